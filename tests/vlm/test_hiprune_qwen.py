"""HiPrune on Qwen as its authors' Qwen2.5-VL code (Danielement321/HiPrune, ``Qwen2_5_VL/qwen2_5_vl_HiPrune.py``;
issue 53 item 2): ``vitrim.vlm.apply(model, "hiprune", ...)`` on a Qwen model runs before the LLM and keeps what an
independent re-implementation of the authors' steps keeps (their eager attention map per block, mean over heads,
sum over queries, mean over the 2×2 patches, un-windowed; round(N · retention) kept, anchors of the object block,
±1 / ±width buffers, registers of the last block minus 1 on the anchored); an image keeps the same alone and in a
padded batch; the LLM sees the kept tokens at their M-RoPE positions."""

from __future__ import annotations

import math

import pytest
import torch

import vitrim.vlm
from tiny_vlms import qwen as tiny_qwen

transformers = pytest.importorskip("transformers")
from transformers.vision_utils import get_vision_window_index  # noqa: E402

GRIDS = [(8, 8), (12, 8), (8, 10)]  # patches: 16, 24, 20 merged tokens


def authors_block_attention(attn: torch.nn.Module, hidden, cu_seqlens, position_embeddings) -> torch.Tensor:
    """(T,) one block's attn_list entry before un-windowing, as their eager ``Qwen2_5_VLVisionAttention`` and their
    vision forward compute it: q, k from ``qkv``, rotary in float, the map masked to each segment with finfo.min,
    softmax, then mean over heads, sum over queries, mean over each group of 4 rows."""
    length = hidden.shape[0]
    q, k, _ = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = (t.unsqueeze(-2).float() for t in position_embeddings)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    q = (q.float() * cos + rotate(q.float()) * sin).to(hidden.dtype)
    k = (k.float() * cos + rotate(k.float()) * sin).to(hidden.dtype)
    mask = torch.full([1, length, length], torch.finfo(q.dtype).min, dtype=q.dtype)
    for i in range(1, len(cu_seqlens)):
        mask[..., cu_seqlens[i - 1] : cu_seqlens[i], cu_seqlens[i - 1] : cu_seqlens[i]] = 0
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    weights = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]) + mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)  # (H, T, T)
    weights = weights.mean(dim=0).sum(dim=0)
    return weights.view(weights.shape[0] // 4, -1).mean(dim=-1)


def authors_keep(model, inputs: dict, retain: float, alpha: float, object_layer: int) -> list[int]:
    """The authors' HiPrune block of their Qwen forward for one image (their code is batch 1)."""
    visual = model.model.visual
    seen: list[tuple] = []
    hooks = [
        block.attn.register_forward_pre_hook(
            lambda m, a, kw: seen.append(
                (m, a[0] if a else kw["hidden_states"], kw["cu_seqlens"], kw["position_embeddings"])
            ),
            with_kwargs=True,
        )
        for block in visual.blocks
    ]
    try:
        with torch.no_grad():
            visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
            attn_list = [authors_block_attention(*entry) for entry in seen]
    finally:
        for hook in hooks:
            hook.remove()
    grid = inputs["image_grid_thw"]
    if hasattr(visual, "fullatt_block_indexes"):  # Qwen2.5: the blocks' rows are in window order
        window_index, _ = get_vision_window_index(
            grid, visual.spatial_merge_size, visual.window_size, visual.patch_size
        )
        reverse = torch.argsort(window_index)
        attn_list = [a[reverse] for a in attn_list]
    shallow, deep = attn_list[object_layer - 1], attn_list[-1].clone()
    n_image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    visual_token_num = round(n_image_tokens * retain)
    shallow_token_num = round((visual_token_num * alpha) / 5)
    shallow_idx = torch.topk(shallow, k=shallow_token_num).indices
    width = int(grid[0][2] / model.config.vision_config.spatial_merge_size)
    shallow_idx = torch.cat([shallow_idx, shallow_idx - 1, shallow_idx + 1, shallow_idx - width, shallow_idx + width])
    shallow_idx = torch.unique(shallow_idx.clamp(0, n_image_tokens - 1), sorted=False)
    available = torch.zeros(n_image_tokens, dtype=torch.bool)
    available.scatter_(0, shallow_idx, 1)
    deep -= available.int()
    deep_idx = torch.topk(deep, k=visual_token_num - shallow_idx.shape[0]).indices
    select = torch.zeros_like(deep, dtype=torch.bool)
    select[torch.cat([shallow_idx, deep_idx])] = True
    return select.nonzero().flatten().tolist()


def image_inputs(grid: tuple[int, int], seed: int) -> dict:
    return tiny_qwen.one(texts=[[1, 5, 6], [7, 8, 9]], grids=[grid], seed=seed)


def vitrim_keep(model, inputs: dict, **options) -> list[list[int]]:
    vitrim.vlm.apply(model, "hiprune", **options)
    try:
        with torch.no_grad():
            model(**inputs)
        return [kept.tolist() for kept in vitrim.vlm.last_selection(model)]
    finally:
        vitrim.vlm.remove(model)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return getattr(tiny_qwen, request.param)(seed=1)


@pytest.mark.parametrize(("retain", "alpha", "object_layer"), [(0.5, 0.6, 1), (0.223, 0.1, 1), (0.75, 0.6, 2)])
def test_hiprune_on_qwen_keeps_what_the_authors_qwen_code_keeps(model, retain, alpha, object_layer) -> None:
    for seed, grid in enumerate(GRIDS):
        inputs = image_inputs(grid, seed)
        expected = authors_keep(model, inputs, retain, alpha, object_layer)
        assert vitrim_keep(model, inputs, keep=retain, alpha=alpha, object_layer=object_layer) == [expected], grid


def test_hiprune_on_qwen_a_padded_batch_keeps_what_each_image_keeps_alone(model) -> None:
    prompts = [([[1, 5, 6], [7, 8, 9]], [GRIDS[0]]), ([[1, 5], [7, 8, 9, 10, 11]], [GRIDS[1]])]
    alone = []
    for seed, (texts, grids) in enumerate(prompts):
        alone += vitrim_keep(
            model, tiny_qwen.one(texts=texts, grids=grids, seed=seed), keep=0.5, alpha=0.6, object_layer=1
        )
    both = tiny_qwen.batch(prompts, side="left")
    both["pixel_values"] = torch.cat(
        [tiny_qwen.one(texts=t, grids=g, seed=s)["pixel_values"] for s, (t, g) in enumerate(prompts)]
    )
    assert vitrim_keep(model, both, keep=0.5, alpha=0.6, object_layer=1) == alone


def test_hiprune_on_qwen_defaults_to_the_authors_object_block_and_checks_it(model) -> None:
    from vitrim.vlm.method.hiprune_qwen import HiPruneBeforeLLM

    assert HiPruneBeforeLLM().options["object_layer"] == 16  # the authors' Qwen2.5-VL script
    with pytest.raises(ValueError, match=r"object_layer=16 is past this tower's 2 blocks; expected 1 … 2"):
        vitrim.vlm.apply(model, "hiprune", keep=0.5)  # the tiny tower has 2 blocks
    with pytest.raises(ValueError, match=r"alpha=2 must be a number in \[0, 1\]"):
        vitrim.vlm.apply(model, "hiprune", keep=0.5, alpha=2)

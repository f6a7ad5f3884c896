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
    attn_list = authors_attn_list(model, inputs)
    grid = inputs["image_grid_thw"]
    n_image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    width = int(grid[0][2] / model.config.vision_config.spatial_merge_size)
    return authors_select(attn_list[object_layer - 1], attn_list[-1].clone(), n_image_tokens, width, retain, alpha)


def authors_attn_list(model, inputs: dict) -> list[torch.Tensor]:
    """Their vision forward's ``attn_list``: per block, (N,) the global attention per merged token, raster order."""
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
    return attn_list


def authors_select(shallow, deep, n_image_tokens: int, width: int, retain: float, alpha: float) -> list[int]:
    """The selection steps of their HiPrune block: shallow, deep (N,) global attention of the two blocks."""
    visual_token_num = round(n_image_tokens * retain)
    shallow_token_num = round((visual_token_num * alpha) / 5)
    shallow_idx = torch.topk(shallow, k=shallow_token_num).indices
    shallow_idx = torch.cat([shallow_idx, shallow_idx - 1, shallow_idx + 1, shallow_idx - width, shallow_idx + width])
    shallow_idx = torch.unique(shallow_idx.clamp(0, n_image_tokens - 1), sorted=False)
    available = torch.zeros(n_image_tokens, dtype=torch.bool)
    available.scatter_(0, shallow_idx, 1)
    deep -= available.int()
    deep_idx = torch.topk(deep, k=visual_token_num - shallow_idx.shape[0]).indices
    select = torch.zeros_like(deep, dtype=torch.bool)
    select[torch.cat([shallow_idx, deep_idx])] = True
    return select.nonzero().flatten().tolist()


def test_hiprune_on_qwen_an_anchored_token_above_1_is_taken_again_as_theirs() -> None:
    """Their registers are the top of the deep attention minus 1 on the anchored tokens: an anchored token whose
    deep score passes 1 plus the others' is taken again, and the image keeps fewer than k (here 6 of 8)."""
    from vitrim.vlm.method.hiprune_qwen import hiprune_qwen_keep

    shallow = torch.zeros(20, dtype=torch.float64)
    shallow[7] = 1.0  # the one anchor (k = 8, alpha = 0.6: round(0.96) = 1), buffers 6, 8, 2, 12 (width 5)
    deep = torch.linspace(0.1, 0.2, 20, dtype=torch.float64)
    deep[[7, 8]] = 3.0  # anchored, and far above 1 + every other token's: the 3 registers are 7, 8 and 19
    expected = authors_select(shallow, deep.clone(), 20, 5, 0.4, 0.6)
    assert len(expected) == 6
    assert hiprune_qwen_keep(shallow, deep, 5, 8, 0.6).tolist() == expected


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
    with pytest.raises(ValueError, match=r"object_layer=16 is past this tower's [23] blocks; expected 1 … [23]"):
        vitrim.vlm.apply(model, "hiprune", keep=0.5)  # the tiny towers have 2 or 3 blocks
    with pytest.raises(ValueError, match=r"alpha=2 must be a number in \[0, 1\]"):
        vitrim.vlm.apply(model, "hiprune", keep=0.5, alpha=2)


def test_hiprune_on_qwen_costs_its_two_blocks_attention_and_keep_tokens() -> None:
    """vitrim vlm flops reads the pre-LLM form's cost on Qwen2.5-VL-7B: the tower whole (no tower cut), the object
    block 16 and the last block full-attention (blocks 15 and 31, 0-based), so 2 · n² · width of q·kᵀ."""
    from vitrim.vlm.flops import QWEN25_VL_7B
    from vitrim.vlm.method.hiprune import HiPrune

    tower = QWEN25_VL_7B.tower
    cost = HiPrune().cost(QWEN25_VL_7B, 128, text_tokens=32)
    assert cost.own == 2 * tower.tokens * tower.tokens * tower.width
    assert cost.llm_cuts == ((0, 128),) and cost.tower_blocks is None
    windowed = HiPrune(object_layer=1).cost(QWEN25_VL_7B, 128, text_tokens=32)  # block 0 attends in windows of 64
    assert windowed.own == tower.tokens * 64 * tower.width + tower.tokens * tower.tokens * tower.width


def test_hiprune_on_qwen_scores_are_the_authors_attn_list(model) -> None:
    """The scores the method ranks (the family's tapped evidence on vitrim's scale, turned to the authors') equal
    their attn_list entries of both blocks, to float32 rounding (their rotary runs in float32, vitrim's in the tower's
    float64 here), on their scale (the minus 1 on the anchored depends on it)."""
    from vitrim.vlm.evidence.global_attention import authors_global_attention
    from vitrim.vlm.method.hiprune_qwen import HiPruneBeforeLLM

    seen = {}
    select = HiPruneBeforeLLM.select

    def spy(self, evidence, keep):
        seen["objects"], seen["deep"] = evidence.object_attention[0], evidence.cls_attention[0]
        return select(self, evidence, keep)

    for seed, grid in enumerate(GRIDS):
        inputs = image_inputs(grid, seed)
        HiPruneBeforeLLM.select = spy
        try:
            vitrim_keep(model, inputs, keep=0.5, alpha=0.6, object_layer=1)
        finally:
            HiPruneBeforeLLM.select = select
        expected = authors_attn_list(model, inputs)
        torch.testing.assert_close(authors_global_attention(seen["objects"]), expected[0], rtol=1e-6, atol=0)
        torch.testing.assert_close(authors_global_attention(seen["deep"]), expected[-1], rtol=1e-6, atol=0)

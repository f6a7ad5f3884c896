"""FlowCut's per-layer selection (vitrim.vlm.method.flowcut) against the authors' encoder loop, ported step for step
in the test on simulated layers: per layer, random attention logits, [CLS]-value logits and values for the image's
original tokens, read on the tokens still there (as a layer computes them on its current input). At batch 1 the two
keep the same patches after every layer; at batch > 1 the authors' count is the batch's largest, vitrim's each
image's own, so an image keeps the same patches alone or in a batch."""

from __future__ import annotations

import pytest
import torch
from tower_reference import authors_flowcut_cut

from vitrim.vlm.method.flowcut import flowcut_count, flowcut_step, remaining_layers

HEADS, DIM = 2, 4


def simulated_layers(layers: int, batch: int, patches: int, seed: int, tied: bool = False) -> list[dict]:
    """Per layer: attention logits (B, H, 1+N, 1+N), [CLS]-value logits (B, H, 1+N), values (B, H, 1+N, hd) of the
    ORIGINAL tokens; ``tied``: values from 2 levels, so many cumulative scores are exactly equal."""
    g = torch.Generator().manual_seed(seed)
    tokens = patches + 1
    out = []
    for _ in range(layers):
        values = torch.randn(batch, HEADS, tokens, DIM, generator=g, dtype=torch.float64)
        if tied:
            values = torch.tensor([1.0, 2.0], dtype=torch.float64)[torch.randint(0, 2, values.shape, generator=g)]
        out.append(
            {
                "attention": 3 * torch.randn(batch, HEADS, tokens, tokens, generator=g, dtype=torch.float64),
                "semantic": torch.randn(batch, HEADS, tokens, generator=g, dtype=torch.float64),
                "values": values,
            }
        )
    return out


def authors_flowcut(layers: list[dict], target_tokens: int) -> list[list[int]]:
    """The authors' CLIPEncoder_forward / CLIPEncoderLayer_forward / compute_score / adaptive_prune_ratio, batched as
    they wrote them, on the simulated layers; ``target_tokens`` counts [CLS] (their ``target``). Returns, per
    image, the original patch indices (0-based, without [CLS]) at the feature layer. topk is stable here."""
    batch, tokens = layers[0]["semantic"].shape[0], layers[0]["semantic"].shape[-1]
    select_layer = len(layers) - 2
    all_keep_indices = torch.arange(tokens).unsqueeze(0).expand(batch, -1)  # [CLS] and patches, original numbers
    current = all_keep_indices.clone()  # the tokens the layer runs on ([CLS] first)
    run: dict = {"scores": None}
    for idx, layer in enumerate(layers):
        rpl = select_layer - idx - 1
        rows = torch.arange(batch)[:, None, None, None]
        heads = torch.arange(HEADS)[None, :, None, None]
        attn_weights = layer["attention"][rows, heads, current[:, None, :, None], current[:, None, None, :]].softmax(-1)
        semantic_attn = layer["semantic"][rows[..., 0], heads[..., 0], current[:, None, :]].softmax(-1).mean(1)
        v_metric = layer["values"][rows, heads, current[:, None, :, None], torch.arange(DIM)].mean(1)  # (B, T, hd)
        if current.shape[1] > target_tokens:
            cls_attention = attn_weights[:, :, 0, 1:].mean(dim=1)
            keep = authors_flowcut_cut(run, rpl, target_tokens, cls_attention, semantic_attn[:, 1:], v_metric[:, 1:])
            if keep is not None:
                current = torch.cat([current[:, :1], torch.gather(current[:, 1:], 1, keep)], dim=1)
    return (current[:, 1:] - 1).tolist()


def vitrim_flowcut(layers: list[dict], image: int, target: int) -> list[int]:
    """vitrim's steps for one image on the same simulated layers; ``target`` in patches."""
    kept = torch.arange(layers[0]["semantic"].shape[-1] - 1)  # original patch indices still there
    cumulative = None
    for idx, layer in enumerate(layers):
        tokens = torch.cat([torch.zeros(1, dtype=torch.long), kept + 1])  # [CLS] and the current patches
        attention = layer["attention"][image][:, tokens][:, :, tokens].softmax(-1)  # (H, T, T)
        semantic = layer["semantic"][image][:, tokens].softmax(-1).mean(0)  # (T,)
        values = layer["values"][image][:, tokens].mean(0)  # (T, hd)
        step = flowcut_step(
            attention[:, 0, 1:].mean(0), semantic[1:], values[1:].abs().sum(-1), cumulative,
            remaining_layers(len(layers), idx), target,
        )  # fmt: skip
        kept, cumulative = kept[step.kept], step.cumulative
    return kept.tolist()


@pytest.mark.parametrize(
    ("layers", "patches", "target", "tied"),
    [(8, 36, 9, False), (12, 64, 16, True), pytest.param(24, 144, 32, False, marks=pytest.mark.full)],
)
def test_at_batch_one_flowcut_keeps_the_authors_patches(layers: int, patches: int, target: int, tied: bool) -> None:
    for seed in range(3):
        simulated = simulated_layers(layers, 1, patches, seed, tied)
        assert vitrim_flowcut(simulated, 0, target) == authors_flowcut(simulated, target + 1)[0]
        assert len(vitrim_flowcut(simulated, 0, target)) == target


def test_an_image_keeps_the_same_patches_alone_or_in_a_batch_where_the_authors_batch_does_not() -> None:
    simulated = simulated_layers(10, 3, 49, seed=7)
    alone = [
        authors_flowcut([{k: v[i : i + 1] for k, v in layer.items()} for layer in simulated], 10)[0] for i in range(3)
    ]
    together = authors_flowcut(simulated, 10)
    assert [vitrim_flowcut(simulated, i, 9) for i in range(3)] == alone
    assert together != alone  # their batch count is the batch's largest prune: other patches on the way
    assert all(len(kept) == 9 for kept in together)


def test_the_count_follows_the_entropy_of_the_cls_row() -> None:
    flat = torch.full((100,), 0.01, dtype=torch.float64)
    peaked = torch.softmax(torch.linspace(0, 12, 100, dtype=torch.float64), 0)
    assert flowcut_count(flat, 4, 20) == 100  # uniform attention: entropy ratio 1, nothing pruned
    assert 20 < flowcut_count(peaked, 4, 20) < 100  # a peaked row prunes part of the way
    assert flowcut_count(peaked, 0, 20) == 20  # the last pruning layer reaches the target

"""Gemma 3's received-attention scores (its SigLIP tower has no [CLS]), checked against transformers' own attention
maps: FasterVLM's choice is the top-k of the attention each pooled token receives at the tower's last layer, from
an eager tower's ``output_attentions`` (vitrim computes its row from the layer's q/k, whatever the attention
implementation), summed over the 2×2 patches the projector pools."""

from __future__ import annotations

import torch

import vitrim.vlm
from tiny_vlms.gemma3 import GRID_TOKENS, pixels, prompt, tiny_gemma3, token_types


def received_by_pooled_token(attentions: torch.Tensor) -> torch.Tensor:
    """(I, H, 64, 64) softmax maps on the 8×8 patch grid -> (I, 16) mean over heads of the attention each 2×2
    pooled token receives (summed over its patches; per patch: the mean over the 64 queries)."""
    per_patch = attentions.mean(2)  # (I, H, 64): mean over queries
    grid = per_patch.reshape(*per_patch.shape[:2], 4, 2, 4, 2)  # (I, H, row, dr, col, dc)
    return grid.sum((3, 5)).reshape(*per_patch.shape[:2], GRID_TOKENS).mean(1)  # (I, 16)


def test_fastervlm_keeps_the_pooled_tokens_that_receive_the_most_attention() -> None:
    model = tiny_gemma3(attn="eager")  # eager: transformers' own attention maps are available to the reference
    ids, pv = prompt(2, 2, images=3)[None], pixels(3, seed=7)
    with torch.no_grad():
        maps = model.model.vision_tower(pixel_values=pv, output_attentions=True).attentions[-1]  # (3, H, 64, 64)
    scores = received_by_pooled_token(maps)
    assert torch.allclose(scores.sum(-1), torch.ones(3, dtype=scores.dtype))  # a distribution per image
    for keep in (1, 5, 11):
        vitrim.vlm.apply(model, "fastervlm", keep=keep)
        model(input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids))
        kept = vitrim.vlm.last_selection(model)
        vitrim.vlm.remove(model)
        for image in range(3):
            expected = torch.sort(scores[image], descending=True, stable=True).indices[:keep].sort().values
            assert torch.equal(kept[image], expected), (keep, image)


def test_patch_to_token_grouping_is_the_projectors_pool_at_gemma_3_4b_size() -> None:
    """Gemma-3-4B (896-px images, 14-px patches, mm_tokens_per_image 256) pools 64×64 patches to 16×16 tokens,
    kernel 4: the patch→token map the scores are summed by is the one torch's average pool uses."""
    from vitrim.vlm.evidence.pooled import pool_to_tokens

    values = torch.randn(2, 64 * 64, 3, dtype=torch.float64)
    grid = values.transpose(1, 2).reshape(2, 3, 64, 64)
    expected = torch.nn.functional.avg_pool2d(grid, 4).flatten(2).transpose(1, 2)  # (2, 256, 3)
    assert torch.allclose(pool_to_tokens(values, 4, "mean"), expected, rtol=0, atol=1e-14)
    assert torch.allclose(pool_to_tokens(values, 4, "sum"), expected * 16, rtol=0, atol=1e-13)

"""The Qwen tower's evidence: received attention, keys and features per merged token, against a hand computation."""

from __future__ import annotations

import pytest
import torch
from qwen_reference import received_by_hand, window_of

from tiny_vlms.qwen import BUILDERS, MERGE, batch
from vitrim.vlm.evidence import attention as evidence_attention
from vitrim.vlm.evidence.merged_tokens import image_evidence
from vitrim.vlm.families.qwen2vl import tower_attention

GRIDS = [(4, 6), (6, 4), (2, 2)]  # 6, 6 and 1 merged tokens; 2.5's 2x2-token windows split the first two unevenly


def tower_run(model: torch.nn.Module, inputs: dict, block_index: int) -> tuple[dict, torch.Tensor, object]:
    """Run the tower; return the scoring block's inputs (as it got them), the last block's output and the pooler."""
    visual = model.model.visual
    seen: dict = {}

    def grab_attn(module, args, kwargs):
        seen["hidden"], seen["cu_seqlens"] = args[0], kwargs["cu_seqlens"]
        seen["rotary"] = kwargs["position_embeddings"]

    def grab_block(module, args, kwargs):
        seen["block_input"] = args[0]

    handles = [
        visual.blocks[block_index].attn.register_forward_pre_hook(grab_attn, with_kwargs=True),
        visual.blocks[block_index].register_forward_pre_hook(grab_block, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            out = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    finally:
        for handle in handles:
            handle.remove()
    return seen, out.last_hidden_state, out.pooler_output


def tower_to_raster(states: torch.Tensor, grids: list[tuple[int, int]], window: int | None) -> list[torch.Tensor]:
    """Per image, the patch rows in processor (raster-block) order; 2.5's window grouping undone by hand."""
    unit = MERGE * MERGE
    out, start = [], 0
    for h, w in grids:
        n_tokens = (h // MERGE) * (w // MERGE)
        rows = states[start : start + n_tokens * unit].reshape(n_tokens, unit, -1)
        if window is not None:  # tower group g holds the g-th token sorted by (window, raster index)
            order = torch.argsort(window_of(h, w, MERGE, window) * n_tokens + torch.arange(n_tokens))
            raster = torch.empty_like(rows)
            raster[order] = rows
            rows = raster
        out.append(rows.reshape(n_tokens * unit, -1))
        start += n_tokens * unit
    return out


@pytest.mark.parametrize(
    ("family", "block_index"),
    [
        ("qwen2_vl", 1),
        pytest.param("qwen2_5_vl", 1, marks=pytest.mark.full),
        ("qwen2_5_vl", 0),
        pytest.param("qwen3_vl", 2, marks=pytest.mark.full),
    ],
)
def test_received_attention_keys_and_features_match_a_hand_computation(
    family: str, block_index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evidence_attention, "QUERY_CHUNK", 5)  # several chunks per image, a ragged last one
    model = BUILDERS[family]()
    inputs = batch([([[1], [2], [3], [4]], GRIDS)])
    visual = model.model.visual
    windowed = family == "qwen2_5_vl"
    window_index = None
    if windowed:
        from transformers.vision_utils import get_vision_window_index

        window_index, _ = get_vision_window_index(
            inputs["image_grid_thw"], MERGE, visual.window_size, visual.patch_size
        )
    seen, last_states, pooler = tower_run(model, inputs, block_index)
    with torch.no_grad():
        attn = visual.blocks[block_index].attn
        capture = tower_attention(attn, seen["hidden"], seen["cu_seqlens"], seen["rotary"])
        evidence = image_evidence(capture, last_states, inputs["image_grid_thw"], MERGE, window_index)

    window = 2 if windowed and block_index not in visual.fullatt_block_indexes else None
    theta = visual.config.rope_parameters["rope_theta"]
    raster_inputs = tower_to_raster(seen["block_input"], GRIDS, 2 if windowed else None)
    offset = 0
    for (h, w), image, block_input in zip(GRIDS, evidence, raster_inputs):
        with torch.no_grad():
            expected, keys = received_by_hand(visual.blocks[block_index], block_input, h, w, MERGE, theta, window)
        n_tokens = expected.shape[1]
        assert image.received.shape == expected.shape
        torch.testing.assert_close(image.received, expected, rtol=0, atol=1e-6)  # the model's rotary is float32
        torch.testing.assert_close(image.keys, keys, rtol=0, atol=1e-15)
        torch.testing.assert_close(image.received.sum(-1), torch.ones(expected.shape[0], dtype=torch.float64))
        # the merger on our features gives the model's own image tokens, in the model's (raster) order
        with torch.no_grad():
            merged = visual.merger(image.features.reshape(n_tokens * MERGE * MERGE, -1))
        torch.testing.assert_close(merged, pooler[offset : offset + n_tokens], rtol=0, atol=1e-15)
        offset += n_tokens

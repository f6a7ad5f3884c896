"""In-LLM methods on Qwen3-VL laid out as its real checkpoints are (``qwen_tiny.qwen3_vl_8b_layout``: DeepStack rows
added after the LLM's layers 0, 1 and 2, FastV's and DART's default drop layer 2 at the last of them).

The reference is written here from the model's definition, with no vitrim code: the unmodified text stack run layer
by layer on the LLM inputs transformers builds (read with a hook on an unmodified forward), every token at its
full-sequence M-RoPE position, each DeepStack row added to its image position after its layer, and from each drop
layer K on no query attending to a dropped key. Dropping must equal it at every kept, non-padding position.
"""

from __future__ import annotations

import pytest
import torch
from test_family_qwen2vl import THREE, dropped_positions, tokens_of

import vitrim.vlm
from tiny_vlms.qwen import batch, qwen3_vl_8b_layout
from vitrim.vlm.api import STATE_ATTRIBUTE

TEMPORAL = 2  # the 8B's temporal patch size


def llm_inputs(model: torch.nn.Module, inputs: dict) -> dict:
    """The keyword arguments transformers hands the text stack in an unmodified forward of ``inputs``."""
    calls: list[dict] = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True
    )
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return calls[0]


def masked_deepstack_reference(model: torch.nn.Module, inputs: dict, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """Logits (B, L, V): the unmodified text stack with DeepStack (Qwen3-VL; none on Qwen2-VL and Qwen2.5-VL), keys
    outside ``kept[K]`` (B, L) masked from layer K on (several K: PyramidDrop's stages)."""
    given = llm_inputs(model, inputs)
    lm = model.model.language_model
    hidden = given["inputs_embeds"]
    positions = given["position_ids"]  # (3, B, L) temporal, height, width (a leading text row only when 4)
    positions = positions[1:] if positions.shape[0] == 4 else positions
    rotary = lm.rotary_emb(hidden, positions)
    length = hidden.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal[None] & inputs["attention_mask"].bool()[:, None, :]  # (B, L, L)
    rows, where = given.get("deepstack_visual_embeds") or [], given.get("visual_pos_masks")  # Qwen3-VL's only
    with torch.no_grad():
        for index, layer in enumerate(lm.layers):
            if index in kept:
                allowed = allowed & kept[index][:, None, :]
            hidden = layer(hidden, attention_mask=allowed[:, None], position_embeddings=rotary, position_ids=None)
            if index < len(rows):  # DeepStack: tap ``index``'s row added to each image position
                hidden = hidden.clone()
                hidden[where] = hidden[where] + rows[index]
        return model.lm_head(lm.norm(hidden))


CASES = {
    "fastv": {},  # the authors' defaults: layer 2, half the tokens
    "dart": {},  # layer 2, 22.2 % kept
    "pdrop": {"layers": (1, 2), "ratios": (0.5, 0.25)},  # stages across two DeepStack layers
}


@pytest.mark.parametrize(
    "name", ["fastv", pytest.param("dart", marks=pytest.mark.full), pytest.param("pdrop", marks=pytest.mark.full)]
)
def test_in_llm_methods_on_the_8b_layout_equal_the_masked_model_with_deepstack(name: str) -> None:
    model = qwen3_vl_8b_layout()
    inputs = batch(THREE, temporal=TEMPORAL)
    assert len(llm_inputs(model, inputs)["deepstack_visual_embeds"]) == 3  # the 8B's layout: three taps
    vitrim.vlm.apply(model, name, **CASES[name])
    with torch.no_grad():
        pruned = model(**inputs).logits  # (B, L, V): the full layout (an early exit at dropped positions)
    drop = getattr(model, STATE_ATTRIBUTE).installation.drop
    stages = drop.stage_selections()
    layers = [stage.layer for stage in drop.stages]
    vitrim.vlm.remove(model)
    assert layers[0] <= 2  # at or before the last layer a DeepStack row is added to
    tokens = tokens_of(inputs)
    kept = {}
    for layer, selection in zip(layers, stages, strict=True):
        assert all(len(k) < n for k, n in zip(selection, tokens, strict=True))  # every image loses tokens
        chosen = [type("Kept", (), {"kept": k})() for k in selection]
        kept[layer] = ~dropped_positions(inputs, chosen, tokens)
    reference = masked_deepstack_reference(model, inputs, kept)
    compared = inputs["attention_mask"].bool() & kept[layers[-1]]
    assert (pruned - reference)[compared].abs().max() <= 1e-12


def test_the_deepstack_reference_is_the_unmodified_model_when_nothing_is_masked() -> None:
    model = qwen3_vl_8b_layout()
    inputs = batch(THREE, temporal=TEMPORAL)
    with torch.no_grad():
        plain = model(**inputs).logits
    reference = masked_deepstack_reference(model, inputs, {})
    real = inputs["attention_mask"].bool()
    assert (plain - reference)[real].abs().max() <= 1e-12


def test_generate_with_the_default_fastv_runs_and_decodes_from_the_prefills_last_position() -> None:
    model = qwen3_vl_8b_layout()
    inputs = batch(THREE, temporal=TEMPORAL)
    vitrim.vlm.apply(model, "fastv")
    with torch.no_grad():
        first = model(**inputs).logits[:, -1].argmax(-1)
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (3, inputs["input_ids"].shape[1] + 3)
    assert torch.equal(out[:, inputs["input_ids"].shape[1]], first)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == [n // 2 for n in tokens_of(inputs)]

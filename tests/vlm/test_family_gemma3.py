"""Gemma 3 with a pre-LLM method: the user's forward and generate() run unchanged, and what reaches the LLM is
exactly the full model with the dropped image keys masked out (original positions, the image block bidirectional
through token_type_ids, the sliding window measured as the unmodified model measures it), at prefill and in
decoding, alone and in padded batches. The tiny LLM's window (8) is shorter than every prompt, so it binds."""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_kw, cache_of

import vitrim.vlm
from tiny_vlms.gemma3 import GRID_TOKENS, IMAGE_TOKEN, batch, pixels, prompt, tiny_gemma3, token_types

TOL = 1e-12  # SDPA in float64


@pytest.fixture(scope="module")
def shared() -> torch.nn.Module:
    return tiny_gemma3()


@pytest.fixture
def model(shared: torch.nn.Module):
    yield shared
    if hasattr(shared, "_vitrim_vlm"):
        vitrim.vlm.remove(shared)


def dropped_mask(ids: torch.Tensor, mask: torch.Tensor, kept: list[torch.Tensor]) -> torch.Tensor:
    """The full model's attention mask with every image token that is not kept masked out (images in reading
    order, GRID_TOKENS each), written independently of vitrim's spans."""
    mask = mask.clone()
    for number, (row, col) in enumerate((ids == IMAGE_TOKEN).nonzero().tolist()):
        image, token = divmod(number, GRID_TOKENS)
        if token not in kept[image].tolist():
            mask[row, col] = 0
    return mask


def original_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as the unmodified model gets them from generate(): cumsum − 1 of the padding mask, 0 at pads."""
    return (mask.cumsum(-1) - 1).clamp(min=0) * mask


def masked_reference(model, ids, pv, mask, kept, steps: int = 0):
    """Logits of the unmodified model with the dropped keys masked out, at its real kept columns (B, L_kept, V) per
    sample, and the logits of ``steps`` greedy decode steps on its full cache (B, steps, V)."""
    masked = dropped_mask(ids, mask, kept)
    positions = original_positions(mask)
    out = model(
        input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids), attention_mask=masked, position_ids=positions
    )
    prefill = [out.logits[row, masked[row].bool()] for row in range(len(ids))]
    decoded, cache, next_position = [], cache_of(out), positions[:, -1:] + 1
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        masked = torch.cat([masked, torch.ones_like(token)], 1)
        step = model(input_ids=token, attention_mask=masked, position_ids=next_position, **cache_kw(cache))
        decoded.append(step.logits[:, -1])
        cache, next_position, token = cache_of(step), next_position + 1, step.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, torch.stack(decoded, 1) if steps else None


@pytest.mark.full
def test_the_image_block_and_the_window_matter_in_the_tiny_model(model: torch.nn.Module) -> None:
    """The checks below could pass by accident if token types or the sliding window changed nothing here."""
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    with_types = model(input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids)).logits
    without = model(input_ids=ids, pixel_values=pv).logits
    assert (with_types - without).abs().max() > 1e-3
    assert ids.shape[1] > 3 * model.config.text_config.sliding_window


def test_keeping_every_token_is_the_unmodified_model_bit_for_bit(model: torch.nn.Module) -> None:
    ids, pv, types = prompt(3, 4, images=2)[None], pixels(2), token_types(prompt(3, 4, images=2)[None])
    reference = model(input_ids=ids, pixel_values=pv, token_type_ids=types).logits
    generated = model.generate(input_ids=ids, pixel_values=pv, token_type_ids=types, max_new_tokens=3, do_sample=False)
    vitrim.vlm.apply(model, "fastervlm", keep=GRID_TOKENS)
    assert torch.equal(model(input_ids=ids, pixel_values=pv, token_type_ids=types).logits, reference)
    again = model.generate(input_ids=ids, pixel_values=pv, token_type_ids=types, max_new_tokens=3, do_sample=False)
    assert torch.equal(again, generated)
    assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [list(range(GRID_TOKENS))] * 2
    vitrim.vlm.remove(model)
    assert torch.equal(model(input_ids=ids, pixel_values=pv, token_type_ids=types).logits, reference)


@pytest.mark.parametrize(
    "method",
    [
        "random",
        "fastervlm",
        pytest.param("vispruner", marks=pytest.mark.full),
        pytest.param("divprune", marks=pytest.mark.full),
    ],
)
def test_dropping_equals_the_full_model_with_those_keys_masked(model: torch.nn.Module, method: str) -> None:
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    mask = torch.ones_like(ids)
    vitrim.vlm.apply(model, method, keep=5, positions="original")
    out = model(input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids))
    kept = vitrim.vlm.last_selection(model)
    assert all(len(k) == 5 and torch.equal(k, k.sort().values) for k in kept)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    step = model(
        input_ids=token, attention_mask=torch.ones(1, ids.shape[1] + 1, dtype=torch.long), **cache_kw(cache_of(out))
    )
    vitrim.vlm.remove(model)
    prefill, decoded = masked_reference(model, ids, pv, mask, kept, steps=1)
    assert out.logits.shape[1] == ids.shape[1] - 2 * (GRID_TOKENS - 5)
    assert (out.logits[0] - prefill[0]).abs().max() <= TOL
    assert (step.logits[:, -1] - decoded[:, 0]).abs().max() <= TOL


def test_the_window_counts_original_distance_not_kept_tokens(model: torch.nn.Module) -> None:
    """Running transformers on the kept tokens alone (token types sliced, original positions) measures the sliding
    window in kept tokens and gives other logits: vitrim's are the masked full model's, not those."""
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    vitrim.vlm.apply(model, "random", keep=4, seed=1)
    pruned = model(input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids)).logits
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    stays = dropped_mask(ids, torch.ones_like(ids), kept)[0].bool()
    short_ids = ids[:, stays]
    image = model.model.get_image_features(pv).pooler_output  # (2, N, D)
    embeds = model.model.get_input_embeddings()(short_ids.clamp(max=98))
    chosen = torch.cat([image[i, k] for i, k in enumerate(kept)])
    embeds[short_ids == IMAGE_TOKEN] = chosen
    naive = model(  # an explicit mask: gapped positions without one read as packed sequences
        inputs_embeds=embeds,
        token_type_ids=token_types(short_ids),
        attention_mask=torch.ones_like(short_ids),
        position_ids=torch.arange(ids.shape[1])[None, stays],
    ).logits
    assert (naive - pruned).abs().max() > 1e-6


def test_visionzip_merges_into_kept_slots(model: torch.nn.Module) -> None:
    """VisionZip's contextual token is its target's pooled state + the mean of its members' (the authors' merge, on
    the pooled states the projector's norm reads), put through the projector's norm and matmul, in the target's
    slot: the full model fed those embeddings with the other image keys masked."""
    ids, pv = prompt(2, 3, images=1)[None], pixels(1)
    types = token_types(ids)
    vitrim.vlm.apply(model, "visionzip", dominant=3, contextual=2, positions="original")
    out = model(input_ids=ids, pixel_values=pv, token_type_ids=types).logits
    kept = vitrim.vlm.last_selection(model)
    groups = vitrim.vlm.last_selection(model, groups=True)[0]
    vitrim.vlm.remove(model)
    assert len(groups) == 5 and any(len(g) > 1 for g in groups)
    assert sorted(torch.cat(groups).tolist()) == list(range(GRID_TOKENS))  # every token stands somewhere
    with torch.no_grad():
        projector = model.model.multi_modal_projector
        states = model.model.vision_tower(pixel_values=pv).last_hidden_state  # (1, 64, C): the 8×8 patch grid
        pooled = states.reshape(4, 2, 4, 2, -1).permute(0, 2, 1, 3, 4).reshape(GRID_TOKENS, 4, -1).mean(1)  # (16, C)
        own = projector(states)[0]  # (16, D) the model's own tokens: a slot standing for itself keeps its own
        tokens = torch.stack(
            [
                projector.mm_soft_emb_norm(pooled[t] + pooled[g[g != t]].mean(0)) @ projector.mm_input_projection_weight
                if len(g) > 1
                else own[t]
                for t, g in zip(kept[0], groups, strict=True)
            ]
        )  # (5, D)
        embeds = model.model.get_input_embeddings()(ids).clone()
        image_columns = (ids[0] == IMAGE_TOKEN).nonzero()[:, 0]
        embeds[0, image_columns[kept[0]]] = tokens
        masked = dropped_mask(ids, torch.ones_like(ids), kept)
        reference = model(
            inputs_embeds=embeds,
            token_type_ids=types,
            attention_mask=masked,
            position_ids=torch.arange(ids.shape[1])[None],
        ).logits
    assert (out[0] - reference[0, masked[0].bool()]).abs().max() <= TOL


def test_kept_tokens_keep_the_projectors_own_output(model: torch.nn.Module) -> None:
    """VisionZip with no contextual token merges nothing: its tokens are the projector's own (not re-projected,
    whose norm rounds through float32), so the pruned model equals the unmodified one with the dropped keys masked
    to 1e-12 in float64 (issue 45: a re-projection was 4e-7 off)."""
    ids, pv = prompt(2, 3, images=1)[None], pixels(1)
    types = token_types(ids)
    vitrim.vlm.apply(model, "visionzip", dominant=5, contextual=0, positions="original")
    out = model(input_ids=ids, pixel_values=pv, token_type_ids=types).logits
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    with torch.no_grad():
        masked = dropped_mask(ids, torch.ones_like(ids), kept)
        reference = model(
            input_ids=ids, pixel_values=pv, token_type_ids=types, attention_mask=masked,
            position_ids=torch.arange(ids.shape[1])[None],
        ).logits  # fmt: skip
    assert (out[0] - reference[0, masked[0].bool()]).abs().max() <= TOL


@pytest.mark.parametrize(
    ("method", "side"),
    [
        ("random", "left"),
        pytest.param("fastervlm", "right", marks=pytest.mark.full),
        pytest.param("divprune", "left", marks=pytest.mark.full),
    ],
)
def test_each_sample_of_a_padded_batch_equals_that_sample_alone(model: torch.nn.Module, method: str, side: str) -> None:
    prompts = [prompt(3, 4, seed=0), prompt(7, 1, seed=1), prompt(1, 9, seed=2)]
    images = pixels(3, seed=5)
    ids, mask = batch(prompts, side)
    vitrim.vlm.apply(model, method, keep=6)
    together = model(
        input_ids=ids,
        pixel_values=images,
        token_type_ids=token_types(ids),
        attention_mask=mask,
        position_ids=original_positions(mask),
    ).logits
    kept_together = vitrim.vlm.last_selection(model)
    for row, alone_ids in enumerate(prompts):
        alone = model(
            input_ids=alone_ids[None], pixel_values=images[row : row + 1], token_type_ids=token_types(alone_ids[None])
        ).logits[0]
        assert torch.equal(vitrim.vlm.last_selection(model)[0], kept_together[row])
        length = alone.shape[0]
        mine = together[row, -length:] if side == "left" else together[row, :length]
        assert (mine - alone).abs().max() <= TOL


def test_generate_after_apply_is_the_masked_model_decoding_greedily(model: torch.nn.Module) -> None:
    """generate() (images encoded first and passed as mm_encoder_outputs, a padded batch) picks the tokens the
    masked full model picks, step by step on its full cache."""
    prompts = [prompt(3, 4, images=2, seed=0), prompt(6, 2, images=1, seed=1)]
    (ids, mask), images = batch(prompts, "left"), pixels(3, seed=2)
    vitrim.vlm.apply(model, "vispruner", keep=5, positions="original")
    generated = model.generate(
        input_ids=ids,
        pixel_values=images,
        token_type_ids=token_types(ids),
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
    )[:, ids.shape[1] :]
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    prefill, decoded = masked_reference(model, ids, images, mask, kept, steps=2)
    picks = torch.cat([torch.stack([p[-1] for p in prefill])[:, None], decoded], 1).argmax(-1)  # (B, 3)
    assert torch.equal(generated, picks)


def test_keep_larger_than_the_pooled_grid_is_refused_at_apply(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="17"):
        vitrim.vlm.apply(model, "random", keep=GRID_TOKENS + 1)
    assert not hasattr(model, "_vitrim_vlm")


@pytest.mark.full
def test_without_token_types_dropping_equals_the_causal_model_with_those_keys_masked(model: torch.nn.Module) -> None:
    """A caller who passes no token_type_ids gets Gemma 3's causal masks (no image block); the same holds there."""
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    vitrim.vlm.apply(model, "random", keep=5, seed=3, positions="original")
    out = model(input_ids=ids, pixel_values=pv)
    kept = vitrim.vlm.last_selection(model)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    step = model(input_ids=token, **cache_kw(cache_of(out)))  # no mask at all: vitrim supplies the cache's layout
    vitrim.vlm.remove(model)
    masked = dropped_mask(ids, torch.ones_like(ids), kept)
    positions = torch.arange(ids.shape[1])[None]
    reference = model(input_ids=ids, pixel_values=pv, attention_mask=masked, position_ids=positions)
    decoded = model(
        input_ids=token,
        attention_mask=torch.cat([masked, torch.ones_like(token)], 1),
        position_ids=positions[:, -1:] + 1,
        **cache_kw(cache_of(reference)),
    )
    assert (out.logits[0] - reference.logits[0, masked[0].bool()]).abs().max() <= TOL
    assert (step.logits - decoded.logits).abs().max() <= TOL


@pytest.mark.full
def test_eager_attention_gets_additive_masks_and_the_same_result() -> None:
    """On eager attention the masks are additive floats; Gemma 3's eager softmax runs in float32, hence 1e-5."""
    model = tiny_gemma3(attn="eager")
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    vitrim.vlm.apply(model, "random", keep=5, seed=4, positions="original")
    out = model(input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids))
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    step = model(
        input_ids=token, attention_mask=torch.ones(1, ids.shape[1] + 1, dtype=torch.long), **cache_kw(cache_of(out))
    )
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    prefill, decoded = masked_reference(model, ids, pv, torch.ones_like(ids), kept, steps=1)
    assert (out.logits[0] - prefill[0]).abs().max() <= 1e-5
    assert (step.logits[:, -1] - decoded[:, 0]).abs().max() <= 1e-5


def test_a_static_cache_is_refused_not_left_unpruned(model: torch.nn.Module) -> None:
    """generate() prepares 4-D masks for a static cache before the model runs; vitrim cannot prune them exactly."""
    ids, pv = prompt(2, 2)[None], pixels(1)
    vitrim.vlm.apply(model, "random", keep=4)
    with pytest.raises(ValueError, match="static or compiled cache"):
        model.generate(
            input_ids=ids,
            pixel_values=pv,
            token_type_ids=token_types(ids),
            max_new_tokens=2,
            do_sample=False,
            cache_implementation="static",
        )

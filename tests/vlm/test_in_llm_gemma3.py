"""The in-LLM methods (fastv, dart, pdrop) on Gemma 3, whose LLM interleaves sliding-window and full-attention
layers and whose image block is bidirectional through ``token_type_ids``: dropping from layer K on equals the
unmodified layers with those keys masked out (``gemma3_llm_reference``, masks written from their definition), at
the prefill and at decode steps on the pruned cache (sliding-window cache layers included), keep=all is the
unmodified model bit for bit, each sample of a padded batch gets what it gets alone, and each method keeps what an
independent re-implementation of its authors' selection keeps. The tiny LLM's window (8) is shorter than every
prompt here, and the drop layers are chosen so that both kinds of layer run on the kept tokens."""

from __future__ import annotations

import pytest
import torch
from gemma3_llm_reference import greedy_reference, image_runs, kept_columns, llm_embeddings, masked_gemma3
from hf_cache import cache_kw, cache_of
from llm_reference import dart_reference, top_k_reference

import vitrim.vlm
from tiny_vlms.gemma3 import (
    GRID_TOKENS,
    IMAGE_TOKEN,
    REAL_PATTERN,
    WINDOW,
    batch,
    pixels,
    prompt,
    tiny_gemma3,
    token_types,
)

TOL = 1e-12  # SDPA in float64
FULL = pytest.mark.full
APPLIED = {
    "fastv": {"layer": 2, "keep": 5},  # reads layer 1 (full); layers 2 (sliding) and 3 (full) run on the kept tokens
    "dart": {"layer": 1, "keep": 6, "pivot_image_token": 2, "pivot_text_token": 2},  # keys of layer 0 (sliding)
    "pdrop": {"layers": (1, 2, 3), "ratios": (0.5, 0.25, 0.125)},  # a full, a sliding and a full drop layer
}
# three prompts of different lengths, the first with two images: the samples keep different counts (re-padded)
PROMPTS = [prompt(3, 4, images=2, seed=0), prompt(6, 2, seed=1), prompt(1, 5, seed=2)]


@pytest.fixture(scope="module")
def shared() -> torch.nn.Module:
    return tiny_gemma3()


@pytest.fixture
def model(shared: torch.nn.Module):
    yield shared
    if hasattr(shared, "_vitrim_vlm"):
        vitrim.vlm.remove(shared)


def original_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as the unmodified model gets them for a left-padded batch: cumsum − 1 of the mask, 0 at pads."""
    return (mask.cumsum(-1) - 1).clamp(min=0) * mask


def _inputs(side: str = "left") -> dict[str, torch.Tensor]:
    ids, mask = batch(PROMPTS, side)
    return {"input_ids": ids, "pixel_values": pixels(4, seed=3), "token_type_ids": token_types(ids),
            "attention_mask": mask, "position_ids": original_positions(mask)}  # fmt: skip


def _stage_drops(model, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{K: (B, L) kept columns from layer K on} of the last prefill, per drop stage."""
    drop = model._vitrim_vlm.installation.drop
    stages = drop.stage_selections()
    return {stage.layer: kept_columns(input_ids, kept) for stage, kept in zip(drop.stages, stages, strict=True)}


def test_the_reference_is_the_unmodified_model_and_its_window_and_image_block_matter(model) -> None:
    """The masks written in the reference are Gemma 3's (no drop: its logits), and dropping the window or the image
    block from them changes the logits, so the checks below see both."""
    inputs = _inputs()
    ids, mask, positions = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
    unmodified = model(**inputs).logits
    embeds = llm_embeddings(model, ids, inputs["pixel_values"])
    runs = image_runs(ids)
    reference = masked_gemma3(model, embeds, runs, mask, positions, {})
    real = mask.bool()
    assert (reference - unmodified)[real].abs().max() <= TOL
    no_block = masked_gemma3(model, embeds, torch.full_like(runs, -1), mask, positions, {})
    assert (no_block - unmodified)[real].abs().max() > 1e-6
    config = model.model.language_model.config
    config.sliding_window = 10 * ids.shape[1]
    try:
        no_window = masked_gemma3(model, embeds, runs, mask, positions, {})
    finally:
        config.sliding_window = WINDOW
    assert (no_window - unmodified)[real].abs().max() > 1e-6


@pytest.mark.parametrize("name", ["fastv", pytest.param("dart", marks=FULL), "pdrop"])
def test_dropping_equals_the_masked_model_at_the_prefill_and_a_decode_step(model, name: str) -> None:
    inputs = _inputs()
    ids, mask, positions = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
    vitrim.vlm.apply(model, name, **APPLIED[name])
    out = model(**inputs)
    drops = _stage_drops(model, ids)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    longer = torch.cat([mask, torch.ones_like(token)], 1)
    step = model(input_ids=token, attention_mask=longer, position_ids=positions[:, -1:] + 1, **cache_kw(cache_of(out)))
    cache = cache_of(out)
    vitrim.vlm.remove(model)
    assert all(int((~keep & (ids == IMAGE_TOKEN)).sum()) > 0 for keep in drops.values())  # every stage drops
    # the pruned cache: layers from the first drop on hold the kept tokens only; sliding layers their window of them
    first = min(drops)
    for index, layer in enumerate(cache.layers):
        held = layer.keys.shape[2]
        kept = ids.shape[1] + 1 if index < first else int(drops[max(k for k in drops if k <= index)].sum(1).max()) + 1
        assert held == (min(kept, WINDOW - 1) if layer.is_sliding else kept)

    reference_cache = __import__("transformers").DynamicCache()
    embeds = llm_embeddings(model, ids, inputs["pixel_values"])
    reference = masked_gemma3(model, embeds, image_runs(ids), mask, positions, drops, reference_cache)
    kept_real = mask.bool() & drops[max(drops)]
    assert (out.logits - reference)[kept_real].abs().max() <= TOL
    runs = torch.cat([image_runs(ids), -torch.ones_like(token)], 1)
    grown = {layer: torch.cat([keep, torch.ones_like(token, dtype=torch.bool)], 1) for layer, keep in drops.items()}
    step_embeds = model.model.get_input_embeddings()(token)
    reference_step = masked_gemma3(model, step_embeds, runs, longer, positions[:, -1:] + 1, grown, reference_cache,
                                   past=ids.shape[1])  # fmt: skip
    assert (step.logits - reference_step).abs().max() <= TOL


def test_without_token_types_dropping_equals_the_causal_model_with_those_keys_masked(model) -> None:
    """A caller who passes no token_type_ids and no mask gets Gemma 3's causal masks (no image block; transformers
    may leave the full layers' mask to SDPA's own causal one): the same holds there, prefill and decode."""
    ids, pixel_values = PROMPTS[0][None], _inputs()["pixel_values"][:2]
    vitrim.vlm.apply(model, "pdrop", layers=(1, 2), ratios=(0.5, 0.25))
    out = model(input_ids=ids, pixel_values=pixel_values)
    drops = _stage_drops(model, ids)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    step = model(input_ids=token, **cache_kw(cache_of(out)))  # no mask, no positions: the model's own
    vitrim.vlm.remove(model)
    cache, ones = __import__("transformers").DynamicCache(), torch.ones_like(ids)
    no_runs = torch.full_like(ids, -1)
    positions = torch.arange(ids.shape[1])[None]
    embeds = llm_embeddings(model, ids, pixel_values)
    reference = masked_gemma3(model, embeds, no_runs, ones, positions, drops, cache)
    assert (out.logits - reference)[drops[2]].abs().max() <= TOL
    grown = {layer: torch.cat([keep, torch.ones_like(token, dtype=torch.bool)], 1) for layer, keep in drops.items()}
    step_embeds, step_runs = model.model.get_input_embeddings()(token), torch.cat([no_runs, -ones[:, :1]], 1)
    reference_step = masked_gemma3(model, step_embeds, step_runs, torch.cat([ones, ones[:, :1]], 1),
                                   positions[:, -1:] + 1, grown, cache, past=ids.shape[1])  # fmt: skip
    assert (step.logits - reference_step).abs().max() <= TOL


@FULL
def test_eager_attention_drops_like_the_masked_eager_model() -> None:
    """Eager attention gets additive masks; Gemma 3's eager softmax runs in float32, hence 1e-5 (one sample: eager
    float64 turns fully padded rows into NaN)."""
    eager = tiny_gemma3(attn="eager")
    ids, pixel_values = PROMPTS[0][None], _inputs()["pixel_values"][:2]
    types = token_types(ids)
    vitrim.vlm.apply(eager, "fastv", **APPLIED["fastv"])
    out = eager(input_ids=ids, pixel_values=pixel_values, token_type_ids=types)
    drops = _stage_drops(eager, ids)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    step = eager(input_ids=token, **cache_kw(cache_of(out)))
    vitrim.vlm.remove(eager)
    picked, reference = greedy_reference(eager, ids, pixel_values, torch.ones_like(ids),
                                         torch.arange(ids.shape[1])[None], drops, steps=2)  # fmt: skip
    assert (out.logits - reference)[drops[2]].abs().max() <= 1e-5
    assert torch.equal(step.logits[:, -1].argmax(-1), picked[:, 1])


@pytest.mark.parametrize("name", ["fastv", "pdrop"])
def test_keeping_every_token_is_the_unmodified_model_bit_for_bit(model, name: str) -> None:
    inputs = _inputs()
    plain = model(**inputs).logits
    generate_inputs = {key: value for key, value in inputs.items() if key != "position_ids"}
    plain_generated = model.generate(**generate_inputs, max_new_tokens=3, do_sample=False)
    options = {"layer": 1, "keep": GRID_TOKENS} if name == "fastv" else {"layers": (1, 2), "ratios": (1.0, 1.0)}
    vitrim.vlm.apply(model, name, **options)
    assert torch.equal(model(**inputs).logits, plain)
    assert torch.equal(model.generate(**generate_inputs, max_new_tokens=3, do_sample=False), plain_generated)
    assert [kept.tolist() for kept in vitrim.vlm.last_selection(model)] == [list(range(GRID_TOKENS))] * 4


@pytest.mark.parametrize(
    ("name", "side"),
    [("dart", "left"), pytest.param("fastv", "right", marks=FULL), pytest.param("pdrop", "left", marks=FULL)],
)
def test_each_sample_of_a_padded_batch_equals_that_sample_alone(model, name: str, side: str) -> None:
    inputs = _inputs(side)
    mask = inputs["attention_mask"]
    vitrim.vlm.apply(model, name, **APPLIED[name])
    together = model(**inputs)
    kept_together = vitrim.vlm.last_selection(model)
    token = together.logits[:, -1].argmax(-1, keepdim=True) if side == "left" else None
    if token is not None:
        longer = torch.cat([mask, torch.ones_like(token)], 1)
        position = inputs["position_ids"][:, -1:] + 1
        step = model(
            input_ids=token, attention_mask=longer, position_ids=position, **cache_kw(cache_of(together))
        ).logits
    image = 0
    for row, alone_ids in enumerate(PROMPTS):
        images = int((alone_ids == IMAGE_TOKEN).sum()) // GRID_TOKENS
        alone_pixels = inputs["pixel_values"][image : image + images]
        alone = model(input_ids=alone_ids[None], pixel_values=alone_pixels, token_type_ids=token_types(alone_ids[None]))
        assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [
            k.tolist() for k in kept_together[image : image + images]
        ]
        image += images
        length = len(alone_ids)
        mine = together.logits[row, -length:] if side == "left" else together.logits[row, :length]
        kept_real = kept_columns(alone_ids[None], vitrim.vlm.last_selection(model))[0]
        assert (mine - alone.logits[0])[kept_real].abs().max() <= TOL
        if token is not None:
            alone_step = model(input_ids=token[row : row + 1], **cache_kw(cache_of(alone)),
                               attention_mask=torch.ones(1, length + 1, dtype=torch.long)).logits  # fmt: skip
            assert (step[row] - alone_step[0]).abs().max() <= TOL


@pytest.mark.parametrize("name", ["fastv", pytest.param("dart", marks=FULL), pytest.param("pdrop", marks=FULL)])
def test_generate_is_the_masked_model_decoding_greedily(model, name: str) -> None:
    """generate() (images encoded first, a left-padded batch, its own position ids) picks the tokens the masked
    reference picks, step by step on its full cache."""
    inputs = {key: value for key, value in _inputs().items() if key != "position_ids"}
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions: list[torch.Tensor] = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(kwargs["position_ids"]), with_kwargs=True
    )
    vitrim.vlm.apply(model, name, **APPLIED[name])
    try:
        generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)[:, ids.shape[1] :]
        drops = _stage_drops(model, ids)
    finally:
        handle.remove()
    vitrim.vlm.remove(model)
    prefill_positions = positions[0].expand(len(ids), -1)
    assert all(torch.equal(later, prefill_positions[:, -1:] + step) for step, later in enumerate(positions[1:], 1))
    picked, _ = greedy_reference(model, ids, inputs["pixel_values"], mask, prefill_positions, drops, steps=4)
    assert torch.equal(generated, picked)


@FULL
def test_beam_search_reorders_every_layers_pruned_cache(model) -> None:
    """Beams of one prompt keep the same tokens, so reordering the pruned caches (full and sliding-window layers)
    keeps them consistent: keep=all is the unmodified beam search, and a pruned one runs to the end."""
    inputs = {key: value for key, value in _inputs().items() if key != "position_ids"}
    plain = model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2)
    vitrim.vlm.apply(model, "fastv", layer=2, keep=GRID_TOKENS)
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2), plain)
    vitrim.vlm.remove(model)
    vitrim.vlm.apply(model, "fastv", **APPLIED["fastv"])
    pruned = model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=2)
    selection = vitrim.vlm.last_selection(model)
    assert pruned.shape == plain.shape
    # rows (prompt 0, prompt 0, prompt 1, prompt 1, ...): images in reading order are prompt 0's two, again, then
    # prompt 1's once per beam, then prompt 2's; a beam keeps what the other beam of its prompt keeps
    beams = [selection[0:2], selection[2:4], selection[4:5], selection[5:6], selection[6:7], selection[7:8]]
    for first, second in (beams[0:2], beams[2:4], beams[4:6]):
        assert [k.tolist() for k in first] == [k.tolist() for k in second]


def _eager_attention_rows(eager, alone_ids, alone_pixels, layer: int, drops=None) -> torch.Tensor:
    """(L,) heads-averaged attention of the last token at ``layer`` of the eager twin, transformers' own weights
    (``output_attentions``) or, with ``drops``, the weights the reference's layer returns with those keys masked."""
    types = token_types(alone_ids[None])
    if drops is None:
        attentions = eager(input_ids=alone_ids[None], pixel_values=alone_pixels, token_type_ids=types,
                           output_attentions=True).attentions  # fmt: skip
        return attentions[layer][0, :, -1].mean(0)
    weights = {}
    handle = eager.model.language_model.layers[layer].self_attn.register_forward_hook(
        lambda module, args, output: weights.__setitem__("w", output[1])
    )
    embeds = llm_embeddings(eager, alone_ids[None], alone_pixels)
    ones = torch.ones(1, len(alone_ids), dtype=torch.long)
    masked_gemma3(eager, embeds, image_runs(alone_ids[None]), ones, torch.arange(len(alone_ids))[None], drops)
    handle.remove()
    return weights["w"][0, :, -1].mean(0)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("fastv", {"layer": 1, "keep": 5}),  # layer 0 is sliding: the last token sees part of the image only
        pytest.param("fastv", {"layer": 2, "keep": 3}, marks=FULL),  # layer 1 is full
        ("pdrop", {"layers": (1, 2), "ratios": (0.5, 0.25)}),
        pytest.param("pdrop", {"layers": (2, 3), "ratios": (0.75, 0.375)}, marks=FULL),
    ],
)
def test_attention_methods_keep_what_the_authors_selection_keeps(model, method: str, options: dict) -> None:
    """FastV: top-k of the last token's attention at layer K−1; PyramidDrop: at each drop layer itself, on the
    tokens still there. The rows come from an eager twin (same weights): transformers' own attention weights, with
    the window and the image block (zero outside the window: those ties go to the earlier token)."""
    vitrim.vlm.apply(model, method, **options)
    model(**_inputs())
    stages = model._vitrim_vlm.installation.drop.stage_selections()
    vitrim.vlm.remove(model)
    eager = tiny_gemma3(attn="eager")
    layers = (options["layer"],) if method == "fastv" else options["layers"]
    counts = [options["keep"]] if method == "fastv" else [int(GRID_TOKENS * r) for r in options["ratios"]]
    pixel_values, image, outside_window = _inputs()["pixel_values"], 0, False
    for alone_ids in PROMPTS:
        columns = (alone_ids == IMAGE_TOKEN).nonzero().flatten().view(-1, GRID_TOKENS)  # (images, N)
        still = [torch.arange(GRID_TOKENS) for _ in columns]
        alone_pixels = pixel_values[image : image + len(columns)]
        drops: dict[int, torch.Tensor] = {}
        for stage, (layer, count) in enumerate(zip(layers, counts, strict=True)):
            read = layer - 1 if method == "fastv" else layer
            row = _eager_attention_rows(eager, alone_ids, alone_pixels, read, None if method == "fastv" else drops)
            for number, image_columns in enumerate(columns):
                scores = row[image_columns][still[number]]
                outside_window |= bool((scores == 0).any())
                still[number] = still[number][top_k_reference(scores, count)]
                assert stages[stage][image + number].tolist() == still[number].tolist()
            drops[layer] = kept_columns(alone_ids[None], still)
        image += len(columns)
    if layers[0] == 1 and method == "fastv":
        assert outside_window  # the sliding window hid image tokens from the last token: the case is exercised


@pytest.mark.parametrize(("layer", "keep", "pivots"), [(1, 6, (2, 2)), pytest.param(2, 5, (4, 4), marks=FULL)])
def test_dart_keeps_key_norm_pivots_and_the_tokens_least_duplicated_with_them(model, layer, keep, pivots) -> None:
    """Keys of layer K−1 read from a full (not sliding-window) cache of the unmodified model; states: layer K's input
    through the final norm; the selection: ``llm_reference.dart_reference``."""
    options = {"layer": layer, "keep": keep, "pivot_image_token": pivots[0], "pivot_text_token": pivots[1]}
    vitrim.vlm.apply(model, "dart", **options)
    model(**_inputs())
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    pixel_values, image = _inputs()["pixel_values"], 0
    inputs_of_k: dict[str, torch.Tensor] = {}
    handle = model.model.language_model.layers[layer].register_forward_pre_hook(
        lambda module, args, kwargs: inputs_of_k.__setitem__("h", args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    for alone_ids in PROMPTS:
        columns = (alone_ids == IMAGE_TOKEN).nonzero().flatten().view(-1, GRID_TOKENS)
        alone_pixels = pixel_values[image : image + len(columns)]
        cache = __import__("transformers").DynamicCache()
        with torch.no_grad():
            model(input_ids=alone_ids[None], pixel_values=alone_pixels, token_type_ids=token_types(alone_ids[None]),
                  **cache_kw(cache))  # fmt: skip
        norms = cache.layers[layer - 1].keys[0].transpose(0, 1).flatten(1).abs().sum(-1)  # (L,) L1 over heads·hd
        states = model.model.language_model.norm(inputs_of_k["h"])[0].detach()  # (L, D)
        for image_columns in columns:
            after = torch.arange(int(image_columns.max()) + 1, len(alone_ids))
            text = after[alone_ids[after] != IMAGE_TOKEN]  # the text tokens after the image (not a later image)
            expected = dart_reference(norms[image_columns], norms[text], states[image_columns], states[text], keep,
                                      *pivots, positions=(image_columns, text))  # fmt: skip
            assert kept[image].tolist() == expected
            image += 1
    handle.remove()


@pytest.mark.parametrize(
    ("method", "options", "message"),
    [
        ("fastv", {"layer": 4}, r"drop layer 4 \(layer= / layers=\) is outside the LLM"),
        ("fastv", {"layer": 0}, "drop layer 0"),
        ("dart", {"layer": 1, "keep": GRID_TOKENS + 1}, "keep=17 is more than the image's 16 tokens"),
        ("pdrop", {}, r"drop layer 8 \(layer= / layers=\) is outside the LLM"),
        ("fastv", {"layer": 1, "keep": 0}, "keep=0 must be at least 1"),
        ("pdrop", {"layers": (1, 4), "ratios": (0.5, 0.25)}, r"drop layer 4 \(layer= / layers=\) is outside the LLM"),
        ("dart", {"layer": 1, "ratio": 0.5}, "unknown option 'ratio' for vlm method 'dart'"),
    ],
)
def test_bad_options_are_refused_at_apply_and_leave_the_model_as_it_was(model, method, options, message) -> None:
    ids, pixel_values = PROMPTS[1][None], _inputs()["pixel_values"][2:3]
    before = model(input_ids=ids, pixel_values=pixel_values, token_type_ids=token_types(ids)).logits
    with pytest.raises(ValueError, match=message):
        vitrim.vlm.apply(model, method, **options)
    assert not hasattr(model, "_vitrim_vlm")
    assert torch.equal(model(input_ids=ids, pixel_values=pixel_values, token_type_ids=token_types(ids)).logits, before)
    vitrim_hooks = [
        hook
        for module in model.modules()
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
        if getattr(hook, "__module__", "").startswith("vitrim")
    ]
    assert not vitrim_hooks


def test_a_static_cache_is_refused_not_left_unpruned(model) -> None:
    """generate() builds the masks of a static cache before the model runs; the in-LLM drop needs the 2-D mask."""
    inputs = {key: value for key, value in _inputs().items() if key != "position_ids"}
    vitrim.vlm.apply(model, "fastv", **APPLIED["fastv"])
    with pytest.raises(ValueError, match="static or compiled cache"):
        model.generate(**inputs, max_new_tokens=2, do_sample=False, cache_implementation="static")


@pytest.mark.parametrize(
    ("name", "options"),
    [("fastv", {}), pytest.param("pdrop", {"layers": (2, 5), "ratios": (0.5, 0.25)}, marks=FULL)],
)
def test_the_checkpoints_five_sliding_to_one_full_layers_drop_like_the_masked_model(name: str, options: dict) -> None:
    """Gemma 3's checkpoints run five sliding-window layers per full one (the tiny model alternates them): FastV at
    its default layer 2 and PyramidDrop across both kinds equal the masked reference there too."""
    model = tiny_gemma3(layer_types=REAL_PATTERN)
    inputs = _inputs()
    ids, mask, positions = inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"]
    vitrim.vlm.apply(model, name, **options)
    out = model(**inputs)
    drops = _stage_drops(model, ids)
    vitrim.vlm.remove(model)
    embeds = llm_embeddings(model, ids, inputs["pixel_values"])
    reference = masked_gemma3(model, embeds, image_runs(ids), mask, positions, drops)
    kept_real = mask.bool() & drops[max(drops)]
    assert all(int((~keep & (ids == IMAGE_TOKEN)).sum()) > 0 for keep in drops.values())
    assert (out.logits - reference)[kept_real].abs().max() <= TOL

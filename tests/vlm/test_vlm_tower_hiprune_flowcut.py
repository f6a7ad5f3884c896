"""HiPrune and FlowCut in LLaVA's own CLIP tower (vitrim.vlm.method.hiprune, vitrim.vlm.method.flowcut), against
their authors' code written in the test on transformers' own layers (every attention map formed in full):

- the kept patches are the authors' (HiPrune: ``encode_images`` of their llava_arch.py; FlowCut: their
  ``CLIPEncoderLayer_forward`` loop, batch 1), at three settings and one with ties (a layer whose queries, or
  queries and values, are zero: every score equal);
- the projector's input is the authors' feature rows (``hidden_states[-2][:, 1:]`` of the tower they run) in the
  kept slots, and the logits are the unmodified model's fed those slots with the dropped slots masked out
  (vitrim's drop equals a mask, positions unchanged), float64, 1e-12;
- in a padded batch of three each sample equals itself alone (FlowCut: where the authors' batch count, the largest
  prune over the batch, does not); generate() decodes the same with and without its cache; keep = all is the
  unmodified model bit for bit; the model runs on SDPA throughout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pre_llm_reference import hiprune_reference
from tower_reference import authors_flowcut_cut, tower_layers

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, batch, pixels, prompt, tiny_llava

TOL = 1e-12
LAYERS = 7  # vision_feature_layer −2: the feature layer is block 5 (0-based); FlowCut cuts after blocks 0, 2 and 4
FEATURE = LAYERS - 2
SIDE = 4  # the 4×4 patch grid


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    return tiny_llava(vision_layers=LAYERS)


@pytest.fixture
def model(llava: torch.nn.Module):
    yield llava
    if hasattr(llava, "_vitrim_vlm"):
        vitrim.vlm.remove(llava)


def padded(side: str = "left") -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three prompts of different lengths padded on ``side`` (left for generate(); right to compare a sample with
    itself alone: left padding shifts a row's positions, and the tiny Llama's float32 rotary table then differs by
    1e-7 in float64 even for the unmodified model)."""
    prompts = [prompt(3, 4), prompt(6, 1, seed=1), prompt(1, 2, seed=2)]
    ids, mask = batch(prompts, side)
    return prompts, {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels(3, seed=3)}


@pytest.fixture
def tied(llava: torch.nn.Module, request: pytest.FixtureRequest):
    """The model with zero queries (``request.param``: and values) in some tower blocks, restored after."""
    blocks, values = request.param
    layers = llava.model.vision_tower.encoder.layers
    saved = {name: p.detach().clone() for name, p in layers.named_parameters()}
    with torch.no_grad():
        for block in blocks:
            attention = layers[block].self_attn
            attention.q_proj.weight.zero_()  # every query 0: every logit 0, a uniform map
            attention.q_proj.bias.zero_()
            if values:
                attention.v_proj.weight.zero_()  # every value the bias: equal values, equal norms
    yield llava
    with torch.no_grad():
        for name, p in layers.named_parameters():
            p.copy_(saved[name])


def authors_hiprune(tower: torch.nn.Module, images: torch.Tensor, keep: int, alpha: float, object_layer: int):
    """Kept patches per image and their feature rows (B, keep, C) of the full tower, as the authors' encode_images."""
    trace = tower_layers(tower, images)
    kept = hiprune_reference(trace[object_layer - 1]["weights"], trace[FEATURE]["weights"], keep, alpha, SIDE)
    features = trace[FEATURE]["output"][:, 1:]
    return kept, torch.stack([features[b, k] for b, k in enumerate(kept)])


def authors_flowcut(tower: torch.nn.Module, images: torch.Tensor, keep: int):
    """The authors' CLIPEncoder_forward with CLIPEncoderLayer_forward's cut (batched as they wrote it: the prune
    count is the batch's largest), topk stable and log N in float64: per image the kept patches (original indices)
    and the feature rows (B, keep, C) of block ``select_layer`` = L − 2; with the patches each block kept."""
    target = keep + 1  # the authors' target counts [CLS]
    select_layer = len(tower.encoder.layers) - 2
    run: dict[str, Any] = {"scores": None, "positions": torch.arange(GRID_TOKENS).expand(len(images), -1)}
    counts = []

    def cut(idx: int, hidden: torch.Tensor, weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] > target:
            cls_attention = weights[:, :, 0, 1:].mean(dim=1)
            semantic = (values[:, :, :1] @ values.transpose(-1, -2)).softmax(-1)[:, :, 0].mean(1)[:, 1:]
            rpl = select_layer - idx - 1  # the authors' remain_prune_layer
            kept = authors_flowcut_cut(run, rpl, target, cls_attention, semantic, values.mean(1)[:, 1:])
            if kept is not None:
                run["positions"] = run["positions"].gather(1, kept)
                rows = hidden[:, 1:].gather(1, kept[..., None].expand(-1, -1, hidden.shape[-1]))
                hidden = torch.cat([hidden[:, :1], rows], dim=1)
        counts.append(hidden.shape[1] - 1)
        return hidden

    trace = tower_layers(tower, images, cut)
    return run["positions"].tolist(), trace[FEATURE]["output"][:, 1:], counts


def run_method(model, inputs: dict, name: str, options: dict) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """logits, last_selection and the projector's input (I, P, C) under ``name``."""
    seen = {}
    vitrim.vlm.apply(model, name, **options)
    handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, a: seen.update(slots=a[0]))
    try:
        logits = model(**inputs).logits
        kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
    finally:
        handle.remove()
        vitrim.vlm.remove(model)
    return logits, kept, seen["slots"]


def masked_reference(model, inputs: dict, slots: torch.Tensor, kept: list[list[int]]) -> torch.Tensor:
    """The unmodified model's logits with its projector fed ``slots`` and every image slot not in ``kept`` masked."""
    mask = inputs["attention_mask"].clone()
    for row, keep in enumerate(kept):
        columns = (inputs["input_ids"][row] == 3).nonzero().flatten()
        dropped = torch.ones(GRID_TOKENS, dtype=torch.bool)
        dropped[keep] = False
        mask[row, columns[dropped]] = 0
    handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, a: (slots,))
    try:
        return model(**{**inputs, "attention_mask": mask}).logits
    finally:
        handle.remove()


def check_against_the_authors(model, images: torch.Tensor, name: str, options: dict, authors: Callable) -> None:
    """Batch 1 per image: the authors' kept patches, their feature rows in the kept slots (the other slots zero),
    and the logits of the unmodified model fed those slots with the others masked."""
    for image in range(len(images)):
        inputs = {"input_ids": prompt(2, 3, seed=image)[None], "pixel_values": images[image : image + 1]}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        with torch.no_grad():
            expected, rows, *_ = authors(model.model.vision_tower, inputs["pixel_values"])
            expected_slots = rows.new_zeros(1, GRID_TOKENS, rows.shape[-1])
            expected_slots[0, expected[0]] = rows[0]
            logits, kept, slots = run_method(model, inputs, name, options)
            reference = masked_reference(model, inputs, expected_slots, expected)
        assert kept == expected
        torch.testing.assert_close(slots, expected_slots, rtol=0, atol=TOL)
        # the LLM's input is shorter by the dropped slots: the 5 text positions after the image are at the end
        torch.testing.assert_close(logits[:, -5:], reference[:, -5:], rtol=0, atol=TOL)


# --- HiPrune ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "alpha", "object_layer"),
    [  # 1, 2, 1 anchors; the last: object layer = deep layer
        (10, 0.5, 2),
        pytest.param(10, 1.0, 1, marks=pytest.mark.full),
        pytest.param(12, 0.5, FEATURE + 1, marks=pytest.mark.full),
    ],
)
def test_hiprune_keeps_the_authors_patches_and_feeds_their_rows(model, keep, alpha, object_layer) -> None:
    options = {"keep": keep, "alpha": alpha, "object_layer": object_layer}
    authors = lambda tower, images: authors_hiprune(tower, images, keep, alpha, object_layer)  # noqa: E731
    check_against_the_authors(model, pixels(2, seed=3), "hiprune", options, authors)


@pytest.mark.parametrize(
    "tied", [((1, FEATURE), False), pytest.param(((1,), False), marks=pytest.mark.full)], indirect=True
)
def test_hiprune_breaks_ties_as_the_authors_code_with_a_stable_topk(tied) -> None:
    """Zero queries at the object block (and the deep block): every patch gets the same global attention."""
    options = {"keep": 10, "alpha": 1.0, "object_layer": 2}
    authors = lambda tower, images: authors_hiprune(tower, images, 10, 1.0, 2)  # noqa: E731
    check_against_the_authors(tied, pixels(2, seed=6), "hiprune", options, authors)


# --- FlowCut ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [6, pytest.param(3, marks=pytest.mark.full), pytest.param(11, marks=pytest.mark.full)])
def test_flowcut_at_batch_one_keeps_the_authors_patches_and_feeds_their_rows(model, keep) -> None:
    authors = lambda tower, images: authors_flowcut(tower, images, keep)  # noqa: E731
    check_against_the_authors(model, pixels(2, seed=3), "flowcut", {"keep": keep}, authors)


@pytest.mark.parametrize("tied", [(range(FEATURE), True)], indirect=True)
def test_flowcut_breaks_ties_as_the_authors_code_with_a_stable_topk(tied) -> None:
    """Zero queries and value weights before the feature block: a uniform [CLS] row (nothing pruned until the last
    cut), equal values, every score equal: the first ``keep`` patches stay."""
    authors = lambda tower, images: authors_flowcut(tower, images, 5)  # noqa: E731
    check_against_the_authors(tied, pixels(2, seed=6), "flowcut", {"keep": 5}, authors)
    with torch.no_grad():
        assert authors_flowcut(tied.model.vision_tower, pixels(1), 5)[0] == [[0, 1, 2, 3, 4]]


def test_flowcut_in_a_batch_each_image_keeps_its_own_count_where_the_authors_batch_does_not(model) -> None:
    prompts, inputs = padded("right")
    tower, images = model.model.vision_tower, inputs["pixel_values"]
    with torch.no_grad():
        alone = [authors_flowcut(tower, images[i : i + 1], 6) for i in range(3)]
        together = authors_flowcut(tower, images, 6)
    counts = [run[2] for run in alone]
    assert len({tuple(c) for c in counts}) > 1  # the images' own counts differ between the cuts: pads are needed
    assert together[0] != [run[0][0] for run in alone]  # the authors' batch count changes what an image keeps
    check_batch_equals_alone(model, prompts, inputs, "flowcut", {"keep": 6})


# --- both ------------------------------------------------------------------------------------------------------

BOTH = [("hiprune", {"keep": 10, "alpha": 0.5, "object_layer": 2}), ("flowcut", {"keep": 6})]


def check_batch_equals_alone(model, prompts: list[torch.Tensor], inputs: dict, name: str, options: dict) -> None:
    with torch.no_grad():
        logits, kept, _ = run_method(model, inputs, name, options)
        for row, ids in enumerate(prompts):
            alone = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids[None]),
                     "pixel_values": inputs["pixel_values"][row : row + 1]}  # fmt: skip
            logits_alone, kept_alone, _ = run_method(model, alone, name, options)
            assert kept_alone[0] == kept[row]
            torch.testing.assert_close(logits[row, : logits_alone.shape[1]], logits_alone[0], rtol=0, atol=TOL)


def test_hiprune_in_a_padded_batch_each_sample_equals_itself_alone(model) -> None:
    prompts, inputs = padded("right")
    check_batch_equals_alone(model, prompts, inputs, *BOTH[0])


@pytest.mark.parametrize(("name", "options"), BOTH)
def test_keep_all_is_the_unmodified_model_bit_for_bit(model, name, options) -> None:
    _, inputs = padded()
    with torch.no_grad():
        reference = model(**inputs).logits
        logits, kept, _ = run_method(model, inputs, name, {**options, "keep": GRID_TOKENS})
    assert torch.equal(logits, reference)
    assert kept == [list(range(GRID_TOKENS))] * 3


@pytest.mark.parametrize(("name", "options"), BOTH)
def test_generate_decodes_as_the_unmodified_model_fed_the_authors_rows(model, name, options) -> None:
    """Greedy decoding of a left-padded batch of three: the tokens, and every step's logits, equal the unmodified
    model's (run whole at each step, numbered as generate() numbers a padded batch) whose projector is fed the
    authors' rows in the kept slots, the other image slots masked."""
    _, inputs = padded()
    images = inputs["pixel_values"]
    with torch.no_grad():
        if name == "hiprune":
            kept, rows = authors_hiprune(model.model.vision_tower, images, 10, 0.5, 2)
        else:  # each image alone: vitrim's count is the image's own
            alone = [authors_flowcut(model.model.vision_tower, images[i : i + 1], 6)[:2] for i in range(3)]
            kept, rows = [k[0] for k, _ in alone], torch.cat([r for _, r in alone])
    slots = rows.new_zeros(3, GRID_TOKENS, rows.shape[-1])
    mask = inputs["attention_mask"].clone()
    for row, patches in enumerate(kept):
        slots[row, patches] = rows[row]
        columns = (inputs["input_ids"][row] == 3).nonzero().flatten()
        mask[row, columns[[p for p in range(GRID_TOKENS) if p not in patches]]] = 0
    ids, full = inputs["input_ids"], inputs["attention_mask"]
    expected_logits = []
    handle = model.model.multi_modal_projector.register_forward_pre_hook(lambda m, a: (slots,))
    try:
        with torch.no_grad():
            for _ in range(3):  # greedy, each step the whole sequence again: no cache to trust
                positions = (full.cumsum(-1) - 1).clamp(min=0)  # generate()'s own numbering of a padded batch
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, pixel_values=images)
                expected_logits.append(logits.logits[:, -1])
                step = expected_logits[-1].argmax(-1, keepdim=True)
                ones = torch.ones_like(step)
                ids, full, mask = torch.cat([ids, step], 1), torch.cat([full, ones], 1), torch.cat([mask, ones], 1)
    finally:
        handle.remove()
    vitrim.vlm.apply(model, name, **options)
    try:
        generated = model.generate(**inputs, max_new_tokens=3, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)  # fmt: skip
    finally:
        vitrim.vlm.remove(model)
    assert torch.equal(generated.sequences, ids)
    for step_logits, expected in zip(generated.logits, expected_logits, strict=True):
        assert step_logits.dtype == torch.float32  # generate() hands LLaVA's logits back in float32
        torch.testing.assert_close(step_logits, expected.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("name", "options"), BOTH)
def test_generate_decodes_the_same_with_and_without_its_cache(model, name, options) -> None:
    _, inputs = padded()
    vitrim.vlm.apply(model, name, **options)
    cached = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    kept = vitrim.vlm.last_selection(model)
    uncached = model.generate(**inputs, max_new_tokens=4, do_sample=False, use_cache=False)
    vitrim.vlm.remove(model)
    assert torch.equal(cached, uncached)
    assert [len(k) for k in kept] == [options["keep"]] * 3
    assert not any("forward" in layer.__dict__ for layer in model.model.vision_tower.encoder.layers)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("hiprune", {}, "vlm method 'hiprune' needs keep="),
        ("hiprune", {"keep": 8}, r"object_layer=9 is past this tower's feature layer \(layer 6, 1-based\)"),
        ("hiprune", {"keep": 8, "alpha": 1.0, "object_layer": 2}, r"hiprune cannot keep 8 tokens with alpha=1\.0"),
        ("hiprune", {"keep": 8, "alpha": 2}, r"alpha=2 must be a number in \[0, 1\]"),
        ("hiprune", {"keep": 8, "object_layer": 0}, r"object_layer=0 must be an int >= 1"),
        ("flowcut", {}, "vlm method 'flowcut' needs keep="),
        ("flowcut", {"keep": 8, "target_num": 8}, "unknown option 'target_num' for vlm method 'flowcut'"),
    ],
)
def test_bad_options_fail_at_apply_and_leave_the_model(model, name, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        vitrim.vlm.apply(model, name, **options)
    assert not hasattr(model, "_vitrim_vlm")
    assert not any("forward" in layer.__dict__ for layer in model.model.vision_tower.encoder.layers)

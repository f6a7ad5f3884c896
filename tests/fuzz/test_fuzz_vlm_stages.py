"""The project fuzzes vitrim.vlm's in-LLM and tower stages through the public API (apply, forward, generate,
last_selection, remove) on tiny float64 models: random methods, keep / layer / method options (good and bad),
batches of 1-3 prompts with 0-2 images each, either padding side, prompts that end on image tokens, a forward
without images after one with them.

The contract, every case:
- ``apply`` either installs or raises vitrim's ValueError / TypeError naming an argument it was given (or the
  layer, whose default a small LLM cannot hold); nothing else, and a refused apply leaves no hook;
- an installed method runs the forward and ``generate`` without any error, with finite logits;
- in-LLM: the logits equal the masked reference (the unmodified LLM run layer by layer with the dropped keys masked
  from each drop layer on, ``llm_reference.masked_layers``; Qwen3-VL's DeepStack one from
  ``test_in_llm_qwen3_deepstack``) at every kept, non-padding position to 1e-12, and every sample's last real
  position stays;
- ``last_selection``: one sorted, unique, in-range index tensor per image; [] after a forward without images;
- ``remove`` leaves the model giving the unmodified logits bit for bit.

Fast by default (a few examples per stage); ``@pytest.mark.full`` draws many more.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "vlm"))  # the references of tests/vlm (llm_reference)

import vitrim.vlm  # noqa: E402
from vitrim.vlm.api import STATE_ATTRIBUTE  # noqa: E402

CLEAR = (ValueError, TypeError)
TOL = 1e-12


def _settings(examples: int) -> Any:
    return settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


# -- inputs -------------------------------------------------------------------------------------------------------

# per sample: (text before, images, text after); text after 0 ends the prompt on image tokens
samples = st.tuples(st.integers(1, 4), st.integers(0, 2), st.integers(0, 3))
batches = st.lists(samples, min_size=1, max_size=3)


def llava_inputs(shape: list[tuple[int, int, int]], side: str, seed: int, family: Any = None) -> dict:
    """A batch for the tiny LLaVA (``family`` None) or the module of another tiny family of the same prompt layout
    (``tiny_gemma3``: each image after its begin-of-image token, token types and the model's positions added)."""
    from tiny_vlms import llava as tiny_llava

    family = family or tiny_llava
    GRID_TOKENS, IMAGE_TOKEN, batch, pixels = family.GRID_TOKENS, family.IMAGE_TOKEN, family.batch, family.pixels
    before_image = [torch.tensor([family.BOI])] if hasattr(family, "BOI") else []
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for before, images, after in shape:
        parts = [torch.randint(6, 99, (before,), generator=generator)]
        for image in range(images):
            parts += [*before_image, torch.full((GRID_TOKENS,), IMAGE_TOKEN)]
            if image < images - 1:
                parts.append(torch.randint(6, 99, (1,), generator=generator))
        parts.append(torch.randint(6, 99, (after,), generator=generator))
        prompts.append(torch.cat(parts))
    input_ids, attention_mask = batch(prompts, side)
    count = sum(images for _, images, _ in shape)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if hasattr(family, "token_types"):
        inputs["token_type_ids"] = family.token_types(input_ids)
        inputs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask  # as generate() has
    return {**inputs, "pixel_values": pixels(count, seed=seed)} if count else inputs


def text_only(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor([[7, 8, 9, 10]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}


# -- options ------------------------------------------------------------------------------------------------------

# three in four draws valid (so most cases run the model), the rest bad in every way the fuzz of issue 45 tried
BAD_KEEPS = [-1, 0, 17, 0.0, 1.5, float("nan"), "half", True]
keeps = st.one_of(
    st.none(), st.integers(1, 16), st.sampled_from([0.25, 0.5, 1.0]), st.integers(1, 4), st.sampled_from(BAD_KEEPS)
)
layer_values = st.sampled_from([None, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 3, -1, 0, 1.5, "1", True])


@st.composite
def in_llm_options(draw: Any) -> tuple[str, dict[str, Any]]:
    name = draw(st.sampled_from(["fastv", "dart", "pdrop"]))
    options: dict[str, Any] = {}
    if name == "pdrop":
        layers = draw(st.sampled_from([(1,), (1,), (1,), (2,), None, (1, 1), (0,), "1"]))
        ratios = draw(st.sampled_from([(0.5,), (0.25,), (1.0,), (0.1,), None, (0.0,), (1.5,), (0.5, 0.25)]))
        options.update({k: v for k, v in (("layers", layers), ("ratios", ratios)) if v is not None})
    else:
        for option, value in (("keep", draw(keeps)), ("layer", draw(layer_values))):
            if value is not None:
                options[option] = value
        if name == "dart" and draw(st.booleans()):
            options["pivot_image_token"] = draw(st.sampled_from([0, 1, 2, 40, 1.5]))
    if draw(st.integers(0, 19)) == 0:
        options["no_such_option"] = 1
    return name, options


@st.composite
def tower_options(draw: Any) -> tuple[str, dict[str, Any]]:
    name = draw(st.sampled_from(vitrim.vlm.methods(stage="tower")))
    options: dict[str, Any] = {}
    defaults = vitrim.vlm.method_info(name).defaults
    if "r" in defaults and draw(st.booleans()):
        options["r"] = draw(st.sampled_from([1, 2, 4, 0, 8, 40, -1, 1.5]))
    if "keep_rate" in defaults and draw(st.booleans()):
        options["keep_rate"] = draw(st.sampled_from([0.3, 0.5, 0.8, 1.0, 0.0, 1.5, float("nan")]))
    if "to_grid" in defaults and draw(st.integers(0, 3)) == 0:
        options["to_grid"] = draw(st.sampled_from([True, False, "yes"]))
    if draw(st.integers(0, 9)) == 0:
        options["keep"] = draw(keeps)
    return name, options


# -- checks -------------------------------------------------------------------------------------------------------


def vitrim_hooks(model: torch.nn.Module) -> int:
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return sum(getattr(hook, "__module__", "").startswith("vitrim") for hook in hooks)


RAN: dict[str, int] = {"applied": 0, "refused": 0}


def applied_or_refused(model: torch.nn.Module, name: str, options: dict[str, Any]) -> bool:
    """Apply; True when installed. A refusal must be vitrim's, naming an option it was given (or the layer)."""
    try:
        vitrim.vlm.apply(model, name, **options)
        RAN["applied"] += 1
    except CLEAR as err:
        RAN["refused"] += 1
        words = (*options, "layer=", "drop layer", repr(name))  # an option given, the default layer, the method
        assert any(word in str(err) for word in words), f"{name} {options}: {err}"
        assert "\n" not in str(err).strip()
        assert vitrim_hooks(model) == 0 and not hasattr(model, STATE_ATTRIBUTE)
        return False
    return True


def check_selection(selection: list[torch.Tensor], tokens: list[int]) -> None:
    """One sorted, unique, in-range LongTensor per image (``tokens``: each image's token count)."""
    assert len(selection) == len(tokens)
    for kept, count in zip(selection, tokens, strict=True):
        assert kept.dtype == torch.long and kept.numel() >= 1
        assert torch.equal(kept, torch.unique(kept)) and int(kept.min()) >= 0 and int(kept.max()) < count


def kept_positions(input_ids: torch.Tensor, image_token: int, tokens: list[int], kept: list[torch.Tensor]) -> Any:
    """(B, L) bool: every position but the image tokens not kept (image i: ``tokens[i]`` positions, reading order)."""
    keep = input_ids != image_token
    image = 0
    for b, row in enumerate(input_ids):
        where = (row == image_token).nonzero().flatten()
        while len(where):
            mine, where = where[: tokens[image]], where[tokens[image] :]
            keep[b, mine[kept[image]]] = True
            image += 1
    return keep


def last_real(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the column of each sample's last real token."""
    columns = torch.arange(attention_mask.shape[1])
    return torch.where(attention_mask.bool(), columns, -1).argmax(1)


# -- LLaVA: the in-LLM and the tower stage -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    from tiny_vlms.llava import tiny_llava

    return tiny_llava(seed=11)


def applied_run(model: torch.nn.Module, method: tuple[str, dict[str, Any]], inputs: dict, run: Any) -> Any:
    """The contract around one case: apply ``method`` (a refusal: vitrim's, naming an option; then None), call
    ``run()`` (the stage's own checks; what it returns is returned), remove, then no vitrim hook is left and the
    model gives its unmodified logits bit for bit."""
    with torch.no_grad():
        plain = model(**inputs).logits
    if not applied_or_refused(model, *method):
        return None
    try:
        result = run()
    finally:
        if hasattr(model, STATE_ATTRIBUTE):
            vitrim.vlm.remove(model)
    assert vitrim_hooks(model) == 0
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, plain)
    return result


def forward_generate_text_only(model: torch.nn.Module, inputs: dict, images: int, tokens: int) -> torch.Tensor:
    """The forward's logits (finite), its selection checked, then generate and a forward without images ([])."""
    with torch.no_grad():
        out = model(**inputs).logits
        if images:
            check_selection(vitrim.vlm.last_selection(model), [tokens] * images)
        generated = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        model(**text_only(inputs))
    assert torch.isfinite(out).all()
    assert generated.shape == (inputs["input_ids"].shape[0], inputs["input_ids"].shape[1] + 2)
    assert vitrim.vlm.last_selection(model) == []
    return out


def run_in_llm(model, method, inputs: dict, images: int, tokens: int, image_token: int, reference: Any) -> None:
    """One in-LLM case; ``reference(drops, llm_kwargs)``: the masked model's logits (B, L, V) for the kept columns
    ``drops`` {K: (B, L) bool} given the keyword arguments the LLM received."""
    lm = model.model.language_model

    def run() -> tuple:
        drop = getattr(model, STATE_ATTRIBUTE).installation.drop
        calls: list[dict] = []
        handle = lm.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
        try:
            with torch.no_grad():
                out = model(**inputs).logits
        finally:
            handle.remove()
        stages = drop.stage_selections() if images else []
        forward_generate_text_only(model, inputs, images, tokens)
        return out, calls[0], stages, [stage.layer for stage in drop.stages]

    ran = applied_run(model, method, inputs, run)
    if ran is None or not images:
        return
    out, given, stages, layers = ran
    mask = inputs["attention_mask"]
    drops = {
        layer: kept_positions(inputs["input_ids"], image_token, [tokens] * images, kept)
        for layer, kept in zip(layers, stages, strict=True)
    }
    last = drops[layers[-1]]
    assert bool(last[torch.arange(mask.shape[0]), last_real(mask)].all())  # the last real position stays
    with torch.no_grad():
        expected = reference(drops, given)
    assert (out - expected)[mask.bool() & last].abs().max() <= TOL


def run_in_llm_on_llava(model, method, shape, side, seed) -> None:
    from llm_reference import masked_layers

    from tiny_vlms.llava import GRID_TOKENS, IMAGE_TOKEN

    inputs = llava_inputs(shape, side, seed)
    mask = inputs["attention_mask"]

    def reference(drops: dict, given: dict) -> torch.Tensor:
        lm = model.model.language_model
        return model.lm_head(masked_layers(lm, given["inputs_embeds"], mask, given.get("position_ids"), drops))

    images = sum(images for _, images, _ in shape)
    run_in_llm(model, method, inputs, images, GRID_TOKENS, IMAGE_TOKEN, reference)


def run_tower_on_llava(model, method, shape, side, seed) -> None:
    from tiny_vlms.llava import GRID_TOKENS

    inputs = llava_inputs(shape, side, seed)
    images = sum(images for _, images, _ in shape)
    applied_run(model, method, inputs, lambda: forward_generate_text_only(model, inputs, images, GRID_TOKENS))


SIDES = st.sampled_from(["left", "right"])
SEEDS = st.integers(0, 2**16)


@pytest.mark.parametrize("examples", [24, pytest.param(150, marks=pytest.mark.full)])
def test_in_llm_on_llava(llava, examples) -> None:
    @_settings(examples)
    @given(method=in_llm_options(), shape=batches, side=SIDES, seed=SEEDS)
    def case(method, shape, side, seed) -> None:
        run_in_llm_on_llava(llava, method, shape, side, seed)

    case()


@pytest.mark.parametrize("examples", [16, pytest.param(100, marks=pytest.mark.full)])
def test_tower_on_llava(llava, examples) -> None:
    @_settings(examples)
    @given(method=tower_options(), shape=batches, side=SIDES, seed=SEEDS)
    def case(method, shape, side, seed) -> None:
        run_tower_on_llava(llava, method, shape, side, seed)

    case()


# -- Gemma 3: the in-LLM stage on sliding-window and full layers with their own masks; the tower on the grid -------


@pytest.fixture(scope="module")
def gemma3() -> torch.nn.Module:
    from tiny_vlms.gemma3 import tiny_gemma3

    return tiny_gemma3(seed=12)


def run_in_llm_on_gemma3(model, method, shape, seed) -> None:
    from gemma3_llm_reference import image_runs, llm_embeddings, masked_gemma3

    from tiny_vlms import gemma3 as tiny_gemma3

    inputs = llava_inputs(shape, "left", seed, family=tiny_gemma3)
    images = sum(images for _, images, _ in shape)

    def reference(drops: dict, given: dict) -> torch.Tensor:
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        embeds = llm_embeddings(model, ids, inputs["pixel_values"])
        return masked_gemma3(model, embeds, image_runs(ids), mask, inputs["position_ids"], drops)

    run_in_llm(model, method, inputs, images, tiny_gemma3.GRID_TOKENS, tiny_gemma3.IMAGE_TOKEN, reference)


def run_tower_on_gemma3(model, method, shape, seed) -> None:
    from tiny_vlms import gemma3 as tiny_gemma3

    inputs = llava_inputs(shape, "left", seed, family=tiny_gemma3)
    images = sum(images for _, images, _ in shape)
    patches = (16 // 2) ** 2  # the tower's 8×8 patches: what the tower stage's selection indexes
    applied_run(model, method, inputs, lambda: forward_generate_text_only(model, inputs, images, patches))


@pytest.mark.parametrize("examples", [10, pytest.param(60, marks=pytest.mark.full)])
def test_in_llm_on_gemma3(gemma3, examples) -> None:
    @_settings(examples)
    @given(method=in_llm_options(), shape=batches, seed=SEEDS)
    def case(method, shape, seed) -> None:
        run_in_llm_on_gemma3(gemma3, method, shape, seed)

    case()


@pytest.mark.parametrize("examples", [6, pytest.param(40, marks=pytest.mark.full)])
def test_tower_on_gemma3(gemma3, examples) -> None:
    @_settings(examples)
    @given(method=tower_options(), shape=batches, seed=SEEDS)
    def case(method, shape, seed) -> None:
        run_tower_on_gemma3(gemma3, method, shape, seed)

    case()


# -- Qwen3-VL as the 8B lays it out: the in-LLM stage with DeepStack ----------------------------------------------

qwen_prompts = st.lists(
    st.tuples(st.integers(1, 3), st.sampled_from([[], [(4, 4)], [(4, 6)], [(4, 4), (4, 2)]])), min_size=1, max_size=3
)


def run_in_llm_on_qwen3(model, method, prompts, side, seed) -> None:
    from test_in_llm_qwen3_deepstack import TEMPORAL, masked_deepstack_reference

    from tiny_vlms.qwen import IMAGE, batch

    if not any(grids for _, grids in prompts):  # the batch builder needs an image (text-only: the LLaVA cases)
        prompts = [(prompts[0][0], [(4, 4)]), *prompts[1:]]
    texts = [([list(range(5, 5 + before))] + [[7]] * len(grids), grids) for before, grids in prompts]
    inputs = batch(texts, seed=seed, side=side, temporal=TEMPORAL)
    tokens = [h * w // 4 for _, grids in prompts for h, w in grids]

    def run() -> tuple | None:
        drop = getattr(model, STATE_ATTRIBUTE).installation.drop
        with torch.no_grad():
            try:
                out = model(**inputs).logits
            except CLEAR as err:  # images differ in size here: keep= is checked against each at the forward
                options = method[1]
                assert "keep" in options and "keep=" in str(err) and "\n" not in str(err), f"{options}: {err}"
                return None
        check_selection(vitrim.vlm.last_selection(model), tokens)
        assert torch.isfinite(out[inputs["attention_mask"].bool()]).all()
        return out, drop.stage_selections(), [stage.layer for stage in drop.stages]

    ran = applied_run(model, method, inputs, run)
    if ran is None:
        return
    out, stages, layers = ran
    drops = {
        layer: kept_positions(inputs["input_ids"], IMAGE, tokens, kept)
        for layer, kept in zip(layers, stages, strict=True)
    }
    reference = masked_deepstack_reference(model, inputs, drops)
    compared = inputs["attention_mask"].bool() & drops[layers[-1]]
    assert (out - reference)[compared].abs().max() <= TOL


@pytest.fixture(scope="module")
def qwen3() -> torch.nn.Module:
    from tiny_vlms.qwen import qwen3_vl_8b_layout

    return qwen3_vl_8b_layout(seed=3)


@pytest.mark.parametrize("examples", [8, pytest.param(60, marks=pytest.mark.full)])
def test_in_llm_on_qwen3_vl_8b_layout(qwen3, examples) -> None:
    @_settings(examples)
    @given(method=in_llm_options(), prompts=qwen_prompts, side=SIDES, seed=SEEDS)
    def case(method, prompts, side, seed) -> None:
        run_in_llm_on_qwen3(qwen3, method, prompts, side, seed)

    case()

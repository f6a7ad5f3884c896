"""Every documented generate() use the unmodified model supports runs on every family with a pre-LLM and an in-LLM
method (issue 41: the stage is written once, so no family refuses beams or ``use_cache=False``).

References, per use: ``use_cache=False`` re-runs the shortened prefill at every step, so its greedy tokens must
equal the cached run's; sampling with the same seed likewise; beam search on a batch of two prompts must give each
prompt what it gets alone (a prompt's selection repeated for its own beams, never another's)."""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms import gemma3 as tiny_gemma3
from tiny_vlms import llava as tiny_llava
from tiny_vlms import qwen as qwen_tiny

STEPS = 3


def llava_inputs() -> list[dict]:
    first, second = tiny_llava.prompt(2, 3, seed=1), tiny_llava.prompt(4, 1, seed=2)
    return [
        {"input_ids": first[None], "pixel_values": tiny_llava.pixels(1, seed=1)},
        {"input_ids": second[None], "pixel_values": tiny_llava.pixels(1, seed=2)},
    ]


def gemma_inputs() -> list[dict]:
    rows = [tiny_gemma3.prompt(2, 3, seed=1), tiny_gemma3.prompt(4, 1, seed=2)]
    return [
        {
            "input_ids": ids[None],
            "pixel_values": tiny_gemma3.pixels(1, seed=s),
            "token_type_ids": tiny_gemma3.token_types(ids[None]),
        }
        for s, ids in zip((1, 2), rows, strict=True)
    ]


def qwen_inputs() -> list[dict]:
    return [qwen_tiny.one(seed=1), qwen_tiny.one(texts=[[1, 5], [7, 8, 9, 10]], grids=[(4, 4)], seed=2)]


def batched(family: str, singles: list[dict]) -> dict:
    """The two prompts as one left-padded batch, as a processor makes it."""
    if family == "qwen":
        prompts = [([[1, 5, 6], [7, 8, 9]], [(4, 6)]), ([[1, 5], [7, 8, 9, 10]], [(4, 4)])]
        both = qwen_tiny.batch(prompts, seed=0, side="left")
        # the pixels of each image as drawn alone (batch() draws them in sequence from one seed)
        both["pixel_values"] = torch.cat([single["pixel_values"] for single in singles])
        return both
    module = tiny_llava if family == "llava" else tiny_gemma3
    ids, mask = module.batch([single["input_ids"][0] for single in singles], side="left")
    inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat([s["pixel_values"] for s in singles])}
    if family == "gemma3":
        inputs["token_type_ids"] = tiny_gemma3.token_types(ids)
    return inputs


FAMILIES = {
    "llava": (lambda: tiny_llava.tiny_llava(), llava_inputs, 8),
    "gemma3": (lambda: tiny_gemma3.tiny_gemma3(), gemma_inputs, 6),
    "qwen": (lambda: qwen_tiny.qwen2_5_vl(), qwen_inputs, 3),
}
METHODS = {"pre_llm": ("random", {}), "in_llm": ("fastv", {"layer": 1}), "tower": ("topk", {})}


def applied(name: str, model: torch.nn.Module, stage: str, keep: int) -> None:
    """Apply the stage's method, or skip where the family does not take the stage (Qwen's windowed tower)."""
    if stage == "tower" and name == "qwen":
        pytest.skip("vitrim.vlm does not cut inside Qwen's windowed tower")
    method, options = METHODS[stage]
    vitrim.vlm.apply(model, method, keep=keep, **options)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, list[dict], int]:
    build, inputs, keep = FAMILIES[request.param]
    return request.param, build(), inputs(), keep


def generate(model: torch.nn.Module, inputs: dict, **options: object) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, **options)
    return out[:, -STEPS:]


@pytest.mark.parametrize("stage", sorted(METHODS))
def test_use_cache_false_and_sampling_give_the_cached_runs_tokens(family: tuple, stage: str) -> None:
    name, model, singles, keep = family
    applied(name, model, stage, keep)
    try:
        cached = generate(model, singles[0], do_sample=False)
        uncached = generate(model, singles[0], do_sample=False, use_cache=False)
        assert torch.equal(cached, uncached), name
        torch.manual_seed(7)
        sampled = generate(model, singles[0], do_sample=True, top_k=0)
        torch.manual_seed(7)
        sampled_uncached = generate(model, singles[0], do_sample=True, top_k=0, use_cache=False)
        assert torch.equal(sampled, sampled_uncached), name
    finally:
        vitrim.vlm.remove(model)


@pytest.mark.parametrize("stage", sorted(METHODS))
def test_beam_search_gives_each_prompt_of_a_batch_what_it_gets_alone(family: tuple, stage: str) -> None:
    name, model, singles, keep = family
    applied(name, model, stage, keep)
    try:
        alone = [generate(model, single, num_beams=2, do_sample=False) for single in singles]
        together = generate(model, batched(name, singles), num_beams=2, do_sample=False)
    finally:
        vitrim.vlm.remove(model)
    assert torch.equal(together, torch.cat(alone)), name


def test_a_static_cache_is_refused_in_one_line_on_every_family(family: tuple) -> None:
    _, model, singles, keep = family
    vitrim.vlm.apply(model, "random", keep=keep)
    try:
        with pytest.raises(ValueError, match=r"needs generate's default dynamic cache; a static or compiled cache"):
            generate(model, singles[0], do_sample=False, cache_implementation="static")
    finally:
        vitrim.vlm.remove(model)


def test_a_prompt_ending_on_an_image_keeps_its_last_position(family: tuple) -> None:
    """generate() reads the next token at the last position: it stays even where the method drops it (its image
    keeps one token more than keep=); on LLaVA the logits there equal the full model's with the other dropped
    image tokens masked."""
    name, model, singles, _ = family
    inputs = dict(singles[0])
    image_token = model.config.image_token_id
    ids = inputs["input_ids"]
    last_image = int((ids[0] == image_token).nonzero().max())
    for key in ("input_ids", "token_type_ids", "mm_token_type_ids", "attention_mask"):
        if key in inputs:
            inputs[key] = inputs[key][:, : last_image + 1]  # the prompt ends on its image's last token
    vitrim.vlm.apply(model, "random", keep=2, positions="original")
    try:
        with torch.no_grad():
            out = model(**inputs).logits
        kept = vitrim.vlm.last_selection(model)[0]
    finally:
        vitrim.vlm.remove(model)
    tokens = int((ids[0] == image_token).sum())
    assert tokens - 1 in kept.tolist() and len(kept) in (2, 3)
    if name == "llava":
        short = inputs["input_ids"]
        image = (short[0] == image_token).nonzero()[:, 0]
        mask = torch.ones_like(short)
        mask[0, image[[i for i in range(tokens) if i not in kept.tolist()]]] = 0
        with torch.no_grad():
            reference = model(input_ids=short, pixel_values=inputs["pixel_values"], attention_mask=mask,
                              position_ids=torch.arange(short.shape[1])[None]).logits  # fmt: skip
        assert (out[0, -1] - reference[0, -1]).abs().max() <= 1e-12

"""An ``attention_mask`` or ``labels`` that does not fit ``input_ids`` is refused before any stage runs, in one
line naming the argument, its shape and the shape expected (issue 53: a mask one column short raised an IndexError
inside the in-LLM drop, a 3-D one an error in torch's words; labels one column short through a stage that shortens
the input crashed inside the shortened-sequence code, and labels of another batch returned a loss where the
unmodified model raises)."""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms import qwen
from tiny_vlms.llava import batch, pixels, prompt, tiny_llava

IN_LLM = {"fastv": {"layer": 1, "keep": 4}, "dart": {"layer": 1, "keep": 4}}


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    return tiny_llava(seed=0)


def _inputs() -> dict[str, torch.Tensor]:
    input_ids, attention_mask = batch([prompt(2, 3, seed=0), prompt(5, 1, seed=1)], "left")  # (2, 24)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixels(2)}


MASKS = {
    "one column short": (lambda mask: mask[:, 1:], r"attention_mask has shape \(2, 23\); expected \(2, 24\)"),
    "3-D": (lambda mask: mask[:, None], r"attention_mask has shape \(2, 1, 24\); expected \(2, 24\)"),
}


@pytest.mark.parametrize("name", sorted(IN_LLM))
@pytest.mark.parametrize("case", sorted(MASKS))
def test_an_attention_mask_that_does_not_fit_input_ids_is_refused_naming_it(llava, name: str, case: str) -> None:
    cut, message = MASKS[case]
    inputs = _inputs()
    vitrim.vlm.apply(llava, name, **IN_LLM[name])
    try:
        with pytest.raises(ValueError, match=message):
            llava(**{**inputs, "attention_mask": cut(inputs["attention_mask"])})
        llava(**inputs)  # the same call with its own mask runs
    finally:
        vitrim.vlm.remove(llava)


def test_the_check_reads_qwen2_vl_calls_too() -> None:
    model = qwen.qwen2_vl(seed=0)
    inputs = qwen.batch([([[1, 5, 6], [7, 8, 9]], [(4, 6)]), ([[1, 5], [7, 8, 9, 10, 11]], [(4, 4)])])
    vitrim.vlm.apply(model, "fastv", layer=1, keep=2)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 13\); expected \(2, 14\)"):
        model(**{**inputs, "attention_mask": inputs["attention_mask"][:, 1:]})


LABELS = {
    "one column short": (lambda labels: labels[:, 1:], r"labels has shape \(2, 23\); expected \(2, 24\)"),
    "another batch": (lambda labels: labels[:1], r"labels has shape \(1, 24\); expected \(2, 24\)"),
}


@pytest.mark.parametrize("case", sorted(LABELS))
def test_labels_that_do_not_fit_input_ids_are_refused_through_a_stage_that_shortens_the_input(llava, case) -> None:
    cut, message = LABELS[case]
    inputs = _inputs()
    labels = inputs["input_ids"].clone()
    vitrim.vlm.apply(llava, "visionzip", keep=6, contextual=2)
    try:
        with pytest.raises(ValueError, match=message):
            llava(**inputs, labels=cut(labels))
        assert torch.isfinite(llava(**inputs, labels=labels).loss)  # labels of the input's shape: a loss
    finally:
        vitrim.vlm.remove(llava)


def test_generate_passes_the_check_at_every_step(llava) -> None:
    """Decode steps hand a mask longer than their input_ids (the cache's tokens first): not refused."""
    inputs = _inputs()
    vitrim.vlm.apply(llava, "visionzip", keep=6, contextual=2)
    try:
        out = llava.generate(**inputs, max_new_tokens=3, do_sample=False)
    finally:
        vitrim.vlm.remove(llava)
    assert out.shape == (2, 27)

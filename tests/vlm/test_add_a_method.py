"""Adding a VLM method is one class: options and defaults with it, a selection that is a function of tensors, one
decorator (issue 41). Shown here with a method that keeps each image's first tokens, run through apply() on the
tiny LLaVA and checked against the masked full model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest
import torch

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, pixels, prompt, tiny_llava
from vitrim.vlm.method import base


def keep_first(features: torch.Tensor, keep: int) -> list[base.ImageSelection]:
    """The pure selection: (I, N, D) features -> each image's first ``keep`` tokens."""
    return [base.ImageSelection.unmerged(torch.arange(keep)) for _ in features]


class KeepFirst(base.Method):
    """Keeps the first ``keep`` image tokens (a dummy method for this test)."""

    defaults: ClassVar[Mapping[str, Any]] = {}

    def select(self, evidence: base.VisionEvidence, keep: int) -> list[base.ImageSelection]:
        return keep_first(evidence.features, keep)


@pytest.fixture
def registered() -> Iterator[None]:
    base.register_method("keep_first", stage="pre_llm")(KeepFirst)
    yield
    del base._METHODS["keep_first"]


def test_a_new_method_is_one_registered_class(registered: None) -> None:
    assert "keep_first" in vitrim.vlm.methods(stage="pre_llm")
    assert vitrim.vlm.method_info("keep_first").stage == "pre_llm"
    model = tiny_llava()
    ids, pv = prompt(2, 3)[None], pixels(1)
    vitrim.vlm.apply(model, "keep_first", keep=5, positions="original")
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pv).logits
    assert vitrim.vlm.last_selection(model)[0].tolist() == [0, 1, 2, 3, 4]
    vitrim.vlm.remove(model)
    image = (ids[0] == model.config.image_token_id).nonzero()[:, 0]
    mask = torch.ones_like(ids)
    mask[0, image[5:]] = 0  # the dropped image tokens masked out of the full model
    with torch.no_grad():
        reference = model(
            input_ids=ids, pixel_values=pv, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None]
        ).logits
    assert GRID_TOKENS > 5
    assert (out[0] - reference[0, mask[0].bool()]).abs().max() <= 1e-12

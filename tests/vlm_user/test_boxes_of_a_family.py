"""A family's pixel boxes are its adapter's (issue 49): a new family maps its image tokens in its own file, and
``vitrim.viz.vlm_token_boxes`` hands the work to whichever family the model is, with no list of families of its own.
The families' maths is checked in test_vlm_boxes.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from vitrim.viz import vlm_token_boxes
from vitrim.vlm import families
from vitrim.vlm.boxes import Affine, TokenBoxes, grid_boxes
from vitrim.vlm.families import FamilyAdapter, FamilyTraits


class ToyVLM(nn.Module):
    """A model of a family vitrim has never heard of."""


class ToyAdapter(FamilyAdapter):
    """A new family's file, as a family author writes it; it offers no boxes."""

    traits = FamilyTraits(classes=("ToyVLM",), title="Toy (ToyVLM)", stages=("pre_llm",))

    def __init__(self, model: nn.Module) -> None:
        self.model = model


class ToyWithBoxes(ToyAdapter):
    """The same family mapping its tokens: a 2×2 grid over each picture; remembers what it was asked."""

    asked: ClassVar[list[tuple[Any, ...]]] = []

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        self.asked.append((image_processor, inputs, sizes, stage))
        return [
            TokenBoxes(
                grid_boxes(2, 2, 1.0, Affine(w / 2, 0.0), Affine(h / 2, 0.0), (h, w)),
                torch.zeros(4, dtype=torch.long),
                ("image",),
                ((2, 2),),
                (h, w),
            )
            for h, w in sizes
        ]


def test_a_new_family_maps_its_tokens_in_its_own_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered the way families are (its classes in the family table), the adapter's boxes are what viz returns:
    nothing outside the family's file names it."""
    monkeypatch.setitem(families.FAMILIES, "ToyVLM", ToyWithBoxes)
    monkeypatch.setattr(ToyWithBoxes, "asked", [])
    image_processor, inputs = object(), {"pixel_values": torch.zeros(1, 3, 4, 4)}
    (boxes,) = vlm_token_boxes(ToyVLM(), SimpleNamespace(image_processor=image_processor), inputs, [(4, 6)], "tower")
    assert ToyWithBoxes.asked == [(image_processor, inputs, [(4, 6)], "tower")]
    assert boxes.size == (4, 6) and boxes.boxes[3].tolist() == [3.0, 2.0, 6.0, 4.0]


def test_a_family_without_boxes_is_one_line_naming_its_class_and_those_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(families.FAMILIES, "ToyVLM", ToyAdapter)
    with pytest.raises(TypeError) as caught:
        vlm_token_boxes(ToyVLM(), SimpleNamespace(image_processor=None), {}, [(4, 6)])
    message = str(caught.value)
    assert "\n" not in message and message.endswith("; not for ToyVLM")
    for adapter in families.ADAPTERS:  # every family vitrim ships maps its tokens, each named by its title
        assert adapter.traits.title in message

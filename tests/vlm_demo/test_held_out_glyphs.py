"""The demo's held-out canvases are drawn from glyphs that no training stage ever draws (issue 44: stage 1 once drew
from another seed's split, which held 279 of the 359 held-out glyphs)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("transformers")

import vitrim.demos.vlm.evaluate as evaluate_module
import vitrim.demos.vlm.train as train_module
from vitrim.data.digits import load_digits, split_indices
from vitrim.demos.vlm.data import TEST_FRACTION, DigitsScenes
from vitrim.demos.vlm.demo import QUICK
from vitrim.demos.vlm.model import build_model, digits_vlm_config


def _recording(drawn: list[tuple[str, int]]) -> type[DigitsScenes]:
    class Recording(DigitsScenes):
        """Records (split, index in the bundled set) of every glyph put on a canvas."""

        def glyph_of(self, value: int, rng: np.random.Generator) -> int:
            position = super().glyph_of(value, rng)
            drawn.append((self.split, int(self.indices[position])))
            return position

    return Recording


@pytest.mark.parametrize("seed", [0, 1])
def test_no_training_stage_draws_a_glyph_of_the_held_out_canvases(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[tuple[str, int]] = []
    monkeypatch.setattr(train_module, "DigitsScenes", _recording(trained))
    # 64 canvases in each stage, both with distorted glyphs (FULL's stage 1 distorts them; stage 2 may)
    plan = dataclasses.replace(QUICK.train, tower_steps=8, steps=8, tower_augment=True, augment=True)
    model = build_model(digits_vlm_config(QUICK.vision, QUICK.text), seed=seed)
    train_module.pretrain_tower(model, plan, seed=seed)
    stage_1 = len(trained)
    train_module.train_model(model, plan, seed=seed)
    assert 0 < stage_1 < len(trained)  # both stages drew glyphs

    held: list[tuple[str, int]] = []
    monkeypatch.setattr(evaluate_module, "DigitsScenes", _recording(held))
    evaluate_module.held_out(200, seed)  # the demo's held-out canvases (QUICK and FULL: 6 and 200 of them)

    _, test_indices = split_indices(load_digits()[1], TEST_FRACTION, seed)  # the held-out split, computed anew
    assert {split for split, _ in trained} == {"train"} and {split for split, _ in held} == {"test"}
    assert {i for _, i in held} <= set(test_indices.tolist())
    assert not {i for _, i in trained} & set(test_indices.tolist())


def test_a_stream_is_another_set_of_canvases_of_the_same_split() -> None:
    zero, one = DigitsScenes("train", 8, seed=3), DigitsScenes("train", 8, seed=3, stream=1)
    assert np.array_equal(zero.indices, one.indices)
    assert not np.array_equal(zero.canvas(0).pixels, one.canvas(0).pixels)
    with pytest.raises(ValueError, match="stream"):
        DigitsScenes("test", 8, stream=1)

"""The digits video clips: every answer is what the frames show (read back from the pixels and the bundled set, not
from the generator's record), and no clip a training stage draws holds a glyph of the held-out split."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest

pytest.importorskip("transformers")

import vitrim.demos.video.data as data_module
from vitrim.data.digits import load_digits, split_indices
from vitrim.demos.video.data import DIGIT, FRAME, QUESTION_TYPES, TEMPORAL, DigitClips, answer_of
from vitrim.demos.video.demo import QUICK
from vitrim.demos.video.evaluate import held_out
from vitrim.demos.video.model import build_model, video_model_config
from vitrim.demos.video.train import pretrain_tower, train_model
from vitrim.demos.vlm.data import DIGIT_WORDS, TEST_FRACTION, DigitsScenes

PAIR = 2  # frames per temporal patch


@functools.cache
def _scaled() -> tuple[np.ndarray, np.ndarray]:
    """The bundled images scaled to 16×16 by nearest neighbour, ink in [0, 1], and their labels."""
    images, labels = load_digits()
    return images.astype(np.float32).repeat(2, axis=1).repeat(2, axis=2) / 16.0, labels


def _read_back(frames: np.ndarray) -> dict[str, tuple]:
    """The three answers computed from the frames alone: which temporal patches hold ink, where the digit's box is,
    which bundled glyph (and so which value) it is."""
    scaled, labels = _scaled()
    pairs = frames.reshape(TEMPORAL, PAIR, FRAME, FRAME)
    assert np.array_equal(pairs[:, 0], pairs[:, 1])  # the two frames of a temporal patch are the same picture
    shown = [t for t in range(TEMPORAL) if pairs[t, 0].any()]
    assert shown == list(range(shown[0], shown[-1] + 1))  # one run of temporal patches
    values, places = set(), []
    for t in shown:
        ys, xs = np.nonzero(pairs[t, 0])
        # the digit's box is on the 8-pixel grid: the glyph's ink may not reach the box's edges, so search the places
        for y in range(0, FRAME - DIGIT + 1, 8):
            for x in range(0, FRAME - DIGIT + 1, 8):
                if y <= ys.min() and ys.max() < y + DIGIT and x <= xs.min() and xs.max() < x + DIGIT:
                    crop = pairs[t, 0, y : y + DIGIT, x : x + DIGIT]
                    found = np.flatnonzero((scaled == crop[None]).all(axis=(1, 2)))
                    if len(found):
                        values |= {int(v) for v in labels[found]}
                        places.append((t, y, x))
    assert len(values) == 1, values
    for (t0, y0, x0), (t1, y1, x1) in itertools.pairwise(places):
        assert t1 == t0 + 1 and (y0, x0) != (y1, x1)  # it moves at every temporal patch
    answers = {
        "which": (DIGIT_WORDS[values.pop()],),
        "when": ("first", "half") if shown[0] < TEMPORAL // 2 else ("second", "half"),
        "count": ({2: "two", 4: "four", 6: "six", 8: "eight"}[PAIR * len(shown)],),
    }
    return answers


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_answer_is_what_the_frames_show(split: str) -> None:
    clips = DigitClips(split, 40, seed=0)
    for index in range(40):
        clip = clips.clip(index)
        answers = _read_back(clip.frames)
        questions = clips.questions(index, clip)
        assert [q.kind for q in questions] == list(QUESTION_TYPES)
        assert {q.kind: q.answer for q in questions} == answers


def _recording(drawn: list[tuple[str, int]]) -> type[DigitsScenes]:
    class Recording(DigitsScenes):
        """Records (split, index in the bundled set) of every glyph put in a clip."""

        def glyph_of(self, value: int, rng: np.random.Generator) -> int:
            position = super().glyph_of(value, rng)
            drawn.append((self.split, int(self.indices[position])))
            return position

    return Recording


def test_training_clips_hold_train_glyphs_only_and_held_out_clips_held_out_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    drawn: list[tuple[str, int]] = []
    monkeypatch.setattr(data_module, "DigitsScenes", _recording(drawn))
    for stream in (0, 1):  # stage 2 draws stream 0, stage 1 stream 1
        clips = DigitClips("train", 50, seed=0, stream=stream, augment=bool(stream))
        for epoch in (0, 5):
            clips.set_epoch(epoch)
            [clips.clip(i) for i in range(50)]
    trained, drawn[:] = list(drawn), []
    held_out(200)
    train_indices, test_indices = split_indices(load_digits()[1], TEST_FRACTION, 0)
    assert {i for _, i in trained} <= set(train_indices.tolist()) and len({i for _, i in trained}) > 150
    assert {i for _, i in drawn} <= set(test_indices.tolist()) and len({i for _, i in drawn}) > 100


@pytest.mark.full  # trains (4 + 4 steps of the QUICK model): ~30 s on a loaded 2-core machine
def test_no_training_stage_draws_a_glyph_of_the_held_out_clips(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[tuple[str, int]] = []
    monkeypatch.setattr(data_module, "DigitsScenes", _recording(drawn))
    plan = dataclasses.replace(QUICK.train, tower_steps=4, steps=4, tower_augment=True, augment=True)
    model = build_model(video_model_config(QUICK.vision, QUICK.text))
    pretrain_tower(model, plan)
    stage_1 = len(drawn)
    train_model(model, plan)
    trained, drawn[:] = list(drawn), []
    held_out(200)  # the demo's held-out clips
    _, test_indices = split_indices(load_digits()[1], TEST_FRACTION, 0)  # the held-out split, computed anew
    assert 0 < stage_1 < len(trained) and {s for s, _ in trained} == {"train"} and {s for s, _ in drawn} == {"test"}
    assert not {i for _, i in trained} & set(test_indices.tolist())
    assert {i for _, i in drawn} <= set(test_indices.tolist())


def test_distorted_training_clips_keep_their_digit_span_and_places() -> None:
    plain, warped = DigitClips("train", 20, seed=1), DigitClips("train", 20, seed=1, augment=True)
    for index in range(20):
        a, b = plain.clip(index), warped.clip(index)
        assert (a.digit, a.start, a.length, a.places) == (b.digit, b.start, b.length, b.places)
        assert not np.array_equal(a.frames, b.frames)
        assert np.array_equal(
            a.frames.reshape(TEMPORAL, PAIR, -1).any(-1), b.frames.reshape(TEMPORAL, PAIR, -1).any(-1)
        )


def test_token_labels_cover_the_digits_box_at_each_temporal_patch() -> None:
    clip = DigitClips("test", 5).clip(3)
    labels = clip.token_digits.reshape(TEMPORAL, 4, 4)
    for t, place in enumerate(clip.places):
        if place is None:
            assert (labels[t] == 10).all()
        else:
            row, col = place
            assert (labels[t, row : row + 2, col : col + 2] == clip.digit).all() and (
                labels[t] == clip.digit
            ).sum() == 4


def test_bad_arguments_are_one_line() -> None:
    with pytest.raises(ValueError, match="split must be"):
        DigitClips("val", 4)
    with pytest.raises(ValueError, match="augment distorts training clips only"):
        DigitClips("test", 4, augment=True)
    with pytest.raises(ValueError, match="question type must be one of"):
        answer_of("where", DigitClips("test", 1).clip(0))
    with pytest.raises(IndexError, match="clip 4 out of range"):
        DigitClips("test", 4).clip(4)
    assert dataclasses.is_dataclass(DigitClips("test", 1).clip(0))

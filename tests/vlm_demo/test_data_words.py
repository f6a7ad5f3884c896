"""The digits VLM's data and processor, checked against the bundled digits and hand-written expectations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitrim.data.digits import load_digits, split_indices
from vitrim.demos.vlm.data import BACKGROUND, DIGIT_WORDS, EMPTY_WORD, QUADRANT_WORDS, DigitsScenes
from vitrim.demos.vlm.words import (
    BOS_ID,
    EOS_ID,
    IMAGE_ID,
    IMAGE_TOKENS,
    PAD_ID,
    WORDS,
    decode_ids,
    processor,
    split_words,
    training_batch,
)


def _glyphs(split: str) -> np.ndarray:
    images, labels = load_digits()
    train, test = split_indices(labels, 0.2, 0)
    chosen = train if split == "train" else test
    return images[chosen].astype(np.float32) / 16.0  # (n, 8, 8)


@pytest.mark.parametrize("split", ["train", "test"])
def test_canvases_hold_distinct_digits_of_their_own_split_in_distinct_quadrants(split: str) -> None:
    scenes = DigitsScenes(split, 40)
    glyphs = _glyphs(split)
    for i in range(40):
        canvas = scenes.canvas(i)
        values = [d for d in canvas.digits if d >= 0]
        assert 1 <= len(values) <= 3 and len(set(values)) == len(values)
        for quadrant, value in enumerate(canvas.digits):
            top, left = (quadrant // 2) * 32, (quadrant % 2) * 32
            block = canvas.pixels[top : top + 32, left : left + 32]
            if value < 0:
                assert not block.any()
                continue
            ys, xs = np.nonzero(block)
            # the digit's 16x16 box starts on the 8-pixel grid; downsampled by 2 it is one 8x8 glyph of this split
            y0, x0 = (ys.min() // 8) * 8, (xs.min() // 8) * 8
            box = block[y0 : y0 + 16, x0 : x0 + 16][::2, ::2]
            matches = np.flatnonzero((np.abs(glyphs - box) < 1e-6).all(axis=(1, 2)))
            assert matches.size > 0, (i, quadrant)
        # patch labels, from the pixels: a patch with ink is labelled with its quadrant's digit
        ink = canvas.pixels.reshape(8, 8, 8, 8).any(axis=(1, 3)).reshape(-1)
        quadrant_of = np.array([(r // 4) * 2 + (c // 4) for r in range(8) for c in range(8)])
        expected = np.array([canvas.digits[q] for q in quadrant_of])
        assert (canvas.patch_digits[ink] == expected[ink]).all()
        assert ((canvas.patch_digits != BACKGROUND).sum()) == 4 * len(values)


def test_questions_are_answered_by_the_canvas() -> None:
    scenes = DigitsScenes("test", 30)
    for i in range(30):
        canvas = scenes.canvas(i)
        which, where, count = scenes.questions(i, canvas)
        quadrant = (
            QUADRANT_WORDS.index(tuple(which.words[3:5]))
            if len(which.words) > 3
            else canvas.digits.index(max(canvas.digits))
        )
        assert which.answer == (DIGIT_WORDS[canvas.digits[quadrant]],)
        asked = DIGIT_WORDS.index(where.words[3])
        assert where.answer == QUADRANT_WORDS[canvas.digits.index(asked)]
        assert count.answer == (("one", "two", "three")[canvas.count - 1],)
    assert DigitsScenes("test", 5).canvas(3).pixels.tobytes() == scenes.canvas(3).pixels.tobytes()  # fixed


def test_drill_asks_about_every_quadrant_and_every_digit() -> None:
    scenes = DigitsScenes("train", 20)
    for i in range(20):
        canvas = scenes.canvas(i)
        drill = scenes.drill(i, canvas)
        which = {q.words[3:5]: q.answer for q in drill if q.kind == "which"}
        # every quadrant asked once, answered from the pixels: ink there -> its digit, none -> EMPTY_WORD
        assert set(which) == set(QUADRANT_WORDS)
        for quadrant, words in enumerate(QUADRANT_WORDS):
            top, left = (quadrant // 2) * 32, (quadrant % 2) * 32
            inked = canvas.pixels[top : top + 32, left : left + 32].any()
            assert which[words] == ((DIGIT_WORDS[canvas.digits[quadrant]],) if inked else (EMPTY_WORD,))
        where = {q.words[3]: q.answer for q in drill if q.kind == "where"}
        assert where == {DIGIT_WORDS[d]: QUADRANT_WORDS[q] for q, d in enumerate(canvas.digits) if d >= 0}
        assert [q.answer for q in drill if q.kind == "count"] == [(("one", "two", "three")[canvas.count - 1],)]


def test_training_canvases_change_with_the_epoch_and_not_otherwise() -> None:
    scenes = DigitsScenes("train", 8)
    first = scenes.canvas(2).pixels.copy()
    assert np.array_equal(first, DigitsScenes("train", 8).canvas(2).pixels)
    scenes.set_epoch(1)
    assert not np.array_equal(first, scenes.canvas(2).pixels)


def test_processor_lays_out_llava_prompts_left_padded() -> None:
    pixels = np.zeros((2, 64, 64), dtype=np.float32)
    pixels[1, :16, :16] = 1.0
    inputs = processor(pixels, ["Which digit?", "how many digits ?"])
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == (2, 1 + 64 + 4)
    assert ids[0, 0] == PAD_ID and mask[0, 0] == 0 and ids[0, 1] == BOS_ID  # 3 question words, 1 pad
    assert (ids[:, -4:] != PAD_ID).all() and int((ids == IMAGE_ID).sum()) == 2 * IMAGE_TOKENS
    assert [WORDS[i] for i in ids[0, -3:]] == ["which", "digit", "?"]
    assert inputs["pixel_values"].shape == (2, 3, 64, 64)
    assert inputs["pixel_values"][1, 2, 0, 0] == 1.0 and inputs["pixel_values"][0, 0, 0, 0] == -1.0


def test_training_batch_labels_the_answer_and_eos_only_at_generate_positions() -> None:
    pixels = np.zeros((2, 64, 64), dtype=np.float32)
    batch = training_batch(pixels, [("which", "digit", "?"), ("where", "is", "the", "two", "?")],
                           [("seven",), ("top", "left")])  # fmt: skip
    labels, mask = batch["labels"], batch["attention_mask"]
    assert [WORDS[i] for i in labels[0][labels[0] >= 0]] == ["seven", "<eos>"]
    assert [WORDS[i] for i in labels[1][labels[1] >= 0]] == ["top", "left", "<eos>"]
    expected = torch.tensor([max(0, j - (mask.shape[1] - int(m.sum()))) for m in mask for j in range(mask.shape[1])])
    assert torch.equal(batch["position_ids"].flatten(), expected)  # 0 on padding, then 0, 1, 2, ...


def test_words_errors_and_decoding() -> None:
    assert split_words("How many digits") == ["how", "many", "digits", "?"]
    with pytest.raises(ValueError, match=r"'colour'.*knows: which"):
        processor(np.zeros((1, 64, 64)), ["which colour ?"])
    with pytest.raises(ValueError, match="question is empty"):
        split_words("  ")
    with pytest.raises(ValueError, match=r"canvases must be \(B, 64, 64\)"):
        processor(np.zeros((1, 32, 32)), ["which digit ?"])
    seven, top, left = WORDS.index("seven"), WORDS.index("top"), WORDS.index("left")
    assert decode_ids([top, left, EOS_ID, seven]) == "top left"
    assert decode_ids([PAD_ID, seven]) == "seven"

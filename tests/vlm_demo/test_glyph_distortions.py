"""The distortions of training glyphs (``DigitsScenes(augment=True)``, issue 44): the affine map checked against
hand-computed pixels, a distorted canvas keeps its digits, places and patch labels, and held-out canvases are never
distorted."""

from __future__ import annotations

import numpy as np
import pytest

from vitrim.demos.vlm.data import DIGIT, DigitsScenes, distort, warp_glyph


def _glyph() -> np.ndarray:
    return DigitsScenes("train", 1).glyphs[7].astype(np.float64)


def test_the_identity_map_keeps_the_glyph_and_a_shift_moves_it_by_whole_pixels() -> None:
    glyph = _glyph()
    assert np.array_equal(warp_glyph(glyph, np.eye(2), np.zeros(2)), glyph)
    moved = warp_glyph(glyph, np.eye(2), np.array([1.0, -2.0]))  # one pixel down, two left
    expected = np.zeros_like(glyph)
    expected[1:, :-2] = glyph[:-1, 2:]
    assert np.array_equal(moved, expected)


def test_half_a_pixel_reads_the_mean_of_two_neighbours_and_a_flip_mirrors() -> None:
    glyph = _glyph()
    half = warp_glyph(glyph, np.eye(2), np.array([0.0, 0.5]))  # output x reads the glyph at x - 0.5
    by_hand = np.zeros_like(glyph)
    by_hand[:, 0] = 0.5 * glyph[:, 0]  # beyond the left edge is background
    by_hand[:, 1:] = 0.5 * (glyph[:, :-1] + glyph[:, 1:])
    np.testing.assert_allclose(half, by_hand, rtol=0, atol=1e-12)
    # a map about the centre: x -> -x mirrors the glyph left to right
    np.testing.assert_allclose(warp_glyph(glyph, np.diag([1.0, -1.0]), np.zeros(2)), glyph[:, ::-1], atol=1e-12)


def test_distortions_are_seeded_and_stay_ink_in_the_glyphs_box() -> None:
    glyph = _glyph().astype(np.float32)
    first = [distort(glyph, np.random.default_rng([3, k])) for k in range(20)]
    again = [distort(glyph, np.random.default_rng([3, k])) for k in range(20)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert all(a.shape == (DIGIT, DIGIT) and a.dtype == np.float32 for a in first)
    assert all(a.min() >= 0.0 and a.max() <= 1.0 for a in first)
    assert sum(not np.array_equal(a, glyph) for a in first) == 20  # every draw moves something
    assert len({a.tobytes() for a in first}) == 20


def test_an_augmented_canvas_has_the_plain_canvas_digits_places_and_labels() -> None:
    plain, augmented = DigitsScenes("train", 30, seed=2), DigitsScenes("train", 30, seed=2, augment=True)
    for scenes in (plain, augmented):
        scenes.set_epoch(4)
    changed = 0
    for i in range(30):
        a, b = plain.canvas(i), augmented.canvas(i)
        assert a.digits == b.digits and np.array_equal(a.patch_digits, b.patch_digits)
        # ink only inside the digits' 2×2-patch boxes, as on the plain canvas
        outside = np.repeat(np.repeat(a.patch_digits.reshape(8, 8) == 10, 8, 0), 8, 1)
        assert not b.pixels[outside].any()
        changed += not np.array_equal(a.pixels, b.pixels)
    assert changed == 30


def test_held_out_canvases_are_never_distorted() -> None:
    with pytest.raises(ValueError, match="augment"):
        DigitsScenes("test", 4, augment=True)

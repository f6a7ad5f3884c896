"""ImageSpans from an image-token mask, against positions written out by hand."""

from __future__ import annotations

import pytest
import torch

from vitrim.vlm.stages.spans import spans_from_mask


def test_two_samples_three_images_with_padding_by_hand() -> None:
    # sample 0: pad, text, image A (3 tokens), text, image B (2 tokens); sample 1: text, image C (2 tokens), pad
    is_image = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    spans = spans_from_mask(is_image, [3, 2, 2])
    assert spans.image_of.tolist() == [[-1, -1, 0, 0, 0, -1, 1, 1], [-1, 2, 2, -1, -1, -1, -1, -1]]
    assert spans.token_of.tolist() == [[-1, -1, 0, 1, 2, -1, 0, 1], [-1, 0, 1, -1, -1, -1, -1, -1]]
    assert spans.num_images == 3 and torch.equal(spans.is_image, is_image)


def test_adjacent_images_are_told_apart_by_their_counts() -> None:
    spans = spans_from_mask(torch.ones(1, 5, dtype=torch.bool), [2, 3])
    assert spans.image_of.tolist() == [[0, 0, 1, 1, 1]] and spans.token_of.tolist() == [[0, 1, 0, 1, 2]]


def test_counts_that_disagree_with_the_mask_are_an_error() -> None:
    with pytest.raises(ValueError, match=r"the input holds 4 image tokens but the images give 5 \(3, 2 per image\)"):
        spans_from_mask(torch.tensor([[1, 1, 1, 1]], dtype=torch.bool), [3, 2])

"""The digits video model's inputs are what transformers' own Qwen2-VL video processor writes, and its prompts hold
the video where Qwen2-VL puts it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vitrim.demos.video.data import FRAME, FRAMES, MERGE, PATCH, TEMPORAL_PATCH  # noqa: E402
from vitrim.demos.video.words import (  # noqa: E402
    GRID_THW,
    VIDEO_ID,
    VIDEO_TOKENS,
    decode_ids,
    encode_words,
    processor,
    video_patches,
)


def test_video_patches_equal_qwen2_vl_video_processor() -> None:
    frames = np.random.default_rng(0).random((2, FRAMES, FRAME, FRAME), dtype=np.float32)  # frames of a pair differ
    reference = transformers.Qwen2VLVideoProcessor(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL_PATCH, do_resize=False, do_rescale=False,
        image_mean=[0.5] * 3, image_std=[0.5] * 3, do_sample_frames=False, cap_pixels_per_frame=False,
    )  # fmt: skip
    videos = [torch.from_numpy(clip)[:, None].expand(-1, 3, -1, -1) for clip in frames]  # (F, 3, H, W) grey
    expected = reference(videos=videos, return_tensors="pt")
    assert expected["video_grid_thw"].tolist() == [list(GRID_THW)] * 2
    torch.testing.assert_close(video_patches(frames), expected["pixel_values_videos"], rtol=0, atol=1e-6)


def test_a_prompt_holds_the_video_between_vision_start_and_end_left_padded() -> None:
    frames = np.zeros((2, FRAMES, FRAME, FRAME), np.float32)
    inputs = processor(frames, ["which digit appears ?", "how many frames show it"])
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == (2, 2 + VIDEO_TOKENS + 1 + 6) and mask[0, 0] == 0 and mask[1].all()
    assert (inputs["mm_token_type_ids"] == 2).sum(1).tolist() == [VIDEO_TOKENS] * 2
    assert ((ids == VIDEO_ID) == (inputs["mm_token_type_ids"] == 2)).all()
    assert decode_ids([*encode_words(["first", "half"]), 2, 5]) == "first half"
    with pytest.raises(ValueError, match="does not know the word 'colour'"):
        processor(frames[:1], ["which colour ?"])
    with pytest.raises(ValueError, match=r"clips must be \(B, 8, 32, 32\)"):
        video_patches(frames[:, :4])

"""vitrim.eval.video: what a video of an lmms-eval request may be, and which frames are read of it.

The reference for the sampling is lmms-eval's Qwen models' rule written out here (qwen_vl_utils: ``nframes``
evenly spaced, ``torch.linspace(0, T - 1, n).round()``), and the frames themselves those written (a folder, an
array) or decoded by PyAV directly from the file (the clip's frames, read without transformers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lmms_eval")

from PIL import Image

from tiny_vlms.clips import CLIP_FPS, write_clip
from vitrim.eval.video import frame_indices, is_video, read_clip


def evenly(total: int, count: int) -> list[int]:
    """``count`` of ``total`` frames evenly spaced, rounded half to even (Python's round, as torch.round)."""
    return sorted({round(i * (total - 1) / max(count - 1, 1)) for i in range(count)})


def test_a_file_is_decoded_and_sampled_by_count_or_by_rate(tmp_path: Path) -> None:
    import av

    path = write_clip(tmp_path / "clip.mp4", 10, 16, 24, seed=0)
    with av.open(str(path)) as container:
        every = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    clip = read_clip(str(path), max_num_frames=4, fps=None)
    assert clip.record()["frame_indices"] == evenly(10, 4)
    np.testing.assert_array_equal(clip.frames, every[evenly(10, 4)])
    at_rate = read_clip(path, max_num_frames=32, fps=2.0)  # 10 frames at 4 fps, read at 2 fps: 5 frames
    assert at_rate.record()["frame_indices"] == evenly(10, 5)
    assert (at_rate.record()["fps"], at_rate.record()["sampled_fps"]) == (CLIP_FPS, 2.0)


def test_frames_as_an_array_a_folder_or_a_list(tmp_path: Path) -> None:
    frames = np.random.default_rng(0).integers(0, 256, (6, 8, 12, 3), dtype=np.uint8)
    for number, frame in enumerate(frames):
        Image.fromarray(frame).save(tmp_path / f"{number:03d}.png")
    pictures = [Image.fromarray(frame) for frame in frames]
    for visual in (frames, str(tmp_path), pictures):
        assert is_video(visual)
        clip = read_clip(visual, max_num_frames=3, fps=None)
        np.testing.assert_array_equal(clip.frames, frames[evenly(6, 3)])
        assert clip.record()["fps"] is None
    assert not is_video(pictures[0]) and not is_video(str(tmp_path / "000.png"))
    with pytest.raises(ValueError, match=r"fps=2\.0: frames handed as an array or a folder carry no frame rate"):
        read_clip(frames, max_num_frames=3, fps=2.0)
    with pytest.raises(ValueError, match=r"shape \(6, 8, 12\) and dtype uint8: expected \(T, H, W, 3\) uint8"):
        read_clip(frames[..., 0], 3, None)
    with pytest.raises(ValueError, match="no such file"):
        read_clip(str(tmp_path / "missing.mp4"), 3, None)


def test_frame_indices_never_exceed_the_clip() -> None:
    assert frame_indices(3, 32, None, None).tolist() == [0, 1, 2]
    assert frame_indices(100, 4, 30.0, 0.1).tolist() == [0]  # 3.3 s at 0.1 fps: one frame
    assert frame_indices(100, 4, 30.0, 30.0).tolist() == evenly(100, 4)

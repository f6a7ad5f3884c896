"""Tiny video clips written as files (PyAV's MPEG-4 encoder), for the tests that hand a model a video path as
lmms-eval's video tasks do: :data:`CLIPS` of different lengths and shapes at :data:`CLIP_FPS`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLIP_FPS = 4
CLIPS = ((8, 24, 16), (3, 16, 24), (8, 16, 24), (5, 24, 16))  # (frames, height, width) of each clip


def write_clip(path: Path, frames: int, height: int, width: int, seed: int, fps: int = CLIP_FPS) -> Path:
    """An MPEG-4 clip at ``path`` of ``frames`` frames of ``height`` × ``width`` at ``fps``: a random still with a
    white 8×8 square moving 2 px right per frame (the frames differ, so a video method has something to drop)."""
    import av

    still = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        for t in range(frames):
            picture = still.copy()
            left = (2 * t) % (width - 8)
            picture[:8, left : left + 8] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path

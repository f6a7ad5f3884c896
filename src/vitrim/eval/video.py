"""A video of an lmms-eval request: read, sampled to the frames the model sees, and described for the record.

lmms-eval's video tasks hand a simple model each video as a path (``doc_to_visual`` returns ``[path]``, e.g.
VideoMME's ``.mp4``). :func:`read_clip` takes:

- a video file (a path whose suffix is in :data:`VIDEO_SUFFIXES`): decoded with PyAV through transformers'
  ``load_video(..., backend="pyav")`` (PyAV is what the eval environment holds; decord is not installed), which
  reads the container's frame rate into the clip's ``VideoMetadata``;
- a folder of frame images (sorted by name), a ``(T, H, W, 3)`` uint8 array or tensor, or a list or tuple of PIL
  frames (nested inside ``doc_to_visual``'s list, where a flat list means several pictures): frames with no frame
  rate (``fps`` unknown: sampled by count only).

Frames are sampled as lmms-eval's Qwen3-VL model asks ``qwen_vl_utils`` to sample them: with no ``fps``,
``k = min(max_num_frames, T)`` frames evenly spaced over the clip (``round(linspace(0, T-1, k))``, rounded half to
even as ``torch.round``); with ``fps``, ``k = int(T / clip_fps · fps)`` (at least 1, at most ``max_num_frames`` and
T; transformers' default sampler's count) spaced the same way. Two of ``qwen_vl_utils``' rules are not copied:
it rounds k to a multiple of 2 (its ``FRAME_FACTOR``; here a Qwen processor repeats the last frame to fill a
temporal patch of 2), and at a given ``fps`` it reads at least 4 frames. The processor then gets the sampled frames
with their metadata (``do_sample_frames=False``): Qwen2.5-VL reads the sampled frame rate from it
(``second_per_grid_ts``, the temporal positions), Qwen3-VL the timestamps it writes before each temporal patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
DECODER = "pyav"


@dataclass(frozen=True)
class Clip:
    """The sampled frames of one video, ``(T, H, W, 3)`` uint8 RGB, and transformers' ``VideoMetadata`` (the clip's
    frame count and rate, the sampled indices)."""

    frames: np.ndarray
    metadata: Any
    source: str  # "file", "folder" or "frames"

    def record(self) -> dict[str, Any]:
        """What decides this video's tokens besides the method: the frames read, at which rate, their size."""
        meta = self.metadata
        return {
            "source": self.source,
            "frames": int(self.frames.shape[0]),
            "frame_indices": [int(i) for i in meta.frames_indices],
            "total_frames": int(meta.total_num_frames),
            "fps": None if meta.fps is None else float(meta.fps),
            "sampled_fps": None if meta.fps is None else float(meta.sampled_fps),
            "size": [int(self.frames.shape[1]), int(self.frames.shape[2])],
        }


def is_video(visual: Any) -> bool:
    """Whether an entry of ``doc_to_visual``'s list is one video (:func:`read_clip`'s kinds) rather than a picture."""
    import torch
    from PIL import Image

    if isinstance(visual, (str, Path)):
        path = Path(visual)
        return path.suffix.lower() in VIDEO_SUFFIXES or path.is_dir()
    if isinstance(visual, (np.ndarray, torch.Tensor)):
        return visual.ndim == 4
    return isinstance(visual, (list, tuple)) and bool(visual) and all(isinstance(f, Image.Image) for f in visual)


def frame_indices(total: int, max_num_frames: int, clip_fps: float | None, fps: float | None) -> np.ndarray:
    """The frames sampled from a clip of ``total`` frames at ``clip_fps`` (module doc)."""
    if fps is None:
        count = min(max_num_frames, total)
    elif clip_fps is None:
        raise ValueError(
            f"model_args fps={fps}: frames handed as an array or a folder carry no frame rate to sample at"
        )
    else:
        count = max(1, min(max_num_frames, total, int(total / clip_fps * fps)))
    return np.unique(np.round(np.linspace(0, total - 1, count)).astype(int))


def read_clip(visual: Any, max_num_frames: int, fps: float | None) -> Clip:
    """One video of a request as its sampled frames (module doc); ``ValueError`` naming what could not be read."""
    from transformers.video_utils import VideoMetadata, load_video

    if isinstance(visual, (str, Path)) and Path(visual).suffix.lower() in VIDEO_SUFFIXES:
        path = Path(visual)
        if not path.is_file():
            raise ValueError(f"video {str(path)!r}: no such file")

        def sample(metadata: Any, **_: Any) -> np.ndarray:
            return frame_indices(metadata.total_num_frames, max_num_frames, metadata.fps, fps)

        location: Any = str(path)  # transformers types a path as its own URL/Path aliases
        frames, metadata = load_video(location, backend=DECODER, sample_indices_fn=sample)
        return Clip(np.asarray(frames, dtype=np.uint8), metadata, "file")
    source = "folder" if isinstance(visual, (str, Path)) else "frames"
    every = _folder_frames(Path(visual)) if source == "folder" else _frames(visual)
    indices = frame_indices(len(every), max_num_frames, None, fps)
    metadata = VideoMetadata(
        total_num_frames=len(every),
        fps=None,
        height=every.shape[1],
        width=every.shape[2],
        frames_indices=indices.tolist(),
    )
    return Clip(every[indices], metadata, source)


def _folder_frames(folder: Path) -> np.ndarray:
    from PIL import Image

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not files:
        raise ValueError(f"video folder {str(folder)!r}: no frame images ({', '.join(FRAME_SUFFIXES)})")
    return _frames([Image.open(p) for p in files])


def _frames(visual: Any) -> np.ndarray:
    """``(T, H, W, 3)`` uint8 frames of an array, a tensor or a list of PIL images, all of one size."""
    import torch

    if isinstance(visual, (list, tuple)):
        arrays = [np.asarray(frame.convert("RGB")) for frame in visual]
        if len({a.shape for a in arrays}) != 1:
            raise ValueError(f"video frames of different sizes: {sorted({a.shape[:2] for a in arrays})}")
        visual = np.stack(arrays)
    if isinstance(visual, torch.Tensor):
        visual = visual.cpu().numpy()
    if visual.ndim != 4 or visual.shape[-1] != 3 or visual.dtype != np.uint8 or visual.shape[0] < 1:
        raise ValueError(
            f"video frames of shape {tuple(visual.shape)} and dtype {visual.dtype}: expected (T, H, W, 3) uint8, T >= 1"
        )
    return visual

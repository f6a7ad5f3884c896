"""What the video methods share: ``video_pruning_rate`` (vLLM's name, the fraction of a video's tokens pruned),
the view of one video's tokens as temporal patches, and segments of them from cut points.

A video method (``reads_time``) selects over a whole video: its :class:`~vitrim.vlm.method.base.VisionEvidence`
holds ONE video (I = 1) of N = t·rows·cols merged tokens in raster order ``(t, row, column)``, ``grid`` the
(rows, columns) of one temporal patch. It decides its own count, so ``keep=`` is not taken; images in the same
prompt keep every token (the family runs video methods on videos only).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from vitrim.vlm.method.base import Method, VisionEvidence

DEFAULT_RATE = 0.75  # EVS's 75 % pruned (vLLM's Cosmos-Reason1 figure); VidCom2's 25 % kept setting


class VideoMethod(Method):
    """Base of the pre-LLM methods that select over a video's time axis (``reads_time``)."""

    defaults: ClassVar[Mapping[str, Any]] = {"video_pruning_rate": DEFAULT_RATE}
    reads_time = True
    scores_projected = True  # they read the merged embeddings (the LLM's input), as vLLM's functions do

    def check(self) -> None:
        rate = self.options["video_pruning_rate"]
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
            raise ValueError(f"video_pruning_rate={rate!r} must be a float in [0, 1) (the fraction of tokens pruned)")


def video_tokens(evidence: VisionEvidence) -> tuple[Tensor, int, int]:
    """One video's merged embeddings (t, P, E) from ``evidence`` (I = 1, ``projected`` (1, N, E), ``grid``), its
    temporal patches t and tokens per temporal patch P; ``ValueError`` when the grid does not hold N."""
    if evidence.projected is None or evidence.grid is None or evidence.projected.shape[0] != 1:
        raise ValueError("a video method reads one video's merged embeddings and its grid (VisionEvidence.projected)")
    rows, columns = evidence.grid
    per_frame = rows * columns
    tokens = evidence.projected[0]
    if tokens.shape[0] % per_frame:
        raise ValueError(
            f"a video grid of {rows} × {columns} tokens per temporal patch does not hold {tokens.shape[0]}"
        )
    frames = tokens.shape[0] // per_frame
    return tokens.reshape(frames, per_frame, -1), frames, per_frame


def sizes_from_cuts(cuts: list[int], length: int) -> list[int]:
    """Segment sizes of ``length`` items cut after each (sorted, distinct) index in ``cuts``."""
    bounds = [-1, *cuts, length - 1]
    return [after - before for before, after in itertools.pairwise(bounds) if after > before]

"""vitrim's ``evs`` and ``vidcom2`` pick the same video tokens as vLLM's own in-tree functions
(``vllm.multimodal.video_prune``), token for token, on the same merged embeddings and grids: the kept indices and
the counts (the count vLLM sizes its placeholders with at prompt processing) over many seeds, clip lengths, sizes,
rates and dtypes, the one-temporal-patch clip included. No engine starts here."""

from __future__ import annotations

import itertools

import pytest
import torch

evs_in_tree = pytest.importorskip("vllm.multimodal.video_prune.evs")
vidcom2_in_tree = pytest.importorskip("vllm.multimodal.video_prune.vidcom2")

from vitrim.vlm.method.evs import evs_count, evs_keep  # noqa: E402
from vitrim.vlm.method.vidcom2 import vidcom2_count, vidcom2_keep  # noqa: E402

MERGE = 2
GRIDS = [(1, 4, 4), (1, 8, 6), (2, 4, 6), (3, 6, 6), (5, 4, 8), (8, 8, 8), (16, 6, 10)]  # (t, h, w) in patches
RATES = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
SEEDS = range(6)
DTYPES = [torch.float32, torch.bfloat16]


def embeddings(grid: tuple[int, int, int], seed: int, dtype: torch.dtype, width: int = 24) -> torch.Tensor:
    """(N, E) merged embeddings of a clip whose temporal patches drift from one another (some cells barely change,
    as in a real video, so EVS's ranking is not a coin toss), and, for even seeds, repeated temporal patches (ties)."""
    t, h, w = grid
    per_frame = (h // MERGE) * (w // MERGE)
    generator = torch.Generator().manual_seed(seed)
    frames = [torch.randn(per_frame, width, generator=generator)]
    for _ in range(1, t):
        moving = (torch.rand(per_frame, 1, generator=generator) < 0.4).float()
        step = torch.randn(per_frame, width, generator=generator) * (0.05 + moving)
        frames.append(frames[-1] if seed % 2 == 0 and torch.rand(1, generator=generator) < 0.3 else frames[-1] + step)
    return torch.cat(frames).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "keep, count, in_tree",
    [(evs_keep, evs_count, evs_in_tree), (vidcom2_keep, vidcom2_count, vidcom2_in_tree)],
    ids=["evs", "vidcom2"],
)
def test_vitrim_keeps_what_vllms_in_tree_function_keeps(keep, count, in_tree, dtype: torch.dtype) -> None:
    compared = 0
    for grid, rate, seed in itertools.product(GRIDS, RATES, SEEDS):
        tokens = embeddings(grid, seed, dtype)
        theirs = in_tree.compute_retention_mask(tokens, grid, MERGE, rate).nonzero()[:, 0]
        t, h, w = grid
        per_frame = (h // MERGE) * (w // MERGE)
        ours = keep(tokens.reshape(t, per_frame, -1), rate)
        assert torch.equal(ours, theirs), (grid, rate, seed, dtype)
        assert count(per_frame, t, rate) == in_tree.compute_retained_tokens_count(per_frame, t, rate) == len(ours)
        if t == 1 and keep is evs_keep:
            assert len(ours) == per_frame  # EVS never prunes a one-temporal-patch clip
        compared += 1
    assert compared == len(GRIDS) * len(RATES) * len(SEEDS) == 294

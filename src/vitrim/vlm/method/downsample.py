"""``downsample``: pool the image's token grid to ``keep`` tokens, each the mean of a cell of the grid - the baseline
every token-reduction table now reports beside ``random`` (a 2026 benchmark, VTC-Bench, finds it ahead of many
pruning methods).

The cells, for an R × C token grid (``VisionEvidence.token_grid``) and k = ``keep`` tokens:

1. r horizontal bands, band i holding rows ⌊i·R/r⌋ … ⌊(i+1)·R/r⌋ − 1, for an r in [⌈k / C⌉, min(R, k)];
2. band i splits into c_i = ⌊k / r⌋ cells, the first k mod r bands one more (so Σ c_i = k, c_i ≤ C); cell j of a
   band holds columns ⌊j·C/c_i⌋ … ⌊(j+1)·C/c_i⌋ − 1;
3. r is the one whose cells are most nearly equal (the largest cell's token count minus the smallest's, least),
   then whose mean cell (R / r rows by C·r / k columns) is most nearly square, then the fewest bands.

So a keep that tiles the grid evenly is plain average pooling (576 tokens of 24 × 24 to 64: 8 × 8 cells of 3 × 3,
as ``avg_pool2d``; to 192: 8 bands of 24 cells of 3 × 1), and any other keep or grid (128 of 24 × 24: 24 one-row bands
of 5 or 6 cells of 4 or 5 tokens; Qwen's non-square grids) gets the most even cells this layout allows. Every token is
in exactly one cell.

Each cell becomes one token: the mean of its tokens' features (``VisionEvidence.features``, what the projector
reads, so LLaVA's LLM sees projector(mean), Gemma 3's the norm and matmul of the mean of its pooled states, Qwen's
the merger of the mean patch states), in the slot of the cell's first token in raster order (its top-left), which
keeps that token's position. No [CLS] attention or other signal is read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost


def band_count(rows: int, columns: int, keep: int) -> int:
    """The number r of horizontal bands for ``keep`` cells of a ``rows`` × ``columns`` grid (module docstring)."""

    def cost(bands: int) -> tuple[int, float, int]:
        sizes = [len(cell) for cell in banded_cells(rows, columns, keep, bands)]
        squareness = abs(math.log((rows / bands) / (columns * bands / keep)))
        return (max(sizes) - min(sizes), round(squareness, 12), bands)

    return min(range(-(-keep // columns), min(rows, keep) + 1), key=cost)


def banded_cells(rows: int, columns: int, keep: int, bands: int) -> list[Tensor]:
    """``keep`` cells in ``bands`` bands (steps 1-2 of the module docstring): per cell its raster indices."""
    base, extra = divmod(keep, bands)
    raster = torch.arange(rows * columns).view(rows, columns)
    cells = []
    for band in range(bands):
        top, bottom = band * rows // bands, (band + 1) * rows // bands
        count = base + (1 if band < extra else 0)
        for cell in range(count):
            left, right = cell * columns // count, (cell + 1) * columns // count
            cells.append(raster[top:bottom, left:right].reshape(-1))
    return cells


def grid_cells(rows: int, columns: int, keep: int) -> list[Tensor]:
    """``keep`` cells of a ``rows`` × ``columns`` raster grid: per cell, its raster indices (ascending), cells in
    raster order (band by band, left to right). 1 ≤ keep ≤ rows · columns."""
    if not 1 <= keep <= rows * columns:
        raise ValueError(f"keep={keep} must be in 1 … {rows * columns} for a {rows}×{columns} grid")
    return banded_cells(rows, columns, keep, band_count(rows, columns, keep))


def downsample_select(features: Tensor, grid: tuple[int, int], keep: int) -> ImageSelection:
    """One image: features (N, D) on a ``grid`` (rows, columns) raster, pooled to ``keep`` cell means."""
    cells = [cell.to(features.device) for cell in grid_cells(*grid, keep)]
    slots = torch.stack([cell[0] for cell in cells])  # (k,) each cell's top-left token: ascending, as the cells
    merged = torch.stack([features[cell].mean(0) for cell in cells])  # (k, D)
    return ImageSelection(kept=slots, groups=tuple(cells), merged=merged)


@register_method("downsample", stage="pre_llm")
class Downsample(Method):
    """Pool the token grid to ``keep`` cell means (no options of its own; ``keep=`` sets the count)."""

    reads_grid = True

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        grid = evidence.token_grid()
        return [downsample_select(features, grid, keep) for features in evidence.features]

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        return MethodCost.before_llm(keep)  # cell means: sums, no products

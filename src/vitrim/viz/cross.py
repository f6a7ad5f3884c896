"""The cross-attention picture: target words (rows) × source words (columns), the true alignment marked.

Drawn on its own Agg canvas like every vitrim figure (see :mod:`vitrim.viz.maps`); matplotlib is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from vitrim.viz.maps import new_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def draw_cross_attention(
    ax: Axes,
    weights: Tensor,
    source: Sequence[str],
    target: Sequence[str],
    alignment: Sequence[int | None] | None = None,
    *,
    title: str = "",
    numbers: bool = True,
) -> None:
    """Draw one (Lt, Ls) attention matrix on ``ax``: rows are target tokens, columns source tokens.

    ``alignment[i]``: the source index aligned to target row i (a red frame), or None; the largest weight of each
    row gets a white dot, so a row is right when its dot sits in its frame.
    """
    matrix = weights.detach().float().cpu()
    if matrix.dim() != 2 or matrix.shape != (len(target), len(source)):
        raise ValueError(
            f"weights must have shape (len(target), len(source)) = ({len(target)}, {len(source)}), "
            f"got {tuple(matrix.shape)}"
        )
    ax.imshow(matrix.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    if numbers:
        for i, row in enumerate(matrix.tolist()):
            for j, value in enumerate(row):
                ax.text(j, i + 0.28, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if value > 0.6 else "white")  # fmt: skip
    best = matrix.argmax(-1).tolist()
    ax.scatter(best, range(len(target)), s=18, c="white", edgecolors="black", linewidths=0.5, zorder=3)
    if alignment is not None:
        from matplotlib.patches import Rectangle

        for i, aligned in enumerate(alignment):
            if aligned is not None:
                ax.add_patch(
                    Rectangle((aligned - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2, zorder=2)
                )
    ax.set_xticks(range(len(source)), list(source), rotation=45, ha="right", fontsize=9)
    ax.set_yticks(range(len(target)), list(target), fontsize=9)
    ax.set_xlabel("source (keys, values)", fontsize=8)
    ax.set_ylabel("target (queries)", fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)


def plot_cross_attention(
    weights: Tensor,
    source: Sequence[str],
    target: Sequence[str],
    alignment: Sequence[int | None] | None = None,
    *,
    title: str = "",
) -> Figure:
    """One figure with :func:`draw_cross_attention` and a legend line under it."""
    fig = new_figure((max(4.8, 1.6 + 0.75 * len(source)), 2.0 + 0.5 * len(target)))
    ax = fig.subplots()
    draw_cross_attention(ax, weights, source, target, alignment, title=title)
    legend = "dot: largest weight of the row" + ("; red frame: true alignment" if alignment is not None else "")
    fig.supxlabel(legend, fontsize=7)
    return fig

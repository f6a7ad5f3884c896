"""Labels for the points of a scatter plot that never overlap, however close the points (the demo's accuracy vs
speed: two models can sit on one spot).

The labels stand in one column just right of the axes, stacked bottom to top in the order of their points' heights,
each joined to its point by a thin line. Each label's slot starts where the one below it ends, plus a gap, measured
in points (1/72 inch) from the text's own rendered height, so no two label boxes can intersect, at any dpi and
whatever the layout does to the axes afterwards (the offsets are fixed in points from the axes' corner; the column
moves with the axes as a whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GAP_POINTS = 3.0  # white space between two labels


def label_points(
    ax: Any, points: Sequence[tuple[float, float]], texts: Sequence[str], *, fontsize: float = 8
) -> list[Any]:
    """Label ``points`` (x, y in data coordinates) with ``texts`` in a column right of ``ax`` (module doc); returns
    the annotations, lowest point's first."""
    if len(points) != len(texts):
        raise ValueError(f"points and texts must pair up, got {len(points)} points and {len(texts)} texts")
    from matplotlib.text import Text

    figure = ax.figure
    renderer = figure.canvas.get_renderer()
    order = sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0]))  # bottom to top
    annotations = [
        ax.annotate(
            texts[i],
            xy=points[i],
            xytext=(1.03, 0.0),
            textcoords=("axes fraction", "axes points"),
            fontsize=fontsize,
            va="bottom",
            ha="left",
            annotation_clip=False,
            arrowprops={"arrowstyle": "-", "color": "0.5", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 3},
        )
        for i in order
    ]
    # the text's box alone (an Annotation's own extent includes its line), in points
    heights = [Text.get_window_extent(a, renderer).height * 72 / figure.dpi for a in annotations]
    # cosmetic only (the slots below are what keeps labels apart): the column starts level with the lowest point and
    # is moved down as far as it must to end inside the axes' height
    ax.autoscale_view()
    lowest = (ax.transData + ax.transAxes.inverted()).transform(points[order[0]])[1]  # axes fraction
    axes_points = ax.get_window_extent(renderer).height * 72 / figure.dpi
    total = sum(heights) + GAP_POINTS * (len(heights) - 1)
    bottom = max(0.0, min(lowest * axes_points - heights[0] / 2, axes_points - total)) if heights else 0.0
    for annotation, height in zip(annotations, heights):
        annotation.xyann = (1.03, bottom)
        bottom += height + GAP_POINTS
    return annotations

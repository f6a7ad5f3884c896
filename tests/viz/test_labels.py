"""Scatter labels never overlap: coincident points, crowded points, any dpi; each label stays on the picture."""

from __future__ import annotations

import io
import itertools

import pytest

pytest.importorskip("matplotlib")

from matplotlib.text import Text

from vitrim.viz.labels import label_points
from vitrim.viz.maps import new_figure, save_figure


def _boxes(points: list[tuple[float, float]], dpi: int) -> tuple[list, object]:
    fig = new_figure((6.4, 3.6))
    fig.set_dpi(dpi)
    ax = fig.subplots()
    for point in points:
        ax.scatter(*point)
    texts = [f"model_{i}\n{i * 1.5:.1f} MFLOPs" for i in range(len(points))]
    annotations = label_points(ax, points, texts)
    save_figure(fig, io.BytesIO(), dpi=dpi)  # layout and drawing as the demo writes it
    renderer = fig.canvas.get_renderer()
    return [Text.get_window_extent(a, renderer) for a in annotations], fig.bbox  # the text boxes, lines aside


CROWDED = [(1000.0, 96.5), (1000.0, 96.5), (905.0, 96.6), (910.0, 89.9), (2000.0, 80.0), (2010.0, 80.1)]  # 2 on 1 spot


@pytest.mark.parametrize("dpi", [100, pytest.param(200, marks=pytest.mark.full)])
@pytest.mark.parametrize("points", [CROWDED])
def test_no_two_label_boxes_intersect_and_all_stay_on_the_figure(points: list, dpi: int) -> None:
    boxes, figure = _boxes(points, dpi)
    assert len(boxes) == len(points) and all(box.height > 0 and box.width > 0 for box in boxes)
    for a, b in itertools.combinations(boxes, 2):
        overlap_x = min(a.x1, b.x1) - max(a.x0, b.x0)
        overlap_y = min(a.y1, b.y1) - max(a.y0, b.y0)
        assert overlap_x <= 0 or overlap_y <= 0, (a, b)
    for box in boxes:
        assert figure.x0 <= box.x0 and box.x1 <= figure.x1 + 0.5 and figure.y0 <= box.y0 and box.y1 <= figure.y1 + 0.5


def test_points_and_texts_must_pair_up() -> None:
    ax = new_figure((3.0, 3.0)).subplots()
    with pytest.raises(ValueError, match="2 points and 1 texts"):
        label_points(ax, [(0.0, 0.0), (1.0, 1.0)], ["one"])

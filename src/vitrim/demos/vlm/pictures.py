"""The digits VLM demo's pictures: accuracy against tokens kept, what each method kept, FastV's attention.

Kept tokens are drawn on the 8×8 patch grid of the canvas: a patch whose token reaches the LLM keeps its pixels and
a red outline (so a kept blank patch shows too), a pruned one is washed out towards white; where a method merged
several patches into one token, those patches are tinted one colour per group.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from vitrim.demos.vlm.data import CANVAS, PATCH, QUESTION_TYPES
from vitrim.demos.vlm.sweep import KEPT_FRACTIONS
from vitrim.demos.vlm.words import IMAGE_TOKENS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GRID = CANVAS // PATCH
WASH = 0.8


def render_groups(pixels: np.ndarray, groups: Sequence[Tensor | np.ndarray]) -> np.ndarray:
    """(CANVAS, CANVAS, 3) RGB in [0, 1]: ink dark on white; patches in no group washed out, merged groups tinted.

    pixels: (CANVAS, CANVAS) ink in [0, 1]; groups: one LongTensor of patch indices (raster order) per LLM token
    (an empty one is the tower's [CLS], which covers no patch: VisionZip hands it to the LLM).
    """
    from matplotlib import colormaps

    grey = 1.0 - np.asarray(pixels, dtype=np.float32)  # ink dark
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    kept = np.zeros(IMAGE_TOKENS, dtype=bool)
    tint = np.full((IMAGE_TOKENS, 3), np.nan, dtype=np.float32)
    palette = colormaps["tab10"]
    merged = 0
    for group in groups:
        indices = np.asarray(group, dtype=np.int64).reshape(-1)
        if indices.size == 0:
            continue  # the [CLS] token: on no patch
        if indices.min() < 0 or indices.max() >= IMAGE_TOKENS:
            raise ValueError(f"a group's indices must lie in [0, {IMAGE_TOKENS}), got {indices.tolist()}")
        kept[indices] = True
        if indices.size > 1:
            tint[indices] = palette(merged % 10)[:3]
            merged += 1
    for index in range(IMAGE_TOKENS):
        r, c = divmod(index, GRID)
        block = rgb[r * PATCH : (r + 1) * PATCH, c * PATCH : (c + 1) * PATCH]
        if not kept[index]:
            block[:] = WASH + (1 - WASH) * block
        elif not np.isnan(tint[index, 0]):
            block[:] = 0.55 * block + 0.45 * tint[index]
    return rgb


def plot_selections(
    pixels: np.ndarray, selections: Mapping[str, Sequence[Tensor] | None], *, title: str, columns: int = 6
) -> Figure:
    """One panel per method: the canvas with that method's tokens (``None``: the method did not run)."""
    from matplotlib.patches import Rectangle

    from vitrim.viz.maps import new_figure

    names = ["full model", *selections]
    rows = -(-len(names) // columns)
    fig = new_figure((max(4.5, 1.9 * min(columns, len(names))), 2.1 * rows + 0.5))
    axes = np.atleast_1d(fig.subplots(rows, min(columns, len(names)))).reshape(-1)
    everything: list[Tensor | np.ndarray] = [np.array([i]) for i in range(IMAGE_TOKENS)]
    for ax, name in zip(axes, names):
        groups: Sequence[Tensor | np.ndarray] | None = everything if name == "full model" else selections[name]
        if groups is None:
            ax.text(0.5, 0.5, "not run", ha="center", va="center")
        else:
            ax.imshow(render_groups(pixels, groups), interpolation="nearest")
            for group in groups if name != "full model" else ():  # outline what entered alone: blank ones show too
                indices = np.asarray(group).reshape(-1)
                if indices.size == 1:
                    r, c = divmod(int(indices[0]), GRID)
                    ax.add_patch(Rectangle((c * PATCH - 0.5, r * PATCH - 0.5), PATCH, PATCH, fill=False,
                                           edgecolor="tab:red", lw=0.8))  # fmt: skip
        entering = IMAGE_TOKENS if groups is None else len(groups)
        ax.set_title(f"{name} ({entering})", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes[len(names) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=8, wrap=True)
    return fig


def plot_attention(pixels: np.ndarray, weights: Tensor, *, title: str) -> Figure:
    """The canvas beside a heat map of ``weights`` (64,) over its 8×8 patches."""
    from vitrim.viz.maps import new_figure

    fig = new_figure((5.0, 2.6))
    left, right = fig.subplots(1, 2)
    left.imshow(1.0 - pixels, cmap="gray", vmin=0, vmax=1)
    left.set_title("canvas", fontsize=8)
    image = right.imshow(weights.reshape(GRID, GRID).numpy(), cmap="viridis")
    right.set_title("attention over the 64 image tokens", fontsize=8)
    fig.colorbar(image, ax=right, fraction=0.046)
    for ax in (left, right):
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(textwrap.fill(title, 70), fontsize=8)  # a figure this narrow cuts a long title off
    return fig


def plot_accuracy_vs_kept(
    summary: dict[str, Any], *, kinds: Sequence[str] = QUESTION_TYPES, tokens: int = IMAGE_TOKENS, unit: str = "image"
) -> Figure:
    """A panel per question type: accuracy against image tokens kept, a line per method, the full model at 64 tokens
    as a grey line. The line says where the method cuts (solid: before the LLM; dash-dot: inside it; dotted: inside
    the tower); the seeded baselines are dashed (black: before the LLM, grey: in the tower): their mean over seeds,
    the range of the seeds shaded. ``kinds``, ``tokens``, ``unit``: the video demo's question types, its 64 video
    tokens and their name."""
    from matplotlib import colormaps

    from vitrim.viz.maps import new_figure

    fig = new_figure((12.0, 3.6))
    axes = fig.subplots(1, len(kinds), sharey=True)
    kept = [round(float(f) * tokens) for f in KEPT_FRACTIONS]
    colours = colormaps["tab20"]
    for ax, kind in zip(axes, kinds):
        ax.axhline(100 * summary["full"][kind], color="grey", lw=1, label=f"full model ({tokens})")
        for index, (method, rows) in enumerate(summary["methods"].items()):
            values = [100 * rows[f]["accuracy"][kind] for f in KEPT_FRACTIONS]
            style = _line_style(method, colours(index % 20))
            ax.plot(kept, values, marker="o", ms=3, label=method, **style)
            if all("accuracy_by_seed" in rows[f] for f in KEPT_FRACTIONS):  # a seeded baseline: its seeds' range
                seeds = [[100 * one[kind] for one in rows[f]["accuracy_by_seed"]] for f in KEPT_FRACTIONS]
                ax.fill_between(
                    kept, [min(s) for s in seeds], [max(s) for s in seeds], color=style["color"], alpha=0.15
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(kept, [str(k) for k in kept])
        ax.set_xlabel(f"{unit} tokens kept (of {tokens})")
        ax.set_title(f'"{kind}" questions', fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact match (%)")
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="outside right center")
    return fig


BASELINES = {"random": "black", "tower_random": "grey"}
STAGE_LINES = {"pre_llm": "-", "in_llm": "-.", "tower": ":"}


def _line_style(method: str, colour: Any) -> dict[str, Any]:
    if method in BASELINES:
        return {"ls": "--", "color": BASELINES[method]}
    import vitrim.vlm  # noqa: F401  (registers every method)
    from vitrim.vlm.method.base import method_class

    return {"ls": STAGE_LINES.get(method_class(method).stage, "-"), "color": colour}

"""``vitrim bench ops``: how many operator calls the host makes for one batch-1 forward, per reducer.

On a GPU at batch 1 a ViT's time is the host's time: every operator call costs some 20–30 µs of Python, dispatch and
kernel launch whatever its size, so a reducer that adds calls slows the model down even while it removes FLOPs. The
count is deterministic (no timing): it is measured here on the CPU, by anyone, and held to budgets by a test.

What is counted: the **top-level ``aten::`` calls** of one forward, recorded by ``torch.profiler`` (CPU activity):
every event whose name starts with ``aten::`` and that has no ``aten::`` event among its ancestors. A call that other
aten calls make on its behalf (``aten::linear`` calling ``aten::addmm``, ``aten::einsum`` calling ``aten::bmm``) is
nested, so it is not counted again: what is counted is what the Python code asked for. Views (``aten::view``,
``aten::slice``, ``aten::unsqueeze``) and no-op conversions (``aten::to`` to the same dtype) count like any call: each
is a trip through the dispatcher. The forward is run once untimed before the recorded one, so caches are warm.

Default rows (the budgets of issue 27 are ratios to the first row, dense): ViT-B/16 at 224 with each registered
reducer at the setting in :data:`DEFAULT_SETTINGS`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

DEFAULT_MODEL = "vit_base_patch16_224"
# Each reducer at its papers' setting for DeiT/ViT-B at 224 (the rows of issue 27's budgets); DiffRate at the preset
# closest to ToMe r = 13's compute (10.4 G multiply-adds against ToMe's 10.37).
DEFAULT_SETTINGS: dict[str, str] = {
    "tome": "tome:r=13",
    "topk": "topk:keep_rate=0.7",
    "evit": "evit:keep_rate=0.7",
    "dynamicvit": "dynamicvit:keep_ratio=0.7",
    "zero_tprune": "zero_tprune:keep_rate=0.7",
    "random": "random:keep_rate=0.7",
    "ppt": "ppt:r=50",
    "pitome": "pitome:ratio=0.9",
    "diffrate": "diffrate:schedule='diffrate_deit_b_10.4'",
    "mctf": "mctf:r=16",
}
# Issue 27's budgets: at most this many times the dense model's calls (reducers not named here have none).
BUDGETS: dict[str, float] = {
    "tome": 2.0,
    "ppt": 2.0,
    "pitome": 2.0,
    "diffrate": 2.0,
    "evit": 1.3,
    "topk": 1.3,
    "dynamicvit": 1.3,
    "zero_tprune": 1.3,
    "random": 1.3,
    "mctf": 3.0,
}


def top_level_aten_calls(fn: Callable[[], Any]) -> Counter[str]:
    """The top-level ``aten::`` calls (module doc) that one call of ``fn()`` makes, by operator name.

    ``fn`` runs twice: once to warm caches, once under the profiler. Both run under ``torch.inference_mode``.
    """
    with torch.inference_mode():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as recorded:
            fn()
    calls: Counter[str] = Counter()
    for event in recorded.events():
        if event.name.startswith("aten::") and not _under_aten(event):
            calls[event.name] += 1
    return calls


def _under_aten(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def forward_calls(model: nn.Module, images: Tensor) -> Counter[str]:
    """Top-level aten calls of ``model(images)`` (eval mode is the caller's business)."""
    return top_level_aten_calls(lambda: model(images))


def count_rows(built: list[tuple[str, nn.Module]], image_shape: tuple[int, int, int]) -> list[dict[str, Any]]:
    """One row per (label, model): its calls for one batch-1 forward of a random image, and the ratio to the first.

    Rows: ``setting``, ``calls`` (total), ``ratio`` (to the first row), ``by_op`` (name -> calls, most first).
    """
    images = torch.randn(1, *image_shape, generator=torch.Generator().manual_seed(0))
    counted = []
    for label, model in built:
        device = next(model.parameters()).device
        counted.append((label, forward_calls(model, images.to(device))))
    baseline = sum(counted[0][1].values())
    return [
        {
            "setting": label,
            "calls": sum(c.values()),
            "ratio": sum(c.values()) / baseline,
            "by_op": dict(c.most_common()),
        }
        for label, c in counted
    ]


def print_table(rows: list[dict[str, Any]], budgets: dict[str, float | None], by_op: int = 0) -> None:
    """The rows as ``vitrim bench ops`` prints them; ``budgets`` maps a row's setting to its budget (or None)."""
    width = max(len("setting"), *(len(r["setting"]) for r in rows))
    print(f"{'setting':<{width}} {'calls':>6} {'x dense':>8} {'budget':>7}")
    print("-" * (width + 24))
    for row in rows:
        budget = budgets.get(row["setting"])
        mark = "" if budget is None else f"{budget:6.1f}x" + ("" if row["ratio"] <= budget else " OVER")
        print(f"{row['setting']:<{width}} {row['calls']:6d} {row['ratio']:7.2f}x {mark:>7}")
        if by_op:
            top = list(row["by_op"].items())[:by_op]
            print("    " + ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in top))

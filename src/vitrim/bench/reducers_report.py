"""What ``vitrim bench reducers`` shows: the markdown table, the skipped list and the two pictures.

``results`` is the dict :func:`vitrim.bench.reducers.bench_reducers` returns (and ``results.json`` holds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitrim.viz.maps import new_figure, save_figure

MARKERS = "osD^vP*Xph<>"


def markdown(results: dict[str, Any]) -> str:
    """One table per model (dense first, then each reducer at each target), then the skipped reducers."""
    rows: list[dict[str, Any]] = results["rows"]
    batches = list(rows[0]["speed"]) if rows else []
    with_accuracy = results.get("accuracy_model") is not None
    head = ["target GMACs", "method", "setting", "GMACs", "of dense"]
    for b in batches:
        head += [f"img/s @{b}", f"speed-up @{b}"]
    if with_accuracy:
        head += ["digits setting", "digits top-1", "Δ top-1 (points)"]
    lines: list[str] = []
    for model, info in results["models"].items():
        h, w = info["img_size"]
        lines += [f"**{model}** at {h}×{w}, dense {info['dense_gmacs']:.4g} GMACs", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
        for r in (r for r in rows if r["model"] == model):
            target = "—" if r["target"] is None else r["target"]
            note = "" if r["reachable"] else " (strongest; target not reached)"
            cells = [target, r["method"], f"`{r['setting']}`{note}", f"{r['gmacs']:.4g}"]
            cells.append(f"{r['fraction_of_dense']:.2f}")
            for b in batches:
                s = r["speed"][b]
                cells += [f"{s['img_s']:.1f}", f"{s['speedup']:.2f}x"]
            if with_accuracy:
                cells += _accuracy_cells(r["accuracy"] or {})
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if with_accuracy:
        acc = results["accuracy_model"]
        lines.append(
            f"Digits: top-1 off the shelf (no retraining) on {acc['test_images']} held-out images of "
            f"`{acc['checkpoint']}` (dense {100 * acc['dense_top1']:.2f}%, {1e3 * acc['dense_gmacs']:.2f} MMACs), "
            "each reducer tuned to the same fraction of that model's dense GMACs as the target is of the model's."
        )
        lines.append("")
    for s in results["skipped"]:
        where = "" if s["model"] is None else f" on {s['model']}"
        lines.append(f"- skipped: {s['method']}{where}: {s['reason']}")
    return "\n".join(lines).rstrip() + "\n"


def _accuracy_cells(acc: dict[str, Any]) -> list[str]:
    if "note" in acc:
        return ["—", acc["note"], "—"]
    if "setting" not in acc:  # the dense row
        return ["—", f"{100 * acc['top1']:.2f}%", "—"]
    note = "" if acc["reachable"] else " (strongest)"
    change = 0.0 - acc["drop_points"] + 0.0  # + 0.0: no "-0.00"
    return [f"`{acc['setting']}`{note}", f"{100 * acc['top1']:.2f}%", f"{change:+.2f}"]


def _styles(results: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """method -> (marker, colour), the same in every picture of one run."""
    methods = sorted({r["method"] for r in results["rows"] if r["method"] != "dense"})
    return {m: (MARKERS[i % len(MARKERS)], f"C{i % 10}") for i, m in enumerate(methods)}


def plot_speedup(results: dict[str, Any], path: Path) -> None:
    """GMACs (x) against speed-up over dense (y) at the largest batch: one point per method and target, per model."""
    rows = results["rows"]
    batch = max(rows[0]["speed"], key=int)
    models = list(results["models"])
    fig = new_figure((5.2 * len(models), 3.8))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    styles = _styles(results)
    for ax, model in zip(axes, models):
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        for method in ["dense", *styles]:
            mine = [r for r in rows if (r["model"], r["method"]) == (model, method)]
            points = [(r["gmacs"], r["speed"][batch]["speedup"]) for r in mine]
            if not points:
                continue
            xs, ys = zip(*points)
            dense = method == "dense"
            ax.scatter(
                xs,
                ys,
                marker="*" if dense else styles[method][0],
                s=140 if dense else 50,
                color="black" if dense else styles[method][1],
                label=method,
                zorder=3 if dense else 2,
            )
        for target in {r["target_gmacs"] for r in rows if r["model"] == model and r["target_gmacs"]}:
            ax.axvline(target, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("GMACs per image (the papers' GFLOPs)")
        ax.set_ylabel(f"speed-up over dense, batch {batch}")
        ax.set_title(model, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_accuracy(results: dict[str, Any], path: Path) -> None:
    """Digits top-1 off the shelf (y) against the digits model's MMACs (x): one point per method and target."""
    acc_model = results["accuracy_model"]
    rows = [r for r in results["rows"] if r["accuracy"] and "top1" in r["accuracy"] and r["method"] != "dense"]
    fig = new_figure((5.6, 4.0))
    ax = fig.subplots()
    dense_x, dense_y = 1e3 * acc_model["dense_gmacs"], 100 * acc_model["dense_top1"]
    ax.scatter(dense_x, dense_y, marker="*", s=160, color="black", label="dense", zorder=3)
    ax.axhline(dense_y, color="black", lw=0.8, ls="--")
    seen: set[tuple[str, float]] = set()
    for method, (marker, colour) in _styles(results).items():
        points = []
        for r in (r for r in rows if r["method"] == method):
            key = (method, r["accuracy"]["value"])
            if key not in seen:
                seen.add(key)
                points.append((1e3 * r["accuracy"]["gmacs"], 100 * r["accuracy"]["top1"]))
        if points:
            xs, ys = zip(*points)
            ax.scatter(xs, ys, marker=marker, color=colour, s=50, label=method)
    ax.set_xlabel("MMACs per image (digits model)")
    ax.set_ylabel("top-1 on held-out digits, off the shelf (%)")
    ax.set_title("accuracy vs compute at matched fractions of dense", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)

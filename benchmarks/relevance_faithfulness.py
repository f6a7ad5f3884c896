"""Does it explain? Deletion / insertion areas of every relevance method on the demo's trained digits models.

Models (``vitrim demo`` trains the first two; the others are the dense model with a training-free reducer):
dense ViT (runs/demo/dense), DynamicViT ρ = 0.7 (runs/demo/dynamicvit), ToMe r = 5 per block, EViT keep rate 0.7
at its default blocks. Images: the held-out digits (the split and placements ``vitrim train`` uses, seed 0,
align 8). Method and definitions: :mod:`vitrim.viz.faithfulness`.

    vitrim demo --out runs/demo                               # once: the trained models (a few minutes)
    python benchmarks/relevance_faithfulness.py --runs runs/demo --out docs/relevance

Writes ``faithfulness.json`` (areas, mean curves, Spearman agreement with the dense model's maps on the patches
each trimmed model kept) and ``faithfulness.png`` (the mean curves), and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import vitrim
from vitrim.data import DigitsCanvas
from vitrim.viz.faithfulness import ATTRIBUTIONS, faithfulness, spearman
from vitrim.viz.maps import new_figure, save_figure

TOME_R = 5  # 36 patches, 6 blocks: 36 -> 31 -> … -> 6 patch tokens; r = 3 would merge only identical background
EVIT_KEEP = 0.7


def models(runs: Path) -> dict[str, torch.nn.Module]:
    dense = vitrim.load_model(runs / "dense" / "last.safetensors").eval()
    tome = vitrim.load_model(runs / "dense" / "last.safetensors").eval()
    vitrim.reduce.apply(tome, "tome", r=TOME_R)
    evit = vitrim.load_model(runs / "dense" / "last.safetensors").eval()
    vitrim.reduce.apply(evit, "evit", keep_rate=EVIT_KEEP)
    dynamic = vitrim.load_model(runs / "dynamicvit" / "last.safetensors").eval()
    return {"dense": dense, "dynamicvit": dynamic, "tome": tome, "evit": evit}


def kept_patches(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, P) True where the model kept the patch as a token of its own, or merged it (ToMe), to the end."""
    with torch.inference_mode():
        out = model.forward_detailed(images)
    P = out.block_positions[0].shape[1]
    if not out.kept_indices:  # ToMe merges, never drops: every patch stays represented
        return torch.ones(images.shape[0], P, dtype=torch.bool)
    kept = out.kept_indices[-1]  # (B, k) absolute positions; −1 for EViT's fused token
    mask = torch.zeros(images.shape[0], P + 1, dtype=torch.bool)
    return mask.scatter_(1, torch.where(kept < 0, P, kept), True)[:, :P]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs/demo"))
    parser.add_argument("--out", type=Path, default=Path("docs/relevance"))
    parser.add_argument("--images", type=int, default=0, help="held-out images to use (0: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    built = models(args.runs)
    test = DigitsCanvas("test", canvas_size=48, in_chans=1, seed=0, align=8)
    count = len(test) if args.images <= 0 else min(args.images, len(test))
    images = torch.stack([test[i][0] for i in range(count)])
    fill = images.mean(dim=(0, 2, 3))  # the data set's mean pixel: what a removed patch becomes
    results: dict[str, dict] = {"images": count, "fill": fill.tolist(), "models": {}}
    maps: dict[str, dict[str, torch.Tensor]] = {}
    for name, model in built.items():
        start = time.perf_counter()
        methods = ATTRIBUTIONS
        result = faithfulness(model, images, methods, fill=fill)
        maps[name] = result.maps
        with torch.inference_mode():
            top1 = float((model(images).argmax(-1) == torch.tensor([test[i][1] for i in range(count)])).float().mean())
        results["models"][name] = {"top1": top1, **result.as_dict(), "seconds": time.perf_counter() - start}
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    for name in ("dynamicvit", "tome", "evit"):
        kept = kept_patches(built[name], images)
        agreement = {}
        for method in ATTRIBUTIONS:
            if method == "random":
                continue
            rho = spearman(maps[name][method], maps["dense"][method], kept)
            agreement[method] = float(rho.nanmean())
        results["models"][name]["spearman_with_dense_on_kept"] = agreement
        results["models"][name]["kept_fraction"] = float(kept.float().mean())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "faithfulness.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out / "faithfulness.png")
    print(table(results))


def table(results: dict) -> str:
    lines = [
        "| model (top-1) | method | deletion AUC ↓ | insertion AUC ↑ | Spearman with dense (kept patches) |",
        "|---|---|---:|---:|---:|",
    ]
    for name, r in results["models"].items():
        for method in ATTRIBUTIONS:
            rho = r.get("spearman_with_dense_on_kept", {}).get(method)
            lines.append(
                f"| {name} ({100 * r['top1']:.1f}%) | {method} | {r['deletion_auc'][method]:.3f} |"
                f" {r['insertion_auc'][method]:.3f} | {'—' if rho is None else f'{rho:.2f}'} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    names = list(results["models"])
    fig = new_figure((3.2 * len(names), 6.0))
    axes = fig.subplots(2, len(names), squeeze=False)
    for col, name in enumerate(names):
        r = results["models"][name]
        for row, kind in enumerate(("deletion", "insertion")):
            ax = axes[row][col]
            for method in ATTRIBUTIONS:
                curve = r[f"{kind}_curve"][method]
                x = [i / (len(curve) - 1) for i in range(len(curve))]
                ax.plot(x, curve, label=method, linestyle="--" if method == "random" else "-")
            ax.set_title(f"{name}: {kind}", fontsize=9)
            ax.set_xlabel(f"fraction of patches {'removed' if kind == 'deletion' else 'inserted'}", fontsize=8)
            ax.set_ylabel("p(explained class)", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()

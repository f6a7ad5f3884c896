"""Peak memory of relevance on ViT-B/16 at 224, batch 8, against the backward pass alone (docs/performance.md).

    python benchmarks/relevance_memory.py                      # ViT-B/16, 224, B = 8, every mode
    python benchmarks/relevance_memory.py --model vit_small_patch16_224 --batch 2 --json r.json

Modes and method: :mod:`vitrim.bench.relevance` (each in a fresh process; growth of the peak resident set).
"""

from __future__ import annotations

import argparse
import json

from vitrim.bench.relevance import MODES, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    for mode in args.modes.split(","):
        r = measure(args.model, args.img_size, args.batch, mode)
        results[mode] = r
        one_map = args.batch * r["heads"] * r["tokens"] ** 2 * 4
        print(
            f"{mode:>14}: peak growth {r['peak_bytes'] / 2**20:8.1f} MiB ({r['peak_bytes'] / one_map:5.1f} maps of "
            f"{one_map / 2**20:.1f} MiB), {r['seconds']:.1f} s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

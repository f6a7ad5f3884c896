"""``vitrim bench ops``: top-level aten calls per batch-1 forward, dense and every reducer (vitrim.bench.ops)."""

from __future__ import annotations

import argparse
import json

from torch import nn

from vitrim import reduce
from vitrim.bench import models, ops
from vitrim.bench.model_cases import build_cases, parse_reducer
from vitrim.cli.common import IMAGE_SIDE, Bounded, add_threads_argument, parse_model_set

SET_FORM = "KEY=VALUE[,KEY=VALUE]"


def register_ops(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "ops",
        help="count the top-level aten calls of one batch-1 forward (host calls: what batch 1 on a GPU pays for)",
        description="Count the aten operator calls one batch-1 forward makes at the top level (not nested in another "
        "aten call), with torch.profiler on the CPU: deterministic, no timing. Rows: dense first, then each "
        "reducer; the ratio is to the first row. Without --reducer: every registered reducer at its default setting.",
    )
    p.add_argument(
        "models",
        nargs="?",
        default=ops.DEFAULT_MODEL,
        help=f"comma-separated registered model names, each optionally NAME[reducer=...] (default {ops.DEFAULT_MODEL})",
    )
    p.add_argument(
        "--reducer",
        action="append",
        default=None,
        help="token reducer NAME[:key=value,...]; repeat for several rows (default: dense, then every registered "
        "reducer at its default setting)",
    )
    p.add_argument("--img-size", type=IMAGE_SIDE, default=None, help="image side (default: each model's own)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        metavar=SET_FORM,
        help="create_model overrides for every model (the count does not depend on the width: embed_dim=96 is quick)",
    )
    p.add_argument(
        "--by-op",
        type=Bounded(int, 0, 10_000, "operators listed per row"),
        default=0,
        metavar="N",
        help="also list each row's N most called operators",
    )
    add_threads_argument(p)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.set_defaults(func=run_ops)


def default_reducer_specs() -> list[str]:
    """``none`` (dense), then every registered reducer that has a default setting in :data:`ops.DEFAULT_SETTINGS`."""
    return ["none", *(ops.DEFAULT_SETTINGS[name] for name in reduce.list_reducers() if name in ops.DEFAULT_SETTINGS)]


def run_ops(args: argparse.Namespace) -> int:
    specs = args.reducer or default_reducer_specs()
    cases = build_cases(
        args.models,
        overrides=parse_model_set(args.overrides, "--set", SET_FORM),
        reducers=specs,
        img_size=args.img_size,
    )
    built: list[tuple[str, nn.Module]] = []
    budgets: dict[str, float | None] = {}
    shapes = set()
    for case in cases:
        model = models.build_model(case, args.img_size)
        built.append((case.label, model))
        parsed = None if case.reducer is None else parse_reducer(case.reducer)
        budgets[case.label] = None if parsed is None else ops.BUDGETS.get(parsed[0])
        shapes.add(models.input_shape(model, args.img_size))
    if len(shapes) != 1:
        raise ValueError(f"the models take different inputs {sorted(shapes)}; count them in separate runs")
    rows = ops.count_rows(built, shapes.pop())
    print("top-level aten calls per batch-1 forward (torch.profiler, CPU; nested calls not counted)")
    ops.print_table(rows, budgets, by_op=args.by_op)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        for row in rows:
            row["budget"] = budgets.get(row["setting"])
        with open(args.json, "w") as f:
            json.dump({"config": config, "rows": rows}, f, indent=2)
    return 0

"""`vitrim bench reducers`: the strength search against FLOPs counted by hand, every registered reducer covered,
the CLI's files and its errors. Tiny models, one timed repeat: the point is the plumbing and the numbers FLOPs and
accuracy give, not the speed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

import vitrim
from vitrim import reduce
from vitrim.bench import reducers as bench_reducers_module
from vitrim.bench.flops import model_flops_per_image
from vitrim.bench.matched import match_flops, match_reducer, reducer_flops
from vitrim.bench.reducers import (
    ReducerBenchSettings,
    Target,
    bench_reducers,
    nearest_preset,
    paired_speedup,
    parse_targets,
)
from vitrim.cli import main
from vitrim.reduce import registry
from vitrim.reduce.base import Reducer, StrengthOption
from vitrim.reduce.schedule import SCHEDULES

# 32×32 image, 8×8 patches: 16 patch tokens + [CLS]; 4 blocks, so EViT / top-k reduce in blocks 1, 2, 3.
TINY = dict(embed_dim=32, depth=4, num_heads=2, img_size=32, patch_size=8, num_classes=5)
TINY_SET = ",".join(f"{k}={v}" for k, v in TINY.items())
FAST = ["--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--threads", "1"]
# the digits model of the accuracy test: 16×16 canvas, 4×4 patches: 16 patch tokens + [CLS], 2 blocks; 3 epochs on
# digits aligned to the patches reach about 50% top-1 (enough for reducers to change some answers) in ~7 s
DIGITS_SET = "embed_dim=32,depth=2,num_heads=2,img_size=16,patch_size=4,in_chans=1"
DIGITS_TRAIN = ["--epochs", "3", "--lr", "5e-3", "--batch-size", "64", "--warmup-epochs", "0"]
DIGITS_DATA = ["--clutter", "0", "--noise", "0", "--align", "4"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread (as tests/conftest.py gives the training tests): FLOP counting and tiny forwards gain nothing
    from a second thread and lose much on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(**changes: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitrim.create_model("vit_tiny_patch16_224", **{**TINY, **changes}).eval()


# -- FLOPs by hand ------------------------------------------------------------------------------------------------


def flops_by_hand(tokens: list[tuple[int, int]], extra: int = 0, *, dim: int = 32, classes: int = 5) -> int:
    """A [CLS] ViT of TINY's shape whose block i attends over tokens[i][0] tokens and runs its MLP on tokens[i][1]
    (a reducer acts between the two): 2 FLOPs per multiply-add, matrix products only; ``extra``: the reducer's own."""
    patches, patch = 16, 8
    total = 2 * patches * (3 * patch * patch) * dim + 2 * dim * classes  # patch embedding, head on [CLS]
    for n, m in tokens:
        total += 2 * n * dim * 3 * dim + 2 * 2 * n * n * dim + 2 * n * dim * dim  # qkv, QKᵀ and A·V, proj
        total += 2 * 2 * m * dim * 4 * dim  # fc1, fc2
    return total + extra


def topk_flops_by_hand(keep_rate: float) -> int:
    """Top-k in blocks 1, 2, 3: k = ⌈keep_rate · n⌉ of the n patch tokens, ranked by one [CLS] query against the N
    tokens of the block (its row of QKᵀ: 2 · N · dim per reducing block), the row's softmax taken by the fused kernel
    over an N × N identity value matrix (A · I: 2 · N · N per head, 2 heads)."""
    n, tokens, extra = 16, [], 0
    for block in range(4):
        k = n if block == 0 or keep_rate >= 1 else min(n, math.ceil(keep_rate * n))
        if k < n:
            extra += 2 * (n + 1) * 32 + 2 * 2 * (n + 1) ** 2
        tokens.append((n + 1, k + 1))
        n = k
    return flops_by_hand(tokens, extra)


def tome_flops_by_hand(r: int) -> int:
    """ToMe in every block: min(r, ⌊(N − 1)/2⌋) merges after the attention; the matching compares all N tokens
    with each other on the keys summed over heads (head dim 16), the pairs that may not merge masked."""
    N, tokens, extra = 17, [], 0
    for _ in range(4):
        merges = min(r, (N - 1) // 2)
        if merges > 0:
            extra += 2 * N * N * 16
        tokens.append((N, N - merges))
        N -= merges
    return flops_by_hand(tokens, extra)


def test_hand_formulas_agree_with_the_counter():
    model = tiny_model()
    assert model_flops_per_image(model, 32) == flops_by_hand([(17, 17)] * 4)
    for rate in (1.0, 0.7, 0.5, 0.26, 0.001):
        reduce.apply(model, "topk", keep_rate=rate)
        assert model_flops_per_image(model, 32) == topk_flops_by_hand(rate), rate
        reduce.remove(model)
    for r in (1, 3, 8):
        reduce.apply(model, "tome", r=r)
        assert model_flops_per_image(model, 32) == tome_flops_by_hand(r), r
        reduce.remove(model)


@pytest.mark.parametrize("fraction", [0.9, 0.7, 0.55])
def test_search_finds_the_closest_achievable_topk_setting(fraction):
    model = tiny_model()
    dense = flops_by_hand([(17, 17)] * 4)
    target = fraction * dense
    match = match_reducer(model, "topk", [target], (32, 32))[0]
    assert match.flops == topk_flops_by_hand(match.value)  # what the search reports is what the model counts
    grid = [round(1 - i * 0.001, 9) for i in range(1000)]  # every keep rate the option offers
    best = min(abs(topk_flops_by_hand(v) - target) for v in grid)
    assert abs(match.flops - target) == best
    assert match.reachable


@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.45])
def test_search_finds_the_closest_tome_r(fraction):
    model = tiny_model()
    target = fraction * flops_by_hand([(17, 17)] * 4)
    match = match_reducer(model, "tome", [target], (32, 32))[0]
    assert isinstance(match.value, int)
    assert match.flops == tome_flops_by_hand(match.value)
    best = min(abs(tome_flops_by_hand(r) - target) for r in range(0, 40))
    assert abs(match.flops - target) == best


def test_unreachable_target_reports_the_weakest_setting_that_removes_the_most():
    model = tiny_model()
    floor = tome_flops_by_hand(1000)  # every block merges all it can
    match = match_reducer(model, "tome", [0.5 * floor], (32, 32))[0]
    assert not match.reachable and match.flops == floor
    assert match.value == min(r for r in range(40) if tome_flops_by_hand(r) == floor)
    floor = topk_flops_by_hand(0.001)  # one patch token left
    match = match_reducer(model, "topk", [0.5 * floor], (32, 32))[0]
    assert not match.reachable and match.flops == floor
    grid = [round(1 - i * 0.001, 9) for i in range(1000)]
    assert match.value == max(v for v in grid if topk_flops_by_hand(v) == floor)  # 0.062: ⌈0.062 · 16⌉ = 1


def test_bisection_on_a_step_function_picks_the_closer_side_and_the_weaker_on_a_tie():
    option = StrengthOption("r", weakest=0, strongest=None)
    calls: list[float] = []

    def count(value: float) -> float:  # 100, 100, 100, 93, 93, 93, 86, … (falls by 7 every 3 steps)
        calls.append(value)
        return 100.0 - 7 * (value // 3)

    assert match_flops(count, option, 88.0).value == 6  # 86 is 2 away, 93 is 5 away
    assert match_flops(count, option, 91.0).value == 3  # 93 is 2 away, 86 is 5 away
    assert match_flops(count, option, 89.5).value == 3  # a tie: the weaker value (fewer tokens removed)
    assert match_flops(count, option, 100.0).value == 0
    assert len(calls) < 40  # bisection, not a scan
    falling = StrengthOption("keep_rate", 1.0, 0.5, step=0.1)  # values 1.0, 0.9, …, 0.5
    assert [falling.value(i) for i in range(6)] == [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    assert match_flops(lambda v: 100.0 * v, falling, 68.0).value == 0.7


@pytest.mark.full  # every reducer's declared strengths built and run: 5-6 s on 2 cores
def test_declared_strengths_are_valid_options_whose_weakest_value_is_dense():
    """Every reducer that declares a strength: the option exists, its weakest value leaves the FLOPs dense, and a
    stronger value lowers them (a future reducer's declaration is checked here without editing this test)."""
    model = tiny_model()
    dense = model_flops_per_image(model, 32)
    for name in reduce.list_reducers():
        option = reduce.get_reducer(name).strength_option
        if option is None:
            continue
        assert option.name in reduce.reducer_options(name), name
        assert reducer_flops(model, name, {option.name: option.weakest}, (32, 32)) == dense, name
        strong = match_reducer(model, name, [0.6 * dense], (32, 32))[0]
        assert strong.flops < dense, name


def test_strength_option_checks_its_declaration():
    with pytest.raises(ValueError, match="step must be positive"):
        StrengthOption("r", 0, 10, step=0)
    with pytest.raises(ValueError, match="unbounded"):
        StrengthOption("keep_rate", 1.0, None, step=0.01)
    assert StrengthOption("keep_rate", 1.0, 0.001, step=0.001).last_index == 999


# -- the benchmark --------------------------------------------------------------------------------------------------


def test_paired_speedup_is_the_median_of_per_repeat_ratios():
    # ratios 2, 4, 1.5 -> 2; the ratio of the medians would be 4 / 1 = 4
    assert paired_speedup([2.0, 4.0, 6.0], [1.0, 1.0, 4.0]) == 2.0
    with pytest.raises(ValueError, match="equal"):
        paired_speedup([1.0], [1.0, 2.0])


def test_parse_targets():
    assert parse_targets("2.9, 2.6") == (Target(2.9), Target(2.6))
    assert parse_targets("63%") == (Target(0.63, relative=True),)
    for bad in ("abc", "-1", "0", "150%", "nan"):
        with pytest.raises(ValueError, match="--targets"):
            parse_targets(bad)


class NoStrength(Reducer):
    """A registered reducer that declares no strength option (the benchmark must list it as skipped)."""

    example_options: ClassVar[dict[str, Any]] = {}


@pytest.mark.full  # every reducer timed once: 7 s
def test_every_registered_reducer_appears_or_is_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(registry, "_REDUCERS", dict(registry._REDUCERS))  # register only for this test
    monkeypatch.setattr(NoStrength, "name", "")
    registry.register("no_strength_test")(NoStrength)
    settings = ReducerBenchSettings(
        targets=(Target(0.7, relative=True),), batch_sizes=(1,), repeats=(1,), warmup=0, overrides=dict(TINY)
    )
    # the second model has no [CLS]: the [CLS]-ranking reducers must say they refuse it
    results = bench_reducers(["vit_tiny_patch16_224", "vit_medium_patch16_gap_256"], settings)
    for model in ("vit_tiny_patch16_224", "vit_medium_patch16_gap_256"):
        shown = {r["method"] for r in results["rows"] if r["model"] == model}
        skipped = {s["method"]: s["reason"] for s in results["skipped"] if s["model"] in (None, model)}
        assert shown | set(skipped) == set(reduce.list_reducers()) | {"dense"}, model
        assert not shown & set(skipped), model
        assert all(reason for reason in skipped.values())
        assert "strength_option" in skipped["no_strength_test"]
    gap_skipped = {s["method"] for s in results["skipped"] if s["model"] in (None, "vit_medium_patch16_gap_256")}
    needs_cls = {n for n in reduce.list_reducers() if reduce.get_reducer(n).needs_cls_token}
    assert needs_cls <= gap_skipped and "tome" not in gap_skipped
    for row in results["rows"]:
        assert row["speed"]["1"]["img_s"] > 0
        if row["method"] == "dense":
            assert row["speed"]["1"]["speedup"] == 1.0 and row["fraction_of_dense"] == 1.0


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A tiny ViT trained briefly on 16×16 digits (see DIGITS_SET)."""
    out = tmp_path_factory.mktemp("digits_run") / "run"
    argv = ["train", "--model", "vit_tiny_patch16_224", "--set", DIGITS_SET, *DIGITS_TRAIN, *DIGITS_DATA]
    assert main([*argv, "--out", str(out), "--quiet", "--threads", "1"]) == 0
    return out


def top1_by_hand(run, name: str | None, options: dict) -> float:
    """Top-1 of the run's model (with a reducer) on its held-out digits, counted here without the benchmark's code."""
    from vitrim.data import build_datasets
    from vitrim.models.data_config import DataConfig
    from vitrim.train.state import load_for_eval

    model, record = load_for_eval(run / "last.safetensors")
    if name is not None:
        reduce.apply(model, name, **options)
    test = build_datasets(
        "digits", data_config=DataConfig().for_input(1, (16, 16)), seed=record["seed"],
        test_fraction=record["test_fraction"], clutter=record["clutter"], noise=record["noise"], align=record["align"],
    ).test  # fmt: skip
    images = torch.stack([test[j][0] for j in range(len(test))])  # (359, 1, 16, 16)
    labels = torch.tensor([int(test[j][1]) for j in range(len(test))])
    with torch.inference_mode():
        right = int((model.eval()(images).argmax(dim=1) == labels).sum())
    return right / len(test)


@pytest.mark.full  # 16 s; test_cli_without_accuracy_writes_the_speed_picture runs the command by default
def test_cli_writes_results_and_pictures_with_accuracy(capsys, tmp_path, digits_run):
    out = tmp_path / "bench"
    argv = ["bench", "reducers", "--models", "vit_tiny_patch16_224", "--set", TINY_SET, "--targets", "60%"]
    rc = main([*argv, *FAST, "--accuracy-model", str(digits_run), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    for picture in ("accuracy_vs_gmacs.png", "gmacs_vs_speedup.png"):
        assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    methods = {r["method"] for r in results["rows"]}
    for name in methods | {s["method"] for s in results["skipped"]}:
        assert name in captured.out  # every method is in the table or the skipped list
    assert set(results["rows"][0]["speed"]) == {"1", "2"}
    dense_top1 = results["accuracy_model"]["dense_top1"]
    assert dense_top1 == pytest.approx(top1_by_hand(digits_run, None, {}))
    checked = 0
    for row in results["rows"]:
        acc = row["accuracy"]
        if row["method"] == "dense" or "note" in acc:
            continue
        # the same fraction of dense on the digits model as the target is on the benchmarked one (within the
        # granularity of 16 tokens in 2 blocks), or as close as the reducer gets
        if acc["reachable"]:
            assert acc["fraction_of_dense"] == pytest.approx(row["target_fraction"], abs=0.06)
        else:
            assert acc["fraction_of_dense"] > row["target_fraction"]
        option = reduce.get_reducer(row["method"]).strength_option
        assert acc["top1"] == pytest.approx(top1_by_hand(digits_run, row["method"], {option.name: acc["value"]}))
        assert acc["drop_points"] == pytest.approx(100 * (dense_top1 - acc["top1"]))
        checked += 1
    assert checked >= 5  # tome, evit, topk, pitome, ppt (dynamicvit is learned: a note)
    assert any(r["accuracy"].get("top1", dense_top1) != dense_top1 for r in results["rows"])  # answers did change
    assert all("note" in r["accuracy"] for r in results["rows"] if r["learned"])


def test_cli_without_accuracy_writes_the_speed_picture(capsys, tmp_path):
    out = tmp_path / "bench"
    argv = ["bench", "reducers", "--model", "vit_tiny_patch16_224", "--set", TINY_SET, "--targets", "60%"]
    assert main([*argv, *FAST, "--out", str(out)]) == 0
    assert "speed-up @2" in capsys.readouterr().out
    assert (out / "gmacs_vs_speedup.png").is_file() and not (out / "accuracy_vs_gmacs.png").exists()
    assert json.loads((out / "results.json").read_text())["accuracy_model"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--targets", "999"], "above the dense count"),
        (["--targets", "2.9"], "above the dense count"),  # the tiny model is far below DeiT-S
        (["--targets", "x"], "--targets"),
        (["--models", "no_such_model"], "no_such_model"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--batch-sizes", "2,-4"], "--batch-sizes"),
        (["--repeats", "0"], "--repeats"),
        (["--repeats", "1,2,3"], "one per batch size"),
        (["--accuracy-model", "/no/such/run"], "--accuracy-model"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(capsys, args, message):
    base = ["bench", "reducers", "--model", "vit_tiny_patch16_224", "--set", TINY_SET, "--targets", "60%"]
    rc = main([*base, *FAST, *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("vitrim: error: ") and message in lines[0], err


# -- schedule presets (DiffRate) ----------------------------------------------------------------------------------

# DeiT-S's shape (197 tokens, 12 blocks, width 384: what DiffRate's DeiT-S presets were searched for), 2 heads
DEIT_S_SHAPE = dict(num_heads=2, num_classes=5)


@pytest.mark.full  # DeiT-S at 224 per preset: 20 s on the shared machine
def test_a_schedule_reducer_runs_the_preset_nearest_to_each_target(monkeypatch):
    torch.manual_seed(0)
    model = vitrim.create_model("deit_small_patch16_224", **DEIT_S_SHAPE).eval()
    hw = (224, 224)
    presets = {name: reducer_flops(model, "diffrate", {"schedule": name}, hw) for name in SCHEDULES}
    # on DeiT-S's shape each DeiT-S preset costs what DiffRate states for it (its key, in GMACs), within 1.5 %
    for name, schedule in SCHEDULES.items():
        if schedule.embed_dim == 384:
            assert presets[name] / 2e9 == pytest.approx(schedule.gflops, rel=0.015), name
    # a target at a DeiT-S preset's FLOPs picks that preset
    for name in ("diffrate_deit_s_2.3", "diffrate_deit_s_2.9", "diffrate_deit_s_3.1"):
        assert nearest_preset(model, "diffrate", presets[name], hw) == (name, presets[name])
    # a preset searched for DeiT-B runs on DeiT-S (same depth and tokens) but never stands in for DiffRate on it
    for name in ("diffrate_deit_b_8.7", "diffrate_deit_b_10.0"):
        found = nearest_preset(model, "diffrate", presets[name], hw)
        assert found is None or found[0].startswith("diffrate_deit_s_")
    # nothing within 5 %: no row rather than a row at another compute
    lowest = min(f for n, f in presets.items() if n.startswith("diffrate_deit_s_"))
    assert nearest_preset(model, "diffrate", 0.9 * lowest, hw) is None
    # presets searched for another depth or token count never stand in
    assert nearest_preset(tiny_model(), "diffrate", 1e6, (32, 32)) is None

    target = presets["diffrate_deit_s_2.9"] / 2e9
    settings = ReducerBenchSettings(
        targets=(Target(target, relative=False),), batch_sizes=(1,), repeats=(1,), warmup=0, overrides=DEIT_S_SHAPE
    )
    # only the schedule path (tuning every other reducer on 12 blocks of 197 tokens costs half a minute)
    monkeypatch.setattr(bench_reducers_module, "tunable_reducers", lambda: ([], ["diffrate"], []))
    results = bench_reducers(["deit_small_patch16_224"], settings)
    assert {r["method"] for r in results["rows"]} == {"dense", "diffrate"}
    (row,) = [r for r in results["rows"] if r["method"] == "diffrate"]
    assert row["setting"] == "schedule=diffrate_deit_s_2.9" and row["value"] is None
    assert row["flops"] == presets["diffrate_deit_s_2.9"] and row["speed"]["1"]["img_s"] > 0

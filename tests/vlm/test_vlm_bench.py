"""``vitrim bench vlm`` on a tiny model: every case is timed and reported, and the MAC ratios it compares with are
those torch's counter finds in the very model it times (unmodified and with the LLM input shortened)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vitrim.vlm
from vitrim.bench.flops import count_flops
from vitrim.bench.vlm import (
    VLMBenchSettings,
    bench_inputs,
    bench_methods,
    build_model,
    flops_config,
    markdown,
    run_bench,
)
from vitrim.cli import main
from vitrim.vlm.flops import prefill_cost

pytest.importorskip("transformers")

TINY = dict(vision_width=32, vision_mlp=48, vision_heads=4, image_size=56, patch_size=14, llm_width=32, llm_mlp=40,
            llm_heads=4)  # fmt: skip
TINY_SET = ",".join(f"{k}={v}" for k, v in TINY.items())


def test_the_mac_counts_are_what_torch_counts_in_the_timed_model() -> None:
    settings = VLMBenchSettings(**TINY, keeps=(5,))  # type: ignore[arg-type]
    model = build_model(settings)
    inputs = bench_inputs(settings)
    vlm = flops_config(settings)
    assert count_flops(lambda: model(**inputs, logits_to_keep=1)) == 2 * prefill_cost(vlm, text_tokens=94).total
    vitrim.vlm.apply(model, "random", keep=5)  # no products of its own: the shortened LLM alone
    try:
        pruned = count_flops(lambda: model(**inputs, logits_to_keep=1))
    finally:
        vitrim.vlm.remove(model)
    assert pruned == 2 * prefill_cost(vlm, "random", 5, text_tokens=94).total
    vitrim.vlm.apply(model, "downsample", keep=4)  # cell means: pooling, no products either
    try:
        pooled = count_flops(lambda: model(**inputs, logits_to_keep=1))
    finally:
        vitrim.vlm.remove(model)
    assert pooled == 2 * prefill_cost(vlm, "downsample", 4, text_tokens=94).total


def test_the_tower_methods_mac_counts_are_what_torch_counts_in_the_timed_model() -> None:
    """HiPrune: the whole tower to the feature block's attention, ``keep`` tokens from its MLP on, and two global
    attention maps (object block 0, feature block 2); FlowCut on 4 blocks: its one cut after block 1 (block 0's
    remaining count is odd), [CLS]'s two rows in blocks 0 and 1. Each is exactly what flops counts."""
    settings = VLMBenchSettings(**TINY, vision_layers=4, keeps=(5,))  # type: ignore[arg-type]
    model = build_model(settings)
    inputs = bench_inputs(settings)
    vlm = flops_config(settings)
    for name, options in (("hiprune", {"object_layer": 1}), ("flowcut", {})):
        vitrim.vlm.apply(model, name, keep=5, **options)
        try:
            counted = count_flops(lambda: model(**inputs, logits_to_keep=1))
        finally:
            vitrim.vlm.remove(model)
        assert counted == 2 * prefill_cost(vlm, name, 5, text_tokens=94).total, name


def test_by_default_every_pre_llm_method_that_runs_with_its_defaults_is_timed() -> None:
    names = bench_methods(VLMBenchSettings(**TINY, keeps=(4,)))  # type: ignore[arg-type]
    assert {"downsample", "scope", "fastervlm", "random", "cdpruner"} <= set(names)
    assert "cdpruner" in names and "hiprune" in names  # hiprune: a tower method; flowcut needs 2 blocks before
    assert set(names) - {"hiprune"} <= set(vitrim.vlm.methods("pre_llm"))  # the feature block (TINY has one)


@pytest.mark.full  # the CLI test runs the same path with one method
def test_every_case_is_timed_against_the_unmodified_model() -> None:
    settings = VLMBenchSettings(**TINY, keeps=(4, 8), methods=("random", "fastervlm"), repeats=2, warmup=0)  # type: ignore[arg-type]
    results = run_bench(settings)
    rows = results["rows"]
    assert [(r["method"], r["keep"]) for r in rows] == [
        ("none", None), ("random", 4), ("random", 8), ("fastervlm", 4), ("fastervlm", 8)
    ]  # fmt: skip
    assert rows[0]["speedup"] == 1.0 and rows[0]["own_ms"] == 0.0
    for row in rows:
        assert 0 < row["tower_ms"] < row["prefill_ms"]
    assert all(r["own_ms"] > 0 for r in rows if r["method"] == "fastervlm")  # its [CLS] row and its top-k
    assert rows[1]["mac_speedup"] > rows[2]["mac_speedup"] > 1  # fewer tokens kept: fewer MACs
    table = markdown(rows)
    assert "| random | 4 |" in table and ("met" in table)


def test_cli_writes_the_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vlm.json"
    argv = ["bench", "vlm", "--set", TINY_SET, "--methods", "random", "--keep", "4", "--repeats", "1", "--warmup",
            "0", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "| random | 4 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["settings"]["keeps"] == [4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "depth=2"], "--set 'depth' is not a model size"),
        (["--methods", "nope"], "unknown vlm method 'nope'"),
        (["--keep", "0"], "keeps must be image tokens in 1..576"),
        (["--keep", "x"], "--keep must be comma-separated ints"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vlm", *argv]) == 2
    assert message in capsys.readouterr().err


EVIDENCE_OF_THE_LLM = ("last_token_attention", "keys", "normed_hidden")  # what an in-LLM method reads at its layer


@pytest.mark.parametrize("method", ["fastervlm", "vispruner", "visionzip", "scope", "fastv", "pdrop", "dart"])
def test_the_stopwatch_sees_the_evidence_work_of_each_method_that_has_some(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The q·k map a pre-LLM method's taps compute and the attention row or keys an in-LLM method reads run inside
    the stopwatch's own time: each evidence call records whether a timed call is in flight when it runs."""
    from vitrim.bench.vlm import _Stopwatch
    from vitrim.vlm.api import STATE_ATTRIBUTE
    from vitrim.vlm.evidence.llm_layer import LayerEvidence

    settings = VLMBenchSettings(**TINY, keeps=(5,), llm_layers=4)  # type: ignore[arg-type]
    model = build_model(settings)
    inputs = bench_inputs(settings)
    watch = _Stopwatch(model)
    seen: list[bool] = []
    options: dict[str, object] = {"keep": 5, **({"layer": 1} if method in ("fastv", "dart") else {})}
    if method == "pdrop":
        options = {"layers": (1, 2, 3), "ratios": (0.5, 0.25, 0.125)}

    def probe(fn):  # type: ignore[no-untyped-def]
        def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(watch.inside)
            return fn(*args, **kwargs)

        return recorded

    for name in EVIDENCE_OF_THE_LLM:
        monkeypatch.setattr(LayerEvidence, name, probe(getattr(LayerEvidence, name)))
    vitrim.vlm.apply(model, method, **options)
    try:
        stack = getattr(model, STATE_ATTRIBUTE).stack
        if "pre_llm" in stack.parts:
            (taps,) = stack.parts["pre_llm"].taps
            taps.scoring.read = probe(taps.scoring.read)  # under the stopwatch's wrapper, which comes next
        watch.watch_method(model)
        model(**inputs, logits_to_keep=1)
    finally:
        vitrim.vlm.remove(model)
        watch.remove()
    assert seen and all(seen), seen  # the evidence ran, and every call of it inside the method's own time
    assert watch.own > 0

"""``vitrim bench vlm --video`` on a tiny Qwen2.5-VL: the MAC ratios it compares with are those torch's counter finds
in the very model it times, and its report (table, JSON) holds every case; no timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vitrim.vlm
from vitrim.bench.flops import count_flops
from vitrim.bench.vlm_video import (
    VideoBenchSettings,
    VideoCase,
    bench_inputs,
    build_model,
    case_macs,
    case_options,
    flops_config,
    run_bench,
)
from vitrim.cli import main

pytest.importorskip("transformers")

TINY = dict(vision_width=32, vision_mlp=40, vision_heads=2, llm_width=32, llm_mlp=40, llm_heads=4, llm_kv_heads=2,
            vocab=64)  # fmt: skip
TINY_SET = ",".join(f"{k}={v}" for k, v in TINY.items())


def test_the_mac_counts_are_what_torch_counts_in_the_timed_model() -> None:
    """3 temporal patches of 224 px (16×16 patches: windows of 8×8 in no block, the one block attends over its
    temporal patch), 64 tokens each: unmodified, every other temporal patch, and 16 random tokens of each (neither
    method computes a product of its own, so the model's own MACs are all torch counts)."""
    settings = VideoBenchSettings(**TINY, temporal_patches=3, text_tokens=20)  # type: ignore[arg-type]
    model = build_model(settings)
    inputs = bench_inputs(settings)
    assert inputs["input_ids"].shape[1] == 3 * 64 + 20 == flops_config(settings).image_tokens + 20
    run = lambda: model(**inputs, logits_to_keep=1)  # noqa: E731
    assert count_flops(run) == 2 * case_macs(VideoCase("none", None), settings)
    for method in ("temporal_downsample", "random"):
        for name, options in case_options(method, 0.5, settings):
            vitrim.vlm.apply(model, name, **options)
        try:
            counted = count_flops(run)
        finally:
            vitrim.vlm.remove(model)
        assert counted == 2 * case_macs(VideoCase(method, None, share=0.5), settings), method


def test_the_stack_cuts_where_flops_counts_it() -> None:
    """flashvid+flashvid_llm on 2 LLM layers: the in-LLM stage at layer 1 (FlashVID's 20 of 28 scaled), and the
    MACs counted for it are the pre-LLM stage's tokens in layer 0 and ⌈0.3·N'⌉ in layer 1."""
    settings = VideoBenchSettings(**TINY, temporal_patches=4, methods=("flashvid+flashvid_llm",))  # type: ignore[arg-type]
    assert settings.stack_layer == 1
    assert case_options("flashvid+flashvid_llm", 0.25, settings) == [
        ("flashvid", {"retention_ratio": 0.25}), ("flashvid_llm", {"layer": 1})
    ]  # fmt: skip
    from vitrim.vlm.flops_video import video_prefill_cost

    row = video_prefill_cost(flops_config(settings), "flashvid+flashvid_llm", 0.25, text_tokens=94, layer=1)
    entering = 4 * 20  # ⌈64·0.25·1.25⌉ = 20 per temporal patch
    assert row.tokens_per_layer == (entering + 94, 24 + 94)  # ⌈0.3·80⌉ = 24


def test_the_report_holds_every_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "video.json"
    argv = ["bench", "vlm", "--video", "2", "--set", TINY_SET, "--methods", "evs,random", "--share", "0.5",
            "--repeats", "1", "--warmup", "0", "--threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| evs | 0.5 | video_pruning_rate=0.5 |" in printed and "| random | 0.5 | keep=32 |" in printed
    payload = json.loads(out.read_text())
    assert payload["settings"]["temporal_patches"] == 2 and payload["settings"]["shares"] == [0.5]
    rows = payload["rows"]
    assert [(r["method"], r["share"]) for r in rows] == [("none", None), ("evs", 0.5), ("random", 0.5)]
    keys = {"prefill_ms", "tower_ms", "own_ms", "speedup", "mac_speedup", "speedup_vs_macs", "own_share", "gmacs"}
    assert all(keys <= set(r) for r in rows) and rows[0]["speedup"] == 1.0
    assert rows[1]["mac_speedup"] > 1 and rows[2]["options"] == {"keep": 32}


def test_run_bench_returns_the_rows_in_case_order() -> None:
    settings = VideoBenchSettings(**TINY, temporal_patches=2, methods=("temporal_downsample",), repeats=1, warmup=0)  # type: ignore[arg-type]
    rows = run_bench(settings)["rows"]
    assert [r["method"] for r in rows] == ["none", "temporal_downsample"]
    assert rows[1]["gmacs"] < rows[0]["gmacs"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--video", "4", "--keep", "4"], "--keep counts an image's tokens; with --video give --share"),
        (["--video", "0"], "argument --video: expected an int in [1, 4096]"),
        (["--video", "4", "--share", "1.5"], "--share must be comma-separated fractions in (0, 1]"),
        (["--video", "4", "--set", "depth=2"], "--set 'depth' is not a size of the video bench"),
        (["--video", "4", "--methods", "fastv"], "vlm method 'fastv' takes no video alone here"),
        (["--video", "4", "--set", "size=300"], "size=300 must be a multiple of 112 px"),
        (["--share", "0.5"], "--share describes a clip; give --video T too"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["bench", "vlm", *argv])
    except SystemExit as exit:  # argparse's own range check (--video) exits from the parser
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err.splitlines()[-1] and "Traceback" not in err  # argparse's usage, then the one line

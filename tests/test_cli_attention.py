"""`vitrim bench attention` and `vitrim demo` run end to end (tiny sizes)."""

from __future__ import annotations

import json

import pytest

from vitrim.cli import main


@pytest.mark.parametrize(
    "memory_length",
    [0, pytest.param(32, marks=pytest.mark.full)],  # peak memory: a fresh process per case, 30 s of the suite's time
)
def test_bench_attention_runs(capsys, tmp_path, memory_length):
    path = tmp_path / "bench.json"
    argv = ["--lengths", "16", "--repeats", "1", "--memory-length", str(memory_length), "--json", str(path)]
    rc = main(["bench", "attention", *argv])
    out = capsys.readouterr().out
    assert rc == 0
    assert "median ms (ratio to torch SDPA)" in out
    assert "torch_sdpa" in out and "vitrim_auto" in out and "vitrim_weights" in out
    assert ("peak memory growth at N=32" in out) == (memory_length == 32)
    results = json.loads(path.read_text())
    assert set(results["times_ms"]["16"]) == {"torch_sdpa", "vitrim_auto", "vitrim_weights", "plain_matmul_softmax"}


def test_bench_attention_rejects_bad_lengths(capsys):
    assert main(["bench", "attention", "--lengths", "16,x", "--memory-length", "0"]) == 2
    assert "--lengths must be comma-separated integers" in capsys.readouterr().err


@pytest.mark.full  # the attention benchmark's demo end to end: 5-6 s on 2 cores
def test_demo_runs(capsys, tmp_path):
    # the demo trains models now (the attention walkthrough moved to `vitrim explain`); --quick checks the plumbing
    assert main(["demo", "--quick", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "report:" in out and (tmp_path / "summary.json").is_file()

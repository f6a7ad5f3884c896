"""A checkpoint's ``run.json`` is data: a ``pipe:`` pattern in it runs nothing, a URL is opened by nothing, and a
record of the wrong shape is one ValueError (``vitrim: error:`` and exit 2 in the CLI) naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from generated import write_shards

from cli_invocations import tiny_checkpoint
from vitrim.cli import main
from vitrim.data import ShardSource
from vitrim.data.shards import _expand, check_local, is_url
from vitrim.train import evaluate_checkpoint

pytest.importorskip("webdataset")


def _checkpoint_with_run(tmp: Path, run: object) -> Path:
    checkpoint = tiny_checkpoint(tmp)
    (tmp / "run.json").write_text(run if isinstance(run, str) else json.dumps(run))
    return checkpoint


def _commands(marker: Path) -> list[str]:
    """Shard patterns that would run ``touch marker`` if anything handed them to WebDataset's gopen."""
    touch = f"pipe:touch {marker}; echo"
    return [
        f"{touch} a/x.tar",  # _info.json is looked for beside the first shard: 'pipe:touch …; echo a/_info.json'
        f"{touch} x.tar",
        f"local.tar::{touch} b/x.tar",  # '::' joins patterns: the second one is a command
        f"  {touch} c/x.tar",  # urlparse strips leading spaces
        f"{touch} {{a,b}}/x.tar",
        "-",  # standard input
        f"{touch} folder",  # not a shard pattern: still no command may be read from a file
    ]


@pytest.mark.parametrize("field", ["data", "val_data"])
def test_a_pipe_pattern_in_run_json_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    for index, pattern in enumerate(_commands(marker)):
        folder = tmp_path / f"run{index}"
        checkpoint = _checkpoint_with_run(folder, {"data": "digits", field: pattern})
        with pytest.raises(ValueError, match=r"run\.json: '" + field + "' .* is a URL, a 'pipe:' command") as err:
            evaluate_checkpoint(checkpoint, device="cpu")
        assert "\n" not in str(err.value)
        assert main(["eval", str(checkpoint), "--quiet", "--device", "cpu"]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("vitrim: error: ") and captured.err.count("\n") == 1, captured.err
        assert "not a local path" in captured.err
        assert not marker.exists(), pattern  # the command never ran


def test_only_the_users_own_data_may_be_a_pipe(tmp_path: Path) -> None:
    """WebDataset's pipe: is the user's feature: typed as --data it works (here: cat of a real shard)."""
    pattern = write_shards(tmp_path, "s", [3], num_classes=2)
    shard = pattern.replace("{000000..000000}", "000000")
    source = ShardSource.parse(f"pipe:cat {shard}|3")
    assert source.num_samples == 3 and source.classes == ("class_0", "class_1")  # _info.json read through the pipe
    with pytest.raises(ValueError, match="not a local path"):
        check_local(f"pipe:cat {shard}", "run.json: 'data'")
    check_local(pattern, "run.json: 'data'")  # a local pattern read from a file is fine
    check_local(f"{pattern}::{pattern}", "run.json: 'data'")
    assert is_url("http://x/a.tar") and is_url("s3://b/a.tar") and is_url("file:///a.tar") and is_url("-")
    assert not is_url("/data/a.tar") and not is_url("shards/train-{0..9}.tar") and not is_url("a/b:c.tar")


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        ("[]", r"run\.json: expected a JSON object, got list \[\]"),
        ({"data": 5}, r"run\.json: 'data' must be 'digits', a folder or a shard pattern, got 5"),
        ({"val_data": ["a"]}, r"'val_data' must be a folder, a shard pattern or null, got \['a'\]"),
        ({"seed": -1}, r"'seed' must be an int, got -1"),
        ({"seed": True}, r"'seed' must be an int, got True"),
        ({"test_fraction": 1.5}, r"'test_fraction' must be a number in \(0, 1\), got 1\.5"),
        ({"noise": "x"}, r"'noise' must be a number >= 0, got 'x'"),
        ({"data_config": [1]}, r"'data_config' must be an object of data-config fields, got \[1\]"),
        ({"classes": [1, 2]}, r"'classes' must be a list of class names, got \[1, 2\]"),
        ("[" * 100_000 + "]" * 100_000, r"run\.json: JSON nested 100000 levels deep"),
        ('{"test_fraction": NaN}', r"run\.json: the non-finite number NaN"),
        ('{"noise": Infinity}', r"run\.json: the non-finite number Infinity"),
        (b"\xff\xfe", r"run\.json: not UTF-8"),
    ],
)
def test_run_json_of_the_wrong_shape_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run: object, expected: str
) -> None:
    checkpoint = tiny_checkpoint(tmp_path)
    record = tmp_path / "run.json"
    record.write_bytes(run) if isinstance(run, bytes) else record.write_text(
        run if isinstance(run, str) else json.dumps(run)
    )
    with pytest.raises(ValueError, match=expected):
        evaluate_checkpoint(checkpoint, device="cpu")
    assert main(["eval", str(checkpoint), "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitrim: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "pattern",
    ["x-{000000..000009}.tar::y-{0..2}.tar", "a/{a..e}{0..10..5}.tar", "{{0..3},{x,y{1..2}}}z{}{,}.tar", "{3..0}"],
)
def test_brace_patterns_expand_as_webdataset_does(pattern: str) -> None:
    import webdataset as wds

    assert _expand(pattern) == wds.shardlists.expand_urls(pattern)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("a/{0..99999999999}.tar", "expands to more than 100000 shards"),  # braceexpand would list 10^11 names
        ("{a,b}" * 40 + ".tar", "expands to more than 100000 shards"),  # 2^40 names of a product
        ("a/{0.." + "9" * 5000 + "}.tar", "expands to more than 100000 shards"),
        ("{" * 40 + "}" * 40 + ".tar", "nests braces over 16 deep"),
        ("{0..1}}.tar", "is not a valid brace pattern"),
    ],
)
def test_brace_bombs_are_refused_before_expansion(tmp_path: Path, pattern: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        check_local(pattern, "run.json: 'data'")
    checkpoint = _checkpoint_with_run(tmp_path, {"data": pattern})
    with pytest.raises(ValueError, match=expected):
        evaluate_checkpoint(checkpoint, device="cpu")


def test_the_users_own_data_replaces_a_hostile_run_record(tmp_path: Path) -> None:
    """The record's data is never needed when the user names the data: it is not opened, and eval runs."""
    marker = tmp_path / "PWNED"
    checkpoint = _checkpoint_with_run(tmp_path / "run", {"data": f"pipe:touch {marker}; echo a/x.tar", "seed": 3})
    metrics = evaluate_checkpoint(checkpoint, data="digits", device="cpu")
    assert metrics["data"] == "digits" and metrics["num_samples"] > 0
    assert not marker.exists()

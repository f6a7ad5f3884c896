"""Every subcommand, run in-process with one argument replaced by a generated bad or edge value: it ends with exit
code 0, or 2 and one line ``vitrim: error: …`` (or argparse's usage error), never with a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vitrim.cli import main

TINY = "embed_dim=16,depth=2,num_heads=2,img_size=16,patch_size=8,in_chans=1"


def commands(tmp: Path) -> dict[str, list[str]]:
    """Cheap, valid invocations of every subcommand (the fuzz mutates one value of each)."""
    (tmp / "a_file").write_text("not a folder")
    return {
        "models": ["models", "deit_*"],
        "explain": ["explain", "--seed", "1", "--out", str(tmp / "explain.png")],
        "train": [
            "train",
            "--model",
            "vit_tiny_patch16_224",
            "--set",
            TINY,
            "--epochs",
            "1",
            "--batch-size",
            "256",
            "--out",
            str(tmp / "run"),
            "--quiet",
            "--threads",
            "1",
        ],
        "eval": ["eval", str(tmp / "run" / "last.safetensors"), "--batch-size", "64"],
        "viz": [
            "viz",
            "attention",
            "--model",
            "vit_tiny_patch16_224",
            "--img-size",
            "32",
            "--digits",
            "0",
            "--out",
            str(tmp / "attn.png"),
        ],
        "bench": [
            "bench",
            "models",
            "vit_tiny_patch16_224",
            "--set",
            TINY,
            "--batch-size",
            "2",
            "--repeats",
            "1",
            "--latency-repeats",
            "0",
            "--warmup",
            "1",
            "--no-memory",
        ],
        "bench-attention": ["bench", "attention", "--lengths", "8", "--repeats", "1", "--memory-length", "0"],
        "bench-reducers": [
            "bench",
            "reducers",
            "--models",
            "vit_tiny_patch16_224",
            "--set",
            TINY,
            "--targets",
            "60%",
            "--batch-sizes",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp / "bench_reducers"),
        ],
    }


BAD = ["-1", "0", "abc", "", "1e9", "nan", "{file}/x", "{missing}", "--help-me", "[1,", "x=1", "3.5"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(commands(Path("/tmp")))), position=st.integers(1, 20), bad=st.sampled_from(BAD))
def test_every_subcommand_with_one_bad_value(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], command: str, position: int, bad: str
) -> None:
    tmp = tmp_path_factory.mktemp("cli")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)  # a generated value such as "nan" may become an output path: written here, not in the repo
        argv = commands(tmp)[command]
        if command == "eval":  # something to evaluate
            assert main(commands(tmp)["train"]) == 0
            capsys.readouterr()
        argv = list(argv)
        index = 1 + position % (len(argv) - 1)
        argv[index] = bad.format(file=tmp / "a_file", missing=tmp / "no" / "such")
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse: a usage error (2) or --help (0)
            code = int(exit_.code or 0)
            assert code in (0, 2)
            return
        err = capsys.readouterr().err
        assert code in (0, 2), (argv, err)
        if code == 2:
            lines = [line for line in err.splitlines() if line.strip()]
            assert lines and lines[-1].startswith("vitrim: error: ") and "Traceback" not in err, (argv, err)

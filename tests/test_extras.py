"""``pip install vitrim`` without an extra: every command either runs or says in one line which extra to install.

The optional libraries are hidden from a fresh interpreter (tests/without_extras.py), which runs the cheapest path
of every subcommand the parser has; and vitrim.extras.OPTIONAL is checked against pyproject.toml's extras."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vitrim
from vitrim.cli import build_parser
from vitrim.extras import OPTIONAL

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).parents[1]
TINY = "img_size=16,patch_size=4,in_chans=1,embed_dim=16,depth=1,num_heads=2,num_classes=10"
USER_ERROR = "a one-line error about the input"
EXTRA_LINE = re.compile(
    r"vitrim: error: vitrim \w+ needs [\w.-]+, which is not installed: pip install 'vitrim\[(\w+)\]'\n"
)


def leaf_commands() -> set[str]:
    """Every command path of the parser: 'models', 'bench attention', 'viz tokens', 'demo translate', …"""
    found: set[str] = set()

    def walk(parser, prefix: str) -> None:  # type: ignore[no-untyped-def]
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not any(action.required for action in subs):  # runs by itself (a group like 'bench' needs a KIND)
            found.add(prefix.strip())
        for action in subs:
            for name, sub in action.choices.items():
                walk(sub, f"{prefix} {name}")

    walk(build_parser(), "")
    return found - {""}


def cheapest_paths(tmp: Path) -> dict[str, tuple[list[str], str | None]]:
    """command -> (argv, what it must do without any extra): None: run (exit 0); an extra: exit 2 with one line naming
    that extra; ``USER_ERROR``: exit 2 with one line about the input (a path that needs a run of its own first)."""
    model = vitrim.create_model(
        "vit_tiny_patch16_224",
        img_size=16,
        patch_size=4,
        in_chans=1,
        embed_dim=16,
        depth=1,
        num_heads=2,
        num_classes=10,
    )
    ckpt = str(vitrim.save_checkpoint(model, tmp / "m.safetensors"))
    run = ["--set", TINY.removesuffix(",num_classes=10"), "--epochs", "1", "--quiet", "--threads", "1"]
    return {
        "models": (["models", "deit_*"], None),
        "explain": (["explain", "--seed", "0", "--out", str(tmp / "e.png")], "viz"),
        "bench attention": (["bench", "attention", "--lengths", "8", "--repeats", "1", "--memory-length", "0"], None),
        "bench models": (
            [
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
                "0",
                "--no-memory",
            ],
            None,
        ),
        "bench reducers": (
            [
                "bench",
                "reducers",
                "--model",
                "vit_tiny_patch16_224",
                "--set",
                TINY,
                "--targets",
                "50%",
                "--batch-sizes",
                "1",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--out",
                str(tmp / "br"),
            ],
            "viz",
        ),
        "demo": (["demo", "--quick", "--out", str(tmp / "demo"), "--quiet"], "viz"),
        "demo translate": (["demo", "translate", "--out", str(tmp / "tr")], "translate"),
        "eval": (["eval", ckpt, "--batch-size", "64"], None),
        "export": (["export", ckpt, "--onnx", str(tmp / "m.onnx")], "export"),
        "train": (["train", "--model", "vit_tiny_patch16_224", "--out", str(tmp / "run"), *run], None),
        "translate": (["translate", "twenty-one", "--run", str(tmp / "tr")], USER_ERROR),  # needs a trained run
        "viz attention": (
            ["viz", "attention", "--checkpoint", ckpt, "--digits", "0", "--out", str(tmp / "a.png")],
            "viz",
        ),
        "viz rollout": (["viz", "rollout", "--checkpoint", ckpt, "--digits", "0", "--out", str(tmp / "r.png")], "viz"),
        "viz tokens": (
            ["viz", "tokens", "--model", "dynamicvit_tiny_patch16_224", "--digits", "0", "--out", str(tmp / "t.png")],
            "viz",
        ),
        "viz rollout-memory": (
            ["viz", "rollout-memory", "--model", "vit_tiny_patch16_224", "--img-size", "32", "--modes", "stream"],
            None,
        ),
    }


def test_every_command_runs_or_names_its_extra_without_any_extra(tmp_path: Path) -> None:
    paths = cheapest_paths(tmp_path)
    assert set(paths) == leaf_commands(), "give every new subcommand its cheapest path here"
    commands = "".join(json.dumps(argv) + "\n" for argv, _ in paths.values())
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "without_extras.py")],
        input=commands,
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(proc.stdout.splitlines()[-1])
    for (name, (_, extra)), result in zip(paths.items(), results):
        if extra is None:
            assert result["code"] == 0, (name, result["stderr"])
        elif extra == USER_ERROR:
            assert result["code"] == 2 and result["stderr"].startswith("vitrim: error: "), (name, result["stderr"])
            assert result["stderr"].count("\n") == 1 and "pip install" not in result["stderr"], (name, result["stderr"])
        else:
            assert result["code"] == 2, (name, result["stderr"])
            line = EXTRA_LINE.fullmatch(result["stderr"])
            assert line is not None and line.group(1) == extra, (name, result["stderr"])


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_table_of_optional_libraries_is_pyproject_s_extras() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {
        (_distribution(req), extra) for extra, reqs in extras.items() if extra not in ("dev", "docs") for req in reqs
    }
    table = {(dist.lower(), extra) for dist, extras_ in OPTIONAL.values() for extra in extras_}
    assert table == declared


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_every_optional_library_is_in_the_dev_environment(module: str) -> None:
    __import__(module)  # make test installs .[dev]: every extra's library is importable there

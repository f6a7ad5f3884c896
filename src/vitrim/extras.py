"""Optional dependencies: which extra of ``pip install 'vitrim[EXTRA]'`` brings each one (owned here).

The core (``pip install vitrim``) needs torch, numpy and safetensors only; drawing, training progress, image files,
translation and ONNX export import their libraries when they are used. When one is missing, the user gets one line
that names the extra to install, instead of Python's ``No module named 'onnxscript'`` from deep inside torch:
:func:`require` raises it for library callers (a ``ModuleNotFoundError`` whose message names the extra) and
``vitrim.cli.main`` prints it for any missing optional import (exit code 2), via :func:`missing_extra_message`.
Commands that would need an extra only at their end (a drawing after training) call :func:`require` first, so no
work is lost to a missing library.

``OPTIONAL`` must list what pyproject.toml's extras list (tests/test_extras.py compares the two).
"""

from __future__ import annotations

import importlib

OPTIONAL: dict[str, tuple[str, tuple[str, ...]]] = {  # import name -> (distribution, extras that install it)
    "matplotlib": ("matplotlib", ("viz", "translate", "explain")),
    "PIL": ("Pillow", ("viz", "train", "data", "explain", "vlm")),
    "torchvision": ("torchvision", ("data", "train", "vlm")),
    "webdataset": ("webdataset", ("data", "train")),
    "huggingface_hub": ("huggingface-hub", ("hub",)),
    "tqdm": ("tqdm", ("train",)),
    "num2words": ("num2words", ("translate",)),
    "sacrebleu": ("sacrebleu", ("translate",)),
    "onnx": ("onnx", ("export",)),
    "onnxscript": ("onnxscript", ("export",)),
    "onnxruntime": ("onnxruntime", ("export",)),
    "captum": ("captum", ("explain",)),
    "transformers": ("transformers", ("vlm",)),
}


def missing_extra_message(err: ImportError, prefer: str | None = None) -> str | None:
    """``"onnxscript, which is not installed: pip install 'vitrim[export]'"`` for an import of an optional dependency
    that failed, or None when ``err`` is about anything else (a bug, not a missing extra). ``prefer``: the extra to name
    when several install the module (the one of the feature the user ran)."""
    module = (err.name or "").partition(".")[0]
    if module not in OPTIONAL:
        return None
    distribution, extras = OPTIONAL[module]
    extra = prefer if prefer in extras else extras[0]
    return f"{distribution}, which is not installed: pip install 'vitrim[{extra}]'"


def require(*modules: str, feature: str) -> None:
    """Import ``modules`` (optional libraries) or raise ``ModuleNotFoundError`` saying that ``feature`` needs them
    and which extra installs them: ``"ONNX export needs onnxscript, which is not installed: pip install
    'vitrim[export]'"``."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            missing = missing_extra_message(err) or f"{module}, which is not installed"
            raise ModuleNotFoundError(f"{feature} needs {missing}", name=err.name) from None

"""vitrim: attention and Vision Transformers that trim their own tokens."""

from __future__ import annotations

import importlib
from typing import Any

from vitrim import moved
from vitrim.attention import MultiHeadAttention, compute_attention, scaled_dot_product_attention
from vitrim.factory import create_model
from vitrim.models import VisionTransformer, ViTConfig, ViTOutput, list_models
from vitrim.optimize import OptimizedModel, optimize
from vitrim.weights import from_timm, from_transformers, load_checkpoint, load_model, save_checkpoint

__version__ = "0.1.0"

moved.install()  # old import paths (one release): vitrim.moved's table answers them, warned

# The subpackages `import vitrim` hands out on first use (`vitrim.data.eval_transform(cfg)`), imported then, so that
# `import vitrim` stays cheap and imports no optional library. A new public subpackage is one more name here.
SUBPACKAGES = ("bench", "data", "export", "losses", "reduce", "train", "viz", "vlm", "vlm_user", "weights")


def __getattr__(name: str) -> Any:
    if name in SUBPACKAGES:
        return importlib.import_module(f"vitrim.{name}")  # the import also sets it on the package: asked once
    raise AttributeError(f"module 'vitrim' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *SUBPACKAGES})


__all__ = [
    "MultiHeadAttention",
    "OptimizedModel",
    "ViTConfig",
    "ViTOutput",
    "VisionTransformer",
    "__version__",
    "compute_attention",
    "create_model",
    "from_timm",
    "from_transformers",
    "list_models",
    "load_checkpoint",
    "load_model",
    "optimize",
    "save_checkpoint",
    "scaled_dot_product_attention",
    *SUBPACKAGES,
]

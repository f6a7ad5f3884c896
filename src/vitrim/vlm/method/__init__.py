"""The VLM methods: the contract (:mod:`vitrim.vlm.method.base`) and one file per method.

Every module of this package is imported here, so a method registers itself by being a file in it (as
:mod:`vitrim.reduce` discovers its reducers): ``@register_method("name", stage=...)`` on a :class:`Method` subclass
whose selection is a function of plain tensors.
"""

import importlib
import pkgutil

from vitrim.vlm.evidence.seeds import content_seed
from vitrim.vlm.method.base import (
    STAGES,
    ImageSelection,
    Method,
    MethodInfo,
    VisionEvidence,
    method_class,
    method_info,
    methods,
    register_method,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "STAGES",
    "ImageSelection",
    "Method",
    "MethodInfo",
    "VisionEvidence",
    "content_seed",
    "method_class",
    "method_info",
    "methods",
    "register_method",
]

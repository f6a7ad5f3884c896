"""The module paths of ``vitrim.vlm`` before its methods, stages and families got a folder each (one release).

``import vitrim.vlm.family_llava`` (or ``from vitrim.vlm.registry import Method``) still works: a finder on
``sys.meta_path`` answers each old name with the module at its new home, as one object (so a monkeypatch on either
name is seen by both), and warns ``DeprecationWarning`` naming the new path. Nothing here is imported by the
library itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    "vitrim.vlm.registry": "vitrim.vlm.method.base",
    "vitrim.vlm.family": "vitrim.vlm.families",
    "vitrim.vlm.family_seams": "vitrim.vlm.families.seams",
    "vitrim.vlm.method_random": "vitrim.vlm.method.random_baseline",
    "vitrim.vlm.tower_methods": "vitrim.vlm.method.tower_reducers",
    **{
        f"vitrim.vlm.method_{name}": f"vitrim.vlm.method.{name}"
        for name in ("dart", "divprune", "fastervlm", "fastv", "pdrop", "visionzip", "vispruner")
    },
    **{
        f"vitrim.vlm.{name}": f"vitrim.vlm.stages.{name}"
        for name in ("in_llm", "in_llm_evidence", "in_llm_slots", "tower", "sequence", "spans")
    },
    "vitrim.vlm.tower_ranking": "vitrim.vlm.method.tower_ranking",
    **{
        f"vitrim.vlm.family_{name}": f"vitrim.vlm.families.{name}"
        for name in ("gemma3", "gemma3_masks", "llava", "llava_next", "paligemma", "qwen2vl", "qwen2vl_vision")
    },
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, home: str) -> None:
        self.home = home

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} is deprecated and goes in the next release: use {self.home}", DeprecationWarning, stacklevel=2
        )
        module = importlib.import_module(self.home)
        self.identity = (module.__spec__, module.__loader__)  # the import system writes the old name's over them
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module at its new home has run already; it keeps its own spec and loader (its own name)."""
        module.__spec__, module.__loader__ = self.identity


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED`, and only those."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        home = MOVED.get(fullname)
        return None if home is None else importlib.machinery.ModuleSpec(fullname, _MovedLoader(home))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (idempotent: a re-imported package adds no second one)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())

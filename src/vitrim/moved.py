"""Old import paths, kept for one release: one table, answered by one finder, each use warned.

:data:`MOVED` maps every path that moved to its new home, a module ``"vitrim.hub"`` to ``"vitrim.weights.hub"``
and a name ``"vitrim.vlm_user:load_model"`` to ``"vitrim.vlm_user.load:load_vlm"``. A move is one line there.

- An old module path is answered by a finder on ``sys.meta_path`` (installed by ``import vitrim``, so the first
  import of a fresh interpreter may already be an old path): ``import vitrim.hub`` warns ``DeprecationWarning`` at
  the user's line, naming the new path, and gives the module at its new home, one object under two names. Where
  the table holds names or submodules under the old path (``vitrim.checkpoint:load_model``, ``vitrim.vlm_demo.ask``),
  it gives an :class:`OldPath` stand-in that reads the new home and answers those itself, each name with a warning.
- A name that left a module that is still there (``vitrim.vlm_user:load_model``) is answered by that module's
  ``__getattr__ = moved_names(__name__)``, with a warning.

The new home is imported by name, only when asked for: an old path is no dependency of anything (no arrow of
docs/architecture.md's floors), and this module imports no other vitrim module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

_DEMO_TRANSLATE = ("demo", "inference", "report", "task", "train")
_DEMO_VLM = (
    "ask",
    "attention",
    "data",
    "demo",
    "evaluate",
    "model",
    "pictures",
    "report",
    "run_folder",
    "sweep",
    "train",
    "words",
)
_VLM_METHODS = ("dart", "divprune", "fastervlm", "fastv", "pdrop", "visionzip", "vispruner")
_VLM_STAGES = ("in_llm", "in_llm_slots", "tower", "sequence", "spans")
_VLM_FAMILIES = ("gemma3", "gemma3_masks", "llava", "llava_next", "paligemma", "qwen2vl")

MOVED: dict[str, str] = {
    # the weights, before vitrim/weights/ (and DynamicViT's loss, before vitrim.losses)
    "vitrim.checkpoint": "vitrim.weights.checkpoint",
    "vitrim.checkpoint:load_model": "vitrim.weights.pretrained:load_model",
    "vitrim.checkpoint_formats": "vitrim.weights.formats",
    "vitrim.checkpoint_formats:HF_WEIGHT_FILES": "vitrim.weights.formats:WEIGHT_FILES",
    "vitrim.checkpoint_hf": "vitrim.weights.hf_names",
    "vitrim.hub": "vitrim.weights.hub",
    "vitrim.in_memory": "vitrim.weights.in_memory",
    "vitrim.pretrained": "vitrim.weights.pretrained",
    "vitrim.models.pretrained_tags": "vitrim.weights.tags",
    "vitrim.reduce.dynamicvit_loss": "vitrim.losses",
    # a user's VLM: one public load_model (vitrim.load_model, a ViT); this one returns a VLM and its processor
    "vitrim.vlm_user:load_model": "vitrim.vlm_user.load:load_vlm",
    "vitrim.vlm_user.load:load_model": "vitrim.vlm_user.load:load_vlm",
    # the demos, before vitrim/demos/
    "vitrim.demo": "vitrim.demos.vision",
    "vitrim.demo_report": "vitrim.demos.vision_report",
    "vitrim.translate": "vitrim.demos.translate",
    **{f"vitrim.translate.{name}": f"vitrim.demos.translate.{name}" for name in _DEMO_TRANSLATE},
    "vitrim.vlm_demo": "vitrim.demos.vlm",
    **{f"vitrim.vlm_demo.{name}": f"vitrim.demos.vlm.{name}" for name in _DEMO_VLM},
    # it read the folder unchecked, and was a second public load_model beside vitrim.load_model
    "vitrim.vlm_demo.model:load_model": "vitrim.demos.vlm.run_folder:load_digits_vlm",
    # vitrim.vlm, before its methods, stages and families got a folder each
    "vitrim.vlm.registry": "vitrim.vlm.method.base",
    "vitrim.vlm.family": "vitrim.vlm.families",
    "vitrim.vlm.family_seams": "vitrim.vlm.stages.inputs",
    "vitrim.vlm.method_random": "vitrim.vlm.method.random_baseline",
    "vitrim.vlm.tower_methods": "vitrim.vlm.method.tower_reducers",
    "vitrim.vlm.tower_ranking": "vitrim.vlm.method.tower_ranking",
    **{f"vitrim.vlm.method_{name}": f"vitrim.vlm.method.{name}" for name in _VLM_METHODS},
    **{f"vitrim.vlm.{name}": f"vitrim.vlm.stages.{name}" for name in _VLM_STAGES},
    **{f"vitrim.vlm.family_{name}": f"vitrim.vlm.families.{name}" for name in _VLM_FAMILIES},
    "vitrim.vlm.family_qwen2vl_vision": "vitrim.vlm.evidence.merged_tokens",
    # vitrim.vlm, before one evidence floor and one encoder seam (issue 49)
    "vitrim.vlm.families.contract": "vitrim.vlm.stages.contract",
    "vitrim.vlm.families.seams": "vitrim.vlm.stages.inputs",
    "vitrim.vlm.families.seams:keep_all": "vitrim.vlm.stages.capture:keep_all",
    "vitrim.vlm.families.seams:write_merged": "vitrim.vlm.stages.capture:write_merged",
    "vitrim.vlm.families.qwen2vl_vision": "vitrim.vlm.evidence.merged_tokens",
    "vitrim.vlm.families.qwen2vl_vision:ScoringCapture": "vitrim.vlm.evidence.merged_tokens:TowerAttention",
    "vitrim.vlm.families.qwen2vl_vision:capture_scoring_block": "vitrim.vlm.families.qwen2vl:tower_attention",
    "vitrim.vlm.families.qwen2vl_vision:received_attention": "vitrim.vlm.evidence.attention:received_by_segment",
    "vitrim.vlm.families.qwen2vl_vision:rotate_half": "vitrim.vlm.evidence.attention:rotate_half",
    "vitrim.vlm.stages.in_llm_evidence": "vitrim.vlm.evidence.llm_layer",
    "vitrim.vlm.in_llm_evidence": "vitrim.vlm.evidence.llm_layer",
    "vitrim.vlm.method.base:content_seed": "vitrim.vlm.evidence.seeds:content_seed",
    # each family's pixel boxes are its file's now (viz/vlm_boxes.py names no family)
    "vitrim.viz.vlm_boxes:llava_boxes": "vitrim.vlm.families.llava:llava_boxes",
    "vitrim.viz.vlm_boxes:anyres_layout": "vitrim.vlm.families.llava_next:anyres_layout",
    "vitrim.viz.vlm_boxes:llava_next_boxes": "vitrim.vlm.families.llava_next:llava_next_boxes",
    "vitrim.viz.vlm_boxes:qwen_boxes": "vitrim.vlm.families.qwen2vl:qwen_boxes",
    "vitrim.viz.vlm_boxes:paligemma_boxes": "vitrim.vlm.families.paligemma:paligemma_boxes",
    "vitrim.viz.vlm_boxes:gemma3_boxes": "vitrim.vlm.families.gemma3:gemma3_boxes",
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    message = f"{old} is deprecated and goes in the next release: use {new}"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def _moved_name(module: str, name: str, stacklevel: int) -> Any:
    """The object the table's ``"module:name"`` now is, warned at the caller ``stacklevel`` frames up."""
    home, _, attribute = MOVED[f"{module}:{name}"].partition(":")
    value = getattr(importlib.import_module(home), attribute)
    _warn(f"{module}.{name}", f"{home}.{attribute}", stacklevel + 1)
    return value


def moved_names(module: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``module``, a module still there: the names :data:`MOVED` says left it."""

    def __getattr__(name: str) -> Any:
        if f"{module}:{name}" not in MOVED:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return _moved_name(module, name, stacklevel=2)

    return __getattr__


def _needs_stand_in(old: str) -> bool:
    """Whether the table holds anything under the old module path: a name that left it, or an old submodule."""
    return any(key.startswith((f"{old}:", f"{old}.")) for key in MOVED)


class OldPath(ModuleType):
    """The stand-in an old module path imports as when the table holds names or submodules under it: it reads the
    module at its new home, and answers what the new home does not hold (``vitrim.checkpoint.load_model``, the old
    submodules of ``vitrim.vlm_demo``) itself, so that nothing of the old layout is written onto the new home.

    A write to it stays on it, as on any module (patch the new home to change what the library sees).
    """

    def __init__(self, old: str, home: ModuleType) -> None:
        super().__init__(old, f"Deprecated (one release): moved to :mod:`{home.__name__}`.")
        self.__moved_to__ = home

    def __getattr__(self, name: str) -> Any:
        old, home = self.__name__, self.__moved_to__
        if f"{old}:{name}" in MOVED:
            return _moved_name(old, name, stacklevel=2)
        if name.startswith("__") and name != "__all__":  # import machinery and introspection ask without meaning it
            raise AttributeError(name)
        try:
            return getattr(home, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {home.__name__!r})") from None

    def __dir__(self) -> list[str]:
        return dir(self.__moved_to__)


class _OldPathLoader(importlib.abc.Loader):
    """An old module path is the module at its new home itself (one object: a monkeypatch on either name is seen by
    both), or, where the table holds names or submodules under it, an :class:`OldPath` stand-in."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        home_name = MOVED[spec.name]
        _warn(spec.name, home_name, stacklevel=2)  # past the import system's frames: the user's import line
        home = importlib.import_module(home_name)
        if _needs_stand_in(spec.name):
            return OldPath(spec.name, home)
        self.home_spec = home.__spec__  # the import system writes the old name's spec over it
        return home

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at its new home ran when it was imported; it keeps its own spec (its name)."""
        if not isinstance(module, OldPath):
            module.__spec__ = self.home_spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED`, and only those."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        # an old package's stand-in has no folder: its old submodules are found by this finder only
        is_package = any(key.startswith(f"{fullname}.") for key in MOVED)
        return importlib.machinery.ModuleSpec(fullname, _OldPathLoader(), is_package=is_package)


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once (idempotent: a re-imported vitrim adds no second one).

    First, because an old package's submodules would otherwise be found by the path finder in the folder of the
    new home, and run a second time under the old name.
    """
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())

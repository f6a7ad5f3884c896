"""Every deprecated path is one line of vitrim.moved's table, and every line of it answers: the old path warns,
naming the new one, and hands on the object at the new home."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import vitrim
from vitrim.moved import MOVED, MovedModuleFinder, OldPath, install

PACKAGE = Path(vitrim.__file__).resolve().parent
MODULES = sorted(old for old in MOVED if ":" not in old)
NAMES = sorted(old for old in MOVED if ":" in old)


def _message(old: str, new: str) -> str:
    return rf"^{re.escape(old)} is deprecated and goes in the next release: use {re.escape(new)}$"


@pytest.mark.parametrize("old", MODULES)
def test_an_old_module_path_warns_and_is_the_new_module(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)  # a fresh import of this path
    home = importlib.import_module(MOVED[old])
    with pytest.warns(DeprecationWarning, match=_message(old, MOVED[old])):
        module = importlib.import_module(old)
    if not isinstance(module, OldPath):
        assert module is home  # one object: a monkeypatch on either name is seen by both
        assert module.__spec__.name == MOVED[old]  # it keeps its own name
        return
    # the table holds names or submodules under this path: a stand-in, which reads the new home
    assert [key for key in MOVED if key.startswith((f"{old}:", f"{old}."))]
    names = [name for name in vars(home) if not name.startswith("__")]  # its own, and the submodules imported so far
    assert [name for name in names if getattr(module, name) is not getattr(home, name)] == []
    assert dir(module) == dir(home)


@pytest.mark.parametrize("old", NAMES)
def test_an_old_name_warns_and_is_the_new_object(old: str) -> None:
    module_name, name = old.split(":")
    home_name, new_name = MOVED[old].split(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the module's own path may be an old one
        module = importlib.import_module(module_name)
    with pytest.warns(DeprecationWarning, match=_message(f"{module_name}.{name}", f"{home_name}.{new_name}")):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(home_name), new_name)
    assert name not in dir(module)  # answered, not advertised


def test_the_targets_exist_and_the_old_paths_have_no_file_of_their_own() -> None:
    for new in MOVED.values():
        module_name, _, name = new.partition(":")
        assert module_name not in MOVED, f"{new}: a target must be a new home, not another old path"
        module = importlib.import_module(module_name)
        assert not name or name in vars(module), f"{new}: no such name"
    for old in MODULES:
        path = PACKAGE.joinpath(*old.split(".")[1:])
        assert not path.with_suffix(".py").exists() and not path.is_dir(), f"{old} still has a file: it would shadow"
        if any(key.startswith(f"{old}.") for key in MOVED):  # an old package: each module of its home has a line
            home = PACKAGE.joinpath(*MOVED[old].split(".")[1:])
            missing = [f.stem for f in home.glob("*.py") if f.stem != "__init__" and f"{old}.{f.stem}" not in MOVED]
            assert not missing, f"{old}: no line for its old submodules {missing}"


PROBE = """
import importlib, json, warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    importlib.import_module({first!r})  # the interpreter's first vitrim import: vitrim/__init__ installs the finder
    from vitrim.moved import MOVED
    for old in sorted(m for m in MOVED if ":" not in m):
        importlib.import_module(old)
print(json.dumps(sorted({{str(w.message) for w in seen if w.category is DeprecationWarning}})))
"""


def test_a_fresh_interpreter_answers_every_old_module_path_first_thing() -> None:
    first = "vitrim.vlm_demo.run_folder"  # an old submodule of an old package, before anything of vitrim is imported
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, check=True
    ).stdout
    messages = json.loads(out.strip().splitlines()[-1])
    expected = [f"{old} is deprecated and goes in the next release: use {MOVED[old]}" for old in MODULES]
    assert sorted(m for m in messages if m in expected) == sorted(expected)


def test_what_is_not_in_the_table_is_not_answered() -> None:
    import vitrim.vlm_user

    with pytest.raises(ModuleNotFoundError, match=r"vitrim\.vlm_demo\.nothing"):
        importlib.import_module("vitrim.vlm_demo.nothing")  # an old package has no folder the path finder reads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("vitrim.checkpoint")
    with pytest.raises(
        AttributeError, match=r"no attribute 'NoSuchName' \(it moved to 'vitrim\.weights\.checkpoint'\)"
    ):
        old.NoSuchName  # noqa: B018
    with pytest.raises(AttributeError, match=r"^module 'vitrim.vlm_user' has no attribute 'nope'$"):
        vitrim.vlm_user.nope  # noqa: B018


def test_the_finder_is_installed_once_and_before_the_path_finder() -> None:
    """Before it: else an old package's submodules are found in the new home's folder and run twice."""
    install()
    install()
    finders = [finder for finder in sys.meta_path if isinstance(finder, MovedModuleFinder)]
    assert len(finders) == 1
    assert sys.meta_path.index(finders[0]) < sys.meta_path.index(importlib.machinery.PathFinder)


def test_one_public_load_model() -> None:
    """``vitrim.load_model`` builds a ViT; no other module of the package defines a public ``load_model``."""
    defined = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "load_model"
    ]
    assert defined == ["weights/pretrained.py"]
    assert vitrim.vlm_user.load_vlm is vitrim.vlm_user.load.load_vlm and "load_model" not in vitrim.vlm_user.__all__

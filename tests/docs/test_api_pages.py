"""Every public module has an API page, and every page of the API reference is in the site's navigation.

A module is public unless it is the command line (``vitrim.cli``, documented by its own ``--help`` and the guides), the
vLLM plugin (``vitrim.vllm``: vLLM loads it; the guide docs/vllm.md documents it, and its modules import vLLM, which
lives in its own environment, not the docs'), the lmms-eval bridge (``vitrim.eval``: the guide docs/evaluating.md
documents it, and it imports lmms-eval, in its own environment too), or a package's ``__init__`` that defines
nothing (its names are documented where they are defined). Old import paths have no file (vitrim.moved's table
answers them), so no page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "vitrim"


def _defines_something(path: Path) -> bool:
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in ast.parse(path.read_text()).body)


def public_modules() -> set[str]:
    modules = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        apart = parts[1:2] in (("cli",), ("vllm",), ("eval",))
        if apart or any(part.startswith("_") and part != "__init__" for part in parts):
            continue
        if parts[-1] == "__init__":
            if path.parent == PACKAGE or not _defines_something(path):
                continue
            parts = parts[:-1]
        modules.add(".".join(parts))
    return modules


def documented_modules() -> dict[str, str]:
    pages = {}
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for module in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), flags=re.M):
            pages[module] = page.name
    return pages


def test_every_public_module_has_an_api_page() -> None:
    documented = documented_modules()
    missing = sorted(public_modules() - set(documented))
    assert not missing, f"public modules without an API page (add a '::: name' line to a page of docs/api): {missing}"
    gone = sorted(m for m in documented if m != "vitrim" and m not in public_modules())
    assert not gone, f"API pages render modules that are not public modules: {gone}"


def test_every_api_page_is_in_the_navigation() -> None:
    navigation = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(page.name for page in (ROOT / "docs" / "api").glob("*.md"))
    assert pages and all(f"api/{page}" in navigation for page in pages), pages


def test_the_lists_see_modules_and_faces(tmp_path: Path) -> None:
    # the checks above would pass vacuously if these saw nothing
    modules = public_modules()
    assert {"vitrim.viz.chefer", "vitrim.data", "vitrim.seeds"} <= modules
    assert "vitrim.cli.train" not in modules and "vitrim.vllm.plugin" not in modules
    assert "vitrim.attention" not in modules  # a face: its names are documented where they are defined
    assert "vitrim.viz.vlm_boxes" in modules  # hands old names on, but defines vlm_token_boxes: no shim

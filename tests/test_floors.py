"""The floors of docs/architecture.md against the code: every `import vitrim…` in src/vitrim goes to a lower floor
or stays on its own, the table lists every module once, and no two modules import each other in a circle; the same
inside `vlm/`, whose rooms have a table of their own ("Inside `vlm/`")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vitrim"


def floors_of_the_docs(section: str = "## The floors") -> dict[str, int]:
    """Room ('attention/' for a package, 'hub.py' for a module) -> floor, from the table of ``section`` in
    docs/architecture.md (the text from that heading to the next heading)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    text = text.split(section, 1)[1].split("\n#", 1)[0]
    floors: dict[str, int] = {}
    for number, rooms in re.findall(r"^\| (\d+) \| (.*?) \|", text, flags=re.M):
        for room in re.findall(r"`([\w./]+)`", rooms):
            assert room not in floors, f"{room} is on two floors of the table"
            floors[room] = int(number)
    return floors


def room_of(path: Path, package: Path = PACKAGE) -> str:
    relative = path.relative_to(package)
    return f"{relative.parts[0]}/" if len(relative.parts) > 1 else relative.name


def room_of_module(name: str, package: Path = PACKAGE) -> str | None:
    """'vitrim.reduce.tome' -> 'reduce/', 'vitrim.seeds' -> 'seeds.py'; None for the package itself (or a module
    outside ``package``, e.g. 'vitrim.vlm.method.base' -> 'method/' for the package src/vitrim/vlm)."""
    prefix = ".".join(package.relative_to(PACKAGE.parent).parts)
    if not name.startswith(prefix + "."):
        return None
    first = name[len(prefix) + 1 :].split(".")[0]
    return f"{first}/" if (package / first).is_dir() else f"{first}.py"


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """The rooms ``path`` imports (anywhere in the file: module level, functions, TYPE_CHECKING blocks)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "vitrim":
                names += [f"vitrim.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    rooms = {room_of_module(n, package) for n in names if n.split(".")[0] == "vitrim"}
    return {room for room in rooms if room is not None and (package / room.rstrip("/")).exists()}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        if path.relative_to(package) == Path("__init__.py"):
            continue
        room = room_of(path, package)
        graph.setdefault(room, set()).update(imports_of(path, package) - {room})
    return graph


# each package whose rooms the docs put on floors of their own: (the package, the heading of its table)
HOUSES = [(PACKAGE, "## The floors"), (PACKAGE / "vlm", "### Inside `vlm/`")]


@pytest.mark.parametrize(("package", "section"), HOUSES, ids=["vitrim", "vlm"])
def test_the_table_lists_every_module_once(package: Path, section: str) -> None:
    rooms = {room_of(p, package) for p in package.rglob("*.py") if p.relative_to(package) != Path("__init__.py")}
    assert set(floors_of_the_docs(section)) == rooms


@pytest.mark.parametrize(("package", "section"), HOUSES, ids=["vitrim", "vlm"])
def test_every_import_goes_down_or_stays_on_its_floor(package: Path, section: str) -> None:
    floors = floors_of_the_docs(section)
    upward = [
        f"{room} (floor {floors[room]}) imports {target} (floor {floors[target]})"
        for room, targets in import_graph(package).items()
        for target in sorted(targets)
        if floors[target] > floors[room]
    ]
    assert not upward


@pytest.mark.parametrize("package", [package for package, _ in HOUSES], ids=["vitrim", "vlm"])
def test_no_circle_between_modules(package: Path) -> None:
    graph = import_graph(package)
    done: set[str] = set()

    def visit(room: str, path: list[str]) -> None:
        assert room not in path, "circle: " + " -> ".join([*path[path.index(room) :], room])
        if room in done:
            return
        for target in sorted(graph.get(room, ())):
            visit(target, [*path, room])
        done.add(room)

    for room in sorted(graph):
        visit(room, [])


def test_the_parser_sees_imports_in_functions_and_names_from_the_package(tmp_path: Path) -> None:
    # otherwise the checks above would pass vacuously
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from vitrim import cli, seeds\n    import vitrim.train.loop\n")
    assert imports_of(probe) == {"cli/", "seeds.py", "train/"}
    assert import_graph()["cli/"] >= {"train/", "models/", "bench/"}
    assert import_graph(PACKAGE / "vlm")["stacking.py"] >= {"stages/", "method/"}

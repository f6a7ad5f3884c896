"""``python without_extras.py < COMMANDS``: ``vitrim`` commands (one JSON argv a line) run as after ``pip install
vitrim``, without any extra. Each optional library of :data:`vitrim.extras.OPTIONAL` fails to import, as when it is
not installed; the commands run in this one process (torch is imported once) and their exit codes and error output
are printed as JSON, one object per command."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from importlib.abc import MetaPathFinder
from typing import Any

from vitrim.extras import OPTIONAL


class Hidden(MetaPathFinder):
    """A finder that finds nothing of the optional libraries: as if they were not installed (``find_spec`` gives
    None, ``import`` raises ModuleNotFoundError), which is what torch's own availability checks expect too."""

    def __init__(self, finder: Any) -> None:
        self.finder = finder

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname.partition(".")[0] in OPTIONAL:
            return None
        return self.finder.find_spec(fullname, path, target)

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


for name in [m for m in sys.modules if m.partition(".")[0] in OPTIONAL]:
    del sys.modules[name]
sys.meta_path[:] = [Hidden(finder) for finder in sys.meta_path]

from vitrim.cli import main  # noqa: E402  (after the optional libraries are hidden)

results = []
for line in sys.stdin:
    argv = json.loads(line)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse
            code = exit_.code
        except BaseException as exc:  # a traceback: what the test forbids
            code, err = 1, io.StringIO(f"{type(exc).__name__}: {exc}")
    results.append({"argv": argv, "code": code, "stderr": err.getvalue()})
print(json.dumps(results))

"""Peak memory of one measurement, in a fresh process: the one probe every memory benchmark uses.

``measure_in_fresh_process(batch_memory, case=..., batch_size=...)`` starts ``python -m vitrim.bench.memory``
with the function's name and its keyword arguments as JSON; the child calls it and prints its result, a JSON object.
Callers pass the function itself, not a name in a string, so mypy and the import graph see what runs. A fresh
process is needed because the peak resident set only grows: in the parent, an earlier case's high-water mark would
hide this one's. Only functions in ``vitrim.bench`` modules are ever called, and the arguments are plain JSON, so
nothing the caller passes can run other code.
"""

from __future__ import annotations

import importlib
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes.

    Linux carries ``ru_maxrss`` over fork and exec, so a child of a large parent would report the parent's peak
    (and every case would seem to grow by 0). ``VmHWM`` belongs to the process's own address space; use it when
    there is one.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_in_fresh_process(function: Callable[..., dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """Run ``function`` (a top-level function of a ``vitrim.bench`` module) with ``kwargs`` in a new Python process.

    ``kwargs`` must be JSON values; returns the function's result (a JSON object) as the child printed it.
    """
    name = f"{function.__module__}:{function.__qualname__}"
    if _resolve(name) is not function:  # a bad name fails here, not in the child
        raise ValueError(f"a memory probe must be a top-level function of a vitrim.bench module, got {name!r}")
    cmd = [sys.executable, "-m", "vitrim.bench.memory", name, json.dumps(kwargs), str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"memory measurement {name}({kwargs}) failed (exit {done.returncode}): {tail[0]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _resolve(function: str) -> Any:
    module_name, _, name = function.partition(":")
    if not module_name.startswith("vitrim.bench.") or not name.isidentifier():
        raise ValueError(f"a memory probe must be a function 'vitrim.bench.<module>:<name>', got {function!r}")
    return getattr(importlib.import_module(module_name), name)


if __name__ == "__main__":  # the child: python -m vitrim.bench.memory FUNCTION JSON_KWARGS THREADS
    torch.set_num_threads(int(sys.argv[3]))
    print(json.dumps(_resolve(sys.argv[1])(**json.loads(sys.argv[2]))))

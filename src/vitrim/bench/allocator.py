"""Stable timings: keep glibc from returning large buffers to the OS after every call.

By default glibc serves allocations above a dynamic threshold with mmap and unmaps them on free, so a benchmark
that allocates a few MB per call pays page faults on some runs and not on others (timings seen to jump 2x between
identical processes). Every benchmark calls :func:`pin_malloc_threshold` first; it changes only the benchmark's
own process, and it affects the baseline and vitrim alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def pin_malloc_threshold(num_bytes: int = 256 * 2**20) -> bool:
    """Serve allocations below ``num_bytes`` from the heap and keep freed memory; False where not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, num_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * num_bytes))

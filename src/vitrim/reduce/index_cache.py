"""Index tensors that depend only on shapes, built once per (shape, device) and reused by every forward.

A reducer's bookkeeping needs small constant tensors (``arange`` of the kept slots, batch offsets for flat row
indices). Building them costs an allocation and a kernel each, on every block of every forward: at batch 1 that was a
few percent of a ToMe forward (268 ``arange`` calls). Here each is built once and returned again, read-only: callers
must never write into a cached tensor.

Under ``torch.compile`` and ``torch.export`` (``torch.compiler.is_compiling()``), nothing is cached: the tensor is built
in the traced graph, where it is a constant folded for free, and a cached tensor would be a module-external input (and
with a dynamic batch, its key would be symbolic). Cached tensors are made outside inference mode, so that a tensor first
built under ``torch.inference_mode`` can later be saved for backward in training.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

MAX_ENTRIES = 512  # a few shapes per block and batch size; bounded so a sweep over sizes cannot grow it forever

_cache: OrderedDict[tuple[object, ...], Tensor] = OrderedDict()


def cached_arange(start: int, end: int, step: int = 1, *, device: torch.device) -> Tensor:
    """``torch.arange(start, end, step)`` (long) on ``device``, built once per arguments. Read-only."""
    return cached(("arange", start, end, step, device), lambda: torch.arange(start, end, step, device=device))


def batch_offsets(batch: int, rows_per_batch: int, *, device: torch.device) -> Tensor:
    """(B, 1) long ``[0, R, 2R, …]``: added to per-batch row indices, it makes them indices into (B·R, …). Read-only."""
    return cached(
        ("offsets", batch, rows_per_batch, device), lambda: torch.arange(batch, device=device)[:, None] * rows_per_batch
    )


def cached(key: tuple[object, ...], build: Callable[[], Tensor]) -> Tensor:
    """``build()``, made once per ``key`` (which must name everything the tensor depends on: shapes, dtype, device)
    and returned again. Read-only. While tracing, ``build()`` runs in the graph every time (a folded constant)."""
    if torch.compiler.is_compiling():
        return build()
    found = _cache.get(key)
    if found is None:
        with torch.inference_mode(False):
            found = build()
        _cache[key] = found
        if len(_cache) > MAX_ENTRIES:
            _cache.popitem(last=False)
    else:
        # least recently used goes first: a forward that only reads an old entry must not see it evicted by the
        # entries it adds after (with first-in-first-out, a full cache rebuilt such entries on every forward)
        _cache.move_to_end(key)
    return found


def cached_eye(n: int, *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The (n, n) identity: its rows are the one-hot vectors that turn destination indices into an assignment
    matrix (``F.embedding(dest, eye)``) in one call. Read-only."""
    return cached(("eye", n, dtype, device), lambda: torch.eye(n, dtype=dtype, device=device))


def clear() -> None:
    """Forget every cached tensor (e.g. to free device memory)."""
    _cache.clear()

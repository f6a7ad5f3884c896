"""The shape-keyed tensor cache of the reducers: built once, and least recently used evicted first.

With first-in-first-out eviction, a full cache (a long test run, a sweep over sizes) evicted the entries a forward
only read while the same forward added others, so the next forward rebuilt them: `vitrim bench ops` counted 26 extra
calls for ToMe after other tests had filled the cache.
"""

from __future__ import annotations

import torch

from vitrim.reduce import index_cache


def test_built_once_then_returned_again() -> None:
    index_cache.clear()
    builds: list[int] = []

    def build() -> torch.Tensor:
        builds.append(1)
        return torch.zeros(3)

    first = index_cache.cached(("zeros", 3), build)
    assert index_cache.cached(("zeros", 3), build) is first
    assert len(builds) == 1


def test_an_entry_read_recently_survives_a_full_cache() -> None:
    index_cache.clear()
    builds: list[str] = []

    def build(name: str) -> torch.Tensor:
        builds.append(name)
        return torch.zeros(1)

    for i in range(index_cache.MAX_ENTRIES):
        index_cache.cached(("filler", i), lambda i=i: build(f"filler {i}"))
    index_cache.cached(("filler", 0), lambda: build("filler 0 again"))  # read: now the most recently used
    index_cache.cached(("new",), lambda: build("new"))  # full: evicts the least recently used, filler 1
    index_cache.cached(("filler", 0), lambda: build("filler 0 again"))
    index_cache.cached(("filler", 1), lambda: build("filler 1 again"))
    assert builds[index_cache.MAX_ENTRIES :] == ["new", "filler 1 again"]
    assert len(index_cache._cache) == index_cache.MAX_ENTRIES
    index_cache.clear()


def test_arange_and_batch_offsets_are_what_torch_builds() -> None:
    assert torch.equal(index_cache.cached_arange(2, 9, 3, device=torch.device("cpu")), torch.arange(2, 9, 3))
    assert torch.equal(index_cache.batch_offsets(3, 5, device=torch.device("cpu")), torch.tensor([[0], [5], [10]]))

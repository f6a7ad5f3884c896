"""What the hostile-file tests share: an address-space limit under which an unbounded allocation crashes the test."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest


@pytest.fixture
def bounded_memory() -> Iterator[None]:
    """An address-space limit ~3 GiB above what the process holds: an unbounded allocation crashes the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (held + 3 * 2**30, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

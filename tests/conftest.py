"""One torch thread for the training and data tests: on a shared machine, threads that wait for each other lose their
cores (a training step measured 12x slower with 2 threads than with 1 under load), and the tiny models gain nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

ONE_THREAD_FOLDERS = ("train", "datasets")


@pytest.fixture(autouse=True)
def _one_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.path.parent.name not in ONE_THREAD_FOLDERS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

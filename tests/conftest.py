"""Suite-wide settings.

* One torch thread per test process. Under pytest-xdist (``make test``) each core runs its own worker, and threads
  that wait for each other lose their cores to the other worker (a training step measured 12x slower with 2 threads
  than with 1 under load); the tiny models gain nothing from a second thread. A plain ``pytest`` run keeps only the
  training and data tests on one thread, as before.
* torchvision's wheel has no compiled ops for this CPU build of torch: the project's install handles that
  (``src/vitrim/torchvision_without_ops.py``, put in ``.venv`` by the Makefile), so the suite runs as a user's code
  does, with no stub of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

ONE_THREAD_FOLDERS = ("train", "datasets", "fuzz")  # fuzz: the training runs of test_faults.py
IN_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


if IN_XDIST_WORKER:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    if IN_XDIST_WORKER or request.path.parent.name not in ONE_THREAD_FOLDERS:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Suite-wide settings.

* One torch thread per test process. Under pytest-xdist (``make test``) each core runs its own worker, and threads
  that wait for each other lose their cores to the other worker (a training step measured 12x slower with 2 threads
  than with 1 under load); the tiny models gain nothing from a second thread. A plain ``pytest`` run keeps only the
  training and data tests on one thread, as before.
* timm imports here although torchvision's wheel has no compiled ops for this CPU build of torch ("operator
  torchvision::nms does not exist"): its two registration modules are stubbed before the first ``import timm``.
  Nothing is edited on disk, and where torchvision loads (a matching build) the stub is skipped. timm's models and
  transforms work; ``torchvision.ops`` does not.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator

import pytest
import torch

ONE_THREAD_FOLDERS = ("train", "datasets")
IN_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def _make_torchvision_importable() -> None:
    try:
        import torchvision
    except ImportError:
        return  # not installed: tests that need timm skip themselves with importorskip
    except RuntimeError:  # the wheel's C ops do not match this torch
        for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules.pop("torchvision", None)
        import torchvision  # noqa: F401


_make_torchvision_importable()
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

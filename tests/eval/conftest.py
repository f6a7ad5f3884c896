"""tests/eval: vitrim inside lmms-eval, run by ``make test-eval`` in ``.venv-eval`` (lmms-eval is not in ``.venv``).

Every module here skips itself where lmms-eval is not installed. Nothing is downloaded: the digits tasks are written
to a temporary folder (``datasets.save_to_disk``), the checkpoints are the shipped digits VLM and a tiny random LLaVA
folder built here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CANVASES = 8  # held-out canvases in the tasks the tests write (the demo's first 8)


@pytest.fixture(scope="session")
def canvases() -> int:
    return CANVASES


@pytest.fixture(scope="session")
def digits_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vitrim.eval.digits_tasks import write_digits_tasks

    return write_digits_tasks(tmp_path_factory.mktemp("digits_tasks"), canvases=CANVASES)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_vlms.folders import save_llava

    return save_llava(tmp_path_factory.mktemp("tiny_llava") / "llava")

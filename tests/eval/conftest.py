"""tests/eval: vitrim inside lmms-eval, run by ``make test-eval`` in ``.venv-eval`` (lmms-eval is not in ``.venv``).

Every module here skips itself where lmms-eval is not installed; test_vllm_path.py, where vLLM is not (it runs in
``.venv-eval-vllm``, ``make test-eval-vllm``). Nothing is downloaded: the digits tasks (canvases and clips) and a
tiny video task are written to temporary folders (``datasets.save_to_disk``; the clips with PyAV), the checkpoints
are the shipped digits VLM and video model and tiny random folders of each family built here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CANVASES = 8  # held-out canvases in the tasks the tests write (the demo's first 8)
CLIPS = 8  # held-out clips in the video digits tasks the tests write (the video demo's first 8)


@pytest.fixture(scope="session")
def canvases() -> int:
    return CANVASES


@pytest.fixture(scope="session")
def digits_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vitrim.eval.digits_tasks import write_digits_tasks

    return write_digits_tasks(tmp_path_factory.mktemp("digits_tasks"), canvases=CANVASES)


@pytest.fixture(scope="session")
def clips() -> int:
    return CLIPS


@pytest.fixture(scope="session")
def digits_video_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vitrim.eval.digits_tasks import write_digits_video_tasks

    return write_digits_video_tasks(tmp_path_factory.mktemp("digits_video_tasks"), clips=CLIPS)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_vlms.folders import save_llava

    return save_llava(tmp_path_factory.mktemp("tiny_llava") / "llava")


VIDEO_TASK = "vitrim_tiny_video"
VIDEO_UTILS = """def doc_to_visual(doc):
    from pathlib import Path

    return [str(Path(__file__).parent / "clips" / doc["video"])]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"]
"""


@pytest.fixture(scope="session")
def video_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """lmms-eval's video convention offline: a task (``vitrim_tiny_video``) whose ``doc_to_visual`` hands the model
    each clip's path, as VideoMME's does; the clips are ``tiny_vlms.clips.CLIPS``, the questions saved with
    ``datasets.save_to_disk``."""
    import datasets
    from tiny_vlms.clips import CLIPS, write_clip

    folder = tmp_path_factory.mktemp("video_task")
    (folder / "clips").mkdir()
    rows = []
    for number, (frames, height, width) in enumerate(CLIPS):
        write_clip(folder / "clips" / f"clip{number}.mp4", frames, height, width, seed=number)
        rows.append({"video": f"clip{number}.mp4", "question": "w5 " * (1 + number % 2) + "w7", "answer": "w9"})
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(folder / "data"))
    (folder / "utils.py").write_text(VIDEO_UTILS)
    (folder / f"{VIDEO_TASK}.yaml").write_text(
        f"task: {VIDEO_TASK}\ndataset_path: {folder / 'data'}\ndataset_kwargs:\n  load_from_disk: true\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_visual: !function utils.doc_to_visual\n"
        "doc_to_text: !function utils.doc_to_text\ndoc_to_target: answer\n"
        "generation_kwargs:\n  max_new_tokens: 4\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 0.1\n"
    )
    return folder


@pytest.fixture(scope="session")
def task_manager(digits_tasks: Path, digits_video_tasks: Path, video_task: Path) -> Any:
    """One lmms-eval ``TaskManager`` over the digits, video digits and video tasks for the session (building one
    indexes every task lmms-eval ships: about 13 s here)."""
    from lmms_eval.tasks import TaskManager

    return TaskManager(include_path=[str(digits_tasks), str(digits_video_tasks), str(video_task)])

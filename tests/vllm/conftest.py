"""tests/vllm: vitrim's vLLM plugin on vLLM's CPU backend, run by ``make test-vllm`` in ``.venv-vllm``.

Every module here skips itself where vLLM is not installed (the main suite's ``.venv``). Engines run in the test's
own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the model the test asks about is in reach, and an engine's start
costs no extra process; tests/vllm/test_serve.py runs ``vllm serve`` as users do, with its processes.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VITRIM_VLLM_RECORD", "1")  # the engines' kept indices, by image (vitrim.vllm.selection_record)

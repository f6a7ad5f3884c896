"""Everything of vitrim.vllm that leans on vLLM's internals, in one place, behind one version check (owned here).

The model classes subclass vLLM's public model classes and override ``embed_multimodal`` and the processing info's
``get_num_image_tokens``, the seams vLLM offers an out-of-tree model. Beyond them:

- **The vLLM version.** Those seams, and the two below, are vLLM internals that change between releases without
  notice; vitrim.vllm was run and tested on :data:`TESTED` only. :func:`check_vllm_version` fails in one line on
  any other release (``VITRIM_VLLM_UNTESTED=1`` lets a user try anyway, at their own risk).
- **Pruning on the CPU runner** (:func:`enable_multimodal_pruning`). vLLM keeps an image's M-RoPE positions after
  pruning only when the model runner's ``is_multimodal_pruning_enabled`` is set; ``GPUModelRunner.load_model``
  sets it for a model that ``supports_multimodal_pruning``, ``CPUModelRunner.load_model`` never does (vLLM 0.32).
  Removed when upstream sets the flag in ``CPUModelRunner.load_model`` as the GPU runner does.
"""

from __future__ import annotations

import os
from typing import Any

TESTED = ("0.32",)  # vLLM major.minor releases vitrim.vllm's tests ran on
UNTESTED_ENV = "VITRIM_VLLM_UNTESTED"


def check_vllm_version(version: str | None = None) -> None:
    """``RuntimeError`` (one line) unless ``version`` (default: the installed vLLM's) is a tested release."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor in TESTED or os.environ.get(UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"vitrim: vLLM {version} is not a release vitrim.vllm was tested on (tested: "
        f"{', '.join(v + '.x' for v in TESTED)}); install vllm=={TESTED[-1]}.* or set {UNTESTED_ENV}=1 to try anyway"
    )


def enable_multimodal_pruning(runner: Any) -> None:
    """Set the CPU model runner's ``is_multimodal_pruning_enabled`` as the GPU runner does (see the module doc)."""
    runner.is_multimodal_pruning_enabled = True

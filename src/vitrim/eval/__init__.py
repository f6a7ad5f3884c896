"""vitrim inside lmms-eval: ``lmms-eval --model vitrim --model_args pretrained=...,method=visionzip,keep=64``.

Installed by the ``eval`` extra (``pip install 'vitrim[eval]'``, which brings lmms-eval); lmms-eval finds the model
through its entry-point group ``lmms_eval.models`` (pyproject.toml), which reads :func:`manifests`.

- :mod:`vitrim.eval.model_args`: what ``--model_args`` says (the checkpoint, the methods, their options);
- :mod:`vitrim.eval.inputs`: the checkpoint, its prompts and answers (a transformers processor, or the digits models');
- :mod:`vitrim.eval.image_tokens`, :mod:`vitrim.eval.prefill_cost`: what is recorded beside each answer;
- :mod:`vitrim.eval.lmms_model`: the lmms-eval model (with :mod:`vitrim.eval.vllm_model`, the served one, the only
  modules that import lmms-eval);
- :mod:`vitrim.eval.digits_tasks`: the digits VLM's and the digits video model's questions as lmms-eval tasks read
  from disk.

Importing this package imports neither lmms-eval nor transformers.
"""

from __future__ import annotations

from typing import Any

MODEL_ID = "vitrim"
MODEL_CLASS = "vitrim.eval.lmms_model.VitrimModel"
VLLM_MODEL_ID = "vitrim_vllm"  # needs vLLM beside lmms-eval (docs/evaluating.md)
VLLM_MODEL_CLASS = "vitrim.eval.vllm_model.VitrimVLLMModel"


def manifests() -> list[Any]:
    """lmms-eval's entry point (group ``lmms_eval.models``): the simple (non-chat) models ``vitrim`` (transformers)
    and ``vitrim_vllm`` (vLLM with vitrim's plugin; its class imports vLLM only when it is asked for)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [
        ModelManifest(model_id=MODEL_ID, simple_class_path=MODEL_CLASS),
        ModelManifest(model_id=VLLM_MODEL_ID, simple_class_path=VLLM_MODEL_CLASS),
    ]

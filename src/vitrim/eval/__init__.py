"""vitrim inside lmms-eval: ``lmms-eval --model vitrim --model_args pretrained=...,method=visionzip,keep=64``.

Installed by the ``eval`` extra (``pip install 'vitrim[eval]'``, which brings lmms-eval); lmms-eval finds the model
through its entry-point group ``lmms_eval.models`` (pyproject.toml), which reads :func:`manifests`.

- :mod:`vitrim.eval.model_args`: what ``--model_args`` says (the checkpoint, the methods, their options);
- :mod:`vitrim.eval.inputs`: the checkpoint, its prompts and answers (a transformers processor, or the digits VLM's);
- :mod:`vitrim.eval.image_tokens`, :mod:`vitrim.eval.prefill_cost`: what is recorded beside each answer;
- :mod:`vitrim.eval.lmms_model`: the lmms-eval model (the only module that imports lmms-eval);
- :mod:`vitrim.eval.digits_tasks`: the digits VLM's questions as lmms-eval tasks read from disk.

Importing this package imports neither lmms-eval nor transformers.
"""

from __future__ import annotations

from typing import Any

MODEL_ID = "vitrim"
MODEL_CLASS = "vitrim.eval.lmms_model.VitrimModel"


def manifests() -> list[Any]:
    """lmms-eval's entry point (group ``lmms_eval.models``): the ``vitrim`` model, a simple (non-chat) model."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id=MODEL_ID, simple_class_path=MODEL_CLASS)]

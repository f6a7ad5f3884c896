"""vitrim.weights is the one home of loading: one public load_model, one weight-file list, one shard-index reader,
one conversion of a Hugging Face state dict per load (its old import paths: tests/test_moved.py)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

import vitrim
import vitrim.weights.formats as formats
from vitrim.weights import hub


def test_one_public_load_model() -> None:
    assert vitrim.load_model is vitrim.weights.load_model is vitrim.weights.pretrained.load_model
    others = ("checkpoint", "formats", "hf_names", "hub", "in_memory", "tags")
    assert not [m for m in others if hasattr(importlib.import_module(f"vitrim.weights.{m}"), "load_model")]
    assert hub.WEIGHT_FILES is formats.WEIGHT_FILES  # one list of the files that hold weights


def test_one_shard_index_reader(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {"a": "model-2.safetensors", "b": "model-1.safetensors", "c": "model-2.safetensors"}})
    )
    assert formats.shard_files(index) == ["model-1.safetensors", "model-2.safetensors"]
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="has no 'weight_map'; not a Hugging Face shard index"):
        formats.shard_files(index)


def test_a_hugging_face_state_dict_is_converted_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32)
    transformers.ViTForImageClassification(transformers.ViTConfig(**sizes, patch_size=8, num_labels=3)).save_pretrained(
        tmp_path
    )
    calls = []
    convert = formats.convert_hf
    monkeypatch.setattr(formats, "convert_hf", lambda state_dict: calls.append(1) or convert(state_dict))
    model = vitrim.load_model(tmp_path)
    assert len(calls) == 1 and model.config.embed_dim == 32
    with pytest.raises(
        ValueError, match=r"is a Hugging Face checkpoint, not a file vitrim wrote: use vitrim\.load_model"
    ):
        vitrim.weights.checkpoint.build_saved_model(tmp_path)  # one route for Hugging Face folders: load_model's

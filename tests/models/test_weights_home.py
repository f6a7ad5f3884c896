"""vitrim.weights is the one home of loading: one public load_model, one weight-file list, one shard-index reader,
one conversion of a Hugging Face state dict per load, and the old import paths kept one release with a warning."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

import vitrim
import vitrim.weights.formats as formats
from vitrim.weights import hub

OLD_PATHS = {  # module users may hold -> a name they may import from it, and where it lives now
    "vitrim.checkpoint": ("load_checkpoint", "vitrim.weights.checkpoint"),
    "vitrim.checkpoint_formats": ("read_checkpoint", "vitrim.weights.formats"),
    "vitrim.checkpoint_hf": ("convert_hf", "vitrim.weights.hf_names"),
    "vitrim.hub": ("fetch", "vitrim.weights.hub"),
    "vitrim.pretrained": ("load_model", "vitrim.weights.pretrained"),
    "vitrim.in_memory": ("from_timm", "vitrim.weights.in_memory"),
    "vitrim.models.pretrained_tags": ("pretrained_repo", "vitrim.weights.tags"),
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_import_paths_hand_on_with_a_deprecation_warning(old: str) -> None:
    name, home = OLD_PATHS[old]
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated .* use {home}\.{name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(home), name)


def test_the_old_checkpoint_load_model_is_the_loader_that_reads_what_it_read() -> None:
    """It read vitrim files and Hugging Face folders; build_saved_model reads vitrim files only now (one route for
    Hugging Face folders: vitrim.load_model's), so the old name hands on vitrim.load_model."""
    import vitrim.checkpoint

    with pytest.warns(DeprecationWarning, match=r"use vitrim\.weights\.pretrained\.load_model"):
        assert vitrim.checkpoint.load_model is vitrim.load_model
    with pytest.warns(DeprecationWarning):
        assert importlib.import_module("vitrim.checkpoint_formats").HF_WEIGHT_FILES is formats.WEIGHT_FILES


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

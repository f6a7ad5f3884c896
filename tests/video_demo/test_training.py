"""Stage 2 of the video recipe (``train.train_model``, the digits LLaVA's loop shared): the tower stays frozen, the
decoder learns, and the model comes back in eval mode with its tower trainable again."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from vitrim.demos.video.demo import QUICK
from vitrim.demos.video.model import build_model, video_model_config
from vitrim.demos.video.train import train_model


def test_stage_two_trains_the_decoder_and_leaves_the_tower_as_it_was() -> None:
    model = build_model(video_model_config(QUICK.vision, QUICK.text), seed=3)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    result = train_model(model, dataclasses.replace(QUICK.train, steps=2), seed=3)
    after = model.state_dict()
    tower = [name for name in before if name.startswith("model.visual.")]
    decoder = [name for name in before if name.startswith("model.language_model.")]
    assert tower and decoder
    assert all(torch.equal(before[name], after[name]) for name in tower)
    assert sum(not torch.equal(before[name], after[name]) for name in decoder) > len(decoder) // 2
    assert not model.training and all(p.requires_grad for p in model.model.visual.parameters())
    assert result["seconds"] > 0 and torch.isfinite(torch.tensor(result["loss"]))

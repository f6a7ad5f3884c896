"""Stage 2's token labels (``train.TokenLabels``): a linear head on the projector's output names each image token's
quadrant and the digit covering it, so that stage 2 cannot wash out of the tokens the decoder reads what stage 1 put
into them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from vitrim.demos.vlm.data import DigitsScenes
from vitrim.demos.vlm.demo import QUICK
from vitrim.demos.vlm.model import build_model, digits_vlm_config
from vitrim.demos.vlm.train import TokenLabels, conversation_batch, train_model


def _tiny() -> torch.nn.Module:
    return build_model(digits_vlm_config(QUICK.vision, QUICK.text), seed=0)


def test_the_losses_are_the_heads_cross_entropies_against_each_tokens_quadrant_and_digit() -> None:
    model = _tiny()
    labels = TokenLabels(model, seed=0)
    with torch.no_grad():  # a head far from its small initial weights, so that every label moves the losses
        labels.head.weight.normal_(0.0, 30.0, generator=torch.Generator().manual_seed(1))
        labels.head.bias.copy_(torch.linspace(-1.0, 1.0, 15))
    scenes = DigitsScenes("train", 4, seed=0)
    batch = conversation_batch(scenes, [0, 1, 2, 3], order_seed=0)
    digits = np.stack([scenes.canvas(i).patch_digits for i in range(4)])  # (4, 64)
    model(**batch)
    where, what = labels.losses(torch.from_numpy(digits))
    # by hand: the tower's layer -2 patch tokens through the projector's two layers, the head, log-softmax
    with torch.no_grad():
        hidden = model.model.vision_tower(batch["pixel_values"], output_hidden_states=True).hidden_states[-2][:, 1:]
        projector = model.model.multi_modal_projector
        tokens = projector.linear_2(torch.nn.functional.gelu(projector.linear_1(hidden)))  # (4, 64, D)
        logits = tokens @ labels.head.weight.T + labels.head.bias  # (4, 64, 15): 4 quadrants, then 10 digits + none
        quadrant_log_p = logits[..., :4].log_softmax(-1)
        digit_log_p = logits[..., 4:].log_softmax(-1)
    expected_where, expected_what = [], []
    for b in range(4):
        for row in range(8):
            for col in range(8):  # top left, top right, bottom left, bottom right
                token = row * 8 + col
                expected_where.append(-quadrant_log_p[b, token, 2 * (row >= 4) + (col >= 4)])
                expected_what.append(-digit_log_p[b, token, digits[b, token]])
    assert float(where.detach()) == pytest.approx(float(torch.stack(expected_where).mean()), abs=1e-6)
    assert float(what.detach()) == pytest.approx(float(torch.stack(expected_what).mean()), abs=1e-6)
    labels.remove()
    model(**batch)
    assert not labels.features  # unhooked: a forward no longer keeps the projector's output


def test_stage_2_trains_the_projector_on_each_and_leaves_no_hook() -> None:
    plan = dataclasses.replace(QUICK.train, steps=2)
    projectors = []
    for quadrant, digit in [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)]:
        model = _tiny()
        train_model(model, dataclasses.replace(plan, quadrant_weight=quadrant, digit_weight=digit), seed=0)
        projector = model.model.multi_modal_projector
        assert not projector._forward_hooks
        projectors.append(projector.linear_1.weight.detach().clone())
    assert not torch.equal(projectors[0], projectors[1])  # the quadrant loss moved the projector
    assert not torch.equal(projectors[0], projectors[2])  # and the digit loss


def test_the_head_is_seeded_and_leaves_the_models_weights_as_built() -> None:
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = TokenLabels(model, seed=3), TokenLabels(model, seed=3)
    assert torch.equal(first.head.weight, second.head.weight)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    first.remove()
    second.remove()

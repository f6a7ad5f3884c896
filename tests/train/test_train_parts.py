"""Parts of training checked against hand computations: metrics, schedule, parameter groups, the batch sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import vitrim
from vitrim.train.distributed import GlobalBatchSampler
from vitrim.train.evaluate import evaluate
from vitrim.train.optim import WarmupCosine, build_optimizer, param_groups


def test_evaluate_matches_a_hand_computation() -> None:
    # the "images" are the logits themselves and the model is the identity, so every number is known by hand
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(23, 7, generator=g)
    labels = torch.randint(0, 7, (23,), generator=g)
    labels[:3] = torch.tensor([6, 6, 6])
    metrics = evaluate(nn.Identity(), TensorDataset(logits, labels), num_classes=7, batch_size=5)

    x, y = logits.numpy().astype(np.float64), labels.numpy()
    log_softmax = x - x.max(1, keepdims=True) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
    order = np.argsort(-x, axis=1)
    assert metrics["num_samples"] == 23
    assert metrics["loss"] == pytest.approx(-log_softmax[np.arange(23), y].mean(), rel=1e-6)
    assert metrics["top1"] == pytest.approx((order[:, 0] == y).mean())
    assert metrics["top5"] == pytest.approx(np.mean([y[i] in order[i, :5] for i in range(23)]))
    for c in range(7):
        members = y == c
        expected = (order[members, 0] == c).mean() if members.any() else None
        assert metrics["per_class"][c] == (pytest.approx(expected) if expected is not None else None)


def test_warmup_cosine_by_hand() -> None:
    f = WarmupCosine(warmup_steps=4, total_steps=14, min_factor=0.1)
    assert [f(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_scheduler_drives_the_optimiser_lr() -> None:
    model = nn.Linear(3, 2)
    opt, sched = build_optimizer(model, lr=0.1, weight_decay=0.0, warmup_steps=2, total_steps=4, min_lr_factor=0.0)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05])


def test_param_groups_skip_decay_on_biases_norms_and_tokens_and_scale_lr() -> None:
    model = vitrim.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    groups = param_groups(
        model, lr=1.0, weight_decay=0.05, lr_multiplier=lambda n: 0.01 if n.startswith("blocks.") else 1.0
    )
    names = {id(p): n for n, p in model.named_parameters()}
    by_name = {names[id(p)]: g for g in groups for p in g["params"]}
    assert len(by_name) == len(names)  # every parameter in exactly one group
    assert by_name["blocks.0.attn.qkv.weight"]["weight_decay"] == 0.05
    assert by_name["blocks.0.attn.qkv.weight"]["lr"] == pytest.approx(0.01)
    for no_decay in ("blocks.0.attn.qkv.bias", "blocks.0.norm1.weight", "pos_embed", "cls_token", "head.bias"):
        assert by_name[no_decay]["weight_decay"] == 0.0, no_decay
    assert by_name["head.weight"]["lr"] == 1.0 and by_name["head.weight"]["weight_decay"] == 0.05


def test_sampler_ranks_together_see_the_single_process_batches() -> None:
    n, global_batch, world = 50, 12, 3
    single = list(GlobalBatchSampler(n, global_batch, seed=4))
    assert len(single) == 48 and len(set(single)) == 48  # 4 full batches; the last 2 samples dropped
    shards = [list(GlobalBatchSampler(n, global_batch, rank=r, world_size=world, seed=4)) for r in range(world)]
    b = global_batch // world
    for step in range(4):
        joined = [i for r in range(world) for i in shards[r][step * b : (step + 1) * b]]
        assert joined == single[step * global_batch : (step + 1) * global_batch]
    sampler = GlobalBatchSampler(n, global_batch, seed=4)
    sampler.set_epoch(1)
    assert list(sampler) != single  # a new order every epoch


def test_sampler_for_evaluation_covers_every_sample_once() -> None:
    shards = [list(GlobalBatchSampler(50, 12, rank=r, world_size=4, shuffle=False, drop_last=False)) for r in range(4)]
    assert sorted(i for s in shards for i in s) == list(range(50))
    assert [len(s) for s in shards] == [len(GlobalBatchSampler(50, 12, rank=r, world_size=4, drop_last=False))
                                        for r in range(4)]  # fmt: skip


@pytest.mark.parametrize(
    "args, match",
    [((10, 0), "batch size must be a positive int, got 0"), ((10, 6, 0, 4), "not divisible by the world size 4")],
)
def test_sampler_rejects_bad_batches(args: tuple, match: str) -> None:
    n, batch, *rest = args
    kwargs = dict(rank=rest[0], world_size=rest[1]) if rest else {}
    with pytest.raises(ValueError, match=match):
        GlobalBatchSampler(n, batch, **kwargs)

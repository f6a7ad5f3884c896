"""The random baseline: top-k's counts, a reproducible subset that the seed and the block change, no [CLS] needed."""

from __future__ import annotations

import pytest
import torch
from reduce_models import images, tiny

import vitrim
from vitrim.reduce.random_keep import random_scores


def kept(seed: int = 0, **options: object) -> list[torch.Tensor]:
    model = vitrim.reduce.apply(tiny(), "random", seed=seed, **{"keep_rate": 0.5, **options})
    with torch.no_grad():
        return model.forward_detailed(images(batch=2)).kept_indices


def test_counts_and_blocks_are_top_ks() -> None:
    x = images(batch=2)
    with torch.no_grad():
        ours = vitrim.reduce.apply(tiny(), "random", keep_rate=0.6).forward_detailed(x, need_weights=True)
        topk = vitrim.reduce.apply(tiny(), "topk", keep_rate=0.6).forward_detailed(x, need_weights=True)
    assert [a.shape[-1] for a in ours.attentions] == [a.shape[-1] for a in topk.attentions]
    assert [k.shape for k in ours.kept_indices] == [k.shape for k in topk.kept_indices]


def test_reproducible_and_changed_by_the_seed_and_the_block() -> None:
    first, again, other = kept(0), kept(0), kept(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    # the same subset for every image of the batch (a batch of one computes what the batch does)
    assert all(torch.equal(k[0], k[1]) for k in first)
    # two blocks at the same count draw different subsets
    one_stage = kept(0, layers=(0, 1), keep_count=(15, 14))
    assert set(one_stage[0][0, :14].tolist()) != set(one_stage[1][0].tolist())


def test_every_token_is_kept_about_as_often() -> None:
    # 400 seeds, keep 8 of 16: each token should be kept about half the time (binomial sd 0.025)
    counts = torch.zeros(16)
    for seed in range(400):
        scores = random_scores(17, salt=seed * 1_000_003 + 17)[1:]
        counts[scores.topk(8).indices] += 1
    assert (counts / 400 - 0.5).abs().max() < 0.1


def test_no_class_token_needed_and_bad_seeds_refused() -> None:
    model = vitrim.create_model(
        "vit_medium_patch16_gap_256", embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8
    )
    vitrim.reduce.apply(model.eval(), "random", keep_rate=0.5, layers=(1,))
    with torch.no_grad():
        assert model.forward_detailed(images()).tokens.shape[1] == 8
    with pytest.raises(ValueError, match="seed must be an int"):
        vitrim.reduce.apply(tiny(), "random", seed=-1)

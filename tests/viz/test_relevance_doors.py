"""Relevance enters the model through declared doors: the head hands out its pool's attention, and a reducer's
declared ``constant_ranking_scores`` is honoured by the reducer itself, with no method of it replaced."""

from __future__ import annotations

import torch

import vitrim
from vitrim.viz.attnlrp import attnlrp_relevance, lrp_rules


def _tiny(**overrides: object) -> vitrim.VisionTransformer:
    config: dict = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=4, num_classes=5)
    config.update(overrides)
    torch.manual_seed(0)
    model = vitrim.create_model("deit_tiny_patch16_224", **config).eval().double()
    assert isinstance(model, vitrim.VisionTransformer)
    return model


def test_the_head_hands_out_the_attention_its_pool_ran() -> None:
    model = _tiny(class_token=False, global_pool="map")
    tokens = torch.randn(2, 16, 32, dtype=torch.float64)
    weights = torch.rand(2, 16, dtype=torch.float64)
    logits, attention = model.forward_head_with_weights(tokens, weights)
    # the same head (the explicit attention that returns weights, vs the fused one: float64 rounding apart)
    assert torch.allclose(logits, model.forward_head(tokens, patch_weights=weights), rtol=0, atol=1e-12)
    assert attention is not None and attention.shape == (2, 4, 1, 16)
    # by hand: the learned query's softmax over the weighted keys, head by head
    pool = model.attn_pool
    assert pool is not None
    q = (pool.latent.expand(2, 1, 32) @ pool.q.weight.T + pool.q.bias).view(2, 1, 4, 8).transpose(1, 2)
    k = (tokens @ pool.kv.weight.T + pool.kv.bias)[..., :32].view(2, 16, 4, 8).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / 8**0.5  # (B, H, 1, N)
    policy = weights / weights.amax(dim=1, keepdim=True)
    expected = scores.exp() * policy[:, None, None] / (scores.exp() * policy[:, None, None]).sum(-1, keepdim=True)
    assert torch.allclose(attention, expected, atol=1e-10)
    cls_model = _tiny()
    logits, attention = cls_model.forward_head_with_weights(torch.randn(2, 17, 32, dtype=torch.float64))
    assert attention is None and logits.shape == (2, 5)


def test_lrp_rules_set_the_declared_flag_and_replace_no_reducer_method() -> None:
    model = _tiny()
    vitrim.reduce.apply(model, "evit", keep_rate=0.5, layers=(0,))
    reducer = model.blocks[0].reducer
    assert type(reducer).constant_ranking_scores and not reducer.attributing
    with lrp_rules(model):
        assert reducer.attributing
        assert "reduce" not in vars(reducer) and "after_attention" not in vars(reducer)
    assert not reducer.attributing and "attributing" not in vars(reducer)


def test_evit_scores_are_constants_only_while_attributing() -> None:
    """The fused token Σ a_i x_i: under AttnLRP its weights a are constants, so the relevance of the input tokens
    changes when they are not (the scores' gradient would flow back into the attention)."""
    model = _tiny()
    vitrim.reduce.apply(model, "evit", keep_rate=0.5, layers=(0,))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    declared, _, _ = attnlrp_relevance(model, x, 1)
    type(model.blocks[0].reducer).constant_ranking_scores = False
    try:
        undeclared, _, _ = attnlrp_relevance(model, x, 1)
    finally:
        del type(model.blocks[0].reducer).constant_ranking_scores  # the class default (ClsRankingReducer's) again
    assert type(model.blocks[0].reducer).constant_ranking_scores
    assert not torch.allclose(declared, undeclared)

"""DynamicViT model: kept counts, [CLS], both modes, ρ = 1, gradients, configuration errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import vitrim
from vitrim.losses import DynamicViTLoss
from vitrim.models.dynamic_vit import DynamicVisionTransformer, DynamicViTConfig, default_prune_layers
from vitrim.models.vit import VisionTransformer

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=10)


def make_model(seed: int = 0, **changes: object) -> DynamicVisionTransformer:
    torch.manual_seed(seed)
    model = DynamicVisionTransformer(DynamicViTConfig(**{**TINY, **changes}))  # type: ignore[arg-type]
    with torch.no_grad():  # larger than the init so that scores spread and dropped tokens matter
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def images(batch: int, h: int = 32, w: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("img", "ratio", "expected"),
    [
        ((32, 32), 0.7, [11, 7, 5]),  # P = 16: int(16·0.7) = 11, int(16·0.49) = 7, int(16·0.343) = 5
        ((48, 48), 0.7, [25, 17, 12]),  # P = 36 (not the config's 16): 25.2, 17.64, 12.348
        ((32, 48), 0.7, [16, 11, 8]),  # P = 24: 16.8, 11.76, 8.232
        ((48, 32), 0.5, [12, 6, 3]),  # P = 24: 12, 6, 3
        ((32, 32), 0.1, [1, 1, 1]),  # never fewer than one token
    ],
)
def test_kept_counts_follow_the_image_grid(img: tuple[int, int], ratio: float, expected: list[int]) -> None:
    model = make_model(keep_ratio=ratio).eval()
    assert model.num_keep(img) == expected
    x = images(2, *img)
    with torch.no_grad():
        out = model.forward_detailed(x)
    assert [t.shape for t in out.kept_indices] == [(2, k) for k in expected]
    assert out.tokens.shape == (2, 1 + expected[-1], 32)  # [CLS] + the last stage's tokens
    P = (img[0] // 8) * (img[1] // 8)
    for stage, idx in enumerate(out.kept_indices):
        assert idx.dtype == torch.long and int(idx.min()) >= 0 and int(idx.max()) < P
        assert all(len(set(row.tolist())) == idx.shape[1] for row in idx)  # no position twice
        if stage:  # each stage keeps a subset of the previous one
            for row, prev in zip(idx, out.kept_indices[stage - 1]):
                assert set(row.tolist()) <= set(prev.tolist())
    model.train()
    train_out = model.forward_detailed(x)
    assert [m.shape for m in train_out.keep_masks] == [(2, P)] * 3
    assert train_out.tokens.shape == (2, 1 + P, 32)  # masked, not removed


def test_deit_sizes_keep_137_96_67() -> None:
    # the paper's counts for 224/16 at ρ = 0.7, from the config alone (no 22M-parameter model needed)
    assert DynamicViTConfig(embed_dim=384, num_heads=6).num_keep() == [137, 96, 67]
    assert DynamicViTConfig().pruning_layers == (3, 6, 9)
    assert DynamicViTConfig(keep_ratio=0.5).num_keep(448) == [392, 196, 98]


def test_cls_is_never_scored_and_always_first() -> None:
    """The [CLS] output is what the head reads: replacing every patch score cannot move it out of place 0."""
    model = make_model().eval()
    x = images(3)
    with torch.no_grad():
        out = model.forward_detailed(x)
        assert torch.allclose(model.head(out.tokens[:, 0]), out.logits, atol=1e-6)
    assert out.tokens.shape == (3, 1 + 5, 32)


def test_eval_is_per_image_and_batch_size_one_works() -> None:
    model = make_model().eval()
    x = images(3)
    with torch.no_grad():
        batched = model.forward_detailed(x)
        for b in range(3):
            single = model.forward_detailed(x[b : b + 1])
            torch.testing.assert_close(single.logits, batched.logits[b : b + 1], atol=1e-5, rtol=1e-5)
            for s, t in zip(single.kept_indices, batched.kept_indices):
                assert s[0].tolist() == t[b].tolist()
    model.train()
    assert model(x[:1]).shape == (1, 10)


def test_kept_tokens_stand_in_descending_keep_score() -> None:
    model = make_model().eval()
    x = images(2)
    with torch.no_grad():
        state = model.embed(x)
        for block in model.blocks[:1]:
            state, _ = block(state)
        scores = model.score_predictor[0](state.tokens[:, 1:])[..., 0]  # (B, 16) before blocks[1]
        out = model.forward_detailed(x)
    first = out.kept_indices[0]  # the positions are the identity before the first stage
    kept_scores = scores.gather(1, first)
    assert bool((kept_scores[:, :-1] >= kept_scores[:, 1:]).all())
    dropped = torch.ones_like(scores, dtype=torch.bool).scatter(1, first, False)
    assert bool((scores[dropped].view(2, -1).amax(1) <= kept_scores.amin(1)).all())


def test_keep_ratio_one_is_exactly_the_dense_backbone() -> None:
    model = make_model(keep_ratio=1.0).eval()
    dense = VisionTransformer(vitrim.ViTConfig(**TINY)).eval()  # type: ignore[arg-type]
    backbone = {k: v for k, v in model.state_dict().items() if not k.startswith("score_predictor.")}
    dense.load_state_dict(backbone)
    x = images(2)
    with torch.no_grad():
        assert torch.equal(model(x), dense(x))
        kept = model.forward_detailed(x).kept_indices
    assert len(kept) == 3 and all(t.tolist() == [list(range(16))] * 2 for t in kept)  # every token, in grid order


def test_training_with_the_eval_decisions_gives_the_eval_logits() -> None:
    """The invariant that ties the modes: masking the tokens evaluation removes changes nothing kept tokens see."""
    model = make_model(seed=3)
    for pruner in model.pruners:
        pruner.gumbel_noise = False
    x = images(4, seed=5)
    model.eval()
    with torch.no_grad():
        ev = model.forward_detailed(x)
    model.train()
    tr = model.forward_detailed(x)
    torch.testing.assert_close(tr.logits, ev.logits, atol=1e-4, rtol=1e-4)
    for mask, kept in zip(tr.keep_masks, ev.kept_indices):
        assert mask.shape == (4, 16)
        assert [set(row.nonzero().flatten().tolist()) for row in mask] == [set(row.tolist()) for row in kept]
    # and the final tokens at the kept places agree (what token distillation compares)
    for b in range(4):
        got = tr.tokens[b, 1:][ev.kept_indices[-1][b]]
        torch.testing.assert_close(got, ev.tokens[b, 1:], atol=1e-4, rtol=1e-4)


def test_gumbel_training_decisions_are_hard_and_nested() -> None:
    model = make_model().train()
    torch.manual_seed(0)
    out = model.forward_detailed(images(4))
    prev = torch.ones(4, 16)
    for mask in out.keep_masks:
        assert set(mask.detach().unique().tolist()) <= {0.0, 1.0}
        assert bool((mask.detach() <= prev).all())  # a dropped token stays dropped
        prev = mask.detach()
    assert out.logits.shape == (4, 10) and out.kept_indices == []


def test_gradients_reach_every_predictor_parameter() -> None:
    model = make_model()
    model.train()
    torch.manual_seed(0)
    x, labels = images(4), torch.tensor([0, 1, 2, 3])
    out = model.forward_detailed(x)
    teacher = torch.randn(4, 10)
    parts = DynamicViTLoss(0.7)(out, labels, teacher, torch.randn_like(out.tokens))
    parts.total.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        if name.startswith("score_predictor."):
            assert float(p.grad.abs().sum()) > 0, name


def test_state_dict_names_are_the_official_ones() -> None:
    keys = set(make_model().state_dict())
    for s in range(3):
        for part in ("in_conv.0", "in_conv.1", "out_conv.0", "out_conv.2", "out_conv.4"):
            assert f"score_predictor.{s}.{part}.weight" in keys and f"score_predictor.{s}.{part}.bias" in keys
    assert "blocks.1.attn.qkv.weight" in keys and "blocks.1.reducer" not in " ".join(keys)
    assert DynamicVisionTransformer.checkpoint_optional_prefixes == ("score_predictor.",)
    assert not any(k.startswith("score_predictor.3") for k in keys)


def test_deepcopy_prunes_with_the_copied_predictors() -> None:
    model = make_model().eval()
    clone = copy.deepcopy(model)
    assert clone.pruners[0].predictor is clone.score_predictor[0]
    with torch.no_grad():
        clone.score_predictor[0].out_conv[4].bias.copy_(torch.tensor([0.0, 0.0]))
        clone.score_predictor[0].out_conv[4].weight.normal_(0, 5.0)
        x = images(2)
        assert model.forward_detailed(x).kept_indices[0].tolist() != clone.forward_detailed(x).kept_indices[0].tolist()


def test_create_model_names_and_overrides() -> None:
    assert {"dynamicvit_tiny_patch16_224", "dynamicvit_small_patch16_224", "dynamicvit_base_patch16_224"} <= set(
        vitrim.list_models("dynamicvit_*")
    )
    tiny = dict(num_classes=10, img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2)
    model = vitrim.create_model("dynamicvit_tiny_patch16_224", **tiny, keep_ratio=0.5, prune_layers=(0, 2))
    assert isinstance(model, DynamicVisionTransformer)
    assert model.config.keep_ratio == 0.5 and model.config.pruning_layers == (0, 2)
    assert [b.reducer is not None for b in model.blocks] == [True, False, True, False]
    assert model.num_keep() == [8, 4]
    assert model.eval()(images(1)).shape == (1, 10)


@pytest.mark.parametrize(
    ("depth", "expected"), [(12, (3, 6, 9)), (4, (1, 2, 3)), (24, (6, 12, 18)), (6, (1, 3, 4)), (2, (0, 1)), (1, (0,))]
)
def test_default_prune_layers(depth: int, expected: tuple[int, ...]) -> None:
    assert default_prune_layers(depth) == expected
    assert DynamicViTConfig(depth=depth).pruning_layers == expected


def test_distilled_backbone_keeps_both_prefix_tokens() -> None:
    model = make_model(distilled=True).eval()
    with torch.no_grad():
        out = model.forward_detailed(images(2))
    assert out.tokens.shape == (2, 2 + 5, 32) and out.logits.shape == (2, 10)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, math.nan, math.inf])
def test_bad_keep_ratio_is_a_clear_value_error(bad: float) -> None:
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\], got"):
        DynamicViTConfig(**TINY, keep_ratio=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [True, "0.7", None])
def test_keep_ratio_of_the_wrong_type_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="keep_ratio must be a number"):
        DynamicViTConfig(**TINY, keep_ratio=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ((4,), r"block indices in \[0, 3\] \(depth 4\), got \(4,\)"),
        ((-1, 2), r"block indices in \[0, 3\]"),
        ((2, 1), "strictly increasing"),
        ((1, 1), "strictly increasing"),
        ((), "at least one block"),
    ],
)
def test_bad_prune_layers_are_clear_value_errors(bad: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicViTConfig(**TINY, prune_layers=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        vitrim.create_model("dynamicvit_tiny_patch16_224", **{**TINY, "prune_layers": bad})


@pytest.mark.parametrize("bad", [(1.0, 2), ("1",), 3, (True,)])
def test_prune_layers_of_the_wrong_type_are_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match="prune_layers must be a sequence of block indices"):
        DynamicViTConfig(**TINY, prune_layers=bad)  # type: ignore[arg-type]


def test_config_round_trips_through_a_dict() -> None:
    config = DynamicViTConfig(**TINY, keep_ratio=0.6, prune_layers=[1, 3])  # type: ignore[arg-type]
    assert config.prune_layers == (1, 3)
    again = DynamicViTConfig.from_dict(config.to_dict())
    assert again == config and isinstance(again, DynamicViTConfig)
    with pytest.raises(TypeError, match="config must be a DynamicViTConfig"):
        DynamicVisionTransformer(vitrim.ViTConfig(**TINY))  # type: ignore[arg-type]

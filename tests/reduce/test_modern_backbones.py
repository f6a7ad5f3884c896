"""Every reducer on the families people run today: registers and [CLS] protected, RoPE phases kept, pools weighted."""

from __future__ import annotations

import pytest
import torch

import vitrim
from vitrim.reduce import TokenState

TINY = dict(embed_dim=32, depth=4, num_heads=2, num_classes=5)
# name -> (img_size, prefix tokens): 4x4 patch grids
BACKBONES = {
    "deit3_small_patch16_224": (64, 1),
    "vit_small_patch14_dinov2": (56, 1),
    "vit_small_patch14_reg4_dinov2": (56, 5),
    "vit_base_patch16_clip_224": (64, 1),
    "vit_base_patch16_siglip_224": (64, 0),
    "eva02_tiny_patch14_224": (56, 1),
    "vit_medium_patch16_gap_256": (64, 0),
}
IDENTITY = [(name, vitrim.reduce.get_reducer(name).identity_options) for name in vitrim.reduce.list_reducers()]


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = vitrim.create_model(name, img_size=BACKBONES[name][0], **TINY).eval()
    with torch.no_grad():  # perturb: layer scale, registers and biases must not be trivial
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def images(name: str, batch: int = 2) -> torch.Tensor:
    side = BACKBONES[name][0]
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


def usable(reducer: str, name: str) -> bool:
    return not (vitrim.reduce.get_reducer(reducer).needs_cls_token and not build(name).config.class_token)


@pytest.mark.parametrize("name", sorted(BACKBONES))
@pytest.mark.parametrize(("reducer", "options"), IDENTITY)
def test_identity_settings_are_the_dense_model(name: str, reducer: str, options: dict[str, object]) -> None:
    if not usable(reducer, name):
        pytest.skip("ranks by [CLS]: refused on this backbone (tested below)")
    model, x = build(name), images(name)
    with torch.no_grad():
        dense = model(x)
        vitrim.reduce.apply(model, reducer, **options)
        torch.testing.assert_close(model(x), dense, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(BACKBONES))
@pytest.mark.parametrize("reducer", ["tome", "mctf", "evit", "topk", "dynamicvit"])
def test_prefix_tokens_are_never_reduced_and_counts_follow(name: str, reducer: str) -> None:
    if not usable(reducer, name):
        with pytest.raises(ValueError, match=r"no \[CLS\] token"):
            vitrim.reduce.apply(build(name), reducer)
        return
    model, x = build(name), images(name)
    prefix = BACKBONES[name][1]
    options = {"tome": {"r": 3}, "mctf": {"r": 2}, "evit": {"keep_rate": 0.5}, "topk": {"keep_rate": 0.5}}
    options = options.get(reducer, {})
    vitrim.reduce.apply(model, reducer, **{**options, **({"keep_ratio": 0.5} if reducer == "dynamicvit" else {})})
    with torch.no_grad():
        dense_prefix = model.embed(x).tokens[:, :prefix]
        out = model.forward_detailed(x)
    # 16 patches; ToMe: -3 per block; MCTF: -2 in blocks 1-3; EViT/top-k at block 1, 2, 3: 8 kept (+1 fused), ...;
    # DynamicViT: 8, 4, 2
    expected = {"tome": 16 - 3 * 4, "mctf": 16 - 2 * 3, "evit": 4, "topk": 2, "dynamicvit": 2}[reducer]  # EViT: ⌈n/2⌉+1
    assert out.tokens.shape[1] == prefix + expected
    assert out.block_positions[0].shape[1] == 16
    if reducer in ("tome", "mctf"):
        assert out.token_sizes is not None and torch.equal(out.token_sizes[:, :prefix], torch.ones(2, prefix))
        torch.testing.assert_close(out.token_sizes.sum(1), torch.full((2,), 16.0 + prefix))
    assert dense_prefix.shape[1] == prefix  # what was protected is exactly the prefix the model has


def test_rope_phase_follows_the_absolute_position_after_pruning() -> None:
    """EVA-02 with top-k at block 1 equals the dense blocks run on the kept tokens with their original positions."""
    name = "eva02_tiny_patch14_224"
    model, x = build(name), images(name)
    reduced = vitrim.reduce.apply(build(name), "topk", keep_rate=0.5, layers=(1,))
    with torch.no_grad():
        out = reduced.forward_detailed(x)
        kept = out.kept_indices[0]  # (B, 8) absolute positions
        state = model.embed(x)
        for block in model.blocks[:2]:
            state, _ = block(state)
        rows = torch.cat([torch.zeros(2, 1, dtype=torch.long), kept + 1], dim=1)  # [CLS] + the kept patches
        tokens = state.tokens.gather(1, rows[..., None].expand(-1, -1, state.tokens.shape[-1]))
        # block 1's MLP ran on all tokens in the dense model, on the kept ones in the reduced: both are per-token
        by_hand = TokenState(tokens, 1, kept, grid_patches=16, rope=state.rope)
        for block in model.blocks[2:]:
            by_hand, _ = block(by_hand)
        expected = model.forward_head(model.norm(by_hand.tokens))
        torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-6)
        shuffled = TokenState(tokens, 1, torch.arange(8).expand(2, 8), grid_patches=16, rope=state.rope)
        for block in model.blocks[2:]:
            shuffled, _ = block(shuffled)
        assert not torch.allclose(model.forward_head(model.norm(shuffled.tokens)), expected, atol=1e-4)  # phases matter


@pytest.mark.parametrize("name", ["vit_base_patch16_siglip_224", "vit_medium_patch16_gap_256"])
def test_pools_weight_a_merged_token_by_its_size(name: str) -> None:
    """A token that stands for k patches counts like k copies of itself in the mean and in the attention pool."""
    model = build(name)
    tokens = torch.randn(2, 3, 32)
    sizes = torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 1.0]])
    copies = [torch.cat([t[i].expand(int(s[i]), -1) for i in range(3)]) for t, s in zip(tokens, sizes)]
    with torch.no_grad():
        weighted = model.forward_head(tokens, pre_logits=True, patch_weights=sizes)
        for b in range(2):
            torch.testing.assert_close(weighted[b], model.forward_head(copies[b][None], pre_logits=True)[0])

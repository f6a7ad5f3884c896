"""Parity with an independent re-implementation of the official DynamicViT, and its checkpoint format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dynamicvit_reference import official_forward, softmax_with_policy

import vitrim
from vitrim.models.dynamic_vit import DynamicVisionTransformer

ARCH = dict(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=10)
PRUNING_LOC = (1, 2, 3)


def official_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny DynamicViT state dict with the official key names, made here without vitrim."""
    g = torch.Generator().manual_seed(seed)
    C, P, hidden = 32, 16, 128

    def t(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def ln(name: str, sd: dict[str, torch.Tensor]) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = 1 + t(C, std=0.1), t(C, std=0.1)

    sd = {
        "cls_token": t(1, 1, C),
        "pos_embed": t(1, P + 1, C),
        "patch_embed.proj.weight": t(C, 3, 8, 8, std=0.05),
        "patch_embed.proj.bias": t(C),
        "head.weight": t(10, C),
        "head.bias": t(10),
    }
    ln("norm", sd)
    for i in range(4):
        b = f"blocks.{i}"
        ln(f"{b}.norm1", sd)
        ln(f"{b}.norm2", sd)
        for name, (out_dim, in_dim) in {
            "attn.qkv": (3 * C, C),
            "attn.proj": (C, C),
            "mlp.fc1": (hidden, C),
            "mlp.fc2": (C, hidden),
        }.items():
            sd[f"{b}.{name}.weight"], sd[f"{b}.{name}.bias"] = t(out_dim, in_dim), t(out_dim, std=0.05)
    for s in range(3):
        p = f"score_predictor.{s}"
        ln(f"{p}.in_conv.0", sd)
        for name, (out_dim, in_dim) in {
            "in_conv.1": (C, C),
            "out_conv.0": (C // 2, C),
            "out_conv.2": (C // 4, C // 2),
            "out_conv.4": (2, C // 4),
        }.items():
            sd[f"{p}.{name}.weight"], sd[f"{p}.{name}.bias"] = t(out_dim, in_dim, std=0.2), t(out_dim, std=0.1)
    return sd


def assert_matches_official(model: torch.nn.Module, sd: dict[str, torch.Tensor], x: torch.Tensor) -> None:
    """The model's logits and kept patches in inference equal the official forward's on the same weights."""
    with torch.no_grad():
        ours = model.forward_detailed(x)
        ref = reference(sd, x, training=False)
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert [t.tolist() for t in ours.kept_indices] == [t.tolist() for t in ref.kept_positions]


def reference(sd: dict[str, torch.Tensor], x: torch.Tensor, *, training: bool, ratio: float = 0.7):  # type: ignore[no-untyped-def]
    return official_forward(
        sd,
        x,
        depth=4,
        heads=2,
        patch=8,
        pruning_loc=PRUNING_LOC,
        token_ratio=[ratio, ratio**2, ratio**3],
        training=training,
    )


def images(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def vitrim_model(sd: dict[str, torch.Tensor], **changes: object) -> DynamicVisionTransformer:
    model = vitrim.create_model("dynamicvit_tiny_patch16_224", **{**ARCH, **changes})
    model.load_state_dict(sd)
    assert isinstance(model, DynamicVisionTransformer)
    return model


@pytest.mark.parametrize("ratio", [0.7, 0.5])
def test_eval_logits_and_kept_tokens_match_the_official_forward(ratio: float) -> None:
    sd = official_state_dict()
    model = vitrim_model(sd, keep_ratio=ratio).eval()
    x = images(4)
    with torch.no_grad():
        ours = model.forward_detailed(x)
        ref = reference(sd, x, training=False, ratio=ratio)
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert len(ours.kept_indices) == len(ref.kept_positions) == 3
    for got, want in zip(ours.kept_indices, ref.kept_positions):
        assert got.tolist() == want.tolist()  # the same tokens, in the same (descending keep score) order
    torch.testing.assert_close(ours.tokens[:, 1:], ref.features, atol=1e-5, rtol=1e-5)
    assert len({tuple(row.tolist()) for row in ours.kept_indices[-1]}) > 1  # images really kept different tokens


def test_training_forward_matches_the_official_one_with_the_same_gumbel_noise() -> None:
    """Same seed -> the same Gumbel draws in both, so decisions must agree exactly and logits up to eps = 1e-6."""
    sd = official_state_dict(seed=2)
    model = vitrim_model(sd).train()
    x = images(4, seed=3)
    torch.manual_seed(123)
    ours = model.forward_detailed(x)
    torch.manual_seed(123)
    ref = reference(sd, x, training=True)
    assert len(ours.keep_masks) == len(ref.decisions) == 3
    for got, want in zip(ours.keep_masks, ref.decisions):
        assert torch.equal(got.detach(), want.detach())
    assert any(float(m.detach().sum()) < m.numel() for m in ours.keep_masks)  # something was dropped
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.tokens[:, 1:], ref.features, atol=1e-5, rtol=1e-5)


def test_keep_policy_attention_matches_official_softmax_with_policy() -> None:
    g = torch.Generator().manual_seed(0)
    B, H, N, E = 3, 2, 9, 8
    q, k, v = (torch.randn(B, H, N, E, generator=g) for _ in range(3))
    policy = (torch.rand(B, N, generator=g) > 0.4).float()
    policy[:, 0] = 1.0  # [CLS]
    policy.requires_grad_(True)
    ours, weights = vitrim.scaled_dot_product_attention(q, k, v, keep_policy=policy, need_weights=True)
    ref_weights = softmax_with_policy((q @ k.transpose(-2, -1)) * E**-0.5, policy.unsqueeze(-1))
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, ref_weights @ v, atol=1e-5, rtol=0)
    # the straight-through gradient reaching the policy (what trains the predictors) agrees too
    probe = torch.randn(B, H, N, E, generator=g)
    (grad_ours,) = torch.autograd.grad((ours * probe).sum(), policy)
    (grad_ref,) = torch.autograd.grad(((ref_weights @ v) * probe).sum(), policy)
    torch.testing.assert_close(grad_ours, grad_ref, atol=1e-4, rtol=1e-4)


def test_official_checkpoint_file_loads_through_load_checkpoint(tmp_path: Path) -> None:
    sd = official_state_dict(seed=4)
    path = tmp_path / "dynamicvit_official.pth"
    torch.save({"model": sd}, path)  # the official release format
    model = vitrim.create_model("dynamicvit_tiny_patch16_224", checkpoint=path, **ARCH).eval()
    x = images(3, seed=6)
    assert_matches_official(model, sd, x)

    fresh = vitrim.create_model("dynamicvit_tiny_patch16_224", **ARCH)
    vitrim.load_checkpoint(fresh, path)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in sd.items())


def test_dense_checkpoint_loads_with_fresh_predictors(tmp_path: Path) -> None:
    """Fine-tuning starts from a dense DeiT: backbone loaded, predictors left as initialised."""
    sd = official_state_dict(seed=5)
    dense_sd = {k: v for k, v in sd.items() if not k.startswith("score_predictor.")}
    path = tmp_path / "deit_dense.pth"
    torch.save({"model": dense_sd}, path)
    torch.manual_seed(0)
    model = vitrim.create_model("dynamicvit_tiny_patch16_224", **ARCH)
    before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("score_predictor.")}
    vitrim.load_checkpoint(model, path)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in dense_sd.items())
    assert before and all(torch.equal(after[k], v) for k, v in before.items())
    # with ρ = 1 the loaded model is the dense DeiT of the reference (no stage removes anything)
    dense = vitrim.create_model("dynamicvit_tiny_patch16_224", checkpoint=path, keep_ratio=1.0, **ARCH).eval()
    x = images(2)
    with torch.no_grad():
        torch.testing.assert_close(dense(x), reference(sd, x, training=False, ratio=1.0).logits, atol=1e-5, rtol=1e-5)


def test_save_and_load_model_rebuild_the_dynamic_config(tmp_path: Path) -> None:
    model = vitrim.create_model("dynamicvit_tiny_patch16_224", keep_ratio=0.6, prune_layers=(0, 2), **ARCH).eval()
    path = vitrim.save_checkpoint(model, tmp_path / "dyn.safetensors")
    loaded = vitrim.load_model(path)
    assert isinstance(loaded, DynamicVisionTransformer)
    assert loaded.config == model.config and loaded.config.pruning_layers == (0, 2)
    x = images(2)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
        assert [t.tolist() for t in loaded.forward_detailed(x).kept_indices] == [
            t.tolist() for t in model.forward_detailed(x).kept_indices
        ]

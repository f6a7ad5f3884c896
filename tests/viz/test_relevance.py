"""Class-specific relevance (vitrim.viz.relevance): Chefer's generic relevance and AttnLRP, dense and through reducers,
against references written from the authors' code (tests/viz/relevance_reference.py) and lxt 2.1 itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from relevance_reference import attnlrp_reference, chefer_reference, forward_rows_reference

import vitrim
from vitrim.viz.attnlrp import attnlrp_relevance, lrp_rules
from vitrim.viz.chefer import chefer_relevance
from vitrim.viz.relevance_trace import leaf_tokens

DATA = Path(__file__).parents[1] / "data" / "timm_modern"
FAMILIES = json.loads((DATA / "manifest.json").read_text())["cases"]


def sharpened(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights drawn wide enough that attention is far from uniform and every sign occurs (timm's init is tiny)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" not in name else 0.2
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return model.eval()


def tiny(**overrides: object) -> torch.nn.Module:
    config = dict(img_size=32, patch_size=8, depth=3, embed_dim=32, num_heads=4, num_classes=5)
    config.update(overrides)
    return sharpened(vitrim.create_model("deit_tiny_patch16_224", **config)).double()


def images(batch: int = 3, size: int = 32, channels: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_chefer_on_a_dense_vit_is_the_authors_formulation_in_float64() -> None:
    model, x = tiny(), images()
    target = torch.tensor([0, 3, 4])
    ours, _, index = chefer_relevance(model, x, target)
    reference = chefer_reference(model, x, target)
    assert torch.equal(index, target)
    assert ours.dtype == torch.float64
    assert torch.allclose(ours, reference, rtol=0, atol=1e-10), (ours - reference).abs().max()
    grid = vitrim.viz.relevance(model, x, target)  # the public call: the patch part, on the grid
    assert torch.allclose(grid.double(), reference[:, 1:].reshape(3, 4, 4).float().double(), atol=1e-6)


def test_chefer_default_target_is_the_predicted_class_and_targets_change_the_map() -> None:
    model, x = tiny(), images()
    logits = model(x)
    default = vitrim.viz.relevance_map(model, x)
    assert torch.equal(default.target, logits.argmax(-1))
    other = vitrim.viz.relevance(model, x, target=(default.target + 1) % 5)
    assert not torch.allclose(other, default.grid)


@pytest.mark.parametrize(
    ("reducer", "options"),
    [
        ("tome", {"r": 3}),
        ("topk", {"keep_rate": 0.5, "layers": (0, 1)}),
        ("evit", {"keep_rate": 0.5, "layers": (0, 1)}),
        ("dynamicvit", {"keep_ratio": 0.6, "prune_layers": (1, 2)}),
    ],
)
def test_chefer_through_a_reducer_equals_the_forward_recursion_with_shared_merged_rows(
    reducer: str, options: dict
) -> None:
    model = tiny()
    vitrim.reduce.apply(model, reducer, **options)
    sharpened(model, seed=5).double()  # the predictors DynamicViT added get non-trivial weights too
    x = images()
    out = model.forward_detailed(x)
    assert out.patch_to_token, "the reducer removed no token in this configuration"
    target = torch.tensor([1, 2, 0])
    ours, _, _ = chefer_relevance(model, x, target)
    reference = forward_rows_reference(model, x, target)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-10), (ours - reference).abs().max()


def test_chefer_at_identity_reducer_options_is_the_dense_relevance() -> None:
    model, x = tiny(), images()
    dense, _, _ = chefer_relevance(model, x, 2)
    vitrim.reduce.apply(model, "tome", r=0)
    assert torch.equal(chefer_relevance(model, x, 2)[0], dense)
    vitrim.reduce.remove(model)
    vitrim.reduce.apply(model, "topk", keep_rate=1.0, layers=(0, 1, 2))
    assert torch.equal(chefer_relevance(model, x, 2)[0], dense)


def test_models_without_cls_explain_the_row_their_head_reads() -> None:
    """GAP: Chefer's row is the pooling weights (uniform over patches), so R_final = mean of the patch rows."""
    model = tiny(class_token=False, global_pool="avg")
    x = images()
    ours, _, target = chefer_relevance(model, x)
    mean_rows = torch.zeros_like(ours)
    for b in range(x.shape[0]):  # forwards: R over all tokens, then the mean of its rows
        single = forward_rows_reference_full(model, x[b : b + 1], target[b : b + 1])
        mean_rows[b] = single.mean(dim=0)
    assert torch.allclose(ours, mean_rows, atol=1e-10)
    siglip = vitrim.create_model("vit_base_patch16_siglip_224", depth=2, embed_dim=32, num_heads=4, img_size=32)
    rel = vitrim.viz.relevance(sharpened(siglip), images(2).float())
    assert rel.shape == (2, 2, 2) and bool((rel >= 0).all()) and float(rel.sum()) > 0


def forward_rows_reference_full(model: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The whole (N, N) R of a dense model for one image, by the authors' loop (no [CLS] needed)."""
    out = model.forward_detailed(x, need_weights=True)
    for a in out.attentions:
        a.retain_grad()
    out.logits.gather(1, target[:, None]).sum().backward()
    N = out.attentions[0].shape[-1]
    R = torch.eye(N, dtype=torch.float64)
    for a in out.attentions:
        R = R + (a.grad[0] * a[0].detach()).clamp(min=0).mean(dim=0) @ R
    return R


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_attnlrp_rules_are_a_complete_decomposition_on_every_family(name: str) -> None:
    """With attention='cp' every rule is a linearisation, so relevance of the input tokens plus that of every bias
    (what LRP lets constants absorb) is exactly the logit; with the softmax rule the sum of the input tokens alone
    stays within the measured band of docs/relevance.md on the bias-free model."""
    case = FAMILIES[name]
    model = vitrim.create_model(name, checkpoint=DATA / case["state_dict"], **case["overrides"]).eval().double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.config.in_chans, *model.config.img_size, dtype=torch.float64, generator=g)
    relevance, logits, target = attnlrp_relevance(model, x, attention="cp")
    with lrp_rules(model, "cp"), torch.enable_grad():
        state, tokens = leaf_tokens(model, x)
        state, _ = model.forward_blocks(state)
        out = model.forward_head(model.norm(state.tokens), patch_weights=state.patch_weights())
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        grads = torch.autograd.grad(out.gather(1, target[:, None]).sum(), [tokens, *biases], allow_unused=True)
    absorbed = sum(float((b * g).detach().sum()) for b, g in zip(biases, grads[1:]) if g is not None)
    explained = logits.gather(1, target[:, None]).sum()
    assert torch.allclose(relevance.sum(1), (tokens * grads[0]).sum((1, 2)), atol=1e-12)
    assert abs(float(relevance.sum()) + absorbed - float(explained)) <= 1e-9 * max(1.0, abs(float(explained)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.zero_()
    relevance, logits, target = attnlrp_relevance(model, x)
    ratio = relevance.sum(1) / logits.gather(1, target[:, None])[:, 0]
    low = 0.4 if case["global_pool"] == "map" else 0.9  # the pool's learned query takes half its attention's share
    assert bool(((ratio > low) & (ratio < 1.1)).all()), ratio


def test_attnlrp_on_a_dense_vit_equals_lxt_explicit_rules_in_float64() -> None:
    pytest.importorskip("lxt")
    model, x = tiny(), images()
    target = torch.tensor([4, 0, 2])
    ours, _, _ = attnlrp_relevance(model, x, target)
    reference = attnlrp_reference(model, x, target)
    assert torch.allclose(ours, reference, rtol=1e-7, atol=1e-9), (ours - reference).abs().max()


@pytest.mark.parametrize(("reducer", "options"), [("tome", {"r": 3}), ("topk", {"keep_rate": 0.5, "layers": (1,)})])
def test_attnlrp_is_conserved_through_merging_and_dropping(reducer: str, options: dict) -> None:
    """A merge and a drop add no loss of their own: with CP rules and no biases the input tokens hold the logit."""
    model = tiny()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.zero_()
    vitrim.reduce.apply(model, reducer, **options)
    x = images()
    assert model.forward_detailed(x).patch_to_token
    relevance, logits, target = attnlrp_relevance(model, x, attention="cp")
    assert torch.allclose(relevance.sum(1), logits.gather(1, target[:, None])[:, 0], rtol=1e-9)


def _lxt_vit_patch() -> object:
    """lxt 2.1's own ViT support: its CP-LRP patch map for torchvision's VisionTransformer.

    lxt's package ``__init__`` imports every LLM patch it has, and its BERT patch imports a module transformers 5
    removed; the ViT patch needs none of them, so its two modules are loaded under empty parent packages.
    """
    import os
    import sys
    import types

    lxt = pytest.importorskip("lxt")
    root = os.path.dirname(lxt.__file__)
    for name, sub in (("lxt.efficient", "efficient"), ("lxt.efficient.models", "efficient/models")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, sub)]
            sys.modules[name] = package
    from lxt.efficient.models import vit_torch

    return vit_torch


def test_attnlrp_cp_equals_lxt_on_torchvisions_vit_with_the_same_weights() -> None:
    """lxt patches torchvision's ViT (CP-LRP in the attention, AttnLRP's LayerNorm and GELU rules elsewhere); the same
    weights in a vitrim ViT under ``lrp_rules(model, "cp")`` give the same pixel relevance."""
    vit_torch = _lxt_vit_patch()
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    tv = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=128, num_classes=5
    )
    sharpened(tv).double()
    model = vitrim.create_model(
        "deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=4, num_classes=5
    ).double()
    state = {"patch_embed.proj.weight": tv.conv_proj.weight, "patch_embed.proj.bias": tv.conv_proj.bias,
             "cls_token": tv.class_token, "pos_embed": tv.encoder.pos_embedding,
             "norm.weight": tv.encoder.ln.weight, "norm.bias": tv.encoder.ln.bias,
             "head.weight": tv.heads.head.weight, "head.bias": tv.heads.head.bias}  # fmt: skip
    for i, layer in enumerate(tv.encoder.layers):
        ours = {"norm1": layer.ln_1, "norm2": layer.ln_2, "mlp.fc1": layer.mlp[0], "mlp.fc2": layer.mlp[3],
                "attn.proj": layer.self_attention.out_proj}  # fmt: skip
        for name, module in ours.items():
            state[f"blocks.{i}.{name}.weight"], state[f"blocks.{i}.{name}.bias"] = module.weight, module.bias
        state[f"blocks.{i}.attn.qkv.weight"] = layer.self_attention.in_proj_weight
        state[f"blocks.{i}.attn.qkv.bias"] = layer.self_attention.in_proj_bias
    model.load_state_dict({k: v.detach().clone() for k, v in state.items()})
    model.eval()
    x = images(2)
    assert torch.allclose(model(x), tv(x), atol=1e-10)

    def pixel_relevance(net: torch.nn.Module) -> torch.Tensor:
        inputs = x.clone().requires_grad_(True)
        logits = net(inputs)
        logits[:, 3].sum().backward()
        return (inputs * inputs.grad).sum(1)

    classes = list(vit_torch.cp_LRP)
    saved = {cls: cls.__dict__.get("forward") for cls in classes}
    try:
        for cls, patch in vit_torch.cp_LRP.items():
            assert patch(cls)
        expected = pixel_relevance(tv)
    finally:
        for cls in classes:
            cls.forward = saved[cls]
            if "original_forward" in cls.__dict__:
                del cls.original_forward
    with lrp_rules(model, "cp"):
        ours = pixel_relevance(model)
    scale = float(
        expected.detach().abs().max()
    )  # lxt's GELU rule divides by x + 1e-10: agreement to ~1e-9 of the largest
    assert scale > 1e-3 and torch.allclose(ours, expected, rtol=0, atol=1e-7 * scale), (ours - expected).abs().max()


def test_chefer_streams_no_earlier_blocks_map_or_gradient_lives_when_a_block_is_folded(monkeypatch) -> None:
    """When block b's gradient arrives, the maps and gradients of the blocks after it (folded before) are gone:
    at most this block's and one neighbour's are alive at once, beyond what autograd itself still holds."""
    import weakref

    import vitrim.viz.chefer as chefer

    model, x = tiny(depth=6), images()
    seen: list[tuple[weakref.ref, weakref.ref]] = []
    most_alive = []
    original = chefer.gradient_weighted_heads

    def recording(attention: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        alive = sum(1 for a, g in seen if a() is not None or g() is not None)
        most_alive.append(alive)
        seen.append((weakref.ref(attention), weakref.ref(gradient)))
        return original(attention, gradient)

    monkeypatch.setattr(chefer, "gradient_weighted_heads", recording)
    chefer_relevance(model, x)
    assert len(most_alive) == 6
    assert max(most_alive) <= 1, most_alive


@pytest.mark.parametrize("reducer", vitrim.reduce.list_reducers())
def test_every_reducer_gives_relevance_over_the_input_grid(reducer: str) -> None:
    """Every registered reducer, with its own example options (the reducer sweep's), on a 4-block model of 16
    patches: Chefer is non-negative and finite on the full grid, and AttnLRP runs wherever its rules apply."""
    cls = vitrim.reduce.get_reducer(reducer)
    model = vitrim.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=4, embed_dim=32,
                                num_heads=2, num_classes=5)  # fmt: skip
    vitrim.reduce.apply(model, reducer, **cls.example_options)
    sharpened(model, seed=3)
    x = images(2).float()
    chefer = vitrim.viz.relevance(model, x)
    assert chefer.shape == (2, 4, 4) and bool(torch.isfinite(chefer).all()) and bool((chefer >= 0).all())
    if cls.looks_ahead:
        return
    lrp = vitrim.viz.relevance(model, x, method="attnlrp")
    assert lrp.shape == (2, 4, 4) and bool(torch.isfinite(lrp).all())


def test_a_distilled_deit_explains_the_mean_of_its_two_heads_rows() -> None:
    distilled = sharpened(vitrim.create_model("deit_tiny_distilled_patch16_224", img_size=32, patch_size=8, depth=2,
                                              embed_dim=32, num_heads=4, num_classes=5)).double()  # fmt: skip
    x = images(1)
    ours, _, target = chefer_relevance(distilled, x)
    R = forward_rows_reference_full(distilled, x, target)
    assert torch.allclose(ours[0], (R[0] + R[1]) / 2, atol=1e-10)

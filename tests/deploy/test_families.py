"""The families people run today deploy with reduction too: registers, RoPE (EVA-02) and SigLIP's attention pool
compile without a graph break and export to ONNX, where onnxruntime computes PyTorch's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vitrim
from vitrim.export import compare_with_onnxruntime, export_onnx

TINY = dict(embed_dim=32, depth=4, num_heads=2, num_classes=5)
CASES = {  # name -> (img_size, reducer, options): 4x4 patch grids
    "vit_small_patch14_reg4_dinov2": (56, "tome", {"r": 3}),
    "vit_base_patch16_siglip_224": (64, "tome", {"r": 3}),  # no [CLS]; MAP pool weighted by size
    "eva02_tiny_patch14_224": (56, "topk", {"keep_rate": 0.5}),  # RoPE by absolute position after pruning
    "deit3_small_patch16_224": (64, "evit", {"keep_rate": 0.5}),  # layer scale
}


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    side, reducer, options = CASES[name]
    torch.manual_seed(0)
    model = vitrim.create_model(name, img_size=side, reducer=reducer, **options, **TINY).eval()
    with torch.no_grad():  # away from the init, so that scores are well separated
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model, torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_graph_breaks(name: str) -> None:
    model, x = build(name)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize("name", ["eva02_tiny_patch14_224", "vit_base_patch16_siglip_224"])
def test_onnx_export_matches_pytorch(name: str, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model, _ = build(name)
    path = export_onnx(model, tmp_path / f"{name}.onnx")
    assert compare_with_onnxruntime(model, path, batch_sizes=(1, 3)) < 1e-4

"""On a GPU: every model kind runs on CUDA as on CPU, under bf16 autocast, and its forward never waits for the host.

Marked ``gpu`` and skipped where torch sees no CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from deploy_models import KINDS, build, images

import vitrim

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def exact_float32() -> Iterator[None]:
    """float32 means float32 here: no TF32 in convolutions or matrix products (CPU has none)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_on_cuda_equals_cpu_and_stays_on_the_device(kind: str) -> None:
    model = build(kind, gumbel_noise=False)
    x = images(3)
    with torch.no_grad():
        expected = model(x)
        model.cuda()
        out = model.forward_detailed(x.cuda())
    torch.testing.assert_close(out.logits.cpu(), expected, rtol=0, atol=1e-4)
    for field in ("logits", "tokens", "kept_indices", "keep_masks", "token_sizes", "patch_to_token"):
        for t in tensors(getattr(out, field)):
            assert t.is_cuda, field


@pytest.mark.parametrize("kind", KINDS)
def test_forward_never_synchronises_with_the_host(kind: str) -> None:
    model = build(kind).cuda()
    x = images(4).cuda()
    with torch.no_grad():
        model(x)  # warm up: kernels load, index caches fill
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast_runs_every_path(kind: str) -> None:
    model = build(kind).cuda()
    x = images(4).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.shape == (4, 5) and torch.isfinite(logits).all()
    if model.training:
        logits.float().sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_attention_masks_and_policies_under_autocast() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, device="cuda", generator=g) for _ in range(3))
    policy = (torch.rand(2, 7, device="cuda", generator=g) > 0.3).float()
    bias = torch.rand(2, 1, 1, 7, device="cuda", generator=g).log()
    bias[1] = float("-inf")  # every key closed for the second image: its rows come out as zeros
    ref, _ = vitrim.scaled_dot_product_attention(q, k, v, bias, keep_policy=policy, backend="math")  # float32
    for backend in ("fused", "math"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = vitrim.scaled_dot_product_attention(
                q.bfloat16(), k.bfloat16(), v.bfloat16(), bias, keep_policy=policy, backend=backend
            )
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)
            assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("kind", ["dense", "tome", "topk", "dynamicvit", "mctf"])
def test_optimize_captures_one_cuda_graph_and_matches_eager(kind: str) -> None:
    from torch._dynamo.utils import counters

    model = build(kind).cuda()
    batches = [images(2, seed=s).cuda() for s in range(4)]
    with torch.no_grad():
        expected = [model(x) for x in batches]
    torch._dynamo.reset()
    counters.clear()
    fast = vitrim.optimize(model, batch_size=2, device="cuda", warmup=3)  # "reduce-overhead": CUDA graphs
    got = [fast(x) for x in batches]
    assert counters["stats"]["unique_graphs"] == 1  # warm-up and four calls of one shape: one capture
    for g, e in zip(got, expected):  # every output still holds its own call's logits (copied out of the graph)
        torch.testing.assert_close(g, e, rtol=0, atol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        expected_bf16 = model(batches[0])
    torch._dynamo.reset()
    fast16 = vitrim.optimize(model, batch_size=2, device="cuda", dtype=torch.bfloat16, warmup=3)
    torch.testing.assert_close(fast16(batches[0]).float(), expected_bf16.float(), rtol=0, atol=5e-2)

"""Attention rollout against a straightforward float64 loop implementation written here, and on tiny models."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

import vitrim
import vitrim.reduce
from vitrim.viz import (
    Rollout,
    attention_rollout,
    attention_rollout_model,
    block_token_indices,
    positions_to_token_index,
)


def random_attention(batch: int, heads: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(batch, heads, n, n, generator=g), dim=-1)  # (B, H, N, N) rows sum to 1


def reference_rollout(attentions, fusion, ratio, token_indices, num_tokens, num_prefix=1):
    """The algorithm as the docstring states it, one number at a time, in float64."""
    batch = attentions[0].shape[0]
    R = [np.eye(num_tokens) for _ in range(batch)]
    for layer, attention in enumerate(attentions):
        a = attention.detach().double().numpy()
        for b in range(batch):
            n = a.shape[-1]
            fused = np.zeros((n, n))
            for i in range(n):
                for j in range(n):
                    heads = a[b, :, i, j]
                    fused[i, j] = {"mean": heads.mean, "max": heads.max, "min": heads.min}[fusion]()
            num_drop = int(ratio * n * n)
            for flat in np.argsort(fused.ravel(), kind="stable")[:num_drop]:
                i, j = divmod(int(flat), n)
                if i >= num_prefix and j >= num_prefix:
                    fused[i, j] = 0.0
            step = fused + np.eye(n)
            for i in range(n):
                step[i] /= step[i].sum()
            index = (
                range(num_tokens) if token_indices is None or token_indices[layer] is None else token_indices[layer][b]
            )
            index = [int(t) for t in index]
            new_rows = [sum(step[i, j] * R[b][index[j]] for j in range(n)) for i in range(n)]
            for i in range(n):
                R[b][index[i]] = new_rows[i]
    return np.stack(R)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.9])
def test_rows_sum_to_one(fusion, ratio):
    attentions = [random_attention(2, 3, 7, seed) for seed in range(4)]
    R = attention_rollout(attentions, fusion, ratio)
    assert R.shape == (2, 7, 7)
    torch.testing.assert_close(R.sum(-1), torch.ones(2, 7), atol=1e-6, rtol=0)
    assert bool((R >= 0).all())


def test_identity_attention_gives_identity():
    eye = torch.eye(5).expand(2, 4, 5, 5)
    R = attention_rollout([eye, eye, eye], "mean", 0.3)
    torch.testing.assert_close(R, torch.eye(5).expand(2, 5, 5), atol=0, rtol=0)


def test_dense_mean_is_the_plain_product_of_half_attention_half_identity():
    attentions = [random_attention(1, 2, 6, seed) for seed in range(3)]
    steps = [0.5 * a[0].double().numpy().mean(0) + 0.5 * np.eye(6) for a in attentions]  # rows already sum to 1
    expected = steps[2] @ steps[1] @ steps[0]
    np.testing.assert_allclose(attention_rollout(attentions)[0].numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.8])
def test_dense_matches_loop_reference(fusion, ratio):
    attentions = [random_attention(2, 3, 6, 10 + seed) for seed in range(3)]
    expected = reference_rollout(attentions, fusion, ratio, None, 6)
    np.testing.assert_allclose(attention_rollout(attentions, fusion, ratio).numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.0, 0.4])
def test_pruned_matches_loop_reference(ratio):
    # 1 [CLS] + 8 patches; blocks 0-1 see everything, 2-3 see 5 patches, 4 sees 3 of those, in shuffled orders
    g = torch.Generator().manual_seed(3)
    stage1 = torch.stack([torch.randperm(8, generator=g)[:5] for _ in range(2)])  # (B, 5) absolute positions
    stage2 = torch.stack([row[torch.randperm(5, generator=g)[:3]] for row in stage1])  # (B, 3), a subset
    index1, index2 = positions_to_token_index(stage1), positions_to_token_index(stage2)
    token_indices = [None, None, index1, index1, index2]
    sizes = [9, 9, 6, 6, 4]
    attentions = [random_attention(2, 2, n, 20 + layer) for layer, n in enumerate(sizes)]
    R = attention_rollout(attentions, "mean", ratio, token_indices=token_indices)
    expected = reference_rollout(attentions, "mean", ratio, token_indices, 9)
    np.testing.assert_allclose(R.numpy(), expected, atol=1e-5)
    torch.testing.assert_close(R.sum(-1), torch.ones(2, 9), atol=1e-6, rtol=0)


def test_pruned_rollout_by_hand():
    # tokens [CLS], p0, p1; block 0 sees all, block 1 sees [CLS] and p1 only
    a0 = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    a1 = torch.tensor([[0.4, 0.6], [0.2, 0.8]])
    index1 = torch.tensor([[0, 2]])
    R = attention_rollout([a0[None, None], a1[None, None]], token_indices=[None, index1])[0]
    s0 = (a0 + torch.eye(3)) / 2  # rows of a0 sum to 1, so (A + I) / 2 is already normalised
    s1 = (a1 + torch.eye(2)) / 2
    row_cls = s1[0, 0] * s0[0] + s1[0, 1] * s0[2]
    row_p1 = s1[1, 0] * s0[0] + s1[1, 1] * s0[2]
    torch.testing.assert_close(R[0], row_cls)
    torch.testing.assert_close(R[2], row_p1)
    torch.testing.assert_close(R[1], s0[1])  # p0 was pruned after block 0: its row stays as it was then


def test_discard_never_drops_cls_row_or_column():
    n = 5
    fused = torch.full((n, n), 0.5) + 0.4 * torch.eye(n)  # patch links 0.5, self links 0.9
    fused[0, :] = 1e-4  # the weakest links of all sit in the [CLS] row and column
    fused[:, 0] = 1e-4
    # int(0.86 * 25) = 21 weakest: the 9 [CLS] links (kept) and the 12 patch-to-other-patch links (dropped)
    step = attention_rollout([fused[None, None]], "mean", 0.86)[0]  # with one block, R is the step itself
    assert bool((step[0] > 0).all()) and bool((step[:, 0] > 0).all())
    off_diagonal = step[1:, 1:][~torch.eye(n - 1, dtype=torch.bool)]
    assert bool((off_diagonal == 0).all())
    expected_patch_row = torch.tensor([1e-4, 1.9, 0, 0, 0]) / (1e-4 + 1.9)  # [CLS] link + self (0.9 + identity)
    torch.testing.assert_close(step[1], expected_patch_row)


def test_rollout_accumulator_matches_list_api():
    attentions = [random_attention(1, 2, 5, seed) for seed in range(3)]
    acc = Rollout("max", 0.2)
    for a in attentions:
        acc.update(a)
    torch.testing.assert_close(acc.result, attention_rollout(attentions, "max", 0.2))
    assert acc.num_blocks == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(head_fusion="median"), "head_fusion must be one of"),
        (dict(discard_ratio=1.0), "discard_ratio must be a number in \\[0, 1\\)"),
        (dict(discard_ratio=-0.1), "discard_ratio"),
    ],
)
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        attention_rollout([random_attention(1, 1, 3, 0)], **kwargs)


def test_bad_inputs_raise():
    a = random_attention(1, 2, 4, 0)
    with pytest.raises(ValueError, match="non-empty list"):
        attention_rollout([])
    with pytest.raises(ValueError, match="floating \\(B, H, N, N\\)"):
        attention_rollout([a[0]])
    with pytest.raises(ValueError, match="block 1 saw 3 tokens but the model has 4"):
        attention_rollout([a, random_attention(1, 2, 3, 1)])
    with pytest.raises(ValueError, match="must lie in \\[0, 4\\)"):
        attention_rollout([a, random_attention(1, 2, 2, 1)], token_indices=[None, torch.tensor([[0, 4]])])
    with pytest.raises(ValueError, match="shape \\(1, 2\\)"):
        attention_rollout([a, random_attention(1, 2, 2, 1)], token_indices=[None, torch.tensor([[0, 1, 2]])])
    with pytest.raises(ValueError, match="earlier blocks had 1"):
        attention_rollout([a, random_attention(2, 2, 4, 1)])
    with pytest.raises(ValueError, match="pass num_tokens"):
        attention_rollout([a], token_indices=[torch.tensor([[0, 1, 2, 3]])])


def test_block_token_indices_from_recorded_positions():
    positions = [torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.tensor([[5, 1, 3]]), torch.tensor([[3, 5]])]
    index = block_token_indices(positions)  # 1 [CLS] + 6 patches, then 3, then 2
    assert index[0] is None  # all 7 tokens in their original order
    assert index[1].tolist() == [[0, 6, 2, 4]]
    assert index[2].tolist() == [[0, 4, 6]]
    shuffled = block_token_indices([torch.tensor([[1, 0]])], num_prefix=2, num_tokens=4)
    assert shuffled[0].tolist() == [[0, 1, 3, 2]]  # every token seen, but not in order: an explicit index
    with pytest.raises(ValueError, match="non-empty list"):
        block_token_indices([])


def tiny_vit(**overrides):
    torch.manual_seed(0)
    config = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
    return vitrim.create_model("vit_tiny_patch16_224", **{**config, **overrides}).eval()


def all_at_once(model, images, fusion="mean", ratio=0.0):
    out = model.forward_detailed(images, need_weights=True)
    prefix = model.num_prefix
    index = block_token_indices(out.block_positions, prefix)
    return attention_rollout(out.attentions, fusion, ratio, token_indices=index, num_prefix=prefix)


@pytest.mark.parametrize(("fusion", "ratio"), [("mean", 0.0), ("max", 0.5)])
def test_streaming_equals_all_at_once_dense(fusion, ratio):
    model = tiny_vit()
    images = torch.randn(2, 3, 32, 32)
    streamed = attention_rollout_model(model, images, fusion, ratio)
    assert streamed.shape == (2, 17, 17)
    torch.testing.assert_close(streamed, all_at_once(model, images, fusion, ratio), atol=1e-6, rtol=1e-5)


def test_streaming_equals_all_at_once_dynamicvit():
    torch.manual_seed(0)
    model = vitrim.create_model(
        "dynamicvit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=5
    ).eval()
    images = torch.randn(2, 3, 32, 32)
    out = model.forward_detailed(images, need_weights=True)
    assert [k.shape[1] for k in out.kept_indices] == model.num_keep(32)  # 64 patches -> 44, 31, 21
    assert [a.shape[-1] for a in out.attentions] == [65, 45, 32, 22]
    streamed = attention_rollout_model(model, images)
    torch.testing.assert_close(streamed, all_at_once(model, images), atol=1e-6, rtol=1e-5)
    # the blocks recorded what they saw: the dense grid, then each stage's kept tokens (pruning before blocks 1-3)
    assert torch.equal(out.block_positions[0], torch.arange(64).expand(2, 64))
    for block, kept in zip(out.block_positions[1:], out.kept_indices):
        assert torch.equal(block, kept)
    # the rollout followed the pruned tokens: compare with the loop reference on the same maps
    index = block_token_indices(out.block_positions)
    expected = reference_rollout(out.attentions, "mean", 0.0, index, 65)
    np.testing.assert_allclose(streamed.numpy(), expected, atol=1e-5)


def test_streaming_follows_a_mid_stage_reducer():
    model = tiny_vit(depth=4)
    vitrim.reduce.apply(model, "topk", keep_rate=0.5, layers=(1, 2))  # prunes after attention in blocks 1 and 2
    images = torch.randn(1, 3, 32, 32)
    out = model.forward_detailed(images, need_weights=True)
    assert [a.shape[-1] for a in out.attentions] == [17, 17, 9, 5]
    torch.testing.assert_close(attention_rollout_model(model, images), all_at_once(model, images), atol=1e-6, rtol=0)


def test_streaming_holds_one_block_map_at_a_time():
    model = tiny_vit(depth=4)
    alive: list[weakref.ref] = []

    def watch(block):
        forward = block.forward

        def wrapped(state, *, need_weights=False):
            assert all(ref() is None for ref in alive), "an earlier block's attention map is still alive"
            state, weights = forward(state, need_weights=need_weights)
            alive.append(weakref.ref(weights))
            return state, weights

        block.forward = wrapped

    for block in model.blocks:
        watch(block)
    attention_rollout_model(model, torch.randn(1, 3, 32, 32))
    assert len(alive) == 4


def test_streaming_rejects_a_non_vit():
    with pytest.raises(TypeError, match="vitrim VisionTransformer"):
        attention_rollout_model(torch.nn.Linear(2, 2), torch.randn(1, 3, 8, 8))

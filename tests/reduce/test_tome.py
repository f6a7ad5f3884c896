"""ToMe: batched merge vs a loop reference, token counts with the cap, sizes, sources, proportional attention."""

from __future__ import annotations

import pytest
import torch
from reduce_models import attention_info, images, peaky_float64, states_per_block, tiny
from tome_model_reference import tome_forward
from tome_reference import reference_merge

import vitrim
from vitrim.reduce import TokenState
from vitrim.reduce.tome import ToMe, bipartite_soft_matching, merge_wavg, parse_r, token_destinations


def random_case(B: int, N: int, seed: int, integer_sizes: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, 6, generator=g, dtype=torch.float64)
    metric = torch.randn(B, N, 5, generator=g, dtype=torch.float64)
    if integer_sizes:
        sizes = torch.randint(1, 5, (B, N), generator=g).to(torch.float64)
    else:
        sizes = torch.ones(B, N, dtype=torch.float64)
    return x, metric, sizes


@pytest.mark.parametrize("N", [9, 10, 17])
@pytest.mark.parametrize("num_prefix", [0, 1, 2])
@pytest.mark.parametrize("r", [1, 3, 100])
@pytest.mark.parametrize("integer_sizes", [False, True])
def test_merge_matches_loop_reference(N: int, num_prefix: int, r: int, integer_sizes: bool) -> None:
    x, metric, sizes = random_case(3, N, seed=N * 7 + num_prefix + r, integer_sizes=integer_sizes)
    m = bipartite_soft_matching(metric, r, num_prefix)
    merged, merged_sizes = merge_wavg(x, sizes, m)
    ref_x, ref_sizes, groups = reference_merge(x, metric, sizes, r, num_prefix)
    torch.testing.assert_close(merged, ref_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_sizes, ref_sizes, rtol=0, atol=0)
    dest = token_destinations(m, N)
    for s, sample_groups in enumerate(groups):
        expected = torch.empty(N, dtype=torch.long)
        for new, members in enumerate(sample_groups):
            expected[members] = new
        assert torch.equal(dest[s], expected)


@pytest.mark.parametrize(("N", "num_prefix", "r"), [(9, 0, 100), (10, 1, 3), (17, 2, 4), (17, 1, 1)])
def test_merge_at_batch_1_matches_loop_reference(N: int, num_prefix: int, r: int) -> None:
    # batch 1 merges with one product by the one-hot assignment, not by moving rows: the same sums
    x, metric, sizes = random_case(1, N, seed=N + r, integer_sizes=True)
    m = bipartite_soft_matching(metric, r, num_prefix)
    merged, merged_sizes = merge_wavg(x, sizes, m)
    ref_x, ref_sizes, groups = reference_merge(x, metric, sizes, r, num_prefix)
    torch.testing.assert_close(merged, ref_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_sizes, ref_sizes, rtol=0, atol=0)
    ones_merged, ones_sizes = merge_wavg(x, None, m)
    ref_ones, _, _ = reference_merge(x, metric, torch.ones_like(sizes), r, num_prefix)
    torch.testing.assert_close(ones_merged, ref_ones, rtol=1e-12, atol=1e-12)
    assert torch.equal(ones_sizes, torch.tensor([[float(len(g)) for g in groups[0]]], dtype=x.dtype))


def test_reducer_merges_on_head_mean_keys_and_tracks_positions_and_sources() -> None:
    B, H, N, hd, p = 2, 3, 13, 4, 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, N, 8, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, hd, generator=g, dtype=torch.float64)
    state = TokenState(x, p, torch.arange(N - p).expand(B, -1), grid_patches=N - p)
    info = attention_info(k, k, scale=hd**-0.5)
    out = ToMe(4).after_attention(state, info)
    ref_x, ref_sizes, groups = reference_merge(x, k.mean(1), torch.ones(B, N, dtype=x.dtype), 4, p)
    torch.testing.assert_close(out.tokens, ref_x, rtol=1e-12, atol=1e-12)
    assert out.sizes is not None and torch.equal(out.sizes, ref_sizes)
    (patch_to_token,) = out.patch_to_token
    for s in range(B):
        for new, members in enumerate(groups[s][p:]):
            # every patch in the group maps to this token; the token sits at its b (last-listed first) member
            assert patch_to_token[s, torch.tensor(members) - p].tolist() == [new] * len(members)
            assert out.positions[s, new].item() == members[0] - p


def test_r_is_capped_at_half_the_mergeable_tokens() -> None:
    metric = torch.randn(2, 11, 4)
    assert bipartite_soft_matching(metric, 50, num_prefix=1).r == 5
    assert bipartite_soft_matching(metric, 50, num_prefix=2).r == 4
    assert bipartite_soft_matching(metric[:, :3], 50, num_prefix=2).r == 0


@pytest.mark.parametrize("r", [3, [5, 0, 4, 9]])
def test_token_counts_per_layer(r: int | list[int]) -> None:
    model = vitrim.reduce.apply(tiny(), "tome", r=r)
    schedule = r if isinstance(r, list) else [r] * 4
    expected, n = [], 17  # 16 patches + [CLS]
    for r_layer in schedule:
        expected.append(n)  # tokens each block's attention sees
        n -= min(r_layer, (n - 1) // 2)  # hand-written cap: half of the mergeable tokens
    with torch.no_grad():
        out = model.forward_detailed(images(), need_weights=True)
    assert [a.shape[-1] for a in out.attentions] == expected
    assert out.tokens.shape[1] == n
    assert len(out.patch_to_token) == sum(1 for r_layer in schedule if r_layer > 0)


@pytest.mark.parametrize("distilled", [False, True])
def test_sizes_sum_to_patches_plus_prefix_and_match_the_source_map(distilled: bool) -> None:
    model = vitrim.reduce.apply(tiny(distilled=distilled), "tome", r=4)
    p = 2 if distilled else 1
    with torch.no_grad():
        out = model.forward_detailed(images(batch=3))
    sizes = out.token_sizes
    assert sizes is not None
    torch.testing.assert_close(sizes.sum(1), torch.full((3,), 16.0 + p))
    assert torch.equal(sizes[:, :p], torch.ones(3, p))
    for step in out.patch_to_token:
        assert step.shape == (3, 16) and bool((step >= 0).all())
    counts = torch.stack([torch.bincount(row, minlength=sizes.shape[1] - p) for row in out.patch_to_token[-1]])
    assert torch.equal(counts.to(sizes.dtype), sizes[:, p:])  # each token stands for as many patches as its size


@pytest.mark.parametrize("backend", ["math", "fused"])
def test_proportional_attention_equals_attention_over_duplicated_tokens(backend: str) -> None:
    g = torch.Generator().manual_seed(3)
    H, Lq, hd = 2, 5, 8
    k = torch.randn(1, H, 4, hd, generator=g, dtype=torch.float64)
    v = torch.randn(1, H, 4, hd, generator=g, dtype=torch.float64)
    q = torch.randn(1, H, Lq, hd, generator=g, dtype=torch.float64)
    sizes = torch.tensor([[1.0, 3.0, 1.0, 5.0]], dtype=torch.float64)  # token 1 stands for 3 copies, token 3 for 5
    bias = TokenState(torch.zeros(1, 4, 2, dtype=torch.float64), 0, torch.zeros(1, 4), sizes=sizes).attention_bias()
    out, _ = vitrim.scaled_dot_product_attention(q, k, v, bias, backend=backend)
    repeats = torch.tensor([1, 3, 1, 5])
    k_dup, v_dup = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)  # 10 keys
    # the duplicated case by hand: softmax over the 10 logits, then the weighted values
    weights = torch.softmax(q @ k_dup.transpose(-1, -2) * hd**-0.5, dim=-1)
    torch.testing.assert_close(out, weights @ v_dup, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("distilled", [False, True])
def test_prefix_outputs_of_the_first_merging_block_equal_the_dense_model(distilled: bool) -> None:
    dense = tiny(distilled=distilled)
    x = images()
    p = 2 if distilled else 1
    with torch.no_grad():
        expected = states_per_block(dense, x)[0].tokens[:, :p]
        reduced = states_per_block(vitrim.reduce.apply(dense, "tome", r=6), x)[0]
    assert reduced.tokens.shape[1] == 17 + p - 1 - 6
    torch.testing.assert_close(reduced.tokens[:, :p], expected, rtol=0, atol=1e-6)


def test_merge_is_differentiable_in_the_tokens() -> None:
    model = vitrim.reduce.apply(tiny().train(), "tome", r=4)
    model(images()).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and bool(torch.isfinite(param.grad).all()), name
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_reducer_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"r must be an int >= 0.*-1"):
        ToMe(-1)
    with pytest.raises(ValueError, match="r must be an int"):
        ToMe(True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("r", "prop_attn"),
    [(3, False), ((3, -1.0), True), ((2, 0.5), False), ([4, 2], True), ([1, 3, 0, 2], True)],
    ids=["int-no-prop-attn", "decreasing", "inflection-0.5", "short-list", "list"],
)
def test_agrees_with_the_authors_forward(r: object, prop_attn: bool) -> None:
    """ToMe's own option forms against an independent copy of the authors' timm patch, float64, same weights."""
    model = peaky_float64("vit_tiny_patch16_224", seed=7)
    sd = model.state_dict()
    vitrim.reduce.apply(model, "tome", r=r, prop_attn=prop_attn)
    x = torch.randn(3, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = tome_forward(sd, x, depth=4, heads=2, patch=8, r=r, prop_attn=prop_attn)
        ours = model(x)
        one_by_one = torch.cat([model(x[i : i + 1]) for i in range(3)])  # batch 1: merges by one-hot products
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(one_by_one, expected, rtol=1e-10, atol=1e-10)


def test_parse_r_reads_the_authors_forms() -> None:
    assert parse_r(4, 3) == [3, 3, 3, 3]
    assert parse_r(12, (16, -1)) == [int(32 - 32 / 11 * i) for i in range(12)]  # min 32, max 0: decreasing
    assert parse_r(4, (4, 0.5)) == [2, 3, 4, 6]  # min int(4 · 0.5) = 2, max 6, step 4/3
    assert parse_r(4, [5, 1]) == [5, 1, 0, 0]  # a short list is padded with 0
    with pytest.raises(ValueError, match=r"\(r, inflection\)"):
        parse_r(4, (1, 2, 3))
    with pytest.raises(ValueError, match="inflection"):
        parse_r(4, (4, 2.0))


def test_trace_source_off_records_no_maps_and_changes_nothing_else() -> None:
    x = images()
    with torch.no_grad():
        traced = vitrim.reduce.apply(tiny(), "tome", r=2).forward_detailed(x)
        untraced = vitrim.reduce.apply(tiny(), "tome", r=2, trace_source=False).forward_detailed(x)
    assert len(traced.patch_to_token) == 4 and untraced.patch_to_token == []
    assert all(m is None for m in untraced.block_patch_to_token)
    assert torch.equal(untraced.logits, traced.logits)

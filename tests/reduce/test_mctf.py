"""MCTF against an independent re-implementation of the authors' DeiT forward, on the same weights in float64."""

from __future__ import annotations

import pytest
import torch
from mctf_reference import mctf_forward
from reduce_models import images, tiny
from vit_reference import grid_sources

import vitrim
from vitrim.reduce.mctf import mctf_count, merge_columns, merge_rows

SETTINGS = [
    dict(r=4),  # the authors' defaults: bidirectional, one-step-ahead, attention pooling
    dict(r=6, one_step_ahead=2),
    dict(r=0.3, bidirection=False, pooling="size"),
]


@pytest.mark.parametrize("options", SETTINGS, ids=str)
def test_matches_the_authors_forward(options: dict) -> None:
    model = tiny(img_size=64).double()  # 64 patches: enough tokens for several merges per block
    x = images(batch=3, size=64).double()
    sd = model.state_dict()
    reference = dict(
        r=options["r"],
        one_step_ahead=options.get("one_step_ahead", 1),
        bidirection=options.get("bidirection", True),
        pooling={"attention": 1, "size": 0}[options.get("pooling", "attention")],
    )
    with torch.no_grad():
        expected, source = mctf_forward(x, sd, heads=2, depth=4, **reference)
        out = vitrim.reduce.apply(model, "mctf", **options).forward_detailed(x)
    assert out.tokens.shape[1] == source.shape[1] < 65
    assert (out.logits - expected).abs().max() <= 1e-12  # float64: the same sums in another order
    assert torch.equal(grid_sources(out.patch_to_token[-1], out.tokens.shape[1] - 1), source[:, 1:])
    assert out.token_sizes is not None and torch.equal(out.token_sizes[:, 1:], source[:, 1:].sum(-1))
    with torch.no_grad():  # batch 1 merges by one-hot products (fewer calls): the same numbers
        one = model.forward_detailed(x[1:2])
    assert (one.logits - expected[1:2]).abs().max() <= 1e-12
    assert torch.equal(grid_sources(one.patch_to_token[-1], one.tokens.shape[1] - 1), source[1:2, 1:])


def test_counts_as_the_authors() -> None:
    assert mctf_count(16, 197, 1) == 16 and mctf_count(0.35, 197, 1) == 68 and mctf_count(16, 20, 1) == 9
    assert mctf_count(16, 12, 1) == 2  # N − r < 10: r = N − 10
    assert mctf_count(0, 197, 1) == 0 and mctf_count(5, 9, 1) == 0


def test_merged_rows_are_sums_by_hand() -> None:
    t = torch.arange(12.0).view(1, 4, 3)  # rows 0..3
    keep, src, dest = torch.tensor([[0, 2]]), torch.tensor([[1, 3]]), torch.tensor([[1, 1]])
    expected = torch.stack([t[0, 0], t[0, 2] + t[0, 1] + t[0, 3]])[None]
    assert torch.equal(merge_rows(t, keep, src, dest), expected)
    assert torch.equal(merge_columns(t.transpose(1, 2), keep, src, dest), expected.transpose(1, 2))
    heads = torch.stack([t, 10 * t], dim=1)  # (1, 2, 4, 3): the same grouping in every head
    assert torch.equal(merge_rows(heads, keep, src, dest), torch.stack([expected, 10 * expected], dim=1))


def test_one_step_ahead_weights_still_sum_to_one_and_gradients_flow() -> None:
    model = vitrim.reduce.apply(tiny(img_size=64), "mctf", r=4).train()
    x = images(batch=2, size=64)
    out = model.forward_detailed(x, need_weights=True)
    assert out.attentions is not None and out.attentions[-1].shape[-1] == out.tokens.shape[1]
    torch.testing.assert_close(out.attentions[-1].sum(-1), torch.ones_like(out.attentions[-1][..., 0]))
    out.logits.sum().backward()
    assert model.blocks[1].attn.qkv.weight.grad is not None and model.blocks[1].attn.qkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("changes", [dict(reg_tokens=4), dict(class_token=False, global_pool="avg")], ids=str)
def test_prefix_tokens_are_never_merged(changes: dict) -> None:
    model = vitrim.reduce.apply(tiny(img_size=64, **changes), "mctf", r=6)  # with registers, prefix tokens in a and b
    with torch.no_grad():
        out = model.forward_detailed(images(size=64))
    p = out.tokens.shape[1] - out.patch_to_token[-1].amax() - 1  # prefix tokens left
    assert p == (5 if changes.get("reg_tokens") else 0) and out.tokens.shape[1] == p + 64 - 3 * 6
    sizes = out.token_sizes
    assert sizes is not None and torch.equal(sizes[:, :p], torch.ones_like(sizes[:, :p]))
    assert torch.equal(sizes[:, p:].sum(-1), torch.full((2,), 64.0))  # every patch in exactly one patch token


def test_refuses_bad_options() -> None:
    with pytest.raises(ValueError, match=r"one_step_ahead must be 1 .* got 0"):
        vitrim.reduce.apply(tiny(), "mctf", r=2, one_step_ahead=0)
    with pytest.raises(ValueError, match=r"pooling must be one of .*'max'"):
        vitrim.reduce.apply(tiny(), "mctf", r=2, pooling="max")
    with pytest.raises(ValueError, match=r"r must be an int >= 0 .* got -1"):
        vitrim.reduce.apply(tiny(), "mctf", r=-1)
    for r in (float("nan"), float("inf")):  # NaN fails every comparison: found by the options fuzz
        with pytest.raises(ValueError, match=rf"r must be an int >= 0 .* got {r}"):
            vitrim.reduce.apply(tiny(), "mctf", r=r)
    with pytest.raises(ValueError, match=r"tau_info must be a finite number >= 0 .* got nan"):
        vitrim.reduce.apply(tiny(), "mctf", r=2, tau_info=float("nan"))
    attn = tiny().blocks[0].attn
    weights = attn.attention_weights(torch.randn(1, 17, 32))
    with pytest.raises(ValueError, match=r"ahead weights must have shape \(1, 2, 5, 5\), got \(1, 2, 17, 17\)"):
        attn.attend(torch.randn(1, 5, 32), ahead=weights)
    with pytest.raises(ValueError, match=r"attend\(x, ahead=\.\.\.\) takes no context"):
        attn.attend(torch.randn(1, 17, 32), torch.randn(1, 3, 32), ahead=weights)

"""Zero-TPrune against an independent re-implementation of the paper's forward, on the same weights in float64; the
Weighted PageRank and the S-stage against hand computations; counts, identity settings and errors."""

from __future__ import annotations

import pytest
import torch
from reduce_models import images, tiny
from zero_tprune_reference import zero_tprune_forward

import vitrim
from vitrim.reduce.zero_tprune import weighted_page_rank, zero_tprune_keep


@pytest.mark.parametrize(
    ("layers", "keep_rate", "options"),
    [
        ((1, 3), (0.5, 0.6), {}),  # EIR heads, half of the removed tokens by similarity
        ((0, 2), (0.7, 0.7), {"similarity_share": 0.0, "head_aggregation": "mean", "iterations": 5}),  # I-stage only
        ((0, 1, 2), (0.8, 0.6, 0.5), {"similarity_share": 1.0, "iterations": 1}),  # S-stage only
    ],
)
def test_matches_the_papers_forward(layers: tuple[int, ...], keep_rate: tuple[float, ...], options: dict) -> None:
    model = tiny().double()
    x = images(batch=3).double()
    expected, kept = zero_tprune_forward(
        x,
        model.state_dict(),
        heads=2,
        depth=4,
        keep_rates=dict(zip(layers, keep_rate)),
        share=options.get("similarity_share", 0.5),
        iterations=options.get("iterations", 30),
        how=options.get("head_aggregation", "eir"),
    )
    with torch.no_grad():
        out = vitrim.reduce.apply(model, "zero_tprune", layers=layers, keep_rate=keep_rate, **options).forward_detailed(
            x
        )
    assert (out.logits - expected).abs().max() <= 1e-10
    assert len(out.kept_indices) == len(kept) == len(layers)
    for got, want in zip(out.kept_indices, kept):
        assert torch.equal(got, want)  # the same tokens, in the same order


def test_weighted_page_rank_reaches_the_stationary_distribution() -> None:
    # A two-token chain: π = πA gives π = (5/6, 1/6); one step from uniform gives the column means of A.
    attn = torch.tensor([[0.9, 0.1], [0.5, 0.5]], dtype=torch.float64).expand(1, 1, 2, 2)
    torch.testing.assert_close(weighted_page_rank(attn, 1)[0, 0], torch.tensor([0.7, 0.3], dtype=torch.float64))
    torch.testing.assert_close(weighted_page_rank(attn, 200)[0, 0], torch.tensor([5 / 6, 1 / 6], dtype=torch.float64))


def test_the_s_stage_drops_the_candidate_most_like_the_important_ones() -> None:
    # n = 6, k = 3, share 0.5: r = 3, r_S = 1, r_I = 2: tokens 5 and 4 (least important) go by importance; of the
    # 4 survivors (0, 1, 2, 3 by importance) the best two are kept, and of 2 and 3 the one closer to 0 or 1 goes.
    importance = torch.tensor([[0.6, 0.5, 0.4, 0.3, 0.2, 0.1]])
    metric = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [1.0, -1.0], [1.0, 0.0], [0.0, 1.0]]])
    assert zero_tprune_keep(importance, metric, 3, 0.5).tolist() == [[0, 1, 3]]  # 2 is almost token 0
    assert zero_tprune_keep(importance, metric, 3, 0.0).tolist() == [[0, 1, 2]]  # importance only
    # share 1: r_S = min(3, k = 3) = 3, no I-stage: the best 3 of the 6 stay, all 3 candidates go
    assert zero_tprune_keep(importance, metric, 3, 1.0).tolist() == [[0, 1, 2]]


def test_counts_per_block_and_prefix_tokens() -> None:
    model = vitrim.reduce.apply(tiny(), "zero_tprune", keep_rate=0.7, layers=(1, 2, 3))
    with torch.no_grad():
        out = model.forward_detailed(images(), need_weights=True)
    # 16 -> ceil(11.2) = 12 -> ceil(8.4) = 9 -> ceil(6.3) = 7 patch tokens, after blocks 1, 2, 3
    assert [a.shape[-1] for a in out.attentions] == [17, 17, 13, 10]
    assert [k.shape[1] for k in out.kept_indices] == [12, 9, 7] and out.tokens.shape[1] == 8
    vitrim.reduce.remove(model)
    vitrim.reduce.apply(model, "zero_tprune", keep_count=[10, 4], layers=(0, 2))
    with torch.no_grad():
        out = model.forward_detailed(images())
    assert [k.shape[1] for k in out.kept_indices] == [10, 4]
    # registers and no [CLS]: every prefix token stays, the ranking needs no [CLS]
    torch.manual_seed(0)
    reg = vitrim.create_model(
        "vit_small_patch14_reg4_dinov2", embed_dim=32, depth=4, num_heads=2, num_classes=5, img_size=56
    ).eval()
    vitrim.reduce.apply(reg, "zero_tprune", keep_rate=0.5, layers=(1,))
    with torch.no_grad():
        out = reg.forward_detailed(torch.randn(2, 3, 56, 56))
    assert out.tokens.shape[1] == 5 + 8 and torch.isfinite(out.logits).all()
    gap = vitrim.create_model("vit_medium_patch16_gap_256", embed_dim=32, depth=2, num_heads=2, img_size=64).eval()
    vitrim.reduce.apply(gap, "zero_tprune", keep_rate=0.5, layers=(0,))
    with torch.no_grad():
        assert gap.forward_detailed(torch.randn(1, 3, 64, 64)).tokens.shape[1] == 8


def test_identity_options_are_exactly_dense() -> None:
    model = tiny()
    x = images()
    with torch.no_grad():
        dense = model(x)
        vitrim.reduce.apply(model, "zero_tprune", keep_rate=1.0, layers=(0, 1, 2, 3))
        assert torch.equal(model(x), dense)
        vitrim.reduce.remove(model)
        vitrim.reduce.apply(model, "zero_tprune", keep_count=16, layers=(0, 1, 2, 3))
        assert torch.equal(model(x), dense)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keep_rate": 0.0}, r"keep_rate must be a number in \(0, 1\].*0\.0"),
        ({"keep_count": 0}, r"keep_count must be an int >= 1.*0"),
        ({"similarity_share": 1.5}, r"similarity_share must be a number in \[0, 1\].*1\.5"),
        ({"iterations": 0}, r"iterations must be an int >= 1.*0"),
        ({"head_aggregation": "max"}, r"head_aggregation must be one of \('eir', 'mean'\), got 'max'"),
        ({"keep_rate": (0.5, 0.7), "layers": (1,)}, r"keep_rate must be one value or one per reducing block \(1"),
    ],
)
def test_bad_options_raise_clear_errors(options: dict[str, object], message: str) -> None:
    model = tiny()
    with pytest.raises(ValueError, match=message):
        vitrim.reduce.apply(model, "zero_tprune", **options)
    assert all(block.reducer is None for block in model.blocks)

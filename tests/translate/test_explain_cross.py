"""``vitrim explain --cross``: every printed number against a float64 hand computation and against torch's SDPA."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitrim
from explain_output import printed_matrices
from vitrim.cli import main
from vitrim.viz.explain_cross import STEPS, explain_cross_numbers, format_cross_explanation, plot_cross_explanation


@pytest.fixture(scope="module")
def ex():
    return explain_cross_numbers(seed=5)


def hand_steps(ex) -> dict[str, np.ndarray]:
    """Every matrix from the embeddings and weights, with numpy and loops where the formula has a sum."""
    Xt, Xs, W_Q, W_K, W_V = (getattr(ex, n).double().numpy() for n in ("X_tgt", "X_src", "W_Q", "W_K", "W_V"))
    Lt, Ls, d = Xt.shape[0], Xs.shape[0], W_Q.shape[1]
    Q, K, V = Xt @ W_Q, Xs @ W_K, Xs @ W_V
    P = np.array([[sum(Q[i, e] * K[j, e] for e in range(d)) for j in range(Ls)] for i in range(Lt)])
    mask = np.array([[ex.source[j] != "<pad>" for j in range(Ls)] for _ in range(Lt)])  # padding only
    logits = np.where(mask, P / math.sqrt(d), -np.inf)
    A = np.zeros((Lt, Ls))
    for i in range(Lt):
        exps = [math.exp(logits[i, j]) if mask[i, j] else 0.0 for j in range(Ls)]
        A[i] = np.array(exps) / sum(exps)
    return dict(X_tgt=Xt, X_src=Xs, W_Q=W_Q, W_K=W_K, W_V=W_V, Q=Q, K=K, V=V, P=P, P_scaled=P / math.sqrt(d),
                mask=mask, logits=logits, A=A, out=A @ V)  # fmt: skip


def test_every_step_equals_the_hand_computation(ex) -> None:
    hand = hand_steps(ex)
    for name, _, _, _ in STEPS:
        np.testing.assert_allclose(getattr(ex, name).double().numpy(), hand[name], atol=1e-5, err_msg=name)


def test_shapes_are_target_by_source_and_rows_sum_to_one(ex) -> None:
    Lt, Ls = len(ex.target), len(ex.source)
    assert (Lt, Ls) == (4, 5)
    assert ex.Q.shape == (Lt, ex.d) and ex.K.shape == (Ls, ex.d) and ex.A.shape == (Lt, Ls)
    torch.testing.assert_close(ex.A.sum(-1), torch.ones(Lt))
    assert float(ex.A[:, -1].abs().sum()) == 0.0  # the padded source position gets nothing
    assert bool((ex.A[:, :-1] > 0).all())  # no causal mask: every target word sees every real source word


def test_the_matrix_is_what_vitrims_and_torchs_attention_compute(ex) -> None:
    mask = ex.mask  # (Lt, Ls) True = may attend
    ours, weights = vitrim.scaled_dot_product_attention(ex.Q, ex.K, ex.V, mask, need_weights=True)
    torch.testing.assert_close(weights, ex.A, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours, ex.out, atol=1e-6, rtol=0)
    theirs = F.scaled_dot_product_attention(ex.Q[None], ex.K[None], ex.V[None], attn_mask=mask[None])[0]
    torch.testing.assert_close(theirs, ex.out, atol=1e-6, rtol=0)


def test_printed_numbers_are_the_computed_ones(ex) -> None:
    text = format_cross_explanation(ex)
    printed = printed_matrices(text)
    hand = hand_steps(ex)
    assert set(printed) == {name for name, _, _, _ in STEPS}
    for name, matrix in printed.items():
        np.testing.assert_allclose(matrix, hand[name].astype(float), atol=6e-4, err_msg=name)
    assert "row sums of A: 1.000000 1.000000 1.000000 1.000000" in text
    assert "queries come from the target, keys and values from the source" in text.lower()


def test_cli_prints_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cross.png"
    assert main(["explain", "--cross", "--seed", "5", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Cross-attention, step by step")
    assert printed_matrices(text)["A"].shape == (4, 5)
    assert out.stat().st_size > 10_000
    assert main(["explain", "--seed", "5"]) == 0  # plain explain is still self-attention
    assert capsys.readouterr().out.startswith("Attention, step by step")


def test_figure_has_a_panel_per_step(ex) -> None:
    fig = plot_cross_explanation(ex)
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert len(titled) == len(STEPS)
    a_panel = next(ax for ax in titled if ax.get_title().startswith("A = softmax"))
    assert [t.get_text() for t in a_panel.get_xticklabels()] == list(ex.source)
    assert [t.get_text() for t in a_panel.get_yticklabels()] == list(ex.target)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="num_padding must be an int in \\[0, 5\\) for 5 source words, got 5"):
        explain_cross_numbers(num_padding=5)
    with pytest.raises(ValueError, match="d must be an int >= 1, got 0"):
        explain_cross_numbers(d=0)

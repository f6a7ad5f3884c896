"""``vitrim explain``: every printed number against a float64 hand computation from the same inputs."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from explain_output import printed_matrices
from vitrim.cli import main
from vitrim.viz import explain_numbers, format_explanation, plot_explanation
from vitrim.viz.explain import STEPS


@pytest.fixture(scope="module")
def ex():
    return explain_numbers(seed=3)


def hand_steps(ex) -> dict[str, np.ndarray]:
    """Every matrix of the walk-through from X and the W's, with numpy, loops where the formula has a sum."""
    X, W_Q, W_K, W_V = (getattr(ex, n).double().numpy() for n in ("X", "W_Q", "W_K", "W_V"))
    L, d = X.shape[0], W_Q.shape[1]
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    P = np.array([[sum(Q[i, e] * K[j, e] for e in range(d)) for j in range(L)] for i in range(L)])
    causal = np.array([[j <= i for j in range(L)] for i in range(L)])
    padding = np.array([[j != L - 1 for j in range(L)] for _ in range(L)])  # the last word is padding
    mask = causal & padding
    logits = np.where(mask, P / math.sqrt(d), -np.inf)
    A = np.zeros((L, L))
    for i in range(L):
        exps = [math.exp(logits[i, j]) if mask[i, j] else 0.0 for j in range(L)]
        A[i] = np.array(exps) / sum(exps)
    return dict(
        X=X, W_Q=W_Q, W_K=W_K, W_V=W_V, Q=Q, K=K, V=V, P=P, P_scaled=P / math.sqrt(d),
        causal_mask=causal, padding_mask=padding, mask=mask, logits=logits, A=A, out=A @ V,
    )  # fmt: skip


def printed_scaling_table(text: str) -> np.ndarray:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[scaling]")) + 2
    rows = []
    for line in lines[start:]:
        if not re.match(r"^\s+\d+\s", line):
            break
        rows.append([float(v) for v in line.split()])
    return np.array(rows)  # columns: d, var, var scaled, max weight, max weight scaled


def test_every_matrix_equals_the_hand_computation(ex):
    hand = hand_steps(ex)
    for name, _, _ in STEPS:
        ours = getattr(ex, name).double().numpy() if name not in ("causal_mask", "padding_mask", "mask") else None
        if ours is None:
            np.testing.assert_array_equal(getattr(ex, name).numpy(), hand[name], err_msg=name)
        else:
            np.testing.assert_allclose(ours, hand[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_softmax_rows_sum_to_one_and_masked_entries_are_exactly_zero(ex):
    np.testing.assert_allclose(ex.A.sum(-1).numpy(), np.ones(4), atol=1e-6)
    assert bool((ex.A[~ex.mask] == 0).all())
    assert bool((ex.logits[~ex.mask] == -math.inf).all())
    assert bool((ex.A[ex.mask] > 0).all())
    assert ex.A[0, 0] == 1.0  # "I" may only look at itself


def test_every_printed_number_matches_the_hand_computation(ex):
    text = format_explanation(ex)
    printed = printed_matrices(text)
    hand = hand_steps(ex)
    assert set(printed) == {name for name, _, _ in STEPS}
    for name, values in printed.items():
        expected = hand[name].astype(float)
        assert values.shape == expected.shape, name
        np.testing.assert_allclose(values, expected, atol=5.1e-4, rtol=0, err_msg=name)  # printed to 3 decimals
    for name, (rows, cols) in {"X": (4, 8), "W_Q": (8, 4), "Q": (4, 4), "P": (4, 4), "out": (4, 4)}.items():
        assert re.search(rf"^\[{name}\] .* shape \({rows}, {cols}\)$", text, flags=re.M), name


def test_variance_grows_like_d_and_scaling_keeps_it_near_one(ex):
    table = printed_scaling_table(format_explanation(ex))
    assert table[:, 0].tolist() == list(ex.d_values)
    for i, d in enumerate(ex.d_values):
        q = ex.queries[i].double().numpy()  # (T, d)
        k = ex.keys[i].double().numpy()  # (T, J, d)
        dots = np.einsum("td,tjd->tj", q, k).ravel()
        var = dots.var(ddof=1)
        var_scaled = (dots / math.sqrt(d)).var(ddof=1)
        logits = np.einsum("td,tjd->tj", q, k)

        def mean_max_softmax(z):
            e = np.exp(z - z.max(-1, keepdims=True))
            return (e / e.sum(-1, keepdims=True)).max(-1).mean()

        expected_row = [d, var, var_scaled, mean_max_softmax(logits), mean_max_softmax(logits / math.sqrt(d))]
        np.testing.assert_allclose(table[i, 1:], expected_row[1:], atol=5.1e-4 * max(1.0, var / 100), rtol=1e-5)
        np.testing.assert_allclose(ex.var_unscaled[i].item(), var, rtol=1e-4)
        # the statistics themselves: 4000 dot products, so the sample variance is within ~15% of d (4+ sigma)
        assert 0.85 * d < var < 1.15 * d, (d, var)
        assert 0.85 < var_scaled < 1.15, (d, var_scaled)
    assert ex.max_weight_unscaled[-1] > 0.9  # unscaled, d = 1024: one key takes (nearly) everything
    assert ex.max_weight_scaled.max() < 0.5  # scaled: no saturation at any d
    assert bool((ex.max_weight_unscaled.diff() > 0).all())  # saturation grows with d


def test_seed_makes_it_deterministic():
    a, b, c = explain_numbers(seed=5), explain_numbers(seed=5), explain_numbers(seed=6)
    assert format_explanation(a) == format_explanation(b)
    assert not np.allclose(a.X.numpy(), c.X.numpy())


def test_bad_arguments_are_rejected_before_compute():
    with pytest.raises(ValueError, match="num_padding must be an int in \\[0, 4\\)"):
        explain_numbers(num_padding=4)
    with pytest.raises(ValueError, match="d must be an int >= 1, got 0"):
        explain_numbers(d=0)
    with pytest.raises(TypeError, match="seed must be an int"):
        explain_numbers(seed=1.5)  # type: ignore[arg-type]


def test_cli_prints_the_same_numbers_and_writes_a_png(tmp_path, capsys):
    out = tmp_path / "explain.png"
    assert main(["explain", "--seed", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    printed = printed_matrices(text)
    hand = hand_steps(explain_numbers(seed=3))
    np.testing.assert_allclose(printed["A"], hand["A"], atol=5.1e-4, rtol=0)
    np.testing.assert_allclose(printed["out"], hand["out"], atol=5.1e-4, rtol=0)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_missing_output_folder_exits_2(tmp_path, capsys):
    assert main(["explain", "--out", str(tmp_path / "no" / "such" / "x.png")]) == 2
    assert capsys.readouterr().err.startswith("vitrim: error:")


def test_plot_has_a_panel_per_step(ex):
    fig = plot_explanation(ex)
    titles = [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("A = softmax") for t in titles) and any("variance" in t for t in titles)

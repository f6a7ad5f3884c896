"""``vitrim explain``: one attention matrix computed by hand, step by step, and why we divide by √d.

The numbers are computed once by :func:`explain_numbers` (a dataclass of tensors); :func:`format_explanation`
prints them and :func:`plot_explanation` draws them, both reading only from that dataclass, so what is shown is
exactly what was computed (the tests recompute every printed number by hand).

The walk-through, on four tokens ("I go to school"), d_model = 8 and d = 4:

    X (4, 8)  ->  Q = X W_Q, K = X W_K, V = X W_V (4, 4)  ->  P = Q Kᵀ (4, 4)  ->  P / √d
    -> + mask (−∞ where a query may not look: causal, and the last word treated as padding)
    -> A = softmax by row (each row sums to 1; masked entries exactly 0)  ->  A · V (4, 4)

The √d argument: for q, k with independent N(0, 1) entries, var(q·k) = d, so the logits grow like √d and the
softmax saturates (one weight near 1, the gradient near 0); var(q·k / √d) = 1 whatever d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vitrim.viz.maps import colormap, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WORDS = ("I", "go", "to", "school")
D_VALUES = (1, 4, 16, 64, 256, 1024)


@dataclass(frozen=True)
class Explanation:
    """Every number of the walk-through. Matrices are float32 tensors; masks are bool (True = may attend)."""

    words: tuple[str, ...]
    seed: int
    X: Tensor  # (L, d_model) one embedding per word
    W_Q: Tensor  # (d_model, d)
    W_K: Tensor  # (d_model, d)
    W_V: Tensor  # (d_model, d)
    Q: Tensor  # (L, d)
    K: Tensor  # (L, d)
    V: Tensor  # (L, d)
    P: Tensor  # (L, L) Q Kᵀ
    P_scaled: Tensor  # (L, L) P / √d
    causal_mask: Tensor  # (L, L) bool: query i sees keys 0 … i
    padding_mask: Tensor  # (L, L) bool: no query sees a padding key
    mask: Tensor  # (L, L) bool: causal and padding
    logits: Tensor  # (L, L) P / √d with −∞ where masked
    A: Tensor  # (L, L) softmax by row
    out: Tensor  # (L, d) A · V
    d_values: tuple[int, ...] = ()
    queries: list[Tensor] = field(default_factory=list)  # per d: (T, d) random queries
    keys: list[Tensor] = field(default_factory=list)  # per d: (T, J, d) random keys, J per query
    var_unscaled: Tensor = field(default_factory=lambda: torch.empty(0))  # (len(d_values),) var of q·k
    var_scaled: Tensor = field(default_factory=lambda: torch.empty(0))  # var of q·k / √d
    max_weight_unscaled: Tensor = field(default_factory=lambda: torch.empty(0))  # mean largest softmax(q·k)
    max_weight_scaled: Tensor = field(default_factory=lambda: torch.empty(0))  # mean largest softmax(q·k / √d)

    @property
    def d(self) -> int:
        return self.Q.shape[-1]


def explain_numbers(
    seed: int = 0,
    *,
    words: tuple[str, ...] = WORDS,
    d_model: int = 8,
    d: int = 4,
    num_padding: int = 1,
    d_values: tuple[int, ...] = D_VALUES,
    num_queries: int = 500,
    num_keys: int = 8,
) -> Explanation:
    """Compute the walk-through (module doc). Deterministic for a given ``seed`` (its own generator).

    ``num_padding``: how many trailing words the padding mask treats as padding. For the √d argument, each d
    draws ``num_queries`` queries and ``num_keys`` keys per query, all entries N(0, 1); variances are unbiased
    (n − 1) over all num_queries · num_keys dot products; a max weight is the largest of one query's num_keys
    softmax weights, averaged over the queries.
    """
    L = len(words)
    for name, value, low in (
        ("d_model", d_model, 1),
        ("d", d, 1),
        ("num_queries", num_queries, 2),
        ("num_keys", num_keys, 2),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if L == 0:
        raise ValueError("words must not be empty")
    if isinstance(num_padding, bool) or not isinstance(num_padding, int) or not 0 <= num_padding < L:
        raise ValueError(f"num_padding must be an int in [0, {L}) for {L} words, got {num_padding!r}")
    if not d_values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in d_values):
        raise ValueError(f"d_values must be positive ints, got {d_values!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")

    g = torch.Generator().manual_seed(seed)
    X = torch.randn(L, d_model, generator=g)  # (L, d_model)
    # 1/√d_model keeps Q, K, V near unit scale, as a trained layer's init would
    W_Q, W_K, W_V = (torch.randn(d_model, d, generator=g) / math.sqrt(d_model) for _ in range(3))
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V  # (L, d)
    P = Q @ K.T  # (L, L)
    P_scaled = P / math.sqrt(d)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    padding = torch.ones(L, L, dtype=torch.bool)
    padding[:, L - num_padding :] = False
    mask = causal & padding
    logits = P_scaled.masked_fill(~mask, float("-inf"))
    A = torch.softmax(logits, dim=-1)  # every row keeps key 0, so no row is all −∞
    out = A @ V

    queries, keys = [], []
    var_unscaled, var_scaled, max_unscaled, max_scaled = [], [], [], []
    for dv in d_values:
        q = torch.randn(num_queries, dv, generator=g)  # (T, d)
        k = torch.randn(num_queries, num_keys, dv, generator=g)  # (T, J, d)
        dots = torch.einsum("td,tjd->tj", q, k)  # (T, J)
        queries.append(q)
        keys.append(k)
        var_unscaled.append(dots.var())
        var_scaled.append((dots / math.sqrt(dv)).var())
        max_unscaled.append(torch.softmax(dots, -1).amax(-1).mean())
        max_scaled.append(torch.softmax(dots / math.sqrt(dv), -1).amax(-1).mean())

    return Explanation(
        words=tuple(words),
        seed=seed,
        X=X,
        W_Q=W_Q,
        W_K=W_K,
        W_V=W_V,
        Q=Q,
        K=K,
        V=V,
        P=P,
        P_scaled=P_scaled,
        causal_mask=causal,
        padding_mask=padding,
        mask=mask,
        logits=logits,
        A=A,
        out=out,
        d_values=tuple(d_values),
        queries=queries,
        keys=keys,
        var_unscaled=torch.stack(var_unscaled),
        var_scaled=torch.stack(var_scaled),
        max_weight_unscaled=torch.stack(max_unscaled),
        max_weight_scaled=torch.stack(max_scaled),
    )


# name in the Explanation, the formula shown, whether rows are words
STEPS = (
    ("X", "X: one embedding per word", True),
    ("W_Q", "W_Q: query projection (learned)", False),
    ("W_K", "W_K: key projection (learned)", False),
    ("W_V", "W_V: value projection (learned)", False),
    ("Q", "Q = X · W_Q", True),
    ("K", "K = X · W_K", True),
    ("V", "V = X · W_V", True),
    ("P", "P = Q · Kᵀ   (row: query, column: key)", True),
    ("P_scaled", "P / √d   (keeps the logits' variance near 1, see the table below)", True),
    ("causal_mask", "causal mask: 1 = may attend (query i sees keys 0 … i)", True),
    ("padding_mask", "padding mask: the last word stands for padding, nobody may attend to it", True),
    ("mask", "mask = causal and padding", True),
    ("logits", "P / √d + mask   (−∞ where masked)", True),
    ("A", "A = softmax by row   (each row sums to 1; masked entries are exactly 0)", True),
    ("out", "output = A · V", True),
)
KEY_COLUMNS = {"P", "P_scaled", "causal_mask", "padding_mask", "mask", "logits", "A"}  # columns are keys (words)


def format_matrix(name: str, title: str, matrix: Tensor, row_labels: list[str], col_labels: list[str]) -> str:
    """``[name] title  shape (r, c)`` then one line per row: its label and its numbers (3 decimals, or 0/1)."""
    lines = [f"[{name}] {title}   shape {tuple(matrix.shape)}"]
    width = max(len(label) for label in row_labels)
    lines.append(" " * width + "".join(f"{c:>9}" for c in col_labels))
    for label, row in zip(row_labels, matrix.tolist()):
        if matrix.dtype == torch.bool:
            cells = "".join(f"{int(v):>9d}" for v in row)
        else:
            cells = "".join(f"{v:>9.3f}" if math.isfinite(v) else f"{'-inf':>9}" for v in row)
        lines.append(f"{label:>{width}}{cells}")
    return "\n".join(lines)


def format_explanation(ex: Explanation) -> str:
    """The terminal text of ``vitrim explain``: every step with its shape, then the √d table."""
    words = list(ex.words)
    parts = [
        f'Attention, step by step, on "{" ".join(words)}" (seed {ex.seed}, d_model = {ex.X.shape[1]}, '
        f"d = {ex.d}, √d = {math.sqrt(ex.d):.3f})"
    ]
    for name, title, by_word in STEPS:
        matrix = getattr(ex, name)
        rows = words if by_word else [str(i) for i in range(matrix.shape[0])]
        col_labels = words if name in KEY_COLUMNS else [f"c{j}" for j in range(matrix.shape[1])]
        parts.append(format_matrix(name, title, matrix, rows, col_labels))
    sums = " ".join(f"{s:.6f}" for s in ex.A.sum(-1).tolist())
    parts.append(f"row sums of A: {sums}")
    T, J = ex.keys[0].shape[:2] if ex.keys else (0, 0)
    table = [
        f"[scaling] why √d: q, k with N(0, 1) entries, {T} queries × {J} keys for each d",
        f"{'d':>6}{'var(q·k)':>12}{'var(q·k/√d)':>14}{'max weight':>13}{'max w. /√d':>13}",
    ]
    for i, dv in enumerate(ex.d_values):
        table.append(
            f"{dv:>6d}{ex.var_unscaled[i].item():>12.3f}{ex.var_scaled[i].item():>14.3f}"
            f"{ex.max_weight_unscaled[i].item():>13.3f}{ex.max_weight_scaled[i].item():>13.3f}"
        )
    table.append(
        "var(q·k) grows like d; divided by √d it stays near 1. Unscaled, the largest of "
        f"{J} softmax weights goes to 1 (saturation: vanishing gradients); scaled, it does not depend on d."
    )
    parts.append("\n".join(table))
    return "\n\n".join(parts)


def plot_explanation(ex: Explanation) -> Figure:
    """One figure: a heat map (with its numbers) per step, then var(q·k) and the largest weight against d."""
    fig = new_figure((16, 15))
    axes = fig.subplots(4, 4)
    words = list(ex.words)
    for ax, (name, title, by_word) in zip(axes.flat, [s for s in STEPS if s[0] not in ("causal_mask", "padding_mask")]):
        matrix = getattr(ex, name).float()
        shown = torch.where(torch.isfinite(matrix), matrix, torch.nan).numpy()
        cmap = colormap("Greys" if name == "mask" else "viridis", bad=(0.85, 0.3, 0.3, 1.0))  # −∞: masked
        ax.imshow(shown, cmap=cmap, aspect="auto")
        for (i, j), value in _cells(matrix):
            text = "−∞" if not math.isfinite(value) else (f"{int(value)}" if name == "mask" else f"{value:.2f}")
            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if name != "mask" else "red")
        ax.set_title(f"{title.split('   ')[0]}  {tuple(matrix.shape)}", fontsize=8)
        ax.set_yticks(range(matrix.shape[0]), words if by_word else range(matrix.shape[0]), fontsize=7)
        ax.set_xticks(range(matrix.shape[1]), words if name in KEY_COLUMNS else range(matrix.shape[1]), fontsize=7)
    used = len(STEPS) - 2
    d = list(ex.d_values)
    ax = axes.flat[used]
    ax.loglog(d, ex.var_unscaled.numpy(), "o-", label="var(q·k)")
    ax.loglog(d, ex.var_scaled.numpy(), "s-", label="var(q·k / √d)")
    ax.loglog(d, d, ":", color="grey", label="d")
    ax.set_xlabel("d")
    ax.set_title("variance of the logits", fontsize=8)
    ax.legend(fontsize=7)
    ax = axes.flat[used + 1]
    ax.semilogx(d, ex.max_weight_unscaled.numpy(), "o-", label="softmax(q·k)")
    ax.semilogx(d, ex.max_weight_scaled.numpy(), "s-", label="softmax(q·k / √d)")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("d")
    ax.set_title(f"largest of {ex.keys[0].shape[1] if ex.keys else 0} weights (mean)", fontsize=8)
    ax.legend(fontsize=7)
    for ax in axes.flat[used + 2 :]:
        ax.set_axis_off()
    fig.suptitle(f'Attention on "{" ".join(words)}", step by step (seed {ex.seed})', fontsize=11)
    return fig


def _cells(matrix: Tensor) -> list[tuple[tuple[int, int], float]]:
    return [((i, j), float(v)) for i, row in enumerate(matrix.tolist()) for j, v in enumerate(row)]

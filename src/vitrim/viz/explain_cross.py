"""``vitrim explain --cross``: one cross-attention matrix by hand, the decoder's view of the source sentence.

Self-attention (``vitrim explain``) relates the words of one sequence to each other. Cross-attention relates two:
the queries come from the sentence being written (the target), the keys and values from the sentence being read
(the source), so the matrix is target × source and need not be square:

    X_tgt (Lt, d_model), X_src (Ls, d_model)
    -> Q = X_tgt W_Q (Lt, d), K = X_src W_K (Ls, d), V = X_src W_V (Ls, d)
    -> P = Q Kᵀ (Lt, Ls) -> P / √d -> + padding mask (a padded source position is −∞ for every target word)
    -> A = softmax by row: row i says how target word i spreads its attention over the source words; sums to 1
    -> A · V (Lt, d): for each target word, a mixture of the source words' values

No causal mask: the whole source sentence is known before the first target word is written, so every target word
may look at every source word (the decoder's *self*-attention is the one that is causal). The words are the seed
notes' example, "I go to school" -> "मैं स्कूल जाता हूँ" (drawn in Latin letters: main skool jaata hoon), with one
padding position after the source, as in a batch of sentences of different lengths. Embeddings and weights are
random (seeded), as in ``vitrim explain``: this shows the mechanics; a trained model's matrix is what
``vitrim translate --show-attention`` draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vitrim.viz.explain import format_matrix
from vitrim.viz.maps import colormap, new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SOURCE_WORDS = ("I", "go", "to", "school", "<pad>")
TARGET_WORDS = ("main", "skool", "jaata", "hoon")  # मैं स्कूल जाता हूँ
TARGET_SCRIPT = "मैं स्कूल जाता हूँ"


@dataclass(frozen=True)
class CrossExplanation:
    """Every number of the walk-through; masks are bool (True = may attend)."""

    source: tuple[str, ...]
    target: tuple[str, ...]
    seed: int
    X_src: Tensor  # (Ls, d_model)
    X_tgt: Tensor  # (Lt, d_model)
    W_Q: Tensor  # (d_model, d)
    W_K: Tensor  # (d_model, d)
    W_V: Tensor  # (d_model, d)
    Q: Tensor  # (Lt, d) from the target
    K: Tensor  # (Ls, d) from the source
    V: Tensor  # (Ls, d) from the source
    P: Tensor  # (Lt, Ls) Q Kᵀ
    P_scaled: Tensor  # (Lt, Ls) P / √d
    mask: Tensor  # (Lt, Ls) padding only: no source padding is seen, nothing else is hidden
    logits: Tensor  # (Lt, Ls) with −∞ where masked
    A: Tensor  # (Lt, Ls) softmax by row
    out: Tensor  # (Lt, d) A · V

    @property
    def d(self) -> int:
        return self.Q.shape[-1]


def explain_cross_numbers(
    seed: int = 0,
    *,
    source: tuple[str, ...] = SOURCE_WORDS,
    target: tuple[str, ...] = TARGET_WORDS,
    d_model: int = 8,
    d: int = 4,
    num_padding: int = 1,
) -> CrossExplanation:
    """Compute the walk-through (module doc), deterministic for ``seed``; the last ``num_padding`` source words
    are padding."""
    for name, value in (("d_model", d_model), ("d", d)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not source or not target:
        raise ValueError(f"source and target must not be empty, got {source!r} and {target!r}")
    if isinstance(num_padding, bool) or not isinstance(num_padding, int) or not 0 <= num_padding < len(source):
        raise ValueError(f"num_padding must be an int in [0, {len(source)}) for {len(source)} source words, got "
                         f"{num_padding!r}")  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    X_src = torch.randn(len(source), d_model, generator=g)  # (Ls, d_model)
    X_tgt = torch.randn(len(target), d_model, generator=g)  # (Lt, d_model)
    W_Q, W_K, W_V = (torch.randn(d_model, d, generator=g) / math.sqrt(d_model) for _ in range(3))
    Q, K, V = X_tgt @ W_Q, X_src @ W_K, X_src @ W_V  # (Lt, d), (Ls, d), (Ls, d)
    P = Q @ K.T  # (Lt, Ls)
    P_scaled = P / math.sqrt(d)
    mask = torch.ones(len(target), len(source), dtype=torch.bool)
    mask[:, len(source) - num_padding :] = False
    logits = P_scaled.masked_fill(~mask, float("-inf"))
    A = torch.softmax(logits, dim=-1)  # every row keeps the real source words, so no row is all −∞
    return CrossExplanation(tuple(source), tuple(target), seed, X_src, X_tgt, W_Q, W_K, W_V, Q, K, V, P, P_scaled,
                            mask, logits, A, A @ V)  # fmt: skip


# name, title, rows (target / source / index), columns are source words
STEPS = (
    ("X_tgt", "X_tgt: one embedding per target word (the decoder's side)", "target", False),
    ("X_src", "X_src: one embedding per source word (the encoder's output)", "source", False),
    ("W_Q", "W_Q: query projection (learned)", "index", False),
    ("W_K", "W_K: key projection (learned)", "index", False),
    ("W_V", "W_V: value projection (learned)", "index", False),
    ("Q", "Q = X_tgt · W_Q   (queries from the target)", "target", False),
    ("K", "K = X_src · W_K   (keys from the source)", "source", False),
    ("V", "V = X_src · W_V   (values from the source)", "source", False),
    ("P", "P = Q · Kᵀ   (row: target word, column: source word; Lt × Ls, not square)", "target", True),
    ("P_scaled", "P / √d", "target", True),
    ("mask", "mask: 1 = may attend; only the source padding is hidden (no causal mask)", "target", True),
    ("logits", "P / √d + mask   (−∞ where masked)", "target", True),
    ("A", "A = softmax by row   (each row sums to 1: how one target word splits its attention)", "target", True),
    ("out", "output = A · V   (per target word, a mix of the source words' values)", "target", False),
)


def format_cross_explanation(ex: CrossExplanation) -> str:
    """The terminal text of ``vitrim explain --cross``: every step with its shape, then the row sums."""
    rows = {"target": list(ex.target), "source": list(ex.source)}
    parts = [
        f'Cross-attention, step by step: "{" ".join(w for w in ex.source if w != "<pad>")}" -> '
        f'"{TARGET_SCRIPT if ex.target == TARGET_WORDS else " ".join(ex.target)}" (seed {ex.seed}, '
        f"d_model = {ex.X_src.shape[1]}, d = {ex.d}, √d = {math.sqrt(ex.d):.3f}). Queries come from the target, "
        "keys and values from the source."
    ]
    for name, title, row_kind, source_columns in STEPS:
        matrix = getattr(ex, name)
        labels = rows.get(row_kind, [str(i) for i in range(matrix.shape[0])])
        columns = list(ex.source) if source_columns else [f"c{j}" for j in range(matrix.shape[1])]
        parts.append(format_matrix(name, title, matrix, labels, columns))
    sums = " ".join(f"{s:.6f}" for s in ex.A.sum(-1).tolist())
    best = ", ".join(f"{t} -> {ex.source[j]}" for t, j in zip(ex.target, ex.A.argmax(-1).tolist()))
    parts.append(
        f"row sums of A: {sums}\nlargest weight per target word: {best}\n"
        "(random weights: a trained translator's rows point at the aligned words; see `vitrim translate "
        "--show-attention`)"
    )
    return "\n\n".join(parts)


def plot_cross_explanation(ex: CrossExplanation) -> Figure:
    """One figure: a heat map (with its numbers) per step."""
    fig = new_figure((16, 12))
    axes = fig.subplots(4, 4)
    rows = {"target": list(ex.target), "source": list(ex.source)}
    for ax, (name, title, row_kind, source_columns) in zip(axes.flat, STEPS):
        matrix = getattr(ex, name).float()
        shown = torch.where(torch.isfinite(matrix), matrix, torch.nan).numpy()
        cmap = colormap("Greys" if name == "mask" else "viridis", bad=(0.85, 0.3, 0.3, 1.0))  # −∞: masked
        ax.imshow(shown, cmap=cmap, aspect="auto")
        for i, row in enumerate(matrix.tolist()):
            for j, value in enumerate(row):
                text = "−∞" if not math.isfinite(value) else (f"{int(value)}" if name == "mask" else f"{value:.2f}")
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="red" if name == "mask" else "white")
        ax.set_title(f"{title.split('   ')[0]}  {tuple(matrix.shape)}", fontsize=8)
        labels = rows.get(row_kind, [str(i) for i in range(matrix.shape[0])])
        ax.set_yticks(range(matrix.shape[0]), labels, fontsize=7)
        columns = list(ex.source) if source_columns else [str(j) for j in range(matrix.shape[1])]
        ax.set_xticks(range(matrix.shape[1]), columns, fontsize=7)
    for ax in axes.flat[len(STEPS) :]:
        ax.set_axis_off()
    fig.suptitle(
        f'Cross-attention "{" ".join(w for w in ex.source if w != "<pad>")}" -> "{" ".join(ex.target)}", step by '
        f"step (seed {ex.seed}): queries from the target, keys and values from the source",
        fontsize=11,
    )
    return fig

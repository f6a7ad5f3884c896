"""``vitrim demo``: the main job on bundled data. Until training lands, a short walk through one attention matrix."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from vitrim.attention import compute_attention, scaled_dot_product_attention


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the demo on bundled data (no downloads)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the toy embeddings")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    words = ["I", "go", "to", "school"]
    d = 8
    X = torch.randn(len(words), d)  # (4, d): one embedding per word
    W_Q, W_K, W_V = (torch.randn(d, d) / d**0.5 for _ in range(3))
    Q, K, V = X @ W_Q, X @ W_K, X @ W_V
    causal = torch.ones(4, 4).tril()  # 1 = visible: each word sees itself and the words before it
    out, A = compute_attention(Q, K, V, causal)
    print(f"attention of {words} (d = {d}, causal); rows are queries, columns keys")
    print("       " + "".join(f"{w:>8}" for w in words))
    for w, row in zip(words, A):
        print(f"{w:>7}" + "".join(f"{p:8.3f}" for p in row.tolist()))
    print("row sums:", [round(s, 6) for s in A.sum(-1).tolist()])
    fused, _ = scaled_dot_product_attention(Q, K, V, is_causal=True)
    reference = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    print(f"max |textbook - vitrim fused| = {(out - fused).abs().max():.2e}")
    print(f"max |textbook - torch SDPA|   = {(out - reference).abs().max():.2e}")
    return 0

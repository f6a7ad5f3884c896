"""A straightforward ToMe merge, one sample and one token at a time, written from the paper (no vitrim code).

Used only as the reference that vitrim's batched, loop-free merge is checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reference_merge(
    x: Tensor, metric: Tensor, sizes: Tensor, r: int, num_prefix: int
) -> tuple[Tensor, Tensor, list[list[list[int]]]]:
    """x (B, N, C), metric (B, N, Cm), sizes (B, N) -> merged x, sizes, and per sample the old tokens of each new one.

    Set a = even indices, set b = odd indices; prefix tokens take no part; each non-prefix a token picks its most
    cosine-similar non-prefix b token; the r best picks merge (size-weighted mean). New order: prefix, the a tokens
    left (by index), the non-prefix b tokens (by index).
    """
    out_x, out_sizes, out_groups = [], [], []
    for s in range(x.shape[0]):
        N = x.shape[1]
        r_s = min(r, (N - num_prefix) // 2)
        a_set = [i for i in range(num_prefix, N) if i % 2 == 0]
        b_set = [j for j in range(num_prefix, N) if j % 2 == 1]
        best: dict[int, tuple[float, int]] = {}
        for i in a_set:
            candidates = []
            for j in b_set:
                cos = torch.dot(metric[s, i], metric[s, j]) / (metric[s, i].norm() * metric[s, j].norm())
                candidates.append((float(cos), j))
            best[i] = max(candidates)
        merged_away = sorted(a_set, key=lambda i: -best[i][0])[:r_s]
        groups = [[i] for i in range(num_prefix)]
        groups += [[i] for i in a_set if i not in merged_away]
        for j in b_set:
            groups.append([j] + [i for i in merged_away if best[i][1] == j])
        new_x, new_sizes = [], []
        for members in groups:
            weight = sizes[s, members]
            new_x.append((x[s, members] * weight[:, None]).sum(0) / weight.sum())
            new_sizes.append(weight.sum())
        out_x.append(torch.stack(new_x))
        out_sizes.append(torch.stack(new_sizes))
        out_groups.append(groups)
    return torch.stack(out_x), torch.stack(out_sizes), out_groups

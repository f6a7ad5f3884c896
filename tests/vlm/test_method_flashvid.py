"""FlashVID (``flashvid`` before the LLM, ``flashvid_llm`` inside it): the kept tokens and merged embeddings equal a
re-implementation of the authors' code (Fanziyang-v/FlashVID: ``flashvid/utils.py``, ``token_selection.py``, their
Qwen2.5-VL tower's attention) written here from its facts, step for step in their order and their tensor shapes; on
the tiny Qwen2.5-VL (Qwen2-VL and Qwen3-VL in ``full``) the pick on the model equals it on the model's own merged
embeddings and the authors' attention (from the last block's own q/k), the LLM receives its merged embeddings and
equals the masked model, a padded batch of different clips equals each clip alone, keep-all is the unmodified model
bit for bit; the stacked in-LLM stage keeps ⌈N·r⌉ by the last token's attention one layer before."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from qwen_reference import last_block_query_key, videos_in_raster

import vitrim.vlm
from tiny_vlms.qwen import BUILDERS, MERGE, VIDEO
from tiny_vlms.qwen_video import (
    assert_batch_equals_each_alone,
    deepstack_group_means,
    dropped_media,
    masked_logits,
    media_tokens,
    video_batch,
)
from vitrim.vlm.method.flashvid import FlashVIDOptions, FlashVIDSelection, cluster_counts, flashvid_select

AUTHORS = dict(  # their Qwen2.5-VL script's, with their flashvid() default retention_ratio
    retention_ratio=0.25,
    expansion=1.25,
    alpha=0.7,
    token_selection_method="attn_div",
    temporal_threshold=0.8,
    do_segment=True,
    segment_threshold=0.9,
    min_segment_num=4,
    complementary_segment=True,
)
MIXED = [
    [[1, 5], ("image", (4, 6)), [7], ("video", (3, 4, 4)), [8, 9]],
    [[1], ("video", (2, 4, 6)), [6, 7], ("video", (4, 4, 4)), [9]],
]


# --- the authors' steps, as their code takes them (one video, batch 1) ---------------------------------------------


def authors_segments(means: torch.Tensor, o: dict) -> torch.Tensor:
    """Their ``segment`` + ``additional_segment``: segment lengths from the temporal patches' mean tokens (t, E)."""
    t = means.shape[0]
    normed = means / means.norm(p=2, dim=-1, keepdim=True)
    sims = torch.sum(normed[:-1] * normed[1:], dim=-1)
    cut = torch.where(sims < o["segment_threshold"])[0]
    if cut.numel() + 1 < o["min_segment_num"] and o["complementary_segment"]:
        sims[sims < o["segment_threshold"]] = 1.0
        extra = torch.topk(sims, k=min(o["min_segment_num"] - cut.numel() - 1, sims.shape[0]), largest=False).indices
        cut = torch.cat([cut, extra]).sort().values
    padded = F.pad(cut, (1, 1), value=0)
    padded[0] = -1
    padded[-1] = t - 1
    return torch.diff(padded)


def authors_selection(features: torch.Tensor, attn: torch.Tensor, k: int, method: str) -> torch.Tensor:
    """Their token selection over a batch of temporal patches (F, P, E): (F, k) sorted. v2 has no guard against a
    second pick of a token in their code; here it has the −1 guard v1 and div have (vitrim's stated difference)."""
    if method == "attn":
        return torch.topk(attn, k=k, dim=-1).indices.sort().values
    x = features.double()
    bsz, n, _ = x.shape
    normed = x / x.norm(p=2, dim=-1, keepdim=True)
    dist = 1.0 - torch.bmm(normed, normed.transpose(-1, -2))
    if method == "attn_div":
        dist = dist * (attn.double() * 1e6).unsqueeze(1)
    elif method == "attn_div_v2":
        pooled = x.mean(1)
        local = torch.einsum("b n d, c d -> b c n", x, pooled).mean(1)
        dist = dist * (attn.double() * 1e6).unsqueeze(1) * local.unsqueeze(1)
    keep = torch.zeros(bsz, k, dtype=torch.long)
    if k == 0:
        return keep
    keep[:, 0] = torch.argmax(torch.topk(dist, k=2, dim=1, largest=False).values[:, 1, :], dim=-1)
    for i in range(1, k):
        sub = torch.gather(dist, dim=1, index=keep[:, :i].unsqueeze(-1).expand(-1, -1, n))
        least = torch.min(sub, dim=1).values
        least.scatter_(1, keep[:, :i], -math.inf if method == "attn_div_v2" else -1)
        keep[:, i] = torch.argmax(least, dim=-1)
    return keep.sort().values


def authors_tstm(video: torch.Tensor, threshold: float, token_mask: torch.Tensor, lower_bound: int):
    """Their ``spatiotemporal_compression`` on a segment (F, P, E), in place on a copy: per temporal patch, the kept
    tokens and their indices."""
    video = video.clone()
    f, n, _ = video.shape
    normed = video / video.norm(p=2, dim=-1, keepdim=True)
    sims = torch.einsum("b n d, b m d -> b n m", normed[1:], normed[:-1])
    sims[~token_mask[1:].unsqueeze(-1).expand(-1, -1, n)] = -1.0
    sims[~token_mask[:-1].unsqueeze(1).expand(-1, n, -1)] = -1.0
    best, parent = torch.max(sims, dim=-1)
    best = F.pad(best, (0, 0, 1, 0), value=-1)
    parent = F.pad(parent, (0, 0, 1, 0), value=-1)
    counts = torch.ones(f, n, dtype=video.dtype)
    mask = best > threshold
    if (~mask).int().sum() < lower_bound:
        soft = best.view(-1).topk(k=f * n - lower_bound).values[-1]
        mask = best > max(soft, -1.0 + 1e-6)
    for i in range(f - 1, -1, -1):
        video[i][~mask[i]] = video[i][~mask[i]] / counts[i][~mask[i]].unsqueeze(-1)
        counts[i][~mask[i]] = 1
        if mask[i].any():
            one_hot = F.one_hot(parent[i][mask[i]], num_classes=n).to(video.dtype)
            video[i - 1] += torch.einsum("m n, m d -> n d", one_hot, video[i][mask[i]])
            counts[i - 1] += one_hot.sum(dim=0)
            counts[i][mask[i]] = 0
    keep = [(~mask[i]) & token_mask[i] for i in range(f)]
    return [video[i][keep[i]] for i in range(f)], [torch.where(keep[i])[0] for i in range(f)]


def authors_dpc_knn(x: torch.Tensor, clusters: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Their ``dpc_knn`` on (1, n, E), without the random density jitter: (assignment (1, n), centres (1, c))."""
    _, n, e = x.shape
    dists = torch.cdist(x.double(), x.double()) / math.sqrt(e)
    nearest = torch.topk(dists, k=k, dim=-1, largest=False).values
    density = torch.mean(-(nearest**2), dim=-1).exp()
    higher = density[:, None, :] > density[:, :, None]
    dist, _ = torch.min(torch.where(higher, dists, dists.view(1, -1).max(dim=-1)[0].view(-1, 1, 1)), dim=-1)
    centres = torch.topk(dist * density, k=clusters, dim=-1).indices
    assigned = torch.argmin(torch.gather(dists, -1, centres.unsqueeze(1).expand(-1, n, -1)), dim=-1)
    assigned.scatter_(-1, centres, torch.arange(clusters).unsqueeze(0))
    return assigned, centres


def hamilton(sizes: list[int], seats: int) -> list[int]:
    """``seats`` shared among parties of ``sizes`` by Hamilton's largest remainder, in exact fractions: each party
    its quota's floor, then one more to the largest fractional parts (ties: the earlier party) until all are given.
    The same counts as vitrim's ``exact_count`` rule (the ceilings, less one from the quotas furthest below theirs,
    the later first), written the other way round."""
    quotas = [Fraction(size * seats, sum(sizes)) for size in sizes]
    given = [math.floor(quota) for quota in quotas]
    order = sorted(range(len(sizes)), key=lambda party: (-(quotas[party] - given[party]), party))
    for party in order[: seats - sum(given)]:
        given[party] += 1
    return given


def authors_flashvid(
    video: torch.Tensor, attn: torch.Tensor, o: dict, exact: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Their ``flashvid_compression`` on one video (t, P, E) with its attention (t, P): (kept indices sorted, the
    embeddings the LLM gets there). One change, vitrim's stated difference: a one-temporal-patch segment clusters
    the tokens not selected (theirs: all P, ``segment_features[0]``). ``exact``: vitrim's ``exact_count``, each
    segment's clusters per temporal patch by :func:`hamilton` instead of their ceilings (a temporal patch given none
    drops its roots)."""
    t, p, e = video.shape
    video = video.clone()
    lengths = authors_segments(video.mean(1), o) if o["do_segment"] else torch.tensor([t])  # their code passes a view
    budget = math.ceil(p * o["retention_ratio"] * o["expansion"])
    n_sel = math.ceil(budget * o["alpha"])
    n_sttm = budget - n_sel
    index = torch.arange(t * p).view(t, p)
    out_tokens, out_index, offset = [], [], 0
    for length in lengths.tolist():
        seg, seg_attn, seg_index = video[offset : offset + length], attn[offset : offset + length], index[offset:]
        seg_index = seg_index[:length]
        chosen = authors_selection(seg, seg_attn, n_sel, o["token_selection_method"])
        tokens = [torch.gather(seg, 1, chosen.unsqueeze(-1).expand(-1, -1, e)).reshape(-1, e)]
        indices = [seg_index.gather(1, chosen).reshape(-1)]
        mask = torch.ones(length, p, dtype=torch.bool)
        mask.scatter_(1, chosen, False)
        others = n_sttm * length
        if others > 0 and o["temporal_threshold"] < 1.0:
            if length > 1:
                merged, local = authors_tstm(seg, o["temporal_threshold"], mask, budget * length)
                merged_index = [seg_index[i][ix] for i, ix in enumerate(local)]
            else:  # vitrim's change: their code takes seg[0] and seg_index[0] whole here
                merged, merged_index = [seg[0][mask[0]]], [seg_index[0][mask[0]]]
            ratio = others / sum(len(m) for m in merged)
            shares = hamilton([len(m) for m in merged], others) if exact else None
            for frame, (values, where) in enumerate(zip(merged, merged_index, strict=True)):
                clusters = math.ceil(len(values) * ratio) if shares is None else shares[frame]
                if shares is not None and clusters == 0:
                    continue
                if clusters > 0 and ratio < 1.0:
                    assigned, centres = authors_dpc_knn(values.unsqueeze(0), clusters, min(clusters, 7))
                    one_hot = F.one_hot(assigned[0], num_classes=clusters).to(values.dtype)
                    values = torch.einsum("n c, n d -> c d", one_hot, values) / one_hot.sum(0).unsqueeze(-1)
                    where = where[centres[0]]
                tokens.append(values)
                indices.append(where)
        out_tokens.append(torch.cat(tokens))
        out_index.append(torch.cat(indices))
        offset += length
    tokens, indices = torch.cat(out_tokens), torch.cat(out_index)
    order = indices.argsort()
    return indices[order], tokens[order]


# --- the method's function against them ----------------------------------------------------------------------------


def scenes(seed: int, t: int, p: int, e: int, cuts: int, noise: float) -> torch.Tensor:
    """(t, P, E) float64: ``cuts`` + 1 scenes of near-repeated temporal patches, their tokens drifting a little, so
    DySeg cuts by its threshold and trees form across temporal patches."""
    generator = torch.Generator().manual_seed(seed)
    bases = torch.randn(cuts + 1, p, e, generator=generator, dtype=torch.float64)
    scene = torch.randint(0, cuts + 1, (t,), generator=generator).sort().values
    return bases[scene] + noise * torch.randn(t, p, e, generator=generator, dtype=torch.float64)


def vitrim_flashvid(video: torch.Tensor, attn: torch.Tensor, options: dict):
    selection = flashvid_select(video, attn, FlashVIDOptions(**options))
    assert selection.merged is not None and selection.projected
    return selection


CASES = [  # (seed, t, P, E, scenes' cuts, noise, options over the authors' defaults)
    (0, 8, 20, 16, 2, 0.3, {}),
    (1, 12, 16, 8, 3, 0.2, {"retention_ratio": 0.4}),
    (2, 9, 24, 16, 1, 0.4, {"min_segment_num": 2, "temporal_threshold": 0.6}),
    (3, 6, 30, 8, 1, 0.3, {"token_selection_method": "attn_div_v2", "retention_ratio": 0.3}),
    (4, 10, 12, 12, 0, 0.05, {"alpha": 0.4, "min_segment_num": 3, "segment_threshold": 0.5}),
    (5, 7, 20, 8, 2, 0.3, {"token_selection_method": "div", "do_segment": False}),
    (6, 5, 16, 8, 1, 0.2, {"token_selection_method": "attn", "complementary_segment": False}),
]


@pytest.mark.parametrize("seed, t, p, e, cuts, noise, options", CASES)
def test_flashvid_equals_the_authors_steps(seed, t, p, e, cuts, noise, options) -> None:
    video = scenes(seed, t, p, e, cuts, noise)
    attn = torch.rand(t, p, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    merged = AUTHORS | options
    selection = vitrim_flashvid(video, attn, merged)
    theirs_kept, theirs_values = authors_flashvid(video, attn, merged)
    assert torch.equal(selection.kept, theirs_kept)
    torch.testing.assert_close(selection.merged, theirs_values, rtol=0, atol=1e-12)
    assert len(selection.kept) < t * p
    # every token of the video is in exactly one kept token's group (nothing dropped while TSTM runs)
    covered = torch.cat(selection.groups).sort().values
    assert torch.equal(covered, torch.arange(t * p))
    assert [int(k) in g.tolist() for k, g in zip(selection.kept, selection.groups, strict=True)] == [True] * len(
        selection.kept
    )


@pytest.mark.full
@pytest.mark.parametrize("seed", range(16))
def test_flashvid_equals_the_authors_steps_on_a_sweep(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    t, p = int(torch.randint(2, 16, (1,), generator=generator)), int(torch.randint(8, 40, (1,), generator=generator))
    methods = ["attn_div", "attn_div_v2", "attn", "div"]
    options = AUTHORS | {
        # below P per temporal patch (their raised threshold fails at a budget of P: topk(k=0)[-1])
        "retention_ratio": float(torch.empty(1).uniform_(0.05, 0.7, generator=generator)),
        "alpha": float(torch.empty(1).uniform_(0.1, 1.0, generator=generator)),
        "token_selection_method": methods[seed % 4],
        "temporal_threshold": float(torch.empty(1).uniform_(0.3, 0.99, generator=generator)),
        "segment_threshold": float(torch.empty(1).uniform_(0.3, 0.99, generator=generator)),
        "min_segment_num": int(torch.randint(1, t + 1, (1,), generator=generator)),  # their code needs ≤ t
    }
    video = scenes(seed, t, p, 8, int(torch.randint(0, 4, (1,), generator=generator)), 0.3)
    attn = torch.rand(t, p, generator=generator, dtype=torch.float64)
    selection = vitrim_flashvid(video, attn, options)
    theirs_kept, theirs_values = authors_flashvid(video, attn, options)
    assert torch.equal(selection.kept, theirs_kept)
    torch.testing.assert_close(selection.merged, theirs_values, rtol=0, atol=1e-12)


def test_a_temporal_threshold_of_one_keeps_only_the_adts_picks() -> None:
    video = scenes(9, 4, 12, 8, 1, 0.2)
    attn = torch.rand(4, 12, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    options = AUTHORS | {"temporal_threshold": 1.0}
    selection = vitrim_flashvid(video, attn, options)
    kept, _ = authors_flashvid(video, attn, options)
    budget = math.ceil(12 * 0.25 * 1.25)
    assert torch.equal(selection.kept, kept) and len(kept) == 4 * math.ceil(budget * 0.7)
    assert all(len(group) == 1 for group in selection.groups)


def test_where_the_authors_code_fails_flashvid_runs() -> None:
    """Their raised threshold when every token must stay (budget = P) takes ``topk(k=0)[-1]`` and fails; vitrim
    lets no token join (keep-all). Their one-temporal-patch segment clusters the ADTS picks too: a cluster's peak
    can be a pick, one slot twice; vitrim's slots are distinct."""
    video = scenes(11, 4, 10, 8, 0, 0.01)  # near-still: every token would join
    attn = torch.rand(4, 10, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    everything = vitrim_flashvid(video, attn, AUTHORS | {"retention_ratio": 1.0, "expansion": 1.0})
    assert torch.equal(everything.kept, torch.arange(40)) and all(len(g) == 1 for g in everything.groups)
    with pytest.raises(IndexError):
        authors_tstm(video, 0.8, torch.ones(4, 10, dtype=torch.bool), 40)
    one = scenes(1, 1, 20, 8, 0, 0.3)  # one temporal patch of 20 tokens: 5 ADTS picks, 2 clusters
    one_attn = torch.rand(1, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    picks = authors_selection(one, one_attn, 5, "attn_div")[0]
    _, centres = authors_dpc_knn(one[0][None], 2, 2)  # theirs: all 20 tokens, the picks among them
    assert set(picks.tolist()) & set(centres[0].tolist())  # a peak that is a pick: their slot twice
    alone = vitrim_flashvid(one, one_attn, AUTHORS)
    assert len(alone.kept) == len(set(alone.kept.tolist())) == 7
    assert set(picks.tolist()) <= set(alone.kept.tolist())


# --- exact_count: each segment's clusters shared by largest remainder (vitrim's option, what vLLM serving needs) ---


def test_the_largest_remainder_by_hand() -> None:
    # 3 temporal patches of 3 roots, 4 clusters: quotas 4/3 each, ceilings 2 + 2 + 2 = 6, two too many, all equally
    # far below theirs: the later temporal patches give one back
    assert cluster_counts([3, 3, 3], 4, exact=True) == [2, 1, 1]
    assert cluster_counts([3, 3, 3], 4, exact=False) == [2, 2, 2]
    # quotas 2.5 and 0.5 of 3: ceilings 3 + 1, equally far below: the second gives its one back (its root dropped)
    assert cluster_counts([5, 1], 3, exact=True) == [3, 0]
    # quotas 4.2 and 1.8 of 6: ceilings 5 + 2, the first furthest below its ceiling (0.8 against 0.2)
    assert cluster_counts([7, 3], 6, exact=True) == [4, 2]
    assert cluster_counts([4, 2], 3, exact=True) == [2, 1]  # whole quotas: nothing to take back
    assert hamilton([3, 3, 3], 4) == [2, 1, 1] and hamilton([5, 1], 3) == [3, 0] and hamilton([7, 3], 6) == [4, 2]


def budget(t: int, p: int, options: dict) -> int:
    """t·B, or t·A where nothing merges: what ``exact_count`` keeps of a video of t temporal patches of P tokens."""
    chosen, context = FlashVIDOptions(**options).budgets(p)
    return t * (chosen + context if context > 0 and options["temporal_threshold"] < 1.0 else chosen)


@pytest.mark.parametrize("seed, t, p, e, cuts, noise, options", CASES)
def test_exact_count_equals_the_authors_steps_with_the_largest_remainder(seed, t, p, e, cuts, noise, options) -> None:
    video = scenes(seed, t, p, e, cuts, noise)
    attn = torch.rand(t, p, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    merged = AUTHORS | options
    selection = vitrim_flashvid(video, attn, merged | {"exact_count": True})
    theirs_kept, theirs_values = authors_flashvid(video, attn, merged, exact=True)
    assert torch.equal(selection.kept, theirs_kept)
    torch.testing.assert_close(selection.merged, theirs_values, rtol=0, atol=1e-12)
    assert len(selection.kept) == budget(t, p, merged)


def random_video(seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A video (t, P, 8) of scenes, its attention (t, P) and options over the authors', all drawn from ``seed``."""
    generator = torch.Generator().manual_seed(1000 + seed)

    def uniform(low: float, high: float) -> float:
        return float(torch.empty(1).uniform_(low, high, generator=generator))

    t, p = int(torch.randint(1, 13, (1,), generator=generator)), int(torch.randint(6, 30, (1,), generator=generator))
    options = AUTHORS | {
        "retention_ratio": uniform(0.05, 0.7),
        "alpha": uniform(0.1, 1.0),
        "token_selection_method": ["attn_div", "attn_div_v2", "attn", "div"][seed % 4],
        "temporal_threshold": uniform(0.3, 0.99),
        "segment_threshold": uniform(0.3, 0.99),
        "min_segment_num": int(torch.randint(1, t + 1, (1,), generator=generator)),
    }
    video = scenes(seed, t, p, 8, int(torch.randint(0, 4, (1,), generator=generator)), uniform(0.05, 0.5))
    return video, torch.rand(t, p, generator=generator, dtype=torch.float64), options


SWEEP = 40  # random videos


def test_exact_count_keeps_t_times_b_on_every_random_video_where_the_authors_rounding_keeps_more() -> None:
    """On :data:`SWEEP` random videos: ``exact_count`` keeps exactly t·B and equals the largest-remainder reference;
    the authors' rounding keeps at least t·B, more on many of them (their ceilings), by at most t."""
    over = []
    for seed in range(SWEEP):
        video, attn, options = random_video(seed)
        t, p, _ = video.shape
        exact = vitrim_flashvid(video, attn, options | {"exact_count": True})
        theirs_kept, theirs_values = authors_flashvid(video, attn, options, exact=True)
        assert torch.equal(exact.kept, theirs_kept), seed
        torch.testing.assert_close(exact.merged, theirs_values, rtol=0, atol=1e-12)
        assert len(exact.kept) == budget(t, p, options), seed
        authors = len(vitrim_flashvid(video, attn, options).kept)
        assert budget(t, p, options) <= authors <= budget(t, p, options) + t, seed  # at most one more per patch
        over.append(authors - len(exact.kept))
    assert sum(extra > 0 for extra in over) >= SWEEP // 4, over  # the rounding correction really runs
    assert max(over) >= 2, over


def test_the_cost_of_exact_count_is_the_count_it_keeps() -> None:
    """``cost`` counts t·B: with ``exact_count`` the tokens a clip of Qwen2.5-VL-7B's 16 × 16 tokens per temporal
    patch keeps, on a video of scenes of that size."""
    from vitrim.vlm.flops import QWEN25_VL_7B
    from vitrim.vlm.flops_video import clip

    model = clip(QWEN25_VL_7B, 6, 448)
    video = scenes(21, 6, 256, 8, 1, 0.3)
    attn = torch.rand(6, 256, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    kept = vitrim_flashvid(video, attn, AUTHORS | {"exact_count": True}).kept
    cost = FlashVIDSelection(exact_count=True).cost(model, 0, text_tokens=0)
    assert cost.tokens_entering(6 * 256) == len(kept) == 6 * 80  # B = ⌈256·0.25·1.25⌉ = 80
    assert len(vitrim_flashvid(video, attn, AUTHORS).kept) > len(kept)


# --- on the tiny models --------------------------------------------------------------------------------------------


def authors_attention(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """Per video, (t, P) the authors' attention as their Qwen towers compute it at the last block: q and k from its
    fused ``qkv`` on the block's (normed) input, the model's rotary on both; per temporal patch the full softmax of
    q·kᵀ/√hd, its mean over heads, then over queries; the mean over each 4 adjacent tower rows (one merged token);
    Qwen2.5-VL's window order undone (their ``reverse_indices``). Their code takes one video; here each in turn."""
    q, k = last_block_query_key(model, inputs)
    heads = q.shape[1]
    grid = inputs["video_grid_thw"]
    scores, at = [], 0
    for t, h, w in grid.tolist():
        vq = q[at : at + t * h * w].reshape(t, h * w, heads, -1).permute(0, 2, 1, 3)  # (t, H, hw, hd)
        vk = k[at : at + t * h * w].reshape(t, h * w, heads, -1).permute(0, 2, 1, 3)
        weights = torch.softmax(vq @ vk.transpose(-1, -2) / vq.shape[-1] ** 0.5, dim=-1).mean(1).mean(1)  # (t, hw)
        scores.append(weights.reshape(t, h * w // 4, 4).mean(-1).reshape(-1))
        at += t * h * w
    return videos_in_raster(model, grid, torch.cat(scores), MERGE)  # Qwen2.5-VL: their reverse_indices


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
OPTIONS = AUTHORS | {"retention_ratio": 0.5, "min_segment_num": 2}
VIDEOS = [[[1], ("video", (6, 4, 6)), [7], ("video", (3, 4, 4)), [8]]]


def still_scenes(inputs: dict) -> dict:
    """``inputs`` with the first video's temporal patches 1, 2 near copies of patch 0 and 4, 5 of patch 3 (pixels
    + 1 % noise), so its tokens join trees across temporal patches (random pixels alone make none)."""
    _, h, w = inputs["video_grid_thw"][0].tolist()
    pixels = inputs["pixel_values_videos"].clone()
    frame = h * w  # rows per temporal patch (the tiny towers' temporal patch is one frame)
    generator = torch.Generator().manual_seed(7)
    for copy, source in ((1, 0), (2, 0), (4, 3), (5, 3)):
        noise = torch.randn(frame, pixels.shape[1], generator=generator, dtype=pixels.dtype)
        pixels[copy * frame : (copy + 1) * frame] = pixels[source * frame : (source + 1) * frame] + 0.01 * noise
    return {**inputs, "pixel_values_videos": pixels}


def families(*default: str) -> list:
    """Every family, those not in ``default`` marked ``full``."""
    return [pytest.param(name, marks=[] if name in default else [pytest.mark.full]) for name in FAMILIES]


def the_authors_on_the_model(
    model: torch.nn.Module, inputs: dict, options: dict = OPTIONS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per video, the authors' (kept, embeddings) on the model's own merged embeddings and their attention (at
    ``options``; ``exact_count`` among them: the largest remainder, :func:`hamilton`)."""
    with torch.no_grad():
        embeddings = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    attention = authors_attention(model, inputs)
    found = []
    for (t, h, w), tokens, attn in zip(
        inputs["video_grid_thw"].tolist(), embeddings.pooler_output, attention, strict=True
    ):
        theirs = {name: value for name, value in options.items() if name != "exact_count"}
        exact = options.get("exact_count", False)
        found.append(authors_flashvid(tokens.reshape(t, (h // MERGE) * (w // MERGE), -1), attn, theirs, exact))
    return found


def llm_input(model: torch.nn.Module, inputs: dict) -> dict:
    """The keyword arguments the LLM gets on ``model(**inputs)``, after vitrim's pre-hook shortened them (hooks run in
    the order they were added: this one after vitrim's)."""
    seen: dict = {}
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return seen


@pytest.mark.parametrize("family", families("qwen2_5_vl"))
def test_on_the_model_the_llm_gets_the_authors_tokens(family: str) -> None:
    model = BUILDERS[family]()
    inputs = still_scenes(video_batch(VIDEOS, qwen3=family == "qwen3_vl"))
    expected = the_authors_on_the_model(model, inputs)
    vitrim.vlm.apply(model, "flashvid", **OPTIONS)
    seen = llm_input(model, inputs)
    kept = vitrim.vlm.last_selection(model)
    assert [k.tolist() for k in kept] == [k.tolist() for k, _ in expected]
    short_ids = inputs["input_ids"][0][~dropped_media(inputs, kept)[0]]
    received = seen["inputs_embeds"][0][short_ids == VIDEO]
    torch.testing.assert_close(received, torch.cat([values for _, values in expected]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", families("qwen2_5_vl"))
def test_the_pruned_model_equals_masking_with_the_authors_embeddings_written(family: str) -> None:
    model = BUILDERS[family]()
    inputs = still_scenes(video_batch(VIDEOS, qwen3=family == "qwen3_vl"))
    expected = the_authors_on_the_model(model, inputs)
    vitrim.vlm.apply(model, "flashvid", **OPTIONS)
    with torch.no_grad():
        pruned = model(**inputs).logits
    kept, groups = vitrim.vlm.last_selection(model), vitrim.vlm.last_selection(model, groups=True)
    vitrim.vlm.remove(model)
    counts = media_tokens(inputs)

    def write(module, args, kwargs, output):  # the prompt holds videos only: the tower's one call is theirs
        rows = output.pooler_output.clone()
        start = 0
        for (where, values), count in zip(expected, counts, strict=True):
            rows[start + where] = values
            start += count
        output.pooler_output = rows
        if getattr(output, "deepstack_features", None):  # Qwen3-VL: vitrim's convention, the mean of the group's
            output.deepstack_features = deepstack_group_means(output.deepstack_features, kept, groups, counts)
        return output

    dropped = dropped_media(inputs, kept)
    handle = model.model.visual.register_forward_hook(write, with_kwargs=True)
    with torch.no_grad():
        reference = masked_logits(model, inputs, dropped)
    handle.remove()
    assert bool(dropped.any())
    torch.testing.assert_close(pruned[0], reference[0, ~dropped[0]], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", families("qwen3_vl"))
def test_keep_all_is_the_unmodified_model_bit_for_bit(family: str) -> None:
    model = BUILDERS[family]()
    inputs = video_batch(MIXED, qwen3=family == "qwen3_vl")
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, "flashvid", retention_ratio=1.0, expansion=1.0)
        after = model(**inputs).logits
    assert torch.equal(after, before)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == media_tokens(inputs)


@pytest.mark.parametrize("family", families("qwen2_5_vl"))
def test_a_padded_batch_of_different_clips_equals_each_clip_alone(family: str) -> None:
    model = vitrim.vlm.apply(BUILDERS[family](), "flashvid", **OPTIONS)
    assert_batch_equals_each_alone(model, MIXED, qwen3=family == "qwen3_vl")


EXACT = OPTIONS | {"alpha": 0.4, "exact_count": True}  # C = 2 merged tokens per temporal patch of 6


@pytest.mark.parametrize("family", families("qwen2_5_vl", "qwen3_vl"))
def test_with_exact_count_the_llm_gets_the_largest_remainder_tokens_t_times_b_of_each_video(family: str) -> None:
    """The first video (6 temporal patches of 6 tokens: B = 4, A = 2) keeps 24 where the authors' rounding keeps 26;
    the second (3 of 4: B = 3, A = 2) 9."""
    model = BUILDERS[family]()
    inputs = still_scenes(video_batch(VIDEOS, qwen3=family == "qwen3_vl"))
    expected = the_authors_on_the_model(model, inputs, EXACT)
    authors = the_authors_on_the_model(model, inputs, EXACT | {"exact_count": False})
    vitrim.vlm.apply(model, "flashvid", **EXACT)
    seen = llm_input(model, inputs)
    kept = vitrim.vlm.last_selection(model)
    assert [k.tolist() for k in kept] == [k.tolist() for k, _ in expected]
    assert [len(k) for k in kept] == [24, 9] and [len(k) for k, _ in authors] == [26, 9]
    short_ids = inputs["input_ids"][0][~dropped_media(inputs, kept)[0]]
    received = seen["inputs_embeds"][0][short_ids == VIDEO]
    torch.testing.assert_close(received, torch.cat([values for _, values in expected]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", families("qwen2_5_vl"))
def test_with_exact_count_a_padded_batch_of_different_clips_equals_each_clip_alone(family: str) -> None:
    model = vitrim.vlm.apply(BUILDERS[family](), "flashvid", **EXACT)
    assert_batch_equals_each_alone(model, MIXED, qwen3=family == "qwen3_vl")


def test_the_in_llm_stage_keeps_the_ceiling_of_the_ratio_by_the_last_tokens_attention_a_layer_before() -> None:
    """Stacked after ``flashvid``: before layer 1, each video keeps ⌈N·0.3⌉ of its N tokens (24 → 8, where FastV's
    rounded fraction keeps 7), those the last token attended to most at layer 0 (the model's own eager attention
    weights on the pruned LLM input, mean over heads, ranked per video)."""
    model = BUILDERS["qwen2_5_vl"]()
    inputs = video_batch(VIDEOS)
    vitrim.vlm.apply(model, "flashvid", **OPTIONS)
    seen = llm_input(model, inputs)
    entered = vitrim.vlm.last_selection(model)
    vitrim.vlm.apply(model, "flashvid_llm", layer=1)
    with torch.no_grad():
        model(**inputs)
    final = vitrim.vlm.last_selection(model)
    assert [k.tolist() for k in vitrim.vlm.last_selection(model, stage="pre_llm")] == [k.tolist() for k in entered]

    reference = BUILDERS["qwen2_5_vl"]().model.language_model  # the same weights, run eagerly for its weights
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        weights = reference(**{k: seen[k] for k in ("inputs_embeds", "position_ids", "attention_mask")},
                            output_attentions=True).attentions[0][0, :, -1].mean(0)  # fmt: skip
    short_ids = inputs["input_ids"][0][~dropped_media(inputs, entered)[0]]
    columns = (short_ids == VIDEO).nonzero()[:, 0]
    start = 0
    for before, after in zip(entered, final, strict=True):
        mine = columns[start : start + len(before)]
        count = math.ceil(len(before) * 0.3)
        best = torch.topk(weights[mine], count).indices.sort().values
        assert after.tolist() == before[best].tolist()
        start += len(before)
    assert [len(k) for k in final] == [8, 3] and round(24 * 0.3) == 7


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("retention_ratio", 0.0, r"a float in \(0, 1\]"),
        ("retention_ratio", 1.5, r"a float in \(0, 1\]"),
        ("expansion", -1.0, r"a float > 0"),
        ("alpha", 1.2, r"a float in \[0, 1\]"),
        ("alpha", "high", r"a float in \[0, 1\]"),
        ("temporal_threshold", float("nan"), r"a float"),
        ("segment_threshold", None, r"a float"),
        ("min_segment_num", 0, r"an int >= 1"),
        ("min_segment_num", 2.0, r"an int >= 1"),
        ("token_selection_method", "attention", r"one of 'attn_div', 'attn_div_v2', 'attn', 'div'"),
        ("do_segment", 1, r"True or False"),
        ("complementary_segment", "yes", r"True or False"),
        ("exact_count", 1, r"True or False"),
    ],
)
def test_bad_options_are_refused_in_one_line(option: str, value, expected: str) -> None:
    model = BUILDERS["qwen2_vl"]()
    line = re.escape(f"{option}={value!r} for vlm method 'flashvid' must be ") + expected
    with pytest.raises(ValueError, match=f"^{line}"):
        vitrim.vlm.apply(model, "flashvid", **{option: value})
    assert not hasattr(model, "_vitrim_vlm")


def test_a_budget_above_a_temporal_patch_is_refused_in_one_line() -> None:
    model = vitrim.vlm.apply(BUILDERS["qwen2_vl"](), "flashvid", retention_ratio=0.9)  # ×1.25 > 1
    inputs = video_batch([[[1], ("video", (2, 4, 4)), [7]]])
    with pytest.raises(ValueError, match=r"^retention_ratio=0.9 with expansion=1.25 budgets ceil\(4·0.9·1.25\) = 5"):
        model(**inputs)


@pytest.mark.parametrize(
    "method, options, expected",
    [
        ("flashvid_llm", {"llm_retention_ratio": 0.0}, r"^llm_retention_ratio=0.0 for vlm method 'flashvid_llm' must"),
        ("flashvid_llm", {"keep": 0.5}, r"^keep=0.5: vlm method 'flashvid_llm' keeps ceil\(N·llm_retention_ratio\)"),
        ("flashvid", {"keep": 4}, r"^keep=4: vlm method 'flashvid' reduces videos"),
    ],
)
def test_the_in_llm_stage_and_keep_are_refused_in_one_line(method: str, options: dict, expected: str) -> None:
    model = BUILDERS["qwen2_5_vl"]()
    with pytest.raises(ValueError, match=expected):
        vitrim.vlm.apply(model, method, **options)
    assert not hasattr(model, "_vitrim_vlm")


def test_a_family_without_video_refuses_flashvid_in_one_line() -> None:
    from tiny_vlms.llava import tiny_llava

    with pytest.raises(TypeError, match=r"^vlm method 'flashvid' reduces videos; vitrim.vlm takes no video on Llava"):
        vitrim.vlm.apply(tiny_llava(), "flashvid")

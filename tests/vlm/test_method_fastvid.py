"""FastVID (``fastvid``): its selection and merged anchors equal a re-implementation of the authors' Qwen2.5-VL code
(LunarShen/FastVID, ``fastvid_qwen25vl``) written here from its facts, step for step in their order; on the tiny
Qwen2-VL / Qwen2.5-VL / Qwen3-VL, keep-all is the unmodified model bit for bit, the pruned model equals the masked
model at the full positions with the anchors' merged embeddings written in, its pick on the model equals the
re-implementation on the model's own merged embeddings and the authors' salience (from the last block's own q/k),
and a padded batch of different clips equals each clip alone."""

from __future__ import annotations

import math
import re

import pytest
import torch
from qwen_reference import last_block_query_key, videos_in_raster

import vitrim.vlm
from tiny_vlms.qwen import BUILDERS, MERGE
from tiny_vlms.qwen_video import (
    assert_batch_equals_each_alone,
    deepstack_group_means,
    dropped_media,
    masked_logits,
    media_tokens,
    video_batch,
)
from vitrim.vlm.method.fastvid import FastVIDOptions, fastvid_select

AUTHORS = dict(retention_ratio=0.27, DySeg_c=8, DySeg_tau=0.84, DySeg_ignore=0.95, STPrune_d=0.4, DTM_p=4, DTM_beta=0.6)
MIXED = [
    [[1, 5], ("image", (4, 6)), [7], ("video", (3, 4, 4)), [8, 9]],
    [[1], ("video", (2, 4, 6)), [6, 7], ("video", (4, 4, 4)), [9]],
]


def authors_fastvid(video: torch.Tensor, attn: torch.Tensor, o: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' steps on one video (t, P, E) with its per-token attention (t, P): (kept indices sorted, their
    hidden states as the LLM gets them). Where their code would raise (fewer than c temporal patches, no cut), the
    callers here avoid it; their density's 1e-6 random jitter is left out (vitrim has none)."""
    t, p, _ = video.shape
    g = video.mean(1)
    g = g / g.norm(dim=1, keepdim=True)
    sim = (g[:-1] * g[1:]).sum(dim=1)
    cut = (
        torch.unique(
            torch.cat(
                [
                    torch.topk(sim, o["DySeg_c"] - 1, largest=False).indices,
                    torch.nonzero(sim < o["DySeg_tau"]).squeeze(1),
                ]
            )
        )
        .sort()
        .values
    )
    sizes = [cut[0].item() + 1] + [cut[i].item() - cut[i - 1].item() for i in range(1, len(cut))]
    sizes.append(t - cut[-1].item() - 1)
    frame_retain = int(p * o["retention_ratio"])
    out_index, out_hidden = [], []
    seg_start = 0
    for seg_len, seg_hidden, seg_attn, seg_g in zip(
        sizes, torch.split(video, sizes), torch.split(attn, sizes), torch.split(g, sizes), strict=True
    ):
        seg_retain = frame_retain * seg_len
        seg_context = max(int(seg_retain * o["STPrune_d"]), 1)
        seg_salient = seg_retain - seg_context
        if seg_len == 1:
            frm_salient, frm_context = [seg_salient], [seg_context]
        else:
            s = (seg_g[:-1] * seg_g[1:]).sum(dim=1)
            c = torch.nonzero(s < o["DySeg_ignore"]).squeeze(1).sort().values
            if len(c):
                sub = [c[0].item() + 1] + [c[i].item() - c[i - 1].item() for i in range(1, len(c))]
                sub.append(seg_len - c[-1].item() - 1)
            else:
                sub = [seg_len]
            v = len(sub)
            sal = [seg_salient // v + (1 if i < seg_salient % v else 0) for i in range(v)]
            groups = (v + o["DTM_p"] - 1) // o["DTM_p"]
            ctx_groups = [seg_context // groups + (1 if i < seg_context % groups else 0) for i in range(groups)]
            ctx, at = [], 0
            for i in range(v):
                if i % o["DTM_p"] == 0:
                    ctx.append(min(ctx_groups[at], p // 2))
                    at += 1
                else:
                    ctx.append(0)
            ctx.reverse()
            frm_salient, frm_context = [], []
            for i in range(v):
                frm_salient += [0] * (sub[i] - 1)
                frm_context += [0] * (sub[i] - 1)
                if ctx[i] == 0:
                    frm_salient.append(min(sal[i], p))
                    frm_context.append(0)
                else:
                    frm_context.append(min(ctx[i], p // 2))
                    frm_salient.append(min(sal[i], p - frm_context[-1]))
        salient_idx, context_idx = [], []
        for f in range(seg_len):
            top = torch.topk(seg_attn[f], frm_salient[f]).indices if frm_salient[f] > 0 else None
            if frm_context[f] > 0:
                every = torch.arange(p)
                remaining = every[~torch.isin(every, top)] if top is not None else every
                x = seg_hidden[f][remaining].unsqueeze(0)
                d = torch.cdist(x.double(), x.double()) / (x.shape[-1] ** 0.5)
                near, _ = torch.topk(d, k=min(4, x.shape[1]), dim=-1, largest=False)
                density = (-(near**2).mean(dim=-1)).exp()
                mask = (density[:, None, :] > density[:, :, None]).double()
                dmax = d.flatten(1).max(dim=-1)[0][:, None, None]
                dist, _ = (d * mask + dmax * (1 - mask)).min(dim=-1)
                picked = torch.topk(dist * density, k=frm_context[f], dim=-1).indices[0].sort().values
                context_idx.append(remaining[picked] + f * p)
            if top is not None:
                salient_idx.append(top + f * p)
        flat = seg_hidden.reshape(seg_len * p, -1)
        salient_idx = torch.cat(salient_idx) if salient_idx else torch.zeros(0, dtype=torch.long)
        unit = flat / flat.norm(dim=-1, keepdim=True)
        everything = torch.arange(seg_len * p)
        context_hidden = []
        for anchors in context_idx:
            others = everything[~torch.isin(everything, torch.cat([salient_idx, anchors]))]
            onehot = torch.zeros(len(others), len(anchors), dtype=flat.dtype)
            onehot.scatter_(1, (unit[others] @ unit[anchors].T).argmax(dim=1).unsqueeze(-1), 1)
            w = (1 / (onehot.sum(dim=0).unsqueeze(-1) + 1)).clamp(min=o["DTM_beta"])
            mean = onehot.T @ flat[others] / onehot.sum(dim=0).clamp(min=1).unsqueeze(-1)
            context_hidden.append(w * flat[anchors] + (1 - w) * mean)
        index = torch.cat([salient_idx, *context_idx])
        hidden = torch.cat([flat[salient_idx], *context_hidden])
        order = torch.argsort(index)
        out_index.append(index[order] + seg_start * p)
        out_hidden.append(hidden[order])
        seg_start += seg_len
    return torch.cat(out_index), torch.cat(out_hidden)


def scenes(seed: int, t: int, p: int, e: int, cuts: int, noise: float) -> torch.Tensor:
    """(t, P, E) float64: ``cuts`` + 1 scenes of near-repeated temporal patches (adjacent cosines near 1 inside a
    scene, low across), so DySeg cuts by its threshold as well as by its count."""
    generator = torch.Generator().manual_seed(seed)
    bases = torch.randn(cuts + 1, p, e, generator=generator, dtype=torch.float64)
    scene = torch.randint(0, cuts + 1, (t,), generator=generator).sort().values
    return bases[scene] + noise * torch.randn(t, p, e, generator=generator, dtype=torch.float64)


def vitrim_fastvid(video: torch.Tensor, attn: torch.Tensor, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    selection = fastvid_select(video, attn, FastVIDOptions(**options))
    assert selection.merged is not None and selection.projected
    return selection.kept, selection.merged


CASES = [  # (seed, t, P, E, scenes' cuts, noise, options over the authors' defaults)
    (0, 8, 12, 16, 2, 0.3, {}),
    (1, 12, 16, 8, 3, 0.2, {"DySeg_c": 3}),
    (2, 9, 6, 16, 1, 0.5, {"retention_ratio": 0.5, "DySeg_tau": 0.5, "DySeg_ignore": 0.99}),
    (3, 16, 12, 8, 4, 0.1, {"DTM_p": 2, "STPrune_d": 0.25, "DTM_beta": 0.3, "DySeg_c": 4}),
    (4, 10, 9, 12, 0, 0.05, {"retention_ratio": 0.4, "DySeg_c": 2, "DySeg_tau": 0.0, "DySeg_ignore": 0.9995}),
    (5, 6, 20, 8, 2, 0.4, {"retention_ratio": 0.1, "DySeg_c": 6}),
]


@pytest.mark.parametrize("seed, t, p, e, cuts, noise, options", CASES)
def test_fastvid_equals_the_authors_steps(seed, t, p, e, cuts, noise, options) -> None:
    video = scenes(seed, t, p, e, cuts, noise)
    attn = torch.rand(t, p, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
    merged = AUTHORS | options
    kept, hidden = vitrim_fastvid(video, attn, merged)
    theirs_kept, theirs_hidden = authors_fastvid(video, attn, merged)
    assert torch.equal(kept, theirs_kept)
    torch.testing.assert_close(hidden, theirs_hidden, rtol=0, atol=1e-12)
    assert len(kept) < t * p


@pytest.mark.full
@pytest.mark.parametrize("seed", range(20))
def test_fastvid_equals_the_authors_steps_on_a_sweep(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    t, p = int(torch.randint(4, 20, (1,), generator=generator)), int(torch.randint(4, 30, (1,), generator=generator))
    options = AUTHORS | {
        "retention_ratio": float(torch.empty(1).uniform_(0.25, 1.0, generator=generator)),
        "DySeg_c": int(torch.randint(1, t + 1, (1,), generator=generator)),
        "DySeg_tau": float(torch.empty(1).uniform_(0.0, 1.0, generator=generator)),
        "DySeg_ignore": float(torch.empty(1).uniform_(0.9, 1.0, generator=generator)),
        "STPrune_d": float(torch.empty(1).uniform_(0.0, 1.0, generator=generator)),
        "DTM_p": int(torch.randint(1, 6, (1,), generator=generator)),
        "DTM_beta": float(torch.empty(1).uniform_(0.0, 1.0, generator=generator)),
    }
    video = scenes(seed, t, p, 8, int(torch.randint(0, 4, (1,), generator=generator)), 0.2)
    attn = torch.rand(t, p, generator=generator, dtype=torch.float64)
    if options["DySeg_c"] == 1 and not bool((similarities(video) < options["DySeg_tau"]).any()):
        options["DySeg_c"] = 2  # their code needs a cut
    kept, hidden = vitrim_fastvid(video, attn, options)
    theirs_kept, theirs_hidden = authors_fastvid(video, attn, options)
    assert torch.equal(kept, theirs_kept)
    torch.testing.assert_close(hidden, theirs_hidden, rtol=0, atol=1e-12)


def similarities(video: torch.Tensor) -> torch.Tensor:
    g = video.mean(1)
    g = g / g.norm(dim=1, keepdim=True)
    return (g[:-1] * g[1:]).sum(1)


def test_where_the_authors_code_raises_fastvid_takes_one_segment_or_what_there_is() -> None:
    video = scenes(7, 3, 8, 8, 0, 0.01)  # 3 temporal patches < DySeg_c = 8, all alike (no cut by threshold)
    attn = torch.rand(3, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    kept, _ = vitrim_fastvid(video, attn, AUTHORS | {"DySeg_c": 8})
    theirs, _ = authors_fastvid(video, attn, AUTHORS | {"DySeg_c": 3})  # the 2 lowest of 2 gaps: the same cuts
    assert torch.equal(kept, theirs)
    one, _ = vitrim_fastvid(video[:1], attn[:1], AUTHORS)  # one temporal patch: one segment
    assert len(one) == int(8 * 0.27)


def authors_salience(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    """Per video, (t, P) the authors' salience, step for step as their Qwen2.5-VL tower computes it at its last
    block: the block's q and k from its fused ``qkv`` on the block's (normed) input, the model's rotary on both; per
    head, the mean query over each temporal patch's h·w patches and the mean key over each group of 4 adjacent
    patches (one merged token, window order); softmax over the temporal patch's tokens of mean query · mean keys /
    √hd; the mean over heads; then their ``reverse_indices`` (argsort of the window order) back to raster. Their code
    takes one video (``grid_thw[0]``); here each video's rows of the tower call in turn."""
    q, k = last_block_query_key(model, inputs)
    heads, head_dim = q.shape[1], q.shape[2]
    q, k = q.transpose(0, 1), k.transpose(0, 1)  # (H, P, hd)
    grid = inputs["video_grid_thw"]
    scores, at = [], 0
    for t, h, w in grid.tolist():
        video_q, video_k = q[:, at : at + t * h * w], k[:, at : at + t * h * w]
        mean_q = video_q.reshape(heads, t, h * w, head_dim).mean(-2, keepdim=True)  # (H, t, 1, hd)
        mean_k = video_k.reshape(heads, t, h * w // 4, 4, head_dim).mean(-2)  # (H, t, hw/4, hd)
        weights = torch.softmax(mean_q @ mean_k.transpose(-2, -1) / math.sqrt(head_dim), dim=-1)
        scores.append(weights.mean(2).mean(0).reshape(-1))  # (t·hw/4,) in tower order
        at += t * h * w
    return videos_in_raster(model, grid, torch.cat(scores), MERGE)  # Qwen2.5-VL: their reverse_indices


def fastvid_on_the_model_and_the_authors(family: str) -> list[tuple]:
    """Per video, (what vitrim's fastvid kept on the model, what the authors' steps keep on the model's own merged
    embeddings and their salience, :func:`authors_salience`)."""
    model = BUILDERS[family]()
    attention = model.model.visual.blocks[-1].attn
    # Sharper attention (the q and k rows ×10): at the tiny tower's small logits the softmax is near linear, and the
    # attention a token receives then picks the tokens the authors' salience picks; at ×10 it does not, in every
    # family here (fastvid ranking by the received attention fails this test)
    with torch.no_grad():
        width = attention.qkv.in_features
        attention.qkv.weight[: 2 * width] *= 10
        attention.qkv.bias[: 2 * width] *= 10
    inputs = video_batch([[[1], ("video", (6, 4, 6)), [7], ("video", (3, 4, 4)), [8]]], qwen3=family == "qwen3_vl")
    with torch.no_grad():
        embeddings = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    scores = authors_salience(model, inputs)
    options = AUTHORS | {"retention_ratio": 0.5, "DySeg_c": 2}
    vitrim.vlm.apply(model, "fastvid", **options)
    with torch.no_grad():
        model(**inputs)
    kept = vitrim.vlm.last_selection(model)
    pairs = []
    for video, (grid, tokens, score) in enumerate(
        zip(inputs["video_grid_thw"].tolist(), embeddings.pooler_output, scores, strict=True)
    ):
        t, h, w = grid
        expected, _ = authors_fastvid(tokens.reshape(t, (h // MERGE) * (w // MERGE), -1), score, options)
        pairs.append((kept[video], expected))
    return pairs


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def families(*default: str) -> list:
    """Every family, those not in ``default`` marked ``full`` (the default suite checks one or two, in turns)."""
    return [pytest.param(name, marks=[] if name in default else [pytest.mark.full]) for name in FAMILIES]


@pytest.mark.parametrize("family", families("qwen2_5_vl"))
def test_fastvid_on_the_model_picks_the_authors_tokens_from_its_merged_embeddings_and_salience(family: str) -> None:
    for kept, expected in fastvid_on_the_model_and_the_authors(family):
        assert torch.equal(kept, expected), (kept, expected)


@pytest.mark.parametrize("family", families("qwen3_vl"))
def test_keep_all_is_the_unmodified_model_bit_for_bit(family: str) -> None:
    model = BUILDERS[family]()
    inputs = video_batch(MIXED, qwen3=family == "qwen3_vl")
    with torch.no_grad():
        before = model(**inputs).logits
        vitrim.vlm.apply(model, "fastvid", retention_ratio=1.0, DySeg_tau=1.5)  # every temporal patch a segment
        after = model(**inputs).logits
    assert torch.equal(after, before)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == media_tokens(inputs)


def pruned_with_merges(model: torch.nn.Module, inputs: dict, options: dict):
    """The pruned logits, and the unmodified model's masked logits at the full positions with each anchor's slot
    holding w·anchor + (1 − w)·mean(its group's others), w = max(1/(n+1), DTM_beta), from the reported groups."""
    vitrim.vlm.apply(model, "fastvid", **options)
    with torch.no_grad():
        pruned = model(**inputs).logits
    kept = vitrim.vlm.last_selection(model)
    groups = vitrim.vlm.last_selection(model, groups=True)
    vitrim.vlm.remove(model)
    counts = media_tokens(inputs)
    first_video = len(counts) - len(inputs["video_grid_thw"])  # images come first in MIXED's reading order
    with torch.no_grad():
        own = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
    written, merges = [], 0
    for video, tokens in enumerate(own):
        tokens = tokens.clone()
        source = tokens.clone()
        for slot, group in zip(kept[first_video + video].tolist(), groups[first_video + video], strict=True):
            others = group[group != slot]
            if len(others):
                weight = max(1 / (len(others) + 1), options["DTM_beta"])
                tokens[slot] = weight * source[slot] + (1 - weight) * source[others].mean(0)
                merges += 1
        written.append(tokens)
    assert merges > 0

    def replace(module, args, kwargs, output):  # the prompts here hold videos only: every tower call is theirs
        output.pooler_output = torch.cat(written)
        if getattr(output, "deepstack_features", None):  # Qwen3-VL: a merged slot's rows the mean of its group's
            videos = slice(first_video, None)
            output.deepstack_features = deepstack_group_means(
                output.deepstack_features, kept[videos], groups[videos], counts[videos]
            )
        return output

    dropped = dropped_media(inputs, kept)
    handle = model.model.visual.register_forward_hook(replace, with_kwargs=True)
    with torch.no_grad():
        reference = masked_logits(model, inputs, dropped)
    handle.remove()
    return pruned, reference, dropped


@pytest.mark.parametrize("family", families("qwen2_5_vl", "qwen3_vl"))
def test_the_pruned_model_equals_masking_at_the_full_positions_with_the_merged_anchors(family: str) -> None:
    model = BUILDERS[family]()
    prompts = [[[1], ("video", (4, 4, 6)), [6, 7], ("video", (3, 4, 4)), [9]]]
    inputs = video_batch(prompts, qwen3=family == "qwen3_vl")
    options = AUTHORS | {"retention_ratio": 0.5, "DySeg_c": 2, "DySeg_ignore": 0.999}
    pruned, reference, dropped = pruned_with_merges(model, inputs, options)
    assert bool(dropped.any())
    stays = ~dropped[0]
    torch.testing.assert_close(pruned[0], reference[0, stays], rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", families("qwen2_5_vl"))
def test_a_padded_batch_of_different_clips_equals_each_clip_alone(family: str) -> None:
    model = vitrim.vlm.apply(BUILDERS[family](), "fastvid", retention_ratio=0.5, DySeg_c=2)
    assert_batch_equals_each_alone(model, MIXED, qwen3=family == "qwen3_vl")


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("retention_ratio", 0.0, r"a float in \(0, 1\]"),
        ("retention_ratio", 1.5, r"a float in \(0, 1\]"),
        ("DySeg_c", 0, r"an int >= 1"),
        ("DySeg_c", 2.0, r"an int >= 1"),
        ("DySeg_tau", "high", r"a float"),
        ("DySeg_ignore", float("nan"), r"a float"),
        ("STPrune_d", -0.1, r"a float in \[0, 1\]"),
        ("DTM_p", True, r"an int >= 1"),
        ("DTM_beta", 2, r"a float in \[0, 1\]"),
    ],
)
def test_bad_options_are_refused_in_one_line(option: str, value, expected: str) -> None:
    model = BUILDERS["qwen2_vl"]()
    line = re.escape(f"{option}={value!r} for vlm method 'fastvid' must be ") + expected
    with pytest.raises(ValueError, match=f"^{line}"):
        vitrim.vlm.apply(model, "fastvid", **{option: value})
    assert not hasattr(model, "_vitrim_vlm")


def test_a_ratio_that_keeps_nothing_of_a_temporal_patch_is_refused() -> None:
    model = vitrim.vlm.apply(BUILDERS["qwen2_vl"](), "fastvid", retention_ratio=0.1)
    inputs = video_batch([[[1], ("video", (2, 4, 4)), [7]]])  # 4 tokens per temporal patch: int(0.4) = 0
    with pytest.raises(ValueError, match=r"^retention_ratio=0.1 keeps int\(4·0.1\) = 0 of a temporal patch's 4"):
        model(**inputs)

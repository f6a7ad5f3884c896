"""The analytic prefill MACs of a LLaVA-OneVision clip against independent counts: torch's FlopCounterMode on
transformers' own LlavaOnevisionForConditionalGeneration at tiny size given a video (every frame through the SigLIP
tower alone, the projector on every patch, the bilinear pooling, one newline token, the LLM), and every method's
count and own products by hand on LLaVA-OneVision-7B's shapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tiny_vlms.llava_onevision import VIDEO_TOKEN, clip, tiny_llava_onevision, video_tokens
from vitrim.cli import main
from vitrim.vlm.flops import LLAVA_ONEVISION_7B, VisionTower, prefill_cost
from vitrim.vlm.flops_video import clip as clip_of
from vitrim.vlm.flops_video import video_cost_table, video_methods, video_prefill_cost
from vitrim.vlm.method.cost import VLM, LanguageModel

# LLaVA-OneVision-7B, 16 frames: 27×27 = 729 patches each, pooled to 14×14 = 196 tokens, N = 3136; LLM width 3584
F, PATCHES, P, N, E, D, TEXT = 16, 729, 196, 3136, 3584, 1152, 94
ONEVISION_CLIP = clip_of(LLAVA_ONEVISION_7B, F)


def counted_macs(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2


def test_a_tiny_llava_onevision_clip_equals_transformers_count() -> None:
    """The whole forward (logits of the last position) on 3 frames of 7×7 patches pooled to 4×4, 5 text tokens."""
    model = tiny_llava_onevision()
    model.set_attn_implementation("eager")
    frames = 3
    ids = torch.tensor([[7, 8, 9] + [VIDEO_TOKEN] * video_tokens(frames) + [10, 11]])
    pixels = clip(frames, 1)[None]
    counted = counted_macs(lambda: model(input_ids=ids, pixel_values_videos=pixels, logits_to_keep=1))
    tiny = VLM(
        name="tiny-onevision",
        tower=VisionTower("tiny SigLIP", 14, 2, 32, 2, 4, 37),
        projector=((32, 32), (32, 32)),
        pool=1,
        llm=LanguageModel("tiny Qwen2", 32, 2, 4, 2, 8, 37, 99),
        cut_before_projector=False,
        video_unit="frame",
        pooled_side=4,  # ⌈7/2⌉
        text_per_video=1,
    )
    video = clip_of(tiny, frames, 14)
    cost = video_prefill_cost(video, text_tokens=5)
    assert cost.tokens_per_layer == (frames * 16 + 1 + 5,) * 2
    assert cost.total == counted


def _siglip_frame() -> int:
    """One frame through LLaVA-OneVision-7B's 26 SigLIP layers: the patch embedding (a 14×14×3 kernel per patch),
    q, k, v, o (4·D² per patch), the attention over the frame's 729 patches, fc1 and fc2."""
    layer = 4 * PATCHES * D * D + 2 * PATCHES * PATCHES * D + 2 * PATCHES * D * 4304
    return PATCHES * 3 * 14 * 14 * D + 26 * layer


def _qwen2_7b(tokens: int) -> int:
    """Qwen2-7B's 28 layers on ``tokens`` positions (q and o 28 heads, k and v 4 heads of 128, attention, the
    gated MLP) and its LM head on the last position."""
    layer = tokens * E * (2 * 28 * 128 + 2 * 4 * 128) + 2 * 28 * tokens * tokens * 128 + 3 * tokens * E * 18944
    return 28 * layer + E * 152064


def test_the_unmodified_7b_clip_by_hand() -> None:
    full = video_prefill_cost(ONEVISION_CLIP, text_tokens=TEXT)
    assert ONEVISION_CLIP.image_tokens == N and ONEVISION_CLIP.tokens_per_temporal_patch == P
    assert full.tower == F * _siglip_frame()
    assert full.projector == F * PATCHES * (D * E + E * E)  # every patch, before the pooling
    assert full.tokens_per_layer == (N + 1 + TEXT,) * 28 and full.llm == _qwen2_7b(N + 1 + TEXT)
    assert full.image_tokens_entering_llm == N  # the newline is counted with the text: never pruned


def test_each_method_on_the_7b_clip_by_hand() -> None:
    row = lambda method, **kw: video_prefill_cost(ONEVISION_CLIP, method, text_tokens=TEXT, **kw)  # noqa: E731
    fixed = 1 + TEXT  # the newline and the text
    evs = row("evs", share=0.25)  # max(P, int(F·P·0.25)) = 784; a cosine (3E) for each token after frame 0
    assert (evs.image_tokens_entering_llm, evs.method_own) == (784, 3 * (F - 1) * P * E)
    assert evs.llm == _qwen2_7b(784 + fixed)
    assert row("evs", options={"video_pruning_rate": 0.99}).image_tokens_entering_llm == P  # one frame at least
    vidcom2 = row("vidcom2", share=0.25)  # max(F, int(N·0.25)); the variances (N·E), two distances of E/2 each
    assert (vidcom2.image_tokens_entering_llm, vidcom2.method_own) == (784, N * E + 2 * N * (E // 2))
    downsample = row("temporal_downsample", share=0.25)  # stride 4: frames 0, 4, 8, 12 whole, no products
    assert (downsample.image_tokens_entering_llm, downsample.method_own) == (4 * P, 0)
    assert row("temporal_downsample", options={"stride": 3}).image_tokens_entering_llm == math.ceil(F / 3) * P
    flashvid = row("flashvid", share=0.25)  # B = ⌈196·0.25·1.25⌉ = 62 per frame
    attention = 2 * F * PATCHES * D * D + F * PATCHES * PATCHES * D  # the last layer's q, k and q·kᵀ per frame
    pairs = P * P * E  # one frame's P × P cosines (ADTS, TSTM against the frame before, DPC)
    assert flashvid.image_tokens_entering_llm == F * 62
    assert flashvid.method_own == attention + (F + (F - 1) + F) * pairs
    for method in ("visionzip", "random", "divprune", "fastervlm"):  # round(0.25·196) = 49 of each frame's 196
        video = row(method, share=0.25)
        assert video.keep == 49 and video.image_tokens_entering_llm == F * 49
        one_frame = prefill_cost(LLAVA_ONEVISION_7B, method, 49, text_tokens=TEXT)  # the config holds one frame
        assert video.method_own == F * one_frame.method_own
        assert video.llm == _qwen2_7b(F * 49 + fixed)


def test_fastvid_s_pooling_head_equals_torchs_count_with_the_method_running(monkeypatch) -> None:
    """FastVID's OneVision form on the tiny model: torch's count of every product its SigLIP pooling head runs
    (PoolingHead.read, during the model's forward with the method applied) equals the count per frame."""
    from test_fastvid_onevision import tiny_siglip

    import vitrim.vlm
    from vitrim.vlm.method.fastvid_onevision import PoolingHead, pooling_head_macs

    model = tiny_llava_onevision()
    read, seen = PoolingHead.read, []

    def counted_read(self, states, rows, columns):
        with FlopCounterMode(display=False) as counter:
            out = read(self, states, rows, columns)
        seen.append((len(states), counter.get_total_flops() // 2))
        return out

    monkeypatch.setattr(PoolingHead, "read", counted_read)
    frames = 3
    ids = torch.tensor([[7, 8, 9] + [VIDEO_TOKEN] * video_tokens(frames) + [10, 11]])
    siglip = tiny_siglip(model).requires_grad_(False)  # torch's module tracker hooks a probe that needs grad
    vitrim.vlm.apply(model, "fastvid", siglip=siglip, retention_ratio=0.5)
    try:
        with torch.no_grad():
            model(input_ids=ids, pixel_values_videos=clip(frames, 1)[None], logits_to_keep=1)
    finally:
        vitrim.vlm.remove(model)
    tower = VisionTower("tiny SigLIP", 14, 2, 32, 2, 4, 37)  # 7×7 patches of a 32-wide tower, an MLP of 37
    assert seen == [(frames, frames * pooling_head_macs(tower))]


def test_fastvid_on_the_7b_clip_by_hand() -> None:
    """The head per frame: its attention twice (the probe's q and out D² each, k and v 2·729·D², q·kᵀ and A·V
    2·729·D), its MLP once on the pooled vector (2·D·4304); then DPC and DTM's bounds as on Qwen (P²·E per frame,
    N·kept·E); at most int(196·0.25) = 49 tokens a frame."""
    row = video_prefill_cost(ONEVISION_CLIP, "fastvid", 0.25, text_tokens=TEXT)
    head = 2 * (2 * D * D + 2 * PATCHES * D * D + 2 * PATCHES * D) + 2 * D * 4304
    assert row.image_tokens_entering_llm == F * 49
    assert row.method_own == F * head + F * P * P * E + N * F * 49 * E
    default = video_prefill_cost(ONEVISION_CLIP, "fastvid", options={})  # the authors' OneVision 0.10: 19 a frame
    assert default.image_tokens_entering_llm == F * 19


def test_what_vitrim_refuses_on_llava_onevision_is_left_out_and_refused_in_one_line() -> None:
    rows = [r.method for r in video_cost_table(ONEVISION_CLIP, (0.25,))]
    assert {"evs", "vidcom2", "temporal_downsample", "fastvid", "flashvid", "flashvid+flashvid_llm"} <= set(rows)
    assert "cdpruner" not in rows and "visionzip" in rows
    assert set(video_methods(ONEVISION_CLIP)) == set(rows[1:])
    with pytest.raises(ValueError, match="reads the prompt; on llava-onevision-7b vitrim runs it on images only"):
        video_prefill_cost(ONEVISION_CLIP, "cdpruner", 0.25)
    assert video_prefill_cost(ONEVISION_CLIP, "cdpruner", 0.25, options={"theta": 0.0}).keep == 49
    with pytest.raises(ValueError, match="size=448 for llava-onevision-7b: its processor resizes every frame to 384"):
        clip_of(LLAVA_ONEVISION_7B, 16, 448)


def test_cli_counts_a_onevision_clip(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["vlm", "flops", "--video", "16", "--share", "0.25", "--models", "llava-onevision-7b"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "llava-onevision-7b, 16 frames of 384×384 px: 11664 patches, 196 video tokens per frame" in printed
    assert "| evs | 0.25 | video_pruning_rate=0.75 |" in printed
    assert "| fastvid | 0.25 | retention_ratio=0.25 |" in printed


def test_cli_size_sets_the_qwen_clips_and_onevision_keeps_its_384(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vlm", "flops", "--video", "16", "--size", "224", "--share", "0.25", "--methods", "evs"]) == 0
    printed = capsys.readouterr().out
    assert "qwen2.5-vl-7b, 16 temporal patches of 224×224 px" in printed
    assert "llava-onevision-7b, 16 frames of 384×384 px" in printed
    named = ["vlm", "flops", "--video", "16", "--size", "224", "--models", "llava-onevision-7b"]
    assert main(named) == 2
    assert "size=224 for llava-onevision-7b: its processor resizes every frame to 384 px" in capsys.readouterr().err

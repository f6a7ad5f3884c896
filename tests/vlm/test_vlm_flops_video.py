"""The analytic prefill MACs of a video clip against independent counts: torch's FlopCounterMode on transformers' own
Qwen2.5-VL and Qwen3-VL towers given a video (each temporal patch its own attention segment, windows, DeepStack
mergers), and the methods' counts and own products by hand on Qwen2.5-VL-7B's and Qwen3-VL-8B's real shapes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitrim.cli import main
from vitrim.vlm.flops import LLAVA_15_7B, QWEN3_VL_8B, QWEN25_VL_7B, VisionTower, prefill_cost, tower_macs
from vitrim.vlm.flops_video import clip, video_cost_table, video_methods, video_prefill_cost

transformers = pytest.importorskip("transformers")

# Qwen2.5-VL-7B, 16 temporal patches at 448 px: 32×32 patches each, 16×16 = 256 tokens, N = 4096; LLM width 3584
T, P, N, E, D, TEXT = 16, 256, 4096, 3584, 1280, 94
PATCHES = T * 1024
QWEN25_CLIP = clip(QWEN25_VL_7B, T, 448)


def counted_macs(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2


def test_a_qwen25_video_tower_equals_transformers_count() -> None:
    """3 temporal patches of 16×16 patches, 8×8-patch windows in block 0, block 1 global within each temporal
    patch (transformers cuts cu_seqlens at every temporal patch), then the merger on every token."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    frames, side = 2, 16
    pixels = torch.randn(frames * side * side, 3 * 2 * 14 * 14)
    counted = counted_macs(lambda: model(pixels, grid_thw=torch.tensor([[frames, side, side]])))
    tower = VisionTower("tiny", side * 14, 14, 32, 2, 2, 40, gated_mlp=True, temporal_patch=2, window=64,
                        full_attention_layers=(1,), temporal_patches=frames)  # fmt: skip
    merger = frames * (side * side // 4) * (128 * 128 + 128 * 48)
    assert tower_macs(tower) + merger == counted
    global_block = 2 * frames * side**2 * side**2 * 32  # per temporal patch, not over the whole clip
    assert global_block < 2 * (frames * side**2) ** 2 * 32


def test_a_qwen3_video_tower_and_its_deepstack_mergers_equal_transformers_count() -> None:
    """Qwen3-VL: no windows, every block within its temporal patch, a plain (fc1, fc2) MLP, and the merger plus one
    DeepStack merger per tapped block on every token (what QWEN3_VL_8B's projector lists four times)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = Qwen3VLVisionModel(config).eval()
    frames, side = 3, 8
    pixels = torch.randn(frames * side * side, 3 * 2 * 16 * 16)
    counted = counted_macs(lambda: model(pixels, grid_thw=torch.tensor([[frames, side, side]])))
    tower = VisionTower("tiny", side * 16, 16, 32, 2, 2, 40, temporal_patch=2, temporal_patches=frames)
    mergers = 3 * frames * (side * side // 4) * (128 * 128 + 128 * 48)
    assert tower_macs(tower) + mergers == counted
    assert QWEN3_VL_8B.projector == ((4608, 4608), (4608, 4096)) * 4


def test_the_unmodified_clip_by_hand() -> None:
    full = video_prefill_cost(QWEN25_CLIP, text_tokens=TEXT)
    assert QWEN25_CLIP.image_tokens == N and QWEN25_CLIP.tokens_per_temporal_patch == P
    assert full.tokens_per_layer == (N + TEXT,) * 28 and full.image_tokens_entering_llm == N
    assert full.projector == N * (5120 * 5120 + 5120 * 3584)
    qwen3 = clip(QWEN3_VL_8B, T, 448)  # 28×28 patches of 16 px, 14×14 = 196 tokens; a timestamp of 8 tokens each
    stamped = video_prefill_cost(qwen3, text_tokens=TEXT)
    assert stamped.tokens_per_layer == (T * 196 + TEXT + 8 * T,) * 36
    evs = video_prefill_cost(qwen3, "evs", 0.25, text_tokens=TEXT)  # the timestamps stay
    assert evs.tokens_per_layer == (784 + TEXT + 8 * T,) * 36


def test_the_video_methods_counts_and_own_products_by_hand() -> None:
    row = lambda method, **kw: video_prefill_cost(QWEN25_CLIP, method, text_tokens=TEXT, **kw)  # noqa: E731
    evs = row("evs", share=0.25)  # max(P, int(t·P·(1 − 0.75))) = 1024; a cosine (3E) for each of (t − 1)·P tokens
    assert (evs.image_tokens_entering_llm, evs.method_own) == (1024, 3 * 15 * 256 * E)
    assert evs.options == {"video_pruning_rate": 0.75} and evs.tokens_per_layer == (1024 + TEXT,) * 28
    assert row("evs", options={"video_pruning_rate": 0.99}).image_tokens_entering_llm == P  # never below one patch
    vidcom2 = row("vidcom2", share=0.25)  # the variances (N·E) and two distances over half the channels
    assert (vidcom2.image_tokens_entering_llm, vidcom2.method_own) == (1024, N * E + 2 * N * (E // 2))
    assert row("temporal_downsample", share=0.25).image_tokens_entering_llm == 4 * P  # stride 4: patches 0, 4, 8, 12
    assert row("temporal_downsample", options={"stride": 3}).image_tokens_entering_llm == 6 * P  # ⌈16 / 3⌉
    fastvid = row("fastvid", share=0.25)  # t·int(P·0.25); salience, DPC of each temporal patch, DTM (bounds)
    salience = 2 * PATCHES * D * D + N * D
    assert fastvid.image_tokens_entering_llm == 1024
    assert fastvid.method_own == salience + T * P * P * E + N * 1024 * E
    flashvid = row("flashvid", share=0.25)  # B = ⌈256·0.25·1.25⌉ = 80 per temporal patch
    attention = 2 * PATCHES * D * D + PATCHES * 1024 * D
    assert flashvid.image_tokens_entering_llm == T * 80
    assert flashvid.method_own == attention + (T + (T - 1) + T) * P * P * E
    assert row("flashvid", options={"retention_ratio": 0.25, "temporal_threshold": 1.0}).image_tokens_entering_llm \
        == T * math.ceil(80 * 0.7)  # no merging: the ADTS picks alone  # fmt: skip


def test_flashvid_s_two_stages_stack_by_hand() -> None:
    """flashvid leaves 1280; flashvid_llm keeps ⌈0.3·1280⌉ = 384 from layer 20, its own the last token's attention
    row at layer 19 over the 1280 video and 94 text tokens (query, keys, q·kᵀ)."""
    stack = video_prefill_cost(QWEN25_CLIP, "flashvid+flashvid_llm", 0.25, text_tokens=TEXT)
    alone = video_prefill_cost(QWEN25_CLIP, "flashvid", 0.25, text_tokens=TEXT)
    assert stack.tokens_per_layer == (1280 + TEXT,) * 20 + (384 + TEXT,) * 8
    keys = 1374
    row = E * 28 * 128 + keys * E * 4 * 128 + 28 * keys * 128
    assert stack.method_own == alone.method_own + row
    assert stack.image_tokens_layer_mean == (20 * 1280 + 8 * 384) / 28 == 1024  # the share, as the authors meant


def test_an_image_method_runs_on_each_temporal_patch() -> None:
    """keep = round(share·P) tokens of each temporal patch; its own work t times its work on one 448-px image."""
    image = dataclasses.replace(QWEN25_VL_7B, tower=dataclasses.replace(QWEN25_VL_7B.tower, image_size=448))
    for method in ("visionzip", "random", "divprune"):
        video = video_prefill_cost(QWEN25_CLIP, method, 0.25, text_tokens=TEXT)
        assert video.keep == 64 and video.image_tokens_entering_llm == T * 64
        assert video.method_own == T * prefill_cost(image, method, 64, text_tokens=TEXT).method_own


def test_every_method_reduces_a_clip_of_16_and_64() -> None:
    for config in (QWEN25_VL_7B, QWEN3_VL_8B):
        for frames in (16, 64):
            rows = video_cost_table(clip(config, frames, 448))
            assert [r.method for r in rows[1:4]] == [video_methods()[0]] * 3
            assert all(r.total < rows[0].total for r in rows[1:]), (config.name, frames)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: clip(QWEN25_VL_7B, 16, 450), "size=450 for qwen2.5-vl-7b: expected a multiple of 112 px"),
        (lambda: clip(QWEN3_VL_8B, 0, 448), "temporal_patches=0: expected an int in 1..4096"),
        (lambda: video_prefill_cost(QWEN25_CLIP, "fastv", 0.5), r"'fastv' \(in_llm\) is not counted alone"),
        (lambda: video_prefill_cost(QWEN25_CLIP, "evs", 1.5), r"share=1.5: expected a fraction .* in \(0, 1\]"),
        (lambda: video_prefill_cost(QWEN25_CLIP, "evs"), "method 'evs' on a video needs share="),
        (lambda: prefill_cost(QWEN25_VL_7B, "evs", 64), "method 'evs' reduces videos and refuses images"),
        (lambda: prefill_cost(QWEN25_CLIP, "random", 64), "holds a video of 16 temporal patches"),
        (lambda: video_prefill_cost(LLAVA_15_7B), "llava-1.5-7b takes no video; give clip"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_value(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_cli_prints_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "video.json"
    argv = ["vlm", "flops", "--video", "16,64", "--share", "0.25", "--methods", "evs,flashvid+flashvid_llm,random",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| evs | 0.25 | video_pruning_rate=0.75 |" in printed and "| random | 0.25 | keep=64 |" in printed
    payload = json.loads(out.read_text())
    assert set(payload["clips"]) == {
        f"{model}, {t} temporal patches of 448×448 px" for model in ("qwen2.5-vl-7b", "qwen3-vl-8b") for t in (16, 64)
    } | {f"llava-onevision-7b, {t} frames of 384×384 px" for t in (16, 64)}
    rows = payload["clips"]["qwen2.5-vl-7b, 16 temporal patches of 448×448 px"]
    assert [(r["method"], r["share"]) for r in rows] == [
        ("none", None), ("evs", 0.25), ("flashvid+flashvid_llm", 0.25), ("random", 0.25)
    ]  # fmt: skip
    assert rows[1]["image_tokens_entering_llm"] == 1024 and rows[1]["total"] < rows[0]["total"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--video", "16", "--keep", "4"], "--keep counts an image's tokens; with --video give --share"),
        (["--video", "x"], "--video must be comma-separated ints"),
        (["--video", "16", "--share", "0"], "--share must be comma-separated fractions in (0, 1]"),
        (["--video", "16", "--models", "gemma-3-4b"], "--models must name some of: qwen2.5-vl-7b, qwen3-vl-8b"),
        (["--video", "16", "--size", "100"], "size=100 for qwen2.5-vl-7b: expected a multiple of 112 px"),
        (["--video", "16", "--methods", "tome"], "method 'tome' (tower) is not counted alone"),
        (["--methods", "evs"], "'evs' reduces videos and refuses images; give --video T"),
        (["--share", "0.5"], "--share describes a clip; give --video T too"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vlm", "flops", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

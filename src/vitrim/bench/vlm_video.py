"""``vitrim bench vlm --video T``: the prefill time of a scaled-down Qwen2.5-VL-7B given a video clip, with each video
method and per-temporal-patch image method, against the unmodified model in the same run.

The model is transformers' own ``Qwen2_5_VLForConditionalGeneration`` built from a config with random weights: every
layer has Qwen2.5-VL-7B's shapes (tower blocks of width 1280, SwiGLU MLP 3420, 16 heads; the 2×2 merger 5120 ->
5120 -> 3584; LLM layers of width 3584, MLP 18944, 28 heads, 4 key/value heads), there are fewer of them (default:
1 tower block, attending over its temporal patch as the real tower's last block does, and 2 LLM layers, so that
FlashVID's in-LLM stage has a layer to cut before: layer 1 of 2 here, 20 of 28 in the real model), and the clip is
small (default 8 temporal patches of 224 × 224 px: 16 × 16 patches, 8 × 8 = 64 video tokens each, 512 in all), so
a prefill fits a 2-core CPU. The prompt: ``text_tokens`` text tokens around the video (vision start, the video
tokens, vision end).

Each case asks for a ``share`` of the video's tokens in the method's own options (:func:`vitrim.vlm.flops_video.
share_options`; an image method keeps round(share · P) tokens of each temporal patch). Timing is
:mod:`vitrim.bench.vlm`'s: every case once untimed, then in turns, one prefill each per round
(``model(**inputs, logits_to_keep=1)``), the median over rounds, the speed-up the median of the per-round ratios to
the unmodified model; the tower and the method's own calls (its scoring taps, its selection, an in-LLM stage's
``choose``) timed inside each prefill. MACs come from :mod:`vitrim.vlm.flops_video` on the same scaled shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from vitrim.bench.vlm import SETTING_RANGES as IMAGE_RANGES
from vitrim.bench.vlm import CaseTimes, _import_torchvision_if_any, check_sizes, time_cases, timing_cells, timing_row
from vitrim.extras import require
from vitrim.models.config_limits import LIMITS
from vitrim.vlm import apply
from vitrim.vlm.flops import QWEN25_VL_7B, VLM, LanguageModel
from vitrim.vlm.flops_video import STACKS, clip, share_options, video_methods, video_prefill_cost
from vitrim.vlm.method import method_class

PATCH, MERGE, WINDOW_PX = 14, 2, 112  # Qwen2.5-VL's patch, merger and attention window (8 × 8 patches)
TEXT_BEFORE_VIDEO = 15  # the system prompt and "<|im_start|>user\n" before the video in Qwen's chat template
DEFAULT_METHODS = ("evs", "vidcom2", "temporal_downsample", "fastvid", "flashvid", "flashvid+flashvid_llm", "random",
                   "visionzip")  # fmt: skip
SHARED = ("vision_layers", "llm_layers", "vision_width", "vision_mlp", "vision_heads", "llm_width", "llm_mlp",
          "llm_heads", "repeats", "warmup", "seed")  # fmt: skip  # ranged as the image bench's
SETTING_RANGES: dict[str, tuple[int, int]] = {
    **{name: IMAGE_RANGES[name] for name in SHARED},
    "vocab": (8, 2**20),  # text, and the image, video, vision start and end ids
    "llm_kv_heads": (1, LIMITS["num_attention_heads"]),
    "size": (WINDOW_PX, 8192),
    "temporal_patches": (1, 4096),
    "text_tokens": (TEXT_BEFORE_VIDEO, 2**17),
}
SIZES = ("vision_layers", "llm_layers", "vocab", "vision_width", "vision_mlp", "vision_heads", "llm_width", "llm_mlp",
         "llm_heads", "llm_kv_heads", "size")  # fmt: skip  # what --set may change


@dataclass(frozen=True)
class VideoBenchSettings:
    """What ``vitrim bench vlm --video`` builds and runs; the widths are Qwen2.5-VL-7B's."""

    vision_layers: int = 1
    llm_layers: int = 2
    vocab: int = 1024  # the last four ids: image, video, vision start, vision end
    vision_width: int = 1280
    vision_mlp: int = 3420
    vision_heads: int = 16
    llm_width: int = 3584
    llm_mlp: int = 18944
    llm_heads: int = 28
    llm_kv_heads: int = 4
    size: int = 224  # px per side of each temporal patch: a multiple of 112 (whole attention windows)
    temporal_patches: int = 8
    text_tokens: int = 94
    shares: tuple[float, ...] = (0.25,)
    methods: tuple[str, ...] = ()  # empty: DEFAULT_METHODS
    repeats: int = 3
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_sizes(self, SETTING_RANGES)
        if self.llm_heads % self.llm_kv_heads:
            raise ValueError(f"llm_heads={self.llm_heads} is not divisible by llm_kv_heads={self.llm_kv_heads}")
        if self.size % WINDOW_PX:
            raise ValueError(f"size={self.size} must be a multiple of {WINDOW_PX} px (whole attention windows)")
        bad = [s for s in self.shares if isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s <= 1]
        if not self.shares or bad:
            raise ValueError(f"shares must be fractions of the video's tokens in (0, 1], got {self.shares}")
        if any(name in STACKS for name in self.methods) and self.llm_layers < 2:
            raise ValueError(f"llm_layers={self.llm_layers}: a stack's in-LLM stage needs 2 layers or more")

    @property
    def side(self) -> int:
        """Patches per side of a temporal patch."""
        return self.size // PATCH

    @property
    def video_tokens(self) -> int:
        return self.temporal_patches * (self.side // MERGE) ** 2

    @property
    def stack_layer(self) -> int:
        """The layer an in-LLM stage of a stack cuts before: FlashVID's 20 of 28 scaled, at least 1."""
        return max(1, min(self.llm_layers - 1, round(self.llm_layers * 20 / 28)))


def bench_methods(s: VideoBenchSettings) -> list[str]:
    """``s.methods`` or :data:`DEFAULT_METHODS`; ``ValueError`` naming one that takes no video."""
    names = list(s.methods or DEFAULT_METHODS)
    known = video_methods()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"vlm method {unknown[0]!r} takes no video alone here; expected some of: {', '.join(known)}")
    return names


def flops_config(s: VideoBenchSettings) -> VLM:
    """The :mod:`vitrim.vlm.flops` description of the scaled-down model given the settings' clip."""
    tower = replace(
        QWEN25_VL_7B.tower, name=f"Qwen2.5-VL ViT ({s.vision_layers} blocks)", width=s.vision_width,
        layers=s.vision_layers, heads=s.vision_heads, mlp_width=s.vision_mlp,
        full_attention_layers=(s.vision_layers - 1,),
    )  # fmt: skip
    llm = LanguageModel(f"Qwen2.5 ({s.llm_layers} layers)", s.llm_width, s.llm_layers, s.llm_heads, s.llm_kv_heads,
                        s.llm_width // s.llm_heads, s.llm_mlp, s.vocab)  # fmt: skip
    merged = 4 * s.vision_width
    scaled = replace(QWEN25_VL_7B, name="scaled qwen2.5-vl-7b", tower=tower, llm=llm,
                     projector=((merged, merged), (merged, s.llm_width)))  # fmt: skip
    return clip(scaled, s.temporal_patches, s.size)


def build_model(s: VideoBenchSettings) -> nn.Module:
    """transformers' Qwen2_5_VLForConditionalGeneration with Qwen2.5-VL-7B's layer shapes, random weights, eval."""
    require("transformers", feature="vitrim bench vlm --video")
    _import_torchvision_if_any()
    import transformers

    half = s.llm_width // s.llm_heads // 2  # rotary pairs per head, split over time, rows, columns
    time_pairs = half // 4
    section = [time_pairs, (half - time_pairs) // 2, half - time_pairs - (half - time_pairs) // 2]  # [16, 24, 24]
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=s.vocab, hidden_size=s.llm_width, intermediate_size=s.llm_mlp, num_hidden_layers=s.llm_layers,
            num_attention_heads=s.llm_heads, num_key_value_heads=s.llm_kv_heads, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 1000000.0},
            bos_token_id=0, eos_token_id=1, pad_token_id=None,
        ),
        vision_config=dict(
            depth=s.vision_layers, hidden_size=s.vision_width, intermediate_size=s.vision_mlp,
            num_heads=s.vision_heads, out_hidden_size=s.llm_width, patch_size=PATCH, spatial_merge_size=MERGE,
            temporal_patch_size=2, window_size=WINDOW_PX, fullatt_block_indexes=[s.vision_layers - 1],
        ),
        image_token_id=s.vocab - 4, video_token_id=s.vocab - 3, vision_start_token_id=s.vocab - 2,
        vision_end_token_id=s.vocab - 1,
    )  # fmt: skip
    torch.manual_seed(s.seed)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


def bench_inputs(s: VideoBenchSettings) -> dict[str, torch.Tensor]:
    """One prompt as Qwen's processor writes it: text, vision start, the video's tokens, vision end, text (in all
    ``text_tokens`` text tokens, the two markers among them), and the clip's patches (random pixels)."""
    generator = torch.Generator().manual_seed(s.seed)
    text = torch.randint(0, s.vocab - 4, (s.text_tokens - 2,), generator=generator)
    video = torch.full((s.video_tokens,), s.vocab - 3)
    ids = torch.cat([text[:TEXT_BEFORE_VIDEO], torch.tensor([s.vocab - 2]), video, torch.tensor([s.vocab - 1]),
                     text[TEXT_BEFORE_VIDEO:]])[None]  # fmt: skip
    patches = s.temporal_patches * s.side * s.side
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": 2 * (ids == s.vocab - 3).int(),  # text 0, image 1, video 2
        "pixel_values_videos": torch.randn(patches, 3 * 2 * PATCH * PATCH, generator=generator),
        "video_grid_thw": torch.tensor([[s.temporal_patches, s.side, s.side]]),
    }


@dataclass
class VideoCase(CaseTimes):
    """A timed case: the method (or stack) at a share of the video's tokens, the options that ask for it."""

    share: float | None = None
    options: dict[str, Any] | None = None


def case_options(method: str, share: float, s: VideoBenchSettings) -> list[tuple[str, dict[str, Any]]]:
    """The ``apply`` calls of one case, in stack order: (method, its options)."""
    if method in STACKS:
        first, second = STACKS[method]
        return [(first, share_options(method, share)), (second, {"layer": s.stack_layer})]
    if method_class(method).reads_time:
        return [(method, share_options(method, share))]
    return [(method, {"keep": max(1, round(share * (s.side // MERGE) ** 2))})]


def run_bench(
    s: VideoBenchSettings, *, model: nn.Module | None = None, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Time every case (module doc); returns the rows (JSON-ready) and the threads used."""
    model = build_model(s) if model is None else model
    cases = [VideoCase("none", None)] + [
        VideoCase(m, None, share=share, options=dict(case_options(m, share, s)[0][1]))
        for m in bench_methods(s) for share in s.shares
    ]  # fmt: skip

    def install(case: CaseTimes) -> bool:
        share = case.share if isinstance(case, VideoCase) else None
        applied = [] if share is None else case_options(case.method, share, s)
        for name, options in applied:
            apply(model, name, **options)
        return bool(applied)

    time_cases(model, bench_inputs(s), cases, install, warmup=s.warmup, repeats=s.repeats, log=log)
    return {"rows": summarize(cases, s), "threads": torch.get_num_threads()}


def case_macs(case: VideoCase, s: VideoBenchSettings) -> int:
    """The case's prefill MACs by :mod:`vitrim.vlm.flops_video` on the scaled shapes."""
    video = flops_config(s)
    if case.share is None:
        return video_prefill_cost(video, text_tokens=s.text_tokens).total
    return video_prefill_cost(
        video, case.method, case.share, text_tokens=s.text_tokens,
        layer=s.stack_layer if case.method in STACKS else None,
    ).total  # fmt: skip


def summarize(cases: Sequence[VideoCase], s: VideoBenchSettings) -> list[dict[str, Any]]:
    """Per case: median times, the paired speed-up, the MAC speed-up and the issue's two targets."""
    full_macs = case_macs(cases[0], s)
    return [
        {"method": case.method, "share": case.share, "options": case.options or {},
         **timing_row(cases[0], case, case_macs(case, s), full_macs)}
        for case in cases
    ]  # fmt: skip


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table, with the two targets marked met or not met."""
    lines = [
        "| method | share | options | prefill ms | tower ms | method's own ms | speed-up | MAC speed-up | speed-up / "
        "MAC speed-up (≥ 0.6) | own / prefill (≤ 5 %) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        first = r["share"] is None
        given = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["options"].items())
        share = "all" if first else format(r["share"], "g")
        lines.append(f"| {r['method']} | {share} | {given} | {timing_cells(r, targets=not first)} |")
    return "\n".join(lines) + "\n"

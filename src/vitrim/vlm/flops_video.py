"""Analytic prefill cost of a video clip on Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision, with and without a
token-reduction method.

On Qwen a clip is t temporal patches (two frames each) of size × size pixels: the tower runs on t·(size/p)² patches,
each temporal patch its own attention segment (transformers cuts ``cu_seqlens`` at every temporal patch; Qwen2.5-VL's
windows lie inside it), the merger on every one of the N = t·P tokens it makes, and the LLM on the tokens a method
leaves, the text and, on Qwen3-VL, the timestamp text before each temporal patch (never pruned). On LLaVA-OneVision
a clip is t sampled frames, each resized to the tower's 384 px and run through it alone (27×27 patches), the
projector on every patch, each frame's grid pooled to P = 14×14 tokens (no products), and one newline token after
the last frame, which no method prunes; a "temporal patch" below is then a frame. The convention is
:mod:`vitrim.vlm.flops`'s (matrix products, in multiply-adds).

Which methods, and what each row asks of it: a row asks for a ``share`` of the video's N tokens, given to each
method in its own options (:func:`share_options`):

- the video methods (``vitrim.vlm.method_info(name).video``) decide their count from their options, and their file
  counts it (``Method.cost`` reads the clip's t and P): ``evs`` and ``vidcom2`` prune 1 − share
  (``video_pruning_rate``), ``temporal_downsample`` keeps every round(1/share)-th temporal patch, ``fastvid`` and
  ``flashvid`` take the share as their ``retention_ratio`` (FlashVID's pre-LLM stage keeps its budget, 1.25 times
  that, and ``flashvid+flashvid_llm``, the two stages stacked, cuts to 0.3 of it at layer 20: on Qwen2.5-VL the
  layer mean is then the share itself);
- an image method runs on each temporal patch as on an image (as vitrim runs it on video): round(share·P) tokens of
  each, its own work t times its work on one temporal patch;
- an in-LLM or tower method alone is refused here (vitrim runs the in-LLM ones on a video; they are not counted
  alone on a clip yet);
- on LLaVA-OneVision, ``fastvid`` runs its authors' OneVision form, which scores each frame with SigLIP's
  attention-pooling head (from its ``siglip=``): its file counts that head's work per frame in its own; ``cdpruner``
  reading the prompt (refused there) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from vitrim.vlm.flops import (
    LLAVA_ONEVISION_7B,
    QWEN3_VL_8B,
    QWEN25_VL_7B,
    PrefillCost,
    _stage_counts,
    counted_methods,
    llm_macs,
    tower_macs,
)
from vitrim.vlm.method import method_class
from vitrim.vlm.method.base import StageOptions
from vitrim.vlm.method.cost import VLM, MethodCost

STACKS = {"flashvid+flashvid_llm": ("flashvid", "flashvid_llm")}  # pre-LLM stage, then in-LLM stage
VIDEO_CONFIGS = {config.name: config for config in (QWEN25_VL_7B, QWEN3_VL_8B, LLAVA_ONEVISION_7B)}
VIDEO_MODELS = tuple(VIDEO_CONFIGS)  # the configs that take a video
MOST_TEMPORAL_PATCHES = 4096  # a clip of over an hour at Qwen's 2 fps
QWEN_VIDEO_SIZE = 448  # a Qwen clip's side by default: 16×16 merged tokens (256) per temporal patch on Qwen2.5-VL


def share_options(method: str, share: float) -> dict[str, Any]:
    """The options that ask the video method ``method`` (or stack) for ``share`` of a video's tokens (module
    docstring); ``ValueError`` for a video method with no such option."""
    first = STACKS.get(method, (method,))[0]
    if first in ("evs", "vidcom2"):
        return {"video_pruning_rate": 1.0 - share}
    if first == "temporal_downsample":
        return {"stride": max(1, round(1.0 / share))}
    if first in ("fastvid", "flashvid"):
        return {"retention_ratio": share}
    raise ValueError(f"video method {method!r} has no option asking for a share of the tokens; give its options")


def video_methods(video: VLM | None = None) -> tuple[str, ...]:
    """The video rows by default: every counted video method, the stacks, then every counted pre-LLM image method
    (per temporal patch), read from the registry now; of ``video``'s config, those vitrim runs on it
    (:func:`refused_on`)."""
    pre_llm = counted_methods("pre_llm")
    videos = [name for name in pre_llm if method_class(name).reads_time]
    rows = (*videos, *STACKS, *(name for name in pre_llm if not method_class(name).reads_time))
    return rows if video is None else tuple(name for name in rows if refused_on(video, name) is None)


def refused_on(video: VLM, method: str, options: Mapping[str, Any] | None = None) -> str | None:
    """Why vitrim refuses ``method`` (or a stack) with ``options`` (default its own) on the video of ``video``'s
    config, None where it counts it. On LLaVA-OneVision (its frames pooled after the projector), as
    ``vitrim.vlm.families.llava_onevision`` refuses it, a method that reads the prompt (CDPruner with ``theta`` >
    0)."""
    cls = method_class(STACKS.get(method, (method,))[0])
    if video.pooled_side is None:
        return None
    model = video.name.split(",")[0]
    if cls(**(options or {})).reads_instruction():
        return f"method {method!r} reads the prompt; on {model} vitrim runs it on images only, not on a video's frames"
    return None


def clip(vlm: VLM, temporal_patches: int, size: int | None = None) -> VLM:
    """``vlm`` (one of :data:`VIDEO_MODELS`' configs) given a clip of ``temporal_patches`` temporal patches (on
    LLaVA-OneVision: frames) of ``size`` × ``size`` pixels (default :func:`default_size`); ``ValueError`` naming the
    value where the tower takes no video, or the size is not whole merged tokens (and, on Qwen2.5-VL, whole attention
    windows, which the count assumes), or not the size LLaVA-OneVision resizes every frame to."""
    tower = vlm.tower
    if vlm.video_unit is None:
        raise ValueError(f"{vlm.name} takes no video here; expected one of: {', '.join(VIDEO_MODELS)}")
    size = default_size(vlm) if size is None else size
    if isinstance(temporal_patches, bool) or not isinstance(temporal_patches, int):
        raise ValueError(f"temporal_patches={temporal_patches!r}: expected an int in 1..{MOST_TEMPORAL_PATCHES}")
    if not 1 <= temporal_patches <= MOST_TEMPORAL_PATCHES:
        raise ValueError(f"temporal_patches={temporal_patches!r}: expected an int in 1..{MOST_TEMPORAL_PATCHES}")
    side = tower.patch_size * (tower.window or vlm.pool) ** 0.5  # one window (Qwen2.5-VL) or one merged token
    unit = int(side)
    if vlm.pooled_side is not None:
        if size != tower.image_size or isinstance(size, bool):
            raise ValueError(
                f"size={size!r} for {vlm.name}: its processor resizes every frame to {tower.image_size} px; expected "
                f"{tower.image_size}"
            )
    elif isinstance(size, bool) or not isinstance(size, int) or size < unit or size % unit or size > 8192:
        what = "its 8×8-patch attention windows" if tower.window else "its 2×2-patch merged tokens"
        raise ValueError(f"size={size!r} for {vlm.name}: expected a multiple of {unit} px up to 8192 ({what})")
    units = {"temporal patch": "temporal patches", "frame": "frames"}[vlm.video_unit]
    frames = f"{temporal_patches} {units} of {size}×{size} px"
    return dataclasses.replace(
        vlm,
        name=f"{vlm.name}, {frames}",
        tower=dataclasses.replace(tower, image_size=size, temporal_patches=temporal_patches),
    )


def _method_cost(
    video: VLM, method: str, options: Mapping[str, Any], keep: int | None, text: int, layer: int | None = None
) -> MethodCost:
    """What ``method`` (a video method, a stack, or an image method at ``keep`` per temporal patch) costs of the
    clip and leaves the model; ``text``: every text token of the prompt; ``layer``: a stack's in-LLM ``layer=``."""
    if method in STACKS:
        first, second = STACKS[method]
        before = method_class(first)(**options).cost(video, video.image_tokens, text_tokens=text)
        entering = before.tokens_entering(video.image_tokens)
        inside: Any = method_class(second)()  # an in-LLM method: its drop_policy says where it cuts
        (stage,) = inside.drop_policy(StageOptions(keep=None, layer=layer)).drop_stages(video.llm.layers)
        kept = stage.tokens(entering)
        after = inside.cost(dataclasses.replace(video, image_tokens_in=entering), kept, text_tokens=text)
        # the cut where the stage's own drop policy puts it (its cost counts the authors' layer, 20)
        return MethodCost(own=before.own + after.own, llm_cuts=(*before.llm_cuts, (stage.layer, kept)))
    cls = method_class(method)
    if cls.stage != "pre_llm":
        raise ValueError(
            f"method {method!r} ({cls.stage}) is not counted alone on a clip here; the video rows take the pre-LLM "
            f"methods and the stacks {', '.join(STACKS)}"
        )
    if cls.reads_time:
        return cls(**options).cost(video, video.image_tokens, text_tokens=text)
    assert keep is not None
    frame = dataclasses.replace(video, tower=dataclasses.replace(video.tower, temporal_patches=1))
    one = cls(**options).cost(frame, keep, text_tokens=text)
    return MethodCost(own=video.temporal_patches * one.own, llm_cuts=((0, video.temporal_patches * keep),))


def video_prefill_cost(
    video: VLM,
    method: str = "none",
    share: float | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    text_tokens: int = 94,
    layer: int | None = None,
) -> PrefillCost:
    """The prefill MACs of the clip ``video`` (:func:`clip`) and ``text_tokens`` text tokens (and, on Qwen3-VL, the
    timestamps) under ``method`` asked for ``share`` of the video's tokens (module docstring), or given its
    ``options`` (a video method or stack; they replace the share's); ``layer``: a stack's in-LLM ``layer=`` (default
    its own, FlashVID's 20). ``keep`` in the row: an image method's tokens per temporal patch (None for the
    others)."""
    if video.video_unit is None:
        raise ValueError(f"{video.name} takes no video; give clip(model, temporal_patches, size) of: "
                         f"{', '.join(VIDEO_MODELS)}")  # fmt: skip
    known = ("none", *video_methods())
    if method in known and method != "none" and (refusal := refused_on(video, method, options)) is not None:
        raise ValueError(refusal)
    if method not in known:
        if isinstance(method, str) and method in counted_methods():
            _method_cost(video, method, {}, None, 0)  # raises the method's own refusal
        raise ValueError(f"unknown method {method!r} for a video; expected one of: {', '.join(known)}")
    if not isinstance(text_tokens, int) or isinstance(text_tokens, bool) or text_tokens < 0:
        raise ValueError(f"text_tokens must be an int >= 0, got {text_tokens!r}")
    n, per_frame, frames = video.image_tokens, video.tokens_per_temporal_patch, video.temporal_patches
    text = text_tokens + frames * video.text_per_temporal_patch + video.text_per_video
    keep = None
    chosen: dict[str, Any] = {}
    cost = MethodCost(own=0)
    if method != "none":
        if share is not None and (isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1):
            raise ValueError(f"share={share!r}: expected a fraction of the video's tokens in (0, 1]")
        video_method = method in STACKS or method_class(method).reads_time
        if options is not None and video_method:
            chosen = dict(options)
        elif share is None:
            raise ValueError(f"method {method!r} on a video needs share= (the fraction of its tokens kept)")
        else:
            chosen = share_options(method, share) if video_method else dict(options or {})
            keep = None if video_method else max(1, round(share * per_frame))
        cost = _method_cost(video, method, chosen, keep, text, layer)
    counts = _stage_counts(n, text, video.llm.layers, cost.llm_cuts)
    return PrefillCost(
        model=video.name,
        method=method,
        keep=keep,
        tower=tower_macs(video.tower),
        projector=video.projector_tokens * sum(i * o for i, o in video.projector),  # every token, every patch
        llm=llm_macs(video.llm, counts),
        method_own=cost.own,
        image_tokens_entering_llm=cost.tokens_entering(n),
        image_tokens_layer_mean=sum(c - text for c in counts) / video.llm.layers,
        tokens_per_layer=tuple(counts),
        share=None if method == "none" else share,
        options=chosen,
    )


def video_cost_table(
    video: VLM, shares: Sequence[float] = (0.5, 0.25, 0.125), *, text_tokens: int = 94,
    methods: Sequence[str] | None = None,
) -> list[PrefillCost]:  # fmt: skip
    """The unmodified clip, then every method (default :func:`video_methods` of ``video``'s config) at every share."""
    names = video_methods(video) if methods is None else methods
    rows = [video_prefill_cost(video, text_tokens=text_tokens)]
    for method in names:
        if method != "none":
            rows.extend(video_prefill_cost(video, method, share, text_tokens=text_tokens) for share in shares)
    return rows


def video_config(name: str) -> VLM:
    """The config ``name`` of :data:`VIDEO_MODELS`; ``ValueError`` naming the others."""
    if name not in VIDEO_CONFIGS:
        raise ValueError(f"model {name!r} takes no video here; expected one of: {', '.join(VIDEO_MODELS)}")
    return VIDEO_CONFIGS[name]


def default_size(vlm: VLM) -> int:
    """The side in pixels a clip's frames have by default: LLaVA-OneVision's tower size (384; its processor resizes
    every frame to it), else :data:`QWEN_VIDEO_SIZE`."""
    return vlm.tower.image_size if vlm.pooled_side is not None else QWEN_VIDEO_SIZE


__all__ = [
    "STACKS",
    "VIDEO_CONFIGS",
    "VIDEO_MODELS",
    "clip",
    "default_size",
    "refused_on",
    "share_options",
    "video_config",
    "video_cost_table",
    "video_methods",
    "video_prefill_cost",
]

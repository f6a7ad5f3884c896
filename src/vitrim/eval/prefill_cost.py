"""The prefill multiply-adds of one sample, with the methods and without, from :mod:`vitrim.vlm.flops` (a picture)
and :mod:`vitrim.vlm.flops_video` (a video).

:mod:`vitrim.vlm.flops` counts a model from its shapes (a ``VLM``: tower, projector, LLM), one picture at one
square resolution; :mod:`vitrim.vlm.flops_video` the same model given a clip (t temporal patches, or frames, of one
square size). The shapes are read here from the loaded checkpoint (its config, and the projector's matrices), for
the families those modules count. A picture:

- LLaVA-1.5 (:func:`llava_shapes`; LLaVA-1.5-7B gives :data:`vitrim.vlm.flops.LLAVA_15_7B`'s numbers): a CLIP tower
  with [CLS] read at one layer, a two-matrix projector, a LLaMA-type LLM;
- Qwen2.5-VL (:func:`qwen2_5_vl_shapes`), per picture: its tokens follow its size, so the shapes are those of the
  sample's own ``image_grid_thw``; counted where ``vitrim.vlm.flops``' tower is exact: a square grid of whole
  attention windows (its windowed blocks attend within ``window`` tokens each);
- Gemma 3 (:func:`gemma3_shapes`): SigLIP at the checkpoint's one size, average-pooled to ``mm_tokens_per_image``,
  one projection matrix.

A video (one per sample, with no picture; :func:`clip_counter`):

- Qwen2.5-VL (:func:`qwen2_5_vl_clip`): the sample's own ``video_grid_thw`` (t temporal patches of h×w patches),
  counted for square frames of whole attention windows, as a picture;
- Qwen3-VL (:func:`qwen3_vl_clip`): its ``video_grid_thw``, square frames; the projector is the merger and each
  DeepStack merger (every one runs on every video token); its timestamps are text the prompt already counts;
- LLaVA-OneVision (:func:`llava_onevision_clip`): the frames' count (each frame at the tower's one size, pooled
  after the projector, one newline token after the last frame).

A video's methods are counted as :func:`vitrim.vlm.flops_video.video_prefill_cost` counts them: a method that reads
time (``evs``, ``vidcom2``, ``temporal_downsample``) with the option that sets its count (``video_pruning_rate``,
``stride``) and its other options at their defaults; an image method on each temporal patch (``keep`` per temporal
patch) as on a picture. ``fastvid`` and ``flashvid`` (and their stack) are not counted per sample: their tokens
follow the clip's segments and clusters, which ``flops_video`` counts by a bound, not this sample's number.

Every other case records ``null`` with the reason, never a number not counted: the other families (LLaVA-NeXT's
tiles, Qwen2-VL, Qwen3-VL's pictures, PaliGemma, LLaVA-OneVision's pictures), a Qwen picture or frame off those
grids, a sample with other than one picture or one video, stacked methods (the modules count one), options other
than those named above set away from the method's defaults (a method's ``cost`` reads its registered defaults), a
count the modules refuse (a tower method on a pooling tower, an in-LLM method alone on a clip).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitrim.eval.model_args import MethodPlan

Grid = Sequence[int]  # a picture's (t, h, w) patches, a row of image_grid_thw


@dataclass(frozen=True)
class Counter:
    """The model's shapes for :func:`vitrim.vlm.flops.prefill_cost`: ``shapes(grid)`` gives a ``VLM`` for a picture
    of that patch grid (None for models whose processor reports none) or the reason it is not counted; ``shapes``
    None: its pictures are not counted (``reason``). ``clip(grid)`` the same for a video of that grid (Qwen: its
    ``video_grid_thw`` row; LLaVA-OneVision: ``(frames,)``) for :func:`vitrim.vlm.flops_video.video_prefill_cost`;
    None: its videos are not counted (``clip_reason``)."""

    shapes: Callable[[Grid | None], Any] | None  # -> vitrim.vlm.method.cost.VLM | str
    reason: str = ""
    clip: Callable[[Grid | None], Any] | None = None  # -> a clip's VLM (vitrim.vlm.flops_video.clip) | str
    clip_reason: str = ""

    @property
    def counted(self) -> bool:
        """Whether any sample of the model is counted (its pictures or its videos)."""
        return self.shapes is not None or self.clip is not None


PICTURES = "vitrim.vlm.flops counts pictures on LLaVA-1.5, Qwen2.5-VL and Gemma 3 checkpoints"
VIDEOS = "vitrim.vlm.flops_video counts videos on Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision checkpoints"


def counter_for(model: nn.Module) -> Counter:
    """A :class:`Counter` for ``model`` (module doc)."""
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    no_pictures, no_videos = f"{PICTURES}; {kind!r} is not counted", f"{VIDEOS}; {kind!r} is not counted"
    if kind == "llava":
        shapes = llava_shapes(model)
        return Counter(lambda grid: shapes, clip_reason=no_videos)
    if kind == "gemma3":
        shapes = gemma3_shapes(model)
        return Counter(lambda grid: shapes, clip_reason=no_videos)
    if kind == "qwen2_5_vl":
        return Counter(lambda grid: qwen2_5_vl_shapes(model, grid), clip=lambda grid: qwen2_5_vl_clip(model, grid))
    if kind == "qwen3_vl":
        return Counter(None, no_pictures, clip=lambda grid: qwen3_vl_clip(model, grid))
    if kind == "llava_onevision":
        return Counter(None, no_pictures, clip=lambda grid: llava_onevision_clip(model, grid))
    return Counter(None, no_pictures, clip_reason=no_videos)


def llava_shapes(model: nn.Module) -> Any:
    """A LLaVA checkpoint's shapes as :mod:`vitrim.vlm.flops` counts them (its config, and the projector's matrices)."""
    from vitrim.vlm.flops import VLM

    config: Any = model.config
    vision = config.vision_config
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: counted for one feature layer only")
    projector_module: Any = getattr(model, "model").multi_modal_projector  # noqa: B009  (typed Any: a transformers model)
    matrices = [m for m in projector_module.modules() if isinstance(m, nn.Linear)]
    return VLM(
        name=str(getattr(config, "_name_or_path", "") or "llava"),
        tower=_vit("CLIP", vision, cls_token=True, feature_layer=layer),
        projector=tuple((m.in_features, m.out_features) for m in matrices),
        pool=1,
        llm=_llm(config.text_config),
        cut_before_projector=False,
    )


def _vit(name: str, vision: Any, **options: Any) -> Any:
    """A CLIP or SigLIP tower's shapes from its vision config (one size: ``image_size``)."""
    from vitrim.vlm.flops import VisionTower

    return VisionTower(
        name,
        vision.image_size,
        vision.patch_size,
        vision.hidden_size,
        vision.num_hidden_layers,
        vision.num_attention_heads,
        vision.intermediate_size,
        **options,
    )


def _llm(text: Any, name: str = "LLM") -> Any:
    """The LLM's shapes from its text config."""
    from vitrim.vlm.flops import LanguageModel

    heads = text.num_attention_heads
    return LanguageModel(
        name,
        text.hidden_size,
        text.num_hidden_layers,
        heads,
        getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
        text.intermediate_size,
        text.vocab_size,
    )


def qwen2_5_vl_shapes(model: nn.Module, grid: Grid | None) -> Any:
    """A Qwen2.5-VL checkpoint's shapes for a picture of patch ``grid`` (t, h, w), or why it is not counted."""
    if grid is None or grid[0] != 1 or grid[1] != grid[2]:
        return f"Qwen2.5-VL is counted for a square picture (a grid of 1×h×h patches); this one is {list(grid or [])}"
    vision: Any = getattr(model.config, "vision_config")  # noqa: B009  (typed Any: a transformers config)
    window_side = vision.window_size // vision.patch_size
    if grid[1] % window_side:
        return (
            f"Qwen2.5-VL is counted for whole attention windows ({window_side}×{window_side} patches); {grid} has not"
        )
    return _qwen2_5_vl(model, grid[1])


def _qwen2_5_vl(model: nn.Module, side: int) -> Any:
    """A Qwen2.5-VL checkpoint's shapes at ``side`` × ``side`` patches (a picture, or a temporal patch of a clip)."""
    from vitrim.vlm.flops import VLM, VisionTower

    config: Any = model.config
    vision = config.vision_config
    merger: Any = getattr(model, "model").visual.merger  # noqa: B009  (typed Any: a transformers model)
    return VLM(
        name=str(getattr(config, "_name_or_path", "") or "qwen2.5-vl"),
        tower=VisionTower(
            "Qwen2.5-VL ViT",
            side * vision.patch_size,
            vision.patch_size,
            vision.hidden_size,
            vision.depth,
            vision.num_heads,
            vision.intermediate_size,
            gated_mlp=True,
            temporal_patch=vision.temporal_patch_size,
            window=(vision.window_size // vision.patch_size) ** 2,
            full_attention_layers=tuple(vision.fullatt_block_indexes),
        ),
        projector=tuple((m.in_features, m.out_features) for m in merger.modules() if isinstance(m, nn.Linear)),
        pool=vision.spatial_merge_size**2,
        llm=_llm(config.text_config),
        cut_before_projector=False,
        video_unit="temporal patch",
    )


def qwen2_5_vl_clip(model: nn.Module, grid: Grid | None) -> Any:
    """A Qwen2.5-VL checkpoint's shapes given a video of patch ``grid`` (t, h, w: its ``video_grid_thw`` row), or why
    it is not counted: square frames of whole attention windows (``flops_video.clip`` refuses the rest)."""
    if grid is None or len(grid) != 3 or grid[1] != grid[2]:
        return f"Qwen2.5-VL's video is counted for square frames (a grid of t×h×h patches); this one is {_shown(grid)}"
    vision: Any = getattr(model.config, "vision_config")  # noqa: B009  (typed Any: a transformers config)
    return _clip(_qwen2_5_vl(model, grid[1]), grid[0], grid[1] * vision.patch_size)


def qwen3_vl_clip(model: nn.Module, grid: Grid | None) -> Any:
    """A Qwen3-VL checkpoint's shapes given a video of patch ``grid`` (t, h, w), or why it is not counted (square
    frames only): its tower (no windows, a plain MLP), the merger and every DeepStack merger as the projector (each
    runs on every video token), the LLM. Its timestamp text is in the prompt's text tokens already, so the config
    adds none (``text_per_temporal_patch`` 0)."""
    from vitrim.vlm.flops import VLM, VisionTower

    if grid is None or len(grid) != 3 or grid[1] != grid[2]:
        return f"Qwen3-VL's video is counted for square frames (a grid of t×h×h patches); this one is {_shown(grid)}"
    config: Any = model.config
    vision = config.vision_config
    visual: Any = getattr(model, "model").visual  # noqa: B009  (typed Any: a transformers model)
    mergers = (visual.merger, *visual.deepstack_merger_list)
    shapes = VLM(
        name=str(getattr(config, "_name_or_path", "") or "qwen3-vl"),
        tower=VisionTower(
            "Qwen3-VL ViT",
            grid[1] * vision.patch_size,
            vision.patch_size,
            vision.hidden_size,
            vision.depth,
            vision.num_heads,
            vision.intermediate_size,
            temporal_patch=vision.temporal_patch_size,
        ),
        projector=tuple(
            (m.in_features, m.out_features) for merger in mergers for m in merger.modules() if isinstance(m, nn.Linear)
        ),
        pool=vision.spatial_merge_size**2,
        llm=_llm(config.text_config),
        cut_before_projector=False,
        video_unit="temporal patch",
    )
    return _clip(shapes, grid[0], grid[1] * vision.patch_size)


def llava_onevision_clip(model: nn.Module, grid: Grid | None) -> Any:
    """A LLaVA-OneVision checkpoint's shapes given a video of ``grid[0]`` frames, or why it is not counted: SigLIP on
    each frame at its one size, the projector on every patch, each frame's p×p grid pooled to ⌈p/2⌉² tokens (no
    products), one newline token after the last frame."""
    from vitrim.vlm.flops import VLM

    if grid is None or len(grid) < 1 or grid[0] < 1:
        return f"LLaVA-OneVision's video is counted from its frames' count; none was given ({_shown(grid)})"
    config: Any = model.config
    vision = config.vision_config
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        return f"vision_feature_layer={layer!r}: counted for one feature layer only"
    projector: Any = getattr(model, "model").multi_modal_projector  # noqa: B009  (typed Any: a transformers model)
    side = vision.image_size // vision.patch_size
    shapes = VLM(
        name=str(getattr(config, "_name_or_path", "") or "llava-onevision"),
        tower=_vit("SigLIP", vision, feature_layer=layer),
        projector=tuple((m.in_features, m.out_features) for m in projector.modules() if isinstance(m, nn.Linear)),
        pool=1,
        llm=_llm(config.text_config),
        cut_before_projector=False,
        video_unit="frame",
        pooled_side=-(-side // 2),
        text_per_video=1,
    )
    return _clip(shapes, grid[0], vision.image_size)


def _clip(shapes: Any, temporal_patches: int, size: int) -> Any:
    """``vitrim.vlm.flops_video.clip`` of ``shapes``, or its refusal's reason."""
    from vitrim.vlm.flops_video import clip

    try:
        return clip(shapes, temporal_patches, size)
    except ValueError as refusal:
        return str(refusal)


def _shown(grid: Grid | None) -> list[int]:
    return [int(n) for n in grid or []]


def gemma3_shapes(model: nn.Module) -> Any:
    """A Gemma 3 checkpoint's shapes: SigLIP (no [CLS]) at its one size, pooled to ``mm_tokens_per_image``, the
    projection matrix (a parameter, ``mm_input_projection_weight``: vision width × text width)."""
    from vitrim.vlm.flops import VLM

    config: Any = model.config
    vision = config.vision_config
    projection: Any = getattr(model, "model").multi_modal_projector.mm_input_projection_weight  # noqa: B009
    patches = (vision.image_size // vision.patch_size) ** 2
    return VLM(
        name=str(getattr(config, "_name_or_path", "") or "gemma3"),
        tower=_vit("SigLIP", vision),
        projector=(tuple(projection.shape),),
        pool=patches // config.mm_tokens_per_image,
        llm=_llm(config.text_config),
        cut_before_projector=False,
    )


def sample_macs(
    counter: Counter, plan: MethodPlan, pictures: int, videos: int, grid: Grid | None, text_tokens: int
) -> dict[str, Any]:
    """One sample's prefill MACs (``pictures`` pictures, ``videos`` videos; ``grid`` the first picture's patch grid,
    or the video's: :class:`Counter`): ``{"dense": n, "method": n, "ratio": method/dense}`` (``method`` is the dense
    count when no method is applied), or ``None`` where not counted, with ``"reason"``."""
    from vitrim.vlm import flops

    if videos:
        return _clip_macs(counter, plan, pictures, videos, grid, text_tokens)
    if counter.shapes is None:
        return _refused(counter.reason)
    if pictures != 1:
        return _refused(f"counted for one picture per sample, this one has {pictures}")
    shapes = counter.shapes(grid)
    if isinstance(shapes, str):
        return _refused(shapes)
    dense = flops.prefill_cost(shapes, "none", text_tokens=text_tokens).total
    if not plan.methods:
        return {"dense": dense, "method": dense, "ratio": 1.0}
    name, options, refusal = _one_method(plan, ())
    if refusal is not None:
        return _refused(refusal, dense)
    keep = keep_tokens(options.get("keep"), shapes.image_tokens)
    if keep is None:
        return _refused(
            f"{name}: keep={options.get('keep')!r} (counted for keep= given as a count or a fraction)", dense
        )
    try:
        counted = flops.prefill_cost(shapes, name, keep, text_tokens=text_tokens).total
    except ValueError as refusal_error:  # e.g. a tower method on a tower whose grid the projector pools
        return _refused(str(refusal_error), dense)
    return {"dense": dense, "method": counted, "ratio": counted / dense}


BOUNDED = ("fastvid", "flashvid")  # video methods whose tokens flops_video counts by a bound (module doc)


def _clip_macs(
    counter: Counter, plan: MethodPlan, pictures: int, videos: int, grid: Grid | None, text_tokens: int
) -> dict[str, Any]:
    """:func:`sample_macs` of a sample holding a video (module doc)."""
    from vitrim.vlm.flops_video import share_options, video_prefill_cost
    from vitrim.vlm.method import method_class

    if counter.clip is None:
        return _refused(counter.clip_reason)
    if videos != 1 or pictures:
        return _refused(f"counted for one video and no picture per sample, this one has {videos} and {pictures}")
    video = counter.clip(grid)
    if isinstance(video, str):
        return _refused(video)
    dense = video_prefill_cost(video, text_tokens=text_tokens).total
    if not plan.methods:
        return {"dense": dense, "method": dense, "ratio": 1.0}
    name = plan.methods[0][0]
    if any(method in BOUNDED for method, _ in plan.methods):
        return _refused(
            f"{name}: its tokens follow the clip's segments and clusters, which vitrim.vlm.flops_video counts by a "
            "bound, not this sample's number",
            dense,
        )
    reads_time = method_class(name).reads_time
    name, options, refusal = _one_method(plan, tuple(share_options(name, 0.5)) if reads_time else ())
    if refusal is not None:
        return _refused(refusal, dense)
    try:
        if reads_time:
            cost = video_prefill_cost(video, name, options=options, text_tokens=text_tokens)
        else:
            per_frame = video.tokens_per_temporal_patch
            keep = keep_tokens(options.get("keep"), per_frame)
            if keep is None:
                return _refused(
                    f"{name}: keep={options.get('keep')!r} (counted for keep= given as a count or a fraction of "
                    f"each temporal patch's {per_frame} tokens)",
                    dense,
                )
            cost = video_prefill_cost(video, name, keep / per_frame, text_tokens=text_tokens)
            assert cost.keep == keep, (cost.keep, keep)  # the share asks for exactly keep tokens of each
    except ValueError as refusal_error:  # a method flops_video refuses on a clip (in-LLM or tower alone, ...)
        return _refused(str(refusal_error), dense)
    return {"dense": dense, "method": cost.total, "ratio": cost.total / dense}


def _one_method(plan: MethodPlan, counted_options: tuple[str, ...]) -> tuple[str, dict[str, Any], str | None]:
    """The plan's one method, its options, and why it is not counted (None where it is): one method, with a cost
    count, its options other than ``keep`` and ``counted_options`` at their registered defaults."""
    from vitrim.vlm import flops, method_info

    name, options = plan.methods[0]
    if len(plan.methods) > 1:
        return name, options, "vitrim.vlm.flops counts one method"
    named = {k: v for k, v in options.items() if k != "keep" and k not in counted_options}
    defaults = method_info(name).defaults
    if "layer" in named or any(defaults.get(k, object()) != v for k, v in named.items()):
        return name, options, f"{name}'s options {named} are not the defaults vitrim.vlm.flops counts"
    if name not in flops.counted_methods():
        return name, options, f"{name} has no cost count"
    return name, options, None


def _refused(reason: str, dense: int | None = None) -> dict[str, Any]:
    return {"dense": dense, "method": None, "ratio": None, "reason": reason}


def keep_tokens(keep: Any, image_tokens: int) -> int | None:
    """``keep=`` as image tokens of an image of ``image_tokens`` (a fraction rounded as ``vitrim.vlm.apply`` rounds
    it: ``max(1, round(f · N))``); None when it is neither a count nor a fraction in (0, 1]."""
    if isinstance(keep, bool) or not isinstance(keep, int | float):
        return None
    if isinstance(keep, int):
        return keep if 1 <= keep <= image_tokens else None
    return max(1, min(image_tokens, round(keep * image_tokens))) if 0.0 < keep <= 1.0 else None

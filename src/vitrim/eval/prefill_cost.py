"""The prefill multiply-adds of one sample, with the methods and without, from :mod:`vitrim.vlm.flops`.

:mod:`vitrim.vlm.flops` counts a model from its shapes (a ``VLM``: tower, projector, LLM), one picture at one
square resolution. The shapes of three families are read here from the loaded checkpoint (its config, and the
projector's matrices), for the families ``vitrim.vlm.flops`` counts:

- LLaVA-1.5 (:func:`llava_shapes`; LLaVA-1.5-7B gives :data:`vitrim.vlm.flops.LLAVA_15_7B`'s numbers): a CLIP tower
  with [CLS] read at one layer, a two-matrix projector, a LLaMA-type LLM;
- Qwen2.5-VL (:func:`qwen2_5_vl_shapes`), per picture: its tokens follow its size, so the shapes are those of the
  sample's own ``image_grid_thw``; counted where ``vitrim.vlm.flops``' tower is exact: a square grid of whole
  attention windows (its windowed blocks attend within ``window`` tokens each);
- Gemma 3 (:func:`gemma3_shapes`): SigLIP at the checkpoint's one size, average-pooled to ``mm_tokens_per_image``,
  one projection matrix.

Every other case records ``null`` with the reason, never a number not counted: the other families (LLaVA-NeXT's
tiles, Qwen2-VL, Qwen3-VL's DeepStack mergers, PaliGemma), a Qwen picture off those grids, a sample with a video or
other than one picture, stacked methods (``vitrim.vlm.flops`` counts one), options other than ``keep`` set away
from the method's defaults (a method's ``cost`` reads its registered defaults), a count ``vitrim.vlm.flops``
refuses (a tower method on a pooling tower).
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
    None: the model is not counted (``reason``)."""

    shapes: Callable[[Grid | None], Any] | None  # -> vitrim.vlm.method.cost.VLM | str
    reason: str = ""


def counter_for(model: nn.Module) -> Counter:
    """A :class:`Counter` for ``model`` (module doc)."""
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if kind == "llava":
        shapes = llava_shapes(model)
        return Counter(lambda grid: shapes)
    if kind == "gemma3":
        shapes = gemma3_shapes(model)
        return Counter(lambda grid: shapes)
    if kind == "qwen2_5_vl":
        return Counter(lambda grid: qwen2_5_vl_shapes(model, grid))
    return Counter(
        None, f"vitrim.vlm.flops counts LLaVA-1.5, Qwen2.5-VL and Gemma 3 checkpoints; {kind!r} is not counted"
    )


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
    from vitrim.vlm.flops import VLM, VisionTower

    config: Any = model.config
    vision = config.vision_config
    if grid is None or grid[0] != 1 or grid[1] != grid[2]:
        return f"Qwen2.5-VL is counted for a square picture (a grid of 1×h×h patches); this one is {list(grid or [])}"
    window_side = vision.window_size // vision.patch_size  # patches per side of an attention window
    if grid[1] % window_side:
        return (
            f"Qwen2.5-VL is counted for whole attention windows ({window_side}×{window_side} patches); {grid} has not"
        )
    merger: Any = getattr(model, "model").visual.merger  # noqa: B009  (typed Any: a transformers model)
    return VLM(
        name=str(getattr(config, "_name_or_path", "") or "qwen2.5-vl"),
        tower=VisionTower(
            "Qwen2.5-VL ViT",
            grid[1] * vision.patch_size,
            vision.patch_size,
            vision.hidden_size,
            vision.depth,
            vision.num_heads,
            vision.intermediate_size,
            gated_mlp=True,
            temporal_patch=vision.temporal_patch_size,
            window=window_side**2,
            full_attention_layers=tuple(vision.fullatt_block_indexes),
        ),
        projector=tuple((m.in_features, m.out_features) for m in merger.modules() if isinstance(m, nn.Linear)),
        pool=vision.spatial_merge_size**2,
        llm=_llm(config.text_config),
        cut_before_projector=False,
    )


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
    """One sample's prefill MACs (``pictures`` pictures, the first of patch ``grid``, ``videos`` videos):
    ``{"dense": n, "method": n, "ratio": method/dense}`` (``method`` is the dense count when no method is applied),
    or ``None`` where not counted, with ``"reason"``."""
    from vitrim.vlm import flops, method_info

    def refused(reason: str, dense: int | None = None) -> dict[str, Any]:
        return {"dense": dense, "method": None, "ratio": None, "reason": reason}

    if counter.shapes is None:
        return refused(counter.reason)
    if videos:
        return refused(f"vitrim.vlm.flops counts pictures; this sample holds {videos} video(s)")
    if pictures != 1:
        return refused(f"counted for one picture per sample, this one has {pictures}")
    shapes = counter.shapes(grid)
    if isinstance(shapes, str):
        return refused(shapes)
    dense = flops.prefill_cost(shapes, "none", text_tokens=text_tokens).total
    if not plan.methods:
        return {"dense": dense, "method": dense, "ratio": 1.0}
    if len(plan.methods) > 1:
        return refused("vitrim.vlm.flops counts one method", dense)
    name, options = plan.methods[0]
    named = {k: v for k, v in options.items() if k != "keep"}
    defaults = method_info(name).defaults
    if "layer" in named or any(defaults.get(k, object()) != v for k, v in named.items()):
        return refused(f"{name}'s options {named} are not the defaults vitrim.vlm.flops counts", dense)
    if name not in flops.counted_methods():
        return refused(f"{name} has no cost count", dense)
    keep = keep_tokens(options.get("keep"), shapes.image_tokens)
    if keep is None:
        return refused(
            f"{name}: keep={options.get('keep')!r} (counted for keep= given as a count or a fraction)", dense
        )
    try:
        counted = flops.prefill_cost(shapes, name, keep, text_tokens=text_tokens).total
    except ValueError as refusal:  # e.g. a tower method on a tower whose grid the projector pools
        return refused(str(refusal), dense)
    return {"dense": dense, "method": counted, "ratio": counted / dense}


def keep_tokens(keep: Any, image_tokens: int) -> int | None:
    """``keep=`` as image tokens of an image of ``image_tokens`` (a fraction rounded as ``vitrim.vlm.apply`` rounds
    it: ``max(1, round(f · N))``); None when it is neither a count nor a fraction in (0, 1]."""
    if isinstance(keep, bool) or not isinstance(keep, int | float):
        return None
    if isinstance(keep, int):
        return keep if 1 <= keep <= image_tokens else None
    return max(1, min(image_tokens, round(keep * image_tokens))) if 0.0 < keep <= 1.0 else None

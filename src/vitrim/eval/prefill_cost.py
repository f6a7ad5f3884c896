"""The prefill multiply-adds of one sample, with the methods and without, from :mod:`vitrim.vlm.flops`.

:mod:`vitrim.vlm.flops` counts a model from its shapes (a ``VLM``: tower, projector, LLM). A LLaVA checkpoint's
shapes are all in its transformers config (a CLIP tower, a two-matrix projector, a LLaMA-type LLM), so
:func:`llava_shapes` reads them from the loaded model (LLaVA-1.5-7B gives :data:`vitrim.vlm.flops.LLAVA_15_7B`'s
numbers; the digits VLM and the tests' tiny LLaVA are counted the same way). Other families are not counted here: a
Qwen2/2.5/3-VL picture makes as many tokens as its size decides (``vitrim vlm flops`` counts Qwen2.5-VL-7B at
672 px only) and Gemma 3's tower is counted for its 896 px checkpoint only; their samples record ``null`` with the
reason. So are runs ``vitrim.vlm.flops`` cannot count as asked: stacked methods (it counts one), options other than
``keep`` set away from the method's defaults (a method's ``cost`` reads its registered defaults), a sample with other
than one picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from vitrim.eval.model_args import MethodPlan


@dataclass(frozen=True)
class Counter:
    """The model's shapes for :func:`vitrim.vlm.flops.prefill_cost`, or why none (``shapes`` None, ``reason``)."""

    shapes: Any  # vitrim.vlm.method.cost.VLM | None
    reason: str = ""


def counter_for(model: nn.Module) -> Counter:
    """A :class:`Counter` for ``model`` (module doc)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "llava":
        kind = getattr(config, "model_type", type(model).__name__)
        return Counter(None, f"prefill MACs are counted from a LLaVA checkpoint's config; {kind!r} is not counted")
    return Counter(llava_shapes(model))


def llava_shapes(model: nn.Module) -> Any:
    """A LLaVA checkpoint's shapes as :mod:`vitrim.vlm.flops` counts them (its config, and the projector's matrices)."""
    from vitrim.vlm.flops import VLM, LanguageModel, VisionTower

    config: Any = model.config
    vision, text = config.vision_config, config.text_config
    layer = config.vision_feature_layer
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r}: counted for one feature layer only")
    projector_module: Any = getattr(model, "model").multi_modal_projector  # noqa: B009  (typed Any: a transformers model)
    matrices = [m for m in projector_module.modules() if isinstance(m, nn.Linear)]
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return VLM(
        name=str(getattr(config, "_name_or_path", "") or "llava"),
        tower=VisionTower(
            "CLIP",
            vision.image_size,
            vision.patch_size,
            vision.hidden_size,
            vision.num_hidden_layers,
            vision.num_attention_heads,
            vision.intermediate_size,
            cls_token=True,
            feature_layer=layer,
        ),
        projector=tuple((m.in_features, m.out_features) for m in matrices),
        pool=1,
        llm=LanguageModel(
            "LLM",
            text.hidden_size,
            text.num_hidden_layers,
            heads,
            getattr(text, "num_key_value_heads", None) or heads,
            head_dim,
            text.intermediate_size,
            text.vocab_size,
        ),
        cut_before_projector=False,
    )


def sample_macs(counter: Counter, plan: MethodPlan, pictures: int, text_tokens: int) -> dict[str, Any]:
    """One sample's prefill MACs: ``{"dense": n, "method": n, "ratio": method/dense}`` (``method`` is the dense
    count when no method is applied), or ``{"dense": None, ..., "reason": why}``."""
    from vitrim.vlm import flops, method_info

    if counter.shapes is None or pictures != 1:
        reason = counter.reason or f"counted for one picture per sample, this one has {pictures}"
        return {"dense": None, "method": None, "ratio": None, "reason": reason}
    dense = flops.prefill_cost(counter.shapes, "none", text_tokens=text_tokens).total
    if not plan.methods:
        return {"dense": dense, "method": dense, "ratio": 1.0}
    if len(plan.methods) > 1:
        return {"dense": dense, "method": None, "ratio": None, "reason": "vitrim.vlm.flops counts one method"}
    name, options = plan.methods[0]
    named = {k: v for k, v in options.items() if k != "keep"}
    defaults = method_info(name).defaults
    if "layer" in named or any(defaults.get(k, object()) != v for k, v in named.items()):
        reason = f"{name}'s options {named} are not the defaults vitrim.vlm.flops counts"
        return {"dense": dense, "method": None, "ratio": None, "reason": reason}
    if name not in flops.counted_methods():
        return {"dense": dense, "method": None, "ratio": None, "reason": f"{name} has no cost count"}
    keep = keep_tokens(options.get("keep"), counter.shapes.image_tokens)
    if keep is None:
        reason = f"{name}: keep={options.get('keep')!r} (counted for keep= given as a count or a fraction)"
        return {"dense": dense, "method": None, "ratio": None, "reason": reason}
    counted = flops.prefill_cost(counter.shapes, name, keep, text_tokens=text_tokens).total
    return {"dense": dense, "method": counted, "ratio": counted / dense}


def keep_tokens(keep: Any, image_tokens: int) -> int | None:
    """``keep=`` as image tokens of an image of ``image_tokens`` (a fraction rounded as ``vitrim.vlm.apply`` rounds
    it: ``max(1, round(f · N))``); None when it is neither a count nor a fraction in (0, 1]."""
    if isinstance(keep, bool) or not isinstance(keep, int | float):
        return None
    if isinstance(keep, int):
        return keep if 1 <= keep <= image_tokens else None
    return max(1, min(image_tokens, round(keep * image_tokens))) if 0.0 < keep <= 1.0 else None

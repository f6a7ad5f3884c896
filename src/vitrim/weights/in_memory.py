"""Models a user already holds: ``from_timm(timm_model)`` and ``from_transformers(hf_model)`` return the vitrim model
with the same weights and the same outputs, and its data config, so a reducer goes onto it in one line::

    model = vitrim.from_timm(timm.create_model("deit_small_patch16_224", pretrained=True))
    vitrim.reduce.apply(model, "tome", r=13)

Neither imports timm or transformers: each reads what the model object carries, through the converters that read
those libraries' files (:mod:`vitrim.weights.pretrained`), so a model in memory and the same model saved give one
result.

* timm: the architecture is ``pretrained_cfg["architecture"]`` (timm's name, which vitrim's registry shares); its
  constructor arguments are those timm recorded (``_model_args``), with the sizes read off the model itself (so a
  ``reset_classifier`` or an older timm that records nothing still builds the right shape); the data config is
  the model's ``pretrained_cfg``.
* transformers: ViT, DINOv2 (± registers), CLIP and SigLIP vision models, or the vision tower of a full
  ``CLIPModel`` / ``SiglipModel``; ``projection=True`` as in :func:`vitrim.load_model`. The data config is the
  ``image_processor`` given (an image processor or its ``to_dict()``), else what the family's official checkpoints
  use.

The returned model is in the training mode of the one given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from torch import nn

from vitrim.weights.formats import RawCheckpoint
from vitrim.weights.pretrained import from_timm_config, from_transformers_config


def from_timm(timm_model: nn.Module) -> nn.Module:
    """The vitrim model of a timm Vision Transformer (module doc), same weights, same outputs."""
    if not isinstance(timm_model, nn.Module):
        raise TypeError(f"from_timm takes a timm model (torch.nn.Module), got {type(timm_model).__name__}")
    pretrained_cfg = dict(getattr(timm_model, "pretrained_cfg", None) or {})
    arch = pretrained_cfg.get("architecture")
    if not isinstance(arch, str):
        raise TypeError(
            f"from_timm takes a model made by timm.create_model (its pretrained_cfg names the architecture); "
            f"a {type(timm_model).__name__} without one was given"
        )
    config = {
        "architecture": arch,
        "num_classes": int(getattr(timm_model, "num_classes", 0)),
        "model_args": {**dict(getattr(timm_model, "_model_args", None) or {}), **_timm_sizes(timm_model)},
        "pretrained_cfg": pretrained_cfg,
    }
    raw = RawCheckpoint(Path(f"<timm {arch}>"), dict(timm_model.state_dict()))
    model = from_timm_config(config, raw, {}, where=f"timm model {arch!r}")
    return model.train(timm_model.training)


def _timm_sizes(timm_model: nn.Module) -> dict[str, Any]:
    """The sizes a timm ViT (VisionTransformer, Eva) shows in its modules: they win over the recorded arguments."""
    sizes: dict[str, Any] = {}
    patch_embed = getattr(timm_model, "patch_embed", None)
    if patch_embed is not None:
        sizes["in_chans"] = int(patch_embed.proj.in_channels)
        if getattr(patch_embed, "img_size", None) is not None:
            sizes["img_size"] = tuple(int(v) for v in patch_embed.img_size)
    blocks = getattr(timm_model, "blocks", None)
    if blocks is not None and len(blocks) > 0:
        sizes["depth"] = len(blocks)
        sizes["num_heads"] = int(blocks[0].attn.num_heads)
    if isinstance(getattr(timm_model, "embed_dim", None), int):
        sizes["embed_dim"] = timm_model.embed_dim
    if isinstance(getattr(timm_model, "global_pool", None), str):
        sizes["global_pool"] = timm_model.global_pool
    return sizes


def from_transformers(hf_model: nn.Module, *, projection: bool = False, image_processor: Any = None) -> nn.Module:
    """The vitrim model of a transformers vision model, or of a full CLIP / SigLIP model's vision tower (module doc)."""
    if not isinstance(hf_model, nn.Module) or not hasattr(getattr(hf_model, "config", None), "to_dict"):
        raise TypeError(
            "from_transformers takes a transformers model (a PreTrainedModel with .config), "
            f"got {type(hf_model).__name__}"
        )
    if not isinstance(projection, bool):
        raise TypeError(f"projection must be a bool, got {projection!r}")
    processor = image_processor.to_dict() if hasattr(image_processor, "to_dict") else image_processor
    if processor is not None and not isinstance(processor, dict):
        raise TypeError(f"image_processor must be an image processor or its to_dict(), got {type(processor).__name__}")
    where = f"transformers model {type(hf_model).__name__}"
    config = cast(dict[str, Any], cast(Any, hf_model).config.to_dict())
    raw = RawCheckpoint(Path(f"<{where}>"), dict(hf_model.state_dict()), {}, config)
    model = from_transformers_config(raw, processor, projection, {}, where=where)
    return model.train(hf_model.training)

"""Models from their published weights: by hub name, from a local folder or file, with the data config that came
with them.

``vitrim.load_model(source, *, projection=False, **overrides)`` takes

* ``"hf-hub:ORG/NAME[@REVISION]"``: a Hugging Face Hub repo, through :mod:`vitrim.weights.hub` (huggingface_hub's
  cache), in either layout: timm's (``config.json`` with ``architecture``, ``model_args``, ``pretrained_cfg``;
  weights with timm's names) or transformers' (``config.json`` with ``model_type``: ViT, DINOv2 with or without
  registers, CLIP, SigLIP, and the vision tower of a full CLIP or SigLIP model; its ``preprocessor_config.json``);
* a local folder in either layout (``save_pretrained``, timm's ``save_for_hf``), or a file vitrim wrote.

The model's ``data_config`` (:class:`~vitrim.models.data_config.DataConfig`) comes from timm's ``pretrained_cfg`` or
transformers' preprocessor config; a model in memory without one gets what its family's official checkpoints use.

``projection=True`` asks for the embedding of CLIP's joint image-text space: CLIP's ``visual_projection`` becomes the
model's head (zero bias, as timm holds OpenAI's CLIP), so ``model(images)`` equals transformers'
``CLIPModel.get_image_features``; ``forward_head(tokens, pre_logits=True)`` is still the pooled tower output. SigLIP
has no projection (its pooled output is its image embedding), so there it changes nothing; other models refuse it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from vitrim import reduce
from vitrim.models import data_config as data_configs
from vitrim.models.config import ViTConfig
from vitrim.models.config_limits import check_file_model
from vitrim.models.data_config import DataConfig
from vitrim.models.registry import build_model, check_registered, list_models
from vitrim.models.vit import VisionTransformer
from vitrim.weights import hub
from vitrim.weights.checkpoint import (
    CheckpointMismatchError,
    build_saved_model,
    check_config_fits_weights,
    load_checkpoint,
)
from vitrim.weights.formats import RawCheckpoint, convert_timm, detect_format, read_checkpoint, read_json
from vitrim.weights.hf_names import check_model_type, has_hf_keys, hf_config_to_vit_fields
from vitrim.weights.tags import pretrained_repo

# timm's constructor arguments that change nothing in vitrim's model (it takes any image size a patch divides;
# initialisation is overwritten by the weights; dropout vitrim has not is off in evaluation anyway)
TIMM_ARGS_WITHOUT_EFFECT = frozenset(
    {"dynamic_img_size", "strict_img_size", "weight_init", "fix_init", "pos_drop_rate", "patch_drop_rate"}
)
TIMM_ARG_RENAMES = {"proj_drop_rate": "drop_rate"}
TRANSFORMERS_DATA = {  # model_type -> what its official checkpoints' preprocessor_config.json say
    "vit": data_configs.TRANSFORMERS_VIT,
    "dinov2": data_configs.TRANSFORMERS_DINOV2,
    "dinov2_with_registers": data_configs.TRANSFORMERS_DINOV2,
    "clip_vision_model": data_configs.TRANSFORMERS_CLIP,
    "siglip_vision_model": data_configs.TRANSFORMERS_SIGLIP,
}
PREPROCESSOR_FILE = "preprocessor_config.json"


def load_model(
    source: str | os.PathLike[str] | RawCheckpoint, *, projection: bool = False, **overrides: Any
) -> nn.Module:
    """Build the model ``source`` describes and load its weights (module doc); returns it in eval mode.

    ``overrides`` change config fields (``img_size=448``: the position embedding is resampled as the weights'
    library resamples it; ``num_classes=10``: a fresh head).
    """
    if not isinstance(projection, bool):
        raise TypeError(f"projection must be a bool, got {projection!r}")
    if hub.is_hub_name(source):
        repo_id, revision = hub.parse_hub_name(str(source))
        repo = hub.fetch(repo_id, revision)
        raw = read_weights(repo.weights)
        assert repo.config is not None  # fetch insists on config.json
        return from_config(repo.config, raw, repo.preprocessor, projection, overrides, where=repo.name).eval()
    raw = source if isinstance(source, RawCheckpoint) else read_checkpoint(source)
    sibling = raw.path.parent / "config.json"
    if raw.hf_config is None and detect_format(raw) == "timm" and sibling.is_file():  # timm's save_for_hf layout
        config = read_json(sibling)
        raw = dataclasses.replace(raw, hf_config=config if is_timm_config(config) else None)
    if raw.hf_config is not None and (is_timm_config(raw.hf_config) or detect_format(raw) == "huggingface"):
        processor_file = raw.path.parent / PREPROCESSOR_FILE
        processor = read_json(processor_file) if processor_file.is_file() else None
        return from_config(raw.hf_config, raw, processor, projection, overrides, where=str(raw.path)).eval()
    if projection:
        raise ValueError(f"projection=True applies to CLIP and SigLIP weights; {str(raw.path)!r} is a vitrim file")
    return build_saved_model(raw, **overrides)


def read_weights(path: Path) -> RawCheckpoint:
    """A downloaded weights file (or a shard index, whose shards lie next to it) -> its tensors and config."""
    return read_checkpoint(path.parent if path.name.endswith(".index.json") else path)


def is_timm_config(config: dict[str, Any]) -> bool:
    """timm's hub config.json: ``architecture`` and ``pretrained_cfg`` (or a legacy flat one without model_type)."""
    return "architecture" in config and "model_type" not in config


def from_config(
    config: dict[str, Any],
    raw: RawCheckpoint,
    processor: dict[str, Any] | None,
    projection: bool,
    overrides: dict[str, Any],
    *,
    where: str,
) -> nn.Module:
    """Build from a repo's config.json (timm's or transformers' layout) and load ``raw`` into it."""
    if is_timm_config(config):
        if projection:
            raise ValueError(f"{where}: projection=True applies to transformers' CLIP and SigLIP repos, not timm's")
        return from_timm_config(config, raw, overrides, where=where)
    if "model_type" in config:
        raw = dataclasses.replace(raw, hf_config=config)
        return from_transformers_config(raw, processor, projection, overrides, where=where)
    raise ValueError(
        f"{where}: config.json is neither timm's (architecture, pretrained_cfg) nor transformers' (model_type); "
        "vitrim reads Vision Transformers in those two layouts"
    )


# -- timm's layout ----------------------------------------------------------------------------------------------


def timm_model_args(model_args: dict[str, Any], where: str) -> dict[str, Any]:
    """timm's constructor arguments (``model_args`` of a hub config.json, or ``timm_model._model_args``) -> vitrim
    config overrides: the same names, less those without effect (``TIMM_ARGS_WITHOUT_EFFECT``); one vitrim
    cannot honour is an error naming it."""
    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    out: dict[str, Any] = {}
    for key, value in model_args.items():
        key = TIMM_ARG_RENAMES.get(key, key)
        if key in TIMM_ARGS_WITHOUT_EFFECT or (key == "dynamic_img_pad" and not value):
            continue
        if key not in fields:
            raise ValueError(f"{where}: timm's argument {key}={value!r} has no equivalent in vitrim's ViTConfig")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def from_timm_config(config: dict[str, Any], raw: RawCheckpoint, overrides: dict[str, Any], *, where: str) -> nn.Module:
    """A vitrim model of timm's ``architecture`` with its ``model_args``, ``num_classes`` and weights, and the data
    config of its ``pretrained_cfg``."""
    arch = config.get("architecture")
    if arch not in list_models():
        raise ValueError(
            f"{where} is timm's {arch!r}, which vitrim does not build; vitrim builds the Vision Transformers of "
            "vitrim.list_models() (timm's names)"
        )
    model_args = config.get("model_args") or {}
    if not isinstance(model_args, dict):
        raise ValueError(
            f"{where} config.json: model_args must be an object of timm's constructor arguments, got {model_args!r:.80}"
        )
    args = timm_model_args(dict(model_args), where)
    if "num_classes" in config:
        args["num_classes"] = config["num_classes"]
    check_file_model(args, lambda: build_model(arch, **args), raw.state_dict, f"{where} config.json")
    legacy = config if "mean" in config else None  # older timm repos: one flat config.json, data keys at the top
    return timm_model(
        arch, raw, {**args, **overrides}, config.get("pretrained_cfg") or legacy, where=where,
        described_by=f"{where} config.json", overridden=frozenset(overrides),
    )  # fmt: skip


def from_timm_name(
    name: str, overrides: dict[str, Any], reducer: str | None = None, reducer_options: dict[str, Any] | None = None
) -> nn.Module:
    """timm's pretrained weights for ``name`` (``vitrim.create_model(name, pretrained=True)``): the repo
    ``timm/<arch>.<tag>``, the weights' class count unless ``overrides`` say otherwise, ``reducer`` attached before
    the weights load (a learned reducer's modules stay fresh when the weights lack them)."""
    arch, repo_id = pretrained_repo(name)
    check_registered(arch)  # before any download
    repo = hub.fetch(repo_id, need_config=False)
    raw = read_weights(repo.weights)
    config = repo.config or {}
    described_by = None
    if "num_classes" not in overrides:
        head = raw.state_dict.get("head.weight")
        num_classes = config.get("num_classes", 0 if head is None else int(head.shape[0]))
        check_file_model(
            {"num_classes": num_classes}, lambda: build_model(arch, num_classes=num_classes, **overrides),
            raw.state_dict, f"{repo.name} config.json",
        )  # fmt: skip
        overrides = {**overrides, "num_classes": num_classes}
        described_by = f"{repo.name} config.json"  # its class count must be the head's
    return timm_model(
        arch, raw, overrides, config.get("pretrained_cfg"), where=repo.name, reducer=reducer,
        reducer_options=reducer_options, described_by=described_by,
        overridden=frozenset(overrides) - {"num_classes"} | {"img_size", "patch_size", "reg_tokens"},
    )  # fmt: skip


def timm_model(
    arch: str,
    raw: RawCheckpoint,
    kwargs: dict[str, Any],
    pretrained_cfg: dict[str, Any] | None,
    *,
    where: str,
    reducer: str | None = None,
    reducer_options: dict[str, Any] | None = None,
    described_by: str | None = None,
    overridden: frozenset[str] = frozenset(),
) -> nn.Module:
    """The one way timm's weights become a model: build ``arch`` with ``kwargs``, attach ``reducer``, load ``raw``
    strictly, and give it the data config of ``pretrained_cfg`` (the registry's when None). ``described_by``: the
    sizes come from that file's config, which must then agree with the weights (``overridden``: the caller's own
    choices, which may leave a fresh head)."""
    model = build_model(arch, **kwargs)
    if reducer is not None:
        reduce.apply(model, reducer, **(reducer_options or {}))
    load_weights(model, raw, where, described_by=described_by, overridden=overridden)
    model.data_config = timm_data_config(pretrained_cfg, model)  # type: ignore[assignment]
    return model


def timm_data_config(pretrained_cfg: dict[str, Any] | None, model: nn.Module) -> DataConfig:
    """The data config of timm's ``pretrained_cfg``, sized for ``model``; the registry's when there is none."""
    base = DataConfig.from_timm(pretrained_cfg) if pretrained_cfg else cast(DataConfig, model.data_config)
    config = cast(ViTConfig, model.config)
    return base.for_input(config.in_chans, config.img_size)


def load_weights(
    model: nn.Module,
    raw: RawCheckpoint,
    where: str,
    *,
    described_by: str | None = None,
    overridden: frozenset[str] = frozenset(),
) -> None:
    """Strict load; a config that does not fit its own weights is one error naming the source (``described_by``:
    the model's sizes came from that file, so no head, register or position embedding is fixed up unless the
    caller ``overridden`` it)."""
    if described_by is not None:
        weights = raw.hf_in_vitrim_names()[0] if has_hf_keys(raw.state_dict) else raw.state_dict
        own = convert_timm(model.state_dict())
        check_config_fits_weights(model, convert_timm(dict(weights)), own, described_by, overridden)
    try:
        load_checkpoint(model, raw)
    except CheckpointMismatchError as err:
        raise CheckpointMismatchError(f"{where}: its config and its weights disagree: {err}") from None


# -- transformers' layout ---------------------------------------------------------------------------------------


def from_transformers_config(
    raw: RawCheckpoint, processor: dict[str, Any] | None, projection: bool, overrides: dict[str, Any], *, where: str
) -> VisionTransformer:
    """A vitrim ViT from transformers' config (``raw.hf_config``) and weights; the vision tower of a full CLIP or
    SigLIP model; CLIP's projection as the head when asked (module doc)."""
    hf_config = raw.hf_config
    assert hf_config is not None
    try:
        model_type = check_model_type(hf_config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if not has_hf_keys(raw.state_dict):
        raise ValueError(
            f"{where}: config.json says {model_type!r}, but its weights hold no {model_type} patch embedding"
        )
    if projection:
        raw = _with_projection_head(raw, model_type, where)
    try:
        fields = hf_config_to_vit_fields(hf_config, raw.hf_in_vitrim_names()[0])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    check_file_model(fields, lambda: VisionTransformer(ViTConfig.from_dict(fields)), raw.state_dict, where)
    model = VisionTransformer(ViTConfig.from_dict(fields).replace(**overrides))
    load_weights(model, raw, where, described_by=f"{where} config.json", overridden=frozenset(overrides))
    c = model.config
    data = DataConfig.from_transformers(processor, c.in_chans) if processor else TRANSFORMERS_DATA[str(model_type)]
    # the processor's size unless the user chose one (DINOv2's processor crops 224 for a model trained at 518)
    size = (data.input_size[1], data.input_size[2]) if processor and "img_size" not in overrides else c.img_size
    model.data_config = data.for_input(c.in_chans, size)  # type: ignore[assignment]
    return model


def _with_projection_head(raw: RawCheckpoint, model_type: object, where: str) -> RawCheckpoint:
    """CLIP's ``visual_projection`` (no bias) as a classifier with a zero bias, which the converter makes the head."""
    if model_type == "siglip_vision_model":
        return raw  # SigLIP's image embedding is its pooled output: nothing to add
    projection = raw.state_dict.get("visual_projection.weight")
    if model_type != "clip_vision_model" or projection is None:
        has = "a CLIP model without its visual_projection" if model_type == "clip_vision_model" else model_type
        raise ValueError(
            f"{where}: projection=True needs CLIP's visual projection (a CLIPModel or CLIPVisionModelWithProjection) "
            f"or SigLIP; this is {has}"
        )
    state_dict = {key: value for key, value in raw.state_dict.items() if key != "visual_projection.weight"}
    state_dict["classifier.weight"] = projection
    state_dict["classifier.bias"] = torch.zeros(projection.shape[0], dtype=projection.dtype)
    return dataclasses.replace(raw, state_dict=state_dict)

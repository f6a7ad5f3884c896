"""Load any supported checkpoint into a model, save vitrim checkpoints, and build a model from a checkpoint.

``load_checkpoint(model, path)`` reads vitrim, timm, DeiT, official DynamicViT and Hugging Face ViT weights
(recognised by content; see :mod:`vitrim.weights.formats`, which also says what is safe to unpickle), then
adapts them to the model:

* a position embedding learned for another patch grid is resampled as the weights' library resamples it (bicubic;
  antialiased for timm, not for transformers' ViT, DINOv2, CLIP and SigLIP), and the model remembers that library's
  way in ``config.pos_embed_antialias`` for the image sizes it will see;
* a classifier head of another size (or none at all) leaves the model's fresh head in place, with a warning,
  so a checkpoint can be fine-tuned on another label set; a model with ``num_classes=0`` ignores the head;
* register tokens the checkpoint lacks (a model built with ``reg_tokens`` loading weights trained without them)
  stay fresh, with a warning; the position embedding's trained [CLS] and patch rows load around them;
* a model may declare parameters that a checkpoint need not carry, by prefix, in the class attribute
  ``checkpoint_optional_prefixes`` (DynamicViT sets ``("score_predictor.",)``: a dense DeiT checkpoint loads
  into it and the predictors keep their fresh initialisation). Such keys are reported as ``fresh``, never as
  missing.

With ``strict=True`` (the default) every other difference raises ONE :class:`CheckpointMismatchError` listing the
missing keys, unexpected keys and shape mismatches; with ``strict=False`` what matches is loaded and the rest is
reported in the returned :class:`LoadResult`.

``save_checkpoint`` writes safetensors with the model's class and config in the metadata (atomically: a temp
file in the same folder, then ``os.replace``), so ``vitrim.load_model`` can rebuild the model with no code from the
file.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from vitrim import reduce
from vitrim.atomic import atomic_write
from vitrim.models.config import ViTConfig
from vitrim.models.config_limits import check_file_model
from vitrim.models.pos_embed import resample_pos_embed
from vitrim.untrusted import expect_object, parse_json
from vitrim.weights.formats import RawCheckpoint, convert_timm, detect_format, read_checkpoint
from vitrim.weights.hf_names import hf_pos_embed_antialias, vision_config

logger = logging.getLogger(__name__)

HEAD_KEYS = ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias")
FORMAT_VERSION = "1"
_SHOW = 5  # keys listed per kind in a mismatch error


class CheckpointMismatchError(ValueError):
    """A checkpoint's keys or shapes do not fit the model (strict loading)."""


@dataclass
class LoadResult:
    """What ``load_checkpoint`` did. Keys are the model's (timm) names.

    missing / unexpected / mismatched: what a strict load refuses (mismatched: (key, checkpoint shape, model
    shape)); fresh: model keys left at their initialisation on purpose (a replaced head, optional prefixes);
    ignored: checkpoint keys dropped on purpose (HF pooler, a head of another size); resampled_pos_embed: the grid
    change, as ((h, w) of the checkpoint, (h, w) of the model), or None.
    """

    format: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    resampled_pos_embed: tuple[tuple[int, int], tuple[int, int]] | None = None


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str] | RawCheckpoint, strict: bool = True) -> LoadResult:
    """Load the weights at ``path`` (file, or Hugging Face directory, or what ``read_checkpoint`` read from one)
    into ``model`` in place.

    Raises FileNotFoundError (no such path), ValueError (not a checkpoint, or unsafe to unpickle) and, when
    ``strict``, CheckpointMismatchError (a ValueError) listing every key that does not fit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    return _load_raw(model, path if isinstance(path, RawCheckpoint) else read_checkpoint(path), strict)


def _load_raw(
    model: nn.Module,
    raw: RawCheckpoint,
    strict: bool,
    *,
    described_by: str | None = None,
    overridden: frozenset[str] = frozenset(),
) -> LoadResult:
    """``described_by``: the model was built from this file's own config (names it: "x config.json"), so what the
    config states and the weights hold must agree; only the fields in ``overridden`` (the caller's own choices) may
    leave a fresh head, fresh registers or a resampled position embedding."""
    fmt = detect_format(raw)
    result = LoadResult(format=fmt)
    state_dict = dict(raw.state_dict)
    if fmt == "huggingface":
        converted, ignored = raw.hf_in_vitrim_names()
        state_dict, result.ignored = dict(converted), list(ignored)  # copies: the adapters below edit them
        _warn_on_hf_eps(model, raw)
    else:
        state_dict = convert_timm(state_dict)
    own = convert_timm(model.state_dict())  # vitrim's names (a RoPE ViT saves under timm's Eva names)
    if described_by is not None:
        check_config_fits_weights(model, state_dict, own, described_by, overridden)
    antialias = _source_antialias(raw, fmt)
    _adapt_registers(model, state_dict, own, result)
    _adapt_pos_embed(model, state_dict, own, _source_grid(raw, fmt), result, antialias)
    _adapt_head(state_dict, own, result)
    optional = tuple(getattr(model, "checkpoint_optional_prefixes", ()))
    for key, target in own.items():
        if key not in state_dict:
            if key.startswith(optional):
                result.fresh.append(key)
            elif key not in result.fresh:
                result.missing.append(key)
        elif state_dict[key].shape != target.shape:
            result.mismatched.append((key, tuple(state_dict[key].shape), tuple(target.shape)))
    result.unexpected = [key for key in state_dict if key not in own]
    problems = _describe_problems(result)
    if problems and strict:
        raise CheckpointMismatchError(
            f"checkpoint {str(raw.path)!r} ({fmt}) does not fit {type(model).__name__}: {'; '.join(problems)}. "
            "Pass strict=False to load only the keys that fit"
        )
    if problems:
        warnings.warn(f"load_checkpoint(strict=False) skipped: {'; '.join(problems)}", stacklevel=3)
    bad = {key for key, _, _ in result.mismatched}
    loadable = {key: value for key, value in state_dict.items() if key in own and key not in bad}
    model.load_state_dict(loadable, strict=False)  # copies into the model's own dtype and device
    config = getattr(model, "config", None)
    if isinstance(config, ViTConfig) and antialias is not None and config.pos_embed_antialias != antialias:
        model.config = dataclasses.replace(config, pos_embed_antialias=antialias)  # type: ignore[assignment]
    if result.fresh:
        logger.info("left at initialisation: %s", _summary(result.fresh))
    return result


def check_config_fits_weights(
    model: nn.Module, weights: dict[str, Tensor], own: dict[str, Tensor], source: str, overridden: frozenset[str]
) -> None:
    """A config read from ``source`` and the weights beside it must agree on the sizes the loader would otherwise
    fix up (a fresh head, fresh registers, a resampled position embedding): a file saying ``num_classes: 11``
    beside a 10-class head is refused, not answered with a random head. ``overridden`` are the caller's choices.
    ``weights`` and ``own`` are in vitrim's names."""
    theirs, ours = weights.get("head.weight"), own.get("head.weight")
    differs = (theirs is None) != (ours is None) or (
        theirs is not None and ours is not None and theirs.shape[0] != ours.shape[0]
    )
    if differs and "num_classes" not in overridden:
        stated = 0 if ours is None else int(ours.shape[0])
        held = "no classifier head" if theirs is None else f"a {int(theirs.shape[0])}-class head (head.weight)"
        raise ValueError(
            f"{source}: num_classes = {stated}, but the weights hold {held}; a file's config and its weights must "
            "agree (to put a fresh head on these weights, pass num_classes= yourself)"
        )
    registers = own.get("reg_token")
    if registers is not None and "reg_token" not in weights and "reg_tokens" not in overridden:
        raise ValueError(
            f"{source}: reg_tokens = {registers.shape[1]}, but the weights hold no reg_token; a file's config and "
            "its weights must agree (to add fresh registers, pass reg_tokens= yourself)"
        )
    pos, target = weights.get("pos_embed"), own.get("pos_embed")
    if (
        pos is not None
        and target is not None
        and pos.dim() == target.dim() == 3
        and pos.shape[-1] == target.shape[-1]
        and pos.shape[1] != target.shape[1]
        and not {"img_size", "patch_size", "reg_tokens"} & overridden
    ):
        config = getattr(model, "config", None)
        size, patch = getattr(config, "img_size", "?"), getattr(config, "patch_size", "?")
        raise ValueError(
            f"{source}: img_size = {size} (a transformers config's image_size) with patch_size = {patch} makes "
            f"{target.shape[1]} positions, but the weights' pos_embed has {pos.shape[1]}; a file's config and its "
            "weights must agree (to resample the position embedding, pass img_size= yourself)"
        )


def _summary(keys: list[str]) -> str:
    more = f", … (+{len(keys) - _SHOW})" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


def _describe_problems(result: LoadResult) -> list[str]:
    problems = []
    if result.missing:
        problems.append(f"{len(result.missing)} missing key(s): {_summary(result.missing)}")
    if result.unexpected:
        problems.append(f"{len(result.unexpected)} unexpected key(s): {_summary(result.unexpected)}")
    if result.mismatched:
        shapes = [f"{key} checkpoint {list(a)} vs model {list(b)}" for key, a, b in result.mismatched]
        problems.append(f"{len(shapes)} shape mismatch(es): {_summary(shapes)}")
    return problems


def _source_grid(raw: RawCheckpoint, fmt: str) -> tuple[int, int] | None:
    """The checkpoint's patch grid when its config says so (non-square grids need this), else None."""
    try:
        if fmt == "vitrim" and "vitrim.config" in raw.metadata:
            cfg = _metadata_config(raw)
            size, patch = cfg["img_size"], cfg["patch_size"]
        elif raw.hf_config is not None:
            hf = vision_config(raw.hf_config)
            size, patch = hf["image_size"], hf["patch_size"]
        else:
            return None
        h, w = (size, size) if isinstance(size, int) else size
        return int(h) // int(patch), int(w) // int(patch)
    except (KeyError, TypeError, ValueError):
        return None


def _source_antialias(raw: RawCheckpoint, fmt: str) -> bool | None:
    """How the weights' library resamples their position embedding (``ViTConfig.pos_embed_antialias``); None: a
    vitrim file that does not say."""
    if fmt == "huggingface":
        return hf_pos_embed_antialias(raw.hf_config, raw.state_dict)
    if fmt == "vitrim":
        value = _metadata_config(raw).get("pos_embed_antialias") if "vitrim.config" in raw.metadata else None
        return value if isinstance(value, bool) else None
    return True  # timm, DeiT and DynamicViT weights: timm's resampling


def _adapt_pos_embed(
    model: nn.Module,
    state_dict: dict[str, Tensor],
    own: dict[str, Tensor],
    source_grid: tuple[int, int] | None,
    result: LoadResult,
    antialias: bool | None,
) -> None:
    pos, target = state_dict.get("pos_embed"), own.get("pos_embed")
    patch_embed = getattr(model, "patch_embed", None)
    num_prefix = getattr(getattr(model, "config", None), "num_pos_prefix", getattr(model, "num_prefix", None))
    if pos is None or target is None or patch_embed is None or num_prefix is None:
        return
    if pos.dim() != 3 or pos.shape[-1] != target.shape[-1] or pos.shape[1] <= num_prefix:
        return  # another width or layout: the strict check reports the shape mismatch
    new_grid = (int(patch_embed.grid_size[0]), int(patch_embed.grid_size[1]))
    num_patches = pos.shape[1] - num_prefix
    if source_grid is None or source_grid[0] * source_grid[1] != num_patches:
        if pos.shape == target.shape:
            return  # nothing says the grids differ
        side = round(num_patches**0.5)
        if side * side != num_patches:
            return  # a non-square grid with no config to say its shape: reported as a mismatch
        source_grid = (side, side)
    if source_grid == new_grid:
        return  # (a 4x8 grid loaded into an 8x4 model has the same shape, but must still be resampled)
    if antialias is None:
        antialias = bool(getattr(getattr(model, "config", None), "pos_embed_antialias", True))
    state_dict["pos_embed"] = resample_pos_embed(pos, new_grid, source_grid, num_prefix, antialias=antialias)
    result.resampled_pos_embed = (source_grid, new_grid)


def _adapt_registers(
    model: nn.Module, state_dict: dict[str, Tensor], own: dict[str, Tensor], result: LoadResult
) -> None:
    """Register tokens added to a model trained without them start fresh, to be fine-tuned in.

    The model's own ``reg_token`` is kept; when the position embedding covers the prefix (timm's layout: [CLS],
    distillation token, registers, then the patches), the checkpoint's rows are split around the registers' rows,
    which keep the model's initialisation. Everything else loads as usual.
    """
    token = own.get("reg_token")  # (1, registers, D)
    if token is None or "reg_token" in state_dict:
        return
    registers = token.shape[1]
    pos, target = state_dict.get("pos_embed"), own.get("pos_embed")
    num_pos_prefix = int(getattr(getattr(model, "config", None), "num_pos_prefix", 0))
    if num_pos_prefix and pos is not None and target is not None:
        before = num_pos_prefix - registers  # [CLS] and distillation rows, which the checkpoint has
        if pos.dim() != 3 or pos.shape[1] <= before or pos.shape[-1] != target.shape[-1]:
            return  # another layout or width: the strict check reports it
        fresh_rows = target[:, before:num_pos_prefix].to(pos.dtype)
        state_dict["pos_embed"] = torch.cat([pos[:, :before], fresh_rows, pos[:, before:]], dim=1)
    warnings.warn(
        f"the checkpoint has no register tokens; the model's {registers} register(s) (reg_token"
        + (" and their position-embedding rows" if num_pos_prefix else "")
        + ") are freshly initialised",
        stacklevel=4,
    )
    result.fresh.append("reg_token")


def _adapt_head(state_dict: dict[str, Tensor], own: dict[str, Tensor], result: LoadResult) -> None:
    """A head of another size, or none, keeps the model's fresh head (fine-tuning on another label set)."""
    theirs, ours = state_dict.get("head.weight"), own.get("head.weight")
    if theirs is None and ours is None:
        return
    if theirs is not None and ours is not None and theirs.shape == ours.shape:
        return
    if ours is None:
        reason = f"the model has no head (num_classes=0); the checkpoint's {theirs.shape[0]}-class head is ignored"  # type: ignore[union-attr]
    elif theirs is None:
        reason = f"the checkpoint has no classifier head; the model's {ours.shape[0]}-class head is freshly initialised"
    else:
        reason = (
            f"the checkpoint's head has {theirs.shape[0]} classes, the model's {ours.shape[0]}; "
            "the model's freshly initialised head is kept"
        )
    if theirs is not None and ours is not None and theirs.shape[1:] != ours.shape[1:]:
        return  # another width: not a label-set change, the strict check reports it
    warnings.warn(reason, stacklevel=4)
    for key in HEAD_KEYS:
        if key in state_dict:
            result.ignored.append(key)
            del state_dict[key]
        if key in own:
            result.fresh.append(key)


def _warn_on_hf_eps(model: nn.Module, raw: RawCheckpoint) -> None:
    model_eps = getattr(getattr(model, "config", None), "norm_eps", None)
    if raw.hf_config is None or model_eps is None:
        return
    eps = float(vision_config(raw.hf_config).get("layer_norm_eps", 1e-12))
    if eps != model_eps:
        warnings.warn(
            f"the checkpoint was trained with layer_norm_eps={eps:g}, the model uses norm_eps={model_eps:g}; "
            f"build it with norm_eps={eps:g} (or use vitrim.load_model) for identical outputs",
            stacklevel=4,
        )


# -- saving, and building a model from a checkpoint ---------------------------------------------------------------


def save_checkpoint(model: nn.Module, path: str | os.PathLike[str]) -> Path:
    """Write ``model``'s state dict to ``path`` as safetensors, with its class and config in the metadata.

    The file appears whole or not at all (temp file in the same folder, then ``os.replace``). Parent folders are
    created. Returns the path written.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"path {str(target)!r} is a directory; expected a file name such as model.safetensors")
    cls = type(model)
    metadata = {"format": "pt", "vitrim.format_version": FORMAT_VERSION, "vitrim.class": _qualified(cls)}
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        metadata["vitrim.config_class"] = _qualified(type(config))
        metadata["vitrim.config"] = json.dumps(dataclasses.asdict(config))
    if reduce.applied_reducers(model):  # reducers put on with vitrim.reduce.apply: load_model puts them on again
        metadata["vitrim.reducers"] = json.dumps(reduce.applied_reducers(model))
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in model.state_dict().items()}
    return atomic_write(target, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_vitrim(name: str, what: str) -> Any:
    """``"vitrim.x.y:Class"`` -> the class. Only vitrim's own modules are imported from a file's metadata."""
    module_name, _, qualname = name.partition(":")
    if not (module_name == "vitrim" or module_name.startswith("vitrim.")) or not qualname:
        raise ValueError(f"refusing to build {what} {name!r} from checkpoint metadata: only vitrim classes are built")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"checkpoint names {what} {name!r}, which this version of vitrim does not have")
    return obj


def build_saved_model(path: str | os.PathLike[str] | RawCheckpoint, **overrides: Any) -> nn.Module:
    """Build the model a vitrim file describes and load its weights; returns it in eval mode.
    :func:`vitrim.load_model` reads vitrim files through it, and every other source (Hugging Face folders, timm's
    layout, the hub) its own way.

    ``path``: a file written by :func:`save_checkpoint`. ``overrides`` change config fields (e.g.
    ``img_size=384``: the position embedding is resampled; ``num_classes=10``: a fresh head); without them, the
    file's config must agree with its weights (:func:`check_config_fits_weights`). A bare timm/DeiT
    state dict has no config: use ``vitrim.create_model(name, checkpoint=path)``.
    """
    raw = path if isinstance(path, RawCheckpoint) else read_checkpoint(path)
    fmt = detect_format(raw)
    if fmt == "vitrim" and "vitrim.config" in raw.metadata:
        cls = _import_vitrim(raw.metadata["vitrim.class"], "model class")
        config_cls = _import_vitrim(raw.metadata.get("vitrim.config_class", _qualified(ViTConfig)), "config class")
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"checkpoint names model class {raw.metadata['vitrim.class']!r}, not an nn.Module")
        fields = _metadata_config(raw)
        where = f"checkpoint {str(raw.path)!r} metadata vitrim.config"
        check_file_model(
            fields,
            lambda: getattr(cls, "from_config", cls)(_config_from(config_cls, fields, {})),
            raw.state_dict,
            where,
        )
        config = _config_from(config_cls, fields, overrides)
        model = getattr(cls, "from_config", cls)(config)
        source = f"checkpoint {str(raw.path)!r} metadata vitrim.reducers"
        for i, spec in enumerate(_reducer_specs(raw.metadata.get("vitrim.reducers"), source)):
            try:  # the registry's name, its option names, and each value, checked by the reducer itself
                reduce.apply(model, spec["name"], layers=spec["layers"], **spec["options"])
            except (ValueError, TypeError) as err:
                text = str(err) if len(str(err)) <= 300 else str(err)[:297] + "..."  # a list option may be long
                raise ValueError(f"{source}[{i}] ({spec['name']!r}): {text}") from None
        result = _load_raw(model, raw, strict=True, described_by=where, overridden=frozenset(overrides))
        unexplained = [key for key in result.fresh if key not in HEAD_KEYS and key != "reg_token"]
        if unexplained:  # e.g. a DynamicViT file without its score predictors would prune at random
            raise ValueError(f"{where}: the weights lack {_summary(unexplained)}, which this model needs")
        return model.eval()
    if fmt == "huggingface" and raw.hf_config is not None:  # one route for Hugging Face layouts: load_model's
        raise ValueError(
            f"{str(raw.path)!r} is a Hugging Face checkpoint, not a file vitrim wrote: use vitrim.load_model(path), "
            "which builds it from its config.json"
        )
    where = "a Hugging Face checkpoint without config.json" if fmt == "huggingface" else f"a bare {fmt} state dict"
    raise ValueError(
        f"{str(raw.path)!r} is {where}, which does not say how to build the model; "
        "use vitrim.create_model(name, checkpoint=path, ...) instead"
    )


def _reducer_specs(text: str | None, source: str) -> list[dict[str, Any]]:
    """The ``vitrim.reducers`` metadata: a JSON list of {"name", "layers", "options"}; names are looked up in the
    reducer registry only, so a file cannot make vitrim build anything else. Here the shape: a name string,
    ``layers`` null or an int or a list of ints (:func:`vitrim.reduce.apply` checks them against the depth),
    ``options`` an object of numbers, bools, strings and flat lists of them (each reducer checks its values)."""
    if text is None:
        return []
    specs = parse_json(text, source)
    keys = {"name", "layers", "options"}
    if not isinstance(specs, list) or not all(isinstance(s, dict) and set(s) == keys for s in specs):
        raise ValueError(f"{source} must be a list of {sorted(keys)} records, got {text!r:.200}")
    for i, spec in enumerate(specs):
        name, layers, options = spec["name"], spec["layers"], spec["options"]
        if not isinstance(name, str):
            raise ValueError(f"{source}[{i}].name must be a reducer name (a string), got {name!r:.80}")
        if not (layers is None or _is_int(layers) or (isinstance(layers, list) and all(map(_is_int, layers)))):
            raise ValueError(f"{source}[{i}].layers must be null, a block index or a list of them, got {layers!r:.80}")
        if not isinstance(options, dict):
            raise ValueError(f"{source}[{i}].options must be a JSON object, got {options!r:.80}")
        for key, value in options.items():
            flat = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (int, float, str)) or v is None for v in flat):
                raise ValueError(
                    f"{source}[{i}].options.{key} must be a number, bool, string or a flat list of them, "
                    f"got {value!r:.80}"
                )
    return specs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _metadata_config(raw: RawCheckpoint) -> dict[str, Any]:
    """The ``vitrim.config`` metadata as a JSON object (through :mod:`vitrim.untrusted`)."""
    source = f"checkpoint {str(raw.path)!r} metadata vitrim.config"
    return expect_object(parse_json(raw.metadata["vitrim.config"], source), source)


def _config_from(config_cls: Any, fields: dict[str, Any], overrides: dict[str, Any]) -> Any:
    if hasattr(config_cls, "from_dict"):
        config = config_cls.from_dict(fields)
        return config.replace(**overrides) if overrides else config
    return config_cls(**{**fields, **overrides})

"""Hugging Face vision checkpoints -> vitrim (timm) names and config: ViT, DINOv2 (with registers), CLIP and SigLIP
vision towers.

``save_pretrained`` directories hold ``config.json`` and the weights with HF's names; the model type is read from
the keys (and the config), the names are mapped to timm's, the separate q/k/v projections are concatenated into
``qkv``, and what differs in layout is rewritten exactly:

* CLIP: ``class_embedding`` (D,) -> ``cls_token`` (1, 1, D); ``position_embedding.weight`` (N, D) -> ``pos_embed``
  (1, N, D); ``pre_layrnorm`` -> ``norm_pre``; ``post_layernorm`` -> ``norm`` (HF applies it to [CLS] only; on the
  pooled token that is the same number);
* SigLIP: the attention-pool head's packed ``in_proj`` splits into ``attn_pool.q`` and ``attn_pool.kv``;
* DINOv2 with registers: HF adds the position embedding to [CLS] and the patches, then inserts the registers;
  vitrim (as timm) keeps a patches-only embedding (``no_embed_class``) and folds [CLS]'s row into ``cls_token``,
  the same sum.

A model type vitrim cannot build raises an error that names it and lists the supported ones.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from vitrim.models.config_limits import check_file_config

SUPPORTED = ("vit", "dinov2", "dinov2_with_registers", "clip_vision_model", "siglip_vision_model")
PATCH_KEYS = ("embeddings.patch_embeddings.projection.weight", "embeddings.patch_embedding.weight")
ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}

_LAYER = re.compile(r"^(?:encoder\.layers?|layers)\.(\d+)\.(.+)\.(weight|bias|lambda1)$")
# per-layer module names of every supported family (classic and transformers-5 in-memory layouts) -> timm's
_LAYER_MODULES = {
    "attention.attention.query": "q",
    "attention.attention.key": "k",
    "attention.attention.value": "v",
    "attention.q_proj": "q",
    "attention.k_proj": "k",
    "attention.v_proj": "v",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "attention.output.dense": "attn.proj",
    "attention.o_proj": "attn.proj",
    "self_attn.out_proj": "attn.proj",
    "layernorm_before": "norm1",
    "layernorm_after": "norm2",
    "norm1": "norm1",
    "norm2": "norm2",
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
    "layer_scale1": "ls1",
    "layer_scale2": "ls2",
}
_TOP = {
    "embeddings.cls_token": "cls_token",
    "embeddings.register_tokens": "reg_token",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
    "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
    "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
    "pre_layrnorm.weight": "norm_pre.weight",
    "pre_layrnorm.bias": "norm_pre.bias",
    "post_layernorm.weight": "norm.weight",
    "post_layernorm.bias": "norm.bias",
    "head.probe": "attn_pool.latent",
    "head.attention.out_proj.weight": "attn_pool.proj.weight",
    "head.attention.out_proj.bias": "attn_pool.proj.bias",
    "head.layernorm.weight": "attn_pool.norm.weight",
    "head.layernorm.bias": "attn_pool.norm.bias",
    "head.mlp.fc1.weight": "attn_pool.mlp.fc1.weight",
    "head.mlp.fc1.bias": "attn_pool.mlp.fc1.bias",
    "head.mlp.fc2.weight": "attn_pool.mlp.fc2.weight",
    "head.mlp.fc2.bias": "attn_pool.mlp.fc2.bias",
}
_SIZES = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_channels=3, image_size=224)
# the defaults of transformers' config classes, which a config.json may leave out (tests/models/test_hf_defaults.py
# checks them against the classes)
TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "vit": dict(_SIZES, intermediate_size=3072, patch_size=16, hidden_act="gelu", layer_norm_eps=1e-12, qkv_bias=True),
    "dinov2": dict(
        _SIZES, mlp_ratio=4, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True, layerscale_value=1.0
    ),
    "clip_vision_model": dict(
        _SIZES, intermediate_size=3072, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5
    ),
    "siglip_vision_model": dict(
        _SIZES, intermediate_size=3072, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6
    ),
}
TRANSFORMERS_DEFAULTS["dinov2_with_registers"] = dict(
    TRANSFORMERS_DEFAULTS["dinov2"], num_register_tokens=4, patch_size=16
)
# HF's tanh pooler, the MAE/iBOT mask token, CLIP's position ids: vitrim's ViT has none of them
_IGNORED = ("pooler.", "embeddings.mask_token", "embeddings.position_ids")


def has_hf_keys(state_dict: dict[str, Tensor]) -> bool:
    """True if the weights carry a Hugging Face vision model's patch embedding."""
    return any(key.endswith(PATCH_KEYS) for key in state_dict)


def convert_hf(state_dict: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """Hugging Face names -> timm names (module doc). Returns (converted state dict, HF keys dropped on purpose).

    Keys this function does not know keep their names, so a strict load reports them as unexpected.
    """
    patch_key = next(key for key in state_dict if key.endswith(PATCH_KEYS))
    base = patch_key[: -len(next(k for k in PATCH_KEYS if patch_key.endswith(k)))]  # e.g. "vit.", "vision_model."
    out: dict[str, Tensor] = {}
    ignored: list[str] = []
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}  # (layer, param) -> {"q": …, "k": …, "v": …}
    for key, value in state_dict.items():
        if key.startswith("classifier."):
            out["head." + key.removeprefix("classifier.")] = value
            continue
        if not key.startswith(base):
            ignored.append(key)  # another tower (CLIPModel's text model, projections)
            continue
        name = key.removeprefix(base)
        if name.startswith(_IGNORED):
            ignored.append(key)
        elif name in _TOP:
            out[_TOP[name]] = value
        elif name in ("embeddings.class_embedding",):
            out["cls_token"] = value.reshape(1, 1, -1)
        elif name == "embeddings.position_embedding.weight":
            out["pos_embed"] = value.unsqueeze(0)  # (N, D) -> (1, N, D)
        elif name.startswith("head.attention.in_proj_"):
            q, kv = value.split([value.shape[0] // 3, 2 * value.shape[0] // 3])
            param = name.removeprefix("head.attention.in_proj_")  # weight | bias
            out[f"attn_pool.q.{param}"], out[f"attn_pool.kv.{param}"] = q, kv
        elif (match := _LAYER.match(name)) and match.group(2) in _LAYER_MODULES:
            layer, module, param = match.groups()
            target = _LAYER_MODULES[module]
            if target in ("q", "k", "v"):
                qkv.setdefault((layer, param), {})[target] = value
            else:
                out[f"blocks.{layer}.{target}.{'gamma' if param == 'lambda1' else param}"] = value
        else:
            out[key] = value
    for (layer, param), parts in qkv.items():
        if set(parts) == {"q", "k", "v"}:
            out[f"blocks.{layer}.attn.qkv.{param}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
        else:  # incomplete: keep under readable names so the strict check lists them
            out.update({f"blocks.{layer}.attn.{p}.{param}": t for p, t in parts.items()})
    if "reg_token" in out and "pos_embed" in out and "cls_token" in out:
        # DINOv2 + registers: fold [CLS]'s position into the token, keep the patches' rows (module doc)
        out["cls_token"] = out["cls_token"] + out["pos_embed"][:, :1]
        out["pos_embed"] = out["pos_embed"][:, 1:]
    return out, ignored


def vision_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The vision part of a config.json: itself, or its ``vision_config`` (a full CLIP or SigLIP model), with
    transformers' defaults for what it leaves out (older ``save_pretrained`` wrote only what differs from them)."""
    config = hf_config
    if hf_config.get("model_type") in ("clip", "siglip"):
        nested = hf_config.get("vision_config")
        config = {
            **(nested if isinstance(nested, dict) else {}),
            "model_type": f"{hf_config['model_type']}_vision_model",
        }
    model_type = config.get("model_type")  # any JSON value: only a string can name defaults (a list is unhashable)
    return {**(TRANSFORMERS_DEFAULTS.get(model_type, {}) if isinstance(model_type, str) else {}), **config}


def check_model_type(hf_config: dict[str, Any]) -> str:
    """The model type of the vision model a config.json describes, if vitrim builds it; a clear error otherwise."""
    model_type = vision_config(hf_config).get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"config.json has model_type {model_type!r}; vitrim reads Hugging Face ViT, DINOv2 (with registers), CLIP "
            f"and SigLIP vision models: model_type one of {list(SUPPORTED)}, or 'clip' / 'siglip' (their vision tower)"
        )
    return str(model_type)


def hf_pos_embed_antialias(hf_config: dict[str, Any] | None, state_dict: dict[str, Tensor]) -> bool:
    """Whether transformers resamples this model's position embedding with antialiasing: its DINOv2 with registers
    does (``interpolate_pos_encoding``: bicubic, ``antialias=True``); its ViT, DINOv2, CLIP and SigLIP do not."""
    if hf_config is not None:
        return vision_config(hf_config).get("model_type") == "dinov2_with_registers"
    return any(key.endswith("embeddings.register_tokens") for key in state_dict)


def hf_config_to_vit_fields(hf_config: dict[str, Any], state_dict: dict[str, Tensor]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` -> ViTConfig fields (timm names). ``state_dict`` (converted) gives the head.

    num_classes is the classifier's size when the weights have one, else 0 (the *Model classes: features only).
    """
    config = vision_config(hf_config)
    model_type = check_model_type(hf_config)
    check_file_config(config, "config.json")  # sizes typed, finite and bounded before anything divides or builds
    act = config.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"config.json has hidden_act {act!r}; vitrim supports {sorted(ACTIVATIONS)}")
    if config.get("use_swiglu_ffn"):
        raise ValueError("config.json has use_swiglu_ffn=True (DINOv2 giant); vitrim reads DINOv2 with an MLP only")
    try:
        dim = int(config["hidden_size"])
        size = config["image_size"]
        fields: dict[str, Any] = dict(
            embed_dim=dim,
            depth=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            img_size=(size, size) if isinstance(size, int) else tuple(size),
            patch_size=int(config["patch_size"]),
        )
        hidden = int(dim * float(config["mlp_ratio"])) if "mlp_ratio" in config else int(config["intermediate_size"])
    except KeyError as err:
        raise ValueError(f"config.json lacks {err.args[0]!r}, which a Hugging Face {model_type} config has") from None
    mlp_ratio = hidden / dim
    if int(dim * mlp_ratio) != hidden:
        raise ValueError(f"intermediate_size {hidden} is not representable as hidden_size {dim} x mlp_ratio")
    head = state_dict.get("head.weight")
    fields.update(
        mlp_ratio=mlp_ratio,
        in_chans=int(config.get("num_channels", 3)),
        qkv_bias=bool(config.get("qkv_bias", True)),
        norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        act_layer=ACTIVATIONS[act],
        num_classes=int(head.shape[0]) if head is not None else 0,
        drop_rate=float(config.get("hidden_dropout_prob", 0.0)),
        attn_drop_rate=float(config.get("attention_probs_dropout_prob", config.get("attention_dropout", 0.0))),
    )
    fields["pos_embed_antialias"] = model_type == "dinov2_with_registers"
    if model_type in ("dinov2", "dinov2_with_registers"):
        fields["init_values"] = float(config.get("layerscale_value", 1.0))
    if model_type == "dinov2_with_registers":
        fields.update(reg_tokens=int(config.get("num_register_tokens", 4)), no_embed_class=True)
    if model_type == "clip_vision_model":
        fields["pre_norm"] = True
    if model_type == "siglip_vision_model":
        fields.update(class_token=False, global_pool="map" if "attn_pool.latent" in state_dict else "avg")
        if "attn_pool.latent" not in state_dict:
            fields["fc_norm"] = False  # no head: the mean of the normalised tokens (HF has no pooler then)
    return fields

"""timm's Eva names for the parameters of a ViT with rotary position embedding (EVA-02), both ways.

vitrim's attention has one fused ``attn.qkv.bias`` and LayerScale modules (``ls1.gamma``); timm's ``Eva`` class holds
a query and a value bias and no key bias (``attn.q_bias``, ``attn.v_bias``; the key's is a zero buffer it does not
save) and ``gamma_1`` / ``gamma_2``. Reading timm's names, the key bias is zero, as in timm. A vitrim RoPE ViT saves
under timm's names (``model.state_dict()`` loads into timm's Eva of the same name, strict), as long as its key bias
is still zero: a key bias matters under RoPE (each key is turned by its own position), so one that training made
non-zero is kept under vitrim's name, which timm's Eva cannot hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor

_Q_BIAS = re.compile(r"^(.*\.attn)\.q_bias$")
_QKV_BIAS = re.compile(r"^(.*\.attn)\.qkv\.bias$")
_GAMMAS = ((".gamma_1", ".ls1.gamma"), (".gamma_2", ".ls2.gamma"))  # (timm Eva suffix, vitrim suffix)
_GAMMAS_TO_EVA = tuple((ours, eva) for eva, ours in _GAMMAS)


def _renamed_gamma(key: str, renames: Iterable[tuple[str, str]]) -> str:
    """``key`` with its LayerScale suffix renamed by the first ``(old, new)`` pair it ends with."""
    for old, new in renames:
        if key.endswith(old):
            return key.removesuffix(old) + new
    return key


def from_eva_names(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """timm's Eva names -> vitrim's (= timm's ViT names); other keys pass through, in their order."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if match := _Q_BIAS.match(key):
            v_bias = state_dict.get(f"{match.group(1)}.v_bias")
            if v_bias is not None:
                out[f"{match.group(1)}.qkv.bias"] = torch.cat([value, torch.zeros_like(value), v_bias])
                continue
        if key.endswith(".attn.v_bias") and f"{key.removesuffix('v_bias')}q_bias" in state_dict:
            continue
        out[_renamed_gamma(key, _GAMMAS)] = value
    return out


def to_eva_names(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """vitrim's names -> timm's Eva names (a fused bias whose key third is non-zero keeps its name: module doc)."""
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        if (match := _QKV_BIAS.match(key)) and value.dim() == 1 and value.shape[0] % 3 == 0:
            q_bias, k_bias, v_bias = value.chunk(3)
            if not k_bias.any():
                out[f"{match.group(1)}.q_bias"], out[f"{match.group(1)}.v_bias"] = q_bias, v_bias
                continue
        out[_renamed_gamma(key, _GAMMAS_TO_EVA)] = value
    return out


def save_eva_names(module: object, state_dict: dict[str, Tensor], prefix: str, local_metadata: object) -> None:
    """``state_dict`` post-hook: the module's keys (under ``prefix``) in timm's Eva names, in place."""
    _rename_in_place(state_dict, prefix, to_eva_names)


def load_eva_names(module: object, state_dict: dict[str, Tensor], prefix: str, *_: object) -> None:
    """``load_state_dict`` pre-hook: timm's Eva names (under ``prefix``) back to vitrim's, in place."""
    _rename_in_place(state_dict, prefix, from_eva_names)


def _rename_in_place(state_dict: dict[str, Tensor], prefix: str, rename: object) -> None:
    ours = {key.removeprefix(prefix): state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
    state_dict.update({prefix + key: value for key, value in rename(ours).items()})  # type: ignore[operator]

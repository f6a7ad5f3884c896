"""vitrim.vlm's tower methods on vLLM's CLIP (LLaVA-1.5) and SigLIP (Gemma 3) towers: the tower stage run on vLLM's
layers and weights.

The reductions are vitrim.vlm's own: the same reducers (``TowerMethod.tower_reducers``) on the same
:class:`~vitrim.vlm.stages.tower.TowerReduction`, which replaces each encoder layer's ``forward`` on this instance
by the layer's own ``layer_norm1``, attention, ``layer_norm2`` and ``mlp`` (vLLM's ``CLIPEncoderLayer`` and
``SiglipEncoderLayer`` name them as transformers does) with the reducer between the halves, the proportional-attention
log-sizes added to the logits, and a batch's ragged images (FlowCut) padded with tokens of size 0. What vLLM's
layers do differently is their attention, so this file gives only that (:class:`VllmTowerAttention`): vLLM's
``CLIPAttention`` and ``SiglipAttention`` project q, k, v in one fused ``qkv_proj`` (this tensor-parallel rank's
heads), and their ``MMEncoderAttention`` takes no mask; and vLLM's SigLIP layer returns ``(hidden, None)``.

Counts. vLLM writes a prompt's placeholders before the tower runs, so a tower method is served with ``keep``: the
patches that reach the feature layer, which every served tower method leaves exactly (``keep=`` spreads a fixed
schedule over the reducer's blocks; HiPrune and FlowCut cut to ``keep`` at the feature block), whatever the image;
PiToMe and PPT take no ``keep``, and leave the count their own options fix (``ratio``; ``r``), whatever the image
(:data:`vitrim.vllm.options.OWN_COUNTS`, from their reducers' own count functions). LLaVA-1.5 hands the LLM those
tokens in raster order of the patches they stand in for (vitrim.vlm's
``to_grid=False``, :func:`kept_in_raster_order`): ``keep`` placeholders per image. Gemma 3 puts them back on the
patch grid for its projector's pooling (``to_grid=True``, :func:`on_grid`): every pooled token stays, the prompt is
vLLM's own.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.nn import functional as F

from vitrim.reduce import Reducer
from vitrim.vllm.tensor_parallel import all_heads
from vitrim.vlm.method.tower_reducers import TowerLayout, TowerMethod
from vitrim.vlm.stages.tower import BlockAttention, TowerPlan, TowerReduction, feature_block, split_heads


class VllmTowerAttention(BlockAttention):
    """vLLM's ``CLIPAttention`` / ``SiglipAttention`` in the tower stage: its fused ``qkv_proj``, its own
    ``MMEncoderAttention`` while no mask is needed (a tower that reduces nothing runs as vLLM's), the same
    softmax(q·kᵀ·scale + mask)·v in torch's SDPA once the stage adds log-sizes, then its ``out_proj``. The reducers
    get q, k, v of every head: under tensor parallelism each rank gathers the others'
    (:func:`~vitrim.vllm.tensor_parallel.all_heads`) and reduces alike."""

    def attend(
        self, layer: Any, hidden: Tensor, mask: Tensor | None, kwargs: dict[str, Any], *, qkv: bool
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        attention = layer.self_attn
        heads = int(attention.num_heads_per_partition)
        projected, _ = attention.qkv_proj(hidden)  # (B, N, 3·h·hd), this rank's h heads
        q, k, v = projected.chunk(3, dim=-1)  # each (B, N, h·hd)
        if mask is None:
            mixed = attention.attn(q, k, v)  # (B, N, h·hd)
        else:
            qh, kh, vh = (split_heads(t, heads) for t in (q, k, v))  # (B, h, N, hd)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.to(q.dtype), scale=float(attention.scale))
            mixed = out.transpose(1, 2).reshape(q.shape)
        out, _ = attention.out_proj(mixed)  # (B, N, D), summed over ranks
        if not qkv:
            return out, None
        q, k, v = (split_heads(t, heads) for t in (q, k, v))  # (B, h, N, hd)
        if heads < int(attention.num_heads):  # tensor parallel: every rank reduces on every head
            q, k, v = (all_heads(t, dim=1) for t in (q, k, v))
        return out, (q, k, v)


def clip_layout(hf_config: Any) -> TowerLayout:
    """What the tower methods see of a LLaVA-1.5 config's CLIP tower: the blocks up to the feature layer's, [CLS],
    P patches per image, the token width."""
    vision = hf_config.vision_config
    depth = feature_block(hf_config.vision_feature_layer, vision.num_hidden_layers) + 1
    return TowerLayout(depth, 1, (vision.image_size // vision.patch_size) ** 2, int(vision.hidden_size))


def siglip_layout(hf_config: Any) -> TowerLayout:
    """The same of a Gemma 3 config's SigLIP tower: every block (the last feeds the projector), no [CLS]."""
    vision = hf_config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return TowerLayout(int(vision.num_hidden_layers), 0, patches, int(vision.hidden_size))


def tower_reducers(
    layout: TowerLayout, method: TowerMethod, keep: int | None, *, to_grid: bool, why: str
) -> dict[int, Reducer]:
    """The reducers ``method`` puts on a tower of ``layout`` for ``keep`` patches at the feature layer (None: the
    count its own options set, PiToMe's and PPT's, :data:`vitrim.vllm.options.OWN_COUNTS`); ``ValueError``
    (one ``vitrim:`` line) for options the tower cannot take, or a ``to_grid`` other than the family's (``why``: the
    family's reason). Built when the engine starts (the processing info), and again in each worker."""
    asked = method.options.get("to_grid")
    if asked is not None and asked != to_grid:
        raise ValueError(f"vitrim: to_grid={asked} is not served here: {why} (drop to_grid)")
    try:
        reducers: dict[int, Reducer] = method.tower_reducers(layout, keep)
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: {error}") from None
    return reducers


def install_tower(layers: Any, layout: TowerLayout, reducers: dict[int, Reducer], *, siglip: bool) -> TowerReduction:
    """The reducers on vLLM's encoder ``layers`` (LLaVA builds them up to the feature layer's; Gemma 3 all);
    ``siglip``: vLLM's SigLIP layer returns ``(hidden, None)``, so each reduced layer does too."""
    plan = TowerPlan(layers, layout.num_prefix, layout.patches, layout.depth - 1)
    reduction = TowerReduction(plan, reducers, to_grid=siglip, attention=VllmTowerAttention())
    if siglip:
        for layer in layers[: layout.depth]:  # the layers the stage runs
            layer.forward = as_pair(layer.forward)
    return reduction


def as_pair(forward: Any) -> Any:
    """``forward`` returning ``(its output, None)``, as vLLM's ``SiglipEncoder`` unpacks each layer's."""

    def pair(*args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        return forward(*args, **kwargs), None

    return pair


def kept_in_raster_order(reduction: TowerReduction, features: Tensor, keep: int) -> tuple[Tensor, list[Tensor]]:
    """The tower's feature tokens (I, keep, D) ([CLS] removed, in the stage's order) sorted by the patch each stands
    in for, and per image those patches (keep,) ascending: what vitrim.vlm's LLaVA hands its LLM (``to_grid=False``)
    and its ``last_selection``. ``RuntimeError`` if the tower left another count than the prompt was written for."""
    state = reduction.feature_state()
    if state is None or state.positions is None or features.shape[1] != keep:
        found = "none" if state is None else f"{features.shape[1]}"
        raise RuntimeError(f"vitrim: the tower method left {found} tokens per image; the prompt holds {keep}")
    order = state.positions.argsort(dim=1)  # (I, keep)
    tokens = features.gather(1, order[..., None].expand(-1, -1, features.shape[2]))
    kept = state.positions.gather(1, order)
    return tokens, list(kept.unbind(0))


def on_grid(reduction: TowerReduction, features: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The tower's feature tokens (I, n, D) back on the P patches of the grid, each patch carrying the token of its
    group (a dropped patch zero): (I, P, D), as vitrim.vlm's ``to_grid=True`` hands the projector; and per image the
    patches whose tokens reached the feature layer, ascending (``last_selection``)."""
    state = reduction.feature_state()
    if state is None or state.positions is None:
        raise RuntimeError("vitrim: the tower's reduced tokens reached the projector without a recorded feature layer")
    return reduction.tokens_to_slots(features, to_grid=True), list(state.positions.sort(dim=1).values.unbind(0))


__all__ = [
    "VllmTowerAttention",
    "clip_layout",
    "install_tower",
    "kept_in_raster_order",
    "on_grid",
    "siglip_layout",
    "tower_reducers",
]

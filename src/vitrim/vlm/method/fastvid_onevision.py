"""FastVID's LLaVA-OneVision form (LunarShen/FastVID, MIT licence, ``fastvid_llavaonevision/``: written here from the
facts of their ``siglip_encoder.py``, ``llava_arch.py`` and ``language_model/modeling_qwen2.py``, not copied), on one
video of F frames of P′ pooled tokens (x: (F, P′, E), the LLM's own rows, after the projector and the bilinear
pooling; the newline token after the video is not among them and always stays).

The frames' signals come from SigLIP's attention-pooling head (the MAP head), which LLaVA-OneVision checkpoints lack
(``vision_use_head=False``): the authors load ``post_layernorm`` and ``head`` of the SigLIP checkpoint the tower came
from (their ``SigLipVisionAbstract``, ``google/siglip-so400m-patch14-384``) and apply them, per frame, to the tower's
feature layer (the last kept layer's output, the projector's input, BEFORE any post-LayerNorm: the tower's own is not
applied, the checkpoint's is): h = head.attention(probe, post_layernorm(s), same) for s (p², D), then

- **salience**: the probe's attention weights over the p² patches (averaged over heads, as ``nn.MultiheadAttention``
  returns them), resized by the same bilinear interpolation as the frame's tokens to P′ (their ``get_attn_2dPool``);
- **DySeg's frame vector**: the head's pooled output (``pooler_output``: h, then h + MLP(LayerNorm(h))).

Then (``modeling_qwen2.py``, their prefill):

1. **DySeg** over the frame vectors: g_f L2-normalised, s_f = g_f·g_f₊₁; a segment ends after frame f where s_f is
   among the ``DySeg_c`` − 1 lowest or s_f < ``DySeg_tau`` (no sub-segments: ``DySeg_ignore`` is the Qwen form's).
2. **Budgets**: R = int(P′·``retention_ratio``) per frame, salient = R − int(R·``STPrune_d``), context = int(R·d).
   EVERY frame keeps its ``salient`` tokens of highest salience. A segment of S frames has context·S anchors, given
   in equal shares (⌊context·S / ⌈S/``DTM_p``⌉⌋) to every ``DTM_p``-th frame counted from its last.
3. **Anchors** of a frame: the density peaks (DPC, k = 4, :func:`~vitrim.vlm.method.density_peaks.density_peaks`)
   among its non-salient tokens.
4. **DTM**: a frame whose share is ``context`` (a one-frame segment; also every frame when ``DTM_p`` = 1) merges its
   own non-salient tokens into its anchors; one whose share is larger merges the non-salient tokens of its whole
   segment. Each token of that pool (the anchors themselves among them) goes to its most cosine-similar anchor; an
   anchor with n tokens becomes w·anchor + (1 − w)·mean(its n), w = max(1 / (n + 1), ``DTM_beta``).

Kept: the salient tokens and the anchors, each at its own position (the authors feed the kept indices as
``position_ids``), in raster order.

Where vitrim differs (docs/video.md says the same): the head runs in float32 at least (float16 in their runs);
their density's 1e-6 random jitter is left out; where their code raises (fewer than ``DySeg_c`` frames, a frame's
anchor share above its non-salient tokens) vitrim takes what there is; a batch of clips is each clip alone (their code:
batch 1, one video).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vitrim.vlm.evidence.pooled import resize_to_tokens
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.method.density_peaks import density_peaks

if TYPE_CHECKING:
    from vitrim.vlm.method.cost import VisionTower
    from vitrim.vlm.method.fastvid import FastVIDOptions

# the SigLIP every released LLaVA-OneVision tower was built from (the authors' ``mm_vision_tower``); transformers'
# LLaVA-OneVision config does not record its tower's source, so vitrim names it
SIGLIP = "google/siglip-so400m-patch14-384"
NEIGHBOURS = 4  # the density's k nearest (the token itself among them), the authors' constant
# the authors' LLaVA-OneVision script (scripts/eval.sh) where it differs from their Qwen2.5-VL one
ONEVISION_DEFAULTS = {"retention_ratio": 0.10, "DySeg_tau": 0.9}


@dataclass(frozen=True)
class PoolingHead:
    """SigLIP's ``post_layernorm`` and attention-pooling ``head`` (private copies, run in float32 at least)."""

    norm: nn.LayerNorm
    head: Any  # transformers' SiglipMultiheadAttentionPoolingHead (its probe and attention are read by name)

    @classmethod
    def load(cls, siglip: Any) -> PoolingHead:
        """``siglip``: a hub name or folder (loaded as ``SiglipVisionModel``, safetensors only), or a SigLIP model in
        hand (``SiglipVisionModel`` or ``SiglipModel``) whose vision model has its head (``vision_use_head=True``)."""
        import transformers

        expected = "a SiglipVisionModel with vision_use_head=True (its hub name or folder, or the model)"
        model = siglip
        if isinstance(siglip, str):
            try:
                model = transformers.SiglipVisionModel.from_pretrained(siglip, use_safetensors=True)
            except (OSError, ValueError) as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise ValueError(
                    f"fastvid siglip={siglip!r} could not be loaded ({first}); expected {expected}"
                ) from None
        vision = getattr(model, "vision_model", model)  # a SiglipModel's, or a SiglipVisionModel before 5.20
        head, norm = getattr(vision, "head", None), getattr(vision, "post_layernorm", None)
        if head is None or norm is None or not hasattr(head, "probe"):
            shown = repr(siglip) if isinstance(siglip, str) else f"<a {type(siglip).__name__}>"
            raise ValueError(f"fastvid siglip={shown} has no attention-pooling head; expected {expected}")
        return cls(norm=copy.deepcopy(norm).eval(), head=copy.deepcopy(head).eval())  # ours to move and cast

    def read(self, states: Tensor, rows: int, columns: int) -> tuple[Tensor, Tensor]:
        """The frames' feature-layer ``states`` (F, p², D) -> (salience (F, rows·columns), frame vectors (F, D)),
        in float32 at least (module docstring)."""
        width = self.norm.weight.shape[0]
        if states.shape[-1] != width:
            raise ValueError(
                f"fastvid siglip=: its head reads {width}-wide states, the tower's feature layer is "
                f"{states.shape[-1]} wide (pass the SigLIP the tower came from)"
            )
        work = torch.promote_types(torch.promote_types(states.dtype, self.norm.weight.dtype), torch.float32)
        self.norm.to(states.device, work)
        self.head.to(states.device, work)
        normed = self.norm(states.to(work))  # (F, p², D)
        probe = self.head.probe.expand(len(normed), -1, -1)  # (F, 1, D)
        weights = self.head.attention(probe, normed, normed)[1]  # (F, 1, p²): averaged over heads
        salience = resize_to_tokens(weights.transpose(1, 2), rows, columns)[..., 0]  # (F, rows·columns)
        return salience, self.head(normed)  # the pooled output (F, D)


def pooling_head_macs(tower: VisionTower) -> int:
    """Multiply-adds of :meth:`PoolingHead.read` on one frame of ``tower``'s p² patches (the head's widths are the
    tower's, the SigLIP it came from: D wide, an MLP of M): the head's attention runs twice, once for the weights
    (salience) and once inside the head for the pooled output, each the probe's query (D²), the patches' keys and
    values (2·p²·D²), q·kᵀ and A·V over the p² patches (2·p²·D, all heads) and the output projection (D²); then
    the head's MLP on the one pooled vector (2·D·M). LayerNorms and the bilinear resize are no products."""
    d, patches = tower.width, tower.patches_per_temporal_patch
    attention = 2 * d * d + 2 * patches * d * d + 2 * patches * d
    return 2 * attention + 2 * d * tower.mlp_width


def anchor_shares(segments: list[int], context: int, period: int) -> list[int]:
    """Anchors per frame: each segment's context·S in equal shares to every ``period``-th frame from its last."""
    shares: list[int] = []
    for size in segments:
        share = context * size // -(-size // period)
        shares += [share if (size - 1 - frame) % period == 0 else 0 for frame in range(size)]
    return shares


def merge_into_anchors(tokens: Tensor, anchors: Tensor, pool: Tensor, beta: float) -> tuple[Tensor, list[Tensor]]:
    """DTM, both forms: the ``pool`` (m,) of ``tokens`` (n, E) each to its most cosine-similar of ``anchors`` (a,)
    (the Qwen form's pool leaves the anchors out, the OneVision form's holds them); returns the anchors' merged
    embeddings (a, E) and, per anchor, the sorted indices it stands for (itself and its assigned)."""
    unit = tokens / tokens.norm(dim=-1, keepdim=True)
    choice = (unit[pool] @ unit[anchors].T).argmax(-1)  # (m,)
    assigned = F.one_hot(choice, len(anchors)).to(tokens.dtype)  # (m, a)
    counts = assigned.sum(0)[:, None]  # (a, 1)
    weight = (1 / (counts + 1)).clamp(min=beta)
    mean = (assigned.T @ tokens[pool]) / counts.clamp(min=1)
    merged = weight * tokens[anchors] + (1 - weight) * mean
    groups = [torch.cat([anchor[None], pool[choice == a]]).unique() for a, anchor in enumerate(anchors)]
    return merged, groups


def onevision_select(tokens: Tensor, salience: Tensor, segments: list[int], options: FastVIDOptions) -> ImageSelection:
    """FastVID's OneVision steps 2-4 on one video's pooled tokens ``tokens`` (F, P′, E) with ``salience`` (F, P′)
    and DySeg's ``segments`` (frame counts): the kept raster indices, their groups and merged embeddings."""
    frames, per_frame, _ = tokens.shape
    retain = int(per_frame * options.retention_ratio)
    context = int(retain * options.STPrune_d)
    salient = torch.topk(salience, retain - context, dim=-1).indices  # (F, salient)
    rest = torch.ones(frames, per_frame, dtype=torch.bool, device=tokens.device)
    rest[torch.arange(frames, device=tokens.device)[:, None], salient] = False
    offsets = torch.arange(frames, device=tokens.device) * per_frame
    candidates = [rest[frame].nonzero()[:, 0] + offsets[frame] for frame in range(frames)]  # raster indices
    flat = tokens.reshape(frames * per_frame, -1)
    shares = anchor_shares(segments, context, options.DTM_p)
    kept = [(salient + offsets[:, None]).flatten()]
    merged: dict[int, Tensor] = {}
    groups: dict[int, Tensor] = {}
    start = 0
    for size in segments:
        for frame in range(start, start + size):
            if shares[frame] == 0:
                continue
            own = candidates[frame]
            anchors = own[density_peaks(flat[own], min(shares[frame], len(own)), NEIGHBOURS)]
            pool = own if shares[frame] == context else torch.cat(candidates[start : start + size])
            values, members = merge_into_anchors(flat, anchors, pool, options.DTM_beta)
            merged.update(zip(anchors.tolist(), values.unbind(0), strict=True))
            groups.update(zip(anchors.tolist(), members, strict=True))
            kept.append(anchors)
        start += size
    order = torch.cat(kept).sort().values
    return ImageSelection(
        kept=order,
        groups=tuple(groups.get(index, order.new_tensor([index])) for index in order.tolist()),
        merged=torch.stack([merged.get(index, flat[index]) for index in order.tolist()]),
        projected=True,
    )

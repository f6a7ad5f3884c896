"""What vLLM's Qwen2.5-VL tower tells a pre-LLM method: vitrim.vlm's evidence from vLLM's modules (owned here).

The conventions are vitrim.vlm's Qwen family's (``vitrim.vlm.families.qwen2vl_vision``): the index space is the raster
order of the merger's outputs; the features of a token are its m² patch states entering the merger; its score is the
attention it receives at the last block, from that block's own q/k after rotary, summed per attention segment
(``received_attention``); its keys are the block's keys before rotary. Here the q/k come from vLLM's fused ``qkv``
and vLLM's own rotary op (``apply_rotary_emb``), exactly as vLLM's block computes them; the per-image split and the
window order are vitrim.vlm's ``image_evidence``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vllm.compat import tap_input
from vitrim.vlm.families.qwen2vl_vision import ScoringCapture, received_attention


def scoring_capture(attention: Any, hidden: Tensor, kwargs: dict[str, Any]) -> ScoringCapture:
    """The received attention (H, P) and pre-rotary keys (P, H, hd) of a vLLM ``Qwen2_5_VisionAttention``.

    hidden: (P, 1, C) the block's normed input in tower (window) order; kwargs: the block's ``cu_seqlens`` and
    ``rotary_pos_emb_cos`` / ``rotary_pos_emb_sin`` as vLLM passes them.
    """
    heads = int(attention.num_attention_heads_per_partition)
    head_dim = int(attention.hidden_size_per_attention_head)
    qkv, _ = attention.qkv(hidden)  # (P, 1, 3·H·hd)
    patches = qkv.shape[0]
    qkv = qkv.reshape(patches, 3, heads, head_dim)  # vLLM's "s b (three head head_dim)"
    query, key = qkv[:, 0], qkv[:, 1]  # (P, H, hd)
    rotated = attention.apply_rotary_emb(
        torch.stack([query, key]).contiguous(),  # (2, P, H, hd): vLLM's "(two b) s head head_dim", b = 1
        kwargs["rotary_pos_emb_cos"],
        kwargs["rotary_pos_emb_sin"],
    ).view(2, patches, heads, head_dim)
    work = torch.promote_types(hidden.dtype, torch.float32)  # a half-precision tower's map is scored in float32
    received = received_attention(
        rotated[0].to(work), rotated[1].to(work), kwargs["cu_seqlens"], float(head_dim**-0.5)
    )  # (H, P)
    return ScoringCapture(received=received, keys=key.to(work))


class TowerCapture:
    """Taps on one vLLM Qwen2.5 tower: the last block's attention (its scoring evidence, when asked; a forward
    pre-hook) and the merger's input (P, C) (vitrim.vllm.compat.tap_input: the merger takes no hooks), each for the
    last tower run."""

    def __init__(self, visual: nn.Module, needs_attention: bool) -> None:
        self.attention: ScoringCapture | None = None
        self.merger_input: Tensor | None = None
        tap_input(visual.merger, self.keep_merger_input)
        if needs_attention:
            last: Any = visual.blocks[-1]  # type: ignore[index]
            last.attn.register_forward_pre_hook(self.score, with_kwargs=True)

    def score(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["x"]
        self.attention = scoring_capture(module, hidden, kwargs)

    def keep_merger_input(self, states: Tensor) -> None:
        self.merger_input = states.reshape(states.shape[0], -1)  # (P, 1, C) -> (P, C)

    def take(self) -> tuple[ScoringCapture | None, Tensor]:
        """The last run's attention evidence (None when not asked) and merger input; forgets both."""
        attention, states = self.attention, self.merger_input
        self.attention = self.merger_input = None
        if states is None:
            raise RuntimeError("vitrim: the Qwen tower ran without its merger")
        return attention, states

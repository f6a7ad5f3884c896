"""Gemma 3's LLM attention on vLLM's CPU backend, as transformers + vitrim.vlm has it for a trimmed prompt.

transformers' Gemma 3 (and vitrim.vlm, which gathers the masks the unmodified model built at the kept rows and
columns: ``vitrim.vlm.families.gemma3_masks``) lets query q see key k when

    (p_k ≤ p_q  or  q and k are tokens of the same image)  and, on a sliding layer,  p_k > p_q − window

with p the ORIGINAL positions (:mod:`vitrim.vllm.gemma3_positions`). vLLM 0.32's CPU attention (``CPU_ATTN``) runs
every layer causally, counting the window in tokens of the (shortened) sequence: it ignores the image ranges vLLM
hands an attention backend for Gemma 3 (``mm_prefix``; only GPU backends read them), so even the unmodified vLLM
Gemma 3 attends causally among an image's tokens on a CPU. :class:`OriginalMaskAttention` wraps each LLM layer's
vLLM ``Attention``: vLLM's kernel runs (and writes the KV cache) as always; then, for each request whose rows the
two rules can tell apart in this step (it holds image tokens, or a sliding layer's query lies past the window with
tokens dropped before it), those rows are computed again with the rule above. The keys and values come from a copy
of each cache slot kept beside vLLM's (its CPU kernel packs its cache per instruction set, a layout Python does not
read), with the slot's original position and image block, written as vLLM writes the slot (tables per layer,
indexed by slot): keys from earlier steps (decode, a prefix cache hit) are judged by their own positions. The copy
doubles the KV cache's memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class StepPositions:
    """The (n,) original positions and image blocks (−1: text) of the tokens of the forward in flight, set by the
    model before its LLM runs (:func:`vitrim.vllm.gemma3_positions.blocks_of`)."""

    def __init__(self) -> None:
        self.positions: Tensor | None = None
        self.blocks: Tensor | None = None


class OriginalMaskAttention:
    """Wraps one vLLM ``Attention`` of Gemma 3's LLM (``layer.forward`` on the instance); ``window``: its sliding
    window (None: a full-attention layer)."""

    def __init__(self, layer: Any, window: int | None, step: StepPositions) -> None:
        self.layer, self.window, self.step = layer, window, step
        self.slot_position: Tensor | None = None  # (slots,) original position of the token each cache slot holds
        self.slot_block: Tensor | None = None  # (slots,) its image block (−1: text)
        self.slot_key: Tensor | None = None  # (slots, Hkv, hd) its key (after rotary), as vLLM caches it
        self.slot_value: Tensor | None = None  # (slots, Hkv, hd) its value
        self.vllm_forward = layer.forward
        layer.forward = self.forward

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        from vllm.model_executor.layers.attention.attention import get_attention_context

        output = self.vllm_forward(query, key, value, *args, **kwargs)  # (n, H·hd), the cache written
        metadata, _, kv_cache, slot_mapping = get_attention_context(self.layer.layer_name)
        positions, blocks = self.step.positions, self.step.blocks
        if metadata is None or positions is None or blocks is None or kv_cache.numel() == 0:
            return output  # a warm-up or profiling run: nothing to judge
        count = int(metadata.num_actual_tokens)
        self.record(kv_cache, slot_mapping[:count], positions[:count], blocks[:count], key[:count], value[:count])
        starts = metadata.query_start_loc.tolist()
        lengths = metadata.seq_lens.tolist()
        for request in range(len(starts) - 1):
            rows = slice(starts[request], starts[request + 1])
            past = lengths[request] - (rows.stop - rows.start)  # the request's tokens before this step
            if not self.differs(positions[rows], blocks[rows], past):
                continue
            out = self.attend(query, kv_cache.shape[2], metadata.block_table[request], lengths[request], rows, past)
            output.view(output.shape[0], -1)[rows] = out.reshape(out.shape[0], -1).to(output.dtype)
        return output

    def record(
        self, kv_cache: Tensor, slots: Tensor, positions: Tensor, blocks: Tensor, key: Tensor, value: Tensor
    ) -> None:
        heads = int(self.layer.num_kv_heads)
        key, value = key.reshape(len(slots), heads, -1), value.reshape(len(slots), heads, -1)
        if self.slot_position is None:
            size = kv_cache.shape[0] * kv_cache.shape[2]  # blocks × block size ([blocks, kv heads, block, 2·hd])
            self.slot_position = torch.zeros(size, dtype=torch.long, device=kv_cache.device)
            self.slot_block = torch.full((size,), -1, dtype=torch.long, device=kv_cache.device)
            self.slot_key = key.new_zeros(size, *key.shape[1:])
            self.slot_value = value.new_zeros(size, *value.shape[1:])
        assert self.slot_block is not None and self.slot_key is not None and self.slot_value is not None
        self.slot_position[slots] = positions
        self.slot_block[slots] = blocks
        self.slot_key[slots] = key
        self.slot_value[slots] = value

    def differs(self, positions: Tensor, blocks: Tensor, past: int) -> bool:
        """Whether vLLM's causal kernel may differ from the rule on these rows: an image token (it sees the later
        tokens of its image), or on a sliding layer a query past the window with tokens dropped before it (the
        kernel counts the window in kept tokens)."""
        if bool((blocks >= 0).any()):
            return True
        if self.window is None:
            return False
        sequence = past + torch.arange(len(positions), device=positions.device)  # (q,) rows in the shortened prompt
        return bool(((positions >= self.window) & (positions > sequence)).any())

    def attend(
        self, query: Tensor, block_size: int, block_table: Tensor, length: int, rows: slice, past: int
    ) -> Tensor:
        """(q, H, hd): the request's rows ``rows`` of ``query`` over its ``length`` cached keys, by the rule."""
        assert self.slot_position is not None and self.slot_block is not None
        assert self.slot_key is not None and self.slot_value is not None
        impl = self.layer.impl
        used = block_table[: (length + block_size - 1) // block_size].long()  # (b,) the request's cache blocks
        slots = (used[:, None] * block_size + torch.arange(block_size, device=used.device)).flatten()[:length]
        key, value = self.slot_key[slots], self.slot_value[slots]  # (S, Hkv, hd)
        kv_heads = key.shape[1]
        heads = int(impl.num_heads)
        q = query.view(query.shape[0], heads, -1)[rows]  # (q, H, hd)
        key_position, key_block = self.slot_position[slots], self.slot_block[slots]  # (S,)
        query_position = self.step.positions[rows]  # type: ignore[index]
        query_block = self.step.blocks[rows]  # type: ignore[index]
        seen = (key_position[None] <= query_position[:, None]) | (
            (key_block[None] == query_block[:, None]) & (query_block[:, None] >= 0)
        )  # (q, S)
        if self.window is not None:
            seen &= key_position[None] > query_position[:, None] - self.window
            # keys out of the kernel's own window may sit in freed blocks: never read them (the rule's window is
            # narrower: a kept token is never farther in the shortened prompt than in the full one)
            sequence = past + torch.arange(q.shape[0], device=q.device)
            seen &= torch.arange(length, device=q.device)[None] > sequence[:, None] - self.window
        repeat = heads // kv_heads
        key = key.repeat_interleave(repeat, dim=1).transpose(0, 1)  # (H, S, hd)
        value = value.repeat_interleave(repeat, dim=1).transpose(0, 1)
        scores = torch.einsum("qhd,hsd->hqs", q.float(), key.float()) * float(impl.scale)  # (H, q, S)
        scores = scores.masked_fill(~seen[None], float("-inf"))
        return torch.einsum("hqs,hsd->qhd", scores.softmax(-1), value.float())  # (q, H, hd)

    def remove(self) -> None:
        self.layer.forward = self.vllm_forward

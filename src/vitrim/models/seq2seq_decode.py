"""Greedy and beam-search decoding for :class:`vitrim.models.seq2seq.Seq2SeqTransformer`, with its KV cache.

Both take the source ids (B, Ls) and the decoder's first input per sentence, ``start_ids`` (B,) (a language tag or
a BOS token), and return the generated ids (B, T) after the start token: each row ends with ``eos_id`` (then
``pad_id`` up to T) or stops at ``max_len`` tokens. Each step feeds only the newest token; the decoder's keys and
values of the earlier positions come from the cache, so a step costs O(T), not O(T²).

Beam search keeps ``beam_size`` hypotheses per sentence, scored by the sum of their tokens' log-probabilities;
a hypothesis that has written EOS is finished and keeps its score. At the end the best finished one is returned,
its score divided by ``length ** length_penalty`` (0: no normalisation, the default). With ``beam_size=1`` this is
greedy decoding, token for token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrim.models.seq2seq import Seq2SeqTransformer


def _check(model: Seq2SeqTransformer, src_ids: Tensor, start_ids: Tensor, max_len: int | None) -> int:
    if not isinstance(model, Seq2SeqTransformer):
        raise TypeError(f"model must be a Seq2SeqTransformer, got {type(model).__name__}")
    if src_ids.dim() != 2:
        raise ValueError(f"src_ids must be (B, Ls) token ids, got shape {tuple(src_ids.shape)}")
    if start_ids.shape != (src_ids.shape[0],):
        raise ValueError(
            f"start_ids must be ({src_ids.shape[0]},), one start token per sentence, got {tuple(start_ids.shape)}"
        )
    limit = model.config.max_len - 1  # the start token takes position 0
    if max_len is None:
        return limit
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= limit:
        raise ValueError(f"max_len must be an int in [1, {limit}] (the model's max_len - 1), got {max_len!r}")
    return max_len


@torch.no_grad()
def greedy_decode(model: Seq2SeqTransformer, src_ids: Tensor, start_ids: Tensor, max_len: int | None = None) -> Tensor:
    """The most likely next token, step by step. Returns (B, T) ids (module doc)."""
    max_len = _check(model, src_ids, start_ids, max_len)
    eos, pad = model.config.eos_id, model.config.pad_id
    memory, memory_mask, _ = model.encode(src_ids)
    cache = model.start_cache(memory, memory_mask)
    token = start_ids[:, None]  # (B, 1)
    done = torch.zeros(len(src_ids), dtype=torch.bool, device=src_ids.device)
    out = []
    for _ in range(max_len):
        logits, _, _ = model.decode(token, cache)  # (B, 1, V)
        token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        token = token.masked_fill(done[:, None], pad)
        out.append(token)
        done |= token[:, 0] == eos
        if bool(done.all()):
            break
    return torch.cat(out, dim=1)


@torch.no_grad()
def beam_search(
    model: Seq2SeqTransformer,
    src_ids: Tensor,
    start_ids: Tensor,
    beam_size: int = 4,
    max_len: int | None = None,
    length_penalty: float = 0.0,
) -> Tensor:
    """Beam search (module doc). Returns (B, T) ids of the best hypothesis per sentence."""
    max_len = _check(model, src_ids, start_ids, max_len)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1, got {beam_size!r}")
    eos, pad = model.config.eos_id, model.config.pad_id
    B, K = len(src_ids), beam_size
    memory, memory_mask, _ = model.encode(src_ids)
    rows = torch.arange(B, device=src_ids.device).repeat_interleave(K)  # (B·K,) beam row -> sentence
    cache = model.start_cache(memory, memory_mask).reorder(rows)
    scores = torch.full((B, K), float("-inf"), device=src_ids.device)
    scores[:, 0] = 0.0  # all beams start equal: let only the first one expand at step 1
    done = torch.zeros(B, K, dtype=torch.bool, device=src_ids.device)
    lengths = torch.zeros(B, K, device=src_ids.device)
    tokens = torch.empty(B, K, 0, dtype=torch.long, device=src_ids.device)
    last = start_ids.repeat_interleave(K)[:, None]  # (B·K, 1)
    for _ in range(max_len):
        logits, _, _ = model.decode(last, cache)  # (B·K, 1, V)
        logp = logits[:, -1].float().log_softmax(-1).view(B, K, -1)  # (B, K, V)
        V = logp.shape[-1]
        # a finished beam may only "write" padding, at no cost, so it keeps its score and its place
        finished_row = torch.full((V,), float("-inf"), device=logp.device)
        finished_row[pad] = 0.0
        logp = torch.where(done[..., None], finished_row, logp)
        candidates = (scores[..., None] + logp).view(B, K * V)  # (B, K·V)
        scores, flat = candidates.topk(K, dim=-1)  # (B, K) best first
        beam, token = flat // V, flat % V  # (B, K) which beam each survivor extends, and with which token
        tokens = torch.cat([tokens.gather(1, beam[..., None].expand(-1, -1, tokens.shape[-1])), token[..., None]], -1)
        was_done = done.gather(1, beam)
        lengths = lengths.gather(1, beam) + (~was_done).float()
        done = was_done | (token == eos)
        cache = cache.reorder((torch.arange(B, device=beam.device)[:, None] * K + beam).flatten())
        last = token.view(B * K, 1)
        if bool(done.all()):
            break
    final = scores / lengths.clamp(min=1.0) ** length_penalty if length_penalty else scores
    final = final.masked_fill(~done & done.any(-1, keepdim=True), float("-inf"))  # prefer finished hypotheses
    best = final.argmax(-1)  # (B,)
    return tokens[torch.arange(B, device=best.device), best]  # (B, T)

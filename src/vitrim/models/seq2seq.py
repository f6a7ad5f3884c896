"""A pre-norm Transformer encoder–decoder (translation), built on vitrim's one attention implementation.

    src ids (B, Ls) ─▶ token + position embedding ─▶ EncoderBlock × E ─▶ LN ─▶ memory (B, Ls, D)
        EncoderBlock: x + SelfAttn(LN(x)), x + MLP(LN(x))
    tgt ids (B, Lt) ─▶ token + position embedding ─▶ DecoderBlock × L ─▶ LN ─▶ lm_head ─▶ logits (B, Lt, V)
        DecoderBlock: y + CausalSelfAttn(LN(y)), y + CrossAttn(LN(y), memory), y + MLP(LN(y))

Every attention is a :class:`vitrim.MultiHeadAttention` whose scores come from
:func:`vitrim.scaled_dot_product_attention` (self-attention: ``self_attn.qkv``; cross-attention: ``cross_attn.q``
over the target and ``cross_attn.kv`` over the memory). The layout is ``torch.nn.Transformer``'s with
``norm_first=True`` and GELU, and its outputs equal torch's on the same weights (tests/translate).

Conventions (owned here):

* id 0 is padding, in both vocabularies. Key-padding masks are bool ``(B, 1, 1, L)``, True = a real token that may
  be attended to (vitrim's polarity; torch's ``key_padding_mask`` is its negation). Padded queries compute
  something harmless; no real token ever looks at a pad, so padding never changes a real token's output.
* Teacher forcing: the caller shifts. ``tgt_ids = [start, y_0, …, y_{n-2}]`` gives logits for ``[y_0, …, y_{n-1}]``;
  decoder position i sees target positions 0 … i only (causal), and every real source position (no causal mask).
* Attention maps, per layer, per head: encoder ``(B, H, Ls, Ls)``, decoder self ``(B, H, Lt, Lt)``, cross
  ``(B, H, Lt, Ls)``. Row i of a cross map is what decoder position i looked at while predicting output token i.
* KV cache (:class:`DecoderCache`): the source's keys and values are projected once per sentence; each step
  appends the new target positions' self-attention keys and values. Decoding with the cache equals recomputing the
  whole prefix (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vitrim.attention import MultiHeadAttention, scaled_dot_product_attention
from vitrim.models.layers import Mlp

POS_EMBEDS = ("sinusoidal", "learned")


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Sizes of a :class:`Seq2SeqTransformer`; the defaults are the translation demo's (trains in a minute on CPU)."""

    src_vocab_size: int
    tgt_vocab_size: int
    dim: int = 64
    encoder_depth: int = 2
    decoder_depth: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    max_len: int = 32  # longest source or target sequence (position table size)
    pos_embed: str = "sinusoidal"  # fixed sines (Vaswani et al.), or "learned"
    dropout: float = 0.0  # on embeddings, attention weights, residual branches
    norm_eps: float = 1e-5  # torch.nn.Transformer's default
    pad_id: int = 0
    eos_id: int = 1

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "dim", "encoder_depth", "decoder_depth", "num_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBEDS}, got {self.pos_embed!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


@dataclass
class Seq2SeqOutput:
    """What :meth:`Seq2SeqTransformer.forward_detailed` returns; attention lists are empty unless asked for."""

    logits: Tensor  # (B, Lt, V)
    memory: Tensor  # (B, Ls, D) encoder output
    encoder_attentions: list[Tensor] = field(default_factory=list)  # per layer (B, H, Ls, Ls)
    decoder_self_attentions: list[Tensor] = field(default_factory=list)  # per layer (B, H, Lt, Lt)
    cross_attentions: list[Tensor] = field(default_factory=list)  # per layer (B, H, Lt, Ls)


@dataclass
class DecoderCache:
    """Keys and values kept between decoding steps, per decoder layer, each (B, H, L, hd)."""

    cross_k: list[Tensor]
    cross_v: list[Tensor]
    memory_mask: Tensor  # (B, 1, 1, Ls) True = real source token
    self_k: list[Tensor | None]
    self_v: list[Tensor | None]

    @property
    def length(self) -> int:
        """Target positions already decoded."""
        k = self.self_k[0]
        return 0 if k is None else k.shape[-2]

    def reorder(self, index: Tensor) -> DecoderCache:
        """Keep rows ``index`` (B',) of the batch (beam search: the beams that survived, in their new order)."""
        rows = lambda ts: [t.index_select(0, index) for t in ts]  # noqa: E731
        maybe = lambda ts: [None if t is None else t.index_select(0, index) for t in ts]  # noqa: E731
        return DecoderCache(rows(self.cross_k), rows(self.cross_v), self.memory_mask.index_select(0, index),
                            maybe(self.self_k), maybe(self.self_v))  # fmt: skip


def sinusoidal_positions(length: int, dim: int) -> Tensor:
    """(length, dim): sin at even channels, cos at odd ones, wavelengths 2π … 10000·2π (Vaswani et al.)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]  # (L, 1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))  # (ceil(D/2),)
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return table


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> Tensor:
    """(Lq, Lk) bool for the last Lq of Lk positions: query i (absolute Lk − Lq + i) sees keys 0 … Lk − Lq + i.

    With Lq == Lk this is ``is_causal``; with a cache the queries are the newest positions (bottom-right).
    """
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device)[:, None] + offset
    return torch.arange(num_keys, device=device)[None, :] <= rows


class EncoderBlock(nn.Module):
    """x + SelfAttn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        dim, drop = config.dim, config.dropout
        self.norm1 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.attn = MultiHeadAttention(dim, config.num_heads, attn_drop=drop, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio), drop=drop)

    def forward(self, x: Tensor, mask: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """x (B, Ls, D), mask (B, 1, 1, Ls) -> x (B, Ls, D) and the weights (B, H, Ls, Ls) if asked."""
        attended, weights = self.attn(self.norm1(x), mask=mask, need_weights=need_weights)
        x = x + attended
        return x + self.mlp(self.norm2(x)), weights


class DecoderBlock(nn.Module):
    """y + CausalSelfAttn(LN(y)), y + CrossAttn(LN(y), memory), y + MLP(LN(y))."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        dim, heads, drop = config.dim, config.num_heads, config.dropout
        self.norm1 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.self_attn = MultiHeadAttention(dim, heads, attn_drop=drop, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.cross_attn = MultiHeadAttention(dim, heads, kv_dim=dim, attn_drop=drop, proj_drop=drop)
        self.norm3 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.mlp = Mlp(dim, int(dim * config.mlp_ratio), drop=drop)

    def forward(
        self,
        y: Tensor,
        memory_kv: tuple[Tensor, Tensor],
        memory_mask: Tensor,
        *,
        tgt_mask: Tensor | None = None,
        past_kv: tuple[Tensor, Tensor] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor | None, Tensor | None]:
        """One decoder layer on the newest target positions.

        Args:
            y: (B, Lnew, D) the target positions to compute (all of them, or the new ones when ``past_kv`` is set).
            memory_kv: the source's keys and values, each (B, H, Ls, hd) (:meth:`memory_keys_values`).
            memory_mask: (B, 1, 1, Ls) bool, True = real source token.
            tgt_mask: (B, 1, 1, Lt) bool, True = real target token (teacher forcing with padding), or None.
            past_kv: keys and values of the earlier target positions, each (B, H, Lpast, hd), or None.

        Returns:
            y (B, Lnew, D); this layer's self-attention keys and values including the new positions (for the cache);
            self-attention weights (B, H, Lnew, Lpast + Lnew) and cross-attention weights (B, H, Lnew, Ls) if asked.
        """
        attn, drop = self.self_attn, self.self_attn.attn_drop if self.training else 0.0
        q, k, v = attn.project_qkv(self.norm1(y))  # each (B, H, Lnew, hd)
        if past_kv is not None:
            k, v = torch.cat([past_kv[0], k], dim=-2), torch.cat([past_kv[1], v], dim=-2)  # (B, H, Lpast+Lnew, hd)
        if past_kv is None or past_kv[0].shape[-2] == 0:
            out, self_weights = scaled_dot_product_attention(
                q, k, v, tgt_mask, is_causal=True, dropout_p=drop, need_weights=need_weights
            )
        else:
            allowed = causal_mask(q.shape[-2], k.shape[-2], q.device)  # (Lnew, Lk): the newest rows
            if tgt_mask is not None:
                allowed = allowed & tgt_mask
            out, self_weights = scaled_dot_product_attention(
                q, k, v, allowed, dropout_p=drop, need_weights=need_weights
            )
        y = y + attn.project_out(out)

        cross, drop = self.cross_attn, self.cross_attn.attn_drop if self.training else 0.0
        q = self.cross_queries(self.norm2(y))  # (B, H, Lnew, hd)
        out, cross_weights = scaled_dot_product_attention(
            q, *memory_kv, memory_mask, dropout_p=drop, need_weights=need_weights
        )
        y = y + cross.project_out(out)
        return y + self.mlp(self.norm3(y)), (k, v), self_weights, cross_weights

    def cross_queries(self, y: Tensor) -> Tensor:
        """(B, L, D) -> (B, H, L, hd): the query half of ``cross_attn.project_qkv``."""
        attn = self.cross_attn
        B, L, _ = y.shape
        return attn.q_norm(attn.q(y).reshape(B, L, attn.num_heads, attn.head_dim).transpose(1, 2))

    def memory_keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """(B, Ls, D) -> k, v each (B, H, Ls, hd): the key/value half of ``cross_attn.project_qkv``, once per source."""
        attn = self.cross_attn
        B, L, _ = memory.shape
        k, v = attn.kv(memory).reshape(B, L, 2, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return attn.k_norm(k), v


class Seq2SeqTransformer(nn.Module):
    """Encoder–decoder Transformer (module doc). ``forward(src_ids, tgt_ids) -> logits (B, Lt, tgt_vocab_size)``."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        D = config.dim
        self.src_embed = nn.Embedding(config.src_vocab_size, D)
        self.tgt_embed = nn.Embedding(config.tgt_vocab_size, D)
        if config.pos_embed == "learned":
            self.src_pos = nn.Parameter(torch.randn(config.max_len, D) * 0.02)
            self.tgt_pos = nn.Parameter(torch.randn(config.max_len, D) * 0.02)
        else:
            table = sinusoidal_positions(config.max_len, D)
            self.register_buffer("src_pos", table, persistent=False)
            self.register_buffer("tgt_pos", table.clone(), persistent=False)
        self.embed_drop = nn.Dropout(config.dropout)
        self.encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.encoder_depth))
        self.encoder_norm = nn.LayerNorm(D, eps=config.norm_eps)
        self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.decoder_depth))
        self.decoder_norm = nn.LayerNorm(D, eps=config.norm_eps)
        self.lm_head = nn.Linear(D, config.tgt_vocab_size)

    @classmethod
    def from_config(cls, config: Seq2SeqConfig) -> Seq2SeqTransformer:
        return cls(config)

    def key_mask(self, ids: Tensor) -> Tensor:
        """(B, L) ids -> (B, 1, 1, L) bool, True = a real token (not padding)."""
        return (ids != self.config.pad_id)[:, None, None, :]

    def _embed(self, ids: Tensor, table: nn.Embedding, pos: Tensor, offset: int, name: str) -> Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
            raise ValueError(f"{name} must be a (B, L) tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")
        if offset + ids.shape[1] > pos.shape[0]:
            raise ValueError(
                f"{name} reaches position {offset + ids.shape[1]}, beyond max_len={pos.shape[0]} of this model"
            )
        return self.embed_drop(table(ids) + pos[offset : offset + ids.shape[1]])  # (B, L, D)

    def encode(self, src_ids: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """src_ids (B, Ls) -> memory (B, Ls, D), its key mask (B, 1, 1, Ls), per-layer weights if asked."""
        x = self._embed(src_ids, self.src_embed, self.src_pos, 0, "src_ids")
        mask = self.key_mask(src_ids)
        maps = []
        for block in self.encoder:
            x, weights = block(x, mask, need_weights)
            if weights is not None:
                maps.append(weights)
        return self.encoder_norm(x), mask, maps

    def start_cache(self, memory: Tensor, memory_mask: Tensor) -> DecoderCache:
        """A cache holding each layer's source keys and values, and no target position yet."""
        kvs = [block.memory_keys_values(memory) for block in self.decoder]  # type: ignore[operator]
        depth = len(self.decoder)
        return DecoderCache([k for k, _ in kvs], [v for _, v in kvs], memory_mask, [None] * depth, [None] * depth)

    def decode(
        self,
        tgt_ids: Tensor,
        cache: DecoderCache,
        *,
        tgt_mask: Tensor | None = None,
        need_weights: bool = False,
        update_cache: bool = True,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run the decoder on the next ``tgt_ids`` (B, Lnew), after the ``cache.length`` positions already seen.

        Returns logits (B, Lnew, V) and, if asked, per-layer self (B, H, Lnew, Lpast+Lnew) and cross
        (B, H, Lnew, Ls) weights. ``update_cache`` appends the new positions' keys and values to ``cache``.
        """
        y = self._embed(tgt_ids, self.tgt_embed, self.tgt_pos, cache.length, "tgt_ids")
        self_maps, cross_maps = [], []
        for i, block in enumerate(self.decoder):
            past_k, past_v = cache.self_k[i], cache.self_v[i]
            past = None if past_k is None or past_v is None else (past_k, past_v)
            memory_kv = (cache.cross_k[i], cache.cross_v[i])
            y, (k, v), self_w, cross_w = block(
                y, memory_kv, cache.memory_mask, tgt_mask=tgt_mask, past_kv=past, need_weights=need_weights
            )
            if update_cache:
                cache.self_k[i], cache.self_v[i] = k, v
            if self_w is not None and cross_w is not None:
                self_maps.append(self_w)
                cross_maps.append(cross_w)
        return self.lm_head(self.decoder_norm(y)), self_maps, cross_maps

    def forward_detailed(self, src_ids: Tensor, tgt_ids: Tensor, need_weights: bool = False) -> Seq2SeqOutput:
        """Teacher forcing on (B, Ls) source and (B, Lt) shifted target ids; maps per layer × head if asked."""
        if src_ids.shape[0] != tgt_ids.shape[0]:
            raise ValueError(
                f"src_ids and tgt_ids must share the batch: {tuple(src_ids.shape)} vs {tuple(tgt_ids.shape)}"
            )
        memory, memory_mask, encoder_maps = self.encode(src_ids, need_weights)
        cache = self.start_cache(memory, memory_mask)
        tgt_mask = self.key_mask(tgt_ids)
        logits, self_maps, cross_maps = self.decode(
            tgt_ids, cache, tgt_mask=tgt_mask, need_weights=need_weights, update_cache=False
        )
        return Seq2SeqOutput(logits, memory, encoder_maps, self_maps, cross_maps)

    def forward(self, src_ids: Tensor, tgt_ids: Tensor) -> Tensor:
        return self.forward_detailed(src_ids, tgt_ids).logits

"""The encoder–decoder against torch's own Transformer on the same weights: outputs and cross-attention maps.

The reference is ``torch.nn.Transformer(norm_first=True, activation="gelu")`` (and its layers), an independent
implementation of the same architecture; weights are copied by name in this file, not by the model's code.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitrim.models.seq2seq import DecoderBlock, EncoderBlock, Seq2SeqConfig, Seq2SeqTransformer

ATOL = 1e-5
# nn.Transformer builds its encoder with nested tensors on, then says it cannot use them with norm_first
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")


def config(**overrides: object) -> Seq2SeqConfig:
    base: dict = dict(src_vocab_size=13, tgt_vocab_size=11, dim=32, encoder_depth=2, decoder_depth=2, num_heads=4,
                      mlp_ratio=2.0, max_len=16)  # fmt: skip
    return Seq2SeqConfig(**{**base, **overrides})


def torch_transformer(cfg: Seq2SeqConfig) -> nn.Transformer:
    return nn.Transformer(
        cfg.dim, cfg.num_heads, cfg.encoder_depth, cfg.decoder_depth, int(cfg.dim * cfg.mlp_ratio), dropout=0.0,
        activation="gelu", layer_norm_eps=cfg.norm_eps, batch_first=True, norm_first=True,
    ).train()  # train mode with dropout 0: no fast path (its padded outputs differ), same numbers  # fmt: skip


def future(L: int) -> torch.Tensor:
    """torch's causal attn_mask: True = may NOT attend (the key lies in the query's future)."""
    return torch.ones(L, L, dtype=torch.bool).triu(1)


def copy_linear(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> None:
    dst.weight.copy_(weight)
    dst.bias.copy_(bias)


@torch.no_grad()
def copy_encoder_layer(dst: EncoderBlock, src: nn.TransformerEncoderLayer) -> None:
    copy_linear(dst.attn.qkv, src.self_attn.in_proj_weight, src.self_attn.in_proj_bias)
    copy_linear(dst.attn.proj, src.self_attn.out_proj.weight, src.self_attn.out_proj.bias)
    copy_linear(dst.mlp.fc1, src.linear1.weight, src.linear1.bias)
    copy_linear(dst.mlp.fc2, src.linear2.weight, src.linear2.bias)
    dst.norm1.load_state_dict(src.norm1.state_dict())
    dst.norm2.load_state_dict(src.norm2.state_dict())


@torch.no_grad()
def copy_decoder_layer(dst: DecoderBlock, src: nn.TransformerDecoderLayer) -> None:
    D = dst.self_attn.dim
    copy_linear(dst.self_attn.qkv, src.self_attn.in_proj_weight, src.self_attn.in_proj_bias)
    copy_linear(dst.self_attn.proj, src.self_attn.out_proj.weight, src.self_attn.out_proj.bias)
    cross = src.multihead_attn  # queries: the first D rows of the packed projection; keys and values: the rest
    copy_linear(dst.cross_attn.q, cross.in_proj_weight[:D], cross.in_proj_bias[:D])
    copy_linear(dst.cross_attn.kv, cross.in_proj_weight[D:], cross.in_proj_bias[D:])
    copy_linear(dst.cross_attn.proj, cross.out_proj.weight, cross.out_proj.bias)
    copy_linear(dst.mlp.fc1, src.linear1.weight, src.linear1.bias)
    copy_linear(dst.mlp.fc2, src.linear2.weight, src.linear2.bias)
    for name in ("norm1", "norm2", "norm3"):
        getattr(dst, name).load_state_dict(getattr(src, name).state_dict())


@torch.no_grad()
def copy_transformer(dst: Seq2SeqTransformer, src: nn.Transformer) -> None:
    for mine, theirs in zip(dst.encoder, src.encoder.layers):
        copy_encoder_layer(mine, theirs)
    for mine, theirs in zip(dst.decoder, src.decoder.layers):
        copy_decoder_layer(mine, theirs)
    dst.encoder_norm.load_state_dict(src.encoder.norm.state_dict())
    dst.decoder_norm.load_state_dict(src.decoder.norm.state_dict())


def padded_ids(lengths: list[int], vocab: int, generator: torch.Generator, first: int = 1) -> torch.Tensor:
    """(B, max length) ids in [first, vocab), padded with 0 after each row's length."""
    ids = torch.randint(first, vocab, (len(lengths), max(lengths)), generator=generator)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
    return ids


CASES = [  # (seed, source lengths, target lengths, heads)
    (0, [5, 3, 7], [4, 6, 2], 4),
    (1, [1, 8], [8, 1], 2),
    (2, [6, 6, 6, 6], [3, 5, 5, 1], 8),
]


def same_weights_and_batch(
    seed: int, heads: int, src_lengths: list[int], tgt_lengths: list[int], *, ids_seed: int
) -> tuple[Seq2SeqTransformer, nn.Transformer, torch.Tensor, torch.Tensor]:
    """vitrim's model and torch's transformer with the same weights, and a padded batch of ids (src, tgt)."""
    torch.manual_seed(seed)
    cfg = config(num_heads=heads)
    model, reference = Seq2SeqTransformer(cfg).eval(), torch_transformer(cfg)
    copy_transformer(model, reference)
    g = torch.Generator().manual_seed(ids_seed)
    return model, reference, padded_ids(src_lengths, 13, g), padded_ids(tgt_lengths, 11, g)


@pytest.mark.parametrize(("seed", "src_lengths", "tgt_lengths", "heads"), CASES)
def test_model_equals_torch_transformer(seed: int, src_lengths: list[int], tgt_lengths: list[int], heads: int) -> None:
    model, reference, src, tgt = same_weights_and_batch(seed, heads, src_lengths, tgt_lengths, ids_seed=seed + 100)
    src_emb = model.src_embed(src) + model.src_pos[: src.shape[1]]
    tgt_emb = model.tgt_embed(tgt) + model.tgt_pos[: tgt.shape[1]]
    Lt = tgt.shape[1]
    with torch.no_grad():
        hidden = reference(
            src_emb, tgt_emb, tgt_mask=future(Lt), tgt_is_causal=True,
            src_key_padding_mask=src == 0, tgt_key_padding_mask=tgt == 0, memory_key_padding_mask=src == 0,
        )  # fmt: skip
        expected = model.lm_head(hidden)
        got = model(src, tgt)
    real = tgt != 0  # rows of padded target positions are not compared: nothing reads them
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize(("seed", "src_lengths", "tgt_lengths", "heads"), CASES)
def test_cross_attention_maps_equal_torch_multihead_attention(
    seed: int, src_lengths: list[int], tgt_lengths: list[int], heads: int
) -> None:
    """Per layer and head, the cross-attention weights are torch's ``average_attn_weights=False`` weights."""
    model, reference, src, tgt = same_weights_and_batch(seed, heads, src_lengths, tgt_lengths, ids_seed=seed + 200)
    captured: list[tuple] = []

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((module, args, kwargs))

    hooks = [
        layer.multihead_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in reference.decoder.layers
    ]
    src_emb = model.src_embed(src) + model.src_pos[: src.shape[1]]
    tgt_emb = model.tgt_embed(tgt) + model.tgt_pos[: tgt.shape[1]]
    Lt = tgt.shape[1]
    with torch.no_grad():
        masks = dict(src_key_padding_mask=src == 0, tgt_key_padding_mask=tgt == 0, memory_key_padding_mask=src == 0)
        reference(src_emb, tgt_emb, tgt_mask=future(Lt), tgt_is_causal=True, **masks)
        for hook in hooks:
            hook.remove()
        out = model.forward_detailed(src, tgt, need_weights=True)
        assert len(out.cross_attentions) == len(captured) == model.config.decoder_depth
        for ours, (module, args, kwargs) in zip(out.cross_attentions, captured):
            query, key, value = args
            _, weights = module(query, key, value, key_padding_mask=kwargs["key_padding_mask"], need_weights=True,
                                average_attn_weights=False)  # fmt: skip
            assert ours.shape == (len(src_lengths), heads, Lt, src.shape[1])
            real = tgt != 0
            torch.testing.assert_close(
                ours.permute(0, 2, 1, 3)[real], weights.permute(0, 2, 1, 3)[real], atol=ATOL, rtol=0
            )
            padded_keys = (src == 0)[:, None, None, :].expand_as(ours)
            assert float(ours[padded_keys].abs().sum()) == 0.0  # no weight on a padded source token
            torch.testing.assert_close(ours.sum(-1), torch.ones_like(ours.sum(-1)))  # each row sums to 1


def test_encoder_and_decoder_self_attention_maps_equal_torch() -> None:
    torch.manual_seed(3)
    cfg = config(encoder_depth=1, decoder_depth=1)
    model, reference = Seq2SeqTransformer(cfg).eval(), torch_transformer(cfg)
    copy_transformer(model, reference)
    g = torch.Generator().manual_seed(5)
    src, tgt = padded_ids([6, 4], 13, g), padded_ids([5, 5], 11, g)
    x = model.src_embed(src) + model.src_pos[:6]
    y = model.tgt_embed(tgt) + model.tgt_pos[:5]
    with torch.no_grad():
        enc = reference.encoder.layers[0]
        _, enc_w = enc.self_attn(*(enc.norm1(x),) * 3, key_padding_mask=src == 0, average_attn_weights=False)
        dec = reference.decoder.layers[0]
        causal = future(5)
        _, dec_w = dec.self_attn(*(dec.norm1(y),) * 3, attn_mask=causal, average_attn_weights=False)
        out = model.forward_detailed(src, tgt, need_weights=True)
    torch.testing.assert_close(out.encoder_attentions[0], enc_w, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.decoder_self_attentions[0], dec_w, atol=ATOL, rtol=0)
    assert float(out.decoder_self_attentions[0].triu(1).abs().max()) == 0.0  # nothing above the diagonal


def test_learned_positions_are_parameters_and_sinusoids_are_vaswanis() -> None:
    learned = Seq2SeqTransformer(config(pos_embed="learned"))
    assert {"src_pos", "tgt_pos"} <= {name for name, _ in learned.named_parameters()}
    fixed = Seq2SeqTransformer(config())
    assert "src_pos" not in fixed.state_dict()  # a fixed table is rebuilt, not stored
    table = fixed.src_pos
    pos, i = 5, 3  # PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(…)
    angle = pos / 10000 ** (2 * i / 32)
    assert table[pos, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(angle)).item(), abs=1e-6)
    assert table[pos, 2 * i + 1].item() == pytest.approx(torch.cos(torch.tensor(angle)).item(), abs=1e-6)

"""Causality, padding, the KV cache and the decoders, each against a computation written here without them."""

from __future__ import annotations

import itertools

import pytest
import torch

from vitrim.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer, causal_mask
from vitrim.models.seq2seq_decode import beam_search, greedy_decode

PAD, EOS, START = 0, 1, 2


def make_model(seed: int, **overrides: object) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    base: dict = dict(src_vocab_size=12, tgt_vocab_size=9, dim=32, num_heads=4, max_len=12)
    model = Seq2SeqTransformer(Seq2SeqConfig(**{**base, **overrides})).eval()
    with torch.no_grad():  # sharper logits than the init's, so that decoding makes real choices
        model.lm_head.weight.mul_(8.0)
        # never <pad> or the start token, as a trained model: a <pad> inside a teacher-forced target would be masked
        model.lm_head.bias[[PAD, START]] = -1e4
    return model


def random_ids(shape: tuple[int, int], vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_target_token_cannot_see_later_target_tokens(seed: int) -> None:
    model = make_model(seed)
    src, tgt = random_ids((3, 5), 12, seed), random_ids((3, 7), 9, seed + 1)
    changed = tgt.clone()
    cut = 3
    changed[:, cut:] = random_ids((3, 7 - cut), 9, seed + 2)
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(before[:, :cut], after[:, :cut], atol=0, rtol=0)  # the kernel sees the same inputs
    assert not torch.allclose(before[:, cut:], after[:, cut:])  # (the later positions did change)


@pytest.mark.parametrize("seed", [0, 1])
def test_changing_the_source_changes_every_target_position(seed: int) -> None:
    """No causal mask on cross-attention: even the first target position sees the last source token."""
    model = make_model(seed)
    src, tgt = random_ids((2, 6), 12, seed), random_ids((2, 4), 9, seed + 1)
    changed = src.clone()
    changed[:, -1] = (changed[:, -1] - 3 + 1) % 9 + 3
    with torch.no_grad():
        delta = (model(src, tgt) - model(changed, tgt)).abs().amax(-1)  # (B, Lt)
    assert bool((delta > 1e-6).all())


@pytest.mark.parametrize("seed", [0, 3])
def test_padding_does_not_change_real_tokens(seed: int) -> None:
    """A batch of different lengths gives each sentence exactly what it gets alone, unpadded."""
    model = make_model(seed)
    lengths = [(5, 4), (2, 6), (7, 1)]
    sentences = [(random_ids((1, ls), 12, seed + i), random_ids((1, lt), 9, seed + 10 + i))
                 for i, (ls, lt) in enumerate(lengths)]  # fmt: skip
    src = torch.zeros(3, 7, dtype=torch.long)
    tgt = torch.zeros(3, 6, dtype=torch.long)
    for i, (s, t) in enumerate(sentences):
        src[i, : s.shape[1]], tgt[i, : t.shape[1]] = s[0], t[0]
    with torch.no_grad():
        batched = model.forward_detailed(src, tgt, need_weights=True)
        for i, (s, t) in enumerate(sentences):
            alone = model.forward_detailed(s, t, need_weights=True)
            ls, lt = s.shape[1], t.shape[1]
            torch.testing.assert_close(batched.logits[i, :lt], alone.logits[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(batched.memory[i, :ls], alone.memory[0], atol=1e-5, rtol=0)
            for ours, theirs in zip(batched.cross_attentions, alone.cross_attentions):
                torch.testing.assert_close(ours[i, :, :lt, :ls], theirs[0], atol=1e-6, rtol=0)
                assert float(ours[i, :, :lt, ls:].abs().sum()) == 0.0


def test_causal_mask_for_the_newest_queries() -> None:
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # queries 2 and 3 of 4 positions
    assert torch.equal(causal_mask(2, 4), expected)
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize(("seed", "chunks"), [(0, [1, 1, 1, 1, 1, 1]), (1, [2, 1, 3]), (2, [1, 4, 1])])
def test_kv_cached_decoding_equals_recomputing_the_prefix(seed: int, chunks: list[int]) -> None:
    """Feeding the target in pieces through the cache gives the logits and cross maps of the full pass."""
    model = make_model(seed)
    src = random_ids((2, 5), 12, seed)
    src[1, 3:] = PAD  # a padded source too
    tgt = random_ids((2, sum(chunks)), 9, seed + 1)
    with torch.no_grad():
        full = model.forward_detailed(src, tgt, need_weights=True)
        memory, memory_mask, _ = model.encode(src)
        cache = model.start_cache(memory, memory_mask)
        begin = 0
        for n in chunks:
            logits, self_maps, cross_maps = model.decode(tgt[:, begin : begin + n], cache, need_weights=True)
            torch.testing.assert_close(logits, full.logits[:, begin : begin + n], atol=1e-5, rtol=0)
            for ours, theirs in zip(cross_maps, full.cross_attentions):
                torch.testing.assert_close(ours, theirs[:, :, begin : begin + n], atol=1e-6, rtol=0)
            for ours, theirs in zip(self_maps, full.decoder_self_attentions):
                torch.testing.assert_close(ours, theirs[:, :, begin : begin + n, : begin + n], atol=1e-6, rtol=0)
            begin += n
            assert cache.length == begin


def naive_greedy(model: Seq2SeqTransformer, src: torch.Tensor, start: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy without a cache: the whole prefix is run again for every new token."""
    out = start[:, None]
    with torch.no_grad():
        for _ in range(steps):
            out = torch.cat([out, model(src, out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[:, 1:]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_greedy_with_cache_equals_greedy_without(seed: int) -> None:
    model = make_model(seed)
    src = random_ids((4, 6), 12, seed)
    src[2, 2:] = PAD
    start = torch.full((4,), START)
    got = greedy_decode(model, src, start, max_len=8)
    expected = naive_greedy(model, src, start, got.shape[1])
    for row, ref in zip(got.tolist(), expected.tolist()):  # after <eos> the decoder writes <pad>
        end = ref.index(EOS) + 1 if EOS in ref else len(ref)
        assert row[:end] == ref[:end] and all(t == PAD for t in row[end:])


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_beam_size_one_equals_greedy(seed: int) -> None:
    model = make_model(seed)
    src = random_ids((5, 6), 12, seed)
    src[0, 3:] = PAD
    start = torch.full((5,), START)
    assert torch.equal(
        beam_search(model, src, start, beam_size=1, max_len=9), greedy_decode(model, src, start, max_len=9)
    )


def sequence_logprob(model: Seq2SeqTransformer, src: torch.Tensor, seq: list[int]) -> float:
    ids = torch.tensor([[START, *seq]])
    with torch.no_grad():
        logp = model(src, ids[:, :-1]).log_softmax(-1)[0]
    return float(sum(logp[i, tok] for i, tok in enumerate(seq)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_wide_beam_finds_the_exhaustive_best(seed: int) -> None:
    """With a beam as wide as all prefixes, beam search returns the most likely finished sentence of ≤ T tokens."""
    model = make_model(seed, tgt_vocab_size=5)  # sentences are {3, 4}* <eos> (never <pad> or start, see make_model)
    src = random_ids((1, 4), 12, seed)
    T = 4
    words = [EOS, 3, 4]
    best, best_seq = float("-inf"), None
    for length in range(1, T + 1):
        for body in itertools.product([3, 4], repeat=length - 1):
            seq = [*body, EOS]
            score = sequence_logprob(model, src, seq)
            if score > best:
                best, best_seq = score, seq
    got = beam_search(model, src, torch.tensor([START]), beam_size=len(words) ** T, max_len=T)[0].tolist()
    assert got[: got.index(EOS) + 1] == best_seq


def test_decoder_arguments_are_checked() -> None:
    model = make_model(0)
    src = random_ids((2, 3), 12, 0)
    with pytest.raises(ValueError, match="start_ids must be \\(2,\\)"):
        greedy_decode(model, src, torch.tensor([START]))
    with pytest.raises(ValueError, match="max_len must be an int in \\[1, 11\\]"):
        greedy_decode(model, src, torch.full((2,), START), max_len=12)
    with pytest.raises(ValueError, match="beam_size must be an int >= 1, got 0"):
        beam_search(model, src, torch.full((2,), START), beam_size=0)
    with pytest.raises(ValueError, match="beyond max_len=12"):
        model(torch.ones(1, 13, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))

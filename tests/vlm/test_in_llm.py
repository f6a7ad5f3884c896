"""Dropping inside the LLM equals the full model with those keys masked from layer K on (prefill and decode),
keeps nothing-dropped runs bit for bit, and gives each sample of a padded batch what it gets alone."""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_kw, cache_of
from llm_reference import kept_keys, masked_forward, masked_layers, positions, prompts, transformers

from tiny_vlms.llms import tiny_llama, tiny_qwen2
from vitrim.vlm.method.dart import DartDrop
from vitrim.vlm.method.fastv import FastVDrop
from vitrim.vlm.method.pdrop import PyramidDrop
from vitrim.vlm.stages.in_llm import InLLMDrop
from vitrim.vlm.stages.spans import spans_from_mask

IMAGE_TOKENS = 8
LENGTHS = [(3, 4), (1, 2), (5, 6)]  # (text before, text after) the image, per sample: different prompt lengths
MIXED = [(3, 4, 1), (2, 3, 0), (1, 2, 2)]  # 1, 0 and 2 images: the samples keep different counts (re-padded)


FULL = pytest.mark.full


def _cases(names, default):
    """Every case of ``names``; only ``default`` runs in the default suite (the rest under ``-m full``)."""
    return [pytest.param(*case, marks=() if case in default else FULL) for case in names]


def _keep(count: int):
    return lambda num_tokens: count


POLICIES = {
    "fastv": lambda: FastVDrop(layer=2, tokens=_keep(3)),
    "dart": lambda: DartDrop(layer=1, tokens=_keep(5), pivot_image_token=2, pivot_text_token=1),
    "pdrop": lambda: PyramidDrop(layers=(1, 3), ratios=(0.5, 0.25)),
}


def _prefill(model, policy, input_ids, attention_mask, spans):
    drop = InLLMDrop(model.model, policy)
    drop.on_prefill(spans)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask), use_cache=True
    )
    return drop, out


def _drops(drop: InLLMDrop, spans) -> dict[int, torch.Tensor]:
    stages = drop.stage_selections()
    assert stages is not None
    return {stage.layer: kept_keys(spans, kept) for stage, kept in zip(drop.stages, stages, strict=True)}


@pytest.mark.parametrize(
    ("name", "mixed"),
    _cases(
        [(name, mixed) for name in sorted(POLICIES) for mixed in (False, True)], [("fastv", False), ("pdrop", True)]
    ),
)
def test_drop_equals_masked_full_model_prefill_and_decode(name, mixed):
    model = tiny_llama()
    input_ids, attention_mask, spans = prompts(MIXED if mixed else LENGTHS, IMAGE_TOKENS)
    drop, out = _prefill(model, POLICIES[name](), input_ids, attention_mask, spans)
    drops = _drops(drop, spans)
    next_ids = torch.tensor([[5], [7], [9]])
    longer = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = model(
        input_ids=next_ids, attention_mask=longer, position_ids=positions(longer)[:, -1:], **cache_kw(cache_of(out))
    )
    dropped = sum(int((~keep & spans.is_image).sum()) for keep in drops.values())
    assert dropped > 0
    cache_lengths = [layer.get_seq_length() for layer in cache_of(step).layers]
    drop.remove()

    cache = transformers.DynamicCache(config=model.config)
    reference = masked_forward(model, input_ids, attention_mask, drops, cache=cache)
    kept = attention_mask.bool() & list(drops.values())[-1]
    assert (out.logits - reference)[kept].abs().max() <= 1e-12
    grown = {layer: torch.cat([keep, torch.ones(3, 1, dtype=torch.bool)], dim=1) for layer, keep in drops.items()}
    reference_step = masked_forward(model, next_ids, longer, grown, cache=cache, past=input_ids.shape[1])
    assert (step.logits - reference_step).abs().max() <= 1e-12
    # each layer's cache holds exactly the tokens still there at that layer (+ the decoded one)
    full = input_ids.shape[1] + 1
    for index, length in enumerate(cache_lengths):
        stages = [stage for stage in drop.stages if stage.layer <= index]
        expected = full if not stages else full - int((~drops[stages[-1].layer]).sum(dim=1).min())
        assert length == expected


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_keep_all_is_the_unmodified_model_bit_for_bit(name):
    model = tiny_llama(seed=1)
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS, seed=1)
    position_ids = positions(attention_mask)
    plain = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
    policy = {
        "fastv": FastVDrop(layer=1, tokens=_keep(IMAGE_TOKENS)),
        "dart": DartDrop(layer=1, tokens=_keep(IMAGE_TOKENS)),
        "pdrop": PyramidDrop(layers=(1, 2), ratios=(1.0, 1.0)),
    }[name]
    drop, out = _prefill(model, policy, input_ids, attention_mask, spans)
    assert torch.equal(out.logits, plain.logits)
    next_ids = torch.tensor([[5], [7], [9]])
    longer = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    kwargs = {"input_ids": next_ids, "attention_mask": longer, "position_ids": positions(longer)[:, -1:]}
    step = model(**kwargs, **cache_kw(cache_of(out)))
    drop.remove()
    assert torch.equal(step.logits, model(**kwargs, **cache_kw(cache_of(plain))).logits)
    assert [kept.tolist() for kept in drop.selection()] == [list(range(IMAGE_TOKENS))] * 3


@pytest.mark.parametrize("name", _cases([("dart",), ("fastv",), ("pdrop",)], [("dart",)]))
def test_each_sample_of_a_padded_batch_equals_that_sample_alone(name):
    model = tiny_llama(seed=2)
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS, seed=2)
    drop, batched = _prefill(model, POLICIES[name](), input_ids, attention_mask, spans)
    next_ids = torch.tensor([[5], [7], [9]])
    longer = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = model(
        input_ids=next_ids, attention_mask=longer, position_ids=positions(longer)[:, -1:], **cache_kw(cache_of(batched))
    )
    selection = drop.selection()
    drop.remove()
    for sample, lengths in enumerate(LENGTHS):
        ids, mask, alone_spans = prompts([lengths], IMAGE_TOKENS, seed=2)
        ids = input_ids[sample : sample + 1, input_ids.shape[1] - ids.shape[1] :]  # the same tokens, unpadded
        drop, alone = _prefill(model, POLICIES[name](), ids, mask, alone_spans)
        one = torch.ones(1, 1, dtype=torch.long)
        grown = torch.cat([mask, one], 1)
        alone_step = model(input_ids=next_ids[sample : sample + 1], attention_mask=grown,
                           position_ids=positions(grown)[:, -1:], **cache_kw(cache_of(alone)))  # fmt: skip
        assert torch.equal(drop.selection()[0], selection[sample])
        drop.remove()
        width = ids.shape[1]
        assert (batched.logits[sample, -width:] - alone.logits[0]).abs().max() <= 1e-12
        assert (step.logits[sample] - alone_step.logits[0]).abs().max() <= 1e-12


@FULL
def test_generate_runs_on_the_kept_tokens_and_remove_restores_the_model():
    model = tiny_llama(seed=3)
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS, seed=3)
    plain = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    drop = InLLMDrop(model.model, FastVDrop(layer=2, tokens=_keep(2)))
    drop.on_prefill(spans)
    pruned = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    drops = _drops(drop, spans)
    drop.remove()
    # greedy decoding of the masked reference, step by step on its full cache
    cache = transformers.DynamicCache(config=model.config)
    mask, ids, keep = attention_mask, input_ids, drops[2]
    logits = masked_forward(model, ids, mask, {2: keep}, cache=cache)
    tokens = []
    for _ in range(3):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        past = mask.shape[1]
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        keep = torch.cat([keep, torch.ones(3, 1, dtype=torch.bool)], dim=1)
        logits = masked_forward(model, token, mask, {2: keep}, cache=cache, past=past)
    assert torch.equal(pruned[:, input_ids.shape[1] :], torch.cat(tokens, dim=1))
    again = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(again, plain)


def test_bad_layers_and_attention_implementations_are_refused_clearly():
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"drop layer 4 \(layer= / layers=\) is outside the LLM"):
        InLLMDrop(model.model, FastVDrop(layer=4, tokens=_keep(2)))
    with pytest.raises(ValueError, match=r"drop layer 0 \(layer= / layers=\) is outside the LLM"):
        InLLMDrop(model.model, FastVDrop(layer=0, tokens=_keep(2)))
    with pytest.raises(ValueError, match=r"layers=\(2, 1\) must increase"):
        PyramidDrop(layers=(2, 1), ratios=(0.5, 0.25))
    with pytest.raises(ValueError, match="must be fractions"):
        PyramidDrop(layers=(1, 2), ratios=(0.25, 0.5))
    assert not model.model.layers[0]._forward_pre_hooks  # a refused install leaves no hook behind
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="runs on 'sdpa' or 'eager' attention; the LLM uses 'flex_attention'"):
        InLLMDrop(model.model, FastVDrop(layer=1, tokens=_keep(2)))


def test_a_cache_cut_outside_vitrim_is_refused_at_the_next_decode_step():
    model = tiny_llama()
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS)
    drop, out = _prefill(model, FastVDrop(layer=2, tokens=_keep(2)), input_ids, attention_mask, spans)
    cache_of(out).crop(-1)  # what assisted decoding does to reject a drafted token
    with pytest.raises(RuntimeError, match="the KV cache of decoder layer 2 holds"):
        model(input_ids=torch.tensor([[5], [7], [9]]), attention_mask=attention_mask, **cache_kw(cache_of(out)))
    drop.remove()


def test_spans_of_another_input_are_refused():
    model = tiny_llama()
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS)
    drop = InLLMDrop(model.model, FastVDrop(layer=2, tokens=_keep(2)))
    drop.on_prefill(spans)
    with pytest.raises(ValueError, match="image spans cover"):
        model(input_ids=input_ids[:, 1:], attention_mask=attention_mask[:, 1:])
    drop.remove()


@pytest.mark.parametrize(
    ("name", "side"),
    _cases([(n, s) for n in sorted(POLICIES) for s in ("left", "right")], [("fastv", "right"), ("pdrop", "left")]),
)
def test_mixed_image_counts_either_padding_side_equal_each_sample_alone(name, side):
    model = tiny_llama(seed=7)
    input_ids, attention_mask, spans = prompts(MIXED, IMAGE_TOKENS, seed=7, side=side)
    drop, batched = _prefill(model, POLICIES[name](), input_ids, attention_mask, spans)
    next_ids = torch.tensor([[5], [7], [9]])
    longer = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = model(
        input_ids=next_ids, attention_mask=longer, position_ids=positions(longer)[:, -1:], **cache_kw(cache_of(batched))
    )
    selection = drop.selection()
    drop.remove()
    image = 0
    for sample, (_, _, images) in enumerate(MIXED):
        real = attention_mask[sample].bool()
        ids = input_ids[sample, real][None]
        alone_spans = spans_from_mask(spans.is_image[sample, real][None], [IMAGE_TOKENS] * images)
        mask = torch.ones_like(ids)
        drop, alone = _prefill(model, POLICIES[name](), ids, mask, alone_spans)
        longer_alone = torch.ones(1, ids.shape[1] + 1, dtype=torch.long)
        alone_step = model(input_ids=next_ids[sample : sample + 1], attention_mask=longer_alone,
                           position_ids=positions(longer_alone)[:, -1:], **cache_kw(cache_of(alone)))  # fmt: skip
        alone_selection = drop.selection() if images else []
        drop.remove()
        assert [kept.tolist() for kept in alone_selection] == [
            kept.tolist() for kept in selection[image : image + images]
        ]
        image += images
        assert (batched.logits[sample, real] - alone.logits[0]).abs().max() <= 1e-12
        assert (step.logits[sample] - alone_step.logits[0]).abs().max() <= 1e-12


@pytest.mark.parametrize(
    ("implementation", "tolerance"),
    # eager: transformers' eager attention takes its softmax in float32, whose sums round differently over fewer keys
    [("sdpa", 1e-12), pytest.param("eager", 1e-5, marks=FULL)],
)
def test_qwen2_layers_drop_like_the_masked_model(implementation, tolerance):
    model = tiny_qwen2(implementation=implementation)
    lengths = LENGTHS if implementation == "sdpa" else LENGTHS[:1]  # eager float64 turns padded rows into NaN
    input_ids, attention_mask, spans = prompts(lengths, IMAGE_TOKENS)
    for policy in (FastVDrop(layer=2, tokens=_keep(3)), DartDrop(layer=1, tokens=_keep(5))):
        drop, out = _prefill(model, policy, input_ids, attention_mask, spans)
        keep = kept_keys(spans, drop.selection())
        drop.remove()
        reference = masked_forward(model, input_ids, attention_mask, {policy.layer: keep})
        assert (out.logits - reference)[attention_mask.bool() & keep].abs().max() <= tolerance


def test_qwen2_sliding_window_layers_drop_like_the_masked_model_with_their_window():
    """Qwen2 with sliding-window layers (window 4, shorter than the prompts; layer 0 full, 1 and 2 sliding): each
    layer's own mask, the window counted in original columns, and a decode step on the window caches."""
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1, initializer_range=0.3,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).double().eval()
    windows = [None, 4, 4]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == windows
    # little text after the last image: the window caches hold kept image tokens, some beyond the window at decode
    input_ids, attention_mask, spans = prompts([(3, 1, 1), (2, 3, 0), (1, 0, 2)], IMAGE_TOKENS)
    drop, out = _prefill(model, FastVDrop(layer=1, tokens=_keep(3)), input_ids, attention_mask, spans)
    keep = kept_keys(spans, drop.selection())
    next_ids = torch.tensor([[5], [7], [9]])
    longer = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = model(
        input_ids=next_ids, attention_mask=longer, position_ids=positions(longer)[:, -1:], **cache_kw(cache_of(out))
    )
    drop.remove()
    cache = transformers.DynamicCache()  # every layer keeps every token: the window is a mask here
    embeds = model.model.embed_tokens(input_ids)
    hidden = masked_layers(model.model, embeds, attention_mask, positions(attention_mask), {1: keep}, cache,
                           windows=windows)  # fmt: skip
    kept = attention_mask.bool() & keep
    assert (out.logits - model.lm_head(hidden))[kept].abs().max() <= 1e-12
    grown = {1: torch.cat([keep, torch.ones(3, 1, dtype=torch.bool)], dim=1)}
    hidden = masked_layers(model.model, model.model.embed_tokens(next_ids), longer, positions(longer)[:, -1:], grown,
                           cache, past=input_ids.shape[1], windows=windows)  # fmt: skip
    assert (step.logits - model.lm_head(hidden)).abs().max() <= 1e-12


@pytest.mark.parametrize("pyramid", [False, pytest.param(True, marks=FULL)])
def test_qwen2_5_vl_text_stack_with_m_rope_positions_drops_like_the_masked_model(pyramid):
    """The LLM of Qwen2.5-VL takes (3, B, L) position ids (M-RoPE): gathered with the kept tokens, original values."""
    text = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    config = transformers.Qwen2_5_VLTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    lm = text.Qwen2_5_VLTextModel(config).double().eval()
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS)
    embeds = lm.embed_tokens(input_ids)
    position_ids = positions(attention_mask)[None].repeat(3, 1, 1)  # (3, B, L)
    position_ids[1] = position_ids[1] * 2 % 7  # height/width rows that differ from the temporal one
    policy = PyramidDrop(layers=(1, 2), ratios=(0.5, 0.25)) if pyramid else FastVDrop(layer=2, tokens=_keep(3))
    drop = InLLMDrop(lm, policy)
    drop.on_prefill(spans)
    out = lm(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    drops = _drops(drop, spans)
    drop.remove()
    reference = masked_layers(lm, embeds, attention_mask, position_ids, drops)
    kept = attention_mask.bool() & list(drops.values())[-1]
    assert (out - reference)[kept].abs().max() <= 1e-12


def test_a_prepared_4d_mask_tells_the_padding_as_the_2d_mask_does():
    """Handed a ready 4-D mask (transformers passes it through), the drop reads the padding from its last row."""
    model = tiny_llama(seed=9)
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS, seed=9, side="right")  # last token ≠ last column
    length = input_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    prepared = (causal[None] & attention_mask.bool()[:, None, :]).unsqueeze(1)  # (B, 1, L, L)
    chosen, logits = [], []
    for mask in (attention_mask, prepared):
        drop = InLLMDrop(model.model, FastVDrop(layer=2, tokens=_keep(3)))
        drop.on_prefill(spans)
        logits.append(model(input_ids=input_ids, attention_mask=mask, position_ids=positions(attention_mask)).logits)
        chosen.append([kept.tolist() for kept in drop.selection()])
        drop.remove()
    assert chosen[0] == chosen[1]
    real = attention_mask.bool()
    assert (logits[0] - logits[1])[real].abs().max() <= 1e-12

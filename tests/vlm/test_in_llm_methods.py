"""Each in-LLM method keeps what an independent re-implementation of its authors' selection keeps, on the same
model: attention read from transformers' eager attention (``output_attentions``), keys read from the KV cache,
the selection written here in plain Python (ties to the earlier token, as vitrim documents)."""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_of
from llm_reference import (
    dart_authors_reference,
    dart_reference,
    kept_keys,
    masked_forward,
    positions,
    prompts,
    top_k_reference,
)

from tiny_vlms.llms import tiny_llama
from vitrim.vlm.method.dart import DartDrop, dart_keep
from vitrim.vlm.method.fastv import FastVDrop, fastv_keep
from vitrim.vlm.method.pdrop import PyramidDrop, pdrop_keep
from vitrim.vlm.stages.in_llm import InLLMDrop

IMAGE_TOKENS = 8
FULL = pytest.mark.full
LENGTHS = [(3, 4), (1, 2), (5, 6)]


def _run(model, policy, seed):
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS, seed=seed)
    drop = InLLMDrop(model.model, policy)
    drop.on_prefill(spans)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask))
    stages = drop.stage_selections()
    drop.remove()
    return input_ids, attention_mask, spans, stages


def _image_columns(spans, sample):
    return spans.is_image[sample].nonzero().flatten()  # raster order = column order here


def _alone(sample, seed):
    """Sample ``sample`` of the batch without its padding (eager attention turns padded rows into NaN in float64,
    so the references read each sample alone; vitrim's selection is read from the padded batch)."""
    batch_ids = prompts(LENGTHS, IMAGE_TOKENS, seed=seed)[0]
    input_ids, attention_mask, spans = prompts([LENGTHS[sample]], IMAGE_TOKENS, seed=seed)
    input_ids = batch_ids[sample : sample + 1, batch_ids.shape[1] - input_ids.shape[1] :]
    return input_ids, attention_mask, spans


@pytest.mark.parametrize(("layer", "keep"), [(2, 5), pytest.param(1, 3, marks=FULL), pytest.param(3, 1, marks=FULL)])
def test_fastv_keeps_the_top_tokens_of_the_last_tokens_attention_at_layer_k_minus_1(layer, keep):
    model = tiny_llama(seed=4)
    stages = _run(model, FastVDrop(layer=layer, tokens=lambda n: keep), seed=4)[3]
    model.set_attn_implementation("eager")
    for sample in range(len(LENGTHS)):
        input_ids, attention_mask, spans = _alone(sample, seed=4)
        attentions = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True).attentions
        row = attentions[layer - 1][0, :, -1].mean(dim=0)  # (L,) heads averaged, the last token's row
        expected = top_k_reference(row[_image_columns(spans, 0)], keep)
        assert stages[0][sample].tolist() == expected


@pytest.mark.parametrize(("layers", "ratios"), [((1, 3), (0.5, 0.25)), pytest.param((2, 3), (0.75, 0.375), marks=FULL)])
def test_pdrop_ranks_each_stage_by_its_own_layers_attention_on_the_tokens_still_there(layers, ratios):
    model = tiny_llama(seed=5)
    stages = _run(model, PyramidDrop(layers=layers, ratios=ratios), seed=5)[3]
    model.set_attn_implementation("eager")
    weights = {}
    hooks = [
        model.model.layers[layer].self_attn.register_forward_hook(
            lambda module, args, output, layer=layer: weights.__setitem__(layer, output[1])
        )
        for layer in layers
    ]
    for sample in range(len(LENGTHS)):
        input_ids, attention_mask, spans = _alone(sample, seed=5)
        still = torch.arange(IMAGE_TOKENS)
        drops = {}
        for stage, (layer, ratio) in enumerate(zip(layers, ratios, strict=True)):
            masked_forward(model, input_ids, attention_mask, drops)  # the layer sees the earlier stages' drops
            row = weights[layer][0, :, -1].mean(dim=0)  # (L,) heads averaged, the last token's row
            scores = row[_image_columns(spans, 0)][still]
            still = still[top_k_reference(scores, int(IMAGE_TOKENS * ratio))]
            assert stages[stage][sample].tolist() == still.tolist()
            drops[layer] = kept_keys(spans, [still])
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize(
    ("layer", "keep", "pivots"),
    [(2, 7, (4, 4)), pytest.param(1, 5, (2, 1), marks=FULL), pytest.param(2, 3, (4, 4), marks=FULL)],
)
def test_dart_keeps_key_norm_pivots_and_the_tokens_least_duplicated_with_them(layer, keep, pivots):
    model = tiny_llama(seed=6)
    policy = DartDrop(layer=layer, tokens=lambda n: keep, pivot_image_token=pivots[0], pivot_text_token=pivots[1])
    stages = _run(model, policy, seed=6)[3]
    for sample in range(len(LENGTHS)):
        input_ids, _, spans = _alone(sample, seed=6)
        out = model(input_ids=input_ids, use_cache=True, output_hidden_states=True)
        keys = cache_of(out).layers[layer - 1].keys.transpose(1, 2).flatten(2)[0]  # (L, Hkv·hd) post-rotary, as cached
        states = model.model.norm(out.hidden_states[layer])[0].detach()  # (L, D) layer K's input through the final norm
        image = _image_columns(spans, 0)
        text = torch.arange(int(image.max()) + 1, input_ids.shape[1])  # the text after the image
        norms = keys.abs().sum(dim=-1)
        expected = dart_reference(
            norms[image], norms[text], states[image], states[text], keep, *pivots, positions=(image, text)
        )
        assert stages[0][sample].tolist() == expected


@pytest.mark.parametrize(
    ("per_pivot", "pivots", "image_tokens"),
    [(1, (4, 4), 16), pytest.param(2, (4, 4), 24, marks=FULL), pytest.param(3, (2, 3), 20, marks=FULL)],
)
def test_dart_at_the_authors_own_count_keeps_what_their_code_keeps(per_pivot, pivots, image_tokens):
    """keep = image pivots + t · (all pivots), so every pivot takes t tokens as in the authors' code (ported step for
    step in ``llm_reference.dart_authors_reference``): the same kept tokens in their pivot order, the default."""
    model = tiny_llama(seed=9)
    lengths = [(35, 9), (3, 12), (20, 6)]  # the image after 35 tokens, as LLaVA-1.5's prompt places it
    keep = pivots[0] + per_pivot * sum(pivots)
    policy = DartDrop(layer=2, tokens=lambda n: keep, pivot_image_token=pivots[0], pivot_text_token=pivots[1])
    drop = InLLMDrop(model.model, policy)
    input_ids, attention_mask, spans = prompts(lengths, image_tokens, seed=9)
    drop.on_prefill(spans)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask))
    kept = [k.tolist() for k in drop.selection()]
    drop.remove()
    for sample, (before, _) in enumerate(lengths):
        alone = input_ids[sample, attention_mask[sample].bool()][None]  # the sample without its padding
        out = model(input_ids=alone, use_cache=True, output_hidden_states=True)
        norms = cache_of(out).layers[1].keys.transpose(1, 2).flatten(2)[0].abs().sum(-1)  # (L,) layer K−1 = 1
        states = model.model.norm(out.hidden_states[2])[0].detach()
        expected = dart_authors_reference(norms, states, before, image_tokens, *pivots, per_pivot)
        assert kept[sample] == expected, sample


def test_ties_go_to_the_earlier_token():
    rows = torch.tensor([[0.1, 0.3, 0.3, 0.0, 0.3, 0.3]], dtype=torch.float64)  # four tied maxima
    for keep in (1, 2, 3):
        assert fastv_keep(rows, keep).tolist() == top_k_reference(rows[0], keep) == [1, 2, 4][:keep]
        assert pdrop_keep(rows.expand(3, -1), keep).tolist() == [1, 2, 4][:keep]
    states = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    norms = torch.tensor([2.0, 2.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)  # tied pivots
    text_states = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    text_norms = torch.tensor([3.0, 3.0], dtype=torch.float64)
    for keep, pivots in ((1, (2, 1)), (4, (1, 1)), (5, (2, 2))):
        got = dart_keep(norms, text_norms, states, text_states, keep, *pivots).tolist()
        assert got == dart_reference(norms, text_norms, states, text_states, keep, *pivots)
        assert len(got) == keep


@pytest.mark.parametrize("policy", [FastVDrop(layer=2, tokens=lambda n: 4), DartDrop(layer=2, tokens=lambda n: 5)])
def test_keys_read_from_the_kv_cache_and_recomputed_select_the_same_tokens(policy):
    """With a cache, layer K−1's keys come from it; without one, from the layer's weights: the same selection."""
    model = tiny_llama(seed=8)
    input_ids, attention_mask, spans = prompts(LENGTHS, IMAGE_TOKENS, seed=8)
    chosen = []
    for use_cache in (True, False):
        drop = InLLMDrop(model.model, policy)
        drop.on_prefill(spans)
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)
        chosen.append([kept.tolist() for kept in drop.selection()])
        drop.remove()
    assert chosen[0] == chosen[1]

"""LLaVA-NeXT (anyres tiles, newline tokens): selected per tile, the packed image tokens shortened alike; the pruned
model equals the full model with the dropped image keys masked out, at prefill and in decoding."""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_kw, cache_of
from llm_reference import masked_layers

import vitrim.vlm
from tiny_vlms.llava import IMAGE_TOKEN, PAD
from tiny_vlms.llava_next import SIZES, TOKENS, inputs, tiny_llava_next
from vitrim.vlm.families import find_family

TOL = 1e-12


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llava_next()


@pytest.fixture(autouse=True)
def _clean(model: torch.nn.Module):
    yield
    if hasattr(model, "_vitrim_vlm"):
        vitrim.vlm.remove(model)


def test_the_token_map_is_transformers_packing_by_hand(model: torch.nn.Module) -> None:
    """No unpadding at these aspect ratios: base tile, then grid rows of 4·columns tokens, each + a newline."""
    maps = find_family(model).token_maps(SIZES)
    for image, columns in ((0, 2), (1, 2)):
        rows = 1 if image == 0 else 2
        expected = list(range(16))  # the base tile
        for row in range(4 * rows):
            for col in range(4 * columns):
                tile = 1 + (row // 4) * columns + col // 4
                expected.append(tile * 16 + (row % 4) * 4 + col % 4)
            expected.append(-1)
        assert maps[image].tolist() == expected


def test_keeping_every_token_is_the_unmodified_model_bit_for_bit(model: torch.nn.Module) -> None:
    reference = model(**inputs()).logits
    vitrim.vlm.apply(model, "fastervlm", keep=16)
    assert torch.equal(model(**inputs()).logits, reference)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == TOKENS
    vitrim.vlm.remove(model)
    assert "get_image_features" not in model.model.__dict__  # the instance wrapper is gone
    assert torch.equal(model(**inputs()).logits, reference)


@pytest.mark.full
def test_watch_spans_sees_the_packed_image_tokens_under_generate(model: torch.nn.Module) -> None:
    seen = []
    unwatch = find_family(model).watch_spans(seen.append)
    model.generate(**inputs(), max_new_tokens=2, do_sample=False)
    unwatch()
    assert "get_image_features" not in model.model.__dict__
    assert len(seen) == 1
    columns = (inputs()["input_ids"][0] == IMAGE_TOKEN).nonzero()[:, 0]
    assert seen[0].image_of[0, columns].tolist() == [0] * TOKENS[0] + [1] * TOKENS[1]


def dropped_mask(ids: torch.Tensor, kept: list[torch.Tensor]) -> torch.Tensor:
    mask = torch.ones_like(ids)
    columns = (ids[0] == IMAGE_TOKEN).nonzero()[:, 0].tolist()
    start = 0
    for image, count in enumerate(TOKENS):
        keep = set(kept[image].tolist())
        for token in range(count):
            if token not in keep:
                mask[0, columns[start + token]] = 0
        start += count
    return mask


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("fastervlm", {}),
        pytest.param("divprune", {}, marks=pytest.mark.full),
        pytest.param("scope", {}, marks=pytest.mark.full),
        pytest.param("cdpruner", {"theta": 0}, marks=pytest.mark.full),
    ],
)
def test_dropping_equals_the_full_model_with_those_keys_masked(model: torch.nn.Module, method: str, options) -> None:
    vitrim.vlm.apply(model, method, keep=5, **options, positions="original")
    pruned = model(**inputs()).logits
    kept = vitrim.vlm.last_selection(model)
    # per tile 5 tokens (3 and 5 tiles), and every newline token (4 and 8)
    assert [len(k) for k in kept] == [3 * 5 + 4, 5 * 5 + 8]
    vitrim.vlm.remove(model)
    mask = dropped_mask(inputs()["input_ids"], kept)
    full = model(**inputs(), attention_mask=mask).logits
    assert (full[0, mask[0].bool()] - pruned[0]).abs().max() <= TOL


@pytest.mark.parametrize(("method", "options"), [("visionzip", {"contextual": 2}), ("downsample", {})])
def test_merged_groups_cover_every_token_the_llm_would_see(model: torch.nn.Module, method: str, options) -> None:
    vitrim.vlm.apply(model, method, keep=5, **options)  # downsample: each 4 × 4 tile pooled to 5 cells
    model(**inputs())
    for image, groups in enumerate(vitrim.vlm.last_selection(model, groups=True)):
        assert sorted(torch.cat(groups).tolist()) == list(range(TOKENS[image]))


def test_generate_equals_greedy_decoding_of_the_masked_model(model: torch.nn.Module) -> None:
    vitrim.vlm.apply(model, "fastervlm", keep=3, positions="original")
    generated = model.generate(**inputs(), max_new_tokens=3, do_sample=False)
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    ids = inputs()["input_ids"]
    mask = dropped_mask(ids, kept)
    positions = torch.arange(ids.shape[1])[None]
    out = model(**inputs(), attention_mask=mask, position_ids=positions, use_cache=True)
    tokens = []
    for step in range(3):
        token = out.logits[0, -1].argmax()
        tokens.append(int(token))
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
        position = torch.tensor([[ids.shape[1] + step]])
        out = model(input_ids=token.view(1, 1), **cache_kw(cache_of(out)), attention_mask=mask, position_ids=position)
    assert generated[0, ids.shape[1] :].tolist() == tokens


def test_keep_counts_per_tile_and_is_checked_against_a_tile(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="keep=17 is more than the image's 16 tokens"):
        vitrim.vlm.apply(model, "fastervlm", keep=17)
    assert not hasattr(model, "_vitrim_vlm")
    assert "get_image_features" not in model.model.__dict__


@pytest.mark.full
def test_a_left_padded_batch_and_beam_search_equal_each_prompt_alone(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(2)
    prompts = [
        torch.tensor([5] + [IMAGE_TOKEN] * TOKENS[0] + [7, 8]),
        torch.tensor([5, 6, 9, 10] + [IMAGE_TOKEN] * TOKENS[1] + [7]),
    ]
    pv = torch.randn(2, 5, 3, 16, 16, dtype=torch.float64, generator=generator)
    length = max(len(p) for p in prompts)
    ids = torch.full((2, length), PAD)
    mask = torch.zeros(2, length, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, length - len(p) :], mask[row, length - len(p) :] = p, 1
    options = dict(max_new_tokens=3, do_sample=False, num_beams=2, num_return_sequences=2)
    vitrim.vlm.apply(model, "fastervlm", keep=4)
    together = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pv, image_sizes=SIZES, **options)
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == [3 * 4 + 4, 5 * 4 + 8]
    for row, p in enumerate(prompts):
        alone = model.generate(
            input_ids=p[None], pixel_values=pv[row : row + 1], image_sizes=SIZES[row : row + 1], **options
        )
        assert together[2 * row : 2 * row + 2, length:].tolist() == alone[:, len(p) :].tolist()


def test_fastv_in_the_llm_equals_the_model_with_the_dropped_keys_masked_from_layer_k(
    model: torch.nn.Module,
) -> None:
    # the in-LLM drop counts an image's packed tokens (tiles and newlines) and keeps `keep` of them from layer K on
    calls: list[dict] = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True
    )
    vitrim.vlm.apply(model, "fastv", layer=1, keep=10)
    pruned = model(**inputs()).logits
    handle.remove()
    kept = vitrim.vlm.last_selection(model)
    generated = model.generate(**inputs(), max_new_tokens=2, do_sample=False)
    vitrim.vlm.remove(model)
    assert [len(k) for k in kept] == [10, 10]
    keep = dropped_mask(inputs()["input_ids"], kept).bool()
    ones = torch.ones_like(keep, dtype=torch.long)
    hidden = masked_layers(model.model.language_model, calls[0]["inputs_embeds"], ones, None, {1: keep})
    assert (model.lm_head(hidden)[keep] - pruned[keep]).abs().max() <= TOL
    assert generated.shape == (1, inputs()["input_ids"].shape[1] + 2)

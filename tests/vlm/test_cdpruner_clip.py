"""CDPruner as its authors ran it on LLaVA-1.5 (issue 53): the question alone through CLIP's text tower, the feature
layer through CLIP's post-LayerNorm and visual projection, their minus sign; equal to an independent
re-implementation of the authors' ``CLIPVisionTower.forward`` + ``encode_images`` (Theia-4869/CDPruner) on a tiny
CLIP whose vision tower is the tiny LLaVA's, saved as a folder and loaded offline. Also: the instruction stays the
prompt's at every step of ``generate(use_cache=False)``, and ``theta`` near 1 does not overflow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pre_llm_reference import cdpruner_reference

import vitrim.vlm
from tiny_vlms.clip_text import save_tiny_clip, tiny_clip
from tiny_vlms.llava import CLIP_TOWER, pixels, prompt, tiny_llava
from vitrim.vlm.method.cdpruner import conditional_dpp_keep, theta_weight

transformers = pytest.importorskip("transformers")

VISION_LAYERS = 4
PROJECTION = 24
SEGMENT = 8  # the tiny text tower's max_position_embeddings: a question of more tokens is cut in segments
QUESTION = "what colour is the cat on the mat? answer in one word."


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    return tiny_llava(vision_layers=VISION_LAYERS, seed=3)


@pytest.fixture(scope="module")
def clip_folder(llava: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny CLIPModel whose vision tower carries the tiny LLaVA's tower weights, with its tokenizer, saved."""
    clip, tokenizer = tiny_clip(CLIP_TOWER | dict(num_hidden_layers=VISION_LAYERS), PROJECTION, SEGMENT, seed=11)
    clip = clip.double()
    clip.vision_model.load_state_dict(llava.model.vision_tower.state_dict())
    return save_tiny_clip(tmp_path_factory.mktemp("clip"), clip, tokenizer)


def authors_relevance(llava: torch.nn.Module, folder: Path, pv: torch.Tensor, question: str) -> torch.Tensor:
    """(B, N): the authors' CDPruner relevance, from their clip_encoder.py and llava_arch.py (read, not copied):
    ``CLIPTextModelWithProjection`` and ``CLIPVisionModelWithProjection``'s projection loaded from the tower's name,
    ``CLIPTokenizerFast``; the question tokenized whole, zero-padded to a multiple of ``max_position_embeddings``,
    reshaped into rows; image embeds = visual_projection(tower.post_layernorm(patch states).float()); relevance =
    mean over the text rows of −cos, min-max over the whole batch (+1e-6 in the numerator)."""
    text_tower = transformers.CLIPTextModelWithProjection.from_pretrained(folder).eval()
    projection = transformers.CLIPVisionModelWithProjection.from_pretrained(folder).visual_projection.float()
    tokenizer = transformers.CLIPTokenizerFast.from_pretrained(folder)
    inputs = tokenizer(text=question, return_tensors="pt")
    limit = text_tower.config.max_position_embeddings
    count = (inputs.input_ids.shape[1] - 1) // limit + 1
    pad = limit * count - inputs.input_ids.shape[1]
    rows = {k: torch.cat([v, v.new_zeros((v.shape[0], pad))], dim=1).reshape(-1, limit) for k, v in inputs.items()}
    tower = llava.model.vision_tower
    with torch.no_grad():
        text_embeds = text_tower(**rows).text_embeds.float()  # the matmul with the float32 image embeds
        hidden = tower(pv, output_hidden_states=True).hidden_states[llava.config.vision_feature_layer][:, 1:]
        image_embeds = projection(tower.post_layernorm(hidden).float())
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    relevance = (-torch.matmul(image_embeds, text_embeds.t())).mean(dim=-1)
    return (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())


def projected_tokens(llava: torch.nn.Module, pv: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = llava.model.vision_tower(pv, output_hidden_states=True).hidden_states[-2][:, 1:]
        return llava.model.multi_modal_projector(hidden)


@pytest.mark.parametrize("keep", [pytest.param(4, marks=pytest.mark.full), 8, pytest.param(12, marks=pytest.mark.full)])
@pytest.mark.parametrize("question", [QUESTION, pytest.param("cat?", marks=pytest.mark.full)])
def test_cdpruner_clip_relevance_selects_what_the_authors_select(llava, clip_folder, keep: int, question: str) -> None:
    pv = pixels(1, seed=keep)
    ids = prompt(3, 4, seed=keep)[None]
    vitrim.vlm.apply(llava, "cdpruner", keep=keep, clip=str(clip_folder))
    try:
        with torch.no_grad():
            llava(input_ids=ids, pixel_values=pv, texts=question)
        kept = vitrim.vlm.last_selection(llava)[0].tolist()
    finally:
        vitrim.vlm.remove(llava)
    relevance = authors_relevance(llava, clip_folder, pv, question)
    assert kept == cdpruner_reference(projected_tokens(llava, pv), relevance.double(), keep)[0]


def test_cdpruner_clip_relevance_equals_the_authors_within_float32(llava, clip_folder) -> None:
    """The relevance itself (the method's ClipRelevance on the same inputs), and the question really cut in
    segments (more tokens than the text tower's positions)."""
    from vitrim.vlm.method.cdpruner import ClipRelevance, instruction_relevance

    pv = pixels(1, seed=5)
    towers = ClipRelevance.load(str(clip_folder), None)
    length = len(towers.tokenizer(text=QUESTION)["input_ids"])  # [BOS] + one token per character + [EOS]
    assert length > 2 * SEGMENT
    with torch.no_grad():
        hidden = llava.model.vision_tower(pv, output_hidden_states=True).hidden_states[-2][0, 1:]
        ours = instruction_relevance(towers.image_embeds(hidden), towers.text_embeds(QUESTION))
    theirs = authors_relevance(llava, clip_folder, pv, QUESTION)[0]
    assert towers.text_embeds(QUESTION).shape[0] == (length - 1) // SEGMENT + 1  # the segments, the last padded
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_cdpruner_clip_relevance_under_generate_with_and_without_the_cache(llava, clip_folder) -> None:
    """texts= reaches the method through generate() (as the authors' generate takes it); the tokens of the cached
    and the uncached run are the same, and the selection is the authors' for the question."""
    pv, ids = pixels(1, seed=2), prompt(2, 3, seed=2)[None]
    vitrim.vlm.apply(llava, "cdpruner", keep=6, clip=str(clip_folder))
    try:
        with torch.no_grad():
            cached = llava.generate(input_ids=ids, pixel_values=pv, texts=QUESTION, max_new_tokens=3, do_sample=False)
            kept = vitrim.vlm.last_selection(llava)[0].tolist()
            uncached = llava.generate(
                input_ids=ids, pixel_values=pv, texts=QUESTION, max_new_tokens=3, do_sample=False, use_cache=False
            )
    finally:
        vitrim.vlm.remove(llava)
    assert torch.equal(cached, uncached)
    assert (
        kept
        == cdpruner_reference(
            projected_tokens(llava, pv), authors_relevance(llava, clip_folder, pv, QUESTION).double(), 6
        )[0]
    )


def test_cdpruner_llm_relevance_reads_the_prompt_at_every_uncached_step(llava) -> None:
    """relevance='llm' reads the prompt's text after the image; generate(use_cache=False) re-runs the prefill with
    the generated tokens in the text, which must not join the instruction: each step's selection is the first's."""
    ids = prompt(2, 2, seed=4)[None]
    vitrim.vlm.apply(llava, "cdpruner", keep=4, relevance="llm")
    picks = []
    hook = llava.model.language_model.register_forward_pre_hook(
        lambda *_: picks.append(vitrim.vlm.last_selection(llava)[0].tolist())
    )
    try:
        for seed in range(3):
            picks.clear()
            with torch.no_grad():
                cached = llava.generate(input_ids=ids, pixel_values=pixels(1, seed=seed), max_new_tokens=4)
                first = vitrim.vlm.last_selection(llava)[0].tolist()
                uncached = llava.generate(
                    input_ids=ids, pixel_values=pixels(1, seed=seed), max_new_tokens=4, use_cache=False
                )
            assert torch.equal(cached, uncached), seed
            assert all(pick == first for pick in picks if pick), (seed, picks)
    finally:
        hook.remove()
        vitrim.vlm.remove(llava)


def test_cdpruner_clip_needs_the_question_and_a_matching_clip(llava, clip_folder) -> None:
    ids, pv = prompt(2, 2, seed=1)[None], pixels(1, seed=1)
    vitrim.vlm.apply(llava, "cdpruner", keep=4, relevance="clip", clip=str(clip_folder))
    try:
        with pytest.raises(ValueError, match=r"relevance='clip' reads the question .* pass texts="):
            llava(input_ids=ids, pixel_values=pv)
        with pytest.raises(ValueError, match=r"texts=3: expected the question as a string"):
            llava(input_ids=ids, pixel_values=pv, texts=3)
    finally:
        vitrim.vlm.remove(llava)
    with pytest.raises(ValueError, match=r"relevance='bert' must be None, 'clip' or 'llm'"):
        vitrim.vlm.apply(llava, "cdpruner", keep=4, relevance="bert")
    vitrim.vlm.apply(llava, "cdpruner", keep=4, clip=str(clip_folder / "missing"))
    try:
        with pytest.raises(ValueError, match=r"cdpruner clip='.*missing' could not be loaded as a CLIPModel"):
            llava(input_ids=ids, pixel_values=pv, texts="cat?")
    finally:
        vitrim.vlm.remove(llava)


def test_cdpruner_theta_near_one_selects_what_the_authors_formula_selects_in_float64() -> None:
    """exp(θ / (2(1 − θ)) r) overflows float32 from θ ≈ 0.99 (α r > 88): vitrim's shifted form selects what the
    authors' form selects where float64 still holds it."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, 30, 12, generator=generator, dtype=torch.float64)
    relevance = torch.rand(1, 30, generator=generator, dtype=torch.float64)
    relevance = (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())
    for theta in (0.5, 0.99, 0.995):
        expected = cdpruner_reference(tokens, relevance, 8, theta)[0]
        weight = theta_weight(relevance[0].float(), theta)
        assert torch.isfinite(weight).all(), theta
        assert sorted(conditional_dpp_keep(tokens[0].float(), weight, 8).tolist()) == expected, theta

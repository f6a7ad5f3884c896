"""By default (``positions="authors"``) a pre-LLM method hands the LLM the sequence its authors' LLaVA code builds, on
a tiny float64 LLaVA-1.5: the same kept tokens, the same rows entering the LLM, and the same logits as the
UNMODIFIED model fed that sequence (``inputs_embeds``, positions 0 … n−1), in a plain forward and under
``generate()`` (greedy, beams, ``use_cache=False``).

The authors' sequence is built here from their code (LLaVA's ``prepare_inputs_labels_for_multimodal``, which every
one of these repositories keeps): each image's placeholder run replaced by the rows their encoder hands on - for
FasterVLM / VisPruner / DivPrune the projected patches their index mask keeps, in raster order; for VisionZip the
projected [CLS] of layer −2, its dominant patches in raster order, then its contextual tokens (target + mean of the
members) - the sequence padded per sample, numbered from 0 over its real tokens (``generate()`` counts the mask).
Selections come from tests/vlm/pre_llm_reference.py (the authors' tensor code, ties to the lower index, vitrim's
documented rule). On the plain tiny model the scores do not tie; the tie settings run on a copy whose scoring layer
(−2) has its queries zeroed, so [CLS]'s attention is exactly uniform in transformers' maps and in vitrim's row: there
FasterVLM and VisionZip keep the lowest-index patches and VisPruner's residuals start in raster order. The authors'
own code leaves the order of ties to the backend: on CPU (this torch) their ``torch.topk`` of 16 equal scores keeps
patches 9 … 12 and 14 for 5 (not 0 … 4), so at ties vitrim departs from their literal CPU output by design; their
``argsort(descending=True)`` (VisPruner) gives 0 … 15 at 16 tokens, which is vitrim's order. DivPrune's tie runs on
a copy without position embeddings and an image with one patch copied onto another: their features are bitwise equal
(where this BLAS rounds the two rows alike; the test skips, saying so, where it does not), so the greedy's distances
tie between them (the paper sets no rule; vitrim's and the reference's: the lower index).
"""

from __future__ import annotations

import copy

import pytest
import torch
from pre_llm_reference import divprune_reference, fastervlm_reference, visionzip_reference, vispruner_reference

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, IMAGE_TOKEN, PAD, batch, pixels, prompt, tiny_llava
from vitrim.vlm.method.base import method_class

TOL = 1e-12


@pytest.fixture(scope="module")
def eager() -> torch.nn.Module:
    return tiny_llava(attn="eager")  # transformers returns the tower's attention maps (the authors' input)


@pytest.fixture(scope="module")
def sdpa() -> torch.nn.Module:
    """The same weights with SDPA: eager attention turns a padded batch's fully masked rows into NaN."""
    return tiny_llava(attn="sdpa")


def tower_tensors(model: torch.nn.Module, pv: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the authors' encoders read, from the unmodified tower: layer −2's attention maps (B, H, 1+N, 1+N), its
    output (B, 1+N, D) [CLS] first, its keys (B, H, 1+N, hd)."""
    tower = model.model.vision_tower
    captured = {}
    hook = tower.encoder.layers[-2].self_attn.k_proj.register_forward_hook(
        lambda m, a, out: captured.__setitem__("keys", out)
    )
    with torch.no_grad():
        out = tower(pv, output_attentions=True, output_hidden_states=True)
    hook.remove()
    heads = tower.config.num_attention_heads
    keys = captured["keys"].view(len(pv), GRID_TOKENS + 1, heads, -1).transpose(1, 2)
    return {"attentions": out.attentions[-2], "hidden": out.hidden_states[-2], "keys": keys}


def authors_image_rows(model: torch.nn.Module, pv: torch.Tensor, method: str, **options) -> tuple[list, list]:
    """Per image: the patches the authors keep (sorted) and the rows (k, E) their encoder hands the LLM, in order."""
    t = tower_tensors(model, pv)
    project = model.model.multi_modal_projector
    with torch.no_grad():
        if method == "visionzip":
            keep, contextual = options["keep"], options["contextual"]
            slots, tokens = visionzip_reference(
                t["attentions"], t["hidden"], t["keys"], keep - contextual - 1, contextual
            )
            rows = project(torch.cat([t["hidden"][:, :1], tokens], 1))  # [CLS], dominant, contextual
            return [sorted(s) for s in slots], list(rows)
        if method == "fastervlm":
            kept = fastervlm_reference(t["attentions"], options["keep"])
        elif method == "vispruner":
            kept = vispruner_reference(t["attentions"], t["hidden"], options["keep"], options["important_ratio"])
        else:
            kept = divprune_reference(project(t["hidden"][:, 1:]), options["keep"])
        projected = project(t["hidden"][:, 1:])  # (B, N, E)
    return kept, [projected[image, k] for image, k in enumerate(kept)]


def authors_sequence(model, ids: torch.Tensor, mask: torch.Tensor, rows: list[torch.Tensor]):
    """LLaVA's ``prepare_inputs_labels_for_multimodal``: each sample's text embeddings with every image's run of
    placeholders replaced by its rows (reading order), padded on the input's side; positions 0 … n−1 over each
    sample's real tokens. Returns (inputs_embeds (B, n, E), attention_mask (B, n), position_ids (B, n))."""
    embed = model.get_input_embeddings()
    left = bool((mask[:, 0] == 0).any())
    samples, image = [], 0
    for row in range(len(ids)):
        real = ids[row][mask[row].bool()]
        parts, column = [], 0
        while column < len(real):
            if int(real[column]) == IMAGE_TOKEN:
                parts.append(rows[image])
                image += 1
                column += GRID_TOKENS
            else:
                parts.append(embed(real[column : column + 1]))
                column += 1
        samples.append(torch.cat(parts))
    length = max(len(s) for s in samples)
    embeds = torch.zeros(len(samples), length, samples[0].shape[1], dtype=samples[0].dtype)
    new_mask = torch.zeros(len(samples), length, dtype=torch.long)
    positions = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        cols = slice(length - len(sample), length) if left else slice(0, len(sample))
        embeds[row, cols], new_mask[row, cols] = sample, 1
        positions[row, cols] = torch.arange(len(sample))
    return embeds, new_mask, positions


def llm_input(model: torch.nn.Module) -> tuple[dict, torch.utils.hooks.RemovableHandle]:
    captured: dict = {}

    def hook(module, args, kwargs):
        captured.setdefault("embeds", kwargs["inputs_embeds"])
        captured.setdefault("positions", kwargs["position_ids"])

    return captured, model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)


SETTINGS = [
    ("visionzip", {"keep": 6, "contextual": 2}),
    pytest.param("visionzip", {"keep": 9, "contextual": 3}, marks=pytest.mark.full),
    ("fastervlm", {"keep": 5}),
    pytest.param("vispruner", {"keep": 6, "important_ratio": 0.5}, marks=pytest.mark.full),
    pytest.param("divprune", {"keep": 4}, marks=pytest.mark.full),
]


def check_authors_sequence(model: torch.nn.Module, method: str, options: dict, pv: torch.Tensor | None = None) -> list:
    """One sample with three images (``pv`` (3, 3, 16, 16), random by default): vitrim's kept tokens, the rows and
    positions entering the LLM and the logits are the authors' (the unmodified ``model`` fed their sequence).
    Returns the authors' kept patches per image."""
    pv = pixels(3, seed=11) if pv is None else pv
    ids = torch.cat([prompt(1, 1, images=1, seed=i) for i in range(3)])[None]  # one sample, three images
    mask = torch.ones_like(ids)
    kept, rows = authors_image_rows(model, pv, method, **options)
    embeds, _, positions = authors_sequence(model, ids, mask, rows)
    with torch.no_grad():
        expected = model(inputs_embeds=embeds, position_ids=positions).logits  # the unmodified model
        vitrim.vlm.apply(model, method, **options)
        captured, hook = llm_input(model)
        try:
            logits = model(input_ids=ids, pixel_values=pv).logits
            selection = vitrim.vlm.last_selection(model)
            groups = vitrim.vlm.last_selection(model, groups=True)
        finally:
            hook.remove()
            vitrim.vlm.remove(model)
    assert [k.tolist() for k in selection] == kept
    assert (captured["embeds"] - embeds).abs().max() <= TOL
    assert torch.equal(captured["positions"], positions)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max() <= TOL
    cls = method == "visionzip"
    for image in range(3):
        assert len(groups[image]) == options["keep"]  # every token entering the LLM, [CLS] included
        assert (groups[image][0].numel() == 0) == cls  # an empty group first: the tower's [CLS]
    return kept


@pytest.mark.parametrize(("method", "options"), SETTINGS)
def test_the_llm_gets_the_authors_rows_positions_and_logits(eager, method: str, options: dict):
    check_authors_sequence(eager, method, options)


@pytest.fixture(scope="module")
def tied(eager) -> torch.nn.Module:
    """A copy of the tiny LLaVA with the scoring layer's (−2) queries zeroed: every attention logit there is exactly
    0, so [CLS]'s row is exactly 1/17 for every patch in transformers' maps and in vitrim's row alike (all tie)."""
    model = copy.deepcopy(eager)
    attention = model.model.vision_tower.encoder.layers[-2].self_attn
    with torch.no_grad():
        attention.q_proj.weight.zero_()
        attention.q_proj.bias.zero_()
    return model


TIE_SETTINGS = [
    ("fastervlm", {"keep": 5}),
    pytest.param("visionzip", {"keep": 6, "contextual": 2}, marks=pytest.mark.full),
    pytest.param("vispruner", {"keep": 9, "important_ratio": 0.5}, marks=pytest.mark.full),
]


@pytest.mark.parametrize(("method", "options"), TIE_SETTINGS)
def test_at_exact_ties_the_llm_gets_the_authors_rows_positions_and_logits(tied, method: str, options: dict):
    """Every [CLS] score equal: the kept tokens are the lowest-index ones (VisPruner's residuals then in raster
    order), end to end. Were vitrim to break ties another way, the kept tokens would differ from the reference's."""
    row = tower_tensors(tied, pixels(3, seed=11))["attentions"][:, :, 0, 1:]
    assert torch.equal(row, torch.full_like(row, float(row[0, 0, 0])))  # the setting is a tie, bitwise
    check_authors_sequence(tied, method, options)


@pytest.fixture(scope="module")
def unplaced(eager) -> torch.nn.Module:
    """A copy of the tiny LLaVA with the tower's position embeddings zeroed: a patch's features depend on its pixels
    and the image, not on where it is, so two patches with the same pixels are twins."""
    model = copy.deepcopy(eager)
    with torch.no_grad():
        model.model.vision_tower.embeddings.position_embedding.weight.zero_()
    return model


@pytest.mark.full
def test_divprune_at_twin_patches_keeps_the_lower_index_as_the_authors_sequence(unplaced):
    """Patch 9 (row 2, column 1) a copy of patch 1 (row 0, column 1): their projected features are bitwise equal, so
    each distance ties between them and the greedy, reaching them, takes patch 1 (the lower index) end to end."""
    pv = pixels(3, seed=11)
    pv[..., 8:12, 4:8] = pv[..., 0:4, 4:8]
    with torch.no_grad():
        projected = unplaced.model.multi_modal_projector(tower_tensors(unplaced, pv)["hidden"][:, 1:])
    if not torch.equal(projected[:, 1], projected[:, 9]):  # the matmul kernels round rows by their place in a tile
        pytest.skip("this BLAS rounds the twin patches' features differently: no exact tie to test")
    kept = check_authors_sequence(unplaced, "divprune", {"keep": 4}, pv)
    assert sum(1 in k and 9 not in k for k in kept) == 2  # two of the three images reach the tie


def test_original_positions_keep_each_token_in_its_slot_without_cls(eager):
    pv, ids = pixels(1, seed=4), prompt(2, 3, images=1, seed=4)[None]
    vitrim.vlm.apply(eager, "visionzip", keep=6, contextual=2, positions="original")
    captured, hook = llm_input(eager)
    try:
        with torch.no_grad():
            eager(input_ids=ids, pixel_values=pv)
        kept = vitrim.vlm.last_selection(eager)[0]
        groups = vitrim.vlm.last_selection(eager, groups=True)[0]
    finally:
        hook.remove()
        vitrim.vlm.remove(eager)
    assert len(kept) == 6 and all(g.numel() for g in groups)  # one more patch where the authors keep [CLS]
    image_positions = (kept + 2).tolist()  # the image starts at column 2; each kept token at its own position
    assert captured["positions"][0].tolist() == [0, 1, *image_positions, *range(18, 18 + 5)]


def test_bad_positions_and_cls_options_are_refused():
    with pytest.raises(ValueError, match=r"positions='sorted'.*'authors', 'original'"):
        method_class("fastervlm")(positions="sorted")
    with pytest.raises(ValueError, match=r"cls=True.*positions='original'"):
        method_class("visionzip")(cls=True, positions="original")
    with pytest.raises(ValueError, match="unknown option 'positions'"):
        method_class("fastv")(positions="original")  # in the LLM: no such option


def two_prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded batch of two prompts with one and two images (their pixels, reading order)."""
    ids, mask = batch([prompt(3, 2, images=1, seed=1), prompt(1, 4, images=2, seed=2)], "left")
    return ids, mask, torch.cat([pixels(1, seed=1), pixels(2, seed=2)])


@pytest.mark.parametrize(
    "how",
    [
        {"num_beams": 1},
        pytest.param({"num_beams": 2}, marks=pytest.mark.full),
        pytest.param({"num_beams": 1, "use_cache": False}, marks=pytest.mark.full),
    ],
)
def test_generate_continues_from_the_authors_shorter_sequence(eager, sdpa, how: dict):
    ids, mask, pv = two_prompts()
    options = {"keep": 6, "contextual": 2}
    _, rows = authors_image_rows(eager, pv, "visionzip", **options)  # the eager tower's maps; the same weights
    embeds, short_mask, _ = authors_sequence(sdpa, ids, mask, rows)
    kwargs = {"max_new_tokens": 4, "do_sample": False, **how}
    with torch.no_grad():
        expected = sdpa.generate(inputs_embeds=embeds, attention_mask=short_mask, **kwargs)  # new tokens only
        vitrim.vlm.apply(sdpa, "visionzip", **options)
        try:
            out = sdpa.generate(input_ids=ids, attention_mask=mask, pixel_values=pv, **kwargs)
        finally:
            vitrim.vlm.remove(sdpa)
    assert out[:, ids.shape[1] :].tolist() == expected.tolist()
    assert PAD in ids[0].tolist()  # the first prompt is padded: each sample is numbered from its own first token


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_where_the_authors_left_no_code_the_default_is_the_original_layout(family: str):
    """Qwen's M-RoPE and Gemma 3's own masks: positions="authors" is positions="original" there (docs/vlm.md), and
    VisionZip, with no [CLS] in the tower, keeps one more dominant patch."""
    if family == "qwen2_5_vl":
        from tiny_vlms import qwen as qwen_tiny

        model, inputs = qwen_tiny.qwen2_5_vl(), qwen_tiny.one()
        options = {"keep": 3, "contextual": 1}
    else:
        from tiny_vlms import gemma3 as tiny_gemma3

        ids = tiny_gemma3.prompt(2, 3, images=1)[None]
        model = tiny_gemma3.tiny_gemma3()
        inputs = {
            "input_ids": ids,
            "pixel_values": tiny_gemma3.pixels(1),
            "token_type_ids": tiny_gemma3.token_types(ids),
        }
        options = {"keep": 5, "contextual": 2}
    runs = []
    for positions in ("authors", "original"):
        vitrim.vlm.apply(model, "visionzip", positions=positions, **options)
        try:
            with torch.no_grad():
                runs.append(model(**inputs).logits)
            groups = vitrim.vlm.last_selection(model, groups=True)[0]
        finally:
            vitrim.vlm.remove(model)
        assert len(groups) == options["keep"] and all(g.numel() for g in groups)  # no [CLS]: patches only
    assert torch.equal(runs[0], runs[1])

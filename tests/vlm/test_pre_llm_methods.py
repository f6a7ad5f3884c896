"""Each pre-LLM method keeps what its authors' selection keeps: end to end on a tiny LLaVA (the authors' tensors
taken from transformers' own outputs of the unmodified model: ``output_attentions`` of the tower's layer −2, its
hidden states and keys), and on hand-made tensors full of ties, against tests/vlm/pre_llm_reference.py."""

from __future__ import annotations

import pytest
import torch
from pre_llm_reference import (
    divprune_reference,
    fastervlm_reference,
    visionzip_reference,
    vispruner_reference,
)

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, pixels, prompt, tiny_llava
from vitrim.vlm.families.llava import read_cls_attention
from vitrim.vlm.method.base import VisionEvidence
from vitrim.vlm.method.divprune import DivPrune
from vitrim.vlm.method.fastervlm import FasterVLM
from vitrim.vlm.method.visionzip import VisionZip
from vitrim.vlm.method.vispruner import VisPruner


@pytest.fixture(scope="module")
def eager() -> torch.nn.Module:
    return tiny_llava(attn="eager")  # so transformers returns the tower's attention maps (the authors' input)


@pytest.fixture(scope="module")
def authors_tensors(eager: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the authors' code reads, from the unmodified model on 3 images."""
    torch.set_grad_enabled(False)  # module-scoped: restored below
    pv = pixels(3, seed=11)
    tower = eager.model.vision_tower
    captured = {}
    hook = tower.encoder.layers[-2].self_attn.k_proj.register_forward_hook(
        lambda m, a, out: captured.__setitem__("keys", out)
    )
    out = tower(pv, output_attentions=True, output_hidden_states=True)
    hook.remove()
    heads = tower.config.num_attention_heads
    keys = captured["keys"].view(3, GRID_TOKENS + 1, heads, -1).transpose(1, 2)  # (B, H, 1 + N, hd)
    hidden = out.hidden_states[-2]
    tensors = {
        "pixels": pv,
        "attentions": out.attentions[-2],
        "hidden": hidden,
        "keys": keys,
        "projected": eager.model.multi_modal_projector(hidden[:, 1:]),
    }
    torch.set_grad_enabled(True)
    return tensors


def selected(model: torch.nn.Module, pv: torch.Tensor, method: str, **options: object) -> list[list[int]]:
    ids = torch.cat([prompt(1, 1, images=1, seed=i) for i in range(len(pv))])[None]
    vitrim.vlm.apply(model, method, **options)
    try:
        model(input_ids=ids, pixel_values=pv)
        return [k.tolist() for k in vitrim.vlm.last_selection(model)]
    finally:
        vitrim.vlm.remove(model)


def test_the_cls_row_and_keys_equal_transformers_attention_maps(
    eager: torch.nn.Module, authors_tensors: dict[str, torch.Tensor]
) -> None:
    layer = eager.model.vision_tower.encoder.layers[-2]
    captured = {}
    hook = layer.self_attn.register_forward_pre_hook(
        lambda m, a, k: captured.__setitem__("x", k["hidden_states"]), with_kwargs=True
    )
    eager.model.vision_tower(authors_tensors["pixels"])
    hook.remove()
    row, keys = read_cls_attention(layer.self_attn, (captured["x"],), {})
    # transformers' eager attention takes its softmax in float32
    assert (row - authors_tensors["attentions"][:, :, 0, 1:]).abs().max() <= 1e-6
    assert torch.equal(keys, authors_tensors["keys"][:, :, 1:])


@pytest.mark.parametrize("keep", [pytest.param(1, marks=pytest.mark.full), 5, pytest.param(12, marks=pytest.mark.full)])
def test_fastervlm_equals_the_authors_top_k(eager, authors_tensors, keep: int) -> None:
    expected = fastervlm_reference(authors_tensors["attentions"], keep)
    assert selected(eager, authors_tensors["pixels"], "fastervlm", keep=keep) == expected


@pytest.mark.parametrize(
    ("keep", "ratio"),
    [
        (4, 0.5),
        pytest.param(9, 0.5, marks=pytest.mark.full),
        pytest.param(6, 0.0, marks=pytest.mark.full),
        pytest.param(5, 1.0, marks=pytest.mark.full),
    ],
)
def test_vispruner_equals_the_authors_selection(eager, authors_tensors, keep: int, ratio: float) -> None:
    expected = vispruner_reference(authors_tensors["attentions"], authors_tensors["hidden"], keep, ratio)
    assert selected(eager, authors_tensors["pixels"], "vispruner", keep=keep, important_ratio=ratio) == expected


@pytest.mark.parametrize(("keep", "contextual"), [(6, 2), pytest.param(9, 3, marks=pytest.mark.full), (4, 4)])
def test_visionzip_equals_the_authors_selection_and_merge(eager, authors_tensors, keep: int, contextual: int) -> None:
    pv = authors_tensors["pixels"]
    slots, tokens = visionzip_reference(
        authors_tensors["attentions"], authors_tensors["hidden"], authors_tensors["keys"], keep - contextual, contextual
    )
    ids = torch.cat([prompt(1, 1, images=1, seed=i) for i in range(len(pv))])[None]
    captured = {}
    vitrim.vlm.apply(eager, "visionzip", keep=keep, contextual=contextual, cls=False)
    hook = eager.model.multi_modal_projector.register_forward_hook(lambda m, a, out: captured.__setitem__("out", out))
    try:
        eager(input_ids=ids, pixel_values=pv)
        kept = [k.tolist() for k in vitrim.vlm.last_selection(eager)]
        groups = vitrim.vlm.last_selection(eager, groups=True)
    finally:
        hook.remove()
        vitrim.vlm.remove(eager)
    assert kept == [sorted(image) for image in slots]
    expected = eager.model.multi_modal_projector(tokens)  # (B, keep, E): what the authors hand the LLM
    for image in range(len(pv)):
        assert sorted(torch.cat(groups[image]).tolist()) == list(range(GRID_TOKENS))  # each token in one group
        for slot, index in enumerate(slots[image]):
            assert (captured["out"][image, index] - expected[image, slot]).abs().max() <= 1e-12, (image, index)


@pytest.mark.parametrize("keep", [pytest.param(1, marks=pytest.mark.full), 4, 10])
def test_divprune_equals_the_papers_greedy(eager, authors_tensors, keep: int) -> None:
    expected = divprune_reference(authors_tensors["projected"], keep)
    assert selected(eager, authors_tensors["pixels"], "divprune", keep=keep) == expected


# --- ties: hand-made tensors where many scores and similarities are exactly equal ---------------------------------


def tied_evidence(seed: int, images: int = 2, tokens: int = 20, heads: int = 2) -> VisionEvidence:
    """Scores from 3 values (many exact ties); features and keys that are multiples of 4 basis vectors, so every
    cosine similarity is exactly 0 or 1 (ties everywhere, and no rounding for the order to depend on)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.01, 0.02, 0.04], dtype=torch.float64)
    cls_attention = levels[torch.randint(0, 3, (images, heads, tokens), generator=g)]
    basis = torch.eye(6, dtype=torch.float64)[:4]
    which = torch.randint(0, 4, (images, tokens), generator=g)
    scale = torch.randint(1, 4, (images, tokens, 1), generator=g).double()
    features = basis[which] * scale  # (I, N, 6)
    keys = torch.eye(3, dtype=torch.float64)[torch.randint(0, 3, (images, heads, tokens), generator=g)]
    return VisionEvidence(features=features, cls_attention=cls_attention, keys=keys, projected=features)


def authors_form(evidence: VisionEvidence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The evidence as the authors' tensors: attentions (I, H, 1+N, 1+N) holding the [CLS] row, hidden and keys
    with a [CLS] row in front (its values are never read by the selections)."""
    images, heads, tokens = evidence.cls_attention.shape
    attentions = torch.zeros(images, heads, tokens + 1, tokens + 1, dtype=torch.float64)
    attentions[:, :, 0, 1:] = evidence.cls_attention
    hidden = torch.cat([torch.ones_like(evidence.features[:, :1]), evidence.features], 1)
    keys = torch.cat([torch.ones_like(evidence.keys[:, :, :1]), evidence.keys], 2)
    return attentions, hidden, keys


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.full), pytest.param(2, marks=pytest.mark.full)])
def test_every_selection_breaks_ties_as_the_references_do(seed: int) -> None:
    evidence = tied_evidence(seed)
    attentions, hidden, keys = authors_form(evidence)
    kept = lambda selections: [s.kept.tolist() for s in selections]  # noqa: E731
    for keep in (3, 7, 12):
        assert kept(FasterVLM().select(evidence, keep)) == fastervlm_reference(attentions, keep)
        for ratio in (0.5, 0.25):
            expected = vispruner_reference(attentions, hidden, keep, ratio)
            assert kept(VisPruner(important_ratio=ratio).select(evidence, keep)) == expected
        assert kept(DivPrune().select(evidence, keep)) == divprune_reference(evidence.projected, keep)
        slots, tokens = visionzip_reference(attentions, hidden, keys, keep - 2, 2)
        selections = VisionZip(contextual=2).select(evidence, keep)
        assert kept(selections) == [sorted(image) for image in slots]
        for image, selection in enumerate(selections):
            for slot, index in enumerate(slots[image]):
                position = selection.kept.tolist().index(index)
                assert torch.equal(selection.merged[position], tokens[image, slot])


def test_on_an_sdpa_tower_the_selections_are_the_same(authors_tensors: dict[str, torch.Tensor]) -> None:
    """The [CLS] row is computed from q/k, so the tower keeps SDPA (which returns no attention maps)."""
    sdpa = tiny_llava(attn="sdpa")  # the same weights as the eager fixture (same seed)
    pv, attentions, hidden = authors_tensors["pixels"], authors_tensors["attentions"], authors_tensors["hidden"]
    assert selected(sdpa, pv, "fastervlm", keep=5) == fastervlm_reference(attentions, 5)
    assert selected(sdpa, pv, "vispruner", keep=6) == vispruner_reference(attentions, hidden, 6, 0.5)
    slots, _ = visionzip_reference(attentions, hidden, authors_tensors["keys"], 3, 2)  # [CLS] + 3 + 2
    assert selected(sdpa, pv, "visionzip", keep=6, contextual=2) == [sorted(s) for s in slots]

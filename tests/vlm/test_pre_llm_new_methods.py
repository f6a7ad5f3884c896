"""The pre-LLM methods of 2025-26 (downsample, cdpruner, scope, hiprune): each pure selection against an independent
re-implementation in tests/vlm/pre_llm_reference.py (the authors' code for CDPruner and HiPrune, the paper for SCOPE,
vitrim's documented pooling for downsample) on the tiny LLaVA's own tensors and on hand-made ties; ``apply`` on the
tiny LLaVA and the tiny Qwen2.5-VL keeps ``keep`` tokens, and an image selects the same alone or in a batch."""

from __future__ import annotations

import pytest
import torch
from pre_llm_reference import (
    cdpruner_reference,
    cdpruner_relevance_reference,
    downsample_reference,
    hiprune_reference,
    scope_reference,
)

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, IMAGE_TOKEN, pixels, prompt, tiny_llava
from vitrim.vlm.method.base import VisionEvidence
from vitrim.vlm.method.cdpruner import CDPruner, conditional_dpp_keep, instruction_relevance
from vitrim.vlm.method.downsample import Downsample, downsample_select
from vitrim.vlm.method.hiprune import hiprune_keep
from vitrim.vlm.method.scope import Scope, scope_keep

FULL = pytest.mark.full
SIDE = 4  # the tiny LLaVA's 4 × 4 grid


@pytest.fixture(scope="module")
def eager() -> torch.nn.Module:
    return tiny_llava(attn="eager", vision_layers=4)  # eager: transformers returns the tower's attention maps


@pytest.fixture(scope="module")
def tensors(eager: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the authors' code reads, from the unmodified model on 3 images."""
    pv = pixels(3, seed=12)
    with torch.no_grad():
        out = eager.model.vision_tower(pv, output_attentions=True, output_hidden_states=True)
        hidden = out.hidden_states[-2]
        projected = eager.model.multi_modal_projector(hidden[:, 1:])
    return {"pixels": pv, "attentions": out.attentions, "hidden": hidden, "projected": projected}


def run(model: torch.nn.Module, pv: torch.Tensor, method: str, **options: object) -> tuple[list, torch.Tensor]:
    """The groups per image and the projector's output (B, N, E) of one forward with ``method`` applied."""
    ids = torch.cat([prompt(1, 1, images=1, seed=i) for i in range(len(pv))])[None]
    captured = {}
    vitrim.vlm.apply(model, method, **options)
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, out: captured.__setitem__("out", out))
    try:
        with torch.no_grad():
            model(input_ids=ids, pixel_values=pv)
        return vitrim.vlm.last_selection(model, groups=True), captured["out"]
    finally:
        hook.remove()
        vitrim.vlm.remove(model)


# --- downsample -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "columns", "keep"), [(4, 4, 4), (24, 24, 128), (2, 3, 4), (3, 8, 5), (4, 4, 7)])
def test_downsample_cells_and_means_equal_the_documented_pooling(rows: int, columns: int, keep: int) -> None:
    features = torch.randn(rows * columns, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(keep))
    cells, means = downsample_reference(features, rows, columns, keep)
    selection = downsample_select(features, (rows, columns), keep)
    assert [g.tolist() for g in selection.groups] == cells
    assert selection.kept.tolist() == [cell[0] for cell in cells]
    assert sorted(i for cell in cells for i in cell) == list(range(rows * columns))  # each token in one cell
    assert torch.allclose(selection.merged, torch.stack(means), atol=1e-14, rtol=0)


@pytest.mark.parametrize(("side", "keep"), [(4, 4), (24, 64), (24, 144)])
def test_downsample_of_an_even_tiling_is_torchs_average_pool(side: int, keep: int) -> None:
    features = torch.randn(side * side, 5, dtype=torch.float64)
    pooled = torch.nn.functional.avg_pool2d(features.T.reshape(1, 5, side, side), side // int(keep**0.5))
    selection = downsample_select(features, (side, side), keep)
    assert torch.allclose(selection.merged, pooled.reshape(5, keep).T, atol=1e-14, rtol=0)


def test_downsample_on_llava_puts_the_cell_means_through_the_projector(eager, tensors) -> None:
    groups, projected = run(eager, tensors["pixels"], "downsample", keep=6)
    for image in range(3):
        cells, means = downsample_reference(tensors["hidden"][image, 1:], SIDE, SIDE, 6)
        assert [g.tolist() for g in groups[image]] == cells
        expected = eager.model.multi_modal_projector(torch.stack(means))  # (6, E): projector(mean of the cell)
        assert torch.allclose(projected[image, [cell[0] for cell in cells]], expected, atol=1e-12, rtol=0)


def test_downsample_without_a_grid_refuses_a_count_that_is_not_a_square() -> None:
    evidence = VisionEvidence(features=torch.zeros(1, 6, 2))
    with pytest.raises(ValueError, match=r"no grid .* 6 tokens are not a square grid"):
        Downsample().select(evidence, 2)
    assert len(Downsample().select(VisionEvidence(features=torch.ones(1, 6, 2), grid=(2, 3)), 2)[0].kept) == 2


# --- cdpruner -------------------------------------------------------------------------------------------------


def test_cdpruner_relevance_is_the_authors_at_batch_one() -> None:
    g = torch.Generator().manual_seed(3)
    image, text = (
        torch.randn(16, 8, generator=g, dtype=torch.float64),
        torch.randn(3, 8, generator=g, dtype=torch.float64),
    )
    expected = cdpruner_relevance_reference(image[None], text)[0]
    assert torch.allclose(instruction_relevance(image, text), expected, atol=1e-15, rtol=0)


@pytest.mark.parametrize(("keep", "theta"), [(5, None), (9, 0.5), pytest.param(16, 0.0, marks=FULL)])
def test_cdpruner_greedy_map_equals_the_authors_with_tied_relevance(tensors, keep: int, theta: float | None) -> None:
    """Relevance from 3 levels: many exact ties among the first step's gains (r_i²)."""
    projected = tensors["projected"]
    levels = torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64)
    relevance = levels[torch.randint(0, 3, projected.shape[:2], generator=torch.Generator().manual_seed(keep))]
    expected = cdpruner_reference(projected, relevance, keep, theta)
    for image in range(3):
        weight = relevance[image] if theta is None else torch.exp(theta / (2 * (1 - theta)) * relevance[image])
        got = conditional_dpp_keep(projected[image], weight, keep)
        assert sorted(got.tolist()) == expected[image]


def test_cdpruner_on_llava_with_theta_0_is_the_dpp_on_the_projected_tokens(eager, tensors) -> None:
    groups, _ = run(eager, tensors["pixels"], "cdpruner", keep=7, theta=0)
    ones = torch.ones(tensors["projected"].shape[:2], dtype=torch.float64)
    assert [[int(g) for g in image] for image in groups] == cdpruner_reference(tensors["projected"], ones, 7, 0.0)


def test_cdpruner_reads_the_instruction_after_each_image(eager, tensors) -> None:
    """The default (theta=None): relevance = the authors' formula (−cos averaged over the instruction's rows,
    min-max normalised) between the image tokens as the LLM receives them and the LLM's input embeddings of the
    real text after the image, written here from the prompt; then the authors' greedy MAP."""
    pv = tensors["pixels"][:2]
    ids = torch.stack([prompt(2, 3, seed=5), prompt(2, 3, seed=6)])  # one image per row, no padding
    vitrim.vlm.apply(eager, "cdpruner", keep=6)
    with torch.no_grad():
        eager(input_ids=ids, pixel_values=pv)
    kept = vitrim.vlm.last_selection(eager)
    vitrim.vlm.remove(eager)
    with torch.no_grad():
        table = eager.model.get_input_embeddings()
        for row in range(2):
            image = ids[row] == IMAGE_TOKEN
            after = ~image & (torch.arange(ids.shape[1]) > image.nonzero().max())
            tokens = tensors["projected"][row]  # (N, E): what the LLM receives in the image's slots
            text = table(ids[row, after])  # (M, E)
            cos = torch.nn.functional.normalize(tokens, dim=-1) @ torch.nn.functional.normalize(text, dim=-1).T
            relevance = -cos.mean(-1)
            relevance = (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())
            expected = cdpruner_reference(tokens[None], relevance[None], 6)[0]
            assert kept[row].tolist() == sorted(expected)
    with pytest.raises(ValueError, match=r"theta=1 must be None or a number in \[0, 1\)"):
        CDPruner(theta=1)


def test_cdpruner_an_exhausted_kernel_fills_by_relevance() -> None:
    """4 distinct directions, 6 tokens kept: after 4 the DPP has no gain left; the rest by r², ties lower first."""
    tokens = torch.eye(4, dtype=torch.float64)[[0, 1, 2, 3, 0, 1, 2, 3]]
    relevance = torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    chosen = conditional_dpp_keep(tokens, relevance, 6).tolist()
    assert chosen[:4] == [4, 1, 2, 3]  # r² = 9, then 4 (1 before 5: tied), then directions 2 and 3 (first of ties)
    assert chosen[4:] == [5, 0]  # no gain left: 5 (r² = 4), then 0, the first of the tied r² = 1


# --- scope ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "alpha"), [(4, 1.0), (7, 0.5), pytest.param(12, 2.0, marks=FULL)])
def test_scope_on_llava_equals_the_papers_greedy(eager, tensors, keep: int, alpha: float) -> None:
    groups, _ = run(eager, tensors["pixels"], "scope", keep=keep, alpha=alpha)
    saliency = tensors["attentions"][-2][:, :, 0, 1:].mean(1)  # [CLS]'s row at the scoring layer, heads averaged
    for image in range(3):
        expected = scope_reference(tensors["hidden"][image, 1:], saliency[image], keep, alpha)
        assert [int(g) for g in groups[image]] == sorted(expected)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
def test_scope_breaks_ties_as_the_reference(alpha: float) -> None:
    """Features on 4 basis vectors (cosines exactly 0 or 1) and saliency from 3 levels: ties everywhere."""
    g = torch.Generator().manual_seed(int(alpha))
    features = torch.eye(4, dtype=torch.float64)[torch.randint(0, 4, (20,), generator=g)] * 2.0
    saliency = torch.tensor([0.01, 0.02, 0.04], dtype=torch.float64)[torch.randint(0, 3, (20,), generator=g)]
    for keep in (3, 6, 11):
        assert scope_keep(features, saliency, keep, alpha).tolist() == scope_reference(features, saliency, keep, alpha)


def test_scope_options_are_checked() -> None:
    with pytest.raises(ValueError, match="alpha=-1 must be a finite number >= 0"):
        Scope(alpha=-1)


# --- hiprune --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "alpha", "object_layer"), [(5, 1.0, 1), (10, 0.5, 2), pytest.param(12, 0.9, 1, marks=FULL)]
)
def test_hiprune_on_the_tiny_llavas_attention_maps_equals_the_authors(tensors, keep, alpha, object_layer) -> None:
    attentions = tensors["attentions"]
    expected = hiprune_reference(attentions[object_layer - 1], attentions[-2], keep, alpha, SIDE)
    global_attention = lambda maps: maps.mean(1).mean(1)[:, 1:]  # noqa: E731 heads, then every query
    objects, deeps = global_attention(attentions[object_layer - 1]), global_attention(attentions[-2])
    for image in range(3):
        assert hiprune_keep(objects[image], deeps[image], SIDE, keep, alpha).tolist() == expected[image]


def test_hiprune_ties_and_the_grid_edges_as_the_authors() -> None:
    """Attention maps from 2 levels (ties) whose anchors sit on the grid's edges (clamped, wrapped neighbours)."""
    g = torch.Generator().manual_seed(0)
    maps = torch.tensor([0.5, 1.0], dtype=torch.float64)[torch.randint(0, 2, (2, 2, 17, 17), generator=g)]
    for keep, alpha in ((10, 1.0), (11, 0.5), (16, 0.7)):
        expected = hiprune_reference(maps, maps.flip(-1), keep, alpha, SIDE)
        objects, deeps = maps.mean(1).mean(1)[:, 1:], maps.flip(-1).mean(1).mean(1)[:, 1:]
        got = [hiprune_keep(objects[i], deeps[i], SIDE, keep, alpha).tolist() for i in range(2)]
        assert got == expected


def test_hiprune_refuses_a_keep_its_anchors_and_buffers_could_exceed() -> None:
    with pytest.raises(ValueError, match=r"hiprune cannot keep 3 tokens with alpha=1\.0"):
        hiprune_keep(torch.rand(16), torch.rand(16), 4, 3, 1.0)


# --- every family: keep k, an image alone equals itself in a batch ---------------------------------------------

NEW = {"downsample": {}, "scope": {}, "cdpruner": {}}  # cdpruner: its default, the instruction read


@pytest.mark.parametrize(
    "method", ["downsample", pytest.param("scope", marks=FULL), pytest.param("cdpruner", marks=FULL)]
)
def test_llava_keeps_k_and_an_image_selects_the_same_alone(method: str) -> None:
    model = tiny_llava(seed=2)
    pv = pixels(2, seed=4)
    ids = torch.stack([prompt(2, 3, seed=0), prompt(2, 3, seed=1)])  # one length: no padding to compare through
    vitrim.vlm.apply(model, method, keep=5, **NEW[method])
    with torch.no_grad():
        together = model(input_ids=ids, pixel_values=pv).logits
        groups = vitrim.vlm.last_selection(model, groups=True)
        for sample in range(2):
            alone = model(input_ids=ids[sample : sample + 1], pixel_values=pv[sample : sample + 1]).logits
            assert [g.tolist() for g in vitrim.vlm.last_selection(model, groups=True)[0]] == [
                g.tolist() for g in groups[sample]
            ]
            assert torch.allclose(alone[0], together[sample], atol=1e-10, rtol=0)
    vitrim.vlm.remove(model)
    assert [len(image) for image in groups] == [5, 5]
    assert together.shape[1] == ids.shape[1] - (GRID_TOKENS - 5)  # the LLM ran on the kept tokens


QWEN_SQUARE = [([[1, 5], [7, 8]], [(8, 8)]), ([[1], [7, 8, 9]], [(4, 4)])]  # 4 × 4 and 2 × 2 merged tokens


@pytest.mark.parametrize(
    ("family", "method"),
    [
        ("qwen2_5_vl", "downsample"),
        ("qwen2_5_vl", "scope"),
        ("qwen2_5_vl", "cdpruner"),
        pytest.param("qwen3_vl", "scope", marks=FULL),  # DeepStack rows go with the kept tokens
        pytest.param("qwen2_vl", "downsample", marks=FULL),
    ],
)
def test_qwen_keeps_k_and_an_image_selects_the_same_alone(family: str, method: str) -> None:
    from tiny_vlms.qwen import BUILDERS, batch

    model = BUILDERS[family]()
    vitrim.vlm.apply(model, method, keep=0.5, **NEW[method])
    with torch.no_grad():
        model(**batch(QWEN_SQUARE))
        together = vitrim.vlm.last_selection(model, groups=True)
        inputs = batch(QWEN_SQUARE)
        rows = inputs["image_grid_thw"].prod(-1).tolist()
        for sample, prompt_ in enumerate(QWEN_SQUARE):
            single = batch([prompt_])  # its image's pixels: the rows this image has in the batch
            single["pixel_values"] = inputs["pixel_values"][sum(rows[:sample]) : sum(rows[: sample + 1])]
            model(**single)
            alone = vitrim.vlm.last_selection(model, groups=True)[0]
            assert [g.tolist() for g in alone] == [g.tolist() for g in together[sample]]
    vitrim.vlm.remove(model)
    assert [len(image) for image in together] == [8, 2]


@pytest.mark.parametrize("method", ["downsample", "scope", pytest.param("cdpruner", marks=FULL)])
def test_gemma3_keeps_k_and_an_image_selects_the_same_alone(method: str) -> None:
    from tiny_vlms.gemma3 import pixels as gemma_pixels
    from tiny_vlms.gemma3 import prompt as gemma_prompt
    from tiny_vlms.gemma3 import tiny_gemma3, token_types

    model = tiny_gemma3()
    pv = gemma_pixels(2, seed=5)
    ids = torch.stack([gemma_prompt(2, 3, seed=0), gemma_prompt(2, 3, seed=1)])  # one length: no padding
    vitrim.vlm.apply(model, method, keep=4, **NEW[method])
    with torch.no_grad():
        together = model(input_ids=ids, pixel_values=pv, token_type_ids=token_types(ids)).logits
        groups = vitrim.vlm.last_selection(model, groups=True)
        for sample in range(2):
            one = ids[sample : sample + 1]
            alone = model(input_ids=one, pixel_values=pv[sample : sample + 1], token_type_ids=token_types(one)).logits
            assert [g.tolist() for g in vitrim.vlm.last_selection(model, groups=True)[0]] == [
                g.tolist() for g in groups[sample]
            ]
            assert torch.allclose(alone[0], together[sample], atol=1e-10, rtol=0)
    vitrim.vlm.remove(model)
    assert [len(image) for image in groups] == [4, 4]


def test_qwen_downsample_pools_a_non_square_grid_by_its_own_rows() -> None:
    """A 2 × 8 grid of merged tokens holds 16 tokens: without the grid, 4 × 4 would be assumed."""
    from tiny_vlms.qwen import BUILDERS, batch

    model = BUILDERS["qwen2_5_vl"]()
    vitrim.vlm.apply(model, "downsample", keep=4)
    with torch.no_grad():
        model(**batch([([[1, 5], [7]], [(4, 16)])]))
    groups = [g.tolist() for g in vitrim.vlm.last_selection(model, groups=True)[0]]
    vitrim.vlm.remove(model)
    cells, _ = downsample_reference(torch.zeros(16, 1), 2, 8, 4)
    assert groups == cells

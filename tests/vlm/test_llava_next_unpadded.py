"""LLaVA-NeXT with ``tiles="unpadded"``: each anyres tile selected among the tokens the unpadding leaves in it.

On images whose unpadding cuts tiles (4:3, 16:9, 4:1, 3:4 on the tiny pinpoints), and on a model whose 1×3
pinpoints make the unpadding remove whole tiles: FasterVLM's kept tokens equal the top-k of the [CLS] attention
(transformers' own ``output_attentions``) restricted to each tile's surviving tokens, written here from the token map
alone; every method's count is ``Σ min(keep, n_tile) + newlines`` (a fraction: ``max(1, round(f · n_tile))``),
a batch selects what each prompt does alone, generate() decodes as the masked full model does; at pinpoint aspect
ratios (no tile cut) the option changes nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pre_llm_reference import stable_topk

import vitrim.vlm
from tiny_vlms.llava import IMAGE_TOKEN, PAD
from tiny_vlms.llava_next import SIZES, inputs, tiny_llava_next
from vitrim.vlm.families import find_family
from vitrim.vlm.families.llava_next import tile_cuts
from vitrim.vlm.method.base import VisionEvidence
from vitrim.vlm.stages.capture import TOKEN_AXES, WHOLE_IMAGE_FIELDS

TILE = 16  # tokens of a 16-px tile of 4-px patches
WIDE = [[16, 48], [48, 16]]  # 1×3 and 3×1 grids: a square image leaves its side tiles out entirely
# (height, width) on the default pinpoints: 4:3, 16:9, 4:1 and 3:4 photos, every grid tile cut
CUT = [(30, 40), (27, 48), (20, 80), (40, 30)]
# on WIDE: a square image (side tiles removed whole), a 4:3 one (side tiles cut to one column)
REMOVED = [(30, 30), (30, 40)]
METHODS = [
    ("fastervlm", {}),
    ("visionzip", {}),
    ("divprune", {}),
    ("downsample", {}),
    ("random", {}),
    ("scope", {}),
    ("vispruner", {}),
    ("cdpruner", {"theta": 0}),
]
TOL = 1e-12


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {
        "default": tiny_llava_next(),
        "wide": tiny_llava_next(WIDE),
        "eager": tiny_llava_next(attn="eager"),  # transformers hands back the tower's attention maps
    }


@pytest.fixture(autouse=True)
def _clean(models: dict[str, torch.nn.Module]):
    yield
    for model in models.values():
        if hasattr(model, "_vitrim_vlm"):
            vitrim.vlm.remove(model)


def prompt(model: torch.nn.Module, sizes: list[tuple[int, int]], seed: int = 1) -> dict[str, torch.Tensor]:
    """One prompt with the images of ``sizes`` (random pixels: the layout is the sizes'), text between them."""
    image_sizes = torch.tensor(sizes)
    family = find_family(model)
    counts = [len(m) for m in family.token_maps(image_sizes)]
    most = max(family.tiles_of(image_sizes))
    ids = [5, 6]
    for count in counts:
        ids += [IMAGE_TOKEN] * count + [7]
    generator = torch.Generator().manual_seed(seed)
    pv = torch.randn(len(sizes), most, 3, 16, 16, dtype=torch.float64, generator=generator)
    return {"input_ids": torch.tensor([[*ids, 8]]), "pixel_values": pv, "image_sizes": image_sizes}


def surviving(model: torch.nn.Module, size: tuple[int, int]) -> list[list[int]]:
    """Per tile of an image of ``size``, the raster indices of its tokens that are in the LLM input (from the
    token map alone: the tile·16 + token numbers it holds)."""
    family = find_family(model)
    image_sizes = torch.tensor([size])
    (token_map,) = family.token_maps(image_sizes)
    (tiles,) = family.tiles_of(image_sizes)
    numbers = [n for n in token_map.tolist() if n >= 0]
    return [sorted(n % TILE for n in numbers if n // TILE == tile) for tile in range(tiles)]


def expected_count(model: torch.nn.Module, size: tuple[int, int], keep: float) -> int:
    """``Σ over tiles of min(keep, n)`` (a fraction: ``max(1, round(keep · n))``; 0 of a removed tile) + newlines."""
    (token_map,) = find_family(model).token_maps(torch.tensor([size]))
    newlines = int((token_map < 0).sum())
    kept = 0
    for tokens in surviving(model, size):
        n = len(tokens)
        if n:
            kept += min(keep, n) if isinstance(keep, int) else max(1, round(keep * n))
    return kept + newlines


def test_what_the_unpadding_leaves_of_each_tile_is_a_rectangle_by_hand(models: dict[str, torch.nn.Module]) -> None:
    """4:3 on the 2×2 grid: 8 token rows unpadded to rows 1 … 6 (the top tiles lose their first row, the bottom
    ones their last); a square image on the 1×3 grid: columns 4 … 7 only, the side tiles gone."""
    family = find_family(models["default"])
    (token_map,) = family.token_maps(torch.tensor([CUT[0]]))
    cuts = [(c.top, c.bottom, c.left, c.right) for c in tile_cuts(token_map, 5, 4)]
    assert cuts == [(0, 4, 0, 4), (1, 4, 0, 4), (1, 4, 0, 4), (0, 3, 0, 4), (0, 3, 0, 4)]
    assert [len(t) for t in surviving(models["default"], CUT[0])] == [16, 12, 12, 12, 12]
    wide = find_family(models["wide"])
    (token_map,) = wide.token_maps(torch.tensor([REMOVED[0]]))
    assert [c.count for c in tile_cuts(token_map, 4, 4)] == [16, 0, 16, 0]
    assert [len(t) for t in surviving(models["wide"], REMOVED[1])] == [16, 4, 16, 4]


def tower_attention(model: torch.nn.Module, tiles: torch.Tensor) -> torch.Tensor:
    """(t, N) the [CLS] row of the tower layer −2's attention, averaged over heads (FasterVLM's score), from
    transformers' own ``output_attentions`` of the unmodified eager tower."""
    with torch.no_grad():
        out = model.model.vision_tower(tiles, output_attentions=True)
    return out.attentions[-2][:, :, 0, 1:].mean(1)


LAYOUTS = [("default", CUT), ("default", [(30, 30), (20, 40)]), ("wide", REMOVED)]  # cut, pinpoint, removed tiles


@pytest.mark.parametrize(("pinpoints", "sizes"), LAYOUTS)
@pytest.mark.parametrize("keep", [5, 13, 0.4])
def test_fastervlm_keeps_the_top_k_of_cls_attention_among_each_tiles_surviving_tokens(
    models: dict[str, torch.nn.Module], pinpoints: str, sizes: list[tuple[int, int]], keep: float
) -> None:
    model = models[pinpoints]
    given = prompt(model, sizes)
    vitrim.vlm.apply(model, "fastervlm", keep=keep, tiles="unpadded")
    with torch.no_grad():
        model(**given)
    kept = vitrim.vlm.last_selection(model)
    eager = models["eager"]  # the same weights (the tower does not read the pinpoints)
    family = find_family(model)
    for image, size in enumerate(sizes):
        (token_map,) = family.token_maps(torch.tensor([size]))
        numbers = token_map.tolist()
        tiles = family.tiles_of(torch.tensor([size]))[0]
        scores = tower_attention(eager, given["pixel_values"][image, :tiles])  # (tiles, 16)
        expected = {position for position, number in enumerate(numbers) if number < 0}  # every newline
        for tile, tokens in enumerate(surviving(model, size)):
            if not tokens:
                continue
            count = min(keep, len(tokens)) if isinstance(keep, int) else max(1, round(keep * len(tokens)))
            top = stable_topk(scores[tile, tokens], count).tolist()
            expected |= {numbers.index(tile * TILE + tokens[j]) for j in top}
        assert kept[image].tolist() == sorted(expected), size
        assert len(kept[image]) == expected_count(model, size, keep)


@pytest.mark.parametrize(("method", "options"), METHODS)
def test_every_method_keeps_the_count_the_image_size_gives_and_a_batch_selects_as_each_prompt_alone(
    models: dict[str, torch.nn.Module], method: str, options: dict
) -> None:
    for name, sizes in (("default", CUT), ("wide", REMOVED)):
        model = models[name]
        for keep in (5, 0.3):
            vitrim.vlm.apply(model, method, keep=keep, tiles="unpadded", **options)
            alone = []
            for size in sizes:
                with torch.no_grad():
                    model(**prompt(model, [size], seed=sum(size)))
                (kept,) = vitrim.vlm.last_selection(model, groups=True)
                assert len(kept) == expected_count(model, size, keep), (name, size, keep)
                alone.append([group.tolist() for group in kept])
            batch = [prompt(model, [size], seed=sum(size)) for size in sizes]
            length = max(p["input_ids"].shape[1] for p in batch)
            ids = torch.full((len(sizes), length), PAD)
            mask = torch.zeros(len(sizes), length, dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, length - p["input_ids"].shape[1] :] = p["input_ids"][0]
                mask[row, length - p["input_ids"].shape[1] :] = 1
            tiles = max(p["pixel_values"].shape[1] for p in batch)
            pv = torch.zeros(len(sizes), tiles, 3, 16, 16, dtype=torch.float64)
            for row, p in enumerate(batch):
                pv[row, : p["pixel_values"].shape[1]] = p["pixel_values"][0]
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, pixel_values=pv, image_sizes=torch.tensor(sizes))
            together = [[group.tolist() for group in image] for image in vitrim.vlm.last_selection(model, groups=True)]
            assert together == alone, (name, keep)
            vitrim.vlm.remove(model)


@pytest.mark.parametrize(("method", "options"), METHODS)
def test_at_pinpoint_aspect_ratios_the_option_changes_nothing(
    models: dict[str, torch.nn.Module], method: str, options: dict
) -> None:
    model = models["default"]
    runs = []
    for tiles in ("whole", "unpadded"):
        vitrim.vlm.apply(model, method, keep=5, tiles=tiles, **options)
        with torch.no_grad():
            logits = model(**inputs()).logits
        runs.append((logits, [k.tolist() for k in vitrim.vlm.last_selection(model)]))
        vitrim.vlm.remove(model)
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    family = find_family(model)  # SIZES: the unpadding cuts no tile
    for token_map, tiles in zip(family.token_maps(SIZES), family.tiles_of(SIZES), strict=True):
        assert all(cut.whole() for cut in tile_cuts(token_map, tiles, 4))


def test_visionzip_merges_within_each_tiles_surviving_tokens(models: dict[str, torch.nn.Module]) -> None:
    """Every token the LLM would see is in exactly one group (nothing merged into a token the unpadding drops,
    nothing lost), and each group stays in its tile."""
    for name, sizes in (("default", CUT), ("wide", REMOVED)):
        model = models[name]
        vitrim.vlm.apply(model, "visionzip", keep=5, contextual=2, tiles="unpadded")
        for size in sizes:
            with torch.no_grad():
                model(**prompt(model, [size]))
            (groups,) = vitrim.vlm.last_selection(model, groups=True)
            (token_map,) = find_family(model).token_maps(torch.tensor([size]))
            assert sorted(torch.cat(groups).tolist()) == list(range(len(token_map)))
            for group in groups:
                assert len({int(token_map[p]) // TILE for p in group.tolist()}) == 1
        vitrim.vlm.remove(model)


def test_generate_equals_greedy_decoding_of_the_masked_model(models: dict[str, torch.nn.Module]) -> None:
    model = models["wide"]
    given = prompt(model, REMOVED)
    vitrim.vlm.apply(model, "fastervlm", keep=3, tiles="unpadded", positions="original")
    generated = model.generate(**given, max_new_tokens=3, do_sample=False)
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    ids = given["input_ids"]
    mask = torch.ones_like(ids)
    columns = (ids[0] == IMAGE_TOKEN).nonzero()[:, 0].tolist()
    start = 0
    for image, size in enumerate(REMOVED):
        count = len(find_family(model).token_maps(torch.tensor([size]))[0])
        for token in set(range(count)) - set(kept[image].tolist()):
            mask[0, columns[start + token]] = 0
        start += count
    tokens = []
    with torch.no_grad():
        for _ in range(3):
            logits = model(**given, attention_mask=mask, position_ids=torch.arange(mask.shape[1])[None]).logits
            tokens.append(int(logits[0, -1].argmax()))
            given = {**given, "input_ids": torch.cat([given["input_ids"], torch.tensor([[tokens[-1]]])], 1)}
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
    assert generated[0, -3:].tolist() == tokens


def test_every_evidence_field_is_cut_or_kept_whole() -> None:
    """A field added to VisionEvidence must be told apart here: cut along its token axis, or the image's own."""
    names = {field.name for field in dataclasses.fields(VisionEvidence)}
    assert names == set(TOKEN_AXES) | WHOLE_IMAGE_FIELDS | {"grid", "frame_states"}


def test_the_option_is_checked_before_anything_is_installed(models: dict[str, torch.nn.Module]) -> None:
    model = models["default"]
    with pytest.raises(ValueError, match=r"tiles='cut': expected one of 'whole', 'unpadded'"):
        vitrim.vlm.apply(model, "fastervlm", keep=5, tiles="cut")
    with pytest.raises(ValueError, match=r"tiles='unpadded' is how the pre-LLM stage selects LLaVA-NeXT"):
        vitrim.vlm.apply(model, "fastv", keep=5, layer=1, tiles="unpadded")
    assert not hasattr(model, "_vitrim_vlm")
    from tiny_vlms.llava import tiny_llava

    with pytest.raises(ValueError, match=r"tiles='unpadded' is an option of LLaVA-NeXT .* takes no 'tiles'"):
        vitrim.vlm.apply(tiny_llava(), "fastervlm", keep=5, tiles="unpadded")


def test_an_in_llm_method_stacked_after_keeps_the_option(models: dict[str, torch.nn.Module]) -> None:
    model = models["default"]
    given = prompt(model, CUT[:2])
    vitrim.vlm.apply(model, "fastervlm", keep=5, tiles="unpadded")
    vitrim.vlm.apply(model, "fastv", keep=10, layer=1)
    with torch.no_grad():
        model(**given)
    entered = vitrim.vlm.last_selection(model, stage="pre_llm")
    assert [len(k) for k in entered] == [expected_count(model, size, 5) for size in CUT[:2]]
    assert [len(k) for k in vitrim.vlm.last_selection(model)] == [10, 10]


def test_the_keep_of_a_cut_tile_is_the_stated_rule() -> None:
    """An int keep: min(keep, n); a float: max(1, round(keep · n)) (Python's round, half to even); 0 of no token."""
    from vitrim.vlm.keep import parse_keep

    assert [parse_keep(13).tokens_within(n) for n in (16, 12, 4, 0)] == [13, 12, 4, 0]
    assert [parse_keep(0.25).tokens_within(n) for n in (16, 10, 6, 2, 0)] == [4, 2, 2, 1, 0]  # 2.5 -> 2, 1.5 -> 2


def test_no_method_has_an_option_named_as_a_family_option() -> None:
    """apply takes a family's options (tiles=) before the method's: a method option of that name would never arrive."""
    from vitrim.vlm.families import family_option_names
    from vitrim.vlm.method.base import method_class

    assert family_option_names() == {"tiles"}
    assert not [name for name in vitrim.vlm.methods() if set(method_class(name).option_defaults()) & {"tiles"}]

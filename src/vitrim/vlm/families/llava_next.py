"""LLaVA-NeXT (transformers' ``LlavaNextForConditionalGeneration``): anyres tiles and the newline tokens.

An image becomes tiles (a base view and a grid of crops, ``image_size_to_num_patches``), each a CLIP image of N
tokens; transformers packs them (``pack_image_features``): the base tile's N tokens, then the grid's tokens in
raster order over the whole grid, unpadded to the image's aspect ratio, each row followed by one ``image_newline``
token. That packed sequence is the image's tokens in the LLM, and its order is vitrim's index space for LLaVA-NeXT
(``last_selection``: positions 0 … T−1 among them, newline tokens included).

Where vitrim cuts, as the authors of FasterVLM and VisPruner do on LLaVA-NeXT: every tile is selected alone, with
``keep`` tokens per tile (so an image of t tiles has t·keep selected tokens before unpadding); newline tokens
always stay; a token the unpadding removes is not in the LLM input, kept or not (a VisionZip contextual token whose
target is unpadded away is lost with it, as in the authors' pipeline). ``keep`` as an int is therefore a count per
tile (1 … N), as a float a fraction of each tile.

Option ``tiles="unpadded"`` of ``vitrim.vlm.apply`` (default ``"whole"``, the authors' convention above) selects each
tile among only the tokens the unpadding leaves in it, so an image's count is known from its size alone (what vLLM
needs, :mod:`vitrim.vllm.llava_next`). The unpadding removes whole rows or columns of the packed grid, so what it
leaves of a tile is a sub-rectangle of the tile's grid (:func:`tile_cuts`; the base tile is never unpadded): the
tile's evidence is cut to that rectangle (every per-token field, ``grid`` the rectangle's:
:func:`~vitrim.vlm.stages.capture.crop_tokens`), the method runs on it and keeps, of the n tokens there, an int
``keep``'s ``min(keep, n)``, a float's ``max(1, round(keep · n))`` (:meth:`~vitrim.vlm.keep.KeepSpec.tokens_within`);
a tile the unpadding removes entirely selects nothing. The kept indices go back to the tile's raster indices and from
there to the packed order as above. VisionZip merges its contextual tokens within the rectangle. An image then hands
the LLM ``Σ over its tiles of that keep + one newline per unpadded row`` tokens. A method that reads the prompt
(CDPruner with ``theta`` > 0) selects among the image's packed tokens, not per tile, under either option.

The packing is transformers' own: vitrim runs the model's ``pack_image_features`` on a tensor of token numbers to
learn where each tile token lands. generate() encodes the images before its first forward without passing
``image_sizes`` to it, so the adapter wraps ``get_image_features`` on the instance (an instance attribute, removed
again) to see them.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.boxes import NO_VIEW, Affine, TokenBoxes, grid_boxes
from vitrim.vlm.families.llava import LlavaAdapter
from vitrim.vlm.method.base import ImageSelection, VisionEvidence
from vitrim.vlm.stages.capture import (
    EncoderSeam,
    HandOn,
    crop_tokens,
    images_of,
    select_keeping_each,
    uncropped,
)
from vitrim.vlm.stages.contract import FamilyTraits, Prefill, ServedArchitecture
from vitrim.vlm.stages.inputs import prefill_input_ids
from vitrim.vlm.stages.spans import ImageSpans, repeated_images, spans_from_mask

NEWLINE = -1  # in a token map: the position holds the image_newline token
# option tiles= of the pre-LLM stage: "whole" selects keep per tile before the unpadding (the authors' convention),
# "unpadded" among the tokens the unpadding leaves in the tile (the module docstring)
TILES = ("whole", "unpadded")


class LlavaNextAdapter(LlavaAdapter):
    """The seams of one ``LlavaNextForConditionalGeneration`` instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=("LlavaNextForConditionalGeneration",),
        title="LLaVA-NeXT (LlavaNextForConditionalGeneration)",
        stages=("pre_llm", "in_llm"),
        options={"tiles": TILES},
        served=(
            ServedArchitecture(
                "VitrimLlavaNextForConditionalGeneration",
                "vitrim.vllm.llava_next",
                "LlavaNextForConditionalGeneration",
                "llava_next",
            ),
        ),
    )
    cls_to_llm = False  # every tile has a [CLS]; the packed image has no place for them (VisionZip: one more patch)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.image_sizes: Tensor | None = None  # of the last get_image_features call
        self.watchers = 0
        self.modeling = sys.modules[type(self.inner).__module__]  # transformers' llava_next module, already loaded

    def tokens_per_image(self) -> int | None:
        return None  # depends on each image's size

    def tiles_of(self, image_sizes: Tensor) -> list[int]:
        image_size = self.config.vision_config.image_size
        pinpoints = self.config.image_grid_pinpoints
        return [int(self.modeling.image_size_to_num_patches(size, pinpoints, image_size)) for size in image_sizes]

    def token_maps(self, image_sizes: Tensor) -> list[Tensor]:
        """Per image (T_i,) long: for each of its LLM tokens, ``tile · N + token`` of the tile token it shows
        (tiles numbered within the image), or NEWLINE."""
        tiles = self.tiles_of(image_sizes)
        tokens = self.tile_tokens()
        numbers = [
            torch.arange(count * tokens, dtype=torch.float64).view(count, tokens, 1) for count in tiles
        ]  # exact integers in float64, packed like features
        newline = torch.tensor([float(NEWLINE)], dtype=torch.float64)
        strategy = self.config.vision_feature_select_strategy
        packed, _ = self.inner.pack_image_features(numbers, image_sizes.cpu(), strategy, image_newline=newline)
        return [image[:, 0].round().long() for image in packed]

    def spans_for(self, input_ids: Tensor, image_sizes: Tensor) -> ImageSpans:
        is_image: Tensor = input_ids == self.config.image_token_id  # (B, L)
        counts = [len(m) for m in self.token_maps(image_sizes)]
        order = repeated_images(counts, is_image.sum(1).tolist())
        return spans_from_mask(is_image, [counts[image] for image in order])

    def see_image_sizes(self) -> Callable[[], None]:
        """Wrap ``get_image_features`` on the instance to remember ``image_sizes``; returns the undo."""
        original = self.inner.get_image_features

        @functools.wraps(original)  # generate() reads its signature to pick the arguments it passes
        def get_image_features(*args: Any, **kwargs: Any) -> Any:
            self.note_image_call(args, kwargs)
            return original(*args, **kwargs)

        self.inner.get_image_features = get_image_features

        def undo() -> None:
            if self.inner.__dict__.get("get_image_features") is get_image_features:
                del self.inner.get_image_features

        return undo

    def note_image_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Remember what a ``get_image_features`` call says about its images: ``image_sizes``."""
        sizes = kwargs.get("image_sizes", args[1] if len(args) > 1 else None)
        self.image_sizes = None if sizes is None else torch.as_tensor(sizes)

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        undo_sizes = self.see_image_sizes()

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            prefill = self.prefill_of(args, kwargs)
            if prefill is not None:
                on_prefill(self.spans_for(prefill.input_ids, prefill.extras["image_sizes"]))

        handle = self.inner.register_forward_pre_hook(hook, with_kwargs=True)

        def remove() -> None:
            handle.remove()
            undo_sizes()

        return remove

    # the pre-LLM stage's seams: LLaVA's, selected per tile, mapped onto the packed tokens

    def prefill_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Prefill | None:
        input_ids = prefill_input_ids(args, kwargs)
        if input_ids is None:
            return None
        sizes = kwargs.get("image_sizes", args[2] if len(args) > 2 else None)
        sizes = sizes if sizes is not None else self.image_sizes
        if sizes is None:
            raise ValueError("vitrim.vlm needs the image_sizes of a LLaVA-NeXT prefill")
        pixels = kwargs.get("pixel_values", args[1] if len(args) > 1 else None)
        extras = {"image_sizes": torch.as_tensor(sizes)}
        return Prefill(input_ids, kwargs.get("attention_mask"), runs_tower=pixels is not None, extras=extras)

    def select_hooks(self, stage: EncoderSeam) -> list[Callable[[], None]]:
        stage.keep_of(self.tile_tokens())  # keep counts per tile here: checked against a tile's tokens
        return [*super().select_hooks(stage), self.see_image_sizes()]

    def hand_on_for(self, stage: EncoderSeam) -> HandOn:
        """``tiles="unpadded"``: each tile selected among the tokens the unpadding leaves (:func:`select_cut_tiles`);
        else, and for a method that selects at the LLM's input (it reads the prompt), the stage's own."""
        method, keep = stage.method, stage.keep
        if stage.family_options.get("tiles", TILES[0]) == "whole" or method.reads_instruction() or keep is None:
            return stage.hand_on

        def choose(evidence: VisionEvidence, count: int) -> list[ImageSelection]:
            if self.image_sizes is None:
                raise ValueError("vitrim.vlm needs the image_sizes of a LLaVA-NeXT prefill")
            side = self.config.vision_config.image_size // self.config.vision_config.patch_size
            maps, tiles = self.token_maps(self.image_sizes), self.tiles_of(self.image_sizes)
            cuts = [cut for m, t in zip(maps, tiles, strict=True) for cut in tile_cuts(m, t, side)]
            keeps = [keep.tokens_within(cut.count) for cut in cuts]
            return select_cut_tiles(evidence, cuts, keeps, lambda part, each: select_keeping_each(method, part, each))

        return HandOn(method, choose)

    def image_tokens(
        self, prefill: Prefill, selections: list[ImageSelection]
    ) -> tuple[list[ImageSelection], list[int]]:
        sizes = prefill.extras["image_sizes"]
        maps = self.token_maps(sizes)
        tiles = self.tiles_of(sizes)
        if sum(tiles) != len(selections):
            raise ValueError(f"the images have {sum(tiles)} tiles but vitrim.vlm selected tokens for {len(selections)}")
        tokens = self.tile_tokens()
        starts = [sum(tiles[:image]) for image in range(len(tiles))]
        images = [
            tiles_to_image(selections[start : start + count], token_map, tokens)
            for start, count, token_map in zip(starts, tiles, maps, strict=True)
        ]
        return images, [len(token_map) for token_map in maps]

    # where its image tokens lie in the user's picture

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture of ``sizes`` (H, W): its packed tokens' boxes (:func:`llava_next_boxes`), the packing read
        from ``inputs["image_sizes"]`` through :meth:`token_maps`."""
        maps = self.token_maps(torch.as_tensor(inputs["image_sizes"]))
        return [llava_next_boxes(image_processor, self.config, m, s) for m, s in zip(maps, sizes, strict=True)]


@dataclass(frozen=True)
class TileCut:
    """What the unpadding leaves of one tile's ``side`` × ``side`` token grid: rows ``top`` … ``bottom`` − 1 and
    columns ``left`` … ``right`` − 1 (a tile it removes entirely: an empty rectangle)."""

    top: int
    bottom: int
    left: int
    right: int
    side: int

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, columns) of the rectangle."""
        return self.bottom - self.top, self.right - self.left

    @property
    def count(self) -> int:
        """Tokens in the rectangle (0 for a tile removed entirely)."""
        rows, columns = self.grid
        return rows * columns

    def whole(self) -> bool:
        return self.count == self.side * self.side

    def positions(self) -> Tensor:
        """(count,) long: the rectangle's tokens as raster indices of the tile, in raster order."""
        rows = torch.arange(self.top, self.bottom)[:, None] * self.side
        return (rows + torch.arange(self.left, self.right)[None]).flatten()


def tile_cuts(token_map: Tensor, tiles: int, side: int) -> list[TileCut]:
    """Per tile of one image (the base tile first), what the unpadding leaves of it, read from the image's
    ``token_map`` (T,) (``tile · side² + token`` or NEWLINE: :meth:`LlavaNextAdapter.token_maps`, vLLM's
    ``packed_token_map``). The unpadding crops whole rows or columns of the packed grid, so each tile keeps a
    rectangle; ``ValueError`` where a map says otherwise."""
    tokens = side * side
    shown = token_map[token_map != NEWLINE]
    cuts = []
    for tile in range(tiles):
        local = shown[shown // tokens == tile] % tokens
        if not len(local):
            cuts.append(TileCut(0, 0, 0, 0, side))
            continue
        rows, columns = local // side, local % side
        cut = TileCut(int(rows.min()), int(rows.max()) + 1, int(columns.min()), int(columns.max()) + 1, side)
        if cut.count != len(local):
            raise ValueError(f"the unpadding leaves {len(local)} tokens of tile {tile}, not a rectangle of its grid")
        cuts.append(cut)
    return cuts


def select_cut_tiles(
    evidence: VisionEvidence,
    cuts: list[TileCut],
    keeps: list[int],
    choose: Callable[[VisionEvidence, list[int]], list[ImageSelection]],
) -> list[ImageSelection]:
    """Each of the t tiles of ``evidence`` (t tiles of side² tokens) selected among the tokens of its ``cuts``
    rectangle only, keeping ``keeps[i]`` of them (0 for an empty rectangle: nothing), in the tile's raster indices.

    choose: ``(evidence of some tiles, their keeps) -> their selections`` (an engine's ``select_keeping_each``);
    it runs once per rectangle shape on the tiles cut alike (:func:`~vitrim.vlm.stages.capture.crop_tokens`; every
    method selects each image alone, so this is what each tile would select alone), the whole tiles uncut.
    """
    device = evidence.features.device
    chosen: dict[int, ImageSelection] = {}
    shapes: dict[tuple[int, int, int, int], list[int]] = {}
    for tile, cut in enumerate(cuts):
        if cut.count == 0:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            chosen[tile] = ImageSelection(kept=empty, groups=())
        else:
            shapes.setdefault((cut.top, cut.bottom, cut.left, cut.right), []).append(tile)
    for members in shapes.values():
        cut = cuts[members[0]]
        rows = torch.tensor(members, device=device)
        part = images_of(evidence, rows)
        positions = cut.positions().to(device)
        if not cut.whole():
            part = crop_tokens(part, positions, cut.grid)
        picked = choose(part, [keeps[tile] for tile in members])
        for tile, selection in zip(members, picked, strict=True):
            chosen[tile] = selection if cut.whole() else uncropped(selection, positions)
    return [chosen[tile] for tile in range(len(cuts))]


def tiles_to_image(tiles: list[ImageSelection], token_map: Tensor, tokens: int) -> ImageSelection:
    """One image's selection over its packed LLM tokens from the selections of its tiles (in order).

    token_map: (T,) ``tile · N + token`` (tiles counted from the image's first) or NEWLINE for each LLM token;
    tokens: N, the tokens of one tile.
    """
    numbers = token_map.tolist()
    position_of = {number: position for position, number in enumerate(numbers) if number != NEWLINE}
    groups = {position: [position] for position, number in enumerate(numbers) if number == NEWLINE}
    for tile, selection in enumerate(tiles):
        for kept, group in zip(selection.kept.tolist(), selection.groups):
            position = position_of.get(tile * tokens + kept)
            if position is None:
                continue  # unpadded away: not in the LLM input
            members = [position_of[tile * tokens + m] for m in group.tolist() if tile * tokens + m in position_of]
            groups[position] = sorted(members)
    kept_positions = sorted(groups)
    device = tiles[0].kept.device
    return ImageSelection(
        kept=torch.tensor(kept_positions, dtype=torch.long, device=device),
        groups=tuple(torch.tensor(groups[p], dtype=torch.long, device=device) for p in kept_positions),
    )


def anyres_layout(size: tuple[int, int], pinpoints: list[list[int]]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The best pinpoint resolution (height, width) for a picture of ``size``, and the size the picture is resized
    to inside it (aspect kept, ``math.ceil`` on the short side, as transformers' ``get_patch_output_size``)."""
    from transformers.image_processing_utils import select_best_resolution  # only when boxes are asked for

    best_h, best_w = select_best_resolution(size, pinpoints)
    height, width = size
    if best_w / width < best_h / height:
        inner = (min(math.ceil(height * best_w / width), best_h), best_w)
    else:
        inner = (best_h, min(math.ceil(width * best_h / height), best_w))
    return (int(best_h), int(best_w)), (int(inner[0]), int(inner[1]))


def llava_next_boxes(image_processor: Any, config: Any, token_map: Tensor, size: tuple[int, int]) -> TokenBoxes:
    """LLaVA-NeXT's packed tokens (``token_map``: (T,) tile · N + t, or NEWLINE) on a picture of ``size`` (H, W).

    Token ``tile · N + t`` is patch ``t`` of tile 0 (the base view: the whole picture resized to a square tile) or
    of grid tile ``tile − 1`` (the picture resized into the best pinpoint resolution, centred with padding, cut
    into square tiles in raster order); the newline tokens have no box. Returns T boxes, view 0 ("base view"),
    1 ("tiles") or NO_VIEW.
    """
    height, width = size
    tile = int(config.vision_config.image_size)
    patch = int(config.vision_config.patch_size)
    side = tile // patch
    per_tile = side * side
    pinpoints = [list(p) for p in image_processor.image_grid_pinpoints]
    (best_h, best_w), (inner_h, inner_w) = anyres_layout(size, pinpoints)
    tiles_per_row = best_w // tile
    # the base view: the whole picture resized to the tile (no crop when the sizes agree, as in the hub's configs)
    base = grid_boxes(side, side, patch, Affine(width / tile, 0.0), Affine(height / tile, 0.0), size)
    # the grid tiles: padded canvas -> resized picture (minus the centring padding) -> original
    pad_x, pad_y = (best_w - inner_w) // 2, (best_h - inner_h) // 2
    canvas_x = Affine(width / inner_w, pad_x * width / inner_w)
    canvas_y = Affine(height / inner_h, pad_y * height / inner_h)
    canvas = grid_boxes(best_h // patch, best_w // patch, patch, canvas_x, canvas_y, size)
    numbers = token_map.tolist()
    boxes = torch.full((len(numbers), 4), math.nan, dtype=torch.float64)
    view = torch.full((len(numbers),), NO_VIEW, dtype=torch.long)
    canvas_cols = best_w // patch
    for position, number in enumerate(numbers):
        if number < 0:
            continue  # the image_newline token
        tile_index, token = divmod(number, per_tile)
        row, col = divmod(token, side)
        if tile_index == 0:
            boxes[position], view[position] = base[token], 0
            continue
        tile_row, tile_col = divmod(tile_index - 1, tiles_per_row)
        cell = (tile_row * side + row) * canvas_cols + tile_col * side + col
        boxes[position], view[position] = canvas[cell], 1
    view[boxes[:, 0].isnan()] = NO_VIEW
    grids = ((side, side), (best_h // patch, best_w // patch))
    return TokenBoxes(boxes, view, ("base view", "tiles"), grids, size)

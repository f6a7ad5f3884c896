"""LLaVA-NeXT in vLLM with a vitrim.vlm pre-LLM method: ``VitrimLlavaNextForConditionalGeneration``.

vitrim.vlm cuts LLaVA-NeXT per tile (:mod:`vitrim.vlm.families.llava_next`): each tile (the base view, then the
anyres grid) is a LLaVA-1.5 image selected alone at ``keep`` tokens, merged tokens are written into the tile's
features before the projector, and the LLM gets the kept tokens among the image's packed tokens (the base tile's,
then the grid's rows unpadded to the image's aspect ratio, each row followed by ``image_newline``), every newline
kept, in packed order. This subclass of vLLM's ``LlavaNextForConditionalGeneration`` does the same at vLLM's seams:

- **the placeholders** (the processor's prompt updates, before the tower runs): an image of t tiles gets
  ``keep`` per tile the unpadding leaves whole and one per newline (:func:`entered_tokens`); the request's own
  ``keep`` where it gives one (:mod:`vitrim.vllm.request_keep`), which travels to the model as one keep per tile
  (:func:`tile_keeps`);
- **the features** (``embed_multimodal``): the tower runs on the image's tiles as vLLM's does, vitrim.vlm's encoder
  seam (:mod:`vitrim.vlm.stages.capture`, the taps of :mod:`vitrim.vllm.llava`) selects per tile and writes merged
  tokens, the projector runs, and the packed tokens (:func:`packed_token_map`) that were kept are handed on.

Where the unpadding cuts through a tile (an image whose aspect ratio is not a pinpoint's: 4:3, 16:9 photos), the
tokens that tile hands the LLM under that convention are those of its ``keep`` that lie in the uncut part, which
depends on what the method keeps, i.e. on the image's content; vLLM lays out a prompt's placeholders before the
tower runs. So such an image is refused (one ``vitrim:`` line, that request alone) unless it keeps every token, or
the engine's ``vitrim`` entry has ``"tiles": "unpadded"`` (vitrim.vlm's ``apply(..., tiles="unpadded")``): each
tile is then selected among the tokens the unpadding leaves in it (vitrim.vlm's ``select_cut_tiles``, the function
transformers runs), keeping ``min(keep, n)`` of its n (a fraction: of n), none of a tile it removes, so every image's
count is :func:`unpadded_tokens`, from its size alone. A tile the unpadding removes whole hands on nothing, whatever
is kept. The option is the engine's (as the method is; a request's own entry takes ``keep`` and the method's options).

Positions: as LLaVA-1.5's (:mod:`vitrim.vllm.llava`): the shortened prompt numbered 0, 1, 2, …, vitrim.vlm's
default; ``positions="original"`` is refused when the engine starts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image
from vllm.config import VllmConfig
from vllm.model_executor.models.llava import LlavaDummyInputsBuilder
from vllm.model_executor.models.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextMultiModalProcessor,
    LlavaNextProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import ImageProcessorItems

from vitrim.vllm.llava import (
    LlavaPlaceholders,
    clip_taps,
    image_tokens,
    llava_trim_options,
)
from vitrim.vllm.options import TrimOptions
from vitrim.vllm.request_keep import BuiltMethods, asked_keeps, item_methods, keep_field, select_items
from vitrim.vllm.selection_record import SelectionRecord
from vitrim.vlm.evidence.seeds import content_seed, image_seeds
from vitrim.vlm.families.llava_next import NEWLINE, TILES, select_cut_tiles, tile_cuts, tiles_to_image
from vitrim.vlm.method.base import Selector, VisionEvidence
from vitrim.vlm.stages.capture import HandOn, select_keeping_each

ARCHITECTURE = "VitrimLlavaNextForConditionalGeneration"


def tile_count(hf_config: Any, height: int, width: int) -> int:
    """The tiles of a ``height`` × ``width`` image: the base view and its anyres grid's."""
    vision = hf_config.vision_config
    rows, columns = get_anyres_image_grid_shape((height, width), hf_config.image_grid_pinpoints, vision.image_size)
    return 1 + int(rows) * int(columns)


def packed_token_map(hf_config: Any, height: int, width: int) -> Tensor:
    """(T,) long: for each LLM token of a ``height`` × ``width`` image, ``tile · N + token`` of the tile token it
    shows (tile 0 the base view, 1 … the grid in raster order; N a tile's tokens), or NEWLINE.

    The packing of transformers' ``pack_image_features`` and vLLM's ``_merge_image_patch_embeddings`` (both call
    transformers' ``get_anyres_image_grid_shape`` and ``unpad_image``): the base tile's N tokens, then the grid's
    tokens row by row over the whole grid, unpadded, each row followed by a newline."""
    vision = hf_config.vision_config
    side = vision.image_size // vision.patch_size
    tokens = side * side
    rows, columns = get_anyres_image_grid_shape((height, width), hf_config.image_grid_pinpoints, vision.image_size)
    numbers = torch.arange(tokens, tokens * (1 + rows * columns)).view(rows, columns, side, side)
    grid = numbers.permute(0, 2, 1, 3).reshape(1, rows * side, columns * side)  # (1, R, C): token (r, c) of the grid
    grid = unpad_image(grid, [height, width])[0]  # (R', C')
    with_newlines = torch.cat([grid, torch.full((grid.shape[0], 1), NEWLINE)], dim=1)  # (R', C' + 1)
    return torch.cat([torch.arange(tokens), with_newlines.flatten()])


def unpadded(options: TrimOptions) -> bool:
    """Whether ``options`` select each tile among the tokens the unpadding leaves (``"tiles": "unpadded"``)."""
    return options.family_options.get("tiles", TILES[0]) == "unpadded"


def tile_keeps(hf_config: Any, height: int, width: int, options: TrimOptions) -> list[int]:
    """Per tile of a ``height`` × ``width`` image (the base view first), the tokens the method keeps of it under
    ``options``: ``keep`` of each tile, or under ``"tiles": "unpadded"`` of the n tokens the unpadding leaves in it
    (``KeepSpec.tokens_within``: ``min(keep, n)``, a fraction of n; 0 of a tile it removes)."""
    tokens = image_tokens(hf_config)
    keep = options.tokens(tokens)  # one vitrim: line where keep is above a tile's tokens
    count = tile_count(hf_config, height, width)
    if not unpadded(options):
        return [keep] * count
    vision = hf_config.vision_config
    cuts = tile_cuts(packed_token_map(hf_config, height, width), count, vision.image_size // vision.patch_size)
    return [options.spec().tokens_within(cut.count) for cut in cuts]


def unpadded_tokens(hf_config: Any, height: int, width: int, options: TrimOptions) -> int:
    """The tokens a ``height`` × ``width`` image hands the LLM under ``"tiles": "unpadded"``, from its size alone:
    :func:`tile_keeps` summed, and every newline."""
    newlines = int((packed_token_map(hf_config, height, width) == NEWLINE).sum())
    return sum(tile_keeps(hf_config, height, width, options)) + newlines


def most_tiles(hf_config: Any) -> int:
    """The most tiles an image has: the base view and the largest pinpoint's grid (the per-tile keeps' width)."""
    size = hf_config.vision_config.image_size
    return 1 + max((int(h) // size) * (int(w) // size) for h, w in hf_config.image_grid_pinpoints)


def entered_tokens(hf_config: Any, height: int, width: int, keep: int) -> int:
    """The tokens a ``height`` × ``width`` image hands the LLM at ``keep`` per tile, known before the tower runs:
    every packed token at keep = N; else ``keep`` per tile the unpadding leaves whole, none of a tile it removes,
    and every newline: the authors' convention (``"tiles": "whole"``; ``"unpadded"``: :func:`unpadded_tokens`).
    ``ValueError`` (one line) where the unpadding cuts through a tile (the count then depends on which tokens the
    method keeps)."""
    token_map = packed_token_map(hf_config, height, width)
    tokens = image_tokens(hf_config)
    if keep == tokens:
        return len(token_map)
    shown = token_map[token_map != NEWLINE]
    tiles = tile_count(hf_config, height, width)
    survivors = torch.bincount(shown // tokens, minlength=tiles)  # (tiles,) each tile's tokens in the LLM input
    cut = int(((survivors > 0) & (survivors < tokens)).sum())
    if cut:
        raise ValueError(
            f"vitrim: a {width}×{height} image's anyres grid is unpadded to its aspect ratio through {cut} of its "
            f"{tiles - 1} tiles, so the tokens it hands the LLM at keep={keep} of {tokens} per tile depend on which "
            "tokens the method keeps, and vLLM lays out the prompt before the tower runs; start the engine with "
            '"tiles": "unpadded" in its "vitrim" entry (each tile selected among the tokens the unpadding leaves), '
            f"send an image whose aspect ratio is a pinpoint's ({hf_config.image_grid_pinpoints}) or keep every token "
            f"(keep={tokens})"
        )
    return keep * int((survivors == tokens).sum()) + int((token_map == NEWLINE).sum())


def llava_next_trim_options(hf_config: Any) -> TrimOptions:
    """The validated ``vitrim`` options of a LLaVA-NeXT config: LLaVA-1.5's on each tile (``keep`` of a tile)."""
    return llava_trim_options(hf_config, ARCHITECTURE)


def trimmed_llava_next_info(ctx: Any) -> LlavaNextProcessingInfo:
    """vLLM's processing info, the options checked first on the untyped config (as :mod:`vitrim.vllm.llava`'s); its
    ``get_num_image_tokens`` stays the unpruned count, the most a request can ask for (profiling, encoder budget)."""
    llava_next_trim_options(ctx.get_hf_config())
    return LlavaNextProcessingInfo(ctx)


class TrimmedLlavaNextProcessor(LlavaPlaceholders, LlavaNextMultiModalProcessor):
    """vLLM's LLaVA-NeXT processor with each image's :func:`entered_tokens` placeholders at its request's ``keep``,
    and that ``keep`` (per tile) handed to the model beside the pixels (:class:`vitrim.vllm.llava.LlavaPlaceholders`).
    """

    architecture = ARCHITECTURE

    def image_placeholders(
        self, hf_config: Any, images: ImageProcessorItems, item: int, keep: int, options: TrimOptions
    ) -> int:
        size = images.get_image_size(item)
        if unpadded(options):
            return unpadded_tokens(hf_config, size.height, size.width, options)
        return entered_tokens(hf_config, size.height, size.width, keep)

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Tensor]:
        """Per image, its :func:`tile_keeps` (zeros after its own tiles, up to :func:`most_tiles`)."""
        sizes = processed.get("image_sizes")
        if processed.get("pixel_values") is None or sizes is None:
            return {}
        config = self.info.get_hf_config()
        keeps = torch.zeros(len(sizes), most_tiles(config), dtype=torch.long)
        for image, (height, width) in enumerate(torch.as_tensor(sizes).tolist()):
            per_tile = tile_keeps(config, int(height), int(width), options)
            keeps[image, : len(per_tile)] = torch.tensor(per_tile)
        return {keep_field("image"): keeps}


@MULTIMODAL_REGISTRY.register_processor(
    TrimmedLlavaNextProcessor, info=trimmed_llava_next_info, dummy_inputs=LlavaDummyInputsBuilder
)
class VitrimLlavaNextForConditionalGeneration(LlavaNextForConditionalGeneration):
    """vLLM's LLaVA-NeXT whose images hand the LLM the tokens a vitrim.vlm method keeps of each tile."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        options = llava_next_trim_options(config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vitrim_tile = image_tokens(config)
        self.vitrim_options = options
        self.vitrim_keep = options.tokens(self.vitrim_tile)
        self.vitrim_record = SelectionRecord()
        self.vitrim_methods: BuiltMethods = {}  # the requests' own option sets' methods (request_keep)
        # no [CLS] row: a packed LLaVA-NeXT image has no place for a tile's [CLS] (vitrim.vlm's cls_to_llm)
        self.vitrim_taps = clip_taps(self.vision_tower, config, options.method, cls_row=False)

    def embed_multimodal(self, **kwargs: object) -> Any:
        image_input = self._parse_and_validate_image_input(**kwargs)
        if image_input is None:
            return []
        if image_input["type"] != "pixel_values":
            raise ValueError(
                "vitrim: trimmed LLaVA-NeXT selects from the tower's evidence; send images, not image_embeds"
            )
        sizes = [(int(h), int(w)) for h, w in torch.as_tensor(image_input["image_sizes"]).tolist()]
        maps = [packed_token_map(self.config, h, w) for h, w in sizes]
        counts = [tile_count(self.config, h, w) for h, w in sizes]
        # the image's own tiles: vLLM may pad a batch's images to the most tiles
        tiles = torch.cat([pixels[:count] for pixels, count in zip(image_input["pixel_values"], counts, strict=True)])
        features = self._image_pixels_to_features(self.vision_tower, tiles)  # (t, N, D) every tile of every image
        assert isinstance(features, Tensor)
        keeps = self.tile_keeps(kwargs, sizes, counts)  # per tile of every image, at its request's keep
        method = self.vitrim_options.method
        # per tile, its image's request's method (the engine's, with the request's own options)
        asked = item_methods(kwargs, "image", method, self.vitrim_methods) or [method] * len(sizes)
        methods = [chosen for chosen, count in zip(asked, counts, strict=True) for _ in range(count)]
        attention = None if self.vitrim_taps is None else self.vitrim_taps.take_attention()
        cls_attention, keys = (None, None) if attention is None else attention
        projected = self.multi_modal_projector(features) if method.scores_projected else None
        if unpadded(self.vitrim_options):  # each tile among the tokens the unpadding leaves: vitrim.vlm's function
            side = self.config.vision_config.image_size // self.config.vision_config.patch_size
            cuts = [cut for m, count in zip(maps, counts, strict=True) for cut in tile_cuts(m, count, side)]

            def each(chosen: Selector, part: VisionEvidence, part_keeps: list[int], items: list[int]) -> Any:
                own_cuts = [cuts[item] for item in items]
                return select_cut_tiles(part, own_cuts, part_keeps, functools.partial(select_keeping_each, chosen))

        else:

            def each(chosen: Selector, part: VisionEvidence, part_keeps: list[int], items: list[int]) -> Any:
                return select_keeping_each(chosen, part, part_keeps)

        hand_on = HandOn(method, lambda evidence, count: select_items(methods, evidence, keeps, each))
        selections, written = hand_on.run(
            features,
            values=features if projected is None else None,
            project=lambda states: states,
            attention=cls_attention,
            keys=keys,
            seeds=image_seeds(tiles),
            projected=projected,
        )
        if projected is None:
            projected = self.multi_modal_projector(features if written is None else written)  # (t, N, E)
        newline = self.image_newline.to(projected.dtype)[None]  # (1, E)
        out = []
        start = 0
        for token_map, count in zip(maps, counts, strict=True):
            image = tiles_to_image(selections[start : start + count], token_map, self.vitrim_tile)
            self.vitrim_record.add(content_seed(tiles[start : start + count]), image.kept)
            rows = torch.cat([projected[start : start + count].flatten(0, 1), newline])  # (count·N + 1, E)
            index = torch.where(token_map == NEWLINE, count * self.vitrim_tile, token_map)  # (T,) rows of the packing
            out.append(rows[index.to(rows.device)[image.kept]])  # (kept, E) in packed order
            start += count
        return tuple(out)

    def tile_keeps(self, kwargs: Mapping[str, object], sizes: list[tuple[int, int]], counts: list[int]) -> list[int]:
        """Per tile of every image (image order), the tokens it keeps: what the processor wrote for the image's
        request (:meth:`TrimmedLlavaNextProcessor.kept_per_item`), else the engine's :func:`tile_keeps`."""
        asked = asked_keeps(kwargs, "image")
        if asked is None:
            return [k for (h, w) in sizes for k in tile_keeps(self.config, h, w, self.vitrim_options)]
        width = len(asked) // len(sizes)  # most_tiles: each image's row
        return [k for image, count in enumerate(counts) for k in asked[image * width : image * width + count]]

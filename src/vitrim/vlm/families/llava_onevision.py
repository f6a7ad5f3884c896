"""LLaVA-OneVision (transformers' ``LlavaOnevisionForConditionalGeneration``): anyres images as LLaVA-NeXT's, and
videos of pooled frames with one newline token.

The model (transformers ≥ 5): ``model.model.vision_tower`` (SigLIP, no [CLS]; ``vision_feature_layer`` −1 and the
"full" strategy in every released checkpoint: all p×p patches, 27×27 at 384 px) → ``multi_modal_projector`` →

- **images** (``pixel_values``, ``image_sizes``, ``batch_num_images``): LLaVA-NeXT's tiles and packing
  (:mod:`vitrim.vlm.families.llava_next`: a base view, a grid of crops unpadded to the picture's aspect ratio with
  one newline token per row; a prompt of several images gets the base view of each and one newline after it).
  Selected per tile as there (``keep=`` per tile of N = p² tokens), mapped onto the packed tokens, newline tokens
  always kept. A grid of more tokens than ``vision_aspect_ratio`` allows ("anyres_max_9": nine tiles' worth) is
  shrunk bilinearly by transformers, so its tokens are no tile's: such an image keeps all its tokens or is refused
  in one line (vitrim does not select in the shrunk grid);
- **videos** (``pixel_values_videos`` (V, F, C, H, W)): every frame runs through the tower alone as an image, then
  the projector, then ``apply_pooling``: a bilinear resize of its p×p grid to h′×w′ = ⌈p/2⌉×⌈p/2⌉ (14×14 = 196
  tokens at 384 px); a video's LLM tokens are its F pooled grids in frame order, then ONE ``image_newline`` token
  after the last frame (``get_video_features``; the processor writes F·h′·w′ + 1 video tokens). That is the video's
  index space in ``last_selection``: ``f·P′ + row·w′ + column`` (P′ = h′·w′), then index F·P′, the newline.

What vitrim does with a video (the Qwen conventions of ``docs/video.md``, where a frame is a temporal patch):

- a **frame** is one sampled frame, its pooled h′×w′ grid (each frame is its own tower run: there is no temporal
  patch). A video method (``reads_time``: ``evs``, ``vidcom2``, ``temporal_downsample``) selects over the video's
  F·P′ pooled tokens, the LLM's own rows: ``evs`` compares a token with the same cell one frame earlier, ``vidcom2``
  budgets per frame, ``temporal_downsample`` keeps every stride-th frame; images in the prompt keep every token.
  ``flashvid`` runs in its authors' LLaVA-OneVision form: on the pooled frames, scored by the attention each pooled
  token receives at the tower's last layer (:func:`video_attention`). ``fastvid`` runs in its authors' OneVision
  form: each frame's feature layer through SigLIP's attention-pooling head, which LLaVA-OneVision checkpoints lack
  (``vision_use_head`` False) and ``fastvid`` loads from its ``siglip=`` (:mod:`vitrim.vlm.method.fastvid_onevision`);
- an image method selects on each frame as on an image (``keep=`` per frame, counted among its P′ pooled tokens;
  the frames' seeds from their own pixels), with evidence on the pooled grid: the attention each patch receives at
  the tower's scoring layer (the layer that makes the feature layer; SigLIP has no [CLS], so the received
  attention stands for [CLS]'s row, as on Gemma 3) and its keys, resized by the same bilinear interpolation
  (:func:`~vitrim.vlm.evidence.pooled.resize_to_tokens`); its features are the pooled tokens themselves (the
  projector runs before the pooling), so a merged token is the mean of its group's pooled tokens, written as it is;
- the newline token is always kept and is never a frame's token: not counted by ``keep=``, not scored, not in a
  video method's count (whose rate is of the F·P′ frame tokens);
- the LLM has 1-D positions: a shortened prefill is just shorter (``positions="authors"``, the default: the kept
  tokens numbered contiguously; ``"original"``: each at its unpruned position, a drop equal to masking its key).

Where it taps (the capture → select → write sequence is :mod:`vitrim.vlm.stages.capture`'s; the prefill, the
shortened LLM input and decoding are the pre-LLM stage's): the tower's pixels (seeds) and its scoring layer's
attention input; the projector's input for image tiles (LLaVA's seam; skipped while a video is encoded); the output
of the model's own ``get_video_features`` (an instance attribute wraps it while installed; ``generate()`` encodes
before its first forward through the same attribute).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.evidence.pooled import resize_to_tokens
from vitrim.vlm.families.gemma3 import read_received_attention
from vitrim.vlm.families.llava import ProjectorSelection
from vitrim.vlm.families.llava_next import NEWLINE, LlavaNextAdapter, tiles_to_image
from vitrim.vlm.method.base import ImageSelection
from vitrim.vlm.stages.capture import EncoderSeam, keep_all
from vitrim.vlm.stages.contract import FamilyTraits, Prefill
from vitrim.vlm.stages.inputs import input_ids_of
from vitrim.vlm.stages.spans import ImageSpans, media_in_reading_order, media_spans

MODALITIES = (("image", "pixel_values", 1), ("video", "pixel_values_videos", 3))  # name, pixels, forward position


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """The seams of one ``LlavaOnevisionForConditionalGeneration`` instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=("LlavaOnevisionForConditionalGeneration",),
        title="LLaVA-OneVision (LlavaOnevisionForConditionalGeneration)",
        stages=("pre_llm", "in_llm"),
        video=True,
    )
    cls_to_llm = False  # SigLIP has no [CLS]

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.batch_num_images: Tensor | None = None  # of the last get_image_features call
        self.encoding_video = False  # while the model's get_video_features runs (the projector hooks stand aside)
        self.chosen: dict[str, list[ImageSelection]] = {}  # per modality, the last encoder run's selections
        self.video_counts: list[int] = []  # LLM tokens per video of the last video run (F·P′ + 1)

    def tile_tokens(self) -> int:
        """Tokens of one tile (and of one frame) entering the projector: SigLIP's p² patches ("full")."""
        vision = self.config.vision_config
        return int((vision.image_size // vision.patch_size) ** 2)

    def pooled_grid(self) -> tuple[int, int]:
        """(h′, w′): a video frame's pooled token grid, ⌈p/2⌉ × ⌈p/2⌉ (``apply_pooling``)."""
        vision = self.config.vision_config
        side = math.ceil(vision.image_size // vision.patch_size / 2)
        return side, side

    # images: LLaVA-NeXT's tiles, with OneVision's multi-image rule and its shrinking of large grids

    def tiles_of(self, image_sizes: Tensor, batch_num_images: Tensor | None = None) -> list[int]:
        """Tiles per image: the anyres count, or one (the base view) for the images of a prompt of several."""
        patched = super().tiles_of(image_sizes)
        if batch_num_images is None:
            return patched
        several = [int(n) > 1 for n in batch_num_images.tolist() for _ in range(int(n))]
        return [1 if many else count for count, many in zip(patched, several, strict=True)]

    def packed_numbers(self, image_sizes: Tensor, batch_num_images: Tensor | None = None) -> list[Tensor]:
        """Per image (T_i,) float64: transformers' own packing of the tile token numbers ``tile · N + token`` (NEWLINE
        at the newline tokens); a value that is not a whole number is a bilinear mix of tokens (a shrunk grid)."""
        tiles = self.tiles_of(image_sizes, batch_num_images)
        tokens = self.tile_tokens()
        numbers = [torch.arange(count * tokens, dtype=torch.float64).view(count, tokens, 1) for count in tiles]
        newline = torch.tensor([float(NEWLINE)], dtype=torch.float64)
        packed, _ = self.inner.pack_image_features(
            numbers, image_sizes.cpu(), image_newline=newline, vision_aspect_ratio=self.config.vision_aspect_ratio
        )
        return [image[:, 0] for image in packed]

    def token_maps(self, image_sizes: Tensor, batch_num_images: Tensor | None = None) -> list[Tensor]:
        """Per image (T_i,) long: the tile token each LLM token shows, or NEWLINE (``ValueError`` for a shrunk grid,
        whose tokens are no tile's)."""
        maps = []
        for size, numbers in zip(image_sizes.tolist(), self.packed_numbers(image_sizes, batch_num_images), strict=True):
            if not torch.equal(numbers, numbers.round()):
                raise ValueError(shrunk_grid(size, self.config.vision_aspect_ratio))
            maps.append(numbers.long())
        return maps

    def note_image_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Remember ``image_sizes`` and ``batch_num_images`` of a ``get_image_features`` call (generate() hands them
        to it, not to the forward)."""
        super().note_image_call(args, kwargs)
        counts = kwargs.get("batch_num_images", args[5] if len(args) > 5 else None)
        self.batch_num_images = None if counts is None else torch.as_tensor(counts)

    def watch_spans(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        """The in-LLM stage's spans: the images' packed tokens and each video's F·P′ + 1 tokens (its newline token
        among them, as an image's newline tokens are among its packed tokens), in reading order."""
        undo_sizes = self.see_image_sizes()

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            prefill = self.prefill_of(args, kwargs, forget=False)
            if prefill is None:
                return
            extras = prefill.extras
            images = []
            if "image" in extras["modalities"]:
                numbers = self.packed_numbers(extras["image_sizes"], extras["batch_num_images"])
                images = [len(packed) for packed in numbers]
            counts = {
                int(self.config.image_token_id): images,
                int(self.config.video_token_id): self.video_token_counts(args, kwargs),
            }
            on_prefill(media_spans(prefill.input_ids, counts))

        handle = self.inner.register_forward_pre_hook(hook, with_kwargs=True)

        def remove() -> None:
            handle.remove()
            undo_sizes()

        return remove

    def video_token_counts(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
        """LLM tokens of each video of a forward (F·P′ + 1), from its pixels (V, F, C, H, W) or, under
        ``generate()``, from ``mm_encoder_outputs["video"]`` (``pooler_output`` (V, F·P′ + 1, E)); [] without."""
        _, key, at = MODALITIES[1]
        pixels = kwargs.get(key, args[at] if len(args) > at else None)
        if pixels is not None:
            rows, columns = self.pooled_grid()
            return [int(pixels.shape[1]) * rows * columns + 1] * int(pixels.shape[0])
        encoded = (kwargs.get("mm_encoder_outputs") or {}).get("video")
        return [] if encoded is None else [int(video.shape[0]) for video in encoded.pooler_output]

    # the pre-LLM stage's seams

    def prefill_of(self, args: tuple[Any, ...], kwargs: dict[str, Any], forget: bool = True) -> Prefill | None:
        """The prefill of a forward with images or videos (as pixels or as ``mm_encoder_outputs``); ``forget``: drop
        the selections of an earlier run of each modality whose pixels this forward encodes anew."""
        encoded = kwargs.get("mm_encoder_outputs") or {}
        pixels = {name: kwargs.get(key, args[at] if len(args) > at else None) for name, key, at in MODALITIES}
        modalities = tuple(name for name, _, _ in MODALITIES if pixels[name] is not None or name in encoded)
        if not modalities:
            return None
        input_ids = input_ids_of(args, kwargs)
        extras: dict[str, Any] = {"modalities": modalities}
        if "image" in modalities:
            sizes = kwargs.get("image_sizes", args[2] if len(args) > 2 else None)
            counts = kwargs.get("batch_num_images")
            if pixels["image"] is None:  # encoded before this forward (generate()): what that call was given
                sizes = sizes if sizes is not None else self.image_sizes
                counts = counts if counts is not None else self.batch_num_images
            if sizes is None:
                raise ValueError("vitrim.vlm needs the image_sizes of a LLaVA-OneVision prefill with images")
            extras["image_sizes"] = torch.as_tensor(sizes)
            extras["batch_num_images"] = None if counts is None else torch.as_tensor(counts)
        if forget:
            for name in modalities:
                if pixels[name] is not None:
                    self.chosen.pop(name, None)
        media = (input_ids == self.config.image_token_id) | (input_ids == self.config.video_token_id)
        runs_tower = any(value is not None for value in pixels.values())
        return Prefill(input_ids, kwargs.get("attention_mask"), runs_tower, extras, media)

    def select_hooks(self, stage: EncoderSeam) -> list[Callable[[], None]]:
        method = stage.method
        if method.needs_cls_attention and self.scoring_layer() is None:
            raise ValueError(
                f"vlm method {method.name!r} scores by the attention at one tower layer; this model has "
                f"vision_feature_layer={self.config.vision_feature_layer!r} (expected one int layer, not 0)"
            )
        stage.keep_of(self.tile_tokens())  # keep counts per tile or frame: checked against a tile's tokens
        selection = OnevisionSelection(self, stage)
        return [*selection.hooks(), self.see_image_sizes(), self.watch_videos(selection)]

    def watch_videos(self, selection: OnevisionSelection) -> Callable[[], None]:
        """Wrap the model's ``get_video_features`` (an instance attribute, its class untouched): the projector hooks
        stand aside while it runs, then ``selection`` selects on its pooled output; returns the undo."""
        inner = self.inner
        original = inner.get_video_features

        @functools.wraps(original)  # its signature: generate() reads which inputs it takes
        def get_video_features(*args: Any, **kwargs: Any) -> Any:
            pixels: Tensor = kwargs["pixel_values_videos"] if "pixel_values_videos" in kwargs else args[0]
            if selection.stage.method.reads_instruction():
                raise ValueError(
                    f"vlm method {selection.stage.method.name!r} reads the prompt; on LLaVA-OneVision vitrim.vlm runs "
                    "it on images only (a video's newline token would be one of its candidates)"
                )
            self.encoding_video = True
            try:
                output = original(*args, **kwargs)
            finally:
                self.encoding_video = False
            if not hasattr(output, "pooler_output"):
                return output  # return_dict=False: a caller's own look at the features, not a forward's
            return selection.on_videos(pixels, output)

        inner.get_video_features = get_video_features

        def undo() -> None:
            if inner.__dict__.get("get_video_features") is get_video_features:
                del inner.get_video_features

        return undo

    def image_tokens(
        self, prefill: Prefill, selections: list[ImageSelection]
    ) -> tuple[list[ImageSelection], list[int]]:
        """The selections and LLM token counts of the prompt's images and videos in reading order (the tower encodes
        all images, then all videos; ``selections`` is the last run's, so each modality's are read from
        :attr:`chosen`)."""
        modalities = prefill.extras["modalities"]
        for modality in modalities:
            if modality not in self.chosen:
                raise ValueError(f"vitrim.vlm saw no {modality} of this prompt encoded after vitrim.vlm.apply")
        images, image_counts = self.packed_images(prefill) if "image" in modalities else ([], [])
        videos, video_counts = (self.chosen["video"], self.video_counts) if "video" in modalities else ([], [])
        records = {
            int(self.config.image_token_id): ("image", images, image_counts),
            int(self.config.video_token_id): ("video", videos, video_counts),
        }
        assert prefill.media is not None
        return media_in_reading_order(prefill.input_ids, prefill.media, records)

    def packed_images(self, prefill: Prefill) -> tuple[list[ImageSelection], list[int]]:
        """The images' selections over their packed tokens (from their tiles') and their LLM token counts."""
        sizes, several = prefill.extras["image_sizes"], prefill.extras["batch_num_images"]
        tiles = self.tiles_of(sizes, several)
        chosen = self.chosen["image"]
        if sum(tiles) != len(chosen):
            raise ValueError(f"the images have {sum(tiles)} tiles but vitrim.vlm selected tokens for {len(chosen)}")
        tokens = self.tile_tokens()
        images, counts = [], []
        start = 0
        for size, count, numbers in zip(sizes.tolist(), tiles, self.packed_numbers(sizes, several), strict=True):
            own = chosen[start : start + count]
            start += count
            counts.append(len(numbers))
            if torch.equal(numbers, numbers.round()):
                images.append(tiles_to_image(own, numbers.long(), tokens))
            elif all(len(tile.kept) == tokens and tile.merged is None for tile in own):
                images.append(keep_all(len(numbers), own[0].kept.device))  # a shrunk grid, every token kept
            else:
                raise ValueError(shrunk_grid(size, self.config.vision_aspect_ratio))
        return images, counts


class OnevisionSelection(ProjectorSelection):
    """Where LLaVA-OneVision hands on its tokens: the projector's input for image tiles (LLaVA's seam, merged tokens
    through the projector; standing aside while a video is encoded), the pooled output of ``get_video_features``
    for video frames (:meth:`on_videos`); the taps on the tower serve both (the tower runs once per modality), its
    scoring layer read for the attention each patch receives (SigLIP has no [CLS])."""

    adapter: LlavaOnevisionAdapter

    def __init__(self, adapter: LlavaOnevisionAdapter, stage: EncoderSeam) -> None:
        super().__init__(  # per patch, from the layer's own q/k projections' outputs (ScoringTap)
            adapter, stage, reader=functools.partial(read_received_attention, 1), projections=("q_proj", "k_proj")
        )

    def report(self, selections: list[ImageSelection], modality: str = "image") -> None:
        """Keep the run's selections by modality (:meth:`LlavaOnevisionAdapter.image_tokens` reads both) and hand
        them to the pre-LLM stage."""
        self.adapter.chosen[modality] = selections
        super().report(selections)

    def on_projector(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.adapter.encoding_video:
            return None  # the frames select after the pooling (on_videos)
        if self.stage.method.reads_time:  # a video method leaves images whole
            tiles, tokens = args[0].shape[:2]
            self.report([keep_all(tokens, args[0].device) for _ in range(tiles)])
            return None
        return super().on_projector(module, args)

    def on_videos(self, pixels: Tensor, output: Any) -> Any:
        """Select on the pooled video tokens of ``get_video_features``' ``output`` (``pooler_output`` (V, F·P′ + 1, E))
        for the videos ``pixels`` (V, F, C, H, W); returns ``output``, its merged slots written."""
        tokens: Tensor = output.pooler_output
        videos, frames = pixels.shape[:2]
        rows, columns = self.adapter.pooled_grid()
        per_frame = rows * columns
        method = self.stage.method
        attention = self.taps.take_attention()  # per frame, per patch (V·F, H, p²) and (V·F, H, p², hd)
        seeds = self.taps.seeds
        frame_tokens = tokens[:, : frames * per_frame]  # (V, F·P′, E) the newline stays out
        with torch.no_grad():
            received, keys = (None, None) if attention is None else attention
            received = None if received is None else resize_to_tokens(received.transpose(1, 2), rows, columns)
            keys = None if keys is None else resize_to_tokens(keys.transpose(1, 2), rows, columns)
        identity: Callable[[Tensor], Tensor] = lambda states: states  # noqa: E731 (pooled tokens are the LLM's)
        if method.reads_time:  # one video at a time, over its time axis
            chosen, pieces, wrote = [], [], False
            per_head = None if received is None else received.transpose(1, 2)  # (V·F, H, P′)
            states = self.feature_states(output) if method.needs_query_attention else None  # FastVID's head reads
            for video in range(videos):
                own = frame_tokens[video : video + 1]  # (1, F·P′, E)
                picked, written = self.stage.hand_on.run(
                    own,
                    values=own,
                    project=identity,
                    projected=own,
                    grid=(rows, columns),
                    seeds=None,
                    attention=None if per_head is None else video_attention(per_head, video, frames),
                    frame_states=None if states is None else states[video * frames : (video + 1) * frames],
                )
                chosen.append(with_newline(picked[0], frames * per_frame))
                pieces.append(own if written is None else written)
                wrote |= written is not None
            written_all = torch.cat(pieces) if wrote else None
        else:  # an image method: every frame as an image, all frames of the call at once
            flat = frame_tokens.reshape(videos * frames, per_frame, -1)  # (V·F, P′, E)
            picked, written = self.stage.hand_on.run(
                flat,
                values=flat,
                project=identity,
                projected=flat,
                grid=(rows, columns),
                attention=None if received is None else received.transpose(1, 2),  # (V·F, H, P′)
                keys=None if keys is None else keys.transpose(1, 2),  # (V·F, H, P′, hd)
                seeds=seeds,
            )
            chosen = [
                with_newline(
                    stitch_frames(picked[video * frames : (video + 1) * frames], per_frame), frames * per_frame
                )
                for video in range(videos)
            ]
            written_all = None if written is None else written.reshape(videos, frames * per_frame, -1)
        self.adapter.video_counts = [frames * per_frame + 1] * videos
        self.report(chosen, "video")
        if written_all is not None:
            output.pooler_output = torch.cat([written_all.to(tokens.dtype), tokens[:, frames * per_frame :]], 1)
        return output

    def feature_states(self, output: Any) -> Tensor:
        """(V·F, p², D) every frame's feature layer (``hidden_states[vision_feature_layer]``, "full": all patches)
        from ``get_video_features``' ``output``, what FastVID's OneVision form reads through SigLIP's head."""
        layer = self.adapter.config.vision_feature_layer
        hidden = getattr(output, "hidden_states", None)
        if hidden is None or not isinstance(layer, int):
            raise ValueError(
                f"fastvid reads each frame's feature layer through SigLIP's head; this model gave no hidden states "
                f"or has vision_feature_layer={layer!r} (expected one int layer)"
            )
        return hidden[layer]


def video_attention(per_frame: Tensor, video: int, frames: int) -> Tensor:
    """(1, H, F·P′): video ``video``'s pooled received attention in its raster order (frame, row, column), from
    every frame's of the call ``per_frame`` (V·F, H, P′); what a video method reading the tower's attention takes
    (FlashVID: the attention each pooled token receives at the tower's last layer)."""
    own = per_frame[video * frames : (video + 1) * frames]  # (F, H, P′)
    return own.transpose(0, 1).reshape(1, own.shape[1], -1)


def stitch_frames(frames: list[ImageSelection], per_frame: int) -> ImageSelection:
    """The selections of a video's frames (each over its ``per_frame`` tokens) as one over the video's raster index
    space (frame f's token j is f·per_frame + j), each frame's authors' order kept, frame after frame."""
    kept: list[Tensor] = []
    groups: list[Tensor] = []
    orders: list[Tensor] = []
    count = 0
    for frame, selection in enumerate(frames):
        offset = frame * per_frame
        order = torch.arange(len(selection.kept)) if selection.order is None else selection.order.cpu()
        orders.append(order + count)
        kept.append(selection.kept + offset)
        groups += [group + offset for group in selection.groups]
        count += len(selection.kept)
    ordered = any(selection.order is not None for selection in frames)
    device = frames[0].kept.device
    return ImageSelection(
        kept=torch.cat(kept), groups=tuple(groups), order=torch.cat(orders).to(device) if ordered else None
    )


def with_newline(selection: ImageSelection, newline: int) -> ImageSelection:
    """``selection`` over a video's frame tokens, with the video's newline token (index ``newline``, after them)
    kept as its own slot, last in the authors' order."""
    token = selection.kept.new_tensor([newline])
    order = None
    if selection.order is not None:
        order = torch.cat([selection.order, selection.order.new_tensor([len(selection.kept)])])
    return ImageSelection(kept=torch.cat([selection.kept, token]), groups=(*selection.groups, token), order=order)


def shrunk_grid(size: list[int], aspect_ratio: str) -> str:
    """Why an image whose tile grid transformers shrinks cannot be reduced."""
    return (
        f"LLaVA-OneVision shrinks the tile grid of an image of image_sizes {size} bilinearly (vision_aspect_ratio="
        f"{aspect_ratio!r}), so its tokens are no tile's and vitrim.vlm, which selects per tile, cannot reduce it; "
        "pass a smaller image or keep every token"
    )

"""The encoder seam, written once for every transformers family and every vLLM class: capture → select → write.

Where a VLM makes its image tokens, three things happen for every tower run, in every engine:

1. **capture**: taps on the tower record what the selector reads, and only that (:class:`Taps`): each image's seed
   from its pixels (the seeded methods), the scoring attention layer's evidence computed from the layer's own
   queries and keys on its input (:class:`ScoringTap`), the feature layer's [CLS] row (VisionZip's [CLS]);
2. **select**: :meth:`HandOn.select` builds the :class:`~vitrim.vlm.method.base.VisionEvidence` from what was
   captured (:meth:`HandOn.evidence`) and runs the selection (a keep of every token keeps them unchanged);
3. **write**: merged tokens are written into their slots where the projector reads them, [CLS] into its carrier
   slot (:func:`write_merged`), so every slot the LLM sees went through the family's own projector.

What an engine or a family supplies is only *where*: which module is the scoring attention and how its q/k come
out of its weights (a ``read`` function: transformers' ``q_proj``/``k_proj``, vLLM's fused ``qkv`` and its rotary
op), which layer gives the [CLS] row, where the features are read and the merged ones written back. The maths from
q/k on is :mod:`vitrim.vlm.evidence`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from vitrim.vlm.evidence.merged_tokens import ImageEvidence
from vitrim.vlm.evidence.seeds import image_seeds
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import ImageSelection, Selector, VisionEvidence

# A reader: (the scoring attention module, its forward's args, kwargs[, its q/k projections' outputs]) -> the
# evidence it gives (engine-specific q/k, then vitrim.vlm.evidence's maths). Runs under no_grad in the module's
# forward pre-hook (or, given projections, in the last one's forward hook: ScoringTap).
Reader = Callable[..., Any]
# What taps a scoring layer: (the attention module, its reader, then the projections whose outputs the reader takes)
Scoring = tuple[Any, ...]


class ScoringTap:
    """A forward pre-hook on a tower's scoring attention: ``read`` on the layer's input, kept for the run in flight.

    With ``projections`` (the layer's own submodules that make its q/k from that input: Qwen's fused ``qkv``,
    SigLIP's ``q_proj`` and ``k_proj``), the pre-hook only keeps the layer's arguments, and ``read`` runs once every
    projection has run in that forward, given their outputs as further arguments, in their order: the reader takes
    the q/k the layer itself computed instead of computing them again (the same modules on the same input: the same
    values, at none of the projections' cost).

    ``read`` is an instance attribute, so a stopwatch can wrap it (``vitrim bench vlm`` times the evidence work)."""

    def __init__(self, attention: nn.Module, read: Reader, *projections: nn.Module) -> None:
        self.read = read
        self.found: Any = None
        self.projections = len(projections)
        self.arguments: tuple[nn.Module, tuple[Any, ...], dict[str, Any]] | None = None  # until the projections run
        self.outputs: dict[int, Tensor] = {}
        self.handles = [attention.register_forward_pre_hook(self.on_input, with_kwargs=True)]
        for index, projection in enumerate(projections):
            self.handles.append(projection.register_forward_hook(functools.partial(self.on_projection, index)))

    def on_input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.projections:
            self.arguments, self.outputs = (module, args, kwargs), {}
            return
        with torch.no_grad():
            self.found = self.read(module, args, kwargs)

    def on_projection(self, index: int, projection: nn.Module, inputs: tuple[Any, ...], output: Tensor) -> None:
        if self.arguments is None:  # a projection called outside the layer's forward: not the layer's q/k
            return
        self.outputs[index] = output
        if len(self.outputs) < self.projections:
            return
        (module, args, kwargs), self.arguments = self.arguments, None
        outputs = [self.outputs.pop(number) for number in range(self.projections)]
        with torch.no_grad():
            self.found = self.read(module, args, kwargs, *outputs)

    def take(self) -> Any:
        """The last run's evidence (None when the layer did not run since the last take); forgets it."""
        found, self.found = self.found, None
        return found


class Taps:
    """The capture taps of one selector on one tower: those its flags ask for, nothing else.

    tower: the module whose first argument (or ``pixel_values``) is the pixels, one row per image: each image's
    seed (for a selector that ``needs_seeds``); scoring: (the scoring attention module, its reader), for a selector
    that ``needs_cls_attention`` (further items, the layer's q/k projections, have the reader take their outputs:
    :class:`ScoringTap`); cls_layer: the layer whose output's first row is the feature layer's [CLS], for a
    selector that ``uses_cls_token`` (where the family can hand a [CLS] to the LLM).
    """

    def __init__(
        self,
        selector: Selector,
        *,
        tower: nn.Module | None = None,
        scoring: Scoring | None = None,
        cls_layer: nn.Module | None = None,
        probe: Scoring | None = None,
    ) -> None:
        self.seeds: Tensor | None = None
        self.cls_row: Tensor | None = None
        self.scoring: ScoringTap | None = None
        self.probe: ScoringTap | None = None  # a second scoring block (HiPrune's object block), same reader contract
        self.handles: list[Any] = []
        if selector.needs_seeds and tower is not None:
            self.handles.append(tower.register_forward_pre_hook(self.on_tower, with_kwargs=True))
        if selector.needs_cls_attention and scoring is not None:
            self.scoring = ScoringTap(*scoring)
            self.handles += self.scoring.handles
        if selector.needs_cls_attention and probe is not None:
            self.probe = ScoringTap(*probe)
            self.handles += self.probe.handles
        if selector.uses_cls_token and cls_layer is not None:
            self.handles.append(cls_layer.register_forward_hook(self.on_feature_layer))

    def on_tower(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.seeds = image_seeds(kwargs["pixel_values"] if "pixel_values" in kwargs else args[0])

    def on_feature_layer(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (I, 1 + N, D), [CLS] first
        self.cls_row = hidden[:, 0]

    def take_attention(self) -> Any:
        """The scoring layer's evidence of the last run (None when no scoring tap is installed); forgets it."""
        return None if self.scoring is None else self.scoring.take()

    def take_probe(self) -> Any:
        """The second scoring block's evidence of the last run (None when no probe is installed); forgets it."""
        return None if self.probe is None else self.probe.take()

    def take_cls_row(self) -> Tensor | None:
        """(I, D) the feature layer's [CLS] rows of the last run (None when not tapped); forgets them."""
        row, self.cls_row = self.cls_row, None
        return row

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class EncoderSeam(Protocol):
    """What the pre-LLM stage hands a family's ``select_hooks`` (``vitrim.vlm.stages.pre_llm.PreLLMStage`` is one):
    the selector whose flags say what to tap, the :class:`HandOn` to run where the tokens are made, the list its
    :class:`Taps` join (a stopwatch times their evidence), ``keep_of`` (tokens an image of N keeps), ``keep`` (the
    ``keep=`` it resolves; None where the selector decides), ``family_options`` (the family's own options given to
    ``apply``, e.g. LLaVA-NeXT's ``tiles``) and ``selected`` (every encoded image's selection, reported once per
    tower run)."""

    @property
    def method(self) -> Selector: ...

    @property
    def hand_on(self) -> HandOn: ...

    @property
    def taps(self) -> list[Taps]: ...

    def keep_of(self, num_tokens: int) -> int: ...

    @property
    def keep(self) -> KeepSpec | None: ...

    @property
    def family_options(self) -> Mapping[str, str]: ...

    def selected(self, selections: list[ImageSelection]) -> None: ...


def keep_all(num_tokens: int, device: torch.device) -> ImageSelection:
    """The selection of an image that keeps its ``num_tokens`` tokens, each its own group (nothing merged)."""
    return ImageSelection.unmerged(torch.arange(num_tokens, device=device))


class HandOn:
    """One selector's select → write on the tokens of one tower run (its :class:`Taps` captured the evidence).

    choose: ``(evidence, N) -> one ImageSelection per image`` (the pre-LLM stage's ``select``, or an engine's
    :func:`select_keeping` at its keep).
    """

    def __init__(self, selector: Selector, choose: Callable[[VisionEvidence, int], list[ImageSelection]]) -> None:
        self.selector = selector
        self.choose = choose

    def run(
        self,
        features: Tensor,
        *,
        values: Tensor | None = None,
        project: Callable[[Tensor], Tensor] | None = None,
        attention: Tensor | None = None,
        keys: Tensor | None = None,
        seeds: Tensor | None = None,
        projected: Tensor | None = None,
        grid: tuple[int, int] | None = None,
        cls_feature: Tensor | None = None,
        object_attention: Tensor | None = None,
        query_attention: Tensor | None = None,
        frame_states: Tensor | None = None,
    ) -> tuple[list[ImageSelection], Tensor | None]:
        """Select among the N tokens of each of the I images of one run, then write the merged ones.

        features: (I, N, D) what the projector reads (the evidence's ``features``); the keyword arguments are the
        rest of :class:`VisionEvidence` (``attention``: its ``cls_attention``), passed on only where the selector
        reads them. values: (I, N, …) where the merged tokens and the [CLS] are written, each merged one through
        ``project`` (None: nothing is written, a selector that scores the projector's output cannot merge).
        Returns the selections and the written copy of ``values`` (None when nothing was written).
        """
        needs = self.selector
        read = attention  # what the selector's score reads: FastVID the mean query's, or its own head's states
        if needs.needs_query_attention:
            read = query_attention if frame_states is None else frame_states
        if needs.needs_cls_attention and read is None:
            raise ValueError("vitrim.vlm saw no input of the tower's scoring layer in this forward pass")
        evidence = VisionEvidence(
            features=features,
            cls_attention=attention if needs.needs_cls_attention else None,
            keys=keys if needs.needs_cls_attention else None,
            seeds=seeds,
            projected=projected,
            grid=grid,
            cls_feature=cls_feature if needs.uses_cls_token else None,
            object_attention=object_attention if needs.needs_cls_attention else None,
            query_attention=query_attention if needs.needs_cls_attention else None,
            frame_states=frame_states if needs.needs_query_attention else None,
        )
        selections = self.choose(evidence, features.shape[1])
        if values is None or project is None:
            return selections, None
        return selections, write_merged(values, selections, project, evidence.cls_feature)

    def run_media(
        self,
        item: ImageEvidence,
        own: Tensor,
        pixels: Tensor,
        project: Callable[[Tensor], Tensor],
        *,
        video: bool,
        probed: ImageEvidence | None = None,
    ) -> tuple[ImageSelection, Tensor | None]:
        """One Qwen image's or video's selection and its tokens with merged slots written (None: nothing written),
        the same in every engine: a video method (``reads_time``) selects over a whole video and leaves an image
        whole; an image method selects on each temporal patch as on an image (an image has one).

        item: the image's or video's evidence (N merged tokens, raster order); own: (N, E) its merger output;
        pixels: its rows of the tower input (each temporal patch's seed comes from its own rows); probed: its
        evidence at a second block, for a method that reads one (HiPrune's object layer)."""
        count = item.features.shape[0]
        if self.selector.reads_time and not video:
            return keep_all(count, own.device), None
        if self.selector.reads_time:
            return self.run_item(item, own, pixels, project, probed)
        frames = count // (item.grid[0] * item.grid[1])
        return self.per_temporal_patch(item, own, pixels, frames, project, probed)

    def run_item(
        self,
        item: ImageEvidence,
        own: Tensor,
        pixels: Tensor,
        project: Callable[[Tensor], Tensor],
        probed: ImageEvidence | None = None,
    ) -> tuple[ImageSelection, Tensor | None]:
        """:meth:`run` on one item (an image, a temporal patch, or a whole video for a video method) of Qwen's
        :class:`ImageEvidence`; own: (N, E) its merger output, also what a merge writes into."""
        chosen, written = self.run(
            item.features[None],
            values=own[None],
            project=project,
            attention=None if item.received is None else item.received[None],
            keys=None if item.keys is None else item.keys[None],
            seeds=image_seeds([pixels]) if self.selector.needs_seeds else None,  # hashing costs a tower block
            projected=own[None],
            grid=item.grid,
            object_attention=None if probed is None or probed.received is None else probed.received[None],
            query_attention=None if item.query_attention is None else item.query_attention[None],
        )
        return chosen[0], None if written is None else written[0]

    def per_temporal_patch(
        self,
        item: ImageEvidence,
        own: Tensor,
        pixels: Tensor,
        frames: int,
        project: Callable[[Tensor], Tensor],
        probed: ImageEvidence | None = None,
    ) -> tuple[ImageSelection, Tensor | None]:
        """An image method on each of a video's ``frames`` temporal patches as an image, stitched into one selection
        in the video's raster index space. Each temporal patch is its own attention segment in the tower, so its
        received attention (a share of the video's queries) times ``frames`` is the mean over its own queries."""
        if frames == 1:
            return self.run_item(item, own, pixels, project, probed)
        per_frame = own.shape[0] // frames
        kept: list[Tensor] = []
        groups: list[Tensor] = []
        orders: list[Tensor] = []
        written: list[Tensor | None] = []
        for frame, frame_pixels in enumerate(pixels.chunk(frames)):
            cut = slice(frame * per_frame, (frame + 1) * per_frame)
            frame_item, frame_probed = (
                None
                if whole is None
                else ImageEvidence(
                    features=whole.features[cut],
                    received=None if whole.received is None else whole.received[:, cut] * frames,
                    keys=None if whole.keys is None else whole.keys[:, cut],
                    grid=whole.grid,
                    query_attention=None if whole.query_attention is None else whole.query_attention[:, cut],
                )
                for whole in (item, probed)
            )
            assert frame_item is not None
            chosen, frame_written = self.run_item(frame_item, own[cut], frame_pixels, project, frame_probed)
            offset = frame * per_frame
            order = torch.arange(len(chosen.kept)) if chosen.order is None else chosen.order.cpu()
            orders.append(order + sum(len(k) for k in kept))
            kept.append(chosen.kept + offset)
            groups += [group + offset for group in chosen.groups]
            written.append(frame_written)
        stitched = ImageSelection(kept=torch.cat(kept), groups=tuple(groups), order=torch.cat(orders).to(own.device))
        if all(w is None for w in written):
            return stitched, None
        return stitched, torch.cat(
            [own[i * per_frame : (i + 1) * per_frame] if w is None else w for i, w in enumerate(written)]
        )


def select_keeping(selector: Selector, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
    """``keep`` tokens per image by ``selector``; at keep = N every token stays, each its own slot, as the
    unmodified model has them (no selection runs)."""
    num_tokens = evidence.features.shape[1]
    if keep == num_tokens:
        return [keep_all(num_tokens, evidence.features.device) for _ in range(evidence.features.shape[0])]
    return selector.select(evidence, keep)


def select_keeping_each(selector: Selector, evidence: VisionEvidence, keeps: list[int]) -> list[ImageSelection]:
    """Image i keeps ``keeps[i]`` tokens (an engine whose requests each ask their own ``keep``): one selection over
    the run where every image asks the same, else image by image on its own rows of the evidence (every method
    selects each image alone, so a batch selects what each image would alone)."""
    if len(set(keeps)) == 1:
        return select_keeping(selector, evidence, keeps[0])
    selections = []
    for image, keep in enumerate(keeps):
        selections += select_keeping(selector, one_image(evidence, image), keep)
    return selections


def one_image(evidence: VisionEvidence, image: int) -> VisionEvidence:
    """The evidence of image ``image`` alone (I = 1): its rows of every tensor field."""
    return images_of(evidence, torch.tensor([image]))


def images_of(evidence: VisionEvidence, images: Tensor) -> VisionEvidence:
    """The evidence of the images ``images`` (r,) long, in that order: their rows of every tensor field."""
    rows: dict[str, Any] = {
        field.name: value.index_select(0, images.to(value.device))
        for field in dataclasses.fields(evidence)
        if isinstance(value := getattr(evidence, field.name), Tensor)
    }
    return dataclasses.replace(evidence, **rows)


# the axis of each VisionEvidence field that runs over an image's N tokens (crop_tokens cuts it); the fields of
# WHOLE_IMAGE_FIELDS say something about the whole image (its seed, its prompt, its [CLS]) and stay as they are
TOKEN_AXES = {"features": 1, "cls_attention": 2, "keys": 2, "projected": 1, "object_attention": 2, "query_attention": 2}
WHOLE_IMAGE_FIELDS = frozenset({"seeds", "instruction", "cls_feature", "question"})


def crop_tokens(evidence: VisionEvidence, positions: Tensor, grid: tuple[int, int]) -> VisionEvidence:
    """The evidence of the same I images restricted to the tokens at ``positions`` (n,) long, sorted raster indices
    of a ``grid`` = (rows, columns) block of each image's grid (rows · columns = n): every per-token field cut along
    its token axis (:data:`TOKEN_AXES`), ``grid`` the block's, the rest as it was. A method run on it selects among
    those n tokens, in their raster order (index ``j`` is token ``positions[j]``); ``frame_states`` (a video's
    frames, not one image's tokens) cannot be cut."""
    if evidence.frame_states is not None:
        raise ValueError("vitrim.vlm cannot cut a video's frame_states to a block of its tokens")
    cut: dict[str, Any] = {"grid": grid}
    for name, axis in TOKEN_AXES.items():
        value = getattr(evidence, name)
        if value is not None:
            cut[name] = value.index_select(axis, positions.to(value.device))
    return dataclasses.replace(evidence, **cut)


def uncropped(selection: ImageSelection, positions: Tensor) -> ImageSelection:
    """A selection made on :func:`crop_tokens`' evidence, in the uncut image's raster indices (``positions``: the
    same (n,) sorted indices; the map keeps raster order, so ``kept`` stays sorted and ``merged``, ``order`` and
    ``cls`` stay as they are)."""
    index = positions.to(selection.kept.device)
    return dataclasses.replace(
        selection, kept=index[selection.kept], groups=tuple(index[group.to(index.device)] for group in selection.groups)
    )


def write_merged(
    values: Tensor,
    selections: list[ImageSelection],
    transform: Callable[[Tensor], Tensor],
    cls_features: Tensor | None = None,
) -> Tensor | None:
    """``values`` (I, N, …) with each image's merged slots (:meth:`ImageSelection.merged_slots`) set to
    ``transform(merged features)`` (the merged tokens themselves where the selection's are ``projected``), and the
    [CLS] carrier slot of an image whose selection hands on its [CLS] set to
    ``cls_features[image]`` ((I, …) as ``values`` holds a token): a copy, or None when nothing was written."""
    written = None
    for image, selection in enumerate(selections):
        if selection.cls:
            if cls_features is None:
                raise ValueError("the selection hands the LLM the tower's [CLS], which this family did not capture")
            written = values.clone() if written is None else written
            written[image, selection.cls_carrier()] = cls_features[image].to(values.dtype)
        if selection.merged is None:
            continue
        slots = selection.merged_slots()
        if not len(slots):
            continue
        written = values.clone() if written is None else written
        merged = selection.merged[slots.to(selection.merged.device)]
        merged = merged if selection.projected else transform(merged)  # tokens after the projector go in as they are
        written[image, selection.kept[slots]] = merged.to(values.dtype)
    return written

"""A ``keep`` and method options per request in vLLM: ``mm_processor_kwargs={"vitrim": {"keep": …, "dominant": …}}``,
a mixin of the trimmed processors and what the models read of it.

vLLM lays out a request's placeholders in its front end, from the processor's prompt updates, and hands the model
only what the processor output declares as fields. So a request's own ``keep`` and options (read by
:func:`vitrim.vllm.options.request_options`) must decide both there: the processor counts the placeholders with them
and writes, per image (video), the tokens it keeps as a field, ``vitrim_image_keep`` (``vitrim_video_keep``: per
temporal patch), and the request's own options of the method as JSON (UTF-8 bytes, empty: the engine's),
``vitrim_image_options`` (``vitrim_video_options``), which reach ``embed_multimodal`` beside the item's pixels. There
each item's method is built from the engine's with those options (:func:`item_methods`, the same constructor as in
the front end) and the items are selected by their own methods (:func:`select_items`). vLLM keys its processor and
encoder caches by the request's processor options, so one image asked at two keeps, or two option sets, is two
entries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.multimodal.inputs import MultiModalFieldConfig

from vitrim.vllm.options import TrimOptions, request_method
from vitrim.vlm.method.base import ImageSelection, Method, Selector, VisionEvidence
from vitrim.vlm.stages.capture import images_of

MODALITIES = ("image", "video")
# (a group's method, its items' evidence, their keeps, their indices among the run's items) -> their selections
Choose = Callable[[Selector, VisionEvidence, list[int], list[int]], list[ImageSelection]]


def keep_field(modality: str) -> str:
    """The processor-output field holding each ``modality`` item's kept tokens (per temporal patch of a video)."""
    return f"vitrim_{modality}_keep"


def asked_keeps(kwargs: Mapping[str, object], modality: str) -> list[int] | None:
    """Each ``modality`` item's kept tokens as the processor wrote them for its request, flattened (LLaVA-NeXT writes
    one per tile of each image, :mod:`vitrim.vllm.llava_next`); None: not written."""
    asked = kwargs.get(keep_field(modality))
    if asked is None:
        return None
    if isinstance(asked, Tensor):
        return [int(k) for k in asked.flatten().tolist()]
    # a list of tensors, one per item (0-d; LLaVA-NeXT: one keep per tile), flattened in item order
    return [int(k) for item in asked for k in torch.as_tensor(item).flatten().tolist()]  # type: ignore[attr-defined]


def options_field(modality: str) -> str:
    """The processor-output field holding each ``modality`` item's request's own options of the method: (L,) uint8,
    their JSON (sorted keys) in UTF-8; empty where the request gives none (the engine's)."""
    return f"vitrim_{modality}_options"


def options_bytes(options: TrimOptions) -> Tensor:
    """(L,) uint8: ``options.overrides`` as :func:`options_field` holds them (empty: none)."""
    text = json.dumps(dict(options.overrides), sort_keys=True) if options.overrides else ""
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


# the methods a model built for its requests' option sets: (id of the engine's method, the options' JSON) -> (that
# engine method, kept so the id is not reused while cached; the request's method)
BuiltMethods = dict[tuple[int, str], tuple[Method, Method]]
BUILT_CAPACITY = 64  # option sets a model keeps built; older ones are built again when asked


def item_methods(kwargs: Mapping[str, object], modality: str, engine: Method, built: BuiltMethods) -> list[Method]:
    """Each ``modality`` item's method as its request asked (:func:`options_field` in ``embed_multimodal``'s
    ``kwargs``): ``engine`` where it gave no options, else the engine's method with them
    (:func:`vitrim.vllm.options.request_method`, which the front end ran on the same JSON), built once per engine
    method and option set into ``built`` (the model's own cache). [] where the field is not written."""
    field = kwargs.get(options_field(modality))
    if field is None:
        return []
    methods = []
    for item in list(field):  # type: ignore[call-overload]  # a list of (L,) tensors, or one (I, L) when alike
        text = bytes(torch.as_tensor(item).flatten().tolist()).decode()
        if not text:
            methods.append(engine)
            continue
        key = (id(engine), text)
        if key not in built:
            if len(built) >= BUILT_CAPACITY:  # a server's clients may ask any number of option sets
                built.pop(next(iter(built)))  # the oldest built
            built[key] = (engine, request_method(engine, json.loads(text)))
        methods.append(built[key][1])
    return methods


def select_items(
    methods: Sequence[Selector], evidence: VisionEvidence, keeps: Sequence[int], choose: Choose
) -> list[ImageSelection]:
    """Item i of ``evidence`` (I items) selected by ``methods[i]`` keeping ``keeps[i]``: the items grouped by their
    method (one group, the whole run, where every request takes the engine's), each group by ``choose`` on its own
    rows of the evidence (a family's ``select_keeping_each``: every method selects each image alone, so a batch
    selects what each item would alone, whichever options its neighbours asked)."""
    groups: dict[int, list[int]] = {}
    for item, method in enumerate(methods):
        groups.setdefault(id(method), []).append(item)
    if len(groups) == 1:
        return choose(methods[0], evidence, list(keeps), list(range(len(methods))))
    chosen: dict[int, ImageSelection] = {}
    for items in groups.values():
        part = images_of(evidence, torch.tensor(items))
        picked = choose(methods[items[0]], part, [keeps[item] for item in items], items)
        chosen.update(zip(items, picked, strict=True))
    return [chosen[item] for item in range(len(methods))]


class RequestKeep:
    """Mixed in before a vLLM multimodal processor. A family gives :meth:`request_trim` (its engine's options with
    the request's keep) and :meth:`kept_per_item` (field -> (items,) kept tokens, from the processor's output; a
    family may write an item's :func:`options_field` itself, where it carries no keep)."""

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        raise NotImplementedError

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Any]:
        raise NotImplementedError

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        # the 'vitrim' entry is vitrim's, not an option of transformers' processor
        plain = {key: value for key, value in hf_kwargs.items() if key != "vitrim"}
        return super()._call_hf_processor(hf_data, plain)  # type: ignore[misc]

    def _postprocess_hf_mm_data(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object], processed_data: Any
    ) -> Any:
        processed = super()._postprocess_hf_mm_data(hf_data, hf_kwargs, processed_data)  # type: ignore[misc]
        options = self.request_trim(hf_kwargs)
        kept: dict[str, Any] = dict(self.kept_per_item(processed, options))
        asked = options_bytes(options)
        for modality in MODALITIES:  # each item that carries a keep carries its request's options beside it
            if keep_field(modality) in kept and options_field(modality) not in kept:
                kept[options_field(modality)] = [asked.clone() for _ in range(len(kept[keep_field(modality)]))]
        processed.update(kept)
        return processed

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]) -> Any:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))  # type: ignore[misc]
        for modality in MODALITIES:
            for name in (keep_field(modality), options_field(modality)):
                if name in hf_inputs:
                    fields[name] = MultiModalFieldConfig.batched(modality)
        return fields

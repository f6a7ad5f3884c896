"""A ``keep`` per request in vLLM: ``mm_processor_kwargs={"vitrim": {"keep": …}}``, a mixin of the trimmed processors.

vLLM lays out a request's placeholders in its front end, from the processor's prompt updates, and hands the model
only what the processor output declares as fields. So a request's own ``keep`` (read by
:func:`vitrim.vllm.options.request_options`) must decide both there: the processor counts the placeholders with it
and writes, per image (video), the tokens it keeps as a field, ``vitrim_image_keep`` (``vitrim_video_keep``: per
temporal patch), which reaches ``embed_multimodal`` beside the item's pixels. vLLM keys its processor and encoder
caches by the request's processor options, so one image asked at two keeps is two entries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from vllm.multimodal.inputs import MultiModalFieldConfig

from vitrim.vllm.options import TrimOptions

MODALITIES = ("image", "video")


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


class RequestKeep:
    """Mixed in before a vLLM multimodal processor. A family gives :meth:`request_trim` (its engine's options with
    the request's keep) and :meth:`kept_per_item` (field -> (items,) kept tokens, from the processor's output)."""

    def request_trim(self, hf_kwargs: Mapping[str, object]) -> TrimOptions:
        raise NotImplementedError

    def kept_per_item(self, processed: Mapping[str, Any], options: TrimOptions) -> dict[str, Tensor]:
        raise NotImplementedError

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        # the 'vitrim' entry is vitrim's, not an option of transformers' processor
        plain = {key: value for key, value in hf_kwargs.items() if key != "vitrim"}
        return super()._call_hf_processor(hf_data, plain)  # type: ignore[misc]

    def _postprocess_hf_mm_data(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object], processed_data: Any
    ) -> Any:
        processed = super()._postprocess_hf_mm_data(hf_data, hf_kwargs, processed_data)  # type: ignore[misc]
        processed.update(self.kept_per_item(processed, self.request_trim(hf_kwargs)))
        return processed

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]) -> Any:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))  # type: ignore[misc]
        for modality in MODALITIES:
            if keep_field(modality) in hf_inputs:
                fields[keep_field(modality)] = MultiModalFieldConfig.batched(modality)
        return fields

"""What a served model selected, per image, for checking it against vitrim.vlm (owned here).

With ``VITRIM_VLLM_RECORD=1`` in the engine's environment (tests/vllm sets it), each vitrim model keeps, for the last
:data:`CAPACITY` images it encoded, the kept raster indices under the image's content seed
(``vitrim.vlm.evidence.seeds.content_seed`` of its pixels: the same for an image alone or in a batch, on vLLM and in
transformers). :func:`recorded_selections` reads them from every worker of an ``LLM``.

Off by default: the seed hashes every image's pixels (on a GPU after copying them to the host), which a served
model needs only for a seeded method (``random``). On the scaled Qwen2.5-VL of benchmarks/vllm_bench.py one 448-px
image's hash cost 5.7 ms of one core, about one of its four tower blocks (docs/vllm.md, "What it costs").
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

from torch import Tensor

CAPACITY = 256  # images remembered per worker; older ones are forgotten first
RECORD_ENV = "VITRIM_VLLM_RECORD"


def recording() -> bool:
    """Whether this process records selections (``VITRIM_VLLM_RECORD=1``)."""
    return os.environ.get(RECORD_ENV) == "1"


class SelectionRecord:
    """A bounded map: image content seed -> the kept raster indices (sorted) of its last encoding."""

    def __init__(self) -> None:
        self.kept: OrderedDict[int, list[int]] = OrderedDict()

    def add(self, seed: int, kept: Tensor) -> None:
        self.kept[seed] = [int(i) for i in kept.tolist()]
        self.kept.move_to_end(seed)
        while len(self.kept) > CAPACITY:
            self.kept.popitem(last=False)

    def add_all(self, seeds: Tensor | None, kept: list[Tensor]) -> None:
        """Image i's ``kept[i]`` under ``seeds[i]`` ((I,)); nothing where ``seeds`` is None (not recording)."""
        if seeds is not None:
            for seed, indices in zip(seeds.tolist(), kept, strict=True):
                self.add(seed, indices)

    def as_dict(self) -> dict[int, list[int]]:
        return dict(self.kept)


def record_of(model: Any) -> dict[int, list[int]]:
    """One worker's record (a module-level function: ``apply_model`` pickles it to worker processes)."""
    return dict(model.vitrim_record.as_dict())


def records_per_worker(llm: Any) -> list[dict[int, list[int]]]:
    """Each worker's record, in rank order (one per tensor-parallel rank)."""
    return list(llm.apply_model(record_of))


def recorded_selections(llm: Any) -> dict[int, list[int]]:
    """The kept indices per image seed that the workers of ``llm`` (a ``vllm.LLM`` of a vitrim architecture) hold;
    ``RuntimeError`` where this process does not record (its engine's workers share its environment)."""
    if not recording():
        raise RuntimeError(f"vitrim: selections are recorded only with {RECORD_ENV}=1 in the engine's environment")
    merged: dict[int, list[int]] = {}
    for record in records_per_worker(llm):
        merged.update(record)
    return merged

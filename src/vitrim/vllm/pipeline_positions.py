"""A trimmed prompt's positions handed from the first pipeline stage to the next, with its hidden states (owned here).

vLLM numbers a request's M-RoPE positions on every stage when the request arrives (``get_mrope_input_positions``)
and numbers its media again once they are encoded (``recompute_mrope_positions``), which happens on the first stage
only: the later stages never encode a medium. vitrim's trimmed Qwen2.5-VL, Qwen3-VL and Gemma 3 place each kept token
at a position that depends on which tokens its method kept (its grid cell; on Gemma 3 its original position), so
only the first stage knows them, and a later stage would run its layers at the arrival numbering (seen at
``--pipeline-parallel-size 2``: other greedy tokens on both Qwen families). The first stage therefore sends the
positions it ran at beside the hidden states, as one more tensor of vLLM's ``IntermediateTensors``, and every later
stage runs at those (decode steps included: the first stage's are authoritative). Removed when upstream re-numbers a
request's pruned media on every stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

KEY = "vitrim_positions"  # (n, rows) long: the positions the first stage ran each token at, transposed


def carry_positions(model: Any, rows: int) -> None:
    """Make ``model`` (a :class:`PositionsAcrossStages`) receive its ``rows`` × n positions on a later stage: its
    ``make_empty_intermediate_tensors`` (the receive buffer vLLM allocates once) gains :data:`KEY`. Called at the end
    of the model's ``__init__`` (vLLM sets that attribute on the instance)."""
    make = model.make_empty_intermediate_tensors

    def make_with_positions(batch_size: int, dtype: torch.dtype, device: torch.device) -> Any:
        tensors = make(batch_size=batch_size, dtype=dtype, device=device)
        tensors[KEY] = torch.zeros(batch_size, rows, dtype=torch.long, device=device)
        return tensors

    model.make_empty_intermediate_tensors = make_with_positions


class PositionsAcrossStages:
    """Mixed in before a vLLM model class that :func:`carry_positions` was called on: its ``forward`` runs at the
    first stage's positions on a later stage and sends them on from every stage but the last. A class that reads
    the rows itself overrides :meth:`stage_positions`."""

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Tensor | None = None,
        **kwargs: object,
    ) -> Any:
        rows = received_positions(positions, intermediate_tensors)
        stage = self.stage_positions(rows)
        output = super().forward(input_ids, stage, intermediate_tensors, inputs_embeds, **kwargs)  # type: ignore[misc]
        return send_positions(output, rows)

    def stage_positions(self, rows: Tensor) -> Tensor:
        """The positions vLLM's ``forward`` gets, from this step's (rows, n) positions: as they are."""
        return rows


def received_positions(positions: Tensor, intermediate_tensors: Any) -> Tensor:
    """The (rows, n) positions this stage runs at: the first stage's where it sent them (a later stage), else
    ``positions`` (the runner's: the first stage, or a stage of an engine without pipeline parallelism)."""
    if intermediate_tensors is None or KEY not in intermediate_tensors.tensors:
        return positions
    return intermediate_tensors.tensors.pop(KEY).T.contiguous().to(positions.dtype)  # a kernel reads rows flat


def send_positions(output: Any, positions: Tensor) -> Any:
    """``output`` with ``positions`` (rows, n) beside the hidden states where this stage hands them to the next
    (an ``IntermediateTensors``; the last stage's hidden states pass unchanged)."""
    if hasattr(output, "tensors"):
        output.tensors[KEY] = positions.T.contiguous()
    return output

"""The tower's attention evidence under tensor parallelism: each rank computes its own heads; every rank selects on
all of them.

vLLM splits a tower's attention heads across the ``--tensor-parallel-size`` ranks (``QKVParallelLinear``): the
rows a tap reads on one rank are that rank's heads, in rank order. The methods reduce over heads (FasterVLM's mean
[CLS] attention, VisionZip's sums, the keys' mean), so each rank gathers the others' heads before it selects: every
rank then holds the evidence a single rank would, selects the same tokens, and hands the LLM the same rows.
"""

from __future__ import annotations

from torch import Tensor
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather


def all_heads(per_rank: Tensor, dim: int) -> Tensor:
    """``per_rank`` (this rank's H/tp heads along ``dim``) with every rank's heads, in head order (H along ``dim``);
    itself at tensor-parallel size 1. Every rank must call it (a collective), as every rank runs the tower."""
    if get_tensor_model_parallel_world_size() == 1:
        return per_rank
    return tensor_model_parallel_all_gather(per_rank.contiguous(), dim=dim)

"""Distributed data parallel under ``torchrun``: who am I, one sampler for every world size, all-reduce.

``torchrun --nproc-per-node N`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without them the run is a single
process. Backend: NCCL on GPU, gloo on CPU. Rank 0 alone logs and writes files; metrics are summed over ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Sampler

from vitrim.seeds import epoch_seed


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the run: rank 0 … world_size−1, its device, and whether DDP is on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def setup_distributed(device: str = "auto") -> DistInfo:
    """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; join the process group if the world has more than one process.

    ``device``: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    return DistInfo(rank, world, local, dev)


def barrier(info: DistInfo) -> None:
    """Wait until every rank gets here (a no-op for a single process).

    Called after the last collective of a run, before the group is torn down: a rank that tore down its gloo
    connections while rank 0 was still writing its last checkpoint was seen to abort ("terminate called without
    an active exception").
    """
    if info.enabled:
        dist.barrier()


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: Tensor, info: DistInfo) -> Tensor:
    """Sum a tensor over ranks (a no-op for a single process); returns the summed tensor."""
    if info.enabled:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class GlobalBatchSampler(Sampler[int]):
    """Indices of one epoch for one rank, so that N ranks together see exactly one process's batches.

    Every epoch draws one permutation from ``(seed, epoch)`` (or keeps the order if not ``shuffle``), cuts it into
    global batches of ``global_batch`` and gives rank r the slice ``[r·b, (r+1)·b)`` of each, b = global_batch / N.
    torch's DistributedSampler deals samples round-robin instead, so its global batches differ from a single
    process's; with this one a DDP run with the same global batch computes the same mean gradient, step by step.

    ``drop_last`` drops the final incomplete global batch (training: every step averages the same number of
    samples on every rank); otherwise (evaluation) the remainder is dealt round-robin, so ranks may differ by one.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if not isinstance(global_batch, int) or global_batch <= 0:
            raise ValueError(f"batch size must be a positive int, got {global_batch!r}")
        if global_batch % world_size != 0:
            raise ValueError(f"batch size {global_batch} is not divisible by the world size {world_size}")
        self.num_samples, self.global_batch, self.rank, self.world_size = num_samples, global_batch, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.local_batch = global_batch // world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _order(self) -> Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return torch.randperm(self.num_samples, generator=g)

    def _indices(self) -> list[int]:
        order = self._order()
        full = self.num_samples // self.global_batch * self.global_batch
        batches = order[:full].view(-1, self.world_size, self.local_batch)  # (steps, world, b)
        mine = batches[:, self.rank].reshape(-1)
        if not self.drop_last:
            mine = torch.cat([mine, order[full:][self.rank :: self.world_size]])
        return mine.tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        full = self.num_samples // self.global_batch * self.global_batch
        extra = 0 if self.drop_last else len(range(self.rank, self.num_samples - full, self.world_size))
        return full // self.world_size + extra

"""DataLoaders for training and evaluation: worker processes, one share of the data per rank, lockstep under DDP.

A dataset with a length (digits, image folders) is dealt by :class:`~vitrim.train.distributed.GlobalBatchSampler`
(a DDP run sees a single process's global batches). A stream of shards deals itself by rank
(:mod:`vitrim.data.shards`). Either way the samples come through :class:`vitrim.data.ReadableBatches`, which drops
unreadable files and counts them.

Under DDP every rank must take the same number of optimiser steps or the gradient all-reduce waits forever; a
rank's shards may hold fewer samples than another's, and a batch whose files were all unreadable is left out. So
:func:`lockstep` asks all ranks before each micro-batch whether they still have one (one all-reduce of one number),
and all stop when one has run out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from vitrim.data import ReadableBatches, collate_readable, rebatch
from vitrim.train.distributed import DistInfo, GlobalBatchSampler

DEFAULT_WORKERS = 4  # timm's train.py default, capped by the cores the process may use


def resolve_workers(workers: int | None, data: str) -> int:
    """DataLoader workers: as asked, or (None) none for the in-memory digits and up to 4 for files."""
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"workers must be an int >= 0, got {workers!r}")
        return workers
    if data == "digits":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(DEFAULT_WORKERS, cores)


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar of ``total`` steps, or None when ``enabled`` is False (quiet, not a terminal, not rank 0)."""
    if not enabled:
        return None
    from tqdm import tqdm  # the train extra

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def _loader(dataset: Dataset, batch_size: int, workers: int, info: DistInfo, **options: Any) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate_readable,
        pin_memory=info.device.type == "cuda",
        **options,
    )


@dataclass
class TrainBatches:
    """One rank's micro-batches of an epoch; ``steps`` optimiser steps of ``accum_steps`` micro-batches each."""

    readable: ReadableBatches
    sampler: GlobalBatchSampler | None  # None for a stream of shards
    steps: int
    micro_batch: int  # samples per micro-batch on this rank
    workers: int  # DataLoader worker processes (evaluation uses as many)

    @property
    def batches(self) -> Iterable[tuple[Tensor, Tensor]]:
        """This epoch's micro-batches, each of ``micro_batch`` samples (but where unreadable files were left out)."""
        return self.readable if self.sampler is not None else rebatch(self.readable, self.micro_batch)

    def set_epoch(self, dataset: Dataset, epoch: int) -> None:
        dataset.set_epoch(epoch)  # type: ignore[attr-defined]
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)


def train_batches(
    dataset: Dataset, *, batch_size: int, accum_steps: int, info: DistInfo, seed: int, workers: int, source: str
) -> TrainBatches:
    """Micro-batches of ``batch_size / (world_size · accum_steps)`` samples; ``batch_size`` is global per step."""
    per_step = batch_size // info.world_size
    if batch_size % info.world_size or per_step % accum_steps:
        raise ValueError(
            f"batch size {batch_size} must divide into world size {info.world_size} x accum steps {accum_steps}"
        )
    micro = per_step // accum_steps
    if isinstance(dataset, IterableDataset):
        num_samples = int(dataset.num_samples)  # type: ignore[attr-defined]
        loader = _loader(dataset, micro, workers, info)  # each worker's last batch comes short: rebatched
        steps, sampler = num_samples // batch_size, None
    else:
        num_samples = len(dataset)  # type: ignore[arg-type]
        sampler = GlobalBatchSampler(num_samples, batch_size, rank=info.rank, world_size=info.world_size, seed=seed)
        loader = _loader(dataset, micro, workers, info, sampler=sampler)
        steps = len(sampler) // per_step
    if steps == 0:
        raise ValueError(f"batch size {batch_size} exceeds the {num_samples} training images")
    return TrainBatches(ReadableBatches(loader, source, steps=steps * accum_steps), sampler, steps, micro, workers)


def eval_batches(dataset: Dataset, *, batch_size: int, info: DistInfo, workers: int, source: str) -> ReadableBatches:
    """Every sample once across the ranks, in order, ``batch_size`` per rank and batch."""
    if isinstance(dataset, IterableDataset):
        num_samples = int(dataset.num_samples)  # type: ignore[attr-defined]
        steps = -(-num_samples // (batch_size * info.world_size))  # about: each rank streams its own shards
        return ReadableBatches(_loader(dataset, batch_size, workers, info), source, steps=steps)
    sampler = GlobalBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size * info.world_size,
        rank=info.rank,
        world_size=info.world_size,
        shuffle=False,
        drop_last=False,
    )
    return ReadableBatches(_loader(dataset, batch_size, workers, info, sampler=sampler), source)


def lockstep(batches: Iterable[Any], info: DistInfo, limit: int) -> Iterator[Any]:
    """At most ``limit`` items of ``batches``, stopping on every rank as soon as one rank has none left."""
    iterator = iter(batches)
    try:
        for _ in range(limit):
            batch = next(iterator, None)
            if info.enabled:
                have = torch.tensor([0.0 if batch is None else 1.0], device=info.device)
                dist.all_reduce(have, op=dist.ReduceOp.MIN)
                if have.item() == 0:
                    return
            if batch is None:
                return
            yield batch
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # a generator left early: its DataLoader shuts its workers down now, not at garbage collection

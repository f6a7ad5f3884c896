"""Batches without the samples that could not be read, and the count of those, across DataLoader workers.

A dataset of files returns ``None`` for a file it cannot decode (:mod:`vitrim.data.folder`, :mod:`vitrim.data.shards`).
Decoding happens in worker processes, where a counter on the dataset would be a copy per worker; so the count
travels with the batch instead: :func:`collate_readable` drops the ``None`` samples and appends how many it dropped,
and :class:`ReadableBatches` strips that count off again, adds it up, and warns once per loader naming the total.
:func:`rebatch` makes a stream's uneven batches even again.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, default_collate


def collate_readable(samples: Sequence[tuple[Tensor, int] | None]) -> tuple[Tensor, Tensor, int]:
    """(images (b, C, H, W), labels (b,), number of unreadable samples dropped); b may be 0."""
    readable = [s for s in samples if s is not None]
    skipped = len(samples) - len(readable)
    if not readable:
        return torch.empty(0), torch.empty(0, dtype=torch.long), skipped
    images, labels = default_collate(readable)
    return images, labels, skipped


def rebatch(batches: Iterable[tuple[Tensor, Tensor]], size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Batches of exactly ``size`` samples out of batches of any size (the remainder at the end is dropped).

    Each DataLoader worker of a stream batches its own shards, so a worker's last batch comes short; training wants
    full batches without losing those samples.
    """
    images: list[Tensor] = []
    labels: list[Tensor] = []
    held = 0
    for x, y in batches:
        images.append(x)
        labels.append(y)
        held += len(y)
        if held < size:
            continue
        x, y = torch.cat(images), torch.cat(labels)
        for start in range(0, held - size + 1, size):
            yield x[start : start + size], y[start : start + size]
        rest = held % size
        images, labels, held = ([x[held - rest :]], [y[held - rest :]], rest) if rest else ([], [], 0)


class ReadableBatches:
    """Iterate ``loader`` (whose ``collate_fn`` is :func:`collate_readable`) as ``(images, labels)`` batches.

    ``num_skipped`` adds up the unreadable samples of every pass; after the first pass that met any, one warning
    names how many (``source`` says where they are). An all-unreadable batch is left out.
    """

    def __init__(self, loader: DataLoader, source: str, *, steps: int | None = None) -> None:
        self.loader = loader
        self.source = source
        self.steps = steps  # batches per pass when the loader cannot say (a stream of shards)
        self.num_skipped = 0
        self.warned = False

    def __len__(self) -> int:
        return self.steps if self.steps is not None else len(self.loader)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        try:
            for images, labels, skipped in self.loader:
                self.num_skipped += skipped
                if len(labels):
                    yield images, labels
        finally:  # also when the consumer stops early (a training epoch ends at its last full step)
            if self.num_skipped and not self.warned:
                self.warned = True
                warnings.warn(f"skipped {self.num_skipped} unreadable image(s) in {self.source}", stacklevel=2)

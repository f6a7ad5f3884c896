"""The seed of one epoch's randomness, written once: every rank, loader worker and sampler derives its own from it.

    epoch_seed(seed, epoch)                  = seed · 1 000 003 + epoch      shared by every rank: the epoch's order
    epoch_seed(seed, epoch, rank)            = that · 1 009 + rank           one rank's stream (dropout, drop-path)
    epoch_seed(seed, epoch, rank, worker)    = that · 1 009 + worker         one loader worker of one rank

It depends on (seed, epoch, rank, worker) only, so a run resumed at epoch e draws what the uninterrupted run drew
(:mod:`vitrim.train.loop`, the batch sampler of :mod:`vitrim.train.distributed`, the shards of
:mod:`vitrim.data.shards`). The multipliers are primes larger than any epoch, rank or worker count in practice, so
distinct tuples give distinct seeds.
"""

from __future__ import annotations


def epoch_seed(seed: int, epoch: int, rank: int | None = None, worker: int | None = None) -> int:
    """The seed of ``epoch`` of a run seeded ``seed``; ``rank`` and ``worker`` narrow it to one rank's stream and to
    one loader worker of that rank (module doc). A rank is 0 or more, so a stream shared by every rank leaves it
    out (None) rather than passing 0."""
    if worker is not None and rank is None:
        raise ValueError(f"worker={worker!r} needs the rank it belongs to (rank=None)")
    value = seed * 1_000_003 + epoch
    for part in (rank, worker):
        if part is not None:
            value = value * 1_009 + part
    return value

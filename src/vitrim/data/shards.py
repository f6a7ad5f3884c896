"""WebDataset tar shards: data that outgrows one disk or one machine, streamed shard by shard.

``--data 'imagenet/train-{000000..001023}.tar'`` (a brace pattern of paths or URLs, anything WebDataset opens;
``|N`` after it gives the sample count, as timm's ``dataset-{0000..9999}.tar|100000``). A sample is the files of one
key in a tar: an image (``jpg``, ``jpeg``, ``png``, ``webp``) and its class index (``cls``), as WebDataset's and
timm's ImageNet shards hold them. Beside the shards, ``_info.json`` (timm's file) names the classes (``"classes"``: a
list of names, or ``"num_classes"``) and may give each shard's sample count (``"splits": {name: {"filenames",
"shard_lengths"}}``); without counts, local shards are counted from their tar headers (no image is read).

Who reads what (:func:`shards_for`): every epoch the shard list is permuted from ``(seed, epoch)`` (the same on every
rank), rank r takes every world_size-th shard from r, and its DataLoader worker w every num_workers-th of those from
w. So the ranks' shards partition the list and each sample of an epoch is read exactly once across the ranks; more
shards than ranks × workers keeps everyone busy. Within a worker a buffer of ``shuffle_buffer`` samples mixes shards
(seeded from (seed, epoch, rank, worker), so a resumed run reads the same order).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from vitrim.data.folder import Transform, open_image
from vitrim.seeds import epoch_seed

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
LABEL_KEY = "cls"
INFO_FILE = "_info.json"
_KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # WebDataset's: key = path up to the first dot of the file name


def is_shard_pattern(data: str) -> bool:
    """Whether ``--data`` names tar shards (``….tar``, a brace pattern, optionally ``|N``) rather than a folder."""
    return data.split("|")[0].rstrip().endswith(".tar")


def _expand(pattern: str) -> list[str]:
    import webdataset as wds  # the data extra

    return list(wds.shardlists.expand_urls(pattern))


def _read_text(url: str) -> str | None:
    """A small file beside the shards (local or remote), or None when there is none."""
    if "://" not in url and not url.startswith("pipe:"):
        return open(url).read() if os.path.isfile(url) else None
    import webdataset as wds

    try:
        with wds.gopen(url) as f:
            return f.read().decode()
    except Exception:  # a missing remote file surfaces as whatever the transport raises
        return None


def _count_local(path: str) -> int:
    """Samples in a local tar: keys that have an image file, read from the tar headers alone."""
    keys = set()
    with tarfile.open(path) as tar:
        for member in tar:
            match = _KEY.match(member.name)
            if member.isfile() and match and match.group(2).lower() in IMAGE_KEYS:
                keys.add(match.group(1))
    return len(keys)


@dataclass(frozen=True)
class ShardSource:
    """The shards of one ``--data`` pattern, how many samples they hold and the class names."""

    urls: tuple[str, ...]
    num_samples: int
    classes: tuple[str, ...]
    pattern: str

    @classmethod
    def parse(cls, data: str) -> ShardSource:
        """Expand ``data`` (module doc), read ``_info.json``, count the samples; errors name what is missing."""
        pattern, _, count = data.partition("|")
        pattern = pattern.strip()
        urls = tuple(_expand(pattern))
        if not urls:
            raise ValueError(f"data {data!r} expands to no shard")
        local = "://" not in urls[0] and not urls[0].startswith("pipe:")
        missing = [u for u in urls if local and not os.path.isfile(u)]
        if missing:
            raise FileNotFoundError(f"data {data!r}: shard {missing[0]!r} does not exist ({len(missing)} missing)")
        info_text = _read_text(os.path.join(os.path.dirname(urls[0]), INFO_FILE))
        info = json.loads(info_text) if info_text else {}
        classes = _classes(info, data)
        num_samples = int(count) if count.strip() else _info_count(info, urls)
        if num_samples is None:
            if not local:
                raise ValueError(f"data {data!r}: give the sample count as '{pattern}|N' or in {INFO_FILE}")
            num_samples = sum(_count_local(u) for u in urls)
        return cls(urls, num_samples, classes, pattern)


def _classes(info: dict, data: str) -> tuple[str, ...]:
    if "classes" in info:
        return tuple(str(c) for c in info["classes"])
    if "num_classes" in info:
        return tuple(str(i) for i in range(int(info["num_classes"])))
    raise ValueError(
        f"data {data!r}: no {INFO_FILE} with 'classes' (a list of names) or 'num_classes' beside the shards"
    )


def _info_count(info: dict, urls: tuple[str, ...]) -> int | None:
    """Sum of the shards' lengths as ``_info.json``'s splits list them, or None when it does not list them all."""
    lengths: dict[str, int] = {}
    for split in info.get("splits", {}).values():
        lengths.update(zip(split.get("filenames", ()), split.get("shard_lengths", ())))
    names = [os.path.basename(u) for u in urls]
    return sum(lengths[n] for n in names) if names and all(n in lengths for n in names) else None


def shards_for(
    num_shards: int, *, rank: int, world_size: int, worker: int, num_workers: int, epoch: int, seed: int, shuffle: bool
) -> list[int]:
    """Indices of the shards one worker of one rank reads in ``epoch`` (module doc: together, a partition)."""
    order = list(range(num_shards))
    if shuffle:
        order = torch.randperm(num_shards, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch))).tolist()
    return order[rank::world_size][worker::num_workers]


class ShardDataset(IterableDataset):
    """Samples ``(transform(image), label)`` of this rank's shards, or None for an unreadable image (module doc).

    ``num_samples`` counts the whole pattern (every rank); each rank streams its own part of it.
    """

    def __init__(
        self,
        source: ShardSource,
        transform: Transform,
        mode: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 1000,
    ) -> None:
        self.source = source
        self.classes = list(source.classes)
        self.num_samples = source.num_samples
        self.transform, self.mode = transform, mode
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _samples(self) -> Iterator[dict]:
        import webdataset as wds

        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = shards_for(
            len(self.source.urls), rank=self.rank, world_size=self.world_size, worker=worker,
            num_workers=num_workers, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle,
        )  # fmt: skip
        samples = wds.tarfile_to_samples(handler=wds.warn_and_continue)(
            iter({"url": self.source.urls[i]} for i in mine)
        )
        if self.shuffle and self.shuffle_buffer > 1:
            seed = epoch_seed(self.seed, self.epoch, self.rank, worker)
            initial = min(self.shuffle_buffer, 100)
            samples = wds.shuffle(self.shuffle_buffer, initial, rng=random.Random(seed))(samples)
        return samples

    def __iter__(self) -> Iterator[tuple[Tensor, int] | None]:
        for sample in self._samples():
            yield self._decode(sample)

    def _decode(self, sample: dict) -> tuple[Tensor, int] | None:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        try:
            if key is None or LABEL_KEY not in sample:
                raise ValueError(f"sample {sample.get('__key__')!r} has no image or no {LABEL_KEY}")
            label = int(sample[LABEL_KEY])
            image = open_image(io.BytesIO(sample[key]), self.mode)
        except Exception:  # a bad sample is counted and skipped (vitrim.data.loader), never the end of a run
            return None
        return self.transform(image), label

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
import itertools
import os
import random
import re
import string
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info

from vitrim import untrusted
from vitrim.data import tar_samples as tar_reading
from vitrim.data.folder import Transform
from vitrim.data.image_file import ImageRefused, open_image
from vitrim.data.tar_samples import KEY, tar_samples
from vitrim.seeds import epoch_seed
from vitrim.untrusted import expect_object, parse_json

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
LABEL_KEY = "cls"
INFO_FILE = "_info.json"
MAX_CLASSES = 1_000_000  # what _info.json may declare (ImageNet-21k: 21,841)
MAX_SHARD_SAMPLES = 10**9  # samples one shard may declare in _info.json


def is_shard_pattern(data: str) -> bool:
    """Whether ``--data`` names tar shards (``….tar``, a brace pattern, optionally ``|N``) rather than a folder."""
    return data.split("|")[0].rstrip().endswith(".tar")


MAX_SHARDS = 100_000  # a pattern that expands to more is refused before its list is made (ImageNet-21k: ~10^4)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # what urlparse (and so WebDataset's gopen) takes for a scheme


def is_url(text: str) -> bool:
    """Whether WebDataset would open ``text`` as something other than a local file: a URL scheme (``pipe:``, which
    runs a shell command, ``http:``, ``s3:``, ``file:`` ...) or ``-`` (standard input)."""
    text = text.lstrip("".join(map(chr, range(33))))  # urlparse strips leading spaces and control characters too
    return text == "-" or _SCHEME.match(text) is not None


_INT_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")  # braceexpand's grammar, counted instead of listed
_CHAR_RANGE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_LETTERS = string.ascii_uppercase + string.ascii_lowercase
MAX_BRACE_DEPTH = 16


def _brace_count(pattern: str) -> int:
    """How many names braceexpand makes of ``pattern`` (capped at ``MAX_SHARDS + 1``), without making them.

    braceexpand lists each range whole before yielding a name (``{0..99999999999}`` never returns) and builds every
    name of a product (``{a,b}`` 40 times: 2^40), so a pattern is counted before it is expanded.
    """
    cap = MAX_SHARDS + 1
    total, start, depth, pos = 1, 0, 0, 0
    while pos < len(pattern):
        char = pattern[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            if depth == 0:
                start = pos
            depth += 1
        elif char == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                total = min(cap, total * _expression_count(pattern[start + 1 : pos]))
        pos += 1
    return total


def _expression_count(expr: str) -> int:
    """Names of one ``{…}``: a number range, a letter range, a comma sequence (a sum), or literal braces."""
    cap = MAX_SHARDS + 1
    if match := _INT_RANGE.match(expr):
        first, last, step = match.groups()
        if max(len(first), len(last), len(step or "")) > 18:
            return cap
        return min(cap, abs(int(last) - int(first)) // (int(step or 1) or 1) + 1)
    if match := _CHAR_RANGE.match(expr):
        first, last, step = match.groups()
        return (
            abs(_LETTERS.index(last) - _LETTERS.index(first)) // (int(step or 1) or 1) + 1
            if len(step or "") < 18
            else 1
        )
    parts, start, depth, pos = [], 0, 0, 0
    while pos < len(expr):
        char = expr[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if not parts:
        return _brace_count(expr)
    return min(cap, sum(_brace_count(part) for part in [*parts, expr[start:]]))


def _brace_depth(pattern: str) -> int:
    depth = deepest = 0
    for char in pattern:
        depth += (char == "{") - (char == "}")
        deepest = max(deepest, depth)
    return deepest


def _expand(pattern: str, option: str = "--data") -> list[str]:
    """The shard names of a brace pattern, as WebDataset expands it (``::`` joins, ``${VAR}`` from ``WDS_VAR``,
    braces), refused beyond ``MAX_SHARDS`` names before any list is made."""
    import braceexpand  # WebDataset's own dependency (the data extra)
    from webdataset.shardlists import envsubst

    names: list[str] = []
    for part in pattern.split("::"):
        for _ in range(10):  # WebDataset substitutes up to 10 times
            last, part = part, envsubst(part)
            if part == last:
                break
        if _brace_depth(part) > MAX_BRACE_DEPTH:
            raise ValueError(f"{option} {pattern!r} nests braces over {MAX_BRACE_DEPTH} deep")
        if len(names) + _brace_count(part) > MAX_SHARDS:
            names = [""] * (MAX_SHARDS + 1)
            break
        try:
            names += itertools.islice(braceexpand.braceexpand(part), MAX_SHARDS + 1 - len(names))
        except ValueError as err:  # braceexpand.UnbalancedBracesError among them
            raise ValueError(f"{option} {pattern!r} is not a valid brace pattern ({err})") from None
    if len(names) > MAX_SHARDS:
        raise ValueError(
            f"{option} {pattern!r} expands to more than {MAX_SHARDS} shards (vitrim.data.shards.MAX_SHARDS)"
        )
    return names


def check_local(data: str, field: str) -> None:
    """ValueError unless ``data`` (read from a file: a run's ``run.json``, a resume file) names local paths only.

    WebDataset opens ``pipe:`` patterns by running them in a shell and ``http:`` ones with curl: a feature for the
    user's own ``--data``, never for a string a file supplies. A shard pattern is checked shard by shard after its
    expansion (``a.tar::pipe:…`` hides a second pattern).
    """
    if not isinstance(data, str):
        raise ValueError(f"{field} must be a string (a folder or a shard pattern), got {type(data).__name__} {data!r}")
    names = _expand(data.partition("|")[0].strip(), field) if is_shard_pattern(data) else [data]
    bad = next((n for n in names if is_url(n)), None)
    if bad is not None:
        where = "" if bad == data else f" (it expands to {bad!r})"
        raise ValueError(
            f"{field} {data!r} is a URL, a 'pipe:' command or standard input{where}, not a local path: data named by "
            "a file is read from local paths only (to read it anyway, give it yourself as --data / --val-data)"
        )


def _read_text(url: str) -> str | bytes | None:
    """A small file beside the shards (local, or remote for the user's own URL pattern), or None when there is none."""
    if not is_url(url):
        if not os.path.isfile(url):
            return None
        if os.path.getsize(url) > untrusted.MAX_JSON_BYTES:
            raise ValueError(
                f"{url}: {os.path.getsize(url)} bytes of JSON, over the limit of {untrusted.MAX_JSON_BYTES}"
            )
        with open(url, "rb") as f:
            return f.read()
    import webdataset as wds

    try:
        with wds.gopen(url) as f:
            return f.read(untrusted.MAX_JSON_BYTES + 1)
    except Exception:  # a missing remote file surfaces as whatever the transport raises
        return None


def _count_local(path: str) -> int:
    """Samples in a local tar: keys that have an image file, read from the tar headers alone."""
    keys = set()
    file_size = os.path.getsize(path)
    try:
        with tarfile.open(path) as tar:
            for member in tar:
                match = KEY.match(member.name)
                if member.isfile() and match and match.group(2).lower() in IMAGE_KEYS:
                    _check_member_size(member, path)
                    if member.offset_data + member.size > file_size:  # tarfile takes a truncated tar for its end
                        raise ValueError(
                            f"shard {path!r}: {member.name!r} declares {member.size} bytes, but the file ends before "
                            "them (a truncated tar)"
                        )
                    keys.add(match.group(1))
    except (tarfile.TarError, OSError, EOFError, UnicodeError) as err:
        raise ValueError(f"shard {path!r} is not a readable tar file ({_detail(err)})") from None
    return len(keys)


def _check_member_size(member: tarfile.TarInfo, shard: str) -> None:
    if member.size > (limit := tar_reading.MAX_MEMBER_BYTES):
        raise ValueError(
            f"shard {shard!r}: {member.name!r} declares {member.size} bytes, over the limit of {limit} "
            "(vitrim.data.tar_samples.MAX_MEMBER_BYTES)"
        )


def _detail(err: BaseException) -> str:
    text = str(err).splitlines()[0].strip().rstrip(":") if str(err).strip() else ""
    return text or type(err).__name__


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
        if not isinstance(data, str):
            raise TypeError(f"data must be a string, got {type(data).__name__}")
        pattern, _, count = data.partition("|")
        pattern = pattern.strip()
        urls = tuple(_expand(pattern))
        if not urls:
            raise ValueError(f"data {data!r} expands to no shard")
        local = not is_url(urls[0])
        missing = [u for u in urls if local and not os.path.isfile(u)]
        if missing:
            raise FileNotFoundError(
                f"data {data!r}: shard {missing[0]!r} does not exist or is not a regular file ({len(missing)} missing)"
            )
        info_path = os.path.join(os.path.dirname(urls[0]), INFO_FILE)
        info_text = _read_text(info_path)
        info = expect_object(parse_json(info_text, info_path), info_path) if info_text else {}
        classes = _classes(info, data, info_path)
        num_samples = _user_count(count, data) if count.strip() else _info_count(info, urls, info_path)
        if num_samples is None:
            if not local:
                raise ValueError(f"data {data!r}: give the sample count as '{pattern}|N' or in {INFO_FILE}")
            num_samples = sum(_count_local(u) for u in urls)
        return cls(urls, num_samples, classes, pattern)


def _user_count(count: str, data: str) -> int:
    text = count.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 15) or int(text) < 1:
        raise ValueError(f"data {data!r}: the sample count after '|' must be a positive int, got {text!r}")
    return int(text)


def _is_count(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _classes(info: dict, data: str, source: str) -> tuple[str, ...]:
    """The class names ``_info.json`` gives: ``classes`` (a list of 1 to MAX_CLASSES strings) or ``num_classes``."""
    if "classes" in info:
        names = info["classes"]
        if not (isinstance(names, list) and 1 <= len(names) <= MAX_CLASSES and all(isinstance(c, str) for c in names)):
            raise ValueError(
                f"{source}: 'classes' must be a list of 1 to {MAX_CLASSES} class names (strings), got {_short(names)}"
            )
        return tuple(names)
    if "num_classes" in info:
        number = info["num_classes"]
        if not _is_count(number, 1, MAX_CLASSES):
            raise ValueError(f"{source}: 'num_classes' must be an int from 1 to {MAX_CLASSES}, got {_short(number)}")
        return tuple(str(i) for i in range(number))
    raise ValueError(
        f"data {data!r}: no {INFO_FILE} with 'classes' (a list of names) or 'num_classes' beside the shards"
    )


def _info_count(info: dict, urls: tuple[str, ...], source: str) -> int | None:
    """Sum of the shards' lengths as ``_info.json``'s splits list them, or None when it does not list them all.

    ``splits``: ``{name: {"filenames": [shard file names], "shard_lengths": [sample counts >= 0]}}`` (timm's).
    """
    splits = info.get("splits", {})
    if not isinstance(splits, dict):
        raise ValueError(
            f"{source}: 'splits' must be an object {{name: {{filenames, shard_lengths}}}}, got {_short(splits)}"
        )
    lengths: dict[str, int] = {}
    for name, split in splits.items():
        field = f"{source}: splits[{name!r}]"
        if not isinstance(split, dict):
            raise ValueError(f"{field} must be an object with 'filenames' and 'shard_lengths', got {_short(split)}")
        filenames, counts = split.get("filenames", []), split.get("shard_lengths", [])
        if not (isinstance(filenames, list) and all(isinstance(f, str) for f in filenames)):
            raise ValueError(f"{field}['filenames'] must be a list of shard file names, got {_short(filenames)}")
        if not (isinstance(counts, list) and all(_is_count(n, 0, MAX_SHARD_SAMPLES) for n in counts)):
            raise ValueError(
                f"{field}['shard_lengths'] must be a list of sample counts (ints from 0 to {MAX_SHARD_SAMPLES}), "
                f"got {_short(counts)}"
            )
        if len(filenames) != len(counts):
            raise ValueError(f"{field} lists {len(filenames)} filenames but {len(counts)} shard_lengths")
        lengths.update(zip(filenames, counts))
    names = [os.path.basename(u) for u in urls]
    return sum(lengths[n] for n in names) if names and all(n in lengths for n in names) else None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_streams(rank: object, world_size: object) -> None:
    """``world_size`` processes (an int >= 1) and this one's ``rank`` among them (an int in [0, world_size))."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1 (the processes that share the data), got {world_size!r:.80}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size - 1}] (world_size {world_size}), got {rank!r:.80}")


def shards_for(
    num_shards: int, *, rank: int, world_size: int, worker: int, num_workers: int, epoch: int, seed: int, shuffle: bool
) -> list[int]:
    """Indices of the shards one worker of one rank reads in ``epoch`` (module doc: together, a partition)."""
    check_streams(rank, world_size)
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
        check_streams(rank, world_size)
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
        samples: Iterator[Any] = itertools.chain.from_iterable(self._read_shard(self.source.urls[i]) for i in mine)
        if self.shuffle and self.shuffle_buffer > 1:
            seed = epoch_seed(self.seed, self.epoch, self.rank, worker)
            initial = min(self.shuffle_buffer, 100)
            samples = wds.shuffle(self.shuffle_buffer, initial, rng=random.Random(seed))(samples)
        return samples

    @staticmethod
    def _read_shard(url: str) -> Iterator[dict | None]:
        """One shard's samples (:mod:`vitrim.data.tar_samples`); a shard that cannot be opened is one ``None``."""
        try:
            if is_url(url):  # the user's own --data only (check_local keeps a file's patterns local)
                import webdataset as wds

                stream = wds.gopen(url)
            else:
                stream = open(url, "rb")  # noqa: SIM115 (closed by the with below, after the yields)
        except Exception:  # a missing or unreachable shard: counted like an unreadable image, as WebDataset skips it
            yield None
            return
        with stream:
            yield from tar_samples(stream, url)

    def __iter__(self) -> Iterator[tuple[Tensor, int] | None]:
        for sample in self._samples():
            yield self._decode(sample)

    def _decode(self, sample: dict | None) -> tuple[Tensor, int] | None:
        """The sample's (image, label), or None when it cannot be used: no image or label, a label outside the
        classes (a loss or a one-hot would fail on it, or learn a class that does not exist), a bad image."""
        if sample is None or "__bad__" in sample:
            return None
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        try:
            if key is None or LABEL_KEY not in sample:
                raise ValueError(f"sample {sample.get('__key__')!r} has no image or no {LABEL_KEY}")
            label = int(sample[LABEL_KEY])
            if not 0 <= label < len(self.classes):
                raise ValueError(f"label {label} outside the {len(self.classes)} classes")
            image = open_image(io.BytesIO(sample[key]), self.mode)
        except Exception:  # a bad sample is counted and skipped (vitrim.data.loader), never the end of a run
            return None
        try:
            return self.transform(image), label
        except ImageRefused:  # too large once resized (vitrim.data.transforms.ResizeGuard): counted, as a bad file
            return None

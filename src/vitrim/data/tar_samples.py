"""The samples of one tar shard, read as WebDataset groups them, with every header checked before its data is read.

A sample is the consecutive files that share a key (the path up to the first dot of the file name): ``0001.png`` and
``0001.cls`` make ``{"__key__": "0001", "png": b"…", "cls": b"3"}``; suffixes are lower-cased, as WebDataset's
``group_by_keys`` does. A shard comes from outside, so nothing it says is trusted:

* a file whose header declares more than ``MAX_MEMBER_BYTES`` is not read, and ends its shard (a header may declare
  8 GiB in a 150-byte file, or a real 8 GiB file may sit inside a shard: skipping it would read it);
* links, folders and special entries are skipped: only regular files make samples;
* a corrupt or truncated tar ends the shard: what was read before is kept, and the rest counts as one unreadable
  sample (``None``), which :mod:`vitrim.data.loader` counts and reports as it does an undecodable image.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from typing import IO, Any

MAX_MEMBER_BYTES = 512 * 2**20  # one file inside a shard (an image, a label); ImageNet's largest JPEG is ~15 MB
KEY = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # WebDataset's: key = path up to the first dot of the file name
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's metadata entries (``__key__``, ``__url__``), never samples

Sample = dict[str, Any]


def tar_samples(stream: IO[bytes], url: str) -> Iterator[Sample | None]:
    """The samples of the tar read from ``stream`` (module doc); ``None`` for a sample that cannot be read."""
    current: Sample | None = None
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                match = KEY.match(member.name)
                if not member.isfile() or match is None or _META.search(member.name):
                    continue
                key, suffix = match.group(1), match.group(2).lower()
                if current is not None and current["__key__"] != key:
                    yield current
                    current = None
                if current is None:
                    current = {"__key__": key, "__url__": url}
                if member.size > MAX_MEMBER_BYTES:  # skipping it would read as much: the shard ends here
                    current["__bad__"] = True
                    break
                if suffix in current:  # a key whose files are not consecutive
                    current["__bad__"] = True
                    continue
                data = tar.extractfile(member)
                current[suffix] = data.read() if data is not None else b""
    except (tarfile.TarError, OSError, EOFError, UnicodeError, ValueError):
        yield None  # the rest of a corrupt shard: one unreadable sample (module doc)
        current = None
    if current is not None:
        yield current

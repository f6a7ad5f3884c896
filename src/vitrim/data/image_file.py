"""Opening an image file from outside: its size checked before any pixel is decoded, a truncated file refused.

Every loader, ``vitrim eval`` and ``vitrim viz --image`` open pictures through :func:`open_image`, so a hostile file
is refused the same way everywhere:

* **decompression bombs**: a 17 KB PNG can declare 12000×12000 pixels (1.1 GB once decoded). The header is read
  first and an image of more than :func:`pixel_limit` pixels is a ``ValueError`` before decoding; Pillow's own
  ``DecompressionBombWarning`` becomes that error too. The limit is Pillow's ``PIL.Image.MAX_IMAGE_PIXELS``
  (89,478,485 pixels by default, about 9459×9459); raise it in Python by setting that attribute, or for the command
  line (and DataLoader workers) with the environment variable ``VITRIM_MAX_IMAGE_PIXELS=N``;
* **truncated files** fail to decode: the whole image is decoded here (Pillow's default, unless the program sets
  ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES``), so a loader counts the file as unreadable instead of a grey image;
* **special files**: a path is opened without blocking and must be a regular file (a FIFO named ``x.png`` would
  otherwise wait forever for a writer).
"""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path
from typing import IO, Any

PIXEL_LIMIT_VARIABLE = "VITRIM_MAX_IMAGE_PIXELS"


class ImageRefused(ValueError):
    """A file refused before decoding (over the pixel limit, not a regular file): the message says why in full."""


def pixel_limit() -> int | None:
    """The most pixels an image may have (``VITRIM_MAX_IMAGE_PIXELS``, else Pillow's limit; None: no limit)."""
    from PIL import Image

    text = os.environ.get(PIXEL_LIMIT_VARIABLE, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"environment variable {PIXEL_LIMIT_VARIABLE} must be a positive int, got {text!r}")
        Image.MAX_IMAGE_PIXELS = int(text)  # Pillow's own check (twice the limit: an error) follows the user's limit
    return Image.MAX_IMAGE_PIXELS


def _open_regular(path: str | Path) -> IO[bytes]:
    """``path`` opened for reading, refused (ValueError) unless it is a regular file; never blocks on a FIFO."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageRefused(f"{str(path)!r} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_image(file: str | Path | IO[bytes], mode: str) -> Any:
    """Decode a path or binary file object into a PIL image of ``mode`` (module doc).

    ValueError when the image is over the pixel limit or the path is not a regular file; a file Pillow cannot
    read (corrupt, truncated, not an image) raises what Pillow raises (the callers word or count it).
    """
    from PIL import Image

    limit = pixel_limit()
    stream = _open_regular(file) if isinstance(file, (str, Path)) else file
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below words it as an error
            try:
                image = Image.open(stream)
            except Image.DecompressionBombError as err:  # over twice Pillow's limit: refused by Pillow itself
                found = re.search(r"\((\d+) pixels\)", str(err))
                raise ImageRefused(_too_large(f"{found.group(1) if found else 'too many'} pixels", limit)) from None
        with image:
            width, height = image.size
            if limit is not None and width * height > limit:
                raise ImageRefused(_too_large(f"{width}x{height} = {width * height} pixels", limit))
            return image.convert(mode)  # convert loads every pixel: a truncated file fails here, not later
    finally:
        if stream is not file:
            stream.close()


def _too_large(size: str, limit: int | None) -> str:
    return (
        f"image of {size} is over the limit of {limit} pixels, refused before decoding (a possible decompression "
        f"bomb; raise the limit with {PIXEL_LIMIT_VARIABLE}=N or PIL.Image.MAX_IMAGE_PIXELS)"
    )

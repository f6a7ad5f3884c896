"""Write a file whole or not at all: a temporary file in the same folder, flushed to disk, then ``os.replace``.

``os.replace`` is atomic on POSIX, so a crash (or a kill) mid-write leaves the previous file whole; checkpoints, the
resume state and the run record are all written this way. A kill mid-write cannot remove its temporary file
(``.NAME.XXXXXXXX.tmp``); ``remove_stale_temps`` clears those when the next run starts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def _temp_prefix(name: str) -> str:
    return f".{name}."


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)``, fsync the file, then rename it to ``path``; on any error remove it and re-raise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; give the result the usual permissions
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_stale_temps(folder: str | Path, names: Iterable[str]) -> None:
    """Remove the temporary files that ``atomic_write`` left for ``names`` in ``folder``.

    Only a writer killed mid-write (SIGKILL, power loss: nothing runs to clean up) leaves one, and the file it
    would have replaced is whole; call this when a run starts, before anything is written into ``folder``.
    """
    for name in names:
        for path in Path(folder).glob(f"{_temp_prefix(name)}*{TEMP_SUFFIX}"):
            if path.is_file():
                path.unlink(missing_ok=True)

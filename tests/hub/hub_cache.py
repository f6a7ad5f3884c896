"""A Hugging Face Hub cache on disk, laid out as huggingface_hub lays it out, for tests that load by name offline.

``models--ORG--NAME/blobs/<sha256>`` holds each file's bytes; ``snapshots/<commit>/<path>`` is a relative symlink
to its blob; ``refs/<revision>`` holds the commit a branch or tag points at. (huggingface_hub's own
``scan_cache_dir`` reads what this writes; tests/hub/test_hub_names.py checks that it finds no corruption.)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes | Path], *, revision: str = "main") -> str:
    """Put ``files`` (repo path -> bytes or a file to copy) into the cache as ``repo_id`` at ``revision``; returns
    the commit hash (made up from the contents, 40 hex digits, as git's are)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    contents = {name: value.read_bytes() if isinstance(value, Path) else value for name, value in files.items()}
    digest = hashlib.sha1(repr(sorted((n, hashlib.sha256(b).hexdigest()) for n, b in contents.items())).encode())
    commit = digest.hexdigest()
    for name, data in contents.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return commit


def add_folder(cache: Path, repo_id: str, folder: Path, *, revision: str = "main") -> str:
    """Every file of a ``save_pretrained`` / ``save_for_hf`` folder as the repo ``repo_id``."""
    files: dict[str, bytes | Path] = {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return add_repo(cache, repo_id, files, revision=revision)

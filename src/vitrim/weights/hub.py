"""Files of a Hugging Face Hub repository, through huggingface_hub: its download, its cache, its revisions.

Names are timm's: ``"hf-hub:org/name"`` or ``"hf-hub:org/name@revision"`` (a branch, tag or commit). Every file
comes from ``huggingface_hub.hf_hub_download``, so the cache is the one transformers and timm share
(``~/.cache/huggingface/hub``, ``$HF_HOME/hub`` or ``$HF_HUB_CACHE``) and ``HF_HUB_OFFLINE=1`` reads that cache
only. The environment is read when a file is asked for, not when huggingface_hub was imported, so a program (or a
test) that sets ``HF_HOME`` or ``HF_HUB_OFFLINE`` late is still obeyed.

Every failure is one line naming the repo and what to do: a repo that is not in the cache while offline, one that
does not exist (or is gated), a revision that does not exist, a repo without weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitrim.extras import require
from vitrim.weights.formats import WEIGHT_FILES, read_json, shard_files

HUB_PREFIX = "hf-hub:"
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean environment variable


def is_hub_name(source: object) -> bool:
    """True for ``"hf-hub:org/name[@revision]"``."""
    return isinstance(source, str) and source.startswith(HUB_PREFIX)


def parse_hub_name(name: str) -> tuple[str, str | None]:
    """``"hf-hub:org/name@rev"`` -> ``("org/name", "rev")``; the revision is None when not given (``main``)."""
    if not is_hub_name(name):
        raise ValueError(f"hub name {name!r} must start with {HUB_PREFIX!r}, e.g. 'hf-hub:facebook/dinov2-small'")
    repo_id, _, revision = name.removeprefix(HUB_PREFIX).partition("@")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or (revision == "" and name.endswith("@")):
        raise ValueError(f"hub name {name!r} must be 'hf-hub:ORG/NAME' or 'hf-hub:ORG/NAME@REVISION'")
    return repo_id, revision or None


def cache_dir() -> str | None:
    """The hub cache the environment names now (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``,
    ``$XDG_CACHE_HOME/huggingface/hub``, in huggingface_hub's order); None: huggingface_hub's own default."""
    for variable, below in (
        ("HF_HUB_CACHE", ()),
        ("HUGGINGFACE_HUB_CACHE", ()),
        ("HF_HOME", ("hub",)),
        ("XDG_CACHE_HOME", ("huggingface", "hub")),
    ):
        if os.environ.get(variable):
            return os.path.join(os.path.expanduser(os.path.expandvars(os.environ[variable])), *below)
    return None


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as the environment says now, or as huggingface_hub read it."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _where(repo_id: str, revision: str | None) -> str:
    return f"hf-hub:{repo_id}" + (f"@{revision}" if revision else "")


def _cache_name() -> str:
    return cache_dir() or "huggingface_hub's default cache"


def _offline_message(where: str, what: str) -> str:
    return (
        f"{where}: {what} is not in the Hugging Face cache ({_cache_name()}) and HF_HUB_OFFLINE=1 forbids "
        "downloading it; download it once online, or point HF_HOME / HF_HUB_CACHE at a cache that has it"
    )


def download(repo_id: str, filename: str, revision: str | None = None, *, required: bool = True) -> Path | None:
    """The local path of ``filename`` in the repo (downloaded into the cache unless offline or already there).

    A file the repo does not have (or, offline, that the cache does not have) is None when not ``required``;
    everything else that goes wrong is one clear error (FileNotFoundError, PermissionError, ValueError, OSError).
    """
    require("huggingface_hub", feature="loading from the Hugging Face Hub")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where, is_offline = _where(repo_id, revision), offline()
    try:
        path = hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir(), local_files_only=is_offline)
    except LocalEntryNotFoundError:
        if not required:
            return None
        if is_offline:
            raise FileNotFoundError(_offline_message(where, filename)) from None
        raise FileNotFoundError(
            f"{where}: {filename} could not be downloaded (no connection?) and is not in the cache ({_cache_name()})"
        ) from None
    except GatedRepoError:
        raise PermissionError(
            f"{where} is gated: accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"{where}: no such repository on the Hugging Face Hub (or it is private: log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{where}: the repository has no revision {revision!r} (a branch, tag or commit)") from None
    except EntryNotFoundError:
        if not required:
            return None
        raise FileNotFoundError(f"{where} has no file {filename!r}") from None
    except HfHubHTTPError as err:
        raise OSError(f"{where}: the Hugging Face Hub answered {str(err).splitlines()[0]}") from None
    return Path(path)


@dataclass(frozen=True)
class HubRepo:
    """What vitrim reads from a repo: ``config.json`` (timm's or transformers'), the weights (the file, or a
    shard index whose shards are downloaded next to it) and transformers' ``preprocessor_config.json`` if any."""

    name: str  # "hf-hub:org/name[@revision]", for messages
    config: dict[str, Any] | None
    weights: Path
    preprocessor: dict[str, Any] | None


def fetch(repo_id: str, revision: str | None = None, *, need_config: bool = True) -> HubRepo:
    """Download (or find in the cache) what :class:`HubRepo` holds. ``need_config=False``: a repo without
    config.json is accepted (timm's name-based weights need only the weights; the data config then comes from
    vitrim's registry)."""
    where = _where(repo_id, revision)
    config_path = download(repo_id, "config.json", revision, required=need_config)
    config = read_json(config_path) if config_path is not None else None
    weights = None
    for filename in WEIGHT_FILES:
        weights = download(repo_id, filename, revision, required=False)
        if weights is not None:
            break
    if weights is None:
        if offline():
            raise FileNotFoundError(_offline_message(where, f"a weights file ({', '.join(WEIGHT_FILES)})"))
        raise FileNotFoundError(f"{where} has no weights: expected one of {list(WEIGHT_FILES)}")
    if weights.name.endswith(".index.json"):
        try:
            shards = shard_files(weights)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        for shard in shards:
            download(repo_id, shard, revision)
    preprocessor = None
    if config is not None and "model_type" in config:  # transformers' layout: its image processor's settings
        path = download(repo_id, "preprocessor_config.json", revision, required=False)
        preprocessor = read_json(path) if path is not None else None
    return HubRepo(where, config, weights, preprocessor)

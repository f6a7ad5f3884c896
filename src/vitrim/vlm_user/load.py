"""Load a user's vision-language model and its processor from a checkpoint folder or a hub id.

transformers' ``AutoProcessor`` and ``AutoModelForImageTextToText`` read the folder (or the hub's local cache, which
``HF_HUB_OFFLINE=1`` keeps offline); no code from the checkpoint runs: ``trust_remote_code`` stays off and the
weights are read from safetensors only. ``config.json`` is read first through :mod:`vitrim.untrusted`, so a broken
or hostile folder ends in one error naming the file. Every failure is a ``ValueError`` naming ``--model``'s value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrim.extras import require
from vitrim.moved import moved_names
from vitrim.untrusted import expect_object, read_json

__getattr__ = moved_names(__name__)  # load_model, now load_vlm (one release)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids


def load_vlm(source: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """``(model, processor)`` from a folder or a hub id; the model in eval mode on ``device`` (float32 on CPU,
    the checkpoint's dtype elsewhere). ``ValueError`` naming ``source`` when it is neither, or not a VLM."""
    require("transformers", feature="loading a vision-language model")
    import_vision_backend()
    import transformers

    where = _checked_source(source)
    device = torch.device(device)
    dtype: Any = torch.float32 if device.type == "cpu" else "auto"
    common: dict[str, Any] = {"trust_remote_code": False}
    try:
        processor = transformers.AutoProcessor.from_pretrained(where, **common)
        model = transformers.AutoModelForImageTextToText.from_pretrained(
            where, dtype=dtype, use_safetensors=True, **common
        )
    except OSError as err:
        raise ValueError(f"--model {source}: cannot load it ({_first_line(err)})") from err
    except ValueError as err:  # transformers: "Unrecognized configuration class …" and the like
        message = f"--model {source}: not a vision-language model transformers can load ({_first_line(err)})"
        raise ValueError(message) from None
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"--model {source}: its processor ({type(processor).__name__}) reads no images")
    model.to(device)  # type: ignore[arg-type]  # transformers wraps .to
    return model.eval(), processor


def _checked_source(source: str | Path) -> str:
    """The folder (its config.json read as untrusted JSON) or the hub id, as a string for ``from_pretrained``."""
    path = Path(source).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"--model {source}: the folder has no config.json (expected a checkpoint folder)")
        expect_object(read_json(config), str(config))
        return str(path)
    if path.exists():
        raise ValueError(f"--model {source}: a file, expected a checkpoint folder or a hub id (owner/name)")
    if not HUB_ID.match(str(source)):
        raise ValueError(f"--model {source}: no such folder, and not a hub id (owner/name)")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(str(source), "config.json")
    if isinstance(cached, str):  # in the local cache: read as untrusted JSON before transformers parses it
        expect_object(read_json(cached), f"{source}/config.json")
    return str(source)


def import_vision_backend() -> None:
    """transformers' image processors use torchvision when it is installed; a wheel built for another torch fails
    at import, which :mod:`vitrim.data.vision` works around (nothing to do without torchvision)."""
    try:
        from vitrim.data.vision import _import_torchvision

        _import_torchvision()
    except ModuleNotFoundError:
        pass


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__

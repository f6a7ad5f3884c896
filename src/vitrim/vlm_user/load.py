"""Load a user's vision-language model and its processor from a checkpoint folder or a hub id.

transformers' ``AutoProcessor`` and ``AutoModelForImageTextToText`` read the folder (a hub id: its snapshot in the
local hub cache, never the network); no code from the checkpoint runs: ``trust_remote_code`` stays off and the
weights are read from safetensors only. Every file is read first as untrusted data
(:mod:`vitrim.vlm_user.folder_checks`), so a broken or hostile folder ends in one error naming the file and
field. Every failure is a ``ValueError`` naming ``--model``'s value.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrim.extras import require
from vitrim.moved import moved_names
from vitrim.vlm_user.folder_checks import check_fits_weights, check_folder

__getattr__ = moved_names(__name__)  # load_model, now load_vlm (one release)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids


def load_vlm(source: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """``(model, processor)`` from a folder or a hub id; the model in eval mode on ``device`` (float32 on CPU,
    the checkpoint's dtype elsewhere). ``ValueError`` naming ``source`` when it is neither, or not a VLM.

    Nothing is fetched: a hub id is read from the local hub cache only (``local_files_only``). Every file is
    checked as data before transformers builds anything (:mod:`vitrim.vlm_user.folder_checks`), the weights
    must cover every tensor of the model the config describes, and the chat template must render a turn."""
    require("transformers", feature="loading a vision-language model")
    import_vision_backend()
    import transformers

    name = f"--model {source}"
    folder = _checked_source(source)
    check_folder(folder, name)
    device = torch.device(device)
    dtype: Any = torch.float32 if device.type == "cpu" else "auto"
    common: dict[str, Any] = {"trust_remote_code": False, "local_files_only": True}
    with _worded(name):
        config = transformers.AutoConfig.from_pretrained(folder, **common)
    check_fits_weights(config, folder, name)
    with _worded(name):
        processor = transformers.AutoProcessor.from_pretrained(folder, **common)
        loaded: Any = transformers.AutoModelForImageTextToText.from_pretrained(
            folder,
            config=config,
            dtype=dtype,
            use_safetensors=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # mismatched tensors are reported (below, named), not raised
            **common,
        )
        model, info = loaded  # output_loading_info: (model, what was missing or mismatched)
    for kind in ("missing_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in info.get(kind) or ())
        if keys:  # transformers would fill them with random values: a model answering at random, silently
            said = "lack" if kind == "missing_keys" else "disagree in shape with"
            raise ValueError(
                f"{name}: its weights {said} {len(keys)} tensor(s) of the model config.json describes "
                f"(first: {keys[0]:.120}); the config does not describe these weights"
            )
    if not hasattr(processor, "image_processor"):
        raise ValueError(f"{name}: its processor ({type(processor).__name__}) reads no images")
    _check_processor(processor, model, name)
    model.to(device)
    return model.eval(), processor


@contextmanager
def _worded(name: str) -> Iterator[None]:
    """transformers' errors while reading a checked folder as one line naming ``--model`` (what it says in
    parentheses); the checks before leave it the cases no field names."""
    try:
        yield
    except ValueError as err:  # transformers: "Unrecognized configuration class …" and the like
        message = f"{name}: not a vision-language model transformers can load ({_first_line(err)})"
        raise ValueError(message) from None
    except Exception as err:  # a folder from outside: any library error is about that folder
        raise ValueError(f"{name}: cannot load it ({type(err).__name__}: {_first_line(err)})") from None


def _check_processor(processor: Any, model: nn.Module, name: str) -> None:
    """The processor's chat template renders a user turn (an image and a question), and the image token it
    writes is the one the model replaces with image features (else every forward fails in transformers' words)."""
    if getattr(processor, "chat_template", None):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
        try:
            processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # jinja's and the template's own errors (raise_exception)
            raise ValueError(
                f"{name}: its chat template fails on a user turn of an image and a question "
                f"({type(err).__name__}: {_first_line(err):.160})"
            ) from None
    tokenizer = getattr(processor, "tokenizer", None)
    # the token the processor repeats per image feature: the tokenizer's (Gemma 3's processor names its
    # begin-of-image so), else the processor's
    written = getattr(tokenizer, "image_token_id", None)
    written = written if isinstance(written, int) else getattr(processor, "image_token_id", None)
    if written is None and getattr(processor, "image_token", None) and tokenizer is not None:
        written = tokenizer.convert_tokens_to_ids(processor.image_token)
    expected = getattr(model.config, "image_token_id", getattr(model.config, "image_token_index", None))
    if written is not None and expected is not None and written != expected:
        raise ValueError(
            f"{name}: config.json's image token id {expected} is not the one its processor writes (id {written}); "
            "the image features would have no place in the prompt"
        )


def _checked_source(source: str | Path) -> Path:
    """The folder, or the hub id's snapshot in the local hub cache (never the network)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {source}: the folder has no config.json (expected a checkpoint folder)")
        return path
    if path.exists():
        raise ValueError(f"--model {source}: a file, expected a checkpoint folder or a hub id (owner/name)")
    if not HUB_ID.match(str(source)):
        raise ValueError(f"--model {source}: no such folder, and not a hub id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(str(source), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"--model {source}: not in the local hub cache ({HF_HUB_CACHE}); vitrim reads no network: download it "
            "first (huggingface-cli download) or give its folder"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ValueError(f"--model {source}: its cached snapshot ({snapshot}) has no config.json")
    return snapshot


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

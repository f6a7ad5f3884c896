"""``vitrim vlm ask --model FOLDER`` on folders a user was sent (issue 53): every hostile file (a config the weights
contradict, sizes as strings or past every published model, a dtype torch lacks, a tokenizer nested 100,000 deep, a
safetensors link to another file, values that would fail only at the forward, a chat template that raises) and
every hostile picture (a decompression bomb) ends in one line ``vitrim: error: --model …`` / ``--image …`` naming
the file, the field and the value, before a model is built; never a traceback, never an error in a library's words.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vitrim.cli import main

Mutation = Callable[[Path], None]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    from vitrim.vlm_user import save_tiny_vlm

    root = tmp_path_factory.mktemp("tiny")
    Image.new("RGB", (20, 16), "red").save(root / "picture.png")
    return {
        "llava": save_tiny_vlm(root / "llava", "llava"),
        "qwen2_5_vl": save_tiny_vlm(root / "qwen", "qwen2_5_vl"),
        "picture": root / "picture.png",
    }


def edit_config(change: Callable[[dict[str, Any]], None]) -> Mutation:
    def mutate(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))

    return mutate


def setter(*path: str, value: Any) -> Mutation:
    def change(config: dict[str, Any]) -> None:
        for key in path[:-1]:
            config = config[key]
        config[path[-1]] = value

    return edit_config(change)


def link_weights_to(target: str) -> Mutation:
    def mutate(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(folder / target)

    return mutate


def deep_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)


def template(text: str) -> Mutation:
    def mutate(folder: Path) -> None:
        (folder / "chat_template.jinja").write_text(text)

    return mutate


# (family, mutation, what the one line must name)
FOLDERS: dict[str, tuple[str, Mutation, list[str]]] = {
    "hidden_size as a string": ("llava", setter("text_config", "hidden_size", value="32"), ["hidden_size", "'32'"]),
    "a million layers": ("llava", setter("text_config", "num_hidden_layers", value=10**6), ["num_hidden_layers"]),
    "patch_size 0": ("llava", setter("vision_config", "patch_size", value=0), ["patch_size", "0"]),
    "an unknown dtype": ("llava", setter("dtype", value="float99"), ["dtype", "float99"]),
    "vision_feature_layer 99": ("llava", setter("vision_feature_layer", value=99), ["vision_feature_layer", "99"]),
    "image_token_index 10**9": ("llava", setter("image_token_index", value=10**9), ["image_token_index"]),
    "a wider LLM than its weights": ("llava", setter("text_config", "hidden_size", value=64), ["disagree in shape"]),
    "more layers than its weights": ("llava", setter("text_config", "num_hidden_layers", value=4), ["weights lack"]),
    "qwen: hidden_size as a string": ("qwen2_5_vl", setter("text_config", "hidden_size", value="32"), ["'32'"]),
    "qwen: image_token_id 10**9": ("qwen2_5_vl", setter("image_token_id", value=10**9), ["image_token_id"]),
    "a deep tokenizer.json": ("llava", deep_tokenizer, ["tokenizer.json", "nested"]),
    "weights linked to the config": ("llava", link_weights_to("config.json"), ["model.safetensors"]),
    "weights linked to the tokenizer": ("llava", link_weights_to("tokenizer.json"), ["model.safetensors"]),
    "a template that raises": ("llava", template("{{ raise_exception('no') }}"), ["chat template"]),
    "a template ranging to 10**9": ("llava", template("{% for i in range(10**9) %}x{% endfor %}"), ["chat template"]),
    "a template of bad syntax": ("llava", template("{% for %}"), ["chat template"]),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_hostile_folder_is_one_line_naming_model_and_field(
    case: str, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    family, mutate, named = FOLDERS[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny[family], folder)
    mutate(folder)
    argv = ["vlm", "ask", "w10", "--model", str(folder), "--image", str(tiny["picture"]), "--max-new-tokens", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vitrim: error: --model {folder}"), err
    for word in named:
        assert word in lines[0], (word, lines[0])


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares ``width``×``height`` grey pixels, with one all-zero compressed row block: a
    few hundred bytes that decode to ``width · height`` bytes (a decompression bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\0" * (width + 1) * 16)  # the first 16 rows; a decoder reading on fails or pads
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("megapixels", [144, 200])
def test_an_image_bomb_is_refused_from_its_header(
    megapixels: int, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """144 Mpx: over Pillow's limit (89 Mpx), under its error (2x): was decoded whole; 200 Mpx: Pillow's
    DecompressionBombError as a traceback. Both: one line naming --image and the pixel count, nothing decoded."""
    side = int((megapixels * 1e6) ** 0.5)
    bomb = png_header_only(tmp_path / "bomb.png", side, side)
    argv = ["vlm", "ask", "w10", "--model", str(tiny["llava"]), "--image", str(bomb), "--max-new-tokens", "1"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vitrim: error: --image {bomb}"), lines
    assert "over the limit" in lines[0]


def test_a_mistyped_hub_id_reads_the_local_cache_and_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id not in the cache is one line at once: the loader opens no connection (it retried the network for
    ~4 minutes, though --help says the local cache is read)."""
    import socket

    from vitrim.vlm_user import load_model

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("vitrim vlm ask --model opened a network connection")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(ValueError, match=r"^--model nobody-x/no-such-vlm: not in the local hub cache"):
        load_model("nobody-x/no-such-vlm")


def test_save_tiny_vlm_writes_a_whole_folder_or_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_tiny_vlm(..., "qwen2_5_vl") raised for torchvision after writing half a folder, which vlm ask --model
    then misread; a builder failing midway now leaves nothing at the path (and no temporary folder)."""
    from vitrim.vlm_user import tiny

    def half_then_fail(path: Path, seed: int) -> Path:
        (path / "config.json").write_text("{}")
        raise ModuleNotFoundError("No module named 'torchvision'")

    monkeypatch.setitem(tiny.TINY, "qwen2_5_vl", half_then_fail)
    with pytest.raises(ModuleNotFoundError):
        tiny.save_tiny_vlm(tmp_path / "qwen", "qwen2_5_vl")
    assert list(tmp_path.iterdir()) == []


def test_the_vlm_extra_installs_what_the_guide_imports() -> None:
    """`pip install 'vitrim[vlm]'` installed transformers alone: the guide's own-image block failed on PIL."""
    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {requirement.split(">")[0].split("[")[0].lower() for requirement in extras["vlm"]}
    assert {"transformers", "pillow", "torchvision"} <= names

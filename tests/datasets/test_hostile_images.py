"""Images from outside: a decompression bomb is refused before decoding in every loader, a truncated file is refused
(counted as unreadable by the datasets), a FIFO named like an image never blocks; the limit can be raised."""

from __future__ import annotations

import io
import json
import os
import struct
import tarfile
import warnings
import zlib
from pathlib import Path

import pytest
from generated import IDENTITY_PIXELS, png_bytes
from PIL import Image

from cli_invocations import tiny_checkpoint
from vitrim.cli import main
from vitrim.data import ImageFolder, ShardDataset, ShardSource, eval_transform
from vitrim.data.image_file import PIXEL_LIMIT_VARIABLE, open_image
from vitrim.data.images import read_image
from vitrim.data.transforms import read_image_for
from vitrim.models.data_config import DataConfig


@pytest.fixture(autouse=True)
def _truncated_images_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's default, whatever an earlier test in this process imported (lmms-eval's ``api.task`` sets
    ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES = True`` on import, and open_image honours the program's choice)."""
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int, rows: int = 1) -> bytes:
    """A PNG whose header declares width × height RGB pixels but holds ``rows`` rows: a bomb that is decoded
    would fail as truncated; one refused from its header never gets that far."""
    pixels = zlib.compress(b"\x00" * ((3 * width + 1) * rows))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", pixels) + _chunk(b"IEND", b"")


BOMB = png_declaring(12000, 12000)  # 144 M pixels (Pillow's limit: 89 M), about 100 bytes
TOO_BIG = "image of 12000x12000 = 144000000 pixels is over the limit of 89478485 pixels, refused before decoding"


def _truncated() -> bytes:
    whole = png_bytes(0, 0, size=32)
    return whole[: len(whole) - 20]


def test_a_bomb_is_refused_from_its_header_by_every_reader(tmp_path: Path) -> None:
    path = tmp_path / "bomb.png"
    path.write_bytes(BOMB)
    with pytest.raises(ValueError, match=TOO_BIG + r" \(a possible decompression bomb; raise the limit with "):
        open_image(path, "RGB")
    with pytest.raises(ValueError, match=TOO_BIG):
        open_image(io.BytesIO(BOMB), "RGB")
    with pytest.raises(ValueError, match=r"--image '.*bomb\.png': " + TOO_BIG):
        read_image(path, (8, 8), 3, name="--image")
    with pytest.raises(ValueError, match=r"--image '.*bomb\.png': " + TOO_BIG):
        read_image_for(path, IDENTITY_PIXELS, name="--image")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning never escapes as a warning either
        with pytest.raises(ValueError, match=TOO_BIG):
            open_image(path, "RGB")


def test_the_limit_is_pillows_and_can_be_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "wide.png"
    path.write_bytes(png_bytes(0, 0, size=40))  # 1600 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ValueError, match="image of 40x40 = 1600 pixels is over the limit of 1000 pixels"):
        open_image(path, "RGB")
    monkeypatch.setenv(PIXEL_LIMIT_VARIABLE, "2000")
    assert open_image(path, "RGB").size == (40, 40)
    monkeypatch.setenv(PIXEL_LIMIT_VARIABLE, "lots")
    with pytest.raises(ValueError, match=f"{PIXEL_LIMIT_VARIABLE} must be a positive int, got 'lots'"):
        open_image(path, "RGB")


def test_truncated_images_and_fifos_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "cut.png"
    path.write_bytes(_truncated())
    with pytest.raises(ValueError, match=r"--image '.*cut\.png' is not a readable PNG/JPEG image \(.*truncated"):
        read_image_for(path, IDENTITY_PIXELS, name="--image")
    with pytest.raises(ValueError, match="is not a readable PNG/JPEG image"):
        read_image(path, (8, 8), 3, name="--image")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.png")
        with pytest.raises(ValueError, match=r"fifo\.png' is not a regular file"):
            read_image_for(tmp_path / "fifo.png", IDENTITY_PIXELS, name="--image")
        with pytest.raises(ValueError, match="is not a regular file"):
            open_image(tmp_path / "fifo.png", "RGB")  # opened without blocking, even when given directly


def test_datasets_count_bombs_and_truncated_files_as_unreadable(tmp_path: Path) -> None:
    folder = tmp_path / "val" / "a"
    folder.mkdir(parents=True)
    (folder / "0.png").write_bytes(png_bytes(0, 0))
    (folder / "1.png").write_bytes(BOMB)
    (folder / "2.png").write_bytes(_truncated())
    dataset = ImageFolder(tmp_path / "val", ["a/0.png", "a/1.png", "a/2.png"], [0, 0, 0], ["a"], lambda x: x, "RGB")
    assert dataset[0] is not None and dataset[1] is None and dataset[2] is None

    pytest.importorskip("webdataset")
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for key, data in [("0", png_bytes(0, 0)), ("1", BOMB), ("2", _truncated())]:
            for name, payload in [(f"{key}.png", data), (f"{key}.cls", b"0")]:
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "_info.json").write_text(json.dumps({"num_classes": 1}))
    shards = ShardDataset(ShardSource.parse(str(tmp_path / "s.tar")), eval_transform(IDENTITY_PIXELS), "RGB")
    assert [sample is not None for sample in shards] == [True, False, False]


def test_viz_image_bomb_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tiny_checkpoint(tmp_path)
    (tmp_path / "bomb.png").write_bytes(BOMB)
    argv = ["viz", "attention", "--checkpoint", str(checkpoint), "--image", str(tmp_path / "bomb.png")]
    assert main([*argv, "--out", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitrim: error: --image ") and TOO_BIG in err and err.count("\n") == 1, err
    assert not (tmp_path / "o.png").exists()


def test_an_extreme_aspect_ratio_is_refused_before_the_resize(tmp_path: Path) -> None:
    """20000×1 pixels pass the decoder's limit, but a shorter side resized to 224 would make 4,480,000×224."""
    path = tmp_path / "line.png"
    Image.new("RGB", (20000, 1), (9, 9, 9)).save(path)
    config = DataConfig(input_size=(3, 224, 224), crop_pct=1.0)
    with pytest.raises(ValueError, match=r"--image '.*line\.png': image of 20000x1 pixels would be resized to about "):
        read_image_for(path, config, name="--image")
    dataset = ImageFolder(tmp_path, ["line.png"], [0], ["a"], eval_transform(config), "RGB")
    assert dataset[0] is None  # counted as unreadable
    squash = DataConfig(input_size=(3, 8, 8), crop_pct=1.0, crop_mode="squash")  # resizes each side: no blow-up
    assert read_image_for(path, squash).shape == (3, 8, 8)
    assert read_image_for(path, IDENTITY_PIXELS.__class__(input_size=(3, 2, 2), crop_pct=1.0)).shape == (3, 2, 2)

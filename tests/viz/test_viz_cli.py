"""``vitrim viz attention|rollout|tokens``: PNGs from a saved checkpoint, and one-line errors with exit code 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitrim
from vitrim.cli import main
from vitrim.data.images import read_image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    tiny = dict(img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10)
    dynamic = vitrim.create_model("dynamicvit_tiny_patch16_224", **tiny)
    dense = vitrim.create_model("vit_tiny_patch16_224", **tiny)
    return {
        "dynamic": str(vitrim.save_checkpoint(dynamic, folder / "dynamic.safetensors")),
        "dense": str(vitrim.save_checkpoint(dense, folder / "dense.safetensors")),
    }


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("img") / "picture.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)).save(path)
    return str(path)


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 2_000


@pytest.mark.parametrize("kind", ["attention", "rollout", "tokens"])
def test_dynamicvit_checkpoint_and_a_digit(checkpoints, tmp_path, capsys, kind):
    out = tmp_path / f"{kind}.png"
    assert main(["viz", kind, "--checkpoint", checkpoints["dynamic"], "--digits", "2", "--out", str(out)]) == 0
    assert_png(out)
    assert f"wrote {out}" in capsys.readouterr().out


def test_rollout_from_an_image_file(checkpoints, picture, tmp_path):
    out = tmp_path / "r.png"
    args = ["viz", "rollout", "--checkpoint", checkpoints["dense"], "--image", picture, "--out", str(out)]
    assert main([*args, "--head-fusion", "max", "--discard-ratio", "0.5"]) == 0
    assert_png(out)


def test_read_image_resizes_and_normalises(picture):
    from PIL import Image

    image = read_image(picture, (16, 16), 3)
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    with Image.open(picture) as f:
        expected = np.asarray(f.convert("RGB").resize((16, 16), Image.Resampling.BILINEAR), dtype=np.float32)
    np.testing.assert_allclose(image.permute(1, 2, 0).numpy(), expected / 127.5 - 1.0, atol=1e-6)
    assert read_image(picture, (8, 12), 1).shape == (1, 8, 12)


def run_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitrim: error: ") and "\n" not in err
    return err


def test_errors_exit_2_with_one_line(checkpoints, picture, tmp_path, capsys):
    out = str(tmp_path / "x.png")
    err = run_error(["viz", "attention", "--checkpoint", str(tmp_path / "nope.safetensors"), "--digits", "0",
                     "--out", out], capsys)  # fmt: skip
    assert "does not exist" in err and "nope.safetensors" in err
    err = run_error(["viz", "tokens", "--checkpoint", checkpoints["dense"], "--digits", "0", "--out", out], capsys)
    assert "needs a DynamicViT" in err
    err = run_error(["viz", "rollout", "--checkpoint", checkpoints["dense"], "--image", str(tmp_path / "no.png"),
                     "--out", out], capsys)  # fmt: skip
    assert "--image" in err and "does not exist" in err
    not_an_image = tmp_path / "fake.png"
    not_an_image.write_text("hello")
    err = run_error(["viz", "rollout", "--checkpoint", checkpoints["dense"], "--image", str(not_an_image),
                     "--out", out], capsys)  # fmt: skip
    assert "not a readable PNG/JPEG" in err
    err = run_error(["viz", "attention", "--checkpoint", checkpoints["dense"], "--digits", "99999", "--out", out],
                    capsys)  # fmt: skip
    assert "--digits must be in [0, " in err  # within the option's bound, past the test digits
    with pytest.raises(SystemExit):  # out of the option's bound: argparse's error, before the model is read
        main(["viz", "rollout", "--checkpoint", checkpoints["dense"], "--digits", "0", "--out", out,
              "--discard-ratio", "1.5"])  # fmt: skip
    assert "argument --discard-ratio: expected a number in [0, 1) (the share of each block's weakest links " in (
        capsys.readouterr().err
    )
    err = run_error(["viz", "attention", "--checkpoint", checkpoints["dense"], "--digits", "0",
                     "--out", str(tmp_path / "missing" / "x.png")], capsys)  # fmt: skip
    assert "does not exist" in err
    err = run_error(["viz", "attention", "--model", "vit_tiny_patch16_22", "--digits", "0", "--out", out], capsys)
    assert "unknown model" in err


def test_a_picture_source_is_required(checkpoints, capsys):
    with pytest.raises(SystemExit) as info:
        main(["viz", "attention", "--checkpoint", checkpoints["dense"], "--out", "x.png"])
    assert info.value.code == 2
    assert "one of the arguments --image --digits is required" in capsys.readouterr().err

"""Image folders from outside: the listing follows no link out of the root and no loop, lists regular files only,
skips and counts names that are not UTF-8; a folder of class folders given to ``vitrim eval`` is evaluated whole."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from generated import IDENTITY_PIXELS, write_folder

import vitrim
from cli_invocations import TINY
from vitrim.cli import main
from vitrim.data import ImageFolder, image_folder_splits, whole_dataset
from vitrim.literals import parse_assignments
from vitrim.train import evaluate_checkpoint

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="symlinks, FIFOs and byte file names: POSIX")


def _listed(root: Path) -> tuple[list[str], int]:
    dataset = ImageFolder.of_class_folders(root, lambda x: x, "RGB")
    return sorted(f.decode() for f in dataset.files), dataset.num_unlisted


def test_links_out_of_the_root_and_loops_are_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_folder(root, [2, 1])  # class_0: 2 images, class_1: 1
    outside = tmp_path / "elsewhere"
    write_folder(outside, [3])
    (root / "class_0" / "up").symlink_to("..")  # a loop: would list every image again at every level
    (root / "class_0" / "self").symlink_to(".")
    (root / "class_1" / "away").symlink_to(outside / "class_0")  # a folder out of the root
    (root / "class_1" / "stolen.png").symlink_to(outside / "class_0" / "000000.png")  # a file out of the root
    (root / "class_1" / "other").symlink_to(root / "class_0")  # another class: its images are not class_1's
    (root / "class_1" / "sub").mkdir()
    (root / "class_1" / "sub" / "again").symlink_to("..")
    (root / "class_1" / "deeper").symlink_to("sub")  # a folder inside the class folder: followed, once
    files, unlisted = _listed(root)
    assert files == ["class_0/000000.png", "class_0/000001.png", "class_1/000002.png"]
    assert unlisted == 1  # the file link out of the root; the folder link out is not entered at all


def test_special_files_and_non_utf8_names_are_skipped_and_counted(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_folder(root, [2, 2])
    os.mkfifo(root / "class_0" / "x.png")  # would block a reader forever
    (root / "class_0" / "dir.png").mkdir()  # a folder named like an image: entered, never read as an image
    try:
        (root / os.fsdecode(b"class_1") / os.fsdecode(b"caf\xe9.png")).write_bytes(b"\x89PNG")
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    files, unlisted = _listed(root)
    assert files == ["class_0/000000.png", "class_0/000001.png", "class_1/000002.png", "class_1/000003.png"]
    assert unlisted == 2  # the FIFO and the name that is not UTF-8; the whole folder is not refused
    train, test = image_folder_splits(
        root, train_transform=lambda x: x, test_transform=lambda x: x, in_chans=3, test_fraction=0.5
    )
    assert len(train) + len(test) == 4 and test.num_unlisted == 2


def test_a_class_folder_named_in_other_bytes_is_refused(tmp_path: Path) -> None:
    write_folder(tmp_path, [1])
    try:
        (tmp_path / os.fsdecode(b"\xff\xfe")).mkdir()
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    with pytest.raises(ValueError, match=r"class folder whose name is not UTF-8 \(b'\\xff\\xfe'\); rename it"):
        ImageFolder.of_class_folders(tmp_path, lambda x: x, "RGB")


def test_eval_of_class_folders_without_splits_is_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One image per class cannot be split into train and test: eval reads every image, none held out."""
    root = tmp_path / "data"
    write_folder(root, [1, 1, 1])
    os.mkfifo(root / "class_2" / "pipe.png")
    dataset, classes = whole_dataset(str(root), data_config=IDENTITY_PIXELS)
    assert len(dataset) == 3 and classes == ["class_0", "class_1", "class_2"]
    options = parse_assignments(TINY, "TINY") | {"in_chans": 3}
    model = vitrim.create_model("vit_tiny_patch16_224", num_classes=3, **options)
    checkpoint = vitrim.save_checkpoint(model, tmp_path / "m.safetensors")
    metrics = evaluate_checkpoint(checkpoint, data=str(root), device="cpu")
    assert metrics["num_samples"] == 3 and metrics["num_skipped"] == 1  # the FIFO, counted, and eval did not block
    assert main(["eval", str(checkpoint), "--data", str(root), "--quiet", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "3 images" in out and "1 unreadable image(s) skipped" in out

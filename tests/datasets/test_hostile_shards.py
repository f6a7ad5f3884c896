"""Shards and their ``_info.json`` are checked, not trusted: a bad ``_info.json`` is one ValueError naming the field,
a label outside the classes or a file too big to read is counted as unreadable, a corrupt tar is a clear error when
counted and one unreadable sample when streamed: never a tarfile / AttributeError traceback."""

from __future__ import annotations

import io
import json
import tarfile
import warnings
from pathlib import Path

import pytest
from generated import IDENTITY_PIXELS, png_bytes, sample_ids, write_shards
from torch.utils.data import DataLoader

from vitrim.data import ReadableBatches, ShardDataset, ShardSource, collate_readable, eval_transform
from vitrim.data.tar_samples import MAX_MEMBER_BYTES

pytest.importorskip("webdataset")


def _read_all(source: ShardSource) -> tuple[list[int], list[int], int]:
    """(sample ids, labels, unreadable count) of one pass over every shard."""
    dataset = ShardDataset(source, eval_transform(IDENTITY_PIXELS), "RGB")
    batches = ReadableBatches(DataLoader(dataset, batch_size=4, collate_fn=collate_readable), "shards")
    ids: list[int] = []
    labels: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the count is checked instead of the warning that reports it
        for images, batch_labels in batches:
            ids += sample_ids(images)
            labels += batch_labels.tolist()
    return ids, labels, batches.num_skipped


def _tar(path: Path, members: list[tuple[str, bytes | None, int | None]]) -> None:
    """A tar of (name, data, declared size): data None writes the header alone, declaring ``size`` bytes."""
    with tarfile.open(path, "w") as tar:
        for name, data, size in members:
            info = tarfile.TarInfo(name)
            info.size = len(data) if data is not None else int(size or 0)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"num_classes": -3}, r"'num_classes' must be an int from 1 to \d+, got -3"),
        ({"num_classes": 0}, r"'num_classes' must be an int from 1"),
        ({"num_classes": 2.5}, r"'num_classes' must be an int from 1 .*got 2\.5"),
        ({"num_classes": 10**12}, r"'num_classes' must be an int from 1 to 1000000"),
        ({"num_classes": "3"}, r"'num_classes' must be an int .*got '3'"),
        ({"classes": []}, r"'classes' must be a list of 1 to \d+ class names"),
        ({"classes": "abc"}, r"'classes' must be a list"),
        ({"classes": [1, 2]}, r"'classes' must be a list of 1 to \d+ class names \(strings\), got \[1, 2\]"),
        ({"classes": ["a", "b"], "splits": []}, r"'splits' must be an object"),
        ({"classes": ["a", "b"], "splits": {"t": 3}}, r"splits\['t'\] must be an object"),
        (
            {"classes": ["a", "b"], "splits": {"t": {"filenames": ["s-000000.tar"], "shard_lengths": [-5]}}},
            r"splits\['t'\]\['shard_lengths'\] must be a list of sample counts \(ints from 0 .*got \[-5\]",
        ),
        (
            {"classes": ["a", "b"], "splits": {"t": {"filenames": ["s-000000.tar"], "shard_lengths": [1e300]}}},
            r"\['shard_lengths'\] must be a list of sample counts",
        ),
        (
            {"classes": ["a", "b"], "splits": {"t": {"filenames": ["s-000000.tar"], "shard_lengths": [1, 2]}}},
            r"lists 1 filenames but 2 shard_lengths",
        ),
        ({"classes": ["a", "b"], "splits": {"t": {"filenames": "s-000000.tar"}}}, r"\['filenames'\] must be a list"),
        ("[]", r"_info\.json: expected a JSON object, got list"),
        ('{"num_classes": Infinity}', r"_info\.json: the non-finite number Infinity"),
        ("[" * 100_000 + "]" * 100_000, r"_info\.json: JSON nested 100000 levels deep"),
        ("{", r"_info\.json: not valid JSON"),
    ],
)
def test_info_json_of_the_wrong_shape_is_one_clear_error(tmp_path: Path, info: object, expected: str) -> None:
    pattern = write_shards(tmp_path, "s", [2], num_classes=2)
    (tmp_path / "_info.json").write_text(info if isinstance(info, str) else json.dumps(info))
    with pytest.raises(ValueError, match=expected) as err:
        ShardSource.parse(pattern)
    assert "\n" not in str(err.value)


def test_info_counts_are_used_when_valid(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path, "s", [2, 3], num_classes=2)
    splits = {"train": {"filenames": ["s-000000.tar", "s-000001.tar"], "shard_lengths": [2, 3]}}
    (tmp_path / "_info.json").write_text(json.dumps({"num_classes": 2, "splits": splits}))
    source = ShardSource.parse(pattern)
    assert source.num_samples == 5 and source.classes == ("0", "1")
    with pytest.raises(ValueError, match=r"sample count after '\|' must be a positive int, got 'abc'"):
        ShardSource.parse(pattern + "|abc")


def test_labels_outside_the_classes_are_counted_not_learnt(tmp_path: Path) -> None:
    members = []
    for sample_id, label in enumerate([0, 99, 1, -1, 2, 3, 1]):  # 3 classes: 99, -1 and 3 are outside
        members += [(f"{sample_id:04d}.png", png_bytes(sample_id, max(label, 0)), None)]
        members += [(f"{sample_id:04d}.cls", str(label).encode(), None)]
    _tar(tmp_path / "s-000000.tar", members)
    (tmp_path / "_info.json").write_text(json.dumps({"num_classes": 3}))
    ids, labels, skipped = _read_all(ShardSource.parse(str(tmp_path / "s-000000.tar")))
    assert sorted(ids) == [0, 2, 4, 6] and sorted(labels) == [0, 1, 1, 2]
    assert skipped == 3


def test_a_header_declaring_8_gib_and_a_corrupt_tar_are_clear(tmp_path: Path) -> None:
    declared = 8 * 2**30
    assert declared > MAX_MEMBER_BYTES
    _tar(tmp_path / "s-000000.tar", [("0000.png", png_bytes(0, 0), None), ("0000.cls", b"0", None)])
    _tar(tmp_path / "s-000001.tar", [("0001.png", None, declared), ("0001.cls", b"0", None)])
    (tmp_path / "_info.json").write_text(json.dumps({"num_classes": 2}))
    pattern = str(tmp_path / "s-{000000..000001}.tar")
    with pytest.raises(ValueError, match=rf"'0001\.png' declares {declared} bytes, over the limit of"):
        ShardSource.parse(pattern)  # counting from the headers: the header is checked, no data is read
    ids, _, skipped = _read_all(ShardSource.parse(pattern + "|2"))
    assert ids == [0] and skipped >= 1  # streaming: the 8 GiB file is never read, its sample counted

    (tmp_path / "s-000001.tar").write_bytes(b"not a tar at all" * 40)
    with pytest.raises(ValueError, match=r"shard '.*s-000001\.tar' is not a readable tar file"):
        ShardSource.parse(pattern)
    good = (tmp_path / "s-000000.tar").read_bytes()
    (tmp_path / "s-000001.tar").write_bytes(good[: 512 + len(png_bytes(0, 0)) // 2])  # cut inside the first image
    with pytest.raises(ValueError, match=r"'0000\.png' declares \d+ bytes, but the file ends before them"):
        ShardSource.parse(pattern)
    ids, _, skipped = _read_all(ShardSource.parse(pattern + "|2"))
    assert ids == [0] and skipped == 1

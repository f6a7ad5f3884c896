"""WebDataset shards: brace patterns, sample counts, class names, and which worker of which rank reads what."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch
from generated import IDENTITY_PIXELS, sample_ids, write_shards
from torch.utils.data import DataLoader

from vitrim.data import ReadableBatches, ShardDataset, ShardSource, build_datasets, collate_readable, eval_transform
from vitrim.data.shards import shards_for

pytest.importorskip("webdataset")


def test_pattern_counts_and_classes(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path, "train", [4, 3, 5], num_classes=3)
    source = ShardSource.parse(pattern)
    assert [Path(u).name for u in source.urls] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert source.num_samples == 12  # counted from the tar headers
    assert source.classes == ("class_0", "class_1", "class_2")
    assert ShardSource.parse(pattern + "|11").num_samples == 11  # timm's way to state it
    one = str(tmp_path / "train-{000001..000002}.tar")
    assert ShardSource.parse(one).num_samples == 8


def test_bad_patterns_name_what_is_missing(tmp_path: Path) -> None:
    pattern = write_shards(tmp_path / "a", "train", [2], num_classes=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ShardSource.parse(pattern.replace("..000000}", "..000003}"))  # shards 1-3 were never written
    (tmp_path / "a" / "_info.json").unlink()
    with pytest.raises(ValueError, match=r"_info\.json"):
        ShardSource.parse(pattern)


@pytest.mark.parametrize("world_size, workers", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_ranks_and_workers_partition_the_shards_every_epoch(world_size: int, workers: int) -> None:
    for epoch in range(3):
        taken = [
            i
            for rank in range(world_size)
            for worker in range(workers)
            for i in shards_for(
                10, rank=rank, world_size=world_size, worker=worker, num_workers=workers, epoch=epoch, seed=5,
                shuffle=True,
            )
        ]  # fmt: skip
        assert sorted(taken) == list(range(10))
    first = shards_for(10, rank=0, world_size=2, worker=0, num_workers=1, epoch=0, seed=5, shuffle=True)
    second = shards_for(10, rank=0, world_size=2, worker=0, num_workers=1, epoch=1, seed=5, shuffle=True)
    assert first != second  # a new shard order each epoch


def test_stream_reads_every_sample_once_and_counts_a_bad_one(tmp_path: Path) -> None:
    import webdataset as wds

    pattern = write_shards(tmp_path, "val", [5, 5, 4], num_classes=2)
    with wds.TarWriter(str(tmp_path / "val-000003.tar")) as writer:  # one more shard: a broken image, a good one
        writer.write({"__key__": "bad", "png": b"not a png", "cls": "0"})
        good = io.BytesIO()
        from PIL import Image

        Image.new("RGB", (8, 8), (14, 0, 40)).save(good, format="PNG")
        writer.write({"__key__": "late", "png": good.getvalue(), "cls": "1"})
    pattern = pattern.replace("000002}", "000003}")
    dataset = ShardDataset(ShardSource.parse(pattern), eval_transform(IDENTITY_PIXELS), "RGB", shuffle=True, seed=1)
    batches = ReadableBatches(DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_readable), pattern)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids = [i for images, _ in batches for i in sample_ids(images)]
    assert sorted(ids) == sorted([*range(14), 14])  # each sample once; the late one's colour is id 14
    assert batches.num_skipped == 1 and len(caught) == 1 and "skipped 1 unreadable" in str(caught[0].message)


def test_shards_need_evaluation_data_and_check_its_classes(tmp_path: Path) -> None:
    train = write_shards(tmp_path / "train", "train", [4, 4], num_classes=2)
    val = write_shards(tmp_path / "val", "val", [3], num_classes=2, first_id=100)
    with pytest.raises(ValueError, match="as val_data"):  # the argument; the CLI shows --val-data
        build_datasets(train, data_config=IDENTITY_PIXELS)
    splits = build_datasets(train, data_config=IDENTITY_PIXELS, val_data=val)
    assert splits.classes == ["class_0", "class_1"]
    images = torch.stack([sample[0] for sample in splits.test])  # type: ignore[attr-defined]
    assert sorted(sample_ids(images)) == [100, 101, 102]
    other = write_shards(tmp_path / "other", "val", [3], num_classes=3)
    with pytest.raises(ValueError, match="classes"):
        build_datasets(train, data_config=IDENTITY_PIXELS, val_data=other)

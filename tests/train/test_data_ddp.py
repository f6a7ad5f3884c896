"""Two gloo processes: each rank reads its own shards (or its share of a folder); together, every sample once."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[1] / "datasets"))
from generated import IDENTITY_PIXELS, sample_ids, write_folder, write_shards

from vitrim.data import Augment, build_datasets
from vitrim.train.distributed import cleanup_distributed, setup_distributed
from vitrim.train.loaders import eval_batches, lockstep, train_batches

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _epoch_ids(data: str, val: str, info: object, *, batch_size: int, workers: int, epoch: int) -> dict:
    splits = build_datasets(
        data, data_config=IDENTITY_PIXELS, augment=Augment.none(), val_data=val, rank=info.rank,  # type: ignore[attr-defined]
        world_size=info.world_size, seed=3,  # type: ignore[attr-defined]
    )  # fmt: skip
    batches = train_batches(
        splits.train,
        batch_size=batch_size,
        accum_steps=1,
        info=info,
        seed=3,
        workers=workers,
        source=data,  # type: ignore[arg-type]
    )
    batches.set_epoch(splits.train, epoch)
    train = [sample_ids(images) for images, _ in lockstep(batches.batches, info, batches.steps)]  # type: ignore[arg-type]
    test = eval_batches(splits.test, batch_size=4, info=info, workers=workers, source=val)  # type: ignore[arg-type]
    return {"train": train, "test": [i for images, _ in test for i in sample_ids(images)]}


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    mp.set_start_method("fork", force=True)  # DataLoader workers fork, as in a process torchrun starts on Linux
    info = setup_distributed("cpu")
    r = Path(root)
    try:
        patterns = json.loads((r / "pattern.json").read_text())
        result = {
            f"{name}-{epoch}": _epoch_ids(
                patterns[name], patterns[f"{name}_val"], info, batch_size=8, workers=2 if name == "shards" else 0,
                epoch=epoch,
            )
            for name in ("shards", "uneven", "folder")
            for epoch in (0, 1)
        }  # fmt: skip
    finally:
        cleanup_distributed()
    (r / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.full  # two processes with gloo: 7-11 s on 2 cores
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_each_rank_reads_its_own_part_and_together_every_sample_once(tmp_path: Path) -> None:
    pytest.importorskip("webdataset")
    patterns = {
        "shards": write_shards(tmp_path / "s", "train", [6, 6, 6, 6], num_classes=2),  # ids 0-23
        "shards_val": write_shards(tmp_path / "s_val", "val", [3, 3, 2], num_classes=2, first_id=1000),
        "uneven": write_shards(tmp_path / "u", "train", [7, 7, 3, 1], num_classes=2),  # 18: 2 steps of 8 at most
        "uneven_val": write_shards(tmp_path / "u_val", "val", [5], num_classes=2, first_id=1000),  # one shard, 2 ranks
    }
    write_folder(tmp_path / "f" / "train", [10, 6])  # ids 0-15: 2 global batches of 8
    write_folder(tmp_path / "f" / "val", [3, 4], first_id=2000)  # 7: not divisible by the ranks
    patterns.update(folder=str(tmp_path / "f"), folder_val=str(tmp_path / "f" / "val"))
    (tmp_path / "pattern.json").write_text(json.dumps(patterns))
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for epoch in (0, 1):
        for name, train_ids, test_ids in (
            ("shards", range(24), range(1000, 1008)),
            ("folder", range(16), range(2000, 2007)),
        ):
            runs = [rank[f"{name}-{epoch}"] for rank in ranks]
            seen = [i for run in runs for batch in run["train"] for i in batch]
            assert sorted(seen) == list(train_ids), (name, epoch)  # every sample once across the ranks
            assert all(len(batch) == 4 for run in runs for batch in run["train"])  # 8 = 4 per rank
            assert sorted(i for run in runs for i in run["test"]) == list(test_ids), (name, epoch)
        mine = [set(i for batch in rank[f"shards-{epoch}"]["train"] for i in batch) for rank in ranks]
        assert all(len({i // 6 for i in ids}) == 2 for ids in mine)  # each rank streamed two whole shards
    assert ranks[0]["shards-0"]["train"] != ranks[0]["shards-1"]["train"]  # reshuffled each epoch
    for epoch in (0, 1):  # shards of unequal sizes: the ranks stop together, no sample twice
        runs = [rank[f"uneven-{epoch}"] for rank in ranks]
        assert len(runs[0]["train"]) == len(runs[1]["train"]) >= 1
        seen = [i for run in runs for batch in run["train"] for i in batch]
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(18))
        assert sorted(i for run in runs for i in run["test"]) == list(range(1000, 1005))

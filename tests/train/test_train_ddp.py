"""DDP: two CPU processes (gloo) compute what one process computes with the same global batch."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from vitrim.train import TrainConfig, train

TINY_VIT = dict(img_size=16, patch_size=4, in_chans=1, embed_dim=16, depth=1, num_heads=2)


def _config(out: Path) -> TrainConfig:
    return TrainConfig(
        model="vit_tiny_patch16_224", out=str(out), epochs=1, overrides=TINY_VIT, batch_size=128, quiet=True,
        device="cpu", warmup_epochs=0.5,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    train(_config(Path(out)))


def _last_metrics(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.full  # two processes with gloo: 7-11 s on 2 cores
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_two_processes_match_one(tmp_path: Path) -> None:
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        assert name not in os.environ
    train(_config(single))
    mp.spawn(_worker, args=(2, _free_port(), str(ddp)), nprocs=2, join=True)

    a, b = _last_metrics(single), _last_metrics(ddp)
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-5)
    assert b["test_top1"] == pytest.approx(a["test_top1"], abs=1 / 359 + 1e-9)  # a tie may flip one prediction
    assert b["test_num_samples"] == a["test_num_samples"] == 359  # the ranks' shares add up to the whole split
    wa, wb = load_file(single / "last.safetensors"), load_file(ddp / "last.safetensors")
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-5, msg=key)
    assert sorted(p.name for p in ddp.iterdir()) == sorted(p.name for p in single.iterdir())  # rank 0 alone wrote

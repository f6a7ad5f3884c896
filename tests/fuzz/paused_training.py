"""``python paused_training.py EVENT N -- TRAIN-ARGS…``: ``vitrim train`` that stops dead at the N-th EVENT.

At that moment it prints ``paused at EVENT N`` on stdout and waits for a signal that never comes but the test's
SIGKILL, so the kill lands at an exact point of the run instead of after a guessed sleep. Events:

* ``metrics``: the epoch's line was appended to metrics.jsonl (its ``last.pt`` not yet written);
* ``checkpoint``: the epoch's ``last.pt`` was written whole (the epoch is committed);
* ``mid-write``: ``last.pt``'s temporary file holds half of its bytes and has not replaced ``last.pt`` yet.

The run's own code is untouched: the hooks wrap the functions the loop calls, in this process only.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from vitrim.cli import main
from vitrim.train import loop, state

event, nth = sys.argv[1], int(sys.argv[2])
seen = 0


def is_the_moment(name: str) -> bool:
    """Whether this is the N-th time the run reaches EVENT (counted across the whole run)."""
    global seen
    seen += name == event
    return name == event and seen == nth


def pause() -> None:
    print(f"paused at {event} {nth}", flush=True)
    while True:
        signal.pause()


def reached(name: str) -> None:
    if is_the_moment(name):
        pause()


real_save_epoch, real_atomic_write = loop._save_epoch, state.atomic_write


def save_epoch(out: Path, *args: Any) -> None:
    real_save_training_state = loop.save_training_state

    def save_state(path: Path, saved: dict[str, Any]) -> Path:
        reached("metrics")  # _save_epoch appends the metrics line just before it writes last.pt
        written = real_save_training_state(path, saved)
        reached("checkpoint")
        return written

    loop.save_training_state = save_state
    try:
        real_save_epoch(out, *args)
    finally:
        loop.save_training_state = real_save_training_state


def atomic_write(path: Path, write: Any) -> Path:
    def half_then_pause(tmp: Path) -> None:
        write(tmp)
        if Path(path).name == loop.LAST and is_the_moment("mid-write"):
            data = tmp.read_bytes()
            tmp.write_bytes(data[: len(data) // 2])
            pause()

    return real_atomic_write(path, half_then_pause)


loop._save_epoch = save_epoch
state.atomic_write = atomic_write
sys.exit(main(sys.argv[sys.argv.index("--") + 1 :]))

"""The devices vitrim runs on: ``cpu``, ``cuda``, ``cuda:N``, checked once where a user names one."""

from __future__ import annotations

import torch


def parse_device(device: str | torch.device, name: str = "device") -> torch.device:
    """``device`` as a torch.device: cpu or cuda (cuda only where torch sees a CUDA device).

    ``name`` is what the error calls the value: ``device`` for a function argument, ``--device`` for a CLI option.
    """
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be cpu, cuda or cuda:N, got {device!r}") from None
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be cpu, cuda or cuda:N, got {device!r}")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name} {device!r}: torch sees no CUDA device here")
    return target

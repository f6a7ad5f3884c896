"""Weights far from a random init's: its near-uniform attention would make every selection and merge alike."""

from __future__ import annotations

import torch


def spread(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with N(0, 0.2²) added to every weight, in place, from torch's global generator (so call it right
    after building the model under ``torch.manual_seed``: the same seed gives the same weights)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    return model

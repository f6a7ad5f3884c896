"""DynamicViT's training loss, by its public name: ``vitrim.losses.DynamicViTLoss``.

The loss lives with its reducer, in :mod:`vitrim.reduce.dynamicvit_loss` (the formula and the official defaults
are written there); this module keeps the name users import.
"""

from vitrim.reduce.dynamicvit_loss import DynamicViTLoss, DynamicViTLossParts

__all__ = ["DynamicViTLoss", "DynamicViTLossParts"]

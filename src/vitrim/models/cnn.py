"""A small convolutional network, the baseline a ViT is compared with on the same data.

A convolution slides one small filter over every position: it sees a 3×3 neighbourhood at a time and builds a
global view only through depth and pooling. Attention relates every patch to every other patch in one layer. The
demo trains both on ``digits`` so the two ideas can be compared on accuracy, FLOPs and throughput.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from vitrim.models.config import replace_checked
from vitrim.models.inputs import check_images
from vitrim.models.layers import to_2tuple
from vitrim.models.registry import register_model


@dataclass(frozen=True)
class CNNConfig:
    """Architecture of :class:`SmallCNN`. Each stage: two 3×3 conv–GroupNorm–GELU, then 2×2 max-pool."""

    img_size: tuple[int, int] = (32, 32)  # any size runs (global average pooling); kept so data can match it
    in_chans: int = 3
    num_classes: int = 1000
    widths: tuple[int, ...] = (16, 32, 64)  # channels per stage; each stage halves the resolution
    # GroupNorm, not BatchNorm: a sample's output does not depend on the rest of its batch, so DDP with any number
    # of processes computes exactly what one process computes with the same global batch.
    groups: int = 8
    drop_rate: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", to_2tuple(self.img_size, "img_size"))
        object.__setattr__(self, "widths", tuple(self.widths))
        for name in ("in_chans", "groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {self.num_classes!r}")
        if not self.widths or any(not isinstance(w, int) or w % self.groups for w in self.widths):
            raise ValueError(f"widths must be ints divisible by groups={self.groups}, got {self.widths!r}")
        if not 0.0 <= self.drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {self.drop_rate!r}")

    def replace(self, **changes: Any) -> CNNConfig:
        """A copy with some fields changed; unknown names raise a clear error."""
        return replace_checked(self, changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _conv(cin: int, cout: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(groups, cout), nn.GELU())


class SmallCNN(nn.Module):
    """Images (B, C, H, W) -> logits (B, num_classes); H and W must be at least 2**len(widths)."""

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        self.config = config
        stages: list[nn.Module] = []
        cin = config.in_chans
        for width in config.widths:
            stages += [_conv(cin, width, config.groups), _conv(width, width, config.groups), nn.MaxPool2d(2)]
            cin = width
        self.features = nn.Sequential(*stages)
        self.head_drop = nn.Dropout(config.drop_rate)
        self.head: nn.Module = nn.Linear(cin, config.num_classes) if config.num_classes > 0 else nn.Identity()

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, widths[-1], H / 2**stages, W / 2**stages)."""
        first_conv = next(m for m in self.features.modules() if isinstance(m, nn.Conv2d))
        check_images(images, in_chans=self.config.in_chans, weight=first_conv.weight)
        return self.features(images)

    def forward_head(self, features: Tensor) -> Tensor:
        """(B, C', h, w) -> logits (B, num_classes), through global average pooling."""
        return self.head(self.head_drop(features.mean(dim=(2, 3))))

    def forward(self, images: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(images))


@register_model
def cnn_small(**overrides: Any) -> SmallCNN:
    """Three stages of 16/32/64 channels (about 10 M multiply-adds on a 1×32×32 image)."""
    return SmallCNN(CNNConfig().replace(**overrides))

"""Stand-in for issue 28's eval_transform (branch i28) until that branch is merged here; replaced then, not kept."""

from __future__ import annotations

import math
from typing import Any

import torch

from vitrim.data.vision import transforms_v2
from vitrim.models.data_config import DataConfig


def eval_transform(data_config: DataConfig) -> Any:
    v2 = transforms_v2()
    _, h, w = data_config.input_size
    scale = (math.floor(h / data_config.crop_pct), math.floor(w / data_config.crop_pct))
    interp = v2.InterpolationMode(data_config.interpolation)
    size = scale[0] if h == w else scale
    return v2.Compose(
        [
            v2.Resize(size, interpolation=interp),
            v2.CenterCrop((h, w)),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(data_config.mean, data_config.std),
        ]
    )

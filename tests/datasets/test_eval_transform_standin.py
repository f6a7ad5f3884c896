"""The stand-in eval transform (until issue 28's is merged) equals timm's eval transform on square model sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vitrim.data import eval_transform
from vitrim.models.data_config import DEIT, DINOV2, SIGLIP


@pytest.mark.parametrize("config", [DEIT, DINOV2, SIGLIP.for_input(3, (32, 32))], ids=["deit", "dinov2", "siglip32"])
@pytest.mark.parametrize("size", [(300, 200), (180, 260)])
def test_equals_timms_eval_transform(config, size: tuple[int, int]) -> None:
    timm_data = pytest.importorskip("timm.data")
    image = Image.fromarray(np.random.default_rng(sum(size)).integers(0, 256, (*size[::-1], 3), dtype=np.uint8))
    theirs = timm_data.create_transform(
        input_size=config.input_size, is_training=False, interpolation=config.interpolation, mean=config.mean,
        std=config.std, crop_pct=config.crop_pct,
    )  # fmt: skip
    torch.testing.assert_close(eval_transform(config)(image), theirs(image), atol=1e-6, rtol=0)

"""The DeiT recipe's augmentations: the crop-flip-normalise path equals timm's, mixup / cutmix targets by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vitrim.data import Augment, MixupCutmix, train_transform
from vitrim.models.data_config import IMAGENET_MEAN, IMAGENET_STD, DataConfig

CONFIG = DataConfig(input_size=(3, 24, 24), mean=IMAGENET_MEAN, std=IMAGENET_STD, interpolation="bicubic")


def _photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", [(40, 30), (30, 41), (24, 24)])
def test_deterministic_settings_equal_timms_training_transform(size: tuple[int, int]) -> None:
    timm_data = pytest.importorskip("timm.data")
    # area 1 and aspect 1: RandomResizedCrop falls back to the centre square, so both sides are deterministic
    ours = train_transform(CONFIG, Augment.none().replace(hflip=1.0))
    theirs = timm_data.create_transform(
        input_size=CONFIG.input_size, is_training=True, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=1.0, vflip=0.0,
        color_jitter=None, auto_augment=None, interpolation="bicubic", mean=IMAGENET_MEAN, std=IMAGENET_STD,
        re_prob=0.0,
    )  # fmt: skip
    image = _photo(*size, seed=sum(size))
    torch.testing.assert_close(ours(image), theirs(image), atol=1e-6, rtol=0)


def test_the_full_recipe_makes_normalised_tensors_of_the_models_size() -> None:
    transform = train_transform(CONFIG, Augment())
    torch.manual_seed(0)
    out = torch.stack([transform(_photo(50, 37, seed=i)) for i in range(8)])
    assert out.shape == (8, 3, 24, 24) and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_mixup_and_cutmix_targets_match_the_pixels_by_hand() -> None:
    B, K, smoothing = 4, 5, 0.1
    images = torch.arange(1.0, B + 1).view(B, 1, 1, 1).expand(B, 3, 8, 8).contiguous()  # image i is the value i+1
    labels = torch.tensor([0, 1, 2, 4])
    mix = MixupCutmix(K, mixup=0.8, cutmix=1.0, label_smoothing=smoothing)
    torch.manual_seed(0)
    kinds = set()
    for _ in range(20):
        mixed, targets = mix(images.clone(), labels)
        for i in range(B):
            own, partner = float(i + 1), float((i - 1) % B + 1)  # paired with the batch rolled by one
            values = mixed[i].flatten()
            if torch.isin(values, torch.tensor([own, partner])).all() and not (values == values[0]).all():
                kinds.add("cutmix")
                lam = float((values == own).float().mean())  # the share of the image that stayed its own
            else:
                kinds.add("mixup")
                lam = (float(values[0]) - partner) / (own - partner)
                torch.testing.assert_close(values, torch.full_like(values, float(values[0])))
            expected = torch.zeros(K)
            expected[labels[i]] += lam
            expected[labels[(i - 1) % B]] += 1 - lam
            expected = expected * (1 - smoothing) + smoothing / K
            torch.testing.assert_close(targets[i], expected, atol=1e-5, rtol=0)
    assert kinds == {"mixup", "cutmix"}  # one of the two per batch, each half the time


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="scale"):
        Augment(scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="hflip"):
        Augment(hflip=1.5)
    with pytest.raises(ValueError, match="randaugment"):
        Augment(randaugment=40)
    with pytest.raises(ValueError, match="mixup"):
        Augment(mixup=-1)
    with pytest.raises(ValueError, match="mixup > 0 or cutmix > 0"):
        MixupCutmix(3, mixup=0, cutmix=0)


def test_transforms_pickle_as_their_recipe_for_spawned_workers() -> None:
    import pickle

    from vitrim.data.vision import BuiltTransform

    transform = BuiltTransform(train_transform, CONFIG, Augment.none().replace(hflip=1.0))
    state = transform.__getstate__()
    assert state["factory"] is train_transform and "transform" not in state  # no torchvision object is pickled
    copy = pickle.loads(pickle.dumps(transform))
    image = _photo(33, 29, seed=3)
    torch.testing.assert_close(copy(image), transform(image), atol=0, rtol=0)

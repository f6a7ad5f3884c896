"""vitrim's table of pretrained tags against timm's own registry, so the two cannot drift: the default tag of every
architecture both have, and the hub repo of every tag timm has weights for."""

from __future__ import annotations

import pytest

import vitrim
from vitrim.weights.tags import DEFAULT_TAGS, WEIGHTS_OF, pretrained_repo

timm = pytest.importorskip("timm")


def timm_archs() -> list[str]:
    return [name for name in vitrim.list_models() if timm.list_pretrained(f"{name}.*")]


def test_the_default_tag_of_every_architecture_is_timm_s_first() -> None:
    archs = timm_archs()
    assert len(archs) >= 30
    assert {arch: DEFAULT_TAGS.get(arch) for arch in archs} == {
        arch: timm.models.get_pretrained_cfg(arch).tag
        for arch in archs  # timm's default: the first tag
    }
    assert set(DEFAULT_TAGS) == set(archs)  # no tag for a name timm does not have


def test_every_tag_reads_the_repo_timm_reads() -> None:
    checked = 0
    for arch in timm_archs():
        for name in timm.list_pretrained(f"{arch}.*"):
            cfg, tag = timm.models.get_pretrained_cfg(name), name.partition(".")[2]
            if not cfg.hf_hub_id:
                continue  # timm has no hub weights under this tag
            expected = cfg.hf_hub_id if cfg.hf_hub_id != "timm/" else f"timm/{arch}.{tag}"
            assert pretrained_repo(f"{arch}.{tag}") == (arch, expected), (arch, tag)
            checked += 1
    assert checked >= 90


def test_dynamicvit_starts_from_deit_s_weights_and_other_names_have_none() -> None:
    assert pretrained_repo("dynamicvit_small_patch16_224") == (
        "dynamicvit_small_patch16_224",
        "timm/deit_small_patch16_224.fb_in1k",
    )
    assert set(WEIGHTS_OF.values()) <= set(DEFAULT_TAGS)
    with pytest.raises(ValueError, match="no pretrained weights are known for 'cnn_small'"):
        pretrained_repo("cnn_small")

"""DynamicViT (Rao et al., NeurIPS 2021): a ViT/DeiT whose learned predictors drop uninformative tokens in stages.

The backbone is the plain :class:`~vitrim.models.vit.VisionTransformer`; each pruning stage is a
:class:`~vitrim.reduce.dynamic.DynamicViTPruning`, the reducer of ``blocks[prune_layers[i]]``, which scores the
tokens just before that block's attention (default: before blocks 4, 7, 10 of 12). Stage s keeps
``max(1, int(P · ρ^s))`` of the P patches of the input's own grid. Training masks tokens (a keep policy reaches every
attention call; shapes stay static); evaluation gathers the kept tokens, so compute really shrinks. The predictor
modules are ``score_predictor.{i}`` as in the official checkpoints, which therefore load as they are; a dense
ViT/DeiT checkpoint loads too, with fresh predictors (``checkpoint_optional_prefixes``), to start fine-tuning.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

from vitrim.models.block import Block
from vitrim.models.config import ViTConfig
from vitrim.models.data_config import DEIT
from vitrim.models.registry import register_model
from vitrim.models.vit import VisionTransformer
from vitrim.models.vit_models import BASE, SMALL, TINY
from vitrim.reduce import quarter_layers as default_prune_layers  # the paper's places: 1/4, 1/2, 3/4 deep
from vitrim.reduce.dynamic import DynamicViTPruning, build_predictors, check_keep_ratio, num_keep, pruning_stages


@dataclass(frozen=True)
class DynamicViTConfig(ViTConfig):
    """A ViT config plus DynamicViT's two settings. Defaults are the paper's (ρ = 0.7, scored before blocks 4/7/10)."""

    keep_ratio: float = 0.7  # ρ: stage s keeps int(P · ρ^s) of the image's P patches
    prune_layers: tuple[int, ...] | None = None  # block indices scored before running; None: default_prune_layers

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "keep_ratio", check_keep_ratio(self.keep_ratio))
        layers = self.prune_layers
        if layers is None:
            return
        if not isinstance(layers, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers
        ):
            raise TypeError(f"prune_layers must be a sequence of block indices (ints), got {layers!r}")
        layers = tuple(layers)
        if not layers:
            raise ValueError("prune_layers must name at least one block, got ()")
        if any(not 0 <= i < self.depth for i in layers):
            raise ValueError(
                f"prune_layers must be block indices in [0, {self.depth - 1}] (depth {self.depth}), got {layers}"
            )
        if any(a >= b for a, b in itertools.pairwise(layers)):
            raise ValueError(f"prune_layers must be strictly increasing (sorted, no duplicates), got {layers}")
        object.__setattr__(self, "prune_layers", layers)

    @property
    def pruning_layers(self) -> tuple[int, ...]:
        """The block indices actually scored: ``prune_layers``, or the default for this depth."""
        return self.prune_layers if self.prune_layers is not None else default_prune_layers(self.depth)

    @property
    def keep_fractions(self) -> tuple[float, ...]:
        """ρ^s for stages s = 1, 2, …: the fraction of the image's patches kept after each stage."""
        return tuple(self.keep_ratio**s for s in range(1, len(self.pruning_layers) + 1))

    def num_keep(self, img_size: int | tuple[int, int] | None = None) -> list[int]:
        """Tokens kept after each stage for an image of ``img_size`` (default: the config's)."""
        h, w = self.img_size if img_size is None else (img_size, img_size) if isinstance(img_size, int) else img_size
        num_patches = (h // self.patch_size) * (w // self.patch_size)
        return [num_keep(num_patches, f) for f in self.keep_fractions]


class DynamicVisionTransformer(VisionTransformer):
    """A ViT with DynamicViT's pruning stages (see module doc).

    ``model(images)`` returns logits (B, num_classes) in training and evaluation. ``forward_detailed`` adds, in
    training, ``keep_masks`` (one (B, P) hard decision per stage, 1 = kept, differentiable straight-through) and the
    final tokens in grid order (for token distillation); in evaluation, ``kept_indices`` (one (B, k_s) tensor of
    absolute patch positions per stage, in descending keep score) and the final kept tokens in that order.
    """

    config: DynamicViTConfig
    # the predictors may be absent from a checkpoint (a dense ViT/DeiT to fine-tune from): they stay freshly initialised
    checkpoint_optional_prefixes: ClassVar[tuple[str, ...]] = ("score_predictor.",)

    def __init__(self, config: DynamicViTConfig) -> None:
        if not isinstance(config, DynamicViTConfig):
            raise TypeError(f"config must be a DynamicViTConfig, got {type(config).__name__}")
        super().__init__(config)
        self.score_predictor = build_predictors(config.embed_dim, len(config.pruning_layers))
        stages = pruning_stages(self.score_predictor, config.pruning_layers, config.keep_ratio)
        for layer, pruner in stages.items():
            block = self.blocks[layer]
            assert isinstance(block, Block)
            block.reducer = pruner

    @property
    def pruners(self) -> list[DynamicViTPruning]:
        """The pruning reducers, stage by stage (e.g. to set ``gumbel_noise``)."""
        return [block.reducer for block in self.blocks if isinstance(block.reducer, DynamicViTPruning)]

    def num_keep(self, img_size: int | tuple[int, int] | None = None) -> list[int]:
        """Tokens kept after each stage for an image of ``img_size`` (default: the config's)."""
        return self.config.num_keep(img_size)


def build_dynamic_vit(defaults: dict[str, Any], overrides: dict[str, Any]) -> DynamicVisionTransformer:
    """A DynamicViT from a size's defaults, then the user's overrides (timm's names, ``keep_ratio``,
    ``prune_layers``)."""
    return DynamicVisionTransformer(DynamicViTConfig().replace(**{**defaults, **overrides}))  # type: ignore[arg-type]


@register_model(data=DEIT)
def dynamicvit_tiny_patch16_224(**overrides: Any) -> DynamicVisionTransformer:
    return build_dynamic_vit(dict(TINY, patch_size=16), overrides)


@register_model(data=DEIT)
def dynamicvit_small_patch16_224(**overrides: Any) -> DynamicVisionTransformer:
    return build_dynamic_vit(dict(SMALL, patch_size=16), overrides)


@register_model(data=DEIT)
def dynamicvit_base_patch16_224(**overrides: Any) -> DynamicVisionTransformer:
    return build_dynamic_vit(dict(BASE, patch_size=16), overrides)

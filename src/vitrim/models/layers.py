"""Layers of a Vision Transformer that know nothing of models: patch embedding, MLPs, LayerScale, DropPath."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrim.models.inputs import check_images


def to_2tuple(value: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    """``224 -> (224, 224)``; a pair stays a pair. Errors name the argument."""
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        pair = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    if min(pair) <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return pair


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, H/p · W/p, D) by a p×p convolution of stride p.

    Any H, W that are multiples of the patch size work; ``img_size`` only sets the grid the position embedding
    was trained for.
    """

    def __init__(
        self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int, bias: bool = True
    ) -> None:
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.grid_size = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def check_input(self, x: Tensor) -> tuple[int, int]:
        """Raise a clear error for a wrong image batch (:func:`vitrim.models.inputs.check_images`); return its
        patch grid (h, w)."""
        return check_images(x, in_chans=self.in_chans, weight=self.proj.weight, patch_size=self.patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h·w, D)


class QuickGELU(nn.Module):
    """x · sigmoid(1.702 x): OpenAI CLIP's approximation of GELU."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


def activation(name: str) -> nn.Module:
    """The MLP activation a config names: "gelu" (erf), "gelu_tanh" (tanh approximation), "quick_gelu"."""
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "quick_gelu":
        return QuickGELU()
    raise ValueError(f"unknown activation {name!r}; expected 'gelu', 'gelu_tanh' or 'quick_gelu'")


class Mlp(nn.Module):
    """fc1 -> activation -> dropout -> fc2 -> dropout (timm's names)."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = activation(act)
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:  # dropout is the identity in evaluation: skip its calls (overhead at batch 1)
            return self.fc2(self.act(self.fc1(x)))
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class GluMlp(nn.Module):
    """SwiGLU with one packed input projection (timm's ``GluMlp`` as EVA-02 uses it): fc1 gives (gate, value),
    out = fc2(SiLU(gate) · value). ``hidden_dim`` is the width of the gated product; fc1 is twice as wide."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden_dim)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.fc1(x).chunk(2, dim=-1)  # (B, N, hidden) each
        return self.drop2(self.fc2(self.drop1(self.act(gate) * value)))


class SwiGLU(nn.Module):
    """SwiGLU with separate gate and value projections and a LayerNorm before fc2 (timm's ``SwiGLU``, EVA-02's
    ``scale_mlp``): out = fc2(norm(SiLU(x W_g) · x W_x))."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden_dim)
        self.fc1_x = nn.Linear(dim, hidden_dim)
        self.act = nn.SiLU()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.LayerNorm(hidden_dim, eps=norm_eps)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1_g(x)) * self.fc1_x(x)))))


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch (CaiT); parameter ``gamma`` as in timm."""

    def __init__(self, dim: int, init_values: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop a whole residual branch per sample in training, rescaling the survivors."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"

"""The configuration of a Vision Transformer: one frozen dataclass, timm's names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from vitrim.models.layers import to_2tuple

GLOBAL_POOLS = ("token", "avg", "map")
ACT_LAYERS = ("gelu", "gelu_tanh", "quick_gelu")

T = TypeVar("T")


def replace_checked(config: T, changes: dict[str, Any]) -> T:
    """``dataclasses.replace`` that names unknown fields (``--set dpeth=4`` is an error, not ignored)."""
    names = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"unknown config option(s) {unknown}; known: {sorted(names)}")
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ViTConfig:
    """Everything that defines a ViT's architecture. Defaults are ViT-B/16 at 224 as timm builds it."""

    img_size: tuple[int, int] = (224, 224)  # the grid the position embedding is learned for; any multiple runs
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000  # 0: no head, the model returns pooled features
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False
    class_token: bool = True
    distilled: bool = False  # DeiT: a distillation token and a second head; logits are the mean of both heads
    reg_tokens: int = 0  # register tokens after [CLS] (DINOv2-reg): prefix tokens without a position embedding
    no_embed_class: bool = False  # the position embedding covers the patches only (DeiT-III, DINOv2-reg)
    pre_norm: bool = False  # a LayerNorm before the blocks and no patch-embedding bias (CLIP)
    global_pool: str = "token"  # "token": the [CLS] output; "avg": mean over patches; "map": attention pool (SigLIP)
    fc_norm: bool | None = None  # norm after pooling instead of before (None: timm's default, on for "avg")
    act_layer: str = "gelu"  # MLP activation: "gelu" (erf), "gelu_tanh" (SigLIP in HF), "quick_gelu" (OpenAI CLIP)
    swiglu_mlp: bool = False  # SwiGLU MLP (EVA-02): SiLU(x W_g) * (x W_x), hidden width int(D * mlp_ratio)
    scale_mlp: bool = False  # with swiglu_mlp: separate gate/value projections and a LayerNorm before fc2 (EVA-02 B/L)
    use_rot_pos_emb: bool = False  # 2-D rotary position embedding on q and k of the patch tokens (EVA-02)
    ref_feat_shape: tuple[int, int] | None = None  # RoPE: the grid its frequencies are scaled to (EVA-02: 16x16)
    rope_temperature: float = 10000.0
    drop_rate: float = 0.0  # dropout before the head and inside blocks (timm's proj_drop)
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0  # stochastic depth, linearly increasing over the blocks
    init_values: float | None = None  # LayerScale init; None = no LayerScale
    norm_eps: float = 1e-6  # timm's; Hugging Face ViT uses 1e-12
    # How the position embedding is resampled to another grid: bicubic with antialiasing, as timm does (and
    # transformers' DINOv2 with registers); False: without, as transformers' ViT, DINOv2, CLIP and SigLIP do. Set by
    # where the weights came from, so that another image size gives the numbers of the library they came from.
    pos_embed_antialias: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "img_size", to_2tuple(self.img_size, "img_size"))
        for name in ("patch_size", "in_chans", "embed_dim", "depth", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {self.num_classes!r}")
        for size in self.img_size:
            if size % self.patch_size != 0:
                raise ValueError(f"image size {size} is not divisible by patch size {self.patch_size}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if self.global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool must be one of {GLOBAL_POOLS}, got {self.global_pool!r}")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' or 'map'")
        if self.act_layer not in ACT_LAYERS:
            raise ValueError(f"act_layer must be one of {ACT_LAYERS}, got {self.act_layer!r}")
        if not isinstance(self.reg_tokens, int) or isinstance(self.reg_tokens, bool) or self.reg_tokens < 0:
            raise ValueError(f"reg_tokens must be an int >= 0, got {self.reg_tokens!r}")
        if self.use_rot_pos_emb and (self.embed_dim // self.num_heads) % 4:
            raise ValueError(f"RoPE needs a head width divisible by 4, got {self.embed_dim // self.num_heads}")
        if self.ref_feat_shape is not None:
            object.__setattr__(self, "ref_feat_shape", to_2tuple(self.ref_feat_shape, "ref_feat_shape"))
        if self.distilled and not self.class_token:
            raise ValueError("distilled=True needs class_token=True")
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be positive, got {self.mlp_ratio!r}")
        for name in ("drop_rate", "attn_drop_rate", "drop_path_rate"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if not isinstance(self.pos_embed_antialias, bool):
            raise ValueError(f"pos_embed_antialias must be a bool, got {self.pos_embed_antialias!r}")

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def num_prefix(self) -> int:
        """Prefix tokens before the patches: [CLS], DeiT's distillation token, registers (timm's num_prefix_tokens)."""
        return int(self.class_token) + int(self.distilled) + self.reg_tokens

    @property
    def num_pos_prefix(self) -> int:
        """Prefix tokens that have a position embedding (none with ``no_embed_class``)."""
        return 0 if self.no_embed_class else self.num_prefix

    @property
    def use_fc_norm(self) -> bool:
        """Norm after pooling (``fc_norm``) rather than on the tokens (``norm``), as timm decides it."""
        return self.global_pool == "avg" if self.fc_norm is None else self.fc_norm

    def replace(self, **changes: Any) -> ViTConfig:
        """A copy with some fields changed; unknown names raise a clear error."""
        return replace_checked(self, changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ViTConfig:
        values = dict(values)
        for key in ("img_size", "ref_feat_shape"):
            if isinstance(values.get(key), (list, tuple)):  # JSON has lists; an int or a bad value: replace checks it
                values[key] = tuple(values[key])
        return cls().replace(**values)

"""DynamicViT fine-tuning from a dense checkpoint, the paper's recipe (Rao et al., 2021, Sec. 4.1).

The dense checkpoint initialises the student's backbone (the prediction modules start fresh) and, frozen, serves as
the teacher. The loss is :class:`vitrim.losses.DynamicViTLoss` (classification + keep ratio + logit and token
distillation). The prediction modules learn at the full learning rate, the backbone at ``backbone_lr_scale`` × it
(0.01 in the paper) and not at all during the first ``freeze_backbone_epochs`` epochs, so the predictors first learn
to score tokens of a backbone that does not move under them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
from torch import Tensor, nn

from vitrim import reduce
from vitrim.checkpoint import load_checkpoint, load_model
from vitrim.checkpoint_formats import RawCheckpoint
from vitrim.losses import DynamicViTLoss
from vitrim.models.vit import ViTOutput

PREDICTOR_PREFIX = "score_predictor."
# architecture fields a student copies from its teacher's config (all but the head size and regularisation)
_ARCHITECTURE = (
    "img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm",
    "class_token", "global_pool", "init_values", "norm_eps", "reg_tokens", "no_embed_class", "pre_norm", "fc_norm",
    "act_layer", "swiglu_mlp", "scale_mlp", "use_rot_pos_emb", "ref_feat_shape", "rope_temperature",
)  # fmt: skip


def teacher_architecture(teacher: RawCheckpoint) -> dict[str, Any]:
    """The ViT fields of a vitrim checkpoint's config (empty for a file without one)."""
    config = json.loads(teacher.metadata.get("vitrim.config", "{}"))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in _ARCHITECTURE}


def student_keep_ratio(student: nn.Module) -> float:
    """ρ of a DynamicViT student: a dynamicvit_* model's config, or the ``dynamicvit`` reducer put on any ViT."""
    keep_ratio = getattr(getattr(student, "config", None), "keep_ratio", None)
    for spec in reduce.applied_reducers(student):
        if spec["name"] == "dynamicvit":
            keep_ratio = spec["options"].get("keep_ratio", 0.7)
    if keep_ratio is None or not hasattr(student, "forward_detailed"):
        raise TypeError(f"--teacher needs a DynamicViT student, got {type(student).__name__} without predictors")
    return float(keep_ratio)


def dense_teacher(student: nn.Module, checkpoint: RawCheckpoint) -> nn.Module:
    """The teacher: the model the checkpoint describes (vitrim, Hugging Face), or, for a bare timm / DeiT state dict,
    the student (which just loaded it) without its reducers."""
    try:
        return load_model(checkpoint)
    except ValueError:  # a state dict without a config: the student's architecture is the teacher's
        teacher = reduce.remove(copy.deepcopy(student))
    if any(getattr(block, "reducer", None) is not None for block in getattr(teacher, "blocks", ())):
        raise ValueError(
            f"teacher {str(checkpoint.path)!r} is a bare state dict and {type(student).__name__} prunes by itself: "
            "train --model <its dense ViT> --set reducer=dynamicvit instead"
        )
    return teacher.eval()


class _Detailed(nn.Module):
    """Makes ``forward`` return ``forward_detailed`` (so DDP's forward hooks run on the call the loss needs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> ViTOutput:
        return self.model.forward_detailed(images)  # type: ignore[operator]


class DistillObjective:
    """``objective(train_model, images, labels, epoch) -> loss`` for a DynamicViT student and a frozen teacher."""

    def __init__(
        self, teacher: nn.Module, loss: nn.Module, *, backbone_lr_scale: float, freeze_backbone_epochs: int
    ) -> None:
        if not backbone_lr_scale >= 0:
            raise ValueError(f"backbone lr scale must be >= 0, got {backbone_lr_scale!r}")
        if freeze_backbone_epochs < 0:
            raise ValueError(f"freeze backbone epochs must be >= 0, got {freeze_backbone_epochs!r}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.loss = loss
        self.backbone_lr_scale = backbone_lr_scale
        self.freeze_backbone_epochs = freeze_backbone_epochs

    @classmethod
    def from_teacher(
        cls, student: nn.Module, checkpoint: RawCheckpoint, config: Any, device: torch.device
    ) -> DistillObjective:
        """Load the dense ``checkpoint`` (read once) into the student's backbone and as the frozen teacher."""
        keep_ratio = student_keep_ratio(student)
        load_checkpoint(student, checkpoint, strict=True)  # predictors are optional: they stay fresh
        teacher = dense_teacher(student, checkpoint).to(device)
        options = {"keep_ratio": keep_ratio, "label_smoothing": config.label_smoothing, **config.distill}
        return cls(
            teacher,
            DynamicViTLoss(**options),
            backbone_lr_scale=config.backbone_lr_scale,
            freeze_backbone_epochs=config.freeze_backbone_epochs,
        )

    def lr_multiplier(self, name: str) -> float:
        return 1.0 if name.startswith(PREDICTOR_PREFIX) else self.backbone_lr_scale

    def wrap(self, model: nn.Module) -> nn.Module:
        return _Detailed(model)

    def __call__(self, model: nn.Module, images: Tensor, labels: Tensor, epoch: int) -> Tensor:
        student: ViTOutput = model(images)  # the wrapped student: forward_detailed
        with torch.no_grad():
            teacher = self.teacher.forward_detailed(images)  # type: ignore[operator]
        return self.loss(student, labels, teacher.logits.float(), teacher.tokens.float()).total

    def after_backward(self, model: nn.Module, epoch: int) -> None:
        """While the backbone is frozen, drop its gradients: AdamW skips parameters without one (no decay either)."""
        if epoch < self.freeze_backbone_epochs:
            for name, param in model.named_parameters():
                if not name.startswith(PREDICTOR_PREFIX):
                    param.grad = None

"""A dense teacher for a run: the checkpoint ``--teacher`` names initialises the student's backbone and, frozen,
teaches it (DynamicViT's recipe; the reducer's objective decides what the teacher is used for)."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from vitrim import reduce
from vitrim.models.config_limits import check_file_config
from vitrim.untrusted import expect_object, parse_json
from vitrim.weights.checkpoint import load_checkpoint
from vitrim.weights.formats import RawCheckpoint
from vitrim.weights.pretrained import load_model

# architecture fields a student copies from its teacher's config (all but the head size and regularisation)
_ARCHITECTURE = (
    "img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm",
    "class_token", "global_pool", "init_values", "norm_eps", "reg_tokens", "no_embed_class", "pre_norm", "fc_norm",
    "act_layer", "swiglu_mlp", "scale_mlp", "use_rot_pos_emb", "ref_feat_shape", "rope_temperature",
)  # fmt: skip


def teacher_architecture(teacher: RawCheckpoint) -> dict[str, Any]:
    """The ViT fields of a vitrim checkpoint's config (empty for a file without one)."""
    source = f"teacher {str(teacher.path)!r} metadata vitrim.config"
    config = expect_object(parse_json(teacher.metadata.get("vitrim.config", "{}"), source), source)
    check_file_config(config, source)  # the student is built with these sizes: bounded like any file's config
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in _ARCHITECTURE}


def load_teacher(student: nn.Module, checkpoint: RawCheckpoint) -> nn.Module:
    """Load the dense ``checkpoint`` into the student (its reducers' modules stay fresh) and return the teacher.

    The teacher is the model the checkpoint describes (vitrim, Hugging Face), or, for a bare timm / DeiT state
    dict, the student without its reducers; in eval mode, on the student's device.
    """
    load_checkpoint(student, checkpoint, strict=True)  # a reducer's modules (predictors) are optional: fresh
    device = next(student.parameters()).device
    try:
        return load_model(checkpoint).to(device)
    except ValueError:  # a state dict without a config: the student's architecture is the teacher's
        teacher = reduce.remove(copy.deepcopy(student))
    if any(getattr(block, "reducer", None) is not None for block in getattr(teacher, "blocks", ())):
        raise ValueError(
            f"teacher {str(checkpoint.path)!r} is a bare state dict and {type(student).__name__} prunes by itself: "
            "train --model <its dense ViT> --set reducer=dynamicvit instead"
        )
    return teacher.eval()

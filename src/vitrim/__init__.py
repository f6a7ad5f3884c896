"""vitrim: attention and Vision Transformers that trim their own tokens."""

from vitrim import losses  # the module: vitrim.losses.DynamicViTLoss
from vitrim.attention import MultiHeadAttention, compute_attention, scaled_dot_product_attention
from vitrim.checkpoint import load_checkpoint, load_model, save_checkpoint
from vitrim.models import VisionTransformer, ViTConfig, ViTOutput, create_model, list_models

__version__ = "0.1.0"

__all__ = [
    "MultiHeadAttention",
    "ViTConfig",
    "ViTOutput",
    "VisionTransformer",
    "__version__",
    "compute_attention",
    "create_model",
    "list_models",
    "losses",
    "load_checkpoint",
    "load_model",
    "save_checkpoint",
    "scaled_dot_product_attention",
]

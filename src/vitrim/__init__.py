"""vitrim: attention and Vision Transformers that trim their own tokens."""

from vitrim import losses, reduce  # the modules: vitrim.losses.DynamicViTLoss, vitrim.reduce.apply
from vitrim.attention import MultiHeadAttention, compute_attention, scaled_dot_product_attention
from vitrim.checkpoint import load_checkpoint, load_model, save_checkpoint
from vitrim.factory import create_model
from vitrim.models import VisionTransformer, ViTConfig, ViTOutput, list_models
from vitrim.optimize import OptimizedModel, optimize

__version__ = "0.1.0"

__all__ = [
    "MultiHeadAttention",
    "OptimizedModel",
    "ViTConfig",
    "ViTOutput",
    "VisionTransformer",
    "__version__",
    "compute_attention",
    "create_model",
    "list_models",
    "losses",
    "reduce",
    "load_checkpoint",
    "load_model",
    "optimize",
    "save_checkpoint",
    "scaled_dot_product_attention",
]

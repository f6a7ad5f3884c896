"""vitrim: attention and Vision Transformers that trim their own tokens."""

from vitrim import losses, reduce, viz  # the modules: vitrim.losses.DynamicViTLoss, vitrim.reduce.apply, vitrim.viz
from vitrim.attention import MultiHeadAttention, compute_attention, scaled_dot_product_attention
from vitrim.checkpoint import load_checkpoint, save_checkpoint
from vitrim.factory import create_model
from vitrim.in_memory import from_timm, from_transformers
from vitrim.models import VisionTransformer, ViTConfig, ViTOutput, list_models
from vitrim.optimize import OptimizedModel, optimize
from vitrim.pretrained import load_model

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
    "from_timm",
    "from_transformers",
    "list_models",
    "losses",
    "reduce",
    "viz",
    "load_checkpoint",
    "load_model",
    "optimize",
    "save_checkpoint",
    "scaled_dot_product_attention",
]

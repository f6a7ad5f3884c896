"""vitrim: attention and Vision Transformers that trim their own tokens."""

from vitrim.attention import MultiHeadAttention, compute_attention, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = ["MultiHeadAttention", "__version__", "compute_attention", "scaled_dot_product_attention"]

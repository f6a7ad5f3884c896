"""Attention: the one function every caller uses, and multi-head attention built on it."""

from vitrim.attention.functional import compute_attention, scaled_dot_product_attention
from vitrim.attention.multi_head import AttentionResult, MultiHeadAttention

__all__ = ["AttentionResult", "MultiHeadAttention", "compute_attention", "scaled_dot_product_attention"]

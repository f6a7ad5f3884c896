"""Seeing attention: maps per block and head, attention rollout, class-specific relevance (Chefer, AttnLRP), kept
tokens per stage, a VLM's kept tokens on the user's own picture, and one matrix by hand.

Importing this package does not import matplotlib; the drawing functions do, on their own Agg canvas.
"""

from vitrim.viz.explain import Explanation, explain_numbers, format_explanation, plot_explanation
from vitrim.viz.maps import (
    cls_attention_grid,
    figure_to_rgb,
    model_attention_grid,
    plot_attention_maps,
    plot_rollout,
    save_figure,
)
from vitrim.viz.relevance import METHODS, RelevanceMap, relevance, relevance_map
from vitrim.viz.rollout import (
    Rollout,
    attention_rollout,
    attention_rollout_model,
    block_token_indices,
    fuse_heads,
    positions_to_token_index,
    rollout_step,
)
from vitrim.viz.tokens import kept_masks, model_kept_indices, plot_kept_tokens, render_kept_tokens
from vitrim.viz.vlm_boxes import TokenBoxes, vlm_token_boxes
from vitrim.viz.vlm_kept import plot_vlm_kept, render_vlm_kept

__all__ = [
    "METHODS",
    "Explanation",
    "RelevanceMap",
    "Rollout",
    "TokenBoxes",
    "attention_rollout",
    "attention_rollout_model",
    "block_token_indices",
    "cls_attention_grid",
    "explain_numbers",
    "figure_to_rgb",
    "format_explanation",
    "fuse_heads",
    "kept_masks",
    "model_attention_grid",
    "model_kept_indices",
    "plot_attention_maps",
    "plot_explanation",
    "plot_kept_tokens",
    "plot_rollout",
    "plot_vlm_kept",
    "positions_to_token_index",
    "relevance",
    "relevance_map",
    "render_kept_tokens",
    "render_vlm_kept",
    "rollout_step",
    "save_figure",
    "vlm_token_boxes",
]

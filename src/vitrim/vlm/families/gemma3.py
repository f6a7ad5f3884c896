"""Gemma 3 (transformers' ``Gemma3ForConditionalGeneration``): where its image tokens are made and enter the LLM.

The model (transformers ≥ 5): ``model.model.vision_tower`` (SigLIP, no [CLS]; its last layer's states after the
post-LayerNorm) → ``model.model.multi_modal_projector`` (an average pool of the P = p×p patch grid to the
``mm_tokens_per_image`` = t×t grid, kernel k = p / t, then RMSNorm and a matmul: Gemma-3-4B pools 64×64 patches
to 16×16 = 256 tokens) → scattered into the ``input_ids == image_token_id`` positions → ``model.model.language_model``,
whose masks are built per layer type (full and sliding-window layers) with the image block bidirectional through
``token_type_ids`` (``vitrim.vlm.families.gemma3_masks``).

Index space: the image tokens entering the LLM are the projector's pooled tokens, so indices are raster indices of
the pooled t×t grid (row-major, 0 … t²−1); pooled token (r, c) stands for the k×k patches of rows r·k … r·k+k−1 and
columns c·k … c·k+k−1 of the tower's grid. Under the processor's pan-and-scan each crop is a picture of its own
(its own ``pixel_values`` row and run of image tokens), so it is one "image" of ``last_selection`` and keeps ``keep``.

Evidence (:class:`~vitrim.vlm.method.base.VisionEvidence`) in that space:
- ``features``: the pooled tower states (what the projector's norm and matmul read), so a merged token is the mean
  of its group's pooled states put through the projector's norm and matmul;
- **no [CLS]**: the [CLS]-based methods (FasterVLM, VisPruner, VisionZip) rank by the attention each token RECEIVES
  at the scoring layer (the tower's last layer, whose output the projector reads), as for Qwen
  (``vitrim.vlm.families.qwen2vl_vision``): per head, the softmax map of that layer from its own q/k projections on
  its input, summed over the queries and divided by the patch count, then summed over the k×k patches of each
  pooled token (per image and head the scores sum to 1). ``keys``: that layer's keys averaged over the k×k patches.

What reaches the LLM after a method selects: the kept tokens only, at their ORIGINAL positions, with the masks the
unmodified model built gathered to the kept rows and columns (so the image block and the sliding window are the
unmodified model's and dropping is exactly masking keys); decode steps get masks built over each layer's cache.
Where it taps (the capture → select → write sequence is :mod:`vitrim.vlm.stages.capture`'s): the tower's pixels
(each image's seed) and the scoring layer's attention (:func:`read_received_attention`), the projector's output
(select, write merged tokens); the masks per layer type gathered for the shortened prefill and built over each
layer's cache at decode (the rest is the pre-LLM stage's, :mod:`vitrim.vlm.stages.pre_llm`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.boxes import TokenBoxes, one_image_per_picture, resized_grid_boxes
from vitrim.vlm.evidence.attention import received_by_segment
from vitrim.vlm.evidence.pooled import pool_to_tokens
from vitrim.vlm.families.gemma3_masks import decode_masks, gather_masks
from vitrim.vlm.stages.capture import EncoderSeam, Taps
from vitrim.vlm.stages.contract import FamilyAdapter, FamilyTraits, Prefill, ServedArchitecture, Shortened
from vitrim.vlm.stages.inputs import cache_of
from vitrim.vlm.stages.pre_llm import PREPARED_MASKS
from vitrim.vlm.stages.sequence import DecodeState, decode_position_ids


class Gemma3Adapter(FamilyAdapter):
    """The seams of one ``Gemma3ForConditionalGeneration`` instance (see the module docstring)."""

    traits = FamilyTraits(
        classes=("Gemma3ForConditionalGeneration",),
        title="Gemma 3 (Gemma3ForConditionalGeneration)",
        stages=("pre_llm", "in_llm", "tower"),
        tower_grid_only="its projector average-pools the whole patch grid",
        served=(
            ServedArchitecture(
                "VitrimGemma3ForConditionalGeneration",
                "vitrim.vllm.gemma3",
                "Gemma3ForConditionalGeneration",
                "gemma3",
            ),
        ),
    )
    # no author of these methods released Gemma 3 code; its LLM's sliding-window and bidirectional-image masks are
    # the model's own, built for the full prompt and gathered at the kept columns, so they count ORIGINAL distance.
    # Renumbering the positions without rebuilding those masks for the shorter sequence would mix the two
    # conventions (and a cached decode would disagree with use_cache=False): positions="authors" keeps the
    # original positions and raster order here, as positions="original" does
    authors_positions = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.text_config: Any = self.config.get_text_config()
        self.positions: Tensor | None = None  # (B, S) original positions of a shortened prefill's cache layout

    def tokens_per_image(self) -> int:
        return int(self.config.mm_tokens_per_image)

    def scoring_attention(self) -> Any:
        """The attention of the tower's last layer (the projector reads that layer's output)."""
        return self.inner.vision_tower.encoder.layers[-1].self_attn

    def in_llm_padding_module(self) -> nn.Module:
        """Where an in-LLM drop reads the user's 2-D padding mask: ``model.model``, whose ``attention_mask`` is the
        caller's (its language model receives the masks already built per layer type)."""
        return self.inner

    # the pre-LLM stage's seams

    def select_hooks(self, stage: EncoderSeam) -> list[Callable[[], None]]:
        return ProjectorSelection(self, stage).hooks()

    def shorten_extras(self, kwargs: dict[str, Any], prefill: Prefill, shortened: Shortened) -> None:
        masks: Any = kwargs.get("attention_mask")  # a dict per layer type, one column per token of the full input
        length = prefill.input_ids.shape[1]
        lengths = {mask.shape[-1] for mask in masks.values() if mask is not None} if isinstance(masks, dict) else {0}
        if not lengths <= {length}:
            raise ValueError(PREPARED_MASKS)
        config = self.text_config
        dtype = kwargs["inputs_embeds"].dtype
        kwargs["attention_mask"] = gather_masks(
            masks, shortened.short, config.sliding_window, config._attn_implementation, dtype
        )
        self.positions = kwargs["position_ids"]

    def decode_extras(self, kwargs: dict[str, Any], state: DecodeState, mask: Tensor, past: int, new: int) -> None:
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = decode_position_ids(state, past, new, mask.device)
            kwargs["position_ids"] = positions
        assert self.positions is not None
        self.positions = torch.cat([self.positions, positions.expand(mask.shape[0], new)], 1)
        config = self.text_config
        kwargs["attention_mask"] = decode_masks(
            cache_of(kwargs),
            list(config.layer_types),
            mask,
            self.positions,
            new,
            config.sliding_window,
            config._attn_implementation,
            _dtype(self.language_model),
        )

    # where its image tokens lie in the user's picture

    def token_boxes(
        self, image_processor: Any, inputs: dict[str, Any], sizes: list[tuple[int, int]], stage: str | None = None
    ) -> list[TokenBoxes]:
        """Per picture of ``sizes`` (H, W): its pooled tokens' boxes, or its patches' for the tower stage (whose
        selection counts the tower's patches, ``vitrim.vlm.stages.tower``) (:func:`gemma3_boxes`). Pan-and-scan
        crops (``do_pan_and_scan``) are refused: each crop is an image of its own, and its boxes would have to follow
        the crop."""
        one_image_per_picture(
            inputs,
            sizes,
            "Gemma 3's pan-and-scan cut them into crops, each an image of its own, which vitrim does not map back to "
            "the picture; load the processor with do_pan_and_scan=False",
        )
        return [gemma3_boxes(image_processor, self.config, size, patches=stage == "tower") for size in sizes]


def read_received_attention(
    kernel: int,
    attention: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    query: Tensor | None = None,
    key: Tensor | None = None,
) -> Any:
    """A SigLIP attention's evidence per pooled token of ``kernel``×``kernel`` patches: the attention each receives
    (I, H, N) and its mean keys (I, H, N, hd), from the layer's own q/k projections on its input (I, P, D); ``query``,
    ``key`` (I, P, H·hd): the layer's own ``q_proj`` / ``k_proj`` outputs where the tap kept them
    (:class:`~vitrim.vlm.stages.capture.ScoringTap`), else computed here."""
    hidden: Tensor = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    query = attention.q_proj(hidden) if query is None else query  # (I, P, H·hd)
    key = attention.k_proj(hidden) if key is None else key
    return pooled_received(query, key, attention.num_heads, float(attention.scale), kernel)


def pooled_received(query: Tensor, key: Tensor, heads: int, scale: float, kernel: int) -> tuple[Tensor, Tensor]:
    """The evidence of :func:`read_received_attention` from a SigLIP layer's queries and keys (I, P, H·hd), however
    the engine's layer makes them (transformers' ``q_proj``/``k_proj``, vLLM's fused ``qkv_proj``)."""
    images, patches, _ = query.shape
    head_dim = query.shape[-1] // heads
    work = torch.promote_types(query.dtype, torch.float32)  # a half-precision tower is scored in float32
    query = query.reshape(images * patches, heads, head_dim).to(work)  # (I·P, H, hd)
    key = key.reshape(images * patches, heads, head_dim).to(work)
    bounds = torch.arange(images + 1) * patches  # each image attends within itself
    received = received_by_segment(query, key, bounds, scale) / patches  # (H, I·P)
    received = received.reshape(heads, images, patches).permute(1, 2, 0)  # (I, P, H)
    keys = key.reshape(images, patches, heads, head_dim)
    pooled_received = pool_to_tokens(received, kernel, "sum").transpose(1, 2)  # (I, H, N)
    pooled_keys = pool_to_tokens(keys, kernel, "mean").transpose(1, 2)  # (I, H, N, hd)
    return pooled_received, pooled_keys


class ProjectorSelection:
    """Where Gemma 3 hands on its tokens: the projector's output (its forward hook), for every image of one run."""

    def __init__(self, adapter: Gemma3Adapter, stage: EncoderSeam) -> None:
        self.adapter, self.stage = adapter, stage
        kernel = int(adapter.inner.multi_modal_projector.kernel_size)
        attention = adapter.scoring_attention()  # the taps read its own q/k projections' outputs (ScoringTap)
        self.taps = Taps(
            stage.method,
            tower=adapter.inner.vision_tower,
            scoring=(attention, partial(read_received_attention, kernel), attention.q_proj, attention.k_proj),
        )
        stage.taps.append(self.taps)

    def hooks(self) -> list[Callable[[], None]]:
        handle = self.adapter.inner.multi_modal_projector.register_forward_hook(self.after_projector)
        return [handle.remove, self.taps.remove]

    def after_projector(self, module: Any, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        tower_states = args[0]  # (I, P, C) the tower's last states
        attention = self.taps.take_attention()
        received, keys = (None, None) if attention is None else attention
        with torch.no_grad():
            pooled = projector_pool(module, tower_states)  # (I, N, C), what the projector's norm reads

        def project(states: Tensor) -> Tensor:  # (k, C) merged pooled states -> the LLM's width
            return module.mm_soft_emb_norm(states.to(tower_states.dtype)) @ module.mm_input_projection_weight

        selections, written = self.stage.hand_on.run(
            pooled,
            values=output,
            project=project,
            attention=received,
            keys=keys,
            seeds=self.taps.seeds,
            projected=output,
        )
        self.stage.selected(selections)
        return written


def projector_pool(projector: Any, tower_states: Tensor) -> Tensor:
    """(I, P, C) -> (I, N, C): the projector's own average pool (so a token kept as it is stays bit for bit)."""
    images, _, channels = tower_states.shape
    side = int(projector.patches_per_image)
    grid = tower_states.transpose(1, 2).reshape(images, channels, side, side).contiguous()
    return projector.avg_pool(grid).flatten(2).transpose(1, 2)


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def gemma3_boxes(image_processor: Any, config: Any, size: tuple[int, int], patches: bool = False) -> TokenBoxes:
    """Gemma 3's pooled tokens (``patches=True``: the tower's patches) on a picture of ``size`` (H, W).

    ``Gemma3ImageProcessor`` resizes the picture to its ``height × width`` (no crop, the aspect ratio not kept); the
    projector average-pools the p×p patch grid to the t×t tokens (``mm_tokens_per_image`` = t², 16×16 in the real
    checkpoints), so a token's box is its k×k cell of patches, k = p / t. Returns t² boxes (p² with ``patches``),
    all of view 0 ("image"; "patches").
    """
    patch = int(config.vision_config.patch_size)
    if patches:
        return resized_grid_boxes(image_processor, patch, None, size, "patches")
    tokens = int(config.mm_tokens_per_image)
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"mm_tokens_per_image={tokens} is not a square grid of pooled tokens")
    return resized_grid_boxes(image_processor, patch, side, size, "image")

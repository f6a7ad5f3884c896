"""Everything of vitrim.vllm that leans on vLLM's internals, in one place, behind one version check (owned here).

The model classes subclass vLLM's public model classes and override ``embed_multimodal`` and the processor's
placeholder count, the seams vLLM offers an out-of-tree model. Beyond them:

- **The vLLM version.** Those seams, and the ones below, are vLLM internals that change between releases without
  notice; vitrim.vllm was run and tested on :data:`TESTED` only. :func:`check_vllm_version` fails in one line on
  any other release (``VITRIM_VLLM_UNTESTED=1`` lets a user try anyway, at their own risk).
- **M-RoPE of pruned media** (Qwen2.5-VL): vLLM re-numbers a prompt whose media were pruned only for video
  pruning (:func:`declare_image_pruning`), continues the text after an image or video by the grid's width rather
  than its largest side and truncates a video's seconds per temporal patch (:func:`video_positions`), lays out a
  prompt's first positions as if no medium were pruned (:func:`sequential_mrope_positions`), its re-numbering
  misplaces some media (:func:`renumber_media` replaces it), and its CPU runner never turns the re-numbering on
  (:func:`patch_cpu_runner`). Each function says the upstream change that removes it.
- **Pipeline parallel on a CPU** (:func:`allocate_pipeline_buffer`): vLLM's CPU worker, run eagerly with an explicit
  KV-cache size, never allocates a later stage's receive buffer.
- **Positions of a model without M-RoPE** (Gemma 3): vLLM numbers a prompt 0, 1, 2, … unless the config declares
  M-RoPE, so vitrim's Gemma 3 architecture declares it (:func:`declare_gemma3_mrope`) to number its shortened
  prompts at their original positions.
- **Modules that take no hooks** (:func:`tap_input`): vLLM's ``support_torch_compile`` wrapper (Qwen2.5-VL's
  vision blocks and merger) calls ``forward`` directly, so forward hooks never run.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

TESTED = ("0.32",)  # vLLM major.minor releases vitrim.vllm's tests ran on
UNTESTED_ENV = "VITRIM_VLLM_UNTESTED"


def check_vllm_version(version: str | None = None) -> None:
    """``RuntimeError`` (one line) unless ``version`` (default: the installed vLLM's) is a tested release."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor in TESTED or os.environ.get(UNTESTED_ENV) == "1":
        return
    raise RuntimeError(
        f"vitrim: vLLM {version} is not a release vitrim.vllm was tested on (tested: "
        f"{', '.join(v + '.x' for v in TESTED)}); install vllm=={TESTED[-1]}.* or set {UNTESTED_ENV}=1 to try anyway"
    )


def declare_image_pruning(multimodal_config: Any) -> None:
    """Make this engine's ``MultiModalConfig`` report multimodal pruning as on, for a vitrim model.

    vLLM runs its M-RoPE re-numbering (``recompute_mrope_positions``) only where
    ``MultiModalConfig.is_multimodal_pruning_enabled()``, which is true only for video pruning
    (``--video-pruning-rate``); the runner reads it after loading the model. A vitrim model sets it on the instance
    its engine holds, so images pruned by the model get their positions. Removed when upstream lets a model that
    ``supports_multimodal_pruning`` turn the re-numbering on for images.
    """
    object.__setattr__(multimodal_config, "is_multimodal_pruning_enabled", lambda: True)


def image_positions(grid_thw: list[int], merge_size: int) -> Tensor:
    """(N, 4) long: per merged token of an image (raster order) its M-RoPE (t, h, w) counted from the image's first
    position, and in the last column the span the image takes, where the text after it continues: transformers'
    (and vitrim.vlm's) max(h, w) of the merged grid, where vLLM's ``compute_mrope_for_media`` writes the width (the
    two differ for an image taller than wide; :func:`video_positions` with one temporal patch)."""
    return video_positions(grid_thw, merge_size, 1.0)


def video_positions(grid_thw: list[int], merge_size: int, time_interval: Tensor | float) -> Tensor:
    """(N, 4) long: per merged token of a video or image of ``grid_thw`` (t, h, w patches; raster order) its M-RoPE
    cell counted from its first position, as the unmodified transformers model numbers it (``get_rope_index``):
    temporal patch τ at ``int(τ · time_interval)`` (a float product, then truncated; ``time_interval`` =
    ``tokens_per_second · second_per_grid_ts``), row and column as they are; and in the last column the span where
    the text after it continues, max(h, w) of the merged grid whatever the temporal extent.

    The layout of vLLM's ``compute_mrope_for_media`` (which vLLM's ``recompute_mrope_positions`` reads), except
    where vLLM's differs from transformers: vLLM truncates ``second_per_grid_ts`` to an integer before multiplying
    and writes the grid's width in the last column. Removed when upstream numbers media as transformers does.
    """
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    temporal = (torch.arange(t) * time_interval).long()
    coords = torch.stack(torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij"), dim=-1).reshape(
        -1, 3
    )
    span = torch.full((coords.shape[0], 1), max(h, w), dtype=torch.long)
    return torch.cat([coords, span], dim=1)


def patch_cpu_runner() -> None:
    """Give vLLM's ``CPUModelRunner.load_model`` the line ``GPUModelRunner.load_model`` has and it lacks, and, for
    vitrim's architectures, a later pipeline stage's receive buffer (:func:`allocate_pipeline_buffer`).

    After loading, the GPU runner sets ``is_multimodal_pruning_enabled`` from the model and the config; the CPU
    runner never does (vLLM 0.32), so pruned embeddings would keep their position columns and the prompt its stale
    positions. Applied by the plugin's ``register`` on a CPU platform only, once. Removed when upstream's
    ``CPUModelRunner.load_model`` sets the flag.
    """
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from vitrim.vllm.options import ARCHITECTURES

    if getattr(CPUModelRunner.load_model, "vitrim_patched", False):
        return
    original = CPUModelRunner.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        mm_config = self.model_config.multimodal_config
        self.is_multimodal_pruning_enabled = (
            supports_multimodal_pruning(self.get_model())
            and mm_config is not None
            and mm_config.is_multimodal_pruning_enabled()
        )
        if type(self.get_model()).__name__ in ARCHITECTURES:
            allocate_pipeline_buffer(self)

    load_model.vitrim_patched = True  # type: ignore[attr-defined]
    CPUModelRunner.load_model = load_model


def allocate_pipeline_buffer(runner: Any) -> None:
    """Give a CPU runner of a later pipeline stage the buffer its stage receives the hidden states into.

    ``GPUModelRunner`` allocates ``intermediate_tensors`` (the receive buffer of every stage but the first) in its
    dummy run, which vLLM 0.32's CPU worker skips when the model runs eagerly with an explicit KV-cache size (the
    ``--enforce-eager --kv-cache-memory-bytes`` a CPU server needs, Gemma 3's only mode), so the second stage stops
    at its first request (``assert self.intermediate_tensors is not None`` in
    ``sync_and_gather_intermediate_tensors``), an unmodified model as well. Allocated here as the dummy run would, for
    vitrim's architectures only (the plugin leaves other models as vLLM runs them). Removed when upstream's CPU
    runner allocates it outside the warm-up.
    """
    from vllm.distributed import get_pp_group

    if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
    )


def tap_input(module: Any, on_input: Any) -> None:
    """Call ``on_input(x)`` with the first argument of every ``module.forward(x, ...)``, then run it as before.

    For a module whose class vLLM wrapped with ``support_torch_compile``: its ``__call__`` calls ``self.forward``
    without PyTorch's hooks, so the tap replaces ``forward`` on the instance. Only where vLLM does not compile the
    module (``do_not_compile``: the default for vision encoders, ``compile_mm_encoder`` off); a compiled module
    fails here in one line. Removed when vLLM's wrapper runs the module's hooks.
    """
    if not getattr(module, "do_not_compile", True):
        raise ValueError(
            f"vitrim: vLLM compiles {type(module).__name__}, whose input vitrim reads; serve with the multimodal "
            "encoder uncompiled (compile_mm_encoder off, vLLM's default)"
        )
    original = module.forward

    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        on_input(x)
        return original(x, *args, **kwargs)

    module.forward = forward


def sequential_mrope_positions(num_tokens: int) -> tuple[Tensor, int]:
    """M-RoPE positions (3, L) 0 … L−1 and delta 0: what a trimmed prompt starts with before vLLM re-numbers it.

    vLLM's ``Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions`` assumes each image holds its full grid
    of placeholders (h·w) and fails on a prompt whose images hold fewer. The runner overwrites the positions from an
    image's first token on (``recompute_mrope_positions``, with the positions the embeddings carry), so only the
    text before the first image keeps these, and for it they are right. Removed when upstream lays out an image by
    its placeholder count (``mm_position.length``), as pruned media need.
    """
    return torch.arange(num_tokens).expand(3, num_tokens).clone(), 0


GEMMA3_ARCHITECTURE = "VitrimGemma3ForConditionalGeneration"


class Gemma3MRoPE:
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``) for vitrim's Gemma 3: the config declares a
    three-row M-RoPE (``mrope_section`` on the outer config only: the LLM's own rotary, built from the text config,
    stays one-dimensional), so vLLM asks the model for each request's positions
    (:mod:`vitrim.vllm.gemma3_positions`); and an image is never split between two steps
    (``disable_chunked_mm_input``), so its tokens see each other in the step that computes them."""

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        model_config.hf_config.mrope_section = [1, 1, 1]

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        vllm_config.scheduler_config.disable_chunked_mm_input = True


def declare_gemma3_mrope() -> None:
    """Register :class:`Gemma3MRoPE` for vitrim's Gemma 3 architecture (only that name: every other model is
    untouched). Called by the plugin's ``register`` before vLLM builds a model's config. Removed when upstream lets
    a model without M-RoPE give its prompt's positions."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP.setdefault(GEMMA3_ARCHITECTURE, Gemma3MRoPE)


def media_regions(input_ids: list[int], vision_start: int, vision_end: int) -> list[tuple[int, int]]:
    """[start, end) of each image's or video's placeholders in a Qwen prompt: the tokens between a vision start
    outside any medium and its vision end (a Qwen3-VL video's timestamps and per-temporal-patch vision start / end
    inside it, transformers ≥ 5.10 keeping the outer pair)."""
    regions, depth, start = [], 0, 0
    for index, token in enumerate(input_ids):
        if token == vision_start:
            start = index + 1 if depth == 0 else start
            depth += 1
        elif token == vision_end and depth:
            depth -= 1
            if depth == 0:
                regions.append((start, index))
    return regions


def renumber_media(
    input_ids: list[int],
    cells: list[Tensor],
    positions: Tensor,
    computed: int,
    config: Any,
) -> tuple[Tensor, int]:
    """vLLM's M-RoPE re-numbering of a prompt whose media were pruned, written for vitrim's Qwen classes.

    input_ids: the prompt (N tokens); cells: per image or video of this prefill chunk, in prompt order, (4, n) its
    rows' positions counted from the token after its vision start and, in the last row, where the text after it
    continues (:func:`video_positions`; a chunk may hold the first or last part of a medium's rows); positions:
    (3, N) the prompt's positions so far, those before ``computed`` (tokens already prefilled) right. Returns the
    positions and vLLM's ``mrope_position_delta`` (largest + 1 − N).

    vLLM 0.32's ``recompute_mrope_positions`` finds a medium's vision start by the count of rows placed so far (a
    second medium after as many text tokens as the first holds is numbered from the first one's place), and on a
    chunk starting inside a Qwen3-VL video takes the base from the temporal patch's vision start, not the video's.
    Here each medium is found in the prompt itself (:func:`media_regions`), and its base is the position of ITS
    vision start + 1. Removed when upstream places each medium from its own vision start.
    """
    positions = positions.clone()
    total = len(input_ids)
    if cells:
        media = {config.image_token_id, config.video_token_id}
        is_text = torch.tensor([token not in media for token in input_ids], device=positions.device)
        regions = [
            region
            for region in media_regions(input_ids, config.vision_start_token_id, config.vision_end_token_id)
            if region[1] > computed
        ]
        for (start, end), rows in zip(regions, cells, strict=False):  # later media have no rows in this chunk
            rows = rows.to(positions.device)
            base = positions[0, start - 1] + 1  # the vision start is text: its three rows agree
            first = max(start, computed)  # a chunk starting inside the medium holds its later rows
            positions[:, first : first + rows.shape[1]] = rows[:3] + base
            positions[:, end:] = base + rows[3, 0] + is_text[end:].long().cumsum(0) - 1  # vision end at the span
    return positions, int(positions.max()) + 1 - total

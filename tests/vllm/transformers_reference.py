"""transformers + vitrim.vlm on a checkpoint folder: the reference tests/vllm compares vLLM against.

Run as a script, in a fresh interpreter, by tests/vllm/engines.py: by default in vLLM's environment, so vitrim.vlm
runs on the transformers vLLM pins (5.19 for vLLM 0.32); ``VITRIM_REFERENCE_PYTHON`` picks another interpreter
(vitrim's main ``.venv``, transformers 5.24, gave the same tokens, seeds and selections for every method).

    python tests/vllm/transformers_reference.py SPECS.json OUT.json

SPECS: a list of runs, each {"folder", "family": "llava" | "llava_next" | "qwen2_5_vl" | "qwen3_vl" | "gemma3",
"method": name or null, "options": {...} (keep and the method's options), "positions": "original" | "contiguous" |
"vllm_evs" | "vllm_qwen3_evs", "max_tokens", "requests": [{"prompt", "images": [png paths], "videos": [{"frames": .npy
path of (T, H, W, 3) uint8, "fps"}], "question"}]} ("videos" optional: a clip's frames as read, every one kept:
``do_sample_frames=False``; "question" optional: ``generate(texts=...)``, CDPruner's question for its CLIP).
OUT: per run, per request {"tokens": greedy ids, "prompt_tokens": the unpruned prompt's
length, "seeds": per image the content seed of its pixels (LLaVA-NeXT: of its own tiles), "video_seeds": per video the
content seed of its pixels, "media": Qwen, "image" / "video" per medium in prompt order (else null),
"image_tokens": per image its unpruned token count, "kept": per image or video (prompt order) kept raster indices
(LLaVA-NeXT: packed positions, newlines included; null without a method), "entered": per image or video the tokens it
handed the LLM (its kept patches, + 1 for VisionZip's [CLS]; null without a method), "video_tokens": per video its
unpruned token count t·(h/m)·(w/m), "video_grids": per video its merged grid [t, h/m, w/m], "in_tree_kept": Qwen3-VL
with evs / vidcom2, per video what vLLM's in-tree function keeps on the merger output and on it with the DeepStack
features ("merger", "with_deepstack"), else null}.

``positions="contiguous"`` numbers the LLM input 0, 1, 2, … whatever vitrim.vlm does: a forward pre-hook on the
language model, after vitrim.vlm's, sets ``position_ids`` to the cache length + 0 … q−1 at every step;
``"original"`` runs vitrim.vlm as it is (on LLaVA its default already numbers the shortened input 0, 1, 2, …).
``"vllm_evs"`` (Qwen2.5-VL, one video, whole-second ``second_per_grid_ts``): vitrim.vlm's positions moved to vLLM
0.32's EVS convention (``recompute_mrope_positions``: the text after a video continues at start + W′, not
start + max(H′, W′); decode from the largest prefill position + 1), on the same kept tokens. ``"vllm_qwen3_evs"``
(Qwen3-VL, one video): generate once with vitrim.vlm, then again on the same kept tokens at the positions vLLM 0.32's
own ``recompute_mrope_positions`` gives the pruned prompt (:func:`vllm_qwen3_pruned_positions`).
"""

from __future__ import annotations

import itertools
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

QWEN_FAMILIES = ("qwen2_5_vl", "qwen3_vl")  # the families whose prompts may mix images and videos


def make_torchvision_importable() -> None:
    """As tests/conftest.py: the main venv's torchvision wheel has no compiled ops for this CPU torch."""
    try:
        import torchvision
    except RuntimeError:
        for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules.pop("torchvision", None)
        import torchvision  # noqa: F401


def contiguous_positions(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    embeds = kwargs["inputs_embeds"]  # (1, q, D)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = 0 if cache is None else int(cache.get_seq_length())
    kwargs["position_ids"] = torch.arange(past, past + embeds.shape[1], device=embeds.device)[None]
    return args, kwargs


class GivenPositions:
    """A forward pre-hook on the language model after vitrim.vlm's, while ``prefill`` is set: the prefill's M-RoPE
    positions replaced by ``prefill`` (3, q), every decode step at its largest + 1 + the step's index (as vLLM
    decodes: ``mrope_position_delta``)."""

    def __init__(self) -> None:
        self.prefill: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.prefill is None:
            return None
        positions = kwargs["position_ids"].clone()  # (3 or 4, 1, q): M-RoPE in the last 3 rows
        q = kwargs["inputs_embeds"].shape[1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = 0 if cache is None else int(cache.get_seq_length())
        if past == 0:
            assert q == self.prefill.shape[1], (q, self.prefill.shape)
            positions[-3:] = self.prefill[:, None].to(positions)
        else:
            steps = self.prefill.max() + 1 + past - self.prefill.shape[1] + torch.arange(q)
            positions[-3:] = steps.view(1, 1, q).to(positions)
        kwargs["position_ids"] = positions
        return args, kwargs


def vllm_qwen3_pruned_positions(model: Any, inputs: Any, kept: torch.Tensor) -> torch.Tensor:
    """(3, q): the M-RoPE positions vLLM 0.32 gives the pruned Qwen3-VL prompt (one video) of ``inputs`` keeping
    the video's raster indices ``kept``, computed by vLLM's own ``recompute_mrope_positions`` on what its Qwen3-VL
    class hands it: the prompt with the kept tokens lumped into the first temporal patch's placeholder
    (``get_video_repl``), and per replacement token (timestamps, vision start / end, kept video tokens, in their
    true layout) its unpruned position counted from the replacement's start. Needs the text before the video to
    hold more tokens than one temporal patch's timestamp (else vLLM reads the prompt's last position as the base)."""
    from vllm.multimodal.video_prune.evs import recompute_mrope_positions

    config = model.config
    ids = inputs["input_ids"][0]
    full = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], video_grid_thw=inputs["video_grid_thw"]
    )[0][:, 0]  # (3, L) the unmodified model's
    video = (ids == config.video_token_id).nonzero()[:, 0]
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[video] = False
    keep[video[kept]] = True
    outer = int((ids == config.vision_start_token_id).nonzero()[0])  # transformers >= 5.10 keeps the outer pair
    last_inner_end = int((ids == config.vision_end_token_id).nonzero()[-2])
    first, end = outer + 1, last_inner_end + 1  # the replacement vLLM embeds: [timestamp, start, tokens, end] per patch
    shown = ids[keep]  # (q,) the pruned prompt, true layout
    columns = keep.nonzero()[:, 0]
    region = (columns >= first) & (columns < end)
    mm = torch.zeros(5, int(region.sum()), dtype=torch.long)
    mm[:3] = full[:, columns[region]] - full[0, first]
    mm[3] = shown[region] == config.vision_start_token_id
    mm[4] = shown[region] == config.video_token_id
    lumped = shown.clone()  # the placeholder vLLM's processor writes: every kept token in the first patch
    inside = lumped[region]
    tokens = int(mm[4].sum())
    first_start = int((inside == config.vision_start_token_id).nonzero()[0])  # a timestamp's tokens
    if outer <= first_start:
        raise ValueError(f"positions='vllm_qwen3_evs' needs more than {first_start} tokens before the video")
    rest = inside[first_start + 1 :][inside[first_start + 1 :] != config.video_token_id]
    lumped[region] = torch.cat([inside[: first_start + 1], torch.full((tokens,), config.video_token_id), rest])
    initial = torch.arange(len(shown)).expand(3, -1).clone()  # only the text before the video is read
    positions, _ = recompute_mrope_positions(
        lumped, [mm], initial, 0, config.vision_start_token_id, config.image_token_id, config.video_token_id
    )
    return positions


class VllmEvsPositions:
    """A forward pre-hook on the language model after vitrim.vlm's: its positions as vLLM's EVS path numbers them.

    Set per request: ``tail`` (prompt tokens after the video) and ``shift`` (W′ − max(H′, W′)); the prefill's last
    ``tail`` columns move by ``shift``; every decode step sits at the largest prefill position + 1 + its index."""

    def __init__(self) -> None:
        self.tail = 0
        self.shift = 0
        self.prefill = 0
        self.next = torch.zeros(())

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        positions = kwargs["position_ids"].clone()  # (3 or 4, 1, q): M-RoPE in the last 3 rows
        q = kwargs["inputs_embeds"].shape[1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = 0 if cache is None else int(cache.get_seq_length())
        if past == 0:
            positions[-3:, :, q - self.tail :] += self.shift
            self.prefill, self.next = q, positions[-3:].max() + 1
        else:
            steps = self.next + past - self.prefill + torch.arange(q, device=positions.device)
            positions[-3:] = steps.view(1, 1, q)
        kwargs["position_ids"] = positions
        return args, kwargs


def main(spec_path: str, out_path: str) -> None:
    make_torchvision_importable()
    specs = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps([run(spec) for spec in specs]))


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import transformers
    from PIL import Image

    import vitrim.vlm
    from vitrim.vlm.evidence.seeds import content_seed

    torch.manual_seed(0)
    classes: dict[str, Any] = {
        "llava": transformers.LlavaForConditionalGeneration,
        "llava_next": transformers.LlavaNextForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "gemma3": transformers.Gemma3ForConditionalGeneration,
    }
    model = classes[spec["family"]].from_pretrained(spec["folder"], dtype=torch.float32).eval()
    plain = None  # an unmodified copy, for what vLLM's in-tree video functions pick on its features
    if spec["family"] == "qwen3_vl" and spec["method"] in ("evs", "vidcom2"):
        plain = classes[spec["family"]].from_pretrained(spec["folder"], dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(spec["folder"])
    if spec["method"] is not None:
        vitrim.vlm.apply(model, spec["method"], **spec["options"])
    if spec["positions"] == "contiguous":
        model.model.language_model.register_forward_pre_hook(contiguous_positions, with_kwargs=True)
    vllm_evs = VllmEvsPositions()
    if spec["positions"] == "vllm_evs":
        model.model.language_model.register_forward_pre_hook(vllm_evs, with_kwargs=True)
    given = GivenPositions()
    if spec["positions"] == "vllm_qwen3_evs":
        model.model.language_model.register_forward_pre_hook(given, with_kwargs=True)
    results = []
    for request in spec["requests"]:
        images = [Image.open(path).convert("RGB") for path in request["images"]]
        clips = request.get("videos", [])
        videos = {}
        if clips:
            videos = dict(
                videos=[np.load(clip["frames"]) for clip in clips],
                video_metadata=[video_metadata(clip) for clip in clips],
                do_sample_frames=False,
            )
        inputs = processor(images=images or None, text=request["prompt"], return_tensors="pt", **videos)
        video_grids = []
        if clips:  # Qwen: the merged grid (t, h/m, w/m) of each video
            merge = model.config.vision_config.spatial_merge_size
            video_grids = [[t, h // merge, w // merge] for t, h, w in inputs["video_grid_thw"].tolist()]
        if spec["positions"] == "vllm_evs":
            vllm_evs.tail, vllm_evs.shift = evs_text_shift(inputs, video_grids, model.config.video_token_id)
        pixels = inputs.get("pixel_values")
        if pixels is None:
            per_image, image_tokens = [], []
        elif spec["family"] in ("qwen2_5_vl", "qwen3_vl"):
            grid = inputs["image_grid_thw"]
            per_image = pixels.split(grid.prod(-1).tolist())
            image_tokens = (grid.prod(-1) // model.config.vision_config.spatial_merge_size**2).tolist()
        elif spec["family"] == "llava_next":  # an image's own tiles (the processor pads to the most), packed count
            per_image, image_tokens = llava_next_images(model.config, inputs)
        elif spec["family"] == "gemma3":  # the projector's pooled grid
            per_image = list(pixels)
            image_tokens = [int(model.config.mm_tokens_per_image)] * len(per_image)
        else:
            per_image = list(pixels)
            vision = model.config.vision_config
            image_tokens = [(vision.image_size // vision.patch_size) ** 2] * len(per_image)
        video_seeds = []
        if clips:
            video_seeds = [
                content_seed(p) for p in inputs["pixel_values_videos"].split(inputs["video_grid_thw"].prod(-1).tolist())
            ]
        asked = {"texts": request["question"]} if "question" in request else {}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=spec["max_tokens"], do_sample=False, **asked)
            if spec["positions"] == "vllm_qwen3_evs":  # again, on the same kept tokens, at vLLM's positions
                (kept,) = vitrim.vlm.last_selection(model)
                given.prefill = vllm_qwen3_pruned_positions(model, inputs, kept)
                out = model.generate(**inputs, max_new_tokens=spec["max_tokens"], do_sample=False)
                given.prefill = None
        selection = vitrim.vlm.last_selection(model) if spec["method"] is not None else None
        groups = vitrim.vlm.last_selection(model, groups=True) if spec["method"] is not None else None
        results.append(
            {
                "tokens": out[0, inputs["input_ids"].shape[1] :].tolist(),
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "seeds": [content_seed(p) for p in per_image],
                "video_seeds": video_seeds,
                "media": media_order(inputs, model.config, spec["family"]) if spec["family"] in QWEN_FAMILIES else None,
                "image_tokens": image_tokens,
                "kept": None if selection is None else [kept.tolist() for kept in selection],
                "entered": None if groups is None else [len(image) for image in groups],
                "video_tokens": [t * h * w for t, h, w in video_grids],
                "video_grids": video_grids,
                "in_tree_kept": None if plain is None or not clips else in_tree_kept(plain, inputs, spec),
            }
        )
    return results


def llava_next_images(config: Any, inputs: Any) -> tuple[list[torch.Tensor], list[int]]:
    """LLaVA-NeXT: per image its own tiles (the processor pads every image to the most tiles) and the image tokens
    the processor wrote for it (a run of image tokens; the requests separate their images by text)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    vision = config.vision_config
    tiles = [
        int(image_size_to_num_patches(size, config.image_grid_pinpoints, vision.image_size))
        for size in inputs["image_sizes"]
    ]
    is_image = (inputs["input_ids"][0] == config.image_token_id).long()
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), is_image, torch.zeros(1, dtype=torch.long)]))
    runs = ((edges == -1).nonzero()[:, 0] - (edges == 1).nonzero()[:, 0]).tolist()
    return [pixels[:count] for pixels, count in zip(inputs["pixel_values"], tiles, strict=True)], runs


def in_tree_kept(model: Any, inputs: Any, spec: dict[str, Any]) -> dict[str, list[list[int]]]:
    """Qwen3-VL: per video, the indices vLLM's in-tree ``compute_retention_mask`` (of ``spec["method"]``) keeps on
    the unmodified tower's merger output ("merger", what vitrim scores) and on that output with the DeepStack
    features concatenated ("with_deepstack": the rows vLLM's Qwen3-VL class hands the function)."""
    import importlib

    in_tree = importlib.import_module(f"vllm.multimodal.video_prune.{spec['method']}")
    rate = spec["options"]["video_pruning_rate"]
    grids = inputs["video_grid_thw"]
    with torch.no_grad():
        features = model.model.get_video_features(inputs["pixel_values_videos"], grids)
    merge = model.config.vision_config.spatial_merge_size
    out: dict[str, list[list[int]]] = {"merger": [], "with_deepstack": []}
    for index, grid in enumerate(grids.tolist()):
        main = features.pooler_output[index]
        stacked = torch.cat([main, *(levels[index] for levels in features.deepstack_features)], dim=-1)
        for name, rows in (("merger", main), ("with_deepstack", stacked)):
            out[name].append(in_tree.compute_retention_mask(rows, grid, merge, rate).nonzero()[:, 0].tolist())
    return out


def media_order(inputs: Any, config: Any, family: str) -> list[str]:
    """Qwen: "image" or "video" per medium of the prompt, in reading order: each run of image tokens is an image,
    each run of video tokens a video on Qwen2.5-VL and one temporal patch of a video on Qwen3-VL (its timestamp text
    stands between them)."""
    ids = inputs["input_ids"][0]
    kinds = {config.image_token_id: "image", config.video_token_id: "video"}
    runs = [token for token, _ in itertools.groupby(ids.tolist())]
    frames = iter(inputs["video_grid_thw"][:, 0].tolist() if "video_grid_thw" in inputs else [])
    media: list[str] = []
    skip = 0
    for token in runs:
        if token not in kinds:
            continue
        if token == config.video_token_id and skip:
            skip -= 1
            continue
        media.append(kinds[token])
        if token == config.video_token_id and family == "qwen3_vl":
            skip = next(frames) - 1
    return media


def video_metadata(clip: dict[str, Any]) -> Any:
    """The metadata of a clip whose every frame is given (what vLLM's video loader reports, read as is)."""
    from transformers.video_utils import VideoMetadata

    frames = int(np.load(clip["frames"], mmap_mode="r").shape[0])
    fps = float(clip["fps"])
    return VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps, frames_indices=list(range(frames)))


def evs_text_shift(inputs: Any, video_grids: list[list[int]], video_token: int) -> tuple[int, int]:
    """(tokens after the prompt's one video, W′ − max(H′, W′)): what vLLM's EVS path moves the text after by.
    Refuses what the hook does not model: several videos, or a ``second_per_grid_ts`` vLLM would truncate."""
    (grid,) = video_grids
    seconds = float(inputs["second_per_grid_ts"][0])
    if seconds != int(seconds):
        raise ValueError(f"positions='vllm_evs' models whole-second second_per_grid_ts only, got {seconds}")
    ids = inputs["input_ids"][0]
    last = int((ids == video_token).nonzero()[-1])
    return len(ids) - last - 1, grid[2] - max(grid[1], grid[2])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

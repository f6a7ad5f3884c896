"""transformers + vitrim.vlm on a checkpoint folder: the reference tests/vllm compares vLLM against.

Run as a script, in a fresh interpreter, by tests/vllm/engines.py: by default in vLLM's environment, so vitrim.vlm
runs on the transformers vLLM pins (5.19 for vLLM 0.32); ``VITRIM_REFERENCE_PYTHON`` picks another interpreter
(vitrim's main ``.venv``, transformers 5.24, gave the same tokens, seeds and selections for every method).

    python tests/vllm/transformers_reference.py SPECS.json OUT.json

SPECS: a list of runs, each {"folder", "family": "llava" | "qwen2_5_vl" | "qwen3_vl", "method": name or null,
"options": {...} (keep and the method's options), "positions": "original" | "contiguous", "max_tokens", "requests":
[{"prompt", "images": [png paths]}]}. OUT: per run, per request {"tokens": greedy ids, "prompt_tokens": the unpruned
prompt's length, "seeds": per image the content seed of its pixels, "image_tokens": per image its unpruned token
count, "kept": per image kept raster indices (null without a method), "entered": per image the tokens it handed the
LLM (its kept patches, + 1 for VisionZip's [CLS]; null without a method)}.

``positions="contiguous"`` numbers the LLM input 0, 1, 2, … whatever vitrim.vlm does: a forward pre-hook on the
language model, after vitrim.vlm's, sets ``position_ids`` to the cache length + 0 … q−1 at every step;
``"original"`` runs vitrim.vlm as it is (on LLaVA its default already numbers the shortened input 0, 1, 2, …).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import torch


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
    classes = {
        "llava": transformers.LlavaForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
    }
    model = classes[spec["family"]].from_pretrained(spec["folder"], dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(spec["folder"])
    if spec["method"] is not None:
        vitrim.vlm.apply(model, spec["method"], **spec["options"])
    if spec["positions"] == "contiguous":
        model.model.language_model.register_forward_pre_hook(contiguous_positions, with_kwargs=True)
    results = []
    for request in spec["requests"]:
        images = [Image.open(path).convert("RGB") for path in request["images"]]
        inputs = processor(images=images or None, text=request["prompt"], return_tensors="pt")
        pixels = inputs["pixel_values"]
        if spec["family"] in ("qwen2_5_vl", "qwen3_vl"):
            grid = inputs["image_grid_thw"]
            per_image = pixels.split(grid.prod(-1).tolist())
            image_tokens = (grid.prod(-1) // model.config.vision_config.spatial_merge_size**2).tolist()
        else:
            per_image = list(pixels)
            vision = model.config.vision_config
            image_tokens = [(vision.image_size // vision.patch_size) ** 2] * len(per_image)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=spec["max_tokens"], do_sample=False)
        selection = vitrim.vlm.last_selection(model) if spec["method"] is not None else None
        groups = vitrim.vlm.last_selection(model, groups=True) if spec["method"] is not None else None
        results.append(
            {
                "tokens": out[0, inputs["input_ids"].shape[1] :].tolist(),
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "seeds": [content_seed(p) for p in per_image],
                "image_tokens": image_tokens,
                "kept": None if selection is None else [kept.tolist() for kept in selection],
                "entered": None if groups is None else [len(image) for image in groups],
            }
        )
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""vLLM engines on the tiny checkpoints, and the transformers reference run beside them (helpers of tests/vllm)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from PIL import Image

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
REFERENCE_SCRIPT = Path(__file__).with_name("transformers_reference.py")
# the reference runs in this (vLLM's) environment, on the transformers vLLM pins (5.19 for vLLM 0.32);
# VITRIM_REFERENCE_PYTHON runs it in another (the main .venv: transformers 5.24; both gave the same results)
REFERENCE_PYTHON = Path(os.environ.get("VITRIM_REFERENCE_PYTHON", sys.executable))

PIXELS_PER_TOKEN = 4  # the tiny Qwen folders: 2-px patches merged 2×2
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=512,
    max_num_seqs=8,
    seed=0,
    kv_cache_memory_bytes=256 << 20,
    limit_mm_per_prompt={"image": 2},
    enable_prefix_caching=False,  # a request alone is computed again, not read from the batch's cache
)


def overrides(architecture: str, method: str | None, **options: Any) -> dict[str, Any] | None:
    if method is None:
        return None
    return {"architectures": [architecture], "vitrim": {"method": method, **options}}


def with_engine(folder: Path, hf_overrides: dict[str, Any] | None, work: Callable[[Any], T], **engine_args: Any) -> T:
    """``work(llm)`` on a ``vllm.LLM`` of ``folder`` (float32, eager; ``engine_args`` over :data:`ENGINE_ARGS`),
    which is then shut down and freed.

    No reference to the engine outlives this call: an engine freed while the next one runs would tear down the
    process-wide parallel groups the new one uses."""
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm import LLM

    llm = LLM(model=str(folder), hf_overrides=hf_overrides, **(ENGINE_ARGS | engine_args))
    try:
        return work(llm)
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def greedy(llm: Any, requests: list[dict[str, Any]], max_tokens: int) -> list[Any]:
    """One ``generate`` over ``requests`` ({"prompt", "images": [PNG paths], "videos": [{"frames": .npy path,
    "fps"}]}, "videos", "mm_processor_kwargs", "uuids" and "video_uuids" optional); the RequestOutputs in order."""
    from vllm import SamplingParams

    prompts = []
    for request in requests:
        images = [Image.open(path).convert("RGB") for path in request["images"]]
        videos = [video_item(clip) for clip in request.get("videos", [])]
        prompt: dict[str, Any] = {"prompt": request["prompt"]}
        if "mm_processor_kwargs" in request:  # e.g. {"vitrim": {"keep": 4}}: this request's own keep
            prompt["mm_processor_kwargs"] = request["mm_processor_kwargs"]
        names = {"image": request.get("uuids"), "video": request.get("video_uuids")}
        if any(names.values()):  # the media's names: fresh ones keep vLLM's caches from handing on earlier features
            prompt["multi_modal_uuids"] = {kind: given for kind, given in names.items() if given}
        data: dict[str, Any] = {}
        if images:
            data["image"] = images if len(images) > 1 else images[0]
        if videos:
            data["video"] = videos if len(videos) > 1 else videos[0]
        if data:
            prompt["multi_modal_data"] = data
        prompts.append(prompt)
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)


def random_pictures(work: Path, sizes: list[tuple[int, int]], seed: int = 0) -> list[str]:
    """Random RGB PNGs ``work/image{i}.png`` of the (height, width) ``sizes``, drawn in order from ``seed``."""
    rng = np.random.default_rng(seed)
    paths = []
    for index, (height, width) in enumerate(sizes):
        path = work / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def three_requests(
    work: Path, sizes: list[tuple[int, int]], image: str = "<image>", seed: int = 0
) -> list[dict[str, Any]]:
    """Three prompts; random images (PNGs in ``work``, drawn from ``seed``) of three (height, width) ``sizes``, one
    prompt with two (its second the first prompt's image, or a fourth image where ``sizes`` gives four: a method
    reading the prompt keeps one selection per prompt, and the record by pixels holds one per image); ``image``:
    the family's image placeholder."""
    paths = random_pictures(work, sizes, seed)
    return [
        {"prompt": f"w10 w11 {image} w12 w13", "images": [paths[0]]},
        {"prompt": f"w20 {image} w21 w22 w23 w24 w25 w26", "images": [paths[1]]},
        {"prompt": f"w30 w31 {image} w32 {image} w33", "images": [paths[2], paths[-1] if len(paths) > 3 else paths[0]]},
    ]


def llava_requests(work: Path, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`three_requests` for LLaVA: images of three sizes (the processor resizes and crops each to 16 px)."""
    return three_requests(work, [(16, 16), (24, 20), (40, 32)], seed=seed)


def gemma3_requests(work: Path) -> list[dict[str, Any]]:
    """:func:`three_requests` for Gemma 3: images of three sizes (the processor resizes each to 32 px)."""
    return three_requests(work, [(32, 32), (40, 24), (64, 48)], image="<start_of_image>")


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
QWEN_TAIL = " ".join(f"w{i}" for i in range(40, 52))  # the last token holds the largest position (test_plugin_video)


def qwen_media_requests(
    work: Path,
    tag: str,
    entries: list[dict[str, Any] | None],
    frames_per_patch: int,
    patches: int = 2,
    seed: int = 2,
    clip_seed: int = 20,
) -> list[dict[str, Any]]:
    """One Qwen request per entry of ``entries`` (its ``vitrim`` entry of ``mm_processor_kwargs``; None: the
    engine's options): a random 16 × 24 image (drawn from ``seed``) and a clip of ``patches`` temporal patches of
    2 × 3 merged tokens (:func:`clip_frames` from ``clip_seed`` + its index) at 2 fps, files ``tag``_image{i}.png and
    ``tag``_clip{i}.npy in ``work``; the image before the video, the text after long enough (:data:`QWEN_TAIL`)."""
    rng = np.random.default_rng(seed)
    requests = []
    for index, entry in enumerate(entries):
        image, clip = work / f"{tag}_image{index}.png", work / f"{tag}_clip{index}.npy"
        Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(image)
        np.save(clip, clip_frames(patches, 2, 3, frames_per_patch=frames_per_patch, seed=clip_seed + index))
        request: dict[str, Any] = {
            # Qwen3-VL's tokenizer here reads "w00" as 3 tokens: as many before the image as it keeps (the case
            # vLLM 0.32's own re-numbering misplaces the video in: vitrim.vllm.compat.renumber_media)
            "prompt": f"w{index}0 {QWEN_IMAGE} w{index}1 {QWEN_VIDEO} {QWEN_TAIL}",
            "images": [str(image)],
            "videos": [{"frames": str(clip), "fps": 2.0}],
        }
        if entry is not None:
            request["mm_processor_kwargs"] = {"vitrim": entry}
        requests.append(request)
    return requests


def video_item(clip: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """A clip as vLLM's Qwen processors take it: its (T, H, W, 3) uint8 frames and the metadata its video loader
    would report, every frame kept (``do_sample_frames`` False: the processor reads the frames as given)."""
    frames = np.load(clip["frames"])
    count, fps = int(frames.shape[0]), float(clip["fps"])
    metadata = dict(
        fps=fps,
        duration=count / fps,
        total_num_frames=count,
        frames_indices=list(range(count)),
        video_backend="opencv",
        do_sample_frames=False,
    )
    return frames, metadata


def clip_frames(patches: int, rows: int, columns: int, frames_per_patch: int, seed: int) -> np.ndarray:
    """(T, H, W, 3) uint8 frames of ``patches`` temporal patches: a random first patch, then in each next one about
    a third of the merged cells redrawn (the rest unchanged), so EVS and VidCom2 have something to rank."""
    rng = np.random.default_rng(seed)
    cell = PIXELS_PER_TOKEN
    frame = rng.integers(0, 256, (rows * cell, columns * cell, 3), dtype=np.uint8)
    frames = []
    for patch in range(patches):
        if patch:
            frame = frame.copy()
            for r, c in zip(*np.nonzero(rng.random((rows, columns)) < 0.35), strict=True):
                frame[r * cell : (r + 1) * cell, c * cell : (c + 1) * cell] = rng.integers(0, 256, (cell, cell, 3))
        frames += [frame] * frames_per_patch
    return np.stack(frames)


def reference_spec(
    folder: Path,
    family: str,
    method: str,
    options: dict[str, Any],
    requests: list[dict[str, Any]],
    max_tokens: int,
    positions: str = "original",
) -> dict[str, Any]:
    """One run of tests/vllm/transformers_reference.py: ``method`` with ``options`` on ``family``'s tiny ``folder``,
    the ``requests`` greedy for ``max_tokens``, the kept tokens numbered as ``positions`` says."""
    return {
        "folder": str(folder),
        "family": family,
        "method": method,
        "options": options,
        "positions": positions,
        "max_tokens": max_tokens,
        "requests": requests,
    }


def transformers_reference(specs: list[dict[str, Any]], work: Path) -> list[list[dict[str, Any]]]:
    """tests/vllm/transformers_reference.py run in a fresh interpreter on ``specs``; its results per spec."""
    spec_path, out_path = work / "specs.json", work / "reference.json"
    spec_path.write_text(json.dumps(specs))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(REFERENCE_PYTHON), str(REFERENCE_SCRIPT), str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the transformers reference failed:\n{done.stderr[-4000:]}")
    return json.loads(out_path.read_text())


def trimmed_runs(
    folder: Path,
    architecture: str,
    method: str,
    options: dict[str, Any],
    requests: list[dict[str, Any]],
    tokens: int,
    **engine_args: Any,
) -> tuple[list[Any], list[Any], dict[int, list[int]]]:
    """One engine of ``architecture`` with ``method`` (``engine_args`` over :data:`ENGINE_ARGS`): the requests
    together, each alone, and what it kept. Each alone run names its media afresh: under the batch's names vLLM's
    encoder cache would hand it the batch's features, and its tower would not run without the batch."""

    def run(llm: Any) -> tuple[list[Any], list[Any], dict[int, list[int]]]:
        from vitrim.vllm.selection_record import recorded_selections

        return *together_and_alone(llm, requests, tokens), recorded_selections(llm)

    return with_engine(folder, overrides(architecture, method, **options), run, **engine_args)


def together_and_alone(llm: Any, requests: list[dict[str, Any]], tokens: int) -> tuple[list[Any], list[Any]]:
    """The RequestOutputs of ``requests`` in one ``generate``, then of each alone under fresh media names
    (:func:`named_afresh`), in order."""
    together = greedy(llm, requests, tokens)
    alone = [greedy(llm, [named_afresh(request, f"alone{i}")], tokens)[0] for i, request in enumerate(requests)]
    return together, alone


def named_afresh(request: dict[str, Any], tag: str) -> dict[str, Any]:
    """``request`` with its images and videos named ``tag``-image-j / ``tag``-video-j (``multi_modal_uuids``)."""
    named = dict(request)
    if request.get("images"):
        named["uuids"] = [f"{tag}-image-{j}" for j in range(len(request["images"]))]
    if request.get("videos"):
        named["video_uuids"] = [f"{tag}-video-{j}" for j in range(len(request["videos"]))]
    return named


def assert_like_reference(
    requests: list[dict[str, Any]],
    runs: tuple[list[Any], list[Any], dict[int, list[int]]],
    reference: list[dict[str, Any]],
) -> None:
    """Each request: together == alone == the reference's tokens; the reference's kept indices per image (by its
    pixels' seed); the prompt shorter than the unpruned one by exactly the dropped image tokens."""
    together, alone, kept = runs
    for request, batched, single, expected in zip(requests, together, alone, reference, strict=True):
        tokens = list(batched.outputs[0].token_ids)
        assert tokens == list(single.outputs[0].token_ids), request["prompt"]
        assert tokens == expected["tokens"], request["prompt"]
        dropped = 0
        for seed, reference_kept, entered, full in zip(
            expected["seeds"], expected["kept"], expected["entered"], expected["image_tokens"], strict=True
        ):
            assert kept[seed] == reference_kept, request["prompt"]
            assert len(reference_kept) <= entered <= full  # entered: + VisionZip's [CLS]
            dropped += full - entered
        assert len(batched.prompt_token_ids) == expected["prompt_tokens"] - dropped


def assert_tower_on_grid_like_reference(
    requests: list[dict[str, Any]],
    runs: tuple[list[Any], list[Any], dict[int, list[int]]],
    reference: list[dict[str, Any]],
    patches: int,
) -> None:
    """A Gemma 3 tower method: each request together == alone == the reference's tokens, the prompt as long as the
    reference's (every pooled soft token stays, the reduced patches back on the grid), and per image the reference's
    ``patches`` kept patches."""
    together, alone, kept = runs
    for request, batched, single, expected in zip(requests, together, alone, reference, strict=True):
        tokens = list(batched.outputs[0].token_ids)
        assert tokens == list(single.outputs[0].token_ids) == expected["tokens"], request["prompt"]
        assert len(batched.prompt_token_ids) == expected["prompt_tokens"]
        for seed, reference_kept in zip(expected["seeds"], expected["kept"], strict=True):
            assert kept[seed] == reference_kept, request["prompt"]
            assert len(reference_kept) == patches


def assert_media_like_reference(
    requests: list[dict[str, Any]],
    runs: tuple[list[Any], list[Any], dict[int, list[int]]],
    reference: list[dict[str, Any]],
) -> int:
    """Each request of images and videos (Qwen): together == alone == the reference's tokens; each image's and
    video's kept indices the reference's (by its pixels' seed); the prompt shorter than the unpruned one by exactly
    the dropped tokens. Returns the tokens dropped over all requests."""
    together, alone, recorded = runs
    pruned = 0
    for request, batched, single, expected in zip(requests, together, alone, reference, strict=True):
        tokens = list(batched.outputs[0].token_ids)
        assert tokens == list(single.outputs[0].token_ids), request["prompt"]
        assert tokens == expected["tokens"], request["prompt"]
        dropped = 0
        for (seed, full), kept, kind in zip(media_of(expected), expected["kept"], expected["media"], strict=True):
            assert recorded[seed] == kept, (request["prompt"], kind)
            dropped += full - len(kept)
        assert len(batched.prompt_token_ids) == expected["prompt_tokens"] - dropped, request["prompt"]
        pruned += dropped
    return pruned


def media_of(expected: dict[str, Any]) -> list[tuple[int, int]]:
    """(content seed, unpruned token count) of each image and video of a reference request, in prompt order."""
    images = iter(zip(expected["seeds"], expected["image_tokens"], strict=True))
    videos = iter(zip(expected["video_seeds"], expected["video_tokens"], strict=True))
    return [next(images if kind == "image" else videos) for kind in expected["media"]]

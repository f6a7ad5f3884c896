"""Videos through vitrim's plugin: ``VitrimQwen2_5_VLForConditionalGeneration`` trims each video with vitrim.vlm's
method on vLLM's CPU backend, against transformers + ``vitrim.vlm.apply`` on the same tiny folder and clips.

Per method, one engine, three requests run together and each alone:

- ``wide``: 4 temporal patches of 2×3 merged tokens at 1 fps (``second_per_grid_ts`` 1.0: temporal positions 4
  apart, ``tokens_per_second`` 4);
- ``tall``: 3 temporal patches of 3×2 (H′ > W′) at 3 fps (``second_per_grid_ts`` 1/3: temporal positions 0, 1, 2,
  a float product truncated), the two cases where vLLM's own EVS path numbers otherwise (docs/video.md, Positions);
- ``mixed``: an image of 4×6 tokens, then a video of 2 temporal patches of 2×3 at 2 fps.

Each request: greedy tokens together = alone = transformers + vitrim.vlm (its positions as they are); each image's
and video's kept indices = ``vitrim.vlm.last_selection``'s (by the content seed of its pixels); the prompt shorter
than the unpruned one by exactly the dropped tokens. Image methods (``visionzip`` merges, ``divprune``, ``random``)
run per temporal patch, ``keep`` of each; video methods (``evs``, ``vidcom2``, ``temporal_downsample``, ``flashvid``
with ``exact_count``: it merges, its count the grid's t·B) over the whole video, images whole. Beside them, on
transformers, flashvid's authors' rounding keeps more of some clips than the served t·B. The text after each video
is long enough that the prompt's last token holds its largest position (vLLM decodes from the largest + 1,
transformers' ``generate()`` from the last + 1).

Then: vLLM's own video pruning beside a vitrim method stops the engine at start in one line; and ``vllm serve`` with
vitrim's ``evs`` answers a chat request whose video is sent as ``video_url`` (``data:video/jpeg;base64,`` frames,
vLLM's offline form) as the offline engine does and as transformers + vitrim.vlm does on the decoded frames.
"""

from __future__ import annotations

import base64
import functools
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import (
    assert_media_like_reference,
    clip_frames,
    media_of,
    overrides,
    reference_spec,
    transformers_reference,
    trimmed_runs,
    with_engine,
)
from PIL import Image
from vllm_server import post, running_server

from tiny_vlms.folders import save_vllm_qwen2_5_vl, save_vllm_qwen3_vl

ARCHITECTURE = "VitrimQwen2_5_VLForConditionalGeneration"
FAMILIES = {  # the transformers reference's family: (the served architecture, its tiny folder, frames per patch)
    "qwen2_5_vl": (ARCHITECTURE, save_vllm_qwen2_5_vl, 1),
    # its tokenizer reads the timestamps' digits: a wrong timestamp changes what the LLM reads
    "qwen3_vl": ("VitrimQwen3VLForConditionalGeneration", functools.partial(save_vllm_qwen3_vl, timestamps=True), 2),
}
MAX_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TAIL = " ".join(f"w{i}" for i in range(40, 52))  # 12 words after a video: the last token's position is the largest
CLIPS = {"wide": ((4, 2, 3), 1.0), "tall": ((3, 3, 2), 3.0), "mixed": ((2, 2, 3), 2.0)}  # (t, H′, W′), fps
METHODS = {  # vitrim options: the image methods keep 3 of each temporal patch's 6 tokens (and of the image's 24)
    "visionzip": {"keep": 3, "dominant": 2, "contextual": 1},
    "divprune": {"keep": 3},
    "random": {"keep": 3},
    "evs": {"video_pruning_rate": 0.5},
    "vidcom2": {"video_pruning_rate": 0.5},
    "temporal_downsample": {"stride": 2},
    # B = ⌈6·0.5·1.25⌉ = 4 of each temporal patch's 6, A = 2 picked, C = 2 merged; one segment per clip, where the
    # authors' rounding keeps more of a clip or two (test below), which exact_count's largest remainder takes back.
    # (B = 5 raises TSTM's threshold on "mixed", whose two temporal patches are the same pixels: its cosines all 1 up
    # to rounding, which tokens join then turns on the last bit, and vLLM's tower differs from transformers' there)
    "flashvid": {"exact_count": True, "retention_ratio": 0.5, "alpha": 0.4, "do_segment": False},
}
VIDEO_METHODS = ("evs", "vidcom2", "temporal_downsample", "flashvid")  # over the whole video, images whole
VIDEO_LIMITS = {"limit_mm_per_prompt": {"image": 1, "video": 1}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    return tmp_path_factory.mktemp(f"plugin_video_{family}")


@pytest.fixture(scope="module")
def folder(work: Path, family: str) -> Path:
    return FAMILIES[family][1](work / "tiny")


@pytest.fixture(scope="module")
def requests(work: Path, family: str) -> list[dict[str, Any]]:
    return video_requests(work, FAMILIES[family][2])


def video_requests(work: Path, frames_per_patch: int) -> list[dict[str, Any]]:
    """The three requests of :data:`CLIPS` (``mixed``: an image, then a video), clips of ``frames_per_patch`` frames
    per temporal patch saved in ``work``."""
    out = []
    for index, (name, (shape, fps)) in enumerate(CLIPS.items()):
        path = work / f"{name}.npy"
        np.save(path, clip_frames(*shape, frames_per_patch=frames_per_patch, seed=index))
        clip = {"frames": str(path), "fps": fps}
        if name == "mixed":
            image = work / "image.png"
            Image.fromarray(np.random.default_rng(7).integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(image)
            out.append({"prompt": f"w30 {IMAGE} w31 {VIDEO} {TAIL}", "images": [str(image)], "videos": [clip]})
        else:
            out.append({"prompt": f"w10 w11 {VIDEO} {TAIL} w{20 + index}", "images": [], "videos": [clip]})
    return out


@pytest.fixture(scope="module")
def reference(work: Path, folder: Path, family: str, requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per method of :data:`METHODS`, transformers + vitrim.vlm's results; under "flashvid_authors", flashvid's with
    the authors' rounding (``exact_count=False``, which vLLM cannot serve)."""
    runs = [*METHODS.items(), ("flashvid", METHODS["flashvid"] | {"exact_count": False})]
    specs = [reference_spec(folder, family, method, options, requests, MAX_TOKENS) for method, options in runs]
    return dict(zip([*METHODS, "flashvid_authors"], transformers_reference(specs, work), strict=True))


@pytest.mark.parametrize("method", list(METHODS))
def test_a_served_video_keeps_what_vitrim_vlm_keeps_and_generates_what_transformers_does(
    method: str,
    family: str,
    folder: Path,
    requests: list[dict[str, Any]],
    reference: dict[str, list[dict[str, Any]]],
) -> None:
    runs = trimmed_runs(folder, FAMILIES[family][0], method, METHODS[method], requests, MAX_TOKENS, **VIDEO_LIMITS)
    pruned = assert_media_like_reference(requests, runs, reference[method])
    for expected in reference[method]:
        for (_, full), kept, kind in zip(media_of(expected), expected["kept"], expected["media"], strict=True):
            if kind == "image" and method in VIDEO_METHODS:
                assert kept == list(range(full))  # a video method leaves images whole
    assert pruned > 0


def test_served_flashvid_keeps_t_times_b_where_the_authors_rounding_keeps_more(
    reference: dict[str, list[dict[str, Any]]],
) -> None:
    """The served ``flashvid`` (``exact_count``) keeps t·4 of each clip, what the engine test above checks against
    transformers; ``exact_count=False`` (the authors' rounding, which vLLM cannot serve) keeps at least as many of
    each clip on transformers, and more of some: the largest remainder took tokens back."""
    taken_back = 0
    for exact, theirs in zip(reference["flashvid"], reference["flashvid_authors"], strict=True):
        videos = [kept for kind, kept in zip(exact["media"], exact["kept"], strict=True) if kind == "video"]
        their_videos = [kept for kind, kept in zip(theirs["media"], theirs["kept"], strict=True) if kind == "video"]
        for kept, their_kept, (t, _, _) in zip(videos, their_videos, exact["video_grids"], strict=True):
            assert len(kept) == t * 4 <= len(their_kept)
            taken_back += len(their_kept) - len(kept)
    assert taken_back > 0


def test_vllms_own_video_pruning_beside_a_vitrim_method_stops_the_engine_at_start(folder: Path, family: str) -> None:
    with pytest.raises(ValueError) as raised:
        with_engine(
            folder,
            overrides(FAMILIES[family][0], "evs", video_pruning_rate=0.5),
            lambda llm: None,
            video_pruning_rate=0.5,
            **VIDEO_LIMITS,
        )
    message = str(raised.value)
    assert "vitrim: vLLM's own video pruning (video_pruning_method='evs', video_pruning_rate=0.5) and vitrim's " in (
        message
    )
    assert "\n" not in message.strip()


def jpeg_frames(frames: np.ndarray) -> list[bytes]:
    def encode(frame: np.ndarray) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="JPEG", quality=95)
        return buffer.getvalue()

    return [encode(frame) for frame in frames]


def video_chat(text: str, jpegs: list[bytes]) -> dict[str, Any]:
    """An OpenAI-style chat request whose video is its JPEG frames (vLLM's ``data:video/jpeg;base64,`` form, read
    at 1 fps, every frame kept) before the text."""
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(jpeg).decode() for jpeg in jpegs)
    return {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}],
            }
        ],
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }


def test_vllm_serve_answers_a_video_chat_as_the_offline_engine_and_transformers_do(
    folder: Path, work: Path, family: str
) -> None:
    if family != "qwen2_5_vl":
        pytest.skip("one served family: the server's path is the offline engine's, checked on every family above")
    from vllm import SamplingParams

    vitrim = overrides(ARCHITECTURE, "evs", video_pruning_rate=0.5)
    jpegs = jpeg_frames(clip_frames(4, 2, 3, frames_per_patch=1, seed=11))
    request = video_chat(TAIL, jpegs)

    def offline(llm: Any) -> tuple[str, list[int], list[int], str]:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        out = llm.chat(request["messages"], params, use_tqdm=False)[0]
        return out.outputs[0].text, list(out.outputs[0].token_ids), list(out.prompt_token_ids), out.prompt

    text, tokens, prompt_ids, prompt = with_engine(folder, vitrim, offline, **VIDEO_LIMITS)
    with running_server(folder, vitrim, work / "server.log", VIDEO_LIMITS["limit_mm_per_prompt"]) as port:
        status, body = post(port, "/v1/chat/completions", request)
    assert status == 200, body
    assert (body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]) == (text, len(prompt_ids))

    decoded = np.stack([np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) for jpeg in jpegs])
    np.save(work / "served.npy", decoded)  # the frames as vLLM's loader reads them (PIL), for transformers
    spec = {
        "folder": str(folder),
        "family": "qwen2_5_vl",
        "method": "evs",
        "options": {"video_pruning_rate": 0.5},
        "positions": "original",
        "max_tokens": MAX_TOKENS,
        "requests": [{"prompt": prompt, "images": [], "videos": [{"frames": str(work / "served.npy"), "fps": 1.0}]}],
    }
    ((expected,),) = transformers_reference([spec], work)
    (kept,) = expected["kept"]
    (full,) = expected["video_tokens"]
    assert len(kept) < full  # EVS pruned the clip
    assert len(prompt_ids) == expected["prompt_tokens"] - (full - len(kept))
    assert tokens == expected["tokens"]

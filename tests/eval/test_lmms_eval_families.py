"""vitrim inside lmms-eval on a tiny random checkpoint of each family vitrim.vlm takes, pictures and videos.

Each family's folder is built here with the real transformers classes and saved with its processor (lmms-eval hands
the model PIL pictures and video paths; the folder's processor turns them into tokens). The reference for a batched
answer is the same model answering the same sample alone (lmms-eval's batch of 1): the generated token ids (the
tiny tokenizers' words are special tokens a decode skips, so the texts alone would compare mostly empty strings)
and the whole per-sample record. The counts recorded are checked against what the method keeps by its own rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmms_eval")

import numpy as np
import torch
from lmms_eval.evaluator import simple_evaluate
from lmms_eval.tasks import TaskManager
from lmms_eval.utils import simple_parse_args_string

from tiny_vlms.clips import CLIP_FPS, CLIPS
from tiny_vlms.folders import (
    save_gemma3,
    save_llava_next,
    save_llava_onevision,
    save_qwen2_5_vl,
    save_qwen2_vl,
    save_small_qwen3_vl,
)
from vitrim.eval.digits_tasks import task_name
from vitrim.eval.lmms_model import VitrimModel

FAMILIES = {
    "llava_next": save_llava_next,
    "qwen2_vl": save_qwen2_vl,
    "qwen2_5_vl": save_qwen2_5_vl,
    "qwen3_vl": save_small_qwen3_vl,
    "gemma3": save_gemma3,
}
FOLDERS = {**FAMILIES, "llava_onevision": save_llava_onevision}  # OneVision: its own test (videos and pictures)
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN_PIXELS = 32 * 32  # max_pixels: a 64×64 canvas read at 32×32, 16×16 patches, 64 image tokens
PICTURE_TOKENS = {"llava_next": 88, "gemma3": 16, **dict.fromkeys(QWEN, 64)}
VIDEO_TASK = "vitrim_tiny_video"  # conftest's video_task
MAX_FRAMES = 4


@pytest.fixture(scope="session")
def family_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: save(root / family) for family, save in FOLDERS.items()}


def evaluate(model: VitrimModel, manager: TaskManager, tasks: list[str], limit: int) -> dict[str, Any]:
    return simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit, log_samples=True)


def answering_ids(model: VitrimModel) -> VitrimModel:
    """``model`` answering with its generated ids (padding after the end dropped) instead of their words."""
    pad = model.prompter.pad_id

    def decode(ids: torch.Tensor) -> list[str]:
        rows = [row.tolist() for row in ids]
        while pad is not None and any(row and row[-1] == pad for row in rows):
            rows = [row[:-1] if row and row[-1] == pad else row for row in rows]
        return [" ".join(map(str, row)) for row in rows]

    model.prompter.decode = decode  # type: ignore[method-assign]
    return model


def by_doc(results: dict[str, Any], task: str) -> dict[int, tuple[str, dict[str, Any]]]:
    return {s["doc_id"]: (s["resps"][0][0], s["token_counts"][0]["vitrim"]) for s in results["samples"][task]}


def batched_and_alone(
    args: dict[str, Any], manager: TaskManager, tasks: list[str], limit: int, batch: int
) -> list[tuple[str, dict[str, Any]]]:
    """Every (answer, record) of a run in lmms-eval's batches of ``batch``, after asserting each equals the sample's
    in batches of 1 (a model per run: lmms-eval frees it at the end)."""
    together = evaluate(answering_ids(VitrimModel(batch_size=batch, **args)), manager, tasks, limit)
    alone = evaluate(answering_ids(VitrimModel(batch_size=1, **args)), manager, tasks, limit)
    found = []
    for task in tasks:
        ours, theirs = by_doc(together, task), by_doc(alone, task)
        assert ours == theirs, task
        assert len(ours) == limit and any(answer for answer, _ in ours.values())
        found.extend(ours[doc] for doc in sorted(ours))
    return found


# each family: a pre-LLM method then an in-LLM one, each with its keep
STACKED = {
    "llava_next": ("visionzip", 6, "fastv", 20),
    "qwen2_vl": ("divprune", 24, "fastv", 12),
    "qwen2_5_vl": ("vispruner", 24, "pdrop", None),  # PyramidDrop: half of the 24 from layer 1 on
    "qwen3_vl": ("divprune", 24, "fastv", 12),
    "gemma3": ("tome", 128, "fastv", 4),  # ToMe in SigLIP: 128 of 256 patches; the 4×4 pooling still makes 16
}


# LLaVA-NeXT counts keep per tile: a 64×64 canvas is its base view and 2×2 tiles (best pinpoint 32×32), 6 tokens
# each, and the 8 newline tokens of the packed 8×8 grid always enter (VisionZip hands on no [CLS] there)
ENTERING = {"llava_next": 5 * 6 + 8, "gemma3": 16}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_answers_a_batch_as_each_sample_alone(
    family: str, family_folders: dict[str, Path], task_manager: TaskManager
) -> None:
    """A stacked pre-LLM + in-LLM pair with its keeps, through lmms-eval's batches of 4 (left padding, two tasks
    whose questions differ in length) and batches of 1: the same tokens and the same record per sample; the record
    counts the pre-LLM keep entering the LLM and the in-LLM keep left after its layer."""
    first, first_keep, second, second_keep = STACKED[family]
    args: dict[str, Any] = {
        "pretrained": str(family_folders[family]),
        "method": f"{first}+{second}",
        f"{first}.keep": first_keep,
        "max_new_tokens": 4,
        "dtype": "float64",
    }
    if second_keep is None:  # PyramidDrop: its stages' ratios
        args |= {f"{second}.ratios": "[0.5]", f"{second}.layers": "[1]"}
    else:
        args |= {f"{second}.keep": second_keep, f"{second}.layer": 1}
    if family in QWEN:
        args["max_pixels"] = QWEN_PIXELS
    found = batched_and_alone(args, task_manager, [task_name("which"), task_name("count")], limit=3, batch=4)
    assert len({record["text_tokens"] for _, record in found}) > 1  # prompts of different lengths were padded
    for _, record in found:
        assert record["image_tokens"] == PICTURE_TOKENS[family]
        assert record["image_tokens_entering_llm"] == ENTERING.get(family, first_keep)
        assert record["video_tokens"] == record["video_tokens_entering_llm"] == 0
        assert record["settings"]["method"] == f"{first}+{second}"
        assert record["image_tokens_kept"] == (12 if second_keep is None else second_keep)
        if family in QWEN:
            assert record["settings"]["pixels"]["size"]["longest_edge"] == QWEN_PIXELS


# the command line's cases: LLaVA-NeXT (tiles) and Qwen2.5-VL (pixel bounds) with a stacked pair each
COMMAND_LINE = {
    "qwen2_5_vl": f"method=divprune+fastv,divprune.keep=24,fastv.keep=12,fastv.layer=1,max_pixels={QWEN_PIXELS}",
    "llava_next": "method=visionzip+fastv,visionzip.keep=6,fastv.keep=20,fastv.layer=1",
}


@pytest.mark.parametrize("family", [pytest.param("qwen2_5_vl"), pytest.param("llava_next", marks=pytest.mark.full)])
def test_the_command_line_on_a_family_checkpoint(
    family: str, family_folders: dict[str, Path], digits_tasks: Path, task_manager: TaskManager, tmp_path: Path
) -> None:
    """The ``lmms-eval`` console script (``--model vitrim --model_args ... --include_path ... --limit``) on a tiny
    family folder: its samples file holds, per sample, the answer and the record ``simple_evaluate`` gives the same
    model arguments in this process (parsed by lmms-eval's own parser), and its results the means of those records."""
    model_args = f"pretrained={family_folders[family]},max_new_tokens=4,{COMMAND_LINE[family]}"
    task = task_name("which")
    out = tmp_path / "out"
    command = [
        str(Path(sys.executable).with_name("lmms-eval")), "--model", "vitrim", "--model_args", model_args,
        "--tasks", task, "--include_path", str(digits_tasks), "--limit", "3", "--batch_size", "3",
        "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    found = list(out.rglob("*_results.json"))  # lmms-eval exits 0 after an error too: the file tells
    assert done.returncode == 0 and len(found) == 1, log
    [samples_file] = out.rglob("*_samples_*.jsonl")
    samples = {s["doc_id"]: s for s in map(json.loads, samples_file.read_text().splitlines())}
    model = VitrimModel(batch_size=3, **simple_parse_args_string(model_args))
    reference = evaluate(model, task_manager, [task], limit=3)["samples"][task]
    assert sorted(samples) == sorted(s["doc_id"] for s in reference) == [0, 1, 2]
    for sample in reference:
        theirs = samples[sample["doc_id"]]
        assert theirs["filtered_resps"] == sample["filtered_resps"][0]  # the file keeps the filtered answer
        assert theirs["token_counts"] == json.loads(json.dumps(sample["token_counts"]))
        record = theirs["token_counts"][0]["vitrim"]
        assert record["image_tokens"] == PICTURE_TOKENS[family]
        assert record["image_tokens_entering_llm"] == ENTERING.get(family, 24)
        assert record["settings"]["method"] == COMMAND_LINE[family].split(",")[0].removeprefix("method=")
    throughput = json.loads(found[0].read_text())["throughput"]
    assert throughput["avg_vitrim_image_tokens_entering_llm"] == ENTERING.get(family, 24)
    assert throughput["avg_vitrim_image_tokens_kept"] == (12 if family in QWEN else 20)


def sampled(frames: int) -> list[int]:
    """The frames read of a clip: MAX_FRAMES evenly spaced, rounded half to even (lmms-eval's Qwen models' rule:
    qwen_vl_utils' ``torch.linspace(0, T - 1, n).round()``), by hand."""
    count = min(MAX_FRAMES, frames)
    return sorted({round(i * (frames - 1) / max(count - 1, 1)) for i in range(count)})


# (family, method, options, tokens kept of a video of t temporal patches of P tokens: the method's own rule, or
# for FastVID, whose count follows the video's segments, its bound: int(P·r) per temporal patch at most)
VIDEO_METHODS = {
    "qwen2_vl": ("qwen2_vl", "temporal_downsample", {"stride": 2}, lambda t, p: -(-t // 2) * p),
    "qwen2_5_vl": ("qwen2_5_vl", "evs", {"video_pruning_rate": 0.5}, lambda t, p: max(p, int(t * p * 0.5))),
    "qwen3_vl": ("qwen3_vl", "vidcom2", {"video_pruning_rate": 0.5}, lambda t, p: max(t, min(int(t * p * 0.5), t * p))),
    "fastvid": ("qwen2_5_vl", "fastvid", {"retention_ratio": 0.5}, None),
}
FASTVID_BOUND = 0.5  # retention_ratio above


@pytest.mark.parametrize("case", VIDEO_METHODS)
def test_a_video_task_answers_a_batch_as_each_clip_alone(
    case: str, family_folders: dict[str, Path], task_manager: TaskManager
) -> None:
    """Video paths handed as lmms-eval's video tasks hand them, decoded (PyAV), sampled to 4 frames, reduced by a
    video method: batched clips of different lengths and shapes answer as each alone, and the record holds the
    frames read, the frame rates, the grid and the video tokens that entered the LLM."""
    family, method, options, rule = VIDEO_METHODS[case]
    args = {"pretrained": str(family_folders[family]), "method": method, **options, "max_num_frames": MAX_FRAMES}
    found = batched_and_alone({**args, "dtype": "float64"}, task_manager, [VIDEO_TASK], limit=len(CLIPS), batch=4)
    temporal = 2 if family == "qwen3_vl" else 1
    for doc, (_, record) in enumerate(found):
        frames, height, width = CLIPS[doc]
        [video] = record["videos"]
        assert video["frame_indices"] == sampled(frames)
        assert (video["total_frames"], video["fps"], video["size"]) == (frames, CLIP_FPS, [height, width])
        assert video["sampled_fps"] == pytest.approx(CLIP_FPS * len(sampled(frames)) / frames)
        t, h, w = video["grid_thw"]
        assert (h, w) == (height // 2, width // 2)  # 2-px patches, read at the clip's own size
        assert t == -(-len(sampled(frames)) // temporal)
        tokens = t * (h // 2) * (w // 2)
        assert record["video_tokens"] == tokens
        entering = record["video_tokens_entering_llm"]
        if rule is None:  # FastVID: its segments' budgets, at most int(P·r) per temporal patch
            assert entering == record["video_tokens_kept"] and 1 <= entering <= t * int(h * w // 4 * FASTVID_BOUND)
        else:
            assert entering == record["video_tokens_kept"] == rule(t, h * w // 4)
        assert record["image_tokens"] == record["image_tokens_entering_llm"] == 0
        reason = record["prefill_macs_not_counted"]  # the clips' frames are not square (test_video_prefill_macs.py)
        expected = f"{family!r} is not counted" if family == "qwen2_vl" else "counted for square frames"
        assert record["prefill_macs"] is None and expected in reason, reason
        settings = record["settings"]
        assert settings["video"] == {"max_num_frames": MAX_FRAMES, "fps": None, "decoder": "pyav"}
        assert settings["pixels"]["video"]["temporal_patch_size"] == temporal
        assert settings["options"][method] | options == settings["options"][method]


ONEVISION_FRAME = 16  # the tiny LLaVA-OneVision's pooled 4×4 grid of a 14×14 frame; a video adds 1 newline


@pytest.mark.parametrize(
    ("method", "options", "rule"),
    [
        ("evs", {"video_pruning_rate": 0.5}, lambda f, p: max(p, int(f * p * 0.5))),
        pytest.param("divprune", {"keep": 5}, lambda f, p: 5 * f, marks=pytest.mark.full),
    ],
)
def test_llava_onevision_videos_and_pictures(
    method: str,
    options: dict[str, Any],
    rule: Any,
    family_folders: dict[str, Path],
    task_manager: TaskManager,
    video_task: Path,
) -> None:
    """LLaVA-OneVision under lmms-eval: the video task's clips (3 frames read of each, evenly spaced, each resized to
    14×14 and pooled to 16 tokens, then one newline: F·16 + 1, the model's own packing,
    tests/tiny_vlms/llava_onevision.py) reduced by a video method (EVS) or an image method per frame (DivPrune),
    and the digits pictures (anyres tiles), batched as each alone; the video tokens entering are the method's rule
    on the frames, plus the newline. Its processor stacks a batch's videos frame for frame: clips read at different
    frame counts are refused in one line."""
    args = {"pretrained": str(family_folders["llava_onevision"]), "method": method, **options}
    args |= {"max_num_frames": 3, "max_new_tokens": 4, "dtype": "float64"}  # 3: every clip's frames (3 to 8)
    found = batched_and_alone(args, task_manager, [VIDEO_TASK, task_name("which")], limit=len(CLIPS), batch=4)
    videos, pictures = found[: len(CLIPS)], found[len(CLIPS) :]
    for doc, (_, record) in enumerate(videos):
        total, frames = CLIPS[doc][0], 3
        assert record["videos"][0]["frame_indices"] == sorted({round(i * (total - 1) / 2) for i in range(frames)})
        assert record["video_tokens"] == frames * ONEVISION_FRAME + 1
        assert record["video_tokens_entering_llm"] == rule(frames, ONEVISION_FRAME) + 1
    for _, record in pictures:  # EVS reads time: a picture enters whole; DivPrune cuts each tile to its keep
        entering = record["image_tokens_entering_llm"]
        assert entering == record["image_tokens"] if method == "evs" else 0 < entering < record["image_tokens"]
        assert record["video_tokens"] == 0
    model = VitrimModel(**{**args, "max_num_frames": 8})
    clips = model._visuals([str(video_task / "clips" / f"clip{doc}.mp4") for doc in (0, 1)])  # 8 and 3 frames
    with pytest.raises(ValueError, match=r"stacks a batch's videos frame for frame; this batch's videos have \[3, 8\]"):
        model.prompter.inputs(["w5", "w6"], [[clips[0]], [clips[1]]])


def test_a_per_frame_image_method_on_video_sampled_at_a_frame_rate(
    family_folders: dict[str, Path], task_manager: TaskManager
) -> None:
    """An image method on video (each temporal patch kept to ``keep``), frames sampled at 2 fps of the 4-fps clips
    (at most 3), each frame held to 256 pixels (``video_max_pixels``; the clips' frames are 384), ``--model_args``
    as the command line's string, parsed by lmms-eval's own parser: the records, and the averages in the results'
    ``throughput``."""
    folder = family_folders["qwen2_5_vl"]
    model_args = f"pretrained={folder},method=divprune,keep=5,fps=2,max_num_frames=3,video_max_pixels=256"
    model = VitrimModel(batch_size=2, **simple_parse_args_string(model_args))
    results = evaluate(model, task_manager, [VIDEO_TASK], limit=len(CLIPS))
    records = [record for _, record in (by_doc(results, VIDEO_TASK)[doc] for doc in range(len(CLIPS)))]
    counts = []
    for record, (frames, height, width) in zip(records, CLIPS, strict=True):
        count = max(1, min(3, frames, int(frames / CLIP_FPS * 2)))  # 2 fps of a 4-fps clip, at most 3
        [video] = record["videos"]
        assert len(video["frame_indices"]) == count
        t, h, w = video["grid_thw"]  # Qwen2.5-VL's tiny tower: a temporal patch of 1 frame, patches of 2×2 px
        assert t == count and h * w * 2 * 2 <= 256 and (h > w) == (height > width)
        assert record["video_tokens_entering_llm"] == record["video_tokens_kept"] == 5 * count
        assert record["settings"]["video"]["fps"] == 2
        assert record["settings"]["pixels"]["video"]["size"]["longest_edge"] == 256
        counts.append(count)
    assert results["throughput"]["avg_vitrim_video_tokens_entering_llm"] == pytest.approx(5 * np.mean(counts))


def test_a_video_for_a_model_without_video_is_one_line(family_folders: dict[str, Path], video_task: Path) -> None:
    model = VitrimModel(pretrained=str(family_folders["gemma3"]))
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration takes no video"):
        model._visuals([str(video_task / "clips" / "clip0.mp4")])


def tower_attention_macs(model: Any, family: str, inputs: dict[str, Any]) -> int:
    """The tower's QKᵀ and A·V products (2·n·n_keys·d per block), which torch's counter does not see on the CPU:
    Gemma 3's SigLIP attends globally; Qwen2.5-VL's windowed blocks attend within the windows transformers' own
    ``get_vision_window_index`` lays out, its ``fullatt_block_indexes`` globally."""
    vision = model.config.vision_config
    if family == "gemma3":
        patches = (vision.image_size // vision.patch_size) ** 2
        return 2 * patches**2 * vision.hidden_size * vision.num_hidden_layers
    from transformers.vision_utils import get_vision_window_index

    grid = inputs["image_grid_thw"]
    _, bounds = get_vision_window_index(grid, vision.spatial_merge_size, vision.window_size, vision.patch_size)
    windows = torch.unique_consecutive(torch.as_tensor(bounds)).diff()
    patches = int(grid.prod())
    full = len(vision.fullatt_block_indexes)
    return 2 * vision.hidden_size * (full * patches**2 + (vision.depth - full) * int((windows**2).sum()))


@pytest.mark.parametrize("method", ["none", "divprune"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_prefill_macs_match_torchs_counter(family: str, method: str, family_folders: dict[str, Path]) -> None:
    """The prefill MACs recorded for a Qwen2.5-VL and a Gemma 3 sample, dense and with DivPrune, equal torch's FLOP
    counter on the model's own prefill with the method applied (its matrix products, DivPrune's similarities and
    the patch convolution, halved to multiply-adds) plus the attention products it does not report, by hand: the
    tower's (above) and the LLM's 2·L²·H·e per layer on the L tokens that entered it."""
    from PIL import Image
    from torch.utils.flop_counter import FlopCounterMode

    extra = {"max_pixels": QWEN_PIXELS} if family in QWEN else {}
    if method != "none":
        extra["keep"] = 8
    model = VitrimModel(pretrained=str(family_folders[family]), method=method, **extra)
    picture = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    visuals = [[Image.fromarray(picture)]]
    [answer] = model._answer(["w5 w6 w7"], visuals, {"max_new_tokens": 1})
    record = answer.token_counts.vitrim
    inputs = model.prompter.inputs(["w5 w6 w7"], visuals)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.model(**inputs, logits_to_keep=1)
    text = model.model.config.text_config
    entered = record["image_tokens_entering_llm"] + record["text_tokens"]
    assert entered < inputs["input_ids"].shape[1] if method != "none" else entered == inputs["input_ids"].shape[1]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    llm_attention = 2 * entered**2 * text.num_attention_heads * head_dim * text.num_hidden_layers
    by_hand = tower_attention_macs(model.model, family, inputs) + llm_attention
    key = "dense_prefill_macs" if method == "none" else "prefill_macs"
    assert record[key] == counter.get_total_flops() // 2 + by_hand
    assert record["prefill_macs_ratio"] == pytest.approx(record["prefill_macs"] / record["dense_prefill_macs"])

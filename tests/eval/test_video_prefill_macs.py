"""The prefill multiply-adds lmms-eval's record gives a video sample, against torch's FLOP counter on the tiny
checkpoint's own prefill (eager attention, so the counter sees every product; the logits of the last position):
the dense model's for ``dense_prefill_macs``, the model with the method applied for ``prefill_macs``, plus the
method's own products that are no matrix product (EVS's cosines, VidCom2's variances and distances: elementwise, by
hand); and the samples the record does not count, each with its reason."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmms_eval")

import torch
from torch.utils.flop_counter import FlopCounterMode

import vitrim.vlm
from tiny_vlms.clips import write_clip
from tiny_vlms.folders import save_llava_onevision, save_qwen2_5_vl, save_small_qwen3_vl
from vitrim.eval.lmms_model import VitrimModel
from vitrim.eval.model_args import MethodPlan
from vitrim.eval.prefill_cost import sample_macs

FOLDERS = {"qwen2_5_vl": save_qwen2_5_vl, "qwen3_vl": save_small_qwen3_vl, "llava_onevision": save_llava_onevision}
FRAMES, SIDE = 4, 16  # a square clip: 8×8 patches of 2 px (Qwen2.5-VL: 2×2 windows of 4×4), OneVision resizes it


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video_macs")
    return {family: save(root / family) for family, save in FOLDERS.items()}


@pytest.fixture(scope="module")
def square_clip(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_clip(tmp_path_factory.mktemp("clip") / "square.mp4", FRAMES, SIDE, SIDE, seed=0))


def counted(model: Any, inputs: dict[str, Any]) -> int:
    """torch's count of the prefill's matrix products, in multiply-adds."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**inputs, logits_to_keep=1)
    return counter.get_total_flops() // 2


def evs_own(t: int, per_frame: int, width: int, options: dict[str, Any]) -> int:
    """A cosine (a dot and two norms of E) for every token after the first temporal patch."""
    return 3 * (t - 1) * per_frame * width


def vidcom2_own(t: int, per_frame: int, width: int, options: dict[str, Any]) -> int:
    """The channels' variances over the N tokens (N·E), two distances of E/2 per token."""
    n = t * per_frame
    return n * width + 2 * n * (width // 2)


CASES = {  # family, method, options, the method's own products torch's counter does not see (by hand)
    "qwen2_5_vl-evs": ("qwen2_5_vl", "evs", {"video_pruning_rate": 0.5}, evs_own),
    "llava_onevision-divprune": ("llava_onevision", "divprune", {"keep": 5}, None),  # its similarities: matmuls
    "qwen3_vl-vidcom2": ("qwen3_vl", "vidcom2", {"video_pruning_rate": 0.5}, vidcom2_own),
}


@pytest.mark.parametrize("case", CASES)
def test_video_prefill_macs_match_torchs_counter(case: str, folders: dict[str, Path], square_clip: str) -> None:
    family, method, options, own = CASES[case]
    model = VitrimModel(pretrained=str(folders[family]), method=method, max_num_frames=FRAMES, **options)
    model.model.set_attn_implementation("eager")
    [clip] = model._visuals([square_clip])
    [answer] = model._answer(["w5 w6 w7"], [[clip]], {"max_new_tokens": 1})
    record = answer.token_counts.vitrim
    assert "prefill_macs_not_counted" not in record, record.get("prefill_macs_not_counted")
    inputs = model.prompter.inputs(["w5 w6 w7"], [[clip]])
    assert record["video_tokens_entering_llm"] < record["video_tokens"]  # the method cut the clip
    text = model.model.config.text_config
    per_frame = 16  # OneVision: a frame pooled to 4×4; Qwen: 8×8 patches merged 2×2
    t = FRAMES if family == "llava_onevision" else record["videos"][0]["grid_thw"][0]
    hand = 0 if own is None else own(t, per_frame, text.hidden_size, options)
    assert record["prefill_macs"] == counted(model.model, inputs) + hand
    vitrim.vlm.remove(model.model)
    assert record["dense_prefill_macs"] == counted(model.model, inputs)
    assert record["prefill_macs_ratio"] == record["prefill_macs"] / record["dense_prefill_macs"]


def test_what_a_video_record_does_not_count_says_why(folders: dict[str, Path]) -> None:
    """One line each: a clip off the counted grids, a method whose count is a bound, stacks, options away from the
    defaults, an in-LLM method alone on a clip, more than one video, a video with a picture, a family not counted."""
    from transformers import AutoModelForImageTextToText

    from vitrim.eval.prefill_cost import counter_for

    qwen = counter_for(AutoModelForImageTextToText.from_pretrained(folders["qwen2_5_vl"]))
    square, grid = [2, 8, 8], [2, 8, 12]
    plan = lambda *methods: MethodPlan(tuple(methods))  # noqa: E731
    for methods, video, message in [
        ((), grid, r"video is counted for square frames .* this one is \[2, 8, 12\]"),
        ((), [2, 6, 6], "expected a multiple of 8 px"),  # 6×6 patches: not whole 4×4 windows
        ((("fastvid", {"retention_ratio": 0.5}),), square, "fastvid: its tokens follow the clip's segments"),
        ((("flashvid", {}), ("flashvid_llm", {})), square, "flashvid: .* counts by a bound"),
        ((("evs", {}), ("fastv", {"keep": 4})), square, "counts one method"),
        ((("evs", {"positions": "original"}),), square, "evs's options {'positions': 'original'} are not the defaults"),
        ((("fastv", {"keep": 4}),), square, r"'fastv' \(in_llm\) is not counted alone on a clip"),
        ((("divprune", {"keep": 17}),), square, "keep=17 .* each temporal patch's 16 tokens"),
    ]:
        macs = sample_macs(qwen, plan(*methods), 0, 1, video, 5)
        assert macs["method"] is None and re.search(message, macs["reason"]), (methods, macs["reason"])
    assert sample_macs(qwen, plan(), 0, 2, square, 5)["reason"] == (
        "counted for one video and no picture per sample, this one has 2 and 0"
    )
    assert "one video and no picture" in sample_macs(qwen, plan(), 1, 1, square, 5)["reason"]
    assert sample_macs(qwen, plan(("evs", {})), 0, 1, square, 5)["dense"] is not None

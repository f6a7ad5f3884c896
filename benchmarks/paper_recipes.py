"""The lmms-eval commands that reproduce the token-reduction papers' rows, for a GPU day (docs/evaluating.md).

    python benchmarks/paper_recipes.py                 # print every command (one per model, method, budget, task)
    python benchmarks/paper_recipes.py --run OUT       # run them one after another, results under OUT
    python benchmarks/paper_recipes.py --table OUT     # the accuracy table of the runs in OUT, published cells beside
    python benchmarks/paper_recipes.py --video ...     # the same for the VideoMME rows

Rows: LLaVA-1.5-7B (``llava-hf/llava-1.5-7b-hf``, 576 image tokens) and Qwen2.5-VL-7B (``Qwen/Qwen2.5-VL-7B-
Instruct`` at 672×672 px: ``min_pixels = max_pixels = 672²``, 576 image tokens, the count of LLaVA-1.5, so a budget
means the same cut) on MME, POPE, GQA and TextVQA (lmms-eval's ``mme``, ``pope``, ``gqa``, ``textvqa_val``), at 64,
128 and 192 image tokens, for FasterVLM, VisPruner, VisionZip, DivPrune, CDPruner (pre-LLM), FastV and PyramidDrop
(in the LLM), and the dense model. Every command is ``lmms-eval --model vitrim`` with the method's paper defaults
(vitrim.vlm's defaults) and ``keep``; FastV keeps ``keep`` tokens from its layer K = 2 on; PyramidDrop, which takes
stage ratios rather than a budget, gets the demo's geometric rule with its middle stage at ``keep`` (``ratios=(2f, f,
f/2)``, f = keep/576), not the PyramidDrop paper's own per-budget settings.

Video rows (``--video``): LLaVA-OneVision-7B (``llava-hf/llava-onevision-qwen2-7b-ov-hf``) and Qwen2.5-VL-7B on
VideoMME (lmms-eval's ``videomme``, its ``videomme_perception_score``), 32 frames evenly spaced (lmms-eval's own
models' default), for EVS and VidCom2 at 25 % of the video tokens, VisionZip per temporal patch at 25 % (the tables'
usual image baseline), FastVID and FlashVID (both stages) at the settings of their authors' scripts, and the dense
model.

``PUBLISHED`` holds the authors' numbers beside each cell, with where they were read. A cell is filled only where
the number was confirmed from the paper or the authors' repository; the rest stay empty (None), never guessed.

``tests/eval/test_paper_recipes.py`` builds every recipe's model from its exact ``--model_args`` (lmms-eval's own
parser) on a tiny random checkpoint of the same family, budgets scaled to its image, and checks lmms-eval knows
every task, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

IMAGE_TOKENS = 576
BUDGETS = (64, 128, 192)
TASKS = {"MME": "mme", "POPE": "pope", "GQA": "gqa", "TextVQA": "textvqa_val"}
METRICS = {"mme": "mme_perception_score", "pope": "pope_f1_score", "gqa": "exact_match", "textvqa_val": "exact_match"}
MODELS = {
    "LLaVA-1.5-7B": "pretrained=llava-hf/llava-1.5-7b-hf",
    "Qwen2.5-VL-7B": "pretrained=Qwen/Qwen2.5-VL-7B-Instruct,min_pixels=451584,max_pixels=451584",
}
METHODS = ("fastervlm", "vispruner", "visionzip", "divprune", "cdpruner", "fastv", "pdrop")
GPU = "device=cuda,dtype=bfloat16"
BATCH = "8"  # lmms-eval's own --batch_size (a batch_size in --model_args would clash with it)

# The papers print GQA, TextVQA and POPE in percent; lmms-eval scores them in [0, 1] (MME in points, as printed).
PAPER_SCALE = {"mme": 1.0, "pope": 100.0, "gqa": 100.0, "textvqa_val": 100.0}

# (model, method, budget, task) -> (published number, where it was read), on the papers' scale (PAPER_SCALE). Only
# cells whose model, token count and metric the read text states; the rest stay out (docs/evaluating.md says why):
# VisionZip's Table 1 prints MME not as perception alone (1862 for the dense model) and POPE without saying F1 or
# accuracy, so those columns stay out; PyramidDrop's v1 tables are by drop ratio and TFLOPs, not token counts.
_VISIONZIP_TABLE_1 = (
    "VisionZip paper (Yang et al., arXiv 2412.04467v1) Table 1: LLaVA-1.5 at 576 image tokens (its Vanilla row is "
    "LLaVA-1.5-7B's; the 13B is Table 10); read as text from the copy of the arXiv HTML table in "
    "deep-diver/ai-paper-reviewer content/paper-reviews/2412.04467/index.md @ 4799e7e60755ba7d996b44a3cf895af13e1a9cd4"
)
_VISIONZIP = "training-free VisionZip row (not VisionZip‡) of the " + _VISIONZIP_TABLE_1
_FASTV_IN_VISIONZIP = "FastV (ECCV24) baseline row, as reported in the " + _VISIONZIP_TABLE_1
_LLAVA_ZOO = (
    "LLaVA authors' model zoo, LLaVA-1.5 7B full_ft-1e row: haotian-liu/LLaVA docs/MODEL_ZOO.md @ "
    "19d8945e1ce3b2b56a7533bc02876fc355e18f65"
)
_FASTV_README = (
    "FastV authors' README, 'Support LMMs-Eval' table, LLaVA-1.5-7B Baseline, MME-Perception (lmms-eval): "
    "pkunlp-icler/FastV README.md @ d1659729b5bf1be225e99ee15783deeea80f63b1"
)
_LLAVA = "LLaVA-1.5-7B"
PUBLISHED: dict[tuple[str, str, int, str], tuple[float, str]] = {
    (_LLAVA, "none", 576, "mme"): (1510.8, _FASTV_README),
    (_LLAVA, "none", 576, "gqa"): (62.0, _LLAVA_ZOO),
    (_LLAVA, "none", 576, "textvqa_val"): (58.2, _LLAVA_ZOO),
    (_LLAVA, "visionzip", 192, "gqa"): (59.3, _VISIONZIP),
    (_LLAVA, "visionzip", 128, "gqa"): (57.6, _VISIONZIP),
    (_LLAVA, "visionzip", 64, "gqa"): (55.1, _VISIONZIP),
    (_LLAVA, "visionzip", 192, "textvqa_val"): (57.3, _VISIONZIP),
    (_LLAVA, "visionzip", 128, "textvqa_val"): (56.8, _VISIONZIP),
    (_LLAVA, "visionzip", 64, "textvqa_val"): (55.5, _VISIONZIP),
    (_LLAVA, "fastv", 192, "gqa"): (52.7, _FASTV_IN_VISIONZIP),
    (_LLAVA, "fastv", 128, "gqa"): (49.6, _FASTV_IN_VISIONZIP),
    (_LLAVA, "fastv", 64, "gqa"): (46.1, _FASTV_IN_VISIONZIP),
    (_LLAVA, "fastv", 192, "textvqa_val"): (52.5, _FASTV_IN_VISIONZIP),
    (_LLAVA, "fastv", 128, "textvqa_val"): (50.6, _FASTV_IN_VISIONZIP),
    (_LLAVA, "fastv", 64, "textvqa_val"): (47.8, _FASTV_IN_VISIONZIP),
}


# Video: one task, scored in percent as the papers print it.
VIDEO_TASK = "videomme"
VIDEO_METRIC = "videomme_perception_score"
VIDEO_MODELS = {
    "LLaVA-OneVision-7B": "pretrained=llava-hf/llava-onevision-qwen2-7b-ov-hf,max_num_frames=32",
    "Qwen2.5-VL-7B": "pretrained=Qwen/Qwen2.5-VL-7B-Instruct,max_num_frames=32",
}
_ONEVISION, _QWEN = VIDEO_MODELS
_FLASHVID = "method=flashvid+flashvid_llm,flashvid.retention_ratio=0.1"
# method -> model -> the method part of --model_args, at the setting its authors report on that model
VIDEO_METHODS: dict[str, dict[str, str]] = {
    "none": {_ONEVISION: "", _QWEN: ""},
    "evs": dict.fromkeys(VIDEO_MODELS, "method=evs,video_pruning_rate=0.75"),
    "vidcom2": dict.fromkeys(VIDEO_MODELS, "method=vidcom2,video_pruning_rate=0.75"),  # its README's R_RATIO 0.25
    "visionzip": dict.fromkeys(VIDEO_MODELS, "method=visionzip,keep=0.25"),  # per temporal patch
    # FastVID's scripts: OneVision at 0.10 with DySeg_tau 0.9 (vitrim's OneVision defaults), Qwen2.5-VL at 0.27
    "fastvid": {_ONEVISION: "method=fastvid,retention_ratio=0.1,DySeg_tau=0.9", _QWEN: "method=fastvid"},
    # FlashVID's: 10 % (its README's example), OneVision with ADTS v2 and 8 segments, then its in-LLM stage
    "flashvid": {
        _ONEVISION: _FLASHVID + ",flashvid.token_selection_method=attn_div_v2,flashvid.min_segment_num=8",
        _QWEN: _FLASHVID,
    },
}
_FASTVID_ONEVISION_LOG = (
    "FastVID authors' own lmms-eval log, llava-onevision-qwen2-7b-ov, max_frames_num=32, fastvid_retention_ratio=0.10, "
    "fastvid_DySeg_tau=0.9, videomme_perception_score 57.3333: LunarShen/FastVID "
    "fastvid_llavaonevision/scripts/llava_onevision.log @ ea8b57e4bbb5478645879c17d182880b445bf968"
)
# (model, method) -> (published VideoMME, where it was read); only where model, frames and setting match the row
PUBLISHED_VIDEO: dict[tuple[str, str], tuple[float, str]] = {
    (_ONEVISION, "fastvid"): (57.3333, _FASTVID_ONEVISION_LOG),
}


@dataclass(frozen=True)
class VideoRecipe:
    model: str
    method: str  # "none": the dense model

    def model_args(self, pretrained: str | None = None, device: str = GPU) -> str:
        """This row's ``--model_args``; the dry run gives another checkpoint (``pretrained``) and a CPU ``device``."""
        base = VIDEO_MODELS[self.model]
        if pretrained is not None:
            base = ",".join([f"pretrained={pretrained}", *base.split(",")[1:]])
        return ",".join(filter(None, (base, VIDEO_METHODS[self.method][self.model], device)))

    @property
    def name(self) -> str:
        return f"{self.model}_{self.method}_{VIDEO_TASK}"

    def command(self, out: str = "results") -> list[str]:
        return [
            "lmms-eval", "--model", "vitrim", "--model_args", self.model_args(), "--tasks", VIDEO_TASK,
            "--batch_size", "1", "--output_path", f"{out}/{self.name}", "--log_samples",
        ]  # fmt: skip


def video_recipes() -> list[VideoRecipe]:
    return [VideoRecipe(model, method) for model in VIDEO_MODELS for method in VIDEO_METHODS]


@dataclass(frozen=True)
class Recipe:
    model: str
    method: str  # "none": the dense model
    budget: int | None
    task: str  # lmms-eval's task name

    def model_args(self, pretrained: str | None = None, image_tokens: int = IMAGE_TOKENS, device: str = GPU) -> str:
        """The ``--model_args`` of this recipe; the dry run gives another checkpoint (``pretrained``, its pixel
        settings kept), whose ``image_tokens`` scale the budget, and a CPU ``device``."""
        base = MODELS[self.model]
        if pretrained is not None:
            base = ",".join([f"pretrained={pretrained}", *base.split(",")[1:]])
        budget = self.budget
        if budget is not None and image_tokens != IMAGE_TOKENS:
            budget = max(1, round(budget * image_tokens / IMAGE_TOKENS))
        return ",".join(filter(None, (base, method_args(self.method, budget, image_tokens), device)))

    def command(self, out: str = "results") -> list[str]:
        name = f"{self.model}_{self.method}_{self.budget or IMAGE_TOKENS}_{self.task}"
        return [
            "lmms-eval", "--model", "vitrim", "--model_args", self.model_args(), "--tasks", self.task,
            "--batch_size", BATCH, "--output_path", f"{out}/{name}", "--log_samples",
        ]  # fmt: skip


def method_args(method: str, budget: int | None, image_tokens: int = IMAGE_TOKENS) -> str:
    """The method part of ``--model_args`` at ``budget`` tokens of an image of ``image_tokens``."""
    if method == "none":
        return ""
    assert budget is not None
    if method == "pdrop":
        f = budget / image_tokens
        return f"method=pdrop,ratios=[{min(1.0, 2 * f):.6g},{f:.6g},{f / 2:.6g}]"
    return f"method={method},keep={budget}" + (",layer=2" if method == "fastv" else "")


def recipes() -> list[Recipe]:
    rows = []
    for model in MODELS:
        for task in TASKS.values():
            rows.append(Recipe(model, "none", None, task))
            rows.extend(Recipe(model, method, budget, task) for method in METHODS for budget in BUDGETS)
    return rows


def table(out: Path) -> str:
    """A Markdown table of the runs under ``out``: ours on the papers' scale, and the published number in parentheses
    where confirmed."""
    lines = ["| model | method | tokens | " + " | ".join(TASKS) + " |", "|---|---|---|" + "---|" * len(TASKS)]
    by_row: dict[tuple[str, str, int], dict[str, str]] = {}
    for recipe in recipes():
        name = f"{recipe.model}_{recipe.method}_{recipe.budget or IMAGE_TOKENS}_{recipe.task}"
        found = sorted((out / name).rglob("*_results.json"))
        ours = "—"
        if found:
            result = json.loads(found[-1].read_text())["results"][recipe.task]
            score = result.get(METRICS[recipe.task] + ",none", float("nan")) * PAPER_SCALE[recipe.task]
            ours = f"{score:.4g}"
        published = PUBLISHED.get((recipe.model, recipe.method, recipe.budget or IMAGE_TOKENS, recipe.task))
        cell = ours + (f" ({published[0]:g})" if published else "")
        by_row.setdefault((recipe.model, recipe.method, recipe.budget or IMAGE_TOKENS), {})[recipe.task] = cell
    for (model, method, budget), cells in by_row.items():
        lines.append(f"| {model} | {method} | {budget} | " + " | ".join(cells[t] for t in TASKS.values()) + " |")
    return "\n".join(lines)


def video_table(out: Path) -> str:
    """The VideoMME table of the video runs under ``out``, the published number in parentheses where confirmed."""
    lines = ["| model | method | VideoMME |", "|---|---|---|"]
    for recipe in video_recipes():
        found = sorted((out / recipe.name).rglob("*_results.json"))
        ours = "—"
        if found:
            result = json.loads(found[-1].read_text())["results"][VIDEO_TASK]
            ours = f"{result.get(VIDEO_METRIC + ',none', float('nan')):.4g}"
        published = PUBLISHED_VIDEO.get((recipe.model, recipe.method))
        cell = ours + (f" ({published[0]:g})" if published else "")
        lines.append(f"| {recipe.model} | {recipe.method} | {cell} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", metavar="OUT", help="run every command, results under OUT")
    parser.add_argument("--table", metavar="OUT", help="print the table of the runs under OUT")
    parser.add_argument("--video", action="store_true", help="the VideoMME rows instead of the image rows")
    args = parser.parse_args(argv)
    if args.table:
        print(video_table(Path(args.table)) if args.video else table(Path(args.table)))
        return 0
    for recipe in video_recipes() if args.video else recipes():
        command = recipe.command(args.run or "results")
        print(shlex.join(command))
        if args.run:
            subprocess.run(command, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

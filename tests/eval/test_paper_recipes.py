"""benchmarks/paper_recipes.py cannot rot: every recipe's exact ``--model_args``, read by lmms-eval's own parser,
builds the vitrim model on a tiny random checkpoint of the same family (budgets scaled to its image), and lmms-eval
knows every task the recipes name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmms_eval")

from vitrim.eval.lmms_model import VitrimModel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paper_recipes.py"


def load_script():
    spec = importlib.util.spec_from_file_location("paper_recipes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["paper_recipes"] = module
    spec.loader.exec_module(module)
    return module


def test_every_recipe_builds_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    """Tiny checkpoints with the 7B models' LLM depths (LLaVA's 32 decoder layers, Qwen2.5-7B's 28), so FastV's
    layer 2 and PyramidDrop's layers 8/16/24 are where the recipes put them."""
    from tiny_vlms.folders import save_llava, save_qwen2_5_vl
    from vitrim.vlm_user.tiny import LLAVA_TEXT, QWEN_TEXT

    recipes = load_script()
    llava = save_llava(tmp_path / "llava", text={**LLAVA_TEXT, "num_hidden_layers": 32})
    qwen = save_qwen2_5_vl(tmp_path / "qwen", text={**QWEN_TEXT, "num_hidden_layers": 28})
    tiny = {"LLaVA-1.5-7B": (llava, 16), "Qwen2.5-VL-7B": (qwen, 16)}
    seen = set()
    for recipe in recipes.recipes():
        key = (recipe.model, recipe.method, recipe.budget)
        if key in seen:
            continue
        seen.add(key)
        folder, image_tokens = tiny[recipe.model]
        args = recipe.model_args(str(folder), image_tokens, device="device=cpu,dtype=float32")
        model = VitrimModel.create_from_arg_string(args)
        assert model.settings["method"] == recipe.method
        assert model.settings["pixels"] or recipe.model == "LLaVA-1.5-7B"
    assert len(seen) == 2 * (1 + len(recipes.METHODS) * len(recipes.BUDGETS))
    command = recipes.Recipe("LLaVA-1.5-7B", "visionzip", 64, "pope").command("out")
    assert command[:3] == ["lmms-eval", "--model", "vitrim"]
    assert "method=visionzip,keep=64" in command[4]


def test_every_video_recipe_builds_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    """The VideoMME rows' exact ``--model_args`` on tiny checkpoints with the 7B models' LLM depth (28 decoder layers
    both), so FlashVID's in-LLM stage sits at its layer 20; each builds with the methods and options it names."""
    from tiny_vlms.folders import save_llava_onevision, save_qwen2_5_vl
    from vitrim.vlm_user.tiny import QWEN_TEXT

    recipes = load_script()
    tiny = {
        "LLaVA-OneVision-7B": save_llava_onevision(tmp_path / "onevision", text={"num_hidden_layers": 28}),
        "Qwen2.5-VL-7B": save_qwen2_5_vl(tmp_path / "qwen", text={**QWEN_TEXT, "num_hidden_layers": 28}),
    }
    rows = recipes.video_recipes()
    assert len(rows) == len(recipes.VIDEO_MODELS) * len(recipes.VIDEO_METHODS) == 12
    for recipe in rows:
        model = VitrimModel.create_from_arg_string(
            recipe.model_args(str(tiny[recipe.model]), device="device=cpu,dtype=float32")
        )
        expected = {"flashvid": "flashvid+flashvid_llm"}.get(recipe.method, recipe.method)
        assert model.settings["method"] == expected, recipe
        assert model.settings["video"]["max_num_frames"] == 32
    flashvid = recipes.VideoRecipe("LLaVA-OneVision-7B", "flashvid").command("out")
    assert flashvid[flashvid.index("--tasks") + 1] == "videomme"
    assert "flashvid.token_selection_method=attn_div_v2" in flashvid[4]


def test_lmms_eval_knows_every_task_the_recipes_name() -> None:
    from lmms_eval.tasks import TaskManager

    recipes = load_script()
    known = set(TaskManager().all_tasks)
    assert set(recipes.TASKS.values()) | {recipes.VIDEO_TASK} <= known


def test_every_published_cell_is_a_recipe_cell_on_the_papers_scale() -> None:
    """A typo in a key (``textvqa`` for ``textvqa_val``, 196 for 192) would leave a number that no cell shows; a
    number copied on lmms-eval's [0, 1] scale would sit beside ours as a hundredfold gap."""
    recipes = load_script()
    cells = {(r.model, r.method, r.budget or recipes.IMAGE_TOKENS, r.task) for r in recipes.recipes()}
    assert set(recipes.PUBLISHED) <= cells
    for (_, _, _, task), (number, source) in recipes.PUBLISHED.items():
        assert (100 < number <= 2000) if task == "mme" else (1 < number <= 100), (task, number)
        assert "@" in source or "Table" in source, source  # where it was read: a commit or a table


def test_the_table_prints_a_published_number_beside_its_cell(tmp_path: Path) -> None:
    """``--table`` reads lmms-eval's results files (scores in [0, 1] for GQA) and prints ours in the papers' percent
    with the published number beside it; a cell with no published number shows ours alone."""
    import json

    recipes = load_script()
    assert recipes.PUBLISHED[("LLaVA-1.5-7B", "visionzip", 64, "gqa")][0] == 55.1
    assert ("LLaVA-1.5-7B", "visionzip", 64, "pope") not in recipes.PUBLISHED
    runs = {"gqa": ("exact_match", 0.5432), "pope": ("pope_f1_score", 0.8123)}
    for task, (metric, score) in runs.items():
        folder = tmp_path / f"LLaVA-1.5-7B_visionzip_64_{task}" / "model"
        folder.mkdir(parents=True)
        (folder / "20261202_results.json").write_text(json.dumps({"results": {task: {f"{metric},none": score}}}))
    row = next(line for line in recipes.table(tmp_path).splitlines() if "| visionzip | 64 |" in line)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:3] == ["LLaVA-1.5-7B", "visionzip", "64"]
    assert cells[3:] == ["—", "81.23", "54.32 (55.1)", "— (55.5)"]  # MME, POPE, GQA, TextVQA


def test_every_published_video_cell_is_a_video_row_and_the_table_prints_it(tmp_path: Path) -> None:
    """A published VideoMME number sits beside its own row (lmms-eval prints the score in percent already)."""
    import json

    recipes = load_script()
    rows = {(r.model, r.method) for r in recipes.video_recipes()}
    assert set(recipes.PUBLISHED_VIDEO) <= rows
    for number, source in recipes.PUBLISHED_VIDEO.values():
        assert 1 < number <= 100 and "@" in source
    folder = tmp_path / "LLaVA-OneVision-7B_fastvid_videomme" / "model"
    folder.mkdir(parents=True)
    (folder / "20261203_results.json").write_text(
        json.dumps({"results": {"videomme": {"videomme_perception_score,none": 56.25}}})
    )
    lines = recipes.video_table(tmp_path).splitlines()
    assert "| LLaVA-OneVision-7B | fastvid | 56.25 (57.3333) |" in lines
    assert "| Qwen2.5-VL-7B | fastvid | — |" in lines

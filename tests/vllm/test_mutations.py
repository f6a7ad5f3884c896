"""The tiny served models see what the exactness tests check: a plugin broken on purpose changes the tokens.

Per family, one engine (FasterVLM keeping 6 tokens per image), the same requests run as the plugin is, then with one
mistake at a time put into the plugin (the module's names the class calls at each step, patched in this process,
where ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the model):

- **misplaced**: each image hands on its neighbouring tokens (every kept raster index + 1) in place of its own;
- **cell** (the Qwen families): each kept token gets its neighbour's M-RoPE cell (the image's positions shifted by
  one token), its features its own;
- **order**: each image's kept tokens enter the LLM in reverse order; on Qwen their cells stay in raster order (the
  tokens in the order a score ranks them, the cells in the grid's: each token on another token's cell).

Each mistake must change some request's greedy tokens: otherwise the exactness tests of tests/vllm could not see it.
Each run names its images afresh (``multi_modal_uuids``), so vLLM's encoder cache never hands one run's features to
another.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import overrides, with_engine
from PIL import Image

from tiny_vlms.folders import save_vllm_llava, save_vllm_qwen2_5_vl, save_vllm_qwen3_vl

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# family: (its plugin module, its tiny folder, its image placeholder, the module whose selection function and
# image_positions its class calls: both Qwen classes cut images in vitrim.vllm.qwen2_5_vl's QwenImageTrimming)
FAMILIES = {
    "llava": ("vitrim.vllm.llava", save_vllm_llava, "<image>", "vitrim.vllm.llava"),
    "qwen2_5_vl": ("vitrim.vllm.qwen2_5_vl", save_vllm_qwen2_5_vl, QWEN_IMAGE, "vitrim.vllm.qwen2_5_vl"),
    "qwen3_vl": ("vitrim.vllm.qwen3_vl", save_vllm_qwen3_vl, QWEN_IMAGE, "vitrim.vllm.qwen2_5_vl"),
}
# the selection function each calling module uses: LLaVA's images of one batch may each ask their own keep
SELECTS = {"vitrim.vllm.llava": "select_keeping_each", "vitrim.vllm.qwen2_5_vl": "select_keeping"}
MISTAKES = {"llava": ("misplaced", "order"), "qwen2_5_vl": ("misplaced", "cell", "order")}
MISTAKES["qwen3_vl"] = MISTAKES["qwen2_5_vl"]
KEEP = 6
POSITION_COLUMNS = 4  # vitrim.vllm.compat.image_positions
MAX_TOKENS = 8


class Mistake:
    """The mistake the patched plugin makes now (None: none), switched between runs of one engine."""

    def __init__(self) -> None:
        self.now: str | None = None


def patch_plugin(module: Any, calls: Any, mistake: Mistake, monkeypatch: pytest.MonkeyPatch, positions: bool) -> None:
    """Wrap the names the class of ``module`` calls from the module ``calls``: its selection function (misplaced:
    ``select_keeping``, or LLaVA's ``select_keeping_each``), ``image_positions`` (cell), and the class's
    ``embed_multimodal`` (order)."""
    name = SELECTS[calls.__name__]
    select_keeping, model_class = getattr(calls, name), getattr(module, module.ARCHITECTURE)
    embed_multimodal = model_class.embed_multimodal

    def select(selector: Any, evidence: Any, keep: Any) -> Any:  # keep: an int, or LLaVA's one per image
        chosen = select_keeping(selector, evidence, keep)
        if mistake.now != "misplaced":
            return chosen
        count = evidence.features.shape[1]
        return [type(s).unmerged(((s.kept + 1) % count).sort().values) for s in chosen]

    def embed(self: Any, **kwargs: Any) -> Any:
        out = embed_multimodal(self, **kwargs)
        if mistake.now != "order":
            return out
        cells = POSITION_COLUMNS if positions else 0  # the (t, h, w, span) columns a Qwen embedding carries
        return tuple(
            torch.cat([rows[:, : rows.shape[1] - cells].flip(0), rows[:, rows.shape[1] - cells :]], 1) for rows in out
        )

    monkeypatch.setattr(calls, name, select)
    monkeypatch.setattr(model_class, "embed_multimodal", embed)
    if positions:
        image_positions = calls.image_positions

        def cells(grid_thw: list[int], merge_size: int) -> Any:
            found = image_positions(grid_thw, merge_size)
            if mistake.now == "cell":
                found[:, :3] = found[:, :3].roll(1, dims=0)  # each token its raster neighbour's (t, h, w)
            return found

        monkeypatch.setattr(calls, "image_positions", cells)


@pytest.fixture(params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_each_mistake_in_the_plugin_changes_the_tokens(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module_name, save, placeholder, calls_name = FAMILIES[family]
    folder = save(tmp_path / family)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(16, 24), (24, 16)]]
    prompts = [f"w10 w11 {placeholder} w12 w13 w14", f"w20 {placeholder} w21 w22 w23 w24 w25 w26"]
    mistake = Mistake()
    module = importlib.import_module(module_name)
    calls = importlib.import_module(calls_name)
    patch_plugin(module, calls, mistake, monkeypatch, positions="cell" in MISTAKES[family])

    def run(llm: Any) -> dict[str | None, list[list[int]]]:
        from vllm import SamplingParams

        tokens = {}
        for name in (None, *MISTAKES[family]):
            mistake.now = name
            requests = [
                {"prompt": prompt, "multi_modal_data": {"image": image}, "multi_modal_uuids": {"image": [f"{name}{i}"]}}
                for i, (prompt, image) in enumerate(zip(prompts, images, strict=True))
            ]
            outputs = llm.generate(requests, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
            tokens[name] = [list(output.outputs[0].token_ids) for output in outputs]
        return tokens

    tokens = with_engine(folder, overrides(module.ARCHITECTURE, "fastervlm", keep=KEEP), run)
    for name in MISTAKES[family]:
        assert tokens[name] != tokens[None], f"{family}: the plugin with its {name} mistake gave the same tokens"

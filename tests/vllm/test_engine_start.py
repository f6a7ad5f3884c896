"""Every refusal docs/vllm.md promises at engine start, on a real engine start (``vllm.LLM`` of a tiny folder).

Each bad override stops the engine with one line that starts ``vitrim:`` and names the value: never vLLM's own
error from deeper in (an architecture on the other family's checkpoint used to stop with vLLM's ``TypeError:
Invalid type of HuggingFace config``, its processing info's typed config getter running before vitrim's check).
The front end builds the processing info before any model loads, so each start fails within a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import overrides, with_engine

from tiny_vlms.folders import save_vllm_llava, save_vllm_qwen2_5_vl, save_vllm_qwen3_vl

LLAVA = "VitrimLlavaForConditionalGeneration"
QWEN = "VitrimQwen2_5_VLForConditionalGeneration"
QWEN3 = "VitrimQwen3VLForConditionalGeneration"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("refusals")
    return {
        "llava": save_vllm_llava(work / "llava"),
        "qwen": save_vllm_qwen2_5_vl(work / "qwen"),
        "qwen3": save_vllm_qwen3_vl(work / "qwen3"),
    }


REFUSALS: list[tuple[str, str, dict[str, Any] | None, str]] = [
    ("llava", QWEN, {"method": "random", "keep": 4}, f"vitrim: architecture {QWEN} runs 'qwen2_5_vl' checkpoints; "
     "this one has model_type 'llava'"),
    ("qwen", LLAVA, {"method": "random", "keep": 4}, f"vitrim: architecture {LLAVA} runs 'llava' checkpoints; "
     "this one has model_type 'qwen2_5_vl'"),
    ("llava", LLAVA, {"method": "visionzap", "keep": 4}, "vitrim: unknown vlm method 'visionzap'"),
    ("qwen", QWEN, {"method": "fastv", "keep": 4}, "vitrim: method 'fastv' prunes inside the LLM by its attention "
     "rows, which vLLM's paged attention does not hand a model"),
    ("qwen", QWEN, {"method": "hiprune", "keep": 4}, "vitrim: method 'hiprune' reduces inside the vision tower, which "
     f"the plugin does on {LLAVA} and VitrimGemma3ForConditionalGeneration (CLIP and SigLIP) only, not on {QWEN}"),
    ("llava", LLAVA, {"method": "hiprune", "keep": 5}, "vitrim: object_layer=9 is past this tower's feature layer"),
    ("llava", LLAVA, {"method": "tome", "keep": 3}, "vitrim: keep=3: ToMe merges at most half of the tokens"),
    ("llava", LLAVA, {"method": "pitome", "ratio": 0.8, "keep": 8}, "vitrim: method 'pitome' removes the patches "
     "its own options (ratio) fix, block by block, and takes no 'keep'; drop keep=8"),
    ("llava", LLAVA, {"method": "ppt"}, "vitrim: tower method 'ppt' needs option(s) ['r']"),
    ("llava", LLAVA, {"method": "tome", "keep": 6, "to_grid": True}, "vitrim: to_grid=True is not served here"),
    ("qwen", QWEN, {"method": "fastvid"}, "vitrim: method 'fastvid' keeps a count that depends on the video's "
     "content, and vLLM writes a prompt's placeholders before the tower runs"),
    ("qwen3", QWEN3, {"method": "flashvid"}, "vitrim: method 'flashvid' with exact_count=False rounds each temporal "
     "patch's clusters up by the video's content (t·B tokens or more, at most one more per temporal patch), "
     "and vLLM writes a prompt's placeholders before the tower runs; pass \"exact_count\": true"),
    ("llava", LLAVA, {"method": "evs"}, f"vitrim: method 'evs' reduces videos, and {LLAVA} serves images only"),
    ("qwen3", QWEN3, {"method": "vidcom2", "keep": 4}, "vitrim: method 'vidcom2' decides each video's count itself"),
    ("qwen", QWEN, {"method": "evs", "keep": 4}, "vitrim: method 'evs' decides each video's count itself; drop 'keep'"),
    ("qwen", QWEN, {"method": "cdpruner", "keep": 4, "relevance": "clip"}, "vitrim: method 'cdpruner' "
     "relevance='clip' reads CLIP's projection of the tower's states"),
    ("llava", LLAVA, {"method": "cdpruner", "keep": 4, "relevance": "clip", "clip": "/no/such/clip"},
     "vitrim: cdpruner clip='/no/such/clip' could not be loaded as a CLIPModel"),
    ("llava", LLAVA, {"method": "random", "keep": 0}, "vitrim: keep=0 must be at least 1"),
    ("qwen", QWEN, {"method": "random", "keep": 1.5}, "vitrim: keep=1.5 as a fraction must be in (0, 1]"),
    ("llava", LLAVA, {"method": "random", "keep": 17}, "vitrim: keep=17 is more than the image's 16 tokens"),
    ("qwen", QWEN, {"method": "random"}, "vitrim: method 'random' needs 'keep'"),
    ("llava", LLAVA, {"method": "random", "keep": 4, "ratio": 2}, "vitrim: unknown option 'ratio' for vlm method"),
    ("llava", LLAVA, {"method": "fastervlm", "keep": 4, "positions": "original"}, "vitrim: positions='original'"),
    ("qwen", QWEN, None, f"vitrim: architecture {QWEN} needs a 'vitrim' entry in --hf-overrides"),
]  # fmt: skip


@pytest.mark.parametrize(("folder", "architecture", "entry", "message"), REFUSALS)
def test_a_bad_override_stops_the_engine_with_vitrims_one_line(
    folder: str, architecture: str, entry: dict[str, Any] | None, message: str, folders: dict[str, Path]
) -> None:
    hf_overrides: dict[str, Any] = {"architectures": [architecture]}
    if entry is not None:
        hf_overrides["vitrim"] = entry
    with pytest.raises(ValueError) as raised:
        with_engine(folders[folder], hf_overrides, lambda llm: None)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_an_untested_vllm_stops_the_engine_in_one_line(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv("VITRIM_VLLM_UNTESTED", raising=False)
    with pytest.raises(RuntimeError, match=r"^vitrim: vLLM 0.99.0 is not a release vitrim.vllm was tested on[^\n]*$"):
        with_engine(folders["qwen"], overrides(QWEN, "random", keep=4), lambda llm: None)

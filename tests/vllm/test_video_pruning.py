"""vLLM's own video pruning (``video_pruning_method``, ``video_pruning_rate``: plain vLLM, its in-tree Qwen classes,
no vitrim plugin) against transformers + ``vitrim.vlm.apply(model, method, video_pruning_rate=...)`` on the same tiny
Qwen2.5-VL and Qwen3-VL folders and the same clips: equal pruned prompt lengths and equal greedy tokens, in the
position convention docs/video.md states.

One engine per (family, method) vLLM serves (three), three clips per engine (one request each, run together):

- ``wide``: 4 temporal patches of 2×3 merged tokens (H′ ≤ W′), whole-second ``second_per_grid_ts`` (1.0);
- ``one``: a single temporal patch: EVS never prunes it, VidCom2 keeps half;
- ``tall``: 3 temporal patches of 3×2 (H′ > W′).

Qwen2.5-VL (EVS): on ``wide`` and ``one`` vitrim's positions are vLLM's and the tokens are compared with vitrim as
it is; on ``tall`` vLLM's EVS path continues the text after the video at start + W′ where transformers continues at
start + max(H′, W′): vLLM's tokens equal transformers + vitrim's with exactly that one change made to vitrim's
positions (the reference's ``positions="vllm_evs"``), and vitrim's own positions give other tokens there (the
difference is real on this model). vLLM 0.32 refuses VidCom2 on Qwen2.5-VL (checked; no engine start).

Qwen3-VL: vLLM 0.32 numbers a pruned video from the wrong column (its ``recompute_mrope_positions`` looks for the
timestamps before the first vision start, which transformers >= 5.10's processor puts outside them); the tokens
are compared with transformers + vitrim at the positions vLLM's own function gives (``positions="vllm_qwen3_evs"``).
vLLM's class scores the merger output with its DeepStack features concatenated, vitrim the merger output: a clip on
which the two pick other tokens (:data:`EXPECTED_OTHER_PICKS`, measured) has its prompt length checked, not its
tokens.

The text after each video is long enough that the prompt's last token holds its largest M-RoPE position (a
Qwen2.5-VL video's temporal positions run 4 apart, ``tokens_per_second`` 4): vLLM decodes from the largest
position + 1, transformers' ``generate()`` from the last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name
from engines import clip_frames, greedy, transformers_reference, with_engine
from vllm.multimodal.video_prune import evs as evs_in_tree
from vllm.multimodal.video_prune import vidcom2 as vidcom2_in_tree

from tiny_vlms.folders import save_vllm_qwen2_5_vl, save_vllm_qwen3_vl

RATE = 0.5
MAX_TOKENS = 8
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TAIL = " ".join(f"w{i}" for i in range(40, 52))  # 12 words after the video: the last token's position is the largest
FAMILIES = {  # the transformers family: (its tiny folder, frames per temporal patch)
    "qwen2_5_vl": (save_vllm_qwen2_5_vl, 1),
    "qwen3_vl": (save_vllm_qwen3_vl, 2),
}
CLIPS = {"wide": (4, 2, 3), "one": (1, 2, 3), "tall": (3, 3, 2)}  # (temporal patches, H′, W′)
IN_TREE = {"evs": evs_in_tree, "vidcom2": vidcom2_in_tree}
# the clips on which vLLM's Qwen3-VL pick (on [merger output | DeepStack features]) is not the pick on the merger
# output: measured (tests/vllm/transformers_reference.py's in_tree_kept), their tokens not compared
EXPECTED_OTHER_PICKS: dict[tuple[str, str], list[str]] = {
    ("qwen2_5_vl", "evs"): [],
    ("qwen3_vl", "evs"): [],
    ("qwen3_vl", "vidcom2"): ["wide", "one", "tall"],
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    return tmp_path_factory.mktemp(family)


@pytest.fixture(scope="module")
def folder(work: Path, family: str) -> Path:
    return FAMILIES[family][0](work / "tiny")


@pytest.fixture(scope="module")
def requests(work: Path, family: str) -> dict[str, dict[str, Any]]:
    """One request per clip; fps = frames per temporal patch, so ``second_per_grid_ts`` is 1.0 on both families."""
    frames_per_patch = FAMILIES[family][1]
    out = {}
    for index, (name, shape) in enumerate(CLIPS.items()):
        path = work / f"{name}.npy"
        np.save(path, clip_frames(*shape, frames_per_patch, seed=index))
        clip = {"frames": str(path), "fps": float(frames_per_patch)}
        out[name] = {"prompt": f"w10 w11 w12 {VIDEO} {TAIL} w{20 + index}", "images": [], "videos": [clip]}
    return out


@pytest.fixture(scope="module")
def reference(
    work: Path, family: str, folder: Path, requests: dict[str, dict[str, Any]]
) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """transformers + vitrim.vlm per (method, positions): per clip its tokens, kept indices and prompt length."""
    runs = [(method, "original") for method in IN_TREE]
    runs += [("evs", "vllm_evs")] if family == "qwen2_5_vl" else [(method, "vllm_qwen3_evs") for method in IN_TREE]
    specs = [
        {
            "folder": str(folder),
            "family": family,
            "method": method,
            "options": {"video_pruning_rate": RATE},
            "positions": positions,
            "max_tokens": MAX_TOKENS,
            "requests": list(requests.values()),
        }
        for method, positions in runs
    ]
    return {
        run: dict(zip(requests, results, strict=True))
        for run, results in zip(runs, transformers_reference(specs, work), strict=True)
    }


def served(family: str, method: str) -> bool:
    return family == "qwen3_vl" or method == "evs"


@pytest.mark.parametrize("method", list(IN_TREE))
def test_vllms_own_video_pruning_generates_what_transformers_and_vitrim_generate(
    method: str,
    family: str,
    folder: Path,
    requests: dict[str, dict[str, Any]],
    reference: dict[tuple[str, str], dict[str, dict[str, Any]]],
) -> None:
    if not served(family, method):
        pytest.skip("vLLM 0.32 serves VidCom2 on Qwen3-VL only (test_vllm_refuses_vidcom2_on_qwen2_5_vl)")
    engine = dict(video_pruning_method=method, video_pruning_rate=RATE, limit_mm_per_prompt={"image": 0, "video": 1})
    outputs = with_engine(folder, None, lambda llm: greedy(llm, list(requests.values()), MAX_TOKENS), **engine)
    vitrim = reference[(method, "original")]
    got, want, other_picks = {}, {}, []
    for name, output in zip(requests, outputs, strict=True):
        expected = vitrim[name]
        (t, h, w) = expected["video_grids"][0]
        (kept,) = expected["kept"]
        assert len(kept) == IN_TREE[method].compute_retained_tokens_count(h * w, t, RATE), name
        if name == "one" and method == "evs":
            assert len(kept) == h * w  # EVS never prunes a one-temporal-patch clip
        else:
            assert len(kept) < t * h * w
        (full,) = expected["video_tokens"]
        assert len(output.prompt_token_ids) == expected["prompt_tokens"] - (full - len(kept)), name
        if family == "qwen3_vl":
            # vLLM 0.32's Qwen3-VL scores the merger output with its DeepStack features concatenated; vitrim (as
            # vLLM's Qwen2.5-VL) the merger output: vitrim keeps what vLLM's function keeps on the latter, and
            # where the two inputs pick other tokens (measured: recorded, never compared) vLLM serves other tokens
            picks = expected["in_tree_kept"]
            assert picks["merger"] == expected["kept"], name
            if picks["with_deepstack"] != picks["merger"]:
                other_picks.append(name)
                continue
            # and vLLM 0.32 misplaces a pruned video's positions on Qwen3-VL (docs/video.md): on the same kept
            # tokens at the positions vLLM's own recompute_mrope_positions gives, transformers gives vLLM's tokens
            convention = (method, "vllm_qwen3_evs")
        elif name == "tall":
            # vLLM's EVS path puts the text after the video at start + W' (here 2), not start + max(H', W') (3): on
            # the same kept tokens with that one change transformers gives vLLM's tokens, and vitrim's own differ
            convention = (method, "vllm_evs")
            assert expected["tokens"] != reference[convention][name]["tokens"], "the positions matter on this clip"
        else:
            convention = (method, "original")  # where docs/video.md says the conventions agree: vitrim as it is
        assert reference[convention][name]["kept"] == expected["kept"]
        got[name] = list(output.outputs[0].token_ids)
        want[name] = reference[convention][name]["tokens"]
    assert got == want
    assert other_picks == EXPECTED_OTHER_PICKS[(family, method)]  # measured on these clips; the rest compared


def test_vllm_refuses_vidcom2_on_qwen2_5_vl(
    family: str, folder: Path, reference: dict[tuple[str, str], dict[str, dict[str, Any]]]
) -> None:
    """vLLM 0.32's Qwen2.5-VL implements EVS only: VidCom2 is refused when the engine is configured (before any
    weights load: no engine start); vitrim's vidcom2 prunes transformers' Qwen2.5-VL to vLLM's count."""
    if family != "qwen2_5_vl":
        pytest.skip("Qwen3-VL serves VidCom2 (test_vllms_own_video_pruning_...)")
    engine = dict(video_pruning_method="vidcom2", video_pruning_rate=RATE)
    with pytest.raises(ValueError, match="Video pruning method 'vidcom2' is not supported by"):
        with_engine(folder, None, lambda llm: None, **engine)
    for name, result in reference[("vidcom2", "original")].items():
        (t, h, w) = result["video_grids"][0]
        assert len(result["kept"][0]) == vidcom2_in_tree.compute_retained_tokens_count(h * w, t, RATE) < t * h * w, name

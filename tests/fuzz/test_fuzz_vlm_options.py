"""Method options at their edges (issue 53): each either works as documented or is refused at ``apply`` (or by
``trim_options`` for vLLM) in one line naming the option and its value; never a crash at the first forward, never a
silent other meaning (``cls=0`` is not ``cls=False``), never an underflow that changes the selection."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1]))

import vitrim.vlm
from vitrim.vlm.method.scope import scope_keep


@pytest.fixture(scope="module")
def llava() -> torch.nn.Module:
    from tiny_vlms.llava import tiny_llava

    return tiny_llava(seed=1)


def llava_inputs() -> dict:
    from tiny_vlms.llava import pixels, prompt

    ids = prompt(2, 3)[None]
    return dict(input_ids=ids, pixel_values=pixels(1), attention_mask=torch.ones_like(ids))


def selected(model: torch.nn.Module, method: str, **options: object) -> list[list[int]]:
    vitrim.vlm.apply(model, method, **options)
    try:
        with torch.no_grad():
            model(**llava_inputs())
        return [kept.tolist() for kept in vitrim.vlm.last_selection(model)]
    finally:
        vitrim.vlm.remove(model)


@pytest.mark.parametrize("keep", range(1, 17))
def test_visionzip_runs_at_every_keep_on_llava(llava: torch.nn.Module, keep: int) -> None:
    """keep=1 crashed ("stack expects a non-empty TensorList"): the [CLS] took the only place. It now enters only
    beside a dominant patch, so the LLM gets ``keep`` tokens: ``keep`` patches, or ``keep - 1`` and the [CLS]."""
    vitrim.vlm.apply(llava, "visionzip", keep=keep)
    try:
        with torch.no_grad():
            model_out = llava(**llava_inputs())
        groups = vitrim.vlm.last_selection(llava, groups=True)[0]
    finally:
        vitrim.vlm.remove(llava)
    assert torch.isfinite(model_out.logits).all()
    assert len(groups) == keep  # the [CLS] (an empty group, first) counts as one of them
    assert (len(groups[0]) == 0) == (2 <= keep < 16)


@pytest.mark.parametrize("cls", [0, 1, 1.0, "yes"])
def test_visionzip_cls_takes_none_true_or_false_only(llava: torch.nn.Module, cls: object) -> None:
    """cls=0 acted as None (0 is not False) and cls=1 as True: now refused, naming the value."""
    with pytest.raises(ValueError, match=rf"^cls={cls!r} must be None"):
        vitrim.vlm.apply(llava, "visionzip", keep=4, cls=cls)
    assert not hasattr(llava, vitrim.vlm.api.STATE_ATTRIBUTE)


def test_visionzip_cls_true_is_refused_at_apply_where_no_cls_reaches_the_llm() -> None:
    """Accepted on Qwen2.5-VL (a tower without [CLS]), it failed at the first forward."""
    from tiny_vlms import qwen

    model = qwen.qwen2_5_vl(seed=0)
    with pytest.raises(
        ValueError, match=r"^visionzip cls=True: Qwen2_5_VLForConditionalGeneration hands .* no \[CLS\]"
    ):
        vitrim.vlm.apply(model, "visionzip", keep=4, cls=True)
    vitrim.vlm.apply(model, "visionzip", keep=4, cls=None)  # the documented way on such a tower
    vitrim.vlm.remove(model)


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -1])
def test_scope_alpha_must_be_finite(llava: torch.nn.Module, alpha: float) -> None:
    with pytest.raises(ValueError, match=rf"^alpha={alpha!r} must be a finite number >= 0"):
        vitrim.vlm.apply(llava, "scope", keep=4, alpha=alpha)


def greedy_by_hand(features: torch.Tensor, saliency: torch.Tensor, keep: int, alpha: float) -> list[int]:
    """SCOPE's greedy written from the paper's formula in Python floats: argmax_i a_i^α · Σ_j max(0, s_ij − m_j),
    compared through logarithms (math.log) so that no a^α underflows; ties to the lower index."""
    unit = [[x / math.sqrt(sum(v * v for v in row)) for x in row] for row in features.double().tolist()]
    n = len(unit)
    sim = [[1.0 if i == j else sum(a * b for a, b in zip(unit[i], unit[j])) for j in range(n)] for i in range(n)]
    covered, chosen = [0.0] * n, []
    for _ in range(keep):
        best, best_score = -1, -math.inf
        for i in range(n):
            if i in chosen:
                continue
            gain = sum(max(0.0, sim[i][j] - covered[j]) for j in range(n))
            a = max(0.0, float(saliency[i]))
            score = alpha * math.log(a) + math.log(gain) if a > 0 and gain > 0 else -1e308
            if score > best_score:
                best, best_score = i, score
        chosen.append(best)
        covered = [max(covered[j], max(0.0, sim[best][j])) for j in range(n)]
    return chosen


@pytest.mark.parametrize(("dtype", "alpha"), [(torch.float16, 5.0), (torch.float16, 12.0), (torch.float64, 200.0)])
def test_scope_at_large_alpha_equals_the_formula(dtype: torch.dtype, alpha: float) -> None:
    """saliency ** alpha underflowed to 0 for every token (float16 from alpha=5): the greedy took index 0, 1, 2, …"""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(24, 8, generator=generator).to(dtype)
    saliency = (torch.rand(24, generator=generator) * 0.02 + 1e-3).to(dtype)  # [CLS] attention over 576 patches
    expected = greedy_by_hand(features, saliency, 8, alpha)
    assert expected != list(range(8))
    assert scope_keep(features, saliency, 8, alpha).tolist() == expected


def test_last_selection_names_a_stage_it_cannot_read(llava: torch.nn.Module) -> None:
    vitrim.vlm.apply(llava, "fastervlm", keep=4)
    try:
        with torch.no_grad():
            llava(**llava_inputs())
        with pytest.raises(ValueError, match=r"^stage=\['tower'\] must be None or one of 'tower', 'pre_llm', 'in_llm'"):
            vitrim.vlm.last_selection(llava, stage=["tower"])  # type: ignore[arg-type]
    finally:
        vitrim.vlm.remove(llava)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"method": "visionzip", "keep": 8, "dominant": 8, "contextual": 4}, "keep=8 differs from dominant"),
        ({"method": "visionzip", "keep": 4, "contextual": 9}, "cannot keep 4 tokens"),
        ({"method": "fastervlm", "keep": 8, 1: 2}, "keys must be option names (strings), got 1"),
    ],
)
def test_trim_options_refuses_what_apply_refuses(entry: dict, expected: str) -> None:
    """trim_options accepted VisionZip's dominant + contextual > keep that apply refuses, and a non-string key ended
    in Python's "keywords must be strings"."""
    from vitrim.vllm.options import trim_options

    config = SimpleNamespace(model_type="llava", vitrim=entry)
    with pytest.raises(ValueError, match=r"^vitrim: ") as refused:
        trim_options(config, "VitrimLlavaForConditionalGeneration")
    assert expected in str(refused.value)

"""The digits VLM's shipped weights (``src/vitrim/data/demo/vlm``) are what the recipe makes, and score what the
shipped ``summary.json`` says (the numbers the docs quote).

* default: the shipped run was trained with today's ``FULL`` plan; the shipped summary has the issue's schema; the
  shipped model answers the first held-out questions as the shipped details record.
* ``full``: the full model's accuracy per question type and every method's accuracy at every kept fraction,
  recomputed from the shipped weights with the methods of this vitrim, equal the shipped summary's (within one
  question of the 300 per type: float16 storage and another CPU's summation order may move an argmax).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("transformers")

from vitrim.demos.vlm.data import QUESTION_TYPES
from vitrim.demos.vlm.demo import FULL, recipe
from vitrim.demos.vlm.evaluate import answer, held_out, score
from vitrim.demos.vlm.model import digits_vlm_config
from vitrim.demos.vlm.run_folder import load_digits_vlm
from vitrim.demos.vlm.sweep import BASELINE_SEEDS, KEPT_FRACTIONS, SEEDED_BASELINES, apply_method
from vitrim.shipped import shipped_run

ONE_QUESTION = 1 / FULL.test_canvases
# The summary was computed on one machine and is recomputed on another: a selection that ranks near-equal scores
# (CDPruner's greedy determinant, DivPrune's distances) can flip a tie with the CPU's summation order, and each flip
# changes a question or two. Measured 2026-12-02: CDPruner at half the tokens, "where" 44.5 % here against the
# summary's 43.5 % (2 questions of 200), on the commit whose CI had reproduced the summary.
ACROSS_MACHINES = 3 * ONE_QUESTION


def _read(name: str) -> dict:
    return json.loads((shipped_run("vlm") / name).read_text())


def test_shipped_vlm_was_trained_by_todays_recipe() -> None:
    # What the plan records only; that no training stage drew a held-out glyph is test_held_out_glyphs.py's to prove
    # of the code that trained them.
    details = _read("details.json")
    assert details["weights"] == "trained" and details["seed"] == 0
    assert recipe(details["plan"]) == recipe(json.loads(json.dumps(dataclasses.asdict(FULL))))
    # and the sizes the plan leaves to the model's defaults (model.VISION, model.TEXT) are the shipped config's
    shipped = _read("config.json")
    today = digits_vlm_config(FULL.vision, FULL.text).to_dict()
    for part in ("vision_config", "text_config"):
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            assert shipped[part].get(key) == today[part].get(key), (part, key)
    assert shipped["text_config"]["num_key_value_heads"] == today["text_config"]["num_key_value_heads"]


def test_shipped_summary_has_the_issues_schema() -> None:
    summary = _read("summary.json")
    assert set(summary) == {"full", "methods"}
    assert list(summary["full"]) == list(QUESTION_TYPES)
    for method, rows in summary["methods"].items():
        assert list(rows) == list(KEPT_FRACTIONS), method
        for row in rows.values():
            seeded = {"accuracy_by_seed"} if method in SEEDED_BASELINES else set()  # a seeded baseline's seeds
            assert set(row) == {"accuracy", "prefill_speedup"} | seeded
            assert list(row["accuracy"]) == list(QUESTION_TYPES)
            if seeded:  # the mean of the seeds' accuracies, each seed's kept
                by_seed = row["accuracy_by_seed"]
                assert len(by_seed) == len(BASELINE_SEEDS) >= 5
                for kind in QUESTION_TYPES:
                    assert row["accuracy"][kind] == pytest.approx(sum(s[kind] for s in by_seed) / len(by_seed))
            assert math.isfinite(row["prefill_speedup"]) and row["prefill_speedup"] > 0
            assert all(0.0 <= a <= 1.0 for a in row["accuracy"].values())


def test_shipped_model_answers_as_recorded() -> None:
    recorded = _read("details.json")["full_model_answers"]
    data = held_out(FULL.test_canvases)
    questions = data.questions[: len(recorded)]
    answers = answer(load_digits_vlm(shipped_run("vlm")), data.pixels[[q.canvas for q in questions]], questions)
    assert answers == recorded


@pytest.mark.full
def test_shipped_summary_is_recomputed_from_the_shipped_weights() -> None:
    summary = _read("summary.json")
    model = load_digits_vlm(shipped_run("vlm"))
    data = held_out(FULL.test_canvases)
    full, _ = score(model, data)
    for kind in QUESTION_TYPES:
        assert full[kind] == pytest.approx(summary["full"][kind], abs=ONE_QUESTION + 1e-9), kind
    for method, rows in summary["methods"].items():
        for fraction in KEPT_FRACTIONS:
            seeds = BASELINE_SEEDS if "accuracy_by_seed" in rows[fraction] else (None,)
            for k, seed in enumerate(seeds):
                accuracy, _ = score(apply_method(model, method, fraction, seed), data)
                row = rows[fraction]
                shipped = row["accuracy"] if seed is None else row["accuracy_by_seed"][k]
                for kind in QUESTION_TYPES:
                    expected = shipped[kind]
                    where = (method, fraction, kind)
                    assert accuracy[kind] == pytest.approx(expected, abs=ACROSS_MACHINES + 1e-9), where

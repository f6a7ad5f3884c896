"""A new method file is all a method needs (issue 49): a pre-LLM method written in a user's own module, imported
in a fresh interpreter before ``vitrim.vlm.flops`` or ``vitrim.cli`` ever are, is listed by
``vitrim.vlm.methods()``, counted by ``vitrim vlm flops`` from the cost its file gives, and run by
``vitrim.vlm.apply`` on the tiny LLaVA (output equal to the full model with the dropped tokens masked). Before this,
flops.py needed a branch for it (``has no count for the pre-LLM method``), and a method registered after flops was
imported was unknown to it (its method lists were frozen at import); the second test shows the latter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vitrim

TESTS = Path(__file__).resolve().parents[1]  # tiny_vlms lives here
SOURCE = Path(vitrim.__file__).resolve().parents[1]  # the vitrim this suite runs on

# The method's own module: selection and cost, nothing else anywhere.
METHOD_FILE = '''
"""``keep_last``: each image's last ``keep`` image tokens (a user's method, in a file of its own)."""

import torch

from vitrim.vlm.method import ImageSelection, Method, register_method
from vitrim.vlm.method.cost import MethodCost


@register_method("keep_last", stage="pre_llm")
class KeepLast(Method):
    """Keeps each image's last ``keep`` image tokens."""

    def select(self, evidence, keep):
        n = evidence.features.shape[1]
        return [ImageSelection.unmerged(torch.arange(n - keep, n)) for _ in evidence.features]

    def cost(self, model, keep, *, text_tokens):
        # a stand-in for a score: one dot product of the tower's width per image token
        return MethodCost.before_llm(keep, own=model.image_tokens * model.tower.width)
'''

# What the fresh interpreter runs: the method's module first, then the API, the CLI and apply.
DRIVER = """
import contextlib, io, json, sys

import keep_last  # the user's file, before anything of flops or the CLI
before = sorted(m for m in sys.modules if m.startswith(("vitrim.vlm.flops", "vitrim.cli")))

import torch
import vitrim.vlm
from vitrim.cli import main
from tiny_vlms.llava import GRID_TOKENS, pixels, prompt, tiny_llava

report = {"imported_before": before, "methods": vitrim.vlm.methods(), "pre_llm": vitrim.vlm.methods(stage="pre_llm")}
for name, argv in (("listed", []), ("asked", ["--methods", "keep_last", "--json", sys.argv[1]])):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report[name + "_code"] = main(["vlm", "flops", "--models", "llava-1.5-7b", "--keep", "64", *argv])
    report[name] = out.getvalue()

model, keep = tiny_llava(), 5
ids, pv = prompt(2, 3)[None], pixels(1)
vitrim.vlm.apply(model, "keep_last", keep=keep, positions="original")
with torch.no_grad():
    logits = model(input_ids=ids, pixel_values=pv).logits
report["kept"] = vitrim.vlm.last_selection(model)[0].tolist()
vitrim.vlm.remove(model)
image = (ids[0] == model.config.image_token_id).nonzero()[:, 0]
mask = torch.ones_like(ids)
mask[0, image[: GRID_TOKENS - keep]] = 0  # the image's first tokens, dropped by keep_last, masked out
with torch.no_grad():
    reference = model(
        input_ids=ids, pixel_values=pv, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None]
    ).logits
report["grid"] = GRID_TOKENS
report["max_difference"] = float((logits[0] - reference[0, mask[0].bool()]).abs().max())
print(json.dumps(report))
"""


@pytest.mark.full  # a fresh interpreter loading a method file: 7-8 s on 2 cores
def test_a_method_in_its_own_file_is_listed_counted_and_applied(tmp_path: Path) -> None:
    (tmp_path / "keep_last.py").write_text(METHOD_FILE)
    path = os.pathsep.join(str(p) for p in (tmp_path, SOURCE, TESTS))
    env = {**os.environ, "PYTHONPATH": path}
    written = tmp_path / "flops.json"
    run = subprocess.run(
        [sys.executable, "-c", DRIVER, str(written)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])

    assert report["imported_before"] == []  # the method's module came first
    assert "keep_last" in report["methods"] and "keep_last" in report["pre_llm"]

    assert report["listed_code"] == report["asked_code"] == 0, run.stderr[-2000:]
    assert "| keep_last | 64 |" in report["listed"]  # the default table lists it, with no line of flops.py
    rows = json.loads(written.read_text())["models"]["llava-1.5-7b"]
    assert [(r["method"], r["keep"]) for r in rows] == [("none", None), ("keep_last", 64)]
    row = rows[1]
    # its own count, by hand: 576 image tokens × CLIP-L's width 1024
    assert row["method_own"] == 576 * 1024 == 589_824
    # what it leaves, by hand: 64 image tokens + 94 text tokens in each of Vicuna-7B's 32 layers. Per position the
    # weights of q, k, v, o (4 × 4096²) and gate, up, down (3 × 4096 × 11008) = 202,375,168 MACs; attention 2 × 32
    # heads × 158² × 128; the LM head 4096 × 32064 on the last position
    assert row["tokens_per_layer"] == [158] * 32 and row["image_tokens_entering_llm"] == 64
    assert row["llm"] == 32 * (158 * 202_375_168 + 2 * 32 * 158 * 158 * 128) + 4096 * 32064
    assert row["total"] == row["tower"] + row["projector"] + row["llm"] + 589_824

    # apply: the last 5 of the 16 image tokens, and the logits of the full model with the other 11 masked
    assert report["kept"] == list(range(report["grid"] - 5, report["grid"])) == [11, 12, 13, 14, 15]
    assert report["max_difference"] <= 1e-12


@pytest.fixture
def registered_late() -> Iterator[None]:
    from vitrim.vlm.flops import prefill_cost  # noqa: F401 - flops is imported first, on purpose
    from vitrim.vlm.method import base
    from vitrim.vlm.method.cost import MethodCost

    class KeepFirstCounted(base.Method):
        """Keeps the first ``keep`` tokens; counts one product per image token (this test's)."""

        def cost(self, model: Any, keep: int, *, text_tokens: int) -> MethodCost:
            return MethodCost.before_llm(keep, own=model.image_tokens)

    class Uncounted(base.Method):
        """A method whose file does not count its cost."""

    base.register_method("keep_first_counted", stage="pre_llm")(KeepFirstCounted)
    base.register_method("uncounted", stage="pre_llm")(Uncounted)
    yield
    del base._METHODS["keep_first_counted"], base._METHODS["uncounted"]


def test_a_method_registered_after_flops_is_counted_and_one_without_a_cost_is_refused_by_name(
    registered_late: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from vitrim.cli import main
    from vitrim.vlm import flops

    assert "keep_first_counted" in flops.METHODS and "keep_first_counted" in flops.PRE_LLM
    assert flops.prefill_cost(flops.LLAVA_15_7B, "keep_first_counted", 64).method_own == 576
    # no silent zero: a method without a cost is left out of the table and refused when asked for
    assert "uncounted" not in flops.METHODS
    with pytest.raises(ValueError, match=r"method 'uncounted' has no cost count: its file must define cost\("):
        flops.prefill_cost(flops.LLAVA_15_7B, "uncounted", 64)
    assert main(["vlm", "flops", "--models", "llava-1.5-7b", "--methods", "uncounted"]) == 2
    assert "--methods: vlm method 'uncounted' has no cost count" in capsys.readouterr().err

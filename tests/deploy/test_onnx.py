"""ONNX: every model kind on every family exports with the dynamo exporter and onnxruntime computes PyTorch's logits,
any batch (the cross product in ``make test-all``; CI exports every kind on two families, as the whole product is an
hour of its 2 cores). ``make test`` exports the dense plain ViT only: each other case cost 11-80 s on the shared 2-core
machine (issue 45), and every kind and family is traced by default in
test_compile.py; the merging paths of tests/reduce/test_merge_export.py and the command's export (a reducer, a
checkpoint) run by default too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deploy_models import KINDS, build, cases, images

import vitrim
from vitrim.cli import main
from vitrim.export import INPUT_NAME, OUTPUT_NAME, compare_with_onnxruntime, export_onnx

onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

EVAL_KINDS = [kind for kind in KINDS if kind != "dynamicvit_train"]  # a deployment graph is an eval graph


# make test: the dense plain ViT; CI: every kind on two families; make test-all: every kind on every family
@pytest.mark.parametrize(("family", "kind"), cases(EVAL_KINDS, every=len(EVAL_KINDS), ci_diagonals=2))
def test_export_runs_in_onnxruntime_with_a_dynamic_batch(family: str, kind: str, tmp_path: Path) -> None:
    model = build(kind, family=family)
    path = export_onnx(model, tmp_path / f"{kind}.onnx", batch_size=2)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (input_meta,) = session.get_inputs()
    assert input_meta.name == INPUT_NAME and not isinstance(input_meta.shape[0], int)  # a symbolic batch
    for batch in (1, 2, 5):
        x = images(batch, seed=batch, family=family)
        with torch.no_grad():
            expected = model(x)
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-4)
    assert not model.training


@pytest.mark.full  # 27 s on the shared machine; the export's eval switch is the same code for every model
def test_a_training_model_is_exported_in_eval_mode_and_left_training(tmp_path: Path) -> None:
    model = build("dynamicvit_train")
    path = export_onnx(model, tmp_path / "dyn.onnx")
    assert model.training
    model.eval()
    assert compare_with_onnxruntime(model, path, batch_sizes=(3,)) < 1e-4


@pytest.mark.parametrize("descending", [True, False])
def test_stable_sort_translation_keeps_ties_in_index_order(descending: bool, tmp_path: Path) -> None:
    # EViT, top-k and ToMe rank with torch.sort(stable=True), which the exporter lacks; vitrim maps it to TopK.
    class Sort(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.sort(x * 1.0, dim=1, descending=descending, stable=True)

    x = torch.tensor([[0.5, 1.0, 0.5, 0.25, 1.0, 0.5, 0.25, 1.0]]).repeat(3, 1)
    x[1] = x[1].flip(0)
    x[2] = 0.0
    from vitrim.export import _translations

    program = torch.onnx.export(
        Sort().eval(), (x,), dynamo=True, custom_translation_table=_translations(), verbose=False
    )
    assert program is not None
    program.save(str(tmp_path / "sort.onnx"))
    session = onnxruntime.InferenceSession(str(tmp_path / "sort.onnx"), providers=["CPUExecutionProvider"])
    values, indices = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = torch.sort(x, dim=1, descending=descending, stable=True)
    assert torch.equal(torch.from_numpy(indices), expected.indices)
    assert torch.equal(torch.from_numpy(values), expected.values)


@pytest.mark.full  # 10 s: the command end to end; the export itself is checked by default above
def test_cli_exports_a_checkpoint_with_a_reducer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build("dense")
    checkpoint = vitrim.save_checkpoint(model, tmp_path / "model.safetensors")
    out = tmp_path / "out" / "model.onnx"
    assert main(["export", str(checkpoint), "--onnx", str(out), "--reducer", "tome:r=3", "--check"]) == 0
    printed = capsys.readouterr().out
    assert out.is_file() and "wrote" in printed
    diff = float(printed.rsplit("difference|", 1)[1].split()[0])
    assert diff < 1e-4
    vitrim.reduce.apply(model, "tome", r=3)
    assert compare_with_onnxruntime(model.eval(), out, batch_sizes=(4,)) < 1e-4


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "missing.safetensors"), "--onnx", str(tmp_path / "x.onnx")]) == 2
    assert "missing.safetensors" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size"):
        export_onnx(build("dense"), tmp_path / "x.onnx", batch_size=0)
    with pytest.raises(ValueError, match="divisible by the patch size"):
        export_onnx(build("dense"), tmp_path / "x.onnx", img_size=30)


def test_an_opset_the_exporter_cannot_reach_is_refused_and_the_old_file_kept(tmp_path: Path, capsys) -> None:
    # torch writes opset 18 and converts; with no converter for an operator it used to keep 18 silently
    checkpoint = vitrim.save_checkpoint(build("dense"), tmp_path / "model.safetensors")
    out = tmp_path / "model.onnx"
    out.write_bytes(b"the user's earlier export")
    assert main(["export", str(checkpoint), "--onnx", str(out), "--opset", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vitrim: error: opset_version 3 is not available") and err.count("\n") == 1
    assert out.read_bytes() == b"the user's earlier export"

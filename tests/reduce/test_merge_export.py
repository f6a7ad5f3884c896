"""The merging methods export to ONNX (gathers and dense assignment products, no scatter_reduce mean)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from reduce_models import images, tiny

import vitrim


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("pitome", {"ratio": 0.8}),
        # proportional attention off: the float-mask path of the attention function is the deploy issue's to export
        ("ppt", {"r": 4, "layers": (1, 2), "threshold": 1.0, "prop_attn": False}),  # every image pools
        ("ppt", {"r": 4, "layers": (1, 2), "threshold": 0.0, "prop_attn": False}),  # every image prunes
        ("zero_tprune", {"keep_rate": 0.6, "layers": (1, 2)}),  # WPR iterations and the S-stage, static counts
        # pruning only: DiffRate's merges always bring proportional attention (the float-mask path, as above)
        ("diffrate", {"prune_kept": [17, 15, 12, 9], "merge_kept": [17, 15, 12, 9]}),
    ],
)
def test_onnx_export_matches_eager(name: str, options: dict[str, object]) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model = vitrim.reduce.apply(tiny(), name, **options)
    x = images()
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), buffer, opset_version=17, dynamo=False)
        expected = model(x)
    session = ort.InferenceSession(buffer.getvalue())
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-5)

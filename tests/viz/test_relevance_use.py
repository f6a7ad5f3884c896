"""Using relevance: ``vitrim viz relevance``, the picture of kept and merged patches, argument errors, and the
faithfulness measures (deletion / insertion by hand, Spearman against a hand computation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vitrim
from vitrim.cli import main
from vitrim.viz.faithfulness import area_under, average_ranks, faithfulness, perturbation_curves, spearman
from vitrim.viz.relevance_plot import token_layout

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = vitrim.create_model(
        "dynamicvit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=10
    )
    return str(vitrim.save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "dynamic.safetensors"))


@pytest.mark.parametrize("method", ["chefer", "attnlrp", "rollout"])
def test_viz_relevance_writes_the_picture(checkpoint, tmp_path, capsys, method):
    out = tmp_path / f"{method}.png"
    args = ["viz", "relevance", "--checkpoint", checkpoint, "--digits", "1", "--method", method, "--out", str(out)]
    assert main([*args, "--class", "3"]) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 2_000
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--class", "10"], "--class must be a class index in [0, 10), got 10"),
        (["--reducer", "nope:r=1"], "nope"),
    ],
)
def test_viz_relevance_errors_are_one_line_exit_2(checkpoint, tmp_path, capsys, extra, message):
    args = ["viz", "relevance", "--checkpoint", checkpoint, "--digits", "1", "--out", str(tmp_path / "x.png")]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitrim: error:") and message in err[0]


def test_rollout_refuses_a_model_without_cls_and_bad_arguments_name_themselves():
    gap = vitrim.create_model("vit_medium_patch16_gap_256", img_size=16, patch_size=4, depth=1, embed_dim=16)
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match="explains the \\[CLS\\] row"):
        vitrim.viz.relevance(gap, x, method="rollout")
    with pytest.raises(ValueError, match="method must be one of"):
        vitrim.viz.relevance(gap, x, method="lime")
    with pytest.raises(ValueError, match=r"target must be a class index in \[0, 1000\), got 1000"):
        vitrim.viz.relevance(gap, x, target=1000)
    with pytest.raises(ValueError, match="target must hold 2 integer class indices"):
        vitrim.viz.relevance(gap, x, target=[1, 2, 3])
    with pytest.raises(ValueError, match="images must be a floating"):
        vitrim.viz.relevance(gap, x[0])
    with pytest.raises(TypeError, match="vitrim VisionTransformer"):
        vitrim.viz.relevance(torch.nn.Linear(2, 2), x)
    mctf = vitrim.create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=24)
    vitrim.reduce.apply(mctf, "mctf", r=2)
    with pytest.raises(ValueError, match="AttnLRP cannot follow MCTF"):
        vitrim.viz.relevance(mctf, x, method="attnlrp")
    assert vitrim.viz.relevance(mctf, x, method="chefer").shape == (2, 4, 4)
    untraced = vitrim.create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=24)
    vitrim.reduce.apply(untraced, "tome", r=2, trace_source=False)
    with pytest.raises(ValueError, match="trace_source=True"):
        vitrim.viz.relevance(untraced, x)
    assert vitrim.viz.relevance(untraced, x, method="attnlrp").shape == (2, 4, 4)  # needs no provenance
    assert gap.training  # the model's mode is restored after an explanation


def test_token_layout_colours_merged_groups_washes_dropped_and_counts():
    mapping = torch.tensor([0, 0, 1, -1, 2, 2, 2, -1, 3])  # 3x3 grid: tokens 0 and 2 are merged groups
    overlay, counts = token_layout(mapping, (3, 3))
    assert counts == {"kept": 2, "merged": 5, "merged_tokens": 2, "dropped": 2}
    alpha = overlay[..., 3].reshape(-1)
    assert np.allclose(alpha[[3, 7]], 0.75) and np.allclose(overlay.reshape(9, 4)[[3, 7], :3], 1.0)
    assert np.allclose(alpha[[2, 8]], 0.0)  # own tokens: the image shows as it is
    colours = overlay.reshape(9, 4)[:, :3]
    assert np.allclose(colours[0], colours[1]) and np.allclose(colours[4], colours[6])
    assert not np.allclose(colours[0], colours[4])


class ByPatch(torch.nn.Module):
    """A stand-in classifier on a 2x2 grid of 4x4 patches: logit 0 = sum of patch means weighted 4, 3, 2, 1."""

    def __init__(self) -> None:
        super().__init__()
        self.config = vitrim.ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        means = x[:, 0].unfold(1, 4, 4).unfold(2, 4, 4).mean((-1, -2)).reshape(x.shape[0], 4)
        logit = means @ torch.tensor([4.0, 3.0, 2.0, 1.0])
        return torch.stack([logit, torch.zeros_like(logit)], dim=1)

    def forward_detailed(self, x: torch.Tensor) -> None:  # makes it pass for a vitrim model in model_config
        raise NotImplementedError


def test_deletion_and_insertion_curves_by_hand():
    model = ByPatch()
    images = torch.ones(1, 1, 8, 8)
    fill = torch.zeros(1)
    order = torch.tensor([[0, 1, 2, 3]])
    deletion, insertion = perturbation_curves(model, images, order, torch.tensor([0]), fill)
    sigmoid = [1 / (1 + math.exp(-v)) for v in (10, 6, 3, 1, 0)]  # logit after removing 0, 1, 2, 3, 4 patches
    assert torch.allclose(deletion[0], torch.tensor(sigmoid), atol=1e-6)
    inserted = [1 / (1 + math.exp(-v)) for v in (0, 4, 7, 9, 10)]  # from the all-removed image, best patch first
    assert torch.allclose(insertion[0], torch.tensor(inserted), atol=1e-6)
    assert torch.allclose(area_under(deletion), torch.tensor([(sum(sigmoid) - (sigmoid[0] + sigmoid[-1]) / 2) / 4]))


def test_faithfulness_ranks_a_right_order_above_random_on_the_stand_in():
    torch.manual_seed(0)
    images = torch.rand(6, 1, 8, 8) + 0.5
    result = faithfulness(ByPatch(), images, ["gradient_x_input", "random"], fill=torch.zeros(1), random_orders=3)
    assert result.deletion_auc["gradient_x_input"] < result.deletion_auc["random"]
    assert result.insertion_auc["gradient_x_input"] > result.insertion_auc["random"]
    assert result.maps["random"].shape == (6, 4)


def test_spearman_matches_a_hand_computation_with_ties_and_a_mask():
    assert torch.equal(
        average_ranks(torch.tensor([10.0, 20.0, 20.0, 5.0])), torch.tensor([2.0, 3.5, 3.5, 1.0]).double()
    )
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    b = torch.tensor([[1.0, 3.0, 2.0, 4.0, -9.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, False], [True] * 5])
    rho = spearman(a, b, mask)
    # first row: ranks (1,2,3,4) vs (1,3,2,4): 1 - 6·Σd²/(n(n²-1)) = 1 - 6·2/60 = 0.8; second: reversed, -1
    assert torch.allclose(rho, torch.tensor([0.8, -1.0]).double())


def test_faithfulness_smoke_every_method_on_a_tiny_vit():
    """The study's whole pipeline (every method, captum's included) on a tiny ViT: curves of the right length that
    start (deletion) and end (insertion) at the intact image's probability."""
    torch.manual_seed(0)
    model = vitrim.create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=16,
                                num_heads=2, num_classes=3).eval()  # fmt: skip
    images = torch.randn(3, 3, 16, 16)
    result = faithfulness(model, images, random_orders=2, step=4)
    with torch.no_grad():
        intact = model(images).softmax(-1).max(-1).values.mean()
    for method in ("chefer", "attnlrp", "rollout", "gradient_x_input", "integrated_gradients", "random"):
        deletion, insertion = result.deletion_curve[method], result.insertion_curve[method]
        assert len(deletion) == len(insertion) == 5  # 16 patches, 4 per step
        assert abs(deletion[0] - float(intact)) < 1e-5 and abs(insertion[-1] - float(intact)) < 1e-5
        assert 0 <= result.deletion_auc[method] <= 1 and 0 <= result.insertion_auc[method] <= 1
        assert result.maps[method].shape == (3, 16)

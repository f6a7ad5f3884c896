"""`vitrim bench models` end to end on tiny models: rows, JSON, hand-checked FLOPs, parameters, memory, errors."""

from __future__ import annotations

import json

import pytest

import vitrim
from vitrim.cli import main
from vitrim.literals import parse_assignments, parse_value

TINY_SET = "embed_dim=32,depth=2,num_heads=2,img_size=32,patch_size=8,num_classes=10"
FAST = ["--batch-size", "2", "--repeats", "2", "--warmup", "1", "--latency-repeats", "3", "--threads", "1"]
FIELDS = {
    "setting",
    "model",
    "gflops_per_image",
    "params_m",
    "throughput_img_s",
    "latency_p50_ms",
    "latency_p95_ms",
    "achieved_gflop_s",
    "matmul_gflop_s",
    "matmul_shape",
    "efficiency",
    "speedup",
    "batch_size",
    "img_size",
    "threads",
}


def tiny_params_by_hand(dim: int = 32, depth: int = 2, patch: int = 8, img: int = 32, classes: int = 10) -> int:
    n = (img // patch) ** 2 + 1
    embed = 3 * patch * patch * dim + dim + dim + n * dim  # conv weight + bias, [CLS], position embedding
    block = 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + 2 * dim + (4 * dim * dim + 4 * dim)
    block += 4 * dim * dim + dim
    return embed + depth * block + 2 * dim + dim * classes + classes


def tiny_flops_by_hand(dim: int = 32, depth: int = 2, patch: int = 8, img: int = 32, classes: int = 10) -> int:
    n = (img // patch) ** 2 + 1
    per_block = 2 * n * dim * 3 * dim + 2 * 2 * n * n * dim + 2 * n * dim * dim + 2 * 2 * n * dim * 4 * dim
    return 2 * (n - 1) * 3 * patch * patch * dim + depth * per_block + 2 * dim * classes


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["bench", "models", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_two_models_write_every_field(capsys, tmp_path):
    path = tmp_path / "rows.json"
    models = "vit_tiny_patch16_224,deit_tiny_patch16_224"
    rc, out, err = run_cli(capsys, models, "--set", TINY_SET, *FAST, "--no-memory", "--json", str(path))
    assert rc == 0, err
    assert "vit_tiny_patch16_224" in out and "deit_tiny_patch16_224" in out and "img/s" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["model"] for r in rows] == models.split(",")
    for row in rows:
        assert set(row) >= FIELDS, FIELDS - set(row)
        assert row["gflops_per_image"] * 1e9 == pytest.approx(tiny_flops_by_hand(), rel=1e-12)
        assert row["params_m"] * 1e6 == pytest.approx(tiny_params_by_hand(), rel=1e-12)
        assert row["throughput_img_s"] > 0 and row["matmul_gflop_s"] > 0
        assert row["latency_p50_ms"] <= row["latency_p95_ms"]
        assert row["achieved_gflop_s"] == pytest.approx(row["gflops_per_image"] * row["throughput_img_s"])
        assert row["efficiency"] == pytest.approx(row["achieved_gflop_s"] / row["matmul_gflop_s"])
        assert row["matmul_shape"] == [2 * 17, 32, 128]  # (B·N, D, 4D) of this model
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(rows[1]["throughput_img_s"] / rows[0]["throughput_img_s"])


def test_peak_memory_holds_at_least_the_mlp_activations(capsys, tmp_path):
    path = tmp_path / "rows.json"
    spec = "embed_dim=64,depth=2,num_heads=2,img_size=64,patch_size=8"
    argv = ["--batch-size", "64", "--repeats", "1", "--warmup", "0", "--latency-repeats", "0", "--threads", "1"]
    argv += ["--json", str(path)]
    rc, _, err = run_cli(capsys, "vit_tiny_patch16_224", "--set", spec, *argv)
    assert rc == 0, err
    row = json.loads(path.read_text())["rows"][0]
    # fc1's output and GELU's output, (64, 65, 256) float32 each, are alive together in every block.
    hidden_mib = 64 * 65 * 256 * 4 / 2**20
    assert 2 * hidden_mib <= row["peak_mem_mb"] < 100
    assert row["peak_rss_mb"] > row["peak_mem_mb"]
    assert row["latency_p50_ms"] is None  # --latency-repeats 0 skips latency


def test_reducer_rows_count_fewer_flops(capsys, tmp_path):
    path = tmp_path / "rows.json"
    spec = "embed_dim=32,depth=4,num_heads=2,img_size=64,patch_size=8"
    reducers = ["--reducer", "none", "--reducer", "tome:r=8", "--reducer", "evit:keep_rate=0.5"]
    argv = ["--set", spec, *reducers, *FAST, "--no-memory", "--json", str(path)]
    rc, _, err = run_cli(capsys, "vit_tiny_patch16_224", *argv)
    assert rc == 0, err
    rows = json.loads(path.read_text())["rows"]
    assert [r["reducer"] for r in rows] == [None, "tome:r=8", "evit:keep_rate=0.5"]
    dense, tome, evit = (r["gflops_per_image"] for r in rows)
    assert tome < dense and evit < dense


@pytest.mark.skipif("dynamicvit_tiny_patch16_224" not in vitrim.list_models(), reason="DynamicViT not registered")
def test_keep_ratio_rows(capsys, tmp_path):
    path = tmp_path / "rows.json"
    spec = "embed_dim=32,depth=4,num_heads=2,img_size=64,patch_size=8"
    ratios = ["--keep-ratio", "1.0", "--keep-ratio", "0.5"]
    argv = ["--set", spec, *ratios, *FAST, "--no-memory", "--json", str(path)]
    rc, _, err = run_cli(capsys, "dynamicvit_tiny_patch16_224", *argv)
    assert rc == 0, err
    rows = json.loads(path.read_text())["rows"]
    assert [r["keep_ratio"] for r in rows] == [1.0, 0.5]
    assert rows[1]["gflops_per_image"] < rows[0]["gflops_per_image"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["vit_smol_patch16_224"], "unknown model 'vit_smol_patch16_224'"),
        (["vit_tiny_patch16_224", "--set", TINY_SET, "--keep-ratio", "0.5"], "does not take keep_ratio"),
        (["vit_tiny_patch16_224", "--set", TINY_SET, "--reducer", "tomato:r=2"], "unknown reducer 'tomato'"),
        (["vit_tiny_patch16_224", "--set", TINY_SET, "--reducer", "tome:q=2"], "unknown option(s) ['q']"),
        (["vit_tiny_patch16_224", "--set", "embed_dim"], "--set expects KEY=VALUE"),
        (["vit_tiny_patch16_224", "--set", "depht=2"], "unknown config option(s) ['depht']"),
        (["vit_tiny_patch16_224", "--set", "img_size=32", "--img-size", "32"], "--img-size or --set img_size"),
        (["vit_tiny_patch16_224[depth=2", "--set", TINY_SET], "must look like name or name[key=value,...]"),
        (["vit_tiny_patch16_224[keep_ratio=2]", "--set", TINY_SET], "keep_ratio must be in (0, 1], got 2"),
        (["vit_tiny_patch16_224,vit_tiny_patch16_224[reducer=tome:r=-1]", "--set", TINY_SET], "r must be an int"),
        (["vit_tiny_patch16_224", "--set", TINY_SET, "--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv, "--no-memory")
    assert rc == 2
    assert err.startswith("vitrim: error: ") and err.count("\n") == 1, err
    assert message in err
    assert "img/s" not in out  # nothing was measured


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--batch-size", "0", "an int in [1, 65536] (images in one batch)"),
        ("--repeats", "-1", "an int in [1, 100000] (timed calls)"),
        ("--img-size", "0", "an int in [1, 8192] (an image side in pixels, at most what a model config may ask for)"),
        ("--keep-ratio", "1.5", "a number in (0, 1] (the share of tokens DynamicViT keeps)"),
    ],
)
def test_numbers_out_of_range_are_argparse_errors(capsys, option, value, expected):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "models", "vit_tiny_patch16_224", option, value, "--no-memory"])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(f"argument {option}: expected {expected}, got '{value}'")
    )


def test_values_are_literals_or_strings():
    assert parse_value("13") == 13 and parse_value("0.7") == 0.7 and parse_value("(3, 6)") == (3, 6)
    assert parse_value("[1,2]") == (1, 2) and parse_value("True") is True and parse_value("avg") == "avg"
    assert parse_value("__import__('os')") == "__import__('os')"  # read, never run
    assert parse_assignments("a=1,b=(2,3),c=avg", "--set") == {"a": 1, "b": (2, 3), "c": "avg"}


def test_timm_reference_rows_do_the_same_work(capsys, tmp_path):
    path = tmp_path / "rows.json"
    models = "vit_tiny_patch16_224,deit_tiny_distilled_patch16_224"
    argv = ["--set", TINY_SET, "--timm-reference", *FAST, "--no-memory", "--json", str(path)]
    rc, out, err = run_cli(capsys, models, *argv)
    assert rc == 0, err
    assert "no timm reference row for deit_tiny_distilled_patch16_224" in out
    rows = json.loads(path.read_text())["rows"]
    assert [(r["model"], r["timm_reference"]) for r in rows] == [
        ("vit_tiny_patch16_224", False),
        ("vit_tiny_patch16_224", True),
        ("deit_tiny_distilled_patch16_224", False),
    ]
    assert rows[1]["setting"] == "vit_tiny_patch16_224 [timm eager ops]"
    # Counted on timm's ops, independently of the vitrim model's forward: the same matrix products.
    assert rows[1]["gflops_per_image"] == rows[0]["gflops_per_image"]


def test_items_carry_their_own_settings(capsys, tmp_path):
    path = tmp_path / "rows.json"
    spec = "embed_dim=32,depth=4,num_heads=2,img_size=64,patch_size=8"
    items = "vit_tiny_patch16_224,vit_tiny_patch16_224[reducer=tome:r=8],vit_tiny_patch16_224[depth=2]"
    items += ",vit_tiny_patch16_224[reducer='evit:keep_rate=0.5,layers=(1,2)']"
    rc, _, err = run_cli(capsys, items, "--set", spec, *FAST, "--no-memory", "--json", str(path))
    assert rc == 0, err
    rows = json.loads(path.read_text())["rows"]
    assert [r["setting"] for r in rows] == [
        "vit_tiny_patch16_224",
        "vit_tiny_patch16_224 tome:r=8",
        "vit_tiny_patch16_224 depth=2",
        "vit_tiny_patch16_224 evit:keep_rate=0.5,layers=(1,2)",
    ]
    dense, tome, shallow, evit = (r["gflops_per_image"] for r in rows)
    assert tome < dense and evit < dense
    assert shallow * 1e9 == pytest.approx(tiny_flops_by_hand(depth=2, img=64, classes=1000), rel=1e-12)

"""Issue 34, model files and API arguments: a config read from a file is bounded before anything is allocated
(vitrim.models.config_limits), and vitrim.optimize and relevance targets refuse bad arguments with one clear error.

Hostile files are written here (a vitrim checkpoint's metadata, a hub repo's config.json in timm's and transformers'
layouts, laid out in an offline hub cache), and each is loaded through the public API under an address-space limit
would turn any large allocation into a crash: the contract is a ValueError / TypeError that names the field."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import vitrim
from vitrim.models import config_limits

CLEAR = (ValueError, TypeError)
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TINY = dict(img_size=32, depth=1, embed_dim=16, num_heads=2, num_classes=10)
SIZE_FIELDS = ("num_classes", "embed_dim", "depth", "num_heads", "img_size", "patch_size", "mlp_ratio", "reg_tokens")
HOSTILE_NUMBERS = st.one_of(
    st.sampled_from([0, -1, 10**9, 2**20, 2**40, 10**20, True, "32", "abc", None, [], {}, 1.5, 1e300, [7, 7, 7]]),
    st.integers(-(2**70), 2**70),
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A tiny vitrim checkpoint's tensors and metadata, to rewrite."""
    path = vitrim.save_checkpoint(
        vitrim.create_model("vit_tiny_patch16_224", **TINY), tmp_path_factory.mktemp("ck") / "m.safetensors"
    )
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


def assert_clear(err: BaseException, *words: str) -> None:
    text = str(err)
    assert "\n" not in text.strip() and any(word in text for word in words), text


def with_config(saved, tmp: Path, text: str) -> Path:
    tensors, metadata = saved
    path = tmp / "hostile.safetensors"
    save_file(tensors, str(path), metadata={**metadata, "vitrim.config": text})
    return path


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("num_classes", 10**9, ("num_classes = 1000000000", "limit")),
        ("embed_dim", 2**20, ("embed_dim = 1048576", "limit")),
        ("depth", 10**6, ("depth = 1000000",)),
        ("reg_tokens", 10**8, ("reg_tokens = 100000000",)),
        ("mlp_ratio", "4", ("mlp_ratio must be a number",)),
        ("img_size", [2**16, 32], ("img_size = 65536",)),
        ("num_classes", 2**20, ("values", "MAX_FRESH_VALUES")),  # within the limit, not within the weights
    ],
)
def test_checkpoint_metadata_sizes_are_bounded(saved, tmp_path, bounded_memory, field, value, words) -> None:
    config = json.loads(saved[1]["vitrim.config"]) | {field: value}
    with pytest.raises(ValueError) as err:
        vitrim.load_model(with_config(saved, tmp_path, json.dumps(config)))
    assert_clear(err.value, *words)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100000 + "]" * 100000, ("nested",)),
        ('{"norm_eps": Infinity}', ("Infinity",)),
        ("[]", ("expected a JSON object",)),
    ],
)
def test_checkpoint_metadata_json_is_read_as_data(saved, tmp_path, text, words) -> None:
    with pytest.raises(ValueError) as err:
        vitrim.load_model(with_config(saved, tmp_path, text))
    assert_clear(err.value, *words)


def test_limits_can_be_raised_for_a_trusted_file(saved, tmp_path) -> None:
    config = json.loads(saved[1]["vitrim.config"]) | {"embed_dim": 16}
    path = with_config(saved, tmp_path, json.dumps(config))
    with (
        config_limits.raised_limits(embed_dim=8),
        pytest.raises(ValueError, match="embed_dim = 16 is over the limit of 8"),
    ):
        vitrim.load_model(path)
    assert config_limits.LIMITS["embed_dim"] == 16384  # restored
    with config_limits.raised_limits(embed_dim=16):
        assert vitrim.load_model(path).config.embed_dim == 16
    with pytest.raises(ValueError, match="unknown limit"), config_limits.raised_limits(embed_dims=16):
        pass


@FAST
@given(field=st.sampled_from(SIZE_FIELDS), value=HOSTILE_NUMBERS)
def test_fuzz_checkpoint_metadata(saved, tmp_path, bounded_memory, field, value) -> None:
    config = json.loads(saved[1]["vitrim.config"]) | {field: value}
    try:
        model = vitrim.load_model(with_config(saved, tmp_path, json.dumps(config)))
    except CLEAR as err:
        assert_clear(err, field, "vitrim.config", "does not fit", "divisible")
        return
    held = sum(t.numel() for t in saved[0].values())
    assert sum(p.numel() for p in model.parameters()) <= held + config_limits.MAX_FRESH_VALUES
    assert_loaded_as_saved(model, saved[0])


def assert_loaded_as_saved(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every value the model holds came from the file: no fresh head, register or resampled position embedding."""
    for key, value in model.state_dict().items():
        assert key in tensors and torch.equal(value, tensors[key]), key


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("num_classes", 11, ("num_classes = 11", "10-class head")),
        ("num_classes", 0, ("num_classes = 0", "10-class head")),
        ("reg_tokens", 2, ("reg_tokens = 2", "no reg_token")),
        ("img_size", 64, ("img_size = (64, 64)", "17 positions", "pos_embed has 5")),
    ],
)
def test_checkpoint_metadata_must_agree_with_its_weights(saved, tmp_path, field, value, words) -> None:
    """What the file states and what its weights hold disagree: refused, never a fresh head or a resampled grid."""
    path = with_config(saved, tmp_path, json.dumps(json.loads(saved[1]["vitrim.config"]) | {field: value}))
    with pytest.raises(ValueError) as err:
        vitrim.load_model(path)
    assert_clear(err.value, words[0])
    assert all(word in str(err.value) for word in (*words, str(path), "vitrim.config")), err.value
    model = vitrim.load_model(path, **{field: value})  # the user's own choice: fresh head / registers, resampled
    assert getattr(model.config, field) in (value, (value, value))


# -- hub repos, both layouts ------------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pytest.importorskip("huggingface_hub")
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def hf_weights(embed_dim: int = 16) -> dict[str, torch.Tensor]:
    """A one-layer transformers ViT's weights (save_pretrained's names), sizes as in ``hf_config``."""
    d, h = embed_dim, 2 * embed_dim
    layer = "vit.encoder.layer.0."
    tensors = {
        "vit.embeddings.cls_token": torch.zeros(1, 1, d),
        "vit.embeddings.position_embeddings": torch.zeros(1, 5, d),
        "vit.embeddings.patch_embeddings.projection.weight": torch.zeros(d, 3, 16, 16),
        "vit.embeddings.patch_embeddings.projection.bias": torch.zeros(d),
        "vit.layernorm.weight": torch.ones(d),
        "vit.layernorm.bias": torch.zeros(d),
        "classifier.weight": torch.zeros(3, d),
        "classifier.bias": torch.zeros(3),
    }
    for name, shape in {
        "attention.attention.query": (d, d),
        "attention.attention.key": (d, d),
        "attention.attention.value": (d, d),
        "attention.output.dense": (d, d),
        "intermediate.dense": (h, d),
        "output.dense": (d, h),
    }.items():
        tensors[f"{layer}{name}.weight"] = torch.zeros(shape)
        tensors[f"{layer}{name}.bias"] = torch.zeros(shape[0])
    for norm in ("layernorm_before", "layernorm_after"):
        tensors[f"{layer}{norm}.weight"], tensors[f"{layer}{norm}.bias"] = torch.ones(d), torch.zeros(d)
    return tensors


HF_CONFIG = dict(
    model_type="vit", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
    image_size=32, patch_size=16, num_channels=3, layer_norm_eps=1e-12,
)  # fmt: skip
TIMM_CONFIG = dict(
    architecture="vit_tiny_patch16_224", num_classes=10,
    model_args=dict(img_size=32, depth=1, embed_dim=16, num_heads=2), pretrained_cfg={},
)  # fmt: skip
HF_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size")
REPO_NUMBERS = itertools.count()  # one fresh repo per generated case
HUB_TESTS = Path(__file__).parents[1] / "hub"
HF_FIELDS += ("patch_size", "num_channels", "layer_norm_eps", "hidden_dropout_prob")


def hub_repo(cache: Path, tmp: Path, name: str, config: bytes, tensors: dict[str, torch.Tensor]) -> str:
    if str(HUB_TESTS) not in sys.path:  # hub_cache lives with the hub tests (found there when run together)
        sys.path.insert(0, str(HUB_TESTS))
    from hub_cache import add_repo

    weights = tmp / f"{name.replace('/', '_')}.safetensors"
    save_file(tensors, str(weights))
    add_repo(cache, name, {"config.json": config, "model.safetensors": weights})
    return f"hf-hub:{name}"


def test_clean_repos_load(cache, tmp_path) -> None:
    """The hostile cases below differ from these in one field only."""
    hf = vitrim.load_model(hub_repo(cache, tmp_path, "a/hf", json.dumps(HF_CONFIG).encode(), hf_weights()))
    assert hf.config.embed_dim == 16
    timm_tensors = vitrim.create_model("vit_tiny_patch16_224", **TINY).state_dict()
    timm = vitrim.load_model(hub_repo(cache, tmp_path, "a/timm", json.dumps(TIMM_CONFIG).encode(), timm_tensors))
    assert timm.config.num_classes == 10


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (dict(HF_CONFIG, hidden_size=0), ("hidden_size must be >= 1, got 0",)),
        (dict(HF_CONFIG, hidden_size=2**20), ("hidden_size = 1048576",)),
        (dict(HF_CONFIG, hidden_size="abc"), ("hidden_size must be an int",)),
        (dict(HF_CONFIG, layer_norm_eps=-1), ("layer_norm_eps",)),
        (dict(HF_CONFIG, hidden_size=4096, intermediate_size=8192), ("values",)),  # within the limits, not the weights
        (dict(TIMM_CONFIG, num_classes=10**9), ("num_classes = 1000000000",)),
        (dict(TIMM_CONFIG, model_args=dict(TIMM_CONFIG["model_args"], embed_dim=2**20)), ("embed_dim = 1048576",)),
        (dict(TIMM_CONFIG, num_classes=2**20), ("values",)),
        # within the limits, but not what the weights hold: refused, never a fresh head or a resampled grid
        (dict(TIMM_CONFIG, num_classes=11), ("a/hostile config.json: num_classes = 11, but the weights hold a 10",)),
        (dict(TIMM_CONFIG, model_args=dict(TIMM_CONFIG["model_args"], img_size=64)), ("pos_embed has 5",)),
        (dict(HF_CONFIG, image_size=64), ("image_size", "pos_embed has 5")),
        # issue 45: timm's model_args of the wrong type, in vitrim's words (was: "'int' object is not iterable")
        (dict(TIMM_CONFIG, model_args=5), ("a/hostile config.json: model_args must be an object", "got 5")),
        (dict(TIMM_CONFIG, model_args="ab"), ("model_args must be an object", "'ab'")),
        (dict(TIMM_CONFIG, model_args=[["depth", 1]]), ("model_args must be an object", "[['depth', 1]]")),
    ],
)
def test_hub_config_sizes_are_bounded(cache, tmp_path, bounded_memory, config, words) -> None:
    tensors = (
        hf_weights() if "model_type" in config else vitrim.create_model("vit_tiny_patch16_224", **TINY).state_dict()
    )
    name = hub_repo(cache, tmp_path, "a/hostile", json.dumps(config).encode(), tensors)
    with pytest.raises(ValueError) as err:
        vitrim.load_model(name)
    assert_clear(err.value, *words)


@pytest.mark.parametrize("text", [b"[" * 100000 + b"]" * 100000, b'{"model_type": "vit", "hidden_size": Infinity}'])
def test_hub_config_json_is_read_as_data(cache, tmp_path, text) -> None:
    with pytest.raises(ValueError) as err:
        vitrim.load_model(hub_repo(cache, tmp_path, "a/json", text, hf_weights()))
    assert_clear(err.value, "nested", "Infinity")


@FAST
@given(layout=st.sampled_from(["hf", "timm"]), index=st.integers(0, 20), value=HOSTILE_NUMBERS)
@example(layout="hf", index=4, value=16)  # image_size 16 beside a 32 px pos_embed: once named as vitrim's img_size only
def test_fuzz_hub_configs(cache, tmp_path, bounded_memory, layout, index, value) -> None:
    if layout == "hf":
        field = HF_FIELDS[index % len(HF_FIELDS)]
        config, tensors = dict(HF_CONFIG, **{field: value}), hf_weights()
    else:
        field = ("num_classes", *TIMM_CONFIG["model_args"], "mlp_ratio", "reg_tokens")[index % 7]
        args = dict(TIMM_CONFIG["model_args"])
        config = dict(TIMM_CONFIG, num_classes=value) if field == "num_classes" else dict(TIMM_CONFIG, model_args=args)
        args[field] = value
        tensors = vitrim.create_model("vit_tiny_patch16_224", **TINY).state_dict()
    name = hub_repo(cache, tmp_path, f"f/{layout}-{next(REPO_NUMBERS)}", json.dumps(config).encode(), tensors)
    try:
        model = vitrim.load_model(name)
    except CLEAR as err:
        assert_clear(err, field, "mlp_ratio", "does not fit", "divisible", "disagree", "values")
        return
    held = sum(t.numel() for t in tensors.values())
    assert sum(p.numel() for p in model.parameters()) <= held + config_limits.MAX_FRESH_VALUES
    if layout == "timm":
        assert_loaded_as_saved(model, tensors)


def test_shard_index_names_no_path_outside_its_folder(tmp_path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG))
    index = {"weight_map": {"vit.embeddings.cls_token": "../../outside.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="expected a file name beside the index"):
        vitrim.load_model(folder)


# -- vitrim.optimize --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return vitrim.create_model("vit_tiny_patch16_224", img_size=32, depth=1, embed_dim=16, num_heads=2).eval()


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (dict(img_size=33), ValueError, "img_size 33 is not divisible"),
        (dict(img_size="32"), ValueError, "img_size must be an int or a pair"),
        (dict(img_size=(32, 32, 3)), ValueError, "img_size must be an int or a pair"),
        (dict(backend="nope"), ValueError, "backend must be a torch.compile backend"),
        (dict(device="tpu"), ValueError, "device must be cpu, cuda"),
        (dict(batch_size=0), ValueError, "batch_size"),
    ],
)
def test_optimize_refuses_bad_arguments_before_compiling(tiny, kwargs, error, words) -> None:
    with pytest.raises(error) as err:
        vitrim.optimize(tiny, **{"batch_size": 1, **kwargs})
    assert_clear(err.value, words)


def test_optimize_accepts_cpu_0_and_refuses_bad_inputs_in_one_line(tiny) -> None:
    fast = vitrim.optimize(tiny, batch_size=1, device="cpu:0", backend="eager")
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(fast(x), tiny(x))  # the eager model is the reference
    for bad, error, words in [
        (x.double(), TypeError, "dtype torch.float64"),
        (x.long(), TypeError, "dtype torch.int64"),
        (torch.randn(2, 3, 32, 32), ValueError, "optimized for (1, 3, 32, 32)"),
        ("x", TypeError, "images must be a torch.Tensor"),
    ]:
        with pytest.raises(error) as err:
            fast(bad)
        assert_clear(err.value, words)


# -- relevance targets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ({0: 1}, TypeError),
        (10**20, ValueError),
        (-1, ValueError),
        ([0], ValueError),
        ([0, 10**20], ValueError),
        ("0", TypeError),
        ([0.5, 1], TypeError),
        (torch.tensor([0.0, 1.0]), ValueError),
        (True, TypeError),
    ],
)
def test_relevance_target_is_checked(tiny, target, error) -> None:
    with pytest.raises(error) as err:
        vitrim.viz.relevance(tiny, torch.randn(2, 3, 32, 32), target=target)
    assert_clear(err.value, "target")


@FAST
@given(target=st.one_of(st.integers(-(2**70), 2**70), st.lists(st.integers(-(2**70), 2**70), max_size=3)))
def test_fuzz_relevance_target(tiny, target) -> None:
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    try:
        rel = vitrim.viz.relevance(tiny, images, target=target, method="rollout")
    except CLEAR as err:
        assert_clear(err, "target")
        return
    assert rel.shape == (2, 2, 2) and torch.isfinite(rel).all()


# -- CLI: a failing call's error is the only line on stderr -------------------------------------------------------


@pytest.mark.full  # an ONNX export: ~40 s on the loaded 2-core machine
def test_export_with_an_unreachable_opset_prints_one_line(saved, tmp_path) -> None:
    pytest.importorskip("onnxscript")
    tensors, metadata = saved
    checkpoint = tmp_path / "m.safetensors"
    save_file(tensors, str(checkpoint), metadata=metadata)
    run = subprocess.run(
        [
            *(sys.executable, "-c", "from vitrim.cli import main; raise SystemExit(main())", "export"),
            *(str(checkpoint), "--onnx", str(tmp_path / "m.onnx"), "--opset", "3"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip()], run.stderr  # one line, no torch warnings
    assert run.stderr.startswith("vitrim: error: opset_version 3") and not (tmp_path / "m.onnx").exists()


# -- reducers named in checkpoint metadata ----------------------------------------------------------------------

REDUCER_VALUES = st.one_of(HOSTILE_NUMBERS, st.floats(allow_nan=False, allow_infinity=False), st.booleans())


def with_reducers(saved, tmp: Path, specs: object) -> Path:
    tensors, metadata = saved
    path = tmp / "reduced.safetensors"
    save_file(tensors, str(path), metadata={**metadata, "vitrim.reducers": json.dumps(specs)})
    return path


@pytest.mark.parametrize(
    ("specs", "words"),
    [
        ([{"name": "os.system", "layers": None, "options": {}}], "unknown reducer 'os.system'"),
        ([{"name": "tome", "layers": [5], "options": {"r": 2}}], "layers must be block indices in [0, 1)"),
        ([{"name": "tome", "layers": "0", "options": {"r": 2}}], "[0].layers must be null"),
        ([{"name": "tome", "layers": None, "options": {"r": -3}}], "r must be"),
        ([{"name": "tome", "layers": None, "options": {"r": {"a": 1}}}], "[0].options.r must be a number"),
        ([{"name": "pitome", "layers": None, "options": {"ratio": 0.8, "alpha": [1, 2]}}], "alpha must be"),
        ([{"name": "diffrate", "layers": None, "options": {"prune_kept": 1, "merge_kept": 1}}], "keeps no patch"),
        ({"name": "tome"}, "must be a list of"),
    ],
)
def test_reducers_in_metadata_are_checked(saved, tmp_path, specs, words) -> None:
    path = with_reducers(saved, tmp_path, specs)
    with pytest.raises(ValueError) as err:
        vitrim.load_model(path)
    assert_clear(err.value, words)
    assert "metadata vitrim.reducers" in str(err.value) and str(path) in str(err.value), err.value


@FAST
@given(
    name=st.sampled_from(vitrim.reduce.list_reducers()),
    option=st.integers(0, 5),
    value=REDUCER_VALUES,
    layers=st.one_of(st.none(), HOSTILE_NUMBERS),
)
def test_fuzz_reducers_in_metadata(saved, tmp_path, name, option, value, layers) -> None:
    """Any value in any option of any reducer: one clear error naming the metadata, or a model that runs."""
    from vitrim.reduce.api import reducer_options
    from vitrim.reduce.registry import get_reducer

    options = dict(get_reducer(name).example_options or {})
    names = list(reducer_options(name))
    if names:
        options[names[option % len(names)]] = value
    path = with_reducers(saved, tmp_path, [{"name": name, "layers": layers, "options": options}])
    try:
        model = vitrim.load_model(path)
    except ValueError as err:  # the record itself, or a learned reducer (DynamicViT) whose modules the weights lack
        assert_clear(err, "metadata vitrim.reducers", "the weights lack")
        return
    assert torch.isfinite(model(torch.randn(2, 3, 32, 32))).all()


# -- other files a run folder holds -----------------------------------------------------------------------------


def test_teacher_metadata_is_bounded_like_any_config(saved, tmp_path, bounded_memory) -> None:
    """A teacher's config gives the student its sizes: read as data and bounded before the student is built."""
    from vitrim.train.teacher import teacher_architecture
    from vitrim.weights.formats import read_checkpoint

    config = json.loads(saved[1]["vitrim.config"])
    assert teacher_architecture(read_checkpoint(with_config(saved, tmp_path, json.dumps(config))))["embed_dim"] == 16
    for text, words in [(json.dumps(config | {"embed_dim": 2**20}), "embed_dim = 1048576"), ("[" * 10**5, "nested")]:
        with pytest.raises(ValueError) as err:
            teacher_architecture(read_checkpoint(with_config(saved, tmp_path, text)))
        assert_clear(err.value, words)
        assert "teacher" in str(err.value)


def test_metrics_lines_that_are_not_records_are_dropped(tmp_path) -> None:
    """Resuming keeps the metric lines of finished epochs; a torn, hostile or odd line is dropped, never a crash."""
    from vitrim.train.loop import _truncate_metrics

    path = tmp_path / "metrics.jsonl"
    lines = ['{"epoch": 1}', "[" * 100000, '{"epoch": "2"}', "[]", '{"epoch": 2}', '{"epoch": 3}', '{"epo']
    path.write_text("\n".join(lines) + "\n")
    _truncate_metrics(path, epochs_done=2)
    assert path.read_text() == '{"epoch": 1}\n{"epoch": 2}\n'


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"class_token": -5}, "class_token must be true or false"),
        ({"distilled": "x"}, "distilled must be true or false"),
    ],
)
def test_checkpoint_metadata_flags_are_booleans(saved, tmp_path, changes, words) -> None:
    """Found by a sweep: `class_token: -5` counted -5 prefix tokens (a torch error), `distilled: "x"` met int()."""
    with pytest.raises(ValueError) as err:
        vitrim.load_model(with_config(saved, tmp_path, json.dumps(json.loads(saved[1]["vitrim.config"]) | changes)))
    assert_clear(err.value, words)


@pytest.mark.parametrize("changes", [{"hidden_act": [0, 0]}, {"model_type": [1]}])
def test_hub_config_strings_of_another_type(cache, tmp_path, changes) -> None:
    """Found by a sweep: a list where a string belongs was 'unhashable type: list'."""
    name = hub_repo(cache, tmp_path, "a/types", json.dumps(HF_CONFIG | changes).encode(), hf_weights())
    with pytest.raises(ValueError) as err:
        vitrim.load_model(name)
    assert_clear(err.value, "hidden_act", "model_type")

"""The project fuzzes itself: generated bad and edge-case inputs for the attention function, MultiHeadAttention,
every registered model, every reducer's options and the checkpoint loader. The contract: a ValueError / TypeError /
FileNotFoundError whose message names the argument, or a finite, correct result; never anything else, and never a
file created by a pickle. Bounded (max_examples) so the suite stays fast."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import vitrim

CLEAR = (ValueError, TypeError, FileNotFoundError)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def names_one_of(err: BaseException, words: tuple[str, ...]) -> bool:
    text = str(err)
    return any(word in text for word in words)


# -- the attention function --------------------------------------------------------------------------------------

ATTENTION_ARGS = ("q", "k", "v", "mask", "keep_policy", "scale", "dropout_p", "backend", "is_causal", "E", "Lk")
dims = st.integers(min_value=0, max_value=4)


@FAST
@given(
    B=st.integers(1, 3),
    H=dims,
    Lq=dims,
    Lk=dims,
    E=st.integers(1, 4),
    Ev=dims,
    Ek=st.integers(1, 5),
    mask_kind=st.sampled_from(["none", "bool", "float", "int", "wrong-shape", "row"]),
    policy_kind=st.sampled_from(["none", "ok", "out-of-range", "wrong-shape", "bool"]),
    # any bad scale (NaN, ±inf, 0, negative) must be refused; a finite one so large that q·kᵀ·scale overflows
    # float32 gives what torch's own kernel gives (non-finite), so valid scales are drawn from a sane range
    scale=st.one_of(
        st.none(), st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -float("inf")]), st.floats(1e-6, 1e6)
    ),
    backend=st.sampled_from(["auto", "math", "fused", "flash"]),
    need_weights=st.booleans(),
    is_causal=st.booleans(),
    dropout=st.sampled_from([0.0, 0.5, 1.0, -0.1]),
)
def test_attention_function(
    B, H, Lq, Lk, E, Ev, Ek, mask_kind, policy_kind, scale, backend, need_weights, is_causal, dropout
):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, E, generator=g)
    k = torch.randn(B, H, Lk, Ek, generator=g)
    v = torch.randn(B, H, Lk, Ev, generator=g)
    mask = {
        "none": None,
        "bool": torch.rand(Lq, Lk, generator=g) > 0.3,
        "float": torch.randn(Lq, Lk, generator=g),
        "int": torch.ones(Lq, Lk, dtype=torch.int64),
        "wrong-shape": torch.ones(Lq + 1, Lk + 2, dtype=torch.bool),
        "row": torch.ones(Lk, dtype=torch.bool),
    }[mask_kind]
    policy = {
        "none": None,
        "ok": torch.rand(B, Lk, generator=g),
        "out-of-range": torch.full((B, Lk), 2.0),
        "wrong-shape": torch.ones(B, Lk + 1),
        "bool": torch.rand(B, Lk, generator=g) > 0.5,
    }[policy_kind]
    try:
        out, _ = vitrim.scaled_dot_product_attention(
            q,
            k,
            v,
            mask,
            is_causal=is_causal,
            scale=scale,
            keep_policy=policy,
            dropout_p=dropout,
            need_weights=need_weights,
            backend=backend,
        )
    except CLEAR as err:
        assert names_one_of(err, ATTENTION_ARGS), err
        return
    assert out.shape == (B, H, Lq, Ev) and bool(torch.isfinite(out).all())
    if dropout == 0.0 and backend != "fused":  # the two kernels agree whenever both are allowed
        fused, _ = vitrim.scaled_dot_product_attention(
            q, k, v, mask, is_causal=is_causal, scale=scale, keep_policy=policy, backend="fused"
        )
        torch.testing.assert_close(out, fused, rtol=1e-4, atol=1e-5)


@FAST
@given(dim=st.integers(-2, 12), heads=st.integers(-1, 5), L=dims, width=st.integers(0, 12))
def test_multi_head_attention(dim: int, heads: int, L: int, width: int) -> None:
    try:
        mha = vitrim.MultiHeadAttention(dim, heads)
        out, _ = mha(torch.randn(2, L, width))
    except CLEAR as err:
        assert names_one_of(err, ("dim", "num_heads", "x must have shape")), err
        return
    assert out.shape == (2, L, dim) and bool(torch.isfinite(out).all())


# -- every registered model ----------------------------------------------------------------------------------------

MODELS = vitrim.list_models()


@pytest.fixture(scope="module")
def tiny_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    built = {}
    for name in MODELS:
        small = {} if name.startswith("cnn") else dict(embed_dim=32, num_heads=2, depth=4)
        built[name] = vitrim.create_model(name, **small, num_classes=3).eval()
    return built


@FAST
@given(
    name=st.sampled_from(MODELS),
    batch=st.integers(0, 2),
    chans=st.integers(0, 4),
    side=st.integers(0, 70),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.uint8, torch.int64, torch.bool]),
    rank=st.sampled_from([3, 4, 5]),
)
def test_every_model_with_any_image_batch(tiny_models, name, batch, chans, side, dtype, rank):  # type: ignore[no-untyped-def]
    model = tiny_models[name]
    shape = (batch, chans, side, side)[:rank] if rank <= 4 else (1, batch, chans, side, side)
    images = torch.zeros(shape, dtype=dtype)
    try:
        with torch.no_grad():
            logits = model(images)
    except CLEAR as err:
        assert names_one_of(err, ("images", "image height", "image width", "channels")), err
        return
    assert logits.shape == (batch, 3) and bool(torch.isfinite(logits).all())


# -- every reducer's options ---------------------------------------------------------------------------------------

option_values = st.one_of(
    st.integers(-3, 20),
    st.floats(-1, 2),
    st.just(float("nan")),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.lists(st.integers(-1, 5), max_size=5),
    st.tuples(st.integers(0, 4), st.floats(-2, 2)),
)


@FAST
@given(
    reducer=st.sampled_from(vitrim.reduce.list_reducers()),
    options=st.dictionaries(
        st.sampled_from(["r", "keep_rate", "keep_ratio", "layers", "prop_attn", "trace_source", "bogus"]),
        option_values,
        max_size=3,
    ),
)
def test_every_reducer_with_any_options(reducer: str, options: dict[str, object]) -> None:
    torch.manual_seed(0)
    model = vitrim.create_model("vit_tiny_patch16_224", embed_dim=32, depth=4, num_heads=2, img_size=32, num_classes=3)
    try:
        vitrim.reduce.apply(model.eval(), reducer, **options)
    except CLEAR as err:
        allowed = (*vitrim.reduce.reducer_options(reducer), "option", "reducer", "layers", "keep")
        assert names_one_of(err, allowed), err
        assert all(b.reducer is None for b in model.blocks)  # nothing half-applied
        return
    with torch.no_grad():
        out = model.forward_detailed(torch.randn(2, 3, 32, 32))
    assert bool(torch.isfinite(out.logits).all())


# -- the checkpoint loader -----------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _files(tmp: Path, seed: int) -> dict[str, Path]:
    torch.manual_seed(seed)
    model = vitrim.create_model("vit_tiny_patch16_224", embed_dim=32, depth=1, num_heads=2, img_size=32)
    good = vitrim.save_checkpoint(model, tmp / "good.safetensors")
    data = good.read_bytes()
    made: dict[str, Path] = {"good": good}

    def write(name: str, payload: bytes) -> None:
        made[name] = tmp / name
        made[name].write_bytes(payload)

    write("empty.safetensors", b"")
    write(
        "random.bin",
        torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(seed)).byte().numpy().tobytes(),
    )
    write("truncated.safetensors", data[: len(data) // (seed % 5 + 2)])
    write("archive.gz", gzip.compress(b"not a checkpoint"))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02garbage")
    write("junk.zip", buf.getvalue())
    write("evil.pth", pickle.dumps({"model": _Evil(tmp / "PWNED")}))
    save_file(
        {"w": torch.zeros(1)},
        str(tmp / "outside.safetensors"),
        metadata={"vitrim.class": "os:system", "vitrim.config": "{}"},
    )
    made["outside"] = tmp / "outside.safetensors"
    save_file(
        dict(model.state_dict()),
        str(tmp / "badcfg.safetensors"),
        metadata={"vitrim.class": "vitrim.models.vit:VisionTransformer", "vitrim.config": json.dumps({"depth": -1})},
    )
    made["badcfg"] = tmp / "badcfg.safetensors"
    (tmp / "folder").mkdir(exist_ok=True)
    made["folder"] = tmp / "folder"
    made["missing"] = tmp / "missing.safetensors"
    return made


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000))
def test_checkpoint_loader_with_any_file(tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    tmp = tmp_path_factory.mktemp("ckpt")
    files = _files(tmp, seed)
    model = vitrim.create_model("vit_tiny_patch16_224", embed_dim=32, depth=1, num_heads=2, img_size=32)
    # load_checkpoint reads weights only: a bad config in the metadata is no reason to refuse them
    loadable = {"load_model": {"good"}, "load_checkpoint": {"good", "badcfg"}}
    for name, path in files.items():
        for how, load in (
            ("load_model", vitrim.load_model),
            ("load_checkpoint", lambda p: vitrim.load_checkpoint(model, p)),
        ):
            try:
                load(path)
            except CLEAR as err:
                assert name not in loadable[how], err
                assert str(path.name) in str(err) or "vitrim" in str(err) or "depth" in str(err), err
            else:
                assert name in loadable[how], f"{how} loaded {name}"
    assert not (tmp / "PWNED").exists()  # no pickle ever ran


# -- issue 45: what was left of the data and hub surfaces ----------------------------------------------------------


@pytest.mark.parametrize("name", [5, None, ["vit_tiny_patch16_224"], 2.5, b"vit_tiny_patch16_224", Path("vit")])
@pytest.mark.parametrize("pretrained", [False, True])
def test_create_model_names_a_name_that_is_no_string(name: object, pretrained: bool) -> None:
    with pytest.raises(TypeError, match=r"^name must be a model name .* \(a str\), got ") as err:
        vitrim.create_model(name, pretrained=pretrained)  # type: ignore[arg-type]
    assert type(name).__name__ in str(err.value) and repr(name)[:40] in str(err.value)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(mean=(1e308,) * 3), ("mean 1e+308", "inf and 0.5 in float32")),  # was: a transform of inf, exit 0
        (dict(mean=(0.5,) * 3, std=(1e-50,) * 3), ("std 1e-50", "0.0 in float32")),  # positive, 0 in float32
        (dict(mean=(0.5,) * 3, std=(1e300,) * 3), ("std 1e+300", "inf in float32")),  # every pixel would be 0
        (dict(mean=(1e30,) * 3, std=(1e-10,) * 3), ("mean 1e+30 and std 1e-10", "overflow float32")),
    ],
)
def test_a_data_config_whose_transform_is_not_finite_in_float32_is_refused(fields, words) -> None:
    from vitrim.models.data_config import DataConfig

    with pytest.raises(ValueError) as err:
        DataConfig(**fields)
    assert all(word in str(err.value) for word in words) and "\n" not in str(err.value), str(err.value)


def float32_normalised(mean: float, std: float) -> torch.Tensor:
    """What torchvision's Normalize makes of the darkest and the brightest pixel, in float32."""
    return (torch.tensor([0.0, 1.0]) - torch.tensor(mean, dtype=torch.float32)) / torch.tensor(std, dtype=torch.float32)


def check_mean_and_std(mean: float, std: float) -> None:
    """A data config of this mean and std gives finite normalised pixels in float32, or is refused naming them."""
    from vitrim.models.data_config import DataConfig

    try:
        config = DataConfig(input_size=(1, 8, 8), mean=(mean,), std=(std,))
    except ValueError as err:
        assert ("mean" in str(err) or "std" in str(err)) and "float32" in str(err), str(err)
        return
    assert torch.isfinite(float32_normalised(*config.mean, *config.std)).all()


MEANS = st.floats(allow_nan=False, allow_infinity=False)
STDS = st.floats(min_value=0.0, exclude_min=True, allow_infinity=False)


@FAST
@given(mean=MEANS, std=STDS)
def test_any_finite_mean_and_std_give_a_finite_transform_or_a_clear_error(mean: float, std: float) -> None:
    check_mean_and_std(mean, std)


@pytest.mark.full
@settings(max_examples=500, deadline=None)
@given(mean=MEANS, std=STDS)
def test_any_finite_mean_and_std_many_more(mean: float, std: float) -> None:
    check_mean_and_std(mean, std)


def test_a_border_resize_of_a_thin_image_keeps_it_one_pixel_high() -> None:
    """A 2000x3 line fitted into 224 px shrinks to 224x0.34: it rounded to 0 px (torchvision's error); timm keeps it,
    a line one pixel high in the middle of the mean-coloured pad."""
    PIL = pytest.importorskip("PIL.Image")
    from vitrim.data.transforms import eval_transform
    from vitrim.models.data_config import DataConfig

    config = DataConfig(crop_mode="border", crop_pct=1.0, mean=(0.5,) * 3, std=(0.5,) * 3)
    out = eval_transform(config)(PIL.new("RGB", (2000, 3), (255, 255, 255)))
    assert out.shape == (3, 224, 224)
    pad = (round(255 * 0.5) / 255 - 0.5) / 0.5  # the fill colour, normalised
    line = (out == 1.0).all(0).all(1)  # rows that are white (normalised 1) across the whole width
    assert line.sum() == 1 and torch.allclose(out[:, ~line], torch.full_like(out[:, ~line], pad), atol=1e-6)
    # the pixel guard measures the resize border mode makes (to fit inside), not the covering one of "center": a
    # 20000x1 line shrinks to 224x1, where covering would be 4,480,000x224 and refused as a decompression bomb
    assert eval_transform(config)(PIL.new("RGB", (20000, 1), (255, 255, 255))).shape == (3, 224, 224)


@pytest.mark.parametrize(
    ("rank", "world_size", "words"),
    [
        (0, 0, "world_size must be an int >= 1 (the processes that share the data), got 0"),
        (0, -2, "world_size must be an int >= 1"),
        (0, 2.0, "world_size must be an int >= 1"),
        (2, 2, "rank must be an int in [0, 1] (world_size 2), got 2"),
        (-1, 2, "rank must be an int in [0, 1]"),
        ("0", 1, "rank must be an int in [0, 0]"),
    ],
)
def test_ranks_and_world_sizes_are_checked_where_they_enter(rank, world_size, words) -> None:
    from vitrim.data import build_datasets
    from vitrim.data.shards import shards_for
    from vitrim.models.data_config import DataConfig

    with pytest.raises(ValueError) as err:  # was: "slice step cannot be zero" on the first batch
        shards_for(4, rank=rank, world_size=world_size, worker=0, num_workers=1, epoch=0, seed=0, shuffle=False)
    assert words in str(err.value)
    with pytest.raises(ValueError) as err:
        build_datasets("shards/x-{0..3}.tar", data_config=DataConfig(), rank=rank, world_size=world_size)
    assert words in str(err.value)


@pytest.mark.parametrize("fraction", ["0.2", None, [0.2], True, 0, 1, 1.5, float("nan")])
def test_test_fraction_of_any_wrong_type_or_range_is_named(fraction: object) -> None:
    from vitrim.data import build_datasets
    from vitrim.data.digits import DigitsCanvas
    from vitrim.data.numbers import split_numbers
    from vitrim.models.data_config import DataConfig

    calls = [
        lambda: DigitsCanvas("train", test_fraction=fraction),
        lambda: split_numbers(100, fraction, 0),  # type: ignore[arg-type]
        lambda: build_datasets("no/such/folder", data_config=DataConfig(), test_fraction=fraction),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^test_fraction must be a number in \(0, 1\), got ") as err:
            call()
        assert repr(fraction)[:20] in str(err.value)

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

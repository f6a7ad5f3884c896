"""The data files vitrim reads fuzz themselves: hostile ``run.json`` records, ``_info.json`` files, tar shards,
images, folders and data configs. The contract: one ValueError / TypeError / FileNotFoundError of one line, or a
result that holds what the file may say (labels within the classes, counts >= 0, only regular files inside the root,
finite pixels); never another exception, a hang, or a command run. Bounded so the suite stays fast."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[1] / "datasets"))
from generated import IDENTITY_PIXELS, png_bytes

from vitrim.data import ImageFolder, ShardDataset, ShardSource, check_data, eval_transform
from vitrim.data.shards import check_local
from vitrim.data.transforms import read_image_for
from vitrim.models.data_config import DataConfig
from vitrim.train.state import check_run_record

CLEAR = (ValueError, TypeError, FileNotFoundError)
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
COMMANDS = st.sampled_from(
    ["pipe:touch {m}; echo a/x.tar", "x.tar::pipe:touch {m}; echo b/x.tar", "-", "http://h/a.tar"]
)


def one_clear_line(err: BaseException) -> None:
    assert isinstance(err, CLEAR), repr(err)
    assert str(err) and "\n" not in str(err), repr(err)


@FAST
@given(
    record=st.dictionaries(
        st.sampled_from(["data", "val_data", "seed", "test_fraction", "noise", "align", "data_config", "model", "x"]),
        JSON | COMMANDS,
        max_size=4,
    )
    | JSON
)
def test_run_records(tmp_path_factory: pytest.TempPathFactory, record: object) -> None:
    marker = tmp_path_factory.mktemp("run") / "PWNED"
    if isinstance(record, dict):
        record = {k: v.replace("{m}", str(marker)) if isinstance(v, str) else v for k, v in record.items()}
    try:
        checked = check_run_record(record, "run.json")
    except Exception as err:  # the contract is on the kind and shape of any error
        one_clear_line(err)
    else:
        assert isinstance(checked, dict)
        for name in ("data", "val_data"):
            if checked.get(name) is not None:
                try:  # what eval does with a record's data: refuse what is not local, then open it
                    check_local(checked[name], name)
                    check_data(checked[name])
                except Exception as err:
                    one_clear_line(err)
    assert not marker.exists()  # whatever passed the check, nothing ran it


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    with tarfile.open(folder / "s-000000.tar", "w") as tar:
        for sample_id, label in enumerate([0, 1, 5, -1]):
            for name, payload in [
                (f"{sample_id:03d}.png", png_bytes(sample_id, 0)),
                (f"{sample_id:03d}.cls", b"%d" % label),
            ]:
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return folder


INFO = st.dictionaries(
    st.sampled_from(["classes", "num_classes", "splits"]),
    JSON
    | st.fixed_dictionaries(
        {
            "t": st.fixed_dictionaries(
                {"filenames": st.just(["s-000000.tar"]), "shard_lengths": st.lists(SCALARS, max_size=2)}
            )
        }
    ),
    max_size=3,
)


@FAST
@given(
    info=INFO | JSON, damage=st.one_of(st.none(), st.tuples(st.integers(0, 3000), st.binary(min_size=1, max_size=8)))
)
def test_info_json_and_shards(shard_folder: Path, info: object, damage: tuple[int, bytes] | None) -> None:
    shard = shard_folder / "s-000000.tar"
    original = shard.read_bytes()
    (shard_folder / "_info.json").write_text(json.dumps(info))
    if damage is not None:
        at, junk = damage
        shard.write_bytes(original[:at] + junk + original[at + len(junk) :])
    try:
        try:
            source = ShardSource.parse(str(shard))
        except Exception as err:
            one_clear_line(err)
            return
        assert source.num_samples >= 0 and len(source.classes) >= 1
        for sample in ShardDataset(source, eval_transform(IDENTITY_PIXELS), "RGB"):
            if sample is not None:
                image, label = sample
                assert 0 <= label < len(source.classes) and torch.isfinite(image).all()
    finally:
        shard.write_bytes(original)


@FAST
@given(
    cut=st.integers(0, 200),
    at=st.integers(0, 200),
    junk=st.binary(max_size=8),
    width=st.integers(1, 64) | st.integers(10_000, 70_000),  # small, or wide enough for a bomb once squared
    height=st.integers(1, 64) | st.integers(10_000, 70_000),
)
def test_images(
    tmp_path_factory: pytest.TempPathFactory, cut: int, at: int, junk: bytes, width: int, height: int
) -> None:
    data = bytearray(png_bytes(1, 1, size=16))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")  # the header's size
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # with its checksum, so Pillow reads on
    data[at : at + len(junk)] = junk
    path = tmp_path_factory.mktemp("img") / "x.png"
    path.write_bytes(bytes(data[: len(data) - cut]))
    try:
        tensor = read_image_for(path, IDENTITY_PIXELS, name="--image")
    except Exception as err:
        one_clear_line(err)
    else:
        assert tensor.shape == (3, 8, 8) and torch.isfinite(tensor).all()


ENTRY = st.tuples(
    st.sampled_from(["a", "b", "a/sub", "b/sub"]),
    st.sampled_from(["x.png", "y.PNG", "up", "loop.png", "\udcff.png"]),
    st.sampled_from(["png", "junk", "dir", "link_up", "link_root", "link_out", "fifo"]),
)


@FAST
@given(entries=st.lists(ENTRY, max_size=8))
def test_folders(tmp_path_factory: pytest.TempPathFactory, entries: list[tuple[str, str, str]]) -> None:
    tmp = tmp_path_factory.mktemp("folder")
    root = tmp / "data"
    (tmp / "outside").mkdir()
    (tmp / "outside" / "o.png").write_bytes(png_bytes(0, 0))
    made = 0
    for folder, name, kind in entries:
        parent = root / folder
        parent.mkdir(parents=True, exist_ok=True)
        path = parent / name
        if path.exists() or path.is_symlink():
            continue
        try:
            if kind == "png" or kind == "junk":
                path.write_bytes(png_bytes(made, 0) if kind == "png" else b"junk")
                made += 1
            elif kind == "dir":
                path.mkdir()
            elif kind == "fifo":
                os.mkfifo(path)
            else:
                path.symlink_to({"link_up": "..", "link_root": root, "link_out": tmp / "outside"}[kind])
        except (OSError, UnicodeError):
            continue  # a file system that refuses a byte name
    try:
        dataset = ImageFolder.of_class_folders(root, eval_transform(IDENTITY_PIXELS), "RGB")
    except Exception as err:
        one_clear_line(err)
        return
    assert len(dataset) <= made  # no file twice, none from outside the root
    for index in range(len(dataset)):
        path = Path(dataset.root) / dataset.files[index].decode()
        assert path.is_file() and str(path.resolve()).startswith(str(root.resolve()))
        sample = dataset[index]
        assert sample is None or torch.isfinite(sample[0]).all()


SIZES = st.integers(-2, 10**7) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=3) | st.none()
PROCESSOR = st.fixed_dictionaries(
    {},
    optional={
        "size": SIZES | st.dictionaries(st.sampled_from(["height", "width", "shortest_edge"]), SIZES, max_size=2),
        "crop_size": SIZES | st.dictionaries(st.sampled_from(["height", "width"]), SIZES, max_size=2),
        "do_center_crop": st.booleans() | SCALARS,
        "image_mean": st.lists(SCALARS, max_size=4) | SCALARS,
        "image_std": st.lists(SCALARS, max_size=4) | SCALARS,
        "resample": st.integers(-1, 6) | SCALARS,
        "do_normalize": SCALARS,
    },
)
TIMM = st.fixed_dictionaries(
    {},
    optional={
        "input_size": st.lists(SIZES, max_size=4) | SIZES,
        "mean": st.lists(SCALARS, max_size=4),
        "std": st.lists(SCALARS, max_size=4),
        "crop_pct": SIZES,
        "interpolation": st.sampled_from(["bicubic", "nope"]) | SCALARS,
        "crop_mode": st.sampled_from(["center", "border", "x"]) | SCALARS,
    },
)


@settings(max_examples=60, deadline=None)
@given(processor=PROCESSOR, timm=TIMM)
def test_data_configs(processor: dict, timm: dict) -> None:
    for build in (lambda: DataConfig.from_transformers(processor), lambda: DataConfig.from_timm(timm)):
        try:
            config = build()
        except Exception as err:
            one_clear_line(err)
            continue
        channels, height, width = config.input_size
        resized = max(height, width) / config.crop_pct
        assert all(v == v and abs(v) < float("inf") for v in config.mean + config.std) and min(config.std) > 0
        if channels in (1, 3) and max(height, width) <= 64 and resized <= 256:  # small enough to run here
            from PIL import Image

            tensor = eval_transform(config)(Image.new("RGB", (20, 13), (10, 200, 30)))
            assert tensor.shape == config.input_size and torch.isfinite(tensor).all()

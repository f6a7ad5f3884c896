"""Issue 45, run folders: ``vitrim vlm ask --run DIR`` reads a folder someone else wrote (config.json and
model.safetensors), so each hostile file ends in one ValueError naming the file and the field, never in Python's,
torch's or transformers' words, never in an allocation the weights do not justify, never in an empty answer.

A tiny digits VLM is saved here; each case rewrites one thing of it and loads it through
:func:`vitrim.demos.vlm.run_folder.load_digits_vlm` (and once through the command), under an address-space limit that
would turn any large allocation into a crash."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

from vitrim.cli import main
from vitrim.demos.vlm.demo import QUICK
from vitrim.demos.vlm.model import CONFIG_FILE, MODEL_FILE, build_model, digits_vlm_config, save_model
from vitrim.demos.vlm.run_folder import load_digits_vlm
from vitrim.demos.vlm.words import processor, split_words


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("vlm_run")
    model = build_model(digits_vlm_config(QUICK.vision, QUICK.text), seed=4)
    save_model(model, folder)
    return folder, model


def copy_run(saved: tuple[Path, torch.nn.Module], tmp: Path) -> Path:
    folder = tmp / "run"
    shutil.copytree(saved[0], folder, dirs_exist_ok=True)
    return folder


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / CONFIG_FILE).read_text())


def write_config(folder: Path, config: dict[str, Any] | str) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / CONFIG_FILE).write_text(text)


def set_field(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """``"text_config.rms_norm_eps"`` -> that field of a copy of ``config`` set to ``value``."""
    config = copy.deepcopy(config)
    *parts, last = path.split(".")
    node = config
    for part in parts:
        node = node[part]
    node[last] = value
    return config


def refused(folder: Path, *words: str) -> str:
    """The one-line ValueError the folder's load ends in, which names every one of ``words``."""
    with pytest.raises(ValueError) as caught:
        load_digits_vlm(folder)
    text = str(caught.value)
    assert "\n" not in text and all(word in text for word in words), text
    return text


def test_a_good_folder_loads_and_answers_as_the_model_saved(saved, tmp_path: Path) -> None:
    model = saved[1]
    loaded = load_digits_vlm(copy_run(saved, tmp_path))
    inputs = processor(torch.rand(2, 64, 64).numpy(), [split_words("which digit ?"), split_words("how many digits ?")])
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("text_config.rms_norm_eps", -1.0, ("rms_norm_eps", "-1.0", "(0, 1]")),
        ("text_config.rms_norm_eps", 0.0, ("rms_norm_eps", "0.0")),
        ("text_config.hidden_size", 10**9, ("hidden_size = 1000000000", "limit")),
        ("text_config.hidden_size", 4096, ("values", "the file holds")),  # within the limits, far over the weights
        ("text_config.hidden_size", "16", ("hidden_size must be an int", "'16'")),
        ("text_config.intermediate_size", 48, ("gate_proj.weight has shape [32, 16]", "makes it [48, 16]")),
        ("text_config.num_key_value_heads", 3, ("num_key_value_heads 3",)),
        ("text_config.vocab_size", 29, ("text_config.vocab_size is 29", "expected 28")),
        ("text_config", 5, ("text_config", "expected a JSON object", "int")),
        ("text_config.rope_parameters.rope_theta", -5, ("rope_theta", "-5")),
        ("vision_config.image_size", 128, ("vision_config.image_size is 128", "expected 64")),
        ("vision_config.num_attention_heads", 3, ("hidden_size 16", "num_attention_heads 3")),
        ("vision_config.num_hidden_layers", 2**30, ("num_hidden_layers = 1073741824", "limit")),
        ("vision_feature_layer", 100, ("vision_feature_layer is 100", "[-2, 1]")),
        ("vision_feature_select_strategy", "full", ("vision_feature_select_strategy is 'full'",)),
        ("projector_hidden_act", "nope", ("does not build", "nope")),
        ("image_token_index", "3", ("image_token_index is '3'", "expected 3")),
    ],
)
def test_a_hostile_config_field_is_one_line_naming_it(saved, tmp_path, bounded_memory, field, value, words) -> None:
    folder = copy_run(saved, tmp_path)
    write_config(folder, set_field(config_of(folder), field, value))
    text = refused(folder, *words)
    assert str(folder / CONFIG_FILE) in text or str(folder / MODEL_FILE) in text  # names the file


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, ("nested",)),  # Python's parser: RecursionError
        ('{"text_config": {"rms_norm_eps": NaN}}', ("non-finite", "NaN")),  # was: exit 0, an empty answer
        ("[1, 2]", ("expected a JSON object", "list")),
        ("\xff\xfe", ("not valid JSON",)),
        ("{", ("not valid JSON",)),
    ],
)
def test_a_hostile_config_file_is_one_line(saved, tmp_path: Path, text: str, words: tuple[str, ...]) -> None:
    folder = copy_run(saved, tmp_path)
    write_config(folder, text)
    refused(folder, str(folder / CONFIG_FILE), *words)


def test_truncated_weights_are_one_line(saved, tmp_path: Path) -> None:
    folder = copy_run(saved, tmp_path)
    data = (folder / MODEL_FILE).read_bytes()
    (folder / MODEL_FILE).write_bytes(data[: len(data) // 2])
    refused(folder, str(folder / MODEL_FILE), "truncated or corrupt")


@pytest.mark.parametrize("change", ["drop", "extra", "shape", "nan", "int"])
def test_weights_that_do_not_fit_are_one_line(saved, tmp_path: Path, change: str) -> None:
    folder = copy_run(saved, tmp_path)
    state = load_file(str(folder / MODEL_FILE))
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    words = {"drop": ("missing", name), "extra": ("unexpected", "surplus"), "shape": (name, "shape [16, 31]"),
             "nan": (name, "non-finite"), "int": (name, "torch.int64", "floating-point")}[change]  # fmt: skip
    if change == "drop":
        del state[name]
    elif change == "extra":
        state["surplus"] = torch.zeros(3)
    elif change == "shape":
        state[name] = state[name][:, :31].contiguous()
    elif change == "nan":
        state[name] = state[name].clone()
        state[name][0, 0] = math.nan
    else:
        state[name] = torch.ones_like(state[name], dtype=torch.int64)
    save_file(state, str(folder / MODEL_FILE))
    refused(folder, str(folder / MODEL_FILE), *words)


def test_a_config_whose_model_answers_nan_is_refused(saved, tmp_path: Path) -> None:
    """Finite weights within every limit can still make no model: a final norm of 3e38 overflows every logit. The
    check is behavioural (a blank canvas must get finite logits), so it holds for whatever makes the answers NaN."""
    folder = copy_run(saved, tmp_path)
    state = load_file(str(folder / MODEL_FILE))
    state["model.language_model.norm.weight"] = torch.full_like(state["model.language_model.norm.weight"], 3e38)
    save_file(state, str(folder / MODEL_FILE))
    refused(folder, "non-finite logits")


def test_the_command_says_it_in_one_line(saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    PIL = pytest.importorskip("PIL.Image")
    folder = copy_run(saved, tmp_path)
    write_config(folder, set_field(config_of(folder), "text_config.hidden_size", 10**9))
    image = tmp_path / "digit.png"
    PIL.new("L", (64, 64)).save(image)
    capsys.readouterr()
    assert main(["vlm", "ask", "how many digits ?", "--image", str(image), "--run", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vitrim: error: ") and "hidden_size = 1000000000" in err, err


CONFIG_FIELDS = [
    "text_config.hidden_size", "text_config.intermediate_size", "text_config.num_hidden_layers",
    "text_config.num_attention_heads", "text_config.num_key_value_heads", "text_config.head_dim",
    "text_config.rms_norm_eps", "text_config.max_position_embeddings", "text_config.vocab_size",
    "text_config.hidden_act", "text_config.rope_parameters", "vision_config.hidden_size",
    "vision_config.intermediate_size", "vision_config.num_hidden_layers", "vision_config.num_attention_heads",
    "vision_config.layer_norm_eps", "vision_config.hidden_act", "vision_config.patch_size", "vision_feature_layer",
    "projector_hidden_act", "image_seq_length", "model_type", "text_config.model_type",
]  # fmt: skip
HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 10**9, 2**40, True, None, "64", "gelu", "llama", [], {}, 1e-300, 0.5, 1e30]),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
)


@pytest.mark.full
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(CONFIG_FIELDS), value=HOSTILE)
def test_any_one_field_loads_a_working_model_or_is_one_clear_line(saved, tmp_path_factory, field, value) -> None:
    folder = copy_run(saved, tmp_path_factory.mktemp("fuzz"))
    write_config(folder, set_field(config_of(folder), field, value))
    try:
        model = load_digits_vlm(folder)
    except ValueError as err:
        assert "\n" not in str(err) and (str(folder) in str(err)), str(err)
        return
    inputs = processor(torch.rand(1, 64, 64).numpy(), [split_words("how many digits ?")])
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()  # loaded: it answers

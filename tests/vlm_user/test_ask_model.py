"""``vitrim vlm ask --model FOLDER_OR_HUB_ID``: end to end on tiny LLaVA-1.5 and Qwen2.5-VL checkpoint folders; what
it prints and writes equals the same run through the public API (``vitrim.vlm.apply`` + ``generate`` +
``last_selection``), and bad arguments end in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitrim.vlm
from tiny_vlms.folders import save_gemma3, save_llava, save_llava_next, save_paligemma, save_picture, save_qwen2_5_vl
from vitrim.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "llava": save_llava(root / "llava"),
        "qwen": save_qwen2_5_vl(root / "qwen"),
        "llava_next": save_llava_next(root / "llava_next"),
        "gemma3": save_gemma3(root / "gemma3"),
        "paligemma": save_paligemma(root / "paligemma"),
        "picture": save_picture(root / "picture.png", width=40, height=30),
    }


def api_run(folder: Path, picture: Path, question: str, method: str, keep: float) -> tuple[str, list, list]:
    """The same question through the public API, written here from transformers' own calls."""
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=[Image.open(picture).convert("RGB")], text=[text], return_tensors="pt")
    vitrim.vlm.apply(model, method, keep=keep)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    answer = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()
    kept = [k.tolist() for k in vitrim.vlm.last_selection(model)]
    groups = [[g.tolist() for g in image] for image in vitrim.vlm.last_selection(model, groups=True)]
    return answer, kept, groups


@pytest.mark.parametrize(
    ("family", "method", "tokens", "entered"),
    [("llava", "visionzip", 16, 8), ("qwen", "divprune", 80, 40), ("llava_next", "fastervlm", 70, 32)],
)
def test_cli_equals_the_api(
    folders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    family: str,
    method: str,
    tokens: int,
    entered: int,
) -> None:
    """Tokens: LLaVA's 16-px crop of 4-px patches (16); Qwen's 40×30 picture smart-resized to 40×32 (10×8 tokens);
    LLaVA-NeXT's 40×30 picture: best pinpoint 32×32 (4 tiles), packed as the base tile's 16 + the 8×8 grid unpadded
    to 6 rows (8·30/40) of 8 tokens and a newline = 70; fastervlm keeps 4 per tile, of which the grid tiles' survive
    the unpadding or not, and the 6 newlines always enter (32, the API's own count)."""
    out = tmp_path / "run"
    argv = ["vlm", "ask", "--model", str(folders[family]), "--image", str(folders["picture"]), "w10 w11 w12"]
    code = main([*argv, "--method", method, "--keep", "0.5", "--max-new-tokens", "4", "--out", str(out)])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    answer, kept, groups = api_run(folders[family], folders["picture"], "w10 w11 w12", method, 0.5)
    assert printed[0] == answer
    cls = " (one of them the tower's [CLS])" if len(groups[0][0]) == 0 else ""  # VisionZip on LLaVA, as its authors
    assert printed[1] == f"{method}: {len(groups[0])} of {tokens} image tokens entered the LLM{cls}"
    assert len(groups[0]) == entered
    record = json.loads((out / "selection.json").read_text())
    assert record["method"] == method and record["options"] == {"keep": 0.5} and record["answer"] == answer
    (image,) = record["images"]
    assert image["kept"] == kept[0] and image["groups"] == groups[0]
    # VisionZip hands LLaVA's LLM the tower's [CLS]: an empty group, first, and "cls": true
    assert image["cls"] == (family == "llava") and (image["groups"][0] == []) == image["cls"]
    assert len(image["kept"]) == entered - image["cls"]
    assert image["tokens"] == tokens and len(image["boxes"]) == tokens
    assert image["size"] == {"height": 30, "width": 40}
    from PIL import Image

    with Image.open(out / "kept_tokens.png") as png:
        assert png.width > 100 and png.height > 100


@pytest.mark.full  # a fresh interpreter: ~5 s alone, ~25 s on a loaded machine
def test_hub_id_from_the_offline_cache(folders: dict[str, Path], tmp_path: Path) -> None:
    """A hub id read from a hub cache laid out on disk, with HF_HUB_OFFLINE=1, in a fresh process."""
    sys.path.insert(0, str(ROOT / "tests" / "hub"))
    from hub_cache import add_folder

    add_folder(tmp_path / "hf" / "hub", "tiny-org/tiny-llava", folders["llava"])
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    argv = ["vlm", "ask", "--model", "tiny-org/tiny-llava", "--image", str(folders["picture"]), "w10"]
    result = subprocess.run(
        [sys.executable, "-m", "vitrim.cli", *argv, "--method", "fastervlm", "--keep", "4", "--max-new-tokens", "2"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1] == "fastervlm: 4 of 16 image tokens entered the LLM"
    argv = ["vlm", "ask", "--model", "tiny-org/not-there", "--image", str(folders["picture"]), "w10"]
    missing = subprocess.run([sys.executable, "-m", "vitrim.cli", *argv], env=env, capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [missing.stderr.strip()]
    assert "--model tiny-org/not-there" in missing.stderr


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"--model": "no/such/folder/x"}, "--model no/such/folder/x: no such folder, and not a hub id"),
        ({"--image": "missing.png"}, "--image missing.png: no such file"),
        ({"--keep": "0"}, "--keep must be a token count"),
        ({"--keep": "1.5"}, "--keep must be a token count"),
        ({"--keep": "17"}, "keep"),
        ({"--set": "nonsense"}, "--set expects OPTION=VALUE"),
        ({"--run": "x"}, "--model and --run name two models"),
        ({"--device": "tpu"}, "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    ],
)
def test_bad_arguments_are_one_line(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str], change: dict[str, str], expected: str
) -> None:
    values = {"--model": str(folders["llava"]), "--image": str(folders["picture"]), "--keep": "4"}
    values.update(change)
    argv = ["vlm", "ask", "w10", "--method", "visionzip"] + [part for item in values.items() for part in item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("vitrim: error: ")
    assert expected in err


def test_a_folder_without_a_config(
    tmp_path: Path, folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["vlm", "ask", "w10", "--model", str(tmp_path), "--image", str(folders["picture"])]) == 2
    assert "the folder has no config.json" in capsys.readouterr().err


def test_demo_flags_need_model(folders: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vlm", "ask", "w10", "--image", str(folders["picture"]), "--out", "x"]) == 2
    assert "--out go with --model" in capsys.readouterr().err
    two = ["--method", "random", "--method", "fastv"]
    assert main(["vlm", "ask", "w10", "--image", str(folders["picture"]), *two]) == 2
    assert "two --method (a stack) go with --model" in capsys.readouterr().err
    assert main(["viz", "vlm", "--out", "x.png", *two]) == 2
    assert "one --method at a time" in capsys.readouterr().err


def test_save_tiny_vlm_names_its_families(tmp_path: Path) -> None:
    from vitrim.vlm_user import save_tiny_vlm

    with pytest.raises(
        ValueError, match="family must be one of llava, llava_next, qwen2_5_vl, gemma3, paligemma, got 'gemma'"
    ):
        save_tiny_vlm(tmp_path / "x", "gemma")


def test_in_llm_and_staged_methods(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fastv: every token enters, its kept count from its layer on; pdrop with no --keep: its own stages (tuples
    through --set: one stage at layer 1 keeping half)."""
    argv = ["vlm", "ask", "w10", "--model", str(folders["llava"]), "--image", str(folders["picture"])]
    assert main([*argv, "--method", "fastv", "--keep", "4", "--set", "layer=1", "--max-new-tokens", "2"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[1]
        == "fastv: all 16 image tokens entered the LLM; 4 of them stay after its layer"
    )
    pdrop = ["--method", "pdrop", "--set", "layers=(1,)", "--set", "ratios=(0.5,)", "--out", str(tmp_path)]
    assert main([*argv, *pdrop]) == 0
    assert (
        capsys.readouterr().out.splitlines()[1]
        == "pdrop: all 16 image tokens entered the LLM; 8 of them stay after its layer"
    )
    assert main([*argv, "--keep", "4"]) == 2
    assert "--keep 4 needs --method" in capsys.readouterr().err


def test_two_methods_stack_from_the_cli_as_through_the_api(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--method random --keep 8 --method fastv --keep 0.5 --set layer=1``: 8 of 16 enter, 4 stay after layer 1;
    the record lists the stack, its kept tokens are the API's stack's; --keep before the first of two --method and
    two methods of one stage are one-line errors."""
    from PIL import Image

    from vitrim.vlm_user import ask

    argv = ["vlm", "ask", "w10", "--model", str(folders["llava"]), "--image", str(folders["picture"])]
    stack = ["--method", "random", "--keep", "8", "--method", "fastv", "--keep", "0.5", "--set", "layer=1"]
    assert main([*argv, *stack, "--max-new-tokens", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1] == "random+fastv: 8 of 16 image tokens entered the LLM; 4 of them stay after its layer"
    record = json.loads((tmp_path / "selection.json").read_text())
    assert [(m["method"], m["stage"], m["options"]) for m in record["stack"]] == [
        ("random", "pre_llm", {"keep": 8}),
        ("fastv", "in_llm", {"keep": 0.5, "layer": 1}),
    ]
    model = transformers.AutoModelForImageTextToText.from_pretrained(folders["llava"]).eval()
    processor = transformers.AutoProcessor.from_pretrained(folders["llava"])
    picture = Image.open(folders["picture"]).convert("RGB")
    answer = ask(model, processor, picture, "w10", [("random", {"keep": 8}), ("fastv", {"keep": 0.5, "layer": 1})], 2)
    assert printed[0] == answer.text and record["images"][0]["kept"] == answer.kept[0]
    assert (answer.entered, answer.selected) == ([8], [4])
    assert main([*argv, "--keep", "8", *stack]) == 2
    assert "give each --keep / --set after its --method" in capsys.readouterr().err
    assert main([*argv, "--method", "random", "--keep", "8", "--method", "divprune", "--keep", "4"]) == 2
    assert "one method per stage" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("family", "method", "keep", "printed", "boxes"),
    [
        ("gemma3", "random", "4", "random: 4 of 16 image tokens entered the LLM", 16),
        ("gemma3", "topk", "64", "topk: 64 tower tokens of 256 patches reach its feature layer", 256),
        ("paligemma", "topk", "10", "topk: 10 tower tokens of 16 patches reach its feature layer", 16),
    ],
)
def test_gemma3_and_paligemma_boxes_from_the_cli(
    folders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    family: str,
    method: str,
    keep: str,
    printed: str,
    boxes: int,
) -> None:
    """Gemma 3 (32-px squares of 2-px patches, 16×16 patches pooled 4×4 to 16 tokens) and PaliGemma (16 tokens) on
    a 40×30 picture: the record's kept tokens are the API's, one box per pooled token (a tower method: per patch,
    the index space of its selection), each box the 40/4 × 30/4 cell (Gemma 3's patches: 40/16 × 30/16)."""
    from PIL import Image

    from vitrim.vlm_user import ask, load_vlm

    options = ["--keep", keep]
    argv = ["vlm", "ask", "w10", "--model", str(folders[family]), "--image", str(folders["picture"])]
    assert main([*argv, "--method", method, *options, "--max-new-tokens", "2", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(printed)
    record = json.loads((tmp_path / "selection.json").read_text())
    model, processor = load_vlm(folders[family])
    answer = ask(model, processor, Image.open(folders["picture"]).convert("RGB"), "w10", method, 2, keep=int(keep))
    (image,) = record["images"]
    assert image["kept"] == answer.kept[0] and len(image["boxes"]) == boxes
    side = int(boxes**0.5)
    cell = [40 / side, 30 / side]
    assert image["boxes"][side + 1] == pytest.approx([cell[0], cell[1], 2 * cell[0], 2 * cell[1]], abs=1e-4)
    assert (tmp_path / "kept_tokens.png").is_file()


def test_gemma3_pan_and_scan_is_refused(folders: dict[str, Path]) -> None:
    """A wide picture cut into crops (each an image of its own in the prompt) has no one set of boxes."""
    from vitrim.viz import vlm_token_boxes
    from vitrim.vlm_user import load_vlm

    model, processor = load_vlm(folders["gemma3"])
    from PIL import Image

    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w10"}]}], tokenize=False
    )
    crops = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_min_ratio_to_activate": 1.2}
    inputs = dict(processor(images=[Image.new("RGB", (64, 16))], text=[text], return_tensors="pt", **crops))
    assert len(inputs["pixel_values"]) > 1
    with pytest.raises(ValueError, match="do_pan_and_scan=False"):
        vlm_token_boxes(model, processor, inputs, [(16, 64)])


def test_a_hostile_config_is_read_as_data(
    tmp_path: Path, folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """config.json goes through vitrim.untrusted before transformers sees it: one line naming the file."""
    (tmp_path / "config.json").write_text('{"model_type": "llava", "x": NaN}')
    assert main(["vlm", "ask", "w10", "--model", str(tmp_path), "--image", str(folders["picture"])]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "config.json" in err and "NaN" in err


@pytest.mark.parametrize("given", ["stage order", "in-LLM first"])
def test_the_docs_stack_prints_and_records_the_same_in_either_order(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    """docs/vlm.md's stack: VisionZip hands the LLM its [CLS] and 7 image tokens, FastV keeps half of the 7 (4) and
    never drops the [CLS] (text to it): 5 stay, counted here from what the run recorded. Given in-LLM first, the
    run is the same stack (the model runs tower, pre-LLM, in-LLM), and so are the line and the record (issue 53:
    it printed no count and labelled the in-LLM selection pre_llm)."""
    argv = ["vlm", "ask", "w10", "--model", str(folders["llava"]), "--image", str(folders["picture"])]
    visionzip = ["--method", "visionzip", "--keep", "8", "--set", "contextual=2"]
    fastv = ["--method", "fastv", "--keep", "0.5", "--set", "layer=1"]
    methods = [*visionzip, *fastv] if given == "stage order" else [*fastv, *visionzip]
    assert main([*argv, *methods, "--max-new-tokens", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    record = json.loads((tmp_path / "selection.json").read_text())
    image = record["images"][0]
    cls = [group for group in image["groups"] if not group]
    assert len(cls) == 1 and image["cls"]  # the [CLS] went through
    assert len(image["kept"]) == 4 and image["selected"] == 1 + len(image["kept"])
    assert printed[1] == (
        "visionzip+fastv: 8 of 16 image tokens entered the LLM (one of them the tower's [CLS]); 5 of them stay after "
        "its layer (the [CLS] and 4 image tokens)"
    )
    assert (record["method"], record["stage"], record["options"]) == (
        "visionzip+fastv",
        "in_llm",
        {"keep": 0.5, "layer": 1},
    )
    assert [(m["method"], m["stage"]) for m in record["stack"]] == [("visionzip", "pre_llm"), ("fastv", "in_llm")]

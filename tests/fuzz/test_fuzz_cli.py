"""The subcommands whose values users type most, run in-process with one argument replaced by a generated bad or edge
value: each ends with exit code 0, or 2 and one line ``vitrim: error: …`` (or argparse's usage error), never with a
traceback. (The demos are left out: a harmless mutation would run a whole demo per example.) Every numeric option has
a bound (issue 45): a test walks the parser for one without."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_invocations import invocations
from vitrim.cli import build_parser, main
from vitrim.cli import models as cli_models
from vitrim.cli.common import Bounded

FUZZED = ["models", "explain", "train", "eval", "viz attention", "bench models", "bench attention", "bench reducers"]
# issue 45: vlm_invocations below
VLM_COMMANDS = ("vlm ask", "vlm ask fastv", "vlm ask pdrop", "viz vlm", "vlm flops", "vlm methods", "bench vlm")


BAD = ["-1", "0", "abc", "", "1e9", "nan", "{file}/x", "{missing}", "--help-me", "[1,", "x=1", "3.5"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(FUZZED), position=st.integers(1, 20), bad=st.sampled_from(BAD))
def test_every_subcommand_with_one_bad_value(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], command: str, position: int, bad: str
) -> None:
    tmp = tmp_path_factory.mktemp("cli")
    run_with_one_bad_value(tmp, capsys, invocations(tmp)[command], position, bad)


def run_with_one_bad_value(
    tmp: Path, capsys: pytest.CaptureFixture[str], invocation: list[str], position: int, bad: str
) -> None:
    """``invocation`` with its argument at ``position`` (modulo its length) replaced by ``bad``: exit code 0, or 2
    and one line (``vitrim: error: …``, or argparse's usage error), never a traceback."""
    capsys.readouterr()  # capsys spans every example: start from an empty stderr
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)  # a generated value such as "nan" may become an output path: written here, not in the repo
        (tmp / "a_file").write_text("not a folder")
        argv = list(invocation)
        index = 1 + position % (len(argv) - 1)
        argv[index] = bad.format(file=tmp / "a_file", missing=tmp / "no" / "such")
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse: a usage error (2) or --help (0)
            code = int(exit_.code or 0)
            assert code in (0, 2)
            return
        err = capsys.readouterr().err
        assert code in (0, 2), (argv, err)
        if code == 2:
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("vitrim: error: "), (argv, err)  # nothing else


def vlm_invocations(tmp: Path) -> dict[str, list[str]]:
    """The VLM commands on the shipped digits VLM (a run folder's hostile files: test_hostile_run_folders.py), and
    bench vlm at toy sizes: each a second or less, so a mutation cannot start a long run."""
    from cli_invocations import blank_png

    image = str(blank_png(tmp))
    return {
        "vlm ask": ["vlm", "ask", "which digit ?", "--image", image, "--method", "random", "--keep", "0.25"],
        "vlm ask fastv": ["vlm", "ask", "how many digits ?", "--image", image, "--method", "fastv", "--keep", "16"],
        "vlm ask pdrop": ["vlm", "ask", "which digit ?", "--image", image, "--method", "pdrop", "--keep", "0.25"],
        "viz vlm": ["viz", "vlm", "--canvas", "3", "--method", "random", "--keep", "16", "--out", str(tmp / "v.png"),
                    "--save-canvas", str(tmp / "c.png")],
        "vlm methods": ["vlm", "methods", "--stage", "in_llm", "--json", str(tmp / "m.json")],
        "vlm flops": ["vlm", "flops", "--models", "gemma-3-4b", "--keep", "64", "--text-tokens", "20"],
        "bench vlm": [
            "bench", "vlm", "--set", "vision_width=32,vision_mlp=48,vision_heads=4,image_size=56,llm_width=32,"
            "llm_mlp=40,llm_heads=4", "--methods", "random", "--keep", "4", "--repeats", "1", "--warmup", "0",
        ],
    }  # fmt: skip


VLM_BAD = [*BAD, "1e308", "-0", "0.0", "inf", "2**31", "9" * 30, "which digit ?", "random", "fastv,nope"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(VLM_COMMANDS)), position=st.integers(1, 20), bad=st.sampled_from(VLM_BAD))
def test_every_vlm_command_with_one_bad_value(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], command: str, position: int, bad: str
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    tmp = tmp_path_factory.mktemp("vlm_cli")
    run_with_one_bad_value(tmp, capsys, vlm_invocations(tmp)[command], position, bad)


@pytest.mark.full
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(VLM_COMMANDS)), position=st.integers(1, 20), bad=st.sampled_from(VLM_BAD))
def test_every_vlm_command_with_one_bad_value_many_more(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], command: str, position: int, bad: str
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    tmp = tmp_path_factory.mktemp("vlm_cli")
    run_with_one_bad_value(tmp, capsys, vlm_invocations(tmp)[command], position, bad)


def test_warnings_are_one_plain_line_on_success_and_dropped_on_failure(tmp_path, capsys) -> None:
    """`vitrim eval` on a folder with unreadable images: the count, once, in the CLI's words; a failing command:
    its error line and nothing else (a library's warnings of the failed call are not news)."""
    from PIL import Image

    from cli_invocations import tiny_checkpoint

    checkpoint = str(tiny_checkpoint(tmp_path))
    for index, name in enumerate("abcdefghij"):  # the tiny model's 10 classes, one grey picture each
        (tmp_path / "data" / name).mkdir(parents=True)
        Image.new("L", (16, 16), 20 * index).save(tmp_path / "data" / name / "0.png")
    (tmp_path / "data" / "a" / "bad.png").write_bytes(b"not a png")
    (tmp_path / "data" / "b" / "bad.jpg").write_bytes(b"\xff\xd8 cut")
    capsys.readouterr()
    assert main(["eval", checkpoint, "--data", str(tmp_path / "data")]) == 0
    err = capsys.readouterr().err
    assert err == f"vitrim: warning: skipped 2 unreadable image(s) in {tmp_path / 'data'}\n", err

    def warns_then_fails(args: object) -> int:
        warnings.warn("a library's complaint\nover two lines", UserWarning, stacklevel=1)
        raise ValueError("--x must be y")

    def warns_then_works(args: object) -> int:
        for _ in range(3):
            warnings.warn("a library's complaint\nover two lines", UserWarning, stacklevel=1)
        return 0

    for func, code, expected in [
        (warns_then_fails, 2, "vitrim: error: --x must be y\n"),
        (warns_then_works, 0, "vitrim: warning: a library's complaint\n"),
    ]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cli_models, "run", func)  # `vitrim models` runs it (main builds its parser each call)
            assert main(["models"]) == code
        assert capsys.readouterr().err == expected


# -- issue 45: every numeric option has a bound that says what it is -----------------------------------------------


def numeric_options() -> list[tuple[list[str], argparse.Action]]:
    """(the command path, the action) of every option whose value is a number, in every command."""
    found: list[tuple[list[str], argparse.Action]] = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.type in (int, float) or isinstance(action.type, Bounded):
                found.append((path, action))

    walk(build_parser(), [])
    return found


def test_every_numeric_option_is_bounded() -> None:
    options = numeric_options()
    assert len(options) > 40  # the walk reaches every command (a broken walk would pass the next line)
    unbounded = [f"vitrim {' '.join(path)} {action.option_strings}" for path, action in options
                 if not isinstance(action.type, Bounded)]  # fmt: skip
    assert not unbounded, unbounded


@pytest.mark.parametrize("side", ["above", "below", "text", "nan"])
def test_each_bound_refuses_in_argparse_words_naming_option_value_and_range(
    capsys: pytest.CaptureFixture[str], side: str
) -> None:
    for path, action in numeric_options():
        bound = action.type
        assert isinstance(bound, Bounded)
        value = {"above": bound.high + 1, "below": bound.low - 1, "text": "many", "nan": "nan"}[side]
        text = str(int(value) if bound.kind is int and not isinstance(value, str) else value)
        option = action.option_strings[0]
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*path, option, text, *(["x"] * (action.nargs == 2))])
        assert exit_.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        expected = f"argument {'/'.join(action.option_strings)}: expected {bound.describe()}, got {text!r}"
        assert last.endswith(expected), (path, last)


def test_each_bound_takes_its_own_range() -> None:
    for _, action in numeric_options():
        bound = action.type
        text = (lambda v: str(int(v))) if bound.kind is int else repr
        for end, is_open in ((bound.low, bound.low_open), (bound.high, bound.high_open)):
            if is_open:
                with pytest.raises(argparse.ArgumentTypeError):
                    bound(text(end))
            else:
                assert bound(text(end)) == end and type(bound(text(end))) is bound.kind


def test_the_canvas_is_one_the_demo_scores(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    pytest.importorskip("transformers")
    from vitrim.cli.vlm_demo import CANVAS_INDEX
    from vitrim.demos.vlm.demo import FULL

    assert CANVAS_INDEX.high + 1 == FULL.test_canvases  # the bound is the demo's held-out set, not a round number
    with pytest.raises(SystemExit):
        main(["viz", "vlm", "--canvas", "200", "--out", str(tmp_path / "x.png")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("argument --canvas: expected an int in [0, 199] (one of the 200 held-out canvases the demo "
                         "scores), got '200'"), last  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("image_size=100000", "image_size must be an int in [1, 8192], got 100000"),
        ("image_size=8192,patch_size=14", "makes 342225 image tokens, over the limit of 16384"),
        ("llm_width=1048576", "llm_width must be an int in [1, 16384], got 1048576"),
        ("vision_layers=0", "vision_layers must be an int in [1, 256], got 0"),
    ],
)
def test_bench_vlm_sizes_are_bounded_before_a_model_is_built(
    capsys: pytest.CaptureFixture[str], setting: str, words: str
) -> None:
    pytest.importorskip("transformers")
    capsys.readouterr()
    assert main(["bench", "vlm", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vitrim: error: ") and words in err, err


def test_demo_vlm_refuses_an_unknown_method_before_training(
    capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    import vitrim.demos.vlm.demo as demo
    from vitrim import vlm

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained or loaded a model although --methods names an unknown method")

    monkeypatch.setattr(demo, "_train", no_work)
    monkeypatch.setattr(demo, "load_digits_vlm", no_work)
    for extra in ([], ["--quick"]):
        capsys.readouterr()
        assert main(["demo", "vlm", "--methods", "fastv,nope", "--out", str(tmp_path / "run"), *extra]) == 2
        err = capsys.readouterr().err
        image_methods = [name for name in vlm.methods() if not vlm.method_info(name).video]
        assert err.count("\n") == 1 and "unknown method(s) ['nope']" in err and str(image_methods) in err, err
    assert main(["demo", "vlm", "--methods", "fastv,evs", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "method(s) ['evs'] reduce videos, and the digits VLM sees pictures" in err and err.count("\n") == 1, err


def test_running_out_of_memory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    def allocates(kind: type[BaseException], message: str) -> object:
        def run(args: object) -> int:
            raise kind(message)

        return run

    for kind, message in [
        (MemoryError, ""),
        (RuntimeError, "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
                       "allocate 4000000000000 bytes.\nsecond line"),
    ]:  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cli_models, "run", allocates(kind, message))
            capsys.readouterr()
            assert main(["models"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("vitrim: error: out of memory") and "smaller" in err, err
    with pytest.MonkeyPatch.context() as patch:  # any other RuntimeError is a bug: its traceback stays
        patch.setattr(cli_models, "run", allocates(RuntimeError, "shape mismatch"))
        with pytest.raises(RuntimeError, match="shape mismatch"):
            main(["models"])


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "models", "vit_tiny_patch16_224", "--set", "embed_dim=1000000000"],
        ["bench", "models", "vit_tiny_patch16_224[embed_dim=1000000000]"],
        ["bench", "ops", "vit_tiny_patch16_224", "--set", "embed_dim=1000000000"],
        ["bench", "reducers", "--models", "vit_tiny_patch16_224", "--set", "embed_dim=1000000000"],
        ["train", "--model", "vit_tiny_patch16_224", "--set", "embed_dim=1000000000", "--out", "{tmp}/run"],
    ],
)
def test_model_sizes_typed_on_the_command_line_are_bounded_like_a_file_s(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    """A size the machine may grant (Linux overcommits) and then spend hours filling is refused before any model is
    built, naming the field, the value and the limit."""
    capsys.readouterr()
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "embed_dim = 1000000000 is over the limit of 16384 for a model built from the " \
        "command line" in err, err  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_viz_vlm_help_names_only_options_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """`viz vlm --help` told of a --model it does not take (issue 53); vlm ask, which takes it, still says so."""
    import re

    for argv, takes_model in ((["viz", "vlm", "--help"], False), (["vlm", "ask", "--help"], True)):
        with pytest.raises(SystemExit):
            main(argv)
        named = set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))
        assert ("--model" in named) == takes_model, (argv, sorted(named))

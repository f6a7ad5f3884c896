"""The subcommands whose values users type most, run in-process with one argument replaced by a generated bad or edge
value: each ends with exit code 0, or 2 and one line ``vitrim: error: …`` (or argparse's usage error), never with a
traceback. (The demos are left out: a harmless mutation would run a whole demo per example.)"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_invocations import invocations
from vitrim.cli import main
from vitrim.cli import models as cli_models

FUZZED = ["models", "explain", "train", "eval", "viz attention", "bench models", "bench attention", "bench reducers"]


BAD = ["-1", "0", "abc", "", "1e9", "nan", "{file}/x", "{missing}", "--help-me", "[1,", "x=1", "3.5"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(FUZZED), position=st.integers(1, 20), bad=st.sampled_from(BAD))
def test_every_subcommand_with_one_bad_value(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], command: str, position: int, bad: str
) -> None:
    tmp = tmp_path_factory.mktemp("cli")
    capsys.readouterr()  # capsys spans every example: start from an empty stderr
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)  # a generated value such as "nan" may become an output path: written here, not in the repo
        (tmp / "a_file").write_text("not a folder")
        argv = list(invocations(tmp)[command])
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

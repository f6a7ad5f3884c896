"""The subcommands whose values users type most, run in-process with one argument replaced by a generated bad or edge
value: each ends with exit code 0, or 2 and one line ``vitrim: error: …`` (or argparse's usage error), never with a
traceback. (The demos are left out: a harmless mutation would run a whole demo per example.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_invocations import invocations
from vitrim.cli import main

FUZZED = ["models", "explain", "train", "eval", "viz attention", "bench models", "bench attention", "bench reducers"]


BAD = ["-1", "0", "abc", "", "1e9", "nan", "{file}/x", "{missing}", "--help-me", "[1,", "x=1", "3.5"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(FUZZED), position=st.integers(1, 20), bad=st.sampled_from(BAD))
def test_every_subcommand_with_one_bad_value(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], command: str, position: int, bad: str
) -> None:
    tmp = tmp_path_factory.mktemp("cli")
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
            assert lines and lines[-1].startswith("vitrim: error: ") and "Traceback" not in err, (argv, err)

"""docs/vllm.md's "Try it here" as a new user runs it: its two shell blocks, as written, in this environment.

The first block writes a tiny LLaVA with ``save_tiny_vlm(..., for_vllm=True)`` and starts the server in the
background; once it says it accepts requests, the second block asks it twice (the engine's keep, a request's own)
and must print the prompt lengths the page states. The only changes to the blocks: the port (a free one for 8000,
so a busy 8000 cannot fail the test), and a ``wait`` after the first, so the shell lives as long as its background
server and its exit tells the test the server stopped. The server is stopped at the end, whatever happens.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from vllm_server import REQUEST_S, SERVER_START_S, copy_until_ready, free_port, healthy

PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
SECTION = "## Try it here: a CPU, nothing downloaded"


def section_blocks() -> list[str]:
    """The ```bash blocks of the page's "Try it here" section, in order."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```bash\n(.*?)```", text[start:end], flags=re.DOTALL)


def test_the_first_hour_runs_as_written(tmp_path: Path) -> None:
    start_block, ask_block = section_blocks()
    port = str(free_port())
    start_block, ask_block = start_block.replace("8000", port), ask_block.replace("8000", port)
    # the page's `python` is this environment's
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = (tmp_path / "server.log").open("w")
    # bash writes the folder, starts the server in the background and waits on it, in a process group of its own
    shell = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", start_block + "wait\n"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    ready = threading.Event()
    reader = threading.Thread(target=copy_until_ready, args=(shell.stdout, log, ready), daemon=True)
    reader.start()
    try:
        ready.wait(timeout=SERVER_START_S)  # the startup line, or the server's exit (its output closes)
        assert shell.poll() is None and healthy(int(port), shell), (tmp_path / "server.log").read_text()[-4000:]
        assert (tmp_path / "tiny-llava" / "config.json").is_file()
        asked = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", ask_block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=REQUEST_S,
            check=False,
        )
        assert asked.returncode == 0, asked.stderr[-4000:]
        lines = asked.stdout.splitlines()
        assert len(lines) == 2, asked.stdout
        assert lines[0].startswith("keep=None: 9 prompt tokens, '"), lines[0]
        assert lines[1].startswith("keep=3: 6 prompt tokens, '"), lines[1]
    finally:
        try:
            os.killpg(shell.pid, signal.SIGINT)  # bash and its server: the process group bash leads
            shell.wait(timeout=60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait(timeout=30)
        reader.join(timeout=30)
        log.close()

"""``vllm serve`` as a user runs it, for tests/vllm: the command (through vllm_cli.py), a server on a free port of
127.0.0.1 that is stopped at the end, and a JSON request to it. Every wait is bounded (SERVER_START_S, REQUEST_S)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engines import ENGINE_ARGS

CLI = Path(__file__).with_name("vllm_cli.py")
SERVER_START_S = 300  # engine start on 2 busy cores: about a minute
REQUEST_S = 60
REFUSED_RETRY_S = 0.2  # between /health tries while the server's socket is bound but not yet listening


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve_command(
    folder: Path,
    port: int,
    hf_overrides: dict[str, Any] | None,
    limit_mm_per_prompt: dict[str, int] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``vllm serve`` of ``folder`` on 127.0.0.1:``port`` as tests/vllm's engines run (float32, eager, the CPU's
    KV-cache size), the model named "tiny"; ``hf_overrides`` None: vLLM's own model; ``extra``: more arguments,
    after these (vLLM takes an option's last value: ``["--max-num-seqs", "32"]`` replaces the 4 here)."""
    return [
        sys.executable,
        str(CLI),
        "serve",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(ENGINE_ARGS["max_model_len"]),
        "--max-num-seqs",
        "4",
        "--kv-cache-memory-bytes",
        str(ENGINE_ARGS["kv_cache_memory_bytes"]),
        "--limit-mm-per-prompt",
        json.dumps(limit_mm_per_prompt or {"image": 2}),
        "--no-enable-prefix-caching",
        *(["--hf-overrides", json.dumps(hf_overrides)] if hf_overrides is not None else []),
        *extra,
    ]


def server_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return {**env, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def healthy(port: int, process: subprocess.Popen[str], within_s: float = 60.0) -> bool:
    """Whether the server answers /health within ``within_s``. vLLM binds its socket early but uvicorn starts
    listening on it just after its "Application startup complete" line, and signals nothing when it does (no line
    for a socket it was handed): a refused connection is tried again once the server process has not exited within
    REFUSED_RETRY_S (its exit ends the wait at once and fails the check); a listening socket holds the request until
    the server's loop takes it."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=within_s) as response:
                return response.status == 200
        except urllib.error.URLError as error:
            if not isinstance(error.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                return False
        except (ConnectionError, TimeoutError):
            return False
        try:
            process.wait(timeout=REFUSED_RETRY_S)  # the server's exit, the one event that ends the wait early
            return False
        except subprocess.TimeoutExpired:
            continue


# The server's last line before it takes requests. vLLM binds its socket before uvicorn starts and hands it over
# (``server.serve(sockets=[sock])``), and uvicorn then never logs "Uvicorn running on" (it does only for sockets it
# binds itself): waiting for that line waited out SERVER_START_S on every start. uvicorn listens right after this
# line (:func:`healthy` tries again until it does).
READY = "Application startup complete"


def copy_until_ready(stream: Any, sink: Any, ready: threading.Event) -> None:
    """Copy the server's output into ``sink`` line by line; set ``ready`` at its startup line or when it ends."""
    for line in stream:
        sink.write(line)
        sink.flush()
        if READY in line:
            ready.set()
    ready.set()  # the process closed its output: it exited


@contextmanager
def running_server(
    folder: Path,
    hf_overrides: dict[str, Any] | None,
    log: Path,
    limit_mm_per_prompt: dict[str, int] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[int]:
    """A ``vllm serve`` process of ``folder`` on a free port of 127.0.0.1 (its output in ``log``; ``extra``: as in
    :func:`serve_command`); its port, once it says it accepts requests (``RuntimeError`` with the log's tail where
    it does not). Stopped (SIGINT, then killed) at the end."""
    port = free_port()
    sink = log.open("w")
    process = subprocess.Popen(
        serve_command(folder, port, hf_overrides, limit_mm_per_prompt, extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=server_env(),
    )
    ready = threading.Event()
    reader = threading.Thread(target=copy_until_ready, args=(process.stdout, sink, ready), daemon=True)
    reader.start()
    try:
        ready.wait(timeout=SERVER_START_S)  # the startup line, the process's exit, or the deadline
        if process.poll() is not None or not healthy(port, process):
            raise RuntimeError(f"vllm serve did not come up (exit {process.poll()}):\n{log.read_text()[-4000:]}")
        yield port
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        reader.join(timeout=30)
        sink.close()

"""``vllm serve`` with the plugin, on 127.0.0.1, as a user runs it; an OpenAI-style client talks to it.

One server (tiny LLaVA, VisionZip keeping 6 of 16 tokens per image) answers chat requests with an image exactly as
the offline ``LLM`` does (text and vLLM's usage numbers); a bad request gets an HTTP error and the server goes on
serving; a bad ``vitrim`` override stops ``vllm serve`` at engine start with the one line naming the value. Every
wait is bounded (SERVER_START_S, REQUEST_S) and the server is stopped at the end of the module.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import ENGINE_ARGS, overrides, with_engine
from PIL import Image

from tiny_vlms.folders import save_vllm_llava as save_llava

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"
OVERRIDES = overrides(ARCHITECTURE, "visionzip", keep=6)
CLI = Path(__file__).with_name("vllm_cli.py")
SERVER_START_S = 300  # engine start on 2 busy cores: about a minute
REQUEST_S = 60
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve_command(folder: Path, port: int, hf_overrides: dict[str, Any]) -> list[str]:
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
        json.dumps({"image": 2}),
        "--no-enable-prefix-caching",
        "--hf-overrides",
        json.dumps(hf_overrides),
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


def healthy(port: int) -> bool:
    """Whether the server answers /health; the request itself waits for it (a listening socket holds the
    connection until the server's loop takes it)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llava(tmp_path_factory.mktemp("serve") / "tiny-llava")


@pytest.fixture(scope="module")
def image_png(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("image") / "image.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
    return path.read_bytes()


READY = "Uvicorn running on"  # uvicorn logs it once its socket listens (after "Application startup complete")


def copy_until_ready(stream: Any, sink: Any, ready: threading.Event) -> None:
    """Copy the server's output into ``sink`` line by line; set ``ready`` at its startup line or when it ends."""
    for line in stream:
        sink.write(line)
        sink.flush()
        if READY in line:
            ready.set()
    ready.set()  # the process closed its output: it exited


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A ``vllm serve`` process on a free port of 127.0.0.1; its port, once it says it accepts requests. Stopped
    (SIGINT, then killed) at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    sink = log.open("w")
    process = subprocess.Popen(
        serve_command(folder, port, OVERRIDES),
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
        if process.poll() is not None or not healthy(port):
            pytest.fail(f"vllm serve did not come up (exit {process.poll()}):\n{log.read_text()[-4000:]}")
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


def chat(text: str, png: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
            }
        ],
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }


def offline_chat(folder: Path, texts: list[str], png: bytes) -> list[tuple[str, int]]:
    """The same chats through an offline ``LLM`` with the same overrides: (text, prompt tokens) each."""
    from vllm import SamplingParams

    def run(llm: Any) -> list[tuple[str, int]]:
        answers = []
        for text in texts:
            messages = chat(text, png)["messages"]
            out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
            answers.append((out.outputs[0].text, len(out.prompt_token_ids)))
        return answers

    return with_engine(folder, OVERRIDES, run)


def test_chat_answers_equal_the_offline_engine_and_a_bad_request_leaves_it_serving(
    server: int, folder: Path, image_png: bytes
) -> None:
    texts = ["w10 w11 w12", "w40 w41"]
    answers = []
    for text in texts:
        status, body = post(server, "/v1/chat/completions", chat(text, image_png))
        assert status == 200, body
        answers.append((body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]))
    assert answers == offline_chat(folder, texts, image_png)
    assert answers[0][1] == 6 + 3  # the image's 6 kept placeholders and 3 words (16 + 3 unpruned)

    broken = chat("w10", b"not an image")
    status, body = post(server, "/v1/chat/completions", broken)
    assert 400 <= status < 500, body
    status, body = post(server, "/v1/chat/completions", chat(texts[0], image_png))
    assert status == 200 and (body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]) == answers[0]


def test_a_bad_override_stops_vllm_serve_at_engine_start_naming_the_value(folder: Path) -> None:
    bad = overrides(ARCHITECTURE, "visionzap", keep=6)
    done = subprocess.run(
        serve_command(folder, free_port(), bad),
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=SERVER_START_S,
        check=False,
    )
    assert done.returncode != 0
    assert "vitrim: unknown vlm method 'visionzap'; expected one of:" in done.stdout + done.stderr

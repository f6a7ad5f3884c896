"""``vllm serve`` with the plugin, on 127.0.0.1, as a user runs it; an OpenAI-style client talks to it.

One server (tiny LLaVA, VisionZip keeping 6 of 16 tokens per image) answers chat requests with an image exactly as
the offline ``LLM`` does (text and vLLM's usage numbers), also a request that asks its own ``keep`` through the chat
request's ``mm_processor_kwargs``; a bad request gets an HTTP error and the server goes on serving; a bad ``vitrim``
override stops ``vllm serve`` at engine start with the one line naming the value. Every wait is bounded
(vllm_server.py) and the server is stopped at the end of the module.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import overrides, with_engine
from PIL import Image
from vllm_server import SERVER_START_S, free_port, post, running_server, serve_command, server_env

from tiny_vlms.folders import save_vllm_llava as save_llava

ARCHITECTURE = "VitrimLlavaForConditionalGeneration"
OVERRIDES = overrides(ARCHITECTURE, "visionzip", keep=6)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llava(tmp_path_factory.mktemp("serve") / "tiny-llava")


@pytest.fixture(scope="module")
def image_png(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("image") / "image.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A ``vllm serve`` process of the tiny LLaVA with :data:`OVERRIDES`; its port. Stopped at the end."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    try:
        # vLLM's server refuses every request's mm_processor_kwargs unless told its clients are trusted
        with running_server(folder, OVERRIDES, log, extra=("--trust-request-mm-kwargs",)) as port:
            yield port
    except RuntimeError as error:
        pytest.fail(str(error))


def chat(text: str, png: bytes, keep: int | None = None) -> dict[str, Any]:
    """An OpenAI-style chat request of one image and ``text``; ``keep`` asks this request's own keep."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    request: dict[str, Any] = {
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
    if keep is not None:
        request["mm_processor_kwargs"] = {"vitrim": {"keep": keep}}
    return request


def offline_chat(folder: Path, asked: list[tuple[str, int | None]], png: bytes) -> list[tuple[str, int]]:
    """The same chats (text, keep asked or None) through an offline ``LLM`` with the same overrides: (text, prompt
    tokens) each."""
    from vllm import SamplingParams

    def run(llm: Any) -> list[tuple[str, int]]:
        answers = []
        for text, keep in asked:
            request = chat(text, png, keep)
            out = llm.chat(
                request["messages"],
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                use_tqdm=False,
                mm_processor_kwargs=request.get("mm_processor_kwargs"),
            )[0]
            answers.append((out.outputs[0].text, len(out.prompt_token_ids)))
        return answers

    return with_engine(folder, OVERRIDES, run)


def test_chat_answers_equal_the_offline_engine_and_a_bad_request_leaves_it_serving(
    server: int, folder: Path, image_png: bytes
) -> None:
    asked: list[tuple[str, int | None]] = [("w10 w11 w12", None), ("w40 w41", None), ("w10 w11 w12", 3)]
    answers = []
    for text, keep in asked:
        status, body = post(server, "/v1/chat/completions", chat(text, image_png, keep))
        assert status == 200, body
        answers.append((body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]))
    assert answers == offline_chat(folder, asked, image_png)
    assert answers[0][1] == 6 + 3  # the image's 6 kept placeholders and 3 words (16 + 3 unpruned)
    assert answers[2][1] == 3 + 3  # this request's own keep: 3 placeholders

    for keep, refusal in (
        (0, "vitrim: this request's keep=0 must be at least 1"),
        (17, "vitrim: this request's keep=17 is more than the image's 16 tokens"),
    ):
        status, body = post(server, "/v1/chat/completions", chat("w10", image_png, keep))
        assert 400 <= status < 500 and refusal in body["error"]["message"], body

    broken = chat("w10", b"not an image")
    status, body = post(server, "/v1/chat/completions", broken)
    assert 400 <= status < 500, body
    status, body = post(server, "/v1/chat/completions", chat(asked[0][0], image_png))
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

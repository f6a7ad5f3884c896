"""One streamed OpenAI chat request to a ``vllm serve`` on 127.0.0.1, timed as a client sees it (for
benchmarks/vllm_bench.py and vllm_soak.py): the status, the time to the first generated text, the text, vLLM's
token counts.

Requests with images go as data URLs (``image_url``), videos as vLLM's offline form, their frames as JPEGs in one
``data:video/jpeg;base64,`` URL (``video_url``). ``cancel_after``: the client closes the connection after that many
pieces of text, as a user who stops reading does (vLLM aborts the request when its stream is closed).
"""

from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

REQUEST_S = 600  # one request's bound: a 32-clip round on two busy cores takes tens of seconds


@dataclass
class Answer:
    """What a client got: ``status`` (HTTP; 200 also when the stream then carried an error), ``error`` (the
    server's message, or None), ``text`` (the generated text so far), ``ttft_s`` (send → first text; None if no
    text came), ``total_s`` (send → end of the stream), ``prompt_tokens`` / ``completion_tokens`` (vLLM's usage,
    None when the stream did not finish)."""

    status: int
    error: str | None
    text: str
    ttft_s: float | None
    total_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def png_url(pixels: np.ndarray) -> str:
    """(H, W, 3) uint8 pixels as a ``data:image/png;base64,`` URL (lossless: the server decodes these pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_url(frames: np.ndarray) -> str:
    """(T, H, W, 3) uint8 frames as vLLM's ``data:video/jpeg;base64,<frame>,<frame>,…`` URL (read at 1 fps unless
    the server's ``--media-io-kwargs`` say otherwise)."""
    parts = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="JPEG", quality=90)
        parts.append(base64.b64encode(buffer.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(parts)


def chat_body(
    text: str, media: list[dict[str, Any]], max_tokens: int, options: dict[str, Any] | None = None, stream: bool = True
) -> dict[str, Any]:
    """A greedy chat request to the model served as "tiny": ``media`` (``{"type": "image_url", …}`` parts) then
    ``text``; ``options``: more fields of vLLM's request (``mm_processor_kwargs``, ``ignore_eos``)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [*media, {"type": "text", "text": text}]}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        **(options or {}),
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def stream_chat(session: Any, port: int, body: dict[str, Any], cancel_after: int | None = None) -> Answer:
    """POST ``body`` (with ``"stream": True``) to the server's chat endpoint through the aiohttp ``session`` and read
    its server-sent events to the end (or to ``cancel_after`` pieces of text)."""
    import aiohttp

    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, int] = {}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_S)) as response:
        if response.status != 200:
            return Answer(response.status, await response.text(), "", None, time.perf_counter() - start)
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:  # an error after the stream began: vLLM sends it as an event
                return Answer(200, json.dumps(event["error"]), "".join(pieces), None, time.perf_counter() - start)
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    pieces.append(piece)
            if cancel_after is not None and len(pieces) >= cancel_after:
                break  # leaving the block closes the connection: the server aborts the request
    now = time.perf_counter()
    return Answer(
        200,
        None,
        "".join(pieces),
        None if first is None else first - start,
        now - start,
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
    )

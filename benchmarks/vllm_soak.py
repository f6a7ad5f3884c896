"""A soak of one ``vllm serve`` of a trimmed tiny LLaVA: 500 mixed requests, 16 in flight; every good answer equals
the offline engine's for the same request, every bad one is refused alone, and the server answers at the end.

    PYTHONPATH=$PWD/src .venv-vllm/bin/python benchmarks/vllm_soak.py                 # about 5 min on 2 busy cores
    PYTHONPATH=$PWD/src .venv-vllm/bin/python benchmarks/vllm_soak.py --requests 20   # a smoke

The server is tests/vllm's (``running_server``: the tiny LLaVA of 16 image tokens, VisionZip keeping 6, float32,
``--kv-cache-memory-bytes``), with ``--max-num-seqs 16`` and ``--trust-request-mm-kwargs`` (without it vLLM answers
any request with ``mm_processor_kwargs`` 400, "Per-request mm_processor_kwargs are disabled by default"). The
requests, in a seeded shuffle (:data:`MIX`, scaled to ``--requests``), each a streamed chat
(benchmarks/vllm_stream.py) with its own picture:

- ``good``: a picture and words, the engine's keep; ``good_keep``: the same with a valid keep of its own
  (``mm_processor_kwargs={"vitrim": {"keep": 4 | 8 | 0.5}}``); ``oversized``: a 2048 × 2048 picture (the
  processor shrinks it to 16 px). Expected: answered, text and ``usage.prompt_tokens`` equal to an offline ``LLM``
  with the same overrides given the same messages (``LLM.chat``, the keep as its ``mm_processor_kwargs``);
- ``broken_image``: a data URL that is not base64, a PNG cut in half, text labelled PNG; ``too_many_images``: three
  pictures where the limit is 2; ``too_long``: a prompt over ``--max-model-len``. Expected: an HTTP 4xx;
- ``bad_keep``: keep 0, −1, 17 (of 16), 1.5, "many", an unknown key, a number for the entry. Expected: a 4xx whose
  message holds the plugin's ``vitrim:`` line;
- ``cancelled``: a good request of 64 tokens whose client closes the stream after its first piece.

At the end: ``/health`` answers 200, vLLM's ``/metrics`` shows no request running or waiting (the cancelled ones
were freed), and one more good request is answered as offline. Exit status 1 if anything differs (each listed).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the checkpoint builder
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))  # the server and engine helpers
from engines import overrides, with_engine
from vllm_server import running_server
from vllm_stream import Answer, chat_body, png_url, stream_chat

from tiny_vlms.folders import save_vllm_llava

OVERRIDES = overrides("VitrimLlavaForConditionalGeneration", "visionzip", keep=6)
MAX_NUM_SEQS, IN_FLIGHT, MAX_TOKENS, CANCELLED_TOKENS = 16, 16, 8, 64
MIX = {  # kind -> count of 500
    "good": 250, "good_keep": 50, "oversized": 40, "broken_image": 40, "bad_keep": 40, "too_many_images": 20,
    "too_long": 20, "cancelled": 40,
}  # fmt: skip
# vLLM's server refuses a request's mm_processor_kwargs (a keep of its own) unless started with this flag
SERVER_ARGS = ["--max-num-seqs", str(MAX_NUM_SEQS), "--trust-request-mm-kwargs"]
ANSWERED = ("good", "good_keep", "oversized")
SHOW_SPECIALS = {"skip_special_tokens": False}
GOOD_KEEPS: tuple[Any, ...] = (4, 8, 0.5)
BAD_VITRIM: tuple[Any, ...] = ({"keep": 0}, {"keep": -1}, {"keep": 17}, {"keep": 1.5}, {"keep": "many"},
                               {"kep": 4}, 5)  # fmt: skip
BROKEN_URLS = (
    "data:image/png;base64,@@not base64@@",
    None,
    "data:image/png;base64," + base64.b64encode(b"hi").decode(),
)


def picture(seed: int, side: int = 20) -> str:
    """A random picture of ``side`` px as a PNG data URL; from 1000 px on, 16-px blocks (a small PNG)."""
    rng = np.random.default_rng(seed)
    if side < 1000:
        return png_url(rng.integers(0, 256, (side, side - 4, 3), dtype=np.uint8))
    blocks = rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8)
    return png_url(blocks.repeat(16, axis=0).repeat(16, axis=1))


def half_png(seed: int) -> str:
    """A PNG data URL cut in half (its header intact, its pixels missing)."""
    raw = base64.b64decode(picture(seed).split(",", 1)[1])
    return "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def make_request(kind: str, seed: int) -> dict[str, Any]:
    """One request of ``kind`` (module docstring): its kind, the chat body, and for answered kinds the keep."""
    rng = random.Random(seed)
    words = " ".join(f"w{rng.randrange(5, 128)}" for _ in range(rng.randrange(3, 12)))
    keep = rng.choice(GOOD_KEEPS) if kind == "good_keep" else None
    # special tokens written out: a random model often generates them, and a cancelled stream then has its text
    media, options, tokens = [image_part(picture(seed))], dict(SHOW_SPECIALS), MAX_TOKENS
    if kind == "good_keep":
        options["mm_processor_kwargs"] = {"vitrim": {"keep": keep}}
    elif kind == "oversized":
        media = [image_part(picture(seed, 2048))]
    elif kind == "broken_image":
        url = BROKEN_URLS[seed % len(BROKEN_URLS)]
        media = [image_part(url if url is not None else half_png(seed))]
    elif kind == "too_many_images":
        media = [image_part(picture(seed + i)) for i in range(3)]
    elif kind == "too_long":
        words = " ".join(f"w{rng.randrange(5, 128)}" for _ in range(600))
    elif kind == "bad_keep":
        options["mm_processor_kwargs"] = {"vitrim": BAD_VITRIM[seed % len(BAD_VITRIM)]}
    elif kind == "cancelled":
        tokens = CANCELLED_TOKENS
    return {"kind": kind, "seed": seed, "keep": keep, "body": chat_body(words, media, tokens, options)}


async def send_all(port: int, requests: list[dict[str, Any]]) -> list[Answer]:
    """Every request, IN_FLIGHT at a time; their answers in order (an exception becomes status 0 and its text)."""
    import aiohttp

    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(session: Any, request: dict[str, Any]) -> Answer:
        async with gate:
            cancel = 1 if request["kind"] == "cancelled" else None
            try:
                return await stream_chat(session, port, request["body"], cancel_after=cancel)
            except Exception as error:  # a dropped connection is a finding, not a crash of the soak
                return Answer(0, f"{type(error).__name__}: {error}", "", None, 0.0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(one(session, request) for request in requests)))


def running_requests(port: int) -> float:
    """vLLM's running + waiting requests, from its Prometheus ``/metrics``; ``RuntimeError`` where it reports
    neither (a renamed metric must not read as zero)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if len(found) != 2:
        raise RuntimeError(f"vLLM's /metrics reports {sorted(found)} of its running and waiting requests")
    return sum(found.values())


def offline_answers(folder: Path, requests: list[dict[str, Any]]) -> dict[int, tuple[str, int]]:
    """seed -> (text, prompt tokens) of each answered request through an offline ``LLM`` with the same overrides,
    the requests of one keep in one ``chat`` call (the keep as its ``mm_processor_kwargs``)."""
    from vllm import SamplingParams

    groups: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for request in requests:
        groups[json.dumps(request["keep"])].append(request)

    def run(llm: Any) -> dict[int, tuple[str, int]]:
        out = {}
        for keep, group in groups.items():
            kwargs = None if json.loads(keep) is None else {"vitrim": {"keep": json.loads(keep)}}
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **SHOW_SPECIALS)
            messages = [request["body"]["messages"] for request in group]
            for request, answer in zip(
                group, llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs=kwargs), strict=True
            ):
                out[request["seed"]] = (answer.outputs[0].text, len(answer.prompt_token_ids))
        return out

    return with_engine(folder, OVERRIDES, run, max_num_seqs=MAX_NUM_SEQS)


def problems(requests: list[dict[str, Any]], answers: list[Answer], offline: dict[int, tuple[str, int]]) -> list[str]:
    """Every request whose answer is not what its kind expects (module docstring), one line each."""
    out = []
    for request, answer in zip(requests, answers, strict=True):
        kind, seed, what = request["kind"], request["seed"], f"{request['kind']} #{request['seed']}"
        if kind in ANSWERED:
            got = (answer.text, answer.prompt_tokens)
            if answer.status != 200 or answer.error or got != offline[seed]:
                out.append(f"{what}: status {answer.status} {answer.error or ''} got {got}, offline {offline[seed]}")
        elif kind == "cancelled":
            if answer.status != 200 or answer.error or not answer.text:
                out.append(f"{what}: status {answer.status} {answer.error or ''}, text {answer.text!r}")
        elif not 400 <= answer.status < 500:
            out.append(f"{what}: status {answer.status} (expected a 4xx) {(answer.error or '')[:200]}")
        elif kind == "bad_keep" and "vitrim:" not in (answer.error or ""):
            out.append(f"{what}: no 'vitrim:' line in {(answer.error or '')[:200]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=sum(MIX.values()), help="scales MIX to this many (≥ 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the counts, statuses and problems here")
    args = parser.parse_args()
    scale = args.requests / sum(MIX.values())
    kinds = [kind for kind, count in MIX.items() for _ in range(max(1, round(count * scale)))]
    random.Random(args.seed).shuffle(kinds)
    requests = [make_request(kind, 1000 * args.seed + i) for i, kind in enumerate(kinds)]
    final = make_request("good", 10**6)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_vllm_llava(Path(tmp) / "tiny-llava")
        log = Path(tmp) / "server.log"
        with running_server(folder, OVERRIDES, log, extra=SERVER_ARGS) as port:
            start = time.perf_counter()
            answers = asyncio.run(send_all(port, requests))
            soak_s = time.perf_counter() - start
            deadline = time.monotonic() + 60
            while (left := running_requests(port)) and time.monotonic() < deadline:
                time.sleep(0.5)  # an aborted request leaves the scheduler at its next step
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
                health = response.status
            (last,) = asyncio.run(send_all(port, [final]))
        answered = [r for r in requests if r["kind"] in ANSWERED] + [final]
        offline = offline_answers(folder, answered)
    found = problems([*requests, final], [*answers, last], offline)
    if health != 200:
        found.append(f"/health answered {health}")
    if left:
        found.append(f"{left:.0f} requests still running or waiting 60 s after the soak")
    counts = collections.Counter(kinds)
    statuses = collections.Counter(f"{r['kind']} {a.status}" for r, a in zip(requests, answers, strict=True))
    print(f"{len(requests)} requests in {soak_s:.0f} s, {IN_FLIGHT} in flight: {dict(counts)}")
    print("statuses:", dict(sorted(statuses.items())))
    last = "as offline" if all(f"#{final['seed']}" not in line for line in found) else "NOT as offline"
    print(f"end: /health {health}, running + waiting {left:.0f}, a last good request {last}")
    print(f"problems: {len(found)}", *found, sep="\n")
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "statuses": statuses, "problems": found}, indent=1))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()

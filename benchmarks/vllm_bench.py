"""vLLM serving dense and vitrim-trimmed VLMs under load: requests/s, time to first token and generated tokens/s at
1, 8 and 32 concurrent requests, in one run, each ratio beside the analytic prefill MAC ratio.

    PYTHONPATH=$PWD/src .venv-vllm/bin/python benchmarks/vllm_bench.py            # 12-14 min on 2 busy cores

Concurrency as a server sees it: each family's engines run as ``vllm serve`` processes side by side (tests/vllm's
``running_server``: float32, eager, ``--max-num-seqs 32``, a 1 GiB KV cache, no prefix caching), and a client
sends c streamed chat requests at once (benchmarks/vllm_stream.py), every one a different picture or clip and prompt
of 24 words, 16 generated tokens each (``ignore_eos``). Per round: requests/s = c / (first send → last answer),
generated tokens/s = the tokens vLLM reports / that time, time to first token = the median over the c requests of
send → first streamed text. Random-weight models scaled down to fit a 2-core CPU (tests/tiny_vlms/folders.py):

- LLaVA-1.5: CLIP 4 × 256 at 224 px (256 image tokens), Llama 4 × 512; dense vs VisionZip keeping 64;
- Qwen2.5-VL: the released layout (14-px patches, temporal patches of 2 frames, 112-px windows, merger 2×2) at
  width 128 × 4 blocks, Qwen2 LLM 4 × 512 (8 heads on 2 KV heads); a 448-px image (256 tokens), a clip of 16
  frames of 224 px (8 temporal patches of 64 tokens: 512); dense vs VisionZip keeping 0.25 (of the image, of each
  temporal patch) and vs EVS pruning 0.75 of each clip.

Dense and trimmed alternate round by round (ABBA over repeats, the same requests for both), so a slow spell on
shared cores lands on both; each ratio is the median of the per-repeat ratios trimmed / dense, with their range.
The MAC ratio is vitrim.vlm.flops (images) and vitrim.vlm.flops_video (clips) on the same shapes: tower + merger +
LLM prefill + the method's own products; decode steps and the server's own work are not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the checkpoint builders
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))  # the server helper
from vllm_server import running_server
from vllm_stream import Answer, chat_body, png_url, stream_chat, video_url

from tiny_vlms.folders import STRING_CONTENT_TEMPLATE, UNTIED, save_vllm_llava
from vitrim.vlm.flops import VLM, LanguageModel, VisionTower, prefill_cost
from vitrim.vlm.flops_video import clip, video_prefill_cost
from vitrim.vlm_user.tiny import QwenGeometry, save_qwen2_5_vl

LLAVA_VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
LLAVA_TEXT = dict(
    vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8,
)  # fmt: skip
LLAVA_SIZE, LLAVA_PATCH, LLAVA_KEEP = 224, 14, 64
QWEN_VISION = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=2, out_hidden_size=512)
QWEN_TEXT: dict[str, Any] = dict(
    vocab_size=96, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "mrope_section": [16, 8, 8], "rope_theta": 10000.0}, **UNTIED,
)  # fmt: skip
QWEN_IMAGE, QWEN_FRAMES, QWEN_FRAME = 448, 16, 224  # 256 image tokens; 8 temporal patches of 64 tokens
QWEN_GEOMETRY = QwenGeometry(
    patch=14, temporal_patch=2, window=112, full_attention_blocks=(3,), max_pixels=QWEN_IMAGE**2,
    video_pixels=(64, QWEN_FRAMES * QWEN_FRAME**2),
)  # fmt: skip
SHARE = 0.25  # Qwen: VisionZip's keep fraction, EVS's 1 - video_pruning_rate
PROMPT_WORDS, MAX_TOKENS = 24, 16
SERVER_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(1 << 30)]

ENGINES = {  # family -> engine -> hf_overrides (None: vLLM's own model)
    "llava": {
        "dense": None,
        "visionzip": {
            "architectures": ["VitrimLlavaForConditionalGeneration"],
            "vitrim": {"method": "visionzip", "keep": LLAVA_KEEP},
        },
    },
    "qwen": {
        "dense": None,
        "visionzip": {
            "architectures": ["VitrimQwen2_5_VLForConditionalGeneration"],
            "vitrim": {"method": "visionzip", "keep": SHARE},
        },
        "evs": {
            "architectures": ["VitrimQwen2_5_VLForConditionalGeneration"],
            "vitrim": {"method": "evs", "video_pruning_rate": 1 - SHARE},
        },
    },
}


@dataclass(frozen=True)
class Workload:
    """One comparison: a family's dense engine against one trimmed engine, on requests with one image or clip."""

    name: str
    family: str
    trimmed: str  # a key of ENGINES[family]
    media: str  # "image" or "video"


WORKLOADS = (
    Workload("LLaVA-1.5, image, VisionZip 64 of 256", "llava", "visionzip", "image"),
    Workload("Qwen2.5-VL, image, VisionZip 0.25", "qwen", "visionzip", "image"),
    Workload("Qwen2.5-VL, video, VisionZip 0.25 per temporal patch", "qwen", "visionzip", "video"),
    Workload("Qwen2.5-VL, video, EVS pruning 0.75", "qwen", "evs", "video"),
)


def llava_flops() -> VLM:
    """The scaled LLaVA as vitrim.vlm.flops counts it (LLAVA_VISION, LLAVA_TEXT)."""
    v, t = LLAVA_VISION, LLAVA_TEXT
    tower = VisionTower(
        "CLIP 4×256", LLAVA_SIZE, LLAVA_PATCH, v["hidden_size"], v["num_hidden_layers"], v["num_attention_heads"],
        v["intermediate_size"], cls_token=True, feature_layer=-2,
    )  # fmt: skip
    head = t["hidden_size"] // t["num_attention_heads"]
    llm = LanguageModel("Llama 4×512", t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
                        t["num_key_value_heads"], head, t["intermediate_size"], t["vocab_size"])  # fmt: skip
    projector = ((v["hidden_size"], t["hidden_size"]), (t["hidden_size"], t["hidden_size"]))
    return VLM("scaled LLaVA-1.5", tower, projector, 1, llm, cut_before_projector=False)


def qwen_flops() -> VLM:
    """The scaled Qwen2.5-VL as vitrim.vlm.flops counts it at QWEN_IMAGE px (QWEN_VISION, QWEN_TEXT, QWEN_GEOMETRY)."""
    v, t, g = QWEN_VISION, QWEN_TEXT, QWEN_GEOMETRY
    tower = VisionTower(
        "Qwen2.5-VL ViT 4×128", QWEN_IMAGE, g.patch, v["hidden_size"], v["depth"], v["num_heads"],
        v["intermediate_size"], gated_mlp=True, temporal_patch=g.temporal_patch, window=(g.window // g.patch) ** 2,
        full_attention_layers=g.full_attention_blocks,
    )  # fmt: skip
    head = t["hidden_size"] // t["num_attention_heads"]
    llm = LanguageModel("Qwen2 4×512", t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"],
                        t["num_key_value_heads"], head, t["intermediate_size"], t["vocab_size"])  # fmt: skip
    merged = 4 * v["hidden_size"]
    projector = ((merged, merged), (merged, v["out_hidden_size"]))
    return VLM("scaled Qwen2.5-VL", tower, projector, 4, llm, cut_before_projector=False)


def mac_ratio(workload: Workload) -> float:
    """Prefill MACs trimmed / dense of one request of ``workload`` (its image or clip and PROMPT_WORDS words)."""
    if workload.family == "llava":
        vlm, keep = llava_flops(), LLAVA_KEEP
    else:
        vlm, keep = qwen_flops(), round(SHARE * qwen_flops().image_tokens)
    if workload.media == "image":
        dense = prefill_cost(vlm, "none", text_tokens=PROMPT_WORDS)
        return prefill_cost(vlm, "visionzip", keep, text_tokens=PROMPT_WORDS).total / dense.total
    video = clip(vlm, QWEN_FRAMES // QWEN_GEOMETRY.temporal_patch, QWEN_FRAME)
    dense = video_prefill_cost(video, text_tokens=PROMPT_WORDS)
    trimmed = video_prefill_cost(video, workload.trimmed, SHARE, text_tokens=PROMPT_WORDS)
    return trimmed.total / dense.total


def bodies(workload: Workload, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` distinct streamed chat requests of ``workload``: random pixels (a clip: a random first frame, then
    a third of each next frame's 28-px cells redrawn, so EVS has motion to rank) and PROMPT_WORDS random words."""
    rng = np.random.default_rng(seed)
    words = (5, LLAVA_TEXT["vocab_size"]) if workload.family == "llava" else (3, 90)
    out = []
    for _ in range(count):
        text = " ".join(f"w{i}" for i in rng.integers(*words, PROMPT_WORDS))
        if workload.media == "image":
            side = LLAVA_SIZE if workload.family == "llava" else QWEN_IMAGE
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            media = {"type": "image_url", "image_url": {"url": png_url(pixels)}}
        else:
            frame = rng.integers(0, 256, (QWEN_FRAME, QWEN_FRAME, 3), dtype=np.uint8)
            frames = [frame]
            cells = QWEN_FRAME // 28
            for _ in range(QWEN_FRAMES - 1):
                frame = frame.copy()
                for r, c in zip(*np.nonzero(rng.random((cells, cells)) < 0.35), strict=True):
                    frame[r * 28 : (r + 1) * 28, c * 28 : (c + 1) * 28] = rng.integers(0, 256, (28, 28, 3))
                frames.append(frame)
            media = {"type": "video_url", "video_url": {"url": video_url(np.stack(frames))}}
        out.append(chat_body(text, [media], MAX_TOKENS, {"ignore_eos": True, "skip_special_tokens": False}))
    return out


def server_cpu_s(port: int) -> float:
    """CPU seconds (user + system) spent so far by the server listening on ``port`` and its processes (the API
    server, vLLM's engine core): what a round costs the machine, whoever else runs on it."""
    import psutil

    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == "LISTEN"}
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in (root, *root.children(recursive=True)))


async def one_round(port: int, requests: list[dict[str, Any]]) -> tuple[float, float, list[Answer]]:
    """All ``requests`` sent at once; the wall time to the last answer, the server's CPU seconds, the answers."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        cpu, start = server_cpu_s(port), time.perf_counter()
        answers = await asyncio.gather(*(stream_chat(session, port, body) for body in requests))
        return time.perf_counter() - start, server_cpu_s(port) - cpu, list(answers)


def round_numbers(wall: float, cpu: float, answers: list[Answer]) -> dict[str, float]:
    """requests/s, generated tokens/s, the median time to first token (ms) and the server's CPU ms per request of
    one round; SystemExit naming the first failed request (a benchmark of failures measures nothing)."""
    for answer in answers:
        if answer.status != 200 or answer.error or answer.ttft_s is None or answer.completion_tokens != MAX_TOKENS:
            raise SystemExit(f"a request failed: {answer}")
    return {
        "requests_per_s": len(answers) / wall,
        "tokens_per_s": sum(a.completion_tokens or 0 for a in answers) / wall,
        "ttft_ms": 1000 * statistics.median(a.ttft_s or 0.0 for a in answers),
        "cpu_ms_per_request": 1000 * cpu / len(answers),
        "prompt_tokens": float(answers[0].prompt_tokens or 0),
    }


def run_family(family: str, folder: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start the family's servers side by side, warm each, then the interleaved rounds; per workload, concurrency
    and engine, the list of round numbers (one per repeat)."""
    workloads = [w for w in WORKLOADS if w.family == family]
    limits = {"image": 1} if family == "llava" else {"image": 1, "video": 1}
    results: dict[str, Any] = {w.name: {c: {"dense": [], "trimmed": []} for c in args.concurrency} for w in workloads}
    with contextlib.ExitStack() as servers:
        ports = {
            engine: servers.enter_context(
                running_server(folder, overrides, work / f"{family}-{engine}.log", limits, SERVER_ARGS)
            )
            for engine, overrides in ENGINES[family].items()
        }
        for index, workload in enumerate(workloads):  # warm-up: the first requests allocate and load lazily
            for engine in ("dense", workload.trimmed):
                asyncio.run(one_round(ports[engine], bodies(workload, 2, 10_000 + index)))
        for repeat in range(args.repeats):
            for step, count in enumerate(args.concurrency):
                for index, workload in enumerate(workloads):
                    requests = bodies(workload, count, 1000 * repeat + 100 * step + index)
                    order = ["dense", "trimmed"] if (repeat + step) % 2 == 0 else ["trimmed", "dense"]
                    for side in order:
                        port = ports["dense" if side == "dense" else workload.trimmed]
                        numbers = round_numbers(*asyncio.run(one_round(port, requests)))
                        results[workload.name][count][side].append(numbers)
                        print(f"{workload.name} c={count} r={repeat} {side}: {numbers}", flush=True)
    return results


def summary(name: str, rounds: dict[int, dict[str, list[dict[str, float]]]]) -> list[str]:
    """Markdown rows of one workload, one per concurrency: the prompt's tokens, then requests/s and the time to first
    token, each as the medians over repeats of dense and trimmed and the median [min–max] of the per-repeat ratios
    trimmed / dense (generated tokens/s is MAX_TOKENS × requests/s: every request generates MAX_TOKENS); then the
    server's CPU per request, which other jobs on the machine disturb less than the wall clock."""
    workload = next(w for w in WORKLOADS if w.name == name)
    lines = [
        f"| {name}: MAC ratio {mac_ratio(workload):.3f} | prompt tokens | requests/s dense | trimmed | ratio "
        "| TTFT ms dense | trimmed | ratio | server CPU ms / request dense | trimmed | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for count, sides in rounds.items():
        dense, trimmed = sides["dense"], sides["trimmed"]
        cells = [f"{count} concurrent", f"{dense[0]['prompt_tokens']:.0f} → {trimmed[0]['prompt_tokens']:.0f}"]
        for key in ("requests_per_s", "ttft_ms", "cpu_ms_per_request"):
            ratios = [t[key] / d[key] for d, t in zip(dense, trimmed, strict=True)]
            d, t = statistics.median(x[key] for x in dense), statistics.median(x[key] for x in trimmed)
            digits = 2 if key == "requests_per_s" else 0
            cells += [f"{d:.{digits}f}", f"{t:.{digits}f}"]
            cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds per engine and concurrency (medians)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--families", nargs="+", default=["llava", "qwen"], choices=list(ENGINES))
    parser.add_argument("--json", type=Path, help="also write every round's numbers here")
    args = parser.parse_args()
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folders = {
            "llava": lambda: save_vllm_llava(
                work / "llava", 0, LLAVA_SIZE, LLAVA_PATCH, LLAVA_VISION, LLAVA_TEXT
            ),
            "qwen": lambda: save_qwen2_5_vl(
                work / "qwen", 0, QWEN_VISION, QWEN_TEXT, UNTIED, STRING_CONTENT_TEMPLATE, "hub",
                geometry=QWEN_GEOMETRY,
            ),
        }  # fmt: skip
        for family in args.families:
            results |= run_family(family, folders[family](), work, args)
    for name, rounds in results.items():
        print("\n" + "\n".join(summary(name, rounds)))
    print(f"generated tokens/s = {MAX_TOKENS} × requests/s")
    load = os.getloadavg()[2]  # the machine's 15-minute load average: other jobs on the same cores
    print(f"\n{args.repeats} repeats, {time.perf_counter() - started:.0f} s in all, load average {load:.1f} at the end")
    if args.json:
        record = {"args": vars(args) | {"json": str(args.json)}, "load": load, "rounds": results}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

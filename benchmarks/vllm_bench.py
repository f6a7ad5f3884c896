"""vLLM serving a LLaVA-1.5 dense and trimmed by a vitrim method: throughput and time to first token, one run.

    .venv-vllm/bin/python benchmarks/vllm_bench.py --method visionzip --keep 64
    .venv-vllm/bin/python benchmarks/vllm_bench.py --model llava-hf/llava-1.5-7b-hf --keep 64   # on a GPU

Without ``--model`` it builds a scaled-down LLaVA-1.5 with random weights (tests/tiny_vlms/folders.py: a 4-layer CLIP
of width 256 at 224 px / 14 px patches = 256 image tokens per image, a 4-layer Llama of width 512), so the run fits
a 2-core CPU; with ``--model`` it serves that checkpoint. The same script runs on a GPU unchanged (bfloat16 there,
float32 on a CPU). Per engine (vLLM's LLaVA, then VitrimLlavaForConditionalGeneration with the method):

- **throughput**: ``--requests`` requests, each a different image and prompt, in one ``generate`` (vLLM batches
  them): requests/s and generated tokens/s over the wall time;
- **TTFT**: one request alone with ``max_tokens=1`` (tower, projector, prefill and one token), the median of
  ``--ttft-runs`` distinct requests, after one warm-up.

It prints both, the measured ratios trimmed / dense, and the analytic prefill MAC ratio of the same model and
prompt (vitrim.vlm.flops: tower + projector + LLM + the method's own products), which bounds what the trim can
save in the prefill; decode steps and the engine's own overhead are not in it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the checkpoint builder
from tiny_vlms.folders import save_vllm_llava
from vitrim.vlm.flops import VLM, LanguageModel, VisionTower, prefill_cost

BENCH_VISION = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
BENCH_TEXT = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
)
IMAGE_SIZE, PATCH_SIZE = 224, 14
PROMPT_WORDS = 24


def scaled_vlm() -> VLM:
    """The scaled-down model as vitrim.vlm.flops counts it (the same numbers as BENCH_VISION / BENCH_TEXT)."""
    v, t = BENCH_VISION, BENCH_TEXT
    tower = VisionTower(
        "CLIP 4×256 at 224",
        IMAGE_SIZE,
        PATCH_SIZE,
        v["hidden_size"],
        v["num_hidden_layers"],
        v["num_attention_heads"],
        v["intermediate_size"],
        cls_token=True,
        feature_layer=-2,
    )
    head = t["hidden_size"] // t["num_attention_heads"]
    llm = LanguageModel(
        "Llama 4×512",
        t["hidden_size"],
        t["num_hidden_layers"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        head,
        t["intermediate_size"],
        t["vocab_size"],
    )
    projector = ((v["hidden_size"], t["hidden_size"]), (t["hidden_size"], t["hidden_size"]))
    return VLM("scaled-llava", tower, projector, 1, llm, cut_before_projector=False)


def requests(count: int, seed: int, image_size: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
        words = " ".join(f"w{i}" for i in rng.integers(5, 1000, PROMPT_WORDS))
        out.append({"prompt": f"<image> {words}", "multi_modal_data": {"image": image}})
    return out


def measure(model: str, hf_overrides: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, float]:
    from vllm.distributed import cleanup_dist_env_and_memory

    from vllm import LLM, SamplingParams

    on_gpu = torch.cuda.is_available()
    llm = LLM(
        model=model,
        hf_overrides=hf_overrides,
        dtype="bfloat16" if on_gpu else "float32",
        enforce_eager=not on_gpu,
        max_model_len=2048,
        max_num_seqs=args.requests,
        seed=0,
        limit_mm_per_prompt={"image": 1},
        enable_prefix_caching=False,
        **({} if on_gpu else {"kv_cache_memory_bytes": 1 << 30}),
    )
    try:
        batch = requests(args.requests, 1, args.image_size)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(requests(1, 99, args.image_size), params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        first = SamplingParams(max_tokens=1, temperature=0.0)
        ttft = []
        for request in requests(args.ttft_runs, 2, args.image_size):
            start = time.perf_counter()
            llm.generate([request], first, use_tqdm=False)
            ttft.append(time.perf_counter() - start)
        return {
            "prompt_tokens": float(len(outputs[0].prompt_token_ids)),
            "requests_per_s": args.requests / wall,
            "tokens_per_s": generated / wall,
            "ttft_ms": 1000 * statistics.median(ttft),
        }
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a LLaVA-1.5 checkpoint (default: a scaled-down random one, built here)")
    parser.add_argument("--method", default="visionzip")
    parser.add_argument("--keep", type=int, default=64, help="image tokens kept per image")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ttft-runs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = args.model
        if model is None:
            model = str(
                save_vllm_llava(Path(work) / "scaled-llava", 0, IMAGE_SIZE, PATCH_SIZE, BENCH_VISION, BENCH_TEXT)
            )
        from transformers import AutoConfig

        vision = AutoConfig.from_pretrained(model).vision_config
        args.image_size = vision.image_size
        trimmed_overrides = {
            "architectures": ["VitrimLlavaForConditionalGeneration"],
            "vitrim": {"method": args.method, "keep": args.keep},
        }
        dense = measure(model, None, args)
        trimmed = measure(model, trimmed_overrides, args)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    result |= {"method": args.method, "keep": args.keep, "dense": dense, "trimmed": trimmed}
    result["measured_ratio"] = {key: trimmed[key] / dense[key] for key in dense}
    if args.model is None:
        text = PROMPT_WORDS
        macs_dense = prefill_cost(scaled_vlm(), "none", text_tokens=text)
        macs_trim = prefill_cost(scaled_vlm(), args.method, args.keep, text_tokens=text)
        result["prefill_mac_ratio"] = macs_trim.total / macs_dense.total
        result["llm_mac_ratio"] = macs_trim.llm / macs_dense.llm
    print(f"{'':14}{'dense':>10}{'trimmed':>10}{'ratio':>8}")
    for key in dense:
        print(f"{key:14}{dense[key]:10.2f}{trimmed[key]:10.2f}{result['measured_ratio'][key]:8.3f}")
    for key in ("prefill_mac_ratio", "llm_mac_ratio"):
        if key in result:
            print(f"{key}: {result[key]:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

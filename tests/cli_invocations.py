"""A cheap, valid invocation of every ``vitrim`` command, for the tests that sweep the CLI (the fuzz, the run
without extras). :func:`leaf_commands` lists what the parser has, so a new subcommand without an entry here fails
those tests instead of going unchecked."""

from __future__ import annotations

import argparse
from pathlib import Path

import vitrim
from vitrim.cli import build_parser
from vitrim.literals import parse_assignments

TINY = "embed_dim=16,depth=2,num_heads=2,img_size=16,patch_size=8,in_chans=1"


def leaf_commands() -> set[str]:
    """Every command path that runs by itself: 'models', 'bench attention', 'viz tokens', 'demo translate', …"""
    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if prefix and not any(action.required for action in subs):  # a group like 'bench' needs a KIND
            found.add(prefix.strip())
        for action in subs:
            for name, sub in action.choices.items():
                walk(sub, f"{prefix} {name}")

    walk(build_parser(), "")
    return found


def tiny_checkpoint(tmp: Path) -> Path:
    """A 10-class grey 16x16 ViT of two blocks, saved as vitrim saves (what ``eval``, ``export``, ``viz`` read)."""
    model = vitrim.create_model("vit_tiny_patch16_224", num_classes=10, **parse_assignments(TINY, "TINY"))
    return vitrim.save_checkpoint(model, tmp / "tiny.safetensors")


def blank_png(tmp: Path) -> Path:
    """A black 64x64 PNG (an empty canvas for the digits VLM); the file's bytes are written by hand (no Pillow)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(64) for _ in range(64))  # filter 0, 64 grey pixels of 0
    header = struct.pack(">IIBBBBB", 64, 64, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path = tmp / "blank.png"
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )
    return path


def invocations(tmp: Path) -> dict[str, list[str]]:
    """Command path -> argv that runs it cheaply, writing under ``tmp`` (the ``translate`` one needs the run that
    ``demo translate`` writes first; ``vlm ask`` and ``viz vlm`` the one of ``demo vlm``)."""
    ckpt = str(tiny_checkpoint(tmp))
    speed = ["--repeats", "1", "--warmup", "0"]
    return {
        "models": ["models", "deit_*"],
        "explain": ["explain", "--seed", "1", "--out", str(tmp / "explain.png")],
        "train": [
            "train",
            "--model",
            "vit_tiny_patch16_224",
            "--set",
            TINY,
            "--epochs",
            "1",
            "--batch-size",
            "256",
            "--out",
            str(tmp / "run"),
            "--quiet",
            "--threads",
            "1",
        ],
        "eval": ["eval", ckpt, "--batch-size", "64"],
        "export": ["export", ckpt, "--onnx", str(tmp / "tiny.onnx")],
        "demo": ["demo", "--quick", "--out", str(tmp / "demo"), "--quiet"],
        "demo translate": ["demo", "translate", "--quick", "--steps", "1", "--out", str(tmp / "translate"), "--quiet"],
        "translate": ["translate", "twenty-one", "--run", str(tmp / "translate")],
        "demo vlm": ["demo", "vlm", "--quick", "--methods", "random", "--out", str(tmp / "vlm"), "--quiet"],
        "demo video": ["demo", "video", "--quick", "--methods", "random", "--out", str(tmp / "video"), "--quiet"],
        "vlm ask": ["vlm", "ask", "which digit ?", "--image", str(blank_png(tmp)), "--run", str(tmp / "vlm")],
        "viz vlm": ["viz", "vlm", "--run", str(tmp / "vlm"), "--method", "random", "--out", str(tmp / "vlm.png")],
        "viz attention": ["viz", "attention", "--checkpoint", ckpt, "--digits", "0", "--out", str(tmp / "attn.png")],
        "viz rollout": ["viz", "rollout", "--checkpoint", ckpt, "--digits", "0", "--out", str(tmp / "roll.png")],
        "viz relevance": ["viz", "relevance", "--checkpoint", ckpt, "--digits", "0", "--out", str(tmp / "rel.png")],
        "viz tokens": [
            "viz",
            "tokens",
            "--model",
            "dynamicvit_tiny_patch16_224",
            "--img-size",
            "32",
            "--digits",
            "0",
            "--out",
            str(tmp / "kept.png"),
        ],
        "viz rollout-memory": [
            "viz",
            "rollout-memory",
            "--model",
            "vit_tiny_patch16_224",
            "--img-size",
            "32",
            "--modes",
            "stream",
        ],
        "bench attention": ["bench", "attention", "--lengths", "8", "--repeats", "1", "--memory-length", "0"],
        "bench models": [
            "bench",
            "models",
            "vit_tiny_patch16_224",
            "--set",
            TINY,
            "--batch-size",
            "2",
            "--latency-repeats",
            "0",
            "--no-memory",
            *speed,
        ],
        "bench vlm": [
            "bench",
            "vlm",
            "--set",
            "vision_width=32,vision_mlp=48,vision_heads=4,image_size=56,llm_width=32,llm_mlp=40,llm_heads=4",
            "--methods",
            "random",
            "--keep",
            "4",
            *speed,
        ],
        "vlm flops": ["vlm", "flops", "--models", "gemma-3-4b", "--keep", "64"],
        "vlm methods": ["vlm", "methods", "--stage", "in_llm"],
        "bench ops": ["bench", "ops", "vit_tiny_patch16_224", "--set", TINY, "--reducer", "tome:r=2"],
        "bench reducers": [
            "bench",
            "reducers",
            "--models",
            "vit_tiny_patch16_224",
            "--set",
            TINY,
            "--targets",
            "60%",
            "--batch-sizes",
            "1",
            *speed,
            "--out",
            str(tmp / "bench_reducers"),
        ],
    }

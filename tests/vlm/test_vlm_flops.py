"""The analytic VLM prefill MACs against independent counts: torch's FlopCounterMode on transformers' own modules
(the real configs on the meta device, where nothing is computed; a tiny Qwen2.5-VL tower on real tensors for its
windows), and a hand computation of one LLaVA-1.5 layer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitrim.cli import main
from vitrim.vlm.flops import (
    CONFIGS,
    GEMMA3_4B,
    LLAVA_15_7B,
    QWEN25_VL_7B,
    VLM,
    VisionTower,
    cost_table,
    llm_block_macs,
    llm_macs,
    prefill_cost,
    tower_macs,
)

transformers = pytest.importorskip("transformers")


def counted_macs(fn) -> int:
    """Multiply-adds of ``fn()`` by torch's own counter (eager attention: plain matmuls it knows)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2


def test_one_llava_layer_by_hand() -> None:
    # Llama-2-7B at 670 positions: per position the weights of q, k, v, o (4 × 4096²) and gate, up, down
    # (3 × 4096 × 11008) = 202,375,168 MACs; attention 2 × 32 heads × 670² × 128.
    linear = 670 * 202_375_168  # 135,591,362,560
    attention = 2 * 32 * 670 * 670 * 128  # 3,677,388,800
    assert llm_block_macs(LLAVA_15_7B.llm, 670) == 139_268_751_360 == linear + attention


def _meta_llm_macs(config, cls, tokens: int) -> int:
    with torch.device("meta"):
        model = cls(config)
        ids = torch.zeros(1, tokens, dtype=torch.long)
    return counted_macs(lambda: model(input_ids=ids, logits_to_keep=1))


@pytest.mark.parametrize(
    ("vlm", "cls", "make"),
    [
        (LLAVA_15_7B, "LlamaForCausalLM", lambda L: transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=L, num_attention_heads=32,
            num_key_value_heads=32, vocab_size=32064)),
        (QWEN25_VL_7B, "Qwen2ForCausalLM", lambda L: transformers.Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=L, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064)),
        (GEMMA3_4B, "Gemma3ForCausalLM", lambda L: transformers.Gemma3TextConfig(
            hidden_size=2560, intermediate_size=10240, num_hidden_layers=L, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, vocab_size=262208)),
    ],
    ids=["llama-2-7b", "qwen2.5-7b", "gemma-3-4b"],
)  # fmt: skip
def test_llm_layers_equal_transformers_count(vlm: VLM, cls: str, make) -> None:
    """Two real-width layers and the LM head on the last position, as transformers runs them (meta device)."""
    config = make(2)
    config._attn_implementation = "eager"
    counted = _meta_llm_macs(config, getattr(transformers, cls), 300)
    assert llm_macs(dataclasses.replace(vlm.llm, layers=2), [300, 300]) == counted


def test_clip_tower_equals_transformers_count() -> None:
    config = transformers.CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336,
        patch_size=14,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.CLIPVisionModel(config)
        pixels = torch.empty(1, 3, 336, 336)
    assert tower_macs(LLAVA_15_7B.tower) == counted_macs(lambda: model(pixel_values=pixels))


def test_siglip_tower_equals_transformers_count() -> None:
    config = transformers.SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
        patch_size=14, vision_use_head=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.SiglipVisionModel(config)
        pixels = torch.empty(1, 3, 896, 896)
    assert tower_macs(GEMMA3_4B.tower) == counted_macs(lambda: model(pixel_values=pixels))


def test_qwen_windows_and_merger_equal_transformers_count() -> None:
    """A small Qwen2.5-VL tower on real tensors (windows come from values): 16×16 patches, four 8×8 windows."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=48, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    side = 16
    pixels = torch.randn(side * side, 3 * 2 * 14 * 14)
    grid = torch.tensor([[1, side, side]])
    counted = counted_macs(lambda: model(pixels, grid_thw=grid))
    tower = VisionTower("tiny", side * 14, 14, 32, 4, 2, 40, gated_mlp=True, temporal_patch=2, window=64,
                        full_attention_layers=(1, 3))  # fmt: skip
    merger = (side * side // 4) * (128 * 128 + 128 * 48)
    assert tower_macs(tower) + merger == counted


def test_cutting_counts_what_runs() -> None:
    text = 94
    full = prefill_cost(LLAVA_15_7B, text_tokens=text)
    assert full.tokens_per_layer == (670,) * 32
    pre = prefill_cost(LLAVA_15_7B, "visionzip", 64, text_tokens=text)
    assert pre.tokens_per_layer == (158,) * 32 and pre.image_tokens_entering_llm == 64
    # vitrim's plumbing runs the projector on every slot and drops slots at the LLM's input
    assert pre.projector == full.projector == 576 * (1024 * 4096 + 4096 * 4096) and pre.tower == full.tower
    fastv = prefill_cost(LLAVA_15_7B, "fastv", 64, text_tokens=text)
    assert fastv.tokens_per_layer == (670, 670) + (158,) * 30
    assert fastv.image_tokens_entering_llm == 576
    assert fastv.image_tokens_layer_mean == (2 * 576 + 30 * 64) / 32 == 96.0
    pdrop = prefill_cost(LLAVA_15_7B, "pdrop", 128, text_tokens=text)  # 576 | 128 | 64 | 32 from layers 8, 16, 24
    assert pdrop.tokens_per_layer == (670,) * 8 + (222,) * 8 + (158,) * 8 + (126,) * 8
    assert pdrop.image_tokens_layer_mean == (576 + 128 + 64 + 32) / 4
    qwen = prefill_cost(QWEN25_VL_7B, "random", 64)  # Qwen2.5-VL's merger makes the LLM tokens: it runs on all
    assert qwen.projector == prefill_cost(QWEN25_VL_7B).projector == 576 * (5120 * 5120 + 5120 * 3584)


def test_tome_in_the_tower_shrinks_blocks_after_the_feature_layer_too() -> None:
    cost = prefill_cost(LLAVA_15_7B, "tome", 64)
    assert cost.tower < tower_macs(LLAVA_15_7B.tower)
    # 23 blocks up to layer -2, an even spread of the 512 merges (no block merges half its tokens here): block i
    # runs on what block i - 1 left, the 24th on the 64 left at the feature layer; + [CLS]
    left = [576 - 512 * done // 23 for done in range(1, 24)]
    expected = [577, *(n + 1 for n in left)]
    assert expected[-1] == 65
    assert tower_macs(LLAVA_15_7B.tower, expected) == cost.tower
    with pytest.raises(ValueError, match="gemma-3-4b pools 16 patches"):
        prefill_cost(GEMMA3_4B, "tome", 64)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"keep must be an int in 1\.\.256 .*gemma-3-4b.*got 300"):
        prefill_cost(GEMMA3_4B, "random", 300)
    with pytest.raises(ValueError, match="unknown method 'fastvv'"):
        prefill_cost(LLAVA_15_7B, "fastvv", 64)
    with pytest.raises(ValueError, match="tokens_per_layer has 3 entries"):
        tower_macs(LLAVA_15_7B.tower, [1, 2, 3])


def test_every_config_and_method_reduces() -> None:
    for vlm in CONFIGS.values():
        rows = cost_table(vlm)
        base = rows[0].total
        assert all(r.total < base for r in rows[1:]), vlm.name


def test_cli_prints_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flops.json"
    assert main(["vlm", "flops", "--models", "llava-1.5-7b", "--methods", "fastv", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fastv | 64 |" in printed and "| 576 | 96.0 |" in printed
    rows = json.loads(out.read_text())["models"]["llava-1.5-7b"]
    assert [r["keep"] for r in rows] == [None, 64, 128, 192]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--keep", "0"], "--keep must be positive"),
        (["--keep", "a"], "--keep must be comma-separated ints"),
        (["--models", "llava"], "--models must name some of"),
        (["--methods", "tome", "--keep", "600"], "keep must be an int in 1..576"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vlm", "flops", *argv]) == 2
    assert message in capsys.readouterr().err


def test_vispruner_s_own_count_follows_the_authors_rounds_by_hand() -> None:
    # 16 image tokens (a 4×4 grid of width 8 and [CLS]), keep 8: 4 important, 4 diverse from a rest of 12; one round
    # compares 6 a-tokens with 6 b-tokens (36 cosines of width 8) and drops 8, leaving 4. The [CLS] row: its query
    # (8 × 8), the 17 keys (17 × 8 × 8) and 17 dot products of width 8.
    tower = VisionTower("tiny", 8, 2, 8, 2, 2, 16, cls_token=True, feature_layer=-2)
    vlm = dataclasses.replace(LLAVA_15_7B, tower=tower, projector=((8, 8),))
    assert prefill_cost(vlm, "vispruner", 8).method_own == 8 * 8 + 17 * 8 * 8 + 17 * 8 + 36 * 8


def test_the_new_pre_llm_methods_count_their_own_products_by_hand() -> None:
    """LLaVA-1.5-7B at keep 64, 94 text tokens: n = 576 image tokens, tower width 1024 on 577 tokens, LLM width 4096."""
    n, d, tokens, e, k, text = 576, 1024, 577, 4096, 64, 94
    cls_row = d * d + tokens * d * d + tokens * d
    own = lambda method: prefill_cost(LLAVA_15_7B, method, k, text_tokens=text).method_own  # noqa: E731
    assert own("downsample") == 0
    assert own("scope") == cls_row + n * n * d
    assert own("cdpruner") == n * n * e + n * k * (k - 1) // 2 + n * text * e  # theta=None: relevance counted
    assert own("visionzip") == cls_row + (n - k) * 10 * d  # the registry's 54 : 10 split at 64
    for method in ("downsample", "scope", "cdpruner", "hiprune", "flowcut"):
        assert prefill_cost(LLAVA_15_7B, method, k, text_tokens=text).tokens_per_layer == (k + text,) * 32


def test_the_tower_methods_count_their_tower_and_own_products_by_hand() -> None:
    """LLaVA-1.5-7B at keep 64: CLIP-L's 24 blocks on 577 tokens, the feature block 22 (0-based). HiPrune: blocks
    0 … 22 attend over all 577, block 22's MLP and block 23 run on 65; its own: the global attention (577 × 577 ×
    1024) of blocks 8 and 22. FlowCut (upper bound): all 577 up to block 21's attention, 65 from its MLP on; its own:
    [CLS]'s attention and value rows (577 × 1024 each) in blocks 0 … 21."""
    d, m, n, kept, k = 1024, 4096, 577, 65, 64
    block = lambda t: 4 * t * d * d + 2 * t * t * d + 2 * t * d * m  # noqa: E731
    attention, mlp = (lambda t: 4 * t * d * d + 2 * t * t * d), (lambda t: 2 * t * d * m)
    embed = 576 * 3 * 14 * 14 * d
    hiprune = prefill_cost(LLAVA_15_7B, "hiprune", k)
    assert hiprune.tower == embed + 22 * block(n) + attention(n) + mlp(kept) + block(kept)
    assert hiprune.method_own == 2 * n * n * d
    flowcut = prefill_cost(LLAVA_15_7B, "flowcut", k)
    assert flowcut.tower == embed + 21 * block(n) + attention(n) + mlp(kept) + 2 * block(kept)
    assert flowcut.method_own == 22 * 2 * n * d
    assert hiprune.llm == flowcut.llm == prefill_cost(LLAVA_15_7B, "random", k).llm

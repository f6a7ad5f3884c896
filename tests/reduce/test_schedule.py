"""DiffRate's searched schedules as presets: the token counts they state, their FLOPs on DeiT-S / DeiT-B, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reduce_models import tiny

import vitrim
from vitrim.bench.flops import model_flops_per_image
from vitrim.reduce.schedule import SCHEDULES, get_schedule

# Tokens after each block, [CLS] included, for DeiT-S at 2.9 GFLOPs, read by hand from compression_rate.json: the
# merge list, as every merge count there is at most the prune count and the previous block's tokens.
DEIT_S_29 = [197, 194, 176, 156, 141, 133, 121, 107, 88, 64, 56, 3]


def narrow_deit_s() -> torch.nn.Module:
    """DeiT-S's depth and token count (12 blocks, 197 tokens) at a small width, for fast count checks."""
    torch.manual_seed(0)
    return vitrim.create_model("deit_small_patch16_224", embed_dim=48, num_classes=5).eval()


def test_presets_quote_diffrate() -> None:
    assert len(SCHEDULES) == 10
    s = get_schedule("diffrate_deit_s_2.9")
    assert s.prune_kept == (197, 196, 190, 168, 150, 139, 129, 117, 99, 78, 58, 3)
    assert s.tokens_after() == tuple(DEIT_S_29) and s.gflops == 2.9
    # DeiT-B 11.5: block 2 prunes nothing (197) but merges to 192
    assert get_schedule("diffrate_deit_b_11.5").tokens_after()[:4] == (197, 197, 192, 178)


@pytest.mark.parametrize("name", ["diffrate", "topk", "evit", "zero_tprune", "tome"])
def test_a_schedule_gives_the_stated_tokens_after_every_block(name: str) -> None:
    model = vitrim.reduce.apply(narrow_deit_s(), name, schedule="diffrate_deit_s_2.9")
    with torch.no_grad():
        out = model.forward_detailed(torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0)))
    after = [p.shape[1] + 1 for p in out.block_positions[1:]] + [out.tokens.shape[1]]
    # ToMe merges at most half of the tokens in a block: 56 -> 29, not 3, in the last block (whose MLP does not
    # change [CLS], so the logits are those of the schedule)
    assert after == ([*DEIT_S_29[:-1], 29] if name == "tome" else DEIT_S_29)


def test_create_model_takes_a_schedule_and_a_saved_model_keeps_it(tmp_path: Path) -> None:
    model = vitrim.create_model(
        "deit_small_patch16_224", embed_dim=48, num_classes=5, reducer="zero_tprune", schedule="diffrate_deit_s_2.9"
    ).eval()
    # the blocks that remove tokens (all but block 0), each keeping the preset's count less [CLS]
    assert [b.reducer.keep_count for b in model.blocks[1:]] == [n - 1 for n in DEIT_S_29[1:]]
    assert model.blocks[0].reducer is None
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    loaded = vitrim.load_model(vitrim.save_checkpoint(model, tmp_path / "m.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def diffrate_gmacs(preset: str, width: int) -> float:
    """DiffRate's own count (``calculate_flop_inference``): per block 4NC² + 2N²C before and 8NC² after the
    reduction, the patch embedding at N = 197 tokens, the classifier; multiply-adds."""
    s, N, total = get_schedule(preset), 197, 0
    for prune, merge in zip(s.prune_kept, s.merge_kept):
        total += 4 * N * width**2 + 2 * N * N * width
        N = min(N, prune, merge)
        total += 8 * N * width**2
    return (total + 197 * width * 16 * 16 * 3 + width * 1000) / 1e9


@pytest.mark.parametrize(
    ("model_name", "width", "preset", "reducer"),
    [
        ("deit_small_patch16_224", 384, "diffrate_deit_s_2.9", "diffrate"),
        ("deit_small_patch16_224", 384, "diffrate_deit_s_2.3", "topk"),
        ("deit_base_patch16_224", 768, "diffrate_deit_b_11.5", "diffrate"),
    ],
)
def test_flops_match_the_stated_figure(model_name: str, width: int, preset: str, reducer: str) -> None:
    model = vitrim.reduce.apply(vitrim.create_model(model_name).eval(), reducer, schedule=preset)
    gmacs = model_flops_per_image(model, 224) / 2e9  # vitrim counts 2 FLOPs per multiply-add; DiffRate counts 1
    # DiffRate's own count of the schedule (its README: 2.905 for "2.9", 11.517 for "11.5"): the names are the
    # search targets. vitrim also counts the reducer's own products ([CLS] row, similarities): a little more.
    assert 0 <= gmacs - diffrate_gmacs(preset, width) < 0.002 * gmacs, (gmacs, diffrate_gmacs(preset, width))
    stated = get_schedule(preset).gflops
    assert abs(gmacs - stated) / stated < 0.015, gmacs


def test_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'diffrate_deit_s_9'; expected one of \["):
        vitrim.reduce.apply(narrow_deit_s(), "topk", schedule="diffrate_deit_s_9")
    with pytest.raises(
        ValueError, match=r"searched for DiffRate DeiT-S: 12 blocks and 197 tokens .* the model has 4 blocks and 17"
    ):
        vitrim.reduce.apply(tiny(), "topk", schedule="diffrate_deit_s_2.9")
    distilled = vitrim.create_model("deit_small_patch16_224", embed_dim=48, distilled=True)
    with pytest.raises(ValueError, match=r"the model has 12 blocks and 198 tokens \(2 prefix \+ 196 patches\)"):
        vitrim.reduce.apply(distilled, "diffrate", schedule="diffrate_deit_s_2.9")
    with pytest.raises(ValueError, match=r"reducer 'pitome' takes no schedule .*these do: \['diffrate', 'evit'"):
        vitrim.reduce.apply(narrow_deit_s(), "pitome", schedule="diffrate_deit_s_2.9")
    with pytest.raises(ValueError, match=r"pass schedule or layers, not both"):
        vitrim.reduce.apply(narrow_deit_s(), "topk", schedule="diffrate_deit_s_2.9", layers=(1, 2))
    with pytest.raises(ValueError, match=r"sets \['keep_count'\] itself"):
        vitrim.reduce.apply(narrow_deit_s(), "topk", schedule="diffrate_deit_s_2.9", keep_count=5)
    model = narrow_deit_s()
    with pytest.raises(ValueError, match=r"schedule"):
        vitrim.reduce.apply(model, "topk", schedule=2.9)
    assert all(block.reducer is None for block in model.blocks)

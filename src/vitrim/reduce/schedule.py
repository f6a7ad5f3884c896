"""Per-block token counts searched by DiffRate (Chen et al., ICCV 2023), as named presets any count-based reducer takes.

``vitrim.reduce.apply(model, "topk", schedule="diffrate_deit_s_2.9")`` puts the reducer on the blocks the preset
reduces, with the counts that leave exactly the preset's number of tokens after each block; ``"tome"`` gets them as
its list ``r``, ``"zero_tprune"`` / ``"topk"`` as ``keep_count`` per block, ``"evit"`` as ``keep_count`` one less
(its fused token fills the place), ``"diffrate"`` as DiffRate's own prune-then-merge counts
(:mod:`vitrim.reduce.diffrate`). A preset names the model it was searched for; one used on a model with another depth
or token count is refused (the counts are absolute, and DiffRate searched them for that model).

Source: OpenGVLab/DiffRate, ``compression_rate.json`` (commit b380acf1ada7cb0e38141324649f1cdcf80bb77c), entries
"ViT-S-DeiT" and "ViT-B-DeiT": ``prune_kept_num`` and ``merge_kept_num``, for each of the 12 blocks the tokens
([CLS] included) left after that block's pruning and after its merging, searched for ImageNet at 224² (197 tokens);
the key is the target in GFLOPs (multiply-adds, as DiffRate's ``calculate_flop_inference`` counts them; vitrim's
FLOP counter counts 2 per multiply-add). In DiffRate's evaluation (``DiffRate/patch/deit.py``) a block keeps
min(tokens, prune) tokens, then merges down to merge if that is fewer, so the tokens after block i are
min(tokens before, prune_i, merge_i). The last block's 3 leaves [CLS] and two tokens for the last MLP, which does
not change [CLS]: the classifier sees the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Schedule:
    """One DiffRate preset: per block, tokens (prefix included) after its pruning and after its merging."""

    name: str
    model: str  # what DiffRate searched it for
    gflops: float  # DiffRate's stated cost, in G multiply-adds
    prune_kept: tuple[int, ...]
    merge_kept: tuple[int, ...]
    num_tokens: int = 197  # entering block 0: [CLS] + 14 × 14 patches
    num_prefix: int = 1  # [CLS]
    embed_dim: int = 384  # the width of the model it was searched for (DeiT-S 384, DeiT-B 768)

    @property
    def depth(self) -> int:
        return len(self.prune_kept)

    def tokens_after(self) -> tuple[int, ...]:
        """Tokens (prefix included) after each block: min(tokens before, prune_i, merge_i)."""
        counts, n = [], self.num_tokens
        for prune, merge in zip(self.prune_kept, self.merge_kept):
            n = min(n, prune, merge)
            counts.append(n)
        return tuple(counts)

    def reductions(self) -> list[tuple[int, int, int]]:
        """(block, tokens before, tokens after) for each block that removes tokens, prefix included."""
        before = (self.num_tokens, *self.tokens_after()[:-1])
        return [(i, b, a) for i, (b, a) in enumerate(zip(before, self.tokens_after())) if a < b]

    def check(self, model: nn.Module) -> None:
        """Refuse a model with another depth, patch count or prefix: the counts are absolute."""
        depth = len(getattr(model, "blocks", ()))
        patch_embed = getattr(model, "patch_embed", None)
        patches = getattr(patch_embed, "num_patches", None)
        prefix = getattr(model, "num_prefix", None)
        if depth != self.depth or patches is None or prefix is None or patches + prefix != self.num_tokens:
            raise ValueError(
                f"schedule {self.name!r} was searched for {self.model}: {self.depth} blocks and {self.num_tokens} "
                f"tokens ([CLS] + {self.num_tokens - self.num_prefix} patches); the model has {depth} blocks and "
                f"{'?' if patches is None or prefix is None else patches + prefix} tokens "
                f"({prefix} prefix + {patches} patches)"
            )


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.strip("[]").split(","))


# Quoted from OpenGVLab/DiffRate compression_rate.json (see module doc):
# (model, GFLOPs): (prune_kept_num, merge_kept_num)
_QUOTED = {
    ("DeiT-S", "2.3"): ("[197,192,168,143,121,105,92,74,62,45,33,3]", "[197,180,156,127,109,98,80,66,52,37,31,3]"),
    ("DeiT-S", "2.5"): ("[197,192,174,156,131,115,111,99,76,50,39,3]", "[197,186,160,133,119,107,96,82,66,43,37,3]"),
    ("DeiT-S", "2.7"): ("[197,196,182,160,141,127,115,105,88,66,49,3]", "[197,188,170,147,131,119,109,96,76,54,45,3]"),
    ("DeiT-S", "2.9"): ("[197,196,190,168,150,139,129,117,99,78,58,3]", "[197,194,176,156,141,133,121,107,88,64,56,3]"),
    ("DeiT-S", "3.1"): (
        "[197,197,194,180,160,147,137,129,115,92,76,3]",
        "[197,196,186,164,150,141,133,121,103,78,68,3]",
    ),
    ("DeiT-B", "8.7"): ("[197,192,172,156,131,107,90,72,56,33,17,3]", "[197,178,162,141,115,96,78,60,47,21,13,3]"),
    ("DeiT-B", "10.0"): ("[197,194,182,168,148,129,113,101,82,49,25,3]", "[197,186,174,156,137,117,105,90,66,31,19,3]"),
    ("DeiT-B", "10.4"): ("[197,196,188,174,156,141,121,103,90,58,25,3]", "[197,190,184,164,145,131,107,94,74,31,21,3]"),
    ("DeiT-B", "11.5"): (
        "[197,197,197,188,170,154,139,123,107,72,43,3]",
        "[197,197,192,178,158,145,127,111,94,50,35,3]",
    ),
    ("DeiT-B", "12.5"): (
        "[197,197,196,192,184,170,154,139,129,94,58,3]",
        "[197,196,194,190,176,160,145,131,115,68,47,3]",
    ),
}
_WIDTHS = {"DeiT-S": 384, "DeiT-B": 768}
_PRESETS = [
    Schedule(
        f"diffrate_deit_{model[-1].lower()}_{gflops}",
        f"DiffRate {model}",
        float(gflops),
        _numbers(p),
        _numbers(m),
        embed_dim=_WIDTHS[model],
    )
    for (model, gflops), (p, m) in _QUOTED.items()
]
SCHEDULES: dict[str, Schedule] = {s.name: s for s in _PRESETS}


def get_schedule(name: object) -> Schedule:
    """The preset called ``name``; a ValueError listing them for any other value."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]

"""What a method's cost is counted on, and what a method says it costs: the model's shapes and :class:`MethodCost`.

Each method's file counts its own part (``Method.cost``, :mod:`vitrim.vlm.method.base`) on these shapes; the model's
own parts (tower blocks, projector, LLM layers) are counted once, by :mod:`vitrim.vlm.flops`, from what the method
leaves. This module sits below every method file and imports none of them, so a method file needs nothing else.

Convention (``vitrim.vlm.flops``'s module docstring): only matrix products are counted, in multiply-adds (MACs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionTower:
    """A ViT vision tower at one resolution; ``layers_run`` blocks run (transformers runs them all)."""

    name: str
    image_size: int  # pixels per side of the image the tower sees
    patch_size: int
    width: int
    layers: int
    heads: int
    mlp_width: int
    gated_mlp: bool = False  # SwiGLU (gate, up, down): 3 matrices instead of 2
    cls_token: bool = False
    temporal_patch: int = 1  # Qwen2.5-VL's Conv3d stacks 2 frames (a still image is repeated)
    window: int | None = None  # tokens per attention window, None: global attention in every block
    full_attention_layers: tuple[int, ...] = ()  # blocks that attend globally despite ``window``
    feature_layer: int = -1  # the hidden state handed on (LLaVA-1.5: -2, the output of the second-to-last block)
    # a video's temporal patches (t; 1: an image): each is its own attention segment in Qwen's towers (transformers'
    # ``cu_seqlens`` cut at every temporal patch), ``image_size`` the side of each
    temporal_patches: int = 1

    @property
    def patches_per_temporal_patch(self) -> int:
        """Patches of one temporal patch (of the image): (image_size / patch_size)²."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def patches(self) -> int:
        """Patches of the whole input: every temporal patch's."""
        return self.temporal_patches * self.patches_per_temporal_patch

    @property
    def tokens(self) -> int:
        """Tokens entering the first block: the patches and [CLS]."""
        return self.patches + int(self.cls_token)

    @property
    def reducing_layers(self) -> int:
        """Blocks up to and including the one whose output is handed on (a reduction after it changes nothing)."""
        return self.layers + 1 + self.feature_layer


@dataclass(frozen=True)
class LanguageModel:
    name: str
    width: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int
    vocab: int


@dataclass(frozen=True)
class VLM:
    """A vision-language model: tower, projector, LLM, and how image tokens flow between them.

    ``projector``: the (in, out) matrices applied to each LLM image token; ``pool``: tower patches per LLM image
    token (LLaVA 1, Qwen2.5-VL's 2×2 merger 4, Gemma 3's 4×4 average pool 16); ``cut_before_projector``: whether the
    projector runs on the kept tokens only. vitrim's plumbing (:mod:`vitrim.vlm.families.llava`) writes merged
    features into their slots, runs the projector on every slot and drops slots at the LLM's input, so it is False
    for every config in :mod:`vitrim.vlm.flops`; a gathering implementation would save (N − keep) projector rows
    (LLaVA: 10.8 GMACs).
    """

    name: str
    tower: VisionTower
    projector: tuple[tuple[int, int], ...]
    pool: int
    llm: LanguageModel
    cut_before_projector: bool
    note: str = ""
    # text a video writes around each temporal patch, which no method prunes (Qwen3-VL: its timestamp, vision start
    # and end); counted on top of ``text_tokens`` when the input is a video (``tower.temporal_patches`` > 1)
    text_per_temporal_patch: int = 0
    # the image tokens an earlier stage hands this one (an in-LLM method stacked after a pre-LLM one counts its part
    # on what that one left, :mod:`vitrim.vlm.flops_video`); None: the tower's own
    image_tokens_in: int | None = None
    # what one step of a video's time axis is where the config takes video: "temporal patch" (Qwen: its Conv3d over
    # two frames) or "frame" (LLaVA-OneVision: each sampled frame its own tower run); None: images only
    video_unit: str | None = None
    # LLaVA-OneVision: a video frame's patch grid, after the projector, resized bilinearly to pooled_side ×
    # pooled_side LLM tokens (``apply_pooling``: 27×27 -> 14×14); None: one LLM token per ``pool`` patches
    pooled_side: int | None = None
    # LLM tokens a video adds once, which no method prunes (LLaVA-OneVision's newline token after its last frame)
    text_per_video: int = 0

    @property
    def image_tokens(self) -> int:
        """Image tokens per image (per video: all its temporal patches') entering the LLM unmodified, or
        ``image_tokens_in`` where an earlier stage left fewer."""
        if self.image_tokens_in is not None:
            return self.image_tokens_in
        return self.temporal_patches * self.tokens_per_temporal_patch

    @property
    def tokens_per_temporal_patch(self) -> int:
        """LLM tokens of one temporal patch (of the image; of a LLaVA-OneVision frame): P."""
        if self.pooled_side is not None:
            return self.pooled_side**2
        return self.tower.patches_per_temporal_patch // self.pool

    @property
    def projector_tokens(self) -> int:
        """Rows the projector runs on: one per ``pool`` patches of the whole input, before any pooling after it
        (vitrim's plumbing runs it on every slot; LLaVA-OneVision's frames are pooled after it)."""
        return self.tower.patches // self.pool

    @property
    def temporal_patches(self) -> int:
        """t: the input's temporal patches (1: an image)."""
        return self.tower.temporal_patches


@dataclass(frozen=True)
class MethodCost:
    """One image's part of a prefill that a method decides: its own products, and what it leaves the model to run.

    own: int                          multiply-adds of the method's own work (scores, similarities, the keys it
                                      computes again), apart from the model's layers
    llm_cuts: ((layer, kept), ...)    from decoder layer ``layer`` (0-based, increasing) on, ``kept`` image tokens of
                                      the image stay; ``(0, k)``: k image tokens enter the LLM; (): all of them
    tower_blocks: ((a, m), ...) | None  per tower block, the tokens its attention runs on (a) and its MLP runs on
                                      (m), [CLS] included, one pair per block of the tower; None: the tower runs whole

    The image tokens entering the LLM are what ``llm_cuts`` leaves at layer 0 (:meth:`tokens_entering`), so the two
    cannot disagree.
    """

    own: int
    llm_cuts: tuple[tuple[int, int], ...] = ()
    tower_blocks: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.own, bool) or not isinstance(self.own, int) or self.own < 0:
            raise ValueError(f"MethodCost.own={self.own!r}: expected an int >= 0 (multiply-adds)")
        pairs = [*self.llm_cuts, *(self.tower_blocks or ())]
        if any(len(pair) != 2 or not all(isinstance(v, int) and v >= 0 for v in pair) for pair in pairs):
            raise ValueError(
                f"MethodCost llm_cuts={self.llm_cuts!r}, tower_blocks={self.tower_blocks!r}: expected pairs of "
                "ints >= 0"
            )
        layers = [layer for layer, _ in self.llm_cuts]
        if any(later <= earlier for earlier, later in itertools.pairwise(layers)):
            raise ValueError(f"MethodCost.llm_cuts={self.llm_cuts!r}: expected increasing decoder layers")

    @classmethod
    def before_llm(cls, keep: int, own: int = 0) -> MethodCost:
        """A pre-LLM method's cost: ``keep`` image tokens enter the LLM; ``own`` multiply-adds of its selection."""
        return cls(own=own, llm_cuts=((0, keep),))

    def tokens_entering(self, image_tokens: int) -> int:
        """Image tokens of the image entering the LLM, of its ``image_tokens`` unmodified ones."""
        return dict(self.llm_cuts).get(0, image_tokens)


def cls_row_macs(tower: VisionTower) -> int:
    """The attention score a [CLS]-ranking method reads at the scoring layer, for one image: with [CLS], its query,
    every key and one q·kᵀ row; without (SigLIP, Qwen's tower), the attention each token receives: every query, key
    and the whole q·kᵀ (see docs/vlm.md), within each temporal patch of a video."""
    d, tokens = tower.width, tower.tokens
    if tower.cls_token:
        return d * d + tokens * d * d + tokens * d
    return 2 * tokens * d * d + tokens * (tokens // tower.temporal_patches) * d


def cut_tower_blocks(tower: VisionTower, block: int, keep: int) -> tuple[tuple[int, int], ...]:
    """:attr:`MethodCost.tower_blocks` of a cut between block ``block``'s attention and its MLP (the seam vitrim's
    tower stage cuts at): every token runs up to that attention, ``keep`` patches and [CLS] run its MLP and every
    block after it."""
    every, kept = tower.tokens, keep + int(tower.cls_token)
    return tuple(
        (every, every) if b < block else (every, kept) if b == block else (kept, kept) for b in range(tower.layers)
    )


def key_macs(llm: LanguageModel, n: int) -> int:
    """The key projection of ``n`` positions (a method that scores by keys computes them again from the layer input)."""
    return n * llm.width * llm.kv_heads * llm.head_dim


def attention_row_macs(llm: LanguageModel, n: int) -> int:
    """One query's attention row over ``n`` keys, every head: its query, the keys again, and q·kᵀ."""
    return llm.width * llm.heads * llm.head_dim + key_macs(llm, n) + llm.heads * n * llm.head_dim


__all__ = [
    "VLM",
    "LanguageModel",
    "MethodCost",
    "VisionTower",
    "attention_row_macs",
    "cls_row_macs",
    "cut_tower_blocks",
    "key_macs",
]

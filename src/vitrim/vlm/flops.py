"""Analytic prefill cost of real vision-language models, with and without a token-reduction method.

Convention (fvcore's, torch's counter's and the papers'): only matrix products are counted, in multiply-adds (MACs;
FLOPs = 2 MACs); norms, activations, softmax, RoPE, pooling and residual adds are not. Attention counts the full
Lq × Lk products QKᵀ and A·V, as dense SDPA computes them (a causal or windowed mask removes no products from a
dense kernel; FastV's and PyramidDrop's FLOP formulas count the same ``2·n²·d`` per layer).

Per layer on ``n`` tokens (``d`` width, ``m`` MLP width, ``H`` heads and ``G`` key/value heads of ``e`` dims):

- vision block: ``4·n·d²`` (qkv, out) + ``2·n·w·d`` (QKᵀ, A·V; w = n, or the window length) + ``k·n·d·m``
  (k = 2 matrices, or 3 for a gated MLP);
- LLM block: ``n·d·(2·H·e + 2·G·e)`` (q, k, v, o) + ``2·H·n²·e`` + ``3·n·d·m`` (gate, up, down);
- the LM head runs on the last position only (``generate`` asks for ``logits_to_keep=1`` at prefill): ``d·V``.

Which tokens run where (``counting what runs``): a pre-LLM method shortens every LLM layer (and, where the cut is
before the projector, the projector); an in-LLM method runs the first ``K`` layers on every token, so the tokens
entering the LLM and the LLM's layer-averaged tokens are different numbers, and both are reported; a tower method
shortens the vision blocks after each reduction. A method's own products (scores, similarities) are counted apart.

Who counts what: each method's own file counts its own products and says what it leaves the model (its ``cost``,
a :class:`~vitrim.vlm.method.cost.MethodCost`: the LLM's cut schedule, the tower's tokens per block); this module
holds the real checkpoints' configs and counts the model's own parts (tower, projector, LLM) from that, so a new
method file is counted without a line here. The methods counted are read from the registry at each call.

Where each config number comes from is cited at its definition (the checkpoints' ``config.json`` on the Hugging
Face hub, which transformers' config classes read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vitrim.vlm.method import Method, method_class, methods
from vitrim.vlm.method.cost import VLM, LanguageModel, MethodCost, VisionTower, cut_tower_blocks
from vitrim.vlm.method.tower_reducers import tome_tower_schedule as tome_tower_schedule  # public here before

STAGE_ORDER = ("pre_llm", "in_llm", "tower")  # the order of the rows: where the method cuts, then its name


def counted_methods(stage: str | None = None) -> tuple[str, ...]:
    """The registered methods whose file counts their cost (``Method.cost``), read from the registry now (a method
    registered after this module was imported is counted too): by stage (:data:`STAGE_ORDER`), then by name; only
    those cutting at ``stage`` if given. Methods without a count (the tower stage's other vitrim reducers, whose
    schedules are their own options) are not listed."""
    stages = STAGE_ORDER if stage is None else (stage,)
    return tuple(name for s in stages for name in methods(stage=s) if method_class(name).cost is not Method.cost)


def __getattr__(name: str) -> tuple[str, ...]:
    """``PRE_LLM``, ``IN_LLM``, ``TOWER`` (the counted methods of each stage) and ``METHODS`` ("none" and every
    counted method), each read from the registry when asked for, never frozen at import."""
    if name in _STAGE_NAMES:
        return counted_methods(_STAGE_NAMES[name])
    if name == "METHODS":
        return ("none", *counted_methods())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_STAGE_NAMES = {"PRE_LLM": "pre_llm", "IN_LLM": "in_llm", "TOWER": "tower"}


# LLaVA-1.5-7B, llava-hf/llava-1.5-7b-hf config.json: vision_config = CLIP ViT-L/14 at 336 (openai/clip-vit-large-
# patch14-336: hidden_size 1024, intermediate_size 4096, 24 layers, 16 heads, patch 14, image 336), vision_feature_
# layer -2, projector "gelu" MLP linear_1 1024->4096, linear_2 4096->4096; text_config = Llama-2-7B / Vicuna-7B v1.5
# (hidden 4096, intermediate 11008, 32 layers, 32 heads, 32 key/value heads, head 128, vocab 32064 with the image
# and pad tokens added to Llama's 32000).
LLAVA_15_7B = VLM(
    name="llava-1.5-7b",
    tower=VisionTower("CLIP ViT-L/14-336", 336, 14, 1024, 24, 16, 4096, cls_token=True, feature_layer=-2),
    projector=((1024, 4096), (4096, 4096)),
    pool=1,
    llm=LanguageModel("Vicuna-7B v1.5", 4096, 32, 32, 32, 128, 11008, 32064),
    cut_before_projector=False,
)

# Qwen2.5-VL-7B, Qwen/Qwen2.5-VL-7B-Instruct config.json: vision_config depth 32, hidden_size 1280, num_heads 16,
# intermediate_size 3420 (SwiGLU), patch_size 14, temporal_patch_size 2, spatial_merge_size 2, window_size 112 px
# (= 8×8 patches = 64 tokens per window), fullatt_block_indexes [7, 15, 23, 31], out_hidden_size 3584; the merger
# is RMSNorm then Linear 5120->5120, GELU, Linear 5120->3584; text: hidden 3584, intermediate 18944, 28 layers,
# 28 heads, 4 key/value heads (head 128), vocab 152064. The resolution is dynamic (min/max pixels); 672×672 makes
# 48×48 patches and 576 LLM image tokens, the count of LLaVA-1.5, so keep 64/128/192 mean the same cut.
QWEN25_VL_7B = VLM(
    name="qwen2.5-vl-7b",
    tower=VisionTower(
        "Qwen2.5-VL ViT (672 px)",
        672,
        14,
        1280,
        32,
        16,
        3420,
        gated_mlp=True,
        temporal_patch=2,
        window=64,
        full_attention_layers=(7, 15, 23, 31),
    ),
    projector=((5120, 5120), (5120, 3584)),
    pool=4,
    llm=LanguageModel("Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064),
    cut_before_projector=False,
    note="dynamic resolution; 672×672 px gives 576 image tokens",
    video_unit="temporal patch",
)

# Gemma-3-4B, google/gemma-3-4b-it config.json: vision_config = SigLIP So400m/14 at 896 (hidden_size 1152,
# intermediate_size 4304, 27 layers, 16 heads, patch 14, image 896, no [CLS], no head); mm_tokens_per_image 256
# (the projector average-pools 64×64 patches 4×4 to 16×16, RMS-norms them, then one 1152->2560 matrix); text:
# hidden 2560, intermediate 10240, 34 layers, 8 heads, 4 key/value heads, head_dim 256, vocab 262208. Five of six
# layers use a 1024-token sliding window, which no prompt here exceeds.
GEMMA3_4B = VLM(
    name="gemma-3-4b",
    tower=VisionTower("SigLIP So400m/14-896", 896, 14, 1152, 27, 16, 4304),
    projector=((1152, 2560),),
    pool=16,
    llm=LanguageModel("Gemma-3-4B", 2560, 34, 8, 4, 256, 10240, 262208),
    cut_before_projector=False,
)

# Qwen3-VL-8B, Qwen/Qwen3-VL-8B-Instruct config.json (its text_config as the checkpoint's config.json and its GGUF
# metadata give it; the vision_config equals transformers' Qwen3VLVisionConfig defaults but out_hidden_size):
# vision_config depth 27, hidden_size 1152, intermediate_size 4304 (linear_fc1, GELU-tanh, linear_fc2: not gated),
# num_heads 16, patch_size 16, temporal_patch_size 2, spatial_merge_size 2, out_hidden_size 4096, no windows (every
# block attends over its temporal patch), deepstack_visual_indexes [8, 16, 24]; the merger and each of the three
# DeepStack mergers are Linear 4608->4608, GELU, Linear 4608->4096 on every LLM image token (their outputs are added
# to the LLM's first three layers' hidden states: no products); text: hidden 4096, intermediate 12288, 36 layers,
# 32 heads, 8 key/value heads (head 128), vocab 151936 (untied head). 768×768 px make 48×48 patches and 576 image
# tokens, LLaVA-1.5's count. A video writes "<t seconds>" and vision start/end around each temporal patch
# (transformers' Qwen3VLProcessor.replace_video_token): 6 tokens for a time below 10 s with Qwen's tokenizer
# (digits one by one), and 2: 8 per temporal patch (a time of two digits is one more, not counted).
QWEN3_VL_8B = VLM(
    name="qwen3-vl-8b",
    tower=VisionTower("Qwen3-VL ViT (768 px)", 768, 16, 1152, 27, 16, 4304, temporal_patch=2),
    projector=((4608, 4608), (4608, 4096)) * 4,  # the merger and the three DeepStack mergers
    pool=4,
    llm=LanguageModel("Qwen3-8B", 4096, 36, 32, 8, 128, 12288, 151936),
    cut_before_projector=False,
    note="dynamic resolution; 768×768 px gives 576 image tokens; DeepStack: 4 mergers",
    text_per_temporal_patch=8,
    video_unit="temporal patch",
)

# LLaVA-OneVision-7B, llava-hf/llava-onevision-qwen2-7b-ov-hf, as a video model (its images, anyres tiles, are not
# counted here): transformers' LlavaOnevisionConfig defaults, which the released config keeps - vision_config SigLIP
# So400m/14 at 384 px with 26 layers (the checkpoint drops the last of So400m's 27; hidden 1152, intermediate 4304,
# 16 heads, no [CLS], no head), vision_feature_layer -1 with the "full" strategy (all 27×27 = 729 patches), the
# projector Linear 1152->3584, GELU, Linear 3584->3584 on every patch; then each frame's grid resized bilinearly to
# ⌈27/2⌉² = 14×14 = 196 tokens (``apply_pooling``: no products) and ONE newline token after a video's last frame;
# text Qwen2-7B: hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 key/value heads (head 128), vocab 152064
# (Qwen2-7B's; the LM head runs on one position, so a padded vocab of the conversion moves a prefill by < 1e-5).
LLAVA_ONEVISION_7B = VLM(
    name="llava-onevision-7b",
    tower=VisionTower("SigLIP So400m/14-384 (26 layers)", 384, 14, 1152, 26, 16, 4304),
    projector=((1152, 3584), (3584, 3584)),
    pool=1,
    llm=LanguageModel("Qwen2-7B", 3584, 28, 28, 4, 128, 18944, 152064),
    cut_before_projector=False,
    note="a video: every frame at 384 px, 729 patches pooled to 196 tokens, one newline token per video",
    video_unit="frame",
    pooled_side=14,
    text_per_video=1,
)

CONFIGS = {c.name: c for c in (LLAVA_15_7B, QWEN25_VL_7B, QWEN3_VL_8B, GEMMA3_4B)}


@dataclass(frozen=True)
class InLLMSchedule:
    """The authors' defaults of the in-LLM methods: where they cut and what they keep (the registry's, read when
    one is made). Kept for callers that name it; :func:`prefill_cost` counts each method with its own options
    (its file's ``cost``) and takes no other schedule."""

    fastv_layer: int = field(default_factory=lambda: int(method_class("fastv").default_layer or 0))
    dart_layer: int = field(default_factory=lambda: int(method_class("dart").default_layer or 0))
    dart_pivots: int = field(
        default_factory=lambda: sum(method_class("dart").defaults[k] for k in ("pivot_image_token", "pivot_text_token"))
    )
    pdrop_layers: tuple[int, ...] = field(default_factory=lambda: tuple(method_class("pdrop").defaults["layers"]))
    pdrop_ratios: tuple[float, ...] = field(default_factory=lambda: tuple(method_class("pdrop").defaults["ratios"]))


def vision_block_macs(tower: VisionTower, tokens: int, *, windowed: bool, mlp_tokens: int | None = None) -> int:
    """MACs of one tower block on ``tokens`` tokens (windowed: attention within windows of ``tower.window``; a
    video's temporal patches each attend alone); its MLP on ``mlp_tokens`` (default ``tokens``) where a cut between
    the two leaves fewer."""
    d, n = tower.width, tokens
    segment = n // tower.temporal_patches  # the tokens one query attends over: its temporal patch's
    keys = min(segment, tower.window) if windowed and tower.window else segment
    mlp = (3 if tower.gated_mlp else 2) * (n if mlp_tokens is None else mlp_tokens) * d * tower.mlp_width
    return 4 * n * d * d + 2 * n * keys * d + mlp


def tower_macs(
    tower: VisionTower,
    tokens_per_layer: Sequence[int] | None = None,
    *,
    mlp_tokens_per_layer: Sequence[int] | None = None,
) -> int:
    """MACs of the patch embedding and every block; ``tokens_per_layer[i]``: tokens block i runs on (default: all),
    ``mlp_tokens_per_layer[i]``: tokens its MLP runs on (default: the same)."""
    counts = [tower.tokens] * tower.layers if tokens_per_layer is None else list(tokens_per_layer)
    mlp_counts = counts if mlp_tokens_per_layer is None else list(mlp_tokens_per_layer)
    for option, values in (("tokens_per_layer", counts), ("mlp_tokens_per_layer", mlp_counts)):
        if len(values) != tower.layers:
            raise ValueError(f"{option} has {len(values)} entries; {tower.name} has {tower.layers} blocks")
    embed = tower.patches * 3 * tower.temporal_patch * tower.patch_size**2 * tower.width
    windowed = tower.window is not None
    blocks = sum(
        vision_block_macs(tower, n, windowed=windowed and i not in tower.full_attention_layers, mlp_tokens=m)
        for i, (n, m) in enumerate(zip(counts, mlp_counts, strict=True))
    )
    return embed + blocks


def llm_block_macs(llm: LanguageModel, tokens: int) -> int:
    """MACs of one decoder layer on ``tokens`` positions (full Lq × Lk attention, see module doc)."""
    d, n, e = llm.width, tokens, llm.head_dim
    projections = n * d * (2 * llm.heads * e + 2 * llm.kv_heads * e)
    return projections + 2 * llm.heads * n * n * e + 3 * n * d * llm.mlp_width


def llm_macs(llm: LanguageModel, tokens_per_layer: Sequence[int]) -> int:
    """MACs of every layer (``tokens_per_layer[i]`` positions in layer i) and of the LM head on the last position."""
    if len(tokens_per_layer) != llm.layers:
        raise ValueError(f"tokens_per_layer has {len(tokens_per_layer)} entries; {llm.name} has {llm.layers} layers")
    return sum(llm_block_macs(llm, n) for n in tokens_per_layer) + llm.width * llm.vocab


def cut_tower_macs(tower: VisionTower, block: int, keep: int) -> int:
    """Tower MACs when every token runs up to block ``block``'s attention, and ``keep`` patches (and [CLS]) run its
    MLP and every block after it (a cut between a block's attention and its MLP, as vitrim's tower stage cuts)."""
    blocks = cut_tower_blocks(tower, block, keep)
    return tower_macs(tower, [a for a, _ in blocks], mlp_tokens_per_layer=[m for _, m in blocks])


def _stage_counts(image: int, text: int, layers: int, cuts: Sequence[tuple[int, int]]) -> list[int]:
    """Positions per LLM layer: ``image + text`` until each (layer, kept image tokens) cut, then ``kept + text``."""
    counts, current = [], image
    cut_at = dict(cuts)
    for layer in range(layers):
        current = cut_at.get(layer, current)
        counts.append(current + text)
    return counts


@dataclass(frozen=True)
class PrefillCost:
    """One image's prefill under one method: MACs by part, and the image tokens it runs on."""

    model: str
    method: str
    keep: int | None
    tower: int
    projector: int
    llm: int
    method_own: int  # the method's own products (scores, similarities), apart from the model's
    image_tokens_entering_llm: int
    image_tokens_layer_mean: float  # image tokens averaged over the LLM's layers
    tokens_per_layer: tuple[int, ...] = field(repr=False, default=())
    # a video's row (vitrim.vlm.flops_video): the share of its tokens asked for, and the method's options it gives
    share: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.tower + self.projector + self.llm + self.method_own


def _check_method(method: str) -> None:
    """``ValueError`` unless ``method`` is "none" or a method whose file counts its cost."""
    counted = counted_methods()
    if method == "none" or method in counted:
        return
    if isinstance(method, str) and method in methods():
        raise ValueError(
            f"method {method!r} has no cost count: its file must define cost(self, model, keep, *, text_tokens) "
            f"(vitrim.vlm.method.base.Method.cost); counted: {', '.join(counted)}"
        )
    raise ValueError(f"unknown method {method!r}; expected one of: {', '.join(('none', *counted))}")


def prefill_cost(
    vlm: VLM,
    method: str = "none",
    keep: int | None = None,
    *,
    text_tokens: int = 94,
    schedule: InLLMSchedule | None = None,
) -> PrefillCost:
    """The prefill MACs of one image and ``text_tokens`` text tokens (default 94: LLaVA-1.5's ~670-token prompt).

    ``keep``: image tokens kept per image, as each method's ``cost`` reads it (pre-LLM: entering the LLM;
    fastv/dart: from their layer K on; pdrop: from its first stage on, later stages scaled by its ratios; tome,
    hiprune, flowcut: left at the tower's feature layer). ``method="none"`` needs no ``keep``. The method's own
    products and what it leaves (its :class:`~vitrim.vlm.method.cost.MethodCost`, under its registered defaults)
    come from its file; the tower, projector and LLM are counted here. ``schedule``: only ``None`` or the defaults
    (:class:`InLLMSchedule`) - an in-LLM method's layers are its own options.
    """
    _check_method(method)
    n_img, llm, tower = vlm.image_tokens, vlm.llm, vlm.tower
    if method == "none":
        keep = None
    elif not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= n_img:
        raise ValueError(f"keep must be an int in 1..{n_img} (the image tokens of {vlm.name}), got {keep!r}")
    if not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be an int >= 0, got {text_tokens!r}")
    if method != "none" and method_class(method).reads_time:
        raise ValueError(
            f"method {method!r} reduces videos and refuses images; count it on a clip: "
            "vitrim.vlm.flops_video.video_prefill_cost(clip(model, temporal_patches, size), ...)"
        )
    if vlm.temporal_patches != 1:
        raise ValueError(
            f"{vlm.name} holds a video of {vlm.temporal_patches} temporal patches; count it with "
            "vitrim.vlm.flops_video.video_prefill_cost"
        )
    if keep is not None and method_class(method).stage == "tower" and vlm.pool != 1:
        raise ValueError(
            f"method {method!r} (in the tower) is counted for towers whose patches are the LLM's image tokens; "
            f"{vlm.name} pools {vlm.pool} patches into each (its projector needs the whole grid)"
        )
    if schedule is not None and schedule != InLLMSchedule():
        raise ValueError(
            f"schedule={schedule!r}: an in-LLM method is counted with its own options by its file's cost(); "
            "expected None or the defaults, InLLMSchedule()"
        )
    cost = MethodCost(own=0) if keep is None else method_class(method)().cost(vlm, keep, text_tokens=text_tokens)
    if cost.tower_blocks is None:
        tower_cost = tower_macs(tower)
    else:
        attention = [a for a, _ in cost.tower_blocks]
        tower_cost = tower_macs(tower, attention, mlp_tokens_per_layer=[m for _, m in cost.tower_blocks])
    entering = cost.tokens_entering(n_img)
    # vitrim's plumbing (VLM.cut_before_projector False) runs the projector on every slot, dropped ones included
    projected = entering if vlm.cut_before_projector else n_img
    counts = _stage_counts(n_img, text_tokens, llm.layers, cost.llm_cuts)
    return PrefillCost(
        model=vlm.name,
        method=method,
        keep=keep,
        tower=tower_cost,
        projector=projected * sum(i * o for i, o in vlm.projector),
        llm=llm_macs(llm, counts),
        method_own=cost.own,
        image_tokens_entering_llm=entering,
        image_tokens_layer_mean=sum(c - text_tokens for c in counts) / llm.layers,
        tokens_per_layer=tuple(counts),
    )


def cost_table(
    vlm: VLM, keeps: Sequence[int] = (64, 128, 192), *, text_tokens: int = 94, methods: Sequence[str] | None = None
) -> list[PrefillCost]:
    """The unmodified prefill, then every method (default: every counted one, :func:`counted_methods`) at every
    ``keep`` (a tower method is skipped on a model that pools its tower's grid; a ``keep`` above the image's tokens
    is refused; a video method, which refuses images, is skipped)."""
    names = counted_methods() if methods is None else methods
    rows = [prefill_cost(vlm, "none", text_tokens=text_tokens)]
    for method in names:
        if method == "none" or method_class(method).reads_time:
            continue
        if vlm.pool != 1 and method in counted_methods("tower"):
            continue
        rows.extend(prefill_cost(vlm, method, k, text_tokens=text_tokens) for k in keeps)
    return rows

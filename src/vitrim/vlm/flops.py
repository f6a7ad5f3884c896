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

Where each config number comes from is cited at its definition (the checkpoints' ``config.json`` on the Hugging
Face hub, which transformers' config classes read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vitrim.vlm.method import method_class, methods
from vitrim.vlm.method.tower_reducers import patches_after_stages

PRE_LLM = tuple(methods(stage="pre_llm"))
IN_LLM = tuple(methods(stage="in_llm"))
# tome: a vitrim reducer in the tower, counted with the schedule keep= gives it (any schedule: tower_macs); hiprune and
# flowcut: the tower methods of their own (vitrim.vlm.method.hiprune, .flowcut)
TOWER = ("tome", "hiprune", "flowcut")
METHODS = ("none", *PRE_LLM, *IN_LLM, *TOWER)


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

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

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
    for every config here; a gathering implementation would save (N − keep) projector rows (LLaVA: 10.8 GMACs).
    """

    name: str
    tower: VisionTower
    projector: tuple[tuple[int, int], ...]
    pool: int
    llm: LanguageModel
    cut_before_projector: bool
    note: str = ""

    @property
    def image_tokens(self) -> int:
        """Image tokens per image entering the LLM unmodified."""
        return self.tower.patches // self.pool


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

CONFIGS = {c.name: c for c in (LLAVA_15_7B, QWEN25_VL_7B, GEMMA3_4B)}


@dataclass(frozen=True)
class InLLMSchedule:
    """The authors' defaults of the in-LLM methods: where they cut and what they keep."""

    # the registry's defaults (vitrim.vlm.method), read once: FastV (K = 2, scored by the last token's attention at
    # K - 1), DART (K = 2; its pivots, each compared with every image token), PyramidDrop (its layers and ratios)
    fastv_layer: int = field(default_factory=lambda: int(method_class("fastv").default_layer or 0))
    dart_layer: int = field(default_factory=lambda: int(method_class("dart").default_layer or 0))
    dart_pivots: int = field(
        default_factory=lambda: sum(method_class("dart").defaults[k] for k in ("pivot_image_token", "pivot_text_token"))
    )
    pdrop_layers: tuple[int, ...] = field(default_factory=lambda: tuple(method_class("pdrop").defaults["layers"]))
    pdrop_ratios: tuple[float, ...] = field(default_factory=lambda: tuple(method_class("pdrop").defaults["ratios"]))


def vision_block_macs(tower: VisionTower, tokens: int, *, windowed: bool) -> int:
    """MACs of one tower block on ``tokens`` tokens (windowed: attention within windows of ``tower.window``)."""
    d, n = tower.width, tokens
    keys = min(n, tower.window) if windowed and tower.window else n
    mlp = (3 if tower.gated_mlp else 2) * n * d * tower.mlp_width
    return 4 * n * d * d + 2 * n * keys * d + mlp


def tower_macs(tower: VisionTower, tokens_per_layer: Sequence[int] | None = None) -> int:
    """MACs of the patch embedding and every block; ``tokens_per_layer[i]``: tokens block i runs on (default: all)."""
    counts = [tower.tokens] * tower.layers if tokens_per_layer is None else list(tokens_per_layer)
    if len(counts) != tower.layers:
        raise ValueError(f"tokens_per_layer has {len(counts)} entries; {tower.name} has {tower.layers} blocks")
    embed = tower.patches * 3 * tower.temporal_patch * tower.patch_size**2 * tower.width
    windowed = tower.window is not None
    blocks = sum(
        vision_block_macs(tower, n, windowed=windowed and i not in tower.full_attention_layers)
        for i, n in enumerate(counts)
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


def tome_tower_schedule(tower: VisionTower, keep: int) -> list[int]:
    """Tokens entering each block ([CLS] included) for ToMe with ``keep=``, as the tower runs it: the patches left
    after each of the L blocks up to the feature layer are
    :func:`~vitrim.vlm.method.tower_reducers.patches_after_stages`
    (an even spread, merged earlier where one block would have to merge more than half).

    ToMe merges after each block's attention, so block i runs its attention on the tokens left by block i - 1 and
    its MLP on fewer; counted here (upper bound) with the tokens entering the block.
    """
    after = patches_after_stages("tome", tower.patches, keep, tower.reducing_layers)
    entering = [tower.patches, *after]
    cls = int(tower.cls_token)
    return [entering[min(block, len(after))] + cls for block in range(tower.layers)]


def cut_tower_macs(tower: VisionTower, block: int, keep: int) -> int:
    """Tower MACs when every token runs up to block ``block``'s attention, and ``keep`` patches (and [CLS]) run its
    MLP and every block after it (a cut between a block's attention and its MLP, as vitrim's tower stage cuts)."""
    every, kept = tower.tokens, keep + int(tower.cls_token)
    counts = [every if b <= block else kept for b in range(tower.layers)]
    mlp = (3 if tower.gated_mlp else 2) * tower.width * tower.mlp_width
    return tower_macs(tower, counts) - (every - kept) * mlp


def _tower_method_own(tower: VisionTower, method: str) -> int:
    """The products a tower method adds to the blocks' own (the stage reads their q, k, v; nothing is recomputed).

    hiprune: the global attention (every query's row over every key, q·kᵀ) of two blocks, the object layer and the
    feature layer (one when they are the same block); flowcut: in each block before the feature block, [CLS]'s
    attention row (q_cls·kᵀ) and its value row (v_cls·vᵀ), counted on every token (its earlier cuts make fewer)."""
    n, d = tower.tokens, tower.width
    feature = tower.reducing_layers - 1
    if method == "hiprune":
        object_block = method_class("hiprune").defaults["object_layer"] - 1
        return (1 if object_block == feature else 2) * n * n * d
    return feature * 2 * n * d


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

    @property
    def total(self) -> int:
        return self.tower + self.projector + self.llm + self.method_own


def prefill_cost(
    vlm: VLM,
    method: str = "none",
    keep: int | None = None,
    *,
    text_tokens: int = 94,
    schedule: InLLMSchedule = InLLMSchedule(),
) -> PrefillCost:
    """The prefill MACs of one image and ``text_tokens`` text tokens (default 94: LLaVA-1.5's ~670-token prompt).

    ``keep``: image tokens kept per image (pre-LLM: entering the LLM; fastv/dart: from their layer K on; pdrop: from
    its first stage on, later stages scaled by its ratios, 0.5 : 0.25 : 0.125 -> keep, keep/2, keep/4, which
    ``vitrim.vlm`` runs as ``ratios=(keep / N, keep / 2N, keep / 4N)``; tome: left
    at the tower's feature layer). ``method="none"`` needs no ``keep``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of: {', '.join(METHODS)}")
    n_img, llm, tower = vlm.image_tokens, vlm.llm, vlm.tower
    if method == "none":
        keep = None
    elif not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= n_img:
        raise ValueError(f"keep must be an int in 1..{n_img} (the image tokens of {vlm.name}), got {keep!r}")
    k = n_img if keep is None else keep
    if not isinstance(text_tokens, int) or text_tokens < 0:
        raise ValueError(f"text_tokens must be an int >= 0, got {text_tokens!r}")
    projector_per_token = sum(i * o for i, o in vlm.projector)
    tower_cost = tower_macs(tower)
    projected = n_img
    own = 0
    cuts: list[tuple[int, int]] = []
    entering = n_img
    if method in PRE_LLM:
        entering = k
        cuts = [(0, k)]
        projected = k if vlm.cut_before_projector else n_img
        own = _pre_llm_own(vlm, method, k, text_tokens)
    elif method in ("fastv", "dart"):
        layer = schedule.fastv_layer if method == "fastv" else schedule.dart_layer
        cuts = [(layer, k)]
        n = n_img + text_tokens
        if method == "fastv":
            own = _attention_row_macs(llm, n)
        else:
            own = _key_macs(llm, n) + n_img * schedule.dart_pivots * llm.width
    elif method == "pdrop":
        first = schedule.pdrop_ratios[0]
        kept = [max(1, round(k * r / first)) for r in schedule.pdrop_ratios]
        cuts = list(zip(schedule.pdrop_layers, kept))
        before = [n_img, *kept[:-1]]
        own = sum(_attention_row_macs(llm, b + text_tokens) for b in before)
    elif method == "tome":
        if vlm.pool != 1:
            raise ValueError(
                f"method 'tome' (in the tower) is counted for towers whose patches are the LLM's image tokens; "
                f"{vlm.name} pools {vlm.pool} patches into each (its projector needs the whole grid)"
            )
        tower_cost = tower_macs(tower, tome_tower_schedule(tower, k))
        entering = k
        projected = (
            k if vlm.cut_before_projector else n_img
        )  # vitrim.vlm.stages.tower writes the tokens into their slots
        cuts = [(0, k)]
        # ToMe's bipartite similarity in each block: (n/2) × (n/2) cosines of the keys summed over heads (head width)
        head = tower.width // tower.heads
        own = sum((n // 2) * (n - n // 2) * head for n in tome_tower_schedule(tower, k)[: tower.reducing_layers])
    elif method in ("hiprune", "flowcut"):
        if vlm.pool != 1:
            raise ValueError(
                f"method {method!r} (in the tower) is counted for towers whose patches are the LLM's image tokens; "
                f"{vlm.name} pools {vlm.pool} patches into each (its projector needs the whole grid)"
            )
        feature = tower.reducing_layers - 1  # the block whose output is handed on (0-based)
        # hiprune drops after the feature block's attention; flowcut's last cut is after the block before it, its
        # earlier cuts follow each image's [CLS] entropy: counted as if they cut nothing (an upper bound)
        tower_cost = cut_tower_macs(tower, feature if method == "hiprune" else feature - 1, k)
        entering, projected, cuts = k, n_img, [(0, k)]
        own = _tower_method_own(tower, method)
    counts = _stage_counts(n_img, text_tokens, llm.layers, cuts)
    return PrefillCost(
        model=vlm.name,
        method=method,
        keep=keep,
        tower=tower_cost,
        projector=projected * projector_per_token,
        llm=llm_macs(llm, counts),
        method_own=own,
        image_tokens_entering_llm=entering,
        image_tokens_layer_mean=sum(c - text_tokens for c in counts) / llm.layers,
        tokens_per_layer=tuple(counts),
    )


def _key_macs(llm: LanguageModel, n: int) -> int:
    """The key projection of ``n`` positions (a method that scores by keys computes them again from the layer input)."""
    return n * llm.width * llm.kv_heads * llm.head_dim


def _attention_row_macs(llm: LanguageModel, n: int) -> int:
    """One query's attention row over ``n`` keys, every head: its query, the keys again, and q·kᵀ."""
    return llm.width * llm.heads * llm.head_dim + _key_macs(llm, n) + llm.heads * n * llm.head_dim


def _pre_llm_own(vlm: VLM, method: str, keep: int, text_tokens: int) -> int:
    """The dominant products of a pre-LLM selection for one image (the papers' algorithms; see docs/vlm.md); a
    method's options are its registered defaults (``method_class(name).defaults``)."""
    n, d, tokens = vlm.image_tokens, vlm.tower.width, vlm.tower.tokens
    received = 2 * tokens * d * d + tokens * tokens * d  # every query, key and q·kᵀ of one tower layer
    if vlm.tower.cls_token:  # [CLS]'s query, every key and one q·kᵀ row at the scoring layer
        scores = d * d + tokens * d * d + tokens * d
    else:  # no [CLS]: the attention each token receives (see docs/vlm.md)
        scores = received
    if method in ("random", "downsample"):  # a draw; cell means (pooling is not counted)
        return 0
    if method == "fastervlm":
        return scores
    if method == "vispruner":  # half by score; then rounds that split the rest in halves a, b, compare them (cosines
        # of the features) and drop the 8 a-tokens nearest to b, until keep - keep // 2 remain (the authors' loop)
        diverse, rest, similarities = keep - keep // 2, n - keep // 2, 0
        while rest > diverse and diverse > 0:
            similarities += ((rest + 1) // 2) * (rest // 2) * d
            rest -= min(8, rest - diverse)
        return scores + similarities
    if method == "visionzip":  # dominant by score; the rest merged into the contextual targets by keys
        options = method_class("visionzip").defaults  # the authors' dominant : contextual split, scaled to keep
        share = options["contextual"] / (options["dominant"] + options["contextual"])
        return scores + (n - keep) * max(1, round(keep * share)) * d
    if method == "scope":  # saliency, then the tower features' pairwise cosines (the greedy rounds add no products)
        return scores + n * n * d
    if method == "cdpruner":  # the projected tokens' pairwise cosines, the greedy MAP's k·(k-1)/2 row updates, and
        # with theta None (the default) the relevance: the image tokens against the text's M rows
        own = n * n * vlm.llm.width + n * keep * (keep - 1) // 2
        if method_class("cdpruner").defaults["theta"] != 0:
            own += n * text_tokens * vlm.llm.width
        return own
    if method == "divprune":  # pairwise cosine similarity of the projected image tokens
        return n * n * vlm.llm.width
    raise ValueError(f"vitrim.vlm.flops has no count for the pre-LLM method {method!r} yet")


def cost_table(
    vlm: VLM, keeps: Sequence[int] = (64, 128, 192), *, text_tokens: int = 94, methods: Sequence[str] = METHODS
) -> list[PrefillCost]:
    """The unmodified prefill, then every method at every ``keep`` (a tower method is skipped on a model that pools
    its tower's grid; a ``keep`` above the image's tokens is refused)."""
    rows = [prefill_cost(vlm, "none", text_tokens=text_tokens)]
    for method in methods:
        if method == "none":
            continue
        if method in TOWER and vlm.pool != 1:
            continue
        rows.extend(prefill_cost(vlm, method, k, text_tokens=text_tokens) for k in keeps)
    return rows

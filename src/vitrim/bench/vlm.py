"""``vitrim bench vlm``: the prefill time of a scaled-down LLaVA-1.5-7B with each token-reduction method, against
the unmodified model in the same run.

The model is transformers' own ``LlavaForConditionalGeneration`` built from a config with random weights: every
layer has LLaVA-1.5-7B's shapes (CLIP ViT-L/14 at 336 px: 577 tokens of width 1024, MLP 4096, 16 heads; Llama-2-7B:
width 4096, MLP 11008, 32 heads), there are fewer of them (default: 2 tower blocks, 1 LLM layer, so a prefill fits
a 2-core CPU), and the vocabulary is small (the LM head runs on the last position only: 0.02 % of a 7B prefill).
The prompt is one image (576 image tokens) and ``text_tokens`` text tokens.

Timing: every case (the unmodified model, then each method at each ``keep``) runs once untimed, then in turns, one
prefill each per round (``model(**inputs, logits_to_keep=1)``, what ``generate`` runs first), so every case meets
the same load; a case's time is the median over rounds, its speed-up the median of the per-round ratios to the
unmodified model. Inside each prefill, forward hooks time the vision tower (from its input to its output), and
the method's own work is timed by wrapping, on the applied stage's own objects only, the calls that compute its
evidence and its selection: a pre-LLM method's scoring taps (``ScoringTap.read``, the q·k map it reads) and its
``select``; an in-LLM method's drop policy (``choose``, which computes the attention row or keys it reads); a tower
method's reducers' calls between the blocks' halves (``before_attention``, ``after_attention``). MACs come from
:mod:`vitrim.vlm.flops` with the same scaled-down shapes, so time and MAC ratios compare like for like.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vitrim.extras import require
from vitrim.models.config_limits import LIMITS
from vitrim.vlm import apply, methods, remove
from vitrim.vlm.api import STATE_ATTRIBUTE
from vitrim.vlm.flops import LLAVA_15_7B, VLM, LanguageModel, counted_methods, prefill_cost
from vitrim.vlm.method.base import method_class

TEXT_BEFORE_IMAGE = 35  # the system prompt and "USER: " before the image in LLaVA-1.5's template
# Each setting's range: what a model config read from a file may ask for (vitrim.models.config_limits), so that a
# typo (image_size=336000) is one line naming it, not a MemoryError deep in a prefill.
SETTING_RANGES: dict[str, tuple[int, int]] = {
    "vision_layers": (1, LIMITS["num_hidden_layers"]),
    "llm_layers": (1, LIMITS["num_hidden_layers"]),
    "vocab": (2, 2**20),  # text and the image token; 2**20: a config's largest vocabulary
    "vision_width": (1, LIMITS["hidden_size"]),
    "vision_mlp": (1, LIMITS["intermediate_size"]),
    "vision_heads": (1, LIMITS["num_attention_heads"]),
    "image_size": (1, LIMITS["image_size"]),
    "patch_size": (1, LIMITS["patch_size"]),
    "llm_width": (1, LIMITS["hidden_size"]),
    "llm_mlp": (1, LIMITS["intermediate_size"]),
    "llm_heads": (1, LIMITS["num_attention_heads"]),
    "repeats": (1, 100_000),
    "text_tokens": (0, 2**17),  # a 128k-token context
    "warmup": (0, 100_000),
    "seed": (0, 2**32 - 1),
}
MAX_IMAGE_TOKENS = 16384  # Qwen2-VL's default max_pixels (12,845,056) in 28-px merged patches


@dataclass(frozen=True)
class VLMBenchSettings:
    """What ``vitrim bench vlm`` builds and runs; the widths are LLaVA-1.5-7B's (override them for a quick run)."""

    vision_layers: int = 2
    llm_layers: int = 1
    vocab: int = 1024  # the last id is the image token (LLaVA-1.5's 32,064-word head on one position: 0.1 GMACs)
    vision_width: int = 1024
    vision_mlp: int = 4096
    vision_heads: int = 16
    image_size: int = 336
    patch_size: int = 14
    llm_width: int = 4096
    llm_mlp: int = 11008
    llm_heads: int = 32
    text_tokens: int = 94
    keeps: tuple[int, ...] = (64, 128, 192)
    methods: tuple[str, ...] = ()  # empty: every registered pre-LLM method, and hiprune / flowcut (bench_methods)
    repeats: int = 3
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        check_sizes(self, SETTING_RANGES)
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size={self.image_size} is smaller than patch_size={self.patch_size}")
        patches = (self.image_size // self.patch_size) ** 2
        if patches > MAX_IMAGE_TOKENS:
            raise ValueError(
                f"image_size={self.image_size} with patch_size={self.patch_size} makes {patches} image tokens, over "
                f"the limit of {MAX_IMAGE_TOKENS} (Qwen2-VL's largest image)"
            )
        bad = [k for k in self.keeps if not 1 <= k <= patches]
        if not self.keeps or bad:
            raise ValueError(f"keeps must be image tokens in 1..{patches}, got {self.keeps}")


def check_sizes(settings: Any, ranges: dict[str, tuple[int, int]]) -> None:
    """``ValueError`` naming the setting unless each of ``ranges`` is an int in its range and each width divides
    into its heads (the settings of :class:`VLMBenchSettings` and of the video bench's)."""
    for name, (least, most) in ranges.items():
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
            raise ValueError(f"{name} must be an int in [{least}, {most}], got {value!r}")
    for width, heads in (("vision_width", "vision_heads"), ("llm_width", "llm_heads")):
        if getattr(settings, width) % getattr(settings, heads):
            raise ValueError(
                f"{width}={getattr(settings, width)} is not divisible by {heads}={getattr(settings, heads)}"
            )


@dataclass
class CaseTimes:
    """One case's per-round samples in seconds: the prefill, the tower inside it, the method's own calls."""

    method: str
    keep: int | None
    prefill: list[float] = field(default_factory=list)
    tower: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)


def flops_config(s: VLMBenchSettings) -> VLM:
    """The :mod:`vitrim.vlm.flops` description of the scaled-down model (same formulas as the real one)."""
    tower = replace(
        LLAVA_15_7B.tower,
        name=f"CLIP ({s.vision_layers} blocks)",
        image_size=s.image_size,
        patch_size=s.patch_size,
        width=s.vision_width,
        layers=s.vision_layers,
        heads=s.vision_heads,
        mlp_width=s.vision_mlp,
        feature_layer=-2 if s.vision_layers >= 2 else -1,
    )
    head_dim = s.llm_width // s.llm_heads
    llm = LanguageModel(f"Llama ({s.llm_layers} layers)", s.llm_width, s.llm_layers, s.llm_heads, s.llm_heads,
                        head_dim, s.llm_mlp, s.vocab)  # fmt: skip
    projector = ((s.vision_width, s.llm_width), (s.llm_width, s.llm_width))
    return replace(LLAVA_15_7B, name="scaled llava-1.5-7b", tower=tower, projector=projector, llm=llm)


def build_model(s: VLMBenchSettings) -> nn.Module:
    """transformers' LlavaForConditionalGeneration with LLaVA-1.5-7B's layer shapes and random weights, eval."""
    require("transformers", feature="vitrim bench vlm")
    _import_torchvision_if_any()
    import transformers

    _extra: dict[str, Any] = {"image_token_id": s.vocab - 1}  # transformers 5's name (its typing still says _index)
    config = transformers.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=s.vision_width, intermediate_size=s.vision_mlp,
            num_hidden_layers=s.vision_layers, num_attention_heads=s.vision_heads, image_size=s.image_size,
            patch_size=s.patch_size, projection_dim=768,
        ),
        text_config=dict(
            model_type="llama", vocab_size=s.vocab, hidden_size=s.llm_width, intermediate_size=s.llm_mlp,
            num_hidden_layers=s.llm_layers, num_attention_heads=s.llm_heads, num_key_value_heads=s.llm_heads,
            max_position_embeddings=4096,
        ),
        **_extra,
        vision_feature_layer=-2 if s.vision_layers >= 2 else -1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(s.seed)
    return transformers.LlavaForConditionalGeneration(config).eval()


def _import_torchvision_if_any() -> None:
    """transformers imports torchvision when it is installed; a wheel built for another torch fails at import
    (see :mod:`vitrim.data.vision`, which makes it importable)."""
    try:
        from vitrim.data.vision import _import_torchvision

        _import_torchvision()
    except ModuleNotFoundError:  # no torchvision (or no pillow): transformers does without it
        pass


def bench_inputs(s: VLMBenchSettings) -> dict[str, torch.Tensor]:
    """One prompt: ``text_tokens`` text ids around the image's (image_size / patch_size)² image tokens."""
    generator = torch.Generator().manual_seed(s.seed)
    patches = (s.image_size // s.patch_size) ** 2
    text = torch.randint(0, s.vocab - 1, (s.text_tokens,), generator=generator)
    before = min(TEXT_BEFORE_IMAGE, s.text_tokens)
    ids = torch.cat([text[:before], torch.full((patches,), s.vocab - 1), text[before:]])[None]
    pixels = torch.randn(1, 3, s.image_size, s.image_size, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def bench_methods(s: VLMBenchSettings) -> list[str]:
    """The methods to time: ``s.methods``, or every registered pre-LLM method that runs with its defaults, and the
    tower methods of their own that the scaled tower takes (hiprune; flowcut where a block runs before the feature
    block's: it cuts after those)."""
    feature_depth = s.vision_layers - 1 if s.vision_layers >= 2 else s.vision_layers  # blocks up to the feature's
    tower = ["hiprune", *(["flowcut"] if feature_depth >= 2 else [])]
    # video methods (reads_time) need a video; the bench's scaled model takes images
    names = (
        list(s.methods)
        or [n for n in methods("pre_llm") if _runs_with_defaults(n) and not method_class(n).reads_time] + tower
    )
    known = methods()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown vlm method {unknown[0]!r}; expected some of: {', '.join(known)}")
    return names


def method_options(name: str, s: VLMBenchSettings) -> dict[str, Any]:
    """Options a method needs on the scaled tower: hiprune's ``object_layer`` (9 of CLIP-L's 24) is at most the
    layer before the feature block's when the scaled tower has fewer, so that it reads two blocks' attention as on
    the real tower (its cost does not depend on which two)."""
    if name != "hiprune":
        return {}
    depth = s.vision_layers - 1 if s.vision_layers >= 2 else s.vision_layers
    return {"object_layer": min(method_class("hiprune").defaults["object_layer"], max(1, depth - 1))}


def _runs_with_defaults(name: str) -> bool:
    try:
        method_class(name)()
    except ValueError:
        return False
    return True


class _Stopwatch:
    """Forward hooks timing the vision tower, and wrappers timing a method's own calls, for one prefill."""

    def __init__(self, model: nn.Module) -> None:
        self.tower = 0.0
        self.own = 0.0
        self.inside = False  # in a timed call of the method's own now
        self._start = 0.0
        inner: Any = model.model
        tower = inner.visual if hasattr(inner, "visual") else inner.vision_tower  # Qwen's, or LLaVA's
        self._handles = [tower.register_forward_pre_hook(self._tower_in), tower.register_forward_hook(self._tower_out)]

    def _tower_in(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def _tower_out(self, *args: Any) -> None:
        self.tower += time.perf_counter() - self._start

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.inside:  # a call inside a timed one is counted once, in the outer one
                return fn(*args, **kwargs)
            start = time.perf_counter()
            self.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = False
                self.own += time.perf_counter() - start

        return wrapper

    def watch_method(self, model: nn.Module) -> None:
        """Time the applied stage's evidence and selection calls (instance attributes only; module docstring)."""
        stack: Any = getattr(model, STATE_ATTRIBUTE).stack
        for stage, part in stack.parts.items():
            if stage == "pre_llm":
                self._wrap(part.method, "select")
                for taps in part.taps:
                    if taps.scoring is not None:
                        self._wrap(taps.scoring, "read")
            elif stage == "in_llm":
                self._wrap(part.drop.policy, "choose")
            else:  # a tower method's work is its reducers' (scores, selection, the cut), between the blocks' halves
                for reducer in part.reducers.values():
                    self._wrap(reducer, "before_attention")
                    self._wrap(reducer, "after_attention")

    def _wrap(self, owner: Any, name: str) -> None:
        # an instance attribute (object.__setattr__: a drop policy is a frozen dataclass); apply() builds a new
        # instance for every case, so nothing outlives the case
        object.__setattr__(owner, name, self.timed(getattr(owner, name)))

    def reset(self) -> None:
        self.tower = self.own = 0.0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def run_bench(
    s: VLMBenchSettings, *, model: nn.Module | None = None, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Time every case (module doc); returns the settings, the rows and the MAC counts (JSON-ready)."""
    model = build_model(s) if model is None else model
    cases = [CaseTimes("none", None)] + [CaseTimes(m, k) for m in bench_methods(s) for k in s.keeps]

    def install(case: CaseTimes) -> bool:
        if case.keep is not None:
            apply(model, case.method, keep=case.keep, **method_options(case.method, s))
        return case.keep is not None

    time_cases(model, bench_inputs(s), cases, install, warmup=s.warmup, repeats=s.repeats, log=log)
    return {"rows": summarize(cases, flops_config(s), s.text_tokens), "threads": torch.get_num_threads()}


def time_cases(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    cases: Sequence[CaseTimes],
    install: Callable[[CaseTimes], bool],
    *,
    warmup: int,
    repeats: int,
    log: Callable[[str], None] | None = None,
) -> None:
    """Every case ``warmup`` times untimed, then ``repeats`` rounds of one prefill each in turns (module doc),
    recorded into the cases; ``install(case)`` applies the case's method(s) and says whether it applied any (they
    are removed after each prefill)."""
    watch = _Stopwatch(model)

    def prefill(case: CaseTimes, record: bool) -> None:
        applied = install(case)
        if applied:
            watch.watch_method(model)
        watch.reset()
        try:
            start = time.perf_counter()
            model(**inputs, logits_to_keep=1)
            elapsed = time.perf_counter() - start
        finally:
            if applied:
                remove(model)
        if record:
            case.prefill.append(elapsed)
            case.tower.append(watch.tower)
            case.own.append(watch.own)

    try:
        with torch.inference_mode():
            for case in cases:
                for _ in range(warmup):
                    prefill(case, record=False)
            for round_ in range(repeats):
                for case in cases:
                    prefill(case, record=True)
                if log is not None:
                    log(f"round {round_ + 1}/{repeats} done")
    finally:
        watch.remove()


def timing_row(base: CaseTimes, case: CaseTimes, macs: int, full_macs: int) -> dict[str, float]:
    """One case's columns against the unmodified ``base`` of the same rounds: median times, the paired speed-up, the
    MAC speed-up (``full_macs / macs``) and the issue's two targets."""
    speedup = statistics.median(b / t for b, t in zip(base.prefill, case.prefill, strict=True))
    prefill_ms = statistics.median(case.prefill) * 1e3
    own_ms = statistics.median(case.own) * 1e3
    mac_speedup = full_macs / macs
    return {
        "prefill_ms": prefill_ms,
        "tower_ms": statistics.median(case.tower) * 1e3,
        "own_ms": own_ms,
        "speedup": speedup,
        "mac_speedup": mac_speedup,
        "speedup_vs_macs": speedup / mac_speedup,  # target >= 0.6
        "own_share": own_ms / prefill_ms,  # target <= 0.05
        "gmacs": macs / 1e9,
    }


def timing_cells(row: dict[str, Any], *, targets: bool) -> str:
    """A row's timing columns of a Markdown table (:func:`timing_row`'s), then its two targets each marked met or
    not met (empty where ``targets`` is False: the unmodified model's row)."""
    ratio = f"{row['speedup_vs_macs']:.2f} {'met' if row['speedup_vs_macs'] >= 0.6 else 'NOT met'}"
    share = f"{100 * row['own_share']:.2f} % {'met' if row['own_share'] <= 0.05 else 'NOT met'}"
    return (
        f"{row['prefill_ms']:.0f} | {row['tower_ms']:.0f} | {row['own_ms']:.1f} | {row['speedup']:.2f} | "
        f"{row['mac_speedup']:.2f} | " + (f"{ratio} | {share}" if targets else " | ")
    )


def summarize(cases: Sequence[CaseTimes], vlm: VLM, text_tokens: int) -> list[dict[str, Any]]:
    """Per case: median times, the paired speed-up, the MAC speed-up, and the issue's two targets."""
    full_macs = prefill_cost(vlm, text_tokens=text_tokens).total
    rows, counted = [], counted_methods()  # read now: a method registered after the import is counted too
    for case in cases:
        method = case.method if case.method in counted else "random"  # a method with no cost count: LLM cut only
        macs = prefill_cost(vlm, method, case.keep, text_tokens=text_tokens).total if case.keep else full_macs
        rows.append({"method": case.method, "keep": case.keep, **timing_row(cases[0], case, macs, full_macs)})
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table, with the two targets marked met or not met."""
    lines = [
        "| method | keep | prefill ms | tower ms | method's own ms | speed-up | MAC speed-up | speed-up / MAC "
        "speed-up (≥ 0.6) | own / prefill (≤ 5 %) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        first = r["keep"] is None
        lines.append(f"| {r['method']} | {'all' if first else r['keep']} | {timing_cells(r, targets=not first)} |")
    return "\n".join(lines) + "\n"

"""The ``vitrim`` entry of a vLLM model's config: which method, how many tokens per image (owned here).

It comes from ``--hf-overrides`` (``LLM(hf_overrides=...)`` in Python), beside the architecture that runs it::

    {"architectures": ["VitrimLlavaForConditionalGeneration"],
     "vitrim": {"method": "visionzip", "keep": 64, "dominant": 54}}

``method`` is a pre-LLM method of vitrim.vlm (on LLaVA-1.5 also a tower method: :mod:`vitrim.vllm.tower_stage`);
``keep`` an int (image tokens per image, and per temporal patch of a video) or a float in (0, 1] (a fraction of
each), as in ``vitrim.vlm.apply``; a family's own option as ``apply`` takes it (LLaVA-NeXT's ``"tiles":
"unpadded"``); every other key is an option of the method under its authors' name (``dominant`` above). A video
method (``evs``, ``vidcom2``, ``temporal_downsample``, ``flashvid`` with ``exact_count``) takes no ``keep``: it
decides each video's count from its grid (:data:`VIDEO_COUNTS`) and leaves images whole, on an architecture that
serves videos (:data:`VIDEO_ARCHITECTURES`).

Why this form: ``--hf-overrides`` is vLLM's own way to change a checkpoint's config, ``architectures`` is how vLLM
picks the model class, and the options live in the config the engine hands every process, so the front end (which
counts each image's and video's placeholders) and the workers (which select) read the same values. Every error is
one line starting ``vitrim:`` and naming the value, raised when the engine starts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard, cast

import vitrim.vlm  # noqa: F401  (registers every method)
from vitrim.reduce import Reducer, get_reducer
from vitrim.reduce.pitome import pitome_patches_left
from vitrim.reduce.ppt import ppt_patches_left
from vitrim.vlm.families import checked_family_options, family_option_names, served_architectures, served_traits
from vitrim.vlm.keep import KeepSpec, parse_keep
from vitrim.vlm.method.base import Method, method_class, methods
from vitrim.vlm.method.evs import evs_count
from vitrim.vlm.method.flashvid import FlashVIDSelection, flashvid_count
from vitrim.vlm.method.tower_reducers import TowerLayout, TowerMethod
from vitrim.vlm.method.vidcom2 import vidcom2_count
from vitrim.vlm.stages.contract import ServedArchitecture

# the one table of served architectures, read from the families' files (their traits' ``served``)
ARCHITECTURES: dict[str, ServedArchitecture] = served_architectures()
EXAMPLE = '{"architectures": ["VitrimLlavaForConditionalGeneration"], "vitrim": {"method": "visionzip", "keep": 64}}'
# the architectures whose videos the plugin trims (the others take images only)
VIDEO_ARCHITECTURES = ("VitrimQwen2_5_VLForConditionalGeneration", "VitrimQwen3VLForConditionalGeneration")
# per served video method: the tokens it keeps of a video of t temporal patches of P tokens, from the grid alone
# (vLLM writes a prompt's placeholders before the tower runs); the method's own selection keeps exactly as many
VIDEO_COUNTS: dict[str, Callable[[Method, int, int], int]] = {
    "evs": lambda method, frames, per_frame: evs_count(per_frame, frames, method.options["video_pruning_rate"]),
    "vidcom2": lambda method, frames, per_frame: vidcom2_count(per_frame, frames, method.options["video_pruning_rate"]),
    "temporal_downsample": lambda method, frames, per_frame: math.ceil(frames / method.options["stride"]) * per_frame,
    "flashvid": lambda method, frames, per_frame: flashvid_count(
        cast(FlashVIDSelection, method).flashvid_options(), frames, per_frame
    ),
}
# per served video method whose count the grid fixes only at some option value: (option, value, why it must be so);
# the method is offered at that value, and refused at engine start without it
SERVED_WITH: dict[str, tuple[str, Any, str]] = {
    "flashvid": (
        "exact_count",
        True,
        "rounds each temporal patch's clusters up by the video's content (t·B tokens or more, at most one more per "
        "temporal patch), and vLLM writes a prompt's placeholders before the tower runs; pass "
        '"exact_count": true (each segment\'s clusters shared by largest remainder: exactly t·B per video)',
    ),
}
# the architectures whose vision tower the plugin reduces in (vitrim.vllm.tower_stage: vLLM's CLIP and SigLIP)
TOWER_ARCHITECTURES = ("VitrimLlavaForConditionalGeneration", "VitrimGemma3ForConditionalGeneration")
# per tower reducer that takes no keep (it removes a count per block set by its own options): the patches its reducers
# leave at the feature layer of a tower, from the tower's layout and the reducers built, in block order; each
# block's count is fixed by the tokens entering it and its options, whatever the image (the reducer's own module)
OWN_COUNTS: dict[str, Callable[[TowerLayout, list[Any]], int]] = {
    "pitome": lambda layout, blocks: pitome_patches_left(layout.patches, [block.ratio for block in blocks]),
    "ppt": lambda layout, blocks: ppt_patches_left(layout.patches, [block.r for block in blocks]),
}


def sets_own_count(method: Method) -> TypeGuard[TowerMethod]:
    """Whether ``method`` is a tower method of :data:`OWN_COUNTS` (PiToMe, PPT): served without ``keep``."""
    return isinstance(method, TowerMethod) and method.reducer in OWN_COUNTS


def own_count(method: TowerMethod, layout: TowerLayout, reducers: Mapping[int, Reducer]) -> int:
    """The patches per image that ``method``'s ``reducers`` (by block, built for a tower of ``layout`` without
    ``keep``) leave at the feature layer: :data:`OWN_COUNTS`."""
    return OWN_COUNTS[method.reducer](layout, [reducers[block] for block in sorted(reducers)])


def refused(method: Method, architecture: str | None = None) -> str | None:
    """Why vLLM serving cannot run ``method`` (a method with its options) on ``architecture`` (None: on the
    architecture that serves it best); None: it can. A served model runs vitrim.vlm's one encoder seam
    (:mod:`vitrim.vlm.stages.capture`) on the evidence vLLM's tower gives, so every pre-LLM method that selects from
    the images alone is served, and every video method whose count the grid fixes. The tower methods run inside
    vLLM's CLIP and SigLIP towers (:data:`TOWER_ARCHITECTURES`, :mod:`vitrim.vllm.tower_stage`), where vLLM writes
    the prompt's placeholders before the tower runs: with ``keep``, the count they leave at the feature layer
    whatever the image; PiToMe and PPT take no ``keep``, and are served because their own options and the tower's
    patch count fix theirs, whatever the image (:data:`OWN_COUNTS`); a reducer taking no ``keep`` without such a
    count would be refused. Refused: the in-LLM methods (they rank by the LLM's attention rows, which vLLM's paged
    attention does not hand a model), the tower methods on another tower (vitrim.vlm runs them in CLIP and SigLIP
    only, never in LLaVA-NeXT's tiles or Qwen's windowed ViT), and a video method whose count depends on the video's
    content (FastVID's segments: vLLM writes the placeholders before the tower runs; FlashVID's rounded clusters
    unless ``exact_count``, :data:`SERVED_WITH`). A method that reads the prompt
    (CDPruner) is served where the architecture hands each image its prompt's text (:data:`INSTRUCTION_RELEVANCES`,
    :func:`check_instruction`)."""
    if method.stage == "in_llm":
        return (
            "prunes inside the LLM by its attention rows, which vLLM's paged attention does not hand a model; the "
            "plugin serves pre-LLM and tower methods"
        )
    if method.stage == "tower":
        if architecture is not None and architecture not in TOWER_ARCHITECTURES:
            return (
                f"reduces inside the vision tower, which the plugin does on {' and '.join(TOWER_ARCHITECTURES)} "
                f"(CLIP and SigLIP) only, not on {architecture}"
            )
        reducer = getattr(method, "reducer", "")
        if reducer and not get_reducer(reducer).takes_schedule() and reducer not in OWN_COUNTS:
            return (
                "sets its count block by block from its own options and takes no 'keep'; the plugin serves a tower "
                "method with 'keep', the count the prompt is written with before the tower runs"
            )
        return None
    if method.reads_time and method.name not in VIDEO_COUNTS:
        return (
            "keeps a count that depends on the video's content, and vLLM writes a prompt's placeholders before the "
            "tower runs"
        )
    if method.name in SERVED_WITH:
        option, value, why = SERVED_WITH[method.name]
        if method.options[option] != value:
            return f"with {option}={method.options[option]!r} {why}"
    return None


# per architecture whose front end hands each image the prompt's text (vitrim.vllm.prompt_instruction): the relevance
# signals CDPruner may read there ("clip" needs a CLIP tower whose projection reads the feature layer: LLaVA-1.5's)
INSTRUCTION_RELEVANCES: dict[str, tuple[str, ...]] = {
    "VitrimLlavaForConditionalGeneration": ("llm", "clip"),
    "VitrimQwen2_5_VLForConditionalGeneration": ("llm",),
    "VitrimQwen3VLForConditionalGeneration": ("llm",),
}


def reads_question(method: Method) -> bool:
    """Whether ``method`` reads each request's question (CDPruner's ``relevance="clip"``, the authors' signal: the
    question through CLIP's text tower), given per request as ``mm_processor_kwargs={"vitrim": {"question": …}}``."""
    return method.reads_instruction() and method.options.get("relevance") == "clip"


def check_instruction(method: Method, architecture: str) -> None:
    """``ValueError`` (one line) where ``method`` reads the prompt and ``architecture`` cannot hand it, or reads a
    relevance the architecture has no tower for. On vLLM the engine fixes the signal: ``relevance=None`` reads the
    prompt's text (``"llm"``, vitrim.vlm's default without ``texts=``); ``"clip"`` reads each request's question."""
    if not method.reads_instruction():
        return
    relevances = INSTRUCTION_RELEVANCES.get(architecture)
    if relevances is None:
        served = ", ".join(INSTRUCTION_RELEVANCES)
        raise ValueError(
            f"method {method.name!r} reads the prompt, and {architecture} does not hand its selection the prompt's "
            f"text (served on {served}; theta=0 selects from the images alone)"
        )
    relevance = method.options.get("relevance") or "llm"
    if relevance not in relevances:
        raise ValueError(
            f"method {method.name!r} relevance={relevance!r} reads CLIP's projection of the tower's states, and "
            f"{architecture}'s tower is not a CLIP; use relevance='llm' (the default: the prompt's text)"
        )


def pre_llm_methods(architecture: str | None = None) -> list[str]:
    """The image methods vLLM serving offers (on ``architecture``: those it serves, :func:`check_instruction`):
    every pre-LLM method but those :func:`refused` names; each also trims a video per temporal patch where the
    architecture serves videos (a method reading the prompt: images only)."""
    offered = [name for name in methods(stage="pre_llm") if not method_class(name).reads_time and served(name)]
    return [name for name in offered if architecture is None or instruction_served(name, architecture)]


def instruction_served(name: str, architecture: str) -> bool:
    """Whether ``architecture`` serves method ``name`` at its default options as far as the prompt goes."""
    try:
        check_instruction(method_class(name)(), architecture)
    except ValueError:
        return False
    return True


def tower_methods() -> list[str]:
    """The tower methods vLLM serving offers, on :data:`TOWER_ARCHITECTURES` (each with ``keep``)."""
    return [name for name in methods(stage="tower") if served(name)]


def video_methods() -> list[str]:
    """The video methods vLLM serving offers (on :data:`VIDEO_ARCHITECTURES`): those whose count the grid fixes."""
    return [name for name in methods(stage="pre_llm") if method_class(name).reads_time and served(name)]


def served(name: str) -> bool:
    """Whether vLLM serving offers method ``name`` (at the option value :data:`SERVED_WITH` asks, where it asks)."""
    needed = {SERVED_WITH[name][0]: SERVED_WITH[name][1]} if name in SERVED_WITH else {}
    return refused(method_class(name)(**needed)) is None


@dataclass(frozen=True)
class TrimOptions:
    """A validated ``vitrim`` entry: the method (options checked), ``keep``, and the family's own options."""

    method: Method
    keep: KeepSpec | None  # None: a tower method that sets its own count (OWN_COUNTS), until its family fixes it
    question: str | None = None  # a request's question (``reads_question`` methods), None for the engine's own
    # the served family's own options (FamilyTraits.options, LLaVA-NeXT's "tiles"), checked; the engine's, every request
    family_options: Mapping[str, str] = field(default_factory=dict)
    keep_given: bool = True  # False: ``keep`` is the method's default_keep() (VisionZip's dominant + contextual)
    # a request's own options of the method (the JSON values it gave, over the engine's; :func:`request_options`):
    # they travel to the worker beside each item (vitrim.vllm.request_keep), which builds the same method from them
    overrides: Mapping[str, Any] = field(default_factory=dict)
    whose: str = ""  # "this request's " in the errors of a request's options

    def tokens(self, num_tokens: int) -> int:
        """Tokens kept of an image of ``num_tokens`` tokens; ``ValueError`` (one line) when ``keep`` exceeds them or
        the method cannot keep that many with its options (a fraction resolved here: the worker's selection would
        raise it otherwise, which would stop the engine rather than fail one request)."""
        try:
            count = self.spec().tokens(num_tokens)
            if self.method.stage == "pre_llm":
                self.method.check_keep(count)
        except ValueError as error:
            raise ValueError(f"vitrim: {self.whose}{error}") from None
        return count

    def spec(self) -> KeepSpec:
        """``keep``; ``RuntimeError`` where an own-count method's family has not fixed it from its tower."""
        if self.keep is None:
            raise RuntimeError(f"vitrim: method {self.method.name!r} sets its own count; no family fixed it")
        return self.keep

    def video_tokens(self, frames: int, per_frame: int) -> int:
        """Tokens kept of a video of ``frames`` temporal patches of ``per_frame`` tokens: a video method's own
        count (:data:`VIDEO_COUNTS`), an image method's ``keep`` of each temporal patch."""
        count = VIDEO_COUNTS.get(self.method.name)
        if self.method.reads_time and count is not None:
            return count(self.method, frames, per_frame)
        try:
            return frames * self.spec().tokens(per_frame)
        except ValueError as error:
            raise ValueError(f"vitrim: {error} (each temporal patch of a video of {frames})") from None


def refuse_vllm_video_pruning(pruning: tuple[str, float] | None, options: TrimOptions) -> None:
    """``ValueError`` (one line) where vLLM's own video pruning is on (``pruning``: its ``MultiModalConfig``'s
    ``get_video_pruning_spec()``, (method, rate) or None) beside a vitrim method: on a Qwen architecture of vitrim a
    video is trimmed by vitrim's method (a video method, or an image method per temporal patch), and two prunings
    of one video are not a configuration anyone means. vitrim's ``evs`` is EVS on the same merger output, at
    vitrim's positions (docs/video.md)."""
    if pruning is None:
        return
    method, rate = pruning
    raise ValueError(
        f"vitrim: vLLM's own video pruning (video_pruning_method={method!r}, video_pruning_rate={rate}) and vitrim's "
        f"method {options.method.name!r} would both trim the videos; drop --video-pruning-rate (vitrim's method "
        "'evs' with 'video_pruning_rate' is EVS, at vitrim's positions)"
    )


def trim_options(hf_config: Any, architecture: str) -> TrimOptions:
    """The ``vitrim`` entry of ``hf_config`` for ``architecture``, validated; ``ValueError`` (one line) otherwise."""
    model_type = getattr(hf_config, "model_type", None)
    expected = ARCHITECTURES[architecture].model_type
    if model_type != expected:
        served = ", ".join(f"{a} ({s.model_type})" for a, s in ARCHITECTURES.items())
        raise ValueError(
            f"vitrim: architecture {architecture} runs {expected!r} checkpoints; this one has model_type "
            f"{model_type!r} (vitrim serves: {served})"
        )
    raw = getattr(hf_config, "vitrim", None)
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"vitrim: architecture {architecture} needs a 'vitrim' entry in --hf-overrides, e.g. {EXAMPLE}"
        )
    unnamed = [key for key in raw if not isinstance(key, str)]
    if unnamed:
        raise ValueError(f"vitrim: the 'vitrim' entry's keys must be option names (strings), got {unnamed[0]!r:.80}")
    options = dict(raw)
    name = options.pop("method", None)
    keep = options.pop("keep", None)
    given = {option: options.pop(option) for option in sorted(family_option_names()) if option in options}
    try:
        family_options = checked_family_options(served_traits(architecture), given)
        method = method_class(name)(**options)
        why = refused(method, architecture)
        if why is not None:
            offered = ", ".join(pre_llm_methods() + video_methods())
            towers = ", ".join(tower_methods())
            raise ValueError(
                f"method {name!r} {why}; vLLM serving offers: {offered} (and on {', '.join(TOWER_ARCHITECTURES)}: "
                f"{towers})"
            )
        check_instruction(method, architecture)
        if method.reads_time:
            return video_options(method, keep, architecture)
        if sets_own_count(method):
            if keep is not None:
                strength = get_reducer(method.reducer).strength_option
                own = f" ({strength.name})" if strength else ""
                raise ValueError(
                    f"method {name!r} removes the patches its own options{own} fix, block by block, and takes no "
                    f"'keep'; drop keep={keep!r}"
                )
            return TrimOptions(method=method, keep=None)
        if keep is None:
            keep = method.default_keep()
        if keep is None:
            raise ValueError(f"method {name!r} needs 'keep' (image tokens per image, or a fraction in (0, 1])")
        spec = parse_keep(keep)
        if spec.count is not None:  # a count is checked against the method's own options, as apply does
            method.check_keep(spec.count)
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: {error}") from None
    return TrimOptions(method=method, keep=spec, family_options=family_options, keep_given="keep" in raw)


REQUEST_EXAMPLE = '{"vitrim": {"keep": 32, "dominant": 24, "contextual": 8}}'
REQUEST_KEYS = {"keep", "question"}
# the method's options a request may not set, and why: the engine fixes them for every request, since they decide
# what the tower is tapped for or loads when the engine starts, or the prompt's layout beyond the count
ENGINE_ONLY: dict[str, str] = {
    "positions": "decides the prompt's layout (the kept tokens' order and positions), which the engine fixes",
    "relevance": (
        "decides what the selection reads (the prompt's text, or the question through a CLIP the engine loads when "
        "it starts)"
    ),
    "clip": "names the CLIP the engine loads when it starts",
    "clip_tokenizer": "names the tokenizer of the CLIP the engine loads when it starts",
}


def request_options(engine: TrimOptions, mm_processor_kwargs: Mapping[str, object]) -> TrimOptions:
    """The options of one request: the engine's, with what the request's ``mm_processor_kwargs={"vitrim": {…}}``
    gives: ``keep``, ``question`` (a method that :func:`reads_question`) and the engine's method's own options
    (VisionZip's ``dominant``, ``contextual``; CDPruner's ``theta``; …), each over the engine's and checked as the
    engine checks its own (the same constructor, so the same lines, "vitrim: this request's …"). ``keep`` decides
    the request's placeholders in the front end and travels to the tower with the request's pixels, the options
    (:attr:`TrimOptions.overrides`) beside them (:mod:`vitrim.vllm.request_keep`), ``question`` beside each image
    (:mod:`vitrim.vllm.prompt_instruction`). Where the request gives no ``keep``: the engine's, or where the engine
    gave none, the request's method's own default (VisionZip's ``dominant + contextual``), as an engine started
    with those options would keep. Refused: another method, the family's options and :data:`ENGINE_ONLY` (what the
    taps, the loaded CLIP or the prompt's layout depend on), a change of whether the method reads the prompt, any
    option of a tower method, and a video method's ``keep`` (its options decide each video's count, here as at
    engine start: :data:`VIDEO_COUNTS`, :data:`SERVED_WITH`). ``ValueError`` (one line), which fails that request
    alone."""
    raw = mm_processor_kwargs.get("vitrim")
    if raw is None:
        return engine
    method = engine.method
    if method.stage == "tower":
        raise ValueError(
            f"vitrim: method {method.name!r} reduces inside the tower with reducers built for the engine's "
            "keep; a request's 'keep' and options are for the pre-LLM methods"
        )
    if not isinstance(raw, Mapping) or not raw or not all(isinstance(key, str) for key in raw):
        raise ValueError(
            f"vitrim: a request's mm_processor_kwargs 'vitrim' entry takes 'keep', 'question' and the engine's "
            f"method's options by name (e.g. {REQUEST_EXAMPLE}), got {raw!r:.80}"
        )
    asked = {key: value for key, value in raw.items() if key not in REQUEST_KEYS}
    try:  # the options as the worker reads them back from the item's field: the front end builds from the same
        asked = json.loads(json.dumps(asked, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError):
        raise ValueError(
            f"vitrim: this request's options must be JSON values (numbers, strings), got {asked!r:.80}"
        ) from None
    question = raw.get("question")
    if "question" in raw and not reads_question(method):
        raise ValueError(
            f"vitrim: this request's question is read by cdpruner with relevance='clip' alone; this engine's "
            f"{method.name!r} reads {'the prompt' if method.reads_instruction() else 'the images'}"
        )
    if "question" in raw and (not isinstance(question, str) or not question.strip()):
        raise ValueError(f"vitrim: this request's question={question!r:.80} must be a non-empty string")
    if method.reads_time and "keep" in raw:
        raise ValueError(
            f"vitrim: method {method.name!r} decides each video's count itself, from its options; this request's "
            "'keep' is for the image methods (give the method's own options, e.g. 'video_pruning_rate')"
        )
    options = engine if not asked else replace(engine, method=request_method(engine.method, asked), overrides=asked)
    why = refused(options.method) if asked else None  # FlashVID without exact_count: a count the grid does not fix
    if why is not None:
        raise ValueError(f"vitrim: this request's options: method {method.name!r} {why}")
    options = replace(options, question=question, whose="this request's ")
    if "keep" not in raw and (engine.keep_given or not asked):
        return options
    try:
        spec = parse_keep(raw["keep"] if "keep" in raw else options.method.default_keep())
        if spec.count is not None:
            options.method.check_keep(spec.count)
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: this request's {error}") from None
    return replace(options, keep=spec)


def request_method(engine: Method, asked: Mapping[str, Any]) -> Method:
    """The engine's method with a request's own options ``asked`` over the options the engine named (the rest stay
    their defaults, as on the engine), checked by its constructor; state the engine loaded for it when it started
    (CDPruner's CLIP towers) is shared. ``ValueError`` (one line, "vitrim: this request's …") for an option the
    engine fixes (:data:`ENGINE_ONLY`, the method, the family's options), an unknown one or a bad value, or a
    ``theta`` that changes whether CDPruner reads the prompt (the front end hands each image its text only where
    the engine's method reads it). The worker builds the same method from the same ``asked``
    (:func:`vitrim.vllm.request_keep.item_methods`)."""
    for option, value in asked.items():
        why = ENGINE_ONLY.get(option) if option in engine.options else None  # else: unknown, the constructor says
        if option == "method" and value != engine.name:
            why = f"is the engine's ({engine.name!r}; an engine serves one method)"
        elif option in family_option_names():
            why = "decides how the family lays out an image's tokens in the prompt, which the engine fixes"
        elif option == "cls" and value is True:
            why = "hands the LLM the tower's [CLS] or fails where it has no room or the tower none; pass None or False"
        if why is not None:
            raise ValueError(f"vitrim: this request's {option}={value!r:.40} {why}")
    own = {option: value for option, value in asked.items() if option != "method"}
    named = {option: engine.options[option] for option in engine.given}
    try:
        method = type(engine)(**{**named, **own})
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: this request's {error}") from None
    if method.reads_instruction() != engine.reads_instruction():
        reads = "reads the prompt" if engine.reads_instruction() else "selects from the images alone"
        raise ValueError(
            f"vitrim: this request's theta={method.options.get('theta')!r} changes whether {engine.name!r} reads "
            f"the prompt, and the engine's {reads} (the front end hands each image its text by the engine's); keep "
            "theta on the engine's side of 0"
        )
    for name, value in vars(engine).items():  # what the engine loaded for its method (CDPruner's CLIP)
        if name not in ("options", "given") and value is not None:
            setattr(method, name, value)
    return method


def video_options(method: Method, keep: Any, architecture: str) -> TrimOptions:
    """A video method's options: served on :data:`VIDEO_ARCHITECTURES`, without ``keep`` (its count is its own;
    images keep every token, as ``vitrim.vlm.apply`` leaves them)."""
    if architecture not in VIDEO_ARCHITECTURES:
        raise ValueError(
            f"method {method.name!r} reduces videos, and {architecture} serves images only (videos: "
            f"{', '.join(VIDEO_ARCHITECTURES)})"
        )
    if keep is not None:
        raise ValueError(f"method {method.name!r} decides each video's count itself; drop 'keep' (got {keep!r})")
    return TrimOptions(method=method, keep=parse_keep(1.0))

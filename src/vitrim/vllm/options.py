"""The ``vitrim`` entry of a vLLM model's config: which method, how many tokens per image (owned here).

It comes from ``--hf-overrides`` (``LLM(hf_overrides=...)`` in Python), beside the architecture that runs it::

    {"architectures": ["VitrimLlavaForConditionalGeneration"],
     "vitrim": {"method": "visionzip", "keep": 64, "dominant": 54}}

``method`` is a pre-LLM method of vitrim.vlm; ``keep`` an int (image tokens per image) or a float in (0, 1] (a
fraction of each image's tokens), as in ``vitrim.vlm.apply``; every other key is an option of the method under its
authors' name (``dominant`` above). Why this form: ``--hf-overrides`` is vLLM's own way to change a checkpoint's
config, ``architectures`` is how vLLM picks the model class, and the options live in the config the engine hands
every process, so the front end (which counts each image's placeholders) and the workers (which select) read the
same values. Every error is one line starting ``vitrim:`` and naming the value, raised when the engine starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import vitrim.vlm  # noqa: F401  (registers every method)
from vitrim.vlm.families import served_architectures
from vitrim.vlm.keep import KeepSpec, parse_keep
from vitrim.vlm.method.base import Method, method_class, methods
from vitrim.vlm.stages.contract import ServedArchitecture

# the one table of served architectures, read from the families' files (their traits' ``served``)
ARCHITECTURES: dict[str, ServedArchitecture] = served_architectures()
EXAMPLE = '{"architectures": ["VitrimLlavaForConditionalGeneration"], "vitrim": {"method": "visionzip", "keep": 64}}'


def refused(method: Method) -> str | None:
    """Why vLLM serving cannot run ``method`` (a method with its options; None: it can). A served model runs
    vitrim.vlm's one encoder seam (:mod:`vitrim.vlm.stages.capture`) on the evidence vLLM's tower gives, so every
    pre-LLM method that selects from the images alone is served. Refused: the other stages (the tower's and the
    LLM's are not hooked in vLLM; its paged attention hands a model no attention rows), a video method (the plugin
    trims images; vLLM serves EVS and VidCom2 itself), and a method that reads the prompt (CDPruner unless
    ``theta=0``: vLLM encodes the images before the text reaches the model)."""
    if method.stage != "pre_llm":
        return f"cuts at stage {method.stage!r}, and the plugin serves pre-LLM methods"
    if method.reads_time:
        return "reduces videos, and the plugin serves images (vLLM's own --video-pruning-method serves EVS and VidCom2)"
    if method.reads_instruction():
        return "reads the prompt, which vLLM has not handed the model when it encodes the images"
    return None


def pre_llm_methods() -> list[str]:
    """The methods vLLM serving offers: every pre-LLM method that selects from the images alone (:func:`refused`)."""
    return [name for name in methods(stage="pre_llm") if refused(method_class(name)()) is None]


@dataclass(frozen=True)
class TrimOptions:
    """A validated ``vitrim`` entry: the method (options checked) and ``keep``."""

    method: Method
    keep: KeepSpec

    def tokens(self, num_tokens: int) -> int:
        """Tokens kept of an image of ``num_tokens`` tokens; ``ValueError`` (one line) when ``keep`` exceeds them."""
        try:
            return self.keep.tokens(num_tokens)
        except ValueError as error:
            raise ValueError(f"vitrim: {error}") from None


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
    try:
        method = method_class(name)(**options)
        why = refused(method)
        if why is not None:
            offered = ", ".join(pre_llm_methods())
            raise ValueError(f"method {name!r} {why}; vLLM serving offers: {offered}")
        if keep is None:
            keep = method.default_keep()
        if keep is None:
            raise ValueError(f"method {name!r} needs 'keep' (image tokens per image, or a fraction in (0, 1])")
        spec = parse_keep(keep)
        if spec.count is not None:  # a count is checked against the method's own options, as apply does
            method.check_keep(spec.count)
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: {error}") from None
    return TrimOptions(method=method, keep=spec)


REQUEST_EXAMPLE = '{"vitrim": {"keep": 32}}'


def request_options(engine: TrimOptions, mm_processor_kwargs: Mapping[str, object]) -> TrimOptions:
    """The options of one request: the engine's, with the ``keep`` of the request's
    ``mm_processor_kwargs={"vitrim": {"keep": …}}`` where it gives one. Only ``keep`` is taken per request: it decides
    the request's placeholders in the front end and travels to the tower with the request's pixels; the method and
    its other options are the engine's. ``ValueError`` (one line) for anything else, which fails that request alone."""
    raw = mm_processor_kwargs.get("vitrim")
    if raw is None:
        return engine
    if not isinstance(raw, Mapping) or set(raw) != {"keep"}:
        raise ValueError(
            f"vitrim: a request's mm_processor_kwargs 'vitrim' entry takes 'keep' alone (e.g. {REQUEST_EXAMPLE}; the "
            f"method and its options are the engine's), got {raw!r:.80}"
        )
    try:
        spec = parse_keep(raw["keep"])
        if spec.count is not None:
            engine.method.check_keep(spec.count)
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: this request's {error}") from None
    return replace(engine, keep=spec)

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
from dataclasses import dataclass
from typing import Any

import vitrim.vlm  # noqa: F401  (registers every method)
from vitrim.vlm.keep import KeepSpec, parse_keep
from vitrim.vlm.method.base import Method, method_class, methods

# architecture registered by the plugin -> (vLLM's class it subclasses, the checkpoint's model_type it runs)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "VitrimLlavaForConditionalGeneration": ("LlavaForConditionalGeneration", "llava"),
    "VitrimQwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
}
EXAMPLE = '{"architectures": ["VitrimLlavaForConditionalGeneration"], "vitrim": {"method": "visionzip", "keep": 64}}'


# the pre-LLM methods whose selection inside vLLM is verified against vitrim.vlm on transformers (tests/vllm); the
# newer ones are not offered yet: downsample needs Qwen's token grid and scope was not run through these tests,
# cdpruner reads the prompt (vLLM encodes the images before the text reaches the model); the tower methods
# (hiprune, flowcut, the reducers) cut inside the vision tower, which the plugin does not hook
SERVED = ("random", "fastervlm", "vispruner", "visionzip", "divprune")


def pre_llm_methods() -> list[str]:
    """The methods vLLM serving offers: the pre-LLM ones of :data:`SERVED` (they select before the LLM, from the
    images alone)."""
    return [name for name in methods(stage="pre_llm") if name in SERVED]


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
    expected = ARCHITECTURES[architecture][1]
    if model_type != expected:
        raise ValueError(
            f"vitrim: architecture {architecture} runs {expected!r} checkpoints; this one has model_type "
            f"{model_type!r} (vitrim serves: {', '.join(f'{a} ({t})' for a, (_, t) in ARCHITECTURES.items())})"
        )
    raw = getattr(hf_config, "vitrim", None)
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"vitrim: architecture {architecture} needs a 'vitrim' entry in --hf-overrides, e.g. {EXAMPLE}"
        )
    options = dict(raw)
    name = options.pop("method", None)
    keep = options.pop("keep", None)
    try:
        cls = method_class(name)
        if cls.stage != "pre_llm":
            raise ValueError(
                f"method {name!r} cuts at stage {cls.stage!r}; vLLM serving offers the pre-LLM methods: "
                f"{', '.join(pre_llm_methods())}"
            )
        if name not in SERVED:
            raise ValueError(
                f"method {name!r} is not served through vLLM yet (its selection there is not verified); vLLM serving "
                f"offers: {', '.join(pre_llm_methods())}"
            )
        method = cls(**options)
        if keep is None:
            keep = method.default_keep()
        if keep is None:
            raise ValueError(f"method {name!r} needs 'keep' (image tokens per image, or a fraction in (0, 1])")
        spec = parse_keep(keep)
    except (ValueError, TypeError) as error:
        raise ValueError(f"vitrim: {error}") from None
    return TrimOptions(method=method, keep=spec)

"""The cache's name in transformers' public API: ``cache`` from 5.20 on (the forward's keyword and the output's
field), ``past_key_values`` before (5.19 is vLLM's pin). The tests read and pass it through these two helpers, so
the suite runs on every transformers vitrim.vlm supports."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE = (
    "cache" if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)


def cache_of(output: Any) -> Any:
    """The cache a model's forward returned."""
    return getattr(output, CACHE)


def cache_kw(cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to a model's forward: ``model(..., **cache_kw(cache))``."""
    return {CACHE: cache}

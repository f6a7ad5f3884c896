"""``keep=``: how many image tokens of each image enter the LLM (or, in the LLM, stay from layer K on).

An int is a count per image (1 ≤ keep ≤ the image's tokens); a float in (0, 1] is a fraction of each image's
tokens, ``max(1, round(fraction · N))`` (Python's round: half to even), so 1.0 keeps every token. Where the token
count of an image is known at ``apply`` (LLaVA-1.5: the tower's grid), the count is checked there; otherwise
(images of several sizes) at the forward pass, with the same message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KeepSpec:
    """A validated ``keep=``: ``count`` (int) or ``fraction`` (float in (0, 1]), exactly one set."""

    count: int | None = None
    fraction: float | None = None

    def tokens(self, num_tokens: int) -> int:
        """Tokens to keep of an image with ``num_tokens`` tokens; ``ValueError`` when an int keep exceeds them."""
        if self.fraction is not None:
            return max(1, min(num_tokens, round(self.fraction * num_tokens)))
        assert self.count is not None
        if self.count > num_tokens:
            raise ValueError(
                f"keep={self.count} is more than the image's {num_tokens} tokens; expected 1 … {num_tokens}"
            )
        return self.count

    def tokens_within(self, num_tokens: int) -> int:
        """Tokens to keep of a part of ``num_tokens`` tokens of what ``keep`` counts (a LLaVA-NeXT tile the unpadding
        cuts, ``tiles="unpadded"``): a count capped at them, ``min(keep, num_tokens)``; a fraction of them, as
        :meth:`tokens` takes it; none of an empty part."""
        if num_tokens == 0:
            return 0
        if self.count is not None:
            return min(self.count, num_tokens)
        return self.tokens(num_tokens)

    def keeps_all(self, num_tokens: int) -> bool:
        return self.tokens(num_tokens) == num_tokens


def parse_keep(keep: object, num_tokens: int | None = None) -> KeepSpec:
    """Validate ``keep`` (int ≥ 1 or float in (0, 1]) and, when the image's token count is known, check it fits."""
    if isinstance(keep, bool) or not isinstance(keep, int | float):
        raise TypeError(f"keep={keep!r} must be an int (tokens per image) or a float in (0, 1] (a fraction)")
    if isinstance(keep, int):
        if keep <= 0:
            raise ValueError(f"keep={keep} must be at least 1 (image tokens per image entering the LLM)")
        spec = KeepSpec(count=keep)
    else:
        if not math.isfinite(keep) or not 0.0 < keep <= 1.0:
            raise ValueError(f"keep={keep} as a fraction must be in (0, 1]")
        spec = KeepSpec(fraction=float(keep))
    if num_tokens is not None:
        spec.tokens(num_tokens)
    return spec

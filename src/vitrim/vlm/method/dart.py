"""DART (Wen et al., 2025, "Stop looking for important tokens ... duplication matters more"): at layer K, keep a few
pivot tokens and the image tokens LEAST duplicated with them; no attention weights, so SDPA stays on.

1. Pivots by key norm: with layer K−1's post-rotary keys (heads concatenated, the vectors its KV cache holds), the
   ``pivot_image_token`` image tokens and the ``pivot_text_token`` text tokens after the image with the largest
   L1 norm ‖k_j‖₁.
2. Duplication: on layer K's input passed through the model's final norm, x̂_j, each pivot p in turn takes the
   ``quota`` remaining image tokens with the LOWEST cosine similarity cos(x̂_p, x̂_j); a taken token leaves the pool.
3. The image keeps its image pivots and every taken token (text pivots only guide).

The authors (``get_retained_image_token`` in their ``modeling_llama_self.py``; defaults K = 2, 4 + 4 pivots,
``max_num_trunction`` = 128) give every pivot ``128 // 8 = 16`` tokens, so their "128" keeps 4 + 8·16 = 132. vitrim
keeps exactly ``keep``: the ``keep − image pivots`` tokens are split over the pivots as evenly as possible (the
earlier-visited pivots take one more; at the authors' own count, ``pivot_image_token + t · (all pivots)``, every
pivot takes t as theirs do), a ``keep`` below ``pivot_image_token`` keeps the top-``keep`` image pivots only, and ties
go to the earlier token. Text pivots: the sample's real non-image tokens after the image's last token.

Pivot order (``pivot_order``): the pool shrinks as pivots take tokens, so the order in which pivots are visited
changes what each takes. The authors visit ``list(set(image_indices + query_indices))``: a Python set of the
pivots' sequence positions, built from the image pivots then the text pivots, each list in ``topk`` order (largest
norm first). CPython iterates a set of ints in hash-table slot order - hash(i) = i, the slot i mod the table size
(8, then ×4 as it fills), a colliding int placed by probing in insertion order - which is deterministic for given
ints inserted in a given order. ``"authors"`` (default) visits the pivots in exactly that order: it builds the
same set of the same positions (each token's index among its sample's real tokens, what the authors' unpadded
batch-1 sequence numbers it) inserted in the same order (ties in the norms to the earlier token), and reads it
back. ``"sequence"``: vitrim's earlier order, image pivots then text pivots, each in sequence order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.ranking import top_k_stable

if TYPE_CHECKING:
    from vitrim.vlm.evidence.llm_layer import LayerEvidence

from vitrim.vlm.method.base import DropStage, Method, StageOptions, register_method
from vitrim.vlm.method.cost import VLM, MethodCost, key_macs

DART_LAYER = 2
DART_PIVOT_IMAGE_TOKEN = 4
DART_PIVOT_TEXT_TOKEN = 4
DART_REDUCTION_RATIO = 0.778  # the authors' scripts: 0.778 of LLaVA-1.5's 576 tokens dropped, 128 kept


PIVOT_ORDERS = ("authors", "sequence")


def authors_visit_order(image_positions: list[int], text_positions: list[int]) -> list[int]:
    """The order (indices into ``image_positions + text_positions``) in which the authors' loop visits the pivots:
    CPython's iteration order of ``set(image_positions + text_positions)``, each list given in ``topk`` order."""
    positions = image_positions + text_positions
    where = {position: number for number, position in enumerate(positions)}
    return [where[position] for position in set(positions)]


def dart_keep(
    image_key_norms: Tensor,
    text_key_norms: Tensor,
    image_states: Tensor,
    text_states: Tensor,
    keep: int,
    pivot_image_token: int = DART_PIVOT_IMAGE_TOKEN,
    pivot_text_token: int = DART_PIVOT_TEXT_TOKEN,
    image_positions: Tensor | None = None,
    text_positions: Tensor | None = None,
) -> Tensor:
    """(keep,) ascending positions among the image's n tokens that DART keeps.

    image_key_norms: (n,) and text_key_norms: (t,) the L1 norms of layer K−1's keys of the image's tokens and of the
    text tokens after it; image_states: (n, D), text_states: (t, D) layer K's input through the final norm.
    image_positions: (n,), text_positions: (t,) the tokens' positions in the sample's unpadded sequence: given, the
    pivots are visited in the authors' order (module docstring); None, in sequence order.
    """
    num_image = image_key_norms.shape[0]
    image_ranked = torch.sort(image_key_norms, descending=True, stable=True).indices  # (n,) largest norm first
    image_pivots = image_ranked[: min(pivot_image_token, num_image, keep)]  # (p,) in topk order
    if keep <= image_pivots.numel():
        return image_pivots.sort().values
    text_ranked = torch.sort(text_key_norms, descending=True, stable=True).indices
    text_pivots = text_ranked[: min(pivot_text_token, text_key_norms.shape[0])]  # (t',) in topk order
    if image_positions is None or text_positions is None:
        image_pivots, text_pivots = image_pivots.sort().values, text_pivots.sort().values
        order = list(range(image_pivots.numel() + text_pivots.numel()))
    else:
        order = authors_visit_order(image_positions[image_pivots].tolist(), text_positions[text_pivots].tolist())
    pivot_states = torch.cat([image_states[image_pivots], text_states[text_pivots]])[order]  # (P, D) visit order
    unit = torch.nn.functional.normalize
    similarity = unit(pivot_states, dim=-1) @ unit(image_states, dim=-1).T  # (P, n) cosine, all pairs at once
    remaining = keep - image_pivots.numel()
    base, extra = divmod(remaining, pivot_states.shape[0])
    pool = torch.ones(num_image, dtype=torch.bool, device=image_states.device)
    pool[image_pivots] = False
    taken = [image_pivots]
    left = int(pool.sum())
    for number in range(pivot_states.shape[0]):
        quota = min(base + (1 if number < extra else 0), left)
        candidates = pool.nonzero().flatten()  # (m,) ascending
        chosen = candidates[top_k_stable(-similarity[number, candidates], quota)]  # the least similar first
        pool[chosen] = False
        left -= quota
        taken.append(chosen)
    return torch.cat(taken).sort().values


@dataclass(frozen=True)
class DartDrop:
    """DART as a drop policy for :class:`vitrim.vlm.stages.in_llm.InLLMDrop`: one drop before ``layer``."""

    layer: int
    tokens: Callable[[int], int]
    pivot_image_token: int = DART_PIVOT_IMAGE_TOKEN
    pivot_text_token: int = DART_PIVOT_TEXT_TOKEN
    pivot_order: str = "authors"
    needs_previous_layer: bool = True
    reads_attention: bool = True  # it recomputes layer K−1's keys

    def drop_stages(self, num_layers: int) -> list[DropStage]:
        return [DropStage(self.layer, self.tokens)]

    def choose(self, evidence: LayerEvidence, counts: list[int]) -> list[Tensor]:
        key_norms = evidence.keys(previous=True).abs().sum(dim=-1)  # (B, S) L1 norm over heads·hd
        states = evidence.normed_hidden()  # (B, S, D)
        kept = []
        for image, count in zip(evidence.images(), counts, strict=True):
            if image.slots.numel() == 0:
                kept.append(image.tokens)
                continue
            row = image.sample
            after = evidence.slot_columns[row] > evidence.slot_columns[row, image.slots].max()
            text = (evidence.real[row] & (evidence.image_of[row] < 0) & after).nonzero().flatten()  # (t,)
            positions = evidence.real[row].long().cumsum(0) - 1  # (S,) each slot's index among the real tokens
            authors = self.pivot_order == "authors"
            chosen = dart_keep(
                key_norms[row, image.slots], key_norms[row, text], states[row, image.slots], states[row, text],
                count, self.pivot_image_token, self.pivot_text_token,
                positions[image.slots] if authors else None, positions[text] if authors else None,
            )  # fmt: skip
            kept.append(image.tokens[chosen])
        return kept


@register_method("dart", stage="in_llm")
class Dart(Method):
    """DART. Options: ``layer=`` (default 2, the authors' K), ``keep=`` (image tokens per image kept from layer K
    on; default 1 − 0.778 of them, the authors' reduction ratio: 128 of 576), ``pivot_image_token`` (default 4),
    ``pivot_text_token`` (default 4), ``pivot_order`` ("authors", the default: the authors' Python-set order;
    "sequence": image pivots then text pivots in sequence order)."""

    default_layer = DART_LAYER

    defaults: ClassVar[Mapping[str, Any]] = {
        "pivot_image_token": DART_PIVOT_IMAGE_TOKEN,
        "pivot_text_token": DART_PIVOT_TEXT_TOKEN,
        "pivot_order": "authors",
    }

    def check(self) -> None:
        for name, least in (("pivot_image_token", 1), ("pivot_text_token", 0)):
            value = self.options[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an int >= {least}")
        if self.options["pivot_order"] not in PIVOT_ORDERS:
            raise ValueError(f"pivot_order={self.options['pivot_order']!r} must be one of {', '.join(PIVOT_ORDERS)}")

    def default_keep(self) -> float:  # a fraction: parse_keep takes it
        return 1.0 - DART_REDUCTION_RATIO

    def drop_policy(self, options: StageOptions) -> DartDrop:
        assert options.keep is not None  # default_keep always gives one
        return DartDrop(
            layer=DART_LAYER if options.layer is None else options.layer,
            tokens=options.keep.tokens,
            pivot_image_token=self.options["pivot_image_token"],
            pivot_text_token=self.options["pivot_text_token"],
            pivot_order=self.options["pivot_order"],
        )

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """Every token runs layers 0 … K−1, ``keep`` image tokens the rest; its own: layer K−1's keys of every
        position again (their norms pick the pivots), and each pivot's cosine with every image token."""
        n, llm = model.image_tokens, model.llm
        pivots = self.options["pivot_image_token"] + self.options["pivot_text_token"]
        own = key_macs(llm, n + text_tokens) + n * pivots * llm.width
        return MethodCost(own=own, llm_cuts=((DART_LAYER, keep),))

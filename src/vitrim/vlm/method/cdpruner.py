"""``cdpruner`` (Zhang et al., NeurIPS 2025, "Beyond Attention or Similarity: Maximizing Conditional Diversity for
Token Pruning in MLLMs"): the ``keep`` image tokens a determinantal point process conditioned on the instruction
finds most diverse, by greedy MAP inference.

As the authors' code (Theia-4869/CDPruner, Apache-2.0; ``encode_images`` of their ``llava_arch.py``) selects, per
image of N tokens:

1. similarity S (N, N): the cosine similarity of the projected image tokens (the projector's output);
2. relevance r (N,): the image tokens' CLIP embeddings (the feature layer through CLIP's post-LayerNorm and visual
   projection) against the instruction's CLIP text embeddings (M rows, the text split in 77-token segments):
   r_i = mean_m(−cos(e_i, t_m)), then min-max normalised, r = (r − min r + 1e-6) / (max r − min r);
3. kernel L = diag(r) · S · diag(r); with ``theta`` given (the authors' commented-out option),
   r ← exp(α r) with α = θ / (2 (1 − θ)) first - θ = 0 gives r = 1, the DPP on similarity alone;
4. greedy MAP (Chen et al., 2018, as the authors write it): d_i² = L_ii; k times, take j = argmax d² (the first
   on ties), e = (L_j − Σ_t c_t[j] c_t) / √d_j², append e to the c's, d² −= e², d_j² = −∞.

Where vitrim differs from the authors, and why:
- **the min and max in step 2 are per image.** The authors take them over the whole batch (``relevance.min()``),
  so an image's tokens changed with the other images of its batch; at batch 1 the two are the same.
- **cos(x, x) = 1 exactly.** The first step's gains are r_i² · cos(x_i, x_i); the authors' matmul leaves the
  diagonal at 1 ± rounding, so among equal relevances (θ = 0: all of them) the first token was chosen by rounding
  noise, which differs between an image alone and in a batch; vitrim sets it to 1, and the tie goes to the lower
  index.
- **a kernel exhausted before ``keep`` tokens** (rank(L) < keep: more tokens kept than the projected width, or
  duplicated tokens): the authors' division by √d² would give NaN there; vitrim takes the remaining tokens by
  their kernel diagonal r_i² (ties to the lower index) once the largest d² is not above 1e-10 of L's largest
  diagonal entry.
- **the instruction** is the LLM's input embeddings of the text after the image, against the image tokens as
  the LLM receives them (the authors read CLIP's text tower, which transformers' LLaVA does not ship).
  :func:`instruction_relevance` takes the embeddings wherever they come from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from vitrim.vlm.method.base import ImageSelection, Method, VisionEvidence, register_method
from vitrim.vlm.method.cost import VLM, MethodCost
from vitrim.vlm.method.fastervlm import kept_as_selection

EXHAUSTED = 1e-10  # a marginal gain d² at or below this share of the kernel's largest diagonal entry is none


def instruction_relevance(image_embeds: Tensor, text_embeds: Tensor) -> Tensor:
    """(N,) the authors' relevance of one image's tokens to the instruction, min-max normalised over the image.

    image_embeds: (N, C) the image tokens in the text tower's space; text_embeds: (M, C) the instruction's rows.
    """
    image = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    relevance = (-(image @ text.T)).mean(dim=-1)  # (N,) the authors' sign: −cos, averaged over the text rows
    return (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())


def theta_weight(relevance: Tensor, theta: float | None) -> Tensor:
    """The relevance as the kernel reads it: unchanged (``theta`` None), else exp(θ / (2(1 − θ)) · r)."""
    if theta is None:
        return relevance
    return torch.exp(theta / (2 * (1 - theta)) * relevance)


def conditional_dpp_keep(tokens: Tensor, relevance: Tensor, keep: int) -> Tensor:
    """(keep,) long, in selection order: the greedy MAP of the DPP with kernel diag(r) · cos(tokens) · diag(r).

    tokens: (N, D) the projected image tokens; relevance: (N,) r (ones for the unconditioned DPP).
    """
    unit = tokens / tokens.norm(dim=-1, keepdim=True)
    similarity = (unit @ unit.T).fill_diagonal_(1.0)  # cos(x, x) = 1 exactly, not 1 ± rounding (see the docstring)
    kernel = relevance[:, None] * similarity * relevance[None, :]  # (N, N)
    num_tokens = tokens.shape[0]
    gains = torch.diagonal(kernel).clone()  # (N,) d², the marginal gain of each token
    floor = EXHAUSTED * float(gains.max())
    basis = gains.new_zeros(keep, num_tokens)  # row t: c_t of the t-th chosen token
    chosen: list[int] = []
    for step in range(keep):
        best = int(torch.argmax(gains))  # the first maximum, as torch.argmax documents
        if float(gains[best]) <= floor:  # the kernel is exhausted: the rest by r², ties to the lower index
            rest = torch.ones(num_tokens, dtype=torch.bool, device=tokens.device)
            rest[chosen] = False
            left = rest.nonzero().flatten()
            order = torch.sort(torch.diagonal(kernel)[left], descending=True, stable=True).indices
            chosen += left[order[: keep - step]].tolist()
            break
        row = (kernel[best] - basis[:step, best] @ basis[:step]) / torch.sqrt(gains[best])  # (N,)
        basis[step] = row
        gains = gains - row * row
        gains[best] = -math.inf
        chosen.append(best)
    return torch.tensor(chosen, dtype=torch.long, device=tokens.device)


@register_method("cdpruner", stage="pre_llm")
class CDPruner(Method):
    """Conditional DPP on the projected tokens × instruction relevance. Options: ``theta`` (None, the authors'
    default: the kernel reads the normalised relevance itself; a float in [0, 1): exp(θ / (2(1 − θ)) r), θ = 0 the
    DPP without the instruction).

    The instruction: the pre-LLM stage hands the LLM's input embeddings of the sample's real text tokens after the
    image (:attr:`VisionEvidence.instruction`) and the image's tokens as the LLM receives them, and the relevance
    is their cosine (the authors' formula) in the LLM's input space, on every family. The authors' own signal on
    LLaVA is CLIP's: the text through CLIP's tokenizer, text tower and projection against the feature layer through
    ``post_layernorm`` and ``visual_projection``; transformers' LLaVA ships no CLIP text tower, so vitrim does not
    use it (a difference from their numbers, docs/vlm.md).
    """

    defaults: ClassVar[Mapping[str, Any]] = {"theta": None}
    scores_projected = True

    def check(self) -> None:
        theta = self.options["theta"]
        valid = theta is None or (not isinstance(theta, bool) and isinstance(theta, int | float) and 0 <= theta < 1)
        if not valid:
            raise ValueError(f"theta={theta!r} must be None or a number in [0, 1)")

    def reads_instruction(self) -> bool:
        return self.options["theta"] != 0  # θ = 0: the DPP on the image tokens alone

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        if evidence.projected is None:
            raise ValueError("cdpruner needs the projected image tokens, which the model did not give")
        theta = self.options["theta"]
        selections = []
        for image, tokens in enumerate(evidence.projected):
            if self.reads_instruction():
                if evidence.instruction is None:
                    raise ValueError(
                        "cdpruner needs the instruction's embeddings, which the pre-LLM stage did not give"
                    )
                relevance = instruction_relevance(tokens, evidence.instruction[image])
            else:
                relevance = torch.ones(tokens.shape[0], dtype=tokens.dtype, device=tokens.device)
            weight = theta_weight(relevance, None if theta is None else float(theta))
            selections.append(kept_as_selection(conditional_dpp_keep(tokens, weight, keep)))
        return selections

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """The projected tokens' N × N cosines, the greedy MAP's k·(k−1)/2 row updates of N, and, when it reads the
        instruction (theta not 0), the relevance: the N image tokens against the text's rows."""
        n, e = model.image_tokens, model.llm.width
        own = n * n * e + n * keep * (keep - 1) // 2
        if self.reads_instruction():
            own += n * text_tokens * e
        return MethodCost.before_llm(keep, own)

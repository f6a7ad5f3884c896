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

The relevance, two signals (option ``relevance``):
- ``"clip"``, the authors' (their ``CLIPVisionTower.forward`` and ``encode_images``): the caller's question alone
  (``texts=`` of the forward or ``generate()``, as the authors' ``generate`` takes it: no chat template) through
  CLIP's tokenizer, cut into segments of the text tower's ``max_position_embeddings`` (77) tokens, the last padded
  with id 0 and mask 0, each through ``CLIPTextModelWithProjection`` (``text_embeds``: M rows); the image tokens
  are the tower's feature layer (the projector's input) through CLIP's ``post_layernorm`` and ``visual_projection``
  in float32. The CLIP is ``clip=`` (a hub name or folder, or a ``CLIPModel`` in hand); by default the tower
  LLaVA-1.5 and LLaVA-NeXT were built from, ``openai/clip-vit-large-patch14-336`` (transformers' LLaVA config does
  not record its tower's source, so vitrim names the one every released LLaVA-1.5 / NeXT checkpoint used).
- ``"llm"``: vitrim's, for families whose tower has no CLIP text tower (Qwen's ViT, SigLIP of Gemma 3 and
  PaliGemma): the LLM's input embeddings of the prompt's text after the image against the image tokens as the LLM
  receives them, the same formula. Inside ``generate()`` the text is the prompt's (the generated tokens never
  join it, also under ``use_cache=False``).
- default (``relevance=None``): ``"clip"`` when the caller passes the question (``texts=``; every family whose
  feature layer CLIP's projection reads: LLaVA-1.5), ``"llm"`` otherwise. The authors' numbers need ``texts=`` on
  LLaVA-1.5; the same tiny LLaVA fed each signal keeps other tokens (issue 53 measured 1.8 of 8 in common).

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
- **θ near 1**: exp(α r) is computed as exp(α (r − max r)), the same kernel times the constant exp(−2 α max r),
  which the greedy MAP's choices do not see (every d² scales alike, the exhaustion test is relative); the
  authors' form overflows once α · max r passes ~88 in float32 (θ ≥ 0.99).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

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
    """The relevance as the kernel reads it: unchanged (``theta`` None), else exp(θ / (2(1 − θ)) · r), computed as
    exp(α (r − max r)): a constant factor the greedy MAP does not see, and no overflow as θ → 1."""
    if theta is None:
        return relevance
    alpha = theta / (2 * (1 - theta))
    return torch.exp(alpha * (relevance - relevance.max()))


def clip_segments(input_ids: Tensor, attention_mask: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The authors' cut of one tokenized question (1, T) into rows of the text tower's ``length`` positions:
    (M, length) ids and mask, M = ⌈T / length⌉, the last row padded with id 0 and mask 0."""
    segments = (input_ids.shape[1] - 1) // length + 1
    padding = segments * length - input_ids.shape[1]
    pad = lambda rows: torch.cat([rows, rows.new_zeros(rows.shape[0], padding)], 1).reshape(-1, length)  # noqa: E731
    return pad(input_ids), pad(attention_mask)


class ClipRelevance:
    """CLIP's two towers as the authors read them: the question's ``text_embeds`` (M, C) and the image tokens'
    projected feature-layer states (N, C). ``model``: a transformers ``CLIPModel``; ``tokenizer``: its tokenizer."""

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        self.model: Any = model  # transformers' CLIPModel (its towers, projections and config are read by name)
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, clip: Any, tokenizer: Any) -> ClipRelevance:
        """``clip``: a hub name or folder, or a ``CLIPModel``; ``tokenizer``: None (``clip``'s own), a name, or one
        in hand. Weights load from safetensors only."""
        import transformers

        if isinstance(clip, str):
            try:
                model = transformers.CLIPModel.from_pretrained(clip, use_safetensors=True)
            except (OSError, ValueError) as error:
                raise ValueError(f"cdpruner clip={clip!r} could not be loaded as a CLIPModel: {error}") from None
        else:
            model = clip
        source = tokenizer if tokenizer is not None else getattr(model, "name_or_path", "")
        if isinstance(source, str):
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(source or clip)
            except (OSError, ValueError) as error:
                raise ValueError(
                    f"cdpruner clip_tokenizer={source!r}: no CLIP tokenizer could be loaded ({error}); pass "
                    "clip_tokenizer= (a name, a folder or a tokenizer)"
                ) from None
        return cls(model.eval(), tokenizer)

    def text_embeds(self, question: str) -> Tensor:
        """(M, C) float32: the question through the tokenizer, cut in segments, and the text tower's projection."""
        tokens = self.tokenizer(text=question, return_tensors="pt")
        length = int(self.model.config.text_config.max_position_embeddings)
        ids, mask = clip_segments(tokens["input_ids"], tokens["attention_mask"], length)
        device = self.model.text_projection.weight.device
        pooled = self.model.text_model(input_ids=ids.to(device), attention_mask=mask.to(device)).pooler_output
        return self.model.text_projection(pooled).float()

    def image_embeds(self, features: Tensor) -> Tensor:
        """(N, C) float32: the feature layer's states (N, D) through CLIP's ``post_layernorm``, then in float32
        through its ``visual_projection`` (the authors' order)."""
        norm = self.model.vision_model.post_layernorm
        projection = self.model.visual_projection
        if features.shape[-1] != projection.in_features:
            raise ValueError(
                f"cdpruner relevance='clip': the tower's features are {features.shape[-1]} wide, the CLIP's vision "
                f"projection reads {projection.in_features} (pass the clip= the tower came from, or relevance='llm')"
            )
        normed = norm(features.to(norm.weight.dtype))
        return nn.functional.linear(normed.float(), projection.weight.float())


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


RELEVANCES = ("clip", "llm")
LLAVA_CLIP = "openai/clip-vit-large-patch14-336"  # the tower of every released LLaVA-1.5 and LLaVA-NeXT checkpoint


@register_method("cdpruner", stage="pre_llm")
class CDPruner(Method):
    """Conditional DPP on the projected tokens × instruction relevance (module doc). Options:

    - ``theta``: None (the authors' default: the kernel reads the normalised relevance itself), or a number in
      [0, 1): exp(θ / (2(1 − θ)) r), θ = 0 the DPP without the instruction;
    - ``relevance``: ``"clip"`` (the authors' signal: the caller's question, ``texts=`` of the forward or
      ``generate()``, through CLIP's text tower against the feature layer through CLIP's projection), ``"llm"``
      (the LLM's input embeddings of the prompt's text after the image against the image tokens as the LLM
      receives them: every family, the one a family without a CLIP text tower has - Qwen, Gemma 3, PaliGemma),
      or None (default): ``"clip"`` when the caller passes ``texts=``, ``"llm"`` otherwise;
    - ``clip``: the CLIP of ``"clip"``, a hub name or folder or a ``CLIPModel`` in hand (default: LLaVA-1.5's
      tower, ``openai/clip-vit-large-patch14-336``); ``clip_tokenizer``: None (``clip``'s own), a name, or one in
      hand.
    """

    defaults: ClassVar[Mapping[str, Any]] = {
        "theta": None, "relevance": None, "clip": LLAVA_CLIP, "clip_tokenizer": None,
    }  # fmt: skip
    scores_projected = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.towers: ClipRelevance | None = None  # loaded at the first question

    def check(self) -> None:
        theta, relevance, clip = self.options["theta"], self.options["relevance"], self.options["clip"]
        valid = theta is None or (not isinstance(theta, bool) and isinstance(theta, int | float) and 0 <= theta < 1)
        if not valid:
            raise ValueError(f"theta={theta!r} must be None or a number in [0, 1)")
        if relevance is not None and relevance not in RELEVANCES:
            raise ValueError(f"relevance={relevance!r} must be None, 'clip' or 'llm'")
        if not isinstance(clip, str) and not isinstance(clip, nn.Module):
            raise ValueError(f"clip={clip!r} must be a hub name, a folder or a transformers CLIPModel")

    def reads_instruction(self) -> bool:
        return self.options["theta"] != 0  # θ = 0: the DPP on the image tokens alone

    def relevance_of(self, evidence: VisionEvidence, image: int, tokens: Tensor) -> Tensor:
        """(N,) the normalised relevance of image ``image``'s tokens (``tokens``: (N, E) as the LLM receives them)."""
        signal = self.options["relevance"] or ("clip" if evidence.question is not None else "llm")
        if signal == "llm":
            if evidence.instruction is None:
                raise ValueError("cdpruner needs the instruction's embeddings, which the pre-LLM stage did not give")
            return instruction_relevance(tokens, evidence.instruction[image])
        if evidence.question is None:
            raise ValueError(
                "cdpruner relevance='clip' reads the question through CLIP's text tower: pass texts='the question' "
                "to the forward or generate() (as the authors do), or relevance='llm'"
            )
        if self.towers is None:
            self.towers = ClipRelevance.load(self.options["clip"], self.options["clip_tokenizer"])
        features = evidence.features[image]  # (N, D) the feature layer, the projector's input
        if features.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"cdpruner relevance='clip' reads the tower's state of each image token; this family hands the LLM "
                f"{tokens.shape[0]} tokens for {features.shape[0]} tower states (use relevance='llm')"
            )
        with torch.no_grad():
            text = self.towers.text_embeds(evidence.question)
            image_embeds = self.towers.image_embeds(features)
        return instruction_relevance(image_embeds, text.to(image_embeds.device))

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        if evidence.projected is None:
            raise ValueError("cdpruner needs the projected image tokens, which the model did not give")
        theta = self.options["theta"]
        selections = []
        for image, tokens in enumerate(evidence.projected):
            if self.reads_instruction():
                relevance = self.relevance_of(evidence, image, tokens).to(tokens.dtype)
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

"""AttnLRP (Achtibat et al., ICML 2024) for vitrim ViTs, as gradient × input with modified gradients.

Relevance of a tensor x is R(x) = x ⊙ g(x), where g is the gradient of the explained logit through the network with
each operation's backward replaced by its LRP rule (the "efficient" form of the authors' ``lxt`` 2.1):

* linear layers, convolutions, additions, gathers: the ε-rule with ε → 0, which in this form is the plain gradient;
* element-wise activations (GELU, QuickGELU, SiLU): the identity rule, g_in = g_out · f(x) / x, so R_in = R_out;
* LayerNorm (also qk-norm and SwiGLU's norm): the identity rule on the normalisation: the standard deviation is
  treated as a constant (no gradient through it), the centring stays linear;
* the attention's two matrix products q kᵀ and A v, and SwiGLU's gate · value: the uniform rule, half the relevance
  to each factor: the gradients of q and k are divided by 4 (both products lie on their path), of v by 2;
* softmax: the AttnLRP rule R_in = x ⊙ (R_out − s Σ R_out), which in this form is the plain gradient of softmax.

``attention="cp"`` is CP-LRP (Ali et al., 2022) inside the attention instead, what ``lxt`` 2.1 patches
torchvision's ViT with: no relevance through the softmax (q and k are constants), all of it through v.

Conservation: every rule above is conservative except where a constant takes its share: the biases of the linear
layers and LayerNorms, and, for the softmax rule, its Taylor expansion's bias term (the softmax at logits 0). The
relevance of the input tokens therefore equals the logit minus what those absorb; ``docs/relevance.md`` gives the
measured fractions.

Through reducers: a merge (ToMe) is a weighted average with constant weights, so its backward is the plain
gradient and the merged token's relevance goes to its sources by share, s_i x_i g / Σ s, conserved; a drop (top-k,
DynamicViT) is a gather, so a dropped token keeps the relevance that flowed into it while it was present, and
nothing is lost; the ranking and matching are discrete (no gradient). EViT's fused token Σ a_i x_i weighs tokens by
attention: its weights are treated as constants (the gate rule), so the fused token's relevance goes to the tokens
it fused, conserved (a reducer declares this with ``constant_ranking_scores`` and detaches them itself while
:func:`lrp_rules` sets its ``attributing`` flag). Reducers that merge by the block's own attention ahead of it
(MCTF) are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from vitrim.attention import MultiHeadAttention
from vitrim.models.layers import GluMlp, QuickGELU, SwiGLU
from vitrim.models.vit import VisionTransformer
from vitrim.viz.relevance_trace import Target, check_images, eval_model, leaf_tokens, resolve_target

AttentionRule = Literal["attnlrp", "cp"]
ATTENTION_RULES = ("attnlrp", "cp")


class _IdentityRule(torch.autograd.Function):
    """y = f(x) forward; backward g_in = g_out · y / x (so x · g_in = y · g_out: relevance passes unchanged)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Any) -> Tensor:
        y = fn(x)
        ctx.save_for_backward(torch.where(x == 0, torch.zeros_like(y), y / x))
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (ratio,) = ctx.saved_tensors
        return grad * ratio, None


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor`` (the uniform rule's share)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


def identity_rule(fn: Any, x: Tensor) -> Tensor:
    """fn(x) whose relevance passes through unchanged (element-wise activations)."""
    return _IdentityRule.apply(x, fn)


def share_gradient(x: Tensor, factor: float) -> Tensor:
    """x, with its gradient multiplied by ``factor`` on the way back."""
    return _ScaleGradient.apply(x, factor)


def layer_norm_rule(module: nn.LayerNorm, x: Tensor) -> Tensor:
    """LayerNorm with its standard deviation held constant (the identity rule on the normalisation)."""
    if len(module.normalized_shape) != 1:
        raise ValueError(f"AttnLRP supports LayerNorm over the last dim only, got {module.normalized_shape}")
    centred = x - x.mean(dim=-1, keepdim=True)
    std = (centred.pow(2).mean(dim=-1, keepdim=True) + module.eps).sqrt().detach()
    y = centred / std
    if module.weight is not None:
        y = y * module.weight
    return y if module.bias is None else y + module.bias


def _glu_rule(module: GluMlp, x: Tensor) -> Tensor:
    gate, value = module.fc1(x).chunk(2, dim=-1)
    return module.fc2(share_gradient(identity_rule(module.act, gate) * value, 0.5))


def _swiglu_rule(module: SwiGLU, x: Tensor) -> Tensor:
    product = identity_rule(module.act, module.fc1_g(x)) * module.fc1_x(x)
    return module.fc2(module.norm(share_gradient(product, 0.5)))


def _qkv_rule(module: MultiHeadAttention, rule: str, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, ...]:
    q, k, v = type(module).project_qkv(module, x, context)
    if rule == "cp":
        return q.detach(), k.detach(), v
    return share_gradient(q, 0.25), share_gradient(k, 0.25), share_gradient(v, 0.5)


@contextmanager
def lrp_rules(model: VisionTransformer, attention: AttentionRule = "attnlrp") -> Iterator[VisionTransformer]:
    """Within the block, ``model``'s backward pass computes AttnLRP's modified gradients (module doc).

    Only this model's own modules are changed (an instance attribute each), and all of them are restored on exit,
    also after an error. Gradient × input of any tensor of the forward pass is then its relevance.
    """
    if attention not in ATTENTION_RULES:
        raise ValueError(f"attention must be one of {ATTENTION_RULES}, got {attention!r}")
    patched: list[tuple[Any, str]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)
        patched.append((obj, name))

    try:
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                patch(module, "forward", partial(layer_norm_rule, module))
            elif isinstance(module, (nn.GELU, nn.SiLU, QuickGELU)):
                patch(module, "forward", partial(identity_rule, type(module).forward.__get__(module)))
            elif isinstance(module, GluMlp):
                patch(module, "forward", partial(_glu_rule, module))
            elif isinstance(module, SwiGLU):
                patch(module, "forward", partial(_swiglu_rule, module))
            elif isinstance(module, MultiHeadAttention):
                patch(module, "project_qkv", partial(_qkv_rule, module, attention))
        for block in model.blocks:
            reducer = getattr(block, "reducer", None)
            if reducer is not None and reducer.looks_ahead:
                raise ValueError(
                    f"AttnLRP cannot follow {type(reducer).__name__}: it merges by attention computed ahead of the "
                    "block, outside the rules; use method='chefer'"
                )
            if reducer is not None and reducer.constant_ranking_scores:
                patch(reducer, "attributing", True)  # it detaches its ranking scores itself (module doc)
        yield model
    finally:
        for obj, name in reversed(patched):
            delattr(obj, name)


def attnlrp_relevance(
    model: nn.Module, images: Tensor, target: Target = None, *, attention: AttentionRule = "attnlrp"
) -> tuple[Tensor, Tensor, Tensor]:
    """AttnLRP relevance of every original token for class ``target`` (module doc).

    Args:
        model: a vitrim VisionTransformer, dense or with reducers (run in eval mode; its mode is restored).
        images: (B, C, H, W).
        target: None (the predicted class), a class index, or one per image.
        attention: "attnlrp" (the softmax and uniform rules) or "cp" (CP-LRP: relevance through v only).

    Returns:
        (relevance (B, num_prefix + P): x ⊙ g summed over the channels of each token entering the first block,
        prefix first, then the grid in row-major order; logits (B, classes); target (B,)).
    """
    vit, _, was_training = eval_model(model)
    images = check_images(images)
    try:
        with lrp_rules(vit, attention), torch.enable_grad():
            state, tokens0 = leaf_tokens(vit, images)
            state, _ = vit.forward_blocks(state)
            logits = vit.forward_head(vit.norm(state.tokens), patch_weights=state.patch_weights())
            index = resolve_target(logits, target)
            (gradient,) = torch.autograd.grad(logits.gather(1, index[:, None]).sum(), tokens0)
    finally:
        vit.train(was_training)
    return (tokens0 * gradient).sum(dim=-1).detach(), logits.detach(), index


__all__ = ["ATTENTION_RULES", "attnlrp_relevance", "identity_rule", "layer_norm_rule", "lrp_rules", "share_gradient"]

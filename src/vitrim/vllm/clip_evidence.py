"""What vLLM's CLIP tower tells a pre-LLM method: vitrim.vlm's ``VisionEvidence`` from vLLM's modules (owned here).

The conventions are vitrim.vlm's LLaVA family's (``vitrim.vlm.families.llava``): the features are the tower's
``vision_feature_layer`` without [CLS]; the scoring layer is the layer that produces it; its [CLS] attention row and
keys come from the layer's own projections applied to its input (after ``layer_norm1``), by vitrim.vlm's own
``cls_attention_and_keys``. vLLM's CLIP attention fuses q, k and v into one ``qkv_proj`` and returns no weights, so
:class:`FusedQKView` hands that function the q and k parts under the names it reads.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from vitrim.vlm.families.llava import cls_attention_and_keys


class FusedQKView:
    """A vLLM ``CLIPAttention`` seen as transformers' (``q_proj``, ``k_proj``, ``num_heads``, ``head_dim``,
    ``scale``): the q and k thirds of its fused ``qkv_proj``, for the heads of this tensor-parallel rank."""

    def __init__(self, attention: Any) -> None:
        self.attention = attention
        self.num_heads = int(attention.num_heads_per_partition)
        self.head_dim = int(attention.head_dim)
        self.scale = float(attention.scale)

    def q_proj(self, hidden: Tensor) -> Tensor:
        return self.attention.qkv_proj(hidden)[0].chunk(3, dim=-1)[0]

    def k_proj(self, hidden: Tensor) -> Tensor:
        return self.attention.qkv_proj(hidden)[0].chunk(3, dim=-1)[1]


def scoring_layer_index(feature_layer: int, num_layers: int) -> int:
    """The index of the tower layer whose output is hidden state ``feature_layer`` (−2: layer ``num_layers`` − 2).

    The same index in vLLM's tower, which builds only the layers up to the feature layer. ``ValueError`` for the
    embeddings (layer 0), which no attention produces."""
    index = feature_layer + num_layers if feature_layer < 0 else feature_layer - 1
    if not 0 <= index < num_layers:
        raise ValueError(
            f"vitrim: the [CLS]-attention methods read the layer that produces vision_feature_layer; "
            f"vision_feature_layer={feature_layer} of a {num_layers}-layer tower has none"
        )
    return index


class ScoringCapture:
    """Hooks on the scoring layer (the tower layer producing the feature layer) for one tower run: its attention's
    input (I, 1 + N, D), and with ``with_cls_row`` the layer's output [CLS] row (I, D), the feature layer's [CLS]
    that VisionZip hands the LLM (vitrim.vlm.families.llava reads the same row)."""

    def __init__(self, layer: nn.Module, with_cls_row: bool = False) -> None:
        attention: Any = layer.self_attn
        self.view = FusedQKView(attention)
        self.hidden: Tensor | None = None
        self.cls_row: Tensor | None = None
        self.handles = [attention.register_forward_pre_hook(self.keep_input, with_kwargs=True)]
        if with_cls_row:
            self.handles.append(layer.register_forward_hook(self.keep_cls_row))

    def keep_input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def keep_cls_row(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # (I, 1 + N, D), [CLS] first
        self.cls_row = hidden[:, 0]

    def take(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The [CLS] attention row (I, H, N), the keys (I, H, N, hd) and the [CLS] row (I, D) or None of the last
        run; forgets them."""
        hidden, self.hidden = self.hidden, None
        cls_row, self.cls_row = self.cls_row, None
        if hidden is None:
            raise RuntimeError("vitrim: the tower ran without its scoring layer")
        return (*cls_attention_and_keys(self.view, hidden), cls_row)

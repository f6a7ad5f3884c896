"""vitrim's token reducers inside a transformers VLM's own vision tower (CLIP: LLaVA-1.5; SigLIP: Gemma 3, PaliGemma).

``apply`` installs them on LLaVA-1.5 (``LlavaForConditionalGeneration``), Gemma 3 (``Gemma3ForConditionalGeneration``)
and PaliGemma (``PaliGemmaForConditionalGeneration``, the tower stage only: ``vitrim.vlm.families.paligemma``); other
families are refused at ``apply`` (their traits do not declare the tower stage).

    vitrim.vlm.apply(model, "tome", r=8)            # ToMe in every tower block up to the feature layer
    vitrim.vlm.apply(model, "evit", keep=64)        # EViT at its quarter blocks, 64 patches left at the feature layer

``keep=`` counts the tower's patches per image (P = (image_size / patch_size)²): on LLaVA-1.5 they are its image
tokens; on Gemma 3 they are the 64×64 patches its projector pools to 16×16 image tokens, so ``keep`` runs up to
4096 there, not 256. A SigLIP tower has no [CLS]: EViT, top-k and PPT rank by the attention each token receives
instead (:mod:`vitrim.vlm.method.tower_ranking`); DiffRate is refused there.

The seam, and why it is this one. A reducer of :mod:`vitrim.reduce` acts between a block's attention and its MLP
(``x = x + attn(LN(x))``; reduce; ``x = x + MLP(LN(x))``), on the keys, queries or values of that attention, and
later blocks add log(size) to their attention logits (proportional attention). transformers' encoder layer keeps
the residual in a local variable, so no hook on its submodules can shorten the tokens between the two halves; and
its ``hidden_states`` output is captured by hooks on the layer instances themselves, so the layers must stay in
place. So each encoder layer of THIS instance gets an instance attribute ``forward`` (the class is untouched) that
calls the layer's own ``layer_norm1``, ``self_attn``, ``layer_norm2`` and ``mlp`` in transformers' order, with the
reducer's hook between them; the attention's q, k and v are read from forward hooks on the layer's own projections
(nothing is computed twice) and the proportional-attention bias enters through the attention's own
``attention_mask`` argument, so every attention backend stays as the user chose it. When a reducer removes nothing
the calls, operands and their order are transformers' own: the tower is bit for bit unmodified. The other option,
running the tower through vitrim's own equivalent model (:func:`vitrim.from_transformers`), would copy the tower's
weights and re-create its output object; it is the independent path the tests compare this one with. The
attention call is the stage's one tower-specific step (:class:`BlockAttention`): vLLM's CLIP, whose attention fuses
q, k and v and takes no mask, runs the same stage through its own (``vitrim.vllm.tower_stage``).

What the tower then hands on. The feature layer's tokens (LLaVA: ``vision_feature_layer``, −2; SigLIP in Gemma 3 and
PaliGemma: the last) are fewer: ``positions`` says which patch each stands in for (a merged token: the patch it was
merged into), ``patch_to_token`` which patches each stands for (:mod:`vitrim.reduce.state`). Per image, the
selection is the tokens' positions, sorted, with the patches each stands for as its group. A forward pre-hook on the
projector then either (``to_grid=True``) puts every token back on the patches it stands for
(:func:`vitrim.reduce.unmerge.tokens_on_grid`: the tower is cheaper, the LLM sees every image token; the only way
for Gemma 3, whose projector average-pools the 64×64 grid, and for PaliGemma, and their default), or
(``to_grid=False``, LLaVA's default) writes each token into its position's slot, and the pre-LLM stage, which
:mod:`vitrim.vlm.stacking` installs after it, drops the other slots, so the LLM sees only the tower's tokens.
Blocks after the feature layer run unreduced: their output is not used by the VLM. A dropped patch (top-k, the
random baseline) is zero on the grid, so on Gemma 3 the average pool of its cell counts it as zero; merging
reducers (ToMe, EViT's fused token, PiToMe) leave no patch empty.

What the selection means. ``last_selection`` lists, per image, the patches of the tower's grid (raster order of its
p×p patches) whose tokens reach the feature layer, and with ``groups=True`` the patches each of those tokens stands
for. On LLaVA-1.5 and PaliGemma a patch is an image token, so this is the usual selection. On Gemma 3 every pooled
image token still enters the LLM (``to_grid=True``): the indices are then patches of the 64×64 grid, not of the
16×16 pooled tokens, and pooled token (r, c) is the mean of its k×k cell of the refilled grid, each patch carrying
the token of its group (``vitrim.vlm.families.gemma3`` for the pooling).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from vitrim.attention import AttentionResult
from vitrim.reduce import Reducer, TokenState
from vitrim.reduce.state import patch_positions
from vitrim.reduce.unmerge import tokens_on_grid
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import ImageSelection, Method, StageOptions
from vitrim.vlm.method.tower_reducers import TowerLayout, TowerMethod, build_reducers
from vitrim.vlm.stages.contract import FamilyAdapter
from vitrim.vlm.stages.inputs import refuse_meta_inputs


@dataclass
class TowerPlan:
    """The tower's layout and where it hands tokens on.

    layers: the encoder's layers (CLIPEncoderLayer / SiglipEncoderLayer); num_prefix: 1 with [CLS], else 0;
    patches: P, the patches of one image; feature_index: the layer whose output the VLM uses (0-based).
    """

    layers: nn.ModuleList
    num_prefix: int
    patches: int
    feature_index: int


PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # transformers' attention projections, read by TransformersAttention


def split_heads(t: Tensor, heads: int) -> Tensor:
    """(B, N, D) -> (B, H, N, hd), as the towers' attention splits it."""
    B, N, D = t.shape
    return t.view(B, N, heads, D // heads).transpose(1, 2)


class BlockAttention:
    """How a tower block's attention runs inside :class:`TowerReduction`, and where the reducers read its q, k, v.

    The one place a tower implementation differs for the stage: transformers' (:class:`TransformersAttention`,
    the default) or vLLM's CLIP (``vitrim.vllm.tower_stage``). Layer norms, MLP and residuals are the layer's own
    modules under the same names in both (``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``)."""

    def watch(self, layer: Any) -> list[Any]:
        """Set up the reading of a reducing layer's q, k, v; the handles to remove with the reduction."""
        return []

    def attend(
        self, layer: Any, hidden: Tensor, mask: Tensor | None, kwargs: dict[str, Any], *, qkv: bool
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """The layer's attention on ``hidden`` (B, N, D) (after ``layer_norm1``) with the additive ``mask``
        (B or 1, 1, 1 or N, N; None: none): its output (B, N, D) after the output projection, and with ``qkv``
        its q, k, v, each (B, H, N, hd) over every head."""
        raise NotImplementedError


class TransformersAttention(BlockAttention):
    """transformers' CLIP / SigLIP attention, called as the model would with the mask as its ``attention_mask``
    (every backend stays as the user chose it); q, k, v read from forward hooks on its own projections."""

    def __init__(self) -> None:
        self._captured: dict[str, Tensor] = {}

    def watch(self, layer: Any) -> list[Any]:
        return [getattr(layer.self_attn, name).register_forward_hook(self._capture(name)) for name in PROJECTIONS]

    def _capture(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            self._captured[name] = output

        return hook

    def attend(
        self, layer: Any, hidden: Tensor, mask: Tensor | None, kwargs: dict[str, Any], *, qkv: bool
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        self._captured.clear()
        out, _ = layer.self_attn(hidden_states=hidden, attention_mask=mask, **kwargs)
        if not qkv:
            return out, None
        heads = layer.self_attn.num_heads
        q, k, v = (split_heads(self._captured[name], heads) for name in PROJECTIONS)
        return out, (q, k, v)


class TowerReduction:
    """Reducers on the encoder layers of one tower instance (module doc); an
    :class:`~vitrim.vlm.method.base.Installation`.

    ``reducers``: layer index -> reducer (layers up to ``plan.feature_index``). After each forward,
    :meth:`feature_state` is the token state at the feature layer and :meth:`selection` its per-image selection.
    """

    def __init__(
        self,
        plan: TowerPlan,
        reducers: Mapping[int, Reducer],
        to_grid: bool = True,
        attention: BlockAttention | None = None,
    ) -> None:
        self.plan = plan
        self.to_grid = to_grid  # the feature layer's tokens go back on the patch grid (else each on its own slot)
        self.reducers = dict(reducers)
        self.attention = TransformersAttention() if attention is None else attention
        self._state: TokenState | None = None
        self._feature: TokenState | None = None
        self._tower_ran = False  # the tower ran since the LLM's last prefill (see on_llm)
        self._no_images = False  # the LLM's last prefill came without a tower run: it had no image
        self._handles: list[Any] = []
        self._overridden: list[nn.Module] = []
        for index, layer in enumerate(plan.layers):
            if index > plan.feature_index:
                break
            if index in self.reducers:
                self._handles += self.attention.watch(layer)
            layer.forward = self._layer_forward(index, layer)  # instance attribute: the class stays as it is
            self._overridden.append(layer)

    def _layer_forward(self, index: int, layer: Any) -> Callable[..., Tensor]:
        def forward(hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
            return self._run_layer(index, layer, hidden_states, attention_mask, kwargs)

        return forward

    def _run_layer(
        self, index: int, layer: Any, x: Tensor, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> Tensor:
        """transformers' encoder layer, in its order, with vitrim's Block hooks between the halves."""
        if index == 0 or self._state is None:
            self._tower_ran, self._no_images = True, False
            B = x.shape[0]
            self._feature = None
            state = TokenState(
                x, self.plan.num_prefix, patch_positions(B, self.plan.patches, x.device), grid_patches=self.plan.patches
            )
        else:
            state = self._state.replace(tokens=x)
        reducer = self.reducers.get(index)
        if reducer is not None:
            state = reducer.before_attention(state)
            x = state.tokens
        state = state.record_block()
        bias = state.attention_bias()  # (B, 1, 1, N) log-sizes after a merge, else None
        mask = bias if attention_mask is None else attention_mask if bias is None else attention_mask + bias
        attn_out, qkv = self.attention.attend(layer, layer.layer_norm1(x), mask, kwargs, qkv=reducer is not None)
        x = x + attn_out
        if reducer is not None:
            assert qkv is not None
            q, k, v = qkv
            scale = float(layer.self_attn.scale)
            result = AttentionResult(out=attn_out, weights=None, q=q, k=k, scale=scale, mask=mask, v=v)
            state = reducer.after_attention(state.replace(tokens=x), result)
            x = state.tokens
        x = x + layer.mlp(layer.layer_norm2(x))
        self._state = state.replace(tokens=x)
        if index == self.plan.feature_index:
            self._feature = self._state
        return x

    def on_llm(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook on the LLM: a prefill (an empty cache) that no tower run came before had no image, so
        :meth:`selection` is then empty instead of describing an earlier forward; decode steps change nothing."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length()) if cache is not None else 0
        if past == 0 and not self._tower_ran:
            self._feature, self._no_images = None, True
        self._tower_ran = False

    def feature_state(self) -> TokenState | None:
        """The token state the feature layer produced in the last forward (None before any)."""
        return self._feature

    def selection(self) -> list[ImageSelection] | None:
        """Per image of the last forward: kept = the feature-layer tokens' positions, sorted; one group per token.
        [] after a prefill without images; None before any forward."""
        if self._no_images:
            return []
        state = self._feature
        if state is None or state.positions is None:
            return None
        p2t = state.patch_to_token[-1] if state.patch_to_token and state.trace else None
        selections = []
        for b in range(state.positions.shape[0]):
            positions = state.positions[b]
            order = positions.argsort()
            kept = positions[order]
            if p2t is None:
                selections.append(ImageSelection.unmerged(kept))
            else:
                groups = tuple((p2t[b] == int(j)).nonzero().flatten() for j in order)
                selections.append(ImageSelection(kept=kept, groups=groups))
        return selections

    def tokens_to_slots(self, tokens: Tensor, *, to_grid: bool) -> Tensor:
        """The feature layer's patch tokens (I, n, D) (prefix removed) on the P image-token slots: (I, P, D).

        to_grid: each token on every patch it stands for (dropped patches zero); else on its position's slot only
        (the other slots zero, for the plumbing that drops them)."""
        state = self._feature
        if state is None or state.positions is None:
            raise RuntimeError("the tower's reduced tokens reached the projector without a recorded feature layer")
        if tokens.shape[1] == self.plan.patches and not state.patch_to_token:
            return tokens  # nothing was reduced
        if to_grid:
            return tokens_on_grid(tokens, state.patch_to_token, 0)
        slots = tokens.new_zeros(tokens.shape[0], self.plan.patches, tokens.shape[2])
        return slots.scatter(1, state.positions[..., None].expand(-1, -1, tokens.shape[2]), tokens)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for layer in self._overridden:
            del layer.forward  # the class's forward again
        self._handles, self._overridden = [], []
        self._state = self._feature = None


def find_tower(model: nn.Module, feature_layer: int) -> TowerPlan:
    """The CLIP / SigLIP vision tower of a VLM (``model.model.vision_tower``) and its feature layer."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "vision_tower", None)
    vision = getattr(tower, "vision_model", tower)
    encoder = getattr(vision, "encoder", None)
    layers = getattr(encoder, "layers", None)
    kinds = {type(layer).__name__ for layer in layers} if isinstance(layers, nn.ModuleList) else set()
    if not kinds or not kinds <= {"CLIPEncoderLayer", "SiglipEncoderLayer"}:
        found = f"its tower's layers are {sorted(kinds)}" if kinds else "it has no model.vision_tower encoder"
        raise TypeError(
            "vitrim reducers run inside CLIP and SigLIP vision towers (LLaVA-1.5, Gemma 3, PaliGemma); "
            f"{type(model).__name__} has none: "
            f"{found}"
        )
    assert isinstance(layers, nn.ModuleList)
    config = tower.config  # type: ignore[union-attr]
    has_cls = "CLIPEncoderLayer" in kinds
    index = feature_block(feature_layer, len(layers))
    return TowerPlan(layers, int(has_cls), (config.image_size // config.patch_size) ** 2, index)


def feature_block(feature_layer: int, depth: int) -> int:
    """The 0-based index of the block whose output is hidden state ``feature_layer`` of a ``depth``-block tower
    (−2 of 24: 22); ``ValueError`` outside the tower or for the embeddings (hidden state 0)."""
    if not -depth <= feature_layer < depth + 1:
        raise ValueError(f"vision feature layer {feature_layer} is outside the tower's {depth} layers")
    # hidden_states[i]: the embeddings for i = 0, the output of layer i - 1 after; negative i counts from the end
    index = (feature_layer % (depth + 1)) - 1
    if index < 0:
        raise ValueError("the vision feature layer is the embeddings: no tower block runs before it")
    return index


def tower_plan(family: FamilyAdapter, method_name: str) -> TowerPlan:
    """The tower of a family that takes the tower stage (its traits); ``TypeError`` naming the model's class
    otherwise (tiled LLaVA-NeXT and windowed Qwen towers are not handled here)."""
    model = family.model
    if "tower" not in family.traits.stages:
        why = f": {family.traits.tower_refused}" if family.traits.tower_refused else ""
        raise TypeError(f"tower method {method_name!r}: {type(model).__name__} is not handled in the tower{why}")
    feature_layer = getattr(model.config, "vision_feature_layer", -1)  # Gemma 3: the last layer, post-LayerNorm
    if not isinstance(feature_layer, int):
        raise ValueError(f"vision_feature_layer={feature_layer!r}: tower reducers need one feature layer (an int)")
    return find_tower(model, feature_layer)


def keep_counts_per_image(family: FamilyAdapter, method: Method) -> int:
    """What ``keep=`` counts for a tower method: the tower's patches per image, P (LLaVA-1.5 and PaliGemma: their
    image tokens too; Gemma 3: the p×p patches its projector pools to fewer image tokens, all entering the LLM)."""
    return tower_plan(family, method.name).patches


def to_grid_of(family: FamilyAdapter, method: Method) -> bool:
    """Whether the tower method puts its tokens back on the patch grid: its ``to_grid``, else the family's default
    (back on the grid where the family needs it); ``ValueError`` / ``TypeError`` for a value the family refuses."""
    grid_only = family.traits.tower_grid_only
    to_grid = method.options.get("to_grid")
    if to_grid is not None and not isinstance(to_grid, bool):
        raise TypeError(f"to_grid={to_grid!r} must be True, False or None (the family's default)")
    if to_grid is None:
        return grid_only is not None
    if grid_only is not None and not to_grid:
        raise ValueError(
            f"to_grid=False is not possible on {type(family.model).__name__}: {grid_only}, so the tower's tokens "
            "must go back on the patch grid (to_grid=True, the default there)"
        )
    return to_grid


def install(family: FamilyAdapter, method: Method, options: StageOptions) -> TowerReduction:
    """Put ``method``'s reducer on the family's tower and its tokens on the projector's slots (module doc). With
    ``to_grid=False`` the slots no tower token fills stay to be dropped before the LLM by the pre-LLM stage that
    :mod:`vitrim.vlm.stacking` installs after this one."""
    if not isinstance(method, TowerMethod):
        raise TypeError(f"vlm method {method.name!r} is not a tower method")
    model = family.model
    config = model.config
    plan = tower_plan(family, method.name)
    to_grid = to_grid_of(family, method)
    keep = _keep_count(options.keep, plan.patches)
    first: Any = plan.layers[0]
    layout = TowerLayout(plan.feature_index + 1, plan.num_prefix, plan.patches, int(first.self_attn.embed_dim))
    reducers = method.tower_reducers(layout, keep)
    if plan.num_prefix and getattr(config, "vision_feature_select_strategy", "default") != "default":
        raise ValueError("vision_feature_select_strategy='full' keeps [CLS] among the image tokens; not supported")
    reduction = TowerReduction(plan, reducers, to_grid)

    def to_slots(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (reduction.tokens_to_slots(args[0], to_grid=to_grid), *args[1:])

    # registered before the pre-LLM stage's own projector hook, which then sees every slot
    reduction._handles.append(family.inner.multi_modal_projector.register_forward_pre_hook(to_slots))
    reduction._handles.append(family.language_model.register_forward_pre_hook(reduction.on_llm, with_kwargs=True))
    # the reducers rank and merge by values: a meta-device image is refused naming it, before the tower runs
    refuse_meta = lambda module, args, kwargs: refuse_meta_inputs(args, kwargs, positional=("pixel_values",))  # noqa: E731
    reduction._handles.append(family.inner.vision_tower.register_forward_pre_hook(refuse_meta, with_kwargs=True))
    return reduction


def _keep_count(keep: KeepSpec | None, patches: int) -> int | None:
    return None if keep is None else keep.tokens(patches)


__all__ = [
    "BlockAttention",
    "TowerMethod",
    "TowerPlan",
    "TowerReduction",
    "TransformersAttention",
    "build_reducers",
    "feature_block",
    "find_tower",
    "split_heads",
    "install",
    "keep_counts_per_image",
    "to_grid_of",
    "tower_plan",
]

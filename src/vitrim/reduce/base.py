"""The token-reduction interface every Block understands: a reducer with hooks around the block's attention.

A Block runs, for the reducer it holds (``block.reducer``, or None)::

    state = reducer.before_attention(state)              # e.g. DynamicViT scores the tokens entering the block
    state, ahead = reducer.reduce_ahead(state, softmax(q kᵀ))   # only if reducer.looks_ahead (MCTF)
    attention = block.attn.attend(norm1(state.tokens), ahead=ahead)   # out, weights, q, k, scale (AttentionResult)
    state = reducer.after_attention(state + attention.out, attention)   # e.g. ToMe, EViT, top-k, using q and k
    state = state + MLP(norm2(state))

``reduce_ahead`` receives the attention weights (B, H, N, N) of the tokens entering the block (only q and k are
projected) and returns the reduced state and those weights merged alike (B, H, N', N'), which the block applies to
the values of the reduced tokens instead of computing its attention again (None: compute it again).

Each hook returns a new :class:`~vitrim.reduce.state.TokenState` (conventions there); nothing is mutated in place,
so a model with reducers stays a plain function of its input. A reducer is a plain object, not an ``nn.Module``: it
holds settings, not parameters (a learned reducer such as DynamicViT's refers to modules the model owns), so
attaching one never changes a state dict.

A new method is one file in this package: subclass :class:`Reducer`, implement a hook, decorate the class with
``@vitrim.reduce.register("name")``; ``vitrim.reduce.apply(model, "name", layers=..., **options)`` then puts one
instance (built from ``options``) on each block in ``layers``, and the reducer tests sweep it with its
``example_options`` and ``identity_options``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from vitrim.attention import AttentionResult
from vitrim.reduce.state import TokenState
from vitrim.reduce.tokens import keep_tokens

if TYPE_CHECKING:
    from vitrim.reduce.schedule import Schedule


def quarter_layers(depth: int) -> tuple[int, ...]:
    """Blocks a quarter, half and three quarters deep: ``depth · k // 4`` for k = 1, 2, 3, deduplicated.

    12 -> (3, 6, 9), 4 -> (1, 2, 3), 24 -> (6, 12, 18), 2 -> (0, 1), 1 -> (0,): where EViT fuses and DynamicViT prunes.
    """
    return tuple(sorted({depth * k // 4 for k in (1, 2, 3)}))


@dataclass(frozen=True)
class StrengthOption:
    """The one numeric option that sets how much a reducer removes, so a benchmark can tune it to a compute budget.

    ``vitrim bench reducers`` tries the values ``weakest``, ``weakest ± step``, … up to ``strongest`` (the sign
    goes from weakest towards strongest) and bisects over them for the value whose FLOPs come closest to a target,
    so FLOPs must not grow as the value moves towards ``strongest``. ``strongest`` None means no upper limit (an
    int option that counts tokens removed, like ToMe's ``r``): the search doubles it until FLOPs stop falling.

    Examples: ToMe ``StrengthOption("r", weakest=0, strongest=None, step=1)``; EViT
    ``StrengthOption("keep_rate", weakest=1.0, strongest=0.001, step=0.001)``.
    """

    name: str
    weakest: float  # the value that leaves the model dense (or closest to it)
    strongest: float | None  # the strongest value the option accepts; None: unbounded (int options only)
    step: float = 1  # the search's resolution; an int step with int ends makes an int option

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"StrengthOption name must be an option name like 'r', got {self.name!r}")
        if not self.step > 0:
            raise ValueError(f"StrengthOption step must be positive, got {self.step!r}")
        if self.strongest is None and not self.integer:
            raise ValueError(f"an unbounded StrengthOption ({self.name}) must be an int option (int weakest and step)")

    @property
    def integer(self) -> bool:
        """Whether the option takes ints (int ends and step)."""
        ends = (self.weakest, self.step) if self.strongest is None else (self.weakest, self.strongest, self.step)
        return all(isinstance(v, int) and not isinstance(v, bool) for v in ends)

    def value(self, index: int) -> float:
        """The ``index``-th value tried: ``weakest + index · step`` towards ``strongest`` (floats rounded to 1e-9)."""
        sign = 1 if self.strongest is None or self.strongest >= self.weakest else -1
        value = self.weakest + sign * index * self.step
        return int(value) if self.integer else round(value, 9)

    @property
    def last_index(self) -> int | None:
        """The index of ``strongest`` (None if unbounded)."""
        if self.strongest is None:
            return None
        return round(abs(self.strongest - self.weakest) / self.step)


class Reducer:
    """Base class of token reducers (see module doc). Subclasses override one or both hooks.

    Class attributes a registered reducer declares:
        name: set by ``@register``.
        example_options: options that reduce tokens on a 4-block model of 16 patches (for the test sweep).
        identity_options: options that leave such a model exactly dense.
        needs_cls_token: True if it ranks tokens by the [CLS] row; ``apply`` refuses models without [CLS].
        adds_modules: names of the modules ``for_model`` adds to the model (learned reducers); ``remove`` deletes them.
        layers_alias: another name ``apply`` accepts for ``layers`` (DynamicViT's ``prune_layers``).
        strength_option: the one numeric option that sets how many tokens go (:class:`StrengthOption`), so that
            ``vitrim bench reducers`` can match reducers at equal FLOPs; None: the benchmark lists it as skipped.
        looks_ahead: True if the block calls :meth:`reduce_ahead` (MCTF's one-step-ahead attention).
        static_counts: True if the tokens it keeps depend only on the input's shape, never on its values (every
            reducer here): a forward of one shape is then one fixed graph, which ``vitrim.optimize`` captures.
        constant_ranking_scores: True if attribution takes the scores it ranks and weighs tokens by as constants
            (AttnLRP's gate rule: a fused token's relevance goes to the tokens it fused, by those weights); the
            reducer detaches them itself while its ``attributing`` flag is set (``vitrim.viz.lrp_rules`` sets it on
            this model's reducers and clears it after), so relevance replaces none of its methods.
        merges_at_most_half: True if one block merges away at most half of its non-prefix tokens (bipartite
            matching: ToMe), so a schedule asking one block for more is met earlier (``vitrim.vlm`` tower's ``keep=``).
    """

    name: ClassVar[str] = ""
    example_options: ClassVar[dict[str, Any]] = {}
    identity_options: ClassVar[dict[str, Any]] = {}
    needs_cls_token: ClassVar[bool] = False
    adds_modules: ClassVar[tuple[str, ...]] = ()
    layers_alias: ClassVar[str | None] = None
    strength_option: ClassVar[StrengthOption | None] = None
    looks_ahead: ClassVar[bool] = False
    static_counts: ClassVar[bool] = True
    constant_ranking_scores: ClassVar[bool] = False
    merges_at_most_half: ClassVar[bool] = False
    applied: bool = False  # set by vitrim.reduce.apply; vitrim.reduce.remove takes off only these
    attributing: bool = False  # set while a relevance method runs (see constant_ranking_scores)

    @classmethod
    def default_layers(cls, depth: int) -> tuple[int, ...]:
        """The blocks that get an instance when ``apply`` is given no ``layers``: every block."""
        return tuple(range(depth))

    @classmethod
    def for_layers(cls, layers: tuple[int, ...], **options: Any) -> dict[int, Reducer | None]:
        """One reducer per block index in ``layers`` (None: that block stays dense), built from ``options``.

        The default builds ``cls(**options)`` for each; reducers whose options can vary per block (a schedule)
        override this.
        """
        return {layer: cls(**options) for layer in layers}

    @classmethod
    def for_model(cls, model: nn.Module, layers: tuple[int, ...], **options: Any) -> dict[int, Reducer | None]:
        """Like :meth:`for_layers`, for reducers that need the model: a learned reducer adds its modules here."""
        return cls.for_layers(layers, **options)

    @classmethod
    def training_objective(
        cls, model: nn.Module, *, label_smoothing: float, options: dict[str, Any], teacher: nn.Module | None = None
    ) -> Any | None:
        """The objective its authors fine-tune a model carrying this reducer with: a :class:`vitrim.train.Objective`,
        or None for plain cross-entropy (the default). ``options``: a run's objective settings by name (``mctf``,
        ``distill``, ``backbone_lr_scale``, …; each reducer reads its own); ``teacher``: a frozen dense model."""
        return None

    @classmethod
    def options_for_schedule(cls, schedule: Schedule) -> tuple[tuple[int, ...], dict[str, Any]]:
        """The blocks and options that leave the tokens a per-block schedule (:mod:`vitrim.reduce.schedule`) states
        after each block. Count-based reducers override this; the default refuses."""
        raise ValueError(f"reducer {cls.name!r} takes no schedule (it has no per-block token counts)")

    @classmethod
    def takes_schedule(cls) -> bool:
        """Whether ``apply(model, name, schedule=...)`` works for this reducer."""
        return cls.options_for_schedule.__func__ is not Reducer.options_for_schedule.__func__  # type: ignore[attr-defined]

    def before_attention(self, state: TokenState) -> TokenState:
        """Called with the tokens entering the block, before its attention. Default: unchanged."""
        return state

    def reduce_ahead(self, state: TokenState, weights: Tensor) -> tuple[TokenState, Tensor | None]:
        """Called, if ``looks_ahead``, with the tokens entering the block and their attention weights (B, H, N, N);
        returns the reduced state and the weights merged alike (B, H, N', N'), or None to have them computed again."""
        return state, None

    def after_attention(self, state: TokenState, attention: AttentionResult) -> TokenState:
        """Called after the attention residual (``state.tokens`` = x + attn(x)), before the MLP. Default: unchanged."""
        return state

    @staticmethod
    def keep(state: TokenState, index: Tensor, **fused: Tensor) -> TokenState:
        """Keep the prefix and the patch tokens ``index`` (B, k); see :func:`vitrim.reduce.tokens.keep_tokens`."""
        return keep_tokens(state, index, **fused)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

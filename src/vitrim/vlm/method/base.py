"""The VLM methods by name, and the contract between a method and the plumbing that runs it (owned here).

A method is one file: a class decorated with ``@register_method("name", stage=...)`` that holds its options (the
authors' names, their paper defaults in ``defaults``), its selection, a pure function of tensors, and its cost
(``cost``: its own multiply-adds and what it leaves the model, read by :mod:`vitrim.vlm.flops`). Where it cuts:

- ``"pre_llm"``: between the vision tower and the LLM. The family adapter captures :class:`VisionEvidence` for a
  batch of images and calls ``method.select(evidence, keep)``, which returns one :class:`ImageSelection` per image;
  the adapter then hands only those tokens to the LLM (``vitrim.vlm.stages.sequence``).
- ``"in_llm"``: inside the LLM from a layer on; installed by ``vitrim.vlm.stages.in_llm.install(family, method, keep)``.
- ``"tower"``: inside the vision tower; installed by ``vitrim.vlm.stages.tower.install(family, method, keep)``.

Every stage's ``install`` returns an :class:`Installation`; ``vitrim.vlm.remove`` calls its ``remove()`` and
``vitrim.vlm.last_selection`` reads its ``selection()``.

Index space (every stage): image-token indices are raster indices of the image tokens the UNMODIFIED model would
hand the LLM for that image (0 … N−1; for LLaVA-1.5 the patches of the feature layer without [CLS]).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch
from torch import Tensor

from vitrim.moved import moved_names
from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.cost import VLM, MethodCost

if TYPE_CHECKING:  # the stage hands it to a method; the method only reads it
    from vitrim.vlm.evidence.llm_layer import LayerEvidence

STAGES = ("pre_llm", "in_llm", "tower")
GENERIC_OPTIONS = ("keep", "layer")  # read by the plumbing, not by a method's constructor
# every pre-LLM method's option ``positions``: "authors" (the default) hands the LLM the sequence the method's authors
# build (a shorter sequence numbered contiguously, the tokens in their order; see docs/vlm.md's table per method),
# "original" keeps every kept token in its own slot at its ORIGINAL position (a drop equals masking those keys)
POSITIONS = ("authors", "original")
PRE_LLM_DEFAULTS: Mapping[str, Any] = {"positions": "authors"}


@dataclass(frozen=True)
class VisionEvidence:
    """What a family adapter captures from the vision tower for the images of one forward pass (I images).

    features: (I, N, D)            the image tokens entering the projector (LLaVA: the ``vision_feature_layer``
                                   hidden states without [CLS]); raster order, index space of the module docstring
    cls_attention: (I, H, N) | None  per head, the softmax attention row of [CLS] at the scoring layer (the layer that
                                   produces the feature layer, LLaVA-1.5: the tower's layer −2), over the N image
                                   tokens (the softmax ran over [CLS] and the N tokens, so a row sums to < 1)
    keys: (I, H, N, hd) | None     that layer's keys of the image tokens, per head (VisionZip's merge metric)
    seeds: (I,) long | None        a number drawn from each image's own pixels, so a seeded method selects the same
                                   tokens for an image alone or in a batch
    projected: (I, N, E) | None    the image tokens as the LLM receives them (the projector's output), for methods
                                   with ``scores_projected`` (they select after the projector and cannot merge)
    grid: (rows, columns) | None   the raster grid of the N tokens (rows · columns = N) for the methods that read
                                   the image's 2-D layout (``downsample``); None: the family did not
                                   say, and a square √N × √N grid is meant (LLaVA, each LLaVA-NeXT tile, Gemma 3's
                                   pooled grid are square; a family whose images keep their aspect ratio - Qwen -
                                   must give it)
    instruction: (I, M, E) | None  the LLM's input embeddings of the instruction each image answers to (the real
                                   text tokens after the image), for methods whose ``reads_instruction()`` is True:
                                   the pre-LLM stage then selects when the prompt reaches the LLM, one image at a
                                   time (I = 1), on ``projected`` = that image's tokens as the LLM receives them
    object_attention: (I, H, N) | None  a second block's attention in ``cls_attention``'s convention, for a method
                                   reading two blocks (HiPrune's object block on Qwen; the family taps the block the
                                   method names in ``object_block``)
    query_attention: (I, H, N) | None  per head, each temporal patch's mean query's softmax attention over its tokens'
                                   mean keys at the scoring block (FastVID's salience; Qwen, for methods with
                                   ``needs_query_attention``; ``evidence.merged_tokens.mean_query_attention``)
    question: str | None           the caller's question for the image (``texts=`` of the forward or ``generate()``,
                                   the question alone as the authors pass it), for a method reading it through a
                                   text tower of its own (CDPruner's CLIP relevance); None when the caller gave none
    frame_states: (F, p², D) | None  one video's frames' feature-layer states, before the projector and the pooling
                                   (LLaVA-OneVision: each frame's tower run, ``hidden_states[vision_feature_layer]``),
                                   for a video method that reads them through a head of its own (FastVID's
                                   OneVision form: SigLIP's attention-pooling head); the family gives them where
                                   the method has ``needs_query_attention`` and the tower has no mean query
    cls_feature: (I, D) | None     the tower's [CLS] row of the feature layer, as ``features`` would hold it before
                                   the projector (LLaVA-1.5: ``hidden_states[vision_feature_layer][:, 0]``), for
                                   methods whose ``uses_cls_token`` is True; None where the tower has no [CLS]
                                   (SigLIP, Qwen's tower) or the family cannot hand one to the LLM (LLaVA-NeXT)
    """

    features: Tensor
    cls_attention: Tensor | None = None
    keys: Tensor | None = None
    seeds: Tensor | None = None
    projected: Tensor | None = None
    grid: tuple[int, int] | None = None
    instruction: Tensor | None = None
    cls_feature: Tensor | None = None
    question: str | None = None
    object_attention: Tensor | None = None
    query_attention: Tensor | None = None
    frame_states: Tensor | None = None

    def token_grid(self) -> tuple[int, int]:
        """(rows, columns) of the N image tokens: :attr:`grid`, or √N × √N when it is None; ``ValueError`` when the
        family gave no grid and N is not a square (the layout cannot be known from N alone)."""
        num_tokens = self.features.shape[1]
        if self.grid is not None:
            rows, columns = self.grid
            if rows * columns != num_tokens:
                raise ValueError(f"VisionEvidence.grid={self.grid} does not hold the image's {num_tokens} tokens")
            return rows, columns
        side = math.isqrt(num_tokens)
        if side * side != num_tokens:
            raise ValueError(
                f"this method reads the image's 2-D token grid; the model gave no grid (VisionEvidence.grid) and "
                f"{num_tokens} tokens are not a square grid"
            )
        return side, side


@dataclass(frozen=True)
class ImageSelection:
    """The tokens of one image that enter the LLM.

    kept: (k,) long, sorted   the raster indices of the image tokens (patches) whose slots the LLM sees
    groups: k tensors         per kept slot, the sorted raster indices it stands for (one index for a kept token,
                              several for a merged one); ``kept[i]`` is in ``groups[i]``
    merged: (k, D) | None     features to write into the kept slots before the projector (None: the slots' own)
    projected: bool           ``merged`` holds (k, E) tokens as the LLM receives them (after the projector), written
                              into the merged slots as they are: a video method merging the merger's output (FastVID)
    cls: bool                 the tower's [CLS] token enters the LLM too, projected by the family's own projector,
                              as one more token standing for NO patch (VisionZip as its authors run it on LLaVA):
                              the image then hands the LLM ``k + 1`` tokens, [CLS] first. It travels in the slot
                              of the first raster index not kept (:meth:`cls_carrier`), a detail of the plumbing:
                              ``kept`` and ``groups`` never name that index for it
    order: (k,) long | None   the positions in ``kept`` in the order the tokens enter the LLM under the authors'
                              layout (``positions="authors"``, after [CLS] when ``cls``); None: raster order. Under
                              ``positions="original"`` every token sits in its own slot and this is ignored
    """

    kept: Tensor
    groups: tuple[Tensor, ...]
    merged: Tensor | None = None
    cls: bool = False
    order: Tensor | None = None
    projected: bool = False

    def merged_slots(self) -> Tensor:
        """(m,) positions in ``kept`` of the slots standing for several tokens: the only slots whose features a
        family writes (a slot standing for itself keeps the model's own features, bit for bit)."""
        sizes = torch.tensor([len(group) for group in self.groups], dtype=torch.long)
        return (sizes > 1).nonzero()[:, 0].to(self.kept.device)

    def cls_carrier(self) -> int:
        """The raster slot the [CLS] row travels in: the first index not in ``kept`` (its own token is dropped, so
        the slot is free; a method setting ``cls`` leaves at least one token out)."""
        taken = set(self.kept.tolist())
        return next(index for index in range(len(taken) + 1) if index not in taken)

    def slots(self) -> Tensor:
        """(k + cls,) sorted: the raster slots the LLM sees (``kept``, and the [CLS] carrier when ``cls``)."""
        if not self.cls:
            return self.kept
        carrier = self.kept.new_tensor([self.cls_carrier()])
        return torch.cat([self.kept, carrier]).sort().values

    def llm_slots(self) -> Tensor:
        """(k + cls,) the raster slots in the order their tokens enter the LLM under the authors' layout: the [CLS]
        carrier first when ``cls``, then ``kept`` in ``order`` (raster order when ``order`` is None)."""
        ordered = self.kept if self.order is None else self.kept[self.order.to(self.kept.device)]
        if not self.cls:
            return ordered
        return torch.cat([self.kept.new_tensor([self.cls_carrier()]), ordered])

    @classmethod
    def unmerged(cls, kept: Tensor) -> ImageSelection:
        """The selection of the sorted ``kept`` (k,) tokens, each standing for itself (nothing merged)."""
        return cls(kept=kept, groups=tuple(kept[:, None].unbind(0)))


class Selector(Protocol):
    """What the pre-LLM stage and the encoder seam run: a pre-LLM :class:`Method`, or a composition of the stacking
    (a tower's tokens, then a method; ``vitrim.vlm.stacking``). Its flags say which evidence the taps capture."""

    @property
    def name(self) -> str: ...

    @property
    def needs_cls_attention(self) -> bool: ...

    @property
    def needs_query_attention(self) -> bool: ...

    @property
    def scores_projected(self) -> bool: ...

    @property
    def needs_seeds(self) -> bool: ...

    @property
    def uses_cls_token(self) -> bool: ...

    def reads_instruction(self) -> bool: ...

    @property
    def reads_time(self) -> bool: ...

    def authors_layout(self) -> bool: ...

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]: ...


@dataclass(frozen=True)
class StageOptions:
    """The generic options every stage's ``install`` receives, validated where they can be known without a model.

    keep: the ``keep=`` spec (None when not given; a stage that needs it says so)
    layer: ``layer=`` as given (in-LLM methods validate it against the LLM's depth), None when not given
    """

    keep: KeepSpec | None
    layer: int | None


class Installation(Protocol):
    """What a stage's ``install`` leaves on the model: ``remove()`` undoes every hook and attribute it set;
    ``selection()`` is, for the last prefill, one :class:`ImageSelection` per image (None before any prefill)."""

    def remove(self) -> None: ...

    def selection(self) -> list[ImageSelection] | None: ...


class Method:
    """Base of every VLM method: options checked once, at construction (so ``apply`` fails before touching a model).

    Subclasses set ``defaults`` (option name -> paper default, the authors' names) and may override ``check``
    to validate values; ``name`` and ``stage`` are set by :func:`register_method`.
    """

    name: ClassVar[str] = ""
    stage: ClassVar[str] = ""
    defaults: ClassVar[Mapping[str, Any]] = {}
    needs_cls_attention: ClassVar[bool] = False  # pre-LLM: the family must capture VisionEvidence.cls_attention/keys
    scores_projected: ClassVar[bool] = False  # pre-LLM: select on VisionEvidence.projected (after the projector)
    needs_seeds: ClassVar[bool] = False  # pre-LLM: the family must compute VisionEvidence.seeds from the pixels
    # pre-LLM, with needs_cls_attention: the family must also capture VisionEvidence.query_attention (Qwen; on
    # LLaVA-OneVision, whose tower has no mean query, VisionEvidence.frame_states for the method's own head)
    needs_query_attention: ClassVar[bool] = False
    reads_grid: ClassVar[bool] = False  # pre-LLM: reads the tokens' 2-D layout (VisionEvidence.token_grid)
    uses_cls_token: ClassVar[bool] = False  # pre-LLM: hand it VisionEvidence.cls_feature where the tower has a [CLS]
    # a family whose stages do not take this method's stage runs this pre-LLM form of it instead (same name, same
    # options): HiPrune's tower method is the authors' LLaVA code, its pre-LLM form their Qwen2.5-VL code
    pre_llm_form: ClassVar[type[Method] | None] = None
    # pre-LLM: selects over a whole video (one video per VisionEvidence, ``grid`` one temporal patch's) and decides
    # its own count (no keep=); False: an image method, which a video family runs on each temporal patch as an image
    reads_time: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        defaults = {**self.defaults, **(PRE_LLM_DEFAULTS if self.stage == "pre_llm" else {})}
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            known = ", ".join([*GENERIC_OPTIONS, *sorted(defaults)])
            raise ValueError(f"unknown option {unknown[0]!r} for vlm method {self.name!r}; expected one of: {known}")
        self.options: dict[str, Any] = {**defaults, **options}
        self.given = frozenset(options)  # the options the caller named (the rest are defaults)
        if "positions" in defaults and self.options["positions"] not in POSITIONS:
            raise ValueError(
                f"positions={self.options['positions']!r} for vlm method {self.name!r}: expected one of "
                f"{', '.join(map(repr, POSITIONS))} (the authors' sequence, or each kept token at its own position)"
            )
        self.check()

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The method's own options with their defaults (what :func:`method_info` lists); every pre-LLM method has
        ``positions`` too (:data:`POSITIONS`)."""
        return {**cls.defaults, **(PRE_LLM_DEFAULTS if cls.stage == "pre_llm" else {})}

    def authors_layout(self) -> bool:
        """Whether this pre-LLM method hands the LLM its authors' sequence (``positions="authors"``)."""
        return self.options.get("positions") == "authors"

    def reads_instruction(self) -> bool:
        """Whether this method's selection reads the prompt (:attr:`VisionEvidence.instruction`)."""
        return False

    def check(self) -> None:
        """Raise ``ValueError`` naming the option, its value and what was expected (``self.options``)."""

    default_layer: ClassVar[int | None] = None  # in-LLM: the authors' drop layer K when ``layer=`` is not given

    def default_keep(self) -> int | float | None:
        """Tokens per image when ``keep=`` is not given (VisionZip: ``dominant + contextual``; FastV: a fraction
        of each image's tokens), else None."""
        return None

    def check_keep(self, keep: int) -> None:
        """Raise ``ValueError`` when this method cannot keep ``keep`` tokens per image with its options."""

    def select(self, evidence: VisionEvidence, keep: int) -> list[ImageSelection]:
        """pre-LLM methods: ``keep`` tokens per image (1 ≤ keep ≤ N, already validated)."""
        raise NotImplementedError(f"vlm method {self.name!r} ({self.stage}) does not select before the LLM")

    def cost(self, model: VLM, keep: int, *, text_tokens: int) -> MethodCost:
        """This method's part of one image's prefill on ``model`` with ``keep`` tokens kept (1 ≤ keep ≤ the model's
        image tokens, validated by the caller) and ``text_tokens`` text tokens, under ``self.options``: its own
        multiply-adds and what it leaves the model to run (:class:`~vitrim.vlm.method.cost.MethodCost`).
        :mod:`vitrim.vlm.flops` counts the tower, projector and LLM from it; a method whose file defines this is
        listed by ``vitrim vlm flops``. A video method (``reads_time``) is counted on a clip (``model`` holds its t
        temporal patches of P tokens, :mod:`vitrim.vlm.flops_video`): it decides its count from its options, so it
        reads no ``keep`` (given the video's t·P) and returns its own count in the cut.

        There is no default count: a silent zero would show a method that scores or compares tokens as free in
        the "method's own" column, and the table exists to compare exactly that. A method that computes nothing
        but its cut says so in one line (``return MethodCost.before_llm(keep)``, as ``random`` does).
        """
        raise NotImplementedError(
            f"vlm method {self.name!r} does not count its cost: its file must define "
            "cost(self, model, keep, *, text_tokens) -> MethodCost (vitrim.vlm.method.cost)"
        )


@dataclass(frozen=True)
class DropStage:
    """Drop before decoder layer ``layer``; ``tokens(N)`` image tokens of an image of N tokens stay from there on."""

    layer: int
    tokens: Callable[[int], int]


class DropPolicy(Protocol):
    """An in-LLM method: where it drops, and which image tokens it keeps (a pure function of the evidence)."""

    needs_previous_layer: bool  # True: the evidence carries layer K-1's input (FastV's attention, DART's keys)
    reads_attention: bool  # True: the method recomputes q/k of some layer (checked at install)

    def drop_stages(self, num_layers: int) -> list[DropStage]: ...

    def choose(self, evidence: LayerEvidence, counts: list[int]) -> list[Tensor]:
        """Per image (batch reading order): the sorted raster indices it keeps, ``counts[i]`` of its current ones."""
        ...


_METHODS: dict[str, type[Method]] = {}
M = TypeVar("M", bound=type[Method])


def register_method(name: str, *, stage: str) -> Callable[[M], M]:
    """Class decorator: make ``cls`` the VLM method ``name`` (``vitrim.vlm.apply(model, name, ...)``)."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} of vlm method {name!r} is not one of {', '.join(STAGES)}")

    def decorate(cls: M) -> M:
        if name in _METHODS and _METHODS[name] is not cls:
            raise ValueError(
                f"vlm method {name!r} is registered twice ({_METHODS[name].__qualname__}, {cls.__qualname__})"
            )
        clashes = sorted(set(cls.defaults) & set(GENERIC_OPTIONS))
        if clashes:
            raise ValueError(f"vlm method {name!r} may not define the generic option {clashes[0]!r}")
        cls.name, cls.stage = name, stage
        _METHODS[name] = cls
        return cls

    return decorate


def method_class(name: str) -> type[Method]:
    """The class registered as ``name``; ``ValueError`` listing the known names otherwise."""
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"unknown vlm method {name!r}; expected one of: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def methods(stage: str | None = None) -> list[str]:
    """The registered method names, sorted; only those cutting at ``stage`` ("pre_llm", "in_llm", "tower") if given."""
    if stage is not None and stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a vlm stage; expected one of: {', '.join(STAGES)}")
    return sorted(name for name, cls in _METHODS.items() if stage is None or cls.stage == stage)


@dataclass(frozen=True)
class MethodInfo:
    """What a method is, for a listing: its ``name``, the ``stage`` it cuts at, its own options with their defaults
    (the authors' names and paper values; ``keep=`` and, in the LLM, ``layer=`` come on top), its docstring's
    first line (``summary``) and whether it reduces videos only (``video``: it selects over time, and refuses a model
    given images)."""

    name: str
    stage: str
    defaults: Mapping[str, Any]
    summary: str
    video: bool = False


def method_info(name: str) -> MethodInfo:
    """The :class:`MethodInfo` of the method ``name``; ``ValueError`` listing the known names otherwise."""
    cls = method_class(name)
    doc = inspect.getdoc(cls) or inspect.getdoc(inspect.getmodule(cls)) or ""
    return MethodInfo(
        name=name,
        stage=cls.stage,
        defaults=dict(cls.option_defaults()),
        summary=doc.split("\n")[0],
        video=cls.reads_time,
    )


# content_seed lived here before the evidence floor (vitrim.vlm.evidence.seeds): answered for one release
__getattr__ = moved_names(__name__)

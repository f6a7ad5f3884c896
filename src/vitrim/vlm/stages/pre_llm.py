"""The pre-LLM stage, once for every family: the method picks each image's tokens between the tower and the LLM,
and only those enter the LLM.

Per forward pass with images (a prefill), in the order the model runs them:

1. the family's encoder seams (:meth:`FamilyAdapter.select_hooks`) tap the evidence where its tokens are made
   and run :attr:`PreLLMStage.hand_on` there (:mod:`vitrim.vlm.stages.capture`: select, write merged tokens into
   their slots), then report every encoded image's selection with :meth:`PreLLMStage.selected` (``generate()``
   encodes the images before its first forward, a plain call inside it: both land here);
2. the stage's pre-hook on the family's model (``model.model``) notes what the prefill holds
   (:meth:`FamilyAdapter.prefill_of`: its input ids, the caller's 2-D mask, the family's extras);
3. the stage's pre-hook on the language model shortens the prefill (:mod:`vitrim.vlm.stages.sequence`): the spans
   of the images (expanded when ``generate()`` repeated every prompt for beams or several sequences), the kept
   columns, the embeddings, positions and mask gathered, the family's own inputs after them
   (:meth:`FamilyAdapter.shorten_extras`: M-RoPE deltas, DeepStack rows, per-layer masks);
4. its forward hook on the language model remembers the cache that prefill filled; a later forward on that cache is
   a decode step, whose mask (and positions, where the caller gave none) the model pre-hook maps onto the cache's
   shorter layout (:meth:`FamilyAdapter.decode_extras` for the family's own).

Everything a family differs in is one of the seams of :class:`~vitrim.vlm.stages.contract.FamilyAdapter`; beams,
sampling, ``use_cache=False``, ``labels=`` (the loss over the positions that entered the LLM) and the text-only
forward are handled here, the same for every family. When every image keeps all its
tokens, nothing is changed (bit for bit the unmodified model).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.vlm.keep import KeepSpec
from vitrim.vlm.method.base import ImageSelection, Selector, VisionEvidence
from vitrim.vlm.stages.capture import HandOn, Taps, select_keeping
from vitrim.vlm.stages.contract import FamilyAdapter, Prefill, Shortened
from vitrim.vlm.stages.filler_masks import prefill_llm_mask
from vitrim.vlm.stages.inputs import cache_of
from vitrim.vlm.stages.sequence import (
    DecodeState,
    ShortSequence,
    authors_order_offsets,
    columns_to_keep,
    decode_attention_mask,
    dropped_before,
    plan_short_sequence,
    read_short,
    reorder_images,
)
from vitrim.vlm.stages.spans import ImageSpans, repeated_images, spans_from_mask


class PreLLMStage:
    """A pre-LLM selector installed on one family instance (an :class:`~vitrim.vlm.method.base.Installation`).

    ``keep``: tokens per image entering the LLM; None when the selector decides its count (the tokens a tower
    method left, ``vitrim.vlm.stacking``).
    """

    def __init__(
        self,
        family: FamilyAdapter,
        method: Selector,
        keep: KeepSpec | None,
        family_options: Mapping[str, str] | None = None,
    ) -> None:
        self.family, self.method, self.keep = family, method, keep
        self.family_options: Mapping[str, str] = dict(family_options or {})  # checked by apply (FamilyTraits)
        self.hand_on = HandOn(method, self.select)
        self.taps: list[Taps] = []  # what the family's seams tap for this stage (a stopwatch times their evidence)
        self.encoded: list[ImageSelection] | None = None  # the last encoder run's, one per encoded image
        self.reported: list[ImageSelection] | None = None  # what last_selection reads
        self.prefill: Prefill | None = None
        self.decode: DecodeState | None = None
        self.decode_cache: weakref.ref[Any] | None = None
        self.shortened_now = False
        self.labels: Tensor | None = None  # the caller's labels= of the forward in flight (B, L)
        self.short_labels: Tensor | None = None  # those of the positions a shortened prefill kept (B, L')
        self.loss_options: dict[str, Any] = {}
        self.followers: list[Callable[[ImageSpans], None]] = []  # later stages watching the LLM's input (follow)
        self.order: list[int] = []  # the last prefill's images in the LLM input: the encoded image each one shows
        self.tower_states: list[Tensor] = []  # per encoded image (N, D): the features, for an instruction method
        self.pending_states: list[Tensor] = []  # those of the encoder run in flight (a family may select per image)
        self.texts: list[str] | None = None  # the caller's questions (texts=) of the forward in flight
        self.prompt_length: int | None = None  # inside generate(): the prompt's columns (the instruction's end)
        self.generate_texts: Any = None  # inside generate(): its texts= (generate hands the model no unknown keyword)
        handles = [
            family.inner.register_forward_pre_hook(self.before_model, with_kwargs=True),
            family.language_model.register_forward_pre_hook(self.before_llm, with_kwargs=True),
            family.language_model.register_forward_hook(self.after_llm, with_kwargs=True),
            family.model.register_forward_pre_hook(self.take_labels, with_kwargs=True),
            family.model.register_forward_hook(self.loss_after, with_kwargs=True),
        ]
        self.undo: list[Callable[[], None]] = [handle.remove for handle in handles]
        self.undo.append(self.watch_generate(family.model))
        try:
            self.undo += family.select_hooks(self)
        except BaseException:
            self.remove()
            raise

    # what the family's encoder seams call

    def keep_of(self, num_tokens: int) -> int:
        """Tokens an image of ``num_tokens`` keeps (``ValueError`` naming keep when an int exceeds it)."""
        return num_tokens if self.keep is None else self.keep.tokens(num_tokens)

    def select(self, evidence: VisionEvidence, num_tokens: int) -> list[ImageSelection]:
        """The selection for the images of ``evidence``, each of ``num_tokens`` tokens. A method that reads the
        instruction selects when the prompt reaches the LLM (:meth:`select_with_instruction`): every token stays
        here; so does every token where ``keep`` keeps them all."""
        if self.keep is None:
            return self.method.select(evidence, num_tokens)  # the selector decides the count
        keep = self.keep_of(num_tokens)
        if self.method.reads_instruction():
            keep = num_tokens
            self.pending_states += list(evidence.features)
        return select_keeping(self.method, evidence, keep)

    def selected(self, selections: list[ImageSelection]) -> None:
        """The selection of every image of one encoder run (encode order)."""
        self.encoded = selections
        self.tower_states, self.pending_states = self.pending_states, []

    # the model: what a prefill holds; decode steps on a shortened prefill's cache

    def before_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        cache = cache_of(kwargs)
        seen = 0 if cache is None else int(cache.get_seq_length())
        prefill = self.family.prefill_of(args, kwargs)
        if prefill is not None:
            if isinstance(prefill.attention_mask, dict) or getattr(cache, "is_compileable", False):
                raise ValueError(PREPARED_MASKS)  # masks built for a static cache, or the cache itself
            if seen:
                raise ValueError("vitrim.vlm cannot reduce images that follow a cached prefix; run them in the prefill")
            if prefill.runs_tower:
                self.encoded = None  # the tower runs inside this forward and selects again
            self.prefill, self.decode = prefill, None
            return None
        if seen == 0:  # a forward without images and without a cache: a text-only prompt
            self.prefill, self.decode, self.reported = None, None, []
            return None
        owner = None if self.decode_cache is None else self.decode_cache()
        if self.decode is None or owner is not cache:
            return None  # not a step on the shortened prefill's cache
        if isinstance(kwargs.get("attention_mask"), dict):
            raise ValueError(PREPARED_MASKS)
        new = query_length(args, kwargs)
        mask = decode_attention_mask(self.decode, kwargs.get("attention_mask"), seen, new)
        if self.decode.shift is not None and kwargs.get("position_ids") is not None:  # the caller's full-length ones
            kwargs["position_ids"] = kwargs["position_ids"] - self.decode.shift.to(mask.device)[:, None]
        self.family.decode_extras(kwargs, self.decode, mask, seen, new)
        return args, kwargs

    def take_labels(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``labels=`` (B, L) are over the unmodified input; the model gets none, and the loss is computed after it
        (:meth:`loss_after`) over the positions that entered the LLM."""
        self.labels = self.short_labels = None
        texts = kwargs.pop("texts", self.generate_texts)
        self.texts = None if texts is None else questions(texts)
        labels = kwargs.get("labels")
        if labels is None:
            return args, kwargs
        self.labels, self.loss_options = labels, {k: kwargs[k] for k in ("num_items_in_batch",) if k in kwargs}
        kwargs["labels"] = None
        return args, kwargs

    def loss_after(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        """The model's own loss function on the logits it returned, with the labels of the positions it ran on (a
        shortened prefill: the kept columns' labels, -100 at re-padding), shifted within that sequence as the
        authors who fine-tune on pruned tokens do."""
        labels = self.labels if self.short_labels is None else self.short_labels
        self.labels = self.short_labels = None
        if labels is None:
            return None
        model: Any = module  # transformers' …ForConditionalGeneration: its config and its own loss_function
        vocab_size = model.config.get_text_config().vocab_size
        output.loss = model.loss_function(
            logits=output.logits, labels=labels.to(output.logits.device), vocab_size=vocab_size, **self.loss_options
        )
        return output

    # the LLM: the shortened prefill

    def before_llm(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        prefill, self.prefill = self.prefill, None
        if prefill is None:
            return None
        if self.encoded is None:
            raise ValueError(
                "vitrim.vlm saw images enter the LLM but no selection was made for them (pass pixel_values, or "
                "image features this model made after vitrim.vlm.apply)"
            )
        selections, counts = self.family.image_tokens(prefill, self.encoded)
        # (B, L): every image's and video's tokens where the family takes videos, else the image tokens
        is_image: Tensor = prefill.input_ids == self.family.image_token_id() if prefill.media is None else prefill.media
        order = self.order = repeated_images(counts, is_image.sum(1).tolist())
        spans = spans_from_mask(is_image, [counts[i] for i in order])
        if self.method.reads_instruction() and not all(self.keep_of(n) == n for n in counts):
            selections = self.select_with_instruction(kwargs["inputs_embeds"], prefill, spans, order, counts)
        selections = keep_last_positions(selections, spans, order, prefill.attention_mask)
        self.reported = selections
        if all(len(s.kept) == n and not s.cls for s, n in zip(selections, counts, strict=True)):
            self._tell_followers(spans)
            return None  # every token stays: the model runs unmodified
        kept = columns_to_keep(spans, [selections[i] for i in order], max(counts))  # (B, L) bool
        short = plan_short_sequence(kept, prefill.attention_mask)
        embeds = kwargs["inputs_embeds"]  # (B, L, D)
        positions = self.family.prefill_positions(kwargs, embeds)
        short_positions = read_short(short, positions, batch_dim=positions.dim() - 2)
        shift = None
        if self.method.authors_layout() and self.family.authors_positions:
            # the authors' shorter sequence: real columns renumbered as if the dropped ones had never been there,
            # each image's tokens in its authors' order on that image's consecutive positions
            real = short.attention_mask.bool()
            short_positions = torch.where(real, short_positions - read_short(short, dropped_before(kept)), 0)
            shift = (~kept).sum(1)  # (B,) taken off every decode position after the prefill
            short = reorder_images(short, authors_order_offsets(spans, [selections[i] for i in order], max(counts)))
        kwargs["inputs_embeds"] = read_short(short, embeds)
        kwargs["position_ids"] = short_positions
        self.family.shorten_extras(kwargs, prefill, Shortened(short, kept, spans, order))
        if self.labels is not None:
            labels = read_short(short, self.labels.to(short.columns.device))
            self.short_labels = torch.where(short.real, labels, torch.full_like(labels, IGNORE_INDEX))
        if not isinstance(kwargs.get("attention_mask"), dict):  # a family's own masks (Gemma 3) are set already
            kwargs["attention_mask"] = prefill_llm_mask(short, module.config, embeds.dtype)
        self.decode = DecodeState(prefill_mask=short.attention_mask, full_length=short.full_length, shift=shift)
        self.shortened_now = True
        self._tell_followers(short_spans(spans, short, [selections[i] for i in order]))
        return args, kwargs

    def follow(self, on_prefill: Callable[[ImageSpans], None]) -> Callable[[], None]:
        """Call ``on_prefill(spans)`` at every prefill with images, with the image positions of the LLM input as this
        stage hands it on (after shortening: the kept tokens only, ``token_of`` still the unmodified model's raster
        indices). A stage inside the LLM stacked after this one watches its prefills here rather than at
        ``model.model`` (``vitrim.vlm.stacking``); returns the undo."""
        self.followers.append(on_prefill)
        return lambda: self.followers.remove(on_prefill) if on_prefill in self.followers else None

    def _tell_followers(self, spans: ImageSpans) -> None:
        for on_prefill in self.followers:
            on_prefill(spans)

    def select_with_instruction(
        self, embeds: Tensor, prefill: Prefill, spans: ImageSpans, order: list[int], counts: list[int]
    ) -> list[ImageSelection]:
        """Each encoded image's selection by a method that reads the prompt, from the LLM's input ``embeds``
        (B, L, E): the image's own rows as the LLM receives them, and the real text rows after it in its sample
        (all of the sample's real text rows when none follows)."""
        real = torch.ones_like(spans.is_image) if prefill.attention_mask is None else prefill.attention_mask.bool()
        chosen: dict[int, ImageSelection] = {}
        for slot, image in enumerate(order):
            if image in chosen:
                continue  # generate() repeated the prompt for its beams: one selection per image
            where = spans.image_of == slot  # (B, L)
            row = int(where.any(1).nonzero()[0])
            columns = where[row].nonzero()[:, 0]  # (N,) the image's columns, raster order
            text = real[row] & ~spans.is_image[row]
            if self.prompt_length is not None:  # generate(): the prompt's text, never the tokens generated after it
                text[self.prompt_length :] = False
            after = text & (torch.arange(text.shape[0], device=text.device) > columns.max())
            instruction = embeds[row, after if bool(after.any()) else text]  # (M, E)
            if not len(instruction):
                raise ValueError(f"vlm method {self.method.name!r} reads the instruction; the prompt has no text")
            tokens = embeds[row, columns]  # (N, E)
            states = self.tower_states
            fits = len(states) == len(counts) and len(states[image]) == len(tokens)
            features = states[image] if fits else tokens  # (N, D) the tower's, where they are the LLM's tokens
            evidence = VisionEvidence(
                features=features[None],
                projected=tokens[None],
                instruction=instruction[None],
                question=self.question_of(row, spans.is_image.shape[0]),
            )
            chosen[image] = self.method.select(evidence, self.keep_of(counts[image]))[0]
        return [chosen[image] for image in range(len(counts))]

    def question_of(self, row: int, rows: int) -> str | None:
        """The caller's question for batch row ``row`` of ``rows`` (``texts=``: one for every row, one per prompt,
        or one per prompt repeated by generate() for its beams or sequences)."""
        if self.texts is None:
            return None
        if len(self.texts) == 1:
            return self.texts[0]
        if not len(self.texts) or rows % len(self.texts):
            raise ValueError(
                f"texts= holds {len(self.texts)} questions for a batch of {rows} prompts; expected one per prompt"
            )
        return self.texts[row // (rows // len(self.texts))]

    def watch_generate(self, model: nn.Module) -> Callable[[], None]:
        """Note the prompt's length and the caller's ``texts=`` for the forwards of every ``generate()`` call on
        ``model`` (an attribute of the instance wrapping the class's method; the class is untouched), so a method
        reading the instruction reads the prompt's text at every step (``use_cache=False`` re-runs the prefill with
        the generated tokens in it); returns the undo."""
        owner: Any = model  # transformers' GenerationMixin: an instance attribute shadows the class's generate
        original = owner.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
            if prompt is None:
                prompt = kwargs.get("inputs_embeds")
            self.prompt_length = None if prompt is None else int(prompt.shape[1])
            self.generate_texts = kwargs.pop("texts", None)
            try:
                return original(*args, **kwargs)
            finally:
                self.prompt_length = self.generate_texts = None

        owner.generate = generate

        def undo() -> None:
            del owner.generate  # the class's method again

        return undo

    def after_llm(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if self.shortened_now:
            cache = getattr(output, "cache", None)
            cache = getattr(output, "past_key_values", None) if cache is None else cache
            self.decode_cache = weakref.ref(cache) if cache is not None else None
        self.shortened_now = False

    # the installation

    def selection(self) -> list[ImageSelection] | None:
        return self.reported

    def remove(self) -> None:
        for undo in self.undo:
            undo()
        self.undo = []
        self.family.remove_extras()


def install(
    family: FamilyAdapter, method: Selector, keep: KeepSpec | None, family_options: Mapping[str, str] | None = None
) -> PreLLMStage:
    """Install the pre-LLM ``method`` on ``family``: ``keep`` image tokens per image enter its LLM (None: the
    selector decides, ``vitrim.vlm.stacking``), selected under the family's own ``family_options`` (checked)."""
    return PreLLMStage(family, method, keep, family_options)


def questions(texts: Any) -> list[str]:
    """``texts=`` as a list of questions: a string (every prompt's), or a list or tuple of strings."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, list | tuple) and all(isinstance(text, str) for text in texts):
        return list(texts)
    raise ValueError(f"texts={texts!r}: expected the question as a string, or a list of strings (one per prompt)")


def query_length(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Columns in this forward (its ``input_ids`` or ``inputs_embeds``)."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    return int(tokens.shape[1])


def keep_last_positions(
    selections: list[ImageSelection], spans: ImageSpans, order: list[int], attention_mask: Tensor | None
) -> list[ImageSelection]:
    """The selections with each sample's last real position kept: ``generate()`` reads the next token there, so a
    prompt that ends on an image token keeps that token (its image keeps one token more than ``keep=``), as its
    own slot, last in the authors' order."""
    batch, length = spans.is_image.shape
    if attention_mask is None:
        last = torch.full((batch,), length - 1, dtype=torch.long)
    else:
        columns = torch.arange(length, device=attention_mask.device)
        last = torch.where(attention_mask.bool(), columns, -1).amax(1).cpu()  # (B,) the last column the mask keeps
    selections = list(selections)
    for row, column in enumerate(last.tolist()):
        if column < 0 or not bool(spans.is_image[row, column]):
            continue
        image = order[int(spans.image_of[row, column])]
        token = int(spans.token_of[row, column])
        selection = selections[image]
        if token in selection.kept.tolist():
            continue
        kept = [*selection.kept.tolist(), token]
        groups = {int(k): g for k, g in zip(selection.kept.tolist(), selection.groups, strict=True)}
        groups[token] = selection.kept.new_tensor([token])
        ordered = sorted(kept)
        llm_order = None
        if selection.order is not None:  # the same tokens in the same order, the added one last
            rank = {k: i for i, k in enumerate(ordered)}
            llm_order = selection.kept.new_tensor(
                [rank[k] for k in selection.kept[selection.order].tolist()] + [rank[token]]
            )
        selections[image] = ImageSelection(
            kept=selection.kept.new_tensor(ordered),
            groups=tuple(groups[k] for k in ordered),
            cls=selection.cls,
            order=llm_order,
        )  # merged features were written by the family already; the added token keeps its own
    return selections


def short_spans(spans: ImageSpans, short: ShortSequence, selections: list[ImageSelection]) -> ImageSpans:
    """``spans`` (B, L) of the unmodified input read at the columns ``short`` keeps: (B, L'), fillers not image, and
    ``real`` the columns of ``short`` that are neither padding nor filler.

    A [CLS] the method hands the LLM (``selections``, reading order, ``cls``) rides in a dropped token's slot (its
    ``cls_carrier``); it stands for no image token, so a stage after this one sees it as it sees text: never dropped,
    never ranked."""
    is_image = spans.is_image.gather(1, short.columns) & short.real
    image_of = torch.where(is_image, spans.image_of.gather(1, short.columns), -1)
    token_of = torch.where(is_image, spans.token_of.gather(1, short.columns), -1)
    for image, selection in enumerate(selections):
        if selection.cls:
            is_image &= ~((image_of == image) & (token_of == selection.cls_carrier()))
    image_of, token_of = torch.where(is_image, image_of, -1), torch.where(is_image, token_of, -1)
    return ImageSpans(is_image, image_of, token_of, real=short.attention_mask.bool())


IGNORE_INDEX = -100  # transformers' loss skips this label

PREPARED_MASKS = (
    "vitrim.vlm shortens the prefill from the caller's 2-D attention_mask and needs generate's default dynamic "
    "cache; a static or compiled cache (cache_implementation='static', masks prepared for one) is not supported"
)

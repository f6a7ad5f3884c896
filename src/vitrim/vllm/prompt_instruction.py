"""The prompt's text each image answers to, from vLLM's front end to the selection: CDPruner served (owned here).

vitrim.vlm's CDPruner reads, per image, the instruction it answers to (:mod:`vitrim.vlm.method.cdpruner`):

- ``relevance="llm"`` (the default on vLLM): the LLM's input embeddings of the prompt's text after the image, as
  vitrim.vlm reads them on transformers (:meth:`vitrim.vlm.stages.pre_llm.PreLlmStage.select_with_instruction`):
  every prompt token after the image that is not an image or video token, the chat template's included (whatever the
  prompt holds), the generated tokens never; all of the prompt's text where none follows the image;
- ``relevance="clip"`` (LLaVA-1.5): the request's question alone through CLIP's text tower, the authors' signal,
  ``texts=`` on transformers, ``mm_processor_kwargs={"vitrim": {"question": …}}`` here.

vLLM encodes an image in its worker, which sees the image's pixels and the processor's fields, never the prompt. So
the front end's processor (:class:`PromptInstruction`, which sees the prompt) hands each image its text as fields of
the processor output, as the request's keep travels (:mod:`vitrim.vllm.request_keep`): ``vitrim_image_text`` (the
token ids) and ``vitrim_image_question`` (UTF-8 bytes, empty where the request gives none). The text comes from the
prompt before vLLM writes the placeholders (each image one target token then, the ``i``-th for image ``i``): the
families served here (LLaVA-1.5, Qwen2.5-VL and Qwen3-VL images) only repeat that token, so the text after it is the
text after the image in the prompt transformers sees. Each image's processor and encoder cache identity (its hash)
takes its text in, so an image asked under two prompts is two entries, and the same image twice in one prompt two.
The worker embeds the ids with the LLM's own embedding (:func:`select_with_prompts`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from vllm.multimodal.inputs import MultiModalFieldConfig

from vitrim.vllm.options import reads_question
from vitrim.vllm.request_keep import RequestKeep
from vitrim.vlm.method.base import ImageSelection, Method, Selector, VisionEvidence
from vitrim.vlm.stages.capture import one_image, select_keeping

TEXT_FIELD = "vitrim_image_text"  # per image (M,) long: the prompt's token ids it answers to
QUESTION_FIELD = "vitrim_image_question"  # per image (Q,) uint8: the request's question, UTF-8; empty: none
TEXTS = "vitrim_image_texts"  # the processor's own option: each image's text, set by apply, never the HF processor's
PROFILE_QUESTION = "what is in the image?"  # the question of vLLM's profiling run, where relevance="clip" needs one


def texts_after(prompt: Sequence[int], target: int, media: frozenset[int], images: int) -> list[list[int]]:
    """Per image of a prompt (before vLLM writes its placeholders: image ``i`` is the ``i``-th ``target`` token) the
    token ids of the text it answers to: the prompt's tokens after it that are not ``media`` (every image or video
    token), or all of the prompt's text where none follows. ``ValueError`` (one line) where the prompt has no text."""
    where = [index for index, token in enumerate(prompt) if token == target][:images]
    text = [token for token in prompt if token not in media]
    if not text:
        raise ValueError("vitrim: cdpruner reads the prompt's text; this prompt has none besides its images")
    texts = []
    for index in where:
        after = [token for token in prompt[index + 1 :] if token not in media]
        texts.append(after or text)
    return texts


def item_hash(base: str, text: Sequence[int]) -> str:
    """An image's cache identity with its text taken in (vLLM's processor and encoder caches key by it)."""
    return hashlib.sha256(f"{base}|vitrim text {list(text)}".encode()).hexdigest()


class PromptInstruction(RequestKeep):
    """Mixed in before a trimmed processor's :class:`~vitrim.vllm.request_keep.RequestKeep` (whose
    ``request_trim`` gives each request's options), for a method that reads the prompt: each image's text and the
    request's question become fields beside its pixels. A family gives :meth:`instruction_tokens`."""

    info: Any

    def instruction_tokens(self) -> tuple[int, frozenset[int]]:
        """(the image's target token in the prompt, every image and video token id)."""
        raise NotImplementedError

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        options = self.request_trim(inputs.hf_processor_mm_kwargs)
        if not options.method.reads_instruction():
            return super().apply(inputs, timing_ctx)  # type: ignore[misc]
        counts = inputs.mm_data_items.get_all_counts()
        if counts.get("video"):
            raise ValueError(
                f"vitrim: method {options.method.name!r} reads the prompt per image, and this request holds a video "
                "(send its frames as images, or serve a video method)"
            )
        if reads_question(options.method) and options.question is None:
            raise ValueError(
                f"vitrim: method {options.method.name!r} with relevance='clip' reads each request's question: pass "
                "mm_processor_kwargs={'vitrim': {'question': ...}} (the question alone, as texts= on transformers)"
            )
        target, media = self.instruction_tokens()
        texts = tuple(map(tuple, texts_after(inputs.prompt, target, media, counts.get("image", 0))))  # hashable
        kwargs = {**inputs.hf_processor_mm_kwargs, TEXTS: texts}
        return super().apply(dataclasses.replace(inputs, hf_processor_mm_kwargs=kwargs), timing_ctx)  # type: ignore[misc]

    def get_dummy_inputs(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any) -> Any:
        # vLLM's profiling run encodes dummy images through apply, on a prompt of image tokens alone: it gets one text
        # token (vLLM pads it with id 0 after anyway) and, under relevance="clip", a question
        inputs = super().get_dummy_inputs(seq_len, mm_counts, mm_options)  # type: ignore[misc]
        method = self.request_trim({}).method
        if not method.reads_instruction():
            return inputs
        media = self.instruction_tokens()[1]
        filler = min(set(range(len(media) + 1)) - media)
        kwargs = dict(inputs.hf_processor_mm_kwargs)
        if reads_question(method):
            kwargs["vitrim"] = {"question": PROFILE_QUESTION}
        return dataclasses.replace(inputs, prompt=[*inputs.prompt, filler], hf_processor_mm_kwargs=kwargs)

    def _get_mm_hashes(self, inputs: Any) -> Any:
        texts = inputs.hf_processor_mm_kwargs.get(TEXTS)
        if texts is None:
            return super()._get_mm_hashes(inputs)  # type: ignore[misc]
        plain = {key: value for key, value in inputs.hf_processor_mm_kwargs.items() if key != TEXTS}
        hashes = dict(super()._get_mm_hashes(dataclasses.replace(inputs, hf_processor_mm_kwargs=plain)))  # type: ignore[misc]
        hashes["image"] = [item_hash(base, text) for base, text in zip(hashes["image"], texts, strict=True)]
        return hashes

    def _get_cache_missing_processor_kwargs(self, inputs: Any, mm_is_cached: Mapping[str, list[bool]]) -> Any:
        kwargs = super()._get_cache_missing_processor_kwargs(inputs, mm_is_cached)  # type: ignore[misc]
        texts = kwargs.get(TEXTS)
        if texts is None:
            return kwargs
        cached = mm_is_cached.get("image", [False] * len(texts))
        return {**kwargs, TEXTS: tuple(text for text, hit in zip(texts, cached, strict=True) if not hit)}

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        return super()._call_hf_processor(hf_data, without_prompt(hf_kwargs))

    def _get_prompt_updates(
        self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: Any
    ) -> Any:
        # the placeholders read the request's keep; vLLM builds (and caches) a transformers processor per distinct set
        # of these options, so neither the texts nor the question reach it
        return super()._get_prompt_updates(mm_items, without_prompt(hf_processor_mm_kwargs), out_mm_kwargs)  # type: ignore[misc]

    def _postprocess_hf_mm_data(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object], processed_data: Any
    ) -> Any:
        processed = super()._postprocess_hf_mm_data(hf_data, hf_kwargs, processed_data)
        texts: Any = hf_kwargs.get(TEXTS)
        if texts is not None and texts:
            question = self.request_trim(hf_kwargs).question or ""
            asked = torch.tensor(list(question.encode()), dtype=torch.uint8)
            processed[TEXT_FIELD] = [torch.tensor(text, dtype=torch.long) for text in texts]
            processed[QUESTION_FIELD] = [asked.clone() for _ in texts]
        return processed

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]) -> Any:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        for name in (TEXT_FIELD, QUESTION_FIELD):
            if name in hf_inputs:
                fields[name] = MultiModalFieldConfig.batched("image")
        return fields


def without_prompt(hf_kwargs: Mapping[str, object]) -> dict[str, object]:
    """A request's processor options without the images' texts and the question (the keep stays)."""
    plain = {key: value for key, value in hf_kwargs.items() if key != TEXTS}
    entry = plain.get("vitrim")
    if isinstance(entry, Mapping) and "question" in entry:
        rest = {key: value for key, value in entry.items() if key != "question"}
        if rest:
            plain["vitrim"] = rest
        else:
            del plain["vitrim"]
    return plain


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """What one image answers to, as its processor wrote it: the prompt's text (M,) long and the question."""

    text: Tensor
    question: str | None


def image_prompts(kwargs: Mapping[str, object], method: Method, images: int) -> list[ImagePrompt] | None:
    """Each image's :class:`ImagePrompt` from the fields of ``embed_multimodal``'s ``kwargs`` (None: ``method``
    reads no prompt); ``RuntimeError`` where the processor wrote none for a method that reads it."""
    if not method.reads_instruction():
        return None
    texts, questions = kwargs.get(TEXT_FIELD), kwargs.get(QUESTION_FIELD)
    if texts is None or questions is None:
        raise RuntimeError(f"vitrim: method {method.name!r} reads the prompt; the processor handed the model none")
    # each field: a list of per-image tensors, or one tensor (I, …) where every image's has the same length
    prompts = [
        ImagePrompt(text.flatten().long(), bytes(question.flatten().tolist()).decode() or None)
        for text, question in zip(list(texts), list(questions), strict=True)  # type: ignore[call-overload]
    ]
    if len(prompts) != images:
        raise RuntimeError(f"vitrim: the processor handed {len(prompts)} prompt texts for {images} images")
    return prompts


def with_prompt(evidence: VisionEvidence, prompt: ImagePrompt, embed: Callable[[Tensor], Tensor]) -> VisionEvidence:
    """One image's evidence (I = 1) with its instruction (1, M, E): ``embed`` (the LLM's input embedding) of its text,
    in the dtype of the image tokens as the LLM receives them, and its question."""
    projected = evidence.projected if evidence.projected is not None else evidence.features
    instruction = embed(prompt.text.to(projected.device)).to(projected.dtype)[None]
    return dataclasses.replace(evidence, instruction=instruction, question=prompt.question)


def select_with_prompts(
    selectors: Sequence[Selector],
    evidence: VisionEvidence,
    keeps: Sequence[int],
    prompts: Sequence[ImagePrompt],
    embed: Callable[[Tensor], Tensor],
) -> list[ImageSelection]:
    """Image ``i`` of ``evidence`` keeps ``keeps[i]`` tokens, selected by ``selectors[i]`` (its request's method) on
    its own rows reading its own prompt: each image alone, as vitrim.vlm selects one at a time when the prompt
    reaches the LLM."""
    selections: list[ImageSelection] = []
    for image, (selector, keep, prompt) in enumerate(zip(selectors, keeps, prompts, strict=True)):
        selections += select_keeping(selector, with_prompt(one_image(evidence, image), prompt, embed), keep)
    return selections


def load_clip(method: Method, width: int, device: torch.device) -> None:
    """Under ``relevance="clip"``: the method's CLIP (its ``clip`` option: a hub name or folder) loaded now, on the
    engine's device, so a CLIP that cannot be had stops the engine at start (one line) rather than a request; its
    visual projection must read the tower's ``width``."""
    if not reads_question(method):
        return
    from vitrim.vlm.method.cdpruner import ClipRelevance

    try:
        towers = ClipRelevance.load(method.options["clip"], method.options["clip_tokenizer"])
    except ValueError as error:
        raise ValueError(f"vitrim: {error}") from None
    model: Any = towers.model  # transformers' CLIPModel
    projection = model.visual_projection
    if projection.in_features != width:
        raise ValueError(
            f"vitrim: cdpruner clip={method.options['clip']!r} projects {projection.in_features}-wide tower states, "
            f"this model's tower is {width} wide (pass the CLIP the tower came from)"
        )
    towers.model = model.to(device)
    method.towers = towers  # type: ignore[attr-defined]  # CDPruner's, read at the first question

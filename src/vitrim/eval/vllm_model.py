"""``lmms-eval --model vitrim_vllm``: a checkpoint served by vLLM with vitrim's plugin, as an lmms-eval model.

lmms-eval's own ``vllm`` models do carry the plugin (``hf_overrides={...}`` in ``--model_args`` is parsed as JSON and
handed to ``vllm.LLM``), but they log nothing per sample, and they send every picture as a PNG (the digits tasks'
float canvases, mode ``"F"``, fail there: ``OSError: cannot write mode F as PNG``). This model serves the same
checkpoint through the plugin and records what :mod:`vitrim.eval.lmms_model` records, from vLLM's own prompt:

- ``--model_args``: ``pretrained`` (a folder vLLM serves), ``method`` (one method the plugin serves: a pre-LLM
  method of vitrim.vlm, or a video method), ``keep`` and the method's options, ``batch_size``, ``max_new_tokens``,
  ``dtype``; every other name that is a field of ``vllm.EngineArgs`` goes to ``vllm.LLM`` (``max_model_len``,
  ``kv_cache_memory_bytes``, ``enforce_eager``, ``limit_mm_per_prompt={"image":2}``, ...), a ``{...}`` or ``[...]``
  value read as JSON; a name that is both (``seed``) is the method's when the method has it;
- the architecture is the plugin's for the folder's ``model_type`` (``VitrimLlavaForConditionalGeneration`` for
  ``llava``), and the ``vitrim`` entry of ``hf_overrides`` is ``{"method": ..., "keep": ..., options}``;
- the prompt is the folder's processor's chat turn, as the transformers model writes it
  (:meth:`vitrim.eval.inputs.TransformersPrompter.prompt`: the pictures, then the question), handed to
  ``LLM.generate`` with the pictures (RGB); answers are greedy (``temperature=0``);
- per sample (``token_counts``, under ``vitrim``): ``image_tokens`` (the processor's placeholders for the sample's
  pictures), ``image_tokens_entering_llm`` (vLLM's prompt, which the plugin shortens by the dropped tokens, less the
  text tokens), ``text_tokens``, the prefill multiply-adds (:mod:`vitrim.eval.prefill_cost` on the checkpoint's
  shapes, read from a model built on the meta device), and ``settings`` (the methods with every option, the
  positions convention, the processor's pixel settings, the engine's arguments, vLLM's version);
  ``image_tokens_kept`` is null: vLLM's workers keep the selection (``vitrim.vllm.selection_record`` reads it only
  in tests).

Pictures only: a task that hands a video is refused in one line (vLLM's video path is the plugin's, docs/vllm.md).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from lmms_eval.api.instance import GenerationResult, Instance
from lmms_eval.api.model import lmms

from vitrim.eval.image_tokens import image_token_id, prompt_counts
from vitrim.eval.inputs import TransformersPrompter, rgb
from vitrim.eval.lmms_model import (
    DEFAULT_MAX_NEW_TOKENS,
    SampleCounts,
    answer_in_batches,
    as_list,
    cut,
    jsonable,
    method_settings,
)
from vitrim.eval.model_args import STACK_SEPARATOR, option_value, parse_model_args
from vitrim.eval.prefill_cost import counter_for, sample_macs
from vitrim.eval.video import is_video

OWN = ("pretrained", "batch_size", "dtype", "max_new_tokens", "method")  # read by parse_model_args, not vLLM


def split_arguments(model_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--model_args`` -> (vitrim's: the checkpoint and the method's options; vLLM's engine arguments)."""
    import vitrim.vlm
    from vllm import EngineArgs

    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    spec = model_args.get("method", "none")
    names = [] if spec in (None, "none") else str(spec).split(STACK_SEPARATOR)
    options: set[str] = {"keep"}
    for name in names:
        if name in vitrim.vlm.methods():
            options |= set(vitrim.vlm.method_info(name).defaults)
    own, engine = {}, {}
    for key, value in model_args.items():
        if key in OWN or key in options or key not in engine_fields:
            own[key] = value
        elif key in ("model", "hf_overrides"):
            raise ValueError(
                f"model_args {key}=...: vitrim_vllm sets it (pretrained=<folder>, method=<name>, keep=<tokens>)"
            )
        else:
            engine[key] = option_value(value) if isinstance(value, str) else value
    engine = {k: list(v) if isinstance(v, tuple) else v for k, v in engine.items()}
    return own, engine


def served_architecture(model_type: str) -> str:
    """The plugin's architecture for checkpoints of ``model_type``; ``ValueError`` for one it does not serve."""
    from vitrim.vlm.families import served_architectures

    found = [a.name for a in served_architectures().values() if a.model_type == model_type]
    if not found:
        served = ", ".join(sorted({a.model_type for a in served_architectures().values()}))
        raise ValueError(f"model_args pretrained: model_type {model_type!r}; vitrim's plugin serves {served}")
    return found[0]


class VitrimVLLMModel(lmms):
    """A checkpoint served by ``vllm.LLM`` with vitrim's plugin (module doc)."""

    is_simple = True

    def __init__(self, max_batch_size: Any = None, **model_args: Any) -> None:
        import transformers

        import vllm

        super().__init__()
        own, engine = split_arguments(model_args)
        self.arguments = parse_model_args(own)
        plan = self.arguments.plan
        if self.arguments.pretrained in ("digits", "digits_video"):
            raise ValueError(
                f"model_args pretrained={self.arguments.pretrained}: vLLM serves checkpoint folders; use --model vitrim"
            )
        if len(plan.methods) > 1:
            raise ValueError(f"model_args method={plan.described()['method']!r}: vitrim's plugin runs one method")
        if plan.methods:
            from vitrim.vllm.options import pre_llm_methods, video_methods

            name = plan.methods[0][0]
            if name not in pre_llm_methods() + video_methods():
                offered = ", ".join(pre_llm_methods() + video_methods())
                raise ValueError(f"model_args method={name!r}: vitrim's plugin serves {offered}")
        config = transformers.AutoConfig.from_pretrained(self.arguments.pretrained, local_files_only=True)
        overrides = None
        if plan.methods:
            name, options = plan.methods[0]
            architecture = served_architecture(config.model_type)
            overrides = {"architectures": [architecture], "vitrim": {"method": name, **jsonable(options)}}
        self.engine_arguments = {"dtype": self.arguments.dtype, "seed": 0, **engine}
        self.llm = vllm.LLM(model=self.arguments.pretrained, hf_overrides=overrides, **self.engine_arguments)
        processor = transformers.AutoProcessor.from_pretrained(self.arguments.pretrained, local_files_only=True)
        self.prompter = TransformersPrompter(processor, self.arguments.dtype)
        with torch.device("meta"):  # the shapes only, for the prefill count
            shapes_model = transformers.AutoModelForImageTextToText.from_config(config)
        self.image_id = image_token_id(shapes_model)
        self.counter = counter_for(shapes_model)
        self.settings = {
            "model": self.arguments.pretrained,
            **method_settings(plan),
            "processor": self.prompter.settings.processor,
            "pixels": self.prompter.settings.pixels,
            "dtype": self.arguments.dtype,
            "served_by": f"vllm {vllm.__version__}",
            "hf_overrides": overrides,
            "engine": json.loads(json.dumps(self.engine_arguments, default=str)),
            "prefill_macs_counted": self.counter.counted,
        }
        self.batch_size = self.arguments.batch_size
        self._rank, self._world_size = 0, 1

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """Greedy answers to ``requests``, ``batch_size`` prompts per ``LLM.generate`` (grouped by generation
        settings, as lmms-eval's ``Collator`` groups them), with their records, in the requests' order."""
        return answer_in_batches(self, requests, self._pictures, self._answer)

    def _pictures(self, visuals: Any) -> list[Any]:
        found = [v for v in as_list(visuals) if v is not None]
        videos = [v for v in found if is_video(v)]
        if videos:
            raise ValueError(f"vitrim_vllm takes pictures; the task hands it a video ({videos[0]!r:.80})")
        return [rgb(v) for v in found]

    def _answer(self, questions: list[str], pictures: list[list[Any]], settings: dict[str, Any]) -> list[Any]:
        from vllm import SamplingParams

        until = settings.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        if float(settings.get("temperature", 0) or 0) > 0 or settings.get("do_sample"):
            raise ValueError("vitrim's lmms-eval model answers greedily; the task asks for sampling (temperature > 0)")
        max_new = int(settings.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        if self.arguments.max_new_tokens is not None:
            max_new = min(max_new, self.arguments.max_new_tokens)
        prompts = []
        for question, group in zip(questions, pictures, strict=True):
            prompt: dict[str, Any] = {"prompt": self.prompter.prompt(question, group)}
            if group:
                prompt["multi_modal_data"] = {"image": group if len(group) > 1 else group[0]}
            prompts.append(prompt)
        outputs = self.llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0), use_tqdm=False)
        return [
            GenerationResult(cut(output.outputs[0].text.strip(), until), self._record(prompt, group, output))
            for prompt, group, output in zip(prompts, pictures, outputs, strict=True)
        ]

    def _record(self, prompt: dict[str, Any], pictures: list[Any], output: Any) -> SampleCounts:
        """The sample's record: the dense prompt from the processor, what entered from vLLM's own prompt."""
        dense = self.prompter.processor(
            images=[pictures] if pictures else None, text=[prompt["prompt"]], return_tensors="pt"
        )
        [image], _, [text] = prompt_counts(dense["input_ids"], dense.get("attention_mask"), self.image_id)
        grids = dense.get("image_grid_thw")
        grid = [int(n) for n in grids[0].tolist()] if grids is not None else None
        macs = sample_macs(self.counter, self.arguments.plan, len(pictures), 0, grid, text)
        record = {
            "image_tokens": image,
            "image_tokens_entering_llm": len(output.prompt_token_ids) - text,
            "image_tokens_kept": None,
            "text_tokens": text,
            "prefill_macs": macs["method"],
            "dense_prefill_macs": macs["dense"],
            "prefill_macs_ratio": macs["ratio"],
            **({"prefill_macs_not_counted": macs["reason"]} if "reason" in macs else {}),
            "settings": self.settings,
        }
        generated = len(output.outputs[0].token_ids)
        return SampleCounts(input_tokens=len(output.prompt_token_ids), output_tokens=generated, vitrim=record)

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("vitrim's lmms-eval model generates answers (output_type: generate_until) only")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("vitrim's lmms-eval model answers one round (output_type: generate_until) only")

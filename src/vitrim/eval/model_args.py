"""``--model_args`` of ``lmms-eval --model vitrim``: which checkpoint, which methods with which options.

lmms-eval splits ``--model_args`` on commas (outside brackets and quotes) into ``name=value`` and turns each value
into a bool, int, float or string. What reaches :func:`method_plan` is that dict, less the arguments of the model
itself (:data:`MODEL_ARGUMENTS`). The rest describes the methods:

- ``method=visionzip,keep=64,dominant=54``: one method with its options (``vitrim.vlm.apply(model, "visionzip",
  keep=64, dominant=54)``);
- ``method=tome_tower+fastv,tome_tower.keep=0.5,fastv.keep=64,fastv.layer=2``: stacked methods (one per stage, in
  any order: :mod:`vitrim.vlm.stacking` runs them tower -> pre-LLM -> in-LLM), each option prefixed by its method;
- a list or tuple option in brackets, as JSON: ``ratios=[0.5,0.25,0.125]``;
- ``method=none`` (or no ``method``): the dense model.

Every name and value is checked here, before a model is loaded; ``vitrim.vlm.apply`` checks each method's own
options (one line naming the option, the value and what was expected).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

NONE = "none"
STACK_SEPARATOR = "+"


@dataclass(frozen=True)
class MethodPlan:
    """The methods to apply, in the order given, each with its options (as ``vitrim.vlm.apply`` takes them)."""

    methods: tuple[tuple[str, dict[str, Any]], ...] = ()

    def described(self) -> dict[str, Any]:
        """What the results file records: ``{"method": "a+b", "options": {"a": {...}, "b": {...}}}``."""
        return {
            "method": STACK_SEPARATOR.join(name for name, _ in self.methods) or NONE,
            "options": {name: _plain(options) for name, options in self.methods},
        }


@dataclass(frozen=True)
class ModelArguments:
    """The model's own arguments: ``pretrained`` (a folder, a hub name the cache holds, ``digits`` for the shipped
    digits VLM, or ``digits_video`` for the shipped digits video model), ``batch_size``, ``device``, ``dtype``,
    ``max_new_tokens`` (a cap on top of a task's ``generation_kwargs``), pixel settings for Qwen's processors
    (``min_pixels``, ``max_pixels``; a video's frames: ``video_min_pixels``, ``video_max_pixels``), a video's frame
    sampling (:mod:`vitrim.eval.video`: ``max_num_frames``, default 32 as lmms-eval's Qwen models; ``fps``, default
    None: ``max_num_frames`` evenly spaced)."""

    pretrained: str
    batch_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    max_num_frames: int = 32
    fps: float | None = None
    plan: MethodPlan = field(default_factory=MethodPlan)


COUNTS = ("max_new_tokens", "min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "max_num_frames")
MODEL_ARGUMENTS = ("pretrained", "batch_size", "device", "dtype", "fps", *COUNTS)
DTYPES = ("float32", "float16", "bfloat16", "float64")


def parse_model_args(arguments: dict[str, Any]) -> ModelArguments:
    """lmms-eval's parsed ``--model_args`` (module doc) -> :class:`ModelArguments`; ``ValueError`` naming the bad
    argument."""
    rest = dict(arguments)
    own = {name: rest.pop(name) for name in MODEL_ARGUMENTS if name in rest}
    if "pretrained" not in own:
        raise ValueError(
            "model_args needs pretrained=<checkpoint folder, 'digits' or 'digits_video' for the shipped digits models>"
        )
    pretrained = own["pretrained"]
    if not isinstance(pretrained, str) or not pretrained:
        raise ValueError(
            f"model_args pretrained={pretrained!r}: expected a checkpoint folder, 'digits' or 'digits_video'"
        )
    batch_size = own.get("batch_size", 1)
    if isinstance(batch_size, str) and batch_size.isdigit():
        batch_size = int(batch_size)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"model_args batch_size={batch_size!r}: expected an int >= 1")
    dtype = own.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"model_args dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    counts = {}
    for name in COUNTS:
        value = own.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"model_args {name}={value!r}: expected an int >= 1")
        counts[name] = value
    frames = counts.pop("max_num_frames") or ModelArguments.max_num_frames
    fps = own.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0):
        raise ValueError(f"model_args fps={fps!r}: expected a number > 0 (frames sampled per second of video)")
    return ModelArguments(
        pretrained=pretrained,
        batch_size=batch_size,
        device=str(own.get("device", "cpu")),
        dtype=dtype,
        max_num_frames=frames,
        fps=None if fps is None else float(fps),
        plan=method_plan(rest),
        **counts,
    )


def method_plan(arguments: dict[str, Any]) -> MethodPlan:
    """The ``method=`` argument and the methods' options (module doc) -> :class:`MethodPlan`."""
    from vitrim.vlm import methods as known_methods

    rest = {name: option_value(value) for name, value in arguments.items()}
    spec = rest.pop("method", NONE)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model_args method={spec!r}: expected a method of vitrim.vlm, or several joined by '+'")
    names = [] if spec == NONE else spec.split(STACK_SEPARATOR)
    known = known_methods()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"model_args method={spec!r}: unknown method(s) {unknown}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"model_args method={spec!r}: a method is named twice")
    options: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, value in rest.items():
        owner, dot, option = key.partition(".")
        if dot:
            if owner not in options:
                raise ValueError(
                    f"model_args {key}={value!r}: {owner!r} is not one of the methods asked for ({spec!r})"
                )
            options[owner][option] = value
        elif len(names) == 1:
            options[names[0]][key] = value
        elif not names:
            raise ValueError(f"model_args {key}={value!r}: an option without method=<name> (the dense model)")
        else:
            raise ValueError(
                f"model_args {key}={value!r}: with stacked methods ({spec!r}) prefix each option by its method, "
                f"e.g. {names[0]}.{key}={value}"
            )
    return MethodPlan(tuple((name, options[name]) for name in names))


def option_value(value: Any) -> Any:
    """A bracketed string (``[0.5,0.25]``) as JSON, lists as tuples (the methods' options are tuples); else as is."""
    if isinstance(value, str) and value[:1] in "[{" and value:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"model_args value {value!r}: not valid JSON ({err.msg})") from None
        return tuple(parsed) if isinstance(parsed, list) else parsed
    return value


def _plain(value: Any) -> Any:
    """Options as JSON writes them (tuples as lists)."""
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value

"""One call for fast inference: ``vitrim.optimize(model, batch_size=B, device=...)`` -> a graph-captured model.

    fast = vitrim.optimize(model, batch_size=1, device="cuda", dtype=torch.bfloat16)
    logits = fast(images)                     # images (1, 3, 224, 224) on the GPU; the first call compiles

What it does, and why it pays where eager mode does not:

* **Static shapes.** A reducer's token counts depend only on the input's shape (ToMe removes r per block, DynamicViT
  keeps int(P · ρ^s), EViT and top-k ⌈n · rate⌉): the data decide *which* tokens go, never *how many*. So a model of
  one batch size and image size is one fixed graph, and ``torch.compile(fullgraph=True, dynamic=False)`` captures it
  whole, once: calls of that shape never recompile. Every registered reducer compiles with no graph break (the
  deployment tests sweep them). A reducer whose counts would depend on the data declares ``static_counts = False``
  and is refused here, with its name, rather than recompiled on every call.
* **CUDA graphs.** On a GPU the default mode is ``"reduce-overhead"``: Inductor records the whole forward as a CUDA
  graph and replays it, so a batch-1 forward costs one launch instead of hundreds of host calls (the cost that makes
  reducers slower than dense in eager mode at batch 1). Outputs of a replay are copied out (``(B, classes)``, a few
  bytes), so a later call never overwrites logits the caller still holds.
* **Inference only.** The model is put in eval mode and runs under ``torch.inference_mode``, without provenance
  (``forward`` records none); ``dtype=torch.bfloat16`` runs it under autocast (weights stay float32).

Calls with another batch size or image size are refused (``ValueError``): optimise again for another shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.devices import parse_device
from vitrim.models.layers import to_2tuple

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class OptimizedModel(nn.Module):
    """A model compiled for one input shape (see module doc). ``model`` is the eager model it wraps."""

    def __init__(
        self,
        model: nn.Module,
        compiled: Callable[[Tensor], Tensor],
        input_shape: tuple[int, int, int, int],
        device: torch.device,
        dtype: torch.dtype | None,
        copy_outputs: bool,
    ) -> None:
        super().__init__()
        self.model = model
        self._compiled = compiled
        self.input_shape = input_shape
        self.device = device
        self.dtype = dtype
        self.copy_outputs = copy_outputs

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C, H, W) of exactly the optimised shape, on the optimised device -> logits (B, classes)."""
        if not isinstance(images, Tensor):
            raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
        if tuple(images.shape) != self.input_shape:
            raise ValueError(
                f"images of shape {tuple(images.shape)}, but the model was optimized for {self.input_shape} "
                "(batch, channels, height, width); call vitrim.optimize again for another shape"
            )
        if _same_device(images.device) != self.device:
            raise ValueError(f"images on {images.device}, but the model was optimized for {self.device}")
        weight = next(self.model.parameters(), None)
        expected = weight.dtype if weight is not None else torch.float32
        if images.dtype != expected:
            raise TypeError(
                f"images have dtype {images.dtype}, but the model was optimized for {expected} inputs"
                + (f" (run under autocast to {self.dtype})" if self.dtype is not None else "")
                + "; convert them with images.to("
                + str(expected)
                + ")"
            )
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)
        with torch.inference_mode(), autocast:
            out = self._compiled(images)
        return out.clone() if self.copy_outputs else out


def optimize(
    model: nn.Module,
    *,
    batch_size: int,
    device: str | torch.device = "cpu",
    mode: str | None = None,
    dtype: torch.dtype | None = None,
    img_size: int | tuple[int, int] | None = None,
    backend: str | Callable[..., Any] = "inductor",
    warmup: int = 0,
) -> OptimizedModel:
    """The model (any vitrim ViT, with or without reducers) compiled for inputs (batch_size, C, H, W) on ``device``.

    Args:
        model: moved to ``device`` and put in eval mode (in place).
        batch_size: the one batch size it will be called with.
        device: "cpu", "cuda" or "cuda:N".
        mode: ``torch.compile``'s mode; None: "reduce-overhead" (CUDA graphs) on a GPU, "default" on the CPU.
        dtype: None: the weights' dtype; ``torch.bfloat16`` or ``torch.float16``: autocast to it.
        img_size: the image side(s); None: the model's own (``model.config.img_size``).
        backend: ``torch.compile``'s backend ("inductor"; tests use "aot_eager", which skips the C++ build).
        warmup: calls made here on random images, so that compiling (and CUDA-graph recording, which takes a
            few calls) happens now rather than on the caller's first images.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    target = _same_device(parse_device(device))
    _check_backend(backend)
    if mode is None:
        mode = "reduce-overhead" if target.type == "cuda" else "default"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be None, torch.bfloat16 or torch.float16, got {dtype!r}")
    _check_reducers(model)
    config = getattr(model, "config", None)
    size = img_size if img_size is not None else getattr(config, "img_size", None)
    if size is None:
        raise ValueError(f"img_size: {type(model).__name__} has no config.img_size; pass img_size=(H, W)")
    h, w = to_2tuple(size, "img_size")
    patch = getattr(config, "patch_size", 1)
    if h % patch or w % patch:
        raise ValueError(f"img_size {size!r} is not divisible by the model's patch size {patch}")
    shape = (batch_size, int(getattr(config, "in_chans", 3)), int(h), int(w))
    model = model.to(target).eval()
    _make_room_for_one_more()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, mode=mode, backend=backend)
    cuda_graphs = target.type == "cuda" and mode in ("reduce-overhead", "max-autotune")
    fast = OptimizedModel(model, compiled, shape, target, dtype, copy_outputs=cuda_graphs)
    images = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(target)
    for _ in range(warmup):
        fast(images)
    return fast


_optimized = 0  # models optimised in this process


def _same_device(device: torch.device) -> torch.device:
    """One name per device: ``cpu:0`` is ``cpu`` (as tensors report it), ``cuda`` is ``cuda:<current>``."""
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_backend(backend: object) -> None:
    """A callable, or one of ``torch._dynamo.list_backends()`` (refused here, not deep inside torch.compile)."""
    if callable(backend):
        return
    known = sorted(torch._dynamo.list_backends(exclude_tags=None))
    if not isinstance(backend, str) or backend not in known:
        raise ValueError(f"backend must be a torch.compile backend, one of {known}, or a callable; got {backend!r}")


def _make_room_for_one_more() -> None:
    """Every optimised model is one more entry in dynamo's cache of the same code (``VisionTransformer.forward``);
    past its recompile limit (8) dynamo would refuse the next, which ``fullgraph=True`` turns into an error. The
    limit is raised to fit every optimised model: each holds one graph and never recompiles."""
    global _optimized
    _optimized += 1
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < _optimized + 8:
        setattr(config, name, _optimized + 8)


def _check_reducers(model: nn.Module) -> None:
    """Refuse a model whose reducers' token counts depend on the data (see module doc)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"model must be a vitrim ViT (with .blocks), got {type(model).__name__}")
    for index, block in enumerate(blocks):
        reducer = getattr(block, "reducer", None)
        if reducer is not None and not getattr(reducer, "static_counts", True):
            raise ValueError(
                f"block {index}'s reducer {reducer!r} keeps a data-dependent number of tokens (static_counts=False): "
                "a graph captured for one shape cannot hold it; run that model in eager mode"
            )

"""Export a vitrim model to ONNX with torch's dynamo exporter: every model kind, a dynamic batch size.

    from vitrim.export import export_onnx
    export_onnx(model, "model.onnx")          # input "images" (B, C, H, W) float32, output "logits" (B, classes)

Token counts are static per stage for every reducer (DynamicViT keeps ``int(P · ρ^s)``, ToMe removes ``r`` per block,
EViT and top-k keep ``⌈n · rate⌉``), so a reduced model is an ordinary static graph: the data decide *which* tokens
are kept or merged, never *how many*. The batch dimension stays symbolic; the image size is the one given (or the
model's own), since the token counts, and hence the graph, depend on it.

The model is exported in evaluation mode (training-time DynamicViT masks tokens and samples Gumbel noise; that is
not a deployment graph). The one operator the exporter lacks is ``aten::sort.stable`` (EViT and top-k rank tokens
with a stable sort, ToMe its matches); it is translated to ONNX ``TopK`` over the whole axis, which the ONNX
specification defines to return equal values in index order, exactly what a stable sort returns.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitrim.atomic import atomic_write
from vitrim.extras import require

INPUT_NAME = "images"
OUTPUT_NAME = "logits"


def export_onnx(
    model: nn.Module,
    path: str | Path,
    *,
    img_size: int | tuple[int, int] | None = None,
    batch_size: int = 2,
    dynamic_batch: bool = True,
    opset_version: int | None = None,
) -> Path:
    """Write ``model`` (any vitrim ViT, with or without token reducers) to ``path`` as ONNX; return the path.

    Args:
        model: the model; exported in eval mode, and left in the mode it was in.
        path: the ``.onnx`` file to write (weights inside it).
        img_size: image side or (H, W) of the graph's input; default the model's own ``config.img_size``.
        batch_size: the batch of the example input used for tracing (any B works at run time if ``dynamic_batch``).
        dynamic_batch: keep the batch dimension symbolic (named ``batch``).
        opset_version: ONNX opset; default torch's.

    Raises:
        ValueError: for an image size the model cannot take, a batch size below 1, or an opset the exporter cannot
            write this model in (the file is then not written, and one already at ``path`` is left as it was).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if opset_version is not None and (isinstance(opset_version, bool) or not isinstance(opset_version, int)):
        raise TypeError(f"opset_version must be an int or None, got {opset_version!r}")
    require("onnx", "onnxscript", feature="ONNX export")
    example = example_input(model, img_size, batch_size)
    path = Path(path)
    dynamic_shapes = ({0: torch.export.Dim("batch", min=1, max=65536)},) if dynamic_batch else None
    with _eval_mode(model), torch.no_grad(), _quiet_version_converter():
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=dynamic_shapes,
            opset_version=opset_version,
            custom_translation_table=_translations(),
            verbose=False,
        )
    if program is None:  # pragma: no cover - the dynamo exporter always returns a program
        raise RuntimeError("torch.onnx.export returned no program")
    written = program.model.opset_imports.get("")
    if opset_version is not None and written != opset_version:
        # torch writes opset 18 and converts to the version asked; where no converter exists for an operator of this
        # model it logs the failure and keeps 18: refuse, rather than write a file of another version than asked
        raise ValueError(
            f"opset_version {opset_version} is not available for this model: the exporter could only write opset "
            f"{written} (it writes 18 and converts to other versions where every operator has a converter)"
        )
    return atomic_write(path, lambda tmp: program.save(str(tmp), external_data=False))


def example_input(model: nn.Module, img_size: int | tuple[int, int] | None, batch_size: int) -> Tensor:
    """A random (B, C, H, W) image batch on the model's device, at ``img_size`` or the model's own size."""
    config = getattr(model, "config", None)
    size = img_size if img_size is not None else getattr(config, "img_size", None)
    if size is None:
        raise ValueError(f"img_size is required for a model without config.img_size ({type(model).__name__})")
    h, w = (size, size) if isinstance(size, int) else size
    patch = getattr(config, "patch_size", 1)
    if h <= 0 or w <= 0 or h % patch or w % patch:
        raise ValueError(f"img_size {size!r} must be positive and divisible by the patch size {patch}")
    chans = getattr(config, "in_chans", 3)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    return torch.randn(batch_size, chans, h, w, generator=torch.Generator().manual_seed(0)).to(device)


@contextlib.contextmanager
def _quiet_version_converter() -> Iterator[None]:
    """Silence onnxscript's converter, which logs a traceback when it cannot reach the opset asked for, and torch's
    exporter, which warns that it will try: the check after the export turns that case into one clear error, with
    nothing else on stderr. Python warnings raised meanwhile are shown only if the export succeeds."""
    loggers = [logging.getLogger(name) for name in ("onnxscript.version_converter", "torch.onnx")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for category in (FutureWarning, DeprecationWarning):  # torch's notes to itself (the exporter's own
                warnings.simplefilter("ignore", category)  # catch_warnings would print them past the record)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    for warning in caught:  # reached only when the export succeeded
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _translations() -> dict[Any, Any]:
    """ONNX translations for the aten ops the exporter has none for (see module doc)."""
    from onnxscript import opset18 as op

    def sort_stable(self: Any, stable: bool | None = None, dim: int = -1, descending: bool = False) -> Any:
        # TopK over the whole axis; ONNX breaks ties by the lower index, which is what a stable sort keeps.
        length = op.Shape(self, start=dim, end=dim + 1) if dim != -1 else op.Shape(self, start=-1)
        return op.TopK(self, length, axis=dim, largest=descending, sorted=True)

    return {torch.ops.aten.sort.stable: sort_stable}


def compare_with_onnxruntime(
    model: nn.Module,
    path: str | Path,
    *,
    batch_sizes: tuple[int, ...] = (1, 3),
    img_size: int | tuple[int, int] | None = None,
) -> float:
    """Run the ONNX file in onnxruntime (CPU) and the model in PyTorch on the same random images; the max |Δ logit|.

    Needs ``onnxruntime`` (``pip install 'vitrim[export]'``). Each batch size is one call of both.
    """
    require("onnxruntime", feature="comparing with onnxruntime")
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst = 0.0
    with _eval_mode(model), torch.no_grad():
        for batch in batch_sizes:
            images = example_input(model, img_size, batch)
            expected = model(images).float().cpu()
            (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: images.cpu().numpy()})
            worst = max(worst, float((torch.from_numpy(got) - expected).abs().max()))
    return worst

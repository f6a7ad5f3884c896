"""Token reduction inside transformers vision-language models: before the LLM, inside it, inside the vision tower.

::

    vitrim.vlm.apply(model, "visionzip", keep=64)     # the user's LlavaForConditionalGeneration, as it is
    out = model.generate(**processor(images=images, text=prompts, return_tensors="pt", padding=True))
    vitrim.vlm.last_selection(model)                  # per image: the kept image-token indices (raster order)
    vitrim.vlm.remove(model)                          # the model as it was

Importing this package does not import transformers; the hooks work on the instance the caller holds.
"""

from vitrim.vlm import (  # noqa: F401  (each registers its method)
    method_dart,
    method_divprune,
    method_fastervlm,
    method_fastv,
    method_pdrop,
    method_random,
    method_visionzip,
    method_vispruner,
)
from vitrim.vlm.api import apply, last_selection, remove
from vitrim.vlm.registry import methods

__all__ = ["apply", "last_selection", "methods", "remove"]

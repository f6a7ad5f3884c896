"""Token reduction inside transformers vision-language models: before the LLM, inside it, inside the vision tower.

::

    vitrim.vlm.apply(model, "visionzip", keep=64)     # the user's LlavaForConditionalGeneration, as it is
    out = model.generate(**processor(images=images, text=prompts, return_tensors="pt", padding=True))
    vitrim.vlm.last_selection(model)                  # per image: the kept image-token indices (raster order)
    vitrim.vlm.remove(model)                          # the model as it was

The house: :mod:`vitrim.vlm.method` (each method's selection, a function of tensors, one file each),
:mod:`vitrim.vlm.stages` (the three places a model sheds tokens: before the LLM, inside it, in the tower) and
:mod:`vitrim.vlm.families` (each model family's seams, one declared contract). Importing this package does not
import transformers; the hooks work on the instance the caller holds.
"""

from vitrim.vlm.api import apply, last_selection, remove
from vitrim.vlm.method import MethodInfo, method_info, methods

__all__ = ["MethodInfo", "apply", "last_selection", "method_info", "methods", "remove"]


def __dir__() -> list[str]:
    """The API, not the modules the package is made of."""
    return sorted(__all__)

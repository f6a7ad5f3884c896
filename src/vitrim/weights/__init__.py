"""Every way weights arrive: files of every format, Hugging Face layouts, the hub, timm's names and tags, models in
memory. ``load_model`` builds a model from any of them; ``load_checkpoint`` loads weights into a model you built."""

from vitrim.weights.checkpoint import CheckpointMismatchError, LoadResult, load_checkpoint, save_checkpoint
from vitrim.weights.formats import RawCheckpoint, read_checkpoint
from vitrim.weights.in_memory import from_timm, from_transformers
from vitrim.weights.pretrained import load_model

__all__ = [
    "CheckpointMismatchError",
    "LoadResult",
    "RawCheckpoint",
    "from_timm",
    "from_transformers",
    "load_checkpoint",
    "load_model",
    "read_checkpoint",
    "save_checkpoint",
]

"""Training: the loop, DDP under torchrun, AdamW + warm-up/cosine, atomic checkpoints and exact resume."""

from vitrim.train.evaluate import evaluate
from vitrim.train.loop import TrainConfig, train

__all__ = ["TrainConfig", "evaluate", "train"]

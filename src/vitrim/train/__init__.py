"""Training: the loop, DDP under torchrun, AdamW + warm-up/cosine, atomic checkpoints and exact resume."""

from vitrim.train.checkpoint_eval import evaluate_checkpoint
from vitrim.train.config import TrainConfig
from vitrim.train.evaluate import evaluate
from vitrim.train.loop import train
from vitrim.train.objective import CrossEntropyObjective, Objective

__all__ = ["CrossEntropyObjective", "Objective", "TrainConfig", "evaluate", "evaluate_checkpoint", "train"]

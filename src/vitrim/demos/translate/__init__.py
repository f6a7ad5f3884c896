"""Translation with cross-attention: the number-words task as tensors, training, scores, the demo and its report."""

"""Tiny random text-only LLMs (float64) the in-LLM drop is tested on directly, without a tower: a Llama and a Qwen2,
with attention scores far from uniform; token ids 0 pad, 1 begin, 2 end, prompts from 3 up to VOCAB."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 64


def tiny_llama(seed: int = 0, layers: int = 4, implementation: str = "sdpa"):
    """A random Llama (float64) with attention scores far from uniform (init range 0.3), so rankings are clear."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, attn_implementation=implementation,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double().eval()


def tiny_qwen2(seed: int = 0, layers: int = 3, implementation: str = "sdpa"):
    """A random Qwen2 (float64): Llama's layout with q/k/v biases."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, attn_implementation=implementation,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config).double().eval()

"""The evidence floor: the tensor maths that turns a vision tower's (or an LLM layer's) outputs into what a method
reads, in pure torch (this package imports nothing of transformers or vLLM, nor anything of vitrim above it).

Every engine computes its queries and keys its own way (transformers' separate ``q_proj``/``k_proj``, vLLM's fused
``qkv``, each with its own rotary op); from there on the maths is one function each, here:

- :mod:`~vitrim.vlm.evidence.attention`: [CLS]'s attention row and the keys (CLIP), the attention each token receives
  (towers without [CLS]: SigLIP, Qwen's packed windows);
- :mod:`~vitrim.vlm.evidence.merged_tokens`: Qwen's merger groups in the LLM's index space (window order undone,
  split per image, each image's token grid), and the temporal patches of a video;
- :mod:`~vitrim.vlm.evidence.pooled`: Gemma 3's pooled cells;
- :mod:`~vitrim.vlm.evidence.columns`: a tensor read per sample at given columns (shortened sequences, slots);
- :mod:`~vitrim.vlm.evidence.llm_layer`: what an in-LLM method reads at its drop layer;
- :mod:`~vitrim.vlm.evidence.seeds`: a number drawn from an image's own pixels (the seeded methods).
"""

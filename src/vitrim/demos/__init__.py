"""The demos: what the library does, on models small enough to train and run on a laptop's CPU.

:mod:`~vitrim.demos.vision` (``vitrim demo``: ViTs and DynamicViT on digits, reported by
:mod:`~vitrim.demos.vision_report`), :mod:`~vitrim.demos.translate` (``vitrim demo translate``: cross-attention) and
:mod:`~vitrim.demos.vlm` (``vitrim demo vlm``: a digits LLaVA and every method of :mod:`vitrim.vlm`). Their trained
weights ship in the package (:mod:`vitrim.shipped`).
"""

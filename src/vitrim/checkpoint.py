"""Deprecated (one release): moved to :mod:`vitrim.weights.checkpoint`."""

from vitrim.moved import moved_to

__getattr__ = moved_to(__name__, "vitrim.weights.checkpoint", {"load_model": "vitrim.weights.pretrained:load_model"})

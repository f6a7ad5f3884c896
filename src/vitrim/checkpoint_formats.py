"""Deprecated (one release): moved to :mod:`vitrim.weights.formats`."""

from vitrim.moved import moved_to

__getattr__ = moved_to(__name__, "vitrim.weights.formats", {"HF_WEIGHT_FILES": "vitrim.weights.formats:WEIGHT_FILES"})

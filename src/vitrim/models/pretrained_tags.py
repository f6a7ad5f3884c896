"""Deprecated (one release): moved to :mod:`vitrim.weights.tags`."""

from vitrim.moved import moved_to

__getattr__ = moved_to(__name__, "vitrim.weights.tags")

"""Deprecated (one release): moved to :mod:`vitrim.weights.hub`."""

from vitrim.moved import moved_to

__getattr__ = moved_to(__name__, "vitrim.weights.hub")

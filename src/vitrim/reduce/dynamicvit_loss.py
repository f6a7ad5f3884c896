"""Deprecated (one release): DynamicViT's loss moved to :mod:`vitrim.losses`."""

from vitrim.moved import moved_to

__getattr__ = moved_to(__name__, "vitrim.losses")

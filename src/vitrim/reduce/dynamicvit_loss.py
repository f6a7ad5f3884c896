"""Deprecated (one release): DynamicViT's loss moved to :mod:`vitrim.losses`."""

import vitrim.losses as _home
from vitrim.moved import moved_to

__getattr__ = moved_to(__name__, _home)

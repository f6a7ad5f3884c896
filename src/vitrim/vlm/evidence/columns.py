"""A tensor read per sample at given columns: what every shortened sequence and every set of slots is made of."""

from __future__ import annotations

from torch import Tensor


def expand_batch(tensor: Tensor, batch: int, dim: int) -> Tensor:
    """``tensor`` with its batch dimension ``dim`` (of size 1 or ``batch``) expanded to ``batch``."""
    shape = list(tensor.shape)
    shape[dim] = batch
    return tensor.expand(shape)


def gather_columns(tensor: Tensor, columns: Tensor, dim: int, batch_dim: int) -> Tensor:
    """``tensor`` (batch B or 1 at ``batch_dim``, sequence at ``dim``) read per sample at ``columns`` (B, S): the
    same tensor with S in place of the sequence length."""
    dim, batch_dim = dim % tensor.ndim, batch_dim % tensor.ndim
    tensor = expand_batch(tensor, columns.shape[0], batch_dim)
    view = [1] * tensor.ndim
    view[batch_dim], view[dim] = columns.shape
    shape = list(tensor.shape)
    shape[dim] = columns.shape[1]
    return tensor.gather(dim, columns.view(view).expand(shape))

"""attnkit.nn: drop-in attention layers built on the attnkit ops.

- :class:`MultiheadAttention` -- a drop-in for :class:`torch.nn.MultiheadAttention` on
  :func:`attnkit.softmax_attention`.

(Sparse, linear and Hopfield layers arrive with their kernel issues.)
"""
from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention"]

"""attnkit.nn: drop-in attention layers built on the attnkit ops.

- :class:`MultiheadAttention` -- a drop-in for :class:`torch.nn.MultiheadAttention` on
  :func:`attnkit.softmax_attention`.
- :class:`Hopfield`, :class:`HopfieldPooling`, :class:`HopfieldLayer` -- the layers of the
  hopfield-layers package, on :func:`attnkit.hopfield_update`.

- :class:`LinearAttention` -- projections + heads on :func:`attnkit.linear_attention`.
- :class:`SparseSelfAttention` -- projections + heads (each with its own pattern, if wanted) on
  :func:`attnkit.sparse_attention`.
"""
from .hopfield import Hopfield, HopfieldLayer, HopfieldPooling
from .linear import LinearAttention
from .multihead import MultiheadAttention
from .sparse import SparseSelfAttention

__all__ = ["MultiheadAttention", "LinearAttention", "SparseSelfAttention", "Hopfield", "HopfieldPooling", "HopfieldLayer"]

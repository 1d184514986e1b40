"""attnkit.nn: drop-in attention layers built on the attnkit ops.

- :class:`MultiheadAttention` -- a drop-in for :class:`torch.nn.MultiheadAttention` on
  :func:`attnkit.softmax_attention`.
- :class:`Hopfield`, :class:`HopfieldPooling`, :class:`HopfieldLayer` -- the layers of the
  hopfield-layers package, on :func:`attnkit.hopfield_update`.

(Sparse and linear attention layers arrive with their kernel issues.)
"""
from .hopfield import Hopfield, HopfieldLayer, HopfieldPooling
from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention", "Hopfield", "HopfieldPooling", "HopfieldLayer"]

"""attnkit.nn: drop-in attention layers built on the attnkit ops.

- :class:`MultiheadAttention` -- a drop-in for :class:`torch.nn.MultiheadAttention` on
  :func:`attnkit.softmax_attention`.
- :class:`Hopfield`, :class:`HopfieldPooling`, :class:`HopfieldLayer` -- the layers of the
  hopfield-layers package, on :func:`attnkit.hopfield_update`.

- :class:`LinearAttention` -- projections + heads on :func:`attnkit.linear_attention`.

(The sparse attention layer arrives with the sparse kernels.)
"""
from .hopfield import Hopfield, HopfieldLayer, HopfieldPooling
from .linear import LinearAttention
from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention", "LinearAttention", "Hopfield", "HopfieldPooling", "HopfieldLayer"]

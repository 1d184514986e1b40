"""attnkit: fused softmax, linear, sparse and Hopfield attention kernels for PyTorch.

Public API.  Shapes: :func:`softmax_attention` takes SDPA's ``[..., H, N, D]`` (any number of
leading batch dims, broadcast together; ``[N, D]`` works too); every other op takes exactly
``[B, H, N, D]`` (``linear_attention_step``: ``[B, H, D]``) and raises ValueError for other ranks,
naming the expected layout and the shape it got.  NaN and ±Inf propagate like SDPA's (never
silently dropped); a fully masked row gives 0.

- :func:`softmax_attention` — a drop-in for ``scaled_dot_product_attention``
- :func:`linear_attention` — kernelized attention φ(q)·Σφ(k)vᵀ, causal or not
- :func:`sparse_attention` with :mod:`attnkit.patterns` — strided, fixed, star, block layouts
- :func:`hopfield_update`, :func:`hopfield_energy` — the modern Hopfield update and its energy
- :func:`merge_attention_states` — exact merge of two partial results by their log-sum-exps
- :mod:`flash_attn_interface` — FlashAttention 2's Python functions (layout, bottom-right causality) on attnkit
- :func:`backends` — which backends (reference, cpu, triton, cuda) are usable here, per family
"""
import torch  # noqa: F401  (loads libtorch before the native extension)

from . import bert_padding, flash_attn_interface, hopfield, nn, patterns, rotary
from ._dispatch import BackendStatus, BackendUnavailableError, backends
from .ops.hopfield import hopfield_energy, hopfield_update
from .ops.kvcache import attention_with_kvcache
from .ops.linear import linear_attention, linear_attention_step
from .ops.merge import merge_attention_states
from .ops.softmax import softmax_attention
from .ops.sparse import sparse_attention
from .ops.linear_varlen import linear_attention_varlen
from .ops.varlen import softmax_attention_varlen

__version__ = "0.1.0"

__all__ = [
    "softmax_attention",
    "linear_attention",
    "linear_attention_step",
    "sparse_attention",
    "merge_attention_states",
    "softmax_attention_varlen",
    "linear_attention_varlen",
    "attention_with_kvcache",
    "hopfield_update",
    "hopfield_energy",
    "patterns",
    "nn",
    "hopfield",
    "flash_attn_interface",
    "bert_padding",
    "rotary",
    "backends",
    "BackendStatus",
    "BackendUnavailableError",
]

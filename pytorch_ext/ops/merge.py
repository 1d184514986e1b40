"""Merging partial attention results: ``attnkit.merge_attention_states``.

Attention over a key set split in two parts A and B (split-KV decoding, a shared prefix and a
per-request suffix, context parallelism) is the softmax over the union: from each part's output
and log-sum-exp,

    lse = log(exp(lse_a) + exp(lse_b))
    out = (exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b)

computed here without any exp of a large number: with d = lse_b - lse_a,
``w_b = sigmoid(d)``, ``out = lerp(out_a, out_b, w_b)`` and
``lse = max(lse_a, lse_b) - logsigmoid(|d|)``.  The peers: FlashAttention-3's
``flash_attn_combine``, FlashInfer's ``merge_state``.  Plain PyTorch (elementwise: a kernel would
gain nothing over torch's own); differentiable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation import check_tensor

OP_NAME = "attnkit.merge_attention_states"


def merge_weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_b, lse): the weight of part B in the merged output and the merged log-sum-exp, for
    log-sum-exps of the accumulation dtype.  A part with lse -inf (no key) weighs 0; both -inf
    give w_b 0 and lse -inf; a NaN lse gives NaN.  Shared with :mod:`attnkit.distributed`."""
    inf = torch.tensor(float("inf"), dtype=lse_a.dtype, device=lse_a.device)
    d = torch.where(torch.isneginf(lse_b), -inf, torch.where(torch.isneginf(lse_a), inf, lse_b - lse_a))
    return torch.sigmoid(d), torch.maximum(lse_a, lse_b) - F.logsigmoid(d.abs())


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attention results over disjoint key sets.

    Args:
        out_a, out_b: ``[..., N, Dv]`` the parts' outputs (one floating dtype, one device), e.g.
            ``softmax_attention(q, k_a, v_a, return_lse=True)`` and the same with ``k_b, v_b``.
        lse_a, lse_b: ``[..., N]`` their log-sum-exps (any floating dtype; -inf for a row with no
            key in that part).

    Returns:
        ``(out, lse)``: the attention over both key sets, out ``[..., N, Dv]`` in the outputs'
        dtype, lse ``[..., N]`` in float32 (float64 when any input is float64).  The merge is
        computed in that accumulation dtype, overflow-free; a row whose both parts are empty
        gives out_a's row (0 from attnkit's ops) and lse -inf; NaN propagates.  Merge more parts
        by folding: the merge is associative and commutative (up to rounding).

    Example::

        out_a, lse_a = attnkit.softmax_attention(q, k[..., :m, :], v[..., :m, :], return_lse=True)
        out_b, lse_b = attnkit.softmax_attention(q, k[..., m:, :], v[..., m:, :], return_lse=True)
        out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
        # == attnkit.softmax_attention(q, k, v, return_lse=True)
    """
    for name, t in (("out_a", out_a), ("out_b", out_b)):
        check_tensor(OP_NAME, name, t, "[..., N, Dv]")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(OP_NAME, name, t, "[..., N]")
    if out_a.dtype != out_b.dtype:
        raise ValueError(f"{OP_NAME}: out_a and out_b must have one dtype; got {out_a.dtype} and {out_b.dtype}")
    for name, t in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if t.device != out_a.device:
            raise ValueError(f"{OP_NAME}: {name} must be on the device of out_a ({out_a.device}); got {t.device}")
    if out_a.shape != out_b.shape:
        raise ValueError(f"{OP_NAME}: out_a and out_b must have one shape; got {list(out_a.shape)} and "
                         f"{list(out_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != out_a.shape[:-1]:
            raise ValueError(f"{OP_NAME}: {name} must have the shape of the outputs without their last dim, "
                             f"{list(out_a.shape[:-1])}; got {list(t.shape)}")
    wide = torch.float64 in (out_a.dtype, lse_a.dtype, lse_b.dtype)
    acc = torch.float64 if wide else torch.float32
    w_b, lse = merge_weights(lse_a.to(acc), lse_b.to(acc))
    out = torch.lerp(out_a.to(acc), out_b.to(acc), w_b.unsqueeze(-1))
    return out.to(out_a.dtype), lse

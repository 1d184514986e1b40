"""``attnkit.linear_attention_varlen`` on the Triton backend: the whole pack in one launch per
kernel (kernels/linear.py's ``linear_varlen_fwd`` / ``linear_varlen_bwd``, the kernels' VARLEN
build: each program reads its sequence's first row and length from the offsets, the per-chunk
grids cover the longest sequence, the causal chunk states of all sequences share one buffer),
with autograd.

Against the grouped path (ops/varlen.py: one linear_attention call per group of equal lengths,
gathered copies for groups that are not adjacent in the pack), it spares the gathers and scatters
and the host's per-call cost: a pack of 256 sequences of distinct lengths is 2 forward launches
(and 6 for the backward) instead of 2 x 256 (and 6 x 256).  Not timed on a GPU yet.

Gradients in q, k, v; a double backward (``create_graph=True``) differentiates the grouped
reference path instead, as linear_attention's Triton backend does.
"""
from __future__ import annotations

import torch

from .._double_backward import reference_gradients


class _Pack:
    """The launch arguments of one call other than q, k, v (no gradient)."""

    def __init__(self, cu, longest, causal, feature_map, normalize, eps, scale):
        self.args = (cu, longest)
        self.kwargs = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale)


class _PackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pack, regroup):
        from ..kernels import linear as kernels

        out, _, _, den = kernels.linear_varlen_fwd(q, k, v, *pack.args, **pack.kwargs)
        ctx.save_for_backward(q, k, v, out, den)
        ctx.pack, ctx.regroup = pack, regroup
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from ..kernels import linear as kernels

        q, k, v, out, den = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a double backward will follow
            grads = reference_gradients([ctx.regroup(q, k, v)], (q, k, v), [grad_out])
            return (*grads, None, None)
        dq, dk, dv = kernels.linear_varlen_bwd(grad_out, q, k, v, *ctx.pack.args, out=out, den=den,
                                               **ctx.pack.kwargs)
        return dq, dk, dv, None, None


def run(q, k, v, cu_seqlens, longest, causal, feature_map, normalize, eps, scale, regroup):
    """out ``[total, H, Dv]`` of the pack in one launch per kernel.  ``cu_seqlens``: the checked
    offsets (any device, int32 / int64); ``longest``: the longest sequence; ``regroup(q, k, v)``:
    the same call on the grouped reference path, differentiable (for a double backward)."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    pack = _Pack(cu, longest, causal, feature_map, normalize, eps, scale)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v):
        return _PackedLinear.apply(q, k, v, pack, regroup)
    from ..kernels import linear as kernels

    with torch.no_grad():
        return kernels.linear_varlen_fwd(q, k, v, *pack.args, **pack.kwargs)[0]

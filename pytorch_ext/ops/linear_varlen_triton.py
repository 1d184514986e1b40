"""``attnkit.linear_attention_varlen`` on the Triton backend: the whole pack in one launch per
kernel (kernels/linear.py's ``linear_varlen_fwd`` / ``linear_varlen_bwd``, the kernels' VARLEN
build: each program reads its sequence's first row and length from the offsets, the per-chunk
grids cover the longest sequence, the causal chunk states of all sequences share one buffer),
with autograd.

Against the grouped path (ops/linear_varlen.py: one linear_attention call per group of equal lengths,
gathered copies for groups that are not adjacent in the pack), it spares the gathers and scatters
and the host's per-call cost: a pack of 256 sequences of distinct lengths is 2 forward launches
(and 6 for the backward) instead of 2 x 256 (and 6 x 256).  Not timed on a GPU yet.

Gradients in q, k, v and the initial state, from those of out and the final states; a double
backward (``create_graph=True``) differentiates the grouped reference path instead, as
linear_attention's Triton backend does.
"""
from __future__ import annotations

import torch

from .._double_backward import reference_gradients


class _Pack:
    """The launch arguments of one call other than q, k, v and the state (no gradient)."""

    def __init__(self, cu, longest, options, return_state):
        self.args = (cu, longest)
        self.kwargs = dict(options)
        self.return_state = return_state


class _PackedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s0, z0, pack, regroup):
        from ..kernels import linear as kernels

        state = None if s0 is None else (s0, z0)
        out, S, z, den = kernels.linear_varlen_fwd(q, k, v, *pack.args, initial_state=state, **pack.kwargs)
        ctx.save_for_backward(q, k, v, s0, z0, out, den)
        ctx.pack, ctx.regroup = pack, regroup
        ctx.set_materialize_grads(False)
        return (out, S, z) if pack.return_state else out

    @staticmethod
    def backward(ctx, grad_out, grad_S=None, grad_z=None):
        from ..kernels import linear as kernels

        q, k, v, s0, z0, out, den = ctx.saved_tensors
        state = None if s0 is None else (s0, z0)
        if torch.is_grad_enabled():  # create_graph=True: a double backward will follow
            result = ctx.regroup(q, k, v, state)
            outputs = [result[0], *result[1]] if ctx.pack.return_state else [result]
            pairs = [(o, g) for o, g in zip(outputs, (grad_out, grad_S, grad_z)) if g is not None]
            wanted = (q, k, v) if s0 is None else (q, k, v, s0, z0)
            grads = reference_gradients([o for o, _ in pairs], wanted, [g for _, g in pairs])
            return (*grads[:3], *(grads[3:] if s0 is not None else (None, None)), None, None)
        grads = kernels.linear_varlen_bwd(grad_out, q, k, v, *ctx.pack.args, initial_state=state, grad_S=grad_S,
                                          grad_z=grad_z, out=out, den=den, **ctx.pack.kwargs)
        return (*grads[:3], *(grads[3:] if s0 is not None else (None, None)), None, None)


def run(q, k, v, cu_seqlens, longest, options, initial_state, return_state, regroup):
    """out ``[total, H, Dv]`` of the pack in one launch per kernel -- with ``return_state`` ``(out,
    (S [batch, H, D, Dv], z [batch, H, D]))``.  ``cu_seqlens``: the checked offsets (any
    device, int32 / int64); ``longest``: the longest sequence; ``options``: causal, feature_map,
    normalize, eps, scale; ``initial_state``: the checked ``(S0, z0)`` or None;
    ``regroup(q, k, v, state)``: the same call on the grouped reference path, differentiable
    (for a double backward)."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    pack = _Pack(cu, longest, options, return_state)
    s0, z0 = (None, None) if initial_state is None else initial_state
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, s0, z0):
        result = _PackedLinear.apply(q, k, v, s0, z0, pack, regroup)
    else:
        from ..kernels import linear as kernels

        with torch.no_grad():
            out, S, z, _ = kernels.linear_varlen_fwd(q, k, v, *pack.args, initial_state=initial_state, **options)
        result = (out, S, z) if return_state else out
    return (result[0], (result[1], result[2])) if return_state else result

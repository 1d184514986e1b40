"""``attnkit.softmax_attention_varlen`` on the Triton backend: the whole pack in one launch per
kernel (kernels/softmax.py's ``softmax_varlen_fwd`` / ``softmax_varlen_bwd``, FlashAttention's
varlen scheme: the grid covers the longest sequence, each program reads its sequence's first
rows and lengths from the offsets), with autograd.

Against the grouped path (ops/varlen.py: one softmax_attention call per group of equal lengths,
gathered copies for groups that are not adjacent in the pack), it spares the gathers and scatters
and, on a GPU, the host's per-call cost: a pack of 256 sequences of distinct lengths is 1
forward launch (and 3 for the backward) instead of 256 (and 3 x 256).  Not timed on a GPU yet.

What it takes: float16 / bfloat16 / float32, head dims up to 256, GQA, is_causal, every score
option (window, softcap, ALiBi [H] or [batch, H], sinks), the lse, dropout (one seed drawn from
torch's generator per call, as softmax_attention draws it; sequence b's mask from the Philox key
seed + b: kernels/softmax.py ``varlen_dropout_keep_masks``) -- except under CUDA graph capture,
where a seed drawn once would replay the same mask every step: dropout there raises.
Gradients in q, k, v and the sinks (the slopes get none, as on softmax_attention's Triton
backend); a double backward (``create_graph=True``) differentiates the grouped
reference instead.
"""
from __future__ import annotations

import torch

from .. import score_options
from .._double_backward import reference_gradients
from .softmax import _gradients

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256  # attnkit.kernels.softmax.MAX_HEAD_DIM (not imported: triton is slow to import)


def takes(chosen: str, q: torch.Tensor, v: torch.Tensor, dropout_p: float, captured: bool = False) -> bool:
    """Whether a call that resolved to backend ``chosen`` runs in one launch (``captured``: under
    CUDA graph capture, where dropout is refused)."""
    return (chosen == "triton" and (dropout_p == 0.0 or not captured) and q.dtype in _TRITON_DTYPES
            and q.shape[2] <= _MAX_HEAD_DIM and v.shape[2] <= _MAX_HEAD_DIM)


class _Pack:
    """The launch arguments of one call other than q, k, v and the sinks (no gradient)."""

    def __init__(self, cu_q, cu_k, max_q, max_k, scale, is_causal, options, dropout_p=0.0, seed=0):
        self.args = (cu_q, cu_k, max_q, max_k, scale, is_causal)
        window, softcap, alibi = (-1, -1), 0.0, None
        if options is not None:
            window, softcap, alibi = options.window, options.softcap, options.alibi_slopes
        self.kwargs = dict(window_left=window[0], window_right=window[1], softcap=softcap,
                           alibi_slopes=alibi, dropout_p=float(dropout_p), seed=int(seed))


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, pack, regroup):
        from ..kernels import softmax as kernels

        out, lse = kernels.softmax_varlen_fwd(q, k, v, *pack.args, sinks=sinks, **pack.kwargs)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.pack, ctx.regroup = pack, regroup
        ctx.set_materialize_grads(False)
        return out, lse.t()  # the lse token-major, as the public function returns it

    @staticmethod
    def backward(ctx, grad_out, grad_lse):

        q, k, v, out, lse, sinks = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a double backward will follow
            if ctx.regroup is None:
                raise RuntimeError("attnkit.softmax_attention_varlen: no double backward of a call made "
                                   "under CUDA graph capture (it reads the offsets on the host)")
            ref_out, ref_lse = ctx.regroup(q, k, v, sinks)
            outputs, grads = [], []
            if grad_out is not None:
                outputs.append(ref_out)
                grads.append(grad_out)
            if grad_lse is not None:
                finite = torch.isfinite(ref_lse)  # no key: lse -inf, no gradient
                outputs.append(torch.where(finite, ref_lse, 0.0))
                grads.append(grad_lse.to(ref_lse.dtype))
            wanted = (q, k, v) if sinks is None else (q, k, v, sinks)
            grads = reference_gradients(outputs, wanted, grads)
            return (*grads[:3], grads[3] if sinks is not None else None, None, None)

        dq, dk, dv, dsinks = _kernel_gradients(q, k, v, out, lse, sinks, ctx.pack, grad_out, grad_lse,
                                               any(ctx.needs_input_grad[:3]), ctx.needs_input_grad[3])
        return dq, dk, dv, dsinks, None, None


def _kernel_gradients(q, k, v, out, lse, sinks, pack, grad_out, grad_lse, wants_qkv=True, wants_sinks=True):
    """(dq, dk, dv, dsinks) by the backward kernels (None where not wanted); ``lse`` ``[H, total_q]``
    as the forward kernel returns it, ``grad_lse`` token-major (either grad may be None)."""
    from ..kernels import softmax as kernels

    def run_bwd(g, v_, out_, with_dropout):  # (the lse's probe call is dropout-free)
        kwargs = pack.kwargs if with_dropout else dict(pack.kwargs, dropout_p=0.0)
        return kernels.softmax_varlen_bwd(g, q, k, v_, out_, lse, *pack.args, **kwargs)

    dq = dk = dv = dsinks = None
    if wants_qkv:
        dq, dk, dv = _gradients(run_bwd, (q, k, v, out, lse.t()), grad_out, grad_lse)
    if sinks is not None and wants_sinks:
        as_batch = (lambda t: None if t is None else t.transpose(0, 1).unsqueeze(0))  # [1, H, total, *]
        dsinks = score_options.sink_gradient(sinks, as_batch(out), lse.unsqueeze(0), as_batch(grad_out),
                                             None if grad_lse is None else grad_lse.t().unsqueeze(0))
    return dq, dk, dv, dsinks


def backward(q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, options, grad_out, grad_lse):
    """The gradients (dq, dk, dv, dsinks) of a dropout-free call of :func:`run` from its results
    ``out`` / ``lse`` (token-major, as run returns them), by the backward kernels alone: the
    backward of ops/compiled.py's opaque op, which holds no autograd graph of the forward."""
    cu_q, cu_k = (cu.to(device=q.device, dtype=torch.int32) for cu in (cu_q, cu_k))
    pack = _Pack(cu_q, cu_k, max_q, max_k, scale, is_causal, options)
    sinks = None if options is None else options.sinks
    return _kernel_gradients(q, k, v, out, lse.t().contiguous(), sinks, pack, grad_out, grad_lse)


def run(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, options, regroup, dropout_p=0.0, seed=0):
    """(out [total_q, H, Dv], lse [total_q, H]) of the pack in one launch.  ``cu_q`` / ``cu_k``:
    the checked offsets (any device, int32 / int64); ``max_q`` / ``max_k``: the longest
    sequences; ``options``: the validated ScoreOptions or None; ``regroup(q, k, v, sinks)``: the
    same call on the grouped reference path, differentiable (for a double backward; None under
    CUDA graph capture: no double backward there).  ``dropout_p`` / ``seed``: the call's dropout
    and its Philox seed (an int)."""
    cu_q, cu_k = (cu.to(device=q.device, dtype=torch.int32) for cu in (cu_q, cu_k))
    pack = _Pack(cu_q, cu_k, max_q, max_k, scale, is_causal, options, dropout_p, seed)
    sinks = None if options is None else options.sinks
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, sinks):
        return _PackedAttention.apply(q, k, v, sinks, pack, regroup)
    from ..kernels import softmax as kernels

    with torch.no_grad():
        out, lse = kernels.softmax_varlen_fwd(q, k, v, *pack.args, sinks=sinks, **pack.kwargs)
    return out, lse.t()

"""Sparse attention: ``attnkit.sparse_attention`` -- softmax attention restricted to a pattern,
at a cost that tracks the entries the pattern keeps.

How (issue 4): block-granular skipping does not see the Sparse Transformer's own patterns (with
stride 64 every 128 x 128 block of the causal triangle holds a strided entry), so every pattern
is cut into a few **dense sub-problems on rearranged views of the rows**, each run by a flash
kernel, and merged exactly through their log-sum-exps:

- ``strided(s)``: a band ``0 <= i-j <= s`` (``|i-j| <= s``) on the rows as they are, plus the
  columns ``i-j = k s, k >= 2`` -- on the *strided view* (rows ``r, r+s, r+2s, ...`` for each
  residue ``r``, read in place through the row stride) they are causal attention shifted by
  two rows (non-causal: two such parts, one each way);
- ``fixed(l, c)``: the own block (a floor-aligned range per row) plus the summary columns,
  gathered into a small dense key set (``~N c / l`` rows) that query ``i`` sees up to the start
  of its own block (non-causal: before and after its block);
- ``star``: every row attends the band of ``radius`` positions and the relay's key; the few
  rows where that is not their star neighbourhood (the relay, which attends everything, its
  neighbours, whose satellite band skips the relay's position, and with ``cyclic`` the ring's
  ends) are recomputed exactly on their own (at most 4 radius + 6 rows, O(rows N) work) --
  nothing of size N is gathered or copied.
- ``block_layout``: a block-sparse kernel walking per-row index lists of the non-empty blocks.

The parts of a pattern partition its mask (no entry counted twice; for a star, outside its
recomputed rows), so softmax over the union equals the LSE-merge of the parts
(tests/ops/test_sparse_parts.py checks the partition, tests/ops/test_sparse_backends.py the result).

On the ``cpu`` backend ``strided`` skips the merge (issue 14): ``attnkit::sparse_strided_fwd``
/ ``_bwd`` (csrc/cpu/sparse.cpp; CPU-only ops declared there) run both parts of a row in one
online softmax -- the band on consecutive rows, then each residue's columns on keys packed
once per head -- and their gradients into one set of outputs (tests/csrc/test_sparse_strided_cpu.py).
Its ``star`` is one call each way too: ``attnkit::sparse_star_fwd`` / ``_bwd``
(csrc/cpu/sparse_star.cpp) list each row's keys (and each key's rows) and fold them in one
softmax (tests/csrc/test_sparse_star_cpu.py).

Layers (DESIGN.md):

- **op**: ``attnkit::sparse_range_fwd`` / ``_bwd`` and ``attnkit::block_sparse_fwd`` / ``_bwd``
  (C++ ops; schemas and exact semantics in ``csrc/ops.cpp``; CPU ``csrc/cpu/sparse.cpp``, CUDA
  ``csrc/cuda/sparse.cu``) and their Triton twins ``attnkit::sparse_range_triton_fwd`` / ...
  (custom ops around ``attnkit.kernels.sparse``), each with a fake and an autograd formula whose
  backward is the kernel's own (gradients of both out and lse).
- **public function** :func:`sparse_attention`: validates, picks the backend, decomposes the
  pattern, calls the parts and merges them (plain differentiable PyTorch on ``[B, H, N]``-sized
  tensors, so torch.compile traces the whole thing).
"""
from __future__ import annotations

import math
import os

import torch

from .._double_backward import reference_gradients
from .._dispatch import ENV_VAR, BackendUnavailableError, native_ops_declared, register_kernel, resolve
from .._validation import RANK_HINT, check_real, check_same_dtype_device, check_size_match, check_tensor
from ..patterns import BlockLayout, Fixed, Pattern, Star, Strided
from ..reference.sparse import (
    block_sparse_reference,
    sparse_attention_reference,
    sparse_range_reference,
)

OP = "attnkit.sparse_attention"
FAMILY = "sparse"

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CUDA_HEAD_DIMS = (64, 128)
CUDA_MIN_BLOCK = 16  # csrc/cuda/sparse.cu: one mma tile row of 16 per block at least


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ==============================================================================================
# op layer
# ==============================================================================================


def _range_fwd_fake(q, k, v, view, lo, hi, scale, float32_out=False):
    b, h, n, _ = q.shape
    out_dtype = torch.float32 if float32_out else q.dtype
    return q.new_empty((b, h, n, v.shape[-1]), dtype=out_dtype), q.new_empty((b, h, n), dtype=_lse_dtype(q.dtype))


def _range_bwd_fake(grad_out, q, k, v, lse, delta, view, lo, hi, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _block_fwd_fake(q, k, v, row_ptr, col_idx, block, causal, scale):
    b, h, n, _ = q.shape
    return q.new_empty((b, h, n, v.shape[-1])), q.new_empty((b, h, n), dtype=_lse_dtype(q.dtype))


def _block_bwd_fake(grad_out, q, k, v, lse, delta, row_ptr, col_idx, col_ptr, row_idx, block, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _delta(grad_out, grad_lse, out, lse):
    """delta_i = rowsum(dO_i * O_i) - dlse_i in the lse dtype (csrc/ops.cpp), and dO (zeros when
    only the lse has a gradient)."""
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    if grad_lse is not None:
        delta = delta - torch.where(torch.isfinite(lse), grad_lse.to(lse.dtype), 0.0)
    return grad_out, delta


def _double_backward(reference, ctx, grad_out, grad_lse, args):
    """Differentiable gradients (create_graph=True) from the plain-PyTorch reference of the op."""
    q, k, v = ctx.saved_tensors[:3]
    out, lse = reference(q, k, v, *args)
    outputs, grads = [], []
    for t, g in ((out, grad_out), (lse, grad_lse)):
        if g is not None:
            outputs.append(torch.where(torch.isfinite(t), t, 0.0) if t is lse else t)
            grads.append(g.to(t.dtype))
    return reference_gradients(outputs, (q, k, v), grads)


def _range_setup(ctx, inputs, output):
    q, k, v, view, lo, hi, scale = inputs[:7]  # (then float32_out)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (list(view), list(lo), list(hi), scale)
    ctx.extra_inputs = len(inputs) - 7
    ctx.set_materialize_grads(False)


def _block_setup(ctx, inputs, output):
    q, k, v, row_ptr, col_idx, block, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, row_ptr, col_idx)
    ctx.args = (block, causal, scale)
    ctx.set_materialize_grads(False)


def _make_range_backward(bwd_op):
    def backward(ctx, grad_out, grad_lse):
        unused = (None,) * (4 + ctx.extra_inputs)
        if torch.is_grad_enabled():  # double backward: through the reference
            grads = _double_backward(sparse_range_reference, ctx, grad_out, grad_lse, ctx.args)
            return (*grads, *unused)
        q, k, v, out, lse = ctx.saved_tensors
        # A float32 out (a part to be merged) gets a float32 gradient; the kernels take q's dtype,
        # and delta = rowsum(dO O) must use the dO they use (with the unrounded one a bfloat16
        # strided(1) dk came out 3.2e-3 off against the rule's 2.6e-3: session 31's random fuzzing).
        if grad_out is not None:
            grad_out = grad_out.to(q.dtype)
        g, delta = _delta(grad_out, grad_lse, out, lse)
        dq, dk, dv = bwd_op(g.contiguous(), q, k, v, lse, delta.contiguous(), *ctx.args)
        return (dq, dk, dv, *unused)

    return backward


def _make_block_backward(bwd_op):
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, row_ptr, col_idx = ctx.saved_tensors
        block, causal, scale = ctx.args
        if torch.is_grad_enabled():
            grads = _double_backward(block_sparse_reference, ctx, grad_out, grad_lse,
                                     (row_ptr, col_idx, block, causal, scale))
            return (*grads, None, None, None, None, None)
        col_ptr, row_idx = _transposed_lists(row_ptr, col_idx, q.shape[2] // block if block else 0)
        g, delta = _delta(grad_out, grad_lse, out, lse)
        dq, dk, dv = bwd_op(g.contiguous(), q, k, v, lse, delta.contiguous(), row_ptr, col_idx,
                            col_ptr, row_idx, block, causal, scale)
        return dq, dk, dv, None, None, None, None, None

    return backward


def _transposed_lists(row_ptr, col_idx, nb):
    """(col_ptr, row_idx) of the lists (row_ptr, col_idx): the query blocks of each key block."""
    hl = row_ptr.shape[0]
    counts = (row_ptr[:, 1:] - row_ptr[:, :-1]).long()  # [Hl, nb]
    heads = torch.arange(hl, device=row_ptr.device).repeat_interleave(counts.sum(1))
    rows = torch.arange(nb, device=row_ptr.device).repeat(hl).repeat_interleave(counts.reshape(-1))
    cols = col_idx.long()
    # Sort entries by (head, col, row): stable sort on col then head keeps rows increasing.
    order = torch.sort(cols, stable=True).indices
    order = order[torch.sort(heads[order], stable=True).indices]
    per = torch.zeros(hl, nb, dtype=torch.int64, device=row_ptr.device)
    per.index_put_((heads, cols), torch.ones_like(cols), accumulate=True)
    col_ptr = torch.zeros(hl, nb + 1, dtype=torch.int64, device=row_ptr.device)
    col_ptr[:, 1:] = torch.cumsum(per.reshape(-1), 0).reshape(hl, nb)
    col_ptr[1:, 0] = col_ptr[:-1, -1]
    return col_ptr.to(torch.int32), rows[order].to(torch.int32).contiguous()


# --- the C++ ops (cpu and cuda backends) ---

_NATIVE_OPS = native_ops_declared("sparse_range_fwd", "sparse_range_bwd", "block_sparse_fwd", "block_sparse_bwd")

if _NATIVE_OPS:
    torch.library.register_fake("attnkit::sparse_range_fwd", _range_fwd_fake)
    torch.library.register_fake("attnkit::sparse_range_bwd", _range_bwd_fake)
    torch.library.register_fake("attnkit::block_sparse_fwd", _block_fwd_fake)
    torch.library.register_fake("attnkit::block_sparse_bwd", _block_bwd_fake)
    torch.library.register_autograd(
        "attnkit::sparse_range_fwd",
        _make_range_backward(lambda *a: torch.ops.attnkit.sparse_range_bwd(*a)),
        setup_context=_range_setup,
    )
    torch.library.register_autograd(
        "attnkit::block_sparse_fwd",
        _make_block_backward(lambda *a: torch.ops.attnkit.block_sparse_bwd(*a)),
        setup_context=_block_setup,
    )

register_kernel(FAMILY, "cpu")
register_kernel(FAMILY, "cuda")


# --- strided(s) in one C++ call (cpu backend): attnkit::sparse_strided_fwd ---
#
# Declared in csrc/cpu/sparse.cpp (CPU-only ops: no CUDA / Triton twin).  The forward runs all
# parts of each row in one online softmax (no merge, no per-part out / lse tensors); the
# backward (attnkit::sparse_strided_bwd) computes both parts' gradients from the pattern's lse
# and delta into one set of outputs -- or, with fewer heads than threads, the range parts' own
# backward kernels do, each given that lse and delta (csrc/ops.cpp: "given the merged lse").  Measured at
# B=1 H=8 N=4096 D=64 float32 strided(64), one thread, CPU time: forward 12.5 -> 8.5-9 ms
# (parts + merge -> fused), forward + backward: see bench/sparse_targets.py --efficiency.


def _strided_fwd_fake(q, k, v, stride, causal, scale):
    b, h, n, _ = q.shape
    return q.new_empty((b, h, n, v.shape[-1])), q.new_empty((b, h, n), dtype=_lse_dtype(q.dtype))


def _strided_bwd_fake(grad_out, q, k, v, lse, delta, stride, causal, scale, out=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _pattern_reference(pattern_cls):
    """(q, k, v, *pattern args, scale) -> (out, lse) of that whole pattern in plain PyTorch (the
    fused ops' double backward)."""
    def reference(q, k, v, *args):
        from ..reference.sparse import _masked_attention_with_lse

        mask = pattern_cls(*args[:-1]).mask(q.shape[2], device=q.device)
        return _masked_attention_with_lse(q, k, v, mask, args[-1])
    return reference


_strided_reference = _pattern_reference(Strided)


def _pattern_setup(ctx, inputs, output):
    """setup_context of the fused whole-pattern ops: inputs (q, k, v, *pattern args, scale)."""
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(inputs[3:])
    ctx.set_materialize_grads(False)


def _strided_backward(ctx, grad_out, grad_lse):
    if torch.is_grad_enabled():  # double backward: through the reference
        grads = _double_backward(_strided_reference, ctx, grad_out, grad_lse, ctx.args)
        return (*grads, None, None, None)
    q, k, v, out, lse = ctx.saved_tensors
    stride, causal, scale = ctx.args
    # One call (one task per head: it owns the head's dK / dV) when the heads keep the threads
    # busy; else the range parts' kernels, which split a head's key tiles over the threads.
    if _STRIDED_BWD and q.shape[0] * q.shape[1] >= torch.get_num_threads():
        if grad_out is not None and grad_lse is None:
            # delta = rowsum(dO * O) per head inside the kernel: _delta's [B, H, N, Dv] product
            # is a fresh tensor whose page faults cost ~12 ms at B=1 H=8 N=16384 D=64 (one thread).
            dq, dk, dv = torch.ops.attnkit.sparse_strided_bwd(grad_out.contiguous(), q, k, v, lse, None, stride,
                                                              causal, scale, out)
        else:
            g, delta = _delta(grad_out, grad_lse, out, lse)
            dq, dk, dv = torch.ops.attnkit.sparse_strided_bwd(g.contiguous(), q, k, v, lse, delta.contiguous(),
                                                              stride, causal, scale)
        return dq, dk, dv, None, None, None
    g, delta = _delta(grad_out, grad_lse, out, lse)
    g, delta = g.contiguous(), delta.contiguous()
    dq = dk = dv = None
    for view, lo, hi in strided_parts(q.shape[2], stride, causal):
        grads = torch.ops.attnkit.sparse_range_bwd(g, q, k, v, lse, delta, list(view), list(lo), list(hi), scale)
        if dq is None:
            dq, dk, dv = grads
        else:  # in place: the first part's gradients are fresh tensors of this backward
            dq.add_(grads[0])
            dk.add_(grads[1])
            dv.add_(grads[2])
    return dq, dk, dv, None, None, None


_STRIDED_OP = native_ops_declared("sparse_strided_fwd")
_STRIDED_BWD = native_ops_declared("sparse_strided_bwd")
if _STRIDED_BWD:  # (a compiled backward through the op needs its fake: it had none before session 32)
    torch.library.register_fake("attnkit::sparse_strided_bwd", _strided_bwd_fake)
if _STRIDED_OP:
    torch.library.register_fake("attnkit::sparse_strided_fwd", _strided_fwd_fake)
    torch.library.register_autograd("attnkit::sparse_strided_fwd", _strided_backward,
                                    setup_context=_pattern_setup)


# --- star in one C++ call (cpu backend): attnkit::sparse_star_fwd / _bwd ---
#
# Declared in csrc/cpu/sparse_star.cpp.  Every row's keys in one softmax: one read of q, k, v and
# one write of the output, where the composed path below makes five passes over [B, H, N, Dv]
# tensors for ~4 keys a row.  The backward recomputes each visible pair's probability once per
# row (dq) and once per key (dk, dv): the composed path's backward ran every part's own kernel,
# 36.7 ms at B=1 H=8 N=4096 D=64 float32 on 2 threads (bench/RESULTS.md, session 8).


def _star_fwd_fake(q, k, v, relay, radius, cyclic, causal, scale):
    b, h, n, _ = q.shape
    return q.new_empty((b, h, n, v.shape[-1])), q.new_empty((b, h, n), dtype=_lse_dtype(q.dtype))


def _star_bwd_fake(grad_out, q, k, v, lse, delta, relay, radius, cyclic, causal, scale, out=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_star_reference = _pattern_reference(Star)


def _star_backward(ctx, grad_out, grad_lse):
    nones = (None,) * 5
    if torch.is_grad_enabled():  # double backward: through the reference
        return (*_double_backward(_star_reference, ctx, grad_out, grad_lse, ctx.args), *nones)
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is not None and grad_lse is None:  # delta = rowsum(dO * O) inside the kernel
        grads = torch.ops.attnkit.sparse_star_bwd(grad_out.contiguous(), q, k, v, lse, None, *ctx.args, out)
    else:
        g, delta = _delta(grad_out, grad_lse, out, lse)
        grads = torch.ops.attnkit.sparse_star_bwd(g.contiguous(), q, k, v, lse, delta.contiguous(), *ctx.args)
    return (*grads, *nones)


_STAR_OP = native_ops_declared("sparse_star_fwd")
_STAR_BWD = native_ops_declared("sparse_star_bwd")
if _STAR_OP:
    torch.library.register_fake("attnkit::sparse_star_fwd", _star_fwd_fake)
if _STAR_OP and _STAR_BWD:
    torch.library.register_fake("attnkit::sparse_star_bwd", _star_bwd_fake)
    torch.library.register_autograd("attnkit::sparse_star_fwd", _star_backward, setup_context=_pattern_setup)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# --- the Triton kernels as custom ops ---


@torch.library.custom_op("attnkit::sparse_range_triton_fwd", mutates_args=())
def _range_triton_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, view: list[int], lo: list[int],
                      hi: list[int], scale: float, float32_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """attnkit.kernels.sparse.sparse_range_fwd: (out, lse); ``float32_out``: out in float32 (a
    part that a merge rounds once, at its end)."""
    from ..kernels import sparse as kernels

    return kernels.sparse_range_fwd(q, k, v, view, lo, hi, scale, out_dtype=torch.float32 if float32_out else None)


@torch.library.custom_op("attnkit::sparse_range_triton_bwd", mutates_args=())
def _range_triton_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, view: list[int], lo: list[int],
                      hi: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attnkit.kernels.sparse.sparse_range_bwd: (dq, dk, dv)."""
    from ..kernels import sparse as kernels

    return kernels.sparse_range_bwd(grad_out, q, k, v, lse, delta, view, lo, hi, scale)


@torch.library.custom_op("attnkit::block_sparse_triton_fwd", mutates_args=())
def _block_triton_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_ptr: torch.Tensor,
                      col_idx: torch.Tensor, block: int, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attnkit.kernels.sparse.block_sparse_fwd: (out, lse)."""
    from ..kernels import sparse as kernels

    return kernels.block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale)


@torch.library.custom_op("attnkit::block_sparse_triton_bwd", mutates_args=())
def _block_triton_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      lse: torch.Tensor, delta: torch.Tensor, row_ptr: torch.Tensor,
                      col_idx: torch.Tensor, col_ptr: torch.Tensor, row_idx: torch.Tensor,
                      block: int, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attnkit.kernels.sparse.block_sparse_bwd: (dq, dk, dv)."""
    from ..kernels import sparse as kernels

    return kernels.block_sparse_bwd(grad_out, q, k, v, lse, delta, row_ptr, col_idx, col_ptr,
                                     row_idx, block, causal, scale)


_range_triton_fwd.register_fake(_range_fwd_fake)
_range_triton_bwd.register_fake(_range_bwd_fake)
_block_triton_fwd.register_fake(_block_fwd_fake)
_block_triton_bwd.register_fake(_block_bwd_fake)
_range_triton_fwd.register_autograd(
    _make_range_backward(lambda *a: torch.ops.attnkit.sparse_range_triton_bwd(*a)),
    setup_context=_range_setup,
)
_block_triton_fwd.register_autograd(
    _make_block_backward(lambda *a: torch.ops.attnkit.block_sparse_triton_bwd(*a)),
    setup_context=_block_setup,
)
register_kernel(FAMILY, "triton")


# ==============================================================================================
# the decomposition of the patterns into range parts, and the merge
# ==============================================================================================

# View [G, q_pg, q_pt, k_pg, k_pt] of the rows as they are, and range bounds
# [a, d, m, b] -> floor((t + a) / d) * m + b (csrc/ops.cpp).
PLAIN = (1, 0, 1, 0, 1)
NO_LOWER = (0, 1, 0, 0)


def _no_upper(n: int):
    return (0, 1, 0, max(n, 1))  # any bound >= the key count is clipped to it


def _offset(c: int):
    return (c, 1, 1, 0)  # t + c


def strided_parts(n: int, s: int, causal: bool):
    """The range parts ``(view, lo, hi)`` of ``strided(s)`` at length n: the band, then the
    strided columns ``|i - j| = k s, k >= 2`` on the strided view (rows r + t s)."""
    parts = [(PLAIN, _offset(-s), _offset(0 if causal else s))]
    if n > 2 * s:  # some row has a column 2s or more away
        view = (s, 1, s, 1, s)
        parts.append((view, NO_LOWER, _offset(-2)))
        if not causal:
            parts.append((view, _offset(2), _no_upper(n)))
    return parts


def fixed_summary_positions(n: int, l: int, c: int) -> torch.Tensor:
    """The summary columns ``j mod l >= l - c`` below n, increasing (block b's at b c ...)."""
    pos = torch.arange(n, dtype=torch.int64)
    return pos[pos % l >= l - c]


def fixed_parts(n: int, l: int, c: int, causal: bool):
    """``(own, summary)``: the own-block part ``(view, lo, hi)`` on the rows, and the parts of
    the gathered summary keys (key t' is the t'-th summary column; block b's are b c .. b c + c-1)."""
    own = (PLAIN, (0, l, l, 0), _offset(0) if causal else (0, l, l, l - 1))
    summary = []
    if n > l:  # a second block exists
        summary.append((PLAIN, NO_LOWER, (0, l, c, -1)))  # blocks before the own one
        if not causal:
            summary.append((PLAIN, (0, l, c, c), _no_upper(n)))  # blocks after it
    return own, summary


def star_band_part(radius: int, causal: bool):
    """The band part of a star, on the rows as they are: keys within ``radius`` positions."""
    return (PLAIN, _offset(-radius), _offset(0 if causal else radius))


def star_patched_rows(n: int, relay: int, radius: int, cyclic: bool) -> torch.Tensor:
    """The rows whose star neighbourhood is not 'the position band + the relay's key': the
    relay itself, the satellites next to it (their band skips the relay's position) and, when
    cyclic, those at the ends (their band wraps around).  They are recomputed exactly
    (:func:`_rows_attention`); there are at most 4 radius + 6 of them."""
    pos = torch.arange(n, dtype=torch.int64)
    near = (pos - relay).abs() <= radius + 1
    if cyclic:
        near |= (pos <= radius) | (pos >= n - 1 - radius)
    return pos[near]


def _merge_pair(a, b):
    """softmax over the union of two disjoint key sets from the two halves' (out, lse):
    out = lerp(o1, o2, w) with w = exp(l2 - lse) = sigmoid(l2 - l1), lse = logaddexp(l1, l2).
    One pass over [B, H, N, Dv] (measured at B=1 H=8 N=4096 Dv=64: 0.7 ms, against 60 ms for a
    stack / exp / weighted-sum version).  An empty half (lse -inf) gets weight 0."""
    (o1, l1), (o2, l2) = a, b
    # l2 = -inf -> d = -inf (weight 0) also when l1 = -inf (where -inf - -inf would be NaN).
    d = torch.where(torch.isneginf(l2), l2, l2 - l1)
    w = torch.sigmoid(d).unsqueeze(-1)
    out = torch.lerp(o1.to(w.dtype), o2.to(w.dtype), w)
    return out, torch.logaddexp(l1, l2)


def _merge(parts, dtype):
    """Exact merge of attention parts over the same query rows: [(out_p, lse_p)] -> (out, lse),
    out in ``dtype``, lse in float32 (float64 for float64).  The merge runs in float32 (float64)
    and rounds once: the cpu and Triton parts come in float32 for it (``_Parts.run``), since a
    16-bit part rounded, merged and rounded again missed DESIGN.md's rule (session 31's random
    fuzzing, test_fuzz_sparse: triton bfloat16 star, out 9.22e-3 off against the rule's 9.13e-3,
    where one rounding of the output alone is up to 7.8e-3; a seeded search: cpu bfloat16
    fixed(4, 1), 1.70e-2 against 1.52e-2).  The cuda backend's parts too (csrc/cuda/sparse.cu)."""
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = _merge_pair((out, lse), part)
    return out.to(dtype), lse


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _relay_column(q, k_relay, v_relay, scale, visible):
    """The part 'query attends the relay's key': lse = its score, out = v_relay; ``visible``
    bool [N]: which rows see the relay this way."""
    acc = _acc_dtype(q.dtype)
    score = (q.to(acc) @ k_relay.to(acc).transpose(-1, -2)).squeeze(-1) * scale
    lse = torch.where(visible, score, torch.full_like(score, float("-inf")))
    return v_relay.expand(*q.shape[:-1], v_relay.shape[-1]), lse


def _rows_attention(q, k, v, rows, mask, scale):
    """Exact attention of the few query rows ``rows`` over all keys under ``mask`` [R, N]
    (every row keeps at least one key): [B, H, R, Dv] in q's dtype.  O(R N) memory.

    NaN semantics of the kernels (issue 15): a NaN or +inf score poisons its row (NaN), while a
    row whose every kept score is -inf (an inf in a key) has nothing to attend and gives 0, as
    the reference's -inf-masked softmax does -- torch.softmax would give NaN there."""
    acc = _acc_dtype(q.dtype)
    s = (q.index_select(2, rows).to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    top = s.amax(dim=-1, keepdim=True).detach()  # NaN stays NaN; -inf: nothing to attend
    empty = torch.isneginf(top)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(top), top))
    den = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(empty, torch.ones_like(den), den)
    # Hidden keys weigh exactly 0, also on a poisoned row (0 / NaN would make their P, and so
    # the gradients of keys the row cannot see, NaN).
    p = torch.where(mask, p, torch.zeros_like(p))
    return (p @ v.to(acc)).to(q.dtype)


class _Parts:
    """The range / block ops of one backend."""

    def __init__(self, backend: str):
        if backend == "triton":
            self.range_fwd = torch.ops.attnkit.sparse_range_triton_fwd
            self.block_fwd = torch.ops.attnkit.block_sparse_triton_fwd
        else:
            self.range_fwd = torch.ops.attnkit.sparse_range_fwd
            self.block_fwd = torch.ops.attnkit.block_sparse_fwd

    def run(self, q, k, v, parts, scale):
        """The parts' (out, lse), out in float32 (float32_out: the merge rounds once, see _merge)."""
        return [self.range_fwd(q, k, v, list(view), list(lo), list(hi), scale, True) for view, lo, hi in parts]


def _run_kernels(backend, q, k, v, pattern, scale):
    ops = _Parts(backend)
    n = q.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if isinstance(pattern, Strided):
        if backend == "cpu" and _STRIDED_KERNEL:
            return torch.ops.attnkit.sparse_strided_fwd(q, k, v, pattern.stride, pattern.causal, scale)[0]
        out, _ = _merge(ops.run(q, k, v, strided_parts(n, pattern.stride, pattern.causal), scale), q.dtype)
        return out
    if isinstance(pattern, Fixed):
        own, summary = fixed_parts(n, pattern.stride, pattern.summary, pattern.causal)
        results = ops.run(q, k, v, [own], scale)
        if summary:
            idx = fixed_summary_positions(n, pattern.stride, pattern.summary).to(q.device)
            ks = k.index_select(2, idx).contiguous()
            vs = v.index_select(2, idx).contiguous()
            results += ops.run(q, ks, vs, summary, scale)
        return _merge(results, q.dtype)[0]
    if isinstance(pattern, Star):
        if backend == "cpu" and _STAR_KERNEL and (_STAR_BWD_KERNEL or not _wants_grad(q, k, v)):
            return torch.ops.attnkit.sparse_star_fwd(q, k, v, pattern.relay, pattern.radius, pattern.cyclic,
                                                     pattern.causal, scale)[0]
        # Band (positions) merged with the relay's key for every row, then the rows where that
        # is not the star's neighbourhood (relay, its neighbours, the ring's ends) recomputed.
        r = pattern.relay
        band = ops.run(q, k, v, [star_band_part(pattern.radius, pattern.causal)], scale)[0]
        pos = torch.arange(n, device=q.device)
        visible = pos > r if pattern.causal else pos != r
        out, _ = _merge([band, _relay_column(q, k[:, :, r:r + 1], v[:, :, r:r + 1], scale, visible)],
                        _acc_dtype(q.dtype))
        rows = star_patched_rows(n, r, pattern.radius, pattern.cyclic).to(q.device)
        exact = _rows_attention(q, k, v, rows, pattern.mask_rows(rows, n), scale)
        # In place: out is the merge's own result, which no backward saves (lerp keeps its
        # inputs); index_copy would copy all of it for a handful of rows (B=1 H=8 N=4096 Dv=64:
        # 0.7 of ~6 ms a call).
        return out.index_copy_(2, rows, exact.to(out.dtype)).to(q.dtype)
    if isinstance(pattern, BlockLayout):
        row_ptr, col_idx, _, _ = pattern.index_lists(device=q.device)
        out, _ = ops.block_fwd(q, k, v, row_ptr, col_idx, pattern.block, pattern.causal, scale)
        return out
    raise AssertionError(f"{OP}: no decomposition for {pattern!r}")  # pragma: no cover


# ==============================================================================================
# routing and the public function
# ==============================================================================================


def _native_kernels(key: str) -> bool:
    """Whether attnkit._C has the sparse ops' kernels for dispatch key ``key`` (CPU / CUDA)."""
    return _NATIVE_OPS and all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"attnkit::{name}", key)
        for name in ("sparse_range_fwd", "sparse_range_bwd", "block_sparse_fwd", "block_sparse_bwd")
    )


# Looked up once (attnkit._C registers its kernels when it loads; dynamo cannot trace the query).
_NATIVE_KERNELS = {"cpu": _native_kernels("CPU"), "cuda": _native_kernels("CUDA")}
_STRIDED_KERNEL = _STRIDED_OP and torch._C._dispatch_has_kernel_for_dispatch_key("attnkit::sparse_strided_fwd", "CPU")
_STAR_KERNEL = _STAR_OP and torch._C._dispatch_has_kernel_for_dispatch_key("attnkit::sparse_star_fwd", "CPU")
_STAR_BWD_KERNEL = _STAR_BWD and torch._C._dispatch_has_kernel_for_dispatch_key("attnkit::sparse_star_bwd", "CPU")


def _kernel_limitation(backend: str, query, value, pattern) -> str:
    """'' when ``backend`` can run this call, else what it cannot do."""
    dtype_name = str(query.dtype).replace("torch.", "")
    d, dv = query.shape[-1], value.shape[-1]
    if backend in ("cpu", "cuda") and not _NATIVE_KERNELS[backend]:
        return f"anything with this build of attnkit._C (it has no {backend} sparse kernels; rebuild it)"
    if backend == "triton":
        if query.dtype not in TRITON_DTYPES:
            return f"{dtype_name} inputs (the Triton kernels take float16, bfloat16 and float32)"
        if not (1 <= d <= TRITON_MAX_HEAD_DIM and 1 <= dv <= TRITON_MAX_HEAD_DIM):
            return f"head dims D = {d}, Dv = {dv} (the Triton kernels take 1..{TRITON_MAX_HEAD_DIM})"
    elif backend == "cuda":
        if query.dtype not in CUDA_DTYPES:
            return f"{dtype_name} inputs (the CUDA kernels take float16 and bfloat16)"
        if d not in CUDA_HEAD_DIMS or dv != d:
            return f"head dims D = {d}, Dv = {dv} (the CUDA kernels take D = Dv in {CUDA_HEAD_DIMS})"
        if isinstance(pattern, BlockLayout) and pattern.block < CUDA_MIN_BLOCK:
            return (f"block layouts with block = {pattern.block} (the CUDA block-sparse kernel takes "
                    f"blocks of {CUDA_MIN_BLOCK} or more)")
    return ""


def _route(backend, query, value, pattern) -> str:
    chosen = resolve(FAMILY, backend, query.device, OP)
    if chosen == "reference":
        return chosen
    why_not = _kernel_limitation(chosen, query, value, pattern)
    if not why_not:
        return chosen
    if backend is not None or os.environ.get(ENV_VAR):
        source = "backend" if backend is not None else ENV_VAR
        raise BackendUnavailableError(
            f"{OP}: the {chosen} backend ({source}={chosen!r}) cannot run {why_not}; use "
            "backend='reference', or leave backend=None to route such calls automatically"
        )
    return "reference"


def _validate(query, key, value, pattern, scale) -> None:
    layout = "[B, H, N, D]"
    check_tensor(OP, "query", query, layout, RANK_HINT)
    check_tensor(OP, "key", key, layout, RANK_HINT)
    check_tensor(OP, "value", value, "[B, H, N, Dv]", RANK_HINT)
    check_same_dtype_device(OP, {"query": query, "key": key, "value": value})
    check_size_match(OP, "batch size", {"query": query.shape[0], "key": key.shape[0], "value": value.shape[0]})
    check_size_match(OP, "number of heads", {"query": query.shape[1], "key": key.shape[1], "value": value.shape[1]})
    check_size_match(OP, "head dim", {"query": query.shape[3], "key": key.shape[3]})
    check_size_match(OP, "sequence length", {"key": key.shape[2], "value": value.shape[2]})
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{OP}: sparse attention is self-attention: query and key must have the same sequence "
            f"length; got query {query.shape[2]}, key {key.shape[2]}"
        )
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"{OP}: pattern must be an attnkit.patterns pattern (strided, fixed, star, block_layout); "
            f"got {type(pattern).__name__}"
        )
    pattern.check(query.shape[2], OP)
    if isinstance(pattern, BlockLayout) and pattern.heads not in (1, query.shape[1]):
        raise ValueError(
            f"{OP}: the block layout has {pattern.heads} heads; it must have 1 or as many as the "
            f"query ({query.shape[1]})"
        )
    check_real(OP, "scale", scale, allow_none=True)


def sparse_attention(query, key, value, pattern, *, scale=None, backend=None):
    """Softmax self-attention where query i may only attend the keys ``pattern.mask(N)[i]``.

    Shapes: exactly 4-D ``[B, H, N, D]`` (unlike :func:`attnkit.softmax_attention`, no other
    ranks and no broadcasting); anything else raises ValueError naming the expected layout and
    the shape that came.

    Args:
        query: ``[B, H, N, D]`` float16 / bfloat16 / float32 / float64.
        key: ``[B, H, N, D]``, same dtype and device (self-attention: same length N).
        value: ``[B, H, N, Dv]`` (Dv may differ from D).
        pattern: an :mod:`attnkit.patterns` pattern -- ``strided``, ``fixed``, ``star`` or
            ``block_layout`` (whose layout has 1 head or H heads; N must be nb * block).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        backend: ``"reference" | "cpu" | "triton" | "cuda"`` or None (device default, or the
            environment variable ``ATTNKIT_BACKEND``).

    Returns:
        ``[B, H, N, Dv]`` in the input dtype: ``out_i = Σ_{j: mask[i, j]} softmax_j(scale q_i·k_j) v_j``.
        A query whose row of the mask is empty (possible with block layouts) gets zeros.
        N = 0 gives an empty result.  Differentiable in query, key and value (once on the kernel
        backends; double backward runs through the references).

    Cost: the kernels compute only the entries of the pattern's parts (see the module
    docstring), at element granularity for strided / fixed / star -- e.g. ``strided(64)`` at
    N = 4096 costs about 3% of dense attention, where block-granular kernels pay for every
    128 x 128 block (all of them).  No kernel materializes an N x N matrix.

    Backends: ``cpu`` (C++, CPU tensors, every floating dtype, any head dim), ``triton`` (CUDA
    tensors, or CPU under ``TRITON_INTERPRET=1``: float16 / bfloat16 / float32, head dims
    1..256), ``cuda`` (float16 / bfloat16, D = Dv in {64, 128}, block layouts with block >= 16, sm_80+),
    ``reference`` (dense masked
    PyTorch).  With ``backend=None`` a call the picked kernel cannot run goes to the reference;
    a backend named explicitly raises :class:`attnkit.BackendUnavailableError` instead.

    Example::

        >>> q = k = v = torch.randn(2, 4, 256, 64)
        >>> out = attnkit.sparse_attention(q, k, v, attnkit.patterns.strided(16))
        >>> out.shape
        torch.Size([2, 4, 256, 64])
    """
    _validate(query, key, value, pattern, scale)
    chosen = _route(backend, query, value, pattern)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] > 0 else 1.0
    b, h, n, _ = query.shape
    # Empty inputs: the reference gives the empty (or zero-sized) result, attached to the graph.
    if chosen == "reference" or n == 0 or b * h == 0:
        return sparse_attention_reference(query, key, value, pattern, scale=scale)
    return _run_kernels(chosen, query, key, value, pattern, float(scale))

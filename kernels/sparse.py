"""Triton kernels for sparse attention: range parts and block-sparse layouts, forward and backward.

Layer 1 of the sparse family (see DESIGN.md): ``@triton.jit`` kernels and the launchers that
size their grids.  No autograd here -- ``pytorch_ext/ops/sparse.py`` registers the launchers as
``torch.library`` ops, merges range parts through their lse and wires the backwards in.
Semantics: the comments of ``sparse_range_fwd`` / ``block_sparse_fwd`` in csrc/ops.cpp; ground
truth: ``pytorch_ext/reference/sparse.py``.

Launchers
---------
``sparse_range_fwd(q, k, v, view, lo, hi, scale, config=None)`` -> ``(out, lse)``
``sparse_range_bwd(grad_out, q, k, v, lse, delta, view, lo, hi, scale, config=None)``
    -> ``(dq, dk, dv)``
``block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale, config=None)``
    -> ``(out, lse)``
``block_sparse_bwd(grad_out, q, k, v, lse, delta, row_ptr, col_idx, col_ptr, row_idx, block,
causal, scale, config=None)`` -> ``(dq, dk, dv)``
``supports(q, k, v)`` -> None when these kernels can run the inputs, else the reason (a str).

Shapes: q [B, H, Nq, D], k [B, H, Nk, D], v [B, H, Nk, Dv] (block-sparse: Nq = Nk = N);
out [B, H, Nq, Dv] in q's dtype, lse [B, H, Nq] float32 (natural log; -inf where a row sees no
key, and out = 0 there).  Backward: ``lse`` is the *merged* lse and ``delta`` (float32
[B, H, Nq]) = rowsum(dO * O_merged) - dlse, both given; P = exp(scale q.k - lse) on the part's
entries; dq, dk, dv are shaped and typed like q, k, v, zeros where the part touches nothing.
Inputs float16 / bfloat16 / float32 (float32 accumulation); float64 raises RuntimeError (route
it to the CPU kernels).  Head dims 1..256, padded to a power of two >= 16 with masked loads.
Any strides are read as given (inputs usually arrive contiguous; nothing is copied).

Range part (``view = [G, q_pg, q_pt, k_pg, k_pt]``, ``lo = hi = [a, d, m, b]``)
-------------------------------------------------------------------------------
Group g's query t (< Tq_g = ceil(max(Nq - g q_pg, 0) / q_pt)) is row g q_pg + t q_pt, its key t'
(< Tk_g) row g k_pg + t' k_pt; t attends t' iff lo(t) <= t' <= hi(t), f(t) = floor((t+a)/d) m + b.
Rows are gathered through pointer arithmetic during the tile loads (a strided view is read in
place).  Requirements (ValueError otherwise): G >= 0, q_pg, k_pg >= 0, q_pt, k_pt >= 1, d >= 1,
m >= 0, and the groups' *query* rows disjoint (every view of the spec is; a row in two groups
would need the union of two masks).  Key rows may be shared between groups: the dK/dV kernel
then runs group by group, accumulating (deterministic, slower).
- forward / dQ: grid (query tiles of the longest group, G, B*H); a tile [t0, t1] visits only the
  keys [lo(t0), hi(t1)] (lo, hi nondecreasing), starting exactly at lo(t0) (no alignment: rows
  are gathered anyway), and masks elementwise.
- dK/dV: grid (key tiles, G, B*H); the queries attending a key tile [n0, n1] are the closed-form
  interval [min t with hi(t) >= n0, max t with lo(t) <= n1] (inverses of the floor-affine
  bounds).  No atomics.
Integer bounds are computed in int64 (``hi = [.., m=0, b=2**40]`` means "no bound"); floor
division never divides a negative numerator (Triton's ``//`` truncates on GPUs, the interpreter
floors).

Block-sparse (``row_ptr`` int32 [Hl, nb+1], ``col_idx`` int32 [nnz], transposed lists
``col_ptr`` / ``row_idx`` for dK/dV; Hl = 1 or H)
----------------------------------------------------------------------------------------------
One program per (query sub-tile of a block row, b*h) walking ``col_idx`` (dK/dV: per key
sub-tile walking ``row_idx``).  Any block >= 1: a block is covered by ceil(block / BLOCK_M)
sub-tiles of a power-of-two size (>= 16, at most next_pow2(block)), and rows/columns past the
block's end are masked -- so block 16, 32, ... tile exactly and block 24 uses one 32-tile with
8 masked rows (or two 16-tiles).  ``causal``: j <= i inside the listed blocks; key sub-tiles
entirely above a query sub-tile's diagonal are skipped.

The tile steps (row-tile loads and stores, scores, online softmax, the backward's dQ / dK
updates) and the launch plumbing are shared with kernels/softmax.py through kernels/_flash.py.
Numerics as kernels/softmax.py: base-2 scores (``s * scale * log2(e)``, exp2), fp32 ieee dots
for float32 inputs, lse stored in natural log, backward p = exp2(s - lse log2(e)).

Tuning: ``RANGE_FWD_CONFIGS``, ``RANGE_DQ_CONFIGS``, ``RANGE_DKDV_CONFIGS``,
``BLOCK_FWD_CONFIGS``, ``BLOCK_DQ_CONFIGS``, ``BLOCK_DKDV_CONFIGS`` (BLOCK_M = query tile,
BLOCK_N = key tile), filtered by the padded head dim (and, block-sparse, the block size) in
:func:`configs_for`.  ``config=`` (a ``triton.Config``; for the backwards also a pair
``(dkdv_config, dq_config)``) skips autotuning; under the interpreter the first eligible config
is used.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._flash import (INTERPRETED, MAX_HEAD_DIM, SUPPORTED_DTYPES, _LOG2E, cdiv, config_list,
                     dk_step, dot_precision, dq_step, finish_rows, fitting, launch, load_bwd_rows,
                     load_row_pair, load_rows, next_pow2, online_softmax_step, pow2, scores,
                     split_config, store_rows, strides, by_batch_slices)

__all__ = [
    "sparse_range_fwd",
    "sparse_range_bwd",
    "block_sparse_fwd",
    "block_sparse_bwd",
    "supports",
    "configs_for",
    "RANGE_FWD_CONFIGS",
    "RANGE_DQ_CONFIGS",
    "RANGE_DKDV_CONFIGS",
    "BLOCK_FWD_CONFIGS",
    "BLOCK_DQ_CONFIGS",
    "BLOCK_DKDV_CONFIGS",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
]

# ----------------------------------------------------------------------------------------------
# autotune search spaces
# ----------------------------------------------------------------------------------------------

# Range parts are often narrow bands (width s+1 .. 2s+1, s = 64): a 64x64 tile of a 65-wide band
# spans 128 keys and wastes half its entries, 32x32 tiles waste a third; wide tiles pay off for
# the long column parts.  The autotuner is keyed on the typical key span of a row (SPAN).
RANGE_FWD_CONFIGS = config_list((64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (32, 32, 4, 2),
                                (16, 32, 2, 2))
RANGE_DQ_CONFIGS = config_list((64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2), (16, 32, 2, 2))
# dK/dV: BLOCK_N is the key tile the program owns, BLOCK_M the query tile it loops over.
RANGE_DKDV_CONFIGS = config_list((64, 64, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2), (16, 32, 2, 2))
# Block-sparse: sub-tiles of a block; configs larger than next_pow2(block) are filtered out, so
# each list ends with a 16x16 entry that every block size accepts.
BLOCK_FWD_CONFIGS = config_list((128, 64, 8, 3), (64, 64, 4, 3), (32, 32, 4, 2), (16, 16, 2, 2))
BLOCK_DQ_CONFIGS = config_list((64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2), (16, 16, 2, 2))
BLOCK_DKDV_CONFIGS = config_list((64, 64, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2), (16, 16, 2, 2))
_CONFIG_LISTS = {
    "range_fwd": RANGE_FWD_CONFIGS, "range_dq": RANGE_DQ_CONFIGS,
    "range_dkdv": RANGE_DKDV_CONFIGS, "block_fwd": BLOCK_FWD_CONFIGS,
    "block_dq": BLOCK_DQ_CONFIGS, "block_dkdv": BLOCK_DKDV_CONFIGS,
}
# BLOCK_M * BLOCK_N * (padded head dim) above which a tile spills registers on sm_80 / sm_90
# (as kernels/softmax.py: one [BLOCK_M, Dv] accumulator forward, two in each backward kernel).
_TILE_LIMIT = {"fwd": 128 * 128 * 128, "dq": 32 * 128 * 128, "dkdv": 32 * 128 * 128}


def configs_for(kernel: str, head_dim: int, value_dim: int | None = None,
                block: int | None = None) -> list:
    """The autotune candidates of ``kernel`` (``"range_fwd" | "range_dq" | "range_dkdv" |
    "block_fwd" | "block_dq" | "block_dkdv"``) for these head dims (and block size)."""
    dmax = pow2(max(head_dim, head_dim if value_dim is None else value_dim))
    configs = _CONFIG_LISTS[kernel]
    if block is not None:
        tile = pow2(block)
        configs = [c for c in configs
                   if c.kwargs["BLOCK_M"] <= tile and c.kwargs["BLOCK_N"] <= tile]
    return fitting(configs, dmax, _TILE_LIMIT[kernel.split("_")[1]])


# ----------------------------------------------------------------------------------------------
# shared device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _floor_div(n, d):
    """floor(n / d) for d >= 1.  Triton's integer ``//`` truncates toward zero on GPUs but the
    interpreter floors: divide only non-negative numerators so both agree."""
    return tl.where(n >= 0, n // d, -((d - 1 - n) // d))


@triton.jit
def _affine(t, a, d, m, b):
    """f(t) = floor((t + a) / d) * m + b (int64)."""
    return _floor_div(t + a, d) * m + b


@triton.jit
def _last_with_f_le(x, a, d, m, b, T):
    """Largest t in [0, T) with f(t) <= x, or -1 (f nondecreasing)."""
    # f(t) <= x  <=>  floor((t+a)/d) <= K = floor((x-b)/m)  <=>  t <= (K+1) d - 1 - a.
    K = _floor_div(x - b, tl.maximum(m, 1))
    t = (K + 1) * d - 1 - a
    t = tl.where(m == 0, tl.where(b <= x, T - 1, -1), t)
    return tl.maximum(tl.minimum(t, T - 1), -1)


@triton.jit
def _first_with_f_ge(x, a, d, m, b, T):
    """Smallest t in [0, T) with f(t) >= x, or T (f nondecreasing)."""
    # f(t) >= x  <=>  floor((t+a)/d) >= K = ceil((x-b)/m)  <=>  t >= K d - a.
    K = -_floor_div(b - x, tl.maximum(m, 1))
    t = K * d - a
    t = tl.where(m == 0, tl.where(b >= x, 0, T), t)
    return tl.minimum(tl.maximum(t, 0), T)


@triton.jit
def _group_len(n, g, pg, pt):
    """T_g = ceil(max(n - g pg, 0) / pt) (int64)."""
    return tl.cdiv(tl.maximum(n - g * pg, 0), pt)


@triton.jit
def _batch_head(pid, H):
    """(b*H + h, b, h) of the program's batch-head grid index (int64)."""
    bh = pid.to(tl.int64)
    return bh, bh // H, bh % H


# One step of each kernel's tile loop, on rows gathered by the caller: ``rows`` / ``row_ok``
# ([BM] query rows), ``krows`` / ``col_ok`` ([BN] key rows) and ``keep`` (the tile's elementwise
# mask, [BM, BN], or [BN, BM] in the dK/dV kernels, which work on transposed tiles so that dk
# and dv come out of plain dots).


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, krows, col_ok, keep, qk_scale,
              stride_kn, stride_kd, stride_vn, stride_vd,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    k = load_rows(k_base, krows, stride_kn, tl.arange(0, BLOCK_D), stride_kd, col_ok, HEAD_D,
                  BLOCK_D, True)
    s = tl.where(keep, scores(q, k, qk_scale, DOT_PREC), float("-inf"))
    # v after the scores, as in kernels/softmax.py: the software pipeliner overlaps its load
    # with the first dot.
    v = load_rows(v_base, krows, stride_vn, tl.arange(0, BLOCK_DV), stride_vd, col_ok, HEAD_DV,
                  BLOCK_DV, True)
    return online_softmax_step(acc, l_i, m_i, s, v, DOT_PREC)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, krows, col_ok, keep, qk_scale,
             stride_kn, stride_kd, stride_vn, stride_vd,
             HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    k, v = load_row_pair(k_base, v_base, krows, col_ok, stride_kn, stride_kd, stride_vn,
                         stride_vd, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), HEAD_D,
                         HEAD_DV, BLOCK_D, BLOCK_DV, True)
    p = tl.where(keep, tl.math.exp2(scores(q, k, qk_scale, DOT_PREC) - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    return dq_step(dq, p, dp, delta, k, keep, DOT_PREC)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, rows, row_ok, keep_t,
               qk_scale, stride_qn, stride_qd, stride_gn, stride_gd,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr):
    q, do, lse2, delta = load_bwd_rows(q_base, do_base, lse_base, delta_base, rows, row_ok,
                                       stride_qn, stride_qd, stride_gn, stride_gd, HEAD_D,
                                       HEAD_DV, BLOCK_D, BLOCK_DV)
    p_t = tl.where(keep_t, tl.math.exp2(scores(k, q, qk_scale, DOT_PREC) - lse2[None, :]), 0.0)
    # A NaN dO row comes from the parts' merge (attnkit/ops/sparse.py) when the row is poisoned
    # (a NaN / +inf score) in another part.  In dV = P^T dO it must reach the keys the row sees
    # only: in the dot, P = 0 * NaN would spread it to the hidden ones (the tests' "poisoned row"
    # case).  So the dot takes dO without its NaN, and the keys a NaN row sees become NaN.
    # Registers (sm_90 compile on the CPU, bfloat16, D = 128, the first two configs; session 29):
    # spills 452 / 360 -> 656 / 672 bytes at 64 x 64, 20 / 20 -> 188 / 216 at 32 x 64.  Both dots
    # behind the branch (the plain one without the select) measured worse: 884 / 960, 220 / 228.
    # Not timed yet: the next GPU run times the sparse backward against session 15's figures.
    do_nan = do != do
    dv = tl.dot(p_t.to(do.dtype), tl.where(do_nan, 0.0, do).to(do.dtype), dv, input_precision=DOT_PREC)
    row_nan = tl.max(do_nan.to(tl.int32), axis=1)  # [rows]
    if tl.max(row_nan, axis=0) > 0:  # rare: a tile without one skips this
        hit = tl.max(tl.where(keep_t, row_nan[None, :], 0), axis=1)  # [keys]
        dv = tl.where(hit[:, None] > 0, float("nan"), dv)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    return dk_step(dk, p_t, dp_t, delta, q, keep_t, DOT_PREC), dv


# The query-side kernels' prologues and the forward's epilogue: the same for both layouts, which
# differ only in how a query tile finds its keys.


@triton.jit
def _fwd_start(Q, K, V, b, h, rows, row_ok, sm_scale, stride_qb, stride_qh, stride_qn, stride_qd,
               stride_kb, stride_kh, stride_vb, stride_vh, HEAD_D: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """(q [BM, BLOCK_D], k and v bases of head (b, h), empty softmax state acc / l_i / m_i,
    base-2 qk_scale) for the query rows ``rows``."""
    q = load_rows(Q + b * stride_qb + h * stride_qh, rows, stride_qn, tl.arange(0, BLOCK_D),
                  stride_qd, row_ok, HEAD_D, BLOCK_D, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    return (q, K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh, acc, l_i,
            m_i, sm_scale * _LOG2E)


@triton.jit
def _fwd_finish(out_base, lse_base, rows, row_ok, acc, l_i, m_i, stride_on, stride_od,
                HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Normalize and store the rows' output and lse (``lse_base``: the head's lse row)."""
    out, lse = finish_rows(acc, l_i, m_i)
    store_rows(out_base, rows, stride_on, tl.arange(0, BLOCK_DV), stride_od, row_ok, out, HEAD_DV)
    tl.store(lse_base + rows, lse, mask=row_ok)


@triton.jit
def _dq_start(Q, K, V, dO, lse_base, delta_base, b, h, rows, row_ok, sm_scale,
              stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_vb,
              stride_vh, stride_gb, stride_gh, stride_gn, stride_gd, HEAD_D: tl.constexpr,
              HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """(q, dO, lse2, delta of the rows (see load_bwd_rows), k and v bases of head (b, h), zero dq
    [BM, BLOCK_D] float32, base-2 qk_scale)."""
    q, do, lse2, delta = load_bwd_rows(Q + b * stride_qb + h * stride_qh,
                                       dO + b * stride_gb + h * stride_gh, lse_base, delta_base,
                                       rows, row_ok, stride_qn, stride_qd, stride_gn, stride_gd,
                                       HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV)
    return (q, do, lse2, delta, K + b * stride_kb + h * stride_kh,
            V + b * stride_vb + h * stride_vh, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
            sm_scale * _LOG2E)


# ----------------------------------------------------------------------------------------------
# range parts
# ----------------------------------------------------------------------------------------------

_RANGE_INTS = ["Nq", "Nk", "q_pg", "q_pt", "k_pg", "k_pt", "lo_a", "lo_d", "lo_m", "lo_b",
               "hi_a", "hi_d", "hi_m", "hi_b"]


@triton.jit
def _range_query_tile(H, G_OFFSET, Nq, Nk, q_pg, q_pt, k_pg, k_pt,
                      lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b, BLOCK_M: tl.constexpr):
    """The query tile of this program of the (query tiles, groups, B*H) grid: (b*H + h, b, h,
    row_ok, q rows, per-row lo / hi, key span [klo, khi) of the tile, Tk_g, first key row of
    the group, key row step)."""
    bh, b, h = _batch_head(tl.program_id(2), H)
    pid_m = tl.program_id(0)
    g = (tl.program_id(1) + G_OFFSET).to(tl.int64)
    q_pg = q_pg.to(tl.int64)
    q_pt = q_pt.to(tl.int64)
    k_pg = k_pg.to(tl.int64)
    k_pt = k_pt.to(tl.int64)
    tq = _group_len(Nq.to(tl.int64), g, q_pg, q_pt)
    tk = _group_len(Nk.to(tl.int64), g, k_pg, k_pt)
    t0 = pid_m.to(tl.int64) * BLOCK_M
    t = t0 + tl.arange(0, BLOCK_M)
    row_ok = t < tq
    rows = g * q_pg + t * q_pt
    lo_t = _affine(t, lo_a.to(tl.int64), lo_d.to(tl.int64), lo_m.to(tl.int64), lo_b.to(tl.int64))
    hi_t = _affine(t, hi_a.to(tl.int64), hi_d.to(tl.int64), hi_m.to(tl.int64), hi_b.to(tl.int64))
    # lo and hi are nondecreasing: the tile needs keys [lo(t0), hi(t_last)] only.
    t_last = tl.minimum(t0 + BLOCK_M, tq) - 1
    klo = tl.maximum(_affine(t0, lo_a.to(tl.int64), lo_d.to(tl.int64), lo_m.to(tl.int64),
                             lo_b.to(tl.int64)), 0)
    khi = tl.minimum(_affine(t_last, hi_a.to(tl.int64), hi_d.to(tl.int64), hi_m.to(tl.int64),
                             hi_b.to(tl.int64)), tk - 1) + 1
    khi = tl.where(t0 < tq, khi, klo)  # a tile past the group's end does nothing
    # Everything the tile loop and the elementwise masks see lies in [-1, Tk]: int32 from here
    # (cheaper compares than int64 on GPUs; row addresses stay int64).
    lo_t = tl.minimum(tl.maximum(lo_t, 0), tk).to(tl.int32)
    hi_t = tl.minimum(tl.maximum(hi_t, -1), tk).to(tl.int32)
    return (bh, b, h, row_ok, rows, lo_t, hi_t, klo.to(tl.int32),
            tl.maximum(khi, klo).to(tl.int32), tk.to(tl.int32), g * k_pg, k_pt)


@triton.jit
def _range_key_tile(start_n, tk, k_row0, k_pt, lo_t, hi_t, BLOCK_N: tl.constexpr):
    """(key rows [BN], in-group mask, keep [BM, BN]) of the key tile starting at index start_n
    of the group: t attends t' iff lo(t) <= t' <= hi(t)."""
    tn = start_n + tl.arange(0, BLOCK_N)
    col_ok = tn < tk
    keep = (tn[None, :] >= lo_t[:, None]) & (tn[None, :] <= hi_t[:, None]) & col_ok[None, :]
    return k_row0 + tn * k_pt, col_ok, keep


@triton.jit(do_not_specialize=_RANGE_INTS)
def _range_fwd_kernel(
    Q, K, V, Out, Lse, sm_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, Nq, Nk, q_pg, q_pt, k_pg, k_pt, lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b,
    G_OFFSET, SPAN,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h, row_ok, rows, lo_t, hi_t, klo, khi, tk, k_row0, k_pt64 = _range_query_tile(
        H, G_OFFSET, Nq, Nk, q_pg, q_pt, k_pg, k_pt, lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m,
        hi_b, BLOCK_M)
    q, k_base, v_base, acc, l_i, m_i, qk_scale = _fwd_start(
        Q, K, V, b, h, rows, row_ok, sm_scale, stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_vb, stride_vh, HEAD_D, BLOCK_D, BLOCK_DV, BLOCK_M)
    for start_n in range(klo, khi, BLOCK_N):
        krows, col_ok, keep = _range_key_tile(start_n, tk, k_row0, k_pt64, lo_t, hi_t, BLOCK_N)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, krows, col_ok, keep,
                                  qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC)
    _fwd_finish(Out + b * stride_ob + h * stride_oh, Lse + bh * Nq, rows, row_ok, acc, l_i, m_i,
                stride_on, stride_od, HEAD_DV, BLOCK_DV)


@triton.jit(do_not_specialize=_RANGE_INTS)
def _range_dq_kernel(
    Q, K, V, dO, Lse, Delta, dQ, sm_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H, Nq, Nk, q_pg, q_pt, k_pg, k_pt, lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b,
    G_OFFSET, SPAN,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h, row_ok, rows, lo_t, hi_t, klo, khi, tk, k_row0, k_pt64 = _range_query_tile(
        H, G_OFFSET, Nq, Nk, q_pg, q_pt, k_pg, k_pt, lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m,
        hi_b, BLOCK_M)
    q, do, lse2, delta, k_base, v_base, dq, qk_scale = _dq_start(
        Q, K, V, dO, Lse + bh * Nq, Delta + bh * Nq, b, h, rows, row_ok, sm_scale, stride_qb,
        stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb,
        stride_gh, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M)
    for start_n in range(klo, khi, BLOCK_N):
        krows, col_ok, keep = _range_key_tile(start_n, tk, k_row0, k_pt64, lo_t, hi_t, BLOCK_N)
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, krows, col_ok, keep,
                      qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                      HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC)
    store_rows(dQ + b * stride_dqb + h * stride_dqh, rows, stride_dqn, tl.arange(0, BLOCK_D),
               stride_dqd, row_ok, dq * sm_scale, HEAD_D)


@triton.jit(do_not_specialize=_RANGE_INTS)
def _range_dkdv_kernel(
    Q, K, V, dO, Lse, Delta, dK, dV, sm_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, Nq, Nk, q_pg, q_pt, k_pg, k_pt, lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b,
    G_OFFSET, SPAN,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PREC: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h = _batch_head(tl.program_id(2), H)
    g = (tl.program_id(1) + G_OFFSET).to(tl.int64)
    q_pg64 = q_pg.to(tl.int64)
    q_pt64 = q_pt.to(tl.int64)
    k_pt64 = k_pt.to(tl.int64)
    la, ld, lm, lb = lo_a.to(tl.int64), lo_d.to(tl.int64), lo_m.to(tl.int64), lo_b.to(tl.int64)
    ha, hd, hm, hb = hi_a.to(tl.int64), hi_d.to(tl.int64), hi_m.to(tl.int64), hi_b.to(tl.int64)
    tq = _group_len(Nq.to(tl.int64), g, q_pg64, q_pt64)
    tk = _group_len(Nk.to(tl.int64), g, k_pg.to(tl.int64), k_pt64)

    n0 = tl.program_id(0).to(tl.int64) * BLOCK_N
    tn = n0 + tl.arange(0, BLOCK_N)
    col_ok = tn < tk
    krows = g * k_pg.to(tl.int64) + tn * k_pt64
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k, v = load_row_pair(K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh,
                         krows, col_ok, stride_kn, stride_kd, stride_vn, stride_vd, offs_d,
                         offs_dv, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, True)
    # The queries that see a key of [n0, n1]: lo(t) <= n1 and hi(t) >= n0 -- an interval, as
    # both bounds are nondecreasing.
    n1 = tl.minimum(n0 + BLOCK_N, tk) - 1
    q_first = _first_with_f_ge(n0, ha, hd, hm, hb, tq)
    q_end = _last_with_f_le(n1, la, ld, lm, lb, tq) + 1
    q_end = tl.where(n0 < tk, q_end, q_first)  # a key tile past the group's end does nothing

    q_base = Q + b * stride_qb + h * stride_qh
    do_base = dO + b * stride_gb + h * stride_gh
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    for start_m in range(q_first, q_end, BLOCK_M):
        t = start_m + tl.arange(0, BLOCK_M)
        row_ok = t < tq
        lo_t = _affine(t, la, ld, lm, lb)
        hi_t = _affine(t, ha, hd, hm, hb)
        keep = (tn[:, None] >= lo_t[None, :]) & (tn[:, None] <= hi_t[None, :]) & row_ok[None, :]
        dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, Lse + bh * Nq, Delta + bh * Nq,
                            g * q_pg64 + t * q_pt64, row_ok, keep, qk_scale,
                            stride_qn, stride_qd, stride_gn, stride_gd,
                            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC)
    dk = dk * sm_scale
    dk_base = dK + b * stride_dkb + h * stride_dkh
    dv_base = dV + b * stride_dvb + h * stride_dvh
    if ACCUMULATE:
        # Key rows shared by several groups: the launcher runs the groups one after the other
        # into float32 buffers (zeroed), each adding its share.
        dk_old, dv_old = load_row_pair(dk_base, dv_base, krows, col_ok, stride_dkn, stride_dkd,
                                       stride_dvn, stride_dvd, offs_d, offs_dv, HEAD_D, HEAD_DV,
                                       BLOCK_D, BLOCK_DV, True)
        dk += dk_old
        dv += dv_old
    store_rows(dk_base, krows, stride_dkn, offs_d, stride_dkd, col_ok, dk, HEAD_D)
    store_rows(dv_base, krows, stride_dvn, offs_dv, stride_dvd, col_ok, dv, HEAD_DV)


# ----------------------------------------------------------------------------------------------
# block-sparse
# ----------------------------------------------------------------------------------------------


@triton.jit
def _block_sub_tile(pid, blk, BLOCK: tl.constexpr):
    """Program ``pid`` of a grid of ceil(blk / BLOCK) sub-tiles per block: (its block, its rows
    [BLOCK] int64, in-block mask, its first row, one past its last row)."""
    n_sub = tl.cdiv(blk, BLOCK)
    r = pid // n_sub
    sub = pid % n_sub
    local = sub * BLOCK + tl.arange(0, BLOCK)
    first = r * blk + sub * BLOCK
    return (r, (r * blk + local).to(tl.int64), local < blk, first,
            r * blk + tl.minimum(sub * BLOCK + BLOCK, blk))


@triton.jit
def _index_list(Ptr, h, ptr_head_stride, r):
    """[start, end) of block row (or column) r's entries in the index list of head h."""
    ptr = Ptr + h * ptr_head_stride + r
    return tl.load(ptr), tl.load(ptr + 1)


@triton.jit
def _listed_keys(ColIdx, e, blk, i_end, IS_CAUSAL: tl.constexpr):
    """(first key, end of the keys to visit, end of the block) of entry e of a block row."""
    j_start = tl.load(ColIdx + e) * blk
    j_stop = j_start + blk
    j_end = j_stop
    if IS_CAUSAL:
        j_end = tl.minimum(j_end, i_end)  # key sub-tiles wholly above the diagonal: skipped
    return j_start, j_end, j_stop


@triton.jit
def _block_key_tile(start_n, j_stop, rows, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """(key rows [BN] int64, in-block mask, keep [BM, BN]) of the key tile at start_n."""
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ok = cols < j_stop
    keep = col_ok[None, :]
    if IS_CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return cols.to(tl.int64), col_ok, keep


@triton.jit
def _block_fwd_kernel(
    Q, K, V, RowPtr, ColIdx, Out, Lse, sm_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, blk, ptr_head_stride,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h = _batch_head(tl.program_id(1), H)
    r, rows, row_ok, _, i_end = _block_sub_tile(tl.program_id(0), blk, BLOCK_M)
    q, k_base, v_base, acc, l_i, m_i, qk_scale = _fwd_start(
        Q, K, V, b, h, rows, row_ok, sm_scale, stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_vb, stride_vh, HEAD_D, BLOCK_D, BLOCK_DV, BLOCK_M)
    e_start, e_end = _index_list(RowPtr, h, ptr_head_stride, r)
    for e in range(e_start, e_end):
        j_start, j_end, j_stop = _listed_keys(ColIdx, e, blk, i_end, IS_CAUSAL)
        for start_n in range(j_start, j_end, BLOCK_N):
            cols, col_ok, keep = _block_key_tile(start_n, j_stop, rows, IS_CAUSAL, BLOCK_N)
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, cols, col_ok, keep,
                                      qk_scale, stride_kn, stride_kd, stride_vn,
                                      stride_vd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC)
    _fwd_finish(Out + b * stride_ob + h * stride_oh, Lse + bh * N, rows, row_ok, acc, l_i, m_i,
                stride_on, stride_od, HEAD_DV, BLOCK_DV)


@triton.jit
def _block_dq_kernel(
    Q, K, V, dO, Lse, Delta, RowPtr, ColIdx, dQ, sm_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H, N, blk, ptr_head_stride,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h = _batch_head(tl.program_id(1), H)
    r, rows, row_ok, _, i_end = _block_sub_tile(tl.program_id(0), blk, BLOCK_M)
    q, do, lse2, delta, k_base, v_base, dq, qk_scale = _dq_start(
        Q, K, V, dO, Lse + bh * N, Delta + bh * N, b, h, rows, row_ok, sm_scale, stride_qb,
        stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb,
        stride_gh, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M)
    e_start, e_end = _index_list(RowPtr, h, ptr_head_stride, r)
    for e in range(e_start, e_end):
        j_start, j_end, j_stop = _listed_keys(ColIdx, e, blk, i_end, IS_CAUSAL)
        for start_n in range(j_start, j_end, BLOCK_N):
            cols, col_ok, keep = _block_key_tile(start_n, j_stop, rows, IS_CAUSAL, BLOCK_N)
            dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, cols, col_ok, keep,
                          qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                          HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC)
    store_rows(dQ + b * stride_dqb + h * stride_dqh, rows, stride_dqn, tl.arange(0, BLOCK_D),
               stride_dqd, row_ok, dq * sm_scale, HEAD_D)


@triton.jit
def _block_dkdv_kernel(
    Q, K, V, dO, Lse, Delta, ColPtr, RowIdx, dK, dV, sm_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N, blk, ptr_head_stride,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h = _batch_head(tl.program_id(1), H)
    c, cols, col_ok, j_first, _ = _block_sub_tile(tl.program_id(0), blk, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k, v = load_row_pair(K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh,
                         cols, col_ok, stride_kn, stride_kd, stride_vn, stride_vd, offs_d,
                         offs_dv, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, True)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = dO + b * stride_gb + h * stride_gh
    e_start, e_end = _index_list(ColPtr, h, ptr_head_stride, c)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    for e in range(e_start, e_end):
        i_start = tl.load(RowIdx + e) * blk
        i_stop = i_start + blk
        if IS_CAUSAL:
            i_start = tl.maximum(i_start, j_first)  # rows before the tile's first key see none
        for start_m in range(i_start, i_stop, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < i_stop
            keep = row_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :])
            dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, Lse + bh * N, Delta + bh * N,
                                rows.to(tl.int64), row_ok, keep, qk_scale,
                                stride_qn, stride_qd, stride_gn, stride_gd,
                                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC)
    store_rows(dK + b * stride_dkb + h * stride_dkh, cols, stride_dkn, offs_d, stride_dkd,
               col_ok, dk * sm_scale, HEAD_D)
    store_rows(dV + b * stride_dvb + h * stride_dvh, cols, stride_dvn, offs_dv, stride_dvd,
               col_ok, dv, HEAD_DV)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

_KERNELS = {
    "range_fwd": _range_fwd_kernel, "range_dq": _range_dq_kernel,
    "range_dkdv": _range_dkdv_kernel, "block_fwd": _block_fwd_kernel,
    "block_dq": _block_dq_kernel, "block_dkdv": _block_dkdv_kernel,
}
_TUNE_KEYS = {
    "range_fwd": ["HEAD_D", "HEAD_DV", "SPAN"], "range_dq": ["HEAD_D", "HEAD_DV", "SPAN"],
    "range_dkdv": ["HEAD_D", "HEAD_DV", "SPAN"],
    "block_fwd": ["HEAD_D", "HEAD_DV", "blk", "IS_CAUSAL"],
    "block_dq": ["HEAD_D", "HEAD_DV", "blk", "IS_CAUSAL"],
    "block_dkdv": ["HEAD_D", "HEAD_DV", "blk", "IS_CAUSAL"],
}


@functools.lru_cache(maxsize=None)
def _autotuned(kernel: str, head_dim: int, value_dim: int, block: int | None):
    return triton.autotune(configs=configs_for(kernel, head_dim, value_dim, block),
                           key=_TUNE_KEYS[kernel])(_KERNELS[kernel])


def supports(q, k, v) -> str | None:
    """None when the Triton sparse kernels can run (q, k, v); otherwise why not (a sentence),
    so that the caller can route to another backend."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [B, H, L, D]"
        if t.dtype not in SUPPORTED_DTYPES:
            return f"the Triton sparse kernels take float16, bfloat16 or float32; got {t.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return "q, k, v must be on one device"
    if not (q.is_cuda or INTERPRETED):
        return (f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                f"attnkit.kernels.sparse is imported); got a {q.device.type} tensor")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or k.shape[:3] != v.shape[:3]:
        return (f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)} (k and v: [B, H, Nk, *], same B and H as q)")
    if q.shape[3] != k.shape[3]:
        return f"k head dim must equal q's ({q.shape[3]}); got {k.shape[3]}"
    for name, d in (("q/k head dim", q.shape[3]), ("v head dim", v.shape[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            return f"{name} must be in 1..{MAX_HEAD_DIM}; got {d}"
    return None


def _check(fn, q, k, v):
    why = supports(q, k, v)
    if why is None:
        return
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in (q, k, v)) \
            or "device" in why or "CUDA" in why:
        raise RuntimeError(f"{fn}: {why}")
    raise ValueError(f"{fn}: {why}")


def _launch(name, grid, args, consts, config, head_dim, value_dim, block=None, tune=True):
    """Run kernel ``name`` with ``config`` or, when None, autotuned (first candidate when
    interpreted, or when ``tune`` is False: a kernel that is not idempotent).  ``grid(BLOCK_M,
    BLOCK_N)`` gives the launch grid."""
    launch(_KERNELS[name], lambda: _autotuned(name, head_dim, value_dim, block),
           lambda: configs_for(name, head_dim, value_dim, block), grid, args, consts, config,
           tune)


def _consts(q, v):
    D, Dv = q.shape[3], v.shape[3]
    return dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv),
                DOT_PREC=dot_precision(q.dtype))


# ---- range parts -------------------------------------------------------------------------------


def _ints(fn, name, x, n):
    try:
        vals = [int(e) for e in x]
    except TypeError as exc:
        raise ValueError(f"{fn}: {name} must be a list of {n} ints; got {x!r}") from exc
    if len(vals) != n:
        raise ValueError(f"{fn}: {name} must have {n} entries; got {vals}")
    return vals


def _clamp64(x):
    # "No bound" arrives as a huge b; keep every bound inside int64 arithmetic in the kernel.
    return max(-(2 ** 50), min(2 ** 50, x))


def _group_len_host(n, g, pg, pt):
    return -(-max(n - g * pg, 0) // pt)


def _live_groups(n, G, pg):
    """Groups g < G with a row below n (the later ones are empty: no program is launched)."""
    if n <= 0:
        return 0
    return G if pg == 0 else min(G, -(-n // pg))


def _groups_disjoint(n, G, pg, pt):
    """Whether the rows g pg + t pt (< n) of groups g < G are pairwise distinct.  Groups g < g'
    share a row iff g' pg < n (group g' is not empty) and pt | (g' - g) pg; the smallest such
    g' - g is pt / gcd(pt, pg)."""
    live = _live_groups(n, G, pg)
    return live <= 1 or pt // math.gcd(pt, pg) >= live


def _range_setup(fn, q, k, v, view, lo, hi):
    G, q_pg, q_pt, k_pg, k_pt = _ints(fn, "view", view, 5)
    lo = [_clamp64(x) for x in _ints(fn, "lo", lo, 4)]
    hi = [_clamp64(x) for x in _ints(fn, "hi", hi, 4)]
    if G < 0 or q_pg < 0 or k_pg < 0 or q_pt < 1 or k_pt < 1:
        raise ValueError(f"{fn}: view = [G, q_pg, q_pt, k_pg, k_pt] needs G, q_pg, k_pg >= 0 "
                         f"and q_pt, k_pt >= 1; got {[G, q_pg, q_pt, k_pg, k_pt]}")
    for name, f in (("lo", lo), ("hi", hi)):
        if f[1] < 1 or f[2] < 0:
            raise ValueError(f"{fn}: {name} = [a, d, m, b] needs d >= 1 and m >= 0; got {f}")
    Nq, Nk = q.shape[2], k.shape[2]
    if not _groups_disjoint(Nq, G, q_pg, q_pt):
        raise ValueError(f"{fn}: the groups of view {[G, q_pg, q_pt, k_pg, k_pt]} share query "
                         f"rows (Nq = {Nq}); the kernels need each query row in at most one "
                         f"group")
    return (G, q_pg, q_pt, k_pg, k_pt), lo, hi


def _span(view, lo, hi, Nq, Nk):
    """Autotune bucket: the key span of a typical query row (middle of group 0)."""
    G, q_pg, q_pt, k_pg, k_pt = view
    tq, tk = _group_len_host(Nq, 0, q_pg, q_pt), _group_len_host(Nk, 0, k_pg, k_pt)

    def f(t, p):
        return (t + p[0]) // p[1] * p[2] + p[3]

    t = tq // 2
    width = min(f(t, hi), tk - 1) - max(f(t, lo), 0) + 1
    return min(4096, next_pow2(max(width, 1)))


def _range_common(view, lo, hi, Nq, Nk, H):
    G, q_pg, q_pt, k_pg, k_pt = view
    return (H, Nq, Nk, q_pg, q_pt, k_pg, k_pt, *lo, *hi)


@by_batch_slices(3, per_element=lambda first: first.shape[1])  # (grid: (..., B * H))
def sparse_range_fwd(q, k, v, view, lo, hi, scale, config=None, out_dtype=None):
    """One range part.  q [B,H,Nq,D], k [B,H,Nk,D], v [B,H,Nk,Dv]; ``view = [G, q_pg, q_pt,
    k_pg, k_pt]``, ``lo = hi = [a, d, m, b]`` (see the module docstring).  Returns ``(out
    [B,H,Nq,Dv] in q.dtype -- or ``out_dtype`` (q's dtype or float32: a part that a merge
    rounds once) --, lse [B,H,Nq] float32)``; rows outside every group or with an empty
    range: 0 / -inf.  ``scale`` None means 1/sqrt(D).  ``config``: a ``triton.Config``
    (BLOCK_M, BLOCK_N) to skip autotuning; see ``RANGE_FWD_CONFIGS``."""
    fn = "sparse_range_fwd"
    _check(fn, q, k, v)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in (q.dtype, torch.float32):
        raise ValueError(f"{fn}: out_dtype must be q's dtype or float32; got {out_dtype}")
    view, lo, hi = _range_setup(fn, q, k, v, view, lo, hi)
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q_pg, q_pt = view[1:3]
    G = _live_groups(Nq, view[0], q_pg)
    covered = sum(_group_len_host(Nq, g, q_pg, q_pt) for g in range(G)) == Nq
    # Rows in no group are never written by the kernel: start from 0 / -inf unless every row
    # belongs to a group (then every row is written).
    if covered:
        out = torch.empty((B, H, Nq, Dv), dtype=out_dtype, device=q.device)
        lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    else:
        out = torch.zeros((B, H, Nq, Dv), dtype=out_dtype, device=q.device)
        lse = torch.full((B, H, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    if B * H * Nq == 0 or G == 0:
        return out, lse
    tq_max = _group_len_host(Nq, 0, q_pg, q_pt)
    args = (q, k, v, out, lse, scale, *strides(q), *strides(k), *strides(v), *strides(out),
            *_range_common(view, lo, hi, Nq, Nk, H), 0, _span(view, lo, hi, Nq, Nk))
    _launch("range_fwd", lambda bm, bn: (cdiv(tq_max, bm), G, B * H), args, _consts(q, v),
            config, D, Dv)
    return out, lse


def _check_bwd_extras(fn, grad_out, q, v, lse, delta):
    B, H, Nq = q.shape[:3]
    Dv = v.shape[3]
    if tuple(grad_out.shape) != (B, H, Nq, Dv) or grad_out.dtype != q.dtype:
        raise ValueError(f"{fn}: grad_out must be {q.dtype} of shape {(B, H, Nq, Dv)}; got "
                         f"{grad_out.dtype} {tuple(grad_out.shape)}")
    for name, t in (("lse", lse), ("delta", delta)):
        if tuple(t.shape) != (B, H, Nq) or t.dtype != torch.float32:
            raise ValueError(f"{fn}: {name} must be float32 of shape {(B, H, Nq)}; got "
                             f"{t.dtype} {tuple(t.shape)}")
    return lse.contiguous(), delta.contiguous()


@by_batch_slices(6, per_element=lambda first: first.shape[1])  # (grid: (..., B * H))
def sparse_range_bwd(grad_out, q, k, v, lse, delta, view, lo, hi, scale, config=None):
    """Gradients of one range part given the merged ``lse`` and ``delta`` (float32 [B,H,Nq]):
    ``(dq, dk, dv)`` shaped and typed like q, k, v, zeros where the part touches nothing.
    ``config``: None (autotune), one ``triton.Config`` for both kernels, or a pair
    ``(dkdv_config, dq_config)``; see ``RANGE_DKDV_CONFIGS`` and ``RANGE_DQ_CONFIGS``."""
    fn = "sparse_range_bwd"
    _check(fn, q, k, v)
    view, lo, hi = _range_setup(fn, q, k, v, view, lo, hi)
    lse, delta = _check_bwd_extras(fn, grad_out, q, v, lse, delta)
    B, H, Nq, D = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cfg_dkdv, cfg_dq = split_config(config)
    G, q_pg, q_pt, k_pg, k_pt = view
    # Groups past the last query row touch nothing; past the last key row, too.
    G = min(_live_groups(Nq, G, q_pg), _live_groups(Nk, G, k_pg))
    q_covered = sum(_group_len_host(Nq, g, q_pg, q_pt) for g in range(G)) == Nq
    keys_disjoint = _groups_disjoint(Nk, G, k_pg, k_pt)
    k_covered = keys_disjoint and sum(_group_len_host(Nk, g, k_pg, k_pt) for g in range(G)) == Nk
    alloc_q = torch.empty if q_covered else torch.zeros
    alloc_k = torch.empty if k_covered else torch.zeros
    dq = alloc_q(q.shape, dtype=q.dtype, device=q.device)
    if B * H == 0 or G == 0 or Nq == 0 or Nk == 0:
        return (dq.zero_(), torch.zeros(k.shape, dtype=k.dtype, device=k.device),
                torch.zeros(v.shape, dtype=v.dtype, device=v.device))
    consts = _consts(q, v)
    common = _range_common(view, lo, hi, Nq, Nk, H)
    span = _span(view, lo, hi, Nq, Nk)
    tq_max = _group_len_host(Nq, 0, q_pg, q_pt)
    tk_max = _group_len_host(Nk, 0, k_pg, k_pt)
    bwd_strides = (*strides(q), *strides(k), *strides(v), *strides(grad_out))
    if keys_disjoint:
        dk = alloc_k(k.shape, dtype=k.dtype, device=k.device)
        dv = alloc_k(v.shape, dtype=v.dtype, device=v.device)
        _launch("range_dkdv", lambda bm, bn: (cdiv(tk_max, bn), G, B * H),
                (q, k, v, grad_out, lse, delta, dk, dv, scale, *bwd_strides, *strides(dk),
                 *strides(dv), *common, 0, span), dict(consts, ACCUMULATE=False), cfg_dkdv,
                D, Dv)
    else:
        # Groups share key rows: one launch per group, adding into float32 buffers in order
        # (deterministic).  Not autotuned: a benchmark run would add twice.
        dk32 = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv32 = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for g in range(G):
            if _group_len_host(Nk, g, k_pg, k_pt) == 0 or _group_len_host(Nq, g, q_pg, q_pt) == 0:
                continue
            _launch("range_dkdv", lambda bm, bn: (cdiv(tk_max, bn), 1, B * H),
                    (q, k, v, grad_out, lse, delta, dk32, dv32, scale, *bwd_strides,
                     *strides(dk32), *strides(dv32), *common, g, span),
                    dict(consts, ACCUMULATE=True), cfg_dkdv, D, Dv, tune=False)
        dk, dv = dk32.to(k.dtype), dv32.to(v.dtype)
    _launch("range_dq", lambda bm, bn: (cdiv(tq_max, bm), G, B * H),
            (q, k, v, grad_out, lse, delta, dq, scale, *bwd_strides, *strides(dq), *common, 0,
             span), consts, cfg_dq, D, Dv)
    return dq, dk, dv


# ---- block-sparse -----------------------------------------------------------------------------


def _block_setup(fn, q, k, v, ptr, idx, block, ptr_name, idx_name):
    B, H, N, _ = q.shape
    block = int(block)
    if block < 1:
        raise ValueError(f"{fn}: block must be >= 1; got {block}")
    if k.shape[2] != N:
        raise ValueError(f"{fn}: block-sparse attention needs Nk == Nq; got {k.shape[2]} and {N}")
    if N % block:
        raise ValueError(f"{fn}: N ({N}) must be a multiple of block ({block})")
    nb = N // block
    for name, t in ((ptr_name, ptr), (idx_name, idx)):
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"{fn}: {name} must be int32 on {q.device}; got {t.dtype} on "
                             f"{t.device}")
    if ptr.dim() != 2 or ptr.shape[1] != nb + 1 or ptr.shape[0] not in (1, H):
        raise ValueError(f"{fn}: {ptr_name} must be [1 or H={H}, nb+1={nb + 1}]; got "
                         f"{tuple(ptr.shape)}")
    if idx.dim() != 1:
        raise ValueError(f"{fn}: {idx_name} must be 1-D; got {tuple(idx.shape)}")
    ptr = ptr.contiguous()
    # Hl == 1: every head reads row 0 of the lists (head stride 0).
    head_stride = nb + 1 if ptr.shape[0] == H and H > 1 else 0
    return block, nb, ptr, idx.contiguous(), head_stride


@by_batch_slices(3, per_element=lambda first: first.shape[1])  # (grid: (..., B * H))
def block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale, config=None):
    """Block-sparse attention over per-row index lists (``BlockLayout.index_lists()``).
    q, k [B,H,N,D], v [B,H,N,Dv], N = nb * block (any block >= 1); ``row_ptr`` int32 [Hl,nb+1]
    (Hl = 1 or H), ``col_idx`` int32 [nnz].  Returns ``(out [B,H,N,Dv] q.dtype, lse [B,H,N]
    float32)``; rows with no block: 0 / -inf.  ``config``: see ``BLOCK_FWD_CONFIGS``."""
    fn = "block_sparse_fwd"
    _check(fn, q, k, v)
    block, nb, row_ptr, col_idx, head_stride = _block_setup(fn, q, k, v, row_ptr, col_idx, block,
                                                            "row_ptr", "col_idx")
    B, H, N, D = q.shape
    Dv = v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty((B, H, N, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    if B * H * N == 0:
        return out, lse
    args = (q, k, v, row_ptr, col_idx, out, lse, scale, *strides(q), *strides(k),
            *strides(v), *strides(out), H, N, block, head_stride)
    consts = dict(_consts(q, v), IS_CAUSAL=bool(causal))
    _launch("block_fwd", lambda bm, bn: (nb * cdiv(block, bm), B * H), args, consts,
            config, D, Dv, block)
    return out, lse


@by_batch_slices(6, per_element=lambda first: first.shape[1])  # (grid: (..., B * H))
def block_sparse_bwd(grad_out, q, k, v, lse, delta, row_ptr, col_idx, col_ptr, row_idx, block,
                     causal, scale, config=None):
    """Gradients of :func:`block_sparse_fwd` given the merged ``lse`` and ``delta`` (float32
    [B,H,N]); ``col_ptr`` / ``row_idx``: the transposed lists.  Returns ``(dq, dk, dv)`` like
    q, k, v.  ``config``: None, one ``triton.Config`` or ``(dkdv_config, dq_config)``."""
    fn = "block_sparse_bwd"
    _check(fn, q, k, v)
    block, nb, row_ptr, col_idx, head_stride = _block_setup(fn, q, k, v, row_ptr, col_idx, block,
                                                            "row_ptr", "col_idx")
    _, _, col_ptr, row_idx, head_stride_t = _block_setup(fn, q, k, v, col_ptr, row_idx, block,
                                                         "col_ptr", "row_idx")
    lse, delta = _check_bwd_extras(fn, grad_out, q, v, lse, delta)
    B, H, N, D = q.shape
    Dv = v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cfg_dkdv, cfg_dq = split_config(config)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if B * H * N == 0:
        return dq, dk, dv
    consts = dict(_consts(q, v), IS_CAUSAL=bool(causal))
    bwd_strides = (*strides(q), *strides(k), *strides(v), *strides(grad_out))
    _launch("block_dkdv", lambda bm, bn: (nb * cdiv(block, bn), B * H),
            (q, k, v, grad_out, lse, delta, col_ptr, row_idx, dk, dv, scale, *bwd_strides,
             *strides(dk), *strides(dv), H, N, block, head_stride_t), consts, cfg_dkdv, D, Dv,
            block)
    _launch("block_dq", lambda bm, bn: (nb * cdiv(block, bm), B * H),
            (q, k, v, grad_out, lse, delta, row_ptr, col_idx, dq, scale, *bwd_strides,
             *strides(dq), H, N, block, head_stride), consts, cfg_dq, D, Dv, block)
    return dq, dk, dv

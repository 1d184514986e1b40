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
from torch.library import wrap_triton

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

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

# ----------------------------------------------------------------------------------------------
# autotune search spaces
# ----------------------------------------------------------------------------------------------


def _cfg(block_m, block_n, num_warps, num_stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps,
                         num_stages=num_stages)


# Range parts are often narrow bands (width s+1 .. 2s+1, s = 64): a 64x64 tile of a 65-wide band
# spans 128 keys and wastes half its entries, 32x32 tiles waste a third; wide tiles pay off for
# the long column parts.  The autotuner is keyed on the typical key span of a row (SPAN).
RANGE_FWD_CONFIGS = [
    _cfg(64, 64, 4, 3),
    _cfg(128, 64, 8, 3),
    _cfg(64, 32, 4, 3),
    _cfg(32, 32, 4, 2),
    _cfg(16, 32, 2, 2),
]
RANGE_DQ_CONFIGS = [
    _cfg(64, 64, 4, 3),
    _cfg(64, 32, 4, 3),
    _cfg(32, 32, 4, 2),
    _cfg(16, 32, 2, 2),
]
# dK/dV: BLOCK_N is the key tile the program owns, BLOCK_M the query tile it loops over.
RANGE_DKDV_CONFIGS = [
    _cfg(64, 64, 4, 3),
    _cfg(32, 64, 4, 3),
    _cfg(32, 32, 4, 2),
    _cfg(16, 32, 2, 2),
]
# Block-sparse: sub-tiles of a block; configs larger than next_pow2(block) are filtered out, so
# each list ends with a 16x16 entry that every block size accepts.
BLOCK_FWD_CONFIGS = [
    _cfg(128, 64, 8, 3),
    _cfg(64, 64, 4, 3),
    _cfg(32, 32, 4, 2),
    _cfg(16, 16, 2, 2),
]
BLOCK_DQ_CONFIGS = [
    _cfg(64, 64, 4, 3),
    _cfg(64, 32, 4, 3),
    _cfg(32, 32, 4, 2),
    _cfg(16, 16, 2, 2),
]
BLOCK_DKDV_CONFIGS = [
    _cfg(64, 64, 4, 3),
    _cfg(32, 64, 4, 3),
    _cfg(32, 32, 4, 2),
    _cfg(16, 16, 2, 2),
]
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
    dmax = _pow2(max(head_dim, head_dim if value_dim is None else value_dim))
    configs = _CONFIG_LISTS[kernel]
    limit = _TILE_LIMIT[kernel.split("_")[1]]
    fit = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * dmax <= limit]
    if block is not None:
        tile = _pow2(block)
        fit = [c for c in fit if c.kwargs["BLOCK_M"] <= tile and c.kwargs["BLOCK_N"] <= tile]
    if not fit:  # never leave the autotuner empty-handed: fall back to the smallest tile
        fit = [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]
    return fit


def _pow2(x: int) -> int:
    # tl.dot needs every dimension >= 16 on GPUs, hence the floor.
    return max(16, triton.next_power_of_2(int(x)))


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
def _load_rows(base, rows, stride_n, offs_d, stride_d, row_ok, HEAD_D: tl.constexpr,
               BLOCK_D: tl.constexpr):
    ptrs = base + rows[:, None] * stride_n + offs_d[None, :] * stride_d
    if BLOCK_D != HEAD_D:
        return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0)


@triton.jit
def _store_rows(base, rows, stride_n, offs_d, stride_d, row_ok, x, HEAD_D: tl.constexpr):
    ptrs = base + rows[:, None] * stride_n + offs_d[None, :] * stride_d
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))


@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr):
    """One flash step on base-2 scores s [BM, BN] (-inf = masked) and values v [BN, Dv]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only -inf keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _finish_rows(acc, l_i, m_i):
    """(out, lse in natural log); rows that saw no key: 0 and -inf."""
    attended = l_i > 0.0
    l_safe = tl.where(attended, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(attended, (m_i + tl.math.log2(l_safe)) * _LN2, float("-inf"))
    return out, lse


@triton.jit
def _lse2(lse):
    # Rows with lse = -inf saw no key: +inf makes every p of the row exp2(-inf) = 0.
    return tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E


# ----------------------------------------------------------------------------------------------
# range parts
# ----------------------------------------------------------------------------------------------

_RANGE_INTS = ["Nq", "Nk", "q_pg", "q_pt", "k_pg", "k_pt", "lo_a", "lo_d", "lo_m", "lo_b",
               "hi_a", "hi_d", "hi_m", "hi_b"]


@triton.jit
def _range_query_tile(pid_m, g, Nq, Nk, q_pg, q_pt, k_pg, k_pt,
                      lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b, BLOCK_M: tl.constexpr):
    """For the query tile pid_m of group g: (t [BM], row_ok, q rows, per-row lo / hi, key span
    [klo, khi) of the tile, Tk_g).  All int64."""
    g = g.to(tl.int64)
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
    return (t, row_ok, rows, lo_t, hi_t, klo.to(tl.int32), tl.maximum(khi, klo).to(tl.int32),
            tk.to(tl.int32), g * k_pg, k_pt)


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
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    t, row_ok, rows, lo_t, hi_t, klo, khi, tk, k_row0, k_pt64 = _range_query_tile(
        tl.program_id(0), tl.program_id(1) + G_OFFSET, Nq, Nk, q_pg, q_pt, k_pg, k_pt,
        lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, stride_qn, offs_d, stride_qd, row_ok,
                   HEAD_D, BLOCK_D)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    qk_scale = sm_scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(klo, khi, BLOCK_N):
        tn = start_n + tl.arange(0, BLOCK_N)
        col_ok = tn < tk
        krows = k_row0 + tn * k_pt64
        k = _load_rows(k_base, krows, stride_kn, offs_d, stride_kd, col_ok, HEAD_D, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        keep = (tn[None, :] >= lo_t[:, None]) & (tn[None, :] <= hi_t[:, None]) & col_ok[None, :]
        s = tl.where(keep, s, float("-inf"))
        v = _load_rows(v_base, krows, stride_vn, offs_dv, stride_vd, col_ok, HEAD_DV, BLOCK_DV)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, DOT_PREC)
    out, lse = _finish_rows(acc, l_i, m_i)
    _store_rows(Out + b * stride_ob + h * stride_oh, rows, stride_on, offs_dv, stride_od, row_ok,
                out, HEAD_DV)
    tl.store(Lse + bh * Nq + rows, lse, mask=row_ok)


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
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    t, row_ok, rows, lo_t, hi_t, klo, khi, tk, k_row0, k_pt64 = _range_query_tile(
        tl.program_id(0), tl.program_id(1) + G_OFFSET, Nq, Nk, q_pg, q_pt, k_pg, k_pt,
        lo_a, lo_d, lo_m, lo_b, hi_a, hi_d, hi_m, hi_b, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, stride_qn, offs_d, stride_qd, row_ok,
                   HEAD_D, BLOCK_D)
    do = _load_rows(dO + b * stride_gb + h * stride_gh, rows, stride_gn, offs_dv, stride_gd,
                    row_ok, HEAD_DV, BLOCK_DV)
    lse2 = _lse2(tl.load(Lse + bh * Nq + rows, mask=row_ok, other=float("inf")))
    delta = tl.load(Delta + bh * Nq + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    qk_scale = sm_scale * _LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(klo, khi, BLOCK_N):
        tn = start_n + tl.arange(0, BLOCK_N)
        col_ok = tn < tk
        krows = k_row0 + tn * k_pt64
        k = _load_rows(k_base, krows, stride_kn, offs_d, stride_kd, col_ok, HEAD_D, BLOCK_D)
        v = _load_rows(v_base, krows, stride_vn, offs_dv, stride_vd, col_ok, HEAD_DV, BLOCK_DV)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        keep = (tn[None, :] >= lo_t[:, None]) & (tn[None, :] <= hi_t[:, None]) & col_ok[None, :]
        p = tl.where(keep, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    _store_rows(dQ + b * stride_dqb + h * stride_dqh, rows, stride_dqn, offs_d, stride_dqd,
                row_ok, dq * sm_scale, HEAD_D)


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
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
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
    k = _load_rows(K + b * stride_kb + h * stride_kh, krows, stride_kn, offs_d, stride_kd, col_ok,
                   HEAD_D, BLOCK_D)
    v = _load_rows(V + b * stride_vb + h * stride_vh, krows, stride_vn, offs_dv, stride_vd,
                   col_ok, HEAD_DV, BLOCK_DV)
    # The queries that see a key of [n0, n1]: lo(t) <= n1 and hi(t) >= n0 -- an interval, as
    # both bounds are nondecreasing.
    n1 = tl.minimum(n0 + BLOCK_N, tk) - 1
    q_first = _first_with_f_ge(n0, ha, hd, hm, hb, tq)
    q_end = _last_with_f_le(n1, la, ld, lm, lb, tq) + 1
    q_end = tl.where(n0 < tk, q_end, q_first)  # a key tile past the group's end does nothing

    q_base = Q + b * stride_qb + h * stride_qh
    do_base = dO + b * stride_gb + h * stride_gh
    qk_scale = sm_scale * _LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # Transposed tiles ([keys, queries]) so that dk and dv come out of plain dots.
    for start_m in range(q_first, q_end, BLOCK_M):
        t = start_m + tl.arange(0, BLOCK_M)
        row_ok = t < tq
        rows = g * q_pg64 + t * q_pt64
        q = _load_rows(q_base, rows, stride_qn, offs_d, stride_qd, row_ok, HEAD_D, BLOCK_D)
        do = _load_rows(do_base, rows, stride_gn, offs_dv, stride_gd, row_ok, HEAD_DV, BLOCK_DV)
        lse2 = _lse2(tl.load(Lse + bh * Nq + rows, mask=row_ok, other=float("inf")))
        delta = tl.load(Delta + bh * Nq + rows, mask=row_ok, other=0.0)
        lo_t = _affine(t, la, ld, lm, lb)
        hi_t = _affine(t, ha, hd, hm, hb)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
        keep = (tn[:, None] >= lo_t[None, :]) & (tn[:, None] <= hi_t[None, :]) & row_ok[None, :]
        p_t = tl.where(keep, tl.math.exp2(s_t - lse2[None, :]), 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    dk = dk * sm_scale
    dk_base = dK + b * stride_dkb + h * stride_dkh
    dv_base = dV + b * stride_dvb + h * stride_dvh
    if ACCUMULATE:
        # Key rows shared by several groups: the launcher runs the groups one after the other
        # into float32 buffers (zeroed), each adding its share.
        dk += _load_rows(dk_base, krows, stride_dkn, offs_d, stride_dkd, col_ok, HEAD_D, BLOCK_D)
        dv += _load_rows(dv_base, krows, stride_dvn, offs_dv, stride_dvd, col_ok, HEAD_DV,
                         BLOCK_DV)
    _store_rows(dk_base, krows, stride_dkn, offs_d, stride_dkd, col_ok, dk, HEAD_D)
    _store_rows(dv_base, krows, stride_dvn, offs_dv, stride_dvd, col_ok, dv, HEAD_DV)


# ----------------------------------------------------------------------------------------------
# block-sparse
# ----------------------------------------------------------------------------------------------


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
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    n_sub = tl.cdiv(blk, BLOCK_M)  # query sub-tiles per block
    r = tl.program_id(0) // n_sub  # query block
    sub = tl.program_id(0) % n_sub  # sub-tile within it
    local = sub * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < blk
    rows = (r * blk + local).to(tl.int64)
    i_end = r * blk + tl.minimum(sub * BLOCK_M + BLOCK_M, blk)  # one past the tile's last row
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, stride_qn, offs_d, stride_qd, row_ok,
                   HEAD_D, BLOCK_D)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    ptr = RowPtr + h * ptr_head_stride + r
    e_start = tl.load(ptr)
    e_end = tl.load(ptr + 1)
    qk_scale = sm_scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for e in range(e_start, e_end):
        c = tl.load(ColIdx + e)
        j_start = c * blk
        j_stop = j_start + blk
        j_end = j_stop
        if IS_CAUSAL:
            j_end = tl.minimum(j_end, i_end)  # key sub-tiles wholly above the diagonal: skipped
        for start_n in range(j_start, j_end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            col_ok = cols < j_stop
            k = _load_rows(k_base, cols.to(tl.int64), stride_kn, offs_d, stride_kd, col_ok,
                           HEAD_D, BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            keep = col_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            s = tl.where(keep, s, float("-inf"))
            v = _load_rows(v_base, cols.to(tl.int64), stride_vn, offs_dv, stride_vd, col_ok,
                           HEAD_DV, BLOCK_DV)
            acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, DOT_PREC)
    out, lse = _finish_rows(acc, l_i, m_i)
    _store_rows(Out + b * stride_ob + h * stride_oh, rows, stride_on, offs_dv, stride_od, row_ok,
                out, HEAD_DV)
    tl.store(Lse + bh * N + rows, lse, mask=row_ok)


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
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    n_sub = tl.cdiv(blk, BLOCK_M)
    r = tl.program_id(0) // n_sub
    sub = tl.program_id(0) % n_sub
    local = sub * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < blk
    rows = (r * blk + local).to(tl.int64)
    i_end = r * blk + tl.minimum(sub * BLOCK_M + BLOCK_M, blk)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, rows, stride_qn, offs_d, stride_qd, row_ok,
                   HEAD_D, BLOCK_D)
    do = _load_rows(dO + b * stride_gb + h * stride_gh, rows, stride_gn, offs_dv, stride_gd,
                    row_ok, HEAD_DV, BLOCK_DV)
    lse2 = _lse2(tl.load(Lse + bh * N + rows, mask=row_ok, other=float("inf")))
    delta = tl.load(Delta + bh * N + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    ptr = RowPtr + h * ptr_head_stride + r
    e_start = tl.load(ptr)
    e_end = tl.load(ptr + 1)
    qk_scale = sm_scale * _LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for e in range(e_start, e_end):
        c = tl.load(ColIdx + e)
        j_start = c * blk
        j_stop = j_start + blk
        j_end = j_stop
        if IS_CAUSAL:
            j_end = tl.minimum(j_end, i_end)
        for start_n in range(j_start, j_end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            col_ok = cols < j_stop
            k = _load_rows(k_base, cols.to(tl.int64), stride_kn, offs_d, stride_kd, col_ok,
                           HEAD_D, BLOCK_D)
            v = _load_rows(v_base, cols.to(tl.int64), stride_vn, offs_dv, stride_vd, col_ok,
                           HEAD_DV, BLOCK_DV)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            keep = col_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            p = tl.where(keep, tl.math.exp2(s - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    _store_rows(dQ + b * stride_dqb + h * stride_dqh, rows, stride_dqn, offs_d, stride_dqd,
                row_ok, dq * sm_scale, HEAD_D)


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
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    n_sub = tl.cdiv(blk, BLOCK_N)  # key sub-tiles per block
    c = tl.program_id(0) // n_sub  # key block
    sub = tl.program_id(0) % n_sub
    local = sub * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = local < blk
    cols = (c * blk + local).to(tl.int64)
    j_first = c * blk + sub * BLOCK_N  # the tile's first key
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_rows(K + b * stride_kb + h * stride_kh, cols, stride_kn, offs_d, stride_kd, col_ok,
                   HEAD_D, BLOCK_D)
    v = _load_rows(V + b * stride_vb + h * stride_vh, cols, stride_vn, offs_dv, stride_vd,
                   col_ok, HEAD_DV, BLOCK_DV)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = dO + b * stride_gb + h * stride_gh
    ptr = ColPtr + h * ptr_head_stride + c
    e_start = tl.load(ptr)
    e_end = tl.load(ptr + 1)
    qk_scale = sm_scale * _LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for e in range(e_start, e_end):
        rq = tl.load(RowIdx + e)
        i_start = rq * blk
        i_stop = i_start + blk
        if IS_CAUSAL:
            i_start = tl.maximum(i_start, j_first)  # rows before the tile's first key see none
        for start_m in range(i_start, i_stop, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < i_stop
            rows64 = rows.to(tl.int64)
            q = _load_rows(q_base, rows64, stride_qn, offs_d, stride_qd, row_ok, HEAD_D, BLOCK_D)
            do = _load_rows(do_base, rows64, stride_gn, offs_dv, stride_gd, row_ok, HEAD_DV,
                            BLOCK_DV)
            lse2 = _lse2(tl.load(Lse + bh * N + rows64, mask=row_ok, other=float("inf")))
            delta = tl.load(Delta + bh * N + rows64, mask=row_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale
            keep = row_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[:, None] <= rows64[None, :])
            p_t = tl.where(keep, tl.math.exp2(s_t - lse2[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    _store_rows(dK + b * stride_dkb + h * stride_dkh, cols, stride_dkn, offs_d, stride_dkd,
                col_ok, dk * sm_scale, HEAD_D)
    _store_rows(dV + b * stride_dvb + h * stride_dvh, cols, stride_dvn, offs_dv, stride_dvd,
                col_ok, dv, HEAD_DV)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

# Under TRITON_INTERPRET=1, @triton.jit gives an interpreted function instead of a JITFunction;
# the autotuner cannot benchmark there (no GPU timers), so the launchers pick a config.
_INTERPRETED = not isinstance(_block_fwd_kernel, triton.runtime.JITFunction)

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
    if not (q.is_cuda or _INTERPRETED):
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


def _strides(t):
    return tuple(t.stride())


def _dot_precision(dtype):
    # float32 inputs: full-precision products (TF32 would miss the 2e-5 accuracy target);
    # float16 / bfloat16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _split_config(config):
    if config is None or isinstance(config, triton.Config):
        return config, config
    return tuple(config)


def _launch(name, grid, args, consts, config, head_dim, value_dim, block=None, tune=True):
    """Run kernel ``name`` with ``config`` or, when None, autotuned (first candidate when
    interpreted, or when ``tune`` is False: a kernel that is not idempotent).  ``grid(BLOCK_M,
    BLOCK_N)`` gives the launch grid."""
    if config is None and (_INTERPRETED or not tune):
        config = configs_for(name, head_dim, value_dim, block)[0]
    if config is None:
        tuned = _autotuned(name, head_dim, value_dim, block)
        wrap_triton(tuned)[lambda meta: grid(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
    else:
        kw = dict(config.kwargs)
        launch = dict(kw, num_warps=config.num_warps, num_stages=config.num_stages)
        wrap_triton(_KERNELS[name])[grid(kw["BLOCK_M"], kw["BLOCK_N"])](*args, **consts,
                                                                        **launch)


def _consts(q, v):
    D, Dv = q.shape[3], v.shape[3]
    return dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(Dv),
                DOT_PREC=_dot_precision(q.dtype))


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
    return min(4096, triton.next_power_of_2(max(width, 1)))


def _range_common(view, lo, hi, Nq, Nk, H):
    G, q_pg, q_pt, k_pg, k_pt = view
    return (H, Nq, Nk, q_pg, q_pt, k_pg, k_pt, *lo, *hi)


def sparse_range_fwd(q, k, v, view, lo, hi, scale, config=None):
    """One range part.  q [B,H,Nq,D], k [B,H,Nk,D], v [B,H,Nk,Dv]; ``view = [G, q_pg, q_pt,
    k_pg, k_pt]``, ``lo = hi = [a, d, m, b]`` (see the module docstring).  Returns ``(out
    [B,H,Nq,Dv] in q.dtype, lse [B,H,Nq] float32)``; rows outside every group or with an empty
    range: 0 / -inf.  ``scale`` None means 1/sqrt(D).  ``config``: a ``triton.Config``
    (BLOCK_M, BLOCK_N) to skip autotuning; see ``RANGE_FWD_CONFIGS``."""
    fn = "sparse_range_fwd"
    _check(fn, q, k, v)
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
        out = torch.empty((B, H, Nq, Dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    else:
        out = torch.zeros((B, H, Nq, Dv), dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    if B * H * Nq == 0 or G == 0:
        return out, lse
    tq_max = _group_len_host(Nq, 0, q_pg, q_pt)
    args = (q, k, v, out, lse, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            *_range_common(view, lo, hi, Nq, Nk, H), 0, _span(view, lo, hi, Nq, Nk))
    _launch("range_fwd", lambda bm, bn: (triton.cdiv(tq_max, bm), G, B * H), args, _consts(q, v),
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
    cfg_dkdv, cfg_dq = _split_config(config)
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
    bwd_strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))
    if keys_disjoint:
        dk = alloc_k(k.shape, dtype=k.dtype, device=k.device)
        dv = alloc_k(v.shape, dtype=v.dtype, device=v.device)
        _launch("range_dkdv", lambda bm, bn: (triton.cdiv(tk_max, bn), G, B * H),
                (q, k, v, grad_out, lse, delta, dk, dv, scale, *bwd_strides, *_strides(dk),
                 *_strides(dv), *common, 0, span), dict(consts, ACCUMULATE=False), cfg_dkdv,
                D, Dv)
    else:
        # Groups share key rows: one launch per group, adding into float32 buffers in order
        # (deterministic).  Not autotuned: a benchmark run would add twice.
        dk32 = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv32 = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for g in range(G):
            if _group_len_host(Nk, g, k_pg, k_pt) == 0 or _group_len_host(Nq, g, q_pg, q_pt) == 0:
                continue
            _launch("range_dkdv", lambda bm, bn: (triton.cdiv(tk_max, bn), 1, B * H),
                    (q, k, v, grad_out, lse, delta, dk32, dv32, scale, *bwd_strides,
                     *_strides(dk32), *_strides(dv32), *common, g, span),
                    dict(consts, ACCUMULATE=True), cfg_dkdv, D, Dv, tune=False)
        dk, dv = dk32.to(k.dtype), dv32.to(v.dtype)
    _launch("range_dq", lambda bm, bn: (triton.cdiv(tq_max, bm), G, B * H),
            (q, k, v, grad_out, lse, delta, dq, scale, *bwd_strides, *_strides(dq), *common, 0,
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
    args = (q, k, v, row_ptr, col_idx, out, lse, scale, *_strides(q), *_strides(k),
            *_strides(v), *_strides(out), H, N, block, head_stride)
    consts = dict(_consts(q, v), IS_CAUSAL=bool(causal))
    _launch("block_fwd", lambda bm, bn: (nb * triton.cdiv(block, bm), B * H), args, consts,
            config, D, Dv, block)
    return out, lse


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
    cfg_dkdv, cfg_dq = _split_config(config)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if B * H * N == 0:
        return dq, dk, dv
    consts = dict(_consts(q, v), IS_CAUSAL=bool(causal))
    bwd_strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad_out))
    _launch("block_dkdv", lambda bm, bn: (nb * triton.cdiv(block, bn), B * H),
            (q, k, v, grad_out, lse, delta, col_ptr, row_idx, dk, dv, scale, *bwd_strides,
             *_strides(dk), *_strides(dv), H, N, block, head_stride_t), consts, cfg_dkdv, D, Dv,
            block)
    _launch("block_dq", lambda bm, bn: (nb * triton.cdiv(block, bm), B * H),
            (q, k, v, grad_out, lse, delta, row_ptr, col_idx, dq, scale, *bwd_strides,
             *_strides(dq), H, N, block, head_stride), consts, cfg_dq, D, Dv, block)
    return dq, dk, dv

"""Triton kernels of the modern Hopfield family: the fused multi-step update and the energy.

Layer 1 of the Hopfield family (see DESIGN.md): ``@triton.jit`` kernels and their launchers.  No
autograd here -- ``pytorch_ext/ops/hopfield.py`` registers the launchers as ``torch.library``
custom ops whose outputs are exactly those of the C++ op ``attnkit::hopfield_update_fwd``
(``csrc/ops.cpp``), so the op layer's backward (recomputing every step from the saved states)
serves both.

Launchers
---------
``hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state, *, split=None,
split_rows=None, config=None)`` -> ``(out, states, lse, applied)``
    state ``[B, H, S, D]``, stored ``[B, H, N, D]`` (N >= 1), values None or ``[B, H, N, Dv]``.
    R = ``steps`` retrievals; the first U = steps (steps - 1 with values) are updates in the
    stored space ξ <- softmax(β ξ Xᵀ) X, the last one with values reads out softmax(β ξ Xᵀ) V.
    Returns, float32: out ``[B, H, S, Dv or D]``; states ``[steps + 1, B, H, S, D]`` (the state
    before each retrieval and after the last update; with values entry ``steps`` is the
    stored-space update of the last state when ``final_state``, else zeros); lse
    ``[R, B, H, S]`` (natural log; +inf where a block of rows skipped the update, all frozen);
    applied bool ``[U, B, H, S]`` (whether update k changed the row).  ``tol``: None, or the
    per-row early stop of ``attnkit.hopfield_update`` (a row's first update always applies;
    after an applied update whose change max_d |new - old| is not > tol, NaN included, the
    row is frozen).
``hopfield_energy_fwd(state, stored, beta, config=None)`` -> ``(energy, lse)``, float32 ``[B, H, S]``
    lse = log Σ_i exp(β x_iᵀ ξ), energy = −lse/β + ½ξᵀξ + log(N)/β + ½M², M = max_i ‖x_i‖.

Dtypes float16, bfloat16, float32 (all inputs alike), fp32 accumulation; head dims 1..256 (tiles
padded to a power of two >= 16 with masked loads).  Inputs are made contiguous.

How
---
- **Fused** (the default): one program per (block of BLOCK_S queries, b·h).  The block's states
  stay in registers (float32) across all ``steps``; each step streams the stored patterns once in
  tiles of BLOCK_N rows, and each tile serves as keys *and* values (keys = values = X): scores
  ``s = β ξ Xᵀ`` (base 2, so ``exp2``), an online softmax (running max m, sum l), ``acc += P X``.
  One retrieval in float16 / bfloat16: the state fed to the dot and the probabilities fed to
  P X are rounded to the inputs' dtype (tensor cores); several: both products take float32
  operands (STATE_F32; 3xTF32), since each later step would amplify those roundings (see
  :func:`hopfield_update_fwd`).  The state itself and the accumulators stay float32.  A block
  whose rows are all frozen by ``tol`` skips the remaining updates.
- **Split-N** (S <= 16 against a long memory, few (b, h); flash-decoding): per step one
  program per (chunk of ``split_rows`` stored rows, b·h) writes a partial (m, l, acc) per query,
  and a merge program per b·h combines the chunks through their log-sum-exps
  (``M = max_c m_c``, weights ``exp(m_c − M)``), applies the update and the ``tol`` rule, and
  writes the next state into ``states`` -- which the next step's partial programs read.  Two
  launches per step: the whole GPU works on one query.
- **Energy**: one program per (query block, b·h), one pass over the stored patterns with an
  online log-sum-exp and the patterns' squared norms (for M²).  The energy is formed as
  ``−(m + log(l / N)) / β + ½ξᵀξ + ½M²`` with m the largest score: the large terms lse/β and
  log(N)/β never get subtracted from each other in float32.  (The C++ CPU kernel also recomputes
  rows with heavy cancellation in double; this kernel does not -- its error is a few float32
  ulps of the largest term.)
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._flash import (INTERPRETED, MAX_HEAD_DIM, SUPPORTED_DTYPES, _LN2, by_batch_slices, cdiv, cfg,
                     dot_precision, fitting, launch, next_pow2, pow2)

__all__ = [
    "hopfield_update_fwd",
    "hopfield_energy_fwd",
    "use_split",
    "UPDATE_CONFIGS",
    "SPLIT_MAX_S",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
]

SPLIT_MAX_S = 16  # split-N only for this few queries (one BLOCK_S = 16 tile)

_TILE_NAMES = ("BLOCK_S", "BLOCK_N")  # the config's tile sizes (kernels/_flash.py's names=)


def _cfg(block_s, block_n, num_warps, num_stages):
    return cfg(block_s, block_n, num_warps, num_stages, names=_TILE_NAMES)


# Fused update: the program keeps its [BLOCK_S, D] state and a [BLOCK_S, Dout] accumulator in
# registers, so the query tile is bounded by the head dim (see _TILE_LIMIT); chosen for
# sm_80 / sm_90 like the softmax forward, not yet tuned on a GPU.
UPDATE_CONFIGS = [
    _cfg(64, 64, 4, 3),
    _cfg(128, 64, 8, 3),
    _cfg(64, 32, 4, 2),
    _cfg(32, 64, 4, 3),
    _cfg(16, 64, 4, 2),
]
_TILE_LIMIT = 64 * 64 * 256  # BLOCK_S * BLOCK_N * padded head dim
_TUNE_KEY = ["HEAD_D", "HEAD_DV", "HAS_VALUES", "FINAL_STATE", "HAS_TOL", "STATE_F32"]


def configs_for(dmax: int, s: int) -> list:
    """Update configs whose tile fits for padded head dim ``dmax``; query tiles no wider than
    needed for ``s`` queries (an S = 7 call does not run 128-row tiles)."""
    # The 16-row config always passes the query filter and is the smallest tile, so fitting()'s
    # fallback is the same as over the whole list.
    narrow = [c for c in UPDATE_CONFIGS if c.kwargs["BLOCK_S"] <= pow2(max(1, s))]
    return fitting(narrow, dmax, _TILE_LIMIT, names=_TILE_NAMES)


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _state_operand(xi, X, STATE_F32: tl.constexpr):
    """The float32 state as the score product's operand: rounded to the inputs' dtype (their
    tensor-core products), or float32 as it is (STATE_F32)."""
    if STATE_F32:
        return xi
    else:
        return xi.to(X.dtype.element_ty)


@triton.jit
def _retrieve(xi, x_base, v_base, n_lo, n_hi, beta2, offs_d, offs_dv,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_S: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WITH_X: tl.constexpr,
              WITH_V: tl.constexpr, DOT_PREC: tl.constexpr, STATE_F32: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """One retrieval of the states ``xi`` [BLOCK_S, BLOCK_D] (:func:`_state_operand`) over
    stored rows [n_lo, n_hi) (n_hi > n_lo): returns (m [base 2], l, acc_x = Σ p X, acc_v = Σ p V),
    the accumulators unnormalized (divide by l), p = exp2(s − m).  Each X tile is loaded once and
    used as keys and (WITH_X) as values.  STATE_F32: both products take float32 operands (the
    tiles converted; DOT_PREC then 3xTF32 on a GPU), p unrounded."""
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc_x = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_S, BLOCK_DV], dtype=tl.float32)
    d_ok = offs_d < HEAD_D
    for start in range(n_lo, n_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_hi
        x = tl.load(x_base + offs_n[:, None] * HEAD_D + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if STATE_F32:
            x = x.to(tl.float32)
        s = tl.dot(xi, tl.trans(x), input_precision=DOT_PREC) * beta2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        # Every tile holds at least one valid row, so m_new is finite (for finite inputs) and
        # the first tile's alpha = exp2(-inf) = 0.
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        p_lo = p.to(x.dtype)
        if WITH_X:
            acc_x = tl.dot(p_lo, x, acc_x * alpha[:, None], input_precision=DOT_PREC)
        if WITH_V:
            v = tl.load(v_base + offs_n[:, None] * HEAD_DV + offs_dv[None, :],
                        mask=n_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
            if STATE_F32:
                v = v.to(tl.float32)
            acc_v = tl.dot(p_lo, v, acc_v * alpha[:, None], input_precision=DOT_PREC)
        m = m_new
    return m, l, acc_x, acc_v


@triton.jit
def _apply_update(xi, active, new, tol, HAS_TOL: tl.constexpr):
    """(xi, active, applied) after one stored-space update to ``new`` (float32 [BLOCK_S, BLOCK_D];
    padded columns are 0 in both).  The tol rule of attnkit.hopfield_update: active rows take
    the update; a row whose change is not > tol (NaN included) is frozen afterwards."""
    applied = active
    if HAS_TOL:
        diff = tl.abs(new - xi)
        change = tl.max(diff, 1)
        nans = tl.sum((diff != diff).to(tl.int32), 1)
        xi = tl.where(active[:, None], new, xi)
        active = active & (change > tol) & (nans == 0)
    else:
        xi = new
    return xi, active, applied


# ----------------------------------------------------------------------------------------------
# fused multi-step update
# ----------------------------------------------------------------------------------------------


@triton.jit
def _update_fused_kernel(
    State, X, V, Out, States, Lse, Applied,
    beta2, tol, S, N, plane, U,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_VALUES: tl.constexpr, FINAL_STATE: tl.constexpr, HAS_TOL: tl.constexpr,
    DOT_PREC: tl.constexpr, STATE_F32: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_s < S
    d_ok = offs_d < HEAD_D
    rows = bh * S + offs_s  # int64: row index into a [B*H*S] plane
    io_mask = row_ok[:, None] & d_ok[None, :]
    x_base = X + bh * N * HEAD_D
    v_base = V + bh * N * HEAD_DV

    xi = tl.load(State + rows[:, None] * HEAD_D + offs_d[None, :], mask=io_mask, other=0.0)
    xi = xi.to(tl.float32)
    tl.store(States + rows[:, None] * HEAD_D + offs_d[None, :], xi, mask=io_mask)
    active = row_ok  # padded rows count as frozen, so they never keep a block going
    for k in range(0, U):
        n_active = tl.sum(active.to(tl.int32), 0)
        if n_active > 0:
            m, l, acc, _unused = _retrieve(
                _state_operand(xi, X, STATE_F32), x_base, v_base, 0, N, beta2, offs_d, offs_dv,
                HEAD_D, HEAD_DV, BLOCK_S, BLOCK_D, BLOCK_DV, True, False, DOT_PREC, STATE_F32, BLOCK_N)
            xi, active, applied = _apply_update(xi, active, acc / l[:, None], tol, HAS_TOL)
            lse = (m + tl.math.log2(l)) * _LN2
        else:
            applied = offs_s < 0
            lse = tl.full([BLOCK_S], float("inf"), dtype=tl.float32)
        # (k * plane stays int32: rows is int64, so every sum with it is.)
        tl.store(Lse + k * plane + rows, lse, mask=row_ok)
        tl.store(Applied + k * plane + rows, applied.to(tl.uint8), mask=row_ok)
        tl.store(States + ((k + 1) * plane + rows)[:, None] * HEAD_D + offs_d[None, :], xi,
                 mask=io_mask)
    if HAS_VALUES:
        m, l, acc_x, acc_v = _retrieve(
            _state_operand(xi, X, STATE_F32), x_base, v_base, 0, N, beta2, offs_d, offs_dv,
            HEAD_D, HEAD_DV, BLOCK_S, BLOCK_D, BLOCK_DV, FINAL_STATE, True, DOT_PREC, STATE_F32, BLOCK_N)
        tl.store(Lse + U * plane + rows, (m + tl.math.log2(l)) * _LN2, mask=row_ok)
        tl.store(Out + rows[:, None] * HEAD_DV + offs_dv[None, :], acc_v / l[:, None],
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
        if FINAL_STATE:
            # The stored-space counterpart of the read-out (a frozen row keeps its state).
            xi = tl.where(active[:, None], acc_x / l[:, None], xi)
            tl.store(States + ((U + 1) * plane + rows)[:, None] * HEAD_D + offs_d[None, :], xi,
                     mask=io_mask)
    else:
        tl.store(Out + rows[:, None] * HEAD_D + offs_d[None, :], xi, mask=io_mask)


# ----------------------------------------------------------------------------------------------
# split-N update (few queries, long memory): partials per chunk of stored rows, then a merge
# ----------------------------------------------------------------------------------------------


@triton.jit
def _split_partial_kernel(
    StatesK, X, V, Active, Pm, Pl, Pacc, Paccx,
    beta2, S, N, chunk, SPLITS,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_W: tl.constexpr, VALUE_STEP: tl.constexpr, FINAL_STATE: tl.constexpr,
    WITH_X: tl.constexpr, DOT_PREC: tl.constexpr, STATE_F32: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Partial (m, l, acc[, accx]) of chunk ``split`` for the S <= BLOCK_S states of one b·h,
    read from StatesK = states[k] ([B*H, S, D] float32).  Partials are full padded tiles:
    Pm / Pl [B*H, SPLITS, BLOCK_S], Pacc [.., BLOCK_S, BLOCK_W], Paccx [.., BLOCK_S, BLOCK_D]."""
    split = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_s < S
    rows = bh * S + offs_s
    active = tl.load(Active + rows, mask=row_ok, other=0)
    n_active = tl.sum(active.to(tl.int32), 0)
    if VALUE_STEP:
        n_active = n_active + 1  # the read-out runs for every row
    if n_active > 0:
        xi = tl.load(StatesK + rows[:, None] * HEAD_D + offs_d[None, :],
                     mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
        n_lo = split * chunk
        n_hi = tl.minimum(N, n_lo + chunk)
        m, l, acc_x, acc_v = _retrieve(
            _state_operand(xi, X, STATE_F32), X + bh * N * HEAD_D, V + bh * N * HEAD_DV, n_lo, n_hi,
            beta2, offs_d, offs_dv, HEAD_D, HEAD_DV, BLOCK_S, BLOCK_D, BLOCK_DV,
            WITH_X, VALUE_STEP, DOT_PREC, STATE_F32, BLOCK_N)
        part = bh * SPLITS + split
        tl.store(Pm + part * BLOCK_S + offs_s, m)
        tl.store(Pl + part * BLOCK_S + offs_s, l)
        if VALUE_STEP:
            tl.store(Pacc + (part * BLOCK_S + offs_s)[:, None] * BLOCK_W + offs_dv[None, :], acc_v)
            if FINAL_STATE:
                tl.store(Paccx + (part * BLOCK_S + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                         acc_x)
        else:
            tl.store(Pacc + (part * BLOCK_S + offs_s)[:, None] * BLOCK_W + offs_d[None, :], acc_x)


@triton.jit
def _split_merge_kernel(
    StatesK, StatesNext, Active, Pm, Pl, Pacc, Paccx, Out, LseK, AppliedK,
    tol, S, SPLITS,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_W: tl.constexpr, VALUE_STEP: tl.constexpr, FINAL_STATE: tl.constexpr,
    STORE_NEXT: tl.constexpr, WRITE_OUT: tl.constexpr, HAS_TOL: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the chunks of retrieval ``k`` for one b·h through their log-sum-exps, then finish
    the step as the fused kernel does: lse[k] (LseK), the update with the tol rule into
    states[k + 1] (StatesNext; and Active, applied[k] = AppliedK), or the read-out into Out
    (VALUE_STEP; StatesNext then only with FINAL_STATE, STORE_NEXT).  WRITE_OUT: the last update
    without values, whose state is also the output.  Per-step pointers are views made by the
    launcher (no step index in the kernel: an int argument equal to 1 becomes a constexpr)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_s < S
    rows = bh * S + offs_s
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_D)
    xi = tl.load(StatesK + rows[:, None] * HEAD_D + offs_d[None, :], mask=io_mask, other=0.0)
    active = tl.load(Active + rows, mask=row_ok, other=0) != 0
    n_active = tl.sum(active.to(tl.int32), 0)
    if VALUE_STEP:
        n_active = n_active + 1
    if n_active > 0:
        m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_S], dtype=tl.float32)
        acc_x = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
        acc_v = tl.zeros([BLOCK_S, BLOCK_DV], dtype=tl.float32)
        for c in range(0, SPLITS):
            part = bh * SPLITS + c
            m_c = tl.load(Pm + part * BLOCK_S + offs_s)
            l_c = tl.load(Pl + part * BLOCK_S + offs_s)
            m_new = tl.maximum(m, m_c)
            a = tl.math.exp2(m - m_new)
            w = tl.math.exp2(m_c - m_new)
            l = l * a + l_c * w
            if VALUE_STEP:
                pv = tl.load(Pacc + (part * BLOCK_S + offs_s)[:, None] * BLOCK_W + offs_dv[None, :])
                acc_v = acc_v * a[:, None] + pv * w[:, None]
                if FINAL_STATE:
                    px = tl.load(Paccx + (part * BLOCK_S + offs_s)[:, None] * BLOCK_D
                                 + offs_d[None, :])
                    acc_x = acc_x * a[:, None] + px * w[:, None]
            else:
                px = tl.load(Pacc + (part * BLOCK_S + offs_s)[:, None] * BLOCK_W + offs_d[None, :])
                acc_x = acc_x * a[:, None] + px * w[:, None]
            m = m_new
        lse = (m + tl.math.log2(l)) * _LN2
        if VALUE_STEP:
            tl.store(Out + rows[:, None] * HEAD_DV + offs_dv[None, :], acc_v / l[:, None],
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
            applied = active
            if FINAL_STATE:
                xi = tl.where(active[:, None], acc_x / l[:, None], xi)
        else:
            xi, active, applied = _apply_update(xi, active, acc_x / l[:, None], tol, HAS_TOL)
    else:
        applied = offs_s < 0
        lse = tl.full([BLOCK_S], float("inf"), dtype=tl.float32)
    tl.store(LseK + rows, lse, mask=row_ok)
    if not VALUE_STEP:
        tl.store(AppliedK + rows, applied.to(tl.uint8), mask=row_ok)
        tl.store(Active + rows, active.to(tl.int8), mask=row_ok)
    if STORE_NEXT:
        tl.store(StatesNext + rows[:, None] * HEAD_D + offs_d[None, :], xi, mask=io_mask)
    if WRITE_OUT:
        tl.store(Out + rows[:, None] * HEAD_D + offs_d[None, :], xi, mask=io_mask)


# ----------------------------------------------------------------------------------------------
# energy
# ----------------------------------------------------------------------------------------------


@triton.jit
def _energy_kernel(
    State, X, Energy, Lse,
    beta, beta2, log_n, S, N,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_s < S
    d_ok = offs_d < HEAD_D
    rows = bh * S + offs_s
    xi = tl.load(State + rows[:, None] * HEAD_D + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    xf = xi.to(tl.float32)
    xi_sq = tl.sum(xf * xf, 1)
    x_base = X + bh * N * HEAD_D
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_S], dtype=tl.float32)
    max_sq = tl.zeros([BLOCK_N], dtype=tl.float32)  # per tile slot; reduced at the end
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        x = tl.load(x_base + offs_n[:, None] * HEAD_D + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        x32 = x.to(tl.float32)
        max_sq = tl.maximum(max_sq, tl.sum(x32 * x32, 1))  # padded rows load 0: harmless
        s = tl.dot(xi, tl.trans(x), input_precision=DOT_PREC) * beta2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row whose scores so far are all -inf shifts by 0: exp2(-inf - -inf) would be NaN
        # where the energy is +inf (issue 15; tests/fuzz/test_regressions.py).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.math.exp2(m - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
        m = m_new
    top = m * _LN2  # the largest score β x_i·ξ
    lse = top + tl.log(l)
    energy = -(top + (tl.log(l) - log_n)) / beta + 0.5 * xi_sq + 0.5 * tl.max(max_sq, 0)
    tl.store(Lse + rows, lse, mask=row_ok)
    tl.store(Energy + rows, energy, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _autotuned(dmax: int, s_pow2: int):
    return triton.autotune(configs=configs_for(dmax, s_pow2), key=_TUNE_KEY)(_update_fused_kernel)


def _check(fn, state, stored, values):
    for name, t in (("state", state), ("stored", stored), ("values", values)):
        if t is None:
            continue
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
        if t.dtype != state.dtype or t.device != state.device:
            raise TypeError(f"{fn}: {name} must share the dtype and device of state")
    B, H, _, D = state.shape
    if stored.shape[0] != B or stored.shape[1] != H or stored.shape[3] != D:
        raise ValueError(f"{fn}: state {tuple(state.shape)} and stored {tuple(stored.shape)} must "
                         "agree on B, H and D")
    if stored.shape[2] < 1:
        raise ValueError(f"{fn}: needs at least one stored pattern (N >= 1)")
    if values is not None and tuple(values.shape[:3]) != tuple(stored.shape[:3]):
        raise ValueError(f"{fn}: values must be [B, H, N, Dv] matching stored; got "
                         f"{tuple(values.shape)}")
    dv = D if values is None else values.shape[3]
    for name, d in (("head dim D", D), ("value dim Dv", dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{fn}: {name} must be in 1..{MAX_HEAD_DIM}; got {d}")
    if not (state.is_cuda or INTERPRETED):
        raise RuntimeError(f"{fn}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set "
                           f"before attnkit.kernels.hopfield is imported); got {state.device.type}")


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any small number gives the same results


def use_split(bh: int, s: int, n: int, device=None) -> bool:
    """Whether the split-N path runs by default: a few queries (S <= 16) whose b·h programs
    alone would leave most of the GPU idle, against a memory of >= 4096 patterns."""
    sms = _sm_count(device if device is not None else torch.device("cpu"))
    return s <= SPLIT_MAX_S and n >= 4096 and bh < sms


def _split_rows_for(bh: int, n: int, block_n: int, device) -> int:
    # About 4 programs per SM over all b·h; at least 8 tiles per chunk so each program streams
    # enough rows to hide its start-up and the merge stays short.
    target = max(1, (4 * _sm_count(device)) // max(1, bh))
    rows = cdiv(n, target)
    return max(8 * block_n, cdiv(rows, block_n) * block_n)


def hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state, *, split=None,
                        split_rows=None, config=None):
    """All ``steps`` retrievals in one call; see the module docstring for shapes and outputs.

    ``split``: None (automatic, :func:`use_split`), True (split-N; needs S <= 16) or False
    (fused).  ``split_rows``: stored rows per chunk of the split path (a multiple of its
    BLOCK_N = 64; default: about four chunks per SM).  ``config``: a ``triton.Config`` with
    BLOCK_S / BLOCK_N for the fused kernel (default: autotuned over :data:`UPDATE_CONFIGS`).
    """
    fn = "hopfield_update_fwd"
    _check(fn, state, stored, values)
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"{fn}: steps must be >= 1; got {steps}")
    if not beta > 0:
        raise ValueError(f"{fn}: beta must be > 0; got {beta}")
    has_values = values is not None
    B, H, S, D = state.shape
    N = stored.shape[2]
    Dv = values.shape[3] if has_values else D
    U = steps - 1 if has_values else steps
    dev = state.device
    f32 = torch.float32
    out = torch.empty((B, H, S, Dv), dtype=f32, device=dev)
    states = torch.empty((steps + 1, B, H, S, D), dtype=f32, device=dev)
    lse = torch.empty((steps, B, H, S), dtype=f32, device=dev)
    applied = torch.empty((U, B, H, S), dtype=torch.bool, device=dev)
    if has_values and not final_state:
        states[steps].zero_()
    BH = B * H
    if S == 0 or BH == 0:
        return out, states, lse, applied
    state = state.contiguous()
    stored = stored.contiguous()
    v_t = values.contiguous() if has_values else stored  # stand-in pointer without values
    final_state = bool(final_state and has_values)
    has_tol = tol is not None
    beta2 = float(beta) * 1.4426950408889634
    tol_f = float(tol) if has_tol else 0.0
    block_d, block_dv = pow2(D), pow2(Dv)
    # Several retrievals in float16 / bfloat16: float32 operands (3xTF32 on a GPU), so that no
    # step rounds the state or the probabilities to the inputs' dtype -- the later steps carry
    # such a rounding through their Jacobian, which amplifies it where the fixed points are far
    # apart: session 30's random fuzzing, float16, 3 steps, beta = 0.123, D = 128, two patterns,
    # out 2.6e-2 off (1.0e-3 after one step, 3.3e-3 after two; each step's Jacobian ~8) where
    # the float16 reference was 4.9e-3 off and DESIGN.md's rule allowed 1.1e-2.  One retrieval
    # keeps the 16-bit products: its rounding goes no further.  (Not timed on a GPU: three
    # tensor-core products instead of one per product, on multi-step calls only.)
    state_f32 = state.dtype in (torch.float16, torch.bfloat16) and steps >= 2
    dot_prec = "tf32x3" if state_f32 else dot_precision(state.dtype)
    if split is None:
        split = use_split(BH, S, N, dev)
    if split and S > SPLIT_MAX_S:
        raise ValueError(f"{fn}: the split-N path takes S <= {SPLIT_MAX_S} queries; got S = {S}")
    applied_u8 = applied.view(torch.uint8)
    if not split:
        args = (state, stored, v_t, out, states, lse, applied_u8, beta2, tol_f, S, N, BH * S, U)
        consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                      HAS_VALUES=has_values, FINAL_STATE=final_state, HAS_TOL=has_tol,
                      DOT_PREC=dot_prec, STATE_F32=state_f32)
        dmax = max(block_d, block_dv)
        launch(_update_fused_kernel, lambda: _autotuned(dmax, next_pow2(S)),
               lambda: configs_for(dmax, S), lambda bs, bn: (cdiv(S, bs), BH), args,
               consts, config, names=_TILE_NAMES)
        return out, states, lse, applied

    # split-N
    block_s, block_n = SPLIT_MAX_S, 64 if max(block_d, block_dv) <= 128 else 32
    if split_rows is None:
        split_rows = _split_rows_for(BH, N, block_n, dev)
    split_rows = int(split_rows)
    if split_rows < 1:
        raise ValueError(f"{fn}: split_rows must be >= 1; got {split_rows}")
    splits = cdiv(N, split_rows)
    block_w = max(block_d, block_dv)
    pm = torch.empty((BH, splits, block_s), dtype=f32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty((BH, splits, block_s, block_w), dtype=f32, device=dev)
    paccx = torch.empty((BH, splits, block_s, block_d) if final_state else (1,), dtype=f32, device=dev)
    active = torch.ones((BH, S), dtype=torch.int8, device=dev)
    states[0].copy_(state.view(B, H, S, D))
    common = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_W=block_w,
                  FINAL_STATE=final_state, BLOCK_S=block_s)
    for k in range(steps):
        value_step = has_values and k == steps - 1
        # states[k] as a [B*H, S, D] view (a pointer into the states buffer).
        wrap_triton(_split_partial_kernel)[(splits, BH)](
            states[k], stored, v_t, active, pm, pl, pacc, paccx, beta2, S, N, split_rows, splits,
            **common, VALUE_STEP=value_step, WITH_X=(not value_step) or final_state,
            DOT_PREC=dot_prec, STATE_F32=state_f32, BLOCK_N=block_n, num_warps=4)
        wrap_triton(_split_merge_kernel)[(BH,)](
            states[k], states[k + 1], active, pm, pl, pacc, paccx, out, lse[k],
            applied_u8[min(k, U - 1)] if U > 0 else applied_u8, tol_f, S, splits,
            **common, VALUE_STEP=value_step, STORE_NEXT=(not value_step) or final_state,
            WRITE_OUT=(not has_values and k == steps - 1), HAS_TOL=has_tol, num_warps=4)
    return out, states, lse, applied


@by_batch_slices(2, per_element=lambda first: first.shape[1])  # (grid: (..., B * H))
def hopfield_energy_fwd(state, stored, beta, config=None):
    """(energy, lse), float32 ``[B, H, S]``; see the module docstring.  ``config``: a
    ``triton.Config`` with BLOCK_S / BLOCK_N (default: 64 x 64, 16-row tiles for S <= 16)."""
    fn = "hopfield_energy_fwd"
    _check(fn, state, stored, None)
    if not beta > 0:
        raise ValueError(f"{fn}: beta must be > 0; got {beta}")
    B, H, S, D = state.shape
    N = stored.shape[2]
    energy = torch.empty((B, H, S), dtype=torch.float32, device=state.device)
    lse = torch.empty_like(energy)
    if S == 0 or B * H == 0:
        return energy, lse
    block_d = pow2(D)
    if config is None:
        block_s = 16 if S <= 16 else 64
        block_n = 64 if block_d <= 128 else 32
        num_warps = 4
    else:
        block_s, block_n = config.kwargs["BLOCK_S"], config.kwargs["BLOCK_N"]
        num_warps = config.num_warps
    wrap_triton(_energy_kernel)[(cdiv(S, block_s), B * H)](
        state.contiguous(), stored.contiguous(), energy, lse, float(beta),
        float(beta) * 1.4426950408889634, math.log(N), S, N, HEAD_D=D, BLOCK_D=block_d,
        DOT_PREC=dot_precision(state.dtype), BLOCK_S=block_s, BLOCK_N=block_n,
        num_warps=num_warps)
    return energy, lse

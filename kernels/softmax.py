"""Triton kernels for softmax attention (FlashAttention-2 structure), forward and backward.

Layer 1 of the softmax family (see DESIGN.md): ``@triton.jit`` kernels and the launchers that
size their grids.  No autograd here -- ``pytorch_ext/ops/softmax.py`` registers the launchers as
a ``torch.library`` op and wires :func:`softmax_bwd` in as its backward.

Launchers
---------
``softmax_fwd(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=0, config=None, *,
window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None)``
    -> ``(out [B, H, N, Dv] in q.dtype, lse [B, H, N] float32)``
``softmax_bwd(grad_out, q, k, v, out, lse, mask, scale, is_causal, dropout_p=0.0, seed=0,
config=None, *, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None)``
    -> ``(dq, dk, dv)`` shaped and typed like ``q, k, v``
``dropout_keep_mask(B, H, N, M, dropout_p, seed, device)`` -> bool ``[B, H, N, M]``, True = kept
``softmax_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
is_causal, config=None, **score options)`` / ``softmax_varlen_bwd(...)``
    packed sequences (``q [total_q, H, D]``, FlashAttention's varlen layout) in one launch per
    kernel: the same kernels built with ``VARLEN`` (the grid covers the longest sequence; each
    program reads its sequence's first rows and lengths from the offsets on the device, so no
    host read: a call can be captured in a CUDA graph).  lse ``[H, total_q]``.  No mask, no
    dropout.  With ``VARLEN`` off the kernels compile as before (sm_90 registers and spills
    unchanged, bench/triton_sm90_resources.py).

Shapes: q ``[B, H, N, D]``, k ``[B, Hk, M, D]``, v ``[B, Hk, M, Dv]`` with ``H % Hk == 0``;
query head ``h`` reads key/value head ``h // (H // Hk)`` (GQA / MQA; K and V are never
repeated in memory, and the dK/dV kernel sums over the group's query heads itself).  Any
strides are read as given.  ``mask``: None, bool (True = attend) or floating (added to the
scores), broadcastable to ``[B, H, N, M]``; broadcast dimensions are read through stride 0,
never densified.  ``is_causal``: top-left aligned, key j visible to query i iff j <= i (N != M
allowed).  Head dims up to 256, any value (the tile is padded to a power of two with masked
loads); float16, bfloat16, float32 with float32 accumulation.  A row with no visible key gives
out = 0, lse = -inf and zero gradients.

Score options (FlashAttention's semantics; keyword-only, the backward takes the forward's):
``s = scale * q.k``; ``softcap > 0``: ``s = softcap * tanh(s / softcap)``; ``alibi_slopes``
(float32 ``[B, H]``, or ``[H]`` / any view broadcast to it, read through its strides): ``s -=
slope[b, h] * |i + M - N - j|``; then the user mask, causal and the window.  Window
(``window_left`` / ``window_right``, -1 = unbounded side; bottom-right aligned): query i sees key
j iff ``i + M - N - left <= j <= i + M - N + right``, on top of ``is_causal``'s top-left
``j <= i``.  The kernels skip whole key tiles (forward, dQ) and query tiles (dK/dV) outside the
band, so their cost follows the band; only the tiles that cross a band edge are masked element
by element.  In the backward, ``dS_raw = dS_capped * (1 - tanh^2)`` (tanh from exp2, see
kernels/_flash.py); the slopes get no gradient.  Each option is a constexpr flag (HAS_WINDOW,
HAS_SOFTCAP, HAS_ALIBI, in the autotune key): with none set the kernels compile as before.

Numerics: scores are kept in base 2 (``s * scale * log2(e)``) so the kernels use ``exp2``; the
stored lse is in natural log.  The backward recomputes the probabilities from the lse
(``p = exp2(s - lse * log2(e))``) and uses ``D = rowsum(dO * O)``, which stays exact with
dropout because ``O`` is the dropped output.

Dropout: the keep decision of element (b, h, i, j) is ``tl.rand(seed, ((b*H + h)*N + i)*M + j)
>= dropout_p`` (Philox, counter = the flat index of the element in a [B, H, N, M] tensor), so the
forward, both backward kernels and :func:`dropout_keep_mask` all draw the same mask from the
seed.  Kept probabilities are scaled by 1 / (1 - dropout_p).

The tile steps and the launch plumbing shared with kernels/sparse.py live in kernels/_flash.py.

Tuning: ``FWD_CONFIGS``, ``BWD_DKDV_CONFIGS`` and ``BWD_DQ_CONFIGS`` are the ``triton.autotune``
search spaces (BLOCK_M = query tile, BLOCK_N = key tile, num_warps, num_stages), chosen for
sm_80 / sm_90 and keyed on the head dims, causality, mask kind, dropout, the score options and
the dtypes.  Each list is first filtered by the padded head dim (:func:`configs_for`) so that no
config that cannot fit the register file is tried.  ``config=`` (a ``triton.Config``) skips
autotuning; under the Triton interpreter (no GPU) the first eligible config is used instead of
benchmarking.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .._env import env_reader
from ._flash import (INTERPRETED, MAX_HEAD_DIM, SUPPORTED_DTYPES, _LOG2E, accumulate_pv, cdiv,
                     check_attention_shapes, check_backward_inputs, config_list, dk_step,
                     dot_precision, dq_step, finish_rows, finish_rows_sink, fitting, launch,
                     load_bwd_rows, load_row_pair, load_rows, next_pow2, online_softmax_update, pow2,
                     scores, option_scores, score_option_args, sink_args, split_config, store_rows,
                     strides, tanh_and_grad, batch_slices)

__all__ = [
    "softmax_fwd",
    "softmax_bwd",
    "softmax_varlen_fwd",
    "softmax_varlen_bwd",
    "dropout_keep_mask",
    "varlen_dropout_keep_masks",
    "configs_for",
    "FWD_CONFIGS",
    "BWD_DKDV_CONFIGS",
    "BWD_DQ_CONFIGS",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
]

# ----------------------------------------------------------------------------------------------
# autotune search spaces
# ----------------------------------------------------------------------------------------------

# Forward: one program per (query tile, head, batch); wide query tiles amortize the K/V loads.
FWD_CONFIGS = config_list((128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3),
                          (64, 64, 4, 4), (64, 32, 4, 2))
# dK/dV: one program per (key tile, kv head, batch) looping over query tiles; the key tile holds
# four accumulators-worth of state (k, v, dk, dv), so the query tile is the narrow one.
BWD_DKDV_CONFIGS = config_list((32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 2),
                               (16, 64, 4, 2))
# dQ: one program per (query tile, head, batch) looping over key tiles.
BWD_DQ_CONFIGS = config_list((128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2),
                             (32, 64, 4, 2))
_CONFIG_LISTS = {"fwd": FWD_CONFIGS, "dkdv": BWD_DKDV_CONFIGS, "dq": BWD_DQ_CONFIGS}
# BLOCK_M * BLOCK_N * (padded head dim) above which a config spills registers on sm_80/sm_90
# (the forward keeps one [BLOCK_M, Dv] accumulator; each backward kernel keeps two).
_TILE_LIMIT = {"fwd": 128 * 128 * 128, "dkdv": 32 * 128 * 128, "dq": 32 * 128 * 128}
_TUNE_KEY = ["HEAD_D", "HEAD_DV", "IS_CAUSAL", "MASK_KIND", "HAS_DROPOUT", "HAS_WINDOW",
             "HAS_SOFTCAP", "HAS_ALIBI", "VARLEN"]  # + dtypes (automatic)


def configs_for(kernel: str, head_dim: int, value_dim: int | None = None) -> list:
    """The autotune candidates of ``kernel`` ("fwd", "dkdv" or "dq") for these head dims."""
    dmax = pow2(max(head_dim, head_dim if value_dim is None else value_dim))
    return fitting(_CONFIG_LISTS[kernel], dmax, _TILE_LIMIT[kernel])


@functools.lru_cache(maxsize=None)
def _autotuned(kernel: str, dmax: int):
    key = _TUNE_KEY + ["HAS_SINKS"] if kernel == "fwd" else _TUNE_KEY  # (the forward's only)
    return triton.autotune(configs=configs_for(kernel, dmax), key=key)(_kernel(kernel))


# ----------------------------------------------------------------------------------------------
# shared device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _query_program(GROUP, IS_CAUSAL: tl.constexpr):
    """(query tile, head, batch, key/value head) of a program of the (query tiles, H, B) grid."""
    if IS_CAUSAL:
        # Later query tiles see more keys: launch them first so the tail of the grid is short.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    return pid_m, h, b, h // GROUP


@triton.jit
def _sequence(b, N, M, CuQ, CuK, VARLEN: tl.constexpr):
    """``(q0, k0, N, M)``: the first query / key row of batch element b and its lengths.  Packed
    sequences (VARLEN): b is sequence b of the pack, rows ``CuQ[b]:CuQ[b + 1]`` of the queries
    and ``CuK[b]:CuK[b + 1]`` of the keys; otherwise rows from 0 and the launch's N, M."""
    if VARLEN:
        q0 = tl.load(CuQ + b).to(tl.int64)
        k0 = tl.load(CuK + b).to(tl.int64)
        return q0, k0, (tl.load(CuQ + b + 1) - q0).to(tl.int32), (tl.load(CuK + b + 1) - k0).to(tl.int32)
    else:
        return 0, 0, N, M


@triton.jit
def _lse_row(b, h, H, ROWS, q0, VARLEN: tl.constexpr):
    """Where the lse / delta rows of (b, h) start: in ``[B, H, ROWS]``, or, for packed sequences,
    in ``[H, ROWS]`` (ROWS = the pack's query rows) at sequence b's first row q0."""
    if VARLEN:
        return h * ROWS + q0
    else:
        return (b * H + h) * ROWS


@triton.jit
def _sequence_window(win_lo, win_hi, N, M, VARLEN: tl.constexpr):
    """The window bounds of a sequence (win_lo <= j - i <= win_hi).  Packed sequences get their
    own alignment M - N: the launch passes -left and right clamped to the longest sequences,
    clamped here to this one's (an unbounded or wider side hides nothing); otherwise the
    launch's bounds as they are."""
    if VARLEN:
        return (M - N) + tl.maximum(win_lo, -M), (M - N) + tl.minimum(win_hi, N)
    else:
        return win_lo, win_hi


@triton.jit
def _query_tile(GROUP, H, N, M, CuQ, CuK, win_lo, win_hi, IS_CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """A program of the (query tiles, H, B) grid: ``(i0, h, b, hk, q0, k0, N, M, row, win_lo,
    win_hi)`` -- its first query row i0 within the sequence, (head, batch element or packed
    sequence, key/value head), the sequence's first query / key row and lengths
    (:func:`_sequence`), where its lse / delta rows start (:func:`_lse_row`, at the sequence's
    first row) and its window bounds (:func:`_sequence_window`)."""
    pid_m, h, b, hk = _query_program(GROUP, IS_CAUSAL)
    row = _lse_row(b, h, H, N, 0, VARLEN)  # (VARLEN: N is the pack's query rows here)
    q0, k0, N, M = _sequence(b, N, M, CuQ, CuK, VARLEN)
    if VARLEN:
        row += q0
        win_lo, win_hi = _sequence_window(win_lo, win_hi, N, M, VARLEN)
    return pid_m * BLOCK_M, h, b, hk, q0, k0, N, M, row, win_lo, win_hi


@triton.jit
def _apply_user_mask(s, mask_base, rows, cols, stride_mn, stride_mm, N, M,
                     MASK_KIND: tl.constexpr):
    """s (base-2 scores) with the user mask applied; ``rows`` are query indices and ``cols`` key
    indices, shaped to broadcast to s (either [BM, 1] x [1, BN] or transposed)."""
    if MASK_KIND != 0:
        # int64 offsets: a dense [N, M] mask passes 2**31 elements at N = M = 46341.
        ptrs = mask_base + rows.to(tl.int64) * stride_mn + cols.to(tl.int64) * stride_mm
        inb = (rows < N) & (cols < M)
        if MASK_KIND == 1:
            keep = tl.load(ptrs, mask=inb, other=0)
            s = tl.where(keep != 0, s, float("-inf"))
        else:
            bias = tl.load(ptrs, mask=inb, other=0.0).to(tl.float32)
            s = s + bias * _LOG2E
    return s


@triton.jit
def _dropout_keep(seed, dropout_p, row_base, rows, cols, M):
    """True where element (row_base + rows, cols) of the flat [B*H*N, M] grid is kept.
    ``row_base`` = (b*H + h)*N as int64; rows/cols broadcast like in _apply_user_mask.

    Packed sequences (VARLEN): sequence b draws with the key ``seed + b`` and counter ((h *
    total_q + its first row + i) * its key length + j): unique within the sequence, and the
    sequences' lengths differ, so one key for all of them could draw the same counter twice --
    the mask of sequence b is ``dropout_keep_mask(1, H, total_q, m_b, p, seed + b)``'s rows of
    the sequence (:func:`varlen_dropout_keep_masks`)."""
    offsets = (row_base + rows.to(tl.int64)) * M + cols.to(tl.int64)
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _load_slope2(Alibi, b, h, stride_ab, stride_ah, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (batch b, head h) times log2(e) (0.0 without ALiBi)."""
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah).to(tl.float32) * _LOG2E
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def _key_band(i0, N, M, win_lo, win_hi, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Key range of the query tile starting at i0 under a window (query i sees key j iff
    win_lo <= j - i <= win_hi, and j <= i when causal): ``(lo, a, b, hi)`` with the key tiles
    [lo, a) and [b, hi) to be masked and [a, b) seen whole by every row of the tile; no row sees
    a key before lo or at / past hi.  lo, a, b are multiples of BLOCK_N (a or b may equal hi)."""
    i_last = tl.minimum(i0 + BLOCK_M, N) - 1
    first = tl.maximum(i0 + win_lo, 0)  # the first key any row of the tile sees
    hi = tl.minimum(M, i_last + win_hi + 1)  # past the last key any row sees
    full_first = tl.maximum(i_last + win_lo, 0)  # every row sees keys from here ...
    full_end = tl.minimum(M, i0 + win_hi + 1)  # ... to before here
    if IS_CAUSAL:
        hi = tl.minimum(hi, i_last + 1)
        full_end = tl.minimum(full_end, i0 + 1)
    full_end = tl.maximum(full_end, 0)  # (no negative operand of //: it truncates)
    lo = (first // BLOCK_N) * BLOCK_N
    # hi < lo (no row sees a key; hi may be negative) leaves all three ranges empty.
    a = tl.minimum(tl.maximum(tl.cdiv(full_first, BLOCK_N) * BLOCK_N, lo), hi)
    b = tl.maximum(a, tl.minimum((full_end // BLOCK_N) * BLOCK_N, hi))
    return lo, a, b, hi


@triton.jit
def _query_band(j0, N, M, win_lo, win_hi, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The dK/dV kernel's query range for the key tile starting at j0 under a window (see
    _key_band): ``(lo, a, b, hi)``, query tiles [lo, a) and [b, hi) masked, [a, b) seeing every
    key of the tile; no query before lo or at / past hi sees any of them."""
    j_last = tl.minimum(j0 + BLOCK_N, M) - 1
    first = tl.maximum(j0 - win_hi, 0)  # the first query that sees any key of the tile
    hi = tl.minimum(N, j_last - win_lo + 1)  # past the last query that sees any
    full_first = tl.maximum(j_last - win_hi, 0)  # queries from here see every key ...
    if IS_CAUSAL:
        first = tl.maximum(first, j0)
        full_first = tl.maximum(full_first, j_last)
    full_end = tl.maximum(j0 - win_lo + 1, 0)  # ... up to before here
    lo = (first // BLOCK_M) * BLOCK_M
    # hi < lo (no query sees the tile; hi may be negative) leaves all three ranges empty.
    a = tl.minimum(tl.maximum(tl.cdiv(full_first, BLOCK_M) * BLOCK_M, lo), hi)
    # b = N (hi = N then): the last, partial query tile needs no mask (rows past N read
    # lse = +inf, so p = 0).
    b = tl.maximum(a, tl.minimum((full_end // BLOCK_M) * BLOCK_M, hi))
    return lo, a, b, hi


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mask_tail_and_diagonal(s, offs_m, offs_n, M, win_lo, win_hi, IS_CAUSAL: tl.constexpr,
                            HAS_WINDOW: tl.constexpr):
    """-inf for the key columns past M and, when causal, above the diagonal, and with a window
    outside win_lo <= j - i <= win_hi ([queries, keys])."""
    valid = offs_n[None, :] < M
    if IS_CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    if HAS_WINDOW:
        rel = offs_n[None, :] - offs_m[:, None]
        valid = valid & (rel >= win_lo) & (rel <= win_hi)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _key_bounds(i0, M, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full_hi, hi) for the query tile starting at i0: key tiles below full_hi need no masking,
    those in [full_hi, hi) do; no row of the tile sees a key at or past hi."""
    if IS_CAUSAL:
        hi = tl.minimum(M, i0 + BLOCK_M)  # no row of this tile sees a key past its last row
        full_hi = (tl.minimum(M, i0 + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = M
        full_hi = (M // BLOCK_N) * BLOCK_N
    return full_hi, hi


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, start_n,
              qk_scale, dropout_p, seed, drop_row, win_lo, win_hi, cap_in, cap_out, slope2,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The key tile at start_n folded into (acc, l_i, m_i); see _fwd_inner."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_rows(k_base, offs_n, stride_kn, offs_d, stride_kd, offs_n < M, HEAD_D, BLOCK_D,
                  MASKED)
    s, _ = option_scores(q, k, offs_m[:, None], offs_n[None, :], qk_scale, cap_in, cap_out,
                         slope2, M - N, HAS_SOFTCAP, HAS_ALIBI, False, DOT_PREC)
    s = _apply_user_mask(s, mask_base, offs_m[:, None], offs_n[None, :], stride_mn,
                         stride_mm, N, M, MASK_KIND)
    if MASKED:
        s = _mask_tail_and_diagonal(s, offs_m, offs_n, M, win_lo, win_hi, IS_CAUSAL,
                                    HAS_WINDOW)
    # The normalizer l_i sums the undropped probabilities (dropout acts after the softmax).
    p, alpha, l_i, m_i = online_softmax_update(s, m_i, l_i)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, dropout_p, drop_row, offs_m[:, None], offs_n[None, :], M)
        p = tl.where(keep, p, 0.0)
    v = load_rows(v_base, offs_n, stride_vn, offs_dv, stride_vd, offs_n < M, HEAD_DV,
                  BLOCK_DV, MASKED)
    return accumulate_pv(acc, alpha, p, v, DOT_PREC), l_i, m_i


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, lo, hi, lo2, hi2,
               qk_scale, dropout_p, seed, drop_row, win_lo, win_hi, cap_in, cap_out, slope2,
               stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               EDGES: tl.constexpr):
    # MASKED=False: every key tile in [lo, hi) lies inside M and is seen whole by every row of
    # this query tile (causal: at or left of the diagonal; window: inside every row's band), so
    # no per-element bounds / causal / window test.  EDGES (a window's two masked band edges):
    # the tiles of [lo, hi), then those of [lo2, hi2) (lo2 a multiple of BLOCK_N), in one loop --
    # one copy of the tile step instead of two: at 128 x 64 on 4 warps the window forward spilled
    # 1224 bytes with two copies, at 128 x 128 on 8 warps 208 (sm_90 compiles,
    # bench/triton_sm90_resources.py softmax-fwd; bench/RESULTS.md session 28 has the table).
    if EDGES:
        n_first = tl.cdiv(hi - lo, BLOCK_N)  # hi is not a multiple of BLOCK_N where [lo2, hi2) is empty
        for step in range(0, n_first + tl.cdiv(hi2 - lo2, BLOCK_N)):
            start_n = tl.where(step >= n_first, lo2 + (step - n_first) * BLOCK_N, lo + step * BLOCK_N)
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, start_n,
                qk_scale, dropout_p, seed, drop_row, win_lo, win_hi, cap_in, cap_out, slope2,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, HAS_WINDOW,
                HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, MASKED)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(
                acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, start_n,
                qk_scale, dropout_p, seed, drop_row, win_lo, win_hi, cap_in, cap_out, slope2,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, HAS_WINDOW,
                HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, MASKED)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Mask, Alibi, Sinks, CuQ, CuK, Out, Lse,
    sm_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mn, stride_mm,
    stride_ab, stride_ah,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, M, GROUP,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i0, h, b, hk, q0, k0, N, M, drop_row, win_lo, win_hi = _query_tile(
        GROUP, H, N, M, CuQ, CuK, win_lo, win_hi, IS_CAUSAL, VARLEN, BLOCK_M)
    if VARLEN:
        if i0 >= N:  # the grid covers the longest sequence
            return
        if HAS_DROPOUT:
            seed = seed + b  # a Philox key per sequence (see _dropout_keep)
    q_base = Q + b * stride_qb + q0 * stride_qn + h * stride_qh
    k_base = K + b * stride_kb + k0 * stride_kn + hk * stride_kh
    v_base = V + b * stride_vb + k0 * stride_vn + hk * stride_vh
    mask_base = Mask + b * stride_mb + h * stride_mh
    slope2 = _load_slope2(Alibi, b, h, stride_ab, stride_ah, HAS_ALIBI)

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N
    q = load_rows(q_base, offs_m, stride_qn, offs_d, stride_qd, row_ok, HEAD_D, BLOCK_D, True)

    qk_scale = sm_scale * _LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if HAS_WINDOW:
        # Only the key tiles of the band: whole in the middle, masked on its two edges.
        lo, full_lo, full_hi, hi = _key_band(i0, N, M, win_lo, win_hi, IS_CAUSAL, BLOCK_M,
                                             BLOCK_N)
        # The masked tiles: the band's left edge [lo, full_lo), then its right edge / the
        # diagonal [full_hi, hi), in one loop.
        edge_lo, edge_hi, edge_lo2, edge_hi2 = lo, full_lo, full_hi, hi
    else:
        full_lo = 0
        full_hi, hi = _key_bounds(i0, M, IS_CAUSAL, BLOCK_M, BLOCK_N)
        edge_lo, edge_hi, edge_lo2, edge_hi2 = full_hi, hi, 0, 0
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, full_lo, full_hi, 0, 0,
        qk_scale, dropout_p, seed, drop_row, win_lo, win_hi, cap_in, cap_out, slope2,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, HAS_WINDOW,
        HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, False, False)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, edge_lo, edge_hi, edge_lo2,
        edge_hi2,
        qk_scale, dropout_p, seed, drop_row, win_lo, win_hi, cap_in, cap_out, slope2,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT, HAS_WINDOW,
        HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, True, HAS_WINDOW)

    if HAS_SINKS:  # head h's sink: one more logit of each row, folded in before the rounding
        out, lse = finish_rows_sink(acc, l_i, m_i, tl.load(Sinks + h))
    else:
        out, lse = finish_rows(acc, l_i, m_i)
    if HAS_DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    store_rows(Out + b * stride_ob + q0 * stride_on + h * stride_oh, offs_m, stride_on, offs_dv,
               stride_od, row_ok, out, HEAD_DV)
    tl.store(Lse + drop_row + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_preprocess(
    Out, dO, Delta,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_gb, stride_gh, stride_gn, stride_gd,
    H, N,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (float32)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N
    o, do = load_row_pair(Out + b * stride_ob + h * stride_oh, dO + b * stride_gb + h * stride_gh,
                          offs_m, row_ok, stride_on, stride_od, stride_gn, stride_gd, offs_dv,
                          offs_dv, HEAD_DV, HEAD_DV, BLOCK_DV, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (b * H + h) * N + offs_m, delta, mask=row_ok)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, mask_base, lse_base, delta_base, drop_row,
               offs_n, start_m, qk_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
               slope2,
               stride_qn, stride_qd, stride_gn, stride_gd, stride_mn, stride_mm, N, M,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    """The query tile at start_m folded into (dk, dv); see _dkdv_inner."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N
    q, do, lse2, delta = load_bwd_rows(q_base, do_base, lse_base, delta_base, offs_m, row_ok,
                                       stride_qn, stride_qd, stride_gn, stride_gd, HEAD_D,
                                       HEAD_DV, BLOCK_D, BLOCK_DV)
    s_t, dcap_t = option_scores(k, q, offs_m[None, :], offs_n[:, None], qk_scale, cap_in,
                                 cap_out, slope2, M - N, HAS_SOFTCAP, HAS_ALIBI, True,
                                 DOT_PREC)
    s_t = _apply_user_mask(s_t, mask_base, offs_m[None, :], offs_n[:, None], stride_mn,
                           stride_mm, N, M, MASK_KIND)
    if MASKED:
        if IS_CAUSAL:
            s_t = tl.where(offs_n[:, None] <= offs_m[None, :], s_t, float("-inf"))
        if HAS_WINDOW:
            rel_t = offs_n[:, None] - offs_m[None, :]
            s_t = tl.where((rel_t >= win_lo) & (rel_t <= win_hi), s_t, float("-inf"))
    # Hidden entries (s = -inf) get p = 0 exactly: a NaN row's lse would make exp2 NaN there.
    visible_t = (s_t != float("-inf")) & row_ok[None, :]
    p_t = tl.where(visible_t, tl.math.exp2(s_t - lse2[None, :]), 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    if HAS_DROPOUT:
        keep_t = _dropout_keep(seed, dropout_p, drop_row, offs_m[None, :], offs_n[:, None], M)
        inv_keep = 1.0 / (1.0 - dropout_p)
        pd_t = tl.where(keep_t, p_t * inv_keep, 0.0)
        dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
    else:
        pd_t = p_t
    dv = tl.dot(pd_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    if HAS_SOFTCAP:  # dS of the uncapped score: dS_capped * (1 - tanh^2)
        dk = dk_step(dk, p_t * dcap_t, dp_t, delta, q, visible_t, DOT_PREC)
    else:
        dk = dk_step(dk, p_t, dp_t, delta, q, visible_t, DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, mask_base, lse_base, delta_base, drop_row,
                offs_n, lo, hi, lo2, hi2, qk_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
                slope2,
                stride_qn, stride_qd, stride_gn, stride_gd, stride_mn, stride_mm, N, M,
                HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                EDGES: tl.constexpr):
    # Works on transposed tiles ([keys, queries]) so that dk and dv come out of plain dots.
    # Query rows past N load lse = +inf, dO = 0, delta = 0 and q = 0, but p must still be
    # masked there: a key holding +-inf scores 0 * inf = NaN against the zero row, and NaN p
    # times dO = 0 is NaN in dk / dv (found by the fuzz test: N = M = 1, D = 3, an inf key).
    # Key rows past M give garbage rows of dk/dv that are never stored (dots are row-wise).
    # MASKED=True: the query tiles that cross the diagonal (causal) or a window edge.
    # EDGES (a window's two masked band edges): the query tiles of [lo, hi), then those of
    # [lo2, hi2) (lo2 a multiple of BLOCK_M), in one loop: one copy of the tile step instead of
    # two (bench/RESULTS.md session 28: sm_90 spills).
    if EDGES:
        n_first = tl.cdiv(hi - lo, BLOCK_M)  # hi is not a multiple of BLOCK_M where [lo2, hi2) is empty
        for step in range(0, n_first + tl.cdiv(hi2 - lo2, BLOCK_M)):
            start_m = tl.where(step >= n_first, lo2 + (step - n_first) * BLOCK_M, lo + step * BLOCK_M)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, mask_base, lse_base, delta_base, drop_row, offs_n, start_m, qk_scale,
                dropout_p, seed, win_lo, win_hi, cap_in, cap_out, slope2, stride_qn, stride_qd, stride_gn,
                stride_gd, stride_mn, stride_mm, N, M, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND,
                HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_M, MASKED)
    else:
        for start_m in range(lo, hi, BLOCK_M):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_base, do_base, mask_base, lse_base, delta_base, drop_row, offs_n, start_m, qk_scale,
                dropout_p, seed, win_lo, win_hi, cap_in, cap_out, slope2, stride_qn, stride_qd, stride_gn,
                stride_gd, stride_mn, stride_mm, N, M, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND,
                HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_M, MASKED)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, Mask, Alibi, CuQ, CuK, dO, Lse, Delta, dK, dV,
    sm_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mn, stride_mm,
    stride_ab, stride_ah,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N, M, GROUP,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    j0 = pid_n * BLOCK_N
    ROWS = N  # the lse / delta rows of a head (VARLEN: of the pack)
    q0, k0, N, M = _sequence(b, N, M, CuQ, CuK, VARLEN)
    if VARLEN:
        if j0 >= M:  # the grid covers the longest sequence
            return
        win_lo, win_hi = _sequence_window(win_lo, win_hi, N, M, VARLEN)
        if HAS_DROPOUT:
            seed = seed + b  # a Philox key per sequence (see _dropout_keep)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < M
    k_base = K + b * stride_kb + k0 * stride_kn + hk * stride_kh
    v_base = V + b * stride_vb + k0 * stride_vn + hk * stride_vh
    k, v = load_row_pair(k_base, v_base, offs_n, col_ok, stride_kn, stride_kd, stride_vn, stride_vd, offs_d,
                         offs_dv, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E

    if HAS_WINDOW:
        # Only the query tiles of the band: masked on its two edges, whole in between.
        lo, mid, full_hi, hi = _query_band(j0, N, M, win_lo, win_hi, IS_CAUSAL, BLOCK_M,
                                           BLOCK_N)
    elif IS_CAUSAL:
        # Queries before j0 see none of these keys; query tiles that start at or after the
        # tile's last key (j0 + BLOCK_N - 1) see all of them.
        lo = (j0 // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, N)
        full_hi = N
        hi = N
    else:
        lo = 0
        mid = 0
        full_hi = N
        hi = N

    # GQA: the query heads of the group all read this key/value head; sum their contributions
    # here rather than materializing per-query-head dK/dV and reducing afterwards.
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + q0 * stride_qn + h * stride_qh
        do_base = dO + b * stride_gb + q0 * stride_gn + h * stride_gh
        mask_base = Mask + b * stride_mb + h * stride_mh
        drop_row = _lse_row(b, h, H, ROWS, q0, VARLEN)
        lse_base = Lse + drop_row
        delta_base = Delta + drop_row
        slope2 = _load_slope2(Alibi, b, h, stride_ab, stride_ah, HAS_ALIBI)
        # The masked query tiles -- the diagonal [lo, mid) and, with a window, its far edge
        # [full_hi, hi), in one loop -- then those that see every key of this tile.
        if IS_CAUSAL or HAS_WINDOW:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, mask_base, lse_base, delta_base, drop_row,
                offs_n, lo, mid, full_hi, hi, qk_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
                slope2, stride_qn, stride_qd, stride_gn, stride_gd, stride_mn, stride_mm, N, M,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
                HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_M, True, HAS_WINDOW)
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, mask_base, lse_base, delta_base, drop_row,
            offs_n, mid, full_hi, 0, 0, qk_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
            slope2, stride_qn, stride_qd, stride_gn, stride_gd, stride_mn, stride_mm, N, M,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
            HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_M, False, False)

    store_rows(dK + b * stride_dkb + k0 * stride_dkn + hk * stride_dkh, offs_n, stride_dkn, offs_d,
               stride_dkd, col_ok, dk * sm_scale, HEAD_D)
    store_rows(dV + b * stride_dvb + k0 * stride_dvn + hk * stride_dvh, offs_n, stride_dvn, offs_dv,
               stride_dvd, col_ok, dv, HEAD_DV)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, mask_base, drop_row,
             offs_m, offs_d, offs_dv, start_n, qk_scale, dropout_p, seed,
             win_lo, win_hi, cap_in, cap_out, slope2,
             stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
             HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
             DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The key tile at start_n folded into dq; see _dq_inner."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = load_row_pair(k_base, v_base, offs_n, offs_n < M, stride_kn, stride_kd, stride_vn,
                         stride_vd, offs_d, offs_dv, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV,
                         MASKED)
    s, dcap = option_scores(q, k, offs_m[:, None], offs_n[None, :], qk_scale, cap_in,
                             cap_out, slope2, M - N, HAS_SOFTCAP, HAS_ALIBI, True, DOT_PREC)
    s = _apply_user_mask(s, mask_base, offs_m[:, None], offs_n[None, :], stride_mn,
                         stride_mm, N, M, MASK_KIND)
    if MASKED:
        s = _mask_tail_and_diagonal(s, offs_m, offs_n, M, win_lo, win_hi, IS_CAUSAL,
                                    HAS_WINDOW)
    visible = s != float("-inf")  # hidden: p = 0 exactly (see the dK/dV loop)
    p = tl.where(visible, tl.math.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, dropout_p, drop_row, offs_m[:, None], offs_n[None, :], M)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    if HAS_SOFTCAP:  # dS of the uncapped score: dS_capped * (1 - tanh^2)
        dq = dq_step(dq, p * dcap, dp, delta, k, visible, DOT_PREC)
    else:
        dq = dq_step(dq, p, dp, delta, k, visible, DOT_PREC)
    return dq


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_base, v_base, mask_base, drop_row,
              offs_m, offs_d, offs_dv, lo, hi, lo2, hi2, qk_scale, dropout_p, seed,
              win_lo, win_hi, cap_in, cap_out, slope2,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              EDGES: tl.constexpr):
    # Same tile split as the forward (MASKED: key tiles past M or across the diagonal or a
    # window edge).  Key columns past M must be masked here: they would otherwise get
    # p = exp2(-lse) != 0.
    # EDGES (a window's two masked band edges): the key tiles of [lo, hi), then those of
    # [lo2, hi2) (lo2 a multiple of BLOCK_N), in one loop, as in the forward's _fwd_inner.
    if EDGES:
        n_first = tl.cdiv(hi - lo, BLOCK_N)  # hi is not a multiple of BLOCK_N where [lo2, hi2) is empty
        for step in range(0, n_first + tl.cdiv(hi2 - lo2, BLOCK_N)):
            start_n = tl.where(step >= n_first, lo2 + (step - n_first) * BLOCK_N, lo + step * BLOCK_N)
            dq = _dq_tile(
                dq, q, do, lse2, delta, k_base, v_base, mask_base, drop_row, offs_m, offs_d, offs_dv, start_n,
                qk_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out, slope2, stride_kn, stride_kd,
                stride_vn, stride_vd, stride_mn, stride_mm, N, M, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL,
                MASK_KIND, HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, MASKED)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            dq = _dq_tile(
                dq, q, do, lse2, delta, k_base, v_base, mask_base, drop_row, offs_m, offs_d, offs_dv, start_n,
                qk_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out, slope2, stride_kn, stride_kd,
                stride_vn, stride_vd, stride_mn, stride_mm, N, M, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL,
                MASK_KIND, HAS_DROPOUT, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, MASKED)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, Mask, Alibi, CuQ, CuK, dO, Lse, Delta, dQ,
    sm_scale, dropout_p, seed, win_lo, win_hi, cap_in, cap_out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mn, stride_mm,
    stride_ab, stride_ah,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H, N, M, GROUP,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr, VARLEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    i0, h, b, hk, q0, k0, N, M, drop_row, win_lo, win_hi = _query_tile(
        GROUP, H, N, M, CuQ, CuK, win_lo, win_hi, IS_CAUSAL, VARLEN, BLOCK_M)
    if VARLEN:
        if i0 >= N:  # the grid covers the longest sequence
            return
        if HAS_DROPOUT:
            seed = seed + b  # a Philox key per sequence (see _dropout_keep)

    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N
    q, do, lse2, delta = load_bwd_rows(Q + b * stride_qb + q0 * stride_qn + h * stride_qh,
                                       dO + b * stride_gb + q0 * stride_gn + h * stride_gh, Lse + drop_row,
                                       Delta + drop_row, offs_m, row_ok, stride_qn, stride_qd,
                                       stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    slope2 = _load_slope2(Alibi, b, h, stride_ab, stride_ah, HAS_ALIBI)

    k_base = K + b * stride_kb + k0 * stride_kn + hk * stride_kh
    v_base = V + b * stride_vb + k0 * stride_vn + hk * stride_vh
    mask_base = Mask + b * stride_mb + h * stride_mh
    if HAS_WINDOW:
        lo, full_lo, full_hi, hi = _key_band(i0, N, M, win_lo, win_hi, IS_CAUSAL, BLOCK_M,
                                             BLOCK_N)
        # The masked key tiles: the band's left edge [lo, full_lo), then its right edge / the
        # diagonal [full_hi, hi), in one loop (after the whole tiles, as in the forward).
        edge_lo, edge_hi, edge_lo2, edge_hi2 = lo, full_lo, full_hi, hi
    else:
        full_lo = 0
        full_hi, hi = _key_bounds(i0, M, IS_CAUSAL, BLOCK_M, BLOCK_N)
        edge_lo, edge_hi, edge_lo2, edge_hi2 = full_hi, hi, 0, 0
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, mask_base, drop_row,
                   offs_m, offs_d, offs_dv, full_lo, full_hi, 0, 0, qk_scale, dropout_p, seed,
                   win_lo, win_hi, cap_in, cap_out, slope2,
                   stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
                   HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
                   HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, False, False)
    dq = _dq_inner(dq, q, do, lse2, delta, k_base, v_base, mask_base, drop_row,
                   offs_m, offs_d, offs_dv, edge_lo, edge_hi, edge_lo2, edge_hi2, qk_scale, dropout_p, seed,
                   win_lo, win_hi, cap_in, cap_out, slope2,
                   stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, stride_mm, N, M,
                   HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_DROPOUT,
                   HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_PREC, BLOCK_N, True, HAS_WINDOW)
    store_rows(dQ + b * stride_dqb + q0 * stride_dqn + h * stride_dqh, offs_m, stride_dqn, offs_d,
               stride_dqd, row_ok, dq * sm_scale, HEAD_D)


# ----------------------------------------------------------------------------------------------
# dropout mask (for tests and for users who want to see the mask a seed gives)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dropout_keep_kernel(Keep, dropout_p, seed, H, N, M,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    num_n = tl.cdiv(M, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    drop_row = (b * H + h) * N
    keep = _dropout_keep(seed, dropout_p, drop_row, offs_m[:, None], offs_n[None, :], M)
    ptrs = Keep + (drop_row + offs_m.to(tl.int64))[:, None] * M + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < N) & (offs_n[None, :] < M))


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

def _kernel(name):
    return {"fwd": _attn_fwd_kernel, "dkdv": _attn_bwd_dkdv_kernel, "dq": _attn_bwd_dq_kernel}[name]


def _check_device(fn: str, t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRETED):
        raise RuntimeError(
            f"{fn}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"attnkit.kernels.softmax is imported, for CPU tensors); got a {t.device.type} tensor")


def _check_inputs(fn, q, k, v, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [B, H, L, D]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
    check_attention_shapes(fn, q, k, v)
    B, H, _, D = q.shape
    _check_dropout(fn, dropout_p)
    _check_device(fn, q)


def _check_dropout(fn, dropout_p):
    """``dropout_p`` as a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1); got {dropout_p!r}")
    return float(dropout_p)


def _prepare_mask(fn, mask, q, B, H, N, M):
    """(MASK_KIND, tensor to pass, its 4 strides).  0 = none, 1 = bool, 2 = additive."""
    if mask is None:
        return 0, q, (0, 0, 0, 0)  # q is a stand-in pointer; MASK_KIND=0 never reads it
    try:
        mask = mask.expand(B, H, N, M)  # a view: broadcast dimensions get stride 0
    except RuntimeError as exc:
        raise ValueError(f"{fn}: mask of shape {tuple(mask.shape)} does not broadcast to "
                         f"[B, H, N, M] = {[B, H, N, M]}") from exc
    if mask.dtype == torch.bool:
        return 1, mask.view(torch.uint8), mask.stride()  # same itemsize: any strides view
    if mask.is_floating_point():
        return 2, mask, mask.stride()
    raise TypeError(f"{fn}: mask must be bool or floating; got {mask.dtype}")


def _prepare_options(fn, q, B, H, N, M, scale, window_left, window_right, softcap,
                     alibi_slopes):
    """The score options as kernel arguments: ``(scalars, alibi, alibi_strides, consts)`` with
    scalars = (win_lo, win_hi, cap_in, cap_out) and consts the HAS_* flags
    (:func:`kernels._flash.score_option_args` validates them).

    The window becomes win_lo <= j - i <= win_hi (win_lo = M - N - left, win_hi = M - N + right);
    an unbounded side (-1) or one wider than the sequences is clamped to a bound that hides
    nothing (left to M, right to N), so the kernels never test the sign of a side."""
    opts = score_option_args(fn, q, B, H, scale, window_left, window_right, softcap, alibi_slopes)
    left = M if opts.left < 0 else min(opts.left, M)
    right = N if opts.right < 0 else min(opts.right, N)
    win_lo, win_hi = (M - N) - left, (M - N) + right
    return (win_lo, win_hi, opts.cap_in, opts.cap_out), opts.alibi, opts.alibi_strides, opts.consts


# ----------------------------------------------------------------------------------------------
# the fast case on Hopper: kernels/softmax_hopper.py (issue 26)
# ----------------------------------------------------------------------------------------------


def _fast_path(q, k, v, mask, dropout_p, config, window_left, window_right, softcap,
               alibi_slopes, *more) -> bool:
    """Whether this call goes to kernels/softmax_hopper.py's measured fast-case kernels (its
    FAST_FWD / FAST_BWD: 1.02-1.07x this file's forward, 1.22-1.28x its backward on an H200).

    The case: no mask, dropout or score option, no explicit ``config``, float16 / bfloat16,
    D = Dv in {64, 128} (the head dims measured), unit head-dim strides, non-empty.
    ``ATTNKIT_TRITON_HOPPER``: ``auto`` (default: CUDA tensors on a compute-capability 9.x
    device -- the only chip it was measured on), ``1`` (wherever the case holds, the interpreter
    included: the tests), ``0`` (never)."""
    mode = _TRITON_HOPPER() or "auto"
    if mode == "0" or config is not None or mask is not None or dropout_p > 0.0:
        return False
    if window_left != -1 or window_right != -1 or softcap != 0.0 or alibi_slopes is not None:
        return False
    D, Dv = q.shape[-1], v.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or D != Dv or D not in (64, 128):
        return False
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v, *more)):
        return False
    if mode == "1":
        return True
    return q.is_cuda and not INTERPRETED and _capability_major(q.device.index) == 9


_TRITON_HOPPER = env_reader("ATTNKIT_TRITON_HOPPER")  # read on every call: the tests set it


@functools.lru_cache(maxsize=None)
def _capability_major(index) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _launch(name, dmax, grid, args, consts, config):
    """Run kernel ``name`` with ``config`` or, when None, autotuned (first candidate when
    interpreted).  ``grid(BLOCK_M, BLOCK_N)`` gives the launch grid."""
    launch(_kernel(name), lambda: _autotuned(name, dmax), lambda: configs_for(name, dmax), grid,
           args, consts, config)


def _batch_rows(x, sl, batch, rank):
    """The rows ``sl`` of a per-batch argument (a mask [B, H | 1, N, M], ALiBi slopes [B, H]:
    ``rank`` dims with the batch first); a broadcast or batch-free one (None, [1, ...], [H],
    [N, M]) unchanged."""
    if isinstance(x, torch.Tensor) and x.dim() == rank and x.shape[0] == batch and batch > 1:
        return x[sl]
    return x


def softmax_fwd(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=0, config=None, *,
                window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    """Flash-attention forward.  Returns ``(out [B, H, N, Dv] in q.dtype, lse [B, H, N] f32)``.

    ``scale`` None means 1/sqrt(D).  ``config``: a ``triton.Config`` with BLOCK_M / BLOCK_N
    (and num_warps / num_stages) to skip autotuning; see ``FWD_CONFIGS``.  ``window_left`` /
    ``window_right`` (-1 = unbounded), ``softcap`` (0.0 = off), ``alibi_slopes`` (float32
    [B, H] or [H], None = off): the score options of the module docstring.  ``sinks`` (float32
    [H], None = off): one more logit of each row's softmax with no value, folded into the rows
    before they are rounded; out and lse are then those with the sink (a row with no visible
    key: out 0, lse = the sink), as :func:`softmax_bwd` takes them.  A batch past CUDA's grid
    limit (B > 65535) runs in slices (batch slice i with dropout seed ``seed + i``).
    """
    fn = "softmax_fwd"
    _check_inputs(fn, q, k, v, dropout_p)
    B, H, N, D = q.shape
    slices = batch_slices(B)  # (grid: (query tiles, H, B))
    if slices is not None:
        parts = [softmax_fwd(q[sl], k[sl], v[sl], _batch_rows(mask, sl, B, 4), scale, is_causal, dropout_p,
                             int(seed) + i, config, window_left=window_left, window_right=window_right,
                             softcap=softcap, alibi_slopes=_batch_rows(alibi_slopes, sl, B, 2), sinks=sinks)
                 for i, sl in enumerate(slices)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    Hk, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if sinks is None and _fast_path(q, k, v, mask, dropout_p, config, window_left, window_right,
                                    softcap, alibi_slopes):
        from .softmax_hopper import fast_fwd

        return fast_fwd(q, k, v, scale, is_causal)
    out = torch.empty((B, H, N, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    mask_kind, mask_t, mask_strides = _prepare_mask(fn, mask, q, B, H, N, M)
    opt_args, alibi, alibi_strides, opt_consts = _prepare_options(
        fn, q, B, H, N, M, scale, window_left, window_right, softcap, alibi_slopes)
    sinks_t, has_sinks = sink_args(fn, q, H, sinks)
    if B * H * N == 0:
        return out, lse
    if M == 0:  # no key at all: every row is fully masked (with sinks: the sink alone)
        out.zero_()
        lse.fill_(float("-inf"))
        if has_sinks:
            from .. import score_options

            return score_options.add_sinks(out, lse, sinks_t)
        return out, lse
    has_dropout = dropout_p > 0.0
    block_d, block_dv = pow2(D), pow2(Dv)
    args = (q, k, v, mask_t, alibi, sinks_t, q, q, out, lse,  # (q: the unread CuQ / CuK)
            scale, float(dropout_p) if has_dropout else 0.0, int(seed) if has_dropout else 0,
            *opt_args, *strides(q), *strides(k), *strides(v), *mask_strides, *alibi_strides,
            *strides(out), H, N, M, H // Hk)
    consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                  IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, HAS_DROPOUT=has_dropout,
                  **opt_consts, HAS_SINKS=has_sinks, DOT_PREC=dot_precision(q.dtype), VARLEN=False)
    _launch("fwd", max(block_d, block_dv), lambda bm, bn: (cdiv(N, bm), H, B), args,
            consts, config)
    return out, lse


def softmax_bwd(grad_out, q, k, v, out, lse, mask, scale, is_causal, dropout_p=0.0, seed=0,
                config=None, *, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    """Flash-attention backward from the forward's ``out`` and ``lse``; returns (dq, dk, dv).

    ``dropout_p`` / ``seed`` must be those of the forward (the mask is regenerated).  ``config``:
    None (autotune), one ``triton.Config`` for both the dK/dV and the dQ kernel, or a pair
    ``(dkdv_config, dq_config)``; see ``BWD_DKDV_CONFIGS`` and ``BWD_DQ_CONFIGS``.  No gradient
    is returned for an additive mask.  The score options (``window_left``, ``window_right``,
    ``softcap``, ``alibi_slopes``) must be those of the forward; the slopes get no gradient.
    """
    fn = "softmax_bwd"
    _check_inputs(fn, q, k, v, dropout_p)
    B, H, N, D = q.shape
    Hk, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    check_backward_inputs(fn, grad_out, out, lse, B, H, N, Dv)
    slices = batch_slices(B)  # as softmax_fwd's (the same slices and seeds)
    if slices is not None:
        parts = [softmax_bwd(grad_out[sl], q[sl], k[sl], v[sl], out[sl], lse[sl], _batch_rows(mask, sl, B, 4), scale,
                             is_causal, dropout_p, int(seed) + i, config, window_left=window_left,
                             window_right=window_right, softcap=softcap,
                             alibi_slopes=_batch_rows(alibi_slopes, sl, B, 2))
                 for i, sl in enumerate(slices)]
        return tuple(torch.cat(grads) for grads in zip(*parts))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if _fast_path(q, k, v, mask, dropout_p, config, window_left, window_right, softcap,
                  alibi_slopes, grad_out):
        from .softmax_hopper import fast_bwd

        return fast_bwd(grad_out, q, k, v, out, lse, scale, is_causal)
    mask_kind, mask_t, mask_strides = _prepare_mask(fn, mask, q, B, H, N, M)
    opt_args, alibi, alibi_strides, opt_consts = _prepare_options(
        fn, q, B, H, N, M, scale, window_left, window_right, softcap, alibi_slopes)
    cfg_dkdv, cfg_dq = split_config(config)

    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    if B * H == 0:
        return dq, dk, dv
    if N == 0 or M == 0:  # no query-key pair: nothing flows back
        return dq.zero_(), dk.zero_(), dv.zero_()

    lse = lse.contiguous()
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    block_d, block_dv = pow2(D), pow2(Dv)
    pre_block = 64
    wrap_triton(_attn_bwd_preprocess)[(cdiv(N, pre_block), H, B)](
        out, grad_out, delta, *strides(out), *strides(grad_out), H, N,
        HEAD_DV=Dv, BLOCK_DV=block_dv, BLOCK_M=pre_block)

    has_dropout = dropout_p > 0.0
    common = (scale, float(dropout_p) if has_dropout else 0.0, int(seed) if has_dropout else 0,
              *opt_args, *strides(q), *strides(k), *strides(v), *mask_strides, *alibi_strides,
              *strides(grad_out))
    consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                  IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, HAS_DROPOUT=has_dropout,
                  **opt_consts, DOT_PREC=dot_precision(q.dtype), VARLEN=False)
    dmax = max(block_d, block_dv)
    _launch("dkdv", dmax, lambda bm, bn: (cdiv(M, bn), Hk, B),
            (q, k, v, mask_t, alibi, q, q, grad_out, lse, delta, dk, dv, *common, *strides(dk),
             *strides(dv), H, N, M, H // Hk), consts, cfg_dkdv)
    _launch("dq", dmax, lambda bm, bn: (cdiv(N, bm), H, B),
            (q, k, v, mask_t, alibi, q, q, grad_out, lse, delta, dq, *common, *strides(dq), H, N, M,
             H // Hk), consts, cfg_dq)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# packed sequences (attnkit.softmax_attention_varlen): the same kernels, one launch for the pack
# ----------------------------------------------------------------------------------------------

_UNBOUNDED = 1 << 30  # a window side that hides nothing in any sequence (see _sequence_window)


def _varlen_views(q, k, v):
    """The packed ``[total, heads, dim]`` tensors as the kernels' ``[1, heads, total, dim]``."""
    return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))


def _varlen_strides(t):
    """A ``[1, heads, total, dim]`` view's strides with 0 for the batch: the kernels index the
    sequences through their first rows, not the batch stride."""
    return (0, *t.stride()[1:])


def _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{fn}: {name} must be 3-D [total, heads, dim]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
    check_attention_shapes(fn, *_varlen_views(q, k, v))
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not torch.is_tensor(cu) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 \
                or cu.numel() == 0 or cu.device != q.device:
            raise ValueError(f"{fn}: {name} must be a 1-D int32 / int64 tensor [batch + 1] on q's device; "
                             f"got {cu!r}"[:300])
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must have one length; got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0; got {x!r}")
    _check_device(fn, q)


def _varlen_window(left, right):
    """(win_lo, win_hi) launch arguments of a packed call: -left and right, an unbounded side
    (-1) as a bound no sequence reaches; the kernels clamp them to each sequence's lengths and
    align them at its M - N (_sequence_window)."""
    return (-left if left >= 0 else -_UNBOUNDED), (right if right >= 0 else _UNBOUNDED)


def softmax_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                       is_causal, config=None, *, window_left=-1, window_right=-1, softcap=0.0,
                       alibi_slopes=None, sinks=None, dropout_p=0.0, seed=0):
    """Attention over packed sequences in one launch per kernel (FlashAttention's varlen layout).

    q ``[total_q, H, D]``, k ``[total_k, Hk, D]``, v ``[total_k, Hk, Dv]`` (any strides);
    ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 / int64 ``[batch + 1]`` on q's device: sequence b
    is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` against key rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``; ``max_seqlen_q`` / ``max_seqlen_k`` at least every
    sequence's lengths (they size the grid: the offsets are never read by the host, so a call can
    be captured in a CUDA graph).  The offsets are not checked here (``attnkit.
    softmax_attention_varlen`` checks them): wrong ones read and write out of range.
    ``is_causal`` top-left per sequence, the window bottom-right per sequence, ``alibi_slopes``
    float32 ``[batch, H]`` (a row per sequence) or ``[H]``, ``sinks`` float32 ``[H]``: as
    :func:`softmax_fwd` has them for each sequence.  No mask.  ``dropout_p`` / ``seed``: dropout
    on the probabilities, sequence b's mask drawn with the Philox key ``seed + b``
    (:func:`varlen_dropout_keep_masks`).

    Returns ``(out [total_q, H, Dv] in q.dtype, lse [H, total_q] float32)`` (the lse
    head-major, as the backward takes it); a sequence with no key gives out 0 and lse -inf (or
    the sink).
    """
    fn = "softmax_varlen_fwd"
    _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    (total_q, H, D), (total_k, Hk, _), Dv = q.shape, k.shape, v.shape[2]
    batch = cu_seqlens_q.numel() - 1
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty((total_q, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    q4, k4, v4 = _varlen_views(q, k, v)
    opts = score_option_args(fn, q, max(batch, 1), H, scale, window_left, window_right, softcap, alibi_slopes)
    sinks_t, has_sinks = sink_args(fn, q, H, sinks)
    dropout_p = _check_dropout(fn, dropout_p)
    if batch == 0 or total_q == 0 or max_seqlen_q == 0:
        return out, lse
    block_d, block_dv = pow2(D), pow2(Dv)
    args = (q4, k4, v4, q, opts.alibi, sinks_t, cu_seqlens_q, cu_seqlens_k, out, lse,
            scale, dropout_p, int(seed), *_varlen_window(opts.left, opts.right), opts.cap_in, opts.cap_out,
            *_varlen_strides(q4), *_varlen_strides(k4), *_varlen_strides(v4), 0, 0, 0, 0, *opts.alibi_strides,
            *_varlen_strides(out.transpose(0, 1).unsqueeze(0)), H, total_q, total_k, H // Hk)
    consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=bool(is_causal),
                  MASK_KIND=0, HAS_DROPOUT=dropout_p > 0.0, **opts.consts, HAS_SINKS=has_sinks,
                  DOT_PREC=dot_precision(q.dtype), VARLEN=True)
    _launch("fwd", max(block_d, block_dv), lambda bm, bn: (cdiv(max_seqlen_q, bm), H, batch), args,
            consts, config)
    return out, lse


def softmax_varlen_bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, scale, is_causal, config=None, *, window_left=-1,
                       window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=0):
    """The backward of :func:`softmax_varlen_fwd` from its ``out [total_q, H, Dv]`` and ``lse
    [H, total_q]`` (float32) -- with sinks, the ones they folded in; returns ``(dq, dk, dv)``
    shaped and typed like q, k, v (contiguous).  ``config``: as :func:`softmax_bwd`'s;
    ``dropout_p`` / ``seed``: the forward's."""
    fn = "softmax_varlen_bwd"
    _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    (total_q, H, D), (total_k, Hk, _), Dv = q.shape, k.shape, v.shape[2]
    batch = cu_seqlens_q.numel() - 1
    g4, o4 = (t.transpose(0, 1).unsqueeze(0) for t in (grad_out, out))
    check_backward_inputs(fn, g4, o4, lse.unsqueeze(0), 1, H, total_q, Dv)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    opts = score_option_args(fn, q, max(batch, 1), H, scale, window_left, window_right, softcap, alibi_slopes)
    dropout_p = _check_dropout(fn, dropout_p)
    cfg_dkdv, cfg_dq = split_config(config)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if batch == 0 or total_q == 0 or total_k == 0:  # no query-key pair: nothing flows back
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    # D = rowsum(dO o O): the pack as one sequence of total_q rows (the [H, total_q] layout)
    delta = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    block_d, block_dv = pow2(D), pow2(Dv)
    pre_block = 64
    wrap_triton(_attn_bwd_preprocess)[(cdiv(total_q, pre_block), H, 1)](
        o4, g4, delta, *strides(o4), *strides(g4), H, total_q,
        HEAD_DV=Dv, BLOCK_DV=block_dv, BLOCK_M=pre_block)
    q4, k4, v4 = _varlen_views(q, k, v)
    common = (scale, dropout_p, int(seed), *_varlen_window(opts.left, opts.right), opts.cap_in, opts.cap_out,
              *_varlen_strides(q4), *_varlen_strides(k4), *_varlen_strides(v4), 0, 0, 0, 0, *opts.alibi_strides,
              *_varlen_strides(g4))
    consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=bool(is_causal),
                  MASK_KIND=0, HAS_DROPOUT=dropout_p > 0.0, **opts.consts, DOT_PREC=dot_precision(q.dtype),
                  VARLEN=True)
    dmax = max(block_d, block_dv)
    dk4, dv4, dq4 = _varlen_views(dk, dv, dq)
    cu = (cu_seqlens_q, cu_seqlens_k)
    _launch("dkdv", dmax, lambda bm, bn: (cdiv(max_seqlen_k, bn), Hk, batch),
            (q4, k4, v4, q, opts.alibi, *cu, g4, lse, delta, dk4, dv4, *common, *_varlen_strides(dk4),
             *_varlen_strides(dv4), H, total_q, total_k, H // Hk), consts, cfg_dkdv)
    _launch("dq", dmax, lambda bm, bn: (cdiv(max_seqlen_q, bm), H, batch),
            (q4, k4, v4, q, opts.alibi, *cu, g4, lse, delta, dq4, *common, *_varlen_strides(dq4), H,
             total_q, total_k, H // Hk), consts, cfg_dq)
    return dq, dk, dv


def varlen_dropout_keep_masks(cu_seqlens_q, cu_seqlens_k, H, dropout_p, seed, device):
    """The keep masks that ``softmax_varlen_fwd`` / ``softmax_varlen_bwd`` apply, one bool
    ``[H, n_b, m_b]`` per sequence (True = kept): sequence b's rows of
    ``dropout_keep_mask(1, H, total_q, m_b, dropout_p, seed + b)`` (see _dropout_keep).  Reads
    the offsets on the host (a checking tool, like dropout_keep_mask)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    total_q = cq[-1]
    return [dropout_keep_mask(1, H, total_q, ck[b + 1] - ck[b], dropout_p, seed + b, device)[0, :, cq[b]:cq[b + 1]]
            for b in range(len(cq) - 1)]


def dropout_keep_mask(B, H, N, M, dropout_p, seed, device):
    """The keep mask (bool [B, H, N, M], True = kept) that ``softmax_fwd`` / ``softmax_bwd``
    apply for this ``dropout_p`` and ``seed`` (past CUDA's grid limit, per batch slice as they
    take it: slice i's with ``seed + i``)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_keep_mask: dropout_p must be in [0, 1); got {dropout_p}")
    slices = batch_slices(B)
    if slices is not None:
        return torch.cat([dropout_keep_mask(sl.stop - sl.start, H, N, M, dropout_p, int(seed) + i, device)
                          for i, sl in enumerate(slices)])
    keep = torch.empty((B, H, N, M), dtype=torch.bool, device=device)
    if keep.numel() == 0:
        return keep
    _check_device("dropout_keep_mask", keep)
    bm = min(32, next_pow2(N))  # no tl.dot here: tiles may be thin
    bn = min(2048 // bm, next_pow2(M))
    wrap_triton(_dropout_keep_kernel)[(cdiv(N, bm) * cdiv(M, bn), H, B)](
        keep.view(torch.uint8), float(dropout_p), int(seed), H, N, M, BLOCK_M=bm, BLOCK_N=bn)
    return keep

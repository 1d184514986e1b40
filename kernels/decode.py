"""Triton split-KV ("flash-decoding") kernels for softmax attention with few query rows (issue 26).

Layer 1 of the softmax family (see DESIGN.md): ``@triton.jit`` kernels and their launcher, no
autograd.  ``attnkit.attention_with_kvcache`` (pytorch_ext/ops/kvcache.py) calls it on the triton
backend for N <= 16 new queries.

Launcher
--------
``softmax_decode_fwd(q, k, v, scale=None, *, kv_lens=None, num_splits=None, config=None,
is_causal=True, merge=None, block_table=None)`` -> ``(out [B, H, N, Dv] in q.dtype, lse [B, H, N]
float32)``.  With ``block_table`` (int32 / int64 ``[B, max_blocks]``) k / v are a paged cache
``[num_blocks, Hk, block_size, *]`` read in place: each key tile's rows are addressed through the
table (one table load per key), so the tiles -- and the results' bits -- are the dense call's.

Shapes: q ``[B, H, N, D]`` with ``1 <= N <= 16`` (N = 0 gives empty results), k ``[B, Hk, M, D]``,
v ``[B, Hk, M, Dv]``, ``H % Hk == 0`` (GQA / MQA; query head h reads kv head ``h // (H // Hk)``),
any strides (read as given, never copied).  float16, bfloat16, float32 (float32 accumulation);
head dims up to 256, any value.

Semantics (FlashAttention's ``flash_attn_with_kvcache`` decoding alignment): batch element b has
``L_b = kv_lens[b]`` valid keys (``kv_lens``: optional int32 / int64 ``[B]`` on q's device,
default M; values are clamped to ``[0, M]`` on the device -- no host synchronization checks
them), and the N query rows are the *last* N positions of that sequence, causally aligned
bottom-right: query i sees key j iff ``j <= L_b - N + i`` (so query N - 1 sees all L_b keys; for
N = 1 this is just ``j < L_b``); ``is_causal=False`` lets every query see all L_b keys.  A row
that sees no key (``L_b - N + i < 0``, e.g. L_b = 0)
gives out = 0 and lse = -inf, never NaN.  NaN (README, "Shapes and NaN semantics"): a NaN key --
or one that makes a score +inf -- makes NaN exactly the rows that see it (out and lse); a NaN
value reaches at least the rows that see it.  ``scale`` None means ``1 / sqrt(D)``.

Score options (issue 28; keyword-only, FlashAttention's semantics, the positions bottom-right:
query i is at ``p = L_b - N + i``): ``window_left`` / ``window_right`` (-1 = unbounded) -- key j
seen iff ``p - left <= j <= p + right``, on top of the causal bound; the splits cut only the keys
some row sees, ``[L_b - N - left, L_b)`` (tile aligned), so a sliding-window decode reads the
window, not the cache -- ``softcap`` (``s = softcap * tanh(s / softcap)`` after scaling) and
``alibi_slopes`` (float32 ``[H]`` or ``[B, H]``: ``s -= slope * |p - j|``).  Each is a constexpr
flag (HAS_WINDOW / HAS_SOFTCAP / HAS_ALIBI, in the autotune key): without them the kernel compiles
as before.  Sinks are not a kernel option: ``attention_with_kvcache`` applies them to (out, lse).

How it runs
-----------
Decoding is bound by reading K and V once.  A program of the split kernel handles one
(row block, key split, kv head, batch): the ``G * N`` query rows that share kv head ``hk``
(``G = H // Hk``, row ``r`` = query head ``hk * G + r // N``, query ``r % N``) are stacked into
one ``[BLOCK_M, D]`` tile (BLOCK_M >= 16 so that ``tl.dot`` has M >= 16; padded rows are masked),
so each K / V tile is loaded once for the whole group.  Groups of more than BLOCK_M rows (MQA
with many heads) take several row blocks; those are adjacent in the grid (the fastest axis), so
the later ones read the same K / V tile from L2.  The keys ``[0, L_b)`` are cut into
``num_splits`` splits of ``chunk_b = roundup(cdiv(L_b, S), BLOCK_N)`` keys (tile aligned; splits
past the end are empty): every K / V row is read by exactly one program per row block.  Tiles
that every row sees whole (``j < L_b - N + 1``) run without element masks; only the last one or
two tiles of a sequence are masked.

With one split the kernel writes out and lse directly.  Otherwise each program writes its
float32 partial (out_s normalized by its own sum, lse_s) to scratch ``[B, H, N, S, Dv]`` /
``[B, H, N, S]``, and they are combined per row, exactly and overflow-free:
``m = max_s lse_s``, ``w_s = exp(lse_s - m)``, ``out = sum_s w_s out_s / sum_s w_s``,
``lse = m + log(sum_s w_s)``; empty splits (lse_s = -inf) weigh 0, a NaN lse_s poisons the row.
Two ways (``merge=``):

- ``"separate"`` (``DEFAULT_MERGE``): a second kernel, a few rows per program.
- ``"fused"``: no second launch.  After storing its partial, each split program increments a
  counter of its (row block, kv head, batch) -- a barrier, then one gpu-scope acq_rel atomic --
  and the program that sees ``S - 1`` (the last to finish) reads the S partials back from L2,
  merges them, writes out / lse and sets the counter back to 0.  The counters live in one
  int32 buffer per device and stream that is all zeros between launches, so a call costs no
  memset.  The MQA / first-H200-run motive: at 34 MB of K/V the two launches, not the bytes,
  set the time (~24 us against ~8 us of copy).

Splits (``num_splits`` None): :func:`default_num_splits` -- about MIN_WAVES programs per SM,
spread evenly over the SMs (SM count from ``torch.cuda.get_device_properties``; 132, an
H100's, off CUDA), each split >= 256 keys, the partials within PARTIAL_SHARE of the K/V bytes.

Tuning: ``DECODE_CONFIGS`` (8 entries: the configs that led or came close on the first H200 run,
64- and 128-key tiles on 2-8 warps with 2-3 stages); :func:`configs_for` fills in the row tile BLOCK_M for a group size and drops the
configs whose tiles would not fit the registers or the shared memory (an estimate,
:func:`_smem_estimate`; a config that still runs out fails to compile and the autotuner skips
it).  ``config=`` (a
``triton.Config`` with BLOCK_N, optionally BLOCK_M) skips autotuning; under the Triton
interpreter the first eligible config is used.  The autotuner is keyed on the head dims, the
group size, the number of splits, the masking and the merge variant (plus the dtypes); ``M`` and
the split count are not specialized on, so one compiled kernel serves a growing cache.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._flash import (INTERPRETED, MAX_HEAD_DIM, SUPPORTED_DTYPES, _LN2, _LOG2E, accumulate_pv, cdiv,
                     check_attention_shapes, finish_rows, finish_rows_sink, fold_sink, launch,
                     load_2d, load_rows, next_pow2, online_softmax_update, option_scores, pow2,
                     score_option_args, sink_args)

__all__ = [
    "softmax_decode_fwd",
    "default_num_splits",
    "configs_for",
    "DECODE_CONFIGS",
    "MAX_QUERY_ROWS",
    "MIN_SPLIT_KEYS",
    "MERGE_MODES",
    "DEFAULT_MERGE",
    "wave_balance",
    "MAX_HEAD_DIM",
    "SUPPORTED_DTYPES",
]

MAX_QUERY_ROWS = 16  # N above this is prefill: use kernels.softmax.softmax_fwd
MIN_SPLIT_KEYS = 256  # the heuristic never cuts a split shorter than this
MIN_WAVES = 2  # the heuristic aims at this many programs per SM (see default_num_splits)
PARTIAL_SHARE = 0.125  # ... and keeps the float32 partials within this share of the K/V bytes
MERGE_MODES = ("separate", "fused")
# The separate merge kernel stays the default until a GPU run shows the fused one faster
# (bench/decode_gpu.py times both on the same inputs).
DEFAULT_MERGE = "separate"
DEFAULT_SM_COUNT = 132  # an H100 SXM's, for the heuristic off CUDA
MAX_BLOCK_M = 128  # the largest row tile (a group of more rows takes several row blocks)

# ----------------------------------------------------------------------------------------------
# autotune search space
# ----------------------------------------------------------------------------------------------

# (BLOCK_N, num_warps, num_stages), the likely best first.  Pruned from the 27-entry product of
# {64, 128, 256} keys x {2, 4, 8} warps x {2, 3, 4} stages by the first H200 run (2026-11-27,
# bench/RESULTS.md session 10: bf16 D = 128, M = 8192, GQA 32/8 N = 4 and MQA N = 1 / 4, % of copy
# bandwidth per config): 64-key tiles on 2 warps with 2-3 stages led GQA (76%), 4 warps / 3 stages
# MQA N = 1, 8 warps / 3 stages (128-row tiles) MQA N = 4; no 256-key tile, no 128-key tile on 2
# warps and no 4-stage pipeline came within 10% of a shape's best anywhere, so they are gone (an
# autotune or a bench sweep costs one compile and one timing per entry).  BLOCK_M (the row tile)
# is filled in per call by configs_for.  The first entry is what the interpreter -- and a launch
# with autotuning off -- runs when no config is given.
_CONFIG_TUPLES = (
    (64, 2, 2),  # GQA N = 1..4 best (16-row tiles)
    (64, 2, 3),
    (64, 4, 3),  # MQA N = 1 best
    (64, 8, 3),  # MQA N = 4 best (128-row tiles: wgmma)
    (128, 8, 3),
    (64, 4, 2),
    (128, 4, 3),
    (128, 8, 2),
)
DECODE_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
                  for bn, w, s in _CONFIG_TUPLES]
# Registers: score-tile x head-dim elements per thread, BLOCK_M * BLOCK_N * (padded head dim) /
# (32 * num_warps), above which the split kernel spilled (Triton 3.9 for sm_90, compiled on the
# CPU, 2026-11-27): the mma.sync path (row tiles < 64, or 2 warps) spilled 0-600 bytes at 4096 and
# 0.7-2.7 KB at 8192; the wgmma path (row tiles >= 64, >= 4 warps) none or 40-470 bytes at 8192,
# 1.1 KB at 16384.
_PER_THREAD_LIMIT = {"mma": 4096, "wgmma": 8192}
# Shared memory per block on an H100 / H200 (227 KiB); see _smem_estimate.
_SMEM_LIMIT = 232448
# + dtypes (automatic).  The merge variant and the masking are constexprs the autotuner would not
# tell apart otherwise: a config tuned for one must not be reused for the other.
_TUNE_KEY = ["HEAD_D", "HEAD_DV", "GROUP", "N", "NUM_SPLITS", "IS_CAUSAL", "FUSED_MERGE", "HAS_WINDOW",
             "HAS_SOFTCAP", "HAS_ALIBI", "HAS_SINKS"]


def _row_tile(rows: int, config, block_d: int, block_dv: int, esize: int) -> int:
    """The row tile for ``rows`` stacked query rows under ``config``: the power of two covering
    them (at least 16, at most MAX_BLOCK_M), halved until the tiles fit (:func:`_fits`; a group
    too big for one tile takes several row blocks)."""
    bm = max(16, min(next_pow2(max(int(rows), 1)), MAX_BLOCK_M))
    while bm > 16 and not _fits(config, bm, block_d, block_dv, esize):
        bm //= 2
    return bm


def _wgmma(block_m, num_warps, esize):
    """Whether Triton takes Hopper's wgmma path for the split kernel's products (16-bit inputs,
    row tiles of 64+ rows and a whole warpgroup); otherwise mma.sync (or FMA for float32)."""
    return block_m >= 64 and num_warps >= 4 and esize == 2


def _smem_estimate(block_m, block_n, block_d, block_dv, num_stages, esize, num_warps=4):
    """Shared memory of the split kernel as Triton 3.9 laid it out for sm_90 (compiled ahead of
    time on the CPU, 2026-11-27, bf16 D = 128: exact for every wgmma config and every mma.sync
    one with BLOCK_M <= 32, an overestimate for 128-row tiles on 2 warps): wgmma keeps
    ``num_stages`` K / V buffers plus q; mma.sync ``num_stages - 1`` buffers plus q and p."""
    kv = block_n * (block_d + block_dv) * esize
    if _wgmma(block_m, num_warps, esize):
        return num_stages * kv + block_m * block_d * esize
    return max(num_stages - 1, 1) * kv + block_m * (block_d + block_n) * esize


def _fits(config, block_m, block_d, block_dv, esize):
    """Whether ``config`` with row tile ``block_m`` fits the registers (without heavy spills)
    and the shared memory."""
    bn, warps, stages = config.kwargs["BLOCK_N"], config.num_warps, config.num_stages
    per_thread = block_m * bn * max(block_d, block_dv) // (32 * warps)
    limit = _PER_THREAD_LIMIT["wgmma" if _wgmma(block_m, warps, esize) else "mma"]
    smem = _smem_estimate(block_m, bn, block_d, block_dv, stages, esize, warps)
    return per_thread <= limit and smem <= _SMEM_LIMIT


def configs_for(head_dim: int, value_dim: int | None = None, rows: int = 16,
                dtype: torch.dtype = torch.float16) -> list:
    """The autotune candidates for these head dims, ``rows`` = G * N stacked query rows per
    kv head and the input ``dtype``: the entries of ``DECODE_CONFIGS`` that fit (:func:`_fits`:
    registers and shared memory) with some row tile, each with its BLOCK_M filled in (the
    largest that fits, :func:`_row_tile`).  Never empty (the smallest tile when nothing fits)."""
    block_d = pow2(head_dim)
    block_dv = pow2(head_dim if value_dim is None else value_dim)
    esize = torch.empty((), dtype=dtype).element_size()
    out = []
    for c in DECODE_CONFIGS:
        bm = _row_tile(rows, c, block_d, block_dv, esize)
        if _fits(c, bm, block_d, block_dv, esize):
            out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": c.kwargs["BLOCK_N"]},
                                     num_warps=c.num_warps, num_stages=c.num_stages))
    if not out:
        c = min(DECODE_CONFIGS, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages, c.num_warps))
        out.append(triton.Config({"BLOCK_M": 16, "BLOCK_N": c.kwargs["BLOCK_N"]},
                                 num_warps=c.num_warps, num_stages=c.num_stages))
    return out


@functools.lru_cache(maxsize=None)
def _autotuned(head_dim: int, value_dim: int, rows: int, dtype: torch.dtype):
    return triton.autotune(configs=configs_for(head_dim, value_dim, rows, dtype),
                           key=_TUNE_KEY)(_decode_split_kernel)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _paged_rows(base, block, slot, stride_blk, stride_n, offs_d, stride_d, row_ok, HEAD_D: tl.constexpr,
                BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Rows ``slot`` of blocks ``block`` ([R] int64 each) of a paged cache at ``base`` -> [R, BLOCK_D],
    zeros where masked (as load_rows)."""
    return load_2d(base + (block * stride_blk + slot * stride_n)[:, None] + offs_d[None, :] * stride_d, row_ok,
                   offs_d < HEAD_D, CHECK_ROWS, BLOCK_D != HEAD_D)


@triton.jit
def _decode_tile(acc, l_i, m_i, q, k_tile, v_tile, k_base, v_base, start_n, end, bound, lower, qk_scale,
                 pos_col, slope_col, cap_in, cap_out,
                 stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv,
                 table_row, block_size, stride_kblk, stride_vblk,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """The key tile [start_n, start_n + BLOCK_N) (K / V rows from k_tile / v_tile, or through the
    table when PAGED) folded into (acc, l_i, m_i); see _decode_tiles."""
    offs = tl.arange(0, BLOCK_N)
    in_range = offs < end - start_n
    keys = start_n + offs
    if PAGED:
        block = tl.load(table_row + keys // block_size, mask=in_range, other=0).to(tl.int64)
        slot = (keys % block_size).to(tl.int64)
        k = _paged_rows(k_base, block, slot, stride_kblk, stride_kn, offs_d, stride_kd, in_range,
                        HEAD_D, BLOCK_D, MASKED)
    else:
        k = load_rows(k_tile, offs, stride_kn, offs_d, stride_kd, in_range, HEAD_D, BLOCK_D, MASKED)
    s, _ = option_scores(q, k, pos_col, keys[None, :], qk_scale, cap_in, cap_out, slope_col, 0,
                         HAS_SOFTCAP, HAS_ALIBI, False, DOT_PREC)
    if MASKED:
        visible = keys[None, :] <= bound[:, None]
        if HAS_WINDOW:
            visible = visible & (keys[None, :] >= lower[:, None])
        s = tl.where(visible, s, float("-inf"))
    p, alpha, l_i, m_i = online_softmax_update(s, m_i, l_i)
    if PAGED:
        v = _paged_rows(v_base, block, slot, stride_vblk, stride_vn, offs_dv, stride_vd, in_range,
                        HEAD_DV, BLOCK_DV, MASKED)
    else:
        v = load_rows(v_tile, offs, stride_vn, offs_dv, stride_vd, in_range, HEAD_DV, BLOCK_DV, MASKED)
    return accumulate_pv(acc, alpha, p, v, DOT_PREC), l_i, m_i


@triton.jit
def _decode_tiles(acc, l_i, m_i, q, k_base, v_base, lo, hi, lo2, hi2, bound, lower, qk_scale,
                  pos_col, slope_col, cap_in, cap_out,
                  stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv,
                  table_row, block_size, stride_kblk, stride_vblk,
                  HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, EDGES: tl.constexpr):
    """The key tiles [lo, hi) (lo a multiple of BLOCK_N) folded into (acc, l_i, m_i); with EDGES
    (a window's two band edges, both masked) the tiles of [lo, hi) and then those of
    [lo2, hi2) (lo2 a multiple of BLOCK_N), in one loop: one copy of the tile step instead of
    two (at the 16-row / 2-warp tile, GQA decoding's best, two copies spilled 40 bytes, one
    none; bench/triton_sm90_resources.py).  MASKED=False: every key of every tile is in range
    and seen by every row.  MASKED: keys at or past the range's end are not loaded, and row r
    sees key j iff j <= bound[r] (and, HAS_WINDOW, j >= lower[r]).  Scores: softcap (cap_in /
    cap_out as in _flash.option_scores), then ALiBi ``- slope_col[r] * |j - pos_col[r]|`` (base 2;
    pos_col: the row's query position).  PAGED: key j is row ``j % block_size`` of block
    ``table_row[j // block_size]`` (blocks ``stride_kblk`` / ``stride_vblk`` elements apart from
    k_base / v_base): each tile's rows are gathered through the table, in place."""
    if EDGES:
        n_first = tl.cdiv(hi - lo, BLOCK_N)  # hi is not a multiple of BLOCK_N where [lo2, hi2) is empty
        for step in range(0, n_first + tl.cdiv(hi2 - lo2, BLOCK_N)):
            second = step >= n_first
            start_n = tl.where(second, lo2 + (step - n_first) * BLOCK_N, lo + step * BLOCK_N)
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, k_base + start_n.to(tl.int64) * stride_kn,
                v_base + start_n.to(tl.int64) * stride_vn, k_base, v_base, start_n, tl.where(second, hi2, hi),
                bound, lower, qk_scale, pos_col, slope_col, cap_in, cap_out, stride_kn, stride_kd, stride_vn,
                stride_vd, offs_d, offs_dv, table_row, block_size, stride_kblk, stride_vblk, HEAD_D, HEAD_DV,
                BLOCK_D, BLOCK_DV, DOT_PREC, BLOCK_N, MASKED, PAGED, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
    else:
        # Tile pointers advanced from an int64 start: lo * stride can pass 2**31 elements on long
        # caches (offsets inside a tile stay small).
        k_tile = k_base + lo.to(tl.int64) * stride_kn
        v_tile = v_base + lo.to(tl.int64) * stride_vn
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _decode_tile(
                acc, l_i, m_i, q, k_tile, v_tile, k_base, v_base, start_n, hi, bound, lower, qk_scale,
                pos_col, slope_col, cap_in, cap_out, stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv,
                table_row, block_size, stride_kblk, stride_vblk, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC,
                BLOCK_N, MASKED, PAGED, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI)
            k_tile += BLOCK_N * stride_kn
            v_tile += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _finish_merge(acc, l, m, poisoned):
    """(out, lse) of merged rows: acc = sum_s w_s out_s, l = sum_s w_s, m the lse shift (natural
    log).  Rows whose splits all saw no key (l = 0): 0 and -inf; a NaN partial lse: NaN, NaN."""
    attended = l != 0.0
    l_safe = tl.where(attended, l, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(attended, m + tl.math.log2(l_safe) * _LN2, float("-inf"))
    nan = poisoned > 0
    out = tl.where(nan[:, None], float("nan"), out)
    lse = tl.where(nan, float("nan"), lse)
    return out, lse


@triton.jit
def _merge_row_partials(PartO, PartL, Sinks, row, h, row_ok, NUM_SPLITS, offs_dv,
                        HEAD_DV: tl.constexpr, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr,
                        HAS_SINKS: tl.constexpr):
    """out, lse of the flat rows ``row`` [ROWS] (query heads ``h``) from their NUM_SPLITS
    partials, one split at a time (a [ROWS, BLOCK_DV] tile each), merged online like
    _decode_merge_kernel, with the heads' sinks folded in last."""
    dv_ok = offs_dv < HEAD_DV
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], dtype=tl.float32)
    poisoned = tl.zeros([ROWS], dtype=tl.int32)
    for s in range(0, NUM_SPLITS):
        part = row * NUM_SPLITS + s
        # .cg (L2, not L1): the partials were written by other programs of this launch.
        lse_s = tl.load(PartL + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        is_nan = lse_s != lse_s
        poisoned += is_nan.to(tl.int32)
        lse_c = tl.where(is_nan, float("-inf"), lse_s)
        m_new = tl.maximum(m, lse_c)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m - m_use) * _LOG2E)
        w = tl.math.exp2((lse_c - m_use) * _LOG2E)  # an empty split (-inf): 0
        # A split of weight 0 is not read at all (its bytes, and 0 * NaN).
        o_s = tl.load(PartO + part[:, None] * HEAD_DV + offs_dv[None, :],
                      mask=(row_ok & (w > 0.0))[:, None] & dv_ok[None, :], other=0.0,
                      cache_modifier=".cg")
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l = l * alpha + w
        m = m_new
    if HAS_SINKS:  # the partials are the keys' alone: the sink joins at the merge (natural log)
        acc, l, m = fold_sink(acc, l, m, tl.load(Sinks + h, mask=row_ok, other=0.0), _LOG2E)
    return _finish_merge(acc, l, m, poisoned)


@triton.jit
def _fused_merge(PartO, PartL, Sinks, Out, Lse, b, hk, rb, H, N, GROUP, NUM_SPLITS,
                 stride_ob, stride_oh, stride_on, stride_od,
                 HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 HAS_SINKS: tl.constexpr):
    """The last program's merge of its row block: out and lse of rows ``rb * BLOCK_M ...`` from
    the partials, in sub-blocks of at most 32 rows -- at 128-row tiles one [128, Dv] tile of
    partials (and its 64-bit addresses) on top of the accumulator spilled 5 KB per thread (an
    sm_90 compile, Triton 3.9, 8 warps) against 1.3 KB without the merge."""
    SUB: tl.constexpr = BLOCK_M if BLOCK_M < 32 else 32
    rows_total = GROUP * N
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv[None, :] < HEAD_DV
    for r0 in range(0, BLOCK_M, SUB):
        rows = rb * BLOCK_M + r0 + tl.arange(0, SUB)
        row_ok = rows < rows_total
        g = rows // N
        qi = rows - g * N
        h = hk * GROUP + g
        row = (b * H + h) * N + qi
        out, lse = _merge_row_partials(PartO, PartL, Sinks, row, h, row_ok, NUM_SPLITS, offs_dv,
                                       HEAD_DV, SUB, BLOCK_DV, HAS_SINKS)
        o_ptrs = (Out + b * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_on
                  + offs_dv[None, :] * stride_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        tl.store(Lse + row, lse, mask=row_ok)


@triton.jit(do_not_specialize=["M", "NUM_SPLITS", "win_left", "win_right"])
def _decode_split_kernel(
    Q, K, V, KvLens, Out, Lse, PartO, PartL, Counters, Table, Alibi, Sinks,
    qk_scale, win_left, win_right, cap_in, cap_out,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lens, stride_tb, stride_ab, stride_ah, block_size,
    H, N, M, GROUP, NUM_SPLITS,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LENS: tl.constexpr, DIRECT: tl.constexpr, IS_CAUSAL: tl.constexpr,
    FUSED_MERGE: tl.constexpr, DOT_PREC: tl.constexpr, PAGED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One (row block, split) x kv head x batch program: the group's stacked query rows against
    the split's keys.  Grid: (row_blocks * NUM_SPLITS, Hk, B), row block fastest.

    DIRECT (one split): out and lse written here.  Otherwise the float32 partial goes to
    PartO / PartL; with FUSED_MERGE the last program of the (row block, kv head, batch) to finish
    -- the one whose increment of its counter in Counters returns NUM_SPLITS - 1 -- merges the
    NUM_SPLITS partials, writes out and lse and sets the counter back to 0 (so the buffer is
    all zeros again for the next launch: no memset launch per call)."""
    rows_total = GROUP * N
    row_blocks = tl.cdiv(rows_total, BLOCK_M)
    pid = tl.program_id(0)
    rb = pid % row_blocks
    split = pid // row_blocks
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)

    if HAS_LENS:
        kv_len = tl.load(KvLens + b * stride_lens).to(tl.int32)
        kv_len = tl.minimum(tl.maximum(kv_len, 0), M)
    else:
        kv_len = M
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < rows_total
    g = rows // N
    qi = rows - g * N  # the query index of the row
    h = hk * GROUP + g  # its query head (int64)
    pos = kv_len - N + qi  # its position in the sequence (bottom-right aligned)
    # Row r sees key j iff lower[r] <= j <= bound[r].  Causal (bottom-right): j <= pos, so keys
    # before kv_len - N + 1 are seen by every row; not causal: every key before kv_len.  A window
    # (win_left / win_right: an unbounded side comes as M + N) bounds both sides around pos.
    if IS_CAUSAL:
        bound = pos
        full_end = tl.maximum(kv_len - N + 1, 0)
    else:
        bound = kv_len - 1 + 0 * qi
        full_end = kv_len
    band_lo = 0  # no row sees a key before this (a multiple of BLOCK_N)
    full_first = 0  # every row sees the keys in [full_first, full_end)
    lower = bound
    if HAS_WINDOW:
        lower = pos - win_left
        bound = tl.minimum(bound, pos + win_right)
        band_lo = (tl.maximum(kv_len - N - win_left, 0) // BLOCK_N) * BLOCK_N
        full_first = tl.maximum(kv_len - 1 - win_left, 0)
        full_end = tl.maximum(tl.minimum(full_end, kv_len - N + win_right + 1), 0)
    # The splits cut the band [band_lo, kv_len) into tile-aligned chunks (empty past the end);
    # each chunk is masked before full_lo and from full_hi, whole in between.
    chunk = tl.cdiv(tl.cdiv(kv_len - band_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = band_lo + split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    hi = tl.maximum(hi, lo)  # an empty split past the end
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_first, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.maximum(tl.minimum(hi, (full_end // BLOCK_N) * BLOCK_N), full_lo)
    if HAS_ALIBI:
        slope_col = (tl.load(Alibi + b * stride_ab + h * stride_ah, mask=row_ok, other=0.0).to(tl.float32)
                     * _LOG2E)[:, None]
    else:
        slope_col = 0.0
    pos_col = pos[:, None]

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (Q + b * stride_qb + h[:, None] * stride_qh + qi[:, None] * stride_qn
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)

    if PAGED:  # K / V [num_blocks, Hk, block_size, *]: the batch element's blocks via its table row
        k_base = K + hk * stride_kh
        v_base = V + hk * stride_vh
    else:
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh
    table_row = Table + b * stride_tb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # The whole tiles, then the masked ones: the causal / right edge [full_hi, hi) and, with a
    # window, its left edge [lo, full_lo) in the same loop.
    acc, l_i, m_i = _decode_tiles(acc, l_i, m_i, q, k_base, v_base, full_lo, full_hi, 0, 0, bound, lower,
                                  qk_scale, pos_col, slope_col, cap_in, cap_out,
                                  stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv,
                                  table_row, block_size, stride_kb, stride_vb,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC, BLOCK_N, False, PAGED,
                                  HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, False)
    if HAS_WINDOW:
        acc, l_i, m_i = _decode_tiles(acc, l_i, m_i, q, k_base, v_base, lo, full_lo, full_hi, hi, bound, lower,
                                      qk_scale, pos_col, slope_col, cap_in, cap_out,
                                      stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv,
                                      table_row, block_size, stride_kb, stride_vb,
                                      HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC, BLOCK_N, True, PAGED,
                                      HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, True)
    else:
        acc, l_i, m_i = _decode_tiles(acc, l_i, m_i, q, k_base, v_base, full_hi, hi, 0, 0, bound, lower,
                                      qk_scale, pos_col, slope_col, cap_in, cap_out,
                                      stride_kn, stride_kd, stride_vn, stride_vd, offs_d, offs_dv,
                                      table_row, block_size, stride_kb, stride_vb,
                                      HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, DOT_PREC, BLOCK_N, True, PAGED,
                                      HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, False)
    if HAS_SINKS and DIRECT:  # the rows' sinks, folded in before the rounding (else at the merge)
        out, lse = finish_rows_sink(acc, l_i, m_i, tl.load(Sinks + h, mask=row_ok, other=0.0))
    else:
        out, lse = finish_rows(acc, l_i, m_i)

    row = (b * H + h) * N + qi  # flat (b, h, i) index: lse [B, H, N] and the partials
    dv_ok = offs_dv[None, :] < HEAD_DV
    if DIRECT:
        o_ptrs = (Out + b * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_on
                  + offs_dv[None, :] * stride_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        tl.store(Lse + row, lse, mask=row_ok)
    else:
        part = row * NUM_SPLITS + split  # [B, H, N, S] flat
        tl.store(PartO + part[:, None] * HEAD_DV + offs_dv[None, :], out,
                 mask=row_ok[:, None] & dv_ok)
        tl.store(PartL + part, lse, mask=row_ok)
        if FUSED_MERGE:
            counter = Counters + (b * tl.num_programs(1) + hk) * row_blocks + rb
            # Every thread's partial is stored before the (one-thread) release below publishes
            # them; the acquire side is the same atomic in the last program (CUTLASS's
            # semaphore pattern: barrier, then a gpu-scope release).
            tl.debug_barrier()
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:
                _fused_merge(PartO, PartL, Sinks, Out, Lse, b, hk, rb, H, N, GROUP, NUM_SPLITS,
                             stride_ob, stride_oh, stride_on, stride_od,
                             HEAD_DV, BLOCK_DV, BLOCK_M, HAS_SINKS)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _decode_merge_kernel(
    PartO, PartL, Sinks, Out, Lse,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N, ROWS, NUM_SPLITS,
    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """out, lse of BLOCK_R flat (b, h, i) rows from their NUM_SPLITS partials each (grid:
    cdiv(B * H * N, BLOCK_R)); BLOCK_S splits at a time, merged online, then the heads'
    sinks."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    qi = rows % N
    bh = rows // N
    h = bh % H
    b = bh // H
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DV
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    poisoned = tl.zeros([BLOCK_R], dtype=tl.int32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        part = rows[:, None] * NUM_SPLITS + (s0 + offs_s)[None, :]  # [BLOCK_R, BLOCK_S]
        ok = row_ok[:, None] & ((s0 + offs_s) < NUM_SPLITS)[None, :]
        lse_s = tl.load(PartL + part, mask=ok, other=float("-inf"))
        # A NaN lse_s (the split saw a NaN score) poisons the row; the running max skips it.
        is_nan = lse_s != lse_s
        poisoned += tl.sum(is_nan.to(tl.int32), 1)
        lse_c = tl.where(is_nan, float("-inf"), lse_s)
        m_new = tl.maximum(m, tl.max(lse_c, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m - m_use) * _LOG2E)
        w = tl.math.exp2((lse_c - m_use[:, None]) * _LOG2E)  # empty splits (-inf): 0
        o_s = tl.load(PartO + part[:, :, None] * HEAD_DV + offs_dv[None, None, :],
                      mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0)
        # w = 0 adds exactly 0 (not 0 * NaN from a split that saw no key)
        contrib = tl.where(w[:, :, None] > 0.0, w[:, :, None] * o_s, 0.0)
        acc = acc * alpha[:, None] + tl.sum(contrib, 1)
        l = l * alpha + tl.sum(w, 1)
        m = m_new
    if HAS_SINKS:
        acc, l, m = fold_sink(acc, l, m, tl.load(Sinks + h, mask=row_ok, other=0.0), _LOG2E)
    out, lse = _finish_merge(acc, l, m, poisoned)
    o_ptrs = (Out + b[:, None] * stride_ob + h[:, None] * stride_oh + qi[:, None] * stride_on
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(Lse + rows, lse, mask=row_ok)


MERGE_MIN_PROGRAMS = 128  # the separate merge's grid aims at about one program per SM


def _merge_tiles(splits: int, block_dv: int, rows: int | None = None) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_R) of the separate merge kernel: up to 8192 float32 partial elements a
    step, and -- given ``rows`` = B * H * N, the rows to merge -- few enough rows per program
    that the grid has about MERGE_MIN_PROGRAMS programs (at least 2 rows each): the merge is a
    latency-bound gather, and 32 rows a program left GQA N = 1 (256 rows) with 8 programs on
    132 SMs."""
    block_s = min(next_pow2(splits), 16)
    block_r = max(2, min(32, 8192 // (block_s * block_dv)))
    if rows is not None:
        spread = 1 << max(0, (max(int(rows), 1) // MERGE_MIN_PROGRAMS).bit_length() - 1)
        block_r = max(2, min(block_r, spread))
    return block_s, block_r


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (DEFAULT_SM_COUNT off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def wave_balance(ctas: int, sms: int) -> float:
    """How evenly ``ctas`` equal programs fill ``sms`` multiprocessors: ctas / (sms * waves), 1.0
    when every SM runs the same number of them (the busiest SM sets the time)."""
    return ctas / (sms * cdiv(ctas, sms))


def default_num_splits(batch: int, kv_heads: int, rows: int, kv_len: int,
                       sms: int = DEFAULT_SM_COUNT) -> int:
    """Key splits for ``batch * kv_heads`` kv heads of ``rows`` = G * N stacked query rows each and
    ``kv_len`` cached keys, on a GPU of ``sms`` multiprocessors.  A pure function of its
    arguments (tests/kernels/test_decode_triton.py checks its choices).

    ``P = batch * kv_heads * row_blocks`` programs per split (row blocks counted at the largest row
    tile, MAX_BLOCK_M).  The rule, from the first H200 run (GQA 32/8, B = 8, M = 8192: P = 64 on
    132 SMs; 2 splits -- one program per SM -- reached 50% of copy bandwidth, 5 splits 76%, 10 and
    20 splits 65-68%; MQA N = 1: 16 splits beat 32, 64 and 128, whose float32 partials grew to
    25-100% of the K/V bytes):

    - no split once ``P >= MIN_WAVES * sms`` (the GPU is full; no partials, no merge);
    - at most ``kv_len // MIN_SPLIT_KEYS`` splits, and at most as many as keep the partials
      (``8 * rows * Dv`` bytes written and read back per split and kv head) within
      ``PARTIAL_SHARE`` of the K/V bytes (``4 * kv_len * D`` for 16-bit K and V, D = Dv assumed):
      ``S <= PARTIAL_SHARE * kv_len / (2 * rows)``;
    - otherwise the fewest splits ``S_lo`` giving ``MIN_WAVES`` programs per SM on average (enough
      loads in flight), or up to twice that, whichever fills the SMs most evenly
      (:func:`wave_balance` of ``P * S``; ties to the fewest splits): P = 64 on 132 SMs takes 6
      (384 programs, 2.9 per SM on every SM) rather than 5 (320: 56 SMs run 3, 76 run 2).
    """
    row_blocks = cdiv(max(int(rows), 1), MAX_BLOCK_M)
    programs = max(1, int(batch) * int(kv_heads) * row_blocks)
    sms = max(1, int(sms))
    if programs >= MIN_WAVES * sms:
        return 1
    cap = min(int(kv_len) // MIN_SPLIT_KEYS, int(PARTIAL_SHARE * int(kv_len) / (2 * max(int(rows), 1))))
    cap = max(1, cap)
    lo = cdiv(MIN_WAVES * sms, programs)
    if lo >= cap:
        return cap
    return max(range(lo, min(2 * lo, cap) + 1),
               key=lambda s: (round(wave_balance(programs * s, sms), 6), -s))


def _check_device(fn: str, t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRETED):
        raise RuntimeError(
            f"{fn}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"attnkit.kernels.decode is imported, for CPU tensors); got a {t.device.type} tensor")


def _check_inputs(fn, q, k, v, paged=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [B, H, L, D]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}")
    N = q.shape[2]
    if N > MAX_QUERY_ROWS:
        raise ValueError(f"{fn}: at most {MAX_QUERY_ROWS} query rows (decoding); got N = {N} "
                         f"(use attnkit.kernels.softmax.softmax_fwd for prefill)")
    check_attention_shapes(fn, q, k, v, paged=paged)
    _check_device(fn, q)


def _check_index_tensor(fn, name, t, q, layout, shape_ok, want):
    """``t``: None, or an int32 / int64 tensor on q's device whose shape passes ``shape_ok``
    (``layout``, ``want``: the expected shape in words, for the messages)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be an int32 tensor {layout} (or None); got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must be int32 (or int64); got {t.dtype}")
    if not shape_ok(t.shape):
        raise ValueError(f"{fn}: {name} must {want}; got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{fn}: {name} must be on q's device ({q.device}); got {t.device}")
    return t


def _check_block_table(fn, block_table, q, k):
    """None, or int32 / int64 [B, max_blocks] on q's device (its entries are not read here)."""
    B = q.shape[0]
    block_table = _check_index_tensor(fn, "block_table", block_table, q, "[B, max_blocks]",
                                      lambda s: len(s) == 2 and s[0] == B, f"be [B, max_blocks] with B = {B}")
    if block_table is not None and k.shape[2] == 0:
        raise ValueError(f"{fn}: a paged cache needs block_size >= 1; got k {tuple(k.shape)}")
    return block_table


def _check_kv_lens(fn, kv_lens, q, B):
    return _check_index_tensor(fn, "kv_lens", kv_lens, q, "[B]", lambda s: tuple(s) == (B,),
                               f"have shape [B] = [{B}]")


def _check_num_splits(fn, num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"{fn}: num_splits must be a positive int or None; got "
                        f"{type(num_splits).__name__} {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"{fn}: num_splits must be >= 1; got {num_splits}")
    return int(num_splits)


def _check_config(fn, config, rows, block_d, block_dv, esize):
    """``config`` with BLOCK_M filled in (None stays None)."""
    if config is None:
        return None
    if not isinstance(config, triton.Config) or "BLOCK_N" not in config.kwargs:
        raise TypeError(f"{fn}: config must be a triton.Config with BLOCK_N (and optionally "
                        f"BLOCK_M); got {config!r}")
    kw = dict(config.kwargs)
    for name in ("BLOCK_N", "BLOCK_M"):
        if name == "BLOCK_M" and name not in kw:
            kw[name] = _row_tile(rows, config, block_d, block_dv, esize)
        x = kw[name]
        if isinstance(x, bool) or not isinstance(x, int) or x < 16 or x & (x - 1):
            raise ValueError(f"{fn}: config {name} must be a power of two >= 16; got {x!r}")
    return triton.Config(kw, num_warps=config.num_warps, num_stages=config.num_stages)


def _check_merge(fn, merge):
    if merge is None:
        return DEFAULT_MERGE
    if merge not in MERGE_MODES:
        raise ValueError(f"{fn}: merge must be one of {', '.join(map(repr, MERGE_MODES))} or None; "
                         f"got {merge!r}")
    return merge


# Fused-merge counters, one int32 per (row block, kv head, batch), all zero between launches
# (each launch's last programs set theirs back).  One buffer per (device, stream): launches on
# one stream run one after the other, so they never see each other's counts; two streams must
# not share one.  Grown (a fresh zeroed buffer) when a call needs more.
_COUNTERS: dict = {}
_COUNTERS_MIN = 1024  # the smallest buffer (tests set 0 to guard the exact size)


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, _COUNTERS_MIN), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def softmax_decode_fwd(q, k, v, scale=None, *, kv_lens=None, num_splits=None, config=None,
                       is_causal=True, merge=None, block_table=None, window_left=-1, window_right=-1,
                       softcap=0.0, alibi_slopes=None, sinks=None):
    """Split-KV decoding forward.  Returns ``(out [B, H, N, Dv] in q.dtype, lse [B, H, N]
    float32)``; see the module docstring for the semantics (bottom-right causal alignment,
    ``kv_lens``, dead rows, NaN).

    ``scale``: None = 1 / sqrt(D).  ``kv_lens``: None or an int32 [B] tensor of valid key
    counts per batch element (clamped to [0, M]).  ``num_splits``: None (the
    :func:`default_num_splits` heuristic) or an int >= 1 (more splits than key tiles is allowed:
    the extra ones are empty).  ``config``: a ``triton.Config`` with BLOCK_N (and optionally
    BLOCK_M, num_warps, num_stages) to skip autotuning; see ``DECODE_CONFIGS``.
    ``is_causal``: True (default) aligns the N queries bottom-right (query i sees keys
    ``j <= L_b - N + i``); False lets every query see all L_b keys.  ``merge``: how several
    splits are combined -- ``"separate"`` (a second kernel), ``"fused"`` (the last split program
    of each row block merges, see the module docstring) or None (``DEFAULT_MERGE``); one split
    needs no merge either way.  ``block_table``: None, or int32 / int64 ``[B, max_blocks]`` for a
    paged cache -- k / v ``[num_blocks, Hk, block_size, D / Dv]``, key j of batch element b
    being row ``j % block_size`` of block ``block_table[b, j // block_size]``, read in place
    (M = max_blocks * block_size; the entries that cover ``[0, L_b)`` must be blocks of the
    cache: not checked on the device).  Score options (FlashAttention's, as
    ``kernels.softmax.softmax_fwd`` takes them, positions bottom-right: query i of batch b is at
    position ``p = L_b - N + i``): ``window_left`` / ``window_right`` (-1 = unbounded) -- query i
    sees key j iff ``p - left <= j <= p + right``, on top of ``is_causal`` (the key tiles before
    the band are never read: the cost follows the window); ``softcap`` (> 0: ``s = softcap *
    tanh(s / softcap)``); ``alibi_slopes`` (float32 ``[H]`` or ``[B, H]``: ``s -= slope * |p - j|``);
    ``sinks`` (float32 ``[H]``: one more logit of each row's softmax with no value, folded in at
    the rows' finish or at the merge -- one rounding of a 16-bit row; a row with no key: out 0,
    lse = the sink).  No autograd: the results carry no graph.
    """
    fn = "softmax_decode_fwd"
    paged = block_table is not None
    _check_inputs(fn, q, k, v, paged=paged)
    block_table = _check_block_table(fn, block_table, q, k)
    B, H, N, D = q.shape
    Hk, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    block_size = M
    if paged:
        M = block_table.shape[1] * block_size
    kv_lens = _check_kv_lens(fn, kv_lens, q, B)
    num_splits = _check_num_splits(fn, num_splits)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{fn}: scale must be a real number or None; got {scale!r}")
    scale = float(scale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"{fn}: is_causal must be a bool; got {type(is_causal).__name__}")
    merge = _check_merge(fn, merge)
    opts = score_option_args(fn, q, B, H, scale, window_left, window_right, softcap, alibi_slopes)
    sinks_t, has_sinks = sink_args(fn, q, H, sinks)
    # An unbounded side (-1), or one wider than every sequence, as M + N: it hides nothing.
    win_left = M + N if opts.left < 0 else min(opts.left, M + N)
    win_right = M + N if opts.right < 0 else min(opts.right, M + N)
    group = H // Hk
    rows = group * N
    block_d, block_dv = pow2(D), pow2(Dv)
    config = _check_config(fn, config, rows, block_d, block_dv, q.element_size())

    out = torch.empty((B, H, N, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    if B * H * N == 0:
        return out, lse
    if M == 0:  # no key at all: every row is dead (with sinks: the sink alone)
        out.zero_()
        lse.fill_(float("-inf"))
        if has_sinks:
            from .. import score_options

            return score_options.add_sinks(out, lse, sinks_t)
        return out, lse

    # With a window the keys read are at most its left side and the N query positions.
    band = min(M, win_left + N) if opts.consts["HAS_WINDOW"] else M
    splits = num_splits if num_splits is not None else default_num_splits(
        B, Hk, rows, band, sm_count(q.device))
    direct = splits == 1
    fused = merge == "fused" and not direct
    if direct:
        part_o = part_l = lse  # stand-in pointers: DIRECT never touches them
    else:
        part_o = torch.empty((B, H, N, splits, Dv), dtype=torch.float32, device=q.device)
        part_l = torch.empty((B, H, N, splits), dtype=torch.float32, device=q.device)
    # Enough counters for the smallest row tile (16): the autotuner may pick any.
    counters = _merge_counters(q.device, B * Hk * cdiv(rows, 16)) if fused else lse
    lens_t, lens_stride = (q, 0) if kv_lens is None else (kv_lens, kv_lens.stride(0))

    table_t, table_stride = (block_table, block_table.stride(0)) if paged else (lens_t, 0)
    args = (q, k, v, lens_t, out, lse, part_o, part_l, counters, table_t, opts.alibi, sinks_t,
            scale * 1.4426950408889634, win_left, win_right, opts.cap_in, opts.cap_out,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), lens_stride, table_stride,
            *opts.alibi_strides, block_size, H, N, M, group, splits)
    consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                  HAS_LENS=kv_lens is not None, DIRECT=direct, IS_CAUSAL=is_causal,
                  FUSED_MERGE=fused, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                  PAGED=paged, **opts.consts, HAS_SINKS=has_sinks)
    launch(_decode_split_kernel, lambda: _autotuned(D, Dv, rows, q.dtype),
           lambda: configs_for(D, Dv, rows, q.dtype),
           lambda bm, bn: (cdiv(rows, bm) * splits, Hk, B), args, consts, config)
    if not direct and not fused:
        block_s, block_r = _merge_tiles(splits, block_dv, B * H * N)
        wrap_triton(_decode_merge_kernel)[(cdiv(B * H * N, block_r),)](
            part_o, part_l, sinks_t, out, lse, *out.stride(), H, N, B * H * N, splits,
            HEAD_DV=Dv, BLOCK_DV=block_dv, BLOCK_S=block_s, BLOCK_R=block_r, HAS_SINKS=has_sinks)
    return out, lse

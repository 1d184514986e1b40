"""Softmax attention for the fast case, with one constexpr switch per Hopper idea (issue 26).

The default Triton kernels (kernels/softmax.py) serve every option -- masks, dropout, windows,
softcap, ALiBi -- and reached 0.73x torch SDPA forward and 0.64x forward+backward on an H200
(bf16, B=4 H=8 N=8192 D=128).  This file holds the kernels of the case that matters most for
speed -- no mask, no dropout, no score option; causal (top-left: key j visible to query i iff
j <= i, as kernels/softmax.py and SDPA) or not; GQA -- written so that each idea can be switched
on alone and timed against the others in one GPU run (bench/softmax_variants_gpu.py).  The
outputs are those of kernels/softmax.py: ``out`` in q's dtype, ``lse`` float32 in natural log,
``(dq, dk, dv)`` shaped and typed like ``q, k, v``; so a variant that wins can later replace the
default path for this case.

Launchers
---------
``hopper_fwd(q, k, v, scale=None, is_causal=False, *, variant=FwdVariant(), config=None,
num_programs=None)`` -> ``(out [B, H, N, Dv], lse [B, H, N] float32)``
``hopper_bwd(grad_out, q, k, v, out, lse, scale=None, is_causal=False, *,
variant=BwdVariant(), config=None)`` -> ``(dq, dk, dv)``

Shapes as kernels/softmax.py: q ``[B, H, N, D]``, k ``[B, Hk, M, D]``, v ``[B, Hk, M, Dv]``,
``H % Hk == 0`` (query head h reads key/value head ``h // (H // Hk)``); head dims up to 256;
float16, bfloat16, float32 (float32 accumulation).  Every row sees at least one key (row i sees
key 0), so no row is fully masked; a NaN in a row's scores makes that row's out and lse NaN.

Switches (:class:`FwdVariant`, :class:`BwdVariant`; each is a constexpr of the kernels)
---------------------------------------------------------------------------------------
``exp`` (forward): ``"exp"`` -- natural exp of ``scale * q.k`` (an extra multiply by log2(e)
    inside every exp); ``"exp2"`` -- scores ``q.k * scale * log2(e)`` (one multiply per score),
    then ``exp2(s - m)`` (today's kernels); ``"exp2_fma"`` -- the row max is taken on the raw
    ``q.k`` and scaled once per row, so each probability is ``exp2(fma(q.k, c, -m))``: the scale
    costs no separate multiply (needs scale > 0; the launcher uses "exp2" otherwise);
    ``"exp2_poly"`` / ``"exp2_fma_only"`` -- as "exp2_fma" with half / all of the exponentials
    computed by a cubic on the FMA pipes instead of the MUFU unit (FlashAttention-4; float16 /
    bfloat16 only, where P is rounded to 16 bits anyway: float32 takes "exp2_fma").  The
    backward always computes ``p = exp2(fma(q.k, c, -lse * log2(e)))``.
``lazy`` (forward): FlashAttention-4's lazy rescale -- the running row max (and the rescale of
    the accumulator) is updated only when a row's max grew by more than 8 (log2 units).
``causal_split``: key tiles that every row of the query tile sees whole run a loop without any
    mask arithmetic; only the tiles on the diagonal (and the partial tile at the end of the keys
    or queries) are masked.  False: one loop that masks every tile.
``tma``: tiles move through on-device tensor descriptors (``tl.make_tensor_descriptor``: the
    Hopper bulk tensor copy engine, one descriptor per (batch, head) with the exact bounds, so
    the copy engine zero-fills rows past the end) instead of pointer loads.  Needs
    ``triton.set_allocator`` (the launchers install a torch allocator when none is set),
    unit-stride head dims, 16-byte aligned bases and row strides.
``warp_specialize``: the key (forward) / query (backward) loop is a
    ``tl.range(..., warp_specialize=True)`` (producer warps feed consumer warpgroups).  Only where
    the installed Triton's ``tl.range`` takes the argument (:data:`HAS_WARP_SPECIALIZE`); the
    other variants compile without it.  Triton's Hopper pass (seen in an sm_90 compile with
    Triton 3.9 on a CPU) acts at num_warps = 4 only, takes one loop per kernel, and failed on
    pointer loads and on the atomic backward's loop: so the variants pair it with ``tma``, keep a
    single loop (masked throughout unless nothing needs a mask) and have 4-warp config lists.
``persistent`` (forward): ``k`` > 0 launches ``k`` programs per SM that walk the (query tile,
    head, batch) tiles in a strided loop (heaviest causal tiles first within a head) instead of
    one program per tile.
``dq`` (backward): ``"split"`` -- today's scheme: a dK/dV kernel per key tile (4 GEMMs per tile
    pair) and a dQ kernel per query tile that recomputes q.k and dP (3 more); ``"atomic"`` --
    FlashAttention-2 style: ONE kernel per key tile computes dK, dV and each query tile's share
    of dQ (5 GEMMs per tile pair) and adds it with float32 atomics into a zeroed [B, H, N_pad,
    BLOCK_D] buffer, converted (scaled, cast) by a small kernel after; ``"tma_reduce"`` -- as
    "atomic" but each dQ share is added by the copy engine's reduce-add of a whole tile
    (``descriptor.atomic_add``; GPU only: the interpreter lacks it).

Tuning: small explicit config lists per kind of kernel (:func:`fwd_configs`,
:func:`bwd_configs`); ``config=`` picks one (a ``triton.Config`` with BLOCK_M = query tile,
BLOCK_N = key tile; for ``dq="split"`` a pair ``(kv_config, dq_config)``); None takes the first.
No autotuning: the bench times each config as its own row.

Numerics as kernels/softmax.py: float32 accumulation, probabilities rounded to the value dtype
before ``P @ V`` and ``dS`` to the input dtype before its products; float32 inputs use
full-precision (``"ieee"``) dots.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch
import triton
import triton.language as tl

from ._flash import (INTERPRETED, SUPPORTED_DTYPES, cdiv, check_attention_shapes,
                     check_backward_inputs, dot_precision, load_rows, pow2, store_rows)

__all__ = [
    "hopper_fwd",
    "hopper_bwd",
    "FwdVariant",
    "BwdVariant",
    "FWD_VARIANTS",
    "BWD_VARIANTS",
    "fwd_configs",
    "bwd_configs",
    "variant_support",
    "HAS_WARP_SPECIALIZE",
    "HAS_TENSOR_DESCRIPTORS",
    "HAS_DESCRIPTOR_REDUCE",
    "FAST_FWD",
    "FAST_BWD",
    "fast_fwd",
    "fast_bwd",
]

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


def _range_takes(name: str) -> bool:
    try:
        return name in inspect.signature(tl.range.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - a tl.range without a signature
        return False


# What the installed Triton offers; the variants that need a missing piece are refused by the
# launchers (ValueError) and skipped by the bench, the others compile without it.
HAS_WARP_SPECIALIZE = _range_takes("warp_specialize")
HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")
HAS_DESCRIPTOR_REDUCE = HAS_TENSOR_DESCRIPTORS and hasattr(
    getattr(tl, "tensor_descriptor", object), "atomic_add")


# ----------------------------------------------------------------------------------------------
# variants and configs
# ----------------------------------------------------------------------------------------------

_EXP_MODES = {"exp": 0, "exp2": 1, "exp2_fma": 2, "exp2_poly": 3, "exp2_fma_only": 4}
_DQ_MODES = {"split": 0, "atomic": 1, "tma_reduce": 2}


@dataclasses.dataclass(frozen=True)
class FwdVariant:
    """The forward's switches (module docstring)."""
    exp: str = "exp2_fma"
    causal_split: bool = True
    tma: bool = False
    warp_specialize: bool = False
    persistent: int = 0
    lazy: bool = False

    def __post_init__(self):
        if self.exp not in _EXP_MODES:
            raise ValueError(f"FwdVariant.exp must be one of {sorted(_EXP_MODES)}; got "
                             f"{self.exp!r}")
        if self.lazy and self.exp == "exp":
            raise ValueError("FwdVariant.lazy works in log2 units: it needs an exp2 mode, not "
                             "exp='exp'")
        if int(self.persistent) < 0:
            raise ValueError(f"FwdVariant.persistent must be >= 0; got {self.persistent}")


@dataclasses.dataclass(frozen=True)
class BwdVariant:
    """The backward's switches (module docstring)."""
    dq: str = "atomic"
    causal_split: bool = True
    tma: bool = False
    warp_specialize: bool = False

    def __post_init__(self):
        if self.dq not in _DQ_MODES:
            raise ValueError(f"BwdVariant.dq must be one of {sorted(_DQ_MODES)}; got {self.dq!r}")


# The variants the bench times, each differing from a neighbour in one switch (names are the
# bench's row labels).  "base" is today's forward arithmetic on this file's loop structure.
# Warp specialization only where Triton's Hopper pass took the loop in an sm_90 compile on a CPU
# (Triton 3.9): with tensor-descriptor loads and no atomics -- pointer loads and the atomic
# backward's loop failed the pass ("PassManager::run failed"), so those combinations are left out.
FWD_VARIANTS = {
    "base": FwdVariant(exp="exp2"),
    "exp": FwdVariant(exp="exp"),
    "fma": FwdVariant(),
    "nosplit": FwdVariant(causal_split=False),
    "tma": FwdVariant(tma=True),
    "tma_ws": FwdVariant(tma=True, warp_specialize=True),
    "persist": FwdVariant(persistent=1),
    "persist2": FwdVariant(persistent=2),
    "tma_persist": FwdVariant(tma=True, persistent=1),
    # prepared in session 15 (after the H200 run), not yet measured: FlashAttention-4's tricks
    "lazy": FwdVariant(exp="exp2", lazy=True),
    "poly": FwdVariant(exp="exp2_poly"),
    "poly_all": FwdVariant(exp="exp2_fma_only"),
    "poly_lazy": FwdVariant(exp="exp2_poly", lazy=True),
}
BWD_VARIANTS = {
    "split": BwdVariant(dq="split"),
    "split_tma": BwdVariant(dq="split", tma=True),
    "split_tma_ws": BwdVariant(dq="split", tma=True, warp_specialize=True),
    "atomic": BwdVariant(),
    "atomic_nosplit": BwdVariant(causal_split=False),
    "atomic_tma": BwdVariant(tma=True),
    "tma_reduce": BwdVariant(dq="tma_reduce", tma=True),
}


def variant_support(variant) -> str:
    """'' when the installed Triton can compile ``variant``, else why not."""
    if getattr(variant, "tma", False) and not HAS_TENSOR_DESCRIPTORS:
        return "this Triton has no tl.make_tensor_descriptor / triton.set_allocator"
    if variant.warp_specialize and not HAS_WARP_SPECIALIZE:
        return "this Triton's tl.range takes no warp_specialize"
    if isinstance(variant, BwdVariant) and variant.dq == "tma_reduce":
        if not HAS_DESCRIPTOR_REDUCE:
            return "this Triton's tensor descriptors have no atomic_add"
        if INTERPRETED:
            return "the Triton interpreter cannot run descriptor reduce-adds"
    return ""


def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dim, chosen from an ahead-of-time
# sm_90 compile on a CPU (Triton 3.9's ptxas; registers, spills and shared memory from the cubin,
# 2026-11-27; the GPU's Triton 3.6 may differ a little):
# - forward, D = 128: 128 x 64 with 4 warps needs 255 registers and spills 320 bytes a thread
#   (kernels/softmax.py's first FWD_CONFIGS entry does the same); 8 warps: 181 registers, no
#   spill.  128 x 128 / 8 warps: 255 registers, no spill; with 3 stages it needs 224 KB of the
#   227 KB of shared memory, so 2.
# - dK/dV (+ dQ share), D = 128: the two [BLOCK_N, D] float32 accumulators are 128 registers a
#   thread at BLOCK_N = 128 / 8 warps; 64 x 128 spills 56 (split) to 144 (atomic) bytes, 32 x
#   128 none (228 / 244 registers; the atomic kernel's 32-row dQ product then runs on mma.sync,
#   not wgmma); 16 warps cap a thread at 128 registers and spill 200-800 bytes.
# - warp specialization: Triton's Hopper pass only acts at num_warps = 4 (at 8 it leaves the loop
#   alone), hence its own lists; the kernels then hold 168 registers a thread and the pass moves
#   registers to the consumer warps (setmaxnreg).
_FWD_TILES = {  # the third entries: 3 stages at 224 KB (D = 128), 8 warps on a 128 x 64 tile
    64: [(128, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)],
    256: [(64, 64, 4, 2), (128, 32, 8, 2)],
}
_FWD_WS_TILES = {
    64: [(128, 128, 4, 3), (128, 64, 4, 3)],
    128: [(128, 128, 4, 2), (128, 64, 4, 3)],
    256: [(64, 64, 4, 2)],
}
_KV_TILES = {  # BLOCK_M = query tile of the inner loop, BLOCK_N = the program's key tile
    64: [(64, 128, 8, 2), (64, 64, 4, 3)],
    128: [(32, 128, 8, 2), (64, 128, 8, 2)],
    256: [(32, 64, 4, 2), (16, 64, 4, 2)],
}
_KV_WS_TILES = {
    64: [(64, 64, 4, 3), (64, 128, 4, 2)],
    128: [(64, 64, 4, 2), (64, 128, 4, 2)],
    256: [(32, 64, 4, 2)],
}
_DQ_TILES = {  # the split scheme's dQ kernel: BLOCK_M = the program's query tile
    64: [(128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 2), (64, 64, 4, 2)],
    256: [(64, 32, 4, 2), (32, 32, 4, 2)],
}
_DQ_WS_TILES = {  # a 128-row dQ tile failed the warp-specialization pass (64 passed)
    64: [(64, 64, 4, 3), (64, 128, 4, 2)],
    128: [(64, 64, 4, 2), (64, 128, 4, 2)],
    256: [(32, 32, 4, 2)],
}


def _dim_key(head_dim: int, value_dim: int | None) -> int:
    d = pow2(max(head_dim, head_dim if value_dim is None else value_dim))
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def fwd_configs(head_dim: int, value_dim: int | None = None,
                variant: FwdVariant | None = None) -> list:
    """The forward's configs for these head dims (and ``variant``: warp specialization has its
    own list)."""
    tiles = _FWD_WS_TILES if variant is not None and variant.warp_specialize else _FWD_TILES
    return [_cfg(*t) for t in tiles[_dim_key(head_dim, value_dim)]]


def bwd_configs(variant: BwdVariant, head_dim: int, value_dim: int | None = None) -> list:
    """The backward's configs: ``triton.Config`` s for dq="atomic" / "tma_reduce", pairs
    ``(kv_config, dq_config)`` for dq="split"."""
    key = _dim_key(head_dim, value_dim)
    ws = variant.warp_specialize
    kv = [_cfg(*t) for t in (_KV_WS_TILES if ws else _KV_TILES)[key]]
    if variant.dq != "split":
        return kv
    dq = [_cfg(*t) for t in (_DQ_WS_TILES if ws else _DQ_TILES)[key]]
    return list(zip(kv, dq[:len(kv)] + dq[-1:] * (len(kv) - len(dq))))


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rows_src(base, n_rows, stride_n, HEAD: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr, TMA: tl.constexpr):
    """A row-major [n_rows, HEAD] matrix at ``base`` in the form the tile loads take: a tensor
    descriptor with [BLOCK_R, BLOCK_C] blocks whose bounds are the matrix's own, so that the copy
    engine zero-fills rows past n_rows and columns past HEAD (TMA), or the base pointer."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD], strides=[stride_n, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
    else:
        return base


@triton.jit
def _load_tile(src, r0, n_rows, stride_n, stride_c, HEAD: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R of a _rows_src matrix -> [BLOCK_R, BLOCK_C], zeros outside it
    (pointer loads test the rows only when CHECK_ROWS: full tiles load unmasked)."""
    if TMA:
        return src.load([r0, 0])
    else:
        rows = r0 + tl.arange(0, BLOCK_R)
        return load_rows(src, rows, stride_n, tl.arange(0, BLOCK_C), stride_c, rows < n_rows,
                         HEAD, BLOCK_C, CHECK_ROWS)


@triton.jit
def _store_tile(dst, base, r0, n_rows, stride_n, stride_c, x, HEAD: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TMA: tl.constexpr):
    """Store x [BLOCK_R, BLOCK_C] (already in the target dtype) into rows r0 .. of the matrix
    at ``base`` (``dst`` its descriptor when TMA: the copy engine clips rows and columns past
    the bounds)."""
    if TMA:
        dst.store([r0, 0], x)
    else:
        rows = r0 + tl.arange(0, BLOCK_R)
        store_rows(base, rows, stride_n, tl.arange(0, BLOCK_C), stride_c, rows < n_rows, x, HEAD)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


# The lazy rescale's slack (log2 units): FlashAttention-4's threshold, probabilities <= 256.
LAZY_SLACK = tl.constexpr(8.0)
# 2**f on [0, 1) as 1 + f (c1 + f (c2 + f c3)): least-squares minimax fit (max relative error
# 8.6e-5, under float16's half ulp 4.9e-4 and bfloat16's 2e-3, the dtypes P is rounded to).
_EXP2_C1 = tl.constexpr(0.6951160932179434)
_EXP2_C2 = tl.constexpr(0.22764613398803532)
_EXP2_C3 = tl.constexpr(0.07706667776702976)


@triton.jit
def _exp2_on_fma(x):
    """2**x for x <= 0 with FMAs and integer ops only (no MUFU ex2): 2**floor(x) goes into the
    exponent bits of the polynomial's value.  Exactly 0 below 2**-126 (masked scores are -inf);
    NaN stays NaN."""
    xc = tl.maximum(x, -126.0)
    xi = tl.floor(xc)
    f = xc - xi
    poly = tl.fma(tl.fma(tl.fma(f, _EXP2_C3, _EXP2_C2), f, _EXP2_C1), f, 1.0)
    bits = poly.to(tl.int32, bitcast=True) + (xi.to(tl.int32) << 23)
    r = bits.to(tl.float32, bitcast=True)
    r = tl.where(x < -126.0, 0.0, r)
    return tl.where(x != x, x, r)


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, M, sm_scale, qk_scale,
              stride_kn, stride_kd, stride_vn, stride_vd,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
              EXP_MODE: tl.constexpr, LAZY: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
              DOT_PREC: tl.constexpr):
    start_n = tl.multiple_of(start_n, BLOCK_N)
    k = _load_tile(k_src, start_n, M, stride_kn, stride_kd, HEAD_D, BLOCK_N, BLOCK_D, MASKED, TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if EXP_MODE == 0:
        s = s * sm_scale
    elif EXP_MODE == 1:
        s = s * qk_scale
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n[None, :] < M
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
    # No -inf guard on the row max: every row sees a key in the first tile it visits (key 0 or
    # a tile left of its diagonal), so m_new is finite from the first step on, and masked
    # entries give exp2(-inf) = 0.
    if EXP_MODE >= 2:
        # the max of the raw scores times a positive scale is the max of the scaled ones, so
        # the scale rides on the fma that forms the exponent: one float op per score
        m_cand = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_cand = tl.maximum(m_i, tl.max(s, 1))
    if LAZY:
        # FlashAttention-4's lazy rescale: keep a stale row max until some row's max grew by
        # more than LAZY_SLACK (log2 units), so most tiles skip the [BLOCK_M, Dv] rescale of
        # acc; the probabilities are then at most 2**LAZY_SLACK, harmless in float32 and in
        # P's 16-bit dtype.  One block-wide decision (a scalar branch), not one per row.
        if tl.max(m_cand - m_i, 0) > LAZY_SLACK:
            alpha = tl.math.exp2(m_i - m_cand)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_cand
        m_new = m_i
    else:
        m_new = m_cand
        if EXP_MODE == 0:
            alpha = tl.exp(m_i - m_new)
        else:
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    if EXP_MODE == 0:
        p = tl.exp(s - m_new[:, None])
    elif EXP_MODE == 1:
        p = tl.math.exp2(s - m_new[:, None])
    elif EXP_MODE == 2:
        p = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    elif EXP_MODE == 3:
        # half the exponentials on the FMA pipes (FlashAttention-4: the MUFU unit's exp2 is
        # as slow as the tensor cores' share of a tile at D = 128), columns paired by split
        x = tl.reshape(tl.fma(s, qk_scale, -m_new[:, None]), [s.shape[0], BLOCK_N // 2, 2])
        x_mufu, x_fma = tl.split(x)
        p = tl.reshape(tl.join(tl.math.exp2(x_mufu), _exp2_on_fma(x_fma)),
                       [s.shape[0], BLOCK_N])
    else:  # 4: every exponential on the FMA pipes
        p = _exp2_on_fma(tl.fma(s, qk_scale, -m_new[:, None]))
    l_i = l_i + tl.sum(p, 1)
    v = _load_tile(v_src, start_n, M, stride_vn, stride_vd, HEAD_DV, BLOCK_N, BLOCK_DV, MASKED,
                   TMA)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, k_src, v_src, lo, hi, offs_m, M, sm_scale, qk_scale,
              stride_kn, stride_kd, stride_vn, stride_vd,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
              EXP_MODE: tl.constexpr, LAZY: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
              WARP_SPEC: tl.constexpr, DOT_PREC: tl.constexpr):
    # The warp_specialize argument is only spelled out in the taken branch of a constexpr test,
    # so a Triton whose tl.range lacks it still compiles every variant with WARP_SPEC False.
    if WARP_SPEC:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, M,
                                      sm_scale, qk_scale, stride_kn, stride_kd, stride_vn,
                                      stride_vd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                      IS_CAUSAL, EXP_MODE, LAZY, MASKED, TMA, DOT_PREC)
    else:
        for start_n in tl.range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_src, v_src, start_n, offs_m, M,
                                      sm_scale, qk_scale, stride_kn, stride_kd, stride_vn,
                                      stride_vd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                      IS_CAUSAL, EXP_MODE, LAZY, MASKED, TMA, DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _fwd_tile(Q, K, V, Out, Lse, sm_scale, qk_scale, pid_m, h, b,
              stride_qb, stride_qh, stride_qn, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_on, stride_od,
              H, N, M, GROUP,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, EXP_MODE: tl.constexpr,
              LAZY: tl.constexpr,
              CAUSAL_SPLIT: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
              EVEN_M: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """One query tile of one (batch, head): the whole forward of its rows."""
    hk = h // GROUP
    i0 = pid_m * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    o_base = Out + b * stride_ob + h * stride_oh
    q_src = _rows_src(q_base, N, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, TMA)
    k_src = _rows_src(k_base, M, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_src(v_base, M, stride_vn, HEAD_DV, BLOCK_N, BLOCK_DV, TMA)
    q = _load_tile(q_src, i0, N, stride_qn, stride_qd, HEAD_D, BLOCK_M, BLOCK_D, True, TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if IS_CAUSAL:
        hi = tl.minimum(M, i0 + BLOCK_M)  # no row of the tile sees a key past its last row
        full_hi = (tl.minimum(M, i0 + 1) // BLOCK_N) * BLOCK_N  # tiles every row sees whole
    else:
        hi = M
        full_hi = (M // BLOCK_N) * BLOCK_N
    # Triton's Hopper warp specialization takes one loop per kernel (3.9, sm_90 compiled on a
    # CPU: a second loop after the specialized one aborted the pass), so WARP_SPEC keeps a
    # single loop: unmasked when nothing needs a mask (not causal, M a multiple of BLOCK_N),
    # else masked throughout.  EVEN_M drops the (empty) tail loop of the non-causal split.
    if WARP_SPEC or not CAUSAL_SPLIT:
        if (not IS_CAUSAL) and EVEN_M:
            acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_src, v_src, 0, M, offs_m, M,
                                      sm_scale, qk_scale, stride_kn, stride_kd, stride_vn,
                                      stride_vd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                      IS_CAUSAL, EXP_MODE, LAZY, False, TMA, WARP_SPEC, DOT_PREC)
        else:
            acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_src, v_src, 0, hi, offs_m, M,
                                      sm_scale, qk_scale, stride_kn, stride_kd, stride_vn,
                                      stride_vd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                      IS_CAUSAL, EXP_MODE, LAZY, True, TMA, WARP_SPEC, DOT_PREC)
    else:
        acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_src, v_src, 0, full_hi, offs_m, M,
                                  sm_scale, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL,
                                  EXP_MODE, LAZY, False, TMA, False, DOT_PREC)
        if IS_CAUSAL or not EVEN_M:
            acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, k_src, v_src, full_hi, hi, offs_m, M,
                                      sm_scale, qk_scale, stride_kn, stride_kd, stride_vn,
                                      stride_vd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N,
                                      IS_CAUSAL, EXP_MODE, LAZY, True, TMA, False, DOT_PREC)

    # l_i >= 1 on every row (its max contributes exp2(0)); NaN when a score was NaN, and then
    # out and lse are NaN as SDPA's.
    out = acc / l_i[:, None]
    if EXP_MODE == 0:
        lse = m_i + tl.log(l_i)
    else:
        lse = (m_i + tl.math.log2(l_i)) * _LN2
    o_src = _rows_src(o_base, N, stride_on, HEAD_DV, BLOCK_M, BLOCK_DV, TMA)
    _store_tile(o_src, o_base, i0, N, stride_on, stride_od, out.to(Out.dtype.element_ty), HEAD_DV,
                BLOCK_M, BLOCK_DV, TMA)
    tl.store(Lse + (b * H + h) * N + offs_m, lse, mask=offs_m < N)


@triton.jit
def _hopper_fwd_kernel(
    Q, K, V, Out, Lse, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    B, H, N, M, GROUP,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, EXP_MODE: tl.constexpr, LAZY: tl.constexpr, CAUSAL_SPLIT: tl.constexpr,
    TMA: tl.constexpr, WARP_SPEC: tl.constexpr, PERSISTENT: tl.constexpr, EVEN_M: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if PERSISTENT:
        # Tiles numbered head-major, so that the programs running at one time share a head's K
        # and V in L2; causal: a head's heaviest query tiles (most keys) first.
        n_m = tl.cdiv(N, BLOCK_M)
        for t in tl.range(tl.program_id(0), n_m * H * B, tl.num_programs(0)):
            bh = t // n_m
            r = t % n_m
            if IS_CAUSAL:
                pid_m = n_m - 1 - r
            else:
                pid_m = r
            h = (bh % H).to(tl.int64)
            b = (bh // H).to(tl.int64)
            _fwd_tile(Q, K, V, Out, Lse, sm_scale, qk_scale, pid_m, h, b,
                      stride_qb, stride_qh, stride_qn, stride_qd,
                      stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd,
                      stride_ob, stride_oh, stride_on, stride_od, H, N, M, GROUP,
                      HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, EXP_MODE, LAZY, CAUSAL_SPLIT,
                      TMA, WARP_SPEC, EVEN_M, DOT_PREC, BLOCK_M, BLOCK_N)
    else:
        if IS_CAUSAL:
            # later query tiles see more keys: launch them first so the tail of the grid is short
            pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        else:
            pid_m = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        _fwd_tile(Q, K, V, Out, Lse, sm_scale, qk_scale, pid_m, h, b,
                  stride_qb, stride_qh, stride_qn, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_ob, stride_oh, stride_on, stride_od, H, N, M, GROUP,
                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, EXP_MODE, LAZY, CAUSAL_SPLIT,
                  TMA, WARP_SPEC, EVEN_M, DOT_PREC, BLOCK_M, BLOCK_N)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _bwd_pre_kernel(Out, dO, Delta, DQacc,
                    stride_ob, stride_oh, stride_on, stride_od,
                    stride_gb, stride_gh, stride_gn, stride_gd,
                    H, N, N_pad,
                    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                    ZERO_DQ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Delta[b, h, i] = sum_d dO * O (float32) and, for the atomic schemes, zeros in the dQ
    accumulator's rows of this tile (one pass instead of a separate memset launch)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < N
    o = load_rows(Out + b * stride_ob + h * stride_oh, offs_m, stride_on, offs_dv, stride_od,
                  row_ok, HEAD_DV, BLOCK_DV, True)
    do = load_rows(dO + b * stride_gb + h * stride_gh, offs_m, stride_gn, offs_dv, stride_gd,
                   row_ok, HEAD_DV, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (b * H + h) * N + offs_m, delta, mask=row_ok)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = DQacc + ((b * H + h) * N_pad + offs_m[:, None]) * BLOCK_D + offs_d[None, :]
        tl.store(ptrs, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
                 mask=(offs_m < N_pad)[:, None])


@triton.jit
def _bwd_kv_step(dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_dst, start_m, offs_n,
                 N, M, qk_scale, stride_qn, stride_qd, stride_gn, stride_gd,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, TMA: tl.constexpr, DQ_MODE: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """One query tile against the program's key tile, on transposed ([keys, queries]) tiles so
    that dK and dV come out of plain dots.  MASKED: the tile crosses the diagonal, the end of
    the queries or (a partial key tile) the end of the keys."""
    start_m = tl.multiple_of(start_m, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_tile(q_src, start_m, N, stride_qn, stride_qd, HEAD_D, BLOCK_M, BLOCK_D, MASKED, TMA)
    do = _load_tile(do_src, start_m, N, stride_gn, stride_gd, HEAD_DV, BLOCK_M, BLOCK_DV, MASKED,
                    TMA)
    if MASKED:
        # rows past N: lse = +inf makes p = 0 (and q = dO = 0, delta = 0)
        lse = tl.load(lse_base + offs_m, mask=offs_m < N, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=offs_m < N, other=0.0)
    else:
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    p_t = tl.math.exp2(tl.fma(s_t, qk_scale, -(lse * _LOG2E)[None, :]))
    if MASKED:
        # keys past M must not reach dQ (their k rows are 0, but p there is exp2(-lse), which
        # may be inf), nor keys right of the diagonal; hidden entries are exactly 0, so that a
        # NaN row's delta stays in the keys that row sees
        valid = offs_n[:, None] < M
        if IS_CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        p_t = tl.where(valid, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    ds_t = p_t * (dp_t - delta[None, :])
    if MASKED:
        ds_t = tl.where(valid, ds_t, 0.0)
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PREC)
    if DQ_MODE != 0:
        # this query tile's share of dQ (unscaled): dS @ K, the fifth product
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PREC)
        if DQ_MODE == 1:
            # relaxed: no ordering is needed among the adds, and acq_rel would fence each one;
            # the accumulator is padded to whole tiles, so no bounds mask either
            ptrs = dq_dst + offs_m[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
            tl.atomic_add(ptrs, dq, sem="relaxed")
        else:
            dq_dst.atomic_add([start_m, 0], dq)
    return dk, dv


@triton.jit
def _bwd_kv_loop(dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_dst, lo, hi, offs_n,
                 N, M, qk_scale, stride_qn, stride_qd, stride_gn, stride_gd,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
                 DQ_MODE: tl.constexpr, DOT_PREC: tl.constexpr):
    if WARP_SPEC:
        for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=True):
            dk, dv = _bwd_kv_step(dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_dst,
                                  start_m, offs_n, N, M, qk_scale, stride_qn, stride_qd,
                                  stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV,
                                  BLOCK_M, IS_CAUSAL, MASKED, TMA, DQ_MODE, DOT_PREC)
    else:
        for start_m in tl.range(lo, hi, BLOCK_M):
            dk, dv = _bwd_kv_step(dk, dv, k, v, q_src, do_src, lse_base, delta_base, dq_dst,
                                  start_m, offs_n, N, M, qk_scale, stride_qn, stride_qd,
                                  stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV,
                                  BLOCK_M, IS_CAUSAL, MASKED, TMA, DQ_MODE, DOT_PREC)
    return dk, dv


@triton.jit
def _hopper_bwd_kv_kernel(
    Q, K, V, dO, Lse, Delta, dK, dV, DQacc, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N, M, GROUP, N_pad,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, DQ_MODE: tl.constexpr, EVEN_N: tl.constexpr, EVEN_M: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key tile of one (batch, kv head): dK and dV summed over the group's query heads, and
    with DQ_MODE 1 / 2 every query tile's share of dQ added into DQacc."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    j0 = pid_n * BLOCK_N
    offs_n = j0 + tl.arange(0, BLOCK_N)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    k_src = _rows_src(k_base, M, stride_kn, HEAD_D, BLOCK_N, BLOCK_D, TMA)
    v_src = _rows_src(v_base, M, stride_vn, HEAD_DV, BLOCK_N, BLOCK_DV, TMA)
    k = _load_tile(k_src, j0, M, stride_kn, stride_kd, HEAD_D, BLOCK_N, BLOCK_D, True, TMA)
    v = _load_tile(v_src, j0, M, stride_vn, stride_vd, HEAD_DV, BLOCK_N, BLOCK_DV, True, TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query tiles: [lo, mid) cross the diagonal (masked), [mid, full_end) see every key of the
    # tile (unmasked), [full_end, N) is the partial last tile (masked).  A partial key tile
    # (the last one) is masked throughout: its rows past M must not reach dQ.
    if IS_CAUSAL:
        lo = (j0 // BLOCK_M) * BLOCK_M  # earlier queries see none of these keys
        mid = tl.minimum(tl.cdiv(j0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, N)
    else:
        lo = 0
        mid = 0
    if not EVEN_M:
        mid = tl.where(j0 + BLOCK_N > M, N, mid)
    full_end = tl.maximum((N // BLOCK_M) * BLOCK_M, mid)

    # GQA: the group's query heads all read this key/value head; their dK/dV contributions are
    # summed here rather than per query head and reduced afterwards.
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = dO + b * stride_gb + h * stride_gh
        q_src = _rows_src(q_base, N, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, TMA)
        do_src = _rows_src(do_base, N, stride_gn, HEAD_DV, BLOCK_M, BLOCK_DV, TMA)
        row0 = (b * H + h) * N
        dq_base = DQacc + (b * H + h) * N_pad * BLOCK_D
        if DQ_MODE == 2:
            dq_dst = tl.make_tensor_descriptor(dq_base, shape=[N_pad, BLOCK_D],
                                               strides=[BLOCK_D, 1],
                                               block_shape=[BLOCK_M, BLOCK_D])
        else:
            dq_dst = dq_base
        if WARP_SPEC or not CAUSAL_SPLIT:
            # one loop (warp specialization takes one per kernel; see _fwd_tile)
            if (not IS_CAUSAL) and EVEN_N and EVEN_M:
                dk, dv = _bwd_kv_loop(dk, dv, k, v, q_src, do_src, Lse + row0, Delta + row0,
                                      dq_dst, 0, N, offs_n, N, M, qk_scale, stride_qn,
                                      stride_qd, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D,
                                      BLOCK_DV, BLOCK_M, IS_CAUSAL, False, TMA, WARP_SPEC,
                                      DQ_MODE, DOT_PREC)
            else:
                dk, dv = _bwd_kv_loop(dk, dv, k, v, q_src, do_src, Lse + row0, Delta + row0,
                                      dq_dst, lo, N, offs_n, N, M, qk_scale, stride_qn,
                                      stride_qd, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D,
                                      BLOCK_DV, BLOCK_M, IS_CAUSAL, True, TMA, WARP_SPEC,
                                      DQ_MODE, DOT_PREC)
        else:
            if IS_CAUSAL or not EVEN_M:
                dk, dv = _bwd_kv_loop(dk, dv, k, v, q_src, do_src, Lse + row0, Delta + row0,
                                      dq_dst, lo, mid, offs_n, N, M, qk_scale, stride_qn,
                                      stride_qd, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D,
                                      BLOCK_DV, BLOCK_M, IS_CAUSAL, True, TMA, False, DQ_MODE,
                                      DOT_PREC)
            dk, dv = _bwd_kv_loop(dk, dv, k, v, q_src, do_src, Lse + row0, Delta + row0,
                                  dq_dst, mid, full_end, offs_n, N, M, qk_scale, stride_qn,
                                  stride_qd, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D,
                                  BLOCK_DV, BLOCK_M, IS_CAUSAL, False, TMA, False, DQ_MODE,
                                  DOT_PREC)
            if not EVEN_N:
                dk, dv = _bwd_kv_loop(dk, dv, k, v, q_src, do_src, Lse + row0, Delta + row0,
                                      dq_dst, full_end, N, offs_n, N, M, qk_scale, stride_qn,
                                      stride_qd, stride_gn, stride_gd, HEAD_D, HEAD_DV, BLOCK_D,
                                      BLOCK_DV, BLOCK_M, IS_CAUSAL, True, TMA, False, DQ_MODE,
                                      DOT_PREC)

    dk_base = dK + b * stride_dkb + hk * stride_dkh
    dv_base = dV + b * stride_dvb + hk * stride_dvh
    dk_dst = _rows_src(dk_base, M, stride_dkn, HEAD_D, BLOCK_N, BLOCK_D, TMA)
    dv_dst = _rows_src(dv_base, M, stride_dvn, HEAD_DV, BLOCK_N, BLOCK_DV, TMA)
    _store_tile(dk_dst, dk_base, j0, M, stride_dkn, stride_dkd,
                (dk * sm_scale).to(dK.dtype.element_ty), HEAD_D, BLOCK_N, BLOCK_D, TMA)
    _store_tile(dv_dst, dv_base, j0, M, stride_dvn, stride_dvd, dv.to(dV.dtype.element_ty),
                HEAD_DV, BLOCK_N, BLOCK_DV, TMA)


@triton.jit
def _bwd_dq_step(dq, q, do, lse2, delta, k_src, v_src, start_n, offs_m, M, qk_scale,
                 stride_kn, stride_kd, stride_vn, stride_vd,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, TMA: tl.constexpr, DOT_PREC: tl.constexpr):
    start_n = tl.multiple_of(start_n, BLOCK_N)
    k = _load_tile(k_src, start_n, M, stride_kn, stride_kd, HEAD_D, BLOCK_N, BLOCK_D, MASKED, TMA)
    v = _load_tile(v_src, start_n, M, stride_vn, stride_vd, HEAD_DV, BLOCK_N, BLOCK_DV, MASKED,
                   TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    p = tl.math.exp2(tl.fma(s, qk_scale, -lse2[:, None]))
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n[None, :] < M
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    if MASKED:
        ds = tl.where(valid, ds, 0.0)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def _bwd_dq_loop(dq, q, do, lse2, delta, k_src, v_src, lo, hi, offs_m, M, qk_scale,
                 stride_kn, stride_kd, stride_vn, stride_vd,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 MASKED: tl.constexpr, TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    if WARP_SPEC:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            dq = _bwd_dq_step(dq, q, do, lse2, delta, k_src, v_src, start_n, offs_m, M, qk_scale,
                              stride_kn, stride_kd, stride_vn, stride_vd, HEAD_D, HEAD_DV,
                              BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL, MASKED, TMA, DOT_PREC)
    else:
        for start_n in tl.range(lo, hi, BLOCK_N):
            dq = _bwd_dq_step(dq, q, do, lse2, delta, k_src, v_src, start_n, offs_m, M, qk_scale,
                              stride_kn, stride_kd, stride_vn, stride_vd, HEAD_D, HEAD_DV,
                              BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL, MASKED, TMA, DOT_PREC)
    return dq


@triton.jit
def _hopper_bwd_dq_kernel(
    Q, K, V, dO, Lse, Delta, dQ, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H, N, M, GROUP,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, EVEN_M: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The split scheme's dQ: one query tile of one (batch, head), recomputing q.k and dP."""
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    i0 = pid_m * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = dO + b * stride_gb + h * stride_gh
    q_src = _rows_src(q_base, N, stride_qn, HEAD_D, BLOCK_M, BLOCK_D, TMA)
    do_src = _rows_src(do_base, N, stride_gn, HEAD_DV, BLOCK_M, BLOCK_DV, TMA)
    k_src = _rows_src(K + b * stride_kb + hk * stride_kh, M, stride_kn, HEAD_D, BLOCK_N, BLOCK_D,
                      TMA)
    v_src = _rows_src(V + b * stride_vb + hk * stride_vh, M, stride_vn, HEAD_DV, BLOCK_N,
                      BLOCK_DV, TMA)
    q = _load_tile(q_src, i0, N, stride_qn, stride_qd, HEAD_D, BLOCK_M, BLOCK_D, True, TMA)
    do = _load_tile(do_src, i0, N, stride_gn, stride_gd, HEAD_DV, BLOCK_M, BLOCK_DV, True, TMA)
    row0 = (b * H + h) * N
    # rows past N: lse = +inf (p = 0) and delta = 0; they are never stored
    lse2 = tl.load(Lse + row0 + offs_m, mask=row_ok, other=float("inf")) * _LOG2E
    delta = tl.load(Delta + row0 + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        hi = tl.minimum(M, i0 + BLOCK_M)
        full_hi = (tl.minimum(M, i0 + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = M
        full_hi = (M // BLOCK_N) * BLOCK_N
    if WARP_SPEC or not CAUSAL_SPLIT:  # one loop (see _fwd_tile)
        if (not IS_CAUSAL) and EVEN_M:
            dq = _bwd_dq_loop(dq, q, do, lse2, delta, k_src, v_src, 0, M, offs_m, M, qk_scale,
                              stride_kn, stride_kd, stride_vn, stride_vd, HEAD_D, HEAD_DV,
                              BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL, False, TMA, WARP_SPEC,
                              DOT_PREC)
        else:
            dq = _bwd_dq_loop(dq, q, do, lse2, delta, k_src, v_src, 0, hi, offs_m, M, qk_scale,
                              stride_kn, stride_kd, stride_vn, stride_vd, HEAD_D, HEAD_DV,
                              BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL, True, TMA, WARP_SPEC,
                              DOT_PREC)
    else:
        dq = _bwd_dq_loop(dq, q, do, lse2, delta, k_src, v_src, 0, full_hi, offs_m, M,
                          qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, HEAD_D, HEAD_DV,
                          BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL, False, TMA, False, DOT_PREC)
        if IS_CAUSAL or not EVEN_M:
            dq = _bwd_dq_loop(dq, q, do, lse2, delta, k_src, v_src, full_hi, hi, offs_m, M,
                              qk_scale, stride_kn, stride_kd, stride_vn, stride_vd, HEAD_D,
                              HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_N, IS_CAUSAL, True, TMA, False,
                              DOT_PREC)
    dq_base = dQ + b * stride_dqb + h * stride_dqh
    dq_dst = _rows_src(dq_base, N, stride_dqn, HEAD_D, BLOCK_M, BLOCK_D, TMA)
    _store_tile(dq_dst, dq_base, i0, N, stride_dqn, stride_dqd,
                (dq * sm_scale).to(dQ.dtype.element_ty), HEAD_D, BLOCK_M, BLOCK_D, TMA)


@triton.jit
def _dq_convert_kernel(DQacc, dQ, sm_scale,
                       stride_dqb, stride_dqh, stride_dqn, stride_dqd,
                       H, N, N_pad,
                       HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """dQ = sm_scale * DQacc in dQ's dtype (rows < N, columns < HEAD_D of the padded buffer)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N
    acc = tl.load(DQacc + ((b * H + h) * N_pad + offs_m[:, None]) * BLOCK_D + offs_d[None, :],
                  mask=row_ok[:, None], other=0.0)
    store_rows(dQ + b * stride_dqb + h * stride_dqh, offs_m, stride_dqn, offs_d, stride_dqd,
               row_ok, acc * sm_scale, HEAD_D)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _torch_allocator(size: int, alignment: int, stream):
    # Scratch for the on-device tensor descriptors (128 bytes each, per program).  torch's
    # caching allocator hands out 512-byte aligned blocks on the current stream.
    device = "cpu" if INTERPRETED else "cuda"
    return torch.empty(size, dtype=torch.int8, device=device)


def _ensure_allocator() -> None:
    """Install a torch allocator for Triton's global scratch unless one is set.  Checked at every
    launch: triton.set_allocator sets a ContextVar, which a new thread (autograd's backward
    threads among them) does not inherit."""
    try:
        from triton.runtime._allocation import NullAllocator, _allocator

        if not isinstance(_allocator.get(), NullAllocator):
            return
    except Exception:  # noqa: BLE001 - another Triton's layout: set ours at every launch
        pass
    triton.set_allocator(_torch_allocator)


def _check_inputs(fn, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [B, H, L, D]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
    check_attention_shapes(fn, q, k, v)
    B, H, _, D = q.shape
    if not (q.is_cuda or INTERPRETED):
        raise RuntimeError(f"{fn}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 "
                           f"set before attnkit.kernels is imported, for CPU tensors)")


def _tma_problem(tensors) -> str:
    """'' when every tensor can be read through a tensor descriptor, else why not."""
    for name, t in tensors:
        if t.stride(-1) != 1:
            return f"{name} has head-dim stride {t.stride(-1)} (tensor descriptors need 1)"
        size = t.element_size()
        if t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
            return (f"{name}'s base or strides {tuple(t.stride())} are not multiples of 16 bytes "
                    "(tensor descriptors need them)")
    return ""


def _check_variant(fn, variant, named_tensors):
    why = variant_support(variant)
    if why:
        raise ValueError(f"{fn}: variant {variant} cannot run here: {why}")
    if getattr(variant, "tma", False) or getattr(variant, "dq", "") == "tma_reduce":
        why = _tma_problem(named_tensors)
        if why:
            raise ValueError(f"{fn}: variant {variant} reads through tensor descriptors, but {why}")
        _ensure_allocator()


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _meta(config):
    return dict(BLOCK_M=config.kwargs["BLOCK_M"], BLOCK_N=config.kwargs["BLOCK_N"],
                num_warps=config.num_warps, num_stages=config.num_stages)


def _strides(t):
    return tuple(t.stride())


def _output(fn, name, given, shape, dtype, device):
    """``given`` (checked: shape, dtype, contiguous) or a new empty tensor."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(given.shape) != tuple(shape) or given.dtype != dtype or not given.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a contiguous {dtype} tensor of shape "
                         f"{tuple(shape)}; got {given.dtype} {tuple(given.shape)}")
    return given


def hopper_fwd(q, k, v, scale=None, is_causal=False, *, variant: FwdVariant | None = None,
               config=None, num_programs: int | None = None, out=None, lse=None):
    """Forward of softmax attention without mask or options: ``(out, lse)`` as
    kernels.softmax.softmax_fwd.  ``variant``: the switches (default :class:`FwdVariant`());
    ``config``: a ``triton.Config`` (BLOCK_M, BLOCK_N, num_warps, num_stages), default the first
    of :func:`fwd_configs`; ``num_programs``: the persistent grid's size (default ``persistent``
    programs per SM; 3 under the interpreter, so that programs take several tiles).  ``out`` /
    ``lse``: contiguous tensors to write into (else new ones)."""
    fn = "hopper_fwd"
    variant = FwdVariant() if variant is None else variant
    _check_inputs(fn, q, k, v)
    B, H, N, D = q.shape
    Hk, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = _output(fn, "out", out, (B, H, N, Dv), q.dtype, q.device)
    lse = _output(fn, "lse", lse, (B, H, N), torch.float32, q.device)
    _check_variant(fn, variant, (("q", q), ("k", k), ("v", v), ("out", out)))
    if B * H * N == 0:
        return out, lse
    if M == 0:  # no key at all: every row is fully masked
        return out.zero_(), lse.fill_(float("-inf"))
    config = fwd_configs(D, Dv, variant)[0] if config is None else config
    exp_mode = _EXP_MODES[variant.exp]
    if exp_mode >= 2 and not scale > 0.0:
        exp_mode = 1  # the row max of raw scores is the scaled max only for a positive scale
    if exp_mode >= 3 and q.dtype == torch.float32:
        exp_mode = 2  # the cubic's 8.6e-5 relative error is below P's rounding in 16 bits only
    bm = config.kwargs["BLOCK_M"]
    n_tiles = cdiv(N, bm) * H * B
    if variant.persistent:
        if num_programs is None:
            num_programs = 3 if INTERPRETED else variant.persistent * _sm_count(q.device)
        grid = (max(1, min(int(num_programs), n_tiles)), 1, 1)
    else:
        grid = (cdiv(N, bm), H, B)
    _hopper_fwd_kernel[grid](
        q, k, v, out, lse, scale, scale * 1.4426950408889634,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), B, H, N, M, H // Hk,
        HEAD_D=D, HEAD_DV=Dv, BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), IS_CAUSAL=bool(is_causal),
        EXP_MODE=exp_mode, LAZY=bool(variant.lazy), CAUSAL_SPLIT=bool(variant.causal_split),
        TMA=bool(variant.tma), WARP_SPEC=bool(variant.warp_specialize),
        PERSISTENT=bool(variant.persistent),
        EVEN_M=M % config.kwargs["BLOCK_N"] == 0, DOT_PREC=dot_precision(q.dtype),
        **_meta(config))
    return out, lse


def hopper_bwd(grad_out, q, k, v, out, lse, scale=None, is_causal=False, *,
               variant: BwdVariant | None = None, config=None, grads=None):
    """Backward from the forward's ``out`` and ``lse`` (natural log): ``(dq, dk, dv)`` as
    kernels.softmax.softmax_bwd.  ``variant``: the switches (default :class:`BwdVariant`(), the
    one-kernel atomic scheme); ``config``: a ``triton.Config`` (dq "atomic" / "tma_reduce") or a
    pair ``(kv_config, dq_config)`` (dq "split"), default the first of :func:`bwd_configs`.
    ``grads``: contiguous ``(dq, dk, dv)`` to write into (else new ones)."""
    fn = "hopper_bwd"
    variant = BwdVariant() if variant is None else variant
    _check_inputs(fn, q, k, v)
    B, H, N, D = q.shape
    Hk, M, Dv = k.shape[1], k.shape[2], v.shape[3]
    check_backward_inputs(fn, grad_out, out, lse, B, H, N, Dv)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    dq, dk, dv = (None, None, None) if grads is None else grads
    dq = _output(fn, "dq", dq, q.shape, q.dtype, q.device)
    dk = _output(fn, "dk", dk, k.shape, k.dtype, k.device)
    dv = _output(fn, "dv", dv, v.shape, v.dtype, v.device)
    _check_variant(fn, variant, (("q", q), ("k", k), ("v", v), ("grad_out", grad_out),
                                 ("dq", dq), ("dk", dk), ("dv", dv)))
    if B * H == 0:
        return dq, dk, dv
    if N == 0 or M == 0:  # no query-key pair: nothing flows back
        return dq.zero_(), dk.zero_(), dv.zero_()
    if config is None:
        config = bwd_configs(variant, D, Dv)[0]
    if variant.dq == "split":
        kv_config, dq_config = config
    else:
        kv_config, dq_config = config, None

    lse = lse.contiguous()
    block_d, block_dv = pow2(D), pow2(Dv)
    dq_mode = _DQ_MODES[variant.dq]
    # The dQ accumulator: float32, padded to whole 128-row tiles (every BLOCK_M here divides
    # 128) and to BLOCK_D columns, so that the adds need no bounds mask.
    pre_block = 128
    n_pad = cdiv(N, pre_block) * pre_block
    if dq_mode:
        dq_acc = torch.empty((B, H, n_pad, block_d), dtype=torch.float32, device=q.device)
    else:
        dq_acc = lse  # a stand-in pointer: DQ_MODE 0 never touches it
    delta = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    _bwd_pre_kernel[(cdiv(n_pad if dq_mode else N, pre_block), H, B)](
        out, grad_out, delta, dq_acc, *_strides(out), *_strides(grad_out), H, N, n_pad,
        HEAD_DV=Dv, BLOCK_DV=block_dv, BLOCK_D=block_d, ZERO_DQ=bool(dq_mode),
        BLOCK_M=pre_block, num_warps=4)

    qk_scale = scale * 1.4426950408889634
    consts = dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                  IS_CAUSAL=bool(is_causal), CAUSAL_SPLIT=bool(variant.causal_split),
                  TMA=bool(variant.tma), WARP_SPEC=bool(variant.warp_specialize),
                  DOT_PREC=dot_precision(q.dtype))
    bm, bn = kv_config.kwargs["BLOCK_M"], kv_config.kwargs["BLOCK_N"]
    _hopper_bwd_kv_kernel[(cdiv(M, bn), Hk, B)](
        q, k, v, grad_out, lse, delta, dk, dv, dq_acc, scale, qk_scale,
        *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dk),
        *_strides(dv), H, N, M, H // Hk, n_pad, DQ_MODE=dq_mode, EVEN_N=N % bm == 0,
        EVEN_M=M % bn == 0, **consts, **_meta(kv_config))
    if dq_mode:
        _dq_convert_kernel[(cdiv(N, pre_block), H, B)](
            dq_acc, dq, scale, *_strides(dq), H, N, n_pad, HEAD_D=D, BLOCK_D=block_d,
            BLOCK_M=pre_block, num_warps=4)
    else:
        bm = dq_config.kwargs["BLOCK_M"]
        _hopper_bwd_dq_kernel[(cdiv(N, bm), H, B)](
            q, k, v, grad_out, lse, delta, dq, scale, qk_scale,
            *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out), *_strides(dq),
            H, N, M, H // Hk, EVEN_M=M % dq_config.kwargs["BLOCK_N"] == 0, **consts,
            **_meta(dq_config))
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# the fast path of kernels/softmax.py (issue 26)
# ----------------------------------------------------------------------------------------------

# The variant and config per (padded head dim, causal) that kernels/softmax.py's launchers take
# for the fast case on sm_90.  Measured on an NVIDIA H200 (Triton 3.6, torch 2.11, 2026-11-27,
# session 15; `bash .ci/gpu_speed softmax`, bf16 B=4 H=8 N=8192; bench/RESULTS.md), against
# kernels/softmax.py autotuned over its own lists in the same run:
#   backward, "split" on these tiles: D=128 full 8.197 -> 6.649 ms, causal 5.196 -> 4.052;
#             D=64 full 4.360 -> 3.414, causal 2.746 -> 2.253 (same tile sizes as the autotuner's
#             pick at D=64: the gain is the loop structure -- unmasked interior tiles, EVEN_*
#             specializations -- not the tiles);
#   forward:  D=128 full 2.183 -> 2.123 ms (base 128x128 w8 s3), causal 1.263 -> 1.181 (base
#             128x64 w8 s3); D=64 full 1.267 -> 1.241 (fma 128x64 w8 s3), causal 0.700 -> 0.691
#             (base 128x64 w8 s3).
# Warp-specialized variants gave wrong results there (NaN lse) and are never taken.
FAST_FWD = {
    (64, False): ("fma", (128, 64, 8, 3)),
    (64, True): ("base", (128, 64, 8, 3)),
    (128, False): ("base", (128, 128, 8, 3)),
    (128, True): ("base", (128, 64, 8, 3)),
}
FAST_BWD = {  # dq="split": (dK/dV tiles, dQ tiles); the same for causal and full
    64: ((64, 64, 4, 3), (64, 64, 4, 3)),
    128: ((64, 128, 8, 2), (64, 64, 4, 2)),
}


# The tables as launch arguments, built once (a triton.Config per call is host time).
_FAST_FWD_ARGS = {key: (FWD_VARIANTS[name], _cfg(*tiles)) for key, (name, tiles) in FAST_FWD.items()}
_FAST_BWD_ARGS = {d: (_cfg(*kv), _cfg(*dq)) for d, (kv, dq) in FAST_BWD.items()}


def fast_fwd(q, k, v, scale, is_causal):
    """kernels/softmax.py's fast-case forward: ``(out, lse)`` with the measured variant."""
    variant, config = _FAST_FWD_ARGS[(pow2(q.shape[-1]), bool(is_causal))]
    return hopper_fwd(q, k, v, scale, is_causal, variant=variant, config=config)


# Where the one-kernel scheme with dQ added by TMA reduce-adds measured faster than split: D=64
# causal, 64x64 w4 s3, 2.253 -> 1.995 ms (H200, session 15, the same run as the tables above;
# fwd+bwd 0.78x -> 0.86x SDPA).  Taken only where this Triton has descriptor reduce-adds and every
# tensor passes the descriptors' alignment rules (else split): the interpreter cannot run them,
# so this path is checked by the GPU tests (test_gpu_fast_path_bf16, test_softmax_hopper).
FAST_BWD_REDUCE = {
    (64, True): (64, 64, 4, 3),
}
_FAST_BWD_REDUCE_ARGS = {key: _cfg(*tiles) for key, tiles in FAST_BWD_REDUCE.items()}


def fast_bwd(grad_out, q, k, v, out, lse, scale, is_causal):
    """kernels/softmax.py's fast-case backward: ``(dq, dk, dv)``, the measured scheme and tiles
    (FAST_BWD_REDUCE where it holds and deterministic algorithms are off, else split on
    FAST_BWD's)."""
    d = pow2(q.shape[-1])
    reduce_config = _FAST_BWD_REDUCE_ARGS.get((d, bool(is_causal)))
    # Not under torch.use_deterministic_algorithms(True): the reduce-adds of dQ's shares come in
    # no fixed order (dQ not bitwise reproducible); split computes dQ in a kernel of its own.
    if (reduce_config is not None and not torch.are_deterministic_algorithms_enabled()
            and _reduce_usable(grad_out, q, k, v, out)):
        return hopper_bwd(grad_out, q, k, v, out, lse, scale, is_causal,
                          variant=BWD_VARIANTS["tma_reduce"], config=reduce_config)
    return hopper_bwd(grad_out, q, k, v, out, lse, scale, is_causal, variant=BWD_VARIANTS["split"],
                      config=_FAST_BWD_ARGS[d])


def _reduce_usable(*tensors) -> bool:
    """Whether the tma_reduce backward can run on these inputs (its outputs are new, contiguous
    tensors: aligned whenever the inputs are)."""
    if variant_support(BWD_VARIANTS["tma_reduce"]):
        return False
    return not _tma_problem([(str(i), t) for i, t in enumerate(tensors)])

"""Triton kernels for linear (kernelized) attention: chunked causal and non-causal, forward and
backward, with the feature map fused in.

Layer 1 of the linear family (see DESIGN.md): ``@triton.jit`` kernels and the launchers that
size their grids.  No autograd here -- ``pytorch_ext/ops/linear.py`` registers the launchers as
a ``torch.library`` op and wires :func:`linear_bwd` in as its backward.

What is computed (per batch b and head h; φ the feature map, applied row-wise)
------------------------------------------------------------------------------
With an initial state (S0 [D, Dv], z0 [D]; zeros when none is given) and S_i the keys that
query i sees (j <= i when causal, all j otherwise)::

    S_i = S0 + Σ_{j∈S_i} φ(k_j) v_jᵀ        z_i = z0 + Σ_{j∈S_i} φ(k_j)
    den_i = φ(q_i)·z_i   (raw, without eps)
    out_i = φ(q_i) S_i / (den_i + eps)   (normalize)      out_i = scale · φ(q_i) S_i   (otherwise)
    S_final = S0 + Σ_j φ(k_j) v_jᵀ                     z_final = z0 + Σ_j φ(k_j)

(without an initial state this is ``linear_attention_reference``).

Launchers
---------
``linear_fwd(q, k, v, *, causal, feature_map, normalize, eps, scale, initial_state=None,
chunk=None, config=None)`` -> ``(out, S_final, z_final, den)``
    out [B, H, N, Dv] in q's dtype; S_final [B, H, D, Dv], z_final [B, H, D] and den [B, H, N]
    float32.  ``den`` is the extra tensor saved for the backward: φ(q_i)·z_i of every query
    row, raw (without eps; computed whatever ``normalize`` says) -- the same tensor as the
    second output of the C++ op ``attnkit::linear_fwd`` (csrc/ops.cpp).
``linear_bwd(grad_out, q, k, v, *, causal, feature_map, normalize, eps, scale,
initial_state=None, grad_S=None, grad_z=None, grad_den=None, out=None, den=None, chunk=None,
config=None)`` -> ``(dq, dk, dv)``, plus ``(dS0, dz0)`` (float32) when ``initial_state`` is
    given.  ``grad_out`` / ``grad_S`` / ``grad_z`` / ``grad_den`` are the gradients of out /
    S_final / z_final / den (None = zero).  With ``normalize`` the backward needs the forward's
    ``out`` and ``den``; when they are not passed it reruns the forward to get them.

``linear_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, ...)`` / ``linear_varlen_bwd(grad_out, q, k,
v, cu_seqlens, max_seqlen, ..., out=None, den=None)``
    Packed sequences (``linear_attention_varlen``): q, k [total, H, D], v [total, H, Dv], sequence
    b rows ``cu_seqlens[b]:cu_seqlens[b + 1]``, its own queries and keys, states from zero; the
    same kernels' VARLEN build in one launch each (see :class:`_Rows`).  Returns out [total, H,
    Dv], S_final [batch, H, D, Dv], z_final [batch, H, D], den [H, total]; the backward (dq, dk,
    dv) [total, H, *].  Each sequence's values are those of the dense launchers on it alone.

Shapes: q [B, H, N, D], k [B, H, M, D], v [B, H, M, Dv] (Dv may differ from D; causal needs
M == N).  ``initial_state`` is a pair ``(S0 [B, H, D, Dv], z0 [B, H, D])``, read as float32.
Inputs float16 / bfloat16 / float32, any strides; float32 accumulation and states.
Empty inputs give empty (or, for M = 0 without an initial state, zero) results, never NaN.

How (chunk size C, default 64)
------------------------------
Forward, two phases:
  1. ``_state_fwd_kernel``, one program per (D-block, Dv-block, h, b), walks the key chunks in
     order, carrying the running state (S, z) in registers; when causal it stores the state
     *before* each chunk (Hs [B, H, NT, D, Dv], Zs [B, H, NT, D]: N/C states, not N); it always
     stores S_final, z_final.
  2. ``_output_kernel``, one program per (query chunk, Dv-block, h, b): the inter-chunk part
     φQ_c · Hs[c] plus, when causal, the intra-chunk part (φQ_c φK_cᵀ ∘ tril) V_c on tl.dot.
     Non-causal reads S_final for every chunk (the reduction pass / apply pass of the spec).
Backward, the same chunking in reverse.  g = grad_out; per query row two factors: the one of
g, r_i = 1/(den_i + eps) (normalize) or ``scale``, and the one of the normalizer path,
c_i = -r_i δ_i (normalize; δ_i = g_i·out_i, from the stored out as in FlashAttention) or 0,
plus grad_den_i.  Then
    dφq_i = r_i S_i g_i + c_i z_i
    dφk_j = Σ_{i sees j} (r_i g_i·v_j + c_i) φq_i + grad_S v_j + grad_z
    dv_j  = Σ_{i sees j} r_i (φq_i·φk_j) g_i + grad_Sᵀ φk_j
    dS0   = grad_S + Σ_i r_i φq_i g_iᵀ          dz0 = grad_z + Σ_i c_i φq_i
  ``_delta_kernel`` (δ), ``_state_fwd_kernel`` again (the forward chunk states are recomputed,
  not saved), ``_state_bwd_kernel`` (the reverse states dHs[c] = grad_S + Σ_{i after chunk c}
  r_i φq_i g_iᵀ and dZs, walking the chunks backwards), then ``_dq_kernel``, ``_dk_kernel``,
  ``_dv_kernel``, one program per (chunk, block, h, b), each an inter-chunk state product plus
  a masked intra-chunk product.  No [N, D, Dv] tensor is formed anywhere.

Numerics: φ is evaluated in float32 on loaded tiles (padded rows and columns are forced to 0:
elu(0)+1 = 1 would otherwise count them).  Two kinds of products:
  - plain ones (φQφKᵀ, P·V, φKᵀV, gVᵀ) take their operands in the input dtype;
  - state ones (a tile times a state, or an operand scaled row-wise by r_i, such as the
    masked (r_i g_i·v_j + c_i) of the backward) would, in float16,
    overflow (a state grows like N) or underflow (r_i shrinks like 1/N): in float16 they run on
    float32 operands with 3xTF32 (plain TF32 truncates, and its bias added up past the float16
    test rule on an H100), in bfloat16 on bfloat16 operands (float32's range already).
float32 inputs use 3xTF32 products everywhere (``input_precision="tf32x3"``: float32-level
accuracy, ~1e-6 relative, on tensor cores; ``"ieee"`` compiles to FMA loops that spill tens of
KB of registers per program at these tile sizes -- measured with ptxas for sm_90a).

Tuning: ``STATE_CONFIGS`` (the two state-walking kernels) and ``CHUNK_CONFIGS`` (the per-chunk
kernels) are ``triton.autotune`` search spaces over (BLOCK_K = D-block, BLOCK_V = Dv-block,
num_warps, num_stages), keyed on the head dims and the chunk; :func:`configs_for` clamps the
blocks to the padded head dims.  ``config=`` (a ``triton.Config`` with BLOCK_K / BLOCK_V) skips
autotuning for every kernel of the call; under the Triton interpreter (no GPU) the first
eligible config is used.  ``chunk`` (a power of two in 16..128) is not tuned: it sets the
chunk-state buffers' shape.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import _flash
from ._flash import INTERPRETED, SUPPORTED_DTYPES, cdiv, cfg, launch, pow2

__all__ = [
    "linear_fwd",
    "linear_bwd",
    "linear_varlen_fwd",
    "linear_varlen_bwd",
    "configs_for",
    "STATE_CONFIGS",
    "CHUNK_CONFIGS",
    "FEATURE_MAPS",
    "SUPPORTED_DTYPES",
    "DEFAULT_CHUNK",
]

FEATURE_MAPS = ("elu", "relu", "identity")
DEFAULT_CHUNK = 64
_FEATURE_CODE = {"elu": 0, "relu": 1, "identity": 2}
# LOWP code of an input dtype: 0 = float32, 1 = float16, 2 = bfloat16 (see _dot_plain/_dot_state)
_LOWP = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# ----------------------------------------------------------------------------------------------
# autotune search spaces
# ----------------------------------------------------------------------------------------------


_TILE_NAMES = ("BLOCK_K", "BLOCK_V")  # the config's tile sizes (kernels/_flash.py's names=)


def _cfg(block_k, block_v, num_warps, num_stages):
    return cfg(block_k, block_v, num_warps, num_stages, names=_TILE_NAMES)


# The lists hold the configs that ptxas (sm_90a, chunk 64, D = Dv in {64, 128}) compiles without
# register spills for at least one dtype: 64x64 with 8 warps for float16 / bfloat16, 32x32 with
# 4 warps for float32 (3xTF32 doubles the operand registers); 128x128 tiles spill everywhere.
# State walkers: one program per (D-block, Dv-block) runs through every chunk, so small blocks
# buy parallelism (B·H alone rarely fills a GPU); the [BLOCK_K, BLOCK_V] state lives in registers.
# (32, 64, 4, 2) is left out of both lists: forced on all six kernels of a bfloat16 backward with
# an initial state (B=1, H=2, N=300, D=Dv=64) it made an illegal memory access on an H100
# (triton 3.6, 2026-11-26); every other config ran clean there.
STATE_CONFIGS = [
    _cfg(64, 64, 8, 2),
    _cfg(32, 32, 4, 2),
    _cfg(64, 32, 4, 2),
    _cfg(64, 64, 4, 2),
    _cfg(64, 64, 8, 3),
]
# Per-chunk kernels: one program per (chunk, block); wide blocks avoid recomputing the [C, C]
# intra-chunk product once per block.
CHUNK_CONFIGS = [
    _cfg(64, 64, 8, 2),
    _cfg(32, 32, 4, 2),
    _cfg(64, 64, 4, 2),
    _cfg(128, 64, 8, 2),
    _cfg(64, 128, 8, 2),
    _cfg(64, 64, 8, 3),
]
_CONFIG_LISTS = {"state": STATE_CONFIGS, "chunk": CHUNK_CONFIGS}
_TUNE_KEY = ["HEAD_D", "HEAD_DV", "CHUNK"]  # + the argument dtypes (automatic)


# Smallest tile edge: on an H100 (triton 3.6, 2026-11-26) every bfloat16 causal fwd+bwd with
# D = 16 -- tiles clamped to BLOCK_K = 16 -- came out wrong (N = 7, 100, 513) or made an illegal
# address (N = 2049), while D = 32, 64, 128 passed at every N; a 32-wide tile over a 16-wide head
# is masked like any ragged edge and runs the configuration that passed.
MIN_BLOCK = 32


def _clamp(config, head_dim, value_dim):
    kw = dict(config.kwargs)
    kw["BLOCK_K"] = min(kw["BLOCK_K"], max(MIN_BLOCK, pow2(head_dim)))
    kw["BLOCK_V"] = min(kw["BLOCK_V"], max(MIN_BLOCK, pow2(value_dim)))
    return triton.Config(kw, num_warps=config.num_warps, num_stages=config.num_stages)


def configs_for(kind: str, head_dim: int, value_dim: int) -> list:
    """The autotune candidates of ``kind`` ("state" or "chunk") for these head dims: blocks
    clamped to the padded dims (a 128-wide block on a 32-wide head only wastes registers),
    duplicates dropped, order kept."""
    seen, out = set(), []
    for c in _CONFIG_LISTS[kind]:
        c = _clamp(c, head_dim, value_dim)
        key = (c.kwargs["BLOCK_K"], c.kwargs["BLOCK_V"], c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _phi(x, FEATURE: tl.constexpr):
    """φ(x) in float32: 0 = elu(x) + 1, 1 = relu, 2 = identity; NaN stays NaN (issue 15).
    Selects test x <= 0, so that a NaN takes the x branch: on a GPU tl.maximum / tl.minimum drop
    a NaN operand (relu(NaN) came out 0, elu(NaN) + 1 = exp(min(NaN, 0)) = 1)."""
    if FEATURE == 0:
        # exp only where it is used: exp of a large positive x would be inf (harmless in the
        # unselected branch, but min() keeps the interpreter free of overflow warnings).
        return tl.where(x <= 0, tl.exp(tl.minimum(x, 0.0)), x + 1.0)
    elif FEATURE == 1:
        return tl.where(x <= 0, 0.0, x)
    else:
        return x


@triton.jit
def _times_dphi(grad, x, FEATURE: tl.constexpr):
    """grad · φ'(x) as torch's autograd has it: relu'(0) = 0, elu'(0) = 1, and at NaN both
    pass grad on unchanged (torch selects on x <= 0)."""
    if FEATURE == 0:
        return grad * tl.where(x <= 0, tl.exp(tl.minimum(x, 0.0)), 1.0)
    elif FEATURE == 1:
        return tl.where(x <= 0, 0.0, grad)
    else:
        return grad


@triton.jit
def _tile_ptrs(base, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """(pointers, in-bounds mask) of the [len(rows), len(cols)] tile of a strided matrix with
    n_rows x n_cols valid entries (int64 row offsets: rows · stride can pass 2^31)."""
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    ptrs = base + rows.to(tl.int64)[:, None] * stride_r + cols[None, :] * stride_c
    return ptrs, ok


@triton.jit
def _load_raw(base, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """Tile in its stored dtype, zero outside [n_rows, n_cols)."""
    ptrs, ok = _tile_ptrs(base, rows, cols, stride_r, stride_c, n_rows, n_cols)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _load_tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """[len(rows), len(cols)] tile as float32, zero outside [n_rows, n_cols)."""
    return _load_raw(base, rows, cols, stride_r, stride_c, n_rows, n_cols).to(tl.float32)


@triton.jit
def _load_phi(base, rows, cols, stride_r, stride_c, n_rows, n_cols, FEATURE: tl.constexpr):
    """(φ(tile), tile), both float32, φ forced to 0 outside [n_rows, n_cols)."""
    ptrs, ok = _tile_ptrs(base, rows, cols, stride_r, stride_c, n_rows, n_cols)
    x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    return tl.where(ok, _phi(x, FEATURE), 0.0), x


@triton.jit
def _load_state(base, offs_k, offs_v, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr):
    """[BLOCK_K, BLOCK_V] block of a float32 state stored row-major [D, Dv]."""
    ok = (offs_k < HEAD_D)[:, None] & (offs_v < HEAD_DV)[None, :]
    return tl.load(base + offs_k[:, None] * HEAD_DV + offs_v[None, :], mask=ok, other=0.0)


@triton.jit
def _store_state(base, x, offs_k, offs_v, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr):
    ok = (offs_k < HEAD_D)[:, None] & (offs_v < HEAD_DV)[None, :]
    tl.store(base + offs_k[:, None] * HEAD_DV + offs_v[None, :], x, mask=ok)


@triton.jit
def _store_state_z(s_base, z_base, state, z, offs_k, offs_v, z_store, HEAD_D: tl.constexpr,
                   HEAD_DV: tl.constexpr):
    """A state block [BLOCK_K, BLOCK_V] at s_base and its z block [BLOCK_K] at z_base (where
    z_store: only the first Dv-block writes z)."""
    _store_state(s_base, state, offs_k, offs_v, HEAD_D, HEAD_DV)
    tl.store(z_base + offs_k, z, mask=z_store)


@triton.jit
def _store_rows(base, x, row0, rows, cols, n_rows, WIDTH: tl.constexpr):
    """x [len(rows), len(cols)] in base's dtype into rows row0 + rows of a contiguous
    [*, WIDTH] matrix, masked to rows < n_rows and cols < WIDTH."""
    ptrs = base + (row0 + rows.to(tl.int64))[:, None] * WIDTH + cols[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty),
             mask=(rows < n_rows)[:, None] & (cols < WIDTH)[None, :])


@triton.jit
def _store_times_dphi(dX, acc, X, row0, rows, cols, stride_r, stride_c, n_rows,
                      WIDTH: tl.constexpr, FEATURE: tl.constexpr):
    """acc · φ'(x) (x: the rows / cols tile of the strided input X, n_rows x WIDTH valid) into
    rows row0 + rows of the contiguous [*, WIDTH] gradient dX."""
    x = _load_tile(X, rows, cols, stride_r, stride_c, n_rows, WIDTH)
    _store_rows(dX, _times_dphi(acc, x, FEATURE), row0, rows, cols, n_rows, WIDTH)


@triton.jit
def _program_tiles(OUTER_BLOCK: tl.constexpr, INNER_DIM: tl.constexpr,
                   INNER_BLOCK: tl.constexpr):
    """(outer, inner, h, b, offs_outer [OUTER_BLOCK], offs_inner [INNER_BLOCK]) of this program:
    grid axis 0 packs outer · cdiv(INNER_DIM, INNER_BLOCK) + inner (outer: a chunk or a D-block,
    inner: a D- or Dv-block); axes 1, 2 are the head and batch (int64: they scale the big
    strides)."""
    num_inner: tl.constexpr = (INNER_DIM + INNER_BLOCK - 1) // INNER_BLOCK
    pid = tl.program_id(0)
    outer = pid // num_inner
    inner = pid % num_inner
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_outer = outer * OUTER_BLOCK + tl.arange(0, OUTER_BLOCK)
    offs_inner = inner * INNER_BLOCK + tl.arange(0, INNER_BLOCK)
    return outer, inner, h, b, offs_outer, offs_inner


@triton.jit
def _chunk_causal(CHUNK: tl.constexpr, TRANSPOSED: tl.constexpr):
    """[CHUNK, CHUNK] mask of the visible (query i, key j) pairs in a chunk, j <= i: indexed
    [i, j], or [j, i] when TRANSPOSED."""
    ci = tl.arange(0, CHUNK)
    if TRANSPOSED:
        return ci[None, :] >= ci[:, None]
    else:
        return ci[None, :] <= ci[:, None]


@triton.jit
def _sequence(Cu, b, N, VARLEN: tl.constexpr):
    """(row0, n) of sequence b: with VARLEN its first packed row and its length, read from the
    offsets Cu (int32 [batch + 1]); otherwise 0 and N (every batch element has N rows)."""
    if VARLEN:
        row0 = tl.load(Cu + b).to(tl.int64)
        return row0, (tl.load(Cu + b + 1) - row0).to(tl.int32)
    else:
        return 0, N


@triton.jit
def _vector_base(b, h, H, N, row0, VARLEN: tl.constexpr):
    """Offset of sequence b's first row, head h, in a contiguous per-row buffer (den, δ,
    grad_den, and the dq / dk / dv outputs row by row): [B, H, N] dense, [H, total] packed (N
    is then the total)."""
    if VARLEN:
        return h * N + row0
    else:
        return (b * H + h) * N


@triton.jit
def _chunk0(ChunkOff, b, VARLEN: tl.constexpr):
    """Index of sequence b's first chunk state: with VARLEN from ChunkOff (int32 [batch + 1],
    the running count of chunks per sequence), otherwise 0 (dense buffers index chunks per
    batch element)."""
    if VARLEN:
        return tl.load(ChunkOff + b).to(tl.int64)
    else:
        return 0


@triton.jit
def _sequence_chunk(Cu, ChunkOff, b, t, N, VARLEN: tl.constexpr):
    """(row0, n, tc) of a per-chunk program: sequence b's first row and length (_sequence) and
    the index of its chunk t's state (_chunk0 + t)."""
    row0, n = _sequence(Cu, b, N, VARLEN)
    return row0, n, _chunk0(ChunkOff, b, VARLEN) + t.to(tl.int64)


@triton.jit
def _dot_plain(a, b, acc, LOWP: tl.constexpr):
    """acc + a @ b with the operands in the input dtype (3xTF32 for float32 inputs)."""
    if LOWP == 1:
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    elif LOWP == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")


@triton.jit
def _dot_state(a, b, acc, LOWP: tl.constexpr):
    """acc + a @ b where an operand is a state or row-scaled by r_i: float16 inputs use float32
    operands with 3xTF32 (a float16 state can overflow, r_i·x can underflow; plain TF32 is not
    enough: the tensor cores drop the 13 low mantissa bits instead of rounding, a bias that adds
    up along the state sums -- on an H100 it made the float16 dv error 2.4x the float16
    reference's own, over the test rule's 2x, while dq / dk / out stayed within 1.9x), bfloat16
    inputs bfloat16 operands (float32's range), float32 3xTF32."""
    if LOWP == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    elif LOWP == 2:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _state_fwd_kernel(
    K, V, S0, Z0, Hs, Zs, S_out, Z_out, Cu, ChunkOff,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_hb, stride_hh, stride_ht,
    stride_zb, stride_zh, stride_zt,
    H, M, NT,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, FEATURE: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_CHUNKS: tl.constexpr, LOWP: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """S = S0 + Σ φ(k) vᵀ and z = z0 + Σ φ(k) over the M keys, chunk by chunk; with
    STORE_CHUNKS the state before chunk t goes to Hs[b, h, t] / Zs[b, h, t].  VARLEN: b is a
    sequence of the pack (M the total, NT unused), its chunks' states at Hs[0, h, ChunkOff[b] +
    t]."""
    ik, iv, h, b, offs_k, offs_v = _program_tiles(BLOCK_K, HEAD_DV, BLOCK_V)
    row0, M = _sequence(Cu, b, M, VARLEN)
    if VARLEN:
        NT = tl.cdiv(M, CHUNK)
    chunk0 = _chunk0(ChunkOff, b, VARLEN)
    bh = b * H + h
    k_ok = offs_k < HEAD_D
    # z depends on the D-block only: every Dv-block computes it, the first one stores it.
    z_store = offs_k < tl.where(iv == 0, HEAD_D, 0)

    if HAS_INIT:
        state = _load_state(S0 + bh * (HEAD_D * HEAD_DV), offs_k, offs_v, HEAD_D, HEAD_DV)
        z = tl.load(Z0 + bh * HEAD_D + offs_k, mask=k_ok, other=0.0)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        z = tl.zeros([BLOCK_K], dtype=tl.float32)

    k_base = K + b * stride_kb + h * stride_kh + row0 * stride_kn
    v_base = V + b * stride_vb + h * stride_vh + row0 * stride_vn
    h_base = Hs + b * stride_hb + h * stride_hh + chunk0 * stride_ht
    zc_base = Zs + b * stride_zb + h * stride_zh + chunk0 * stride_zt
    for t in range(NT):
        if STORE_CHUNKS:
            t64 = b * 0 + t  # int64 (t is a plain int in the interpreter: no .to())
            _store_state_z(h_base + t64 * stride_ht, zc_base + t64 * stride_zt, state, z,
                           offs_k, offs_v, z_store, HEAD_D, HEAD_DV)
        rows = t * CHUNK + tl.arange(0, CHUNK)
        phik, _ = _load_phi(k_base, rows, offs_k, stride_kn, stride_kd, M, HEAD_D, FEATURE)
        vv = _load_raw(v_base, rows, offs_v, stride_vn, stride_vd, M, HEAD_DV)
        state = _dot_plain(tl.trans(phik), vv, state, LOWP)
        z += tl.sum(phik, 0)

    _store_state_z(S_out + bh * (HEAD_D * HEAD_DV), Z_out + bh * HEAD_D, state, z, offs_k,
                   offs_v, z_store, HEAD_D, HEAD_DV)


@triton.jit
def _output_kernel(
    Q, K, V, Hs, Zs, Out, Den, Cu, ChunkOff,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_hb, stride_hh, stride_ht,
    stride_zb, stride_zh, stride_zt,
    H, N, eps, scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, FEATURE: tl.constexpr,
    CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr, LOWP: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """out rows of query chunk t, Dv-block iv: φQ_c Hs[t] (+ (φQ_c φK_cᵀ ∘ tril) V_c).
    VARLEN: chunk t of sequence b (N the total); programs past its end return."""
    t, iv, h, b, rows, offs_v = _program_tiles(CHUNK, HEAD_DV, BLOCK_V)
    row0, n, tc = _sequence_chunk(Cu, ChunkOff, b, t, N, VARLEN)
    if VARLEN:
        if t * CHUNK >= n:  # the grid covers the longest sequence
            return
    q_base = Q + b * stride_qb + h * stride_qh + row0 * stride_qn
    k_base = K + b * stride_kb + h * stride_kh + row0 * stride_kn
    h_base = Hs + b * stride_hb + h * stride_hh + tc * stride_ht
    zc_base = Zs + b * stride_zb + h * stride_zh + tc * stride_zt

    acc = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    den = tl.zeros([CHUNK], dtype=tl.float32)
    p = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for k0 in range(0, HEAD_D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        phiq, _ = _load_phi(q_base, rows, offs_k, stride_qn, stride_qd, n, HEAD_D, FEATURE)
        state = _load_state(h_base, offs_k, offs_v, HEAD_D, HEAD_DV)
        z = tl.load(zc_base + offs_k, mask=offs_k < HEAD_D, other=0.0)
        acc = _dot_state(phiq, state, acc, LOWP)
        den += tl.sum(phiq * z[None, :], 1)
        if CAUSAL:
            phik, _ = _load_phi(k_base, rows, offs_k, stride_kn, stride_kd, n, HEAD_D, FEATURE)
            p = _dot_plain(phiq, tl.trans(phik), p, LOWP)
    if CAUSAL:
        p = tl.where(_chunk_causal(CHUNK, False), p, 0.0)
        vv = _load_raw(V + b * stride_vb + h * stride_vh + row0 * stride_vn, rows, offs_v,
                       stride_vn, stride_vd, n, HEAD_DV)
        acc = _dot_plain(p, vv, acc, LOWP)
        den += tl.sum(p, 1)
    if NORMALIZE:
        # Rows past n hold 0 / eps, NaN at eps = 0: never stored, but kept out anyway.
        out = acc / tl.where(rows < n, den + eps, 1.0)[:, None]
    else:
        out = acc * scale

    row_ok = rows < n
    o_ptrs = Out + b * stride_ob + h * stride_oh + row0 * stride_on \
        + rows.to(tl.int64)[:, None] * stride_on + offs_v[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_v[None, :] < HEAD_DV))
    tl.store(Den + _vector_base(b, h, H, N, row0, VARLEN) + rows, den,
             mask=rows < tl.where(iv == 0, n, 0))


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _delta_kernel(
    G, Out, Delta,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N,
    HEAD_DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """δ[b, h, i] = Σ_e g[b, h, i, e] · out[b, h, i, e] in float32."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for v0 in range(0, HEAD_DV, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        g = _load_tile(G + b * stride_gb + h * stride_gh, rows, offs_v, stride_gn, stride_gd,
                       N, HEAD_DV)
        o = _load_tile(Out + b * stride_ob + h * stride_oh, rows, offs_v, stride_on, stride_od,
                       N, HEAD_DV)
        acc += tl.sum(g * o, 1)
    tl.store(Delta + (b * H + h) * N + rows, acc, mask=rows < N)


@triton.jit
def _row_factors(Den, Delta, GDen, row_base, rows, N, eps, scale, NORMALIZE: tl.constexpr,
                 HAS_GDEN: tl.constexpr):
    """(r, c) of the given rows: the gradient reaching φ(q_i) is r_i S_i g_i + c_i z_i, with
    r = 1/(den + eps), c = -r·δ (normalize) or r = scale, c = 0; plus grad_den in c."""
    ok = rows < N
    if NORMALIZE:
        den = tl.load(Den + row_base + rows, mask=ok, other=1.0)
        dl = tl.load(Delta + row_base + rows, mask=ok, other=0.0)
        r = 1.0 / (den + eps)
        c = -r * dl
    else:
        r = rows.to(tl.float32) * 0.0 + scale
        c = rows.to(tl.float32) * 0.0
    if HAS_GDEN:
        c += tl.load(GDen + row_base + rows, mask=ok, other=0.0)
    return r, c


@triton.jit
def _state_bwd_kernel(
    Q, G, Den, Delta, GDen, GS, GZ, dHs, dZs, dS_out, dZ_out, Cu, ChunkOff,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_hb, stride_hh, stride_ht,
    stride_zb, stride_zh, stride_zt,
    H, N, NT, eps, scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, FEATURE: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_GDEN: tl.constexpr, HAS_GS: tl.constexpr, HAS_GZ: tl.constexpr,
    STORE_CHUNKS: tl.constexpr, LOWP: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dS = grad_S + Σ r_i φq_i g_iᵀ, dz = grad_z + Σ c_i φq_i over the N queries, walking
    the chunks backwards; with STORE_CHUNKS the value *after* chunk t (the sum over the later
    chunks) goes to dHs[b, h, t] / dZs[b, h, t].  VARLEN as in _state_fwd_kernel."""
    ik, iv, h, b, offs_k, offs_v = _program_tiles(BLOCK_K, HEAD_DV, BLOCK_V)
    row0, n = _sequence(Cu, b, N, VARLEN)
    if VARLEN:
        NT = tl.cdiv(n, CHUNK)
    chunk0 = _chunk0(ChunkOff, b, VARLEN)
    bh = b * H + h
    k_ok = offs_k < HEAD_D
    z_store = offs_k < tl.where(iv == 0, HEAD_D, 0)

    if HAS_GS:
        dstate = _load_state(GS + bh * (HEAD_D * HEAD_DV), offs_k, offs_v, HEAD_D, HEAD_DV)
    else:
        dstate = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    if HAS_GZ:
        dz = tl.load(GZ + bh * HEAD_D + offs_k, mask=k_ok, other=0.0)
    else:
        dz = tl.zeros([BLOCK_K], dtype=tl.float32)

    q_base = Q + b * stride_qb + h * stride_qh + row0 * stride_qn
    g_base = G + b * stride_gb + h * stride_gh + row0 * stride_gn
    h_base = dHs + b * stride_hb + h * stride_hh + chunk0 * stride_ht
    zc_base = dZs + b * stride_zb + h * stride_zh + chunk0 * stride_zt
    row_base = _vector_base(b, h, H, N, row0, VARLEN)
    for tt in range(NT):
        t = NT - 1 - tt
        if STORE_CHUNKS:
            t64 = b * 0 + t  # int64 (t is a plain int in the interpreter: no .to())
            _store_state_z(h_base + t64 * stride_ht, zc_base + t64 * stride_zt, dstate, dz,
                           offs_k, offs_v, z_store, HEAD_D, HEAD_DV)
        rows = t * CHUNK + tl.arange(0, CHUNK)
        phiq, _ = _load_phi(q_base, rows, offs_k, stride_qn, stride_qd, n, HEAD_D, FEATURE)
        g = _load_raw(g_base, rows, offs_v, stride_gn, stride_gd, n, HEAD_DV)
        r, c = _row_factors(Den, Delta, GDen, row_base, rows, n, eps, scale, NORMALIZE,
                            HAS_GDEN)
        dstate = _dot_state(tl.trans(phiq * r[:, None]), g, dstate, LOWP)
        if NORMALIZE or HAS_GDEN:
            dz += tl.sum(phiq * c[:, None], 0)

    _store_state_z(dS_out + bh * (HEAD_D * HEAD_DV), dZ_out + bh * HEAD_D, dstate, dz, offs_k,
                   offs_v, z_store, HEAD_D, HEAD_DV)


@triton.jit
def _dq_kernel(
    Q, K, V, G, Den, Delta, GDen, Hs, Zs, dQ, Cu, ChunkOff,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_hb, stride_hh, stride_ht,
    stride_zb, stride_zh, stride_zt,
    H, N, eps, scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, FEATURE: tl.constexpr,
    CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr, HAS_GDEN: tl.constexpr,
    LOWP: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dq of query chunk t, D-block ik: [r_i g_i Hs[t]ᵀ + c_i Zs[t] + Σ_{j<=i in chunk}
    (r_i g_i·v_j + c_i) φk_j] · φ'(q_i).  Output contiguous [B, H, N, D] ([H, total, D] with
    VARLEN, as in _output_kernel)."""
    t, ik, h, b, rows, offs_k = _program_tiles(CHUNK, HEAD_D, BLOCK_K)
    row0, n, tc = _sequence_chunk(Cu, ChunkOff, b, t, N, VARLEN)
    if VARLEN:
        if t * CHUNK >= n:  # the grid covers the longest sequence
            return
    k_ok = offs_k < HEAD_D
    g_base = G + b * stride_gb + h * stride_gh + row0 * stride_gn
    v_base = V + b * stride_vb + h * stride_vh + row0 * stride_vn
    h_base = Hs + b * stride_hb + h * stride_hh + tc * stride_ht

    acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    w = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    for v0 in range(0, HEAD_DV, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        g = _load_raw(g_base, rows, offs_v, stride_gn, stride_gd, n, HEAD_DV)
        state = _load_state(h_base, offs_k, offs_v, HEAD_D, HEAD_DV)
        acc = _dot_state(g, tl.trans(state), acc, LOWP)
        if CAUSAL:
            vv = _load_raw(v_base, rows, offs_v, stride_vn, stride_vd, n, HEAD_DV)
            w = _dot_plain(g, tl.trans(vv), w, LOWP)
    vector_base = _vector_base(b, h, H, N, row0, VARLEN)
    r, c = _row_factors(Den, Delta, GDen, vector_base, rows, n, eps, scale, NORMALIZE,
                        HAS_GDEN)
    acc = acc * r[:, None]
    if NORMALIZE or HAS_GDEN:
        z = tl.load(Zs + b * stride_zb + h * stride_zh + tc * stride_zt + offs_k,
                    mask=k_ok, other=0.0)
        acc += c[:, None] * z[None, :]
    if CAUSAL:
        w = tl.where(_chunk_causal(CHUNK, False), w * r[:, None] + c[:, None], 0.0)
        phik, _ = _load_phi(K + b * stride_kb + h * stride_kh + row0 * stride_kn, rows, offs_k,
                            stride_kn, stride_kd, n, HEAD_D, FEATURE)
        acc = _dot_state(w, phik, acc, LOWP)
    _store_times_dphi(dQ, acc, Q + b * stride_qb + h * stride_qh + row0 * stride_qn,
                      vector_base, rows, offs_k, stride_qn, stride_qd, n, HEAD_D, FEATURE)


@triton.jit
def _dk_kernel(
    Q, K, V, G, Den, Delta, GDen, dHs, dZs, dK, Cu, ChunkOff,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_hb, stride_hh, stride_ht,
    stride_zb, stride_zh, stride_zt,
    H, N, M, eps, scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, FEATURE: tl.constexpr,
    CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr, HAS_GDEN: tl.constexpr,
    LOWP: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dk of key chunk t, D-block ik: [dHs[t] v_j + dZs[t] + Σ_{i>=j in chunk} (r_i g_i·v_j +
    c_i) φq_i] · φ'(k_j).  Output contiguous [B, H, M, D] ([H, total, D] with VARLEN: N = M =
    the total, each sequence's queries its keys)."""
    t, ik, h, b, rows, offs_k = _program_tiles(CHUNK, HEAD_D, BLOCK_K)
    row0, n, tc = _sequence_chunk(Cu, ChunkOff, b, t, N, VARLEN)
    m = _sequence(Cu, b, M, VARLEN)[1]
    if VARLEN:
        if t * CHUNK >= n:  # the grid covers the longest sequence
            return
    k_ok = offs_k < HEAD_D
    g_base = G + b * stride_gb + h * stride_gh + row0 * stride_gn
    v_base = V + b * stride_vb + h * stride_vh + row0 * stride_vn
    h_base = dHs + b * stride_hb + h * stride_hh + tc * stride_ht

    acc = tl.zeros([CHUNK, BLOCK_K], dtype=tl.float32)
    wt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # wt[j, i] = v_j · g_i
    for v0 in range(0, HEAD_DV, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        vv = _load_raw(v_base, rows, offs_v, stride_vn, stride_vd, m, HEAD_DV)
        dstate = _load_state(h_base, offs_k, offs_v, HEAD_D, HEAD_DV)
        acc = _dot_state(vv, tl.trans(dstate), acc, LOWP)
        if CAUSAL:
            g = _load_raw(g_base, rows, offs_v, stride_gn, stride_gd, n, HEAD_DV)
            wt = _dot_plain(vv, tl.trans(g), wt, LOWP)
    dz = tl.load(dZs + b * stride_zb + h * stride_zh + tc * stride_zt + offs_k,
                 mask=k_ok, other=0.0)
    acc += dz[None, :]
    if CAUSAL:
        r, c = _row_factors(Den, Delta, GDen, _vector_base(b, h, H, N, row0, VARLEN), rows, n,
                            eps, scale, NORMALIZE, HAS_GDEN)
        wt = tl.where(_chunk_causal(CHUNK, True), wt * r[None, :] + c[None, :], 0.0)
        phiq, _ = _load_phi(Q + b * stride_qb + h * stride_qh + row0 * stride_qn, rows, offs_k,
                            stride_qn, stride_qd, n, HEAD_D, FEATURE)
        acc = _dot_state(wt, phiq, acc, LOWP)
    _store_times_dphi(dK, acc, K + b * stride_kb + h * stride_kh + row0 * stride_kn,
                      _vector_base(b, h, H, M, row0, VARLEN), rows, offs_k, stride_kn, stride_kd,
                      m, HEAD_D, FEATURE)


@triton.jit
def _dv_kernel(
    Q, K, G, Den, Delta, GDen, dHs, dV, Cu, ChunkOff,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_gb, stride_gh, stride_gn, stride_gd,
    stride_hb, stride_hh, stride_ht,
    H, N, M, eps, scale,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, FEATURE: tl.constexpr,
    CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr, HAS_GDEN: tl.constexpr,
    LOWP: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dv of key chunk t, Dv-block iv: dHs[t]ᵀ φk_j + Σ_{i>=j in chunk} r_i (φq_i·φk_j) g_i.
    Output contiguous [B, H, M, Dv] ([H, total, Dv] with VARLEN, as in _dk_kernel)."""
    t, iv, h, b, rows, offs_v = _program_tiles(CHUNK, HEAD_DV, BLOCK_V)
    row0, n, tc = _sequence_chunk(Cu, ChunkOff, b, t, N, VARLEN)
    m = _sequence(Cu, b, M, VARLEN)[1]
    if VARLEN:
        if t * CHUNK >= n:  # the grid covers the longest sequence
            return
    q_base = Q + b * stride_qb + h * stride_qh + row0 * stride_qn
    k_base = K + b * stride_kb + h * stride_kh + row0 * stride_kn
    h_base = dHs + b * stride_hb + h * stride_hh + tc * stride_ht

    acc = tl.zeros([CHUNK, BLOCK_V], dtype=tl.float32)
    pt = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # pt[j, i] = φk_j · φq_i
    for k0 in range(0, HEAD_D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        phik, _ = _load_phi(k_base, rows, offs_k, stride_kn, stride_kd, m, HEAD_D, FEATURE)
        dstate = _load_state(h_base, offs_k, offs_v, HEAD_D, HEAD_DV)
        acc = _dot_state(phik, dstate, acc, LOWP)
        if CAUSAL:
            phiq, _ = _load_phi(q_base, rows, offs_k, stride_qn, stride_qd, n, HEAD_D, FEATURE)
            pt = _dot_plain(phik, tl.trans(phiq), pt, LOWP)
    if CAUSAL:
        r, _ = _row_factors(Den, Delta, GDen, _vector_base(b, h, H, N, row0, VARLEN), rows, n,
                            eps, scale, NORMALIZE, False)
        pt = tl.where(_chunk_causal(CHUNK, True), pt * r[None, :], 0.0)
        g = _load_raw(G + b * stride_gb + h * stride_gh + row0 * stride_gn, rows, offs_v,
                      stride_gn, stride_gd, n, HEAD_DV)
        acc = _dot_state(pt, g, acc, LOWP)
    _store_rows(dV, acc, _vector_base(b, h, H, M, row0, VARLEN), rows, offs_v, m, HEAD_DV)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

_KERNELS = {
    "state_fwd": (_state_fwd_kernel, "state"),
    "state_bwd": (_state_bwd_kernel, "state"),
    "output": (_output_kernel, "chunk"),
    "dq": (_dq_kernel, "chunk"),
    "dk": (_dk_kernel, "chunk"),
    "dv": (_dv_kernel, "chunk"),
}


@functools.lru_cache(maxsize=None)
def _autotuned(name: str, head_dim: int, value_dim: int):
    fn, kind = _KERNELS[name]
    return triton.autotune(configs=configs_for(kind, head_dim, value_dim), key=_TUNE_KEY)(fn)


# Autotuning is opt-in for this family (ATTNKIT_LINEAR_AUTOTUNE=1).  On an H100 (triton 3.6,
# torch 2.11, 2026-11-26) every *autotuned* bfloat16 backward of the shapes B=1, H=2 with
# (N, D, Dv) = (7, 16, 32), (2049, 32, 48) and (300, 64, 64) + an initial state made an illegal
# memory access, while the same calls ran clean with any single config of the lists forced on all
# six kernels (each in a fresh process; .ci/gpu_diag_linear.py).  The interpreter, with every
# tensor -- the launchers' own buffers too -- against inaccessible pages, finds no out-of-range
# access for any config (tests/kernels/test_triton_bounds.py).  Until `.ci/gpu --diag` pins the
# fault down, the GPU runs one fixed config per dtype, the first of the lists (64 x 64 blocks,
# 8 warps, 2 stages: ptxas fits it without spills in 16-bit) or 32 x 32 / 4 warps for float32
# (3xTF32 doubles the operand registers), both of which ran clean in those probes.
AUTOTUNE = os.environ.get("ATTNKIT_LINEAR_AUTOTUNE", "0") == "1"


def default_config(dtype: torch.dtype):
    """The fixed config the GPU launches use when autotuning is off (see AUTOTUNE).

    float16 runs float32's config: its state products are 3xTF32 like float32's, and with the
    bfloat16 config (64 x 64, 8 warps) the causal float16 dq / dk came out ~100x the float16
    reference's error on an H100 (1.2e-1 vs 1.0e-3, .ci/gpu_diag_linear.py --f16, 2026-11-26;
    non-causal, dv and out were fine), while the float32 runs of that config passed."""
    return _cfg(64, 64, 8, 2) if dtype == torch.bfloat16 else _cfg(32, 32, 4, 2)


def _launch(name, grid, args, consts, config, head_dim, value_dim):
    """Run kernel ``name``: with ``config`` (clamped to the head dims), else autotuned when
    AUTOTUNE, else with :func:`default_config` of the inputs' dtype (every kernel's first
    argument is q or k); the first candidate when interpreted.  ``grid(BLOCK_K, BLOCK_V)`` gives
    the launch grid."""
    fn, kind = _KERNELS[name]
    if config is None and not AUTOTUNE and not INTERPRETED:
        config = default_config(args[0].dtype)
    if config is not None:
        config = _clamp(config, head_dim, value_dim)
    launch(fn, lambda: _autotuned(name, head_dim, value_dim),
           lambda: configs_for(kind, head_dim, value_dim), grid, args, consts, config,
           names=_TILE_NAMES)


def _check_device(fn: str, t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRETED):
        raise RuntimeError(
            f"{fn}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"attnkit.kernels.linear is imported, for CPU tensors); got a {t.device.type} tensor")


def _check_inputs(fn, q, k, v, causal, feature_map, chunk):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D [B, H, L, D]; got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}")
    B, H, N, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H):
        raise ValueError(f"{fn}: q, k, v must share [B, H]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{fn}: k and v must have the same length; got {k.shape[2]} and "
                         f"{v.shape[2]}")
    if k.shape[3] != D:
        raise ValueError(f"{fn}: k head dim must equal q's ({D}); got {k.shape[3]}")
    if D < 1 or v.shape[3] < 1:
        raise ValueError(f"{fn}: head dims must be >= 1; got D={D}, Dv={v.shape[3]}")
    if causal and k.shape[2] != N:
        raise ValueError(f"{fn}: causal needs M == N; got N={N}, M={k.shape[2]}")
    if feature_map not in _FEATURE_CODE:
        raise ValueError(f"{fn}: feature_map must be one of {', '.join(map(repr, FEATURE_MAPS))};"
                         f" got {feature_map!r}")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)
                              or chunk not in (16, 32, 64, 128)):
        raise ValueError(f"{fn}: chunk must be 16, 32, 64 or 128; got {chunk!r}")
    _check_device(fn, q)


def _check_state(fn, name, t, shape, device):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a tensor; got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name} must have shape {list(shape)}; got {list(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must be floating point; got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} must be on {device}; got {t.device}")
    return t.to(torch.float32).contiguous()


def _initial_state(fn, initial_state, B, H, D, Dv, device):
    if initial_state is None:
        return None, None
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError(f"{fn}: initial_state must be a pair (S [B, H, D, Dv], z [B, H, D]); "
                        f"got {type(initial_state).__name__}")
    s0 = _check_state(fn, "initial_state[0] (S)", initial_state[0], (B, H, D, Dv), device)
    z0 = _check_state(fn, "initial_state[1] (z)", initial_state[1], (B, H, D), device)
    if s0 is None or z0 is None:
        raise TypeError(f"{fn}: initial_state must hold two tensors (S, z)")
    return s0, z0


class _Rows:
    """Where the kernels find the rows of each sequence.

    Dense (``cu`` None): ``batch`` = B elements of N queries and M keys, tensors [B, H, L, *].
    Packed (the VARLEN build): the sequences of ``cu`` (int32 [batch + 1] on the device), each
    its own queries and keys; tensors are [1, H, total, *] views of the packed [total, H, *]
    with batch stride 0 (a program adds its sequence's first row itself), the kernels' N and M
    are the total, the per-chunk grids cover ``longest`` rows (programs past their sequence
    return), and the causal chunk states of all sequences share one [1, H, chunks, D, Dv]
    buffer: sequence b's at ``chunk_off[b]``, a running count taken on the device (no host read
    of the offsets here), ``chunks`` an upper bound that needs none either."""

    def __init__(self, batch, n, m, cu=None, longest=0, chunk=DEFAULT_CHUNK):
        self.batch, self.n, self.m, self.cu, self.chunk = batch, n, m, cu, chunk
        self.varlen = cu is not None
        self.longest = longest if self.varlen else n
        if self.varlen:
            lengths = (cu[1:] - cu[:-1]).to(torch.int64)
            per_sequence = torch.div(lengths + (chunk - 1), chunk, rounding_mode="floor")
            self.chunk_off = torch.cat([per_sequence.new_zeros(1), per_sequence.cumsum(0)]).to(torch.int32)
            # Σ ceil(n_b / C) <= (total + batch (C - 1)) / C
            self.chunks = (n + batch * (chunk - 1)) // chunk

    def strides(self, x):
        """x's strides as the kernels take them: batch stride 0 when packed."""
        return (0, *x.stride()[1:]) if self.varlen else x.stride()

    def offsets(self, stand_in):
        """(Cu, ChunkOff) kernel arguments: stand-in pointers when dense (never read)."""
        return (self.cu, self.chunk_off) if self.varlen else (stand_in, stand_in)

    def state_buffers(self, causal, H, D, Dv, S, Z):
        """(Hs, Zs, Hs strides (b, h, t), Zs strides (b, h, t)): per-chunk buffers when causal;
        else the totals S, Z themselves, read by every chunk (chunk stride 0)."""
        if causal:
            lead, nt = (1, self.chunks) if self.varlen else (self.batch, cdiv(self.m, self.chunk))
            hs = torch.empty((lead, H, nt, D, Dv), dtype=torch.float32, device=S.device)
            zs = torch.empty((lead, H, nt, D), dtype=torch.float32, device=S.device)
            hst, zst = hs.stride()[:3], zs.stride()[:3]
            if self.varlen:
                hst, zst = (0, *hst[1:]), (0, *zst[1:])
            return hs, zs, hst, zst
        return S, Z, (S.stride(0), S.stride(1), 0), (Z.stride(0), Z.stride(1), 0)


def _run_state_fwd(k, v, s0, z0, S, Z, rows, causal, feature, lowp, C, config):
    """Forward states: S_final / Z_final into S, Z; returns the chunk-state buffers."""
    H, D, Dv = k.shape[1], k.shape[3], v.shape[3]
    hs, zs, hst, zst = rows.state_buffers(causal, H, D, Dv, S, Z)
    has_init = s0 is not None
    args = (k, v, s0 if has_init else S, z0 if has_init else Z, hs, zs, S, Z, *rows.offsets(S),
            *rows.strides(k), *rows.strides(v), *hst, *zst, H, rows.m, cdiv(rows.m, C))
    consts = dict(HEAD_D=D, HEAD_DV=Dv, FEATURE=feature, HAS_INIT=has_init,
                  STORE_CHUNKS=bool(causal), LOWP=lowp, VARLEN=rows.varlen, CHUNK=C)
    _launch("state_fwd", lambda bk, bv: (cdiv(D, bk) * cdiv(Dv, bv), H, rows.batch),
            args, consts, config, D, Dv)
    return hs, zs, hst, zst


def _forward(q, k, v, out, S, Z, den, rows, s0, z0, *, causal, feature, lowp, normalize, eps,
             scale, C, config):
    """Both forward phases into the allocated out / S / Z / den (see linear_fwd)."""
    H, D, Dv = q.shape[1], q.shape[3], v.shape[3]
    hs, zs, hst, zst = _run_state_fwd(k, v, s0, z0, S, Z, rows, causal, feature, lowp, C, config)
    if rows.n == 0:
        return
    if rows.m == 0 and s0 is None:
        # Nothing to attend to: zeros whatever eps is (0 / eps would be NaN at eps = 0), as
        # the reference has it.
        out.zero_()
        den.zero_()
        return
    args = (q, k, v, hs, zs, out, den, *rows.offsets(S), *rows.strides(q), *rows.strides(k),
            *rows.strides(v), *rows.strides(out), *hst, *zst, H, rows.n, float(eps), float(scale))
    consts = dict(HEAD_D=D, HEAD_DV=Dv, FEATURE=feature, CAUSAL=bool(causal),
                  NORMALIZE=bool(normalize), LOWP=lowp, VARLEN=rows.varlen, CHUNK=C)
    _launch("output", lambda bk, bv: (cdiv(rows.longest, C) * cdiv(Dv, bv), H, rows.batch),
            args, consts, config, D, Dv)


def linear_fwd(q, k, v, *, causal, feature_map, normalize, eps, scale, initial_state=None,
               chunk=None, config=None):
    """Chunked linear attention forward; see the module docstring.

    Returns ``(out [B, H, N, Dv] in q.dtype, S_final [B, H, D, Dv] f32, z_final [B, H, D] f32,
    den [B, H, N] f32)``; ``den`` = φ(q_i)·z_i, raw (without eps, as the C++ op returns it),
    is what :func:`linear_bwd` needs besides ``out``.
    """
    fn = "linear_fwd"
    _check_inputs(fn, q, k, v, causal, feature_map, chunk)
    B, H, N, D = q.shape
    M, Dv = k.shape[2], v.shape[3]
    C = DEFAULT_CHUNK if chunk is None else chunk
    s0, z0 = _initial_state(fn, initial_state, B, H, D, Dv, q.device)
    slices = _flash.batch_slices(B)  # (every grid: (..., H, B)): past CUDA's limit, in slices
    if slices is not None:
        parts = [linear_fwd(q[sl], k[sl], v[sl], causal=causal, feature_map=feature_map, normalize=normalize,
                            eps=eps, scale=scale, initial_state=None if s0 is None else (s0[sl], z0[sl]),
                            chunk=chunk, config=config) for sl in slices]
        return tuple(torch.cat(results) for results in zip(*parts))
    out = torch.empty((B, H, N, Dv), dtype=q.dtype, device=q.device)
    S = torch.empty((B, H, D, Dv), dtype=torch.float32, device=q.device)
    Z = torch.empty((B, H, D), dtype=torch.float32, device=q.device)
    den = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    if B * H == 0:
        return out, S, Z, den
    _forward(q, k, v, out, S, Z, den, _Rows(B, N, M, chunk=C), s0, z0, causal=causal,
             feature=_FEATURE_CODE[feature_map], lowp=_operand_code(q.dtype, N == 1 and M == 1),
             normalize=normalize, eps=eps, scale=scale, C=C, config=config)
    return out, S, Z, den


def _operand_code(dtype, one_token):
    """LOWP of the products: the dtype's, except for a single token (one query, one key):
    float32 operands, whatever the dtype.  The 16-bit operands round the token's score once more
    than the reference in that dtype does -- one float16 ulp of out past DESIGN.md's rule
    (session 29's random fuzzing: float16, elu, unnormalized, D = 3, Dv = 1: 4.35546875 against
    the true 4.35229 and the float16 reference's 4.3515625) -- and a single token's tiles are
    mostly padding: the 3xTF32 dots cost little there (not timed on a GPU)."""
    return _LOWP[torch.float32] if one_token else _LOWP[dtype]


def _backward(grad_out, q, k, v, out, den, dq, dk, dv, dS0, dz0, rows, s0, z0, gs, gz, gden, *,
              causal, feature, lowp, normalize, eps, scale, C, config):
    """The backward's kernels into the allocated dq / dk / dv / dS0 / dz0 (see linear_bwd;
    ``den`` float32 contiguous when ``normalize``, ``gden`` None = zero)."""
    H, D, Dv = q.shape[1], q.shape[3], v.shape[3]
    N, M = rows.n, rows.m
    eps, scale = float(eps), float(scale)
    # Forward chunk states (causal) or totals (non-causal), recomputed.
    S = torch.empty((rows.batch, H, D, Dv), dtype=torch.float32, device=q.device)
    Z = torch.empty((rows.batch, H, D), dtype=torch.float32, device=q.device)
    hs, zs, hst, zst = _run_state_fwd(k, v, s0, z0, S, Z, rows, causal, feature, lowp, C, config)

    # δ_i = g_i · out_i (normalize only; never read otherwise: stand-in pointers).  Packed, the
    # [1, H, total] rows are one batch element: the kernel is the dense one.
    if normalize:
        lead = 1 if rows.varlen else rows.batch
        delta = torch.empty((lead, H, N), dtype=torch.float32, device=q.device)
        if N > 0:
            block_r = 32
            wrap_triton(_delta_kernel)[(cdiv(N, block_r), H, lead)](
                grad_out, out, delta, *grad_out.stride(), *out.stride(), H, N,
                HEAD_DV=Dv, BLOCK_R=block_r, BLOCK_V=min(pow2(Dv), 128))
    else:
        den = delta = dS0
    has_gden = gden is not None
    if gden is None:
        gden = dS0  # stand-in, HAS_GDEN=False

    # Reverse states over the queries: per chunk (causal) or the total, which is dS0 / dz0.
    dhs, dzs, dhst, dzst = rows.state_buffers(causal, H, D, Dv, dS0, dz0)
    offsets = rows.offsets(dS0)
    args = (q, grad_out, den, delta, gden, gs if gs is not None else dS0,
            gz if gz is not None else dz0, dhs, dzs, dS0, dz0, *offsets,
            *rows.strides(q), *rows.strides(grad_out), *dhst, *dzst, H, N, cdiv(N, C), eps, scale)
    consts = dict(HEAD_D=D, HEAD_DV=Dv, FEATURE=feature, NORMALIZE=normalize,
                  HAS_GDEN=has_gden, HAS_GS=gs is not None, HAS_GZ=gz is not None,
                  STORE_CHUNKS=bool(causal), LOWP=lowp, VARLEN=rows.varlen, CHUNK=C)
    _launch("state_bwd", lambda bk, bv: (cdiv(D, bk) * cdiv(Dv, bv), H, rows.batch),
            args, consts, config, D, Dv)

    common = dict(HEAD_D=D, HEAD_DV=Dv, FEATURE=feature, CAUSAL=bool(causal),
                  NORMALIZE=normalize, HAS_GDEN=has_gden, LOWP=lowp, VARLEN=rows.varlen, CHUNK=C)
    strides = (*rows.strides(q), *rows.strides(k), *rows.strides(v), *rows.strides(grad_out))
    longest_q = rows.longest if rows.varlen else N
    longest_k = rows.longest if rows.varlen else M
    if N > 0:
        args = (q, k, v, grad_out, den, delta, gden, hs, zs, dq, *offsets, *strides, *hst, *zst,
                H, N, eps, scale)
        _launch("dq", lambda bk, bv: (cdiv(longest_q, C) * cdiv(D, bk), H, rows.batch),
                args, common, config, D, Dv)
    if M > 0:
        args = (q, k, v, grad_out, den, delta, gden, dhs, dzs, dk, *offsets, *strides, *dhst,
                *dzst, H, N, M, eps, scale)
        _launch("dk", lambda bk, bv: (cdiv(longest_k, C) * cdiv(D, bk), H, rows.batch),
                args, common, config, D, Dv)
        args = (q, k, grad_out, den, delta, gden, dhs, dv, *offsets, *rows.strides(q),
                *rows.strides(k), *rows.strides(grad_out), *dhst, H, N, M, eps, scale)
        _launch("dv", lambda bk, bv: (cdiv(longest_k, C) * cdiv(Dv, bv), H, rows.batch),
                args, common, config, D, Dv)


def linear_bwd(grad_out, q, k, v, *, causal, feature_map, normalize, eps, scale,
               initial_state=None, grad_S=None, grad_z=None, grad_den=None, out=None, den=None,
               chunk=None, config=None):
    """Chunked linear attention backward; see the module docstring.

    Returns ``(dq, dk, dv)`` (contiguous, the inputs' dtype), followed by ``(dS0, dz0)``
    (float32) when ``initial_state`` is given.  Upstream gradients, each None = zero:
    ``grad_out`` [B, H, N, Dv], ``grad_S`` [B, H, D, Dv] / ``grad_z`` [B, H, D] (of S_final /
    z_final) and ``grad_den`` [B, H, N] (of the raw ``den``).  ``out`` / ``den``: the forward's
    outputs, needed when ``normalize`` (recomputed when either is None).
    """
    fn = "linear_bwd"
    _check_inputs(fn, q, k, v, causal, feature_map, chunk)
    B, H, N, D = q.shape
    M, Dv = k.shape[2], v.shape[3]
    C = DEFAULT_CHUNK if chunk is None else chunk
    s0, z0 = _initial_state(fn, initial_state, B, H, D, Dv, q.device)
    gs = _check_state(fn, "grad_S", grad_S, (B, H, D, Dv), q.device)
    gz = _check_state(fn, "grad_z", grad_z, (B, H, D), q.device)
    gden = _check_state(fn, "grad_den", grad_den, (B, H, N), q.device)
    grad_out = _grad_out(fn, grad_out, (B, H, N, Dv), q)
    normalize = bool(normalize)
    slices = _flash.batch_slices(B)  # as linear_fwd's
    if slices is not None:
        def cut(x, sl):
            return None if x is None else x[sl]

        parts = [linear_bwd(grad_out[sl], q[sl], k[sl], v[sl], causal=causal, feature_map=feature_map,
                            normalize=normalize, eps=eps, scale=scale,
                            initial_state=None if s0 is None else (s0[sl], z0[sl]), grad_S=cut(gs, sl),
                            grad_z=cut(gz, sl), grad_den=cut(gden, sl), out=cut(out, sl), den=cut(den, sl),
                            chunk=chunk, config=config) for sl in slices]
        return tuple(torch.cat(results) for results in zip(*parts))
    if normalize and (out is None or den is None):
        out, _, _, den = linear_fwd(q, k, v, causal=causal, feature_map=feature_map,
                                    normalize=True, eps=eps, scale=scale,
                                    initial_state=initial_state, chunk=chunk, config=config)
    if normalize:
        if tuple(out.shape) != (B, H, N, Dv) or tuple(den.shape) != (B, H, N):
            raise ValueError(f"{fn}: out / den must have shapes {[B, H, N, Dv]} / {[B, H, N]};"
                             f" got {list(out.shape)} / {list(den.shape)}")
        den = den.to(torch.float32).contiguous()

    dq = torch.empty((B, H, N, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H, M, D), dtype=q.dtype, device=q.device)
    dv = torch.empty((B, H, M, Dv), dtype=q.dtype, device=q.device)
    dS0 = torch.empty((B, H, D, Dv), dtype=torch.float32, device=q.device)
    dz0 = torch.empty((B, H, D), dtype=torch.float32, device=q.device)
    result = (dq, dk, dv, dS0, dz0) if s0 is not None else (dq, dk, dv)
    if B * H == 0:
        return result
    if M == 0 and s0 is None:
        # The forward's output and den are identically zero (see linear_fwd) and there are no
        # keys: nothing flows back (and 1/(den + eps) would be 1/0 at eps = 0).
        dq.zero_()
        return result
    _backward(grad_out, q, k, v, out, den, dq, dk, dv, dS0, dz0, _Rows(B, N, M, chunk=C), s0, z0, gs, gz,
              gden, causal=causal, feature=_FEATURE_CODE[feature_map], lowp=_LOWP[q.dtype],
              normalize=normalize, eps=eps, scale=scale, C=C, config=config)
    return result


def _grad_out(fn, grad_out, shape, q):
    """grad_out of the expected shape in q's dtype (zeros for None)."""
    if grad_out is None:
        return torch.zeros(shape, dtype=q.dtype, device=q.device)
    if not isinstance(grad_out, torch.Tensor) or tuple(grad_out.shape) != tuple(shape):
        raise ValueError(f"{fn}: grad_out must have shape {list(shape)}; got "
                         f"{list(getattr(grad_out, 'shape', ()))}")
    return grad_out.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# packed sequences (linear_attention_varlen)
# ----------------------------------------------------------------------------------------------


def _check_pack(fn, q, k, v, cu_seqlens, max_seqlen, causal, feature_map, chunk):
    """The packed inputs: q, k [total, H, D], v [total, H, Dv]; cu_seqlens int32 / int64
    [batch + 1] on their device; max_seqlen an int >= 0.  The offsets' values are not read
    here (the public function checks them): wrong ones read and write out of range."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{fn}: {name} must be a 3-D tensor [total, H, *]; got "
                             f"{tuple(getattr(t, 'shape', ())) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
        raise ValueError(f"{fn}: q, k, v must share [total, H]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32 / int64 tensor [batch + 1]; got "
                         f"{cu_seqlens!r}"[:300])
    if cu_seqlens.device != q.device:
        raise ValueError(f"{fn}: cu_seqlens must be on q's device ({q.device}); got {cu_seqlens.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{fn}: max_seqlen must be an int >= 0; got {max_seqlen!r}")
    as_batch = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    _check_inputs(fn, *as_batch, causal, feature_map, chunk)
    return as_batch


def linear_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, *, causal, feature_map, normalize, eps,
                      scale, initial_state=None, chunk=None, config=None):
    """Linear attention over packed sequences in one launch per kernel (the kernels' VARLEN
    build): sequence b is rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of q, k and v, its own
    queries and keys, its states starting from zero; ``max_seqlen`` its longest length (sizes
    the grid).

    q, k [total, H, D], v [total, H, Dv] (any strides); cu_seqlens int32 / int64 [batch + 1] on
    q's device; ``initial_state`` ``(S0 [batch, H, D, Dv], z0 [batch, H, D])`` (read as float32):
    sequence b's states start from S0[b], z0[b].  Returns ``(out [total, H, Dv] in q.dtype,
    S_final [batch, H, D, Dv] f32, z_final [batch, H, D] f32, den [H, total] f32)`` -- each
    sequence's values exactly those of :func:`linear_fwd` on it alone (same chunking and tiles),
    its final states included.
    """
    fn = "linear_varlen_fwd"
    q4, k4, v4 = _check_pack(fn, q, k, v, cu_seqlens, max_seqlen, causal, feature_map, chunk)
    total, H, D = q.shape
    Dv, batch = v.shape[2], cu_seqlens.numel() - 1
    C = DEFAULT_CHUNK if chunk is None else chunk
    s0, z0 = _initial_state(fn, initial_state, batch, H, D, Dv, q.device)
    out = torch.empty((total, H, Dv), dtype=q.dtype, device=q.device)
    S = torch.zeros((batch, H, D, Dv), dtype=torch.float32, device=q.device)
    Z = torch.zeros((batch, H, D), dtype=torch.float32, device=q.device)
    den = torch.empty((1, H, total), dtype=torch.float32, device=q.device)
    if batch * H == 0:
        return out, S, Z, den[0]
    if total == 0:  # sequences without rows: their states are the initial ones
        if s0 is not None:
            S.copy_(s0)
            Z.copy_(z0)
        return out, S, Z, den[0]
    rows = _Rows(batch, total, total, cu=cu_seqlens.to(torch.int32), longest=max_seqlen, chunk=C)
    _forward(q4, k4, v4, out.transpose(0, 1).unsqueeze(0), S, Z, den, rows, s0, z0,
             causal=causal, feature=_FEATURE_CODE[feature_map],
             lowp=_operand_code(q.dtype, max_seqlen == 1), normalize=normalize, eps=eps,
             scale=scale, C=C, config=config)
    return out, S, Z, den[0]


def linear_varlen_bwd(grad_out, q, k, v, cu_seqlens, max_seqlen, *, causal, feature_map,
                      normalize, eps, scale, initial_state=None, grad_S=None, grad_z=None, out=None,
                      den=None, chunk=None, config=None):
    """Backward of :func:`linear_varlen_fwd`: ``(dq, dk, dv)`` as [total, H, *] views of
    contiguous [H, total, *] buffers, the inputs' dtype, followed by ``(dS0, dz0)`` (float32)
    when ``initial_state`` is given.  ``grad_out`` [total, H, Dv], ``grad_S`` [batch, H, D, Dv],
    ``grad_z`` [batch, H, D] (of out / S_final / z_final; None = zero); ``out`` [total, H, Dv] /
    ``den`` [H, total]: the forward's, needed when ``normalize`` (recomputed when either is
    None)."""
    fn = "linear_varlen_bwd"
    q4, k4, v4 = _check_pack(fn, q, k, v, cu_seqlens, max_seqlen, causal, feature_map, chunk)
    total, H, D = q.shape
    Dv, batch = v.shape[2], cu_seqlens.numel() - 1
    C = DEFAULT_CHUNK if chunk is None else chunk
    s0, z0 = _initial_state(fn, initial_state, batch, H, D, Dv, q.device)
    gs = _check_state(fn, "grad_S", grad_S, (batch, H, D, Dv), q.device)
    gz = _check_state(fn, "grad_z", grad_z, (batch, H, D), q.device)
    grad_out = _grad_out(fn, grad_out, (total, H, Dv), q)
    normalize = bool(normalize)
    if normalize and (out is None or den is None):
        out, _, _, den = linear_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, causal=causal,
                                           feature_map=feature_map, normalize=True, eps=eps,
                                           scale=scale, initial_state=initial_state, chunk=chunk,
                                           config=config)
    if normalize:
        if tuple(out.shape) != (total, H, Dv) or tuple(den.shape) != (H, total):
            raise ValueError(f"{fn}: out / den must have shapes {[total, H, Dv]} / {[H, total]};"
                             f" got {list(out.shape)} / {list(den.shape)}")
        den = den.to(torch.float32).contiguous().unsqueeze(0)
        out = out.transpose(0, 1).unsqueeze(0)
    grads = [torch.empty((1, H, total, width), dtype=q.dtype, device=q.device)
             for width in (D, D, Dv)]
    dS0 = torch.empty((batch, H, D, Dv), dtype=torch.float32, device=q.device)
    dz0 = torch.empty((batch, H, D), dtype=torch.float32, device=q.device)
    if batch * H > 0 and total > 0:
        rows = _Rows(batch, total, total, cu=cu_seqlens.to(torch.int32), longest=max_seqlen,
                     chunk=C)
        _backward(grad_out.transpose(0, 1).unsqueeze(0), q4, k4, v4, out, den, *grads, dS0, dz0,
                  rows, s0, z0, gs, gz, None, causal=causal,
                  feature=_FEATURE_CODE[feature_map], lowp=_LOWP[q.dtype], normalize=normalize,
                  eps=eps, scale=scale, C=C, config=config)
    else:  # no rows: the initial state reaches the final one unchanged
        dS0.copy_(gs) if gs is not None else dS0.zero_()
        dz0.copy_(gz) if gz is not None else dz0.zero_()
    result = tuple(g[0].transpose(0, 1) for g in grads)
    return result + (dS0, dz0) if s0 is not None else result

"""Pieces shared by the flash-style Triton kernels (kernels/softmax.py, kernels/sparse.py; the
host helpers also serve kernels/hopfield.py and kernels/linear.py).

Device side: ``@triton.jit`` helpers for one step of the tile loop -- row-tile loads and stores,
base-2 scores, the online-softmax update, the forward's finish, the backward's row statistics
and its dQ / dK accumulations, and tanh from exp2 (:func:`tanh_exp2`, :func:`tanh_and_grad`,
for the softmax kernels' softcap).  Triton inlines them into the calling kernel, so splitting a
kernel into these costs nothing at run time.  Host side: the plain-Python launcher plumbing
(config lists, strides, dot precision, autotune-or-fixed-config launch).

Conventions (as in both kernel files): a tile of rows is ``[BM, BLOCK_D]`` with the head dim
padded to ``BLOCK_D`` (a power of two >= 16) and the columns past ``HEAD_D`` masked; scores are
base 2 (``s * scale * log2(e)``) and the stored lse is in natural log.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.runtime.errors import OutOfResources

# The tile helpers pad head dims to a power of two up to this and take these input dtypes
# (float32 accumulation); both kernel files export them.
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def load_2d(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Bounds checks only where a tile can run past the tensor, so that full tiles load unmasked.
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif CHECK_COLS:
        x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def load_rows(base, rows, stride_n, offs_d, stride_d, row_ok, HEAD_D: tl.constexpr,
              BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Rows ``rows`` [R] of a [*, HEAD_D] matrix at ``base`` -> [R, BLOCK_D], zeros where
    masked (rows with row_ok False when CHECK_ROWS; columns past HEAD_D)."""
    return load_2d(base + rows[:, None] * stride_n + offs_d[None, :] * stride_d, row_ok,
                   offs_d < HEAD_D, CHECK_ROWS, BLOCK_D != HEAD_D)


@triton.jit
def load_row_pair(a_base, b_base, rows, row_ok, stride_an, stride_ad, stride_bn, stride_bd,
                  offs_d, offs_dv, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """The same rows of two matrices (k and v, or q and dO): ``([R, BLOCK_D], [R, BLOCK_DV])``."""
    a = load_rows(a_base, rows, stride_an, offs_d, stride_ad, row_ok, HEAD_D, BLOCK_D,
                  CHECK_ROWS)
    b = load_rows(b_base, rows, stride_bn, offs_dv, stride_bd, row_ok, HEAD_DV, BLOCK_DV,
                  CHECK_ROWS)
    return a, b


@triton.jit
def store_rows(base, rows, stride_n, offs_d, stride_d, row_ok, x, HEAD_D: tl.constexpr):
    """Store x [R, BLOCK_D] (cast to the target's dtype) into rows ``rows`` at ``base``."""
    ptrs = base + rows[:, None] * stride_n + offs_d[None, :] * stride_d
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))


@triton.jit
def scores(a, b, qk_scale, DOT_PREC: tl.constexpr):
    """Base-2 scores a @ b^T * qk_scale (qk_scale = scale * log2(e)): [A, B] float32."""
    return tl.dot(a, tl.trans(b), input_precision=DOT_PREC) * qk_scale


@triton.jit
def online_softmax_update(s, m_i, l_i):
    """Fold base-2 scores s [BM, BN] (-inf = masked) into the running row max m_i and sum l_i.
    Returns (p [BM, BN] = exp2(s - m_new), alpha [BM] = rescale of the old state, l_new, m_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # While a row has seen only -inf scores its max is -inf; shifting by 0 instead keeps
    # exp2 at 0 rather than exp2(-inf - -inf) = NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def accumulate_pv(acc, alpha, p, v, DOT_PREC: tl.constexpr):
    """acc [BM, Dv] rescaled by alpha, plus p @ v."""
    acc = acc * alpha[:, None]
    return tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr):
    """One flash step on base-2 scores s [BM, BN] (-inf = masked) and values v [BN, Dv]."""
    p, alpha, l_i, m_new = online_softmax_update(s, m_i, l_i)
    acc = accumulate_pv(acc, alpha, p, v, DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def finish_rows(acc, l_i, m_i):
    """(out, lse in natural log); rows that saw no key: 0 and -inf; a row with a NaN or +inf
    score: NaN and NaN, as SDPA (issue 15)."""
    # l_i >= 1 iff the row saw a finite score (its maximum contributes exp2(0) = 1); l_i = 0 iff
    # it saw no key.  A NaN / +inf score makes l_i NaN, which must not count as "no key" (the
    # backward would then give the row zero gradients): test l_i != 0, not l_i > 0.
    attended = l_i != 0.0
    l_safe = tl.where(attended, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(attended, (m_i + tl.math.log2(l_safe)) * _LN2, float("-inf"))
    return out, lse


@triton.jit
def fold_sink(acc, l_i, m_i, sink, LOG2_SCALE: tl.constexpr):
    """(acc, l, m) of online-softmax rows with one more logit ``sink`` of value 0 -- a learned
    sink (issue 28) -- folded in before the rows are finished and rounded: one rounding of a
    16-bit row, where adding it to the finished (out, lse) would round twice.

    ``m_i`` and ``sink`` (a scalar or one per row) in the same log base: base 2 with
    ``LOG2_SCALE`` 1.0 (the kernels' running max), natural with ``LOG2_SCALE`` log2(e) (the
    decode merges).  A row that saw no key gets l = 1 and m = the sink (out 0, lse = the sink);
    with a -inf sink too, out 0 and lse -inf.  A NaN row or sink stays NaN, and a +inf sink
    gives out 0, lse +inf (as :func:`attnkit.score_options.add_sinks`): the sink's own weight is
    exactly 1 whenever it is the new max (+inf included), never exp2(inf - inf)."""
    top = tl.maximum(m_i, sink)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    keys = tl.math.exp2((m_i - top_safe) * LOG2_SCALE)
    sink_w = tl.where(sink == top, 1.0, tl.math.exp2((sink - top_safe) * LOG2_SCALE))
    return acc * keys[:, None], l_i * keys + sink_w, top


@triton.jit
def finish_rows_sink(acc, l_i, m_i, sink):
    """:func:`finish_rows` of base-2 rows with the learned sink ``sink`` (natural log; a scalar
    or one per row) folded in (:func:`fold_sink`); a row that saw no key gets lse = the sink
    exactly, not its round trip through base 2."""
    seen = l_i != 0.0
    acc, l_i, m_i = fold_sink(acc, l_i, m_i, sink * _LOG2E, 1.0)
    out, lse = finish_rows(acc, l_i, m_i)
    return out, tl.where(seen, lse, sink)


@triton.jit
def load_row_stats(lse_base, delta_base, rows, row_ok):
    """(lse in base 2, delta) of the rows: what the backward needs to rebuild p and dS."""
    lse = tl.load(lse_base + rows, mask=row_ok, other=float("inf"))
    # Rows with lse = -inf saw no key: +inf makes every p of the row exp2(-inf) = 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def load_bwd_rows(q_base, do_base, lse_base, delta_base, rows, row_ok, stride_qn, stride_qd,
                  stride_gn, stride_gd, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Everything the backward reads of a query tile: (q [R, BLOCK_D], dO [R, BLOCK_DV], lse in
    base 2, delta).  Rows with row_ok False read q = dO = 0, lse2 = +inf, delta = 0."""
    q, do = load_row_pair(q_base, do_base, rows, row_ok, stride_qn, stride_qd, stride_gn,
                          stride_gd, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), HEAD_D,
                          HEAD_DV, BLOCK_D, BLOCK_DV, True)
    lse2, delta = load_row_stats(lse_base, delta_base, rows, row_ok)
    return q, do, lse2, delta


@triton.jit
def dq_step(dq, p, dp, delta, k, visible, DOT_PREC: tl.constexpr):
    """dq += dS @ k with dS = p * (dP - delta) on the visible entries, exactly 0 on the hidden
    ones ([queries, keys] tiles): 0 * (dP - delta) would carry a NaN row's delta to keys the row
    cannot see (issue 15)."""
    ds = tl.where(visible, p * (dp - delta[:, None]), 0.0)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)


@triton.jit
def dk_step(dk, p_t, dp_t, delta, q, visible_t, DOT_PREC: tl.constexpr):
    """dk += dS^T @ q with dS^T = p^T * (dP^T - delta), 0 where hidden (transposed [keys,
    queries] tiles; see dq_step)."""
    ds_t = tl.where(visible_t, p_t * (dp_t - delta[None, :]), 0.0)
    return tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)


_M2LOG2E = tl.constexpr(-2.0 * 1.4426950408889634)  # exp(-2|x|) = exp2(|x| * _M2LOG2E)


@triton.jit
def _tanh_parts(x):
    """(tanh(x), e = exp(-2|x|)) in float32 from exp2: tanh|x| = (1 - e) / (1 + e) with e in
    [0, 1] (never overflows), and below |x| = 0.1, where 1 - e cancels, the series
    x - x^3/3 + 2x^5/15 (relative error < 6e-8).  tanh(+-inf) = +-1; NaN stays NaN."""
    ax = tl.abs(x)
    # exp(-2 * 64) is 0 in float32 already; the cap keeps ax * _M2LOG2E finite (NaN stays NaN)
    e = tl.math.exp2(tl.where(ax > 64.0, 64.0, ax) * _M2LOG2E)
    xs = tl.minimum(ax, 0.1)  # the series is only used below 0.1 (and x * x may overflow)
    x2 = xs * xs
    small = xs * (1.0 + x2 * (-0.3333333333333333 + x2 * 0.13333333333333333))
    t = tl.where(ax < 0.1, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t), e


@triton.jit
def tanh_exp2(x):
    """tanh(x) (float32) for Triton versions without ``tl.tanh``; see _tanh_parts."""
    t, e = _tanh_parts(x)
    return t


@triton.jit
def tanh_and_grad(x):
    """(tanh(x), 1 - tanh(x)^2), the derivative as 4e / (1 + e)^2 with e = exp(-2|x|), which
    does not cancel where tanh is near +-1 (0 at +-inf, NaN for NaN)."""
    t, e = _tanh_parts(x)
    one_e = 1.0 + e
    return t, (4.0 * e) / (one_e * one_e)


@triton.jit
def option_scores(a, b, rows, cols, qk_scale, cap_in, cap_out, slope2, off,
                  HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, WANT_GRAD: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """Base-2 scores of a @ b^T with the score options, before any mask: ``(s, dcap)``.

    HAS_SOFTCAP: s = cap_out * tanh(raw * cap_in) with cap_in = scale / softcap and cap_out =
    softcap * log2(e) (the tanh acts on the natural-unit score scale * raw / softcap).  With
    WANT_GRAD, dcap = 1 - tanh^2 (d capped / d uncapped); otherwise dcap is s (never read).
    HAS_ALIBI: s -= slope2 * |cols - rows - off| (slope2 = slope * log2(e), off = M - N), i.e.
    the bias -slope * |i + M - N - j| in base 2.  ``rows`` / ``cols`` are query / key indices
    shaped to broadcast to the tile ([BM, 1] x [1, BN] or transposed)."""
    if HAS_SOFTCAP:
        raw = tl.dot(a, tl.trans(b), input_precision=DOT_PREC) * cap_in
        if WANT_GRAD:
            t, dcap = tanh_and_grad(raw)
        else:
            t = tanh_exp2(raw)
            dcap = t
        s = t * cap_out
    else:
        s = scores(a, b, qk_scale, DOT_PREC)
        dcap = s
    if HAS_ALIBI:
        s = s - slope2 * tl.abs(cols - rows - off).to(tl.float32)
    return s, dcap



# Under TRITON_INTERPRET=1, @triton.jit gives an interpreted function instead of a JITFunction;
# the autotuner cannot benchmark there (no GPU timers), so the launchers pick a config.
INTERPRETED = not isinstance(load_2d, triton.runtime.JITFunction)

# ----------------------------------------------------------------------------------------------
# host helpers (launchers)
# ----------------------------------------------------------------------------------------------


# The two tile sizes a launcher's configs carry: BLOCK_M x BLOCK_N here; other kernel files name
# them after their own loops (hopfield: BLOCK_S x BLOCK_N, linear: BLOCK_K x BLOCK_V) and pass
# ``names`` to cfg / fitting / launch.
TILE_NAMES = ("BLOCK_M", "BLOCK_N")


def cfg(block_m, block_n, num_warps, num_stages, names=TILE_NAMES):
    return triton.Config({names[0]: block_m, names[1]: block_n}, num_warps=num_warps,
                         num_stages=num_stages)


def config_list(*tiles):
    """[triton.Config] from (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples."""
    return [cfg(*t) for t in tiles]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host code (grids, padding).  Not triton.cdiv / next_power_of_2: they
    are ConstexprFunctions since Triton 3.5, 4.8 us a call from Python on an AMD EPYC Zen 3 --
    several per launch, most of a launcher's own host time."""
    return -(-int(a) // int(b))


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (0 for 0, as triton.next_power_of_2), for the host code
    (see :func:`cdiv`)."""
    x = int(x)
    return 1 << (x - 1).bit_length() if x > 0 else 0


def pow2(x: int) -> int:
    # tl.dot needs every dimension >= 16 on GPUs, hence the floor.
    return max(16, next_pow2(x))


def fitting(configs, dmax, limit, names=TILE_NAMES):
    """The configs whose tile (BLOCK_M * BLOCK_N, or the two ``names``) * dmax stays within
    ``limit`` (registers), or the smallest tile when none does (never leave the autotuner
    empty-handed)."""
    def area(c):
        return c.kwargs[names[0]] * c.kwargs[names[1]]

    fit = [c for c in configs if area(c) * dmax <= limit]
    return fit or [min(configs, key=area)]


class ScoreOptionArgs(NamedTuple):
    """The score options of one launch, validated (:func:`score_option_args`)."""

    left: int  # window sides as given: -1 = unbounded, else >= 0
    right: int
    cap_in: float  # softcap: s = cap_out * tanh(raw * cap_in) in base 2 (0.0, 0.0 when off)
    cap_out: float
    alibi: torch.Tensor  # float32 [B, H] view (stride 0 over B for [H]); q as a stand-in when off
    alibi_strides: tuple
    consts: dict  # HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI


def _window_side(fn, name, x):
    if isinstance(x, bool):
        raise TypeError(f"{fn}: {name} must be an int >= -1 (-1 = unbounded); got {x!r}")
    try:
        x = operator.index(x)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int >= -1 (-1 = unbounded); got "
                        f"{type(x).__name__} {x!r}") from None
    if x < -1:
        raise ValueError(f"{fn}: {name} must be >= -1 (-1 = unbounded); got {x}")
    return x


def score_option_args(fn, q, B, H, scale, window_left, window_right, softcap, alibi_slopes) -> ScoreOptionArgs:
    """Validate a Triton launcher's score options (FlashAttention's: ``window_left`` /
    ``window_right`` ints >= -1, ``softcap`` a finite real >= 0 with 0.0 = off, ``alibi_slopes``
    None or float32 ``[H]`` / ``[B, H]`` on q's device) and turn them into kernel arguments for
    ``scale``; raises TypeError / ValueError saying what was expected and what came."""
    left = _window_side(fn, "window_left", window_left)
    right = _window_side(fn, "window_right", window_right)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"{fn}: softcap must be a real number (0.0 = off); got "
                        f"{type(softcap).__name__} {softcap!r}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"{fn}: softcap must be a finite number >= 0 (0.0 = off); got {softcap}")
    has_softcap = softcap > 0.0
    # s = softcap * tanh(scale * q.k / softcap), in base 2: tanh(raw * cap_in) * cap_out
    cap_in = scale / softcap if has_softcap else 0.0
    cap_out = softcap / math.log(2.0) if has_softcap else 0.0

    if alibi_slopes is None:
        alibi, alibi_strides = q, (0, 0)  # q is a stand-in pointer; HAS_ALIBI=0 never reads it
    else:
        if not torch.is_tensor(alibi_slopes):
            raise TypeError(f"{fn}: alibi_slopes must be a float32 tensor [B, H] or [H]; got "
                            f"{type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"{fn}: alibi_slopes must be float32; got {alibi_slopes.dtype}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"{fn}: alibi_slopes must be on q's device ({q.device}); got "
                             f"{alibi_slopes.device}")
        try:
            if alibi_slopes.dim() > 2:
                raise RuntimeError
            alibi = alibi_slopes.detach().expand(B, H)  # a view: [H] -> stride 0 over B
        except RuntimeError:
            raise ValueError(f"{fn}: alibi_slopes of shape {tuple(alibi_slopes.shape)} does "
                             f"not broadcast to [B, H] = {[B, H]}") from None
        alibi_strides = alibi.stride()
    consts = dict(HAS_WINDOW=left >= 0 or right >= 0, HAS_SOFTCAP=has_softcap,
                  HAS_ALIBI=alibi_slopes is not None)
    return ScoreOptionArgs(left, right, cap_in, cap_out, alibi, alibi_strides, consts)


def sink_args(fn, q, H, sinks) -> tuple:
    """``(pointer, HAS_SINKS)`` of a launcher's learned sinks (None, or float32 ``[H]`` on q's
    device; contiguous): q stands in for the pointer when there are none (never read)."""
    if sinks is None:
        return q, False
    if not torch.is_tensor(sinks):
        raise TypeError(f"{fn}: sinks must be a float32 tensor [H]; got {type(sinks).__name__}")
    if sinks.dtype != torch.float32:
        raise TypeError(f"{fn}: sinks must be float32; got {sinks.dtype}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(f"{fn}: sinks must have shape [H] = [{H}]; got {list(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{fn}: sinks must be on q's device ({q.device}); got {sinks.device}")
    return sinks.detach().contiguous(), True


def check_attention_shapes(fn: str, q, k, v, max_head_dim: int = MAX_HEAD_DIM, paged: bool = False) -> None:
    """The checks every attention launcher shares, for q [B, H, N, D], k [B, Hk, M, D],
    v [B, Hk, M, Dv]: one dtype, equal batches, k and v alike, k's head dim q's, H a multiple
    of Hk, head dims in 1..max_head_dim.  ``paged``: k and v are caches [num_blocks, Hk,
    block_size, *], whose first dim is not the batch.  Raises TypeError / ValueError naming ``fn``."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, _, D = q.shape
    if paged and k.shape[0] != v.shape[0]:
        raise ValueError(f"{fn}: the k and v caches must have the same number of blocks; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not paged and (k.shape[0] != B or v.shape[0] != B):
        raise ValueError(f"{fn}: batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"{fn}: k and v must have the same heads and length; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"{fn}: k head dim must equal q's ({D}); got {k.shape[3]}")
    if k.shape[1] == 0 or H % k.shape[1] != 0:
        raise ValueError(f"{fn}: query heads ({H}) must be a multiple of key/value heads "
                         f"({k.shape[1]})")
    for name, d in (("q/k head dim", D), ("v head dim", v.shape[3])):
        if not 1 <= d <= max_head_dim:
            raise ValueError(f"{fn}: {name} must be in 1..{max_head_dim}; got {d}")


def check_backward_inputs(fn: str, grad_out, out, lse, B: int, H: int, N: int, Dv: int) -> None:
    """A flash backward's saved tensors: grad_out and out [B, H, N, Dv], lse float32 [B, H, N]."""
    if tuple(grad_out.shape) != (B, H, N, Dv) or tuple(out.shape) != (B, H, N, Dv):
        raise ValueError(f"{fn}: grad_out and out must have shape {(B, H, N, Dv)}; got "
                         f"{tuple(grad_out.shape)} and {tuple(out.shape)}")
    if tuple(lse.shape) != (B, H, N) or lse.dtype != torch.float32:
        raise ValueError(f"{fn}: lse must be float32 of shape {(B, H, N)}; got "
                         f"{lse.dtype} {tuple(lse.shape)}")


def strides(t):
    return tuple(t.stride())


def dot_precision(dtype):
    # float32 inputs: full-precision products (TF32 would miss the 2e-5 accuracy target);
    # float16 / bfloat16 ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def split_config(config):
    """A backward's ``config``: None or one triton.Config for both kernels, or a pair
    ``(dkdv_config, dq_config)``."""
    if config is None or isinstance(config, triton.Config):
        return config, config
    return tuple(config)


# Autotuning on a GPU when a launcher gets no config.  Issue 26: the GPU test suite spent its
# minutes compiling every candidate of every autotune list (33 tests unreached in two 200 s runs
# on an H100, session 8), so tests/conftest.py sets ATTNKIT_TRITON_AUTOTUNE=0: numerics tests
# then run the first candidate of each list, and the tests marked ``autotune`` turn it back on
# with :func:`autotuning` (one per family).  Users and the benchmarks autotune (the default).
_AUTOTUNE = [os.environ.get("ATTNKIT_TRITON_AUTOTUNE", "1") != "0"]


def autotuning_enabled() -> bool:
    """Whether launches given no config autotune (GPU only; the interpreter never does)."""
    return _AUTOTUNE[0]


@contextlib.contextmanager
def autotuning(enabled: bool = True):
    """Within the block, launches given no config autotune (``True``) or run the first
    candidate of their list (``False``)."""
    previous, _AUTOTUNE[0] = _AUTOTUNE[0], bool(enabled)
    try:
        yield
    finally:
        _AUTOTUNE[0] = previous


def _launch_with(kernel, config, grid, args, consts, names):
    kw = dict(config.kwargs)
    meta = dict(kw, num_warps=config.num_warps, num_stages=config.num_stages)
    wrap_triton(kernel)[grid(kw[names[0]], kw[names[1]])](*args, **consts, **meta)


# (kernel, constexprs, tensor dtypes) -> index of the first candidate that compiled for it
_FIRST_FITTING: dict = {}


def _launch_first_fitting(kernel, configs, grid, args, consts, names):
    """Run the first of ``configs`` that compiles for this GPU.  The registers / shared-memory
    estimates of the lists are only estimates: on an H200 the first bfloat16 D = 256 forward
    candidate (128 x 64 tiles, 3 stages) ran out of shared memory, which the autotuner skips
    silently but a fixed-config launch raised (issue 26's GPU run, 2026-11-27)."""
    scalars = tuple(sorted((k, v) for k, v in consts.items()
                           if isinstance(v, (int, float, bool, str))))
    key = (kernel, scalars, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
    start = _FIRST_FITTING.get(key, 0)
    for i in range(start, len(configs)):
        try:
            _launch_with(kernel, configs[i], grid, args, consts, names)
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            continue
        _FIRST_FITTING[key] = i
        return


# CUDA's limit on a launch grid's y and z dims (x takes 2^31 - 1).  The launchers put the heads
# and the batch there (softmax: (query tiles, H, B); sparse, Hopfield: (..., B * H)), so a call
# past it failed on a GPU ("invalid argument") -- B * H = 65536 is B = 4096 sequences of 16
# heads.  Such calls run on slices of the batch (:func:`batch_slices`).
MAX_GRID_YZ = 65535


def batch_slices(batch: int, per_element: int = 1) -> list[slice] | None:
    """None when ``batch`` elements of ``per_element`` programs each fit one grid dim
    (``batch * per_element <= MAX_GRID_YZ``); else slices of at most ``MAX_GRID_YZ //
    per_element`` batch elements that cover the batch."""
    step = MAX_GRID_YZ // max(per_element, 1)
    if batch <= step:
        return None
    if step < 1:
        raise ValueError(f"{per_element} programs per batch element exceed CUDA's grid limit ({MAX_GRID_YZ})")
    return [slice(b0, min(b0 + step, batch)) for b0 in range(0, batch, step)]


def by_batch_slices(batched: int, per_element=lambda first: 1):
    """Decorator for a launcher whose first ``batched`` positional arguments are tensors with the
    batch as dim 0 (or None) and whose results -- a tensor or a tuple of tensors -- all have it as
    dim 0: a call whose grid would pass :data:`MAX_GRID_YZ` (``per_element(first argument)``
    programs per batch element on one grid dim) runs on batch slices, the results concatenated.
    Every other argument is passed unchanged to each slice."""
    def decorate(launcher):
        def run(*args, **kwargs):
            first = args[0]
            slices = batch_slices(first.shape[0], per_element(first)) if first.dim() else None
            if slices is None:
                return launcher(*args, **kwargs)
            parts = [launcher(*(a[sl] if i < batched and a is not None else a for i, a in enumerate(args)),
                              **kwargs) for sl in slices]
            if isinstance(parts[0], tuple):
                return tuple(torch.cat(results) for results in zip(*parts))
            return torch.cat(parts)

        run.__name__, run.__qualname__, run.__doc__ = launcher.__name__, launcher.__qualname__, launcher.__doc__
        run.__wrapped__ = launcher
        return run
    return decorate


def _within_limits(kernel, grid):
    """``grid`` checked against CUDA's limits when evaluated (a clear error instead of the
    driver's "invalid argument" at launch)."""
    def checked(*tiles):
        dims = grid(*tiles)
        if any(d > MAX_GRID_YZ for d in dims[1:]):
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
            raise ValueError(f"attnkit: {name}'s launch grid {tuple(dims)} passes CUDA's limit of {MAX_GRID_YZ} "
                             "on its y / z dims (the batch, or batch x heads): call it on slices of the batch")
        return dims
    return checked


def launch(kernel, autotuned, candidates, grid, args, consts, config, tune=True,
           names=TILE_NAMES):
    """Run ``kernel`` with ``config`` or, when None, through ``autotuned()`` (its
    ``triton.autotune`` wrapper).  Instead of autotuning: the first of ``candidates()`` when
    interpreted, and the first that compiles on a GPU when ``tune`` is False (a kernel that is
    not idempotent) or autotuning is off (:func:`autotuning`).  ``grid(BLOCK_M, BLOCK_N)`` (the
    two tile sizes ``names``) gives the launch grid; a grid past :data:`MAX_GRID_YZ` on its y / z
    dims raises ValueError (the launchers that can split their batch do so before: sparse,
    softmax, linear, Hopfield energy)."""
    grid = _within_limits(kernel, grid)
    if config is None and INTERPRETED:
        config = candidates()[0]
    if config is None and (not tune or not _AUTOTUNE[0]):
        _launch_first_fitting(kernel, candidates(), grid, args, consts, names)
    elif config is None:
        wrap_triton(autotuned())[lambda meta: grid(meta[names[0]], meta[names[1]])](*args,
                                                                                  **consts)
    else:
        _launch_with(kernel, config, grid, args, consts, names)

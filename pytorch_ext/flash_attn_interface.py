"""FlashAttention's Python interface on attnkit: ``flash_attn_func`` and its packed / varlen /
KV-cache siblings with FlashAttention 2's signatures (``flash_attn`` 2.6+, positional order
included; FlashAttention 3's ``flash_attn_interface`` orders its arguments differently -- no
``dropout_p`` -- so code written for it should pass keywords), layouts and semantics, on every
attnkit backend (so also on CPUs, with a backward).

Model code written against ``flash_attn`` switches with one import::

    from attnkit.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

What differs from attnkit's own ops, and is done here:

- **Layout.** FlashAttention's tensors are ``[B, N, H, D]`` (positions before heads) and its
  caches ``[B, max_len, Hk, D]`` / paged ``[num_blocks, block_size, Hk, D]``; attnkit's are
  ``[B, H, N, D]``.  Inputs go in as transposed views (no copy: the kernels take strides, and a
  cache is written in place through its view); outputs come back contiguous in FlashAttention's
  layout (one copy of the output, O(N H D), as FlashAttention returns them contiguous and model
  code ``.view``\\ s them).  The packed-sequence layout ``[total, H, D]`` is the same in both.
- **Causality is bottom-right** (query i sees keys ``<= i + M - N``; rows that see no key give
  0), where ``attnkit.softmax_attention``'s ``is_causal`` is SDPA's top-left: ``causal=True``
  becomes attnkit's ``window=(left, 0)`` -- or ``is_causal=True`` where the two agree (N == M;
  a varlen call whose ``cu_seqlens_q`` *is* ``cu_seqlens_k``), which keeps the fast paths that
  take no score options.
- ``window_size=(left, right)`` (-1, or any negative, = unbounded; ``causal`` sets right = 0),
  ``softcap`` (> 0 on, 0 off), ``alibi_slopes`` (``[H]`` or ``[B, H]`` float32) map to attnkit's
  score options of the same meaning; ``dropout_p`` to ``dropout_p``; ``softmax_scale`` to
  ``scale``; fewer key heads than query heads to ``enable_gqa=True``.
- ``deterministic=True`` runs the call's backward with ``torch.use_deterministic_algorithms``
  on (warn-only unless it was on already) and restores the previous setting after it: the GPU
  backward paths that add dQ by atomics take their deterministic kernels then (attnkit's CPU
  kernels are deterministic always).  Eager calls only: under torch.compile set
  ``torch.use_deterministic_algorithms(True)`` around the compiled step instead.
- ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: FlashAttention's third
  result (the dropout-encoded probabilities, "for testing only") is not materialized -- no
  attnkit kernel forms the N x M matrix.  ``softmax_lse`` is float32 ``[B, H, N]`` (varlen:
  ``[H, total_q]``, FlashAttention 2's); a row that sees no key has lse -inf (log 0; attnkit's
  convention, which :func:`attnkit.merge_attention_states` takes).
- ``flash_attn_with_kvcache``: ``rotary_cos`` / ``rotary_sin`` (attnkit.rotary; applied to q and
  the new keys before the append, at FlashAttention's positions), ``cache_batch_idx`` (as a
  one-block-per-row page table over the cache: read and written in place), ``cache_leftpad``
  (one call per distinct pad, on the cache from the pad on); ``num_splits`` is accepted and
  ignored (attnkit's decode kernels choose their splits).  No gradient, as in FlashAttention.
  Under torch.compile(fullgraph=True): calls without those three extras (one
  attention_with_kvcache call, its compiled op); the extras read their indices on the host.

Every function takes two more keywords: ``backend`` (attnkit's: None, "reference", "cpu",
"triton", "cuda") and ``s_aux`` (learned sinks ``[H]``, as vLLM's FlashAttention fork takes
them: attnkit's ``sinks``).  Bad input raises TypeError / ValueError naming FlashAttention's layout,
before any kernel runs.  Beyond FlashAttention: any float dtype (float32 and float64 too), Dv
!= D, and ``cache_leftpad`` with ``cache_batch_idx``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ._validation import check_bool, check_int, check_real, check_same_dtype_device, check_tensor
from .ops.kvcache import _check_seqlens_type, _lengths, attention_with_kvcache, check_call_tensors
from .ops.softmax import softmax_attention
from .ops.varlen import softmax_attention_varlen
from .rotary import apply_rotary_emb, check_positions, check_tables, rotate

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "apply_rotary_emb",
]

_PREFIX = "attnkit.flash_attn_interface."


# ---------------------------------------------------------------------------------------------
# The options every function shares
# ---------------------------------------------------------------------------------------------
def _window_pair(fn: str, window_size) -> tuple[int, int]:
    """window_size as (left, right) with every negative side as -1 (unbounded)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 \
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size):
        raise TypeError(f"{fn}: window_size must be a pair of ints (left, right), -1 = unbounded; got "
                        f"{window_size!r}")
    return tuple(-1 if w < 0 else w for w in window_size)


def _score_options(fn: str, causal, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                   return_probs_name: str, return_probs, s_aux=None) -> tuple[tuple[int, int], dict]:
    """Checks the shared options; returns (the window as (left, right) with causal's right = 0
    folded in, the attnkit score options besides the window)."""
    check_bool(fn, "causal", causal)
    check_bool(fn, "deterministic", deterministic)
    check_bool(fn, return_probs_name, return_probs)
    check_real(fn, "dropout_p", dropout_p, low=0.0, high=1.0)
    check_real(fn, "softcap", softcap, low=0.0)
    left, right = _window_pair(fn, window_size)
    if causal:
        right = 0
    options = {}
    if softcap > 0:
        options["softcap"] = float(softcap)
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if s_aux is not None:
        options["sinks"] = s_aux  # (attnkit's name; checked as softmax_attention checks sinks)
    return (left, right), options


def _causality(window: tuple[int, int], aligned: bool) -> tuple[bool, dict]:
    """(attnkit's is_causal, its window option) for FlashAttention's bottom-right window (left,
    right).  ``aligned``: every sequence has as many queries as keys, where SDPA's top-left
    causality is the same mask -- then plain is_causal (no score option: the fast paths)."""
    if window == (-1, -1):
        return False, {}
    if window == (-1, 0) and aligned:
        return True, {}
    return False, {"window": window}


def _heads_fit(fn: str, heads: int, kv_heads: int) -> bool:
    """Whether this is grouped-query attention (raises when the heads do not divide; no heads at
    all is an empty call)."""
    if heads == kv_heads:
        return False
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"{fn}: the number of query heads ({heads}) must be a multiple of the number of key / "
                         f"value heads ({kv_heads})")
    return True


class _DeterministicExit(torch.autograd.Function):
    """Identity on the inputs of a call; its backward (which runs after the call's own backward)
    restores the deterministic-algorithms setting that _DeterministicEnter's backward saved."""

    @staticmethod
    def forward(ctx, state, *tensors):
        ctx.state = state
        views = tuple(t.view_as(t) for t in tensors)
        return views if len(views) > 1 else views[0]

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.state.pop("saved", None)
        if saved is not None:
            torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        return (None, *grads)


class _DeterministicEnter(torch.autograd.Function):
    """Identity on the output of a call; its backward (which runs before the call's backward)
    switches torch's deterministic algorithms on, remembering the previous setting."""

    @staticmethod
    def forward(ctx, state, out):
        ctx.state = state
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        enabled = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        ctx.state["saved"] = (enabled, warn_only)
        if not enabled:
            # Warn-only: between the two nodes other branches of the graph may run their
            # backward too; an op of theirs without a deterministic version warns, not raises.
            torch.use_deterministic_algorithms(True, warn_only=True)
        return None, grad


def _run_deterministic(deterministic: bool, run, *tensors):
    """run(*tensors) -> (out, *rest); with ``deterministic`` and a gradient to take, the
    backward of ``run`` happens under torch's deterministic algorithms -- in eager mode.  Under
    torch.compile the switch is left out: AOT autograd refuses a compiled backward run under
    another deterministic setting than its forward was traced with (a RuntimeError at the
    backward), so a compiled region follows the setting the caller makes around it."""
    if (not deterministic or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or not any(t.requires_grad for t in tensors)):
        return run(*tensors)
    state: dict = {}
    inner = _DeterministicExit.apply(state, *tensors)
    inner = inner if isinstance(inner, tuple) else (inner,)
    out, *rest = run(*inner)
    return (_DeterministicEnter.apply(state, out), *rest)


def _unpack(fn: str, name: str, x, layout: str, dim: int, parts: int) -> tuple:
    """The tensors stacked along ``dim`` of a packed input (``parts`` of them), as views: their
    gradients come back as one tensor of x's shape (unbind's backward stacks them)."""
    check_tensor(fn, name, x, layout)
    if x.shape[dim] != parts:
        raise ValueError(f"{fn}: {name} must be {layout}; got {list(x.shape)}")
    return x.unbind(dim)


def _bhnd(x: torch.Tensor) -> torch.Tensor:
    """[B, N, H, D] <-> [B, H, N, D] (a view)."""
    return x.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Dense batches
# ---------------------------------------------------------------------------------------------
def _dense(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs, backend, s_aux=None):
    # Fast path: the plain call (no window or causality that needs one, no cap, ALiBi or
    # determinism switch; sizes that fit) goes straight to softmax_attention, which checks the
    # rest (dtypes, devices, dropout_p, scale) itself; anything else, valid or not, takes the
    # checks below and their FlashAttention-layout messages.  B=H=1 N=16 D=64 float32, one
    # thread (Intel Xeon without AMX, session 33, timeit): 22.4 -> 14.3 us a call (softmax_attention
    # alone 7.3, SDPA 6.3; the three transposes and the output copy ~4).
    if (window_size.__class__ is tuple and window_size == (-1, -1) and softcap.__class__ is float and softcap == 0.0
            and alibi_slopes is None and s_aux is None and deterministic is False and (causal is False or causal is True)
            and (return_attn_probs is False or return_attn_probs is True)):
        try:
            (b, n, h, d), (bk, m, hk, dk), (bv, mv, hv, _) = q.shape, k.shape, v.shape
        except (AttributeError, ValueError, RuntimeError):
            pass  # not three 4-D tensors: the checks below say so
        else:
            if b == bk == bv and d == dk and m == mv and hk == hv and hk > 0 and h % hk == 0 and (not causal or n == m):
                result = softmax_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout_p,
                                           causal, softmax_scale, h != hk, return_lse=return_attn_probs,
                                           backend=backend)
                if return_attn_probs:
                    return result[0].transpose(1, 2).contiguous(), result[1], None
                return result.transpose(1, 2).contiguous()
    check_tensor(fn, "q", q, "[B, N, H, D]")
    check_tensor(fn, "k", k, "[B, Nk, Hk, D]")
    check_tensor(fn, "v", v, "[B, Nk, Hk, Dv]")
    check_same_dtype_device(fn, {"q": q, "k": k, "v": v})
    window, options = _score_options(fn, causal, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                                     "return_attn_probs", return_attn_probs, s_aux)
    check_real(fn, "softmax_scale", softmax_scale, allow_none=True)
    batch, n, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"{fn}: q, k and v must have one batch size [B, N, H, D]; got q {list(q.shape)}, k "
                         f"{list(k.shape)}, v {list(v.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"{fn}: k must have q's head dim D = {head_dim} ([B, Nk, Hk, D]); got {list(k.shape)}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"{fn}: v must match k's Nk and Hk ([B, Nk, Hk, Dv]); got k {list(k.shape)}, v "
                         f"{list(v.shape)}")
    gqa = _heads_fit(fn, heads, k.shape[2])
    is_causal, window_option = _causality(window, aligned=n == k.shape[1])

    def run(q_, k_, v_):
        result = softmax_attention(_bhnd(q_), _bhnd(k_), _bhnd(v_), None, dropout_p, is_causal, softmax_scale,
                                   gqa, return_lse=return_attn_probs, backend=backend, **window_option, **options)
        return result if return_attn_probs else (result,)

    out, *lse = _run_deterministic(deterministic, run, q, k, v)
    out = _bhnd(out).contiguous()
    return (out, lse[0], None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, s_aux=None, backend=None):
    """Softmax attention in FlashAttention's layout and semantics (``flash_attn.flash_attn_func``).

    Args:
        q: ``[B, N, H, D]``.
        k: ``[B, Nk, Hk, D]``; v: ``[B, Nk, Hk, Dv]``.  H a multiple of Hk (grouped-query /
            multi-query attention: query head h uses key head ``h // (H // Hk)``).  One floating
            dtype and device.
        dropout_p: dropout on the attention probabilities (pass 0.0 in evaluation).
        softmax_scale: the scale of q kᵀ (default 1 / sqrt(D)).
        causal: bottom-right causal mask: query i sees keys ``j <= i + Nk - N``.
        window_size: (left, right): query i sees keys in ``[i + Nk - N - left, i + Nk - N + right]``
            (-1 = unbounded side).
        softcap: > 0: scores become ``softcap * tanh(s / softcap)`` (after the scale).
        alibi_slopes: float32 ``[H]`` or ``[B, H]``: ``-slope * |i + Nk - N - j|`` added to the scores.
        deterministic: run this call's backward under torch's deterministic algorithms.
        return_attn_probs: also return the log-sum-exp (and None for the probabilities).
        s_aux: keyword-only, beyond FlashAttention 2: float32 ``[H]`` learned sinks (gpt-oss's,
            named as vLLM's FlashAttention fork names them; attnkit's ``sinks``): one more logit
            per head in each row's softmax denominator, with no value; differentiable.  Every
            function here takes it.
        backend: attnkit's backend (None: the default for the device).

    Returns:
        ``out`` ``[B, N, H, Dv]`` contiguous; with ``return_attn_probs`` ``(out, softmax_lse
        [B, H, N] float32, None)``.  Differentiable in q, k, v.

    Raises:
        TypeError / ValueError: wrong ranks, mismatched shapes, dtypes or devices, heads that do not
        divide, bad options -- before any kernel runs.
    """
    return _dense(_PREFIX + "flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs, backend, s_aux)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              s_aux=None, backend=None):
    """:func:`flash_attn_func` on q, k, v stacked in one tensor ``qkv [B, N, 3, H, D]``; the
    gradient comes back as one ``[B, N, 3, H, D]`` tensor."""
    fn = _PREFIX + "flash_attn_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, "[B, N, 3, H, D]", 2, 3)
    return _dense(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs, backend, s_aux)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             s_aux=None, backend=None):
    """:func:`flash_attn_func` with k and v stacked in one tensor ``kv [B, Nk, 2, Hk, D]``."""
    fn = _PREFIX + "flash_attn_kvpacked_func"
    k, v = _unpack(fn, "kv", kv, "[B, Nk, 2, Hk, D]", 2, 2)
    return _dense(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                  return_attn_probs, backend, s_aux)


# ---------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------
def _paged_rows(fn, block_table, cu_seqlens_k, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """Where every sequence's key (value) rows lie in a paged cache ``[num_blocks, block_size,
    Hk, D]`` flattened to ``[num_blocks * block_size, Hk, D]``: int64 ``[total_k]``, sequence b's
    rows being its first ``len_b`` positions in its blocks of ``block_table [batch, max_blocks]``
    (one index for K and V: the offsets read and checked once)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (torch.int32, torch.int64) \
            or block_table.dim() != 2:
        raise TypeError(f"{fn}: block_table must be an int32 tensor [batch, max_blocks]")
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1:
        raise ValueError(f"{fn}: cu_seqlens_k must be an int32 tensor [batch + 1]")
    cu = [int(c) for c in cu_seqlens_k.tolist()]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}: cu_seqlens_k must start at 0 and not decrease; got {cu}")
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if block_table.shape[0] != len(lengths):
        raise ValueError(f"{fn}: block_table must have one row per sequence ({len(lengths)}); got "
                         f"{list(block_table.shape)}")
    capacity = block_table.shape[1] * block_size
    for b, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"{fn}: sequence {b} has {n} keys but its block_table row holds max_blocks * "
                             f"block_size = {capacity}")
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, dtype=torch.int64, device=device))
    pos = torch.arange(sum(lengths), device=device) - torch.tensor(cu[:-1], dtype=torch.int64, device=device)[seq]
    blocks = block_table.to(device=device, dtype=torch.int64)[seq, pos // block_size]
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"{fn}: block_table holds indices outside the cache's {num_blocks} blocks")
    return blocks * block_size + pos % block_size


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, backend,
            s_aux=None):
    check_tensor(fn, "q", q, "[total_q, H, D]")
    paged = block_table is not None
    layout_k = "[num_blocks, block_size, Hk, {}]" if paged else "[total_k, Hk, {}]"
    check_tensor(fn, "k", k, layout_k.format("D"))
    check_tensor(fn, "v", v, layout_k.format("Dv"))
    check_same_dtype_device(fn, {"q": q, "k": k, "v": v})
    window, options = _score_options(fn, causal, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                                     "return_attn_probs", return_attn_probs, s_aux)
    check_real(fn, "softmax_scale", softmax_scale, allow_none=True)
    if k.shape[-1] != q.shape[-1] or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{fn}: k must be {layout_k.format('D')} with q's D and v must match it in all but the "
                         f"last dim; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    gqa = _heads_fit(fn, q.shape[1], k.shape[-2])
    is_causal, window_option = _causality(window, aligned=cu_seqlens_q is cu_seqlens_k and not paged)

    def run(q_, k_, v_):
        if paged:  # the pages gathered into a pack (differentiable into them)
            index = _paged_rows(fn, block_table, cu_seqlens_k, k_.shape[0], k_.shape[1], k_.device)
            k_, v_ = k_.flatten(0, 1).index_select(0, index), v_.flatten(0, 1).index_select(0, index)
        result = softmax_attention_varlen(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p=dropout_p, is_causal=is_causal, scale=softmax_scale,
                                          enable_gqa=gqa, return_lse=return_attn_probs, backend=backend,
                                          **window_option, **options)
        return result if return_attn_probs else (result,)

    out, *lse = _run_deterministic(deterministic, run, q, k, v)
    return (out, lse[0].transpose(0, 1).contiguous(), None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, s_aux=None,
                           backend=None):
    """Softmax attention over packed sequences (``flash_attn.flash_attn_varlen_func``), each
    sequence attending within itself.

    Args:
        q: ``[total_q, H, D]``; k ``[total_k, Hk, D]``; v ``[total_k, Hk, Dv]``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` cumulative offsets.
        max_seqlen_q, max_seqlen_k: ints >= every length.
        block_table: None, or int32 ``[batch, max_blocks]`` with k / v paged caches
            ``[num_blocks, block_size, Hk, D]``: sequence b's keys are its first
            ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` positions in its blocks (gathered into one
            packed copy, then as without).
        the rest: as :func:`flash_attn_func`, per sequence (causality and windows bottom-right
            within each sequence; ``alibi_slopes`` ``[H]`` or ``[batch, H]``).

    Returns:
        ``out`` ``[total_q, H, Dv]``; with ``return_attn_probs`` ``(out, softmax_lse [H, total_q]
        float32, None)``.  Differentiable in q, k, v.
    """
    return _varlen(_PREFIX + "flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table, backend, s_aux)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, s_aux=None, backend=None):
    """:func:`flash_attn_varlen_func` on ``qkv [total, 3, H, D]`` with one ``cu_seqlens``."""
    fn = _PREFIX + "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, "[total, 3, H, D]", 1, 3)
    return _varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None, backend, s_aux)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    s_aux=None, backend=None):
    """:func:`flash_attn_varlen_func` with k and v stacked in ``kv [total_k, 2, Hk, D]``."""
    fn = _PREFIX + "flash_attn_varlen_kvpacked_func"
    k, v = _unpack(fn, "kv", kv, "[total_k, 2, Hk, D]", 1, 2)
    return _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None, backend,
                   s_aux)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------
def _index_vector(fn: str, name: str, x, batch: int) -> list[int]:
    """An int32 / int64 tensor [batch] read to the host."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must be an int32 tensor [B]; got "
                        f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if tuple(x.shape) != (batch,):
        raise ValueError(f"{fn}: {name} must have shape [B] = [{batch}]; got {list(x.shape)}")
    return [int(i) for i in x.tolist()]


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            s_aux=None, backend=None):
    """Attention of new queries against a KV cache, appending k / v to it in place
    (``flash_attn.flash_attn_with_kvcache``), on :func:`attnkit.attention_with_kvcache`.

    Args:
        q: ``[B, Nq, H, D]``.
        k_cache, v_cache: ``[B_cache, max_len, Hk, D]`` (``Dv`` for v), or with ``block_table``
            paged ``[num_blocks, block_size, Hk, D]``.  Written in place.
        k, v: None, or the new rows ``[B, Nk, Hk, D]`` / ``[B, Nk, Hk, Dv]``, written at positions
            ``cache_seqlens[b] ..`` of batch element b's cache row.
        rotary_cos, rotary_sin: None, or ``[seqlen_ro, rotary_dim / 2]`` (with k and v): the new
            keys are rotated at positions ``cache_seqlens[b] + t``; the queries at the same
            positions when causal or windowed, otherwise all at ``cache_seqlens[b]``.
            ``rotary_interleaved``: GPT-J's channel pairs (True) or GPT-NeoX's halves (False).
        cache_seqlens: int or int32 ``[B]``: the filled length of each cache row before the call
            (None: the whole cache, max_len -- or max_blocks * block_size -- with no k / v).
        cache_batch_idx: None, or int32 ``[B]``: batch element b uses cache row
            ``cache_batch_idx[b]`` (not with block_table; two elements appending to one row raise).
        cache_leftpad: None, or int32 ``[B]``: row b's keys start at that position (positions
            before it are not attended; causality, windows and ALiBi count from it, rotary
            positions do not); not with block_table.
        block_table: None, or int32 ``[B, max_blocks]`` for a paged cache.
        softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux: as
            :func:`flash_attn_func` (the keys of row b: its first ``cache_seqlens[b] + Nk``
            positions).
        num_splits: accepted for the signature, ignored.
        return_softmax_lse: also return the lse ``[B, H, Nq]`` float32.

    Returns:
        ``out`` ``[B, Nq, H, Dv]`` contiguous, or ``(out, softmax_lse)``.  No gradient.
    """
    fn = _PREFIX + "flash_attn_with_kvcache"
    paged = block_table is not None
    cache_layout = "[num_blocks, block_size, Hk, {}]" if paged else "[B_cache, max_len, Hk, {}]"
    check_call_tensors(fn, q, k_cache, v_cache, k, v, "[B, Nq, H, D]", cache_layout, "[B, Nk, Hk, {}]")
    window, options = _score_options(fn, causal, window_size, softcap, alibi_slopes, 0.0, False,
                                     "return_softmax_lse", return_softmax_lse, s_aux)
    check_bool(fn, "rotary_interleaved", rotary_interleaved)
    check_int(fn, "num_splits", num_splits, low=0)
    batch, nq, heads, head_dim = q.shape
    rows, cache_len, kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if v_cache.shape[:3] != k_cache.shape[:3] or k_cache.shape[3] != head_dim:
        raise ValueError(f"{fn}: k_cache must be {cache_layout.format('D')} with q's D = {head_dim}, v_cache the "
                         f"same in all but the last dim; got k_cache {list(k_cache.shape)}, v_cache "
                         f"{list(v_cache.shape)}")
    new = 0
    if k is not None:
        new = k.shape[1]
        want_k, want_v = (batch, new, kv_heads, head_dim), (batch, new, kv_heads, v_cache.shape[3])
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise ValueError(f"{fn}: k and v must be [B, Nk, Hk, D] = {list(want_k)} and [B, Nk, Hk, Dv] = "
                             f"{list(want_v)} (from q and the cache); got k {list(k.shape)}, v {list(v.shape)}")
    gqa = _heads_fit(fn, heads, kv_heads)
    if paged and (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2):
        raise TypeError(f"{fn}: block_table must be an int32 tensor [B, max_blocks]; got "
                        f"{type(block_table).__name__ if not isinstance(block_table, torch.Tensor) else list(block_table.shape)}")
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError(f"{fn}: cache_batch_idx and cache_leftpad do not go with a paged cache (block_table)")
    if cache_seqlens is None:
        if k is not None:
            raise ValueError(f"{fn}: with new rows k / v, cache_seqlens must say where they go")
        cache_seqlens = block_table.shape[1] * cache_len if paged else cache_len
    # No rotation, row index or left padding: one attention_with_kvcache call, which reads and
    # checks cache_seqlens itself (B=1 H=Hk=8 D=64 decoding, one thread, Intel Xeon without AMX,
    # session 33: the shim's own host reads and tensors cost 45 us a call over its 69).
    direct = (cache_batch_idx is None and cache_leftpad is None and rotary_cos is None and rotary_sin is None
              and (paged or rows == batch))
    if direct:  # (its values are read and checked by attention_with_kvcache, its type here)
        _check_seqlens_type(fn, cache_seqlens, batch)
    # FlashAttention's causal is bottom-right, as attention_with_kvcache's is_causal; a window
    # goes with it as the score option (left, right) (with causal: (left, 0)).
    if window != (-1, -1) and not (causal and window[0] == -1):
        options["window"] = window
    call = dict(is_causal=causal, scale=softmax_scale, enable_gqa=gqa, return_lse=True, backend=backend)
    if direct:
        # One call on the caller's cache_seqlens, read (once) by attention_with_kvcache only.
        out, lse = attention_with_kvcache(_bhnd(q), _bhnd(k_cache), _bhnd(v_cache), None if k is None else _bhnd(k),
                                          None if v is None else _bhnd(v), cache_seqlens=cache_seqlens,
                                          block_table=block_table, **call, **options)
        out = _bhnd(out).contiguous()
        return (out, lse) if return_softmax_lse else out
    lengths = _lengths(fn, cache_seqlens, batch)
    pads = [0] * batch
    if cache_leftpad is not None:
        pads = _index_vector(fn, "cache_leftpad", cache_leftpad, batch)
        for b, (pad, n) in enumerate(zip(pads, lengths)):
            if not 0 <= pad <= n:
                raise ValueError(f"{fn}: cache_leftpad[{b}] = {pad} must be in [0, cache_seqlens[{b}] = {n}]")
    cache_rows = None
    if cache_batch_idx is not None:
        cache_rows = _index_vector(fn, "cache_batch_idx", cache_batch_idx, batch)
        for b, r in enumerate(cache_rows):
            if not 0 <= r < rows:
                raise ValueError(f"{fn}: cache_batch_idx[{b}] = {r} is not a row of the cache (B_cache = {rows})")
    elif not paged and rows != batch:
        raise ValueError(f"{fn}: k_cache must have q's batch size B = {batch} (or pass cache_batch_idx); got "
                         f"{list(k_cache.shape)}")

    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError(f"{fn}: pass both rotary_cos and rotary_sin or neither")
        if k is None:
            raise ValueError(f"{fn}: rotary_cos / rotary_sin rotate the new keys: pass k and v with them")
        check_tables(fn, rotary_cos, rotary_sin, head_dim, q.device)
        start = torch.tensor(lengths, dtype=torch.int64, device=q.device).view(batch, 1)
        k_pos = start + torch.arange(new, device=q.device)
        q_pos = start + torch.arange(nq, device=q.device) if causal or window != (-1, -1) else start
        check_positions(fn, k_pos, rotary_cos.shape[0], "the new keys")
        check_positions(fn, q_pos, rotary_cos.shape[0], "the queries")
        k = rotate(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)
        q = rotate(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)


    def attend(members, pad):
        """(out, lse) of the batch elements ``members`` (None: all, in order), whose rows start at ``pad``."""
        sel = (lambda x: x) if members is None else (lambda x: x[members])
        k_view, v_view = k_cache[:, pad:], v_cache[:, pad:]
        table = block_table
        if cache_rows is not None or members is not None:
            # A one-block-per-row page table over the cache (read and written in place).
            index = cache_rows if cache_rows is not None else list(range(batch))
            table = torch.tensor([[index[b]] for b in (members if members is not None else range(batch))],
                                 dtype=torch.int32, device=q.device)
        seqlens = [lengths[b] - pad for b in (members if members is not None else range(batch))]
        opts = dict(options)
        if alibi_slopes is not None and isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2 \
                and members is not None:
            opts["alibi_slopes"] = alibi_slopes[members]
        return attention_with_kvcache(
            _bhnd(sel(q)), _bhnd(k_view), _bhnd(v_view), None if k is None else _bhnd(sel(k)),
            None if v is None else _bhnd(sel(v)),
            cache_seqlens=torch.tensor(seqlens, dtype=torch.int64, device=q.device), block_table=table, **call,
            **opts)

    distinct = sorted(set(pads))
    if len(distinct) == 1:
        out, lse = attend(None, distinct[0])
    else:
        out = q.new_empty((batch, heads, nq, v_cache.shape[3]))
        lse = q.new_empty((batch, heads, nq), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        for pad in distinct:
            members = [b for b in range(batch) if pads[b] == pad]
            o, l = attend(members, pad)
            index = torch.tensor(members, dtype=torch.int64, device=q.device)
            out.index_copy_(0, index, o)
            lse.index_copy_(0, index, l)
    out = _bhnd(out).contiguous()
    return (out, lse) if return_softmax_lse else out

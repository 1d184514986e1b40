"""Attention against a KV cache, for decoding and chunked prefill:
``attnkit.attention_with_kvcache`` (issue 28), in the spirit of FlashAttention's
``flash_attn_with_kvcache``.

One call appends the new keys / values to the cache (in place) and attends each batch element's
queries to its cached keys plus the new ones, causally aligned bottom-right (the new queries are
the last positions of the sequence).  Two routes:

- **triton backend, Nq <= 16 new queries** (decoding, a short chunk): one call
  of the split-KV Triton kernel ``attnkit.kernels.decode.softmax_decode_fwd`` for the whole
  batch, with per-sequence lengths ``kv_lens = cache_seqlens + Nk`` and the kernel's own
  bottom-right causal alignment (``is_causal=False``: every query sees all L_b keys).  It reads
  each sequence's first L_b cache positions straight from the cache (one view of the first
  ``max_b L_b`` positions; a paged cache read in place through its block table), with no
  grouping by length, no mask and no merge of a prefix and a causal part.  The score options go
  with it: window, softcap and ALiBi in the kernel (a window's keys only are read), the sinks
  folded into each row's finish or split merge.  Forward only: nothing here takes a gradient anyway (see below).
- **otherwise** (the reference, cpu and cuda backends, more queries, dtypes or
  head dims the Triton kernels lack): plain Python over :func:`attnkit.softmax_attention` (so
  every backend, dtype and score option it has), whose CPU backend sends few-query calls
  (N <= 16) to its split-KV decode kernel, as follows.

How a call becomes kernel calls on the second route:

- **lengths**: batch element b sees L_b = cache_seqlens[b] + Nk keys, and nothing past them is
  ever read (a cache allocated with ``torch.empty`` may hold anything there, NaN included).  A
  contiguous cache is read through views ``k_cache[b0:b1, :, :L]`` -- one kernel call per run of
  adjacent batch elements of equal L_b, no copy.  Not one call over the whole cache with a
  key-padding mask: that reads the unused tail (a NaN there can reach the output through
  0 · NaN within a kernel tile) and computes it; it only wins where the per-call overhead
  (~0.1-0.2 ms a call measured at B=1, Hq=32, Hk=8, D=128, one thread) outweighs the padding.
  Measured (AMD EPYC, AVX2, float32, B=8, Hq=32, Hk=8, D=128, max_len 4096, lengths in
  [2048, 4096), interleaved medians): one thread, 8 calls 42-82 ms against one padded call
  53-107 ms (the 2-core machine was shared; see bench/varlen.py); two threads at a quiet moment
  24.7 against 29.2 ms.  A paged cache on the cpu backend with Nq <= 16 (and Nq * H / Hk <= 64)
  is read in place: one call of the decoding kernel per group of equal L_b
  (``attnkit::softmax_decode_paged``: its key tiles cut at the blocks' ends, each tile's rows
  read from their block), bottom-right causality as its window's right bound 0, the score
  options and the sinks in the kernel.  Otherwise (more queries) it is
  gathered: the blocks of each batch element (block_table) into one contiguous copy per group
  of equal L_b, one ``cat`` of block views each.
- **bottom-right causality** (query j of Nq sees keys < L - Nq + j + 1): Nq = 1 needs no mask
  at all.  For Nq > 1 the causal bound is the window's right bound, ``window=(left, 0)``
  (FlashAttention's alignment, a score option every backend but the cuda kernels takes): one
  call, the output rounded once.  On ``backend="cuda"`` (no window there) the visible keys split
  into the prefix ``[0, L - Nq)``, which every query sees, and the last Nq keys, which the
  queries see causally *top-left* -- two calls of softmax_attention merged by their
  log-sum-exps (:func:`attnkit.merge_attention_states`): exact in float32, a 16-bit output
  rounded twice (by each part, then by the merge; session 33 made the window the default for
  that).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import score_options as _score_options
from .._dispatch import native_ops_declared, resolve
from .._validation import check_bool, check_real, check_same_dtype_device, check_tensor
from . import compiled
from .merge import merge_attention_states
from .softmax import softmax_attention
from .varlen import SCORE_OPTIONS, check_score_options, options_for

OP_NAME = "attnkit.attention_with_kvcache"

# Score options whose positions are relative to the last key (bottom-right): a split of the keys
# would move them; with these the causal bound goes into the window.
_ALIGNED_OPTIONS = ("window", "alibi_slopes")
# Applied once per row (a sink is one more logit of the softmax): in only one part of a split.
_ONCE_OPTIONS = ("sinks",)
# Named backends whose kernels take no window (score_options.BACKEND_OPTIONS): there causal Nq > 1
# is the prefix / causal split merged by lse (_attend).  (A set, so that the tests can put the
# cpu backend in it and check the split on this machine.)
_WINDOWLESS = {name for name, took in _score_options.BACKEND_OPTIONS.items() if "window" not in took}

# What attnkit.kernels.decode.softmax_decode_fwd takes (MAX_QUERY_ROWS, SUPPORTED_DTYPES,
# MAX_HEAD_DIM; not imported from there: importing the kernels imports triton, slow, and only
# the triton route needs it).
_DECODE_MAX_QUERIES = 16
_DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DECODE_MAX_HEAD_DIM = 256


def _decode_kernel_fits(backend, q, value_dim) -> bool:
    """Whether the call goes to the triton split-KV decode kernel (module docstring): the
    triton backend, 1..16 new queries, a dtype and head dims it takes (any score option).
    Anything else takes the softmax_attention route, which routes or raises as
    softmax_attention does."""
    return (backend == "triton" and 1 <= q.shape[2] <= _DECODE_MAX_QUERIES
            and q.dtype in _DECODE_DTYPES and 1 <= q.shape[3] <= _DECODE_MAX_HEAD_DIM
            and 1 <= value_dim <= _DECODE_MAX_HEAD_DIM)


def _paged_kernel_fits(backend, q, kv_heads) -> bool:
    """Whether a paged call reads its blocks in place through the CPU decoding kernel
    (``attnkit::softmax_decode_paged``, one call per group of equal L_b) rather than through a
    gathered copy: the cpu backend, 1..16 new queries and at most 64 rows a kv head (the decoding
    kernel's), float32 / bfloat16 / float16.  Causality and every score option go with it."""
    nq, heads = q.shape[2], q.shape[1]
    return (backend == "cpu" and q.device.type == "cpu" and q.dtype in _DECODE_DTYPES
            and 1 <= nq <= _DECODE_MAX_QUERIES and nq * (heads // kv_heads) <= 64)


def _decode_paged_fake(q, k_cache, v_cache, block_table, length, scale, window_left=-1, window_right=-1,
                       softcap=0.0, alibi_slopes=None, sinks=None):
    """Shapes of attnkit::softmax_decode_paged's results (torch.compile, meta tensors)."""
    batch, heads, nq, _ = q.shape
    return q.new_empty((batch, heads, nq, v_cache.shape[3])), q.new_empty((batch, heads, nq), dtype=torch.float32)


if native_ops_declared("softmax_decode_paged"):
    torch.library.register_fake("attnkit::softmax_decode_paged", _decode_paged_fake)


def _kernel_options(q, options):
    """The score options of a decoding-kernel call on q [g, H, Nq, D], validated as
    softmax_attention validates them: ``(opts or None, window_left, window_right, softcap,
    alibi_slopes float32 [g, H] or None)``."""
    group, heads = q.shape[0], q.shape[1]
    opts = _score_options.build(OP_NAME, options.get("window"), options.get("softcap", 0.0),
                               options.get("alibi_slopes"), options.get("sinks"), heads=heads, batch=(group,),
                               device=q.device)
    if opts is None:
        return None, -1, -1, 0.0, None
    return opts, opts.window[0], opts.window[1], opts.softcap, opts.to_kernel(group, heads).alibi_slopes


def _decode_paged_cpu(q, k_cache, v_cache, table, length, scale, is_causal, options):
    """(out, lse) of q [g, H, Nq, D] against the first ``length`` positions of each row of
    ``table`` (int64 [g, max_blocks]), the blocks read in place by the CPU decoding kernel:
    causality bottom-right as the window's right bound 0 (query i sees keys <= length - Nq + i),
    the other score options as softmax_attention takes them (validated by the same code), the
    sinks folded into each row's softmax by the kernel (before a 16-bit output is rounded: applied
    to the finished row they would round it twice)."""
    opts, left, right, softcap, slopes = _kernel_options(q, options)
    if is_causal and q.shape[2] > 1:
        right = 0  # with a window's right bound r >= 0 as well: min(r, 0) = 0
    sinks = None if opts is None or opts.sinks is None else opts.sinks.detach().float().contiguous()
    return torch.ops.attnkit.softmax_decode_paged(q, k_cache, v_cache, table, length, scale, left, right, softcap,
                                                  slopes, sinks)


def _decode_triton(q, k_cache, v_cache, visible, tables, is_causal, scale, options):
    """(out, lse) of every batch element at once from the split-KV Triton kernel: the cache's
    first max(L_b) positions (a view; a paged cache read in place through its block table),
    kv_lens = L_b, the score options in the kernel (its own bottom-right alignment, causal or
    not), the sinks folded into each row's finish or merge.  Cache positions at or past L_b are
    never read (the kernel loads only keys < kv_lens[b])."""
    opts, left, right, softcap, slopes = _kernel_options(q, options)
    sinks = None if opts is None or opts.sinks is None else opts.sinks.detach()
    return _decode_triton_kernel(q, k_cache, v_cache, visible, tables, is_causal, scale,
                                 dict(window_left=left, window_right=right, softcap=softcap,
                                      alibi_slopes=slopes, sinks=sinks))


def _decode_triton_kernel(q, k_cache, v_cache, visible, tables, is_causal, scale, kernel_options):
    from ..kernels.decode import softmax_decode_fwd

    kv_lens = torch.tensor(visible, dtype=torch.int32, device=q.device)
    if tables is not None:
        # The blocks read in place: the table's rows cut to the longest L_b's blocks (entries
        # past a row's own blocks are never read: zeros).
        width = max((len(row) for row in tables), default=0)
        table = torch.tensor([row + [0] * (width - len(row)) for row in tables] if width else [[0]] * len(tables),
                             dtype=torch.int32, device=q.device)
        return softmax_decode_fwd(q, k_cache, v_cache, scale, kv_lens=kv_lens, is_causal=is_causal,
                                  block_table=table, **kernel_options)
    longest = max(visible)
    return softmax_decode_fwd(q, k_cache[:, :, :longest], v_cache[:, :, :longest], scale, kv_lens=kv_lens,
                              is_causal=is_causal, **kernel_options)


def check_call_tensors(fn: str, q, k_cache, v_cache, k, v, q_layout: str, cache_layout: str, new_layout: str) -> None:
    """The tensors of a KV-cache call: each of its layout (``cache_layout`` / ``new_layout`` with
    ``{}`` for the head dim, D or Dv), k and v both or neither, one dtype and device."""
    check_tensor(fn, "q", q, q_layout)
    check_tensor(fn, "k_cache", k_cache, cache_layout.format("D"))
    check_tensor(fn, "v_cache", v_cache, cache_layout.format("Dv"))
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: pass both k and v (new rows to append) or neither")
    if k is not None:
        check_tensor(fn, "k", k, new_layout.format("D"))
        check_tensor(fn, "v", v, new_layout.format("Dv"))
        tensors.update(k=k, v=v)
    check_same_dtype_device(fn, tensors)


def _lengths(fn: str, cache_seqlens, batch: int) -> list[int]:
    _check_seqlens_type(fn, cache_seqlens, batch)
    if isinstance(cache_seqlens, int):
        return [cache_seqlens] * batch
    lengths = cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{fn}: cache_seqlens must be >= 0; got cache_seqlens[{b}] = {n}")
    return lengths


def _check_seqlens_type(fn: str, cache_seqlens, batch: int) -> None:
    """cache_seqlens is an int >= 0 or an int32 / int64 tensor [B] (its values unread)."""
    if isinstance(cache_seqlens, bool):
        raise TypeError(f"{fn}: cache_seqlens must be an int or an int32 / int64 tensor [B]; got {cache_seqlens!r}")
    if isinstance(cache_seqlens, int):
        if cache_seqlens < 0:
            raise ValueError(f"{fn}: cache_seqlens must be >= 0; got {cache_seqlens}")
        return
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cache_seqlens must be an int or an int32 / int64 tensor [B]; got "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: cache_seqlens must be int32 or int64; got "
                        f"{str(cache_seqlens.dtype).replace('torch.', '')}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"{fn}: cache_seqlens must have shape [B] = [{batch}]; got {list(cache_seqlens.shape)}")


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """[b0, b1) ranges of adjacent batch elements with equal lengths."""
    runs, start = [], 0
    for b in range(1, len(lengths) + 1):
        if b == len(lengths) or lengths[b] != lengths[start]:
            runs.append((start, b))
            start = b
    return runs


def _attend(q, k, v, is_causal, scale, enable_gqa, backend, options):
    """(out, lse) of queries q [g, H, Nq, D] against all keys k / v [g, Hk, L, D] they may see,
    causally aligned bottom-right when ``is_causal``."""
    nq, length = q.shape[2], k.shape[2]

    def call(q_, k_, v_, causal, opts):
        return softmax_attention(q_, k_, v_, None, 0.0, causal, scale, enable_gqa, return_lse=True,
                                 backend=backend, **opts)

    if not is_causal or nq <= 1:
        return call(q, k, v, False, options)
    prefix = length - nq
    if prefix == 0 and not any(name in options for name in _ALIGNED_OPTIONS):
        return call(q, k, v, True, options)  # top-left and bottom-right agree
    if backend not in _WINDOWLESS or any(name in options for name in _ALIGNED_OPTIONS):
        # One call, the causal bound as the window's right bound 0 (bottom-right; with a window's
        # own right bound r >= 0 as well: min(r, 0) = 0): every backend but the cuda kernels takes
        # a window.  The prefix / causal split below rounds a 16-bit output twice (each part's,
        # then their merge): session 33's random fuzzing (flash_attn_with_kvcache, bfloat16, two
        # queries, softcap 2) found it 0.0076 off against the rule's 0.0064.
        if "window" not in SCORE_OPTIONS:  # cannot happen: they came together into softmax_attention
            raise TypeError(f"{OP_NAME}: is_causal with more than one query needs softmax_attention's window")
        left, _ = options.get("window", (-1, -1))
        return call(q, k, v, False, {**options, "window": (left, 0)})
    once_free = {name: value for name, value in options.items() if name not in _ONCE_OPTIONS}
    if prefix > 0:
        out_a, lse_a = call(q, k[:, :, :prefix], v[:, :, :prefix], False, options)
        out_b, lse_b = call(q, k[:, :, prefix:], v[:, :, prefix:], True, once_free)
        return merge_attention_states(out_a, lse_a, out_b, lse_b)
    # Fewer keys than queries: the first -prefix queries see none (out 0, lse -inf -- or the
    # sink), the others the keys top-left causally.
    empty = -prefix
    out_a, lse_a = call(q[:, :, :empty], k[:, :, :0], v[:, :, :0], False, options)
    out_b, lse_b = call(q[:, :, empty:], k, v, True, options)
    return torch.cat([out_a, out_b], dim=2), torch.cat([lse_a, lse_b], dim=2)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    cache_seqlens: Union[int, torch.Tensor],
    block_table: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: Optional[str] = None,
    **score_options,
):
    """Attention of new queries against a KV cache, appending the new keys / values to it in
    place -- a decoding step (Nq = 1) or a chunk of a prefill (Nq > 1) -- like FlashAttention's
    ``flash_attn_with_kvcache``, in attnkit's ``[B, H, N, D]`` layout.

    For each batch element b: ``k`` / ``v`` (Nk new rows) are written into the cache at
    positions ``cache_seqlens[b] .. cache_seqlens[b] + Nk - 1``, then the queries attend to the
    first ``L_b = cache_seqlens[b] + Nk`` cache positions.  ``cache_seqlens`` is not updated:
    advance it by Nk yourself.

    Layout: attnkit's ``[B, H, N, D]`` everywhere (heads before positions), **not**
    FlashAttention's ``[B, N, H, D]``: coming from ``flash_attn_with_kvcache`` transpose q, k, v
    and the cache (``x.transpose(1, 2)``; a paged cache ``[num_blocks, block_size, Hk, D]`` too).

    Args:
        q: ``[B, H, Nq, D]`` the new queries.
        k_cache: ``[B, Hk, max_len, D]`` -- or, with ``block_table``, a paged cache
            ``[num_blocks, Hk, block_size, D]``.  Written in place.
        v_cache: ``[B, Hk, max_len, Dv]`` (paged: ``[num_blocks, Hk, block_size, Dv]``).
        k, v: None (nothing to append: Nk = 0), or the new keys ``[B, Hk, Nk, D]`` and values
            ``[B, Hk, Nk, Dv]`` (both or neither).  All tensors share q's dtype and device.
        cache_seqlens: int32 / int64 ``[B]`` (or one int for all): the number of valid
            positions in each cache row before this call.  Read to the host once.
        block_table: None, or int32 / int64 ``[B, max_blocks]``: position p of batch element b
            lives in block ``block_table[b, p // block_size]`` at offset ``p % block_size``.
            Only the entries covering ``[0, L_b)`` are read (they must be valid block indices);
            blocks may be shared between batch elements for reading, but two batch elements may
            not write the same slot.  The decoding kernels read the blocks in place: on the
            triton backend with Nq <= 16 (one call for the batch), and on the cpu backend with
            Nq <= 16 (one call per group of equal L_b); causal or not, any score option;
            otherwise the blocks are gathered into a contiguous copy first, which a call pays
            on top.
        is_causal: query j (of Nq) sees the keys ``< L_b - Nq + j + 1``: causal **bottom-right**
            -- the new queries are the last Nq positions of the sequence, so the last one sees
            every key and earlier ones one key fewer each (what decoding and chunked prefill
            need; with Nk = Nq, query j sees the cache and the new keys up to its own).  This
            differs from :func:`attnkit.softmax_attention`'s ``is_causal`` (top-left, SDPA's: row
            i sees keys ``<= i``), which would let the first new query see only the first cached
            key.  A query that sees no key (L_b < Nq) gives out 0, lse -inf.  With Nq = 1 it
            makes no difference.  ``False``: every query sees all L_b keys.
        scale, enable_gqa, backend: as in :func:`attnkit.softmax_attention` (``enable_gqa``
            lets H be a multiple of Hk; default False like SDPA).
        return_lse: also return the log-sum-exp of each row.
        **score_options: the score options of :func:`attnkit.softmax_attention` (``window``,
            ``softcap``, ``alibi_slopes``, ``sinks``, where this version of it has them), passed
            through per batch element -- ``window`` and ALiBi positions are bottom-right aligned,
            relative to key L_b - 1, as in FlashAttention.  ``alibi_slopes`` may be ``[H]`` or
            ``[B, H]``.

    Returns:
        ``out`` ``[B, H, Nq, Dv]`` in q's dtype; with ``return_lse`` the tuple ``(out, lse)``,
        lse ``[B, H, Nq]`` float32 (float64 for float64 inputs).

    An inference API: **no gradient**.  The call runs under ``torch.no_grad()`` (the cache is
    written in place, which autograd could not differentiate through anyway); its results never
    require grad, whatever the inputs do.  Train with :func:`attnkit.softmax_attention`.

    torch.compile: a call under compilation (``fullgraph=True`` included) is one opaque op that
    runs this function at run time and writes the cache in place (ops/compiled.py).

    Cache positions at or past ``L_b`` are never read: they may hold anything (NaN included).

    Cost: see the module docstring.  On the triton backend with Nq <= 16: one split-KV decode
    kernel call for the whole batch (per-sequence lengths, causal or not, any score option --
    with a window only its keys are read; a paged cache read in place).  Otherwise views of a contiguous cache (one
    kernel call per run of adjacent batch elements with equal L_b); a paged cache read in place
    on the cpu backend (see ``block_table``), else a gathered copy of it; Nq <= 16 takes
    softmax_attention's decode kernel on CPU; causal Nq > 1 is one call with the causal bound as
    a window's (on ``backend="cuda"``: two calls and a merge).

    Raises:
        TypeError: non-tensors, non-floating q / k / v / caches, cache_seqlens or block_table of
            a non-integer dtype, non-bool flags, an unknown score option.
        ValueError: wrong ranks or sizes, mismatched dtypes / devices, k without v, heads that do
            not fit (GQA), negative cache_seqlens, new rows that do not fit in the cache
            (``cache_seqlens[b] + Nk > max_len``, or beyond ``max_blocks * block_size``), block
            indices out of range, two batch elements writing one paged slot.  All before the
            cache is written.

    Example::

        >>> B, H, Hk, D, max_len = 2, 8, 2, 64, 1024
        >>> k_cache = torch.zeros(B, Hk, max_len, D); v_cache = torch.zeros(B, Hk, max_len, D)
        >>> lengths = torch.tensor([0, 0], dtype=torch.int32)
        >>> # prefill a chunk of 100 tokens, then decode one token at a time
        >>> q, k, v = torch.randn(B, H, 100, D), torch.randn(B, Hk, 100, D), torch.randn(B, Hk, 100, D)
        >>> out = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
        ...                                      enable_gqa=True)
        >>> lengths += 100
        >>> q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hk, 1, D), torch.randn(B, Hk, 1, D)
        >>> out = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
        ...                                      enable_gqa=True)          # [2, 8, 1, 64]
        >>> lengths += 1
    """
    fn = OP_NAME
    paged = block_table is not None
    cache_layout = "[num_blocks, Hk, block_size, {}]" if paged else "[B, Hk, max_len, {}]"
    check_call_tensors(fn, q, k_cache, v_cache, k, v, "[B, H, Nq, D]", cache_layout, "[B, Hk, Nk, {}]")
    check_bool(fn, "is_causal", is_causal)
    check_bool(fn, "enable_gqa", enable_gqa)
    check_bool(fn, "return_lse", return_lse)
    check_real(fn, "scale", scale, allow_none=True)
    check_score_options(fn, score_options)

    batch, heads, nq, head_dim = q.shape
    cache_rows, kv_heads, cache_len, _ = k_cache.shape
    value_dim = v_cache.shape[3]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{fn}: k_cache must have q's head dim D = {head_dim}; got {list(k_cache.shape)}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"{fn}: v_cache must match k_cache in all but the last dim; got k_cache "
                         f"{list(k_cache.shape)}, v_cache {list(v_cache.shape)}")
    if not paged and cache_rows != batch:
        raise ValueError(f"{fn}: k_cache must have q's batch size B = {batch}; got {list(k_cache.shape)}")
    if heads != kv_heads:
        if not enable_gqa:
            raise ValueError(f"{fn}: q has {heads} heads and the cache {kv_heads}: pass enable_gqa=True for "
                             "grouped-query attention (otherwise the head counts must be equal)")
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(f"{fn}: with enable_gqa the number of query heads ({heads}) must be a multiple "
                             f"of the cache's heads ({kv_heads})")
    new = 0
    if k is not None:
        new = k.shape[2]
        want_k, want_v = (batch, kv_heads, new, head_dim), (batch, kv_heads, new, value_dim)
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise ValueError(f"{fn}: k and v must be [B, Hk, Nk, D] = {list(want_k)} and [B, Hk, Nk, Dv] = "
                             f"{list(want_v)} (from q and the cache); got k {list(k.shape)}, v {list(v.shape)}")
    if compiled.compiling():
        # Under torch.compile: one opaque op that runs this function at run time (ops/compiled.py).
        _check_seqlens_type(fn, cache_seqlens, batch)
        out, lse = compiled.kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale,
                                    enable_gqa, backend, score_options)
        return (out, lse) if return_lse else out
    seqlens = _lengths(fn, cache_seqlens, batch)
    visible = [n + new for n in seqlens]

    if paged:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"{fn}: block_table must be an int32 tensor [B, max_blocks]; got "
                            f"{type(block_table).__name__}")
        if block_table.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{fn}: block_table must be int32 (or int64); got "
                            f"{str(block_table.dtype).replace('torch.', '')}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"{fn}: block_table must be [B, max_blocks] with B = {batch}; got "
                             f"{list(block_table.shape)}")
        block_size = cache_len
        capacity = block_table.shape[1] * block_size
        where = f"max_blocks * block_size = {block_table.shape[1]} * {block_size}"
    else:
        capacity, where = cache_len, f"max_len = {cache_len}"
    for b, length in enumerate(visible):
        if length > capacity:
            raise ValueError(f"{fn}: batch element {b} does not fit in the cache: cache_seqlens[{b}] + Nk = "
                             f"{seqlens[b]} + {new} = {length} > {where}")
    tables = None
    if paged:
        table_rows = block_table.tolist()
        tables = [row[:-(-length // block_size)] for row, length in zip(table_rows, visible)]
        for b, row in enumerate(tables):
            for i, block in enumerate(row):
                if not 0 <= block < cache_rows:
                    raise ValueError(f"{fn}: block_table[{b}, {i}] = {block} is not a block of the cache "
                                     f"(num_blocks = {cache_rows})")
        if new:
            slots = {}
            for b in range(batch):
                for p in range(seqlens[b], visible[b]):
                    slot = (tables[b][p // block_size], p % block_size)
                    if slots.setdefault(slot, b) != b:
                        raise ValueError(f"{fn}: batch elements {slots[slot]} and {b} both write block "
                                         f"{slot[0]} offset {slot[1]} of the paged cache")
    chosen = resolve("softmax", backend, q.device, fn)
    for b0, b1 in _runs(visible):  # per-batch options of the wrong size: before the cache is written
        options_for(fn, score_options, slice(b0, b1), batch)

    with torch.no_grad():
        if new:
            _append(k_cache, v_cache, k, v, seqlens, tables, paged)
        if batch and _decode_kernel_fits(chosen, q, value_dim):
            out, lse = _decode_triton(q, k_cache, v_cache, visible, tables, is_causal, scale, score_options)
            return (out, lse) if return_lse else out
        out = q.new_empty((batch, heads, nq, value_dim))
        lse = q.new_empty((batch, heads, nq), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        if paged:
            groups: dict[int, list[int]] = {}
            for b, length in enumerate(visible):
                groups.setdefault(length, []).append(b)
            in_place = _paged_kernel_fits(chosen, q, kv_heads)
            table64 = block_table.to(torch.int64) if in_place else None
            for length, members in groups.items():
                index = torch.tensor(members, dtype=torch.int64, device=q.device)
                qg = q if len(members) == batch else q.index_select(0, index)
                rows = index.cpu() if len(members) < batch else slice(0, batch)
                if in_place:
                    tg = table64 if len(members) == batch else table64.index_select(0, index)
                    o, l = _decode_paged_cpu(qg, k_cache, v_cache, tg, length,
                                             head_dim ** -0.5 if scale is None else float(scale), is_causal,
                                             options_for(fn, score_options, rows, batch))
                else:
                    kg, vg = _gather_pages(k_cache, v_cache, [tables[b] for b in members], length)
                    o, l = _attend(qg, kg, vg, is_causal, scale, enable_gqa, backend,
                                   options_for(fn, score_options, rows, batch))
                if len(members) == batch:
                    out.copy_(o)
                    lse.copy_(l)
                else:
                    out.index_copy_(0, index, o)
                    lse.index_copy_(0, index, l.to(lse.dtype))
        else:
            for b0, b1 in _runs(visible):
                length = visible[b0]
                o, l = _attend(q[b0:b1], k_cache[b0:b1, :, :length], v_cache[b0:b1, :, :length], is_causal,
                               scale, enable_gqa, backend, options_for(fn, score_options, slice(b0, b1), batch))
                out[b0:b1].copy_(o)
                lse[b0:b1].copy_(l)
    return (out, lse) if return_lse else out


def _append(k_cache, v_cache, k, v, seqlens, tables, paged):
    """Write the new rows k / v [B, Hk, Nk, D] into the cache at positions seqlens[b] + t."""
    batch, _, new, _ = k.shape
    if not paged and len(set(seqlens)) == 1:
        start = seqlens[0]
        k_cache[:, :, start:start + new].copy_(k)
        v_cache[:, :, start:start + new].copy_(v)
        return
    device = k_cache.device
    positions = [(b, seqlens[b] + t) for b in range(batch) for t in range(new)]
    if paged:
        block_size = k_cache.shape[2]
        first = torch.tensor([tables[b][p // block_size] for b, p in positions], dtype=torch.int64, device=device)
        second = torch.tensor([p % block_size for _, p in positions], dtype=torch.int64, device=device)
    else:
        first = torch.tensor([b for b, _ in positions], dtype=torch.int64, device=device)
        second = torch.tensor([p for _, p in positions], dtype=torch.int64, device=device)
    # cache[first[i], :, second[i]] = row i of the new rows [B * Nk, Hk, D] (b major, t minor).
    k_cache[first, :, second] = k.transpose(1, 2).reshape(batch * new, k.shape[1], k.shape[3])
    v_cache[first, :, second] = v.transpose(1, 2).reshape(batch * new, v.shape[1], v.shape[3])


def _gather_pages(k_cache, v_cache, tables, length):
    """The first ``length`` positions of each batch element's blocks as contiguous
    [g, Hk, length, D] / [g, Hk, length, Dv]: one ``cat`` of the block views per batch element,
    into the result (one copy; torch's CPU ``index_select`` of the blocks measured ~5x slower)."""

    def gather(cache):
        _, hk, block_size, dim = cache.shape
        out = cache.new_empty((len(tables), hk, length, dim))
        for j, row in enumerate(tables):
            views = [cache[block, :, :min(block_size, length - i * block_size)] for i, block in enumerate(row)]
            if views:
                torch.cat(views, dim=1, out=out[j])
        return out

    return gather(k_cache), gather(v_cache)

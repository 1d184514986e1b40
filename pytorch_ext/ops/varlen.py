"""Packed sequences (varlen): ``attnkit.softmax_attention_varlen`` (issue 28), and the packing
helpers that ops/linear_varlen.py's ``attnkit.linear_attention_varlen`` shares.

FlashAttention's ``flash_attn_varlen_func`` layout: the sequences of a batch are concatenated
along one token axis, ``q [total_q, H, D]``, ``k / v [total_k, Hk, D / Dv]``, and
``cu_seqlens [batch + 1]`` holds the cumulative offsets (sequence i is rows
``cu_seqlens[i]:cu_seqlens[i + 1]``).  Each sequence attends within itself only.

On the Triton backend softmax_attention_varlen runs the whole pack in one launch per kernel
(ops/varlen_triton.py), and so does linear_attention_varlen (ops/linear_varlen_triton.py).  Everywhere else these are plain Python over the existing ops
(:func:`attnkit.softmax_attention`, :func:`attnkit.linear_attention`), which keeps their
backends, autograd, NaN semantics and score options.  How the sequences become kernel calls
there (no work across sequence boundaries, no dense block-diagonal mask):

- the sequences are grouped by their (query length, key length); a group is one kernel call on
  ``[g, H, n, D]`` tensors;
- the packed tensors are cut by one ``split`` in pack order: a group whose sequences are
  adjacent in the pack (a run of equal lengths; every group of one sequence) is a *view*, any
  other group the ``cat`` of its sequences' chunks (a copy of O(rows · H · D), against the
  O(rows · n · H · D) of the attention itself), so that many short sequences of few distinct
  lengths cost few calls instead of one call each;
- the groups' outputs go back in pack order by one ``cat`` of per-sequence views.
  The backward of all this is O(total) however many groups (see :func:`_split`).

Measured (AMD EPYC, AVX2, 2 cores shared with other jobs, one thread; ``bench/varlen.py`` and
interleaved re-timings, H=8, D=64, float32): against torch SDPA over the pack with a dense
block-diagonal mask 9-54x (forward) and 9-49x (forward+backward); against one
softmax_attention call per sequence 1.0x where every length differs (the same calls) and
1.1-1.35x for 256 sequences of 8-40 tokens (33 calls instead of 256).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from .. import _autocast
from .._dispatch import resolve
from .._validation import check_bool, check_real, check_same_dtype_device, check_size_match, check_tensor
from ..score_options import build as build_score_options
from . import compiled, varlen_triton
from .softmax import _draw_seed, softmax_attention

OP_NAME = "attnkit.softmax_attention_varlen"

# The score options of softmax_attention (its keyword-only arguments other than these): window,
# softcap, alibi_slopes, sinks once they exist there.  Read from its signature, so that the
# functions built on it pass through exactly what it takes.
_NOT_SCORE_OPTIONS = ("return_lse", "backend")
SCORE_OPTIONS = tuple(
    name for name, p in inspect.signature(softmax_attention).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in _NOT_SCORE_OPTIONS
)
# A per-batch-element option: [H] (every call takes it unchanged) or [batch, H] (one row per
# sequence / batch element: each call takes the rows of its own).
PER_BATCH_OPTIONS = ("alibi_slopes",)


def check_score_options(fn: str, options: dict) -> None:
    """``options`` (the ``**score_options`` of a call) are keyword arguments softmax_attention
    takes (their values are checked by softmax_attention itself, before its kernel runs)."""
    unknown = [name for name in options if name not in SCORE_OPTIONS]
    if unknown:
        known = ", ".join(SCORE_OPTIONS) if SCORE_OPTIONS else "none in this version"
        raise TypeError(
            f"{fn}: unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))} (the score options of softmax_attention: {known})"
        )


def options_for(fn: str, options: dict, rows, batch: int) -> dict:
    """The score options of one kernel call covering the sequences / batch elements ``rows``
    (a slice or an index tensor): per-batch options given as ``[batch, H]`` are cut to those
    rows, everything else passes unchanged.  None values are dropped (= the default)."""
    result = {}
    for name, value in options.items():
        if value is None:
            continue
        if name in PER_BATCH_OPTIONS and isinstance(value, torch.Tensor) and value.dim() == 2:
            if value.shape[0] != batch:
                raise ValueError(
                    f"{fn}: {name} must be [H] or [batch, H] with batch = {batch}; got shape "
                    f"{list(value.shape)}"
                )
            value = value[rows]
        result[name] = value
    return result


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_cu_tensor(fn: str, name: str, cu) -> None:
    """``cu`` is an int32 / int64 1-D tensor (its values unread)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be an int32 or int64 torch.Tensor [batch + 1]; got "
                        f"{type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: {name} must be int32 or int64; got {str(cu.dtype).replace('torch.', '')}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{fn}: {name} must be a 1-D tensor [batch + 1] of cumulative offsets; got shape "
                         f"{list(cu.shape)}")


def _check_cu_seqlens(fn: str, name: str, cu, total: int, what: str) -> list[int]:
    """``cu`` is a valid offsets tensor for ``total`` rows; returns it as a list of ints (read to
    the host: one synchronization when it lives on a GPU)."""
    _check_cu_tensor(fn, name, cu)
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0; got {name}[0] = {offsets[0]}")
    for i in range(len(offsets) - 1):
        if offsets[i + 1] < offsets[i]:
            raise ValueError(
                f"{fn}: {name} must be non-decreasing (cumulative offsets); got {name}[{i}] = "
                f"{offsets[i]} > {name}[{i + 1}] = {offsets[i + 1]}"
            )
    if offsets[-1] != total:
        raise ValueError(
            f"{fn}: {name} must end at the number of packed rows of {what} ({total}); got "
            f"{name}[-1] = {offsets[-1]}"
        )
    return offsets


def _check_max_seqlen(fn: str, name: str, value, lengths: list[int], cu_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
    longest = max(lengths, default=0)
    if value < longest:
        i = lengths.index(longest)
        raise ValueError(
            f"{fn}: {name} = {value} is below the length of sequence {i} ({longest}, from {cu_name})"
        )


class _Group:
    """Sequences of one (query length n, key length m), in pack order."""

    def __init__(self, n: int, m: int, seqs: list[int]):
        self.n, self.m, self.seqs = n, m, seqs

    def adjacent(self, offsets: list[int], length: int) -> bool:
        """Whether the group's rows are one block of the packed tensor (``length`` rows each)."""
        return all(offsets[s] + length == offsets[t] for s, t in zip(self.seqs, self.seqs[1:]))


def _groups(lengths_q: list[int], lengths_k: list[int]) -> list[_Group]:
    """The sequences with at least one query row, grouped by (query length, key length) in the
    order of their first sequence."""
    by_length: dict[tuple[int, int], list[int]] = {}
    for i, (n, m) in enumerate(zip(lengths_q, lengths_k)):
        if n > 0:
            by_length.setdefault((n, m), []).append(i)
    return [_Group(n, m, seqs) for (n, m), seqs in by_length.items()]


def _split(x: torch.Tensor, groups: list[_Group], offsets: list[int], length_of) -> list[torch.Tensor]:
    """The groups' rows of the packed ``x [total, heads, dim]`` as ``[g, heads, length, dim]``
    each (``length_of(group)`` rows per sequence).

    One ``split`` of x into chunks in pack order -- a group whose sequences are adjacent in x is
    one chunk (a view), any other group one chunk per sequence, concatenated (one copy) -- so
    the backward is one concatenation of the chunks' gradients: O(total) however many groups.
    (Slicing x once per group would cost a full-size zero gradient per slice in the backward:
    measured 50 s for 512 sequences of 8-16 tokens, where the kernels took ~1 s; and torch's
    CPU ``index_select`` of the rows copied ~5x slower than ``cat`` of the chunks.)"""
    if not groups:
        return []
    chunks = []  # (start, size, group index, position in the group's list of chunks)
    for gi, group in enumerate(groups):
        length = length_of(group)
        if len(group.seqs) > 1 and group.adjacent(offsets, length):
            chunks.append((offsets[group.seqs[0]], len(group.seqs) * length, gi, 0))
        else:
            chunks.extend((offsets[s], length, gi, j) for j, s in enumerate(group.seqs))
    # Chunks with rows, in pack order (they do not overlap), then the empty ones (anywhere).
    chunks.sort(key=lambda c: (c[1] == 0, c[0]))
    sizes, owners, at = [], [], 0
    for start, size, gi, j in chunks:
        if size and start > at:  # rows of no group (sequences without query rows)
            sizes.append(start - at)
            owners.append(None)
        if size:
            at = start + size
        elif at < x.shape[0]:  # the rows left, before the empty chunks
            sizes.append(x.shape[0] - at)
            owners.append(None)
            at = x.shape[0]
        sizes.append(size)
        owners.append((gi, j))
    if at < x.shape[0]:
        sizes.append(x.shape[0] - at)
        owners.append(None)
    parts: list[dict] = [{} for _ in groups]
    for piece, owner in zip(x.split(sizes), owners):
        if owner is not None:
            parts[owner[0]][owner[1]] = piece
    result = []
    for group, found in zip(groups, parts):
        pieces = [found[j] for j in range(len(found))]
        block = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        result.append(block.unflatten(0, (len(group.seqs), length_of(group))).transpose(1, 2))
    return result


def _unpack(pieces: list[torch.Tensor], groups: list[_Group]) -> torch.Tensor:
    """The groups' results ``[g, H, n, ...]`` back in the packed layout ``[total, H, ...]``: one
    ``cat`` of per-sequence views in pack order (one copy; its backward hands out views)."""
    rows = {}
    for piece, group in zip(pieces, groups):
        rows.update(zip(group.seqs, piece.transpose(1, 2).unbind(0)))  # [n, H, ...] per sequence
    return torch.cat([rows[s] for s in sorted(rows)])


def _batch_rows(group: _Group):
    """The group's sequence indices, as a per-batch option takes them."""
    seqs = group.seqs
    if seqs == list(range(seqs[0], seqs[0] + len(seqs))):
        return slice(seqs[0], seqs[0] + len(seqs))
    return torch.tensor(seqs, dtype=torch.int64)


def _attached_empty(shape, like: torch.Tensor, dtype, *inputs) -> torch.Tensor:
    """An empty result that is still part of the autograd graph of ``inputs`` (so that a
    backward through an empty pack gives zero gradients, not an error)."""
    out = like.new_zeros(shape, dtype=dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out = out + sum(t.sum() for t in inputs).to(dtype) * 0
    return out


def softmax_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: Optional[str] = None,
    **score_options,
):
    """Softmax attention over packed sequences of different lengths (FlashAttention's
    ``flash_attn_varlen_func`` layout), each sequence attending within itself only.

    Sequence i is query rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` against key / value rows
    ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]``; its result is exactly
    ``softmax_attention(q_i, k_i, v_i, ...)`` on ``[1, H, n_i, D]`` (with the same options).

    Args:
        q: ``[total_q, H, D]`` the packed queries (tokens first, like FlashAttention; not
            attnkit's ``[B, H, N, D]``).
        k: ``[total_k, Hk, D]``.
        v: ``[total_k, Hk, Dv]``.  q, k, v share one floating dtype and device; any strides.
        cu_seqlens_q, cu_seqlens_k: int32 or int64 ``[batch + 1]`` cumulative offsets: start at
            0, non-decreasing, last entry = total_q (resp. total_k); one length for both.  On
            any device (they are read to the host once).  A sequence may be empty: 0 query rows
            give no rows; 0 key rows give rows with no key (out 0, lse -inf).
        max_seqlen_q, max_seqlen_k: ints >= every query (key) length, as FlashAttention takes
            them; checked, otherwise unused (the grouping reads the lengths themselves).
        dropout_p, scale, enable_gqa, backend: as in :func:`attnkit.softmax_attention`
            (``enable_gqa``: H a multiple of Hk, query head h uses key head ``h // (H // Hk)``).
        is_causal: per sequence, **top-left** aligned like :func:`attnkit.softmax_attention`:
            query row t of a sequence sees its key rows ``<= t``.  FlashAttention's varlen
            ``causal=True`` is bottom-right aligned (the last query row sees the last key row);
            the two agree when a sequence has as many query rows as key rows (self-attention,
            the usual packed-training case).  For bottom-right with n_i != m_i, pass
            ``window=(-1, 0)`` (a score option) instead.
        return_lse: also return the log-sum-exp of each row.
        **score_options: the score options of :func:`attnkit.softmax_attention` (``window``,
            ``softcap``, ``alibi_slopes``, ``sinks``, where this version of it has them), passed
            through unchanged to every per-sequence call -- so ``window`` is bottom-right aligned
            per sequence, as in FlashAttention's varlen.  ``alibi_slopes`` may also be
            ``[batch, H]``: one row of slopes per sequence.

    Returns:
        ``out`` ``[total_q, H, Dv]`` in the inputs' dtype; with ``return_lse`` the tuple
        ``(out, lse)``, lse ``[total_q, H]`` in float32 (float64 for float64 inputs).
        The lse is token-major like ``out`` (FlashAttention returns ``[H, total_q]``, its
        kernel's layout): row r of ``lse`` belongs to row r of ``out``, so that
        :func:`attnkit.merge_attention_states` takes the pair as it comes
        (``lse.shape == out.shape[:-1]``); ``lse.T`` is FlashAttention's layout.

    Differentiable in q, k, v (and what softmax_attention differentiates among the score
    options) through softmax_attention's autograd: the gradients land in the packed tensors.
    NaN / empty-row semantics are softmax_attention's, per sequence.

    Cost: no work across sequence boundaries and no block-diagonal mask.  On the ``triton``
    backend the whole pack is one launch per kernel (FlashAttention's varlen scheme,
    ops/varlen_triton.py; with dropout, sequence b's mask comes from the Philox key seed + b, the
    seed drawn from torch's generator as softmax_attention draws it).  Elsewhere sequences of equal (query, key) lengths form one
    kernel call ``[g, H, n, D]``: a view of the packed tensors when they are adjacent in the
    pack, a gathered copy of their rows otherwise; so a pack of all distinct lengths is one call
    per sequence (~0.15 ms of fixed cost each, measured for a tiny call on a CPU), many short
    sequences of few lengths are few calls.

    torch.compile: a call under compilation (``fullgraph=True`` included) is one opaque op that
    runs this function at run time (ops/compiled.py; its gradient recomputes the forward, no
    double backward); with ``dropout_p > 0`` it stays eager Python (a graph break).

    CUDA graphs: under capture (``torch.cuda.graph``) the offsets are never read on the host --
    their values go unchecked and ``max_seqlen_q`` / ``max_seqlen_k`` size the grid, as in
    FlashAttention -- which only the Triton one launch allows: other calls raise ValueError
    there.  No double backward of a captured call.

    Raises:
        TypeError: non-tensors, non-floating q / k / v, cu_seqlens that are not int32 / int64,
            a non-int max_seqlen, an unknown score option (and what softmax_attention raises).
        ValueError: q / k / v not 3-D or of mismatched sizes / dtypes / devices, heads that do
            not fit (GQA), cu_seqlens not 1-D, not starting at 0, decreasing, not ending at
            total_q / total_k or of different lengths, a max_seqlen below a length.  All of
            these before any kernel runs.

    Example::

        >>> lengths = [5, 0, 17, 1]
        >>> cu = torch.tensor([0, 5, 5, 22, 23], dtype=torch.int32)
        >>> q, k, v = (torch.randn(23, 8, 64) for _ in range(3))
        >>> out, lse = attnkit.softmax_attention_varlen(q, k, v, cu, cu, 17, 17, is_causal=True,
        ...                                             return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([23, 8, 64]), torch.Size([23, 8]))
    """
    fn = OP_NAME
    if _autocast.any_enabled():  # SDPA's autocast policy, as softmax_attention (pytorch_ext/_autocast.py)
        q, k, v = _autocast.cast_inputs(q, k, v)
    check_tensor(fn, "q", q, "[total_q, H, D]")
    check_tensor(fn, "k", k, "[total_k, Hk, D]")
    check_tensor(fn, "v", v, "[total_k, Hk, Dv]")
    check_same_dtype_device(fn, {"q": q, "k": k, "v": v})
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, _ = k.shape
    check_size_match(fn, "head dim D", {"q": head_dim, "k": k.shape[2]})
    check_size_match(fn, "number of packed rows total_k", {"k": total_k, "v": v.shape[0]})
    check_size_match(fn, "number of heads Hk", {"k": kv_heads, "v": v.shape[1]})
    check_bool(fn, "is_causal", is_causal)
    check_bool(fn, "enable_gqa", enable_gqa)
    check_bool(fn, "return_lse", return_lse)
    if heads != kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"{fn}: q has {heads} heads and k / v {kv_heads}: pass enable_gqa=True for "
                "grouped-query attention (otherwise the head counts must be equal)"
            )
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(f"{fn}: with enable_gqa the number of query heads ({heads}) must be a "
                             f"multiple of the key / value heads ({kv_heads})")
    check_real(fn, "dropout_p", dropout_p, low=0.0)
    check_real(fn, "scale", scale, allow_none=True)
    check_score_options(fn, score_options)
    if compiled.compiling() and dropout_p == 0:
        # Under torch.compile: one opaque op that runs this function at run time (ops/compiled.py).
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _check_cu_tensor(fn, name, cu)
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            compiled.check_int(fn, name, value)
        out, lse = compiled.softmax_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           is_causal, scale, enable_gqa, backend, score_options)
        return (out, lse) if return_lse else out
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        out, lse = _captured(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             is_causal, scale, backend, score_options)
        return (out, lse) if return_lse else out
    cu_q = _check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, total_q, "q")
    cu_k = _check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, total_k, "k / v")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
            f"{len(cu_q)} and {len(cu_k)}"
        )
    batch = len(cu_q) - 1
    lengths_q = [cu_q[i + 1] - cu_q[i] for i in range(batch)]
    lengths_k = [cu_k[i + 1] - cu_k[i] for i in range(batch)]
    _check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, lengths_q, "cu_seqlens_q")
    _check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, lengths_k, "cu_seqlens_k")
    chosen = resolve("softmax", backend, q.device, fn)  # an unknown / unusable backend: before any kernel

    value_dim = v.shape[2]
    groups = _groups(lengths_q, lengths_k)
    for group in groups:  # per-batch options of the wrong size: before any kernel
        options_for(fn, score_options, _batch_rows(group), batch)
    if groups and varlen_triton.takes(chosen, q, v, dropout_p):
        # Triton: the whole pack in one launch per kernel (ops/varlen_triton.py)
        options = _one_launch_options(score_options, heads, batch, q.device)

        def regroup(q_, k_, v_, sinks_):  # the grouped reference path, for a double backward
            extra = dict(score_options, sinks=sinks_) if "sinks" in score_options else score_options
            return softmax_attention_varlen(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                            return_lse=True, backend="reference", **extra)

        seed = int(_draw_seed(dropout_p))
        out, lse = varlen_triton.run(q, k, v, cu_seqlens_q, cu_seqlens_k, max(lengths_q), max(lengths_k),
                                     is_causal, scale, options, regroup, dropout_p, seed)
        return (out, lse) if return_lse else out
    outs, lses = [], []
    queries = _split(q, groups, cu_q, lambda g: g.n)
    keys = _split(k, groups, cu_k, lambda g: g.m)
    values = _split(v, groups, cu_k, lambda g: g.m)
    for group, qg, kg, vg in zip(groups, queries, keys, values):
        result = softmax_attention(
            qg, kg, vg, None, dropout_p, is_causal, scale, enable_gqa, return_lse=return_lse,
            backend=backend, **options_for(fn, score_options, _batch_rows(group), batch),
        )
        out, lse = result if return_lse else (result, None)
        outs.append(out)
        lses.append(lse)

    if not groups:  # no query row at all
        out = _attached_empty((total_q, heads, value_dim), q, q.dtype, q, k, v)
        # (the lse too, as softmax_attention's with N = 0: a loss on it backpropagates)
        lse = _attached_empty((total_q, heads), q, _lse_dtype(q.dtype), q, k, v)
    else:
        out = _unpack(outs, groups)
        lse = _unpack(lses, groups) if return_lse else None
    return (out, lse) if return_lse else out


def softmax_attention_nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                             backend, **score_options):
    """:func:`attnkit.softmax_attention` on nested tensors of the jagged layout, as torch's SDPA
    takes them: ``query [B, H, j, D]``, ``key [B, Hk, j', D]``, ``value [B, Hk, j', Dv]`` -- a
    ``[B, j, H, D]`` jagged tensor transposed(1, 2), the ragged dim third.  Each batch element's
    sequence attends within itself: the jagged tensors' values and offsets are exactly
    :func:`softmax_attention_varlen`'s packed layout, so the call is one softmax_attention_varlen
    call (no padding, no mask).  Returns ``out [B, H, j, Dv]`` nested with query's offsets (and
    with ``return_lse`` the lse ``[B, H, j]``, nested too); differentiable through the nested
    tensors' values.  ``attn_mask`` is refused (SDPA's nested path takes none either)."""
    fn = "attnkit.softmax_attention"
    inputs = (("query", query), ("key", key), ("value", value))
    for name, t in inputs:
        if not (isinstance(t, torch.Tensor) and t.is_nested):
            nested = ", ".join(n for n, x in inputs if getattr(x, "is_nested", False))
            raise ValueError(f"{fn}: query, key and value must all be nested tensors or none; {nested} "
                             f"{'is' if ',' not in nested else 'are'} nested, {name} is "
                             f"{'a ' + type(t).__name__ if not isinstance(t, torch.Tensor) else 'not'}")
        if t.layout != torch.jagged:
            raise ValueError(f"{fn}: nested {name} must have the jagged layout (torch.nested.nested_tensor(..., "
                             f"layout=torch.jagged)); got {t.layout}")
        if t.dim() != 4 or t._ragged_idx != 2:
            raise ValueError(f"{fn}: nested {name} must be [B, H, j, D] with the ragged dim third (SDPA's layout: "
                             f"a [B, j, H, D] jagged tensor transposed(1, 2)); got {t.dim()}-D with the ragged "
                             f"dim {t._ragged_idx}")
        if t._lengths is not None:
            raise ValueError(f"{fn}: nested {name} has holes (a non-contiguous jagged tensor with lengths); "
                             "pass one whose sequences are contiguous in its values")
    if attn_mask is not None:
        raise ValueError(f"{fn}: attn_mask is not supported with nested tensors (SDPA's nested path takes none "
                         "either); each sequence attends within itself, is_causal per sequence")
    packed = [t.transpose(1, 2) for t in (query, key, value)]  # [B, j, H, D]: ragged dim 1
    cu_q, cu_k, cu_v = (t.offsets() for t in packed)
    if cu_v is not cu_k and not torch.equal(cu_v, cu_k):
        raise ValueError(f"{fn}: nested key and value must have the same sequence lengths")

    def longest(cu):
        return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0

    result = softmax_attention_varlen(packed[0].values(), packed[1].values(), packed[2].values(), cu_q, cu_k,
                                      longest(cu_q), longest(cu_k), dropout_p=dropout_p, is_causal=is_causal,
                                      scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, backend=backend,
                                      **{name: value for name, value in score_options.items()
                                         if value is not None and not (name == "softcap" and value == 0.0)})
    out, lse = result if return_lse else (result, None)
    out = torch.nested.nested_tensor_from_jagged(out, cu_q).transpose(1, 2)
    if not return_lse:
        return out
    return out, torch.nested.nested_tensor_from_jagged(lse, cu_q).transpose(1, 2)


def one_launch_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, is_causal, scale, backend, score_options,
                        grad_out, grad_lse):
    """The gradients (dq, dk, dv, dsinks) of a dropout-free call that ran in one Triton launch,
    from its ``out`` / ``lse`` by the backward kernels alone (ops/compiled.py's backward, which
    has no autograd graph of the forward); None when the call takes another path.  The
    arguments were checked by the forward call."""
    chosen = resolve("softmax", backend, q.device, OP_NAME)
    if q.shape[0] == 0 or not varlen_triton.takes(chosen, q, v, 0.0):
        return None
    batch = cu_seqlens_q.numel() - 1
    longest = [int((cu[1:] - cu[:-1]).max()) if batch else 0 for cu in (cu_seqlens_q, cu_seqlens_k)]
    options = _one_launch_options(score_options, q.shape[1], batch, q.device)
    return varlen_triton.backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *longest, is_causal, scale, options,
                                  grad_out, grad_lse)


def _one_launch_options(score_options: dict, heads: int, batch: int, device):
    """The call's score options, validated, for the one launch (ALiBi ``[H]`` or ``[batch, H]``)."""
    return build_score_options(OP_NAME, score_options.get("window"), score_options.get("softcap", 0.0),
                               score_options.get("alibi_slopes"), score_options.get("sinks"),
                               heads=heads, batch=(batch,), device=device)


def _captured(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal, scale,
              backend, score_options):
    """softmax_attention_varlen under CUDA graph capture: the Triton one launch, which reads no
    offset on the host -- so the offsets' values are not checked (wrong ones read and write out
    of range) and ``max_seqlen_q`` / ``max_seqlen_k`` size the grid, as in FlashAttention."""
    fn = OP_NAME
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_cu_tensor(fn, name, cu)
        if cu.device != q.device:
            raise ValueError(f"{fn}: under CUDA graph capture {name} must be on q's device ({q.device}); "
                             f"got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1); got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
        if value < 0:
            raise ValueError(f"{fn}: {name} must be >= 0; got {value}")
    chosen = resolve("softmax", backend, q.device, fn)
    if not varlen_triton.takes(chosen, q, v, dropout_p, captured=True):
        raise ValueError(
            f"{fn}: under CUDA graph capture only the Triton one-launch path runs (backend triton, "
            f"dropout_p = 0, float16 / bfloat16 / float32, head dims <= 256); got backend {chosen}, "
            f"dropout_p = {dropout_p}, {q.dtype}, D = {q.shape[2]}, Dv = {v.shape[2]}"
        )
    batch = cu_seqlens_q.numel() - 1
    options = _one_launch_options(score_options, q.shape[1], batch, q.device)
    return varlen_triton.run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                             options, None)

"""``attnkit.linear_attention_varlen`` (issue 28): linear attention over packed sequences, each
sequence on its own, optionally continuing from a per-sequence state and returning each
sequence's final state (flash-linear-attention's ``cu_seqlens`` with ``initial_state`` /
``output_final_state``).

On the ``triton`` backend the whole pack is one launch per kernel (ops/linear_varlen_triton.py);
elsewhere sequences of equal length form one :func:`attnkit.linear_attention` call, cut from the
pack as softmax_attention_varlen's grouped path does (ops/varlen.py ``_split`` / ``_unpack``).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._validation import check_bool, check_same_dtype_device, check_size_match, check_tensor
from . import compiled, linear_varlen_triton
from .linear import _check_options as _check_linear_options
from .linear import _check_state
from .linear import _route as _linear_route
from .linear import linear_attention
from .varlen import _attached_empty, _check_cu_seqlens, _check_cu_tensor, _groups, _split, _unpack

OP_NAME = "attnkit.linear_attention_varlen"


def linear_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = False,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    return_state: bool = False,
    backend: Optional[str] = None,
):
    """Linear attention over packed sequences (the layout of :func:`softmax_attention_varlen`),
    each sequence on its own: the sums -- the causal state (S, z) -- start at every sequence
    start from zero, or from that sequence's ``initial_state``.

    Sequence i is rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of q, k and v alike (linear
    attention's causal form needs as many keys as queries, so one ``cu_seqlens``); its result is
    exactly ``linear_attention(q_i, k_i, v_i, ...)`` on ``[1, H, n_i, D]`` (with
    ``initial_state=(S0[i:i+1], z0[i:i+1])`` when given).

    Args:
        q, k: ``[total, H, D]``; v: ``[total, H, Dv]`` (one floating dtype and device, equal H:
            linear attention has no GQA).
        cu_seqlens: int32 or int64 ``[batch + 1]`` cumulative offsets (start at 0,
            non-decreasing, end at total); empty sequences are allowed.
        causal, feature_map, normalize, eps, scale, backend: as in
            :func:`attnkit.linear_attention`.
        initial_state: causal only.  ``(S0 [batch, H, D, Dv], z0 [batch, H, D])``, one state per
            sequence (float32; float64 for float64 inputs), as linear_attention's: sequence i's
            queries also see S0[i], z0[i].  Differentiable.
        return_state: causal only.  Also return each sequence's state after its last key,
            ``(S [batch, H, D, Dv], z [batch, H, D])`` (an empty sequence's is its initial
            state, or zeros), to continue it with :func:`attnkit.linear_attention_step` or another
            call.  Differentiable.

    Returns:
        ``out`` ``[total, H, Dv]`` in the inputs' dtype; with ``return_state`` the pair ``(out,
        (S, z))``.  Differentiable in q, k, v and the initial state.  On the ``triton`` backend
        the whole pack runs in one launch per kernel (its kernels' packed build:
        pytorch_ext/ops/linear_varlen_triton.py); elsewhere sequences of equal length form one
        linear_attention call (a view when they are adjacent in the pack, a gathered copy
        otherwise), as in :func:`softmax_attention_varlen`.

    torch.compile: as :func:`softmax_attention_varlen` (one opaque op; its gradient recomputes
    the forward).

    Raises:
        TypeError / ValueError: as :func:`softmax_attention_varlen` for the packed inputs and
            cu_seqlens, and as :func:`attnkit.linear_attention` for the options and the state
            (its leading dim the number of sequences) -- all before any kernel runs.

    Example::

        >>> cu = torch.tensor([0, 100, 350], dtype=torch.int32)
        >>> q, k, v = (torch.randn(350, 4, 32) for _ in range(3))
        >>> out = attnkit.linear_attention_varlen(q, k, v, cu, causal=True)   # [350, 4, 32]
        >>> # each prompt's state, to continue it token by token:
        >>> out, (S, z) = attnkit.linear_attention_varlen(q, k, v, cu, causal=True, return_state=True)
        >>> out1, (S, z) = attnkit.linear_attention_step(*(torch.randn(2, 4, 32) for _ in range(3)), (S, z))
    """
    fn = OP_NAME
    check_tensor(fn, "q", q, "[total, H, D]")
    check_tensor(fn, "k", k, "[total, H, D]")
    check_tensor(fn, "v", v, "[total, H, Dv]")
    check_same_dtype_device(fn, {"q": q, "k": k, "v": v})
    check_size_match(fn, "number of packed rows total", {"q": q.shape[0], "k": k.shape[0], "v": v.shape[0]})
    check_size_match(fn, "number of heads H", {"q": q.shape[1], "k": k.shape[1], "v": v.shape[1]})
    check_size_match(fn, "head dim D", {"q": q.shape[2], "k": k.shape[2]})
    check_bool(fn, "causal", causal)
    check_bool(fn, "return_state", return_state)
    _check_linear_options(fn, feature_map, normalize, eps, scale)
    _check_cu_tensor(fn, "cu_seqlens", cu_seqlens)
    batch, heads, head_dim, value_dim = cu_seqlens.shape[0] - 1, q.shape[1], q.shape[2], v.shape[2]
    if (initial_state is not None or return_state) and not causal:
        what = "initial_state" if initial_state is not None else "return_state=True"
        raise ValueError(f"{fn}: {what} needs causal=True (a recurrent state continues a causal sequence)")
    if initial_state is not None:
        _check_state(fn, "initial_state", initial_state, batch, heads, head_dim, value_dim, q.dtype, q.device,
                     lead="batch")
        initial_state = tuple(initial_state)
    if compiled.compiling():
        # Under torch.compile: one opaque op that runs this function at run time (ops/compiled.py).
        return compiled.linear_varlen(q, k, v, cu_seqlens, causal, feature_map, normalize, eps, scale, initial_state,
                                      return_state, backend)
    offsets = _check_cu_seqlens(fn, "cu_seqlens", cu_seqlens, q.shape[0], "q, k and v")
    lengths = [offsets[i + 1] - offsets[i] for i in range(batch)]
    groups = _groups(lengths, lengths)
    chosen = _linear_route(fn, backend, q.device, q.dtype, head_dim, value_dim, batch, heads, causal)
    options = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=float(eps), scale=float(scale))
    if chosen == "triton" and groups:

        def regroup(q_, k_, v_, state_):  # the grouped reference path, for a double backward
            return linear_attention_varlen(q_, k_, v_, cu_seqlens, initial_state=state_, return_state=return_state,
                                           backend="reference", **options)

        return linear_varlen_triton.run(q, k, v, cu_seqlens, max(lengths), options, initial_state, return_state,
                                        regroup)
    return _grouped(q, k, v, offsets, lengths, groups, options, initial_state, return_state, backend)


def _grouped(q, k, v, offsets, lengths, groups, options, initial_state, return_state, backend):
    """One linear_attention call per group of equal lengths (see ops/varlen.py ``_split``); the
    groups' states gathered from / scattered back to the sequences' order."""
    parts = [_split(x, groups, offsets, lambda g: g.n) for x in (q, k, v)]
    results = []
    for group, qg, kg, vg in zip(groups, *parts):
        state = None
        if initial_state is not None:
            rows = torch.tensor(group.seqs, device=q.device)
            state = tuple(s.index_select(0, rows) for s in initial_state)
        results.append(linear_attention(qg, kg, vg, initial_state=state, return_state=return_state,
                                        backend=backend, **options))
    outs = [r[0] if return_state else r for r in results]
    if not groups:
        out = _attached_empty((q.shape[0], q.shape[1], v.shape[2]), q, q.dtype, q, k, v)
    else:
        out = _unpack(outs, groups)
    if not return_state:
        return out
    return out, _final_states(results, groups, lengths, initial_state, q, v)


def _final_states(results, groups, lengths, initial_state, q, v):
    """(S [batch, H, D, Dv], z [batch, H, D]) in sequence order: a group's returned states for
    its sequences, the initial state (or zeros) for a sequence without rows."""
    from ..reference.linear import state_dtype

    batch, heads, head_dim, value_dim = len(lengths), q.shape[1], q.shape[2], v.shape[2]
    per_sequence: list = [None] * batch
    for (_, (s, z)), group in zip(results, groups):
        for j, i in enumerate(group.seqs):
            per_sequence[i] = (s[j], z[j])
    dtype = state_dtype(q.dtype)
    for i in range(batch):
        if per_sequence[i] is None:
            per_sequence[i] = (initial_state[0][i], initial_state[1][i]) if initial_state is not None else (
                q.new_zeros((heads, head_dim, value_dim), dtype=dtype), q.new_zeros((heads, head_dim), dtype=dtype))
    if batch == 0:
        return (q.new_zeros((0, heads, head_dim, value_dim), dtype=dtype), q.new_zeros((0, heads, head_dim),
                                                                                        dtype=dtype))
    return torch.stack([s for s, _ in per_sequence]), torch.stack([z for _, z in per_sequence])

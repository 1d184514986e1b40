"""Context-parallel attention on torch.distributed: ``attnkit.distributed``.

The sequence axis is sharded over the ranks of a process group; every rank holds the queries,
keys and values of its own positions and gets back the output (and log-sum-exp) of those
positions, equal to what one process computes on the whole sequence.  Transport is
``torch.distributed`` alone (gloo on CPU, NCCL on GPUs; no home-made sockets).

- :func:`ring_attention` -- softmax attention.  The K/V shards travel around the ring of ranks
  (rank r sends to r + 1 and receives from r - 1) with point-to-point ops
  (``batch_isend_irecv``); the transfer of step s + 1's shard is posted *before* step s's block
  kernel runs, so communication overlaps compute.  Each rank keeps its running output and
  log-sum-exp in float32 (float64 for float64 inputs) across the steps and merges each block's
  partial result in the overflow-free form (sigmoid / logsigmoid of the LSE difference; the
  merge of ``attnkit/ops/sparse.py``).  The backward (a ``torch.autograd.Function``) sends the
  K/V shards around the ring again, together with float32 dK/dV accumulators that come back to
  their owner after W hops.
- :func:`shard_indices` -- the positions a rank holds, in the order the functions expect.
  Causal softmax uses the **zig-zag** layout (2W chunks; rank r holds chunks r and 2W-1-r), so
  that every rank does the same work at every ring step; everything else is contiguous.
- :func:`linear_attention` -- linear attention context parallel: each rank computes its
  chunk's state (Σ φ(k) vᵀ, Σ φ(k)); causal runs combine them by a prefix scan across ranks
  (Hillis-Steele, ceil(log2 W) rounds of point-to-point messages), non-causal ones by one
  all-reduce.  No K/V exchange.
- :func:`count_p2p` -- records every point-to-point message and collective these functions
  issue (the tests count them; the benchmark reads the time spent waiting).
- :func:`run_local_world` -- spawns W local processes joined in one process group on
  127.0.0.1 (tests and the benchmark use it), and reports every rank's failure instead of
  hanging.

Choices, named:

- ``ring_attention`` returns ``out`` alone by default and ``(out, lse)`` with
  ``return_lse=True``, like :func:`attnkit.softmax_attention` and every other op.  The LSE is
  computed either way (the ring merges each step's block result by it), so asking for it costs
  nothing extra; it is what lets a caller merge the result further
  (:func:`attnkit.merge_attention_states`).
- Uneven N: shards differ in length by at most one row per chunk (the first ``N mod parts``
  chunks are one longer); no padding.  A rank learns every shard's length (it must size its
  receive buffers) from one small ``all_gather`` per call (the *handshake*), which also checks
  that every rank passed the same B, H, Hk, D, Dv, dtype, causal and scale and that the local
  lengths are the layout of :func:`shard_indices` -- a mismatch raises the same ValueError on
  every rank instead of a hang or a size error inside the ring.  A rank whose own inputs fail
  validation still joins the handshake (with a failure flag), so every rank raises.  With
  ``seq_len=N`` the handshake is skipped (the lengths follow from N; nothing is checked): on
  GPUs the handshake costs a host synchronization per call.
- K and V travel as one packed buffer ``[B, Hk, n, D + Dv]`` in the inputs' dtype: one message
  per ring step instead of two.  dK/dV travel as one float32 buffer (float64 for float64): the
  accumulator crosses W ranks, and rounding it to bfloat16 at every hop would make the error grow
  with W.
- Partial outputs are merged into the float32 running output.  On the GPU backends they come
  out of the block kernel in the inputs' dtype (the kernels return that), rounded once each:
  their kernels round P to bfloat16 / float16 for P V anyway, which dominates the error.  On the
  ``cpu`` backend the blocks of float16 / bfloat16 inputs run on float32 copies, so the partial
  outputs are not rounded at all: a partial over few keys is larger than the final output (less
  averaging), and its rounding alone made the ring's bfloat16 error 2.3x that of the
  single-process kernel (3.7e-3 against 1.6e-3, W = 4, on a CPU without AVX-512 BF16, whose
  kernel keeps P in float32; issue 24).  The backward's blocks likewise (each block's dq, dk,
  dv unrounded before they are summed).  The cost is float32 copies of each block's inputs.
- The backward of each block is the kernels' own backward fed with the *global* output and LSE
  (the probabilities it recomputes, exp(s - lse), are then the global ones): no second pass.
- Causal zig-zag step schedule (rank r, K/V from rank j): j == r: causal over both own chunks;
  j < r: all local queries against chunk j only (chunk 2W-1-j lies after both of r's chunks);
  j > r: the later local chunk (2W-1-r) against both of j's chunks (chunk r lies before both).
  Every step after the first costs half a square block on every rank.
- Linear attention uses the contiguous layout also when causal (its cost does not depend on
  the position); the scan passes one packed buffer ``[B, H, D*Dv + D]`` per message.  An
  ``initial_state`` is the state before the whole sequence, passed identically on every rank;
  each rank adds it to its own prefix, so its gradient on a rank is that rank's part (sum them
  over the ranks, as for any replicated input).  ``return_state`` gives every rank the state
  after the whole sequence (a broadcast from the last rank); its backward all-reduces.
- Every rank must run the backward through every call (the backward is a ring too); a rank
  that skips it leaves the others waiting until the process group's timeout.

Tested on CPU with gloo (tests/test_distributed.py: world sizes 2 and 4).  NCCL uses the same
calls; it is not run yet (no multi-GPU machine so far).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import queue as _queue
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._validation import (
    check_bool,
    check_real,
    check_same_dtype_device,
    check_size_match,
    check_tensor,
)
from .ops import linear as _linear_ops
from .ops import softmax as _softmax_ops
from .ops.merge import merge_weights
from .reference.linear import feature_map_reference, state_dtype

__all__ = [
    "P2PEvent",
    "P2PLog",
    "WorldError",
    "count_p2p",
    "linear_attention",
    "ring_attention",
    "run_local_world",
    "shard_indices",
    "shard_lengths",
]

RING_OP = "attnkit.distributed.ring_attention"
LINEAR_OP = "attnkit.distributed.linear_attention"

# Message tags: the backward has a K/V and a dK/dV exchange in flight between the same pair of
# ranks at once (gloo matches messages by tag; NCCL ignores tags and orders them itself).
_TAG_KV, _TAG_DKV, _TAG_SCAN = 1, 2, 3


# ==============================================================================================
# layout
# ==============================================================================================


def _chunk_sizes(n: int, parts: int) -> list[int]:
    """``parts`` chunk lengths summing to n, differing by at most one (longer ones first)."""
    base, rem = divmod(n, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def _rank_chunks(n: int, rank: int, world_size: int, causal: bool) -> list[tuple[int, int]]:
    """[start, stop) ranges of the positions rank holds, in order."""
    parts = 2 * world_size if causal else world_size
    sizes = _chunk_sizes(n, parts)
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    ids = (rank, 2 * world_size - 1 - rank) if causal else (rank,)
    return [(starts[c], starts[c + 1]) for c in ids]


def _check_layout_args(fn: str, n, rank, world_size, causal) -> None:
    for name, value in (("n", n), ("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int; got {type(value).__name__}")
    if n < 0:
        raise ValueError(f"{fn}: n must be >= 0; got {n}")
    if world_size < 1:
        raise ValueError(f"{fn}: world_size must be >= 1; got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{fn}: rank must be in [0, {world_size}); got {rank}")
    check_bool(fn, "causal", causal)


def shard_indices(n: int, rank: int, world_size: int, causal: bool) -> torch.Tensor:
    """The sequence positions rank ``rank`` of ``world_size`` holds, in the order
    :func:`ring_attention` expects its local q, k, v (and returns its output and LSE).

    ``causal=False``: contiguous -- W chunks, rank r holds chunk r.
    ``causal=True``: zig-zag -- 2W chunks, rank r holds chunks r and 2W-1-r (in that order), so
    that every rank has the same amount of causal work at every ring step.
    Chunk lengths differ by at most one (the first ``n mod parts`` chunks are one longer), so
    N need not be divisible by anything; with N < parts some chunks are empty.

    :func:`linear_attention` takes the contiguous layout (``causal=False`` here) whether or not
    it is causal.

    Returns an int64 tensor (on the CPU) of the positions, increasing.  Shard a ``[B, H, N, D]``
    tensor with ``x[:, :, shard_indices(N, rank, W, causal)]`` (or ``index_select(2, ...)``).

    Example::

        >>> shard_indices(10, 0, 2, causal=True)     # chunks 0 and 3 of [3, 3, 2, 2]
        tensor([0, 1, 2, 8, 9])
    """
    _check_layout_args("attnkit.distributed.shard_indices", n, rank, world_size, causal)
    ranges = _rank_chunks(n, rank, world_size, causal)
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in ranges])


def shard_lengths(n: int, world_size: int, causal: bool) -> list[int]:
    """The number of positions each rank holds: ``[len(shard_indices(n, r, world_size, causal))
    for r in range(world_size)]``."""
    _check_layout_args("attnkit.distributed.shard_lengths", n, 0, world_size, causal)
    return [sum(b - a for a, b in _rank_chunks(n, r, world_size, causal))
            for r in range(world_size)]


# ==============================================================================================
# instrumentation: count_p2p
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class P2PEvent:
    """One message or collective issued by this rank.

    ``phase``: "forward" / "backward" (ring_attention), "linear_forward" / "linear_backward",
    or "handshake".  ``step``: the ring step (or scan round; 0 for a collective).
    ``what``: "kv", "dkv", "state", "meta" (or "block" for a kernel).  ``op``: "send", "recv",
    "all_gather", "broadcast", "all_reduce"; also "wait" (this rank starts waiting for the
    exchange of ``what`` posted at ``step``) and "kernel" (a ring step's block kernel starts),
    so that the order shows what overlaps what.  ``peer``: the group rank of the other end (-1
    for collectives, waits and kernels).  ``nbytes``: the payload this rank sends or receives
    (its own contribution for collectives; 0 for waits and kernels).
    """

    phase: str
    step: int
    what: str
    op: str
    peer: int
    nbytes: int


class P2PLog:
    """What :func:`count_p2p` records: ``events`` (:class:`P2PEvent`, in issue order) and
    ``waits`` (``(phase, step, what, seconds)``: the wall time this rank spent blocked waiting
    for each exchange to complete -- the communication that compute did not hide)."""

    def __init__(self) -> None:
        self.events: list[P2PEvent] = []
        self.waits: list[tuple[str, int, str, float]] = []

    def count(self, phase: str, op: str | None = None, step: int | None = None,
              what: str | None = None) -> int:
        """How many recorded events match the given fields."""
        return sum(1 for e in self.events if e.phase == phase and (op is None or e.op == op)
                   and (step is None or e.step == step) and (what is None or e.what == what))

    def wait_seconds(self, phase: str | None = None) -> float:
        return sum(s for p, _, _, s in self.waits if phase is None or p == phase)


_LOGS: list[P2PLog] = []


@contextlib.contextmanager
def count_p2p():
    """Record every point-to-point message and collective that attnkit.distributed issues on
    this rank inside the block::

        with attnkit.distributed.count_p2p() as log:
            out, lse = ring_attention(q, k, v, causal=True, return_lse=True)
            (out.sum() + lse.sum()).backward()
        log.count("forward", "send")       # W - 1
    """
    log = P2PLog()
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _record(phase, step, what, op, peer, tensor=None) -> None:
    if _LOGS:
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        event = P2PEvent(phase, step, what, op, peer, nbytes)
        for log in _LOGS:
            log.events.append(event)


# ==============================================================================================
# communication
# ==============================================================================================


class _Comm:
    """A process group seen from one rank: group rank, size, and the exchanges the algorithms
    use.  ``group=None`` with no initialized default group: a world of one (no communication)."""

    def __init__(self, group) -> None:
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.group, self.rank, self.world = None, 0, 1
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError("attnkit.distributed: this process is not a member of the group")

    def backend(self) -> str:
        return dist.get_backend(self.group) if self.group is not None else "none"

    def exchange(self, sends, recvs, phase: str, step: int, what: str, tag: int):
        """Post sends [(tensor, peer)] and receives [(tensor, peer)] as one batch; returns a
        handle for :meth:`wait`."""
        ops = []
        for tensor, peer in sends:
            _record(phase, step, what, "send", peer, tensor)
            ops.append(dist.P2POp(dist.isend, tensor, group=self.group, tag=tag, group_peer=peer))
        for tensor, peer in recvs:
            _record(phase, step, what, "recv", peer, tensor)
            ops.append(dist.P2POp(dist.irecv, tensor, group=self.group, tag=tag, group_peer=peer))
        works = dist.batch_isend_irecv(ops) if ops else []
        return (works, phase, step, what)

    @staticmethod
    def wait(handle) -> None:
        works, phase, step, what = handle
        _record(phase, step, what, "wait", -1)
        start = time.perf_counter()
        for work in works:
            work.wait()
        if _LOGS:
            spent = time.perf_counter() - start
            for log in _LOGS:
                log.waits.append((phase, step, what, spent))

    def all_gather(self, tensor: torch.Tensor, phase: str, what: str) -> list[torch.Tensor]:
        _record(phase, 0, what, "all_gather", -1, tensor)
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str, what: str) -> None:
        _record(phase, 0, what, "broadcast", -1, tensor)
        dist.broadcast(tensor, group=self.group, group_src=src)

    def all_reduce(self, tensor: torch.Tensor, phase: str, what: str) -> None:
        _record(phase, 0, what, "all_reduce", -1, tensor)
        dist.all_reduce(tensor, group=self.group)


# ==============================================================================================
# ring attention: plan (handshake), merge, block backward
# ==============================================================================================

_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_META_FIELDS = ("batch size B", "query heads H", "key/value heads Hk", "head dim D",
                "value head dim Dv", "dtype", "causal", "scale")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class _RingPlan:
    comm: _Comm
    n: int  # the global sequence length
    lengths: list[int]  # positions per rank
    first: list[int]  # causal: the length of each rank's first chunk (chunk r)
    causal: bool

    def block(self, src: int, n_local: int):
        """(query rows, key rows, causal) of the block that K/V from rank ``src`` contribute."""
        r = self.comm.rank
        everything = slice(0, n_local)
        if not self.causal:
            return everything, slice(0, self.lengths[src]), False
        if src == r:
            return everything, everything, True
        if src < r:
            return everything, slice(0, self.first[src]), False
        return slice(self.first[r], n_local), slice(0, self.lengths[src]), False


def _plan(comm: _Comm, causal: bool, n_local: int, meta: list[int] | None, local_error,
          seq_len: int | None) -> _RingPlan:
    """Every rank's shard length, from ``seq_len`` or from the handshake (an all_gather of each
    rank's shapes, which also checks that the ranks agree)."""
    w, r = comm.world, comm.rank
    if seq_len is None and w > 1:
        fields = [0 if local_error is not None else 1, n_local] + (meta or [0] * len(_META_FIELDS))
        device = torch.device("cuda", torch.cuda.current_device()) if comm.backend() == "nccl" \
            else torch.device("cpu")
        mine = torch.tensor(fields, dtype=torch.int64, device=device)
        rows = [t.tolist() for t in comm.all_gather(mine, "handshake", "meta")]
        if local_error is not None:
            raise local_error
        failed = [j for j, row in enumerate(rows) if row[0] == 0]
        if failed:
            raise ValueError(f"{RING_OP}: the inputs of rank(s) {failed} failed validation (see "
                             "the error raised there); every rank stops")
        for j, row in enumerate(rows):
            for name, a, b in zip(_META_FIELDS, rows[0][2:], row[2:]):
                if a != b:
                    if name == "scale":
                        a, b = (struct.unpack("<d", struct.pack("<q", x))[0] for x in (a, b))
                    raise ValueError(f"{RING_OP}: the ranks disagree on the {name}: rank 0 has "
                                     f"{a}, rank {j} has {b}")
        lengths = [row[1] for row in rows]
        n = sum(lengths)
        want = shard_lengths(n, w, causal)
        if lengths != want:
            layout = "zig-zag" if causal else "contiguous"
            raise ValueError(
                f"{RING_OP}: the local sequence lengths {lengths} are not the {layout} layout of "
                f"N = {n} over {w} ranks ({want}); shard with "
                f"shard_indices(N, rank, {w}, causal={causal})"
            )
    else:
        if local_error is not None:
            raise local_error
        n = seq_len if seq_len is not None else n_local
        lengths = shard_lengths(n, w, causal)
        if lengths[r] != n_local:
            raise ValueError(
                f"{RING_OP}: rank {r} holds {n_local} positions; shard_indices({n}, {r}, {w}, "
                f"causal={causal}) gives {lengths[r]}"
            )
    first = [b - a for a, b in (_rank_chunks(n, j, w, True)[0] for j in range(w))] if causal \
        else list(lengths)
    return _RingPlan(comm, n, lengths, first, causal)


def _merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- the softmax over the union of the two key sets, from each part's
    (output, log-sum-exp): attnkit.merge_attention_states's overflow-free merge
    (:func:`attnkit.ops.merge.merge_weights`).  A part with lse -inf (no keys) has weight 0."""
    w_b, merged = merge_weights(lse, lse_b)
    out.lerp_(out_b.to(out.dtype), w_b.unsqueeze(-1))
    lse.copy_(merged)


def _reference_block_backward(dout, dlse, q, k, v, out, lse, scale, causal):
    """Gradients of one block with the global out / lse, in plain PyTorch (the ``reference``
    backend; materializes the block's scores).  Returns float32 (float64) gradients."""
    acc = lse.dtype
    group = q.shape[1] // k.shape[1]
    qf = q.to(acc)
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    s = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    finite = torch.isfinite(lse).unsqueeze(-1)
    p = torch.where(finite, torch.exp(s - torch.where(finite, lse.unsqueeze(-1), 0.0)), 0.0)
    ds = torch.zeros_like(p)
    dv = torch.zeros_like(vf)
    if dout is not None:
        do = dout.to(acc)
        row = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vf.transpose(-2, -1)) - row)
        dv = torch.matmul(p.transpose(-2, -1), do)
    if dlse is not None:
        ds = ds + p * dlse.to(acc).unsqueeze(-1)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qf) * scale
    b, hk, m = k.shape[0], k.shape[1], k.shape[2]
    dk = dk.view(b, hk, group, m, -1).sum(2)
    dv = dv.view(b, hk, group, m, -1).sum(2)
    return dq, dk, dv


def _block_backward(backend, dout, dlse, q, k, v, out, lse, scale, causal):
    """(dq, dk, dv) of one block from the ``backend``'s backward kernel fed with the global
    ``out`` and ``lse``: its recomputed probabilities exp(scale q·k - lse) are the global ones,
    so the results are this block's exact share of the gradients.  The LSE's gradient is
    handled as in :mod:`attnkit.ops.softmax` (a second, probe call of the kernel)."""
    if backend == "reference":
        return _reference_block_backward(dout, dlse, q, k, v, out, lse, scale, causal)
    if backend in ("cpu", "cuda"):
        def run_bwd(g, v_, out_, _with_dropout):
            return torch.ops.attnkit.softmax_bwd(g, q, k, v_, out_, lse, None, scale, causal)
        probe = q.shape[-1] if q.is_cuda else None
    else:  # triton
        seed = torch.zeros((), dtype=torch.int64)

        def run_bwd(g, v_, out_, _with_dropout):
            return torch.ops.attnkit.softmax_triton_bwd(g, q, k, v_, out_, lse, None, scale,
                                                        causal, 0.0, seed)
        probe = None
    return _softmax_ops._gradients(run_bwd, (q, k, v, out, lse), dout, dlse, probe)


def _ring_forward(plan: _RingPlan, q, k, v, scale: float, backend: str):
    comm = plan.comm
    w, r = comm.world, comm.rank
    b, h, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    out = q.new_zeros((b, h, n, dv), dtype=acc)
    lse = q.new_full((b, h, n), -math.inf, dtype=acc)
    kv = torch.cat([k, v], dim=-1)  # the packed shard that travels: [B, Hk, n_src, D + Dv]
    nxt, prv = (r + 1) % w, (r - 1) % w
    unrounded_partials = backend == "cpu" and acc != q.dtype  # see the module docstring
    for step in range(w):
        src = (r - step) % w
        pending = recv = None
        if step < w - 1:  # post the next shard's transfer before this block's kernel
            recv = kv.new_empty((b, hk, plan.lengths[(r - step - 1) % w], d + dv))
            pending = comm.exchange([(kv, nxt)], [(recv, prv)], "forward", step, "kv", _TAG_KV)
        rows, keys, block_causal = plan.block(src, n)
        q_b = q[:, :, rows]
        k_b, v_b = kv[:, :, keys, :d], kv[:, :, keys, d:]
        if q_b.shape[2] > 0 and k_b.shape[2] > 0:
            _record("forward", step, "block", "kernel", -1)
            if unrounded_partials:
                q_b, k_b, v_b = q_b.to(acc), k_b.to(acc), v_b.to(acc)
            out_b, lse_b = _softmax_ops.softmax_attention(
                q_b, k_b, v_b, is_causal=block_causal, scale=scale, enable_gqa=True,
                return_lse=True, backend=backend)
            if step == 0:  # the own block covers every row: it starts the running result
                out.copy_(out_b)
                lse.copy_(lse_b)
            else:
                _merge_(out[:, :, rows], lse[:, :, rows], out_b, lse_b)
        if pending is not None:
            comm.wait(pending)
            kv = recv
    return out, lse


def _ring_backward(plan: _RingPlan, dout, dlse, q, k, v, out, lse, scale: float, backend: str):
    comm = plan.comm
    w, r = comm.world, comm.rank
    b, _, n, d = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    acc = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.cat([k, v], dim=-1)
    nxt, prv = (r + 1) % w, (r - 1) % w
    unrounded_partials = backend == "cpu" and acc != q.dtype  # see the module docstring
    dkv_pending = dkv_in = None
    for step in range(w):
        src = (r - step) % w
        kv_pending = kv_recv = None
        if step < w - 1:
            kv_recv = kv.new_empty((b, hk, plan.lengths[(r - step - 1) % w], d + dv))
            kv_pending = comm.exchange([(kv, nxt)], [(kv_recv, prv)], "backward", step, "kv",
                                       _TAG_KV)
        rows, keys, block_causal = plan.block(src, n)
        grads = None
        if (rows.stop - rows.start) > 0 and (keys.stop - keys.start) > 0:
            _record("backward", step, "block", "kernel", -1)
            block = [None if dout is None else dout[:, :, rows], q[:, :, rows], kv[:, :, keys, :d],
                     kv[:, :, keys, d:], out[:, :, rows]]
            if unrounded_partials:  # float32 copies: each block's gradients unrounded (as forward)
                block = [None if t is None else t.to(acc) for t in block]
            g_out, q_b, k_b, v_b, out_b = block
            grads = _block_backward(backend, g_out, None if dlse is None else dlse[:, :, rows],
                                    q_b, k_b, v_b, out_b, lse[:, :, rows], scale, block_causal)
        # The dK/dV accumulator of shard `src`: started here at step 0, else received from the
        # previous rank (which added its share one step earlier).
        if step == 0:
            dkv = torch.zeros((b, hk, plan.lengths[src], d + dv), dtype=acc, device=q.device)
        else:
            comm.wait(dkv_pending)
            dkv = dkv_in
        if grads is not None:
            dq_b, dk_b, dv_b = grads
            dq[:, :, rows] += dq_b
            dkv[:, :, keys, :d] += dk_b
            dkv[:, :, keys, d:] += dv_b
        if w > 1:
            # Pass it on; receive the accumulator of the shard we hold next (after the last
            # step: our own, back from its W-th hop).
            dkv_in = torch.empty((b, hk, plan.lengths[(r - step - 1) % w], d + dv), dtype=acc,
                                 device=q.device)
            dkv_pending = comm.exchange([(dkv, nxt)], [(dkv_in, prv)], "backward", step, "dkv",
                                        _TAG_DKV)
        if kv_pending is not None:
            comm.wait(kv_pending)
            kv = kv_recv
    if w > 1:
        comm.wait(dkv_pending)
        dkv = dkv_in
    return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, backend):
        out_acc, lse = _ring_forward(plan, q, k, v, scale, backend)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.backend = plan, scale, backend
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        # Even with no gradient on this rank the ring must run: the others wait for our share.
        dq, dk, dv = _ring_backward(ctx.plan, dout, dlse, q, k, v, out, lse, ctx.scale,
                                    ctx.backend)
        return dq, dk, dv, None, None, None


def _validate_ring(query, key, value, scale, backend):
    """Local checks of ring_attention's inputs; returns the handshake fields."""
    fn = RING_OP
    check_tensor(fn, "query", query, "[B, H, n, D]")
    check_tensor(fn, "key", key, "[B, Hk, n, D]")
    check_tensor(fn, "value", value, "[B, Hk, n, Dv]")
    check_same_dtype_device(fn, {"query": query, "key": key, "value": value})
    b, h, n, d = query.shape
    hk = key.shape[1]
    check_size_match(fn, "batch size B", {"query": b, "key": key.shape[0], "value": value.shape[0]})
    check_size_match(fn, "head dim D", {"query": d, "key": key.shape[3]})
    check_size_match(fn, "number of heads Hk", {"key": hk, "value": value.shape[1]})
    check_size_match(fn, "local sequence length n (self-attention over the same positions)",
                     {"query": n, "key": key.shape[2], "value": value.shape[2]})
    if hk == 0 or h % hk != 0:
        raise ValueError(f"{fn}: the query's heads must be a multiple of the key's (GQA); got "
                         f"query {h}, key {hk}")
    check_real(fn, "scale", scale, allow_none=True)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{fn}: backend must be a string or None; got {type(backend).__name__}")


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    scale: float | None = None,
    seq_len: int | None = None,
    backend: str | None = None,
    return_lse: bool = False,
):
    """Softmax attention over a sequence sharded across the ranks of a process group
    (context parallelism, "ring attention").  Returns ``out`` (with ``return_lse``,
    ``(out, lse)``) on every rank, like :func:`attnkit.softmax_attention`.

    Rank r passes the rows ``idx = shard_indices(N, r, W, causal)`` of the full sequence's
    tensors and gets back the same rows of ``softmax_attention(Q, K, V, is_causal=causal,
    scale=scale, enable_gqa=True, return_lse=True)`` computed on the whole sequence::

        out_full[:, :, idx], lse_full[:, :, idx]  ==  ring_attention(Q[:, :, idx], K[:, :, idx],
                                                                     V[:, :, idx], causal=causal,
                                                                     return_lse=True)

    Args:
        query: ``[B, H, n_r, D]`` -- this rank's queries (n_r = ``len(idx)``).
        key: ``[B, Hk, n_r, D]`` -- this rank's keys; H must be a multiple of Hk (GQA: query
            head h uses key head h // (H // Hk); K/V are never repeated).
        value: ``[B, Hk, n_r, Dv]``.  q, k, v: one floating dtype, one device (CPU tensors with
            a gloo group, CUDA tensors with an NCCL group).
        group: the process group (default: the default group; none initialized = one process).
        causal: causal self-attention over the global positions (then shard with the zig-zag
            layout, ``shard_indices(..., causal=True)``).
        scale: multiplies q·k; default 1/sqrt(D).
        seq_len: the global N, if known: skips the handshake (an ``all_gather`` of each rank's
            shapes that sizes the receive buffers and checks that the ranks agree).
        backend: the attnkit backend of every block (as in ``softmax_attention``; None picks
            ``cpu`` for CPU tensors, ``triton`` for CUDA tensors, routing what a kernel cannot
            run to the reference).
        return_lse: also return the log-sum-exp of each local row over the global keys.

    Returns:
        ``out`` ``[B, H, n_r, Dv]`` in the inputs' dtype; with ``return_lse`` the tuple
        ``(out, lse)``, lse ``[B, H, n_r]`` in float32 (float64 for float64 inputs).
        Differentiable (once) with respect to q, k, v; every rank must run the backward (it is
        a ring too).

    Algorithm: W steps; at step s rank r holds the K/V shard of rank (r - s) mod W, posts its
    transfer to r + 1 (and the receive of the next one from r - 1) as one
    ``batch_isend_irecv``, runs the block kernel meanwhile, merges the block's (out, lse) into
    its float32 running result (sigmoid/logsigmoid of the LSE difference) and waits.
    Messages per rank: forward W - 1 sends and W - 1 receives (one per step but the last);
    backward W - 1 K/V and W dK/dV exchanges (the dK/dV accumulators end at their owners).

    Example (in every rank of an initialized group)::

        >>> idx = shard_indices(N, dist.get_rank(), dist.get_world_size(), causal=True)
        >>> out = ring_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], causal=True)
    """
    comm = _Comm(group)
    check_bool(RING_OP, "causal", causal)
    check_bool(RING_OP, "return_lse", return_lse)
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)
                                or seq_len < 0):
        raise ValueError(f"{RING_OP}: seq_len must be None or an int >= 0; got {seq_len!r}")
    local_error, meta, n_local, chosen = None, None, 0, None
    try:
        _validate_ring(query, key, value, scale, backend)
        n_local = query.shape[2]
        if scale is None:
            scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] > 0 else 1.0
        scale = float(scale)
        chosen = _softmax_ops._route(backend, query, key, value, None, 0.0)
        b, h, _, d = query.shape
        meta = [b, h, key.shape[1], d, value.shape[-1], _DTYPE_CODES[query.dtype], int(causal),
                struct.unpack("<q", struct.pack("<d", scale))[0]]
    except (TypeError, ValueError, RuntimeError) as error:  # joins the handshake, then raises
        local_error = error
    plan = _plan(comm, causal, n_local, meta, local_error, seq_len)
    out, lse = _RingAttentionFn.apply(query, key, value, plan, scale, chosen)
    return (out, lse) if return_lse else out


# ==============================================================================================
# linear attention: prefix scan of chunk states
# ==============================================================================================


def _exclusive_scan(comm: _Comm, x: torch.Tensor, phase: str, reverse: bool):
    """Hillis-Steele scan over the ranks (position p = rank, or W-1-rank when ``reverse``):
    returns (Σ_{p' < p} x_p', Σ_{p' <= p} x_p').  Round t (t = 0 .. ceil(log2 W) - 1, d = 2^t):
    position p sends its running inclusive sum to p + d (if < W) and receives from p - d (if
    >= 0) -- one batch per round."""
    w = comm.world
    pos = (w - 1 - comm.rank) if reverse else comm.rank
    to_rank = (lambda p: w - 1 - p) if reverse else (lambda p: p)
    incl, excl = x, torch.zeros_like(x)
    d, rnd = 1, 0
    while d < w:
        sends = [(incl, to_rank(pos + d))] if pos + d < w else []
        recv = torch.empty_like(x) if pos - d >= 0 else None
        recvs = [(recv, to_rank(pos - d))] if recv is not None else []
        comm.wait(comm.exchange(sends, recvs, phase, rnd, "state", _TAG_SCAN))
        if recv is not None:
            incl, excl = incl + recv, excl + recv
        d, rnd = 2 * d, rnd + 1
    return excl, incl


def _pack_state(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.cat([s.flatten(2), z], dim=-1)


def _unpack_state(x: torch.Tensor, d: int, dv: int):
    s = x[..., : d * dv].reshape(*x.shape[:2], d, dv)
    return s, x[..., d * dv:]


class _StateScanFn(torch.autograd.Function):
    """(S, z) of this rank's chunk -> (exclusive prefix S, z; and the total when asked)."""

    @staticmethod
    def forward(ctx, s, z, comm, want_total):
        d, dv = s.shape[-2], s.shape[-1]
        x = _pack_state(s, z)
        excl, incl = _exclusive_scan(comm, x, "linear_forward", reverse=False)
        ctx.comm, ctx.want_total, ctx.dims = comm, want_total, (d, dv)
        total = None
        if want_total:
            total = incl.clone() if comm.rank == comm.world - 1 else torch.empty_like(x)
            if comm.world > 1:
                comm.broadcast(total, comm.world - 1, "linear_forward", "state")
        ps, pz = _unpack_state(excl, d, dv)
        if total is None:
            return ps, pz, None, None
        ts, tz = _unpack_state(total, d, dv)
        return ps, pz, ts, tz

    @staticmethod
    @once_differentiable
    def backward(ctx, g_ps, g_pz, g_ts, g_tz):
        comm = ctx.comm
        g = _pack_state(g_ps, g_pz)
        # S_r feeds the prefixes of every later rank: Σ over them (a reverse scan).
        grad, _ = _exclusive_scan(comm, g, "linear_backward", reverse=True)
        if ctx.want_total:
            # ... and the total on every rank: Σ over all ranks.
            gt = _pack_state(g_ts, g_tz).clone()
            if comm.world > 1:
                comm.all_reduce(gt, "linear_backward", "state")
            grad = grad + gt
        ds, dz = _unpack_state(grad, *ctx.dims)
        return ds, dz, None, None


class _StateAllReduceFn(torch.autograd.Function):
    """Σ over the ranks of (S, z); the backward all-reduces the gradients."""

    @staticmethod
    def forward(ctx, s, z, comm):
        d, dv = s.shape[-2], s.shape[-1]
        x = _pack_state(s, z).clone()
        if comm.world > 1:
            comm.all_reduce(x, "linear_forward", "state")
        ctx.comm, ctx.dims = comm, (d, dv)
        return _unpack_state(x, d, dv)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_s, g_z):
        g = _pack_state(g_s, g_z).clone()
        if ctx.comm.world > 1:
            ctx.comm.all_reduce(g, "linear_backward", "state")
        return (*_unpack_state(g, *ctx.dims), None)


def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    backend: str | None = None,
):
    """``attnkit.linear_attention`` over a sequence sharded across the ranks of a process group.

    Rank r passes the rows ``idx = shard_indices(N, r, W, causal=False)`` (the contiguous
    layout, also for causal runs) of the full tensors and gets back those rows of
    ``attnkit.linear_attention(Q, K, V, causal=causal, ...)`` on the whole sequence.

    Each rank computes its chunk's state S_r = Σ φ(k_j) v_jᵀ ``[B, H, D, Dv]``, z_r = Σ φ(k_j)
    ``[B, H, D]`` (float32; float64 for float64 inputs).  Causal: an exclusive prefix scan
    across the ranks (Hillis-Steele: ceil(log2 W) rounds; in round t rank r sends to r + 2^t
    and receives from r - 2^t, where those exist) gives P_r = S0 + Σ_{j<r} S_j, and the rank
    runs the single-process causal kernel on its chunk with ``initial_state=P_r``.  Non-causal:
    one all-reduce gives Σ_j S_j, and out = φ(q)ᵀS / (φ(q)·z + eps).  No K/V moves.

    Args:
        query, key: ``[B, H, n_r, D]``; value ``[B, H, n_r, Dv]``.
        group: the process group (default: the default group; none initialized = one process).
        causal, feature_map, normalize, eps, scale: as in ``attnkit.linear_attention``.
        initial_state: causal only; ``(S0 [B, H, D, Dv], z0 [B, H, D])``, the state before the
            whole sequence, passed identically on every rank.  Its gradient on a rank is that
            rank's part; sum it over the ranks (as for any replicated input).
        return_state: causal only; also return the state after the whole sequence, the same on
            every rank (a broadcast from the last rank): ``(out, (S, z))``.
        backend: the attnkit backend of the local causal kernel (non-causal runs are two
            matrix products in plain PyTorch, in float32 / float64).

    No handshake: the messages have the state's size, which every rank knows; ranks whose
    shapes differ fail in the transport (or time out) instead of raising a ValueError together.

    Returns:
        ``out [B, H, n_r, Dv]`` in the inputs' dtype, or ``(out, (S, z))``.  Differentiable
        (once) with respect to q, k, v and the initial state; every rank must run the backward.

    Messages per rank (causal): forward, per scan round, a send if r + 2^t < W and a receive if
    r - 2^t >= 0 (plus a broadcast with ``return_state``); the backward the same in reverse
    (plus an all-reduce with ``return_state``).  Non-causal: one all-reduce each way.
    """
    _linear_ops._validate(query, key, value, causal, feature_map, normalize, eps, scale,
                          initial_state, return_state)
    comm = _Comm(group)
    acc = state_dtype(query.dtype)
    phi_k = feature_map_reference(key.to(acc), feature_map)
    s_loc = torch.matmul(phi_k.transpose(-2, -1), value.to(acc))  # [B, H, D, Dv]
    z_loc = phi_k.sum(dim=-2)  # [B, H, D]
    if not causal:
        s_all, z_all = _StateAllReduceFn.apply(s_loc, z_loc, comm)
        phi_q = feature_map_reference(query.to(acc), feature_map)
        num = torch.matmul(phi_q, s_all)
        if normalize:
            out = num / (torch.matmul(phi_q, z_all.unsqueeze(-1)) + eps)
        else:
            out = num * scale
        return out.to(query.dtype)
    ps, pz, ts, tz = _StateScanFn.apply(s_loc, z_loc, comm, bool(return_state))
    if initial_state is not None:
        s0, z0 = initial_state
        ps, pz = ps + s0, pz + z0
        if return_state:
            ts, tz = ts + s0, tz + z0
    out = _linear_ops.linear_attention(
        query, key, value, causal=True, feature_map=feature_map, normalize=normalize, eps=eps,
        scale=scale, initial_state=(ps, pz), backend=backend)
    return (out, (ts, tz)) if return_state else out


# ==============================================================================================
# a local world of processes (tests, benchmark)
# ==============================================================================================


class WorldError(RuntimeError):
    """Some ranks of :func:`run_local_world` failed: ``errors`` maps each failed rank to its
    report (the exception and traceback, or why it was stopped); ``results`` holds the ranks
    that finished."""

    def __init__(self, errors: dict[int, str], results: dict[int, Any]) -> None:
        self.errors, self.results = errors, results
        lines = [f"{len(errors)} of the ranks failed:"]
        for rank in sorted(errors):
            lines.append(f"--- rank {rank}: {errors[rank].rstrip()}")
        super().__init__("\n".join(lines))


def _world_worker(rank, world_size, port, backend, collective_timeout_s, threads, fn, args,
                  results) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as error:  # noqa: BLE001  (reported to the parent, whatever it is)
        results.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()
        # No destroy_process_group: peers may be gone; leave at once (the parent reports).
        os._exit(1)


def run_local_world(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    process group, and return their results in rank order.

    The rendezvous store lives in this process (a ``TCPStore`` on 127.0.0.1, port chosen by the
    OS: no port race); each rank calls
    ``init_process_group(backend, timeout=collective_timeout_s)``, so a collective or
    point-to-point wait whose peer never comes raises after that long instead
    of hanging.  ``fn`` must be importable (a module-level function) and its result picklable.
    ``threads_per_rank``: torch's intra-op threads in each rank (default: the CPU count divided
    by the world size, at least 1).

    Raises :class:`WorldError` naming every failed rank with its exception and traceback: a
    rank that raised, one that died without reporting, and, once a rank has failed, the ranks
    still running ``collective_timeout_s`` + 10 s later (then stopped), or any rank still running
    after ``timeout_s``.
    """
    import torch.multiprocessing as mp

    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=collective_timeout_s))
    results_q = ctx.Queue()
    procs = [
        ctx.Process(target=_world_worker, daemon=True,
                    args=(rank, world_size, store.port, backend, collective_timeout_s,
                          threads_per_rank, fn, tuple(args), results_q))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    start = time.monotonic()
    deadline = start + timeout_s
    first_failure = None
    silent_since: dict[int, float] = {}
    try:
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            limit = deadline
            if first_failure is not None:
                limit = min(limit, first_failure + collective_timeout_s + 10.0)
            if now >= limit:
                break
            try:
                rank, status, payload = results_q.get(timeout=min(0.2, limit - now))
            except _queue.Empty:
                for rank, p in enumerate(procs):
                    if rank in results or rank in errors or p.is_alive():
                        continue
                    # Dead without a report (yet: its message may still be in the pipe).
                    since = silent_since.setdefault(rank, now)
                    if now - since > 2.0:
                        errors[rank] = f"exited with code {p.exitcode} without reporting"
                        first_failure = first_failure or now
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
                first_failure = first_failure or time.monotonic()
    finally:
        elapsed = time.monotonic() - start
        for rank, p in enumerate(procs):
            if p.is_alive() and rank not in results and rank not in errors:
                p.kill()
                errors[rank] = (f"still running after {elapsed:.1f} s (another rank failed, or "
                                f"timeout_s={timeout_s}); stopped")
        for p in procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join()
        results_q.close()
        del store
    if errors:
        raise WorldError(errors, results)
    return [results[r] for r in range(world_size)]

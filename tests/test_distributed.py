"""attnkit.distributed: context-parallel softmax (ring) and linear (prefix-scan) attention.

Each world size runs once, in spawned processes joined by gloo on 127.0.0.1
(``attnkit.distributed.run_local_world``), and computes every case there (process start-up
dominates: one world per size, all cases inside it).  Every rank builds the full inputs from
one seed, computes the single-process result (``attnkit.softmax_attention`` /
``attnkit.linear_attention`` on the whole sequence, with autograd), runs the distributed op
on its shard, and reports error figures and message logs; the tests below assert on them.

Tolerances (the issue's): float64 1e-10, float32 2e-5 (relative to the largest magnitude of
the single-process tensor; outputs, LSE and every gradient); bfloat16: the error against the
float64 result may not exceed twice the single-process bfloat16 error, at W = 2 and W = 4.
"""
from __future__ import annotations

import math
import time

import attnkit
import pytest
import torch
import torch.distributed as dist
from attnkit import distributed as cp

B, H, HK, D, DV = 2, 4, 2, 16, 12  # GQA cases use HK key heads; D != Dv on purpose
WORLDS = (2, 4)


def _n(world: int) -> int:
    """An N divisible neither by W nor by 2W (uneven shards, uneven zig-zag chunks)."""
    return 8 * world + 5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _inputs(seed, n, dtype, hk, dv=DV, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, hk, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, hk, n, dv, generator=g, dtype=torch.float64)
    go = torch.randn(B, H, n, dv, generator=g, dtype=torch.float64)
    gl = torch.randn(B, H, n, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)], go, gl


def _single(q, k, v, causal, go, gl):
    """Single-process softmax_attention on the whole sequence: out, lse, dq, dk, dv."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attnkit.softmax_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                         return_lse=True)
    loss = (out.double() * go).sum() + (lse.double() * gl).sum()
    loss.backward()
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _ring(q, k, v, causal, go, gl, idx, **kw):
    """ring_attention on this rank's shard: out, lse, dq, dk, dv (of the shard)."""
    q, k, v = (t[:, :, idx].detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = cp.ring_attention(q, k, v, causal=causal, return_lse=True, **kw)
    loss = (out.double() * go[:, :, idx]).sum() + (lse.double() * gl[:, :, idx]).sum()
    loss.backward()
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


NAMES = ("out", "lse", "dq", "dk", "dv")


def _softmax_errors(rank, world, dtype, causal, hk, seed, n, **kw):
    (q, k, v), go, gl = _inputs(seed, n, dtype, hk)
    idx = cp.shard_indices(n, rank, world, causal)
    ref = _single(q, k, v, causal, go, gl)
    got = _ring(q, k, v, causal, go, gl, idx, **kw)
    return {name: _rel(a, b[:, :, idx]) for name, a, b in zip(NAMES, got, ref)}


def _bf16_errors(rank, world, causal, seed, n):
    """Errors against float64 (on the same bfloat16-rounded inputs) of the ring and of
    single-process attnkit, both in bfloat16."""
    (q, k, v), go, gl = _inputs(seed, n, torch.bfloat16, HK, dv=32, d=32)
    idx = cp.shard_indices(n, rank, world, causal)
    exact = _single(q.double(), k.double(), v.double(), causal, go, gl)
    single = _single(q, k, v, causal, go, gl)
    ring = _ring(q, k, v, causal, go, gl, idx)
    return {name: (_rel(r, e[:, :, idx]), _rel(s[:, :, idx], e[:, :, idx]))
            for name, r, s, e in zip(NAMES, ring, single, exact)}


def _events(log):
    return [(e.phase, e.step, e.what, e.op, e.peer, e.nbytes) for e in log.events]


def _linear_case(rank, world, dtype, causal, seed, n, count=False):
    """Distributed vs single-process linear attention (elu, normalized), with an initial state
    and the returned state when causal.  Gradients of S0, z0 are summed over the ranks."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=torch.float64).to(dtype)
               for d in (D, D, DV))
    go = torch.randn(B, H, n, DV, generator=g, dtype=torch.float64)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s0 = torch.randn(B, H, D, DV, generator=g, dtype=torch.float64).to(acc)
    z0 = torch.rand(B, H, D, generator=g, dtype=torch.float64).to(acc) + 1.0
    gs = torch.randn(B, H, D, DV, generator=g, dtype=torch.float64)
    gz = torch.randn(B, H, D, generator=g, dtype=torch.float64)
    idx = cp.shard_indices(n, rank, world, False)

    def run(fn, q, k, v, go, state_loss=True, **kw):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        state = [t.detach().clone().requires_grad_() for t in (s0, z0)] if causal else []
        kw = dict(kw, causal=causal)
        if causal:
            kw.update(initial_state=tuple(state), return_state=True)
        res = fn(*leaves, **kw)
        out, (s, z) = res if causal else (res, (None, None))
        loss = (out.double() * go).sum()
        if causal and state_loss:  # the final state is on every rank: count it once
            loss = loss + (s.double() * gs).sum() + (z.double() * gz).sum()
        loss.backward()
        vals = [out.detach()] + ([s.detach(), z.detach()] if causal else [])
        return vals + [t.grad for t in leaves] + [t.grad for t in state]

    ref = run(attnkit.linear_attention, q, k, v, go)
    with cp.count_p2p() as log:
        got = run(cp.linear_attention, q[:, :, idx], k[:, :, idx], v[:, :, idx], go[:, :, idx],
                  state_loss=rank == world - 1)
    names = ["out"] + (["S", "z"] if causal else []) + ["dq", "dk", "dv"] + \
        (["dS0", "dz0"] if causal else [])
    errs = {}
    for name, a, b in zip(names, got, ref):
        if name in ("out", "dq", "dk", "dv"):
            b = b[:, :, idx]
        if name in ("dS0", "dz0"):  # per-rank parts of a replicated input: sum them
            a = a.clone()
            dist.all_reduce(a)
        errs[name] = _rel(a, b)
    return errs, (_events(log) if count else None)


def _world_job(rank: int, world: int) -> dict:
    """Every case of one world size; returns error figures and logs (small, picklable)."""
    torch.manual_seed(1234 + rank)
    res = {}
    n = _n(world)
    # float64 / float32: causal and not, MHA and GQA, uneven N.
    for causal in (False, True):
        for hk in (H, HK):
            res[("f64", causal, hk)] = _softmax_errors(rank, world, torch.float64, causal, hk,
                                                       10 + hk + causal, n)
    for causal, hk in ((False, H), (True, HK)):
        res[("f32", causal, hk)] = _softmax_errors(rank, world, torch.float32, causal, hk,
                                                   20 + causal, n)
    # The blocks on the pure-PyTorch backend (its own block backward): against the C++ kernel.
    res[("f64", True, HK, "reference")] = _softmax_errors(rank, world, torch.float64, True, HK,
                                                          25, n, backend="reference")
    # bfloat16 at one N for both world sizes (so the single-process error is the same).
    for causal in (False, True):
        res[("bf16", causal)] = _bf16_errors(rank, world, causal, 30 + causal, 259)

    # seq_len= skips the handshake: the same numbers, bit for bit; and the message counts.
    (q, k, v), go, gl = _inputs(40, n, torch.float64, HK)
    for causal in (False, True):
        idx = cp.shard_indices(n, rank, world, causal)
        with cp.count_p2p() as log:
            a = _ring(q, k, v, causal, go, gl, idx)
        b = _ring(q, k, v, causal, go, gl, idx, seq_len=n)
        res[("seq_len_equal", causal)] = all(torch.equal(x, y) for x, y in zip(a, b))
        res[("events", causal)] = _events(log)
        res[("waits", causal)] = len(log.waits)

    # Linear attention: causal with states (float64, float32), non-causal; scan messages.
    res[("linear", "f64", True)], res[("linear_events", True)] = _linear_case(
        rank, world, torch.float64, True, 50, n, count=True)
    res[("linear", "f32", True)], _ = _linear_case(rank, world, torch.float32, True, 51, n)
    res[("linear", "f64", False)], res[("linear_events", False)] = _linear_case(
        rank, world, torch.float64, False, 52, n, count=True)

    # Ranks that disagree, or a rank whose inputs are invalid: every rank raises ValueError.
    def raised(fn):
        try:
            fn()
        except ValueError as error:
            return str(error)
        return None

    qs = torch.randn(B, H, cp.shard_lengths(n, world, True)[rank], D)
    ks = torch.randn(B, HK, qs.shape[2], D)
    bad_d = torch.randn(B, HK, qs.shape[2], D, DV + rank)  # 5-D on every rank: invalid
    res["mismatch_dv"] = raised(
        lambda: cp.ring_attention(qs, ks, torch.randn(B, HK, qs.shape[2], DV + rank), causal=True))
    res["mismatch_invalid"] = raised(
        lambda: cp.ring_attention(qs, ks, bad_d if rank == world - 1 else ks, causal=True))
    m = cp.shard_lengths(n, world, False)[rank] + (rank == 0)  # rank 0: one row too many
    x = torch.randn(B, H, m, D)
    res["mismatch_layout"] = raised(lambda: cp.ring_attention(x, x, x, causal=False))
    # ... and the group still works afterwards.
    res["after_mismatch"] = _softmax_errors(rank, world, torch.float64, True, HK, 60, n)

    # A rank that never joins: the others' waits end with the group's timeout (2 s), not a hang.
    short = dist.new_group(list(range(world)), timeout=__import__("datetime").timedelta(seconds=2))
    if rank == 0:
        start = time.monotonic()
        try:
            n_short = 2 * world
            x = torch.randn(1, 1, cp.shard_lengths(n_short, world, False)[0], 4)
            cp.ring_attention(x, x, x, group=short, seq_len=n_short)
            res["timeout"] = ("no error", time.monotonic() - start)
        except RuntimeError as error:
            res["timeout"] = (str(error)[:300], time.monotonic() - start)
    dist.barrier()
    return res


_WORLD_RESULTS: dict[int, list[dict]] = {}


def _world(world: int) -> list[dict]:
    if world not in _WORLD_RESULTS:
        _WORLD_RESULTS[world] = cp.run_local_world(_world_job, world, timeout_s=240,
                                                   collective_timeout_s=60)
    return _WORLD_RESULTS[world]


# ----------------------------------------------------------------------------------------------
# layout (no processes)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [0, 1, 7, 16, 37, 1000])
def test_shard_indices_partition(n, world, causal):
    parts = [cp.shard_indices(n, r, world, causal) for r in range(world)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(n))
    for r, idx in enumerate(parts):
        assert idx.dtype == torch.int64 and bool((idx[1:] > idx[:-1]).all())
        assert len(idx) == cp.shard_lengths(n, world, causal)[r]
    lengths = [len(p) for p in parts]
    assert max(lengths) - min(lengths) <= (2 if causal else 1)


def test_shard_indices_zigzag_chunks():
    # 2W = 8 chunks of 37: [5, 5, 5, 5, 5, 4, 4, 4]; rank r holds chunks r and 7 - r.
    starts = [0, 5, 10, 15, 20, 25, 29, 33, 37]
    for r in range(4):
        want = list(range(starts[r], starts[r + 1])) + list(range(starts[7 - r], starts[8 - r]))
        assert cp.shard_indices(37, r, 4, True).tolist() == want
    assert cp.shard_indices(10, 1, 2, False).tolist() == [5, 6, 7, 8, 9]


def test_zigzag_balances_causal_work():
    # The query-key pairs each rank computes (causal, its rows against every earlier key): equal
    # when 2W divides N.
    n, world = 64, 4
    work = [int((cp.shard_indices(n, r, world, True) + 1).sum()) for r in range(world)]
    assert len(set(work)) == 1


def test_shard_indices_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        cp.shard_indices(10, 2, 2, False)
    with pytest.raises(TypeError, match="causal"):
        cp.shard_indices(10, 0, 2, 1)
    with pytest.raises(ValueError, match="n must"):
        cp.shard_indices(-1, 0, 2, False)


def test_single_process_without_a_group():
    # No process group initialized: a world of one, the same numbers as softmax_attention.
    (q, k, v), go, gl = _inputs(0, 29, torch.float64, HK)
    for causal in (False, True):
        got = _ring(q, k, v, causal, go, gl, torch.arange(29))
        ref = _single(q, k, v, causal, go, gl)
        for a, b in zip(got, ref):
            assert _rel(a, b) < 1e-12
    out = cp.linear_attention(q, q, v.repeat(1, 2, 1, 1), causal=True)
    assert _rel(out, attnkit.linear_attention(q, q, v.repeat(1, 2, 1, 1), causal=True)) < 1e-12


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_block_backends_single_process(backend):
    """The reference and Triton (interpreted here) block kernels, forward and backward through
    out and lse, against the C++ kernel (float32)."""
    if backend == "triton" and not attnkit.backends()["softmax"]["triton"].usable:
        pytest.skip("triton backend not usable here")
    (q, k, v), go, gl = _inputs(3, 20, torch.float32, 1, dv=D)
    got = _ring(q, k, v, True, go, gl, torch.arange(20), backend=backend)
    ref = _single(q, k, v, True, go, gl)
    for name, a, b in zip(NAMES, got, ref):
        assert _rel(a, b) < 2e-5, (name, _rel(a, b))


def test_merge_is_overflow_free():
    # LSEs far beyond exp's range (and -inf for an empty part) merge without inf / NaN.
    out = torch.tensor([[[[1.0], [2.0], [0.0]]]])
    lse = torch.tensor([[[1e4, -1e4, -math.inf]]])
    cp._merge_(out, lse, torch.tensor([[[[3.0], [4.0], [5.0]]]]),
               torch.tensor([[[1e4, -math.inf, 7.0]]]))
    assert torch.allclose(out.flatten(), torch.tensor([2.0, 2.0, 5.0]))
    assert torch.allclose(lse.flatten(), torch.tensor([1e4 + math.log(2.0), -1e4, 7.0]))


# ----------------------------------------------------------------------------------------------
# the worlds
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_ring_matches_single_process_float64_float32(world):
    """out, lse, dq, dk, dv of every rank's shard: float64 within 1e-10, float32 within 2e-5
    (causal and not; MHA and GQA; N not divisible by W or 2W)."""
    failures = []
    for rank, res in enumerate(_world(world)):
        for key, errs in res.items():
            if not (isinstance(key, tuple) and key[0] in ("f64", "f32")):
                continue
            tol = 1e-10 if key[0] == "f64" else 2e-5
            failures += [(rank, key, name, e) for name, e in errs.items() if not e <= tol]
    assert not failures, failures


@pytest.mark.parametrize("world", WORLDS)
def test_ring_bfloat16_error_does_not_grow(world):
    """bf16: each rank's error against float64 <= 2x single-process attnkit's bf16 error."""
    failures = []
    for rank, res in enumerate(_world(world)):
        for causal in (False, True):
            for name, (ring, single) in res[("bf16", causal)].items():
                if not ring <= 2.0 * single + 1e-7:
                    failures.append((rank, causal, name, ring, single))
    assert not failures, failures


@pytest.mark.parametrize("world", WORLDS)
def test_ring_message_counts(world):
    """Per rank: forward, one K/V send to r+1 and one receive from r-1 at every step but the
    last (W-1 each), plus one handshake all_gather; backward, W-1 K/V exchanges and W dK/dV
    exchanges (the accumulators' last hop brings them home); sizes as the layout says."""
    n = _n(world)
    for causal in (False, True):
        lengths = cp.shard_lengths(n, world, causal)
        for rank, res in enumerate(_world(world)):
            events = res[("events", causal)]
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            # The handshake: one all_gather of 10 int64 fields per call.
            assert [e for e in events if e[0] == "handshake"] == [
                ("handshake", 0, "meta", "all_gather", -1, 80)]
            for phase in ("forward", "backward"):
                for step in range(world):
                    mine = [e for e in events if e[0] == phase and e[1] == step]
                    got = sorted(e[2:5] for e in mine if e[3] in ("send", "recv"))
                    want = []
                    if step < world - 1:  # the shard held at step+1 comes from rank r-1
                        want += [("kv", "recv", prv), ("kv", "send", nxt)]
                    if phase == "backward":
                        want += [("dkv", "recv", prv), ("dkv", "send", nxt)]
                    assert got == sorted(want), (rank, phase, step, got)
                    # Overlap: the K/V exchange is posted before the step's kernel starts and
                    # waited for after it; the dK/dV accumulator is passed on after the kernel.
                    order = [e[2:4] for e in mine]
                    assert order.index(("block", "kernel")) >= 0
                    if step < world - 1:
                        assert order.index(("kv", "send")) < order.index(("block", "kernel")) \
                            < order.index(("kv", "wait")), order
                    if phase == "backward":
                        assert order.index(("block", "kernel")) < order.index(("dkv", "send"))
                    for e in mine:
                        if e[3] not in ("send", "recv"):
                            continue
                        # K/V (float64, D + Dv) and dK/dV (float64 accumulators) of the shard
                        # sent: held now (origin r-s) or received (origin r-s-1).
                        origin = (rank - step - (e[3] == "recv")) % world
                        assert e[5] == B * HK * lengths[origin] * (D + DV) * 8, e
            assert len([e for e in events if e[3] in ("send", "recv")]) == 2 * (3 * world - 2)
            assert res[("seq_len_equal", causal)]
            assert res[("waits", causal)] == (world - 1) + (world - 1) + world


@pytest.mark.parametrize("world", WORLDS)
def test_linear_matches_single_process(world):
    """Causal (with an initial state, returning the final state) and non-causal linear
    attention: out, final state, dq, dk, dv, d(initial state): float64 1e-10, float32 2e-5."""
    failures = []
    for rank, res in enumerate(_world(world)):
        for dtype, causal in (("f64", True), ("f32", True), ("f64", False)):
            tol = 1e-10 if dtype == "f64" else 2e-5
            failures += [(rank, dtype, causal, name, e)
                         for name, e in res[("linear", dtype, causal)].items() if not e <= tol]
    assert not failures, failures


@pytest.mark.parametrize("world", WORLDS)
def test_linear_scan_message_counts(world):
    """Causal: Hillis-Steele, ceil(log2 W) rounds; in round t rank r sends to r + 2^t if that
    exists and receives from r - 2^t if that exists, one packed state [B, H, D*Dv + D] each; the
    backward runs the rounds in reverse (to r - 2^t, from r + 2^t); return_state adds one
    broadcast forward and one all-reduce backward.  Non-causal: one all-reduce each way."""
    state_bytes = B * H * (D * DV + D) * 8
    rounds = math.ceil(math.log2(world))
    for rank, res in enumerate(_world(world)):
        events = res[("linear_events", True)]
        for phase, sign in (("linear_forward", 1), ("linear_backward", -1)):
            for t in range(rounds):
                got = sorted((e[3], e[4]) for e in events if e[0] == phase and e[1] == t
                             and e[3] in ("send", "recv"))
                want = []
                if 0 <= rank + sign * 2 ** t < world:
                    want.append(("send", rank + sign * 2 ** t))
                if 0 <= rank - sign * 2 ** t < world:
                    want.append(("recv", rank - sign * 2 ** t))
                assert got == sorted(want), (rank, phase, t, got)
            assert all(e[5] == state_bytes for e in events
                       if e[0] == phase and e[3] in ("send", "recv"))
            assert not [e for e in events if e[0] == phase and e[1] >= rounds]
        assert [e[3] for e in events if e[3] in ("broadcast", "all_reduce", "all_gather")] == [
            "broadcast", "all_reduce"]
        assert [e[:4] for e in res[("linear_events", False)] if e[3] != "wait"] == [
            ("linear_forward", 0, "state", "all_reduce"),
            ("linear_backward", 0, "state", "all_reduce")]


@pytest.mark.parametrize("world", WORLDS)
def test_disagreeing_ranks_raise_everywhere(world):
    """Ranks with different Dv, a rank with an invalid tensor, or shards that are not the
    layout: every rank raises ValueError from the handshake (no hang, no size error inside the
    ring), and the group keeps working."""
    for rank, res in enumerate(_world(world)):
        assert "disagree on the value head dim Dv" in res["mismatch_dv"]
        msg = res["mismatch_invalid"]
        assert ("4-D tensor" in msg) if rank == world - 1 else ("failed validation" in msg)
        assert "not the contiguous layout" in res["mismatch_layout"]
        assert all(e <= 1e-10 for e in res["after_mismatch"].values())


@pytest.mark.parametrize("world", WORLDS)
def test_absent_peer_times_out(world):
    """Rank 0 alone enters ring_attention on a group with a 2 s timeout: it raises (gloo's
    timeout) after about 2 s instead of waiting for ever."""
    message, seconds = _world(world)[0]["timeout"]
    assert "Timed out" in message or "timeout" in message.lower(), message
    assert 1.5 <= seconds <= 15, seconds


def _raise_on_rank_one(rank: int, world: int):
    q = torch.randn(1, 2, cp.shard_lengths(20, world, True)[rank], 8)
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return cp.ring_attention(q, q, q, causal=True).shape


def test_a_rank_that_raises_is_reported():
    """run_local_world: rank 1 raises before the call; rank 0, left waiting in the handshake,
    fails too (its peer is gone, or the 5 s timeout); both are reported with their errors, well
    before the overall deadline."""
    start = time.monotonic()
    with pytest.raises(cp.WorldError) as info:
        cp.run_local_world(_raise_on_rank_one, 2, timeout_s=120, collective_timeout_s=5)
    elapsed = time.monotonic() - start
    errors = info.value.errors
    assert "rank 1 fails on purpose" in errors[1]
    assert 0 in errors and "ring_attention" in errors[0], errors  # its traceback
    assert elapsed < 60, elapsed


def test_ring_returns_the_lse_only_when_asked():
    # Like softmax_attention: out alone by default, (out, lse) with return_lse=True (one process).
    (q, k, v), _, _ = _inputs(4, 13, torch.float32, HK)
    out = cp.ring_attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    out2, lse = cp.ring_attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    assert torch.equal(out, out2)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-6)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cp.ring_attention(q, k, v, return_lse=1)

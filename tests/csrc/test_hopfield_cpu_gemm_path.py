"""The Hopfield family's CPU kernels (csrc/cpu/hopfield.cpp) on each tile-GEMM path (issue 25,
csrc/cpu/gemm_path.h), forced by ``ATTNKIT_CPU_GEMM=native|brgemm|emulate`` as in
test_cpu_gemm_path.py.

For bfloat16 / float16 inputs off the native path, the update (attnkit::hopfield_update_fwd) and
the energy (attnkit::hopfield_energy_fwd) run their score and read-out GEMMs through brgemm on
16-bit operands (the states and probabilities rounded to the inputs' dtype, as the reference run in
that dtype rounds them); on this kind of CPU (no AMX) ``brgemm`` is torch's plain-layout reference
fallback and ``emulate`` attnkit's scalar model of the AMX kernel on the VNNI layout, with oneDNN's
K-tail NaN defect.  Their backwards are float32 (attnkit::softmax_bwd on the saved float32 states):
checked here all the same, through autograd.  Everything is held to the float64 reference by
DESIGN.md's rule (assert_close_to_reference: twice the error of the reference run in the dtype,
plus 1e-3), on shapes whose reduction dims are not multiples of 32 (D = 17, 40, 72; stored tiles
of 40, 88, 300 rows), one and two threads, the split-N decomposition (S <= 16, N >= 8192), tol,
values, NaN / inf inputs and empty ones.  The brgemm fallback and emulate are scalar: shapes stay small.
"""
import math

import pytest
import torch

import attnkit
from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference
from attnkit_testing import F64, assert_close_to_reference, has_cpu_kernel, num_threads

F16, BF16 = torch.float16, torch.bfloat16
ENV = "ATTNKIT_CPU_GEMM"

pytestmark = pytest.mark.skipif(not has_cpu_kernel("hopfield_update_fwd"), reason="attnkit._C is not built")


def _inputs(b, h, s, n, d, dv, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s, d, generator=g, dtype=F64) * spread,
            torch.randn(b, h, n, d, generator=g, dtype=F64) * spread,
            torch.randn(b, h, n, dv, generator=g, dtype=F64))


def _upd(state, stored, values=None, beta=0.3, steps=1, tol=None, final_state=False):
    return torch.ops.attnkit.hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state)


# ----------------------------------------------------------------------------------------------
# the update: forward and gradients
# ----------------------------------------------------------------------------------------------


def _update_run(kind, inputs, dtype, beta, steps, tol):
    """(out, grad state, grad stored[, grad values]) of hopfield_update from the loss <out, w>:
    the cpu kernel (kind "cpu") or the reference in ``dtype`` ("lowp") or in float64 ("ref64"),
    all from the inputs rounded to ``dtype``."""
    leaves = [None if t is None else t.to(dtype) for t in inputs]
    if kind == "ref64":
        leaves = [None if t is None else t.double() for t in leaves]
    leaves = [None if t is None else t.detach().requires_grad_() for t in leaves]
    state, stored, values = leaves
    if kind == "cpu":
        out = attnkit.hopfield_update(state, stored, beta=beta, steps=steps, values=values, tol=tol, backend="cpu")
    else:
        out = hopfield_update_reference(state, stored, beta=beta, steps=steps, values=values, tol=tol)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=F64).to(out.dtype)
    wanted = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((out * w).sum(), wanted)
    return [out.detach(), *grads]


def _check_update(inputs, dtype, beta, steps, tol=None):
    got = _update_run("cpu", inputs, dtype, beta, steps, tol)
    ref64 = _update_run("ref64", inputs, dtype, beta, steps, tol)
    lowp = _update_run("lowp", inputs, dtype, beta, steps, tol)
    assert got[0].dtype == dtype
    for name, a, b, c in zip(("out", "grad state", "grad stored", "grad values"), got, ref64, lowp):
        assert_close_to_reference(a, b, c, grad=name != "out", name=name, dtype=dtype)
    return got


# (B, H, S, N, D, Dv, steps, with values, beta): D = 17 / 40 / 72 (the scores' K tails, odd D),
# N = 40, 300, 600 (the read-outs' K: one tile of 40 or 300 rows; 512 + 88 rows), S = 70 (> 64:
# the GEMM blocks rather than the streaming kernel on AVX-512 builds), 9000 rows with S = 3 and
# B = H = 1 (split-N: chunks of 4096 rows merged by log-sum-exp).
UPDATE_CASES = [
    (1, 2, 7, 40, 17, 5, 2, True, 0.25),
    (1, 1, 70, 300, 40, 19, 3, False, 1 / math.sqrt(40)),
    (2, 1, 5, 600, 72, 3, 2, True, 0.125),
    (1, 1, 9, 40, 40, 40, 4, False, 0.2),
    (1, 1, 3, 9000, 40, 7, 2, True, 0.15),
]


@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-s{c[6]}-v{int(c[7])}")
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_update_matches_reference(forced, case, dtype):
    b, h, s, n, d, dv, steps, with_values, beta = case
    state, stored, values = _inputs(b, h, s, n, d, dv)
    _check_update((state, stored, values if with_values else None), dtype, beta, steps)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_update_thread_counts(forced, threads, dtype):
    # S = 150: two blocks of 128 + 22 states (the brgemm path's fixed block size).
    state, stored, values = _inputs(1, 2, 150, 100, 40, 9, seed=1)
    with num_threads(threads):
        _check_update((state, stored, values), dtype, 0.2, 3)


def test_update_is_the_same_on_one_and_two_threads(monkeypatch):
    monkeypatch.setenv(ENV, "emulate")
    state, stored, values = (t.to(BF16) for t in _inputs(1, 2, 150, 100, 40, 9, seed=1))
    results = []
    for threads in (1, 2):
        with num_threads(threads):
            results.append(_upd(state, stored, values, beta=0.2, steps=3, final_state=True))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_update_tol_freezes_rows_as_the_reference(forced):
    # States on stored patterns far apart: every row freezes after its first update (change far
    # below tol), so later steps skip (lse +inf) -- the decisions are far from tol's edge.
    state, stored, _ = _inputs(1, 2, 7, 300, 40, 1, seed=2, spread=4.0)
    state = stored[:, :, 10:17].clone()
    for dtype in (BF16, F16):
        _check_update((state, stored, None), dtype, 1.0, 3, tol=1e-2)
        out, states, lse, applied = _upd(state.to(dtype), stored.to(dtype), beta=1.0, steps=3, tol=1e-2)
        assert applied[0].all() and not applied[1:].any()
        assert torch.isinf(lse[1:]).all() and (lse[1:] > 0).all()


def test_update_final_state_with_values(forced):
    # final_state: the value step also reads out through X (accx).
    state, stored, values = (t.to(BF16) for t in _inputs(1, 1, 9, 72, 40, 6, seed=3))
    out, states, lse, _ = _upd(state, stored, values, beta=0.3, steps=2, final_state=True)
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.3, steps=2)
    lowp = hopfield_update_reference(state, stored, beta=0.3, steps=2)
    assert_close_to_reference(states[2], want, lowp, name="final state", dtype=BF16)


def test_brgemm_paths_are_taken(monkeypatch):
    # The 16-bit probabilities of the brgemm paths change the float32 outputs against native.
    state, stored, values = (t.to(BF16) for t in _inputs(1, 1, 9, 72, 40, 6, seed=4))
    outs = {}
    for path in ("native", "brgemm", "emulate"):
        monkeypatch.setenv(ENV, path)
        outs[path] = _upd(state, stored, values, beta=0.3, steps=2)[0]
        assert not torch.isnan(outs[path]).any()
    assert not torch.equal(outs["native"], outs["brgemm"])
    assert not torch.equal(outs["native"], outs["emulate"])


def test_float32_ignores_a_forced_brgemm(monkeypatch):
    state, stored, values = (t.float() for t in _inputs(1, 1, 9, 72, 40, 6, seed=5))
    outs = []
    for path in ("native", "emulate"):
        monkeypatch.setenv(ENV, path)
        outs.append(_upd(state, stored, values, beta=0.3, steps=2)[0])
    assert torch.equal(*outs)


# ----------------------------------------------------------------------------------------------
# the energy: forward and gradients
# ----------------------------------------------------------------------------------------------

# (S, N, D): tiles of 64 states x 256 patterns; D = 17 / 40 / 72 (K tails).
ENERGY_SIZES = [(1, 1, 1), (9, 300, 40), (70, 37, 72), (5, 600, 17)]


@pytest.mark.parametrize("s,n,d", ENERGY_SIZES)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_energy_matches_reference(forced, s, n, d, dtype):
    state, stored, _ = _inputs(2, 1, s, n, d, 1, seed=6)
    lo = [t.to(dtype).requires_grad_() for t in (state, stored)]
    hi = [t.detach().double().requires_grad_() for t in lo]
    energy, lse = torch.ops.attnkit.hopfield_energy_fwd(*lo, 0.5)  # autograd: attnkit.ops.hopfield
    want = hopfield_energy_reference(*hi, 0.5)
    want_lse = torch.logsumexp(0.5 * hi[0] @ hi[1].transpose(-1, -2), -1)
    lowp = hopfield_energy_reference(*lo, 0.5)
    lowp_lse = torch.logsumexp(0.5 * lo[0] @ lo[1].transpose(-1, -2), -1)
    assert energy.dtype == lse.dtype == torch.float32
    assert_close_to_reference(energy.detach(), want.detach(), lowp.detach(), name="energy", dtype=dtype)
    assert_close_to_reference(lse.detach(), want_lse.detach(), lowp_lse.detach(), name="lse", dtype=dtype)
    # gradients of both outputs (the float32 backward), from the same loss
    gw = torch.randn(energy.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    gl = torch.randn(energy.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    got = torch.autograd.grad((energy * gw.float()).sum() + (lse * gl.float()).sum(), lo)
    ref = torch.autograd.grad((want * gw).sum() + (want_lse * gl).sum(), hi)
    lo2 = [t.detach().requires_grad_() for t in lo]
    ref_lo = torch.autograd.grad((hopfield_energy_reference(*lo2, 0.5) * gw.to(dtype)).sum()
                                 + (torch.logsumexp(0.5 * lo2[0] @ lo2[1].transpose(-1, -2), -1) * gl.to(dtype)).sum(),
                                 lo2)
    for name, a, b, c in zip(("grad state", "grad stored"), got, ref, ref_lo):
        assert_close_to_reference(a, b, c, grad=True, name=name, dtype=dtype)


@pytest.mark.parametrize("threads", [1, 2])
def test_energy_thread_counts(forced, threads):
    state, stored, _ = _inputs(2, 2, 70, 300, 40, 1, seed=10)
    lo = [t.to(BF16) for t in (state, stored)]
    with num_threads(threads):
        energy, _ = torch.ops.attnkit.hopfield_energy_fwd(*lo, 0.5)
    want = hopfield_energy_reference(*(t.double() for t in lo), 0.5)
    assert_close_to_reference(energy, want, hopfield_energy_reference(*lo, 0.5), name="energy", dtype=BF16)


# ----------------------------------------------------------------------------------------------
# NaN / inf and empty inputs
# ----------------------------------------------------------------------------------------------

# The K-tail guard (gemm_path.h): with K > 32 and K % 32 != 0, oneDNN on AMX (and emulate) writes
# a NaN of the left operand's row i + 1 into output row i.  Here state row 5 holds a NaN: its own
# outputs are NaN, its neighbours' (rows 4 and 6) must stay finite and exact.  D = 40 / 72 (the
# scores' K), N = 40 / 72 (the read-outs' K).  Checked: with the read-out's K left at the tile's
# 40 rows instead of bkp = round_up(40, 32) in retrieve_range16, the update cases failed under
# emulate (row 4 NaN); with the energy's Dp = D (no zero padding of the state rows), the energy
# cases did.
@pytest.mark.parametrize("d", [40, 72])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_nan_in_one_state_row_stays_in_that_row(forced, d, dtype):
    state, stored, values = (t.to(dtype) for t in _inputs(1, 1, 9, d, d, 6, seed=11))
    state[0, 0, 5, 3] = float("nan")
    clean = state.clone()
    clean[0, 0, 5] = 0
    for vals in (None, values):
        out = _upd(state, stored, vals, beta=0.3, steps=2)[0]
        want = _upd(clean, stored, vals, beta=0.3, steps=2)[0]
        assert torch.isnan(out[0, 0, 5]).all()
        rows = [r for r in range(9) if r != 5]
        assert torch.equal(out[0, 0, rows], want[0, 0, rows])
    energy, lse = torch.ops.attnkit.hopfield_energy_fwd(state, stored, 0.3)
    e_want, l_want = torch.ops.attnkit.hopfield_energy_fwd(clean, stored, 0.3)
    assert torch.isnan(energy[0, 0, 5]) and torch.isnan(lse[0, 0, 5])
    rows = [r for r in range(9) if r != 5]
    assert torch.equal(energy[0, 0, rows], e_want[0, 0, rows]) and torch.equal(lse[0, 0, rows], l_want[0, 0, rows])


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_nan_and_inf_in_the_stored_patterns_behave_as_native(forced, dtype, monkeypatch):
    # A NaN pattern makes every row NaN; an infinite entry gives +-inf scores.  The brgemm paths
    # must give the native kernels' NaN / inf pattern, and their finite values within the rule.
    state, stored, values = (t.to(dtype) for t in _inputs(1, 1, 9, 72, 40, 6, seed=12))
    nan_stored = stored.clone()
    nan_stored[0, 0, 21, 5] = float("nan")
    assert torch.isnan(_upd(state, nan_stored, values, steps=2)[0]).all()
    assert torch.isnan(torch.ops.attnkit.hopfield_energy_fwd(state, nan_stored, 0.3)[1]).all()
    inf_stored = stored.clone()
    inf_stored[0, 0, 30, 7] = float("inf")
    got = _upd(state, inf_stored, values, steps=2)
    got_e = torch.ops.attnkit.hopfield_energy_fwd(state, inf_stored, 0.3)
    monkeypatch.setenv(ENV, "native")
    want = _upd(state, inf_stored, values, steps=2)
    want_e = torch.ops.attnkit.hopfield_energy_fwd(state, inf_stored, 0.3)
    for a, b in [*zip(got[:3], want[:3]), *zip(got_e, want_e)]:
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b))
        assert torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
        fin = torch.isfinite(b)
        if fin.any():
            torch.testing.assert_close(a[fin], b[fin], rtol=0, atol=1e-2 * (1 + b[fin].abs().max().item()))


def test_empty_inputs(forced):
    for dtype in (BF16, F16):
        out, states, lse, applied = _upd(torch.randn(2, 3, 0, 40, dtype=dtype), torch.randn(2, 3, 5, 40, dtype=dtype),
                                         steps=2)
        assert out.shape == (2, 3, 0, 40) and states.shape == (3, 2, 3, 0, 40) and lse.shape == (2, 2, 3, 0)
        energy, lse = torch.ops.attnkit.hopfield_energy_fwd(torch.randn(2, 3, 0, 40, dtype=dtype),
                                                           torch.randn(2, 3, 5, 40, dtype=dtype), 0.5)
        assert energy.shape == lse.shape == (2, 3, 0)

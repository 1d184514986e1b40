"""The C++ CPU op attnkit::hopfield_energy_fwd (csrc/cpu/hopfield.cpp) and its Python
registrations (fake, autograd with the chunked backward) in pytorch_ext/ops/hopfield.py."""
import importlib
import math

import pytest
import torch

import attnkit
from attnkit.reference.hopfield import hopfield_energy_reference
from attnkit_testing import assert_close_to_reference, num_threads

hop_ops = importlib.import_module("attnkit.ops.hopfield")
pytestmark = pytest.mark.skipif(
    not attnkit.backends()["hopfield_energy"]["cpu"].usable, reason="attnkit._C is not built"
)
F64 = torch.float64


def _op(state, stored, beta):
    return torch.ops.attnkit.hopfield_energy_fwd(state, stored, beta)


def _scale_close(got, want, rtol):
    torch.testing.assert_close(got.to(F64), want, rtol=rtol, atol=rtol * want.abs().max().item())


# The kernel tiles 8 queries x 16 patterns: sizes straddle both tile edges.
SIZES = [(1, 1, 1), (7, 16, 16), (8, 17, 63), (9, 300, 64), (129, 7, 16), (3, 1000, 33)]


@pytest.mark.parametrize("s,n,d", SIZES)
@pytest.mark.parametrize("beta", [0.01, 1.0, 10.0])
def test_float32_energy_and_lse_match_float64(s, n, d, beta):
    state = torch.randn(2, 3, s, d)
    stored = torch.randn(2, 3, n, d)
    energy, lse = _op(state, stored, beta)
    assert energy.dtype == lse.dtype == torch.float32 and energy.shape == lse.shape == (2, 3, s)
    s64, x64 = state.double(), stored.double()
    _scale_close(energy, hopfield_energy_reference(s64, x64, beta), 2e-5)
    _scale_close(lse, torch.logsumexp(beta * s64 @ x64.transpose(-1, -2), dim=-1), 2e-5)


@pytest.mark.parametrize("s,n,d", SIZES)
def test_float64_matches_reference_to_rounding(s, n, d):
    state = torch.randn(2, 3, s, d, dtype=F64)
    stored = torch.randn(2, 3, n, d, dtype=F64)
    energy, lse = _op(state, stored, 0.3)
    assert energy.dtype == lse.dtype == F64
    torch.testing.assert_close(energy, hopfield_energy_reference(state, stored, 0.3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(0.3 * state @ stored.transpose(-1, -2), -1),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_float32(dtype):
    state = torch.randn(2, 3, 9, 64).to(dtype)
    stored = torch.randn(2, 3, 300, 64).to(dtype)
    energy, _ = _op(state, stored, 0.5)
    assert energy.dtype == torch.float32
    want = hopfield_energy_reference(state.double(), stored.double(), 0.5)
    ref_err = (hopfield_energy_reference(state, stored, 0.5).double() - want).abs().max()
    err = (energy.double() - want).abs().max()
    assert err <= 2 * ref_err + 1e-3
    # The inputs are exact in float32, so the float32 kernel's error bound applies as well.
    _scale_close(energy, want, 2e-5)


@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_low_precision_energy_is_the_float32_kernel_bit_for_bit(monkeypatch, dtype, d):
    """On the native path 16-bit inputs are widened (exactly) and run on the float32 kernels
    (energy_fast at D = 64, the generic kernel at D = 40): energy and lse bit for bit those of the
    widened inputs.  (Before session 26 the 16-bit energy ran the generic kernel at every D: at
    D = 64 its sums differ from energy_fast's, and this test fails there.)"""
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    g = torch.Generator().manual_seed(11)
    state = torch.randn(2, 3, 37, d, generator=g).to(dtype)
    stored = torch.randn(2, 3, 300, d, generator=g).to(dtype)
    energy, lse = _op(state, stored, 0.4)
    energy32, lse32 = _op(state.float(), stored.float(), 0.4)
    assert torch.equal(energy, energy32) and torch.equal(lse, lse32)


@pytest.mark.parametrize("scale,beta", [(10.0, 10.0), (0.01, 0.01), (0.1, 0.001), (30.0, 1.0)])
def test_extreme_scores_stay_finite_and_accurate(scale, beta):
    # Scores up to ~1e4 (exp would overflow without the running max) and ~1e-6.  In the small
    # cases E is ~1e-5 of its terms (lse/β ≈ log N/β): a plain float32 evaluation (the float32
    # reference, say) is off by ~1e-2 relative there; the kernel redoes such rows in double.
    state = torch.randn(1, 2, 9, 32, dtype=F64) * scale
    stored = torch.randn(1, 2, 100, 32, dtype=F64) * scale
    energy, _ = _op(state.float(), stored.float(), beta)
    assert torch.isfinite(energy).all()
    _scale_close(energy, hopfield_energy_reference(state, stored, beta), 2e-5)


def test_non_contiguous_inputs():
    state = torch.randn(2, 9, 3, 16).transpose(1, 2)
    stored = torch.randn(2, 3, 40, 32)[..., 1::2]
    energy, lse = _op(state, stored, 0.5)
    e2, l2 = _op(state.contiguous(), stored.contiguous(), 0.5)
    assert torch.equal(energy, e2) and torch.equal(lse, l2)


def test_empty_queries():
    energy, lse = _op(torch.randn(2, 3, 0, 16), torch.randn(2, 3, 5, 16), 0.5)
    assert energy.shape == lse.shape == (2, 3, 0)


def test_nan_input_gives_nan_not_a_silent_number():
    state = torch.randn(1, 1, 3, 16)
    stored = torch.randn(1, 1, 40, 16)
    stored[0, 0, 21, 5] = float("nan")
    energy, lse = _op(state, stored, 0.5)
    assert torch.isnan(lse).all() and torch.isnan(energy).all()


@pytest.mark.parametrize(
    "state,stored,beta,match",
    [
        (torch.randn(3, 7, 16), torch.randn(1, 3, 9, 16), 0.5, "expected state"),
        (torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16, dtype=F64), 0.5, "must share a dtype"),
        (torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 8), 0.5, "must agree on B, H and D"),
        (torch.randn(1, 3, 7, 16), torch.randn(1, 3, 0, 16), 0.5, "at least one stored pattern"),
        (torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16), 0.0, "beta must be finite and > 0"),
        (torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16), math.inf, "beta must be finite and > 0"),
    ],
)
def test_kernel_checks_its_inputs(state, stored, beta, match):
    with pytest.raises(RuntimeError, match=match):
        _op(state, stored, beta)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_opcheck(dtype):
    state = torch.randn(2, 3, 7, 16, dtype=dtype, requires_grad=True)
    stored = torch.randn(2, 3, 17, 16, dtype=dtype).transpose(-1, -2).contiguous().transpose(-1, -2)
    stored.requires_grad_()
    torch.library.opcheck(torch.ops.attnkit.hopfield_energy_fwd.default, (state, stored, 0.7))


def test_gradcheck_both_outputs_and_gradgradcheck():
    state = torch.randn(1, 2, 3, 5, dtype=F64, requires_grad=True)
    stored = torch.randn(1, 2, 7, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, x: _op(a, x, 0.6), (state, stored))
    # The backward is made of differentiable torch ops, so second derivatives work too.
    state, stored = state[:, :1, :2, :3].detach().requires_grad_(), stored[:, :1, :4, :3].detach().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, x: _op(a, x, 0.6), (state, stored))


def _explicit_grads(state, stored, beta, g_energy, g_lse):
    """dE/dξ = ξ − Σ p_i x_i, dE/dx_i = −p_i ξ (+ x_i on the first max-norm row), and
    d lse/dξ = β Σ p_i x_i, d lse/dx_i = β p_i ξ, written with full S×N probabilities."""
    probs = torch.softmax(beta * state @ stored.transpose(-1, -2), dim=-1)  # [B,H,S,N]
    mix = probs @ stored
    g_state = g_energy[..., None] * (state - mix) + g_lse[..., None] * beta * mix
    weights = probs * (beta * g_lse - g_energy)[..., None]
    g_stored = weights.transpose(-1, -2) @ state
    b_, h_, n_ = stored.shape[:3]
    norms = stored.pow(2).sum(-1)
    for b in range(b_):
        for h in range(h_):
            top = next(i for i in range(n_) if norms[b, h, i] == norms[b, h].max())
            g_stored[b, h, top] += g_energy[b, h].sum() * stored[b, h, top]
    return g_state, g_stored


@pytest.mark.parametrize("budget", [1, 40, 1 << 22, "kernel"])
def test_backward_slices_the_probabilities_and_matches_explicit_gradients(monkeypatch, budget):
    """The backward's formula in slices of the stored patterns (what the GPU backends run; on
    CPU the C++ softmax kernels compute the same sums: budget "kernel") against explicit
    gradients."""
    b_, h_, s_, n_, d_ = 2, 2, 5, 37, 8
    kernel = budget == "kernel"
    if kernel:
        budget = 1 << 22
    else:
        monkeypatch.setattr(hop_ops, "_SOFTMAX_BWD", False)  # no kernel: the slices
    monkeypatch.setattr(hop_ops, "_BWD_PROBS_BUDGET", budget)
    seen = []
    real = hop_ops._chunk_probs

    def recording(xi, x_chunk, lse, beta):
        p = real(xi, x_chunk, lse, beta)
        seen.append(p.shape)
        return p

    monkeypatch.setattr(hop_ops, "_chunk_probs", recording)
    state = torch.randn(b_, h_, s_, d_, dtype=F64, requires_grad=True)
    stored = torch.randn(b_, h_, n_, d_, dtype=F64, requires_grad=True)
    # Two rows share the largest norm: the subgradient goes to the first of them.
    with torch.no_grad():
        top = stored.pow(2).sum(-1).argmax(-1)
        for b in range(b_):
            for h in range(h_):
                stored[b, h, 0] = -stored[b, h, top[b, h]] if top[b, h] != 0 else stored[b, h, 0]
    g_energy = torch.randn(b_, h_, s_, dtype=F64)
    g_lse = torch.randn(b_, h_, s_, dtype=F64)
    energy, lse = _op(state, stored, 0.4)
    got = torch.autograd.grad((energy, lse), (state, stored), (g_energy, g_lse))
    want = _explicit_grads(state.detach(), stored.detach(), 0.4, g_energy, g_lse)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    if kernel:
        assert not seen
        return
    chunk = max(1, min(n_, budget // (b_ * h_ * s_)))
    assert seen and all(shape == (b_, h_, s_, min(chunk, n_ - i * chunk)) for i, shape in enumerate(seen))
    assert sum(shape[-1] for shape in seen) == n_
    assert max(math.prod(shape) for shape in seen) <= max(budget, b_ * h_ * s_)


def test_backward_only_for_the_inputs_that_need_it(monkeypatch):
    state = torch.randn(1, 2, 3, 8, requires_grad=True)
    stored = torch.randn(1, 2, 20, 8)
    energy, _ = _op(state, stored, 0.5)
    energy.sum().backward()
    assert state.grad is not None and stored.grad is None
    state2 = torch.randn(1, 2, 3, 8)
    stored2 = stored.clone().requires_grad_()
    energy, _ = _op(state2, stored2, 0.5)
    energy.sum().backward()
    assert stored2.grad is not None and state2.grad is None
    # Each alone equals its part of the gradient of both (on CPU the kernels skip the forward
    # product when only the stored patterns want a gradient).
    both = [state.detach().clone().requires_grad_(), stored.clone().requires_grad_()]
    _op(*both, 0.5)[0].sum().backward()
    torch.testing.assert_close(state.grad, both[0].grad)
    stored3 = stored.clone().requires_grad_()
    _op(state.detach(), stored3, 0.5)[0].sum().backward()
    torch.testing.assert_close(stored3.grad, both[1].grad)


def test_low_precision_gradients_have_the_input_dtype():
    state = torch.randn(1, 2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    stored = torch.randn(1, 2, 20, 8, dtype=torch.bfloat16, requires_grad=True)
    energy, _ = _op(state, stored, 0.5)
    energy.sum().backward()
    assert state.grad.dtype == stored.grad.dtype == torch.bfloat16
    s64 = state.detach().double().requires_grad_()
    x64 = stored.detach().double().requires_grad_()
    hopfield_energy_reference(s64, x64, 0.5).sum().backward()
    # Computed in float32 from bfloat16 inputs, rounded once to bfloat16 (8 bits of mantissa).
    _scale_close(state.grad, s64.grad, 2 ** -7)
    _scale_close(stored.grad, x64.grad, 2 ** -7)


def test_fake_tensor_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dtype, acc in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (F64, F64)):
            energy, lse = _op(torch.empty(2, 3, 7, 16, dtype=dtype), torch.empty(2, 3, 9, 16, dtype=dtype), 0.5)
            assert energy.shape == lse.shape == (2, 3, 7)
            assert energy.dtype == lse.dtype == acc


# ============================================================================ update op
# attnkit::hopfield_update_fwd (all steps fused) and its registrations: fake, chunked backward.

from attnkit.reference.hopfield import hopfield_update_reference  # noqa: E402


def _upd(state, stored, values=None, beta=0.3, steps=1, tol=None, final_state=False):
    return torch.ops.attnkit.hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state)


def _ref64(state, stored, values, beta, steps, tol, **kw):
    return hopfield_update_reference(state.double(), stored.double(), beta=beta, steps=steps,
                                     values=None if values is None else values.double(), tol=tol, **kw)


# (steps, with values, S, N, D, tol): a sample of steps 1..5 x values x S {1, 7, 64} x
# N {1, 300, 10000} x D {16, 64, 128} x tol; S = 1 with N = 10000 and B = H = 1 takes the split-N
# path (S <= 16, N >= 2 * 4096 stored rows per chunk).
UPDATE_CASES = [
    (1, False, 1, 1, 16, None),
    (2, True, 7, 1, 64, 1e-3),
    (3, False, 64, 300, 16, None),
    (5, True, 7, 300, 128, None),
    (4, False, 1, 300, 64, 1e-2),
    (1, True, 64, 10000, 64, None),
    (3, False, 7, 10000, 16, 1e-3),
    (5, False, 64, 300, 64, 1e-2),
    (2, False, 1, 10000, 128, None),
    (3, True, 1, 10000, 64, 1e-2),
]


def _update_inputs(b, h, s, n, d, dv=5, dtype=torch.float32, spread=1.0):
    # spread 1 with beta = 1/sqrt(d) keeps the iteration well conditioned.  (At spread 2 some
    # states sit near saddles between patterns for a few steps and amplify rounding: there the
    # float32 *reference* is off by ~1e-3 after 5 steps, as is any float32 kernel.)
    return (torch.randn(b, h, s, d, dtype=dtype) * spread, torch.randn(b, h, n, d, dtype=dtype) * spread,
            torch.randn(b, h, n, dv, dtype=dtype))


def _tol_margin(state, stored, beta, steps, tol):
    """min over rows and steps of |change − tol| along the float64 trajectory without tol."""
    xi, x = state.double(), stored.double()
    margin = math.inf
    for _ in range(steps):
        new = torch.softmax(beta * xi @ x.transpose(-1, -2), -1) @ x
        margin = min(margin, ((new - xi).abs().amax(-1) - tol).abs().min().item())
        xi = new
    return margin


@pytest.mark.parametrize("steps,with_values,s,n,d,tol", UPDATE_CASES)
def test_update_float32_forward_and_grads_match_float64_reference(steps, with_values, s, n, d, tol):
    b, h = (1, 1) if s == 1 and n == 10000 else (2, 2)
    beta = 1.0 / math.sqrt(d)
    # tol makes the result discontinuous: a row whose change lands within rounding of tol may
    # freeze a step earlier in float32 than in float64.  Draw inputs whose float64 changes all
    # stay 1e-4 away from tol (float32 states are good to ~1e-6 here).
    for seed in range(50):
        torch.manual_seed(seed)
        state, stored, values = _update_inputs(b, h, s, n, d)
        if tol is None or _tol_margin(state, stored, beta, steps, tol) > 1e-4:
            break
    values = values if with_values else None
    leaves = [t.clone().requires_grad_() for t in (state, stored) + ((values,) if with_values else ())]
    out = attnkit.hopfield_update(leaves[0], leaves[1], beta=beta, steps=steps,
                                  values=leaves[2] if with_values else None, tol=tol, backend="cpu")
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    want = hopfield_update_reference(leaves64[0], leaves64[1], beta=beta, steps=steps,
                                     values=leaves64[2] if with_values else None, tol=tol)
    assert out.dtype == torch.float32 and out.shape == want.shape
    _scale_close(out, want.detach(), 2e-5)
    weights = torch.randn(out.shape, dtype=F64)
    (out * weights.float()).sum().backward()
    (want * weights).sum().backward()
    # Relative to the largest gradient of any input: with N = 1 the state's gradient is exactly
    # zero (softmax over one pattern), which float32 can only meet to rounding of that scale.
    scale = max(ref.grad.abs().max().item() for ref in leaves64)
    for got, ref in zip(leaves, leaves64):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("with_values", [False, True])
def test_update_float64_matches_reference_to_rounding_and_saves_the_trajectory(with_values):
    state, stored, values = _update_inputs(2, 3, 9, 300, 33, dtype=F64)
    values = values if with_values else None
    steps = 3
    out, states, lse, applied = _upd(state, stored, values, beta=0.2, steps=steps, tol=1e-3, final_state=True)
    want, energy = _ref64(state, stored, values, 0.2, steps, 1e-3, return_energy=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert states.shape == (steps + 1, 2, 3, 9, 33) and lse.shape == (steps, 2, 3, 9)
    assert applied.dtype == torch.bool and applied.shape == (steps - (1 if with_values else 0), 2, 3, 9)
    # states[k] is the state before retrieval k; lse[k] its log-sum-exp of beta * scores.
    for k in range(steps):
        scores = 0.2 * states[k] @ stored.transpose(-1, -2)
        torch.testing.assert_close(lse[k], torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states[0], state)
    # The energies of the saved trajectory are the reference's (entry `steps`: the stored-space
    # update of the last state, with values too).
    for k in range(steps + 1):
        torch.testing.assert_close(hopfield_energy_reference(states[k], stored, 0.2), energy[k], rtol=1e-10, atol=1e-10)


def test_update_tol_applied_mask_follows_the_reference_rule():
    state, stored, _ = _update_inputs(1, 1, 3, 20, 16, dtype=F64)
    state[0, 0, 0] = stored[0, 0, 3]  # next to a fixed point: tiny first change, frozen after it
    _, states, _, applied = _upd(state, stored, beta=1.0, steps=4, tol=1e-3)
    assert applied[0].all()  # the first update always applies
    assert not applied[1:, 0, 0, 0].any()
    assert torch.equal(states[1, 0, 0, 0], states[4, 0, 0, 0])
    # A row is frozen after the first update whose change is <= tol, exactly.
    for k in range(1, 4):
        change = (states[k] - states[k - 1]).abs().amax(-1)
        assert torch.equal(applied[k], applied[k - 1] & (change > 1e-3))


def test_update_all_frozen_block_skips_with_infinite_lse_and_zero_gradient_there():
    # Patterns far apart (scores ~ 200 against ~ 25): each is a fixed point to ~exp(-100), so a
    # state on one changes by less than tol in its first update and both rows freeze together.
    stored = torch.randn(1, 1, 30, 8, dtype=F64) * 5
    state = stored[:, :, :2].clone().requires_grad_()
    out, states, lse, applied = _upd(state, stored, beta=1.0, steps=4, tol=1e-6)
    assert applied[0].all() and not applied[1:].any()
    assert torch.isfinite(lse[0]).all() and torch.isinf(lse[1:]).all() and (lse[1:] > 0).all()
    (g,) = torch.autograd.grad(out.sum(), state)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_values", [False, True])
def test_update_streaming_from_dram_matches_float64_reference(threads, with_values):
    """Steps that stream more than 32 MiB of stored rows (here 2 x 70000 x 64 float32, 34 MiB)
    also prefetch far ahead into L2 (kStreamFarBytes).  At 2 threads B*H = 2 heads take the
    split path, at 1 thread the fused path; 70000 rows is no multiple of the 4096-row chunks or
    16-row blocks, so the far prefetch's stop before the end of a range is exercised."""
    torch.manual_seed(0)
    state = torch.randn(1, 2, 1, 64)
    stored = torch.randn(1, 2, 70000, 64)
    values = torch.randn(1, 2, 70000, 3) if with_values else None
    with num_threads(threads):
        out = attnkit.hopfield_update(state, stored, beta=0.125, steps=2, values=values, backend="cpu")
    want = _ref64(state, stored, values, 0.125, 2, None)
    _scale_close(out, want, 2e-5)


def test_update_split_path_equals_the_fused_path():
    # S = 1 against N = 20000 splits the stored patterns into 5 chunks merged by log-sum-exp;
    # S = 17 (> 16) runs the fused path: the first row must agree to rounding.
    torch.manual_seed(0)
    stored = torch.randn(1, 1, 20000, 64, dtype=F64) * 2
    values = torch.randn(1, 1, 20000, 3, dtype=F64)
    state = torch.randn(1, 1, 17, 64, dtype=F64) * 2
    for v in (None, values):
        one = _upd(state[:, :, :1], stored, v, beta=0.125, steps=3, tol=1e-6, final_state=True)
        many = _upd(state, stored, v, beta=0.125, steps=3, tol=1e-6, final_state=True)
        torch.testing.assert_close(one[0], many[0][:, :, :1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(one[1], many[1][:, :, :, :1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(one[2], many[2][..., :1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_update_energy_never_rises_along_the_kernel_updates(beta):
    stored = torch.randn(2, 2, 300, 16) * 1.5
    state = torch.randn(2, 2, 7, 16) * 2
    _, energy = attnkit.hopfield_update(state, stored, beta=beta, steps=6, return_energy=True, backend="cpu")
    assert energy.shape == (7, 2, 2, 7) and energy.dtype == torch.float32
    e = energy.double()
    # CCCP: E(ξ_{k+1}) <= E(ξ_k); the slack covers float32 rounding of the states (scale ~1e-5).
    assert (e[1:] <= e[:-1] + 1e-5 * (1 + e[:-1].abs())).all()
    assert (e[1] < e[0]).all() and (e >= -1e-4).all()


@pytest.mark.parametrize("with_values", [False, True])
def test_update_bfloat16_within_twice_reference_error(with_values):
    state, stored, values = _update_inputs(2, 2, 7, 300, 64)
    values = values if with_values else None
    lo = [None if t is None else t.bfloat16() for t in (state, stored, values)]
    want = _ref64(lo[0], lo[1], lo[2], 0.125, 3, None)
    ref_err = (hopfield_update_reference(lo[0], lo[1], beta=0.125, steps=3, values=lo[2]).double() - want).abs().max()
    got = attnkit.hopfield_update(lo[0], lo[1], beta=0.125, steps=3, values=lo[2], backend="cpu")
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3


def test_update_bfloat16_gradients():
    state, stored, values = (t.bfloat16().requires_grad_() for t in _update_inputs(1, 2, 7, 40, 16))
    out = attnkit.hopfield_update(state, stored, beta=0.25, steps=2, values=values, backend="cpu")
    weights = torch.randn(out.shape)
    (out.float() * weights).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (state, stored, values)]
    ref = hopfield_update_reference(*leaves64[:2], beta=0.25, steps=2, values=leaves64[2])
    (ref * weights.double()).sum().backward()
    lo = [t.detach().clone().requires_grad_() for t in (state, stored, values)]
    ref_lo = hopfield_update_reference(*lo[:2], beta=0.25, steps=2, values=lo[2])
    (ref_lo * weights.bfloat16()).sum().backward()
    for got, r64, rlo in zip((state, stored, values), leaves64, lo):
        assert got.grad.dtype == torch.bfloat16
        ref_err = (rlo.grad.double() - r64.grad).abs().max()
        assert (got.grad.double() - r64.grad).abs().max() <= 2 * ref_err + 1e-3


def test_update_gradcheck_float64_through_tol_and_values():
    state, stored, values = (t.requires_grad_() for t in _update_inputs(1, 2, 3, 6, 4, dv=3, dtype=F64, spread=1.0))
    assert torch.autograd.gradcheck(lambda a, x, v: _upd(a, x, v, beta=0.8, steps=3)[0], (state, stored, values))
    assert torch.autograd.gradcheck(lambda a, x: _upd(a, x, None, beta=0.8, steps=4, tol=1e-2)[0], (state, stored))


def test_update_frozen_rows_pass_gradients_straight_through():
    stored = torch.randn(1, 1, 20, 8, dtype=F64) * 5
    state = torch.randn(1, 1, 2, 8, dtype=F64) * 0.1  # row 1: near the origin, keeps moving
    state[0, 0, 0] = stored[0, 0, 5]  # a fixed point to ~exp(-100): frozen after one update
    state.requires_grad_()
    out, _, _, applied = _upd(state, stored, beta=1.0, steps=5, tol=1e-6)
    assert applied[0, 0, 0, 0] and not applied[1:, 0, 0, 0].any()
    (g,) = torch.autograd.grad(out[0, 0, 0].sum(), state)
    one = state.detach().clone().requires_grad_()
    (g1,) = torch.autograd.grad(_upd(one, stored, beta=1.0, steps=1)[0][0, 0, 0].sum(), one)
    torch.testing.assert_close(g, g1, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("with_values", [False, True])
def test_update_opcheck(dtype, with_values):
    state, stored, values = (t.requires_grad_() for t in _update_inputs(2, 2, 5, 17, 8, dv=3, dtype=dtype))
    values = values if with_values else None
    torch.library.opcheck(torch.ops.attnkit.hopfield_update_fwd.default, (state, stored, values, 0.5, 3, 1e-3, True))
    torch.library.opcheck(torch.ops.attnkit.hopfield_update_fwd.default, (state, stored, values, 0.5, 2, None, False))


def test_update_torch_compile_fullgraph_with_grads_and_energy():
    state, stored, values = _update_inputs(1, 2, 7, 9, 8, dv=3)
    compiled = torch.compile(attnkit.hopfield_update, fullgraph=True)
    kwargs = {"steps": 3, "tol": 1e-3, "values": values, "beta": 0.5, "backend": "cpu", "return_energy": True}
    sc = state.clone().requires_grad_()
    out_c, energy_c = compiled(sc, stored, **kwargs)
    se = state.clone().requires_grad_()
    out_e, energy_e = attnkit.hopfield_update(se, stored, **kwargs)
    torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(energy_c, energy_e, rtol=1e-6, atol=1e-6)
    out_c.sum().backward()
    out_e.sum().backward()
    torch.testing.assert_close(sc.grad, se.grad, rtol=1e-5, atol=1e-5)


def test_update_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dtype, acc in ((torch.bfloat16, torch.float32), (F64, F64)):
            st, x, v = torch.empty(2, 3, 7, 16, dtype=dtype), torch.empty(2, 3, 9, 16, dtype=dtype), torch.empty(2, 3, 9, 4, dtype=dtype)
            out, states, lse, applied = _upd(st, x, v, steps=3, tol=0.1)
            assert out.shape == (2, 3, 7, 4) and states.shape == (4, 2, 3, 7, 16)
            assert lse.shape == (3, 2, 3, 7) and applied.shape == (2, 2, 3, 7) and applied.dtype == torch.bool
            assert out.dtype == states.dtype == lse.dtype == acc


def test_update_non_contiguous_empty_and_nan():
    state = torch.randn(2, 9, 3, 16).transpose(1, 2)
    stored = torch.randn(2, 3, 40, 32)[..., 1::2]
    values = torch.randn(2, 3, 40, 10)[..., ::2]
    got = _upd(state, stored, values, steps=2, tol=1e-3)
    want = _upd(state.contiguous(), stored.contiguous(), values.contiguous(), steps=2, tol=1e-3)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    out, states, lse, applied = _upd(torch.randn(2, 3, 0, 16), torch.randn(2, 3, 5, 16), steps=2)
    assert out.shape == (2, 3, 0, 16) and states.shape == (3, 2, 3, 0, 16) and lse.shape == (2, 2, 3, 0)
    stored = torch.randn(1, 1, 40, 16)
    stored[0, 0, 21, 5] = float("nan")
    assert torch.isnan(_upd(torch.randn(1, 1, 3, 16), stored, steps=2)[0]).all()


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(3, 7, 16), torch.randn(1, 3, 9, 16), None, 0.5, 1, None, False), "expected state"),
        ((torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16, dtype=F64), None, 0.5, 1, None, False), "must share a dtype"),
        ((torch.randn(1, 3, 7, 16), torch.randn(1, 3, 0, 16), None, 0.5, 1, None, False), "at least one stored pattern"),
        ((torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16), None, -1.0, 1, None, False), "beta must be finite and > 0"),
        ((torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16), None, 0.5, 0, None, False), "steps must be >= 1"),
        ((torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16), None, 0.5, 1, -1.0, False), "tol must be finite and >= 0"),
        ((torch.randn(1, 3, 7, 16), torch.randn(1, 3, 9, 16), torch.randn(1, 3, 8, 2), 0.5, 1, None, False), "values must be"),
    ],
)
def test_update_kernel_checks_its_inputs(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.attnkit.hopfield_update_fwd(*args)


# ============================================================== streaming few-query kernel
# S <= 64 float32 runs the streaming kernel (csrc/cpu/hopfield.cpp, stream_range_f32): each
# block of 16 stored rows read once, as key and value, for a group of up to 16 queries (one pass
# per group); N >= 8192 with few (batch, head) pairs also splits the rows into chunks of 4096
# merged by log-sum-exp.  Its
# outputs are checked against an independent float64 trajectory, written here from the rule.


def _trajectory64(state, stored, values, beta, steps, tol, final_state):
    """(out, states, lse, applied) of hopfield_update_fwd in float64, one plain step at a time.

    A (batch, head) whose rows are all frozen skips a stored-space step: lse +inf there (the
    kernel's blocks of queries hold all S <= 16 rows of a (batch, head))."""
    xi, x = state.double(), stored.double()
    v = None if values is None else values.double()
    updates = steps - (v is not None)
    active = torch.ones(xi.shape[:-1], dtype=torch.bool)
    states, lses, applied = [xi], [], []
    out = None
    for k in range(steps):
        scores = beta * xi @ x.transpose(-1, -2)
        lse = torch.logsumexp(scores, -1)
        p = torch.softmax(scores, -1)
        if k < updates:
            skipped = ~active.any(-1, keepdim=True) & torch.ones_like(active) if tol is not None else torch.zeros_like(active)
            lses.append(torch.where(skipped, torch.full_like(lse, math.inf), lse))
            new = p @ x
            change = (new - xi).abs().amax(-1)
            applied.append(active.clone())
            xi = torch.where(active[..., None], new, xi)
            if tol is not None:
                active = active & (change > tol)
            states.append(xi)
        else:
            lses.append(lse)
            out = p @ v
            states.append(torch.where(active[..., None], p @ x, xi) if final_state else torch.zeros_like(xi))
    if out is None:
        out = xi
    shape = (0,) + tuple(active.shape)
    applied = torch.stack(applied) if applied else torch.zeros(shape, dtype=torch.bool)
    return out, torch.stack(states), torch.stack(lses), applied


def _check_against_trajectory(got, want, tol):
    out, states, lse, applied = got
    w_out, w_states, w_lse, w_applied = want
    assert out.dtype == states.dtype == lse.dtype == torch.float32
    _scale_close(out, w_out, 2e-5)
    _scale_close(states, w_states, 2e-5)
    finite = torch.isfinite(w_lse)
    assert torch.equal(torch.isinf(lse), ~finite) and (lse[~finite] > 0).all()
    _scale_close(lse[finite], w_lse[finite], 2e-5)
    if tol is not None:
        assert torch.equal(applied, w_applied)


def _check_case_against_trajectory(sizes, dv, spread, steps, with_values, tol, beta):
    """Random float32 inputs of ``sizes`` (B, H, S, N, D) and value dim ``dv``, both final_state
    settings, against the float64 trajectory.  With a tol, the first seed whose updates all stay
    1e-4 away from the stopping threshold (so that float32 rounding cannot flip a decision)."""
    for seed in range(50):
        torch.manual_seed(seed)
        state, stored, values = _update_inputs(*sizes, dv=dv, spread=spread)
        if tol is None or _tol_margin(state, stored, beta, steps, tol) > 1e-4:
            break
    values = values if with_values else None
    for final_state in (False, True):
        got = _upd(state, stored, values, beta=beta, steps=steps, tol=tol, final_state=final_state)
        want = _trajectory64(state, stored, values, beta, steps, tol, final_state)
        _check_against_trajectory(got, want, tol)


# (B, H, S, N, D, steps, with values, tol, beta, spread).  N = 9000 / 9001 with B = H = 1 takes
# the split path (and leaves partial blocks of 16 rows at the ends of chunks); D = 33, 100, 5:
# a masked last chunk of the row; beta = 1 with spread 3: scores in the hundreds, so the running
# maximum grows block after block and the sums and accumulators are rescaled many times.
STREAM_CASES = [
    (1, 1, 1, 1, 64, 1, False, None, 0.125, 1.0),
    (1, 1, 1, 9000, 64, 3, False, None, 0.125, 1.0),
    (1, 1, 7, 9000, 33, 3, True, None, 0.17, 1.0),
    (1, 1, 16, 9001, 128, 3, False, 1e-3, 0.088, 1.0),
    (2, 3, 16, 300, 16, 2, True, None, 0.25, 1.0),
    (2, 3, 7, 17, 5, 3, False, None, 0.45, 1.0),
    (1, 2, 1, 300, 100, 5, True, 1e-2, 0.1, 1.0),
    (1, 1, 7, 9000, 64, 1, False, None, 1.0, 3.0),
    (2, 1, 16, 1000, 48, 1, True, None, 1.0, 3.0),
    (1, 1, 40, 9000, 64, 3, True, None, 0.125, 1.0),
    (2, 3, 64, 300, 33, 2, False, None, 0.17, 1.0),
    (1, 1, 23, 1000, 64, 2, True, None, 1.0, 3.0),
]


@pytest.mark.parametrize("b,h,s,n,d,steps,with_values,tol,beta,spread", STREAM_CASES)
def test_update_streaming_float32_matches_float64_trajectory(b, h, s, n, d, steps, with_values, tol, beta, spread):
    _check_case_against_trajectory((b, h, s, n, d), 19, spread, steps, with_values, tol, beta)


def test_update_streaming_all_rows_frozen_skip_with_infinite_lse():
    # Seven states on stored patterns far apart: all freeze after the first update, so the
    # block of the (batch, head) skips steps 2 and 3 (split path: N = 9000, B = H = 1).
    torch.manual_seed(1)
    stored = torch.randn(1, 1, 9000, 64) * 5
    state = stored[:, :, 100:107].clone()
    got = _upd(state, stored, beta=1.0, steps=3, tol=1e-4, final_state=True)
    want = _trajectory64(state, stored, None, 1.0, 3, 1e-4, True)
    assert want[3][0].all() and not want[3][1:].any() and torch.isinf(want[2][1:]).all()
    _check_against_trajectory(got, want, 1e-4)


def test_update_streaming_split_agrees_with_the_blas_path_in_float32():
    # S = 1 (streaming, split over N) against S = 65 (> 64: the GEMM path): the first row agrees.
    torch.manual_seed(0)
    stored = torch.randn(1, 1, 20000, 64) * 2
    values = torch.randn(1, 1, 20000, 3)
    state = torch.randn(1, 1, 65, 64) * 2
    for v in (None, values):
        one = _upd(state[:, :, :1], stored, v, beta=0.125, steps=3, final_state=True)
        many = _upd(state, stored, v, beta=0.125, steps=3, final_state=True)
        _scale_close(one[0], many[0][:, :, :1].double(), 2e-5)
        _scale_close(one[1], many[1][:, :, :, :1].double(), 2e-5)
        _scale_close(one[2], many[2][..., :1].double(), 2e-5)


def test_update_streaming_result_does_not_depend_on_the_thread_count():
    # The chunks are handed out dynamically to the caller and its helper threads, but every
    # chunk's partial is computed alone and the merge runs in chunk order: bitwise the same.
    # (B = H = 1: the split path for any thread count.)
    torch.manual_seed(2)
    stored = torch.randn(1, 1, 20000, 48)
    values = torch.randn(1, 1, 20000, 7)
    state = torch.randn(1, 1, 3, 48)
    results = []
    for n in (1, 2, 3):
        with num_threads(n):
            results.append(_upd(state, stored, values, beta=0.2, steps=3, tol=1e-5, final_state=True))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_update_streaming_values_that_are_the_stored_tensor():
    # values=stored reaches the kernel as the same pointer: the read-out must still fill the
    # final stored-space state (final_state) and equal the read-out through a copy.
    torch.manual_seed(3)
    for n in (300, 9000):
        stored = torch.randn(1, 1, n, 32)
        state = torch.randn(1, 1, 5, 32)
        same = _upd(state, stored, stored, beta=0.3, steps=2, final_state=True)
        copy = _upd(state, stored, stored.clone(), beta=0.3, steps=2, final_state=True)
        for a, b in zip(same, copy):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        want = _trajectory64(state, stored, stored, 0.3, 2, None, True)
        _check_against_trajectory(same, want, None)


def test_update_streaming_nan_propagates_through_the_split_merge():
    stored = torch.randn(1, 1, 9000, 64)
    stored[0, 0, 8999, 3] = float("nan")  # in the last, partial chunk
    out, states, lse, _ = _upd(torch.randn(1, 1, 2, 64), stored, beta=0.125, steps=2)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_update_split_with_values_and_several_queries_float64():
    # The split path's partial read-outs are rows of Dv inside slots of S x max(D, Dv): with
    # S > 1 and Dv != D the merge once read them with the wrong stride (float64: the BLAS path).
    torch.manual_seed(4)
    state, stored, values = _update_inputs(1, 1, 5, 9000, 33, dv=19, dtype=F64)
    for final_state in (False, True):
        got = _upd(state, stored, values, beta=0.17, steps=3, final_state=final_state)
        want = _trajectory64(state, stored, values, 0.17, 3, None, final_state)
        for a, b in zip(got[:3], want[:3]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ============================================================== AVX-512 GEMM of the fused path
# S > 64 float32 with D a multiple of 16 (<= 128) runs the fused path on register-blocked AVX-512
# kernels over stored patterns packed in groups of 16 (padded to 32 rows): micro-tiles of 8
# states x 32 patterns for the scores and RB states (12, 12, 8, 6, 4, 3, 3, 2 for D/16 = 1..8)
# for P.X.  The cases leave remainders of every kind: states per block of 256 (the last block,
# of <= 64 states, streams) and per micro-tile, stored rows per tile of 512 and per group of 32,
# N = 1.
FAST_GEMM_CASES = [
    (1, 1, 65, 1, 16, 2, False, None),
    (1, 2, 300, 513, 64, 3, True, None),
    (2, 1, 69, 1000, 128, 3, False, 1e-3),
    (1, 1, 100, 77, 48, 2, True, None),
    (1, 1, 75, 300, 80, 3, False, None),
    (1, 1, 341, 50, 32, 1, True, None),
]


@pytest.mark.parametrize("b,h,s,n,d,steps,with_values,tol", FAST_GEMM_CASES)
def test_update_fused_avx512_gemm_matches_float64_trajectory(b, h, s, n, d, steps, with_values, tol):
    _check_case_against_trajectory((b, h, s, n, d), 11, 1.0, steps, with_values, tol, 1.0 / math.sqrt(d))


# S > 64 float32 without values (D <= 128, any D) runs the states-in-lanes kernel: groups of up to
# 64 states in the vector lanes (fewer when there are few tasks per thread; a group's last
# vectors may be partly empty), chunks of 64 stored
# rows, score micro-tiles of 6 / 8 / 12 stored rows (by the group's width) with tails of 4, 2, 1,
# P.X micro-tiles of as many dims with the same tails.  The cases leave each remainder: S = 65,
# 79, 100, 127, 130 (last group 1, 15, 36, 63, 2 states), N = 1, 5, 63, 64, 65, 1000, D = 1, 7, 13,
# 33, 63, 64, 128; beta = 1 with spread 3 makes the running maximum grow chunk after chunk.
LANES_CASES = [
    (1, 1, 65, 1, 16, 2, None, 0.25, 1.0),
    (1, 2, 79, 5, 7, 3, None, 0.4, 1.0),
    (2, 1, 100, 63, 13, 3, 1e-3, 0.3, 1.0),
    (1, 1, 127, 64, 33, 2, None, 0.17, 1.0),
    (1, 1, 130, 65, 63, 3, None, 0.125, 1.0),
    (1, 1, 200, 1000, 64, 3, None, 0.125, 1.0),
    (1, 1, 70, 1000, 128, 2, None, 0.088, 1.0),
    (1, 1, 90, 1000, 64, 1, None, 1.0, 3.0),
    (1, 1, 66, 300, 1, 3, None, 1.0, 1.0),
]


@pytest.mark.parametrize("b,h,s,n,d,steps,tol,beta,spread", LANES_CASES)
def test_update_lanes_kernel_matches_float64_trajectory(b, h, s, n, d, steps, tol, beta, spread):
    _check_case_against_trajectory((b, h, s, n, d), 11, spread, steps, False, tol, beta)


def test_update_lanes_kernel_all_rows_frozen_skip_with_infinite_lse():
    # 70 states on stored patterns far apart: all freeze after the first update, so both groups
    # (64 + 6 states) skip steps 2 and 3.
    torch.manual_seed(1)
    stored = torch.randn(1, 1, 500, 64) * 5
    state = stored[:, :, 100:170].clone()
    got = _upd(state, stored, beta=1.0, steps=3, tol=1e-4, final_state=True)
    want = _trajectory64(state, stored, None, 1.0, 3, 1e-4, True)
    assert want[3][0].all() and not want[3][1:].any() and torch.isinf(want[2][1:]).all()
    _check_against_trajectory(got, want, 1e-4)


def test_update_lanes_kernel_some_lanes_frozen_others_go_on():
    # The lanes kernel keeps the states in the lanes layout across the steps and freezes lane by
    # lane: in each group of 64, the even states sit on stored patterns far apart (they freeze
    # after the first update) and the odd ones are random (they go on), so every vector of lanes
    # mixes frozen and active states for steps 2 and 3; one NaN state freezes on its NaN change.
    torch.manual_seed(3)
    stored = torch.randn(1, 1, 700, 48) * 4
    state = torch.randn(1, 1, 150, 48) * 0.05
    state[:, :, 0::2] = stored[:, :, 200:275]
    state[0, 0, 77, 5] = float("nan")
    got = _upd(state, stored, beta=1.0, steps=3, tol=1e-4, final_state=False)
    want = _trajectory64(state, stored, None, 1.0, 3, 1e-4, False)
    applied = want[3]
    assert applied[0].all() and applied[1:, 0, 0, 0::2].logical_not().all() and applied[1:, 0, 0, 1::2].sum() > 0
    assert not applied[1:, 0, 0, 77].any()  # the NaN row froze after its first update
    finite = ~torch.isnan(want[1]).any(-1, keepdim=True).expand_as(want[1])
    out, states, lse, app = got
    assert torch.equal(app, applied)
    assert torch.isnan(states[1:, 0, 0, 77]).all() and torch.isnan(out[0, 0, 77]).all()
    keep = torch.ones(150, dtype=torch.bool)
    keep[77] = False
    _scale_close(out[:, :, keep], want[0][:, :, keep], 2e-5)
    _scale_close(states[:, :, :, keep], want[1][:, :, :, keep], 2e-5)
    assert finite[:, :, :, keep].all()


@pytest.mark.parametrize("b,s,d,values", [(2, 150, 64, False), (1, 100, 64, False), (2, 150, 33, False),
                                          (2, 150, 64, True), (1, 300, 64, True)])
def test_update_lanes_kernel_result_does_not_depend_on_the_thread_count(b, s, d, values):
    # Each state's arithmetic is its lane's alone, in the same order whatever the group width:
    # (1, 100) runs as groups of 64 on one thread and of 32 on two (two tasks per thread).
    # Odd D, values, and builds without AVX-512 go through MKL, whose result can depend on a
    # block's row count: their blocks do not depend on the thread count (issue 24: an x86-64-v3
    # build on an Intel Xeon differed between 1 and 2 threads at (2, 150)).
    torch.manual_seed(2)
    state, stored = torch.randn(b, 1, s, d), torch.randn(b, 1, 700, d)
    kw = {"values": torch.randn(b, 1, 700, 24)} if values else {}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attnkit.hopfield_update(state, stored, beta=0.2, steps=3, backend="cpu", **kw)
        torch.set_num_threads(max(2, threads))
        many = attnkit.hopfield_update(state, stored, beta=0.2, steps=3, backend="cpu", **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


# --------------------------------------------------------------------------------------------
# NaN and ±inf (issue 15): the update, the energy and their gradients are non-finite (and NaN)
# exactly where the float64 reference is, on every decomposition of the cpu kernel.

_NONFINITE_SHAPES = [
    (3, 40, 16),    # streaming kernel (S <= 64, D <= 128)
    (5, 37, 33),    # streaming, D not a multiple of 16
    (70, 100, 32),  # AVX-512 GEMM on packed patterns (with values)
    (70, 90, 33),   # BLAS / portable loops (odd D)
    (67, 100, 32),  # states-in-lanes kernel (S > 64 without values; s == 70 always takes values)
    (67, 90, 33),   # states-in-lanes kernel, odd D
    (20, 9000, 64),  # split-N over threads, streaming chunks merged through their lse
]


def _poison(kind, state, stored, values):
    inf = float("inf")
    if kind == "stored_nan":
        stored[0, 1, 5, 0] = float("nan")
    elif kind == "state_nan":
        state[0, 0, 1, 3] = float("nan")
    elif kind == "state_inf":
        state[0, 1, 0, 1] = inf
    elif kind == "stored_inf_block":
        # The first 20 patterns of head 0 (a whole first tile of scores) are +inf in column 2: rows
        # with state[..., 2] < 0 see scores of -inf there and finite scores after.
        stored[0, 0, 0:20, 2] = inf
    elif kind == "stored_minus_inf":
        stored[0, 0, 1, 2] = -inf
    elif kind == "values_nan":
        values[0, 0, 3, 1] = float("nan")
    elif kind == "values_inf":
        values[0, 1, 7, 0] = -inf


def _same_nonfinite(name, got, want):
    """NaN and non-finite entries exactly where the float64 reference has them; the finite ones
    within the float32 rule (DESIGN.md) of it."""
    got = got.detach().to(F64)
    want = want.detach()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), name
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), name
    finite = torch.isfinite(want)
    assert_close_to_reference(got[finite].float(), want[finite], dtype=torch.float32,
                              grad=name.startswith("d"), name=name)


@pytest.mark.parametrize("s,n,d", _NONFINITE_SHAPES)
@pytest.mark.parametrize("kind", ["stored_nan", "state_nan", "state_inf", "stored_inf_block", "stored_minus_inf",
                                  "values_nan", "values_inf"])
@pytest.mark.parametrize("tol", [None, 1e-3])
def test_update_nonfinite_inputs_reach_what_they_reach_in_float64(s, n, d, kind, tol):
    from attnkit.reference.hopfield import hopfield_update_reference

    torch.manual_seed(0)
    with_values = kind.startswith("values") or s == 70
    state = torch.randn(1, 2, s, d)
    stored = torch.randn(1, 2, n, d) * 0.3
    values = torch.randn(1, 2, n, 7) if with_values else None
    _poison(kind, state, stored, values)
    leaves = [t.clone().requires_grad_(True) for t in (state, stored, values) if t is not None]
    out = attnkit.hopfield_update(leaves[0], leaves[1], beta=0.5, steps=2, tol=tol,
                                  values=leaves[2] if with_values else None, backend="cpu")
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    leaves64 = [t.detach().to(F64).requires_grad_(True) for t in leaves]
    want = hopfield_update_reference(leaves64[0], leaves64[1], beta=0.5, steps=2, tol=tol,
                                     values=leaves64[2] if with_values else None)
    want_grads = torch.autograd.grad(want, leaves64, g.to(F64))
    _same_nonfinite("out", out, want)
    for name, a, b in zip(["dstate", "dstored", "dvalues"], grads, want_grads):
        _same_nonfinite(name, a, b)


@pytest.mark.parametrize("s,n,d", [(9, 40, 16), (3, 1000, 33)])
@pytest.mark.parametrize("kind", ["stored_nan", "state_nan", "state_inf", "stored_inf_block", "stored_minus_inf"])
def test_energy_nonfinite_inputs_reach_what_they_reach_in_float64(s, n, d, kind):
    torch.manual_seed(0)
    state, stored = torch.randn(1, 2, s, d), torch.randn(1, 2, n, d) * 0.3
    _poison(kind, state, stored, None)
    leaves = [t.clone().requires_grad_(True) for t in (state, stored)]
    energy = attnkit.hopfield_energy(leaves[0], leaves[1], 0.5, backend="cpu")
    grads = torch.autograd.grad(energy, leaves, torch.ones_like(energy))
    leaves64 = [t.detach().to(F64).requires_grad_(True) for t in leaves]
    want = hopfield_energy_reference(leaves64[0], leaves64[1], 0.5)
    want_grads = torch.autograd.grad(want, leaves64, torch.ones_like(want))
    _same_nonfinite("energy", energy, want)
    for name, a, b in zip(["dstate", "dstored"], grads, want_grads):
        _same_nonfinite(name, a, b)


def test_energy_lse_is_plus_inf_for_an_infinite_score_like_torch_logsumexp():
    # Regression: a +inf score gave lse = m + log(NaN) (exp(inf - inf)); the backward, which
    # recomputes the probabilities from lse, then made every pattern's gradient NaN.
    state, stored = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 40, 16)
    stored[0, 0, 7, 0] = float("inf")
    state[0, 0, 0, 0], state[0, 0, 1, 0] = 1.0, -1.0
    _, lse = _op(state, stored, 0.5)
    want = torch.logsumexp(0.5 * state.double() @ stored.double().transpose(-1, -2), -1)
    assert lse[0, 0, 0] == float("inf") and torch.isfinite(lse[0, 0, 1])
    torch.testing.assert_close(lse[0, 0, 1].double(), want[0, 0, 1], rtol=2e-5, atol=0)


def test_update_first_tile_of_minus_inf_scores_is_not_nan():
    # Regression: with every score of the first tile -inf the running max stayed -inf and
    # exp(-inf - -inf) = NaN poisoned the row; the reference gives exp(-inf) = 0 weights, and a NaN
    # only in the column where those patterns are infinite (0·inf).
    torch.manual_seed(1)
    for s in (3, 70):  # streaming and GEMM paths
        state, stored = torch.randn(1, 1, s, 32), torch.randn(1, 1, 600, 32) * 0.3
        stored[0, 0, :40, 2] = float("inf")
        state[..., 2] = -state[..., 2].abs()
        out = attnkit.hopfield_update(state, stored, beta=0.5, backend="cpu")
        assert torch.isnan(out[..., 2]).all()
        assert torch.isfinite(out[..., :2]).all() and torch.isfinite(out[..., 3:]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,N,D,Dv,steps", [(1, 5000, 64, 32, 2), (3, 9000, 40, None, 2), (70, 1100, 72, 24, 3)],
                         ids=["one-query-values", "split-N", "fused-values"])
def test_16bit_native_update_is_the_float32_update_rounded(dtype, S, N, D, Dv, steps, monkeypatch):
    """The native path runs 16-bit inputs on float32 tiles (converted a tile of stored rows at a
    time on builds without AVX-512, up front with it): bit for bit the float32 update of the
    converted inputs, rounded once -- NaN and inf patterns included -- across several tiles of
    512 stored rows, the split-N and fused decompositions, with and without values."""
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    g = torch.Generator().manual_seed(S + N)
    state = torch.randn(2, 2, S, D, generator=g).to(dtype)
    stored = torch.randn(2, 2, N, D, generator=g).to(dtype)
    values = None if Dv is None else torch.randn(2, 2, N, Dv, generator=g).to(dtype)
    stored[0, 1, N // 2, 3] = float("nan")
    stored[1, 0, 7, 0] = float("inf")
    kwargs = {} if values is None else {"values": values}
    got = attnkit.hopfield_update(state, stored, beta=0.3, steps=steps, backend="cpu", **kwargs)
    kwargs32 = {} if values is None else {"values": values.float()}
    want = attnkit.hopfield_update(state.float(), stored.float(), beta=0.3, steps=steps, backend="cpu",
                                   **kwargs32).to(dtype)
    assert torch.isnan(got).any() and torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())

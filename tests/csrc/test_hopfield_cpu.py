"""The C++ CPU op attnkit::hopfield_energy_fwd (csrc/cpu/hopfield.cpp) and its Python
registrations (fake, autograd with the chunked backward) in pytorch_ext/ops/hopfield.py."""
import importlib
import math

import pytest
import torch

import attnkit
from attnkit.reference.hopfield import hopfield_energy_reference

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


@pytest.mark.parametrize("budget", [1, 40, 1 << 22])
def test_backward_slices_the_probabilities_and_matches_explicit_gradients(monkeypatch, budget):
    b_, h_, s_, n_, d_ = 2, 2, 5, 37, 8
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

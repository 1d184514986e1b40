"""attnkit.hopfield_update and attnkit.hopfield_energy: the public functions (validation,
dispatch, shapes, gradients, torch.compile) against the float64 reference."""
import importlib
import os
import subprocess
import sys

import pytest
import torch

import attnkit
from attnkit import BackendUnavailableError
from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference
from attnkit_testing import assert_close_to_reference

hop_ops = importlib.import_module("attnkit.ops.hopfield")
F64 = torch.float64
NATIVE = attnkit.backends()["hopfield_energy"]["cpu"].usable
needs_native = pytest.mark.skipif(not NATIVE, reason="attnkit._C (the cpu backend) is not built")
ENERGY_BACKENDS = ["reference", pytest.param("cpu", marks=needs_native)]


def _inputs(b=2, h=3, s=7, n=33, d=16, dv=5, dtype=torch.float32):
    return (torch.randn(b, h, s, d, dtype=dtype), torch.randn(b, h, n, d, dtype=dtype),
            torch.randn(b, h, n, dv, dtype=dtype))


def _close_to_f64(got, want64, rtol=2e-5):
    """float32 result vs float64 reference: within rtol of the reference's scale."""
    torch.testing.assert_close(got.to(F64), want64, rtol=rtol, atol=rtol * want64.abs().max().item())


# ----------------------------------------------------------------------------- update


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("tol", [None, 1e-2])
def test_update_float32_matches_float64_reference(steps, with_values, tol):
    state, stored, values = _inputs(s=7, n=129, d=63)
    values = values if with_values else None
    got = attnkit.hopfield_update(state, stored, beta=0.3, steps=steps, values=values, tol=tol)
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.3, steps=steps,
                                     values=None if values is None else values.double(), tol=tol)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 7, 5 if with_values else 63)
    _close_to_f64(got, want)


def test_update_default_beta_is_inverse_sqrt_of_head_dim():
    state, stored, _ = _inputs(d=64)
    got = attnkit.hopfield_update(state, stored, steps=2)
    assert torch.equal(got, attnkit.hopfield_update(state, stored, beta=0.125, steps=2))
    assert not torch.equal(got, attnkit.hopfield_update(state, stored, beta=0.25, steps=2))


def test_update_one_step_retrieval_of_noisy_binary_patterns():
    # 1000 random ±1 patterns in d = 128 and β = 1: the target scores 128 − 2·13 = 102 against
    # ~N(0, 128) for the rest, so a single update restores every bit of a 10%-flipped query.
    patterns = torch.randint(0, 2, (1, 1, 1000, 128)).float() * 2 - 1
    targets = patterns[:, :, :32]
    flips = torch.rand(1, 1, 32, 128).argsort(-1) < 13  # exactly 13 of 128 bits per query
    noisy = torch.where(flips, -targets, targets)
    assert torch.equal(attnkit.hopfield_update(noisy, patterns, beta=1.0).sign(), targets)
    # Retrieving the values stored with the patterns: the one-hot label of each.
    labels = torch.eye(1000).view(1, 1, 1000, 1000)
    got = attnkit.hopfield_update(noisy, patterns, beta=1.0, values=labels)
    assert torch.equal(got.argmax(-1)[0, 0], torch.arange(32))


def test_update_tol_freezes_rows_independently():
    state, stored, _ = _inputs(b=1, h=1, s=2, n=20)
    state[0, 0, 0] = stored[0, 0, 3]  # next to a fixed point: tiny first change
    one = attnkit.hopfield_update(state, stored, beta=1.0, steps=1)
    three = attnkit.hopfield_update(state, stored, beta=1.0, steps=3)
    first_change = (one - state).abs().amax(-1)[0, 0]
    tol = 2 * first_change[0].item()
    assert first_change[1] > tol
    got = attnkit.hopfield_update(state, stored, beta=1.0, steps=3, tol=tol)
    assert torch.equal(got[0, 0, 0], one[0, 0, 0])
    assert torch.equal(got[0, 0, 1], three[0, 0, 1])
    assert torch.equal(attnkit.hopfield_update(state, stored, beta=1.0, steps=3, tol=0.0), three)


def test_update_non_contiguous_inputs():
    state = torch.randn(2, 7, 3, 16).transpose(1, 2)
    stored = torch.randn(2, 3, 16, 40).transpose(2, 3)
    values = torch.randn(2, 3, 40, 10)[..., ::2]
    assert not (state.is_contiguous() or stored.is_contiguous() or values.is_contiguous())
    got = attnkit.hopfield_update(state, stored, steps=2, values=values, tol=1e-3)
    want = attnkit.hopfield_update(state.contiguous(), stored.contiguous(), steps=2,
                                   values=values.contiguous(), tol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_update_empty_queries_give_empty_results():
    _, stored, values = _inputs()
    state = torch.randn(2, 3, 0, 16)
    assert attnkit.hopfield_update(state, stored, steps=3, tol=0.1).shape == (2, 3, 0, 16)
    assert attnkit.hopfield_update(state, stored, steps=3, values=values).shape == (2, 3, 0, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_update_low_precision_within_twice_reference_error(dtype):
    state, stored, values = _inputs(n=63)
    want = hopfield_update_reference(state.double(), stored.double(), steps=2, values=values.double())
    lo = [t.to(dtype) for t in (state, stored, values)]
    ref_err = (hopfield_update_reference(lo[0], lo[1], steps=2, values=lo[2]).double() - want).abs().max()
    got = attnkit.hopfield_update(lo[0], lo[1], steps=2, values=lo[2])
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3


def test_update_gradcheck_float64():
    state, stored, values = (t.double().requires_grad_() for t in _inputs(b=1, h=2, s=3, n=5, d=4, dv=3))
    assert torch.autograd.gradcheck(
        lambda a, x, v: attnkit.hopfield_update(a, x, beta=0.8, steps=2, values=v), (state, stored, values))
    assert torch.autograd.gradcheck(
        lambda a, x: attnkit.hopfield_update(a, x, beta=0.8, steps=3, tol=1e-2), (state, stored))


def test_update_torch_compile_fullgraph():
    state, stored, values = _inputs(b=1, h=2, s=7, n=9, d=8, dv=3)
    compiled = torch.compile(attnkit.hopfield_update, fullgraph=True)
    # One compile (they take seconds here) through every branch: the tol masks and the values.
    kwargs = {"steps": 3, "tol": 1e-2, "values": values, "beta": 0.5}
    torch.testing.assert_close(compiled(state, stored, **kwargs),
                               attnkit.hopfield_update(state, stored, **kwargs), rtol=1e-6, atol=1e-6)


UPDATE_BACKENDS = ["reference", pytest.param("cpu", marks=needs_native)]


@pytest.mark.parametrize("backend", UPDATE_BACKENDS)
@pytest.mark.parametrize("with_values", [False, True])
def test_update_return_energy_gives_the_energies_of_the_trajectory(backend, with_values):
    state, stored, values = _inputs(s=7, n=40, d=16, dtype=F64)
    values = values if with_values else None
    out, energy = attnkit.hopfield_update(state, stored, beta=0.5, steps=3, values=values, tol=1e-3,
                                          return_energy=True, backend=backend)
    assert energy.shape == (4, 2, 3, 7) and energy.dtype == F64 and not energy.requires_grad
    assert torch.equal(out, attnkit.hopfield_update(state, stored, beta=0.5, steps=3, values=values, tol=1e-3,
                                                    backend=backend))
    # Independently: the energies of ξ_0 … ξ_3, the stored-space trajectory under the same tol
    # (with values, ξ_3 is the stored-space update of the state the read-out starts from).
    xi = [state]
    for _ in range(3):
        xi.append(attnkit.hopfield_update(xi[0], stored, beta=0.5, steps=len(xi), tol=1e-3, backend="reference"))
    for k in range(4):
        torch.testing.assert_close(energy[k], hopfield_energy_reference(xi[k], stored, 0.5), rtol=1e-10, atol=1e-10)


@needs_native
def test_update_defaults_to_the_cpu_kernel_on_cpu(monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(hop_ops, "hopfield_update_reference", no_reference)
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    state, stored, _ = _inputs()
    assert attnkit.hopfield_update(state, stored, steps=2).shape == (2, 3, 7, 16)
    with pytest.raises(AssertionError, match="the reference ran"):
        attnkit.hopfield_update(state, stored, backend="reference")


UPDATE_GRAD_CASES = [  # (s, n, d, dv, steps, with_values, tol); S = 1: _few_queries_backward
    (1, 1, 5, 3, 1, False, None), (1, 3000, 64, 64, 1, False, None), (1, 200, 16, 4, 3, True, 1e-2),
    (1, 513, 33, 33, 3, False, 10.0), (7, 129, 63, 5, 3, True, 1e-2),
    (16, 700, 17, 9, 2, False, 1e-3), (40, 257, 32, 32, 3, True, None), (300, 513, 64, 64, 3, False, None),
]


@needs_native
@pytest.mark.parametrize("s,n,d,dv,steps,with_values,tol", UPDATE_GRAD_CASES)
def test_update_float32_gradients_match_float64_reference(s, n, d, dv, steps, with_values, tol):
    """On CPU each retrieval's backward is the C++ softmax backward kernel (attnkit::softmax_bwd,
    from the step's lse and output): gradients of state, stored and values against the float64
    reference's autograd, frozen rows (tol) included."""
    gen = torch.Generator().manual_seed(s + n)
    # Rows of norm ~2: scores of a few units, so the softmax is not one-hot.  (Randn rows of norm
    # sqrt(D) give scores ~40 at D=64: dstate then cancels to ~1e-5 of its terms, and the float32
    # rounding of those scores, amplified over three near-argmax steps, is all that is left.)
    state, stored, values = (2 * torch.randn(2, 2, r, c, generator=gen) / c ** 0.5
                             for r, c in ((s, d), (n, d), (n, dv)))
    values = values if with_values else None
    g = torch.randn(2, 2, s, dv if with_values else d, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (state, stored) + ((values,) if with_values else ())]
    out = attnkit.hopfield_update(leaves[0], leaves[1], beta=0.7, steps=steps, tol=tol,
                                  values=leaves[2] if with_values else None, backend="cpu")
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = hopfield_update_reference(ref_leaves[0], ref_leaves[1], beta=0.7, steps=steps, tol=tol,
                                    values=ref_leaves[2] if with_values else None)
    want = torch.autograd.grad(ref, ref_leaves, g.double())
    for name, got, w in zip(("state", "stored", "values"), grads, want):
        if name == "state" and n == 1:
            # One stored pattern: P = 1 and dP = Δ = g·x, so dstate = β P (dP − Δ) x is exactly 0;
            # the float32 rounding scales with the terms that cancel, β ‖g‖ ‖x‖ max|x|.
            terms = 0.7 * g.norm(dim=-1).max() * stored.norm(dim=-1).max() * stored.abs().max()
            assert w.abs().max() == 0 and got.abs().max() <= 1e-4 * terms
            continue
        assert_close_to_reference(got, w, grad=True, name=f"d{name}")


@needs_native
def test_update_backward_runs_the_softmax_kernel_and_double_backward_the_reference(monkeypatch):
    calls = []
    real = torch.ops.attnkit.softmax_bwd

    def spy(*args):
        calls.append(args[1].shape)
        return real(*args)

    monkeypatch.setattr(hop_ops, "_SOFTMAX_BWD", spy)
    state, stored, _ = (t.double().requires_grad_() for t in _inputs(b=1, h=1, s=3, n=6, d=4))
    out = attnkit.hopfield_update(state, stored, beta=0.5, steps=2, backend="cpu")
    torch.autograd.grad(out.sum(), (state, stored))
    assert calls == [(1, 1, 3, 4)] * 2  # one kernel call per retrieval
    calls.clear()
    assert torch.autograd.gradgradcheck(
        lambda a, x: attnkit.hopfield_update(a, x, beta=0.5, steps=2, backend="cpu"), (state, stored))
    assert not calls  # create_graph: through the differentiable reference
    state, stored, values = (t.double().requires_grad_() for t in _inputs(b=1, h=1, s=2, n=5, d=3, dv=2))
    assert torch.autograd.gradgradcheck(
        lambda a, x, v: attnkit.hopfield_update(a, x, beta=0.8, steps=3, values=v, tol=1e-2, backend="cpu"),
        (state, stored, values))


@needs_native
@pytest.mark.parametrize("with_values", [False, True])
def test_update_backward_formula_without_the_kernel(monkeypatch, with_values):
    """The chunked PyTorch formula (what the GPU backends run) against the reference in float64,
    frozen rows included."""
    monkeypatch.setattr(hop_ops, "_SOFTMAX_BWD", False)
    monkeypatch.setattr(hop_ops, "_BWD_PROBS_BUDGET", 40)  # several slices
    state, stored, values = (t.double().requires_grad_() for t in _inputs(b=1, h=2, s=4, n=23, d=6, dv=3))
    values = values if with_values else None
    leaves = [t for t in (state, stored, values) if t is not None]
    got = torch.autograd.grad(attnkit.hopfield_update(state, stored, beta=0.6, steps=3, values=values, tol=1e-2,
                                                      backend="cpu").sum(), leaves)
    want = torch.autograd.grad(hopfield_update_reference(state, stored, beta=0.6, steps=3, values=values,
                                                         tol=1e-2).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@needs_native
def test_update_cpu_and_reference_backends_agree_with_grads():
    state, stored, values = (t.double().requires_grad_() for t in _inputs(s=9, n=50, d=16))
    grads = []
    for backend in ("cpu", "reference"):
        out = attnkit.hopfield_update(state, stored, beta=0.4, steps=3, values=values, tol=1e-4, backend=backend)
        grads.append((out, *torch.autograd.grad(out.sum(), (state, stored, values))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@needs_native
@pytest.mark.parametrize("steps", [1, 3])
def test_update_eager_path_matches_the_registered_op_bit_for_bit(steps):
    # The plain call skips the per-argument checks and torch.library's autograd wrapper (issue
    # 14): the same kernel and backward, so the same bits as the op called as registered.
    state, stored, _ = (t.requires_grad_() for t in _inputs(s=9, n=41, d=12))
    out = attnkit.hopfield_update(state, stored, beta=0.3, steps=steps)
    assert out.grad_fn is not None
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (state, stored), g)
    op_out = torch.ops.attnkit.hopfield_update_fwd(state, stored, None, 0.3, steps, None, False)[0]
    op_grads = torch.autograd.grad(op_out, (state, stored), g)
    for got, want in zip((out, *grads), (op_out, *op_grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # default beta = 1/sqrt(D) on the fast path too; no gradient wanted: no graph
    torch.testing.assert_close(attnkit.hopfield_update(state, stored, steps=steps),
                               attnkit.hopfield_update(state, stored, beta=12 ** -0.5, steps=steps), rtol=0, atol=0)
    with torch.no_grad():
        assert attnkit.hopfield_update(state, stored, steps=steps).grad_fn is None
    assert attnkit.hopfield_update(state.detach(), stored.detach(), steps=steps).grad_fn is None


@pytest.mark.parametrize("changes,exc,match", [
    # plain-shaped calls whose other arguments are still not what the API takes
    (dict(beta=float("nan")), TypeError, "beta must be a finite real number"),
    (dict(beta=0.0), ValueError, "beta"),
    (dict(beta=True), TypeError, "beta"),
    (dict(steps=0), ValueError, "steps"),
    (dict(steps=True), TypeError, "steps"),
    (dict(steps=2.0), TypeError, "steps"),
    (dict(backend="nope"), ValueError, "nope"),
])
def test_update_plain_shaped_calls_still_checked(changes, exc, match):
    state, stored, _ = _inputs()
    with pytest.raises(exc, match=match):
        attnkit.hopfield_update(state, stored, **changes)


def test_update_plain_shaped_mismatches_still_raise():
    state, stored, _ = _inputs()
    with pytest.raises(ValueError, match="head dim"):
        attnkit.hopfield_update(state, stored[..., :-1])
    with pytest.raises(ValueError, match="dtype"):
        attnkit.hopfield_update(state, stored.double())
    with pytest.raises(ValueError, match="at least one pattern"):
        attnkit.hopfield_update(state, stored[:, :, :0])
    with pytest.raises(TypeError, match="floating point"):
        attnkit.hopfield_update(state.int(), stored.int())


# ----------------------------------------------------------------------------- energy


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
@pytest.mark.parametrize("s,n,d", [(1, 1, 16), (7, 300, 64), (129, 7, 63)])
def test_energy_float32_matches_float64_reference(backend, s, n, d):
    state, stored, _ = _inputs(s=s, n=n, d=d)
    got = attnkit.hopfield_energy(state, stored, 0.25, backend=backend)
    assert got.dtype == torch.float32 and got.shape == (2, 3, s)
    _close_to_f64(got, hopfield_energy_reference(state.double(), stored.double(), 0.25))


@needs_native
def test_energy_float64_cpu_matches_reference():
    state, stored, _ = _inputs(s=7, n=300, d=64, dtype=F64)
    got = attnkit.hopfield_energy(state, stored, 1.5, backend="cpu")
    torch.testing.assert_close(got, hopfield_energy_reference(state, stored, 1.5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_energy_low_precision_within_twice_reference_error(backend, dtype):
    state, stored, _ = _inputs(s=7, n=129, d=16)
    state, stored = state.to(dtype), stored.to(dtype)
    want = hopfield_energy_reference(state.double(), stored.double(), 0.5)
    ref_err = (hopfield_energy_reference(state, stored, 0.5).double() - want).abs().max()
    got = attnkit.hopfield_energy(state, stored, 0.5, backend=backend)
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3


@needs_native
def test_energy_defaults_to_the_cpu_kernel_on_cpu(monkeypatch):
    def no_reference(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(hop_ops, "hopfield_energy_reference", no_reference)
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    state, stored, _ = _inputs()
    assert attnkit.hopfield_energy(state, stored, 0.5).shape == (2, 3, 7)
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    with pytest.raises(AssertionError, match="the reference ran"):
        attnkit.hopfield_energy(state, stored, 0.5)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_energy_never_rises_along_the_updates(beta):
    stored = torch.randn(2, 2, 50, 16, dtype=F64)
    xi = torch.randn(2, 2, 7, 16, dtype=F64) * 2
    energies = [attnkit.hopfield_energy(xi, stored, beta)]
    for _ in range(6):
        xi = attnkit.hopfield_update(xi, stored, beta=beta)
        energies.append(attnkit.hopfield_energy(xi, stored, beta))
    for before, after in zip(energies, energies[1:]):
        assert (after <= before + 1e-12 * (1 + before.abs())).all()
    assert (energies[1] < energies[0] - 1e-6).all()
    assert (energies[-1] >= 0).all()


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
def test_energy_non_contiguous_inputs(backend):
    state = torch.randn(2, 7, 3, 16).transpose(1, 2)
    stored = torch.randn(2, 3, 40, 32)[..., ::2]
    got = attnkit.hopfield_energy(state, stored, 0.5, backend=backend)
    want = hopfield_energy_reference(state.double(), stored.double(), 0.5)
    _close_to_f64(got, want)


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
def test_energy_empty_queries_give_empty_results(backend):
    state = torch.randn(2, 3, 0, 16, requires_grad=True)
    stored = torch.randn(2, 3, 9, 16, requires_grad=True)
    e = attnkit.hopfield_energy(state, stored, 0.5, backend=backend)
    assert e.shape == (2, 3, 0)
    e.sum().backward()
    assert stored.grad.shape == stored.shape and not stored.grad.any()
    assert state.grad.shape == state.shape


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
def test_energy_gradcheck_float64(backend):
    state = torch.randn(1, 2, 3, 5, dtype=F64, requires_grad=True)
    stored = torch.randn(1, 2, 7, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, x: attnkit.hopfield_energy(a, x, 0.7, backend=backend), (state, stored))


@needs_native
def test_energy_float32_gradients_match_float64_reference():
    state, stored, _ = _inputs(s=7, n=33, d=16)
    state.requires_grad_()
    stored.requires_grad_()
    weights = torch.randn(2, 3, 7)
    (attnkit.hopfield_energy(state, stored, 0.5, backend="cpu") * weights).sum().backward()
    s64 = state.detach().double().requires_grad_()
    x64 = stored.detach().double().requires_grad_()
    (hopfield_energy_reference(s64, x64, 0.5) * weights.double()).sum().backward()
    _close_to_f64(state.grad, s64.grad, rtol=1e-4)
    _close_to_f64(stored.grad, x64.grad, rtol=1e-4)


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
def test_energy_gradient_of_a_tied_max_norm_goes_to_the_first_row(backend):
    # Two stored rows of the largest norm (x and -x): the subgradient of 1/2 M^2 goes whole to the
    # first of them, on every backend and in the reference (session 33's random fuzzing found the
    # reference's amax splitting it: float16, D = 1).
    state = torch.randn(1, 1, 3, 4, dtype=F64, requires_grad=True)
    stored = torch.randn(1, 1, 5, 4, dtype=F64)
    stored[0, 0, 1] = stored[0, 0].norm(dim=-1).max() * torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64) + 1.0
    stored[0, 0, 3] = -stored[0, 0, 1]
    stored.requires_grad_()
    grads = torch.autograd.grad(attnkit.hopfield_energy(state, stored, 0.7, backend=backend).sum(), (state, stored))
    want = torch.autograd.grad(hopfield_energy_reference(state, stored, 0.7).sum(), (state, stored))
    for got, ref in zip(grads, want):
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12)
    # the M^2 term's share: 3 rows x (d 1/2 |x_1|^2 / d x_1 = x_1), row 1 only
    plain = stored.detach().clone().requires_grad_()
    (lse_part,) = torch.autograd.grad(hopfield_energy_reference(state, plain, 0.7).sum()
                                      - 0.5 * 3 * plain[0, 0, 1].pow(2).sum(), plain)
    assert torch.allclose(grads[1][0, 0, 3], lse_part[0, 0, 3], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ENERGY_BACKENDS)
def test_energy_torch_compile_fullgraph(backend):
    state, stored, _ = _inputs(b=1, h=2, s=7, n=9, d=8)
    compiled = torch.compile(attnkit.hopfield_energy, fullgraph=True)
    state_c = state.clone().requires_grad_()
    got = compiled(state_c, stored, 0.5, backend=backend)
    torch.testing.assert_close(got, attnkit.hopfield_energy(state, stored, 0.5, backend=backend),
                               rtol=1e-6, atol=1e-6)
    got.sum().backward()
    state_e = state.clone().requires_grad_()
    attnkit.hopfield_energy(state_e, stored, 0.5, backend=backend).sum().backward()
    torch.testing.assert_close(state_c.grad, state_e.grad, rtol=1e-5, atol=1e-5)
    # A second beta and length: the recompile sees them as symbolic (a SymFloat beta reaches the op).
    state2 = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(compiled(state2, stored, 0.7, backend=backend),
                               attnkit.hopfield_energy(state2, stored, 0.7, backend=backend), rtol=1e-6, atol=1e-6)


def test_both_run_on_the_meta_device():
    state = torch.empty(2, 3, 7, 16, device="meta")
    stored = torch.empty(2, 3, 9, 16, device="meta")
    values = torch.empty(2, 3, 9, 4, device="meta")
    assert attnkit.hopfield_update(state, stored, steps=2, values=values, tol=0.1).shape == (2, 3, 7, 4)
    assert attnkit.hopfield_energy(state, stored, 0.5).shape == (2, 3, 7)


# ----------------------------------------------------------------------------- validation

UPDATE = "attnkit.hopfield_update"
ENERGY = "attnkit.hopfield_energy"


def _call(fn, state, stored, **kwargs):
    if fn == UPDATE:
        return attnkit.hopfield_update(state, stored, **kwargs)
    beta = kwargs.pop("beta", 0.5)
    return attnkit.hopfield_energy(state, stored, beta, **kwargs)


@pytest.mark.parametrize("fn", [UPDATE, ENERGY])
@pytest.mark.parametrize(
    "state_shape,stored_shape,error,match",
    [
        ((2, 3, 7), (2, 3, 9, 16), ValueError, r"state must be a 4-D tensor \[B, H, S, D\]; got 3-D"),
        ((2, 3, 7, 16), (1, 2, 3, 9, 16), ValueError, r"stored must be a 4-D tensor \[B, H, N, D\]; got 5-D"),
        ((2, 3, 7, 16), (1, 3, 9, 16), ValueError, "state and stored must have the same batch size; got state 2, stored 1"),
        ((2, 3, 7, 16), (2, 4, 9, 16), ValueError, "state and stored must have the same number of heads; got state 3, stored 4"),
        ((2, 3, 7, 16), (2, 3, 9, 8), ValueError, "state and stored must have the same head dim; got state 16, stored 8"),
        ((2, 3, 7, 16), (2, 3, 0, 16), ValueError, r"stored must hold at least one pattern \(N >= 1\); got stored of shape \(2, 3, 0, 16\)"),
        ((2, 3, 7, 0), (2, 3, 9, 0), ValueError, "the head dim D must be >= 1"),
    ],
)
def test_shape_errors(fn, state_shape, stored_shape, error, match):
    with pytest.raises(error, match=f"{fn}: {match}"):
        _call(fn, torch.randn(state_shape), torch.randn(stored_shape))


@pytest.mark.parametrize("fn", [UPDATE, ENERGY])
def test_kind_dtype_and_device_errors(fn):
    state, stored, _ = _inputs()
    with pytest.raises(TypeError, match=f"{fn}: state must be a torch.Tensor"):
        _call(fn, state.tolist(), stored)
    with pytest.raises(TypeError, match=f"{fn}: stored must be floating point .*; got int64"):
        _call(fn, state, stored.long())
    with pytest.raises(TypeError, match=f"{fn}: state must be floating point .*; got bool"):
        _call(fn, state > 0, stored)
    with pytest.raises(ValueError, match=fr"{fn}: stored must have the dtype of state \(float32\); got float64"):
        _call(fn, state, stored.double())
    with pytest.raises(ValueError, match=fr"{fn}: stored must be on the device of state \(cpu\); got meta"):
        _call(fn, state, stored.to("meta"))


@pytest.mark.parametrize("fn", [UPDATE, ENERGY])
@pytest.mark.parametrize(
    "beta,error,match",
    [
        (0.0, ValueError, "beta must be > 0; got 0.0"),
        (-1.0, ValueError, "beta must be > 0; got -1.0"),
        (float("inf"), TypeError, "beta must be a finite real number; got inf"),
        (float("nan"), TypeError, "beta must be a finite real number; got nan"),
        ("0.5", TypeError, "beta must be a finite real number; got '0.5'"),
        (torch.tensor(0.5), TypeError, "beta must be a finite real number"),
    ],
)
def test_beta_errors(fn, beta, error, match):
    state, stored, _ = _inputs()
    with pytest.raises(error, match=f"{fn}: {match}"):
        _call(fn, state, stored, beta=beta)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"steps": 0}, ValueError, "steps must be >= 1; got 0"),
        ({"steps": -2}, ValueError, "steps must be >= 1; got -2"),
        ({"steps": 2.0}, TypeError, "steps must be an int; got 2.0"),
        ({"steps": True}, TypeError, "steps must be an int; got True"),
        ({"tol": -1e-3}, ValueError, "tol must be >= 0; got -0.001"),
        ({"tol": float("nan")}, TypeError, "tol must be a finite real number; got nan"),
        ({"backend": "fast"}, ValueError, "unknown backend 'fast'; expected one of reference"),
        ({"return_energy": 1}, TypeError, "return_energy must be a bool; got 1"),
    ],
)
def test_update_argument_errors(kwargs, error, match):
    state, stored, _ = _inputs()
    with pytest.raises(error, match=f"{UPDATE}: {match}"):
        attnkit.hopfield_update(state, stored, **kwargs)


@pytest.mark.parametrize(
    "values_shape,match",
    [
        ((2, 3, 9), r"values must be a 4-D tensor \[B, H, N, Dv\]; got 3-D"),
        ((1, 3, 33, 5), "values and stored must have the same batch size; got values 1, stored 2"),
        ((2, 1, 33, 5), "values and stored must have the same number of heads; got values 1, stored 3"),
        ((2, 3, 32, 5), "values and stored must have the same length N; got values 32, stored 33"),
    ],
)
def test_update_values_shape_errors(values_shape, match):
    state, stored, _ = _inputs()
    with pytest.raises(ValueError, match=f"{UPDATE}: {match}"):
        attnkit.hopfield_update(state, stored, values=torch.randn(values_shape))


def test_update_values_kind_dtype_and_device_errors():
    state, stored, values = _inputs()
    with pytest.raises(TypeError, match=f"{UPDATE}: values must be floating point .*; got int32"):
        attnkit.hopfield_update(state, stored, values=values.int())
    with pytest.raises(ValueError, match=fr"{UPDATE}: values must have the dtype of state \(float32\); got float16"):
        attnkit.hopfield_update(state, stored, values=values.half())
    with pytest.raises(ValueError, match=fr"{UPDATE}: values must be on the device of state \(cpu\); got meta"):
        attnkit.hopfield_update(state, stored, values=values.to("meta"))


def test_named_kernel_backend_refuses_what_it_cannot_run():
    state, stored, _ = _inputs()
    with pytest.raises(BackendUnavailableError, match=f"{UPDATE}: .*triton.*float64"):
        attnkit.hopfield_update(state.double(), stored.double(), backend="triton")


def test_energy_backend_errors():
    state, stored, _ = _inputs()
    with pytest.raises(ValueError, match=f"{ENERGY}: unknown backend 'fast'"):
        attnkit.hopfield_energy(state, stored, 0.5, backend="fast")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match=f"{ENERGY}: .*cuda"):
            attnkit.hopfield_energy(state, stored, 0.5, backend="cuda")
    with pytest.raises(TypeError, match="beta"):
        attnkit.hopfield_energy(state, stored)  # beta is required


def test_validation_runs_before_any_computation(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("computed before validating")

    monkeypatch.setattr(hop_ops, "hopfield_update_reference", boom)
    monkeypatch.setattr(hop_ops, "hopfield_energy_reference", boom)
    state, stored, _ = _inputs()
    with pytest.raises(ValueError, match="steps"):
        attnkit.hopfield_update(state, stored, steps=0)
    with pytest.raises(ValueError, match="beta"):
        attnkit.hopfield_energy(state, stored, -1.0, backend="reference")


def test_without_the_native_extension_the_energy_falls_back_and_says_why():
    # A fresh interpreter in which `import attnkit._C` fails, as on an install without a compiler.
    probe = (
        "import sys; sys.modules['attnkit._C'] = None\n"
        "import torch, attnkit\n"
        "status = attnkit.backends()['hopfield_energy']['cpu']\n"
        "assert not status.usable and 'attnkit._C' in status.reason, status\n"
        "s, x = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)\n"
        "from attnkit.reference.hopfield import hopfield_energy_reference as ref\n"
        "assert torch.equal(attnkit.hopfield_energy(s, x, 0.5), ref(s, x, 0.5))\n"
        "try:\n"
        "    attnkit.hopfield_energy(s, x, 0.5, backend='cpu')\n"
        "except attnkit.BackendUnavailableError as exc:\n"
        "    assert 'attnkit._C' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('backend=cpu ran without attnkit._C')\n"
        "assert torch.equal(attnkit.hopfield_update(s, x, beta=0.5, steps=2),\n"
        "                   attnkit.reference.hopfield.hopfield_update_reference(s, x, beta=0.5, steps=2))\n"
        "assert not attnkit.backends()['hopfield']['cpu'].usable\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_BACKEND"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

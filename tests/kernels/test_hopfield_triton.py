"""Triton Hopfield kernels (attnkit.kernels.hopfield): fused multi-step update, split-N update,
energy, and the ops around them (``attnkit::hopfield_triton_update_fwd`` / ``_energy_fwd``).

Without a GPU these run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): small shapes (S in {1, 7}, N in {1, 300}, D in {16, 64}, steps 1..3).  With
a GPU the same tests run on CUDA, plus the ``gpu``-marked ones (bfloat16, which the interpreter
cannot do, large N through the split path, autotuned configs).

Ground truth: float64.  attnkit_testing's ``loop_hopfield_update`` spells out every output of the op contract
(csrc/ops.cpp: out, states, lse, applied) with the tol rule written row by row; the outputs are
also checked against ``hopfield_update_reference`` (the public function's ground truth).
Tolerance rule (DESIGN.md) via ``assert_close_to_reference``.
"""
import functools
import math

import pytest
import torch

triton = pytest.importorskip("triton")

import attnkit  # noqa: E402
from attnkit.kernels import hopfield as K  # noqa: E402
from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference  # noqa: E402
from attnkit_testing import TRITON_BF16, assert_close_to_reference, loop_hopfield_update, make_hopfield_inputs  # noqa: E402

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG16 = triton.Config({"BLOCK_S": 16, "BLOCK_N": 64}, num_warps=4, num_stages=2)
make = functools.partial(make_hopfield_inputs, device=DEVICE)


def check_outputs(got, state, stored, values, beta, steps, tol, final_state):
    """float32 inputs: every output against loop_hopfield_update; out also against the reference."""
    out, states, lse, applied = got
    r_out, r_states, r_lse, r_applied = loop_hopfield_update(state, stored, values, beta, steps, tol, final_state)
    assert out.dtype == states.dtype == lse.dtype == F32 and applied.dtype == torch.bool
    assert torch.equal(applied.cpu(), r_applied), "applied differs"
    assert_close_to_reference(out.cpu(), r_out, name="out")
    assert_close_to_reference(states.cpu(), r_states, name="states")
    # lse of the rows each retrieval really ran on (a frozen row's lse is unspecified: +inf when
    # its whole block skipped the step).
    ran = torch.cat([r_applied, torch.ones_like(r_lse[:1], dtype=torch.bool)]) if values is not None else r_applied
    assert_close_to_reference(lse.cpu()[ran], r_lse[ran], name="lse", dtype=F32)
    ref = hopfield_update_reference(state.double().cpu(), stored.double().cpu(), beta=beta, steps=steps,
                                    values=None if values is None else values.double().cpu(), tol=tol)
    assert_close_to_reference(out.cpu(), ref, name="out vs reference")


# ----------------------------------------------------------------------------------------------
# kernel level: fused and split-N, float32 and float16
# ----------------------------------------------------------------------------------------------

CASES = [  # (S, N, D, Dv or None, steps)
    (7, 300, 16, None, 3),
    (1, 300, 64, None, 2),
    (7, 1, 16, None, 2),
    (7, 300, 64, 16, 3),
    (1, 300, 16, 64, 1),
]


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("s,n,d,dv,steps", CASES)
def test_update_float32(split, s, n, d, dv, steps):
    state, stored, values = make(2, 2, s, n, d, dv)
    beta = 0.5
    got = K.hopfield_update_fwd(state, stored, values, beta, steps, None, True, split=split,
                                split_rows=128 if split else None, config=None if split else CFG16)
    check_outputs(got, state, stored, values, beta, steps, None, True)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("with_values", [False, True])
def test_update_tol_freezes_some_rows(split, with_values):
    # beta = 2 on well-separated patterns: most rows reach a fixed point after one or two steps,
    # so tol = 1e-3 freezes them at different steps while the others go on.
    state, stored, values = make(1, 2, 7, 300, 16, 16 if with_values else None, seed=3)
    state = stored[:, :, :7] + 0.3 * state
    steps, tol = 3 + with_values, 1e-3  # with values the last step is the read-out
    got = K.hopfield_update_fwd(state, stored, values, 2.0, steps, tol, True, split=split,
                                split_rows=64 if split else None, config=None if split else CFG16)
    check_outputs(got, state, stored, values, 2.0, steps, tol, True)
    applied = got[3]
    assert not applied[-1].all() and applied[-1].any(), "the case must freeze some rows, not all"


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_all_rows_frozen_skip_the_block(split):
    # tol above any change: every row freezes after its first update; the block skips the rest.
    state, stored, _ = make(1, 1, 1, 300, 16)
    got = K.hopfield_update_fwd(state, stored, None, 0.5, 3, 1e3, True, split=split,
                                split_rows=64 if split else None)
    out, states, lse, applied = got
    assert applied[0].all() and not applied[1:].any()
    assert torch.isinf(lse[1:]).all() and (lse[1:] > 0).all() and torch.isfinite(lse[0]).all()
    assert torch.equal(states[1], states[2]) and torch.equal(states[2], states[3])
    check_outputs(got, state, stored, None, 0.5, 3, 1e3, True)


@pytest.mark.parametrize("final_state", [False, True])
def test_values_final_state(final_state):
    state, stored, values = make(1, 1, 7, 300, 16, 32)
    got = K.hopfield_update_fwd(state, stored, values, 0.5, 2, None, final_state, config=CFG16)
    if not final_state:
        assert not got[1][-1].any(), "states[steps] must be zeros without final_state"
    check_outputs(got, state, stored, values, 0.5, 2, None, final_state)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("s,n,d,dv,steps", [(7, 300, 64, None, 3), (7, 300, 16, 64, 2)])
def test_update_float16(split, s, n, d, dv, steps):
    state, stored, values = make(1, 2, s, n, d, dv, dtype=F16)
    beta = 1.0 / math.sqrt(d)
    out = K.hopfield_update_fwd(state, stored, values, beta, steps, None, False, split=split,
                                split_rows=128 if split else None, config=None if split else CFG16)[0]
    to64 = lambda t: None if t is None else t.double().cpu()  # noqa: E731
    ref64 = hopfield_update_reference(to64(state), to64(stored), beta=beta, steps=steps, values=to64(values))
    ref16 = hopfield_update_reference(state.cpu(), stored.cpu(), beta=beta, steps=steps,
                                      values=None if values is None else values.cpu())
    assert_close_to_reference(out.cpu(), ref64, ref16.cpu(), dtype=F16)


def test_split_equals_fused():
    state, stored, _ = make(1, 1, 7, 300, 16)
    a = K.hopfield_update_fwd(state, stored, None, 0.5, 2, None, True, split=False, config=CFG16)
    b = K.hopfield_update_fwd(state, stored, None, 0.5, 2, None, True, split=True, split_rows=64)
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)


def test_launcher_errors():
    state, stored, _ = make(1, 1, 3, 10, 16)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        K.hopfield_update_fwd(state.double(), stored.double(), None, 1.0, 1, None, False)
    with pytest.raises(ValueError, match="head dim"):
        big = torch.zeros(1, 1, 3, 300, device=DEVICE)
        K.hopfield_update_fwd(big, big, None, 1.0, 1, None, False)
    with pytest.raises(ValueError, match="S <= 16"):
        s20 = torch.zeros(1, 1, 20, 16, device=DEVICE)
        K.hopfield_update_fwd(s20, stored, None, 1.0, 1, None, False, split=True)
    with pytest.raises(ValueError, match="N >= 1"):
        K.hopfield_update_fwd(state, stored[:, :, :0], None, 1.0, 1, None, False)


# ----------------------------------------------------------------------------------------------
# energy
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, TRITON_BF16])
@pytest.mark.parametrize("s,n,d", [(7, 300, 16), (1, 1, 64), (20, 300, 64)])
def test_energy(dtype, s, n, d):
    state, stored, _ = make(2, 1, s, n, d, dtype=dtype)
    beta = 0.3
    energy, lse = K.hopfield_energy_fwd(state, stored, beta)
    s64, x64 = state.double().cpu(), stored.double().cpu()
    ref = hopfield_energy_reference(s64, x64, beta)
    ref_lse = torch.logsumexp(beta * s64 @ x64.transpose(-2, -1), -1)
    low = hopfield_energy_reference(state.cpu(), stored.cpu(), beta) if dtype != F32 else None
    low_lse = torch.logsumexp(beta * state.cpu() @ stored.cpu().transpose(-2, -1), -1) if dtype != F32 else None
    assert energy.dtype == lse.dtype == F32
    assert_close_to_reference(energy.cpu(), ref, low, name="energy", dtype=dtype)
    assert_close_to_reference(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)


# ----------------------------------------------------------------------------------------------
# through the public functions and the ops: routing, gradients, opcheck, torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_values,tol", [(False, None), (True, None), (False, 1e-3)])
def test_public_update_and_grads(with_values, tol):
    state, stored, values = make(1, 2, 7, 300, 16, 8 if with_values else None, seed=5)
    leaves = [t for t in (state, stored, values) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    out = attnkit.hopfield_update(state, stored, beta=0.7, steps=2, values=values, tol=tol, backend="triton")
    assert out.dtype == F32
    leaves64 = [t.detach().double().cpu().requires_grad_(True) for t in leaves]
    v64 = leaves64[2] if with_values else None
    ref = hopfield_update_reference(leaves64[0], leaves64[1], beta=0.7, steps=2, values=v64, tol=tol)
    assert_close_to_reference(out.cpu(), ref)
    g = torch.randn(ref.shape, dtype=F64)
    out.backward(g.to(F32).to(DEVICE))
    ref.backward(g)
    for name, t, t64 in zip(("state", "stored", "values"), leaves, leaves64):
        assert_close_to_reference(t.grad.cpu(), t64.grad, grad=True, name=f"grad {name}")


def test_public_energy_grads_and_return_energy():
    state, stored, _ = make(1, 2, 7, 300, 16, seed=6)
    state.requires_grad_(True)
    stored.requires_grad_(True)
    e = attnkit.hopfield_energy(state, stored, 0.4, backend="triton")
    s64 = state.detach().double().cpu().requires_grad_(True)
    x64 = stored.detach().double().cpu().requires_grad_(True)
    ref = hopfield_energy_reference(s64, x64, 0.4)
    assert_close_to_reference(e.cpu(), ref, name="energy")
    e.sum().backward()
    ref.sum().backward()
    assert_close_to_reference(state.grad.cpu(), s64.grad, grad=True, name="grad state")
    assert_close_to_reference(stored.grad.cpu(), x64.grad, grad=True, name="grad stored")
    out, energy = attnkit.hopfield_update(state.detach(), stored.detach(), beta=0.4, steps=3,
                                          return_energy=True, backend="triton")
    _, r_energy = hopfield_update_reference(s64.detach(), x64.detach(), beta=0.4, steps=3, return_energy=True)
    assert_close_to_reference(energy.cpu(), r_energy, name="energies along the updates")
    assert (energy[1:] <= energy[:-1] + 1e-4).all(), "the update must not raise the energy"


def test_routing():
    state, stored, _ = make(1, 1, 3, 20, 16)
    with pytest.raises(attnkit.BackendUnavailableError, match="float64"):
        attnkit.hopfield_update(state.double(), stored.double(), backend="triton")
    with pytest.raises(attnkit.BackendUnavailableError, match="head dims"):
        big = torch.randn(1, 1, 3, 300, device=DEVICE)
        attnkit.hopfield_energy(big, big, 1.0, backend="triton")
    assert "triton" in attnkit.backends()["hopfield"] and attnkit.backends()["hopfield"]["triton"].usable


def test_opcheck():
    state, stored, values = make(1, 2, 7, 40, 16, 8)
    op = torch.ops.attnkit.hopfield_triton_update_fwd.default
    for args in ((state, stored, None, 0.5, 2, None, False), (state, stored, values, 0.5, 2, 1e-3, True)):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.attnkit.hopfield_triton_energy_fwd.default, (state, stored, 0.5),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_torch_compile_fullgraph():
    state, stored, values = make(1, 1, 7, 40, 16, 8)
    state.requires_grad_(True)

    def f(s, x, v):
        out = attnkit.hopfield_update(s, x, beta=0.5, steps=2, values=v, backend="triton")
        return out.sum() + attnkit.hopfield_energy(s, x, 0.5, backend="triton").sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(state, stored, values)
    want = f(state, stored, values)
    torch.testing.assert_close(got, want)
    (g1,) = torch.autograd.grad(got, state)
    (g2,) = torch.autograd.grad(want, state)
    torch.testing.assert_close(g1, g2)


# ----------------------------------------------------------------------------------------------
# GPU only: bfloat16, large N through the split path, autotuned configs
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(BF16, marks=pytest.mark.autotune), F16, F32])
@pytest.mark.parametrize("s,n,d,dv", [(1, 1 << 18, 64, None), (7, 100_000, 128, None), (64, 10_000, 64, 64),
                                      (257, 4000, 128, None)])
def test_gpu_large(dtype, s, n, d, dv):
    state, stored, values = make(1, 2, s, n, d, dv, dtype=dtype)
    beta = 1.0 / math.sqrt(d)
    out = K.hopfield_update_fwd(state, stored, values, beta, 3, None, False)[0]
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref64 = hopfield_update_reference(to64(state), to64(stored), beta=beta, steps=3, values=to64(values))
    low = None if dtype == F32 else hopfield_update_reference(state, stored, beta=beta, steps=3, values=values)
    assert_close_to_reference(out, ref64, low, dtype=dtype)
    energy, _ = K.hopfield_energy_fwd(state, stored, beta)
    e_low = None if dtype == F32 else hopfield_energy_reference(state, stored, beta)
    assert_close_to_reference(energy, hopfield_energy_reference(to64(state), to64(stored), beta), e_low,
                              dtype=dtype, name="energy")


@pytest.mark.gpu
def test_gpu_split_equals_fused_bf16():
    state, stored, _ = make(2, 2, 5, 50_000, 64, dtype=BF16)
    a = K.hopfield_update_fwd(state, stored, None, 0.125, 2, 1e-4, True, split=False)
    b = K.hopfield_update_fwd(state, stored, None, 0.125, 2, 1e-4, True, split=True)
    torch.testing.assert_close(a[0], b[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(a[3], b[3])

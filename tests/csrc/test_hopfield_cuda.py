"""CUDA C++ Hopfield kernels (csrc/cuda/hopfield.cu): attnkit::hopfield_update_fwd and
attnkit::hopfield_energy_fwd under the CUDA dispatch key, i.e. ``backend="cuda"``.

GPU only (``pytest -m gpu``; skipped elsewhere, and where attnkit._C was built without CUDA).
Ground truth: float64 -- the reference for out / energy and attnkit_testing's
``loop_hopfield_update`` for the op's other outputs (states, lse, applied).  Tolerance rule of
DESIGN.md via ``assert_close_to_reference``; bfloat16 and float16 against 2x the reference's own
error in that dtype.
"""
import functools
import math

import pytest
import torch

import attnkit
from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference
from attnkit_testing import assert_close_to_reference, loop_hopfield_update, make_hopfield_inputs

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.fixture(autouse=True)
def _needs_cuda_build():
    if not attnkit.backends()["hopfield"]["cuda"].usable:
        pytest.skip(attnkit.backends()["hopfield"]["cuda"].reason)


make = functools.partial(make_hopfield_inputs, device="cuda")


def to64(t):
    return None if t is None else t.detach().double()


CASES = [  # (S, N, D, Dv): fused, split-N (S <= 16, N >= 4096), odd sizes, D = 256
    (7, 300, 64, None),
    (1, 1 << 18, 64, None),
    (16, 10_000, 128, 64),
    (257, 1000, 128, None),
    (33, 129, 256, 256),
    (63, 1, 16, None),
]


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("s,n,d,dv", CASES)
def test_update_against_reference(dtype, s, n, d, dv):
    state, stored, values = make(2, 2, s, n, d, dv, dtype=dtype)
    beta = 1.0 / math.sqrt(d)
    out = attnkit.hopfield_update(state, stored, beta=beta, steps=3, values=values, backend="cuda")
    ref64 = hopfield_update_reference(to64(state), to64(stored), beta=beta, steps=3, values=to64(values))
    low = None if dtype == F32 else hopfield_update_reference(state, stored, beta=beta, steps=3, values=values)
    assert_close_to_reference(out, ref64, low, dtype=dtype)


@pytest.mark.parametrize("s,n", [(7, 300), (5, 20_000)])  # fused, split
@pytest.mark.parametrize("with_values", [False, True])
def test_op_outputs_with_tol(s, n, with_values):
    state, stored, values = make(1, 2, s, n, 16, 16 if with_values else None, seed=3)
    state = stored[:, :, :s] + 0.3 * state
    steps, tol = 3 + with_values, 1e-3
    out, states, lse, applied = torch.ops.attnkit.hopfield_update_fwd(state, stored, values, 2.0, steps, tol, True)
    _, r_states, _, r_applied = loop_hopfield_update(state, stored, values, 2.0, steps, tol, True)
    assert torch.equal(applied.cpu(), r_applied)
    assert_close_to_reference(states.cpu(), r_states, name="states")
    assert torch.isfinite(lse[0]).all()


def test_all_frozen_skip():
    state, stored, _ = make(1, 1, 1, 20_000, 16)
    _, states, lse, applied = torch.ops.attnkit.hopfield_update_fwd(state, stored, None, 0.5, 3, 1e3, True)
    assert applied[0].all() and not applied[1:].any()
    assert torch.isposinf(lse[1:]).all() and torch.equal(states[1], states[3])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("s,n,d", [(7, 300, 64), (1, 50_000, 128), (100, 2000, 16)])
def test_energy(dtype, s, n, d):
    state, stored, _ = make(2, 2, s, n, d, dtype=dtype)
    e = attnkit.hopfield_energy(state, stored, 0.2, backend="cuda")
    low = None if dtype == F32 else hopfield_energy_reference(state, stored, 0.2)
    assert_close_to_reference(e, hopfield_energy_reference(to64(state), to64(stored), 0.2), low, dtype=dtype)


def test_grads_through_the_cuda_op():
    state, stored, values = make(1, 2, 9, 5000, 64, 32)
    leaves = [state, stored, values]
    for t in leaves:
        t.requires_grad_(True)
    out = attnkit.hopfield_update(state, stored, beta=0.125, steps=2, values=values, backend="cuda")
    l64 = [to64(t).requires_grad_(True) for t in leaves]
    ref = hopfield_update_reference(l64[0], l64[1], beta=0.125, steps=2, values=l64[2])
    g = torch.randn_like(ref)
    out.backward(g.float())
    ref.backward(g)
    for t, t64 in zip(leaves, l64):
        assert_close_to_reference(t.grad, t64.grad, grad=True)


def test_cuda_matches_triton():
    pytest.importorskip("triton")
    state, stored, _ = make(2, 4, 12, 40_000, 64, dtype=BF16)
    a = attnkit.hopfield_update(state, stored, beta=0.125, steps=3, backend="cuda")
    b = attnkit.hopfield_update(state, stored, beta=0.125, steps=3, backend="triton")
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

"""attnkit.hopfield_update's few-states route (attnkit/ops/hopfield.py, _steps_by_decoding): 16-bit
states against many stored patterns run step by step as softmax attentions on the cpu backend's
decoding kernel.  Checked against the float64 reference (forward, gradients, NaN), and which calls
take the route under each tile-GEMM path."""
import importlib
import math

import pytest
import torch

import attnkit
from attnkit.reference.hopfield import hopfield_update_reference

hop_ops = importlib.import_module("attnkit.ops.hopfield")
pytestmark = pytest.mark.skipif(not attnkit.backends()["hopfield"]["cpu"].usable,
                                reason="attnkit._C (the cpu backend) is not built")
BF16, F16 = torch.bfloat16, torch.float16
MANY = hop_ops._DECODE_MANY_PATTERNS
N_ODD = MANY + 37  # past the threshold, not a multiple of the kernel's 64-key tiles


def _inputs(s, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(1, 2, s, d, generator=g).to(dtype)
    stored = torch.randn(1, 2, n, d, generator=g).to(dtype)
    return state, stored


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("s,steps", [(1, 1), (1, 3), (5, 1)])
def test_routed_update_within_twice_reference_error(dtype, s, steps):
    state, stored = _inputs(s, N_ODD, 40, dtype)
    assert hop_ops._steps_by_decoding(dtype, s, N_ODD, steps)  # on every tile-GEMM path
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.2, steps=steps)
    ref_err = (hopfield_update_reference(state, stored, beta=0.2, steps=steps).double() - want).abs().max()
    got = attnkit.hopfield_update(state, stored, beta=0.2, steps=steps, backend="cpu")
    assert got.dtype == dtype and got.shape == state.shape
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3


def test_routed_update_is_the_softmax_attention_steps_bit_for_bit():
    state, stored = _inputs(1, N_ODD, 40, F16, seed=1)
    got = attnkit.hopfield_update(state, stored, beta=0.3, steps=2, backend="cpu")
    xi = state
    for _ in range(2):
        xi = attnkit.softmax_attention(xi, stored, stored, scale=0.3, backend="cpu")
    assert torch.equal(got, xi)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_routed_update_gradients_within_twice_reference_error(dtype):
    state, stored = (t.requires_grad_() for t in _inputs(1, N_ODD, 24, dtype, seed=2))
    assert hop_ops._steps_by_decoding(dtype, 1, N_ODD, 2)
    out = attnkit.hopfield_update(state, stored, beta=0.25, steps=2, backend="cpu")
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * weights).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (state, stored)]
    (hopfield_update_reference(*leaves64, beta=0.25, steps=2) * weights.double()).sum().backward()
    low = [t.detach().clone().requires_grad_() for t in (state, stored)]
    (hopfield_update_reference(*low, beta=0.25, steps=2) * weights.to(dtype)).sum().backward()
    for got, r64, rlo in zip((state, stored), leaves64, low):
        assert got.grad.dtype == dtype
        ref_err = (rlo.grad.double() - r64.grad).abs().max()
        assert (got.grad.double() - r64.grad).abs().max() <= 2 * ref_err + 1e-3


@pytest.mark.parametrize("where,val", [("stored", math.nan), ("stored", math.inf), ("state", math.inf)])
def test_routed_update_nan_rows_as_the_reference(where, val):
    state, stored = _inputs(3, N_ODD, 40, BF16, seed=4)
    if where == "stored":
        stored[0, 1, 11, 5] = val
    else:
        state[0, 0, 2, 7] = val
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.2, steps=2)
    got = attnkit.hopfield_update(state, stored, beta=0.2, steps=2, backend="cpu")
    assert want.isnan().any()
    assert torch.equal(got.isnan(), want.isnan())


class _Routed(Exception):
    pass


def _raise_routed(*args):
    raise _Routed


@pytest.mark.parametrize("kwargs,routed", [
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1), True),
    (dict(dtype=torch.float32, s=1, n=N_ODD, steps=1), False),  # float32: the fused streaming kernel
    (dict(dtype=BF16, s=17, n=N_ODD, steps=1), False),  # more states than the decoding kernel takes
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1, tol=0.1), False),  # tol: the fused kernel's freezing
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1, values=True), False),
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1, return_energy=True), False),
])
def test_which_calls_take_the_route(monkeypatch, kwargs, routed):
    monkeypatch.setattr(hop_ops, "_update_by_decoding", _raise_routed)
    state, stored = _inputs(kwargs.pop("s"), kwargs.pop("n"), 16, kwargs.pop("dtype"))
    extra = {"beta": 0.5, "steps": kwargs.pop("steps"), "backend": "cpu", **kwargs}
    if extra.pop("values", False):
        extra["values"] = stored.clone()
    if routed:
        with pytest.raises(_Routed):
            attnkit.hopfield_update(state, stored, **extra)
    else:
        attnkit.hopfield_update(state, stored, **extra)  # the fused kernel: no _Routed


@pytest.mark.parametrize("gemm,dtype,s,n,steps,routed", [
    # a brgemm path (AMX, or forced): one state always, many patterns always
    ("brgemm", BF16, 1, 256, 3, True), ("brgemm", BF16, 16, 1024, 3, False), ("brgemm", BF16, 16, MANY, 3, True),
    # the native path: many patterns, with one state or one step
    ("native", BF16, 16, 1024, 1, False), ("native", F16, 1, 1024, 1, False), ("native", F16, 1, MANY, 3, True),
    ("native", F16, 16, MANY, 3, False), ("native", F16, 16, MANY, 1, True), ("native", F16, 0, MANY, 1, False),
])
def test_the_route_follows_the_tile_gemm_path(monkeypatch, gemm, dtype, s, n, steps, routed):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", gemm)
    assert hop_ops._steps_by_decoding(dtype, s, n, steps) is routed

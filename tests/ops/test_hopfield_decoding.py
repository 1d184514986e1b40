"""attnkit.hopfield_update's route to the softmax kernels (attnkit/ops/hopfield.py, _steps_by_softmax): a
16-bit state's updates run step by step as softmax attentions on the cpu backend's decoding kernel (and
bfloat16 where the decoding kernel has its own AMX tiles: up to 16 states for one step, and 256 or more
on the flash kernel).  Checked against the float64 reference (forward, gradients, NaN), and which calls
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
N_ODD = 4133  # not a multiple of the decoding kernel's 64-key tiles; split over the threads


def _inputs(s, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(1, 2, s, d, generator=g).to(dtype)
    stored = torch.randn(1, 2, n, d, generator=g).to(dtype)
    return state, stored


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("steps", [1, 3])
def test_routed_update_within_twice_reference_error(monkeypatch, dtype, steps):
    if steps > 1:  # several steps take the route on a brgemm path only: forced (any CPU)
        monkeypatch.setenv("ATTNKIT_CPU_GEMM", "brgemm")
    state, stored = _inputs(1, N_ODD, 40, dtype)
    assert hop_ops._steps_by_softmax(dtype, 1, steps)
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.2, steps=steps)
    ref_err = (hopfield_update_reference(state, stored, beta=0.2, steps=steps).double() - want).abs().max()
    got = attnkit.hopfield_update(state, stored, beta=0.2, steps=steps, backend="cpu")
    assert got.dtype == dtype and got.shape == state.shape
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3


def test_routed_update_is_the_softmax_attention_steps_bit_for_bit(monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "brgemm")
    state, stored = _inputs(1, N_ODD, 40, BF16, seed=1)
    got = attnkit.hopfield_update(state, stored, beta=0.3, steps=2, backend="cpu")
    xi = state
    for _ in range(2):
        xi = attnkit.softmax_attention(xi, stored, stored, scale=0.3, backend="cpu")
    assert torch.equal(got, xi)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_routed_update_gradients_within_twice_reference_error(monkeypatch, dtype):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "brgemm")  # two steps: the route on any CPU
    state, stored = (t.requires_grad_() for t in _inputs(1, N_ODD, 24, dtype, seed=2))
    assert hop_ops._steps_by_softmax(dtype, 1, 2)
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


@pytest.mark.parametrize("where,val", [("stored", math.nan), ("stored", math.inf), ("state", math.inf),
                                       ("stored", -math.inf)])
def test_routed_update_nan_rows_as_the_reference(where, val):
    state, stored = _inputs(1, N_ODD, 40, BF16, seed=4)
    if where == "stored":
        stored[0, 1, 11, 5] = val
    else:
        state[0, 0, 0, 7] = val
    assert hop_ops._steps_by_softmax(BF16, 1, 1)
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.2, steps=1)
    got = attnkit.hopfield_update(state, stored, beta=0.2, steps=1, backend="cpu")
    assert want.isnan().any()
    assert torch.equal(got.isnan(), want.isnan())


class _Routed(Exception):
    pass


def _raise_routed(*args):
    raise _Routed


@pytest.mark.parametrize("kwargs,routed", [
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1), True),
    (dict(dtype=F16, s=1, n=N_ODD, steps=1), True),
    (dict(dtype=torch.float32, s=1, n=N_ODD, steps=1), False),  # float32: the fused streaming kernel
    (dict(dtype=BF16, s=2, n=N_ODD, steps=1, native=True), False),  # several states, native: fused
    (dict(dtype=BF16, s=17, n=N_ODD, steps=1), False),  # 17 states: the fused kernel everywhere
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1, tol=0.1), False),  # tol: the fused kernel's freezing
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1, values=True), False),
    (dict(dtype=BF16, s=1, n=N_ODD, steps=1, return_energy=True), False),
])
def test_which_calls_take_the_route(monkeypatch, kwargs, routed):
    monkeypatch.setattr(hop_ops, "_update_by_softmax", _raise_routed)
    if kwargs.pop("native", False):
        monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    state, stored = _inputs(kwargs.pop("s"), kwargs.pop("n"), 16, kwargs.pop("dtype"))
    extra = {"beta": 0.5, "steps": kwargs.pop("steps"), "backend": "cpu", **kwargs}
    if extra.pop("values", False):
        extra["values"] = stored.clone()
    if routed:
        with pytest.raises(_Routed):
            attnkit.hopfield_update(state, stored, **extra)
    else:
        result = attnkit.hopfield_update(state, stored, **extra)  # the fused kernel: no _Routed
        out = result[0] if isinstance(result, tuple) else result
        assert out.shape == state.shape and out.dtype == state.dtype


@pytest.mark.parametrize("gemm,dtype,s,steps,routed", [
    ("brgemm", BF16, 1, 3, True), ("brgemm", F16, 1, 3, True), ("brgemm", BF16, 16, 1, False),
    ("native", BF16, 1, 1, True), ("native", F16, 1, 3, False), ("native", F16, 16, 1, False),
    ("native", F16, 0, 1, False), ("native", torch.float32, 1, 1, False),
])
def test_the_route_follows_the_tile_gemm_path(monkeypatch, gemm, dtype, s, steps, routed):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", gemm)
    assert hop_ops._steps_by_softmax(dtype, s, steps) is routed


AMX_DECODE = hop_ops.native().cpu_gemm_path("bfloat16", "decode") == "own AMX tiles" if attnkit.backends()[
    "hopfield"]["cpu"].usable else False


@pytest.mark.parametrize("s,steps,routed", [(2, 1, True), (2, 3, False), (4, 2, False), (8, 1, True), (16, 1, True),
                                            (16, 3, False), (17, 1, False), (64, 3, False), (255, 1, False),
                                            (256, 3, True), (1024, 1, True)])
def test_bfloat16_states_take_the_route_where_the_decoding_kernel_has_its_own_tiles(monkeypatch, s, steps, routed):
    # auto: on a Xeon with AMX (the own tiles and brgemm) as measured in session 20; elsewhere
    # (native tiles) only one state.  float16 keeps the one-state rule.
    monkeypatch.delenv("ATTNKIT_CPU_GEMM", raising=False)
    assert hop_ops._steps_by_softmax(BF16, s, steps) is (routed and AMX_DECODE)
    assert hop_ops._steps_by_softmax(F16, s, steps) is False


@pytest.mark.skipif(not AMX_DECODE, reason="the decoding kernel has no own AMX tiles here")
@pytest.mark.parametrize("s,steps", [(3, 1), (16, 1), (256, 2)])
def test_routed_states_within_twice_reference_error(s, steps):
    state, stored = _inputs(s, 700, 64, BF16, seed=5)
    assert hop_ops._steps_by_softmax(BF16, s, steps)
    want = hopfield_update_reference(state.double(), stored.double(), beta=0.2, steps=steps)
    ref_err = (hopfield_update_reference(state, stored, beta=0.2, steps=steps).double() - want).abs().max()
    got = attnkit.hopfield_update(state, stored, beta=0.2, steps=steps, backend="cpu")
    assert got.dtype == BF16 and got.shape == state.shape
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3

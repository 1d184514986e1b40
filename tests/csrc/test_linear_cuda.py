"""CUDA C++ linear-attention kernels (csrc/cuda/linear.cu): torch.ops.attnkit.linear_fwd /
linear_bwd on CUDA tensors against the float64 reference.

Every test needs a GPU (``pytest -m gpu``; skipped elsewhere by tests/conftest.py).  The ground
truth is ``linear_attention_reference`` run in float64 on the same (already rounded) inputs, its
gradients by autograd; with a recurrent state (S0, z0 in; S, z out) and the raw normalizer den
(outputs the reference does not have), an independent float64 formulation from cumulative sums
of outer products (``attnkit_testing.state_reference``).  Tolerance (DESIGN.md): float32 within
2e-5 of the largest reference magnitude (gradients 1e-4); float16 / bfloat16 within 2x the error the
reference itself makes when run in that dtype, + 1e-3; float64 within 1e-10.

Op contract (csrc/ops.cpp): linear_fwd(q, k, v, S0?, z0?, causal, feature_map, normalize, eps,
scale) -> (out, den, S, z); linear_bwd(grad_out?, grad_den?, grad_S?, grad_z?, q, k, v, out, den,
S, z, S0?, z0?, causal, feature_map, normalize, eps, scale) -> (dq, dk, dv, dS0, dz0).
"""
import pytest
import torch

from attnkit.reference.linear import feature_map_reference, linear_attention_reference
from attnkit_testing import linear_dq_term_scale, linear_dk_term_scale, native_cuda_ops, state_reference

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FEATURE_MAPS = ("elu", "relu", "identity")


@pytest.fixture(scope="module")
def ops():
    return native_cuda_ops()


# ----------------------------------------------------------------------------------------------
# tolerance rule and references
# ----------------------------------------------------------------------------------------------


def _max_err(x, ref, name):
    x, ref = x.detach().to(F64), ref.detach().to(F64)
    assert torch.isfinite(ref).all(), f"{name}: non-finite reference"
    assert torch.isfinite(x).all(), f"{name}: NaN or inf in the result"
    return (x - ref).abs().max().item() if x.numel() else 0.0


def assert_close(x, ref64, ref_low=None, *, dtype, grad=False, name="out", size=None):
    """``size``: the magnitude the float32 / float64 tolerance is relative to, when the result
    is a sum of larger terms that cancel (dq: attnkit_testing.linear_dq_term_scale); default
    the largest reference magnitude."""
    assert x.shape == ref64.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref64.shape)}"
    err = _max_err(x, ref64, name)
    ref_size = ref64.detach().abs().max().item() if ref64.numel() else 0.0
    size = ref_size if size is None else max(ref_size, size)
    if dtype == F64:
        tol = 1e-10 * size
    elif dtype == F32:
        tol = (1e-4 if grad else 2e-5) * size
    else:
        tol = 2.0 * _max_err(ref_low, ref64, f"{name} (reference in {dtype})") + 1e-3
    assert err <= tol, f"{name} ({dtype}): max error {err:.3e} > tolerance {tol:.3e}"


def acc_dtype(dtype):
    return F64 if dtype == F64 else F32


def make_inputs(b, h, n, m, d, dv, dtype, seed=0, positive=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, device="cuda")
    k = torch.randn(b, h, m, d, generator=g, device="cuda")
    v = torch.randn(b, h, m, dv, generator=g, device="cuda")
    go = torch.randn(b, h, n, dv, generator=g, device="cuda")
    if positive:  # identity + normalize: keep the normalizer away from 0 (conditioning)
        q, k = 0.5 * q + 1.0, 0.5 * k + 1.0
    return [t.to(dtype) for t in (q, k, v, go)]


def make_state(b, h, d, dv, dtype, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    acc = acc_dtype(dtype)
    s0 = torch.randn(b, h, d, dv, generator=g, device="cuda").to(acc)
    z0 = (torch.rand(b, h, d, generator=g, device="cuda") * 5.0 + 1.0).to(acc)
    gs = torch.randn(b, h, d, dv, generator=g, device="cuda").to(acc)
    gz = torch.randn(b, h, d, generator=g, device="cuda").to(acc)
    return s0, z0, gs, gz


def reference(q, k, v, go, kw, dtype=F64):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = linear_attention_reference(*leaves, **kw)
    out.backward(go.to(dtype))
    return (out.detach(), *(t.grad for t in leaves))


def kwargs(causal, feature_map, normalize, eps=1e-6, scale=1.0):
    return dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
                scale=scale)


def run(ops, q, k, v, go, kw, s0=None, z0=None, gden=None, gs=None, gz=None):
    args = (kw["causal"], kw["feature_map"], kw["normalize"], kw["eps"], kw["scale"])
    out, den, s, z = ops.linear_fwd(q, k, v, s0, z0, *args)
    grads = ops.linear_bwd(go, gden, gs, gz, q, k, v, out, den, s, z, s0, z0, *args)
    return (out, den, s, z), grads


def check(ops, q, k, v, go, kw):
    dtype = q.dtype
    (out, den, s, z), (dq, dk, dv, ds0, dz0) = run(ops, q, k, v, go, kw)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
    assert den.dtype == s.dtype == z.dtype == ds0.dtype == acc_dtype(dtype)
    ref = reference(q, k, v, go, kw)
    low = None if dtype in (F32, F64) else reference(q, k, v, go, kw, dtype=dtype)
    # dq and dk sum terms that cancel (exactly for a single key): their tolerances scale with
    # them (on an H100 the float32 single-key cases failed dk's max|ref|-relative tolerance).
    dq_terms = linear_dq_term_scale(q, k, v, go, **kw)
    dk_terms = linear_dk_term_scale(q, k, v, go, **kw)
    sizes = (None, dq_terms.max().item() if dq_terms.numel() else 0.0,
             dk_terms.max().item() if dk_terms.numel() else 0.0, None)
    for i, (x, name) in enumerate(zip((out, dq, dk, dv), ("out", "dq", "dk", "dv"))):
        assert_close(x, ref[i], None if low is None else low[i], dtype=dtype, grad=i > 0,
                     name=name, size=sizes[i])
    return out, den, s, z


# ----------------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------------

COMBOS = [(fm, c, nz) for fm in FEATURE_MAPS for c in (False, True) for nz in (True, False)]
SIZES = ((1, 16, 16), (7, 32, 48), (100, 64, 64), (513, 128, 96), (257, 80, 40))


@pytest.mark.parametrize("n, d, dv", SIZES)
@pytest.mark.parametrize("feature_map, causal, normalize", COMBOS)
@pytest.mark.parametrize("dtype", (F16, BF16, F32))
def test_matches_reference(ops, dtype, feature_map, causal, normalize, n, d, dv):
    m = n if causal else n + 37
    q, k, v, go = make_inputs(2, 3, n, m, d, dv, dtype, seed=n + d,
                              positive=feature_map == "identity" and normalize)
    check(ops, q, k, v, go, kwargs(causal, feature_map, normalize, scale=1.0 / m))


@pytest.mark.parametrize("causal", (False, True))
def test_long_sequence(ops, causal):
    q, k, v, go = make_inputs(1, 4, 2049, 2049, 64, 64, BF16, seed=3)
    check(ops, q, k, v, go, kwargs(causal, "elu", True))


@pytest.mark.parametrize("causal, normalize", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtype", (F32, F64))
def test_state_den_and_all_gradients(ops, dtype, causal, normalize):
    b, h, n, d, dv = 2, 2, 150, 48, 40
    m = n if causal else 90
    q, k, v, go = make_inputs(b, h, n, m, d, dv, dtype, seed=5)
    s0, z0, gs, gz = make_state(b, h, d, dv, dtype)
    gden = torch.randn(b, h, n, device="cuda", dtype=acc_dtype(dtype)) * 0.1
    kw = kwargs(causal, "elu", normalize, scale=0.3)
    fwd, grads = run(ops, q, k, v, go, kw, s0, z0, gden, gs, gz)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, s0, z0)]
    ref = state_reference(*leaves, **kw)
    torch.autograd.backward(ref, [go.to(F64), gden.to(F64), gs.to(F64), gz.to(F64)])
    for x, r, name in zip(fwd, ref, ("out", "den", "S", "z")):
        assert_close(x, r, dtype=dtype, name=name)
    for x, leaf, name in zip(grads, leaves, ("dq", "dk", "dv", "dS0", "dz0")):
        assert_close(x, leaf.grad, dtype=dtype, grad=True, name=name)


def test_prompt_in_two_parts_equals_one_call(ops):
    q, k, v, _ = make_inputs(1, 2, 300, 300, 64, 64, F32, seed=6)
    args = (True, "elu", True, 1e-6, 1.0)
    whole, _, s_whole, z_whole = ops.linear_fwd(q, k, v, None, None, *args)
    cut = 130
    first, _, s1, z1 = ops.linear_fwd(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], None, None,
                                      *args)
    second, _, s2, z2 = ops.linear_fwd(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], s1, z1, *args)
    torch.testing.assert_close(torch.cat([first, second], 2), whole, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(s2, s_whole, rtol=2e-5, atol=1e-4)
    torch.testing.assert_close(z2, z_whole, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", (F32, BF16))
def test_agrees_with_the_cpu_kernels(ops, dtype):
    q, k, v, go = make_inputs(1, 2, 130, 130, 32, 24, dtype, seed=7)
    s0, z0, gs, gz = make_state(1, 2, 32, 24, dtype)
    for causal in (True, False):
        kw = kwargs(causal, "relu", True)
        gpu = run(ops, q, k, v, go, kw, s0, z0, None, gs, gz)
        cpu = run(ops, *(t.cpu() for t in (q, k, v, go)), kw, s0.cpu(), z0.cpu(), None,
                  gs.cpu(), gz.cpu())
        for a, b_ in zip(gpu[0] + gpu[1], cpu[0] + cpu[1]):
            a, b_ = a.cpu().to(F64), b_.to(F64)
            tol = (1e-4 if dtype == F32 else 3e-2) * max(b_.abs().max().item(), 1e-30)
            assert (a - b_).abs().max().item() <= tol


def test_non_contiguous_inputs(ops):
    b, h, n, d = 2, 3, 77, 64
    q = torch.randn(b, n, h, d, device="cuda").transpose(1, 2)
    k = torch.randn(b, n, h, d, device="cuda").transpose(1, 2)
    v = torch.randn(b, n, h, 2 * d, device="cuda").transpose(1, 2)[..., ::2]
    go = torch.randn(1, 1, 1, d, device="cuda").expand(b, h, n, d)  # stride 0
    assert not any(t.is_contiguous() for t in (q, k, v, go))
    for causal in (True, False):
        check(ops, q, k, v, go, kwargs(causal, "elu", True))


@pytest.mark.parametrize("causal, n, m", [(False, 0, 5), (False, 5, 0), (True, 0, 0)])
def test_empty_sequences(ops, causal, n, m):
    q, k, v, go = make_inputs(2, 2, n, m, 16, 24, F32)
    for eps in (1e-6, 0.0):
        (out, den, s, z), grads = run(ops, q, k, v, go, kwargs(causal, "elu", True, eps=eps))
        assert out.shape == (2, 2, n, 24) and s.shape == (2, 2, 16, 24)
        assert torch.equal(out, torch.zeros_like(out))
        for t in (den, s, z, *grads):
            assert torch.isfinite(t).all()
        pk = feature_map_reference(k.to(F64), "elu")
        torch.testing.assert_close(s.to(F64), pk.transpose(-2, -1) @ v.to(F64), rtol=1e-5,
                                   atol=1e-5)


def test_deterministic(ops):
    q, k, v, go = make_inputs(2, 4, 500, 500, 64, 64, BF16, seed=8)
    kw = kwargs(True, "elu", True)
    first = run(ops, q, k, v, go, kw)
    again = run(ops, q, k, v, go, kw)
    for x, y in zip(first[0] + first[1], again[0] + again[1]):
        assert torch.equal(x, y)


def test_runs_on_the_current_stream(ops):
    q, k, v, _ = make_inputs(2, 4, 400, 400, 64, 64, F16, seed=9)
    args = (True, "elu", True, 1e-6, 1.0)
    expected = ops.linear_fwd(q, k, v, None, None, *args)[0]
    q2 = torch.zeros_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        q2.copy_(q)
        out = ops.linear_fwd(q2, k, v, None, None, *args)[0]
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


def test_float16_state_beyond_float16_range(ops):
    # The state sums to ~1e5 (> 65504) while out stays ~300: states are kept in float32.
    g = torch.Generator(device="cuda").manual_seed(10)
    q = torch.randn(1, 1, 500, 16, generator=g, device="cuda").half()
    k = (torch.randn(1, 1, 500, 16, generator=g, device="cuda") * 0.1 + 5.0).half()
    v = (torch.randn(1, 1, 500, 16, generator=g, device="cuda") + 300.0).half()
    for causal in (False, True):
        out, _, s, _ = ops.linear_fwd(q, k, v, None, None, causal, "elu", True, 1e-6, 1.0)
        assert s.abs().max() > 65504
        ref = linear_attention_reference(q.double(), k.double(), v.double(), causal=causal)
        assert (out.double() - ref).abs().max() <= 2e-3 * ref.abs().max()


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def test_errors(ops):
    q, k, v, _ = make_inputs(1, 2, 4, 5, 16, 16, F32)
    args = ("elu", True, 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="causal needs N == M"):
        ops.linear_fwd(q, k, v, None, None, True, *args)
    with pytest.raises(RuntimeError, match="unknown feature_map 'softplus'"):
        ops.linear_fwd(q, k, v, None, None, False, "softplus", True, 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="sizes do not fit"):
        ops.linear_fwd(q, k[..., :8], v, None, None, False, *args)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.linear_fwd(q, k, v.half(), None, None, False, *args)
    with pytest.raises(RuntimeError, match="float16, bfloat16, float32 or float64"):
        ops.linear_fwd(*(t.int() for t in (q, k, v)), None, None, False, *args)
    s0 = torch.zeros(1, 2, 16, 16, device="cuda")
    z0 = torch.zeros(1, 2, 16, device="cuda")
    with pytest.raises(RuntimeError, match="S0 must be Float"):
        ops.linear_fwd(q, k, v, s0.double(), z0, False, *args)
    with pytest.raises(RuntimeError, match="S0 and z0 go together"):
        ops.linear_fwd(q, k, v, s0, None, False, *args)
    with pytest.raises(RuntimeError, match=r"z0 must have shape \[1, 2, 16\]"):
        ops.linear_fwd(q, k, v, s0, z0[..., :3], False, *args)

"""The linear-attention reference against an independent float64 loop over queries."""
import math

import pytest
import torch

from attnkit.reference.linear import FEATURE_MAPS, feature_map_reference, linear_attention_reference

F64 = torch.float64


def phi_loop(x: torch.Tensor, name: str) -> torch.Tensor:
    """The feature maps written out from their definitions (not via torch.nn.functional)."""
    if name == "elu":  # elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise
        return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    assert name == "identity"
    return x


def linear_loop(q, k, v, *, causal, feature_map, normalize, eps, scale):
    """out_i = Σ_{j∈S_i} w_ij v_j (/ (Σ w_ij + eps) or * scale), one query i at a time, in float64."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    pq, pk = phi_loop(q, feature_map), phi_loop(k, feature_map)
    b, h, n, _ = q.shape
    m, dv = k.shape[2], v.shape[3]
    out = torch.zeros(b, h, n, dv, dtype=F64)
    for i in range(n):
        stop = i + 1 if causal else m
        w = (pq[:, :, i, None, :] * pk[:, :, :stop, :]).sum(-1)  # [B, H, |S_i|]
        num = (w[..., None] * v[:, :, :stop, :]).sum(-2)  # [B, H, Dv]
        if normalize:
            out[:, :, i] = num / (w.sum(-1, keepdim=True) + eps)
        else:
            out[:, :, i] = num * scale
    return out


def make(b, h, n, m, d, dv, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=F64).to(dtype)
    k = torch.randn(b, h, m, d, generator=g, dtype=F64).to(dtype)
    v = torch.randn(b, h, m, dv, generator=g, dtype=F64).to(dtype)
    return q, k, v


# ---------------------------------------------------------------------------- feature maps

@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_feature_map_matches_definition(name):
    x = torch.linspace(-6.0, 6.0, 241, dtype=F64)
    torch.testing.assert_close(feature_map_reference(x, name), phi_loop(x, name), rtol=1e-14, atol=1e-14)


def test_feature_map_known_values():
    x = torch.tensor([-1.0, 0.0, 2.0], dtype=F64)
    torch.testing.assert_close(feature_map_reference(x, "elu"),
                               torch.tensor([math.exp(-1.0), 1.0, 3.0], dtype=F64))
    torch.testing.assert_close(feature_map_reference(x, "relu"), torch.tensor([0.0, 0.0, 2.0], dtype=F64))
    torch.testing.assert_close(feature_map_reference(x, "identity"), x)
    # elu + 1 is strictly positive even far into the negative range (what makes normalize safe)
    assert (feature_map_reference(torch.tensor([-30.0], dtype=F64), "elu") > 0).all()


def test_feature_map_unknown_name():
    with pytest.raises(ValueError, match="unknown feature_map 'softmax'"):
        feature_map_reference(torch.zeros(3), "softmax")


# ---------------------------------------------------------------------------- vs the loop

@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("n", [1, 7, 100])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_reference_matches_loop(feature_map, causal, normalize, n, d):
    m = n if causal else n + 5  # non-causal: key length differs from the query length
    dv = 11  # value head dim differs from D
    q, k, v = make(2, 3, n, m, d, dv, seed=n * 100 + d)
    kwargs = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-6, scale=0.37)
    out = linear_attention_reference(q, k, v, **kwargs)
    expected = linear_loop(q, k, v, **kwargs)
    assert out.shape == (2, 3, n, dv) and out.dtype == F64
    # identity + normalize divides by sums of signed weights, which can be small: the float64
    # rounding of either side is amplified by Σ|w| / |Σ w|, hence rtol 1e-9 rather than 1e-14.
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_value_dim_equal_and_larger(causal):
    for dv in (16, 40):
        q, k, v = make(1, 2, 9, 9, 16, dv, seed=dv)
        kwargs = dict(causal=causal, feature_map="elu", normalize=True, eps=1e-6, scale=1.0)
        torch.testing.assert_close(linear_attention_reference(q, k, v, **kwargs),
                                   linear_loop(q, k, v, **kwargs), rtol=1e-12, atol=1e-12)


def test_eps_enters_the_normalizer():
    q, k, v = make(1, 1, 5, 5, 4, 3, seed=3)
    for eps in (0.0, 1e-3, 10.0):
        kwargs = dict(causal=True, feature_map="elu", normalize=True, eps=eps, scale=1.0)
        torch.testing.assert_close(linear_attention_reference(q, k, v, **kwargs),
                                   linear_loop(q, k, v, **kwargs), rtol=1e-12, atol=1e-12)


def test_causal_first_query_sees_only_first_key():
    q, k, v = make(1, 1, 6, 6, 8, 5, seed=4)
    out = linear_attention_reference(q, k, v, causal=True, feature_map="elu", normalize=True,
                                     eps=0.0, scale=1.0)
    # one visible key, positive weight: the normalized output is exactly that key's value
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], rtol=1e-14, atol=1e-14)


def test_scale_only_without_normalize():
    q, k, v = make(1, 2, 7, 7, 8, 8, seed=5)
    base = dict(causal=False, feature_map="relu", eps=1e-6)
    a = linear_attention_reference(q, k, v, normalize=True, scale=1.0, **base)
    b = linear_attention_reference(q, k, v, normalize=True, scale=123.0, **base)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = linear_attention_reference(q, k, v, normalize=False, scale=1.0, **base)
    d = linear_attention_reference(q, k, v, normalize=False, scale=-0.5, **base)
    torch.testing.assert_close(d, -0.5 * c, rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------------------- dtypes, empty

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_computes_in_given_dtype(dtype):
    q, k, v = make(1, 2, 33, 33, 16, 8, dtype=dtype, seed=6)
    for causal in (False, True):
        out = linear_attention_reference(q, k, v, causal=causal, feature_map="elu", normalize=True,
                                         eps=1e-6, scale=1.0)
        assert out.dtype == dtype
        expected = linear_loop(q, k, v, causal=causal, feature_map="elu", normalize=True,
                               eps=1e-6, scale=1.0)
        # a low-precision run is close to, but (for 16-bit types) not identical with, float64
        err = (out.to(F64) - expected).abs().max().item()
        assert err < {torch.float32: 1e-5, torch.bfloat16: 0.1, torch.float16: 0.02}[dtype]


@pytest.mark.parametrize("causal", [False, True])
def test_empty_query_length(causal):
    q, k, v = make(2, 3, 0, 0 if causal else 4, 8, 5)
    out = linear_attention_reference(q, k, v, causal=causal, feature_map="elu", normalize=True,
                                     eps=1e-6, scale=1.0)
    assert out.shape == (2, 3, 0, 5)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("normalize", [True, False])
def test_no_keys_gives_zeros(normalize, eps):
    q, k, v = make(2, 3, 7, 0, 8, 5)
    out = linear_attention_reference(q, k, v, causal=False, feature_map="elu", normalize=normalize,
                                     eps=eps, scale=2.0)
    assert out.shape == (2, 3, 7, 5)
    assert torch.equal(out, torch.zeros_like(out))  # also: no NaN from 0 / (0 + 0)


# ---------------------------------------------------------------------------- recurrent state

from attnkit.reference.linear import linear_attention_step_reference, state_dtype  # noqa: E402


def state_loop(q, k, v, s0, z0, *, causal, feature_map, normalize, eps, scale):
    """out_i with every query also seeing the earlier keys summed in (S0, z0), one query at a
    time; and the final state Σ_j φ(k_j) v_jᵀ + S0, Σ_j φ(k_j) + z0 by explicit loops."""
    q, k, v, s0, z0 = (t.to(F64) for t in (q, k, v, s0, z0))
    pq, pk = phi_loop(q, feature_map), phi_loop(k, feature_map)
    b, h, n, d = q.shape
    m, dv = k.shape[2], v.shape[3]
    out = torch.zeros(b, h, n, dv, dtype=F64)
    for i in range(n):
        stop = i + 1 if causal else m
        w = (pq[:, :, i, None, :] * pk[:, :, :stop, :]).sum(-1)
        num = (w[..., None] * v[:, :, :stop, :]).sum(-2) + (pq[:, :, i, :, None] * s0).sum(-2)
        den = w.sum(-1, keepdim=True) + (pq[:, :, i] * z0).sum(-1, keepdim=True)
        out[:, :, i] = num / (den + eps) if normalize else num * scale
    s, z = s0.clone(), z0.clone()
    for j in range(m):
        s += pk[:, :, j, :, None] * v[:, :, j, None, :]
        z += pk[:, :, j]
    return out, s, z


def make_state(b, h, d, dv, seed=20):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, d, dv, generator=g, dtype=F64),
            torch.rand(b, h, d, generator=g, dtype=F64) + 0.5)


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_initial_state_and_returned_state_match_loops(feature_map, normalize, n):
    q, k, v = make(2, 3, n, n, 8, 5, seed=21 + n)
    if feature_map == "identity" and normalize:
        q, k = q.abs(), k.abs()
    s0, z0 = make_state(2, 3, 8, 5)
    kw = dict(causal=True, feature_map=feature_map, normalize=normalize, eps=1e-6, scale=0.3)
    out, (s, z) = linear_attention_reference(q, k, v, initial_state=(s0, z0), return_state=True, **kw)
    want, ws, wz = state_loop(q, k, v, s0, z0, **kw)
    torch.testing.assert_close(out, want, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(s, ws, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, wz, rtol=1e-12, atol=1e-12)


def test_returned_state_without_initial_state():
    q, k, v = make(1, 2, 9, 9, 4, 3, seed=22)
    zeros = (torch.zeros(1, 2, 4, 3, dtype=F64), torch.zeros(1, 2, 4, dtype=F64))
    kw = dict(causal=True, feature_map="elu", normalize=True, eps=1e-6, scale=1.0)
    out, (s, z) = linear_attention_reference(q, k, v, return_state=True, **kw)
    want, ws, wz = state_loop(q, k, v, *zeros, **kw)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, ws, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, wz, rtol=1e-12, atol=1e-12)
    # without return_state the same call returns the tensor alone
    assert torch.equal(linear_attention_reference(q, k, v, **kw), out)


@pytest.mark.parametrize("dtype,expected", [(F64, F64), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float32)])
def test_state_dtype(dtype, expected):
    assert state_dtype(dtype) == expected
    q, k, v = make(1, 1, 5, 5, 4, 3, dtype=dtype)
    out, (s, z) = linear_attention_reference(q, k, v, causal=True, feature_map="elu",
                                             normalize=True, eps=1e-6, scale=1.0, return_state=True)
    assert out.dtype == dtype and s.dtype == z.dtype == expected


def test_no_keys_with_a_state_divides_by_the_state_normalizer():
    # M = 0 but a carried-in state: the sums are not empty, out_i = φ(q_i)S0 / (φ(q_i)·z0 + eps)
    q, k, v = make(1, 2, 4, 0, 6, 3)
    s0, z0 = make_state(1, 2, 6, 3)
    out = linear_attention_reference(q, k, v, causal=False, feature_map="elu", normalize=True,
                                     eps=1e-6, scale=1.0, initial_state=(s0, z0))
    pq = phi_loop(q, "elu")
    want = (pq @ s0) / ((pq * z0.unsqueeze(2)).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_step_reference_is_the_recurrence(feature_map, normalize):
    b, h, d, dv = 2, 3, 6, 4
    g = torch.Generator().manual_seed(23)
    state = None
    s_loop, z_loop = torch.zeros(b, h, d, dv, dtype=F64), torch.zeros(b, h, d, dtype=F64)
    for _ in range(5):
        q_t, k_t = torch.randn(b, h, d, generator=g, dtype=F64), torch.randn(b, h, d, generator=g, dtype=F64)
        if feature_map == "identity" and normalize:
            q_t, k_t = q_t.abs(), k_t.abs()
        v_t = torch.randn(b, h, dv, generator=g, dtype=F64)
        out, state = linear_attention_step_reference(q_t, k_t, v_t, state, feature_map=feature_map,
                                                     normalize=normalize, eps=1e-6, scale=0.5)
        pq, pk = phi_loop(q_t, feature_map), phi_loop(k_t, feature_map)
        for bi in range(b):
            for hi in range(h):
                s_loop[bi, hi] += torch.outer(pk[bi, hi], v_t[bi, hi])
                z_loop[bi, hi] += pk[bi, hi]
                num = pq[bi, hi] @ s_loop[bi, hi]
                want = num / (pq[bi, hi] @ z_loop[bi, hi] + 1e-6) if normalize else 0.5 * num
                torch.testing.assert_close(out[bi, hi], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[0], s_loop, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[1], z_loop, rtol=1e-12, atol=1e-12)


def test_parallel_prompt_then_steps_equals_one_call():
    n, n0 = 12, 5
    q, k, v = make(1, 2, n, n, 4, 3, seed=24)
    kw = dict(feature_map="elu", normalize=True, eps=1e-6, scale=1.0)
    full = linear_attention_reference(q, k, v, causal=True, **kw)
    head, state = linear_attention_reference(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], causal=True,
                                             return_state=True, **kw)
    torch.testing.assert_close(head, full[:, :, :n0], rtol=1e-12, atol=1e-12)
    for t in range(n0, n):
        out_t, state = linear_attention_step_reference(q[:, :, t], k[:, :, t], v[:, :, t], state, **kw)
        torch.testing.assert_close(out_t, full[:, :, t], rtol=1e-12, atol=1e-12)


def test_state_is_differentiable():
    q, k, v = make(1, 1, 4, 4, 3, 2, seed=25)
    s0, z0 = make_state(1, 1, 3, 2)
    leaves = [t.requires_grad_(True) for t in (q, k, v, s0, z0)]

    def fn(q, k, v, s0, z0):
        out, (s, z) = linear_attention_reference(q, k, v, causal=True, feature_map="elu",
                                                 normalize=True, eps=1e-3, scale=1.0,
                                                 initial_state=(s0, z0), return_state=True)
        return out, s, z

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("n", [3, 40, 1000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_elu_feature_map_derivative_at_nan_is_one_whatever_the_size(n, dtype):
    # torch's elu backward gives 1 at a NaN in its scalar loop and NaN in its vectorized one
    # (AVX2: n = 40 gave NaN, n = 3 gave 1), so the reference fixes the kernels' convention itself.
    from attnkit.reference.linear import feature_map_reference

    x = torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(0))
    x[::7] = float("nan")
    x.requires_grad_()
    feature_map_reference(x, "elu").backward(torch.full((n,), 2.0, dtype=dtype))
    nan = torch.isnan(x.detach())
    assert torch.equal(x.grad[nan], torch.full_like(x.grad[nan], 2.0))
    want = 2.0 * torch.where(x.detach() > 0, torch.ones_like(x.detach()), torch.exp(x.detach()))
    torch.testing.assert_close(x.grad[~nan], want[~nan], rtol=0, atol=0)

"""attnkit.linear_attention: the public function (validation, dispatch, numerics, autograd, compile)."""
import pytest
import torch

import attnkit
from attnkit import BackendUnavailableError
from attnkit.reference.linear import linear_attention_reference

F64 = torch.float64
FEATURE_MAPS = ("elu", "relu", "identity")


def phi_loop(x, name):
    """The feature maps from their definitions (independent of the library's)."""
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    return x


def linear_loop(q, k, v, *, causal=False, feature_map="elu", normalize=True, eps=1e-6, scale=1.0):
    """Independent float64 ground truth: one query i at a time."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    pq, pk = phi_loop(q, feature_map), phi_loop(k, feature_map)
    b, h, n, _ = q.shape
    m, dv = k.shape[2], v.shape[3]
    out = torch.zeros(b, h, n, dv, dtype=F64)
    for i in range(n):
        stop = i + 1 if causal else m
        w = (pq[:, :, i, None, :] * pk[:, :, :stop, :]).sum(-1)
        num = (w[..., None] * v[:, :, :stop, :]).sum(-2)
        out[:, :, i] = num / (w.sum(-1, keepdim=True) + eps) if normalize else num * scale
    return out


def make(b, h, n, m, d, dv, dtype=F64, seed=0, positive_qk=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=F64)
    k = torch.randn(b, h, m, d, generator=g, dtype=F64)
    v = torch.randn(b, h, m, dv, generator=g, dtype=F64)
    if positive_qk:
        # identity + normalize divides by Σ_j q_i·k_j, which for signed inputs can come
        # arbitrarily close to 0 (an ill-conditioned problem, not an implementation error);
        # positive q, k keep every weight positive so that precision tests measure the kernel.
        q, k = q.abs(), k.abs()
    return q.to(dtype), k.to(dtype), v.to(dtype)


def rel_err(out, expected):
    """max |out - expected| relative to max |expected| (outputs can cross zero elementwise)."""
    return ((out.to(F64) - expected).abs().max() / expected.abs().max()).item()


def combos():
    for fm in FEATURE_MAPS:
        for causal in (False, True):
            for normalize in (True, False):
                yield fm, causal, normalize


# ---------------------------------------------------------------------------- semantics

@pytest.mark.parametrize("feature_map,causal,normalize", list(combos()))
def test_matches_loop_float64(feature_map, causal, normalize):
    n = 63
    m = n if causal else 129
    q, k, v = make(2, 3, n, m, 16, 7, seed=1)
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-5, scale=0.25)
    out = attnkit.linear_attention(q, k, v, **kw)
    assert out.shape == (2, 3, n, 7) and out.dtype == F64
    torch.testing.assert_close(out, linear_loop(q, k, v, **kw), rtol=1e-9, atol=1e-12)


def test_defaults():
    q, k, v = make(1, 2, 7, 9, 8, 8, seed=2)
    expected = linear_loop(q, k, v, causal=False, feature_map="elu", normalize=True, eps=1e-6)
    torch.testing.assert_close(attnkit.linear_attention(q, k, v), expected, rtol=1e-12, atol=1e-12)


def test_scale_multiplies_only_without_normalize():
    q, k, v = make(1, 2, 7, 7, 8, 5, seed=3)
    unnorm = linear_loop(q, k, v, normalize=False, scale=1.0)
    out = attnkit.linear_attention(q, k, v, normalize=False, scale=-3.0)
    torch.testing.assert_close(out, -3.0 * unnorm, rtol=1e-12, atol=1e-12)
    a = attnkit.linear_attention(q, k, v, normalize=True, scale=1.0)
    b = attnkit.linear_attention(q, k, v, normalize=True, scale=-3.0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_in_context_learning_special_case(causal):
    # Linear self-attention of ICL theory (e.g. von Oswald et al. 2023):
    # out_i = (1/N) Σ_j (q_i·k_j) v_j, written here as the masked matrix product ((Q Kᵀ) ∘ mask) V / N.
    n = 17
    q, k, v = make(2, 2, n, n, 6, 4, seed=4)
    out = attnkit.linear_attention(q, k, v, causal=causal, feature_map="identity",
                                   normalize=False, scale=1.0 / n)
    scores = torch.einsum("bhid,bhjd->bhij", q, k)
    if causal:
        scores = scores * torch.ones(n, n, dtype=F64).tril()
    expected = torch.einsum("bhij,bhje->bhie", scores, v) / n
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(5)
    # [B, N, H, D] storage seen as [B, H, N, D]; value also sliced along its last dim
    q = torch.randn(2, 11, 3, 8, generator=g, dtype=F64).transpose(1, 2)
    k = torch.randn(2, 11, 3, 8, generator=g, dtype=F64).transpose(1, 2)
    v = torch.randn(2, 11, 3, 10, generator=g, dtype=F64).transpose(1, 2)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for causal in (False, True):
        for normalize in (True, False):
            kw = dict(causal=causal, normalize=normalize, feature_map="elu")
            out = attnkit.linear_attention(q, k, v, **kw)
            torch.testing.assert_close(out, linear_loop(q, k, v, **kw), rtol=1e-12, atol=1e-12)
            ref = attnkit.linear_attention(q.contiguous(), k.contiguous(), v.contiguous(), **kw)
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_explicit_reference_backend_and_env(monkeypatch):
    q, k, v = make(1, 1, 5, 5, 4, 4, seed=6)
    expected = linear_loop(q, k, v, causal=True)
    torch.testing.assert_close(attnkit.linear_attention(q, k, v, causal=True, backend="reference"),
                               expected, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    torch.testing.assert_close(attnkit.linear_attention(q, k, v, causal=True), expected,
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- empty inputs

@pytest.mark.parametrize("causal", [False, True])
def test_empty_query_length(causal):
    q, k, v = make(2, 3, 0, 0 if causal else 5, 8, 6)
    out = attnkit.linear_attention(q, k, v, causal=causal)
    assert out.shape == (2, 3, 0, 6)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("normalize", [True, False])
def test_no_keys_gives_zeros_and_zero_grads(normalize, eps):
    q, k, v = make(2, 3, 7, 0, 8, 6)
    q.requires_grad_(True)
    out = attnkit.linear_attention(q, k, v, normalize=normalize, eps=eps, scale=5.0)
    assert out.shape == (2, 3, 7, 6)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


# ---------------------------------------------------------------------------- autograd, compile

@pytest.mark.parametrize("feature_map,causal,normalize", list(combos()))
def test_gradcheck(feature_map, causal, normalize):
    q, k, v = make(1, 2, 5, 5 if causal else 6, 3, 4, seed=7,
                   positive_qk=(feature_map == "identity" and normalize))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fn(q, k, v):
        return attnkit.linear_attention(q, k, v, causal=causal, feature_map=feature_map,
                                        normalize=normalize, eps=1e-3, scale=0.7)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_torch_compile_fullgraph():
    q, k, v = make(1, 2, 9, 9, 8, 5, dtype=torch.float32, seed=8)
    compiled = torch.compile(attnkit.linear_attention, fullgraph=True)
    # The second and third calls pass other floats: Dynamo then traces eps / scale as symbolic
    # floats, which the input checks must also get through without a graph break.
    for kw in (dict(causal=True, feature_map="elu", normalize=True),
               dict(causal=False, feature_map="identity", normalize=False, scale=0.125),
               dict(causal=True, feature_map="relu", normalize=True, eps=1e-3, scale=2.0)):
        expected = attnkit.linear_attention(q, k, v, **kw)
        torch.testing.assert_close(compiled(q, k, v, **kw), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- precision

@pytest.mark.parametrize("feature_map,causal", [(fm, c) for fm in FEATURE_MAPS for c in (False, True)])
def test_float32_vs_float64(feature_map, causal):
    n = 129
    q, k, v = make(2, 2, n, n, 32, 24, seed=9, positive_qk=(feature_map == "identity"))
    q32, k32, v32 = (t.float().requires_grad_(True) for t in (q, k, v))
    q64, k64, v64 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kw = dict(causal=causal, feature_map=feature_map, normalize=True)
    out32 = attnkit.linear_attention(q32, k32, v32, **kw)
    out64 = attnkit.linear_attention(q64, k64, v64, **kw)
    assert out32.dtype == torch.float32
    assert rel_err(out32, linear_loop(q, k, v, **kw)) <= 2e-5
    grad_out = torch.randn(out64.shape, generator=torch.Generator().manual_seed(10), dtype=F64)
    g32 = torch.autograd.grad(out32, (q32, k32, v32), grad_out.float())
    g64 = torch.autograd.grad(out64, (q64, k64, v64), grad_out)
    for a, b in zip(g32, g64):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("feature_map,causal,normalize",
                         [("elu", False, True), ("elu", True, True), ("relu", True, True),
                          ("identity", False, False), ("identity", True, False)])
def test_half_precision_vs_float64(dtype, feature_map, causal, normalize):
    # Tolerance rule: within 2x the error the reference itself makes in that dtype, plus 1e-3.
    n = 129
    q, k, v = make(2, 2, n, n, 32, 16, seed=11)
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, scale=1.0 / n)
    truth = linear_loop(q, k, v, **kw)
    lo = [t.to(dtype) for t in (q, k, v)]
    out = attnkit.linear_attention(*lo, **kw)
    assert out.dtype == dtype
    ref_err = (linear_attention_reference(*lo, eps=1e-6, **kw).to(F64) - truth).abs().max().item()
    err = (out.to(F64) - truth).abs().max().item()
    assert err <= 2 * ref_err + 1e-3


# ---------------------------------------------------------------------------- validation

def _qkv(n=4, m=4, d=8, dv=6):
    return make(2, 3, n, m, d, dv, dtype=torch.float32)


@pytest.mark.parametrize("which,shape", [("query", (3, 4, 8)), ("key", (2, 3, 4, 8, 1)),
                                         ("value", (3, 4, 6))])
def test_rank_must_be_4(which, shape):
    args = dict(zip(("query", "key", "value"), _qkv()))
    args[which] = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"linear_attention: {which} must be a 4-D tensor"):
        attnkit.linear_attention(**args)


def test_not_a_tensor():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        attnkit.linear_attention(q, k.tolist(), v)


def test_batch_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="must have the same batch size B; got query 2, key 1, value 2"):
        attnkit.linear_attention(q, k[:1], v)


def test_heads_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="same number of heads H; got query 3, key 3, value 2"):
        attnkit.linear_attention(q, k, v[:, :2])


def test_head_dim_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="query and key must have the same head dim D; got query 8, key 7"):
        attnkit.linear_attention(q, k[..., :7], v)


def test_key_value_length_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="key and value must have the same sequence length M; got key 4, value 3"):
        attnkit.linear_attention(q, k, v[:, :, :3])


def test_causal_needs_equal_lengths():
    q, k, v = _qkv(n=4, m=6)
    attnkit.linear_attention(q, k, v, causal=False)  # fine without causal
    with pytest.raises(ValueError, match=r"causal=True needs the key length M to equal the query length N.*N=4, M=6"):
        attnkit.linear_attention(q, k, v, causal=True)


def test_dtype_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"value must have the dtype of query \(float32\); got float64"):
        attnkit.linear_attention(q, k, v.double())


def test_device_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="key must be on the device of query"):
        attnkit.linear_attention(q, k.to("meta"), v)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_floating_dtype(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="query must be floating point"):
        attnkit.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype))


@pytest.mark.parametrize("fm", ["softmax", "ELU", None])
def test_unknown_feature_map(fm):
    with pytest.raises(ValueError, match="unknown feature_map"):
        attnkit.linear_attention(*_qkv(), feature_map=fm)


def test_eps_negative():
    with pytest.raises(ValueError, match=r"eps must be >= 0.0; got -1e-06"):
        attnkit.linear_attention(*_qkv(), eps=-1e-6)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), "1e-6", None])
def test_eps_non_finite_or_not_a_number(eps):
    with pytest.raises(TypeError, match="eps must be a finite real number"):
        attnkit.linear_attention(*_qkv(), eps=eps)


@pytest.mark.parametrize("scale", [float("nan"), float("-inf"), None])
def test_scale_non_finite(scale):
    with pytest.raises(TypeError, match="scale must be a finite real number"):
        attnkit.linear_attention(*_qkv(), normalize=False, scale=scale)


@pytest.mark.parametrize("name", ["causal", "normalize"])
def test_flags_must_be_bool(name):
    with pytest.raises(TypeError, match=rf"{name} must be a bool; got 'yes'"):
        attnkit.linear_attention(*_qkv(), **{name: "yes"})


def test_unknown_backend(monkeypatch):
    with pytest.raises(ValueError, match="linear_attention: unknown backend 'fast'"):
        attnkit.linear_attention(*_qkv(), backend="fast")
    monkeypatch.setenv("ATTNKIT_BACKEND", "fast")
    with pytest.raises(ValueError, match="unknown ATTNKIT_BACKEND 'fast'"):
        attnkit.linear_attention(*_qkv())


def test_backend_without_linear_kernels():
    with pytest.raises(BackendUnavailableError, match="the cpu backend has no linear kernels yet"):
        attnkit.linear_attention(*_qkv(), backend="cpu")


def test_validation_precedes_computation():
    # meta tensors carry no data: a shape error must come from validation, not from a matmul
    q = torch.empty(2, 3, 4, 8, device="meta")
    k = torch.empty(2, 3, 4, 7, device="meta")
    with pytest.raises(ValueError, match="same head dim D"):
        attnkit.linear_attention(q, k, torch.empty(2, 3, 4, 6, device="meta"))

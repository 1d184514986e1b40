"""attnkit.linear_attention: the public function (validation, dispatch, numerics, autograd, compile)."""
import pytest
import torch

import attnkit
from attnkit import BackendUnavailableError
from attnkit._dispatch import resolve
from attnkit.reference.linear import linear_attention_reference

# Every usable backend of this machine that takes CPU tensors (the reference always; cpu when
# attnkit._C is built).  Tests parametrized on it run each one against the same ground truth.
BACKENDS = [b for b in ("reference", "cpu") if attnkit.backends()["linear"][b].usable]

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

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature_map,causal,normalize", list(combos()))
def test_matches_loop_float64(feature_map, causal, normalize, backend):
    n = 63
    m = n if causal else 129
    q, k, v = make(2, 3, n, m, 16, 7, seed=1)
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-5, scale=0.25)
    out = attnkit.linear_attention(q, k, v, backend=backend, **kw)
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
    backend = BACKENDS[-1]  # the kernel where there is one (the reference's own: its test file)
    q, k, v = make(1, 2, 5, 5 if causal else 6, 3, 4, seed=7,
                   positive_qk=(feature_map == "identity" and normalize))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fn(q, k, v):
        return attnkit.linear_attention(q, k, v, causal=causal, feature_map=feature_map,
                                        normalize=normalize, eps=1e-3, scale=0.7, backend=backend)

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


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_backend_that_cannot_run_here_raises(backend):
    status = attnkit.backends()["linear"][backend]
    if status.usable:
        pytest.skip(f"{backend} is usable here")
    with pytest.raises(BackendUnavailableError, match=rf"linear_attention: .*{backend}"):
        attnkit.linear_attention(*_qkv(), backend=backend)
    with pytest.raises(BackendUnavailableError, match=rf"linear_attention_step: .*{backend}"):
        attnkit.linear_attention_step(*(t[:, :, 0] for t in _qkv()), backend=backend)


def test_cpu_is_the_default_for_cpu_tensors():
    if not attnkit.backends()["linear"]["cpu"].usable:
        pytest.skip("attnkit._C is not built")
    assert resolve("linear", None, torch.device("cpu"), "t") == "cpu"


def test_validation_precedes_computation():
    # meta tensors carry no data: a shape error must come from validation, not from a matmul
    q = torch.empty(2, 3, 4, 8, device="meta")
    k = torch.empty(2, 3, 4, 7, device="meta")
    with pytest.raises(ValueError, match="same head dim D"):
        attnkit.linear_attention(q, k, torch.empty(2, 3, 4, 6, device="meta"))


# ---------------------------------------------------------------------------- recurrent state

def state_loop(q, k, v, s0, z0, *, feature_map="elu", normalize=True, eps=1e-6, scale=1.0):
    """Causal outputs with a carried-in state, and the final state, by explicit loops (float64)."""
    q, k, v, s0, z0 = (t.to(F64) for t in (q, k, v, s0, z0))
    pq, pk = phi_loop(q, feature_map), phi_loop(k, feature_map)
    s, z = s0.clone(), z0.clone()
    outs = []
    for i in range(q.shape[2]):
        s = s + pk[:, :, i, :, None] * v[:, :, i, None, :]
        z = z + pk[:, :, i]
        num = (pq[:, :, i, :, None] * s).sum(-2)
        den = (pq[:, :, i] * z).sum(-1, keepdim=True)
        outs.append(num / (den + eps) if normalize else num * scale)
    return torch.stack(outs, dim=2), s, z


def make_state(b, h, d, dv, dtype=F64, seed=30):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, d, dv, generator=g, dtype=F64).to(dtype),
            (torch.rand(b, h, d, generator=g, dtype=F64) + 0.5).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature_map,normalize", [("elu", True), ("relu", True), ("identity", False)])
def test_initial_and_returned_state(feature_map, normalize, backend):
    q, k, v = make(2, 2, 75, 75, 8, 5, seed=31)
    s0, z0 = make_state(2, 2, 8, 5)
    kw = dict(feature_map=feature_map, normalize=normalize, eps=1e-6, scale=0.1)
    out, (s, z) = attnkit.linear_attention(q, k, v, causal=True, initial_state=(s0, z0),
                                           return_state=True, backend=backend, **kw)
    want, ws, wz = state_loop(q, k, v, s0, z0, **kw)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, ws, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, wz, rtol=1e-12, atol=1e-12)
    # a list works as the pair too
    out2 = attnkit.linear_attention(q, k, v, causal=True, initial_state=[s0, z0], backend=backend, **kw)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_matches_loop_and_returns_documented_shapes(backend):
    b, h, d, dv, n = 2, 3, 6, 4, 10
    q, k, v = make(b, h, n, n, d, dv, seed=32)
    want, ws, wz = state_loop(q, k, v, torch.zeros(b, h, d, dv, dtype=F64), torch.zeros(b, h, d, dtype=F64))
    state = None
    for t in range(n):
        out_t, state = attnkit.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state,
                                                     backend=backend)
        assert out_t.shape == (b, h, dv) and out_t.dtype == F64
        torch.testing.assert_close(out_t, want[:, :, t], rtol=1e-11, atol=1e-12)
    assert state[0].shape == (b, h, d, dv) and state[1].shape == (b, h, d)
    torch.testing.assert_close(state[0], ws, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state[1], wz, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_then_steps_equals_one_call_float32(backend):
    n, n0 = 90, 67
    q, k, v = make(1, 2, n, n, 16, 8, dtype=torch.float32, seed=33)
    full = attnkit.linear_attention(q, k, v, causal=True, backend=backend)
    head, state = attnkit.linear_attention(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], causal=True,
                                           return_state=True, backend=backend)
    assert state[0].dtype == torch.float32
    outs = [head]
    for t in range(n0, n):
        out_t, state = attnkit.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state,
                                                     backend=backend)
        outs.append(out_t[:, :, None])
    assert rel_err(torch.cat(outs, dim=2), linear_loop(q, k, v, causal=True)) <= 2e-5
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_gradients(backend):
    q, k, v = (t[:, :, 0] for t in make(1, 2, 1, 1, 3, 2, seed=34))
    s0, z0 = make_state(1, 2, 3, 2)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s0, z0)]

    def fn(q, k, v, s0, z0):
        out, (s, z) = attnkit.linear_attention_step(q, k, v, (s0, z0), eps=1e-3, backend=backend)
        return out, s, z

    assert torch.autograd.gradcheck(fn, leaves)


def test_step_torch_compile_fullgraph():
    q, k, v = (t[:, :, 0] for t in make(1, 2, 1, 1, 8, 4, dtype=torch.float32, seed=35))
    s0, z0 = make_state(1, 2, 8, 4, dtype=torch.float32)
    compiled = torch.compile(attnkit.linear_attention_step, fullgraph=True)
    got, (s, z) = compiled(q, k, v, (s0, z0), feature_map="relu")
    want, (ws, wz) = attnkit.linear_attention_step(q, k, v, (s0, z0), feature_map="relu")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, ws, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, wz, rtol=1e-6, atol=1e-6)


def test_state_api_torch_compile_fullgraph():
    q, k, v = make(1, 2, 9, 9, 8, 5, dtype=torch.float32, seed=36)
    s0, z0 = make_state(1, 2, 8, 5, dtype=torch.float32)
    compiled = torch.compile(attnkit.linear_attention, fullgraph=True)
    kw = dict(causal=True, initial_state=(s0, z0), return_state=True)
    got, (s, z) = compiled(q, k, v, **kw)
    want, (ws, wz) = attnkit.linear_attention(q, k, v, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, ws, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z, wz, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- state validation

def test_state_needs_causal():
    q, k, v = _qkv()
    state = make_state(2, 3, 8, 6, dtype=torch.float32)
    with pytest.raises(ValueError, match="linear_attention: initial_state needs causal=True"):
        attnkit.linear_attention(q, k, v, initial_state=state)
    with pytest.raises(ValueError, match="linear_attention: return_state=True needs causal=True"):
        attnkit.linear_attention(q, k, v, return_state=True)


def test_return_state_must_be_bool():
    with pytest.raises(TypeError, match="return_state must be a bool; got 1"):
        attnkit.linear_attention(*_qkv(), causal=True, return_state=1)


@pytest.mark.parametrize("state,match", [
    (torch.zeros(2, 3, 8, 6), r"initial_state must be a pair \(S, z\) of tensors; got Tensor"),
    ((torch.zeros(2, 3, 8, 6),), r"initial_state must be a pair \(S, z\) of tensors; got a tuple of length 1"),
])
def test_state_must_be_a_pair(state, match):
    with pytest.raises(TypeError, match=match):
        attnkit.linear_attention(*_qkv(), causal=True, initial_state=state)


def test_state_parts_must_be_floating_tensors():
    s0, z0 = make_state(2, 3, 8, 6, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"initial_state\[1\] \(z\) must be a torch.Tensor"):
        attnkit.linear_attention(*_qkv(), causal=True, initial_state=(s0, z0.tolist()))
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) must be a 4-D tensor"):
        attnkit.linear_attention(*_qkv(), causal=True, initial_state=(s0[0], z0))


@pytest.mark.parametrize("which,shape,want", [
    (0, (2, 3, 8, 5), r"initial_state\[0\] \(S\) must have shape \[2, 3, 8, 6\]; got \[2, 3, 8, 5\]"),
    (1, (2, 1, 8), r"initial_state\[1\] \(z\) must have shape \[2, 3, 8\]; got \[2, 1, 8\]"),
])
def test_state_shapes(which, shape, want):
    state = list(make_state(2, 3, 8, 6, dtype=torch.float32))
    state[which] = torch.zeros(shape)
    with pytest.raises(ValueError, match=want):
        attnkit.linear_attention(*_qkv(), causal=True, initial_state=tuple(state))


def test_state_dtype_is_the_accumulation_dtype():
    s0, z0 = make_state(2, 3, 8, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) must be float32 \(the state dtype of "
                                         r"bfloat16 inputs\); got float64"):
        attnkit.linear_attention(*(t.bfloat16() for t in _qkv()), causal=True, initial_state=(s0, z0))
    with pytest.raises(ValueError, match=r"\(z\) must be float64 \(the state dtype of float64 inputs\); got float32"):
        attnkit.linear_attention(*(t.double() for t in _qkv()), causal=True,
                                 initial_state=(s0, z0.float()))


def test_state_device():
    s0, z0 = make_state(2, 3, 8, 6, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"initial_state\[0\] \(S\) must be on the device of query"):
        attnkit.linear_attention(*_qkv(), causal=True, initial_state=(s0.to("meta"), z0))


def _step_args(d=8, dv=6):
    q, k, v = _qkv(d=d, dv=dv)
    return q[:, :, 0], k[:, :, 0], v[:, :, 0]


def test_step_validation():
    q, k, v = _step_args()
    fn = "linear_attention_step"
    with pytest.raises(ValueError, match=rf"{fn}: q_t must be a 3-D tensor \[B, H, D\]"):
        attnkit.linear_attention_step(q[:, :, None], k, v)
    with pytest.raises(ValueError, match=rf"{fn}: v_t must be a 3-D tensor \[B, H, Dv\]"):
        attnkit.linear_attention_step(q, k, v[:, :, None])
    with pytest.raises(ValueError, match="same head dim D; got q_t 8, k_t 7"):
        attnkit.linear_attention_step(q, k[..., :7], v)
    with pytest.raises(ValueError, match="same batch size B; got q_t 2, k_t 2, v_t 1"):
        attnkit.linear_attention_step(q, k, v[:1])
    with pytest.raises(ValueError, match="same number of heads H; got q_t 3, k_t 2, v_t 3"):
        attnkit.linear_attention_step(q, k[:, :2], v)
    with pytest.raises(ValueError, match=r"v_t must have the dtype of q_t \(float32\); got float64"):
        attnkit.linear_attention_step(q, k, v.double())
    with pytest.raises(TypeError, match=rf"{fn}: k_t must be floating point"):
        attnkit.linear_attention_step(q, k.long(), v)
    with pytest.raises(ValueError, match=rf"{fn}: unknown feature_map 'exp'"):
        attnkit.linear_attention_step(q, k, v, feature_map="exp")
    with pytest.raises(ValueError, match=rf"{fn}: eps must be >= 0.0"):
        attnkit.linear_attention_step(q, k, v, eps=-1.0)
    with pytest.raises(TypeError, match=rf"{fn}: scale must be a finite real number"):
        attnkit.linear_attention_step(q, k, v, normalize=False, scale=float("nan"))
    with pytest.raises(TypeError, match=rf"{fn}: normalize must be a bool"):
        attnkit.linear_attention_step(q, k, v, normalize=None)
    with pytest.raises(ValueError, match=rf"{fn}: unknown backend 'gpu'"):
        attnkit.linear_attention_step(q, k, v, backend="gpu")


def test_step_state_validation():
    q, k, v = _step_args()
    s0, z0 = make_state(2, 3, 8, 6, dtype=torch.float32)
    fn = "linear_attention_step"
    with pytest.raises(TypeError, match=rf"{fn}: state must be a pair \(S, z\)"):
        attnkit.linear_attention_step(q, k, v, s0)
    with pytest.raises(ValueError, match=rf"{fn}: state\[0\] \(S\) must have shape \[2, 3, 8, 6\]"):
        attnkit.linear_attention_step(q, k, v, (s0[..., :5], z0))
    with pytest.raises(ValueError, match=rf"{fn}: state\[1\] \(z\) must be float32"):
        attnkit.linear_attention_step(q, k, v, (s0, z0.double()))


def test_step_validation_precedes_computation():
    q = torch.empty(2, 3, 8, device="meta")
    with pytest.raises(ValueError, match="same head dim D"):
        attnkit.linear_attention_step(q, torch.empty(2, 3, 7, device="meta"),
                                      torch.empty(2, 3, 6, device="meta"))


# ---------------------------------------------------------------------------- triton backend
# (on CPU tensors under TRITON_INTERPRET=1, which tests/conftest.py sets where there is no GPU;
# small shapes: the interpreter is slow)

needs_triton = pytest.mark.skipif(not attnkit.backends()["linear"]["triton"].usable,
                                  reason="the triton backend cannot run here")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton kernels run


def on_dev(*tensors):
    return [t.to(DEV) for t in tensors]


@needs_triton
@pytest.mark.parametrize("feature_map,causal,normalize", [("elu", True, True), ("relu", False, True),
                                                          ("identity", True, False)])
def test_triton_forward_and_grads_vs_float64(feature_map, causal, normalize):
    n = 37
    q, k, v = make(1, 2, n, n if causal else 21, 8, 6, dtype=torch.float32, seed=40,
                   positive_qk=feature_map == "identity")
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, scale=1.0 / n)
    leaves = [t.requires_grad_(True) for t in on_dev(q, k, v)]
    out = attnkit.linear_attention(*leaves, backend="triton", **kw)
    assert out.dtype == torch.float32
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = linear_loop(*leaves64, **kw)
    assert rel_err(out.cpu(), want) <= 2e-5
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(41))
    got = torch.autograd.grad(out, leaves, g.to(DEV))
    for a, b in zip(got, torch.autograd.grad(want, leaves64, g.double())):
        assert rel_err(a.cpu(), b) <= 1e-4


@needs_triton
def test_triton_state_and_step_match_cpu_semantics():
    n, n0 = 30, 20
    q, k, v = make(1, 2, n, n, 8, 4, dtype=torch.float32, seed=42)
    s0, z0 = make_state(1, 2, 8, 4, dtype=torch.float32)
    want, ws, wz = state_loop(q, k, v, s0, z0)
    q, k, v, s0, z0 = on_dev(q, k, v, s0, z0)
    full, (s, z) = attnkit.linear_attention(q, k, v, causal=True, initial_state=(s0, z0),
                                            return_state=True, backend="triton")
    assert rel_err(full.cpu(), want) <= 2e-5
    assert rel_err(s.cpu(), ws) <= 2e-5 and rel_err(z.cpu(), wz) <= 2e-5
    head, state = attnkit.linear_attention(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], causal=True,
                                           initial_state=(s0, z0), return_state=True, backend="triton")
    for t in range(n0, n0 + 3):
        out_t, state = attnkit.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state,
                                                     backend="triton")
        assert rel_err(out_t.cpu(), want[:, :, t]) <= 2e-5


@needs_triton
def test_triton_state_gradients():
    q, k, v = make(1, 1, 12, 12, 4, 3, dtype=torch.float32, seed=43)
    s0, z0 = make_state(1, 1, 4, 3, dtype=torch.float32)
    leaves = [t.requires_grad_(True) for t in on_dev(q, k, v, s0, z0)]
    out, (s, z) = attnkit.linear_attention(*leaves[:3], causal=True, initial_state=tuple(leaves[3:]),
                                           return_state=True, backend="triton")
    loss = out.square().sum() + s.sum() + (z * 2).sum()
    got = [g.cpu() for g in torch.autograd.grad(loss, leaves)]
    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v, s0, z0)]
    o64, s64, z64 = state_loop(*leaves64)
    want = torch.autograd.grad(o64.square().sum() + s64.sum() + (z64 * 2).sum(), leaves64)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-4


@needs_triton
def test_triton_opcheck():
    q, k, v = make(1, 1, 20, 20, 4, 3, dtype=torch.float32, seed=44)
    s0, z0 = make_state(1, 1, 4, 3, dtype=torch.float32)
    q, k, v, s0, z0 = (t.requires_grad_(True) for t in on_dev(q, k, v, s0, z0))
    torch.library.opcheck(torch.ops.attnkit.linear_triton_fwd.default,
                          (q, k, v, s0, z0, True, "elu", True, 1e-6, 1.0),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@needs_triton
def test_triton_named_for_float64_raises():
    q, k, v = on_dev(*make(1, 1, 5, 5, 4, 3))
    with pytest.raises(BackendUnavailableError,
                       match=r"the triton backend \(backend='triton'\) cannot run float64 inputs"):
        attnkit.linear_attention(q, k, v, backend="triton")
    with pytest.raises(BackendUnavailableError, match=r"linear_attention_step: the triton backend"):
        attnkit.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], backend="triton")


@needs_triton
def test_default_routes_what_triton_cannot_run_to_the_reference(monkeypatch):
    # The default backend of a CUDA tensor is triton; float64 (and a zero head dim) are routed
    # to the reference.  Decided from the device alone: no GPU needed to check the rule.
    from attnkit.ops.linear import _route

    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    cuda = torch.device("cuda")
    assert _route("f", None, cuda, torch.float32, 8, 8) == "triton"
    assert _route("f", None, cuda, torch.float64, 8, 8) == "reference"
    assert _route("f", None, cuda, torch.float32, 8, 0) == "reference"
    monkeypatch.setenv("ATTNKIT_BACKEND", "triton")
    with pytest.raises(BackendUnavailableError, match=r"\(ATTNKIT_BACKEND='triton'\) cannot run float64"):
        _route("f", None, cuda, torch.float64, 8, 8)


# ---------------------------------------------------------------------------- cuda backend

@pytest.mark.gpu
@pytest.mark.skipif(not attnkit.backends()["linear"]["cuda"].usable, reason="no cuda backend here")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_backend_forward_grads_and_state(causal):
    q, k, v = make(2, 2, 130, 130 if causal else 77, 16, 8, dtype=torch.float32, seed=50)
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    res = attnkit.linear_attention(*leaves, causal=causal, return_state=causal, backend="cuda")
    out = res[0] if causal else res
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = linear_loop(*leaves64, causal=causal)
    assert rel_err(out.cpu(), want) <= 2e-5
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(51))
    got = torch.autograd.grad(out, leaves, g.cuda())
    for a, b in zip(got, torch.autograd.grad(want, leaves64, g.double())):
        assert rel_err(a.cpu(), b) <= 1e-4
    if causal:
        _, ws, wz = state_loop(q, k, v, torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, 16))
        assert rel_err(res[1][0].cpu(), ws) <= 2e-5 and rel_err(res[1][1].cpu(), wz) <= 2e-5


# ----------------------------------------------------------------------------------------------
# the eager fast path (issue 14): plain calls skip _validate and torch.library's Python autograd
# wrapper -- same kernels, so results bit for bit those of the registered op
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_eager_path_matches_the_registered_op_bit_for_bit(causal):
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend here")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, d, requires_grad=True) for d in (8, 8, 5))
    g = torch.randn(2, 3, 13, 5)
    out = attnkit.linear_attention(q, k, v, causal=causal)
    assert out.grad_fn is not None
    grads = torch.autograd.grad(out, (q, k, v), g)
    out_op = torch.ops.attnkit.linear_fwd(q, k, v, None, None, causal, "elu", True, 1e-6, 1.0)[0]
    grads_op = torch.autograd.grad(out_op, (q, k, v), g)
    for got, want in zip((out, *grads), (out_op, *grads_op)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        assert attnkit.linear_attention(q, k, v, causal=causal).grad_fn is None


def test_eager_path_state_gradients_match_the_registered_op():
    if "cpu" not in BACKENDS:
        pytest.skip("no cpu backend here")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 4, requires_grad=True) for _ in range(3))
    S0 = torch.randn(1, 2, 4, 4, requires_grad=True)
    z0 = torch.rand(1, 2, 4, requires_grad=True)
    out, (S, z) = attnkit.linear_attention(q, k, v, causal=True, initial_state=(S0, z0), return_state=True)
    loss = out.sum() + S.square().sum() + z.sum()
    grads = torch.autograd.grad(loss, (q, k, v, S0, z0))
    out_op, _, S_op, z_op = torch.ops.attnkit.linear_fwd(q, k, v, S0, z0, True, "elu", True, 1e-6, 1.0)
    grads_op = torch.autograd.grad(out_op.sum() + S_op.square().sum() + z_op.sum(), (q, k, v, S0, z0))
    for got, want in zip(grads, grads_op):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("changes,exc,match", [
    # Arguments a plain [B, H, N, D] call could carry that are still not what the API takes.
    (dict(eps=True), TypeError, "eps must be a finite real number; got True"),
    (dict(scale=False), TypeError, "scale must be a finite real number; got False"),
    (dict(causal=1), TypeError, "causal must be a bool; got 1"),
    (dict(return_state=True), ValueError, "return_state=True needs causal=True"),
    (dict(feature_map=["elu"]), ValueError, "unknown feature_map"),
])
def test_plain_shaped_calls_still_checked(changes, exc, match):
    with pytest.raises(exc, match=f"attnkit.linear_attention: {match}"):
        attnkit.linear_attention(*_qkv(), **changes)


def test_step_plain_shaped_calls_still_checked():
    fn = "attnkit.linear_attention_step"
    q, k, v = (torch.randn(2, 3, 4) for _ in range(3))
    S, z = torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4)
    with pytest.raises(TypeError, match=rf"{fn}: eps must be a finite real number; got True"):
        attnkit.linear_attention_step(q, k, v, (S, z), eps=True)
    with pytest.raises(TypeError, match=rf"{fn}: normalize must be a bool; got 1"):
        attnkit.linear_attention_step(q, k, v, (S, z), normalize=1)
    with pytest.raises(ValueError, match=rf"{fn}: state\[0\] \(S\) must have shape \[2, 3, 4, 4\]"):
        attnkit.linear_attention_step(q, k, v, (S[:, :, :3], z))
    with pytest.raises(ValueError, match=rf"{fn}: state\[1\] \(z\) must be float32"):
        attnkit.linear_attention_step(q, k, v, (S, z.double()))
    with pytest.raises(TypeError, match=rf"{fn}: state must be a pair \(S, z\)"):
        attnkit.linear_attention_step(q, k, v, (S, z, z))
    # A list is a pair too; the new state is a tuple.
    out, state = attnkit.linear_attention_step(q, k, v, [S, z])
    assert isinstance(state, tuple) and out.shape == (2, 3, 4)

"""The C++ CPU linear-attention ops attnkit::linear_fwd / linear_bwd (csrc/cpu/linear.cpp) and
their registrations in pytorch_ext/ops/linear.py (fake, autograd, the cpu backend).

Ground truth: the float64 reference (itself checked against explicit loops in
tests/reference/test_linear_reference.py), whose masked-quadratic form shares nothing with the
kernels' chunked recurrence; gradients by autograd through it.
"""
import itertools

import pytest
import torch

import attnkit
from attnkit.reference.linear import linear_attention_reference, linear_attention_step_reference
from attnkit_testing import num_threads

pytestmark = pytest.mark.skipif(
    not attnkit.backends()["linear"]["cpu"].usable, reason="attnkit._C is not built"
)
F64 = torch.float64
FEATURE_MAPS = ("elu", "relu", "identity")
COMBOS = list(itertools.product(FEATURE_MAPS, (False, True), (True, False)))  # fm, causal, normalize


def make(b, h, n, m, d, dv, dtype=torch.float32, seed=0, positive_qk=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=F64)
    k = torch.randn(b, h, m, d, generator=g, dtype=F64)
    v = torch.randn(b, h, m, dv, generator=g, dtype=F64)
    if positive_qk:
        # identity + normalize divides by Σ_j q_i·k_j, which for signed inputs can be ~0 (an
        # ill-conditioned problem, not a kernel error): positive q, k keep the weights positive.
        q, k = q.abs(), k.abs()
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_state(b, h, d, dv, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    s0 = torch.randn(b, h, d, dv, generator=g, dtype=F64)
    z0 = torch.rand(b, h, d, generator=g, dtype=F64) + 0.5  # a plausible Σ φ(k) > 0
    return s0.to(dtype), z0.to(dtype)


def rel_err(got, want):
    """max |got - want| / max |want| (outputs cross zero elementwise)."""
    scale = want.abs().max().item()
    return (got.to(F64) - want).abs().max().item() / (scale if scale > 0 else 1.0)


def truth(q, k, v, grad_out, state=None, grad_state=None, **kw):
    """float64 reference forward (out, S, z) and the gradients of Σ out·grad_out (+ the state's)."""
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    st = None
    if state is not None:
        st = tuple(t.detach().to(F64).requires_grad_(True) for t in state)
        leaves += list(st)
    out, (s, z) = linear_attention_reference(*leaves[:3], initial_state=st, return_state=True, **kw)
    outs, grads = [out], [grad_out.to(F64)]
    if grad_state is not None:
        outs += [s, z]
        grads += [g.to(F64) for g in grad_state]
    found = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    found = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, found)]
    return out.detach(), (s.detach(), z.detach()), found


def run_cpu(q, k, v, grad_out, state=None, grad_state=None, **kw):
    """attnkit.linear_attention on the cpu backend: out, state, and the same gradients."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    st = None
    if state is not None:
        st = tuple(t.detach().clone().requires_grad_(True) for t in state)
        leaves += list(st)
    causal = kw.get("causal", False)
    res = attnkit.linear_attention(*leaves[:3], initial_state=st, return_state=causal,
                                   backend="cpu", **kw)
    out, (s, z) = res if causal else (res, (None, None))
    outs, grads = [out], [grad_out]
    if grad_state is not None:
        outs += [s, z]
        grads += list(grad_state)
    found = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    return out.detach(), (s, z), found


# ------------------------------------------------------------------ forward + grads, float64

@pytest.mark.parametrize("feature_map,causal,normalize", COMBOS)
def test_float64_matches_reference_to_rounding(feature_map, causal, normalize):
    # N = 130: two full chunks of 64 and a tail of 2; M != N when not causal; Dv != D.
    n, m = 130, (130 if causal else 77)
    q, k, v = make(2, 3, n, m, 16, 11, F64, seed=2, positive_qk=feature_map == "identity")
    g = torch.randn(2, 3, n, 11, dtype=F64)
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-3, scale=0.7)
    out, _, grads = run_cpu(q, k, v, g, **kw)
    want, _, want_grads = truth(q, k, v, g, **kw)
    assert out.dtype == F64 and out.shape == (2, 3, n, 11)
    assert rel_err(out, want) < 1e-12
    for got, exp in zip(grads, want_grads):
        assert rel_err(got, exp) < 1e-11


# ------------------------------------------------------------------ float32, the sizes

# (N, D, Dv), sampled over the grid N in {1, 7, 100, 513, 2049}, D in {16, 32, 64, 128},
# Dv != D; every (feature map, causal, normalize) combination meets a few of them.
SIZES = [(1, 16, 24), (7, 32, 20), (100, 64, 40), (513, 128, 96), (2049, 64, 80),
         (100, 16, 8), (513, 32, 48), (7, 128, 64)]
CASES = [(size, combo) for i, combo in enumerate(COMBOS) for size in (SIZES[i % 8], SIZES[(i + 3) % 8])]


@pytest.mark.parametrize("size,combo", CASES, ids=lambda x: str(x))
def test_float32_forward_and_grads_vs_float64(size, combo):
    n, d, dv = size
    feature_map, causal, normalize = combo
    m = n if causal else n + 9
    b, h = (1, 2) if n >= 513 else (2, 2)
    q, k, v = make(b, h, n, m, d, dv, seed=n + d, positive_qk=feature_map == "identity" and normalize)
    g = torch.randn(b, h, n, dv)
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-6,
              scale=1.0 / max(n, 1))
    out, _, grads = run_cpu(q, k, v, g, **kw)
    want, _, want_grads = truth(q, k, v, g, **kw)
    assert out.dtype == torch.float32
    assert rel_err(out, want) <= 2e-5
    for got, exp in zip(grads, want_grads):
        assert got.dtype == torch.float32
        assert rel_err(got, exp) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("feature_map,causal,normalize",
                         [("elu", True, True), ("elu", False, True), ("relu", True, True),
                          ("identity", True, False), ("identity", False, False)])
def test_half_precision_within_twice_the_reference_error(dtype, feature_map, causal, normalize):
    # Tolerance rule: within 2x the error the reference itself makes in that dtype, plus 1e-3
    # (absolute, on outputs / gradients of size ~1).
    n, d, dv = 200, 32, 24
    q, k, v = make(2, 2, n, n, d, dv, dtype, seed=5)
    g = torch.randn(2, 2, n, dv).to(dtype)
    kw = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-6, scale=1.0 / n)
    out, _, grads = run_cpu(q, k, v, g, **kw)
    want, _, want_grads = truth(q, k, v, g, **kw)
    # the reference run in the low dtype itself (forward and autograd)
    lo = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = linear_attention_reference(*lo, **kw)
    ref_grads = torch.autograd.grad(ref_out, lo, g)
    assert out.dtype == dtype and all(t.dtype == dtype for t in grads)

    def err(a, b):
        return (a.to(F64) - b).abs().max().item()

    assert err(out, want) <= 2 * err(ref_out, want) + 1e-3
    for got, ref, exp in zip(grads, ref_grads, want_grads):
        assert err(got, exp) <= 2 * err(ref, exp) + 1e-3


# ------------------------------------------------------------------ recurrent state

@pytest.mark.parametrize("feature_map,normalize", [("elu", True), ("relu", False), ("identity", False)])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_initial_state_forward_and_all_grads(feature_map, normalize, dtype):
    n, d, dv = 150, 32, 20
    q, k, v = make(2, 3, n, n, d, dv, dtype, seed=6)
    state = make_state(2, 3, d, dv, dtype)
    g = torch.randn(2, 3, n, dv, dtype=dtype)
    g_state = (torch.randn(2, 3, d, dv, dtype=dtype), torch.randn(2, 3, d, dtype=dtype))
    kw = dict(causal=True, feature_map=feature_map, normalize=normalize, eps=1e-6, scale=0.01)
    out, (s, z), grads = run_cpu(q, k, v, g, state, g_state, **kw)
    want, (ws, wz), want_grads = truth(q, k, v, g, state, g_state, **kw)
    assert s.dtype == z.dtype == dtype and s.shape == (2, 3, d, dv) and z.shape == (2, 3, d)
    tol_out, tol_grad = (1e-12, 1e-11) if dtype == F64 else (2e-5, 1e-4)
    assert rel_err(out, want) <= tol_out
    assert rel_err(s, ws) <= tol_out and rel_err(z, wz) <= tol_out
    assert len(grads) == 5
    for got, exp in zip(grads, want_grads):  # q, k, v, S0, z0
        assert rel_err(got, exp) <= tol_grad


def test_state_dtype_for_low_precision_inputs_is_float32():
    q, k, v = make(1, 2, 70, 70, 16, 8, torch.bfloat16)
    s0, z0 = make_state(1, 2, 16, 8, torch.float32)
    out, (s, z) = attnkit.linear_attention(q, k, v, causal=True, initial_state=(s0, z0),
                                           return_state=True, backend="cpu")
    assert out.dtype == torch.bfloat16 and s.dtype == z.dtype == torch.float32
    _, (ws, wz) = linear_attention_reference(q.double(), k.double(), v.double(), causal=True,
                                              initial_state=(s0.double(), z0.double()),
                                              return_state=True)
    # the state sums bf16 inputs exactly converted to float32: float32 accuracy
    assert rel_err(s, ws) < 1e-5 and rel_err(z, wz) < 1e-5


@pytest.mark.parametrize("feature_map,normalize", [("elu", True), ("identity", False)])
def test_chunked_equals_step_by_step(feature_map, normalize):
    # The chunked causal kernel against the token-by-token recurrence (the cpu backend's
    # linear_attention_step, and the reference recurrence), over two chunk boundaries.
    n, d, dv = 140, 16, 12
    q, k, v = make(2, 2, n, n, d, dv, F64, seed=7)
    kw = dict(feature_map=feature_map, normalize=normalize, eps=1e-6, scale=0.5)
    out, (s, z) = attnkit.linear_attention(q, k, v, causal=True, return_state=True, backend="cpu", **kw)
    state = ref_state = None
    for t in range(n):
        o_t, state = attnkit.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state,
                                                   backend="cpu", **kw)
        r_t, ref_state = linear_attention_step_reference(q[:, :, t], k[:, :, t], v[:, :, t],
                                                         ref_state, **kw)
        torch.testing.assert_close(o_t, out[:, :, t], rtol=1e-11, atol=1e-12)
        torch.testing.assert_close(r_t, out[:, :, t], rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(state[0], s, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state[1], z, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_prompt_then_steps_equals_one_long_call(dtype):
    n_prompt, n_total, d, dv = 70, 100, 32, 24
    q, k, v = make(1, 4, n_total, n_total, d, dv, dtype, seed=8)
    full, (s_full, z_full) = attnkit.linear_attention(q, k, v, causal=True, return_state=True,
                                                      backend="cpu")
    head, state = attnkit.linear_attention(q[:, :, :n_prompt], k[:, :, :n_prompt],
                                           v[:, :, :n_prompt], causal=True, return_state=True,
                                           backend="cpu")
    outs = [head]
    for t in range(n_prompt, n_total):
        o_t, state = attnkit.linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state,
                                                   backend="cpu")
        outs.append(o_t.unsqueeze(2))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, **tol)
    torch.testing.assert_close(state[0], s_full, **tol)
    torch.testing.assert_close(state[1], z_full, **tol)
    # and two parallel calls, the second continuing the first's state
    a, st = attnkit.linear_attention(q[:, :, :n_prompt], k[:, :, :n_prompt], v[:, :, :n_prompt],
                                     causal=True, return_state=True, backend="cpu")
    b2 = attnkit.linear_attention(q[:, :, n_prompt:], k[:, :, n_prompt:], v[:, :, n_prompt:],
                                  causal=True, initial_state=st, backend="cpu")
    torch.testing.assert_close(torch.cat([a, b2], dim=2), full, **tol)


def test_gradients_flow_through_a_chain_of_calls():
    # loss on the second half only: gradients reach the first half's inputs through the state
    q, k, v = make(1, 2, 40, 40, 8, 6, F64, seed=9)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    _, st = attnkit.linear_attention(*(t[:, :, :25] for t in leaves), causal=True,
                                     return_state=True, backend="cpu")
    second = attnkit.linear_attention(*(t[:, :, 25:] for t in leaves), causal=True,
                                      initial_state=st, backend="cpu")
    got = torch.autograd.grad(second.sum(), leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    full = linear_attention_reference(*ref_leaves, causal=True)
    want = torch.autograd.grad(full[:, :, 25:].sum(), ref_leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ layouts, threads, edges

@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_and_broadcast_grad(causal):
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 90, 3, 16, generator=g, dtype=F64).transpose(1, 2)
    k = torch.randn(2, 90, 3, 16, generator=g, dtype=F64).transpose(1, 2)
    v = torch.randn(2, 3, 90, 20, generator=g, dtype=F64)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    grad_out = torch.randn(1, 1, 1, 10, dtype=F64).expand(2, 3, 90, 10)  # stride-0 gradient
    out, _, grads = run_cpu(q, k, v, grad_out, causal=causal)
    want, _, want_grads = truth(q, k, v, grad_out, causal=causal)
    assert rel_err(out, want) < 1e-12
    for a, b in zip(grads, want_grads):
        assert rel_err(a, b) < 1e-11


def test_causal_results_do_not_depend_on_the_thread_count():
    q, k, v = make(2, 3, 300, 300, 32, 16, seed=11)
    g = torch.randn(2, 3, 300, 16)
    results = []
    for t in (1, 2, 3):
        with num_threads(t):
            results.append(run_cpu(q, k, v, g, causal=True))
    for out, _, grads in results[1:]:
        assert torch.equal(out, results[0][0])  # per-(b, h) sweeps: bitwise reproducible
        for a, b in zip(grads, results[0][2]):
            assert torch.equal(a, b)


def test_noncausal_split_reduction_single_head():
    # B*H = 1 < threads: the key (and query) chunks are reduced in parallel groups.
    with num_threads(3):
        q, k, v = make(1, 1, 700, 1000, 32, 24, F64, seed=12)
        g = torch.randn(1, 1, 700, 24, dtype=F64)
        out, _, grads = run_cpu(q, k, v, g, causal=False)
    want, _, want_grads = truth(q, k, v, g, causal=False)
    assert rel_err(out, want) < 1e-12
    for a, b in zip(grads, want_grads):
        assert rel_err(a, b) < 1e-11


@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequence(causal):
    q, k, v = make(2, 3, 0, 0 if causal else 5, 8, 6)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = attnkit.linear_attention(*leaves, causal=causal, backend="cpu")
    assert out.shape == (2, 3, 0, 6)
    out.sum().backward()
    assert leaves[1].grad.shape == (2, 3, 0 if causal else 5, 8)
    assert torch.equal(leaves[1].grad, torch.zeros_like(leaves[1].grad))


def test_empty_sequence_passes_the_state_through():
    q, k, v = make(1, 2, 0, 0, 8, 6)
    s0, z0 = make_state(1, 2, 8, 6)
    out, (s, z) = attnkit.linear_attention(q, k, v, causal=True, initial_state=(s0, z0),
                                           return_state=True, backend="cpu")
    assert out.shape == (1, 2, 0, 6) and torch.equal(s, s0) and torch.equal(z, z0)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
@pytest.mark.parametrize("normalize", [True, False])
def test_no_keys_gives_zeros_and_zero_grads(normalize, eps):
    q, k, v = make(2, 3, 7, 0, 8, 6)
    q.requires_grad_(True)
    out = attnkit.linear_attention(q, k, v, normalize=normalize, eps=eps, backend="cpu")
    assert torch.equal(out, torch.zeros(2, 3, 7, 6))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_value_dim_zero_and_head_dim_one():
    q, k, v = make(1, 2, 70, 70, 4, 0)
    assert attnkit.linear_attention(q, k, v, causal=True, backend="cpu").shape == (1, 2, 70, 0)
    q, k, v = make(1, 2, 70, 70, 1, 3, F64)
    for causal in (False, True):
        torch.testing.assert_close(attnkit.linear_attention(q, k, v, causal=causal, backend="cpu"),
                                   linear_attention_reference(q, k, v, causal=causal),
                                   rtol=1e-12, atol=1e-12)


def test_feature_map_derivative_at_zero_matches_autograd():
    # relu'(0) = 0 and (elu+1)'(0) = 1, as torch's autograd has them.
    q, k, v = make(1, 1, 20, 20, 8, 4, F64, seed=13)
    q[..., :3] = 0.0
    k[..., 2:5] = 0.0
    g = torch.randn(1, 1, 20, 4, dtype=F64)
    for fm in ("relu", "elu"):
        _, _, grads = run_cpu(q, k, v, g, causal=True, feature_map=fm)
        _, _, want = truth(q, k, v, g, causal=True, feature_map=fm)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def test_nan_propagates():
    q, k, v = make(1, 1, 10, 10, 4, 4)
    q[0, 0, 3, 1] = float("nan")
    for fm in FEATURE_MAPS:
        out = attnkit.linear_attention(q, k, v, causal=True, feature_map=fm, backend="cpu")
        assert torch.isnan(out[0, 0, 3]).all() and not torch.isnan(out[0, 0, :3]).any()


def test_very_negative_inputs_stay_finite():
    # elu + 1 of a very negative input is ~0 (not exactly), the normalizer eps keeps it finite
    q, k, v = make(1, 1, 80, 80, 8, 4)
    q, k = q - 200.0, k - 200.0
    for causal in (False, True):
        out = attnkit.linear_attention(q, k, v, causal=causal, backend="cpu")
        assert torch.isfinite(out).all()


# ------------------------------------------------------------------ op registration

def _op_args(causal, state, dtype=torch.float32):
    q, k, v = make(1, 2, 70, 70 if causal else 33, 8, 5, dtype, seed=14)
    s0, z0 = make_state(1, 2, 8, 5, dtype) if state else (None, None)
    return q, k, v, s0, z0


@pytest.mark.parametrize("causal,state", [(True, True), (True, False), (False, False), (False, True)])
def test_opcheck(causal, state):
    q, k, v, s0, z0 = _op_args(causal, state)
    for t in (q, k, v) + ((s0, z0) if state else ()):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.attnkit.linear_fwd.default,
                          (q, k, v, s0, z0, causal, "elu", True, 1e-6, 1.0))


def test_op_outputs_are_their_definitions():
    q, k, v, s0, z0 = _op_args(True, True, F64)
    out, den, s, z = torch.ops.attnkit.linear_fwd(q, k, v, s0, z0, True, "relu", True, 0.5, 1.0)
    pq, pk = q.relu(), k.relu()
    zi = z0.unsqueeze(2) + pk.cumsum(2)  # [B, H, N, D]
    torch.testing.assert_close(den, (pq * zi).sum(-1), rtol=1e-12, atol=1e-12)  # raw, no eps
    torch.testing.assert_close(s, s0 + pk.transpose(-1, -2) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, zi[:, :, -1], rtol=1e-12, atol=1e-12)
    ref = linear_attention_reference(q, k, v, causal=True, feature_map="relu", eps=0.5,
                                     initial_state=(s0, z0))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_through_the_op_with_state(causal):
    q, k, v = make(1, 1, 6, 6 if causal else 4, 3, 2, F64, seed=17)
    s0, z0 = make_state(1, 1, 3, 2, F64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s0, z0)]

    def fn(q, k, v, s0, z0):
        out, den, s, z = torch.ops.attnkit.linear_fwd(q, k, v, s0, z0, causal, "elu", True, 1e-3, 1.0)
        return out, den, s, z  # the gradients of every output, den included

    assert torch.autograd.gradcheck(fn, leaves)


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward(causal):
    q, k, v = make(1, 1, 6, 6, 3, 2, F64, seed=15)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def fn(q, k, v):
        return attnkit.linear_attention(q, k, v, causal=causal, backend="cpu")

    assert torch.autograd.gradgradcheck(fn, leaves)
    # through q alone, k and v held fixed (the reference's first gradients differentiated them
    # too and raised "One of the differentiated Tensors does not require grad"; session 29)
    k, v = k.detach(), v.detach()
    assert torch.autograd.gradgradcheck(lambda q: fn(q, k, v), (q,))


def test_torch_compile_fullgraph_with_state_and_backward():
    q, k, v = make(1, 2, 70, 70, 16, 8, seed=16)
    s0, z0 = make_state(1, 2, 16, 8)

    def fn(q, k, v, s0, z0):
        out, (s, z) = attnkit.linear_attention(q, k, v, causal=True, feature_map="relu",
                                               initial_state=(s0, z0), return_state=True,
                                               backend="cpu")
        return out.sum() + s.sum() + z.sum()

    compiled = torch.compile(fn, fullgraph=True)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s0, z0)]
    got = compiled(*leaves)
    got_grads = torch.autograd.grad(got, leaves)
    leaves2 = [t.clone().requires_grad_(True) for t in (q, k, v, s0, z0)]
    want = fn(*leaves2)
    want_grads = torch.autograd.grad(want, leaves2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_op_rejects_bad_arguments():
    q, k, v, s0, z0 = _op_args(True, True)
    with pytest.raises(RuntimeError, match="unknown feature_map 'tanh'"):
        torch.ops.attnkit.linear_fwd(q, k, v, None, None, True, "tanh", True, 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="S0 must be Double"):
        torch.ops.attnkit.linear_fwd(q.double(), k.double(), v.double(), s0, z0.double(), True,
                                     "elu", True, 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="S0 and z0 go together"):
        torch.ops.attnkit.linear_fwd(q, k, v, s0, None, True, "elu", True, 1e-6, 1.0)
    with pytest.raises(RuntimeError, match="causal needs N == M"):
        torch.ops.attnkit.linear_fwd(q, k[:, :, :5], v[:, :, :5], None, None, True, "elu", True,
                                     1e-6, 1.0)


# --------------------------------------------------------------------------------------------
# NaN and ±inf (issue 15): they reach exactly the outputs and gradients they reach in float64.


def _causal_rows64(q, k, v, feature_map, normalize, state):
    """Causal linear attention in float64, one row at a time over the keys that row sees.

    The reference's masked quadratic form multiplies the mask's zeros by every value row, so a NaN
    in v_j also reaches the rows i < j there (0·NaN; issue 15 allows it); row by row nothing past
    row i enters row i, which is the recurrence's (linear_attention_step) answer too."""
    from attnkit.reference.linear import feature_map_reference

    pq, pk = feature_map_reference(q, feature_map), feature_map_reference(k, feature_map)
    rows = []
    for i in range(q.shape[-2]):
        w = pq[..., i:i + 1, :] @ pk[..., :i + 1, :].transpose(-1, -2)
        num, den = w @ v[..., :i + 1, :], w.sum(-1, keepdim=True)
        if state is not None:
            num = num + pq[..., i:i + 1, :] @ state[0]
            den = den + pq[..., i:i + 1, :] @ state[1].unsqueeze(-1)
        rows.append(num / (den + 1e-6) if normalize else num)
    return torch.cat(rows, -2)


def _nonfinite_case(feature_map, causal, normalize, where, value, with_state):
    """(kernel's out and grads, float64 truth's out and grads, index of the poisoned entry)."""
    n, d, dv = 150, 19, 17  # 3 chunks of 64, the last partial; odd head dims
    q, k, v = make(1, 2, n, n, d, dv, seed=5)
    state = make_state(1, 2, d, dv, seed=6) if with_state else None
    inputs = {"q": q, "k": k, "v": v}
    if with_state:
        inputs.update(S0=state[0], z0=state[1])
    at = (0, 0, 3) if where == "z0" else (0, 0, 3, 3) if where == "S0" else (0, 0, 70, 3)
    inputs[where][at] = value  # row 70: chunk 1, the 3rd row of a 4-row micro-tile
    names = list(inputs)
    leaves = [inputs[name].clone().requires_grad_(True) for name in names]
    init = (leaves[3], leaves[4]) if with_state else None
    out = attnkit.linear_attention(*leaves[:3], causal=causal, feature_map=feature_map, normalize=normalize,
                                   initial_state=init, backend="cpu")
    g = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, leaves, g)]
    leaves64 = [t.detach().to(F64).requires_grad_(True) for t in leaves]
    init64 = (leaves64[3], leaves64[4]) if with_state else None
    if causal:
        want_out = _causal_rows64(*leaves64[:3], feature_map, normalize, init64)
    else:
        want_out = linear_attention_reference(*leaves64[:3], feature_map=feature_map, normalize=normalize)
    grads = torch.autograd.grad(want_out, leaves64, g.to(F64), allow_unused=True)
    want = [want_out, *[torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves64, grads)]]
    return names, got, want, at


@pytest.mark.parametrize("feature_map,causal,normalize", COMBOS)
@pytest.mark.parametrize("where", ["q", "k", "v", "S0", "z0"])
def test_nan_reaches_exactly_the_outputs_and_gradients_it_reaches_in_float64(feature_map, causal, normalize, where):
    if where in ("S0", "z0") and not causal:
        pytest.skip("an initial state needs causal=True")
    names, got, want, at = _nonfinite_case(feature_map, causal, normalize, where, float("nan"), where in ("S0", "z0"))
    for name, a, b in zip(["out"] + ["d" + n for n in names], got, want):
        a, b = a.detach().to(F64).clone(), b.detach().clone()
        if name == "d" + where:
            # The poisoned entry's own gradient: torch's elu backward gives NaN there on its
            # vectorized path and the gradient on its scalar tail; the kernel gives NaN (elu),
            # the gradient (relu, identity).  Every other entry must agree.
            a[at] = b[at] = 0
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        finite = torch.isfinite(b)
        assert torch.isfinite(a[finite]).all(), name
    if causal and where != "v":
        # Here the reference's own masked form agrees exactly with the row-by-row truth.
        ref = linear_attention_reference(*[t.to(F64) for t in _nan_inputs(where)], causal=True,
                                         feature_map=feature_map, normalize=normalize)
        out = attnkit.linear_attention(*_nan_inputs(where), causal=True, feature_map=feature_map,
                                       normalize=normalize, backend="cpu")
        assert torch.equal(torch.isnan(out), torch.isnan(ref))


def _nan_inputs(where):
    q, k, v = make(1, 2, 150, 150, 19, 17, seed=5)
    if where in ("q", "k"):
        {"q": q, "k": k}[where][0, 0, 70, 3] = float("nan")
    return q, k, v


@pytest.mark.parametrize("feature_map,causal,normalize", [c for c in COMBOS if c[0] != "identity"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_inf_reaches_exactly_the_outputs_and_gradients_it_reaches_in_float64(feature_map, causal, normalize, where, value):
    # Non-finite where float64 is non-finite, finite elsewhere.  Inf against NaN may differ: the
    # state form sums φ(k_j)[d] v_j[e] before the query's weights (0·inf = NaN in φ(k) vᵀ where the
    # quadratic form has w·inf = inf), as the recurrence does.
    names, got, want, _ = _nonfinite_case(feature_map, causal, normalize, where, value, False)
    for name, a, b in zip(["out"] + ["d" + n for n in names], got, want):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name


def test_nan_value_never_reaches_earlier_rows_of_its_causal_chunk():
    # Regression: the triangular product A·V of a chunk ran on 4-row micro-tiles, multiplying the
    # mask's zeros by v_{j} for up to 3 rows i < j: out[68] and out[69] came out NaN.
    q, k, v = make(1, 1, 100, 100, 16, 16)
    v[0, 0, 71, 0] = float("nan")
    out = attnkit.linear_attention(q, k, v, causal=True, backend="cpu")
    assert not torch.isnan(out[0, 0, :71]).any() and torch.isnan(out[0, 0, 71:, 0]).all()
    assert not torch.isnan(out[0, 0, 71:, 1:]).any()


def test_relu_gradient_is_zero_where_the_input_is_not_positive_even_against_nan():
    # Regression: relu' = 0 was applied as a product, so a NaN gradient of φ(q) made dq NaN where
    # q <= 0; torch's relu backward selects 0 there.
    q, k, v = make(1, 1, 40, 40, 8, 8)
    k[0, 0, 5, 2] = float("nan")  # every query's dφ(q) is NaN in the non-causal case
    q = q.requires_grad_(True)
    out = attnkit.linear_attention(q, k, v, feature_map="relu", backend="cpu")
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert (dq[q.detach() <= 0] == 0).all() and torch.isnan(dq[q.detach() > 0]).all()


def test_unnormalized_gradients_ignore_a_nan_in_z0():
    # normalize=False: den and z0 do not reach the output, so their NaN must not reach dq (dden = 0
    # was multiplied into z: 0·NaN).
    q, k, v = make(1, 1, 70, 70, 8, 8)
    s0, z0 = make_state(1, 1, 8, 8)
    z0[0, 0, 1] = float("nan")
    q = q.requires_grad_(True)
    out = attnkit.linear_attention(q, k, v, causal=True, normalize=False, initial_state=(s0, z0), backend="cpu")
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()

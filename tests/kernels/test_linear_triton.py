"""Triton linear-attention kernels (attnkit.kernels.linear): chunked forward and backward.

Without a GPU these run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports attnkit), where a tile step costs milliseconds:
shapes stay small (N <= 130, one N = 257 case).  bfloat16: three small sizes interpreted (its
interpreter fixed for the tests: tests/triton_interpreter_bf16.py), the rest in the ``gpu``-marked
tests, with the large shapes.

Ground truth: ``linear_attention_reference`` run in float64 on the same (already rounded)
inputs, gradients by autograd.  With a recurrent state (initial state in, final state out),
which the reference does not have, the ground truth is an independent float64 formulation:
cumulative sums of the outer products φ(k_j) v_jᵀ (``state_reference``); without a state it is
checked against the reference too.  Tolerance rule (DESIGN.md): float32 within 2e-5 of the
largest reference magnitude (gradients 1e-4); float16 / bfloat16 within 2x the error the
reference makes when it runs in that dtype, plus 1e-3.

identity + normalize divides by Σ_j q_i·k_j, which for zero-mean inputs comes arbitrarily
close to 0 (an ill-conditioned problem whatever computes it), so those cases draw q, k with a
positive mean (``positive``) to keep the normalizer away from 0.
"""
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from attnkit.kernels import linear as triton_linear  # noqa: E402
from attnkit_testing import TRITON_BF16_TEST  # noqa: E402
from attnkit.reference.linear import (  # noqa: E402
    feature_map_reference,
    linear_attention_reference,
)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEATURE_MAPS = ("elu", "relu", "identity")


def cfg(bk, bv):
    """A block config for the interpreter tests (warps / stages mean nothing there)."""
    return triton.Config({"BLOCK_K": bk, "BLOCK_V": bv}, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------
# tolerance rule and references
# ----------------------------------------------------------------------------------------------


def max_err(x, ref64, name):
    x = x.detach().to(F64).cpu()
    ref64 = ref64.detach().to(F64).cpu()
    assert not torch.isnan(x).any(), f"{name}: NaN in the result"
    assert torch.isfinite(ref64).all(), f"{name}: non-finite float64 reference"
    assert torch.isfinite(x).all(), f"{name}: non-finite result"
    return (x - ref64).abs().max().item() if x.numel() else 0.0


def assert_close(x, ref64, ref_lowp=None, *, dtype, grad=False, name="out"):
    assert tuple(x.shape) == tuple(ref64.shape), \
        f"{name}: shape {tuple(x.shape)} != {tuple(ref64.shape)}"
    err = max_err(x, ref64, name)
    size = ref64.detach().abs().max().item() if ref64.numel() else 0.0
    if dtype == F32:
        tol = (1e-4 if grad else 2e-5) * size
    else:
        tol = 2.0 * max_err(ref_lowp, ref64, f"{name} (reference in {dtype})") + 1e-3
    assert err <= tol, f"{name} ({dtype}): max error {err:.3e} > tolerance {tol:.3e}"


def make_inputs(b, h, n, m, d, dv, dtype, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, h, m, d, generator=g)
    v = torch.randn(b, h, m, dv, generator=g)
    go = torch.randn(b, h, n, dv, generator=g)
    if positive:
        q, k = 0.5 * q + 1.0, 0.5 * k + 1.0
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, go)]


def reference(q, k, v, go, kw, dtype=F64):
    """(out, dq, dk, dv) of linear_attention_reference run in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = linear_attention_reference(*leaves, **kw)
    out.backward(go.to(dtype))
    return (out.detach(), *(t.grad for t in leaves))


def state_reference(q, k, v, s0, z0, *, causal, feature_map, normalize, eps, scale):
    """(out, S_final, z_final, den) from the recurrent form: the state a query sees is S0 + a
    cumulative sum of outer products φ(k_j) v_jᵀ (causal) or their total; den = φ(q_i)·z_i raw.
    Differentiable (autograd gives the ground-truth gradients, including those of s0, z0)."""
    pq = feature_map_reference(q, feature_map)
    pk = feature_map_reference(k, feature_map)
    outer = pk[..., :, None] * v[..., None, :]  # [B, H, M, D, Dv]
    s_final = s0 + outer.sum(2)
    z_final = z0 + pk.sum(2)
    if causal:
        states = s0[:, :, None] + outer.cumsum(2)  # state including key i, for query i
        zs = z0[:, :, None] + pk.cumsum(2)
        num = torch.einsum("bhnd,bhnde->bhne", pq, states)
        den = (pq * zs).sum(-1, keepdim=True)
    else:
        num = pq @ s_final
        den = (pq * z_final[:, :, None]).sum(-1, keepdim=True)
    out = num / (den + eps) if normalize else num * scale
    return out, s_final, z_final, den[..., 0]


def run_kernels(q, k, v, go, kw, **extra):
    out, s, z, den = triton_linear.linear_fwd(q, k, v, **kw, **extra)
    grads = triton_linear.linear_bwd(go, q, k, v, **kw, out=out, den=den, **extra)
    return (out, *grads), (s, z, den)


NAMES = ("out", "dq", "dk", "dv")


def check_against_reference(got, q, k, v, go, kw):
    dtype = q.dtype
    ref = reference(q, k, v, go, kw)
    lowp = None if dtype == F32 else reference(q, k, v, go, kw, dtype=dtype)
    for i, name in enumerate(NAMES):
        assert got[i].dtype == dtype, name
        assert_close(got[i], ref[i], None if lowp is None else lowp[i], dtype=dtype,
                     grad=i > 0, name=name)


def kwargs(causal, feature_map, normalize, eps=1e-6, scale=1.0):
    return dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
                scale=scale)


# ----------------------------------------------------------------------------------------------
# forward and backward against the float64 reference: every feature map x causal x normalize
# ----------------------------------------------------------------------------------------------

COMBOS = [(fm, c, nz) for fm in FEATURE_MAPS for c in (False, True) for nz in (True, False)]
IDS = [f"{fm}-{'causal' if c else 'full'}-{'norm' if nz else 'scale'}" for fm, c, nz in COMBOS]


@pytest.mark.parametrize("feature_map, causal, normalize", COMBOS, ids=IDS)
def test_float32(feature_map, causal, normalize):
    # causal: N = 100 (one full chunk of 64 and a partial one); non-causal: N = 70 queries,
    # M = 100 keys.  Dv != D.
    n, m = (100, 100) if causal else (70, 100)
    q, k, v, go = make_inputs(1, 2, n, m, 32, 48, F32, seed=len(feature_map) + causal,
                              positive=feature_map == "identity" and normalize)
    kw = kwargs(causal, feature_map, normalize, scale=0.7)
    got, _ = run_kernels(q, k, v, go, kw)
    check_against_reference(got, q, k, v, go, kw)


@pytest.mark.parametrize("feature_map, causal, normalize", COMBOS, ids=IDS)
def test_float16(feature_map, causal, normalize):
    n, m = (77, 77) if causal else (45, 77)
    q, k, v, go = make_inputs(1, 2, n, m, 16, 24, F16, seed=7,
                              positive=feature_map == "identity" and normalize)
    kw = kwargs(causal, feature_map, normalize, scale=1.0 / m)
    got, _ = run_kernels(q, k, v, go, kw, chunk=32)
    check_against_reference(got, q, k, v, go, kw)


def test_long_sequence_several_chunks():
    # N = 257: five chunks of 64 with a last one of a single row.
    q, k, v, go = make_inputs(1, 1, 257, 257, 16, 16, F32, seed=3)
    kw = kwargs(True, "elu", True, eps=0.5)
    got, (_, _, den) = run_kernels(q, k, v, go, kw)
    check_against_reference(got, q, k, v, go, kw)
    # den is the raw normalizer φ(q_i)·Σ_{j<=i} φ(k_j) (without eps), saved for the backward
    pq, pk = (feature_map_reference(t.to(F64), "elu") for t in (q, k))
    expected = (pq * pk.cumsum(2)).sum(-1)
    assert_close(den, expected, dtype=F32, name="den")
    assert (den.to(F64) - expected).abs().max() < 0.1  # an eps of 0.5 would show


@pytest.mark.parametrize("chunk, config, d, dv", [
    (16, cfg(32, 16), 80, 40),  # several D- and Dv-blocks, padded on both
    (32, cfg(16, 32), 20, 72),
    (128, cfg(64, 64), 64, 64),  # one chunk covers N
])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_chunks_and_blocks(chunk, config, d, dv, causal):
    n = 90 if chunk > 16 else 41
    q, k, v, go = make_inputs(1, 1, n, n, d, dv, F32, seed=chunk + d)
    kw = kwargs(causal, "elu", True)
    got, _ = run_kernels(q, k, v, go, kw, chunk=chunk, config=config)
    check_against_reference(got, q, k, v, go, kw)


def test_chunk_size_does_not_change_the_result():
    q, k, v, go = make_inputs(1, 2, 100, 100, 32, 32, F32, seed=4)
    kw = kwargs(True, "relu", False, scale=0.01)
    first, _ = run_kernels(q, k, v, go, kw, chunk=16)
    second, _ = run_kernels(q, k, v, go, kw, chunk=64)
    for a, b, name in zip(first, second, NAMES):
        assert_close(a, b.to(F64), dtype=F32, grad=name != "out", name=name)


def test_non_contiguous_inputs():
    # [B, N, H, D] storage viewed as [B, H, N, D]; every other column of v; a transposed g.
    b, h, n, d = 2, 2, 53, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, n, h, d, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(b, n, h, d, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(b, n, h, 2 * 24, generator=g).to(DEVICE).transpose(1, 2)[..., ::2]
    go = torch.randn(b, h, 24, n, generator=g).to(DEVICE).transpose(2, 3)
    assert not any(t.is_contiguous() for t in (q, k, v, go))
    for causal in (True, False):
        kw = kwargs(causal, "elu", True)
        got, _ = run_kernels(q, k, v, go, kw, chunk=32)
        check_against_reference(got, q, k, v, go, kw)


def test_backward_recomputes_out_and_den_when_not_given():
    q, k, v, go = make_inputs(1, 2, 40, 40, 16, 16, F32, seed=6)
    kw = kwargs(True, "elu", True)
    given, _ = run_kernels(q, k, v, go, kw, chunk=16)
    recomputed = triton_linear.linear_bwd(go, q, k, v, **kw, chunk=16)
    for a, b in zip(given[1:], recomputed):
        assert torch.equal(a, b)


def test_eps_and_scale_are_used():
    q, k, v, go = make_inputs(1, 1, 30, 30, 16, 16, F32, seed=8)
    base = triton_linear.linear_fwd(q, k, v, **kwargs(True, "relu", True))[0]
    big_eps = triton_linear.linear_fwd(q, k, v, **kwargs(True, "relu", True, eps=10.0))[0]
    assert (base - big_eps).abs().max() > 1e-2
    kw = kwargs(True, "relu", True, eps=10.0)
    check_against_reference(run_kernels(q, k, v, go, kw)[0], q, k, v, go, kw)
    # scale is ignored with normalize and multiplies the output without it
    scaled = triton_linear.linear_fwd(q, k, v, **kwargs(True, "relu", True, scale=5.0))[0]
    assert torch.equal(base, scaled)
    one = triton_linear.linear_fwd(q, k, v, **kwargs(True, "relu", False, scale=1.0))[0]
    three = triton_linear.linear_fwd(q, k, v, **kwargs(True, "relu", False, scale=3.0))[0]
    torch.testing.assert_close(three, 3.0 * one, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# recurrent state: initial state in, final state out, gradients of both
# ----------------------------------------------------------------------------------------------


def make_state(b, h, d, dv, seed, positive):
    g = torch.Generator().manual_seed(seed)
    s0 = torch.randn(b, h, d, dv, generator=g)
    z0 = torch.rand(b, h, d, generator=g) * 5.0 + (1.0 if positive else -2.5)
    gs = torch.randn(b, h, d, dv, generator=g)
    gz = torch.randn(b, h, d, generator=g)
    return [t.to(DEVICE) for t in (s0, z0, gs, gz)]


@pytest.mark.parametrize("causal, normalize, feature_map", [
    (True, True, "elu"), (True, False, "identity"), (False, True, "relu"),
    (False, False, "elu"),
])
def test_initial_state_final_state_and_their_gradients(causal, normalize, feature_map):
    n, m = (75, 75) if causal else (50, 75)
    q, k, v, go = make_inputs(1, 2, n, m, 16, 24, F32, seed=9)
    s0, z0, gs, gz = make_state(1, 2, 16, 24, seed=10, positive=True)
    gden = torch.randn(1, 2, n, generator=torch.Generator().manual_seed(17)).to(DEVICE) * 0.1
    kw = kwargs(causal, feature_map, normalize, scale=0.3)
    out, s, z, den = triton_linear.linear_fwd(q, k, v, **kw, initial_state=(s0, z0), chunk=32)
    grads = triton_linear.linear_bwd(go, q, k, v, **kw, initial_state=(s0, z0), grad_S=gs,
                                     grad_z=gz, grad_den=gden, out=out, den=den, chunk=32)
    assert len(grads) == 5 and grads[3].dtype == grads[4].dtype == F32

    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, s0, z0)]
    ref = state_reference(*leaves, **kw)
    torch.autograd.backward(ref, [go.to(F64), gs.to(F64), gz.to(F64), gden.to(F64)])
    for x, r, name in zip((out, s, z, den), ref, ("out", "S_final", "z_final", "den")):
        assert_close(x, r, dtype=F32, name=name)
    for x, leaf, name in zip(grads, leaves, ("dq", "dk", "dv", "dS0", "dz0")):
        assert_close(x, leaf.grad, dtype=F32, grad=True, name=name)


def test_state_reference_agrees_with_the_reference():
    # The recurrent-form ground truth is itself checked against the quadratic reference.
    q, k, v, _ = make_inputs(1, 2, 20, 20, 8, 8, F64, seed=11)
    zero_s, zero_z = torch.zeros(1, 2, 8, 8, dtype=F64), torch.zeros(1, 2, 8, dtype=F64)
    for causal in (True, False):
        kw = kwargs(causal, "elu", True)
        torch.testing.assert_close(state_reference(q, k, v, zero_s, zero_z, **kw)[0],
                                   linear_attention_reference(q, k, v, **kw))
        # and its grad_den path is that of the normalizer written out
        qq = q.clone().requires_grad_()
        den = state_reference(qq, k, v, zero_s, zero_z, **kw)[3]
        den.sum().backward()
        pk = feature_map_reference(k, "elu")
        zs = pk.cumsum(2) if causal else pk.sum(2, keepdim=True).expand_as(pk)
        dphi = torch.where(q > 0, 1.0, torch.exp(q.clamp(max=0))).to(F64)
        torch.testing.assert_close(qq.grad, zs * dphi)


@pytest.mark.parametrize("normalize", [True, False])
def test_prompt_in_two_parts_equals_one_call(normalize):
    # Causal: the state after the first 70 positions, fed to a call on the next 33, gives the
    # same outputs and final state as one call on all 103 (the basis of prompt + generation).
    q, k, v, _ = make_inputs(1, 2, 103, 103, 16, 16, F32, seed=12)
    kw = kwargs(True, "elu", normalize, scale=0.1)
    whole, s_whole, z_whole, _ = triton_linear.linear_fwd(q, k, v, **kw)
    cut = 70
    first, s1, z1, _ = triton_linear.linear_fwd(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], **kw)
    second, s2, z2, _ = triton_linear.linear_fwd(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:],
                                                 **kw, initial_state=(s1, z1))
    scale_of = whole.abs().max().item()
    assert (torch.cat([first, second], 2) - whole).abs().max() <= 2e-6 * scale_of
    assert (s2 - s_whole).abs().max() <= 2e-6 * s_whole.abs().max()
    assert (z2 - z_whole).abs().max() <= 2e-6 * z_whole.abs().max()


def test_grad_of_final_state_alone():
    # Only the final state is used downstream: grad_out None (zero), the gradients come from grad_S
    # and grad_z alone (dq = 0 exactly: the output does not depend on q through the state).
    q, k, v, go = make_inputs(1, 1, 40, 40, 16, 16, F32, seed=13)
    _, _, gs, gz = make_state(1, 1, 16, 16, seed=14, positive=True)
    kw = kwargs(True, "elu", False)
    dq, dk, dv = triton_linear.linear_bwd(None, q, k, v, **kw, grad_S=gs, grad_z=gz)
    assert torch.all(dq == 0)
    leaves = [t.detach().to(F64).requires_grad_() for t in (k, v)]
    pk = feature_map_reference(leaves[0], "elu")
    s_final = (pk[..., :, None] * leaves[1][..., None, :]).sum(2)
    loss = (s_final * gs.to(F64)).sum() + (pk.sum(2) * gz.to(F64)).sum()
    loss.backward()
    assert_close(dk, leaves[0].grad, dtype=F32, grad=True, name="dk")
    assert_close(dv, leaves[1].grad, dtype=F32, grad=True, name="dv")


# ----------------------------------------------------------------------------------------------
# float16 range: states and 1/den outside float16's range
# ----------------------------------------------------------------------------------------------


def test_float16_state_beyond_float16_range():
    # φ(k)·v sums to ~1e5 (> 65504, float16's largest) while the normalized output stays ~300:
    # the state must not be rounded to float16.  The reference in float16 overflows here (its
    # error is inf), so the bounds are float16's own precision instead: 2e-3 relative for out
    # and dv.  dq and dk are differences of two large terms (g·v_j - g·out_i with v ≈ 300 ± 1)
    # and, as in FlashAttention, δ_i = g_i·out_i is formed from the stored float16 out: their
    # error is bounded by 2e-3 of the size of those terms, not of the result.
    b, h, n, d = 1, 1, 40, 16
    g = torch.Generator().manual_seed(15)
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, h, n, d, generator=g) * 0.1 + 20.0
    v = torch.randn(b, h, n, d, generator=g) + 300.0
    q, k, v = (t.to(F16).to(DEVICE) for t in (q, k, v))
    go = torch.ones(b, h, n, d, dtype=F16, device=DEVICE)
    for causal in (False, True):
        kw = kwargs(causal, "elu", True)
        got, (s, _, _) = run_kernels(q, k, v, go, kw, chunk=16)
        assert s.abs().max() > 65504
        ref = reference(q, k, v, go, kw)
        pq, pk = (feature_map_reference(t.to(F64).cpu(), "elu") for t in (q, k))
        z = pk.cumsum(2) if causal else pk.sum(2, keepdim=True).expand_as(pk)
        r = 1.0 / ((pq * z).sum(-1) + 1e-6)  # [B, H, N]
        delta_abs = (go.to(F64).cpu() * ref[0].cpu()).abs().sum(-1)
        term = {"out": ref[0].abs().max().item(), "dv": ref[3].abs().max().item(),
                "dq": (r * delta_abs * z.amax(-1)).max().item(),
                "dk": (r * delta_abs * pq.amax(-1)).sum().item()}
        for x, rx, name in zip(got, ref, NAMES):
            err = max_err(x, rx, name)
            assert err <= 2e-3 * term[name], f"{name}: {err:.3e} > 2e-3 * {term[name]:.3e}"


# ----------------------------------------------------------------------------------------------
# configs, empty inputs, errors
# ----------------------------------------------------------------------------------------------


def test_config_lists_and_clamping():
    for kind in ("state", "chunk"):
        configs = triton_linear.configs_for(kind, 128, 128)
        assert configs and all(isinstance(c, triton.Config) for c in configs)
        assert len(configs) == len(triton_linear._CONFIG_LISTS[kind])  # none clamped away
        for c in configs:  # tl.dot needs >= 16 along every dimension on GPUs
            assert c.kwargs["BLOCK_K"] >= 16 and c.kwargs["BLOCK_V"] >= 16
        small = triton_linear.configs_for(kind, 20, 16)
        # clamped to the padded head dims, but never under MIN_BLOCK = 32: 16-wide tiles gave
        # wrong bfloat16 results / an illegal address on an H100 (D = 16), 32-wide ones passed
        assert triton_linear.MIN_BLOCK == 32
        assert all(c.kwargs["BLOCK_K"] == 32 and c.kwargs["BLOCK_V"] == 32 for c in small)
        assert len(small) < len(configs)  # duplicates after clamping are dropped


def test_gpu_launches_use_a_fixed_config_unless_autotuning_is_asked_for():
    # Issue 10: autotuned bfloat16 backwards made illegal memory accesses on an H100 while every
    # single forced config ran clean; autotuning is opt-in (ATTNKIT_LINEAR_AUTOTUNE=1).
    assert triton_linear.AUTOTUNE == (os.environ.get("ATTNKIT_LINEAR_AUTOTUNE") == "1")
    # float16 runs float32's config (3xTF32 state products; with 64 x 64 / 8 warps its causal
    # dq / dk were ~100x off on an H100)
    for dtype, block in ((torch.float32, 32), (torch.float16, 32), (torch.bfloat16, 64)):
        c = triton_linear.default_config(dtype)
        assert (c.kwargs["BLOCK_K"], c.kwargs["BLOCK_V"]) == (block, block)
        assert any(c.kwargs == l.kwargs and c.num_warps == l.num_warps
                   for l in triton_linear.STATE_CONFIGS)  # one of the searched configs
    # the config seen faulting alone on the H100 is out of both lists
    assert all((c.kwargs["BLOCK_K"], c.kwargs["BLOCK_V"], c.num_warps, c.num_stages) != (32, 64, 4, 2)
               for c in triton_linear.STATE_CONFIGS + triton_linear.CHUNK_CONFIGS)


# Every block shape of both lists (warps / stages mean nothing to the interpreter).
BLOCKS = sorted({(c.kwargs["BLOCK_K"], c.kwargs["BLOCK_V"])
                 for c in triton_linear.STATE_CONFIGS + triton_linear.CHUNK_CONFIGS})


@pytest.mark.parametrize("bk, bv", BLOCKS)
def test_every_block_shape(bk, bv):
    # D = Dv = 128: every block shape tiles them (several blocks for the narrow ones).
    q, k, v, go = make_inputs(1, 1, 70, 70, 128, 128, F32, seed=bk + bv)
    kw = kwargs(bk <= bv, "elu", True)
    got, _ = run_kernels(q, k, v, go, kw, config=cfg(bk, bv))
    check_against_reference(got, q, k, v, go, kw)


@pytest.mark.parametrize("causal, n, m", [(False, 0, 5), (False, 5, 0), (True, 0, 0),
                                          (False, 0, 0)])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
def test_empty_sequences(causal, n, m, with_state):
    b, h, d, dv = 2, 2, 16, 24
    q, k, v, go = make_inputs(b, h, n, m, d, dv, F32)
    s0, z0, gs, gz = make_state(b, h, d, dv, seed=16, positive=True)
    state = (s0, z0) if with_state else None
    for eps in (1e-6, 0.0):
        kw = kwargs(causal, "elu", True, eps=eps)
        out, s, z, den = triton_linear.linear_fwd(q, k, v, **kw, initial_state=state)
        assert out.shape == (b, h, n, dv) and s.shape == (b, h, d, dv) and z.shape == (b, h, d)
        grads = triton_linear.linear_bwd(go, q, k, v, **kw, initial_state=state, grad_S=gs,
                                         grad_z=gz, out=out, den=den)
        assert [t.shape for t in grads[:3]] == [q.shape, k.shape, v.shape]
        for t in (out, s, z, *grads):
            assert not torch.isnan(t).any()
        leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, s0, z0)]
        if not with_state:
            leaves[3] = torch.zeros(b, h, d, dv, dtype=F64)
            leaves[4] = torch.zeros(b, h, d, dtype=F64)
        ref = state_reference(*leaves, **kw)[:3]
        if m == 0 and not with_state:
            assert torch.all(out == 0)  # no keys: zeros whatever eps (0 / 0 otherwise)
        else:
            assert_close(out, ref[0], dtype=F32, name="out")
        assert_close(s, ref[1], dtype=F32, name="S_final")
        assert_close(z, ref[2], dtype=F32, name="z_final")
        if with_state:  # dS0 = grad_S + (nothing from the empty sums)
            torch.autograd.backward([t for t in ref if t.requires_grad],
                                    [go.to(F64), gs.to(F64), gz.to(F64)])
            assert_close(grads[3], leaves[3].grad, dtype=F32, grad=True, name="dS0")
            assert_close(grads[4], leaves[4].grad, dtype=F32, grad=True, name="dz0")
        if m == 0 and n > 0:
            assert torch.all(grads[0] == 0) or with_state


def test_empty_batch():
    q, k, v, go = make_inputs(0, 2, 5, 5, 16, 16, F32)
    out, s, z, den = triton_linear.linear_fwd(q, k, v, **kwargs(True, "elu", True))
    assert out.shape == (0, 2, 5, 16) and s.shape == (0, 2, 16, 16) and den.shape == (0, 2, 5)
    grads = triton_linear.linear_bwd(go, q, k, v, **kwargs(True, "elu", True))
    assert [t.shape for t in grads] == [q.shape, k.shape, v.shape]


def _small(dtype=F32, n=3, m=3, d=16, dv=16):
    return make_inputs(1, 2, n, m, d, dv, dtype)[:3]


@pytest.mark.parametrize("inputs, extra, exc, match", [
    (lambda: _small(F64), {}, TypeError, r"float16, bfloat16 or float32; got torch.float64"),
    (lambda: [t[0] for t in _small()], {}, ValueError, r"q must be 4-D"),
    (lambda: _small(m=4), {"causal": True}, ValueError, r"causal needs M == N; got N=3, M=4"),
    (lambda: (lambda q, k, v: (q, k[..., :8], v))(*_small()), {}, ValueError,
     r"k head dim must equal q's \(16\); got 8"),
    (lambda: (lambda q, k, v: (q, k, v[:, :, :2]))(*_small()), {}, ValueError,
     r"k and v must have the same length; got 3 and 2"),
    (lambda: (lambda q, k, v: (q, k, v.half()))(*_small()), {}, TypeError,
     r"q, k, v must share a dtype"),
    (lambda: _small(), {"feature_map": "softplus"}, ValueError,
     r"feature_map must be one of 'elu', 'relu', 'identity'; got 'softplus'"),
    (lambda: _small(), {"chunk": 48}, ValueError, r"chunk must be 16, 32, 64 or 128; got 48"),
    (lambda: _small(), {"initial_state": torch.zeros(1)}, TypeError,
     r"initial_state must be a pair"),
    (lambda: _small(), {"initial_state": (torch.zeros(1, 2, 16, 15), torch.zeros(1, 2, 16))},
     ValueError,
     r"initial_state\[0\] \(S\) must have shape \[1, 2, 16, 16\]; got \[1, 2, 16, 15\]"),
])
def test_launcher_errors(inputs, extra, exc, match):
    q, k, v = inputs()
    kw = kwargs(False, "elu", True)
    kw.update({key: (tuple(t.to(DEVICE) for t in val) if isinstance(val, tuple)
                     else val.to(DEVICE) if torch.is_tensor(val) else val)
               for key, val in extra.items()})
    with pytest.raises(exc, match=match):
        triton_linear.linear_fwd(q, k, v, **kw)


def test_backward_errors():
    q, k, v = _small()
    kw = kwargs(False, "elu", True)
    with pytest.raises(ValueError, match=r"grad_out must have shape \[1, 2, 3, 16\]"):
        triton_linear.linear_bwd(torch.zeros(1, 2, 3, 8, device=DEVICE), q, k, v, **kw)
    with pytest.raises(ValueError, match=r"grad_S must have shape \[1, 2, 16, 16\]"):
        triton_linear.linear_bwd(torch.zeros(1, 2, 3, 16, device=DEVICE), q, k, v, **kw,
                                 grad_S=torch.zeros(2, 16, 16, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# GPU: bfloat16 (its small cases run interpreted too), large shapes, the autotuned path
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("feature_map, causal, normalize", COMBOS, ids=IDS)
def test_gpu_large_autotuned(dtype, feature_map, causal, normalize):
    n, m = (1000, 1000) if causal else (700, 1000)
    q, k, v, go = make_inputs(2, 4, n, m, 64, 96, dtype, seed=21,
                              positive=feature_map == "identity" and normalize)
    kw = kwargs(causal, feature_map, normalize, scale=1.0 / m)
    got, _ = run_kernels(q, k, v, go, kw)
    check_against_reference(got, q, k, v, go, kw)


@TRITON_BF16_TEST
@pytest.mark.parametrize("n, d", [(1, 16), (7, 32), (100, 64)])
def test_bf16_small_sizes(n, d):
    # test_gpu_sizes_bf16's small cases, on CPU under the fixed interpreter (tests/conftest.py)
    check_sizes_bf16(n, d)


def check_sizes_bf16(n, d):
    q, k, v, go = make_inputs(1, 2, n, n, d, d + 16, BF16, seed=n + d)
    kw = kwargs(True, "elu", True)
    got, _ = run_kernels(q, k, v, go, kw)
    check_against_reference(got, q, k, v, go, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 100, 513, 2049])
@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_gpu_sizes_bf16(n, d):
    check_sizes_bf16(n, d)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_float32_large(causal):
    q, k, v, go = make_inputs(1, 4, 2049, 2049, 128, 64, F32, seed=22)
    kw = kwargs(causal, "elu", True)
    got, _ = run_kernels(q, k, v, go, kw)
    check_against_reference(got, q, k, v, go, kw)


_LINEAR_EVERY = [(kind, i) for kind in ("chunk", "state")
                 for i in range(len(triton_linear.configs_for(kind, 128, 128)))]


@pytest.mark.gpu
@pytest.mark.parametrize("kind, index", _LINEAR_EVERY, ids=[f"{k}-{i}" for k, i in _LINEAR_EVERY])
def test_gpu_every_config_bf16(kind, index):
    # one test per config: they compile on separate workers (issue 26)
    q, k, v, go = make_inputs(1, 2, 1000, 1000, 128, 128, BF16, seed=23)
    kw = kwargs(True, "relu", True)
    config = triton_linear.configs_for(kind, 128, 128)[index]
    got, _ = run_kernels(q, k, v, go, kw, config=config)
    check_against_reference(got, q, k, v, go, kw)


@pytest.mark.gpu
def test_gpu_bf16_initial_state():
    q, k, v, go = make_inputs(1, 2, 300, 300, 64, 64, BF16, seed=24)
    s0, z0, gs, gz = make_state(1, 2, 64, 64, seed=25, positive=True)
    kw = kwargs(True, "elu", True)
    out, s, z, den = triton_linear.linear_fwd(q, k, v, **kw, initial_state=(s0, z0))
    grads = triton_linear.linear_bwd(go, q, k, v, **kw, initial_state=(s0, z0), grad_S=gs,
                                     grad_z=gz, out=out, den=den)
    leaves64 = [t.detach().to(F64).requires_grad_() for t in (q, k, v, s0, z0)]
    ref64 = state_reference(*leaves64, **kw)[:3]
    torch.autograd.backward(ref64, [go.to(F64), gs.to(F64), gz.to(F64)])
    # the "reference in bfloat16": the same formulation run entirely in bfloat16
    low = [t.detach().to(BF16).requires_grad_() for t in (q, k, v, s0, z0)]
    ref_low = state_reference(*low, **kw)[:3]
    torch.autograd.backward(ref_low, [go, gs.to(BF16), gz.to(BF16)])
    assert_close(out, ref64[0], ref_low[0], dtype=BF16, name="out")
    for x, leaf64, leaf_low, name in zip(grads, leaves64, low, ("dq", "dk", "dv", "dS0", "dz0")):
        assert_close(x, leaf64.grad, leaf_low.grad, dtype=BF16, grad=True, name=name)

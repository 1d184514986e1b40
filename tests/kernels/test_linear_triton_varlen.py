"""The Triton linear-attention kernels over packed sequences in one launch per kernel (issue 28):
``linear_varlen_fwd`` / ``linear_varlen_bwd`` (kernels/linear.py, VARLEN) and the path of
``attnkit.linear_attention_varlen`` that takes them (pytorch_ext/ops/linear_varlen_triton.py).

Ground truth: the float64 reference run one sequence at a time (a loop over the offsets); the
final states against their float64 sums.  Each sequence's arithmetic in the packed launch is
that of the dense launch on that sequence alone (the same chunks from its first row, the same
tiles), so everything is also checked bit for bit against ``linear_fwd`` / ``linear_bwd`` per
sequence -- except, in float16 / bfloat16, a sequence of one token, which the dense launch runs
on float32 operands (linear_fwd's one-token rule; the pack's operands are the dtype's).
Without a GPU these run under the Triton interpreter (tests/conftest.py): small packs, one tile
config each.
"""
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

import attnkit  # noqa: E402
from attnkit.kernels import linear as triton_linear  # noqa: E402
from attnkit.reference.linear import feature_map_reference, linear_attention_reference  # noqa: E402
from attnkit_testing import TRITON_BF16_TEST  # noqa: E402

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = triton.Config({"BLOCK_K": 32, "BLOCK_V": 32}, num_warps=4, num_stages=2)
CHUNK = 16
# Odd lengths, 0 and 1, one of exactly a chunk, several over more than one chunk (70: five).
LENGTHS = [5, 0, 1, 19, 16, 3, 70]


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device=DEVICE)


def _pack(lengths, h, d, dv, dtype, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, h, d, generator=g) for _ in range(2))
    v, go = (torch.randn(total, h, dv, generator=g) for _ in range(2))
    if positive:  # identity + normalize: keep the normalizer away from 0 (test_linear_triton.py)
        q, k = 0.5 * q + 1.0, 0.5 * k + 1.0
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, go)]


def _kwargs(causal, feature_map, normalize):
    return dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=1e-6, scale=0.5)


def _sequences(cu):
    c = cu.tolist()
    return [(c[i], c[i + 1]) for i in range(len(c) - 1)]


def _loop(q, k, v, go, cu, kw, dtype=F64):
    """(out, dq, dk, dv) packed [total, H, *], S_final [batch, H, D, Dv], z_final [batch, H, D]
    from linear_attention_reference run per sequence in ``dtype``."""
    results = {name: [] for name in ("out", "dq", "dk", "dv")}
    states, sums, magnitudes = [], [], []
    for a, b in _sequences(cu):
        leaves = [x[a:b].transpose(0, 1).unsqueeze(0).to(dtype).requires_grad_() for x in (q, k, v)]
        out = linear_attention_reference(*leaves, **kw)
        out.backward(go[a:b].transpose(0, 1).unsqueeze(0).to(dtype))
        for name, t in zip(results, (out.detach(), *(x.grad for x in leaves))):
            results[name].append(t[0].transpose(0, 1))
        phik = feature_map_reference(leaves[1].detach()[0].to(F64), kw["feature_map"])  # [H, n, D]
        states.append(phik.transpose(1, 2) @ leaves[2].detach()[0].to(F64))
        magnitudes.append(phik.abs().transpose(1, 2) @ leaves[2].detach()[0].to(F64).abs())
        sums.append(phik.sum(1))
    _loop.state_magnitudes = torch.stack(magnitudes)  # Σ_j |φ(k_j)| |v_j|ᵀ per sequence
    return {name: torch.cat(parts) for name, parts in results.items()}, torch.stack(states), torch.stack(sums)


def _assert_close(got, ref64, ref_low, name, grad):
    """tests/kernels/test_linear_triton.py's rule: float32 within 2e-5 (gradients 1e-4) of the
    largest reference magnitude; float16 / bfloat16 within 2x the error of the reference run in
    that dtype, plus 1e-3."""
    assert got.shape == ref64.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite result"
    err = (got.to(F64) - ref64).abs().max().item() if got.numel() else 0.0
    if got.dtype == F32:
        tol = (1e-4 if grad else 2e-5) * (ref64.abs().max().item() if ref64.numel() else 0.0)
    else:
        tol = 2.0 * ((ref_low.to(F64) - ref64).abs().max().item() if ref_low.numel() else 0.0) + 1e-3
    assert err <= tol, f"{name} ({got.dtype}): max error {err:.3e} > tolerance {tol:.3e}"


def _run(q, k, v, go, cu, kw, config=CFG):
    longest = max(b - a for a, b in _sequences(cu)) if cu.numel() > 1 else 0
    out, s, z, den = triton_linear.linear_varlen_fwd(q, k, v, cu, longest, **kw, chunk=CHUNK, config=config)
    grads = triton_linear.linear_varlen_bwd(go, q, k, v, cu, longest, **kw, out=out, den=den, chunk=CHUNK,
                                            config=config)
    return out, s, z, den, grads


def _cases():
    """Every feature map x causal x normalize in float32; in float16 / bfloat16 elu and
    identity (relu's φ is float32 code, the same in every dtype)."""
    for dtype, fm, causal, normalize in itertools.product((F32, F16, BF16), ("elu", "relu", "identity"),
                                                          (True, False), (True, False)):
        if dtype != F32 and fm == "relu":
            continue
        name = f"{str(dtype)[6:]}-{fm}-{'causal' if causal else 'full'}-{'norm' if normalize else 'scale'}"
        yield pytest.param(fm, causal, normalize, dtype, id=name, marks=[TRITON_BF16_TEST] if dtype == BF16 else [])


@pytest.mark.parametrize("feature_map, causal, normalize, dtype", list(_cases()))
def test_launchers_match_the_float64_loop(feature_map, causal, normalize, dtype):
    q, k, v, go = _pack(LENGTHS, 2, 24, 40, dtype, seed=3 + causal,
                        positive=feature_map == "identity" and normalize)
    kw = _kwargs(causal, feature_map, normalize)
    out, s, z, den, (dq, dk, dv) = _run(q, k, v, go, _cu(LENGTHS), kw)
    ref, s64, z64 = _loop(q, k, v, go, _cu(LENGTHS), kw)
    low = _loop(q, k, v, go, _cu(LENGTHS), kw, dtype=dtype)[0] if dtype != F32 else ref
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.dtype == dtype and got.shape == ref[name].shape, name
        _assert_close(got, ref[name], low[name], name, grad=name != "out")
    # The final states: float32 sums, the float32 rule on their size; in float16 / bfloat16 the
    # kernel rounds φ(k) to the dtype before the product φ(k)ᵀ V (a tensor-core operand), so S
    # also carries up to one unit roundoff of each term: u Σ_j |φ(k_j)| |v_j|ᵀ, entry by entry.
    unit = 0.0 if dtype == F32 else torch.finfo(dtype).eps / 2
    for name, got, want, terms in (("S_final", s, s64, _loop.state_magnitudes), ("z_final", z, z64, 0.0)):
        assert got.dtype == F32 and got.shape == want.shape, name
        excess = (got.to(F64) - want).abs() - unit * terms - 1e-4 * want.abs().max().item() - 1e-6
        assert excess.max().item() <= 0, f"{name}: {excess.max().item():.3e} past the rule"
    assert den.shape == (2, sum(LENGTHS)) and den.dtype == F32


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_one_launch_gives_the_per_sequence_launches_bits(causal, dtype):
    kw = _kwargs(causal, "elu", True)
    q, k, v, go = _pack(LENGTHS, 2, 20, 36, dtype, seed=7)
    cu = _cu(LENGTHS)
    out, s, z, den, grads = _run(q, k, v, go, cu, kw)
    for i, (a, b) in enumerate(_sequences(cu)):
        if dtype != F32 and b - a == 1:
            continue  # linear_fwd's one-token rule (module docstring)
        as_batch = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v, go)]
        o1, s1, z1, d1 = triton_linear.linear_fwd(*as_batch[:3], **kw, chunk=CHUNK, config=CFG)
        g1 = triton_linear.linear_bwd(as_batch[3], *as_batch[:3], **kw, out=o1, den=d1, chunk=CHUNK, config=CFG)
        pairs = [("out", out[a:b], o1), ("S", s[i], s1[0]), ("z", z[i], z1[0]), ("den", den[:, a:b], d1[0])]
        pairs += [(name, g[a:b], g1j) for name, g, g1j in zip(("dq", "dk", "dv"), grads, g1)]
        for name, packed, alone in pairs:
            if name in ("out", "dq", "dk", "dv"):
                alone = alone[0].transpose(0, 1)
            assert torch.equal(packed, alone), f"sequence {i} (length {b - a}): {name} differs"


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "scale"])
def test_states_give_the_per_sequence_launches_bits(normalize):
    # An initial state per sequence in, the final states' gradients back: each sequence's out, S,
    # z, den and dq, dk, dv, dS0, dz0 are the dense launchers' on it alone, bit for bit (an empty
    # sequence's: S = S0, dS0 = grad_S).
    kw = _kwargs(True, "elu", normalize)
    q, k, v, go = _pack(LENGTHS, 2, 20, 36, F32, seed=13)
    g = torch.Generator().manual_seed(3)
    batch = len(LENGTHS)
    s0, gs = (torch.randn(batch, 2, 20, 36, generator=g).to(DEVICE) for _ in range(2))
    z0, gz = torch.rand(batch, 2, 20, generator=g).to(DEVICE) + 1, torch.randn(batch, 2, 20, generator=g).to(DEVICE)
    cu = _cu(LENGTHS)
    out, s, z, den = triton_linear.linear_varlen_fwd(q, k, v, cu, max(LENGTHS), **kw, initial_state=(s0, z0),
                                                     chunk=CHUNK, config=CFG)
    grads = triton_linear.linear_varlen_bwd(go, q, k, v, cu, max(LENGTHS), **kw, initial_state=(s0, z0), grad_S=gs,
                                            grad_z=gz, out=out, den=den, chunk=CHUNK, config=CFG)
    assert len(grads) == 5
    for i, (a, b) in enumerate(_sequences(cu)):
        one = dict(initial_state=(s0[i:i + 1], z0[i:i + 1]), chunk=CHUNK, config=CFG)
        as_batch = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v, go)]
        o1, s1, z1, d1 = triton_linear.linear_fwd(*as_batch[:3], **kw, **one)
        g1 = triton_linear.linear_bwd(as_batch[3], *as_batch[:3], **kw, **one, grad_S=gs[i:i + 1],
                                      grad_z=gz[i:i + 1], out=o1, den=d1)
        pairs = [("out", out[a:b], o1[0].transpose(0, 1)), ("S", s[i], s1[0]), ("z", z[i], z1[0]),
                 ("den", den[:, a:b], d1[0])]
        pairs += [(name, grads[j][a:b], g1[j][0].transpose(0, 1)) for j, name in enumerate(("dq", "dk", "dv"))]
        pairs += [("dS0", grads[3][i], g1[3][0]), ("dz0", grads[4][i], g1[4][0])]
        for name, packed, alone in pairs:
            assert torch.equal(packed, alone), f"sequence {i} (length {b - a}): {name} differs"


def test_double_backward_with_states():
    q, k, v, go, cu = _public(lengths=[3, 0, 6, 1])
    s0 = torch.randn(4, 2, 12, 8, device=DEVICE, requires_grad=True)
    z0 = (torch.rand(4, 2, 12, device=DEVICE) + 1).requires_grad_()
    results = []
    for backend in ("triton", "reference"):
        out, (S, z) = attnkit.linear_attention_varlen(q, k, v, cu, causal=True, initial_state=(s0, z0),
                                                      return_state=True, backend=backend)
        (dq,) = torch.autograd.grad((out * go).sum() + S.square().sum(), q, create_graph=True)
        results.append(torch.autograd.grad(dq.square().sum() + z.sum(), (q, k, v, s0, z0)))
    for got, want in zip(*results):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def _public(dtype=F32, causal=True, requires_grad=True, lengths=LENGTHS):
    q, k, v, go = _pack(lengths, 2, 12, 8, dtype, seed=11)
    q, k, v = (x.requires_grad_(requires_grad) for x in (q, k, v))
    return q, k, v, go, _cu(lengths, torch.int64)


def test_the_public_function_takes_one_launch(monkeypatch):
    q, k, v, go, cu = _public()
    calls = []
    for name in ("linear_varlen_fwd", "linear_varlen_bwd"):
        real = getattr(triton_linear, name)
        monkeypatch.setattr(triton_linear, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr("attnkit.ops.linear_varlen.linear_attention",
                        lambda *a, **kw: pytest.fail("the grouped path ran"))
    out = attnkit.linear_attention_varlen(q, k, v, cu, causal=True, backend="triton")
    grads = torch.autograd.grad(out, (q, k, v), go)
    assert calls == ["linear_varlen_fwd", "linear_varlen_bwd"]
    kw = _kwargs(True, "elu", True) | dict(scale=1.0)
    want, _, _, den = triton_linear.linear_varlen_fwd(q.detach(), k.detach(), v.detach(), cu.int(), max(LENGTHS),
                                                      **kw)
    assert torch.equal(out, want)
    want_grads = triton_linear.linear_varlen_bwd(go, q.detach(), k.detach(), v.detach(), cu.int(), max(LENGTHS),
                                                 **kw, out=want, den=den)
    for got, w in zip(grads, want_grads):
        assert torch.equal(got, w)
    # and against the float64 reference, through the public reference backend (the grouped path)
    monkeypatch.undo()
    ref = attnkit.linear_attention_varlen(*(x.detach().to(F64) for x in (q, k, v)), cu, causal=True,
                                          backend="reference")
    assert (out.to(F64) - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()


def test_double_backward_goes_through_the_grouped_reference():
    q, k, v, go, cu = _public(lengths=[3, 0, 6, 1])
    kw = dict(causal=True, feature_map="elu", normalize=True)
    results = []
    for backend in ("triton", "reference"):
        out = attnkit.linear_attention_varlen(q, k, v, cu, backend=backend, **kw)
        (dq,) = torch.autograd.grad(out, q, go, create_graph=True)
        results.append(torch.autograd.grad(dq.square().sum(), (q, k, v)))
    for got, want in zip(*results):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_no_gradient_wanted_and_empty_packs():
    q, k, v, _, cu = _public(requires_grad=False)
    out = attnkit.linear_attention_varlen(q, k, v, cu, backend="triton")
    assert out.shape == (sum(LENGTHS), 2, 8) and not out.requires_grad
    for lengths in ([], [0, 0]):  # no sequence; sequences without rows: the grouped path's empty result
        q, k, v, _, cu = _public(lengths=lengths)
        out = attnkit.linear_attention_varlen(q, k, v, cu, backend="triton")
        assert out.shape == (0, 2, 8)
        out.sum().backward()
        assert q.grad.shape == q.shape
    # the launchers alone: an empty pack returns empty results and zero final states
    q, k, v, go = _pack([0, 0], 2, 4, 4, F32)
    out, s, z, den, grads = _run(q, k, v, go, _cu([0, 0]), _kwargs(True, "elu", True))
    assert out.shape == (0, 2, 4) and s.shape == (2, 2, 4, 4) and not s.any() and not z.any()
    assert all(g.shape == (0, 2, 4) for g in grads)


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v, cu: triton_linear.linear_varlen_fwd(q[0], k, v, cu, 3, **_kwargs(True, "elu", True)),
     ValueError, r"q must be a 3-D tensor \[total, H, \*\]"),
    (lambda q, k, v, cu: triton_linear.linear_varlen_fwd(q, k[:, :1], v, cu, 3, **_kwargs(True, "elu", True)),
     ValueError, r"must share \[total, H\]"),
    (lambda q, k, v, cu: triton_linear.linear_varlen_fwd(q, k, v, cu.float(), 3, **_kwargs(True, "elu", True)),
     ValueError, r"cu_seqlens must be a 1-D int32 / int64 tensor"),
    (lambda q, k, v, cu: triton_linear.linear_varlen_fwd(q, k, v, cu, -1, **_kwargs(True, "elu", True)),
     ValueError, r"max_seqlen must be an int >= 0; got -1"),
    (lambda q, k, v, cu: triton_linear.linear_varlen_fwd(q, k, v, cu, 3, **_kwargs(True, "tanh", True)),
     ValueError, r"feature_map must be one of"),
    (lambda q, k, v, cu: triton_linear.linear_varlen_bwd(q[:, :, :2], q, k, v, cu, 3, **_kwargs(True, "elu", True)),
     ValueError, r"grad_out must have shape"),
])
def test_launcher_errors(call, error, match):
    q, k, v, _ = _pack([3, 2], 2, 4, 4, F32)
    with pytest.raises(error, match=match):
        call(q, k, v, _cu([3, 2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_long_pack_autotuned_configs(dtype, causal):
    # the GPU's default tile config and chunk (64), sequences over many chunks and a short tail
    lengths = [1000, 1, 63, 64, 65, 0, 517]
    q, k, v, go = _pack(lengths, 4, 64, 96, dtype, seed=21)
    cu = _cu(lengths)
    kw = _kwargs(causal, "elu", True)
    out, s, z, den = triton_linear.linear_varlen_fwd(q, k, v, cu, max(lengths), **kw)
    grads = triton_linear.linear_varlen_bwd(go, q, k, v, cu, max(lengths), **kw, out=out, den=den)
    ref, _, _ = _loop(q, k, v, go, cu, kw)
    low = _loop(q, k, v, go, cu, kw, dtype=dtype)[0]
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        _assert_close(got, ref[name].to(got.device), low[name].to(got.device), name, grad=name != "out")

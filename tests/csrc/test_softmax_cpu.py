"""The C++ CPU softmax-attention ops attnkit::softmax_fwd / softmax_bwd (csrc/cpu/softmax.cpp),
called directly through torch.ops.

Ground truth: ``softmax_attention_reference`` in float64 on the same (already rounded) inputs,
gradients by torch.autograd through it.  Tolerance rule (DESIGN.md): float64 1e-10 of the
largest reference magnitude; float32 2e-5 (gradients 1e-4); float16 / bfloat16 within 2x the
error the reference itself makes when run in that dtype, plus 1e-3.

The kernel tiles 64 query rows x 256 keys in the forward and 64 x 64 in the backward, so the
sizes below (1, 7, 64, 129, 257, 1000) straddle every tile edge; head dims 80 and 96 are not
multiples of the 64-column register panels.
"""
import math

import pytest
import torch

import attnkit  # noqa: F401  (loads attnkit._C, which registers the ops)
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import has_cpu_kernel, num_threads

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16


def test_cpu_kernels_are_registered():
    # No skip when they are missing: every supported install builds attnkit._C, and a missing
    # kernel must fail here rather than hide behind skipped tests.
    assert has_cpu_kernel("softmax_fwd") and has_cpu_kernel("softmax_bwd")


def fwd(q, k, v, mask, scale, causal):
    return torch.ops.attnkit.softmax_fwd(q, k, v, mask, scale, causal)


def bwd(g, q, k, v, out, lse, mask, scale, causal):
    return torch.ops.attnkit.softmax_bwd(g, q, k, v, out, lse, mask, scale, causal)


# ----------------------------------------------------------------------------------------------
# tolerance rule
# ----------------------------------------------------------------------------------------------


def max_err(x, ref64, name):
    """max |x - ref64| over the finite entries; x must have no NaN and the same infinities."""
    x = x.detach().to(F64)
    ref64 = ref64.detach().to(F64)
    assert not torch.isnan(x).any(), f"{name}: NaN in the result"
    assert not torch.isnan(ref64).any(), f"{name}: NaN in the float64 reference"
    assert torch.equal(torch.isinf(x), torch.isinf(ref64)), f"{name}: infinities differ"
    assert torch.equal(x[torch.isinf(x)], ref64[torch.isinf(ref64)]), f"{name}: inf signs differ"
    finite = torch.isfinite(ref64)
    return (x[finite] - ref64[finite]).abs().max().item() if finite.any() else 0.0


def assert_close(x, ref64, ref_lowp=None, *, dtype, grad=False, name="out", size=None):
    """``size``: the magnitude the relative tolerance refers to (default max|ref64|)."""
    assert tuple(x.shape) == tuple(ref64.shape), f"{name}: shape {tuple(x.shape)} != {tuple(ref64.shape)}"
    err = max_err(x, ref64, name)
    finite = torch.isfinite(ref64)
    if size is None:
        size = ref64.detach()[finite].abs().max().item() if finite.any() else 0.0
    if dtype == F64:
        tol = 1e-10 * size
    elif dtype == F32:
        tol = (1e-4 if grad else 2e-5) * size
    else:
        tol = 2.0 * max_err(ref_lowp, ref64, f"{name} (reference in {dtype})") + 1e-3
    assert err <= tol, f"{name} ({dtype}): max error {err:.3e} > tolerance {tol:.3e}"


# ----------------------------------------------------------------------------------------------
# one case: forward and backward of the op against the reference
# ----------------------------------------------------------------------------------------------


def make_mask(kind, shape, n, m):
    """A mask of `shape` (broadcastable to [B, H, N, M]) or None."""
    if kind is None:
        return None
    if kind == "bool":
        return torch.rand(shape) > 0.3
    # additive: finite values plus some -inf
    mask = torch.randn(shape, dtype=F64)
    return mask.masked_fill(torch.rand(shape) < 0.2, float("-inf"))


def reference(q, k, v, mask, causal, scale, grad_out):
    """(out, lse, dq, dk, dv) of the reference in the dtype of its inputs."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    out, lse = softmax_attention_reference(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out.detach(), lse, dq, dk, dv


def check(B, H, Hk, N, M, D, Dv, dtype, *, causal=False, mask=None, mask_shape=None,
          scale=None, layout=None, mask_dtype=None, mask_layout=None):
    q = torch.randn(B, H, N, D).to(dtype)
    k = torch.randn(B, Hk, M, D).to(dtype)
    v = torch.randn(B, Hk, M, Dv).to(dtype)
    grad_out = torch.randn(B, H, N, Dv).to(dtype)
    if layout is not None:
        q, k, v, grad_out = (layout(x) for x in (q, k, v, grad_out))
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    m = make_mask(mask, mask_shape or (B, H, N, M), N, M)
    if m is not None and mask_dtype is not None:
        m = m.to(mask_dtype)
    if m is not None and mask_layout is not None:
        m = mask_layout(m)
    # The op takes the mask as a [B, H, N, M] view (stride 0 along broadcast dims).
    m_op = None if m is None else m.expand(B, H, N, M)

    out, lse = fwd(q, k, v, m_op, scale, causal)
    assert out.dtype == dtype and out.shape == (B, H, N, Dv)
    assert lse.dtype == (F64 if dtype == F64 else F32) and lse.shape == (B, H, N)
    dq, dk, dv = bwd(grad_out, q, k, v, out, lse, m_op, scale, causal)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3

    ref64 = reference(q.double(), k.double(), v.double(),
                      None if m is None else (m if m.dtype == torch.bool else m.double()),
                      causal, scale, grad_out.double())
    ref_lowp = reference(q, k, v, m, causal, scale, grad_out) if dtype in (BF16, F16) else (None,) * 5
    names = ("out", "lse", "dq", "dk", "dv")
    for name, got, want, low in zip(names, (out, lse, dq, dk, dv), ref64, ref_lowp):
        size = None
        if name in ("dq", "dk") and not want.any():
            # One visible key per row (M = 1, or causal with N = 1): dS = P o (dP - D) is exactly
            # 0 (P = 1 whatever the scores) and the kernel's is the rounding residue of dP - D;
            # measure it against the size of the terms that dq = dS K, dk = dS^T Q sum.
            other = k if name == "dq" else q
            size = abs(scale) * (grad_out.abs().max() * v.abs().max() * other.abs().max()).item()
        assert_close(got, want, low, dtype=dtype, grad=name.startswith("d"), name=name, size=size)
    return out, lse, dq, dk, dv


# (B, H, Hk, N, M, D, Dv, causal): a sample of N, M in {1, 7, 64, 129, 257}, D in {16, 64, 80,
# 96, 128, 256}, Dv != D once, GQA ratios 1, 2, 4, causal with N == M, N < M and N > M.
SHAPES = [
    (1, 1, 1, 1, 1, 16, 16, False),
    (2, 2, 2, 7, 7, 16, 16, True),
    (1, 4, 1, 64, 129, 64, 64, False),
    (1, 4, 2, 129, 64, 64, 64, True),
    (2, 2, 1, 129, 257, 80, 80, True),
    (1, 2, 2, 257, 129, 96, 96, True),
    (1, 4, 4, 64, 257, 128, 128, False),
    (1, 2, 1, 7, 129, 256, 256, True),
    (1, 2, 2, 257, 7, 80, 96, False),
    (1, 2, 1, 1, 257, 64, 64, True),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])) + ("c" if s[7] else ""))
@pytest.mark.parametrize("dtype", [F32, F64])
def test_matches_reference(shape, dtype):
    *dims, causal = shape
    check(*dims, dtype, causal=causal)


def test_long_sequence_float32():
    check(1, 2, 1, 1000, 1000, 64, 64, F32, causal=True)
    check(1, 1, 1, 1000, 1000, 64, 64, F32, mask="bool", mask_shape=(1, 1, 1000, 1000))


# (mask kind, mask shape, dtype, causal): every kind and broadcast shape causal and not, in
# float32, and a float64 sample.
MASKS = [
    ("bool", (2, 4, 129, 257)), ("bool", (1, 1, 129, 257)), ("additive", (2, 1, 129, 257)),
    ("additive", (1, 1, 1, 257)), ("bool", (2, 4, 129, 1)),
]
MASK_CASES = [(m, shape, F32, causal) for m, shape in MASKS for causal in (False, True)] + [
    ("bool", (1, 1, 129, 257), F64, True), ("additive", (2, 1, 129, 257), F64, False)]


@pytest.mark.parametrize(
    "mask,mask_shape,dtype,causal", MASK_CASES,
    ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)) if isinstance(x, tuple)
    else str(x).replace("torch.", "") if isinstance(x, torch.dtype) else ("causal" if x else "full"),
)
def test_masks(mask, mask_shape, dtype, causal):
    check(2, 4, 2, 129, 257, 64, 64, dtype, causal=causal, mask=mask, mask_shape=mask_shape)


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_mask_with_non_unit_strides(mask):
    """Masks whose key axis is not contiguous ([.., M, N] memory, and every other column)."""
    check(1, 2, 1, 64, 129, 32, 32, F32, mask=mask, mask_shape=(1, 2, 64, 129), causal=True,
          mask_layout=lambda m: m.transpose(-1, -2).contiguous().transpose(-1, -2))
    check(1, 2, 1, 64, 129, 32, 32, F32, mask=mask, mask_shape=(1, 2, 64, 258),
          mask_layout=lambda m: m[..., ::2])


@pytest.mark.parametrize("mask_dtype", [F32, BF16, F16])
def test_additive_mask_dtypes(mask_dtype):
    check(1, 2, 1, 64, 129, 32, 32, F64, mask="additive", mask_shape=(1, 1, 64, 129),
          mask_dtype=mask_dtype)


@pytest.mark.parametrize(
    "shape",
    [(1, 2, 1, 129, 257, 64, 64, True), (1, 2, 2, 64, 129, 80, 96, False),
     (1, 2, 2, 7, 7, 16, 16, True), (1, 4, 2, 257, 257, 128, 128, False)],
    ids=["gqa2-causal", "dv96", "tiny", "d128"],
)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_low_precision(shape, dtype):
    *dims, causal = shape
    check(*dims, dtype, causal=causal)


def test_low_precision_with_mask():
    check(1, 2, 1, 129, 257, 64, 64, BF16, mask="bool", mask_shape=(1, 1, 129, 257))
    check(1, 2, 1, 129, 257, 64, 64, BF16, mask="additive", mask_shape=(1, 2, 129, 257))


def test_scale():
    check(1, 2, 1, 64, 129, 64, 64, F32, scale=0.3)
    check(1, 2, 1, 64, 129, 64, 64, F64, scale=-0.05, causal=True)


@pytest.mark.parametrize(
    "layout",
    [lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),   # [B, N, H, D] memory
     lambda x: torch.cat([x, x], dim=-1)[..., ::2],                # stride 2 along D
     lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)],  # [B, H, D, N] memory
    ids=["bnhd", "strided-d", "bhdn"],
)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_non_contiguous_inputs(layout, dtype):
    check(2, 4, 2, 129, 70, 64, 64, dtype, causal=True, layout=layout)


@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_fully_masked_rows(dtype):
    B, H, N, M, D = 1, 2, 70, 300, 32
    mask = torch.rand(B, H, N, M) > 0.5
    mask[:, :, 3] = False       # fully masked rows
    mask[:, 1, 65:] = False
    q, k, v = torch.randn(B, H, N, D).to(dtype), torch.randn(B, 1, M, D).to(dtype), torch.randn(B, 1, M, D).to(dtype)
    out, lse = fwd(q, k, v, mask, 0.2, False)
    dq, dk, dv = bwd(torch.randn_like(out), q, k, v, out, lse, mask, 0.2, False)
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.isneginf(lse[:, :, 3]).all() and torch.isneginf(lse[:, 1, 65:]).all()
    assert torch.isfinite(lse[:, 0, :3]).all()
    assert torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3]))
    assert torch.equal(dq[:, 1, 65:], torch.zeros_like(dq[:, 1, 65:]))
    # Additive -inf rows and causal + mask combinations against the reference too.
    add = torch.randn(B, H, N, M, dtype=F64).masked_fill(~mask, float("-inf"))
    if dtype != BF16:
        check(B, H, 1, N, M, D, D, dtype, mask="bool", mask_shape=(B, H, N, M))
    mask_causal = torch.ones(N, M, dtype=torch.bool)
    mask_causal[:10, 0] = False  # with causality, rows 0 sees only key 0: row 0 fully masked
    o2, l2 = fwd(q, k, v, mask_causal.expand(B, H, N, M), 0.2, True)
    assert torch.isneginf(l2[:, :, 0]).all() and torch.isfinite(l2[:, :, 1:]).all()
    assert torch.equal(o2[:, :, 0], torch.zeros_like(o2[:, :, 0]))
    o3, l3 = fwd(q, k, v, add.to(dtype if dtype != F64 else F64), 0.2, False)
    assert torch.isneginf(l3[:, :, 3]).all() and not torch.isnan(o3).any()


def test_all_keys_masked_gives_zero_gradients():
    q, k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 11, 16), torch.randn(1, 2, 11, 16)
    mask = torch.zeros(1, 2, 9, 11, dtype=torch.bool)
    out, lse = fwd(q, k, v, mask, 0.25, False)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for g in bwd(torch.randn_like(out), q, k, v, out, lse, mask, 0.25, False):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("n,m", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_empty_sequences(n, m, dtype):
    q, k, v = torch.randn(2, 4, n, 16).to(dtype), torch.randn(2, 2, m, 16).to(dtype), torch.randn(2, 2, m, 24).to(dtype)
    for causal in (False, True):
        out, lse = fwd(q, k, v, None, 0.25, causal)
        assert out.shape == (2, 4, n, 24) and lse.shape == (2, 4, n)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        dq, dk, dv = bwd(torch.randn_like(out), q, k, v, out, lse, None, 0.25, causal)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for g in (dq, dk, dv):
            assert torch.equal(g, torch.zeros_like(g))


def test_empty_batch():
    q = torch.randn(0, 2, 5, 16)
    out, lse = fwd(q, q, q, None, 0.25, False)
    assert out.shape == (0, 2, 5, 16) and lse.shape == (0, 2, 5)
    assert tuple(g.shape for g in bwd(out, q, q, q, out, lse, None, 0.25, False)) == (q.shape,) * 3


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts(threads):
    """Few (batch, kv-head) pairs split the backward's key blocks over chunks with dQ partials;
    one thread runs everything in order.  Both must give the same answers."""
    with num_threads(threads):
        check(1, 2, 1, 129, 300, 64, 64, F32, causal=True)
        check(1, 1, 1, 7, 257, 16, 16, F64)


def test_validation_errors():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    with pytest.raises(RuntimeError, match="share the head dim"):
        fwd(q, torch.randn(1, 2, 9, 8), v, None, 1.0, False)
    with pytest.raises(RuntimeError, match="multiple of the key/value heads"):
        fwd(q, torch.randn(1, 3, 9, 16), torch.randn(1, 3, 9, 16), None, 1.0, False)
    with pytest.raises(RuntimeError, match="share a dtype"):
        fwd(q, k.double(), v, None, 1.0, False)
    with pytest.raises(RuntimeError, match="mask must have shape"):
        fwd(q, k, v, torch.ones(1, 1, 8, 9, dtype=torch.bool), 1.0, False)
    with pytest.raises(RuntimeError, match="mask must be bool or floating"):
        fwd(q, k, v, torch.ones(1, 4, 8, 9, dtype=torch.int32), 1.0, False)
    with pytest.raises(RuntimeError, match="expected q"):
        fwd(q[0], k, v, None, 1.0, False)
    with pytest.raises(RuntimeError, match="agree on Hk and M"):
        fwd(q, k, torch.randn(1, 2, 10, 16), None, 1.0, False)
    out, lse = fwd(q, k, v, None, 1.0, False)
    with pytest.raises(RuntimeError, match="lse must be"):
        bwd(out, q, k, v, out, lse.double(), None, 1.0, False)
    with pytest.raises(RuntimeError, match="grad_out and out must have shape"):
        bwd(out[:, :, :4], q, k, v, out, lse, None, 1.0, False)

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
from attnkit_testing import (assert_close_to_reference, finite_inputs, has_cpu_kernel, nan_spreading_matmul, num_threads,
                             without_spread_nan)

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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_bnhd_layout_is_bit_identical_to_dense(dtype, causal):
    # FlashAttention's [B, N, H, D] memory seen as [B, H, N, D]: rows H * D apart.  The float
    # kernels copy such V rows per head (forward) and such Q / dO rows once per call (backward)
    # rather than reading them in place (power-of-two strides share few L1 sets): the same values
    # through the same products, so the same bits as dense inputs.
    B, H, Hk, N, M, D, Dv = 2, 4, 2, 129, 300, 64, 48
    dense = [torch.randn(*shape, dtype=dtype) for shape in
             ((B, H, N, D), (B, Hk, M, D), (B, Hk, M, Dv), (B, H, N, Dv))]
    bnhd = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in dense]
    assert all(x.stride(2) == x.shape[1] * x.shape[3] for x in bnhd)
    results = []
    for q, k, v, g in (dense, bnhd):
        out, lse = fwd(q, k, v, None, 0.125, causal)
        results.append((out, lse, *bwd(g, q, k, v, out, lse, None, 0.125, causal)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name


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


# ----------------------------------------------------------------------------------------------
# NaN and +-inf propagate as in torch SDPA (issue 15)
# ----------------------------------------------------------------------------------------------
# The rule: a NaN in q poisons exactly that row; a NaN or +inf in k (a NaN in a float mask)
# poisons exactly the rows that can see that key (causality and a bool mask hide keys; a score
# of -inf, from q . k = -inf, is dropped like a masked one); a NaN in v reaches at least the rows
# that see it.  A poisoned row has out and lse NaN; a fully masked row stays 0 / -inf.  The
# gradients are NaN at least where SDPA's are for those rows: dq on the poisoned rows, dk and dv
# on every key a poisoned row sees.  (SDPA also spreads NaN through 0 * NaN to neighbours of the
# same tile, and through its bool -> additive mask conversion to rows that mask the key: not
# required, the rows of another kv head must stay clean.)

NAN, INF = float("nan"), float("inf")


def visibility(H, N, M, causal, bool_mask):
    """[H, N, M] bool: which keys each (head, row) sees."""
    vis = torch.ones(H, N, M, dtype=torch.bool)
    if causal:
        vis &= torch.ones(N, M, dtype=torch.bool).tril()
    if bool_mask is not None:
        vis &= bool_mask[0]
    return vis


def nan_rows(x):
    return torch.isnan(x).any(-1)


def assert_rows(got, want, name, exact=True):
    """got, want: bool [..., rows]; exact or got a superset of want."""
    if exact:
        assert torch.equal(got, want), f"{name}: NaN rows {got.nonzero().tolist()} != {want.nonzero().tolist()}"
    else:
        missing = want & ~got
        assert not missing.any(), f"{name}: rows {missing.nonzero().tolist()} should be NaN"


NAN_CASES = [("q", NAN), ("q", INF), ("k", NAN), ("k", INF), ("k", -INF), ("v", NAN),
             ("mask", NAN), ("mask", INF)]


NAN_MASK_CASES = [(w, v, m) for w, v in NAN_CASES for m in (None, "bool", "float")
                  if w != "mask" or m == "float"]


@pytest.mark.parametrize("where,val,mask_kind", NAN_MASK_CASES,
                         ids=[f"{w}-{v}-{m}" for w, v, m in NAN_MASK_CASES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16])
@pytest.mark.parametrize("N", [70, 12], ids=["flash", "decode"])
def test_nan_and_inf_propagate(where, val, mask_kind, causal, dtype, N, D=32):
    # H = 4 query heads on Hk = 2 kv heads: the poisoned kv head 0 feeds heads 0, 1 only.
    # N = 12 takes the decoding path (not for float64).  D: tests/csrc/test_cpu_gemm_path.py
    # reruns this with a D that is not a multiple of 32 (the AMX K-tail edge).
    B, H, Hk, M = 1, 4, 2, 300
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(B, H, N, D, generator=gen).to(dtype)
    k = torch.randn(B, Hk, M, D, generator=gen).to(dtype)
    v = torch.randn(B, Hk, M, D, generator=gen).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, H, N, M, generator=gen) > 0.3
        mask[:, :, 5] = False            # fully masked rows
    elif mask_kind == "float":
        mask = torch.randn(B, H, N, M, generator=gen).to(dtype)
        mask[:, :, 5] = -INF
    # Keys hidden by causality or a bool mask; an additive -inf does not hide a NaN score
    # (NaN + -inf = NaN, in SDPA too).
    vis = visibility(H, N, M, causal, mask if mask_kind == "bool" else None)
    i, j = min(40, N - 2), 7              # the poisoned query row / key
    if where == "q":
        q[0, 0, i, 5] = val
    elif where == "k":
        k[0, 0, j, 5] = val
    elif where == "v":
        v[0, 0, j, 5] = val
    else:
        mask[0, 0, i, j] = val
    scale = 1.0 / math.sqrt(D)
    if where == "v":
        poisoned = torch.zeros(H, N, dtype=torch.bool)   # rows whose out must be NaN
        poisoned[:2] = vis[:2, :, j]
        if mask_kind == "float":  # p = 0 on an additive -inf: the row need not see v[j]
            poisoned[:2] &= ~torch.isneginf(mask[0, :2, :, j])
    else:
        # A row is poisoned when a score it sees is NaN or +inf: the scores in float64 of the
        # same inputs (q . k = -inf is a dropped key).
        s = torch.einsum("hnd,hmd->hnm", q[0].double(), k[0].double().repeat_interleave(H // Hk, 0))
        s = s * scale
        if mask_kind == "float":
            s = s + mask[0].double()
        poisoned = (vis & (torch.isnan(s) | (s == INF))).any(-1)
    out, lse = fwd(q, k, v, mask, scale, causal)
    g = torch.randn(B, H, N, D, generator=gen).to(dtype)
    dq, dk, dv = bwd(g, q, k, v, out, lse, mask, scale, causal)

    # Forward: exactly the poisoned rows (v: at least those, and only in kv head 0's query heads).
    exact = where != "v"
    assert_rows(nan_rows(out)[0], poisoned, "out", exact)
    assert not nan_rows(out)[0, 2:].any(), "NaN leaked to another kv head's query heads"
    lse_nan = torch.isnan(lse[0])
    if where == "v":
        assert not lse_nan.any()
    else:
        assert torch.equal(lse_nan, poisoned), "lse NaN rows differ from out's"
    # Fully masked rows: 0 and -inf, told apart from NaN rows.
    if mask_kind is not None:
        hidden = ~vis.any(-1) if mask_kind == "bool" else torch.isneginf(mask[0]).all(-1)
        hidden &= ~poisoned
        assert hidden[2:, 5].all()
        assert torch.equal(out[0][hidden], torch.zeros_like(out[0][hidden]))
        assert torch.isneginf(lse[0][hidden]).all()
    # Finite rows agree with the float64 reference on the same inputs.
    ref_mask = None if mask is None else (mask if mask.dtype == torch.bool else mask.double())
    ref_out = softmax_attention_reference(q.double(), k.double(), v.double(), attn_mask=ref_mask,
                                          is_causal=causal, scale=scale, enable_gqa=True)
    low = None
    if dtype in (BF16, F16):  # DESIGN's rule: 2x the error of the reference run in the dtype,
        # read on the unpoisoned rows only: without the NaN that a torch matmul can spread between
        # rows (bfloat16 on AMX, issue 24).
        low = without_spread_nan(
            softmax_attention_reference(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True),
            softmax_attention_reference(*finite_inputs(q, k, v), attn_mask=finite_inputs(mask, keep_neginf=True),
                                        is_causal=causal, scale=scale, enable_gqa=True))
    clean = ~nan_rows(out)[0] & ~nan_rows(ref_out)[0]
    assert_close_to_reference(out[0][clean], ref_out[0][clean], None if low is None else low[0][clean],
                              dtype=dtype, name="out (finite rows)")

    # Backward: NaN at least where the poisoned rows reach; nothing in kv head 1's gradients.
    seen = (vis & poisoned.unsqueeze(-1))[:2].any(0)          # keys a poisoned row sees
    if where == "v":
        rows_v = vis[:2, :, j]                                # rows whose dP sees v[j],
        if mask_kind == "float":  # but not a row with no key (all -inf): zero gradients (README)
            rows_v &= ~torch.isneginf(mask[0, :2]).all(-1)
        assert_rows(nan_rows(dq)[0], torch.cat([rows_v, torch.zeros(2, N, dtype=torch.bool)]),
                    "dq", exact=False)
        assert_rows(nan_rows(dk)[0, 0], (vis[:2] & rows_v.unsqueeze(-1)).any(0).any(0), "dk",
                    exact=False)
    else:
        assert_rows(nan_rows(dq)[0], poisoned, "dq", exact=False)
        assert_rows(nan_rows(dk)[0, 0], seen, "dk", exact=False)
        assert_rows(nan_rows(dv)[0, 0], seen, "dv", exact=False)
    for t, name in ((dq[0, 2:], "dq"), (dk[0, 1], "dk"), (dv[0, 1], "dv")):
        assert not torch.isnan(t).any(), f"{name}: NaN leaked to kv head 1"
    # Where no mask reinterprets visibility, the forward's NaN rows are SDPA's (its bool masks
    # turn into -inf additive ones: NaN + -inf = NaN would poison rows that hide the key).
    if exact and mask_kind != "bool" and dtype in (F32, F64):
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        if where != "mask" or vis[0, i, j]:
            assert torch.equal(nan_rows(out), nan_rows(sdpa))


@pytest.mark.parametrize("where,val", [("q", NAN), ("k", NAN), ("mask", NAN)])
@pytest.mark.parametrize("N", [70, 12], ids=["flash", "decode"])
def test_nan_and_inf_propagate_under_a_nan_spreading_matmul(where, val, N):
    # Issue 24: the bfloat16 checks above, with torch's matmul spreading a NaN of row i + 1 of A
    # into output row i, as torch 2.13 does on AMX (emulated here on any machine): the tolerance
    # reference must not carry it into the unpoisoned rows.
    with nan_spreading_matmul():
        test_nan_and_inf_propagate(where, val, "float" if where == "mask" else None, True, BF16, N)


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16])
def test_nan_behind_masked_keys(dtype):
    """A row whose only visible score is NaN (the max of the others is -inf: the row looks fully
    masked to the max) comes out NaN, not 0; a NaN on keys a row cannot see changes nothing."""
    B, H, N, M, D = 1, 1, 3, 260, 16
    q, k, v = (torch.randn(B, H, n, D).to(dtype) for n in (N, M, M))
    mask = torch.zeros(B, H, N, M, dtype=torch.bool)
    mask[0, 0, 0, 258] = True     # row 0 sees key 258 only (second key block), which is NaN
    mask[0, 0, 1, 3] = True       # row 1 sees key 3 only
    mask[0, 0, 2, :] = True
    mask[0, 0, 2, 258] = False    # row 2 sees everything but the NaN key
    k[0, 0, 258, 0] = NAN
    out, lse = fwd(q, k, v, mask, 0.25, False)
    assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(lse[0, 0, 0])
    assert torch.isfinite(out[0, 0, 1:]).all() and torch.isfinite(lse[0, 0, 1:]).all()
    dq, dk, dv = bwd(torch.ones_like(out), q, k, v, out, lse, mask, 0.25, False)
    assert torch.isnan(dq[0, 0, 0]).all() and torch.isnan(dv[0, 0, 258]).all()
    assert not torch.isnan(dv[0, 0, :258]).any()


def test_nan_row_is_not_a_fully_masked_row():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    q[0, 0, 1, 0] = NAN
    mask = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    mask[0, 0, 2] = False
    out, lse = fwd(q, k, v, mask, 0.3, False)
    assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(lse[0, 0, 1])
    assert torch.equal(out[0, 0, 2], torch.zeros(8)) and torch.isneginf(lse[0, 0, 2])
    assert torch.isfinite(out[0, 0, [0, 3]]).all()


# ----------------------------------------------------------------------------------------------
# decoding path (issue 14): N <= 16 query rows, G * N <= 64 rows per kv head, float32 / bfloat16
# / float16.  Keys split over tasks when (b, kv head) pairs are few (each split >= 512 keys),
# merged by log-sum-exp weights; key tiles of 64 keys, scores as dot products of 16 keys at a
# time with masked tails along d (D not a multiple of 16 / 32) and along the keys.
# ----------------------------------------------------------------------------------------------

# (B, H, Hk, N, M, D, Dv, causal)
DECODE_SHAPES = [
    (1, 4, 1, 1, 3001, 64, 64, False),     # MQA, 5 splits
    (2, 8, 2, 4, 1100, 128, 128, False),   # GQA 4, 16 rows, 2 splits
    (1, 2, 2, 16, 257, 80, 96, False),     # MHA, 16 rows, Dv != D
    (1, 16, 1, 4, 1300, 32, 32, False),    # 64 rows per task
    (1, 6, 3, 7, 1, 16, 16, False),        # a single key
    (1, 3, 1, 5, 700, 17, 9, False),       # odd head dims, 15 rows: the GEMM scores (bf16)
    (1, 2, 1, 3, 301, 17, 9, False),       # odd head dims, 6 rows: dot-product scores with masked
                                           # d tails (bf16: 17 of 32), odd key count, Dv pad
    (2, 4, 2, 16, 600, 64, 64, True),      # causal: rows see keys <= i only
    (1, 8, 8, 1, 64, 128, 128, True),
    # AVX2 row blocks (decode_dots_avx2 / decode_pv_avx2): 4-row blocks plus one row (R = 9),
    # D with a 4-element tail, Dv under one 24-column panel; plus two rows (R = 10), 128 columns
    # = five 24-column panels and one vector
    (1, 9, 1, 1, 700, 44, 20, False),
    (1, 5, 1, 2, 333, 128, 128, False),
]


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s[:7])) + ("c" if s[7] else ""))
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_decode_matches_reference(shape, dtype):
    *dims, causal = shape
    check(*dims, dtype, causal=causal)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_decode_masks(dtype, mask):
    check(2, 8, 2, 4, 1500, 64, 64, dtype, mask=mask, mask_shape=(2, 1, 4, 1500))
    check(1, 4, 1, 1, 2100, 64, 64, dtype, mask=mask, mask_shape=(1, 4, 1, 2100), causal=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_non_contiguous(dtype):
    for layout in (lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
                   lambda x: torch.cat([x, x], dim=-1)[..., ::2]):
        check(1, 8, 2, 3, 1200, 64, 64, dtype, layout=layout)


@pytest.mark.parametrize("threads", [1, 3])
def test_decode_thread_counts(threads):
    with num_threads(threads):
        check(1, 4, 2, 2, 2500, 64, 64, F32)
        check(1, 4, 1, 1, 1100, 64, 64, BF16)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_fully_masked_and_nan_rows_across_splits(dtype):
    """A row masked in every split stays 0 / -inf; a NaN key in one split poisons the rows that
    see it after the merge, and only those."""
    B, H, Hk, N, M, D = 1, 4, 1, 2, 3000, 32
    q, k, v = torch.randn(B, H, N, D).to(dtype), torch.randn(B, Hk, M, D).to(dtype), torch.randn(B, Hk, M, D).to(dtype)
    mask = torch.rand(B, H, N, M) > 0.5
    mask[0, 0, 0] = False           # fully masked
    mask[0, 1, 1] = False
    mask[0, 1, 1, 2900] = True      # sees one key, in the last split
    k[0, 0, 2900, 3] = NAN
    mask[0, 2:, :, 2900] = False    # heads 2, 3 hide the NaN key
    out, lse = fwd(q, k, v, mask, 0.2, False)
    assert torch.equal(out[0, 0, 0], torch.zeros(D, dtype=dtype)) and torch.isneginf(lse[0, 0, 0])
    sees = mask[0, :, :, 2900]
    assert torch.equal(torch.isnan(lse[0]), sees)
    assert torch.equal(nan_rows(out)[0], sees)
    k[0, 0, 2900, 3] = 0.5
    out, lse = fwd(q, k, v, mask, 0.2, False)
    ref, ref_lse = softmax_attention_reference(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.2,
                                               enable_gqa=True, return_lse=True)
    assert not torch.isnan(out).any()
    low = None if dtype == F32 else softmax_attention_reference(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    assert_close_to_reference(out, ref, low, dtype=dtype, name="out")

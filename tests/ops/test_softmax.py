"""attnkit.softmax_attention: the public function (validation, dispatch, numerics, autograd,
dropout, compile), on the backend a CPU tensor gets by default -- the C++ ``cpu`` kernel once
attnkit._C is built (the reference for what it cannot do: dropout, a mask that requires grad),
else the reference.  tests/ops/test_softmax_backends.py names each backend explicitly.

Ground truth is ``loop_attention`` (tests/attnkit_testing.py): float64, one query row at a time,
key/value heads picked by index arithmetic, masks applied with ``where`` and products summed
elementwise -- a different formulation from the library's reference (matmul, repeat_interleave,
masked_fill).  torch's own SDPA in float64 is a second oracle wherever its semantics match ours
(it gives NaN on fully masked rows, where we give 0).  ``assert_close_to_reference`` (same file)
is the tolerance rule of DESIGN.md.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, assert_close_to_reference, loop_attention, make_mask, make_qkv

OP = "attnkit.softmax_attention"


# Mask shapes cycled through the parametrized cases: full, 2-D, per-batch, key padding, 3-D.
MASK_SHAPES = (
    lambda b, h, n, m: (b, h, n, m),
    lambda b, h, n, m: (n, m),
    lambda b, h, n, m: (b, 1, n, m),
    lambda b, h, n, m: (1, h, 1, m),
    lambda b, h, n, m: (h, n, m),
)


# ----------------------------------------------------------------------------------------------
# values against the float64 ground truths
# ----------------------------------------------------------------------------------------------

SIZES = (1, 7, 64, 129)


@pytest.mark.parametrize("d", (16, 80))
@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mask_kind", (None, "causal", "bool", "additive"))
def test_matches_loop_and_sdpa_float64(mask_kind, n, m, d):
    # GQA ratio and mask shape vary with the case so that all of them meet every size.
    case = SIZES.index(n) * 4 + SIZES.index(m) + (d == 80)
    ratio = (1, 2, 4)[case % 3]
    b, h = 2, 4
    dv = d // 2 + 3  # Dv != D
    q, k, v = make_qkv(b, h, h // ratio, n, m, d, dv, seed=case)
    shape = MASK_SHAPES[case % len(MASK_SHAPES)](b, h, n, m)
    mask = make_mask(mask_kind, b, h, n, m, seed=case, shape=shape)
    causal = mask_kind == "causal"
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                         enable_gqa=ratio > 1, return_lse=True)
    ref_out, ref_lse = loop_attention(q, k, v, attn_mask=mask, is_causal=causal)
    assert out.dtype == F64 and lse.dtype == F64
    assert_close_to_reference(out, ref_out, name="out")
    assert_close_to_reference(lse, ref_lse, name="lse")
    # torch's SDPA agrees everywhere (these masks leave no row fully masked).
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=ratio > 1)
    assert_close_to_reference(out, sdpa, name="out vs SDPA")


@pytest.mark.parametrize("scale", (None, 0.3, -1.5, 0.0, 2))
def test_scale(scale):
    q, k, v = make_qkv(1, 2, 2, 7, 9, 16, 5)
    out = attnkit.softmax_attention(q, k, v, scale=scale)
    assert_close_to_reference(out, loop_attention(q, k, v, scale=scale)[0])
    assert_close_to_reference(out, F.scaled_dot_product_attention(q, k, v, scale=scale))


def test_causal_is_top_left_aligned():
    # N > M: rows i >= M see every key; N < M: row i sees keys 0..i only (SDPA's convention).
    for n, m in ((9, 4), (4, 9)):
        q, k, v = make_qkv(1, 1, 1, n, m, 8, 8)
        out = attnkit.softmax_attention(q, k, v, is_causal=True)
        for i in range(n):
            visible = min(i + 1, m)
            s = (k[0, 0, :visible] @ q[0, 0, i]) / math.sqrt(8)
            expected = torch.softmax(s, 0) @ v[0, 0, :visible]
            torch.testing.assert_close(out[0, 0, i], expected, rtol=1e-12, atol=1e-12)


def test_bool_and_additive_masks_agree():
    # A bool mask and the additive mask with -inf where it is False are the same attention.
    q, k, v = make_qkv(2, 2, 2, 7, 64, 16, 16)
    keep = make_mask("bool", 2, 2, 7, 64)
    bias = torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, float("-inf"))
    a = attnkit.softmax_attention(q, k, v, attn_mask=keep)
    b = attnkit.softmax_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_gqa_shares_key_value_heads():
    # With enable_gqa, query head h uses key/value head h // (H // Hk): same as expanding k, v.
    q, k, v = make_qkv(2, 6, 2, 7, 9, 16, 8)
    out = attnkit.softmax_attention(q, k, v, enable_gqa=True)
    expanded = attnkit.softmax_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    torch.testing.assert_close(out, expanded, rtol=0, atol=1e-14)
    # ... and not the other assignment (h % Hk), so the test can tell them apart.
    wrong = attnkit.softmax_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))
    assert (out - wrong).abs().max() > 1e-3


def test_enable_gqa_with_equal_heads_is_plain_attention():
    q, k, v = make_qkv(1, 3, 3, 7, 7, 16, 16)
    torch.testing.assert_close(attnkit.softmax_attention(q, k, v, enable_gqa=True),
                               attnkit.softmax_attention(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("n,m,d,mask_kind,ratio", [
    (129, 64, 80, "causal", 2),
    (64, 129, 16, "additive", 1),
    (7, 129, 80, "bool", 4),
    (1, 7, 16, None, 1),
])
def test_low_precision_against_float64(dtype, n, m, d, mask_kind, ratio):
    b, h = 2, 4
    q, k, v = make_qkv(b, h, h // ratio, n, m, d, d, seed=n + m, dtype=dtype, requires_grad=True)
    mask = make_mask(mask_kind, b, h, n, m, seed=n, dtype=torch.float32)
    kw = dict(attn_mask=mask, is_causal=mask_kind == "causal", enable_gqa=ratio > 1)
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32

    # float64 truth from the same rounded inputs (and the mask as the inputs' dtype sees it).
    q64, k64, v64 = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    mask64 = None if mask is None else mask.to(dtype).to(F64) if mask.is_floating_point() else mask
    ref_out, ref_lse = loop_attention(q64, k64, v64, attn_mask=mask64, is_causal=kw["is_causal"])
    q_lp, k_lp, v_lp = (t.detach().clone().requires_grad_() for t in (q, k, v))
    low_out, low_lse = softmax_attention_reference(q_lp, k_lp, v_lp, return_lse=True, **kw)

    assert_close_to_reference(out, ref_out, low_out, name="out")
    assert_close_to_reference(lse, ref_lse, low_lse, name="lse", dtype=dtype)

    g = torch.randn(out.shape, dtype=F64)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), g)
    low_grads = torch.autograd.grad(low_out, (q_lp, k_lp, v_lp), g.to(dtype))
    for name, got, ref, low in zip("qkv", grads, ref_grads, low_grads):
        assert_close_to_reference(got, ref, low, grad=True, name=f"grad {name}")


def test_tolerance_helper_can_fail():
    # The helper must reject a result that is off by more than the rule allows.
    ref = torch.linspace(-1, 1, 50, dtype=F64)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_close_to_reference((ref * (1 + 5e-5)).float(), ref)
    assert_close_to_reference((ref * (1 + 5e-5)).float(), ref, grad=True)
    low = ref.to(torch.bfloat16)
    with pytest.raises(AssertionError, match="tolerance"):
        assert_close_to_reference((ref + 0.05).to(torch.bfloat16), ref, low)
    lse = torch.tensor([0.5, float("-inf")], dtype=F64)
    with pytest.raises(AssertionError, match="infinities"):
        assert_close_to_reference(torch.tensor([0.5, 0.0]), lse)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_reference(torch.tensor([0.5, float("nan")]), lse)


# ----------------------------------------------------------------------------------------------
# layouts, lse, empty inputs
# ----------------------------------------------------------------------------------------------


def test_non_contiguous_inputs():
    b, h, hk, n, m, d, dv = 2, 4, 2, 7, 63, 16, 12
    g = torch.Generator().manual_seed(3)
    # [B, N, H, D] storage transposed to [B, H, N, D]; value sliced from a wider tensor;
    # key strided along the sequence; mask expanded (stride 0 over batch and heads).
    q = torch.randn(b, n, h, d, generator=g, dtype=F64).transpose(1, 2)
    k = torch.randn(b, hk, 2 * m, d, generator=g, dtype=F64)[:, :, ::2]
    v = torch.randn(b, hk, m, 2 * dv, generator=g, dtype=F64)[..., 5:5 + dv]
    mask = make_mask("bool", 1, 1, n, m).expand(b, h, n, m)
    assert not any(t.is_contiguous() for t in (q, k, v, mask))
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)
    ref_out, ref_lse = loop_attention(q, k, v, attn_mask=mask)
    assert_close_to_reference(out, ref_out)
    assert_close_to_reference(lse, ref_lse, name="lse")
    dense = attnkit.softmax_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                      attn_mask=mask.contiguous(), enable_gqa=True)
    torch.testing.assert_close(out, dense, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype,lse_dtype", [
    (F64, F64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32)])
def test_return_lse_shapes_and_dtypes(dtype, lse_dtype):
    q, k, v = make_qkv(2, 3, 3, 7, 9, 16, 5, dtype=dtype)
    plain = attnkit.softmax_attention(q, k, v)
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 7, 5) and out.dtype == dtype
    assert lse.shape == (2, 3, 7) and lse.dtype == lse_dtype
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    # lse is the log-partition of the scaled scores: softmax = exp(scores - lse).
    scores = (q.to(F64) @ k.to(F64).transpose(-1, -2)) / 4.0
    tol = 1e-12 if dtype == F64 else 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(lse.to(F64), torch.logsumexp(scores, -1), rtol=0, atol=tol)


@pytest.mark.parametrize("n,m", [(0, 5), (4, 0), (0, 0)])
def test_empty_sequences(n, m):
    q, k, v = make_qkv(2, 4, 2, n, m, 8, 6, requires_grad=True)
    out, lse = attnkit.softmax_attention(q, k, v, enable_gqa=True, is_causal=True, return_lse=True)
    assert out.shape == (2, 4, n, 6) and lse.shape == (2, 4, n)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))
    # With a mask of the right (empty) shape too.
    mask = torch.ones(n, m, dtype=torch.bool)
    assert attnkit.softmax_attention(q, k, v, attn_mask=mask, enable_gqa=True).shape == (2, 4, n, 6)


def test_empty_batch():
    q, k, v = make_qkv(0, 2, 2, 7, 9, 8, 8)
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True)
    assert out.shape == (0, 2, 7, 8) and lse.shape == (0, 2, 7)


# ----------------------------------------------------------------------------------------------
# fully masked rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ("bool", "additive"))
def test_fully_masked_rows_are_zero_with_zero_gradients(kind):
    b, h, n, m = 2, 2, 7, 9
    q, k, v = make_qkv(b, h, h, n, m, 16, 8, requires_grad=True)
    keep = make_mask("bool", b, h, n, m)
    keep[0, 1, 3] = False  # one row
    keep[1, 0] = False  # a whole head
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, float("-inf"))
    if kind == "additive":
        mask.requires_grad_()
    dead = ~keep.any(-1)  # [B, H, N]
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    ref_out, ref_lse = loop_attention(q, k, v, attn_mask=mask)
    assert_close_to_reference(out, ref_out)
    assert_close_to_reference(lse, ref_lse, name="lse")
    # torch's SDPA agrees on the rows that attend to something (it is not specified on the rest:
    # older versions gave NaN there).
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close_to_reference(out[~dead], sdpa[~dead])

    # Gradients: no NaN, zero for the dead rows' queries, and the dead rows contribute nothing
    # to key/value gradients (a loss on the dead rows alone gives zero gradients everywhere).
    # The loss also uses lse (where finite): a kernel's lse backward must be safe too.
    g = torch.randn(out.shape, dtype=F64)
    inputs = (q, k, v) + ((mask,) if kind == "additive" else ())
    loss = (out * g).sum() + torch.where(dead, 0.0, lse).sum()
    grads = torch.autograd.grad(loss, inputs, retain_graph=True)
    ref_loss = (ref_out * g).sum() + torch.where(dead, 0.0, ref_lse).sum()
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    for name, got, ref in zip(("q", "k", "v", "mask"), grads, ref_grads):
        assert_close_to_reference(got, ref, grad=True, name=f"grad {name}")
    assert torch.equal(grads[0][dead], torch.zeros_like(grads[0][dead]))
    dead_only = torch.autograd.grad((out * dead[..., None]).sum(), inputs)
    for got in dead_only:
        assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("kind", ("bool", "additive", "empty_keys"))
def test_fully_masked_rows_low_precision(dtype, kind):
    # The same guarantees in every dtype (a tiny epsilon in place of a guard underflows in
    # float16, and 0/0 is NaN).
    b, h, n, m = 1, 2, 5, 0 if kind == "empty_keys" else 6
    q, k, v = make_qkv(b, h, h, n, m, 8, 4, dtype=dtype, requires_grad=True)
    keep = torch.ones(b, h, n, m, dtype=torch.bool)
    keep[0, 0, 1] = False
    keep[0, 1, ::2] = False
    mask = None if kind == "empty_keys" else keep if kind == "bool" else \
        torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    dead = ~keep.any(-1)
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad((out.float() ** 2).sum(), (q, k, v))
    for grad in grads:
        assert torch.isfinite(grad).all()
    assert torch.equal(grads[0][dead], torch.zeros_like(grads[0][dead]))


# ----------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ("plain", "causal", "bool_dead_row", "additive", "gqa_lse", "dv"))
def test_gradcheck(variant):
    b, h, hk, n, m, d, dv = 1, 2, 2, 5, 6, 3, 3
    kw = {}
    if variant == "gqa_lse":
        h, hk = 4, 2
        kw = dict(enable_gqa=True)
    if variant == "dv":
        dv, m = 4, 3
    q, k, v = make_qkv(b, h, hk, n, m, d, dv, requires_grad=True)
    inputs = [q, k, v]
    if variant == "causal":
        kw = dict(is_causal=True)
    if variant == "bool_dead_row":
        mask = make_mask("bool", b, h, n, m)
        mask[0, 1, 2] = False
        kw = dict(attn_mask=mask)
    if variant == "additive":
        mask = make_mask("additive", b, 1, n, m, shape=(b, 1, n, m)).requires_grad_()
        mask.data[0, 0, 4] = float("-inf")  # a fully masked row
        inputs.append(mask)

    def fn(*args):
        extra = dict(kw)
        if variant == "additive":
            extra["attn_mask"] = args[3]
        out, lse = attnkit.softmax_attention(*args[:3], return_lse=True, **extra)
        # gradcheck cannot difference -inf; the fully masked rows' lse is a constant anyway.
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)
    if variant == "plain":
        assert torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,m,mask_kind,ratio", [(129, 64, "causal", 4), (64, 129, "additive", 2),
                                                  (7, 7, "bool", 1)])
def test_float32_gradients_against_float64(n, m, mask_kind, ratio):
    b, h = 1, 4
    q, k, v = make_qkv(b, h, h // ratio, n, m, 16, 24, dtype=torch.float32, requires_grad=True)
    mask = make_mask(mask_kind, b, h, n, m, dtype=torch.float32)
    kw = dict(attn_mask=mask, is_causal=mask_kind == "causal", enable_gqa=ratio > 1)
    out = attnkit.softmax_attention(q, k, v, **kw)
    q64, k64, v64 = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    mask64 = mask.to(F64) if mask is not None and mask.is_floating_point() else mask
    ref = loop_attention(q64, k64, v64, attn_mask=mask64, is_causal=kw["is_causal"])[0]
    assert_close_to_reference(out, ref)
    g = torch.randn(out.shape, dtype=F64)
    for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), g.float()),
                               torch.autograd.grad(ref, (q64, k64, v64), g)):
        assert_close_to_reference(got, want, grad=True, name=f"grad {name}")


# ----------------------------------------------------------------------------------------------
# dropout (reference backend: torch.rand, reproducible under torch.manual_seed)
# ----------------------------------------------------------------------------------------------


def test_dropout_zero_is_no_dropout():
    q, k, v = make_qkv(2, 2, 2, 7, 9, 16, 8)
    plain = attnkit.softmax_attention(q, k, v, backend="reference")
    for p in (0.0, 0):
        torch.manual_seed(5)
        out = attnkit.softmax_attention(q, k, v, dropout_p=p, backend="reference")
        assert torch.equal(out, plain)


def test_dropout_same_seed_same_output():
    q, k, v = make_qkv(2, 2, 2, 7, 9, 16, 8)
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(attnkit.softmax_attention(q, k, v, dropout_p=0.4, backend="reference"))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_dropout_matches_explicit_mask_values_and_grads():
    # The reference draws keep = torch.rand([B, H, N, M]) >= p; with the same seed the oracle
    # can rebuild that mask and apply it independently.
    b, h, hk, n, m, p = 2, 4, 2, 7, 9, 0.3
    q, k, v = make_qkv(b, h, hk, n, m, 16, 8, requires_grad=True)
    torch.manual_seed(21)
    out, lse = attnkit.softmax_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True,
                                         return_lse=True, backend="reference")
    torch.manual_seed(21)
    keep = torch.rand(b, h, n, m, dtype=F64) >= p
    ref_out, ref_lse = loop_attention(q, k, v, is_causal=True, keep=keep, dropout_p=p)
    assert_close_to_reference(out, ref_out)
    assert_close_to_reference(lse, ref_lse, name="lse")  # lse is taken before dropout
    g = torch.randn(out.shape, dtype=F64)
    for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), g),
                               torch.autograd.grad(ref_out, (q, k, v), g)):
        assert_close_to_reference(got, want, grad=True, name=f"grad {name}")


def test_dropout_statistics_per_probability():
    # q = 0 makes every probability 1/M; value = identity makes out = the dropped probability
    # matrix itself.  Each entry must be 0 or 1 / (M (1 - p)), kept with probability 1 - p.
    # Fixed seed: deterministic, so it cannot flake; the bound is 6 standard deviations.
    b, h, n, m, p = 2, 2, 64, 64, 0.3
    q = torch.zeros(b, h, n, 8, dtype=F64)
    k = torch.randn(b, h, m, 8, dtype=F64)
    v = torch.eye(m, dtype=F64).expand(b, h, m, m)
    torch.manual_seed(1234)
    out = attnkit.softmax_attention(q, k, v, dropout_p=p, backend="reference")
    kept_value = 1.0 / (m * (1.0 - p))
    kept = out > 0
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], kept_value), rtol=1e-12, atol=0)
    count = out.numel()
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) <= 6 * math.sqrt(p * (1 - p) / count), frac
    # Unbiased: the mean probability stays 1/M.
    assert abs(out.mean().item() - 1.0 / m) <= 6 * kept_value * math.sqrt(p * (1 - p) / count)


def test_dropout_expectation_is_the_undropped_output():
    # E[dropout output] = output without dropout.  Average K independent draws (K copies of one
    # problem stacked along the batch, expanded without copying) and compare within 6 standard
    # errors, the variance computed from the data: Var = p/(1-p) · Σ_j P_ij² v_j².
    b, h, n, m, d, p, draws = 1, 2, 7, 9, 16, 0.25, 2000
    q, k, v = make_qkv(b, h, h, n, m, d, 4)
    plain = attnkit.softmax_attention(q, k, v, backend="reference")
    torch.manual_seed(99)
    stacked = attnkit.softmax_attention(*(t.expand(draws, -1, -1, -1) for t in (q, k, v)),
                                        dropout_p=p, backend="reference")
    mean = stacked.mean(0, keepdim=True)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    var = p / (1 - p) * (probs[..., None] ** 2 * v[:, :, None] ** 2).sum(-2)
    assert ((mean - plain).abs() <= 6 * (var / draws).sqrt()).all()
    # And dropout did change the individual draws.
    assert not torch.equal(mean, plain)


# ----------------------------------------------------------------------------------------------
# torch.autocast: SDPA's policy (pytorch_ext/_autocast.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_autocast_casts_the_inputs_as_sdpa_does(backend):
    # Under autocast(cpu, bfloat16) SDPA runs float32 inputs in bfloat16 and takes mixed dtypes;
    # so does softmax_attention: its result is exactly the call on the inputs cast by hand, and
    # the gradients reach the float32 leaves through the casts.
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16, 8, dtype=torch.float32, requires_grad=True)
    mask = torch.randn(9, 11)  # float32: follows the inputs' dtype (softmax_attention's rule)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask)
        out, lse = attnkit.softmax_attention(q, k, v, mask, enable_gqa=True, return_lse=True, backend=backend)
        mixed = attnkit.softmax_attention(q.to(torch.bfloat16), k, v, enable_gqa=True, backend=backend)
    assert out.dtype == sdpa.dtype == mixed.dtype == torch.bfloat16 and lse.dtype == torch.float32
    cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    want, want_lse = attnkit.softmax_attention(*cast, mask, enable_gqa=True, return_lse=True, backend=backend)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(mixed, attnkit.softmax_attention(*cast, enable_gqa=True, backend=backend))
    g = torch.randn(out.shape).to(torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), g)
    for name, a, b in zip("qkv", got, torch.autograd.grad(want, cast, g)):
        assert a.dtype == torch.float32 and torch.equal(a, b.float()), name
    # float64 is not cast (autocast leaves it, as for SDPA); outside autocast nothing is cast.
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attnkit.softmax_attention(q64, k64, v64, enable_gqa=True, backend=backend).dtype == torch.float64
    assert attnkit.softmax_attention(q, k, v, enable_gqa=True, backend=backend).dtype == torch.float32


def test_autocast_varlen():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attnkit.softmax_attention_varlen(q.to(torch.bfloat16), k, v, cu, cu, 7, 7, is_causal=True)
    want = attnkit.softmax_attention_varlen(*(t.to(torch.bfloat16) for t in (q, k, v)), cu, cu, 7, 7, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


def test_compile_fullgraph():
    torch._dynamo.reset()  # the frame cache is shared with other tests that compile this function
    compiled = torch.compile(attnkit.softmax_attention, fullgraph=True)
    # 1) causal + GQA + lse, M != N, with a backward through the compiled graph
    q, k, v = make_qkv(1, 4, 2, 7, 9, 16, 8, dtype=torch.float32, requires_grad=True)
    out, lse = compiled(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    eager, eager_lse = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    q64, k64, v64 = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    ref, ref_lse = loop_attention(q64, k64, v64, is_causal=True)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, name="lse")
    torch.testing.assert_close(out, eager, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(lse, eager_lse, rtol=2e-5, atol=1e-6)
    g = torch.randn(out.shape)
    for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), g),
                               torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert_close_to_reference(got, want, grad=True, name=f"grad {name}")
    # 2) a broadcast bool mask with a fully masked row
    q, k, v = make_qkv(2, 2, 2, 7, 9, 16, 8, dtype=torch.float32)
    mask = make_mask("bool", 1, 1, 7, 9, shape=(7, 9))
    mask[3] = False
    out = compiled(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert_close_to_reference(out, loop_attention(q, k, v, attn_mask=mask)[0])
    # 3) a float argument seen with a second value may be traced symbolically: validation
    # (finite scale, 0 <= dropout_p < 1) must still trace in one graph.
    for scale in (0.3, 0.5):
        out = compiled(q, k, v, attn_mask=mask, scale=scale)
        assert_close_to_reference(out, loop_attention(q, k, v, attn_mask=mask, scale=scale)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cuda_against_float64(dtype):
    # Whatever backend CUDA tensors get by default (triton, see test_softmax_backends.py).
    q, k, v = make_qkv(2, 4, 2, 129, 64, 80, 48, dtype=dtype)
    q, k, v = (t.cuda().requires_grad_() for t in (q, k, v))
    out, lse = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    assert out.is_cuda and lse.is_cuda
    q64, k64, v64 = (t.detach().cpu().to(F64).requires_grad_() for t in (q, k, v))
    ref, ref_lse = loop_attention(q64, k64, v64, is_causal=True)
    q_lp, k_lp, v_lp = (t.detach().clone().requires_grad_() for t in (q, k, v))
    low, low_lse = softmax_attention_reference(q_lp, k_lp, v_lp, is_causal=True, enable_gqa=True,
                                               return_lse=True)
    assert_close_to_reference(out.cpu(), ref, low.cpu(), name="out")
    assert_close_to_reference(lse.cpu(), ref_lse, low_lse.cpu(), name="lse", dtype=dtype)
    g = torch.randn(out.shape, dtype=F64)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dtype).cuda())
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g)
    low_grads = torch.autograd.grad(low, (q_lp, k_lp, v_lp), g.to(dtype).cuda())
    for name, got, want, lowp in zip("qkv", grads, ref_grads, low_grads):
        assert_close_to_reference(got.cpu(), want, lowp.cpu(), grad=True, name=f"grad {name}")


# ----------------------------------------------------------------------------------------------
# validation and dispatch
# ----------------------------------------------------------------------------------------------


def _qkv():
    return make_qkv(2, 4, 4, 7, 9, 16, 8, dtype=torch.float32)


def _call(**changes):
    q, k, v = _qkv()
    args = dict(query=q, key=k, value=v)
    args.update(changes)
    return attnkit.softmax_attention(**args)


@pytest.mark.parametrize("changes,exc,match", [
    (dict(query=[[1.0]]), TypeError, "query must be a torch.Tensor"),
    (dict(value=None), TypeError, "value must be a torch.Tensor"),
    # Any leading dims (tests/ops/test_leading_dims.py), but at least [N, D].
    (dict(query=torch.randn(16)), ValueError,
     r"query must be a tensor of at least 2 dims \[..., N, D\]; got 1-D with shape \(16,\)"),
    (dict(key=torch.randn(2, 3, 4, 9, 16)), ValueError, r"batch dims .* must broadcast together; "
     r"got query \[2\], key \[2, 3\], value \[2\]"),
    (dict(value=torch.randn(2, 4, 9)), ValueError, "same sequence length M; got key 9, value 4"),
    (dict(query=torch.ones(2, 4, 7, 16, dtype=torch.int64)), TypeError, "query must be floating point"),
    (dict(key=torch.ones(2, 4, 9, 16, dtype=torch.bool)), TypeError, "key must be floating point"),
    (dict(value=torch.randn(2, 4, 9, 8, dtype=F64)), ValueError, "value must have the dtype of query"),
    (dict(key=torch.randn(2, 4, 9, 16, device="meta")), ValueError, "key must be on the device of query"),
    (dict(key=torch.randn(3, 4, 9, 16)), ValueError,
     r"batch dims .* must broadcast together; got query \[2\], key \[3\], value \[2\]"),
    (dict(value=torch.randn(3, 4, 9, 8)), ValueError, "must broadcast together"),
    (dict(key=torch.randn(2, 4, 9, 15)), ValueError, "same head dim D; got query 16, key 15"),
    (dict(value=torch.randn(2, 4, 8, 8)), ValueError, "same sequence length M; got key 9, value 8"),
    (dict(value=torch.randn(2, 2, 9, 8)), ValueError, "same number of heads Hk; got key 4, value 2"),
    (dict(key=torch.randn(2, 2, 9, 16), value=torch.randn(2, 2, 9, 8)), ValueError,
     "same number of heads unless enable_gqa=True; got query 4, key 2"),
    (dict(key=torch.randn(2, 3, 9, 16), value=torch.randn(2, 3, 9, 8), enable_gqa=True), ValueError,
     "must be a multiple of the key's; got query 4, key 3"),
    (dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor or None; got list"),
    (dict(attn_mask=torch.ones(7, 9, dtype=torch.int32)), TypeError,
     "attn_mask must be bool .* or floating point .*; got int32"),
    (dict(attn_mask=torch.ones(7, 8, dtype=torch.bool)), ValueError,
     r"attn_mask must be broadcastable to \[B, H, N, M\] = \[2, 4, 7, 9\]; got shape \[7, 8\]"),
    (dict(attn_mask=torch.ones(3, 4, 7, 9, dtype=torch.bool)), ValueError, "must be broadcastable"),
    (dict(attn_mask=torch.ones(1, 1, 1, 7, 9, dtype=torch.bool)), ValueError, "must be broadcastable"),
    (dict(attn_mask=torch.zeros(7, 9, device="meta")), ValueError, "attn_mask must be on the device of query"),
    (dict(attn_mask=torch.ones(7, 9, dtype=torch.bool), is_causal=True), ValueError,
     "attn_mask and is_causal=True cannot be combined"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be >= 0.0; got -0.1"),
    (dict(dropout_p=1.0), ValueError, "dropout_p must be < 1; got 1.0"),
    (dict(dropout_p=float("nan")), TypeError, "dropout_p must be a finite real number"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a finite real number"),
    (dict(scale=float("inf")), TypeError, "scale must be a finite real number; got inf"),
    (dict(scale=float("nan")), TypeError, "scale must be a finite real number"),
    (dict(scale="1"), TypeError, "scale must be a finite real number"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool; got 1"),
    (dict(enable_gqa=None), TypeError, "enable_gqa must be a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    (dict(backend="fast"), ValueError, "unknown backend 'fast'; expected one of reference, cpu, triton, cuda"),
])
def test_validation_errors(changes, exc, match):
    with pytest.raises(exc, match=f"^{re.escape(OP)}: .*{match}"):
        _call(**changes)


def test_unknown_backend_from_environment(monkeypatch):
    monkeypatch.setenv("ATTNKIT_BACKEND", "bogus")
    with pytest.raises(ValueError, match=f"{OP}: unknown ATTNKIT_BACKEND 'bogus'"):
        _call()


def test_reference_backend_explicit_and_from_environment(monkeypatch):
    q, k, v = _qkv()
    expected = softmax_attention_reference(q, k, v)
    torch.testing.assert_close(attnkit.softmax_attention(q, k, v, backend="reference"), expected,
                               rtol=0, atol=0)
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    torch.testing.assert_close(attnkit.softmax_attention(q, k, v), expected, rtol=0, atol=0)


def test_validation_happens_before_computation(monkeypatch):
    # A bad argument must raise even though the backend would have run fine: validation comes
    # first.  Make the implementation explode so any computation shows up.
    import attnkit.ops.softmax as ops_softmax

    def boom(*args, **kwargs):
        raise AssertionError("computation ran before validation")

    monkeypatch.setitem(ops_softmax._IMPLEMENTATIONS, "reference", boom)
    with pytest.raises(ValueError, match="dropout_p must be < 1"):
        _call(dropout_p=1.5, backend="reference")
    with pytest.raises(AssertionError, match="computation ran"):
        _call(backend="reference")


# ----------------------------------------------------------------------------------------------
# the eager fast path (issue 14): plain calls skip the per-argument checks and torch.library's
# Python autograd wrapper -- same kernels, so results bit for bit those of the registered op
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
def test_eager_path_matches_the_registered_op_bit_for_bit(is_causal):
    if not attnkit.backends()["softmax"]["cpu"].usable:
        pytest.skip("no cpu backend here")
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 3, 3, 13, 11, 8, 5, dtype=torch.float32))
    g, g_lse = torch.randn(2, 3, 13, 5), torch.randn(2, 3, 13)
    out, lse = attnkit.softmax_attention(q, k, v, is_causal=is_causal, return_lse=True)
    assert out.grad_fn is not None
    grads = torch.autograd.grad((out, lse), (q, k, v), (g, g_lse))
    # The op as registered (torch.library's autograd wrapper around the same setup/backward).
    out_op, lse_op = torch.ops.attnkit.softmax_fwd(q, k, v, None, 8 ** -0.5, is_causal)
    grads_op = torch.autograd.grad((out_op, lse_op), (q, k, v), (g, g_lse))
    for got, want in zip((out, lse, *grads), (out_op, lse_op, *grads_op)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Only out used: the lse's gradient is not materialized, same gradients as the op's.
    grads = torch.autograd.grad(attnkit.softmax_attention(q, k, v, is_causal=is_causal), (q, k, v), g)
    grads_op = torch.autograd.grad(torch.ops.attnkit.softmax_fwd(q, k, v, None, 8 ** -0.5, is_causal)[0],
                                   (q, k, v), g)
    for got, want in zip(grads, grads_op):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # No grad wanted: no graph.
    with torch.no_grad():
        assert attnkit.softmax_attention(q, k, v, is_causal=is_causal).grad_fn is None
    assert attnkit.softmax_attention(q.detach(), k.detach(), v.detach()).grad_fn is None


@pytest.mark.parametrize("changes", [
    {}, dict(is_causal=True), dict(scale=1), dict(scale=0.3), dict(return_lse=True), dict(backend="cpu"),
    dict(enable_gqa=True), dict(dropout_p=0),
])
def test_default_cpu_call_is_the_routed_call_bit_for_bit(changes):
    # The default call on CPU tensors skips _route and _run_native (issue 25): the same kernel
    # with the same arguments as the implementation the router picks.
    if not attnkit.backends()["softmax"]["cpu"].usable:
        pytest.skip("no cpu backend here")
    import attnkit.ops.softmax as ops_softmax

    q, k, v = make_qkv(2, 3, 3, 13, 11, 8, 5, dtype=torch.float32)
    got = attnkit.softmax_attention(q, k, v, **changes)
    scale = 1.0 / math.sqrt(8) if "scale" not in changes else float(changes["scale"])
    want = ops_softmax._IMPLEMENTATIONS["cpu"](q, k, v, None, 0.0, changes.get("is_causal", False), scale, False,
                                               changes.get("return_lse", False))
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_default_cpu_call_keeps_routing_and_grad_rules(monkeypatch):
    import attnkit.ops.softmax as ops_softmax

    ran = []
    for name, impl in list(ops_softmax._IMPLEMENTATIONS.items()):
        monkeypatch.setitem(ops_softmax._IMPLEMENTATIONS, name,
                            lambda *a, _impl=impl, _name=name: ran.append(_name) or _impl(*a))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 6, 6, 8, 8, dtype=torch.float32))
    with torch.no_grad():  # inputs that require grad, grad mode off: no graph
        assert attnkit.softmax_attention(q, k, v).grad_fn is None
    assert attnkit.softmax_attention(q, k, v).grad_fn is not None
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    attnkit.softmax_attention(q, k, v)
    monkeypatch.setenv("ATTNKIT_BACKEND", "cpu")
    attnkit.softmax_attention(q, k, v)
    monkeypatch.delenv("ATTNKIT_BACKEND")
    attnkit.softmax_attention(q, k, v[:, :1])  # broadcast kv heads: the full path
    # The spied implementations ran (the shortcut stands aside for a spy), each as routed.
    expected = "cpu" if attnkit.backends()["softmax"]["cpu"].usable else "reference"
    assert ran == [expected, expected, "reference", "cpu", expected]
    # Rank and device mismatches still reach the full path's errors.
    with pytest.raises(ValueError, match=f"^{re.escape(OP)}: .*same sequence length M"):
        attnkit.softmax_attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match=f"^{re.escape(OP)}: value must be on the device of query"):
        attnkit.softmax_attention(q, k, v.to("meta"))


@pytest.mark.parametrize("changes,exc,match", [
    # Arguments a plain [B, H, N, D] call could carry that are still not what the API takes.
    (dict(dropout_p=False), TypeError, "dropout_p must be a finite real number; got False"),
    (dict(scale=True), TypeError, "scale must be a finite real number; got True"),
    (dict(scale=-float("inf")), TypeError, "scale must be a finite real number"),
    (dict(is_causal=torch.tensor(True)), TypeError, "is_causal must be a bool"),
    (dict(return_lse=0), TypeError, "return_lse must be a bool; got 0"),
    (dict(dropout_p=torch.tensor([0.0, 0.0])), TypeError, "dropout_p must be a finite real number"),
])
def test_plain_shaped_calls_still_checked(changes, exc, match):
    with pytest.raises(exc, match=f"^{re.escape(OP)}: .*{match}"):
        _call(**changes)


def test_plain_call_still_routes_through_the_dispatcher(monkeypatch):
    # ATTNKIT_BACKEND is read on every call, also by the fast path.
    import attnkit.ops.softmax as ops_softmax

    ran = []
    original = ops_softmax._IMPLEMENTATIONS["reference"]
    monkeypatch.setitem(ops_softmax._IMPLEMENTATIONS, "reference",
                        lambda *a: ran.append("reference") or original(*a))
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    _call()
    monkeypatch.delenv("ATTNKIT_BACKEND")
    _call(backend="reference")
    assert ran == ["reference", "reference"]


# ----------------------------------------------------------------------------------------------
# grouped-query attention on the fast path (issue 25): enable_gqa with Hk = Hv dividing H skips
# the full path's checks as plain calls do -- the same kernel call, so the full path's results
# to the bit; anything unusual still reaches the full path and its errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("h,hk", [(6, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gqa_fast_path_is_the_full_path_bit_for_bit(h, hk, n, is_causal, dtype):
    q, k, v = make_qkv(2, h, hk, n, 7, 6, 5, dtype=dtype, requires_grad=True)
    g = torch.randn(2, h, n, 5, dtype=dtype)
    g_lse = torch.randn(2, h, n, dtype=torch.float32 if dtype == torch.float32 else F64)
    kw = dict(is_causal=is_causal, enable_gqa=True)
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, **kw)
    assert attnkit.softmax_attention(q, k, v, **kw).shape == out.shape  # return_lse=False: out alone
    grads = torch.autograd.grad((out, lse), (q, k, v), (g, g_lse))
    # The full path for the same tensors: a leading batch dim of 1 (5-D) never takes the fast path.
    out5, lse5 = attnkit.softmax_attention(q[None], k[None], v[None], return_lse=True, **kw)
    grads5 = torch.autograd.grad((out5, lse5), (q, k, v), (g[None], g_lse[None]))
    for got, want in zip((out, lse, *grads), (out5[0], lse5[0], *grads5)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # ... and the float64 ground truth (key/value head h // (H // Hk)), forward and gradients.
    q64, k64, v64 = (t.detach().to(F64).requires_grad_() for t in (q, k, v))
    out64, lse64 = loop_attention(q64, k64, v64, is_causal=is_causal)
    assert_close_to_reference(out, out64)
    assert_close_to_reference(lse, lse64, name="lse", dtype=dtype)
    grads64 = torch.autograd.grad((out64, lse64), (q64, k64, v64), (g.to(F64), g_lse.to(F64)))
    for name, got, want in zip("qkv", grads, grads64):
        assert_close_to_reference(got, want, grad=True, name=f"grad {name}")


def test_gqa_calls_take_the_fast_path(monkeypatch):
    # The decode shape of a GQA model (H = 4 query heads per key/value head, one query row)
    # must not pay the full path's checks and _Layout (issue 25: ~40 us of a ~50 us call).
    import attnkit.ops.softmax as ops_softmax

    layouts = []
    original = ops_softmax._Layout
    monkeypatch.setattr(ops_softmax, "_Layout", lambda *a: layouts.append(a) or original(*a))
    q, k, v = make_qkv(2, 8, 2, 1, 9, 16, 16, dtype=torch.float32)
    attnkit.softmax_attention(q, k, v, enable_gqa=True)
    attnkit.softmax_attention(q.requires_grad_(), k, v, enable_gqa=True, is_causal=True, return_lse=True)
    assert layouts == []
    attnkit.softmax_attention(q, k, v[:, :1], enable_gqa=True)  # Hk != Hv (broadcast): the full path
    assert len(layouts) == 1


def _gqa_call(**changes):
    q, k, v = make_qkv(2, 6, 2, 7, 9, 16, 8, dtype=torch.float32)
    args = dict(query=q, key=k, value=v, enable_gqa=True)
    args.update(changes)
    return attnkit.softmax_attention(**args)


@pytest.mark.parametrize("changes,exc,match", [
    # GQA-shaped calls (query 6 heads, key / value 2) that the fast path must leave to the full
    # path's errors.
    (dict(enable_gqa=False), ValueError, "same number of heads unless enable_gqa=True; got query 6, key 2"),
    (dict(enable_gqa=1), TypeError, "enable_gqa must be a bool; got 1"),
    (dict(key=torch.randn(2, 4, 9, 16), value=torch.randn(2, 4, 9, 8)), ValueError,
     "must be a multiple of the key's; got query 6, key 4"),
    (dict(key=torch.randn(2, 0, 9, 16), value=torch.randn(2, 0, 9, 8)), ValueError,
     "must be a multiple of the key's; got query 6, key 0"),
    (dict(value=torch.randn(2, 3, 9, 8)), ValueError, "same number of heads Hk; got key 2, value 3"),
    (dict(key=torch.randn(2, 2, 9, 15)), ValueError, "same head dim D; got query 16, key 15"),
    (dict(value=torch.randn(2, 2, 8, 8)), ValueError, "same sequence length M; got key 9, value 8"),
    (dict(key=torch.randn(3, 2, 9, 16)), ValueError,
     r"batch dims .* must broadcast together; got query \[2\], key \[3\], value \[2\]"),
    (dict(value=torch.randn(2, 2, 9, 8, dtype=F64)), ValueError, "value must have the dtype of query"),
    (dict(key=torch.randn(2, 2, 9, 16, device="meta")), ValueError, "key must be on the device of query"),
    (dict(scale=float("nan")), TypeError, "scale must be a finite real number"),
    (dict(dropout_p=1.0), ValueError, "dropout_p must be < 1; got 1.0"),
    (dict(is_causal=1), TypeError, "is_causal must be a bool; got 1"),
    (dict(return_lse=0), TypeError, "return_lse must be a bool; got 0"),
    (dict(attn_mask=torch.ones(7, 9, dtype=torch.bool), is_causal=True), ValueError,
     "attn_mask and is_causal=True cannot be combined"),
])
def test_gqa_shaped_calls_still_checked(changes, exc, match):
    with pytest.raises(exc, match=f"^{re.escape(OP)}: .*{match}"):
        _gqa_call(**changes)


def test_differentiable_fast_path_keeps_function_apply_rules():
    # Differentiable calls skip torch.autograd.Function.apply's Python wrapper (issue 25) only
    # where it does nothing: under a functorch transform it still runs, with its error (the
    # kernels' Function has no setup_context), as before.
    if not attnkit.backends()["softmax"]["cpu"].usable:
        pytest.skip("no cpu backend here")
    q, k, v = make_qkv(1, 2, 2, 5, 6, 8, 8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.grad(lambda x: attnkit.softmax_attention(x, k, v).sum())(q)
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.grad(lambda x: attnkit.softmax_attention(x, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool)).sum())(q)
    # Plain autograd: the same gradients as the registered op's autograd formula.
    q.requires_grad_()
    got = torch.autograd.grad(attnkit.softmax_attention(q, k, v).sum(), q)[0]
    want = torch.autograd.grad(torch.ops.attnkit.softmax_fwd(q, k, v, None, 8 ** -0.5, False)[0].sum(), q)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)

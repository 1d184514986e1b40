"""attnkit.reference.softmax: the ground truth of the softmax tests, checked against scalar Python.

``scalar_attention`` works entry by entry with Python floats and ``math`` (no tensors in the
arithmetic), from the definition: for each (b, h, i), the keys visible to query i, their
weights exp(s_ij - max) and the weighted sum of the value rows.  torch's SDPA in float64 is a
second oracle on larger shapes.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from attnkit.reference.softmax import expand_kv_heads, softmax_attention_reference

F64 = torch.float64
NEG_INF = float("-inf")


def scalar_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, keep=None, dropout_p=0.0):
    """(out, lse) as nested Python lists of floats; lse is -inf and out 0 on rows with no key."""
    b_, h_, n_, d_ = q.shape
    hk, m_, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d_) if scale is None else scale
    ql, kl, vl = q.tolist(), k.tolist(), v.tolist()
    full = None if attn_mask is None else torch.broadcast_to(attn_mask, (b_, h_, n_, m_)).tolist()
    keepl = None if keep is None else keep.tolist()
    out = [[[[0.0] * dv for _ in range(n_)] for _ in range(h_)] for _ in range(b_)]
    lse = [[[NEG_INF] * n_ for _ in range(h_)] for _ in range(b_)]
    for b in range(b_):
        for h in range(h_):
            g = h * hk // h_  # the key/value head of query head h (GQA groups are contiguous)
            for i in range(n_):
                scores = {}
                for j in range(m_):
                    if is_causal and j > i:
                        continue
                    s = scale * sum(ql[b][h][i][t] * kl[b][g][j][t] for t in range(d_))
                    if full is not None:
                        mask = full[b][h][i][j]
                        if isinstance(mask, bool):
                            if not mask:
                                continue
                        else:
                            s += mask
                    if s == NEG_INF:
                        continue
                    scores[j] = s
                if not scores:
                    continue
                top = max(scores.values())
                weights = {j: math.exp(s - top) for j, s in scores.items()}
                total = sum(weights.values())
                lse[b][h][i] = top + math.log(total)
                for j, w in weights.items():
                    p = w / total
                    if keepl is not None:
                        p = p / (1.0 - dropout_p) if keepl[b][h][i][j] else 0.0
                    for c in range(dv):
                        out[b][h][i][c] += p * vl[b][g][j][c]
    return torch.tensor(out, dtype=F64).reshape(b_, h_, n_, dv), torch.tensor(lse, dtype=F64).reshape(b_, h_, n_)


def make_qkv(b, h, hk, n, m, d, dv, seed=0, dtype=F64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=g, dtype=F64) for s in ((b, h, n, d), (b, hk, m, d), (b, hk, m, dv))]
    return [t.to(dtype).requires_grad_(requires_grad) for t in tensors]


def make_mask(kind, shape, seed=0):
    g = torch.Generator().manual_seed(seed + 77)
    if kind == "bool":
        return torch.rand(shape, generator=g) < 0.6
    if kind == "additive":
        bias = 2 * torch.randn(shape, generator=g, dtype=F64)
        return bias.masked_fill(torch.rand(shape, generator=g) < 0.3, NEG_INF)
    return None


def close(a, b, tol=1e-12):
    """Equal up to float64 rounding, -inf entries included (and no NaN anywhere)."""
    a, b = a.detach(), b.detach()
    assert not torch.isnan(a).any() and not torch.isnan(b).any()
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", (None, "causal", "bool", "additive"))
@pytest.mark.parametrize("n,m", [(1, 1), (7, 5), (5, 7), (1, 7), (7, 1)])
@pytest.mark.parametrize("ratio", (1, 2))
def test_matches_scalar_definition(mask_kind, n, m, ratio):
    b, h, d, dv = 2, 4, 3, 5
    q, k, v = make_qkv(b, h, h // ratio, n, m, d, dv, seed=n * 10 + m)
    # Random masks here do leave some rows fully masked: those must be 0 / -inf.
    mask = make_mask(mask_kind, (b, 1, n, m), seed=n + m)
    causal = mask_kind == "causal"
    out, lse = softmax_attention_reference(q, k, v, mask, 0.0, causal, None, ratio > 1, return_lse=True)
    ref_out, ref_lse = scalar_attention(q, k, v, mask, causal)
    assert out.shape == (b, h, n, dv) and lse.shape == (b, h, n)
    assert out.dtype == F64 and lse.dtype == F64
    close(out, ref_out)
    close(lse, ref_lse)


@pytest.mark.parametrize("scale", (0.0, 0.7, -2.0))
def test_scale_matches_scalar_definition(scale):
    q, k, v = make_qkv(1, 2, 2, 5, 6, 4, 3, seed=3)
    out, lse = softmax_attention_reference(q, k, v, scale=scale, return_lse=True)
    ref_out, ref_lse = scalar_attention(q, k, v, scale=scale)
    close(out, ref_out)
    close(lse, ref_lse)


@pytest.mark.parametrize("n,m,d", [(63, 129, 16), (129, 63, 80), (1, 257, 32)])
@pytest.mark.parametrize("mask_kind", (None, "causal", "bool", "additive"))
def test_matches_sdpa_float64(n, m, d, mask_kind):
    b, h = 2, 4
    q, k, v = make_qkv(b, h, 2, n, m, d, d + 8, seed=n)
    mask = make_mask(mask_kind, (b, h, n, m), seed=m)
    if mask is not None:  # SDPA is only comparable where no row is fully masked
        if mask.dtype == torch.bool:
            mask[..., 0] = True
        else:
            mask[..., 0] = 0.0
    causal = mask_kind == "causal"
    out = softmax_attention_reference(q, k, v, mask, is_causal=causal, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=True)
    close(out, expected, tol=1e-11)


@pytest.mark.parametrize("kind", ("bool", "additive"))
def test_fully_masked_rows_zero_output_and_gradients(kind):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 3, 3, requires_grad=True)
    keep = torch.ones(1, 2, 4, 5, dtype=torch.bool)
    keep[0, 0, 1] = False
    keep[0, 1] = False
    keep[0, 0, 2, ::2] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, NEG_INF)
    inputs = (q, k, v) if kind == "bool" else (q, k, v, mask.requires_grad_())
    out, lse = softmax_attention_reference(q, k, v, mask, return_lse=True)
    dead = ~keep.any(-1)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    # A loss over the output and the finite lse entries: gradients are finite, the dead rows'
    # query gradients are exactly 0 (torch.logsumexp's backward would give NaN here).
    loss = out.sum() + torch.where(dead, 0.0, lse).sum()
    grads = torch.autograd.grad(loss, inputs)
    for grad in grads:
        assert torch.isfinite(grad).all()
    assert torch.equal(grads[0][dead], torch.zeros_like(grads[0][dead]))
    if kind == "additive":
        assert torch.equal(grads[3][~keep], torch.zeros_like(grads[3][~keep]))


@pytest.mark.parametrize("variant", ("plain", "causal_gqa", "bool", "additive"))
def test_gradcheck(variant):
    q, k, v = make_qkv(1, 2, 1 if variant == "causal_gqa" else 2, 4, 5, 3, 2, requires_grad=True)
    inputs = [q, k, v]
    kw = {}
    if variant == "causal_gqa":
        kw = dict(is_causal=True, enable_gqa=True)
    if variant == "bool":
        mask = make_mask("bool", (1, 2, 4, 5))
        mask[0, 0, 0] = False  # a fully masked row
        kw = dict(attn_mask=mask)
    if variant == "additive":
        mask = make_mask("additive", (1, 1, 4, 5), seed=1)
        mask[0, 0, 3] = NEG_INF  # a fully masked row
        inputs.append(mask.requires_grad_())

    def fn(*args):
        extra = dict(kw, attn_mask=args[3]) if len(args) == 4 else kw
        out, lse = softmax_attention_reference(*args[:3], return_lse=True, **extra)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_explicit_dropout_mask():
    b, h, n, m, p = 1, 2, 5, 6, 0.4
    q, k, v = make_qkv(b, h, h, n, m, 3, 4, seed=5)
    keep = torch.rand(b, h, n, m, generator=torch.Generator().manual_seed(8)) >= p
    out, lse = softmax_attention_reference(q, k, v, dropout_p=p, return_lse=True, dropout_mask=keep)
    ref_out, ref_lse = scalar_attention(q, k, v, keep=keep, dropout_p=p)
    close(out, ref_out)
    close(lse, ref_lse)  # lse is taken before dropout
    # All kept: only the 1 / (1 - p) rescaling remains.
    all_kept = softmax_attention_reference(q, k, v, dropout_p=p, dropout_mask=torch.ones_like(keep))
    close(all_kept * (1 - p), softmax_attention_reference(q, k, v))


def test_drawn_dropout_mask_comes_from_torch_rand():
    # Without dropout_mask the reference keeps where torch.rand([B, H, N, M]) >= p: reproducible
    # under torch.manual_seed, and exactly the mask a test can rebuild.
    b, h, n, m, p = 2, 2, 6, 7, 0.3
    q, k, v = make_qkv(b, h, h, n, m, 3, 4, seed=6)
    torch.manual_seed(42)
    drawn = softmax_attention_reference(q, k, v, dropout_p=p)
    torch.manual_seed(42)
    again = softmax_attention_reference(q, k, v, dropout_p=p)
    torch.manual_seed(42)
    keep = torch.rand(b, h, n, m, dtype=F64) >= p
    assert torch.equal(drawn, again)
    close(drawn, scalar_attention(q, k, v, keep=keep, dropout_p=p)[0])
    assert not torch.equal(drawn, softmax_attention_reference(q, k, v))


@pytest.mark.parametrize("n,m", [(0, 4), (3, 0), (0, 0)])
def test_empty_sequences(n, m):
    q, k, v = make_qkv(2, 2, 2, n, m, 3, 5, requires_grad=True)
    out, lse = softmax_attention_reference(q, k, v, is_causal=True, return_lse=True)
    assert out.shape == (2, 2, n, 5) and lse.shape == (2, 2, n)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 7, 3, 4, generator=g, dtype=F64).transpose(1, 2)
    k = torch.randn(2, 3, 10, 4, generator=g, dtype=F64)[:, :, 1::2]
    v = torch.randn(2, 3, 5, 9, generator=g, dtype=F64)[..., ::3]
    mask = make_mask("bool", (1, 1, 7, 5)).expand(2, 3, 7, 5)
    out = softmax_attention_reference(q, k, v, mask)
    close(out, scalar_attention(q, k, v, mask)[0])


def test_expand_kv_heads_groups_are_contiguous():
    x = torch.arange(3, dtype=F64).view(1, 3, 1, 1)
    assert expand_kv_heads(x, 6).flatten().tolist() == [0, 0, 1, 1, 2, 2]
    assert expand_kv_heads(x, 3) is x


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_low_precision_dtypes(dtype):
    # Computes in the given dtype; lse comes back float32.  Its error is what a naive
    # implementation makes in that dtype: bounded, and nonzero for bfloat16.
    q, k, v = make_qkv(1, 2, 2, 7, 9, 8, 4, dtype=dtype)
    out, lse = softmax_attention_reference(q, k, v, is_causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = scalar_attention(q.double(), k.double(), v.double(), is_causal=True)
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=tol * 4)


def test_float_mask_is_cast_to_the_inputs_dtype():
    # A float64 mask with float32 inputs: same as the float32 mask (SDPA accepts any float mask).
    q, k, v = make_qkv(1, 2, 2, 5, 6, 4, 4, dtype=torch.float32)
    mask = make_mask("additive", (5, 6))
    a = softmax_attention_reference(q, k, v, mask)
    b = softmax_attention_reference(q, k, v, mask.float())
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=0, atol=0)

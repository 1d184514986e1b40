"""attnkit.merge_attention_states: the attention over a key set split in two, merged from each
part's (out, lse), against the float64 reference on the whole key set."""
import math

import pytest
import torch

import attnkit
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, assert_close_to_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _qkv(n, m, d, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, r, d, generator=g, dtype=F64) for r in (n, m, m))
    return (q * scale).to(dtype), (k * scale).to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [F64, F32, BF16, F16], ids=str)
@pytest.mark.parametrize("n,m,split", [(7, 63, 20), (1, 129, 1), (33, 40, 39), (5, 12, 0)])
def test_merging_two_parts_gives_the_whole(dtype, n, m, split):
    q, k, v = _qkv(n, m, 17, dtype, seed=n + m)
    parts = [attnkit.softmax_attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
             for a, b in ((0, split), (split, m))]
    out, lse = attnkit.merge_attention_states(*parts[0], *parts[1])
    ref, ref_lse = softmax_attention_reference(q.to(F64), k.to(F64), v.to(F64), return_lse=True)
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else F32)
    low = None
    if dtype in (BF16, F16):  # DESIGN's rule: the whole computation run naively in the dtype
        low = softmax_attention_reference(q, k, v, return_lse=True)
    assert_close_to_reference(out, ref, None if low is None else low[0], name="out")
    assert_close_to_reference(lse, ref_lse, None if low is None else low[1], name="lse", dtype=dtype)


def test_merge_is_overflow_free_and_exact_in_float32():
    # lse of 1e4 and 1e4 + 30: exp would overflow; the weights are sigmoid(±30).
    out_a, out_b = torch.full((1, 2, 4), 1.0), torch.full((1, 2, 4), 3.0)
    lse_a, lse_b = torch.full((1, 2), 1e4), torch.full((1, 2), 1e4 + 30.0)
    out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    w = 1.0 / (1.0 + math.exp(-30.0))
    torch.testing.assert_close(out, torch.full_like(out, 1.0 + 2.0 * w), rtol=1e-7, atol=0)
    torch.testing.assert_close(lse, torch.full_like(lse, 1e4 + 30.0 + math.log1p(math.exp(-30.0))),
                               rtol=1e-7, atol=0)


def test_empty_parts_and_nan():
    out_a = torch.tensor([[[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [float("nan"), 1.0]]])
    out_b = torch.tensor([[[5.0, 6.0], [7.0, 8.0], [0.0, 0.0], [1.0, 1.0]]])
    ninf = float("-inf")
    lse_a = torch.tensor([[0.5, ninf, ninf, 0.0]])
    lse_b = torch.tensor([[ninf, 0.25, ninf, 0.0]])
    out, lse = attnkit.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0, 0], out_a[0, 0]) and lse[0, 0] == 0.5      # B empty: A alone
    assert torch.equal(out[0, 1], out_b[0, 1]) and lse[0, 1] == 0.25     # A empty: B alone
    assert torch.equal(out[0, 2], torch.zeros(2)) and torch.isneginf(lse[0, 2])  # both empty
    assert torch.isnan(out[0, 3, 0]) and out[0, 3, 1] == 1.0              # NaN stays in its entry
    nan_lse = attnkit.merge_attention_states(out_a, torch.tensor([[float("nan")] * 4]), out_b, lse_b)[1]
    assert torch.isnan(nan_lse).all()


def test_gradients_match_the_whole_computation():
    q, k, v = _qkv(9, 21, 8, F64, seed=3)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    a = attnkit.softmax_attention(q, k[..., :8, :], v[..., :8, :], return_lse=True, backend="reference")
    b = attnkit.softmax_attention(q, k[..., 8:, :], v[..., 8:, :], return_lse=True, backend="reference")
    out, lse = attnkit.merge_attention_states(*a, *b)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))
    ref, ref_lse = softmax_attention_reference(q, k, v, return_lse=True)
    want = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), (q, k, v))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad,match", [
    (lambda a, la, b, lb: (a, la, b.half(), lb), "one dtype"),
    (lambda a, la, b, lb: (a, la, b[..., :1], lb), "one shape"),
    (lambda a, la, b, lb: (a, la[..., :1], b, lb), "lse_a must have the shape"),
    (lambda a, la, b, lb: (a, la, b, lb.long()), "floating point"),
    (lambda a, la, b, lb: (a, la, b, [1.0]), "torch.Tensor"),
    (lambda a, la, b, lb: (a[0, 0, 0], la, b, lb), "at least 2 dims"),
])
def test_bad_arguments_raise(bad, match):
    args = (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3))
    with pytest.raises((TypeError, ValueError), match=match):
        attnkit.merge_attention_states(*bad(*args))

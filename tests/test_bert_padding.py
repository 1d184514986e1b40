"""attnkit.bert_padding: unpad / pad round trips, the offsets, gradients, and the varlen call on an
unpadded batch against attention over the padded batch with its key mask."""
import pytest
import torch

from attnkit.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input
from attnkit.flash_attn_interface import flash_attn_varlen_func
from attnkit_testing import assert_close_to_reference, fa_reference

F64 = torch.float64


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _mask(lengths, seqlen, left=False):
    pos = torch.arange(seqlen)
    lengths = torch.tensor(lengths)[:, None]
    return (pos >= seqlen - lengths) if left else (pos < lengths)


@pytest.mark.parametrize("left", [False, True])
def test_unpad_and_pad_round_trip(left):
    lengths, seqlen = [3, 0, 7, 5], 7
    x = _randn((4, seqlen, 2, 3), 1)
    mask = _mask(lengths, seqlen, left).to(torch.int32)
    rows, indices, cu, max_len, used = unpad_input(x, mask)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 10, 15] and max_len == 7
    assert used.tolist() == lengths and rows.shape == (15, 2, 3)
    flat = [b * seqlen + s for b in range(4) for s in range(seqlen) if mask[b, s]]
    assert indices.tolist() == flat and torch.equal(rows, x.reshape(28, 2, 3)[flat])
    back = pad_input(rows, indices, 4, seqlen)
    assert torch.equal(back, x * mask[..., None, None])


def test_unused_positions_are_packed_but_not_counted_as_used():
    attention = _mask([2, 3], 5)
    unused = torch.zeros(2, 5, dtype=torch.bool)
    unused[0, 2] = True
    rows, indices, cu, max_len, used = unpad_input(_randn((2, 5, 4), 2), attention, unused)
    assert cu.tolist() == [0, 3, 6] and used.tolist() == [2, 3] and max_len == 3 and rows.shape == (6, 4)


def test_gradients_flow_through_both_ways():
    x = _randn((3, 4, 5), 3).requires_grad_()
    mask = _mask([4, 1, 2], 4)
    rows, indices, *_ = unpad_input(x, mask)
    out = pad_input(rows * 2, indices, 3, 4)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad, 2 * mask[..., None].to(F64).expand_as(x))
    values = _randn((3, 2), 4).requires_grad_()
    put = index_put_first_axis(values, torch.tensor([4, 0, 2]), 6)
    assert torch.equal(index_first_axis(put, torch.tensor([4, 0, 2])), values)
    assert torch.autograd.gradcheck(lambda v: index_put_first_axis(v, torch.tensor([4, 0, 2]), 6), (values,))


def test_varlen_attention_on_the_unpadded_batch():
    # The padded batch's causal attention over its valid tokens (right padding), through unpad,
    # flash_attn_varlen_func and pad, against the float64 reference per sequence.
    lengths, seqlen = [5, 1, 8], 8
    q, k, v = (_randn((3, seqlen, 2, 8), i) for i in (11, 12, 13))
    mask = _mask(lengths, seqlen)
    (qu, indices, cu, max_len, _), ku, vu = unpad_input(q, mask), unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, max_len, max_len, causal=True), indices, 3, seqlen)
    for b, n in enumerate(lengths):
        want = fa_reference(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)[0]
        assert_close_to_reference(out[b:b + 1, :n], want)
        assert not out[b, n:].any()


@pytest.mark.parametrize("call,error,match", [
    (lambda: unpad_input(torch.zeros(2, 3, 4), torch.ones(2, 4)), ValueError, r"\[B, S\] = \[2, 3\]"),
    (lambda: unpad_input(torch.zeros(2, 3, 4), torch.ones(2, 3)), TypeError, "bool or integer"),
    (lambda: unpad_input(torch.zeros(3), torch.ones(1, 3, dtype=torch.bool)), ValueError, r"\[B, S, \.\.\.\]"),
    (lambda: pad_input(torch.zeros(2, 4), torch.tensor([0, 9]), 2, 3), ValueError, "flat positions"),
    (lambda: pad_input(torch.zeros(2, 4), torch.tensor([0]), 2, 3), ValueError, "one entry per row"),
])
def test_bad_calls_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()

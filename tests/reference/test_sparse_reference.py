"""attnkit.reference.sparse: the reference sparse attention against an independent computation.

Ground truth (``attnkit_testing.loop_sparse_attention``): float64, one query row at a time, the
allowed keys listed from the issue's pattern definitions with explicit loops, an elementwise
dot product and a max-shifted softmax over just those keys -- no mask tensor, no matmul.
"""
import pytest
import torch

from attnkit.patterns import block_layout, fixed, star, strided
from attnkit.reference.sparse import sparse_attention_reference
from attnkit_testing import F64, loop_sparse_attention


def _layout_with_empty_rows(heads, nb):
    # fixed generator: the cases are built at import, outside the per-test seeding
    layout = torch.rand(heads, nb, nb, generator=torch.Generator().manual_seed(10 * heads + nb)) < 0.5
    layout[:, 0] = False  # the first block of queries attends nothing
    return layout


CASES = [
    (strided(3), 13),
    (strided(4, causal=False), 11),
    (fixed(4, summary=2), 13),
    (fixed(5, summary=1, causal=False), 12),
    (star(0, 1), 9),
    (star(4, 2, cyclic=True, causal=True), 10),
    (block_layout(_layout_with_empty_rows(3, 4), 3), 12),
    (block_layout(_layout_with_empty_rows(1, 3), 4, causal=True), 12),
]


@pytest.mark.parametrize("p, n", CASES, ids=lambda x: repr(x) if not isinstance(x, int) else str(x))
def test_reference_matches_loops(p, n):
    q, k = torch.randn(2, 3, n, 5, dtype=F64), torch.randn(2, 3, n, 5, dtype=F64)
    v = torch.randn(2, 3, n, 7, dtype=F64)  # a different value head dim
    out = sparse_attention_reference(q, k, v, p)
    assert out.shape == (2, 3, n, 7) and out.dtype == F64
    torch.testing.assert_close(out, loop_sparse_attention(q, k, v, p), rtol=1e-12, atol=1e-12)
    out_scaled = sparse_attention_reference(q, k, v, p, scale=0.3)
    torch.testing.assert_close(out_scaled, loop_sparse_attention(q, k, v, p, scale=0.3), rtol=1e-12, atol=1e-12)


def test_empty_rows_give_zeros_and_finite_grads():
    layout = torch.tensor([[[False, False], [True, True]]])
    p = block_layout(layout, 3)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=F64, requires_grad=True) for _ in range(3))
    out = sparse_attention_reference(q, k, v, p)
    assert torch.equal(out[:, :, :3], torch.zeros(1, 2, 3, 4, dtype=F64))
    assert not torch.equal(out[:, :, 3:], torch.zeros(1, 2, 3, 4, dtype=F64))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, :3], torch.zeros(1, 2, 3, 4, dtype=F64))


@pytest.mark.parametrize("p, n", [(strided(2), 5), (star(1, 1, causal=True), 5),
                                  (block_layout(_layout_with_empty_rows(2, 3), 2), 6)])
def test_reference_gradcheck(p, n):
    q, k = (torch.randn(1, 2, n, 3, dtype=F64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, n, 2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: sparse_attention_reference(a, b, c, p), (q, k, v))


def test_reference_low_precision_runs_in_dtype():
    q = torch.randn(1, 2, 9, 4, dtype=torch.bfloat16)
    out = sparse_attention_reference(q, q, q, strided(3))
    assert out.dtype == torch.bfloat16
    ref = loop_sparse_attention(q, q, q, strided(3))
    assert (out.to(F64) - ref).abs().max() < 0.05  # bfloat16 rounding, not a wrong mask


def test_reference_empty_and_length_mismatch():
    q = torch.randn(2, 3, 0, 4)
    assert sparse_attention_reference(q, q, torch.randn(2, 3, 0, 6), star(0)).shape == (2, 3, 0, 6)
    with pytest.raises(ValueError, match="self-attention needs key length == query length; got 5 and 4"):
        sparse_attention_reference(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), strided(2))

"""CUDA C++ sparse-attention kernels (csrc/cuda/sparse.cu): torch.ops.attnkit.sparse_range_fwd /
sparse_range_bwd / block_sparse_fwd / block_sparse_bwd on CUDA tensors, at real sizes, against
the float64 references of pytorch_ext/reference/sparse.py.

Every test needs a GPU (``pytest -m gpu``; skipped elsewhere by tests/conftest.py).  Tolerance
(DESIGN.md): within 2x the error the reference itself makes in the inputs' dtype, + 1e-3;
infinities (lse = -inf on rows with no key) must match exactly, NaN never passes.  The same
kernels' device code is run on the CPU by tests/csrc/test_sparse_cuda_emulated.py.
"""
import math

import pytest
import torch

from attnkit.patterns import block_layout
from attnkit.reference.sparse import (
    block_sparse_bwd_reference,
    block_sparse_reference,
    sparse_range_bwd_reference,
    sparse_range_reference,
)
from attnkit_testing import F64, LOW_PRECISION as LOW, assert_close_to_reference, native_cuda_ops

pytestmark = pytest.mark.gpu

NONE_HI = 2**40
V1 = (1, 0, 1, 0, 1)


@pytest.fixture(scope="module")
def ops():
    return native_cuda_ops()


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, device="cuda").to(dtype)


def _bwd_inputs(out64, lse64, g):
    """dout, and a merged lse / delta as the lead passes them (lse >= the part's; finite where
    the part has no key; delta = rowsum(dO O) - dlse)."""
    dout = torch.randn(out64.shape, generator=g, device="cuda")
    bump = 0.5 * torch.rand(lse64.shape, generator=g, device="cuda")
    lse = torch.where(torch.isinf(lse64), torch.full_like(lse64, 0.7), lse64 + bump)
    delta = (dout.double() * out64).sum(-1) - 0.3 * torch.randn(lse64.shape, generator=g, device="cuda")
    return dout, lse.float(), delta.float()


def _check_all(results, reference, dtype, label):
    ref64, ref_low = reference(F64), reference(dtype)
    for name, x, r64, rlow in zip(("out", "lse", "dq", "dk", "dv"), results, ref64, ref_low):
        assert_close_to_reference(x, r64, rlow, name=f"{name} [{label}]", dtype=dtype)


def check_range(ops, dtype, d, b, h, nq, nk, view, lo, hi, seed=0, scale=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k, v = _randn((b, h, nq, d), dtype, g), _randn((b, h, nk, d), dtype, g), _randn((b, h, nk, d), dtype, g)
    out, lse = ops.sparse_range_fwd(q, k, v, list(view), list(lo), list(hi), scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = sparse_range_reference(q.double(), k.double(), v.double(), view, lo, hi, scale)
    dout, mlse, delta = _bwd_inputs(ref_out, ref_lse, g)
    dout = dout.to(dtype)
    dq, dk, dv = ops.sparse_range_bwd(dout, q, k, v, mlse, delta, list(view), list(lo), list(hi), scale)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype,) * 3

    def reference(dt):
        o, l = sparse_range_reference(q.to(dt), k.to(dt), v.to(dt), view, lo, hi, scale)
        grads = sparse_range_bwd_reference(dout.to(dt), q.to(dt), k.to(dt), v.to(dt), mlse.to(dt), delta.to(dt),
                                           view, lo, hi, scale)
        return (o, l) + tuple(grads)

    results = (out, lse, dq, dk, dv)
    _check_all(results, reference, dtype, f"view={view} lo={lo} hi={hi} Nq={nq} Nk={nk}")
    return results, (q, k, v, dout, mlse, delta)


def _strided_view(s):
    return (s, 1, s, 1, s)


# (name, Nq, Nk, view, lo, hi) at the sizes the lead uses (s = 64, l = 128, c = 8).
def _range_parts(n, s=64, l=128, c=8):
    nsum = -(-n // l) * c
    return [
        ("band_causal", n, n, V1, (-s, 1, 1, 0), (0, 1, 1, 0)),
        ("columns_causal", n, n, _strided_view(s), (0, 1, 0, 0), (-2, 1, 1, 0)),
        ("band_noncausal", n, n, V1, (-s, 1, 1, 0), (s, 1, 1, 0)),
        ("columns_low", n, n, _strided_view(s), (0, 1, 0, 0), (-2, 1, 1, 0)),
        ("columns_high", n, n, _strided_view(s), (2, 1, 1, 0), (0, 1, 0, NONE_HI)),
        ("fixed_own_block", n, n, V1, (0, l, l, 0), (0, 1, 1, 0)),
        ("fixed_summary", n, nsum, V1, (0, 1, 0, 0), (0, l, c, -1)),
        ("negative_floor", n, n // 2 + 3, V1, (-7, 3, 2, 5), (-9, 2, 3, 12)),
        ("partial_groups", n, n, (3, 1, 8, 1, 8), (-2, 1, 1, 0), (1, 1, 1, 0)),
        ("empty", n, n, V1, (5, 1, 1, 0), (3, 1, 1, 0)),
    ]


@pytest.mark.parametrize("n", (1000, 4097))
@pytest.mark.parametrize("part", range(10), ids=lambda i: _range_parts(64)[i][0])
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", LOW)
def test_range_part_matches_reference(ops, dtype, d, part, n):
    name, nq, nk, view, lo, hi = _range_parts(n)[part]
    check_range(ops, dtype, d, 1, 2, nq, nk, view, lo, hi, seed=part + n)


def test_strided_causal_partition_merges_to_the_pattern(ops):
    # band + columns, merged through their lse, is strided causal attention (the lead's plan).
    from attnkit.patterns import strided
    from attnkit.reference.sparse import sparse_attention_reference

    b, h, n, d, s, dtype = 1, 2, 2000, 64, 64, torch.float16
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (_randn((b, h, n, d), dtype, g) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    o1, l1 = ops.sparse_range_fwd(q, k, v, list(V1), [-s, 1, 1, 0], [0, 1, 1, 0], scale)
    o2, l2 = ops.sparse_range_fwd(q, k, v, list(_strided_view(s)), [0, 1, 0, 0], [-2, 1, 1, 0], scale)
    lse = torch.logaddexp(l1, l2)
    out = o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]
    ref64 = sparse_attention_reference(q.double(), k.double(), v.double(), strided(s), scale)
    ref16 = sparse_attention_reference(q, k, v, strided(s), scale)
    assert_close_to_reference(out, ref64, ref16, name="merged strided", dtype=dtype)


def check_block(ops, dtype, d, b, h, hl, block, nb, causal, density=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = torch.rand(hl, nb, nb, generator=g) < density
    lay[0, 1] = False  # a query block with no key block
    # (index lists of every listed block: causal is the kernels' own test, not a filter here)
    row_ptr, col_idx, col_ptr, row_idx = block_layout(lay, block).index_lists(device="cuda")
    n = nb * block
    gc = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (_randn((b, h, n, d), dtype, gc) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    out, lse = ops.block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale)
    ref_out, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), row_ptr, col_idx, block, causal,
                                              scale)
    dout, mlse, delta = _bwd_inputs(ref_out, ref_lse, gc)
    dout = dout.to(dtype)
    dq, dk, dv = ops.block_sparse_bwd(dout, q, k, v, mlse, delta, row_ptr, col_idx, col_ptr, row_idx, block, causal,
                                      scale)

    def reference(dt):
        o, l = block_sparse_reference(q.to(dt), k.to(dt), v.to(dt), row_ptr, col_idx, block, causal, scale)
        grads = block_sparse_bwd_reference(dout.to(dt), q.to(dt), k.to(dt), v.to(dt), mlse.to(dt), delta.to(dt),
                                           row_ptr, col_idx, block, causal, scale)
        return (o, l) + tuple(grads)

    results = (out, lse, dq, dk, dv)
    _check_all(results, reference, dtype, f"block={block} nb={nb} Hl={hl} causal={causal}")
    rows = slice(block, 2 * block)
    assert torch.isneginf(lse[:, 0, rows]).all()
    assert torch.equal(out[:, 0, rows], torch.zeros_like(out[:, 0, rows]))
    return results


@pytest.mark.parametrize("block,nb", ((16, 64), (24, 40), (32, 33), (64, 16), (128, 9)))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("hl", (1, 4))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", LOW)
def test_block_sparse_matches_reference(ops, dtype, d, hl, causal, block, nb):
    check_block(ops, dtype, d, 2, 4, hl, block, nb, causal, seed=block + nb + hl)


def test_deterministic(ops):
    first, _ = check_range(ops, torch.bfloat16, 64, 1, 2, 3000, 3000, _strided_view(64), (0, 1, 0, 0), (-2, 1, 1, 0))
    second, _ = check_range(ops, torch.bfloat16, 64, 1, 2, 3000, 3000, _strided_view(64), (0, 1, 0, 0), (-2, 1, 1, 0))
    for x, y in zip(first, second):
        assert torch.equal(x, y)
    a = check_block(ops, torch.float16, 128, 1, 2, 2, 32, 40, True, seed=1)
    b = check_block(ops, torch.float16, 128, 1, 2, 2, 32, 40, True, seed=1)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_unsupported_inputs_raise_clear_errors(ops):
    q = torch.randn(1, 1, 64, 64, device="cuda")
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.sparse_range_fwd(q, q, q, list(V1), [0, 1, 0, 0], [0, 1, 1, 0], 0.1)
    q96 = torch.randn(1, 1, 64, 96, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head dims 64 and 128"):
        ops.sparse_range_fwd(q96, q96, q96, list(V1), [0, 1, 0, 0], [0, 1, 1, 0], 0.1)
    h = q.half()
    with pytest.raises(RuntimeError, match="disjoint"):  # two groups holding the same rows
        ops.sparse_range_fwd(h, h, h, [2, 0, 1, 0, 1], [0, 1, 0, 0], [0, 1, 1, 0], 0.1)
    ptr = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.int32, device="cuda")
    idx = torch.arange(8, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="block >= 16"):
        ops.block_sparse_fwd(h, h, h, ptr, idx, 8, False, 0.1)

"""The fused strided ops of the CPU backend (csrc/cpu/sparse.cpp, issue 14), called directly:
attnkit::sparse_strided_fwd (the whole strided(s) pattern in one online softmax: the band on
consecutive rows, then each residue's columns, on its keys packed once, from the band's state) and attnkit::sparse_strided_bwd
(both parts' gradients from the pattern's lse and delta, one task per head).

Ground truth: the float64 masked reference (pytorch_ext/reference/sparse.py) on the same rounded
inputs; tolerances from DESIGN.md via assert_close_to_reference.  Sizes straddle the kernel's
edges: super-blocks of 512 rows (U = 512 // s blocks), segments of super-blocks when heads are
fewer than 2 x threads, column strips of 8 rows (forward) and 16 rows (backward), key chunks of
256, band strips of 8 rows (48 in the forward when s > 176), strides below the
band strip height (state copied, not in place), s >= N (no columns) and s = 1.
"""
import pytest
import torch

import attnkit  # noqa: F401  (loads attnkit._C, which registers the ops)
from attnkit import patterns
from attnkit.reference.sparse import _masked_attention_bwd, _masked_attention_with_lse
from attnkit_testing import F64, assert_close_to_reference, has_cpu_kernel

F32, BF16 = torch.float32, torch.bfloat16

pytestmark = pytest.mark.skipif(not has_cpu_kernel("sparse_strided_fwd"),
                                reason="attnkit._C without the fused strided ops")

CASES = [  # (n, stride, causal)
    (1, 1, True), (7, 2, True), (63, 4, False), (129, 8, True), (257, 16, False),
    (300, 7, True), (1000, 64, True), (1000, 1, True), (130, 200, True), (600, 100, False),
    (2100, 64, True), (1100, 300, False),
]


def _inputs(b, h, n, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, n, x, generator=g, dtype=F64).to(dtype) for x in (d, d, dv, dv))
    return q, k, v, dout


def _reference(q, k, v, s, causal, scale):
    mask = patterns.strided(s, causal).mask(q.shape[2])
    return mask, _masked_attention_with_lse(q, k, v, mask, scale)


@pytest.mark.parametrize("n,s,causal", CASES)
@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_fused_strided_forward_matches_reference(n, s, causal, dtype):
    d, dv = (64, 64) if n >= 1000 else (17, 9)
    q, k, v, _ = _inputs(2, 3, n, d, dv, dtype, seed=n + s)
    scale = d ** -0.5
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, causal, scale)
    _, (ref, ref_lse) = _reference(q.to(F64), k.to(F64), v.to(F64), s, causal, scale)
    low = _reference(q, k, v, s, causal, scale)[1] if dtype == BF16 else (None, None)
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else F32)
    assert_close_to_reference(out, ref, low[0])
    assert_close_to_reference(lse, ref_lse, None if dtype != BF16 else low[1].float(), name="lse", dtype=dtype)


@pytest.mark.parametrize("n,s,causal", [(2100, 64, True), (1000, 7, True), (600, 100, False), (1100, 30, False)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_strided_forward_segments(n, s, causal, threads):
    """Fewer heads than 2 x threads: each head's rows are split into segments of super-blocks
    (each gathering the columns its rows need).  The result is the reference's, and bit for bit
    the one-segment run of the same head (every row's sums run in the same order)."""
    old = torch.get_num_threads()
    try:
        q, k, v, _ = _inputs(1, 8, n, 32, 16, F32, seed=n + threads)
        torch.set_num_threads(1)
        whole = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, causal, 0.2)  # 8 heads: one segment
        torch.set_num_threads(threads)
        one = [t[:, 2:3].contiguous() for t in (q, k, v)]
        out, lse = torch.ops.attnkit.sparse_strided_fwd(*one, s, causal, 0.2)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(out, whole[0][:, 2:3]) and torch.equal(lse, whole[1][:, 2:3])
    _, (ref, ref_lse) = _reference(*(t.to(F64) for t in one), s, causal, 0.2)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, name="lse", dtype=F32)


@pytest.mark.parametrize("n,s,causal", CASES)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_fused_strided_backward_matches_reference(n, s, causal, dtype):
    d, dv = (64, 64) if n >= 1000 else (17, 9)
    q, k, v, dout = _inputs(2, 3, n, d, dv, dtype, seed=7 * n + s)
    scale = d ** -0.5
    _, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, causal, scale)
    # A random delta (as tests/csrc/test_sparse_cpu.py does): with rowsum(dO * O) the gradients
    # of short rows are rounding noise (n = 1: exactly 0 in exact arithmetic), no test of scale.
    delta = torch.randn(lse.shape, generator=torch.Generator().manual_seed(n), dtype=F64).to(lse.dtype)
    grads = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, delta, s, causal, scale)
    mask = patterns.strided(s, causal).mask(n)
    ref = _masked_attention_bwd(dout.to(F64), q.to(F64), k.to(F64), v.to(F64), lse.to(F64), delta.to(F64),
                                mask, scale)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert got.dtype == dtype
        assert_close_to_reference(got, want, grad=True, name=name)


@pytest.mark.parametrize("n,s,causal", [(7, 2, True), (300, 7, True), (600, 100, False), (2100, 64, True)])
@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_fused_strided_backward_delta_from_out(n, s, causal, dtype):
    """Without delta the kernel computes it from out (rowsum(grad_out * out), what
    attnkit.ops.sparse._delta gives for a call with no lse gradient): gradients of the reference."""
    d, dv = (64, 64) if n >= 1000 else (17, 9)
    q, k, v, dout = _inputs(1, 2, n, d, dv, dtype, seed=3 * n + s)
    scale = d ** -0.5
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, causal, scale)
    grads = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, None, s, causal, scale, out)
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    given = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, delta, s, causal, scale)
    mask = patterns.strided(s, causal).mask(n)
    ref = _masked_attention_bwd(dout.to(F64), q.to(F64), k.to(F64), v.to(F64), lse.to(F64), delta.to(F64),
                                mask, scale)
    # bfloat16: DESIGN's rule against the reference run in bfloat16 (lse, delta rounded to it)
    low = (_masked_attention_bwd(dout, q, k, v, lse.to(dtype), delta.to(dtype), mask, scale) if dtype == BF16
           else (None,) * 3)
    for name, got, same, want, want_low in zip(("dq", "dk", "dv"), grads, given, ref, low):
        assert got.dtype == dtype
        assert_close_to_reference(got, want, want_low, grad=True, name=name)
        if dtype == BF16:  # the same float32 sums up to delta's summation order: one bf16 rounding step apart
            torch.testing.assert_close(got.float(), same.float(), rtol=2 ** -7, atol=1e-5)
    with pytest.raises(RuntimeError, match="give delta, or out"):
        torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, None, s, causal, scale)


def test_fused_strided_large_outputs_per_head():
    """Outputs of 4 MiB and more are allocated 2 MiB-aligned on huge pages (empty_huge in
    csrc/cpu/empty_huge.h): the same values as each head run alone (small outputs, at::empty), and
    they behave as ordinary tensors under autograd (gradients accumulated twice)."""
    n, s, h = 2048, 64, 8  # [1, 8, 2048, 64] float32: 4 MiB
    q, k, v, dout = _inputs(1, h, n, 64, 64, F32, seed=11)
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, True, 0.125)
    grads = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, None, s, True, 0.125, out)
    assert out.data_ptr() % (2 << 20) == 0 and all(g.data_ptr() % (2 << 20) == 0 for g in grads)
    for x in range(h):
        one = [t[:, x:x + 1].contiguous() for t in (q, k, v, dout)]
        o1, l1 = torch.ops.attnkit.sparse_strided_fwd(*one[:3], s, True, 0.125)
        assert torch.equal(out[:, x:x + 1], o1) and torch.equal(lse[:, x:x + 1], l1)
        g1 = torch.ops.attnkit.sparse_strided_bwd(one[3], *one[:3], l1, None, s, True, 0.125, o1)
        for got, want in zip(grads, g1):
            assert torch.equal(got[:, x:x + 1], want)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for _ in range(2):
        attnkit.sparse_attention(*leaves, patterns.strided(s), scale=0.125, backend="cpu").backward(dout)
    for leaf, g in zip(leaves, grads):
        assert torch.equal(leaf.grad, 2 * g)  # the same kernel twice: g + g, exactly


def test_fused_strided_outputs_reuse_freed_blocks():
    """Freed huge-page outputs are kept and handed to the next output of the same size
    (HugeBlockCache in csrc/cpu/empty_huge.h): a reused block holds the old tensor's contents,
    here NaN, and every element of the new result must still be written by the kernel."""
    n, s = 2048, 64  # [1, 8, 2048, 64] float32: 4 MiB, on huge pages
    q, k, v, dout = _inputs(1, 8, n, 64, 64, F32, seed=5)
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, True, 0.125)
    grads = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, None, s, True, 0.125, out)
    want = [out.clone(), *(g.clone() for g in grads)]
    ptrs = {t.data_ptr() for t in (out, *grads)}
    for t in (out, *grads):
        t.fill_(float("nan"))
    del t, grads
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, True, 0.125)
    assert out.data_ptr() in ptrs  # the NaN-filled block came back
    del ptrs
    grads = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, None, s, True, 0.125, out)
    for got, expected in zip((out, *grads), want):
        assert torch.equal(got, expected)


def test_fused_strided_poisoned_row():
    """A NaN in one query row: that row's out and lse are NaN, every other row is finite.  The
    backward: NaN on the keys the row sees and on its dq; beyond them, 0 * NaN reaches keys in
    the row's GEMM tiles (the reference's dense GEMM reaches every key), no further than in the
    range parts' kernels (the route the fused backward replaces), equal where finite."""
    from attnkit.ops.sparse import strided_parts

    n, s = 300, 16
    q, k, v, dout = _inputs(1, 2, n, 16, 16, F32, seed=3)
    q[0, 1, 200, 3] = float("nan")
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, True, 0.25)
    assert torch.isnan(out[0, 1, 200]).all() and torch.isnan(lse[0, 1, 200])
    rest = torch.ones(n, dtype=torch.bool)
    rest[200] = False
    assert torch.isfinite(out[0, 1, rest]).all() and torch.isfinite(out[0, 0]).all()
    delta = (dout * out).sum(-1)
    fused = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, delta, s, True, 0.25)
    parts = [torch.ops.attnkit.sparse_range_bwd(dout, q, k, v, lse, delta, list(a), list(b), list(c), 0.25)
             for a, b, c in strided_parts(n, s, True)]
    # The finite entries against the float64 run of the same range kernels (same tiles, so the
    # same NaN reach), under DESIGN.md's float32 gradient rule.
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    out64, lse64 = torch.ops.attnkit.sparse_strided_fwd(q64, k64, v64, s, True, 0.25)
    delta64 = (dout64 * out64).sum(-1)
    parts64 = [torch.ops.attnkit.sparse_range_bwd(dout64, q64, k64, v64, lse64, delta64, list(a), list(b),
                                                  list(c), 0.25)
               for a, b, c in strided_parts(n, s, True)]
    seen = patterns.strided(s).mask(n)[200]
    for x, name in enumerate(("dq", "dk", "dv")):
        want = sum(p[x] for p in parts)
        bad = ~torch.isfinite(fused[x])
        assert not (bad & torch.isfinite(want)).any(), name
        ok = ~bad & torch.isfinite(want)
        want64 = sum(p[x] for p in parts64)
        assert torch.isfinite(want64[ok]).all(), name
        assert_close_to_reference(fused[x][ok], want64[ok], grad=True, name=name)
        if x:
            assert bad[0, 1, seen].all(), name
    assert torch.isfinite(fused[0][0, 1, rest]).all() and torch.isnan(fused[0][0, 1, 200]).any()


@pytest.mark.parametrize("threads", [1, 2])
def test_sparse_attention_strided_cpu_both_backward_routes(threads):
    """sparse_attention's cpu route: the fused backward (heads >= threads) and the range parts'
    (fewer heads than threads) give the reference's gradients."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, h in ((1, 1), (2, 3)):
            q, k, v, dout = _inputs(b, h, 333, 16, 16, F64, seed=b * h)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            p = patterns.strided(10)
            out = attnkit.sparse_attention(q, k, v, p, backend="cpu")
            got = torch.autograd.grad(out, (q, k, v), dout)
            ref = attnkit.sparse_attention(q, k, v, p, backend="reference")
            want = torch.autograd.grad(ref, (q, k, v), dout)
            assert_close_to_reference(out.detach(), ref.detach())
            for x, y in zip(got, want):
                assert_close_to_reference(x, y, grad=True)
    finally:
        torch.set_num_threads(old)

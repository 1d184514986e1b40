"""The star forward of the CPU backend in one call (csrc/cpu/sparse_star.cpp, issue 14):
attnkit::sparse_star_fwd lists each row's keys (the relay's row: all of them; any other row: the
relay's key and the satellites within ``radius``, on a ring when ``cyclic``; ``causal`` keeps
j <= i) and folds them in one softmax.

Ground truth: the float64 masked reference on the same rounded inputs, with the mask of
attnkit.patterns.Star; tolerances from DESIGN.md via assert_close_to_reference.  Cases straddle
the kernel's edges: N = 1 (the relay alone), N = 2, the relay first, inside and last, a radius
past half the ring (every satellite), causal rows before the relay (no relay key), rows in
several 256-row tasks, D and Dv odd.
"""
import pytest
import torch

import attnkit
from attnkit import patterns
from attnkit.reference.sparse import _masked_attention_with_lse
from attnkit_testing import F64, assert_close_to_reference, has_cpu_kernel, num_threads

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

pytestmark = pytest.mark.skipif(not has_cpu_kernel("sparse_star_fwd"),
                                reason="attnkit._C without the fused star forward")

CASES = [  # (n, relay, radius, cyclic, causal)
    (1, 0, 1, False, False), (1, 0, 3, True, True), (2, 1, 1, True, True), (2, 0, 1, False, False),
    (7, 3, 1, True, False), (9, 8, 2, False, True), (9, 8, 2, True, False), (10, 4, 4, True, True),
    (11, 0, 5, True, False), (100, 50, 3, True, True), (300, 0, 1, False, False), (300, 299, 2, True, True),
    (600, 257, 1, False, True), (600, 123, 7, True, False),
]


def _inputs(b, h, n, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, x, generator=g, dtype=F64).to(dtype) for x in (d, d, dv))


def _reference(q, k, v, pattern, scale):
    return _masked_attention_with_lse(q, k, v, pattern.mask(q.shape[2]), scale)


@pytest.mark.parametrize("n,relay,radius,cyclic,causal", CASES)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
def test_star_forward_matches_reference(n, relay, radius, cyclic, causal, dtype):
    d, dv = (64, 64) if n >= 300 else (17, 9)
    q, k, v = _inputs(2, 3, n, d, dv, dtype, seed=n + relay + radius)
    scale = d ** -0.5
    pattern = patterns.star(relay, radius, cyclic, causal)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, relay, radius, cyclic, causal, scale)
    ref, ref_lse = _reference(q.to(F64), k.to(F64), v.to(F64), pattern, scale)
    low = _reference(q, k, v, pattern, scale) if dtype in (BF16, F16) else (None, None)
    assert out.dtype == dtype and lse.dtype == (F64 if dtype == F64 else F32)
    assert_close_to_reference(out, ref, low[0])
    assert_close_to_reference(lse, ref_lse, None if low[1] is None else low[1].float(), name="lse", dtype=dtype)


def test_star_forward_thread_count_and_layout_do_not_change_the_result():
    """Tasks of 256 rows per head: 1, 2 and 3 threads give the same bits; a non-contiguous
    input (a transposed view) the same values as its contiguous copy."""
    q, k, v = _inputs(2, 2, 700, 32, 32, F32, seed=3)
    runs = []
    for t in (1, 2, 3):
        with num_threads(t):
            runs.append(torch.ops.attnkit.sparse_star_fwd(q, k, v, 5, 2, True, False, 0.2))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides of [B, N, H, D]
    assert not qt.is_contiguous()
    out, lse = torch.ops.attnkit.sparse_star_fwd(qt, k, v, 5, 2, True, False, 0.2)
    assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("kind", ["q_nan", "k_nan", "k_inf", "v_nan"])
def test_star_forward_nonfinite_inputs_poison_exactly_the_rows_that_see_them(kind):
    """Issue 15's rule: a NaN or +inf score makes its row NaN (out and lse); a NaN value every
    row that sees its key; nothing else changes."""
    n, relay = 40, 7
    pattern = patterns.star(relay, 2, False, True)
    q, k, v = _inputs(1, 1, n, 8, 4, F32, seed=1)
    q, k, v = q.abs(), k.abs(), v  # positive scores: an inf in k gives +inf, never -inf
    bad = 20  # poisoned position
    t = {"q": q, "k": k, "v": v}[kind[0]]
    t[0, 0, bad, 1] = float("nan") if kind.endswith("nan") else float("inf")
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, relay, 2, False, True, 0.3)
    mask = pattern.mask(n)
    want = torch.zeros(n, dtype=torch.bool)
    if kind == "q_nan":
        want[bad] = True
    else:
        want = mask[:, bad].clone()  # the rows that see key `bad`
    assert torch.equal(torch.isnan(out[0, 0]).any(-1), want)
    # A NaN score spoils the whole row; a NaN value only its own column of the rows that see it.
    assert torch.isnan(out[0, 0][want][:, 1] if kind == "v_nan" else out[0, 0][want]).all()
    assert torch.equal(torch.isnan(lse[0, 0]), torch.zeros(n, dtype=torch.bool) if kind == "v_nan" else want)
    keep = ~want
    # (The rows kept do not see the poisoned key, so any finite stand-in for it gives their
    # reference; the masked reference itself would spread a NaN value through 0 * NaN.)
    clean = [torch.nan_to_num(t.double(), nan=0.0, posinf=0.0) for t in (q, k, v)]
    ref, _ = _reference(*clean, pattern, 0.3)
    assert_close_to_reference(out[0, 0][keep], ref[0, 0][keep])


def test_star_forward_row_of_minus_inf_scores_is_empty():
    """Every score of a row -inf (an inf in the keys against a query of the other sign): out 0
    and lse -inf, as the reference's -inf-masked softmax, not NaN."""
    n = 6
    q = torch.zeros(1, 1, n, 2)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, 2)
    k[..., 0] = -float("inf")
    v = torch.randn(1, 1, n, 3)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, 0, 1, False, False, 1.0)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_star_forward_empty_and_bad_arguments():
    q = torch.randn(1, 2, 0, 4)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, q, q, 0, 1, False, False, 0.5)
    assert out.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(RuntimeError, match=r"relay must be a position of the sequence \(0..N-1 for N=5\); got 5"):
        torch.ops.attnkit.sparse_star_fwd(q, q, q, 5, 1, False, False, 0.5)
    with pytest.raises(RuntimeError, match="radius must be >= 1; got 0"):
        torch.ops.attnkit.sparse_star_fwd(q, q, q, 0, 0, False, False, 0.5)
    with pytest.raises(RuntimeError, match="q and k must have the same length"):
        torch.ops.attnkit.sparse_star_fwd(q, torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4), 0, 1, False, False, 0.5)


def test_star_forward_opcheck():
    q, k, v = _inputs(1, 2, 33, 8, 5, F32, seed=0)
    torch.library.opcheck(torch.ops.attnkit.sparse_star_fwd.default, (q, k, v, 3, 2, True, True, 0.4),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("causal", [False, True])
def test_sparse_attention_star_takes_the_fused_forward_without_gradients(monkeypatch, causal):
    """attnkit.sparse_attention (cpu): without gradients one sparse_star_fwd call, with them the
    composed path (which has a backward); both equal the reference."""
    calls = []
    real = torch.ops.attnkit.sparse_star_fwd

    class Spy:
        def __call__(self, *a):
            calls.append(a[3:8])
            return real(*a)

    from attnkit.ops import sparse as ops_sparse
    monkeypatch.setattr(ops_sparse.torch.ops.attnkit, "sparse_star_fwd", Spy())
    pattern = patterns.star(9, 2, True, causal)
    q, k, v = _inputs(2, 2, 130, 16, 16, F32, seed=5)
    ref, _ = _reference(q.double(), k.double(), v.double(), pattern, 0.25)
    with torch.no_grad():
        fast = attnkit.sparse_attention(q, k, v, pattern, scale=0.25, backend="cpu")
    assert calls == [(9, 2, True, causal, 0.25)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    slow = attnkit.sparse_attention(*leaves, pattern, scale=0.25, backend="cpu")
    assert len(calls) == 1  # the composed path
    slow.sum().backward()
    assert all(t.grad is not None for t in leaves)
    assert_close_to_reference(fast, ref)
    assert_close_to_reference(slow.detach(), ref)

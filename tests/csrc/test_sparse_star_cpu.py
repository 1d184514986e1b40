"""The star pattern of the CPU backend in one call each way (csrc/cpu/sparse_star.cpp, issue 14):
attnkit::sparse_star_fwd lists each row's keys (the relay's row: all of them; any other row: the
relay's key and the satellites within ``radius``, on a ring when ``cyclic``; ``causal`` keeps
j <= i) and folds them in one softmax; attnkit::sparse_star_bwd recomputes each visible pair's
probability once per row (dq) and once per key (dk, dv, over the rows that see the key).

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
from attnkit.reference.sparse import _masked_attention_bwd, _masked_attention_with_lse
from attnkit_testing import F64, assert_close_to_reference, has_cpu_kernel, num_threads

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

pytestmark = pytest.mark.skipif(not (has_cpu_kernel("sparse_star_fwd") and has_cpu_kernel("sparse_star_bwd")),
                                reason="attnkit._C without the fused star kernels")

CASES = [  # (n, relay, radius, cyclic, causal)
    (1, 0, 1, False, False), (1, 0, 3, True, True), (2, 1, 1, True, True), (2, 0, 1, False, False),
    (7, 3, 1, True, False), (9, 8, 2, False, True), (9, 8, 2, True, False), (10, 4, 4, True, True),
    (11, 0, 5, True, False), (100, 50, 3, True, True), (300, 0, 1, False, False), (300, 299, 2, True, True),
    (600, 257, 1, False, True), (600, 123, 7, True, False),
]


def _inputs(b, h, n, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, x, generator=g, dtype=F64).to(dtype) for x in (d, d, dv))


def _case_inputs(n, relay, radius, dtype):
    """q, k, v of a CASES row (D = Dv = 64 from 300 rows, else 17 and 9) and the scale 1/sqrt(D)."""
    d, dv = (64, 64) if n >= 300 else (17, 9)
    return (*_inputs(2, 3, n, d, dv, dtype, seed=n + relay + radius), d ** -0.5)


def _reference(q, k, v, pattern, scale):
    return _masked_attention_with_lse(q, k, v, pattern.mask(q.shape[2]), scale)


@pytest.mark.parametrize("n,relay,radius,cyclic,causal", CASES)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
def test_star_forward_matches_reference(n, relay, radius, cyclic, causal, dtype):
    q, k, v, scale = _case_inputs(n, relay, radius, dtype)
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


def _minus_inf_scores(n):
    """q, k, v whose every score is -inf: an inf in the keys against a query of the other sign."""
    q = torch.zeros(1, 1, n, 2)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, 2)
    k[..., 0] = -float("inf")
    return q, k, torch.randn(1, 1, n, 3)


def test_star_forward_row_of_minus_inf_scores_is_empty():
    """Every score of a row -inf: out 0 and lse -inf, as the reference's -inf-masked softmax,
    not NaN."""
    q, k, v = _minus_inf_scores(6)
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
def test_sparse_attention_star_runs_the_fused_kernels_with_and_without_gradients(monkeypatch, causal):
    """attnkit.sparse_attention (cpu): one sparse_star_fwd call per forward, with gradients or
    without, and one sparse_star_bwd call per backward; the results are the reference's."""
    calls = []
    ops = torch.ops.attnkit
    real_fwd, real_bwd = ops.sparse_star_fwd, ops.sparse_star_bwd

    class Spy:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __call__(self, *a, **kw):
            calls.append(self.name)
            return self.real(*a, **kw)

    from attnkit.ops import sparse as ops_sparse
    monkeypatch.setattr(ops_sparse.torch.ops.attnkit, "sparse_star_fwd", Spy("fwd", real_fwd))
    monkeypatch.setattr(ops_sparse.torch.ops.attnkit, "sparse_star_bwd", Spy("bwd", real_bwd))
    pattern = patterns.star(9, 2, True, causal)
    q, k, v = _inputs(2, 2, 130, 16, 16, F32, seed=5)
    dout = torch.randn(2, 2, 130, 16, generator=torch.Generator().manual_seed(1))
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = _reference(*leaves64, pattern, 0.25)
    ref_grads = torch.autograd.grad(ref, leaves64, dout.double())
    with torch.no_grad():
        fast = attnkit.sparse_attention(q, k, v, pattern, scale=0.25, backend="cpu")
    assert calls == ["fwd"]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.sparse_attention(*leaves, pattern, scale=0.25, backend="cpu")
    assert calls == ["fwd", "fwd"]
    out.backward(dout)
    assert calls == ["fwd", "fwd", "bwd"]
    assert_close_to_reference(fast, ref.detach())
    assert_close_to_reference(out.detach(), ref.detach())
    for name, t, want in zip(("dq", "dk", "dv"), leaves, ref_grads):
        assert_close_to_reference(t.grad, want, grad=True, name=name)


# ---------------------------------------------------------------------------------------------
# backward: attnkit::sparse_star_bwd
# ---------------------------------------------------------------------------------------------


def _delta_and_dout(lse, n, dv, dtype, seed):
    """A random dO and delta: with delta = rowsum(dO * O) the gradients of one-key rows are
    rounding noise (exactly 0 in exact arithmetic), no test of scale (as the strided tests do)."""
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(*lse.shape, dv, generator=g, dtype=F64).to(dtype)
    delta = torch.randn(lse.shape, generator=g, dtype=F64).to(lse.dtype)
    return dout, delta


@pytest.mark.parametrize("n,relay,radius,cyclic,causal", CASES)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
def test_star_backward_matches_reference(n, relay, radius, cyclic, causal, dtype):
    q, k, v, scale = _case_inputs(n, relay, radius, dtype)
    dv = v.shape[-1]
    _, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, relay, radius, cyclic, causal, scale)
    dout, delta = _delta_and_dout(lse, n, dv, dtype, seed=n)
    grads = torch.ops.attnkit.sparse_star_bwd(dout, q, k, v, lse, delta, relay, radius, cyclic, causal, scale)
    mask = patterns.star(relay, radius, cyclic, causal).mask(n)
    ref = _masked_attention_bwd(dout.to(F64), q.to(F64), k.to(F64), v.to(F64), lse.to(F64), delta.to(F64),
                                mask, scale)
    low = (_masked_attention_bwd(dout, q, k, v, lse.to(dtype), delta.to(dtype), mask, scale)
           if dtype in (BF16, F16) else (None,) * 3)
    for name, got, want, want_low in zip(("dq", "dk", "dv"), grads, ref, low):
        assert got.dtype == dtype and got.shape == want.shape
        assert_close_to_reference(got, want, want_low, grad=True, name=name)


@pytest.mark.parametrize("n,relay,radius,cyclic,causal",
                         [(2, 1, 1, True, True), (9, 8, 2, True, False), (300, 299, 2, True, True),
                          (600, 257, 1, False, True)])
@pytest.mark.parametrize("dtype", [F32, F64, BF16])
def test_star_backward_delta_from_out_and_lse_gradient(n, relay, radius, cyclic, causal, dtype):
    """Through autograd on the op: a loss on out (delta computed in the kernel from out) and one
    on out and lse (delta given: rowsum(dO * O) - dlse) against the float64 reference's autograd."""
    d, dv = (64, 64) if n >= 300 else (17, 9)
    q, k, v = _inputs(1, 2, n, d, dv, dtype, seed=3 * n + relay)
    scale = d ** -0.5
    g = torch.Generator().manual_seed(n)
    dout = torch.randn(1, 2, n, dv, generator=g, dtype=F64)
    dlse = torch.randn(1, 2, n, generator=g, dtype=F64)
    pattern = patterns.star(relay, radius, cyclic, causal)
    for with_lse in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = torch.ops.attnkit.sparse_star_fwd(*leaves, relay, radius, cyclic, causal, scale)
        loss = (out.to(F64) * dout).sum() + ((lse.to(F64) * dlse).sum() if with_lse else 0.0)
        grads = torch.autograd.grad(loss, leaves)
        refs = []
        for prec in (F64, dtype):
            ref_leaves = [t.to(prec).requires_grad_() for t in (q, k, v)]
            r_out, r_lse = _reference(*ref_leaves, pattern, scale)
            r_loss = (r_out.to(F64) * dout).sum() + ((r_lse.to(F64) * dlse).sum() if with_lse else 0.0)
            refs.append(torch.autograd.grad(r_loss, ref_leaves))
        for name, got, want, want_low in zip(("dq", "dk", "dv"), grads, *refs):
            assert got.dtype == dtype
            assert_close_to_reference(got, want, want_low if dtype == BF16 else None, grad=True,
                                      name=f"{name} (lse loss: {with_lse})")


def test_star_backward_thread_count_and_layout_do_not_change_the_result():
    """Each output row is written by one task from sums in a fixed order: 1, 2 and 3 threads
    give the same bits, and a non-contiguous grad_out the same as its contiguous copy."""
    q, k, v = _inputs(2, 2, 700, 32, 32, F32, seed=4)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, 5, 2, True, False, 0.2)
    dout, _ = _delta_and_dout(lse, 700, 32, F32, seed=2)
    runs = []
    for t in (1, 2, 3):
        with num_threads(t):
            runs.append(torch.ops.attnkit.sparse_star_bwd(dout, q, k, v, lse, None, 5, 2, True, False, 0.2, out))
    for grads in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, runs[0]))
    dt = dout.transpose(1, 2).contiguous().transpose(1, 2)
    assert not dt.is_contiguous()
    grads = torch.ops.attnkit.sparse_star_bwd(dt, q, k, v, lse, None, 5, 2, True, False, 0.2, out)
    assert all(torch.equal(a, b) for a, b in zip(grads, runs[0]))


def test_star_backward_nan_query_poisons_its_row_and_the_keys_it_sees():
    """Issue 15's rule through the backward: a NaN query makes its row's lse NaN, so its dq and
    the dk / dv of exactly the keys it sees are NaN; every other gradient is the reference's
    (for which any finite stand-in for that query gives the same)."""
    n, relay, radius, bad = 40, 7, 2, 20
    pattern = patterns.star(relay, radius, False, True)
    q, k, v = _inputs(1, 1, n, 8, 4, F32, seed=1)
    q[0, 0, bad, 1] = float("nan")
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, relay, radius, False, True, 0.3)
    dout, _ = _delta_and_dout(lse, n, 4, F32, seed=3)
    dq, dk, dv = torch.ops.attnkit.sparse_star_bwd(dout, q, k, v, lse, None, relay, radius, False, True, 0.3, out)
    seen = pattern.mask(n)[bad]
    row = torch.zeros(n, dtype=torch.bool)
    row[bad] = True
    assert torch.equal(torch.isnan(dq[0, 0]).any(-1), row) and torch.isnan(dq[0, 0, bad]).all()
    for g in (dk, dv):
        assert torch.equal(torch.isnan(g[0, 0]).any(-1), seen) and torch.isnan(g[0, 0][seen]).all()
    clean = q.double().clone()
    clean[0, 0, bad] = 0.0
    leaves = [clean.requires_grad_(), k.double().requires_grad_(), v.double().requires_grad_()]
    r_out, _ = _reference(*leaves, pattern, 0.3)
    ref = torch.autograd.grad(r_out, leaves, dout.double())
    assert_close_to_reference(dq[0, 0][~row], ref[0][0, 0][~row], grad=True, name="dq")
    for name, got, want in (("dk", dk, ref[1]), ("dv", dv, ref[2])):
        assert_close_to_reference(got[0, 0][~seen], want[0, 0][~seen], grad=True, name=name)


def test_star_backward_row_of_minus_inf_scores_passes_no_gradient():
    """A row whose scores are all -inf (lse -inf, out 0) contributes nothing: its dq is 0 and
    no key's dk / dv depends on it (here every row is such a row)."""
    q, k, v = _minus_inf_scores(6)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, 0, 1, False, False, 1.0)
    dq, dk, dv = torch.ops.attnkit.sparse_star_bwd(torch.randn_like(v), q, k, v, lse, None, 0, 1, False,
                                                   False, 1.0, out)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_star_backward_empty_and_bad_arguments():
    q = torch.randn(1, 2, 0, 4)
    lse = torch.empty(1, 2, 0)
    grads = torch.ops.attnkit.sparse_star_bwd(q, q, q, q, lse, None, 0, 1, False, False, 0.5, q)
    assert [g.shape for g in grads] == [(1, 2, 0, 4)] * 3
    q = torch.randn(1, 1, 5, 4)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, q, q, 0, 1, False, False, 0.5)
    with pytest.raises(RuntimeError, match="give delta, or out to compute it from"):
        torch.ops.attnkit.sparse_star_bwd(q, q, q, q, lse, None, 0, 1, False, False, 0.5)
    with pytest.raises(RuntimeError, match=r"relay must be a position of the sequence \(0..N-1 for N=5\); got 7"):
        torch.ops.attnkit.sparse_star_bwd(q, q, q, q, lse, None, 7, 1, False, False, 0.5, out)
    with pytest.raises(RuntimeError, match="radius must be >= 1; got 0"):
        torch.ops.attnkit.sparse_star_bwd(q, q, q, q, lse, None, 0, 0, False, False, 0.5, out)
    with pytest.raises(RuntimeError, match="out must be like grad_out"):
        torch.ops.attnkit.sparse_star_bwd(q, q, q, q, lse, None, 0, 1, False, False, 0.5, out[..., :3])
    with pytest.raises(RuntimeError, match="lse"):
        torch.ops.attnkit.sparse_star_bwd(q, q, q, q, lse[..., :4], None, 0, 1, False, False, 0.5, out)


def test_star_backward_opcheck_and_double_backward():
    q, k, v = _inputs(1, 2, 33, 8, 5, F32, seed=0)
    out, lse = torch.ops.attnkit.sparse_star_fwd(q, k, v, 3, 2, True, True, 0.4)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attnkit.sparse_star_bwd.default,
                          (dout, q, k, v, lse, None, 3, 2, True, True, 0.4, out),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.attnkit.sparse_star_fwd.default, (*(t.requires_grad_() for t in (q, k, v)),
                          3, 2, True, True, 0.4), test_utils=("test_autograd_registration",))
    # Second derivatives go through the float64 masked reference (as the strided op's do).
    leaves = [torch.randn(1, 1, 12, 4, dtype=F64, requires_grad=True) for _ in range(3)]
    torch.autograd.gradgradcheck(lambda a, b, c: torch.ops.attnkit.sparse_star_fwd(a, b, c, 4, 1, True, False,
                                                                                   0.5)[0], leaves)

"""The runtime tile-GEMM path of the CPU sparse kernels (issue 25, csrc/cpu/sparse.cpp; the choice in
csrc/cpu/gemm_path.h): range parts and block-sparse forward / backward and the fused strided ops
multiply their tiles with attnkit's float32 GEMM (``native``) or, for bfloat16 / float16, with oneDNN's
brgemm on operands rounded to the dtype (``brgemm``: AMX on a Xeon, torch's exact reference fallback
on a CPU without it) or on attnkit's scalar model of the AMX brgemm (``emulate``: the VNNI layout,
with oneDNN's K-tail NaN defect reproduced), forced by ``ATTNKIT_CPU_GEMM``.  The star ops
(csrc/cpu/sparse_star.cpp) take each row's few keys by dot products, no tile GEMM: they run as
before whatever the path, and are checked here end to end only.

Each forced path against the float64 reference by DESIGN.md's rule (bfloat16 / float16: twice the
error of the reference run in that dtype, plus 1e-3; tests/csrc/test_sparse_cpu.py's helpers), forward
and gradients, on shapes off the kernels' tiles with K tails that are not a multiple of 32 (D = 17, 40,
72), every pattern the kernels serve (strided, fixed, star, block layouts), one and two threads, NaN
/ inf inputs by issue 15's rules, and empty sequences.  The scalar paths are slow: shapes stay small.
"""
import pytest
import torch

import attnkit
from attnkit import _dispatch, patterns
from attnkit.reference.sparse import _masked_attention_bwd, _masked_attention_with_lse
from attnkit_testing import F64, assert_close_to_reference, has_cpu_kernel, num_threads

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ENV = "ATTNKIT_CPU_GEMM"
V1 = [1, 0, 1, 0, 1]
NONE_LO = [0, 1, 0, 0]
NONE_HI = [0, 1, 0, 2 ** 40]

pytestmark = pytest.mark.skipif(not has_cpu_kernel("sparse_strided_fwd"), reason="attnkit._C is not built")


def sparse_cpu():
    import test_sparse_cpu  # tests/csrc is on sys.path under pytest (rootdir without __init__.py)

    return test_sparse_cpu


def gemm_path(dtype):
    return _dispatch.native().cpu_gemm_path(str(dtype).removeprefix("torch."))


# ----------------------------------------------------------------------------------------------
# the choice is read by every op
# ----------------------------------------------------------------------------------------------


def test_bad_value_raises_in_every_sparse_op(monkeypatch):
    monkeypatch.setenv(ENV, "amx-bf16")
    q = torch.randn(1, 1, 32, 8, dtype=BF16)
    lse = torch.zeros(1, 1, 32)
    ptr = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    ops = torch.ops.attnkit
    calls = {
        "sparse_range_fwd": lambda: ops.sparse_range_fwd(q, q, q, V1, NONE_LO, NONE_HI, 0.3),
        "sparse_range_bwd": lambda: ops.sparse_range_bwd(q, q, q, q, lse, lse, V1, NONE_LO, NONE_HI, 0.3),
        "block_sparse_fwd": lambda: ops.block_sparse_fwd(q, q, q, ptr, idx, 16, False, 0.3),
        "block_sparse_bwd": lambda: ops.block_sparse_bwd(q, q, q, q, lse, lse, ptr, idx, ptr, idx, 16, False, 0.3),
        "sparse_strided_fwd": lambda: ops.sparse_strided_fwd(q, q, q, 4, True, 0.3),
        "sparse_strided_bwd": lambda: ops.sparse_strided_bwd(q, q, q, q, lse, lse, 4, True, 0.3),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="ATTNKIT_CPU_GEMM must be one of auto, native, brgemm, amx, split, emulate"):
            call()
    # float32 inputs always run native, but the value is checked all the same
    with pytest.raises(RuntimeError, match="ATTNKIT_CPU_GEMM must be one of"):
        ops.sparse_strided_fwd(q.float(), q.float(), q.float(), 4, True, 0.3)


# ----------------------------------------------------------------------------------------------
# numbers: the primitives (range parts, block-sparse) against the float64 reference
# ----------------------------------------------------------------------------------------------

# (name, nq, nk, d, dv, view, lo, hi), as tests/csrc/test_sparse_cpu.py's RANGE_CASES: D = 17, 40, 72
# leave K tails of 17, 8, 8 past a multiple of 32 in Q K^T; the windows (P V), query steps and key
# tiles (dK, dQ) leave others.
RANGE_CASES = [
    ("band_d40", 67, 67, 40, 24, V1, [-9, 1, 1, 0], [0, 1, 1, 0]),
    ("strided_columns_d17", 67, 67, 17, 9, [8, 1, 8, 1, 8], [0, 1, 0, 0], [-2, 1, 1, 0]),  # strided view
    ("strided_noncausal_columns_d72", 61, 61, 72, 40, [5, 1, 5, 1, 5], [2, 1, 1, 0], NONE_HI),
    ("fixed_own_block_d40", 63, 63, 40, 40, V1, [0, 8, 8, 0], [0, 1, 1, 0]),
    ("fixed_summary_d72", 63, 16, 72, 24, V1, NONE_LO, [0, 8, 2, -1]),
    ("wide_full_d40", 100, 210, 40, 17, V1, NONE_LO, NONE_HI),  # 48-row strips (range > 192 keys)
    ("shared_keys_d17", 20, 20, 17, 8, [2, 1, 2, 0, 1], [-3, 1, 2, 0], [0, 1, 2, 0]),
    ("empty_ranges_d40", 20, 20, 40, 8, V1, [0, 1, 1, 5], [0, 1, 1, 0]),
]


def alternating_dtypes(cases, ids):
    """The cases with bfloat16 and float16 taking turns (both dtypes, half the slow references)."""
    return [pytest.param(case, (BF16, F16)[i % 2], id=f"{name}-{str((BF16, F16)[i % 2])[6:]}")
            for i, (case, name) in enumerate(zip(cases, ids))]


@pytest.mark.parametrize("case,dtype", alternating_dtypes(RANGE_CASES, [c[0] for c in RANGE_CASES]))
def test_range_parts_match_reference(forced, case, dtype):
    sparse_cpu()._check_range_case(case, dtype, seed=3)


# (block, nb, hl, causal, d, dv): blocks below, at and above the 64-row tiles; key chunks of several
# gathered blocks.
BLOCK_CASES = [(16, 5, 2, True, 40, 24), (24, 4, 1, False, 17, 9), (80, 2, 1, True, 72, 40)]


@pytest.mark.parametrize("case,dtype", alternating_dtypes(BLOCK_CASES + BLOCK_CASES[:1], list(map(str, BLOCK_CASES * 2))))
def test_block_sparse_matches_reference(forced, case, dtype):
    sparse_cpu()._check_block_case(case, dtype, seed=2)


def test_float32_ignores_a_forced_brgemm(forced):
    assert gemm_path(F32) == "native"
    sparse_cpu()._check_range_case(RANGE_CASES[0], F32)
    sparse_cpu()._check_block_case(BLOCK_CASES[0], F32)


# ----------------------------------------------------------------------------------------------
# numbers: the fused strided ops
# ----------------------------------------------------------------------------------------------


def strided_inputs(b, h, n, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, x, generator=g, dtype=F64).to(dtype) for x in (d, d, dv, dv)]


def check_fused_strided(n, s, causal, d, dv, dtype, b=1, h=2, seed=0):
    q, k, v, dout = strided_inputs(b, h, n, d, dv, dtype, seed)
    scale = d ** -0.5
    mask = patterns.strided(s, causal).mask(n)
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, causal, scale)
    ref, ref_lse = _masked_attention_with_lse(q.to(F64), k.to(F64), v.to(F64), mask, scale)
    low, low_lse = _masked_attention_with_lse(q, k, v, mask, scale)
    assert_close_to_reference(out, ref, low, name="out")
    assert_close_to_reference(lse, ref_lse, low_lse.float(), name="lse", dtype=dtype)
    # a random delta, as tests/csrc/test_sparse_strided_cpu.py (rowsum(dO * O) leaves rounding noise)
    delta = torch.randn(lse.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).float()
    grads = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, delta, s, causal, scale)
    want = _masked_attention_bwd(dout.to(F64), q.to(F64), k.to(F64), v.to(F64), lse.to(F64), delta.to(F64),
                                 mask, scale)
    want_low = _masked_attention_bwd(dout, q, k, v, lse.to(dtype), delta.to(dtype), mask, scale)
    for name, got, ref64, ref_low in zip(("dq", "dk", "dv"), grads, want, want_low):
        assert got.dtype == dtype
        assert_close_to_reference(got, ref64, ref_low, grad=True, name=name)


# (n, s, causal, d, dv): strides at and below the band strips (state in place, copied), s >= n.
STRIDED_CASES = [(67, 8, True, 40, 24), (97, 3, False, 17, 9), (130, 200, True, 72, 40)]


@pytest.mark.parametrize("case,dtype", alternating_dtypes(STRIDED_CASES, ["-".join(map(str, c)) for c in STRIDED_CASES]))
def test_fused_strided_matches_reference(forced, case, dtype):
    n, s, causal, d, dv = case
    check_fused_strided(n, s, causal, d, dv, dtype, seed=n + s)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_strided_thread_counts(forced, threads):
    """Two super-blocks of 500 rows (n = 520, s = 100), one head: on two threads the forward splits it
    into two segments; then two heads of a batch of 2."""
    with num_threads(threads):
        check_fused_strided(520, 100, False, 40, 17, BF16, b=1, h=1, seed=5)
        check_fused_strided(100, 9, False, 17, 9, F16, b=2, h=1, seed=6)


# ----------------------------------------------------------------------------------------------
# numbers: every pattern family end to end (attnkit.sparse_attention, cpu backend, autograd)
# ----------------------------------------------------------------------------------------------


def families(n):
    """test_sparse_cpu's pattern families (every kind the kernels serve), at N = n."""
    import test_sparse_cpu  # tests/csrc is on sys.path under pytest (rootdir without __init__.py)

    return test_sparse_cpu._families(n)


def sparse_run(backend, q, k, v, pattern, dout, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = attnkit.sparse_attention(q, k, v, pattern, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return [t.detach() for t in (out, *grads)]


# Every family on one thread in bfloat16; those of the tile kernels on two threads in float16 (two
# heads: the fused strided backward on one thread, the range parts' on two, as attnkit.ops.sparse
# routes them).
PATTERN_RUNS = [(family, 1) for family in families(96)] + [(family, 2) for family in ("strided", "fixed",
                                                                                     "block_layout")]


@pytest.mark.parametrize("family,threads", PATTERN_RUNS, ids=[f"{f}-{t}" for f, t in PATTERN_RUNS])
def test_patterns_end_to_end(forced, family, threads):
    n, d, dv = 96, 40, 24
    dtype = BF16 if threads == 1 else F16
    pattern = families(n)[family]
    q, k, v, dout = strided_inputs(1, 2, n, d, dv, dtype, seed=len(family))
    with num_threads(threads):
        got = sparse_run("cpu", q, k, v, pattern, dout, dtype)
    ref64 = sparse_run("reference", q, k, v, pattern, dout, F64)
    low = sparse_run("reference", q, k, v, pattern, dout, dtype)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_close_to_reference(got[i], ref64[i], low[i], grad=i > 0, name=name, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# the path is taken
# ----------------------------------------------------------------------------------------------


def test_brgemm_paths_round_p_and_ds(monkeypatch):
    """Under brgemm and emulate the kernels multiply P (and, backward, P and dS) rounded to the dtype,
    where the native tiles multiply them in float32: the results differ from the native ones (so the
    path is taken) by little (a few units of the dtype's last place of the largest entry); both are
    within the rule (the tests above)."""
    d, dv, n, s = 40, 24, 67, 8
    q, k, v, dout = strided_inputs(1, 2, n, d, dv, F64, seed=9)
    for dtype in (BF16, F16):
        q16, k16, v16, g16 = (t.to(dtype) for t in (q, k, v, dout))
        res = {}
        for path in ("native", "brgemm", "emulate"):
            monkeypatch.setenv(ENV, path)
            out, lse = torch.ops.attnkit.sparse_strided_fwd(q16, k16, v16, s, True, d ** -0.5)
            grads = torch.ops.attnkit.sparse_strided_bwd(g16, q16, k16, v16, lse, None, s, True, d ** -0.5, out)
            rng = torch.ops.attnkit.sparse_range_fwd(q16, k16, v16, V1, [-20, 1, 1, 0], [0, 1, 1, 0], d ** -0.5)
            res[path] = (out, *grads, rng[0])
        for path in ("brgemm", "emulate"):
            for name, a, b in zip(("out", "dq", "dk", "dv", "range out"), res["native"], res[path]):
                assert not torch.equal(a, b), f"{name} ({dtype}, {path}): the native kernels' bits"
                size = a.double().abs().max().item()
                assert (a.double() - b.double()).abs().max().item() <= 4 * torch.finfo(dtype).eps * size, name


# ----------------------------------------------------------------------------------------------
# NaN / inf (issue 15's rules, as tests/csrc/test_sparse_cpu.py checks them), with K tails
# ----------------------------------------------------------------------------------------------

# The primitives' poisoned-input tests (exact NaN rows against the float64 reference, fully masked rows
# 0 / -inf, no NaN dropped in the gradients) at D = 40 and 72: Q K^T reduces over D, so under
# ``emulate`` a Q with a NaN row spoils the row above it unless D is zero-padded to a multiple of 32,
# and these exact NaN-row checks catch it.  (Checked: with TileGemm's K padding in csrc/cpu/sparse.cpp cut
# to a multiple of 2, 5 of the 18 emulate cases below fail -- the q_nan ones of the range and block tests
# and both of test_fused_strided_nan_row_is_exact -- on the row above the NaN row.)
NAN_RANGE_CASES = [
    ("band_d40", 70, 70, 40, 24, V1, [-9, 1, 1, 0], [0, 1, 1, 0]),
    ("strided_columns_d72", 67, 67, 72, 40, [8, 1, 8, 1, 8], [0, 1, 0, 0], [-2, 1, 1, 0]),
]


@pytest.mark.parametrize("kind", ("q_nan", "k_nan", "k_inf", "q_inf", "v_nan"))
@pytest.mark.parametrize("case", NAN_RANGE_CASES, ids=[c[0] for c in NAN_RANGE_CASES])
def test_range_nonfinite_under_k_tails(forced, case, kind):
    sparse_cpu().test_range_nonfinite(case, BF16 if kind != "k_inf" else F16, kind)


@pytest.mark.parametrize("kind", ("q_nan", "k_nan", "v_nan"))
def test_block_sparse_nonfinite_under_k_tails(forced, kind):
    # test_sparse_cpu.test_block_sparse_nonfinite on a case of its own: blocks of 24 rows, D = 40
    sparse_cpu().test_block_sparse_nonfinite((24, 4, 2, False, 40, 24), F16 if kind == "k_nan" else BF16, kind)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_fused_strided_nan_row_is_exact(forced, dtype):
    """A NaN in one query row (D = 40): exactly that row's out and lse are NaN, every other row finite;
    the backward's dq is NaN on that row and finite on the rows of other residues' strips."""
    n, s, d = 150, 8, 40
    q, k, v, dout = strided_inputs(1, 2, n, d, 24, dtype, seed=4)
    row = 101
    q[0, 1, row, 5] = float("nan")
    out, lse = torch.ops.attnkit.sparse_strided_fwd(q, k, v, s, True, d ** -0.5)
    nan_rows = torch.isnan(out).any(-1)
    want = torch.zeros_like(nan_rows)
    want[0, 1, row] = True
    assert torch.equal(nan_rows, want), f"NaN rows {nan_rows.nonzero().tolist()}"
    assert torch.equal(torch.isnan(lse), want) and torch.isfinite(out[~want]).all()
    dq, dk, dv = torch.ops.attnkit.sparse_strided_bwd(dout, q, k, v, lse, None, s, True, d ** -0.5, out)
    assert torch.isnan(dq[0, 1, row]).all()
    assert torch.isfinite(dq[0, 0]).all() and torch.isfinite(dk[0, 0]).all() and torch.isfinite(dv[0, 0]).all()
    seen = patterns.strided(s).mask(n)[row]
    assert torch.isnan(dk[0, 1, seen]).any(-1).all()


@pytest.mark.parametrize("family,kind", [("strided", "q_nan"), ("block_layout", "q_nan"), ("strided", "k_nan"),
                                         ("block_layout", "v_nan")])
def test_patterns_nonfinite_end_to_end(forced, family, kind):
    sparse_cpu().test_sparse_attention_nonfinite_end_to_end(family, BF16, kind)


# ----------------------------------------------------------------------------------------------
# empty sequences
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_empty_sequences(forced, dtype):
    ops = torch.ops.attnkit
    # a range part with no keys: every row 0 / -inf, zero gradients
    sparse_cpu()._check_range_case(("no_keys", 5, 0, 40, 8, V1, NONE_LO, NONE_HI), dtype)
    for n in (0,):
        q = torch.randn(1, 2, n, 40, dtype=dtype)
        out, lse = ops.sparse_strided_fwd(q, q, q, 4, True, 0.2)
        assert out.shape == (1, 2, 0, 40) and lse.shape == (1, 2, 0)
        grads = ops.sparse_strided_bwd(q, q, q, q, lse, lse, 4, True, 0.2)
        assert [g.shape for g in grads] == [q.shape] * 3
        out, lse = ops.sparse_range_fwd(q, q, q, V1, NONE_LO, NONE_HI, 0.2)
        assert out.shape == (1, 2, 0, 40)
        grads = ops.sparse_range_bwd(q, q, q, q, lse, lse, V1, NONE_LO, NONE_HI, 0.2)
        assert [g.shape for g in grads] == [q.shape] * 3
    # no batch
    q = torch.randn(0, 2, 32, 40, dtype=dtype)
    ptr = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    out, lse = ops.block_sparse_fwd(q, q, q, ptr, idx, 16, False, 0.2)
    assert out.shape == q.shape
    grads = ops.block_sparse_bwd(q, q, q, q, lse, lse, ptr, idx, ptr, idx, 16, False, 0.2)
    assert [g.shape for g in grads] == [q.shape] * 3

"""The C++ CPU sparse-attention primitives (csrc/cpu/sparse.cpp), called directly through torch.ops:
attnkit::sparse_range_fwd / _bwd (one "range part" on affine row views) and
attnkit::block_sparse_fwd / _bwd (block layouts as per-row index lists).

Ground truth: pytorch_ext/reference/sparse.py in float64 on the same (already rounded) inputs;
tolerances from DESIGN.md via assert_close_to_reference.  The backward is given a random delta
and a *merged* lse (the lse of all keys, as when this part is merged with others), so
P = exp(s - lse) is not the part's own softmax.

The kernel's range forward takes 256-query tasks, keys packed in chunks of up to 384 (equal
sizes), and strips of 16 query rows (48 when the range is wider than 192 keys) whose GEMMs
cover only the union of the strip's row ranges; the backward 32 keys x 64 queries; block-sparse in 64-row tiles with key
chunks of up to 256 gathered keys.  Sizes below straddle those edges (1, 7, 63, 129, 300).
"""
import pytest
import torch

import attnkit  # noqa: F401  (loads attnkit._C, which registers the ops)
from attnkit.reference.sparse import (
    block_lists_mask,
    range_part_mask,
    block_sparse_bwd_reference,
    block_sparse_reference,
    sparse_range_bwd_reference,
    sparse_range_reference,
)
from attnkit_testing import (F64, assert_close_to_reference, finite_inputs, has_cpu_kernel, nan_spreading_matmul,
                             without_spread_nan)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NONE_LO = [0, 1, 0, 0]          # lo(t) = 0
NONE_HI = [0, 1, 0, 2 ** 40]    # hi(t) = "no bound"
V1 = [1, 0, 1, 0, 1]


def test_cpu_kernels_are_registered():
    for name in ("sparse_range_fwd", "sparse_range_bwd", "block_sparse_fwd", "block_sparse_bwd"):
        assert has_cpu_kernel(name), name


def _acc(dtype):
    return F64 if dtype == F64 else F32


def _inputs(b, h, nq, nk, d, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g, dtype=F64).to(dtype)
               for s in ((b, h, nq, d), (b, h, nk, d), (b, h, nk, dv)))
    dout = torch.randn(b, h, nq, dv, generator=g, dtype=F64).to(dtype)
    delta = torch.randn(b, h, nq, generator=g, dtype=F64).to(_acc(dtype))
    return q, k, v, dout, delta


def _merged_lse(q, k, scale, dtype):
    """lse over all keys (>= the part's own lse, as a merged lse is); row 0 of head 0 set to
    -inf (a row the merge found empty: no gradient)."""
    s = (q.to(F64) @ k.to(F64).transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1) if k.shape[-2] > 0 else torch.full(s.shape[:-1], -float("inf"), dtype=F64)
    lse[0, 0, 0] = -float("inf")
    return lse.to(_acc(dtype))


def _check(got, ref64, ref_lowp, dtype, names, grad=False):
    for x, r, rl, name in zip(got, ref64, ref_lowp if ref_lowp is not None else [None] * len(got), names):
        assert x.dtype == (dtype if name not in ("lse",) else _acc(dtype)), name
        assert_close_to_reference(x, r, rl, grad=grad, name=name, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# range parts
# ----------------------------------------------------------------------------------------------


def strided_causal(s):
    return [(V1, [-s, 1, 1, 0], [0, 1, 1, 0]), ([s, 1, s, 1, s], [0, 1, 0, 0], [-2, 1, 1, 0])]


def strided_noncausal(s):
    return [(V1, [-s, 1, 1, 0], [s, 1, 1, 0]), ([s, 1, s, 1, s], NONE_LO, [-2, 1, 1, 0]),
            ([s, 1, s, 1, s], [2, 1, 1, 0], NONE_HI)]


# (name, nq, nk, d, dv, view, lo, hi)
RANGE_CASES = []
for _n in (1, 7, 129):
    for _s in (1, 3, 64):
        for _i, (_view, _lo, _hi) in enumerate(strided_causal(_s)):
            RANGE_CASES.append((f"strided_causal_s{_s}_n{_n}_part{_i}", _n, _n, 16, 16, _view, _lo, _hi))
for _i, (_view, _lo, _hi) in enumerate(strided_noncausal(3)):
    RANGE_CASES.append((f"strided_noncausal_s3_part{_i}", 100, 100, 8, 8, _view, _lo, _hi))
for _i, (_view, _lo, _hi) in enumerate(strided_noncausal(64)):
    RANGE_CASES.append((f"strided_noncausal_s64_part{_i}", 200, 200, 16, 16, _view, _lo, _hi))
RANGE_CASES += [
    # fixed (stride l = 8, summary c = 2): own block, then summary keys gathered (N c / l rows)
    ("fixed_own_block", 63, 63, 16, 16, V1, [0, 8, 8, 0], [0, 1, 1, 0]),
    ("fixed_summary", 63, 16, 16, 16, V1, NONE_LO, [0, 8, 2, -1]),
    ("star_band", 50, 50, 16, 16, V1, [-5, 1, 1, 0], [5, 1, 1, 0]),
    ("wide_full", 300, 300, 16, 24, V1, NONE_LO, NONE_HI),          # 64-row tiles, 2 key chunks
    ("wide_causal", 300, 300, 16, 16, V1, NONE_LO, [0, 1, 1, 0]),
    ("empty_ranges", 20, 20, 8, 8, V1, [0, 1, 1, 5], [0, 1, 1, 0]),  # lo > hi everywhere
    ("floor_negative", 40, 30, 8, 8, V1, [-5, 3, 2, -1], [4, 2, 3, 1]),
    ("uncovered_rows", 21, 21, 8, 8, [1, 0, 2, 0, 1], [-4, 1, 1, 0], [0, 1, 1, 0]),
    ("groups_without_keys", 20, 2, 8, 8, [4, 1, 4, 1, 4], NONE_LO, NONE_HI),
    ("empty_groups", 7, 7, 8, 8, [64, 1, 64, 1, 64], NONE_LO, NONE_HI),
    ("shared_keys", 20, 20, 8, 8, [2, 1, 2, 0, 1], [-3, 1, 2, 0], [0, 1, 2, 0]),
    ("odd_dims", 33, 33, 5, 3, V1, [-7, 1, 1, 0], [0, 1, 1, 0]),
    ("dims_80_96", 70, 70, 80, 96, V1, [-20, 1, 1, 0], [3, 1, 1, 0]),
    ("no_keys", 5, 0, 8, 8, V1, NONE_LO, NONE_HI),
    # forward tasks of 256 queries: a band across three of them (and their packed key chunks)
    ("band_super_tiles", 600, 600, 16, 16, V1, [-40, 1, 1, 0], [0, 1, 1, 0]),
    # 48-row strips over several equal key chunks (span 900 -> 3 x 304 keys): online softmax
    # across chunks, strips whose window ends inside a later chunk
    ("wide_chunks", 300, 900, 16, 16, V1, NONE_LO, NONE_HI),
    ("wide_chunks_causal", 700, 700, 16, 16, V1, NONE_LO, [100, 1, 1, 0]),
    # 48-key blocks: 16-row strips straddle the blocks (their window spans two)
    ("own_block_48", 300, 300, 16, 16, V1, [0, 48, 48, 0], [0, 1, 1, 0]),
    # gaps: rows whose ranges are empty in the middle of a strip (lo jumps past hi)
    ("gapped_rows", 90, 90, 8, 8, V1, [0, 3, 3, 0], [-1, 3, 3, 1]),
    # strided view with a wide range and rows past 256 per group
    ("strided_long_groups", 650, 650, 16, 16, [2, 1, 2, 1, 2], [-300, 1, 1, 0], [0, 1, 1, 0]),
]


def _check_range_case(case, dtype, b=1, h=2, seed=0):
    name, nq, nk, d, dv, view, lo, hi = case
    scale = d ** -0.5
    q, k, v, dout, delta = _inputs(b, h, nq, nk, d, dv, dtype, seed)
    out, lse = torch.ops.attnkit.sparse_range_fwd(q, k, v, view, lo, hi, scale)
    r64 = [t.to(F64) for t in (q, k, v)]
    ref = sparse_range_reference(*r64, view, lo, hi, scale)
    ref_lp = sparse_range_reference(q, k, v, view, lo, hi, scale) if dtype in (BF16, F16) else None
    assert_close_to_reference(out, ref[0], None if ref_lp is None else ref_lp[0], name="out")
    assert_close_to_reference(lse, ref[1], None if ref_lp is None else ref_lp[1].float(), name="lse",
                              dtype=dtype)
    assert out.dtype == dtype and lse.dtype == _acc(dtype)

    mlse = _merged_lse(q, k, scale, dtype)
    grads = torch.ops.attnkit.sparse_range_bwd(dout, q, k, v, mlse, delta, view, lo, hi, scale)
    gref = sparse_range_bwd_reference(dout.to(F64), *r64, mlse.to(F64), delta.to(F64), view, lo, hi, scale)
    gref_lp = (sparse_range_bwd_reference(dout, q, k, v, mlse.to(dtype), delta.to(dtype), view, lo, hi, scale)
               if dtype in (BF16, F16) else [None] * 3)
    for x, r, rl, gname in zip(grads, gref, gref_lp, ("dq", "dk", "dv")):
        assert x.dtype == dtype and x.shape == r.shape, gname
        assert_close_to_reference(x, r, rl, grad=True, name=gname)


@pytest.mark.parametrize("case", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_range_float32(case):
    _check_range_case(case, F32)


@pytest.mark.parametrize("case", [c for c in RANGE_CASES if c[0] in (
    "strided_causal_s3_n129_part0", "strided_causal_s3_n129_part1", "fixed_summary", "floor_negative",
    "shared_keys", "wide_full", "uncovered_rows", "wide_chunks", "own_block_48")], ids=str)
@pytest.mark.parametrize("dtype", [F64, BF16, F16], ids=str)
def test_range_dtypes(case, dtype):
    _check_range_case(case, dtype, seed=1)


def test_range_batch_and_chunks():
    # B*H = 3 units on 2+ threads: the backward splits key tiles into chunks (own dQ buffers).
    _check_range_case(("b3", 150, 150, 16, 16, V1, [-40, 1, 1, 0], [0, 1, 1, 0]), F32, b=3, h=1, seed=2)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("n", [60, 150])
def test_range_strided_view_chunks(n, dtype):
    # Three groups of a strided view on one head: 3 units, so the backward splits key tiles
    # into chunks; its dQ rows are gathered into a local buffer and scattered; with n = 60 a
    # group has one key tile, so the second chunk only zeroes its dQ rows.
    _check_range_case(("strided_chunks", n, n, 16, 8, [3, 1, 3, 1, 3], [-20, 1, 1, 0], [0, 1, 1, 0]),
                      dtype, b=1, h=1, seed=5)


def test_range_parts_partition_strided_causal():
    # The two parts of the strided causal pattern cover its mask exactly once (what the lead's
    # merge relies on), and merging the kernel's parts by lse gives the pattern's attention.
    n, s, d = 100, 8, 16
    q, k, v, _, _ = _inputs(1, 1, n, n, d, d, F32, 3)
    outs, lses = zip(*(torch.ops.attnkit.sparse_range_fwd(q, k, v, *p, d ** -0.5) for p in strided_causal(s)))
    lse = torch.logaddexp(*lses)
    out = sum(o * torch.exp(l - lse).unsqueeze(-1) for o, l in zip(outs, lses))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (j <= i) & ((i - j <= s) | ((i - j) % s == 0))
    ref = torch.softmax((q.double() @ k.double().mT * d ** -0.5).masked_fill(~mask, -float("inf")), -1) @ v.double()
    assert_close_to_reference(out, ref)


def test_range_rejects_overlapping_query_groups():
    q = torch.randn(1, 1, 10, 4)
    with pytest.raises(RuntimeError, match="two groups"):
        torch.ops.attnkit.sparse_range_fwd(q, q, q, [2, 0, 1, 0, 1], NONE_LO, NONE_HI, 1.0)
    with pytest.raises(RuntimeError, match="d >= 1"):
        torch.ops.attnkit.sparse_range_fwd(q, q, q, V1, [0, 0, 1, 0], NONE_HI, 1.0)


def test_range_backward_is_deterministic():
    case = ("det", 129, 129, 16, 16, V1, [-64, 1, 1, 0], [0, 1, 1, 0])
    q, k, v, dout, delta = _inputs(1, 1, 129, 129, 16, 16, F32, 4)
    lse = _merged_lse(q, k, 0.25, F32)
    a = torch.ops.attnkit.sparse_range_bwd(dout, q, k, v, lse, delta, *case[5:], 0.25)
    b = torch.ops.attnkit.sparse_range_bwd(dout, q, k, v, lse, delta, *case[5:], 0.25)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# block-sparse
# ----------------------------------------------------------------------------------------------


def _lists(layout):
    """(row_ptr, col_idx, col_ptr, row_idx) int32 of a bool layout [Hl, nb, nb] (as
    BlockLayout.index_lists, but without dropping blocks above the diagonal)."""
    out = []
    for m in (layout, layout.transpose(1, 2)):
        hl, nb = m.shape[0], m.shape[1]
        flat = torch.zeros(hl * nb + 1, dtype=torch.int64)
        flat[1:] = m.sum(-1).reshape(-1).cumsum(0)  # absolute offsets, heads one after another
        ptr = torch.stack([flat[i * nb:(i + 1) * nb + 1] for i in range(hl)])
        out += [ptr.to(torch.int32), m.nonzero()[:, 2].to(torch.int32)]
    return out


def _random_layout(hl, nb, seed, causal):
    g = torch.Generator().manual_seed(seed)
    lay = torch.rand(hl, nb, nb, generator=g) < 0.5
    lay[:, :, 0] |= torch.rand(hl, nb, generator=g) < 0.5
    if nb > 2:
        lay[:, nb // 2, :] = False                # an empty query-block row
    if causal and nb > 2:
        lay[:, 0, nb - 1] = True                  # above the diagonal: no entry survives
    return lay


BLOCK_CASES = [  # (block, nb, hl, causal, d, dv)
    (16, 5, 1, False, 16, 16),
    (16, 5, 2, True, 16, 16),
    (24, 4, 2, False, 8, 12),
    (24, 4, 1, True, 8, 8),
    (64, 3, 2, True, 16, 16),
    (64, 3, 1, False, 16, 16),
    (1, 9, 2, True, 4, 4),
    (300, 1, 1, True, 8, 8),     # a block larger than the 256-key chunks and 64-row tiles
]


def _check_block_case(case, dtype, seed=0, b=1, h=2):
    block, nb, hl, causal, d, dv = case
    n = block * nb
    scale = d ** -0.5
    lay = _random_layout(hl, nb, seed, causal)
    row_ptr, col_idx, col_ptr, row_idx = _lists(lay)
    q, k, v, dout, delta = _inputs(b, h, n, n, d, dv, dtype, seed)
    out, lse = torch.ops.attnkit.block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale)
    r64 = [t.to(F64) for t in (q, k, v)]
    ref = block_sparse_reference(*r64, row_ptr, col_idx, block, causal, scale)
    lp = dtype in (BF16, F16)
    ref_lp = block_sparse_reference(q, k, v, row_ptr, col_idx, block, causal, scale) if lp else None
    assert_close_to_reference(out, ref[0], ref_lp[0] if lp else None, name="out")
    assert_close_to_reference(lse, ref[1], ref_lp[1].float() if lp else None, name="lse", dtype=dtype)
    if nb > 2:
        assert torch.isinf(lse[:, :, (nb // 2) * block:(nb // 2 + 1) * block]).all()  # the empty row

    mlse = _merged_lse(q, k, scale, dtype)
    grads = torch.ops.attnkit.block_sparse_bwd(dout, q, k, v, mlse, delta, row_ptr, col_idx, col_ptr,
                                               row_idx, block, causal, scale)
    gref = block_sparse_bwd_reference(dout.to(F64), *r64, mlse.to(F64), delta.to(F64), row_ptr, col_idx,
                                      block, causal, scale)
    gref_lp = (block_sparse_bwd_reference(dout, q, k, v, mlse.to(dtype), delta.to(dtype), row_ptr,
                                          col_idx, block, causal, scale) if lp else [None] * 3)
    for x, r, rl, gname in zip(grads, gref, gref_lp, ("dq", "dk", "dv")):
        assert x.dtype == dtype and x.shape == r.shape, gname
        assert_close_to_reference(x, r, rl, grad=True, name=gname)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
def test_block_sparse_float32(case):
    _check_block_case(case, F32)


@pytest.mark.parametrize("case", [BLOCK_CASES[1], BLOCK_CASES[2], BLOCK_CASES[4]], ids=str)
@pytest.mark.parametrize("dtype", [F64, BF16, F16], ids=str)
def test_block_sparse_dtypes(case, dtype):
    _check_block_case(case, dtype, seed=1)


def test_block_sparse_matches_block_layout_lists():
    # The lists BlockLayout.index_lists() builds are what the kernel reads.
    from attnkit.patterns import BlockLayout

    lay = _random_layout(2, 4, 5, False)
    for causal in (False, True):
        bl = BlockLayout(lay, block=16, causal=causal)
        row_ptr, col_idx, col_ptr, row_idx = bl.index_lists()
        q, k, v, _, _ = _inputs(1, 2, 64, 64, 8, 8, F32, 6)
        out, lse = torch.ops.attnkit.block_sparse_fwd(q, k, v, row_ptr, col_idx, 16, causal, 0.3)
        ref = block_sparse_reference(q.double(), k.double(), v.double(), row_ptr, col_idx, 16, causal, 0.3)
        assert_close_to_reference(out, ref[0])
        assert_close_to_reference(lse, ref[1])


def test_block_sparse_rejects_bad_lists():
    q = torch.randn(1, 1, 32, 4)
    row_ptr = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="increasing block indices"):
        torch.ops.attnkit.block_sparse_fwd(q, q, q, row_ptr, torch.tensor([0, 2], dtype=torch.int32), 16,
                                           False, 1.0)
    with pytest.raises(RuntimeError, match="multiple of block"):
        torch.ops.attnkit.block_sparse_fwd(q, q, q, row_ptr, torch.tensor([0, 1], dtype=torch.int32), 15,
                                           False, 1.0)


# ----------------------------------------------------------------------------------------------
# NaN and infinities (issue 15): never dropped, as SDPA and the reference do it.  A NaN in q
# poisons exactly its row, a NaN or +inf in k exactly the rows that see that key (an inf in k
# gives +inf scores to some rows and -inf to others: those others drop the key, like the
# reference), a NaN in v at least every row that sees it (rows of the same strip also get it
# through 0 * NaN in the P V product, as SDPA's masked rows do).  A row with no visible key
# stays 0 / lse -inf, told apart from a NaN row by its lse.  The backward never drops a NaN:
# every gradient entry that a poisoned row depends on is NaN (within a tile, 0 * NaN in the
# GEMMs may reach more, as in SDPA, which poisons every key).
# ----------------------------------------------------------------------------------------------

POISONS = ("q_nan", "k_nan", "k_inf", "q_inf", "v_nan")


def _poison(q, k, v, kind, row, col=1):
    """Copies of q, k, v with one entry set per ``kind`` (row ``row`` of head 0, batch 0)."""
    q, k, v = q.clone(), k.clone(), v.clone()
    t = {"q": q, "k": k, "v": v}[kind[0]]
    t[0, 0, row, col % t.shape[-1]] = float("nan") if kind.endswith("nan") else float("inf")
    return q, k, v


def _nan_rows(x):
    return torch.isnan(x).flatten(0, -2).any(-1) if x.dim() > 1 else torch.isnan(x)


def _check_poisoned_forward(out, lse, ref_out, ref_lse, mask, kind, row, empty_rows):
    """out/lse of a kernel (or None for lse) against the float64 reference on poisoned inputs.
    ``mask``: bool [Nq, Nk] of head 0 (for the v case); ``empty_rows``: bool [B, H, Nq] rows
    with no visible key."""
    got = torch.isnan(out).any(-1)
    if kind == "v_nan":
        sees = torch.zeros_like(got)
        sees[0, 0] = mask[:, row]
        assert not (sees & ~got).any(), "a row that sees the NaN value is not NaN"
        if lse is not None:
            assert torch.isfinite(lse[~empty_rows]).all() and torch.isneginf(lse[empty_rows]).all()
        return
    want = torch.isnan(ref_out).any(-1) | ~torch.isfinite(ref_out).all(-1)
    assert torch.equal(got, want), (f"NaN rows {got.nonzero().tolist()} != reference's "
                                    f"{want.nonzero().tolist()}")
    assert torch.isfinite(out[~got]).all()
    if lse is not None:
        assert torch.equal(torch.isnan(lse), want), "lse NaN rows differ from the output's"
        assert torch.isneginf(lse[~want & torch.isneginf(ref_lse)]).all()
        assert torch.isfinite(lse[~want & torch.isfinite(ref_lse)]).all()
    # Fully masked rows: 0, never NaN (and their lse -inf).
    z = empty_rows & ~want
    assert (out[z] == 0).all()


RANGE_POISON_CASES = [c for c in RANGE_CASES if c[0] in (
    "strided_causal_s3_n129_part0", "strided_causal_s3_n129_part1", "strided_noncausal_s64_part2",
    "fixed_own_block", "fixed_summary", "star_band", "wide_chunks", "wide_chunks_causal", "gapped_rows",
    "strided_long_groups", "uncovered_rows", "own_block_48", "empty_ranges")]


@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
@pytest.mark.parametrize("case", RANGE_POISON_CASES, ids=[c[0] for c in RANGE_POISON_CASES])
def test_range_nonfinite(case, dtype, kind):
    name, nq, nk, d, dv, view, lo, hi = case
    scale = d ** -0.5
    q, k, v, dout, _ = _inputs(1, 2, nq, nk, d, dv, dtype, 7)
    mask = range_part_mask(nq, nk, view, lo, hi)
    # A key / query that some row sees: the middle one of the part's entries.
    seen_rows, seen_keys = mask.nonzero(as_tuple=True)
    if seen_rows.numel() == 0:
        row = nq // 2 if kind[0] == "q" else nk // 2
    else:
        mid = seen_rows.numel() // 2
        row = int(seen_rows[mid] if kind[0] == "q" else seen_keys[mid])
    q, k, v = _poison(q, k, v, kind, row)
    out, lse = torch.ops.attnkit.sparse_range_fwd(q, k, v, view, lo, hi, scale)
    ref_out, ref_lse = sparse_range_reference(q.to(F64), k.to(F64), v.to(F64), view, lo, hi, scale)
    empty = ~mask.any(-1).expand(1, 2, nq)
    _check_poisoned_forward(out, lse, ref_out, ref_lse, mask, kind, row, empty)
    # Unpoisoned rows still match the reference (all rows for a v NaN: the lse).
    bad = _nan_rows(out).reshape(1, 2, nq)
    lp = dtype in (BF16, F16)
    # The low-precision run only sets the tolerance of the unpoisoned rows: without the NaN that a
    # torch matmul can spread between rows (bfloat16 on AMX, issue 24).
    ref_lp = without_spread_nan(sparse_range_reference(q, k, v, view, lo, hi, scale),
                                sparse_range_reference(*finite_inputs(q, k, v), view, lo, hi, scale)) if lp else None
    assert_close_to_reference(lse[~bad], ref_lse[~bad], ref_lp[1].float()[~bad] if lp else None,
                              name="lse", dtype=dtype)
    if kind != "v_nan":
        assert_close_to_reference(out[~bad], ref_out[~bad], ref_lp[0][~bad] if lp else None, name="out")
    # Backward with the part's own lse and delta = rowsum(dO * O): NaN for the poisoned rows.
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    dq, dk, dv_ = torch.ops.attnkit.sparse_range_bwd(dout, q, k, v, lse, delta, view, lo, hi, scale)
    _check_poisoned_backward(dq, dk, dv_, lse, delta, mask, view, lo, hi)


def _check_poisoned_backward(dq, dk, dv, lse, delta, mask, view=None, lo=None, hi=None):
    """Every gradient row that a NaN row depends on is NaN: dq of rows with a NaN lse or delta;
    dk of the keys those rows see; dv of the keys that rows with a NaN lse see (P is NaN there).
    ``mask`` [Nq, Nk] applies to every head."""
    lse_bad = torch.isnan(lse)
    bad = lse_bad | torch.isnan(delta)
    has_key = mask.any(-1)
    want_dq = bad & has_key
    want_dk = (bad.to(F64) @ mask.to(F64)) > 0
    want_dv = (lse_bad.to(F64) @ mask.to(F64)) > 0
    for g, want, name in ((dq, want_dq, "dq"), (dk, want_dk, "dk"), (dv, want_dv, "dv")):
        got = _nan_rows(g).reshape(want.shape)
        assert not (want & ~got).any(), f"{name}: NaN dropped at {(want & ~got).nonzero().tolist()[:5]}"


@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
@pytest.mark.parametrize("case", [BLOCK_CASES[1], BLOCK_CASES[2], BLOCK_CASES[7]], ids=str)
def test_block_sparse_nonfinite(case, dtype, kind):
    block, nb, hl, causal, d, dv = case
    n = block * nb
    scale = d ** -0.5
    lay = _random_layout(hl, nb, 3, causal)
    row_ptr, col_idx, col_ptr, row_idx = _lists(lay)
    mask = block_lists_mask(row_ptr, col_idx, block, causal, n)[0]  # head 0's
    seen_rows, seen_keys = mask.nonzero(as_tuple=True)
    mid = seen_rows.numel() // 2
    row = int(seen_rows[mid] if kind[0] == "q" else seen_keys[mid])
    q, k, v, dout, _ = _inputs(1, 2, n, n, d, dv, dtype, 8)
    q, k, v = _poison(q, k, v, kind, row)
    out, lse = torch.ops.attnkit.block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale)
    ref_out, ref_lse = block_sparse_reference(q.to(F64), k.to(F64), v.to(F64), row_ptr, col_idx, block,
                                              causal, scale)
    full = block_lists_mask(row_ptr, col_idx, block, causal, n)
    empty = ~full.any(-1).expand(2, n).reshape(1, 2, n) if full.shape[0] == 1 else ~full.any(-1)[None]
    _check_poisoned_forward(out, lse, ref_out, ref_lse, mask, kind, row, empty)
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    dq, dk, dv_ = torch.ops.attnkit.block_sparse_bwd(dout, q, k, v, lse, delta, row_ptr, col_idx, col_ptr,
                                                     row_idx, block, causal, scale)
    # Head 0 only (the poisoned one; head 1 of a two-head layout has another mask).
    _check_poisoned_backward(dq[:, :1], dk[:, :1], dv_[:, :1], lse[:, :1], delta[:, :1], mask)
    assert torch.isfinite(dq[:, 1:]).all() and torch.isfinite(dk[:, 1:]).all()


def test_range_nan_query_without_keys_stays_zero():
    # A NaN query row that sees no key: 0 and lse -inf, as the reference (nothing to attend).
    q, k, v, _, _ = _inputs(1, 1, 20, 20, 8, 8, F32, 9)
    q[0, 0, 0, 0] = float("nan")
    view, lo, hi = V1, [-5, 1, 1, 0], [-2, 1, 1, 0]  # row 0 (and 1) see nothing
    out, lse = torch.ops.attnkit.sparse_range_fwd(q, k, v, view, lo, hi, 0.3)
    assert (out[0, 0, 0] == 0).all() and torch.isneginf(lse[0, 0, 0])
    assert torch.isfinite(out).all()


def test_range_all_scores_minus_inf_is_empty():
    # Every visible score -inf (an inf in k against q of the other sign): the row has no
    # usable key, like the reference and SDPA's safe softmax: 0 / -inf, not NaN.
    q = torch.ones(1, 1, 4, 2)
    k = torch.ones(1, 1, 4, 2)
    v = torch.randn(1, 1, 4, 2)
    k[0, 0, 0, 0] = -float("inf")  # row 0 sees only key 0 (causal): score -inf
    out, lse = torch.ops.attnkit.sparse_range_fwd(q, k, v, V1, NONE_LO, [0, 1, 1, 0], 1.0)
    ref_out, ref_lse = sparse_range_reference(q.double(), k.double(), v.double(), V1, NONE_LO, [0, 1, 1, 0], 1.0)
    assert (out[0, 0, 0] == 0).all() and torch.isneginf(lse[0, 0, 0]) and torch.isneginf(ref_lse[0, 0, 0])
    assert torch.isfinite(out).all()
    assert_close_to_reference(out, ref_out)


# End to end: attnkit.sparse_attention (cpu) on every pattern family, against the float64
# reference (sparse_attention_reference) and SDPA with the pattern's dense mask.

def _families(n):
    from attnkit import patterns

    lay = _random_layout(2, n // 16, 11, False)
    return {
        "strided": patterns.strided(7),
        "strided_noncausal": patterns.strided(5, causal=False),
        "fixed": patterns.fixed(8, 2),
        "fixed_noncausal": patterns.fixed(8, 3, causal=False),
        "star": patterns.star(n // 2, 2),
        "star_cyclic_causal": patterns.star(0, 1, cyclic=True, causal=True),
        "block_layout": patterns.block_layout(lay, 16),
        "block_layout_causal": patterns.block_layout(lay[:1], 16, causal=True),
    }


@pytest.mark.parametrize("kind", POISONS)
@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
@pytest.mark.parametrize("family", list(_families(64)))
def test_sparse_attention_nonfinite_end_to_end(family, dtype, kind):
    import torch.nn.functional as F

    from attnkit import sparse_attention
    from attnkit.reference.sparse import sparse_attention_reference

    n, d = 96, 16
    pattern = _families(n)[family]
    mask = pattern.mask(n)
    mask = mask if mask.dim() == 2 else mask[0]  # head 0's (the poisoned head)
    q, k, v, _, _ = _inputs(1, 2, n, n, d, d, dtype, 12)
    row = 41
    q, k, v = _poison(q, k, v, kind, row, col=3)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = sparse_attention(q, k, v, pattern, backend="cpu")
    with torch.no_grad():
        ref = sparse_attention_reference(q.to(F64), k.to(F64), v.to(F64), pattern)
        full = pattern.mask(n)
        sdpa = F.scaled_dot_product_attention(q.to(F64), k.to(F64), v.to(F64),
                                              attn_mask=full if full.dim() == 2 else full[None])
    got = torch.isnan(out).any(-1)
    if kind == "v_nan":
        assert got[0, 0][mask[:, row]].all(), "a row that sees the NaN value is not NaN"
    else:
        want = ~torch.isfinite(ref).all(-1)
        assert torch.equal(got, want), f"NaN rows {got.nonzero().tolist()} != {want.nonzero().tolist()}"
        # SDPA with the dense (additive -inf) mask poisons these rows too (and more for k).
        assert not (got & torch.isfinite(sdpa).all(-1)).any()
        lp = dtype in (BF16, F16)
        with torch.no_grad():
            ref_lp = without_spread_nan(sparse_attention_reference(q, k, v, pattern),  # issue 24
                                        sparse_attention_reference(*finite_inputs(q, k, v), pattern)) if lp else None
        assert_close_to_reference(out.detach()[~got], ref[~got], ref_lp[~got] if lp else None, name="out")
    # Backward (loss = sum(out * w), w finite): no NaN dropped.  What a NaN row r depends on
    # (an autograd float64 reference would not say: its own GEMMs spread 0 * NaN): dq_r, and dk
    # of every key r sees; dv of those keys too when r's scores are NaN (q, k), not when only
    # its output is (v: dv = P^T dO stays finite) and only for NaN (an infinite score makes
    # P NaN on the +inf scores but 0 on the -inf ones: which keys those are is not this test's).
    w = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1)).to(dtype)
    (out * w).sum().backward()
    full = pattern.mask(n)
    full = (full if full.dim() == 2 else full[:1]).expand(2, n, n).to(F64)
    bad = (~torch.isfinite(out.detach()).all(-1))[0].to(F64)  # [H, N]
    if kind == "v_nan":
        # the rows that see the NaN value: out's NaN may reach further through 0 * NaN in P V
        # (the star's exactly recomputed rows do), which is no NaN those rows' dq depends on
        bad = torch.zeros_like(bad)
        bad[0] = mask[:, row].to(F64)
    score_bad = bad if kind in ("q_nan", "k_nan") else torch.zeros_like(bad)
    want = {"dq": (bad > 0) & (full.sum(-1) > 0),
            "dk": (bad.unsqueeze(1) @ full).squeeze(1) > 0,
            "dv": (score_bad.unsqueeze(1) @ full).squeeze(1) > 0}
    for g, name in ((q.grad, "dq"), (k.grad, "dk"), (v.grad, "dv")):
        missing = want[name] & ~torch.isnan(g[0]).any(-1)
        assert want[name].any() or name == "dv"
        assert not missing.any(), f"{name}: NaN dropped at {missing.nonzero().tolist()[:8]}"


# Issue 24: on an Intel Xeon with AMX, torch 2.13's bfloat16 matmul writes the NaN of row i + 1 of
# A into output row i too, so a low-precision reference run on poisoned inputs had NaN in rows
# the poison does not reach, and 14 of the tests above failed there on the reference, not on the
# kernel.  Here the same tests run with that defect emulated on any machine
# (attnkit_testing.nan_spreading_matmul): they must still judge the kernel by the rows a poison
# reaches, and only by those.

_AMX_FAILED_CASES = [c for c in RANGE_POISON_CASES if c[0] in (
    "strided_causal_s3_n129_part1", "star_band", "uncovered_rows", "wide_chunks_causal")]


@pytest.mark.parametrize("kind", ("q_nan", "k_nan", "q_inf", "k_inf"))
@pytest.mark.parametrize("case", _AMX_FAILED_CASES, ids=[c[0] for c in _AMX_FAILED_CASES])
def test_range_nonfinite_under_a_nan_spreading_matmul(case, kind):
    with nan_spreading_matmul():
        test_range_nonfinite(case, BF16, kind)


@pytest.mark.parametrize("kind", ("q_nan", "k_nan"))
def test_sparse_attention_nonfinite_end_to_end_under_a_nan_spreading_matmul(kind):
    with nan_spreading_matmul():
        test_sparse_attention_nonfinite_end_to_end("strided", BF16, kind)


def test_the_emulated_defect_fails_a_reference_from_poisoned_inputs():
    # The emulation bites where the AMX machine did: the tolerance reference computed from the
    # poisoned inputs alone (what the tests did before) has NaN in an unpoisoned row, and the
    # tolerance rule then fails; without_spread_nan takes those rows from a run on finite inputs.
    name, nq, nk, d, dv, view, lo, hi = next(c for c in RANGE_POISON_CASES if c[0] == "strided_causal_s3_n129_part1")
    q, k, v, _, _ = _inputs(1, 2, nq, nk, d, dv, BF16, 7)
    mask = range_part_mask(nq, nk, view, lo, hi)
    seen_rows, _ = mask.nonzero(as_tuple=True)
    q, k, v = _poison(q, k, v, "q_nan", int(seen_rows[seen_rows.numel() // 2]))
    out, _ = torch.ops.attnkit.sparse_range_fwd(q, k, v, view, lo, hi, d ** -0.5)
    ref_out = sparse_range_reference(q.to(F64), k.to(F64), v.to(F64), view, lo, hi, d ** -0.5)[0]
    good = ~_nan_rows(ref_out).reshape(1, 2, nq)
    with nan_spreading_matmul():
        poisoned_lp = sparse_range_reference(q, k, v, view, lo, hi, d ** -0.5)[0]
        clean_lp = without_spread_nan(poisoned_lp, sparse_range_reference(*finite_inputs(q, k, v), view, lo, hi,
                                                                          d ** -0.5)[0])
    assert _nan_rows(poisoned_lp[good]).any(), "the emulated defect put no NaN into an unpoisoned row"
    with pytest.raises(AssertionError, match="NaN in the result"):
        assert_close_to_reference(out[good], ref_out[good], poisoned_lp[good], name="out")
    assert_close_to_reference(out[good], ref_out[good], clean_lp[good], name="out")

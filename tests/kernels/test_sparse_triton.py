"""Triton sparse-attention kernels (attnkit.kernels.sparse): range parts and block-sparse layouts,
forward and backward.

Without a GPU these run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports attnkit): shapes stay small (N <= 130, D 16 / 32).
With a GPU the same tests run on CUDA, plus the ``gpu``-marked ones (bfloat16, which the
interpreter cannot do, and real sizes).

Ground truth: pytorch_ext/reference/sparse.py (sparse_range_reference / _bwd_reference,
block_sparse_reference / _bwd_reference) in float64 on the same (already rounded) inputs.  The
backward gets a *merged* lse (the part's own lse plus a positive offset, finite on rows the part
does not reach, -inf on a few rows no part reaches) and a random delta, as the lead's merge
passes them.  Tolerance rule (DESIGN.md) via attnkit_testing.assert_close_to_reference.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from attnkit import patterns  # noqa: E402
from attnkit.kernels import sparse as ks  # noqa: E402
from attnkit.reference import sparse as ref  # noqa: E402
from attnkit_testing import TRITON_BF16_TEST, assert_close_to_reference  # noqa: E402

F16, F32, F64, BF16 = torch.float16, torch.float32, torch.float64, torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NONE_HI = [0, 1, 0, 2 ** 40]  # "no upper bound"
NONE_LO = [0, 1, 0, 0]  # "no lower bound"
V1 = [1, 0, 1, 0, 1]  # the plain view


def cfg(bm, bn):
    """A tile config for the interpreter tests (warps / stages mean nothing there)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------
# inputs, merged lse / delta, and the comparison
# ----------------------------------------------------------------------------------------------


def make_inputs(b, h, nq, nk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g)
    k = torch.randn(b, h, nk, d, generator=g)
    v = torch.randn(b, h, nk, dv, generator=g)
    go = torch.randn(b, h, nq, dv, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, go)]


def merged_lse_delta(part_lse, seed=1):
    """A merged lse (>= the part's lse, as a sum over more parts would be; finite where this part
    has no key, except on every 5th such row: no part at all) and a random delta."""
    g = torch.Generator().manual_seed(seed)
    part_lse = part_lse.detach().cpu().to(F32)
    extra = torch.rand(part_lse.shape, generator=g)
    other = torch.randn(part_lse.shape, generator=g)
    lse = torch.where(torch.isinf(part_lse), other, part_lse + extra)
    dead = torch.isinf(part_lse).flatten().nonzero()[::5, 0]
    lse.view(-1)[dead] = float("-inf")
    delta = torch.randn(part_lse.shape, generator=g)
    return lse.to(DEVICE), delta.to(DEVICE)


def check(got, expected64, expected_lowp, dtype, names):
    for i, name in enumerate(names):
        assert got[i].dtype == (F32 if name == "lse" else dtype), name
        assert_close_to_reference(got[i], expected64[i],
                                  None if expected_lowp is None else expected_lowp[i],
                                  dtype=dtype, grad=name.startswith("d"), name=name)


def references(fwd_ref, bwd_ref, q, k, v, go, lse_m, delta, dtypes):
    """Forward and backward references, run in each dtype of ``dtypes`` on the same inputs."""
    out = []
    for dt in dtypes:
        if dt is None:
            out.append(None)
            continue
        c = [t.detach().cpu().to(dt) for t in (q, k, v, go)]
        fwd = fwd_ref(*c[:3])
        bwd = bwd_ref(c[3], *c[:3], lse_m.cpu().to(dt), delta.cpu().to(dt))
        out.append((*fwd, *bwd))
    return out


# ----------------------------------------------------------------------------------------------
# range parts
# ----------------------------------------------------------------------------------------------


def run_range(q, k, v, go, view, lo, hi, scale, fwd_config=None, bwd_config=None):
    out, lse = ks.sparse_range_fwd(q, k, v, view, lo, hi, scale, config=fwd_config)
    lse_m, delta = merged_lse_delta(ref.sparse_range_reference(
        q.cpu().double(), k.cpu().double(), v.cpu().double(), view, lo, hi, scale)[1])
    grads = ks.sparse_range_bwd(go, q, k, v, lse_m, delta, view, lo, hi, scale,
                                config=bwd_config)
    return (out, lse, *grads), lse_m, delta


def check_range(b, h, nq, nk, d, dv, dtype, view, lo, hi, scale=0.3, fwd_config=None,
                bwd_config=None, seed=0):
    q, k, v, go = make_inputs(b, h, nq, nk, d, dv, dtype, seed)
    got, lse_m, delta = run_range(q, k, v, go, view, lo, hi, scale, fwd_config, bwd_config)
    ref64, lowp = references(
        lambda *a: ref.sparse_range_reference(*a, view, lo, hi, scale),
        lambda *a: ref.sparse_range_bwd_reference(*a, view, lo, hi, scale),
        q, k, v, go, lse_m, delta, (F64, None if dtype == F32 else dtype))
    check(got, ref64, lowp, dtype, ("out", "lse", "dq", "dk", "dv"))
    return got, ref64


S = 8  # the stride of the strided examples (N = 37, 61: not multiples of it)
L, C = 8, 3  # fixed: block length and summary columns
N_SUMMARY = 37 // L * C + max(0, 37 % L - (L - C))  # summary rows of N = 37

# (Nq, Nk, D, Dv, view, lo, hi)
RANGE_CASES = {
    "strided_causal_band": (37, 37, 16, 16, V1, [-S, 1, 1, 0], [0, 1, 1, 0]),
    "strided_causal_columns": (37, 37, 16, 16, [S, 1, S, 1, S], [0, 1, 0, 0], [-2, 1, 1, 0]),
    "strided_full_band": (61, 61, 32, 16, V1, [-S, 1, 1, 0], [S, 1, 1, 0]),
    "strided_full_columns_before": (61, 61, 16, 32, [S, 1, S, 1, S], NONE_LO, [-2, 1, 1, 0]),
    "strided_full_columns_after": (61, 61, 16, 16, [S, 1, S, 1, S], [2, 1, 1, 0], NONE_HI),
    "fixed_own_block": (37, 37, 16, 16, V1, [0, L, L, 0], [0, 1, 1, 0]),
    # keys: the gathered summary rows (C per block of L); query t sees the summaries of the
    # blocks before its own: hi(t) = floor(t / L) * C - 1
    "fixed_summary_gathered": (37, N_SUMMARY, 16, 16, V1, NONE_LO, [0, L, C, -1]),
    "star_band_d24": (30, 30, 24, 20, V1, [-2, 1, 1, 0], [2, 1, 1, 0]),
    # negative t + a with d > 1 (floor, not truncation) and a lower bound above the upper bound
    # on the first rows (empty ranges)
    "floor_of_negatives_empty_rows": (45, 45, 16, 16, V1, [-7, 3, 2, 1], [-5, 2, 3, 0]),
    # more groups than rows (empty groups), and groups whose keys run out before their queries
    "empty_groups": (5, 3, 16, 16, [8, 1, 8, 1, 8], NONE_LO, NONE_HI),
    "keys_shorter_than_queries": (40, 13, 16, 16, [4, 1, 4, 1, 4], [-1, 1, 1, 0], [1, 1, 1, 0]),
    # every other query row in no group (0 / -inf), keys on a different stride
    "rows_in_no_group": (33, 50, 16, 16, [1, 0, 2, 0, 3], [0, 2, 1, 0], [3, 1, 1, 0]),
    # the groups share their keys (k_pg = 0): dK/dV accumulates group by group
    "groups_share_keys": (30, 20, 16, 16, [3, 1, 3, 0, 1], [0, 1, 1, 0], [5, 1, 2, 0]),
    "n1": (1, 1, 16, 16, V1, [-S, 1, 1, 0], [0, 1, 1, 0]),
    "n1_columns": (1, 1, 16, 16, [S, 1, S, 1, S], [0, 1, 0, 0], [-2, 1, 1, 0]),
}


@pytest.mark.parametrize("case", RANGE_CASES.values(), ids=RANGE_CASES.keys())
def test_range_part_matches_float64_reference(case):
    nq, nk, d, dv, view, lo, hi = case
    check_range(1, 2, nq, nk, d, dv, F32, view, lo, hi, fwd_config=cfg(16, 16),
                bwd_config=cfg(16, 16))


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"),
                                   pytest.param(BF16, id="bf16", marks=TRITON_BF16_TEST)])
def test_range_part_low_precision_and_batches(dtype):
    # bfloat16 on CPU: the fixed interpreter (tests/conftest.py)
    check_range(2, 1, 61, 61, 32, 32, dtype, [S, 1, S, 1, S], [0, 1, 0, 0], [-2, 1, 1, 0],
                fwd_config=cfg(16, 16), bwd_config=cfg(16, 16))
    check_range(1, 1, 37, 37, 16, 16, dtype, V1, [-S, 1, 1, 0], [0, 1, 1, 0],
                fwd_config=cfg(32, 32), bwd_config=cfg(32, 32))


def test_range_strided_parts_partition_the_pattern():
    # band + columns (the lead's decomposition of strided causal) cover the pattern exactly once
    n, s = 37, S
    band = ref.range_part_mask(n, n, V1, [-s, 1, 1, 0], [0, 1, 1, 0])
    cols = ref.range_part_mask(n, n, [s, 1, s, 1, s], [0, 1, 0, 0], [-2, 1, 1, 0])
    assert not (band & cols).any()
    assert torch.equal(band | cols, patterns.strided(s).mask(n).cpu())


def test_range_empty_rows_and_no_nan():
    # rows_in_no_group: odd rows are in no group; floor_of_negatives: the first rows have
    # lo > hi.  Their outputs are exactly 0, lse -inf, dq 0; and no NaN anywhere.
    for name, dead_rows in (("rows_in_no_group", list(range(1, 33, 2))),
                            ("floor_of_negatives_empty_rows", [0, 1, 2, 3, 4])):
        nq, nk, d, dv, view, lo, hi = RANGE_CASES[name]
        (out, lse, dq, dk, dv_), _ = check_range(1, 2, nq, nk, d, dv, F32, view, lo, hi,
                                                 fwd_config=cfg(16, 16), bwd_config=cfg(16, 16))
        for t in (out, lse, dq, dk, dv_):
            assert not torch.isnan(t).any()
        assert torch.all(out[:, :, dead_rows] == 0) and torch.all(dq[:, :, dead_rows] == 0)
        assert torch.all(lse[:, :, dead_rows] == float("-inf"))


def test_range_default_scale_and_scale_is_used():
    nq, nk, d, dv, view, lo, hi = RANGE_CASES["strided_causal_band"]
    q, k, v, _ = make_inputs(1, 1, nq, nk, d, dv, F32)
    out, lse = ks.sparse_range_fwd(q, k, v, view, lo, hi, None, config=cfg(16, 16))
    r_out, r_lse = ref.sparse_range_reference(q.cpu().double(), k.cpu().double(),
                                              v.cpu().double(), view, lo, hi, d ** -0.5)
    assert_close_to_reference(out, r_out, name="out")
    assert_close_to_reference(lse, r_lse, dtype=F32, name="lse")
    other = ks.sparse_range_fwd(q, k, v, view, lo, hi, 0.9, config=cfg(16, 16))[0]
    assert (other - out).abs().max() > 1e-3


# Every autotune candidate: N = 130 > 128 so that the widest tiles have a partial second tile.
@pytest.mark.parametrize("i", range(len(ks.RANGE_FWD_CONFIGS)), ids=lambda i: f"cfg{i}")
def test_range_every_config(i):
    fwd = ks.RANGE_FWD_CONFIGS[i]
    bwd = (ks.RANGE_DKDV_CONFIGS[i % len(ks.RANGE_DKDV_CONFIGS)],
           ks.RANGE_DQ_CONFIGS[i % len(ks.RANGE_DQ_CONFIGS)])
    if i % 2 == 0:  # a band on the plain view
        view, lo, hi = V1, [-17, 1, 1, 0], [3, 1, 1, 0]
    else:  # columns on a strided view
        view, lo, hi = [3, 1, 3, 1, 3], NONE_LO, [-1, 1, 1, 0]
    check_range(1, 1, 130, 130, 16, 16, F32, view, lo, hi, fwd_config=fwd, bwd_config=bwd,
                seed=i)


@pytest.mark.parametrize("view, lo, hi, match", [
    ([2, 1, 1, 0, 1], NONE_LO, NONE_HI, r"share query rows"),
    ([1, 0, 0, 0, 1], NONE_LO, NONE_HI, r"q_pt, k_pt >= 1"),
    ([1, 0, 1, 0, 1], [0, 0, 1, 0], NONE_HI, r"lo = \[a, d, m, b\] needs d >= 1"),
    ([1, 0, 1, 0, 1], NONE_LO, [0, 1, -1, 0], r"hi = \[a, d, m, b\] needs d >= 1 and m >= 0"),
    ([1, 0, 1, 0], NONE_LO, NONE_HI, r"view must have 5 entries"),
])
def test_range_rejects_bad_views(view, lo, hi, match):
    q, k, v, _ = make_inputs(1, 1, 10, 10, 16, 16, F32)
    with pytest.raises(ValueError, match=match):
        ks.sparse_range_fwd(q, k, v, view, lo, hi, 1.0)


def test_groups_disjoint_closed_form():
    # the closed form against brute force
    for n in (0, 1, 7, 20):
        for G in (1, 2, 3, 5):
            for pg in (0, 1, 2, 3, 6):
                for pt in (1, 2, 3, 4, 6):
                    rows = [r for g in range(G) for t in range(n) if (r := g * pg + t * pt) < n]
                    assert ks._groups_disjoint(n, G, pg, pt) == (len(rows) == len(set(rows))), \
                        (n, G, pg, pt)


# ----------------------------------------------------------------------------------------------
# block-sparse
# ----------------------------------------------------------------------------------------------


def block_lists(hl, nb, block, causal, seed=0, empty_row=1):
    g = torch.Generator().manual_seed(seed)
    lay = torch.rand(hl, nb, nb, generator=g) < 0.5
    lay[:, torch.arange(nb), torch.arange(nb)] |= torch.rand(hl, nb, generator=g) < 0.7
    if nb == 1:
        lay[:] = True
    elif empty_row is not None:
        lay[0, empty_row] = False  # a query block with no key block: zeros / -inf
    return [t.to(DEVICE) for t in patterns.block_layout(lay, block, causal=causal).index_lists()]


def check_block(b, h, hl, nb, block, causal, d, dv, dtype, config=None, bwd_config=None,
                seed=0, scale=0.3):
    n = nb * block
    q, k, v, go = make_inputs(b, h, n, n, d, dv, dtype, seed)
    rp, ci, cp, ri = block_lists(hl, nb, block, causal, seed)
    out, lse = ks.block_sparse_fwd(q, k, v, rp, ci, block, causal, scale, config=config)
    rp_cpu, ci_cpu = rp.cpu(), ci.cpu()  # the references run on CPU (the lists may be CUDA)
    lse_m, delta = merged_lse_delta(ref.block_sparse_reference(
        q.cpu().double(), k.cpu().double(), v.cpu().double(), rp_cpu, ci_cpu, block, causal,
        scale)[1])
    grads = ks.block_sparse_bwd(go, q, k, v, lse_m, delta, rp, ci, cp, ri, block, causal, scale,
                                config=config if bwd_config is None else bwd_config)
    ref64, lowp = references(
        lambda *a: ref.block_sparse_reference(*a, rp_cpu, ci_cpu, block, causal, scale),
        lambda *a: ref.block_sparse_bwd_reference(*a, rp_cpu, ci_cpu, block, causal, scale),
        q, k, v, go, lse_m, delta, (F64, None if dtype == F32 else dtype))
    got = (out, lse, *grads)
    check(got, ref64, lowp, dtype, ("out", "lse", "dq", "dk", "dv"))
    return got


# (B, H, Hl, nb, block, causal, D, Dv, config)
BLOCK_CASES = {
    "block16_shared_layout_causal": (1, 2, 1, 5, 16, True, 16, 16, cfg(16, 16)),
    "block16_per_head": (2, 2, 2, 4, 16, False, 32, 24, cfg(16, 16)),
    "block24_per_head_causal_tile32": (1, 2, 2, 4, 24, True, 16, 16, cfg(32, 32)),
    "block24_tile16_two_subtiles": (1, 2, 2, 3, 24, False, 16, 16, cfg(16, 16)),
    "block32_causal_subtiles": (1, 1, 1, 4, 32, True, 16, 16, cfg(16, 16)),
    "block3_causal": (1, 2, 1, 9, 3, True, 16, 16, cfg(16, 16)),
    "block1": (1, 1, 1, 8, 1, False, 16, 16, cfg(16, 16)),
    "one_block": (1, 1, 1, 1, 16, True, 16, 16, cfg(16, 16)),
}


@pytest.mark.parametrize("case", BLOCK_CASES.values(), ids=BLOCK_CASES.keys())
def test_block_sparse_matches_float64_reference(case):
    b, h, hl, nb, block, causal, d, dv, config = case
    check_block(b, h, hl, nb, block, causal, d, dv, F32, config)


@pytest.mark.parametrize("dtype", [pytest.param(F16, id="f16"),
                                   pytest.param(BF16, id="bf16", marks=TRITON_BF16_TEST)])
def test_block_sparse_low_precision(dtype):
    check_block(1, 2, 2, 4, 16, True, 32, 32, dtype, cfg(16, 16))


def test_block_sparse_empty_rows():
    got = check_block(1, 2, 1, 4, 16, False, 16, 16, F32, cfg(16, 16))
    out, lse, dq = got[0].cpu(), got[1].cpu(), got[2].cpu()
    rows = slice(16, 32)  # query block 1 has no key block in the shared layout
    assert torch.all(out[:, :, rows] == 0) and torch.all(dq[:, :, rows] == 0)
    assert torch.all(lse[:, :, rows] == float("-inf"))
    assert torch.isfinite(lse[:, :, :16]).all()


def test_block_sparse_layout_rows_are_per_head():
    # Hl = H: head 1 must read its own lists -- giving it head 0's lists changes the result
    b, h, nb, block = 1, 2, 4, 16
    q, k, v, _ = make_inputs(b, h, nb * block, nb * block, 16, 16, F32)
    rp, ci, _, _ = block_lists(2, nb, block, False, seed=3, empty_row=None)
    out = ks.block_sparse_fwd(q, k, v, rp, ci, block, False, 0.5, config=cfg(16, 16))[0]
    shared = ks.block_sparse_fwd(q, k, v, rp[:1], ci, block, False, 0.5, config=cfg(16, 16))[0]
    assert torch.equal(out[:, 0], shared[:, 0])
    assert (out[:, 1] - shared[:, 1]).abs().max() > 1e-3


@pytest.mark.parametrize("i", range(len(ks.BLOCK_FWD_CONFIGS)), ids=lambda i: f"cfg{i}")
def test_block_sparse_every_config(i):
    fwd = ks.BLOCK_FWD_CONFIGS[i]
    bwd = (ks.BLOCK_DKDV_CONFIGS[i % len(ks.BLOCK_DKDV_CONFIGS)],
           ks.BLOCK_DQ_CONFIGS[i % len(ks.BLOCK_DQ_CONFIGS)])
    # the block is the config's largest tile (so that the other tile has sub-tiles, and no
    # tile is mostly padding); causal on every other config; 2 query blocks
    block = max(c.kwargs[key] for c in (fwd, *bwd) for key in ("BLOCK_M", "BLOCK_N"))
    check_block(1, 1, 1, 2, block, i % 2 == 0, 16, 16, F32, fwd, bwd, seed=i)


def test_configs_for_filters():
    assert ks.configs_for("range_fwd", 64) == ks.RANGE_FWD_CONFIGS
    for name in ("block_fwd", "block_dq", "block_dkdv"):
        small = ks.configs_for(name, 64, block=16)
        assert small and all(c.kwargs["BLOCK_M"] == 16 == c.kwargs["BLOCK_N"] for c in small)
        assert ks.configs_for(name, 64, block=3) == small
        assert all(c.kwargs["BLOCK_M"] <= 32 for c in ks.configs_for(name, 64, block=24))
    for name, configs in ks._CONFIG_LISTS.items():
        for c in configs:  # tl.dot needs >= 16 along every dimension on GPUs
            assert c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16
        big = ks.configs_for(name, 256)
        assert big and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 64 for c in big)


@pytest.mark.parametrize("block, n, match", [(16, 40, r"multiple of block"),
                                             (0, 16, r"block must be >= 1")])
def test_block_sparse_rejects_bad_sizes(block, n, match):
    q, k, v, _ = make_inputs(1, 1, n, n, 16, 16, F32)
    rp = torch.zeros(1, 3, dtype=torch.int32, device=DEVICE)
    ci = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        ks.block_sparse_fwd(q, k, v, rp, ci, block, False, 1.0)


# ----------------------------------------------------------------------------------------------
# routing: supports() and float64
# ----------------------------------------------------------------------------------------------


def test_supports_and_float64_refusal():
    q, k, v, _ = make_inputs(1, 2, 8, 8, 16, 16, F32)
    assert ks.supports(q, k, v) is None
    assert ks.supports(q.to(F16), k.to(F16), v.to(F16)) is None
    assert "float64" in ks.supports(q.double(), k.double(), v.double())
    big = torch.zeros(1, 2, 8, 272, device=DEVICE)
    assert "272" in ks.supports(big, big, v)
    assert "v head dim" in ks.supports(q, k, torch.zeros(1, 2, 8, 300, device=DEVICE))
    assert "share a dtype" in ks.supports(q, k.to(F16), v)
    assert "4-D" in ks.supports(q[0], k, v)
    with pytest.raises(RuntimeError, match="float64"):
        ks.sparse_range_fwd(q.double(), k.double(), v.double(), V1, NONE_LO, NONE_HI, 1.0)
    rp, ci, _, _ = block_lists(1, 1, 8, False, empty_row=None)
    with pytest.raises(RuntimeError, match="float64"):
        ks.block_sparse_fwd(q.double(), k.double(), v.double(), rp, ci, 8, False, 1.0)


# ----------------------------------------------------------------------------------------------
# GPU: bfloat16 (its small cases run interpreted too), real sizes, the autotuned path
# ----------------------------------------------------------------------------------------------


def _strided_parts(s):
    """The lead's exact decomposition of strided causal: (view, lo, hi) of band and columns."""
    return [(V1, [-s, 1, 1, 0], [0, 1, 1, 0]), ([s, 1, s, 1, s], [0, 1, 0, 0], [-2, 1, 1, 0])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(BF16, marks=pytest.mark.autotune), F16, F32],
                         ids=["bf16", "f16", "f32"])
def test_gpu_strided_parts_real_size(dtype):
    for view, lo, hi in _strided_parts(64):
        check_range(1, 4, 2000, 2000, 128, 128, dtype, view, lo, hi, scale=128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fixed_own_block", "rows_in_no_group", "groups_share_keys",
                                  "floor_of_negatives_empty_rows"])
def test_gpu_range_cases_bf16(name):
    nq, nk, d, dv, view, lo, hi = RANGE_CASES[name]
    check_range(2, 4, nq, nk, 128, 128, BF16, view, lo, hi)


# One test per (kernel, config), so that the configs compile on separate workers (issue 26).
def _every_config(kind, **kw):
    return [(kernel, i) for kernel in ("fwd", "dkdv", "dq")
            for i in range(len(ks.configs_for(f"{kind}_{kernel}", 128, **kw)))]


_RANGE_EVERY = _every_config("range")
_BLOCK_EVERY = _every_config("block", block=128)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, index", _RANGE_EVERY, ids=[f"{k}-{i}" for k, i in _RANGE_EVERY])
def test_gpu_range_every_config_bf16(kernel, index):
    lists = {"fwd": ks.RANGE_FWD_CONFIGS, "dkdv": ks.RANGE_DKDV_CONFIGS,
             "dq": ks.RANGE_DQ_CONFIGS}
    config = ks.configs_for(f"range_{kernel}", 128)[index]
    assert config in lists[kernel]
    fwd = config if kernel == "fwd" else None
    bwd = {"fwd": None, "dkdv": (config, None), "dq": (None, config)}[kernel]
    for view, lo, hi in _strided_parts(64):
        check_range(1, 2, 1500, 1500, 128, 128, BF16, view, lo, hi, fwd_config=fwd,
                    bwd_config=bwd)


@pytest.mark.gpu
@pytest.mark.parametrize("block, causal", [(64, True), (128, False), (24, True), (16, False)])
def test_gpu_block_sparse_bf16(block, causal):
    check_block(2, 4, 4, 1536 // block, block, causal, 128, 128, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, index", _BLOCK_EVERY, ids=[f"{k}-{i}" for k, i in _BLOCK_EVERY])
def test_gpu_block_sparse_every_config_bf16(kernel, index):
    config = ks.configs_for(f"block_{kernel}", 128, block=128)[index]
    fwd = config if kernel == "fwd" else None
    bwd = {"fwd": None, "dkdv": (config, None), "dq": (None, config)}[kernel]
    check_block(1, 2, 2, 8, 128, True, 128, 128, BF16, fwd, bwd)

"""Split-KV decoding kernel (attnkit.kernels.decode, issue 26): softmax_decode_fwd.

Without a GPU the kernels run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports attnkit): float32 and float16, bfloat16 in two cases
(its interpreter fixed for the tests: tests/triton_interpreter_bf16.py), tiny shapes, fixed tile configs.  With a GPU the same
tests run on CUDA, plus the ``gpu``-marked ones (bfloat16 and float16 at decoding sizes, against
torch SDPA).

Ground truth: ``softmax_attention_reference`` in float64 on the same (already rounded) inputs,
with the decoding mask as a bool tensor: batch b has L_b = kv_lens[b] keys and query i of N sees
key j iff j <= L_b - N + i (bottom-right; ``is_causal=False``: iff j < L_b).  Both merge
variants (``merge="separate"`` / ``"fused"``) run the cases with several splits.  Tolerance (DESIGN.md): float32 within 2e-5 of the
largest reference magnitude; float16 / bfloat16 within 2x the error of the reference run in
that dtype, plus 1e-3.

The out-of-bounds check runs this file as a script in a child process (guarded memory,
tests/guarded_memory.py): a fault kills the child, not the test session.
"""
import faulthandler
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in sys.path:  # run as a script (the bounds child)
    sys.path.insert(0, TESTS_DIR)

from attnkit.kernels import decode  # noqa: E402
from attnkit.reference.softmax import softmax_attention_reference  # noqa: E402
from attnkit_testing import TRITON_BF16_TEST, assert_close_to_reference  # noqa: E402

F16, F32, F64, BF16 = torch.float16, torch.float32, torch.float64, torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cfg(bn, bm=None, warps=4, stages=2):
    """A fixed tile config (warps / stages mean nothing in the interpreter)."""
    kw = {"BLOCK_N": bn} if bm is None else {"BLOCK_N": bn, "BLOCK_M": bm}
    return triton.Config(kw, num_warps=warps, num_stages=stages)


# ----------------------------------------------------------------------------------------------
# inputs and reference
# ----------------------------------------------------------------------------------------------


def make_inputs(b, h, hk, n, m, d, dv, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, hk, m, d, generator=g)
    v = torch.randn(b, hk, m, dv, generator=g)
    return [t.to(dtype).to(device) for t in (q, k, v)]


def lengths(kv_lens, b, m):
    """Per-batch valid key counts as int64 on the CPU (clamped to [0, M] like the kernel)."""
    if kv_lens is None:
        return torch.full((b,), m, dtype=torch.int64)
    return kv_lens.cpu().long().clamp(0, m)


def decode_mask(kv_lens, b, n, m, device=DEVICE, causal=True):
    """bool [B, 1, N, M]: query i of batch b sees key j iff j <= L_b - N + i (causal) / j < L_b."""
    lens = lengths(kv_lens, b, m)
    j = torch.arange(m)
    i = torch.arange(n)
    last = lens[:, None, None] - n + i[None, :, None] if causal else lens[:, None, None] - 1
    allowed = j[None, None, :] <= last.expand(b, n, 1)
    return allowed[:, None].to(device)


def dead_rows(kv_lens, b, h, n, m, causal=True):
    """bool [B, H, N]: rows that see no key."""
    lens = lengths(kv_lens, b, m)
    last = lens[:, None] - n + torch.arange(n)[None, :] if causal else (lens[:, None] - 1).expand(b, n)
    dead = last < 0  # [B, N]
    return dead[:, None, :].expand(b, h, n)


def reference(q, k, v, kv_lens, scale=None, dtype=F64, causal=True):
    """(out, lse) of the reference run in ``dtype`` on the given inputs."""
    b, _, n, _ = q.shape
    m = k.shape[2]
    mask = decode_mask(kv_lens, b, n, m, q.device, causal)
    return softmax_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                       return_lse=True)


def check(got, q, k, v, kv_lens=None, scale=None, causal=True):
    out, lse = got
    dtype = q.dtype
    assert out.dtype == dtype and lse.dtype == F32
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    assert lse.shape == q.shape[:3]
    ref = reference(q, k, v, kv_lens, scale, causal=causal)
    lowp = None if dtype == F32 else reference(q, k, v, kv_lens, scale, dtype=dtype, causal=causal)
    assert_close_to_reference(out, ref[0], None if lowp is None else lowp[0], dtype=dtype,
                              name="out")
    assert_close_to_reference(lse, ref[1], None if lowp is None else lowp[1], dtype=dtype,
                              name="lse")
    # dead rows: exactly 0 and -inf (not NaN)
    dead = dead_rows(kv_lens, *q.shape[:3], k.shape[2], causal).to(out.device)
    assert torch.all(out[dead] == 0) and torch.all(lse[dead] == float("-inf"))
    assert torch.isfinite(lse[~dead]).all()


def lens_t(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------------------------
# against the float64 reference
# ----------------------------------------------------------------------------------------------

# (B, H, Hk, N, M, D, Dv, dtype, kv_lens, num_splits, config)
CASES = {
    "n1_m1_gqa": (1, 8, 2, 1, 1, 16, 16, F32, None, None, cfg(64)),
    "n3_m7_mqa_lens01_more_splits_than_blocks": (3, 4, 1, 3, 7, 33, 20, F32, [0, 1, 7], 3,
                                                 cfg(64)),
    "n16_m300_gqa_splits3_lens": (2, 8, 2, 16, 300, 24, 40, F32, [300, 17], 3, cfg(64)),
    "n1_m1000_mqa_default_splits": (2, 8, 1, 1, 1000, 64, 64, F32, None, None, cfg(256)),
    "n3_m1000_gqa_one_split_d40_dv72": (1, 8, 2, 3, 1000, 40, 72, F32, [999], 1, cfg(256)),
    "n16_m7_mqa_row_blocks": (1, 8, 1, 16, 7, 16, 16, F32, None, 5, cfg(64, bm=32)),
    "n3_m300_lens_0_1_2_more_splits_than_blocks": (4, 2, 1, 3, 300, 16, 16, F32, [0, 1, 2, 300],
                                                   5, cfg(128)),
    "f16_n1_m300_gqa_splits2": (2, 8, 2, 1, 300, 64, 64, F16, None, 2, cfg(128)),
    "f16_n16_m1000_gqa_d32_dv48": (1, 8, 2, 16, 1000, 32, 48, F16, [1000], 2, cfg(256)),
    "f16_n3_m7_mqa_lens01": (2, 4, 1, 3, 7, 16, 24, F16, [0, 1], 1, cfg(64)),
    "f16_n16_m300_mqa_splits4": (1, 4, 1, 16, 300, 16, 16, F16, [255], 4, cfg(64)),
    # 72 rows in 64-row tiles: the fused merge walks each tile in 32-row sub-blocks, the last
    # ones partly or wholly past the rows
    "n9_m130_mqa_bm64_subblocks": (2, 8, 1, 9, 130, 16, 24, F32, [100, 3], 3, cfg(64, bm=64)),
}


# Every case with the separate merge; the ones with several splits (None: the heuristic's, which
# is several for these) with the fused merge too -- one split merges nothing either way.
MERGE_CASES = [pytest.param(case, "separate", id=f"{name}-separate") for name, case in CASES.items()]
MERGE_CASES += [pytest.param(case, "fused", id=f"{name}-fused") for name, case in CASES.items()
                if case[9] != 1]


# Two float16 cases in bfloat16 (on CPU: the fixed interpreter, tests/conftest.py).
MERGE_CASES += [pytest.param(CASES[name][:7] + (BF16,) + CASES[name][8:], merge, id=f"bf16_{name[4:]}-{merge}",
                             marks=TRITON_BF16_TEST)
                for name, merge in (("f16_n1_m300_gqa_splits2", "fused"), ("f16_n3_m7_mqa_lens01", "separate"))]


@pytest.mark.parametrize("case, merge", MERGE_CASES)
def test_matches_float64_reference(case, merge):
    b, h, hk, n, m, d, dv, dtype, kv, splits, config = case
    q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype)
    kv_lens = None if kv is None else lens_t(kv)
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config,
                                    merge=merge)
    check(got, q, k, v, kv_lens)
    if merge == "fused":
        assert_counters_clear()


def to_pages(k, v, block_size, seed=0, spare=2):
    """A paged copy of the dense k / v [B, Hk, M, *]: blocks of block_size keys scattered over a
    pool with `spare` extra blocks, the pool's unused rows NaN (never read); the int32 table."""
    b, hk, m, _ = k.shape
    blocks = -(-m // block_size)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(b * blocks + spare, generator=g)[:b * blocks].view(b, blocks).to(torch.int32)
    pages = []
    for x in (k, v):
        pool = torch.full((b * blocks + spare, hk, block_size, x.shape[3]), float("nan"), dtype=x.dtype,
                          device=x.device)
        for i in range(b):
            for j in range(blocks):
                rows = x[i, :, j * block_size:(j + 1) * block_size]
                pool[table[i, j], :, :rows.shape[1]] = rows
        pages.append(pool)
    return pages[0], pages[1], table.to(x.device)


# (B, H, Hk, N, M, D, Dv, dtype, kv_lens, num_splits, config, block_size, merge): key tiles of
# 64 / 128 over blocks of 5, 16 and 256 keys (a tile spanning many blocks, part of one block).
PAGED_CASES = {
    "n1_gqa_bs16_splits3": (2, 8, 2, 1, 300, 24, 40, F32, [300, 17], 3, cfg(64), 16, "separate"),
    "n3_mqa_bs5_lens01": (3, 4, 1, 3, 37, 33, 20, F32, [0, 1, 37], 2, cfg(64), 5, "fused"),
    "f16_n16_gqa_bs256_one_split": (1, 8, 2, 16, 600, 32, 48, F16, [599], 1, cfg(128), 256, None),
    "bf16_n1_gqa_bs16": (2, 8, 2, 1, 100, 16, 16, BF16, None, 2, cfg(64), 16, "fused"),
}


@pytest.mark.parametrize("case", [pytest.param(c, id=name, marks=TRITON_BF16_TEST if c[7] == BF16 else ())
                                  for name, c in PAGED_CASES.items()])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_cache_read_in_place_equals_dense(case, causal):
    """block_table: the blocks read in place through the table give the dense call's bits (the
    key tiles are the same; only the rows' addresses differ), and the reference's numbers."""
    b, h, hk, n, m, d, dv, dtype, kv, splits, config, block_size, merge = case
    q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype, seed=block_size)
    kv_lens = lens_t(kv if kv is not None else [m] * b)
    k_pages, v_pages, table = to_pages(k, v, block_size, seed=n)
    got = decode.softmax_decode_fwd(q, k_pages, v_pages, kv_lens=kv_lens, num_splits=splits, config=config,
                                    merge=merge, is_causal=causal, block_table=table)
    want = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config, merge=merge,
                                     is_causal=causal)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    check(got, q, k, v, kv_lens, causal=causal)
    if merge == "fused":
        assert_counters_clear()


def assert_counters_clear():
    """The fused merge leaves every counter at 0 (the next launch relies on it)."""
    for buf in decode._COUNTERS.values():
        assert int(torch.count_nonzero(buf)) == 0


# (B, H, Hk, N, M, D, Dv, dtype, kv_lens, num_splits, config): every query sees all L_b keys.
NON_CAUSAL_CASES = {
    "n3_m300_gqa_lens_0_1_299_splits3": (3, 4, 2, 3, 300, 16, 24, F32, [0, 1, 299], 3, cfg(64)),
    "n16_m70_mqa_row_blocks_direct": (1, 8, 1, 16, 70, 16, 16, F32, [70], 1, cfg(64, bm=32)),
    "f16_n5_m200_gqa_default_splits": (2, 8, 2, 5, 200, 32, 32, F16, [3, 200], None, cfg(64)),
}


@pytest.mark.parametrize("merge", ["separate", "fused"])
@pytest.mark.parametrize("case", NON_CAUSAL_CASES.values(), ids=NON_CAUSAL_CASES.keys())
def test_non_causal_matches_float64_reference(case, merge):
    # L_b = 1 and 3 with N = 3 / 5 queries: causal would kill rows; here every row sees the keys.
    b, h, hk, n, m, d, dv, dtype, kv, splits, config = case
    q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype, seed=21)
    kv_lens = lens_t(kv)
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config,
                                    is_causal=False, merge=merge)
    check(got, q, k, v, kv_lens, causal=False)
    causal = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits,
                                       config=config, merge=merge)
    assert not torch.equal(causal[1], got[1])  # the flag changes what the rows see


# ----------------------------------------------------------------------------------------------
# score options: window, softcap, ALiBi (positions bottom-right, relative to key L_b - 1)
# ----------------------------------------------------------------------------------------------


def option_reference(q, k, v, kv_lens, causal, window, softcap, slopes, dtype=F64, sinks=None):
    """(out, lse) of the reference run in ``dtype``, one batch element at a time on its first L_b
    keys (so the reference's bottom-right alignment of the window and ALiBi is the kernel's),
    causality as a bool mask (bottom-right)."""
    b, h, n, _ = q.shape
    lens = lengths(kv_lens, b, k.shape[2])
    outs, lses = [], []
    for i in range(b):
        m = int(lens[i])
        mask = (torch.arange(m)[None, :] <= m - n + torch.arange(n)[:, None]).to(q.device) if causal else None
        sl = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[i])
        o, l = softmax_attention_reference(q[i:i + 1].to(dtype), k[i:i + 1, :, :m].to(dtype),
                                           v[i:i + 1, :, :m].to(dtype), attn_mask=mask,
                                           enable_gqa=h != k.shape[1], return_lse=True, window=window,
                                           softcap=softcap, alibi_slopes=None if sl is None else sl.to(dtype),
                                           sinks=None if sinks is None else sinks.to(dtype))
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def check_options(got, q, k, v, kv_lens, causal, window, softcap, slopes, sinks=None):
    out, lse = got
    ref = option_reference(q, k, v, kv_lens, causal, window, softcap, slopes, sinks=sinks)
    lowp = None if q.dtype == F32 else option_reference(q, k, v, kv_lens, causal, window, softcap, slopes,
                                                         dtype=q.dtype, sinks=sinks)
    assert_close_to_reference(out, ref[0], None if lowp is None else lowp[0], dtype=q.dtype, name="out")
    assert_close_to_reference(lse, ref[1], None if lowp is None else lowp[1], dtype=q.dtype, name="lse")
    if sinks is None:
        dead = ref[1] == float("-inf")  # rows that see no key: exactly 0 and -inf
        assert torch.all(out[dead] == 0) and torch.all(lse[dead] == float("-inf"))
    return ref


def slopes_for(kind, b, h, device=DEVICE):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(5)
    shape = (h,) if kind == "h" else (b, h)
    return (torch.rand(shape, generator=g) * 0.5 + 0.05).to(device)


# (B, H, Hk, N, M, D, Dv, dtype, kv_lens, num_splits, config, causal, window, softcap, alibi,
#  block_size or None, merge)
OPTION_CASES = {
    # the band [L - N - left, L) cut over 3 splits; L = 0 and 17 (the band reaches key 0)
    "window8_n1_splits3_lens": (3, 8, 2, 1, 300, 24, 40, F32, [300, 17, 0], 3, cfg(64), True, (8, 0), 0.0,
                                None, None, "separate"),
    # zero-width window, not causal: each row sees its own position only; L < N kills rows
    "window00_noncausal_n3_lens012": (4, 4, 1, 3, 70, 16, 16, F32, [0, 1, 2, 70], 2, cfg(64), False, (0, 0),
                                      0.0, None, None, "fused"),
    # a right side, not causal: rows before the last see keys past their position
    "window52_noncausal_n4_gqa": (2, 8, 2, 4, 150, 32, 24, F32, [150, 6], 2, cfg(64), False, (5, 2), 0.0,
                                  None, None, "separate"),
    # windows wider than the cache; left unbounded with a right bound
    "window_wider_than_m": (2, 4, 2, 3, 90, 16, 16, F32, [90, 40], 2, cfg(64), True, (1000, 1000), 0.0,
                            None, None, "separate"),
    "window_left_unbounded_right3": (2, 4, 2, 5, 90, 16, 16, F32, [90, 4], 1, cfg(64), False, (-1, 3), 0.0,
                                     None, None, None),
    "softcap_n16_splits2": (2, 8, 2, 16, 200, 32, 32, F32, [200, 30], 2, cfg(64), True, (-1, -1), 5.0, None,
                            None, "fused"),
    "alibi_h_window_causal_n3": (2, 8, 2, 3, 130, 16, 16, F32, [130, 70], 3, cfg(64), True, (40, -1), 0.0,
                                 "h", None, "separate"),
    "alibi_bh_noncausal_mqa": (2, 4, 1, 2, 100, 16, 16, F32, [100, 9], 2, cfg(64), False, (-1, -1), 0.0,
                               "bh", None, "fused"),
    "all_three_f16_paged_bs16": (2, 8, 2, 3, 200, 32, 32, F16, [200, 45], 3, cfg(64), True, (50, 0), 8.0,
                                 "bh", 16, "fused"),
    "all_three_f32_paged_bs5_one_split": (2, 4, 2, 4, 60, 16, 16, F32, [60, 13], 1, cfg(64), False, (7, 1),
                                          3.0, "h", 5, None),
    "bf16_window_softcap": (2, 8, 2, 1, 100, 16, 16, BF16, [100, 3], 2, cfg(64), True, (20, 0), 4.0, None,
                            None, "separate"),
}


def _run_options(case, seed=31, sinks=None):
    (b, h, hk, n, m, d, dv, dtype, kv, splits, config, causal, window, softcap, alibi, block_size,
     merge) = case
    q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype, seed=seed)
    kv_lens = lens_t(kv)
    slopes = slopes_for(alibi, b, h)
    kwargs = dict(kv_lens=kv_lens, num_splits=splits, config=config, merge=merge, is_causal=causal,
                  window_left=window[0], window_right=window[1], softcap=softcap, alibi_slopes=slopes,
                  sinks=sinks)
    if block_size is None:
        got = decode.softmax_decode_fwd(q, k, v, **kwargs)
    else:
        k_pages, v_pages, table = to_pages(k, v, block_size, seed=n)
        got = decode.softmax_decode_fwd(q, k_pages, v_pages, block_table=table, **kwargs)
        dense = decode.softmax_decode_fwd(q, k, v, **kwargs)
        assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1])
    return got, (q, k, v, kv_lens, causal, window, softcap, slopes)


def sinks_for(h, device=DEVICE):
    """Sinks [H] from below to above the scores' range: some rows dominated by their sink."""
    return torch.linspace(-3.0, 4.0, h).to(device)


@pytest.mark.parametrize("case", [pytest.param(c, id=name, marks=TRITON_BF16_TEST if c[7] == BF16 else ())
                                  for name, c in OPTION_CASES.items()])
def test_score_options_match_float64_reference(case):
    got, args = _run_options(case)
    check_options(got, *args)
    if case[-1] == "fused":
        assert_counters_clear()


# name -> (merge, num_splits, dtype, block size or None): the sink joins at the rows' finish (one
# split) or at either merge; paged; bfloat16 (one rounding of each row: the reference's budget).
SINK_CASES = {
    "direct": (None, 1, F32, None),
    "separate": ("separate", 3, F32, None),
    "fused": ("fused", 3, F32, None),
    "fused_paged": ("fused", 2, F32, 16),
    "bf16_separate": ("separate", 2, BF16, None),
    "bf16_direct": (None, 1, BF16, None),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=TRITON_BF16_TEST if c[2] == BF16 else ())
                                  for n, c in SINK_CASES.items()])
def test_sinks_fold_into_the_finish_and_the_merges(name):
    """Learned sinks (issue 28) with a window, softcap and ALiBi: every row against the float64
    reference; rows that see no key (L = 0; the first row of L = 2 < N) give out 0 and lse =
    their head's sink exactly, through the finish and through both merges."""
    merge, splits, dtype, block_size = SINK_CASES[name]
    b, h, hk, n = 3, 4, 2, 3
    sinks = sinks_for(h)
    case = (b, h, hk, n, 150, 16, 16, dtype, [150, 0, 2], splits, cfg(64), True, (40, 0), 2.5, "h",
            block_size, merge)
    got, args = _run_options(case, seed=12, sinks=sinks)
    check_options(got, *args, sinks=sinks)
    out, lse = got
    dead = option_reference(*args)[1] == float("-inf")  # without the sinks
    assert dead.sum() == h * (n + 1)
    assert torch.all(out[dead] == 0)
    assert torch.equal(lse[dead], sinks.view(1, h, 1).expand(b, h, n)[dead])
    if merge == "fused":
        assert_counters_clear()


def test_sinks_off_is_the_plain_kernel():
    """sinks=None is the kernel without the option, bit for bit, in each merge."""
    q, k, v = make_inputs(2, 4, 2, 3, 100, 16, 16, F32, seed=8)
    for merge, splits in ((None, 1), ("separate", 2), ("fused", 2)):
        kw = dict(kv_lens=lens_t([100, 50]), num_splits=splits, config=cfg(64), merge=merge)
        base = decode.softmax_decode_fwd(q, k, v, **kw)
        with_sinks = decode.softmax_decode_fwd(q, k, v, sinks=torch.full((4,), float("-inf"), device=DEVICE), **kw)
        same = decode.softmax_decode_fwd(q, k, v, sinks=None, **kw)
        assert torch.equal(base[0], same[0]) and torch.equal(base[1], same[1])
        # a -inf sink adds nothing (the other path through the finish)
        assert torch.equal(base[0], with_sinks[0]) and torch.equal(base[1], with_sinks[1])


@pytest.mark.parametrize("splits", [1, 3])
def test_window_reads_only_its_band(splits):
    """The key tiles wholly before the band [L - N - left, L) are never read: NaN there (K and V)
    changes nothing.  With 64-key tiles, L = 300, N = 2, left = 30 the band starts at key 268, its
    tile at 256: keys [0, 256) are NaN."""
    q, k, v = make_inputs(2, 4, 2, 2, 300, 16, 16, F32, seed=3)
    kv_lens = lens_t([300, 300])
    kwargs = dict(kv_lens=kv_lens, num_splits=splits, config=cfg(64), window_left=30, window_right=0)
    clean = decode.softmax_decode_fwd(q, k, v, **kwargs)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :256] = float("nan")
    v_nan[:, :, :256] = float("nan")
    got = decode.softmax_decode_fwd(q, k_nan, v_nan, **kwargs)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])
    check_options(got, q, k, v, kv_lens, True, (30, 0), 0.0, None)
    # the control: key 256 is outside the window but in the band's first tile, which is read
    # (masked): its NaN value reaches the output through 0 * NaN
    v_nan[:, :, 256] = float("nan")
    assert torch.isnan(decode.softmax_decode_fwd(q, k, v_nan, **kwargs)[0]).all()


def test_default_options_are_the_plain_kernel():
    """window (-1, -1), softcap 0.0, no slopes: the kernel without options, bit for bit; each option
    set changes the result."""
    q, k, v = make_inputs(2, 4, 2, 3, 100, 16, 16, F32, seed=8)
    kv_lens = lens_t([100, 50])
    base = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=2, config=cfg(64))
    same = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=2, config=cfg(64), window_left=-1,
                                     window_right=-1, softcap=0.0, alibi_slopes=None)
    assert torch.equal(base[0], same[0]) and torch.equal(base[1], same[1])
    for option in ({"window_left": 10}, {"softcap": 2.0}, {"alibi_slopes": slopes_for("h", 2, 4)}):
        other = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=2, config=cfg(64), **option)
        assert not torch.equal(base[1], other[1]), option


@pytest.mark.parametrize("splits", [3, 12])
def test_fused_merge_matches_separate_and_is_repeatable(splits, monkeypatch):
    # MQA with 2 row blocks of 16 (G * N = 4 * 5 = 20 rows), lengths 0, 1, a partial tile and
    # a full cache: splits past a sequence's end are empty (12 splits of 300 keys: 7 are).
    # The fused path launches one kernel (no merge kernel) and leaves the counters at zero, so
    # the second call is bitwise the first.
    launched = []
    real_wrap = decode.wrap_triton
    monkeypatch.setattr(decode, "wrap_triton", lambda kern: launched.append(kern) or real_wrap(kern))
    q, k, v = make_inputs(4, 4, 1, 5, 300, 16, 16, F32, seed=splits)
    kv_lens = lens_t([0, 1, 77, 300])
    config = cfg(64, bm=16)
    fused = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config,
                                      merge="fused")
    assert launched == []
    assert_counters_clear()
    again = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config,
                                      merge="fused")
    assert torch.equal(fused[0], again[0]) and torch.equal(fused[1], again[1])
    sep = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config,
                                    merge="separate")
    assert launched == [decode._decode_merge_kernel]
    check(fused, q, k, v, kv_lens)
    torch.testing.assert_close(fused[0], sep[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[1], sep[1], rtol=1e-6, atol=1e-6)


def test_fused_counters_grow_when_a_call_needs_more():
    # One buffer per (device, stream), 1024 counters at first; a call needing more than the
    # buffer holds gets a fresh zeroed one (shrunk here to 2 to see it happen), reused after.
    decode._COUNTERS.clear()
    q, k, v = make_inputs(1, 2, 2, 1, 130, 16, 16, F32, seed=8)
    decode.softmax_decode_fwd(q, k, v, num_splits=2, config=cfg(64), merge="fused")
    (key, first), = decode._COUNTERS.items()
    assert first.numel() == 1024 and first.dtype == torch.int32
    decode._COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=first.device)
    q, k, v = make_inputs(3, 4, 2, 3, 130, 16, 16, F32, seed=9)  # 3 * 2 counters needed
    got = decode.softmax_decode_fwd(q, k, v, num_splits=3, config=cfg(64), merge="fused")
    assert decode._COUNTERS[key].numel() == 1024 and len(decode._COUNTERS) == 1
    check(got, q, k, v)
    assert_counters_clear()


def test_dead_rows_and_lengths():
    # N = 3: L = 0 kills every row, L = 1 kills rows 0 and 1 (row 2 sees key 0 only), L = 2
    # kills row 0; lengths past M are clamped to M, negative ones to 0.
    b, h, hk, n, m = 5, 4, 2, 3, 40
    q, k, v = make_inputs(b, h, hk, n, m, 16, 16, F32, seed=1)
    kv_lens = lens_t([0, 1, 2, 1000, -4])
    out, lse = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=2, config=cfg(64))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[[0, 4]] == 0) and torch.all(lse[[0, 4]] == float("-inf"))
    assert torch.all(out[1, :, :2] == 0) and torch.all(lse[1, :, :2] == float("-inf"))
    # row 2 of batch 1 sees key 0 only: out = v[0], lse = scale * q.k0
    g = torch.arange(h) // (h // hk)
    assert torch.allclose(out[1, :, 2], v[1, g, 0], atol=1e-6)
    expect = (q[1, :, 2] * k[1, g, 0]).sum(-1) / 4.0
    assert torch.allclose(lse[1, :, 2], expect, atol=1e-5)
    check((out, lse), q, k, v, kv_lens)
    # clamped length = M: the same result as no kv_lens for that batch element
    full, full_lse = decode.softmax_decode_fwd(q, k, v, num_splits=2, config=cfg(64))
    assert torch.equal(out[3], full[3]) and torch.equal(lse[3], full_lse[3])


def test_scale_and_non_contiguous_inputs():
    # [B, N, H, D] storage viewed as [B, H, N, D]; v strided in its head dim; kv_lens a strided
    # view of an int64 tensor.
    b, h, hk, n, m, d = 2, 4, 2, 3, 130, 24
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, n, h, d, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(b, m, hk, d, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(b, m, hk, 2 * d, generator=g).to(DEVICE).transpose(1, 2)[..., ::2]
    kv_lens = torch.tensor([129, 0, 77, 0], dtype=torch.int64, device=DEVICE)[::2]
    assert not any(t.is_contiguous() for t in (q, k, v, kv_lens))
    got = decode.softmax_decode_fwd(q, k, v, 0.3, kv_lens=kv_lens, num_splits=2, config=cfg(64))
    check(got, q, k, v, kv_lens, scale=0.3)
    default = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=2, config=cfg(64))
    assert (default[0] - got[0]).abs().max() > 1e-3  # the scale is really used


@pytest.mark.parametrize("bn", [64, 128, 256])
def test_every_key_tile(bn):
    # Every BLOCK_N of DECODE_CONFIGS (num_warps / num_stages mean nothing interpreted): two
    # splits, a partial last tile, a length that ends inside a tile.
    q, k, v = make_inputs(2, 4, 2, 3, 300, 16, 16, F32, seed=bn)
    kv_lens = lens_t([300, 200])
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=2, config=cfg(bn))
    check(got, q, k, v, kv_lens)


def test_default_config_and_splits_are_deterministic():
    # config=None runs the first eligible config in the interpreter (autotuned on a GPU); the
    # split count does not change the result beyond rounding.
    q, k, v = make_inputs(1, 4, 1, 2, 600, 16, 16, F32, seed=4)
    a = decode.softmax_decode_fwd(q, k, v)
    b_ = decode.softmax_decode_fwd(q, k, v)
    assert torch.equal(a[0], b_[0]) and torch.equal(a[1], b_[1])
    one = decode.softmax_decode_fwd(q, k, v, num_splits=1, config=cfg(64))
    assert torch.allclose(a[0], one[0], atol=1e-6) and torch.allclose(a[1], one[1], atol=1e-6)
    check(a, q, k, v)


@pytest.mark.parametrize("n, splits, merge", [(3, 3, "separate"), (3, 3, "fused"), (1, 1, None)])
def test_nan_key_poisons_only_the_rows_that_see_it(n, splits, merge):
    # Batch 1 has L = 152; key 150 of kv head 0 is NaN.  With N = 3, query 0 sees keys <= 149
    # (not the NaN), queries 1 and 2 see it; with N = 1 the only query sees it.  Only the query
    # heads of kv head 0's group (0, 1) and batch 1 are touched, across the split boundary.
    b, h, hk, m = 2, 4, 2, 300
    q, k, v = make_inputs(b, h, hk, n, m, 16, 16, F32, seed=5)
    kv_lens = lens_t([300, 152])
    k[1, 0, 150, 3] = float("nan")
    out, lse = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits,
                                         config=cfg(64), merge=merge)
    poisoned = torch.zeros(b, h, n, dtype=torch.bool)
    poisoned[1, :2, (1 if n == 3 else 0):] = True
    poisoned = poisoned.to(out.device)
    assert torch.isnan(out[poisoned]).all() and torch.isnan(lse[poisoned]).all()
    assert not torch.isnan(out[~poisoned]).any() and not torch.isnan(lse[~poisoned]).any()
    clean = k.clone()
    clean[1, 0, 150] = 0.0  # the rows left unpoisoned never see key 150
    ref_out, ref_lse = reference(q, clean, v, kv_lens)
    assert_close_to_reference(out[~poisoned], ref_out[~poisoned], dtype=F32, name="out")
    assert_close_to_reference(lse[~poisoned], ref_lse[~poisoned], dtype=F32, name="lse")


def test_empty_inputs():
    q, k, v = make_inputs(2, 4, 2, 3, 0, 16, 24, F32)
    out, lse = decode.softmax_decode_fwd(q, k, v)
    assert out.shape == (2, 4, 3, 24) and torch.all(out == 0)
    assert torch.all(lse == float("-inf"))
    q, k, v = make_inputs(0, 4, 2, 3, 5, 16, 24, F32)
    out, lse = decode.softmax_decode_fwd(q, k, v)
    assert out.shape == (0, 4, 3, 24) and lse.shape == (0, 4, 3)


# ----------------------------------------------------------------------------------------------
# configs, split heuristic, launcher errors
# ----------------------------------------------------------------------------------------------


def test_config_lists():
    cs = decode.DECODE_CONFIGS
    tuples = [(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in cs]
    # The first H200 run's leaders first (GQA: 64 keys, 2 warps, 2 stages); nothing that lost
    # everywhere (256-key tiles, 128-key tiles on 2 warps, 4 stages).
    assert tuples[:4] == [(64, 2, 2), (64, 2, 3), (64, 4, 3), (64, 8, 3)]
    assert len(set(tuples)) == len(tuples) == 8
    assert all(bn in (64, 128) and s in (2, 3) and not (bn == 128 and w == 2)
               for bn, w, s in tuples)
    small = decode.configs_for(64, 64, rows=4, dtype=F16)
    assert len(small) == 8 and all(c.kwargs["BLOCK_M"] == 16 for c in small)
    for rows in (1, 4, 32, 64, 128, 512):
        for dtype in (F16, BF16, F32):
            esize = torch.empty((), dtype=dtype).element_size()
            for d in (64, 128, 256):
                got = decode.configs_for(d, d, rows=rows, dtype=dtype)
                assert got
                for c in got:
                    bm, bn, w = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps
                    assert 16 <= bm <= decode.MAX_BLOCK_M and bm & (bm - 1) == 0
                    assert bm <= max(16, triton.next_power_of_2(rows))
                    assert bm * bn * max(d, 16) // (32 * w) <= 8192  # registers
                    assert decode._smem_estimate(bm, bn, d, d, c.num_stages, esize, w) <= 232448
    # Triton 3.9's sm_90 layouts (compiled on the CPU): wgmma (BM=128, 8 warps) 224 KiB and
    # 272 KiB (BM=64 BN=256 2 stages: too much), mma.sync (BM=16 BN=128 3 stages) 136 KiB
    assert decode._smem_estimate(128, 128, 128, 128, 3, 2, 8) == 224 * 1024
    assert decode._smem_estimate(64, 256, 128, 128, 2, 2, 8) == 272 * 1024
    assert decode._smem_estimate(16, 128, 128, 128, 3, 2, 4) == 136 * 1024
    # MQA, 32 heads x 16 queries, bf16 D = 128: every entry fits, with the first H200 run's
    # row tiles (2 warps: 32 rows; 4 warps 64-key: 128; 8 warps: 128)
    big = decode.configs_for(128, 128, rows=512, dtype=BF16)
    assert [(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in big] == tuples
    assert {c.kwargs["BLOCK_M"] for c in big} == {32, 64, 128}
    assert big[0].kwargs["BLOCK_M"] == 32 and big[3].kwargs["BLOCK_M"] == 128
    assert len(decode.configs_for(256, 256, rows=4, dtype=F32)) < len(big)  # shared memory


def test_wave_balance():
    assert decode.wave_balance(132, 132) == 1.0 and decode.wave_balance(264, 132) == 1.0
    assert decode.wave_balance(320, 132) == pytest.approx(320 / 396)  # 56 SMs run 3, 76 run 2
    assert decode.wave_balance(1, 132) == pytest.approx(1 / 132)


@pytest.mark.parametrize("args, sms, want", [
    # B=8 GQA 32/8 (64 programs): 5 splits leave 76 of 132 SMs a program short; 6 fill all
    # evenly (384 = 132 x 2.9); the same at 128k (the partials stay tiny: 4 rows per kv head)
    ((8, 8, 4, 8192), 132, 6),
    ((8, 8, 1, 8192), 132, 6),
    ((8, 8, 16, 131072), 132, 6),
    # 1024 keys: at most 4 splits of 256
    ((8, 8, 4, 1024), 132, 4),
    # MQA N = 1 (32 rows, one row block of 8 programs): the partials cap it at 16 (the H200
    # run's best of 16 / 32 / 64 / 128); at 128k 33 x 8 = 264 = 2 x 132 exactly
    ((8, 1, 32, 8192), 132, 16),
    ((8, 1, 32, 131072), 132, 33),
    # MQA N = 4 (128 rows): partials 8 * 128 * Dv bytes a split against 4 * 8192 * D of K/V
    ((8, 1, 128, 8192), 132, 4),
    # MQA N = 16 (512 rows in 4 row blocks of 128): any split would cost more than 1/8 in partials
    ((8, 1, 512, 8192), 132, 1),
    # the GPU is full already (>= 2 programs per SM), or too few keys to split
    ((64, 32, 1, 1 << 17), 132, 1),
    ((4, 66, 4, 8192), 132, 1),
    ((2, 66, 4, 8192), 132, 2),  # 132 programs: 2 splits fill 2 x 132 exactly
    ((1, 1, 1, 255), 132, 1),
    # another SM count: 64 programs on 114 SMs (an H100 PCIe): lo = 4 (256 = 2.2 per SM),
    # 7 fills 114 x 4 - 8 best of 4..8
    ((8, 8, 4, 8192), 114, 7),
    ((1, 8, 4, 8192), 132, 32),  # 8 programs: 33 wanted, 8192 // 256 = 32 allowed
])
def test_default_num_splits(args, sms, want):
    got = decode.default_num_splits(*args, sms=sms)
    assert got == want
    batch, kv_heads, rows, kv_len = args
    programs = batch * kv_heads * -(-rows // decode.MAX_BLOCK_M)
    assert got == 1 or kv_len // got >= decode.MIN_SPLIT_KEYS
    if 1 < got and programs * got >= decode.MIN_WAVES * sms:  # not capped: the most even fill
        lo = -(-decode.MIN_WAVES * sms // programs)
        for s in range(lo, 2 * lo + 1):
            if kv_len // s >= decode.MIN_SPLIT_KEYS and 2 * rows * s <= decode.PARTIAL_SHARE * kv_len:
                assert decode.wave_balance(programs * s, sms) <= decode.wave_balance(programs * got, sms) + 1e-9


def test_sm_count_off_cuda():
    assert decode.sm_count(torch.device("cpu")) == decode.DEFAULT_SM_COUNT


def test_merge_tiles():
    # Few rows (GQA N = 1: 8 x 32 rows): 2 rows a program, 128 programs; many: up to 8192
    # float32 partial elements a step.
    assert decode._merge_tiles(5, 128, 256) == (8, 2)
    assert decode._merge_tiles(5, 128, 1 << 16) == (8, 8)
    assert decode._merge_tiles(40, 128, 1 << 16) == (16, 4)
    assert decode._merge_tiles(2, 16, 1 << 20) == (2, 32)
    assert decode._merge_tiles(3, 256, 1) == (4, 2)
    assert decode._merge_tiles(3, 256) == (4, 8)  # no row count: the step size alone


def _small(d=16, dv=16, h=4, hk=2, n=3, dtype=F32):
    return make_inputs(1, h, hk, n, 5, d, dv, dtype)


@pytest.mark.parametrize("inputs, extra, exc, match", [
    (lambda: _small(n=17), {}, ValueError, r"at most 16 query rows .* N = 17"),
    (lambda: _small(d=272), {}, ValueError, r"q/k head dim must be in 1\.\.256; got 272"),
    (lambda: _small(dv=300), {}, ValueError, r"v head dim must be in 1\.\.256; got 300"),
    (lambda: _small(h=3, hk=2), {}, ValueError, r"multiple of key/value heads"),
    (lambda: _small(dtype=F64), {}, TypeError, r"float16, bfloat16 or float32; got torch.float64"),
    (lambda: [t[0] for t in _small()], {}, ValueError, r"q must be 4-D"),
    (lambda: [_small()[0], *_small(dtype=F16)[1:]], {}, TypeError, r"must share a dtype"),
    (lambda: [_small()[0], _small()[1][:, :, :4], _small()[2]], {}, ValueError,
     r"same heads and length"),
    (lambda: _small(), {"kv_lens": torch.ones(2, dtype=torch.int32)}, ValueError,
     r"kv_lens must have shape \[B\] = \[1\]"),
    (lambda: _small(), {"kv_lens": torch.ones(1)}, TypeError, r"kv_lens must be int32"),
    (lambda: _small(), {"kv_lens": [3]}, TypeError, r"kv_lens must be an int32 tensor"),
    (lambda: _small(), {"num_splits": 0}, ValueError, r"num_splits must be >= 1; got 0"),
    (lambda: _small(), {"num_splits": 2.0}, TypeError, r"num_splits must be a positive int"),
    (lambda: _small(), {"config": cfg(48)}, ValueError, r"BLOCK_N must be a power of two"),
    (lambda: _small(), {"config": "fast"}, TypeError, r"config must be a triton.Config"),
    (lambda: _small(), {"merge": "both"}, ValueError, r"merge must be one of 'separate', 'fused'"),
    (lambda: _small(), {"is_causal": 1}, TypeError, r"is_causal must be a bool"),
    (lambda: _small(), {"block_table": torch.zeros(1, 2)}, TypeError, r"block_table must be int32"),
    (lambda: _small(), {"block_table": torch.zeros(2, 2, dtype=torch.int32)}, ValueError,
     r"block_table must be \[B, max_blocks\] with B = 1"),
    (lambda: _small(), {"block_table": [[0]]}, TypeError, r"block_table must be an int32 tensor"),
    (lambda: [_small()[0], _small()[1][:, :, :0], _small()[2][:, :, :0]],
     {"block_table": torch.zeros(1, 2, dtype=torch.int32)}, ValueError, r"block_size >= 1"),
    (lambda: _small(), {"window_left": -2}, ValueError, r"window_left must be >= -1 \(-1 = unbounded\); got -2"),
    (lambda: _small(), {"window_right": 1.5}, TypeError, r"window_right must be an int >= -1"),
    (lambda: _small(), {"softcap": -1.0}, ValueError, r"softcap must be a finite number >= 0"),
    (lambda: _small(), {"softcap": "2"}, TypeError, r"softcap must be a real number"),
    (lambda: _small(), {"alibi_slopes": torch.ones(4, dtype=F16)}, TypeError, r"alibi_slopes must be float32"),
    (lambda: _small(), {"alibi_slopes": torch.ones(3)}, ValueError,
     r"alibi_slopes of shape \(3,\) does not broadcast to \[B, H\] = \[1, 4\]"),
    (lambda: _small(), {"alibi_slopes": [0.5] * 4}, TypeError, r"alibi_slopes must be a float32 tensor"),
    (lambda: [_small()[0], torch.zeros(3, 2, 5, 16), torch.zeros(4, 2, 5, 16)],
     {"block_table": torch.zeros(1, 2, dtype=torch.int32)}, ValueError, r"same number of blocks"),
])
def test_launcher_errors(inputs, extra, exc, match):
    q, k, v = inputs()
    extra = {key: (val.to(DEVICE) if torch.is_tensor(val) else val) for key, val in extra.items()}
    with pytest.raises(exc, match=match):
        decode.softmax_decode_fwd(q, k, v, **extra)


@pytest.mark.skipif(DEVICE != "cuda", reason="the device check needs a GPU to mix devices")
def test_launcher_rejects_mixed_devices():
    q, k, v = _small()
    with pytest.raises(ValueError, match="one device"):
        decode.softmax_decode_fwd(q, k.cpu(), v)


# ----------------------------------------------------------------------------------------------
# the GPU bench's plan (bench/decode_gpu.py): what the next GPU run will time, from this kernel's
# configs and heuristic (no GPU needed)
# ----------------------------------------------------------------------------------------------


def test_bench_plan_reaches_every_config_of_both_merges():
    from attnkit.bench import decode_gpu as g

    quick = g.shapes(quick=True)
    assert [(s["Hk"], s["N"], s["M"], s["dtype"]) for s in quick] == [
        (8, 1, 8192, "bfloat16"), (8, 4, 8192, "bfloat16"), (1, 1, 8192, "bfloat16"),
        (1, 4, 8192, "bfloat16")]
    plan = g.make_plan(quick, 132)
    first = plan[0]
    assert first["S"] == 6 and first["configs"][0] == (16, 64, 2, 2)
    assert len(first["configs"]) == len(decode.DECODE_CONFIGS) and first["dropped"] == []
    assert {2, 4, 5, 6, 8, 10, 12, 16, 20} <= set(first["split_variants"])
    tasks = g.compile_tasks(plan)
    keys = {t["key"] for t in tasks}
    for entry in plan:  # every pass-1 row of every shape has its kernel compiled ahead
        for config in entry["configs"]:
            for merge in g.merges_for(entry["S"]):
                task = dict(entry["shape"], S=entry["S"], config=list(config), merge=merge)
                assert g.task_key(task) in keys
        for s in entry["split_variants"]:  # and every separate merge tile of the sweep
            task = dict(entry["shape"], S=s, config=list(entry["configs"][0]), merge="separate")
            assert g.merge_key(task) in {g.merge_key(t) for t in tasks}
    assert len(tasks) <= 80  # ~30 s of 15 compile children on the H200 (84 took 28 s)
    # the full mode adds 32k and 128k keys, after the quick shapes; --kv-lens picks lengths
    full = g.shapes()
    assert full[:4] == quick and len(full) == 48
    assert [s["M"] for s in full[4:8]] == [32768, 32768, 131072, 131072]
    assert {s["M"] for s in g.shapes(True, kv_lens=[32768, 131072])} == {32768, 131072}


def test_bench_split_sweep_and_records():
    from attnkit.bench import decode_gpu as g

    # 64 programs on 132 SMs: 2 .. 33 splits (0.97 .. 16 per SM), whole waves 3, 5, 7, 9 too
    assert g.split_sweep(64, 132, 8192, 6) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 24, 32]
    assert 1 in g.split_sweep(512, 132, 8192, 1) and 1 not in g.split_sweep(64, 132, 8192, 6)
    assert max(g.split_sweep(8, 132, 1024, 16)) <= 1024 // 64
    assert g.config_label(16, 64, 2, 2, 6, "fused") == "S=6 BM=16 BN=64 w2 s2 fused"
    assert g.config_label(16, 64, 2, 2, 1, "fused") == "S=1 BM=16 BN=64 w2 s2"
    shape = g.shapes(quick=True)[0]
    rows = [{"impl": "copy K/V", "kind": "copy", "seconds": 1e-4},
            {"impl": "SDPA", "kind": "sdpa", "seconds": 8e-5},
            {"impl": "a", "kind": "decode", "splits": 6, "merge": "separate", "seconds": 9e-5},
            {"impl": "b", "kind": "decode", "splits": 6, "merge": "fused", "seconds": 7e-5},
            {"impl": "c", "kind": "decode", "splits": 4, "merge": "fused", "seconds": 7.5e-5},
            {"impl": "d", "kind": "decode", "splits": 1, "merge": "direct", "seconds": 2e-4}]
    rec = g.finish_record(shape, rows, 4000.0)
    assert rec["best"] == "b"
    assert rec["best_by_merge"] == {"fused": "b", "separate": "a", "direct": "d"}
    rec["heuristic_splits"] = 6
    text = g.format_summary([rec])
    assert "heuristic S=6  separate 0.0900 / 0.89 / S=6; fused 0.0700 / 1.14 / S=6" in text


# ----------------------------------------------------------------------------------------------
# out-of-bounds accesses, caught in guarded memory (child process)
# ----------------------------------------------------------------------------------------------

# (name, B, H, Hk, N, M, D, Dv, kv_lens, num_splits, [(BLOCK_N, BLOCK_M or None)], dtypes, merge):
# a partial last tile, lengths 0 and past M (clamped), padded rows and head dims (D = 24 in a
# 32-wide tile), partials and the merge; then one split written directly, several row blocks;
# the fused merge with its counters allocated at their exact size (several row blocks, empty
# splits, a length-1 sequence), non-causal too.
BOUNDS_CASES = [
    ("gqa_n3_m70_splits3", 3, 4, 2, 3, 70, 24, 40, [70, 0, 200], 3,
     [(64, None), (128, None), (256, None)], (F32,), "separate"),
    ("gqa_n3_m70_splits3", 3, 4, 2, 3, 70, 24, 40, [70, 0, 200], 3, [(64, None)], (F16,),
     "separate"),
    ("mqa_n16_m33_direct_rowblocks", 1, 4, 1, 16, 33, 16, 8, None, 1, [(64, 32)], (F32, F16),
     "separate"),
    ("mqa_n5_m70_fused_rowblocks", 2, 8, 1, 5, 70, 24, 40, [1, 200], 4, [(64, 16)], (F32, F16),
     "fused"),
    ("gqa_n3_m70_fused_noncausal", 3, 4, 2, 3, 70, 24, 40, [70, 0, 2], 3, [(64, None)], (F32,),
     "fused-noncausal"),
    # the score options: a window (the band's splits start past key 0), softcap, ALiBi [B, H]
    # slopes read from guarded memory
    ("gqa_n3_m200_options_splits3", 3, 4, 2, 3, 200, 24, 40, [200, 0, 150], 3, [(64, None)], (F32,),
     "separate-options"),
    ("mqa_n5_m200_options_fused", 2, 8, 1, 5, 200, 24, 40, [200, 3], 4, [(64, 16)], (F16,),
     "fused-noncausal-options"),
]


def _bounds_child():
    """Run every BOUNDS_CASES launch on guarded inputs with guarded launcher buffers, in both
    guard modes; print one line per case (the parent names the case a fault killed)."""
    from guarded_memory import MODES, GuardedAllocations, guarded_copy, is_guarded

    faulthandler.enable()
    decode._COUNTERS_MIN = 0  # fused-merge counters at the size the launch asks for
    for name, b, h, hk, n, m, d, dv, kv, splits, tiles, dtypes, variant in BOUNDS_CASES:
        merge, *flags = variant.split("-")
        kw = dict(num_splits=splits, merge=merge, is_causal="noncausal" not in flags)
        options = "options" in flags
        if options:
            kw.update(window_left=70, window_right=2, softcap=3.0)
        for dtype in dtypes:
            q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype, seed=7, device="cpu")
            kv_lens = None if kv is None else torch.tensor(kv, dtype=torch.int32)
            slopes = slopes_for("bh" if options else None, b, h, device="cpu")
            for bn, bm in tiles:
                config = cfg(bn, bm)
                plain = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, config=config, alibi_slopes=slopes,
                                                  **kw)
                for where in MODES:
                    label = f"{name} {dtype} BLOCK_N={bn} BLOCK_M={bm} guard at {where}"
                    print("start", label, flush=True)
                    gq, gk, gv = (guarded_copy(t, where) for t in (q, k, v))
                    glens = None if kv_lens is None else guarded_copy(kv_lens, where)
                    gslopes = None if slopes is None else guarded_copy(slopes, where)
                    decode._COUNTERS.clear()  # allocated below, under the guard
                    with GuardedAllocations(where) as alloc:
                        out, lse = decode.softmax_decode_fwd(gq, gk, gv, kv_lens=glens,
                                                             config=config, alibi_slopes=gslopes, **kw)
                    assert alloc.count > 0 and is_guarded(out) and is_guarded(lse), label
                    if merge == "fused":
                        assert all(is_guarded(c) for c in decode._COUNTERS.values()), label
                    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), label
                    print("done", label, flush=True)
    print("all done", flush=True)


def test_no_out_of_bounds_access():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "bounds"], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    started = [ln[len("start "):] for ln in lines if ln.startswith("start ")]
    done = [ln[len("done "):] for ln in lines if ln.startswith("done ")]
    where = started[-1] if started and len(done) < len(started) else "(before the first case)"
    assert proc.returncode == 0 and lines and lines[-1] == "all done", (
        f"bounds child failed (exit {proc.returncode}) in {where}:\n{proc.stderr[-3000:]}")
    expected = sum(len(c[10]) * len(c[11]) * 2 for c in BOUNDS_CASES)
    assert len(done) == expected


# ----------------------------------------------------------------------------------------------
# GPU: bfloat16 (its small cases run interpreted too), decoding sizes, against torch SDPA
# ----------------------------------------------------------------------------------------------


def sdpa(q, k, v, kv_lens=None, causal=True):
    """torch SDPA with the decoding mask (bottom-right; only when needed) in q's dtype."""
    import torch.nn.functional as F

    b, _, n, _ = q.shape
    m = k.shape[2]
    needed = kv_lens is not None or (causal and n > 1)
    mask = decode_mask(kv_lens, b, n, m, q.device, causal) if needed else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def check_gpu(got, q, k, v, kv_lens=None, causal=True):
    """Against the float64 reference, with torch SDPA in the inputs' dtype as the tolerance run
    (rows without keys, where SDPA gives NaN, are checked apart)."""
    out, lse = got
    ref_out, ref_lse = reference(q, k, v, kv_lens, causal=causal)
    low = sdpa(q, k, v, kv_lens, causal)
    dead = dead_rows(kv_lens, *q.shape[:3], k.shape[2], causal).to(q.device)
    assert torch.all(out[dead] == 0) and torch.all(lse[dead] == float("-inf"))
    live = ~dead
    assert_close_to_reference(out[live], ref_out[live], low[live], dtype=q.dtype, name="out")
    # SDPA has no lse: the float32 rule for it (the kernel keeps it in float32)
    err = (lse[live].double() - ref_lse[live]).abs().max().item()
    assert err <= 1e-3, f"lse max error {err:.3e}"


MERGES = ["separate", "fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [1, 4])
def test_gpu_decoding_sizes(dtype, n, merge):
    # B=8 H=32 Hk=8 M=8192 D=128, the heuristic split, a fixed tile (no autotuning here).
    q, k, v = make_inputs(8, 32, 8, n, 8192, 128, 128, dtype, seed=n)
    got = decode.softmax_decode_fwd(q, k, v, config=cfg(128, warps=4, stages=3), merge=merge)
    check_gpu(got, q, k, v)


@pytest.mark.gpu
@pytest.mark.autotune
@pytest.mark.parametrize("merge", MERGES)
def test_gpu_autotuned_bf16(merge):
    q, k, v = make_inputs(8, 32, 8, 1, 8192, 128, 128, BF16, seed=11)
    check_gpu(decode.softmax_decode_fwd(q, k, v, merge=merge), q, k, v)
    assert_counters_clear()  # the autotuner's timing runs included


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_gpu_mqa_lengths(dtype, merge):
    # MQA with 4 row blocks (32 heads x 16 queries), lengths 0 and 1 among long ones, 5 splits.
    b, m = 4, 3000
    q, k, v = make_inputs(b, 32, 1, 16, m, 128, 128, dtype, seed=12)
    kv_lens = lens_t([0, 1, 2999, 1500])
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=5,
                                    config=cfg(64, warps=4, stages=3), merge=merge)
    check_gpu(got, q, k, v, kv_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [cfg(64, warps=2, stages=2), cfg(64, warps=8, stages=3)],
                         ids=["w2", "w8"])
def test_gpu_fused_merge_is_race_free(config):
    # The fused merge's publication (partials stored, barrier, acq_rel atomic; the last program
    # reads them back): many programs finishing together, 8 warps (more threads to order) and
    # 2, lengths that leave splits empty.  Repeated calls must agree bitwise (a race would show
    # as a run-to-run difference or a wrong row) and leave the counters at zero.
    q, k, v = make_inputs(8, 32, 8, 4, 8192, 128, 128, BF16, seed=14)
    kv_lens = lens_t([8192, 1, 0, 5000, 64, 65, 8191, 3000])
    runs = [decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=48, config=config,
                                      merge="fused") for _ in range(6)]
    torch.cuda.synchronize()
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    assert_counters_clear()
    check_gpu(runs[0], q, k, v, kv_lens)
    sep = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=48, config=config)
    torch.testing.assert_close(runs[0][1], sep[1], rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
def test_gpu_non_causal(merge):
    q, k, v = make_inputs(4, 32, 8, 16, 3000, 128, 128, BF16, seed=15)
    kv_lens = lens_t([3000, 1, 0, 2048])
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=4, is_causal=False,
                                    config=cfg(64, warps=2, stages=2), merge=merge)
    check_gpu(got, q, k, v, kv_lens, causal=False)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("n", [1, 4])
def test_gpu_score_options(n, merge, paged):
    # Decoding sizes with every kernel option (issue 28): a 1024-key window of caches up to 8192
    # (the band's splits), softcap, ALiBi [B, H], sinks; bfloat16, a paged cache of 256-key blocks
    # too, against the float64 reference request by request; paged = dense bit for bit.
    b, m = 4, 8192
    case = (b, 32, 8, n, m, 128, 128, BF16, [8192, 1, 700, 5000], None, cfg(64, warps=2, stages=2), True,
            (1024, 0), 30.0, "bh", 256 if paged else None, merge)
    got, args = _run_options(case, seed=16 + n, sinks=sinks_for(32))
    check_options(got, *args, sinks=sinks_for(32))


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("index", range(len(decode.configs_for(128, 128, rows=16, dtype=BF16))))
def test_gpu_every_config_bf16(index, merge):
    # Every candidate compiles, runs and gives the right answer (GQA 32/8, N = 4, three splits),
    # with either merge, one test per config so that they compile on separate workers (issue
    # 26).  The heads, N and head dim are the bench's (bench/decode_gpu.py).
    q, k, v = make_inputs(2, 32, 8, 4, 2000, 128, 128, BF16, seed=13)
    c = decode.configs_for(128, 128, rows=16, dtype=BF16)[index]
    check_gpu(decode.softmax_decode_fwd(q, k, v, num_splits=3, config=c, merge=merge), q, k, v)


if __name__ == "__main__" and sys.argv[1:] == ["bounds"]:
    _bounds_child()

"""Split-KV decoding kernel (attnkit.kernels.decode, issue 26): softmax_decode_fwd.

Without a GPU the kernels run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports attnkit): float32 and float16 only (the interpreter's
bfloat16 ``tl.dot`` is garbage, DESIGN.md), tiny shapes, fixed tile configs.  With a GPU the same
tests run on CUDA, plus the ``gpu``-marked ones (bfloat16 and float16 at decoding sizes, against
torch SDPA).

Ground truth: ``softmax_attention_reference`` in float64 on the same (already rounded) inputs,
with the decoding mask as a bool tensor: batch b has L_b = kv_lens[b] keys and query i of N sees
key j iff j <= L_b - N + i (bottom-right).  Tolerance (DESIGN.md): float32 within 2e-5 of the
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
from attnkit_testing import assert_close_to_reference  # noqa: E402

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


def decode_mask(kv_lens, b, n, m, device=DEVICE):
    """bool [B, 1, N, M]: query i of batch b sees key j iff j <= L_b - N + i."""
    lens = lengths(kv_lens, b, m)
    j = torch.arange(m)
    i = torch.arange(n)
    allowed = j[None, None, :] <= (lens[:, None, None] - n + i[None, :, None])
    return allowed[:, None].to(device)


def dead_rows(kv_lens, b, h, n, m):
    """bool [B, H, N]: rows that see no key."""
    lens = lengths(kv_lens, b, m)
    dead = (lens[:, None] - n + torch.arange(n)[None, :]) < 0  # [B, N]
    return dead[:, None, :].expand(b, h, n)


def reference(q, k, v, kv_lens, scale=None, dtype=F64):
    """(out, lse) of the reference run in ``dtype`` on the given inputs."""
    b, _, n, _ = q.shape
    m = k.shape[2]
    mask = decode_mask(kv_lens, b, n, m, q.device)
    return softmax_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                       return_lse=True)


def check(got, q, k, v, kv_lens=None, scale=None):
    out, lse = got
    dtype = q.dtype
    assert out.dtype == dtype and lse.dtype == F32
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    assert lse.shape == q.shape[:3]
    ref = reference(q, k, v, kv_lens, scale)
    lowp = None if dtype == F32 else reference(q, k, v, kv_lens, scale, dtype=dtype)
    assert_close_to_reference(out, ref[0], None if lowp is None else lowp[0], dtype=dtype,
                              name="out")
    assert_close_to_reference(lse, ref[1], None if lowp is None else lowp[1], dtype=dtype,
                              name="lse")
    # dead rows: exactly 0 and -inf (not NaN)
    dead = dead_rows(kv_lens, *q.shape[:3], k.shape[2]).to(out.device)
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
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_float64_reference(case):
    b, h, hk, n, m, d, dv, dtype, kv, splits, config = case
    q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype)
    kv_lens = None if kv is None else lens_t(kv)
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits, config=config)
    check(got, q, k, v, kv_lens)


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


@pytest.mark.parametrize("n, splits", [(3, 3), (1, 1)])
def test_nan_key_poisons_only_the_rows_that_see_it(n, splits):
    # Batch 1 has L = 152; key 150 of kv head 0 is NaN.  With N = 3, query 0 sees keys <= 149
    # (not the NaN), queries 1 and 2 see it; with N = 1 the only query sees it.  Only the query
    # heads of kv head 0's group (0, 1) and batch 1 are touched, across the split boundary.
    b, h, hk, m = 2, 4, 2, 300
    q, k, v = make_inputs(b, h, hk, n, m, 16, 16, F32, seed=5)
    kv_lens = lens_t([300, 152])
    k[1, 0, 150, 3] = float("nan")
    out, lse = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits,
                                         config=cfg(64))
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
    assert len(cs) == 27
    assert {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in cs} == {
        (bn, w, s) for bn in (64, 128, 256) for w in (2, 4, 8) for s in (2, 3, 4)}
    small = decode.configs_for(64, 64, rows=4, dtype=F16)
    assert len(small) == 27 and all(c.kwargs["BLOCK_M"] == 16 for c in small)
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
    # MQA, 32 heads x 16 queries, bf16 D = 128: every entry but BN=256 with 2 warps or 3+
    # stages fits, with a row tile of 16 to 128
    big = decode.configs_for(128, 128, rows=512, dtype=BF16)
    assert {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in big} == {
        (bn, w, s) for bn in (64, 128, 256) for w in (2, 4, 8) for s in (2, 3, 4)
        if bn < 256 or (w > 2 and s == 2)}
    assert {c.kwargs["BLOCK_M"] for c in big} == {16, 32, 64, 128}
    assert len(decode.configs_for(256, 256, rows=4, dtype=F32)) < len(big)  # shared memory


def test_default_num_splits():
    # B * Hk * row_blocks * splits ~ 2 x SMs, >= 256 keys a split
    assert decode.default_num_splits(8, 8, 4, 8192, 132) == 5  # 64 programs -> 5 splits
    assert decode.default_num_splits(8, 1, 32, 131072, 132) == 33
    assert decode.default_num_splits(8, 1, 512, 8192, 132) == 9  # 4 row blocks of 128
    assert decode.default_num_splits(8, 8, 4, 1024, 132) == 4  # capped: 1024 / 256
    assert decode.default_num_splits(1, 1, 1, 255, 132) == 1
    assert decode.default_num_splits(64, 32, 1, 1 << 17, 132) == 1  # the GPU is full already
    assert decode.sm_count(torch.device("cpu")) == decode.DEFAULT_SM_COUNT


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
# out-of-bounds accesses, caught in guarded memory (child process)
# ----------------------------------------------------------------------------------------------

# (name, B, H, Hk, N, M, D, Dv, kv_lens, num_splits, [(BLOCK_N, BLOCK_M or None)], dtypes):
# a partial last tile, lengths 0 and past M (clamped), padded rows and head dims (D = 24 in a
# 32-wide tile), partials and the merge; then one split written directly, several row blocks.
BOUNDS_CASES = [
    ("gqa_n3_m70_splits3", 3, 4, 2, 3, 70, 24, 40, [70, 0, 200], 3,
     [(64, None), (128, None), (256, None)], (F32,)),
    ("gqa_n3_m70_splits3", 3, 4, 2, 3, 70, 24, 40, [70, 0, 200], 3, [(64, None)], (F16,)),
    ("mqa_n16_m33_direct_rowblocks", 1, 4, 1, 16, 33, 16, 8, None, 1, [(64, 32)], (F32, F16)),
]


def _bounds_child():
    """Run every BOUNDS_CASES launch on guarded inputs with guarded launcher buffers, in both
    guard modes; print one line per case (the parent names the case a fault killed)."""
    from guarded_memory import MODES, GuardedAllocations, guarded_copy, is_guarded

    faulthandler.enable()
    for name, b, h, hk, n, m, d, dv, kv, splits, tiles, dtypes in BOUNDS_CASES:
        for dtype in dtypes:
            q, k, v = make_inputs(b, h, hk, n, m, d, dv, dtype, seed=7, device="cpu")
            kv_lens = None if kv is None else torch.tensor(kv, dtype=torch.int32)
            for bn, bm in tiles:
                config = cfg(bn, bm)
                plain = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, num_splits=splits,
                                                  config=config)
                for where in MODES:
                    label = f"{name} {dtype} BLOCK_N={bn} BLOCK_M={bm} guard at {where}"
                    print("start", label, flush=True)
                    gq, gk, gv = (guarded_copy(t, where) for t in (q, k, v))
                    glens = None if kv_lens is None else guarded_copy(kv_lens, where)
                    with GuardedAllocations(where) as alloc:
                        out, lse = decode.softmax_decode_fwd(gq, gk, gv, kv_lens=glens,
                                                             num_splits=splits, config=config)
                    assert alloc.count > 0 and is_guarded(out) and is_guarded(lse), label
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
# GPU: bfloat16 (wrong in the interpreter), decoding sizes, against torch SDPA
# ----------------------------------------------------------------------------------------------


def sdpa(q, k, v, kv_lens=None):
    """torch SDPA with the decoding mask (bottom-right; only when needed) in q's dtype."""
    import torch.nn.functional as F

    b, _, n, _ = q.shape
    m = k.shape[2]
    mask = None if (n == 1 and kv_lens is None) else decode_mask(kv_lens, b, n, m, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def check_gpu(got, q, k, v, kv_lens=None):
    """Against the float64 reference, with torch SDPA in the inputs' dtype as the tolerance run
    (rows without keys, where SDPA gives NaN, are checked apart)."""
    out, lse = got
    ref_out, ref_lse = reference(q, k, v, kv_lens)
    low = sdpa(q, k, v, kv_lens)
    dead = dead_rows(kv_lens, *q.shape[:3], k.shape[2]).to(q.device)
    assert torch.all(out[dead] == 0) and torch.all(lse[dead] == float("-inf"))
    live = ~dead
    assert_close_to_reference(out[live], ref_out[live], low[live], dtype=q.dtype, name="out")
    # SDPA has no lse: the float32 rule for it (the kernel keeps it in float32)
    err = (lse[live].double() - ref_lse[live]).abs().max().item()
    assert err <= 1e-3, f"lse max error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [1, 4])
def test_gpu_decoding_sizes(dtype, n):
    # B=8 H=32 Hk=8 M=8192 D=128, the heuristic split, a fixed tile (no autotuning here).
    q, k, v = make_inputs(8, 32, 8, n, 8192, 128, 128, dtype, seed=n)
    got = decode.softmax_decode_fwd(q, k, v, config=cfg(128, warps=4, stages=3))
    check_gpu(got, q, k, v)


@pytest.mark.gpu
@pytest.mark.autotune
def test_gpu_autotuned_bf16():
    q, k, v = make_inputs(8, 32, 8, 1, 8192, 128, 128, BF16, seed=11)
    check_gpu(decode.softmax_decode_fwd(q, k, v), q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_gpu_mqa_lengths(dtype):
    # MQA with 4 row blocks (32 heads x 16 queries), lengths 0 and 1 among long ones.
    b, m = 4, 3000
    q, k, v = make_inputs(b, 32, 1, 16, m, 128, 128, dtype, seed=12)
    kv_lens = lens_t([0, 1, 2999, 1500])
    got = decode.softmax_decode_fwd(q, k, v, kv_lens=kv_lens, config=cfg(64, warps=4, stages=3))
    check_gpu(got, q, k, v, kv_lens)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(decode.configs_for(128, 128, rows=16, dtype=BF16))))
def test_gpu_every_config_bf16(index):
    # Every candidate compiles, runs and gives the right answer (GQA 32/8, N = 4, three splits),
    # one test per config so that they compile on separate workers (issue 26).  The heads, N and
    # head dim are the bench's (bench/decode_gpu.py).
    q, k, v = make_inputs(2, 32, 8, 4, 2000, 128, 128, BF16, seed=13)
    c = decode.configs_for(128, 128, rows=16, dtype=BF16)[index]
    check_gpu(decode.softmax_decode_fwd(q, k, v, num_splits=3, config=c), q, k, v)


if __name__ == "__main__" and sys.argv[1:] == ["bounds"]:
    _bounds_child()

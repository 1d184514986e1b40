"""The bfloat16 decoding kernel's own AMX tiles (issue 25; csrc/cpu/amx_tiles.h, GemmPath::kAmxTiles
in csrc/cpu/softmax.cpp), forced with ``ATTNKIT_CPU_GEMM=amx``: S^T = K Q^T with K's rows read in
place by tile loads, the online softmax shared with the other paths, O += P V on the tiles.

Held to the float64 reference by DESIGN.md's rule (as tests/csrc/test_cpu_gemm_path.py) on the
shapes the tiles take (D a multiple of 32, Dv of 16, G N <= 16 rows per kv head) with key counts
around the tiles' edges (blocks of 16 keys, halves of 32, tiles of 64: M = 1, 15, 16, 17, 31, 33,
63, 64, 65, 300), K read through row strides, score options and masks, NaN / inf, one and two
threads (the keys split over tasks); the shapes the tiles do not take fall back to the native dot
products bit for bit; and oneDNN's brgemm, whose tile configuration the kernel replaces on its
threads, still gives its own bits after it.  Runs only where the tiles run: a build for AMX, a CPU
with AMX-BF16 and the OS's grant of the tile state (elsewhere ``=amx`` raises, checked below).
"""
import math

import pytest
import torch

import attnkit
from attnkit import _dispatch
from attnkit_testing import has_cpu_kernel, num_threads

from test_cpu_gemm_path import BF16, ENV, check, make_case

pytestmark = pytest.mark.skipif(not has_cpu_kernel("softmax_fwd"), reason="attnkit._C is not built")


def _amx_tiles_here():
    import os

    old = os.environ.get(ENV)
    os.environ[ENV] = "amx"
    try:
        return _dispatch.native().cpu_gemm_path("bfloat16", "decode") == "own AMX tiles"
    except RuntimeError as exc:
        assert "own AMX tiles need" in str(exc), exc
        return False
    finally:
        if old is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = old


AMX_HERE = has_cpu_kernel("softmax_fwd") and _amx_tiles_here()
needs_amx = pytest.mark.skipif(not AMX_HERE, reason="no own AMX tiles here (build, CPU or OS without AMX-BF16)")


@pytest.fixture
def amx(monkeypatch):
    monkeypatch.setenv(ENV, "amx")


def decode(q, k, v, **kw):
    return attnkit.softmax_attention(q, k, v, enable_gqa=True, backend="cpu", return_lse=True, **kw)


def test_forcing_amx_where_the_tiles_cannot_run_raises(monkeypatch):
    monkeypatch.setenv(ENV, "amx")
    q = torch.randn(1, 4, 1, 64, dtype=BF16)
    k = torch.randn(1, 2, 40, 64, dtype=BF16)
    if AMX_HERE:
        decode(q, k, k)  # runs
    else:
        with pytest.raises(RuntimeError, match="own AMX tiles need a build for AMX-TILE, AMX-BF16"):
            decode(q, k, k)
    # float16 and float32 decodes never take the own tiles: brgemm and native under amx
    assert _dispatch.native().cpu_gemm_path("float16", "decode") == _dispatch.native().cpu_gemm_path("float16")
    assert _dispatch.native().cpu_gemm_path("float32", "decode") == "native"


# (B, H, Hk, N, M, D, Dv), causal, mask, score options.  Rows per kv head R = (H / Hk) N: up to 16 in
# one group of tile rows, more in groups of 16 (the last padded: R = 17, 32, 33, 40, 44, 64).
AMX_CASES = [
    ((1, 4, 1, 1, 300, 64, 64), False, None, {}),
    ((2, 8, 2, 1, 1, 128, 128), False, None, {}),
    ((1, 2, 1, 1, 15, 32, 16), False, None, {}),
    ((1, 2, 2, 1, 16, 96, 48), False, None, {}),
    ((1, 2, 1, 3, 17, 64, 80), True, None, {}),
    ((1, 16, 1, 1, 31, 64, 64), False, None, {}),
    ((1, 4, 1, 4, 33, 128, 32), False, "bool", {}),
    ((2, 3, 1, 5, 63, 64, 64), True, None, {}),
    ((1, 2, 1, 8, 64, 32, 128), False, "float", {}),
    ((1, 4, 2, 2, 65, 64, 64), False, None, {"softcap": 5.0}),
    ((1, 4, 4, 12, 300, 64, 16), False, None, {"window": (50, 2)}),
    ((1, 17, 1, 1, 100, 64, 64), False, None, {}),
    ((1, 8, 1, 4, 77, 64, 48), True, None, {}),
    ((2, 11, 1, 4, 65, 32, 32), False, "bool", {}),
    ((1, 8, 2, 10, 130, 96, 64), False, None, {"window": (40, 3), "softcap": 3.0}),
    ((1, 16, 1, 4, 300, 128, 128), True, "float", {}),
]


def case_id(case):
    dims, causal, mask, opts = case
    parts = ["x".join(map(str, dims))] + (["causal"] if causal else []) + ([mask] if mask else [])
    return "-".join(parts + [f"{k}{v}" for k, v in opts.items()]).replace(" ", "")


@needs_amx
@pytest.mark.parametrize("case", AMX_CASES, ids=case_id)
def test_matches_reference(amx, case):
    dims, causal, mask, opts = case
    check(dims, BF16, causal=causal, mask_kind=mask, opts=opts)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_split_keys_and_threads(amx, threads):
    """Keys split over tasks (B Hk = 1 pair: each split at least 512 keys) whose last tiles end in
    partial blocks of 16 keys."""
    with num_threads(threads):
        check((1, 8, 1, 1, 1101, 64, 64), BF16)
        check((1, 2, 1, 7, 2000, 128, 96), BF16, causal=True)
        check((1, 33, 1, 1, 1500, 64, 32), BF16)


def _strided_kv(m, hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    # [B, M, Hk, D] seen as [B, Hk, M, D]: K's rows Hk D elements apart, unit stride along d
    return torch.randn(1, m, hk, d, generator=g).to(BF16).transpose(1, 2)


@needs_amx
def test_strided_keys_give_the_contiguous_bits(amx):
    q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
    k, v = _strided_kv(77, 2, 64, 2), _strided_kv(77, 2, 64, 3)
    got = decode(q, k, v)
    want = decode(q, k.contiguous(), v.contiguous())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_amx
@pytest.mark.parametrize("dims", [(1, 4, 2, 1, 100, 40, 64), (1, 4, 2, 1, 100, 64, 24)], ids=["D40", "Dv24"])
def test_shapes_off_the_tiles_fall_back_to_the_dot_products(monkeypatch, dims):
    """D not a multiple of 32, Dv not of 16: the native kernel's bits under amx.  (A shape on the
    tiles differs from them: the test below.)"""
    q, k, v, _, _, _ = make_case(*dims, None)
    q, k, v = (t.to(BF16) for t in (q, k, v))
    outs = {}
    for setting in ("amx", "native"):
        monkeypatch.setenv(ENV, setting)
        outs[setting] = decode(q, k, v)
    assert torch.equal(outs["amx"][0], outs["native"][0]) and torch.equal(outs["amx"][1], outs["native"][1])


@needs_amx
def test_a_shape_on_the_tiles_is_not_the_dot_products(monkeypatch):
    # the negative control of the fallback test: D = 64, Dv = 64, 8 rows per kv head, scores summed
    # in another order (lse 4.8e-7 apart on a Xeon with AMX; M = 100 with 2 rows gave equal bits)
    q, k, v, _, _, _ = make_case(2, 16, 2, 1, 300, 64, 64, None)
    q, k, v = (t.to(BF16) for t in (q, k, v))
    lse = {}
    for setting in ("amx", "native"):
        monkeypatch.setenv(ENV, setting)
        lse[setting] = decode(q, k, v)[1]
    assert not torch.equal(lse["amx"], lse["native"])


@needs_amx
@pytest.mark.parametrize("heads,auto_takes_tiles", [(2, False), (6, False), (8, True), (68, True)])
def test_auto_takes_the_tiles_from_four_rows_per_kv_head(monkeypatch, heads, auto_takes_tiles):
    """Under auto the own tiles take N G >= 4 query rows per kv head (the native dot products
    measured faster below: gemm_path.h, cpu_decode_path); a forced amx takes any count."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(4, heads, 1, 64, generator=g).to(BF16)
    k, v = (torch.randn(4, 2, 1000, 64, generator=g).to(BF16) for _ in range(2))
    outs = {}
    for setting in ("auto", "native", "amx"):
        monkeypatch.setenv(ENV, setting)
        outs[setting] = decode(q, k, v)
    same = "amx" if auto_takes_tiles else "native"
    assert torch.equal(outs["auto"][0], outs[same][0]) and torch.equal(outs["auto"][1], outs[same][1])
    # the two paths tell apart on these inputs (the scores summed in another order; with 2 rows and
    # 300 keys they happened to give the same bits)
    assert not (torch.equal(outs["amx"][0], outs["native"][0]) and torch.equal(outs["amx"][1], outs["native"][1]))


@needs_amx
def test_brgemm_after_the_own_tiles_keeps_its_bits(monkeypatch):
    """The flash forward on oneDNN's brgemm, then a decode on the own tiles (which loads its tile
    configuration over oneDNN's on the same threads), then the flash forward again: the same bits,
    on one thread and on two."""
    monkeypatch.setenv(ENV, "amx")  # brgemm for the flash kernel, the own tiles for the decode
    g = torch.Generator().manual_seed(5)
    qf, kf, vf = (torch.randn(1, 2, 200, 64, generator=g).to(BF16) for _ in range(3))
    qd = torch.randn(1, 8, 1, 64, generator=g).to(BF16)
    for threads in (1, 2):
        with num_threads(threads):
            before = attnkit.softmax_attention(qf, kf, vf, backend="cpu", return_lse=True)
            decode(qd, kf, vf)
            after = attnkit.softmax_attention(qf, kf, vf, backend="cpu", return_lse=True)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        # and those are brgemm's bits, not the native tiles' (the check can fail)
        monkeypatch.setenv(ENV, "native")
        native = attnkit.softmax_attention(qf, kf, vf, backend="cpu", return_lse=True)
        monkeypatch.setenv(ENV, "amx")
        assert not torch.equal(after[1], native[1])


NAN_CASES = [("q", math.nan), ("k", math.nan), ("k", math.inf), ("k", -math.inf), ("v", math.nan), ("v", math.inf)]


@needs_amx
@pytest.mark.parametrize("rows", [4, 20])
@pytest.mark.parametrize("where,val", NAN_CASES, ids=[f"{w}-{v}" for w, v in NAN_CASES])
def test_nan_and_inf_stay_in_their_rows(amx, where, val, rows):
    """A NaN / inf in one query row, one key or one value row of kv head 0 (key 70: the second tile,
    inside its second half): the outputs and lse of kv head 1's query heads are the clean ones, kv
    head 0's rows are what the float64 reference gives (NaN and inf where it has them, close elsewhere)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 8, 1, 64, generator=g).to(BF16)
    k, v = (torch.randn(1, 2, 100, 64, generator=g).to(BF16) for _ in range(2))
    if rows == 20:  # two groups of tile rows for each kv head (16 + 4 padded)
        q = torch.randn(1, 40, 1, 64, generator=g).to(BF16)
    clean = decode(q, k, v)
    t = {"q": q, "k": k, "v": v}[where].clone()
    if where == "q":
        t[0, 1, 0, 5] = val
    else:
        t[0, 0, 70, 5] = val
    q2, k2, v2 = (t if name == where else x for name, x in (("q", q), ("k", k), ("v", v)))
    out, lse = decode(q2, k2, v2)
    h0 = q.shape[1] // 2  # the query heads of kv head 1 from here
    assert torch.equal(out[:, h0:], clean[0][:, h0:]) and torch.equal(lse[:, h0:], clean[1][:, h0:])
    ref = torch.nn.functional.scaled_dot_product_attention(q2.double(), k2.double(), v2.double(), enable_gqa=True)
    assert torch.equal(out.isnan(), ref.isnan()), (where, val)
    infinite = ref.isinf()  # a value row's inf reaches the output as the same inf
    assert torch.equal(out.isinf(), infinite) and torch.equal(out.double()[infinite], ref[infinite]), (where, val)
    finite = ref.isfinite()
    assert (out.double()[finite] - ref[finite]).abs().max().item() <= 2e-2

"""How the CPU softmax kernels multiply bfloat16 on the native path (issue 25, csrc/cpu/gemm_path.h:
cpu_bf16_dot_products): AVX512-BF16 dot products (``vdpbf16ps``, P rounded to bfloat16) or operands
widened to float32 for the FMA tiles (P kept in float32), ``ATTNKIT_CPU_BF16=auto|dot|float32``
(read on every call); and the 16-bit conversions of the widened path (16 at a time on AVX-512:
flash_tiles.h convert_row, transpose_widen16, store_scaled_row), which float16 always takes.

Both settings are held to the float64 reference on the shapes of test_cpu_gemm_path (forward and
backward; the flash and the decoding kernel) under ``ATTNKIT_CPU_GEMM=native``.  The widened path
is checked bit for bit too: a bfloat16 / float16 call under ``float32`` must give exactly what the
float32 kernel gives on the same values widened (the widening is exact, the arithmetic the same),
its output rounded once -- on shapes whose D, Dv, N and M are off every vector width.
"""
import re

import pytest
import torch

import attnkit
from attnkit import _dispatch
from attnkit_testing import has_cpu_kernel, num_threads
from test_cpu_gemm_path import CASES, DECODE_CASES, case_id, check, make_case

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ENV = "ATTNKIT_CPU_BF16"

pytestmark = pytest.mark.skipif(not has_cpu_kernel("softmax_fwd"), reason="attnkit._C is not built")


def build_has_bf16_dot():
    return _dispatch.native().cpu_kernel_isa() == "avx512f+avx512bf16"


def cpu_vendor():
    """vendor_id from /proc/cpuinfo (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^vendor_id\s*:\s*(\S+)", f.read(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None


@pytest.fixture(params=["dot", "float32"])
def products(request, monkeypatch):
    """The native tiles (also on a CPU with AMX), with bfloat16 multiplied the given way."""
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    monkeypatch.setenv(ENV, request.param)
    return request.param


# ----------------------------------------------------------------------------------------------
# the choice and its report
# ----------------------------------------------------------------------------------------------


TEXT = {"dot": "native (AVX512-BF16 dot products)", "float32": "native (widened to float32)"}


def test_auto_takes_the_dot_products_on_amd_only(monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    monkeypatch.delenv(ENV, raising=False)
    products = _dispatch.native().cpu_bf16_products
    kernels = attnkit.backends()["softmax"]["cpu"].kernels
    if not build_has_bf16_dot():
        assert products("softmax") == products("decode") == ""
        assert "bfloat16 native, float16 native" in kernels and "(widened to float32)" not in kernels, kernels
        return
    vendor = cpu_vendor()
    if vendor is None:
        pytest.skip("/proc/cpuinfo names no vendor here")
    # The flash tiles and the decoding kernel alike (session 27: the decoding kernel's widened
    # scores, 4 rows x 4 keys at a time, overtook its dot products on the Intel Xeon).
    want = "dot" if vendor == "AuthenticAMD" else "float32"
    assert products("softmax") == products("decode") == want
    # The report: one choice, so no separate line for the decoding kernel.
    assert f"ATTNKIT_CPU_GEMM=native): bfloat16 {TEXT[want]}, float16 native, float32 native" in kernels, kernels
    assert "; decoding (N <= 16): bfloat16" not in kernels, kernels
    with pytest.raises(RuntimeError, match="use must be 'softmax' or 'decode'; got 'tiles'"):
        products("tiles")


@pytest.mark.parametrize("setting", ["dot", "float32"])
def test_a_forced_setting_is_reported(monkeypatch, setting):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    monkeypatch.setenv(ENV, setting)
    for use in ("softmax", "decode"):
        assert _dispatch.native().cpu_bf16_products(use) == (setting if build_has_bf16_dot() else "")
    kernels = attnkit.backends()["softmax"]["cpu"].kernels
    want = f"bfloat16 {TEXT[setting]}" if build_has_bf16_dot() else "bfloat16 native, "
    assert want in kernels and "decoding (N <= 16)" not in kernels, kernels


def test_bad_value_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(ENV, "amx")
    q = torch.randn(1, 1, 4, 8)
    for dtype in (BF16, F32):  # read on every call, whatever the dtype (as ATTNKIT_CPU_GEMM)
        with pytest.raises(RuntimeError, match="ATTNKIT_CPU_BF16 must be one of auto, dot, float32; got 'amx'"):
            attnkit.softmax_attention(q.to(dtype), q.to(dtype), q.to(dtype), backend="cpu")
    assert "ATTNKIT_CPU_BF16 must be one of" in attnkit.backends()["softmax"]["cpu"].kernels


# ----------------------------------------------------------------------------------------------
# numbers: both settings against the float64 reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(products, case):
    dims, causal, mask, opts = case
    check(dims, BF16, causal=causal, mask_kind=mask, opts=opts)


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_matches_reference(products, case):
    dims, causal, mask, opts = case
    check(dims, BF16, causal=causal, mask_kind=mask, opts=opts)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts(products, threads):
    with num_threads(threads):
        check((2, 4, 2, 130, 300, 40, 40), BF16, causal=True)


def test_the_settings_differ_where_the_build_has_the_dot_products(monkeypatch):
    """P is rounded to bfloat16 by the dot path only: the two outputs differ somewhere (the switch
    takes effect) -- and are identical where the build has no AVX512-BF16 (no switch to take)."""
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    q, k, v, _, _, _ = make_case(1, 2, 1, 67, 300, 72, 40, None)
    outs = []
    for setting in ("dot", "float32"):
        monkeypatch.setenv(ENV, setting)
        outs.append(attnkit.softmax_attention(q.to(BF16), k.to(BF16), v.to(BF16), enable_gqa=True, backend="cpu"))
    assert torch.equal(outs[0], outs[1]) is not build_has_bf16_dot()


# ----------------------------------------------------------------------------------------------
# the widened path, bit for bit against the float32 kernel
# ----------------------------------------------------------------------------------------------

# (B, H, Hk, N, M, D, Dv), causal, score options: D, Dv = 17, 9, 40, 72 and 136 leave tails past
# 16 (the conversions' vectors) and 8; N, M off the 64-row and 256-key blocks; N = 16 with a GQA
# group of 4 takes the decoding kernel's tile GEMMs (64 rows; its K / V rows converted per 64-key
# tile).  (From 9 to 16 rows the decoding kernel's scores are dot products in float32 but tile
# GEMMs in 16 bits -- the crossover measured for each, softmax.cpp: the sums' order differs there,
# so no bit-for-bit case with 9-16 rows.)
WIDE_CASES = [
    ((1, 2, 1, 67, 131, 40, 24), False, {}),
    ((1, 2, 2, 67, 300, 72, 72), True, {}),
    ((1, 4, 1, 67, 67, 17, 9), True, {"window": (9, 0)}),
    ((1, 2, 1, 130, 300, 136, 40), False, {"softcap": 3.0}),
    ((1, 8, 2, 16, 31, 17, 9), True, {}),
    # 1-8 rows a kv head: the decoding kernel's dot products in both (16-bit K and V read in place,
    # widened in registers: decode_dots4, decode_pv_widen) -- 8 rows (two groups of 4), 6 (4 + 2),
    # 3 and 1; M = 131, 67, 45: a last block of 3, 3, 1 keys; D = 72, 40, 17, 136: a partial last
    # chunk of 8, 8, 1, 8; Dv = 72, 9, 24, 40: column tails.
    ((1, 4, 2, 4, 300, 72, 72), False, {}),
    ((2, 2, 1, 3, 131, 40, 9), True, {"softcap": 4.0}),
    ((1, 3, 1, 1, 67, 17, 24), False, {}),
    ((2, 5, 5, 1, 45, 136, 40), False, {}),
]


@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: case_id((c[0], c[1], None, c[2])))
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_widened_path_is_the_float32_kernel_bit_for_bit(monkeypatch, case, dtype):
    """Under float32 (bfloat16) -- and always (float16) -- a 16-bit call is the float32 kernel on the
    widened values, its output rounded once: out and lse bit for bit.  (Checked with mutants of
    flash_tiles.h, each failing 40-42 of this file's 47 tests: convert_row's or store_scaled_row's
    last partial vector one lane short, transpose_widen16 one column short; and the last bit of
    store_scaled_row's full vectors cleared fails every bit-for-bit case with Dv >= 16; in
    softmax.cpp's decoding kernel, decode_pv_widen's column tail one lane short or its last key
    dropped, each fails 8 of the decode and bit-for-bit tests here and in test_cpu_gemm_path; and
    decode_dots4's partial last chunk of D one lane short, its group of 3 rows dropped, its partial
    last block of keys one key short, or a one-row group's partial last block skipped, fail 38,
    12, 61 and 5 tests of this file, test_cpu_gemm_path, test_softmax_cpu and test_kvcache.)"""
    dims, causal, opts = case
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    monkeypatch.setenv(ENV, "float32")
    q, k, v, _, _, _ = make_case(*dims, None, seed=3)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    with num_threads(2):
        out, lse = attnkit.softmax_attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True,
                                             backend="cpu", **opts)
        out32, lse32 = attnkit.softmax_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                 enable_gqa=True, return_lse=True, backend="cpu", **opts)
    assert torch.equal(lse, lse32)
    assert torch.equal(out, out32.to(dtype))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_widened_backward_writes_the_float32_sums(monkeypatch, dtype):
    """The backward of a 16-bit call (widened on the native tiles, both dtypes) against the float32
    backward run on the same widened q, k, v, out and dO: dQ, dK, dV bit for bit after one rounding
    -- one kv head and two threads (dQ summed from per-chunk partials) and four kv heads (dQ
    written once)."""
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    for dims in ((1, 2, 1, 67, 300, 40, 24), (1, 4, 4, 67, 131, 17, 9)):
        q, k, v, _, grad_out, _ = make_case(*dims, None, seed=4)
        q, k, v, g = (t.to(dtype) for t in (q, k, v, grad_out))
        out, lse = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True, backend="cpu")
        with num_threads(2):
            grads = torch.ops.attnkit.softmax_bwd(g, q, k, v, out, lse, None, dims[5] ** -0.5, True, -1, -1, 0.0,
                                                  None)
            grads32 = torch.ops.attnkit.softmax_bwd(g.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                                    None, dims[5] ** -0.5, True, -1, -1, 0.0, None)
        for name, got, want in zip(("dq", "dk", "dv"), grads, grads32):
            assert torch.equal(got, want.to(dtype)), name

"""The runtime choice of the CPU softmax kernels' tile-GEMM path (issue 25, csrc/cpu/gemm_path.h):
``native`` (attnkit's FMA / AVX512-BF16 tiles) or ``brgemm`` (oneDNN's micro-kernel through
``at::native::cpublas::brgemm``: AMX tiles with a VNNI-packed B where ``cpublas::could_pack``, the
plain row-major B of torch's reference fallback elsewhere), per dtype, forced by
``ATTNKIT_CPU_GEMM=auto|native|brgemm`` (read on every call), or ``emulate``: attnkit's scalar model
of the AMX brgemm on the VNNI layout, with oneDNN's K-tail NaN defect reproduced (a NaN in row i + 1
of the left operand spoils output row i when K > 32 and K % 32 != 0), so that the VNNI packing and
the guard against that defect are checked on every CPU, AMX or not.

Each forced path runs the cpu backend's forward (the flash kernel, or the decoding kernel for
N <= 16 query rows) through the public function, then its backward through autograd (the flash
backward, on the same path: P and dS rounded to the dtype under brgemm), and both are held to the
float64 reference by DESIGN.md's rule (bfloat16 / float16: twice the error of the reference run in
that dtype, plus 1e-3), with the lse in the loss, on shapes that straddle the tiles (forward 64
(native) or 128 (brgemm) query rows x 256 keys, groups of 16 rows on a causal / window band; backward 64 x 64 (native) and
128 x 128 (brgemm); decode 64-key
tiles) and K tails that are not a multiple of 32 (D = 17, 40, 72, 136: the AMX micro-kernels'
edge; query and key blocks of 67, 131, 300 rows), with causality, a window, softcap, GQA, bool and
float masks, one and two threads, and NaN / inf inputs by README's rules.  On a CPU without AMX
``brgemm`` runs the reference fallback (slow): the shapes stay small.
"""
import math
import re

import pytest
import torch

import attnkit
from attnkit import _dispatch
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, assert_close_to_reference, has_cpu_kernel, num_threads

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ENV = "ATTNKIT_CPU_GEMM"

pytestmark = pytest.mark.skipif(not has_cpu_kernel("softmax_fwd"), reason="attnkit._C is not built")


def gemm_path(dtype):
    return _dispatch.native().cpu_gemm_path(str(dtype).removeprefix("torch."))


def amx_tiles_here(monkeypatch):
    """Whether the decoding kernel's own AMX tiles run here (ATTNKIT_CPU_GEMM=amx takes them for a
    bfloat16 decode, or raises where the build, the CPU or the OS lacks them)."""
    monkeypatch.setenv(ENV, "amx")
    try:
        path = _dispatch.native().cpu_gemm_path("bfloat16", "decode")
    except RuntimeError as exc:
        assert "own AMX tiles need" in str(exc), exc
        return False
    finally:
        monkeypatch.delenv(ENV, raising=False)
    assert path == "own AMX tiles", path
    return True


def amx_in_cpuinfo():
    """The AMX flags /proc/cpuinfo lists (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    flags = set(re.findall(r"^flags\s*:(.*)$", text, re.M)[0].split()) if "flags" in text else set()
    return {flag for flag in flags if flag.startswith("amx")}


# ----------------------------------------------------------------------------------------------
# the choice
# ----------------------------------------------------------------------------------------------


def test_forced_paths_are_reported(forced):
    for dtype in (BF16, F16):
        path = gemm_path(dtype)
        if forced == "native":
            assert path == "native"
        elif forced == "emulate":
            assert path == "brgemm emulated (VNNI layout, scalar: tests)"
        else:  # VNNI where oneDNN packs for AMX, the reference fallback elsewhere
            assert path in ("brgemm (AMX, VNNI)", "brgemm (no VNNI: reference fallback)"), path
    # float32 / float64 stay native whatever is asked
    assert gemm_path(F32) == "native" and gemm_path(F64) == "native"


def test_auto_follows_the_cpu(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    default = {dtype: gemm_path(dtype) for dtype in (BF16, F16)}
    monkeypatch.setenv(ENV, "auto")
    assert {dtype: gemm_path(dtype) for dtype in (BF16, F16)} == default
    amx = amx_in_cpuinfo()
    if amx is not None:
        # brgemm only with the dtype's AMX tiles (AMX-FP16 for float16), in VNNI mode; an AMD EPYC
        # (no AMX) keeps its native kernels.
        needs = {BF16: {"amx_tile", "amx_bf16"}, F16: {"amx_tile", "amx_fp16"}}
        for dtype, path in default.items():
            if not needs[dtype] <= amx:
                assert path == "native", (dtype, path, sorted(amx))
            else:
                assert path in ("native", "brgemm (AMX, VNNI)"), (dtype, path)  # could_pack decides


def test_decoding_sparse_range_and_linear_kernels_take_their_own_path_under_auto_and_a_forced_path_otherwise(
        monkeypatch):
    # Session 17 (gemm_path.h, GemmUse::kDecode): on a Xeon with AMX the decoding kernel measured
    # faster native (K, V read in place) than on brgemm; a forced path still holds for it.
    # Likewise the sparse range and fused strided kernels ("ranges") and the linear chunk products.
    # Session 20: the bfloat16 decoding kernel takes its own AMX tiles where they run (auto, amx).
    native = _dispatch.native()
    amx_here = amx_tiles_here(monkeypatch)
    for use in ("decode", "ranges", "linear"):
        for setting in ("", "auto"):
            monkeypatch.setenv(ENV, setting)
            for dtype in ("bfloat16", "float16", "float32"):
                want = "own AMX tiles" if (use, dtype, amx_here) == ("decode", "bfloat16", True) else "native"
                assert native.cpu_gemm_path(dtype, use) == want, (use, setting, dtype)
        for setting in ("native", "brgemm", "amx", "emulate"):
            monkeypatch.setenv(ENV, setting)
            for dtype in ("bfloat16", "float16"):
                if (use, dtype, setting) == ("decode", "bfloat16", "amx"):
                    continue  # the own tiles, or an error (amx_tiles_here)
                assert native.cpu_gemm_path(dtype, use) == native.cpu_gemm_path(dtype), (use, setting, dtype)
    with pytest.raises(RuntimeError, match="use must be 'tiles', 'softmax', 'decode', 'ranges' or 'linear'; got 'prefill'"):
        native.cpu_gemm_path("bfloat16", "prefill")
    # the report names these kernels' path where it differs from the tiles'
    monkeypatch.delenv(ENV, raising=False)
    for family, label, main in (("softmax", "decoding (N <= 16)", "softmax"),
                                ("sparse", "range and fused strided kernels", "tiles"), ("linear", "under auto", "tiles")):
        kernels = attnkit.backends()[family]["cpu"].kernels
        if family == "softmax" and amx_here:
            assert (f"; {label}: bfloat16 own AMX tiles (from 4 query rows per kv head; native below), "
                    "float16 native, float32 native") in kernels, kernels
            continue
        # (softmax's main tiles: GemmUse::kSoftmax, which may split float16: tests/csrc/test_cpu_split_f16.py)
        differs = any(native.cpu_gemm_path(dtype, main) != "native" for dtype in ("bfloat16", "float16"))
        assert (f"; {label}: bfloat16 native, float16 native, float32 native" in kernels) == differs, kernels


def test_decoding_under_auto_is_its_own_kernel_bit_for_bit(monkeypatch):
    # The routing seen in the numbers: auto's decode output and float32 lse equal the forced
    # native ones exactly -- or, where the own AMX tiles run (session 20), the forced amx ones,
    # which differ from the native ones (the scores summed in another order).  Where auto takes
    # brgemm for the tiles (a CPU with AMX: the one place the decoding kernel's own choice
    # matters), the forced brgemm decode gives another lse on this input (4.7e-7 on a Xeon,
    # session 17), so the comparison tells the paths apart there.
    amx_here = amx_tiles_here(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    tiles_take_brgemm = gemm_path(BF16) != "native"
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 1, 64, generator=g).to(BF16)  # 4 rows per kv head: the own tiles under auto
    k, v = (torch.randn(2, 2, 300, 64, generator=g).to(BF16) for _ in range(2))
    outs = {}
    for setting in ("auto", "native", "brgemm") + (("amx",) if amx_here else ()):
        monkeypatch.setenv(ENV, setting)
        outs[setting] = attnkit.softmax_attention(q, k, v, enable_gqa=True, backend="cpu", return_lse=True)
    own = "amx" if amx_here else "native"
    assert torch.equal(outs["auto"][0], outs[own][0]) and torch.equal(outs["auto"][1], outs[own][1])
    if amx_here:
        assert not torch.equal(outs["amx"][1], outs["native"][1])
    if tiles_take_brgemm:
        assert not torch.equal(outs["brgemm"][1], outs["native"][1])


def test_sparse_range_kernels_under_auto_are_the_native_ones_bit_for_bit(monkeypatch):
    # As the decoding test above, for the fused strided and range (fixed) kernels, forward and
    # gradients; the block-sparse kernel keeps auto's tile path (brgemm on a CPU with AMX).
    from attnkit import patterns

    monkeypatch.delenv(ENV, raising=False)
    tiles_take_brgemm = gemm_path(BF16) != "native"
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g).to(BF16) for _ in range(3))
    for pattern in (patterns.strided(32), patterns.fixed(32)):
        res = {}
        for setting in ("auto", "native", "brgemm"):
            monkeypatch.setenv(ENV, setting)
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            out = attnkit.sparse_attention(qg, kg, vg, pattern, backend="cpu")
            out.float().square().sum().backward()
            res[setting] = (out, qg.grad, kg.grad, vg.grad)
        assert all(torch.equal(a, b) for a, b in zip(res["auto"], res["native"])), pattern
        if tiles_take_brgemm:
            assert not all(torch.equal(a, b) for a, b in zip(res["brgemm"], res["native"])), pattern


def test_bad_value_names_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(ENV, "amx-bf16")
    q = torch.randn(1, 1, 20, 8, dtype=BF16)
    with pytest.raises(RuntimeError,
                       match="ATTNKIT_CPU_GEMM must be one of auto, native, brgemm, amx, split, emulate; got 'amx-bf16'"):
        attnkit.softmax_attention(q, q, q, backend="cpu")
    with pytest.raises(RuntimeError, match="auto, native, brgemm, amx, split, emulate"):
        gemm_path(BF16)
    with pytest.raises(RuntimeError, match="bfloat16, float16, float32, float64"):
        _dispatch.native().cpu_gemm_path("int8")
    # the report says so rather than raise
    assert "ATTNKIT_CPU_GEMM must be one of" in attnkit.backends()["softmax"]["cpu"].kernels


def test_backends_report_the_runtime_choice(forced):
    kernels = attnkit.backends()["softmax"]["cpu"].kernels
    isa = _dispatch.native().cpu_kernel_isa()
    assert kernels.startswith(isa + ": "), kernels
    assert (f"forward, backward and decode tile GEMMs chosen at run time per dtype (ATTNKIT_CPU_GEMM={forced})"
            in kernels), kernels
    for dtype in (BF16, F16, F32):
        assert f"{str(dtype)[6:]} {gemm_path(dtype)}" in kernels, kernels
    # so do the Hopfield (forward), sparse and linear kernels
    for family, what in (("hopfield", "update forward tile GEMMs (the backward: torch)"),
                         ("hopfield_energy", "energy forward tile GEMMs (the backward: torch)"),
                         ("sparse", "range, block and fused strided tile GEMMs, forward and backward"),
                         ("linear", "chunk products, forward and backward")):
        text = attnkit.backends()[family]["cpu"].kernels
        assert f"{what}" in text and f"chosen at run time per dtype (ATTNKIT_CPU_GEMM={forced})" in text, text
        assert f"bfloat16 {gemm_path(BF16)}" in text, text


# ----------------------------------------------------------------------------------------------
# numbers: forward (forced path) and backward against the float64 reference
# ----------------------------------------------------------------------------------------------


def run(backend, q, k, v, mask, causal, opts, grad_out, grad_lse, dtype):
    """(out, lse, dq, dk, dv) of softmax_attention in ``dtype`` from the loss <out, grad_out> +
    <lse, grad_lse> (lse's infinite entries left out of the loss)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    gqa = q.shape[1] != k.shape[1]
    if backend == "reference":
        with num_threads(1):
            out, lse = softmax_attention_reference(q, k, v, mask, 0.0, causal, None, gqa, return_lse=True, **opts)
    else:
        out, lse = attnkit.softmax_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa, return_lse=True,
                                             backend=backend, **opts)
    loss_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    grads = torch.autograd.grad((out, loss_lse), (q, k, v), (grad_out.to(out.dtype), grad_lse.to(lse.dtype)))
    return tuple(t.detach() for t in (out, lse, *grads))


def make_case(b, h, hk, n, m, d, dv, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, dtype=F64) for shape in ((b, h, n, d), (b, hk, m, d), (b, hk, m, dv)))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, h, n, m, generator=g) > 0.25
        mask[:, :, 3] = False  # a fully masked row
    elif mask_kind == "float":
        mask = torch.randn(b, 1, n, m, generator=g, dtype=F64)
        mask = mask.masked_fill(torch.rand(b, 1, n, m, generator=g) < 0.2, -math.inf)
    grad_out = torch.randn(b, h, n, dv, generator=g, dtype=F64)
    grad_lse = torch.randn(b, h, n, generator=g, dtype=F64)
    return q, k, v, mask, grad_out, grad_lse


def fold_causal(mask, causal):
    """(mask, causal) for the public function, which takes a mask or is_causal (like SDPA): the
    causal condition (top-left, j <= i) folded into the mask where there is one."""
    if mask is None or not causal:
        return mask, causal
    n, m = mask.shape[-2:]
    hidden = ~torch.ones(n, m, dtype=torch.bool).tril()
    return (mask & ~hidden if mask.dtype == torch.bool else mask.masked_fill(hidden, -math.inf)), False


def check(dims, dtype, *, causal=False, mask_kind=None, opts=None, seed=0):
    opts = opts or {}
    q, k, v, mask, grad_out, grad_lse = make_case(*dims, mask_kind, seed=seed)
    mask, causal = fold_causal(mask, causal)
    q, k, v = (t.to(dtype) for t in (q, k, v))  # the inputs all runs share
    got = run("cpu", q, k, v, mask, causal, opts, grad_out, grad_lse, dtype)
    ref64 = run("reference", q, k, v, mask, causal, opts, grad_out, grad_lse, F64)
    low = run("reference", q, k, v, mask, causal, opts, grad_out, grad_lse, dtype) if dtype != F32 else (None,) * 5
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_close_to_reference(got[i], ref64[i], low[i], grad=i >= 2, name=name, dtype=dtype)
    return got


# (B, H, Hk, N, M, D, Dv), causal, mask, score options: N, M, D, Dv off the tiles; D = 17, 40,
# 72, 136 leave K tails of 17, 8, 8, 8 past a multiple of 32 (D2 = 18, 40, 72, 136); M = 300
# spans two key blocks, the second with a tail of 44.
CASES = [
    ((1, 2, 1, 67, 131, 40, 24), False, None, {}),
    ((1, 2, 2, 67, 131, 72, 72), True, None, {}),
    ((1, 2, 1, 67, 300, 136, 40), True, "bool", {}),  # causal folded into the mask
    ((2, 2, 1, 67, 67, 72, 56), False, "float", {"window": (20, 3)}),
    ((1, 4, 2, 67, 131, 40, 40), False, None, {"softcap": 5.0}),
    ((1, 4, 1, 67, 67, 17, 9), True, None, {"window": (9, 0)}),
    ((1, 2, 1, 130, 300, 40, 72), False, None, {"window": (70, 40), "softcap": 3.0}),
    # D and Dv multiples of 32: the backward reads Q and dO rows in place as brgemm's A operands.
    ((1, 2, 1, 131, 140, 64, 96), True, None, {}),
]


def case_id(case):
    dims, causal, mask, opts = case
    parts = ["x".join(map(str, dims))] + (["causal"] if causal else []) + ([mask] if mask else [])
    return "-".join(parts + [f"{k}{v}" for k, v in opts.items()]).replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_matches_reference(forced, case, dtype):
    dims, causal, mask, opts = case
    check(dims, dtype, causal=causal, mask_kind=mask, opts=opts)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_thread_counts(forced, threads, dtype):
    with num_threads(threads):
        check((2, 4, 2, 130, 300, 40, 40), dtype, causal=True)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fewer_tasks_than_threads(forced, threads, dtype):
    """One head of 100 query rows: the forward's query blocks shrink so that every thread gets a
    task -- on brgemm from 128 rows to 64 (2 threads) or 32 (4), on the native tiles from 64 to 32
    (4) -- and the blocks' edges fall inside the rows (a causal diagonal, a window across them).
    Checked: with the block count left at the unshrunk size, all 12 cases fail."""
    with num_threads(threads):
        check((1, 1, 1, 100, 300, 72, 40), dtype, causal=True)
        check((1, 1, 1, 45, 131, 40, 24), dtype, opts={"window": (30, 5)})


def test_float32_ignores_a_forced_brgemm(forced):
    check((1, 2, 1, 67, 131, 40, 24), F32, causal=True)


@pytest.mark.parametrize("dims", [(1, 2, 1, 67, 300, 72, 40), (1, 4, 2, 5, 300, 72, 40)], ids=["flash", "decode"])
def test_both_paths_agree(monkeypatch, dims):
    """The two paths multiply the same 16-bit operands with float32 sums: their outputs differ by
    the summation order and P's rounding only (a few units of the last place of the output dtype)."""
    for dtype in (BF16, F16):
        outs = []
        for path in ("native", "brgemm"):
            monkeypatch.setenv(ENV, path)
            q, k, v, _, _, _ = make_case(*dims, None)
            outs.append(attnkit.softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                                                  enable_gqa=True, backend="cpu").double())
        eps = torch.finfo(dtype).eps
        assert (outs[0] - outs[1]).abs().max().item() <= 4 * eps * outs[0].abs().max().item()


# (B, H, Hk, N, M, D, Dv), causal, mask, score options, for the decoding kernel (N <= 16, G N <= 64
# rows per task): M = 1, 31, 33 (one tile, an odd last key), 300 (four full 64-key tiles and 44).
DECODE_CASES = [
    ((1, 4, 2, 1, 300, 40, 24), False, None, {}),
    ((2, 4, 1, 5, 33, 72, 72), True, None, {}),
    ((1, 8, 2, 16, 31, 17, 9), False, "bool", {}),
    ((1, 2, 2, 7, 1, 136, 40), False, None, {}),
    ((1, 4, 2, 12, 300, 40, 56), False, "float", {"window": (50, 2), "softcap": 4.0}),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_decode_matches_reference(forced, case, dtype):
    dims, causal, mask, opts = case
    check(dims, dtype, causal=causal, mask_kind=mask, opts=opts)


def test_decode_split_keys(forced):
    """A kv cache long enough to be split over tasks (two splits, their (max, sum, out) merged), two
    threads; the second split's 525 keys end in a tile of 13 (odd) after 64-key tiles."""
    with num_threads(2):
        check((1, 2, 1, 3, 1101, 40, 24), BF16)


def test_backward_takes_the_path(monkeypatch):
    """The backward op on the same (out, lse) under each path: brgemm rounds P and dS to the dtype
    (the native backward multiplies them in float32), so the gradients differ -- by less than a
    unit of the dtype's last place of the largest gradient, measured (AMD EPYC AVX2) -- and both
    are within the rule (test_matches_reference)."""
    dims = (1, 2, 1, 67, 131, 40, 24)
    q, k, v, _, grad_out, _ = make_case(*dims, None, seed=3)
    for dtype in (BF16, F16):
        q16, k16, v16, g16 = (t.to(dtype) for t in (q, k, v, grad_out))
        monkeypatch.setenv(ENV, "native")
        out, lse = torch.ops.attnkit.softmax_fwd(q16, k16, v16, None, 0.125, True, -1, -1, 0.0, None)
        grads = {}
        for path in ("native", "brgemm"):
            monkeypatch.setenv(ENV, path)
            grads[path] = torch.ops.attnkit.softmax_bwd(g16, q16, k16, v16, out, lse, None, 0.125, True, -1, -1,
                                                        0.0, None)
        for name, a, b in zip(("dq", "dk", "dv"), grads["native"], grads["brgemm"]):
            assert not torch.equal(a, b), f"{name} ({dtype}): brgemm gave the native backward's bits"
            size = a.double().abs().max().item()
            assert (a.double() - b.double()).abs().max().item() <= 4 * torch.finfo(dtype).eps * size, name


# ----------------------------------------------------------------------------------------------
# NaN / inf (README: "NaN and ±inf are never dropped"; issue 15's rules, as the native tests)
# ----------------------------------------------------------------------------------------------

# The native kernels' own NaN test (tests/csrc/test_softmax_cpu.py: exact NaN rows against the
# float64 scores, nothing leaking to the other kv head, fully masked rows 0 / -inf, the gradients'
# NaN, finite rows within tolerance), rerun on each forced path at its flash size (N = 70, M = 300,
# D = 32): a sample of its cases, the dtypes alternating.
# N = 12 (the decoding kernel forward) on a few.
NAN_CASES = [("q", math.nan, None, False, BF16, 70), ("q", math.inf, None, True, F16, 70),
             ("k", math.nan, "bool", True, BF16, 70), ("k", math.inf, None, False, F16, 70),
             ("k", -math.inf, "float", True, F16, 70), ("v", math.nan, None, True, BF16, 70),
             ("mask", math.nan, "float", False, BF16, 70), ("q", math.nan, None, True, BF16, 12),
             ("k", math.inf, "bool", False, F16, 12), ("v", math.nan, None, False, F16, 12)]


@pytest.mark.parametrize("where,val,mask_kind,causal,dtype,n", NAN_CASES,
                         ids=[f"{w}-{v}-{m}-{'causal' if c else 'full'}-{str(d)[6:]}-{n}"
                              for w, v, m, c, d, n in NAN_CASES])
def test_nan_and_inf_propagate(forced, where, val, mask_kind, causal, dtype, n):
    import test_softmax_cpu  # tests/csrc is on sys.path under pytest (rootdir without __init__.py)

    test_softmax_cpu.test_nan_and_inf_propagate(where, val, mask_kind, causal, dtype, n)


# The same with D = 40 and 72 (Q K^T and dP = dO V^T reduce over D; dK and dQ over the query and
# key blocks: K > 32 and K % 32 != 0 unless padded): under ``emulate`` a NaN in one row of a left
# operand whose reduction is not padded spoils the row above it, which these exact NaN-row checks
# catch (checked: without the forward's padding of D, the q cases fail).
NAN_K_TAIL_CASES = [("q", math.nan, BF16, 70, 40), ("k", math.nan, F16, 70, 72), ("v", math.nan, BF16, 70, 72),
                    ("q", math.nan, F16, 12, 40), ("k", math.inf, BF16, 12, 72)]


@pytest.mark.parametrize("where,val,dtype,n,d", NAN_K_TAIL_CASES,
                         ids=[f"{w}-{v}-{str(t)[6:]}-{n}-d{d}" for w, v, t, n, d in NAN_K_TAIL_CASES])
def test_nan_rows_under_k_tails(forced, where, val, dtype, n, d):
    import test_softmax_cpu

    test_softmax_cpu.test_nan_and_inf_propagate(where, val, None, True, dtype, n, D=d)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_nan_behind_masked_keys(forced, dtype):
    import test_softmax_cpu

    test_softmax_cpu.test_nan_behind_masked_keys(dtype)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_strided_rows_give_the_contiguous_bits(forced, dtype):
    """Q, K, V and dO as [B, N, H, D] tensors seen as [B, H, N, D] (rows H * D apart: the backward
    reads Q and dO rows in place on brgemm when D is a multiple of 32) give the same bits as
    contiguous copies."""
    b, h, n, m, d = 1, 2, 131, 140, 64
    g = torch.Generator().manual_seed(3)
    q, k, v, grad_out = (torch.randn(b, rows, h, d, generator=g).to(dtype) for rows in (n, m, m, n))
    results = []
    for layout in ("strided", "contiguous"):
        ts = [t.transpose(1, 2) for t in (q, k, v, grad_out)]
        if layout == "contiguous":
            ts = [t.contiguous() for t in ts]
        qq, kk, vv = (t.detach().requires_grad_() for t in ts[:3])
        out = attnkit.softmax_attention(qq, kk, vv, is_causal=True, backend="cpu")
        results.append((out.detach(), *torch.autograd.grad(out, (qq, kk, vv), ts[3])))
    for name, a, c in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, c), f"{name}: the strided rows changed the result"

"""The float16 split (csrc/cpu/gemm_path.h, GemmPath::kSplitBf16): float16 softmax attention on a
CPU whose AMX multiplies bfloat16 but not float16.  Each float16 operand x is split into two
bfloat16, hi = bf16(x) and lo = x - hi (exact), so that S = Q K^T takes the four products of the
parts (every one exact in float32, as float16's own products are) and O += P V takes P's hi
against V's (hi, lo) pairs and P's lo against V's hi, all on oneDNN's bfloat16 brgemm.

``ATTNKIT_CPU_GEMM=split`` forces it: on oneDNN's AMX where it packs bfloat16, and on attnkit's
emulated brgemm (scalar) elsewhere, so every CPU runs these tests.  ``auto`` takes it for float16
where the CPU has AMX-BF16 and not AMX-FP16 (Sapphire / Emerald Rapids); every other dtype, and
every other kernel (decoding, sparse, Hopfield, linear), is as under ``auto``.

Checked: the forward and the backward against the float64 reference on tests/csrc/test_cpu_gemm_path.py's shapes (tiles' edges, K tails of D = 17, 40, 72,
136, causality, windows, softcap, GQA, masks, threads) and its NaN / inf cases; scores exact where
float32 holds them exactly (the lo * lo product is not dropped); P kept to more than float16's 11
bits; the same NaN / inf pattern as the native tiles (the partial products pair hi with lo only
where both are finite).
"""
import math
import re

import pytest
import torch

import attnkit
from attnkit import _dispatch
from attnkit_testing import has_cpu_kernel, num_threads

import test_cpu_gemm_path as gp  # tests/csrc is on sys.path under pytest (rootdir without __init__.py)

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
ENV = "ATTNKIT_CPU_GEMM"
SPLIT_NAMES = ("brgemm split (float16 as bfloat16 pairs, AMX)",
               "brgemm split emulated (float16 as bfloat16 pairs, scalar: tests)")

pytestmark = pytest.mark.skipif(not has_cpu_kernel("softmax_fwd"), reason="attnkit._C is not built")


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setenv(ENV, "split")


def path(dtype, use="softmax"):
    return _dispatch.native().cpu_gemm_path(dtype, use)


# ----------------------------------------------------------------------------------------------
# the choice
# ----------------------------------------------------------------------------------------------


def test_split_is_forced_for_float16_softmax_only(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    auto = {(dtype, use): path(dtype, use) for dtype in ("bfloat16", "float16", "float32")
            for use in ("softmax", "tiles", "decode", "ranges", "linear")}
    monkeypatch.setenv(ENV, "split")
    for (dtype, use), want in auto.items():
        got = path(dtype, use)
        if (dtype, use) == ("float16", "softmax"):
            assert got in SPLIT_NAMES, got
        else:
            assert got == want, (dtype, use, got, want)
    # oneDNN's AMX where it packs bfloat16 (the path auto takes for the bfloat16 tiles there)
    amx_bf16 = auto[("bfloat16", "tiles")] == "brgemm (AMX, VNNI)"
    assert path("float16") == SPLIT_NAMES[0 if amx_bf16 else 1]


def test_auto_takes_the_split_where_amx_multiplies_bfloat16_only(monkeypatch):
    monkeypatch.setenv(ENV, "auto")
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(re.findall(r"^flags\s*:(.*)$", f.read(), re.M)[0].split())
    except (OSError, IndexError):
        pytest.skip("no /proc/cpuinfo flags to read the CPU's AMX from")
    got = path("float16")
    if {"amx_tile", "amx_bf16"} <= flags and "amx_fp16" not in flags:
        # could_pack(bfloat16) decides, as for the bfloat16 tiles
        assert got == (SPLIT_NAMES[0] if path("bfloat16") == "brgemm (AMX, VNNI)" else "native"), got
    else:
        assert got in ("native", "brgemm (AMX, VNNI)"), got  # AMD EPYC, or a CPU with AMX-FP16
    # the report gives the softmax family's own choice
    assert f"float16 {got}" in attnkit.backends()["softmax"]["cpu"].kernels


# ----------------------------------------------------------------------------------------------
# numbers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", gp.CASES, ids=gp.case_id)
def test_matches_reference(split, case):
    dims, causal, mask, opts = case
    gp.check(dims, F16, causal=causal, mask_kind=mask, opts=opts)


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_counts(split, threads):
    with num_threads(threads):
        gp.check((2, 4, 2, 130, 300, 40, 40), F16, causal=True)


def test_scores_are_exact_where_float32_holds_them(split):
    """Values 1 + 3 * 2^-10 (and their negatives) are float16 numbers with a lo part of 3 * 2^-10
    (their bfloat16 hi is 1): a score of D = 8 of their products, 8 (1 + 3 * 2^-10)^2, is exact in
    float32, and with one key the lse is that score (times the scale, 1).  Dropping the lo * lo
    products would leave it 8 * 9 * 2^-20 = 6.9e-5 short; any other part, far more.  The output
    with one key is V itself (P = 1), lo parts and all."""
    x = 1 + 3 * 2.0 ** -10
    g = torch.Generator().manual_seed(0)
    sign = lambda *shape: torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0).to(F64)  # noqa: E731
    q = (x * sign(1, 2, 37, 8)).to(F16)
    k = (x * sign(1, 2, 1, 8)).to(F16)
    v = (torch.randn(1, 2, 1, 24, generator=g) * 3).to(F16)
    assert torch.equal(q.to(BF16).to(F16).abs(), torch.ones_like(q))  # bf16 keeps only the hi part
    out, lse = attnkit.softmax_attention(q, k, v, scale=1.0, backend="cpu", return_lse=True)
    s64 = (q.double() @ k.double().transpose(-1, -2))[..., 0]
    assert (lse.double() - s64).abs().max().item() <= 4 * 2.0 ** -24 * 8 * x * x
    assert torch.equal(out, v.expand_as(out))


def test_probabilities_keep_more_than_float16_bits(split):
    """O = P V with P kept to 16 bits (hi + lo) and V exact: before the output's rounding to float16
    the result is within 2^-15 max|v| of the float64 one, so the float16 output is within half its
    ulp of it plus that.  P in bfloat16 alone (its lo dropped) is 2^-9 off per weight."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 4, n, 64, generator=g).to(F16) for n in (67, 300))
    v = torch.randn(1, 4, 300, 40, generator=g).to(F16)
    out = attnkit.softmax_attention(q, k, v, backend="cpu").double()
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, -1) @ v.double()
    tol = ref.abs() * 2.0 ** -11 + 2.0 ** -15 * v.double().abs().max()
    assert ((out - ref).abs() <= tol).all(), ((out - ref).abs() - tol).max().item()


def test_agrees_with_the_native_tiles(monkeypatch):
    """Both paths take every product exactly and sum in float32: the outputs differ by rounding
    only (a few units of float16's last place)."""
    q, k, v, _, _, _ = gp.make_case(1, 4, 2, 67, 300, 72, 40, None)
    q, k, v = (t.to(F16) for t in (q, k, v))
    outs = {}
    for setting in ("native", "split"):
        monkeypatch.setenv(ENV, setting)
        outs[setting] = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True, backend="cpu").double()
    size = outs["native"].abs().max().item()
    assert (outs["native"] - outs["split"]).abs().max().item() <= 4 * torch.finfo(F16).eps * size


@pytest.mark.parametrize("dims", [(1, 2, 1, 131, 300, 64, 64), (1, 4, 2, 67, 140, 40, 72)], ids=["d64", "d40-dv72"])
def test_backward_keeps_p_and_ds_to_16_bits(monkeypatch, dims):
    """The backward op on the same (out, lse): the native tiles multiply P and dS in float32, the
    split keeps them to 16 bits (and Q, K, V, dO exact), so its float32 gradients are within
    ~2^-16 of the native ones and round to the same float16 bits but for ties: measured 0.8-2.1%
    of the entries differ.  float16 brgemm's P and dS (11 bits) moved
    17-40% of them (Xeon with AMX); P or dS at bfloat16's 8 bits would move most."""
    q, k, v, _, grad_out, _ = gp.make_case(*dims, None, seed=4)
    q, k, v, g = (t.to(F16) for t in (q, k, v, grad_out))
    scale = dims[5] ** -0.5
    monkeypatch.setenv(ENV, "native")
    out, lse = torch.ops.attnkit.softmax_fwd(q, k, v, None, scale, True, -1, -1, 0.0, None)
    grads = {}
    for setting in ("native", "split"):
        monkeypatch.setenv(ENV, setting)
        grads[setting] = torch.ops.attnkit.softmax_bwd(g, q, k, v, out, lse, None, scale, True, -1, -1, 0.0, None)
    for name, a, b in zip(("dq", "dk", "dv"), grads["native"], grads["split"]):
        differ = a != b
        assert differ.any(), f"{name}: the split gave the native tiles' bits (not taken?)"
        assert differ.float().mean().item() <= 0.08, (name, differ.float().mean().item())
        # (a bound of the largest gradient's ulp: where a gradient cancels -- the first causal rows'
        # dq -- both sides round a sum of terms far larger than it)
        size = a.double().abs().max().item()
        assert (a.double() - b.double()).abs().max().item() <= torch.finfo(F16).eps * size, name


# ----------------------------------------------------------------------------------------------
# NaN / inf: tests/csrc/test_softmax_cpu.py's exact NaN-row checks on the split's flash size, with
# K tails (D = 40, 72); a float16 inf has hi = inf and lo = 0, and the products of a hi with a lo
# take the hi's finite values only -- without that, 0 * inf and inf - inf made NaN rows that the
# float64 scores do not have (q's lo of 0 against k's hi of inf).
# ----------------------------------------------------------------------------------------------

# (V's infinities: test_large_values_keep_their_infinities below.)
NAN_CASES = [("q", math.nan, None, False, 32), ("q", math.inf, None, True, 32), ("q", -math.inf, None, False, 40),
             ("k", math.nan, "bool", True, 72), ("k", math.inf, None, False, 32), ("k", -math.inf, "float", True, 40),
             ("k", math.inf, None, True, 72), ("v", math.nan, None, True, 72), ("v", math.nan, "float", False, 40),
             ("mask", math.nan, "float", False, 32), ("mask", math.inf, "float", True, 40)]


@pytest.mark.parametrize("where,val,mask_kind,causal,d", NAN_CASES,
                         ids=[f"{w}-{v}-{m}-{'causal' if c else 'full'}-d{d}" for w, v, m, c, d in NAN_CASES])
def test_nan_and_inf_propagate(split, where, val, mask_kind, causal, d):
    import test_softmax_cpu

    test_softmax_cpu.test_nan_and_inf_propagate(where, val, mask_kind, causal, F16, 70, D=d)


def test_nan_behind_masked_keys(split):
    import test_softmax_cpu

    test_softmax_cpu.test_nan_behind_masked_keys(F16)


def test_large_values_keep_their_infinities(split):
    """float16's largest values (65504 rounds to bfloat16's 65536, lo = -32) and infinities in V:
    the output's infinities and NaNs are where the float64 product puts them."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 1, n, 32, generator=g).to(F16) for n in (40, 70))
    v = torch.randn(1, 1, 70, 16, generator=g).to(F16)
    v[0, 0, :, 3] = 65504.0
    v[0, 0, 5, 7] = math.inf
    v[0, 0, 9, 8] = -math.inf
    out = attnkit.softmax_attention(q, k, v, backend="cpu").double()
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(32), -1) @ v.double()
    ref = ref.clamp(-65504, 65504).where(torch.isfinite(ref), ref)  # float16's range, as the output
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isinf(out), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert ((out - ref).abs()[finite] <= ref.abs()[finite] * 2.0 ** -10 + 1e-3).all()

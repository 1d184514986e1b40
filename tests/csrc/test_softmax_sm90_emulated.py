"""The Hopper softmax kernels (csrc/cuda/softmax_sm90.cu, issue 27) run on the CPU by the emulator.

As tests/csrc/test_softmax_cuda_emulated.py does for softmax.cu: cuda_emulator/extract.py cuts
the device code out of softmax_sm90.cu (sm90_ptx.cuh's PTX helpers replaced by the emulator's
models in cuda_emulator/harness_sm90.h: TMA boxes with the 128-byte swizzle landing as late as the
mbarrier allows, NaN before; mbarrier phases and transaction counts; wgmma from the PTX ISA's
fragment and shared-memory descriptor layouts, computed at the wait that covers it, its
accumulators NaN until then; setmaxnreg), g++ compiles it with
cuda_emulator/softmax_sm90_harness.cpp, and the forward (its three consumer loops: overlapped,
overlapped with the consumers' ping-pong, and "simple") and the backward (dQ and dK / dV kernels,
delta given; at D = 256 the two wide kernels, which split the head dim between the consumers) run
on CPU tensors in NaN-guarded buffers.  out, lse, dq, dk, dv are checked against the float64 reference under DESIGN.md's rule;
every global and shared access is bounds-checked; mutants (a causal mask off by one, a wrong
k-step, a dK / dV loop that skips a query tile, a stage released before its product is waited
for, dQ's and dK / dV's scores read before their wait, a ping-pong turn ended on the wrong barrier) must be
caught.

Not covered: the host side (softmax_sm90.cu's checks, cuTensorMapEncodeTiled, the probe of the
sm_90a build; the harness re-creates the launches and the maps) and anything about a real GPU:
tests/csrc/test_softmax_cuda_sm90.py (``pytest -m gpu``) covers those on an H100 / H200.
"""
import ctypes
import math
from pathlib import Path

import pytest
import torch

from attnkit_testing import (
    F64,
    assert_close_to_reference,
    assert_nonfinite_like_reference,
    finite_inputs,
    poison,
    without_spread_nan,
)
from cuda_emulator import emu_build
from cuda_emulator.emu_build import EmulatorError
from test_softmax_cuda_emulated import (
    Case,
    Guarded,
    _bits,
    _make_inputs,
    _reference,
    assert_matches_reference,
    assert_untouched,
)

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
SOURCE = HERE.parents[1] / "csrc" / "cuda" / "softmax_sm90.cu"

# Deliberate bugs, each switched on by configure(mutant=k) in one build (fp16, D = 64 only).
SWITCHED = {
    # the forward's causal test off by one (a key one past the diagonal visible).
    "causal_off_by_one": (
        "sc[nt][e] = (j < p.M && (!p.causal || j <= i)) ? x : -INFINITY;",
        "sc[nt][e] = (j < p.M && (!p.causal || j <= i + {on})) ? x : -INFINITY;",
    ),
    # dQ's overlap: dS computed before the S / dP products are waited for (a wait that still
    # lets them run): their accumulators are read too early.
    "dq_wait_too_weak": (
        "      wgmma_wait<1>();  // S_t and dP_t done; dQ's product may still run",
        "      if ({on}) wgmma_wait<2>(); else wgmma_wait<1>();  // S_t and dP_t done",
    ),
    # dK / dV's overlap (D = 64), the same: Pᵀ and dSᵀ computed before their products' wait.
    "dkdv_wait_too_weak": (
        "      wgmma_wait<1>();  // Sᵀ and dPᵀ of step u done; dV and dK of step u - 1 may still run",
        "      if ({on}) wgmma_wait<2>(); else wgmma_wait<1>();  // Sᵀ and dPᵀ of step u done",
    ),
    # the ping-pong: a consumer ends its turn on its own barrier instead of the other's.
    "pingpong_wrong_barrier": (
        "if (!(last && wq == 1)) named_bar_arrive(2 - wq, 256);",
        "if (!(last && wq == 1)) named_bar_arrive({on} ? 1 + wq : 2 - wq, 256);",
    ),
    # S = Q Kᵀ: the k-step's start inside the 128-byte row moved by 16 bytes too few.
    "k_step_offset": (
        "const uint16_t* ak = a + (kk / 4) * kRowsA * kPanelCols + a_row0 * kPanelCols + (kk % 4) * 16;",
        "const uint16_t* ak = a + (kk / 4) * kRowsA * kPanelCols + a_row0 * kPanelCols + (kk % 4) * (16 - 8 * {on});",
    ),
    # dK / dV: the causal start one query tile too late.
    "dkdv_first_tile": (
        "const int first = p.causal ? k0 / kBwdStep : 0;",
        "const int first = p.causal ? k0 / kBwdStep + {on} : 0;",
    ),
    # the backward that adds dQ with atomics: keys past M no longer hidden in Pᵀ / dSᵀ (their K
    # rows are TMA's zero fill, but P = 2^(0 - lse2) overflows where every score is very
    # negative, and dQ meets inf · 0).
    "atomic_keys_past_m_visible": (
        "!edge || (i < p.N && key0 + g + 8 * r < p.M && (!p.causal || key0 + g + 8 * r <= i));",
        "!edge || (i < p.N && ({on} || key0 + g + 8 * r < p.M) && (!p.causal || key0 + g + 8 * r <= i));",
    ),
    # the persistent forward: the producer loads the next tile's Q without waiting for the
    # consumers to release the current one.
    "persistent_q_not_released": (
        "if (k > 0) mbar_wait(q_empty, static_cast<uint32_t>(k - 1) & 1u);",
        "if (k > 0 && !{on}) mbar_wait(q_empty, static_cast<uint32_t>(k - 1) & 1u);",
    ),
    # D = 256 (the switched build has fp16 D = 64 and 256): the forward's P V product reads V's
    # columns 0-127 for both halves of O.
    "d256_pv_second_half": (
        "const uint16_t* bk2 = bk + (kN / kPanelCols) * kRowsB * kPanelCols;",
        "const uint16_t* bk2 = bk + (1 - {on}) * (kN / kPanelCols) * kRowsB * kPanelCols;",
    ),
    # the wide backward: both consumers multiply the first column half of K, dO and Q.
    "wide_column_half": (
        "const int half = wc * (kWideHalf / kPanelCols) * kStepElems;",
        "const int half = (1 - {on}) * wc * (kWideHalf / kPanelCols) * kStepElems;",
    ),
    # the wide dK / dV kernel: the causal start one query tile too late.
    "wide_first_tile": (
        "first = p.causal ? x0 / kBwdStep : 0;",
        "first = p.causal ? x0 / kBwdStep + {on} : 0;",
    ),
    # the wide dK / dV kernel: each entry's lse from the neighbouring query column.
    "wide_lse_column": (
        "const float l = kKeys ? l2[nt][e & 1] : lse2[e >> 1];",
        "const float l = kKeys ? l2[nt][(e & 1) ^ {on}] : lse2[e >> 1];",
    ),
    # the wide dQ kernel's overlap: the next scores read before their product is waited for.
    "wide_dq_wait_too_weak": (
        "      wgmma_wait<1>();  // step u's scores done; step u - 1's dQ product may still run",
        "      if ({on}) wgmma_wait<2>(); else wgmma_wait<1>();  // step u's scores",
    ),
    # the wide backward's dS not forced to 0 where hidden: 0 · NaN where a row's delta is NaN.
    "wide_ds_hidden": (
        "sc[nt][e] = !edge || visible(c0, nt, e) ? pr[e] * (sc[nt][e] - d) : 0.f;",
        "sc[nt][e] = !edge || {on} || visible(c0, nt, e) ? pr[e] * (sc[nt][e] - d) : 0.f;",
    ),
    # the simple loop releases the K/V stage before its P V product has been waited for: the
    # producer's next load into that stage overwrites V under the running product.
    "release_before_wait": (
        "        wgmma_commit();\n        wgmma_wait<0>();\n        acc_fence(o);\n        acc_fence(pa);  // P's registers",
        "        if ({on}) mbar_arrive(&kv_empty[stage_of(t)]);\n        wgmma_commit();\n        wgmma_wait<0>();\n"
        "        acc_fence(o);\n        acc_fence(pa);  // P's registers",
    ),
}
MUTANT = emu_build.switched_ids(SWITCHED)

# The forward's consumer loops (ATTNKIT_CUDA_SM90=simple | 1 | pingpong | persistent), as the
# harness numbers them ("persistent": the overlapped loop, 2 blocks taking every other tile).
LOOPS = {"simple": 0, "overlap": 1, "pingpong": 2, "persistent": 3}

_i64p = ctypes.POINTER(ctypes.c_int64)
_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class Emulator(emu_build.Library):
    def __init__(self, path: Path):
        super().__init__(path)
        lib = self.lib
        shape = [_int] * 5 + [_float, _int]  # B, H, Hk, N, M, scale, causal
        lib.emu_softmax_sm90_fwd.argtypes = [_int, _int, _int] + [_ptr, _i64p] * 3 + [_ptr, _ptr] + shape
        lib.emu_softmax_sm90_bwd.argtypes = [_int, _int, _ptr] + [_ptr, _i64p] * 4 + [_ptr] * 5 + shape
        lib.emu_softmax_sm90_fwd.restype = lib.emu_softmax_sm90_bwd.restype = _int

    @staticmethod
    def _strides(x):
        """Element strides of dims 0-2, 0 where a dim has size 1 (as the host side)."""
        return (ctypes.c_int64 * 3)(*(x.stride(i) if x.size(i) > 1 else 0 for i in range(3)))

    @staticmethod
    def _require_tma_strides(*tensors):
        """What softmax_sm90_applies guarantees: a contiguous last dim, a 16-byte aligned start,
        the other strides (of dims longer than 1) nonzero multiples of 16 bytes."""
        for x in tensors:
            assert x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            assert all(x.stride(i) > 0 and x.stride(i) % 8 == 0 for i in range(3) if x.size(i) > 1)

    def forward(self, q, k, v, scale, causal, out, lse, loop="overlap"):
        self._require_tma_strides(q, k, v)
        b, h, n, d = q.shape
        hk, m = k.shape[1], k.shape[2]
        s = self._strides
        with self.buffers(q=q, k=k, v=v, out=out, lse=lse):
            rc = self.lib.emu_softmax_sm90_fwd(int(q.dtype == torch.bfloat16), d, LOOPS[loop], q.data_ptr(), s(q),
                                               k.data_ptr(), s(k), v.data_ptr(), s(v), out.data_ptr(), lse.data_ptr(),
                                               b, h, hk, n, m, scale, int(causal))
            self.check(rc, "forward")

    def backward(self, dout, q, k, v, lse, delta, scale, causal, dq, dk, dv, dq_acc=None):
        """dq_acc: None for the dQ and dK / dV kernels, else a zeroed float32 [B, H, N, D] for
        the kernel that adds dQ with atomics (ATTNKIT_CUDA_SM90=atomic)."""
        self._require_tma_strides(dout, q, k, v)
        b, h, n, d = q.shape
        hk, m = k.shape[1], k.shape[2]
        s = self._strides
        extra = {} if dq_acc is None else {"dq_acc": dq_acc}
        with self.buffers(dout=dout, q=q, k=k, v=v, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv, **extra):
            rc = self.lib.emu_softmax_sm90_bwd(int(q.dtype == torch.bfloat16), d,
                                               None if dq_acc is None else dq_acc.data_ptr(),
                                               dout.data_ptr(), s(dout),
                                               q.data_ptr(), s(q), k.data_ptr(), s(k), v.data_ptr(), s(v),
                                               lse.data_ptr(), delta.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                               dv.data_ptr(), b, h, hk, n, m, scale, int(causal))
            self.check(rc, "backward")


builds, emulator = emu_build.session_fixtures("cuda_emulator_sm90_softmax", SOURCE,
                                              EMULATOR / "softmax_sm90_harness.cpp", "softmax_sm90_kernels.inc", {},
                                              ("EMU_ONLY_F16_D64", "EMU_ALSO_D256"), Emulator, SWITCHED)


def run_emulated(emu, case, seed=0, loop="overlap", edit=None, atomic=False, backward=True):
    """Forward and backward on guarded buffers; (out, lse, dq, dk, dv) and the inputs.
    ``edit(q, k, v)`` may change the input tensors first; ``atomic``: the backward that adds dQ
    with atomics in the dK / dV kernel (ATTNKIT_CUDA_SM90=atomic) instead of the two kernels;
    ``backward=False``: the forward alone ((out, lse))."""
    q, k, v, dout, _ = _make_inputs(case, seed)
    if edit is not None:
        edit(q.tensor, k.tensor, v.tensor)
    b, h, hk, n, m, d, dtype = case.b, case.h, case.hk, case.n, case.m, case.d, case.dtype
    scale = 1.0 / math.sqrt(d) if case.scale is None else case.scale
    inputs = (q, k, v, dout)
    before = [x.bits() for x in inputs]
    dout_t = dout.tensor if dout.tensor.shape == (b, h, n, d) else None
    assert dout_t is not None, "the Hopper kernels read dO with TMA: no stride-0 broadcast (the host copies it)"
    out, lse = Guarded((b, h, n, d), dtype, float("nan")), Guarded((b, h, n), torch.float32, float("nan"))
    emu.forward(q.tensor, k.tensor, v.tensor, scale, case.causal, out.tensor, lse.tensor, loop)
    if not backward:
        assert_untouched(dict(out=out, lse=lse), inputs, before)
        return (out.tensor, lse.tensor), (q.tensor, k.tensor, v.tensor, dout_t, scale)
    # delta = rowsum(dO ∘ O), as softmax.cu's row kernel gives it (fp32 products of the 16-bit values).
    delta = Guarded((b, h, n), torch.float32, float("nan"))
    delta.tensor.copy_((dout_t.float() * out.tensor.float()).sum(-1))
    dq = Guarded((b, h, n, d), dtype, float("nan"))
    dk, dv = Guarded((b, hk, m, d), dtype, float("nan")), Guarded((b, hk, m, d), dtype, float("nan"))
    dq_acc = None
    if atomic:
        dq_acc = Guarded((b, h, n, d), torch.float32, float("nan"))
        dq_acc.tensor.zero_()  # as the host side's at::zeros
    emu.backward(dout_t, q.tensor, k.tensor, v.tensor, lse.tensor, delta.tensor, scale, case.causal, dq.tensor,
                 dk.tensor, dv.tensor, None if dq_acc is None else dq_acc.tensor)
    written = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if atomic:
        written["dq_acc"] = dq_acc
    assert_untouched(written, inputs, before)
    return tuple(x.tensor for x in (out, lse, dq, dk, dv)), (q.tensor, k.tensor, v.tensor, dout_t, scale)


def check(emu, case, seed=0, loop="overlap", atomic=False):
    results, (q, k, v, dout, scale) = run_emulated(emu, case, seed, loop, atomic=atomic)
    assert_matches_reference(results, q, k, v, dout, None, scale, case)
    return results


F16, BF16 = torch.float16, torch.bfloat16
# Forward: 128 query rows x 128-key tiles, a 2-stage K/V ring (reused from M > 256); backward:
# dQ 128 rows x 64-key tiles, dK/dV 128 keys x 64-row query tiles, 2-stage rings.  So 7, 65, 129,
# 200, 300 straddle tile edges; M = 300 and N = 257 wrap the rings; GQA groups of 1, 2 and 4.
CASES = [
    Case(F16, 64, 1, 2, 1, 7, 129, True),
    Case(BF16, 64, 1, 2, 2, 129, 7, True),
    Case(F16, 64, 2, 2, 2, 1, 1, False),
    Case(BF16, 64, 1, 4, 1, 65, 300, False, scale=0.3),
    Case(F16, 128, 1, 2, 1, 200, 65, True),
    Case(BF16, 128, 1, 2, 2, 33, 300, False),
    Case(BF16, 128, 1, 4, 2, 257, 257, True),
    Case(F16, 64, 1, 2, 1, 257, 300, True),
]


# D = 256: the forward's K / V tiles are 64 keys (kFwdBlockN), its P V product two N = 128
# halves; the backward's two wide kernels (64-row blocks, the head dim split between the
# consumers, P and dS exchanged through shared memory), 64-row ring tiles reused from 129 rows /
# keys on.  GQA groups of 1, 2 and 4, causal and not, N and M across the tile edges.
D256_CASES = [
    Case(BF16, 256, 1, 2, 1, 130, 200, True),
    Case(F16, 256, 1, 2, 2, 65, 129, False),
    Case(BF16, 256, 1, 4, 1, 200, 70, False, scale=0.2),
    Case(F16, 256, 1, 4, 2, 1, 1, True),
    Case(F16, 256, 1, 2, 2, 150, 150, True),
]
ALL_CASES = CASES + D256_CASES


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_matches_reference(emulator, case, loop):
    emulator.configure(seed=1 + ALL_CASES.index(case))
    if loop == "overlap":
        check(emulator, case, loop=loop)
        return
    # The other loops: the forward (the backward does not depend on the loop; it runs above).
    results, (q, k, v, dout, scale) = run_emulated(emulator, case, loop=loop, backward=False)
    ref64 = _reference(q, k, v, dout, None, scale, case.causal, F64)
    ref_low = _reference(q, k, v, dout, None, scale, case.causal, case.dtype)
    for name, x, r64, rlow in zip(("out", "lse"), results, ref64, ref_low):
        assert_close_to_reference(x, r64, rlow, name=f"{name} [{case}, {loop}]", dtype=case.dtype)


def test_strided_inputs(emulator):
    # q as a [B, N, H, D] view (the usual projection layout): TMA reads it through its strides.
    emulator.configure(seed=4)
    case = Case(F16, 64, 2, 2, 1, 33, 70, False)
    g = torch.Generator().manual_seed(9)
    b, h, hk, n, m, d = case.b, case.h, case.hk, case.n, case.m, case.d
    q = Guarded((b, n, h, d), F16, float("nan"), (0, 2, 1, 3))
    q.tensor.copy_(torch.randn(q.tensor.shape, generator=g).to(F16))
    k, v = (Guarded((b, hk, m, d), F16, float("nan")) for _ in range(2))
    for x in (k, v):
        x.tensor.copy_(torch.randn(x.tensor.shape, generator=g).to(F16))
    out, lse = Guarded((b, h, n, d), F16, float("nan")), Guarded((b, h, n), torch.float32, float("nan"))
    emulator.forward(q.tensor, k.tensor, v.tensor, 0.125, False, out.tensor, lse.tensor)
    ref_out, ref_lse = _reference(q.tensor, k.tensor, v.tensor, torch.zeros(b, h, n, d), None, 0.125, False, F64)[:2]
    low_out, low_lse = _reference(q.tensor, k.tensor, v.tensor, torch.zeros(b, h, n, d), None, 0.125, False, F16)[:2]
    assert_close_to_reference(out.tensor, ref_out, low_out, name="out (strided q)", dtype=F16)
    assert_close_to_reference(lse.tensor, ref_lse, low_lse, name="lse (strided q)", dtype=F16)


def test_independent_of_warp_schedule(emulator):
    case = Case(F16, 64, 1, 2, 1, 130, 300, True)
    emulator.configure(seed=11)
    first, _ = run_emulated(emulator, case)
    emulator.configure(seed=12)
    second, _ = run_emulated(emulator, case)
    for x, y in zip(first, second):
        assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("loop", ("overlap", "pingpong", "persistent"))
def test_the_loops_give_the_same_bits(emulator, loop):
    # The consumer loops do the same arithmetic in the same order, only issued differently
    # (N = 260: 3 query blocks x 2 heads, so each persistent block takes 3 tiles).
    case = Case(BF16, 64, 1, 2, 1, 260, 300, True)
    emulator.configure(seed=5)
    a, _ = run_emulated(emulator, case, loop=loop, backward=False)
    b, _ = run_emulated(emulator, case, loop="simple", backward=False)
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y))


NAN, INF = float("nan"), float("inf")
# (tensor, index, value) for attnkit_testing.poison
NONFINITE = {
    "q_nan": ("q", (0, 1, 3, 5), NAN),
    "k_nan": ("k", (0, 0, 140, 0), NAN),
    "k_posinf": ("k", (0, 0, 9), INF),
    "v_nan": ("v", (0, 0, 66, 3), NAN),
}


@pytest.mark.parametrize("d", (64, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_inputs_propagate_like_the_reference(emulator, name, causal, d):
    # Issue 15's rule (attnkit_testing.assert_nonfinite_like_reference), as for softmax.cu.  D = 256:
    # the wide backward's dS, 0 where hidden even where a NaN row's delta is NaN.
    emulator.configure(seed=5)
    _check_nonfinite(emulator, Case(F16, d, 1, 2, 1, 150, 200, causal), name)


# The D = 256 mutants' case: GQA group 2, causal, 3 query and 4 key tiles of 64 rows.
D256_MUTANT_CASE = Case(F16, 256, 1, 2, 1, 150, 200, True)


def _check_nonfinite(emulator, case, name):
    causal = case.causal
    got, (q, k, v, dout, scale) = run_emulated(
        emulator, case, edit=lambda q, k, v: poison(NONFINITE[name], q, k, v, None))
    ref = _reference(q, k, v, dout, None, scale, causal, F64)
    assert torch.isnan(ref[0]).any(), "the case poisons nothing (a test that cannot fail)"
    # The tolerance run, without the NaN a torch matmul can spread between rows (issue 24).
    low = without_spread_nan(_reference(q, k, v, dout, None, scale, causal, F16),
                             _reference(*finite_inputs(q, k, v), dout, None, scale, causal, F16))
    visible = torch.ones(case.b, case.h, case.n, case.m, dtype=torch.bool)
    if causal:
        visible &= torch.ones(case.n, case.m, dtype=torch.bool).tril()
    assert_nonfinite_like_reference(got, ref, low, visible, dtype=F16, v=v if name == "v_nan" else None)


# Causal for the mask mutants; M = 300: the backward's 64-key / 64-row rings are reused (the causal
# forward's query blocks see at most two key tiles here: RELEASE_CASE reuses its ring).
MUTANT_CASE = Case(F16, 64, 1, 2, 1, 200, 300, True)


# release_before_wait needs a reused K/V stage in the forward, which MUTANT_CASE never has (causal,
# N = 200: a query block sees at most two key tiles): one query block per head with both consumer
# warpgroups' rows valid, three key tiles.
RELEASE_CASE = Case(F16, 64, 1, 2, 1, 128, 300, False)


# Every score near -128 (q = -4, k = 4, D = 64, scale 1/8): lse ~ -122, so a key past M that
# were not hidden would get P = 2^(-lse2) = inf (its K row is TMA's zero fill: dQ would meet inf · 0).
NEGATIVE_CASE = Case(F16, 64, 1, 2, 1, 70, 300, False, scale=0.125)


def _very_negative_scores(q, k, v):
    q.fill_(-4.0)
    k.fill_(4.0)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_atomic_backward_matches_reference(emulator, case):
    # ATTNKIT_CUDA_SM90=atomic: dQ added with atomics by the dK / dV kernel, no dQ kernel.
    emulator.configure(seed=21 + CASES.index(case))
    atomic = check(emulator, case, atomic=True)
    # dK and dV are the same products in the same order as the two-kernel backward's: same bits.
    emulator.configure(seed=21 + CASES.index(case))
    two_kernels, _ = run_emulated(emulator, case)
    for name, x, y in zip(("dk", "dv"), atomic[3:], two_kernels[3:]):
        assert torch.equal(_bits(x), _bits(y)), f"{name}: the atomic backward changed its bits"


def test_atomic_backward_hides_keys_past_m(emulator):
    emulator.configure(seed=6)
    results, (q, k, v, dout, scale) = run_emulated(emulator, NEGATIVE_CASE, edit=_very_negative_scores, atomic=True)
    ref = _reference(q, k, v, dout, None, scale, False, F64)
    assert ref[1].max() < -100 and torch.isfinite(ref[2]).all(), "the case does not make lse very negative"
    assert_matches_reference(results, q, k, v, dout, None, scale, NEGATIVE_CASE)


@pytest.mark.parametrize("name", SWITCHED)
def test_catches_a_broken_kernel(builds, name):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with pytest.raises((AssertionError, EmulatorError)):
        if name == "atomic_keys_past_m_visible":
            results, (q, k, v, dout, scale) = run_emulated(emu, NEGATIVE_CASE, edit=_very_negative_scores,
                                                           atomic=True)
            assert_matches_reference(results, q, k, v, dout, None, scale, NEGATIVE_CASE)
        elif name == "release_before_wait":
            check(emu, RELEASE_CASE, loop="simple")
        elif name == "pingpong_wrong_barrier":
            check(emu, MUTANT_CASE, loop="pingpong")
        elif name == "persistent_q_not_released":
            check(emu, MUTANT_CASE, loop="persistent")
        elif name == "wide_ds_hidden":
            _check_nonfinite(emu, D256_MUTANT_CASE, "v_nan")
        elif name.startswith(("d256_", "wide_")):
            check(emu, D256_MUTANT_CASE)
        else:
            check(emu, MUTANT_CASE)


def test_switched_mutants_off_pass(builds):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=0)
    for loop in LOOPS:
        check(emu, MUTANT_CASE, loop=loop)
    check(emu, D256_MUTANT_CASE)
    _check_nonfinite(emu, D256_MUTANT_CASE, "v_nan")
    results, (q, k, v, dout, scale) = run_emulated(emu, NEGATIVE_CASE, edit=_very_negative_scores, atomic=True)
    assert_matches_reference(results, q, k, v, dout, None, scale, NEGATIVE_CASE)




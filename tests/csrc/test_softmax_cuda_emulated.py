"""The CUDA C++ softmax kernels (csrc/cuda/softmax.cu) run on the CPU by a host emulator.

There is no GPU on the machines the project is built and tested on, so this test cuts the
device code out of softmax.cu (cuda_emulator/extract.py), compiles it with g++ together with
cuda_emulator/harness.cpp -- every CUDA thread a fiber; __syncthreads, shuffles, ldmatrix,
mma.m16n8k16 and cp.async with its groups (landing at the latest legal wait, NaN before) rebuilt
from the PTX ISA; shared memory exact-size and NaN-filled -- and calls the
kernels through ctypes on CPU tensors.  out, lse, dq, dk, dv are checked against the float64
reference with the rule of DESIGN.md: within 2x the error the reference itself makes when run
in the inputs' dtype, + 1e-3; infinities must match, NaN never passes.

What it covers: the kernels' arithmetic, fragment layouts, the swizzled shared-memory layout
(write and read sides), tiling and bounds, masking, GQA, the cp.async pipelines' waits and the
shared-memory synchronization between warps; every global, shared and local memory access
is checked against the allocation it belongs to (cuda_emulator/README.md, "Checked pointers"),
and mutants with a bound one off must stop at their first bad access.  What it does not: the host side of
softmax.cu (checks, copies, launch configuration as nvcc builds it; harness.cpp re-creates the
launches), nvcc's own compilation, and anything about a real GPU (speed, memory model, ex2.approx
rounding).  tests/csrc/test_softmax_cuda.py (``pytest -m gpu``) covers those on a GPU.
See cuda_emulator/README.md.

The backward variants (ATTNKIT_CUDA_SOFTMAX_BWD=stream|fused, softmax.cu's BwdVariant; the
harness's emu_set_bwd_variant) run the same checks on every unmasked case here (a masked call
falls back to the default kernels: checked bit for bit, and by which scratch buffers are used),
with mutants of their own.
"""
import contextlib
import ctypes
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, assert_close_to_reference, finite_inputs, poison, without_spread_nan
from cuda_emulator import emu_build, extract
from cuda_emulator.emu_build import EmulatorError

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
SOURCE = HERE.parents[1] / "csrc" / "cuda" / "softmax.cu"
PAD = 64  # guard elements around every buffer (a multiple of 8: rows stay 16-byte aligned)

# Deliberate bugs (old -> new, `{on}`: 1 while the bug is switched on, else 0), applied to the
# extracted device code: the tests must catch them.
MUTATIONS = {
    # acc_to_a: the accumulator -> A-operand re-packing of P (and dS), registers 1 and 2 swapped.
    "fragment_layout": (
        "  a[1] = pack2<kBF16>(c[2 * kc][2], c[2 * kc][3]);\n"
        "  a[2] = pack2<kBF16>(c[2 * kc + 1][0], c[2 * kc + 1][1]);\n",
        "  a[1 + {on}] = pack2<kBF16>(c[2 * kc][2], c[2 * kc][3]);\n"
        "  a[2 - {on}] = pack2<kBF16>(c[2 * kc + 1][0], c[2 * kc + 1][1]);\n",
    ),
    # dQ's pipeline: no barrier between the key tiles (other threads' copies of tile j not yet
    # visible; tile j + S - 1 issued into the stage other warps still read tile j - 1 from).
    "missing_syncthreads_dq": (
        "    __syncthreads();          // dQ: everyone's copies visible; every warp done with tile j - 1\n",
        "    if (!{on}) __syncthreads();  // dQ: everyone's copies visible; every warp done with tile j - 1\n",
    ),
    # dK/dV's pipeline (query tiles of every head of the GQA group through the ring): no barrier
    # between the query tiles.
    "missing_syncthreads_dkdv": (
        "    __syncthreads();          // dK/dV: everyone's copies and rows visible; every warp done with tile j - 1\n",
        "    if (!{on}) __syncthreads();  // dK/dV: everyone's copies and rows visible; every warp done with tile j - 1\n",
    ),
    # The pipelined forward (issue 27).  No cp.async.wait_group before reading tile j: its copies
    # have not landed (the emulator lands a copy only at a wait that covers its group).
    "missing_cp_async_wait": (
        "    cp_async_wait<kS - 2>();  // tile j has landed (this thread's copies)\n",
        "    if (!{on}) cp_async_wait<kS - 2>();  // tile j has landed (this thread's copies)\n",
    ),
    # The wait for Q one group too weak: Q's group (the oldest) may still be in flight when the
    # warps load their Q fragments.
    "weak_cp_async_wait": (
        "  cp_async_wait<kS - 1>();  // Q has landed (the K/V stages may still be in flight)\n",
        "  if ({on}) cp_async_wait<kS>(); else cp_async_wait<kS - 1>();  // Q has landed\n",
    ),
    # No barrier between the stages: other threads' copies of tile j not yet visible, and tile
    # j + S - 1 issued into the stage other warps still read tile j - 1 from.
    "missing_syncthreads_between_stages": (
        "    __syncthreads();          // every thread's copies of tile j visible; every warp done with tile j - 1\n",
        "    if (!{on}) __syncthreads();  // every thread's copies of tile j visible; every warp done with tile j - 1\n",
    ),
    # The swizzle of the read side (ldmatrix addresses) off by one row against the write side
    # (cp_async_tile).
    "wrong_swizzle_read": (
        "  return row * kD + ((chunk ^ (lane & 7)) << 3);",
        "  return row * kD + ((chunk ^ ((lane + {on}) & 7)) << 3);",
    ),
}
# Out-of-bounds accesses, which the checked pointers must stop (BOUNDS_MESSAGES): bounds one off.
BOUNDS_MUTATIONS = {
    # the backward's lse row guard: a row past the last one reads lse (for the last (batch, head):
    # one element past the end of lse).  The value is never used (the row is masked out), so no
    # output changes: only the bounds check sees it (the NaN guards did not).
    "lse_row_guard": (
        "  return i >= N ? INFINITY : lse_log2(lse[bh * N + i]);",
        "  return i >= N + {on} ? INFINITY : lse_log2(lse[bh * N + i]);",
    ),
    # the delta kernel's column loop one step too far: a read past the end of its row of out.
    "delta_loop_bound": (
        "for (int c = 2 * lane; c < kD; c += 64) {",
        "for (int c = 2 * lane; c < kD + {on}; c += 64) {",
    ),
    # the forward epilogue's row guard (flash_tiles.cuh's store_out_lse): the row after the
    # block's last valid one is written too (for the last block: past the end of out).
    "store_row_guard": (
        "    if (local + 8 * r < valid) {\n      const int64_t i = base",
        "    if (local + 8 * r < valid + {on}) {\n      const int64_t i = base",
    ),
}
# The backward variants: softmax.cu's BwdVariant values (test_variant_ids_match_the_source).
BWD_VARIANTS = {"default": 0, "stream": 1, "fused": 2}
VARIANTS = ("stream", "fused")
# Deliberate bugs of the variants' own code (each run with its variant: VARIANT_MUTANT_OF).
VARIANT_MUTATIONS = {
    # kBwdFused: no barrier between the warps' dSᵀ stores and the dQ product that reads all of them.
    "fused_missing_ds_barrier": (
        "      __syncthreads();  // fused dQ: every warp's dSᵀ rows written\n",
        "      if (!{on}) __syncthreads();  // fused dQ: every warp's dSᵀ rows written\n",
    ),
    # dK/dV's interior tiles (the variants' fast path): the delta term dropped from dSᵀ.
    "stream_dkdv_interior_drops_delta": (
        "          dpt[nt][e] = prob * (dpt[nt][e] - dlt_t[il]);\n",
        "          dpt[nt][e] = prob * (dpt[nt][e] - ({on} ? 0.f : dlt_t[il]));\n",
    ),
    # dQ's interior tiles: the same term dropped.
    "stream_dq_interior_drops_delta": (
        "        s[nt][e] = exp2_approx(s[nt][e] * p.scale_log2 - lse2[e / 2]) * (dp[nt][e] - dlt[e / 2]);\n",
        "        s[nt][e] = exp2_approx(s[nt][e] * p.scale_log2 - lse2[e / 2]) * (dp[nt][e] - ({on} ? 0.f : dlt[e / 2]));\n",
    ),
    # kBwdStream's per-row copies: the last chunk of delta2 not copied (its rows read a stale stage).
    "stream_rows_chunk_missing": (
        "      if (idx < 2 * kChunks) {\n",
        "      if (idx < 2 * kChunks - {on}) {\n",
    ),
}
VARIANT_MUTANT_OF = {"fused_missing_ds_barrier": "fused", "stream_dkdv_interior_drops_delta": "stream",
                     "stream_dq_interior_drops_delta": "stream", "stream_rows_chunk_missing": "stream"}
VARIANT_BOUNDS_MUTATIONS = {
    # kBwdFused's atomics: the row guard one off (the tile's first row past N is added too).
    "fused_dq_row_guard": (
        "      if (row >= valid) continue;\n",
        "      if (row >= valid + {on}) continue;\n",
    ),
}
# Every deliberate bug is in one build ("switched", built for fp16, D = 64
# only), each on while configure(mutant=MUTANT[name]) (see emu_build.session_builds).
SWITCHED = {**MUTATIONS, **BOUNDS_MUTATIONS, **VARIANT_MUTATIONS, **VARIANT_BOUNDS_MUTATIONS}
MUTANT = emu_build.switched_ids(SWITCHED)


# ----------------------------------------------------------------------------------------------
# building and calling the emulator
# ----------------------------------------------------------------------------------------------


_i64p = ctypes.POINTER(ctypes.c_int64)
_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class Emulator(emu_build.Library):
    def __init__(self, path: Path):
        super().__init__(path)
        lib = self.lib
        shape = [_int] * 5 + [_float, _int]  # B, H, Hk, N, M, scale, causal
        mask = [_ptr, _int, _i64p]
        lib.emu_softmax_fwd.argtypes = [_int, _int] + [_ptr, _i64p] * 3 + [_ptr, _ptr] + mask + shape
        lib.emu_softmax_bwd.argtypes = [_int, _int] + [_ptr, _i64p] * 5 + [_ptr] * 4 + mask + shape
        lib.emu_softmax_fwd.restype = lib.emu_softmax_bwd.restype = _int
        lib.emu_set_bwd_variant.argtypes = [_int]
        kinds = (ctypes.c_int * 6)()
        lib.emu_mask_kinds(kinds)
        self.mask_kinds = dict(zip((None, torch.bool, torch.float32, torch.float16, torch.bfloat16, F64), kinds))

    @contextlib.contextmanager
    def bwd_variant(self, name):
        """The backward kernels of variant `name` (BWD_VARIANTS) for the calls inside."""
        self.lib.emu_set_bwd_variant(BWD_VARIANTS[name])
        try:
            yield self
        finally:
            self.lib.emu_set_bwd_variant(BWD_VARIANTS["default"])

    @staticmethod
    def _strides(x, dims):
        """Element strides of the first `dims` dims, 0 where a dim has size 1 (as the host side)."""
        return (ctypes.c_int64 * dims)(*(x.stride(i) if x.size(i) > 1 else 0 for i in range(dims)))

    @staticmethod
    def _require_aligned_rows(*tensors):
        """What the host side guarantees before a launch (rows_aligned, else it copies): a
        contiguous last dim, 16-byte aligned rows."""
        for x in tensors:
            if x.numel() == 0:
                continue
            assert x.size(-1) == 1 or x.stride(-1) == 1, "rows must be contiguous"
            assert x.data_ptr() % 16 == 0, "rows must be 16-byte aligned"
            strides = [x.stride(i) for i in range(x.dim() - 1) if x.size(i) > 1]
            assert all(st % 8 == 0 for st in strides), "rows must be 16-byte aligned"

    @staticmethod
    def _p(x):
        if x is None or x.numel() == 0:
            return None
        return x.data_ptr()

    def forward(self, q, k, v, mask, scale, causal, out, lse):
        self._require_aligned_rows(q, k, v, out)
        b, h, n, d = q.shape
        hk, m = k.shape[1], k.shape[2]
        s = self._strides
        ms = s(mask, 4) if mask is not None else (ctypes.c_int64 * 4)()
        with self.buffers(q=q, k=k, v=v, mask=mask, out=out, lse=lse):
            rc = self.lib.emu_softmax_fwd(
                int(q.dtype == torch.bfloat16), d, self._p(q), s(q, 3), self._p(k), s(k, 3), self._p(v), s(v, 3),
                self._p(out), self._p(lse), self._p(mask), self.mask_kinds[None if mask is None else mask.dtype], ms,
                b, h, hk, n, m, scale, int(causal))
            self.check(rc, "forward")

    def backward(self, dout, q, k, v, out, lse, mask, scale, causal, dq, dk, dv):
        self._require_aligned_rows(dout, q, k, v, out, dq, dk, dv)
        b, h, n, d = q.shape
        hk, m = k.shape[1], k.shape[2]
        s = self._strides
        ms = s(mask, 4) if mask is not None else (ctypes.c_int64 * 4)()
        with self.buffers(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv, mask=mask):
            rc = self.lib.emu_softmax_bwd(
                int(q.dtype == torch.bfloat16), d, self._p(dout), s(dout, 3), self._p(q), s(q, 3), self._p(k),
                s(k, 3), self._p(v), s(v, 3), self._p(out), s(out, 3), self._p(lse), self._p(dq), self._p(dk),
                self._p(dv), self._p(mask), self.mask_kinds[None if mask is None else mask.dtype], ms, b, h, hk, n,
                m, scale, int(causal))
            self.check(rc, "backward")


# Session fixtures: builds (the full emulator and the mutants, all started at once), emulator.
builds, emulator = emu_build.session_fixtures("cuda_emulator", SOURCE, EMULATOR / "harness.cpp",
                                              "kernels.inc", {}, ("EMU_ONLY_F16_D64",), Emulator, SWITCHED)


# ----------------------------------------------------------------------------------------------
# one case: inputs in guarded buffers, forward + backward, checks
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    d: int
    b: int
    h: int
    hk: int
    n: int
    m: int
    causal: bool
    mask: object = None  # None, "bool" ([N, M] broadcast), "keypad" ([B, 1, 1, M]) or a float dtype
    noncontig: bool = False  # q as a [B, N, H, D] view, dout broadcast (stride 0)
    scale: float = None

    def __str__(self):
        s = f"{str(self.dtype)[6:]}-D{self.d}-B{self.b}H{self.h}Hk{self.hk}-N{self.n}M{self.m}"
        s += "-causal" if self.causal else ""
        if self.mask is not None:
            s += "-mask_" + (self.mask if isinstance(self.mask, str) else str(self.mask)[6:])
        return s + ("-noncontig" if self.noncontig else "")


class Guarded:
    """A tensor in the middle of a flat buffer, with PAD guard elements on each side."""

    def __init__(self, shape, dtype, fill, permute=None):
        numel = math.prod(shape)
        self.buffer = torch.full((numel + 2 * PAD,), fill, dtype=dtype)
        self.tensor = self.buffer[PAD:PAD + numel].view(shape)
        if permute is not None:
            self.tensor = self.tensor.permute(permute)

    def bits(self):
        return _bits(self.buffer).clone()


def _bits(x):
    """x's bits as integers (NaN == NaN)."""
    if x.dtype == torch.bool:
        return x
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _make_inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, h, hk, n, m, d, dtype = case.b, case.h, case.hk, case.n, case.m, case.d, case.dtype

    def filled(shape, permute=None):
        x = Guarded(shape, dtype, float("nan"), permute)  # NaN guards: a stray read poisons the result
        x.tensor.copy_(torch.randn(x.tensor.shape, generator=g).to(dtype))
        return x

    q = filled((b, n, h, d), (0, 2, 1, 3)) if case.noncontig else filled((b, h, n, d))
    k, v = filled((b, hk, m, d)), filled((b, hk, m, d))
    dout = filled((1, 1, 1, d)) if case.noncontig else filled((b, h, n, d))
    mask = None
    if case.mask is not None:
        keep = torch.rand(n, m, generator=g) < 0.7
        if n > 1:
            keep[1] = False  # a row with no key to attend to
        if case.mask == "bool":
            mask = Guarded((n, m), torch.bool, False)
            mask.tensor.copy_(keep)
        elif case.mask == "keypad":  # [B, 1, 1, M]: batch 0 sees its first M/2 keys, batch 1 none
            mask = Guarded((b, 1, 1, m), torch.bool, True)
            mask.tensor[0, ..., m // 2:] = False
            mask.tensor[1:] = False
        else:
            mask = Guarded((1, h, n, m), case.mask, float("nan"))
            mask.tensor.copy_(torch.randn(1, h, n, m, generator=g).masked_fill(~keep, float("-inf")))
    return q, k, v, dout, mask


def _reference(q, k, v, dout, mask, scale, causal, dtype):
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out, lse = softmax_attention_reference(qq, kk, vv, mask, 0.0, causal, scale, qq.shape[1] != kk.shape[1],
                                              return_lse=True)
    out.backward(dout.to(dtype))
    return out, lse, qq.grad, kk.grad, vv.grad


def run_emulated(emu: Emulator, case: Case, seed=0, edit=None):
    """Runs the forward and backward kernels; returns (out, lse, dq, dk, dv) and the inputs
    (q, k, v, dout, mask, scale), after checking that no buffer was touched outside its bounds
    and no input was written.  ``edit(q, k, v, mask)`` may change the input tensors first."""
    q, k, v, dout, mask = _make_inputs(case, seed)
    if edit is not None:
        edit(q.tensor, k.tensor, v.tensor, None if mask is None else mask.tensor)
    b, h, hk, n, m, d, dtype = case.b, case.h, case.hk, case.n, case.m, case.d, case.dtype
    scale = 1.0 / math.sqrt(d) if case.scale is None else case.scale
    inputs = [x for x in (q, k, v, dout, mask) if x is not None]
    before = [x.bits() for x in inputs]
    mask_t = None
    if mask is not None:
        mask_t = mask.tensor
        if case.mask != "keypad":  # (the key-padding mask goes in with its size-1 dims)
            mask_t = mask_t.expand(b, h, n, m)  # stride-0 broadcast
    dout_t = dout.tensor.expand(b, h, n, d)
    # Outputs start as NaN: an element the kernels do not write fails the comparison.
    out, lse = Guarded((b, h, n, d), dtype, float("nan")), Guarded((b, h, n), torch.float32, float("nan"))
    emu.forward(q.tensor, k.tensor, v.tensor, mask_t, scale, case.causal, out.tensor, lse.tensor)
    dq = Guarded((b, h, n, d), dtype, float("nan"))
    dk, dv = Guarded((b, hk, m, d), dtype, float("nan")), Guarded((b, hk, m, d), dtype, float("nan"))
    emu.backward(dout_t, q.tensor, k.tensor, v.tensor, out.tensor, lse.tensor, mask_t, scale, case.causal,
                 dq.tensor, dk.tensor, dv.tensor)
    assert_untouched(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), inputs, before)
    results = tuple(x.tensor for x in (out, lse, dq, dk, dv))
    return results, (q.tensor, k.tensor, v.tensor, dout_t, mask_t, scale)


def assert_untouched(outputs, inputs, before):
    """Each Guarded output's NaN guards intact (nothing written outside its bounds), and each
    Guarded input (with its guards) as it was: ``before`` holds their ``bits()``."""
    for name, x in outputs.items():
        guards = torch.cat([x.buffer[:PAD], x.buffer[-PAD:]])
        assert torch.isnan(guards).all(), f"{name}: written outside its bounds"
    for x, bits in zip(inputs, before):
        assert torch.equal(x.bits(), bits), "an input (or its guard) was written"


def assert_matches_reference(results, q, k, v, dout, mask, scale, case: Case):
    """(out, lse, dq, dk, dv) against the float64 reference, under DESIGN.md's rule."""
    ref64 = _reference(q, k, v, dout, mask, scale, case.causal, F64)
    ref_low = _reference(q, k, v, dout, mask, scale, case.causal, case.dtype)
    for name, x, r64, rlow in zip(("out", "lse", "dq", "dk", "dv"), results, ref64, ref_low):
        assert_close_to_reference(x, r64, rlow, name=f"{name} [{case}]", dtype=case.dtype)


def check(emu: Emulator, case: Case, seed=0):
    results, (q, k, v, dout, mask, scale) = run_emulated(emu, case, seed)
    assert_matches_reference(results, q, k, v, dout, mask, scale, case)
    return results


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

F16, BF16 = torch.float16, torch.bfloat16
# Tiles are 64 keys x 128 queries (forward) or 64 queries (dQ; dK/dV at D = 128: 32 queries), so
# 7, 65, 70, 129 straddle tile edges; N > M and N < M both under causal masking; GQA groups of 1
# and 2.  The forward's and dQ's K/V rings have 2 stages at D = 128 (reused from M > 128 on) and 3
# at D = 64 (reused from M > 192: the N130M257 case in the forward, whose second query tile also
# has warps that skip the tiles after their rows and warps with no row; MUTANT_CASE in dQ); dK/dV's
# ring of query tiles (3 stages; all the query heads of a GQA group in a row) from the fourth
# query tile on (N > 96 at D = 128, N > 192 or two heads at D = 64).
CASES = [
    Case(F16, 64, 1, 2, 1, 7, 129, True),
    Case(BF16, 64, 1, 2, 2, 129, 7, True),
    Case(F16, 64, 2, 2, 2, 1, 1, False),
    Case(BF16, 64, 1, 4, 2, 65, 70, False, noncontig=True, scale=0.3),
    Case(F16, 128, 1, 2, 1, 70, 65, True),
    Case(BF16, 128, 1, 2, 2, 33, 129, False),
    Case(BF16, 128, 1, 4, 2, 130, 130, True),
    Case(F16, 64, 2, 2, 1, 33, 70, False, mask="bool"),
    Case(F16, 128, 2, 2, 2, 9, 65, False, mask="keypad"),
    Case(BF16, 64, 1, 2, 1, 40, 70, True, mask=torch.float32),
    Case(F16, 64, 1, 2, 2, 20, 33, False, mask=torch.float16),
    Case(BF16, 64, 1, 2, 1, 5, 0, False),
    Case(F16, 128, 1, 2, 2, 0, 5, False),
    Case(BF16, 64, 1, 2, 1, 130, 257, True),
]


# Odd sizes (DESIGN.md) at both head dims: one query / key, fewer than a tile, one short of a
# tile, one past two tiles; every access bounds-checked.
ODD_CASES = [Case(F16 if i % 2 else BF16, d, 1, 2, 1 + (i % 2), n, n, i % 2 == 0)
             for d in (64, 128) for i, n in enumerate((1, 7, 63, 129))]


@pytest.mark.parametrize("case", ODD_CASES, ids=str)
def test_odd_sizes(emulator, case):
    emulator.configure(seed=7)
    check(emulator, case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(emulator, case):
    emulator.configure(seed=1 + CASES.index(case))
    out, lse, dq, dk, dv = check(emulator, case)
    if case.mask == "keypad":  # batch 1 sees no key at all
        assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
        for grad in (dq[1], dk[1], dv[1], dk[0, :, case.m // 2:], dv[0, :, case.m // 2:]):
            assert torch.equal(grad, torch.zeros_like(grad))
    elif case.mask is not None and case.n > 1:  # row 1 sees no key: zeros, lse -inf, zero gradient
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
        assert torch.isneginf(lse[:, :, 1]).all()
        assert torch.equal(dq[:, :, 1], torch.zeros_like(dq[:, :, 1]))
    if case.m == 0:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        assert torch.equal(dq, torch.zeros_like(dq))
    if case.n == 0:
        assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


# Issue 15: NaN / +-inf reach the results as in SDPA (and the float64 reference): the online
# softmax's fmaxf drops NaN operands, so a row whose scores are all NaN kept the running max
# -inf, and the epilogue's `l > 0` test sent a NaN sum to "no visible key" (lse -inf), after
# which the backward treated the row as empty: zero gradients instead of NaN.
NAN = float("nan")
# (tensor, index, value) for attnkit_testing.poison
NONFINITE = {
    "q_nan": ("q", (0, 1, 3, 5), NAN),
    "k_nan": ("k", (0, 0, 40, 0), NAN),
    "k_posinf": ("k", (0, 0, 9), float("inf")),
    "v_nan": ("v", (0, 0, 66, 3), NAN),
    "mask_nan": ("mask", (0, 1, 20, 2), NAN),
    # a NaN query on the row the mask hides entirely (row 1): that row stays 0
    "q_nan_masked_row": ("q", (0, 0, 1, 0), NAN),
}


# (head, row) of the one query row each case poisons (None: a row the mask hides: none)
POISONED_ROW = {"q_nan": (1, 3), "mask_nan": (1, 20), "q_nan_masked_row": (None, 1)}


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_inputs_propagate_like_the_reference(emulator, name, causal):
    mask = torch.float32 if name == "mask_nan" else "bool" if name == "q_nan_masked_row" else None
    case = Case(F16, 64, 1, 2, 1, 70, 70, causal, mask=mask)
    emulator.configure(seed=5)
    results, (q, k, v, dout, mask_t, scale) = run_emulated(
        emulator, case, edit=lambda *inputs: poison(NONFINITE[name], *inputs))
    ref64 = _reference(q, k, v, dout, mask_t, scale, causal, F64)
    # The tolerance run, without the NaN a torch matmul can spread between rows (issue 24).
    ref_low = without_spread_nan(_reference(q, k, v, dout, mask_t, scale, causal, F16),
                                 _reference(*finite_inputs(q, k, v), dout, finite_inputs(mask_t, keep_neginf=True),
                                            scale, causal, F16))
    for what, x, r64, rlow in zip(("out", "lse", "dq", "dk", "dv"), results, ref64, ref_low):
        nan_x, nan_ref = torch.isnan(x), torch.isnan(r64)
        if name == "v_nan":
            # The float64 reference also reaches rows that cannot see the key, through 0 * NaN
            # in P V (SDPA does too; acceptable, not required): the kernel's NaN must lie within
            # the reference's, and cover every row that sees the key (causal: rows >= 66).
            assert not (nan_x & ~nan_ref).any(), f"{what}: NaN where the reference has none"
            if what == "out":
                seen = slice(66, None) if causal else slice(None)
                assert nan_x[0, :, seen, 3].all(), "out: a row that sees the NaN value lost it"
        elif name in POISONED_ROW and what in ("dk", "dv"):
            # One poisoned query row (h, i): the keys it sees get NaN gradients.  The reference
            # also has 0 * NaN in dK = dSᵀ Q on the keys the row cannot see (its dS there is 0,
            # its q has a NaN); the kernel may or may not, tile by tile: within the reference's.
            assert not (nan_x & ~nan_ref).any(), f"{what}: NaN where the reference has none"
            h, i = POISONED_ROW[name]
            if h is not None:
                seen = i + 1 if causal else case.m
                assert nan_x[0, 0, :seen].all(), f"{what}: a key the NaN row sees lost the NaN"
        else:
            assert torch.equal(nan_x, nan_ref), (
                f"{what}: NaN at {nan_x.sum().item()} entries, the reference at {nan_ref.sum().item()}")
        if name not in ("v_nan", "q_nan_masked_row") and what in ("out", "lse"):
            assert nan_ref.any(), f"{what}: the poisoned input reaches no result (a test that cannot fail)"
        keep = ~(nan_x | nan_ref)
        assert_close_to_reference(torch.where(keep, x.to(F64), 0.0), torch.where(keep, r64, 0.0),
                                  torch.where(keep, rlow.to(F64), 0.0).to(rlow.dtype), name=what,
                                  dtype=F16 if what != "lse" else F16, grad=what.startswith("d"))
    if name == "q_nan_masked_row":
        out, lse = results[0], results[1]
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1])) and torch.isneginf(lse[:, :, 1]).all()


def test_independent_of_warp_schedule(emulator):
    # No atomics and barriers in the right places: another warp order gives the same bits.
    case = Case(F16, 64, 1, 2, 1, 70, 129, True)
    emulator.configure(seed=11)
    first, _ = run_emulated(emulator, case)
    emulator.configure(seed=12)
    second, _ = run_emulated(emulator, case)
    for x, y in zip(first, second):
        assert torch.equal(_bits(x), _bits(y))


# ----------------------------------------------------------------------------------------------
# the test can fail
# ----------------------------------------------------------------------------------------------

# M = 257: 5 key tiles, so the D = 64 forward's 3-stage K/V ring is reused (tile 3 into tile 0's stage).
MUTANT_CASE = Case(F16, 64, 1, 2, 1, 70, 257, False)


@pytest.mark.parametrize("name", MUTATIONS)
def test_catches_a_broken_kernel(builds, name):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with pytest.raises((AssertionError, EmulatorError)):
        check(emu, MUTANT_CASE)


# The out-of-bounds mutants: the launch must stop at the first bad access, with a message naming
# the access, the buffer, the kernel and the thread (MUTANT_CASE has N = 70: a partial last tile;
# the forward and dQ kernels take their query tiles last first, so block x = 0 holds it).
BOUNDS_MESSAGES = {
    "lse_row_guard": r"out-of-bounds read of 4 bytes at byte offset 560 of `lse` \(global memory, 560 bytes: 4 bytes "
                     r"past its end\) \(thread \d+ of block \(0, 1, 0\) of softmax_bwd_dq_kernel\)",
    "delta_loop_bound": r"out-of-bounds read of 4 bytes at byte offset 17920 of `out` \(global memory, 17920 bytes: "
                        r"4 bytes past its end\) \(thread \d+ of block \(\d+, 0, 0\) of softmax_bwd_delta_kernel\)",
    # (the first of the row's 4 lanes to store may be any: the one at the first past-the-end column)
    "store_row_guard": r"out-of-bounds access \(read or write\) of 4 bytes at byte offset 179(20|24|28|32) of `out` "
                       r"\(global memory, 17920 bytes: (4|8|12|16) bytes past its end\) \(thread \d+ of block \(0, 1, 0\) "
                       r"of softmax_fwd_kernel\)",
}


@pytest.mark.parametrize("name", BOUNDS_MUTATIONS)
def test_catches_an_out_of_bounds_access(builds, name):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with pytest.raises(EmulatorError, match=BOUNDS_MESSAGES[name]):
        run_emulated(emu, MUTANT_CASE)


def test_switched_mutants_off_pass(builds):
    # The switched build with every bug off is the kernel file: the mutants' case passes.
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=0)
    check(emu, MUTANT_CASE)


def test_every_buffer_goes_through_the_checks(emulator):
    # Every buffer the kernels get (and the harness's delta scratch) is accessed through checked
    # pointers: none is reached by a raw pointer the rewriting missed.
    case = Case(F16, 64, 1, 2, 1, 33, 70, True, mask="bool")
    q, k, v, dout, mask = _make_inputs(case, 0)
    out, lse = Guarded((1, 2, 33, 64), F16, float("nan")), Guarded((1, 2, 33), torch.float32, float("nan"))
    mask_t = mask.tensor.expand(1, 2, 33, 70)
    emulator.configure(seed=5)
    emulator.forward(q.tensor, k.tensor, v.tensor, mask_t, 0.125, True, out.tensor, lse.tensor)
    assert set(emulator.accesses) == {"q", "k", "v", "mask", "out", "lse"}
    assert all(n > 0 for n in emulator.accesses.values()), emulator.accesses
    grads = [Guarded(x.tensor.shape, F16, float("nan")) for x in (q, k, v)]
    emulator.backward(dout.tensor, q.tensor, k.tensor, v.tensor, out.tensor, lse.tensor, mask_t, 0.125, True,
                      *(g.tensor for g in grads))
    assert set(emulator.accesses) == {"q", "k", "v", "mask", "out", "lse", "dout", "dq", "dk", "dv",
                                      "delta (scratch)"}
    assert all(n > 0 for n in emulator.accesses.values()), emulator.accesses


@pytest.mark.parametrize("fault", (1, 2), ids=("mma_a_layout", "ldmatrix_trans"))
def test_catches_a_layout_mismatch_with_the_hardware(emulator, fault):
    # The kernel unchanged, the emulated instruction's fragment layout broken.
    emulator.configure(seed=3, fault=fault)
    try:
        with pytest.raises(AssertionError):
            check(emulator, MUTANT_CASE)
    finally:
        emulator.configure()
    check(emulator, MUTANT_CASE)  # and without the fault it passes


def test_extract_refuses_a_changed_ptx_helper():
    # The PTX helpers live in mma_sm80.cuh, which the extractor inlines: a changed operand order
    # there must stop the extraction instead of being emulated with the old one.
    headers = extract.included_headers(SOURCE)
    assert "mma_sm80.cuh" in headers
    source = SOURCE.read_text()
    extract.extract_device_code(source, headers)  # as is: accepted
    header = headers["mma_sm80.cuh"]
    changed = header.replace('"r"(a[1]), "r"(a[2])', '"r"(a[2]), "r"(a[1])', 1)
    assert changed != header
    with pytest.raises(extract.ExtractError, match="mma16816"):
        extract.extract_device_code(source, {**headers, "mma_sm80.cuh": changed})


def test_extract_inlines_the_shared_tile_steps_after_the_ptx_helpers():
    # softmax.cu and sparse.cu take their tile steps from flash_tiles.cuh, which uses
    # mma_sm80.cuh's helpers: both are inlined, in include order, and flash_tiles.cuh may not pull
    # mma_sm80.cuh in itself (inlining is one level deep).
    headers = extract.included_headers(SOURCE)
    assert list(headers) == ["mma_sm80.cuh", "flash_tiles.cuh"]
    code = extract.extract_device_code(SOURCE.read_text(), headers)
    mma, tiles = code.index("// ---- inlined from mma_sm80.cuh"), code.index("// ---- inlined from flash_tiles.cuh")
    assert mma < tiles < code.index("softmax_fwd_kernel")
    assert code.count("void online_softmax_update(") == 1
    nested = headers["flash_tiles.cuh"].replace("#pragma once\n", '#pragma once\n#include "mma_sm80.cuh"\n', 1)
    assert nested != headers["flash_tiles.cuh"]
    with pytest.raises(extract.ExtractError, match="one level deep"):
        extract.extract_device_code(SOURCE.read_text(), {**headers, "flash_tiles.cuh": nested})


# ----------------------------------------------------------------------------------------------
# the backward variants (ATTNKIT_CUDA_SOFTMAX_BWD)
# ----------------------------------------------------------------------------------------------

# The unmasked cases above (the variants compute no mask) and a few with more full tiles, where
# the variants' interior fast path runs (dQ: a warp's 16 rows < N and 64 keys < M; dK/dV: the
# tile's kBr = 32 (D = 128) or 64 (D = 64) queries < N and the warp's 16 keys < M; causal: the
# tile below the diagonal), in GQA groups of 1, 2 and 4.
VARIANT_CASES = [c for c in CASES + ODD_CASES if c.mask is None] + [
    Case(BF16, 128, 1, 4, 2, 200, 190, False),
    Case(F16, 128, 1, 2, 1, 161, 257, True),
    Case(BF16, 64, 1, 4, 1, 257, 129, True),
    Case(F16, 64, 2, 2, 2, 128, 192, False),
]


def test_variant_ids_match_the_source():
    # BWD_VARIANTS is what emu_set_bwd_variant and softmax.cu's host side take.
    enum = re.search(r"enum BwdVariant : int \{([^}]*)\}", SOURCE.read_text()).group(1)
    values = {name: int(v) for name, v in re.findall(r"kBwd(\w+) = (\d+)", enum)}
    assert values == {name.capitalize(): v for name, v in BWD_VARIANTS.items()}


@pytest.mark.parametrize("case", VARIANT_CASES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_reference(emulator, variant, case):
    emulator.configure(seed=21 + VARIANT_CASES.index(case))
    with emulator.bwd_variant(variant):
        out, lse, dq, dk, dv = check(emulator, case)
    if case.m == 0:
        assert torch.equal(dq, torch.zeros_like(dq))
    if case.n == 0:
        assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_uses_its_kernels_and_falls_back_with_a_mask(emulator, variant):
    # Unmasked: the variant's scratch (padded rows; fused: the fp32 dQ) is used, the default's
    # delta is not.  Masked: the default kernels run, bit for bit as without the variant.
    case = Case(F16, 64, 1, 2, 1, 70, 129, True)
    emulator.configure(seed=5)
    with emulator.bwd_variant(variant):
        run_emulated(emulator, case)
    used = {name for name, n in emulator.accesses.items() if n > 0}  # (the harness registers delta anyway)
    assert "lse2/delta2 (scratch)" in used and "delta (scratch)" not in used, used
    assert ("dq_accum (scratch)" in used) == (variant == "fused"), used
    masked = Case(F16, 64, 1, 2, 1, 70, 129, True, mask="bool")
    emulator.configure(seed=5)
    with emulator.bwd_variant(variant):
        results, _ = run_emulated(emulator, masked)
    used = {name for name, n in emulator.accesses.items() if n > 0}
    assert "delta (scratch)" in used and not used & {"lse2/delta2 (scratch)", "dq_accum (scratch)"}, used
    emulator.configure(seed=5)
    default, _ = run_emulated(emulator, masked)
    for x, y in zip(results, default):
        assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_independent_of_warp_schedule(emulator, variant):
    # (fused: the warps add disjoint dQ columns; the emulator runs blocks in a fixed order.)
    case = Case(F16, 64, 1, 2, 1, 70, 129, True)
    results = []
    for seed in (11, 12):
        emulator.configure(seed=seed)
        with emulator.bwd_variant(variant):
            results.append(run_emulated(emulator, case)[0])
    for x, y in zip(*results):
        assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("name", ("q_nan", "k_nan", "k_posinf"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_nonfinite_inputs_like_the_default(emulator, variant, name, causal):
    # The variants' fast path keeps the default's arithmetic: on NaN / inf inputs (the unmasked
    # ones of NONFINITE) they give the default's results bit for bit.
    case = Case(F16, 64, 1, 2, 1, 70, 70, causal)
    results = []
    for v in ("default", variant):
        emulator.configure(seed=5)
        with emulator.bwd_variant(v):
            results.append(run_emulated(emulator, case, edit=lambda *inputs: poison(NONFINITE[name], *inputs))[0])
    for what, x, y in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(torch.isnan(x), torch.isnan(y)), what
        if variant == "stream" or what not in ("dq",):
            assert torch.equal(_bits(x), _bits(y)), what
        else:  # fused: dQ summed over the key tiles in another order (fp32), then rounded
            keep = ~torch.isnan(x)
            assert torch.allclose(x[keep].double(), y[keep].double(), rtol=2e-3, atol=1e-3), what


# The default backward's barrier mutants break the variants too (they share those lines; the
# layout mutants are left out: they break the forward first), and the variants' own mutants:
# each must fail under its variant (seen: NaN in dq / dk, or dq / dk past the tolerance).
SHARED_MUTANTS = ("missing_syncthreads_dq", "missing_syncthreads_dkdv")


@pytest.mark.parametrize("name,variant", [(n, v) for n in SHARED_MUTANTS for v in VARIANTS
                                          if not (n == "missing_syncthreads_dq" and v == "fused")]
                         + list(VARIANT_MUTANT_OF.items()), ids=lambda x: x)
def test_catches_a_broken_variant(builds, name, variant):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with emu.bwd_variant(variant), pytest.raises((AssertionError, EmulatorError)):
        check(emu, MUTANT_CASE)


def test_catches_an_out_of_bounds_dq_accum_add(builds):
    # MUTANT_CASE: N = 70, D = 64 (query tiles of 64): the last tile of head 1 adds row 70 too, one
    # row past the end of dq_accum.
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT["fused_dq_row_guard"])
    with emu.bwd_variant("fused"), pytest.raises(
            EmulatorError, match=r"out-of-bounds access \(read or write\) of 4 bytes at byte offset 358\d\d of "
                                 r"`dq_accum \(scratch\)` \(global memory, 35840 bytes: \d+ bytes past its end\) "
                                 r"\(thread \d+ of block \(\d+, 0, 0\) of softmax_bwd_dkdv_kernel<fused>\)"):
        run_emulated(emu, MUTANT_CASE)


@pytest.mark.parametrize("variant", VARIANTS)
def test_switched_mutants_off_pass_under_the_variants(builds, variant):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=0)
    with emu.bwd_variant(variant):
        check(emu, MUTANT_CASE)

"""The CUDA C++ sparse-attention kernels (csrc/cuda/sparse.cu) run on the CPU by the host emulator.

Like tests/csrc/test_softmax_cuda_emulated.py: cuda_emulator/extract.py cuts the device code out
of sparse.cu, g++ compiles it with cuda_emulator/sparse_harness.cpp (the emulator of harness.cpp:
every CUDA thread a fiber; __syncthreads, shuffles, ldmatrix and mma.m16n8k16 rebuilt from the PTX
ISA; shared memory exact-size and NaN-filled) and the four ops' kernels are called through ctypes
on CPU tensors held in NaN-guarded buffers.  out, lse (forward) and dq, dk, dv (backward, given a
merged lse and a delta) are compared with the float64 references of
pytorch_ext/reference/sparse.py under the rule of DESIGN.md: within 2x the error the reference
itself makes in the inputs' dtype, + 1e-3; infinities must match, NaN never passes.

Covered: range parts (the strided band and columns with N not a multiple of the stride, fixed-like
floor ranges with Nq != Nk, floor division of negative numbers, empty ranges, rows in no group,
different query and key views, several query / key tiles per group) and block-sparse lists (Hl = 1
and H, causal, rows with no block, block 16 / 24 / 32 / 80), fp16 and bf16, D 64 and 128, odd N;
every memory access bounds-checked against its allocation (cuda_emulator/README.md, "Checked
pointers"), with mutants whose bounds are one off.
Not covered: the host side of sparse.cu (checks, copies, launch configuration as nvcc builds it;
sparse_harness.cpp re-creates the launches) and anything about a real GPU:
tests/csrc/test_sparse_cuda.py (``pytest -m gpu``) covers those.
"""
import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attnkit.patterns import block_layout
from attnkit.reference.sparse import (
    block_sparse_bwd_reference,
    block_sparse_reference,
    sparse_range_bwd_reference,
    sparse_range_reference,
)
from attnkit_testing import F64, assert_close_to_reference, finite_inputs, without_spread_nan
from cuda_emulator import emu_build, extract
from cuda_emulator.emu_build import EmulatorError

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
SOURCE = HERE.parents[1] / "csrc" / "cuda" / "sparse.cu"
PAD = 64  # guard elements around every buffer (a multiple of 8: rows stay 16-byte aligned)
NONE_HI = 2**40  # "no upper bound" as the lead writes it

# Deliberate bugs (old -> new, `{on}`: 1 while the bug is switched on, else 0), applied to the
# extracted device code: the tests must catch them.
MUTATIONS = {
    # floor division done as C++'s truncating `/` (wrong for a negative t + a).
    "truncating_division": (
        "return x >= 0 ? x / d : -((-x + d - 1) / d);",
        "return x >= 0 || {on} ? x / d : -((-x + d - 1) / d);",
    ),
    # dK/dV: no barrier before the next Q/dO tiles overwrite the ones other warps still read.
    "missing_syncthreads": (
        "    __syncthreads();  // every warp is done with the previous Q/dO tiles (k_s, v_s: written before)\n",
        ("    if (!{on}) __syncthreads();  // every warp is done with the previous Q/dO tiles (k_s, v_s: written "
         "before)\n"),
    ),
    # block lists: the causal test inside listed blocks dropped in the forward / dQ walk.
    "no_causal_in_blocks": (
        "return c < k_valid && w.listed(e, c) && !(w.causal && w.o0 + c > w.own[e]);",
        "return c < k_valid && w.listed(e, c) && ({on} || !(w.causal && w.o0 + c > w.own[e]));",
    ),
}
# Out-of-bounds accesses, which the checked pointers must stop (BOUNDS_MUTANTS): bounds one off.
BOUNDS_MUTATIONS = {
    # the block-list walk's loop bound: it reads the entry after a row's list (for the last row
    # of the last layout head: past the end of col_idx).
    "list_loop_bound": (
        "for (int c = cur[i]; c < end[i] && idx[c] <= ob1; ++c)",
        "for (int c = cur[i]; c < end[i] + {on} && idx[c] <= ob1; ++c)",
    ),
    # dK/dV: the lse row guard: the query row after the tile's last valid one reads lse (past its
    # end in the last tile); the value is never used, no output changes.
    "dkdv_lse_row_guard": (
        "lse_s[idx] = idx < w.q_valid ? lse_log2(p.lse[i]) : INFINITY;",
        "lse_s[idx] = idx < w.q_valid + {on} ? lse_log2(p.lse[i]) : INFINITY;",
    ),
    # dK/dV epilogue (flash_tiles.cuh's store_dk_dv): the row guard, a write past the end of dk.
    "store_row_guard": (
        "    if (local + 8 * r < valid) {\n      const int64_t j = base",
        "    if (local + 8 * r < valid + {on}) {\n      const int64_t j = base",
    ),
}
# Every deliberate bug is in one build ("switched", built for fp16, D = 64
# only), each on while configure(mutant=MUTANT[name]) (see emu_build.session_builds).
SWITCHED = {**MUTATIONS, **BOUNDS_MUTATIONS}
MUTANT = emu_build.switched_ids(SWITCHED)


# ----------------------------------------------------------------------------------------------
# building and calling the emulator
# ----------------------------------------------------------------------------------------------


_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_i64x = ctypes.POINTER(ctypes.c_int64)


def _i64(values):
    return (ctypes.c_int64 * len(values))(*values)


def _p(x):
    return None if x is None or x.numel() == 0 else x.data_ptr()


class Emulator(emu_build.Library):
    def __init__(self, path: Path):
        super().__init__(path)
        lib = self.lib
        rng = [_int] * 4 + [_i64x] * 3 + [_float]  # B, H, Nq, Nk, view, lo, hi, scale
        lib.emu_sparse_range_fwd.argtypes = [_int, _int] + [_ptr] * 5 + rng
        lib.emu_sparse_range_fwd32.argtypes = [_int, _int] + [_ptr] * 5 + rng
        lib.emu_sparse_range_bwd.argtypes = [_int, _int] + [_ptr] * 9 + rng
        lib.emu_block_sparse_fwd.argtypes = [_int, _int] + [_ptr] * 5 + [_int] * 3 + [_ptr] * 2 + [_int] * 3 + [_float]
        lib.emu_block_sparse_bwd.argtypes = ([_int, _int] + [_ptr] * 9 + [_int] * 3 + [_ptr] * 4 + [_int] * 3
                                                + [_float])
        for f in ("emu_sparse_range_fwd", "emu_sparse_range_fwd32", "emu_sparse_range_bwd", "emu_block_sparse_fwd",
                  "emu_block_sparse_bwd"):
            getattr(lib, f).restype = _int


# Session fixtures: builds (the full emulator and the mutants, all started at once), emulator.
builds, emulator = emu_build.session_fixtures("cuda_emulator_sparse", SOURCE, EMULATOR / "sparse_harness.cpp",
                                              "sparse_kernels.inc", {}, ("EMU_ONLY_F16_D64",), Emulator, SWITCHED)


# ----------------------------------------------------------------------------------------------
# guarded buffers
# ----------------------------------------------------------------------------------------------


class Guarded:
    """A contiguous tensor in the middle of a flat buffer, with PAD guard elements on each side."""

    def __init__(self, shape, dtype, fill):
        numel = math.prod(shape)
        self.buffer = torch.full((numel + 2 * PAD,), fill, dtype=dtype)
        self.tensor = self.buffer[PAD:PAD + numel].view(shape)

    def bits(self):
        return _bits(self.buffer).clone()

    def guards_intact(self):
        guards = torch.cat([self.buffer[:PAD], self.buffer[-PAD:]])
        return bool(torch.isnan(guards).all()) if guards.is_floating_point() else True


def _bits(x):
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _guarded_copy(x, fill=float("nan")):
    g = Guarded(tuple(x.shape), x.dtype, fill)
    g.tensor.copy_(x)
    return g


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

F16, BF16 = torch.float16, torch.bfloat16


@dataclass(frozen=True)
class RangeCase:
    name: str
    dtype: torch.dtype
    d: int
    b: int
    h: int
    nq: int
    nk: int
    view: tuple
    lo: tuple
    hi: tuple

    def __str__(self):
        return f"{self.name}-{str(self.dtype)[6:]}-D{self.d}-B{self.b}H{self.h}-Nq{self.nq}Nk{self.nk}"


@dataclass(frozen=True)
class BlockCase:
    name: str
    dtype: torch.dtype
    d: int
    b: int
    h: int
    hl: int
    block: int
    nb: int
    causal: bool
    density: float = 0.5

    def __str__(self):
        c = "-causal" if self.causal else ""
        return f"{self.name}-{str(self.dtype)[6:]}-D{self.d}-B{self.b}H{self.h}Hl{self.hl}-blk{self.block}x{self.nb}{c}"


V1 = (1, 0, 1, 0, 1)  # the plain view: one group, every row


def _strided_view(s):
    return (s, 1, s, 1, s)


# The lead's decompositions (see the sparse spec), at emulator sizes.  Tiles are 64 rows, so
# groups of 75 / 150 rows need several query and key tiles; N is no multiple of the stride.
RANGE_CASES = [
    # strided causal, s = 8: band (one group, several tiles) + columns on the strided view
    RangeCase("band_causal", F16, 64, 1, 2, 150, 150, V1, (-8, 1, 1, 0), (0, 1, 1, 0)),
    RangeCase("columns_causal", BF16, 64, 2, 1, 150, 150, _strided_view(8), (0, 1, 0, 0), (-2, 1, 1, 0)),
    # s = 2: 75 rows per group (two tiles each way), D = 128
    RangeCase("columns_causal_s2", F16, 128, 1, 1, 150, 150, _strided_view(2), (0, 1, 0, 0), (-2, 1, 1, 0)),
    # strided non-causal: band |t - t'| <= s, columns below t - 2 and above t + 2 (no upper bound)
    RangeCase("band_noncausal", BF16, 128, 1, 2, 100, 100, V1, (-8, 1, 1, 0), (8, 1, 1, 0)),
    RangeCase("columns_low", F16, 64, 1, 1, 131, 131, _strided_view(4), (0, 1, 0, 0), (-2, 1, 1, 0)),
    RangeCase("columns_high", BF16, 64, 1, 1, 131, 131, _strided_view(4), (2, 1, 1, 0), (0, 1, 0, NONE_HI)),
    # fixed causal, stride l = 24 (floor ranges, tiles not aligned to blocks), summary c = 3:
    # own block, then the gathered summary columns (Nk = 3 per block of 24, Nq != Nk)
    RangeCase("fixed_own_block", F16, 64, 1, 1, 130, 130, V1, (0, 24, 24, 0), (0, 1, 1, 0)),
    RangeCase("fixed_summary", BF16, 64, 1, 2, 130, 18, V1, (0, 1, 0, 0), (0, 24, 3, -1)),
    # floor division of negative numbers (d > 1, t + a < 0) on both bounds
    RangeCase("negative_floor", F16, 128, 1, 1, 90, 80, V1, (-7, 3, 2, 5), (-9, 2, 3, 12)),
    # groups that cover only some rows (3 of 8 residues): the others give 0 / -inf / zero grads
    RangeCase("partial_groups", BF16, 64, 1, 1, 100, 100, (3, 1, 8, 1, 8), (-2, 1, 1, 0), (1, 1, 1, 0)),
    # queries and keys on different strided views (q: residues mod 4, k: even residues mod 8), Nk != Nq
    RangeCase("strided_keys", F16, 64, 1, 1, 130, 120, (4, 1, 4, 2, 8), (-5, 1, 1, 0), (3, 1, 1, 0)),
    # every range empty (lo > hi): all rows 0 / -inf, all grads 0
    RangeCase("empty", BF16, 64, 1, 1, 70, 70, V1, (5, 1, 1, 0), (3, 1, 1, 0)),
]

BLOCK_CASES = [
    BlockCase("b16", F16, 64, 1, 2, 1, 16, 9, False),
    BlockCase("b16_causal_heads", BF16, 64, 1, 2, 2, 16, 8, True, 0.6),
    BlockCase("b24_causal", F16, 128, 1, 1, 1, 24, 6, True, 0.7),
    BlockCase("b32_heads", BF16, 128, 1, 2, 2, 32, 5, False, 0.4),
    BlockCase("b80_causal", F16, 64, 1, 1, 1, 80, 3, True, 0.8),
]


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g).to(dtype)


def _bwd_inputs(out64, lse64, g):
    """dout, and a merged lse / delta as the lead passes them: lse >= the part's (other parts
    add mass; finite even where this part has no key), delta = rowsum(dO O) - dlse."""
    dout = torch.randn(out64.shape, generator=g)
    lse = torch.where(torch.isinf(lse64), torch.full_like(lse64, 0.7), lse64 + 0.5 * torch.rand(lse64.shape, generator=g))
    delta = (dout.double() * out64).sum(-1) - 0.3 * torch.randn(lse64.shape, generator=g)
    return dout, lse.float(), delta.float()


def _run_case(emu, kind, bf16, d, inputs, outs, args, buffers):
    """Calls the emulator with guarded buffers (buffers: {name: Guarded}, the allocations the
    checked pointers are checked against); checks guards and unchanged inputs."""
    before = [x.bits() for x in inputs]
    fn = getattr(emu.lib, f"emu_{kind}")
    with emu.buffers(**{name: x.tensor for name, x in buffers.items()}):
        emu.check(fn(bf16, d, *args), kind)
    for x in outs:
        assert x.guards_intact(), f"{kind}: an output was written outside its bounds"
    for x, bits in zip(inputs, before):
        assert torch.equal(x.bits(), bits), f"{kind}: an input (or its guard) was written"


def run_range(emu, case: RangeCase, seed=0, edit=None):
    """``edit(q, k, v)`` may change the inputs first."""
    g = torch.Generator().manual_seed(seed)
    b, h, nq, nk, d, dtype = case.b, case.h, case.nq, case.nk, case.d, case.dtype
    scale = 1.0 / math.sqrt(d)
    q, k, v = _randn((b, h, nq, d), dtype, g), _randn((b, h, nk, d), dtype, g), _randn((b, h, nk, d), dtype, g)
    if edit is not None:
        edit(q, k, v)
    ref_out, ref_lse = sparse_range_reference(q.double(), k.double(), v.double(), case.view, case.lo, case.hi, scale)
    dout, lse, delta = _bwd_inputs(ref_out, ref_lse, g)
    dout = dout.to(dtype)
    gq, gk, gv, gdo = (_guarded_copy(x) for x in (q, k, v, dout))
    glse, gdelta = _guarded_copy(lse), _guarded_copy(delta)
    out, olse = Guarded((b, h, nq, d), dtype, float("nan")), Guarded((b, h, nq), torch.float32, float("nan"))
    dq, dk, dv = (Guarded(shape, dtype, float("nan")) for shape in ((b, h, nq, d), (b, h, nk, d), (b, h, nk, d)))
    bf16 = int(dtype == BF16)
    geo = [b, h, nq, nk, _i64(case.view), _i64(case.lo), _i64(case.hi), scale]
    _run_case(emu, "sparse_range_fwd", bf16, d, [gq, gk, gv], [out, olse],
              [_p(gq.tensor), _p(gk.tensor), _p(gv.tensor), _p(out.tensor), _p(olse.tensor)] + geo,
              {"q": gq, "k": gk, "v": gv, "out": out, "lse": olse})
    _run_case(emu, "sparse_range_bwd", bf16, d, [gq, gk, gv, gdo, glse, gdelta], [dq, dk, dv],
              [_p(gdo.tensor), _p(gq.tensor), _p(gk.tensor), _p(gv.tensor), _p(glse.tensor), _p(gdelta.tensor),
               _p(dq.tensor), _p(dk.tensor), _p(dv.tensor)] + geo,
              {"dout": gdo, "q": gq, "k": gk, "v": gv, "lse": glse, "delta": gdelta, "dq": dq, "dk": dk, "dv": dv})
    results = (out.tensor, olse.tensor, dq.tensor, dk.tensor, dv.tensor)

    def reference(dt, finite=False):
        # finite: from finite_inputs (the second run of without_spread_nan, issue 24)
        qq, kk, vv, ll, dd = (t.to(dt) for t in (q, k, v, lse, delta))
        if finite:
            qq, kk, vv, ll, dd = finite_inputs(qq, kk, vv, ll, dd)
        o, l = sparse_range_reference(qq, kk, vv, case.view, case.lo, case.hi, scale)
        grads = sparse_range_bwd_reference(dout.to(dt), qq, kk, vv, ll, dd, case.view, case.lo, case.hi, scale)
        return (o, l) + tuple(grads)

    return results, reference


def _layout(case: BlockCase, g):
    lay = torch.rand(case.hl, case.nb, case.nb, generator=g) < case.density
    lay[:, :, 0] |= torch.rand(case.hl, case.nb, generator=g) < 0.5
    lay[0, 1] = False  # a query block with no key block: rows 0 / -inf
    if case.causal:  # keep some blocks above the diagonal: the causal test inside blocks must drop them
        lay[0, 0, 0] = True
    return lay


def run_block(emu, case: BlockCase, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h, d, dtype, block = case.b, case.h, case.d, case.dtype, case.block
    n = block * case.nb
    scale = 1.0 / math.sqrt(d)
    lay = _layout(case, g)
    # The layout's lists as the op layer builds them, all blocks kept (causal=False there): with
    # case.causal the kernels get blocks above the diagonal too, and must drop them themselves.
    row_ptr, col_idx, col_ptr, row_idx = block_layout(lay, block).index_lists()
    q, k, v = (_randn((b, h, n, d), dtype, g) for _ in range(3))
    ref_out, ref_lse = block_sparse_reference(q.double(), k.double(), v.double(), row_ptr, col_idx, block,
                                                 case.causal, scale)
    dout, lse, delta = _bwd_inputs(ref_out, ref_lse, g)
    dout = dout.to(dtype)
    gq, gk, gv, gdo = (_guarded_copy(x) for x in (q, k, v, dout))
    glse, gdelta = _guarded_copy(lse), _guarded_copy(delta)
    lists = [_guarded_copy(x, 0) for x in (row_ptr, col_idx, col_ptr, row_idx)]
    out, olse = Guarded((b, h, n, d), dtype, float("nan")), Guarded((b, h, n), torch.float32, float("nan"))
    dq, dk, dv = (Guarded((b, h, n, d), dtype, float("nan")) for _ in range(3))
    bf16 = int(dtype == BF16)
    tail = [case.hl, block, int(case.causal), scale]
    names = dict(zip(("row_ptr", "col_idx", "col_ptr", "row_idx"), lists))
    _run_case(emu, "block_sparse_fwd", bf16, d, [gq, gk, gv] + lists, [out, olse],
              [_p(gq.tensor), _p(gk.tensor), _p(gv.tensor), _p(out.tensor), _p(olse.tensor), b, h, n,
               _p(lists[0].tensor), _p(lists[1].tensor)] + tail,
              {"q": gq, "k": gk, "v": gv, "out": out, "lse": olse, "row_ptr": lists[0], "col_idx": lists[1]})
    _run_case(emu, "block_sparse_bwd", bf16, d, [gq, gk, gv, gdo, glse, gdelta] + lists, [dq, dk, dv],
              [_p(gdo.tensor), _p(gq.tensor), _p(gk.tensor), _p(gv.tensor), _p(glse.tensor), _p(gdelta.tensor),
               _p(dq.tensor), _p(dk.tensor), _p(dv.tensor), b, h, n] + [_p(x.tensor) for x in lists] + tail,
              {"dout": gdo, "q": gq, "k": gk, "v": gv, "lse": glse, "delta": gdelta, "dq": dq, "dk": dk, "dv": dv,
               **names})
    results = (out.tensor, olse.tensor, dq.tensor, dk.tensor, dv.tensor)

    def reference(dt):
        o, l = block_sparse_reference(q.to(dt), k.to(dt), v.to(dt), row_ptr, col_idx, block, case.causal, scale)
        grads = block_sparse_bwd_reference(dout.to(dt), q.to(dt), k.to(dt), v.to(dt), lse.to(dt), delta.to(dt),
                                              row_ptr, col_idx, block, case.causal, scale)
        return (o, l) + tuple(grads)

    return results, reference


def check(emu, case, seed=0):
    run = run_range if isinstance(case, RangeCase) else run_block
    results, reference = run(emu, case, seed)
    ref64, ref_low = reference(F64), reference(case.dtype)
    for name, x, r64, rlow in zip(("out", "lse", "dq", "dk", "dv"), results, ref64, ref_low):
        assert_close_to_reference(x, r64, rlow, name=f"{name} [{case}]", dtype=case.dtype)
    return results


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", RANGE_CASES, ids=str)
def test_range_part_matches_reference(emulator, case):
    emulator.configure(seed=1 + RANGE_CASES.index(case))
    out, lse, dq, dk, dv = check(emulator, case)
    if case.name == "empty":
        assert torch.isneginf(lse).all()
        for x in (out, dq, dk, dv):
            assert torch.equal(x, torch.zeros_like(x))
    if case.name == "partial_groups":  # rows 3..7 mod 8 are in no group
        rows = [i for i in range(case.nq) if i % 8 >= 3]
        assert torch.isneginf(lse[..., rows]).all()
        for x in (out, dq, dk, dv):
            assert torch.equal(x[..., rows, :], torch.zeros_like(x[..., rows, :]))
    if case.name == "columns_causal":  # t = 0, 1 of every group: an empty range (hi = t - 2 < 0)
        assert torch.isneginf(lse[..., :16]).all()


@pytest.mark.parametrize("case", [c for c in RANGE_CASES if c.name in ("band_noncausal", "fixed_summary",
                                                                       "partial_groups", "strided_keys")], ids=str)
def test_range_part_float32_out(emulator, case):
    # float32_out (a part that the pattern's merge rounds once): the same lse, an out that rounds
    # to the 16-bit call's bit for bit (the kernel's one store differs), rows outside every group 0.
    emulator.configure(seed=7)
    (out16, lse16, *_), reference = run_range(emulator, case)
    g = torch.Generator().manual_seed(0)  # run_range's inputs (its first draws)
    b, h, nq, nk, d, dtype = case.b, case.h, case.nq, case.nk, case.d, case.dtype
    q, k, v = _randn((b, h, nq, d), dtype, g), _randn((b, h, nk, d), dtype, g), _randn((b, h, nk, d), dtype, g)
    gq, gk, gv = (_guarded_copy(x) for x in (q, k, v))
    out, lse = Guarded((b, h, nq, d), torch.float32, float("nan")), Guarded((b, h, nq), torch.float32, float("nan"))
    _run_case(emulator, "sparse_range_fwd32", int(dtype == BF16), d, [gq, gk, gv], [out, lse],
              [_p(gq.tensor), _p(gk.tensor), _p(gv.tensor), _p(out.tensor), _p(lse.tensor), b, h, nq, nk,
               _i64(case.view), _i64(case.lo), _i64(case.hi), 1.0 / math.sqrt(d)],
              {"q": gq, "k": gk, "v": gv, "out": out, "lse": lse})
    assert torch.equal(lse.tensor, lse16)
    assert torch.equal(out.tensor.to(dtype), out16)
    ref64 = reference(F64)[0]
    assert_close_to_reference(out.tensor, ref64, reference(dtype)[0], name=f"out [{case}]", dtype=dtype)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
def test_block_sparse_matches_reference(emulator, case):
    emulator.configure(seed=101 + BLOCK_CASES.index(case))
    out, lse, dq, dk, dv = check(emulator, case)
    rows = slice(case.block, 2 * case.block)  # query block 1 of layout head 0 lists no key block
    assert torch.isneginf(lse[:, 0, rows]).all()
    assert torch.equal(out[:, 0, rows], torch.zeros_like(out[:, 0, rows]))
    assert torch.equal(dq[:, 0, rows], torch.zeros_like(dq[:, 0, rows]))


# Issue 15: a NaN query poisons its row (and the gradients of the keys it sees), a NaN key the
# rows that see it; rows that do not see them stay finite.  Band, causal, s = 8: query i sees
# keys i - 8 .. i.
@pytest.mark.parametrize("name, edit, rows", [
    ("q_nan", lambda q, k, v: q[0, 1, 70].__setitem__(4, float("nan")), [(1, 70)]),
    ("k_nan", lambda q, k, v: k[0, 0, 100].__setitem__(0, float("nan")), [(0, i) for i in range(100, 109)]),
], ids=lambda x: x if isinstance(x, str) else "")
def test_nonfinite_inputs_propagate_like_the_reference(emulator, name, edit, rows):
    case = RANGE_CASES[0]
    emulator.configure(seed=3)
    results, reference = run_range(emulator, case, edit=edit)
    ref64 = reference(F64)
    for what, x, r in zip(("out", "lse", "dq", "dk", "dv"), results, ref64):
        nan_x, nan_ref = torch.isnan(x), torch.isnan(r)
        if what.startswith("d"):
            # 0 * NaN in dQ = dS K and dK = dSᵀ Q (dS = 0 on hidden entries, a NaN in k or q) may
            # reach more rows than the reference's NaN rows, tile by tile: within the reference's.
            assert not (nan_x & ~nan_ref).any(), f"{what}: NaN where the reference has none"
            for h, i in rows:
                seen = slice(i, i + 1) if what == "dq" else slice(max(0, i - 8), i + 1)
                assert nan_x[0, h, seen].all(), f"{what}: lost the NaN of row {i}"
        else:
            assert torch.equal(nan_x, nan_ref), f"{what}: NaN at {nan_x.sum()} entries, reference {nan_ref.sum()}"
            hit = nan_x.reshape(*nan_x.shape[:3], -1).any(-1)
            assert sorted(map(tuple, hit[0].nonzero().tolist())) == rows, what
        keep = ~(nan_x | nan_ref)
        # The low-precision run sets the tolerance only: without the NaN a torch matmul can
        # spread between rows (bfloat16 on AMX, issue 24).
        low = without_spread_nan(reference(case.dtype), reference(case.dtype, finite=True))
        low = low[("out", "lse", "dq", "dk", "dv").index(what)]
        assert_close_to_reference(torch.where(keep, x.double(), 0.0), torch.where(keep, r, 0.0),
                                  torch.where(keep, low.double(), 0.0).to(case.dtype),
                                  name=what, dtype=case.dtype, grad=what.startswith("d"))


def test_independent_of_warp_schedule(emulator):
    # No atomics, barriers in the right places: another warp order gives the same bits.
    for case in (RANGE_CASES[2], BLOCK_CASES[2]):
        run = run_range if isinstance(case, RangeCase) else run_block
        emulator.configure(seed=11)
        first, _ = run(emulator, case)
        emulator.configure(seed=12)
        second, _ = run(emulator, case)
        for x, y in zip(first, second):
            assert torch.equal(_bits(x), _bits(y))


MUTANT_CASES = {
    "truncating_division": RangeCase("negative_floor", F16, 64, 1, 1, 90, 80, V1, (-7, 3, 2, 5), (-9, 2, 3, 12)),
    "missing_syncthreads": RangeCase("band_causal", F16, 64, 1, 1, 150, 150, V1, (-40, 1, 1, 0), (0, 1, 1, 0)),
    "no_causal_in_blocks": BlockCase("b16_causal", F16, 64, 1, 1, 1, 16, 8, True, 0.6),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_catches_a_broken_kernel(builds, name):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with pytest.raises((AssertionError, EmulatorError)):
        check(emu, MUTANT_CASES[name])


def test_mutant_cases_pass_unmutated(emulator):
    # The cases that catch the mutants pass on the real kernels (so what fails there is the bug).
    emulator.configure(seed=3)
    for case in list(MUTANT_CASES.values()) + [case for case, _ in BOUNDS_MUTANTS.values()]:
        check(emulator, case)


def test_switched_mutants_off_pass(builds):
    # The switched build with every bug off is the kernel file: the mutants' cases pass.
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=0)
    for case in list(MUTANT_CASES.values()) + [case for case, _ in BOUNDS_MUTANTS.values()]:
        check(emu, case)


# The out-of-bounds mutants: (case, the message).  The launch must stop at the first bad access,
# naming the access, the buffer, the kernel and the thread.
BOUNDS_MUTANTS = {
    "list_loop_bound": (
        BlockCase("b16_causal", F16, 64, 1, 2, 2, 16, 5, True, 0.6),
        (r"out-of-bounds read of 4 bytes at byte offset \d+ of `col_idx` \(global memory, \d+ bytes: 4 bytes past "
         r"its end\) \(thread \d+ of block \(\d+, 1, 0\) of sparse_fwd_kernel\)"),
    ),
    "dkdv_lse_row_guard": (
        RangeCase("band_causal", F16, 64, 1, 2, 100, 100, V1, (-8, 1, 1, 0), (0, 1, 1, 0)),
        (r"out-of-bounds read of 4 bytes at byte offset 800 of `lse` \(global memory, 800 bytes: 4 bytes past its "
         r"end\) \(thread \d+ of block \(0, 1, 0\) of sparse_bwd_dkdv_kernel\)"),
    ),
    "store_row_guard": (
        RangeCase("band_causal", F16, 64, 1, 2, 100, 100, V1, (-8, 1, 1, 0), (0, 1, 1, 0)),
        (r"out-of-bounds access \(read or write\) of 4 bytes at byte offset 25600 of `dk` \(global memory, 25600 "
         r"bytes: 4 bytes past its end\) \(thread \d+ of block \(1, 1, 0\) of sparse_bwd_dkdv_kernel\)"),
    ),
}


@pytest.mark.parametrize("name", BOUNDS_MUTATIONS)
def test_catches_an_out_of_bounds_access(builds, name):
    case, message = BOUNDS_MUTANTS[name]
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with pytest.raises(EmulatorError, match=message):
        (run_range if isinstance(case, RangeCase) else run_block)(emu, case)


def test_every_buffer_goes_through_the_checks(emulator):
    # Every buffer the kernels get is accessed through checked pointers (none is reached by a raw
    # pointer the rewriting missed).
    emulator.configure(seed=5)
    run_block(emulator, BLOCK_CASES[0])
    names = {"dout", "q", "k", "v", "lse", "delta", "dq", "dk", "dv", "row_ptr", "col_idx", "col_ptr", "row_idx"}
    assert set(emulator.accesses) == names
    assert all(n > 0 for n in emulator.accesses.values()), emulator.accesses
    run_range(emulator, RANGE_CASES[0])
    assert set(emulator.accesses) == names - {"row_ptr", "col_idx", "col_ptr", "row_idx"}
    assert all(n > 0 for n in emulator.accesses.values()), emulator.accesses


# Odd sizes (DESIGN.md) at both head dims, on the band of a causal strided pattern (block lists
# need N to be a multiple of the block): every access bounds-checked.
ODD_CASES = [RangeCase("band_causal", F16 if i % 2 else BF16, d, 1, 2, n, n, V1, (-8, 1, 1, 0), (0, 1, 1, 0))
             for d in (64, 128) for i, n in enumerate((1, 7, 63, 129))]


@pytest.mark.parametrize("case", ODD_CASES, ids=str)
def test_odd_sizes(emulator, case):
    emulator.configure(seed=7)
    check(emulator, case)


def test_extract_refuses_a_second_copy_of_a_ptx_helper():
    # sparse.cu takes its PTX helpers from mma_sm80.cuh; a copy of one pasted back into the .cu
    # (two definitions: the emulator would stand in for only one of them) stops the extraction.
    source, headers = SOURCE.read_text(), extract.included_headers(SOURCE)
    header = headers["mma_sm80.cuh"]
    start = header.index("__device__ __forceinline__ float exp2_approx(float x) {")
    copy = header[start:header.index("\n}\n", start) + 3]
    changed = source.replace("namespace {\n", "namespace {\n\n" + copy, 1)
    assert changed != source
    extract.extract_device_code(source, headers, name="sparse.cu")
    with pytest.raises(extract.ExtractError, match=r"exp2_approx\(\) in sparse.cu \+ mma_sm80.cuh \+ flash_tiles.cuh, found 2"):
        extract.extract_device_code(changed, headers, name="sparse.cu")


def test_extract_refuses_a_changed_exp2():
    # ex2.approx without .ftz would keep subnormal results, which the emulation flushes to zero.
    headers = extract.included_headers(SOURCE)
    changed = headers["mma_sm80.cuh"].replace("ex2.approx.ftz.f32", "ex2.approx.f32", 1)
    assert changed != headers["mma_sm80.cuh"]
    with pytest.raises(extract.ExtractError, match="exp2_approx"):
        extract.extract_device_code(SOURCE.read_text(), {**headers, "mma_sm80.cuh": changed}, name="sparse.cu")

"""The CUDA C++ linear-attention kernels (csrc/cuda/linear.cu) run on the CPU by the host emulator.

Like tests/csrc/test_softmax_cuda_emulated.py: cuda_emulator/extract.py cuts the device code out
of linear.cu (from ``namespace attnkit {`` to the "host side" banner, with mma_sm80.cuh inlined),
replaces its inline-PTX helpers (mma16816, ldsm_x4, ldsm_x4_trans, exp2_approx) by the emulated
ones of cuda_emulator/harness.cpp after checking that they still issue the PTX the emulation
models, and g++
compiles it with cuda_emulator/linear_harness.cpp (every CUDA thread a fiber; __syncthreads,
shuffles, ldmatrix and mma.m16n8k16 rebuilt from the PTX ISA; shared memory exact-size and
NaN-filled; the launches as linear.cu's host side makes them).  The kernels are called through
ctypes on CPU tensors held in NaN-guarded buffers.

Checked against the float64 reference (pytorch_ext/reference/linear.py) with the rule of
DESIGN.md (within 2x the error the reference makes in the inputs' dtype, + 1e-3): out, dq, dk,
dv for float16 and bfloat16 (the tensor-core path), causal and not, the three feature maps,
normalize or not, N not a multiple of the 64-row chunk, Dv != D, D and Dv over 64 (two column
blocks); with an initial state and gradients of every output, also den, S, z, dS0, dz0 against
the recurrent form.  Every memory access is bounds-checked against its allocation, the harness's
scratch included (cuda_emulator/README.md, "Checked pointers"), with mutants whose bounds are one
off.  Not covered: the host side of linear.cu (checks, copies, launches as nvcc
builds them), the float32 / float64 kernels (CUDA cores), nvcc's own compilation and anything
about a real GPU: tests/csrc/test_linear_cuda.py (``pytest -m gpu``) covers those.
"""
import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attnkit.reference.linear import linear_attention_reference
from attnkit_testing import F64, assert_close_to_reference, finite_inputs, state_reference, without_spread_nan
from cuda_emulator import emu_build, extract
from cuda_emulator.emu_build import EmulatorError

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
SOURCE = HERE.parents[1] / "csrc" / "cuda" / "linear.cu"
PAD = 64  # guard elements around every buffer
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# Deliberate bugs (old -> new, `{on}`: 1 while the bug is switched on, else 0), applied to the
# extracted device code: the tests must catch them.
MUTATIONS = {
    # the intra-chunk causal mask one off: a query no longer sees its own key (and dk/dv alike).
    "mask_off_by_one": (
        "const bool keep = kLower ? c <= r : c >= r;",
        "const bool keep = kLower ? c <= r - {on} : c >= r + {on};",
    ),
    # state_fwd: no barrier before the next chunk's K/V tiles overwrite the ones other warps read.
    "missing_syncthreads": (
        "    column_parts(zparts, kt);\n    __syncthreads();\n  }",
        "    column_parts(zparts, kt);\n    if (!{on}) __syncthreads();\n  }",
    ),
    # state_fwd: the per-chunk states Zs stored before adding the previous chunk's parts (the
    # causal den).  (Dropping the last chunk's parts from z_final instead fails 11 reference
    # tests, the initial-state ones; this case returns no z.)
    "z_parts_late": (
        "    if (t > 0 && tid < kT) z += column_sum(zparts, tid);  // chunk t - 1's",
        "    if (!{on} && t > 0 && tid < kT) z += column_sum(zparts, tid);",
    ),
    # state_bwd: the per-chunk reverse sums w stored before adding the previous chunk's parts.
    "w_parts_late": (
        "    if (t < nt - 1 && tid < kT) w += column_sum(wparts, tid);  // chunk t + 1's",
        "    if (!{on} && t < nt - 1 && tid < kT) w += column_sum(wparts, tid);",
    ),
}
# Out-of-bounds accesses, which the checked pointers must stop (BOUNDS_MESSAGES): bounds one off.
BOUNDS_MUTATIONS = {
    # the chunk tile load's row guard: the row after the chunk's last one is read (for the last
    # chunk of the last (batch, head): past the end of k).
    "tile_row_guard": (
        "    if (src != nullptr && r < rows && c < cols) regs.v[u] = src[r * sr + c * sc];",
        "    if (src != nullptr && r < rows + {on} && c < cols) regs.v[u] = src[r * sr + c * sc];",
    ),
    # load_tile's row guard (the chunk kernels' one-shot tile loads): the row after the chunk's
    # last one is read.
    "chunk_tile_row_guard": (
        "    if (src != nullptr && r < rows && c < cols) raw[u] = src[r * sr + c * sc];",
        "    if (src != nullptr && r < rows + {on} && c < cols) raw[u] = src[r * sr + c * sc];",
    ),
    # the output epilogue's row guard: a row written past the chunk (past the end of out).
    "store_row_guard": (
        "    if (r < rows && c < cols) out[r * ld + c] = from_acc<T>(f(acc.v[i][j], r, c));",
        "    if (r < rows + {on} && c < cols) out[r * ld + c] = from_acc<T>(f(acc.v[i][j], r, c));",
    ),
}
# Every deliberate bug is in one build ("switched", built for float16
# only), each on while configure(mutant=MUTANT[name]) (see emu_build.session_builds).
SWITCHED = {**MUTATIONS, **BOUNDS_MUTATIONS}
MUTANT = emu_build.switched_ids(SWITCHED)


# ----------------------------------------------------------------------------------------------
# building and calling the emulator
# ----------------------------------------------------------------------------------------------


_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_i64x = ctypes.POINTER(ctypes.c_int64)


def _p(x):
    return None if x is None or x.numel() == 0 else x.data_ptr()


def _strides(x):
    return (ctypes.c_int64 * 4)(*x.stride()) if x is not None else None


class Emulator(emu_build.Library):
    def __init__(self, path: Path):
        super().__init__(path)
        lib = self.lib
        head = [_int, ctypes.POINTER(_int), _float, _float]
        lib.emu_linear_fwd.argtypes = head + [_ptr, _i64x] * 3 + [_ptr] * 6
        lib.emu_linear_bwd.argtypes = head + [_ptr, _i64x] + [_ptr] * 3 + [_ptr, _i64x] * 4 + [_ptr] * 10
        lib.emu_linear_fwd.restype = lib.emu_linear_bwd.restype = _int
        fms = (_int * 3)()
        lib.emu_linear_feature_maps(fms)
        self.feature_maps = dict(zip(("elu", "relu", "identity"), fms))

    def _head(self, q, v, k, kw):
        b, h, n, d = q.shape
        shape = (_int * 9)(b, h, n, k.shape[2], d, v.shape[3], self.feature_maps[kw["feature_map"]],
                           int(kw["causal"]), int(kw["normalize"]))
        return [int(q.dtype == BF16), shape, kw["eps"], kw["scale"]]

    def forward(self, q, k, v, s0, z0, kw, out, den, s, z):
        with self.buffers(q=q, k=k, v=v, S0=s0, z0=z0, out=out, den=den, S=s, z=z):
            rc = self.lib.emu_linear_fwd(*self._head(q, v, k, kw), _p(q), _strides(q), _p(k), _strides(k), _p(v),
                                         _strides(v), _p(s0), _p(z0), _p(out), _p(den), _p(s), _p(z))
            self.check(rc, "forward")

    def backward(self, g, gden, gs, gz, q, k, v, out, den, s, z, s0, z0, kw, dq, dk, dv, ds0, dz0):
        with self.buffers(grad_out=g, grad_den=gden, grad_S=gs, grad_z=gz, q=q, k=k, v=v, out=out, den=den, S=s,
                          z=z, S0=s0, z0=z0, dq=dq, dk=dk, dv=dv, dS0=ds0, dz0=dz0):
            rc = self.lib.emu_linear_bwd(*self._head(q, v, k, kw), _p(g), _strides(g), _p(gden), _p(gs), _p(gz),
                                         _p(q), _strides(q), _p(k), _strides(k), _p(v), _strides(v), _p(out),
                                         _strides(out), _p(den), _p(s), _p(z), _p(s0), _p(z0), _p(dq), _p(dk),
                                         _p(dv), _p(ds0), _p(dz0))
            self.check(rc, "backward")


# Session fixtures: builds (the full emulator and the mutants, all started at once), emulator.
builds, emulator = emu_build.session_fixtures("cuda_emulator_linear", SOURCE, EMULATOR / "linear_harness.cpp",
                                              "linear_kernels.inc", {}, ("EMU_ONLY_F16",), Emulator, SWITCHED)


# ----------------------------------------------------------------------------------------------
# one case: inputs in guarded buffers, forward + backward, checks
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    feature_map: str
    causal: bool
    normalize: bool
    n: int
    m: int
    d: int
    dv: int
    b: int = 1
    h: int = 2
    state: bool = False  # initial state in, gradients of den, S, z too
    noncontig: bool = False  # q as a [B, N, H, D] view, grad_out broadcast (stride 0)

    def __str__(self):
        s = f"{str(self.dtype)[6:]}-{self.feature_map}-{'causal' if self.causal else 'full'}"
        s += f"-{'norm' if self.normalize else 'raw'}-N{self.n}M{self.m}-D{self.d}Dv{self.dv}"
        return s + ("-state" if self.state else "") + ("-noncontig" if self.noncontig else "")

    def kwargs(self):
        return dict(causal=self.causal, feature_map=self.feature_map, normalize=self.normalize, eps=1e-6,
                    scale=1.0 if self.normalize else 1.0 / max(self.m, 1))


class Guarded:
    """A tensor in the middle of a NaN-filled flat buffer, with PAD guard elements each side."""

    def __init__(self, shape, dtype, permute=None):
        numel = math.prod(shape)
        self.buffer = torch.full((numel + 2 * PAD,), float("nan"), dtype=dtype)
        self.tensor = self.buffer[PAD:PAD + numel].view(shape)
        if permute is not None:
            self.tensor = self.tensor.permute(permute)

    def bits(self):
        return self.buffer.view({2: torch.int16, 4: torch.int32}[self.buffer.element_size()]).clone()

    def guards_intact(self):
        return torch.isnan(torch.cat([self.buffer[:PAD], self.buffer[-PAD:]])).all().item()


def _inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, h, n, m, d, dv, dt = case.b, case.h, case.n, case.m, case.d, case.dv, case.dtype
    positive = case.feature_map == "identity" and case.normalize  # keep den away from 0

    def filled(shape, permute=None, shift=False):
        x = Guarded(shape, dt, permute)
        val = torch.randn(x.tensor.shape, generator=g)
        x.tensor.copy_((0.5 * val + 1.0 if shift else val).to(dt))
        return x

    q = filled((b, n, h, d), (0, 2, 1, 3), positive) if case.noncontig else filled((b, h, n, d), shift=positive)
    k, v = filled((b, h, m, d), shift=positive), filled((b, h, m, dv))
    go = filled((1, 1, 1, dv)) if case.noncontig else filled((b, h, n, dv))
    state = None
    if case.state:
        s0 = torch.randn(b, h, d, dv, generator=g)
        z0 = torch.rand(b, h, d, generator=g) * 5.0 + 1.0
        gden = torch.randn(b, h, n, generator=g) * 0.1
        gs, gz = torch.randn(b, h, d, dv, generator=g), torch.randn(b, h, d, generator=g)
        state = (s0, z0, gden, gs, gz)
    return q, k, v, go, state


def run_emulated(emu: Emulator, case: Case, seed=0, edit=None):
    """Forward + backward through the emulator; returns ((out, den, S, z), (dq, dk, dv, dS0, dz0))
    and the inputs (q, k, v, grad_out, state), after checking that nothing was written outside
    the outputs and no input changed.  ``edit(q, k, v)`` may change the inputs first."""
    q, k, v, go, state = _inputs(case, seed)
    if edit is not None:
        edit(q.tensor, k.tensor, v.tensor)
    b, h, n, m, d, dv, dt = case.b, case.h, case.n, case.m, case.d, case.dv, case.dtype
    kw = case.kwargs()
    s0 = z0 = gden = gs = gz = None
    if state is not None:
        s0, z0, gden, gs, gz = state
    go_t = go.tensor.expand(b, h, n, dv)
    before = [x.bits() for x in (q, k, v, go)]
    # Outputs start as NaN: an element the kernels do not write fails the comparison.
    out, den = Guarded((b, h, n, dv), dt), Guarded((b, h, n), F32)
    s, z = Guarded((b, h, d, dv), F32), Guarded((b, h, d), F32)
    emu.forward(q.tensor, k.tensor, v.tensor, s0, z0, kw, out.tensor, den.tensor, s.tensor, z.tensor)
    dq, dk, dvv = Guarded((b, h, n, d), dt), Guarded((b, h, m, d), dt), Guarded((b, h, m, dv), dt)
    ds0, dz0 = Guarded((b, h, d, dv), F32), Guarded((b, h, d), F32)
    emu.backward(go_t, gden, gs, gz, q.tensor, k.tensor, v.tensor, out.tensor, den.tensor, s.tensor, z.tensor,
                 s0, z0, kw, dq.tensor, dk.tensor, dvv.tensor, ds0.tensor, dz0.tensor)
    names = ("out", "den", "S", "z", "dq", "dk", "dv", "dS0", "dz0")
    outs = (out, den, s, z, dq, dk, dvv, ds0, dz0)
    for name, x in zip(names, outs):
        assert x.guards_intact(), f"{name}: written outside its bounds"
    for x, bits in zip((q, k, v, go), before):
        assert torch.equal(x.bits(), bits), "an input (or its guard) was written"
    results = tuple(x.tensor for x in outs)
    return (results[:4], results[4:]), (q.tensor, k.tensor, v.tensor, go_t, state)


def _reference(q, k, v, go, kw, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = linear_attention_reference(*leaves, **kw)
    out.backward(go.to(dtype))
    return (out, *(t.grad for t in leaves))


def _state_reference(q, k, v, go, state, kw, dtype):
    """(out, den, S, z, dq, dk, dv, dS0, dz0) of the recurrent form in `dtype` (autograd)."""
    s0, z0, gden, gs, gz = state
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, s0, z0)]
    fwd = state_reference(*leaves, **kw)
    torch.autograd.backward(fwd, [go.to(dtype), gden.to(dtype), gs.to(dtype), gz.to(dtype)])
    return (*fwd, *(t.grad for t in leaves))


def check(emu: Emulator, case: Case, seed=0):
    ((out, den, s, z), (dq, dk, dv, ds0, dz0)), (q, k, v, go, state) = run_emulated(emu, case, seed)
    kw = case.kwargs()
    if state is None:
        got, names = (out, dq, dk, dv), ("out", "dq", "dk", "dv")
        ref64, low = _reference(q, k, v, go, kw, F64), _reference(q, k, v, go, kw, case.dtype)
    else:
        got = (out, den, s, z, dq, dk, dv, ds0, dz0)
        names = ("out", "den", "S", "z", "dq", "dk", "dv", "dS0", "dz0")
        ref64, low = (_state_reference(q, k, v, go, state, kw, t) for t in (F64, case.dtype))
    for i, (name, x, r64, rlow) in enumerate(zip(names, got, ref64, low)):
        assert_close_to_reference(x, r64, rlow, grad=name.startswith("d") and name != "den",
                                  name=f"{name} [{case}]", dtype=case.dtype)
    return (out, den, s, z), (dq, dk, dv, ds0, dz0)


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

# Chunks are 64 rows, D / Dv blocks 64 columns: 1, 7, 70, 129, 200 are not multiples; D, Dv of 80
# and 72 take two column blocks; Dv != D throughout.
CASES = [
    Case(F16, "elu", True, True, 70, 70, 32, 48),
    Case(BF16, "elu", True, True, 129, 129, 16, 24, noncontig=True),
    Case(F16, "relu", True, False, 129, 129, 24, 16),
    Case(BF16, "identity", True, True, 100, 100, 80, 72, h=1),
    Case(F16, "identity", False, True, 33, 70, 24, 16),
    Case(BF16, "relu", False, False, 65, 7, 16, 40),
    Case(F16, "elu", True, True, 1, 1, 16, 8),
    Case(F16, "elu", True, True, 200, 200, 64, 32, h=1),
    Case(BF16, "elu", True, True, 70, 70, 20, 12, state=True),
    Case(F16, "relu", False, False, 50, 90, 12, 20, state=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(emulator, case):
    emulator.configure(seed=1 + CASES.index(case))
    check(emulator, case)


def test_independent_of_warp_schedule(emulator):
    # No atomics and barriers in the right places: another warp order gives the same bits.
    case = Case(F16, "elu", True, True, 70, 70, 32, 48)
    runs = []
    for seed in (11, 12):
        emulator.configure(seed=seed)
        (fwd, bwd), _ = run_emulated(emulator, case)
        runs.append(fwd + bwd)
    for x, y in zip(*runs):
        assert not x.isnan().any() and torch.equal(x, y)


# ----------------------------------------------------------------------------------------------
# the test can fail
# ----------------------------------------------------------------------------------------------

MUTANT_CASE = Case(F16, "elu", True, True, 70, 70, 32, 48)


@pytest.mark.parametrize("name", MUTATIONS)
def test_catches_a_broken_kernel(builds, name):
    emu = builds["switched"].emulator()
    emu.configure(seed=3, mutant=MUTANT[name])
    with pytest.raises((AssertionError, EmulatorError)):
        check(emu, MUTANT_CASE)


# The out-of-bounds mutants: the launch must stop at the first bad access, naming the access, the
# buffer, the kernel and the thread (MUTANT_CASE: N = 70, a partial last chunk).
BOUNDS_MESSAGES = {
    # (the first read past the end in the emulator's schedule: chunk 1's fetch, whose K and V
    # loads all issue before either is staged; v's column 32 of row 70, head 1)
    "tile_row_guard": r"out-of-bounds read of 2 bytes at byte offset 13504 of `v` \(global memory, 13440 bytes: 66 "
                      r"bytes past its end\) \(thread \d+ of block \(0, 1, 0\) of state_fwd_kernel\)",
    # (float16: the state tile of the last chunk, through load_state_operand's load_tile)
    "chunk_tile_row_guard": r"out-of-bounds read of 4 bytes at byte offset 24704 of `Hs \(chunk states, scratch\)` "
                            r"\(global memory, 24576 bytes: 132 bytes past its end\) \(thread \d+ of block "
                            r"\(1, 1, 0\) of output_kernel\)",
    "store_row_guard": r"out-of-bounds access \(read or write\) of 2 bytes at byte offset \d+ of `out` \(global "
                       r"memory, 13440 bytes: \d+ bytes past its end\) \(thread \d+ of block \(1, 1, 0\) of "
                       r"output_kernel\)",
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
    # Every buffer the kernels get (and the harness's scratch) is accessed through checked
    # pointers: none is reached by a raw pointer the rewriting missed.
    emulator.configure(seed=5)
    for causal in (True, False):
        emulator.access_log.clear()
        run_emulated(emulator, Case(BF16, "elu", causal, True, 70, 70, 20, 12, state=True))
        fwd, bwd = emulator.access_log
        chunks = {"Hs (chunk states, scratch)", "Zs (chunk normalizers, scratch)"} if causal else set()
        assert set(fwd) == {"q", "k", "v", "S0", "z0", "out", "den", "S", "z"} | chunks
        assert all(n > 0 for n in fwd.values()), fwd
        scratch = {"delta (scratch)"}
        if causal:
            scratch |= chunks | {"Rs (chunk state gradients, scratch)", "Ws (chunk normalizer gradients, scratch)",
                                 "S (recomputed total state, scratch)", "z (recomputed total normalizer, scratch)"}
        assert set(bwd) == {"grad_out", "grad_den", "grad_S", "grad_z", "q", "k", "v", "out", "den", "S", "z",
                            "S0", "z0", "dq", "dk", "dv", "dS0", "dz0"} | scratch
        # Causal: S and z are recomputed from S0, z0 chunk by chunk; otherwise the totals S, z serve.
        unread = {"S", "z"} if causal else {"S0", "z0"}
        assert all(n > 0 for name, n in bwd.items() if name not in unread), {k: n for k, n in bwd.items() if not n}
        assert all(bwd[name] == 0 for name in unread), bwd


# Odd sizes (DESIGN.md) at D = 64 and 128 (Dv != D), causal and not; every access bounds-checked.
ODD_CASES = [Case(F16 if i % 2 else BF16, ("elu", "relu", "identity", "elu")[i], i % 2 == 0, i != 1, n, n, d,
                  d // 2 + 8, h=1) for d in (64, 128) for i, n in enumerate((1, 7, 63, 129))]


@pytest.mark.parametrize("case", ODD_CASES, ids=str)
def test_odd_sizes(emulator, case):
    emulator.configure(seed=7)
    check(emulator, case)


@pytest.mark.parametrize("fault", (1, 2), ids=("mma_a_layout", "ldmatrix_trans"))
def test_catches_a_layout_mismatch_with_the_hardware(emulator, fault):
    # The kernels unchanged, the emulated instruction's fragment layout broken.
    emulator.configure(seed=3, fault=fault)
    try:
        with pytest.raises(AssertionError):
            check(emulator, MUTANT_CASE)
    finally:
        emulator.configure()


def test_extraction_refuses_a_changed_ptx_helper():
    # linear.cu's ldmatrix helpers come from mma_sm80.cuh: a dropped .trans there must stop the
    # extraction (the emulated ldsm_x4_trans would still transpose).
    source, headers = SOURCE.read_text(), extract.included_headers(SOURCE)
    header = headers["mma_sm80.cuh"]
    changed = header.replace("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.shared.b16", 1)
    assert changed != header
    with pytest.raises(extract.ExtractError, match="ldsm_x4_trans"):
        extract.extract_device_code(source, {**headers, "mma_sm80.cuh": changed}, name="linear.cu")


# Issue 15: a NaN in q reaches its own row; in k (causal) the rows at and after it, every row
# when not causal -- exactly the out rows of the float64 reference.  A NaN in v also reaches
# earlier rows of its chunk through 0 * NaN in the masked intra-chunk product (P ∘ tril) V, as the
# reference's masked quadratic form does for every row (SDPA's tiles do the same, which the issue
# accepts): there out's NaN lies within the reference's and covers the rows at and after it.
# Gradients: NaN only where the reference has it (its 0 * NaN products reach further), and on
# every dq row whose out row is all NaN.
# relu: φ(NaN) must stay NaN (the kernel's `x > 0 ? x : 0` made it 0: found by tests/fuzz on an
# H100, linear_attention_step with a NaN query).
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_nonfinite_inputs_reach_the_rows_of_the_reference(emulator, where, causal, feature_map):
    case = Case(F16, feature_map, causal, True, 150, 150, 32, 48)
    row, col = {"q": 10, "k": 100, "v": 70}[where], 2  # k: in the second 64-row chunk, as v

    def edit(q, k, v):
        {"q": q, "k": k, "v": v}[where][0, 1, row, col] = float("nan")

    emulator.configure(seed=2)
    ((out, _, _, _), grads), (q, k, v, go, _) = run_emulated(emulator, case, edit=edit)
    ref = _reference(q, k, v, go, case.kwargs(), F64)
    # The tolerance run, without the NaN a torch matmul can spread between rows (issue 24).
    low = without_spread_nan(_reference(q, k, v, go, case.kwargs(), F16),
                             _reference(*finite_inputs(q, k, v), go, case.kwargs(), F16))
    seen_from = row if (causal or where == "q") else 0  # the rows that see the NaN: seen_from..
    seen_to = row + 1 if where == "q" else case.n
    for name, x, r, rl in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]), ref, low):
        nan_x, nan_r = torch.isnan(x), torch.isnan(r)
        if name == "out" and where != "v":
            assert torch.equal(nan_x, nan_r), f"out: NaN at {int(nan_x.sum())} entries, the reference at {int(nan_r.sum())}"
            assert nan_x[0, 1, seen_from:seen_to].all() and not nan_x[0, 1, :seen_from].any()
        else:
            assert not (nan_x & ~nan_r).any(), f"{name}: NaN where the reference has none"
        if name == "out" and where == "v":
            assert nan_x[0, 1, seen_from:, col].all(), "out: a row that sees the NaN value lost it"
        if name == "dq" and where != "v":  # on a NaN out row, dq's NaN exactly as the reference's (relu: 0 where q <= 0)
            poisoned = torch.isnan(ref[0]).all(-1)
            assert poisoned.any()
            assert torch.equal(nan_x[poisoned], nan_r[poisoned]), \
                "dq: a NaN row's gradient lost the NaN"
        keep = ~(nan_x | nan_r)
        assert_close_to_reference(torch.where(keep, x.double(), 0.0).to(x.dtype), torch.where(keep, r, 0.0),
                                  torch.where(keep, rl.double(), 0.0).to(rl.dtype), name=name, dtype=F16,
                                  grad=name != "out")


# bfloat16 runs the state products as a x hi + a x lo (the state split in two bfloat16 tiles): an
# inf in a (here phi(q), unnormalized) must meet hi alone, or inf x lo adds NaN wherever lo is 0 or
# of the other sign than hi.  The inf row's out: +inf / -inf / NaN exactly where the float64
# reference has them (the FMA path's inf x s); every other row finite.  Not causal: there the
# reference's masked quadratic form makes the whole row NaN (inf x 0 at the masked keys), which
# the kernels' masked intra-chunk products do not (issue 15's rule for a NaN, not for an inf).
@pytest.mark.parametrize("feature_map", ["identity", "relu"])
def test_an_infinite_query_meets_the_state_as_in_the_reference(emulator, feature_map):
    case = Case(BF16, feature_map, False, False, 150, 150, 32, 48)
    row, col = 100, 2  # in the second 64-row chunk: its state is a sum of 64+ keys

    def edit(q, k, v):
        q[0, 1, row, col] = float("inf")

    emulator.configure(seed=2)
    ((out, _, _, _), _), (q, k, v, go, _) = run_emulated(emulator, case, edit=edit)
    with torch.no_grad():
        ref = linear_attention_reference(*(t.detach().to(F64) for t in (q, k, v)), **case.kwargs())
    x, r = out.to(F64), ref
    assert torch.isinf(r[0, 1, row]).sum() > case.dv // 2, "the case must put infinities in the row"
    for what, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = fn(x) != fn(r)
        assert not diff.any(), f"{what} pattern differs from the float64 reference at {int(diff.sum())} entries"
    others = torch.ones(out.shape[:3], dtype=torch.bool)
    others[0, 1, row] = False
    assert torch.isfinite(x[others]).all()

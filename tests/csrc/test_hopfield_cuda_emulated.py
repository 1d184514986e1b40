"""The CUDA C++ Hopfield kernels (csrc/cuda/hopfield.cu) run on the CPU by the host emulator.

Like tests/csrc/test_linear_cuda_emulated.py: cuda_emulator/extract.py cuts the device code out of
hopfield.cu (from ``namespace attnkit {`` to the "host side" banner; it has no PTX helpers), and g++
compiles it with cuda_emulator/hopfield_harness.cpp (every CUDA thread a fiber; __syncthreads,
__syncthreads_or, shuffles, __any_sync and __syncwarp as collectives; warps in a seeded order;
shared memory exact-size and NaN-filled; the launches as hopfield.cu's host side makes them, the
split-N path forced on at small N).  The kernels are called through ctypes on CPU tensors held in
NaN-guarded buffers.

Checked against float64: ``out`` against pytorch_ext/reference/hopfield.py with the rule of
DESIGN.md (float32 within 2e-5; float16 / bfloat16 within 2x the reference's own error in that
dtype + 1e-3); the op's other outputs (states, lse, applied) against attnkit_testing's
``loop_hopfield_update``, float32-rule (they are float32 computations from inputs that are exact in
float64); energy and its lse against the reference.  Fused and split-N, S in {1, 7}, N in {1, 50,
300} and odd N (1, 7, 63, 129) at D 64 / 128, D in {16, 64}, 1..3 steps, values or not, tol.  Every
memory access is bounds-checked against its allocation, the split-N scratch included
(cuda_emulator/README.md, "Checked pointers"), with mutants whose bounds are one off.  Not covered: the host side (checks,
allocations, the split decision, launches as nvcc builds them), nvcc's compilation, and anything
about a real GPU: tests/csrc/test_hopfield_cuda.py (``pytest -m gpu``) covers those.
"""
import ctypes
import math
from pathlib import Path

import pytest
import torch

from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference
from attnkit_testing import assert_close_to_reference, loop_hopfield_update, make_hopfield_inputs
from cuda_emulator import emu_build
from cuda_emulator.emu_build import EmulatorError

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
SOURCE = HERE.parents[1] / "csrc" / "cuda" / "hopfield.cu"
PAD = 64  # guard elements around every buffer
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_CODE = {F32: 0, F16: 1, BF16: 2}

# Deliberate bugs (old -> new, `{on}`: 1 while the bug is switched on, else 0), applied to the
# extracted device code: the tests must catch them.
MUTATIONS = {
    # retrieve: no barrier before the next X tile overwrites the one other warps still read.
    "missing_syncthreads": (
        "    __syncthreads();  // everyone is done with the previous tile\n",
        "    if (!{on}) __syncthreads();  // everyone is done with the previous tile\n",
    ),
    # the split-N merge rescales a chunk's partials by the wrong weight.
    "merge_weight": (
        "l[i] = l[i] * a + q.l[pr] * wc;",
        "l[i] = l[i] * a + q.l[pr] * ({on} ? a : wc);",
    ),
}
# Out-of-bounds accesses, which the checked pointers must stop (BOUNDS_MUTANTS): bounds one off.
BOUNDS_MUTATIONS = {
    # split-N: a partial row's column guard, one element written past the row (for the last
    # partial row: past the end of the harness's scratch, which no guard watched before).
    "partial_column_guard": (
        "if (d < Dout) q.acc[pr * q.W + d] = acc[i][j];",
        "if (d < Dout + {on}) q.acc[pr * q.W + d] = acc[i][j];",
    ),
    # the state tile load's row guard: the row after the last state row is read (for the last
    # (batch, head): past the end of state).
    "state_row_guard": (
        "const int r = e / D, d = e - r * D;\n    sm.xi[r * (D + 1) + d] = r < rows",
        "const int r = e / D, d = e - r * D;\n    sm.xi[r * (D + 1) + d] = r < rows + {on}",
    ),
}
# Every deliberate bug is in one build ("switched", built for float32
# only), each on while configure(mutant=MUTANT[name]) (see emu_build.session_builds).
SWITCHED = {**MUTATIONS, **BOUNDS_MUTATIONS}
MUTANT = emu_build.switched_ids(SWITCHED)

_ptr, _int, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_i64p = ctypes.POINTER(ctypes.c_int64)


def _p(x):
    return None if x is None or x.numel() == 0 else x.data_ptr()


class Emulator(emu_build.Library):
    def __init__(self, path: Path):
        super().__init__(path)
        lib = self.lib
        lib.emu_hopfield_update.argtypes = [_int, _i64p, _float, _float] + [_ptr] * 7
        lib.emu_hopfield_energy.argtypes = [_int, _i64p, _float] + [_ptr] * 4
        lib.emu_hopfield_update.restype = lib.emu_hopfield_energy.restype = _int

    def update(self, dtype, dims, beta, tol, state, x, v, out, states, lse, applied):
        with self.buffers(state=state, X=x, V=v, out=out, states=states, lse=lse, applied=applied):
            rc = self.lib.emu_hopfield_update(DTYPE_CODE[dtype], (ctypes.c_int64 * 11)(*dims), beta, tol,
                                              _p(state), _p(x), _p(v), _p(out), _p(states), _p(lse), _p(applied))
            self.check(rc, "update")

    def energy(self, dtype, dims, beta, state, x, e, lse):
        with self.buffers(state=state, X=x, energy=e, lse=lse):
            rc = self.lib.emu_hopfield_energy(DTYPE_CODE[dtype], (ctypes.c_int64 * 4)(*dims), beta, _p(state),
                                              _p(x), _p(e), _p(lse))
            self.check(rc, "energy")


# Session fixtures: builds (the full emulator and the mutants, all started at once), emulator.
builds, emulator = emu_build.session_fixtures("cuda_emulator_hopfield", SOURCE, EMULATOR / "hopfield_harness.cpp",
                                              "hopfield_kernels.inc", {}, ("EMU_ONLY_F32",), Emulator, SWITCHED)


class Guarded:
    """A tensor in the middle of a guard-filled flat buffer (NaN; bool: 0x5a bytes), PAD each side."""

    def __init__(self, shape, dtype, init=None):
        numel = math.prod(shape)
        if dtype == torch.bool:
            self.buffer = torch.full((numel + 2 * PAD,), 0x5A, dtype=torch.uint8)
            self.tensor = self.buffer[PAD:PAD + numel].view(shape)
        else:
            self.buffer = torch.full((numel + 2 * PAD,), float("nan"), dtype=dtype)
            self.tensor = self.buffer[PAD:PAD + numel].view(shape)
        if init is not None:
            self.tensor.copy_(init)

    def bits(self):
        return self.buffer.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[self.buffer.element_size()]).clone()

    def guards_intact(self):
        g = torch.cat([self.buffer[:PAD], self.buffer[-PAD:]])
        return (g == 0x5A).all().item() if g.dtype == torch.uint8 else torch.isnan(g).all().item()


def run_update(emu, state, stored, values, beta, steps, tol, final_state, split, seed=1, mutant=0):
    """The op's four outputs (out, states, lse, applied) from the emulated kernels (b*h flattened
    back to [B, H]), after checking the guards and that no input changed."""
    b, h, s, d = state.shape
    n, dt = stored.shape[2], state.dtype
    dv = d if values is None else values.shape[3]
    r, u = steps, steps - (values is not None)
    ins = [Guarded(t.shape, dt, t) for t in (state, stored, values) if t is not None]
    before = [g.bits() for g in ins]
    out, states = Guarded((b, h, s, dv), F32), Guarded((steps + 1, b, h, s, d), F32)
    lse, applied = Guarded((r, b, h, s), F32), Guarded((u, b, h, s), torch.bool)
    dims = (b * h, s, n, d, dv, steps, tol is not None, values is not None, final_state, split, 132)
    emu.configure(seed=seed, mutant=mutant)
    emu.update(dt, dims, beta, 0.0 if tol is None else tol, ins[0].tensor, ins[1].tensor,
               ins[2].tensor if values is not None else None, out.tensor, states.tensor, lse.tensor, applied.tensor)
    for g, bits in zip(ins, before):
        assert torch.equal(g.bits(), bits), "an input changed"
    for g, name in ((out, "out"), (states, "states"), (lse, "lse"), (applied, "applied")):
        assert g.guards_intact(), f"written outside {name}"
    assert ((applied.tensor == 0) | (applied.tensor == 1)).all(), "applied: an element not written"
    return out.tensor, states.tensor, lse.tensor, applied.tensor.bool()


def check_update(emu, dtype, s, n, d, dv, steps, tol, split, final_state=True, seed=0, scale=1.0, near=False,
                 mutant=0):
    state, stored, values = make_hopfield_inputs(1, 2, s, n, d, dv, dtype=dtype, seed=seed, scale=scale)
    if near:  # states near stored patterns, so that tol freezes rows at different steps
        state = (stored[:, :, :s].double() + 0.3 * state.double()).to(dtype)
    beta = 1.0 / math.sqrt(d) if not near else 2.0
    out, states, lse, applied = run_update(emu, state, stored, values, beta, steps, tol, final_state, split,
                                           mutant=mutant)
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref64 = hopfield_update_reference(to64(state), to64(stored), beta=beta, steps=steps, values=to64(values),
                                      tol=tol)
    low = None if dtype == F32 else hopfield_update_reference(state, stored, beta=beta, steps=steps, values=values,
                                                              tol=tol)
    assert_close_to_reference(out, ref64, low, dtype=dtype, name="out")
    _, r_states, r_lse, r_applied = loop_hopfield_update(state, stored, values, beta, steps, tol, final_state)
    assert torch.equal(applied, r_applied), "applied"
    assert_close_to_reference(states, r_states, name="states", dtype=F32)
    # lse: +inf where the whole block skipped the step (every row frozen), else the loop's.
    skipped = torch.isposinf(lse)
    assert not skipped[-1].any() or values is None, "the value read-out is never skipped"
    for k in range(lse.shape[0]):
        if k < applied.shape[0]:
            assert not (skipped[k] & applied[k]).any(), "a step skipped for a row still updating"
    assert_close_to_reference(torch.where(skipped, r_lse.float(), lse), r_lse, name="lse", dtype=F32)
    return out, states, lse, applied


# (S, N, D, Dv, steps, split)
CASES = [
    (1, 1, 16, None, 1, False),
    (7, 50, 64, None, 3, False),
    (7, 300, 16, 24, 2, False),
    (1, 300, 64, None, 2, True),
    (7, 300, 16, None, 3, True),
    (7, 50, 64, 40, 3, True),
    (1, 1, 16, 16, 1, True),
    # S = 1 on split-N: the stored rows spread over the warps (retrieve_one_row), four chunks, the
    # last partial; values of another width and the final state (accx).
    (1, 1000, 64, 40, 3, True),
]


@pytest.mark.parametrize("s,n,d,dv,steps,split", CASES,
                         ids=[f"S{c[0]}-N{c[1]}-D{c[2]}-Dv{c[3]}-steps{c[4]}-{'split' if c[5] else 'fused'}"
                              for c in CASES])
def test_update_float32(emulator, s, n, d, dv, steps, split):
    check_update(emulator, F32, s, n, d, dv, steps, None, split)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_update_low_precision(emulator, dtype, split):
    check_update(emulator, dtype, 7, 300, 64, None, 3, None, split, seed=1)
    check_update(emulator, dtype, 1, 50, 16, 16, 2, None, split, seed=2)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("dv", [None, 16], ids=["novalues", "values"])
def test_update_tol(emulator, split, dv):
    """Rows freeze at different steps (applied, states); the read-out of frozen rows."""
    _, _, _, applied = check_update(emulator, F32, 7, 50, 16, dv, 4, 1e-3, split, seed=3, near=True)
    assert applied[-1].sum() < applied[0].sum(), "the case should freeze some rows"


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_all_frozen_skip(emulator, split):
    """A block whose rows are all frozen skips the step: lse +inf, applied false, state carried."""
    state, stored, _ = make_hopfield_inputs(1, 1, 7, 50, 16, seed=4)
    for seed in (1, 2, 3):
        _, states, lse, applied = run_update(emulator, state, stored, None, 0.5, 3, 1e3, True, split, seed=seed)
        assert applied[0].all() and not applied[1:].any()
        assert torch.isposinf(lse[1:]).all(), f"seed {seed}: lse {lse[1:].flatten().tolist()}"
        assert torch.equal(states[1], states[3])


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_schedule_independent(emulator, split):
    """Bit-identical results whatever the warp order (a race would show up as a difference)."""
    state, stored, values = make_hopfield_inputs(1, 2, 7, 300, 16, 16, seed=5)
    state = stored[:, :, :7] + 0.3 * state
    runs = [run_update(emulator, state, stored, values, 2.0, 4, 1e-3, True, split, seed=seed) for seed in (1, 7, 99)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("s,n,d", [(1, 1, 16), (7, 50, 64), (7, 300, 16)])
def test_energy(emulator, dtype, s, n, d):
    state, stored, _ = make_hopfield_inputs(1, 2, s, n, d, dtype=dtype, seed=6)
    beta = 0.2
    xs, xx = Guarded(state.shape, dtype, state), Guarded(stored.shape, dtype, stored)
    e, lse = Guarded(state.shape[:-1], F32), Guarded(state.shape[:-1], F32)
    emulator.configure(seed=3)
    emulator.energy(dtype, (2, s, n, d), beta, xs.tensor, xx.tensor, e.tensor, lse.tensor)
    assert all(g.guards_intact() for g in (xs, xx, e, lse))
    s64, x64 = state.double(), stored.double()
    ref = hopfield_energy_reference(s64, x64, beta)
    low = None if dtype == F32 else hopfield_energy_reference(state, stored, beta)
    assert_close_to_reference(e.tensor, ref, low, dtype=dtype, name="energy")
    r_lse = torch.logsumexp(beta * s64 @ x64.transpose(-2, -1), -1)
    assert_close_to_reference(lse.tensor, r_lse, name="lse", dtype=F32)


# The out-of-bounds mutants: (split, message).  The launch must stop at the first bad access,
# naming the access, the buffer, the kernel and the thread.
BOUNDS_MUTANTS = {
    "partial_column_guard": (
        True,
        (r"out-of-bounds access \(read or write\) of 4 bytes at byte offset 2048 of `acc \(split-N partial outputs, "
         r"scratch\)` \(global memory, 2048 bytes: 4 bytes past its end\) \(thread \d+ of block \(1, 1, 0\) of "
         r"split_partial_kernel\)"),
    ),
    "state_row_guard": (
        False,
        (r"out-of-bounds read of 4 bytes at byte offset 896 of `state` \(global memory, 896 bytes: 4 bytes past its "
         r"end\) \(thread \d+ of block \(0, 1, 0\) of update_fused_kernel\)"),
    ),
}


@pytest.mark.parametrize("mutation", BOUNDS_MUTATIONS)
def test_catches_an_out_of_bounds_access(builds, mutation):
    split, message = BOUNDS_MUTANTS[mutation]
    state, stored, _ = make_hopfield_inputs(1, 2, 7, 300, 16, seed=0)
    emu = builds["switched"].emulator()
    with pytest.raises(EmulatorError, match=message):
        run_update(emu, state, stored, None, 0.25, 2, None, True, split, mutant=MUTANT[mutation])


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_switched_mutants_off_pass(builds, split):
    # The switched build with every bug off is the kernel file: the mutants' cases pass.
    check_update(builds["switched"].emulator(), F32, 7, 300, 16, None, 2, None, split)


@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
def test_every_buffer_goes_through_the_checks(emulator, split):
    # Every buffer the kernels get (and the harness's split-N scratch) is accessed through checked
    # pointers: none is reached by a raw pointer the rewriting missed.
    state, stored, values = make_hopfield_inputs(1, 2, 7, 50, 16, 24, seed=8)
    run_update(emulator, state, stored, values, 0.25, 2, None, True, split)
    names = {"state", "X", "V", "out", "states", "lse", "applied"}
    if split:
        names |= {"m (split-N partial maxima, scratch)", "l (split-N partial sums, scratch)",
                  "acc (split-N partial outputs, scratch)", "accx (split-N partial states, scratch)",
                  "active (split-N row flags, scratch)"}
    assert set(emulator.accesses) == names
    assert all(n > 0 for n in emulator.accesses.values()), emulator.accesses


# Odd numbers of stored patterns (DESIGN.md) at D = 64 and 128, fused and split-N, with values at
# D = 128; every access bounds-checked.
ODD_CASES = [(7, n, d, 40 if d == 128 else None, 2, i % 2 == 1)
             for d in (64, 128) for i, n in enumerate((1, 7, 63, 129))]


@pytest.mark.parametrize("s,n,d,dv,steps,split", ODD_CASES,
                         ids=[f"N{c[1]}-D{c[2]}-{'split' if c[5] else 'fused'}" for c in ODD_CASES])
def test_odd_sizes(emulator, s, n, d, dv, steps, split):
    check_update(emulator, F32, s, n, d, dv, steps, None, split)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutants_are_caught(builds, mutation):
    emu = builds["switched"].emulator()
    split = mutation == "merge_weight"
    with pytest.raises((AssertionError, EmulatorError)):
        check_update(emu, F32, 7, 300, 16, None, 2, None, split, mutant=MUTANT[mutation])


# Issue 15: a NaN in a state row poisons that row's retrieval; a NaN in a stored pattern (or its
# value) every row, since every row attends to every pattern -- as in the float64 reference; the
# other rows stay finite and correct.  With tol a NaN row must not be taken for converged early
# with a finite state: its result stays NaN.
@pytest.mark.parametrize("split", [False, True], ids=["fused", "split"])
@pytest.mark.parametrize("where", ["state", "stored", "values"])
@pytest.mark.parametrize("tol", [None, 1e-3], ids=["steps", "tol"])
def test_nonfinite_inputs_propagate_like_the_reference(emulator, split, where, tol):
    dv = 16 if where == "values" else None
    state, stored, values = make_hopfield_inputs(1, 2, 7, 300 if split else 50, 16, dv, dtype=F32, seed=4)
    {"state": state[0, 1, 3], "stored": stored[0, 0, 17], "values": None if values is None else values[0, 1, 5]}[
        where][2] = float("nan")
    beta, steps = 0.25, 3
    out = run_update(emulator, state, stored, values, beta, steps, tol, True, split)[0]
    ref = hopfield_update_reference(state.double(), stored.double(), beta=beta, steps=steps,
                                    values=None if values is None else values.double(), tol=tol)
    assert torch.isnan(ref).any()  # the case poisons something
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (
        f"NaN at {int(torch.isnan(out).sum())} entries, the reference at {int(torch.isnan(ref).sum())}")
    keep = ~torch.isnan(ref)
    assert_close_to_reference(torch.where(keep, out.double(), 0.0).float(), torch.where(keep, ref, 0.0), name="out")

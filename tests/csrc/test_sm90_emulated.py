"""The CUDA emulator's Hopper (sm_90a) models -- TMA, mbarriers, wgmma, setmaxnreg
(cuda_emulator/harness_sm90.h) -- tested on small real CUDA kernels written with
csrc/cuda/sm90_ptx.cuh (cuda_emulator/sm90_selftest.cu), so that a Hopper kernel file built on the
header can be run on the CPU with the semantics it will have on a GPU.

What is checked: extract.py removes the header's PTX helpers only while their asm is exactly what
the emulator models (a changed operand order is refused); TMA boxes of a 4D tensor (odd sizes,
partial boxes at the edges, negative coordinates, a box entirely outside) land at their 128-byte
swizzled places with zeros outside the tensor; a producer / consumer mbarrier ring over more
tiles than stages; wgmma m64n64k16 and m64n128k16, bf16 and f16, A by descriptor or from
registers, B K-major or MN-major, on TMA-loaded swizzled tiles with k-steps inside the 128-byte
rows and across panels, against float64 products (exact fp32 products, fp32 summation); the
asynchrony (a missing mbar_wait or wgmma_wait reads NaN, accumulators are NaN until the wait);
and that each misuse is caught: tx-count over- or underflow, deadlock, misaligned destinations,
uninitialized barriers, divergent or non-uniform warpgroup collectives, a missing wgmma_fence,
A registers changed before the wait, out-of-bounds tensor reads.  The fault hooks (a TMA that
ignores the swizzle, a wgmma that flips imm-trans-b or swaps accumulator rows) make the results
wrong, showing that the comparisons see a layout mismatch.  The scheduler's release-first rule (a
thread completing an mbarrier phase steps aside for the threads it releases): a consumer that
releases a ring stage before the wgmma_wait of the product reading it is caught for every seed
(fault 6, the rule off: for some only).  Named barriers (bar.sync / bar.arrive): a ping-pong
between two warpgroups keeps its order, a missing arrive deadlocks with both barriers' state in
the message, misuse is refused.

These are the emulator's semantics, verified against the PTX ISA and CUTLASS (harness_sm90.h's
header comment); no GPU runs here.
"""
import ctypes
import re
from pathlib import Path

import pytest
import torch

from cuda_emulator import emu_build, extract
from cuda_emulator.emu_build import EmulatorError

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
SELFTEST = EMULATOR / "sm90_selftest.cu"
HEADER = HERE.parents[1] / "csrc" / "cuda" / "sm90_ptx.cuh"
NAN16 = -1  # 0xffff as int16: the emulator's NaN fill of shared memory


class Sm90(emu_build.Library):
    def __init__(self, path):
        super().__init__(path)
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        self.lib.emu_sm90_tma.argtypes = [ctypes.c_void_p, u64p, u64p, u32p, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                          ctypes.c_int]
        self.lib.emu_sm90_ring.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        self.lib.emu_sm90_mma.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
        self.lib.emu_sm90_wgmma_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                 ctypes.c_int]
        self.lib.emu_sm90_pingpong.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]

    def tma(self, full, dims, box, coords, swizzle, slot, kind=0, registered=None):
        """Loads the boxes at `coords` of the 4D tensor whose storage is `full` (int16; logical dims
        innermost first, rows padded in `full`), each into a `slot`-byte slot; returns the slots
        ([n, slot / 2] int16)."""
        strides = [full.stride(2) * 2, full.stride(1) * 2, full.stride(0) * 2]
        out = torch.full((len(coords), slot // 2), NAN16, dtype=torch.int16)
        c = (ctypes.c_int * (4 * len(coords)))(*[x for box_at in coords for x in box_at])
        with self.buffers(t=full if registered is None else registered, out=out):
            self.check(self.lib.emu_sm90_tma(full.data_ptr(), (ctypes.c_uint64 * 4)(*dims),
                                             (ctypes.c_uint64 * 3)(*strides), (ctypes.c_uint32 * 4)(*box), swizzle, c,
                                             len(coords), slot, out.data_ptr(), kind), "tma")
        return out

    def ring(self, src, kind=0):
        out = torch.full_like(src, NAN16)
        with self.buffers(src=src, out=out):
            self.check(self.lib.emu_sm90_ring(src.data_ptr(), src.shape[0], out.data_ptr(), kind), "ring")
        return out

    def mma(self, a, b, trans, rs, kind=0):
        """d = a b (a: 128 x 128, b: 128 x n, 16-bit), B given K-major (bᵀ) or MN-major (b)."""
        n = b.shape[1]
        given = b.contiguous() if trans else b.t().contiguous()
        d = torch.full((128, n), float("nan"))
        with self.buffers(a=a, b=given, d=d):
            self.check(self.lib.emu_sm90_mma(int(a.dtype == torch.bfloat16), n, trans, rs, a.data_ptr(),
                                             given.data_ptr(), d.data_ptr(), kind), "mma")
        return d

    def wgmma_ring(self, a, bt, kind=0):
        """d (64 x 64) = a (bt[0] + .. + bt[-1])ᵀ, tile by tile through a two-stage ring (a: 64 x 64
        bf16, bt: tiles x 64 x 64 bf16, each tile Bᵀ)."""
        d = torch.full((64, 64), float("nan"))
        with self.buffers(a=a, bt=bt, d=d):
            self.check(self.lib.emu_sm90_wgmma_ring(a.data_ptr(), bt.data_ptr(), bt.shape[0], d.data_ptr(), kind),
                       "wgmma ring")
        return d

    def pingpong(self, rounds, kind=0):
        out = torch.zeros(128, dtype=torch.int64)
        out32 = torch.zeros(128, dtype=torch.int32)
        with self.buffers(out=out32):
            self.check(self.lib.emu_sm90_pingpong(rounds, out32.data_ptr(), kind), "ping-pong")
        out.copy_(out32)
        return out % 2**32


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    try:
        code = extract.extract_device_code(SELFTEST.read_text(), extract.included_headers(SELFTEST),
                                           name="tests/csrc/cuda_emulator/sm90_selftest.cu")
    except extract.ExtractError as e:
        pytest.fail(str(e), pytrace=False)
    build = emu_build.Build(tmp_path_factory.mktemp("cuda_emulator_sm90") / "build",
                            EMULATOR / "sm90_selftest_harness.cpp", "sm90_kernels.inc", code, load=Sm90)
    try:
        emulator = build.emulator()
        emulator.configure()
        yield emulator
    finally:
        build.stop()


# ----------------------------------------------------------------------------------------------
# extraction: the header's PTX helpers go only while their asm is what the emulator models
# ----------------------------------------------------------------------------------------------


def test_extraction_removes_every_ptx_helper():
    code = extract.extract_device_code(SELFTEST.read_text(), extract.included_headers(SELFTEST), name="selftest")
    assert "#define ATTNKIT_SM90A 1" in code
    for helper in extract.SM90_HELPERS:
        assert not re.search(r"__forceinline__ \w+ " + helper + r"\(", code), helper
    for kept in ("smem_addr", "smem_desc_sw128"):  # run as written
        assert re.search(r"__forceinline__ \w+ " + kept + r"\(", code), kept
    assert "emu::ptr<" in code and " asm" not in extract._code_only(code)


@pytest.mark.parametrize("old,new,helper", [
    ('"%32, %33, p, 1, 1, 0, %35;\\n}\\n"', '"%33, %32, p, 1, 1, 0, %35;\\n}\\n"', "wgmma_ss"),  # A, B swapped
    ("m64n128k16.f32.f16.f16", "m64n128k16.f32.f16.f16.x", "wgmma_ss"),
    ('"{%32, %33, %34, %35}, %36, p, 1, 1, %38;\\n}\\n"', '"{%32, %34, %33, %35}, %36, p, 1, 1, %38;\\n}\\n"',
     "wgmma_rs"),
    ("mbarrier.try_wait.parity.shared::cta.b64", "mbarrier.test_wait.parity.shared::cta.b64", "mbar_wait"),
    ("[%0], [%1, {%3, %4, %5, %6}], [%2];", "[%0], [%1, {%6, %5, %4, %3}], [%2];", "tma_load_4d"),
    ('"wgmma.wait_group.sync.aligned %0;\\n"', '"wgmma.wait_group.sync.aligned 0;\\n"', "wgmma_wait"),
    ('"bar.sync %0, %1;\\n"', '"bar.sync %1, %0;\\n"', "named_bar_sync"),
    ('"bar.arrive %0, %1;\\n"', '"barrier.arrive %0, %1;\\n"', "named_bar_arrive"),
], ids=["ss_operands", "ss_type", "rs_registers", "test_wait", "tma_coords", "wait_group", "bar_sync_operands",
        "bar_arrive_instruction"])
def test_extraction_refuses_a_changed_helper(old, new, helper):
    header = HEADER.read_text()
    assert header.count(old) >= 1, f"{old!r} no longer in sm90_ptx.cuh"
    headers = {name: text.replace(old, new, 1) if Path(name).name == "sm90_ptx.cuh" else text
               for name, text in extract.included_headers(SELFTEST).items()}
    with pytest.raises(extract.ExtractError, match=re.escape(f"{helper}(): its body is now")):
        extract.extract_device_code(SELFTEST.read_text(), headers, name="selftest")


# ----------------------------------------------------------------------------------------------
# TMA
# ----------------------------------------------------------------------------------------------

DIMS = (100, 37, 3, 2)  # innermost first; rows padded to 104 elements in storage
SW_BOX = (64, 16, 2, 1)  # 128 bytes wide: the 128-byte swizzle
SW_COORDS = [(0, 0, 0, 0), (64, 32, 2, 1), (-8, -3, 0, 0), (40, 10, 1, 1), (96, 36, 2, 1), (100, 0, 0, 0)]
PLAIN_BOX = (24, 5, 1, 2)
PLAIN_COORDS = [(0, 0, 0, 0), (90, 35, 2, 1), (-5, -2, -1, 0)]


def tensor():
    """(storage [2, 3, 37, 104] int16 with distinct positive values, -7 in the row padding)."""
    full = torch.arange(1, 2 * 3 * 37 * 104 + 1, dtype=torch.int32).to(torch.int16).view(2, 3, 37, 104)
    full[..., DIMS[0]:] = -7
    return full


def expected(full, box, coords, swizzle, slot):
    """The slots as the ISA says: the box dense in the slot (i0 fastest), elements outside the tensor
    zero, the 128-byte swizzle (16-byte chunk bits 4-6 XOR bits 7-9 of the 1024-aligned address),
    the slot's bytes beyond the box untouched (NaN)."""
    out = torch.full((len(coords), slot // 2), NAN16, dtype=torch.int16)
    for i, c in enumerate(coords):
        vals = torch.zeros(box[3], box[2], box[1], box[0], dtype=torch.int16)
        src, dst = [], []
        for d in (3, 2, 1, 0):
            lo, hi = max(c[d], 0), min(c[d] + box[d], DIMS[d])
            if lo >= hi:
                break
            src.append(slice(lo, hi))
            dst.append(slice(lo - c[d], hi - c[d]))
        else:
            vals[tuple(dst)] = full[tuple(src)]
        byte = torch.arange(vals.numel()) * 2
        if swizzle:
            byte = byte ^ (((byte >> 7) & 7) << 4)
        out[i, byte // 2] = vals.flatten()
    return out


@pytest.mark.parametrize("swizzle", [3, 0], ids=["swizzle128", "plain"])
def test_tma_boxes_land_swizzled_with_zero_fill(sm90, swizzle):
    full = tensor()
    box, coords = (SW_BOX, SW_COORDS) if swizzle else (PLAIN_BOX, PLAIN_COORDS)
    slot = 4096 if swizzle else 1024
    for seed in (1, 2):
        sm90.configure(seed=seed)
        out = sm90.tma(full, DIMS, box, coords, swizzle, slot)
        assert torch.equal(out, expected(full, box, coords, swizzle, slot))
    assert sm90.accesses["t"] == sum(int((expected(full, box, [c], 0, slot) > 0).sum()) for c in coords)
    sm90.configure()


def test_tma_fault_ignoring_the_swizzle_is_seen(sm90):
    full = tensor()
    sm90.configure(fault=3)
    try:
        out = sm90.tma(full, DIMS, SW_BOX, SW_COORDS[:1], 3, 4096)
    finally:
        sm90.configure()
    assert torch.equal(out, expected(full, SW_BOX, SW_COORDS[:1], 0, 4096))  # unswizzled
    assert not torch.equal(out, expected(full, SW_BOX, SW_COORDS[:1], 3, 4096))


@pytest.mark.parametrize("kind", [1, 6], ids=["no_wait", "wait_for_parity_1"])
def test_tma_read_before_it_completes_reads_nan(sm90, kind):
    out = sm90.tma(tensor(), DIMS, SW_BOX, SW_COORDS[:2], 3, 4096, kind=kind)
    assert (out == NAN16).all()


@pytest.mark.parametrize("kind,message", [
    (2, r"mbarrier at shared byte offset 0: 2 transaction bytes more completed than expected \(expect_tx\) in its "
        r"phase 0"),
    (3, r"deadlock in block \(0, 0, 0\) of tma_probe_kernel: 0 of 128 threads exited, the others wait "
        r"\(thread:barrier\): 0:mbarrier.try_wait"),
    (4, r"cp.async.bulk.tensor destination: shared address 0x880 \(byte offset 1152\) not 1024-byte aligned "
        r"\(thread 0 of block \(0, 0, 0\) of tma_probe_kernel\)"),
    (5, r"mbarrier\.(arrive\.expect_tx|try_wait\.parity) on the mbarrier at shared byte offset 0, which is not "
        r"initialized \(mbarrier.init\) or whose 8 bytes were overwritten since"),
    (7, r"mbarrier.arrive: more arrivals on the mbarrier at shared byte offset 0 than its count 1 in its phase 0 "
        r"\(which waits for 8192 transaction bytes\) \(thread 0 "),
    (8, r"cp.async.bulk.tensor.4d completing on the mbarrier at shared byte offset 0, which thread 0 initialized "
        r"without a fence.proxy.async since"),
], ids=["tx_underflow", "deadlock", "misaligned_destination", "uninitialized", "extra_arrival", "no_proxy_fence"])
def test_tma_and_mbarrier_misuse_is_caught(sm90, kind, message):
    with pytest.raises(EmulatorError, match=message):
        sm90.tma(tensor(), DIMS, SW_BOX, SW_COORDS[:2], 3, 4096, kind=kind)


def test_tma_reads_are_checked_against_the_allocation(sm90):
    full = tensor()
    with pytest.raises(EmulatorError, match=r"out-of-bounds read of 2 bytes at byte offset \d+ of `t` \(global memory, "
                                            r"23088 bytes: 2 bytes past its end\) \(thread 0 "):
        sm90.tma(full, DIMS, SW_BOX, [(0, 0, 0, 1)], 3, 4096, registered=full[0])


@pytest.mark.parametrize("dims,box,swizzle,message", [
    (DIMS, (32, 16, 1, 1), 3, "128B swizzle with an inner box of 64 bytes"),
    (DIMS, (64, 300, 1, 1), 3, r"box\[1\] = 300 not in \[1, 256\]"),
    (DIMS, (4, 2, 1, 1), 0, "box\\[0\\] \\* element size = 8 bytes, not a multiple of 16"),
    (DIMS, SW_BOX, 2, "swizzle 2 not modelled"),
], ids=["narrow_swizzled_box", "box_too_big", "inner_box_not_16_bytes", "64B_swizzle"])
def test_tensor_map_parameters_are_checked(sm90, dims, box, swizzle, message):
    with pytest.raises(EmulatorError, match="emu_make_tensor_map_4d: " + message):
        sm90.tma(tensor(), dims, box, SW_COORDS[:1], swizzle, 4096)


# ----------------------------------------------------------------------------------------------
# an mbarrier ring: one producer, two consumer warpgroups, more tiles than stages
# ----------------------------------------------------------------------------------------------


def test_ring_of_stages(sm90):
    src = torch.arange(1, 5 * 64 * 64 + 1, dtype=torch.int16).view(5, 64, 64)
    for seed in (1, 2, 3):
        sm90.configure(seed=seed)
        assert torch.equal(sm90.ring(src), src)
    sm90.configure()


def test_ring_without_waiting_for_a_free_stage_is_caught(sm90):
    src = torch.arange(1, 5 * 64 * 64 + 1, dtype=torch.int16).view(5, 64, 64)
    with pytest.raises(EmulatorError, match=r"mbarrier.arrive.expect_tx: more arrivals on the mbarrier at shared byte "
                                            r"offset 0 than its count 1"):
        sm90.ring(src, kind=1)


def test_ring_waiting_for_the_wrong_parity_is_caught(sm90):
    # The consumers' first waits (parity 1 of fresh barriers) return at once: they read NaN,
    # release the stages early, and the phases go out of step: an arrival on a barrier whose
    # phase still waits for bytes, or every thread waiting.
    src = torch.arange(1, 5 * 64 * 64 + 1, dtype=torch.int16).view(5, 64, 64)
    for seed in (1, 2, 3):
        sm90.configure(seed=seed)
        with pytest.raises(EmulatorError, match=r"more arrivals on the mbarrier at shared byte offset \d+|deadlock"):
            sm90.ring(src, kind=2)
    sm90.configure()


# ----------------------------------------------------------------------------------------------
# wgmma
# ----------------------------------------------------------------------------------------------


def operands(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(128, 128, generator=g).to(dtype), torch.randn(128, n, generator=g).to(dtype)


def assert_product(d, a, b):
    """d == a b up to fp32 summation: products exact, 128 sums each rounded to fp32."""
    ref = a.double() @ b.double()
    bound = 128 * 2.0 ** -24 * (a.double().abs() @ b.double().abs()) + 1e-30
    assert torch.isfinite(d).all()
    assert ((d.double() - ref).abs() <= bound).all(), (d.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("trans", [0, 1], ids=["b_kmajor", "b_mnmajor"])
@pytest.mark.parametrize("rs", [0, 1], ids=["ss", "rs"])
def test_wgmma(sm90, dtype, n, trans, rs):
    a, b = operands(dtype, n)
    assert_product(sm90.mma(a, b, trans, rs), a, b)


@pytest.mark.parametrize("fault,trans,rs", [(3, 0, 0), (4, 0, 0), (4, 1, 1), (5, 0, 1)],
                         ids=["tma_no_swizzle", "flip_trans_b_kmajor", "flip_trans_b_mnmajor", "swap_acc_rows"])
def test_wgmma_layout_faults_are_seen(sm90, fault, trans, rs):
    a, b = operands(torch.bfloat16, 64, seed=1)
    sm90.configure(fault=fault)
    try:
        d = sm90.mma(a, b, trans, rs)
        ref = a.double() @ b.double()
        assert not torch.allclose(d.double(), ref, atol=1e-2)
    except EmulatorError as e:  # MN-major tiles read as K-major: rows SBO apart run past the end
        assert fault == 4 and trans == 1 and "outside the block's" in str(e)
    finally:
        sm90.configure()


@pytest.mark.parametrize("kind,rs", [(1, 0), (2, 0), (6, 0), (1, 1)],
                         ids=["read_before_wait", "wait_1_chained", "no_mbar_wait", "rs_read_before_wait"])
def test_wgmma_results_are_nan_before_their_wait(sm90, kind, rs):
    a, b = operands(torch.bfloat16, 64)
    d = sm90.mma(a, b, 0, rs, kind=kind)
    assert torch.isnan(d).all()


@pytest.mark.parametrize("kind,rs,message", [
    (3, 0, r"divergent warpgroup 1: thread \d+ is at (wgmma.mma_async|wgmma.commit_group), thread \d+ at "
           r"(wgmma.commit_group|wgmma.mma_async)"),
    (4, 0, r"wgmma.mma_async: thread 133 has descriptors 0x[0-9a-f]+, 0x[0-9a-f]+ and scale-d 0, thread 128 "
           r"0x[0-9a-f]+, 0x[0-9a-f]+ and 0: they must be the same in the 128 threads of the warpgroup"),
    (5, 0, r"wgmma.mma_async without a wgmma.fence of its warpgroup since its last wgmma.wait_group"),
    (7, 1, r"wgmma_rs: the A registers of thread \d+ changed between the wgmma and the wgmma.wait_group that "
           r"covers it"),
], ids=["divergent", "non_uniform_descriptor", "no_fence", "rs_registers_changed"])
def test_wgmma_misuse_is_caught(sm90, kind, rs, message):
    a, b = operands(torch.bfloat16, 64)
    with pytest.raises(EmulatorError, match=message):
        sm90.mma(a, b, 0, rs, kind=kind)


# ----------------------------------------------------------------------------------------------
# the release-first rule: a thread that completes an mbarrier phase steps aside, and the threads
# it releases run first (a stage released under a running wgmma is overwritten under it)
# ----------------------------------------------------------------------------------------------


def ring_operands(tiles=3):
    g = torch.Generator().manual_seed(7)
    return torch.randn(64, 64, generator=g).to(torch.bfloat16), torch.randn(tiles, 64, 64, generator=g).to(
        torch.bfloat16)


def test_wgmma_ring_releasing_after_the_wait(sm90):
    a, bt = ring_operands()
    for seed in (1, 2, 3):
        sm90.configure(seed=seed)
        d = sm90.wgmma_ring(a, bt)
        ref = a.double() @ bt.double().sum(0).t()
        bound = 3 * 64 * 2.0 ** -24 * (a.double().abs() @ bt.double().abs().sum(0).t()) + 1e-30
        assert torch.isfinite(d).all() and ((d.double() - ref).abs() <= bound).all()
    sm90.configure()


def test_wgmma_ring_releasing_before_the_wait_is_caught(sm90):
    # The last consumer thread's early release completes the stage's phase; the producer, waiting
    # for it, runs first and issues the next load into the stage (NaN until it lands), and the
    # product, computed at its wgmma_wait, reads NaN: for every schedule.
    a, bt = ring_operands()
    for seed in range(1, 9):
        sm90.configure(seed=seed)
        assert torch.isnan(sm90.wgmma_ring(a, bt, kind=1)).all(), seed
    sm90.configure()


def test_without_the_release_first_rule_the_race_depends_on_the_schedule(sm90):
    # fault 6 turns the rule off: the producer then runs only when the scheduler reaches its warp,
    # sometimes after the product has been computed (the race is then missed).
    a, bt = ring_operands()
    missed = []
    try:
        for seed in range(1, 21):
            sm90.configure(seed=seed, fault=6)
            missed.append(not torch.isnan(sm90.wgmma_ring(a, bt, kind=1)).any())
    finally:
        sm90.configure()
    assert any(missed) and not all(missed)


# ----------------------------------------------------------------------------------------------
# named barriers (bar.sync / bar.arrive id, count): a ping-pong between two warpgroups
# ----------------------------------------------------------------------------------------------


def pingpong_expected(rounds):
    x = torch.arange(128, dtype=torch.int64)
    for r in range(rounds):
        x = (3 * x + r + 1) % 2**32
        x = (5 * x + 2 * r + 7) % 2**32
    return x


def test_named_barriers_enforce_the_ping_pong_order(sm90):
    for seed in (1, 2, 3, 4):
        sm90.configure(seed=seed)
        assert torch.equal(sm90.pingpong(4), pingpong_expected(4))
    sm90.configure()


def test_without_the_named_barriers_the_order_is_lost(sm90):
    # Each warp then runs its rounds at once: A's four updates, then B's (or B's first).
    for seed in (1, 2, 3, 4):
        sm90.configure(seed=seed)
        assert not torch.equal(sm90.pingpong(4, kind=1), pingpong_expected(4))
    sm90.configure()


@pytest.mark.parametrize("kind,message", [
    (2, r"deadlock in block \(0, 0, 0\) of pingpong_kernel: 0 of 256 threads exited, the others wait "
        r"\(thread:barrier\): 0:bar.sync 2 .*\(named barrier 1: 128 of 256 threads arrived, threads 128-255 wait at "
        r"bar.sync 1; named barrier 2: 128 of 256 threads arrived, threads 0-127 wait at bar.sync 2\)$"),
    (3, r"bar.(sync 1, 224|arrive 1, 256): named barrier 1's current use expects (256|224) threads \(\d+ arrived\): "
        r"the thread counts of one use must agree"),
    (4, r"bar.sync 1, 100: the thread count must be a positive multiple of the warp size \(32\), at most the "
        r"block's 256 threads"),
    (5, r"bar.arrive 0, 256: barrier 0 is not modelled \(1 .. 15; barrier 0 is __syncthreads'\)"),
    (6, r"divergent warp: lane \d+ is at bar.arrive [23], lane \d+ at another collective"),
], ids=["missing_arrive_deadlocks", "count_mismatch", "count_not_warp_multiple", "barrier_0", "divergent_warp"])
def test_named_barrier_misuse_is_caught(sm90, kind, message):
    for seed in (1, 2):
        sm90.configure(seed=seed)
        with pytest.raises(EmulatorError, match=message):
            sm90.pingpong(4, kind=kind)
    sm90.configure()

"""The CUDA emulator's checked pointers (cuda_emulator/README.md, "Memory"): extract.py rewrites
every pointer of the device code into harness.cpp's ``emu::ptr``, which checks each access against
the allocation the pointer was made from.

Two parts: the rewriting itself (extract.instrument_pointers, on snippets and on the four kernel
files), and a small probe kernel compiled with the emulator that makes one bad access of each kind
-- past the end of a buffer into the buffer after it (valid memory, which guard pages or NaN
guards cannot tell from a good read), before the start, misaligned, through a null pointer, into
unregistered memory, past the end of shared memory -- each of which must stop the launch with a
message naming it.  The per-family tests (test_*_cuda_emulated.py) run the real kernels under the
checks, with mutants whose bounds are off by one.
"""
import ctypes
from pathlib import Path

import pytest
import torch

from cuda_emulator import emu_build, extract
from cuda_emulator.emu_build import EmulatorError

HERE = Path(__file__).resolve().parent
EMULATOR = HERE / "cuda_emulator"
KERNEL_FILES = ("softmax", "sparse", "linear", "hopfield")

# ----------------------------------------------------------------------------------------------
# the rewriting
# ----------------------------------------------------------------------------------------------

SNIPPET = """\
template <class L, typename A>
struct Acc;
struct P {
  const uint16_t* q;  // a comment with a * b
  float *a, *b;
  unsigned char* raw = nullptr;
};
template <typename T, class L, typename A, typename E>
__device__ const T* at(const T* p, const Acc<L, A>* acc, int i) {
  const uint4 v = *reinterpret_cast<const uint4*>(p + i);
  E *kt = sm.template tile<E>(0), *vt = sm.template tile<E>(1);
  const auto* u = reinterpret_cast<const uint16_t*>(p);
  float x = 2.f * i, y = x * x;
  int e;
  frexpf(x, &e);
  each([&](int j) { y += static_cast<const float*>(nullptr) == nullptr ? j : 0; });
  return p + i * kLdOf<E> * sizeof(E);
}
__device__ void f(uint32_t (&r)[4], const float (&c)[2][4], int* lo) {}
"""


def test_rewrites_every_pointer_type():
    out = extract.instrument_pointers(SNIPPET)
    for expected in (
        "emu::ptr<const uint16_t> q;  // a comment with a * b",
        "emu::ptr<float> a, b;",
        "emu::ptr<unsigned char> raw = nullptr;",
        "__device__ emu::ptr<const T> at(emu::ptr<const T> p, emu::ptr<const Acc<L, A>> acc, int i) {",
        "*emu::reinterpret_ptr<emu::ptr<const uint4>>(p + i);",
        "emu::ptr<E> kt = sm.template tile<E>(0), vt = sm.template tile<E>(1);",
        "const auto u = emu::reinterpret_ptr<emu::ptr<const uint16_t>>(p);",
        "float x = 2.f * i, y = x * x;",  # multiplications stay
        "frexpf(x, emu::addr(e));",
        "each([&](int j) { y += static_cast<emu::ptr<const float>>(nullptr) == nullptr ? j : 0; });",
        "return p + i * kLdOf<E> * sizeof(E);",
        "__device__ void f(uint32_t (&r)[4], const float (&c)[2][4], emu::ptr<int> lo) {}",  # references stay
    ):
        assert expected in out, f"{expected!r} not in\n{out}"


@pytest.mark.parametrize("code,match", [
    ("float *a, b;", "mixes pointers and non-pointers"),
    ("float** p;", "pointers to pointers"),
    ("float* const p = q;", "const / restrict pointers"),
    ("f(&(x));", "address-of whose operand is not a name"),
    ("const Undeclared* x = y;", "`Undeclared` is neither a type the device code declares nor a value"),
])
def test_refuses_what_it_cannot_rewrite(code, match):
    with pytest.raises(extract.ExtractError, match=match):
        extract.instrument_pointers("__device__ void g() {\n  " + code + "\n}\n")


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_no_raw_pointer_is_left_in_the_kernel_files(name):
    # extract_device_code rewrites by default and refuses if a pointer type is left; the plain
    # extraction keeps the kernel file's own spelling (what MUTATIONS are written against).
    source = HERE.parents[1] / "csrc" / "cuda" / f"{name}.cu"
    headers = extract.included_headers(source)
    checked = extract.extract_device_code(source.read_text(), headers, name=name)
    plain = extract.extract_device_code(source.read_text(), headers, name=name, checked_pointers=False)
    assert checked == extract.instrument_pointers(plain, name)
    assert "emu::ptr<" in checked and "emu::ptr<" not in plain
    code = extract._code_only(checked)
    assert "reinterpret_cast" not in code and "const_cast" not in code


# ----------------------------------------------------------------------------------------------
# the checks, on a probe kernel
# ----------------------------------------------------------------------------------------------

PROBE_CU = r"""// Probe kernels for the checked pointers and cp.async (not project kernels).
#include "mma_sm80.cuh"

namespace attnkit {
namespace {

constexpr int kThreads = 64;

struct Args {
  const float* in;  // n floats
  float* out;       // n floats
  int n, kind;
};

__global__ void probe_kernel(const Args a) {
  extern __shared__ float smem_raw[];  // kThreads floats
  const int i = threadIdx.x;
  smem_raw[i] = 1.f;
  __syncthreads();
  switch (a.kind) {
    case 0:  // in bounds
      if (i < a.n) a.out[i] = 2.f * a.in[i] + smem_raw[kThreads - 1 - i];
      break;
    case 1:  // the row guard one off: in[n], the first float of the buffer after `in`
      if (i <= a.n) a.out[i < a.n ? i : 0] = a.in[i];
      break;
    case 2:  // a write before the start
      if (i == 0) a.out[-1] = 0.f;
      break;
    case 3:  // a vector read at a 4-byte offset
      if (i == 0) a.out[0] = __uint_as_float(reinterpret_cast<const uint4*>(a.in + 1)->x);
      break;
    case 4:  // through a null pointer
      if (i == 0) {
        const float* none = nullptr;
        a.out[0] = none[3];
      }
      break;
    case 5:  // shared memory, one past its end
      if (i == 0) a.out[0] = smem_raw[kThreads];
      break;
  }
}

// cp.async (mma_sm80.cuh's cp_async16 / cp_async_commit / cp_async_wait, emulated by harness.cpp):
// thread i copies row i of `in` (kThreads rows of 8 uint16) into row i of a shared tile, then
// writes row j = kThreads - 1 - i of the tile (copied by the other warp) to row i of `out`, and
// row j of a second tile to row kThreads + i of `out`.
struct CpArgs {
  const uint16_t* in;  // kThreads x 8
  uint16_t* out;       // 2 kThreads x 8
  int kind;
};

__global__ void cp_async_probe_kernel(const CpArgs a) {
  extern __shared__ __align__(16) uint16_t smem[];  // two tiles of kThreads x 8
  const int i = threadIdx.x, j = kThreads - 1 - i;
  uint16_t* tile = smem;
  uint16_t* tile2 = smem + kThreads * 8;
  uint16_t keep[8];
  switch (a.kind) {
    case 0:  // right: copy, commit, wait, barrier
      cp_async16(tile + i * 8, a.in + i * 8);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      break;
    case 1:  // no wait: the copy has not landed
      cp_async16(tile + i * 8, a.in + i * 8);
      cp_async_commit();
      __syncthreads();
      break;
    case 2:  // no barrier after the wait: the other warp's copies are not visible
      cp_async16(tile + i * 8, a.in + i * 8);
      cp_async_commit();
      cp_async_wait<0>();
      break;
    case 3:  // two groups, wait_group 1: the first has landed, the second not
      cp_async16(tile + i * 8, a.in + i * 8);
      cp_async_commit();
      cp_async16(tile2 + i * 8, a.in + i * 8);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      break;
    case 4:  // a copy never committed: wait_group 0 does not cover it
      cp_async16(tile + i * 8, a.in + i * 8);
      cp_async_wait<0>();
      __syncthreads();
      break;
    case 5:  // the source one row past the end of `in` (the last thread)
      cp_async16(tile + i * 8, a.in + (i + 1) * 8);
      break;
    case 6:  // a source 2 bytes off the 16-byte alignment (thread 0, as below)
      if (i == 0) cp_async16(tile + i * 8, a.in + i * 8 + 1);
      break;
    case 7:  // a destination in global memory
      if (i == 0) cp_async16(a.out + i * 8, a.in + i * 8);
      break;
    case 8:  // a source in shared memory
      if (i == 0) cp_async16(tile + i * 8, tile2 + i * 8);
      break;
    case 9:  // a destination past the end of shared memory
      if (i == 0) cp_async16(tile + (i + 2 * kThreads) * 8, a.in + i * 8);
      break;
    case 10:  // a destination 8 bytes off the 16-byte alignment
      if (i == 0) cp_async16(tile + i * 8 + 4, a.in + i * 8);
      break;
    case 11:  // right: read the other warp's row, barrier, then overwrite the own row
    case 12:  // the same without that barrier: the other warp may read the new bytes (or NaN)
      cp_async16(tile + i * 8, a.in + i * 8);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int e = 0; e < 8; ++e) keep[e] = tile[j * 8 + e];
      if (a.kind == 11) __syncthreads();
      cp_async16(tile + i * 8, a.in + j * 8);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int e = 0; e < 8; ++e) a.out[i * 8 + e] = keep[e];
      return;
  }
  if (a.kind >= 5) return;
  for (int e = 0; e < 8; ++e) {
    a.out[i * 8 + e] = tile[j * 8 + e];
    a.out[(kThreads + i) * 8 + e] = tile2[j * 8 + e];
  }
}

// ---------------------------------------------------------------------------------------------
// host side (the extraction ends above it and closes the two namespaces)

}  // namespace
}  // namespace attnkit
"""

PROBE_HARNESS = """\
#define EMU_CORE_ONLY
#include "{harness}"

#include "probe_kernels.inc"

extern "C" int emu_probe(const float* in, float* out, int n, int kind) {{
  emu::S.failed = false;
  emu::S.error.clear();
  attnkit::Args a;
  a.in = in, a.out = out, a.n = n, a.kind = kind;
  const size_t smem = attnkit::kThreads * sizeof(float);
  const dim3 grid{{1, 1, 1}};
  return emu::launch("probe_kernel", grid, attnkit::kThreads, smem, [a] {{ attnkit::probe_kernel(a); }}) ? 0 : 1;
}}

// The in-bounds probe reading a harness buffer that was freed after the pointer to it was made.
extern "C" int emu_probe_freed(float* out, int n) {{
  emu::S.failed = false;
  emu::S.error.clear();
  attnkit::Args a;
  {{
    std::vector<float> scratch(n, 1.f);
    emu::Buffers buffers;
    buffers.add(scratch, "scratch");
    a.in = scratch.data();
  }}
  a.out = out, a.n = n, a.kind = 0;
  const size_t smem = attnkit::kThreads * sizeof(float);
  const dim3 grid{{1, 1, 1}};
  return emu::launch("probe_kernel", grid, attnkit::kThreads, smem, [a] {{ attnkit::probe_kernel(a); }}) ? 0 : 1;
}}

extern "C" int emu_cp_async_probe(const uint16_t* in, uint16_t* out, int kind, unsigned long long seed) {{
  emu::S.failed = false;
  emu::S.error.clear();
  emu::S.seed = seed;
  attnkit::CpArgs a;
  a.in = in, a.out = out, a.kind = kind;
  const size_t smem = 2 * attnkit::kThreads * 8 * sizeof(uint16_t);
  const dim3 grid{{1, 1, 1}};
  return emu::launch("cp_async_probe_kernel", grid, attnkit::kThreads, smem,
                     [a] {{ attnkit::cp_async_probe_kernel(a); }}) ? 0 : 1;
}}
"""


class Probe(emu_build.Library):
    def __init__(self, path):
        super().__init__(path)
        self.lib.emu_probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.lib.emu_probe_freed.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.emu_cp_async_probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]

    def run(self, kind, n, registered=True):
        """Runs the probe on `in` = the first n floats of a buffer of 2n, `after` = the next n
        (both registered, as two allocations), and `out` (n floats; unregistered if not
        `registered`); returns out."""
        both = torch.arange(2 * n, dtype=torch.float32)
        x, after = both[:n], both[n:]
        out = torch.full((n,), float("nan"))
        with self.buffers(**{"in": x, "after": after}, **({"out": out} if registered else {})):
            self.check(self.lib.emu_probe(x.data_ptr(), out.data_ptr(), n, kind), "probe")
        return out

    def cp_async(self, kind, seed=1):
        """Runs the cp.async probe on `in` = rows 0..63 of 8 float16 each (distinct finite
        values); returns (in, out) with out as [2, 64, 8] (the two tiles' rows as read)."""
        x = torch.arange(64 * 8, dtype=torch.float16).view(64, 8)
        out = torch.full((2, 64, 8), float("nan"), dtype=torch.float16)
        with self.buffers(**{"in": x, "out": out}):
            self.check(self.lib.emu_cp_async_probe(x.data_ptr(), out.data_ptr(), kind, seed), "cp.async probe")
        return x, out


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_emulator_probe")
    headers = {"mma_sm80.cuh": (HERE.parents[1] / "csrc" / "cuda" / "mma_sm80.cuh").read_text()}
    code = extract.extract_device_code(PROBE_CU, headers, name="probe.cu")
    harness = root / "probe_harness.cpp"
    harness.write_text(PROBE_HARNESS.format(harness=(EMULATOR / "harness.cpp").as_posix()))
    build = emu_build.Build(root / "build", harness, "probe_kernels.inc", code, load=Probe)
    try:
        yield build.emulator()
    finally:
        build.stop()


def test_probe_in_bounds(probe):
    out = probe.run(0, 40)
    assert torch.equal(out, 2 * torch.arange(40.0) + 1)
    assert probe.accesses == {"in": 40, "after": 0, "out": 40}


@pytest.mark.parametrize("kind,message", [
    # in[40] is after[0]: valid memory, but not `in`'s
    (1, (r"out-of-bounds read of 4 bytes at byte offset 160 of `in` \(global memory, 160 bytes: 4 bytes past its "
         r"end\) \(thread 40 of block \(0, 0, 0\) of probe_kernel\)")),
    (2, (r"out-of-bounds access \(read or write\) of 4 bytes at byte offset -4 of `out` \(global memory, 160 bytes: "
         r"4 bytes before its start\) \(thread 0 of block")),
    (3, r"misaligned read of 16 bytes at byte offset 4 of `in` \(global memory; needs 16-byte alignment\)"),
    (4, r"read of 4 bytes through a null pointer \(address 0xc\)"),
    (5, (r"out-of-bounds access \(read or write\) of 4 bytes at byte offset 256 of `shared memory` \(shared memory, "
         r"256 bytes: 4 bytes past its end\)")),
], ids=["into_the_next_buffer", "before_the_start", "misaligned", "null", "shared_memory"])
def test_probe_catches(probe, kind, message):
    with pytest.raises(EmulatorError, match=message):
        probe.run(kind, 40)


def test_probe_catches_a_freed_buffer(probe):
    out = torch.full((8,), float("nan"))
    with pytest.raises(EmulatorError, match=r"read of 4 bytes in `scratch` \(global memory\) after it was freed"):
        with probe.buffers(out=out):
            probe.check(probe.lib.emu_probe_freed(out.data_ptr(), 8), "probe")


def test_probe_catches_unregistered_memory(probe):
    with pytest.raises(EmulatorError, match=r"access \(read or write\) of 4 bytes at address 0x[0-9a-f]+, which is in "
                                            r"no registered buffer"):
        probe.run(0, 40, registered=False)


# ----------------------------------------------------------------------------------------------
# cp.async and its groups (harness.cpp: a copy NaN-fills its destination at the issue and lands
# at the first wait_group of its thread that covers its group)
# ----------------------------------------------------------------------------------------------


def test_cp_async_lands_at_the_wait(probe):
    for seed in (1, 2, 3):
        x, out = probe.cp_async(0, seed)
        assert torch.equal(out[0], x.flip(0))  # every row, copied by the other warp, visible
        assert torch.isnan(out[1]).all()       # the second tile was never written
    assert probe.accesses == {"in": 64, "out": 2 * 64 * 8}


@pytest.mark.parametrize("kind", (1, 2, 4), ids=("no_wait", "no_barrier", "never_committed"))
def test_cp_async_catches_a_missing_wait_or_barrier(probe, kind):
    for seed in (1, 2, 3):
        _, out = probe.cp_async(kind, seed)
        if kind == 2:  # the warp that runs first reads the other warp's rows before they were copied
            assert torch.isnan(out[0, :32]).all() or torch.isnan(out[0, 32:]).all()
        else:
            assert torch.isnan(out[0]).all()


def test_cp_async_wait_group_counts_groups(probe):
    x, out = probe.cp_async(3)
    assert torch.equal(out[0], x.flip(0))  # the older group landed
    assert torch.isnan(out[1]).all()       # the most recent one is still pending (wait_group 1)


def test_cp_async_catches_an_overwrite_before_the_barrier(probe):
    x, out = probe.cp_async(11)
    assert torch.equal(out[0], x.flip(0))
    for seed in (1, 2, 3):
        _, out = probe.cp_async(12, seed)
        assert not torch.equal(out[0], x.flip(0))  # a warp read the row another warp overwrote


@pytest.mark.parametrize("kind,message", [
    (5, (r"out-of-bounds read of 16 bytes at byte offset 1024 of `in` \(global memory, 1024 bytes: 16 bytes past "
         r"its end\) \(thread 63 of block \(0, 0, 0\) of cp_async_probe_kernel\)")),
    (6, r"misaligned read of 16 bytes at byte offset 2 of `in` \(global memory; needs 16-byte alignment\)"),
    (7, r"cp.async destination not in shared memory \(it points into out\)"),
    (8, r"cp.async source not in global memory \(it points into shared memory\)"),
    (9, (r"out-of-bounds access \(read or write\) of 16 bytes at byte offset 2048 of `shared memory` \(shared memory, "
         r"2048 bytes: 16 bytes past its end\)")),
    (10, (r"misaligned access \(read or write\) of 16 bytes at byte offset 8 of `shared memory` \(shared memory; "
          r"needs 16-byte alignment\)")),
], ids=["source_past_the_end", "source_misaligned", "destination_global", "source_shared", "destination_past_the_end",
        "destination_misaligned"])
def test_cp_async_checks_its_addresses(probe, kind, message):
    with pytest.raises(EmulatorError, match=message):
        probe.cp_async(kind)


def test_extract_refuses_a_changed_cp_async():
    # The cp.async helpers are emulated from their PTX: a changed instruction must stop the extraction.
    header = (HERE.parents[1] / "csrc" / "cuda" / "mma_sm80.cuh").read_text()
    for old, new, name in (("cp.async.wait_group %0", "cp.async.wait_all", "cp_async_wait"),
                           ("cp.async.cg.shared.global [%0], [%1], 16;", "cp.async.ca.shared.global [%0], [%1], 8;",
                            "cp_async16"),
                           ("cp.async.commit_group;", "cp.async.wait_all;", "cp_async_commit")):
        changed = header.replace(old, new, 1)
        assert changed != header
        with pytest.raises(extract.ExtractError, match=name):
            extract.extract_device_code(PROBE_CU, {"mma_sm80.cuh": changed}, name="probe.cu")

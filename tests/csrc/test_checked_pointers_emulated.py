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

PROBE_CU = r"""// A probe kernel for the checked pointers (not a project kernel).
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
"""


class Probe(emu_build.Library):
    def __init__(self, path):
        super().__init__(path)
        self.lib.emu_probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.lib.emu_probe_freed.argtypes = [ctypes.c_void_p, ctypes.c_int]

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


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_emulator_probe")
    code = extract.extract_device_code(PROBE_CU, name="probe.cu")
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

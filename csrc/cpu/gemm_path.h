// The CPU kernels' tile-GEMM path, chosen at run time (issue 25).
//
//   native  attnkit's own register-blocked tiles (csrc/cpu/flash_tiles.h): FMA on the vector
//           width the build was compiled for (-march), or AVX512-BF16 dot products where compiled in.
//   brgemm  at::native::cpublas::brgemm (ATen/native/CPUBlas.h), oneDNN's batch-reduce GEMM
//           micro-kernel that libtorch exports: JIT-compiled AMX tiles on Intel Xeons that have
//           them.  Its B operand comes VNNI-packed ("pairs": element (k, n) at
//           ((k / 2) * ld_b + n) * 2 + k % 2, K even) where cpublas::could_pack(dtype) -- i.e. where
//           oneDNN runs it on AMX -- and plain row-major [K][ld_b] elsewhere (torch's reference
//           fallback: exact, slow; only for forcing the path on a CPU without AMX, the tests).
//
// The choice, per call and dtype: ATTNKIT_CPU_GEMM=auto (default) | native | brgemm.  auto takes
// brgemm for bfloat16 / float16 only where the CPU has the AMX tiles of that dtype (CPUID) and
// could_pack(dtype) holds -- never on AMD EPYC (no AMX), whose native kernels are the faster
// ones -- and native otherwise.  float32 / float64 always run native.  The softmax forward,
// backward and decoding kernels have the choice (csrc/cpu/softmax.cpp); the other families not yet.
// Every brgemm call zero-pads its K (reduction) dimension to a multiple of 32 (zeros in both
// operands) or has a left operand that holds no NaN: torch 2.13's oneDNN on AMX writes a NaN of
// left-operand row i + 1 into output row i when K > 32 and K % 32 != 0 (DESIGN.md).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>

namespace attnkit {

enum class GemmPath { kNative, kBrgemmVnni, kBrgemmPlain };

// The path the softmax kernels' tile GEMMs take for `dtype` in this call (reads
// ATTNKIT_CPU_GEMM; raises on a value other than auto, native, brgemm).
GemmPath cpu_gemm_path(at::ScalarType dtype);

// "native", "brgemm (AMX, VNNI)" or "brgemm (no VNNI: reference fallback)".
std::string gemm_path_name(GemmPath path);

// Whether the CPU has AMX tiles for `dtype` (bfloat16: AMX-TILE + AMX-BF16; float16: AMX-TILE +
// AMX-FP16), by CPUID leaf 7.
bool cpu_has_amx(at::ScalarType dtype);

// C [M][ldc] (+)= A [M][lda] B, 16-bit A and B (scalar_t: at::BFloat16 or at::Half, given as raw
// bits), C float32; B VNNI-packed (vnni) or plain [K][ldb].  K even when vnni.
template <typename scalar_t>
inline void brgemm16(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                     const uint16_t* A, const uint16_t* B, float* C, bool vnni) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, reinterpret_cast<const scalar_t*>(A),
                              reinterpret_cast<const scalar_t*>(B), C, vnni);
}

// Ends a worker thread's use of brgemm (oneDNN's AMX tile state) when it dies: a member of the
// scratch that run_tasks (flash_tiles.h) builds per worker inside the parallel region, so that
// brgemm_release runs at the end of each thread's share of it.  Movable (the scratch is built
// by value and moved); only the last owner releases.
class BrgemmRelease {
 public:
  BrgemmRelease() = default;
  BrgemmRelease(bool active, bool vnni) : active_(active), vnni_(vnni) {}
  BrgemmRelease(BrgemmRelease&& o) noexcept : active_(o.active_), vnni_(o.vnni_) { o.active_ = false; }
  BrgemmRelease& operator=(BrgemmRelease&& o) noexcept {
    std::swap(active_, o.active_);
    std::swap(vnni_, o.vnni_);
    return *this;
  }
  BrgemmRelease(const BrgemmRelease&) = delete;
  BrgemmRelease& operator=(const BrgemmRelease&) = delete;
  ~BrgemmRelease() {
    if (active_) at::native::cpublas::brgemm_release(vnni_);
  }

 private:
  bool active_ = false;
  bool vnni_ = false;
};

}  // namespace attnkit

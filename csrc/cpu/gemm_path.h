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
//   amx     the decoding kernel's own AMX tiles (GemmPath::kAmxTiles, csrc/cpu/amx_tiles.h):
//           bfloat16 K read in place by tile loads, S^T = K Q^T and O += P V on AMX, the online
//           softmax in AVX-512 between them.  Every other kernel takes brgemm under this setting.
//
//   split   float16 on a CPU whose AMX multiplies bfloat16 but not float16 (Sapphire / Emerald
//           Rapids: AMX-BF16, no AMX-FP16): each float16 operand x is split into two bfloat16,
//           hi = bf16(x) and lo = x - hi -- exact, a float16's 11 significant bits being at most
//           8 + 3 -- and a product ab is taken as the products of the parts on brgemm's bfloat16
//           AMX tiles (GemmPath::kSplitBf16), each exact in float32 (float16 x float16: all four;
//           float32 P or dS x float16: three, P and dS kept to 16 bits).  The softmax flash tiles only (GemmUse::kSoftmax; csrc/cpu/split16.h
//           has the operands); kSplitBf16Emulated is the same on the emulated brgemm (scalar: the
//           tests, on any CPU).  Taken by auto there: B=1 H=8 float16, 2 threads, Xeon with AMX
//           (session 21), against torch SDPA, native tiles -> split: forward N=256 D=64 0.65x ->
//           1.11x, N=1024 D=128 0.83x -> 1.38x; forward+backward N=1024 D=128 0.99x -> 1.32x.
//
//   emulate attnkit's scalar model of the AMX brgemm (brgemm16_emulated below): the VNNI packing of
//           the brgemm path checked on any CPU, with oneDNN's K-tail NaN defect reproduced so that
//           the guard against it is tested too.  Exact float32 sums of 16-bit products; slow: for
//           the tests, never chosen by auto.
//
// The choice, per call and dtype: ATTNKIT_CPU_GEMM=auto (default) | native | brgemm | amx | split | emulate.  auto takes
// brgemm for bfloat16 / float16 only where the CPU has the AMX tiles of that dtype (CPUID) and
// could_pack(dtype) holds -- never on AMD EPYC (no AMX), whose native kernels are the faster
// ones -- and native otherwise.  float32 / float64 always run native.  Kernels with the choice:
// softmax forward, backward and decoding (csrc/cpu/softmax.cpp); the sparse range, block-sparse and
// fused strided kernels, forward and backward (csrc/cpu/sparse.cpp; the star ops' scattered dot
// products are no tile GEMM); the Hopfield update and energy forwards (csrc/cpu/hopfield.cpp;
// their backwards run on torch); the linear chunk products, forward and backward, but those with
// the running state, kept float32 (csrc/cpu/linear.cpp).
// Every brgemm call zero-pads its K (reduction) dimension to a multiple of 32 (zeros in both
// operands) or has a left operand that holds no NaN: torch 2.13's oneDNN on AMX writes a NaN of
// left-operand row i + 1 into output row i when K > 32 and K % 32 != 0 (DESIGN.md).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace attnkit {

enum class GemmPath { kNative, kBrgemmVnni, kBrgemmPlain, kBrgemmEmulated, kAmxTiles, kSplitBf16, kSplitBf16Emulated };

// Whether the path runs its products through brgemm16 on the operands' own dtype (oneDNN's brgemm
// or its emulation).  The split paths run brgemm16 too, but on bfloat16 parts: see is_split.
inline bool is_brgemm(GemmPath path) {
  return path == GemmPath::kBrgemmVnni || path == GemmPath::kBrgemmPlain || path == GemmPath::kBrgemmEmulated;
}

// Whether float16 operands are split into bfloat16 pairs (hi, lo) on brgemm (see "split" above).
inline bool is_split(GemmPath path) {
  return path == GemmPath::kSplitBf16 || path == GemmPath::kSplitBf16Emulated;
}

// Whether the path's B operands are VNNI-packed (pairs of K rows interleaved).
inline bool brgemm_vnni_layout(GemmPath path) {
  return path == GemmPath::kBrgemmVnni || path == GemmPath::kBrgemmEmulated || is_split(path);
}

// What the GEMMs serve: the flash tiles (every family's forward and backward tiles, the
// block-sparse ones included), the softmax decoding kernel (N <= 16 query rows against a long KV
// cache: memory-bound), the sparse range and fused strided kernels (short ragged key ranges), or
// the linear-attention chunk products (float32 tiles rounded to 16 bits per product).
// kSoftmax: the softmax flash tiles, forward and backward -- kTiles, and the only use that takes
// the float16 split (above).
enum class GemmUse { kTiles, kDecode, kSparseRanges, kLinear, kSoftmax };

// The path the kernels' tile GEMMs take for `dtype` in this call (reads ATTNKIT_CPU_GEMM; raises
// on a value other than auto, native, brgemm, emulate).  auto gives the decoding kernel the native
// path on every CPU: its bfloat16 K and V are read in place by AVX512-BF16 dot products there,
// where brgemm needs them repacked per tile -- B=8 Hq=32 Hk=8 N=1 D=128 bfloat16 on a Xeon with
// AMX (session 17, `bench/softmax_cpu_speed.py decode --dtype bfloat16`): 1.68x SDPA native
// against 1.41x brgemm at M=4096, 1.94x against 1.82x at M=16384.  And the sparse range and fused
// strided kernels (B=1 H=8 N=4096 D=64 bfloat16, same Xeon, /tmp/w/sparse_cmp.py, native speed over
// brgemm's): strided(64) forward 2.00x, forward+backward 1.79x; fixed(64) 1.50x / 1.11x -- while
// the block-sparse kernel (64-blocks, density 0.1) is faster on brgemm: 0.74x / 0.75x native.
// And linear attention (B=1 H=8 D=64 bfloat16, /tmp/w/lin_cmp.py): causal N=1024 / 4096 forward
// 2.87x / 2.87x, forward+backward 3.01x / 3.26x; non-causal N=1024 1.04x / 1.32x -- brgemm there
// rounds each product's float32 tiles to 16 bits (scalar), and its bfloat16 phi(q), phi(k) were
// one ulp off in tests/fuzz's recurrent-step column where the native float32 tiles were not.
// A forced path (brgemm, emulate, native) holds for all of them.  Session 20: the bfloat16 decoding
// kernel takes its own AMX tiles under auto where they run (amx_tiles_available; amx forces them):
// same Xeon, one thread, K and V in cache (B=1 Hq=32 Hk=8 N=1 D=128 M=256) 45 -> 31 ns a key and
// kv head; M=4096 (B=8) 68.5 -> 52-54 ns; `bench/softmax_cpu_speed.py decode --dtype bfloat16`, 2
// threads: M=4096 1.62x -> 1.92x SDPA, M=16384 2.00x -> 2.64x (12.8-13.9 -> 17.6 GB/s of K and V).
GemmPath cpu_gemm_path(at::ScalarType dtype, GemmUse use = GemmUse::kTiles);

// The decoding kernel's path for `rows` query rows per kv head (N G): cpu_gemm_path(dtype,
// GemmUse::kDecode), except that under auto the own AMX tiles take 4 rows or more only -- the
// native dot products measured faster below (B=2 Hk=8 M=16384 and B=1 Hk=1 M=262144, N=1,
// bfloat16, 2 threads, Xeon with AMX; native time / tiles' time): G=1 0.65-0.88, G=2 0.89-1.04,
// G=4 0.93-1.50, G=8 1.34-1.65 (D 64 and 128).  A forced amx takes them for any count.
GemmPath cpu_decode_path(at::ScalarType dtype, int64_t rows);

// "native", "brgemm (AMX, VNNI)", "brgemm (no VNNI: reference fallback)" or
// "brgemm emulated (VNNI layout, scalar: tests)".
std::string gemm_path_name(GemmPath path);

// Whether the native kernels of `use` multiply bfloat16 by AVX512-BF16 dot products (vdpbf16ps:
// the softmax forward's Q K^T and P V, kSoftmax; the decoding kernel's scores and P V, kDecode) in
// this call, rather than on operands widened to float32 (FMA tiles; P kept in float32).  False
// where the build has no AVX512-BF16.  ATTNKIT_CPU_BF16=auto (default) | dot | float32 (raises on
// another value, on every call).  auto: the dot products on AMD only, for the flash tiles and
// the decoding kernel alike.  Why: one vdpbf16ps zmm is 32 multiply-adds, one vfmadd231ps 16, but
// on the Xeon (Emerald Rapids, family 6 model 207, AMX hidden by its VM) the dot product issues
// once per ~2 cycles against two FMAs a cycle: 0.743 ns against 0.182 ns an instruction, 86
// against 176 GFLOP/s a core (bench/cpu_micro/dot_vs_fma.c, session 26), so the float32 tiles are
// 2x the dot products' peak there: bfloat16 forward, B=1 H=8, 2 threads, against torch SDPA,
// dot -> float32: N=1024 D=64 1.12x -> 1.83x, causal 1.60x -> 2.52x, N=2048 D=128 causal 1.30x ->
// 2.13x.  On AMD EPYC (Zen 5) the dot path is the one that measured 2-3.5x torch SDPA in
// bfloat16 (bench/RESULTS.md).  The decoding kernel (B=8 Hq=32 Hk=8 N=1 D=128, same Xeon,
// 2 threads, `bench/softmax_cpu_speed.py decode --dtype bfloat16`): it took the dot products
// under auto until its widened scores ran 4 rows x 4 keys at a time (softmax.cpp decode_dots4,
// session 27): M=4096 8.05 ms widened against 9.87 ms dot (1.53x against 1.25x SDPA), M=16384
// 32.4 against 38.6 ms (2.18x against 1.83x).
bool cpu_bf16_dot_products(GemmUse use);

// Whether the decoding kernel's own AMX tiles (GemmPath::kAmxTiles) can run `dtype` here: built
// in (amx_tiles.h), bfloat16, the CPU's AMX-BF16, the OS's grant of the tile state.
bool amx_tiles_available(at::ScalarType dtype);

// Whether the CPU has AMX tiles for `dtype` (bfloat16: AMX-TILE + AMX-BF16; float16: AMX-TILE +
// AMX-FP16), by CPUID leaf 7.
bool cpu_has_amx(at::ScalarType dtype);

// The emulated brgemm (GemmPath::kBrgemmEmulated): C [M][ldc] (+)= A [M][lda] B for 16-bit A and
// B (bfloat16 when bf16, else float16; raw bits), B VNNI-packed, float32 sums in k order.  It
// checks what oneDNN's AMX kernel needs of the call (K even, lda >= K, ldb and ldc >= N) and
// reproduces the defect of torch 2.13's oneDNN on AMX (DESIGN.md): when K > 32 and K % 32 != 0,
// a NaN in row i + 1 of A makes all of output row i NaN here (the real kernel spreads it to some
// of the row; all of it is the stricter test of the guard).
void brgemm16_emulated(bool bf16, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                       bool add_C, const uint16_t* A, const uint16_t* B, float* C);

// C [M][ldc] (+)= A [M][lda] B, 16-bit A and B (scalar_t: at::BFloat16 or at::Half, given as raw
// bits), C float32, on `path` (a brgemm one): B VNNI-packed (brgemm_vnni_layout(path), K even) or
// plain [K][ldb].
template <typename scalar_t>
inline void brgemm16(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                     const uint16_t* A, const uint16_t* B, float* C, GemmPath path) {
  if (path == GemmPath::kBrgemmEmulated || path == GemmPath::kSplitBf16Emulated) {
    brgemm16_emulated(std::is_same_v<scalar_t, at::BFloat16>, M, N, K, lda, ldb, ldc, add_C, A, B, C);
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, reinterpret_cast<const scalar_t*>(A),
                              reinterpret_cast<const scalar_t*>(B), C, brgemm_vnni_layout(path));
}

// Ends a worker thread's use of brgemm (oneDNN's AMX tile state) when it dies: a member of the
// scratch that run_tasks (flash_tiles.h) builds per worker inside the parallel region, so that
// brgemm_release runs at the end of each thread's share of it.  Movable (the scratch is built
// by value and moved); only the last owner releases.
class BrgemmRelease {
 public:
  BrgemmRelease() = default;
  // Active for oneDNN's paths only (the native and emulated ones hold no oneDNN state).
  explicit BrgemmRelease(GemmPath path)
      : active_(path == GemmPath::kBrgemmVnni || path == GemmPath::kBrgemmPlain || path == GemmPath::kSplitBf16),
        vnni_(path == GemmPath::kBrgemmVnni || path == GemmPath::kSplitBf16) {}
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

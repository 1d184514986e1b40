// CPU kernels of linear (kernelized) attention, forward and backward.
//
//   linear_fwd(q [B,H,N,D], k [B,H,M,D], v [B,H,M,Dv], S0?, z0?, causal, feature_map,
//              normalize, eps, scale) -> (out [B,H,N,Dv], den [B,H,N], S [B,H,D,Dv], z [B,H,D])
//   linear_bwd(grad_out?, grad_den?, grad_S?, grad_z?, q, k, v, out, den, S, z, S0?, z0?,
//              causal, feature_map, normalize, eps, scale) -> (dq, dk, dv, dS0, dz0)
//
// With P = phi(Q), K' = phi(K) (phi fused into the packing of each chunk) and the state
// S = S0 + sum_j phi(k_j) v_j^T, z = z0 + sum_j phi(k_j) (the sums over the keys each query
// sees: all of them, or j <= i when causal):
//   num_i = phi(q_i)^T S_i,  den_i = phi(q_i) . z_i,
//   out_i = num_i / (den_i + eps) (normalize) or scale * num_i.
// den is returned raw (without eps), in the accumulation type: the backward needs it.  S and
// z are the final state (causal) or the full sums (non-causal), S0 + ..., z0 + ....
//
// Causal forward, per (b, h), chunks of kChunk rows in order (L rows in this chunk):
//   A   = P_c K'_c^T o tril                  (L x L)
//   num = A V_c + P_c S_prev,   den = rowsum(A) + P_c z_prev
//   S_prev += K'_c^T V_c,       z_prev += colsum(K'_c)
// Non-causal: one reduction pass for S and z (split over key chunks when B*H is smaller than
// the thread count), then one apply pass num = P S, den = P z over (b, h, query chunk).
//
// Backward.  From the upstream gradients: dnum_i = g_i / r_i and
// dden_i = -(g_i . out_i) / r_i (+ grad_den_i) with r_i = den_i + eps (normalize), or
// dnum_i = scale g_i.  Then, with the suffix sums R_j = grad_S + sum_{i >= j} phi(q_i) dnum_i^T,
// w_j = grad_z + sum_{i >= j} dden_i phi(q_i):
//   dphi(q_i) = dnum_i S_i^T + dden_i z_i        (S_i, z_i: the prefix state query i sees)
//   dphi(k_j) = R_j v_j + w_j,   dv_j = R_j^T phi(k_j),   dS0 = R_0,   dz0 = w_0.
// Causal: two sweeps per (b, h), run as independent tasks -- a forward sweep (dq: prefix state
// S^T rebuilt chunk by chunk) and a reverse sweep (dk, dv: suffix state R built from the end),
// each with the intra-chunk terms dA = (dnum V_c^T + dden 1^T) o tril and A as small GEMMs.
// Never an N x D x Dv tensor; extra memory is O(kChunk (D + Dv + kChunk) + D Dv) per thread.
//
// Accumulation (GEMMs, states, den): float32, float64 for float64 inputs.  GEMMs: a
// register-blocked micro-kernel (AVX-512 / AVX2+FMA intrinsics, scalar fallback) on packed,
// zero-padded tiles; the triangular products skip the blocks the mask zeroes.  bfloat16 /
// float16 inputs off the native path (ATTNKIT_CPU_GEMM, gemm_path.h) run the products of chunk
// tiles (scores, A V, dA, the backward's state updates) on brgemm with 16-bit operands, and the
// products that read the running state, and the forward's state updates, in float32 as above:
// see chunk_gemm and add_outer.
#include "torch_headers.h"
#include "convert16.h"
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../checks/checks.h"
#include "aligned_vector.h"
#include "gemm_path.h"
#include "parallel_tasks.h"
#include "simd_f32.h"

namespace attnkit {
namespace {

// Rows per chunk.  64 keeps a chunk's tiles (P, K', V, A, ...) in L1/L2 for D, Dv <= 128 and
// the intra-chunk L x L products as large as the state products (L = D = 64).
constexpr int64_t kChunk = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ---------------------------------------------------------------------------------------------
// SIMD wrapper: one vector of W values of T.  W is also the padding unit of every packed tile's
// row length, so the micro-kernel works on whole vectors only.
// ---------------------------------------------------------------------------------------------
template <typename T>
struct Simd;

// One specialization per (element type, instruction set); PFX/SFX name the intrinsics
// (PFX##_loadu_##SFX is _mm512_loadu_ps, _mm256_loadu_pd, ...).
#define ATTNKIT_LINEAR_SIMD(T, VT, WIDTH, PFX, SFX)                      \
  template <>                                                            \
  struct Simd<T> {                                                       \
    using V = VT;                                                        \
    static constexpr int W = WIDTH;                                      \
    static V zero() { return PFX##_setzero_##SFX(); }                    \
    static V load(const T* p) { return PFX##_loadu_##SFX(p); }           \
    static void store(T* p, V v) { PFX##_storeu_##SFX(p, v); }           \
    static V set1(T a) { return PFX##_set1_##SFX(a); }                   \
    static V fma(V a, V b, V c) { return PFX##_fmadd_##SFX(a, b, c); }   \
  };
#if defined(__AVX512F__)
ATTNKIT_LINEAR_SIMD(float, __m512, 16, _mm512, ps)
ATTNKIT_LINEAR_SIMD(double, __m512d, 8, _mm512, pd)
#elif defined(__AVX2__) && defined(__FMA__)
ATTNKIT_LINEAR_SIMD(float, __m256, 8, _mm256, ps)
ATTNKIT_LINEAR_SIMD(double, __m256d, 4, _mm256, pd)
#else
template <typename T>
struct ScalarSimd {
  using V = T;
  static constexpr int W = 1;
  static V zero() { return T(0); }
  static V load(const T* p) { return *p; }
  static void store(T* p, V v) { *p = v; }
  static V set1(T a) { return a; }
  static V fma(V a, V b, V c) { return a * b + c; }
};
template <>
struct Simd<float> : ScalarSimd<float> {};
template <>
struct Simd<double> : ScalarSimd<double> {};
#endif
#undef ATTNKIT_LINEAR_SIMD

// ---------------------------------------------------------------------------------------------
// GEMM on packed tiles:  C[r][c] (+)= sum_k A(r, k) B[k][c],  A(r, k) = A[r * sar + k * sak]
// (so A may be read transposed), B and C row-major with n (the column count) a multiple of W.
// Structure tells which blocks can be skipped because a triangular mask zeroes them:
//   kOutLower  C is lower triangular (c <= r): column blocks right of the diagonal are skipped
//   kOutUpper  C is upper triangular (c >= r): column blocks left of the diagonal are skipped
//   kLeftLower A(r, k) = 0 for k > r;  kLeftUpper A(r, k) = 0 for k < r
//   kRightLower B[k][c] = 0 for c > k
// Skipped blocks of C are not written: the caller masks C (kOut*) or never reads them.
// ---------------------------------------------------------------------------------------------
enum class Tri { kFull, kOutLower, kOutUpper, kLeftLower, kLeftUpper, kRightLower };

constexpr int kRows = 4;  // rows of C per micro-tile
constexpr int kVecs = 4;  // vectors of C per micro-tile row (4 x 4 accumulators)

template <typename T, int R, int NV>
void micro_tile(int64_t k0, int64_t k1, const T* A, int64_t sar, int64_t sak, const T* B,
                int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  using S = Simd<T>;
  using V = typename S::V;
  constexpr int W = S::W;
  V c[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? S::load(C + r * ldc + v * W) : S::zero();
  for (int64_t k = k0; k < k1; ++k) {
    V b[NV];
    const T* brow = B + k * ldb;
    for (int v = 0; v < NV; ++v) {
      b[v] = S::load(brow + v * W);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      // Keep the row of B in registers: without this gcc folds the load into each of the R
      // FMAs that use it (R loads of B per k instead of 1), and the loop became load-bound:
      // a 64x64x64 product ran at 211 GF/s against 266 GF/s with the barrier (one thread,
      // AVX-512, this machine's AMD EPYC; /tmp/s4/overhead/mb/mb.cpp).
      asm("" : "+v"(b[v]));
#endif
    }
    for (int r = 0; r < R; ++r) {
      const V a = S::set1(A[r * sar + k * sak]);
      for (int v = 0; v < NV; ++v) c[r][v] = S::fma(a, b[v], c[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) S::store(C + r * ldc + v * W, c[r][v]);
}

template <typename T>
using TileFn = void (*)(int64_t, int64_t, const T*, int64_t, int64_t, const T*, int64_t, T*,
                        int64_t, bool);

template <typename T, int R>
constexpr TileFn<T> tile_for(int nv) {
  return nv == 1 ? &micro_tile<T, R, 1>
       : nv == 2 ? &micro_tile<T, R, 2>
       : nv == 3 ? &micro_tile<T, R, 3>
                 : &micro_tile<T, R, 4>;
}

template <typename T>
TileFn<T> pick_tile(int rows, int nv) {
  switch (rows) {
    case 1: return tile_for<T, 1>(nv);
    case 2: return tile_for<T, 2>(nv);
    case 3: return tile_for<T, 3>(nv);
    default: return tile_for<T, 4>(nv);
  }
}

template <typename T>
void gemm(Tri tri, int64_t m, int64_t n, int64_t K, const T* A, int64_t sar, int64_t sak,
          const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  constexpr int W = Simd<T>::W;
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
    int64_t c_begin = 0, c_end = n;
    if (tri == Tri::kOutLower) c_end = std::min(n, round_up(r0 + rows, W));
    if (tri == Tri::kOutUpper) c_begin = (r0 / W) * W;
    int64_t k0 = 0, k1 = K;
    if (tri == Tri::kLeftLower) k1 = std::min(K, r0 + rows);
    if (tri == Tri::kLeftUpper) k0 = std::min(K, r0);
    for (int64_t c0 = c_begin; c0 < c_end; c0 += kVecs * W) {
      const int nv = static_cast<int>(std::min<int64_t>(kVecs, (c_end - c0) / W));
      const int64_t kb = tri == Tri::kRightLower ? std::min(K, c0) : k0;
      pick_tile<T>(rows, nv)(kb, k1, A + r0 * sar, sar, sak, B + c0, ldb, C + r0 * ldc + c0,
                             ldc, accumulate);
    }
  }
}

// The same product summed over exactly the k that the mask keeps, in plain loops, for the
// triangular modes with the zeros in an operand (kLeftLower, kLeftUpper, kRightLower).  The
// blocked gemm skips whole blocks past the diagonal, but a micro-tile that straddles it still
// multiplies the mask's zeros by the other operand, and 0 * NaN = NaN, 0 * inf = NaN: a NaN in
// v_j reached up to 3 rows i < j of the causal output (a micro-tile has 4 rows), and in the
// backward a NaN in k, dnum or q reached gradients of rows that cannot see it (up to 15
// columns past the diagonal for kRightLower).  gemm_tri below runs these loops only for a chunk
// whose other operand is not all finite.
template <typename T>
void gemm_exact(Tri tri, int64_t m, int64_t n, int64_t K, const T* A, int64_t sar, int64_t sak,
                const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      int64_t k0 = 0, k1 = K;
      if (tri == Tri::kLeftLower) k1 = std::min(K, r + 1);
      if (tri == Tri::kLeftUpper) k0 = std::min(K, r);
      if (tri == Tri::kRightLower) k0 = std::min(K, c);
      T sum = accumulate ? C[r * ldc + c] : T(0);
      for (int64_t k = k0; k < k1; ++k) sum += A[r * sar + k * sak] * B[k * ldb + c];
      C[r * ldc + c] = sum;
    }
}

// Whether n values are all finite: x - x is 0 for those, NaN for NaN and +-inf.
template <typename T>
bool all_finite(const T* x, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] - x[i];
  return s == T(0);
}

// A triangular product (kLeftLower, kLeftUpper: the zeros in A; kRightLower: in B) whose other
// operand's tile has `finite` all-finite values: the blocked gemm, else gemm_exact.  The check
// reads the other tile once (L x D values against L x L x D / 2 multiply-adds of the product).
template <typename T>
void gemm_tri(bool finite, Tri tri, int64_t m, int64_t n, int64_t K, const T* A, int64_t sar,
              int64_t sak, const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  if (finite)
    gemm<T>(tri, m, n, K, A, sar, sak, B, ldb, C, ldc, accumulate);
  else
    gemm_exact<T>(tri, m, n, K, A, sar, sak, B, ldb, C, ldc, accumulate);
}

// ---------------------------------------------------------------------------------------------
// The run-time brgemm path of the bfloat16 / float16 chunk products (issue 25, gemm_path.h).
// The chunk tiles are float32 (phi applied, dnum = g / r, the scores A and dA), so the brgemm
// path rounds both operands of a product to the inputs' 16-bit type, as the reference run in that
// type rounds its operands, and sums in float32 into the same float32 C.  Rules:
//   - K (the reduction dim) is zero-padded to a multiple of 32 in both operands: a left operand
//     may hold NaN (a NaN query or key row gives NaN score rows), and oneDNN on AMX writes a NaN
//     of row i + 1 into row i when K > 32 and K % 32 != 0 (gemm_path.h).
//   - brgemm is dense: the triangular products run it only when the caller's `finite` holds
//     (the operand without the mask's zeros is all finite), the masked triangle already being
//     zeros in the packed float tile; otherwise gemm_exact, as on the native path.
//   - a finite value that rounds to +-inf (float16 past 65504: the scores and dnum are not
//     bounded by the inputs' range) sends the product back to the float32 path.
// The products that read the running state (phi(Q) S, dnum S^T, phi(K) R, R V^T) stay float32 on
// every path: routed as well (the state rounded to 16 bits per chunk), they still met DESIGN.md's
// rule, but with less margin as the prefix grows -- bfloat16, causal elu, N = 4096, D = Dv = 64,
// values of mean 2, emulate: dv's error 0.63 of the rule's bar against 0.44 with them float32
// (native 0.36); the other outputs and gradients <= 0.35 either way.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kBrgemmK = 32;  // the K multiple that keeps oneDNN's AMX kernel off its K tail

// The bits of x rounded to scalar_t; ok turns false when a finite x overflows to +-inf.
template <typename scalar_t>
inline uint16_t round16(float x, bool& ok) {
  const scalar_t r(x);
  ok = ok && !(std::isfinite(x) && std::isinf(static_cast<float>(r)));
  return r.x;
}

// a16 [m][Kp] = A(r, k) = A[r * sar + k * sak] rounded, columns [K, Kp) zero.
template <typename scalar_t>
bool pack_left16(int64_t m, int64_t K, int64_t Kp, const float* A, int64_t sar, int64_t sak,
                 uint16_t* a16) {
  bool ok = true;
  for (int64_t r = 0; r < m; ++r) {
    uint16_t* row = a16 + r * Kp;
    for (int64_t k = 0; k < K; ++k) row[k] = round16<scalar_t>(A[r * sar + k * sak], ok);
    std::fill(row + K, row + Kp, uint16_t(0));
  }
  return ok;
}

// b16 = B [K][ldb] (n columns) rounded, rows [K, Kp) zero, as brgemm's B of leading dim n:
// VNNI pairs (element (k, c) at ((k / 2) n + c) 2 + k % 2) or plain [Kp][n].
template <typename scalar_t>
bool pack_right16(int64_t n, int64_t K, int64_t Kp, const float* B, int64_t ldb, bool vnni,
                  uint16_t* b16) {
  bool ok = true;
  for (int64_t k = 0; k < Kp; ++k)
    for (int64_t c = 0; c < n; ++c) {
      const uint16_t bits = k < K ? round16<scalar_t>(B[k * ldb + c], ok) : uint16_t(0);
      b16[vnni ? ((k / 2) * n + c) * 2 + k % 2 : k * n + c] = bits;
    }
  return ok;
}

// C [m][ldc] (+)= round16(A) round16(B) by brgemm16 on `path`; false (C untouched) when a finite
// value overflowed in the rounding or K is 0.
template <typename scalar_t>
bool brgemm_rounded(GemmPath path, int64_t m, int64_t n, int64_t K, const float* A, int64_t sar,
                    int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc,
                    bool accumulate) {
  if (m == 0 || n == 0 || K == 0) return false;
  const int64_t Kp = round_up(K, kBrgemmK);
  thread_local avec<uint16_t> a16, b16;         // per worker, grown to the largest product
  a16.resize(std::max<size_t>(a16.size(), static_cast<size_t>(m * Kp)));
  b16.resize(std::max<size_t>(b16.size(), static_cast<size_t>(Kp * n)));
  if (!pack_left16<scalar_t>(m, K, Kp, A, sar, sak, a16.data())) return false;
  if (!pack_right16<scalar_t>(n, K, Kp, B, ldb, brgemm_vnni_layout(path), b16.data())) return false;
  brgemm16<scalar_t>(m, n, Kp, Kp, n, ldc, accumulate, a16.data(), b16.data(), C, path);
  return true;
}

// A chunk product of the kernels below: on the brgemm path for bfloat16 / float16 inputs off
// native when `finite` holds (see above), else gemm_tri -- which is what the native path and
// float32 / float64 run, unchanged (with finite = true for the kFull / kOut* products: gemm).
template <typename scalar_t, typename T>
void chunk_gemm(GemmPath path, bool finite, Tri tri, int64_t m, int64_t n, int64_t K, const T* A,
                int64_t sar, int64_t sak, const T* B, int64_t ldb, T* C, int64_t ldc,
                bool accumulate) {
  if constexpr (std::is_same_v<T, float> &&
                (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>)) {
    if (path != GemmPath::kNative && finite &&
        brgemm_rounded<scalar_t>(path, m, n, K, A, sar, sak, B, ldb, C, ldc, accumulate))
      return;
  }
  gemm_tri<T>(finite, tri, m, n, K, A, sar, sak, B, ldb, C, ldc, accumulate);
}

// ---------------------------------------------------------------------------------------------
// Feature maps, fused into packing.
// ---------------------------------------------------------------------------------------------
enum class FeatureMap { kElu, kRelu, kIdentity };

// name: checked by checks::linear_fwd / linear_bwd (csrc/checks/linear.cpp).
FeatureMap parse_feature_map(std::string_view name) {
  if (name == "elu") return FeatureMap::kElu;
  if (name == "relu") return FeatureMap::kRelu;
  ATTNKIT_CHECK(name == "identity", "attnkit::linear (cpu): unchecked feature_map ", name);
  return FeatureMap::kIdentity;
}

// exp(x) for x <= 0 in float, written so that loops over it vectorize: x = k ln2 + r with
// |r| <= ln2/2 (+ rounding), exp(r) by its degree-7 Taylor polynomial (relative error < 2e-8), 2^k built in
// the exponent bits.  Below -87 the result is exactly 0 (exp(-87) ~ 1.6e-38: an elu feature of
// that size is zero next to any other).  A clamp to exp(-87) made elu(-inf) + 1 nonzero, so a
// key of -inf times an infinite query entry gave inf where the reference's 0 * inf gives NaN,
// and elu'(-inf) * inf likewise.  NaN stays NaN.
inline float exp_nonpositive(float x) {
  const bool under = x < -87.0f;
  x = under ? -87.0f : x;
  // k = round(x log2 e) by the 1.5 * 2^23 trick (std::floor would not vectorize).
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^k from its exponent bits; memcpy rather than C++20's std::bit_cast (torch < 2.13 builds
  // extensions as C++17), and gcc folds it to the same register move, so the loop still vectorizes.
  const int32_t two_k_bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &two_k_bits, sizeof two_k);
  return under ? 0.0f : p * two_k;
}

inline double exp_nonpositive(double x) { return std::exp(x); }

// x <- phi(x) (kDerivative false) or x <- phi'(x) (true) on n values.  phi' is the derivative
// torch's autograd uses: at 0, relu' = 0, elu' = 1; at NaN, relu' = 1 (torch's threshold
// backward selects the gradient unless x <= 0) and elu' = 1 (torch's scalar elu backward, which
// the float64 reference runs on small tensors, selects on x <= 0 as well; its vectorized path,
// taken from 64 elements on, gives NaN -- torch is inconsistent there, and attnkit's CUDA and
// Triton kernels use 1, so all backends agree).
// relu' = 0 is applied as a select, not a product (see write_input_grad).  One body for both so that the two stay
// consistent; kDerivative is a compile-time constant, the loops vectorize as before.
#if defined(__AVX512F__)
inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// exp(x) for x <= 0 on 16 lanes: exp_nonpositive_v (simd_f32.h).  The loop gcc vectorized from
// the scalar version ran ~25 instructions a vector (the selects and the exponent-bit tricks, all
// masked); the elu passes were ~10% of the causal forward at N=256 (perf, one thread).

// elu(x) + 1 (kDerivative false) or elu'(x) (true) on n floats, as map_phi's scalar loop.
template <bool kDerivative>
void map_elu_ps(float* x, int64_t n) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 m = n - d >= 16 ? static_cast<__mmask16>(0xffff) : tail_mask(n - d);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + d);
    const __mmask16 pos = _mm512_cmp_ps_mask(v, zero, _CMP_GT_OQ);  // NaN: false
    const __m512 e = exp_nonpositive_v(_mm512_mask_mov_ps(v, pos, zero));  // NaN stays NaN
    __m512 y;
    if constexpr (kDerivative)
      y = _mm512_mask_mov_ps(one, _mm512_cmp_ps_mask(v, zero, _CMP_LE_OQ), e);  // elu'(NaN) = 1
    else
      y = _mm512_mask_mov_ps(e, pos, _mm512_add_ps(v, one));
    _mm512_mask_storeu_ps(x + d, m, y);
  }
}
#endif

template <bool kDerivative, typename T>
void map_phi(T* x, int64_t n, FeatureMap fm) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (fm == FeatureMap::kElu) {
      map_elu_ps<kDerivative>(x, n);
      return;
    }
  }
#endif
  switch (fm) {
    case FeatureMap::kElu:
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) {
        const T e = exp_nonpositive(x[d] > T(0) ? T(0) : x[d]);  // NaN stays NaN
        if constexpr (kDerivative)
          x[d] = x[d] <= T(0) ? e : T(1);  // elu'(NaN) = 1 (see above)
        else
          x[d] = x[d] > T(0) ? x[d] + T(1) : e;
      }
      break;
    case FeatureMap::kRelu:
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) {
        if constexpr (kDerivative)
          x[d] = x[d] <= T(0) ? T(0) : T(1);
        else
          x[d] = x[d] < T(0) ? T(0) : x[d];  // NaN stays NaN
      }
      break;
    case FeatureMap::kIdentity:
      if constexpr (kDerivative) std::fill(x, x + n, T(1));
      break;
  }
}
template <typename T>
void apply_phi(T* x, int64_t n, FeatureMap fm) { map_phi<false>(x, n, fm); }
template <typename T>
void apply_dphi(T* x, int64_t n, FeatureMap fm) { map_phi<true>(x, n, fm); }

// Vectorized reductions (the pragma allows the reassociation that a plain loop forbids).
template <typename T>
inline T sum_of(const T* x, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}
template <typename T>
inline T dot(const T* x, const T* y, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}
#if defined(__AVX512F__)
// float32: gcc ends the `omp simd` reductions above by adding the 16 lanes one after another
// (16 dependent scalar adds, ~64 cycles), which for the causal forward's short rows (den: a
// sum and a dot of <= 64 values per query row) cost more than the sums themselves; a masked
// tail and a tree reduction instead.
template <>
inline float sum_of<float>(const float* x, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(x + i));
  if (i < n) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
  return _mm512_reduce_add_ps(s);
}
template <>
inline float dot<float>(const float* x, const float* y, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), s);
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i), s);
  }
  return _mm512_reduce_add_ps(s);
}
#endif

// ---------------------------------------------------------------------------------------------
// Strided [B, H, L, X] inputs (any strides: nothing is copied to make them contiguous).
// ---------------------------------------------------------------------------------------------
template <typename scalar_t>
struct View4 {
  const scalar_t* p = nullptr;
  int64_t sb = 0, sh = 0, sn = 0, sd = 0, H = 1;
  View4() = default;
  explicit View4(const at::Tensor& t)
      : p(t.const_data_ptr<scalar_t>()), sb(t.stride(0)), sh(t.stride(1)), sn(t.stride(2)),
        sd(t.stride(3)), H(t.size(1)) {}
  // Start of the [L, X] matrix of one (b, h); row i is at base(bh) + i * sn.
  const scalar_t* base(int64_t bh) const { return p + (bh / H) * sb + (bh % H) * sh; }
};

// dst[0..n) = src row (converted), dst[n..ld) = 0.
template <typename scalar_t, typename T>
void load_row(const scalar_t* src, int64_t stride, int64_t n, T* dst, int64_t ld) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (kIs16<scalar_t> && std::is_same_v<T, float>) {
    // 16 at a time (convert16.h; c10::Half's scalar conversion does not vectorize: float16 causal
    // forward+backward B=1 H=8 N=4096 D=64 took 31.2 ms against bfloat16's 19.3, Xeon model 207
    // without AMX, 2 threads, session 26).
    if (stride == 1) {
      widen16_row(src, n, dst);
      std::fill(dst + n, dst + ld, T(0));
      return;
    }
  }
#endif
  if (stride == 1) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d * stride]);
  }
  std::fill(dst + n, dst + ld, T(0));
}

// Rows [i0, i0 + L) of a [B,H,*,X] view into dst [L][ld] (zero-padded), phi applied if asked.
template <typename scalar_t, typename T>
void pack_rows(const View4<scalar_t>& x, int64_t bh, int64_t i0, int64_t L, int64_t X, T* dst,
               int64_t ld, const FeatureMap* fm) {
  const scalar_t* src = x.base(bh) + i0 * x.sn;
  for (int64_t i = 0; i < L; ++i) {
    T* row = dst + i * ld;
    load_row(src + i * x.sn, x.sd, X, row, ld);
    if (fm) apply_phi(row, X, *fm);
  }
}

// dst[x][i] = src[i][x] for i < L, x < X; columns [L, ldd_pad) of each dst row set to 0.
template <typename T>
void transpose(const T* src, int64_t lds, int64_t L, int64_t X, T* dst, int64_t ldd,
               int64_t pad_to) {
  for (int64_t x = 0; x < X; ++x) {
    T* d = dst + x * ldd;
    for (int64_t i = 0; i < L; ++i) d[i] = src[i * lds + x];
    std::fill(d + L, d + pad_to, T(0));
  }
}

// Keep a[i][j] for j <= i (lower) or j >= i (upper) in an [L][ld] tile, zero the rest of [0, n).
template <typename T>
void mask_lower(T* a, int64_t ld, int64_t L, int64_t n) {
  for (int64_t i = 0; i < L; ++i) std::fill(a + i * ld + std::min(i + 1, n), a + i * ld + n, T(0));
}
template <typename T>
void mask_upper(T* a, int64_t ld, int64_t L, int64_t n) {
  for (int64_t i = 0; i < L; ++i) std::fill(a + i * ld, a + i * ld + std::min(i, n), T(0));
}

// ---------------------------------------------------------------------------------------------
// Threads.  dynamic_for(n, f) calls f(begin, end) on disjoint blocks covering [0, n): about 8
// blocks per thread (one per task when there are fewer), handed out by parallel_tasks
// (parallel_tasks.h: one at a time, on torch's OpenMP threads), so a thread that runs takes the
// work of one that does not.
//
// Why dynamic (issue 14, stable timings): with at::parallel_for's one static range per thread,
// the causal forward (B=1 H=8 N=16384 D=64: 8 heads, 4 per thread) ran at whatever share of a
// core the other processes left to its second thread: process CPU time per call was steady
// (53-59 ms user in 6 fresh processes, and independent of the inputs' relative alignment: 0 /
// 64 B / 4 KiB / 256 KiB gaps within 3%), while wall time per call ranged over 58-84 ms -- the
// 40 vs 75 ms "bimodal" processes of the issue.  The rest of the spread between processes was
// kernel time faulting in the fresh 32 MiB output of every call: see bench/harness.py
// steady_memory.
//
// Until session 7 the blocks went to helper jobs on torch's inter-op pool, which the OpenMP
// workers of other ops kept off the second core.  Measured (2 threads, B=1 H=8 D=64 causal elu,
// interleaved in one process, each call after an attnkit softmax call at the same N; inter-op ->
// OpenMP): forward N=16 0.039 -> 0.019 ms, N=128 0.168 -> 0.090, N=512 0.733 -> 0.370, N=2048
// 4.36 -> 2.22, N=4096 8.22 -> 4.20, N=16384 23.1 -> 22.6; forward+backward N=128 0.752 ->
// 0.462, N=2048 12.5 -> 9.6, N=16384 87.0 -> 84.8.  Linear calls alone, back to back: equal
// from N=2048 up (forward+backward N=2048 9.08 / 9.02 ms, N=4096 19.14 / 19.22 ms), and at N=16
// 0.050 -> 0.019 ms (no job to enqueue, no helper to wake).
// ---------------------------------------------------------------------------------------------
template <typename F>
void dynamic_for(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t block = ceil_div(n, std::min<int64_t>(n, 8 * at::get_num_threads()));
  parallel_tasks(ceil_div(n, block), [&](int64_t b) { f(b * block, std::min(n, (b + 1) * block)); });
}

// ---------------------------------------------------------------------------------------------
// Problem description shared by the kernels.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, typename T>
struct Problem {
  int64_t BH, N, M, D, Dv;
  int64_t Dp, Dvp;  // D, Dv rounded up to whole vectors
  FeatureMap fm;
  bool causal, normalize;
  T eps, scale;
  View4<scalar_t> q, k, v;
  const T* S0 = nullptr;  // [BH][D][Dv] contiguous, or null (zero initial state)
  const T* z0 = nullptr;  // [BH][D]
  // The chunk products' tile-GEMM path (cpu_gemm_path, read once per op call): kNative for
  // float32 / float64.
  GemmPath path = GemmPath::kNative;
};

// Per-thread tiles of one chunk.
template <typename T>
struct Tiles {
  avec<T> pq, pqT, pk, pkT, v, vT, dnum, dden, a, da, num, grad, gradT, S, z;
  Tiles(int64_t Dp, int64_t Dvp)
      : pq(kChunk * Dp), pqT(Dp * kChunk), pk(kChunk * Dp), pkT(Dp * kChunk), v(kChunk * Dvp),
        vT(Dvp * kChunk), dnum(kChunk * Dvp), dden(kChunk), a(kChunk * kChunk),
        da(kChunk * kChunk), num(kChunk * std::max(Dvp, Dp)), grad(kChunk * std::max(Dvp, Dp)),
        gradT(Dp * kChunk), S(std::max(Dp * Dvp, Dvp * Dp)), z(Dp), Dp_(Dp), Dvp_(Dvp) {}
  int64_t Dp_, Dvp_;
  size_t bytes() const { return sizeof(T) * (13 * kChunk * std::max(Dp_, Dvp_) + Dp_ * Dvp_); }
};

// The calling thread's Tiles for (Dp, Dvp), kept from call to call.  dynamic_for calls its body
// once per block, and with few (b, h) a block is a single head: the causal forward at B=1 H=8
// N=256 D=64 built (and zero-filled: 13 tiles of 16 KiB) fresh Tiles for every head, ~7% of
// its time.  Reuse is safe: every pass writes each tile entry it reads for a chunk before
// reading it (as it must already, since a block of several heads reuses its tiles from head to
// head).  Tiles over 4 MiB (D or Dv in the thousands) are not kept.
template <typename T>
struct TilesLease {
  std::unique_ptr<Tiles<T>> own;
  Tiles<T>* t;
  TilesLease(int64_t Dp, int64_t Dvp) {
    thread_local std::unique_ptr<Tiles<T>> cached;
    thread_local bool busy = false;  // a nested lease on the same thread gets its own tiles
    if (!busy && cached && cached->Dp_ == Dp && cached->Dvp_ == Dvp) {
      t = cached.get();
    } else {
      own = std::make_unique<Tiles<T>>(Dp, Dvp);
      t = own.get();
      if (!busy && own->bytes() <= (size_t(4) << 20)) {
        cached = std::move(own);
        t = cached.get();
      }
    }
    if (!own) busy = true, held = &busy;
  }
  ~TilesLease() {
    if (held) *held = false;
  }
  TilesLease(const TilesLease&) = delete;
  TilesLease& operator=(const TilesLease&) = delete;
  Tiles<T>& operator*() { return *t; }

 private:
  bool* held = nullptr;
};

// A [D][Dv] state (optional, contiguous) into a zeroed, padded [rows][ld] tile, transposed if asked.
template <typename T>
void load_state(const T* src, int64_t D, int64_t Dv, T* dst, int64_t Dp, int64_t Dvp,
                bool transposed) {
  std::fill(dst, dst + Dp * Dvp, T(0));
  if (!src) return;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t e = 0; e < Dv; ++e) {
      if (transposed)
        dst[e * Dp + d] = src[d * Dv + e];
      else
        dst[d * Dvp + e] = src[d * Dv + e];
    }
}

// The running state of one (b, h) at the start of a sweep: S <- init_S (or 0) as a padded tile
// ([Dp][Dvp], or [Dvp][Dp] transposed), z <- init_z (or 0) padded to Dp.  init_S [BH][D][Dv] and
// init_z [BH][D] are optional.
template <typename T>
void init_state(const T* init_S, const T* init_z, int64_t bh, int64_t D, int64_t Dv, int64_t Dp,
                int64_t Dvp, bool transposed, T* S, T* z) {
  load_state(init_S ? init_S + bh * D * Dv : nullptr, D, Dv, S, Dp, Dvp, transposed);
  std::fill(z, z + Dp, T(0));
  if (init_z) std::copy(init_z + bh * D, init_z + (bh + 1) * D, z);
}

// Non-causal reductions: the `groups` partial states [S (Dp x Dvp), z (Dp)] of (b, h), state_size
// apart from partial + bh groups state_size on, summed into the first; then the optional extras
// add_S [BH][D][Dv] and add_z [BH][D] of (b, h) added.  Returns that first state's S (z follows).
template <typename T>
T* sum_partials(T* partial, int64_t bh, int64_t groups, int64_t state_size, const T* add_S,
                const T* add_z, int64_t D, int64_t Dv, int64_t Dp, int64_t Dvp) {
  T* S = partial + bh * groups * state_size;
  T* z = S + Dp * Dvp;
  if (add_S) add_S += bh * D * Dv;
  if (add_z) add_z += bh * D;
  for (int64_t g = 1; g < groups; ++g) {
    const T* Sg = S + g * state_size;
    for (int64_t x = 0; x < state_size; ++x) S[x] += Sg[x];
  }
  if (add_S)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t e = 0; e < Dv; ++e) S[d * Dvp + e] += add_S[d * Dv + e];
  if (add_z)
    for (int64_t d = 0; d < D; ++d) z[d] += add_z[d];
  return S;
}

// Chunk packing shared by the passes, rows [i0, i0 + L) of one (b, h), Lp = L rounded up to W:
//   pack_q_t:  t.pq = phi(Q_c), t.pqT its transpose
//   pack_kv:   t.pk = phi(K_c), t.v = V_c, and t.pkT (with_kT) / t.vT (with_vT) transposed
template <typename scalar_t, typename T>
void pack_q_t(const Problem<scalar_t, T>& P, int64_t bh, int64_t i0, int64_t L, int64_t Lp,
              Tiles<T>& t) {
  pack_rows(P.q, bh, i0, L, P.D, t.pq.data(), P.Dp, &P.fm);
  transpose(t.pq.data(), P.Dp, L, P.D, t.pqT.data(), kChunk, Lp);
}
template <typename scalar_t, typename T>
void pack_kv(const Problem<scalar_t, T>& P, int64_t bh, int64_t j0, int64_t L, int64_t Lp,
             bool with_kT, bool with_vT, Tiles<T>& t) {
  pack_rows(P.k, bh, j0, L, P.D, t.pk.data(), P.Dp, &P.fm);
  if (with_kT) transpose(t.pk.data(), P.Dp, L, P.D, t.pkT.data(), kChunk, Lp);
  pack_rows(P.v, bh, j0, L, P.Dv, t.v.data(), P.Dvp, nullptr);
  if (with_vT) transpose(t.v.data(), P.Dvp, L, P.Dv, t.vT.data(), kChunk, Lp);
}

// S += xT y, z += xT ycol over the L rows of a chunk: xT [D][kChunk] (a transposed packed tile),
// y [L][Dvp], ycol [L] (null: a column of ones, i.e. z += rowsum(xT)); z null: S only.  The
// state updates of the forward (S += K'^T V, z += colsum(K')) and of the backward
// (R += P^T dnum, w += P^T dden).
// The product reads chunk tiles only (the state is its float32 C): on `path` (chunk_gemm) in the
// backward; the forward's callers pass kNative.  Its state is an output (return_state) that a
// caller chains into the next call, promised float32-accurate to the float64 sums of the inputs:
// K' = phi(K) is computed in float32 and rounding it to bfloat16 for brgemm put a 2.3e-3 error
// into the returned state (test_state_dtype_for_low_precision_inputs_is_float32, which failed on
// the first Xeon with AMX to run it, session 17).
template <typename scalar_t, typename T>
void add_outer(GemmPath path, int64_t D, int64_t Dvp, int64_t L, const T* xT, const T* y,
               const T* ycol, T* S, T* z) {
  chunk_gemm<scalar_t, T>(path, true, Tri::kFull, D, Dvp, L, xT, kChunk, 1, y, Dvp, S, Dvp, true);
  if (z == nullptr) return;
  for (int64_t d = 0; d < D; ++d)
    z[d] += ycol ? dot(xT + d * kChunk, ycol, L) : sum_of(xT + d * kChunk, L);
}

// z[0..n) += sum of the `rows` rows of x ([rows][ld]), in row order.
template <typename T>
void add_rows(const T* x, int64_t ld, int64_t rows, int64_t n, T* z) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* r = x + i * ld;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) z[d] += r[d];
  }
}

// a[i][c] += u[i] v[c] on an [rows][ld] tile, c < cols (v null: a row of ones, a[i][c] += u[i]).
template <typename T>
void add_rank1(T* a, int64_t ld, int64_t rows, int64_t cols, const T* u, const T* v) {
  for (int64_t i = 0; i < rows; ++i) {
    T* r = a + i * ld;
    if (v)
      for (int64_t c = 0; c < cols; ++c) r[c] += u[i] * v[c];
    else
      for (int64_t c = 0; c < cols; ++c) r[c] += u[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------------------------
struct FwdOut {
  void* out;  // scalar_t [BH][N][Dv]
  void* den;  // T [BH][N]
  void* S;    // T [BH][D][Dv]
  void* z;    // T [BH][D]
};

// Rows [i0, i0 + L) of the output from num (ld Dvp) and den.
template <typename scalar_t, typename T>
void write_out(const Problem<scalar_t, T>& P, int64_t bh, int64_t i0, int64_t L, const T* num,
               const T* den, scalar_t* out, T* den_out) {
  for (int64_t i = 0; i < L; ++i) {
    scalar_t* o = out + (bh * P.N + i0 + i) * P.Dv;
    const T* nr = num + i * P.Dvp;
    if (P.normalize) {
      const T r = den[i] + P.eps;
      for (int64_t e = 0; e < P.Dv; ++e) o[e] = static_cast<scalar_t>(nr[e] / r);
    } else {
      for (int64_t e = 0; e < P.Dv; ++e) o[e] = static_cast<scalar_t>(nr[e] * P.scale);
    }
    den_out[bh * P.N + i0 + i] = den[i];
  }
}

template <typename scalar_t, typename T>
void store_state(const Problem<scalar_t, T>& P, int64_t bh, const T* S, const T* z, T* S_out,
                 T* z_out) {
  for (int64_t d = 0; d < P.D; ++d) {
    std::copy(S + d * P.Dvp, S + d * P.Dvp + P.Dv, S_out + (bh * P.D + d) * P.Dv);
    z_out[bh * P.D + d] = z[d];
  }
}

template <typename scalar_t, typename T>
void causal_forward(const Problem<scalar_t, T>& P, const FwdOut& o) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t D = P.D, Dv = P.Dv, Dp = P.Dp, Dvp = P.Dvp;
  dynamic_for(P.BH, [&](int64_t begin, int64_t end) {
    TilesLease<T> lease(Dp, Dvp);
    Tiles<T>& t = *lease;
    const BrgemmRelease release(P.path);
    T* S = t.S.data();
    T* z = t.z.data();
    T den[kChunk];
    for (int64_t bh = begin; bh < end; ++bh) {
      init_state(P.S0, P.z0, bh, D, Dv, Dp, Dvp, false, S, z);
      for (int64_t i0 = 0; i0 < P.N; i0 += kChunk) {
        const int64_t L = std::min(kChunk, P.N - i0), Lp = round_up(L, W);
        pack_rows(P.q, bh, i0, L, D, t.pq.data(), Dp, &P.fm);
        pack_kv(P, bh, i0, L, Lp, true, false, t);
        // A = P K'^T o tril
        chunk_gemm<scalar_t, T>(P.path, true, Tri::kOutLower, L, Lp, D, t.pq.data(), Dp, 1, t.pkT.data(),
                                kChunk, t.a.data(), kChunk, false);
        mask_lower(t.a.data(), kChunk, L, Lp);
        // num = A V + P S_prev (the first chunk without an initial state: S_prev = 0, no
        // product -- 8% of the work at N = 256 -- and no 0 * inf = NaN from it either, as in
        // the reference, which has no such term)
        const bool has_prev = i0 > 0 || P.S0 != nullptr;
        chunk_gemm<scalar_t, T>(P.path, all_finite(t.v.data(), L * Dvp), Tri::kLeftLower, L, Dvp, L,
                                t.a.data(), kChunk, 1, t.v.data(), Dvp, t.num.data(), Dvp, false);
        // P S_prev reads the running state: float32 on every path (see chunk_gemm).
        if (has_prev)
          gemm<T>(Tri::kFull, L, Dvp, D, t.pq.data(), Dp, 1, S, Dvp, t.num.data(), Dvp, true);
        for (int64_t i = 0; i < L; ++i) {
          const T* arow = t.a.data() + i * kChunk;
          const T* prow = t.pq.data() + i * Dp;
          den[i] = sum_of(arow, i + 1) + (has_prev ? dot(prow, z, D) : T(0));
        }
        write_out(P, bh, i0, L, t.num.data(), den, static_cast<scalar_t*>(o.out),
                  static_cast<T*>(o.den));
        // S_prev += K'^T V, z_prev += colsum(K') (as a sum of K' rows: no horizontal sums)
        add_outer<scalar_t, T>(GemmPath::kNative, D, Dvp, L, t.pkT.data(), t.v.data(), nullptr, S, nullptr);
        add_rows(t.pk.data(), Dp, L, D, z);
      }
      store_state(P, bh, S, z, static_cast<T*>(o.S), static_cast<T*>(o.z));
    }
  });
}

// How many groups the chunks of one (b, h) are split into for a reduction: enough for every
// thread to have work when B*H is small, never more than the chunks.
inline int64_t reduce_groups(int64_t BH, int64_t chunks) {
  const int64_t threads = at::get_num_threads();
  if (BH >= threads || chunks <= 1) return 1;
  return std::min(chunks, ceil_div(threads, BH));
}

// Step 1 of a non-causal pass: the chunks of each (b, h) over `rows` rows are split into G
// groups (one task each); body(bh, i0, L, Lp, tiles, scratch, S, z) adds chunk [i0, i0 + L)'s
// terms to its group's partial state S [Dp][Dvp], z [Dp], at partial + (bh G + g) state_size.
template <typename T, typename Body>
void reduce_chunk_groups(GemmPath path, int64_t BH, int64_t rows, int64_t G, int64_t Dp, int64_t Dvp,
                         int64_t state_size, T* partial, const Body& body) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t chunks = ceil_div(rows, kChunk), per_group = ceil_div(chunks, G);
  dynamic_for(BH * G, [&](int64_t begin, int64_t end) {
    TilesLease<T> lease(Dp, Dvp);
    Tiles<T>& t = *lease;
    const BrgemmRelease release(path);
    avec<T> scratch(std::max(Dp, Dvp));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / G, g = task % G;
      T* S = partial + task * state_size;
      T* z = S + Dp * Dvp;
      for (int64_t c = g * per_group; c < std::min(chunks, (g + 1) * per_group); ++c) {
        const int64_t i0 = c * kChunk, L = std::min(kChunk, rows - i0), Lp = round_up(L, W);
        body(bh, i0, L, Lp, t, scratch.data(), S, z);
      }
    }
  });
}

template <typename scalar_t, typename T>
void noncausal_forward(const Problem<scalar_t, T>& P, const FwdOut& o) {
  const int64_t D = P.D, Dv = P.Dv, Dp = P.Dp, Dvp = P.Dvp;
  const int64_t G = reduce_groups(P.BH, ceil_div(P.M, kChunk));
  const int64_t state_size = Dp * Dvp + Dp;  // S then z
  avec<T> partial(static_cast<size_t>(P.BH * G * state_size), T(0));
  // 1. partial sums of K'^T V and colsum(K') over the key chunks of each group
  reduce_chunk_groups<T>(P.path, P.BH, P.M, G, Dp, Dvp, state_size, partial.data(),
                         [&](int64_t bh, int64_t j0, int64_t L, int64_t Lp, Tiles<T>& t, T*,
                             T* S, T* z) {
                           pack_kv(P, bh, j0, L, Lp, true, false, t);
                           add_outer<scalar_t, T>(GemmPath::kNative, D, Dvp, L, t.pkT.data(), t.v.data(),
                                                  nullptr, S, z);
                         });
  // 2. S = S0 + sum of the groups (into group 0's slot), z likewise
  dynamic_for(P.BH, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const T* S = sum_partials(partial.data(), bh, G, state_size, P.S0, P.z0, D, Dv, Dp, Dvp);
      store_state(P, bh, S, S + Dp * Dvp, static_cast<T*>(o.S), static_cast<T*>(o.z));
    }
  });
  // 3. num = P S, den = P z per query chunk
  const int64_t qchunks = ceil_div(P.N, kChunk);
  const bool no_keys = P.M == 0 && P.S0 == nullptr;
  dynamic_for(P.BH * qchunks, [&](int64_t begin, int64_t end) {
    TilesLease<T> lease(Dp, Dvp);
    Tiles<T>& t = *lease;
    T den[kChunk];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / qchunks, i0 = (task % qchunks) * kChunk;
      const int64_t L = std::min(kChunk, P.N - i0);
      const T* S = partial.data() + bh * G * state_size;
      const T* z = S + Dp * Dvp;
      if (no_keys) {
        // Empty sums: the output is 0 (not 0 / (0 + eps), which is NaN for eps = 0).
        scalar_t* out = static_cast<scalar_t*>(o.out) + (bh * P.N + i0) * Dv;
        std::fill(out, out + L * Dv, scalar_t(0));
        T* den_out = static_cast<T*>(o.den) + bh * P.N + i0;
        std::fill(den_out, den_out + L, T(0));
        continue;
      }
      pack_rows(P.q, bh, i0, L, D, t.pq.data(), Dp, &P.fm);
      // P S reads the summed state: float32 on every path (see causal_forward).
      gemm<T>(Tri::kFull, L, Dvp, D, t.pq.data(), Dp, 1, S, Dvp, t.num.data(), Dvp, false);
      for (int64_t i = 0; i < L; ++i) {
        const T* prow = t.pq.data() + i * Dp;
        den[i] = dot(prow, z, D);
      }
      write_out(P, bh, i0, L, t.num.data(), den, static_cast<scalar_t*>(o.out),
                static_cast<T*>(o.den));
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Backward.
// ---------------------------------------------------------------------------------------------
template <typename scalar_t, typename T>
struct Grads {
  View4<scalar_t> g;    // grad_out (p == nullptr: zero)
  View4<scalar_t> out;  // the forward's output
  const T* den = nullptr;       // [BH][N] (forward's den, without eps)
  const T* grad_den = nullptr;  // [BH][N] or null
  const T* grad_S = nullptr;    // [BH][D][Dv] or null
  const T* grad_z = nullptr;    // [BH][D] or null
  const T* S = nullptr;         // forward's S, z (non-causal backward)
  const T* z = nullptr;
  scalar_t* dq = nullptr;
  scalar_t* dk = nullptr;
  scalar_t* dv = nullptr;
  T* dS0 = nullptr;
  T* dz0 = nullptr;
  // Whether den reaches anything (normalize, or a gradient for den itself).  Without it dden is
  // identically 0 and every dden term is skipped rather than multiplied: 0 * NaN would carry a
  // NaN of z (from a NaN key or z0) or of phi(q) into dq, dk and dz0, which the reference
  // (whose output does not depend on den then) leaves finite.
  bool use_den = true;
};

// dnum [L][Dvp] (zero-padded) and dden [L] of query rows [i0, i0 + L).
template <typename scalar_t, typename T>
void pack_dnum(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G, int64_t bh, int64_t i0,
               int64_t L, T* dnum, T* dden, T* scratch) {
  const int64_t Dv = P.Dv, Dvp = P.Dvp;
  const scalar_t* g = G.g.p ? G.g.base(bh) + i0 * G.g.sn : nullptr;
  const scalar_t* out = G.out.base(bh) + i0 * G.out.sn;
  for (int64_t i = 0; i < L; ++i) {
    T* row = dnum + i * Dvp;
    const int64_t n = bh * P.N + i0 + i;
    T dd = G.grad_den ? G.grad_den[n] : T(0);
    if (!G.g.p) {
      std::fill(row, row + Dvp, T(0));
    } else if (P.normalize) {
      const T r = G.den[n] + P.eps;
      load_row(g + i * G.g.sn, G.g.sd, Dv, row, Dvp);
      load_row(out + i * G.out.sn, G.out.sd, Dv, scratch, Dv);
      const T inv = T(1) / r;
      const T go = dot(row, scratch, Dv);
#pragma omp simd
      for (int64_t e = 0; e < Dv; ++e) row[e] *= inv;
      dd -= go * inv;
    } else {
      load_row(g + i * G.g.sn, G.g.sd, Dv, row, Dvp);
      for (int64_t e = 0; e < Dv; ++e) row[e] *= P.scale;
    }
    dden[i] = dd;
  }
}

// dA = (dnum V^T + dden 1^T) o tril, [L][kChunk] (from vT [Dv][kChunk]; dden null: 0).
template <typename scalar_t, typename T>
void intra_dA(GemmPath path, int64_t L, int64_t Lp, int64_t Dv, const T* dnum, int64_t Dvp, const T* vT,
              const T* dden, T* da) {
  chunk_gemm<scalar_t, T>(path, true, Tri::kOutLower, L, Lp, Dv, dnum, Dvp, 1, vT, kChunk, da, kChunk, false);
  for (int64_t i = 0; i < L; ++i) {
    T* r = da + i * kChunk;
    if (dden)
      for (int64_t j = 0; j <= i; ++j) r[j] += dden[i];
  }
  mask_lower(da, kChunk, L, Lp);
}

// grad of phi(x) [rows][X] (ld) -> grad of x, written as scalar_t rows of the [BH][rows][X] output.
template <typename scalar_t, typename T>
void write_input_grad(const View4<scalar_t>& x, int64_t bh, int64_t i0, int64_t L, int64_t X,
                      int64_t total_rows, const T* gphi, int64_t ld, FeatureMap fm, T* scratch,
                      scalar_t* dst) {
  const scalar_t* src = x.base(bh) + i0 * x.sn;
  for (int64_t i = 0; i < L; ++i) {
    load_row(src + i * x.sn, x.sd, X, scratch, X);
    apply_dphi(scratch, X, fm);
    const T* gr = gphi + i * ld;
    if (fm == FeatureMap::kRelu) {
      // torch's relu backward selects: 0 where x <= 0 even when the incoming gradient is NaN or
      // inf (a product 0 * NaN here made every such entry NaN: ~2x the reference's NaN count).
      for (int64_t d = 0; d < X; ++d) scratch[d] = scratch[d] != T(0) ? gr[d] : T(0);
    } else {
      for (int64_t d = 0; d < X; ++d) scratch[d] *= gr[d];
    }
    // Rounded to the dtype 16 at a time (convert16.h): the scalar conversion was ~6% of a float16
    // causal forward+backward (B=1 H=8 N=4096 D=64, one thread, Xeon model 207, perf, session 26).
    store_scaled_row(scratch, T(1), X, dst + (bh * total_rows + i0 + i) * X);
  }
}

// Causal, forward sweep of one (b, h): dq.
template <typename scalar_t, typename T>
void causal_dq_sweep(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G, int64_t bh,
                     Tiles<T>& t, T* scratch) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t D = P.D, Dv = P.Dv, Dp = P.Dp, Dvp = P.Dvp;
  T* ST = t.S.data();  // prefix state, transposed: [Dvp][Dp]
  T* z = t.z.data();
  init_state(P.S0, P.z0, bh, D, Dv, Dp, Dvp, true, ST, z);
  for (int64_t i0 = 0; i0 < P.N; i0 += kChunk) {
    const int64_t L = std::min(kChunk, P.N - i0), Lp = round_up(L, W);
    pack_kv(P, bh, i0, L, Lp, false, true, t);
    pack_dnum(P, G, bh, i0, L, t.dnum.data(), t.dden.data(), scratch);
    intra_dA<scalar_t, T>(P.path, L, Lp, Dv, t.dnum.data(), Dvp, t.vT.data(),
                          G.use_den ? t.dden.data() : nullptr, t.da.data());
    // dphi(q) = dA K' + dnum S_prev^T + dden z_prev^T (the state product float32 on every path)
    T* gq = t.grad.data();
    chunk_gemm<scalar_t, T>(P.path, all_finite(t.pk.data(), L * Dp), Tri::kLeftLower, L, Dp, L, t.da.data(),
                            kChunk, 1, t.pk.data(), Dp, gq, Dp, false);
    gemm<T>(Tri::kFull, L, Dp, Dv, t.dnum.data(), Dvp, 1, ST, Dp, gq, Dp, true);
    if (G.use_den) add_rank1(gq, Dp, L, D, t.dden.data(), z);
    write_input_grad(P.q, bh, i0, L, D, P.N, gq, Dp, P.fm, scratch, G.dq);
    // S_prev^T += V^T K',  z_prev += colsum(K')
    chunk_gemm<scalar_t, T>(P.path, true, Tri::kFull, Dv, Dp, L, t.vT.data(), kChunk, 1, t.pk.data(), Dp, ST,
                            Dp, true);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) z[d] += t.pk[i * Dp + d];
  }
}

// dk [L][D] rows from dphi(k)^T [D][kChunk].
template <typename scalar_t, typename T>
void write_dk_transposed(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G, int64_t bh,
                         int64_t j0, int64_t L, const T* gkT, T* rows, T* scratch) {
  for (int64_t j = 0; j < L; ++j)
    for (int64_t d = 0; d < P.D; ++d) rows[j * P.Dp + d] = gkT[d * kChunk + j];
  write_input_grad(P.k, bh, j0, L, P.D, P.M, rows, P.Dp, P.fm, scratch, G.dk);
}

template <typename scalar_t, typename T>
void write_dv(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G, int64_t bh, int64_t j0,
              int64_t L, const T* dvt) {
  for (int64_t j = 0; j < L; ++j) {
    scalar_t* o = G.dv + (bh * P.M + j0 + j) * P.Dv;
    for (int64_t e = 0; e < P.Dv; ++e) o[e] = static_cast<scalar_t>(dvt[j * P.Dvp + e]);
  }
}

template <typename scalar_t, typename T>
void store_state_grad(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G, int64_t bh,
                      const T* R, const T* w) {
  for (int64_t d = 0; d < P.D; ++d) {
    std::copy(R + d * P.Dvp, R + d * P.Dvp + P.Dv, G.dS0 + (bh * P.D + d) * P.Dv);
    G.dz0[bh * P.D + d] = w[d];
  }
}

// Causal, reverse sweep of one (b, h): dk, dv, dS0, dz0.
template <typename scalar_t, typename T>
void causal_dkv_sweep(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G, int64_t bh,
                      Tiles<T>& t, T* scratch) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t D = P.D, Dv = P.Dv, Dp = P.Dp, Dvp = P.Dvp;
  T* R = t.S.data();  // suffix state [Dp][Dvp]
  T* w = t.z.data();
  init_state(G.grad_S, G.grad_z, bh, D, Dv, Dp, Dvp, false, R, w);
  const int64_t chunks = ceil_div(P.N, kChunk);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t i0 = c * kChunk, L = std::min(kChunk, P.N - i0), Lp = round_up(L, W);
    pack_q_t(P, bh, i0, L, Lp, t);
    pack_kv(P, bh, i0, L, Lp, false, true, t);
    pack_dnum(P, G, bh, i0, L, t.dnum.data(), t.dden.data(), scratch);
    // A^T = K' P^T o triu  (A^T[j][i] = phi(k_j) . phi(q_i), kept for i >= j)
    chunk_gemm<scalar_t, T>(P.path, true, Tri::kOutUpper, L, Lp, D, t.pk.data(), Dp, 1, t.pqT.data(),
                            kChunk, t.a.data(), kChunk, false);
    mask_upper(t.a.data(), kChunk, L, Lp);
    intra_dA<scalar_t, T>(P.path, L, Lp, Dv, t.dnum.data(), Dvp, t.vT.data(),
                          G.use_den ? t.dden.data() : nullptr, t.da.data());
    // dv = A^T dnum + K' R_next (the state product float32 on every path)
    T* gv = t.num.data();
    chunk_gemm<scalar_t, T>(P.path, all_finite(t.dnum.data(), L * Dvp), Tri::kLeftUpper, L, Dvp, L,
                            t.a.data(), kChunk, 1, t.dnum.data(), Dvp, gv, Dvp, false);
    gemm<T>(Tri::kFull, L, Dvp, D, t.pk.data(), Dp, 1, R, Dvp, gv, Dvp, true);
    write_dv(P, G, bh, i0, L, gv);
    // dphi(k)^T = P^T dA + R_next V^T + w_next 1^T
    T* gkT = t.gradT.data();
    chunk_gemm<scalar_t, T>(P.path, all_finite(t.pq.data(), L * Dp), Tri::kRightLower, D, Lp, L, t.pqT.data(),
                            kChunk, 1, t.da.data(), kChunk, gkT, kChunk, false);
    gemm<T>(Tri::kFull, D, Lp, Dv, R, Dvp, 1, t.vT.data(), kChunk, gkT, kChunk, true);  // state: float32
    add_rank1(gkT, kChunk, D, L, w, static_cast<const T*>(nullptr));
    write_dk_transposed(P, G, bh, i0, L, gkT, t.grad.data(), scratch);
    // R_next += P^T dnum,  w_next += P^T dden
    add_outer<scalar_t, T>(P.path, D, Dvp, L, t.pqT.data(), t.dnum.data(), t.dden.data(), R,
                           G.use_den ? w : nullptr);
  }
  store_state_grad(P, G, bh, R, w);
}

template <typename scalar_t, typename T>
void causal_backward(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G) {
  // Task 2*bh: the dq sweep of (b, h); task 2*bh + 1: its dk/dv sweep (interleaved so that the
  // threads' contiguous task ranges mix the cheaper and the dearer sweep).
  dynamic_for(2 * P.BH, [&](int64_t begin, int64_t end) {
    TilesLease<T> lease(P.Dp, P.Dvp);
    Tiles<T>& t = *lease;
    const BrgemmRelease release(P.path);
    avec<T> scratch(std::max(P.Dp, P.Dvp));
    for (int64_t task = begin; task < end; ++task) {
      if (task % 2 == 0)
        causal_dq_sweep(P, G, task / 2, t, scratch.data());
      else
        causal_dkv_sweep(P, G, task / 2, t, scratch.data());
    }
  });
}

template <typename scalar_t, typename T>
void noncausal_backward(const Problem<scalar_t, T>& P, const Grads<scalar_t, T>& G) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t D = P.D, Dv = P.Dv, Dp = P.Dp, Dvp = P.Dvp;
  const int64_t qchunks = ceil_div(P.N, kChunk), kchunks = ceil_div(P.M, kChunk);
  const int64_t NG = reduce_groups(P.BH, qchunks);
  const int64_t state_size = Dp * Dvp + Dp;
  avec<T> partial(static_cast<size_t>(P.BH * NG * state_size), T(0));
  // 1. R = grad_S + P^T dnum, w = grad_z + P^T dden (partial sums over query-chunk groups)
  reduce_chunk_groups<T>(P.path, P.BH, P.N, NG, Dp, Dvp, state_size, partial.data(),
                         [&](int64_t bh, int64_t i0, int64_t L, int64_t Lp, Tiles<T>& t,
                             T* scratch, T* R, T* w) {
                           pack_q_t(P, bh, i0, L, Lp, t);
                           pack_dnum(P, G, bh, i0, L, t.dnum.data(), t.dden.data(), scratch);
                           add_outer<scalar_t, T>(P.path, D, Dvp, L, t.pqT.data(), t.dnum.data(),
                                                  t.dden.data(), R, G.use_den ? w : nullptr);
                         });
  // 2. totals (group 0's slot), S^T for the dq pass, the state gradients
  avec<T> ST(static_cast<size_t>(P.BH * Dvp * Dp));
  dynamic_for(P.BH, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const T* R = sum_partials(partial.data(), bh, NG, state_size, G.grad_S, G.grad_z, D, Dv,
                                Dp, Dvp);
      store_state_grad(P, G, bh, R, R + Dp * Dvp);
      load_state(G.S + bh * D * Dv, D, Dv, ST.data() + bh * Dvp * Dp, Dp, Dvp, true);
    }
  });
  // 3. dq per query chunk, dk and dv per key chunk
  dynamic_for(P.BH * (qchunks + kchunks), [&](int64_t begin, int64_t end) {
    TilesLease<T> lease(Dp, Dvp);
    Tiles<T>& t = *lease;
    avec<T> scratch(std::max(Dp, Dvp));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / (qchunks + kchunks), c = task % (qchunks + kchunks);
      if (c < qchunks) {
        const int64_t i0 = c * kChunk, L = std::min(kChunk, P.N - i0);
        pack_dnum(P, G, bh, i0, L, t.dnum.data(), t.dden.data(), scratch.data());
        // dphi(q) = dnum S^T + dden z^T (this pass's products all read a state: float32)
        T* gq = t.grad.data();
        gemm<T>(Tri::kFull, L, Dp, Dv, t.dnum.data(), Dvp, 1, ST.data() + bh * Dvp * Dp, Dp, gq,
                Dp, false);
        const T* z = G.z + bh * D;
        if (G.use_den) add_rank1(gq, Dp, L, D, t.dden.data(), z);
        write_input_grad(P.q, bh, i0, L, D, P.N, gq, Dp, P.fm, scratch.data(), G.dq);
      } else {
        const int64_t j0 = (c - qchunks) * kChunk, L = std::min(kChunk, P.M - j0),
                      Lp = round_up(L, W);
        const T* R = partial.data() + bh * NG * state_size;
        const T* w = R + Dp * Dvp;
        pack_kv(P, bh, j0, L, Lp, false, true, t);
        // dv = K' R
        T* gv = t.num.data();
        gemm<T>(Tri::kFull, L, Dvp, D, t.pk.data(), Dp, 1, R, Dvp, gv, Dvp, false);
        write_dv(P, G, bh, j0, L, gv);
        // dphi(k)^T = R V^T + w 1^T
        T* gkT = t.gradT.data();
        gemm<T>(Tri::kFull, D, Lp, Dv, R, Dvp, 1, t.vT.data(), kChunk, gkT, kChunk, false);
        add_rank1(gkT, kChunk, D, L, w, static_cast<const T*>(nullptr));
        write_dk_transposed(P, G, bh, j0, L, gkT, t.grad.data(), scratch.data());
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Op entry points.
// ---------------------------------------------------------------------------------------------

// at::empty for the large outputs (out, dq, dk, dv), with a transparent-huge-page hint on the
// fresh, still untouched memory.  Blocks of >= 32 MiB come straight from mmap and go back to
// the OS when freed, so every call faults its outputs in again -- with 4 KiB pages that is one
// fault per 4 KiB, about a fifth of the run time at N = 16384 (B=1, H=8, D=64); with 2 MiB
// pages 512 times fewer.  A hint only: where THP is off (or not Linux) nothing changes.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const size_t bytes = t.nbytes();
  if (bytes >= 4 * kHuge) {
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data_ptr()) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data_ptr()) + bytes) & ~(kHuge - 1);
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#endif
  return t;
}

at::ScalarType acc_type(at::ScalarType t) { return checks::acc_type(t); }

// An optional tensor (checked: of the accumulation type and its shape), contiguous.
at::Tensor contiguous_or_none(const std::optional<at::Tensor>& t) {
  return checks::defined(t) ? t->contiguous() : at::Tensor();
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// The accumulation type of the kernels for inputs of scalar_t.
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// The Problem of checked q [B,H,N,D], k [B,H,M,D], v [B,H,M,Dv] and optional S0, z0 (of T).
template <typename scalar_t, typename T>
Problem<scalar_t, T> make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& S0, const at::Tensor& z0, FeatureMap fm,
                                  bool causal, bool normalize, double eps, double scale) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t D = q.size(3), Dv = v.size(3);
  return Problem<scalar_t, T>{q.size(0) * q.size(1), q.size(2), k.size(2), D, Dv,
                              round_up(D, W), round_up(Dv, W), fm, causal, normalize,
                              static_cast<T>(eps), static_cast<T>(scale), View4<scalar_t>(q),
                              View4<scalar_t>(k), View4<scalar_t>(v), ptr_or_null<T>(S0),
                              ptr_or_null<T>(z0)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& S0_in, const std::optional<at::Tensor>& z0_in, bool causal,
    c10::string_view feature_map, bool normalize, double eps, double scale) {
  const std::string_view fm_name(feature_map.data(), feature_map.size());
  checks::linear_fwd(checks::cpu_target(), q, k, v, S0_in, z0_in, causal, fm_name, normalize, eps, scale);
  const FeatureMap fm = parse_feature_map(fm_name);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Dv = v.size(3);
  const auto acc = acc_type(q.scalar_type());
  const at::Tensor S0 = contiguous_or_none(S0_in);
  const at::Tensor z0 = contiguous_or_none(z0_in);
  auto out = empty_output({B, H, N, Dv}, q.options());
  auto den = at::empty({B, H, N}, q.options().dtype(acc));
  // Not zero-filled: both passes store the state of every (b, h) (the initial one at N = 0).
  // A token of linear_attention_step at B=1 H=8 D=64 zeroed 128 KiB here for nothing.
  auto S = at::empty({B, H, D, Dv}, q.options().dtype(acc));
  auto z = at::empty({B, H, D}, q.options().dtype(acc));
  if (B * H == 0) return {out, den, S, z};
  const GemmPath path = cpu_gemm_path(q.scalar_type(), GemmUse::kLinear);  // once per call, before the kernels
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "linear_fwd", [&] {
    using T = acc_t<scalar_t>;
    auto P = make_problem<scalar_t, T>(q, k, v, S0, z0, fm, causal, normalize, eps, scale);
    P.path = path;
    FwdOut o{out.mutable_data_ptr<scalar_t>(), den.mutable_data_ptr<T>(), S.mutable_data_ptr<T>(),
             z.mutable_data_ptr<T>()};
    if (causal)
      causal_forward(P, o);
    else
      noncausal_forward(P, o);
  });
  return {out, den, S, z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cpu(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den_in,
    const std::optional<at::Tensor>& grad_S_in, const std::optional<at::Tensor>& grad_z_in,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& den_in, const at::Tensor& S_in, const at::Tensor& z_in,
    const std::optional<at::Tensor>& S0_in, const std::optional<at::Tensor>& z0_in, bool causal,
    c10::string_view feature_map, bool normalize, double eps, double scale) {
  const std::string_view fm_name(feature_map.data(), feature_map.size());
  checks::linear_bwd(checks::cpu_target(), grad_out, grad_den_in, grad_S_in, grad_z_in, q, k, v, out, den_in, S_in,
                     z_in, S0_in, z0_in, causal, fm_name, normalize, eps, scale);
  const FeatureMap fm = parse_feature_map(fm_name);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  const int64_t M = k.size(2), Dv = v.size(3);
  const auto acc = acc_type(q.scalar_type());
  const at::Tensor den = den_in.contiguous();
  const at::Tensor S = S_in.contiguous();
  const at::Tensor z = z_in.contiguous();
  const at::Tensor S0 = contiguous_or_none(S0_in);
  const at::Tensor z0 = contiguous_or_none(z0_in);
  const at::Tensor gden = contiguous_or_none(grad_den_in);
  const at::Tensor gS = contiguous_or_none(grad_S_in);
  const at::Tensor gz = contiguous_or_none(grad_z_in);
  const at::Tensor g = checks::defined(grad_out) ? *grad_out : at::Tensor();
  auto dq = empty_output(q.sizes(), q.options());
  auto dk = empty_output(k.sizes(), k.options());
  auto dv = empty_output(v.sizes(), v.options());
  auto dS0 = at::empty({B, H, D, Dv}, q.options().dtype(acc));
  auto dz0 = at::empty({B, H, D}, q.options().dtype(acc));
  if (B * H == 0) return {dq, dk, dv, dS0, dz0};
  if (!causal && M == 0 && !S0.defined()) {
    // out is identically 0 here (no keys, no state): every gradient but the state's is 0.
    dq.zero_();
    dS0.copy_(gS.defined() ? gS : at::zeros_like(dS0));
    dz0.copy_(gz.defined() ? gz : at::zeros_like(dz0));
    return {dq, dk, dv, dS0, dz0};
  }
  const GemmPath path = cpu_gemm_path(q.scalar_type(), GemmUse::kLinear);  // once per call, before the kernels
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "linear_bwd", [&] {
    using T = acc_t<scalar_t>;
    auto P = make_problem<scalar_t, T>(q, k, v, S0, z0, fm, causal, normalize, eps, scale);
    P.path = path;
    Grads<scalar_t, T> G;
    if (g.defined()) G.g = View4<scalar_t>(g);
    G.out = View4<scalar_t>(out);
    G.den = den.const_data_ptr<T>();
    G.grad_den = ptr_or_null<T>(gden);
    G.grad_S = ptr_or_null<T>(gS);
    G.grad_z = ptr_or_null<T>(gz);
    G.S = S.const_data_ptr<T>();
    G.z = z.const_data_ptr<T>();
    G.dq = dq.mutable_data_ptr<scalar_t>();
    G.dk = dk.mutable_data_ptr<scalar_t>();
    G.dv = dv.mutable_data_ptr<scalar_t>();
    G.dS0 = dS0.mutable_data_ptr<T>();
    G.dz0 = dz0.mutable_data_ptr<T>();
    G.use_den = normalize || G.grad_den != nullptr;
    if (causal)
      causal_backward(P, G);
    else
      noncausal_backward(P, G);
  });
  return {dq, dk, dv, dS0, dz0};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("linear_fwd", &linear_fwd_cpu);
  m.impl("linear_bwd", &linear_bwd_cpu);
}

}  // namespace attnkit

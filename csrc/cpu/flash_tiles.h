// Shared building blocks of attnkit's flash-style CPU kernels (csrc/cpu/softmax.cpp,
// csrc/cpu/sparse.cpp): register-blocked GEMM tiles (AVX-512 float32, AVX512-BF16 pairs, AVX2 +
// FMA float32, a portable fallback for float64 and older builds), the vectorized exp2 of the base-2
// online softmax, key packing (transposing gathers) and the dynamic task runner.
//
// Everything sits in an anonymous namespace: each kernel file gets its own copy, so files built
// with different target flags never share (ODR-merge) a function compiled for another ISA.
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "aligned_vector.h"
#include "convert16.h"

namespace attnkit {
namespace {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.6931471805599453094;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// Accumulation type of an input element type: float64 for float64, float32 for the rest.
template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

inline at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// NaN propagation (issue 15).  A NaN or +inf score must reach the row's output and lse, as in
// torch SDPA: std::max(a, NaN) returns a, and AVX-512 max returns its second operand when either
// is NaN, so no max below is trusted to carry a NaN.  The exponentials are: exp2_ps keeps NaN
// (and +inf - +inf = NaN), so a NaN score makes the row's sum l NaN, and finish_row then writes
// a NaN row and a NaN lse.  The one place a NaN could hide is a row whose max came out -inf
// (every other score masked): callers check has_nan there (a rare path, no cost otherwise).

// max(a, b), NaN if either is.
template <typename T>
inline T max_nan(T a, T b) {
  return (a != a || b != b) ? std::numeric_limits<T>::quiet_NaN() : std::max(a, b);
}

// Whether s[0..n) holds a NaN.
template <typename T>
inline bool has_nan(const T* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (s[j] != s[j]) return true;
  return false;
}

// Writes a finished row of the base-2 online softmax (running max m, sum l, unnormalized output
// o[0..Dv)): dst = o / l, lse = ln 2 * m + ln l; a row that saw no key (l == 0): 0 and -inf.  A
// row that saw a NaN (l NaN) comes out NaN, lse NaN: told apart from a fully masked one.
template <typename scalar_t, typename acc_t>
inline void finish_row(const acc_t* o, acc_t m, acc_t l, int64_t Dv, scalar_t* dst, acc_t* lse) {
  if (l != acc_t(0)) {
    store_scaled_row(o, acc_t(1) / l, Dv, dst);
    *lse = m * static_cast<acc_t>(kLn2) + std::log(l);
  } else {
    for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(0);
    *lse = neg_inf<acc_t>();
  }
}

// finish_row with a learned sink (issue 28; sink = the sink's logit, natural log, -inf: none):
// one more term of the row's softmax, with no value -- over s2 = sink log2 e and M = max(m, s2),
// l' = l 2^(m - M) + 2^(s2 - M), dst = o 2^(m - M) / l', lse = ln 2 * M + ln l'.  Folded in here,
// before the row is rounded to scalar_t: applied to a finished 16-bit row it rounds twice (up to
// ~1 ulp; tests/fuzz/test_regressions.py).  A row that saw no key: 0 and lse = the sink exactly;
// a NaN row stays NaN; as attnkit.score_options.add_sinks, a NaN sink gives NaN and +inf 0, +inf.
template <typename scalar_t, typename acc_t>
inline void finish_row(const acc_t* o, acc_t m, acc_t l, int64_t Dv, scalar_t* dst, acc_t* lse, acc_t sink) {
  if (sink == neg_inf<acc_t>() || l != l) {
    finish_row(o, m, l, Dv, dst, lse);
    return;
  }
  if (sink != sink || sink == -neg_inf<acc_t>()) {
    const acc_t fill = sink != sink ? sink : acc_t(0);
    for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(fill);
    *lse = sink;
    return;
  }
  if (l == acc_t(0)) {  // no key: the sink alone
    for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(0);
    *lse = sink;
    return;
  }
  const acc_t sink2 = sink * static_cast<acc_t>(kLog2e);
  const acc_t top = std::max(m, sink2);
  const acc_t keys = std::exp2(m - top);
  const acc_t total = l * keys + std::exp2(sink2 - top);
  store_scaled_row(o, keys / total, Dv, dst);
  *lse = top * static_cast<acc_t>(kLn2) + std::log(total);
}

// ---------------------------------------------------------------------------------------------
// GEMM tiles:  C[r][c] (+)= sum_{k < K} A(r, k) * B[k * ldb + c]   (r < rows, c < cols)
// with A(r, k) = A[r * sar + k * sak] (so A may be read transposed) and B row-major.
// ---------------------------------------------------------------------------------------------

// Portable version (float64, and float32 on builds with neither AVX-512 nor AVX2 + FMA).
// The simple loop keeps a row of C in memory; the register-blocked one holds an R x W block of C
// in local arrays that the compiler maps to vector registers.  Measured (float32 built for
// x86-64-v3, causal N=4096 D=64, one thread): forward 16 -> ~21-26 GF/s, backward 19 -> ~38
// GF/s; the forward is then held back by the scalar exp2 of this path.  (AVX2 builds now take
// the intrinsics tiles below: 64 x 64 x 64 tiles 16.8 -> 60 GF/s on one core of a loaded AMD
// EPYC with AVX2, same process.)
template <typename T>
void gemm_simple(int64_t rows, int64_t cols, int64_t K, const T* A, int64_t sar, int64_t sak,
                 const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    T* c = C + r * ldc;
    if (!accumulate) std::fill(c, c + cols, T(0));
    for (int64_t k = 0; k < K; ++k) {
      const T a = A[r * sar + k * sak];
      const T* b = B + k * ldb;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[j] += a * b[j];
    }
  }
}

template <typename T, int R, int W>
inline void micro_generic(int64_t K, const T* __restrict A, int64_t sar, int64_t sak,
                          const T* __restrict B, int64_t ldb, T* __restrict C, int64_t ldc,
                          bool accumulate) {
  T acc[R][W];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma omp simd
    for (int c = 0; c < W; ++c) acc[r][c] = accumulate ? C[r * ldc + c] : T(0);
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const T a = A[r * sar + k * sak];
#pragma omp simd
      for (int c = 0; c < W; ++c) acc[r][c] += a * b[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma omp simd
    for (int c = 0; c < W; ++c) C[r * ldc + c] = acc[r][c];
}

template <typename T>
void gemm_generic(int64_t rows, int64_t cols, int64_t K, const T* A, int64_t sar, int64_t sak,
                  const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
#if defined(__AVX512F__)
  constexpr int R = 4, W = 4 * 64 / sizeof(T);  // 4 rows x four zmm registers (16 accumulators)
#else
  constexpr int R = 4, W = 2 * 32 / sizeof(T);  // 4 rows x two ymm registers (AVX2 has 16)
#endif
  const int64_t rows_b = rows / R * R, cols_b = cols / W * W;
  for (int64_t c0 = 0; c0 < cols_b; c0 += W)
    for (int64_t r0 = 0; r0 < rows_b; r0 += R)
      micro_generic<T, R, W>(K, A + r0 * sar, sar, sak, B + c0, ldb, C + r0 * ldc + c0, ldc,
                             accumulate);
  if (cols_b < cols)
    gemm_simple(rows_b, cols - cols_b, K, A, sar, sak, B + cols_b, ldb, C + cols_b, ldc, accumulate);
  if (rows_b < rows)
    gemm_simple(rows - rows_b, cols, K, A + rows_b * sar, sar, sak, B, ldb, C + rows_b * ldc, ldc,
                accumulate);
}

#if defined(__AVX512F__)
// The R x NV accumulator block of a register-blocked tile (micro_f32, micro_bf16), read from C
// (accumulate) or zeroed, and written back; the last vector of each row under the mask `last`.
// Forced inline: acc must stay in zmm registers.
template <int R, int NV>
__attribute__((always_inline)) inline void load_acc(__m512 (&acc)[R][NV], const float* C, int64_t ldc,
                                                    __mmask16 last, bool accumulate) {
  if (accumulate) {
    #pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 32
      for (int v = 0; v < NV; ++v)
        acc[r][v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, C + r * ldc + 16 * v)
                                : _mm512_loadu_ps(C + r * ldc + 16 * v);
  } else {
    #pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
}

template <int R, int NV>
__attribute__((always_inline)) inline void store_acc(const __m512 (&acc)[R][NV], float* C, int64_t ldc,
                                                     __mmask16 last) {
  #pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) {
      if (v == NV - 1)
        _mm512_mask_storeu_ps(C + r * ldc + 16 * v, last, acc[r][v]);
      else
        _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
    }
}

// R rows x NV vectors of 16 columns held in registers (R * NV <= 24 accumulators + NV loads of
// B + one broadcast fit in the 32 zmm registers).  Per k: NV loads, R broadcasts, R*NV FMAs.
// The last vector of columns is loaded / stored under `last` (columns past `cols`).
template <int R, int NV>
inline void micro_f32(int64_t K, const float* __restrict A, int64_t sar, int64_t sak,
                      const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                      __mmask16 last, bool accumulate) {
  __m512 acc[R][NV];
  load_acc(acc, C, ldc, last, accumulate);
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    __m512 bv[NV];
    #pragma GCC unroll 32
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, b + 16 * v) : _mm512_loadu_ps(b + 16 * v);
    const float* a = A + k * sak;
    #pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(a[r * sar]);
      #pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  store_acc(acc, C, ldc, last);
}

// Rows per register block for NV column vectors (about 24 accumulators).  For NV = 4: 6 rows
// measured 92-103 GF/s float32 forward, 4 rows 72-87, 7 rows 85-108 (spills risk; not kept).
template <int NV>
constexpr int rows_for() {
  return NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 8;
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (CPUs without AVX-512: AMD before Zen 4, Intel client cores; or a build for
// x86-64-v3).  The same register-blocked tile with 8-wide ymm vectors: 16 registers hold
// R x NV accumulators + NV loads of B + one broadcast, so panels of at most 2 vectors (16
// columns) and 6 rows (12 accumulators), or 8 rows of one vector.  The last vector of each row
// is loaded / stored under a lane mask.  The generic loops above, which GCC vectorized to the
// same instructions but with C in memory, ran the softmax forward at 0.41x torch SDPA
// (B=1 H=8 N=1024 D=64 float32, AMD EPYC with AVX2, 2 threads; bench --quick).
inline __m256i lanes_below8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Columns all full: the tag passed instead of a lane mask (plain loads and stores).  With the
// mask, GCC kept it in a register and, one short of the 16, reloaded the first B vector from
// memory for every row (13 loads per 12 FMAs in the P V tile); vmaskmovps loads are slower too.
struct FullCols {};

template <typename Mask>
__attribute__((always_inline)) inline __m256 load_cols(const float* p, Mask last) {
  if constexpr (std::is_same_v<Mask, FullCols>) return _mm256_loadu_ps(p);
  else return _mm256_maskload_ps(p, last);
}

template <typename Mask>
__attribute__((always_inline)) inline void store_cols(float* p, Mask last, __m256 x) {
  if constexpr (std::is_same_v<Mask, FullCols>) _mm256_storeu_ps(p, x);
  else _mm256_maskstore_ps(p, last, x);
}

// 8 consecutive elements as float32 (bfloat16: the bits shifted up by 16).
__attribute__((always_inline)) inline __m256 load8_as_float(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((always_inline)) inline __m256 load8_as_float(const at::BFloat16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
#if defined(__F16C__)
__attribute__((always_inline)) inline __m256 load8_as_float(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// The last n < 8 elements of a row as float32, zeros past n: float32 under a lane mask, 16 bits
// through a zero-padded copy (a 16-byte load could read past the row's end).
template <typename T>
inline __m256 load8_tail(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_maskload_ps(p, lanes_below8(n));
  } else {
    alignas(16) T t[8];
    std::memset(static_cast<void*>(t), 0, sizeof(t));
    std::memcpy(static_cast<void*>(t), p, static_cast<size_t>(n) * sizeof(T));
    return load8_as_float(t);
  }
}

// The last vector of B's columns under `last` (tail: how many of its 8 columns are real).
template <typename TB, typename Mask>
__attribute__((always_inline)) inline __m256 load_last_cols(const TB* p, Mask last, int64_t tail) {
  if constexpr (std::is_same_v<TB, float>) return load_cols(p, last);
  else if constexpr (std::is_same_v<Mask, FullCols>) return load8_as_float(p);
  else return load8_tail(p, tail);
}

// B may be float32 or 16 bits (TB: widened in registers as it is loaded; the decode's P V reads
// V in place this way); tail: see load_last_cols.
template <int R, int NV, typename Mask, typename TB = float>
inline void micro_f32(int64_t K, const float* __restrict A, int64_t sar, int64_t sak,
                      const TB* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                      Mask last, bool accumulate, int64_t tail = 8) {
  __m256 acc[R][NV];
  #pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 32
    for (int v = 0; v < NV; ++v)
      acc[r][v] = !accumulate ? _mm256_setzero_ps()
                  : v == NV - 1 ? load_cols(C + r * ldc + 8 * v, last)
                                : _mm256_loadu_ps(C + r * ldc + 8 * v);
  for (int64_t k = 0; k < K; ++k) {
    const TB* b = B + k * ldb;
    __m256 bv[NV];
    #pragma GCC unroll 32
    for (int v = 0; v < NV; ++v)
      bv[v] = v == NV - 1 ? load_last_cols(b + 8 * v, last, tail) : load8_as_float(b + 8 * v);
    const float* a = A + k * sak;
    #pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * sar);
      #pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
    }
  }
  #pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) {
      if (v == NV - 1)
        store_cols(C + r * ldc + 8 * v, last, acc[r][v]);
      else
        _mm256_storeu_ps(C + r * ldc + 8 * v, acc[r][v]);
    }
}

template <int NV>
constexpr int rows_for() {
  return NV == 2 ? 6 : 8;
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// A panel of NV column vectors over all rows: register blocks of rows_for<NV>() rows, then the
// exact tail height (one instantiation per height).  Mask: the lane mask of the last vector of
// columns (__mmask16 on AVX-512, __m256i on AVX2), passed through to micro_f32.
template <int NV, int R, typename Mask>
inline void micro_rows_f32(int64_t rows, int64_t K, const float* A, int64_t sar, int64_t sak,
                           const float* B, int64_t ldb, float* C, int64_t ldc, Mask last,
                           bool accumulate) {
  if constexpr (R > 1) {  // rows < R here: dispatch to the exact tail height
    if (rows == R - 1) {
      micro_f32<R - 1, NV>(K, A, sar, sak, B, ldb, C, ldc, last, accumulate);
      return;
    }
    micro_rows_f32<NV, R - 1>(rows, K, A, sar, sak, B, ldb, C, ldc, last, accumulate);
  }
}

template <int NV, typename Mask>
inline void panel_f32(int64_t rows, int64_t K, const float* A, int64_t sar, int64_t sak,
                      const float* B, int64_t ldb, float* C, int64_t ldc, Mask last,
                      bool accumulate) {
  constexpr int R = rows_for<NV>();
  int64_t r = 0;
#if !defined(__AVX512F__)
  // AVX2: blocks of R - 1 or R rows, as even as possible (64 rows: 9 x 6 + 2 x 5 rather than
  // 10 x 6 + 4; 16: 6 + 5 + 5): the 4-row tail has only 8 accumulators, no more than the FMAs
  // the two pipes keep in flight.
  if (rows > R && rows % R != 0) {
    const int64_t nb = ceil_div(rows, R);
    const int64_t full = rows - nb * (R - 1);  // blocks of R rows; the other nb - full have R - 1
    if (full >= 0) {
      for (; r < full * R; r += R)
        micro_f32<R, NV>(K, A + r * sar, sar, sak, B, ldb, C + r * ldc, ldc, last, accumulate);
      for (; r < rows; r += R - 1)
        micro_f32<R - 1, NV>(K, A + r * sar, sar, sak, B, ldb, C + r * ldc, ldc, last, accumulate);
      return;
    }
  }
#endif
  for (; r + R <= rows; r += R)
    micro_f32<R, NV>(K, A + r * sar, sar, sak, B, ldb, C + r * ldc, ldc, last, accumulate);
  if (r < rows)
    micro_rows_f32<NV, R>(rows - r, K, A + r * sar, sar, sak, B, ldb, C + r * ldc, ldc, last,
                          accumulate);
}

#endif

#if defined(__AVX512F__)
// Depth of the slices gemm_f32 multiplies a panel of B in (below).  O += P V at the forward's
// shape (64 x 64, 256 keys; bench/cpu_micro/gemm_tiles.cpp, one thread, Intel Xeon without AMX,
// session 32): 160-165 GF/s in one pass, 174-177 in slices of 128 (the core's FMA peak: 185).
constexpr int64_t kDepth = 128;
inline void gemm_f32(int64_t rows, int64_t cols, int64_t K, const float* A, int64_t sar, int64_t sak,
              const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t nv = ceil_div(cols, 16);
  // Split the column vectors into panels of at most 4, as even as possible (5 -> 3 + 2 rather
  // than 4 + 1: a one-vector panel has too few independent accumulators to hide FMA latency).
  const int64_t panels = ceil_div(nv, 4);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t v0 = p * nv / panels, v1 = (p + 1) * nv / panels;
    const int64_t c0 = v0 * 16;
    const int64_t tail = std::min(cols, v1 * 16) - (v1 - 1) * 16;  // 1..16 columns
    const __mmask16 last = static_cast<__mmask16>((1u << tail) - 1u);
    float* c = C + c0;
    // A panel of B deeper than kDepth rows (a P V tile's 256 keys x 64 columns: 64 KiB) does
    // not stay in L1 (48 KiB) while every register block of rows streams it: multiply it in
    // slices of at most kDepth rows, as even as possible, each slice over all the row blocks.
    // (The same products in the same order: C's rows leave the registers between slices as
    // float32 and come back unchanged.)
    // K = 0 is one pass too: it zeroes C unless accumulating.
    const int64_t slice = K > kDepth ? ceil_div(K, ceil_div(K, kDepth)) : std::max<int64_t>(K, 1);
    for (int64_t k0 = 0; k0 == 0 || k0 < K; k0 += slice) {
      const int64_t kn = std::min(slice, K - k0);
      const float* a = A + k0 * sak;
      const float* b = B + k0 * ldb + c0;
      const bool acc = accumulate || k0 > 0;
      switch (v1 - v0) {
        case 1: panel_f32<1>(rows, kn, a, sar, sak, b, ldb, c, ldc, last, acc); break;
        case 2: panel_f32<2>(rows, kn, a, sar, sak, b, ldb, c, ldc, last, acc); break;
        case 3: panel_f32<3>(rows, kn, a, sar, sak, b, ldb, c, ldc, last, acc); break;
        default: panel_f32<4>(rows, kn, a, sar, sak, b, ldb, c, ldc, last, acc); break;
      }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void gemm_f32(int64_t rows, int64_t cols, int64_t K, const float* A, int64_t sar, int64_t sak,
                     const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t nv = ceil_div(cols, 8);
  const int64_t panels = ceil_div(nv, 2);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t v0 = p * nv / panels, v1 = (p + 1) * nv / panels;
    const int64_t c0 = v0 * 8;
    const int64_t tail = std::min(cols, v1 * 8) - (v1 - 1) * 8;  // 1..8 columns
    if (tail == 8) {
      if (v1 - v0 == 1)
        panel_f32<1>(rows, K, A, sar, sak, B + c0, ldb, C + c0, ldc, FullCols{}, accumulate);
      else
        panel_f32<2>(rows, K, A, sar, sak, B + c0, ldb, C + c0, ldc, FullCols{}, accumulate);
      continue;
    }
    const __m256i last = lanes_below8(tail);
    if (v1 - v0 == 1)
      panel_f32<1>(rows, K, A, sar, sak, B + c0, ldb, C + c0, ldc, last, accumulate);
    else
      panel_f32<2>(rows, K, A, sar, sak, B + c0, ldb, C + c0, ldc, last, accumulate);
  }
}
#endif  // __AVX512F__ / __AVX2__

template <typename T>
inline void gemm(int64_t rows, int64_t cols, int64_t K, const T* A, int64_t sar, int64_t sak,
                 const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if constexpr (std::is_same_v<T, float>) {
    gemm_f32(rows, cols, K, A, sar, sak, B, ldb, C, ldc, accumulate);
    return;
  }
#endif
  gemm_generic<T>(rows, cols, K, A, sar, sak, B, ldb, C, ldc, accumulate);
}

// ---------------------------------------------------------------------------------------------
// Exponentials.  exp2 of x <= 0 (scores minus the running max, in base 2), -inf -> 0.
// ---------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
// x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7 Taylor polynomial in f*ln2
// (truncation < 5e-9 relative), times 2^n with vscalefps.  With AVX512-DQ, f comes from vreduceps,
// which gives f = 0 for x = -inf: n = -inf, and vscalefps returns exactly 0 for masked scores.
// Without it, x is clamped at -200 first: 2^-200 underflows to exactly 0, so masked scores (-inf)
// give p = 0 without a NaN.  The clamp takes x as max's *second* operand, which vmaxps returns
// when either is NaN: a NaN x stays NaN (with x first, NaN became -200 and then p = 0: the NaN
// was dropped, issue 15).  vreduceps keeps a NaN too.
inline __m512 exp2_ps(__m512 x) {
#if defined(__AVX512DQ__)
  // f = x - round(x) by vreduceps, n = x - f (both exact), no clamp: as exp2_ps_p16 below.
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, f);
#else
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
#endif
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp2_ps for probabilities that are stored in 16 bits (bfloat16 / float16 P of the brgemm and
// dot-product tiles): 2^f by a degree-4 polynomial fitted for relative error on [-1/2, 1/2] with
// p(0) = 1 exactly, max 2.9e-6 evaluated in float32 -- 1/1300 of a bfloat16 ulp, 1/170 of a
// float16 one -- where exp2_ps's degree 7 bought 5e-8 that the rounding to 16 bits throws away.
// The sum l takes the same float32 values, so P / l stays consistent.  Clamp, rounding and NaN
// rules as exp2_ps.  Three FMAs fewer per 16 scores: the exponential pass is the largest part
// of the bfloat16 forward after the AMX products (perf, Xeon with AMX, session 17).  f comes from
// vreduceps (x - round(x), exact; n = x - f exact too) rather than vrndscaleps and a subtraction:
// 64 x 256 exponentials with their sum and rounding to bfloat16, one thread, Xeon with AMX
// (session 18): 4.10 -> 3.75 ns per 16 (bench/cpu_micro/exp2_variants.cpp), the same values.  NaN stays NaN.
// And no clamp then: vreduceps gives f = 0 for x = -inf (and for any |x| >= 2^23), so
// n = -inf and vscalefps returns exactly 0 -- what the clamp at -200 was for.
inline __m512 exp2_ps_p16(__m512 x) {
#if defined(__AVX512DQ__)
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, f);
#else
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
#endif
  __m512 p = _mm512_set1_ps(0.009582852944731712f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055906426161527634f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024099111557007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931241750717163f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 8 lanes.  x is clamped at -127 first (max's second operand: a NaN x stays NaN), then
// x = n + f with n = round(x) (to nearest even) taken with the magic-number addition
// t = x + (1.5 * 2^23 + 127) -- whose low mantissa bits then hold n + 127, shifted into the exponent
// field for 2^n -- and 2^f by a degree-5 polynomial fitted for relative error on [-1/2, 1/2]
// (max 9.3e-8 in exact arithmetic, 1.9e-7 evaluated in float32; the AVX-512 path's degree-7 Taylor
// polynomial: 6e-8).  n = -127 gives the bit pattern of 0.0, so every x <= -126.5 -- masked
// scores (-inf) among them -- gives exactly 0 (2^-126 is negligible next to a running sum >= 1).
// NaN or +inf x: f = NaN, the result NaN.  Measured against the degree-7 polynomial with vroundps
// and vcvtps2dq (64 x 256 exponentials with their sum, L1-hot, one thread, AMD EPYC Zen 3):
// 12960 -> 10339 ticks.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
  const __m256 magic = _mm256_set1_ps(12582912.0f + 127.0f);  // 1.5 * 2^23 + 127
  const __m256 t = _mm256_add_ps(x, magic);
  const __m256 f = _mm256_sub_ps(x, _mm256_sub_ps(t, magic));
  __m256 p = _mm256_set1_ps(1.3269969607684583e-03f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6715105812216730e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5507156941029480e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022242134745525e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314699130075500e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// max_j c * s[j] over n >= 1 entries (c may have either sign).  NaN entries may or may not be
// dropped (see max_nan above): callers rely on the exponential pass, or has_nan, for those.
template <typename acc_t>
inline acc_t scaled_max(const acc_t* s, int64_t n, acc_t c) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m512 cv = _mm512_set1_ps(c);
    __m512 m = _mm512_set1_ps(neg_inf<float>());
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_mul_ps(cv, _mm512_loadu_ps(s + j)));
    if (j < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1u);
      m = _mm512_mask_max_ps(m, k, m, _mm512_mul_ps(cv, _mm512_maskz_loadu_ps(k, s + j)));
    }
    return _mm512_reduce_max_ps(m);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 cv = _mm256_set1_ps(c);
    __m256 m = _mm256_set1_ps(neg_inf<float>());
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_mul_ps(cv, _mm256_loadu_ps(s + j)));
    float mx = hmax8(m);
    for (; j < n; ++j) mx = std::max(mx, c * s[j]);
    return mx;
  }
#endif
  acc_t m = neg_inf<acc_t>();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, c * s[j]);
  return m;
}

// s[j] <- exp2(c s[j] - mx) for j < n (mx finite, or NaN: then every s[j] is NaN); returns the
// sum.  A NaN (or +inf when mx is +inf) among the scores makes the sum NaN.  Folding the scale into
// the exponent's FMA saves the separate scaling pass over the scores.
template <typename acc_t>
inline acc_t exp2_scaled_sum(acc_t* s, int64_t n, acc_t c, acc_t mx) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 p = exp2_ps(_mm512_fmsub_ps(cv, _mm512_loadu_ps(s + j), mv));
      _mm512_storeu_ps(s + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    if (j < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 p = exp2_ps(_mm512_fmsub_ps(cv, _mm512_maskz_loadu_ps(k, s + j), mv));
      _mm512_mask_storeu_ps(s + j, k, p);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, p));
    }
    return _mm512_reduce_add_ps(sum);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 cv = _mm256_set1_ps(c), mv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 p = exp2_ps(_mm256_fmsub_ps(cv, _mm256_loadu_ps(s + j), mv));
      _mm256_storeu_ps(s + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    if (j < n) {  // masked lanes load 0 and are then set to -inf: p = 0 there
      const __m256i k = lanes_below8(n - j);
      const __m256 x = _mm256_blendv_ps(_mm256_set1_ps(neg_inf<float>()),
                                        _mm256_fmsub_ps(cv, _mm256_maskload_ps(s + j, k), mv),
                                        _mm256_castsi256_ps(k));
      const __m256 p = exp2_ps(x);
      _mm256_maskstore_ps(s + j, k, p);
      sum = _mm256_add_ps(sum, p);
    }
    return hsum8(sum);
  }
#endif
  acc_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t p = std::exp2(c * s[j] - mx);
    s[j] = p;
    sum += p;
  }
  return sum;
}

// s[j] <- exp2(s[j] - mx) for j < n; returns the sum.  mx is finite.  (c = 1: the FMA's product is
// exact, so this is s[j] - mx to the bit.)
template <typename T>
inline T exp2_sub_sum(T* s, int64_t n, T mx) {
  return exp2_scaled_sum(s, n, T(1), mx);
}

// max_j s[j] over n >= 1 entries.
template <typename T>
inline T row_max(const T* s, int64_t n) {
  return scaled_max(s, n, T(1));
}

// out[r] = exp2(a[r] - b[r]) for r < n: the online softmax's rescale factors (old max minus new
// max) of a tile's rows, a vector of rows at a time in float32 (exp2_ps: 6e-8 relative on
// AVX-512, 1.9e-7 on AVX2; a factor multiplies a row's output and its sum alike, so its error
// cancels in their ratio), std::exp2 otherwise.  Exact where it matters to the callers: a
// difference of 0 gives 1 (p(0) = 1), -inf gives 0, NaN gives NaN.  One call per row of libm's
// exp2f, in the chain from the row's max to its sum, was 4.5% of the bfloat16 forward's samples
// (B=1 H=8 N=1024 D=64, perf, Xeon with AMX, session 18).
template <typename T>
inline void exp2_diff(const T* a, const T* b, T* out, int64_t n) {
  int64_t r = 0;
  if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
    for (; r + 16 <= n; r += 16)
      _mm512_storeu_ps(out + r, exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(a + r), _mm512_loadu_ps(b + r))));
    if (r < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - r)) - 1u);
      _mm512_mask_storeu_ps(out + r, k,
                            exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, a + r), _mm512_maskz_loadu_ps(k, b + r))));
      r = n;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; r + 8 <= n; r += 8)
      _mm256_storeu_ps(out + r, exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(a + r), _mm256_loadu_ps(b + r))));
#endif
  }
  for (; r < n; ++r) out[r] = std::exp2(a[r] - b[r]);
}


// Runs `work(task)` for task in [0, ntasks) on torch's intra-op pool, handing tasks out
// dynamically (causal tasks differ in size; tasks are ordered largest first by the callers).
// `make_state()` builds each worker's scratch once.
template <typename MakeState, typename Work>
void run_tasks(int64_t ntasks, MakeState make_state, Work work) {
  if (ntasks <= 0) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), ntasks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    // Called from inside another parallel region, at::parallel_for runs this inline for all
    // workers at once: the first drains the queue, and the scratch is only built on demand.
    for (int64_t w = begin; w < end; ++w) {
      std::optional<decltype(make_state())> state;
      for (int64_t t = next.fetch_add(1); t < ntasks; t = next.fetch_add(1)) {
        if (!state) state.emplace(make_state());
        work(*state, t);
      }
    }
  });
}

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;

// bfloat16 tiles: C[r][c] (+)= sum_k A[r][k] B[k][c] with A row-major bf16 [rows][lda] read as
// pairs (k even, k + 1), B in pair-interleaved layout B[kp][c][2] (ldb bf16 per pair row,
// columns padded to a multiple of 16 so loads need no mask), C float32.  vdpbf16ps multiplies
// 16 column pairs and adds both products into float32 lanes.
template <int R, int NV>
inline void micro_bf16(int64_t KP, const uint16_t* __restrict A, int64_t lda,
                       const uint16_t* __restrict B, int64_t ldb, float* __restrict C,
                       int64_t ldc, __mmask16 last, bool accumulate) {
  __m512 acc[R][NV];
  load_acc(acc, C, ldc, last, accumulate);
  for (int64_t kp = 0; kp < KP; ++kp) {
    const uint16_t* b = B + kp * ldb;
    __m512bh bv[NV];
#pragma GCC unroll 32
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + 32 * v);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * kp, sizeof(pair));
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 32
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  store_acc(acc, C, ldc, last);
}

template <int NV, int R>
inline void micro_rows_bf16(int64_t rows, int64_t KP, const uint16_t* A, int64_t lda,
                            const uint16_t* B, int64_t ldb, float* C, int64_t ldc, __mmask16 last,
                            bool accumulate) {
  if constexpr (R > 1) {
    if (rows == R - 1) {
      micro_bf16<R - 1, NV>(KP, A, lda, B, ldb, C, ldc, last, accumulate);
      return;
    }
    micro_rows_bf16<NV, R - 1>(rows, KP, A, lda, B, ldb, C, ldc, last, accumulate);
  }
}

template <int NV>
inline void panel_bf16(int64_t rows, int64_t KP, const uint16_t* A, int64_t lda,
                       const uint16_t* B, int64_t ldb, float* C, int64_t ldc, __mmask16 last,
                       bool accumulate) {
  constexpr int R = rows_for<NV>();
  int64_t r = 0;
  for (; r + R <= rows; r += R)
    micro_bf16<R, NV>(KP, A + r * lda, lda, B, ldb, C + r * ldc, ldc, last, accumulate);
  if (r < rows)
    micro_rows_bf16<NV, R>(rows - r, KP, A + r * lda, lda, B, ldb, C + r * ldc, ldc, last,
                           accumulate);
}

// C [rows][cols] (+)= A [rows][K] B [K][cols]; K counted in elements (odd K: A and B carry a
// zero in the pair's second slot).
inline void gemm_bf16(int64_t rows, int64_t cols, int64_t K, const uint16_t* A, int64_t lda,
               const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t KP = ceil_div(K, 2);
  const int64_t nv = ceil_div(cols, 16);
  const int64_t panels = ceil_div(nv, 4);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t v0 = p * nv / panels, v1 = (p + 1) * nv / panels;
    const int64_t tail = std::min(cols, v1 * 16) - (v1 - 1) * 16;
    const __mmask16 last = static_cast<__mmask16>((1u << tail) - 1u);
    const uint16_t* b = B + v0 * 32;
    float* c = C + v0 * 16;
    switch (v1 - v0) {
      case 1: panel_bf16<1>(rows, KP, A, lda, b, ldb, c, ldc, last, accumulate); break;
      case 2: panel_bf16<2>(rows, KP, A, lda, b, ldb, c, ldc, last, accumulate); break;
      case 3: panel_bf16<3>(rows, KP, A, lda, b, ldb, c, ldc, last, accumulate); break;
      default: panel_bf16<4>(rows, KP, A, lda, b, ldb, c, ldc, last, accumulate); break;
    }
  }
}

// n floats -> bf16 (round to nearest even), zero-filling up to n_pad.
inline void to_bf16(const float* src, int64_t n, uint16_t* dst, int64_t n_pad) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1u);
    _mm256_mask_storeu_epi16(dst + j, k, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, src + j)));
  }
  for (j = n; j < n_pad; ++j) dst[j] = 0;
}
#else
constexpr bool kHaveBf16Dot = false;
#endif

// The bits of a 16-bit float (the packed operands of the bfloat16 dot path and of brgemm).
inline uint16_t bits16(at::BFloat16 x) { return x.x; }
inline uint16_t bits16(at::Half x) { return x.x; }

// n floats -> 16-bit T16 (bfloat16 or float16, round to nearest even), zero-filling up to n_pad.
template <typename T16>
inline void to_bits16(const float* src, int64_t n, uint16_t* dst, int64_t n_pad) {
  int64_t j = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T16, at::BFloat16>) {
    to_bf16(src, n, dst, n_pad);
    return;
  }
#endif
#if defined(__F16C__) && (defined(__AVX2__) || defined(__AVX512F__))
  if constexpr (std::is_same_v<T16, at::Half>) {
    for (; j + 8 <= n; j += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; j < n; ++j) dst[j] = bits16(T16(src[j]));
  for (j = n; j < n_pad; ++j) dst[j] = 0;
}

// One row of P in 16 bits, in one pass: dst[j] = T16(exp2(c s[j] - mx)) (round to nearest even)
// for j in [lo, hi), 0 for j in [0, lo) and [hi, n_pad); returns the float32 sum of the
// exponentials before rounding.  What exp2_scaled_sum(s + lo, hi - lo, c, mx) and then to_bits16
// of the row with zeros outside [lo, hi) give -- with exp2_ps_p16's polynomial on AVX-512 (2.9e-6
// relative, under a 16-bit ulp) -- but the float32 exponentials never go back to memory and the
// row is read once, not three times (the exponential pass, the zero fills, the conversion).
// s[lo, hi) may be overwritten (the fallback works in place).  The 16-bit forward tiles' hot loop
// on a Xeon with AMX, where oneDNN's brgemm does the products: exp2_scaled_sum and the conversion
// were 18% and ~10% of the bfloat16 forward's samples (B=1 H=8 N=1024 D=64, perf, session 17).
template <typename T16>
inline float exp2_scaled_sum_bits16(float* s, int64_t lo, int64_t hi, float c, float mx, uint16_t* dst,
                                    int64_t n_pad) {
#if defined(__AVX512F__)
  if constexpr (kRound16Vector<T16>) {
    if (lo > 0) std::memset(dst, 0, static_cast<size_t>(lo) * sizeof(uint16_t));
    const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = lo;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T16, at::BFloat16>) {
      // 32 at a time: one vcvtne2ps2bf16 rounds two vectors (vcvtneps2bf16 is as costly for one).
      __m512 sum2 = _mm512_setzero_ps();
      for (; j + 32 <= hi; j += 32) {
        const __m512 p0 = exp2_ps_p16(_mm512_fmsub_ps(cv, _mm512_loadu_ps(s + j), mv));
        const __m512 p1 = exp2_ps_p16(_mm512_fmsub_ps(cv, _mm512_loadu_ps(s + j + 16), mv));
        sum = _mm512_add_ps(sum, p0);
        sum2 = _mm512_add_ps(sum2, p1);
        _mm512_storeu_si512(dst + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      sum = _mm512_add_ps(sum, sum2);
    }
#endif
    for (; j + 16 <= hi; j += 16) {
      const __m512 p = exp2_ps_p16(_mm512_fmsub_ps(cv, _mm512_loadu_ps(s + j), mv));
      sum = _mm512_add_ps(sum, p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), round16_ps<T16>(p));
    }
    if (j < hi) {
      const __mmask16 k = static_cast<__mmask16>((1u << (hi - j)) - 1u);
      const __m512 p = exp2_ps_p16(_mm512_fmsub_ps(cv, _mm512_maskz_loadu_ps(k, s + j), mv));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, p));
      _mm256_mask_storeu_epi16(dst + j, k, round16_ps<T16>(p));
      j = hi;
    }
    if (n_pad > j) std::memset(dst + j, 0, static_cast<size_t>(n_pad - j) * sizeof(uint16_t));
    return _mm512_reduce_add_ps(sum);
  }
#endif
  const float sum = hi > lo ? exp2_scaled_sum(s + lo, hi - lo, c, mx) : 0.f;
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + std::max(hi, n_pad), 0.f);
  to_bits16<T16>(s, std::max(hi, n_pad), dst, n_pad);
  return sum;
}

#if defined(__AVX512F__)
// 16 x 16 transpose of 32-bit words in registers: r[i] becomes column i (64 shuffles).
__attribute__((always_inline)) inline void tile_transpose16(__m512 (&r)[16]) {
  __m512 t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved: t[2i] = a0 b0 a1 b1 | a4 b4 ..
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {  // rows 4g..4g+3: u[4g + c] = column c (mod 4) of each 128-bit lane
    u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // gather the 128-bit lanes: columns c, c + 4, c + 8, c + 12
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[c + 4] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[c + 12] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}

// 32-bit words: dst[c * ldd + r] = src[r * sn + c] for r < rows <= 16, c < cols <= 16 (strides
// in bytes); dst's lanes past `rows` are left alone.
inline void transpose_words(const char* src, int64_t sn, int rows, int cols, char* dst, int64_t ldd) {
  const __mmask16 cm = static_cast<__mmask16>((1u << cols) - 1u);
  const __mmask16 rm = static_cast<__mmask16>((1u << rows) - 1u);
  __m512 r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    r[i] = i < rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(cm, src + i * sn)) : _mm512_setzero_ps();
  tile_transpose16(r);
  for (int c = 0; c < cols; ++c) _mm512_mask_storeu_epi32(dst + c * ldd, rm, _mm512_castps_si512(r[c]));
}

// Rows of 32-bit words, transposed in 16 x 16 blocks: dst[c * ldd + r] = src[r * sn + c] for
// r < rows, c < cols (strides in bytes).
inline void transpose_words_all(const char* src, int64_t sn, int64_t rows, int64_t cols, char* dst,
                                int64_t ldd) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16)
      transpose_words(src + r0 * sn + c0 * 4, sn, static_cast<int>(std::min<int64_t>(16, rows - r0)),
                      static_cast<int>(std::min<int64_t>(16, cols - c0)), dst + c0 * ldd + r0 * 4, ldd);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 8 x 8 transpose of floats in registers: r[i] becomes column i.
__attribute__((always_inline)) inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {
    u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA tiles for few query rows against rows of keys read in place (the softmax decode,
// csrc/cpu/softmax.cpp; Hopfield retrievals of few states, csrc/cpu/hopfield.cpp): K and V as
// float32, bfloat16 or float16 (T), 16-bit elements widened in registers (load8_as_float), so
// neither is converted into a scratch copy.
// Measured against the tiles before (scores: 4 rows x 2 keys, 8 accumulators, float32 K only;
// P V: the flash GEMM tile, 4 rows x 16 columns; 16-bit K transposed into float32 per tile and
// V converted per tile), AMD EPYC Zen 3, B=8 Hq=32 Hk=8 N=1 D=128, 2 threads
// (bench/softmax_cpu_speed.py decode): float32 M=16384 86-92 -> 73-78 ms; one thread, K and V
// in cache (B=Hk=1 M=2048): float32 167 -> 150 us, bfloat16 225 -> 125 us a call.


// S[r][j] = q_r . K[j] for RB query rows and KB keys at once (RB * KB accumulators, each K
// vector loaded once for all RB rows), K rows in place (ldk elements apart), keys past kn
// repeating the last one (their sums are not stored), D's last partial vector masked.  The sums
// are folded with horizontal adds, four at a time.
template <int RB, int KB, typename T>
inline void decode_dots_block(const float* q, int64_t ldq, const T* K, int64_t ldk, int64_t D, int64_t kn,
                              float* S, int64_t lds) {
  constexpr int A = RB * KB;
  static_assert(A % 4 == 0 && A <= 12, "4, 8 or 12 accumulators");
  __m256 acc[A];
  #pragma GCC unroll 12
  for (int a = 0; a < A; ++a) acc[a] = _mm256_setzero_ps();
  const T* kr[KB];
  #pragma GCC unroll 12
  for (int j = 0; j < KB; ++j) kr[j] = K + std::min<int64_t>(j, kn - 1) * ldk;
  const int64_t D8 = D / 8 * 8;
  for (int64_t d = 0; d < D8; d += 8) {
    __m256 kv[KB];
    #pragma GCC unroll 12
    for (int j = 0; j < KB; ++j) kv[j] = load8_as_float(kr[j] + d);
    #pragma GCC unroll 12
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * ldq + d);
      #pragma GCC unroll 12
      for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm256_fmadd_ps(qv, kv[j], acc[r * KB + j]);
    }
  }
  if (D8 < D) {
    __m256 kv[KB];
    #pragma GCC unroll 12
    for (int j = 0; j < KB; ++j) kv[j] = load8_tail(kr[j] + D8, D - D8);
    #pragma GCC unroll 12
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_maskload_ps(q + r * ldq + D8, lanes_below8(D - D8));
      #pragma GCC unroll 12
      for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm256_fmadd_ps(qv, kv[j], acc[r * KB + j]);
    }
  }
  // lane i of u = the sum of acc[4g + i] (lanes 0-3)
  alignas(32) float t[12];
  #pragma GCC unroll 3
  for (int g = 0; g < A / 4; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[4 * g], acc[4 * g + 1]),
                                    _mm256_hadd_ps(acc[4 * g + 2], acc[4 * g + 3]));
    _mm_store_ps(t + 4 * g, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  const int64_t kk = std::min<int64_t>(KB, kn);
  #pragma GCC unroll 12
  for (int r = 0; r < RB; ++r)
    for (int64_t j = 0; j < kk; ++j) S[r * lds + j] = t[r * KB + j];
}

// S[r][j] = q_r . K[j] for r < R, j < kn: key blocks outer (each block's K rows stay in L1 over
// the row blocks), rows in blocks of 4 (three keys each: 12 accumulators), the last 1-3 rows
// with more keys each.
template <typename T>
inline void decode_dots_avx2(const float* q, int64_t R, int64_t D, const T* K, int64_t ldk, int64_t kn,
                             float* S, int64_t lds) {
  const int64_t R4 = R / 4 * 4, rt = R - R4;
  constexpr int64_t kb = 12;  // keys per block: a multiple of 3, 4 and 6
  for (int64_t j0 = 0; j0 < kn; j0 += kb) {
    const int64_t je = std::min(kn, j0 + kb);
    for (int64_t r0 = 0; r0 < R4; r0 += 4)
      for (int64_t j1 = j0; j1 < je; j1 += 3)
        decode_dots_block<4, 3>(q + r0 * D, D, K + j1 * ldk, ldk, D, kn - j1, S + r0 * lds + j1, lds);
    const float* qt = q + R4 * D;
    float* st = S + R4 * lds;
    for (int64_t j1 = j0; j1 < je; j1 += (rt == 3 ? 4 : rt == 2 ? 6 : 12)) {
      if (rt == 3) decode_dots_block<3, 4>(qt, D, K + j1 * ldk, ldk, D, kn - j1, st + j1, lds);
      else if (rt == 2) decode_dots_block<2, 6>(qt, D, K + j1 * ldk, ldk, D, kn - j1, st + j1, lds);
      else if (rt == 1) decode_dots_block<1, 12>(qt, D, K + j1 * ldk, ldk, D, kn - j1, st + j1, lds);
    }
  }
}


// O[r][c] += sum_{j < kn} P[r * ldp + j] V[j][c] for RB rows: column panels of NV vectors
// (micro_f32 on V's rows in place, RB x NV accumulators, each V vector loaded and widened once
// for the RB rows), then the remainder one vector at a time, the last masked.
template <int RB, int NV, typename T>
inline void decode_pv_rows(int64_t kn, const float* P, int64_t ldp, const T* V, int64_t ldv, float* O,
                           int64_t ldo, int64_t Dv) {
  int64_t c0 = 0;
  for (; c0 + 8 * NV <= Dv; c0 += 8 * NV)
    micro_f32<RB, NV>(kn, P, ldp, 1, V + c0, ldv, O + c0, ldo, FullCols{}, true);
  for (; c0 < Dv; c0 += 8) {  // the rest, one vector at a time (at most NV - 1 of them)
    const int64_t w = std::min<int64_t>(8, Dv - c0);
    if (w == 8) micro_f32<RB, 1>(kn, P, ldp, 1, V + c0, ldv, O + c0, ldo, FullCols{}, true);
    else micro_f32<RB, 1>(kn, P, ldp, 1, V + c0, ldv, O + c0, ldo, lanes_below8(w), true, w);
  }
}

// O [R][Dv] += P [R][kn] V [kn][Dv]: rows in blocks of 4 (3 column vectors: 12 accumulators),
// the last 1-3 rows with 4, 6 or 8 column vectors.
template <typename T>
inline void decode_pv_avx2(int64_t R, int64_t kn, const float* P, int64_t ldp, const T* V, int64_t ldv, float* O,
                           int64_t Dv) {
  const int64_t R4 = R / 4 * 4, rt = R - R4;
  for (int64_t r0 = 0; r0 < R4; r0 += 4) decode_pv_rows<4, 3>(kn, P + r0 * ldp, ldp, V, ldv, O + r0 * Dv, Dv, Dv);
  const float* pt = P + R4 * ldp;
  float* ot = O + R4 * Dv;
  if (rt == 3) decode_pv_rows<3, 4>(kn, pt, ldp, V, ldv, ot, Dv, Dv);
  else if (rt == 2) decode_pv_rows<2, 6>(kn, pt, ldp, V, ldv, ot, Dv, Dv);
  else if (rt == 1) decode_pv_rows<1, 8>(kn, pt, ldp, V, ldv, ot, Dv, Dv);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16-bit rows widened and transposed in 16 x 16 blocks: dst[c * ldd + r] = float(src[r * sn + c])
// for r < rows, c < cols (strides in elements).
template <typename T16>
inline void transpose_widen16(const T16* src, int64_t sn, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int rn = static_cast<int>(std::min<int64_t>(16, rows - r0));
      const int cn = static_cast<int>(std::min<int64_t>(16, cols - c0));
      const __mmask16 cm = static_cast<__mmask16>((1u << cn) - 1u);
      const __mmask16 rm = static_cast<__mmask16>((1u << rn) - 1u);
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = i < rn ? load16_as_float(src + (r0 + i) * sn + c0, cm) : _mm512_setzero_ps();
      tile_transpose16(r);
      for (int c = 0; c < cn; ++c) _mm512_mask_storeu_ps(dst + (c0 + c) * ldd + r0, rm, r[c]);
    }
}
#endif

// dst[d] = src[d * sd] for d < n, converted to acc_t (16-bit rows with unit stride: 16 at a time
// on AVX-512, 8 at a time on AVX2 -- float16 through F16C: c10::Half's scalar conversion left the
// one-query Hopfield update at 11 ms, twice its bfloat16 time, S=1 N=262144 D=64, AMD EPYC Zen 3).
template <typename scalar_t, typename acc_t>
inline void convert_row(const scalar_t* src, int64_t sd, int64_t n, acc_t* dst) {
  int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (kIs16<scalar_t> && std::is_same_v<acc_t, float>) {
    if (sd == 1) {
      widen16_row(src, n, dst);
      return;
    }
  }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#if defined(__F16C__)
  constexpr bool kHalf8 = std::is_same_v<scalar_t, at::Half>;
#else
  constexpr bool kHalf8 = false;
#endif
  if constexpr ((std::is_same_v<scalar_t, at::BFloat16> || kHalf8) && std::is_same_v<acc_t, float>) {
    if (sd == 1)
      for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, load8_as_float(src + d));
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<acc_t>(src[d * sd]);
}

// dst[d * ldd + jj] = src[jj * sn + d * sd] for jj < kn, d < D: one key block transposed (and
// converted).  float32 rows (sd = 1): 16 x 16 blocks transposed in registers; other strides:
// 16 keys at a time with a gather.  Measured on a call that is all packing (B=1 H=32 N=1
// M=4096 D=128 float32, 2 threads): 188 ms with the scalar loop (and V copied), 37 ms with the
// gather (and V read in place).
template <typename scalar_t, typename acc_t>
void pack_transposed(const scalar_t* src, int64_t sn, int64_t sd, int64_t kn, int64_t D,
                     acc_t* dst, int64_t ldd) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    if (sd == 1) {
      transpose_words_all(reinterpret_cast<const char*>(src), sn * 4, kn, D,
                          reinterpret_cast<char*>(dst), ldd * 4);
      return;
    }
    if (16 * sn < (int64_t(1) << 31)) {
      const __m512i idx = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32(static_cast<int32_t>(sn)));
      for (int64_t j0 = 0; j0 < kn; j0 += 16) {
        const __mmask16 m = kn - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (kn - j0)) - 1u);
        const float* base = src + j0 * sn;
        for (int64_t d = 0; d < D; ++d)
          _mm512_mask_storeu_ps(dst + d * ldd + j0, m,
                                _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, base + d * sd, 4));
      }
      return;
    }
  }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  // 16-bit rows (sd = 1) widened in registers on the way: the scalar loop's conversions, with
  // store_scaled_row's, were ~12% of a float16 forward (flash_tiles.h, session 26).
  if constexpr (kIs16<scalar_t> && std::is_same_v<acc_t, float>) {
    if (sd == 1) {
      transpose_widen16(src, sn, kn, D, dst, ldd);
      return;
    }
  }
#endif
#elif defined(__AVX2__) && defined(__FMA__)
  // float32 or bfloat16 rows (sd = 1) to float32: 8 x 8 blocks transposed in registers, the
  // edges (kn or D not a multiple of 8) by the scalar loop.  Measured (B=1 H=8 N=1024 D=64,
  // AMD EPYC Zen 3, one thread): the scalar loop alone was ~2% of the forward, with every thread
  // packing every head.
  if constexpr (std::is_same_v<acc_t, float> &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>)) {
    if (sd == 1) {
      const int64_t kn8 = kn / 8 * 8, D8 = D / 8 * 8;
      for (int64_t j0 = 0; j0 < kn8; j0 += 8)
        for (int64_t d0 = 0; d0 < D8; d0 += 8) {
          __m256 r[8];
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) r[i] = load8_as_float(src + (j0 + i) * sn + d0);
          transpose8(r);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (d0 + i) * ldd + j0, r[i]);
        }
      for (int64_t jj = 0; jj < kn; ++jj)
        for (int64_t d = jj < kn8 ? D8 : 0; d < D; ++d) dst[d * ldd + jj] = static_cast<acc_t>(src[jj * sn + d]);
      return;
    }
  }
#endif
  for (int64_t jj = 0; jj < kn; ++jj)
    for (int64_t d = 0; d < D; ++d) dst[d * ldd + jj] = static_cast<acc_t>(src[jj * sn + d * sd]);
}

// Where element (k, n) of a 16-bit B operand [K][ld] lies: pairs of k (VNNI: the layout of the
// bfloat16 dot path and of brgemm's packed B) or plain rows.
inline int64_t b16_index(int64_t k, int64_t n, int64_t ld, bool pairs) {
  return pairs ? ((k >> 1) * ld + n) * 2 + (k & 1) : k * ld + n;
}

// One key block transposed to 16-bit bits: element (d, jj) = src[jj * sn + d * sd] at
// b16_index(d, jj, ldd, pairs) -- pairs along d: dst[(dp * ldd + jj) * 2 + e] = src[jj * sn +
// (2 dp + e) * sd]; plain: dst[d * ldd + jj].
template <typename scalar_t>
void pack_transposed_pairs(const scalar_t* src, int64_t sn, int64_t sd, int64_t kn, int64_t D,
                           uint16_t* dst, int64_t ldd, bool pairs = true) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
    if (pairs && sd == 1 && D % 2 == 0) {
      // A pair is one 32-bit word: rows of D / 2 words transposed in registers.
      transpose_words_all(reinterpret_cast<const char*>(src), sn * 2, kn, D / 2,
                          reinterpret_cast<char*>(dst), ldd * 4);
      return;
    }
  }
#endif
  for (int64_t jj = 0; jj < kn; ++jj)
    for (int64_t d = 0; d < D; ++d) dst[b16_index(d, jj, ldd, pairs)] = bits16(src[jj * sn + d * sd]);
}

// Rows of a 16-bit operand, not transposed: element (r, d) = src[r * sn + d * sd] at
// b16_index(r, d, ldd, pairs) for r < rows, d < cols -- pairs along r (a VNNI B operand whose K
// runs over the rows: V's keys, dO's / Q's query rows) or plain rows (a B operand without VNNI,
// or an A operand [rows][ldd]) -- and zeros for the rows [rows, rows_pad) (a K tail padded with
// zeros: the buffer may hold an earlier, longer block there).
template <typename scalar_t>
void pack_rows16(const scalar_t* src, int64_t sn, int64_t sd, int64_t rows, int64_t cols, uint16_t* dst,
                 int64_t ldd, bool pairs, int64_t rows_pad) {
#if defined(__AVX512BW__)
  // Unit stride along the row: plain rows are copies of the bits, pairs interleave two rows 32
  // columns at a time (vpermt2w).  The backward packs Q and dO per tile pair on AMX (session 17).
  if (sd == 1) {
    const auto row_bits = [&](int64_t r) { return reinterpret_cast<const uint16_t*>(src + r * sn); };
    if (!pairs) {
      for (int64_t r = 0; r < rows_pad; ++r) {
        uint16_t* out = dst + r * ldd;
        if (r < rows) std::memcpy(out, row_bits(r), static_cast<size_t>(cols) * sizeof(uint16_t));
        else std::memset(out, 0, static_cast<size_t>(cols) * sizeof(uint16_t));
      }
      return;
    }
    alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                                     22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                                     28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
    for (int64_t r = 0; r < rows_pad; r += 2) {
      uint16_t* out = dst + (r / 2) * ldd * 2;  // b16_index(r, 0, ldd, true)
      for (int64_t d = 0; d < cols; d += 32) {
        const int64_t dn = std::min<int64_t>(32, cols - d);
        const __mmask32 m = static_cast<__mmask32>(dn == 32 ? ~0u : (1u << dn) - 1u);
        const __m512i a = r < rows ? _mm512_maskz_loadu_epi16(m, row_bits(r) + d) : _mm512_setzero_si512();
        const __m512i b = r + 1 < rows ? _mm512_maskz_loadu_epi16(m, row_bits(r + 1) + d) : _mm512_setzero_si512();
        const __m512i lo = _mm512_permutex2var_epi16(a, lo_idx, b);  // columns d .. d + 15, as pairs
        const __m512i hi = _mm512_permutex2var_epi16(a, hi_idx, b);  // columns d + 16 .. d + 31
        const int64_t n_lo = std::min<int64_t>(16, dn), n_hi = dn - n_lo;
        _mm512_mask_storeu_epi16(out + 2 * d, static_cast<__mmask32>(n_lo == 16 ? ~0u : (1u << (2 * n_lo)) - 1u), lo);
        if (n_hi > 0)
          _mm512_mask_storeu_epi16(out + 2 * d + 32,
                                   static_cast<__mmask32>(n_hi == 16 ? ~0u : (1u << (2 * n_hi)) - 1u), hi);
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows_pad; ++r) {
    uint16_t* out = dst + b16_index(r, 0, ldd, pairs);
    const int64_t step = pairs ? 2 : 1;
    if (r >= rows) {
      for (int64_t d = 0; d < cols; ++d) out[d * step] = 0;
      continue;
    }
    const scalar_t* in = src + r * sn;
    for (int64_t d = 0; d < cols; ++d) out[d * step] = bits16(in[d * sd]);
  }
}

// A float tile transposed and rounded to 16-bit T16 (an A operand [cols][ldd] of a product over
// the tile's rows): dst[c * ldd + r] = T16(src[r * lds + c]) for r < rows, c < cols, and zeros for
// r in [rows, rows_pad) (the K tail padded with zeros).
// Blocks of 16 x 16 transposed in registers (tile_transpose16) where the CPU converts 16 floats
// at once (AVX512-BF16 for bfloat16, AVX-512F for float16): the scalar loop read src down its
// columns, one element a cache line.  The backward on a Xeon with AMX transposes P and dS of
// every tile pair (session 17).
template <typename T16>
void to_bits16_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, uint16_t* dst,
                          int64_t ldd, int64_t rows_pad) {
#if defined(__AVX512F__)
  if constexpr (kRound16Vector<T16>) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int rn = static_cast<int>(std::min<int64_t>(16, rows - r0));
      const __mmask16 rm = static_cast<__mmask16>((1u << rn) - 1u);
      for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        const int cn = static_cast<int>(std::min<int64_t>(16, cols - c0));
        const __mmask16 cm = static_cast<__mmask16>((1u << cn) - 1u);
        __m512 t[16];
        for (int r = 0; r < 16; ++r)
          t[r] = r < rn ? _mm512_maskz_loadu_ps(cm, src + (r0 + r) * lds + c0) : _mm512_setzero_ps();
        tile_transpose16(t);
        for (int c = 0; c < cn; ++c)
          _mm256_mask_storeu_epi16(dst + (c0 + c) * ldd + r0, rm, round16_ps<T16>(t[c]));
      }
    }
    if (rows_pad > rows)
      for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * ldd + rows, dst + c * ldd + rows_pad, uint16_t(0));
    return;
  }
#endif
  for (int64_t c = 0; c < cols; ++c) {
    uint16_t* out = dst + c * ldd;
    for (int64_t r = 0; r < rows; ++r) out[r] = bits16(T16(src[r * lds + c]));
    std::fill(out + rows, out + rows_pad, uint16_t(0));
  }
}

}  // namespace
}  // namespace attnkit

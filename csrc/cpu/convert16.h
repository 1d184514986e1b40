// 16-bit float rows (bfloat16, float16) widened to float32, and float32 rows rounded to them, 16
// at a time on AVX-512: exact widening, and the rounding of T16(x); far cheaper than c10::Half's
// scalar conversions, which do not vectorize (one vcvtph2ps / vcvtps2ph per element).  Shared by
// flash_tiles.h (convert_row, transpose_widen16, finish_row) and linear.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace attnkit {
namespace {

// Whether T is a 16-bit float (bfloat16 or float16).
template <typename T>
inline constexpr bool kIs16 = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Up to 16 consecutive 16-bit floats as float32 (exact), the lanes outside `cm` zero (and not read).
template <typename T16>
__attribute__((always_inline)) inline __m512 load16_as_float(const T16* p, __mmask16 cm) {
  const __m256i x = _mm256_maskz_loadu_epi16(cm, p);
  if constexpr (std::is_same_v<T16, at::Half>) return _mm512_cvtph_ps(x);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

// dst[d] = float(src[d]) for d < n.
template <typename T16>
inline void widen16_row(const T16* src, int64_t n, float* dst) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(dst + d, load16_as_float(src + d, __mmask16(0xFFFF)));
  if (d < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - d)) - 1u);
    _mm512_mask_storeu_ps(dst + d, k, load16_as_float(src + d, k));
  }
}
#endif

#if defined(__AVX512F__)
// Whether 16 floats round to T16 in one instruction here -- AVX512-BF16's vcvtneps2bf16 for
// bfloat16, AVX-512F's vcvtps2ph for float16 -- and that rounding (to nearest even, as T16(x)).
template <typename T16>
inline constexpr bool kRound16Vector =
#if defined(__AVX512BF16__)
    true;
#else
    std::is_same_v<T16, at::Half>;
#endif

template <typename T16>
inline __m256i round16_ps(__m512 x) {
  if constexpr (std::is_same_v<T16, at::Half>) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    return _mm256_setzero_si256();  // (not reached: kRound16Vector<T16> is false)
#endif
  }
}
#endif

// dst[d] = scalar_t(src[d] * f) for d < n (float32 sources into 16-bit rows: 16 at a time where
// the rounding is one instruction, kRound16Vector).  The scalar loop's conversions were ~12% of a
// float16 forward (B=1 H=8 N=1024 D=64 causal, one thread, Xeon without AMX, perf, session 26)
// together with the operands' widening (flash_tiles.h: convert_row, transpose_widen16).
template <typename scalar_t, typename acc_t>
inline void store_scaled_row(const acc_t* src, acc_t f, int64_t n, scalar_t* dst) {
  int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<acc_t, float> &&
                (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>)) {
    if constexpr (kRound16Vector<scalar_t>) {
      const __m512 fv = _mm512_set1_ps(f);
      for (; d + 16 <= n; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            round16_ps<scalar_t>(_mm512_mul_ps(_mm512_loadu_ps(src + d), fv)));
      if (d < n) {
        const __mmask16 k = static_cast<__mmask16>((1u << (n - d)) - 1u);
        _mm256_mask_storeu_epi16(dst + d, k, round16_ps<scalar_t>(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, src + d), fv)));
        d = n;
      }
    }
  }
#endif
  for (; d < n; ++d) dst[d] = static_cast<scalar_t>(src[d] * f);
}

}  // namespace
}  // namespace attnkit

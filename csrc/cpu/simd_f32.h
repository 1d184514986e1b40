// AVX-512 float32 helpers shared by CPU kernel files: the horizontal sums of 16 vectors as one
// vector (a transpose-and-add tree: the Hopfield streaming retrieval and the softmax decode
// scores fold dot products of 16 rows with it) and exp(x) for x <= 0 on 16 lanes (the Hopfield
// kernels, linear attention's elu).
//
// Anonymous namespace, as in flash_tiles.h: each kernel file keeps its own copy.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace attnkit {
namespace {

// Lane r of the result = the sum of the 16 lanes of v[r].
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  __m512 t[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], a = v[2i], b = v[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 u[4];
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the partials of rows 4j .. 4j+3
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Sum the four 128-bit lanes of each u[j], keeping the rows in order.
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp_nonpositive on 16 lanes (same reduction and polynomial as the scalar exp_nonpositive of csrc/cpu/hopfield.cpp; exactly 0
// below -87).  max with -87 first as the first operand: vmaxps returns its second operand for
// NaN, so NaN stays NaN (and the ordered compare is false for NaN, so it is not zeroed).
inline __m512 exp_nonpositive_v(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

}  // namespace
}  // namespace attnkit
#endif  // __AVX512F__

// The float16 split (gemm_path.h, GemmPath::kSplitBf16): float16 products on a CPU whose AMX
// multiplies bfloat16 only.  A value x becomes two bfloat16, hi = bf16(x) (round to nearest even)
// and lo = bf16(x - hi).  For a float16 x the pair is exact (11 significant bits: hi holds 8, x - hi
// at most 3); for a float32 x (P, dS) it keeps 16 bits, x - hi - lo under 2^-17 |x|.  hi is zero,
// infinite or NaN where x is, so the product of two his carries IEEE's rules for x y (0 inf = NaN,
// NaN spreads); every other partial product must stay finite, or inf - inf and 0 inf would make
// NaNs that x y has not: so a non-finite x gets lo = 0, and the partial products that pair a hi
// with a lo take hif -- hi with its non-finite values zeroed.
//
// The operands of the softmax kernels' products (csrc/cpu/softmax.cpp), all on brgemm's bfloat16
// VNNI layout:
//   float16 x float16 (S = Q K^T, dP = dO V^T): one product of depth 4 D2, A's rows
//     [hi | hif | lo | lo] (pack_split_rows4) against B's depth rows [hi; lo; hif; lo]
//     (pack_split_transposed4): hi hi + hif lo + lo hif + lo lo, each exact in float32.
//   float32 x float16 (O += P V, and the backward's P^T dO, dS^T Q, dS K): two products, A's
//     pairs (hi, hif) per k (split_f32_rows) against B's pairs (hi, lo) of row k
//     (pack_split_pairs), then A's lo against B's hif rows in VNNI pairs: x (y_hi + y_lo) +
//     x_lo y_hif, x kept to 16 bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "flash_tiles.h"

namespace attnkit {

inline void split_bf16_scalar(float x, uint16_t& hi, uint16_t& lo, uint16_t& hif) {
  const at::BFloat16 h(x);
  const float hf = static_cast<float>(h);
  const bool finite = std::isfinite(hf);
  hi = h.x;
  lo = finite ? at::BFloat16(x - hf).x : uint16_t(0);
  hif = finite ? h.x : uint16_t(0);
}

#if defined(__AVX512BF16__)
// 16 floats: hi and lo as 16 bfloat16 each, and (where hif is not null) hif; lo and hif zero
// where hi is not finite (the inputs: P is finite, hif not asked).
inline void split_bf16_ps(__m512 x, __m256i& hi, __m256i& lo, __m256i* hif) {
  hi = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
  __m512 d = _mm512_sub_ps(x, hf);
  if (hif != nullptr) {
    const __mmask16 finite = static_cast<__mmask16>(~_mm512_fpclass_ps_mask(hf, 0x99));  // not NaN / inf
    d = _mm512_maskz_mov_ps(finite, d);
    *hif = _mm256_maskz_mov_epi16(finite, hi);
  }
  lo = (__m256i)_mm512_cvtneps_pbh(d);
}
#endif

// rows x cols float16 values (element (r, c) at src[r * sn + c * sd]) split into bfloat16 bits:
// hi[r * ld + c], lo[r * ld + c], hif[r * ld + c].
inline void split_half_rows(const at::Half* src, int64_t sn, int64_t sd, int64_t rows, int64_t cols, uint16_t* hi,
                            uint16_t* lo, uint16_t* hif, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const at::Half* in = src + r * sn;
    uint16_t* h = hi + r * ld;
    uint16_t* l = lo + r * ld;
    uint16_t* hf = hif + r * ld;
    int64_t c = 0;
#if defined(__AVX512BF16__)
    if (sd == 1) {
      for (; c < cols; c += 16) {
        const __mmask16 k = static_cast<__mmask16>(cols - c >= 16 ? 0xffffu : (1u << (cols - c)) - 1u);
        const __m512 x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, in + c));
        __m256i vh, vl, vf;
        split_bf16_ps(x, vh, vl, &vf);
        _mm256_mask_storeu_epi16(h + c, k, vh);
        _mm256_mask_storeu_epi16(l + c, k, vl);
        _mm256_mask_storeu_epi16(hf + c, k, vf);
      }
    }
#endif
    for (; c < cols; ++c) split_bf16_scalar(static_cast<float>(in[c * sd]), h[c], l[c], hf[c]);
  }
}

// One row of P split for the float16 split's O += P V (softmax.cpp): p[j] = exp2(c s[j] - mx) for
// j in [lo, hi) -- exp2_ps_p16's polynomial, as exp2_scaled_sum_bits16 -- and 0 for j in [0, lo)
// and [hi, n_pad), written as split_f32_rows writes a row -- pdup[2 j] = pdup[2 j + 1] = bf16 hi of
// p[j] (hif = hi: p is finite), to multiply V's pairs (hi, lo) of key j, and plo[j] = its lo, to
// multiply V's hif -- without the float32 p going back to memory.  Returns the float32 sum of the
// p[j].  s[lo, hi) may be overwritten.
inline float exp2_scaled_sum_split(float* s, int64_t lo, int64_t hi, float c, float mx, uint16_t* pdup,
                                   uint16_t* plo, int64_t n_pad) {
  int64_t j = lo;
  float total = 0.f;
  std::memset(pdup, 0, static_cast<size_t>(2 * lo) * sizeof(uint16_t));
  std::memset(plo, 0, static_cast<size_t>(lo) * sizeof(uint16_t));
#if defined(__AVX512BF16__)
  {
    const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (; j < hi; j += 16) {
      const __mmask16 k = static_cast<__mmask16>(hi - j >= 16 ? 0xffffu : (1u << (hi - j)) - 1u);
      const __m512 p = _mm512_maskz_mov_ps(k, exp2_ps_p16(_mm512_fmsub_ps(cv, _mm512_maskz_loadu_ps(k, s + j), mv)));
      sum = _mm512_add_ps(sum, p);
      __m256i ph, pl;
      split_bf16_ps(p, ph, pl, nullptr);
      const __m512i w = _mm512_cvtepu16_epi32(ph);  // hi as 32-bit words, then doubled: (hi, hi)
      _mm512_mask_storeu_epi32(pdup + 2 * j, k, _mm512_or_si512(w, _mm512_slli_epi32(w, 16)));
      _mm256_mask_storeu_epi16(plo + j, k, pl);
    }
    j = std::max(j, hi);
    total = _mm512_reduce_add_ps(sum);
  }
#else
  if (hi > lo) total = exp2_scaled_sum(s + lo, hi - lo, c, mx);
  for (; j < hi; ++j) {
    uint16_t h, l, f;
    split_bf16_scalar(s[j], h, l, f);
    pdup[2 * j] = pdup[2 * j + 1] = h;
    plo[j] = l;
  }
#endif
  j = std::max(lo, hi);
  if (n_pad > j) {
    std::memset(pdup + 2 * j, 0, static_cast<size_t>(2 * (n_pad - j)) * sizeof(uint16_t));
    std::memset(plo + j, 0, static_cast<size_t>(n_pad - j) * sizeof(uint16_t));
  }
  return total;
}

// rows x cols float16 values (element (r, c) at src[r * sn + c * sd]) as the A operand of a
// float16 x float16 split product: dst[r * ldd + seg * cols2 + c] for the segments hi, hif, lo,
// lo (each cols2 >= cols wide; the columns [cols, cols2) of each must be zero already).  scratch:
// 3 rows * cols.
inline void pack_split_rows4(const at::Half* src, int64_t sn, int64_t sd, int64_t rows, int64_t cols, int64_t cols2,
                             uint16_t* scratch, uint16_t* dst, int64_t ldd) {
  uint16_t *hi = scratch, *lo = hi + rows * cols, *hif = lo + rows * cols;
  split_half_rows(src, sn, sd, rows, cols, hi, lo, hif, cols);
  const uint16_t* segs[4] = {hi, hif, lo, lo};
  for (int64_t seg = 0; seg < 4; ++seg)
    pack_rows16(reinterpret_cast<const at::BFloat16*>(segs[seg]), cols, 1, rows, cols, dst + seg * cols2, ldd, false,
                rows);
}

// kn rows x D float16 values (element (j, d) at src[j * sn + d * sd]) as the B operand of a
// float16 x float16 split product, transposed in VNNI pairs of d: depth 4 D2, the segments hi,
// lo, hif, lo of D2 rows each (b16_index(seg * D2 + d, j, ldd, true); the rows [D, D2) of each
// must be zero already).  scratch: 3 kn * D.
inline void pack_split_transposed4(const at::Half* src, int64_t sn, int64_t sd, int64_t kn, int64_t D, int64_t D2,
                                   uint16_t* scratch, uint16_t* dst, int64_t ldd) {
  uint16_t *hi = scratch, *lo = hi + kn * D, *hif = lo + kn * D;
  split_half_rows(src, sn, sd, kn, D, hi, lo, hif, D);
  const size_t seg_bytes = static_cast<size_t>(D2 * ldd) * sizeof(uint16_t);
  for (int64_t seg = 0; seg < 2; ++seg)
    pack_transposed_pairs(reinterpret_cast<const at::BFloat16*>(seg == 0 ? hi : lo), D, 1, kn, D, dst + seg * D2 * ldd,
                          ldd, true);
  // The fourth segment is the second's copy, and the third the first's unless a value is not
  // finite: copies of the packed segments rather than two more transposes (the packing is most
  // of a call with few query rows per kv head: B=1 H=8 N=32 M=8192 D=64, 2 threads, Xeon with AMX).
  std::memcpy(dst + 3 * D2 * ldd, dst + D2 * ldd, seg_bytes);
  if (std::memcmp(hi, hif, static_cast<size_t>(kn * D) * sizeof(uint16_t)) == 0)
    std::memcpy(dst + 2 * D2 * ldd, dst, seg_bytes);
  else
    pack_transposed_pairs(reinterpret_cast<const at::BFloat16*>(hif), D, 1, kn, D, dst + 2 * D2 * ldd, ldd, true);
}

// rows x cols float16 values (element (r, c) at src[r * sn + c * sd]) as the B operands of a
// float32 x float16 split product over the rows: pairs[b16_index(2 r + e, c, ldd, true)] = (hi,
// lo)[e] of row r (depth 2 rows_pad), and hif[b16_index(r, c, ldd, true)] = hif of row r (depth
// rows_pad, even); rows [rows, rows_pad) zero.  scratch: 4 rows * cols.
inline void pack_split_pairs(const at::Half* src, int64_t sn, int64_t sd, int64_t rows, int64_t rows_pad,
                             int64_t cols, uint16_t* scratch, uint16_t* pairs, uint16_t* hif, int64_t ldd) {
  uint16_t *hl = scratch, *hf = hl + 2 * rows * cols;  // hi / lo rows alternating; hif rows 2 cols apart
  split_half_rows(src, sn, sd, rows, cols, hl, hl + cols, hf, 2 * cols);
  pack_rows16(reinterpret_cast<const at::BFloat16*>(hl), cols, 1, 2 * rows, cols, pairs, ldd, true, 2 * rows_pad);
  pack_rows16(reinterpret_cast<const at::BFloat16*>(hf), 2 * cols, 1, rows, cols, hif, ldd, true, rows_pad);
}

// rows x cols float32 values (x[r * lds + c]) as the A operands of a float32 x float16 split
// product: dup[r * ld_dup + 2 c + e] = (hi, hif)[e] and lo[r * ld_lo + c] of x[r][c], zeros for c
// in [cols, cols_pad).
inline void split_f32_rows(const float* x, int64_t lds, int64_t rows, int64_t cols, int64_t cols_pad, uint16_t* dup,
                           int64_t ld_dup, uint16_t* lo, int64_t ld_lo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * lds;
    uint16_t* d = dup + r * ld_dup;
    uint16_t* l = lo + r * ld_lo;
    int64_t c = 0;
#if defined(__AVX512BF16__)
    for (; c < cols; c += 16) {
      const __mmask16 k = static_cast<__mmask16>(cols - c >= 16 ? 0xffffu : (1u << (cols - c)) - 1u);
      __m256i vh, vl, vf;
      split_bf16_ps(_mm512_maskz_loadu_ps(k, in + c), vh, vl, &vf);
      _mm512_mask_storeu_epi32(d + 2 * c, k,
                               _mm512_or_si512(_mm512_cvtepu16_epi32(vh), _mm512_slli_epi32(_mm512_cvtepu16_epi32(vf), 16)));
      _mm256_mask_storeu_epi16(l + c, k, vl);
    }
    c = cols;
#endif
    for (; c < cols; ++c) split_bf16_scalar(in[c], d[2 * c], l[c], d[2 * c + 1]);
    if (cols_pad > cols) {
      std::memset(d + 2 * cols, 0, static_cast<size_t>(2 * (cols_pad - cols)) * sizeof(uint16_t));
      std::memset(l + cols, 0, static_cast<size_t>(cols_pad - cols) * sizeof(uint16_t));
    }
  }
}

}  // namespace attnkit

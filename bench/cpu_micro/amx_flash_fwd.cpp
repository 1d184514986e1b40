// A prototype (not built, not tested by the suite): the bfloat16 flash forward on attnkit's own AMX
// tiles, to measure on a Xeon with AMX whether owning the tiles and interleaving the softmax with
// the AMX products beats the brgemm path (session 21, bench/RESULTS.md).  One thread, D = Dv = 64,
// no mask or option, N and M multiples of 64, float32 output.  Blocks of 16 query rows: O (tiles
// 0-3) and Q (tiles 4-5) stay in the tiles for the whole key loop; tile 6 is S's C tile or P's A
// tile, tile 7 K's or V's B tile; 64 keys per step.  The softmax rescales O only when a row's max
// grows by more than THR (8, in log2 units; FlashAttention-4's trick), storing and reloading
// the O tiles then.  Modes (the `mode` argument, + 10: THR = 0, + 100: softmax variant 1):
//   0  S(j+1) and O += P(j-1) V(j-1) issued after / before softmax(j) (the out-of-order core
//      overlaps what it can);   1  the same AMX units interleaved into softmax(j)'s rows;
//   3  the AMX products only;   4  the softmax only.
// Softmax variant 1: each row's max and sum by horizontal reductions per step; variant 2 (the
// default): the max reduced only when some score passes m + THR, the sum kept as a vector.
//   python bench/cpu_micro/amx_flash_fwd.py [threads] [N] [rounds]
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include "../../csrc/cpu/flash_tiles.h"
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
struct TileCfg { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static TileCfg cfg;
// The exponential of attnkit's 16-bit P (degree 4, vreduceps): the forward's own.
static inline __m512 exp2p(__m512 x) { return attnkit::exp2_ps_p16(x); }
constexpr int D = 64, KB = 64, BQ = 16;
static int MODE = 1;
static float THR = 8.0f;
// state of one 16-row block
struct Blk {
  const uint16_t* Kp; const uint16_t* Vp; int M;
  alignas(64) float S[2][BQ * KB];
  alignas(64) uint16_t P[2][BQ * KB];
  float m[BQ], l[BQ];
  alignas(64) float lv[BQ * 16];
};
// AMX step machine: S for key block js into S[buf], PV for key block jp from P[pbuf].
// steps 0..15 : S part (4 col tiles x (zero, 2x(load,tdp), store) grouped)
// we issue in "units": S unit u (0..3): zero6; load7 K(c0,u); tdp6,4,7; load7 K(c1,u); tdp6,5,7; store6.
// PV unit u (0..1): load6 P(kk=u); 4 x (load7 V(u,ct); tdp ct,6,7).
static inline void s_unit(Blk& b, int js, int buf, int u) {
  const uint16_t* kb = b.Kp + (size_t(js) * KB + u * 16) * 2;
  _tile_zero(6);
  _tile_loadd(7, kb, b.M * 4);
  _tile_dpbf16ps(6, 4, 7);
  _tile_loadd(7, kb + size_t(16) * b.M * 2, b.M * 4);
  _tile_dpbf16ps(6, 5, 7);
  _tile_stored(6, b.S[buf] + u * 16, KB * 4);
}
static inline void pv_unit(Blk& b, int jp, int pbuf, int u) {
  _tile_loadd(6, b.P[pbuf] + u * 32, KB * 2);
  const uint16_t* vb = b.Vp + (size_t(jp) * KB / 2 + u * 16) * D * 2;
  _tile_loadd(7, vb, D * 4); _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(7, vb + 32, D * 4); _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(7, vb + 64, D * 4); _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(7, vb + 96, D * 4); _tile_dpbf16ps(3, 6, 7);
}
static bool V1 = false;
// variant 1: exact row max and scalar sum by horizontal reductions every block
static inline bool soft_row_v1(Blk& b, int buf, int r, float c, float* alpha) {
  const float* s = b.S[buf] + r * KB;
  __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16), s2 = _mm512_load_ps(s + 32), s3 = _mm512_load_ps(s + 48);
  const float mx = c * _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s0, s1), _mm512_max_ps(s2, s3)));
  bool resc = false;
  if (mx > b.m[r] + THR) { alpha[r] = std::exp2(b.m[r] - mx); b.l[r] *= alpha[r]; b.m[r] = mx; resc = true; }
  const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(b.m[r]);
  __m512 p0 = exp2p(_mm512_fmsub_ps(cv, s0, mv)), p1 = exp2p(_mm512_fmsub_ps(cv, s1, mv));
  __m512 p2 = exp2p(_mm512_fmsub_ps(cv, s2, mv)), p3 = exp2p(_mm512_fmsub_ps(cv, s3, mv));
  b.l[r] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3)));
  uint16_t* pr = b.P[buf] + r * KB;
  _mm512_store_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  _mm512_store_si512(pr + 32, (__m512i)_mm512_cvtne2ps_pbh(p3, p2));
  return resc;
}
// softmax of one row r of S[buf] -> P[buf]; returns whether a rescale is needed (sets alpha)
static inline bool soft_row_v2(Blk& b, int buf, int r, float c, float* alpha) {
  const float* s = b.S[buf] + r * KB;
  __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16), s2 = _mm512_load_ps(s + 32), s3 = _mm512_load_ps(s + 48);
  const __m512 cv = _mm512_set1_ps(c);
  const __m512 mx4 = _mm512_mul_ps(cv, _mm512_max_ps(_mm512_max_ps(s0, s1), _mm512_max_ps(s2, s3)));
  bool resc = false;
  __m512 lv = _mm512_load_ps(b.lv + r * 16);
  if (_mm512_cmp_ps_mask(mx4, _mm512_set1_ps(b.m[r] + THR), _CMP_GT_OQ)) {
    const float mx = _mm512_reduce_max_ps(mx4);
    alpha[r] = std::exp2(b.m[r] - mx); lv = _mm512_mul_ps(lv, _mm512_set1_ps(alpha[r])); b.m[r] = mx; resc = true;
  }
  const __m512 mv = _mm512_set1_ps(b.m[r]);
  __m512 p0 = exp2p(_mm512_fmsub_ps(cv, s0, mv)), p1 = exp2p(_mm512_fmsub_ps(cv, s1, mv));
  __m512 p2 = exp2p(_mm512_fmsub_ps(cv, s2, mv)), p3 = exp2p(_mm512_fmsub_ps(cv, s3, mv));
  _mm512_store_ps(b.lv + r * 16, _mm512_add_ps(lv, _mm512_add_ps(_mm512_add_ps(p0, p1), _mm512_add_ps(p2, p3))));
  uint16_t* pr = b.P[buf] + r * KB;
  _mm512_store_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  _mm512_store_si512(pr + 32, (__m512i)_mm512_cvtne2ps_pbh(p3, p2));
  return resc;
}
static inline bool soft_row(Blk& b, int buf, int r, float c, float* alpha) {
  return V1 ? soft_row_v1(b, buf, r, c, alpha) : soft_row_v2(b, buf, r, c, alpha);
}
static void rescale_o(float* Ot, const float* alpha, const bool* need) {
  _tile_stored(0, Ot, D * 4); _tile_stored(1, Ot + 16, D * 4); _tile_stored(2, Ot + 32, D * 4); _tile_stored(3, Ot + 48, D * 4);
  for (int r = 0; r < BQ; ++r) if (need[r]) for (int d = 0; d < D; ++d) Ot[r * D + d] *= alpha[r];
  _tile_loadd(0, Ot, D * 4); _tile_loadd(1, Ot + 16, D * 4); _tile_loadd(2, Ot + 32, D * 4); _tile_loadd(3, Ot + 48, D * 4);
}
// one 16-row block: q [16][D] bf16, out [16][D] float
static void block(Blk& b, const uint16_t* q, float* out, float c) {
  const int nj = b.M / KB;
  alignas(64) float Ot[BQ * D];
  float alpha[BQ]; bool need[BQ];
  for (int r = 0; r < BQ; ++r) { b.m[r] = -INFINITY; b.l[r] = 0; _mm512_store_ps(b.lv + r * 16, _mm512_setzero_ps()); }
  _tile_loadd(4, q, D * 2); _tile_loadd(5, q + 32, D * 2);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  // prologue: S_0
  for (int u = 0; u < 4; ++u) s_unit(b, 0, 0, u);
  for (int j = 0; j < nj; ++j) {
    const int buf = j & 1;
    bool any = false;
    if (MODE == 3) {
      if (j > 0) { for (int u = 0; u < 2; ++u) pv_unit(b, j - 1, buf ^ 1, u); }
      if (j + 1 < nj) for (int u = 0; u < 4; ++u) s_unit(b, j + 1, buf ^ 1, u);
    } else if (MODE == 4) {
      for (int r = 0; r < BQ; ++r) { need[r] = soft_row(b, buf, r, c, alpha); any |= need[r]; }
    } else if (MODE == 0) {
      if (j > 0) { for (int u = 0; u < 2; ++u) pv_unit(b, j - 1, buf ^ 1, u); }
      for (int r = 0; r < BQ; ++r) { need[r] = soft_row(b, buf, r, c, alpha); any |= need[r]; }
      if (j + 1 < nj) for (int u = 0; u < 4; ++u) s_unit(b, j + 1, buf ^ 1, u);
    } else {
      // 16 rows; 6 AMX units: PV(j-1) 2 units first (they read P[buf^1]), then S(j+1) 4 units
      // (they write S[buf^1] -- P[buf^1] and S[buf^1] are different arrays).
      for (int r = 0; r < BQ; ++r) {
        need[r] = soft_row(b, buf, r, c, alpha); any |= need[r];
        if ((r & 1) == 0) {
          const int unit = r >> 1;  // 0..7
          if (unit < 2) { if (j > 0) pv_unit(b, j - 1, buf ^ 1, unit); }
          else if (unit < 6) { if (j + 1 < nj) s_unit(b, j + 1, buf ^ 1, unit - 2); }
        }
      }
    }
    // O holds sum over blocks < j with old maxima; PV(j-1) done. Rescale rows whose max moved.
    if (any) rescale_o(Ot, alpha, need);
  }
  pv_unit(b, nj - 1, (nj - 1) & 1, 0); pv_unit(b, nj - 1, (nj - 1) & 1, 1);
  _tile_stored(0, Ot, D * 4); _tile_stored(1, Ot + 16, D * 4); _tile_stored(2, Ot + 32, D * 4); _tile_stored(3, Ot + 48, D * 4);
  for (int r = 0; r < BQ; ++r) for (int d = 0; d < D; ++d) out[r * D + d] = Ot[r * D + d] / (V1 ? b.l[r] : _mm512_reduce_add_ps(_mm512_load_ps(b.lv + r * 16)));
}

static bool inited = false;
torch::Tensor proto_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t mode) {
  if (!inited) { syscall(SYS_arch_prctl, 0x1023, 18); inited = true; }
  MODE = mode % 10; THR = (mode / 10) % 10 == 1 ? 0.0f : 8.0f; V1 = mode >= 100;
  memset(&cfg, 0, sizeof cfg); cfg.palette = 1; for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
  at::native::cpublas::brgemm_release(true);
  _tile_loadconfig(&cfg);
  const int H = q.size(0), N = q.size(1), M = k.size(1);
  auto out = torch::empty({H, N, D}, q.options().dtype(torch::kFloat));
  const uint16_t* qd = (const uint16_t*)q.data_ptr(); const uint16_t* kd = (const uint16_t*)k.data_ptr(); const uint16_t* vd = (const uint16_t*)v.data_ptr();
  float* od = out.data_ptr<float>();
  const float c = 0.125f * 1.4426950408889634f;
  static std::vector<uint16_t> Kp, Vp; Kp.resize(size_t(M) * D); Vp.resize(size_t(M) * D);
  static Blk* b = new (std::align_val_t(64)) Blk;
  for (int h = 0; h < H; ++h) {
    const uint16_t* kh = kd + size_t(h) * M * D; const uint16_t* vh = vd + size_t(h) * M * D;
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kh); uint32_t* kp32 = reinterpret_cast<uint32_t*>(Kp.data());
    for (int m0 = 0; m0 < M; m0 += 16) for (int dp = 0; dp < D / 2; ++dp) for (int m = m0; m < m0 + 16; ++m) kp32[dp * size_t(M) + m] = k32[m * (D / 2) + dp];
    for (int m = 0; m < M; m += 2) for (int d = 0; d < D; ++d) { Vp[((m / 2) * size_t(D) + d) * 2] = vh[m * D + d]; Vp[((m / 2) * size_t(D) + d) * 2 + 1] = vh[(m + 1) * D + d]; }
    b->Kp = Kp.data(); b->Vp = Vp.data(); b->M = M;
    for (int i0 = 0; i0 < N; i0 += BQ) block(*b, qd + (size_t(h) * N + i0) * D, od + (size_t(h) * N + i0) * D, c);
  }
  _tile_release();
  return out;
}
TORCH_LIBRARY(amx_flash_fwd, m) { m.def("fwd", &proto_fwd); }

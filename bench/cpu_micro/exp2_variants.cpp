// Variants of the forward's 16-bit exponential pass (exp2 of c s - m, its sum, rounding to bfloat16)
// and of the row max, in ns per 16 scores on one thread, for 16- and 64-row tiles of 256 keys:
// the degree-4 polynomial with vrndscaleps (p4), with vreduceps (reduce), the magic-number
// rounding (magic), degree 3 (p3).  Session 18, RESULTS.md.  Not part of the build or the tests.
//   g++ -O2 -march=sapphirerapids bench/cpu_micro/exp2_variants.cpp -o /tmp/exp2v && /tmp/exp2v
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cmath>
#include <random>
// 2^f on [-1/2, 1/2] by Horner's rule over coefficients from the highest degree down: degree 4 is
// flash_tiles.h's exp2_ps_p16 polynomial (2.9e-6 relative), degree 3 a truncated Taylor one.
constexpr float kP4[] = {0.009582852944731712f, 0.055906426161527634f, 0.24024099111557007f, 0.6931241750717163f, 1.0f};
constexpr float kP3[] = {0.0555041086648215f, 0.2402265069591007f, 0.6931471805599453f, 1.0f};
template <int K>
static inline __m512 horner(__m512 f, const float (&c)[K]) {
  __m512 p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < K; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return p;
}
// Range reductions x = n + f.  V = 0: vrndscaleps, degree 4 (the kernel before session 18);
// 1: the magic-number rounding with the exponent added as an integer; 2: vreduceps, degree 4;
// 3: vrndscaleps, degree 3.  All clamp x at -200 (-127 for 1): 0 for -inf.
template <int V>
static inline __m512 e2(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(V == 1 ? -127.0f : -200.0f), x);
  if constexpr (V == 1) {
    const __m512 magic = _mm512_set1_ps(12582912.0f + 127.0f);  // 1.5 * 2^23 + 127
    const __m512 t = _mm512_add_ps(x, magic);                   // low mantissa bits: n + 127
    const __m512 p = horner(_mm512_sub_ps(x, _mm512_sub_ps(t, magic)), kP4);
    const __m512i e = _mm512_sub_epi32(_mm512_slli_epi32(_mm512_castps_si512(t), 23), _mm512_set1_epi32(127 << 23));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
  } else if constexpr (V == 2) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(horner(f, kP4), _mm512_sub_ps(x, f));
  } else {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    return _mm512_scalef_ps(V == 0 ? horner(f, kP4) : horner(f, kP3), n);
  }
}

template <int V, int U>
__attribute__((noinline)) float expsum(const float* s, int n, float c, float mx, uint16_t* dst) {
  const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(mx);
  __m512 acc[U];
  for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
  for (int j = 0; j + 16 * U <= n; j += 16 * U) {
    __m512 p[U];
    for (int u = 0; u < U; ++u) { p[u] = e2<V>(_mm512_fmsub_ps(cv, _mm512_loadu_ps(s + j + 16 * u), mv)); acc[u] = _mm512_add_ps(acc[u], p[u]); }
    for (int u = 0; u < U; u += 2)
      _mm512_storeu_si512(dst + j + 16 * u, (__m512i)_mm512_cvtne2ps_pbh(p[u + 1], p[u]));
  }
  for (int u = 1; u < U; ++u) acc[0] = _mm512_add_ps(acc[0], acc[u]);
  return _mm512_reduce_add_ps(acc[0]);
}
template <int U>
__attribute__((noinline)) float smax(const float* s, int n, float c) {
  const __m512 cv = _mm512_set1_ps(c);
  __m512 m[U];
  for (int u = 0; u < U; ++u) m[u] = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j + 16 * U <= n; j += 16 * U)
    for (int u = 0; u < U; ++u) m[u] = _mm512_max_ps(m[u], _mm512_mul_ps(cv, _mm512_loadu_ps(s + j + 16 * u)));
  for (int u = 1; u < U; ++u) m[0] = _mm512_max_ps(m[0], m[u]);
  return _mm512_reduce_max_ps(m[0]);
}
using clk = std::chrono::steady_clock;
template <class F> double bench(F f, int reps) {
  double best = 1e30;
  for (int t = 0; t < 7; ++t) {
    auto a = clk::now(); for (int r = 0; r < reps; ++r) f(); auto b = clk::now();
    best = std::min(best, std::chrono::duration<double>(b - a).count() / reps);
  }
  return best;
}
int main() {
  std::mt19937 g(0); std::normal_distribution<float> nd(0, 8);
  for (int rows : {16, 64}) {
    const int K = 256; std::vector<float> S(rows * K); for (auto& x : S) x = nd(g);
    std::vector<uint16_t> P(rows * K); std::vector<float> m(rows);
    volatile float sink = 0;
    double elems = rows * K;
    auto ns = [&](double t) { return t * 1e9 / elems * 16; };  // ns per 16 elements
    printf("rows=%d (S %d KB)\n", rows, rows * K * 4 / 1024);
    printf(" max U1 %.2f ns/16\n", ns(bench([&] { for (int r = 0; r < rows; ++r) m[r] = smax<1>(&S[r * K], K, 0.18f); }, 2000)));
    printf(" max U4 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) m[r] = smax<4>(&S[r * K], K, 0.18f); }, 2000)));
    for (int r = 0; r < rows; ++r) m[r] = smax<4>(&S[r * K], K, 0.18f);
    printf(" exp p4 U2 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) sink = sink + expsum<0, 2>(&S[r * K], K, 0.18f, m[r], &P[r * K]); }, 2000)));
    printf(" exp p4 U4 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) sink = sink + expsum<0, 4>(&S[r * K], K, 0.18f, m[r], &P[r * K]); }, 2000)));
    printf(" exp reduce U2 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) sink = sink + expsum<2, 2>(&S[r * K], K, 0.18f, m[r], &P[r * K]); }, 2000)));
    printf(" exp p3 U2 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) sink = sink + expsum<3, 2>(&S[r * K], K, 0.18f, m[r], &P[r * K]); }, 2000)));
    printf(" exp magic U2 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) sink = sink + expsum<1, 2>(&S[r * K], K, 0.18f, m[r], &P[r * K]); }, 2000)));
    printf(" exp magic U4 %.2f\n", ns(bench([&] { for (int r = 0; r < rows; ++r) sink = sink + expsum<1, 4>(&S[r * K], K, 0.18f, m[r], &P[r * K]); }, 2000)));
  }
  // accuracy of magic vs p4
  double me = 0; for (float x = -30; x <= 0; x += 0.0013f) { float a[16], b[16]; _mm512_storeu_ps(a, e2<1>(_mm512_set1_ps(x))); double r = std::exp2((double)x); me = std::max(me, std::fabs(a[0] - r) / r); }
  printf("magic rel err %.3g; x=-127 -> ", me); float a[16]; _mm512_storeu_ps(a, e2<1>(_mm512_set1_ps(-1000.f))); printf("%g, -inf -> ", a[0]); _mm512_storeu_ps(a, e2<1>(_mm512_set1_ps(-INFINITY))); printf("%g nan -> ", a[0]); _mm512_storeu_ps(a, e2<1>(_mm512_set1_ps(NAN))); printf("%g\n", a[0]);
}

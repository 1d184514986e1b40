// An own AMX bfloat16 micro-kernel (2 x 2 tiles) at the bfloat16 forward's two GEMM shapes, checked
// against a double product, in GF/s on one thread: whether owning the tile configuration beats
// cpublas::brgemm on this CPU (session 18, RESULTS.md).  Not part of the build or the tests.
//   g++ -O2 -march=sapphirerapids bench/cpu_micro/amx_gemm.cpp -o /tmp/amx_gemm && /tmp/amx_gemm
// (The tile configuration is static: a stack copy at -O2 was seen half-written by ldtilecfg.)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>
struct TileCfg { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void cfg_all16() {
  static TileCfg c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  _tile_loadconfig(&c);
}
static uint16_t bf(float x) { uint32_t u; memcpy(&u, &x, 4); return (u + 0x7fff + ((u >> 16) & 1)) >> 16; }
static float fb(uint16_t h) { uint32_t u = uint32_t(h) << 16; float x; memcpy(&x, &u, 4); return x; }
// C[M][ldc] (+)= A[M][K] (lda elements) * B, B VNNI [K/2][N][2] (ldb = N); M, N, K multiples of 32.
// 2 x 2 C tiles (0-3), A tiles 4-5, B tiles 6-7: four loads per four tdpbf16ps.
__attribute__((target("amx-tile,amx-bf16"))) void gemm_amx(int M, int N, int K, const uint16_t* A, int lda, const uint16_t* B, int ldb, float* C, int ldc, bool acc) {
  for (int i = 0; i < M; i += 32)
    for (int j = 0; j < N; j += 32) {
      if (acc) {
        _tile_loadd(0, C + i * ldc + j, ldc * 4); _tile_loadd(1, C + i * ldc + j + 16, ldc * 4);
        _tile_loadd(2, C + (i + 16) * ldc + j, ldc * 4); _tile_loadd(3, C + (i + 16) * ldc + j + 16, ldc * 4);
      } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      }
      for (int k = 0; k < K; k += 32) {
        _tile_loadd(4, A + i * lda + k, lda * 2);
        _tile_loadd(5, A + (i + 16) * lda + k, lda * 2);
        _tile_loadd(6, B + (k / 2) * ldb * 2 + j * 2, ldb * 4);
        _tile_loadd(7, B + (k / 2) * ldb * 2 + (j + 16) * 2, ldb * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, C + i * ldc + j, ldc * 4); _tile_stored(1, C + i * ldc + j + 16, ldc * 4);
      _tile_stored(2, C + (i + 16) * ldc + j, ldc * 4); _tile_stored(3, C + (i + 16) * ldc + j + 16, ldc * 4);
    }
}
using clk = std::chrono::steady_clock;
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX perm\n"); return 1; }
  cfg_all16();
  struct S { int M, N, K; bool acc; } shapes[] = {{64, 256, 64, false}, {64, 64, 256, true}, {64, 256, 128, false}, {64, 128, 256, true}, {32, 256, 64, false}, {64,64,512,true}};
  for (auto sh : shapes) {
    int M = sh.M, N = sh.N, K = sh.K;
    std::vector<uint16_t> A(M * K), B(K * N); std::vector<float> C(M * N), R(M * N);
    for (int i = 0; i < M * K; ++i) A[i] = bf(std::sin(i * 0.37f));
    for (int i = 0; i < K * N; ++i) B[i] = bf(std::cos(i * 0.11f));
    // check: B element (k, n) at ((k/2)*N + n)*2 + k%2
    for (int i = 0; i < M; ++i) for (int n = 0; n < N; ++n) { double s = 0; for (int k = 0; k < K; ++k) s += fb(A[i * K + k]) * fb(B[((k / 2) * N + n) * 2 + k % 2]); R[i * N + n] = s; }
    std::fill(C.begin(), C.end(), 0.f);
    gemm_amx(M, N, K, A.data(), K, B.data(), N, C.data(), N, sh.acc);
    double err = 0; for (int i = 0; i < M * N; ++i) err = std::max(err, (double)std::fabs(C[i] - R[i]));
    double best = 1e30; int reps = 4000;
    for (int t = 0; t < 7; ++t) {
      auto a = clk::now();
      for (int r = 0; r < reps; ++r) { gemm_amx(M, N, K, A.data(), K, B.data(), N, C.data(), N, sh.acc); }
      best = std::min(best, std::chrono::duration<double>(clk::now() - a).count());
    }
    printf("M=%d N=%d K=%d acc=%d: %.0f GF/s (%.2f us/call) err %.2g\n", M, N, K, sh.acc, 2.0 * M * N * K * reps / best / 1e9, best / reps * 1e6, err);
  }
  _tile_release();
}

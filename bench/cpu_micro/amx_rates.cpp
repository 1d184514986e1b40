// The rates of AMX's instructions on this CPU, one thread: tdpbf16ps on resident tiles, with two
// tile loads per four, tilestored, tileloadd from L1 (session 18, RESULTS.md: a KVM Xeon ran them
// 2-5x slower than the paper rates).  Not part of the build or the tests.
//   g++ -O2 -march=sapphirerapids bench/cpu_micro/amx_rates.cpp -o /tmp/amx_rates && /tmp/amx_rates
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <vector>
struct TileCfg { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static TileCfg c;
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  memset(&c, 0, sizeof c); c.palette = 1; for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; }
  _tile_loadconfig(&c);
  std::vector<uint16_t> buf(64 * 1024, 0x3f80); std::vector<float> out(16 * 16 * 4);
  _tile_loadd(4, buf.data(), 64); _tile_loadd(5, buf.data() + 512, 64); _tile_loadd(6, buf.data() + 1024, 64); _tile_loadd(7, buf.data() + 1536, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int it = 200000;
  for (int rep = 0; rep < 3; ++rep) {
  auto a = std::chrono::steady_clock::now();
  for (int i = 0; i < it; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  printf("TDP only: %.1f ns per TDP (%.0f GF/s)\n", t / it / 4 * 1e9, 2.0 * 16 * 16 * 32 * it * 4 / t / 1e9);
  a = std::chrono::steady_clock::now();
  for (int i = 0; i < it; ++i) { _tile_loadd(4, buf.data() + (i & 15) * 1024, 64); _tile_loadd(6, buf.data() + (i & 15) * 1024 + 512, 64); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
  t = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  printf("2 loads + 4 TDP: %.1f ns per TDP\n", t / it / 4 * 1e9);
  a = std::chrono::steady_clock::now();
  for (int i = 0; i < it; ++i) { _tile_stored(0, out.data(), 64); }
  t = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  printf("store: %.1f ns per tile store\n", t / it * 1e9);
  a = std::chrono::steady_clock::now();
  for (int i = 0; i < it; ++i) { _tile_loadd(4, buf.data() + (i & 15) * 1024, 64); }
  t = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  printf("load: %.1f ns per tile load (L1)\n", t / it * 1e9);
  }
  _tile_release();
}

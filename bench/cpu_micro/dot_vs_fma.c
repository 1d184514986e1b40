/* The issue rates of vfmadd231ps zmm and vdpbf16ps zmm on this core: twelve independent
 * accumulator chains each (more than the latency times the ports), 50M iterations.  Behind
 * ATTNKIT_CPU_BF16's auto choice (csrc/cpu/gemm_path.h, session 26).  Not built by setup.py.
 *
 *     gcc -O2 -march=native bench/cpu_micro/dot_vs_fma.c -o /tmp/dot_vs_fma && /tmp/dot_vs_fma
 *
 * Prints ns per instruction and GFLOP/s per core (an FMA: 16 multiply-adds; a vdpbf16ps: 32).
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

int main(void) {
  const long iters = 50000000;
#define DECLARE(i) __m512 a##i = _mm512_set1_ps(i * 1e-9f);
  CHAINS(DECLARE)
  __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.9999999f);
  __m512bh xb = (__m512bh)_mm512_set1_epi16(0x3f80), yb = (__m512bh)_mm512_set1_epi16(0x3f80);
  /* keep the operands in registers, opaque to the compiler */
  __asm__ volatile("" : "+v"(x), "+v"(y), "+v"(xb), "+v"(yb));
  float sink = 0;
#define SUM(i) sink += _mm512_reduce_add_ps(a##i);

  double t = now();
  for (long it = 0; it < iters; ++it) {
#define FMA(i) a##i = _mm512_fmadd_ps(x, a##i, y);
    CHAINS(FMA)
  }
  double dt = now() - t;
  CHAINS(SUM)
  printf("vfmadd231ps zmm: %.3f ns/instr, %.1f GFLOP/s per core\n", dt / (iters * 12.0) * 1e9,
         iters * 12.0 * 32 / dt / 1e9);

  t = now();
  for (long it = 0; it < iters; ++it) {
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, xb, yb);
    CHAINS(DOT)
  }
  dt = now() - t;
  CHAINS(SUM)
  printf("vdpbf16ps zmm:   %.3f ns/instr, %.1f GFLOP/s per core\n", dt / (iters * 12.0) * 1e9,
         iters * 12.0 * 64 / dt / 1e9);
  printf("(checksum %g)\n", sink);
  return 0;
}

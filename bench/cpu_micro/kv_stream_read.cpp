// The read ceiling of the CPU decoding kernel: K and V of `pairs` (b, kv head) pairs, 4096 keys
// x 128 bfloat16 each, read in the kernel's order (per pair, tiles of T keys: the K rows, then
// the V rows) and only widened to float32 and summed -- no products, no softmax.  With 512 pairs
// (1 GiB) the data comes from DRAM.  Behind bench/RESULTS.md session 27's "ceiling" of the
// bfloat16 decode.  Not built by setup.py.
//
//     g++ -O2 -march=native -fopenmp bench/cpu_micro/kv_stream_read.cpp -o /tmp/kv_read
//     OMP_NUM_THREADS=2 /tmp/kv_read 0 64 512     # prefetch-ahead tiles (0: none), T, pairs
//
// Prints GB/s (K and V bytes over the best of 5 passes) and ns per key and pair per thread.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s <prefetch tiles ahead> <tile keys> <pairs>\n", argv[0]);
    return 1;
  }
  const int ahead = std::atoi(argv[1]);
  const long T = std::atol(argv[2]), pairs = std::atol(argv[3]);
  const long M = 4096, row = 128;  // keys a pair, bfloat16 elements a row
  std::vector<uint16_t> K(pairs * M * row, 0x3f80), V(pairs * M * row, 0x3f80);
  double best = 1e30, total = 0;
  for (int pass = 0; pass < 5; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    float sum = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : sum)
    for (long p = 0; p < pairs; ++p) {
      __m512 a[8];
      for (auto& x : a) x = _mm512_setzero_ps();
      for (long k0 = 0; k0 < M; k0 += T) {
        for (int half = 0; half < 2; ++half) {
          const uint16_t* base = (half ? V.data() : K.data()) + (p * M + k0) * row;
          for (long j = 0; j < T; ++j) {
            // Optionally K and V of the tile `ahead` tiles on into L2, 16 rows at a time.
            if (ahead && half == 0 && (j & 15) == 0 && k0 + ahead * T < M)
              for (long jj = 0; jj < 16; ++jj)
                for (int x = 0; x < 256; x += 64) {
                  _mm_prefetch(reinterpret_cast<const char*>(K.data() + (p * M + k0 + ahead * T + j + jj) * row) + x,
                               _MM_HINT_T1);
                  _mm_prefetch(reinterpret_cast<const char*>(V.data() + (p * M + k0 + ahead * T + j + jj) * row) + x,
                               _MM_HINT_T1);
                }
            const uint16_t* r = base + j * row;
#pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
              const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * c));
              a[c] = _mm512_add_ps(a[c], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
            }
          }
        }
      }
      for (const auto& x : a) sum += _mm512_reduce_add_ps(x);
    }
    total += sum;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  const double bytes = 2.0 * pairs * M * row * sizeof(uint16_t);
  std::printf("ahead=%d T=%ld pairs=%ld threads=%d: %.1f GB/s, %.1f ns a key and pair a thread (checksum %g)\n",
              ahead, T, pairs, omp_get_max_threads(), bytes / best / 1e9,
              best * 1e9 * omp_get_max_threads() / double(pairs * M), total);
  return 0;
}

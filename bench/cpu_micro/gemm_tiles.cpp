// The float32 flash forward's two tile GEMMs at its shapes (csrc/cpu/softmax.cpp: 64 query rows,
// 256-key tiles, D = 64), one thread, operands in cache: GF/s to read against dot_vs_fma.c's
// FMA peak of a core.  Behind gemm_f32's depth slices (flash_tiles.h, kDepth; session 32).
// Not built by setup.py.
//
//     g++ -O3 -march=native -fno-trapping-math -std=c++17 \
//         $(python -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))") \
//         -Icsrc/cpu bench/cpu_micro/gemm_tiles.cpp -o /tmp/gemm_tiles && /tmp/gemm_tiles
#include "flash_tiles.h"

#include <chrono>
#include <cstdio>
#include <vector>

using namespace attnkit;

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

int main() {
  constexpr int BQ = 64, D = 64, BK = 256;
  std::vector<float> q(BQ * D, 0.01f), kt(D * BK, 0.02f), s(BQ * BK, 0.001f), v(BK * D, 0.03f), o(BQ * D);
  const __mmask16 all = 0xffff;
  const char* names[] = {"S = Q K^T   64 x 256, depth 64 (gemm_f32)",
                         "O += P V    64 x 64, depth 256 (gemm_f32: slices of kDepth)",
                         "O += P V    64 x 64, depth 256 in one pass (panel_f32, no slices)"};
  for (int shape = 0; shape < 3; ++shape) {
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      const int iters = 20000;
      const double t0 = now();
      for (int i = 0; i < iters; ++i) {
        if (shape == 0)
          gemm_f32(BQ, BK, D, q.data(), D, 1, kt.data(), BK, s.data(), BK, false);
        else if (shape == 1)
          gemm_f32(BQ, D, BK, s.data(), BK, 1, v.data(), D, o.data(), D, true);
        else
          panel_f32<4>(BQ, BK, s.data(), BK, 1, v.data(), D, o.data(), D, all, true);
        asm volatile("" : : "r"(s.data()), "r"(o.data()) : "memory");
      }
      best = std::min(best, (now() - t0) / iters);
    }
    std::printf("%-66s %7.3f us  %6.1f GF/s\n", names[shape], best * 1e6, 2.0 * BQ * BK * D / best * 1e-9);
  }
}

// cpublas::brgemm timed from C++ (see brgemm_rates.py).
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include <chrono>
using namespace at::native;
// returns GF/s for repeated brgemm calls; alt: alternate with a second shape
double bench(int64_t M, int64_t N, int64_t K, bool addc, int64_t M2, int64_t N2, int64_t K2, int64_t reps) {
  std::vector<c10::BFloat16> A(M * K + M2 * K2 + 64, c10::BFloat16(0.5f)), B(K * N + K2 * N2 + 64, c10::BFloat16(0.25f));
  std::vector<float> C(M * N + M2 * N2 + 64, 0.f);
  auto run = [&] {
    cpublas::brgemm(M, N, K, K, N, N, addc, A.data(), B.data(), C.data(), true);
    if (M2) cpublas::brgemm(M2, N2, K2, K2, N2, N2, true, A.data(), B.data(), C.data(), true);
  };
  run();
  double best = 1e30;
  for (int t = 0; t < 5; ++t) {
    auto a = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r) run();
    auto b = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(b - a).count());
  }
  cpublas::brgemm_release(true);
  return 2.0 * (M * N * K + M2 * N2 * K2) * reps / best / 1e9;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bench", &bench); }

// The one place attnkit's operator schemas are declared (TORCH_LIBRARY(attnkit, m)).
// Kernels register implementations per dispatch key in their own files:
// csrc/cpu/<family>.cpp (CPU), csrc/cuda/<family>.cu (CUDA).
#include <torch/extension.h>

TORCH_LIBRARY(attnkit, m) {
  // Hopfield energy, fused log-sum-exp.  state [B,H,S,D], stored [B,H,N,D] ->
  // (energy [B,H,S], lse [B,H,S]) where lse = log sum_i exp(beta * x_i . xi) and
  // energy = -lse/beta + 0.5 xi.xi + log(N)/beta + 0.5 M^2, M = max_i |x_i| (per batch, head).
  // Both outputs are float32 (float64 for float64 inputs).
  m.def("hopfield_energy_fwd(Tensor state, Tensor stored, float beta) -> (Tensor, Tensor)");
}

namespace {
bool built_with_cuda() {
#ifdef ATTNKIT_WITH_CUDA
  return true;
#else
  return false;
#endif
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "attnkit native kernels (C++ CPU, and CUDA when built with it)";
  module.def("built_with_cuda", &built_with_cuda, "whether the CUDA kernels were compiled in");
  module.def("openmp_max_threads", []() { return at::get_num_threads(); },
             "threads the CPU kernels use (torch's intra-op pool)");
}

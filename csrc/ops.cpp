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

  // Softmax attention, flash style (csrc/cpu/softmax.cpp, csrc/cuda/softmax.cu).
  // q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,Dv] with H % Hk == 0 (GQA: query head h reads
  // key/value head h / (H/Hk)).  mask: None, or bool (True = attend) / floating (added to the
  // scaled scores) of shape [B,H,N,M], usually a stride-0 broadcast view of a smaller mask.
  // is_causal: key j visible to query i iff j <= i (top-left).  Fully masked rows: out 0, lse -inf.
  // Returns out [B,H,N,Dv] (q's dtype) and lse [B,H,N] (float32; float64 for float64 inputs).
  m.def("softmax_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal) -> (Tensor, Tensor)");
  // Gradients recomputed from lse (no N x M tensor stored): returns (dq, dk, dv) shaped like
  // q, k, v (dk, dv summed over the query heads of each GQA group).
  m.def("softmax_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, float scale, bool is_causal) -> (Tensor, Tensor, Tensor)");
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

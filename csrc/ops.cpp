// The one place attnkit's operator schemas are declared (TORCH_LIBRARY(attnkit, m)).
// Kernels register implementations per dispatch key: csrc/cpu/<family>.cpp (CPU), and
// csrc/checks/<family>.cpp (CUDA: the input check, then the kernels of csrc/cuda/<family>.cu).
// Also the Python module attnkit._C, with the op's input checks bound for the tests (_checks).
// Not <torch/extension.h>: its C++ front end (autograd, nn, optim) is unused here; pybind11 with
// torch's type casters (at::Tensor, std::optional) is torch/csrc/utils/pybind.h.  g++ -std=c++17
// -fsyntax-only of this file, 2-core AMD EPYC (AVX2, loaded): 30.4 -> 11.1 s CPU.
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "checks/checks.h"
#include "cpu/gemm_path.h"
#include "softmax_autograd.h"

TORCH_LIBRARY(attnkit, m) {
  // Hopfield energy, fused log-sum-exp.  state [B,H,S,D], stored [B,H,N,D] ->
  // (energy [B,H,S], lse [B,H,S]) where lse = log sum_i exp(beta * x_i . xi) and
  // energy = -lse/beta + 0.5 xi.xi + log(N)/beta + 0.5 M^2, M = max_i |x_i| (per batch, head).
  // Both outputs are float32 (float64 for float64 inputs).
  m.def("hopfield_energy_fwd(Tensor state, Tensor stored, float beta) -> (Tensor, Tensor)");
  // Hopfield update, all steps fused (csrc/cpu/hopfield.cpp).  state [B,H,S,D], stored [B,H,N,D],
  // values None or [B,H,N,Dv]; R = steps retrievals, the first U = steps (steps-1 with values)
  // xi <- softmax(beta xi X^T) X, then (values) softmax(beta xi X^T) V.  tol: per-row early stop
  // (attnkit.hopfield_update's rule).  Returns, all in the accumulation dtype (float32; float64
  // for float64) except applied: out [B,H,S,Dv or D]; states [steps+1,B,H,S,D], the state before
  // each retrieval and after the last update (with values: entry `steps` is the stored-space
  // update softmax(beta xi X^T) X of the last state when final_state, else zeros); lse [R,B,H,S]
  // of each retrieval (+inf where a row's update was skipped); applied [U,B,H,S] bool, whether
  // update k changed the row (false once tol froze it).
  m.def("hopfield_update_fwd(Tensor state, Tensor stored, Tensor? values, float beta, int steps, float? tol, bool final_state) -> (Tensor, Tensor, Tensor, Tensor)");

  // Softmax attention, flash style (csrc/cpu/softmax.cpp, csrc/cuda/softmax.cu).
  // q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,Dv] with H % Hk == 0 (GQA: query head h reads
  // key/value head h / (H/Hk)).  mask: None, or bool (True = attend) / floating (added to the
  // scaled scores) of shape [B,H,N,M], usually a stride-0 broadcast view of a smaller mask.
  // is_causal: key j visible to query i iff j <= i (top-left).  Fully masked rows: out 0, lse -inf.
  // Score options (issue 28; defaults: none): window_left / window_right: key j visible to query i
  // iff i + M - N - window_left <= j <= i + M - N + window_right (bottom-right aligned; -1 =
  // unbounded), intersected with is_causal and the mask; softcap > 0: s = softcap tanh(s / softcap)
  // on s = scale q.k, first; alibi_slopes: None or float32 [B,H] (a stride-0 view of [H] is fine),
  // s -= slope_bh |i + M - N - j| after the cap, before the masks; sinks: None or float32 [H], one
  // more logit of each row's softmax with no value (Z_i = sum_j exp(s_ij) + exp(sink_h)), folded
  // in before the row is rounded to q's dtype (out and lse are then those with the sink; a row
  // with no visible key: out 0, lse = the sink).  softmax_bwd takes them as they are: it needs no
  // sinks argument (attnkit/score_options.py gives d sinks).  The cuda kernels take the defaults only.
  // Returns out [B,H,N,Dv] (q's dtype) and lse [B,H,N] (float32; float64 for float64 inputs).
  m.def("softmax_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool is_causal, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor, Tensor)");
  // The decoding forward against a paged KV cache, read in place (CPU; issue 28's
  // attention_with_kvcache): q [B,H,N,D] (N <= 16, N * H / Hk <= 64), k_cache / v_cache
  // [num_blocks, Hk, block_size, D / Dv], block_table int64 [B, max_blocks]: key position p < length
  // of batch element b is row p % block_size of block block_table[b, p / block_size].  Every query
  // row sees the `length` keys, limited by the score options as in softmax_fwd (window and ALiBi
  // bottom-right aligned, M = length: window_right = 0 is bottom-right causality).  Returns out
  // [B,H,N,Dv] (q's dtype) and lse [B,H,N] float32; no key seen: out 0, lse -inf.
  m.def("softmax_decode_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int length, float scale, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None) -> (Tensor, Tensor)");
  // Gradients recomputed from lse (no N x M tensor stored): returns (dq, dk, dv) shaped like
  // q, k, v (dk, dv summed over the query heads of each GQA group).  No gradient for alibi_slopes.
  m.def("softmax_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, float scale, bool is_causal, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None) -> (Tensor, Tensor, Tensor)");

  // Linear attention, chunked (csrc/cpu/linear.cpp).  q [B,H,N,D], k [B,H,M,D], v [B,H,M,Dv]
  // (causal: M == N); feature_map "elu" (elu+1) | "relu" | "identity"; optional initial state
  // S0 [B,H,D,Dv], z0 [B,H,D] (both or neither) in the accumulation dtype (float32; float64
  // for float64 inputs).  With S_i = S0 + sum_{j in S_i} phi(k_j) v_j^T, z_i likewise:
  // num_i = phi(q_i) S_i, den_i = phi(q_i) . z_i, out_i = num_i / (den_i + eps) if normalize
  // else scale * num_i.  Returns out [B,H,N,Dv] (q's dtype), den [B,H,N] (raw, without eps),
  // and the final state S [B,H,D,Dv], z [B,H,D] (all keys), all three in the accumulation dtype.
  m.def("linear_fwd(Tensor q, Tensor k, Tensor v, Tensor? S0, Tensor? z0, bool causal, str feature_map, bool normalize, float eps, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
  // Gradients of linear_fwd's four outputs (a missing gradient counts as zero) with respect to
  // q, k, v, S0, z0, chunked (no N x D x Dv tensor).  out/den/S/z: linear_fwd's outputs.
  m.def("linear_bwd(Tensor? grad_out, Tensor? grad_den, Tensor? grad_S, Tensor? grad_z, Tensor q, Tensor k, Tensor v, Tensor out, Tensor den, Tensor S, Tensor z, Tensor? S0, Tensor? z0, bool causal, str feature_map, bool normalize, float eps, float scale) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Sparse attention parts (csrc/cpu/sparse.cpp, csrc/cuda/sparse.cu; Triton twin in
  // kernels/sparse.py).  A "range" part is dense softmax attention on affine views of the rows:
  // q [B,H,Nq,D], k [B,H,Nk,D], v [B,H,Nk,Dv]; view = [G, q_pg, q_pt, k_pg, k_pt]: group g in
  // [0, G) has query rows t in [0, Tq_g), Tq_g = ceil(max(Nq - g*q_pg, 0) / q_pt), at position
  // g*q_pg + t*q_pt, and key rows t' in [0, Tk_g) at g*k_pg + t'*k_pt (Tk_g likewise with Nk).
  // Query t of group g attends the keys t' of its group with lo(t) <= t' <= hi(t), where
  // f(t) = floor((t + a) / d) * m + b for lo = [a, d, m, b], hi likewise (d >= 1, m >= 0: both
  // nondecreasing in t), clipped to [0, Tk_g - 1].  Rows with no key (or in no group): out 0,
  // lse -inf.  Returns out [B,H,Nq,Dv] (q's dtype), lse [B,H,Nq] (natural log of the sum of
  // exp(scale q.k); float32, float64 for float64 inputs).
  // float32_out: a 16-bit call's out in float32 (a part that the pattern's merge rounds once).
  m.def("sparse_range_fwd(Tensor q, Tensor k, Tensor v, int[] view, int[] lo, int[] hi, float scale, "
        "bool float32_out=False) -> (Tensor, Tensor)");
  // Gradients of one range part given the merged lse and delta_i = rowsum(dO_i * O_i) - dlse_i:
  // P_ij = exp(scale q_i.k_j - lse_i), dS_ij = P_ij (dO_i.v_j - delta_i);
  // dq_i = scale sum_j dS_ij k_j, dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dO_i.
  // Returns (dq, dk, dv) like q, k, v (zeros where the part touches nothing).  Deterministic.
  m.def("sparse_range_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor delta, int[] view, int[] lo, int[] hi, float scale) -> (Tensor, Tensor, Tensor)");
  // Block-sparse attention over a layout given as per-row index lists.  q, k [B,H,N,D],
  // v [B,H,N,Dv], N = nb * block; row_ptr int32 [Hl, nb+1] (Hl = 1 or H; offsets into col_idx,
  // absolute), col_idx int32 [nnz]: the key blocks of query block r of layout head h are
  // col_idx[row_ptr[h, r] : row_ptr[h, r+1]] in increasing order.  causal: also j <= i.
  // Returns out [B,H,N,Dv] (q's dtype), lse [B,H,N] (as sparse_range_fwd).
  m.def("block_sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor row_ptr, Tensor col_idx, int block, bool causal, float scale) -> (Tensor, Tensor)");
  // Gradients (delta as in sparse_range_bwd); col_ptr / row_idx: the transposed lists (the query
  // blocks that attend each key block), so dk/dv are accumulated without atomics.
  m.def("block_sparse_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor delta, Tensor row_ptr, Tensor col_idx, Tensor col_ptr, Tensor row_idx, int block, bool causal, float scale) -> (Tensor, Tensor, Tensor)");
}

namespace {
bool built_with_cuda() {
#ifdef ATTNKIT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// The vector path of the CPU kernels (csrc/cpu/flash_tiles.h), fixed when they were compiled
// (-march=native, or ATTNKIT_MARCH): every TU is built with the same flags as this one.  The
// softmax forward's tile GEMMs choose at run time on top of it (cpu_gemm_path below, issue 25).
std::string cpu_kernel_isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512f+avx512bf16";
#elif defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#else
  return "scalar";
#endif
}

// The path the softmax forward's tile GEMMs take in this process for a dtype named as torch
// prints it without "torch." (ATTNKIT_CPU_GEMM and the CPU: csrc/cpu/gemm_path.h).
std::string cpu_gemm_path_name(const std::string& dtype, const std::string& use) {
  ATTNKIT_CHECK(use == "tiles" || use == "softmax" || use == "decode" || use == "ranges" || use == "linear",
                "cpu_gemm_path: use must be 'tiles', 'softmax', 'decode', 'ranges' or 'linear'; got '", use, "'");
  at::ScalarType t = at::kFloat;
  if (dtype == "bfloat16") {
    t = at::kBFloat16;
  } else if (dtype == "float16") {
    t = at::kHalf;
  } else if (dtype == "float64") {
    t = at::kDouble;
  } else {
    ATTNKIT_CHECK(dtype == "float32", "cpu_gemm_path: dtype must be one of bfloat16, float16, float32, float64; got '",
                  dtype, "'");
  }
  const attnkit::GemmUse u = use == "decode"    ? attnkit::GemmUse::kDecode
                            : use == "ranges"  ? attnkit::GemmUse::kSparseRanges
                            : use == "linear"  ? attnkit::GemmUse::kLinear
                            : use == "softmax" ? attnkit::GemmUse::kSoftmax
                                               : attnkit::GemmUse::kTiles;
  return attnkit::gemm_path_name(attnkit::cpu_gemm_path(t, u));
}

// How the softmax kernels' native tiles multiply bfloat16 in this process (ATTNKIT_CPU_BF16:
// csrc/cpu/gemm_path.h): "dot" (AVX512-BF16 dot products) or "float32" (widened); "" on a build
// without AVX512-BF16 (always widened).  use: "softmax" (the flash kernels) or "decode".
std::string cpu_bf16_products(const std::string& use) {
  ATTNKIT_CHECK(use == "softmax" || use == "decode", "cpu_bf16_products: use must be 'softmax' or 'decode'; got '",
                use, "'");
  const bool dot = attnkit::cpu_bf16_dot_products(use == "decode" ? attnkit::GemmUse::kDecode
                                                                   : attnkit::GemmUse::kSoftmax);
#if defined(__AVX512BF16__)
  return dot ? "dot" : "float32";
#else
  (void)dot;
  return "";
#endif
}

namespace checks = attnkit::checks;

// A target for the tests: backend "cpu" or "cuda"; device: the device type the tensors must have
// (default: the backend's; "meta" runs the CUDA branch on meta tensors, without a GPU); cc and
// smem_optin: the made-up CUDA device (default: an H100, compute capability 9.0, 227 KiB); sm90:
// whether the Hopper softmax kernels run there (default no: ATTNKIT_CUDA_SM90 is opt-in).
checks::Target make_target(const std::string& backend, const std::optional<std::string>& device,
                           std::tuple<int, int> cc, int64_t smem_optin, bool sm90) {
  ATTNKIT_CHECK(backend == "cpu" || backend == "cuda", "backend must be 'cpu' or 'cuda'; got '", backend, "'");
  checks::Target t;
  t.backend = backend == "cuda" ? checks::Backend::kCuda : checks::Backend::kCpu;
  t.device_type = device ? c10::Device(*device).type() : (t.cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU);
  t.cc_major = std::get<0>(cc);
  t.cc_minor = std::get<1>(cc);
  t.smem_optin = smem_optin;
  t.sm90_kernels = sm90;
  return t;
}

// The checks take std::string_view; the module passes a Python str through std::string.
void linear_fwd_check(const checks::Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0, bool causal,
                      const std::string& feature_map, bool normalize, double eps, double scale) {
  checks::linear_fwd(t, q, k, v, S0, z0, causal, feature_map, normalize, eps, scale);
}

void linear_bwd_check(const checks::Target& t, const std::optional<at::Tensor>& grad_out,
                      const std::optional<at::Tensor>& grad_den, const std::optional<at::Tensor>& grad_S,
                      const std::optional<at::Tensor>& grad_z, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& out, const at::Tensor& den, const at::Tensor& S,
                      const at::Tensor& z, const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0,
                      bool causal, const std::string& feature_map, bool normalize, double eps, double scale) {
  checks::linear_bwd(t, grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0, causal, feature_map,
                     normalize, eps, scale);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "attnkit native kernels (C++ CPU, and CUDA when built with it)";
  module.def("built_with_cuda", &built_with_cuda, "whether the CUDA kernels were compiled in");
  module.def("cpu_kernel_isa", &cpu_kernel_isa,
             "the vector instructions the CPU kernels were compiled for (compile-time choice)");
  module.def("cpu_bf16_products", &cpu_bf16_products, pybind11::arg("use") = "softmax",
             "How the softmax kernels' native tiles multiply bfloat16 here: 'dot', 'float32', or '' (no AVX512-BF16 build)");
  module.def("cpu_gemm_path", &cpu_gemm_path_name, pybind11::arg("dtype"), pybind11::arg("use") = "tiles",
             "the tile-GEMM path of the CPU kernels for a dtype ('bfloat16', 'float16', 'float32', "
             "'float64') and use ('tiles': the flash tiles of every family; 'decode': the softmax decoding "
             "kernel; 'ranges': the sparse range and fused strided kernels; 'linear': the linear chunk products), chosen at run time: 'native', 'brgemm (AMX, VNNI)', 'brgemm (no VNNI: reference "
             "fallback)' or 'brgemm emulated (VNNI layout, scalar: tests)' "
             "(ATTNKIT_CPU_GEMM=auto|native|brgemm|emulate, read per call)");
  // attnkit::softmax_fwd / softmax_bwd without their score options, called through the dispatcher
  // from C++ (a typed handle): what torch.ops.attnkit.softmax_fwd.default._op does from Python,
  // less its boxing -- the Python arguments parsed against the schema into an IValue stack
  // (createStackForSchema, toIValue per argument) and the outputs unboxed.  Dispatch is the same:
  // the caller's dispatch keys and TLS (below autograd, the fast path's) pick the kernel.  B=H=1
  // N=16 D=64 float32 forward under no_grad, Xeon with AMX, 2 threads, best of 5 x 20000 calls:
  // see pytorch_ext/ops/softmax.py (_FWD_CALL).
  module.def(
      "softmax_fwd_call", &attnkit::call_softmax_fwd,
      "attnkit::softmax_fwd(q, k, v, mask, scale, is_causal) through the dispatcher, typed (no score options)");
  module.def(
      "softmax_bwd_call", &attnkit::call_softmax_bwd,
      "attnkit::softmax_bwd(grad_out, q, k, v, out, lse, mask, scale, is_causal) through the dispatcher, typed");
  attnkit::bind_softmax_autograd(module);
  module.def(
      "softmax_sm90_enabled",
      [](int64_t device) {
#ifdef ATTNKIT_WITH_CUDA
        return attnkit::softmax_sm90_enabled(static_cast<int>(device));
#else
        (void)device;
        return false;
#endif
      },
      "whether the cuda softmax runs its Hopper kernels on CUDA device `device` (ATTNKIT_CUDA_SM90 set, an sm_90a "
      "build, compute capability 9.0): then it takes D = Dv = 256 unmasked");
  module.def("openmp_max_threads", []() { return at::get_num_threads(); },
             "threads the CPU kernels use (torch's intra-op pool)");

  // The input check of each op (csrc/checks/), callable without running the op: the tests run
  // every message of both backends here, the CUDA ones on CPU / meta tensors without a GPU.
  // _checks.<op>(target, <the op's arguments>) returns None or raises RuntimeError.
  namespace py = pybind11;
  py::module_ c = module.def_submodule("_checks", "the ops' input checks, for the tests (csrc/checks/)");
  py::class_<checks::Target>(c, "Target")
      .def(py::init(&make_target), py::arg("backend"), py::kw_only(), py::arg("device") = py::none(),
           py::arg("cc") = std::make_tuple(9, 0), py::arg("smem_optin") = int64_t{227 * 1024},
           py::arg("sm90") = false);
  // softmax: the score options default as in the schema.
  c.def("softmax_fwd", &checks::softmax_fwd, py::arg("target"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("mask"), py::arg("scale"), py::arg("is_causal"), py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(),
        py::arg("sinks") = py::none());
  c.def("softmax_bwd", &checks::softmax_bwd, py::arg("target"), py::arg("grad_out"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("mask"), py::arg("scale"), py::arg("is_causal"),
        py::arg("window_left") = -1, py::arg("window_right") = -1, py::arg("softcap") = 0.0,
        py::arg("alibi_slopes") = py::none());
  c.def("softmax_decode_paged", &checks::softmax_decode_paged, py::arg("target"), py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("length"), py::arg("scale"), py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("softcap") = 0.0, py::arg("alibi_slopes") = py::none(),
        py::arg("sinks") = py::none());
  c.def("linear_fwd", &linear_fwd_check);
  c.def("linear_bwd", &linear_bwd_check);
  c.def("sparse_range_fwd", &checks::sparse_range_fwd);
  c.def("sparse_range_bwd", &checks::sparse_range_bwd);
  c.def("block_sparse_fwd", &checks::block_sparse_fwd);
  c.def("block_sparse_bwd", &checks::block_sparse_bwd);
  c.def("hopfield_update_fwd", &checks::hopfield_update_fwd);
  c.def("hopfield_energy_fwd", &checks::hopfield_energy_fwd);
}

// Input checks of attnkit::linear_fwd / linear_bwd (csrc/checks/checks.h says why they live
// here), and, in a CUDA build, the CUDA registration of both ops: check, then csrc/cuda/linear.cu.
//
// Both backends take float16, bfloat16, float32 and float64 with any D, Dv.  The CUDA kernels
// also need: compute capability >= 8.0 for 16-bit inputs (tensor cores), B and H within the grid,
// N, M < 2^30 and D, Dv < 2^24 (int indexing), and for float64 more shared memory per block than
// some devices have (cuda_limits::linear_smem_bytes).
#include "checks.h"

#include <torch/library.h>

#include <string>
#include <vector>

namespace attnkit {
namespace checks {
namespace {

void check_qkv(const Op& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  ATTNKIT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": expected q [B,H,N,D], k [B,H,M,D], v [B,H,M,Dv]; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  check_device_type(op, "q", q);
  check_same_device(op, "k", k, "q", q);
  check_same_device(op, "v", v, "q", q);
  const auto st = q.scalar_type();
  ATTNKIT_CHECK(k.scalar_type() == st && v.scalar_type() == st, op, ": q, k and v must share a dtype; got ", st, ", ",
              k.scalar_type(), " and ", v.scalar_type());
  ATTNKIT_CHECK(st == at::kHalf || st == at::kBFloat16 || st == at::kFloat || st == at::kDouble, op, ": the ",
              (op.target.cuda() ? "cuda" : "cpu"), " kernels take float16, bfloat16, float32 or float64; got ", st);
  ATTNKIT_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) && q.size(1) == v.size(1) &&
                  q.size(3) == k.size(3) && k.size(2) == v.size(2),
              op, ": q, k, v sizes do not fit: ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  ATTNKIT_CHECK(!causal || q.size(2) == k.size(2), op, ": causal needs N == M; got ", q.size(2), " and ", k.size(2));
  if (!op.target.cuda()) return;
  if (st == at::kHalf || st == at::kBFloat16) check_sm80(op, "float16 / bfloat16 inputs");
  check_grid_bh(op, q.size(0), q.size(1));
  ATTNKIT_CHECK(q.size(2) < (int64_t{1} << 30) && k.size(2) < (int64_t{1} << 30) && q.size(3) < (1 << 24) &&
                  v.size(3) < (1 << 24),
              op, ": sizes too large: need N, M < 2^30 and D, Dv < 2^24; got q ", q.sizes(), ", k ", k.sizes(),
              ", v ", v.sizes());
  const int64_t smem = cuda_limits::linear_smem_bytes(st == at::kDouble);
  ATTNKIT_CHECK(smem <= op.target.smem_optin, op, ": the cuda kernels need ", smem, " bytes of shared memory per ",
              "block for ", st, " inputs; this device (compute capability ", op.target.cc_major, ".",
              op.target.cc_minor, ") allows ", op.target.smem_optin);
}

void check_feature_map(const Op& op, std::string_view name) {
  ATTNKIT_CHECK(name == "elu" || name == "relu" || name == "identity", op, ": unknown feature_map '", std::string(name),
              "'; expected 'elu', 'relu' or 'identity'");
}

// An optional tensor of the accumulation dtype with the given shape, on q's device.
void check_acc(const Op& op, const char* name, const std::optional<at::Tensor>& t, const at::Tensor& q,
               at::IntArrayRef shape) {
  if (!defined(t)) return;
  const auto acc = acc_type(q.scalar_type());
  ATTNKIT_CHECK(t->scalar_type() == acc, op, ": ", name, " must be ", acc, "; got ", t->scalar_type());
  ATTNKIT_CHECK(t->sizes() == shape, op, ": ", name, " must have shape ", shape, "; got ", t->sizes());
  check_same_device(op, name, *t, "q", q);
}

// The initial state: S0 [B,H,D,Dv] and z0 [B,H,D], both or neither.
void check_initial_state(const Op& op, const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0,
                         const at::Tensor& q, const at::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Dv = v.size(3);
  check_acc(op, "S0", S0, q, {B, H, D, Dv});
  check_acc(op, "z0", z0, q, {B, H, D});
  ATTNKIT_CHECK(defined(S0) == defined(z0), op, ": S0 and z0 go together; got ", (defined(S0) ? "S0" : "z0"),
              " without ", (defined(S0) ? "z0" : "S0"));
}

}  // namespace

void linear_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0, bool causal,
                std::string_view feature_map, bool /*normalize*/, double /*eps*/, double /*scale*/) {
  const Op op{"linear_fwd", t};
  check_qkv(op, q, k, v, causal);
  check_feature_map(op, feature_map);
  check_initial_state(op, S0, z0, q, v);
}

void linear_bwd(const Target& t, const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den,
                const std::optional<at::Tensor>& grad_S, const std::optional<at::Tensor>& grad_z, const at::Tensor& q,
                const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den,
                const at::Tensor& S, const at::Tensor& z, const std::optional<at::Tensor>& S0,
                const std::optional<at::Tensor>& z0, bool causal, std::string_view feature_map, bool /*normalize*/,
                double /*eps*/, double /*scale*/) {
  const Op op{"linear_bwd", t};
  check_qkv(op, q, k, v, causal);
  check_feature_map(op, feature_map);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Dv = v.size(3);
  const std::vector<int64_t> out_shape{B, H, N, Dv};
  ATTNKIT_CHECK(out.sizes() == out_shape && out.scalar_type() == q.scalar_type(), op,
              ": out must be the forward's output, [B, H, N, Dv] = ", at::IntArrayRef(out_shape), " of q's dtype ",
              q.scalar_type(), "; got ", out.sizes(), " ", out.scalar_type());
  check_same_device(op, "out", out, "q", q);
  // The forward's other outputs (required: den, S, z) and the gradients of all four.
  check_acc(op, "den", den, q, {B, H, N});
  check_acc(op, "S", S, q, {B, H, D, Dv});
  check_acc(op, "z", z, q, {B, H, D});
  check_initial_state(op, S0, z0, q, v);
  check_acc(op, "grad_den", grad_den, q, {B, H, N});
  check_acc(op, "grad_S", grad_S, q, {B, H, D, Dv});
  check_acc(op, "grad_z", grad_z, q, {B, H, D});
  if (defined(grad_out)) {
    ATTNKIT_CHECK(grad_out->sizes() == out_shape && grad_out->scalar_type() == q.scalar_type(), op,
                ": grad_out must be shaped and typed like out, ", at::IntArrayRef(out_shape), " ", q.scalar_type(),
                "; got ", grad_out->sizes(), " ", grad_out->scalar_type());
    check_same_device(op, "grad_out", *grad_out, "q", q);
  }
}

}  // namespace checks
}  // namespace attnkit

#ifdef ATTNKIT_WITH_CUDA
namespace attnkit {
namespace {

std::string_view as_std(c10::string_view s) { return std::string_view(s.data(), s.size()); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd_cuda_checked(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& S0,
    const std::optional<at::Tensor>& z0, bool causal, c10::string_view feature_map, bool normalize, double eps,
    double scale) {
  checks::linear_fwd(checks::cuda_target(q), q, k, v, S0, z0, causal, as_std(feature_map), normalize, eps, scale);
  auto result = linear_fwd_cuda(q, k, v, S0, z0, causal, as_std(feature_map), normalize, eps, scale);
  checks::raise_cuda_error("linear_fwd");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cuda_checked(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den,
    const std::optional<at::Tensor>& grad_S, const std::optional<at::Tensor>& grad_z, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den, const at::Tensor& S,
    const at::Tensor& z, const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0, bool causal,
    c10::string_view feature_map, bool normalize, double eps, double scale) {
  checks::linear_bwd(checks::cuda_target(q), grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0,
                     causal, as_std(feature_map), normalize, eps, scale);
  auto result = linear_bwd_cuda(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0, causal,
                                as_std(feature_map), normalize, eps, scale);
  checks::raise_cuda_error("linear_bwd");
  return result;
}

}  // namespace
}  // namespace attnkit

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("linear_fwd", &attnkit::linear_fwd_cuda_checked);
  m.impl("linear_bwd", &attnkit::linear_bwd_cuda_checked);
}
#endif  // ATTNKIT_WITH_CUDA

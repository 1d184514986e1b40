// Input checks of attnkit::hopfield_update_fwd / hopfield_energy_fwd (csrc/checks/checks.h says
// why they live here), and, in a CUDA build, the CUDA registration of both ops: check, then
// csrc/cuda/hopfield.cu.
//
// What differs by backend: the CPU kernels take any floating dtype (computing in float32, float64
// for float64) and any D; the CUDA kernels take float16, bfloat16 and float32, D and Dv in
// 1..256, B * H within the grid (gridDim.y) and steps that fit an int.
#include "checks.h"

#include <torch/library.h>

#include <cmath>
#include <limits>

namespace attnkit {
namespace checks {
namespace {

// state [B,H,S,D], stored [B,H,N,D], beta.
void check_common(const Op& op, const at::Tensor& state, const at::Tensor& stored, double beta) {
  ATTNKIT_CHECK(state.dim() == 4 && stored.dim() == 4, op, ": expected state [B,H,S,D] and stored [B,H,N,D]; got ",
              state.dim(), "-D and ", stored.dim(), "-D");
  check_device_type(op, "state", state);
  check_same_device(op, "stored", stored, "state", state);
  const auto st = state.scalar_type();
  ATTNKIT_CHECK(stored.scalar_type() == st, op, ": state and stored must share a dtype; got ", st, " and ",
              stored.scalar_type());
  if (op.target.cuda()) {
    ATTNKIT_CHECK(st == at::kHalf || st == at::kBFloat16 || st == at::kFloat, op,
                ": the cuda kernels take float16, bfloat16 and float32; got ", st);
  } else {
    ATTNKIT_CHECK(at::isFloatingType(st), op, ": expected floating inputs; got ", st);
  }
  ATTNKIT_CHECK(state.size(0) == stored.size(0) && state.size(1) == stored.size(1) && state.size(3) == stored.size(3),
              op, ": state and stored must agree on B, H and D; got ", state.sizes(), " and ", stored.sizes());
  ATTNKIT_CHECK(stored.size(2) > 0, op, ": needs at least one stored pattern (N >= 1)");
  ATTNKIT_CHECK(beta > 0 && std::isfinite(beta), op, ": beta must be finite and > 0; got ", beta);
  if (op.target.cuda()) {
    const int64_t D = state.size(3), BH = state.size(0) * state.size(1);
    ATTNKIT_CHECK(D >= 1 && D <= cuda_limits::kHopfieldMaxD, op, ": head dim D must be in 1..",
                cuda_limits::kHopfieldMaxD, "; got ", D);
    // One block row per (b, h) in gridDim.y.
    ATTNKIT_CHECK(BH <= cuda_limits::kMaxGridYZ, op, ": B * H must be <= ", cuda_limits::kMaxGridYZ,
                " (CUDA grid); got B = ", state.size(0), ", H = ", state.size(1));
  }
}

}  // namespace

void hopfield_update_fwd(const Target& t, const at::Tensor& state, const at::Tensor& stored,
                         const std::optional<at::Tensor>& values, double beta, int64_t steps,
                         std::optional<double> tol, bool /*final_state*/) {
  const Op op{"hopfield_update_fwd", t};
  check_common(op, state, stored, beta);
  ATTNKIT_CHECK(steps >= 1, op, ": steps must be >= 1; got ", steps);
  if (t.cuda()) {
    ATTNKIT_CHECK(steps < std::numeric_limits<int>::max(), op, ": steps must be < 2^31 - 1; got ", steps);
  }
  ATTNKIT_CHECK(!tol.has_value() || (*tol >= 0 && std::isfinite(*tol)), op, ": tol must be finite and >= 0; got ",
              tol.value_or(0));
  if (!defined(values)) return;
  const at::Tensor& v = *values;
  ATTNKIT_CHECK(v.dim() == 4 && v.size(0) == stored.size(0) && v.size(1) == stored.size(1) &&
                  v.size(2) == stored.size(2),
              op, ": values must be [B,H,N,Dv] matching stored ", stored.sizes(), "; got ", v.sizes());
  ATTNKIT_CHECK(v.scalar_type() == stored.scalar_type(), op, ": values must share the dtype of stored (",
              stored.scalar_type(), "); got ", v.scalar_type());
  check_same_device(op, "values", v, "state", state);
  if (t.cuda()) {
    ATTNKIT_CHECK(v.size(3) >= 1 && v.size(3) <= cuda_limits::kHopfieldMaxD, op, ": value dim Dv must be in 1..",
                cuda_limits::kHopfieldMaxD, "; got ", v.size(3));
  }
}

void hopfield_energy_fwd(const Target& t, const at::Tensor& state, const at::Tensor& stored, double beta) {
  check_common(Op{"hopfield_energy_fwd", t}, state, stored, beta);
}

}  // namespace checks
}  // namespace attnkit

#ifdef ATTNKIT_WITH_CUDA
namespace attnkit {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hopfield_update_fwd_cuda_checked(
    const at::Tensor& state, const at::Tensor& stored, const std::optional<at::Tensor>& values, double beta,
    int64_t steps, std::optional<double> tol, bool final_state) {
  checks::hopfield_update_fwd(checks::cuda_target(state), state, stored, values, beta, steps, tol, final_state);
  auto result = hopfield_update_fwd_cuda(state, stored, values, beta, steps, tol, final_state);
  checks::raise_cuda_error("hopfield_update_fwd");
  return result;
}

std::tuple<at::Tensor, at::Tensor> hopfield_energy_fwd_cuda_checked(const at::Tensor& state, const at::Tensor& stored,
                                                                    double beta) {
  checks::hopfield_energy_fwd(checks::cuda_target(state), state, stored, beta);
  auto result = hopfield_energy_fwd_cuda(state, stored, beta);
  checks::raise_cuda_error("hopfield_energy_fwd");
  return result;
}

}  // namespace
}  // namespace attnkit

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("hopfield_update_fwd", &attnkit::hopfield_update_fwd_cuda_checked);
  m.impl("hopfield_energy_fwd", &attnkit::hopfield_energy_fwd_cuda_checked);
}
#endif  // ATTNKIT_WITH_CUDA

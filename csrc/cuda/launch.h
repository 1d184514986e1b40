// The host entry points of the CUDA kernels (defined in csrc/cuda/<family>.cu) and the limits
// of what those kernels take.
//
// Why this header (issue 10): a check failing in a .cu's host code killed the process on the GPU
// image instead of raising (the cause, measured later, was the iostream formatting of TORCH_CHECK
// messages inside attnkit._C: csrc/message.h; it hit the C++ sources too).  The .cu files no
// longer check their inputs nor register themselves with the dispatcher: csrc/checks/<family>.cpp (compiled by the host C++
// compiler) registers the CUDA implementations, runs the op's one input check
// (csrc/checks/checks.h) and only then calls the entry point declared here.
//
// Contract of every entry point: its inputs passed the op's check (it checks nothing itself but
// internal invariants, which cannot fail on checked inputs); it raises nothing for a CUDA error
// either: a failed launch is left in CUDA's last-error slot, and the caller raises it
// (checks::raise_cuda_error) right after the call.
//
// Plain C++ (no CUDA types): included by the g++ files, including the CPU-only build, whose
// checks use the limits below (the tests check the CUDA branch of every check on CPU), and by
// csrc/cuda/host_utils.cuh, so each .cu sees the declarations it defines and static_asserts that
// its kernels' constants match the limits.  Not included by a .cu directly: the CUDA emulator's
// extractor (tests/csrc/cuda_emulator/extract.py) treats a .cu's quoted includes as device headers.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <tuple>

namespace attnkit {
namespace cuda_limits {

// softmax.cu, sparse.cu: float16 / bfloat16 on tensor cores (mma.m16n8k16: compute capability
// >= 8.0), head dims 64 and 128 with Dv == D.
constexpr bool flash_head_dim(int64_t d) { return d == 64 || d == 128; }
// sparse.cu: the smallest block of block-sparse attention (kMinBlock there).
constexpr int64_t kSparseMinBlock = 16;
// hopfield.cu: the largest D and Dv (kMaxD there).  Its largest block (D = Dv = 256, 32 rows,
// values) needs 98816 bytes of shared memory, within the opt-in limit of every device of compute
// capability >= 8.0 (99 KiB on 8.6 / 8.9 / 12.x), so no shared-memory check is needed there.
constexpr int64_t kHopfieldMaxD = 256;
// linear.cu: dynamic shared memory per block, by accumulation type (smem_bytes<A>() there):
// three 64 x 65 tiles plus four 64-vectors of A.  float64 needs more than the 99 KiB of
// compute capability 8.6 / 8.9 / 12.x.
constexpr int64_t linear_smem_bytes(bool fp64) {
  // 3 tile slots and 4 64-vectors (csrc/cuda/linear.cu, smem_bytes): a float32 slot holds two
  // 64 x 72 bfloat16 tiles (a split state), a float64 one a 64 x 65 tile of doubles.
  return fp64 ? (3 * 64 * 65 + 4 * 64) * 8 : (3 * 64 * 72 + 4 * 64) * 4;
}
// softmax_sm90.cu: the head dim that only the Hopper kernels take (kWideD there).
constexpr int64_t kSm90WideHeadDim = 256;
// CUDA grid: gridDim.y and gridDim.z are at most 65535 (B and H, or B * H).
constexpr int64_t kMaxGridYZ = 65535;

}  // namespace cuda_limits

// Each returns what the op of the same name returns (schemas in csrc/ops.cpp).
std::tuple<at::Tensor, at::Tensor> softmax_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask, double scale,
                                                    bool is_causal);
// softmax_sm90.cu: the Hopper kernels where they apply (ATTNKIT_CUDA_SM90 set, an sm_90a build on
// a compute capability 9.0 device, D = Dv = 64, 128 or 256, nonempty, TMA-readable strides); nullopt
// otherwise.  softmax_fwd_cuda / softmax_bwd_cuda try them first for unmasked calls (the
// backward with delta = rowsum(dO ∘ O) computed by softmax.cu's row kernel).
// softmax_sm90_applies: for the forward (dout null) or the backward; softmax_bwd_cuda_sm90 assumes
// it said yes (it checks nothing itself).
bool softmax_sm90_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* dout);
// Whether the Hopper kernels run on CUDA device `device` (ATTNKIT_CUDA_SM90 set, an sm_90a build,
// compute capability 9.0): then softmax takes D = Dv = 256 unmasked, on them alone
// (softmax_fwd_cuda / softmax_bwd_cuda copy inputs whose strides TMA cannot read).
bool softmax_sm90_enabled(int device);
std::optional<std::tuple<at::Tensor, at::Tensor>> softmax_fwd_cuda_sm90(const at::Tensor& q, const at::Tensor& k,
                                                                        const at::Tensor& v, double scale,
                                                                        bool is_causal);
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> softmax_bwd_cuda_sm90(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    const at::Tensor& delta, double scale, bool is_causal);
std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q,
                                                                const at::Tensor& k, const at::Tensor& v,
                                                                const at::Tensor& out, const at::Tensor& lse,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                bool is_causal);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& S0,
    const std::optional<at::Tensor>& z0, bool causal, std::string_view feature_map, bool normalize, double eps,
    double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cuda(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den,
    const std::optional<at::Tensor>& grad_S, const std::optional<at::Tensor>& grad_z, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den, const at::Tensor& S,
    const at::Tensor& z, const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0, bool causal,
    std::string_view feature_map, bool normalize, double eps, double scale);

std::tuple<at::Tensor, at::Tensor> sparse_range_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, c10::IntArrayRef view,
                                                         c10::IntArrayRef lo, c10::IntArrayRef hi, double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_range_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    const at::Tensor& delta, c10::IntArrayRef view, c10::IntArrayRef lo, c10::IntArrayRef hi, double scale);
std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const at::Tensor& row_ptr,
                                                         const at::Tensor& col_idx, int64_t block, bool causal,
                                                         double scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    const at::Tensor& delta, const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& col_ptr,
    const at::Tensor& row_idx, int64_t block, bool causal, double scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hopfield_update_fwd_cuda(
    const at::Tensor& state, const at::Tensor& stored, const std::optional<at::Tensor>& values, double beta,
    int64_t steps, std::optional<double> tol, bool final_state);
std::tuple<at::Tensor, at::Tensor> hopfield_energy_fwd_cuda(const at::Tensor& state, const at::Tensor& stored,
                                                            double beta);

}  // namespace attnkit

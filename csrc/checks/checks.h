// The input checks of every attnkit op, one function per op, shared by its CPU and CUDA
// implementations (issue 10).
//
// Why: on the GPU image (torch 2.11) every failing check of a CUDA op killed the process instead
// of raising.  First suspects: the nvcc-compiled host code (its C++ standard, exceptions through its
// frames); the measured cause: a message formatted through iostreams inside attnkit._C (see
// csrc/message.h), hence ATTNKIT_CHECK throughout.  Either way, every input check lives here,
// compiled by the host C++ compiler in every build:
//  - the CPU kernels (csrc/cpu/<family>.cpp) call their op's check first;
//  - the CUDA kernels are registered for the CUDA key by csrc/checks/<family>.cpp (under
//    ATTNKIT_WITH_CUDA), whose wrappers run the same check, call the .cu's entry point
//    (csrc/cuda/launch.h) and raise a failed launch from here (raise_cuda_error);
//  - the tests run the checks directly, the CUDA branch too, on CPU and meta tensors with a
//    made-up device (attnkit._C._checks, bound in csrc/ops.cpp), so CI covers every message.
// A check raises c10::Error (RuntimeError in Python) saying what was expected and what came,
// through ATTNKIT_CHECK (csrc/message.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include <utility>

#ifdef ATTNKIT_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "../cuda/launch.h"  // the CUDA kernels' limits (plain C++, in every build)
#include "../message.h"      // ATTNKIT_CHECK: messages formatted without iostreams

namespace attnkit {
namespace checks {

enum class Backend { kCpu, kCuda };

// Where an op runs, and what its checks need to know of that place.
struct Target {
  Backend backend = Backend::kCpu;
  // The device type the op's tensors must have: CPU or CUDA.  Only the tests' entry
  // (attnkit._C._checks) sets another (meta), to run the CUDA branch without a GPU.
  c10::DeviceType device_type = c10::DeviceType::CPU;
  // CUDA: q's device.  Compute capability, and the most dynamic shared memory a block may opt
  // in to (bytes).  Read from the device by cuda_target(); made up by the tests.
  int cc_major = 0, cc_minor = 0;
  int64_t smem_optin = 0;
  // CUDA: the Hopper softmax kernels (csrc/cuda/softmax_sm90.cu) run on this device -- an sm_90a
  // build, compute capability 9.0, ATTNKIT_CUDA_SM90 set -- so softmax takes D = 256 unmasked.
  bool sm90_kernels = false;

  bool cuda() const { return backend == Backend::kCuda; }
};

inline Target cpu_target() { return Target{}; }

// The subject of every message: "attnkit::<op> (cpu)" or "attnkit::<op> (cuda)".
struct Op {
  const char* name;
  const Target& target;
};

// How ATTNKIT_CHECK (csrc/message.h) writes an Op into a message (found by argument-dependent
// lookup).  Every check here uses ATTNKIT_CHECK, not TORCH_CHECK: a message formatted through
// iostreams inside attnkit._C segfaulted on the GPU image (csrc/message.h says why).
inline void put(std::string& s, const Op& op) {
  s += "attnkit::";
  s += op.name;
  s += op.target.cuda() ? " (cuda)" : " (cpu)";
}

// ---- one check function per op (csrc/checks/<family>.cpp) -----------------------------------

// The trailing four: the score options (issue 28) -- window (-1 or >= 0 each), softcap (finite,
// >= 0), alibi_slopes (None or float32 [B, H] on q's device); the cuda kernels take none of them.
void softmax_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& mask, double scale, bool is_causal, int64_t window_left = -1,
                 int64_t window_right = -1, double softcap = 0.0,
                 const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
                 const std::optional<at::Tensor>& sinks = std::nullopt);
// The paged decoding forward (CPU): q [B,H,N,D] with N <= 16 and N * H / Hk <= 64 (the decoding
// kernel's rows), caches [num_blocks, Hk, block_size, D / Dv], block_table int64 [B, max_blocks]
// whose first ceil(length / block_size) entries of each row are blocks of the cache, length >= 0;
// the score options as softmax_fwd's.
void softmax_decode_paged(const Target& t, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, int64_t length, double scale, int64_t window_left = -1,
                          int64_t window_right = -1, double softcap = 0.0,
                          const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
                          const std::optional<at::Tensor>& sinks = std::nullopt);
void softmax_bwd(const Target& t, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                 const std::optional<at::Tensor>& mask, double scale, bool is_causal, int64_t window_left = -1,
                 int64_t window_right = -1, double softcap = 0.0,
                 const std::optional<at::Tensor>& alibi_slopes = std::nullopt);

void linear_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const std::optional<at::Tensor>& S0, const std::optional<at::Tensor>& z0, bool causal,
                std::string_view feature_map, bool normalize, double eps, double scale);
void linear_bwd(const Target& t, const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den,
                const std::optional<at::Tensor>& grad_S, const std::optional<at::Tensor>& grad_z, const at::Tensor& q,
                const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den,
                const at::Tensor& S, const at::Tensor& z, const std::optional<at::Tensor>& S0,
                const std::optional<at::Tensor>& z0, bool causal, std::string_view feature_map, bool normalize,
                double eps, double scale);

void sparse_range_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      c10::IntArrayRef view, c10::IntArrayRef lo, c10::IntArrayRef hi, double scale);
void sparse_range_bwd(const Target& t, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& lse, const at::Tensor& delta, c10::IntArrayRef view,
                      c10::IntArrayRef lo, c10::IntArrayRef hi, double scale);
// The lists' entries (offsets in range, block indices increasing and in range) are checked where
// the host can read them: CPU tensors.  CUDA lists are not read back (that would synchronize
// every call): they must come from a valid layout (attnkit.patterns.BlockLayout.index_lists).
// The backward of a whole-pattern op over one sequence (sparse_strided_bwd, sparse_star_bwd;
// CPU-only): sparse_range_bwd's checks on a plain view, with lse standing in for delta when only
// out is given (then out must be like grad_out), and q, k of the same length.  `name` is the op's
// ("sparse_strided_bwd").  Returns whether delta was given.
bool sparse_pattern_bwd(const Target& t, const char* name, const at::Tensor& grad_out, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                        const c10::optional<at::Tensor>& delta, const c10::optional<at::Tensor>& out, double scale);
void block_sparse_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& row_ptr, const at::Tensor& col_idx, int64_t block, bool causal, double scale);
void block_sparse_bwd(const Target& t, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& row_ptr,
                      const at::Tensor& col_idx, const at::Tensor& col_ptr, const at::Tensor& row_idx, int64_t block,
                      bool causal, double scale);

void hopfield_update_fwd(const Target& t, const at::Tensor& state, const at::Tensor& stored,
                         const std::optional<at::Tensor>& values, double beta, int64_t steps,
                         std::optional<double> tol, bool final_state);
void hopfield_energy_fwd(const Target& t, const at::Tensor& state, const at::Tensor& stored, double beta);

// ---- helpers the families share -------------------------------------------------------------

// The accumulation dtype of the kernels: float64 for float64 inputs, else float32.
inline at::ScalarType acc_type(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

inline bool defined(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// `lead` (the op's first tensor, named `name`) has the target's device type ("the cuda backend
// takes CUDA tensors; got q on cpu").
inline void check_device_type(const Op& op, const char* name, const at::Tensor& lead) {
  ATTNKIT_CHECK(lead.device().type() == op.target.device_type, op, ": the ", (op.target.cuda() ? "cuda" : "cpu"),
              " backend takes ", c10::DeviceTypeName(op.target.device_type), " tensors; got ", name, " on ",
              lead.device());
}

// t (named `name`) is on lead's device (`lead_name`'s).
inline void check_same_device(const Op& op, const char* name, const at::Tensor& t, const char* lead_name,
                              const at::Tensor& lead) {
  ATTNKIT_CHECK(t.device() == lead.device(), op, ": ", name, " must be on ", lead_name, "'s device (", lead.device(),
              "); got ", t.device());
}

// CUDA: 16-bit operands need tensor cores with mma.m16n8k16 (compute capability >= 8.0).  `what`
// is the subject of the message ("the cuda kernels", "float16 / bfloat16 inputs").
inline void check_sm80(const Op& op, const char* what) {
  const Target& t = op.target;
  ATTNKIT_CHECK(t.cc_major >= 8, op, ": ", what, " need compute capability 8.0 or newer (tensor-core mma.m16n8k16); ",
              "got ", t.cc_major, ".", t.cc_minor);
}

// CUDA: B and H index gridDim.z and gridDim.y.
inline void check_grid_bh(const Op& op, int64_t B, int64_t H) {
  constexpr int64_t kMax = cuda_limits::kMaxGridYZ;
  ATTNKIT_CHECK(B <= kMax && H <= kMax, op, ": B and H must be <= ", kMax, " (CUDA grid); got B = ", B, ", H = ", H);
}

// The flash-style families' q, k, v (softmax, sparse): all three 4-D (`layout` names the shapes
// the op expects, e.g. "q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,Dv]"), on the target's device type
// and one device, one dtype, which the backend takes (cuda: float16 / bfloat16; cpu: floating).
inline void check_flash_qkv_basics(const Op& op, const char* layout, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v) {
  ATTNKIT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": expected ", layout, "; got ", q.dim(), "-D, ",
                k.dim(), "-D and ", v.dim(), "-D");
  check_device_type(op, "q", q);
  check_same_device(op, "k", k, "q", q);
  check_same_device(op, "v", v, "q", q);
  const auto st = q.scalar_type();
  ATTNKIT_CHECK(k.scalar_type() == st && v.scalar_type() == st, op, ": q, k and v must share a dtype; got ", st, ", ",
                k.scalar_type(), " and ", v.scalar_type());
  if (op.target.cuda()) {
    ATTNKIT_CHECK(st == at::kHalf || st == at::kBFloat16, op, ": the cuda kernels take float16 or bfloat16; got ", st);
  } else {
    ATTNKIT_CHECK(at::isFloatingType(st), op, ": expected floating inputs; got ", st);
  }
}

// CUDA, the flash-style kernels' limits: D = Dv in {64, 128}, row indices in int (`n_name`,
// `m_name`: the lengths' names in the message), B and H within the grid, compute capability 8.0.
// wide: D = Dv = 256 too (softmax on the Hopper kernels); wide_hint: say when it would be.
inline void check_flash_cuda_limits(const Op& op, int64_t B, int64_t H, const char* n_name, int64_t N,
                                    const char* m_name, int64_t M, int64_t D, int64_t Dv, bool wide = false,
                                    const char* wide_hint = "") {
  ATTNKIT_CHECK((cuda_limits::flash_head_dim(D) || (wide && D == cuda_limits::kSm90WideHeadDim)) && Dv == D, op,
                ": the cuda kernels support head dims 64 and 128, with value's head dim equal to query's; got D = ", D,
                ", Dv = ", Dv, (D == cuda_limits::kSm90WideHeadDim ? wide_hint : ""));
  ATTNKIT_CHECK(N < (int64_t{1} << 30) && M < (int64_t{1} << 30), op, ": sequence lengths must be < 2^30; got ",
                n_name, " = ", N, ", ", m_name, " = ", M);
  check_grid_bh(op, B, H);
  check_sm80(op, "the cuda kernels");
}

#ifdef ATTNKIT_WITH_CUDA
// The target of a CUDA op whose first tensor is `lead`: q's device's properties.  For a tensor
// that is not on a CUDA device none are read (the op's check then stops at its device type).
inline Target cuda_target(const at::Tensor& lead) {
  Target t;
  t.backend = Backend::kCuda;
  t.device_type = c10::DeviceType::CUDA;
  if (!lead.is_cuda()) return t;
  const int dev = lead.get_device();
  int smem = 0;
  for (auto [attr, out] : {std::pair{cudaDevAttrComputeCapabilityMajor, &t.cc_major},
                           std::pair{cudaDevAttrComputeCapabilityMinor, &t.cc_minor},
                           std::pair{cudaDevAttrMaxSharedMemoryPerBlockOptin, &smem}}) {
    const cudaError_t err = cudaDeviceGetAttribute(out, attr, dev);
    ATTNKIT_CHECK(err == cudaSuccess, "attnkit: cannot read the properties of CUDA device ", dev, ": ",
                cudaGetErrorString(err));
  }
  t.smem_optin = smem;
  t.sm90_kernels = softmax_sm90_enabled(dev);
  return t;
}

// Raises the CUDA error a .cu entry point left pending (a failed launch), if any.  Called right
// after the entry point, from g++-compiled code: the .cu itself raises nothing (launch.h).
inline void raise_cuda_error(const char* op) {
  const cudaError_t err = cudaGetLastError();
  ATTNKIT_CHECK(err == cudaSuccess, "attnkit::", op, " (cuda): CUDA error ", cudaGetErrorName(err), ": ",
              cudaGetErrorString(err));
}
#endif

}  // namespace checks
}  // namespace attnkit

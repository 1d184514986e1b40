// Input checks of attnkit::softmax_fwd / softmax_bwd / softmax_decode_paged (CPU only) (csrc/checks/checks.h says why they live
// here), and, in a CUDA build, the CUDA registration of both ops: check, then csrc/cuda/softmax.cu.
//
// What differs by backend: the CPU kernel takes any floating dtype, any head dims (Dv may differ
// from D) and a mask of exactly [B, H, N, M] (a stride-0 broadcast view is fine); the CUDA kernels
// take float16 / bfloat16 on compute capability >= 8.0, D = Dv in {64, 128} (and 256 unmasked where
// the Hopper kernels run: Target::sm90_kernels), N, M < 2^30, B and H
// within the grid, and a mask that may also have size 1 in any dim.
#include "checks.h"

#include <torch/library.h>

#include <cmath>
#include <vector>

namespace attnkit {
namespace checks {
namespace {

// q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,Dv]: ranks, devices, dtypes, shapes, the backend's limits
// (CUDA: D = Dv = 256 on the Hopper kernels, which take no mask).
void check_qkv(const Op& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool masked) {
  check_flash_qkv_basics(op, "q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,Dv]", q, k, v);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), M = k.size(2);
  ATTNKIT_CHECK(k.size(0) == B && v.size(0) == B, op, ": batch sizes differ: q ", q.sizes(), ", k ", k.sizes(), ", v ",
              v.sizes());
  ATTNKIT_CHECK(k.size(3) == D, op, ": q and k must share the head dim; got ", q.sizes(), " and ", k.sizes());
  ATTNKIT_CHECK(v.size(1) == Hk && v.size(2) == M, op, ": k and v must agree on Hk and M; got ", k.sizes(), " and ",
              v.sizes());
  ATTNKIT_CHECK(Hk > 0 ? H % Hk == 0 : H == 0, op,
              ": the query heads must be a multiple of the key/value heads; got H = ", H, ", Hk = ", Hk);
  if (op.target.cuda()) {
    const char* hint = masked ? " (256 runs on the Hopper kernels, which take no mask)"
                              : " (256 runs on the Hopper kernels: ATTNKIT_CUDA_SM90 set, a compute capability 9.0 "
                                "device, an sm_90a build)";
    check_flash_cuda_limits(op, B, H, "N", N, "M", M, D, v.size(3), op.target.sm90_kernels && !masked, hint);
  }
}

// mask: None, or bool / floating of shape [B,H,N,M] on q's device.
void check_mask(const Op& op, const std::optional<at::Tensor>& mask, const at::Tensor& q, const at::Tensor& k) {
  if (!defined(mask)) return;
  const at::Tensor& m = *mask;
  const int64_t want[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
  // The CUDA kernels read a dim of size 1 with stride 0 (a broadcast); the CPU kernel reads the
  // mask's strides as they are, so it needs the full shape (a stride-0 expand() view is fine).
  bool fits = m.dim() == 4;
  for (int d = 0; fits && d < 4; ++d) fits = m.size(d) == want[d] || (op.target.cuda() && m.size(d) == 1);
  ATTNKIT_CHECK(fits, op, ": mask must have shape [B, H, N, M] = [", want[0], ", ", want[1], ", ", want[2], ", ",
              want[3], "]", (op.target.cuda() ? " (or 1 in any dim)" : " (a broadcast view is fine)"), "; got ",
              m.sizes());
  check_same_device(op, "mask", m, "q", q);
  const auto st = m.scalar_type();
  ATTNKIT_CHECK(st == at::kBool || st == at::kHalf || st == at::kBFloat16 || st == at::kFloat || st == at::kDouble, op,
              ": mask must be bool or floating point (float16, bfloat16, float32, float64); got ", st);
}

// The score options (issue 28): window bounds -1 (unbounded) or >= 0; softcap finite and >= 0 (0 =
// off); alibi_slopes float32 [B, H] on q's device (a stride-0 expand of [H] is fine).  The cuda
// kernels compute none of them yet: any non-default option is refused there (attnkit's Python
// layer routes such calls to the cpu kernel or the reference before they get here).
void check_score_options(const Op& op, const at::Tensor& q, int64_t window_left, int64_t window_right,
                         double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  ATTNKIT_CHECK(window_left >= -1 && window_right >= -1, op,
                ": window bounds must be -1 (unbounded) or >= 0; got window_left = ", window_left,
                ", window_right = ", window_right);
  ATTNKIT_CHECK(std::isfinite(softcap) && softcap >= 0.0, op, ": softcap must be finite and >= 0 (0 = off); got ",
                softcap);
  if (defined(alibi_slopes)) {
    const at::Tensor& a = *alibi_slopes;
    const int64_t B = q.size(0), H = q.size(1);
    ATTNKIT_CHECK(a.dim() == 2 && a.size(0) == B && a.size(1) == H, op,
                  ": alibi_slopes must have shape [B, H] = [", B, ", ", H, "] (a broadcast view is fine); got ",
                  a.sizes());
    ATTNKIT_CHECK(a.scalar_type() == at::kFloat, op, ": alibi_slopes must be Float; got ", a.scalar_type());
    check_same_device(op, "alibi_slopes", a, "q", q);
  }
  if (op.target.cuda()) {
    const bool window = window_left != -1 || window_right != -1;
    const bool alibi = defined(alibi_slopes);
    ATTNKIT_CHECK(!window && softcap == 0.0 && !alibi, op,
                  ": the cuda kernels do not implement the score options window, softcap and alibi_slopes yet; got",
                  (window ? " window" : ""), (softcap != 0.0 ? " softcap" : ""), (alibi ? " alibi_slopes" : ""),
                  " (run them on the cpu backend or the reference)");
  }
}

// sinks: None or float32 [H] on q's device, one logit a query head that the kernel folds into
// each row's softmax.  The cuda kernels do not (attnkit's Python layer applies the sinks around
// them), so the cuda target refuses them.
void check_sinks(const Op& op, const at::Tensor& q, const std::optional<at::Tensor>& sinks) {
  if (!defined(sinks)) return;
  const at::Tensor& s = *sinks;
  const int64_t H = q.size(1);
  ATTNKIT_CHECK(s.dim() == 1 && s.size(0) == H, op, ": sinks must have shape [H] = [", H, "]; got ", s.sizes());
  ATTNKIT_CHECK(s.scalar_type() == at::kFloat, op, ": sinks must be Float; got ", s.scalar_type());
  check_same_device(op, "sinks", s, "q", q);
  ATTNKIT_CHECK(!op.target.cuda(), op,
                ": the cuda kernels do not fold sinks into the softmax; got sinks (attnkit.softmax_attention "
                "applies them around the kernel there)");
}

}  // namespace

void softmax_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const std::optional<at::Tensor>& mask, double /*scale*/, bool /*is_causal*/, int64_t window_left,
                 int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                 const std::optional<at::Tensor>& sinks) {
  const Op op{"softmax_fwd", t};
  check_qkv(op, q, k, v, defined(mask));
  check_mask(op, mask, q, k);
  check_score_options(op, q, window_left, window_right, softcap, alibi_slopes);
  check_sinks(op, q, sinks);
}

void softmax_decode_paged(const Target& t, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, int64_t length, double /*scale*/, int64_t window_left,
                          int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                          const std::optional<at::Tensor>& sinks) {
  const Op op{"softmax_decode_paged", t};
  check_flash_qkv_basics(op, "q [B,H,N,D], k_cache [num_blocks,Hk,block_size,D], v_cache [num_blocks,Hk,block_size,Dv]",
                         q, k_cache, v_cache);
  const auto st = q.scalar_type();
  ATTNKIT_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op,
                ": the paged decoding kernel takes float32, bfloat16 or float16; got ", st);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t blocks = k_cache.size(0), Hk = k_cache.size(1), block_size = k_cache.size(2);
  ATTNKIT_CHECK(k_cache.size(3) == D, op, ": q and k_cache must share the head dim; got ", q.sizes(), " and ",
                k_cache.sizes());
  ATTNKIT_CHECK(v_cache.size(0) == blocks && v_cache.size(1) == Hk && v_cache.size(2) == block_size, op,
                ": k_cache and v_cache must agree on num_blocks, Hk and block_size; got ", k_cache.sizes(), " and ",
                v_cache.sizes());
  ATTNKIT_CHECK(Hk > 0 && H % Hk == 0, op, ": the query heads must be a multiple of the key/value heads; got H = ", H,
                ", Hk = ", Hk);
  ATTNKIT_CHECK(N <= 16 && N * (H / Hk) <= 64, op,
                ": the paged decoding kernel takes N <= 16 query rows and N * H / Hk <= 64 rows a kv head; got N = ", N,
                ", H = ", H, ", Hk = ", Hk);
  ATTNKIT_CHECK(length >= 0, op, ": length must be >= 0; got ", length);
  check_score_options(op, q, window_left, window_right, softcap, alibi_slopes);
  check_sinks(op, q, sinks);
  ATTNKIT_CHECK(block_size > 0 || length == 0, op, ": the cache has block_size 0; got ", k_cache.sizes());
  ATTNKIT_CHECK(block_table.dim() == 2 && block_table.size(0) == B, op, ": block_table must be [B, max_blocks] with B = ",
                B, "; got ", block_table.sizes());
  ATTNKIT_CHECK(block_table.scalar_type() == at::kLong, op, ": block_table must be int64; got ",
                block_table.scalar_type());
  check_same_device(op, "block_table", block_table, "q", q);
  const int64_t used = block_size > 0 ? (length + block_size - 1) / block_size : 0;
  ATTNKIT_CHECK(used <= block_table.size(1), op, ": length ", length, " needs ", used, " blocks of ", block_size,
                "; block_table has ", block_table.size(1));
  if (used > 0 && B > 0) {
    const at::Tensor head = block_table.narrow(1, 0, used);
    const int64_t lo = head.min().item<int64_t>(), hi = head.max().item<int64_t>();
    ATTNKIT_CHECK(lo >= 0 && hi < blocks, op, ": block_table's first ", used, " entries of each row must be blocks of ",
                  "the cache, in [0, ", blocks, "); got values in [", lo, ", ", hi, "]");
  }
}

void softmax_bwd(const Target& t, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                 const std::optional<at::Tensor>& mask, double /*scale*/, bool /*is_causal*/, int64_t window_left,
                 int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  const Op op{"softmax_bwd", t};
  check_qkv(op, q, k, v, defined(mask));
  check_mask(op, mask, q, k);
  check_score_options(op, q, window_left, window_right, softcap, alibi_slopes);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), Dv = v.size(3);
  const std::vector<int64_t> want_out{B, H, N, Dv};
  ATTNKIT_CHECK(grad_out.sizes() == want_out && out.sizes() == want_out, op,
              ": grad_out and out must have shape [B, H, N, Dv] = ", at::IntArrayRef(want_out), "; got ",
              grad_out.sizes(), " and ", out.sizes());
  ATTNKIT_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), op,
              ": grad_out and out must have q's dtype ", q.scalar_type(), "; got ", grad_out.scalar_type(), " and ",
              out.scalar_type());
  const std::vector<int64_t> want_lse{B, H, N};
  ATTNKIT_CHECK(lse.sizes() == want_lse, op, ": lse must have shape [B, H, N] = ", at::IntArrayRef(want_lse), "; got ",
              lse.sizes());
  ATTNKIT_CHECK(lse.scalar_type() == acc_type(q.scalar_type()), op, ": lse must be ", acc_type(q.scalar_type()),
              "; got ", lse.scalar_type());
  check_same_device(op, "grad_out", grad_out, "q", q);
  check_same_device(op, "out", out, "q", q);
  check_same_device(op, "lse", lse, "q", q);
}

}  // namespace checks
}  // namespace attnkit

#ifdef ATTNKIT_WITH_CUDA
namespace attnkit {
namespace {

// The score options pass the check only with their defaults (check_score_options): the CUDA
// kernels (csrc/cuda/softmax.cu) take none of them yet.
std::tuple<at::Tensor, at::Tensor> softmax_fwd_cuda_checked(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const std::optional<at::Tensor>& mask,
                                                            double scale, bool is_causal, int64_t window_left,
                                                            int64_t window_right, double softcap,
                                                            const std::optional<at::Tensor>& alibi_slopes,
                                                            const std::optional<at::Tensor>& sinks) {
  checks::softmax_fwd(checks::cuda_target(q), q, k, v, mask, scale, is_causal, window_left, window_right, softcap,
                      alibi_slopes, sinks);
  auto result = softmax_fwd_cuda(q, k, v, mask, scale, is_causal);
  checks::raise_cuda_error("softmax_fwd");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_bwd_cuda_checked(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& mask, double scale, bool is_causal, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes) {
  checks::softmax_bwd(checks::cuda_target(q), grad_out, q, k, v, out, lse, mask, scale, is_causal, window_left,
                      window_right, softcap, alibi_slopes);
  auto result = softmax_bwd_cuda(grad_out, q, k, v, out, lse, mask, scale, is_causal);
  checks::raise_cuda_error("softmax_bwd");
  return result;
}

}  // namespace
}  // namespace attnkit

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("softmax_fwd", &attnkit::softmax_fwd_cuda_checked);
  m.impl("softmax_bwd", &attnkit::softmax_bwd_cuda_checked);
}
#endif  // ATTNKIT_WITH_CUDA

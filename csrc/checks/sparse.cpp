// Input checks of attnkit::sparse_range_fwd / _bwd and block_sparse_fwd / _bwd (csrc/checks/
// checks.h says why they live here), and, in a CUDA build, the CUDA registration of the four
// ops: check, then csrc/cuda/sparse.cu.
//
// What differs by backend: the CPU kernels take any floating dtype and head dims (Dv may differ
// from D), any block >= 1, and range views whose groups' query rows are disjoint (checked row by
// row).  The CUDA kernels take float16 / bfloat16 on compute capability >= 8.0, D = Dv in
// {64, 128}, Nq, Nk < 2^30, B and H within the grid, block >= 16, view entries and bounds that
// fit their int arithmetic, and only views whose groups are disjoint by one of two closed-form
// tests (query rows; in the backward key rows too: dK/dV are written without atomics).
#include "checks.h"

#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <vector>

namespace attnkit {
namespace checks {
namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// q [B,H,Nq,D], k [B,H,Nk,D], v [B,H,Nk,Dv].
void check_qkv(const Op& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_flash_qkv_basics(op, "q [B,H,Nq,D], k [B,H,Nk,D], v [B,H,Nk,Dv]", q, k, v);
  ATTNKIT_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1),
              op, ": q, k, v must share B and H; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  ATTNKIT_CHECK(k.size(3) == q.size(3), op, ": q and k must share D; got ", q.sizes(), " and ", k.sizes());
  ATTNKIT_CHECK(v.size(2) == k.size(2), op, ": k and v must have the same rows; got ", k.sizes(), " and ", v.sizes());
  if (op.target.cuda()) {
    check_flash_cuda_limits(op, q.size(0), q.size(1), "Nq", q.size(2), "Nk", k.size(2), q.size(3), v.size(3));
  }
}

// The backward's extra inputs: grad_out [B,H,Nq,Dv] like q; lse, delta [B,H,Nq] of the
// accumulation dtype.
void check_grad_inputs(const Op& op, const at::Tensor& q, const at::Tensor& v, const at::Tensor& dout,
                       const at::Tensor& lse, const at::Tensor& delta) {
  const std::vector<int64_t> out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  ATTNKIT_CHECK(dout.sizes() == out_shape, op, ": grad_out must be [B, H, Nq, Dv] = ", at::IntArrayRef(out_shape),
              "; got ", dout.sizes());
  ATTNKIT_CHECK(dout.scalar_type() == q.scalar_type(), op, ": grad_out must have q's dtype ", q.scalar_type(), "; got ",
              dout.scalar_type());
  check_same_device(op, "grad_out", dout, "q", q);
  const std::vector<int64_t> row_shape{q.size(0), q.size(1), q.size(2)};
  const auto acc = acc_type(q.scalar_type());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"lse", lse}, {"delta", delta}}) {
    ATTNKIT_CHECK(t.sizes() == row_shape, op, ": lse and delta must be [B, H, Nq] = ", at::IntArrayRef(row_shape),
                "; got ", name, " ", t.sizes());
    ATTNKIT_CHECK(t.scalar_type() == acc, op, ": lse and delta must be ", acc, "; got ", name, " ", t.scalar_type());
    check_same_device(op, name, t, "q", q);
  }
}

// ---- range parts ----

// Rows of group g on one side: ceil(max(n - g * pg, 0) / pt) (sparse.cu: group_rows).
int64_t group_rows(int64_t n, int64_t g, int64_t pg, int64_t pt) {
  const int64_t rest = n - g * pg;
  return rest <= 0 ? 0 : (rest + pt - 1) / pt;
}

// Whether no row of one side is in two groups, by the CUDA kernels' closed-form tests (the same
// as group_cover in sparse.cu, which relies on it): interleaved groups, 0 < (used - 1) * pg < pt,
// or consecutive stretches, pg > (T_0 - 1) * pt; every group the same rows (pg = 0) only for one
// used group.  Sufficient, not necessary: the CPU kernels check exactly instead.
bool cuda_groups_disjoint(int64_t n, int64_t G, int64_t pg, int64_t pt) {
  const int64_t first = G > 0 ? group_rows(n, 0, pg, pt) : 0;
  if (first == 0) return true;
  if (pg == 0) return G == 1;
  // Groups with rows: g * pg < n (rows are nonincreasing in g).
  const int64_t used = std::min(G, (n + pg - 1) / pg);
  return used <= 1 || (used - 1) * pg < pt || pg > (first - 1) * pt;
}

// The first query row that two groups share (exact, row by row), or -1.  O(Nq).
int64_t first_shared_query_row(int64_t Nq, int64_t G, int64_t pg, int64_t pt) {
  std::vector<char> seen(static_cast<size_t>(Nq), 0);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t rows = group_rows(Nq, g, pg, pt);
    if (rows == 0) break;  // starts only grow with g: no later group has rows either
    for (int64_t t = 0; t < rows; ++t) {
      char& s = seen[static_cast<size_t>(g * pg + t * pt)];
      if (s) return g * pg + t * pt;
      s = 1;
    }
  }
  return -1;
}

// view = [G, q_pg, q_pt, k_pg, k_pt], lo / hi = [a, d, m, b] (csrc/ops.cpp).  keys_disjoint: the
// backward, whose CUDA kernels write dK/dV of each group's key rows without atomics.
void check_range(const Op& op, const at::Tensor& q, const at::Tensor& k, c10::IntArrayRef view, c10::IntArrayRef lo,
                 c10::IntArrayRef hi, bool keys_disjoint) {
  ATTNKIT_CHECK(view.size() == 5, op, ": view must be [G, q_pg, q_pt, k_pg, k_pt]; got ", view.size(), " values");
  const int64_t G = view[0], q_pg = view[1], q_pt = view[2], k_pg = view[3], k_pt = view[4];
  ATTNKIT_CHECK(G >= 0 && q_pg >= 0 && k_pg >= 0 && q_pt >= 1 && k_pt >= 1, op,
              ": view [G, q_pg, q_pt, k_pg, k_pt] needs G, q_pg, k_pg >= 0 and q_pt, k_pt >= 1; got ", view);
  for (const auto& [name, f] : {std::pair<const char*, c10::IntArrayRef>{"lo", lo}, {"hi", hi}}) {
    ATTNKIT_CHECK(f.size() == 4, op, ": ", name, " must be [a, d, m, b]; got ", f.size(), " values");
    ATTNKIT_CHECK(f[1] >= 1 && f[2] >= 0, op, ": ", name, " = [a, d, m, b] needs d >= 1 and m >= 0 ",
                "(nondecreasing bounds); got d=", f[1], ", m=", f[2]);
    // The CPU kernels clamp f(t) to +-2^62; t + a must not overflow on the way.
    ATTNKIT_CHECK(std::abs(f[0]) < (int64_t{1} << 60), op, ": ", name, "'s offset a is out of range (|a| < 2^60); got ",
                f[0]);
  }
  const int64_t Nq = q.size(2), Nk = k.size(2);
  if (!op.target.cuda()) {
    const int64_t row = first_shared_query_row(Nq, G, q_pg, q_pt);
    ATTNKIT_CHECK(row < 0, op, ": view ", view, " puts query row ", row,
                " in two groups; the kernels need the groups' query rows to be disjoint");
    return;
  }
  // The CUDA kernels hold view entries and d in int, and evaluate floor((t + a) / d) * m + b in
  // int64 with t < 2^30.
  for (int i = 0; i < 5; ++i) ATTNKIT_CHECK(view[i] <= kIntMax, op, ": view entries must be < 2^31; got ", view);
  for (const c10::IntArrayRef f : {lo, hi}) {
    ATTNKIT_CHECK(f[1] <= kIntMax && f[2] <= (int64_t{1} << 20) && std::abs(f[0]) <= (int64_t{1} << 40) &&
                    std::abs(f[3]) <= (int64_t{1} << 62),
                op, ": the cuda kernels take bounds [a, d, m, b] with 1 <= d < 2^31, 0 <= m <= 2^20, |a| <= 2^40, ",
                "|b| <= 2^62; got lo = ", lo, ", hi = ", hi);
  }
  if (!keys_disjoint) {
    ATTNKIT_CHECK(cuda_groups_disjoint(Nq, G, q_pg, q_pt), op,
                ": the cuda kernels need the groups' query rows to be disjoint; view = ", view, " with Nq = ", Nq,
                " puts some query row in two groups (or is not of the interleaved / consecutive forms they take)");
  } else {
    ATTNKIT_CHECK(cuda_groups_disjoint(Nq, G, q_pg, q_pt) && cuda_groups_disjoint(Nk, G, k_pg, k_pt), op,
                ": the cuda kernels need the groups' query rows and key rows to be disjoint; view = ", view,
                " with Nq = ", Nq, ", Nk = ", Nk,
                " puts some row in two groups (or is not of the interleaved / consecutive forms they take)");
  }
}

// ---- block-sparse ----

// block, and q, k of one length N = nb * block.
void check_block(const Op& op, const at::Tensor& q, const at::Tensor& k, int64_t block) {
  if (op.target.cuda()) {
    ATTNKIT_CHECK(block >= cuda_limits::kSparseMinBlock, op, ": the cuda kernels need block >= ",
                cuda_limits::kSparseMinBlock, "; got block = ", block);
  } else {
    ATTNKIT_CHECK(block >= 1, op, ": block must be >= 1; got ", block);
  }
  ATTNKIT_CHECK(k.size(2) == q.size(2), op, ": q and k must have the same length N; got ", q.sizes(), " and ",
              k.sizes());
  ATTNKIT_CHECK(q.size(2) % block == 0, op, ": N = ", q.size(2), " must be a multiple of block = ", block);
}

// One pair of index lists: ptr int32 [1 or H, nb + 1] of offsets into idx int32 [nnz], on q's
// device; on the CPU also their entries (see checks.h).
void check_lists(const Op& op, const at::Tensor& q, const char* pname, const at::Tensor& ptr, const char* iname,
                 const at::Tensor& idx, int64_t nb) {
  const int64_t H = q.size(1);
  ATTNKIT_CHECK(ptr.scalar_type() == at::kInt && idx.scalar_type() == at::kInt, op, ": ", pname, " and ", iname,
              " must be int32; got ", ptr.scalar_type(), " and ", idx.scalar_type());
  check_same_device(op, pname, ptr, "q", q);
  check_same_device(op, iname, idx, "q", q);
  ATTNKIT_CHECK(ptr.dim() == 2 && (ptr.size(0) == 1 || ptr.size(0) == H) && ptr.size(1) == nb + 1, op, ": ", pname,
              " must be [1 or H, nb + 1] = [1 or ", H, ", ", nb + 1, "]; got ", ptr.sizes());
  ATTNKIT_CHECK(idx.dim() == 1, op, ": ", iname, " must be 1-D; got ", idx.sizes());
  if (!ptr.device().is_cpu()) return;
  const at::Tensor p = ptr.contiguous(), x = idx.contiguous();
  const int32_t* P = p.const_data_ptr<int32_t>();
  const int32_t* I = x.const_data_ptr<int32_t>();
  const int64_t nnz = x.numel();
  for (int64_t h = 0; h < p.size(0); ++h) {
    for (int64_t r = 0; r < nb; ++r) {
      const int64_t a = P[h * (nb + 1) + r], e = P[h * (nb + 1) + r + 1];
      ATTNKIT_CHECK(0 <= a && a <= e && e <= nnz, op, ": ", pname, " must hold nondecreasing offsets into ", iname,
                  " (", nnz, " entries); head ", h, " row ", r, ": [", a, ", ", e, ")");
      for (int64_t i = a; i < e; ++i) {
        ATTNKIT_CHECK(0 <= I[i] && I[i] < nb && (i == a || I[i - 1] < I[i]), op, ": ", iname,
                    " entries must be increasing block indices in [0, ", nb, ") per row; head ", h, " row ", r,
                    " has ", I[i]);
      }
    }
  }
}

}  // namespace

void sparse_range_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      c10::IntArrayRef view, c10::IntArrayRef lo, c10::IntArrayRef hi, double /*scale*/) {
  const Op op{"sparse_range_fwd", t};
  check_qkv(op, q, k, v);
  check_range(op, q, k, view, lo, hi, /*keys_disjoint=*/false);
}

void sparse_range_bwd(const Target& t, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& lse, const at::Tensor& delta, c10::IntArrayRef view,
                      c10::IntArrayRef lo, c10::IntArrayRef hi, double /*scale*/) {
  const Op op{"sparse_range_bwd", t};
  check_qkv(op, q, k, v);
  check_grad_inputs(op, q, v, grad_out, lse, delta);
  check_range(op, q, k, view, lo, hi, /*keys_disjoint=*/true);
}

bool sparse_pattern_bwd(const Target& t, const char* name, const at::Tensor& grad_out, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                        const c10::optional<at::Tensor>& delta, const c10::optional<at::Tensor>& out, double scale) {
  const Op op{name, t};
  const std::vector<int64_t> plain{1, 0, 1, 0, 1}, lo{0, 1, 1, 0}, hi{0, 1, 1, 0};
  const bool has_delta = delta.has_value() && delta->defined();
  const bool has_out = out.has_value() && out->defined();
  ATTNKIT_CHECK(has_delta || has_out, op, ": give delta, or out to compute it from");
  sparse_range_bwd(t, grad_out, q, k, v, lse, has_delta ? *delta : lse, plain, lo, hi, scale);
  if (!has_delta) {
    ATTNKIT_CHECK(out->sizes() == grad_out.sizes() && out->scalar_type() == grad_out.scalar_type() &&
                      out->device() == grad_out.device(),
                  op, ": out must be like grad_out (", grad_out.sizes(), ", ", grad_out.scalar_type(), ", ",
                  grad_out.device(), "); got ", out->sizes(), ", ", out->scalar_type(), ", ", out->device());
  }
  ATTNKIT_CHECK(k.size(2) == q.size(2), op, ": self-attention: q and k must have the same length; got ", q.sizes(),
                " and ", k.sizes());
  return has_delta;
}

void block_sparse_fwd(const Target& t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& row_ptr, const at::Tensor& col_idx, int64_t block, bool /*causal*/,
                      double /*scale*/) {
  const Op op{"block_sparse_fwd", t};
  check_qkv(op, q, k, v);
  check_block(op, q, k, block);
  check_lists(op, q, "row_ptr", row_ptr, "col_idx", col_idx, q.size(2) / block);
}

void block_sparse_bwd(const Target& t, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& lse, const at::Tensor& delta, const at::Tensor& row_ptr,
                      const at::Tensor& col_idx, const at::Tensor& col_ptr, const at::Tensor& row_idx, int64_t block,
                      bool /*causal*/, double /*scale*/) {
  const Op op{"block_sparse_bwd", t};
  check_qkv(op, q, k, v);
  check_block(op, q, k, block);
  check_grad_inputs(op, q, v, grad_out, lse, delta);
  const int64_t nb = q.size(2) / block;
  check_lists(op, q, "row_ptr", row_ptr, "col_idx", col_idx, nb);
  check_lists(op, q, "col_ptr", col_ptr, "row_idx", row_idx, nb);
  ATTNKIT_CHECK(col_idx.numel() == row_idx.numel() && row_ptr.size(0) == col_ptr.size(0), op,
              ": the column lists must transpose the row lists; got ", col_idx.numel(), " vs ", row_idx.numel(),
              " entries, ", row_ptr.size(0), " vs ", col_ptr.size(0), " layout heads");
}

}  // namespace checks
}  // namespace attnkit

#ifdef ATTNKIT_WITH_CUDA
namespace attnkit {
namespace {

std::tuple<at::Tensor, at::Tensor> sparse_range_fwd_cuda_checked(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, c10::IntArrayRef view,
                                                                 c10::IntArrayRef lo, c10::IntArrayRef hi,
                                                                 double scale) {
  checks::sparse_range_fwd(checks::cuda_target(q), q, k, v, view, lo, hi, scale);
  auto result = sparse_range_fwd_cuda(q, k, v, view, lo, hi, scale);
  checks::raise_cuda_error("sparse_range_fwd");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_range_bwd_cuda_checked(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    const at::Tensor& delta, c10::IntArrayRef view, c10::IntArrayRef lo, c10::IntArrayRef hi, double scale) {
  checks::sparse_range_bwd(checks::cuda_target(q), grad_out, q, k, v, lse, delta, view, lo, hi, scale);
  auto result = sparse_range_bwd_cuda(grad_out, q, k, v, lse, delta, view, lo, hi, scale);
  checks::raise_cuda_error("sparse_range_bwd");
  return result;
}

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cuda_checked(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, const at::Tensor& row_ptr,
                                                                 const at::Tensor& col_idx, int64_t block,
                                                                 bool causal, double scale) {
  checks::block_sparse_fwd(checks::cuda_target(q), q, k, v, row_ptr, col_idx, block, causal, scale);
  auto result = block_sparse_fwd_cuda(q, k, v, row_ptr, col_idx, block, causal, scale);
  checks::raise_cuda_error("block_sparse_fwd");
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cuda_checked(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    const at::Tensor& delta, const at::Tensor& row_ptr, const at::Tensor& col_idx, const at::Tensor& col_ptr,
    const at::Tensor& row_idx, int64_t block, bool causal, double scale) {
  checks::block_sparse_bwd(checks::cuda_target(q), grad_out, q, k, v, lse, delta, row_ptr, col_idx, col_ptr, row_idx,
                           block, causal, scale);
  auto result =
      block_sparse_bwd_cuda(grad_out, q, k, v, lse, delta, row_ptr, col_idx, col_ptr, row_idx, block, causal, scale);
  checks::raise_cuda_error("block_sparse_bwd");
  return result;
}

}  // namespace
}  // namespace attnkit

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("sparse_range_fwd", &attnkit::sparse_range_fwd_cuda_checked);
  m.impl("sparse_range_bwd", &attnkit::sparse_range_bwd_cuda_checked);
  m.impl("block_sparse_fwd", &attnkit::block_sparse_fwd_cuda_checked);
  m.impl("block_sparse_bwd", &attnkit::block_sparse_bwd_cuda_checked);
}
#endif  // ATTNKIT_WITH_CUDA

// The outputs and the dtype dispatch of a whole-pattern sparse backward (csrc/cpu/sparse.cpp's
// sparse_strided_bwd, csrc/cpu/sparse_star.cpp's sparse_star_bwd): dq, dk, dv in the
// accumulation type on huge pages, the kernel run for q's dtype, the results converted back.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <tuple>

#include "empty_huge.h"
#include "flash_tiles.h"

namespace attnkit {
namespace {  // as flash_tiles.h, whose helpers this uses

// kernel(BH, N, D, Dv, dout, q, k, v, lse, delta or nullptr, out or nullptr, dq, dk, dv), a
// generic lambda: typed pointers (scalar_t inputs, acc_t lse / delta / gradients) pick the
// kernel's instantiation.  All tensors contiguous; delta or out undefined when not given.  The
// kernel writes every element of dq, dk and dv.
template <typename Kernel>
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_pattern_bwd(const at::Tensor& dout,
                                                               const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& lse,
                                                               const at::Tensor& delta, const at::Tensor& out,
                                                               Kernel kernel) {
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Dv = v.size(3);
  const auto dtype = q.scalar_type();
  const auto acc = acc_type_of(dtype);
  at::Tensor dq = empty_huge({B, H, N, D}, q.options().dtype(acc));
  at::Tensor dk = empty_huge({B, H, N, D}, q.options().dtype(acc));
  at::Tensor dv = empty_huge({B, H, N, Dv}, q.options().dtype(acc));
  if (B * H * N > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "sparse_pattern_bwd", [&] {
      using acc_t = acc_of<scalar_t>;
      kernel(B * H, N, D, Dv, dout.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
             k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), lse.const_data_ptr<acc_t>(),
             delta.defined() ? delta.const_data_ptr<acc_t>() : nullptr,
             out.defined() ? out.const_data_ptr<scalar_t>() : nullptr, dq.mutable_data_ptr<acc_t>(),
             dk.mutable_data_ptr<acc_t>(), dv.mutable_data_ptr<acc_t>());
    });
  }
  if (acc != dtype) return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
  return {dq, dk, dv};
}

}  // namespace
}  // namespace attnkit

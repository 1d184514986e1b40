// attnkit::softmax_fwd's autograd in C++ (csrc/softmax_autograd.cpp), bound into attnkit._C.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>

namespace attnkit {
// attnkit::softmax_fwd / softmax_bwd without their score options, called through the dispatcher
// from C++ with a typed handle (the caller's dispatch keys and TLS pick the kernel).
std::tuple<at::Tensor, at::Tensor> call_softmax_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& mask, double scale,
                                                    bool is_causal);
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_softmax_bwd(const at::Tensor& grad_out, const at::Tensor& q,
                                                                const at::Tensor& k, const at::Tensor& v,
                                                                const at::Tensor& out, const at::Tensor& lse,
                                                                const std::optional<at::Tensor>& mask, double scale,
                                                                bool is_causal);

// Adds softmax_fwd_autograd and set_softmax_backward_fallback to the module.
void bind_softmax_autograd(pybind11::module_& module);
}  // namespace attnkit

// attnkit::softmax_fwd's autograd in C++ (csrc/softmax_autograd.cpp), bound into attnkit._C.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace attnkit {
// Adds softmax_fwd_autograd and set_softmax_backward_fallback to the module.
void bind_softmax_autograd(pybind11::module_& module);
}  // namespace attnkit

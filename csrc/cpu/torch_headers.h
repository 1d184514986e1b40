// The torch headers a CPU kernel file needs: tensors and their methods, the few ATen functions
// the kernels call (empty, zeros, zeros_like, full, from_blob), at::parallel_for, the
// AT_DISPATCH macros and TORCH_LIBRARY_IMPL.  Not <torch/extension.h>: that one also parses
// torch's C++ front end (autograd, nn, optim) and pybind11, which no kernel file uses.
// Measured on the 2-core AMD EPYC (AVX2), g++ -std=c++17 -fsyntax-only of csrc/cpu/linear.cpp
// (the C++17 check tests/test_build.py runs): 28.9 s of CPU with <torch/extension.h>, 15.4 s with
// <ATen/ATen.h>, 7.0 s with this list; the same parse is paid again by the -O3 build of every
// kernel file.  (csrc/ops.cpp keeps <torch/extension.h>: it defines the pybind11 module.)
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

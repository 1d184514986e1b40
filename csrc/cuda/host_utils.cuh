// Host-side preamble shared by csrc/cuda/{hopfield,linear,softmax,sparse}.cu: the torch headers
// their host code needs, the declarations of their entry points (launch.h), and the small helpers
// each would otherwise write again (the shared-memory opt-in, raw 16-bit pointers).  No input
// checks: those run in g++-compiled code before an entry point is called (csrc/checks/, issue 10),
// and nothing here throws.
//
// Host code only.  tests/csrc/cuda_emulator/extract.py takes a kernel file's device code and the
// device part of the project headers it includes; it skips this one by name (HOST_ONLY_HEADERS
// there), so nothing defined here may be used by device code.  Include it first in a .cu: the
// C10_CUDA_NO_CMAKE_CONFIGURE_FILE switch below must come before any c10/cuda header.
#pragma once

// The CPU torch wheel (used by CI's compile check) does not ship this generated header; it only
// matters for Windows DLL exports, which c10/cuda/CUDAMacros.h lets us skip.  A CUDA wheel
// ships it and it is used.
#if defined(__has_include)
#if !__has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#define C10_CUDA_NO_CMAKE_CONFIGURE_FILE
#endif
#endif

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>

#include "launch.h"  // the entry points each .cu defines, and the limits its kernels must match
#include "../message.h"  // ATTNKIT_CHECK for the few internal invariants left in a .cu

namespace attnkit {
namespace {

// Lets `kernel` use `bytes` of dynamic shared memory (past the default 48 KiB needs the opt-in).
// Does not throw: a failure stays in CUDA's last-error slot (and the launch that needed it fails
// too), which the op's g++ caller raises (checks::raise_cuda_error).  The checks already made
// sure the device has the memory.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// The elements of a float16 / bfloat16 tensor as raw 16-bit words (the kernels' operand type).
inline const uint16_t* bits(const at::Tensor& x) { return static_cast<const uint16_t*>(x.data_ptr()); }
inline uint16_t* mutable_bits(at::Tensor& x) { return static_cast<uint16_t*>(x.data_ptr()); }

}  // namespace
}  // namespace attnkit

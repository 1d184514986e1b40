// Host-side preamble shared by csrc/cuda/{hopfield,linear,softmax,sparse}.cu: the torch headers
// their host code needs, and the small helpers each would otherwise write again (input checks,
// the compute-capability check, the shared-memory opt-in, raw 16-bit pointers).
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

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <tuple>

namespace attnkit {
namespace {

// q is a CUDA tensor and k, v sit on its device (fn names the op in the message).
inline void check_same_cuda_device(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.is_cuda(), fn, ": the cuda backend takes CUDA tensors; got q on ", q.device());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), fn, ": q, k, v must be on one device; got ",
              q.device(), ", ", k.device(), ", ", v.device());
}

// q is float16 or bfloat16 (the tensor-core kernels' inputs) and k, v share its dtype.
inline void check_16bit_dtypes(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, fn,
              ": the cuda kernels take float16 or bfloat16; got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), fn,
              ": q, k, v must share one dtype; got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
}

// x's device has compute capability >= 8.0 (mma.m16n8k16 on 16-bit operands).  `what` says
// what needs it, as the message's subject ("the cuda kernels", "float16 / bfloat16 inputs").
inline void check_sm80(const char* fn, const at::Tensor& x, const char* what) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device()));
  TORCH_CHECK(major >= 8, fn, ": ", what, " need compute capability 8.0 or newer (tensor-core mma.m16n8k16); got ",
              major, ".x");
}

// Lets `kernel` use `bytes` of dynamic shared memory (past the default 48 KiB needs the opt-in).
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// The elements of a float16 / bfloat16 tensor as raw 16-bit words (the kernels' operand type).
inline const uint16_t* bits(const at::Tensor& x) { return static_cast<const uint16_t*>(x.data_ptr()); }
inline uint16_t* mutable_bits(at::Tensor& x) { return static_cast<uint16_t*>(x.data_ptr()); }

}  // namespace
}  // namespace attnkit

// Output tensors on transparent huge pages (csrc/cpu/sparse.cpp's fused strided ops).  Tried on
// the dense softmax outputs too (session 5, B=1 H=8 N=4096 D=64 causal, one thread, CPU time,
// old and new build alternating in fresh processes): minor faults per forward+backward went from
// 228-3627 (depending on what glibc had kept from earlier calls) to 24, but the forward's CPU
// time from 85-87 to 89.5 ms (every call now zeroes fresh huge pages, where glibc sometimes
// handed back pages already mapped), so softmax.cpp keeps at::empty.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attnkit {
namespace {

// An uninitialized CPU tensor like at::empty, on transparent huge pages when >= 4 MiB (for large
// outputs, written once).  The first touch of each 4 KiB page is
// a page fault, here (a VM) about 1.5 us: allocating and filling an [8, 4096, 64] float32
// tensor took 3.0 ms, [8, 16384, 64] 12 ms, against 0.14 / 2.2 ms after madvise(MADV_HUGEPAGE)
// (THP "madvise" mode; one thread, median of 7).  2 MiB-aligned: at::empty's page-aligned
// block kept up to 2 MiB at each end on 4 KiB pages (~1500 faults, ~2 ms, per forward +
// backward at N = 4096, H = 8).  Measured on strided(64) B=1 H=8 D=64, one thread, CPU time:
// N = 16384 forward 75.8 -> 66 ms, backward 181 -> 143 ms.  Advisory: without THP nothing
// changes but the alignment.  Not kept (session 6): a cache of freed blocks reused for the next
// call (no kernel zeroing): the forward went from 10.8 to 11.6-11.9 ms at N = 4096 (the zeroed
// pages arrive in cache, reused ones are read for ownership from DRAM), the backward unchanged.
at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t(2) << 20;
  size_t n = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  for (const int64_t x : sizes) n *= static_cast<size_t>(x);
  if (n >= (size_t(4) << 20) && options.device().is_cpu()) {
    const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(kHuge, bytes);
    if (p != nullptr) {
      (void)madvise(p, bytes, MADV_HUGEPAGE);
      return at::from_blob(p, sizes, [](void* q) { std::free(q); }, options);
    }
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace
}  // namespace attnkit

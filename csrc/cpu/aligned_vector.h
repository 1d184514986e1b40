// avec<T>: std::vector on 64-byte (cache-line) boundaries, for the CPU kernels' scratch buffers.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace attnkit {

// Scratch buffers on 64-byte (cache-line) boundaries.  The GEMM tiles load 16 floats of a B row
// as two 32-byte vectors; glibc's malloc returns 16-byte aligned blocks (large ones at 16 mod
// 64, after mmap's header), so one of the two loads straddled two cache lines on every k.
// Measured on one core of an AMD EPYC Zen 3 (AVX2; /tmp microbenchmark of gemm<float>, L1-hot
// 64 x 256 x 64 and 64 x 64 x 256 tiles, best of 5): 84 -> 95 GF/s.
template <typename T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) noexcept {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const noexcept { return false; }
};
template <typename T>
using avec = std::vector<T, CacheAligned<T>>;

}  // namespace attnkit

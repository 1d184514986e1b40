// avec<T>: std::vector on 64-byte (cache-line) boundaries, for the CPU kernels' scratch buffers.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace attnkit {

namespace detail {

// A per-thread cache of the scratch blocks freed last, by exact size: a kernel called again on the
// same shapes gets its blocks back without malloc, free and -- for blocks glibc returns to the
// system when the heap's top grows past its trim threshold (128 KiB) -- the page faults of
// touching them anew.  Small calls paid for that: B=H=1 N=16 D=64 float32, the backward kernel
// call took 20 us against 5.6 us at N=0 (its scratch: nine 16 KiB blocks and the Di / lse rows),
// for ~2 us of arithmetic (Xeon with AMX, session 17).  Blocks over kMaxBytes are not kept; at
// most kSlots per thread (evicted round-robin), so a thread holds at most 4 MiB.
// Thread exit: thread_local scratch of the kernels (hopfield.cpp, linear.cpp) may be destroyed
// after the cache (thread_locals die in reverse order of construction, and the cache is built by
// their first allocation): scratch_cache_gone() -- a bool with no destructor, valid until the
// thread ends -- then sends their blocks straight to free (without it, a put into the destroyed
// cache freed a stale slot twice: test_concurrency's Python threads aborted).
inline bool& scratch_cache_gone() {
  thread_local bool gone = false;
  return gone;
}

class ScratchCache {
 public:
  static constexpr int kSlots = 16;
  static constexpr std::size_t kMaxBytes = std::size_t(256) << 10;
  ~ScratchCache() {
    scratch_cache_gone() = true;
    for (Slot& s : slots_) std::free(s.p);
  }
  void* take(std::size_t bytes) noexcept {
    for (Slot& s : slots_)
      if (s.p != nullptr && s.bytes == bytes) {
        void* p = s.p;
        s.p = nullptr;
        return p;
      }
    return nullptr;
  }
  // Keeps p (false: not kept, the caller frees it).
  bool put(void* p, std::size_t bytes) noexcept {
    if (bytes > kMaxBytes) return false;
    for (Slot& s : slots_)
      if (s.p == nullptr) {
        s.p = p;
        s.bytes = bytes;
        return true;
      }
    Slot& victim = slots_[next_victim_];
    next_victim_ = (next_victim_ + 1) % kSlots;
    std::free(victim.p);
    victim.p = p;
    victim.bytes = bytes;
    return true;
  }

 private:
  struct Slot {
    void* p = nullptr;
    std::size_t bytes = 0;
  };
  Slot slots_[kSlots];
  int next_victim_ = 0;
};

// This thread's cache, or nullptr once it is destroyed (thread exit).
inline ScratchCache* scratch_cache() {
  if (scratch_cache_gone()) return nullptr;
  thread_local ScratchCache cache;
  return &cache;
}

}  // namespace detail

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
    const std::size_t bytes = block_bytes(n);
    detail::ScratchCache* cache = detail::scratch_cache();
    void* p = cache != nullptr ? cache->take(bytes) : nullptr;
    if (p == nullptr) p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    detail::ScratchCache* cache = detail::scratch_cache();
    if (cache == nullptr || !cache->put(p, block_bytes(n))) std::free(p);
  }
  static std::size_t block_bytes(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    return bytes == 0 ? 64 : bytes;
  }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const noexcept { return false; }
};
template <typename T>
using avec = std::vector<T, CacheAligned<T>>;

}  // namespace attnkit

// Output tensors on transparent huge pages (csrc/cpu/sparse.cpp's fused strided ops and
// csrc/cpu/sparse_star.cpp's star forward).  Tried on
// the dense softmax outputs too (session 5, B=1 H=8 N=4096 D=64 causal, one thread, CPU time,
// old and new build alternating in fresh processes): minor faults per forward+backward went from
// 228-3627 (depending on what glibc had kept from earlier calls) to 24, but the forward's CPU
// time from 85-87 to 89.5 ms (every call now zeroes fresh huge pages, where glibc sometimes
// handed back pages already mapped), so softmax.cpp keeps at::empty.
#pragma once

#include <ATen/ATen.h>

#include <cstdlib>
#include <deque>
#include <iterator>
#include <mutex>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attnkit {

// Not in an anonymous namespace (unlike flash_tiles.h): every kernel file that includes this
// shares the one cache, so its bounds hold for the whole library.
//
// An uninitialized CPU tensor like at::empty, on transparent huge pages when >= 4 MiB (for large
// outputs, written once).  The first touch of each 4 KiB page is
// a page fault, here (a VM) about 1.5 us: allocating and filling an [8, 4096, 64] float32
// tensor took 3.0 ms, [8, 16384, 64] 12 ms, against 0.14 / 2.2 ms after madvise(MADV_HUGEPAGE)
// (THP "madvise" mode; one thread, median of 7).  2 MiB-aligned: at::empty's page-aligned
// block kept up to 2 MiB at each end on 4 KiB pages (~1500 faults, ~2 ms, per forward +
// backward at N = 4096, H = 8).  Measured on strided(64) B=1 H=8 D=64, one thread, CPU time:
// N = 16384 forward 75.8 -> 66 ms, backward 181 -> 143 ms.  Advisory: without THP nothing
// changes but the alignment.
//
// Freed blocks are kept for the next output of the same size (HugeBlockCache), as glibc keeps
// freed heap memory for at::empty: a fresh block's pages are zeroed by the kernel at first touch
// (clear_page_erms in perf).  Session 6, B=1 H=8 D=64 strided(64), one thread, CPU time, cache
// on / off alternating in one process: N = 4096 forward 9.20 -> 8.60 ms, backward 21.07 ->
// 19.62 ms; with a dense causal call between the calls (as bench/sparse_targets.py does) 9.14
// -> 8.66 and 19.93 -> 19.19 ms; N = 16384 forward 63.4 -> 61.1 ms.  Bounded: at most
// kCacheBlocks blocks and ATTNKIT_CPU_CACHE_MB MiB in all (default 256; 0 turns it off), the
// oldest freed first.  (Measured once in separate processes on the session-5 kernel, the
// forward looked slower with it, 10.8 -> 11.6 ms: not reproduced interleaved.)
class HugeBlockCache {
 public:
  static HugeBlockCache& get() {
    static HugeBlockCache* cache = new HugeBlockCache();  // never destroyed: deleters may run at exit
    return *cache;
  }
  // The most recently kept block of exactly `bytes` (the likeliest still in cache), or nullptr.
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
      if (it->second == bytes) {
        void* p = it->first;
        held_ -= bytes;
        blocks_.erase(std::next(it).base());
        return p;
      }
    return nullptr;
  }
  // Keeps the block, or frees it when it does not fit the bounds (evicting older ones first).
  void give(void* p, size_t bytes) {
    std::deque<void*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes > cap_) {
        drop.push_back(p);
      } else {
        while (!blocks_.empty() && (held_ + bytes > cap_ || blocks_.size() >= kCacheBlocks)) {
          drop.push_back(blocks_.front().first);
          held_ -= blocks_.front().second;
          blocks_.pop_front();
        }
        blocks_.emplace_back(p, bytes);
        held_ += bytes;
      }
    }
    for (void* q : drop) std::free(q);
  }

 private:
  static constexpr size_t kCacheBlocks = 8;
  HugeBlockCache() {
    const char* env = std::getenv("ATTNKIT_CPU_CACHE_MB");
    cap_ = (env != nullptr && *env != '\0' ? static_cast<size_t>(std::strtoull(env, nullptr, 10)) : size_t(256)) << 20;
  }
  std::mutex mu_;
  std::deque<std::pair<void*, size_t>> blocks_;  // oldest first
  size_t held_ = 0, cap_ = 0;
};

inline at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kHuge = size_t(2) << 20;
  size_t n = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  for (const int64_t x : sizes) n *= static_cast<size_t>(x);
  if (n >= (size_t(4) << 20) && options.device().is_cpu()) {
    const size_t bytes = (n + kHuge - 1) / kHuge * kHuge;
    void* p = HugeBlockCache::get().take(bytes);
    if (p == nullptr) {
      p = std::aligned_alloc(kHuge, bytes);
      if (p != nullptr) (void)madvise(p, bytes, MADV_HUGEPAGE);
    }
    if (p != nullptr)
      return at::from_blob(p, sizes, [bytes](void* q) { HugeBlockCache::get().give(q, bytes); }, options);
  }
#endif
  return at::empty(sizes, options);
}

}  // namespace attnkit

// Tasks on torch's intra-op (OpenMP) threads, handed out one at a time from a shared counter:
// the CPU kernel files' one way to run in parallel (hopfield.cpp, linear.cpp).
//
// Why a counter rather than at::parallel_for's fixed contiguous ranges: on the shared 2-core
// machines a descheduled thread otherwise holds up the whole call (Hopfield S=1, N=262144: 2
// threads with static ranges ran 2x slower than 1 thread while the load average was ~7; linear
// causal forward B=1 H=8 N=16384: wall time 58-84 ms a call for a steady 53-59 ms of CPU time).
// Why OpenMP threads rather than helper jobs on torch's inter-op pool (both files' earlier
// versions, which also avoided the OpenMP barrier): in a program that runs other torch ops, the
// OpenMP workers those leave spinning kept the inter-op helper off the second core.  Measured,
// 2 threads, interleaved in one process after an attnkit softmax call (inter-op -> OpenMP):
// Hopfield update S=256 N=4096 3 steps 2.91 -> 1.91 ms, S=1 N=65536 0.317 -> 0.197 ms, energy
// S=256 N=4096 0.96 -> 0.52 ms, S=1024 N=16384 7.4 -> 6.5 ms; linear causal forward N=128 0.168 -> 0.090 ms,
// N=2048 4.36 -> 2.22 ms, N=16384 23.1 -> 22.6 ms (session 7; linear.cpp has the full table).
//
// Anonymous namespace, as in flash_tiles.h: each kernel file keeps its own copy.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace attnkit {
namespace {

// body(task) for every task in [0, tasks).  Inside another parallel region at::parallel_for runs
// inline, so the calling thread then takes every task.
template <typename F>
void parallel_tasks(int64_t tasks, const F& body) {
  if (tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) body(t);
  });
}

}  // namespace
}  // namespace attnkit

// Host emulator for the device code of csrc/cuda/softmax.cu (see README.md).
//
// Build (extract.py writes kernels.inc, the kernels' text with the inline-PTX helpers removed):
//   g++ -std=c++20 -O1 -fno-strict-aliasing -shared -fPIC -I<dir of kernels.inc> harness.cpp -o libemu.so
// Optional: -DEMU_ONLY_F16_D64 (instantiate fp16 / head dim 64 only: a quick build),
//           -DEMU_USE_UCONTEXT (portable fiber switch instead of the x86-64 one).
//
// Model.  Every CUDA thread of a block is a fiber (its own stack) on the calling OS thread; a
// fiber runs until it waits at a barrier, so a block's threads interleave only at
// __syncthreads and at warp collectives (shuffle, ldmatrix, mma), which are the only places the
// kernels communicate.  The scheduler runs one warp at a time as far as it gets (to the next
// __syncthreads), in an order drawn per block and per pass from a seeded generator: a missing
// __syncthreads lets a warp overwrite or read a shared tile that another warp has not finished
// with or not yet written, and the result goes wrong.  (Hopper, harness_sm90.h: a thread whose
// arrival completes an mbarrier phase or a named barrier steps aside, and the threads that the
// completion releases run first: run_released_first.)  Warp collectives take the 32 lanes'
// registers, and the last lane to arrive computes the warp's result from the PTX ISA's rules:
//   ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8m .. 8m+7 give the row addresses
//     of 8x8 matrix m (16 bytes each, 16-byte aligned, in shared memory); register m of lane l
//     gets row l/4, elements 2(l%4), 2(l%4)+1 of matrix m (.trans: of the transposed matrix).
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: g = lane/4, t = lane%4;
//     A (16x16, 4 regs): element a_i (i = 0..7, reg i/2, low half first) is
//       A[g + 8*((i/2)%2)][2t + i%2 + 8*(i/4)];
//     B (16x8, 2 regs): b_i (i = 0..3) is B[2t + i%2 + 8*(i/2)][g];
//     C, D (16x8, 4 floats): c_i is C[g + 8*(i/2)][2t + i%2].  Products are exact in fp32
//     (16-bit operands), summed in fp32 in k order onto C.
//   shfl.sync.bfly (__shfl_xor_sync with a full mask): lane l reads lane l ^ laneMask.
//   ex2.approx.ftz.f32: exp2f with subnormal results flushed to zero.
// Shared memory is allocated at exactly the launch's size (16-byte aligned), filled with NaN
// (0xffff is NaN in fp16, bf16 and fp32) and followed by a canary that is checked after the
// block.  Every pointer of the device code is an emu::ptr (extract.py rewrites them): it carries
// the allocation it was made from (a registered global buffer, the block's shared memory, the
// thread's stack) and every access through it is checked against that allocation's bytes, its
// liveness and the type's alignment.  Errors (an out-of-bounds, misaligned or stray access, a
// bad ldmatrix address, divergent collectives, a deadlock, a clobbered canary) stop the launch;
// the entry points return nonzero and emu_last_error() says why, naming the thread, block and
// kernel.
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>
#if defined(EMU_USE_UCONTEXT) || !defined(__x86_64__)
#define EMU_UCONTEXT 1
#include <ucontext.h>
#endif

// ---------------------------------------------------------------------------------------------
// CUDA spellings the device code uses
// ---------------------------------------------------------------------------------------------

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// One OS thread runs every fiber, so plain globals do: the scheduler sets threadIdx before it
// resumes a fiber, the launch sets the others.
dim3 threadIdx, blockIdx, gridDim, blockDim;

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __half2 {
  __half x, y;  // x: low 16 bits
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __half __ushort_as_half(uint16_t bits) { return __half{bits}; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<uint32_t>(h.bits) << 16); }
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);  // round to nearest even
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return __nv_bfloat16{0x7fff};  // what cuda_bf16.hpp returns
  u += 0x7fffu + ((u >> 16) & 1u);                   // round to nearest even
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
using std::max;
using std::min;

// ---------------------------------------------------------------------------------------------
// fibers and the block scheduler
// ---------------------------------------------------------------------------------------------

namespace emu {

struct Fiber;

#ifndef EMU_UCONTEXT
extern "C" void emu_switch_stack(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl emu_switch_stack
  .hidden emu_switch_stack
  .type emu_switch_stack, @function
  .p2align 4
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, .-emu_switch_stack
)");
#endif

struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

enum Collective : int { kNone = 0, kShfl, kLdsm, kLdsmTrans, kMmaF16, kMmaBF16 };

// One warp collective's inputs and outputs.  Two of them alternate (by generation parity): a
// lane can be at most one collective ahead of the slowest lane, which may still be reading.
struct Exchange {
  int kind[32];
  float value[32];
  int lane_mask[32];
  const uint16_t* row[32];
  uint32_t a[32][4];
  uint32_t b[32][2];
  float c[32][4];
  uint32_t r_out[32][4];
  float f_out[32];
};

struct Warp {
  Barrier bar;
  Exchange ex[2];
};

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kCanaryBytes = 256;
constexpr unsigned kMaxThreads = 1024;

// An allocation that checked pointers (emu::ptr, below) point into: [lo, hi).  Global buffers are
// registered by the caller (emu_register_buffer: the tests' tensors) or a harness (its scratch,
// emu::Buffers); shared memory is the launch's block allocation; local memory a thread's stack.
struct Alloc {
  uintptr_t lo = 0, hi = 0;
  std::string name;
  const char* space = "global";
  bool live = false;              // false: freed (or the null / stray sentinel)
  mutable long long accesses = 0;  // checked accesses through pointers into it
};

// One cp.async of a thread that has not landed yet: its 16 bytes (read from global memory when it
// was issued), where they go, and the group it belongs to (the thread's number of commits at issue:
// the group the next commit closes).
struct AsyncCopy {
  unsigned char* dst;
  uint64_t group;
  unsigned char bytes[16];
};

struct Fiber {
  void* sp = nullptr;  // saved stack pointer (x86-64 switch)
#ifdef EMU_UCONTEXT
  ucontext_t ctx;
#endif
  char* stack = nullptr;  // kStackBytes + a guard page below
  unsigned tid = 0;
  bool done = false;
  const Barrier* wait_bar = nullptr;  // waiting until wait_bar->generation != wait_gen
  uint64_t wait_gen = 0;
  const char* wait_what = nullptr;
  Alloc local;  // its stack, the thread's local memory
  std::vector<AsyncCopy> copies;  // cp.async: issued, not landed
  uint64_t groups = 0;            // cp.async.commit_group calls so far
};

struct State {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier block_bar;
  uint16_t* smem = nullptr;
  size_t smem_bytes = 0;
  Fiber* current = nullptr;
  bool in_fiber = false;  // a kernel thread is running (not the harness's own code)
  const char* kernel = nullptr;  // the running launch's kernel, for messages
  void* scheduler_sp = nullptr;
#ifdef EMU_UCONTEXT
  ucontext_t scheduler_ctx;
#endif
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  bool failed = false;
  std::string error;
  uint64_t seed = 1;
  uint64_t rng = 0;        // the running block's schedule generator (from seed and blockIdx)
  unsigned finished = 0;   // threads of the running block that have exited
  // Threads that the running fiber has just released (an mbarrier phase or a named barrier it
  // completed): it steps aside, and the scheduler runs these first (run_released_first).
  std::vector<unsigned> released;
  int fault = 0;  // test hook: 1 = mma reads A's registers 1 and 2 swapped, 2 = ldmatrix ignores .trans (emu_configure)
  int mutant = 0;  // test hook: the switched mutation that is on (emu_build's `switched`; 0: none)
  long long collectives = 0;
  // checked pointers: the registered global buffers (stable addresses: deque), the live ones, the
  // block's shared memory, and two sentinels that every access fails against.
  std::deque<Alloc> buffers;
  std::vector<Alloc*> live_buffers;
  Alloc shared{0, 0, "shared memory", "shared"};
  Alloc null_alloc{0, 0, "a null pointer"};
  Alloc stray{0, 0, "no registered buffer"};
};
State S;

void to_scheduler() {
#ifdef EMU_UCONTEXT
  swapcontext(&S.current->ctx, &S.scheduler_ctx);
#else
  emu_switch_stack(&S.current->sp, S.scheduler_sp);
#endif
}

// Records the first error and parks the calling fiber for good (the launch is abandoned; the
// fibers' frames hold no resources).
[[noreturn]] void fail(const char* fmt, ...) {
  if (!S.failed) {
    char buf[512];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, args);
    va_end(args);
    S.failed = true;
    S.error = std::string(buf) + " (thread " + std::to_string(threadIdx.x) + " of block (" +
              std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " + std::to_string(blockIdx.z) +
              ")" + (S.kernel ? std::string(" of ") + S.kernel : std::string()) + ")";
  }
  for (;;) to_scheduler();
}

// Returns true in the last thread to arrive, before the others are released: it completes the
// collective.  The others come back once the generation has moved on.
bool arrive(Barrier& bar, const char* what) {
  const uint64_t gen = bar.generation;
  if (++bar.arrived == bar.expected) return true;
  Fiber* f = S.current;
  f->wait_bar = &bar;
  f->wait_gen = gen;
  f->wait_what = what;
  to_scheduler();
  return false;
}

void release(Barrier& bar) {
  bar.arrived = 0;
  ++bar.generation;
}

void fiber_main() {
  S.body(S.body_arg);
  S.current->done = true;
  to_scheduler();
  std::abort();  // a finished fiber is never resumed
}

#ifndef EMU_UCONTEXT
// x86-64: the first switch to a fiber pops six zero registers and "returns" into fiber_main,
// with the stack aligned as after a call.
void init_fiber(Fiber& f) {
  uintptr_t top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uintptr_t*>(top);
  *--sp = 0;                                          // fiber_main's return address (never used)
  *--sp = reinterpret_cast<uintptr_t>(&fiber_main);  // popped by ret
  for (int i = 0; i < 6; ++i) *--sp = 0;             // rbp rbx r12 r13 r14 r15
  f.sp = sp;
}
#else
void init_fiber(Fiber& f) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack;
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, &fiber_main, 0);
}
#endif

void resume(Fiber& f) {
  S.current = &f;
  threadIdx = dim3{f.tid, 0, 0};
  f.wait_bar = nullptr;
  S.in_fiber = true;
#ifdef EMU_UCONTEXT
  swapcontext(&S.scheduler_ctx, &f.ctx);
#else
  emu_switch_stack(&S.scheduler_sp, f.sp);
#endif
  S.in_fiber = false;
}

char* new_stack() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
  return static_cast<char*>(p) + page;
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool waiting(const Fiber& f) { return f.wait_bar != nullptr && f.wait_bar->generation == f.wait_gen; }

// The Hopper models (harness_sm90.h): their per-block state is reset before each block, and when
// every thread waits, their asynchronous operations still in flight (TMA loads) land before the
// scheduler calls it a deadlock (true: something landed, run on); blocked_detail() adds their
// barriers' state to a deadlock message.
namespace sm90 {
void begin_block(unsigned threads);
bool land_all();
std::string blocked_detail();
}  // namespace sm90

// The threads of the running block (0 .. blockDim.x - 1) that wait on `bar` in its generation
// `gen`, in thread order: those a completion of that generation releases.
std::vector<unsigned> waiters(const Barrier& bar, uint64_t gen) {
  std::vector<unsigned> out;
  for (unsigned t = 0; t < blockDim.x; ++t) {
    const Fiber& f = S.fibers[t];
    if (!f.done && f.wait_bar == &bar && f.wait_gen == gen) out.push_back(t);
  }
  return out;
}

// The release-first rule (README, "Hopper"): the running thread has just completed a barrier
// phase that `tids` waited for (an mbarrier arrival, a named barrier).  On a GPU the released
// threads may run at once, before the releasing thread's next instruction; the emulator takes
// that order, adversarially: the running thread steps aside and the scheduler runs the released
// threads as far as they get (until each blocks or exits; recursively, the threads that they in
// turn release first), then the releasing thread goes on.  So a stage released while its reader
// is still reading it (a wgmma not yet waited for) is overwritten under that reader.
void run_released_first(std::vector<unsigned> tids) {
  if (tids.empty() || !S.in_fiber || S.failed || S.fault == 6) return;  // fault 6: the rule off
  S.released = std::move(tids);
  to_scheduler();
}

void run_set(std::vector<unsigned> tids);

// Resumes f until it blocks, exits or steps aside; then runs the threads it released, if any.
void step(Fiber& f) {
  resume(f);
  if (f.done) ++S.finished;
  if (!S.released.empty() && !S.failed) {
    std::vector<unsigned> tids = std::move(S.released);
    S.released.clear();
    run_set(std::move(tids));
  }
}

// Runs the threads `tids` as far as they get: their warps in an order drawn from the block's
// generator, each warp's listed lanes until none of them moves, until no listed thread moves.
void run_set(std::vector<unsigned> tids) {
  std::vector<unsigned> warps;
  for (unsigned t : tids)
    if (warps.empty() || warps.back() != t / 32) warps.push_back(t / 32);
  for (size_t i = warps.size(); i > 1; --i) std::swap(warps[i - 1], warps[splitmix64(S.rng) % i]);
  for (bool any = true; any && !S.failed;) {
    any = false;
    for (unsigned w : warps) {
      for (bool moved = true; moved && !S.failed;) {
        moved = false;
        for (unsigned t : tids) {
          if (t / 32 != w) continue;
          Fiber& f = S.fibers[t];
          if (f.done || waiting(f)) continue;
          step(f);
          moved = any = true;
          if (S.failed) return;
        }
      }
    }
  }
}

void run_block(unsigned threads) {
  const unsigned nwarps = threads / 32;
  S.rng = S.seed ^ (0x51ed2701ull * (1 + blockIdx.x + 65536ull * (blockIdx.y + 65536ull * blockIdx.z)));
  S.released.clear();
  std::vector<unsigned> order(nwarps);
  for (unsigned w = 0; w < nwarps; ++w) order[w] = w;
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = S.fibers[t];
    f.tid = t;
    f.done = false;
    f.wait_bar = nullptr;
    f.copies.clear();  // (a copy left pending by the previous block's thread never lands)
    f.groups = 0;
    init_fiber(f);
  }
  S.finished = 0;
  while (S.finished < threads && !S.failed) {
    for (unsigned i = nwarps; i > 1; --i) std::swap(order[i - 1], order[splitmix64(S.rng) % i]);
    bool progressed = false;
    for (unsigned w : order) {
      // Run this warp as far as it gets: each sweep takes its lanes through one collective.
      for (bool moved = true; moved && !S.failed;) {
        moved = false;
        for (unsigned lane = 0; lane < 32 && !S.failed; ++lane) {
          Fiber& f = S.fibers[w * 32 + lane];
          if (f.done || waiting(f)) continue;
          step(f);
          moved = progressed = true;
        }
      }
      if (S.failed) return;
    }
    if (!progressed && S.finished < threads) {
      if (sm90::land_all()) continue;
      std::string where;
      for (unsigned t = 0; t < threads; ++t) {
        const Fiber& f = S.fibers[t];
        if (!f.done && where.size() < 200) where += " " + std::to_string(t) + ":" + (f.wait_what ? f.wait_what : "?");
      }
      S.failed = true;
      S.error = "deadlock in block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
                std::to_string(blockIdx.z) + ")" + (S.kernel ? std::string(" of ") + S.kernel : std::string()) +
                ": " + std::to_string(S.finished) + " of " + std::to_string(threads) +
                " threads exited, the others wait (thread:barrier):" + where + sm90::blocked_detail();
    }
  }
}

template <typename F>
void call_body(void* f) {
  (*static_cast<F*>(f))();
}

// Runs `kernel` (named `name` in messages) on every block of `grid`, blocks one after the other.
template <typename F>
bool launch(const char* name, dim3 grid, unsigned threads, size_t smem_bytes, F kernel) {
  if (S.failed) return false;
  if (threads == 0 || threads % 32 || threads > kMaxThreads) {
    S.failed = true;
    S.error = "launch: block size " + std::to_string(threads) + " is not a multiple of 32 in (0, 1024]";
    return false;
  }
  while (S.fibers.size() < threads) {
    S.fibers.emplace_back();
    S.fibers.back().stack = new_stack();
    if (!S.fibers.back().stack) {
      S.fibers.pop_back();
      S.failed = true;
      S.error = "launch: cannot map a fiber stack";
      return false;
    }
    const uintptr_t lo = reinterpret_cast<uintptr_t>(S.fibers.back().stack);
    S.fibers.back().local = Alloc{lo, lo + kStackBytes, "the thread's local memory (stack)", "local", true};
  }
  S.warps.assign(threads / 32, Warp{});
  const size_t alloc = (smem_bytes + kCanaryBytes + 15) / 16 * 16;
  auto* raw = static_cast<unsigned char*>(std::aligned_alloc(128, alloc));
  S.body = &call_body<F>;
  S.body_arg = &kernel;
  S.kernel = name;
  S.shared = Alloc{reinterpret_cast<uintptr_t>(raw), reinterpret_cast<uintptr_t>(raw) + smem_bytes,
                   "shared memory", "shared", smem_bytes > 0};
  gridDim = grid;
  blockDim = dim3{threads, 1, 1};
  for (unsigned z = 0; z < grid.z && !S.failed; ++z) {
    for (unsigned y = 0; y < grid.y && !S.failed; ++y) {
      for (unsigned x = 0; x < grid.x && !S.failed; ++x) {
        blockIdx = dim3{x, y, z};
        std::memset(raw, 0xff, smem_bytes);  // NaN in fp16, bf16 and fp32
        for (size_t i = smem_bytes; i < alloc; ++i) raw[i] = static_cast<unsigned char>(0xa5 ^ i);
        S.smem = smem_bytes ? reinterpret_cast<uint16_t*>(raw) : nullptr;
        S.smem_bytes = smem_bytes;
        S.block_bar = Barrier{static_cast<int>(threads), 0, 0};
        for (auto& w : S.warps) w.bar = Barrier{32, 0, 0};
        sm90::begin_block(threads);
        run_block(threads);
        for (size_t i = smem_bytes; i < alloc && !S.failed; ++i) {
          if (raw[i] != static_cast<unsigned char>(0xa5 ^ i)) {
            S.failed = true;
            S.error = "shared memory written past its end (byte " + std::to_string(i) + " of a " +
                      std::to_string(smem_bytes) + "-byte allocation) in block (" + std::to_string(x) + ", " +
                      std::to_string(y) + ", " + std::to_string(z) + ") of " + (name ? name : "?");
          }
        }
      }
    }
  }
  std::free(raw);
  S.smem = nullptr;
  S.shared.live = false;
  S.kernel = nullptr;
  return !S.failed;
}

// The warp collective protocol: deposit this lane's inputs in ex(gen), arrive; the last lane
// checks that every lane called the same collective, computes, releases; all read their output.
inline Warp& my_warp() { return S.warps[threadIdx.x / 32]; }
inline unsigned my_lane() { return threadIdx.x % 32; }

template <typename Compute>
Exchange& collective(int kind, const char* what, Compute&& compute, void (*deposit)(Exchange&, unsigned, const void*),
                     const void* in) {
  Warp& W = my_warp();
  const uint64_t gen = W.bar.generation;
  Exchange& ex = W.ex[gen & 1];
  const unsigned lane = my_lane();
  ex.kind[lane] = kind;
  deposit(ex, lane, in);
  if (arrive(W.bar, what)) {
    for (unsigned l = 0; l < 32; ++l) {
      if (ex.kind[l] != kind) fail("divergent warp: lane %u is at %s, lane %u at another collective", lane, what, l);
    }
    ++S.collectives;
    compute(ex);
    release(W.bar);
  }
  return ex;
}

// ---------------------------------------------------------------------------------------------
// checked pointers.  extract.py spells every pointer type of the device code `T*` as ptr<T>,
// every reinterpret_cast / const_cast to a pointer type as reinterpret_ptr / const_ptr_cast and
// every `&x` as addr(x), so the kernels hold no raw pointer: a ptr carries the allocation it was
// made from (found by address when it is made from a raw pointer: the harness's parameters, a
// local's address) through all arithmetic and casts, and every dereference checks that the
// accessed bytes lie inside that allocation, that the allocation is still live and that the
// address is aligned for the type (as the GPU requires).  The first violation stops the launch.
// ---------------------------------------------------------------------------------------------

// The allocation a raw pointer points into (or one past the end of): the running thread's stack,
// the block's shared memory, the most recently registered live buffer that holds it; else the
// null or the stray sentinel.
[[gnu::noinline]] inline Alloc* find_alloc(const void* raw) {
  if (raw == nullptr) return &S.null_alloc;
  const uintptr_t x = reinterpret_cast<uintptr_t>(raw);
  if (S.in_fiber) {
    const Alloc& l = S.current->local;
    if (x - l.lo < l.hi - l.lo) return &S.current->local;
  }
  if (S.shared.live && x - S.shared.lo <= S.shared.hi - S.shared.lo) return &S.shared;
  for (auto it = S.live_buffers.rbegin(); it != S.live_buffers.rend(); ++it) {
    if (x - (*it)->lo < (*it)->hi - (*it)->lo) return *it;
  }
  for (auto it = S.live_buffers.rbegin(); it != S.live_buffers.rend(); ++it) {
    if (x == (*it)->hi) return *it;
  }
  return &S.stray;
}

inline Alloc* register_buffer(const void* p, size_t bytes, std::string name) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p);
  S.buffers.push_back(Alloc{lo, lo + bytes, std::move(name), "global", true});
  S.live_buffers.push_back(&S.buffers.back());
  return &S.buffers.back();
}

inline void unregister_buffer(Alloc* a) {
  a->live = false;
  S.live_buffers.erase(std::remove(S.live_buffers.begin(), S.live_buffers.end(), a), S.live_buffers.end());
}

// A harness's own device-visible buffers (scratch such as softmax's delta, linear's chunk states,
// hopfield's split-N partials), registered while it lives.
class Buffers {
 public:
  Buffers() = default;
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    for (Alloc* a : list_) unregister_buffer(a);
  }
  template <typename T>
  void add(std::vector<T>& v, const char* name) {
    if (!v.empty()) list_.push_back(register_buffer(v.data(), v.size() * sizeof(T), name));
  }

 private:
  std::vector<Alloc*> list_;
};

// The failed check of an access of `bytes` at address x through a pointer into `a`: in a kernel
// thread, the launch's error (the thread is parked); in a harness's own code, the error is recorded
// and a scratch area is returned to access instead (the harness then stops at its next launch).
[[gnu::cold, gnu::noinline]] inline void* bad_access(const Alloc* a, uintptr_t x, size_t bytes, size_t align,
                                                     bool read) {
  char what[48];
  std::snprintf(what, sizeof what, "%s of %zu bytes", read ? "read" : "access (read or write)", bytes);
  const long long off = static_cast<long long>(x - a->lo);
  const long long size = static_cast<long long>(a->hi - a->lo);
  char where[160] = "";
  if (off < 0)
    std::snprintf(where, sizeof where, ": %lld bytes before its start", -off);
  else if (off + static_cast<long long>(bytes) > size)
    std::snprintf(where, sizeof where, ": %lld bytes past its end", off + static_cast<long long>(bytes) - size);
  char msg[512];
  if (a == &S.null_alloc)
    std::snprintf(msg, sizeof msg, "%s through a null pointer (address %#zx)", what, static_cast<size_t>(x));
  else if (a == &S.stray)
    std::snprintf(msg, sizeof msg, "%s at address %#zx, which is in no registered buffer", what,
                  static_cast<size_t>(x));
  else if (!a->live)
    std::snprintf(msg, sizeof msg, "%s in `%s` (%s memory) after it was freed", what, a->name.c_str(), a->space);
  else if (x % align != 0 && off >= 0 && off + static_cast<long long>(bytes) <= size)
    std::snprintf(msg, sizeof msg, "misaligned %s at byte offset %lld of `%s` (%s memory; needs %zu-byte alignment)",
                  what, off, a->name.c_str(), a->space, align);
  else
    std::snprintf(msg, sizeof msg, "out-of-bounds %s at byte offset %lld of `%s` (%s memory, %lld bytes%s)", what,
                  off, a->name.c_str(), a->space, size, where);
  if (S.in_fiber) fail("%s", msg);
  if (!S.failed) {
    S.failed = true;
    S.error = std::string(msg) + " (in the harness, outside a kernel)";
  }
  alignas(64) static unsigned char scratch[4096];
  return scratch;
}

struct ptr_root {
  const void* p_ = nullptr;
  Alloc* a_ = &S.null_alloc;
};

template <class T>
class ptr;

// ptr<T> derives from ptr<const T>: it converts to it implicitly, and template argument deduction
// sees through it (`const EA* a` deduces EA from a ptr<E>, as from an E*).
template <class T>
using ptr_base = std::conditional_t<std::is_const_v<T>, ptr_root, ptr<const T>>;

template <class T>
class ptr : public ptr_base<T> {
  static constexpr size_t kSize = sizeof(std::conditional_t<std::is_void_v<T>, char, T>);

 public:
  using element_type = T;

  ptr() = default;
  ptr(std::nullptr_t) {}
  ptr(T* raw) {  // NOLINT: implicit, as the harnesses assign their raw pointers to parameters
    this->p_ = raw;
    this->a_ = find_alloc(raw);
  }
  ptr(T* raw, Alloc* a) {
    this->p_ = raw;
    this->a_ = a;
  }
  // ptr<U> -> ptr<void>, ptr<const void> (as U* -> void*): implicit.
  template <class U, std::enable_if_t<std::is_convertible_v<U*, T*> && !std::is_base_of_v<ptr<T>, ptr<U>>, int> = 0>
  ptr(const ptr<U>& o) {  // NOLINT
    this->p_ = o.p_;
    this->a_ = o.a_;
  }
  // void* -> U* (static_cast): explicit.
  template <class U, std::enable_if_t<std::is_void_v<U> && (std::is_const_v<T> || !std::is_const_v<U>) &&
                                          !std::is_convertible_v<U*, T*>, int> = 0>
  explicit ptr(const ptr<U>& o) {
    this->p_ = o.p_;
    this->a_ = o.a_;
  }

  T* get() const { return static_cast<T*>(const_cast<void*>(this->p_)); }
  Alloc* alloc() const { return this->a_; }

  // The checked address of element i (as a U).
  template <class U>
  U* check(ptrdiff_t i) const {
    const Alloc* a = this->a_;
    const uintptr_t x = reinterpret_cast<uintptr_t>(this->p_) + static_cast<uintptr_t>(i) * sizeof(U);
    if (x - a->lo > a->hi - a->lo || a->hi - x < sizeof(U) || x % alignof(U) != 0 || !a->live) [[unlikely]]
      return static_cast<U*>(bad_access(a, x, sizeof(U), alignof(U), std::is_const_v<U>));
    ++a->accesses;
    return reinterpret_cast<U*>(x);
  }
  template <class U = T, std::enable_if_t<!std::is_void_v<U>, int> = 0>
  U& operator*() const {
    return *check<U>(0);
  }
  template <class U = T, std::enable_if_t<!std::is_void_v<U>, int> = 0>
  U* operator->() const {
    return check<U>(0);
  }
  template <class U = T, std::enable_if_t<!std::is_void_v<U>, int> = 0>
  U& operator[](ptrdiff_t i) const {
    return *check<U>(i);
  }

  ptr operator+(ptrdiff_t n) const { return ptr(offset(n), this->a_); }
  friend ptr operator+(ptrdiff_t n, const ptr& p) { return p + n; }
  ptr operator-(ptrdiff_t n) const { return ptr(offset(-n), this->a_); }
  ptr& operator+=(ptrdiff_t n) {
    this->p_ = offset(n);
    return *this;
  }
  ptr& operator-=(ptrdiff_t n) {
    this->p_ = offset(-n);
    return *this;
  }
  ptr& operator++() { return *this += 1; }
  ptr& operator--() { return *this -= 1; }
  ptr operator++(int) {
    ptr old = *this;
    *this += 1;
    return old;
  }
  ptr operator--(int) {
    ptr old = *this;
    *this -= 1;
    return old;
  }
  template <class U>
  ptrdiff_t operator-(const ptr<U>& o) const {
    return (reinterpret_cast<intptr_t>(this->p_) - reinterpret_cast<intptr_t>(o.p_)) / static_cast<ptrdiff_t>(kSize);
  }

  explicit operator bool() const { return this->p_ != nullptr; }
  bool operator==(std::nullptr_t) const { return this->p_ == nullptr; }
  template <class U>
  bool operator==(const ptr<U>& o) const {
    return this->p_ == o.p_;
  }
  template <class U>
  bool operator<(const ptr<U>& o) const {
    return this->p_ < o.p_;
  }
  template <class U>
  bool operator<=(const ptr<U>& o) const {
    return this->p_ <= o.p_;
  }
  template <class U>
  bool operator>(const ptr<U>& o) const {
    return this->p_ > o.p_;
  }
  template <class U>
  bool operator>=(const ptr<U>& o) const {
    return this->p_ >= o.p_;
  }

 private:
  // Address arithmetic on integers: a pointer may leave its allocation; only accesses are checked.
  T* offset(ptrdiff_t n) const {
    return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(this->p_) + static_cast<uintptr_t>(n) * kSize);
  }
};

template <class P, class U>
P reinterpret_ptr(const ptr<U>& p) {
  return P(reinterpret_cast<typename P::element_type*>(p.get()), p.alloc());
}
template <class P, class U>
P reinterpret_ptr(U* raw) {
  return P(reinterpret_cast<typename P::element_type*>(raw));
}
template <class P, class U>
P const_ptr_cast(const ptr<U>& p) {
  return P(const_cast<typename P::element_type*>(p.get()), p.alloc());
}
template <class T>
ptr<T> addr(T& x) {
  return ptr<T>(&x);
}
// The library functions the device code passes an address to (found by argument-dependent lookup).
inline float frexpf(float x, ptr<int> e) { return std::frexp(x, &*e); }
inline double frexp(double x, ptr<int> e) { return std::frexp(x, &*e); }

// 1 while switched mutation k is on (emu_set_mutant), else 0.
inline int mutant(int k) { return S.mutant == k; }

// The block's dynamic shared memory (the kernels' `extern __shared__` array).
inline ptr<uint16_t> shared_memory() { return ptr<uint16_t>(S.smem, S.smem ? &S.shared : &S.null_alloc); }

}  // namespace emu

inline void __syncthreads() {
  if (emu::arrive(emu::S.block_bar, "__syncthreads")) emu::release(emu::S.block_bar);
}

// atomicAdd on a float (softmax.cu's kBwdFused dQ): every fiber runs on the one OS thread and
// none is switched out inside this function, so a checked read-modify-write is atomic.  (The
// order of the additions follows the emulator's block and warp order; on a GPU it is not fixed.)
inline float atomicAdd(emu::ptr<float> address, float value) {
  float& x = *address;
  const float old = x;
  x = old + value;
  return old;
}

inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync with mask %#x: only full-warp shuffles are emulated", mask);
  struct In {
    float v;
    int m;
  } in{value, lane_mask};
  emu::Exchange& ex = emu::collective(
      emu::kShfl, "__shfl_xor_sync",
      [](emu::Exchange& e) {
        for (unsigned l = 0; l < 32; ++l) {
          const unsigned src = l ^ static_cast<unsigned>(e.lane_mask[l]);
          e.f_out[l] = src < 32 ? e.value[src] : e.value[l];
        }
      },
      [](emu::Exchange& e, unsigned l, const void* p) {
        e.value[l] = static_cast<const In*>(p)->v;
        e.lane_mask[l] = static_cast<const In*>(p)->m;
      },
      &in);
  return ex.f_out[emu::my_lane()];
}

// shfl.sync.idx of an int with a full mask (__shfl_sync(mask, v, src): every lane reads lane
// src's v), through the butterfly above: lane l reads lane l ^ (l ^ src).  The int's bits ride
// in the float (copied, never computed on).
inline int __shfl_sync(unsigned mask, int value, int src_lane) {
  float bits;
  std::memcpy(&bits, &value, sizeof bits);
  const float got = __shfl_xor_sync(mask, bits, static_cast<int>(emu::my_lane()) ^ src_lane);
  int out;
  std::memcpy(&out, &got, sizeof out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// the PTX helpers that extract.py removed, with the same signatures
// ---------------------------------------------------------------------------------------------

namespace attnkit {
namespace {

inline float exp2_approx(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;  // .ftz
}

inline float emu_bits_to_float(uint16_t bits, bool bf16) {
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

inline void emu_ldmatrix_x4(uint32_t (&r)[4], emu::ptr<const uint16_t> row_ptr, bool trans) {
  if (row_ptr.alloc() != &emu::S.shared)
    emu::fail("ldmatrix row address not in shared memory (it points into %s)", row_ptr.alloc()->name.c_str());
  ++row_ptr.alloc()->accesses;
  const uint16_t* row = row_ptr.get();
  const ptrdiff_t off = reinterpret_cast<intptr_t>(row) - reinterpret_cast<intptr_t>(emu::S.smem);  // bytes
  if (emu::S.smem == nullptr || off < 0 || static_cast<size_t>(off) + 16 > emu::S.smem_bytes)
    emu::fail("ldmatrix row address outside the block's %zu bytes of shared memory (byte offset %td)",
              emu::S.smem_bytes, off);
  if (off % 16 != 0) emu::fail("ldmatrix row address not 16-byte aligned (byte offset %td)", off);
  const bool transpose = trans && emu::S.fault != 2;
  emu::Exchange& ex = emu::collective(
      trans ? emu::kLdsmTrans : emu::kLdsm, trans ? "ldmatrix.x4.trans" : "ldmatrix.x4",
      [transpose](emu::Exchange& e) {
        for (unsigned l = 0; l < 32; ++l) {
          const unsigned g = l / 4, t = l % 4;
          for (unsigned m = 0; m < 4; ++m) {
            // element (i, j) of matrix m is e.row[8m + i][j]
            auto at = [&](unsigned i, unsigned j) { return e.row[8 * m + i][j]; };
            const uint16_t lo = transpose ? at(2 * t, g) : at(g, 2 * t);
            const uint16_t hi = transpose ? at(2 * t + 1, g) : at(g, 2 * t + 1);
            e.r_out[l][m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
          }
        }
      },
      [](emu::Exchange& e, unsigned l, const void* p) { e.row[l] = static_cast<const uint16_t*>(p); }, row);
  const unsigned lane = emu::my_lane();
  for (int m = 0; m < 4; ++m) r[m] = ex.r_out[lane][m];
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], emu::ptr<const uint16_t> row) {
  emu_ldmatrix_x4(r, row, false);
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], emu::ptr<const uint16_t> row) {
  emu_ldmatrix_x4(r, row, true);
}

template <bool kBF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct In {
    const float* c;
    const uint32_t* a;
    const uint32_t* b;
  } in{c, a, b};
  emu::Exchange& ex = emu::collective(
      kBF16 ? emu::kMmaBF16 : emu::kMmaF16, kBF16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16",
      [](emu::Exchange& e) {
        float A[16][16], B[16][8];
        auto half = [](uint32_t reg, int i) { return static_cast<uint16_t>(i % 2 ? reg >> 16 : reg & 0xffffu); };
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          uint32_t ra[4] = {e.a[l][0], e.a[l][1], e.a[l][2], e.a[l][3]};
          if (emu::S.fault == 1) std::swap(ra[1], ra[2]);
          for (int i = 0; i < 8; ++i)
            A[g + 8 * ((i / 2) % 2)][2 * t + i % 2 + 8 * (i / 4)] = emu_bits_to_float(half(ra[i / 2], i), kBF16);
          for (int i = 0; i < 4; ++i)
            B[2 * t + i % 2 + 8 * (i / 2)][g] = emu_bits_to_float(half(e.b[l][i / 2], i), kBF16);
        }
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
            float acc = e.c[l][i];
            for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
            e.c[l][i] = acc;
          }
        }
      },
      [](emu::Exchange& e, unsigned l, const void* p) {
        const In& v = *static_cast<const In*>(p);
        for (int i = 0; i < 4; ++i) e.a[l][i] = v.a[i], e.c[l][i] = v.c[i];
        for (int i = 0; i < 2; ++i) e.b[l][i] = v.b[i];
      },
      &in);
  const unsigned lane = emu::my_lane();
  for (int i = 0; i < 4; ++i) c[i] = ex.c[lane][i];
}

// cp.async.cg.shared.global [dst], [src], 16, cp.async.commit_group, cp.async.wait_group N
// (PTX ISA: the copies of one thread form groups at each commit; wait_group N returns once at
// most the N most recent groups are pending, and the copies of the others are then visible to
// the issuing thread; other threads need a barrier after that).  The emulation lands each copy as
// LATE as the ISA allows: at the first wait_group of its thread that covers its group, never
// before (not at a __syncthreads, not at the thread's end); from its issue until then its
// destination holds NaN (0xffff in fp16, bf16 and fp32), the bytes a too-early reader gets.  So a
// missing or too-weak wait reads NaN, as does a missing barrier between one thread's wait and
// another thread's read (the scheduler runs warps as far apart as barriers allow), and an issue
// into a tile that another warp still reads (no barrier between) NaN-fills it under that warp.
// The source is read (and bounds-checked: 16 bytes inside its global allocation, 16-byte
// aligned) at the issue; the destination must be 16 bytes inside the block's shared memory,
// 16-byte aligned.
inline void cp_async16(emu::ptr<uint16_t> dst, emu::ptr<const uint16_t> src) {
  if (dst.alloc() != &emu::S.shared && dst.alloc()->live)
    emu::fail("cp.async destination not in shared memory (it points into %s)", dst.alloc()->name.c_str());
  if (src.alloc() == &emu::S.shared || std::strcmp(src.alloc()->space, "local") == 0)
    emu::fail("cp.async source not in global memory (it points into %s)", src.alloc()->name.c_str());
  const uint4* from = src.template check<const uint4>(0);
  uint4* to = dst.template check<uint4>(0);
  emu::AsyncCopy c;
  c.dst = reinterpret_cast<unsigned char*>(to);
  c.group = emu::S.current->groups;
  std::memcpy(c.bytes, from, 16);
  std::memset(c.dst, 0xff, 16);
  emu::S.current->copies.push_back(c);
}

inline void cp_async_commit() { ++emu::S.current->groups; }

template <int kN>
inline void cp_async_wait() {
  static_assert(kN >= 0, "cp.async.wait_group takes a non-negative count");
  emu::Fiber& f = *emu::S.current;
  auto& copies = f.copies;
  size_t kept = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].group + kN < f.groups) {  // a committed group older than the kN most recent ones
      std::memcpy(copies[i].dst, copies[i].bytes, 16);
    } else {
      copies[kept++] = copies[i];
    }
  }
  copies.resize(kept);
}

}  // namespace
}  // namespace attnkit

// The Hopper (sm_90a) models: TMA, mbarriers, wgmma, setmaxnreg (csrc/cuda/sm90_ptx.cuh's helpers).
#include "harness_sm90.h"

// EMU_CORE_ONLY: the emulator alone (fibers, collectives, PTX helpers), for a harness of another
// kernel file that includes this one (sparse_harness.cpp); the softmax part below is left out.
#ifndef EMU_CORE_ONLY
#include "kernels.inc"

// ---------------------------------------------------------------------------------------------
// launches (what the host side of softmax.cu does after its checks and copies)
// ---------------------------------------------------------------------------------------------

namespace {
using namespace attnkit;

template <bool BF, int D>
bool fwd(const FwdParams& p, int B) {
  const dim3 grid{static_cast<unsigned>((p.N + kFwdBlockQ - 1) / kFwdBlockQ), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(B)};
  return emu::launch("softmax_fwd_kernel", grid, kFwdThreads, kFwdSmemBytes<D>, [p] { softmax_fwd_kernel<BF, D>(p); });
}

template <bool BF, int D>
bool bwd(const BwdParams& p, const uint16_t* out, const int64_t* os, const uint16_t* dout, const int64_t* dos,
         float* delta, int B) {
  const int64_t rows = int64_t(B) * p.H * p.N;
  if (rows > 0) {
    constexpr int kRowsPerBlock = 256 / 32;
    const dim3 grid{static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 1, 1};
    if (!emu::launch("softmax_bwd_delta_kernel", grid, 256, 0, [=] {
          softmax_bwd_delta_kernel<BF, D>(out, os[0], os[1], os[2], dout, dos[0], dos[1], dos[2], delta, p.H, p.N,
                                          rows);
        }))
      return false;
    const dim3 dq_grid{static_cast<unsigned>((p.N + kBlockQ - 1) / kBlockQ), static_cast<unsigned>(p.H),
                       static_cast<unsigned>(B)};
    if (!emu::launch("softmax_bwd_dq_kernel", dq_grid, kThreads, kDqSmemBytes<D>,
                     [p] { softmax_bwd_dq_kernel<BF, D>(p); }))
      return false;
  }
  if (int64_t(B) * p.Hk * p.M > 0) {
    const dim3 kv_grid{static_cast<unsigned>((p.M + kBlockK - 1) / kBlockK), static_cast<unsigned>(p.Hk),
                       static_cast<unsigned>(B)};
    if (!emu::launch("softmax_bwd_dkdv_kernel", kv_grid, kThreads, kDkdvSmemBytes<D>,
                     [p] { softmax_bwd_dkdv_kernel<BF, D>(p); }))
      return false;
  }
  return true;
}

// softmax.cu's launch_bwd_variant (the variants of ATTNKIT_CUDA_SOFTMAX_BWD; no mask): the
// per-row kernel into padded lse2 / delta2 (NaN-filled first: a row it missed poisons the
// result), then kBwdStream's dQ and dK/dV kernels, or kBwdFused's dK/dV + dQ into a zeroed fp32
// dq_accum and its conversion.
template <bool BF, int D>
bool bwd_variant(BwdParams p, int variant, const uint16_t* out, const int64_t* os, const uint16_t* dout,
                 const int64_t* dos, int B) {
  const int64_t n_pad = (int64_t(p.N) + 63) / 64 * 64;
  const int64_t rows = int64_t(B) * p.H * n_pad;
  std::vector<float> rows2(static_cast<size_t>(2 * rows), NAN);
  std::vector<float> dq_accum(variant == kBwdFused ? static_cast<size_t>(B) * p.H * p.N * D : 0, 0.f);
  emu::Buffers scratch;
  scratch.add(rows2, "lse2/delta2 (scratch)");
  if (variant == kBwdFused) scratch.add(dq_accum, "dq_accum (scratch)");
  p.lse2 = rows2.data();
  p.delta2 = rows2.data() + rows;
  p.n_pad = static_cast<int>(n_pad);
  p.dq_accum = dq_accum.data();
  if (rows > 0) {
    constexpr int kRowsPerBlock = 256 / 32;
    const dim3 grid{static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 1, 1};
    float* lse2 = rows2.data();
    if (!emu::launch("softmax_bwd_rows_kernel", grid, 256, 0, [=] {
          softmax_bwd_rows_kernel<BF, D>(out, os[0], os[1], os[2], dout, dos[0], dos[1], dos[2], p.lse, lse2,
                                         lse2 + rows, p.H, p.N, static_cast<int>(n_pad), rows);
        }))
      return false;
  }
  const dim3 kv_grid{static_cast<unsigned>((p.M + kBlockK - 1) / kBlockK), static_cast<unsigned>(p.Hk),
                     static_cast<unsigned>(B)};
  const bool any_keys = int64_t(B) * p.Hk * p.M > 0;
  if (variant == kBwdStream) {
    if (rows > 0) {
      const dim3 dq_grid{static_cast<unsigned>((p.N + kBlockQ - 1) / kBlockQ), static_cast<unsigned>(p.H),
                         static_cast<unsigned>(B)};
      if (!emu::launch("softmax_bwd_dq_kernel<stream>", dq_grid, kThreads, kDqSmemBytes<D>,
                       [p] { softmax_bwd_dq_kernel<BF, D, kBwdStream>(p); }))
        return false;
    }
    return !any_keys || emu::launch("softmax_bwd_dkdv_kernel<stream>", kv_grid, kThreads,
                                    kDkdvSmemBytes<D, kBwdStream>,
                                    [p] { softmax_bwd_dkdv_kernel<BF, D, kBwdStream>(p); });
  }
  if (any_keys && !emu::launch("softmax_bwd_dkdv_kernel<fused>", kv_grid, kThreads, kDkdvSmemBytes<D, kBwdFused>,
                               [p] { softmax_bwd_dkdv_kernel<BF, D, kBwdFused>(p); }))
    return false;
  const int64_t n = int64_t(B) * p.H * p.N * D;
  if (n == 0) return true;
  const int64_t blocks = std::min<int64_t>((n / 8 + 255) / 256, int64_t{1} << 16);
  return emu::launch("softmax_bwd_dq_convert_kernel", dim3{static_cast<unsigned>(blocks), 1, 1}, 256, 0,
                     [p, n] { softmax_bwd_dq_convert_kernel<BF>(p.dq_accum, p.dq, n, p.scale); });
}

// The backward variant of the next emu_softmax_bwd calls (emu_set_bwd_variant; BwdVariant).
int g_bwd_variant = kBwdDefault;

bool unsupported([[maybe_unused]] int bf16, int D) {
#ifdef EMU_ONLY_F16_D64
  if (bf16 || D != 64) {
    emu::S.failed = true;
    emu::S.error = "this build has only the fp16, D = 64 kernels (EMU_ONLY_F16_D64)";
    return true;
  }
#endif
  if (D != 64 && D != 128) {
    emu::S.failed = true;
    emu::S.error = "head dim " + std::to_string(D) + " not supported (64, 128)";
    return true;
  }
  return false;
}

template <template <bool, int> class Dispatch, typename... Args>
bool dispatch(int bf16, int D, Args&&... args) {
#ifdef EMU_ONLY_F16_D64
  (void)bf16, (void)D;
  return Dispatch<false, 64>::run(args...);
#else
  if (bf16) return D == 64 ? Dispatch<true, 64>::run(args...) : Dispatch<true, 128>::run(args...);
  return D == 64 ? Dispatch<false, 64>::run(args...) : Dispatch<false, 128>::run(args...);
#endif
}

template <bool BF, int D>
struct Fwd {
  static bool run(const FwdParams& p, int B) { return fwd<BF, D>(p, B); }
};
template <bool BF, int D>
struct Bwd {
  static bool run(const BwdParams& p, const uint16_t* out, const int64_t* os, const uint16_t* dout,
                  const int64_t* dos, float* delta, int B) {
    // As softmax_bwd_cuda: the variants compute no mask, so a masked call takes the default kernels.
    if (g_bwd_variant != kBwdDefault && p.mask.kind == kNoMask) return bwd_variant<BF, D>(p, g_bwd_variant, out, os, dout, dos, B);
    return bwd<BF, D>(p, out, os, dout, dos, delta, B);
  }
};

Mask make_mask(const void* mask, int kind, const int64_t* ms) { return Mask{mask, kind, ms[0], ms[1], ms[2], ms[3]}; }

void begin() {
  emu::S.failed = false;
  emu::S.error.clear();
}
}  // namespace

// Strides are in elements ([b, h, n] for q/k/v/out/dout, [b, h, n, m] for the mask), 0 where a
// dim has size 1; rows must be contiguous and 16-byte aligned (the host side copies otherwise).
// out, lse, dq, dk, dv are contiguous.  Return 0 on success, else see emu_last_error().
extern "C" int emu_softmax_fwd(int bf16, int D, const uint16_t* q, const int64_t* qs, const uint16_t* k,
                               const int64_t* ks, const uint16_t* v, const int64_t* vs, uint16_t* out, float* lse,
                               const void* mask, int mask_kind, const int64_t* ms, int B, int H, int Hk, int N, int M,
                               float scale, int causal) {
  begin();
  if (unsupported(bf16, D)) return 1;
  FwdParams p;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse = lse;
  p.q_sb = qs[0], p.q_sh = qs[1], p.q_sn = qs[2];
  p.k_sb = ks[0], p.k_sh = ks[1], p.k_sn = ks[2];
  p.v_sb = vs[0], p.v_sh = vs[1], p.v_sn = vs[2];
  p.mask = make_mask(mask, mask_kind, ms);
  p.H = H, p.group = Hk ? H / Hk : 0, p.N = N, p.M = M;
  p.scale_log2 = scale * kLog2e;
  p.causal = causal;
  if (B == 0 || H == 0 || N == 0) return 0;
  return dispatch<Fwd>(bf16, D, p, B) ? 0 : 1;
}

extern "C" int emu_softmax_bwd(int bf16, int D, const uint16_t* dout, const int64_t* dos, const uint16_t* q,
                               const int64_t* qs, const uint16_t* k, const int64_t* ks, const uint16_t* v,
                               const int64_t* vs, const uint16_t* out, const int64_t* os, const float* lse,
                               uint16_t* dq, uint16_t* dk, uint16_t* dv, const void* mask, int mask_kind,
                               const int64_t* ms, int B, int H, int Hk, int N, int M, float scale, int causal) {
  begin();
  if (unsupported(bf16, D)) return 1;
  std::vector<float> delta(static_cast<size_t>(B) * H * N, NAN);
  emu::Buffers scratch;
  scratch.add(delta, "delta (scratch)");
  BwdParams p;
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.lse = lse, p.delta = delta.data();
  p.dq = dq, p.dk = dk, p.dv = dv;
  p.q_sb = qs[0], p.q_sh = qs[1], p.q_sn = qs[2];
  p.k_sb = ks[0], p.k_sh = ks[1], p.k_sn = ks[2];
  p.v_sb = vs[0], p.v_sh = vs[1], p.v_sn = vs[2];
  p.do_sb = dos[0], p.do_sh = dos[1], p.do_sn = dos[2];
  p.mask = make_mask(mask, mask_kind, ms);
  p.H = H, p.Hk = Hk, p.group = Hk ? H / Hk : 0, p.N = N, p.M = M;
  p.scale = scale, p.scale_log2 = scale * kLog2e, p.causal = causal;
  if (B == 0 || (H == 0 && Hk == 0)) return 0;
  return dispatch<Bwd>(bf16, D, p, out, os, dout, dos, delta.data(), B) ? 0 : 1;
}

#endif  // EMU_CORE_ONLY

extern "C" const char* emu_last_error() { return emu::S.error.c_str(); }

#ifndef EMU_CORE_ONLY
// softmax.cu's backward variant for the next emu_softmax_bwd calls (the values of BwdVariant,
// as ATTNKIT_CUDA_SOFTMAX_BWD picks them on a GPU: 0 default, 1 stream, 2 fused).
extern "C" void emu_set_bwd_variant(int variant) { g_bwd_variant = variant; }
#endif  // EMU_CORE_ONLY

// seed: the warp order of the scheduler; fault: a test hook that breaks the emulated hardware
// (0 = none, 1 = mma's A layout, 2 = ldmatrix's .trans; harness_sm90.h: 3 = TMA ignores the
// 128-byte swizzle, 4 = wgmma reads B with imm-trans-b flipped, 5 = wgmma's accumulator rows g and
// g + 8 swapped; 6 = the scheduler's release-first rule off) to show that the tests notice.
extern "C" void emu_configure(uint64_t seed, int fault) {
  emu::S.seed = seed;
  emu::S.fault = fault;
}

extern "C" long long emu_collectives() { return emu::S.collectives; }

// k: the switched mutation to turn on in a build that holds them (tests/csrc/cuda_emulator/
// emu_build.py, `switched`); 0: none.
extern "C" void emu_set_mutant(int k) { emu::S.mutant = k; }

// The buffer registry of the checked pointers (emu::ptr): the caller registers every buffer it
// passes to an entry point (`bytes` from p on; `name` appears in the error messages), and clears
// them once the call is done.  The harnesses register their own scratch while it lives.
extern "C" void emu_register_buffer(const void* p, size_t bytes, const char* name) {
  emu::register_buffer(p, bytes, name);
}
extern "C" void emu_clear_buffers() {
  emu::S.live_buffers.clear();
  emu::S.buffers.clear();
}
// Every buffer registered since the last emu_clear_buffers, in order (the harnesses' included):
// its name and the number of checked accesses to it.
extern "C" int emu_buffer_count() { return static_cast<int>(emu::S.buffers.size()); }
extern "C" const char* emu_buffer_name(int i) { return emu::S.buffers[static_cast<size_t>(i)].name.c_str(); }
extern "C" long long emu_buffer_accesses(int i) { return emu::S.buffers[static_cast<size_t>(i)].accesses; }

#ifndef EMU_CORE_ONLY
// The values of softmax.cu's MaskKind, in the order none, bool, f32, f16, bf16, f64.
extern "C" void emu_mask_kinds(int* kinds) {
  const int k[6] = {kNoMask, kBoolMask, kF32Mask, kF16Mask, kBF16Mask, kF64Mask};
  std::memcpy(kinds, k, sizeof k);
}
#endif  // EMU_CORE_ONLY

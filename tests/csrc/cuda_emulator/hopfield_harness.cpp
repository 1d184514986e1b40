// Host emulator for the device code of csrc/cuda/hopfield.cu: the emulator of harness.cpp (fibers,
// NaN-filled shared memory, seeded warp order; see README.md), the warp / block collectives that
// hopfield.cu uses beyond harness.cpp's (__shfl_sync, __any_sync, __syncwarp, __syncthreads_or),
// the Hopfield kernels as extract.py cuts them out of hopfield.cu (no PTX helpers: SIMT float32),
// and their launches re-created from what hopfield.cu's host side does after its checks (same
// grids, same rows per warp, same shared-memory size: smem_bytes<RPW> of the device part, the same
// split-N chunking given the SM count).
//
// Build (`python extract.py csrc/cuda/hopfield.cu <dir>/hopfield_kernels.inc` writes the include):
//   g++ -std=c++20 -O1 -fno-strict-aliasing -shared -fPIC -I<dir> hopfield_harness.cpp -o libemu.so
// Optional: -DEMU_ONLY_F32 (float32 kernels only: a quicker build, for the test's mutants).
#define EMU_CORE_ONLY
#include "harness.cpp"

#include <cmath>

#define __host__
using std::isnan;  // CUDA declares isnan(float) globally

// What the device code uses of c10's 16-bit types: conversion to float (to_float's static_cast).
namespace c10 {
struct Half {
  uint16_t x;
  operator float() const { return __half2float(__half{x}); }
};
struct BFloat16 {
  uint16_t x;
  operator float() const { return __bfloat162float(__nv_bfloat16{x}); }
};
}  // namespace c10

// ---------------------------------------------------------------------------------------------
// the collectives hopfield.cu adds (full-warp masks only, like harness.cpp's __shfl_xor_sync)
// ---------------------------------------------------------------------------------------------

namespace emu {
// Kinds past harness.cpp's Collective values, so a lane at another collective is reported.
constexpr int kShflIdx = 100, kAny = 101, kSyncWarp = 102;

inline void full_mask(unsigned mask, const char* what) {
  if (mask != 0xffffffffu) fail("%s with mask %#x: only full-warp collectives are emulated", what, mask);
}

// __syncthreads_or: each thread ORs its predicate into the slot of the barrier's generation
// (two slots by parity, each tagged with its generation and cleared by the first thread of a new
// one: every thread has read a slot's result before any thread arrives two barriers later).  The
// block is part of the tag (the generation restarts at 0 in every block), and hop_launch clears
// both slots (the next launch's blocks start over).
struct OrSlot {
  uint64_t gen = ~0ull;
  unsigned bx = ~0u, by = ~0u, bz = ~0u;
  int value = 0;
  bool is(uint64_t g) const { return gen == g && bx == blockIdx.x && by == blockIdx.y && bz == blockIdx.z; }
};
OrSlot block_or[2];
}  // namespace emu

inline float __shfl_sync(unsigned mask, float value, int src_lane) {
  emu::full_mask(mask, "__shfl_sync");
  struct In {
    float v;
    int src;
  } in{value, src_lane};
  emu::Exchange& ex = emu::collective(
      emu::kShflIdx, "__shfl_sync",
      [](emu::Exchange& e) {
        for (unsigned l = 0; l < 32; ++l) e.f_out[l] = e.value[static_cast<unsigned>(e.lane_mask[l]) % 32];
      },
      [](emu::Exchange& e, unsigned l, const void* p) {
        e.value[l] = static_cast<const In*>(p)->v;
        e.lane_mask[l] = static_cast<const In*>(p)->src;
      },
      &in);
  return ex.f_out[emu::my_lane()];
}

inline int __any_sync(unsigned mask, int pred) {
  emu::full_mask(mask, "__any_sync");
  emu::Exchange& ex = emu::collective(
      emu::kAny, "__any_sync",
      [](emu::Exchange& e) {
        int any = 0;
        for (unsigned l = 0; l < 32; ++l) any |= e.lane_mask[l] != 0;
        for (unsigned l = 0; l < 32; ++l) e.f_out[l] = static_cast<float>(any);
      },
      [](emu::Exchange& e, unsigned l, const void* p) { e.lane_mask[l] = *static_cast<const int*>(p); }, &pred);
  return ex.f_out[emu::my_lane()] != 0.f;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::full_mask(mask, "__syncwarp");
  emu::collective(
      emu::kSyncWarp, "__syncwarp", [](emu::Exchange&) {}, [](emu::Exchange&, unsigned, const void*) {}, nullptr);
}

inline int __syncthreads_or(int pred) {
  emu::Barrier& bar = emu::S.block_bar;
  const uint64_t gen = bar.generation;
  emu::OrSlot& slot = emu::block_or[gen & 1];
  if (!slot.is(gen)) slot = emu::OrSlot{gen, blockIdx.x, blockIdx.y, blockIdx.z, 0};
  slot.value |= pred != 0;
  if (emu::arrive(bar, "__syncthreads_or")) emu::release(bar);
  return slot.value;
}

#include "hopfield_kernels.inc"

namespace {
using namespace attnkit;

struct Args {
  int64_t BH, S, N;
  int D, Dv, steps, has_tol, has_values, final_state, split, sms;
  float beta, tol;
};

// hopfield.cu's dispatch_rpw.
template <typename F>
bool with_rpw(int64_t S, F&& f) {
  if (S <= 8) return f(std::integral_constant<int, 1>{});
  if (S <= 16) return f(std::integral_constant<int, 2>{});
  return f(std::integral_constant<int, 4>{});
}

template <typename F>
bool hop_launch(const char* name, dim3 grid, size_t smem, F kernel) {
  emu::block_or[0] = emu::block_or[1] = emu::OrSlot{};
  return emu::launch(name, grid, kThreads, smem, kernel);
}

std::vector<float> scratch(size_t n) { return std::vector<float>(n, NAN); }

// hopfield_update_fwd_cuda after its checks and allocations (S, BH > 0).
template <typename T>
bool update(const Args& a, const void* state, const void* X, const void* V, float* out, float* states, float* lse,
            bool* applied) {
  const int64_t R = a.steps, U = a.has_values ? a.steps - 1 : a.steps;
  const int64_t plane = a.BH * a.S;
  if (a.has_values && !a.final_state) std::fill_n(states + a.steps * plane * a.D, plane * a.D, 0.f);
  Params<T> p;
  p.state = static_cast<const T*>(state);
  p.X = static_cast<const T*>(X);
  p.V = a.has_values ? static_cast<const T*>(V) : nullptr;
  p.out = out, p.states = states, p.lse = lse, p.applied = applied;
  p.BH = a.BH, p.S = a.S, p.N = a.N;
  p.D = a.D, p.Dv = a.has_values ? a.Dv : a.D, p.R = static_cast<int>(R), p.U = static_cast<int>(U);
  p.beta2 = a.beta * kLog2e;
  p.has_tol = a.has_tol;
  p.tol = a.has_tol ? a.tol : 0.f;
  p.has_values = a.has_values;
  p.final_state = a.has_values && a.final_state;
  return with_rpw(a.S, [&](auto rpw_c) {
    constexpr int RPW = decltype(rpw_c)::value;
    constexpr int kRows = 8 * RPW;
    const size_t smem = smem_bytes<RPW>(p.D, p.Dv, a.has_values);
    if (!a.split) {
      const dim3 grid{static_cast<unsigned>(ceil_div(a.S, kRows)), static_cast<unsigned>(a.BH), 1};
      return hop_launch("update_fused_kernel", grid, smem, [p] { update_fused_kernel<T, RPW>(p); });
    }
    // states[0] = state (the host's copy_, converting to float32).
    for (int64_t e = 0; e < plane * a.D; ++e) states[e] = to_float(p.state[e]);
    const int64_t target = std::max<int64_t>(1, (4 * a.sms) / a.BH);
    const int64_t chunk = std::max<int64_t>(8 * kBN, ceil_div(ceil_div(a.N, target), kBN) * kBN);
    Partials q;
    q.chunk = chunk;
    q.splits = static_cast<int>(ceil_div(a.N, chunk));
    q.W = std::max(p.D, p.Dv);
    std::vector<float> pm = scratch(a.BH * q.splits * kRows), pl = scratch(a.BH * q.splits * kRows);
    std::vector<float> pacc = scratch(a.BH * q.splits * kRows * q.W);
    std::vector<float> paccx = scratch(p.final_state ? a.BH * q.splits * kRows * a.D : 1);
    std::vector<int8_t> active(plane, 1);
    emu::Buffers buffers;
    buffers.add(pm, "m (split-N partial maxima, scratch)");
    buffers.add(pl, "l (split-N partial sums, scratch)");
    buffers.add(pacc, "acc (split-N partial outputs, scratch)");
    buffers.add(paccx, "accx (split-N partial states, scratch)");
    buffers.add(active, "active (split-N row flags, scratch)");
    q.m = pm.data(), q.l = pl.data(), q.acc = pacc.data(), q.accx = paccx.data(), q.active = active.data();
    for (int k = 0; k < static_cast<int>(R); ++k) {
      const dim3 pgrid{static_cast<unsigned>(q.splits), static_cast<unsigned>(a.BH), 1};
      const bool launched = split_partial_wants_x(p, k)
                                ? hop_launch("split_partial_kernel", pgrid, smem,
                                             [p, q, k] { split_partial_kernel<T, RPW, true>(p, q, k); })
                                : hop_launch("split_partial_kernel", pgrid, smem,
                                             [p, q, k] { split_partial_kernel<T, RPW, false>(p, q, k); });
      if (!launched) return false;
      const dim3 mgrid{static_cast<unsigned>(a.BH), 1, 1};
      if (!hop_launch("split_merge_kernel", mgrid, smem, [p, q, k] { split_merge_kernel<T, RPW>(p, q, k); }))
        return false;
    }
    return true;
  });
}

template <typename T>
bool energy(const Args& a, const void* state, const void* X, float* e, float* lse) {
  return with_rpw(a.S, [&](auto rpw_c) {
    constexpr int RPW = decltype(rpw_c)::value;
    const size_t smem = smem_bytes<RPW>(a.D, a.D, false);
    const dim3 grid{static_cast<unsigned>(ceil_div(a.S, 8 * RPW)), static_cast<unsigned>(a.BH), 1};
    const T* st = static_cast<const T*>(state);
    const T* x = static_cast<const T*>(X);
    const Args b = a;
    return hop_launch("energy_kernel", grid, smem,
                       [=] { energy_kernel<T, RPW>(st, x, e, lse, b.S, b.N, b.D, b.beta); });
  });
}

// dtype: 0 float32, 1 float16, 2 bfloat16.
template <typename F>
bool by_dtype(int dtype, F&& f) {
  switch (dtype) {
    case 0: return f(float{});
#ifndef EMU_ONLY_F32
    case 1: return f(c10::Half{});
    case 2: return f(c10::BFloat16{});
#endif
    default:
      emu::S.failed = true;
      emu::S.error = "dtype " + std::to_string(dtype) + " not built";
      return false;
  }
}

bool start() {
  emu::S.failed = false;
  emu::S.error.clear();
  return true;
}

}  // namespace

// dims: BH, S, N, D, Dv, steps, has_tol, has_values, final_state, split, sms.
extern "C" int emu_hopfield_update(int dtype, const int64_t* dims, float beta, float tol, const void* state,
                                   const void* X, const void* V, float* out, float* states, float* lse,
                                   bool* applied) {
  start();
  Args a{dims[0], dims[1], dims[2], static_cast<int>(dims[3]), static_cast<int>(dims[4]), static_cast<int>(dims[5]),
         static_cast<int>(dims[6]), static_cast<int>(dims[7]), static_cast<int>(dims[8]), static_cast<int>(dims[9]),
         static_cast<int>(dims[10]), beta, tol};
  return by_dtype(dtype, [&](auto t) { return update<decltype(t)>(a, state, X, V, out, states, lse, applied); }) ? 0
                                                                                                                 : 1;
}

// dims: BH, S, N, D.
extern "C" int emu_hopfield_energy(int dtype, const int64_t* dims, float beta, const void* state, const void* X,
                                   float* e, float* lse) {
  start();
  Args a{dims[0], dims[1], dims[2], static_cast<int>(dims[3]), 0, 0, 0, 0, 0, 0, 0, beta, 0.f};
  return by_dtype(dtype, [&](auto t) { return energy<decltype(t)>(a, state, X, e, lse); }) ? 0 : 1;
}

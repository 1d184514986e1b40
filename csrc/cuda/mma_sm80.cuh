// Tensor-core building blocks shared by the CUDA C++ kernels (softmax.cu, sparse.cu, linear.cu):
// the inline-PTX helpers (ex2.approx, mma.sync.m16n8k16 f16/bf16, ldmatrix.x4 [.trans], cp.async
// with its groups; sm_80+),
// the 16-bit element helpers they work with, and the m16n8k16 fragment loaders.
//
// One copy on purpose: tests/csrc/cuda_emulator/extract.py inlines this file into the device
// code it cuts out of a .cu file, removes the seven PTX helpers after checking that they still
// issue the PTX (and operand order) the emulator models, and the emulated tests run the rest as
// written.  Change a PTX helper here and the extractor refuses until harness.cpp's emulation has
// been re-checked against the PTX ISA.
//
// Include it at the top of a .cu (`#include "mma_sm80.cuh"`); the definitions are in
// attnkit's unnamed namespace, like the kernels that use them (internal linkage per .cu, as
// before they were shared).  Everything here is header-only: no kernel, no host code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnkit {
namespace {

// ---------------------------------------------------------------------------------------------
// element helpers (16-bit values are handled as raw bits; only conversions know the dtype)
// ---------------------------------------------------------------------------------------------

// Two floats rounded to the input dtype, packed as one 32-bit register: `lo` in the low half
// (the element with the smaller column index, as the mma fragments want it).
template <bool kBF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <bool kBF16>
__device__ __forceinline__ float to_float(uint16_t bits) {
  if constexpr (kBF16) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

// 2^x (ex2.approx: ~2 ulp; 2^-inf = +0, which the masking relies on).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// tensor-core primitives (PTX ISA, mma.m16n8k16 with .f16/.bf16; g = lane / 4, t = lane % 4):
//   A 16x16: reg0 = A[g][2t..2t+1], reg1 = A[g+8][2t..], reg2 = A[g][2t+8..], reg3 = A[g+8][2t+8..]
//   B 16x8 : reg0 = B[2t..2t+1][g],  reg1 = B[2t+8..2t+9][g]
//   C 16x8 : c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
// ---------------------------------------------------------------------------------------------

// c += a · b for one m16n8k16 tile (a: 16x16 row-major fragment, b: 16x8 column fragment).
template <bool kBF16>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  // Never launched: every host side checks compute capability >= 8.0 before taking this path.
  __trap();
#endif
}

// ldmatrix.x4: lanes 8m .. 8m+7 give the row addresses (16 bytes each) of 8x8 matrix m; register
// m of lane l receives row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of matrix m (.trans: the
// elements [2 (l % 4)][l / 4] and [2 (l % 4) + 1][l / 4], i.e. of the transposed matrix).
// asm volatile: must stay between the __syncthreads that guard the shared tiles.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---------------------------------------------------------------------------------------------
// cp.async (sm_80+): asynchronous 16-byte copies global -> shared, in per-thread groups.
//   cp.async.cg.shared.global [dst], [src], 16: both addresses 16-byte aligned; .cg caches in L2
//     only (each K/V tile is read once per block).  The copy lands at some time between its
//     issue and the wait_group that covers it;
//   cp.async.commit_group: closes this thread's copies issued since the last commit into a group
//     (an empty group if there are none);
//   cp.async.wait_group N: waits until at most the N most recent of this thread's groups are
//     still pending, i.e. every older group's copies have landed -- visible to this thread only:
//     other threads see them after a __syncthreads that follows the wait.
// (tests/csrc/cuda_emulator/harness.cpp models exactly this: a copy fills its destination with
// NaN when issued and lands only at a wait_group that covers its group.)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint16_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" : : "r"(addr), "l"(src) : "memory");
#else
  __trap();  // never launched below compute capability 8.0 (see mma16816)
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" : : : "memory");
#endif
}

template <int kN>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" : : "n"(kN) : "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// fragment loaders (softmax.cu, sparse.cu).  Shared-memory tiles are row-major with leading
// dimension kLd (elements).  All three read 8x8 matrices with one ldmatrix.x4; the rows of a
// tile must be 16-byte aligned (kLd · 2 bytes a multiple of 16, column offsets multiples of 8
// elements); 8 elements of row padding put the 8 rows of one matrix on 8 different 4-bank groups.
// ---------------------------------------------------------------------------------------------

// A = tile[r0 .. r0+15][c0 .. c0+15].  Matrices: 0 = rows r0.., cols c0..; 1 = rows r0+8..;
// 2 = cols c0+8..; 3 = both (registers a[0..3] of the A layout, in that order).
template <int kLd>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const uint16_t* tile, int r0, int c0, int lane) {
  const int row = r0 + lane % 8 + ((lane / 8) % 2) * 8;
  const int col = c0 + (lane / 16) * 8;
  ldsm_x4(a, tile + row * kLd + col);
}

// Two B fragments for n-tiles n0 and n0 + 8, where B[k][n] = tile[n + n][k0 + k]: the tile
// holds B's columns as rows (K for Q·Kᵀ).  Matrices: 0 = rows n0.., cols k0.. (b0[0]);
// 1 = rows n0.., cols k0+8.. (b0[1]); 2 = rows n0+8.., cols k0.. (b1[0]); 3 = both (b1[1]).
template <int kLd>
__device__ __forceinline__ void load_b_nk2(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* tile, int n0,
                                           int k0, int lane) {
  const int row = n0 + lane % 8 + (lane / 16) * 8;
  const int col = k0 + ((lane / 8) % 2) * 8;
  uint32_t r[4];
  ldsm_x4(r, tile + row * kLd + col);
  b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

// Two B fragments for n-tiles n0 and n0 + 8, where B[k][n] = tile[k0 + k][n]: the tile holds
// B's rows as rows (V for P·V), read transposed.  Matrices: 0 = rows k0.., cols n0.. (b0[0]);
// 1 = rows k0+8.., cols n0.. (b0[1]); 2 = rows k0.., cols n0+8.. (b1[0]); 3 = both (b1[1]).
template <int kLd>
__device__ __forceinline__ void load_b_kn2(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* tile, int k0,
                                           int n0, int lane) {
  const int row = k0 + lane % 8 + ((lane / 8) % 2) * 8;
  const int col = n0 + (lane / 16) * 8;
  uint32_t r[4];
  ldsm_x4_trans(r, tile + row * kLd + col);
  b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

// The A fragment of columns 16 kc .. 16 kc + 15 of a 16-row accumulator held as C fragments
// c[nt] (8 columns each): columns 16 kc + 0..7 are tile 2 kc, 16 kc + 8..15 tile 2 kc + 1.
template <bool kBF16, int kNt>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[kNt][4], int kc) {
  a[0] = pack2<kBF16>(c[2 * kc][0], c[2 * kc][1]);
  a[1] = pack2<kBF16>(c[2 * kc][2], c[2 * kc][3]);
  a[2] = pack2<kBF16>(c[2 * kc + 1][0], c[2 * kc + 1][1]);
  a[3] = pack2<kBF16>(c[2 * kc + 1][2], c[2 * kc + 1][3]);
}

// Copies rows [0, kR) of a tile of 16-bit elements with kD columns (global row stride `stride`
// elements, rows 16-byte aligned) to shared memory (leading dimension kD + kRowPad), 16 bytes
// per thread and step, with kBlockThreads threads; rows >= `valid` are zero-filled (never read
// from global memory).  A file that uses it fixes the block size and padding with a `load_tile`
// alias.  The loads go in groups of two before their stores: in one loop each load waited for
// the previous step's store (dst is a generic pointer: it might alias src), one memory latency a
// step (the same pattern cost linear.cu's state walks ~17 us a chunk on an H200, session 24).
// Groups of two, not all of a thread's: with all four (D = 128) sparse.cu's D = 128 range
// forward spilled 8 bytes (ptxas -v, sm_90a); two spill nothing.
template <int kBlockThreads, int kRowPad, int kR, int kD>
__device__ __forceinline__ void load_rows16(uint16_t* dst, const uint16_t* src, int64_t stride, int valid) {
  constexpr int kChunks = kD / 8;
  constexpr int kSteps = kR * kChunks / kBlockThreads;
  constexpr int kGroup = kSteps < 2 ? kSteps : 2;
  static_assert((kR * kChunks) % kBlockThreads == 0, "tile must split evenly over the threads");
  static_assert(kSteps % kGroup == 0, "steps must split evenly in groups");
#pragma unroll
  for (int it0 = 0; it0 < kSteps; it0 += kGroup) {
    uint4 vals[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int idx = (it0 + g) * kBlockThreads + static_cast<int>(threadIdx.x);
      const int r = idx / kChunks, c = idx % kChunks;
      vals[g] = make_uint4(0u, 0u, 0u, 0u);
      if (r < valid) vals[g] = *reinterpret_cast<const uint4*>(src + r * stride + c * 8);
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int idx = (it0 + g) * kBlockThreads + static_cast<int>(threadIdx.x);
      const int r = idx / kChunks, c = idx % kChunks;
      *reinterpret_cast<uint4*>(dst + r * (kD + kRowPad) + c * 8) = vals[g];
    }
  }
}

}  // namespace
}  // namespace attnkit

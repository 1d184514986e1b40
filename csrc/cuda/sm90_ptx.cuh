// Hopper (sm_90a) building blocks of csrc/cuda/softmax_sm90.cu: the inline-PTX helpers for the
// tensor-memory accelerator (cp.async.bulk.tensor), mbarriers, warpgroup MMA (wgmma) and register
// reallocation (setmaxnreg), and the shared-memory matrix descriptors wgmma reads its operands by.
//
// One copy on purpose, like mma_sm80.cuh: tests/csrc/cuda_emulator/extract.py inlines this file
// into the device code it cuts out of a .cu, removes the PTX helpers below after checking that
// each still issues the PTX (and operand order) the emulator models (harness_sm90.h), and the
// emulated tests run everything else as written -- smem_desc_sw128 included, so a wrong
// descriptor reads the wrong elements in the emulator too.
//
// Semantics the kernels rely on (PTX ISA 8.x, "Asynchronous Warpgroup Level Matrix Multiply" and
// "Tensor copy"; CUTLASS's cute/arch/copy_sm90_tma.hpp and mma_sm90_desc.hpp spell the same):
//  - 128-byte swizzle.  A tile written by a TMA load with CU_TENSOR_MAP_SWIZZLE_128B, whose box is
//    128 bytes wide (64 16-bit elements) and whose shared-memory destination is 1024-byte aligned,
//    holds box element (r, c) at byte r * 128 + ((c * 2 / 16) ^ (r % 8)) * 16 + (c * 2) % 16: the
//    16-byte chunk index (address bits 4-6) XOR the row within its 8-row group (bits 7-9).
//    wgmma's 128-byte-swizzle descriptors undo the same XOR on the absolute shared address.
//  - Descriptor (smem_desc_sw128): bits 0-13 start address >> 4, 16-29 leading byte offset >> 4,
//    32-45 stride byte offset >> 4, 49-51 base offset (0: the tiles are 1024-byte aligned),
//    62-63 layout (1 = 128-byte swizzle).
//      K-major operand (Q and K in S = Q Kᵀ): rows of 64 elements (128 bytes) along K, 8-row
//      groups `sbo` = 1024 bytes apart; the leading byte offset is unused (set to 1); a k-step of
//      16 elements inside the 128-byte row moves the start address by 32 bytes.
//      MN-major operand (V in O += P V, imm-trans-b = 1): rows of 64 N-elements (128 bytes) along
//      N, one row per k; 8-row groups along K `sbo` = 1024 bytes apart, and the 64-column panels
//      along N `lbo` bytes apart (the panel stride of the tile).
//  - wgmma.mma_async m64nNk16, f32 accumulation, issued by the 128 threads of a warpgroup (warps
//    4w .. 4w+3).  Accumulator fragment, float d[N / 8][4] (the m16n8 C fragments of the warp's
//    16 rows, as flash_tiles.cuh keeps them): warp w' = warp % 4, g = lane / 4, t = lane % 4;
//    d[j][0], d[j][1] = D[16 w' + g][8 j + 2 t + {0, 1}], d[j][2], d[j][3] = D[16 w' + g + 8][...].
//    A from registers (RS): a[0] = A[16 w' + g][2t, 2t+1], a[1] = A[16 w' + g + 8][2t, 2t+1],
//    a[2] = A[16 w' + g][2t+8, 2t+9], a[3] = A[16 w' + g + 8][2t+8, 2t+9] (low half: lower k).
//    The accumulators must not be read or written between the issue and the wgmma_wait that
//    covers it; acc_fence keeps the compiler from moving those accesses across.
//  - mbarrier phases: a barrier initialized with count c completes its current phase when c
//    arrivals have been made and its transaction count is back to 0; mbar_wait(bar, parity)
//    returns once the phase of that parity has completed (a fresh barrier is in phase 0, so
//    waiting for parity 1 returns at once: the "previous phase" of a fresh barrier counts as done).
//  - cp.async.bulk.tensor: the whole box's bytes count towards the barrier's transaction count,
//    elements outside the tensor included (written as zeros).
#pragma once

#include <cstdint>

namespace attnkit {
namespace {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNKIT_SM90A 1
#else
#define ATTNKIT_SM90A 0
#endif

// Shared-memory address (the 32-bit window) of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Descriptor of a 128-byte-swizzled operand starting at `p` (see the header comment).
__device__ __forceinline__ uint64_t smem_desc_sw128(const void* p, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint64_t start = (smem_addr(p) & 0x3FFFFu) >> 4;
  return start | (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t{1} << 62);
}

// ---------------------------------------------------------------------------------------------
// PTX helpers (each modelled by the emulator; keep the asm text as it is or re-check the model)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if ATTNKIT_SM90A
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" : : "r"(smem_addr(bar)), "r"(count) : "memory");
#endif
}

// One arrival on `bar`, after raising its expected transaction count by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if ATTNKIT_SM90A
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" : : "r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#if ATTNKIT_SM90A
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" : : "r"(smem_addr(bar)) : "memory");
#endif
}

// Blocks until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if ATTNKIT_SM90A
  asm volatile(
      "{\n.reg .pred done;\nWAIT_AGAIN:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_AGAIN;\n}\n"
      : : "r"(smem_addr(bar)), "r"(parity) : "memory");
#endif
}

// Orders this thread's earlier generic-proxy shared-memory accesses (mbarrier.init, ordinary
// stores) before later async-proxy ones (TMA, wgmma operand reads).
__device__ __forceinline__ void fence_proxy_async() {
#if ATTNKIT_SM90A
  asm volatile("fence.proxy.async.shared::cta;\n" : : : "memory");
#endif
}

// TMA: the box at coordinates (c0 innermost, .. c3) of the tensor map into shared memory at
// `dst` (1024-byte aligned for the 128-byte swizzle), completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* tensor_map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
#if ATTNKIT_SM90A
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%3, %4, %5, %6}], [%2];\n"
      : : "r"(smem_addr(dst)), "l"(tensor_map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}

// Register reallocation per warpgroup (the kernel must be launched with a register cap:
// __launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if ATTNKIT_SM90A
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" : : "n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if ATTNKIT_SM90A
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" : : "n"(kRegs));
#endif
}

// Named barrier `id` (1..15; 0 is __syncthreads') for `count` threads (a multiple of 32): waits
// until `count` threads have arrived (bar.sync) or only arrives (bar.arrive).
__device__ __forceinline__ void named_bar_sync(int id, int count) {
#if ATTNKIT_SM90A
  asm volatile("bar.sync %0, %1;\n" : : "r"(id), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void named_bar_arrive(int id, int count) {
#if ATTNKIT_SM90A
  asm volatile("bar.arrive %0, %1;\n" : : "r"(id), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if ATTNKIT_SM90A
  asm volatile("wgmma.fence.sync.aligned;\n" : : : "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if ATTNKIT_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;\n" : : : "memory");
#endif
}

// Waits until at most kPending of this warpgroup's committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if ATTNKIT_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" : : "n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving accesses of the accumulators across a wgmma issue or wait.
template <int kNt>
__device__ __forceinline__ void acc_fence(float (&d)[kNt][4]) {
#if ATTNKIT_SM90A
#pragma unroll
  for (int i = 0; i < kNt; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e]) : : "memory");
  }
#endif
}

// The same for registers that an issued wgmma reads (A from registers): they must keep their
// values until the wait.
template <int kNt>
__device__ __forceinline__ void acc_fence(uint32_t (&a)[kNt][4]) {
#if ATTNKIT_SM90A
#pragma unroll
  for (int i = 0; i < kNt; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e]) : : "memory");
  }
#endif
}

// d (64 x kN, fp32) = A B + (scale_d ? d : 0), A (64 x 16) and B (16 x kN) from shared memory
// through descriptors; B K-major (kTransB = 0) or MN-major (kTransB = 1).
template <bool kBF16, int kN, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if ATTNKIT_SM90A
  static_assert(kN == 64 || kN == 128, "wgmma_ss: N is 64 or 128");
  if constexpr (kN == 64) {
      if constexpr (kBF16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, %35;\n}\n"
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "%32, %33, p, 1, 1, 0, %35;\n}\n"
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      }
  } else {
      if constexpr (kBF16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, 0, %67;\n}\n"
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "%64, %65, p, 1, 1, 0, %67;\n}\n"
            : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
            : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      }
  }
#else
  __trap();  // never launched: the host side takes this path only on sm_90a builds and devices
#endif
}

// The same with A from registers (the accumulator layout of a previous product, re-packed).
// kOff: the product's accumulators are d[kOff .. kOff + kN / 8 - 1] (an N = 256 accumulator as two
// halves of N = 128).
template <bool kBF16, int kN, int kTransB, int kOff = 0, int kNt = kN / 8>
__device__ __forceinline__ void wgmma_rs(float (&d)[kNt][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
#if ATTNKIT_SM90A
  static_assert(kN == 64 || kN == 128, "wgmma_rs: N is 64 or 128");
  static_assert(kOff >= 0 && kOff + kN / 8 <= kNt, "wgmma_rs: the accumulators lie inside d");
  if constexpr (kN == 64) {
      if constexpr (kBF16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
            : "+f"(d[kOff + 0][0]), "+f"(d[kOff + 0][1]), "+f"(d[kOff + 0][2]), "+f"(d[kOff + 0][3]), "+f"(d[kOff + 1][0]), "+f"(d[kOff + 1][1]), "+f"(d[kOff + 1][2]), "+f"(d[kOff + 1][3]), "+f"(d[kOff + 2][0]), "+f"(d[kOff + 2][1]), "+f"(d[kOff + 2][2]), "+f"(d[kOff + 2][3]), "+f"(d[kOff + 3][0]), "+f"(d[kOff + 3][1]), "+f"(d[kOff + 3][2]), "+f"(d[kOff + 3][3]), "+f"(d[kOff + 4][0]), "+f"(d[kOff + 4][1]), "+f"(d[kOff + 4][2]), "+f"(d[kOff + 4][3]), "+f"(d[kOff + 5][0]), "+f"(d[kOff + 5][1]), "+f"(d[kOff + 5][2]), "+f"(d[kOff + 5][3]), "+f"(d[kOff + 6][0]), "+f"(d[kOff + 6][1]), "+f"(d[kOff + 6][2]), "+f"(d[kOff + 6][3]), "+f"(d[kOff + 7][0]), "+f"(d[kOff + 7][1]), "+f"(d[kOff + 7][2]), "+f"(d[kOff + 7][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
            "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
            : "+f"(d[kOff + 0][0]), "+f"(d[kOff + 0][1]), "+f"(d[kOff + 0][2]), "+f"(d[kOff + 0][3]), "+f"(d[kOff + 1][0]), "+f"(d[kOff + 1][1]), "+f"(d[kOff + 1][2]), "+f"(d[kOff + 1][3]), "+f"(d[kOff + 2][0]), "+f"(d[kOff + 2][1]), "+f"(d[kOff + 2][2]), "+f"(d[kOff + 2][3]), "+f"(d[kOff + 3][0]), "+f"(d[kOff + 3][1]), "+f"(d[kOff + 3][2]), "+f"(d[kOff + 3][3]), "+f"(d[kOff + 4][0]), "+f"(d[kOff + 4][1]), "+f"(d[kOff + 4][2]), "+f"(d[kOff + 4][3]), "+f"(d[kOff + 5][0]), "+f"(d[kOff + 5][1]), "+f"(d[kOff + 5][2]), "+f"(d[kOff + 5][3]), "+f"(d[kOff + 6][0]), "+f"(d[kOff + 6][1]), "+f"(d[kOff + 6][2]), "+f"(d[kOff + 6][3]), "+f"(d[kOff + 7][0]), "+f"(d[kOff + 7][1]), "+f"(d[kOff + 7][2]), "+f"(d[kOff + 7][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      }
  } else {
      if constexpr (kBF16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
            : "+f"(d[kOff + 0][0]), "+f"(d[kOff + 0][1]), "+f"(d[kOff + 0][2]), "+f"(d[kOff + 0][3]), "+f"(d[kOff + 1][0]), "+f"(d[kOff + 1][1]), "+f"(d[kOff + 1][2]), "+f"(d[kOff + 1][3]), "+f"(d[kOff + 2][0]), "+f"(d[kOff + 2][1]), "+f"(d[kOff + 2][2]), "+f"(d[kOff + 2][3]), "+f"(d[kOff + 3][0]), "+f"(d[kOff + 3][1]), "+f"(d[kOff + 3][2]), "+f"(d[kOff + 3][3]), "+f"(d[kOff + 4][0]), "+f"(d[kOff + 4][1]), "+f"(d[kOff + 4][2]), "+f"(d[kOff + 4][3]), "+f"(d[kOff + 5][0]), "+f"(d[kOff + 5][1]), "+f"(d[kOff + 5][2]), "+f"(d[kOff + 5][3]), "+f"(d[kOff + 6][0]), "+f"(d[kOff + 6][1]), "+f"(d[kOff + 6][2]), "+f"(d[kOff + 6][3]), "+f"(d[kOff + 7][0]), "+f"(d[kOff + 7][1]), "+f"(d[kOff + 7][2]), "+f"(d[kOff + 7][3]), "+f"(d[kOff + 8][0]), "+f"(d[kOff + 8][1]), "+f"(d[kOff + 8][2]), "+f"(d[kOff + 8][3]), "+f"(d[kOff + 9][0]), "+f"(d[kOff + 9][1]), "+f"(d[kOff + 9][2]), "+f"(d[kOff + 9][3]), "+f"(d[kOff + 10][0]), "+f"(d[kOff + 10][1]), "+f"(d[kOff + 10][2]), "+f"(d[kOff + 10][3]), "+f"(d[kOff + 11][0]), "+f"(d[kOff + 11][1]), "+f"(d[kOff + 11][2]), "+f"(d[kOff + 11][3]), "+f"(d[kOff + 12][0]), "+f"(d[kOff + 12][1]), "+f"(d[kOff + 12][2]), "+f"(d[kOff + 12][3]), "+f"(d[kOff + 13][0]), "+f"(d[kOff + 13][1]), "+f"(d[kOff + 13][2]), "+f"(d[kOff + 13][3]), "+f"(d[kOff + 14][0]), "+f"(d[kOff + 14][1]), "+f"(d[kOff + 14][2]), "+f"(d[kOff + 14][3]), "+f"(d[kOff + 15][0]), "+f"(d[kOff + 15][1]), "+f"(d[kOff + 15][2]), "+f"(d[kOff + 15][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
            "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
            : "+f"(d[kOff + 0][0]), "+f"(d[kOff + 0][1]), "+f"(d[kOff + 0][2]), "+f"(d[kOff + 0][3]), "+f"(d[kOff + 1][0]), "+f"(d[kOff + 1][1]), "+f"(d[kOff + 1][2]), "+f"(d[kOff + 1][3]), "+f"(d[kOff + 2][0]), "+f"(d[kOff + 2][1]), "+f"(d[kOff + 2][2]), "+f"(d[kOff + 2][3]), "+f"(d[kOff + 3][0]), "+f"(d[kOff + 3][1]), "+f"(d[kOff + 3][2]), "+f"(d[kOff + 3][3]), "+f"(d[kOff + 4][0]), "+f"(d[kOff + 4][1]), "+f"(d[kOff + 4][2]), "+f"(d[kOff + 4][3]), "+f"(d[kOff + 5][0]), "+f"(d[kOff + 5][1]), "+f"(d[kOff + 5][2]), "+f"(d[kOff + 5][3]), "+f"(d[kOff + 6][0]), "+f"(d[kOff + 6][1]), "+f"(d[kOff + 6][2]), "+f"(d[kOff + 6][3]), "+f"(d[kOff + 7][0]), "+f"(d[kOff + 7][1]), "+f"(d[kOff + 7][2]), "+f"(d[kOff + 7][3]), "+f"(d[kOff + 8][0]), "+f"(d[kOff + 8][1]), "+f"(d[kOff + 8][2]), "+f"(d[kOff + 8][3]), "+f"(d[kOff + 9][0]), "+f"(d[kOff + 9][1]), "+f"(d[kOff + 9][2]), "+f"(d[kOff + 9][3]), "+f"(d[kOff + 10][0]), "+f"(d[kOff + 10][1]), "+f"(d[kOff + 10][2]), "+f"(d[kOff + 10][3]), "+f"(d[kOff + 11][0]), "+f"(d[kOff + 11][1]), "+f"(d[kOff + 11][2]), "+f"(d[kOff + 11][3]), "+f"(d[kOff + 12][0]), "+f"(d[kOff + 12][1]), "+f"(d[kOff + 12][2]), "+f"(d[kOff + 12][3]), "+f"(d[kOff + 13][0]), "+f"(d[kOff + 13][1]), "+f"(d[kOff + 13][2]), "+f"(d[kOff + 13][3]), "+f"(d[kOff + 14][0]), "+f"(d[kOff + 14][1]), "+f"(d[kOff + 14][2]), "+f"(d[kOff + 14][3]), "+f"(d[kOff + 15][0]), "+f"(d[kOff + 15][1]), "+f"(d[kOff + 15][2]), "+f"(d[kOff + 15][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
      }
  }
#else
  __trap();
#endif
}

}  // namespace
}  // namespace attnkit

// Softmax attention forward and backward for Hopper (sm_90a), FlashAttention-3's design written
// for attnkit (issue 27): TMA loads of Q, K and V tiles completing on mbarriers, wgmma for both products, and
// warp specialization -- one producer warpgroup that only issues the tile loads (its registers
// given back with setmaxnreg) and two consumer warpgroups of 64 query rows each.
//
// STATUS.  Compiled for sm_90a by .ci/compile_cuda.sh (its SASS checked for HGMMA / UTMALDG and
// no local memory by .ci/check_sm90_sass.sh) and run on the CPU by the CUDA emulator
// (tests/csrc/test_softmax_sm90_emulated.py: TMA with the 128-byte swizzle, mbarrier phases and
// wgmma from the PTX ISA) against the float64 reference.  Not yet run on a GPU: opt-in with
// ATTNKIT_CUDA_SM90=1 until `pytest -m gpu` passes with it on an H100/H200 (bench/RESULTS.md).
//
// BACKWARD (below the forward): a dQ kernel and a dK / dV kernel of the same shape (producer
// warpgroup, two consumer warpgroups of 64 rows, wgmma for all five products per tile pair,
// S and dP recomputed in each kernel, no atomics), taking delta = rowsum(dO ∘ O) from
// softmax.cu's row kernel.  ATTNKIT_CUDA_SM90=fwd keeps softmax.cu's backward;
// ATTNKIT_CUDA_SM90=atomic runs the dK / dV kernel alone, which adds dQ with float32 atomics
// (FlashAttention-2/3's 5 products per tile pair; session 23, emulated, not yet on a GPU).
//
// WHAT IT COMPUTES.  The forward of softmax.cu's kernels (same entry point, same results up to
// fp32 summation order) for the cases it takes: float16 / bfloat16, D = Dv = 64 or 128, no mask,
// and D = Dv = 256, which only these kernels take (the forward on K / V tiles of 64 keys, the
// backward in the two "wide" kernels below the others; softmax.cu sends such calls here alone),
// causal (top-left, j <= i) or not, GQA (query head h reads kv head h / (H / Hk)), any N and M,
// q, k, v of shape [B, H|Hk, N|M, D] with a contiguous last dim and other strides multiples of
// 16 bytes (what TMA reads).  Out [B, H, N, D] contiguous, lse [B, H, N] float32 (natural log;
// -inf for a row that saw no key, whose out is 0).
//
// HOW.  One block of 384 threads per (128 query rows, h, b) (keys per K / V tile: 128; 64 at D = 256):
//  - warpgroup 0 (producer, 40 registers): thread 0 loads Q (D / 64 boxes of 128 rows x 64
//    elements, 128-byte swizzle) once, then streams K and V tiles of 128 keys through a ring of
//    kStages stages: it waits for the stage to be released (kv_empty), then issues the TMA loads
//    of K (on k_full) and V (on v_full) separately, so S = Q Kᵀ can start before V has landed.
//  - warpgroups 1 and 2 (consumers, 232 registers): rows 64 (wg - 1) .. +63 of the block.  Per
//    tile: S = Q Kᵀ by D / 16 wgmma m64n128k16 from shared memory (Q and K K-major), the online
//    softmax in registers (base 2, flash_tiles.cuh's update: the wgmma accumulator of a warp is
//    the m16n8 C fragments of its 16 rows), P re-packed in registers as the A operand, O += P V by
//    8 wgmma m64nDk16 with A from registers and V MN-major (imm-trans-b), then the stage is
//    released.  Out-of-range keys (j >= M, zero-filled by TMA) and causally hidden ones are -inf.
//  - Consumer loops (ATTNKIT_CUDA_SM90=1 | pingpong | simple | persistent, all emulated, to be
//    timed on a GPU): "simple" waits for each product at once; the default overlaps the softmax
//    of tile t with the P V product of tile t - 1 (FlashAttention-3's intra-warpgroup
//    pipelining); "pingpong" adds the two consumers' turns on named barriers; "persistent" runs
//    the default loop on a grid of one block per SM (see kPersistent at the kernel).

#include "host_utils.cuh"  // first: torch headers and host helpers
#include <ATen/ops/zeros.h>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "mma_sm80.cuh"
#include "flash_tiles.cuh"
#include "sm90_ptx.cuh"

namespace attnkit {
namespace {

constexpr int kSm90Threads = 384;        // 3 warpgroups: producer, 2 consumers
constexpr int kSm90BlockM = 128;         // query rows per block (64 per consumer warpgroup)
constexpr int kSm90BlockN = 128;         // keys per K / V tile (D = 64, 128; kFwdBlockN)
constexpr int kSm90Stages = 2;           // K / V ring depth
constexpr int kPanelCols = 64;           // elements per 128-byte swizzled row (one TMA box wide)
constexpr int kPanelElems = 128 * kPanelCols;  // one 128-row panel (Q tile, K or V tile): 16 KiB
constexpr uint32_t kPanelBytes = kPanelElems * 2;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;       // 40 * 128 + 232 * 256 = 64512 <= 65536 registers
// The backward kernel that adds dQ too (kDqAtomic) needs 8 more a consumer thread at D = 128
// (ptxas -v: 68 bytes spilled at 232; 32 with its descriptors in uniform registers; none at
// 240): FlashAttention-3's split, the producer at 24.
constexpr int kProducerRegsTight = 24;
constexpr int kConsumerRegsWide = 240;  // 24 * 128 + 240 * 256 = 64512
constexpr size_t kSm90MaxSmem = 232448;  // 227 KiB: the most dynamic shared memory a block can opt into
static_assert(kSm90BlockM == 128, "Q's panels hold 128 rows");

// The forward's keys per K / V tile: 128, except at D = 256, where a ring of two 128-key stages
// (4 x 64 KiB) and Q (64 KiB) would not fit in shared memory: 64 there (Q and two stages of K
// and V: 192 KiB).  FlashAttention-3 takes 80 at D = 256; 64 keeps the products at the wgmma
// shapes the other head dims use (N = 64 / 128) and the tiles at whole 1024-byte swizzle atoms.
// (A variable template: device code cannot call a constexpr host function without
// --expt-relaxed-constexpr.)
template <int kD>
constexpr int kFwdBlockN = kD <= 128 ? kSm90BlockN : 64;

// Dynamic shared memory: 1024 bytes of slack to align the tiles (the 128-byte swizzle repeats
// every 1024 bytes and TMA and wgmma read it from address bits 7-9), Q, the K and V rings, and
// 2 + 3 kSm90Stages mbarriers.
template <int kD>
constexpr size_t sm90_smem_bytes() {
  return 1024 + static_cast<size_t>(kD / kPanelCols) * (kSm90BlockM + 2 * kSm90Stages * kFwdBlockN<kD>) *
                    kPanelCols * 2 +
         (2 + 3 * kSm90Stages) * sizeof(uint64_t);
}
static_assert(sm90_smem_bytes<256>() <= kSm90MaxSmem, "the D = 256 forward's tiles fit in shared memory");

struct Sm90FwdParams {
  uint16_t* out;  // [B, H, N, D] contiguous
  float* lse;     // [B, H, N]
  int H, group, N, M;
  int B, q_blocks;   // the persistent kernel's tiles: q_blocks x H x B (q_blocks = ceil(N / 128))
  float scale_log2;  // scale * log2(e)
  bool causal;
};

// Tiles in shared memory are kD / 64 panels of kRows rows x 64 elements (128 bytes a row, the
// 128-byte swizzle of TMA), panel c at tile + c * kRows * 64; a tile's panels and the tiles of a
// ring are contiguous and 1024-byte aligned.

// acc (64 x kN) = A Bᵀ over kD columns, issued (not waited for): A = rows a_row0 .. a_row0 + 63
// of a tile of kRowsA rows, B = the first kN rows of a tile of kRowsB rows (both K-major); k-step
// kk reads columns 16 kk .. of panel kk / 4, 32 bytes further per step.
template <bool kBF16, int kN, int kD, int kRowsA, int kRowsB>
__device__ __forceinline__ void issue_abt(float (&acc)[kN / 8][4], const uint16_t* a, int a_row0, const uint16_t* b) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint16_t* ak = a + (kk / 4) * kRowsA * kPanelCols + a_row0 * kPanelCols + (kk % 4) * 16;
    const uint16_t* bk = b + (kk / 4) * kRowsB * kPanelCols + (kk % 4) * 16;
    wgmma_ss<kBF16, kN, 0>(acc, smem_desc_sw128(ak, 16, 1024), smem_desc_sw128(bk, 16, 1024), kk > 0);
  }
}

// acc (64 x kD) += P B, issued: P (64 x kK) from registers (the A fragments of its 16-column
// steps), B = the first kK rows of a tile of kRowsB rows (MN-major: its kD columns are the N of
// the product); k-step kc reads rows 16 kc .. (16 rows of 128 bytes further), the panels
// kRowsB * 128 bytes apart.  kD = 256: two products of N = 128 a k-step (columns 0-127 and
// 128-255, panels 0-1 and 2-3), on the two halves of acc.
template <bool kBF16, int kD, int kK, int kRowsB>
__device__ __forceinline__ void issue_pb(float (&acc)[kD / 8][4], const uint32_t (&pa)[kK / 16][4], const uint16_t* b) {
  constexpr int kN = kD <= 128 ? kD : 128;  // the product's N (wgmma: at most 256; 64 and 128 are modelled)
#pragma unroll
  for (int kc = 0; kc < kK / 16; ++kc) {
    const uint16_t* bk = b + kc * 16 * kPanelCols;
    wgmma_rs<kBF16, kN, 1>(acc, pa[kc], smem_desc_sw128(bk, kRowsB * kPanelCols * 2, 1024), 1);
    if constexpr (kD > kN) {
      const uint16_t* bk2 = bk + (kN / kPanelCols) * kRowsB * kPanelCols;  // columns 128-255: panels 2-3
      wgmma_rs<kBF16, kN, 1, kN / 8>(acc, pa[kc], smem_desc_sw128(bk2, kRowsB * kPanelCols * 2, 1024), 1);
    }
  }
}

// The forward's two products: S = Q Kᵀ for consumer wq's 64 rows against the K tile of a stage,
// and O += P V against the V tile of a stage.
// (A K / V tile of kBN rows: kD / 64 panels of kBN x 64 elements.)
template <bool kBF16, int kD, int kBN = kFwdBlockN<kD>>
__device__ __forceinline__ void issue_scores(float (&sc)[kBN / 8][4], const uint16_t* sq, const uint16_t* sk,
                                             int stage, int wq) {
  constexpr int kP = kD / kPanelCols;
  issue_abt<kBF16, kBN, kD, kSm90BlockM, kBN>(sc, sq, 64 * wq, sk + stage * kP * kBN * kPanelCols);
}

template <bool kBF16, int kD, int kBN = kFwdBlockN<kD>>
__device__ __forceinline__ void issue_pv(float (&o)[kD / 8][4], const uint32_t (&pa)[kBN / 16][4],
                                         const uint16_t* sv, int stage) {
  constexpr int kP = kD / kPanelCols;
  issue_pb<kBF16, kD, kBN, kBN>(o, pa, sv + stage * kP * kBN * kPanelCols);
}

// Scores to base 2; keys past M and (causal) past the row hidden.  Warp-uniform test: only the
// last tile and the tiles crossing this warp's diagonal need the per-entry check.
template <int kBN>
__device__ __forceinline__ void scale_and_mask(float (&sc)[kBN / 8][4], const Sm90FwdParams& p, int t,
                                               int row0, int g, int tq) {
  const int j0 = t * kBN;
  const bool edge = j0 + kBN > p.M || (p.causal && j0 + kBN - 1 > row0);
#pragma unroll
  for (int nt = 0; nt < kBN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = sc[nt][e] * p.scale_log2;
      if (edge) {
        const int j = j0 + 8 * nt + 2 * tq + (e & 1);
        const int i = row0 + g + 8 * (e >> 1);
        sc[nt][e] = (j < p.M && (!p.causal || j <= i)) ? x : -INFINITY;
      } else {
        sc[nt][e] = x;
      }
    }
  }
}

// kOverlap = false ("simple"): per tile, S, softmax, then O += P V, each product waited for at
// once.  kOverlap = true: the products of tile t (S_t) and of tile t - 1 (O += P_{t-1} V_{t-1})
// are issued together; the softmax of S_t runs while the P V product is still on the tensor
// cores, and O is rescaled once that product is done (FlashAttention-3's intra-warpgroup
// overlap; P_{t-1} and S_t in registers at once: 32 + 64 more than O's).  kPingPong (with
// kOverlap): the two consumers take turns to issue their products (named barriers 1 and 2,
// consumer 0 first), so that one's softmax runs while the other's products do (FlashAttention-3's
// inter-warpgroup ping-pong).
// kPersistent (ATTNKIT_CUDA_SM90=persistent, with kOverlap): a grid of at most one block per SM,
// block i taking the tiles (128 query rows, h, b) i, i + gridDim.x, ... in the order causal
// longest first (every head's last query block, then the ones before); the ring's uses and the
// Q barrier's phases run on across the tiles, and the consumers release Q (q_empty) before
// storing a tile's output, so that the producer loads the next tile's Q, K and V during that
// store (FlashAttention-3's persistent scheduler, statically striped).
template <bool kBF16, int kD, bool kOverlap, bool kPingPong = false, bool kPersistent = false>
__global__ void __launch_bounds__(kSm90Threads, 1)
    softmax_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                            const __grid_constant__ CUtensorMap tm_v, const Sm90FwdParams p) {
#if !ATTNKIT_SM90A
  __trap();  // an sm_80 pass: never launched (sm90_available); no body to compile for it
#else
  constexpr int kP = kD / kPanelCols;  // panels per tile
  constexpr int kBN = kFwdBlockN<kD>;
  constexpr int kKvPanelElems = kBN * kPanelCols;  // one panel of a K or V tile
  constexpr int kNt = kBN / 8;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint16_t* sq = reinterpret_cast<uint16_t*>(base);
  uint16_t* sk = sq + kP * kPanelElems;
  uint16_t* sv = sk + kSm90Stages * kP * kKvPanelElems;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kSm90Stages * kP * kKvPanelElems);
  uint64_t* q_empty = q_full + 1;  // kPersistent: Q read for the last time by both consumers
  uint64_t* k_full = q_empty + 1;
  uint64_t* v_full = k_full + kSm90Stages;
  uint64_t* kv_empty = v_full + kSm90Stages;

  // The block's k-th tile: its first query row, head and batch, and its number of key tiles.
  // Causal: the last query blocks (the most key tiles) first, so the longest blocks start in the
  // first wave and the short ones fill the tail.
  struct Tile {
    int q0, h, b, n_tiles;
  };
  auto tile_of = [&p](int k) {
    Tile tile;
    int qb;
    if constexpr (kPersistent) {
      const int w = static_cast<int>(blockIdx.x) + k * static_cast<int>(gridDim.x);
      const int heads = p.H * p.B;
      qb = w / heads;
      tile.h = w % heads % p.H;
      tile.b = w % heads / p.H;
      if (p.causal) qb = p.q_blocks - 1 - qb;
    } else {
      qb = static_cast<int>(p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
      tile.h = static_cast<int>(blockIdx.y);
      tile.b = static_cast<int>(blockIdx.z);
    }
    tile.q0 = qb * kSm90BlockM;
    // Keys [0, kv_end) can be visible to the block's rows (causal: j <= i < min(q0 + 128, N)).
    const int kv_end = p.causal ? min(p.M, min(tile.q0 + kSm90BlockM, p.N)) : p.M;
    tile.n_tiles = (kv_end + kBN - 1) / kBN;
    return tile;
  };
  const int my_tiles =
      kPersistent ? (p.q_blocks * p.H * p.B - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                        static_cast<int>(gridDim.x)
                  : 1;
  const int wg = static_cast<int>(threadIdx.x) / 128;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, 256);  // every consumer thread releases Q
    for (int s = 0; s < kSm90Stages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&kv_empty[s], 256);  // every consumer thread releases the stage
    }
    fence_proxy_async();  // the initialized barriers, visible to the TMA unit
  }
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      int it = 0;  // the ring's uses so far
      for (int k = 0; k < my_tiles; ++k) {
        const Tile tile = tile_of(k);
        const int h = tile.h, b = tile.b, hk = h / p.group;
        if (k > 0) mbar_wait(q_empty, static_cast<uint32_t>(k - 1) & 1u);  // the previous tile's Q read
        mbar_arrive_expect_tx(q_full, kP * kPanelBytes);
        for (int c = 0; c < kP; ++c) tma_load_4d(sq + c * kPanelElems, &tm_q, c * kPanelCols, tile.q0, h, b, q_full);
        for (int t = 0; t < tile.n_tiles; ++t, ++it) {
          const int s = it % kSm90Stages, use = it / kSm90Stages;
          // The stage's previous use released (a fresh barrier's "previous phase" counts as done).
          mbar_wait(&kv_empty[s], (use & 1) ^ 1);
          mbar_arrive_expect_tx(&k_full[s], kP * kKvPanelElems * 2);
          for (int c = 0; c < kP; ++c) {
            tma_load_4d(sk + (s * kP + c) * kKvPanelElems, &tm_k, c * kPanelCols, t * kBN, hk, b, &k_full[s]);
          }
          mbar_arrive_expect_tx(&v_full[s], kP * kKvPanelElems * 2);
          for (int c = 0; c < kP; ++c) {
            tma_load_4d(sv + (s * kP + c) * kKvPanelElems, &tm_v, c * kPanelCols, t * kBN, hk, b, &v_full[s]);
          }
        }
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wq = wg - 1;  // consumer 0 or 1: rows 64 wq .. 64 wq + 63 of the block
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  int it = 0;  // the ring's uses by the tiles before this one

  for (int k = 0; k < my_tiles; ++k) {
    const Tile tile = tile_of(k);
    const int h = tile.h, b = tile.b, n_tiles = tile.n_tiles;
    const int row0 = tile.q0 + 64 * wq + 16 * warp;  // this warp's first row
    float o[kD / 8][4];
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float sc[kNt][4];
    uint32_t pa[kNt / 2][4];
    auto stage_of = [it](int t) { return (it + t) % kSm90Stages; };
    auto parity_of = [it](int t) { return static_cast<uint32_t>((it + t) / kSm90Stages) & 1u; };

    mbar_wait(q_full, static_cast<uint32_t>(k) & 1u);
    if constexpr (!kOverlap) {
      for (int t = 0; t < n_tiles; ++t) {
        mbar_wait(&k_full[stage_of(t)], parity_of(t));
        wgmma_fence();
        issue_scores<kBF16, kD>(sc, sq, sk, stage_of(t), wq);
        wgmma_commit();
        wgmma_wait<0>();
        acc_fence(sc);
        scale_and_mask<kBN>(sc, p, t, row0, g, tq);
        online_softmax_update<kNt, kD / 8>(sc, o, m_run, l_run);
#pragma unroll
        for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
        mbar_wait(&v_full[stage_of(t)], parity_of(t));
        wgmma_fence();
        issue_pv<kBF16, kD>(o, pa, sv, stage_of(t));
        wgmma_commit();
        wgmma_wait<0>();
        acc_fence(o);
        acc_fence(pa);  // P's registers stay P's until the products that read them are done
        mbar_arrive(&kv_empty[stage_of(t)]);
      }
    } else if (n_tiles > 0) {
      // A turn: this consumer's products of one step issued (ping-pong: between its own barrier's
      // sync and the other consumer's barrier's arrive; consumer 1 opens consumer 0's first turn
      // and skips the arrive after its last, which nobody waits for).
      auto turn_begin = [wq] {
        if constexpr (kPingPong) named_bar_sync(1 + wq, 256);
      };
      auto turn_end = [wq](bool last) {
        if constexpr (kPingPong) {
          if (!(last && wq == 1)) named_bar_arrive(2 - wq, 256);
        }
      };
      if constexpr (kPingPong) {
        if (wq == 1) named_bar_arrive(1, 256);
      }
      turn_begin();
      mbar_wait(&k_full[stage_of(0)], parity_of(0));
      wgmma_fence();
      issue_scores<kBF16, kD>(sc, sq, sk, stage_of(0), wq);
      wgmma_commit();
      turn_end(false);
      wgmma_wait<0>();
      acc_fence(sc);
      scale_and_mask<kBN>(sc, p, 0, row0, g, tq);
      float alpha[2];
      online_softmax_scores<kNt>(sc, m_run, l_run, alpha);  // o is still 0: no rescale
#pragma unroll
      for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
      for (int t = 1; t < n_tiles; ++t) {
        const int prev = t - 1;
        turn_begin();
        mbar_wait(&k_full[stage_of(t)], parity_of(t));
        wgmma_fence();
        issue_scores<kBF16, kD>(sc, sq, sk, stage_of(t), wq);  // group 1: S_t
        wgmma_commit();
        mbar_wait(&v_full[stage_of(prev)], parity_of(prev));
        issue_pv<kBF16, kD>(o, pa, sv, stage_of(prev));  // group 2: O += P_{t-1} V_{t-1}
        wgmma_commit();
        turn_end(false);
        wgmma_wait<1>();  // S_t done; the P V product may still run
        acc_fence(sc);
        scale_and_mask<kBN>(sc, p, t, row0, g, tq);
        online_softmax_scores<kNt>(sc, m_run, l_run, alpha);
        wgmma_wait<0>();
        acc_fence(o);
        acc_fence(pa);
        mbar_arrive(&kv_empty[stage_of(prev)]);
        rescale_rows<kD / 8>(o, alpha);
#pragma unroll
        for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
      }
      const int last = n_tiles - 1;
      turn_begin();
      mbar_wait(&v_full[stage_of(last)], parity_of(last));
      wgmma_fence();
      issue_pv<kBF16, kD>(o, pa, sv, stage_of(last));
      wgmma_commit();
      turn_end(true);
      wgmma_wait<0>();
      acc_fence(o);
      acc_fence(pa);
      mbar_arrive(&kv_empty[stage_of(last)]);
    }

    if constexpr (kPersistent) mbar_arrive(q_empty);  // the producer may load the next tile's Q
    it += n_tiles;
    store_out_lse<kBF16, kD>(p.out, p.lse, (static_cast<int64_t>(b) * p.H + h) * p.N + row0, 1, g, p.N - row0, o,
                             m_run, l_run, tq);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// backward: dQ, and dK / dV, in two kernels of the forward's shape (a producer warpgroup and two
// consumer warpgroups of 64 rows), recomputing S and dP in each (no atomics: deterministic).
// delta = rowsum(dO ∘ O) comes from softmax.cu's row kernel.
// ---------------------------------------------------------------------------------------------

constexpr int kBwdRows = 128;  // dQ: query rows per block; dK/dV: keys per block
constexpr int kBwdStep = 64;   // dQ: keys per K / V tile; dK/dV: query rows per Q / dO tile
constexpr int kStepElems = kBwdStep * kPanelCols;  // one 64-row panel: 8 KiB
constexpr uint32_t kStepBytes = kStepElems * 2;

// Both kernels: two 128-row tiles (Q and dO, or K and V), rings of two 64-row tiles (K and V,
// or Q and dO), then (kWithDs: the dK / dV kernel that also adds dQ, below) two buffers of dS
// for 64 query rows x 128 keys (two 64-row panels each), then 1 + 3 kSm90Stages mbarriers.
constexpr int kDsBuffers = 2;
template <int kD, bool kWithDs = false>
constexpr size_t sm90_bwd_smem_bytes() {
  return 1024 + static_cast<size_t>(kD / kPanelCols) * (2 * kPanelBytes + 2 * kSm90Stages * kStepBytes) +
         (kWithDs ? kDsBuffers * 2 * kStepBytes : 0) + (1 + 3 * kSm90Stages) * sizeof(uint64_t);
}

struct Sm90BwdParams {
  const float* lse;    // [B, H, N], natural log
  const float* delta;  // [B, H, N]
  uint16_t* dq;        // [B, H, N, D] contiguous
  float* dq_acc;       // [B, H, N, D] zeroed: dQ / scale, summed by atomics (ATTNKIT_CUDA_SM90=atomic)
  uint16_t* dk;        // [B, Hk, M, D] contiguous
  uint16_t* dv;
  int H, Hk, group, N, M;
  float scale, scale_log2;
  bool causal;
};

// The shared-memory tiles and barriers of a backward block.
struct BwdSmem {
  uint16_t *big0, *big1;    // the two 128-row tiles
  uint16_t *ring0, *ring1;  // the two rings of 64-row tiles
  uint16_t* ds;              // kWithDs: kDsBuffers dS tiles of two 64-row panels
  uint64_t *big_full, *ring_full, *ring_empty;
};

template <int kD, bool kWithDs = false>
__device__ __forceinline__ BwdSmem bwd_smem(uint8_t* smem_raw) {
  constexpr int kP = kD / kPanelCols;
  uint8_t* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  BwdSmem sm;
  sm.big0 = reinterpret_cast<uint16_t*>(base);
  sm.big1 = sm.big0 + kP * kPanelElems;
  sm.ring0 = sm.big1 + kP * kPanelElems;
  sm.ring1 = sm.ring0 + kSm90Stages * kP * kStepElems;
  sm.ds = sm.ring1 + kSm90Stages * kP * kStepElems;
  sm.big_full = reinterpret_cast<uint64_t*>(sm.ds + (kWithDs ? kDsBuffers * 2 * kStepElems : 0));
  sm.ring_full = sm.big_full + 1;
  sm.ring_empty = sm.ring_full + kSm90Stages;
  return sm;
}

// Thread 0: the barriers (ring_empty released by every consumer thread), made visible to TMA.
__device__ __forceinline__ void init_bwd_barriers(const BwdSmem& sm) {
  if (threadIdx.x == 0) {
    mbar_init(sm.big_full, 1);
    for (int s = 0; s < kSm90Stages; ++s) {
      mbar_init(&sm.ring_full[s], 1);
      mbar_init(&sm.ring_empty[s], 256);
    }
    fence_proxy_async();
  }
  __syncthreads();
}

// The producer's part (thread 0 of warpgroup 0): the two 128-row tiles at row `row0` of (h0, b),
// then `steps` pairs of 64-row ring tiles, step u at row `ring_row(u)` of head `ring_head(u)`.
// (kBigRows: the rows of the two tiles; 64 in the D = 256 kernels.)
template <int kD, int kBigRows = kBwdRows, typename RowOf, typename HeadOf>
__device__ __forceinline__ void produce_bwd(const BwdSmem& sm, const CUtensorMap* big0, const CUtensorMap* big1,
                                            int row0, int h0, const CUtensorMap* ring0, const CUtensorMap* ring1,
                                            int steps, RowOf ring_row, HeadOf ring_head, int b) {
  constexpr int kP = kD / kPanelCols;
  constexpr int kBigPanel = kBigRows * kPanelCols;
  mbar_arrive_expect_tx(sm.big_full, 2 * kP * kBigPanel * 2);
  for (int c = 0; c < kP; ++c) {
    tma_load_4d(sm.big0 + c * kBigPanel, big0, c * kPanelCols, row0, h0, b, sm.big_full);
    tma_load_4d(sm.big1 + c * kBigPanel, big1, c * kPanelCols, row0, h0, b, sm.big_full);
  }
  for (int u = 0; u < steps; ++u) {
    const int s = u % kSm90Stages, use = u / kSm90Stages;
    mbar_wait(&sm.ring_empty[s], (use & 1) ^ 1);
    mbar_arrive_expect_tx(&sm.ring_full[s], 2 * kP * kStepBytes);
    const int row = ring_row(u), head = ring_head(u);
    for (int c = 0; c < kP; ++c) {
      tma_load_4d(sm.ring0 + (s * kP + c) * kStepElems, ring0, c * kPanelCols, row, head, b, &sm.ring_full[s]);
      tma_load_4d(sm.ring1 + (s * kP + c) * kStepElems, ring1, c * kPanelCols, row, head, b, &sm.ring_full[s]);
    }
  }
}

// dQ: one block per (128 query rows, h, b); Q and dO tiles once, K and V tiles of 64 keys
// streamed.  Per tile, for consumer wq's 64 rows: S = Q Kᵀ and dP = dO Vᵀ (issued together, with
// the previous tile's dQ product), P = 2^(S scale log2 e - lse2) (0 where hidden),
// dS = P (dP - delta), dQ += dS K.
template <bool kBF16, int kD>
__global__ void __launch_bounds__(kSm90Threads, 1)
    softmax_bwd_dq_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                               const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                               const Sm90BwdParams p) {
#if !ATTNKIT_SM90A
  __trap();  // an sm_80 pass: never launched (sm90_available); no body to compile for it
#else
  constexpr int kP = kD / kPanelCols;
  constexpr int kNt = kBwdStep / 8;
  extern __shared__ uint8_t smem_raw[];
  const BwdSmem sm = bwd_smem<kD>(smem_raw);
  const int q0 = static_cast<int>(p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kBwdRows;  // longest first
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int kv_end = p.causal ? min(p.M, min(q0 + kBwdRows, p.N)) : p.M;
  const int n_tiles = (kv_end + kBwdStep - 1) / kBwdStep;
  const int wg = static_cast<int>(threadIdx.x) / 128;
  init_bwd_barriers(sm);

  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      const int hk = h / p.group;
      produce_bwd<kD>(sm, &tm_q, &tm_do, q0, h, &tm_k, &tm_v, n_tiles, [](int u) { return u * kBwdStep; },
                      [hk](int) { return hk; }, b);
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wq = wg - 1;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int row0 = q0 + 64 * wq + 16 * warp;
  const int g = lane / 4, tq = lane % 4;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + g + 8 * r;
    lse2[r] = i < p.N ? lse_log2(p.lse[bh * p.N + i]) : INFINITY;
    delta[r] = i < p.N ? p.delta[bh * p.N + i] : 0.f;
  }
  float dq[kD / 8][4];
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;

  // Tile t's S and dP are issued together with tile t - 1's dQ += dS K, and dS_t is computed
  // while that product runs (the forward's intra-warpgroup overlap; dS_{t-1} stays in da until
  // its product is done).
  auto key_tile = [&](const uint16_t* ring, int t) { return ring + (t % kSm90Stages) * kP * kStepElems; };
  float sc[kNt][4], dp[kNt][4];
  uint32_t da[kNt / 2][4];
  // sc <- dS of tile t (S and dP waited for): 0 where hidden, even where delta or dP is NaN (a
  // row that saw a NaN), as the masked softmax's gradient is: no 0 · NaN.
  auto ds_of = [&](int t) {
    const int j0 = t * kBwdStep;
    const bool edge = j0 + kBwdStep > p.M || (p.causal && j0 + kBwdStep - 1 > row0);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int j = j0 + 8 * nt + 2 * tq + (e & 1);
        const bool visible = !edge || (j < p.M && (!p.causal || j <= row0 + g + 8 * r));
        sc[nt][e] = visible ? exp2_approx(sc[nt][e] * p.scale_log2 - lse2[r]) * (dp[nt][e] - delta[r]) : 0.f;
      }
    }
  };

  auto issue_s_dp = [&](int t) {
    mbar_wait(&sm.ring_full[t % kSm90Stages], static_cast<uint32_t>(t / kSm90Stages) & 1u);
    issue_abt<kBF16, kBwdStep, kD, kBwdRows, kBwdStep>(sc, sm.big0, 64 * wq, key_tile(sm.ring0, t));
    issue_abt<kBF16, kBwdStep, kD, kBwdRows, kBwdStep>(dp, sm.big1, 64 * wq, key_tile(sm.ring1, t));
    wgmma_commit();
  };

  mbar_wait(sm.big_full, 0);
  if (n_tiles > 0) {
    wgmma_fence();
    issue_s_dp(0);
    wgmma_wait<0>();
    acc_fence(sc);
    acc_fence(dp);
    ds_of(0);
#pragma unroll
    for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(da[kc], sc, kc);
    for (int t = 1; t < n_tiles; ++t) {
      wgmma_fence();
      issue_s_dp(t);
      issue_pb<kBF16, kD, kBwdStep, kBwdStep>(dq, da, key_tile(sm.ring0, t - 1));  // dQ += dS K
      wgmma_commit();
      wgmma_wait<1>();  // S_t and dP_t done; dQ's product may still run
      acc_fence(sc);
      acc_fence(dp);
      ds_of(t);
      wgmma_wait<0>();
      acc_fence(dq);
      acc_fence(da);
      mbar_arrive(&sm.ring_empty[(t - 1) % kSm90Stages]);
#pragma unroll
      for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(da[kc], sc, kc);
    }
    wgmma_fence();
    issue_pb<kBF16, kD, kBwdStep, kBwdStep>(dq, da, key_tile(sm.ring0, n_tiles - 1));
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(dq);
    acc_fence(da);
    mbar_arrive(&sm.ring_empty[(n_tiles - 1) % kSm90Stages]);
  }
  store_rows<kBF16, kD>(p.dq, bh * p.N + row0, 1, g, p.N - row0, dq, p.scale, tq);
#endif
}

// dSᵀ of a warp's 16 keys (ds_t: entry (key 16 warp + g + 8 r, query 8 nt + 2 tq + c), as the
// dK / dV kernel holds it) stored transposed into a 64-row panel of shared memory: row = query,
// column = key, 128 bytes a row in the 128-byte swizzle (the 16-byte chunk of row i at chunk
// index ^ (i % 8), as TMA lays out a tile), i.e. the K-major A operand of dQ = dS K.  Rounded to
// the input dtype as pack() rounds it for dK.
template <bool kBF16>
__device__ __forceinline__ void store_ds_transposed(uint16_t* panel, const float (&ds_t)[kBwdStep / 8][4], int warp,
                                                    int g, int tq) {
#pragma unroll
  for (int nt = 0; nt < kBwdStep / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 8 * nt + 2 * tq + (e & 1);  // query row of the panel
      const int j = 16 * warp + g + 8 * (e >> 1);  // key column
      panel[i * kPanelCols + ((((j >> 3) ^ (i & 7)) << 3) | (j & 7))] =
          static_cast<uint16_t>(pack2<kBF16>(ds_t[nt][e], 0.f) & 0xffffu);
    }
  }
}

// dK / dV: one block per (128 keys, kv head, b); K and V tiles once, then for each query head of
// the GQA group the Q and dO tiles of 64 rows (causal: from the first with a row >= the block's
// first key).  Per tile, for consumer wk's 64 keys: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (issued together,
// with the previous tile's two products), Pᵀ and dSᵀ as in the dQ kernel, dV += Pᵀ dO and
// dK += dSᵀ Q (issued together).
// kDqAtomic (ATTNKIT_CUDA_SM90=atomic; FlashAttention-2/3's backward): dQ too, so that no dQ
// kernel recomputes S and dP (5 products per tile pair instead of 7).  Each step's dS goes to
// shared memory (store_ds_transposed); at D = 128 consumer wk multiplies the block's dS (64
// queries x 128 keys) by columns 64 wk .. 64 wk + 63 of K, at D = 64 its own 64 keys' dS by all
// of K's columns (the two consumers' shares then meet in the atomics); the share is added to
// p.dq_acc with float atomics (their order is not fixed: dQ is not bitwise deterministic), which
// sm90_dq_convert_kernel scales and rounds.  One step at a time (the D = 128 registers: dK, dV,
// Pᵀ, dSᵀ and 32 of dQ's share, 192, where the overlap would add Sᵀ and dPᵀ's 64).
template <bool kBF16, int kD, bool kDqAtomic = false>
__global__ void __launch_bounds__(kSm90Threads, 1)
    softmax_bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                                 const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                                 const Sm90BwdParams p) {
#if !ATTNKIT_SM90A
  __trap();  // an sm_80 pass: never launched (sm90_available); no body to compile for it
#else
  constexpr int kP = kD / kPanelCols;
  constexpr int kNt = kBwdStep / 8;
  extern __shared__ uint8_t smem_raw[];
  const BwdSmem sm = bwd_smem<kD, kDqAtomic>(smem_raw);
  const int k0 = static_cast<int>(blockIdx.x) * kBwdRows;
  const int hk = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int first = p.causal ? k0 / kBwdStep : 0;  // rows i < k0 see none of these keys
  const int q_tiles = (p.N + kBwdStep - 1) / kBwdStep;
  const int per_head = max(q_tiles - first, 0);
  const int steps = p.group * per_head;
  const int wg = static_cast<int>(threadIdx.x) / 128;
  init_bwd_barriers(sm);

  if (wg == 0) {
    setmaxnreg_dec<kDqAtomic ? kProducerRegsTight : kProducerRegs>();
    if (threadIdx.x == 0) {
      const int group = p.group;
      produce_bwd<kD>(sm, &tm_k, &tm_v, k0, hk, &tm_q, &tm_do, steps,
                      [first, per_head](int u) { return (first + u % per_head) * kBwdStep; },
                      [hk, group, per_head](int u) { return hk * group + u / per_head; }, b);
    }
    return;
  }

  setmaxnreg_inc<kDqAtomic ? kConsumerRegsWide : kConsumerRegs>();
  // kDqAtomic: the consumer index through a shuffle from lane 0, which ptxas knows to be
  // warp-uniform: the shared-memory descriptors derived from it then live in uniform registers
  // (at D = 128, held in ordinary ones, 24 bytes of them spilled).
  const int wk = kDqAtomic ? __shfl_sync(0xffffffffu, wg - 1, 0) : wg - 1;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int key0 = k0 + 64 * wk + 16 * warp;  // this warp's first key
  const int g = lane / 4, tq = lane % 4;
  float dk[kD / 8][4], dv[kD / 8][4];
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) {
    dk[dt][0] = dk[dt][1] = dk[dt][2] = dk[dt][3] = 0.f;
    dv[dt][0] = dv[dt][1] = dv[dt][2] = dv[dt][3] = 0.f;
  }

  // D = 64, as the dQ kernel: step u's Sᵀ and dPᵀ are issued with step u - 1's dV and dK
  // products, and Pᵀ, dSᵀ of step u are computed while those run (pa, da keep step u - 1's until
  // they are done).
  auto ring_tile = [&](const uint16_t* ring, int u) { return ring + (u % kSm90Stages) * kP * kStepElems; };
  float st[kNt][4], dpt[kNt][4];
  uint32_t pa[kNt / 2][4], da[kNt / 2][4];
  auto issue_st_dpt = [&](int u) {
    mbar_wait(&sm.ring_full[u % kSm90Stages], static_cast<uint32_t>(u / kSm90Stages) & 1u);
    issue_abt<kBF16, kBwdStep, kD, kBwdRows, kBwdStep>(st, sm.big0, 64 * wk, ring_tile(sm.ring0, u));
    issue_abt<kBF16, kBwdStep, kD, kBwdRows, kBwdStep>(dpt, sm.big1, 64 * wk, ring_tile(sm.ring1, u));
    wgmma_commit();
  };
  auto issue_dv_dk = [&](int u) {
    issue_pb<kBF16, kD, kBwdStep, kBwdStep>(dv, pa, ring_tile(sm.ring1, u));  // dV += Pᵀ dO
    issue_pb<kBF16, kD, kBwdStep, kBwdStep>(dk, da, ring_tile(sm.ring0, u));  // dK += dSᵀ Q
    wgmma_commit();
  };
  // st <- Pᵀ, dpt <- dSᵀ of step u (Sᵀ and dPᵀ waited for), packed into pa, da.  Entry (key j,
  // query i): j = key0 + g + 8 (e / 2), i = i0 + 8 nt + 2 tq + e % 2.
  auto p_ds_of = [&](int u) {
    const int h = hk * p.group + u / per_head;
    const int i0 = (first + u % per_head) * kBwdStep;
    const int64_t row_base = (static_cast<int64_t>(b) * p.H + h) * p.N;
    // Keys past M (their K and V rows zero-filled by TMA) hidden too: their dK / dV are never
    // stored, but dQ = dS K would meet 0 · inf where P = 2^(0 - lse2) overflows.
    const bool edge = i0 + kBwdStep > p.N || key0 + 16 > p.M || (p.causal && key0 + 15 > i0);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int i = i0 + 8 * nt + 2 * tq + c;
        const float l2 = i < p.N ? lse_log2(p.lse[row_base + i]) : INFINITY;
        const float dl = i < p.N ? p.delta[row_base + i] : 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int e = 2 * r + c;
          const bool visible =
              !edge || (i < p.N && key0 + g + 8 * r < p.M && (!p.causal || key0 + g + 8 * r <= i));
          const float pr = visible ? exp2_approx(st[nt][e] * p.scale_log2 - l2) : 0.f;
          st[nt][e] = pr;
          dpt[nt][e] = visible ? pr * (dpt[nt][e] - dl) : 0.f;  // dSᵀ (0 where hidden: no 0 · NaN)
        }
      }
    }
  };
  // Step u's Sᵀ and dPᵀ issued and waited for, then Pᵀ and dSᵀ (the one-step-at-a-time loops).
  auto st_dpt_of = [&](int u) {
    wgmma_fence();
    issue_st_dpt(u);
    wgmma_wait<0>();
    acc_fence(st);
    acc_fence(dpt);
    p_ds_of(u);
  };
  auto pack = [&] {
#pragma unroll
    for (int kc = 0; kc < kNt / 2; ++kc) {
      acc_to_a<kBF16, kNt>(pa[kc], st, kc);
      acc_to_a<kBF16, kNt>(da[kc], dpt, kc);
    }
  };

  mbar_wait(sm.big_full, 0);
  if constexpr (kDqAtomic) {
    constexpr bool kSplitCols = kD == 128;
    constexpr int kDsKeys = kSplitCols ? 128 : 64;  // the product's depth
    const int col0 = kSplitCols ? 64 * wk : 0;      // dQ columns of this consumer's share
    const int key_off = kSplitCols ? 0 : 64 * wk;   // keys of the block it multiplies
    float dq[64 / 8][4];
    for (int u = 0; u < steps; ++u) {
      st_dpt_of(u);
      // Buffer u % 2: its readers (step u - 2's products) are done, since every thread that
      // stores here has passed step u - 1's barrier, after its own wait for those products.
      uint16_t* ds = sm.ds + (u % kDsBuffers) * 2 * kStepElems;
      store_ds_transposed<kBF16>(ds + wk * kStepElems, dpt, warp, g, tq);
      pack();
      fence_proxy_async();  // the stores, visible to the tensor cores' reads (the async proxy)
      if constexpr (kSplitCols) {
        named_bar_sync(1, 256);  // both consumers' dS in place
      } else {
        named_bar_sync(1 + wk, 128);
      }
      // Zeroed here (the first k-step ignores them anyway) so that dQ's registers are dead
      // between the steps: read-modify-write operands of the wgmma asm, they were live across
      // the loop, beside Sᵀ, dPᵀ, Pᵀ and dSᵀ, and spilled 72 bytes.
#pragma unroll
      for (int dt = 0; dt < 64 / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;
      wgmma_fence();
      issue_dv_dk(u);
      const uint16_t* ds_a = ds + key_off / 64 * kStepElems;
#pragma unroll
      for (int kk = 0; kk < kDsKeys / 16; ++kk) {  // dQ share = dS K (K MN-major: imm-trans-b)
        const uint16_t* ak = ds_a + (kk / 4) * kStepElems + (kk % 4) * 16;
        const uint16_t* bk = sm.big0 + (col0 / kPanelCols) * kPanelElems + (key_off + 16 * kk) * kPanelCols;
        wgmma_ss<kBF16, 64, 1>(dq, smem_desc_sw128(ak, 16, 1024), smem_desc_sw128(bk, kBwdRows * kPanelCols * 2, 1024),
                               kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(dv);
      acc_fence(dk);
      acc_fence(pa);
      acc_fence(da);
      acc_fence(dq);
      mbar_arrive(&sm.ring_empty[u % kSm90Stages]);
      const int h = hk * p.group + u / per_head;
      const int i0 = (first + u % per_head) * kBwdStep;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = i0 + 16 * warp + g + 8 * r;
        if (i < p.N) {
          float* at = p.dq_acc + ((static_cast<int64_t>(b) * p.H + h) * p.N + i) * kD + col0 + 2 * tq;
#pragma unroll
          for (int dt = 0; dt < 64 / 8; ++dt) {
            atomicAdd(at + 8 * dt, dq[dt][2 * r]);
            atomicAdd(at + 8 * dt + 1, dq[dt][2 * r + 1]);
          }
        }
      }
    }
  } else if constexpr (kD > 64) {
    // D = 128: dK and dV hold 128 registers; the overlap's extra live set (Sᵀ, dPᵀ of step u
    // beside Pᵀ, dSᵀ of u - 1) spilled 208 bytes and made ptxas serialize the wgmmas: one step
    // at a time.
    for (int u = 0; u < steps; ++u) {
      st_dpt_of(u);
      pack();
      wgmma_fence();
      issue_dv_dk(u);
      wgmma_wait<0>();
      acc_fence(dv);
      acc_fence(dk);
      acc_fence(pa);
      acc_fence(da);
      mbar_arrive(&sm.ring_empty[u % kSm90Stages]);
    }
  } else if (steps > 0) {
    wgmma_fence();
    issue_st_dpt(0);
    wgmma_wait<0>();
    acc_fence(st);
    acc_fence(dpt);
    p_ds_of(0);
    pack();
    for (int u = 1; u < steps; ++u) {
      wgmma_fence();
      issue_st_dpt(u);
      issue_dv_dk(u - 1);
      wgmma_wait<1>();  // Sᵀ and dPᵀ of step u done; dV and dK of step u - 1 may still run
      acc_fence(st);
      acc_fence(dpt);
      p_ds_of(u);
      wgmma_wait<0>();
      acc_fence(dv);
      acc_fence(dk);
      acc_fence(pa);
      acc_fence(da);
      mbar_arrive(&sm.ring_empty[(u - 1) % kSm90Stages]);
      pack();
    }
    wgmma_fence();
    issue_dv_dk(steps - 1);
    wgmma_wait<0>();
    acc_fence(dv);
    acc_fence(dk);
    acc_fence(pa);
    acc_fence(da);
    mbar_arrive(&sm.ring_empty[(steps - 1) % kSm90Stages]);
  }
  store_dk_dv<kBF16, kD>(p.dk, p.dv, (static_cast<int64_t>(b) * p.Hk + hk) * p.M + key0, 1, g, p.M - key0, dk, dv,
                         p.scale, tq);
#endif
}

// ---------------------------------------------------------------------------------------------
// backward at D = 256: the head dim split between the two consumers.  The kernels above give
// each consumer 64 rows of its own; at D = 256 a consumer's dK and dV would be 256 registers
// (dQ 128 beside S and dP), and the tiles of 128 rows with 2-stage rings 256 KiB of shared
// memory.  Here both consumers own the same 64 rows of the block (query rows for dQ, keys for
// dK / dV) and each accumulates half of the output columns (consumer c: columns 128 c .. +127),
// and the one 64 x 64 score product per step that both need is not computed twice: consumer 0
// forms S and P, consumer 1 dP, and they meet in shared memory:
//   1. consumer 0: S = X0 Y0ᵀ -> P (0 where hidden); consumer 1: dP = X1 Y1ᵀ (each by 16
//      wgmma m64n64k16 over D, at once);
//   2. consumer 0 writes P (float32, each thread its own 32 slots) -> named barrier 1 ->
//      consumer 1 reads P, writes dS = P (dP - delta) (0 where hidden) over it in the same slots
//      -> named barrier 2 -> consumer 0 reads dS;
//   3. both, from registers: dQ[:, half] += dS K[:, half] (the dQ kernel: X = Q, dO; Y = K, V),
//      or dV[:, half] += Pᵀ dO[:, half] and dK[:, half] += dSᵀ Q[:, half] (the dK / dV kernel:
//      X = K, V; Y = Q, dO; its "rows" are keys and its "columns" query rows).
// The exchange buffer needs no second copy: consumer 0 writes P of step u + 1 after reading dS of
// step u, consumer 1 writes dS of step u + 1 after barrier 1 of u + 1 (consumer 0 past its read).
// Per consumer and step: a 64 x 64 x 256 product and 1 or 2 of 64 x 128 x 64, the 7 products per
// tile pair of the two-kernel backward with none repeated.  Shared memory: the two 64-row tiles
// (64 KiB), two 2-stage rings of 64-row tiles (128 KiB) and the exchange buffer (16 KiB).
// ---------------------------------------------------------------------------------------------

constexpr int kWideD = 256;
constexpr int kWideRows = 64;                      // the block's rows (both consumers')
constexpr int kWideHalf = kWideD / 2;              // output columns per consumer
constexpr int kWideSlots = kBwdStep / 8 * 4;       // a thread's entries of a 64 x 64 product: 32
constexpr size_t kWideXchgBytes = kWideSlots * 128 * sizeof(float);

constexpr size_t sm90_bwd_wide_smem_bytes() {
  return 1024 + static_cast<size_t>(kWideD / kPanelCols) * (2 * kWideRows + 2 * kSm90Stages * kBwdStep) *
                    kPanelCols * 2 +
         kWideXchgBytes + (1 + 2 * kSm90Stages) * sizeof(uint64_t);
}
static_assert(sm90_bwd_wide_smem_bytes() <= kSm90MaxSmem, "the D = 256 backward's tiles fit in shared memory");

// kKeys = false: dQ, one block per (64 query rows, h, b), K and V tiles of 64 keys streamed.
// kKeys = true: dK / dV, one block per (64 keys, kv head, b), Q and dO tiles of 64 rows for each
// query head of the GQA group (causal: from the first tile with a row >= the block's first key).
template <bool kBF16, bool kKeys>
__global__ void __launch_bounds__(kSm90Threads, 1)
    softmax_bwd_wide_sm90_kernel(const __grid_constant__ CUtensorMap tm_x0, const __grid_constant__ CUtensorMap tm_x1,
                                 const __grid_constant__ CUtensorMap tm_y0, const __grid_constant__ CUtensorMap tm_y1,
                                 const Sm90BwdParams p) {
#if !ATTNKIT_SM90A
  __trap();  // an sm_80 pass: never launched (sm90_available); no body to compile for it
#else
  constexpr int kP = kWideD / kPanelCols;
  constexpr int kNt = kBwdStep / 8;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  BwdSmem sm;
  sm.big0 = reinterpret_cast<uint16_t*>(base);
  sm.big1 = sm.big0 + kP * kStepElems;
  sm.ring0 = sm.big1 + kP * kStepElems;
  sm.ring1 = sm.ring0 + kSm90Stages * kP * kStepElems;
  float* xchg = reinterpret_cast<float*>(sm.ring1 + kSm90Stages * kP * kStepElems);
  sm.big_full = reinterpret_cast<uint64_t*>(xchg + kWideSlots * 128);
  sm.ring_full = sm.big_full + 1;
  sm.ring_empty = sm.ring_full + kSm90Stages;

  const int bx = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  // dQ: causal blocks longest first.  x0: the block's first row (query row or key).
  const int x0 = (kKeys || !p.causal ? bx : static_cast<int>(gridDim.x) - 1 - bx) * kWideRows;
  int first = 0, per_head = 0, steps = 0;
  if constexpr (kKeys) {
    first = p.causal ? x0 / kBwdStep : 0;  // query rows i < x0 see none of these keys
    per_head = max((p.N + kBwdStep - 1) / kBwdStep - first, 0);
    steps = p.group * per_head;
  } else {
    const int kv_end = p.causal ? min(p.M, min(x0 + kWideRows, p.N)) : p.M;
    steps = (kv_end + kBwdStep - 1) / kBwdStep;
  }
  // Step u's ring tile: its first row and its head.
  auto ring_row = [=](int u) { return kKeys ? (first + u % per_head) * kBwdStep : u * kBwdStep; };
  auto ring_head = [=](int u) { return kKeys ? head * p.group + u / per_head : head / p.group; };
  const int wg = static_cast<int>(threadIdx.x) / 128;
  init_bwd_barriers(sm);

  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce_bwd<kWideD, kWideRows>(sm, &tm_x0, &tm_x1, x0, head, &tm_y0, &tm_y1, steps, ring_row, ring_head, b);
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wc = wg - 1;  // 0: S and P; 1: dP and dS.  Output columns 128 wc .. 128 wc + 127.
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int xw = x0 + 16 * warp;  // this warp's first row
  // dQ: the rows' lse (base 2) and delta, once.
  float lse2[2] = {INFINITY, INFINITY}, delta[2] = {0.f, 0.f};
  if constexpr (!kKeys) {
    const int64_t row_base = (static_cast<int64_t>(b) * p.H + head) * p.N;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = xw + g + 8 * r;
      if (i < p.N) {
        lse2[r] = lse_log2(p.lse[row_base + i]);
        delta[r] = p.delta[row_base + i];
      }
    }
  }
  float acc0[kWideHalf / 8][4], acc1[kKeys ? kWideHalf / 8 : 1][4];  // dQ; or dV, dK
#pragma unroll
  for (int dt = 0; dt < kWideHalf / 8; ++dt) {
    acc0[dt][0] = acc0[dt][1] = acc0[dt][2] = acc0[dt][3] = 0.f;
    if constexpr (kKeys) acc1[dt][0] = acc1[dt][1] = acc1[dt][2] = acc1[dt][3] = 0.f;
  }
  float sc[kNt][4];
  uint32_t pa[kNt / 2][4], da[kNt / 2][4];
  auto ring_tile = [&](const uint16_t* ring, int u) { return ring + (u % kSm90Stages) * kP * kStepElems; };
  // Entry (nt, e) of this thread: block row xw + g + 8 (e / 2), tile column c0 + 8 nt + 2 tq + e % 2.
  // A query row i and a key j: visible iff i < N, j < M and (causal) j <= i.
  auto visible = [&](int c0, int nt, int e) {
    const int x = xw + g + 8 * (e >> 1), y = c0 + 8 * nt + 2 * tq + (e & 1);
    const int i = kKeys ? y : x, j = kKeys ? x : y;
    return i < p.N && j < p.M && (!p.causal || j <= i);
  };

  // Step u's score product (S for consumer 0, dP for consumer 1), issued and committed.
  auto issue_score = [&](int u) {
    mbar_wait(&sm.ring_full[u % kSm90Stages], static_cast<uint32_t>(u / kSm90Stages) & 1u);
    issue_abt<kBF16, kBwdStep, kWideD, kWideRows, kBwdStep>(sc, wc == 0 ? sm.big0 : sm.big1, 0,
                                                             ring_tile(wc == 0 ? sm.ring0 : sm.ring1, u));
    wgmma_commit();
  };
  // Step u's P / dS exchange (its score product waited for): sc <- dS, and (dK / dV) pa <- P.
  auto exchange = [&](int u) {
    const int c0 = ring_row(u);
    // Only tiles that cross N, M or the diagonal test each entry (warp-uniform).
    const bool edge = kKeys ? (c0 + kBwdStep > p.N || xw + 16 > p.M || (p.causal && xw + 15 > c0))
                            : (xw + 16 > p.N || c0 + kBwdStep > p.M || (p.causal && c0 + kBwdStep - 1 > xw));
    acc_fence(sc);
    if (wc == 0) {
      // dK / dV: the columns' lse (base 2), per step.
      float l2[kNt][2];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if constexpr (kKeys) {
            const int i = c0 + 8 * nt + 2 * tq + c;
            const int64_t row_base = (static_cast<int64_t>(b) * p.H + ring_head(u)) * p.N;
            l2[nt][c] = i < p.N ? lse_log2(p.lse[row_base + i]) : INFINITY;
          } else {
            l2[nt][c] = 0.f;
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float l = kKeys ? l2[nt][e & 1] : lse2[e >> 1];
          sc[nt][e] = !edge || visible(c0, nt, e) ? exp2_approx(sc[nt][e] * p.scale_log2 - l) : 0.f;
          xchg[(4 * nt + e) * 128 + tid] = sc[nt][e];
        }
      }
      if constexpr (kKeys) {
#pragma unroll
        for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
      }
      named_bar_sync(1, 256);  // P in place
      named_bar_sync(2, 256);  // dS in place
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = xchg[(4 * nt + e) * 128 + tid];
      }
    } else {
      float dl[kNt][2];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if constexpr (kKeys) {
            const int i = c0 + 8 * nt + 2 * tq + c;
            const int64_t row_base = (static_cast<int64_t>(b) * p.H + ring_head(u)) * p.N;
            dl[nt][c] = i < p.N ? p.delta[row_base + i] : 0.f;
          } else {
            dl[nt][c] = 0.f;
          }
        }
      }
      named_bar_sync(1, 256);  // P in place
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& slot = xchg[(4 * nt + e) * 128 + tid];
          pr[e] = slot;
          const float d = kKeys ? dl[nt][e & 1] : delta[e >> 1];
          // dS (0 where hidden, even where dP or delta is NaN: no 0 · NaN)
          sc[nt][e] = !edge || visible(c0, nt, e) ? pr[e] * (sc[nt][e] - d) : 0.f;
          slot = sc[nt][e];
        }
        if constexpr (kKeys) {
          if (nt % 2 == 0) {
            pa[nt / 2][0] = pack2<kBF16>(pr[0], pr[1]);
            pa[nt / 2][1] = pack2<kBF16>(pr[2], pr[3]);
          } else {
            pa[nt / 2][2] = pack2<kBF16>(pr[0], pr[1]);
            pa[nt / 2][3] = pack2<kBF16>(pr[2], pr[3]);
          }
        }
      }
      named_bar_sync(2, 256);  // dS in place
    }
  };
  const int half = wc * (kWideHalf / kPanelCols) * kStepElems;  // panels 2 wc, 2 wc + 1 of a ring tile
  auto pack_ds = [&] {
#pragma unroll
    for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(da[kc], sc, kc);
  };

  mbar_wait(sm.big_full, 0);
  if constexpr (kKeys) {
    // dK / dV: one step at a time (dK, dV 128 registers, P and dS 32 more while their products
    // run: the next scores' 32 beside them measured nothing yet and would need P packed apart).
    for (int u = 0; u < steps; ++u) {
      wgmma_fence();
      issue_score(u);
      wgmma_wait<0>();
      exchange(u);
      pack_ds();
      wgmma_fence();
      issue_pb<kBF16, kWideHalf, kBwdStep, kBwdStep>(acc0, pa, ring_tile(sm.ring1, u) + half);  // dV += Pᵀ dO
      issue_pb<kBF16, kWideHalf, kBwdStep, kBwdStep>(acc1, da, ring_tile(sm.ring0, u) + half);  // dK += dSᵀ Q
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(acc0);
      acc_fence(acc1);
      acc_fence(pa);
      acc_fence(da);
      mbar_arrive(&sm.ring_empty[u % kSm90Stages]);
    }
  } else if (steps > 0) {
    // dQ, FlashAttention-3's intra-warpgroup overlap: step u's score product is issued with step
    // u - 1's dQ product, and step u's exchange runs while that product does (dQ, dS and the
    // scores: 112 registers).  The loop is the forward's shape (no product issued or waited for
    // under a condition inside it: ptxas then serialized the wgmmas, C7514).
    wgmma_fence();
    issue_score(0);
    wgmma_wait<0>();
    exchange(0);
    pack_ds();
    for (int u = 1; u < steps; ++u) {
      wgmma_fence();
      issue_score(u);                                                                                  // group 1
      issue_pb<kBF16, kWideHalf, kBwdStep, kBwdStep>(acc0, da, ring_tile(sm.ring0, u - 1) + half);  // dQ += dS K
      wgmma_commit();                                                                                  // group 2
      wgmma_wait<1>();  // step u's scores done; step u - 1's dQ product may still run
      exchange(u);
      wgmma_wait<0>();
      acc_fence(acc0);
      acc_fence(da);
      mbar_arrive(&sm.ring_empty[(u - 1) % kSm90Stages]);
      pack_ds();
    }
    wgmma_fence();
    issue_pb<kBF16, kWideHalf, kBwdStep, kBwdStep>(acc0, da, ring_tile(sm.ring0, steps - 1) + half);
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(acc0);
    acc_fence(da);
    mbar_arrive(&sm.ring_empty[(steps - 1) % kSm90Stages]);
  }

  // The rows' halves: dQ · scale; or dV, and dK · scale.
  const int64_t out_base = (static_cast<int64_t>(b) * (kKeys ? p.Hk : p.H) + head) * (kKeys ? p.M : p.N);
  const int rows = kKeys ? p.M : p.N;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int x = xw + g + 8 * r;
    if (x < rows) {
      const int64_t at = (out_base + x) * kWideD + wc * kWideHalf + 2 * tq;
#pragma unroll
      for (int dt = 0; dt < kWideHalf / 8; ++dt) {
        if constexpr (kKeys) {
          *reinterpret_cast<uint32_t*>(p.dv + at + 8 * dt) = pack2<kBF16>(acc0[dt][2 * r], acc0[dt][2 * r + 1]);
          *reinterpret_cast<uint32_t*>(p.dk + at + 8 * dt) =
              pack2<kBF16>(acc1[dt][2 * r] * p.scale, acc1[dt][2 * r + 1] * p.scale);
        } else {
          *reinterpret_cast<uint32_t*>(p.dq + at + 8 * dt) =
              pack2<kBF16>(acc0[dt][2 * r] * p.scale, acc0[dt][2 * r + 1] * p.scale);
        }
      }
    }
  }
#endif
}

// dq = dq_acc · scale rounded to the input dtype (ATTNKIT_CUDA_SM90=atomic), 8 elements a thread
// (n is a multiple of 8: D is 64 or 128).
template <bool kBF16>
__global__ void __launch_bounds__(256) sm90_dq_convert_kernel(const float* acc, uint16_t* dq, int64_t n, float scale) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
#pragma unroll
  for (int c = 0; c < 8; c += 2) {
    *reinterpret_cast<uint32_t*>(dq + i + c) = pack2<kBF16>(acc[i + c] * scale, acc[i + c + 1] * scale);
  }
}

// Writes 1 when the device code was built for sm_90a (wgmma and setmaxnreg present), else 0.
__global__ void sm90a_probe_kernel(int* out) { *out = ATTNKIT_SM90A; }

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

// ATTNKIT_CUDA_SM90 (read per call: cheap, and tests switch it): "1" turns the kernels on (the
// forward's overlapped consumer loop and the backward), "pingpong" the overlapped loop with the
// consumers' ping-pong and the backward, "simple" the forward without overlap and the backward,
// "fwd" the overlapped forward only (softmax.cu's backward), "atomic" the overlapped forward and
// the backward in one kernel that adds dQ with atomics (not bitwise deterministic); anything
// else, off.
// "persistent": the overlapped forward on the persistent scheduler (kPersistent), the backward
// as "1".
enum class Sm90Mode { kOff, kOverlap, kPingPong, kSimple, kForwardOnly, kAtomic, kPersistent };
Sm90Mode sm90_requested() {
  const char* env = std::getenv("ATTNKIT_CUDA_SM90");
  if (env == nullptr) return Sm90Mode::kOff;
  if (std::strcmp(env, "1") == 0) return Sm90Mode::kOverlap;
  if (std::strcmp(env, "pingpong") == 0) return Sm90Mode::kPingPong;
  if (std::strcmp(env, "simple") == 0) return Sm90Mode::kSimple;
  if (std::strcmp(env, "fwd") == 0) return Sm90Mode::kForwardOnly;
  if (std::strcmp(env, "atomic") == 0) return Sm90Mode::kAtomic;
  if (std::strcmp(env, "persistent") == 0) return Sm90Mode::kPersistent;
  return Sm90Mode::kOff;
}

// Whether this build carries the sm_90a code and the current device is a compute capability 9.0
// one, probed once per device.
bool sm90_available(int device) {
  static std::mutex mu;
  static int cached[64];
  static bool known[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return false;
  if (known[device]) return cached[device] != 0;
  // The probe allocates and copies: not inside a CUDA graph capture (answer "no" this time, and
  // probe at the next call outside one).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return false;
  }
  known[device] = true;
  cached[device] = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    (void)cudaGetLastError();
    return false;
  }
  int* flag = nullptr;
  int host = 0;
  if (cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
    sm90a_probe_kernel<<<1, 1>>>(flag);
    if (cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) host = 0;
    (void)cudaFree(flag);
  }
  (void)cudaGetLastError();  // a build without sm_90 code fails the probe launch: not available
  cached[device] = host;
  return host != 0;
}

// The device's number of SMs (the persistent grid), asked once per device.
int sm_count(int device) {
  static std::mutex mu;
  static int cached[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return 1;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();
      n = 1;
    }
    cached[device] = n;
  }
  return cached[device];
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, without linking libcuda (nullptr when unavailable).
EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// TMA strides are nonzero multiples of 16 bytes: x's, except that a dim of size 1 (never stepped)
// gets the extent of the dims inside it.
bool tma_strides_ok(const at::Tensor& x) {
  if (x.stride(3) != 1 || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (x.size(d) > 1 && (x.stride(d) <= 0 || (x.stride(d) * 2) % 16 != 0)) return false;
  }
  return true;
}

// The 4-d map (D, L, heads, B) of x [B, heads, L, D] with boxes of 64 x `rows` x 1 x 1 elements
// and the 128-byte swizzle.
bool make_map(CUtensorMap* map, const at::Tensor& x, bool bf16, uint32_t rows) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(x.size(3)), static_cast<cuuint64_t>(x.size(2)),
                              static_cast<cuuint64_t>(x.size(1)), static_cast<cuuint64_t>(x.size(0))};
  cuuint64_t strides[3];
  cuuint64_t inner = static_cast<cuuint64_t>(x.size(3)) * 2;
  for (int i = 0; i < 3; ++i) {
    const int d = 2 - i;  // tensor dim of map dim i + 1
    strides[i] = x.size(d) > 1 ? static_cast<cuuint64_t>(x.stride(d)) * 2 : inner;
    inner = strides[i] * static_cast<cuuint64_t>(std::max<int64_t>(x.size(d), 1));
  }
  const cuuint32_t box[4] = {kPanelCols, rows, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode_tiled()(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                        x.data_ptr(), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <bool kBF16, int kD>
void launch_sm90(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Sm90FwdParams& p,
                 dim3 grid, cudaStream_t stream, Sm90Mode mode) {
  constexpr size_t smem = sm90_smem_bytes<kD>();
  if (mode == Sm90Mode::kSimple) {
    allow_smem(softmax_fwd_sm90_kernel<kBF16, kD, false>, smem);
    softmax_fwd_sm90_kernel<kBF16, kD, false><<<grid, kSm90Threads, smem, stream>>>(tq, tk, tv, p);
  } else if (mode == Sm90Mode::kPingPong) {
    allow_smem(softmax_fwd_sm90_kernel<kBF16, kD, true, true>, smem);
    softmax_fwd_sm90_kernel<kBF16, kD, true, true><<<grid, kSm90Threads, smem, stream>>>(tq, tk, tv, p);
  } else if (mode == Sm90Mode::kPersistent) {
    allow_smem(softmax_fwd_sm90_kernel<kBF16, kD, true, false, true>, smem);
    softmax_fwd_sm90_kernel<kBF16, kD, true, false, true><<<grid, kSm90Threads, smem, stream>>>(tq, tk, tv, p);
  } else {
    allow_smem(softmax_fwd_sm90_kernel<kBF16, kD, true>, smem);
    softmax_fwd_sm90_kernel<kBF16, kD, true><<<grid, kSm90Threads, smem, stream>>>(tq, tk, tv, p);
  }
}

// maps: the dQ kernel's q and dO (128-row boxes; 64 at D = 256), k and v (64-row boxes), then the
// dK / dV kernel's k and v (128-row boxes; 64 at D = 256), q and dO (64-row boxes).
// atomic: the dK / dV kernel adds dQ / scale to p.dq_acc (zeroed), then sm90_dq_convert_kernel.
template <bool kBF16, int kD>
void launch_sm90_bwd_narrow(const CUtensorMap (&maps)[8], const Sm90BwdParams& p, int64_t B, cudaStream_t stream,
                            bool atomic) {
  constexpr size_t smem = sm90_bwd_smem_bytes<kD>();
  if (atomic) {
    constexpr size_t smem_ds = sm90_bwd_smem_bytes<kD, true>();
    if (p.M > 0) {
      allow_smem(softmax_bwd_dkdv_sm90_kernel<kBF16, kD, true>, smem_ds);
      const dim3 grid(static_cast<unsigned>((p.M + kBwdRows - 1) / kBwdRows), static_cast<unsigned>(p.Hk),
                      static_cast<unsigned>(B));
      softmax_bwd_dkdv_sm90_kernel<kBF16, kD, true>
          <<<grid, kSm90Threads, smem_ds, stream>>>(maps[4], maps[5], maps[6], maps[7], p);
    }
    const int64_t n = B * p.H * static_cast<int64_t>(p.N) * kD;
    if (n > 0) {
      sm90_dq_convert_kernel<kBF16><<<static_cast<unsigned>((n / 8 + 255) / 256), 256, 0, stream>>>(p.dq_acc, p.dq, n,
                                                                                                   p.scale);
    }
    return;
  }
  if (p.N > 0) {
    allow_smem(softmax_bwd_dq_sm90_kernel<kBF16, kD>, smem);
    const dim3 grid(static_cast<unsigned>((p.N + kBwdRows - 1) / kBwdRows), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(B));
    softmax_bwd_dq_sm90_kernel<kBF16, kD><<<grid, kSm90Threads, smem, stream>>>(maps[0], maps[1], maps[2], maps[3], p);
  }
  if (p.M > 0) {
    allow_smem(softmax_bwd_dkdv_sm90_kernel<kBF16, kD>, smem);
    const dim3 grid(static_cast<unsigned>((p.M + kBwdRows - 1) / kBwdRows), static_cast<unsigned>(p.Hk),
                    static_cast<unsigned>(B));
    softmax_bwd_dkdv_sm90_kernel<kBF16, kD><<<grid, kSm90Threads, smem, stream>>>(maps[4], maps[5], maps[6], maps[7], p);
  }
}

// D = 256: the two wide kernels (every map with 64-row boxes; `atomic` does not apply: dQ has
// its own kernel).
template <bool kBF16, int kD>
void launch_sm90_bwd(const CUtensorMap (&maps)[8], const Sm90BwdParams& p, int64_t B, cudaStream_t stream,
                     bool atomic) {
  if constexpr (kD == kWideD) {
    constexpr size_t wide = sm90_bwd_wide_smem_bytes();
    if (p.N > 0) {
      allow_smem(softmax_bwd_wide_sm90_kernel<kBF16, false>, wide);
      const dim3 grid(static_cast<unsigned>((p.N + kWideRows - 1) / kWideRows), static_cast<unsigned>(p.H),
                      static_cast<unsigned>(B));
      softmax_bwd_wide_sm90_kernel<kBF16, false><<<grid, kSm90Threads, wide, stream>>>(maps[0], maps[1], maps[2],
                                                                                         maps[3], p);
    }
    if (p.M > 0) {
      allow_smem(softmax_bwd_wide_sm90_kernel<kBF16, true>, wide);
      const dim3 grid(static_cast<unsigned>((p.M + kWideRows - 1) / kWideRows), static_cast<unsigned>(p.Hk),
                      static_cast<unsigned>(B));
      softmax_bwd_wide_sm90_kernel<kBF16, true><<<grid, kSm90Threads, wide, stream>>>(maps[4], maps[5], maps[6],
                                                                                        maps[7], p);
    }
  } else {
    launch_sm90_bwd_narrow<kBF16, kD>(maps, p, B, stream, atomic);
  }
}

// The mode the call takes: kOff where the kernels do not apply (backward: dout given).
Sm90Mode sm90_mode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* dout) {
  const Sm90Mode mode = sm90_requested();
  const int64_t D = q.size(3);
  // "fwd" keeps softmax.cu's backward, except at D = 256, which only these kernels take.
  if (mode == Sm90Mode::kOff || (dout != nullptr && mode == Sm90Mode::kForwardOnly && D != kWideD))
    return Sm90Mode::kOff;
  if ((D != 64 && D != 128 && D != kWideD) || v.size(3) != D || q.numel() == 0 || k.numel() == 0)
    return Sm90Mode::kOff;
  if (!tma_strides_ok(q) || !tma_strides_ok(k) || !tma_strides_ok(v) || (dout != nullptr && !tma_strides_ok(*dout)))
    return Sm90Mode::kOff;
  c10::cuda::CUDAGuard guard(q.device());
  return sm90_available(q.device().index()) && encode_tiled() != nullptr ? mode : Sm90Mode::kOff;
}

}  // namespace

// Entry points (csrc/cuda/launch.h): checked inputs, no mask.

bool softmax_sm90_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor* dout) {
  return sm90_mode(q, k, v, dout) != Sm90Mode::kOff;
}

bool softmax_sm90_enabled(int device) {
  static_assert(kWideD == cuda_limits::kSm90WideHeadDim, "launch.h names the wide kernels' head dim");
  if (sm90_requested() == Sm90Mode::kOff || encode_tiled() == nullptr) return false;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return sm90_available(device);
}

std::optional<std::tuple<at::Tensor, at::Tensor>> softmax_fwd_cuda_sm90(const at::Tensor& q, const at::Tensor& k,
                                                                        const at::Tensor& v, double scale,
                                                                        bool is_causal) {
  const Sm90Mode mode = sm90_mode(q, k, v, nullptr);
  if (mode == Sm90Mode::kOff) return std::nullopt;
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Hk = k.size(1), M = k.size(2);
  c10::cuda::CUDAGuard guard(q.device());
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  CUtensorMap tq, tk, tv;
  const uint32_t block_n = D == 256 ? kFwdBlockN<256> : kFwdBlockN<128>;
  if (!make_map(&tq, q, bf16, kSm90BlockM) || !make_map(&tk, k, bf16, block_n) || !make_map(&tv, v, bf16, block_n)) {
    return std::nullopt;
  }
  at::Tensor out = at::empty({B, H, N, D}, q.options());
  at::Tensor lse = at::empty({B, H, N}, q.options().dtype(at::kFloat));
  Sm90FwdParams p;
  p.out = mutable_bits(out);
  p.lse = lse.data_ptr<float>();
  p.H = static_cast<int>(H);
  p.group = static_cast<int>(H / Hk);
  p.N = static_cast<int>(N);
  p.M = static_cast<int>(M);
  p.B = static_cast<int>(B);
  p.q_blocks = static_cast<int>((N + kSm90BlockM - 1) / kSm90BlockM);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = is_causal;
  // One block per tile, or (persistent) at most one per SM, each taking every gridDim.x-th tile.
  const int64_t tiles = static_cast<int64_t>(p.q_blocks) * H * B;
  const dim3 grid = mode == Sm90Mode::kPersistent
                        ? dim3(static_cast<unsigned>(std::min<int64_t>(tiles, sm_count(q.device().index()))))
                        : dim3(static_cast<unsigned>(p.q_blocks), static_cast<unsigned>(H), static_cast<unsigned>(B));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (bf16) {
    D == 64    ? launch_sm90<true, 64>(tq, tk, tv, p, grid, stream, mode)
    : D == 128 ? launch_sm90<true, 128>(tq, tk, tv, p, grid, stream, mode)
               : launch_sm90<true, 256>(tq, tk, tv, p, grid, stream, mode);
  } else {
    D == 64    ? launch_sm90<false, 64>(tq, tk, tv, p, grid, stream, mode)
    : D == 128 ? launch_sm90<false, 128>(tq, tk, tv, p, grid, stream, mode)
               : launch_sm90<false, 256>(tq, tk, tv, p, grid, stream, mode);
  }
  return std::make_tuple(out, lse);
}

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> softmax_bwd_cuda_sm90(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
    const at::Tensor& delta, double scale, bool is_causal) {
  // (softmax_bwd_cuda asked softmax_sm90_applies first, before computing delta.)
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Hk = k.size(1), M = k.size(2);
  c10::cuda::CUDAGuard guard(q.device());
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  CUtensorMap maps[8];
  const uint32_t big = D == kWideD ? kWideRows : kBwdRows;  // the wide kernels' blocks: 64 rows
  if (!make_map(&maps[0], q, bf16, big) || !make_map(&maps[1], dout, bf16, big) ||
      !make_map(&maps[2], k, bf16, kBwdStep) || !make_map(&maps[3], v, bf16, kBwdStep) ||
      !make_map(&maps[4], k, bf16, big) || !make_map(&maps[5], v, bf16, big) ||
      !make_map(&maps[6], q, bf16, kBwdStep) || !make_map(&maps[7], dout, bf16, kBwdStep)) {
    return std::nullopt;
  }
  at::Tensor dq = at::empty({B, H, N, D}, q.options());
  at::Tensor dk = at::empty({B, Hk, M, D}, q.options());
  at::Tensor dv = at::empty({B, Hk, M, D}, q.options());
  // (torch.use_deterministic_algorithms(True): the two-kernel backward, whose dQ has no atomics.)
  const bool atomic = sm90_requested() == Sm90Mode::kAtomic && D != kWideD &&
                      !at::globalContext().deterministicAlgorithms();
  at::Tensor dq_acc = atomic ? at::zeros({B, H, N, D}, q.options().dtype(at::kFloat)) : at::Tensor();
  Sm90BwdParams p;
  p.dq_acc = atomic ? dq_acc.data_ptr<float>() : nullptr;
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq = mutable_bits(dq);
  p.dk = mutable_bits(dk);
  p.dv = mutable_bits(dv);
  p.H = static_cast<int>(H);
  p.Hk = static_cast<int>(Hk);
  p.group = static_cast<int>(H / Hk);
  p.N = static_cast<int>(N);
  p.M = static_cast<int>(M);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = is_causal;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (bf16) {
    D == 64    ? launch_sm90_bwd<true, 64>(maps, p, B, stream, atomic)
    : D == 128 ? launch_sm90_bwd<true, 128>(maps, p, B, stream, atomic)
               : launch_sm90_bwd<true, 256>(maps, p, B, stream, atomic);
  } else {
    D == 64    ? launch_sm90_bwd<false, 64>(maps, p, B, stream, atomic)
    : D == 128 ? launch_sm90_bwd<false, 128>(maps, p, B, stream, atomic)
               : launch_sm90_bwd<false, 256>(maps, p, B, stream, atomic);
  }
  return std::make_tuple(dq, dk, dv);
}

}  // namespace attnkit

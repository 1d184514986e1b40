// CUDA C++ kernels of softmax attention (FlashAttention-2 style) for attnkit::softmax_fwd and
// attnkit::softmax_bwd (schemas in csrc/ops.cpp): the entry points softmax_fwd_cuda /
// softmax_bwd_cuda (csrc/cuda/launch.h), which csrc/checks/softmax.cpp registers for the CUDA
// dispatch key after running the ops' input checks (nothing here throws on bad input: issue 10).
//
// STATUS.  Checked: compiles with nvcc -c for sm_80 and sm_90a against torch's headers
// (.ci/compile_cuda.sh); ptxas -v (CUDA 13.0), registers sm_80 / sm_90a: forward D = 128
// 227 / 229, D = 64 148 / 161; dQ 255 / 255, 168 / 166; dK/dV 245 / 245, 242 / 244; no
// spills.  The device code (this file up to "host side") runs on the CPU in
// tests/csrc/test_softmax_cuda_emulated.py (tests/csrc/cuda_emulator: every thread a
// fiber, ldmatrix / mma.m16n8k16 / cp.async and its groups from the PTX ISA, shared memory exact
// and NaN-filled, every access bounds-checked) against the float64 reference: fp16/bf16, D
// 64/128, causal, GQA, bool/float masks, odd N and M, empty N or M, non-finite inputs.
// Backward variants (session 15, ATTNKIT_CUDA_SOFTMAX_BWD=stream|fused, see BwdVariant; default:
// the kernels above, unchanged): emulated on every unmasked case with mutants of their own, not
// yet run on a GPU.  ptxas -v sm_80 / sm_90a, D = 128 | 64: stream dQ 255 / 255 | 226 / 168,
// stream dK/dV 247 / 244 | 241 / 242, fused dK/dV 251 / 254 | 246 / 245; no spills.
// On a GPU: tests/csrc/test_softmax_cuda.py (`pytest -m gpu`) passed in full on an H100 (sm_90,
// torch 2.11 + CUDA 13.0, commit 4a5f870, bench/RESULTS.md "session 8") with the forward of
// before issue 27 (4 warps x 16 rows, K/V tiles loaded synchronously into padded rows): 12.3 ms
// bf16 B=4 H=8 N=8192 D=128, 0.13x SDPA.  The pipelined forward below (issue 27) has not run on
// a GPU yet (target: >= 330 TFLOP/s there), nor has the pipelined backward.
//
// WHAT IT COMPUTES.  q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,D] (float16 or bfloat16; D = 64 or
// 128, value's head dim equal to query's; other head dims fail the op's check
// (csrc/checks/softmax.cpp) with a message that names them, so the Python side can route
// elsewhere).  GQA: query head h reads kv head h / (H/Hk).
// Optional mask [B,H,N,M] (any strides, stride-0 broadcast welcome; each dim may also be 1):
// bool (True = attend) or float16/bfloat16/float32/float64 (added to the scaled scores).
// is_causal: key j is visible to query i iff j <= i (top-left; N != M allowed).
// The score options of the schema (issue 28: window_left / window_right, softcap, alibi_slopes)
// are not computed here yet: the registered CUDA implementation (csrc/checks/softmax.cpp) takes
// them and its check refuses any non-default one with a message naming it, before the entry
// points below -- whose signatures (csrc/cuda/launch.h) stay without them until the kernels
// compute them -- are reached.  (Learned sinks need no kernel: attnkit/score_options.py applies
// them around these ops.)
// Forward -> out [B,H,N,D] (input dtype), lse [B,H,N] float32; a row with no visible key gives
// out 0 and lse -inf.  Backward -> dq, dk, dv (contiguous, input dtype); dk/dv summed over the
// query heads of each GQA group.
//
// HOW.  Each warp owns 16 rows of a tile and multiplies with tensor-core mma.sync.m16n8k16
// (fp16/bf16 operands, fp32 accumulation), through inline PTX.  Fragments are read from shared
// memory with ldmatrix.x4 (.trans for the operands stored key-major, like V in P·V), from
// XOR-swizzled rows (flash_tiles.cuh), so the loads are bank-conflict free; every tile comes
// in through cp.async, the streamed ones through a ring of 2-3 stages (one __syncthreads per tile).  The accumulator of one product (C layout) is re-packed in registers as
// the A operand of the next (S -> P -> P·V), as in FlashAttention-2.
//  - forward (softmax_fwd_kernel, see there): one block of 8 warps per (128 queries, h, b), Q
//    fragments and O in registers, K/V tiles of 64 keys streamed through a 2- (D = 128) or
//    3-stage (D = 64) cp.async ring; online softmax in the base-2 domain (scores multiplied by
//    scale·log2 e); writes out, lse.
//  - backward: thread blocks of 4 warps (64-row tiles).
//    (1) delta = rowsum(dO ∘ O) per query row (fp32);
//    (2) dQ: one block per (64 queries, h, b), loops over key tiles (the forward's cp.async ring:
//        2 stages at D = 128, 3 at D = 64), recomputes P = exp(S - lse), dP = dO·Vᵀ,
//        dS = P ∘ (dP - delta), dQ += dS·K (no atomics);
//    (3) dK/dV: one block per (64 keys, kv head, b), loops over the query heads of its GQA
//        group and their query tiles (a 3-stage cp.async ring across heads), with
//        Sᵀ = K·Qᵀ: dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dK += dSᵀ·Q (no atomics; deterministic).
//  - causal: key tiles entirely above the diagonal are skipped (forward, dQ), and so are the
//    query tiles entirely before a key tile (dK/dV).  Tiles are bounds-checked (zero-filled
//    past N / M and masked), so any N and M work.
//  - masked entries are -inf in the scores (forward) or P = 0 (backward); the running maximum
//    of a row that has seen only -inf is replaced by 0 when exponentiating, so no -inf - -inf
//    NaN; a row with lse = -inf is treated as lse = +inf in the backward (P = 0, zero grads).
// Inputs need only a contiguous last dim with 16-byte aligned rows; others are copied first.

#include "host_utils.cuh"  // first: torch headers and host helpers

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "mma_sm80.cuh"
#include "flash_tiles.cuh"

namespace attnkit {
namespace {

// Tile geometry (kThreads, kBlockQ, kBlockK, kDkdvBlockQ), tile copies and steps:
// flash_tiles.cuh, shared with sparse.cu; the ring stages and shared-memory sizes per kernel here.

// ---------------------------------------------------------------------------------------------
// mask
// ---------------------------------------------------------------------------------------------

enum MaskKind : int { kNoMask = 0, kBoolMask, kF32Mask, kF16Mask, kBF16Mask, kF64Mask };

struct Mask {
  const void* ptr;
  int kind;
  int64_t sb, sh, sn, sm;  // element strides (0 where broadcast)
};

// A float mask's value at element offset `off`, times log2(e).
__device__ __forceinline__ float mask_bias_log2(const Mask& mk, int64_t off) {
  switch (mk.kind) {
    case kF32Mask:
      return static_cast<const float*>(mk.ptr)[off] * kLog2e;
    case kF16Mask:
      return __half2float(static_cast<const __half*>(mk.ptr)[off]) * kLog2e;
    case kBF16Mask:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(mk.ptr)[off]) * kLog2e;
    case kF64Mask:
      return static_cast<float>(static_cast<const double*>(mk.ptr)[off]) * kLog2e;
    default:
      return 0.f;
  }
}

// Applies the mask to the base-2 score x of a visible (query i, key j); returns whether the
// entry stays visible.  A bool mask hides the entry (its score is never used, so a NaN there
// stays out, as SDPA's masked_fill keeps it out -- an added -inf kept NaN + -inf = NaN, issue
// 15); a float mask adds value · log2(e) (NaN + -inf is NaN there, as in SDPA).  `base` = b · sb
// + h · sh.
__device__ __forceinline__ bool apply_mask_log2(const Mask& mk, int64_t base, int i, int j, float& x) {
  if (mk.kind == kNoMask) return true;
  const int64_t off = base + static_cast<int64_t>(i) * mk.sn + static_cast<int64_t>(j) * mk.sm;
  if (mk.kind == kBoolMask) return static_cast<const uint8_t*>(mk.ptr)[off] != 0;
  x += mask_bias_log2(mk, off);
  return true;
}

// Whether (query i, key j) is visible -- a real key, causally allowed, not masked out -- with the
// mask's bias added to the base-2 score x.  Rows past N (the last query tile's padding, whose
// results are dropped) read no mask; callers for which such rows must count as hidden (dK/dV)
// test i < N first.  P: FwdParams or BwdParams.
template <class P>
__device__ __forceinline__ bool visible_log2(const P& p, int64_t base, int i, int j, float& x) {
  return j < p.M && !(p.causal && j > i) && (i >= p.N || apply_mask_log2(p.mask, base, i, j, x));
}

// ---------------------------------------------------------------------------------------------
// element helpers, PTX helpers: mma_sm80.cuh (pack2, to_float, exp2_approx, mma16816, ldsm_x4,
// ldsm_x4_trans, cp_async16, cp_async_commit, cp_async_wait, acc_to_a).
// Tile steps: flash_tiles.cuh (cp_async_tile and the swizzled fragment loaders load_a_swz,
// load_b_nk2_swz, load_b_kn2_swz; online_softmax_update, for_each_entry, store_out_lse,
// store_rows, store_dk_dv).  Its padded-layout steps (load_tile, mma_abt, ...) are sparse.cu's.
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------

struct FwdParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;  // contiguous [B, H, N, D]
  float* lse;     // contiguous [B, H, N]
  int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn;  // element strides
  Mask mask;
  int H, group, N, M;  // group = H / Hk
  float scale_log2;    // scale · log2(e): the scores live in the base-2 domain
  bool causal;
};

// Key / value tile `tile` (keys tile * kBlockK ..) of one (batch, KV head) into ring stage
// tile % kS of k_s / v_s (the forward's and the dQ kernel's K/V ring; P: FwdParams or BwdParams).
template <int kThreads, int kBlockK, int kD, int kS, class P>
__device__ __forceinline__ void cp_async_kv_stage(uint16_t* k_s, uint16_t* v_s, const uint16_t* k_g,
                                                  const uint16_t* v_g, const P& p, int tile) {
  constexpr int kTile = kBlockK * kD;
  const int k0 = tile * kBlockK, stage = tile % kS;
  const int valid = min(kBlockK, p.M - k0);
  cp_async_tile<kThreads, kBlockK, kD>(k_s + stage * kTile, k_g + k0 * p.k_sn, p.k_sn, valid);
  cp_async_tile<kThreads, kBlockK, kD>(v_s + stage * kTile, v_g + k0 * p.v_sn, p.v_sn, valid);
}

// The pipelined forward (issue 27: FlashAttention-2 class on sm_80+).  A block of kFwdWarps = 8
// warps owns kFwdBlockQ = 128 query rows of one (b, h); warp w owns rows 16w .. 16w + 15.  Its Q
// fragments are loaded once into registers; its output accumulators O, running max and sum stay
// in registers across the whole key loop; P goes from the S accumulators straight into the A
// operand of P·V (acc_to_a): no round trip through shared memory.  K and V tiles of kFwdBlockK =
// 64 keys stream through a ring of kFwdStages<kD> shared-memory stages filled by cp.async, in the
// swizzled layout of flash_tiles.cuh (conflict-free cp.async writes and ldmatrix reads, no padding):
//   prologue: Q (group 0), then tiles 0 .. S-2 (one group each);
//   key tile j: wait until tile j's group has landed (cp.async.wait_group S-2: the S-2 newer
//   groups may still be in flight), __syncthreads (every thread's copies of tile j visible, and
//   every warp done with tile j-1, whose stage the next copy reuses), issue tile j+S-1 into that
//   stage and commit (an empty group past the last tile, so that the counting stays uniform),
//   then S = Q Kᵀ, online softmax (base 2, scale·log2 e folded into one multiply), O += P V on
//   tile j, while tiles j+1 .. j+S-1 load.
// A warp skips the products of a tile it cannot see at all (causal: every key after its last row;
// or all its rows past N), and the per-entry visibility tests of a tile it sees entirely (no mask,
// no key past M, causal: every key at or before its first row).  Query rows past N are zero-filled
// and never stored; key rows past M are zero-filled (V: no NaN into P·V) and hidden.
// One block per SM (__launch_bounds__(kFwdThreads, 1)): ptxas -v (CUDA 13.0) D = 128: 227
// registers (sm_80) / 229 (sm_90a), D = 64: 148 / 161, no spills.  (Without the `1`, ptxas
// aimed at two blocks per SM at D = 64, 128 registers, and spilled 24-32 bytes on sm_90a; two
// m-tiles per warp on 4 warps, FlashAttention-2's split, halves the ldmatrix traffic per row but
// spilled 128 bytes at D = 128 with 255 registers, Q kept in shared memory.)
constexpr int kFwdWarps = 8;
constexpr int kFwdThreads = 32 * kFwdWarps;
constexpr int kFwdBlockQ = 16 * kFwdWarps;  // 128 query rows per block
constexpr int kFwdBlockK = 64;              // keys per tile
// Stages of the K/V ring.  Shared memory (Q + S pairs of K/V tiles): D = 128, 2 stages: 96 KiB,
// within the 99 KiB of every sm_8x / sm_12x device; D = 64, 3 stages: 64 KiB.
template <int kD>
constexpr int kFwdStages = kD <= 64 ? 3 : 2;
template <int kD>
constexpr size_t kFwdSmemBytes = static_cast<size_t>(kFwdBlockQ + 2 * kFwdStages<kD> * kFwdBlockK) * kD * sizeof(uint16_t);

template <bool kBF16, int kD>
__global__ void __launch_bounds__(kFwdThreads, 1) softmax_fwd_kernel(const FwdParams p) {
  constexpr int kNt = kFwdBlockK / 8;  // n-tiles of scores
  constexpr int kS = kFwdStages<kD>;
  constexpr int kTile = kFwdBlockK * kD;  // elements of one K or V stage
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;                    // kFwdBlockQ x kD, swizzled
  uint16_t* k_s = smem + kFwdBlockQ * kD;  // kS stages of kFwdBlockK x kD, swizzled
  uint16_t* v_s = k_s + kS * kTile;        // kS stages

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4;
  // Last query tiles first: under causal masking they have the most key tiles.
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kFwdBlockQ;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int64_t mask_base = b * p.mask.sb + h * p.mask.sh;
  const uint16_t* k_g = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* v_g = p.v + b * p.v_sb + hk * p.v_sh;
  const int w0 = q0 + warp * 16;  // the warp's first query row
  const bool warp_rows = w0 < p.N;
  const int k_end = p.causal ? min(p.M, q0 + kFwdBlockQ) : p.M;
  const int n_tiles = (k_end + kFwdBlockK - 1) / kFwdBlockK;

  // Key tile `tile` into stage tile % kS.
  auto load_kv = [&](int tile) { cp_async_kv_stage<kFwdThreads, kFwdBlockK, kD, kS>(k_s, v_s, k_g, v_g, p, tile); };

  cp_async_tile<kFwdThreads, kFwdBlockQ, kD>(q_s, p.q + b * p.q_sb + h * p.q_sh + q0 * p.q_sn, p.q_sn,
                                             min(kFwdBlockQ, p.N - q0));
  cp_async_commit();
#pragma unroll
  for (int st = 0; st < kS - 1; ++st) {
    if (st < n_tiles) load_kv(st);
    cp_async_commit();
  }

  // The warp's Q fragments (A operands of the kD / 16 k-steps of S = Q Kᵀ), once.
  uint32_t qf[kD / 16][4];
  cp_async_wait<kS - 1>();  // Q has landed (the K/V stages may still be in flight)
  __syncthreads();          // ... for every thread
  if (warp_rows) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) load_a_swz<kD>(qf[kk], q_s, warp * 16, kk * 16, lane);
  }

  // This thread's two query rows: row0 (accumulator entries 0, 1) and row0 + 8 (entries 2, 3).
  const int row0 = w0 + lane / 4;
  float o[kD / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the base-2 scores
  float l_run[2] = {0.f, 0.f};  // this thread's part of the running sum (reduced at the end)

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<kS - 2>();  // tile j has landed (this thread's copies)
    __syncthreads();          // every thread's copies of tile j visible; every warp done with tile j - 1
    if (j + kS - 1 < n_tiles) load_kv(j + kS - 1);  // into the stage of tile j - 1
    cp_async_commit();

    const int k0 = j * kFwdBlockK;
    // Warp-uniform: nothing to compute for rows past N, or (causal) keys all after the warp's rows.
    if (!warp_rows || (p.causal && k0 > w0 + 15)) continue;
    const uint16_t* k_t = k_s + (j % kS) * kTile;
    const uint16_t* v_t = v_s + (j % kS) * kTile;

    // S = Q Kᵀ for the warp's 16 rows x 64 keys.
    float s[kNt][4] = {};
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kNt; nt += 2) {
        uint32_t b0[2], b1[2];
        load_b_nk2_swz<kD>(b0, b1, k_t, nt * 8, kk * 16, lane);
        mma16816<kBF16>(s[nt], qf[kk], b0);
        mma16816<kBF16>(s[nt + 1], qf[kk], b1);
      }
    }

    // Scale to base 2; -inf where the key is out of range, causally hidden or masked out.
    if (p.mask.kind == kNoMask && k0 + kFwdBlockK <= p.M && !(p.causal && k0 + kFwdBlockK - 1 > w0)) {
      for_each_entry<kNt>(t, [&](int nt, int e, int) { s[nt][e] *= p.scale_log2; });
    } else {
      for_each_entry<kNt>(t, [&](int nt, int e, int c) {
        float x = s[nt][e] * p.scale_log2;  // the entry's row: row0 + (e / 2) * 8, key k0 + c
        const bool visible = visible_log2(p, mask_base, row0 + (e / 2) * 8, k0 + c, x);
        s[nt][e] = visible ? x : -INFINITY;
      });
    }

    online_softmax_update(s, o, m_run, l_run);

    // O += P V, P converted from the S accumulators in registers.
    mma_pb<kBF16, kD, kNt, true>(o, s, v_t, lane);
  }

  store_out_lse<kBF16, kD>(p.out, p.lse, bh * p.N, 1, row0, p.N, o, m_run, l_run, t);
}

// ---------------------------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------------------------

struct BwdParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* dout;
  const float* lse;    // contiguous [B, H, N] (natural log)
  const float* delta;  // contiguous [B, H, N]: rowsum(dO ∘ O)
  uint16_t* dq;        // contiguous [B, H, N, D]
  uint16_t* dk;        // contiguous [B, Hk, M, D]
  uint16_t* dv;        // contiguous [B, Hk, M, D]
  int64_t q_sb, q_sh, q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, do_sb, do_sh, do_sn;
  Mask mask;
  int H, Hk, group, N, M;
  float scale, scale_log2;
  bool causal;
  // The variants only (kBwdStream, kBwdFused; unused by the default kernels): per query row, padded
  // to n_pad = N rounded up to 64 (rows past N: lse2 = +inf, delta2 = 0), written by
  // softmax_bwd_rows_kernel; fused: dQ accumulated in fp32 ([B, H, N, D], zeroed) by atomics.
  const float* lse2;    // [B, H, n_pad]: base-2 lse as the backward uses it (lse_log2)
  const float* delta2;  // [B, H, n_pad]
  float* dq_accum;      // [B, H, N, D] (kBwdFused)
  int n_pad;
};

// The backward's kernels (ATTNKIT_CUDA_SOFTMAX_BWD, read once by softmax_bwd_cuda; the default is
// today's).  The variants run only without a mask (softmax_bwd_cuda falls back to the default
// kernels with one) and differ from the default in:
//  - kBwdStream: each query row's base-2 lse and delta come from padded per-row arrays
//    (softmax_bwd_rows_kernel), which dK/dV copies into its ring stage with cp.async like Q and
//    dO -- the default has the first 32 threads load them from global memory and store them to
//    shared memory after the barrier, so warp 0 waits a global-memory latency per query tile
//    while the other warps, done with their products, wait for it at the next barrier; and tiles
//    wholly inside the visible region (no key past M, no query past N, causal: every key at or
//    before every query) compute dS entry by entry without the visibility tests (straight-line
//    code: the default's per-entry branches and mask switch cost ~20 instructions per entry,
//    about as many issue slots per tile as the tensor-core products themselves).
//  - kBwdFused: kBwdStream's dK/dV kernel also computes dQ (FlashAttention-2's 5 products per
//    tile instead of 7: no dQ kernel, which recomputes S and dP): each warp stores its dSᵀ rows
//    (key-major, rounded as in dK) to shared memory; after a barrier the block's 4 warps
//    multiply dS (kBr x 64 keys) by K, split by head-dim columns, and add their share to the fp32
//    dq_accum with atomicAdd (order of the additions not fixed: dQ is not bitwise deterministic
//    on a GPU); softmax_bwd_dq_convert_kernel scales and rounds it.
enum BwdVariant : int { kBwdDefault = 0, kBwdStream = 1, kBwdFused = 2 };

// The base-2 lse of row i as the backward uses it (see lse_log2); rows past N get +inf too, so
// that every P of theirs is 0.
__device__ __forceinline__ float lse_log2(const float* lse, int64_t bh, int N, int i) {
  return i >= N ? INFINITY : lse_log2(lse[bh * N + i]);
}

// delta[b, h, i] = sum_d dO[b, h, i, d] · O[b, h, i, d] (fp32); one warp per row.
template <bool kBF16, int kD>
__global__ void __launch_bounds__(256) softmax_bwd_delta_kernel(
    const uint16_t* out, int64_t o_sb, int64_t o_sh, int64_t o_sn, const uint16_t* dout, int64_t do_sb,
    int64_t do_sh, int64_t do_sn, float* delta, int H, int N, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // uniform per warp
  const int lane = threadIdx.x % 32;
  const int i = static_cast<int>(row % N);
  const int64_t bh = row / N;
  const int64_t h = bh % H, b = bh / H;
  const uint16_t* o = out + b * o_sb + h * o_sh + i * o_sn;
  const uint16_t* d = dout + b * do_sb + h * do_sh + i * do_sn;
  float acc = 0.f;
#pragma unroll
  for (int c = 2 * lane; c < kD; c += 64) {
    const uint32_t ov = *reinterpret_cast<const uint32_t*>(o + c);
    const uint32_t dv = *reinterpret_cast<const uint32_t*>(d + c);
    acc += to_float<kBF16>(static_cast<uint16_t>(ov & 0xffffu)) * to_float<kBF16>(static_cast<uint16_t>(dv & 0xffffu));
    acc += to_float<kBF16>(static_cast<uint16_t>(ov >> 16)) * to_float<kBF16>(static_cast<uint16_t>(dv >> 16));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) delta[row] = acc;
}

// The variants' per-row inputs (kBwdStream, kBwdFused): lse2[bh, i] = lse_log2 of row i and
// delta2[bh, i] = rowsum(dO ∘ O) for i < N; +inf and 0 for N <= i < n_pad, so that the dK/dV
// kernel can copy any query tile's rows with 16-byte cp.async (n_pad, a multiple of 64, keeps
// every tile's rows 16-byte aligned) and a row past N gets P = 0.  One warp per padded row.
template <bool kBF16, int kD>
__global__ void __launch_bounds__(256) softmax_bwd_rows_kernel(
    const uint16_t* out, int64_t o_sb, int64_t o_sh, int64_t o_sn, const uint16_t* dout, int64_t do_sb,
    int64_t do_sh, int64_t do_sn, const float* lse, float* lse2, float* delta2, int H, int N, int n_pad,
    int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // uniform per warp
  const int lane = threadIdx.x % 32;
  const int i = static_cast<int>(row % n_pad);
  const int64_t bh = row / n_pad;
  if (i >= N) {  // padding: P = 0 for this row, and dS = 0
    if (lane == 0) {
      lse2[row] = INFINITY;
      delta2[row] = 0.f;
    }
    return;
  }
  const int64_t h = bh % H, b = bh / H;
  const uint16_t* o = out + b * o_sb + h * o_sh + i * o_sn;
  const uint16_t* d = dout + b * do_sb + h * do_sh + i * do_sn;
  float acc = 0.f;
#pragma unroll
  for (int c0 = 0; c0 < kD; c0 += 64) {  // lane's pair: columns c0 + 2 lane, c0 + 2 lane + 1
    const uint32_t ov = *reinterpret_cast<const uint32_t*>(o + c0 + 2 * lane);
    const uint32_t dv = *reinterpret_cast<const uint32_t*>(d + c0 + 2 * lane);
    acc += to_float<kBF16>(static_cast<uint16_t>(ov & 0xffffu)) * to_float<kBF16>(static_cast<uint16_t>(dv & 0xffffu));
    acc += to_float<kBF16>(static_cast<uint16_t>(ov >> 16)) * to_float<kBF16>(static_cast<uint16_t>(dv >> 16));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    lse2[row] = lse_log2(lse[bh * N + i]);
    delta2[row] = acc;
  }
}

// kBwdFused's last step: dq = dq_accum · scale, rounded to the input dtype; 8 elements per thread
// and step (n, the element count B·H·N·D, is a multiple of 64).
template <bool kBF16>
__global__ void __launch_bounds__(256) softmax_bwd_dq_convert_kernel(const float* acc, uint16_t* dq, int64_t n,
                                                                     float scale) {
  for (int64_t e = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
    const uint4 a = *reinterpret_cast<const uint4*>(acc + e);  // 2 x 4 floats, as bits
    const uint4 c = *reinterpret_cast<const uint4*>(acc + e + 4);
    uint4 r;
    r.x = pack2<kBF16>(__uint_as_float(a.x) * scale, __uint_as_float(a.y) * scale);
    r.y = pack2<kBF16>(__uint_as_float(a.z) * scale, __uint_as_float(a.w) * scale);
    r.z = pack2<kBF16>(__uint_as_float(c.x) * scale, __uint_as_float(c.y) * scale);
    r.w = pack2<kBF16>(__uint_as_float(c.z) * scale, __uint_as_float(c.w) * scale);
    *reinterpret_cast<uint4*>(dq + e) = r;
  }
}

// dQ for one tile of kBlockQ = 64 queries of one (b, h): warp w owns query rows 16w..16w+15.
// Pipelined as the forward: Q and dO (group 0) and K/V tiles of 64 keys through a ring of
// kDqStages<kD> cp.async stages, swizzled, one __syncthreads per key tile (see softmax_fwd_kernel
// for the group counting); Q and dO fragments are read from shared memory at each tile (in
// registers they would leave too few for dQ, S and dP at D = 128).  Shared memory: D = 128, 2
// stages: 96 KiB; D = 64, 3 stages: 64 KiB.
template <int kD>
constexpr int kDqStages = kD <= 64 ? 3 : 2;
template <int kD>
constexpr size_t kDqSmemBytes = static_cast<size_t>(2 * kBlockQ + 2 * kDqStages<kD> * kBlockK) * kD * sizeof(uint16_t);

// kVariant (BwdVariant): kBwdDefault, or kBwdStream (padded per-row lse2 / delta2, and the
// interior tiles' dS without visibility tests; no mask).
template <bool kBF16, int kD, int kVariant = kBwdDefault>
__global__ void __launch_bounds__(kThreads) softmax_bwd_dq_kernel(const BwdParams p) {
  static_assert(kVariant == kBwdDefault || kVariant == kBwdStream, "kBwdFused has no dQ kernel");
  constexpr int kNt = kBlockK / 8;
  constexpr int kS = kDqStages<kD>;
  constexpr int kTile = kBlockK * kD;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;                  // kBlockQ x kD, swizzled
  uint16_t* do_s = smem + kBlockQ * kD;  // kBlockQ x kD, swizzled
  uint16_t* k_s = do_s + kBlockQ * kD;   // kS stages of kBlockK x kD, swizzled
  uint16_t* v_s = k_s + kS * kTile;      // kS stages

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockQ;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int64_t mask_base = b * p.mask.sb + h * p.mask.sh;
  const uint16_t* k_g = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* v_g = p.v + b * p.v_sb + hk * p.v_sh;
  const int w0 = q0 + warp * 16;  // the warp's first query row
  const bool warp_rows = w0 < p.N;
  const int k_end = p.causal ? min(p.M, q0 + kBlockQ) : p.M;
  const int n_tiles = (k_end + kBlockK - 1) / kBlockK;

  auto load_kv = [&](int tile) { cp_async_kv_stage<kThreads, kBlockK, kD, kS>(k_s, v_s, k_g, v_g, p, tile); };

  if (n_tiles > 0) {  // (with no key tile nothing reads them, and no wait would cover them)
    const int q_valid = min(kBlockQ, p.N - q0);
    cp_async_tile<kThreads, kBlockQ, kD>(q_s, p.q + b * p.q_sb + h * p.q_sh + q0 * p.q_sn, p.q_sn, q_valid);
    cp_async_tile<kThreads, kBlockQ, kD>(do_s, p.dout + b * p.do_sb + h * p.do_sh + q0 * p.do_sn, p.do_sn, q_valid);
  }
  cp_async_commit();
#pragma unroll
  for (int st = 0; st < kS - 1; ++st) {
    if (st < n_tiles) load_kv(st);
    cp_async_commit();
  }

  const int row0 = w0 + lane / 4;
  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if constexpr (kVariant == kBwdDefault) {
      lse2[r] = lse_log2(p.lse, bh, p.N, i);
      dlt[r] = i < p.N ? p.delta[bh * p.N + i] : 0.f;
    } else {  // padded rows (i < q0 + kBlockQ <= n_pad): +inf and 0 past N
      lse2[r] = p.lse2[bh * p.n_pad + i];
      dlt[r] = p.delta2[bh * p.n_pad + i];
    }
  }
  float dq[kD / 8][4] = {};

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<kS - 2>();  // tile j (and Q, dO) landed: this thread's copies
    __syncthreads();          // dQ: everyone's copies visible; every warp done with tile j - 1
    if (j + kS - 1 < n_tiles) load_kv(j + kS - 1);  // into the stage of tile j - 1
    cp_async_commit();

    const int k0 = j * kBlockK;
    if (!warp_rows || (p.causal && k0 > w0 + 15)) continue;  // warp-uniform: nothing to add
    const uint16_t* k_t = k_s + (j % kS) * kTile;
    const uint16_t* v_t = v_s + (j % kS) * kTile;

    float s[kNt][4] = {};   // S = Q Kᵀ, then dS
    float dp[kNt][4] = {};  // dP = dO Vᵀ
    mma_abt2<kBF16, kD, kNt, true>(s, q_s, k_t, dp, do_s, v_t, warp * 16, lane);

    // kBwdStream: a tile the warp sees entirely (every row < N, every key < M, causal: every key
    // at or before the warp's first row; no mask in the variants) needs no per-entry test.
    if (kVariant != kBwdDefault && w0 + 16 <= p.N && k0 + kBlockK <= p.M && !(p.causal && k0 + kBlockK - 1 > w0)) {
      for_each_entry<kNt>(t, [&](int nt, int e, int) {
        s[nt][e] = exp2_approx(s[nt][e] * p.scale_log2 - lse2[e / 2]) * (dp[nt][e] - dlt[e / 2]);
      });
    } else {
      for_each_entry<kNt>(t, [&](int nt, int e, int c) {
        float x = s[nt][e] * p.scale_log2;  // the entry's row: row0 + (e / 2) * 8, key k0 + c
        const bool visible = visible_log2(p, mask_base, row0 + (e / 2) * 8, k0 + c, x);
        // Hidden entries get dS = 0 exactly (not 0 · (dP - delta)): a NaN row's delta must not
        // reach the keys it cannot see (issue 15; SDPA's masked_fill gives them no gradient).
        s[nt][e] = visible ? exp2_approx(x - lse2[e / 2]) * (dp[nt][e] - dlt[e / 2]) : 0.f;
      });
    }

    // dQ += dS K (the scale is applied once, at the end): K read transposed from its stage.
    mma_pb<kBF16, kD, kNt, true>(dq, s, k_t, lane);
  }

  store_rows<kBF16, kD>(p.dq, bh * p.N, 1, row0, p.N, dq, p.scale, t);
}

// dK, dV for one tile of 64 keys of one (b, kv head): warp w owns keys 16w..16w+15 and works
// on the transposed products (Sᵀ = K Qᵀ), so that its rows of dK and dV stay in registers.
// K and V (group 0) are loaded once; the query tiles of kBr = kDkdvBlockQ<kD> rows of every
// query head of the GQA group (in order: head, then query tile) stream through a ring of
// kDkdvStages cp.async stages, swizzled, with their rows' base-2 lse and delta (default: plain
// loads into the stage when the tile is issued; the variants: cp.async from the padded per-row
// arrays); one __syncthreads per query tile (see softmax_fwd_kernel for the group counting),
// two for kBwdFused.  Shared memory: D = 128 (kBr = 32): 81 KiB; D = 64 (kBr = 64): 65.5 KiB;
// kBwdFused adds the dSᵀ tile (kBlockK x (kBr + 8) 16-bit): 5 KiB, 9 KiB.
constexpr int kDkdvStages = 3;
// kBwdFused's dSᵀ tile: key-major rows of kBr queries padded by 8 elements (16 bytes), so that
// both the quads' 4-byte stores (8 rows x 4 columns) and ldmatrix's 8 rows fall in distinct banks.
template <int kD>
constexpr int kDsLd = kDkdvBlockQ<kD> + 8;
template <int kD, int kVariant = kBwdDefault>
constexpr size_t kDkdvSmemBytes =
    static_cast<size_t>(2 * kBlockK + 2 * kDkdvStages * kDkdvBlockQ<kD>) * kD * sizeof(uint16_t) +
    static_cast<size_t>(kDkdvStages * 2 * kDkdvBlockQ<kD>) * sizeof(float) +
    (kVariant == kBwdFused ? static_cast<size_t>(kBlockK * kDsLd<kD>) * sizeof(uint16_t) : 0);

// kBwdFused: dQ[i0 .. i0 + kBr) += dS K over the block's kBlockK keys, dS read from the
// key-major dSᵀ tile ds_s, K from its swizzled tile; the 4 warps split the kD columns (kD / 4
// each: every product has all of the tile's rows).  dq_g points at row i0 of the (b, h) rows of
// the fp32 dq_accum; rows >= valid are past N (not added).
template <bool kBF16, int kD, int kBr>
__device__ __forceinline__ void fused_dq_add(float* dq_g, int valid, const uint16_t* ds_s, const uint16_t* k_s,
                                             int warp, int lane) {
  constexpr int kCols = kD / (kThreads / 32);  // head-dim columns of each warp: 32 (D = 128) or 16
  constexpr int kMt = kBr / 16, kNq = kCols / 8;
  constexpr int kLd = kDsLd<kD>;
  float acc[kMt][kNq][4] = {};
#pragma unroll
  for (int kc = 0; kc < kBlockK / 16; ++kc) {
    uint32_t bf[kNq][2];
#pragma unroll
    for (int nq = 0; nq < kNq; nq += 2) load_b_kn2_swz<kD>(bf[nq], bf[nq + 1], k_s, kc * 16, warp * kCols + nq * 8, lane);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      // A = dS[16 mt .., 16 kc ..]: matrix m (lanes 8m .. 8m + 7 give its rows) holds keys
      // 16 kc + 8 (m / 2) .. and queries 16 mt + 8 (m % 2) .. of dSᵀ; .trans hands lane l
      // dS[query g][key 2t, 2t + 1] of it, the A layout (registers: m 0-7 | 8-15 x k 0-7 | 8-15).
      uint32_t a[4];
      ldsm_x4_trans(a, ds_s + (kc * 16 + (lane / 16) * 8 + lane % 8) * kLd + mt * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
      for (int nq = 0; nq < kNq; ++nq) mma16816<kBF16>(acc[mt][nq], a, bf[nq]);
    }
  }
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = mt * 16 + g + 8 * r;
      if (row >= valid) continue;
#pragma unroll
      for (int nq = 0; nq < kNq; ++nq) {
        float* at = dq_g + static_cast<int64_t>(row) * kD + warp * kCols + nq * 8 + 2 * t;
        atomicAdd(at, acc[mt][nq][2 * r]);
        atomicAdd(at + 1, acc[mt][nq][2 * r + 1]);
      }
    }
  }
}

// kBwdFused: the warp's 16 rows (keys) of the block's dSᵀ tile from its accumulator, rounded
// as dK += dSᵀ Q rounds them (acc_to_a), 2 queries per 4-byte store (entry e of n-tile nt: key
// 16 warp + g + 8 (e / 2), query 8 nt + 2 t + e % 2).
template <bool kBF16, int kD, int kNt>
__device__ __forceinline__ void store_ds_rows(uint16_t* ds_s, const float (&dst)[kNt][4], int warp, int lane) {
  uint16_t* row = ds_s + (warp * 16 + lane / 4) * kDsLd<kD> + 2 * (lane % 4);
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    *reinterpret_cast<uint32_t*>(row + nt * 8) = pack2<kBF16>(dst[nt][0], dst[nt][1]);
    *reinterpret_cast<uint32_t*>(row + 8 * kDsLd<kD> + nt * 8) = pack2<kBF16>(dst[nt][2], dst[nt][3]);
  }
}

// kVariant (BwdVariant): kBwdDefault; kBwdStream (rows by cp.async, interior tiles without
// visibility tests; no mask); kBwdFused (kBwdStream plus dQ, see fused_dq_add).
template <bool kBF16, int kD, int kVariant = kBwdDefault>
__global__ void __launch_bounds__(kThreads) softmax_bwd_dkdv_kernel(const BwdParams p) {
  constexpr int kBr = kDkdvBlockQ<kD>;
  constexpr int kNt = kBr / 8;
  constexpr int kS = kDkdvStages;
  constexpr int kQTile = kBr * kD;  // elements of one Q or dO stage
  constexpr bool kFused = kVariant == kBwdFused;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* k_s = smem;                   // kBlockK x kD, swizzled
  uint16_t* v_s = k_s + kBlockK * kD;     // kBlockK x kD, swizzled
  uint16_t* q_st = v_s + kBlockK * kD;    // kS stages of kBr x kD, swizzled
  uint16_t* do_st = q_st + kS * kQTile;   // kS stages
  // kS stages of (base-2 lse, delta) x kBr floats; byte offset a multiple of 16
  float* rows_st = reinterpret_cast<float*>(do_st + kS * kQTile);
  // kBwdFused: the block's dSᵀ (kBlockK keys x kBr queries, row length kDsLd); offset a multiple of 16
  uint16_t* ds_s = reinterpret_cast<uint16_t*>(rows_st + kS * 2 * kBr);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4;
  const int k0 = blockIdx.x * kBlockK;
  const int hk = blockIdx.y, b = blockIdx.z;
  // Causal: queries i < k0 see none of these keys; k0 is a multiple of kBr.
  const int i_begin = p.causal ? k0 : 0;
  const int per_head = i_begin < p.N ? (p.N - i_begin + kBr - 1) / kBr : 0;  // query tiles per head
  const int n_tiles = p.group * per_head;

  // Query tile `tile` (head hg = tile / per_head of the group) into stage tile % kS.
  auto load_q = [&](int tile) {
    const int hg = tile / per_head, i0 = i_begin + (tile % per_head) * kBr, stage = tile % kS;
    const int h = hk * p.group + hg;
    const int64_t bh = static_cast<int64_t>(b) * p.H + h;
    const int valid = min(kBr, p.N - i0);
    cp_async_tile<kThreads, kBr, kD>(q_st + stage * kQTile, p.q + b * p.q_sb + h * p.q_sh + i0 * p.q_sn, p.q_sn, valid);
    cp_async_tile<kThreads, kBr, kD>(do_st + stage * kQTile, p.dout + b * p.do_sb + h * p.do_sh + i0 * p.do_sn,
                                     p.do_sn, valid);
    float* rows = rows_st + stage * 2 * kBr;
    if constexpr (kVariant == kBwdDefault) {
      for (int idx = threadIdx.x; idx < kBr; idx += kThreads) {
        const int i = i0 + idx;
        rows[idx] = lse_log2(p.lse, bh, p.N, i);
        rows[kBr + idx] = i < p.N ? p.delta[bh * p.N + i] : 0.f;
      }
    } else {
      // The padded rows i0 .. i0 + kBr - 1 (< n_pad: i0 is a multiple of kBr, n_pad of 64) of
      // lse2 and delta2, 4 floats per copy, in the tile's group: no thread waits for them here.
      constexpr int kChunks = kBr / 4;
      static_assert(2 * kChunks <= kThreads, "one copy per thread");
      const int idx = threadIdx.x;
      if (idx < 2 * kChunks) {
        const float* src = (idx < kChunks ? p.lse2 : p.delta2) + bh * p.n_pad + i0 + (idx % kChunks) * 4;
        cp_async16(reinterpret_cast<uint16_t*>(rows + (idx / kChunks) * kBr + (idx % kChunks) * 4),
                   reinterpret_cast<const uint16_t*>(src));
      }
    }
  };

  if (n_tiles > 0) {  // (with no query tile nothing reads them, and no wait would cover them)
    const int k_valid = min(kBlockK, p.M - k0);
    cp_async_tile<kThreads, kBlockK, kD>(k_s, p.k + b * p.k_sb + hk * p.k_sh + k0 * p.k_sn, p.k_sn, k_valid);
    cp_async_tile<kThreads, kBlockK, kD>(v_s, p.v + b * p.v_sb + hk * p.v_sh + k0 * p.v_sn, p.v_sn, k_valid);
  }
  cp_async_commit();
#pragma unroll
  for (int st = 0; st < kS - 1; ++st) {
    if (st < n_tiles) load_q(st);
    cp_async_commit();
  }

  // This thread's two key rows: key0 (entries 0, 1) and key0 + 8 (entries 2, 3).
  const int key0 = k0 + warp * 16 + lane / 4;
  const bool warp_keys = k0 + warp * 16 < p.M;  // the warp has a key row to compute
  float dk[kD / 8][4] = {};
  float dv[kD / 8][4] = {};

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait<kS - 2>();  // query tile j (and K, V) landed: this thread's copies
    __syncthreads();          // dK/dV: everyone's copies and rows visible; every warp done with tile j - 1
    if (j + kS - 1 < n_tiles) load_q(j + kS - 1);  // into the stage of tile j - 1
    cp_async_commit();

    const int hg = j / per_head, i0 = i_begin + (j % per_head) * kBr;
    // Warp-uniform: no key row, or (causal) every query of the tile before the warp's first key.
    const bool warp_work = warp_keys && !(p.causal && i0 + kBr - 1 < k0 + warp * 16);
    if constexpr (!kFused) {
      if (!warp_work) continue;
    }
    const int h = hk * p.group + hg;
    if (warp_work) {
      const int64_t mask_base = b * p.mask.sb + h * p.mask.sh;
      const uint16_t* q_t = q_st + (j % kS) * kQTile;
      const uint16_t* do_t = do_st + (j % kS) * kQTile;
      const float* lse_t = rows_st + (j % kS) * 2 * kBr;
      const float* dlt_t = lse_t + kBr;

      // Sᵀ = K Qᵀ (warp's 16 keys x kBr queries) and dPᵀ = V dOᵀ.
      float st[kNt][4] = {};
      float dpt[kNt][4] = {};
      mma_abt2<kBF16, kD, kNt, true>(st, k_s, q_t, dpt, v_s, do_t, warp * 16, lane);

      // Pᵀ (in st) and dSᵀ = Pᵀ ∘ (dPᵀ - delta) (in dpt).  The variants: a tile the warp sees
      // entirely (its keys < M, the tile's queries < N, causal: its last key at or before the
      // tile's first query; no mask) without the per-entry tests.
      if (kVariant != kBwdDefault && k0 + warp * 16 + 16 <= p.M && i0 + kBr <= p.N &&
          !(p.causal && k0 + warp * 16 + 15 > i0)) {
        for_each_entry<kNt>(t, [&](int nt, int e, int il) {
          const float prob = exp2_approx(st[nt][e] * p.scale_log2 - lse_t[il]);
          st[nt][e] = prob;
          dpt[nt][e] = prob * (dpt[nt][e] - dlt_t[il]);
        });
      } else {
        for_each_entry<kNt>(t, [&](int nt, int e, int il) {
          const int jj = key0 + (e / 2) * 8;
          const int i = i0 + il;
          float x = st[nt][e] * p.scale_log2;
          const bool visible = i < p.N && visible_log2(p, mask_base, i, jj, x);
          const float prob = visible ? exp2_approx(x - lse_t[il]) : 0.f;
          st[nt][e] = prob;
          dpt[nt][e] = visible ? prob * (dpt[nt][e] - dlt_t[il]) : 0.f;  // hidden: exactly 0 (see dQ)
        });
      }

      // dV += Pᵀ dO,  dK += dSᵀ Q  (the scale is applied once, at the end): dO and Q read transposed.
      mma_pb2<kBF16, kD, kNt, true>(dv, st, do_t, dk, dpt, q_t, lane);
      if constexpr (kFused) store_ds_rows<kBF16, kD, kNt>(ds_s, dpt, warp, lane);
    } else if constexpr (kFused) {
      const float none[kNt][4] = {};  // no visible entry: dS = 0 in the warp's rows
      store_ds_rows<kBF16, kD, kNt>(ds_s, none, warp, lane);
    }

    if constexpr (kFused) {
      __syncthreads();  // fused dQ: every warp's dSᵀ rows written
      const int64_t bh = static_cast<int64_t>(b) * p.H + h;
      fused_dq_add<kBF16, kD, kBr>(p.dq_accum + (bh * p.N + i0) * kD, p.N - i0, ds_s, k_s, warp, lane);
    }
  }

  const int64_t bhk = static_cast<int64_t>(b) * p.Hk + hk;
  store_dk_dv<kBF16, kD>(p.dk, p.dv, bhk * p.M, 1, key0, p.M, dk, dv, p.scale, t);
}

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

// Rows the kernels can read with 16-byte loads: contiguous last dim, 16-byte aligned start,
// every other stride (of a dim longer than 1) a multiple of 8 elements.
bool rows_aligned(const at::Tensor& x) {
  if (x.numel() == 0) return true;
  if (x.size(-1) > 1 && x.stride(-1) != 1) return false;
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    if (x.size(d) > 1 && x.stride(d) % 8 != 0) return false;
  }
  return true;
}

// x itself when its rows are aligned, else a fresh contiguous copy (a contiguous view with an
// odd storage offset is copied too: .contiguous() would return it unchanged).
at::Tensor aligned_rows(const at::Tensor& x) {
  return rows_aligned(x) ? x : x.clone(at::MemoryFormat::Contiguous);
}

// Element stride of dim d, 0 where the dim has one element (its index is always 0).
int64_t stride_or_zero(const at::Tensor& x, int64_t d) { return x.size(d) == 1 ? 0 : x.stride(d); }

struct Shape {
  int64_t B, H, Hk, N, M, D;
};

// Inputs checked by checks::softmax_fwd / softmax_bwd (csrc/checks/softmax.cpp).
Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
  return Shape{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
}

// The kernels' view of a checked mask: any dim may be 1 (read with stride 0).
Mask make_mask(const std::optional<at::Tensor>& mask) {
  Mask mk{nullptr, kNoMask, 0, 0, 0, 0};
  if (!mask.has_value() || !mask->defined()) return mk;
  const at::Tensor& m = *mask;
  switch (m.scalar_type()) {
    case at::kBool: mk.kind = kBoolMask; break;
    case at::kFloat: mk.kind = kF32Mask; break;
    case at::kHalf: mk.kind = kF16Mask; break;
    case at::kBFloat16: mk.kind = kBF16Mask; break;
    case at::kDouble: mk.kind = kF64Mask; break;
    default: ATTNKIT_CHECK(false, "attnkit::softmax (cuda): unchecked mask dtype");  // checks::softmax_*: cannot happen
  }
  mk.ptr = m.numel() > 0 ? m.data_ptr() : nullptr;
  mk.sb = stride_or_zero(m, 0);
  mk.sh = stride_or_zero(m, 1);
  mk.sn = stride_or_zero(m, 2);
  mk.sm = stride_or_zero(m, 3);
  return mk;
}

template <bool kBF16, int kD>
void launch_fwd(const FwdParams& p, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = kFwdSmemBytes<kD>;
  allow_smem(softmax_fwd_kernel<kBF16, kD>, smem);
  softmax_fwd_kernel<kBF16, kD><<<grid, kFwdThreads, smem, stream>>>(p);
}

template <bool kBF16, int kD>
void launch_bwd(const BwdParams& p, const at::Tensor& out, const at::Tensor& dout, float* delta, int64_t B,
                cudaStream_t stream) {
  const int64_t rows = B * p.H * static_cast<int64_t>(p.N);
  if (rows > 0) {
    constexpr int kRowsPerBlock = 256 / 32;
    softmax_bwd_delta_kernel<kBF16, kD><<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0, stream>>>(
        bits(out), stride_or_zero(out, 0), stride_or_zero(out, 1), stride_or_zero(out, 2), bits(dout),
        stride_or_zero(dout, 0), stride_or_zero(dout, 1), stride_or_zero(dout, 2), delta, p.H, p.N, rows);

    constexpr size_t dq_smem = kDqSmemBytes<kD>;
    allow_smem(softmax_bwd_dq_kernel<kBF16, kD>, dq_smem);
    const dim3 dq_grid(static_cast<unsigned>((p.N + kBlockQ - 1) / kBlockQ), static_cast<unsigned>(p.H),
                       static_cast<unsigned>(B));
    softmax_bwd_dq_kernel<kBF16, kD><<<dq_grid, kThreads, dq_smem, stream>>>(p);
  }
  if (B * p.Hk * static_cast<int64_t>(p.M) > 0) {
    // Runs also when N = 0: it then writes dK = dV = 0.
    constexpr size_t dkdv_smem = kDkdvSmemBytes<kD>;
    allow_smem(softmax_bwd_dkdv_kernel<kBF16, kD>, dkdv_smem);
    const dim3 kv_grid(static_cast<unsigned>((p.M + kBlockK - 1) / kBlockK), static_cast<unsigned>(p.Hk),
                       static_cast<unsigned>(B));
    softmax_bwd_dkdv_kernel<kBF16, kD><<<kv_grid, kThreads, dkdv_smem, stream>>>(p);
  }
}

// The backward of a variant (BwdVariant, not kBwdDefault; no mask): the per-row kernel into
// padded lse2 / delta2, then kBwdStream: the dQ and dK/dV kernels of the variant; kBwdFused:
// dK/dV with dQ accumulated in fp32 (zeroed first), then its conversion into dq.
template <bool kBF16, int kD>
void launch_bwd_variant(BwdParams p, BwdVariant variant, const at::Tensor& out, const at::Tensor& dout,
                        const at::Tensor& lse, const at::Tensor& dq, int64_t B, cudaStream_t stream) {
  const int64_t n_pad = (static_cast<int64_t>(p.N) + 63) / 64 * 64;
  const int64_t rows = B * p.H * n_pad;
  at::Tensor rows2 = at::empty({2, rows}, lse.options());
  p.lse2 = rows2.data_ptr<float>();
  p.delta2 = p.lse2 + rows;
  p.n_pad = static_cast<int>(n_pad);
  if (rows > 0) {
    constexpr int kRowsPerBlock = 256 / 32;
    softmax_bwd_rows_kernel<kBF16, kD><<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0, stream>>>(
        bits(out), stride_or_zero(out, 0), stride_or_zero(out, 1), stride_or_zero(out, 2), bits(dout),
        stride_or_zero(dout, 0), stride_or_zero(dout, 1), stride_or_zero(dout, 2), lse.data_ptr<float>(), rows2.data_ptr<float>(),
        rows2.data_ptr<float>() + rows, p.H, p.N, p.n_pad, rows);
  }
  const dim3 kv_grid(static_cast<unsigned>((p.M + kBlockK - 1) / kBlockK), static_cast<unsigned>(p.Hk),
                     static_cast<unsigned>(B));
  const bool any_keys = B * p.Hk * static_cast<int64_t>(p.M) > 0;
  if (variant == kBwdStream) {
    if (rows > 0) {
      constexpr size_t dq_smem = kDqSmemBytes<kD>;
      allow_smem(softmax_bwd_dq_kernel<kBF16, kD, kBwdStream>, dq_smem);
      const dim3 dq_grid(static_cast<unsigned>((p.N + kBlockQ - 1) / kBlockQ), static_cast<unsigned>(p.H),
                         static_cast<unsigned>(B));
      softmax_bwd_dq_kernel<kBF16, kD, kBwdStream><<<dq_grid, kThreads, dq_smem, stream>>>(p);
    }
    if (any_keys) {
      constexpr size_t smem = kDkdvSmemBytes<kD, kBwdStream>;
      allow_smem(softmax_bwd_dkdv_kernel<kBF16, kD, kBwdStream>, smem);
      softmax_bwd_dkdv_kernel<kBF16, kD, kBwdStream><<<kv_grid, kThreads, smem, stream>>>(p);
    }
    return;
  }
  // kBwdFused
  at::Tensor dq_accum = at::zeros(dq.sizes(), lse.options());
  p.dq_accum = dq_accum.data_ptr<float>();
  if (any_keys) {
    constexpr size_t smem = kDkdvSmemBytes<kD, kBwdFused>;
    allow_smem(softmax_bwd_dkdv_kernel<kBF16, kD, kBwdFused>, smem);
    softmax_bwd_dkdv_kernel<kBF16, kD, kBwdFused><<<kv_grid, kThreads, smem, stream>>>(p);
  }
  const int64_t n = dq.numel();  // a multiple of 64 (D = 64 or 128)
  if (n > 0) {
    const int64_t blocks = std::min<int64_t>((n / 8 + 255) / 256, int64_t{1} << 16);
    softmax_bwd_dq_convert_kernel<kBF16><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        dq_accum.data_ptr<float>(), p.dq, n, p.scale);
  }
}

// ATTNKIT_CUDA_SOFTMAX_BWD, read once per process: unset, empty or "default": today's kernels;
// "stream" or "fused" (BwdVariant); anything else: a warning, then the default.
BwdVariant bwd_variant() {
  static const BwdVariant variant = [] {
    const char* env = std::getenv("ATTNKIT_CUDA_SOFTMAX_BWD");
    const std::string name = env != nullptr ? env : "";
    if (name.empty() || name == "default") return kBwdDefault;
    if (name == "stream") return kBwdStream;
    if (name == "fused") return kBwdFused;
    TORCH_WARN("attnkit: ATTNKIT_CUDA_SOFTMAX_BWD=", name, " is not one of default, stream, fused: using default");
    return kBwdDefault;
  }();
  return variant;
}

// D = 256 (the op's check let it through only unmasked where the Hopper kernels run: Target::
// sm90_kernels): softmax_sm90.cu's kernels, the only ones for this head dim.  Empty sequences
// are answered here (out 0, lse -inf; zero gradients), and inputs whose strides TMA cannot read
// are copied to fresh contiguous storage first.  Should the kernels still refuse (a tensor map
// the driver rejects: not for checked sizes), the results are NaN, never a silent number.
at::Tensor tma_readable(const at::Tensor& x) {
  const bool ok = x.stride(3) == 1 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  (x.size(0) <= 1 || (x.stride(0) * 2) % 16 == 0) && (x.size(1) <= 1 || (x.stride(1) * 2) % 16 == 0) &&
                  (x.size(2) <= 1 || (x.stride(2) * 2) % 16 == 0);
  return ok ? x : x.clone(at::MemoryFormat::Contiguous);
}

std::tuple<at::Tensor, at::Tensor> softmax_fwd_wide(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const Shape& s, double scale, bool is_causal) {
  if (s.B * s.H * s.N == 0 || s.M == 0) {
    return {at::zeros({s.B, s.H, s.N, s.D}, q.options()),
            at::full({s.B, s.H, s.N}, -INFINITY, q.options().dtype(at::kFloat))};
  }
  if (auto hopper = softmax_fwd_cuda_sm90(tma_readable(q), tma_readable(k), tma_readable(v), scale, is_causal)) {
    return *hopper;
  }
  return {at::full({s.B, s.H, s.N, s.D}, NAN, q.options()), at::full({s.B, s.H, s.N}, NAN, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_bwd_wide(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                                const at::Tensor& k_in, const at::Tensor& v_in,
                                                                const at::Tensor& out, const at::Tensor& lse,
                                                                const Shape& s, double scale, bool is_causal) {
  if (s.B * s.H * s.N == 0 || s.M == 0) {
    return {at::zeros({s.B, s.H, s.N, s.D}, q_in.options()), at::zeros({s.B, s.Hk, s.M, s.D}, q_in.options()),
            at::zeros({s.B, s.Hk, s.M, s.D}, q_in.options())};
  }
  const at::Tensor q = tma_readable(q_in), k = tma_readable(k_in), v = tma_readable(v_in), dout = tma_readable(dout_in);
  if (softmax_sm90_applies(q, k, v, &dout)) {
    // delta = rowsum(dO ∘ O) by the row kernel, as for the other head dims.
    at::Tensor delta = at::empty({s.B, s.H, s.N}, q.options().dtype(at::kFloat));
    const int64_t rows = s.B * s.H * s.N;
    constexpr int kRowsPerBlock = 256 / 32;
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    auto delta_kernel = q.scalar_type() == at::kBFloat16 ? softmax_bwd_delta_kernel<true, 256>
                                                         : softmax_bwd_delta_kernel<false, 256>;
    delta_kernel<<<blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        bits(out), stride_or_zero(out, 0), stride_or_zero(out, 1), stride_or_zero(out, 2), bits(dout),
        stride_or_zero(dout, 0), stride_or_zero(dout, 1), stride_or_zero(dout, 2), delta.data_ptr<float>(),
        static_cast<int>(s.H), static_cast<int>(s.N), rows);
    if (auto hopper = softmax_bwd_cuda_sm90(dout, q, k, v, lse, delta, scale, is_causal)) return *hopper;
  }
  return {at::full({s.B, s.H, s.N, s.D}, NAN, q.options()), at::full({s.B, s.Hk, s.M, s.D}, NAN, q.options()),
          at::full({s.B, s.Hk, s.M, s.D}, NAN, q.options())};
}

}  // namespace

// Entry points (csrc/cuda/launch.h: checked inputs; launch errors are left to the caller).

std::tuple<at::Tensor, at::Tensor> softmax_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                    const at::Tensor& v_in, const std::optional<at::Tensor>& mask,
                                                    double scale, bool is_causal) {
  const Shape s = shape_of(q_in, k_in);
  const Mask mk = make_mask(mask);
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = aligned_rows(q_in), k = aligned_rows(k_in), v = aligned_rows(v_in);
  if (s.D == cuda_limits::kSm90WideHeadDim) return softmax_fwd_wide(q, k, v, s, scale, is_causal);
  if (mk.kind == kNoMask) {
    if (auto hopper = softmax_fwd_cuda_sm90(q, k, v, scale, is_causal)) return *hopper;
  }
  at::Tensor out = at::empty({s.B, s.H, s.N, s.D}, q.options());
  at::Tensor lse = at::empty({s.B, s.H, s.N}, q.options().dtype(at::kFloat));
  if (s.B == 0 || s.H == 0 || s.N == 0) return {out, lse};

  FwdParams p;
  p.q = bits(q);
  p.k = bits(k);
  p.v = bits(v);
  p.out = mutable_bits(out);
  p.lse = lse.data_ptr<float>();
  p.q_sb = stride_or_zero(q, 0), p.q_sh = stride_or_zero(q, 1), p.q_sn = stride_or_zero(q, 2);
  p.k_sb = stride_or_zero(k, 0), p.k_sh = stride_or_zero(k, 1), p.k_sn = stride_or_zero(k, 2);
  p.v_sb = stride_or_zero(v, 0), p.v_sh = stride_or_zero(v, 1), p.v_sn = stride_or_zero(v, 2);
  p.mask = mk;
  p.H = static_cast<int>(s.H);
  p.group = static_cast<int>(s.H / s.Hk);
  p.N = static_cast<int>(s.N);
  p.M = static_cast<int>(s.M);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = is_causal;

  const dim3 grid(static_cast<unsigned>((s.N + kFwdBlockQ - 1) / kFwdBlockQ), static_cast<unsigned>(s.H),
                  static_cast<unsigned>(s.B));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (bf16) {
    s.D == 64 ? launch_fwd<true, 64>(p, grid, stream) : launch_fwd<true, 128>(p, grid, stream);
  } else {
    s.D == 64 ? launch_fwd<false, 64>(p, grid, stream) : launch_fwd<false, 128>(p, grid, stream);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const std::optional<at::Tensor>& mask, double scale,
    bool is_causal) {
  const Shape s = shape_of(q_in, k_in);
  const Mask mk = make_mask(mask);
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = aligned_rows(q_in), k = aligned_rows(k_in), v = aligned_rows(v_in);
  const at::Tensor dout = aligned_rows(dout_in), out = aligned_rows(out_in);
  const at::Tensor lse = lse_in.contiguous();
  if (s.D == cuda_limits::kSm90WideHeadDim) return softmax_bwd_wide(dout, q, k, v, out, lse, s, scale, is_causal);
  at::Tensor dq = at::empty({s.B, s.H, s.N, s.D}, q.options());
  at::Tensor dk = at::empty({s.B, s.Hk, s.M, s.D}, q.options());
  at::Tensor dv = at::empty({s.B, s.Hk, s.M, s.D}, q.options());
  at::Tensor delta = at::empty({s.B, s.H, s.N}, q.options().dtype(at::kFloat));
  if (s.B == 0 || (s.H == 0 && s.Hk == 0)) return {dq, dk, dv};

  BwdParams p;
  p.q = bits(q);
  p.k = bits(k);
  p.v = bits(v);
  p.dout = bits(dout);
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq = mutable_bits(dq);
  p.dk = mutable_bits(dk);
  p.dv = mutable_bits(dv);
  p.q_sb = stride_or_zero(q, 0), p.q_sh = stride_or_zero(q, 1), p.q_sn = stride_or_zero(q, 2);
  p.k_sb = stride_or_zero(k, 0), p.k_sh = stride_or_zero(k, 1), p.k_sn = stride_or_zero(k, 2);
  p.v_sb = stride_or_zero(v, 0), p.v_sh = stride_or_zero(v, 1), p.v_sn = stride_or_zero(v, 2);
  p.do_sb = stride_or_zero(dout, 0), p.do_sh = stride_or_zero(dout, 1), p.do_sn = stride_or_zero(dout, 2);
  p.mask = mk;
  p.H = static_cast<int>(s.H);
  p.Hk = static_cast<int>(s.Hk);
  p.group = static_cast<int>(s.H / s.Hk);
  p.N = static_cast<int>(s.N);
  p.M = static_cast<int>(s.M);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = is_causal;
  p.lse2 = p.delta2 = nullptr;  // the variants' (launch_bwd_variant)
  p.dq_accum = nullptr;
  p.n_pad = 0;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // The Hopper kernels (softmax_sm90.cu), where they apply: delta first, by the row kernel here.
  if (mk.kind == kNoMask && softmax_sm90_applies(q, k, v, &dout)) {
    const int64_t rows = s.B * p.H * static_cast<int64_t>(p.N);
    constexpr int kRowsPerBlock = 256 / 32;
    const unsigned blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    auto delta_kernel = bf16 ? (s.D == 64 ? softmax_bwd_delta_kernel<true, 64> : softmax_bwd_delta_kernel<true, 128>)
                             : (s.D == 64 ? softmax_bwd_delta_kernel<false, 64> : softmax_bwd_delta_kernel<false, 128>);
    delta_kernel<<<blocks, 256, 0, stream>>>(bits(out), stride_or_zero(out, 0), stride_or_zero(out, 1),
                                             stride_or_zero(out, 2), bits(dout), stride_or_zero(dout, 0),
                                             stride_or_zero(dout, 1), stride_or_zero(dout, 2), delta.data_ptr<float>(), p.H, p.N, rows);
    if (auto hopper = softmax_bwd_cuda_sm90(dout, q, k, v, lse, delta, scale, is_causal)) return *hopper;
  }
  // The variants compute no mask: with one, the default kernels run whatever the variable says.
  BwdVariant variant = mk.kind == kNoMask ? bwd_variant() : kBwdDefault;
  // torch.use_deterministic_algorithms(True): not the fused variant, whose dQ atomics add in no
  // fixed order; the stream variant is the same scheme with dQ by its own kernel.
  if (variant == kBwdFused && at::globalContext().deterministicAlgorithms()) variant = kBwdStream;
  if (variant != kBwdDefault) {
    const bool bf16 = q.scalar_type() == at::kBFloat16;
    if (bf16) {
      s.D == 64 ? launch_bwd_variant<true, 64>(p, variant, out, dout, lse, dq, s.B, stream)
                : launch_bwd_variant<true, 128>(p, variant, out, dout, lse, dq, s.B, stream);
    } else {
      s.D == 64 ? launch_bwd_variant<false, 64>(p, variant, out, dout, lse, dq, s.B, stream)
                : launch_bwd_variant<false, 128>(p, variant, out, dout, lse, dq, s.B, stream);
    }
    return {dq, dk, dv};
  }
  float* delta_ptr = delta.data_ptr<float>();
  if (q.scalar_type() == at::kBFloat16) {
    s.D == 64 ? launch_bwd<true, 64>(p, out, dout, delta_ptr, s.B, stream)
              : launch_bwd<true, 128>(p, out, dout, delta_ptr, s.B, stream);
  } else {
    s.D == 64 ? launch_bwd<false, 64>(p, out, dout, delta_ptr, s.B, stream)
              : launch_bwd<false, 128>(p, out, dout, delta_ptr, s.B, stream);
  }
  return {dq, dk, dv};
}

}  // namespace attnkit

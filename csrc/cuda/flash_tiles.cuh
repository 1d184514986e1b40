// The FlashAttention-2 tile steps shared by the softmax (softmax.cu) and sparse (sparse.cu)
// CUDA kernels: one tile geometry (4 warps x 16 rows, 64-key tiles, padded shared-memory rows),
// the padded shared-memory layouts (sparse.cu's kernels), the swizzled tiles and cp.async tile
// copies (softmax.cu's pipelined kernels), the tensor-core products of a
// warp's 16 rows (S = A·Bᵀ, acc += P·B, each also in a fused pair), the online-softmax row
// update and the epilogues.  What differs between the families -- which rows a block owns,
// which tiles it visits, which (query, key) pairs are visible -- stays in the kernels.
//
// Include it after mma_sm80.cuh (it uses pack2, exp2_approx, mma16816 and the fragment loaders;
// it does not include that header itself because tests/csrc/cuda_emulator/extract.py inlines
// project headers one level deep, and refuses one that includes another).  The extractor inlines
// it like mma_sm80.cuh, so the emulated tests run these steps as written.  Device code only, in
// attnkit's unnamed namespace (internal linkage per .cu).
//
// Fragment layout (m16n8k16, g = lane / 4, t = lane % 4): a warp's 16-row accumulator over
// 8 kNt columns is float acc[kNt][4]; entry e of n-tile nt is row g + 8 (e / 2), column
// 8 nt + 2 t + e % 2.  "Row slot" r (0, 1) below is row g + 8 r.
#pragma once

#include <cmath>
#include <cstdint>

namespace attnkit {
namespace {

constexpr int kThreads = 128;  // 4 warps per block
constexpr int kBlockQ = 64;    // query rows per block (forward, dQ): warp w owns rows 16w..16w+15
constexpr int kBlockK = 64;    // key rows per tile (all kernels); dK/dV: warp w owns keys 16w..16w+15
constexpr int kPad = 8;        // shared-memory row padding (elements): conflict-free fragment loads
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A tile of kR rows x kD columns to shared memory (leading dimension kD + kPad) by the block's
// kThreads threads; rows >= `valid` zero-filled.
template <int kR, int kD>
__device__ __forceinline__ void load_tile(uint16_t* dst, const uint16_t* src, int64_t stride, int valid) {
  load_rows16<kThreads, kPad, kR, kD>(dst, src, stride, valid);
}

// The next K and V tiles (kBlockK rows each, `valid` of them real) of a query-major loop
// (forward, dQ), between the two barriers that guard them.
template <int kD>
__device__ __forceinline__ void load_kv_tiles(uint16_t* k_s, uint16_t* v_s, const uint16_t* k, int64_t k_stride,
                                              const uint16_t* v, int64_t v_stride, int valid) {
  __syncthreads();  // every warp is done with the previous K/V tiles (the query tiles: written before)
  load_tile<kBlockK, kD>(k_s, k, k_stride, valid);
  load_tile<kBlockK, kD>(v_s, v, v_stride, valid);
  __syncthreads();
}

// The base-2 lse of a row as the backward uses it: P = 2^(x - lse2); lse = -inf (the row saw no
// key) -> +inf, so that every P of the row is 0.
__device__ __forceinline__ float lse_log2(float value) { return value == -INFINITY ? INFINITY : value * kLog2e; }

// ---------------------------------------------------------------------------------------------
// shared-memory layouts (16-bit tiles with leading dimension kD + kPad)
// ---------------------------------------------------------------------------------------------

// Query-major kernels of 64 query rows: the forward (Q, K, V tiles) and dQ (Q, dO, K, V).
template <int kD>
constexpr size_t fwd_smem_bytes() {
  return static_cast<size_t>(kBlockQ + 2 * kBlockK) * (kD + kPad) * sizeof(uint16_t);
}

template <int kD>
constexpr size_t dq_smem_bytes() {
  return static_cast<size_t>(2 * kBlockQ + 2 * kBlockK) * (kD + kPad) * sizeof(uint16_t);
}

struct FwdSmem {
  uint16_t *q, *k, *v;
};

template <int kD>
__device__ __forceinline__ FwdSmem fwd_smem(uint16_t* smem) {
  constexpr int kLd = kD + kPad;
  return {smem, smem + kBlockQ * kLd, smem + (kBlockQ + kBlockK) * kLd};
}

struct DqSmem {
  uint16_t *q, *dout, *k, *v;
};

template <int kD>
__device__ __forceinline__ DqSmem dq_smem(uint16_t* smem) {
  constexpr int kLd = kD + kPad;
  return {smem, smem + kBlockQ * kLd, smem + 2 * kBlockQ * kLd, smem + (2 * kBlockQ + kBlockK) * kLd};
}

// Query rows per step of the dK/dV kernels: fewer for D = 128, where dK and dV alone take 128
// accumulator registers per thread.  (A variable template: a constexpr function would need
// --expt-relaxed-constexpr in device code.)
template <int kD>
constexpr int kDkdvBlockQ = kD <= 64 ? 64 : 32;

// dK/dV kernels (64 key rows, query tiles of kBr = kDkdvBlockQ<kD>): K, V, Q, dO tiles, then
// per query row of the tile its base-2 lse and delta (float), then kRowBytes more bytes per
// query row for the kernel's own use (sparse.cu: the range bounds).
template <int kD, int kRowBytes = 0>
constexpr size_t dkdv_smem_bytes() {
  constexpr int kBr = kDkdvBlockQ<kD>;
  return static_cast<size_t>(2 * kBlockK + 2 * kBr) * (kD + kPad) * sizeof(uint16_t) +
         static_cast<size_t>(kBr) * (2 * sizeof(float) + kRowBytes);
}

struct DkdvSmem {
  uint16_t *k, *v, *q, *dout;
  float *lse, *delta;  // kBr each; `delta + kBr` starts the kRowBytes area (4-byte aligned)
};

template <int kD>
__device__ __forceinline__ DkdvSmem dkdv_smem(uint16_t* smem) {
  constexpr int kLd = kD + kPad, kBr = kDkdvBlockQ<kD>;
  uint16_t* q = smem + 2 * kBlockK * kLd;
  uint16_t* dout = q + kBr * kLd;
  // Byte offset (2 kBlockK + 2 kBr) · kLd · 2 is a multiple of 4 (kLd is even).
  float* lse = reinterpret_cast<float*>(dout + kBr * kLd);
  return {smem, smem + kBlockK * kLd, q, dout, lse, lse + kBr};
}

// ---------------------------------------------------------------------------------------------
// swizzled tiles (softmax.cu's pipelined kernels).  Rows of kD 16-bit elements without padding:
// kD / 8 chunks of 16 bytes (kD a multiple of 64), chunk c of row r stored at chunk c ^ (r % 8).
// The 8 rows of an 8x8 matrix that ldmatrix reads (one chunk of 8 consecutive rows) then lie in 8
// different 16-byte bank groups, as do the chunks that 8 consecutive threads of cp_async_tile
// write: both conflict-free, with no padding (a K or V tile at D = 128 is 16 KiB exactly).
// ---------------------------------------------------------------------------------------------

// Rows [0, kR) of a tile of kD columns (global row stride `stride` elements, rows 16-byte
// aligned) into a swizzled shared tile through cp.async, 16 bytes per thread and step with
// kBlockThreads threads; rows >= `valid` are zero-filled by plain stores (never read from global
// memory).  The caller commits the group, waits for it, and then needs a __syncthreads before
// other threads read the rows.
template <int kBlockThreads, int kR, int kD>
__device__ __forceinline__ void cp_async_tile(uint16_t* dst, const uint16_t* src, int64_t stride, int valid) {
  constexpr int kChunks = kD / 8;
  static_assert(kChunks % 8 == 0, "the swizzle permutes chunks in groups of 8");
  static_assert((kR * kChunks) % kBlockThreads == 0, "tile must split evenly over the threads");
#pragma unroll
  for (int it = 0; it < kR * kChunks / kBlockThreads; ++it) {
    const int idx = it * kBlockThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kChunks, c = idx % kChunks;
    uint16_t* to = dst + r * kD + (c ^ (r & 7)) * 8;  // the write side of the swizzle (read side: swizzled)
    if (r < valid) {
      cp_async16(to, src + r * stride + c * 8);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Element offset of chunk `chunk` of row `row` in a swizzled tile of kD columns (the read side of
// cp_async_tile's layout), for a lane whose row is lane % 8 past a multiple of 8 (as in every
// ldmatrix of the loaders below): row % 8 is spelled lane % 8, so that the compiler sees one XOR
// pattern per lane instead of one per row (at D = 128 the dQ kernel spilled 8 bytes on sm_80
// with `row & 7`, none with `lane & 7`).
template <int kD>
__device__ __forceinline__ int swizzled(int row, int chunk, int lane) {
  return row * kD + ((chunk ^ (lane & 7)) << 3);
}

// mma_sm80.cuh's fragment loaders (load_a, load_b_nk2, load_b_kn2: same matrices, same lanes) on
// swizzled tiles; r0, n0, k0, c0 are multiples of 8 (rows of 8-row matrices, chunk boundaries).
template <int kD>
__device__ __forceinline__ void load_a_swz(uint32_t (&a)[4], const uint16_t* tile, int r0, int c0, int lane) {
  ldsm_x4(a, tile + swizzled<kD>(r0 + lane % 8 + ((lane / 8) % 2) * 8, c0 / 8 + lane / 16, lane));
}

template <int kD>
__device__ __forceinline__ void load_b_nk2_swz(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* tile, int n0,
                                               int k0, int lane) {
  uint32_t r[4];
  ldsm_x4(r, tile + swizzled<kD>(n0 + lane % 8 + (lane / 16) * 8, k0 / 8 + (lane / 8) % 2, lane));
  b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

template <int kD>
__device__ __forceinline__ void load_b_kn2_swz(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* tile, int k0,
                                               int n0, int lane) {
  uint32_t r[4];
  ldsm_x4_trans(r, tile + swizzled<kD>(k0 + lane % 8 + ((lane / 8) % 2) * 8, n0 / 8 + lane / 16, lane));
  b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

// The padded (kLd = kD + kPad) or the swizzled (kSwz) layout's loader: the tile steps below serve
// both (sparse.cu's padded tiles, softmax.cu's cp.async ring).
template <int kD, bool kSwz>
__device__ __forceinline__ void load_a_of(uint32_t (&a)[4], const uint16_t* tile, int r0, int c0, int lane) {
  if constexpr (kSwz) load_a_swz<kD>(a, tile, r0, c0, lane);
  else load_a<kD + kPad>(a, tile, r0, c0, lane);
}

template <int kD, bool kSwz>
__device__ __forceinline__ void load_b_nk2_of(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* tile, int n0,
                                              int k0, int lane) {
  if constexpr (kSwz) load_b_nk2_swz<kD>(b0, b1, tile, n0, k0, lane);
  else load_b_nk2<kD + kPad>(b0, b1, tile, n0, k0, lane);
}

template <int kD, bool kSwz>
__device__ __forceinline__ void load_b_kn2_of(uint32_t (&b0)[2], uint32_t (&b1)[2], const uint16_t* tile, int k0,
                                              int n0, int lane) {
  if constexpr (kSwz) load_b_kn2_swz<kD>(b0, b1, tile, k0, n0, lane);
  else load_b_kn2<kD + kPad>(b0, b1, tile, k0, n0, lane);
}

// ---------------------------------------------------------------------------------------------
// per-warp tile steps (the warp's 16 rows start at row r0 of the A tiles)
// ---------------------------------------------------------------------------------------------

// f(nt, e, c) for every entry of a 16 x (8 kNt) accumulator: entry e of n-tile nt, at row slot
// e / 2 and column c of the tile (t = lane % 4).
template <int kNt, class F>
__device__ __forceinline__ void for_each_entry(int t, F&& f) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f(nt, e, nt * 8 + 2 * t + (e % 2));
  }
}

// s += A Bᵀ over the kD columns: A = a_s[r0 .. r0 + 15][:], B = b_s[0 .. 8 kNt - 1][:] (the tile
// holds B's columns as rows: K for Q Kᵀ).
template <bool kBF16, int kD, int kNt>
__device__ __forceinline__ void mma_abt(float (&s)[kNt][4], const uint16_t* a_s, const uint16_t* b_s, int r0,
                                        int lane) {
  constexpr int kLd = kD + kPad;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[4];
    load_a<kLd>(a, a_s, r0, kk * 16, lane);
#pragma unroll
    for (int nt = 0; nt < kNt; nt += 2) {
      uint32_t b0[2], b1[2];
      load_b_nk2<kLd>(b0, b1, b_s, nt * 8, kk * 16, lane);
      mma16816<kBF16>(s[nt], a, b0);
      mma16816<kBF16>(s[nt + 1], a, b1);
    }
  }
}

// Two such products in one pass: s += A Bᵀ and s2 += A2 B2ᵀ (dQ: S = Q Kᵀ with dP = dO Vᵀ;
// dK/dV: Sᵀ = K Qᵀ with dPᵀ = V dOᵀ), on padded tiles or (kSwz) swizzled ones.
template <bool kBF16, int kD, int kNt, bool kSwz = false>
__device__ __forceinline__ void mma_abt2(float (&s)[kNt][4], const uint16_t* a_s, const uint16_t* b_s,
                                         float (&s2)[kNt][4], const uint16_t* a2_s, const uint16_t* b2_s, int r0,
                                         int lane) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    uint32_t a[4], a2[4];
    load_a_of<kD, kSwz>(a, a_s, r0, kk * 16, lane);
    load_a_of<kD, kSwz>(a2, a2_s, r0, kk * 16, lane);
#pragma unroll
    for (int nt = 0; nt < kNt; nt += 2) {
      uint32_t b0[2], b1[2], b20[2], b21[2];
      load_b_nk2_of<kD, kSwz>(b0, b1, b_s, nt * 8, kk * 16, lane);
      load_b_nk2_of<kD, kSwz>(b20, b21, b2_s, nt * 8, kk * 16, lane);
      mma16816<kBF16>(s[nt], a, b0);
      mma16816<kBF16>(s[nt + 1], a, b1);
      mma16816<kBF16>(s2[nt], a2, b20);
      mma16816<kBF16>(s2[nt + 1], a2, b21);
    }
  }
}

// acc += P B: P = the warp's 16 x (8 kNt) accumulator p (rounded to the input dtype, as the A
// operand), B = b_s[0 .. 8 kNt - 1][0 .. kD - 1] (the tile holds B's rows as rows: V for P V).
template <bool kBF16, int kD, int kNt, bool kSwz = false>
__device__ __forceinline__ void mma_pb(float (&acc)[kD / 8][4], const float (&p)[kNt][4], const uint16_t* b_s,
                                       int lane) {
#pragma unroll
  for (int kc = 0; kc < kNt / 2; ++kc) {
    uint32_t a[4];
    acc_to_a<kBF16, kNt>(a, p, kc);
#pragma unroll
    for (int dt = 0; dt < kD / 8; dt += 2) {
      uint32_t b0[2], b1[2];
      load_b_kn2_of<kD, kSwz>(b0, b1, b_s, kc * 16, dt * 8, lane);
      mma16816<kBF16>(acc[dt], a, b0);
      mma16816<kBF16>(acc[dt + 1], a, b1);
    }
  }
}

// Two such products in one pass: acc += P B and acc2 += P2 B2 (dK/dV: dV += Pᵀ dO, dK += dSᵀ Q).
template <bool kBF16, int kD, int kNt, bool kSwz = false>
__device__ __forceinline__ void mma_pb2(float (&acc)[kD / 8][4], const float (&p)[kNt][4], const uint16_t* b_s,
                                        float (&acc2)[kD / 8][4], const float (&p2)[kNt][4], const uint16_t* b2_s,
                                        int lane) {
#pragma unroll
  for (int kc = 0; kc < kNt / 2; ++kc) {
    uint32_t a[4], a2[4];
    acc_to_a<kBF16, kNt>(a, p, kc);
    acc_to_a<kBF16, kNt>(a2, p2, kc);
#pragma unroll
    for (int dt = 0; dt < kD / 8; dt += 2) {
      uint32_t b0[2], b1[2], b20[2], b21[2];
      load_b_kn2_of<kD, kSwz>(b0, b1, b_s, kc * 16, dt * 8, lane);
      load_b_kn2_of<kD, kSwz>(b20, b21, b2_s, kc * 16, dt * 8, lane);
      mma16816<kBF16>(acc[dt], a, b0);
      mma16816<kBF16>(acc[dt + 1], a, b1);
      mma16816<kBF16>(acc2[dt], a2, b20);
      mma16816<kBF16>(acc2[dt + 1], a2, b21);
    }
  }
}

// Online softmax over one key tile, in the base-2 domain, without the output: s holds the tile's
// scaled scores (-inf where hidden) and becomes P = 2^(s - m_new); the running max m_run and this
// thread's part of the running sum l_run are updated, and alpha[r] = 2^(m_old - m_new) is what
// the output accumulator of row slot r must be multiplied by (softmax_sm90.cu does that after
// the product still running on it has finished).  The 4 lanes of a quad (same lane / 4) share a row.
template <int kNt>
__device__ __forceinline__ void online_softmax_scores(float (&s)[kNt][4], float (&m_run)[2], float (&l_run)[2],
                                                      float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[r], mx);
    // A row that has seen only -inf: exponentiate against 0 (every term is then 0, no NaN).
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = exp2_approx(m_run[r] - m_use);  // 0 when m_run was -inf
    m_run[r] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      s[nt][2 * r] = exp2_approx(s[nt][2 * r] - m_use);
      s[nt][2 * r + 1] = exp2_approx(s[nt][2 * r + 1] - m_use);
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    l_run[r] = l_run[r] * alpha[r] + sum;
  }
}

// o's row slots multiplied by alpha (online_softmax_scores' factors).
template <int kDt>
__device__ __forceinline__ void rescale_rows(float (&o)[kDt][4], const float (&alpha)[2]) {
#pragma unroll
  for (int dt = 0; dt < kDt; ++dt) {
    o[dt][0] *= alpha[0];
    o[dt][1] *= alpha[0];
    o[dt][2] *= alpha[1];
    o[dt][3] *= alpha[1];
  }
}

// The same with the output accumulator o rescaled at once.
template <int kNt, int kDt>
__device__ __forceinline__ void online_softmax_update(float (&s)[kNt][4], float (&o)[kDt][4], float (&m_run)[2],
                                                      float (&l_run)[2]) {
  float alpha[2];
  online_softmax_scores<kNt>(s, m_run, l_run, alpha);
  rescale_rows<kDt>(o, alpha);
}

// ---------------------------------------------------------------------------------------------
// epilogues.  The thread's row slot r (0, 1) is row `local + 8 r`, which exists when that is
// < `valid`; its row of the contiguous [rows, kD] output is `base + (local + 8 r) · step`.
// ---------------------------------------------------------------------------------------------

// Two adjacent outputs of a thread: rounded to the 16-bit dtype, or float32 as they are (sparse.cu's
// range parts that the pattern's merge rounds once).
template <bool kBF16>
__device__ __forceinline__ void store_out_pair(uint16_t* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = pack2<kBF16>(a, b);
}
template <bool kBF16>
__device__ __forceinline__ void store_out_pair(float* dst, float a, float b) {
  dst[0] = a;
  dst[1] = b;
}

// The forward's end: out = o / l (0 for a row that saw no key) and the natural-log lse (-inf for
// such a row); out 16-bit (OutT = uint16_t) or float32.  Every lane must call it (quad shuffles).
template <bool kBF16, int kD, typename OutT>
__device__ __forceinline__ void store_out_lse(OutT* out, float* lse, int64_t base, int64_t step, int local,
                                              int valid, const float (&o)[kD / 8][4], const float (&m_run)[2],
                                              const float (&l_run)[2], int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // l >= 1 whenever the row saw a finite score (its maximum contributes 2^0); l = 0 only for a
    // row that saw no key (out 0, lse -inf).  A NaN or +inf score makes l NaN: out and lse NaN,
    // as SDPA's (issue 15: testing `l > 0` sent such rows to "no key", and the backward then
    // gave them zero gradients).
    const bool empty = l == 0.f;
    const float inv = empty ? 0.f : 1.f / l;
    if (local + 8 * r < valid) {
      const int64_t i = base + static_cast<int64_t>(local + 8 * r) * step;
      OutT* o_g = out + i * kD;
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        store_out_pair<kBF16>(o_g + dt * 8 + 2 * t, o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
      }
      if (t == 0) lse[i] = empty ? -INFINITY : (m_run[r] + log2f(l)) * kLn2;
    }
  }
}

// dst = acc · scale (rounded to the input dtype).
template <bool kBF16, int kD>
__device__ __forceinline__ void store_rows(uint16_t* dst, int64_t base, int64_t step, int local, int valid,
                                           const float (&acc)[kD / 8][4], float scale, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (local + 8 * r < valid) {
      uint16_t* g = dst + (base + static_cast<int64_t>(local + 8 * r) * step) * kD;
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(g + dt * 8 + 2 * t) = pack2<kBF16>(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
      }
    }
  }
}

// dK = dk_acc · scale and dV = dv_acc, row by row.
template <bool kBF16, int kD>
__device__ __forceinline__ void store_dk_dv(uint16_t* dk, uint16_t* dv, int64_t base, int64_t step, int local,
                                            int valid, const float (&dk_acc)[kD / 8][4],
                                            const float (&dv_acc)[kD / 8][4], float scale, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (local + 8 * r < valid) {
      const int64_t j = base + static_cast<int64_t>(local + 8 * r) * step;
      uint16_t* gk = dk + j * kD;
      uint16_t* gv = dv + j * kD;
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(gk + dt * 8 + 2 * t) =
            pack2<kBF16>(dk_acc[dt][2 * r] * scale, dk_acc[dt][2 * r + 1] * scale);
        *reinterpret_cast<uint32_t*>(gv + dt * 8 + 2 * t) = pack2<kBF16>(dv_acc[dt][2 * r], dv_acc[dt][2 * r + 1]);
      }
    }
  }
}

}  // namespace
}  // namespace attnkit

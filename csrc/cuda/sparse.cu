// CUDA C++ kernels of sparse attention (issue 4) for attnkit::sparse_range_fwd /
// sparse_range_bwd / block_sparse_fwd / block_sparse_bwd (schemas and exact semantics:
// csrc/ops.cpp; plain-PyTorch twins: pytorch_ext/reference/sparse.py): the entry points
// <op>_cuda (csrc/cuda/launch.h), which csrc/checks/sparse.cpp registers for the CUDA dispatch
// key after running the ops' input checks (nothing here throws on bad input: issue 10).
//
// STATUS.  Checked: compiles with nvcc -c for sm_80 and sm_90a (.ci/compile_cuda.sh).  The
// device code (this file up to "host side") runs on the CPU through the project's emulator of
// the warp primitives (tests/csrc/test_sparse_cuda_emulated.py: fibers per CUDA thread,
// ldmatrix / mma.m16n8k16 from the PTX ISA's fragment tables, NaN-poisoned shared memory)
// against the float64 reference.  On a GPU: tests/csrc/test_sparse_cuda.py (`pytest -m gpu`)
// passed in full on an H100 (sm_90, torch 2.11 + CUDA 13.0, commit 4a5f870, bench/RESULTS.md
// "session 8"); strided(128) N=16384 forward 0.425 ms, 4.45x FlexAttention, level with Triton.
//
// WHAT IT SUPPORTS.  float16 / bfloat16 (fp32 accumulation, lse and delta float32), head dims
// D = 64 or 128 with Dv == D, compute capability >= 8.0.  Block-sparse: block >= 16 (any size,
// not only powers of two).  Range parts: the query rows of different groups must not overlap
// (nor, for the backward, the key rows): true of every view of the form [G, 1, s, 1, s] with
// G <= s, and of a single group.  Anything else fails the op's check (csrc/checks/sparse.cpp)
// with a message naming it, so the Python side can route it elsewhere (float32 / float64: the
// CPU or Triton backends).  Block index lists on the GPU are not read back to be checked: they
// must be valid (attnkit.patterns.BlockLayout.index_lists makes them so).
//
// HOW.  The tiles and the arithmetic are those of csrc/cuda/softmax.cu (FlashAttention-2 style:
// 4 warps x 16 rows, tensor-core mma.sync.m16n8k16 through inline PTX, ldmatrix fragments,
// online softmax in base 2, deterministic backward with a dQ pass and a dK/dV pass, no
// atomics).  The element, PTX and fragment helpers are softmax.cu's, shared through
// mma_sm80.cuh (the emulator's extractor inlines it and checks each PTX helper's text); so are
// the tile geometry, shared-memory layouts and tile steps (products, online softmax, K/V loads,
// epilogues), through flash_tiles.cuh: the kernels below are only the walks' loops.  What
// differs is which rows a tile holds and which tiles it meets, given by a "walk" object per
// thread block:
//  - range part, query-major (forward, dQ): a block owns 64 consecutive query rows t of one
//    group g (rows g*q_pg + t*q_pt: read IN PLACE as a tile with row stride q_pt*D), and visits
//    the key tiles of 64 consecutive t' in [lo(t0), hi(t1)] (lo, hi nondecreasing); the element
//    test is lo(t) <= t' <= hi(t) with lo / hi per row computed once.
//  - range part, key-major (dK/dV): a block owns 64 key rows t' of a group; the queries that
//    attend them are t in [first t with hi(t) >= t'0, last t with lo(t) <= t'1], found by two
//    binary searches (monotone bounds); lo / hi of each query tile go to shared memory.
//  - block-sparse: a block owns 64 rows (query rows forward / dQ, key rows dK/dV, with the
//    transposed lists); those rows touch at most 5 blocks (block >= 16), whose sorted index lists
//    are merged on the fly: the next tile starts at the first listed block at or after the
//    current position, and a bit set per own block says which of the (at most 5) blocks under
//    the tile are listed.  Causal: j <= i per element, and tiles past the diagonal are skipped.
//  - a row that sees no key: out 0, lse -inf (the running max of an all -inf row is replaced by 0
//    when exponentiating); the backward treats lse = -inf as +inf (P = 0).  Range rows in no
//    group are filled by the host (out 0, lse -inf, zero gradients); when the groups cover every
//    row the kernels write everything and nothing is filled.
// Inputs are made contiguous with 16-byte aligned rows first (a copy only when they are not).

#include "host_utils.cuh"  // first: torch headers and host helpers
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <limits>

#include "mma_sm80.cuh"
#include "flash_tiles.cuh"

namespace attnkit {
namespace {

// Tile geometry (kThreads, kBlockQ, kBlockK, kPad), shared-memory layouts and tile steps:
// flash_tiles.cuh, shared with softmax.cu.
constexpr int kMinBlock = 16;  // block-sparse: smallest block size (64 rows then touch <= 5 blocks)
constexpr int kMaxSpan = 5;    // blocks of >= kMinBlock rows that 64 consecutive rows can touch
constexpr int kNoBlock = 0x7fffffff;

// ---------------------------------------------------------------------------------------------
// element helpers, PTX helpers, fragment loaders: mma_sm80.cuh (pack2, to_float, exp2_approx,
// mma16816, ldsm_x4, ldsm_x4_trans, load_a, load_b_nk2, load_b_kn2, acc_to_a, load_rows16).
// Tile steps: flash_tiles.cuh (load_tile, load_kv_tiles, mma_abt[2], mma_pb[2],
// online_softmax_update, for_each_entry, store_out_lse, store_rows, lse_log2, the smem layouts).
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// parameters
// ---------------------------------------------------------------------------------------------

// Range part: view = [G, q_pg, q_pt, k_pg, k_pt]; f(t) = floor((t + a) / d) * m + b for
// lo = [a, d, m, b] and hi likewise (the host checks d >= 1, 0 <= m <= 2^20, |a| <= 2^40,
// |b| <= 2^62, so that f fits in int64 for t < 2^30).
struct RangeGeo {
  int G, q_pg, q_pt, k_pg, k_pt;
  int64_t lo[4], hi[4];
};

// Block-sparse index lists: row_ptr / col_ptr [Hl, nb + 1] (absolute offsets), col_idx / row_idx.
struct BlockGeo {
  const int* row_ptr;
  const int* col_idx;
  const int* col_ptr;
  const int* row_idx;
  int Hl, nb, block;
  bool causal;
};

struct Params {
  const uint16_t* q;     // contiguous [B, H, Nq, D]
  const uint16_t* k;     // contiguous [B, H, Nk, D]
  const uint16_t* v;     // contiguous [B, H, Nk, D]
  const uint16_t* dout;  // contiguous [B, H, Nq, D]
  uint16_t* out;         // contiguous [B, H, Nq, D]
  float* out_f32;        // or there, in float32 (when set: a part that the pattern's merge rounds once)
  float* lse_out;        // contiguous [B, H, Nq] (forward)
  const float* lse;      // contiguous [B, H, Nq] (backward: the merged lse, natural log)
  const float* delta;    // contiguous [B, H, Nq] (backward: rowsum(dO * O) - dlse)
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  int H, Nq, Nk;
  float scale, scale_log2;  // scale_log2 = scale * log2(e): scores live in the base-2 domain
  RangeGeo rg;
  BlockGeo bg;
};

// ---------------------------------------------------------------------------------------------
// range parts
// ---------------------------------------------------------------------------------------------

// floor(x / d) for d >= 1 (C++ `/` truncates toward zero).
__device__ __forceinline__ int64_t floor_div(int64_t x, int64_t d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }

// f(t) clipped to [-1, tk]: outside [0, tk) every clipped value says the same thing (no key
// below / above), and the result fits in int.
__device__ __forceinline__ int range_bound(const int64_t (&f)[4], int t, int tk) {
  const int64_t v = floor_div(static_cast<int64_t>(t) + f[0], f[1]) * f[2] + f[3];
  return v < -1 ? -1 : (v > tk ? tk : static_cast<int>(v));
}

// Rows of group g: ceil(max(n - g * pg, 0) / pt).
__host__ __device__ __forceinline__ int group_rows(int n, int g, int pg, int pt) {
  const int64_t rest = static_cast<int64_t>(n) - static_cast<int64_t>(g) * pg;
  return rest <= 0 ? 0 : static_cast<int>((rest + pt - 1) / pt);
}

// Tiles of `rows` per group: as many as group 0 (the largest) needs; a tile past the end of a
// smaller group is empty.
__host__ __device__ __forceinline__ int tiles_per_group(int n, const RangeGeo& r, bool keys, int rows) {
  const int t0 = keys ? group_rows(n, 0, r.k_pg, r.k_pt) : group_rows(n, 0, r.q_pg, r.q_pt);
  return (t0 + rows - 1) / rows;
}

// Query-major walk (forward, dQ): block `tile` owns query rows t0 .. t0 + 63 of one group and
// visits the key tiles t' = k_t0 .. k_t0 + 63 that any of them attends.
struct RangeQueryWalk {
  int64_t q_row0, k_row0;  // first row of the query tile / of the current key tile
  int q_step, k_step;      // row strides (in rows) of the tiles
  int q_valid, k_valid;    // rows of the tiles that exist
  int tk, k_t0, k_next, k_last;
  int lo_r[2], hi_r[2];  // this thread's two query rows: the keys t' they attend

  __device__ RangeQueryWalk(const Params& p, int tile, int /*h*/, int row_local0) {
    const RangeGeo& r = p.rg;
    const int per_group = tiles_per_group(p.Nq, r, false, kBlockQ);
    const int g = tile / per_group, t0 = (tile % per_group) * kBlockQ;
    const int tq = group_rows(p.Nq, g, r.q_pg, r.q_pt);
    tk = group_rows(p.Nk, g, r.k_pg, r.k_pt);
    q_row0 = static_cast<int64_t>(g) * r.q_pg + static_cast<int64_t>(t0) * r.q_pt;
    q_step = r.q_pt;
    q_valid = max(0, min(kBlockQ, tq - t0));
    k_step = r.k_pt;
    k_row0 = static_cast<int64_t>(g) * r.k_pg;  // + t' * k_pt
    k_valid = 0;
    k_t0 = 0;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = t0 + row_local0 + 8 * e;
      const bool row = t < tq;
      lo_r[e] = row ? range_bound(r.lo, t, tk) : tk;
      hi_r[e] = row ? range_bound(r.hi, t, tk) : -1;
    }
    if (q_valid > 0) {
      k_next = max(range_bound(r.lo, t0, tk), 0);
      k_last = min(range_bound(r.hi, t0 + q_valid - 1, tk), tk - 1);
    } else {
      k_next = 0, k_last = -1;
    }
  }

  __device__ bool active() const { return q_valid > 0; }

  __device__ bool next(const Params& p) {
    if (k_next > k_last) return false;
    k_row0 += static_cast<int64_t>(k_next - k_t0) * k_step;
    k_t0 = k_next;
    k_valid = min(kBlockK, tk - k_t0);
    k_next += kBlockK;
    return true;
  }

  // Query row slot e (0: row_local0, 1: row_local0 + 8) and key c of the current key tile.
  __device__ bool visible(int e, int c) const {
    const int tp = k_t0 + c;
    return c < k_valid && tp >= lo_r[e] && tp <= hi_r[e];
  }
};

// Key-major walk (dK/dV): block `tile` owns key rows t' = k_t0 .. k_t0 + 63 of one group and
// visits the query tiles (kBr rows) between the first query that reaches them and the last.
template <int kBr>
struct RangeKeyWalk {
  int64_t k_row0, q_row0;
  int k_step, q_step, k_valid, q_valid;
  int tk, tq, q_t0, q_next, q_end;
  int key_t[2];  // this thread's two key rows (t')

  __device__ RangeKeyWalk(const Params& p, int tile, int /*h*/, int row_local0) {
    const RangeGeo& r = p.rg;
    const int per_group = tiles_per_group(p.Nk, r, true, kBlockK);
    const int g = tile / per_group, k_t0 = (tile % per_group) * kBlockK;
    tk = group_rows(p.Nk, g, r.k_pg, r.k_pt);
    tq = group_rows(p.Nq, g, r.q_pg, r.q_pt);
    k_row0 = static_cast<int64_t>(g) * r.k_pg + static_cast<int64_t>(k_t0) * r.k_pt;
    k_step = r.k_pt;
    k_valid = max(0, min(kBlockK, tk - k_t0));
    q_row0 = static_cast<int64_t>(g) * r.q_pg;  // + t * q_pt
    q_step = r.q_pt;
    q_valid = 0;
    q_t0 = 0;
    key_t[0] = k_t0 + row_local0;
    key_t[1] = k_t0 + row_local0 + 8;
    q_next = 0, q_end = 0;
    if (k_valid > 0) {
      // First t with hi(t) >= k_t0, first t with lo(t) > the tile's last key: hi and lo are
      // nondecreasing, so the queries in between are the only ones that can see the tile.
      const int k_t1 = k_t0 + k_valid - 1;
      int a = 0, b = tq;
      while (a < b) {
        const int mid = a + (b - a) / 2;
        if (range_bound(r.hi, mid, tk) >= k_t0) b = mid; else a = mid + 1;
      }
      q_next = a;
      b = tq;
      while (a < b) {
        const int mid = a + (b - a) / 2;
        if (range_bound(r.lo, mid, tk) > k_t1) b = mid; else a = mid + 1;
      }
      q_end = a;
    }
  }

  __device__ bool active() const { return k_valid > 0; }

  __device__ bool next(const Params& p) {
    if (q_next >= q_end) return false;
    q_row0 += static_cast<int64_t>(q_next - q_t0) * q_step;
    q_t0 = q_next;
    q_valid = min(kBr, tq - q_t0);
    q_next += kBr;
    return true;
  }

  // The key range [lo_s, hi_s] of query `idx` of the current query tile (empty past its end).
  __device__ void row_bounds(const Params& p, int idx, int* lo_s, int* hi_s) const {
    const int t = q_t0 + idx;
    const bool row = idx < q_valid;
    lo_s[idx] = row ? range_bound(p.rg.lo, t, tk) : tk;
    hi_s[idx] = row ? range_bound(p.rg.hi, t, tk) : -1;
  }

  // Key row slot e and query c of the current query tile.
  __device__ bool visible(int e, int c, const int* lo_s, const int* hi_s) const {
    const int tp = key_t[e];
    return tp < tk && tp >= lo_s[c] && tp <= hi_s[c];
  }
};

// ---------------------------------------------------------------------------------------------
// block-sparse lists
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int layout_row(const BlockGeo& g, int H, int h) { return g.Hl == H ? h : 0; }

// Merges the sorted index lists of the (at most kMaxSpan) blocks that rows own0 .. own0 +
// own_valid - 1 touch, and yields tiles of kOther rows on the other side: each starts at the
// first listed block at or after the current position, so a tile holds at least one listed
// block; bits[i] says which blocks under the tile (bit b: block ob0 + b) own block first + i
// lists, and own_bits[e] the same for this thread's own row slot e (row own[e]).  Every thread
// runs the same walk (uniform control flow).  Used by the query-major walk (own = query rows,
// the lists of listed key blocks) and the key-major one (own = key rows, transposed lists).
template <int kOther>
struct ListWalk {
  const int* idx;
  int block, n_other, first, pos, pos_end, o0, ob0;
  bool causal;
  int cur[kMaxSpan], end[kMaxSpan];
  uint32_t bits[kMaxSpan];
  int own[2];            // this thread's two own rows: own0 + row_local0 (+ 8)
  int own_rel[2];        // their block minus `first` (-1: a row past the end)
  uint32_t own_bits[2];  // bits of their block for the current tile

  // ptr / idx: the lists of all layout heads ([Hl, nb + 1] and [nnz]); head h's are used.
  __device__ void init(const BlockGeo& g, const int* ptr, const int* idx_, int H, int h, int own0, int own_valid,
                       int n_own, int n_other_, int row_local0, int pos_begin, int pos_end_) {
    ptr += static_cast<int64_t>(layout_row(g, H, h)) * (g.nb + 1);
    idx = idx_, block = g.block, n_other = n_other_, causal = g.causal;
    first = own0 / block;
    const int n_own_blocks = (own0 + own_valid - 1) / block - first + 1;
#pragma unroll
    for (int i = 0; i < kMaxSpan; ++i) {
      cur[i] = i < n_own_blocks ? ptr[first + i] : 0;
      end[i] = i < n_own_blocks ? ptr[first + i + 1] : 0;
      bits[i] = 0;
    }
    pos = pos_begin, pos_end = pos_end_, o0 = 0, ob0 = 0;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      own[e] = own0 + row_local0 + 8 * e;
      own_rel[e] = own[e] < n_own ? own[e] / block - first : -1;
      own_bits[e] = 0;
    }
  }

  __device__ bool next() {
    if (pos >= pos_end) return false;
    const int pb = pos / block;
    int best = kNoBlock;
#pragma unroll
    for (int i = 0; i < kMaxSpan; ++i) {
      while (cur[i] < end[i] && idx[cur[i]] < pb) ++cur[i];
      if (cur[i] < end[i]) best = min(best, idx[cur[i]]);
    }
    if (best == kNoBlock) return false;
    o0 = max(pos, best * block);
    if (o0 >= pos_end) return false;
    ob0 = o0 / block;  // == best: every list's entries from cur on are >= best
    const int ob1 = (min(o0 + kOther, n_other) - 1) / block;
#pragma unroll
    for (int i = 0; i < kMaxSpan; ++i) {
      uint32_t m = 0;
      for (int c = cur[i]; c < end[i] && idx[c] <= ob1; ++c) m |= 1u << (idx[c] - ob0);
      bits[i] = m;
    }
    pos = o0 + kOther;
    own_bits[0] = bits_of(own_rel[0]);
    own_bits[1] = bits_of(own_rel[1]);
    return true;
  }

  // bits of own block first + rel (0 when rel is out of range: a row past the end).
  __device__ uint32_t bits_of(int rel) const {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kMaxSpan; ++i) m = i == rel ? bits[i] : m;
    return m;
  }

  // Whether row o0 + c of the other side is in a block that own row slot e lists.
  __device__ bool listed(int e, int c) const { return (own_bits[e] >> ((o0 + c) / block - ob0)) & 1u; }
};

// Query-major walk over the block lists (forward, dQ): 64 query rows, key tiles of 64.
struct BlockQueryWalk {
  ListWalk<kBlockK> w;
  int64_t q_row0, k_row0;
  int q_step, k_step, q_valid, k_valid;

  __device__ BlockQueryWalk(const Params& p, int tile, int h, int row_local0) {
    const BlockGeo& g = p.bg;
    const int q0 = tile * kBlockQ;
    q_row0 = q0, q_step = 1, k_row0 = 0, k_step = 1, k_valid = 0;
    q_valid = min(kBlockQ, p.Nq - q0);
    // Causal: no key past the tile's last query.
    w.init(g, g.row_ptr, g.col_idx, p.H, h, q0, q_valid, p.Nq, p.Nq, row_local0, 0, g.causal ? q0 + q_valid : p.Nq);
  }

  __device__ bool active() const { return q_valid > 0; }

  __device__ bool next(const Params& p) {
    if (!w.next()) return false;
    k_row0 = w.o0;
    k_valid = min(kBlockK, p.Nk - w.o0);
    return true;
  }

  // Query row slot e and key c of the current key tile.
  __device__ bool visible(int e, int c) const {
    return c < k_valid && w.listed(e, c) && !(w.causal && w.o0 + c > w.own[e]);
  }
};

// Key-major walk over the transposed lists (dK/dV): 64 key rows, query tiles of kBr.
template <int kBr>
struct BlockKeyWalk {
  ListWalk<kBr> w;
  int64_t k_row0, q_row0;
  int k_step, q_step, k_valid, q_valid;

  __device__ BlockKeyWalk(const Params& p, int tile, int h, int row_local0) {
    const BlockGeo& g = p.bg;
    const int k0 = tile * kBlockK;
    k_row0 = k0, k_step = 1, q_row0 = 0, q_step = 1, q_valid = 0;
    k_valid = min(kBlockK, p.Nk - k0);
    // Causal: queries before the tile's first key see none of it.
    w.init(g, g.col_ptr, g.row_idx, p.H, h, k0, k_valid, p.Nk, p.Nq, row_local0, g.causal ? k0 : 0, p.Nq);
  }

  __device__ bool active() const { return k_valid > 0; }

  __device__ bool next(const Params& p) {
    if (!w.next()) return false;
    q_row0 = w.o0;
    q_valid = min(kBr, p.Nq - w.o0);
    return true;
  }

  __device__ void row_bounds(const Params&, int, int*, int*) const {}

  // Key row slot e and query c of the current query tile.
  __device__ bool visible(int e, int c, const int*, const int*) const {
    return c < q_valid && w.listed(e, c) && !(w.causal && w.own[e] > w.o0 + c);
  }
};

// ---------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------

// One block per (64 query rows of the walk, h, b).
template <bool kBF16, int kD, class Walk>
__global__ void __launch_bounds__(kThreads) sparse_fwd_kernel(const Params p) {
  constexpr int kNt = kBlockK / 8;
  extern __shared__ __align__(16) uint16_t smem[];
  const auto [q_s, k_s, v_s] = fwd_smem<kD>(smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int row_local0 = warp * 16 + lane / 4;
  Walk w(p, blockIdx.x, h, row_local0);
  if (!w.active()) return;  // uniform: a tile past the end of its group
  const uint16_t* k_g = p.k + bh * p.Nk * kD;
  const uint16_t* v_g = p.v + bh * p.Nk * kD;
  load_tile<kBlockQ, kD>(q_s, p.q + (bh * p.Nq + w.q_row0) * kD, static_cast<int64_t>(w.q_step) * kD, w.q_valid);

  float o[kD / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY};  // running max of the base-2 scores
  float l_run[2] = {0.f, 0.f};              // this thread's part of the running sum

  while (w.next(p)) {
    const int64_t k_stride = static_cast<int64_t>(w.k_step) * kD;
    load_kv_tiles<kD>(k_s, v_s, k_g + w.k_row0 * kD, k_stride, v_g + w.k_row0 * kD, k_stride, w.k_valid);

    float s[kNt][4] = {};
    mma_abt<kBF16, kD, kNt>(s, q_s, k_s, warp * 16, lane);  // S = Q Kᵀ
    for_each_entry<kNt>(t, [&](int nt, int e, int c) {
      s[nt][e] = w.visible(e / 2, c) ? s[nt][e] * p.scale_log2 : -INFINITY;
    });
    online_softmax_update(s, o, m_run, l_run);
    mma_pb<kBF16, kD, kNt>(o, s, v_s, lane);  // O += P V
  }

  if (p.out_f32 != nullptr) {
    store_out_lse<kBF16, kD>(p.out_f32, p.lse_out, bh * p.Nq + w.q_row0, w.q_step, row_local0, w.q_valid, o, m_run,
                             l_run, t);
  } else {
    store_out_lse<kBF16, kD>(p.out, p.lse_out, bh * p.Nq + w.q_row0, w.q_step, row_local0, w.q_valid, o, m_run, l_run,
                             t);
  }
}

// ---------------------------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------------------------

// dQ for the 64 query rows of the walk: P = exp(S - lse), dP = dO Vᵀ, dS = P (dP - delta),
// dQ += dS K (no atomics).
template <bool kBF16, int kD, class Walk>
__global__ void __launch_bounds__(kThreads) sparse_bwd_dq_kernel(const Params p) {
  constexpr int kNt = kBlockK / 8;
  extern __shared__ __align__(16) uint16_t smem[];
  const auto [q_s, do_s, k_s, v_s] = dq_smem<kD>(smem);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int row_local0 = warp * 16 + lane / 4;
  Walk w(p, blockIdx.x, h, row_local0);
  if (!w.active()) return;
  const uint16_t* k_g = p.k + bh * p.Nk * kD;
  const uint16_t* v_g = p.v + bh * p.Nk * kD;
  const int64_t q_stride = static_cast<int64_t>(w.q_step) * kD;
  load_tile<kBlockQ, kD>(q_s, p.q + (bh * p.Nq + w.q_row0) * kD, q_stride, w.q_valid);
  load_tile<kBlockQ, kD>(do_s, p.dout + (bh * p.Nq + w.q_row0) * kD, q_stride, w.q_valid);

  float lse2[2], dlt[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int local = row_local0 + 8 * r;
    const int64_t i = bh * p.Nq + w.q_row0 + static_cast<int64_t>(local) * w.q_step;
    lse2[r] = local < w.q_valid ? lse_log2(p.lse[i]) : INFINITY;
    dlt[r] = local < w.q_valid ? p.delta[i] : 0.f;
  }
  float dq[kD / 8][4] = {};

  while (w.next(p)) {
    const int64_t k_stride = static_cast<int64_t>(w.k_step) * kD;
    load_kv_tiles<kD>(k_s, v_s, k_g + w.k_row0 * kD, k_stride, v_g + w.k_row0 * kD, k_stride, w.k_valid);

    float s[kNt][4] = {};   // S = Q Kᵀ, then dS
    float dp[kNt][4] = {};  // dP = dO Vᵀ
    mma_abt2<kBF16, kD, kNt>(s, q_s, k_s, dp, do_s, v_s, warp * 16, lane);
    for_each_entry<kNt>(t, [&](int nt, int e, int c) {
      // Hidden entries get dS = 0 exactly, not 0 · (dP - delta): a NaN row's delta must not reach
      // the keys it cannot see (issue 15).
      s[nt][e] = w.visible(e / 2, c) ? exp2_approx(s[nt][e] * p.scale_log2 - lse2[e / 2]) * (dp[nt][e] - dlt[e / 2])
                                     : 0.f;
    });
    mma_pb<kBF16, kD, kNt>(dq, s, k_s, lane);  // dQ += dS K (the scale is applied once, at the end)
  }

  store_rows<kBF16, kD>(p.dq, bh * p.Nq + w.q_row0, w.q_step, row_local0, w.q_valid, dq, p.scale, t);
}

// dK/dV's shared memory after flash_tiles.cuh's layout: the key range [lo, hi] of each query of
// the tile (range parts; block walks leave it unused).
constexpr int kBoundsRowBytes = 2 * sizeof(int);

// dK, dV for the 64 key rows of the walk: warp w owns keys 16w..16w+15 and works on the
// transposed products (Sᵀ = K Qᵀ), so its rows of dK and dV stay in registers.  Query tiles of
// kBr = kDkdvBlockQ<kD> rows (flash_tiles.cuh).
template <bool kBF16, int kD, template <int> class Walk>
__global__ void __launch_bounds__(kThreads) sparse_bwd_dkdv_kernel(const Params p) {
  constexpr int kBr = kDkdvBlockQ<kD>;
  constexpr int kNt = kBr / 8;
  extern __shared__ __align__(16) uint16_t smem[];
  const auto [k_s, v_s, q_s, do_s, lse_s, dlt_s] = dkdv_smem<kD>(smem);
  int* lo_s = reinterpret_cast<int*>(dlt_s + kBr);  // range parts: keys [lo, hi] of each query
  int* hi_s = lo_s + kBr;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int row_local0 = warp * 16 + lane / 4;
  Walk<kBr> w(p, blockIdx.x, h, row_local0);
  if (!w.active()) return;
  const int64_t k_stride = static_cast<int64_t>(w.k_step) * kD;
  load_tile<kBlockK, kD>(k_s, p.k + (bh * p.Nk + w.k_row0) * kD, k_stride, w.k_valid);
  load_tile<kBlockK, kD>(v_s, p.v + (bh * p.Nk + w.k_row0) * kD, k_stride, w.k_valid);

  float dk[kD / 8][4] = {};
  float dv[kD / 8][4] = {};
  const uint16_t* q_g = p.q + bh * p.Nq * kD;
  const uint16_t* do_g = p.dout + bh * p.Nq * kD;

  while (w.next(p)) {
    __syncthreads();  // every warp is done with the previous Q/dO tiles (k_s, v_s: written before)
    const int64_t q_stride = static_cast<int64_t>(w.q_step) * kD;
    load_tile<kBr, kD>(q_s, q_g + w.q_row0 * kD, q_stride, w.q_valid);
    load_tile<kBr, kD>(do_s, do_g + w.q_row0 * kD, q_stride, w.q_valid);
    for (int idx = threadIdx.x; idx < kBr; idx += kThreads) {
      const int64_t i = bh * p.Nq + w.q_row0 + static_cast<int64_t>(idx) * w.q_step;
      lse_s[idx] = idx < w.q_valid ? lse_log2(p.lse[i]) : INFINITY;
      dlt_s[idx] = idx < w.q_valid ? p.delta[i] : 0.f;
      w.row_bounds(p, idx, lo_s, hi_s);
    }
    __syncthreads();

    // Sᵀ = K Qᵀ (the warp's 16 keys x kBr queries) and dPᵀ = V dOᵀ.
    float st[kNt][4] = {};
    float dpt[kNt][4] = {};
    mma_abt2<kBF16, kD, kNt>(st, k_s, q_s, dpt, v_s, do_s, warp * 16, lane);

    // Pᵀ (in st) and dSᵀ = Pᵀ ∘ (dPᵀ - delta) (in dpt); c: the query of the tile.
    for_each_entry<kNt>(t, [&](int nt, int e, int c) {
      const bool visible = w.visible(e / 2, c, lo_s, hi_s);
      const float prob = visible ? exp2_approx(st[nt][e] * p.scale_log2 - lse_s[c]) : 0.f;
      st[nt][e] = prob;
      dpt[nt][e] = visible ? prob * (dpt[nt][e] - dlt_s[c]) : 0.f;  // hidden: exactly 0 (see dQ)
    });

    // dV += Pᵀ dO,  dK += dSᵀ Q  (the scale is applied once, at the end).
    mma_pb2<kBF16, kD, kNt>(dv, st, do_s, dk, dpt, q_s, lane);
  }

  store_dk_dv<kBF16, kD>(p.dk, p.dv, bh * p.Nk + w.k_row0, w.k_step, row_local0, w.k_valid, dk, dv, p.scale, t);
}

// Host-side helpers the launches need (plain functions: the emulator's launches use them too).

// The groups of a view on one side (n rows, G groups at g * pg + t * pt): how many have rows,
// how many rows they hold together, and whether no row is in two groups (sufficient tests:
// interleaved groups, 0 < (used - 1) * pg < pt, or consecutive stretches, pg > (T_0 - 1) * pt).
struct GroupCover {
  int used;
  int64_t rows;
  bool disjoint;
};

inline GroupCover group_cover(int n, int G, int pg, int pt) {
  GroupCover c{0, 0, true};
  const int first = G > 0 ? group_rows(n, 0, pg, pt) : 0;
  if (first == 0) return c;
  if (pg == 0) {  // every group holds the same rows
    c.used = G;
    c.rows = static_cast<int64_t>(G) * first;
    c.disjoint = G == 1;
    return c;
  }
  for (int g = 0; g < G; ++g) {
    const int rows = group_rows(n, g, pg, pt);  // nonincreasing in g
    if (rows == 0) break;
    ++c.used;
    c.rows += rows;
  }
  c.disjoint = c.used <= 1 || static_cast<int64_t>(c.used - 1) * pg < pt ||
               static_cast<int64_t>(pg) > static_cast<int64_t>(first - 1) * pt;
  return c;
}

// Grid x of the range kernels: tiles of every group that has rows.
inline unsigned range_query_blocks(const Params& p, int used_q) {
  return static_cast<unsigned>(used_q) * static_cast<unsigned>(tiles_per_group(p.Nq, p.rg, false, kBlockQ));
}
inline unsigned range_key_blocks(const Params& p, int used_k) {
  return static_cast<unsigned>(used_k) * static_cast<unsigned>(tiles_per_group(p.Nk, p.rg, true, kBlockK));
}
inline unsigned block_tiles(int n, int rows) { return static_cast<unsigned>((n + rows - 1) / rows); }

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

// x contiguous with a 16-byte aligned start (the kernels read rows with 16-byte loads); a copy
// only when it is not already.
at::Tensor dense_rows(const at::Tensor& x) {
  at::Tensor c = x.contiguous();
  if (c.numel() > 0 && reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone(at::MemoryFormat::Contiguous);
  return c;
}

// The kernels agree with the limits the checks use (csrc/cuda/launch.h).
static_assert(kMinBlock == cuda_limits::kSparseMinBlock, "csrc/cuda/launch.h: kSparseMinBlock");

struct Shape {
  int64_t B, H, Nq, Nk, D;
};

// Inputs checked by checks::sparse_range_* / block_sparse_* (csrc/checks/sparse.cpp).
Shape shape_of(const at::Tensor& q, const at::Tensor& k) {
  return Shape{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
}

// The range part's view and bounds (checked: sizes, ranges, int limits) into p.rg.
void set_range(Params& p, c10::IntArrayRef view, c10::IntArrayRef lo, c10::IntArrayRef hi) {
  RangeGeo& r = p.rg;
  r.G = static_cast<int>(view[0]), r.q_pg = static_cast<int>(view[1]), r.q_pt = static_cast<int>(view[2]);
  r.k_pg = static_cast<int>(view[3]), r.k_pt = static_cast<int>(view[4]);
  for (int i = 0; i < 4; ++i) r.lo[i] = lo[i], r.hi[i] = hi[i];
}

void set_block_geo(Params& p, int64_t hl, int64_t nb, int64_t block, bool causal) {
  p.bg.Hl = static_cast<int>(hl);
  p.bg.nb = static_cast<int>(nb);
  p.bg.block = static_cast<int>(block);
  p.bg.causal = causal;
}

const int* ints(const at::Tensor& x) { return x.numel() > 0 ? x.data_ptr<int>() : nullptr; }

Params base_params(const Shape& s, double scale) {
  Params p{};
  p.H = static_cast<int>(s.H);
  p.Nq = static_cast<int>(s.Nq);
  p.Nk = static_cast<int>(s.Nk);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  return p;
}

template <bool kBF16, int kD, class QWalk>
void launch_fwd(const Params& p, unsigned q_blocks, int64_t B, cudaStream_t stream) {
  if (q_blocks == 0 || B == 0 || p.H == 0) return;
  constexpr size_t smem = fwd_smem_bytes<kD>();
  allow_smem(sparse_fwd_kernel<kBF16, kD, QWalk>, smem);
  const dim3 grid(q_blocks, static_cast<unsigned>(p.H), static_cast<unsigned>(B));
  sparse_fwd_kernel<kBF16, kD, QWalk><<<grid, kThreads, smem, stream>>>(p);
}

template <bool kBF16, int kD, class QWalk, template <int> class KWalk>
void launch_bwd(const Params& p, unsigned q_blocks, unsigned k_blocks, int64_t B, cudaStream_t stream) {
  if (B == 0 || p.H == 0) return;
  if (q_blocks > 0) {
    constexpr size_t smem = dq_smem_bytes<kD>();
    allow_smem(sparse_bwd_dq_kernel<kBF16, kD, QWalk>, smem);
    const dim3 grid(q_blocks, static_cast<unsigned>(p.H), static_cast<unsigned>(B));
    sparse_bwd_dq_kernel<kBF16, kD, QWalk><<<grid, kThreads, smem, stream>>>(p);
  }
  if (k_blocks > 0) {
    constexpr size_t smem = dkdv_smem_bytes<kD, kBoundsRowBytes>();
    allow_smem(sparse_bwd_dkdv_kernel<kBF16, kD, KWalk>, smem);
    const dim3 grid(k_blocks, static_cast<unsigned>(p.H), static_cast<unsigned>(B));
    sparse_bwd_dkdv_kernel<kBF16, kD, KWalk><<<grid, kThreads, smem, stream>>>(p);
  }
}

// Calls F<kBF16, kD>::run(args...) for the inputs' dtype and head dim (checked before).
template <template <bool, int> class F, typename... Args>
void dispatch(const at::Tensor& q, int64_t D, Args&&... args) {
  if (q.scalar_type() == at::kBFloat16) {
    D == 64 ? F<true, 64>::run(args...) : F<true, 128>::run(args...);
  } else {
    D == 64 ? F<false, 64>::run(args...) : F<false, 128>::run(args...);
  }
}

template <bool kBF16, int kD>
struct RangeFwd {
  static void run(const Params& p, unsigned qb, int64_t B, cudaStream_t st) { launch_fwd<kBF16, kD, RangeQueryWalk>(p, qb, B, st); }
};
template <bool kBF16, int kD>
struct RangeBwd {
  static void run(const Params& p, unsigned qb, unsigned kb, int64_t B, cudaStream_t st) {
    launch_bwd<kBF16, kD, RangeQueryWalk, RangeKeyWalk>(p, qb, kb, B, st);
  }
};
template <bool kBF16, int kD>
struct BlockFwd {
  static void run(const Params& p, unsigned qb, int64_t B, cudaStream_t st) { launch_fwd<kBF16, kD, BlockQueryWalk>(p, qb, B, st); }
};
template <bool kBF16, int kD>
struct BlockBwd {
  static void run(const Params& p, unsigned qb, unsigned kb, int64_t B, cudaStream_t st) {
    launch_bwd<kBF16, kD, BlockQueryWalk, BlockKeyWalk>(p, qb, kb, B, st);
  }
};

}  // namespace

// Entry points (csrc/cuda/launch.h: checked inputs; launch errors are left to the caller).

// ---- range parts ----

std::tuple<at::Tensor, at::Tensor> sparse_range_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                         const at::Tensor& v_in, c10::IntArrayRef view,
                                                         c10::IntArrayRef lo, c10::IntArrayRef hi, double scale,
                                                         bool float32_out) {
  const Shape s = shape_of(q_in, k_in);
  Params p = base_params(s, scale);
  set_range(p, view, lo, hi);
  const GroupCover cq = group_cover(p.Nq, p.rg.G, p.rg.q_pg, p.rg.q_pt);
  ATTNKIT_CHECK(cq.disjoint, "attnkit::sparse_range_fwd (cuda): unchecked view");  // checks::sparse_range_fwd: cannot happen
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in);
  // Rows in no group: out 0, lse -inf (written here; the kernels write every row of a group).
  const bool all_rows = cq.rows == s.Nq;
  const auto out_options = float32_out ? q.options().dtype(at::kFloat) : q.options();
  at::Tensor out = all_rows ? at::empty({s.B, s.H, s.Nq, s.D}, out_options) : at::zeros({s.B, s.H, s.Nq, s.D}, out_options);
  at::Tensor lse = all_rows ? at::empty({s.B, s.H, s.Nq}, q.options().dtype(at::kFloat))
                            : at::full({s.B, s.H, s.Nq}, -INFINITY, q.options().dtype(at::kFloat));
  p.q = bits(q), p.k = bits(k), p.v = bits(v);
  if (float32_out) {
    p.out_f32 = out.data_ptr<float>();
  } else {
    p.out = mutable_bits(out);
  }
  p.lse_out = lse.data_ptr<float>();
  dispatch<RangeFwd>(q, s.D, p, range_query_blocks(p, cq.used), s.B, c10::cuda::getCurrentCUDAStream());
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_range_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& lse_in, const at::Tensor& delta_in, c10::IntArrayRef view, c10::IntArrayRef lo,
    c10::IntArrayRef hi, double scale) {
  const Shape s = shape_of(q_in, k_in);
  Params p = base_params(s, scale);
  set_range(p, view, lo, hi);
  const GroupCover cq = group_cover(p.Nq, p.rg.G, p.rg.q_pg, p.rg.q_pt);
  const GroupCover ck = group_cover(p.Nk, p.rg.G, p.rg.k_pg, p.rg.k_pt);
  ATTNKIT_CHECK(cq.disjoint && ck.disjoint, "attnkit::sparse_range_bwd (cuda): unchecked view");  // checks::sparse_range_bwd: cannot happen
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in), dout = dense_rows(dout_in);
  const at::Tensor lse = lse_in.contiguous(), delta = delta_in.contiguous();
  const auto like = [](bool all, const at::Tensor& x) { return all ? at::empty_like(x) : at::zeros_like(x); };
  at::Tensor dq = like(cq.rows == s.Nq, q), dk = like(ck.rows == s.Nk, k), dv = like(ck.rows == s.Nk, v);
  p.q = bits(q), p.k = bits(k), p.v = bits(v), p.dout = bits(dout);
  p.lse = lse.data_ptr<float>(), p.delta = delta.data_ptr<float>();
  p.dq = mutable_bits(dq), p.dk = mutable_bits(dk), p.dv = mutable_bits(dv);
  dispatch<RangeBwd>(q, s.D, p, range_query_blocks(p, cq.used), range_key_blocks(p, ck.used), s.B,
                     c10::cuda::getCurrentCUDAStream());
  return {dq, dk, dv};
}

// ---- block-sparse ----

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                         const at::Tensor& v_in, const at::Tensor& row_ptr_in,
                                                         const at::Tensor& col_idx_in, int64_t block, bool causal,
                                                         double scale) {
  const Shape s = shape_of(q_in, k_in);
  const at::Tensor row_ptr = row_ptr_in.contiguous(), col_idx = col_idx_in.contiguous();
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in);
  at::Tensor out = at::empty({s.B, s.H, s.Nq, s.D}, q.options());  // every row is written
  at::Tensor lse = at::empty({s.B, s.H, s.Nq}, q.options().dtype(at::kFloat));
  Params p = base_params(s, scale);
  set_block_geo(p, row_ptr.size(0), s.Nq / block, block, causal);
  p.bg.row_ptr = ints(row_ptr), p.bg.col_idx = ints(col_idx);
  p.q = bits(q), p.k = bits(k), p.v = bits(v);
  p.out = mutable_bits(out);
  p.lse_out = lse.data_ptr<float>();
  dispatch<BlockFwd>(q, s.D, p, block_tiles(p.Nq, kBlockQ), s.B, c10::cuda::getCurrentCUDAStream());
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& lse_in, const at::Tensor& delta_in, const at::Tensor& row_ptr_in, const at::Tensor& col_idx_in,
    const at::Tensor& col_ptr_in, const at::Tensor& row_idx_in, int64_t block, bool causal, double scale) {
  const Shape s = shape_of(q_in, k_in);
  const at::Tensor row_ptr = row_ptr_in.contiguous(), col_idx = col_idx_in.contiguous();
  const at::Tensor col_ptr = col_ptr_in.contiguous(), row_idx = row_idx_in.contiguous();
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in), dout = dense_rows(dout_in);
  const at::Tensor lse = lse_in.contiguous(), delta = delta_in.contiguous();
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);  // every row is written
  Params p = base_params(s, scale);
  set_block_geo(p, row_ptr.size(0), s.Nq / block, block, causal);
  p.bg.row_ptr = ints(row_ptr), p.bg.col_idx = ints(col_idx);
  p.bg.col_ptr = ints(col_ptr), p.bg.row_idx = ints(row_idx);
  p.q = bits(q), p.k = bits(k), p.v = bits(v), p.dout = bits(dout);
  p.lse = lse.data_ptr<float>(), p.delta = delta.data_ptr<float>();
  p.dq = mutable_bits(dq), p.dk = mutable_bits(dk), p.dv = mutable_bits(dv);
  dispatch<BlockBwd>(q, s.D, p, block_tiles(p.Nq, kBlockQ), block_tiles(p.Nk, kBlockK), s.B,
                     c10::cuda::getCurrentCUDAStream());
  return {dq, dk, dv};
}

}  // namespace attnkit

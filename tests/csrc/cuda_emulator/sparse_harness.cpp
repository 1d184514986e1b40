// Host emulator for the device code of csrc/cuda/sparse.cu: the emulator of harness.cpp (fibers,
// warp collectives, ldmatrix / mma from the PTX ISA, NaN-filled shared memory; see README.md),
// the sparse kernels as extract.py cuts them out of sparse.cu, and their launches re-created
// from what sparse.cu's host side does after its checks.
//
// Build (extract.py writes sparse_kernels.inc):
//   g++ -std=c++20 -O1 -fno-strict-aliasing -shared -fPIC -I<dir of sparse_kernels.inc> sparse_harness.cpp -o libemu.so
// Optional: -DEMU_ONLY_F16_D64 (fp16 / head dim 64 only: a quick build, for the test's mutants).
#define EMU_CORE_ONLY
#include "harness.cpp"

#define __host__
using std::max;

#include "sparse_kernels.inc"

namespace {
using namespace attnkit;

bool fail(const std::string& what) {
  emu::S.failed = true;
  emu::S.error = what;
  return false;
}

template <bool BF, int D, class QWalk>
bool fwd(const Params& p, unsigned q_blocks, int B) {
  if (q_blocks == 0 || B == 0 || p.H == 0) return true;
  const dim3 grid{q_blocks, static_cast<unsigned>(p.H), static_cast<unsigned>(B)};
  return emu::launch("sparse_fwd_kernel", grid, kThreads, fwd_smem_bytes<D>(),
                     [p] { sparse_fwd_kernel<BF, D, QWalk>(p); });
}

template <bool BF, int D, class QWalk, template <int> class KWalk>
bool bwd(const Params& p, unsigned q_blocks, unsigned k_blocks, int B) {
  if (B == 0 || p.H == 0) return true;
  if (q_blocks > 0) {
    const dim3 grid{q_blocks, static_cast<unsigned>(p.H), static_cast<unsigned>(B)};
    if (!emu::launch("sparse_bwd_dq_kernel", grid, kThreads, dq_smem_bytes<D>(),
                     [p] { sparse_bwd_dq_kernel<BF, D, QWalk>(p); }))
      return false;
  }
  if (k_blocks > 0) {
    const dim3 grid{k_blocks, static_cast<unsigned>(p.H), static_cast<unsigned>(B)};
    if (!emu::launch("sparse_bwd_dkdv_kernel", grid, kThreads, dkdv_smem_bytes<D, kBoundsRowBytes>(),
                     [p] { sparse_bwd_dkdv_kernel<BF, D, KWalk>(p); }))
      return false;
  }
  return true;
}

template <bool BF, int D>
struct RangeFwd {
  static bool run(const Params& p, unsigned qb, unsigned, int B) { return fwd<BF, D, RangeQueryWalk>(p, qb, B); }
};
template <bool BF, int D>
struct RangeBwd {
  static bool run(const Params& p, unsigned qb, unsigned kb, int B) {
    return bwd<BF, D, RangeQueryWalk, RangeKeyWalk>(p, qb, kb, B);
  }
};
template <bool BF, int D>
struct BlockFwd {
  static bool run(const Params& p, unsigned qb, unsigned, int B) { return fwd<BF, D, BlockQueryWalk>(p, qb, B); }
};
template <bool BF, int D>
struct BlockBwd {
  static bool run(const Params& p, unsigned qb, unsigned kb, int B) {
    return bwd<BF, D, BlockQueryWalk, BlockKeyWalk>(p, qb, kb, B);
  }
};

template <template <bool, int> class F>
bool dispatch(int bf16, int D, const Params& p, unsigned qb, unsigned kb, int B) {
#ifdef EMU_ONLY_F16_D64
  if (bf16 || D != 64) return fail("this build has only the fp16, D = 64 kernels (EMU_ONLY_F16_D64)");
  return F<false, 64>::run(p, qb, kb, B);
#else
  if (D != 64 && D != 128) return fail("head dim " + std::to_string(D) + " not supported (64, 128)");
  if (bf16) return D == 64 ? F<true, 64>::run(p, qb, kb, B) : F<true, 128>::run(p, qb, kb, B);
  return D == 64 ? F<false, 64>::run(p, qb, kb, B) : F<false, 128>::run(p, qb, kb, B);
#endif
}

Params base(int H, int Nq, int Nk, float scale) {
  emu::S.failed = false;
  emu::S.error.clear();
  Params p{};
  p.H = H, p.Nq = Nq, p.Nk = Nk;
  p.scale = scale, p.scale_log2 = scale * kLog2e;
  return p;
}

void set_range(Params& p, const int64_t* view, const int64_t* lo, const int64_t* hi) {
  p.rg.G = static_cast<int>(view[0]), p.rg.q_pg = static_cast<int>(view[1]), p.rg.q_pt = static_cast<int>(view[2]);
  p.rg.k_pg = static_cast<int>(view[3]), p.rg.k_pt = static_cast<int>(view[4]);
  for (int i = 0; i < 4; ++i) p.rg.lo[i] = lo[i], p.rg.hi[i] = hi[i];
}

template <typename T>
void fill(T* x, size_t n, T value) {
  for (size_t i = 0; i < n; ++i) x[i] = value;
}
}  // namespace

// The forward with a 16-bit out (Params::out) or a float32 one (Params::out_f32: sparse.cu's
// float32_out).
template <typename OutT>
int range_fwd(int bf16, int D, const uint16_t* q, const uint16_t* k, const uint16_t* v, OutT* out, float* lse,
              int B, int H, int Nq, int Nk, const int64_t* view, const int64_t* lo, const int64_t* hi, float scale) {
  Params p = base(H, Nq, Nk, scale);
  set_range(p, view, lo, hi);
  const GroupCover cq = group_cover(Nq, p.rg.G, p.rg.q_pg, p.rg.q_pt);
  if (!cq.disjoint) return fail("query groups overlap (sparse.cu refuses this view)"), 1;
  if (cq.rows != Nq) {
    fill(out, size_t(B) * H * Nq * D, OutT{0});
    fill(lse, size_t(B) * H * Nq, -INFINITY);
  }
  p.q = q, p.k = k, p.v = v, p.lse_out = lse;
  if constexpr (std::is_same_v<OutT, float>) {
    p.out_f32 = out;
  } else {
    p.out = out;
  }
  return dispatch<RangeFwd>(bf16, D, p, range_query_blocks(p, cq.used), 0, B) ? 0 : 1;
}

// All tensors contiguous with 16-byte aligned rows (as sparse.cu's host side makes them):
// q, dout, out, dq [B, H, Nq, D]; k, v, dk, dv [B, H, Nk, D]; lse, delta [B, H, Nq] float32.
// Outputs are written as sparse.cu's host side and kernels write them (rows in no group: filled
// here, as at::zeros / at::full there).  Return 0 on success, else see emu_last_error().
extern "C" int emu_sparse_range_fwd(int bf16, int D, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    uint16_t* out, float* lse, int B, int H, int Nq, int Nk, const int64_t* view,
                                    const int64_t* lo, const int64_t* hi, float scale) {
  return range_fwd(bf16, D, q, k, v, out, lse, B, H, Nq, Nk, view, lo, hi, scale);
}

// The same with a float32 out.
extern "C" int emu_sparse_range_fwd32(int bf16, int D, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                      float* out, float* lse, int B, int H, int Nq, int Nk, const int64_t* view,
                                      const int64_t* lo, const int64_t* hi, float scale) {
  return range_fwd(bf16, D, q, k, v, out, lse, B, H, Nq, Nk, view, lo, hi, scale);
}

extern "C" int emu_sparse_range_bwd(int bf16, int D, const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                                    const uint16_t* v, const float* lse, const float* delta, uint16_t* dq,
                                    uint16_t* dk, uint16_t* dv, int B, int H, int Nq, int Nk, const int64_t* view,
                                    const int64_t* lo, const int64_t* hi, float scale) {
  Params p = base(H, Nq, Nk, scale);
  set_range(p, view, lo, hi);
  const GroupCover cq = group_cover(Nq, p.rg.G, p.rg.q_pg, p.rg.q_pt);
  const GroupCover ck = group_cover(Nk, p.rg.G, p.rg.k_pg, p.rg.k_pt);
  if (!cq.disjoint || !ck.disjoint) return fail("groups overlap (sparse.cu refuses this view)"), 1;
  if (cq.rows != Nq) fill(dq, size_t(B) * H * Nq * D, uint16_t{0});
  if (ck.rows != Nk) {
    fill(dk, size_t(B) * H * Nk * D, uint16_t{0});
    fill(dv, size_t(B) * H * Nk * D, uint16_t{0});
  }
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.lse = lse, p.delta = delta, p.dq = dq, p.dk = dk, p.dv = dv;
  return dispatch<RangeBwd>(bf16, D, p, range_query_blocks(p, cq.used), range_key_blocks(p, ck.used), B) ? 0 : 1;
}

// row_ptr, col_ptr int32 [Hl, N / block + 1]; col_idx, row_idx int32 [nnz].
extern "C" int emu_block_sparse_fwd(int bf16, int D, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    uint16_t* out, float* lse, int B, int H, int N, const int* row_ptr,
                                    const int* col_idx, int Hl, int block, int causal, float scale) {
  Params p = base(H, N, N, scale);
  if (block < kMinBlock || N % block != 0) return fail("block < kMinBlock or N not a multiple (sparse.cu refuses)"), 1;
  p.bg.row_ptr = row_ptr, p.bg.col_idx = col_idx, p.bg.Hl = Hl, p.bg.nb = N / block, p.bg.block = block;
  p.bg.causal = causal;
  p.q = q, p.k = k, p.v = v, p.out = out, p.lse_out = lse;
  return dispatch<BlockFwd>(bf16, D, p, block_tiles(N, kBlockQ), 0, B) ? 0 : 1;
}

extern "C" int emu_block_sparse_bwd(int bf16, int D, const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                                    const uint16_t* v, const float* lse, const float* delta, uint16_t* dq,
                                    uint16_t* dk, uint16_t* dv, int B, int H, int N, const int* row_ptr,
                                    const int* col_idx, const int* col_ptr, const int* row_idx, int Hl, int block,
                                    int causal, float scale) {
  Params p = base(H, N, N, scale);
  if (block < kMinBlock || N % block != 0) return fail("block < kMinBlock or N not a multiple (sparse.cu refuses)"), 1;
  p.bg.row_ptr = row_ptr, p.bg.col_idx = col_idx, p.bg.col_ptr = col_ptr, p.bg.row_idx = row_idx;
  p.bg.Hl = Hl, p.bg.nb = N / block, p.bg.block = block, p.bg.causal = causal;
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.lse = lse, p.delta = delta, p.dq = dq, p.dk = dk, p.dv = dv;
  return dispatch<BlockBwd>(bf16, D, p, block_tiles(N, kBlockQ), block_tiles(N, kBlockK), B) ? 0 : 1;
}

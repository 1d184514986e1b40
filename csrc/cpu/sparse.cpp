// CPU kernels of sparse attention (issue 4): the "range part" and block-sparse primitives that
// attnkit.ops.sparse composes into strided / fixed / star patterns and block layouts.
//
//   sparse_range_fwd(q [B,H,Nq,D], k [B,H,Nk,D], v [B,H,Nk,Dv], view, lo, hi, scale)
//       -> out [B,H,Nq,Dv] (q's dtype), lse [B,H,Nq] (natural log; float32, float64 for float64)
//   sparse_range_bwd(dout, q, k, v, lse, delta, view, lo, hi, scale) -> (dq, dk, dv)
//   block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, scale) -> (out, lse)
//   block_sparse_bwd(dout, q, k, v, lse, delta, row_ptr, col_idx, col_ptr, row_idx, block,
//                    causal, scale) -> (dq, dk, dv)
//   sparse_strided_fwd(q, k, v, stride, causal, scale) -> (out, lse) of strided(stride) whole
//   sparse_strided_bwd(dout, q, k, v, lse, delta?, stride, causal, scale, out?) -> (dq, dk, dv)
//       (CPU only, declared here; delta None: computed per head as rowsum(dout * out)).
// Exact semantics: the comments in csrc/ops.cpp and pytorch_ext/reference/sparse.py.
//
// Same scheme as csrc/cpu/softmax.cpp (and its micro-kernels, csrc/cpu/flash_tiles.h): scores
// in base 2 (scale * log2 e), online softmax over key chunks, packed K^T tiles, float32
// accumulation (float64 for float64).  What differs is that the visible keys of a query row are
// one interval [lo, hi] of its key set, so a tile carries per-row intervals instead of a causal
// cut, and only the interval is exponentiated (the rest of the tile row is set to 0).
//
// Range part.  view = [G, q_pg, q_pt, k_pg, k_pt]: group g's query t is row g q_pg + t q_pt, its
// key t' row g k_pg + t' k_pt; no input is copied or transposed as a whole: the forward reads
// contiguous Q and V rows in place (float32/float64; the GEMM tiles take a row stride) and
// gathers the rows of a strided view (rows 16 KiB apart share a few L1 sets) or converts other
// dtypes per task; K rows are always packed transposed.  Forward task: (b, h, g, super-tile of kRangeQS = 256 query rows);
// the ranges are nondecreasing in t, so the task needs keys [lo(t0), hi(t1)] only: they are
// packed (K^T) once per task in chunks of up to kFwdKeys = 384 (a band's 256 + 65 keys: one
// chunk), and used by all the task's strips.  A strip is kStripNarrow = 16 query rows (48 when
// the range is wider than 192 keys); its QK^T and PV GEMMs cover only the union of its rows'
// ranges (the "window"), so a band of 65 computes 80 keys per row instead of the 96 of a
// 32 x 96 tile, and the 64-row blocks of a fixed pattern's own part 8..64 instead of 64.  Each
// strip runs QK^T -> softmax -> PV on its window and is finished (out, lse) as soon as its last
// chunk is done, while in L1; the scale is folded into the exp2's FMA.  Misses dominate what
// is left (a part reads each row of q, k, v about once): the K rows are prefetched two blocks
// ahead of the transposing loads, and the next strip's Q, V and output rows one strip ahead.
// (Measured, B=1 H=8 N=4096 D=64 fp32, one thread, CPU time: band 8.9 -> 7.2 ms, columns
// 6.9 -> 5.3, fixed own block 7.9 -> 6.0, fixed summary 14.4 -> 12.5; with everything in
// L2 (N=1024, H=1) the band runs at 121 GF/s against 93 before, dense causal 163.)
//   Backward: one pass per (b, h, g): for each key tile, the query rows that attend it
// form one interval (found by binary search on the monotone bounds); the pass accumulates dK,
// dV of the tile and dQ of the group's rows (both owned by the task: no atomics, deterministic).
// When there are too few tasks for the threads, the key tiles of a group are split into
// chunks, each with its own dQ buffer, summed in a fixed order at the end.  As in the forward,
// the rows of a strided view are gathered (Q, dO once per group, K per tile) and its dQ kept
// in a contiguous buffer; the kernel writes every output row (dK/dV stored, dQ zeroed as the
// tiles first reach it), so the outputs need no zero fill; a band tile (32 keys, 97 rows)
// is one step of 128 rows.  (Measured, B=1 H=8 N=4096 D=64 fp32, one thread, CPU time:
// band 17.0 -> 14.0 ms, strided columns 12.2 -> 10.6 ms.  Not kept: 16-key tiles, whose
// 1.23x instead of 1.48x computed entries per kept one did not pay for the smaller GEMMs,
// 16.4 vs 15.9 ms; prefetching the strided rows ahead of their copies, no change.)
//
// NaN and infinities (issue 15): see row_new_max below.
//
// Block-sparse.  Forward task: (b, h, query block, sub-tile of <= 64 rows); the listed key
// blocks are gathered into chunks of up to 256 keys (small blocks: several per chunk, so the
// GEMM tiles stay large); causal keeps j <= i, a prefix of each chunk since blocks are sorted.
// Backward: dQ pass over the row lists, dK/dV pass over the transposed (column) lists.
//
// Extra memory: per thread O(Nk (D + Dv)) packed keys plus O(tile) scratch; never N x N.
//
// Tile-GEMM path (issue 25): every op reads ATTNKIT_CPU_GEMM once (cpu_gemm_path, gemm_path.h); for
// bfloat16 / float16 inputs a brgemm path runs every tile GEMM above (Q K^T, P V; backward P^T dO,
// dO V^T, dS^T Q, dS K) through oneDNN's brgemm on 16-bit operands with K zero-padded to a multiple
// of 32 (TileGemm below); the softmax, its masks and NaN rules are the same on every path.
#include "torch_headers.h"

#include <vector>

#include "empty_huge.h"
#include "gemm_path.h"
#include "pattern_bwd.h"
#include "flash_tiles.h"
#include "../checks/checks.h"

namespace attnkit {
namespace {

// Tile sizes (see the header comment; figures in the report of issue 4).
constexpr int64_t kRangeQS = 256;     // range forward: query rows per task (super-tile)
constexpr int64_t kFwdKeys = 384;     //   keys per packed chunk (a band's super-tile: one)
constexpr int64_t kStripNarrow = 16;  //   query rows per strip (GEMM pair), ranges <= kWide
constexpr int64_t kStripWide = 48;    //   ... wider ranges
constexpr int64_t kWide = 192;
constexpr int64_t kChunkK = 256;      // keys per online-softmax step (forward, block dQ pass)
constexpr int64_t kRangeKb = 32;      // range backward: keys per tile
constexpr int64_t kRangeQb = 128;     //   query rows per step (a band of 65 + 32: one)
constexpr int64_t kBlockQ = 64;       // block-sparse: query rows per task
constexpr int64_t kBlockKb = 64;      //   backward dK/dV pass: keys per task
constexpr int64_t kBlockQb = 128;     //   backward dK/dV pass: query rows per step
// Leading dimensions of packed tiles get 16 extra columns so that the rows of a [D][ld] tile
// do not all map to the same L1 sets (ld = 256 floats = 1 KiB would).
constexpr int64_t kPad = 16;

// ---------------------------------------------------------------------------------------------
// NaN and infinities (issue 15).  A NaN or +inf score must poison its row, as SDPA's does: the
// row's output and lse become NaN.  The arithmetic carries it by itself (exp2 of NaN, or of
// +inf - +inf, is NaN, so the row's sum l and its P V turn NaN and stay so through later
// rescalings); three places would drop it and are handled here, off the vector loops:
//  - the running max: std::max(m, x) returns m when x is NaN (max_nan keeps it), and a row
//    whose other visible scores are all -inf would then look empty;
//  - a row whose visible scores are all -inf (an infinite q or k): the reference and SDPA give
//    it 0 / lse -inf, as a row with no key; exp2(-inf - -inf) would make it NaN;
//  - finishing the row: a NaN row must not be read as "no key" (0, -inf); finish_row
//    (flash_tiles.h) tests l == 0 for that, so l NaN gives a NaN row and lse.
// ---------------------------------------------------------------------------------------------

// The row's new max mx from its visible raw scores s[0..n) times c.  Returns false when the
// chunk adds nothing to the row's sums: every score is -inf (the state stays as it was), or
// the row is poisoned -- a NaN or +inf max, or NaN among -inf scores (a reduction may drop NaN
// for another operand) -- and its state is set to NaN (sticky: max_nan and the rescaling keep
// it; max_nan, has_nan: flash_tiles.h).  Setting it here does not rely on exp2 of NaN being
// NaN.  Scalar work per row and chunk; the vector loops are unchanged.
template <typename acc_t>
inline bool row_new_max(const acc_t* s, int64_t n, acc_t c, acc_t& m, acc_t& l, acc_t& mx) {
  mx = max_nan(m, scaled_max(s, n, c));
  const bool poisoned = mx != mx || mx == -neg_inf<acc_t>() ||
                        (mx == neg_inf<acc_t>() && has_nan(s, n));
  if (poisoned) m = l = std::numeric_limits<acc_t>::quiet_NaN();
  return !poisoned && mx != neg_inf<acc_t>();
}

// ---------------------------------------------------------------------------------------------
// The tile GEMMs' path (issue 25): ATTNKIT_CPU_GEMM, read once per op call (cpu_gemm_path,
// gemm_path.h), picks for bfloat16 / float16 inputs between attnkit's float32 tiles (native:
// gemm<acc_t>, flash_tiles.h) and oneDNN's brgemm on 16-bit operands (brgemm16: AMX tiles on a
// Xeon; the reference fallback or the scalar emulation elsewhere, for the tests).  These kernels
// build their tiles in the accumulation type (inputs converted per task, P and dS in float32),
// so the brgemm path rounds each GEMM's operands to the inputs' 16-bit type as it multiplies
// them: exact for the inputs' own values; P and dS rounded as the softmax kernels' brgemm path
// rounds them.  Every product on it has its K (reduction) dimension zero-padded to a multiple of
// 32 in both operands, whatever the left operand holds: torch 2.13's oneDNN on AMX writes a NaN
// of left-operand row i + 1 into output row i when K > 32 and K % 32 != 0 (gemm_path.h), and
// here a left operand may be Q with a NaN row, or P / dS of a NaN row.  The operands are
// re-packed on every call (O((M + N) K) conversions against M N K products): simple and exact;
// whether hoisting the packing of shared B operands out of the strip loops pays is a question
// for an AMX machine.  float32 / float64 inputs and the native path run gemm<acc_t> as before.
// ---------------------------------------------------------------------------------------------

// The 16-bit type of a brgemm product: the inputs' (bfloat16 or float16); none for the others.
enum class Operand16 { kNone, kBFloat16, kHalf };

template <typename scalar_t>
constexpr Operand16 operand16_of() {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) return Operand16::kBFloat16;
  if constexpr (std::is_same_v<scalar_t, at::Half>) return Operand16::kHalf;
  return Operand16::kNone;
}

// One worker's tile GEMM on the call's path, with its 16-bit packing buffers and its brgemm
// state (released when the worker's scratch dies: BrgemmRelease).  Called as gemm<acc_t>:
// C [rows][ldc] (+)= A B, A element (r, x) at A[r * sar + x * sak], B [K][ldb] row-major.
template <typename acc_t>
class TileGemm {
 public:
  TileGemm() = default;

  // The GEMM of a kernel on inputs of type scalar_t: `path` for bfloat16 / float16, native for
  // float32 / float64 (whatever path the call has).
  template <typename scalar_t>
  static TileGemm on(GemmPath path) {
    TileGemm g;
    g.type_ = operand16_of<scalar_t>();
    g.path_ = g.type_ == Operand16::kNone ? GemmPath::kNative : path;
    g.release_ = BrgemmRelease(g.path_);
    return g;
  }

  void operator()(int64_t rows, int64_t cols, int64_t K, const acc_t* A, int64_t sar, int64_t sak,
                  const acc_t* B, int64_t ldb, acc_t* C, int64_t ldc, bool accumulate) {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (path_ != GemmPath::kNative) {
        if (type_ == Operand16::kBFloat16)
          brgemm_rounded<at::BFloat16>(rows, cols, K, A, sar, sak, B, ldb, C, ldc, accumulate);
        else
          brgemm_rounded<at::Half>(rows, cols, K, A, sar, sak, B, ldb, C, ldc, accumulate);
        return;
      }
    }
    gemm<acc_t>(rows, cols, K, A, sar, sak, B, ldb, C, ldc, accumulate);
  }

 private:
  // A rounded to T16 as [rows][K2] rows (zeros in [K, K2)), B as K2 rows of ldb16 in the path's
  // layout (b16_index: VNNI pairs or plain; zero rows [K, K2), zero columns [cols, ldb16)),
  // then brgemm16 with K = K2.
  template <typename T16>
  void brgemm_rounded(int64_t rows, int64_t cols, int64_t K, const float* A, int64_t sar, int64_t sak,
                      const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
    if (rows <= 0 || cols <= 0) return;
    if (K <= 0) {  // an empty reduction: C = 0 (or unchanged), without asking oneDNN
      if (!accumulate)
        for (int64_t r = 0; r < rows; ++r) std::fill(C + r * ldc, C + r * ldc + cols, 0.0f);
      return;
    }
    const int64_t K2 = round_up(K, 32);  // the NaN rule (see the section comment)
    const int64_t ldb16 = round_up(cols, 16);
    a16_.resize(static_cast<size_t>(rows * K2));
    b16_.resize(static_cast<size_t>(K2 * ldb16));
    pack_a<T16>(rows, K, K2, A, sar, sak);
    pack_b<T16>(cols, K, K2, ldb16, B, ldb);
    brgemm16<T16>(rows, cols, K2, K2, ldb16, ldc, accumulate, a16_.data(), b16_.data(), C, path_);
  }

  template <typename T16>
  void pack_a(int64_t rows, int64_t K, int64_t K2, const float* A, int64_t sar, int64_t sak) {
    uint16_t* dst = a16_.data();
    if (sak == 1) {  // rows of A (Q, dO, P, dS)
      for (int64_t r = 0; r < rows; ++r) to_bits16<T16>(A + r * sar, K, dst + r * K2, K2);
    } else if (sar == 1) {  // A is a transposed tile (P^T, dS^T): its columns become the rows
      to_bits16_transposed<T16>(A, sak, K, rows, dst, K2, K2);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t x = 0; x < K; ++x) dst[r * K2 + x] = bits16(T16(A[r * sar + x * sak]));
        std::fill(dst + r * K2 + K, dst + (r + 1) * K2, uint16_t(0));
      }
    }
  }

  template <typename T16>
  void pack_b(int64_t cols, int64_t K, int64_t K2, int64_t ldb16, const float* B, int64_t ldb) {
    uint16_t* dst = b16_.data();
    if (!brgemm_vnni_layout(path_)) {  // plain rows [K2][ldb16]
      for (int64_t x = 0; x < K; ++x) to_bits16<T16>(B + x * ldb, cols, dst + x * ldb16, ldb16);
      std::fill(dst + K * ldb16, dst + K2 * ldb16, uint16_t(0));
      return;
    }
    // VNNI: rows x, x + 1 interleaved, element (x, j) at ((x / 2) * ldb16 + j) * 2 + x % 2.
    line_.resize(static_cast<size_t>(2 * ldb16));
    uint16_t* even = line_.data();
    uint16_t* odd = even + ldb16;
    for (int64_t x = 0; x < K2; x += 2) {
      uint16_t* pair = dst + x * ldb16;  // = ((x / 2) * ldb16) * 2
      if (x >= K) {
        std::fill(pair, pair + 2 * ldb16, uint16_t(0));
        continue;
      }
      to_bits16<T16>(B + x * ldb, cols, even, ldb16);
      if (x + 1 < K)
        to_bits16<T16>(B + (x + 1) * ldb, cols, odd, ldb16);
      else
        std::fill(odd, odd + ldb16, uint16_t(0));
      for (int64_t j = 0; j < ldb16; ++j) {
        pair[2 * j] = even[j];
        pair[2 * j + 1] = odd[j];
      }
    }
  }

  Operand16 type_ = Operand16::kNone;
  GemmPath path_ = GemmPath::kNative;
  avec<uint16_t> a16_, b16_, line_;
  BrgemmRelease release_;  // the worker's brgemm state, released with its scratch
};

// ---------------------------------------------------------------------------------------------
// Tiles.  vlo[r] <= j < vhi[r] are the visible columns of row r (relative to the tile; empty
// when vlo >= vhi).
// ---------------------------------------------------------------------------------------------

// One online-softmax step: S = Q K^T (qn x kn), scores in base 2, running max m, sum l,
// O (qn x Dv, row stride ldo) += P V.  Q rows: stride ldq; K^T: [D][ldkt]; V rows: stride ldv.
template <typename acc_t>
void fwd_tile(TileGemm<acc_t>& mm, int64_t qn, int64_t kn, int64_t D, int64_t Dv, const acc_t* Q, int64_t ldq,
              const acc_t* KT, int64_t ldkt, const acc_t* V, int64_t ldv, const int64_t* vlo,
              const int64_t* vhi, acc_t c, acc_t* S, int64_t lds, acc_t* m, acc_t* l, acc_t* O,
              int64_t ldo) {
  mm(qn, kn, D, Q, ldq, 1, KT, ldkt, S, lds, false);
  for (int64_t r = 0; r < qn; ++r) {
    acc_t* s = S + r * lds;
    const int64_t a = std::clamp<int64_t>(vlo[r], 0, kn), e = std::clamp<int64_t>(vhi[r], 0, kn);
    if (a >= e) {  // nothing visible in this chunk: the row's state is unchanged
      std::fill(s, s + kn, acc_t(0));
      continue;
    }
    acc_t mx;
    if (!row_new_max(s + a, e - a, c, m[r], l[r], mx)) {
      std::fill(s, s + kn, acc_t(0));
      continue;
    }
    const acc_t alpha = std::exp2(m[r] - mx);  // 0 on the row's first visible chunk
    const acc_t sum = exp2_scaled_sum(s + a, e - a, c, mx);
    std::fill(s, s + a, acc_t(0));
    std::fill(s + e, s + kn, acc_t(0));
    if (alpha != acc_t(1)) {
      acc_t* o = O + r * ldo;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
    }
    l[r] = l[r] * alpha + sum;
    m[r] = mx;
  }
  mm(qn, Dv, kn, S, lds, 1, V, ldv, O, ldo, true);
}

// Gradients of one tile given the (merged) lse in base 2 (l2) and delta (di) per row:
// P = exp2(c S - l2) on the visible entries, dV += P^T dO, dP = dO V^T, dS = P (dP - di) scale,
// dK += dS^T Q, dQ += dS K (each skipped when its pointer is null).  K rows: stride ldk;
// K^T, V^T: [D][ldkt], [Dv][ldvt].
template <typename acc_t>
void bwd_tile(TileGemm<acc_t>& mm, int64_t qn, int64_t kn, int64_t D, int64_t Dv, const acc_t* Q, int64_t ldq,
              const acc_t* dO, int64_t lddo, const acc_t* l2, const acc_t* di, const acc_t* KT,
              int64_t ldkt, const acc_t* K, int64_t ldk, const acc_t* VT, int64_t ldvt,
              const int64_t* vlo, const int64_t* vhi, acc_t c, acc_t scale, acc_t* S, acc_t* dP,
              int64_t lds, acc_t* dQ, int64_t lddq, acc_t* dK, int64_t lddk, acc_t* dV,
              int64_t lddv) {
  mm(qn, kn, D, Q, ldq, 1, KT, ldkt, S, lds, false);
  for (int64_t r = 0; r < qn; ++r) {
    acc_t* s = S + r * lds;
    const int64_t a = std::clamp<int64_t>(vlo[r], 0, kn), e = std::clamp<int64_t>(vhi[r], 0, kn);
    if (a >= e || l2[r] == neg_inf<acc_t>()) {  // no visible entry, or a row with no key at all
      std::fill(s, s + kn, acc_t(0));
      continue;
    }
    if (l2[r] != l2[r]) {  // a NaN row (issue 15): P is NaN where it sees, whatever exp2 does
      std::fill(s, s + kn, acc_t(0));
      std::fill(s + a, s + e, l2[r]);
      continue;
    }
    exp2_scaled_sum(s + a, e - a, c, l2[r]);  // the scale folded into the exponent's FMA
    std::fill(s, s + a, acc_t(0));
    std::fill(s + e, s + kn, acc_t(0));
  }
  if (dV) {
    // dV += P^T dO.  A row whose dO holds a NaN / inf (a row another part of the pattern poisoned:
    // the merge passes it NaN) must not reach the keys it does not see through 0 * NaN in the
    // GEMM (issue 15; tests/fuzz/test_regressions.py): such rows go in as 0 and are added where
    // P != 0 alone.  Rare, so the check is a scan of dO and the common path is the plain GEMM.
    // 0 * x is 0 for finite x and NaN for NaN / inf: a branch-free (vectorized) scan instead of
    // a scalar isfinite loop with an early exit; it runs for every tile (measured: fused strided
    // backward N=4096 H=8, one thread, 25.6 -> 24.9 ms median, within this machine's noise).
    acc_t probe = 0;
    for (int64_t r = 0; r < qn; ++r) {
      const acc_t* g = dO + r * lddo;
#pragma omp simd reduction(+ : probe)
      for (int64_t c = 0; c < Dv; ++c) probe += g[c] * acc_t(0);
    }
    const bool finite = probe == acc_t(0);
    if (finite) {
      mm(kn, Dv, qn, S, 1, lds, dO, lddo, dV, lddv, true);
    } else {
      avec<acc_t> clean(static_cast<size_t>(qn * Dv));
      std::vector<char> bad(static_cast<size_t>(qn), 0);
      for (int64_t r = 0; r < qn; ++r) {
        for (int64_t c = 0; c < Dv; ++c) bad[r] |= !std::isfinite(dO[r * lddo + c]);
        for (int64_t c = 0; c < Dv; ++c) clean[r * Dv + c] = bad[r] ? acc_t(0) : dO[r * lddo + c];
      }
      mm(kn, Dv, qn, S, 1, lds, clean.data(), Dv, dV, lddv, true);
      for (int64_t r = 0; r < qn; ++r) {
        if (!bad[r]) continue;
        for (int64_t j = 0; j < kn; ++j) {
          const acc_t pj = S[r * lds + j];
          if (pj == acc_t(0)) continue;
          for (int64_t c = 0; c < Dv; ++c) dV[j * lddv + c] += pj * dO[r * lddo + c];
        }
      }
    }
  }
  mm(qn, kn, Dv, dO, lddo, 1, VT, ldvt, dP, lds, false);
  for (int64_t r = 0; r < qn; ++r) {
    const acc_t* p = S + r * lds;
    acc_t* dp = dP + r * lds;
    const acc_t d = di[r];
    if (!std::isfinite(d)) {
      // A NaN or infinite delta (the row's out is NaN, or sees an inf value): dS as usual on the
      // entries the row sees and exactly 0 on the others -- P = 0 there, but 0 * (dP - NaN / inf)
      // would carry a NaN to the dK of keys the row cannot see (issue 15; tests/fuzz/
      // test_regressions.py).
      const int64_t a = std::clamp<int64_t>(vlo[r], 0, kn), e = std::clamp<int64_t>(vhi[r], 0, kn);
      for (int64_t j = 0; j < kn; ++j)
        dp[j] = (j >= a && j < e && p[j] != acc_t(0)) ? p[j] * (dp[j] - d) * scale : acc_t(0);
      continue;
    }
#pragma omp simd
    for (int64_t j = 0; j < kn; ++j) dp[j] = p[j] * (dp[j] - d) * scale;
  }
  if (dK) mm(kn, D, qn, dP, 1, lds, Q, ldq, dK, lddk, true);
  if (dQ) mm(qn, D, kn, dP, lds, 1, K, ldk, dQ, lddq, true);
}

// rows x n of src (row stride lds) -> dst (row stride ldd), converted to acc_t.
template <typename scalar_t, typename acc_t>
inline void copy_rows(const scalar_t* src, int64_t lds, int64_t rows, int64_t n, acc_t* dst,
                      int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* s = src + r * lds;
    acc_t* d = dst + r * ldd;
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      // 16-bit rows: flash_tiles.h's vector conversion (c10::Half's scalar one does not
      // vectorize: float16 strided(64, causal) forward+backward B=1 H=8 N=4096 D=64 took 26.9 ms
      // against bfloat16's 20.9, Xeon model 207 without AMX, 2 threads, session 26).
      convert_row(s, 1, n, d);
      continue;
    }
    // An inline vector loop, not memcpy: the rows are short (a head dim) and many (the strided
    // forward gathers every Q and V row once), and the call to memcpy was 11% of its time.
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) d[x] = static_cast<acc_t>(s[x]);
  }
}

// K^T tiles: dst[d * ldd + jj] = src[jj * sn + d] for jj < kn, d < D (rows contiguous along d).
// float32 transposes 16 x 16 blocks in registers: flash_tiles.h's pack_transposed gathers 16
// keys per instruction, and that gather was 28% of the strided band's forward time on this CPU
// (the band packs ~1.5 keys per key it attends; a dense head packs each key once).
#if defined(__AVX512F__)
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + j], 128-bit lane L: rows 4i..4i+3 at column 4L + j.
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 p = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
    const __m512 q = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
    const __m512 p2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
    const __m512 q2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_f32x4(p, p2, 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(p, p2, 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(q, q2, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(q, q2, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

template <typename scalar_t, typename acc_t>
void pack_kt(const scalar_t* src, int64_t sn, int64_t kn, int64_t D, acc_t* dst, int64_t ldd) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<acc_t, float>) {
    for (int64_t j0 = 0; j0 < kn; j0 += 16) {
      const int64_t jn = std::min<int64_t>(16, kn - j0);
      const __mmask16 jm = static_cast<__mmask16>((1u << jn) - 1u);
      // The keys of a sparse part are mostly read once, from memory: ask for the block after
      // next while this one is transposed (more misses in flight than the loads alone make).
      for (int64_t j = j0 + 32; j < std::min(kn, j0 + 48); ++j)
        for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(src + j * sn + d), _MM_HINT_T0);
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t dn = std::min<int64_t>(16, D - d0);
        const __mmask16 dm = static_cast<__mmask16>((1u << dn) - 1u);
        __m512 r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < jn ? _mm512_maskz_loadu_ps(dm, src + (j0 + i) * sn + d0) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t i = 0; i < dn; ++i) _mm512_mask_storeu_ps(dst + (d0 + i) * ldd + j0, jm, r[i]);
      }
    }
    return;
  }
#endif
  pack_transposed(src, sn, 1, kn, D, dst, ldd);
}

// ---------------------------------------------------------------------------------------------
// Range parts: geometry.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kHuge = int64_t(1) << 62;

// f(t) = floor((t + a) / d) * m + b, clamped to +-2^62 (the "no bound" b = 2^40 of the callers
// must not overflow).
struct Affine {
  int64_t a = 0, d = 1, m = 0, b = 0;
  int64_t operator()(int64_t t) const {
    const int64_t x = t + a;
    int64_t q = x / d;
    if (x % d != 0 && x < 0) --q;  // C++ division truncates; floor for negative x
    const __int128 v = static_cast<__int128>(q) * m + b;
    return v > kHuge ? kHuge : v < -kHuge ? -kHuge : static_cast<int64_t>(v);
  }
};

struct RangeGeom {
  int64_t G = 0, q_pg = 0, q_pt = 1, k_pg = 0, k_pt = 1, Nq = 0, Nk = 0;
  Affine lo, hi;
  int64_t Tq(int64_t g) const { return rows_of(Nq, g * q_pg, q_pt); }
  int64_t Tk(int64_t g) const { return rows_of(Nk, g * k_pg, k_pt); }
  static int64_t rows_of(int64_t n, int64_t start, int64_t step) {
    return n > start ? ceil_div(n - start, step) : 0;
  }
  // Visible keys of query t (group with tk keys), inclusive [l, h]; empty when l > h.
  void range(int64_t t, int64_t tk, int64_t& l, int64_t& h) const {
    l = std::max<int64_t>(lo(t), 0);
    h = std::min<int64_t>(hi(t), tk - 1);
  }
};

// First t in [0, T) with f(t) >= x (f nondecreasing), T if none.
int64_t first_at_least(const Affine& f, int64_t T, int64_t x) {
  int64_t a = 0, b = T;
  while (a < b) {
    const int64_t mid = a + (b - a) / 2;
    if (f(mid) >= x) b = mid; else a = mid + 1;
  }
  return a;
}

Affine to_affine(at::IntArrayRef f) { return Affine{f[0], f[1], f[2], f[3]}; }

// The geometry of a view checked by checks::sparse_range_* (csrc/checks/sparse.cpp: sizes,
// ranges, query rows of the groups disjoint); returns whether the groups' query rows cover every
// row of q (else the caller zero-fills first) and, through keys_shared, whether some key row
// belongs to several groups (then the backward keeps the groups of a head in one task, so dK/dV
// never race).
RangeGeom make_geom(at::IntArrayRef view, at::IntArrayRef lo, at::IntArrayRef hi,
                    int64_t Nq, int64_t Nk, bool& all_rows_covered, bool& keys_shared) {
  RangeGeom g;
  g.G = view[0];
  g.q_pg = view[1];
  g.q_pt = view[2];
  g.k_pg = view[3];
  g.k_pt = view[4];
  g.Nq = Nq;
  g.Nk = Nk;
  g.lo = to_affine(lo);
  g.hi = to_affine(hi);
  // Groups are visited only while they have rows: G may be large with most groups empty.
  std::vector<char> qseen(static_cast<size_t>(Nq), 0), kseen(static_cast<size_t>(Nk), 0);
  int64_t covered = 0;
  keys_shared = false;
  for (int64_t gi = 0; gi < g.G; ++gi) {
    const int64_t tq = g.Tq(gi), tk = g.Tk(gi);
    if (tq == 0) break;  // starts only grow with g: no later group has queries either
    for (int64_t t = 0; t < tq; ++t) {
      char& s = qseen[gi * g.q_pg + t * g.q_pt];
      ATTNKIT_CHECK(!s, "attnkit::sparse_range (cpu): unchecked view: a query row in two groups");  // checks::sparse_range_*
      s = 1;
      ++covered;
    }
    for (int64_t t = 0; t < tk; ++t) {
      char& s = kseen[gi * g.k_pg + t * g.k_pt];
      keys_shared = keys_shared || s;
      s = 1;
    }
  }
  all_rows_covered = covered == Nq;
  return g;
}

// ---------------------------------------------------------------------------------------------
// Range part: forward.
// ---------------------------------------------------------------------------------------------

// Online-softmax step of one strip of hn query rows over a window of w keys: S (row stride
// lds) holds the raw scores q.k; row r sees the window's columns [a[r], e[r]) (clamped to
// [0, w)).  Leaves P = exp2(c s - m) there and 0 elsewhere in S, updates the running max m
// and sum l, and rescales the rows of O (row stride ldo) by exp2(m_old - m_new) unless the
// strip is `fresh` (no P V yet: the caller then overwrites O).
template <typename acc_t>
void strip_softmax(int64_t hn, int64_t w, const int64_t* a, const int64_t* e, acc_t c, acc_t* S,
                   int64_t lds, acc_t* m, acc_t* l, acc_t* O, int64_t ldo, int64_t Dv,
                   bool fresh) {
  // Three passes over (up to 64 of) the strip's rows, as the dense forward does
  // (softmax.cpp): the new maxima; every row's rescale factor exp2(m_old - m_new) at once
  // (exp2_diff, no libm call per row: that was ~1.5% of the strided forward in perf); then P,
  // the sums and the rescaled rows of O.  A row's chain of latencies (the max's reduction, the
  // factor, the sum's reduction) then overlaps the other rows' work.  A fresh strip's factor is
  // 0 (its rows start there: m = -inf; O is overwritten by the caller).
  constexpr int64_t kRows = 64;
  for (int64_t g0 = 0; g0 < hn; g0 += kRows) {
    const int64_t gn = std::min(kRows, hn - g0);
    acc_t m_old[kRows], mx[kRows], alpha[kRows];
    int64_t ar[kRows], er[kRows];  // the row's visible columns, clamped to [0, w)
    bool live[kRows];
    for (int64_t i = 0; i < gn; ++i) {
      const int64_t r = g0 + i;
      ar[i] = std::clamp<int64_t>(a[r], 0, w);
      er[i] = std::clamp<int64_t>(e[r], 0, w);
      m_old[i] = m[r];
      live[i] = ar[i] < er[i] && row_new_max(S + r * lds + ar[i], er[i] - ar[i], c, m[r], l[r], mx[i]);
      if (!live[i]) m_old[i] = mx[i] = acc_t(0);  // (no factor needed)
    }
    if (fresh)
      std::fill(alpha, alpha + gn, acc_t(0));
    else
      exp2_diff(m_old, mx, alpha, gn);
    for (int64_t i = 0; i < gn; ++i) {
      const int64_t r = g0 + i;
      acc_t* s = S + r * lds;
      if (!live[i]) {
        std::fill(s, s + w, acc_t(0));
        continue;
      }
      const acc_t sum = exp2_scaled_sum(s + ar[i], er[i] - ar[i], c, mx[i]);
      std::fill(s, s + ar[i], acc_t(0));
      std::fill(s + er[i], s + w, acc_t(0));
      if (!fresh && alpha[i] != acc_t(1)) {
        acc_t* o = O + r * ldo;
        for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha[i];
      }
      l[r] = l[r] * alpha[i] + sum;
      m[r] = mx[i];
    }
  }
}

template <typename acc_t>
struct RangeFwdScratch {
  TileGemm<acc_t> mm;            // the tile GEMMs on the call's path (gemm_path.h)
  avec<acc_t> kt;             // [D][ldk] K^T of the key chunk
  avec<acc_t> vr;             // [chunk][Dv] V rows gathered / converted (when not read in place)
  avec<acc_t> q;              // [kRangeQS][D] Q rows gathered / converted (idem)
  avec<acc_t> s;              // [strip][lds] scores of one strip
  avec<acc_t> o, m, l;        // [kRangeQS][Dv], [kRangeQS]: the task's online-softmax state
  std::vector<int64_t> lo, hi, a, e, slo, shi;
  std::vector<char> fresh, done;
};

// Strip height (query rows per GEMM pair) for a range of about `width` keys.
int64_t range_strip(int64_t width) { return width > kWide ? kStripWide : kStripNarrow; }

template <typename scalar_t, typename acc_t, typename out_t>
void range_fwd_kernel(GemmPath path, const RangeGeom& geo, int64_t BH, int64_t D, int64_t Dv, double scale,
                      const scalar_t* q, const scalar_t* k, const scalar_t* v, out_t* out,
                      acc_t* lse) {
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  const int64_t Nq = geo.Nq, Nk = geo.Nk;
  const int64_t qstep = geo.q_pt, kstep = geo.k_pt;
  // Q rows are read in place only when contiguous: rows q_pt * D apart (16 KiB for the strided
  // columns) fall into the same few L1 sets, and a strip reads up to 24 of them per k step.
  const bool q_direct = kInPlace && qstep == 1;
  const bool v_direct = kInPlace && kstep == 1;
  int64_t width = 0;  // range width in the middle of group 0 picks the strip height
  {
    const int64_t tq = geo.Tq(0), tk = geo.Tk(0);
    if (tq > 0 && tk > 0) {
      int64_t l, h;
      geo.range(tq / 2, tk, l, h);
      width = h - l + 1;
    }
  }
  const int64_t SH = range_strip(width);
  const int64_t QS = kRangeQS;
  const int64_t lds = kFwdKeys + kPad;
  const int64_t ldk = kFwdKeys + kPad;
  const acc_t c = static_cast<acc_t>(scale * kLog2e);
  // Tasks: (b, h, super-tile); the super-tiles of all groups, the most keys first (dynamic
  // scheduling then ends on small tasks).
  struct Tile { int64_t g, t0, work; };
  std::vector<Tile> tiles;
  for (int64_t gi = 0; gi < geo.G; ++gi) {
    const int64_t tq = geo.Tq(gi), tk = geo.Tk(gi);
    if (tq == 0) break;
    for (int64_t t0 = 0; t0 < tq; t0 += QS) {
      const int64_t t1 = std::min(tq, t0 + QS) - 1;
      int64_t l0, h0, l1, h1;
      geo.range(t0, tk, l0, h0);
      geo.range(t1, tk, l1, h1);
      tiles.push_back({gi, t0, (t1 - t0 + 1) * std::max<int64_t>(0, (h0 + h1 - l0 - l1) / 2 + 1)});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& x, const Tile& y) { return x.work > y.work; });
  const int64_t ntiles = static_cast<int64_t>(tiles.size());

  run_tasks(
      BH * ntiles,
      [&] {
        RangeFwdScratch<acc_t> st;
        st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
        st.kt.resize(static_cast<size_t>(D * ldk));
        if (!v_direct) st.vr.resize(static_cast<size_t>(kFwdKeys * Dv));
        if (!q_direct) st.q.resize(static_cast<size_t>(QS * D));
        st.s.resize(static_cast<size_t>(SH * lds));
        st.o.resize(static_cast<size_t>(QS * Dv));
        for (auto* x : {&st.m, &st.l}) x->resize(QS);
        for (auto* x : {&st.lo, &st.hi, &st.a, &st.e}) x->resize(QS);
        const int64_t ns = ceil_div(QS, SH);
        st.slo.resize(ns);
        st.shi.resize(ns);
        st.fresh.resize(ns);
        st.done.resize(ns);
        return st;
      },
      [&](RangeFwdScratch<acc_t>& st, int64_t task) {
        const int64_t bh = task / ntiles;
        const Tile& tile = tiles[task % ntiles];
        const int64_t gi = tile.g, t0 = tile.t0;
        const int64_t tq = geo.Tq(gi), tk = geo.Tk(gi);
        const int64_t qn = std::min(QS, tq - t0);
        const int64_t qrow0 = bh * Nq + gi * geo.q_pg + t0 * geo.q_pt;  // row of t0 in [B*H*Nq]
        const int64_t ns = ceil_div(qn, SH);
        // Visible keys per row, per strip (the union over its rows), and for the whole task.
        int64_t klo = kHuge, khi = -1;
        for (int64_t sx = 0; sx < ns; ++sx) {
          int64_t sl = kHuge, sh = -1;
          for (int64_t r = sx * SH; r < std::min(qn, (sx + 1) * SH); ++r) {
            geo.range(t0 + r, tk, st.lo[r], st.hi[r]);
            if (st.lo[r] <= st.hi[r]) {
              sl = std::min(sl, st.lo[r]);
              sh = std::max(sh, st.hi[r]);
            }
          }
          st.slo[sx] = sl;
          st.shi[sx] = sh;
          st.fresh[sx] = 1;
          klo = std::min(klo, sl);
          khi = std::max(khi, sh);
        }
        std::fill(st.m.begin(), st.m.begin() + qn, neg_inf<acc_t>());
        std::fill(st.l.begin(), st.l.begin() + qn, acc_t(0));
        std::fill(st.done.begin(), st.done.begin() + ns, 0);
        auto finish_strip = [&](int64_t sx) {
          for (int64_t r = sx * SH; r < std::min(qn, (sx + 1) * SH); ++r) {
            const int64_t row = qrow0 + r * qstep;
            finish_row<out_t, acc_t>(st.o.data() + r * Dv, st.m[r], st.l[r], Dv,
                                        out + row * Dv, lse + row);
          }
          st.done[sx] = 1;
        };
        // Software prefetch for the next strip: its Q rows (read in place), the V rows past the
        // current window, and its output rows (written soon).  The parts read each row of q, k,
        // v about once, so these come from memory, and a strip's work is short.
        auto prefetch_strip = [&](int64_t sx, int64_t vfrom, int64_t vto, const acc_t* Q,
                                  int64_t ldq, const acc_t* V, int64_t ldv, int64_t k0) {
          constexpr int64_t kLine = 64 / sizeof(acc_t);
          const int64_t r0 = sx * SH, r1 = std::min(qn, r0 + SH);
          if (q_direct)
            for (int64_t r = r0; r < r1; ++r)
              for (int64_t d = 0; d < D; d += kLine) __builtin_prefetch(Q + r * ldq + d, 0, 3);
          if (v_direct)
            for (int64_t j = std::max(vfrom, st.slo[sx]); j <= std::min(vto, st.shi[sx]); ++j)
              for (int64_t d = 0; d < Dv; d += kLine) __builtin_prefetch(V + (j - k0) * ldv + d, 0, 3);
          for (int64_t r = r0; r < r1; ++r) {
            const out_t* o = out + (qrow0 + r * qstep) * Dv;
            for (int64_t d = 0; d < Dv; d += 64 / static_cast<int64_t>(sizeof(out_t)))
              __builtin_prefetch(o + d, 1, 3);
          }
        };
        if (khi >= klo) {
          const int64_t kbase = bh * Nk + gi * geo.k_pg;  // row of key 0 of the group
          const acc_t* Q;
          int64_t ldq;
          if (q_direct) {
            Q = reinterpret_cast<const acc_t*>(q) + qrow0 * D;
            ldq = D;
          } else {
            copy_rows(q + qrow0 * D, qstep * D, qn, D, st.q.data(), D);
            Q = st.q.data();
            ldq = D;
          }
          // Key chunks of equal size, at most kFwdKeys: a band's super-tile (256 + 65 keys)
          // is one chunk, packed once and used by all its strips.
          const int64_t span = khi - klo + 1;
          const int64_t kc = std::min(kFwdKeys, round_up(ceil_div(span, ceil_div(span, kFwdKeys)), 16));
          for (int64_t k0 = klo; k0 <= khi; k0 += kc) {
            const int64_t kn = std::min(kc, khi + 1 - k0);
            const int64_t krow = kbase + k0 * kstep;
            pack_kt(k + krow * D, kstep * D, kn, D, st.kt.data(), ldk);
            const acc_t* V;
            int64_t ldv;
            if (v_direct) {
              V = reinterpret_cast<const acc_t*>(v) + krow * Dv;
              ldv = Dv;
            } else {
              copy_rows(v + krow * Dv, kstep * Dv, kn, Dv, st.vr.data(), Dv);
              V = st.vr.data();
              ldv = Dv;
            }
            for (int64_t sx = 0; sx < ns; ++sx) {
              const int64_t wa = std::max(st.slo[sx], k0), wb = std::min(st.shi[sx], k0 + kn - 1);
              if (wa > wb) continue;
              const int64_t w = wb - wa + 1;
              const int64_t r0 = sx * SH, hn = std::min(SH, qn - r0);
              for (int64_t r = 0; r < hn; ++r) {
                st.a[r] = st.lo[r0 + r] - wa;
                st.e[r] = st.hi[r0 + r] + 1 - wa;
              }
              if (sx + 1 < ns) prefetch_strip(sx + 1, wb + 1, k0 + kn - 1, Q, ldq, V, ldv, k0);
              st.mm(hn, w, D, Q + r0 * ldq, ldq, 1, st.kt.data() + (wa - k0), ldk,
                          st.s.data(), lds, false);
              strip_softmax<acc_t>(hn, w, st.a.data(), st.e.data(), c, st.s.data(), lds,
                                   st.m.data() + r0, st.l.data() + r0, st.o.data() + r0 * Dv, Dv,
                                   Dv, st.fresh[sx]);
              st.mm(hn, Dv, w, st.s.data(), lds, 1, V + (wa - k0) * ldv, ldv,
                          st.o.data() + r0 * Dv, Dv, !st.fresh[sx]);
              st.fresh[sx] = 0;
              if (wb == st.shi[sx]) finish_strip(sx);  // its last keys: write it while in L1
            }
          }
        }
        for (int64_t sx = 0; sx < ns; ++sx)
          if (!st.done[sx]) finish_strip(sx);
      });
}
// ---------------------------------------------------------------------------------------------
// strided(s), fused forward (issue 14): all parts of a row in one online softmax.
// ---------------------------------------------------------------------------------------------
// Row i = s u + r (block u, residue r) sees the band [i - s, i] (non-causal: [i - s, i + s])
// and the columns i - j = k s, |k| >= 2: the keys (t', r) of its residue with t' <= u - 2
// (non-causal also t' >= u + 2).  Run as range parts, that is two or three kernel calls, whose
// (out, lse) pairs were then merged in PyTorch (~14 of 53 ms of a forward+backward at N=4096,
// H=8), each part reading q, k, v again.  Here one task is (b, h, segment of super-blocks of U
// blocks: the whole head unless there are fewer heads than 2 x threads), and
//   B. per super-block, strips of consecutive rows over their band (K^T of the super-block's
//      keys packed once): the online-softmax state (m, l, unnormalized O) of each row is kept,
//      residue-major, in the task's scratch;
//   A. per residue r: its query rows of the segment against its columns, from that state, as one
//      small causal problem (rows t, keys t' <= t - 2): its K^T and V gathered once into
//      contiguous tiles (Q rows read in place), so the GEMMs run on packed keys; the rows are
//      finished (out, lse) -- nothing of a part's result leaves the task, and there is no merge.
// The union is exact: band and columns partition the row's keys (k = 0, +-1 are the band's).
// NaN / inf: the state carries them as the range kernel's does (row_new_max); a row poisoned
// in B stays NaN through A.
// Session 6 (B=1 H=8 D=64 float32 strided(64), one thread, CPU time, variants interleaved in one
// process): A ran per super-block before, on every residue's columns packed for the task, and
// so read all the packed columns (2.3 MiB at N=4096: past L2) again for every 8 rows of a
// residue; per residue over the whole segment: 9.1 -> 8.5 ms at N=4096, 65 -> 63 ms at 16384.
// Super-blocks of 256 / 512 / 1024 rows: 8.79 / 8.80 / 8.88 ms; A strips of 4 / 8 / 16 rows:
// 9.82 / 8.80 / 8.81 ms (N=4096).
constexpr int64_t kStridedSB = 512;  // rows per super-block (U = kStridedSB / s blocks, >= 1)
constexpr int64_t kStripA = 8;       // A: query rows (of one residue) per GEMM strip
// B: query rows per band strip (ranges up to kWide; kStripWide beyond).  8 rows (72-key window
// for s = 64) against 16 (80 keys): 9.7 -> 9.3 ms at N=4096 (with a dense call between calls,
// as in bench/sparse_targets.py), 62.0 -> 60.2 ms at N=16384; 4 rows 10.4, 12 rows 9.5.
constexpr int64_t kStripBandFwd = 8;

// Asks for n rows (width elements, `stride` apart) ahead of their use.  The gathers of the
// strided forward read rows s * D apart, a new page each: the hardware prefetchers do not
// follow, and without this the gathers were a third of its time (perf, N=4096).
template <typename T>
inline void prefetch_rows(const T* src, int64_t stride, int64_t n, int64_t width) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < width; d += kLine) __builtin_prefetch(src + j * stride + d, 0, 3);
}

// The column keys of query rows t0 .. t0 + hn - 1 of one residue (tr rows): t' <= t - 2, then
// (non-causal) t' >= t + 2, in chunks of at most kChunkK.  For each chunk [k0, k0 + w): lo[x],
// hi[x] are row x's visible columns relative to k0, then visit(k0, w) runs.  Shared by the
// fused strided forward and backward.
template <typename Visit>
inline void column_chunks(int64_t t0, int64_t hn, int64_t tr, bool causal, int64_t* lo, int64_t* hi,
                          Visit&& visit) {
  for (int side = 0; side < (causal ? 1 : 2); ++side) {
    const int64_t ka = side == 0 ? 0 : t0 + 2;
    const int64_t kb = side == 0 ? std::min(tr, t0 + hn - 2) : tr;  // exclusive
    for (int64_t k0 = ka; k0 < kb; k0 += kChunkK) {
      const int64_t w = std::min(kChunkK, kb - k0);
      for (int64_t x = 0; x < hn; ++x) {
        const int64_t t = t0 + x;
        lo[x] = (side == 0 ? 0 : t + 2) - k0;
        hi[x] = (side == 0 ? t - 1 : tr) - k0;
      }
      visit(k0, w);
    }
  }
}

template <typename acc_t>
struct StridedFwdScratch {
  TileGemm<acc_t> mm;            // the tile GEMMs on the call's path (gemm_path.h)
  avec<acc_t> ktr, vr, qr;         // one residue: K^T [D][ldt], V [T][Dv], Q rows [T][D] (converted)
  avec<acc_t> oa, ma, la;          // the segment's row state, residue-major: [s][ldr], [s][Useg]
  avec<acc_t> kt;                  // band K^T [D][ldb]
  avec<acc_t> qb, vb;              // band Q rows, V rows converted (non-float32 inputs)
  avec<acc_t> s;                   // scores [strip][lds]
  avec<acc_t> o, m, l;             // a band strip's state (strides below the strip height)
  std::vector<int64_t> a, e;
};

template <typename scalar_t, typename acc_t>
void strided_fwd_kernel(GemmPath path, int64_t BH, int64_t N, int64_t D, int64_t Dv, int64_t s, bool causal,
                        double scale, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                        scalar_t* out, acc_t* lse) {
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  const int64_t T = ceil_div(N, s);  // blocks (rows of residue 0)
  const int64_t U = std::max<int64_t>(1, std::min(T, kStridedSB / s));
  const int64_t nsb = ceil_div(T, U);
  const int64_t SBR = U * s;  // rows per super-block
  const int64_t sN = std::min(s, N);  // residues that have rows
  const int64_t ldt = T + (T >= 64 ? kPad : 0);
  const int64_t bandw = causal ? s : 2 * s;  // extra keys of a strip's band window
  const int64_t SHB = bandw + kStripNarrow > kWide ? kStripWide : kStripBandFwd;
  const int64_t bandk = std::min(N, SBR + bandw);  // band keys of a super-block, at most
  const int64_t ldb = bandk + kPad;
  const int64_t lds = std::max<int64_t>(kChunkK, SHB + bandw) + kPad;
  const int64_t SR = std::max(SHB, kStripA);
  const acc_t c = static_cast<acc_t>(scale * kLog2e);
  auto Tr = [&](int64_t r) { return r < N ? ceil_div(N - r, s) : int64_t(0); };
  // Segments per head: enough tasks for the threads; each segment gathers the columns it needs.
  const int64_t threads = at::get_num_threads();
  const int64_t segs = std::clamp<int64_t>(ceil_div(2 * threads, BH), 1, nsb);
  const int64_t Umax = ceil_div(nsb, segs) * U;  // blocks of the longest segment
  // A residue's state rows are Umax * Dv apart plus one cache line: a band strip writes its
  // consecutive rows, one per residue, and at a multiple of 4 KiB apart (16 KiB at N = 4096)
  // they would all fall into the same few L1 sets.
  const int64_t ldr = Umax * Dv + kPad;

  run_tasks(
      BH * segs,
      [&] {
        StridedFwdScratch<acc_t> st;
        st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
        st.ktr.resize(static_cast<size_t>(D * ldt));
        st.vr.resize(static_cast<size_t>(T * Dv));
        if (!kInPlace) st.qr.resize(static_cast<size_t>(Umax * D));
        st.oa.resize(static_cast<size_t>(sN * ldr));
        st.ma.resize(sN * Umax);
        st.la.resize(sN * Umax);
        st.kt.resize(static_cast<size_t>(D * ldb));
        if (!kInPlace) {
          st.qb.resize(static_cast<size_t>(std::min(N, SBR) * D));
          st.vb.resize(static_cast<size_t>(bandk * Dv));
        }
        st.s.resize(static_cast<size_t>(SR * lds));
        st.o.resize(static_cast<size_t>(SHB * Dv));
        for (auto* x : {&st.m, &st.l}) x->resize(SR);
        for (auto* x : {&st.a, &st.e}) x->resize(SR);
        return st;
      },
      [&](StridedFwdScratch<acc_t>& st, int64_t task) {
        const int64_t bh = task / segs, seg = task % segs;
        const int64_t ub0 = (seg * nsb / segs) * U, ub1 = std::min(T, ((seg + 1) * nsb / segs) * U);
        const int64_t is0 = ub0 * s, is1 = std::min(N, ub1 * s);  // rows of the segment
        const scalar_t* qh = q + bh * N * D;
        const scalar_t* kh = k + bh * N * D;
        const scalar_t* vh = v + bh * N * Dv;
        scalar_t* oh = out + bh * N * Dv;
        acc_t* lh = lse + bh * N;
        auto state_at = [&](int64_t i) { return (i % s) * Umax + (i / s - ub0); };
        // ---- B: the band, per super-block, strips of consecutive rows: reads q, k, v in
        // order (their first touch); leaves each row's state (m, l, unnormalized O) ----
        for (int64_t i0 = is0; i0 < is1; i0 += SBR) {
          const int64_t i1 = std::min(is1, i0 + SBR);
          const int64_t ka = std::max<int64_t>(0, i0 - s);
          const int64_t kb = std::min(N, i1 + (causal ? 0 : s));  // exclusive
          const int64_t kn = kb - ka;
          pack_kt(kh + ka * D, D, kn, D, st.kt.data(), ldb);
          const acc_t* Q;
          const acc_t* V;
          if constexpr (kInPlace) {
            Q = qh + i0 * D;
            V = vh + ka * Dv;
          } else {
            copy_rows(qh + i0 * D, D, i1 - i0, D, st.qb.data(), D);
            copy_rows(vh + ka * Dv, Dv, kn, Dv, st.vb.data(), Dv);
            Q = st.qb.data();
            V = st.vb.data();
          }
          // A strip inside one block (s >= the strip height) writes its state in place:
          // consecutive rows are consecutive residues, ldr apart there.  Else (small strides)
          // the strip's state is copied there.
          for (int64_t r0 = i0; r0 < i1;) {
            const int64_t u = r0 / s;
            const bool direct = s >= SHB;
            const int64_t hn = std::min({SHB, i1 - r0, direct ? (u + 1) * s - r0 : SHB});
            const int64_t wa = std::max<int64_t>(0, r0 - s);
            const int64_t wb = std::min(N, r0 + hn + (causal ? 0 : s));  // exclusive
            acc_t* O = direct ? st.oa.data() + (r0 % s) * ldr + (u - ub0) * Dv : st.o.data();
            const int64_t ldo = direct ? ldr : Dv;
            for (int64_t x = 0; x < hn; ++x) {
              const int64_t i = r0 + x;
              st.m[x] = neg_inf<acc_t>();
              st.l[x] = acc_t(0);
              st.a[x] = std::max<int64_t>(0, i - s) - wa;
              st.e[x] = std::min(N, i + 1 + (causal ? 0 : s)) - wa;
            }
            // The next strip's new Q and V rows, read here for the first time: without this
            // the band's GEMMs waited on them (B=1 H=8 N=4096 D=64 strided(64), one thread,
            // CPU time, interleaved: forward 10.3 -> 9.1 ms; two or three strips ahead, or
            // the K^T columns too, no better).
            if (r0 + hn < N) prefetch_rows(qh + (r0 + hn) * D, D, std::min(hn, N - r0 - hn), D);
            if (wb < N) prefetch_rows(vh + wb * Dv, Dv, std::min(hn, N - wb), Dv);
            const int64_t w = wb - wa;
            st.mm(hn, w, D, Q + (r0 - i0) * D, D, 1, st.kt.data() + (wa - ka), ldb,
                        st.s.data(), lds, false);
            strip_softmax<acc_t>(hn, w, st.a.data(), st.e.data(), c, st.s.data(), lds,
                                 st.m.data(), st.l.data(), O, ldo, Dv, true);
            st.mm(hn, Dv, w, st.s.data(), lds, 1, V + (wa - ka) * Dv, Dv, O, ldo, false);
            for (int64_t x = 0; x < hn; ++x) {
              const int64_t i = r0 + x;
              const int64_t at = state_at(i);
              st.ma[at] = st.m[x];
              st.la[at] = st.l[x];
              acc_t* dst = st.oa.data() + (i % s) * ldr + (i / s - ub0) * Dv;
              // A row with nothing to attend yet holds 0, not the GEMM's 0 * V (NaN where the
              // window has an inf value the row does not see).
              if (st.m[x] == neg_inf<acc_t>())
                std::fill(dst, dst + Dv, acc_t(0));
              else if (!direct)
                std::copy(O + x * ldo, O + x * ldo + Dv, dst);
            }
            r0 += hn;
          }
        }
        // ---- A: the columns, one residue at a time over all the segment's rows (a small
        // causal problem: rows t, keys t' <= t - 2), from the band's state; finishes the rows.
        // Its K and V rows are gathered once per segment (rows s * D apart: prefetched one
        // residue ahead; see the section comment for what this replaced). ----
        auto keys_of = [&](int64_t r) {  // keys t' < keys_of(r) of residue r the segment needs
          const int64_t tr = Tr(r), tb = std::min(ub1, tr);
          return causal ? std::clamp<int64_t>(tb - 2, 0, tr) : (tb > ub0 ? tr : int64_t(0));
        };
        for (int64_t r = 0; r < sN; ++r) {
          const int64_t tr = Tr(r);
          const int64_t ta = ub0, tb = std::min(ub1, tr);  // query blocks of residue r here
          if (ta >= tb) continue;
          const int64_t nk = keys_of(r);
          if (r + 1 < sN) {  // the next residue's rows, while this one is computed
            const int64_t nk1 = keys_of(r + 1), tb1 = std::min(ub1, Tr(r + 1));
            prefetch_rows(kh + (r + 1) * D, s * D, nk1, D);
            prefetch_rows(vh + (r + 1) * Dv, s * Dv, nk1, Dv);
            if (nk1 > 0 && tb1 > ta) prefetch_rows(qh + (ta * s + r + 1) * D, s * D, tb1 - ta, D);
          }
          acc_t* m = st.ma.data() + r * Umax;
          acc_t* l = st.la.data() + r * Umax;
          acc_t* O = st.oa.data() + r * ldr;
          if (nk > 0) {
            pack_kt(kh + r * D, s * D, nk, D, st.ktr.data(), ldt);
            copy_rows(vh + r * Dv, s * Dv, nk, Dv, st.vr.data(), Dv);
            // Q rows are read in place (float32 / float64): a strip's 8 rows, s * D apart, take
            // 8 ways of the same few L1 sets, which hold 12 (against the gathered copy: 8.50 ->
            // 8.28 ms at N=4096, 58.6 -> 56.9 ms at N=16384, interleaved).  Other dtypes are
            // converted here.
            if constexpr (!kInPlace) copy_rows(qh + (ta * s + r) * D, s * D, tb - ta, D, st.qr.data(), D);
          }
          for (int64_t t0 = ta; t0 < tb; t0 += kStripA) {
            const int64_t hn = std::min(kStripA, tb - t0);
            const acc_t* Qa;  // the strip's Q rows
            int64_t sqa;
            if constexpr (kInPlace) {
              Qa = qh + (t0 * s + r) * D;
              sqa = s * D;
            } else {
              Qa = st.qr.data() + (t0 - ta) * D;
              sqa = D;
            }
            column_chunks(t0, hn, tr, causal, st.a.data(), st.e.data(), [&](int64_t k0, int64_t w) {
              st.mm(hn, w, D, Qa, sqa, 1, st.ktr.data() + k0, ldt, st.s.data(), lds, false);
              strip_softmax<acc_t>(hn, w, st.a.data(), st.e.data(), c, st.s.data(), lds,
                                   m + (t0 - ub0), l + (t0 - ub0), O + (t0 - ub0) * Dv, Dv, Dv,
                                   false);
              st.mm(hn, Dv, w, st.s.data(), lds, 1, st.vr.data() + k0 * Dv, Dv,
                          O + (t0 - ub0) * Dv, Dv, true);
            });
            // Finished in place (normalized, lse in ma): the rows are written to out below,
            // in order.
            for (int64_t x = 0; x < hn; ++x) {
              acc_t* o = O + (t0 + x - ub0) * Dv;
              finish_row<acc_t, acc_t>(o, m[t0 + x - ub0], l[t0 + x - ub0], Dv, o, &m[t0 + x - ub0]);
            }
          }
        }
        // Written row by row from the residue-major state: out in order.  Finishing straight
        // into out wrote rows s * Dv apart, a page each: 0.8 of 10 ms of the forward (B=1 H=8
        // N=4096 D=64 strided(64), one thread) went to those stores' misses.
        for (int64_t i = is0; i < is1; ++i) {
          const acc_t* src = st.oa.data() + (i % s) * ldr + (i / s - ub0) * Dv;
          scalar_t* dst = oh + i * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<scalar_t>(src[d]);
          lh[i] = st.ma[state_at(i)];
        }
      });
}
// ---------------------------------------------------------------------------------------------
// strided(s), fused backward (issue 14): both parts' gradients in one call, into one set of
// outputs (the range parts' backward calls returned three tensors each, then summed).
// ---------------------------------------------------------------------------------------------
// One task per (b, h): it owns the head's dK / dV rows, so nothing races.  Band: strips of
// consecutive query rows (8) over their key window (72 keys for s = 64: 1.11 computed entries
// per kept one, against 1.48 in the range kernel's 32-key x 97-row tiles), K^T / V^T packed per
// super-block of rows.  Columns first: per residue, its rows, keys, dO, lse and delta gathered
// once, dQ / dK / dV accumulated into the task's residue-major copy of the head's gradients;
// then the band, per super-block, writes the outputs' rows in order from that copy and adds its
// tiles to them.  (Session 6, B=1 H=8 N=4096 D=64 strided(64), one thread, CPU time,
// interleaved: 24.9 -> 20.7 ms; the columns stored their rows straight into the outputs, s * D
// apart, a page each, and the band then read them back.  Prefetching the band's next rows: no
// gain.)  Gradients of a tile: bwd_tile (NaN / inf rules there).
constexpr int64_t kStripBwdA = 16;  // columns: query rows (of one residue) per tile
// Band: query rows per strip.  8 rows (72-key window for s = 64: 1.11 computed entries per kept
// one) against 16 (80 keys, 1.23): backward 20.4 -> 19.5 ms at N=4096, 146.9 -> 142.9 ms at
// N=16384 (one thread, CPU time, interleaved; 12 rows 20.5, 32 rows 21.0; column strips of 8
// or 32 rows: 20.8 / 20.6 against 20.4 for 16).
constexpr int64_t kStripBwdBand = 8;

template <typename acc_t>
struct StridedBwdScratch {
  TileGemm<acc_t> mm;            // the tile GEMMs on the call's path (gemm_path.h)
  avec<acc_t> kt, vt;                 // band: K^T, V^T [D][ldb] of a super-block's keys
  avec<acc_t> qb, gb, kb;             // band: Q, dO, K rows converted (non-float32 inputs)
  avec<acc_t> l2, di;                 // [N] lse in base 2, delta of the head (band), or residue
  avec<acc_t> ktr, vtr;               // columns: K^T, V^T [D][ldt] of one residue
  avec<acc_t> kr, qr, gr;             // columns: K, Q, dO rows of one residue
  avec<acc_t> dqr, dkr, dvr;          // columns: the head's gradients, residue-major
  avec<acc_t> s, dp;                  // [rows][lds]
  std::vector<int64_t> vlo, vhi;
};

template <typename scalar_t, typename acc_t>
void strided_bwd_kernel(GemmPath path, int64_t BH, int64_t N, int64_t D, int64_t Dv, int64_t s, bool causal,
                        double scale, const scalar_t* dout, const scalar_t* q,
                        const scalar_t* k, const scalar_t* v, const acc_t* lse,
                        const acc_t* delta, const scalar_t* out, acc_t* dq, acc_t* dk, acc_t* dv) {
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  const int64_t T = ceil_div(N, s);
  const int64_t U = std::max<int64_t>(1, std::min(T, kStridedSB / s));
  const int64_t SBR = U * s;
  const int64_t sN = std::min(s, N);
  const int64_t ldt = T + (T >= 64 ? kPad : 0);
  // The columns' gradients of the head, residue-major: residue r's rows t at r * ldq + t * D
  // (ldv for dV), one cache line of padding per residue so that consecutive rows (consecutive
  // residues) do not share L1 sets.
  const int64_t ldq = T * D + kPad, ldv = T * Dv + kPad;
  const int64_t bandw = causal ? s : 2 * s;
  const int64_t SH = kStripBwdBand;
  const int64_t bandk = std::min(N, SBR + bandw);
  const int64_t ldb = bandk + kPad;
  const int64_t lds = std::max<int64_t>(kChunkK, SH + bandw) + kPad;
  const int64_t SR = std::max(SH, kStripBwdA);
  const acc_t c = static_cast<acc_t>(scale * kLog2e);
  const acc_t sc = static_cast<acc_t>(scale);
  auto Tr = [&](int64_t r) { return r < N ? ceil_div(N - r, s) : int64_t(0); };

  run_tasks(
      BH,
      [&] {
        StridedBwdScratch<acc_t> st;
        st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
        st.kt.resize(static_cast<size_t>(D * ldb));
        st.vt.resize(static_cast<size_t>(Dv * ldb));
        if (!kInPlace) {
          st.qb.resize(static_cast<size_t>(std::min(N, SBR) * D));
          st.gb.resize(static_cast<size_t>(std::min(N, SBR) * Dv));
          st.kb.resize(static_cast<size_t>(bandk * D));
        }
        st.l2.resize(N);
        st.di.resize(N);
        st.ktr.resize(static_cast<size_t>(D * ldt));
        st.vtr.resize(static_cast<size_t>(Dv * ldt));
        st.kr.resize(static_cast<size_t>(T * D));
        st.qr.resize(static_cast<size_t>(T * D));
        st.gr.resize(static_cast<size_t>(T * Dv));
        st.dqr.resize(static_cast<size_t>(sN * ldq));
        st.dkr.resize(static_cast<size_t>(sN * ldq));
        st.dvr.resize(static_cast<size_t>(sN * ldv));
        st.s.resize(static_cast<size_t>(SR * lds));
        st.dp.resize(static_cast<size_t>(SR * lds));
        st.vlo.resize(SR);
        st.vhi.resize(SR);
        return st;
      },
      [&](StridedBwdScratch<acc_t>& st, int64_t bh) {
        const scalar_t* qh = q + bh * N * D;
        const scalar_t* kh = k + bh * N * D;
        const scalar_t* vh = v + bh * N * Dv;
        const scalar_t* gh = dout + bh * N * Dv;
        acc_t* dqh = dq + bh * N * D;
        acc_t* dkh = dk + bh * N * D;
        acc_t* dvh = dv + bh * N * Dv;
        for (int64_t i = 0; i < N; ++i) st.l2[i] = lse[bh * N + i] * static_cast<acc_t>(kLog2e);
        if (delta) {
          std::copy(delta + bh * N, delta + (bh + 1) * N, st.di.begin());
        } else {
          // delta_i = rowsum(dO_i * O_i), as attnkit.ops.sparse._delta computes it for a call
          // without an lse gradient, here per head instead of as a [B, H, N, Dv] product
          // tensor (a fresh 32 MiB at N = 16384, H = 8: its page faults alone cost ~12 ms).
          const scalar_t* oh = out + bh * N * Dv;
          for (int64_t i = 0; i < N; ++i) {
            acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < Dv; ++d)
              sum += static_cast<acc_t>(gh[i * Dv + d]) * static_cast<acc_t>(oh[i * Dv + d]);
            st.di[i] = sum;
          }
        }
        // ---- the columns, per residue, into the residue-major copy (every row of it written:
        // 0 where a residue has no column); the outputs are untouched until the band ----
        avec<acc_t> l2r(static_cast<size_t>(T)), dir(static_cast<size_t>(T));
        for (int64_t r = 0; r < sN; ++r) {
          const int64_t tr = Tr(r);
          acc_t* dqr = st.dqr.data() + r * ldq;
          acc_t* dkr = st.dkr.data() + r * ldq;
          acc_t* dvr = st.dvr.data() + r * ldv;
          std::fill(dqr, dqr + tr * D, acc_t(0));
          std::fill(dkr, dkr + tr * D, acc_t(0));
          std::fill(dvr, dvr + tr * Dv, acc_t(0));
          if (tr <= 2) continue;  // no row of this residue has a column
          if (r + 1 < sN) {  // the next residue's rows (a page apart each: see prefetch_rows)
            const int64_t tn = Tr(r + 1);
            prefetch_rows(kh + (r + 1) * D, s * D, tn, D);
            prefetch_rows(vh + (r + 1) * Dv, s * Dv, tn, Dv);
            prefetch_rows(qh + (r + 1) * D, s * D, tn, D);
            prefetch_rows(gh + (r + 1) * Dv, s * Dv, tn, Dv);
          }
          // K rows gathered once (s * D apart), K^T packed from the gathered copy.
          copy_rows(kh + r * D, s * D, tr, D, st.kr.data(), D);
          pack_kt(st.kr.data(), D, tr, D, st.ktr.data(), ldt);
          pack_kt(vh + r * Dv, s * Dv, tr, Dv, st.vtr.data(), ldt);
          copy_rows(qh + r * D, s * D, tr, D, st.qr.data(), D);
          copy_rows(gh + r * Dv, s * Dv, tr, Dv, st.gr.data(), Dv);
          for (int64_t t = 0; t < tr; ++t) {
            l2r[t] = st.l2[t * s + r];
            dir[t] = st.di[t * s + r];
          }
          for (int64_t t0 = 0; t0 < tr; t0 += kStripBwdA) {
            const int64_t hn = std::min(kStripBwdA, tr - t0);
            column_chunks(t0, hn, tr, causal, st.vlo.data(), st.vhi.data(), [&](int64_t k0, int64_t w) {
              bwd_tile<acc_t>(st.mm, hn, w, D, Dv, st.qr.data() + t0 * D, D, st.gr.data() + t0 * Dv, Dv,
                              l2r.data() + t0, dir.data() + t0, st.ktr.data() + k0, ldt,
                              st.kr.data() + k0 * D, D, st.vtr.data() + k0, ldt, st.vlo.data(),
                              st.vhi.data(), c, sc, st.s.data(), st.dp.data(), lds,
                              dqr + t0 * D, D, dkr + k0 * D, D, dvr + k0 * Dv, Dv);
            });
          }
        }
        // ---- the band, per super-block of rows: the outputs' rows are first written here, in
        // order, from the columns' gradients, and the band's tiles add to them ----
        auto init_rows = [&](acc_t* dst, const acc_t* col, int64_t ld, int64_t w, int64_t a, int64_t b) {
          for (int64_t i = a; i < b; ++i) {
            const acc_t* src = col + (i % s) * ld + (i / s) * w;
#pragma omp simd
            for (int64_t d = 0; d < w; ++d) dst[i * w + d] = src[d];
          }
        };
        int64_t kv_init = 0;  // dK / dV rows [0, kv_init) are written
        for (int64_t i0 = 0; i0 < N; i0 += SBR) {
          const int64_t i1 = std::min(N, i0 + SBR);
          const int64_t ka = std::max<int64_t>(0, i0 - s);
          const int64_t kb = std::min(N, i1 + (causal ? 0 : s));
          const int64_t kn = kb - ka;
          init_rows(dqh, st.dqr.data(), ldq, D, i0, i1);
          init_rows(dkh, st.dkr.data(), ldq, D, kv_init, kb);
          init_rows(dvh, st.dvr.data(), ldv, Dv, kv_init, kb);
          kv_init = kb;
          pack_kt(kh + ka * D, D, kn, D, st.kt.data(), ldb);
          pack_kt(vh + ka * Dv, Dv, kn, Dv, st.vt.data(), ldb);
          const acc_t *Q, *G, *K;
          if constexpr (kInPlace) {
            Q = qh + i0 * D;
            G = gh + i0 * Dv;
            K = kh + ka * D;
          } else {
            copy_rows(qh + i0 * D, D, i1 - i0, D, st.qb.data(), D);
            copy_rows(gh + i0 * Dv, Dv, i1 - i0, Dv, st.gb.data(), Dv);
            copy_rows(kh + ka * D, D, kn, D, st.kb.data(), D);
            Q = st.qb.data();
            G = st.gb.data();
            K = st.kb.data();
          }
          for (int64_t r0 = i0; r0 < i1; r0 += SH) {
            const int64_t hn = std::min(SH, i1 - r0);
            const int64_t wa = std::max<int64_t>(0, r0 - s);
            const int64_t wb = std::min(N, r0 + hn + (causal ? 0 : s));
            for (int64_t x = 0; x < hn; ++x) {
              const int64_t i = r0 + x;
              st.vlo[x] = std::max<int64_t>(0, i - s) - wa;
              st.vhi[x] = std::min(N, i + 1 + (causal ? 0 : s)) - wa;
            }
            bwd_tile<acc_t>(st.mm, hn, wb - wa, D, Dv, Q + (r0 - i0) * D, D, G + (r0 - i0) * Dv, Dv,
                            st.l2.data() + r0, st.di.data() + r0, st.kt.data() + (wa - ka), ldb,
                            K + (wa - ka) * D, D, st.vt.data() + (wa - ka), ldb, st.vlo.data(),
                            st.vhi.data(), c, sc, st.s.data(), st.dp.data(), lds, dqh + r0 * D, D,
                            dkh + wa * D, D, dvh + wa * Dv, Dv);
          }
        }
      });
}
// ---------------------------------------------------------------------------------------------
// Range part: backward.
// ---------------------------------------------------------------------------------------------
template <typename acc_t>
struct RangeBwdScratch {
  TileGemm<acc_t> mm;            // the tile GEMMs on the call's path (gemm_path.h)
  avec<acc_t> kt, vt;            // [D][lds], [Dv][lds] K^T, V^T of the key tile
  avec<acc_t> kr;                // [kRangeKb][D] K rows gathered / converted
  avec<acc_t> qr, dor;           // [Tq][D], [Tq][Dv] Q, dO rows gathered / converted
  avec<acc_t> dq;                // [Tq][D] dQ of a strided group (scattered at its end)
  avec<acc_t> l2, di;            // [Tq] lse in base 2, delta of the group's rows
  avec<acc_t> s, dp;             // [kRangeQb][lds]
  avec<acc_t> dk, dv;            // [kRangeKb][D], [kRangeKb][Dv]
  std::vector<int64_t> vlo, vhi;
};

// `store`: every key row belongs to exactly one group (no shared keys, all covered), so dK/dV
// rows are written, not added, and the outputs need no zero fill first.  dQ rows of the
// groups are always written (zeroed here as the key tiles first reach them).
template <typename scalar_t, typename acc_t>
void range_bwd_kernel(GemmPath path, const RangeGeom& geo, bool keys_shared, bool store, int64_t BH, int64_t D,
                      int64_t Dv, double scale, const scalar_t* dout, const scalar_t* q,
                      const scalar_t* k, const scalar_t* v, const acc_t* lse, const acc_t* delta,
                      acc_t* dq_acc, int64_t chunks, acc_t* dk_acc, acc_t* dv_acc) {
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  const int64_t Nq = geo.Nq, Nk = geo.Nk;
  // Groups that have query rows (the others touch nothing).
  std::vector<int64_t> groups;
  int64_t tq_max = 0;
  for (int64_t gi = 0; gi < geo.G; ++gi) {
    const int64_t tq = geo.Tq(gi), tk = geo.Tk(gi);
    if (tq == 0) break;
    if (tk == 0) continue;  // its rows keep zero gradients
    groups.push_back(gi);
    tq_max = std::max(tq_max, tq);
  }
  const int64_t ng = static_cast<int64_t>(groups.size());
  if (ng == 0) return;
  // A unit is (b, h, group), or (b, h) with all groups when groups share key rows.
  const int64_t per_bh = keys_shared ? 1 : ng;
  const int64_t lds = kRangeKb + kPad;
  const acc_t c = static_cast<acc_t>(scale * kLog2e);
  const acc_t sc = static_cast<acc_t>(scale);
  const int64_t qstep = geo.q_pt, kstep = geo.k_pt;
  // Rows of a strided view (rows q_pt * D apart: 16 KiB for strided(64)) are gathered into
  // contiguous buffers, as in the forward: GEMM operands whose rows share a few L1 sets, and
  // a dQ accumulated in place there, cost more than the copies (measured below).
  const bool q_direct = kInPlace && qstep == 1;
  const bool k_direct = kInPlace && kstep == 1;

  run_tasks(
      BH * per_bh * chunks,
      [&] {
        RangeBwdScratch<acc_t> st;
        st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
        st.kt.resize(static_cast<size_t>(D * lds));
        st.vt.resize(static_cast<size_t>(Dv * lds));
        if (!k_direct) st.kr.resize(static_cast<size_t>(kRangeKb * D));
        if (!q_direct) {
          st.qr.resize(static_cast<size_t>(tq_max * D));
          st.dor.resize(static_cast<size_t>(tq_max * Dv));
          st.dq.resize(static_cast<size_t>(tq_max * D));
        }
        st.l2.resize(tq_max);
        st.di.resize(tq_max);
        st.s.resize(static_cast<size_t>(kRangeQb * lds));
        st.dp.resize(static_cast<size_t>(kRangeQb * lds));
        st.dk.resize(static_cast<size_t>(kRangeKb * D));
        st.dv.resize(static_cast<size_t>(kRangeKb * Dv));
        st.vlo.resize(kRangeQb);
        st.vhi.resize(kRangeQb);
        return st;
      },
      [&](RangeBwdScratch<acc_t>& st, int64_t task) {
        const int64_t chunk = task % chunks;
        const int64_t unit = task / chunks;
        const int64_t bh = unit / per_bh;
        const int64_t g_begin = keys_shared ? 0 : unit % per_bh;
        const int64_t g_end = keys_shared ? ng : g_begin + 1;
        acc_t* dq_c = dq_acc + chunk * BH * Nq * D;
        for (int64_t gx = g_begin; gx < g_end; ++gx) {
          const int64_t gi = groups[gx];
          const int64_t tq = geo.Tq(gi), tk = geo.Tk(gi);
          const int64_t qbase = bh * Nq + gi * geo.q_pg;  // row of query t = 0
          const int64_t kbase = bh * Nk + gi * geo.k_pg;  // row of key t' = 0
          const int64_t nkt = ceil_div(tk, kRangeKb);
          // dQ of the group: in place (contiguous rows) or a local buffer; rows [0, zq) are
          // zeroed.  The first query row a key tile reaches never decreases from one tile to
          // the next, so zeroing up to the end of each step is exact (each row once).
          acc_t* dQ = q_direct ? dq_c + qbase * D : st.dq.data();
          int64_t zq = 0;
          auto zero_dq_to = [&](int64_t t1) {
            if (t1 > zq) std::fill(dQ + zq * D, dQ + t1 * D, acc_t(0));
            zq = std::max(zq, t1);
          };
          if (chunk < nkt) {
            const acc_t *Q, *dO;
            if (q_direct) {
              Q = reinterpret_cast<const acc_t*>(q) + qbase * D;
              dO = reinterpret_cast<const acc_t*>(dout) + qbase * Dv;
            } else {
              copy_rows(q + qbase * D, qstep * D, tq, D, st.qr.data(), D);
              copy_rows(dout + qbase * Dv, qstep * Dv, tq, Dv, st.dor.data(), Dv);
              Q = st.qr.data();
              dO = st.dor.data();
            }
            for (int64_t t = 0; t < tq; ++t) {
              const int64_t row = qbase + t * qstep;
              st.l2[t] = lse[row] * static_cast<acc_t>(kLog2e);
              st.di[t] = delta[row];
            }
            for (int64_t kt_i = chunk; kt_i < nkt; kt_i += chunks) {
              const int64_t k0 = kt_i * kRangeKb, kn = std::min(kRangeKb, tk - k0);
              const int64_t krow = kbase + k0 * kstep;
              // Queries attending a key of [k0, k0 + kn): hi(t) >= k0 and lo(t) < k0 + kn.
              const int64_t ta = first_at_least(geo.hi, tq, k0);
              const int64_t tb = first_at_least(geo.lo, tq, k0 + kn);
              std::fill(st.dk.begin(), st.dk.begin() + kn * D, acc_t(0));
              std::fill(st.dv.begin(), st.dv.begin() + kn * Dv, acc_t(0));
              if (ta < tb) {
                // K rows (gathered from a strided view), K^T and V^T of this key tile only:
                // small, cache-resident.
                const acc_t* K;
                if (k_direct) {
                  K = reinterpret_cast<const acc_t*>(k) + krow * D;
                } else {
                  copy_rows(k + krow * D, kstep * D, kn, D, st.kr.data(), D);
                  K = st.kr.data();
                }
                pack_kt(K, D, kn, D, st.kt.data(), lds);
                pack_kt(v + krow * Dv, kstep * Dv, kn, Dv, st.vt.data(), lds);
                for (int64_t t0 = ta; t0 < tb; t0 += kRangeQb) {
                  const int64_t qn = std::min(kRangeQb, tb - t0);
                  for (int64_t r = 0; r < qn; ++r) {
                    int64_t l, h;
                    geo.range(t0 + r, tk, l, h);
                    st.vlo[r] = l - k0;
                    st.vhi[r] = l <= h ? h + 1 - k0 : l - k0;
                  }
                  zero_dq_to(t0 + qn);
                  bwd_tile<acc_t>(st.mm, qn, kn, D, Dv, Q + t0 * D, D, dO + t0 * Dv, Dv,
                                  st.l2.data() + t0, st.di.data() + t0, st.kt.data(), lds, K, D,
                                  st.vt.data(), lds, st.vlo.data(), st.vhi.data(), c, sc,
                                  st.s.data(), st.dp.data(), lds, dQ + t0 * D, D, st.dk.data(),
                                  D, st.dv.data(), Dv);
                }
              }
              // Stored when every key row is this tile's alone; else added (with shared
              // keys another group of this task wrote them too).
              for (int64_t j = 0; j < kn; ++j) {
                const int64_t row = kbase + (k0 + j) * kstep;
                acc_t* dkr = dk_acc + row * D;
                acc_t* dvr = dv_acc + row * Dv;
                const acc_t* a = st.dk.data() + j * D;
                const acc_t* b = st.dv.data() + j * Dv;
                if (store) {
                  std::memcpy(dkr, a, static_cast<size_t>(D) * sizeof(acc_t));
                  std::memcpy(dvr, b, static_cast<size_t>(Dv) * sizeof(acc_t));
                } else {
                  for (int64_t d = 0; d < D; ++d) dkr[d] += a[d];
                  for (int64_t d = 0; d < Dv; ++d) dvr[d] += b[d];
                }
              }
            }
          }
          zero_dq_to(tq);  // rows no key tile (of this chunk) reached
          if (!q_direct)
            for (int64_t t = 0; t < tq; ++t)
              std::memcpy(dq_c + (qbase + t * qstep) * D, dQ + t * D,
                          static_cast<size_t>(D) * sizeof(acc_t));
        }
      });
}

// Chunks of key tiles per unit: 1 unless there are too few units to keep the threads busy.
int64_t pick_chunks(int64_t units, int64_t max_tiles) {
  const int64_t threads = at::get_num_threads();
  if (units >= 4 * threads || units % threads == 0) return 1;
  return std::max<int64_t>(1, std::min(max_tiles, threads));
}

// ---------------------------------------------------------------------------------------------
// Block-sparse lists.
// ---------------------------------------------------------------------------------------------
struct BlockLists {
  const int32_t* ptr = nullptr;  // [Hl][nb + 1]
  const int32_t* idx = nullptr;
  int64_t Hl = 1, nb = 0;
  // The entries of row r of layout head hl: idx[begin(h, r) : end(h, r)].
  int64_t begin(int64_t h, int64_t r) const { return ptr[(Hl == 1 ? 0 : h) * (nb + 1) + r]; }
  int64_t end(int64_t h, int64_t r) const { return ptr[(Hl == 1 ? 0 : h) * (nb + 1) + r + 1]; }
};

// The lists (ptr [Hl, nb + 1], idx [nnz], contiguous) checked by checks::block_sparse_*.
BlockLists make_lists(const at::Tensor& ptr, const at::Tensor& idx, int64_t nb) {
  BlockLists L;
  L.ptr = ptr.const_data_ptr<int32_t>();
  L.idx = idx.const_data_ptr<int32_t>();
  L.Hl = ptr.size(0);
  L.nb = nb;
  return L;
}

// A run of rows [start, start + len) of one block, gathered into a chunk.
struct Seg {
  int64_t start, len;
};

// Splits the blocks idx[a:e) (rows [c * block, (c + 1) * block), each cut to rows < limit) into
// chunks of at most cap rows; calls fn(segments, total rows) per chunk.
template <typename Fn>
void for_each_chunk(const int32_t* idx, int64_t a, int64_t e, int64_t block, int64_t limit,
                    int64_t cap, std::vector<Seg>& segs, Fn fn) {
  segs.clear();
  int64_t n = 0;
  for (int64_t x = a; x < e; ++x) {
    int64_t s = static_cast<int64_t>(idx[x]) * block;
    const int64_t stop = std::min(s + block, limit);
    while (s < stop) {
      const int64_t len = std::min(stop - s, cap - n);
      segs.push_back({s, len});
      n += len;
      s += len;
      if (n == cap) {
        fn(segs, n);
        segs.clear();
        n = 0;
      }
    }
  }
  if (n > 0) fn(segs, n);
}

// Rows per chunk of listed blocks: as many whole blocks as fit in `target` rows, or `target`
// (a part of one block) when a block is larger.
inline int64_t chunk_cap(int64_t block, int64_t target) {
  return std::max(block >= target ? target : target / block * block, int64_t(1));
}

// A block-sparse task index, decoded: sub-tile `sub` of block `blk` of head row bh (= b * H + h).
struct BlockTask {
  int64_t sub, blk, bh, h;
  BlockTask(int64_t task, int64_t subs, int64_t nb, int64_t H)
      : sub(task % subs), blk((task / subs) % nb), bh(task / (subs * nb)), h(bh % H) {}
};

// Causal visibility in a chunk of sorted key segments: the number of chunk keys j <= i.
inline int64_t keys_up_to(const std::vector<Seg>& segs, int64_t i) {
  int64_t n = 0;
  for (const Seg& s : segs) {
    if (s.start > i) break;
    n += std::min(s.len, i - s.start + 1);
  }
  return n;
}

template <typename acc_t>
struct BlockScratch {
  TileGemm<acc_t> mm;            // the tile GEMMs on the call's path (gemm_path.h)
  avec<acc_t> kt, vt;          // [D][ld], [Dv][ld] transposed chunk of K, V
  avec<acc_t> kr, vr;          // [cap][D], [cap][Dv] K, V rows of a chunk
  avec<acc_t> qr, dor;         // Q, dO rows
  avec<acc_t> l2, di;
  avec<acc_t> s, dp, o, m, l;
  avec<acc_t> dk, dv;
  std::vector<int64_t> vlo, vhi;
  std::vector<Seg> segs;

  // Sizes what both backward passes use: `rows` query rows (Q, dO, lse, delta, visible ranges
  // from 0) against transposed key tiles of leading dimension ld.
  void size_bwd(int64_t rows, int64_t ld, int64_t D, int64_t Dv) {
    kt.resize(static_cast<size_t>(D * ld));
    vt.resize(static_cast<size_t>(Dv * ld));
    qr.resize(static_cast<size_t>(rows * D));
    dor.resize(static_cast<size_t>(rows * Dv));
    l2.resize(rows);
    di.resize(rows);
    s.resize(static_cast<size_t>(rows * ld));
    dp.resize(static_cast<size_t>(rows * ld));
    vlo.assign(rows, 0);
    vhi.resize(rows);
  }
};

// Pointer to `n` rows (width w) of a chunk: in place when the chunk is one run and needs no
// conversion, else gathered (converted) into buf.
template <typename scalar_t, typename acc_t>
const acc_t* chunk_rows(const scalar_t* base, int64_t w, const std::vector<Seg>& segs,
                        avec<acc_t>& buf, int64_t& ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    if (segs.size() == 1) {
      ld = w;
      return base + segs[0].start * w;
    }
  }
  int64_t off = 0;
  for (const Seg& s : segs) {
    copy_rows(base + s.start * w, w, s.len, w, buf.data() + off * w, w);
    off += s.len;
  }
  ld = w;
  return buf.data();
}

template <typename scalar_t, typename acc_t>
void pack_chunk_transposed(const scalar_t* base, int64_t w, const std::vector<Seg>& segs,
                           acc_t* dst, int64_t ld) {
  int64_t off = 0;
  for (const Seg& s : segs) {
    pack_kt(base + s.start * w, w, s.len, w, dst + off, ld);
    off += s.len;
  }
}

template <typename scalar_t, typename acc_t>
void block_fwd_kernel(GemmPath path, const BlockLists& L, int64_t BH, int64_t H, int64_t N, int64_t D,
                      int64_t Dv, int64_t block, bool causal, double scale, const scalar_t* q,
                      const scalar_t* k, const scalar_t* v, scalar_t* out, acc_t* lse) {
  constexpr bool kInPlace = std::is_same_v<scalar_t, acc_t>;
  const int64_t nb = L.nb;
  const int64_t TQ = std::min(block, kBlockQ);
  const int64_t subs = ceil_div(block, TQ);
  const int64_t cap = chunk_cap(block, kChunkK);
  const int64_t ld = cap + kPad;
  const acc_t c = static_cast<acc_t>(scale * kLog2e);
  run_tasks(
      BH * nb * subs,
      [&] {
        BlockScratch<acc_t> st;
        st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
        st.kt.resize(static_cast<size_t>(D * ld));
        st.vr.resize(static_cast<size_t>(cap * Dv));
        if (!kInPlace) st.qr.resize(static_cast<size_t>(TQ * D));
        st.s.resize(static_cast<size_t>(TQ * ld));
        st.o.resize(static_cast<size_t>(TQ * Dv));
        for (auto* x : {&st.m, &st.l}) x->resize(TQ);
        st.vlo.assign(TQ, 0);
        st.vhi.resize(TQ);
        return st;
      },
      [&](BlockScratch<acc_t>& st, int64_t task) {
        const BlockTask bt(task, subs, nb, H);
        const int64_t sub = bt.sub, r = bt.blk, bh = bt.bh, h = bt.h;
        const int64_t i0 = r * block + sub * TQ, qn = std::min(TQ, (r + 1) * block - i0);
        const int64_t qrow0 = bh * N + i0;
        std::fill(st.o.begin(), st.o.begin() + qn * Dv, acc_t(0));
        std::fill(st.m.begin(), st.m.begin() + qn, neg_inf<acc_t>());
        std::fill(st.l.begin(), st.l.begin() + qn, acc_t(0));
        const acc_t* Q;
        if constexpr (kInPlace) {
          Q = q + qrow0 * D;
        } else {
          copy_rows(q + qrow0 * D, D, qn, D, st.qr.data(), D);
          Q = st.qr.data();
        }
        const scalar_t* kb = k + bh * N * D;
        const scalar_t* vb = v + bh * N * Dv;
        // Causal: no row of this tile sees keys >= i0 + qn.
        const int64_t limit = causal ? i0 + qn : N;
        for_each_chunk(L.idx, L.begin(h, r), L.end(h, r), block, limit, cap, st.segs,
                       [&](const std::vector<Seg>& segs, int64_t kn) {
                         pack_chunk_transposed(kb, D, segs, st.kt.data(), ld);
                         int64_t ldv;
                         const acc_t* V = chunk_rows(vb, Dv, segs, st.vr, ldv);
                         for (int64_t x = 0; x < qn; ++x)
                           st.vhi[x] = causal ? keys_up_to(segs, i0 + x) : kn;
                         fwd_tile<acc_t>(st.mm, qn, kn, D, Dv, Q, D, st.kt.data(), ld, V, ldv,
                                         st.vlo.data(), st.vhi.data(), c, st.s.data(), ld,
                                         st.m.data(), st.l.data(), st.o.data(), Dv);
                       });
        for (int64_t x = 0; x < qn; ++x)
          finish_row<scalar_t, acc_t>(st.o.data() + x * Dv, st.m[x], st.l[x], Dv,
                                      out + (qrow0 + x) * Dv, lse + qrow0 + x);
      });
}

template <typename scalar_t, typename acc_t>
void block_bwd_kernel(GemmPath path, const BlockLists& R, const BlockLists& C, int64_t BH, int64_t H, int64_t N,
                      int64_t D, int64_t Dv, int64_t block, bool causal, double scale,
                      const scalar_t* dout, const scalar_t* q, const scalar_t* k,
                      const scalar_t* v, const acc_t* lse, const acc_t* delta, acc_t* dq_acc,
                      acc_t* dk_acc, acc_t* dv_acc) {
  const int64_t nb = R.nb;
  const acc_t c = static_cast<acc_t>(scale * kLog2e);
  const acc_t sc = static_cast<acc_t>(scale);

  // dQ pass: per (b, h, query block, sub-tile), over the row lists.
  {
    const int64_t TQ = std::min(block, kBlockQ);
    const int64_t subs = ceil_div(block, TQ);
    // Keys per chunk: the scratch holds [TQ][cap] scores twice; 128 keys keep it in L1/L2.
    const int64_t cap = chunk_cap(block, 128);
    const int64_t ld = cap + kPad;
    run_tasks(
        BH * nb * subs,
        [&] {
          BlockScratch<acc_t> st;
          st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
          st.size_bwd(TQ, ld, D, Dv);
          st.kr.resize(static_cast<size_t>(cap * D));
          return st;
        },
        [&](BlockScratch<acc_t>& st, int64_t task) {
          const BlockTask bt(task, subs, nb, H);
          const int64_t sub = bt.sub, r = bt.blk, bh = bt.bh, h = bt.h;
          const int64_t i0 = r * block + sub * TQ, qn = std::min(TQ, (r + 1) * block - i0);
          const int64_t qrow0 = bh * N + i0;
          int64_t ldq, lddo;
          const std::vector<Seg> qseg{{i0, qn}};
          const acc_t* Q = chunk_rows(q + bh * N * D, D, qseg, st.qr, ldq);
          const acc_t* dO = chunk_rows(dout + bh * N * Dv, Dv, qseg, st.dor, lddo);
          for (int64_t x = 0; x < qn; ++x) {
            st.l2[x] = lse[qrow0 + x] * static_cast<acc_t>(kLog2e);
            st.di[x] = delta[qrow0 + x];
          }
          const scalar_t* kb = k + bh * N * D;
          const scalar_t* vb = v + bh * N * Dv;
          const int64_t limit = causal ? i0 + qn : N;
          for_each_chunk(R.idx, R.begin(h, r), R.end(h, r), block, limit, cap, st.segs,
                         [&](const std::vector<Seg>& segs, int64_t kn) {
                           pack_chunk_transposed(kb, D, segs, st.kt.data(), ld);
                           pack_chunk_transposed(vb, Dv, segs, st.vt.data(), ld);
                           int64_t ldk;
                           const acc_t* K = chunk_rows(kb, D, segs, st.kr, ldk);
                           for (int64_t x = 0; x < qn; ++x)
                             st.vhi[x] = causal ? keys_up_to(segs, i0 + x) : kn;
                           bwd_tile<acc_t>(st.mm, qn, kn, D, Dv, Q, ldq, dO, lddo, st.l2.data(),
                                           st.di.data(), st.kt.data(), ld, K, ldk,
                                           st.vt.data(), ld, st.vlo.data(), st.vhi.data(), c, sc,
                                           st.s.data(), st.dp.data(), ld, dq_acc + qrow0 * D, D,
                                           nullptr, 0, nullptr, 0);
                         });
        });
  }

  // dK/dV pass: per (b, h, key block, sub-tile), over the column lists.
  {
    const int64_t TK = std::min(block, kBlockKb);
    const int64_t subs = ceil_div(block, TK);
    const int64_t cap = chunk_cap(block, kBlockQb);
    const int64_t ld = TK + kPad;
    run_tasks(
        BH * nb * subs,
        [&] {
          BlockScratch<acc_t> st;
          st.mm = TileGemm<acc_t>::template on<scalar_t>(path);
          st.size_bwd(cap, ld, D, Dv);
          st.dk.resize(static_cast<size_t>(TK * D));
          st.dv.resize(static_cast<size_t>(TK * Dv));
          return st;
        },
        [&](BlockScratch<acc_t>& st, int64_t task) {
          const BlockTask bt(task, subs, nb, H);
          const int64_t sub = bt.sub, cb = bt.blk, bh = bt.bh, h = bt.h;
          const int64_t j0 = cb * block + sub * TK, kn = std::min(TK, (cb + 1) * block - j0);
          const int64_t krow0 = bh * N + j0;
          pack_kt(k + krow0 * D, D, kn, D, st.kt.data(), ld);
          pack_kt(v + krow0 * Dv, Dv, kn, Dv, st.vt.data(), ld);
          std::fill(st.dk.begin(), st.dk.end(), acc_t(0));
          std::fill(st.dv.begin(), st.dv.end(), acc_t(0));
          const scalar_t* qb = q + bh * N * D;
          const scalar_t* gb = dout + bh * N * Dv;
          // Query blocks listed for this key block; causal: rows < j0 see none of its keys.
          int64_t a = C.begin(h, cb);
          const int64_t e = C.end(h, cb);
          if (causal)
            while (a < e && (static_cast<int64_t>(C.idx[a]) + 1) * block <= j0) ++a;
          for_each_chunk(C.idx, a, e, block, N, cap, st.segs,
                         [&](const std::vector<Seg>& segs, int64_t qn) {
                           int64_t ldq, lddo;
                           const acc_t* Q = chunk_rows(qb, D, segs, st.qr, ldq);
                           const acc_t* dO = chunk_rows(gb, Dv, segs, st.dor, lddo);
                           int64_t x = 0;
                           for (const Seg& s : segs)
                             for (int64_t i = s.start; i < s.start + s.len; ++i, ++x) {
                               st.l2[x] = lse[bh * N + i] * static_cast<acc_t>(kLog2e);
                               st.di[x] = delta[bh * N + i];
                               st.vhi[x] = causal ? std::clamp<int64_t>(i - j0 + 1, 0, kn) : kn;
                             }
                           bwd_tile<acc_t>(st.mm, qn, kn, D, Dv, Q, ldq, dO, lddo, st.l2.data(),
                                           st.di.data(), st.kt.data(), ld, nullptr, 0,
                                           st.vt.data(), ld, st.vlo.data(), st.vhi.data(), c, sc,
                                           st.s.data(), st.dp.data(), ld, nullptr, 0,
                                           st.dk.data(), D, st.dv.data(), Dv);
                         });
          for (int64_t j = 0; j < kn; ++j) {
            std::memcpy(dk_acc + (krow0 + j) * D, st.dk.data() + j * D, D * sizeof(acc_t));
            std::memcpy(dv_acc + (krow0 + j) * Dv, st.dv.data() + j * Dv, Dv * sizeof(acc_t));
          }
        });
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points.
// ---------------------------------------------------------------------------------------------
// float32_out: a 16-bit call's out in float32, the accumulation dtype (the pattern's merge of its
// parts then rounds once: rounded here and again after the merge, a bfloat16 fixed(4, 1) row came
// out 1.7e-2 off against DESIGN.md's 1.5e-2 -- session 31).  Ignored for float32 / float64.
std::tuple<at::Tensor, at::Tensor> sparse_range_fwd_cpu(const at::Tensor& q_, const at::Tensor& k_,
                                                        const at::Tensor& v_, at::IntArrayRef view,
                                                        at::IntArrayRef lo, at::IntArrayRef hi,
                                                        double scale, bool float32_out) {
  checks::sparse_range_fwd(checks::cpu_target(), q_, k_, v_, view, lo, hi, scale);
  // The tile GEMMs' path (gemm_path.h), read on every call, so that a bad ATTNKIT_CPU_GEMM raises here.
  const GemmPath path = cpu_gemm_path(q_.scalar_type(), GemmUse::kSparseRanges);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Nk = k.size(2), Dv = v.size(3);
  bool covered = false, keys_shared = false;
  const RangeGeom geo = make_geom(view, lo, hi, Nq, Nk, covered, keys_shared);
  const auto acc = acc_type_of(q.scalar_type());
  const auto out_options = float32_out ? q.options().dtype(acc) : q.options();
  at::Tensor out, lse;
  if (covered) {
    out = at::empty({B, H, Nq, Dv}, out_options);
    lse = at::empty({B, H, Nq}, q.options().dtype(acc));
  } else {  // rows in no group: 0 / -inf
    out = at::zeros({B, H, Nq, Dv}, out_options);
    lse = at::full({B, H, Nq}, -std::numeric_limits<double>::infinity(), q.options().dtype(acc));
  }
  if (B * H * Nq == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "sparse_range_fwd", [&] {
    using acc_t = acc_of<scalar_t>;
    if (out.scalar_type() == q.scalar_type()) {
      range_fwd_kernel<scalar_t, acc_t, scalar_t>(path, geo, B * H, D, Dv, scale, q.const_data_ptr<scalar_t>(),
                                                  k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                                                  out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<acc_t>());
    } else {
      range_fwd_kernel<scalar_t, acc_t, acc_t>(path, geo, B * H, D, Dv, scale, q.const_data_ptr<scalar_t>(),
                                               k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                                               out.mutable_data_ptr<acc_t>(), lse.mutable_data_ptr<acc_t>());
    }
  });
  return {out, lse};
}

// strided(stride) in one call: (out, lse) of the whole pattern (see strided_fwd_kernel).
std::tuple<at::Tensor, at::Tensor> sparse_strided_fwd_cpu(const at::Tensor& q_, const at::Tensor& k_,
                                                          const at::Tensor& v_, int64_t stride,
                                                          bool causal, double scale) {
  // The checks of its band part (q, k, v as for any range part), then what the pattern adds.
  const std::vector<int64_t> plain{1, 0, 1, 0, 1}, lo{0, 1, 1, 0}, hi{0, 1, 1, 0};
  checks::sparse_range_fwd(checks::cpu_target(), q_, k_, v_, plain, lo, hi, scale);
  ATTNKIT_CHECK(stride >= 1, "attnkit::sparse_strided_fwd (cpu): stride must be >= 1; got ", stride);
  ATTNKIT_CHECK(k_.size(2) == q_.size(2), "attnkit::sparse_strided_fwd (cpu): self-attention: q and k ",
                "must have the same length; got ", q_.sizes(), " and ", k_.sizes());
  // The tile GEMMs' path (gemm_path.h), read on every call, so that a bad ATTNKIT_CPU_GEMM raises here.
  const GemmPath path = cpu_gemm_path(q_.scalar_type(), GemmUse::kSparseRanges);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Dv = v.size(3);
  const auto acc = acc_type_of(q.scalar_type());
  at::Tensor out = empty_huge({B, H, N, Dv}, q.options());
  at::Tensor lse = at::empty({B, H, N}, q.options().dtype(acc));
  if (B * H * N == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "sparse_strided_fwd", [&] {
    using acc_t = acc_of<scalar_t>;
    strided_fwd_kernel<scalar_t, acc_t>(path, B * H, N, D, Dv, stride, causal, scale,
                                        q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                                        v.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                                        lse.mutable_data_ptr<acc_t>());
  });
  return {out, lse};
}

// Gradients of sparse_strided_fwd given its lse and delta (as sparse_range_bwd's); without delta,
// from the forward's out: delta = rowsum(grad_out * out) (a call with no lse gradient).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_strided_bwd_cpu(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& lse_, const c10::optional<at::Tensor>& delta_opt, int64_t stride, bool causal,
    double scale, const c10::optional<at::Tensor>& out_opt) {
  const bool has_delta = checks::sparse_pattern_bwd(checks::cpu_target(), "sparse_strided_bwd", dout_, q_, k_, v_,
                                                    lse_, delta_opt, out_opt, scale);
  ATTNKIT_CHECK(stride >= 1, "attnkit::sparse_strided_bwd (cpu): stride must be >= 1; got ", stride);
  // The tile GEMMs' path (gemm_path.h), read on every call, so that a bad ATTNKIT_CPU_GEMM raises here.
  const GemmPath path = cpu_gemm_path(q_.scalar_type(), GemmUse::kSparseRanges);
  // The kernel writes every output row (each task its head's rows in order, from its columns'
  // gradients, before its band adds to them).
  return run_pattern_bwd(
      dout_.contiguous(), q_.contiguous(), k_.contiguous(), v_.contiguous(),
      lse_.contiguous(), has_delta ? delta_opt->contiguous() : at::Tensor(),
      has_delta ? at::Tensor() : out_opt->contiguous(),
      [&](int64_t BH, int64_t N, int64_t D, int64_t Dv, const auto* dout, const auto* q, const auto* k,
          const auto* v, const auto* lse, const auto* delta, const auto* out, auto* dq, auto* dk, auto* dv) {
        strided_bwd_kernel(path, BH, N, D, Dv, stride, causal, scale, dout, q, k, v, lse, delta, out, dq, dk, dv);
      });
}

// Per-chunk float buffers -> the result in the input dtype (chunks summed in order: deterministic).
at::Tensor reduce_chunks(const at::Tensor& buf, at::ScalarType dtype) {
  at::Tensor sum = buf[0].clone();
  for (int64_t c = 1; c < buf.size(0); ++c) sum.add_(buf[c]);
  return sum.to(dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_range_bwd_cpu(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& lse_, const at::Tensor& delta_, at::IntArrayRef view, at::IntArrayRef lo,
    at::IntArrayRef hi, double scale) {
  checks::sparse_range_bwd(checks::cpu_target(), dout_, q_, k_, v_, lse_, delta_, view, lo, hi, scale);
  // The tile GEMMs' path (gemm_path.h), read on every call, so that a bad ATTNKIT_CPU_GEMM raises here.
  const GemmPath path = cpu_gemm_path(q_.scalar_type(), GemmUse::kSparseRanges);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor dout = dout_.contiguous(), lse = lse_.contiguous(), delta = delta_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Nk = k.size(2), Dv = v.size(3);
  bool covered = false, keys_shared = false;
  const RangeGeom geo = make_geom(view, lo, hi, Nq, Nk, covered, keys_shared);
  const auto dtype = q.scalar_type();
  const auto acc = acc_type_of(dtype);
  const bool direct = acc == dtype;
  // Units of work and chunks of key tiles per unit (see range_bwd_kernel).
  // Rows of the groups the kernel visits (query rows are disjoint across groups; key rows too
  // unless keys_shared): when they are all the rows, the kernel writes every output row and
  // the outputs need no zero fill (a separate pass over 3 outputs: measured 6 ms of the 55 ms
  // CPU of a strided(64) N=4096 H=8 forward + backward on one thread).
  int64_t ng = 0, nkt_max = 0, q_rows = 0, k_rows = 0;
  for (int64_t gi = 0; gi < geo.G; ++gi) {
    const int64_t tq = geo.Tq(gi), tk = geo.Tk(gi);
    if (tq == 0) break;
    if (tk == 0) continue;
    ++ng;
    q_rows += tq;
    k_rows += tk;
    nkt_max = std::max(nkt_max, ceil_div(tk, kRangeKb));
  }
  const bool q_all = q_rows == Nq;
  const bool store = !keys_shared && k_rows == Nk;
  const int64_t chunks = keys_shared ? 1 : pick_chunks(B * H * ng, nkt_max);
  auto make = [&](at::IntArrayRef size, bool written) {
    return written ? at::empty(size, q.options().dtype(acc)) : at::zeros(size, q.options().dtype(acc));
  };
  const bool run = B * H > 0 && ng > 0;
  // One dQ buffer per chunk (the result itself when there is one and no conversion).
  at::Tensor dq_buf = chunks == 1 ? make({B, H, Nq, D}, run && q_all)
                                  : make({chunks, B, H, Nq, D}, run && q_all);
  at::Tensor dk = make({B, H, Nk, D}, run && store);
  at::Tensor dv = make({B, H, Nk, Dv}, run && store);
  if (run) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "sparse_range_bwd", [&] {
      using acc_t = acc_of<scalar_t>;
      range_bwd_kernel<scalar_t, acc_t>(
          path, geo, keys_shared, store, B * H, D, Dv, scale, dout.const_data_ptr<scalar_t>(),
          q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
          lse.const_data_ptr<acc_t>(), delta.const_data_ptr<acc_t>(),
          dq_buf.mutable_data_ptr<acc_t>(), chunks, dk.mutable_data_ptr<acc_t>(),
          dv.mutable_data_ptr<acc_t>());
    });
  }
  at::Tensor dq = chunks == 1 ? dq_buf.to(dtype) : reduce_chunks(dq_buf, dtype);
  if (!direct) {
    dk = dk.to(dtype);
    dv = dv.to(dtype);
  }
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cpu(const at::Tensor& q_, const at::Tensor& k_,
                                                        const at::Tensor& v_,
                                                        const at::Tensor& row_ptr_,
                                                        const at::Tensor& col_idx_, int64_t block,
                                                        bool causal, double scale) {
  checks::block_sparse_fwd(checks::cpu_target(), q_, k_, v_, row_ptr_, col_idx_, block, causal, scale);
  // The tile GEMMs' path (gemm_path.h), read on every call, so that a bad ATTNKIT_CPU_GEMM raises here.
  const GemmPath path = cpu_gemm_path(q_.scalar_type());
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor row_ptr = row_ptr_.contiguous(), col_idx = col_idx_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Dv = v.size(3);
  const BlockLists L = make_lists(row_ptr, col_idx, N / block);
  auto out = at::empty({B, H, N, Dv}, q.options());
  auto lse = at::empty({B, H, N}, q.options().dtype(acc_type_of(q.scalar_type())));
  if (B * H * N == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "block_sparse_fwd", [&] {
    using acc_t = acc_of<scalar_t>;
    block_fwd_kernel<scalar_t, acc_t>(path, L, B * H, H, N, D, Dv, block, causal, scale,
                                      q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                                      v.const_data_ptr<scalar_t>(),
                                      out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<acc_t>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cpu(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& lse_, const at::Tensor& delta_, const at::Tensor& row_ptr_,
    const at::Tensor& col_idx_, const at::Tensor& col_ptr_, const at::Tensor& row_idx_,
    int64_t block, bool causal, double scale) {
  checks::block_sparse_bwd(checks::cpu_target(), dout_, q_, k_, v_, lse_, delta_, row_ptr_, col_idx_, col_ptr_,
                           row_idx_, block, causal, scale);
  // The tile GEMMs' path (gemm_path.h), read on every call, so that a bad ATTNKIT_CPU_GEMM raises here.
  const GemmPath path = cpu_gemm_path(q_.scalar_type());
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor dout = dout_.contiguous(), lse = lse_.contiguous(), delta = delta_.contiguous();
  const at::Tensor row_ptr = row_ptr_.contiguous(), col_idx = col_idx_.contiguous();
  const at::Tensor col_ptr = col_ptr_.contiguous(), row_idx = row_idx_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Dv = v.size(3);
  const BlockLists R = make_lists(row_ptr, col_idx, N / block);
  const BlockLists C = make_lists(col_ptr, row_idx, N / block);
  const auto dtype = q.scalar_type();
  const auto acc = acc_type_of(dtype);
  at::Tensor dq = at::zeros({B, H, N, D}, q.options().dtype(acc));
  at::Tensor dk = at::empty({B, H, N, D}, q.options().dtype(acc));
  at::Tensor dv = at::empty({B, H, N, Dv}, q.options().dtype(acc));
  if (B * H * N > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "block_sparse_bwd", [&] {
      using acc_t = acc_of<scalar_t>;
      block_bwd_kernel<scalar_t, acc_t>(
          path, R, C, B * H, H, N, D, Dv, block, causal, scale, dout.const_data_ptr<scalar_t>(),
          q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
          lse.const_data_ptr<acc_t>(), delta.const_data_ptr<acc_t>(), dq.mutable_data_ptr<acc_t>(),
          dk.mutable_data_ptr<acc_t>(), dv.mutable_data_ptr<acc_t>());
    });
  }
  if (acc != dtype) return {dq.to(dtype), dk.to(dtype), dv.to(dtype)};
  return {dq, dk, dv};
}

}  // namespace

// The fused strided op is CPU-only and has no CUDA / Triton twin: its schema is declared here
// rather than in csrc/ops.cpp (whose ops every backend implements); pytorch_ext/ops/sparse.py
// registers its fake and autograd (the backward runs the range parts' backward kernels).
TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("sparse_strided_fwd(Tensor q, Tensor k, Tensor v, int stride, bool causal, float scale) -> (Tensor, Tensor)");
  m.def("sparse_strided_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor? delta, int stride, bool causal, float scale, Tensor? out=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("sparse_range_fwd", &sparse_range_fwd_cpu);
  m.impl("sparse_strided_fwd", &sparse_strided_fwd_cpu);
  m.impl("sparse_strided_bwd", &sparse_strided_bwd_cpu);
  m.impl("sparse_range_bwd", &sparse_range_bwd_cpu);
  m.impl("block_sparse_fwd", &block_sparse_fwd_cpu);
  m.impl("block_sparse_bwd", &block_sparse_bwd_cpu);
}

}  // namespace attnkit

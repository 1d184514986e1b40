// CPU kernels of softmax attention (FlashAttention-2 style), forward and backward.
//
//   softmax_fwd(q [B,H,N,D], k [B,Hk,M,D], v [B,Hk,M,Dv], mask?, scale, is_causal,
//               window_left, window_right, softcap, alibi_slopes?)
//       -> out [B,H,N,Dv] (q's dtype), lse [B,H,N] (float32; float64 for float64 inputs)
//   softmax_bwd(dout, q, k, v, out, lse, mask?, scale, is_causal, <the same four>) -> (dq, dk, dv)
//
// Score options (issue 28, csrc/ops.cpp): a score s = scale q.k is capped (softcap tanh(s /
// softcap)), gets ALiBi's -slope |i + M - N - j|, then the masks (bool / additive, causal, the
// window's band).  All of it happens in prepare_row, on each row's scores of a tile; a row's
// visible keys [key_lo(i), key_hi(i)) (Problem) bound the tiles walked: the forward skips key
// blocks that no row of a query block sees, the backward query rows that see no key of a key
// block, so a window's cost tracks its band.  Softcap's backward multiplies dS by 1 - tanh^2,
// recomputed with the scores.  Sinks are not here: attnkit/score_options.py applies them to
// (out, lse) around these ops.
//
// Forward.  A task is (b, h, block of kBQ query rows).  It walks the key blocks (kBK keys),
// computes the scores S = Q K^T of the tile with a register-blocked micro-kernel, folds them
// into a running (max, sum) per row (online softmax, in base 2: scores are multiplied by
// scale*log2(e) so that the exponentials are exp2), and accumulates O += P V.  The keys of one
// (b, kv-head) are packed once per thread (transposed to [D][kBK] per block, converted to the
// accumulation type); float32 values are read in place, other dtypes are converted once per
// thread and head.  GQA: query head h reads kv head h / (H/Hk), nothing is repeated.
// Extra memory: per thread O(M (D + Dv)) packed K/V plus O(kBQ kBK) tiles -- never N x M
// (measured at B=1 H=8 N=16384 D=64 causal float32: 17 MiB peak beyond inputs and outputs).
//
// Backward.  D_i = rowsum(dO o O) first; then a task is (b, kv-head, chunk of key blocks): for
// each key block it keeps dK, dV accumulators, and for every query head of the GQA group and
// every query block recomputes P = exp2(S' - lse') from the saved lse, then
//   dV += P^T dO,  dP = dO V^T,  dS = P o (dP - D) * scale,  dK += dS^T Q,  dQ += dS K.
// dK/dV belong to the task; dQ rows of the group's heads belong to it too as long as a kv head
// is not split into chunks -- when it is (fewer (b, kv-head) pairs than threads), each chunk
// adds into its own dQ partial buffer and the partials are summed at the end.  No races.
//
// Threads: torch's intra-op pool (at::parallel_for), tasks handed out dynamically.
// Accumulation: float32 (float64 for float64 inputs).  bfloat16 forward multiplies bf16 Q, K,
// P, V with the CPU's bfloat16 dot product (vdpbf16ps, float32 sums) when the build has
// AVX512-BF16; everything else (float16, the bfloat16 backward) converts to float32 -- unless
// ATTNKIT_CPU_GEMM picks oneDNN's brgemm (gemm_path.h) for float16 / bfloat16: then the forward,
// backward and decoding kernels multiply 16-bit tiles with float32 sums through it.
//
// Why hand-written AVX-512 micro-kernels rather than BLAS calls on the tiles: MKL (what
// at::native::cpublas::gemm calls for float32 -- whose typed overloads the torch 2.13 wheel does
// not even export to extensions) runs its AVX2 code on this AMD CPU: ~75 GF/s sgemm per core.
// Measured at B=1 H=8 N=4096 D=64 float32, 2 threads, against torch SDPA in the same process:
// MKL sgemm_ on the same tiles gave 0.93x (forward) / 1.07x (causal forward+backward), the
// micro-kernels 1.86x / 2.19x; one thread, they reach ~157 GF/s forward, ~145 GF/s backward.
#include "torch_headers.h"

#include <array>
#include <vector>

#include "amx_tiles.h"
#include "flash_tiles.h"
#include "gemm_path.h"
#include "simd_f32.h"
#include "split16.h"
#include "../checks/checks.h"

namespace attnkit {
namespace {

// Tile sizes.  kBQ query rows x kBK keys per step of the forward; kBQb x kBKb in the backward.
// Sweep (B=1 H=2 N=4096 D=64 causal, one thread, float32 and bfloat16): forward 32x256,
// 128x128 and backward 32x128, 128x64 were within the +-15% noise of this shared machine;
// 512-key blocks (64x512 / 64x128) were slower (74 vs 92-103 GF/s forward).
constexpr int64_t kBQ = 64;
constexpr int64_t kBQMax = 128;  // the forward's query rows per task on brgemm (softmax_fwd_kernel)
constexpr int64_t kBK = 256;
constexpr int64_t kBQb = 64;
constexpr int64_t kBKb = 64;
// Where the rows of a query block see different keys (causality, a window), the forward
// multiplies the tiles at the band's edges by groups of this many query rows, each over its own
// keys.
constexpr int64_t kWindowRows = 16;

// ---------------------------------------------------------------------------------------------
// Masks.  Read in place through their strides (a broadcast mask is a stride-0 view).
// ---------------------------------------------------------------------------------------------
enum class MaskKind { kNone, kBool, kFloat, kDouble, kBFloat16, kHalf };

struct MaskView {
  MaskKind kind = MaskKind::kNone;
  const char* data = nullptr;
  int64_t esize = 0;
  int64_t sb = 0, sh = 0, sn = 0, sm = 0;  // element strides
  const char* row(int64_t b, int64_t h, int64_t i) const {
    return data + (b * sb + h * sh + i * sn) * esize;
  }
};

template <typename T, typename M>
inline void add_mask(T* s, int64_t n, const M* m, int64_t sm) {
  const T c = static_cast<T>(kLog2e);
  if (sm == 1) {
    for (int64_t j = 0; j < n; ++j) s[j] += c * static_cast<T>(m[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) s[j] += c * static_cast<T>(m[j * sm]);
  }
}

// Applies the mask for keys [j0, j0 + n) of query row (b, h, i) to base-2 scores s.
template <typename T>
inline void apply_mask(T* s, int64_t n, const MaskView& mv, int64_t b, int64_t h, int64_t i,
                       int64_t j0) {
  if (mv.kind == MaskKind::kNone) return;
  const char* row = mv.row(b, h, i) + j0 * mv.sm * mv.esize;
  switch (mv.kind) {
    case MaskKind::kBool: {
      const bool* m = reinterpret_cast<const bool*>(row);
      const T ninf = neg_inf<T>();
      if (mv.sm == 1) {
        // Branch-free: the select on each byte compiled to a branch, mispredicted on a random
        // mask (B=2 H=8 N=M=1024 D=64 float32, 70% True, 2 threads: forward 31.8 ms against
        // 13.1 ms with a float mask of the same shape, 0.87x SDPA).
        const uint8_t* mb = reinterpret_cast<const uint8_t*>(m);
        int64_t j = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        if constexpr (std::is_same_v<T, float>) {
          const __m512 ninf_v = _mm512_set1_ps(ninf);
          for (; j + 16 <= n; j += 16) {
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mb + j));
            const __mmask16 keep = _mm_test_epi8_mask(bytes, bytes);
            _mm512_storeu_ps(s + j, _mm512_mask_blend_ps(keep, ninf_v, _mm512_loadu_ps(s + j)));
          }
        }
#endif
#pragma omp simd
        for (int64_t x = j; x < n; ++x) s[x] = mb[x] != 0 ? s[x] : ninf;
      } else {
        for (int64_t j = 0; j < n; ++j) s[j] = m[j * mv.sm] ? s[j] : ninf;
      }
      break;
    }
    case MaskKind::kFloat: add_mask(s, n, reinterpret_cast<const float*>(row), mv.sm); break;
    case MaskKind::kDouble: add_mask(s, n, reinterpret_cast<const double*>(row), mv.sm); break;
    case MaskKind::kBFloat16:
      add_mask(s, n, reinterpret_cast<const at::BFloat16*>(row), mv.sm);
      break;
    case MaskKind::kHalf: add_mask(s, n, reinterpret_cast<const at::Half*>(row), mv.sm); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// Problem description shared by forward and backward.
// ---------------------------------------------------------------------------------------------
struct Strides4 {
  int64_t b, h, n, d;
  explicit Strides4(const at::Tensor& t) : b(t.stride(0)), h(t.stride(1)), n(t.stride(2)), d(t.stride(3)) {}
  int64_t at(int64_t bi, int64_t hi, int64_t ni) const { return bi * b + hi * h + ni * n; }
};

struct Problem {
  int64_t B, H, Hk, N, M, D, Dv;
  double scale;
  bool causal;
  MaskView mask;
  // Score options (issue 28).  window: key j visible to query i iff i + M - N - wl <= j <=
  // i + M - N + wr (bottom-right aligned; -1 = unbounded, stored clamped to N + M so the index
  // arithmetic cannot overflow).  softcap > 0: s = softcap tanh(s / softcap) on s = scale q.k.
  // alibi: slopes float32 [B, H] read through strides (nullptr: none), s -= slope |i + M - N - j|.
  int64_t wl = -1, wr = -1;
  double softcap = 0.0;
  const float* alibi = nullptr;
  int64_t alibi_sb = 0, alibi_sh = 0;
  // Learned sinks, float32 [H] contiguous (nullptr: none): one more logit of each row's softmax,
  // folded in by finish_row before a row is rounded to its dtype (the flash forward and the
  // decoding kernel; the backward takes the rows and lse with the sink in them).
  const float* sinks = nullptr;
  // Query head h's sink (-inf: none), as finish_row takes it.
  template <typename acc_t = float>
  acc_t sink(int64_t h) const {
    return sinks ? static_cast<acc_t>(sinks[h]) : -std::numeric_limits<acc_t>::infinity();
  }

  // The keys query row i sees, [key_lo(i), key_hi(i)), before the masks: causality and the
  // window (empty when key_lo >= key_hi).  Both are nondecreasing in i.
  int64_t key_lo(int64_t i) const { return wl >= 0 ? std::max<int64_t>(0, i + M - N - wl) : 0; }
  int64_t key_hi(int64_t i) const {
    int64_t hi = M;
    if (causal) hi = std::min(hi, i + 1);
    if (wr >= 0) hi = std::min(hi, i + M - N + wr + 1);
    return std::max<int64_t>(hi, 0);
  }
  // The query rows that see some key of [j0, j1): [row_lo(j0), row_hi(j1)) (j0 < j1).
  int64_t row_lo(int64_t j0) const {
    int64_t lo = 0;
    if (causal) lo = std::max(lo, j0);
    if (wr >= 0) lo = std::max(lo, j0 - (M - N) - wr);
    return std::min(lo, N);
  }
  int64_t row_hi(int64_t j1) const {
    return wl >= 0 ? std::clamp<int64_t>(j1 - (M - N) + wl, 0, N) : N;
  }
  bool has_window() const { return wl >= 0 || wr >= 0; }
  // Row i's visible keys within the tile [j0, j0 + n), as offsets [lo, hi) into it (lo == hi: none).
  void tile_range(int64_t i, int64_t j0, int64_t n, int64_t& lo, int64_t& hi) const {
    lo = std::clamp<int64_t>(key_lo(i) - j0, 0, n);
    hi = std::clamp<int64_t>(key_hi(i) - j0, lo, n);
  }
  float slope(int64_t b, int64_t h) const { return alibi[b * alibi_sb + h * alibi_sh]; }
};

// Logit soft-capping (issue 28): s[j] <- cap2 * tanh(s[j] * inv) for raw scores s = q.k, with
// inv = scale / softcap and cap2 = softcap * log2(e) (base-2 scores).  dcap (the backward's, or
// nullptr): 1 - tanh^2, the derivative of the cap.  float32: a rational approximation of tanh
// (Eigen's, numerator of degree 13 over degree 6 on [-7.9053, 7.9053], max error 4e-7 measured
// against std::tanh), written so that the loop vectorizes on every target (AVX2 and AVX-512
// alike; std::tanh does not: setup.py's -fno-trapping-math is needed for the division); the
// clamp keeps a NaN (both compares are false for NaN) and maps +-inf to +-1.  No branch for tiny
// |x| (Eigen returns x there): p(0) / q(0) = 1 - 1.3e-7, and the select cost 0.70 against 0.45
// ns per score (AMD EPYC AVX2, session 12).  float64: std::tanh.
template <typename T>
inline T tanh_fast(T x) {
  if constexpr (std::is_same_v<T, float>) {
    constexpr float c = 7.90531110763549805f;
    const float y = std::min(std::max(x, -c), c);
    const float y2 = y * y;
    float p = -2.76076847742355e-16f;
    p = p * y2 + 2.00018790482477e-13f;
    p = p * y2 + -8.60467152213735e-11f;
    p = p * y2 + 5.12229709037114e-08f;
    p = p * y2 + 1.48572235717979e-05f;
    p = p * y2 + 6.37261928875436e-04f;
    p = p * y2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * y2 + 1.18534705686654e-04f;
    q = q * y2 + 2.26843463243900e-03f;
    q = q * y2 + 4.89352518554385e-03f;
    return p * y / q;
  } else {
    return std::tanh(x);
  }
}

template <typename T>
inline void softcap_row(T* s, int64_t n, T inv, T cap2, T* dcap) {
  if (dcap == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] = cap2 * tanh_fast(s[j] * inv);
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const T t = tanh_fast(s[j] * inv);
      s[j] = cap2 * t;
      dcap[j] = (T(1) - t) * (T(1) + t);
    }
  }
}

// Base-2 scores of query row (b, h, i) for the keys [j0, j0 + n): s[j] <- c s[j] (or the capped
// score, see softcap_row) plus ALiBi's -slope |i + M - N - j| log2(e), then the mask, for the
// keys j in [lo, hi) (clamped to [0, n)) -- the row's visible range, from causality and the
// window -- and -inf outside it.  dcap (softcap's backward only): 1 - tanh^2 per key, 0 outside
// [lo, hi) (so that a stale value never meets a hidden key's zero probability).  raw_factor: the
// factor the scores already carry (s = raw_factor q.k; the forward multiplies Q by
// scale * log2(e) while packing it, and passes c = 1: no multiplication pass over the scores).
template <typename T>
inline void prepare_row(T* s, int64_t n, int64_t lo, int64_t hi, T c, const Problem& p, int64_t b,
                        int64_t h, int64_t i, int64_t j0, T* dcap = nullptr, double raw_factor = 1.0) {
  lo = std::clamp<int64_t>(lo, 0, n);
  hi = std::clamp<int64_t>(hi, lo, n);
  for (int64_t j = 0; j < lo; ++j) s[j] = neg_inf<T>();
  for (int64_t j = hi; j < n; ++j) s[j] = neg_inf<T>();
  if (dcap != nullptr) {
    std::fill(dcap, dcap + lo, T(0));
    std::fill(dcap + hi, dcap + n, T(0));
  }
  const int64_t nv = hi - lo;
  if (nv <= 0) return;
  T* sv = s + lo;
  if (p.softcap > 0.0) {
    softcap_row(sv, nv, static_cast<T>(p.scale / p.softcap / raw_factor), static_cast<T>(p.softcap * kLog2e),
                dcap == nullptr ? nullptr : dcap + lo);
  } else if (c != T(1)) {
#pragma omp simd
    for (int64_t j = 0; j < nv; ++j) sv[j] *= c;
  }
  if (p.alibi != nullptr) {
    // |i + M - N - j| for j = j0 + lo + x: |d0 - x|; int32 (rows and keys number < 2^31) so
    // that the conversion vectorizes.
    const T a = static_cast<T>(-static_cast<double>(p.slope(b, h)) * kLog2e);
    const int32_t d0 = static_cast<int32_t>(i + p.M - p.N - j0 - lo);
#pragma omp simd
    for (int32_t x = 0; x < static_cast<int32_t>(nv); ++x) sv[x] += a * static_cast<T>(std::abs(d0 - x));
  }
  apply_mask(sv, nv, p.mask, b, h, i, j0 + lo);
}

MaskView make_mask_view(const c10::optional<at::Tensor>& mask) {
  MaskView mv;
  if (!mask.has_value() || !mask->defined()) return mv;
  const at::Tensor& m = *mask;
  switch (m.scalar_type()) {
    case at::kBool: mv.kind = MaskKind::kBool; break;
    case at::kFloat: mv.kind = MaskKind::kFloat; break;
    case at::kDouble: mv.kind = MaskKind::kDouble; break;
    case at::kBFloat16: mv.kind = MaskKind::kBFloat16; break;
    case at::kHalf: mv.kind = MaskKind::kHalf; break;
    default: ATTNKIT_CHECK(false, "attnkit::softmax (cpu): unchecked mask dtype ", m.scalar_type());  // checks::softmax_*
  }
  mv.data = static_cast<const char*>(m.const_data_ptr());
  mv.esize = m.element_size();
  mv.sb = m.stride(0);
  mv.sh = m.stride(1);
  mv.sn = m.stride(2);
  mv.sm = m.stride(3);
  return mv;
}

// ---------------------------------------------------------------------------------------------
// Forward, accumulation type acc_t (float or double); inputs of any floating dtype are
// converted while packing.
// ---------------------------------------------------------------------------------------------
template <typename acc_t>
struct FwdScratch {
  int64_t packed_head = -1;   // b * Hk + hk of the packed K / V below
  avec<acc_t> kt;             // [nkb][D][kBK]  K transposed per key block, zero padded
  avec<acc_t> v;              // [M][Dv]
  avec<acc_t> q;              // [kBQ][D]
  // 16-bit tiles (the bf16 dot path, brgemm): K [nkb][D2/2][kBK][2] (pairs of d) or, brgemm
  // without VNNI, [nkb][D2][kBK]; V [M2/2][Dvp][2] (pairs of keys) or [M2][Dvp]; Q [kBQ][D2];
  // P [kBQ][kBK].  Element (k, n) of a B operand at b16_index(k, n, ld, pairs).
  avec<uint16_t> kb16, vb16, qb16, pb16;
  // The float16 split (split16.h): K's packed depth is [hi; lo; hif; lo] (4 D2), Q's rows
  // [hi | hif | lo | lo]; vb16 holds V's hif, va16 its (hi, lo) pairs per key [M2][Dvp][2]; pb16
  // P's lo, pa16 its hi doubled per key [kBQ][2 kBK]; split16 the hi / lo / hif rows before
  // packing.
  avec<uint16_t> va16, pa16, split16;
  avec<acc_t> s;              // [kBQ][kBK]
  avec<acc_t> o;              // [kBQ][Dv]
  avec<acc_t> m, l;           // [kBQ]
  BrgemmRelease release;      // the thread's brgemm state, released when the worker ends
};


// path (gemm_path.h, float16 / bfloat16 only): the tile GEMMs through oneDNN's brgemm, on 16-bit
// Q, K, P, V packed in its B layout (VNNI pairs, or plain rows where oneDNN has no AMX), or
// native: bfloat16 multiplies in bfloat16 (vdpbf16ps, float32 sums) where the build has it (the
// same pairs layout), every other case on float32 (float64) tiles.  Only the packing and the two
// GEMM calls differ; the online softmax is the same for all.
template <typename scalar_t, typename acc_t>
void softmax_fwd_kernel(const Problem& p, GemmPath path, bool bf16_dot, const scalar_t* q, Strides4 qs,
                        const scalar_t* k, Strides4 ks, const scalar_t* v, Strides4 vs, scalar_t* out, acc_t* lse) {
  constexpr bool k16 = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;
  const bool brgemm = k16 && path != GemmPath::kNative;
  // bfloat16 on the native tiles: dot products where cpu_bf16_dot_products() says (gemm_path.h),
  // else widened to float32 as float16 is.
  const bool dot = kHaveBf16Dot && std::is_same_v<scalar_t, at::BFloat16> && !brgemm && bf16_dot;
  const bool tiles16 = dot || brgemm;  // Q, K, V, P packed as 16-bit
  const bool pairs = brgemm ? brgemm_vnni_layout(path) : dot;  // VNNI layout of K and V
  // float16 as bfloat16 pairs (hi, lo) on brgemm: S = Qh Kh + Qh Kl + Ql Kh + Ql Kl in one product
  // of depth 4 D2 -- every product exact in float32, as float16's own -- and O += Ph (Vh + Vl) +
  // Pl Vh in two (P kept to 16 bits, more than float16's 11; gemm_path.h).  The three-term S
  // (Ql Kl dropped) was a quarter cheaper but its scores 2^-18 sum |q k| off: lse 1.1e-3 off at
  // |s| ~ 300 (float16 inputs of scale 8, D=64), 1.0e-4 on the native tiles.
  const bool split = std::is_same_v<scalar_t, at::Half> && is_split(path);
  const int64_t B = p.B, H = p.H, Hk = p.Hk, N = p.N, M = p.M, D = p.D, Dv = p.Dv;
  const int64_t G = H / Hk;
  // Query rows per task: 128 on brgemm, 64 on the native tiles.  Forward, B=1 H=8, Xeon with
  // AMX, min of 250-700 calls, builds alternated (bench/cpu_micro/min_of_calls.py): bfloat16
  // N=1024 D=128 2 threads 3.96-4.00 -> 3.85-3.91 ms (one thread: 8.07-8.26 -> 7.45-7.72 in one
  // window, within the noise in another), N=4096 D=64 causal 2 threads 23.4-23.8 -> 22.2-22.9 ms,
  // N=1024 D=64 causal one thread 3.80-3.83 -> 3.64 ms; float32 (native) within 1-2% either way,
  // so the native tiles keep the size measured on AMD EPYC.
  int64_t BQ = brgemm ? kBQMax : kBQ;
  // Fewer tasks than threads (few heads, few query rows: a prompt chunk against a long cache):
  // smaller query blocks, down to 32 rows, so that every thread gets one.  B=1 H=1 N=128 M=16384
  // D=64, 2 threads, Xeon with AMX (session 21), against torch SDPA: bfloat16 0.79x -> 1.13x,
  // float16 (the split) 0.38x -> 0.71x.
  while (BQ > 32 && B * H * ceil_div(N, BQ) < at::get_num_threads()) BQ /= 2;
  const int64_t nqb = ceil_div(N, BQ);
  const int64_t nkb = ceil_div(M, kBK);
  // Q's row length and K's packed depth: even (a bf16 pair), and a multiple of 32 for brgemm.
  // torch 2.13's bundled oneDNN, on AMX, writes a NaN of row i + 1 of the left operand into
  // output row i when K > 32 and K % 32 != 0 (DESIGN.md): zero-padding D to 32 keeps a NaN query
  // row's NaN in its own row.  (P, the left operand of O += P V, never holds a NaN: see below.)
  const int64_t D2 = round_up(D, brgemm ? 32 : 2), Dvp = round_up(Dv, 16), M2 = round_up(M, 2);
  const int64_t DS = split ? 4 * D2 : D2;  // the packed depth of S = Q K^T
  const acc_t c = static_cast<acc_t>(p.scale * kLog2e);
  // 16-bit tiles' raw scores with no score option or mask to apply: the scale goes into the max
  // and the exponentials (exp2_scaled_sum_bits16) instead of a pass of its own (prepare_row).
  const bool raw_plain = tiles16 && p.softcap <= 0.0 && p.alibi == nullptr && p.mask.kind == MaskKind::kNone;
  // Task order: (b, kv head) major so that a worker mostly reuses its packed K / V, then query
  // blocks last-first (the causal ones are the largest), then the heads of the GQA group.
  const int64_t ntasks = B * Hk * nqb * G;
  run_tasks(
      ntasks,
      [&] {
        FwdScratch<acc_t> st;
        if (tiles16) {
          st.kb16.resize(static_cast<size_t>(nkb * DS * kBK));
          st.vb16.resize(static_cast<size_t>(M2 * Dvp));
          st.qb16.resize(static_cast<size_t>(BQ * DS));
          st.pb16.resize(static_cast<size_t>(BQ * kBK));
          if (split) {
            st.va16.resize(static_cast<size_t>(2 * M2 * Dvp));
            st.pa16.resize(static_cast<size_t>(BQ * 2 * kBK));
            // K's block or Q's rows: hi, lo, hif [rows][D]; V: hi / lo rows [2 M][Dv], hif [M][2 Dv].
            st.split16.resize(static_cast<size_t>(std::max({3 * kBK * D, 3 * BQ * D, 4 * M * Dv})));
          }
          st.release = BrgemmRelease(path);
        } else {
          st.kt.resize(static_cast<size_t>(nkb * D * kBK));
          if (!(std::is_same_v<scalar_t, acc_t> && vs.d == 1 && vs.n == Dv)) st.v.resize(static_cast<size_t>(M * Dv));
          st.q.resize(static_cast<size_t>(BQ * D));
        }
        st.s.resize(static_cast<size_t>(BQ * kBK));
        st.o.resize(static_cast<size_t>(BQ * Dv));
        st.m.resize(BQ);
        st.l.resize(BQ);
        return st;
      },
      [&](FwdScratch<acc_t>& st, int64_t t) {
        const int64_t g = t % G;
        const int64_t qb = nqb - 1 - (t / G) % nqb;
        const int64_t bk = t / (G * nqb);  // b * Hk + hk
        const int64_t b = bk / Hk, hk = bk % Hk, h = hk * G + g;
        // float32 values in dense rows (unit stride, rows Dv apart) are multiplied in place (no
        // copy).  Rows further apart are copied once per head: FlashAttention's [B, N, H, D]
        // layout -- and transformers' q / k / v, views of [B, N, H * D] projections -- puts V's
        // rows of one head H * Dv apart (2 KiB at H = 8, Dv = 64 in float32), a power-of-two
        // stride whose rows fall into few L1 sets while the P V panel is streamed.  Such views,
        // B=1 H=8 N=1024 D=64 float32, one thread, builds alternated (Intel Xeon without AMX,
        // session 33, a fuzz job on the other core): forward min 15.7-16.7 -> 15.3-15.4 ms
        // (with the backward's change below, forward+backward 60.3-62.0 -> 56.1-58.7 ms); causal
        // within noise.
        const bool v_in_place = std::is_same_v<scalar_t, acc_t> && vs.d == 1 && vs.n == Dv;
        if (st.packed_head != bk) {
          // Padding (keys past M, an odd D's last pair) stays zero from the buffers' creation:
          // every head writes the same positions.
          for (int64_t k0 = 0; k0 < M; k0 += kBK) {
            const int64_t kn = std::min(kBK, M - k0);
            if (split) {
              // Depth rows: K's hi, lo, hif, lo (D2 each; split16.h).
              if constexpr (std::is_same_v<scalar_t, at::Half>)
                pack_split_transposed4(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D, D2, st.split16.data(),
                                       st.kb16.data() + (k0 / kBK) * DS * kBK, kBK);
            } else if (tiles16) {
              // kb16[kb * D2 * kBK + b16_index(d, jj, kBK, pairs)] = k[b, hk, kb * kBK + jj, d]
              if constexpr (k16)
                pack_transposed_pairs(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D,
                                      st.kb16.data() + (k0 / kBK) * D2 * kBK, kBK, pairs);
            } else {
              // kt[(kb * D + d) * kBK + jj] = k[b, hk, kb * kBK + jj, d]
              pack_transposed(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D,
                              st.kt.data() + (k0 / kBK) * D * kBK, kBK);
            }
          }
          if (split) {
            // V's (hi, lo) pairs per key (va16) and its hif in pairs of keys (vb16; split16.h).
            if constexpr (std::is_same_v<scalar_t, at::Half>)
              pack_split_pairs(v + vs.at(b, hk, 0), vs.n, vs.d, M, M2, Dv, st.split16.data(), st.va16.data(),
                               st.vb16.data(), Dvp);
          } else if (tiles16) {
            // vb16[b16_index(j, d, Dvp, pairs)] = v[b, hk, j, d]
            if constexpr (k16) pack_rows16(v + vs.at(b, hk, 0), vs.n, vs.d, M, Dv, st.vb16.data(), Dvp, pairs, M);
          } else if (!v_in_place) {
            for (int64_t j = 0; j < M; ++j) {
              const scalar_t* src = v + vs.at(b, hk, j);
              acc_t* dst = st.v.data() + j * Dv;
              convert_row(src, vs.d, Dv, dst);
            }
          }
          st.packed_head = bk;
        }
        const acc_t* vrows = nullptr;  // V rows of the fp32 path: [M][ldv]
        int64_t ldv = Dv;
        if (!tiles16) {
          if (v_in_place) {
            vrows = reinterpret_cast<const acc_t*>(v + vs.at(b, hk, 0));
            ldv = vs.n;
          } else {
            vrows = st.v.data();
          }
        }
        const int64_t q0 = qb * BQ;
        const int64_t qn = std::min(BQ, N - q0);
        if (split) {
          // Q rows [qn][4 D2]: hi | hif | lo | lo (split16.h), each segment's columns [D, D2) zero
          // from the buffer's creation.
          if constexpr (std::is_same_v<scalar_t, at::Half>)
            pack_split_rows4(q + qs.at(b, h, q0), qs.n, qs.d, qn, D, D2, st.split16.data(), st.qb16.data(), DS);
        } else if (tiles16) {
          // Q rows [qn][D2]; the columns [D, D2) stay zero from the buffer's creation.
          if constexpr (k16) pack_rows16(q + qs.at(b, h, q0), qs.n, qs.d, qn, D, st.qb16.data(), D2, false, qn);
        } else {
          for (int64_t r = 0; r < qn; ++r) {
            acc_t* dst = st.q.data() + r * D;
            convert_row(q + qs.at(b, h, q0 + r), qs.d, D, dst);
            for (int64_t d = 0; d < D; ++d) dst[d] *= c;
          }
        }
        std::fill(st.o.begin(), st.o.begin() + qn * Dv, acc_t(0));
        std::fill(st.m.begin(), st.m.begin() + qn, neg_inf<acc_t>());
        std::fill(st.l.begin(), st.l.begin() + qn, acc_t(0));
        // The keys some row of the block sees (causality, window): [kv_begin, kv_end), the
        // start rounded down to 16 keys (the bf16 tiles read whole 16-column vectors of the
        // packed block).  Key blocks outside it are skipped: a window's cost tracks its band.
        const int64_t kv_end = p.key_hi(q0 + qn - 1);
        const int64_t kv_begin = std::min(p.key_lo(q0), kv_end) / 16 * 16;
        // Under causality or a window the rows of the block see shifted key ranges; every row
        // sees [split_lo, split_hi) (16-aligned inside), and the tiles are cut there too, so that
        // the band's edges (the window's left wedge, the causal diagonal) come as tiles of their
        // own, multiplied by groups of kWindowRows rows each over its own keys, and the keys in
        // between as tiles that every row sees whole (one GEMM over all rows, nothing masked).
        int64_t split_lo = kv_begin, split_hi = kv_begin;
        if (p.causal || p.has_window()) {
          split_lo = std::clamp<int64_t>(round_up(p.key_lo(q0 + qn - 1), 16), kv_begin, kv_end);
          // (No cut where every row sees the block's last key: a window too wide to hide any key
          // then tiles exactly as no window.)
          const int64_t hi0 = p.key_hi(q0);
          split_hi = hi0 >= kv_end ? kv_end : std::clamp<int64_t>(hi0 / 16 * 16, split_lo, kv_end);
        }
        for (int64_t k0 = kv_begin; k0 < kv_end;) {
          // Keys [k0, k0 + kn) of packed block kb, from its column col (a multiple of 16).
          const int64_t kb = k0 / kBK, col = k0 - kb * kBK;
          int64_t k1 = std::min((kb + 1) * kBK, kv_end);
          if (split_lo > k0) k1 = std::min(k1, split_lo);
          if (split_hi > k0) k1 = std::min(k1, split_hi);
          const int64_t kn = k1 - k0;
          acc_t* S = st.s.data();
          // S = Q K^T by groups of rows, each over the keys its rows see: [c0, c1) of the tile,
          // c0 rounded down to 16.  Groups of kWindowRows rows where the rows' key ranges differ
          // (causality, a window), consecutive groups with the same columns merged (a tile that
          // every row sees whole: one group); otherwise one group, the whole tile.  Keys a group
          // skips are hidden for all its rows (prepare_row reads a row's [lo, hi) only, inside
          // [c0, c1)).
          const int64_t rows_per_group = (p.causal || p.has_window()) ? kWindowRows : qn;
          int64_t groups[kBQMax / kWindowRows + 1][4];  // r0, r1, c0, c1
          int64_t ngroups = 0;
          for (int64_t r0 = 0; r0 < qn; r0 += rows_per_group) {
            const int64_t r1 = std::min(r0 + rows_per_group, qn);
            const int64_t c0 = std::clamp<int64_t>(p.key_lo(q0 + r0) - k0, 0, kn) / 16 * 16;
            const int64_t c1 = std::clamp<int64_t>(p.key_hi(q0 + r1 - 1) - k0, c0, kn);
            if (ngroups > 0 && groups[ngroups - 1][2] == c0 && groups[ngroups - 1][3] == c1) {
              groups[ngroups - 1][1] = r1;
              continue;
            }
            int64_t* gr = groups[ngroups++];
            gr[0] = r0;
            gr[1] = r1;
            gr[2] = c0;
            gr[3] = c1;
          }
          for (int64_t g = 0; g < ngroups; ++g) {
            const int64_t r0 = groups[g][0], rn = groups[g][1] - r0, c0 = groups[g][2], c1 = groups[g][3];
            if (c1 == c0) continue;
            if (split) {
              if constexpr (k16)
                brgemm16<at::BFloat16>(rn, c1 - c0, DS, DS, kBK, kBK, false, st.qb16.data() + r0 * DS,
                                       st.kb16.data() + kb * DS * kBK + b16_index(0, col + c0, kBK, true),
                                       S + r0 * kBK + c0, path);
            } else if (brgemm) {
              if constexpr (k16)
                brgemm16<scalar_t>(rn, c1 - c0, D2, D2, kBK, kBK, false, st.qb16.data() + r0 * D2,
                                   st.kb16.data() + kb * D2 * kBK + b16_index(0, col + c0, kBK, pairs),
                                   S + r0 * kBK + c0, path);
            } else if (dot) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
                gemm_bf16(rn, c1 - c0, D, st.qb16.data() + r0 * D2, D2,
                          st.kb16.data() + kb * D2 * kBK + (col + c0) * 2, kBK * 2, S + r0 * kBK + c0, kBK, false);
#endif
            } else {
              gemm<acc_t>(rn, c1 - c0, D, st.q.data() + r0 * D, D, 1, st.kt.data() + kb * D * kBK + col + c0,
                          kBK, S + r0 * kBK + c0, kBK, false);
            }
          }
          // The online softmax of the tile, in three passes over its rows rather than one row
          // after another: a row's chain of latencies (the max's reduction, the exponential of the
          // max's change, the sum's reduction) then overlaps other rows' work.  bfloat16 B=1 H=8
          // N=1024 D=64 forward, one thread, Xeon with AMX (brgemm, session 18, min of ~350 calls):
          // 6.9 -> 6.0 ms.
          // (1) The visible keys [lo, hi) of each row in the tile (the edges of a causal diagonal
          // or a window's band are skipped; P = 0 elsewhere), its score options, the new max.
          // Q was multiplied by c while packing (the 16-bit tiles multiply raw scores: without
          // score options, c is folded into the max and the exponentials, no pass of its own).
          const acc_t cs = raw_plain ? c : acc_t(1);  // the factor s still needs
          int64_t row_lo[kBQMax], row_hi[kBQMax];
          acc_t row_mx[kBQMax], row_alpha[kBQMax];
          for (int64_t r = 0; r < qn; ++r) {
            acc_t* s = S + r * kBK;
            const int64_t i = q0 + r;
            int64_t& lo = row_lo[r];
            int64_t& hi = row_hi[r];
            p.tile_range(i, k0, kn, lo, hi);
            if (!raw_plain)
              prepare_row<acc_t>(s, kn, lo, hi, tiles16 ? c : acc_t(1), p, b, h, i, k0, nullptr,
                                 tiles16 ? 1.0 : double(c));
            row_mx[r] = hi > lo ? max_nan(st.m[r], scaled_max(s + lo, hi - lo, cs)) : st.m[r];
          }
          // (2) The rescale factors exp2(m - mx) of all rows at once (0 on a row's first visible
          // block; unused where mx is -inf).
          exp2_diff(st.m.data(), row_mx, row_alpha, qn);
          // (3) P, its sums, and the running (m, l, o).
          for (int64_t r = 0; r < qn; ++r) {
            acc_t* s = S + r * kBK;
            const int64_t lo = row_lo[r], hi = row_hi[r];
            const acc_t mx = row_mx[r];
            if (mx == neg_inf<acc_t>() || hi == lo) {
              // Nothing visible yet in this row: contributes nothing -- unless the max dropped a
              // NaN (flash_tiles.h): then the row is NaN from here on (m, l NaN are sticky).  (The
              // scale first where it is still to apply: 0 * inf is a NaN too.)
              if (cs != acc_t(1))
                for (int64_t j = lo; j < hi; ++j) s[j] *= cs;
              if (hi > lo && has_nan(s + lo, hi - lo)) {
                st.m[r] = st.l[r] = std::numeric_limits<acc_t>::quiet_NaN();
                std::fill(st.o.data() + r * Dv, st.o.data() + (r + 1) * Dv, st.m[r]);
              }
              std::fill(s, s + kn, acc_t(0));
              if (tiles16) std::fill(st.pb16.data() + r * kBK, st.pb16.data() + r * kBK + round_up(kn, 2), uint16_t(0));
              if (split)
                std::fill(st.pa16.data() + r * 2 * kBK, st.pa16.data() + r * 2 * kBK + 2 * round_up(kn, 2), uint16_t(0));
            } else {
              const acc_t alpha = row_alpha[r];
              acc_t sum = 0;
              if constexpr (k16 && std::is_same_v<acc_t, float>) {
                // P in 16 bits straight from the scores (one pass), zero up to an even count: the
                // pair of a VNNI product's odd tail.
                if (split && k16)
                  sum = exp2_scaled_sum_split(s, lo, hi, cs, mx, st.pa16.data() + r * 2 * kBK, st.pb16.data() + r * kBK,
                                              round_up(kn, 2));
                else if (tiles16)
                  sum = exp2_scaled_sum_bits16<scalar_t>(s, lo, hi, cs, mx, st.pb16.data() + r * kBK, round_up(kn, 2));
              }
              if (!tiles16) {
                sum = exp2_sub_sum(s + lo, hi - lo, mx);
                std::fill(s, s + lo, acc_t(0));
                std::fill(s + hi, s + kn, acc_t(0));
              }
              if (alpha != acc_t(1)) {
                acc_t* o = st.o.data() + r * Dv;
                for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
              }
              st.l[r] = st.l[r] * alpha + sum;
              st.m[r] = mx;
              // A row whose l is NaN (a NaN score, or inf - inf) is NaN already (o, m, l stay NaN)
              // and gets P = 0: no NaN in the left operand of P V for the oneDNN defect above to
              // spread into the row before it.
              if (tiles16 && std::isnan(st.l[r])) {
                std::fill(st.pb16.data() + r * kBK, st.pb16.data() + r * kBK + round_up(kn, 2), uint16_t(0));
                if (split)
                  std::fill(st.pa16.data() + r * 2 * kBK, st.pa16.data() + r * 2 * kBK + 2 * round_up(kn, 2), uint16_t(0));
              }
            }
          }
          // O += P V, by the same groups (P is 0 outside a group's keys).
          for (int64_t g = 0; g < ngroups; ++g) {
            const int64_t r0 = groups[g][0], rn = groups[g][1] - r0, c0 = groups[g][2], c1 = groups[g][3];
            if (c1 == c0) continue;
            if (split) {
              // Ph (Vh + Vl): depth 2 (c1 - c0), key j's pair (Ph, Ph) against (Vh, Vl); then Pl Vhif as
              // below.  (P holds no NaN: the K-tail defect cannot reach these products.)
              if constexpr (k16) {
                brgemm16<at::BFloat16>(rn, Dv, 2 * (c1 - c0), 2 * kBK, Dvp, Dv, true,
                                       st.pa16.data() + r0 * 2 * kBK + 2 * c0, st.va16.data() + (k0 + c0) * Dvp * 2,
                                       st.o.data() + r0 * Dv, path);
                brgemm16<at::BFloat16>(rn, Dv, round_up(c1 - c0, 2), kBK, Dvp, Dv, true, st.pb16.data() + r0 * kBK + c0,
                                       st.vb16.data() + (k0 + c0) * Dvp, st.o.data() + r0 * Dv, path);
              }
            } else if (brgemm) {
              // VNNI: K even; P's columns from c1 on are 0 for these rows (their keys end at c1),
              // and V has row k0 + c1 (a zero row past an odd M).
              if constexpr (k16)
                brgemm16<scalar_t>(rn, Dv, pairs ? round_up(c1 - c0, 2) : c1 - c0, kBK, Dvp, Dv, true,
                                   st.pb16.data() + r0 * kBK + c0, st.vb16.data() + (k0 + c0) * Dvp,
                                   st.o.data() + r0 * Dv, path);
            } else if (dot) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
                gemm_bf16(rn, Dv, c1 - c0, st.pb16.data() + r0 * kBK + c0, kBK, st.vb16.data() + (k0 + c0) * Dvp,
                          Dvp * 2, st.o.data() + r0 * Dv, Dv, true);
#endif
            } else {
              gemm<acc_t>(rn, Dv, c1 - c0, S + r0 * kBK + c0, kBK, 1, vrows + (k0 + c0) * ldv, ldv,
                          st.o.data() + r0 * Dv, Dv, true);
            }
          }
          k0 += kn;
        }
        for (int64_t r = 0; r < qn; ++r) {
          const int64_t row = (b * H + h) * N + q0 + r;
          finish_row(st.o.data() + r * Dv, st.m[r], st.l[r], Dv, out + row * Dv, lse + row, p.sink<acc_t>(h));
        }
      });
}

// ---------------------------------------------------------------------------------------------
// Decoding forward (issue 14): few query rows (N <= kDecodeMaxN) against a long KV cache.
//
// The flash forward above packs (transposes) all of K per (b, kv head) into a scratch buffer
// and multiplies one query head's N rows at a time: for N = 1 that is a 1-row GEMM per key
// block, with K written out and read back.  Here a task is (b, kv head, split of the keys): the
// R = G * N rows of every query head of the GQA group are processed together, so each K and V
// row is read from memory once for all of them.  Per tile of 64 keys: the scores S [R][64] as
// dot products of 4 query rows with 4 K rows at a time, read in place (decode_dots4: one vector
// accumulator per row and key, their 16 horizontal sums folded into one vector), the
// online softmax per row, O += P V with V read in place (float32) or converted per tile.  Keys
// are split over tasks when there are too few (b, kv head) pairs for the threads; the splits'
// (max, sum, out) are merged with the usual log-sum-exp weights at the end.
// Why dot products rather than a GEMM on a transposed K tile (the layout before): the
// transposition cost as much as the score GEMM itself.  Measured (B=8 Hq=32 Hk=8 M=4096 D=128,
// one thread, interleaved in one process, scratch build): float32 N=1 20.3 -> 13.7 ms, N=4 13.7
// -> 10.3 ms (M=2048), N=16 28.0 -> 27.0 ms (M=2048, compute-bound: the same); bfloat16 N=1
// (vdpbf16ps on K in place) 7.6 -> 4.9 ms (M=2048).  Prefetch: V of the tile into L1 at its
// start, K of the next tile into L2 (kept from before; K and V two or more tiles ahead into L2,
// or no prefetch, measured 10-25% slower).
// ---------------------------------------------------------------------------------------------
constexpr int64_t kDecodeMaxN = 16;     // query rows per head
constexpr int64_t kDecodeMaxRows = 64;  // G * N rows per task

bool use_decode(const Problem& p, at::ScalarType dtype) {
  if (!(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf)) return false;
  return p.N <= kDecodeMaxN && p.N * (p.H / p.Hk) <= kDecodeMaxRows;
}

struct DecodeScratch {
  avec<float> q;             // [R][D]: the task's query rows (float32 dots)
  avec<uint16_t> qb;         // [R][D2]: the same in 16 bits (bf16 dots, brgemm)
  avec<float> kf;            // [T][D]: K tile as float32 rows (when not read in place)
  avec<float> kt;            // [D][T]: K tile transposed (float32 GEMM scores)
  avec<uint16_t> kb;         // [D2/2][T][2]: K tile as pairs of d (bf16 GEMM scores; brgemm
                             // without VNNI: [D2][T])
  avec<float> vf;            // [T][Dv]: V tile as float32 (when not read in place)
  avec<uint16_t> pb;         // [R][T]: probabilities in 16 bits (bf16 P V, brgemm)
  avec<uint16_t> vb;         // [T/2][Dvp][2]: V tile as pairs of keys (bf16 P V; brgemm without
                             // VNNI: [T][Dvp])
  avec<float> s;             // [R][T]: scores, then probabilities
  avec<float> o;             // [R][Dv]
  avec<float> m, l;          // [R]
  BrgemmRelease release;     // the thread's brgemm state, released when the worker ends
  // Own AMX tiles (amx_decode_scores / amx_decode_pv):
  avec<uint32_t> qt;         // [D/2][R]: Q^T as pairs of d
  avec<float> st;            // [T][16]: S^T of a tile
  avec<uint16_t> kpad;       // [16][D]: the rows of a tile's last, partial block of 16 keys
  AmxTileScope tiles;        // the worker's tile configuration, released when the worker ends
};

#if defined(__AVX512F__)
// 16 elements of a K row as float32 under a lane mask: float32 loaded, 16 bits widened in registers.
__attribute__((always_inline)) inline __m512 load_k16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
template <typename T16>
__attribute__((always_inline)) inline __m512 load_k16(const T16* p, __mmask16 m) { return load16_as_float(p, m); }
#endif

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// O [R][ldo] (+)= P [R][ldp] V for keys j < kn, columns [0, cols <= 16 NV): 16-bit V rows read in
// place (ldv apart), each widened in registers once for the R rows.
template <int R, int NV, bool Full, typename T16>
inline void decode_pv_widen_rows(int64_t kn, const float* P, int64_t ldp, const T16* V, int64_t ldv, float* O,
                                 int64_t ldo, int64_t cols) {
  __mmask16 m[NV];
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    const int64_t n = std::clamp<int64_t>(cols - 16 * c, 0, 16);
    m[c] = Full ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_maskz_loadu_ps(m[c], O + r * ldo + 16 * c);
  }
  for (int64_t j = 0; j < kn; ++j) {
    __m512 vv[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) vv[c] = load16_as_float(V + j * ldv + 16 * c, m[c]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(P[r * ldp + j]);
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pv, vv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(O + r * ldo + 16 * c, m[c], acc[r][c]);
}

// One panel of cols <= 64 columns for all R rows: groups of 4 rows, the last one 1-3 rows.
template <bool Full, typename T16>
inline void decode_pv_widen_cols(int64_t R, int64_t kn, const float* P, int64_t ldp, const T16* V, int64_t ldv,
                                 float* O, int64_t ldo, int64_t cols) {
  int64_t r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) decode_pv_widen_rows<4, 4, Full>(kn, P + r0 * ldp, ldp, V, ldv, O + r0 * ldo, ldo, cols);
  const int64_t rt = R - r0;
  if (rt == 3) decode_pv_widen_rows<3, 4, Full>(kn, P + r0 * ldp, ldp, V, ldv, O + r0 * ldo, ldo, cols);
  else if (rt == 2) decode_pv_widen_rows<2, 4, Full>(kn, P + r0 * ldp, ldp, V, ldv, O + r0 * ldo, ldo, cols);
  else if (rt == 1) decode_pv_widen_rows<1, 4, Full>(kn, P + r0 * ldp, ldp, V, ldv, O + r0 * ldo, ldo, cols);
}

// O [R][Dv] += P [R][ldp] V [kn][Dv] (16-bit, in place): groups of 4 rows x 64 columns (16
// accumulators), the last group of rows 1-3.
template <typename T16>
inline void decode_pv_widen(int64_t R, int64_t kn, const float* P, int64_t ldp, const T16* V, int64_t ldv, float* O,
                            int64_t Dv) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    const int64_t cols = std::min<int64_t>(64, Dv - c0);
    if (cols == 64) decode_pv_widen_cols<true>(R, kn, P, ldp, V + c0, ldv, O + c0, Dv, cols);
    else decode_pv_widen_cols<false>(R, kn, P, ldp, V + c0, ldv, O + c0, Dv, cols);
  }
}
#endif

// S [r][j] (rows ldS apart) = q_r . K[j] for RG <= 4 rows of q (float32, D each, rows D apart) and
// keys j < kn (rows ldk apart, read in place), KB = 16 / 8 / 4 keys at a time for 1 / 2 / 3-4
// rows: each 16-element chunk of a K row is loaded (16 bits: widened) once for the RG rows, into
// RG x KB accumulators that one reduce16 folds (lane KB r + j: row r, key j).  Keys past kn
// repeat the last one (their sums are not stored); D's last partial chunk is read under a lane
// mask.  (KB = 4 for one row too measured 5-14% slower there: four times the horizontal sums.)
// Why: the dot products one query row at a time (16 keys, one accumulator each) loaded and
// widened every K chunk once per row: three 512-bit ALU instructions (vpmovzxwd, vpslld,
// vfmadd231ps) per multiply-add on the two ports that take them, one in six here (4 rows).  And
// reduce16 is forced inline (simd_f32.h): called out of line, the 16 accumulators were stored to
// the stack on every chunk.  Measured, B=8 Hq=32 Hk=8 N=1 M=4096 D=128, 2 threads, Xeon (model
// 207, no AMX), `bench/softmax_cpu_speed.py decode` (session 27): float16 9.25 -> 7.46 ms (3.56x
// -> 4.42x SDPA), bfloat16 widened 9.53 -> 8.05 ms, now ahead of the dot products (9.87 ms, same
// run; cpu_bf16_dot_products); float32 13.51 / 13.78 ms (memory-bound, the same).
template <int RG, typename T>
inline void decode_dots4_rows(const float* q, int64_t D, const T* K, int64_t ldk, int64_t kn, float* S,
                              int64_t ldS) {
  constexpr int KB = RG == 1 ? 16 : RG == 2 ? 8 : 4;  // keys a block: RG x KB <= 16 accumulators
  for (int64_t j0 = 0; j0 < kn; j0 += KB) {
    const int64_t nj = std::min<int64_t>(KB, kn - j0);
    const T* kr[KB];
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) kr[j] = K + (j0 + std::min<int64_t>(j, nj - 1)) * ldk;  // past kn: the last key again
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      __m512 qv[RG];
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) qv[r] = _mm512_loadu_ps(q + r * D + d);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) {
        const __m512 kv = load_k16(kr[j] + d, __mmask16(0xFFFF));
#pragma GCC unroll 4
        for (int r = 0; r < RG; ++r) acc[KB * r + j] = _mm512_fmadd_ps(qv[r], kv, acc[KB * r + j]);
      }
    }
    if (d < D) {
      const __mmask16 md = static_cast<__mmask16>((1u << (D - d)) - 1u);
      __m512 qv[RG];
#pragma GCC unroll 4
      for (int r = 0; r < RG; ++r) qv[r] = _mm512_maskz_loadu_ps(md, q + r * D + d);
#pragma GCC unroll 16
      for (int j = 0; j < KB; ++j) {
        const __m512 kv = load_k16(kr[j] + d, md);
#pragma GCC unroll 4
        for (int r = 0; r < RG; ++r) acc[KB * r + j] = _mm512_fmadd_ps(qv[r], kv, acc[KB * r + j]);
      }
    }
    // Lanes KB r .. KB r + nj - 1 to row r: a masked store based KB r floats early (the lanes
    // outside the mask are neither read nor written, so the early base never touches memory).
    const __m512 sums = reduce16(acc);
    const unsigned mj = (1u << nj) - 1u;
#pragma GCC unroll 4
    for (int r = 0; r < RG; ++r)
      _mm512_mask_storeu_ps(S + r * ldS + j0 - KB * r, static_cast<__mmask16>(mj << (KB * r)), sums);
  }
}

// S [R][ldS] = Q K^T for all R rows (groups of 4, the last one 1-3 rows), keys j < kn.
template <typename T>
inline void decode_dots4(const float* q, int64_t R, int64_t D, const T* K, int64_t ldk, int64_t kn, float* S,
                         int64_t ldS) {
  int64_t r0 = 0;
  for (; r0 + 4 <= R; r0 += 4) decode_dots4_rows<4>(q + r0 * D, D, K, ldk, kn, S + r0 * ldS, ldS);
  const int64_t rt = R - r0;
  if (rt == 3) decode_dots4_rows<3>(q + r0 * D, D, K, ldk, kn, S + r0 * ldS, ldS);
  else if (rt == 2) decode_dots4_rows<2>(q + r0 * D, D, K, ldk, kn, S + r0 * ldS, ldS);
  else if (rt == 1) decode_dots4_rows<1>(q + r0 * D, D, K, ldk, kn, S + r0 * ldS, ldS);
}
#endif

#if defined(__AVX512BF16__)
// The same for bfloat16 q and K (bits): vdpbf16ps multiplies 32 d at a time, float32 sums.
inline void decode_dot16_bf16(const uint16_t* q, const uint16_t* K, int64_t ldk, int64_t D, float* s,
                              int64_t kn) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  if (kn == 16 && D % 32 == 0) {
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
      #pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(K + j * ldk + d));
    }
    _mm512_storeu_ps(s, reduce16(acc));
    return;
  }
  const int64_t kmax = kn - 1;
  for (int64_t d = 0; d < D; d += 32) {
    const __mmask32 md = D - d >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (D - d)) - 1u);
    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(md, q + d);
    #pragma GCC unroll 16
    for (int j = 0; j < 16; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv,
                                (__m512bh)_mm512_maskz_loadu_epi16(md, K + std::min<int64_t>(j, kmax) * ldk + d));
  }
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << kn) - 1u), reduce16(acc));
}

// V tile rows as pairs of keys for vdpbf16ps: dst[(jp * ldd + d) * 2 + e] = V[2 jp + e][d] (rows
// sn elements apart, unit stride along d), a missing last row (odd kn) as zeros -- 0 * NaN
// would otherwise leak into the sums.  Whole 32-column blocks by two permutations per pair.
inline void interleave_key_pairs(const uint16_t* src, int64_t sn, int64_t kn, int64_t Dv, uint16_t* dst,
                                 int64_t ldd) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < kn; j += 2) {
    const uint16_t* a = src + j * sn;
    const bool pair = j + 1 < kn;
    uint16_t* out = dst + (j / 2) * ldd * 2;
    int64_t d = 0;
    for (; d + 32 <= Dv; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = pair ? _mm512_loadu_si512(a + sn + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(x, hi, y));
    }
    for (; d < Dv; ++d) {
      out[2 * d] = a[d];
      out[2 * d + 1] = pair ? a[sn + d] : uint16_t(0);
    }
  }
}
#endif

#if defined(ATTNKIT_HAVE_AMX_TILES)
// The decoding kernel's own AMX tiles (GemmPath::kAmxTiles; amx_tiles.h), for groups of at most 16
// rows of bfloat16 queries, D a multiple of 32, Dv of 16, K and V with unit stride along d.  Per tile of
// keys: S^T = K Q^T on AMX, K's rows read in place by the tile loads (A operand, 16 keys x 32 d)
// against Q^T packed once per task as pairs of d (B operand); S gathered back into rows for the
// online softmax shared with the other paths; O += P V on AMX, P in bfloat16 (A operand) and V
// interleaved in key pairs (interleave_key_pairs, B operand), O read and written per 16 columns.
// Why: on the dot products (decode_dot16_bf16, micro_bf16) the decoding kernel spent ~40 ns a key
// with K and V in cache (B=1 Hq=32 Hk=8 N=1 D=128 M=256, one thread, Xeon with AMX), at the rate
// of vdpbf16ps on this machine (0.8 ns each, 32 of them a key for four rows); the tiles multiply
// a 16 x 16 x 32 block in 6-7 ns (bench/cpu_micro/amx_rates.cpp).
// Tiles:  0, 1  S^T blocks [16 keys][R] float32 (C)     2  a Q^T chunk [16 d pairs][R] (B)
//         3, 6  K blocks [16 keys][32 d] (A)             4, 5  P halves [R][32 keys] (A)
//         6     also V blocks [16 key pairs][16 dv] (B)  7  an O block [R][16 dv] float32 (C)
TileConfig decode_tile_config(int64_t R) {
  TileConfig c;
  c.set(0, 16, static_cast<int>(4 * R));
  c.set(1, 16, static_cast<int>(4 * R));
  c.set(2, 16, static_cast<int>(4 * R));
  c.set(3, 16, 64);
  c.set(4, static_cast<int>(R), 64);
  c.set(5, static_cast<int>(R), 64);
  c.set(6, 16, 64);
  c.set(7, static_cast<int>(R), 64);
  return c;
}

// Q^T as pairs of d, by groups of Rg rows: qt[(g * D / 2 + k) * Rg + r] = the k-th pair (32-bit word)
// of row g Rg + r of qb [R][D2], zero for the rows past R of the last group.
inline void pack_q_pairs_transposed(const uint16_t* qb, int64_t R, int64_t Rg, int64_t D2, int64_t D, uint32_t* qt) {
  const int64_t groups = ceil_div(R, Rg);
  std::fill(qt, qt + groups * (D / 2) * Rg, 0u);
  for (int64_t row = 0; row < R; ++row) {
    const int64_t g = row / Rg, r = row % Rg;
    const uint16_t* src = qb + row * D2;
    for (int64_t k = 0; k < D / 2; ++k) {
      uint32_t w;
      std::memcpy(&w, src + 2 * k, sizeof w);
      qt[(g * (D / 2) + k) * Rg + r] = w;
    }
  }
}

// S [rows][ldS] (first kn columns) = Q K^T for the R tile rows of one group (Q^T in qt: the group's
// part of pack_q_pairs_transposed; the first rows <= R of them written out), keys K[0, kn) (rows
// ldk elements apart), through st_buf [round_up(kn, 16)][16] (S^T) and kpad [16][D]: the last
// block's rows when kn % 16 != 0, so that a tile load of 16 rows never reads past the keys it was
// given (the zeros after them give scores that are never read).
inline void amx_decode_scores(const uint32_t* qt, int64_t R, int64_t rows, int64_t D, const uint16_t* K, int64_t ldk,
                              int64_t kn, float* st_buf, uint16_t* kpad, float* S, int64_t ldS) {
  auto block = [&](int64_t j0, int64_t& ld) -> const uint16_t* {
    if (kn - j0 >= 16) {
      ld = ldk;
      return K + j0 * ldk;
    }
    const int64_t tail = kn - j0;
    for (int64_t j = 0; j < tail; ++j) std::memcpy(kpad + j * D, K + (j0 + j) * ldk, D * sizeof(uint16_t));
    std::memset(kpad + tail * D, 0, (16 - tail) * D * sizeof(uint16_t));
    ld = D;
    return kpad;
  };
  for (int64_t j0 = 0; j0 < kn; j0 += 32) {
    const bool two = j0 + 16 < kn;
    int64_t ld0 = 0, ld1 = 0;
    const uint16_t* k0 = block(j0, ld0);
    const uint16_t* k1 = two ? block(j0 + 16, ld1) : nullptr;
    _tile_zero(0);
    if (two) _tile_zero(1);
    for (int64_t d = 0; d < D; d += 32) {
      _tile_loadd(2, qt + (d / 2) * R, static_cast<int>(4 * R));
      _tile_loadd(3, k0 + d, static_cast<int>(2 * ld0));
      _tile_dpbf16ps(0, 3, 2);
      if (two) {
        _tile_loadd(6, k1 + d, static_cast<int>(2 * ld1));
        _tile_dpbf16ps(1, 6, 2);
      }
    }
    _tile_stored(0, st_buf + j0 * 16, 64);
    if (two) _tile_stored(1, st_buf + (j0 + 16) * 16, 64);
  }
  // Rows back out of S^T: S[r][j] = st_buf[j][r], 16 keys at a time.
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(16));
  for (int64_t j0 = 0; j0 < kn; j0 += 16) {
    const __mmask16 m = kn - j0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (kn - j0)) - 1u);
    for (int64_t r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(S + r * ldS + j0, m,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, st_buf + j0 * 16 + r, 4));
  }
}

// O [R][Dv] += P V for kn <= 64 keys: P [R][ldp] bfloat16 with zeros in columns [kn, 32 * halves),
// vb [32][Dv][2] (V in key pairs, interleave_key_pairs) with zero pairs up to 16 * halves.
inline void amx_decode_pv(const uint16_t* pb, int64_t ldp, const uint16_t* vb, int64_t kn, int64_t Dv, float* O) {
  const bool two = kn > 32;
  _tile_loadd(4, pb, static_cast<int>(2 * ldp));
  if (two) _tile_loadd(5, pb + 32, static_cast<int>(2 * ldp));
  const int stride_o = static_cast<int>(4 * Dv), stride_v = static_cast<int>(4 * Dv);
  for (int64_t c = 0; c < Dv; c += 16) {
    _tile_loadd(7, O + c, stride_o);
    _tile_loadd(6, vb + 2 * c, stride_v);
    _tile_dpbf16ps(7, 4, 6);
    if (two) {
      _tile_loadd(6, vb + 2 * (16 * Dv + c), stride_v);
      _tile_dpbf16ps(7, 5, 6);
    }
    _tile_stored(7, O + c, stride_o);
  }
}
#endif

// A paged KV cache (softmax_decode_paged, issue 28): key j of batch element b is row
// j % block_size of block table[b * table_b + j / block_size] of the cache [num_blocks, Hk,
// block_size, D]; the kernel reads the rows in place, its K / V Strides4 being the cache's (.b
// steps from one block to the next).
struct KvPages {
  const int64_t* table;
  int64_t table_b;     // the table's row stride
  int64_t block_size;
};

// path (gemm_path.h, float16 / bfloat16 only): S = Q K^T and O += P V through oneDNN's brgemm on
// 16-bit Q, K, P (rounded), V -- the K tile transposed per tile, V's rows packed per tile in its B
// layout -- or the native dots / tiles below.  float32 is always native.
template <typename scalar_t>
void softmax_decode_kernel(const Problem& p, GemmPath path, bool bf16_dot, const scalar_t* q, Strides4 qs, const scalar_t* k,
                           Strides4 ks, const scalar_t* v, Strides4 vs, scalar_t* out, float* lse,
                           const KvPages* pages = nullptr) {
  const int64_t B = p.B, H = p.H, Hk = p.Hk, N = p.N, D = p.D, Dv = p.Dv;
  // Element offsets of key j's row of (b, kv head hk) in K and V: through the block table when
  // the cache is paged (ks.b / vs.b then step from block to block).
  auto k_at = [&](int64_t b, int64_t hk, int64_t j) -> int64_t {
    if (pages == nullptr) return ks.at(b, hk, j);
    return pages->table[b * pages->table_b + j / pages->block_size] * ks.b + hk * ks.h + (j % pages->block_size) * ks.n;
  };
  auto v_at = [&](int64_t b, int64_t hk, int64_t j) -> int64_t {
    if (pages == nullptr) return vs.at(b, hk, j);
    return pages->table[b * pages->table_b + j / pages->block_size] * vs.b + hk * vs.h + (j % pages->block_size) * vs.n;
  };
  const int64_t G = H / Hk, R = G * N;
  ATTNKIT_CHECK(R <= kDecodeMaxRows, "softmax_decode_kernel: ", R, " rows per task, at most ", kDecodeMaxRows,
                " expected (use_decode)");
  // Keys per tile: 64 = four vectors of columns, the P V micro-kernel's widest panel (32 KiB of
  // float32 V at D = 128, prefetched into L1 at the tile's start); 32-key tiles measured 5-20%
  // slower.
  constexpr int64_t T = 64;
  const float c = static_cast<float>(p.scale * kLog2e);
  // The keys some row sees (causality: j <= i < N; a window: its band), [Mb, Mb + Me): the
  // splits below cover those only.  None at all: every row is empty (out 0, lse -inf).
  const int64_t Mb = p.key_lo(0);
  const int64_t Me = p.key_hi(N - 1) - Mb;
  if (Me <= 0) {
    for (int64_t row = 0; row < B * H * N; ++row)
      finish_row(static_cast<const float*>(nullptr), neg_inf<float>(), 0.f, Dv, out + row * Dv, lse + row,
                 p.sink((row / N) % H));
    return;
  }
  // bfloat16 K multiplies with vdpbf16ps (Q is bfloat16 already, so exact products, float32
  // sums), as in the flash forward; everything else in float32, K read in place when it is
  // float32 with unit stride along d, else converted per tile.
  constexpr bool k16 = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;
  const bool brgemm = k16 && is_brgemm(path);
  const bool vnni = brgemm_vnni_layout(path);
  // Own AMX tiles (amx_decode_scores, amx_decode_pv) where the call fits them; otherwise the
  // native dot products below.
  const bool amx = kHaveAmxTiles && path == GemmPath::kAmxTiles && std::is_same_v<scalar_t, at::BFloat16> &&
                   D % 32 == 0 && Dv % 16 == 0 && ks.d == 1 && vs.d == 1;
  // The tiles' rows: R, or groups of 16 (the last one padded with zero rows of Q, P and O: Rp rows).
  // Per key and kv head, K and V in cache (B=4 Hq=R Hk=1 N=1 M=2048 D=128, one thread, Xeon with
  // AMX): R = 4 / 8 / 16 39 / 43 / 50 ns on the tiles against 55 / 86 / 140 ns native; R = 32 / 64
  // on the native GEMM path 246 / 452 ns.
  const int64_t Rg = R <= 16 ? R : 16, ngroups = ceil_div(R, Rg), Rp = ngroups * Rg;
  const bool k_dot = !brgemm && !amx && kHaveBf16Dot && std::is_same_v<scalar_t, at::BFloat16> && bf16_dot && ks.d == 1;
  const bool q16 = k_dot || brgemm || amx;  // Q packed in 16 bits
  // AVX2 + FMA without AVX-512: every native tile below reads K and V in place in their own
  // dtype (decode_dots_avx2, decode_pv_avx2: 16 bits widened in registers).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  constexpr bool avx2 = true;
#else
  constexpr bool avx2 = false;
#endif
  const bool k_in_place = (std::is_same_v<scalar_t, float> || (avx2 && !brgemm)) && ks.d == 1;
  const bool v_in_place = (std::is_same_v<scalar_t, float> || (avx2 && !brgemm)) && vs.d == 1;
  // bfloat16 P V with vdpbf16ps as well (P rounded to bfloat16, as the flash forward does),
  // on V rows interleaved in key pairs per tile.  Measured (B=8 Hq=32 Hk=8 N=1 D=128, one
  // thread): with K/V in cache, P V took 8.5 ns and V's float32 conversion 3.7 ns of 22 ns per
  // key in float32; the whole decode at M=2048 went 5.8-6.3 -> 4.6 ms.
  const bool v_pairs = (k_dot || amx) && vs.d == 1;
  // Scores by dot products (K rows in place) for few rows; for many, the K tile transposed once
  // and shared by a GEMM over all R rows (its cost per key is then spread over the rows, while
  // each dot product pays its horizontal sums).  Measured, dots against GEMM (B=2 Hq=32 Hk=8
  // M=4096 D=128, one thread, interleaved in one process, R = 4 N): float32 1.34-1.39x at R=4,
  // 1.17-1.25x at 8, 1.07-1.10x at 16, 0.94x at 32, 0.85x at 64; bfloat16 1.31-1.36x at 4,
  // 1.23x at 8, 0.96-1.03x at 16, 0.87x at 32, 0.75x at 64.
  const int64_t dot_max_rows = std::is_same_v<scalar_t, float> ? 16 : 8;
  bool direct = R <= dot_max_rows && !brgemm && !amx;
#if !defined(__AVX512F__)
  if (avx2) direct = R <= 16 && !brgemm;  // float32 and 16 bits alike (widened in registers)
  else direct = false;
#endif
  // bfloat16 dots (K in place): the prefetches below spread over the tile's 16-key blocks (this
  // tile's V rows into L1, the next tile's K rows into L2, 16 rows at a time, during the first
  // row's dots) instead of all at the tile's start, where perf put about half of the kernel's
  // samples on the prefetch instructions themselves (the fill buffers full).  Measured (B=8 Hq=32
  // Hk=8 N=1 D=128, Xeon with AMX, min over 2-3 s, alternated in fresh processes): M=4096 one
  // thread 19.2-20.3 -> 18.2-18.7 ms; two threads 9.0-9.5 -> 8.9-10.0 ms (better in 5 of 7
  // pairs), M=16384 38.0-40.0 -> 37.0-37.6 ms.
  [[maybe_unused]] const bool spread_here = direct && k_dot && ks.d == 1 && vs.d == 1;
  // 16-bit K and V without the dot products (float16; bfloat16 under ATTNKIT_CPU_BF16=float32),
  // unit stride, few rows (direct): read in place and widened in registers (AVX-512BW) by the
  // dots and by O += P V (decode_pv_widen), instead of converted into float32 rows per tile.
  // B=8 Hq=32 Hk=8 N=1 M=4096 D=128, 2 threads, Xeon (model 207, no AMX), `bench/softmax_cpu_speed.py
  // decode` (session 26): float16 11.57 -> 9.63 ms (2.90x -> 3.44x SDPA); bfloat16 under
  // float32 12.02 -> 9.90 ms, then behind its dot products (9.43 ms).  With the scores 4 rows x 4
  // keys at a time (decode_dots4, session 27): bfloat16 8.05 ms against the dot products' 9.87 ms,
  // so auto widens bfloat16 here too except on AMD (gemm_path.h cpu_bf16_dot_products).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const bool k_widen = direct && k16 && !k_dot && !brgemm && !amx && ks.d == 1;
  const bool v_widen = direct && k16 && !v_pairs && !brgemm && !amx && vs.d == 1;
#else
  constexpr bool k_widen = false, v_widen = false;
#endif
  // Q's row length and K's packed depth: even (a bf16 pair), for brgemm a multiple of 32, zeros
  // past D in both operands: the K of S = Q K^T is zero-padded against oneDNN's AMX K-tail defect
  // (a NaN of row i + 1 of the left operand written into row i when K > 32, K % 32 != 0;
  // DESIGN.md), as in the flash forward.
  const int64_t D2 = round_up(D, brgemm ? 32 : 2);
  const int64_t Dvp = round_up(Dv, 16);

  // Splits of the keys: enough tasks for the threads (4 per thread for the dynamic balance),
  // each at least 512 keys (a split's fixed cost -- Q packing, the merge -- stays small).
  const int64_t pairs = B * Hk;
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  if (pairs < 4 * threads)
    splits = std::max<int64_t>(1, std::min(ceil_div(4 * threads, pairs), Me / 512));
  const int64_t span = round_up(ceil_div(Me, splits), T);
  splits = ceil_div(Me, span);
  // Partial results of every split, merged below (none when each pair is one task).
  avec<float> part_m, part_l, part_o;
  if (splits > 1) {
    part_m.resize(static_cast<size_t>(pairs * splits * R));
    part_l.resize(static_cast<size_t>(pairs * splits * R));
    part_o.resize(static_cast<size_t>(pairs * splits * R * Dv));
  }

  run_tasks(
      pairs * splits,
      [&] {
        DecodeScratch st;
        if (q16) {
          st.qb.assign(static_cast<size_t>(R * D2), 0);  // an odd D's pad stays zero
          if (!direct && !amx) st.kb.assign(static_cast<size_t>(D2 * T), 0);
          if (brgemm) {
            st.pb.resize(static_cast<size_t>(R * T));
            st.vb.assign(static_cast<size_t>(T * Dvp), 0);
            st.release = BrgemmRelease(path);
          }
        } else {
          st.q.resize(static_cast<size_t>(R * D));
          if (!direct) st.kt.assign(static_cast<size_t>(D * T), 0.f);
          else if (!k_in_place) st.kf.resize(static_cast<size_t>(T * D));
        }
        if (v_pairs) {
          st.pb.assign(static_cast<size_t>((amx ? Rp : R) * T), 0);  // the padding rows stay zero
          st.vb.assign(static_cast<size_t>(T * Dvp), 0);  // columns past Dv stay zero
        } else if (!v_in_place && !brgemm) {
          st.vf.resize(static_cast<size_t>(T * Dv));
        }
#if defined(ATTNKIT_HAVE_AMX_TILES)
        if (amx) {
          st.qt.resize(static_cast<size_t>(ngroups * (D / 2) * Rg));
          st.st.resize(static_cast<size_t>(T * 16));
          st.kpad.resize(static_cast<size_t>(16 * D));
          st.tiles = AmxTileScope(decode_tile_config(Rg));
        }
#endif
        st.s.resize(static_cast<size_t>(R * T));
        st.o.resize(static_cast<size_t>((amx ? Rp : R) * Dv));
        st.m.resize(R);
        st.l.resize(R);
        return st;
      },
      [&](DecodeScratch& st, int64_t t) {
        const int64_t split = t % splits, pair = t / splits;
        const int64_t b = pair / Hk, hk = pair % Hk;
        const int64_t j_begin = Mb + split * span, j_end = Mb + std::min(Me, split * span + span);
        // Row r = g * N + i is query row i of head hk * G + g.
        for (int64_t r = 0; r < R; ++r) {
          const scalar_t* src = q + qs.at(b, hk * G + r / N, r % N);
          if (q16) {
            if constexpr (k16) pack_rows16(src, 0, qs.d, 1, D, st.qb.data() + r * D2, D2, false, 1);
          } else {
            convert_row(src, qs.d, D, st.q.data() + r * D);
          }
        }
#if defined(ATTNKIT_HAVE_AMX_TILES)
        if (amx) pack_q_pairs_transposed(st.qb.data(), R, Rg, D2, D, st.qt.data());
#endif
        std::fill(st.o.begin(), st.o.end(), 0.f);
        std::fill(st.m.begin(), st.m.end(), neg_inf<float>());
        std::fill(st.l.begin(), st.l.end(), 0.f);
        float* S = st.s.data();
        // The tile's K rows as float32 for the dot products: in place, or converted into st.kf.
        [[maybe_unused]] auto k_rows_f32 = [&](int64_t k0, int64_t kn, int64_t& ldk) -> const float* {
          if (std::is_same_v<scalar_t, float> && k_in_place) {
            ldk = ks.n;
            return reinterpret_cast<const float*>(k + k_at(b, hk, k0));
          }
          for (int64_t jj = 0; jj < kn; ++jj)
            convert_row(k + k_at(b, hk, k0 + jj), ks.d, D, st.kf.data() + jj * D);
          ldk = D;
          return st.kf.data();
        };
        // Tiles of T keys -- in a paged cache cut at the blocks' ends too, so that a tile's rows
        // lie ks.n / vs.n apart as in a dense one (blocks of fewer than T keys give shorter tiles).
        for (int64_t k0 = j_begin, kn = 0; k0 < j_end; k0 += kn) {
          kn = std::min(T, j_end - k0);
          if (pages != nullptr) kn = std::min(kn, pages->block_size - k0 % pages->block_size);
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
          // AVX2 + FMA (every dtype: K and V are read in place): the next tile's K and V rows
          // into L2 at this tile's start (prefetcht1; this tile's were asked for one tile ago).  Measured (B=8 Hq=32 Hk=8 N=1
          // M=4096 D=128 float32, AMD EPYC Zen 3, machine shared with a CI run, interleaved in one
          // process, see bench/softmax_cpu_speed.py decode): with the dot-product scores 1.08-1.16x
          // at 2 threads, 1.15-1.3x at one, over the transposed-tile GEMM without prefetch; the
          // dots alone, no prefetch: 0.98-1.05x.  Tried, no faster: this tile's V into L1 at its
          // start (as on AVX-512), K and V prefetched 8-256 keys ahead spread over the score
          // blocks (into L1 or L2), the next tile's V only before P V, prefetchnta, 32-key tiles
          // (the same as 64), P V in groups of 4-32 keys (V read row-block by row-block).  With
          // the 12-accumulator tiles (AMD EPYC Zen 3, M=16384 float32, 2 threads, interleaved,
          // quiet; the spread of one setting between runs 5-10%): no prefetch 79-91 ms against
          // 76-87 ms with it; K 16 keys ahead into L1 and V of the same keys into L2, spread over
          // the score blocks, 68-79 ms (better in two runs of three: not kept); 16- and 32-key
          // tiles; P V over 4-16 keys at a time for all columns (V read in address order): all
          // within the noise.  Huge pages (THP_MEM_ALLOC_ENABLE=1) the same.  The call reads
          // K and V at 14-15 GB/s, where torch.sum reads at 25-31: each thread stalls on memory
          // for ~75% of the time (one thread: 150 ns a key, 35-55 ns of it compute).
          {
            for (int64_t jj = k0 + T; jj < std::min(j_end, k0 + 2 * T); ++jj) {
              const char* row = reinterpret_cast<const char*>(k + k_at(b, hk, jj));
              for (int64_t x = 0; x < D * ks.d * int64_t(sizeof(scalar_t)); x += 64)
                _mm_prefetch(row + x, _MM_HINT_T1);
              row = reinterpret_cast<const char*>(v + v_at(b, hk, jj));
              for (int64_t x = 0; x < Dv * vs.d * int64_t(sizeof(scalar_t)); x += 64)
                _mm_prefetch(row + x, _MM_HINT_T1);
            }
          }
#endif
#if defined(__AVX512F__)
          // Software prefetch: this tile's V (read after the scores) into L1, the next tile's K
          // into L2.  Measured (B=8 Hq=32 Hk=8 N=1 M=4096 D=128 float32, one thread, with the
          // dot-product scores): 13.3 ms with both, 13.1-18.1 ms with V alone, 18.0 ms with K
          // alone and with none (V into L2 a tile or more ahead instead: 15-16 ms).
          // The own AMX tiles: K and V rows of the tile two ahead into L2 / L3 (prefetcht2), none into
          // L1.  Measured (B=8 Hq=32 Hk=8 N=1 D=128 bfloat16, 2 threads, Xeon with AMX, variants
          // alternated in one process, `bench/softmax_cpu_speed.py decode`, four runs): M=4096 5.53-5.63
          // ms against 6.57-7.04 ms with the native kernel's prefetches (this tile's V into L1, the next
          // tile's K into L2), 5.61-5.79 ms with none; M=16384 28.6-33.9 against 32.3-34.7 ms (none:
          // 28.5-36.1).  prefetcht2 4, 8 or 16 tiles ahead, or K and V one tile ahead into L2: no better.
          if (amx) {
            for (int64_t jj = k0 + 2 * T; jj < std::min(j_end, k0 + 3 * T); ++jj) {
              const char* krow = reinterpret_cast<const char*>(k + k_at(b, hk, jj));
              const char* vrow = reinterpret_cast<const char*>(v + v_at(b, hk, jj));
              for (int64_t x = 0; x < D * 2; x += 64) _mm_prefetch(krow + x, _MM_HINT_T2);
              for (int64_t x = 0; x < Dv * 2; x += 64) _mm_prefetch(vrow + x, _MM_HINT_T2);
            }
          }
          if (!spread_here && !amx) for (int64_t jj = 0; jj < kn; ++jj) {
            const char* row = reinterpret_cast<const char*>(v + v_at(b, hk, k0 + jj));
            for (int64_t x = 0; x < Dv * vs.d * int64_t(sizeof(scalar_t)); x += 64)
              _mm_prefetch(row + x, _MM_HINT_T0);
          }
          if (!spread_here && !amx) for (int64_t jj = k0 + T; jj < std::min(j_end, k0 + 2 * T); ++jj) {
            const char* row = reinterpret_cast<const char*>(k + k_at(b, hk, jj));
            for (int64_t x = 0; x < D * ks.d * int64_t(sizeof(scalar_t)); x += 64)
              _mm_prefetch(row + x, _MM_HINT_T1);
          }
#endif
          // S [R][kn] = Q K^T.
          if (brgemm) {
            // K = D2: zero-padded (K^T's rows past D are never written).
            if constexpr (k16) {
              pack_transposed_pairs(k + k_at(b, hk, k0), ks.n, ks.d, kn, D, st.kb.data(), T, vnni);
              brgemm16<scalar_t>(R, kn, D2, D2, T, T, false, st.qb.data(), st.kb.data(), S, path);
            }
          } else if (amx) {
#if defined(ATTNKIT_HAVE_AMX_TILES)
            for (int64_t g = 0; g < ngroups; ++g)
              amx_decode_scores(st.qt.data() + g * (D / 2) * Rg, Rg, std::min(Rg, R - g * Rg), D,
                                reinterpret_cast<const uint16_t*>(k + k_at(b, hk, k0)), ks.n, kn, st.st.data(),
                                st.kpad.data(), S + g * Rg * T, T);
#endif
          } else if (!direct) {
            if (k_dot) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
                pack_transposed_pairs(k + k_at(b, hk, k0), ks.n, ks.d, kn, D, st.kb.data(), T);
                gemm_bf16(R, kn, D, st.qb.data(), D2, st.kb.data(), T * 2, S, T, false);
              }
#endif
            } else {
              pack_transposed(k + k_at(b, hk, k0), ks.n, ks.d, kn, D, st.kt.data(), T);
              gemm<float>(R, kn, D, st.q.data(), D, 1, st.kt.data(), T, S, T, false);
            }
          }
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
          else if constexpr (avx2) {
            if (k_in_place) {
              decode_dots_avx2(st.q.data(), R, D, k + k_at(b, hk, k0), ks.n, kn, S, T);
            } else {
              int64_t ldk;
              const float* kt = k_rows_f32(k0, kn, ldk);
              decode_dots_avx2(st.q.data(), R, D, kt, ldk, kn, S, T);
            }
          }
#endif
#if defined(__AVX512F__)
          else if (k_dot) {
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
              const uint16_t* kt = reinterpret_cast<const uint16_t*>(k + k_at(b, hk, k0));
              for (int64_t r = 0; r < R; ++r)
                for (int64_t j0 = 0; j0 < kn; j0 += 16) {
                  if (spread_here && r == 0) {
                    for (int64_t jj = j0; jj < std::min(kn, j0 + 16); ++jj) {
                      const char* row = reinterpret_cast<const char*>(v + v_at(b, hk, k0 + jj));
                      for (int64_t x = 0; x < Dv * 2; x += 64) _mm_prefetch(row + x, _MM_HINT_T0);
                    }
                    for (int64_t jj = k0 + T + j0; jj < std::min(j_end, k0 + T + j0 + 16); ++jj) {
                      const char* row = reinterpret_cast<const char*>(k + k_at(b, hk, jj));
                      for (int64_t x = 0; x < D * 2; x += 64) _mm_prefetch(row + x, _MM_HINT_T1);
                    }
                  }
                  decode_dot16_bf16(st.qb.data() + r * D2, kt + j0 * ks.n, ks.n, D, S + r * T + j0,
                                    std::min<int64_t>(16, kn - j0));
                }
            }
#endif
          } else if (k_widen) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
            if constexpr (k16) {
              decode_dots4(st.q.data(), R, D, k + k_at(b, hk, k0), ks.n, kn, S, T);
            }
#endif
          } else {
            int64_t ldk;
            const float* kt = k_rows_f32(k0, kn, ldk);
            decode_dots4(st.q.data(), R, D, kt, ldk, kn, S, T);
          }
#endif
          // Online softmax, as in the flash forward (NaN rules in flash_tiles.h), in its three
          // passes over the rows: ranges, score options and maxima; every row's rescale factor
          // at once (exp2_diff); P, sums, (m, l, o).
          int64_t row_lo[kDecodeMaxRows], row_hi[kDecodeMaxRows];
          float row_mx[kDecodeMaxRows], row_alpha[kDecodeMaxRows];
          for (int64_t r = 0; r < R; ++r) {
            float* s = S + r * T;
            const int64_t i = r % N, h = hk * G + r / N;
            int64_t& lo = row_lo[r];
            int64_t& hi = row_hi[r];
            p.tile_range(i, k0, kn, lo, hi);
            prepare_row<float>(s, kn, lo, hi, c, p, b, h, i, k0);
            row_mx[r] = hi > lo ? max_nan(st.m[r], row_max(s + lo, hi - lo)) : st.m[r];
          }
          exp2_diff(st.m.data(), row_mx, row_alpha, R);
          for (int64_t r = 0; r < R; ++r) {
            float* s = S + r * T;
            const int64_t lo = row_lo[r], hi = row_hi[r];
            const float mx = row_mx[r];
            if (mx == neg_inf<float>() || hi == lo) {
              if (hi > lo && has_nan(s + lo, hi - lo)) {
                st.m[r] = st.l[r] = std::numeric_limits<float>::quiet_NaN();
                std::fill(st.o.data() + r * Dv, st.o.data() + (r + 1) * Dv, st.m[r]);
              }
              std::fill(s, s + kn, 0.f);
            } else {
              const float alpha = row_alpha[r];
              const float sum = exp2_sub_sum(s + lo, hi - lo, mx);
              std::fill(s, s + lo, 0.f);
              std::fill(s + hi, s + kn, 0.f);
              if (alpha != 1.f) {
                float* o = st.o.data() + r * Dv;
                for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
              }
              st.l[r] = st.l[r] * alpha + sum;
              st.m[r] = mx;
            }
          }
          // O [R][Dv] += P V.
          if (brgemm) {
            // P rounded to 16 bits, zero up to an even count; V's rows [kn, kn2) zeroed (an
            // earlier, longer tile's rows may lie there).  A row whose l is NaN is NaN already
            // and gets P = 0 (its P would be NaN: exp2(s - NaN), or inf - inf): no NaN in the
            // left operand for oneDNN's K-tail defect (above) to move into the row before it.
            if constexpr (k16) {
              const int64_t kn2 = vnni ? round_up(kn, 2) : kn;
              for (int64_t r = 0; r < R; ++r) {
                if (std::isnan(st.l[r])) std::fill(S + r * T, S + r * T + kn, 0.f);
                to_bits16<scalar_t>(S + r * T, kn, st.pb.data() + r * T, kn2);
              }
              pack_rows16(v + v_at(b, hk, k0), vs.n, vs.d, kn, Dv, st.vb.data(), Dvp, vnni, kn2);
              brgemm16<scalar_t>(R, Dv, kn2, T, Dvp, Dv, true, st.pb.data(), st.vb.data(), st.o.data(), path);
            }
            continue;
          }
#if defined(__AVX512BF16__)
          if (v_pairs) {
            if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
              // The AMX tiles read P and V's pairs in whole halves of 32 keys: zeros past kn there.
              const int64_t width = amx ? round_up(kn, 32) : round_up(kn, 2);
              for (int64_t r = 0; r < R; ++r) to_bf16(S + r * T, kn, st.pb.data() + r * T, width);
              interleave_key_pairs(reinterpret_cast<const uint16_t*>(v + v_at(b, hk, k0)), vs.n, kn, Dv,
                                   st.vb.data(), Dvp);
              if (amx) {
#if defined(ATTNKIT_HAVE_AMX_TILES)
                std::fill(st.vb.data() + round_up(kn, 2) * Dvp, st.vb.data() + width * Dvp, uint16_t(0));
                for (int64_t g = 0; g < ngroups; ++g)
                  amx_decode_pv(st.pb.data() + g * Rg * T, T, st.vb.data(), kn, Dv, st.o.data() + g * Rg * Dv);
#endif
              } else {
                gemm_bf16(R, Dv, kn, st.pb.data(), T, st.vb.data(), Dvp * 2, st.o.data(), Dv, true);
              }
            }
            continue;
          }
#endif
          // O [R][Dv] += P V.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
          if (v_in_place) {
            decode_pv_avx2(R, kn, S, T, v + v_at(b, hk, k0), vs.n, st.o.data(), Dv);
            continue;
          }
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
          if (v_widen) {
            if constexpr (k16) decode_pv_widen(R, kn, S, T, v + v_at(b, hk, k0), vs.n, st.o.data(), Dv);
            continue;
          }
#endif
          const float* Vt;
          int64_t ldv;
          if (v_in_place) {
            Vt = reinterpret_cast<const float*>(v + v_at(b, hk, k0));
            ldv = vs.n;
          } else {
            for (int64_t jj = 0; jj < kn; ++jj)
              convert_row(v + v_at(b, hk, k0 + jj), vs.d, Dv, st.vf.data() + jj * Dv);
            Vt = st.vf.data();
            ldv = Dv;
          }
          gemm<float>(R, Dv, kn, S, T, 1, Vt, ldv, st.o.data(), Dv, true);
        }
        if (splits == 1) {
          for (int64_t r = 0; r < R; ++r) {
            const int64_t row = (b * H + hk * G + r / N) * N + r % N;
            finish_row(st.o.data() + r * Dv, st.m[r], st.l[r], Dv, out + row * Dv, lse + row, p.sink(hk * G + r / N));
          }
        } else {
          std::copy(st.m.begin(), st.m.end(), part_m.begin() + t * R);
          std::copy(st.l.begin(), st.l.end(), part_l.begin() + t * R);
          std::copy(st.o.begin(), st.o.begin() + R * Dv, part_o.begin() + t * R * Dv);
        }
      });

  if (splits > 1) {
    // Merge the splits of each row: weights 2^(m_s - max), splits that saw no key skipped; a
    // NaN in any split (l_s NaN) makes the row NaN.
    at::parallel_for(0, pairs * R, 16, [&](int64_t begin, int64_t end) {
      avec<float> o(static_cast<size_t>(Dv));
      for (int64_t x = begin; x < end; ++x) {
        const int64_t pair = x / R, r = x % R;
        float mx = neg_inf<float>();
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t idx = (pair * splits + sp) * R + r;
          if (part_l[idx] != 0.f) mx = max_nan(mx, part_m[idx]);
        }
        float l = 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t idx = (pair * splits + sp) * R + r;
          if (part_l[idx] == 0.f) continue;
          const float w = std::exp2(part_m[idx] - mx);
          l += w * part_l[idx];
          const float* os = part_o.data() + idx * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += w * os[d];
        }
        const int64_t b = pair / Hk, hk = pair % Hk;
        const int64_t row = (b * H + hk * G + r / N) * N + r % N;
        finish_row(o.data(), mx, l, Dv, out + row * Dv, lse + row, p.sink(hk * G + r / N));
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Backward (accumulation type acc_t; inputs converted while packing).
// ---------------------------------------------------------------------------------------------
// BQb x BKb: the backward's tile (softmax_bwd_kernel).
template <typename acc_t>
struct BwdScratch {
  avec<acc_t> kt, vt;          // [D][BKb], [Dv][BKb]: K^T, V^T of the key block
  avec<acc_t> kr;              // [BKb][D]: K rows
  avec<acc_t> dk, dv;          // [BKb][D], [BKb][Dv]
  avec<acc_t> q, dout;         // [BQb][D], [BQb][Dv]
  avec<acc_t> s, dp;           // [BQb][BKb]
  avec<acc_t> dcap;            // [BQb][BKb]: softcap's 1 - tanh^2 (softcap only)
  // [BQb]: each row's keys [lo, hi) in the key tile (causality and the window), for dS
  std::array<int64_t, kBQMax> lo{}, hi{};
  // brgemm (16-bit operands, Element (k, n) of a B operand at b16_index(k, n, ld, pairs)):
  // A operands: Q rows [BQb][D2], dO rows [BQb][Dv2], P^T and dS^T [BKb][BQb], dS [BQb][BKb];
  // B operands: K^T [D2][BKb], V^T [Dv2][BKb], K rows [BKb][Dp], Q rows [BQb][Dp], dO rows
  // [BQb][Dvp].
  avec<uint16_t> qa, doa, pt, dst, ds, ktb, vtb, krb, qb, dob;
  // The float16 split (split16.h): qa, doa rows [hi | hif | lo | lo] (4 D2, 4 Dv2); ktb, vtb depth
  // [hi; lo; hif; lo]; krb, qb, dob the (hi, lo) pairs per row (depth 2 x rows) and krf, qbf, dobf
  // the hif rows; pt, dst, ds the (hi, hif) pairs of P^T, dS^T, dS (rows of 2 BQb, 2 BQb, 2 BKb)
  // and ptlo, dstlo, dslo their lo; tr a float tile transposed ([BKb][BQb]); split16 the hi / lo /
  // hif rows before packing.
  avec<uint16_t> krf, qbf, dobf, ptlo, dstlo, dslo, split16;
  avec<acc_t> tr;
  BrgemmRelease release;       // the thread's brgemm state, released when the worker ends
};

// path (gemm_path.h, float16 / bfloat16 only): the five tile GEMMs through oneDNN's brgemm on
// 16-bit operands (Q, K, V, dO as given; P and dS rounded to the dtype, as flash backward kernels
// on AMX do) with float32 sums, or native: float32 (float64) tiles.  Only the packing and the
// GEMM calls differ.
template <typename scalar_t, typename acc_t>
void softmax_bwd_kernel(const Problem& p, GemmPath path, const scalar_t* dout, Strides4 dos, const scalar_t* q,
                        Strides4 qs, const scalar_t* k, Strides4 ks, const scalar_t* v,
                        Strides4 vs, const scalar_t* out, Strides4 os, const acc_t* lse,
                        Strides4 ls /* b, h, n used */, scalar_t* dq, scalar_t* dk, scalar_t* dv) {
  const int64_t B = p.B, H = p.H, Hk = p.Hk, N = p.N, M = p.M, D = p.D, Dv = p.Dv;
  const int64_t G = H / Hk;
  const acc_t c = static_cast<acc_t>(p.scale * kLog2e);
  const acc_t scale = static_cast<acc_t>(p.scale);
  const bool softcap = p.softcap > 0.0;
  constexpr bool k16 = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;
  const bool brgemm = k16 && path != GemmPath::kNative;
  const bool pairs = brgemm_vnni_layout(path);
  // float16 as bfloat16 pairs on brgemm (split16.h): S and dP in one product each of depth 4 D2 /
  // 4 Dv2; dV += P^T dO, dK += dS^T Q, dQ += dS K in two each, P and dS kept to 16 bits.
  const bool split = std::is_same_v<scalar_t, at::Half> && is_split(path);
  // Tiles of BQb query rows x BKb keys: 128 x 128 on brgemm (its calls' fixed cost and the
  // per-key-block packing of Q and dO spread over twice the work each way), 64 x 64 on the native
  // tiles.  bfloat16 forward+backward, B=1 H=8, one thread, Xeon with AMX, min of ~100 calls,
  // builds alternated: N=1024 D=128 38.7-43.5 -> 33.1-34.4 ms (64 x 128 and 64 x 256: 36.8-37.9;
  // 256 x 128: 33.7-33.9), N=256 D=128 3.03 -> 2.71-2.76 ms, N=1024 D=64 causal 15.1-16.8 ->
  // 13.9 ms, N=4096 D=64 causal 205-213 -> 181-186 ms.  float32 (native) at 128 x 128: within
  // 1-3% either way, so the native tiles keep the size measured on AMD EPYC.
  const int64_t BQb = brgemm ? 128 : kBQb, BKb = brgemm ? 128 : kBKb;
  // Every brgemm's K (reduction) dimension is zero-padded to a multiple of 32, zeros in both
  // operands: torch 2.13's bundled oneDNN, on AMX, writes a NaN of row i + 1 of the left operand
  // into output row i when K > 32 and K % 32 != 0 (DESIGN.md), and here every left operand may
  // hold a NaN (NaN inputs; P and dS of a row the forward found NaN).  D and Dv: D2, Dv2; the
  // query rows of a block (K of dV, dK): qn2; the keys of a block (K of dQ): kn2.
  const int64_t D2 = round_up(D, 32), Dv2 = round_up(Dv, 32);
  const int64_t Dp = round_up(D, 16), Dvp = round_up(Dv, 16);
  const int64_t DS = split ? 4 * D2 : D2, DvS = split ? 4 * Dv2 : Dv2;  // the depths of S and dP

  // Di = rowsum(dO o O), and lse in base 2 (-inf kept), both [B*H*N].  The rows are converted to
  // acc_t a chunk at a time and summed in kLanes independent partial sums: one chain of dependent
  // scalar FMAs per row (Dv x 4 cycles of latency, with a scalar conversion each) was ~5% of a
  // bfloat16 forward+backward (B=1 H=8 N=1024 D=128, one thread, perf, Xeon with AMX, session 18).
  avec<acc_t> Di(static_cast<size_t>(B * H * N)), L2(static_cast<size_t>(B * H * N));
  at::parallel_for(0, B * H * N, 256, [&](int64_t begin, int64_t end) {
    constexpr int64_t kChunk = 256, kLanes = 16;
    alignas(64) acc_t ob[kChunk], gb[kChunk];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (H * N), h = (row / N) % H, i = row % N;
      const scalar_t* o = out + os.at(b, h, i);
      const scalar_t* g = dout + dos.at(b, h, i);
      acc_t part[kLanes] = {};
      for (int64_t d0 = 0; d0 < Dv; d0 += kChunk) {
        const int64_t n = std::min(kChunk, Dv - d0);
        convert_row(o + d0 * os.d, os.d, n, ob);
        convert_row(g + d0 * dos.d, dos.d, n, gb);
        const int64_t n_full = n / kLanes * kLanes;
        for (int64_t d = 0; d < n_full; d += kLanes)
          for (int64_t x = 0; x < kLanes; ++x) part[x] += ob[d + x] * gb[d + x];
        for (int64_t d = n_full; d < n; ++d) part[d - n_full] += ob[d] * gb[d];
      }
      acc_t sum = 0;
      for (int64_t x = 0; x < kLanes; ++x) sum += part[x];
      Di[row] = sum;
      L2[row] = lse[ls.at(b, h, i)] * static_cast<acc_t>(kLog2e);
    }
  });

  const int64_t nkb = ceil_div(M, BKb);
  const int64_t threads = at::get_num_threads();
  // Chunks of key blocks per kv head: 1 unless there are too few (b, kv-head) pairs to keep
  // every thread busy; each extra chunk costs a dQ partial buffer.
  int64_t chunks = 1;
  if (B * Hk < 4 * threads && (B * Hk) % threads != 0) chunks = std::min(nkb, threads);
  const bool direct = chunks == 1 && std::is_same_v<scalar_t, acc_t>;
  avec<acc_t> dq_partial;
  acc_t* dq_acc;
  if (direct) {
    dq_acc = reinterpret_cast<acc_t*>(dq);
    std::fill(dq_acc, dq_acc + B * H * N * D, acc_t(0));
  } else {
    dq_partial.assign(static_cast<size_t>(chunks * B * H * N * D), acc_t(0));
    dq_acc = dq_partial.data();
  }

  // `rows` rows of `cols` (sn, sd apart) as acc_t rows: read in place (acc_t, dense rows; ld =
  // sn) or converted into buf (ld = cols).  Rows further apart are copied, as the forward copies
  // V's (softmax_fwd_kernel): FlashAttention's [B, N, H, D] layout puts them H * D apart.
  const auto acc_rows = [](const scalar_t* src, int64_t sn, int64_t sd, int64_t rows, int64_t cols,
                           acc_t* buf, int64_t& ld) -> const acc_t* {
    if (std::is_same_v<scalar_t, acc_t> && sd == 1 && sn == cols) {
      ld = sn;
      return reinterpret_cast<const acc_t*>(src);
    }
    for (int64_t r = 0; r < rows; ++r) convert_row(src + r * sn, sd, cols, buf + r * cols);
    ld = cols;
    return buf;
  };
  run_tasks(
      B * Hk * chunks,
      [&] {
        BwdScratch<acc_t> st;
        if (brgemm) {
          // Zero-filled: the padding columns [D, D2) of Q's / dO's rows and the padding rows of
          // K^T / V^T are never written.
          const int64_t x = split ? 2 : 1;  // the split's (hi, lo) pairs: twice the depth
          st.qa.resize(static_cast<size_t>(BQb * DS));
          st.doa.resize(static_cast<size_t>(BQb * DvS));
          st.pt.resize(static_cast<size_t>(BKb * BQb * x));
          st.dst.resize(static_cast<size_t>(BKb * BQb * x));
          st.ds.resize(static_cast<size_t>(BQb * BKb * x));
          st.ktb.resize(static_cast<size_t>(DS * BKb));
          st.vtb.resize(static_cast<size_t>(DvS * BKb));
          st.krb.resize(static_cast<size_t>(BKb * Dp * x));
          st.qb.resize(static_cast<size_t>(BQb * Dp * x));
          st.dob.resize(static_cast<size_t>(BQb * Dvp * x));
          if (split) {
            st.krf.resize(static_cast<size_t>(BKb * Dp));
            st.qbf.resize(static_cast<size_t>(BQb * Dp));
            st.dobf.resize(static_cast<size_t>(BQb * Dvp));
            st.ptlo.resize(static_cast<size_t>(BKb * BQb));
            st.dstlo.resize(static_cast<size_t>(BKb * BQb));
            st.dslo.resize(static_cast<size_t>(BQb * BKb));
            st.tr.resize(static_cast<size_t>(BKb * BQb));
            st.split16.resize(static_cast<size_t>(4 * std::max(BKb, BQb) * std::max(D, Dv)));
          }
          st.release = BrgemmRelease(path);
        } else {
          st.kt.resize(static_cast<size_t>(D * BKb));
          st.vt.resize(static_cast<size_t>(Dv * BKb));
          st.kr.resize(static_cast<size_t>(BKb * D));
          st.q.resize(static_cast<size_t>(BQb * D));
          st.dout.resize(static_cast<size_t>(BQb * Dv));
        }
        st.dk.resize(static_cast<size_t>(BKb * D));
        st.dv.resize(static_cast<size_t>(BKb * Dv));
        st.s.resize(static_cast<size_t>(BQb * BKb));
        st.dp.resize(static_cast<size_t>(BQb * BKb));
        if (softcap) st.dcap.resize(static_cast<size_t>(BQb * BKb));
        return st;
      },
      [&](BwdScratch<acc_t>& st, int64_t t) {
        const int64_t chunk = t % chunks;
        const int64_t bk = t / chunks;
        const int64_t b = bk / Hk, hk = bk % Hk;
        acc_t* dq_c = dq_acc + chunk * B * H * N * D;
        for (int64_t kb = chunk; kb < nkb; kb += chunks) {
          const int64_t k0 = kb * BKb;
          const int64_t kn = std::min(BKb, M - k0);
          const int64_t kn2 = round_up(kn, 32);
          // The query rows that see a key of this block (causality: i >= k0; a window: its band).
          const int64_t i_begin = p.row_lo(k0), i_end = p.row_hi(k0 + kn);
          if (i_begin >= i_end) {  // none: zero gradients
            for (int64_t jj = 0; jj < kn; ++jj) {
              const int64_t row = (b * Hk + hk) * M + k0 + jj;
              std::fill(dk + row * D, dk + (row + 1) * D, static_cast<scalar_t>(0));
              std::fill(dv + row * Dv, dv + (row + 1) * Dv, static_cast<scalar_t>(0));
            }
            continue;
          }
          // Pack this key block: K^T, V^T (16 x 16 register transposes for float32 rows; the
          // GEMMs read kn columns, so the padding is never touched), and K rows unless float32
          // K is read in place.  Measured at B=4 H=8 N=16 D=64 (one thread), backward op: the
          // scalar pack, zero-filled K^T / V^T and Q / dO copies per key block took 88 us.
          const acc_t* Kr = st.kr.data();
          int64_t ldkr = D;
          if (split) {
            // K^T, V^T of depth 4 D2 / 4 Dv2; K's (hi, lo) pairs and hif rows (rows [kn, kn2) zero).
            if constexpr (std::is_same_v<scalar_t, at::Half>) {
              pack_split_transposed4(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D, D2, st.split16.data(), st.ktb.data(),
                                     BKb);
              pack_split_transposed4(v + vs.at(b, hk, k0), vs.n, vs.d, kn, Dv, Dv2, st.split16.data(),
                                     st.vtb.data(), BKb);
              pack_split_pairs(k + ks.at(b, hk, k0), ks.n, ks.d, kn, kn2, D, st.split16.data(), st.krb.data(),
                               st.krf.data(), Dp);
            }
          } else if (brgemm) {
            // 16-bit K^T, V^T (B of S and dP; the GEMMs read kn columns) and K rows (B of dQ,
            // rows [kn, kn2) zeroed: the K tail).
            if constexpr (k16) {
              pack_transposed_pairs(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D, st.ktb.data(), BKb, pairs);
              pack_transposed_pairs(v + vs.at(b, hk, k0), vs.n, vs.d, kn, Dv, st.vtb.data(), BKb, pairs);
              pack_rows16(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D, st.krb.data(), Dp, pairs, kn2);
            }
          } else {
            pack_transposed(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D, st.kt.data(), BKb);
            pack_transposed(v + vs.at(b, hk, k0), vs.n, vs.d, kn, Dv, st.vt.data(), BKb);
            Kr = acc_rows(k + ks.at(b, hk, k0), ks.n, ks.d, kn, D, st.kr.data(), ldkr);
          }
          std::fill(st.dk.begin(), st.dk.begin() + kn * D, acc_t(0));
          std::fill(st.dv.begin(), st.dv.begin() + kn * Dv, acc_t(0));
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            for (int64_t q0 = i_begin; q0 < i_end; q0 += BQb) {
              const int64_t qn = std::min(BQb, i_end - q0);
              const int64_t qn2 = round_up(qn, 32);
              const int64_t row0 = (b * H + h) * N + q0;
              // Q and dO rows: read in place (float32, unit stride along D) or converted; brgemm:
              // 16-bit, as A operands (rows of D2 / Dv2) and as B operands (rows [qn, qn2) zeroed).
              const acc_t* Qr = st.q.data();
              const acc_t* dOr = st.dout.data();
              int64_t ldq = D, lddo = Dv;
              // As A operands, rows of a multiple of 32 with unit stride are read in place (the
              // copies were 5.6% of a bfloat16 forward+backward, N=1024 D=128, one thread, perf,
              // Xeon with AMX).
              const uint16_t* Qa = st.qa.data();
              const uint16_t* dOa = st.doa.data();
              int64_t lda_q = D2, lda_do = Dv2;
              if (split) {
                if constexpr (std::is_same_v<scalar_t, at::Half>) {
                  pack_split_rows4(q + qs.at(b, h, q0), qs.n, qs.d, qn, D, D2, st.split16.data(), st.qa.data(), DS);
                  pack_split_pairs(q + qs.at(b, h, q0), qs.n, qs.d, qn, qn2, D, st.split16.data(), st.qb.data(),
                                   st.qbf.data(), Dp);
                  pack_split_rows4(dout + dos.at(b, h, q0), dos.n, dos.d, qn, Dv, Dv2, st.split16.data(),
                                   st.doa.data(), DvS);
                  pack_split_pairs(dout + dos.at(b, h, q0), dos.n, dos.d, qn, qn2, Dv, st.split16.data(),
                                   st.dob.data(), st.dobf.data(), Dvp);
                  lda_q = DS;
                  lda_do = DvS;
                }
              } else if (brgemm) {
                if constexpr (k16) {
                  if (qs.d == 1 && D == D2) {
                    Qa = reinterpret_cast<const uint16_t*>(q + qs.at(b, h, q0));
                    lda_q = qs.n;
                  } else {
                    pack_rows16(q + qs.at(b, h, q0), qs.n, qs.d, qn, D, st.qa.data(), D2, false, qn);
                  }
                  pack_rows16(q + qs.at(b, h, q0), qs.n, qs.d, qn, D, st.qb.data(), Dp, pairs, qn2);
                  if (dos.d == 1 && Dv == Dv2) {
                    dOa = reinterpret_cast<const uint16_t*>(dout + dos.at(b, h, q0));
                    lda_do = dos.n;
                  } else {
                    pack_rows16(dout + dos.at(b, h, q0), dos.n, dos.d, qn, Dv, st.doa.data(), Dv2, false, qn);
                  }
                  pack_rows16(dout + dos.at(b, h, q0), dos.n, dos.d, qn, Dv, st.dob.data(), Dvp, pairs, qn2);
                }
              } else {
                Qr = acc_rows(q + qs.at(b, h, q0), qs.n, qs.d, qn, D, st.q.data(), ldq);
                dOr = acc_rows(dout + dos.at(b, h, q0), dos.n, dos.d, qn, Dv, st.dout.data(), lddo);
              }
              acc_t* S = st.s.data();
              acc_t* dP = st.dp.data();
              // S = Q K^T (brgemm: K = D2, zero-padded; the split: 4 D2)
              if (split) {
                if constexpr (k16) brgemm16<at::BFloat16>(qn, kn, DS, lda_q, BKb, BKb, false, Qa, st.ktb.data(), S, path);
              } else if (brgemm) {
                if constexpr (k16)
                  brgemm16<scalar_t>(qn, kn, D2, lda_q, BKb, BKb, false, Qa, st.ktb.data(), S, path);
              } else {
                gemm<acc_t>(qn, kn, D, Qr, ldq, 1, st.kt.data(), BKb, S, BKb, false);
              }
              for (int64_t r = 0; r < qn; ++r) {
                acc_t* s = S + r * BKb;
                const int64_t i = q0 + r;
                int64_t lo, hi;
                p.tile_range(i, k0, kn, lo, hi);
                st.lo[r] = lo;
                st.hi[r] = std::max(lo, hi);
                acc_t* dcap = softcap ? st.dcap.data() + r * BKb : nullptr;
                const acc_t l2 = L2[row0 + r];
                if (l2 == neg_inf<acc_t>()) {  // fully masked row: no gradient
                  std::fill(s, s + kn, acc_t(0));
                  if (dcap != nullptr) std::fill(dcap, dcap + kn, acc_t(0));
                  continue;
                }
                if (l2 != l2) {
                  // A row the forward found NaN (it saw a NaN or +inf score): P is NaN on every
                  // key the row sees (a score of -inf included) and exactly 0 on the keys that
                  // causality or a bool mask hide, as in torch SDPA's backward, so that dK, dV
                  // of hidden keys stay clean (exp2(s - NaN) would make every P NaN).
                  std::fill(s, s + kn, l2);
                  prepare_row<acc_t>(s, kn, lo, hi, c, p, b, h, i, k0, dcap);
                  for (int64_t j = 0; j < kn; ++j)
                    s[j] = s[j] == neg_inf<acc_t>() ? acc_t(0) : l2;
                  continue;
                }
                prepare_row<acc_t>(s, kn, lo, hi, c, p, b, h, i, k0, dcap);
                exp2_sub_sum(s + lo, hi - lo, l2);  // P over the visible keys only, 0 elsewhere
                std::fill(s, s + lo, acc_t(0));
                std::fill(s + hi, s + kn, acc_t(0));
              }
              if (split) {
                if constexpr (k16) {
                  // dV += P^T dO: P^T's (hi, hif) pairs against dO's (hi, lo), then P^T's lo against
                  // dO's hif (K = 2 qn2, qn2: the rows [qn, qn2) zero);  dP = dO V^T (K = 4 Dv2)
                  pack_transposed(S, BKb, 1, qn, kn, st.tr.data(), BQb);
                  split_f32_rows(st.tr.data(), BQb, kn, qn, qn2, st.pt.data(), 2 * BQb, st.ptlo.data(), BQb);
                  brgemm16<at::BFloat16>(kn, Dv, 2 * qn2, 2 * BQb, Dvp, Dv, true, st.pt.data(), st.dob.data(),
                                         st.dv.data(), path);
                  brgemm16<at::BFloat16>(kn, Dv, qn2, BQb, Dvp, Dv, true, st.ptlo.data(), st.dobf.data(), st.dv.data(),
                                         path);
                  brgemm16<at::BFloat16>(qn, kn, DvS, lda_do, BKb, BKb, false, dOa, st.vtb.data(), dP, path);
                }
              } else if (brgemm) {
                if constexpr (k16) {
                  // dV += P^T dO, P rounded to the dtype (K = qn2: P^T's columns and dO's rows
                  // [qn, qn2) zero);  dP = dO V^T (K = Dv2, zero-padded)
                  to_bits16_transposed<scalar_t>(S, BKb, qn, kn, st.pt.data(), BQb, qn2);
                  brgemm16<scalar_t>(kn, Dv, qn2, BQb, Dvp, Dv, true, st.pt.data(), st.dob.data(), st.dv.data(),
                                     path);
                  brgemm16<scalar_t>(qn, kn, Dv2, lda_do, BKb, BKb, false, dOa, st.vtb.data(), dP, path);
                }
              } else {
                // dV += P^T dO
                gemm<acc_t>(kn, Dv, qn, S, 1, BKb, dOr, lddo, st.dv.data(), Dv, true);
                // dP = dO V^T
                gemm<acc_t>(qn, kn, Dv, dOr, lddo, 1, st.vt.data(), BKb, dP, BKb, false);
              }
              for (int64_t r = 0; r < qn; ++r) {
                const acc_t* pr = S + r * BKb;
                acc_t* dpr = dP + r * BKb;
                const acc_t di = Di[row0 + r];
                if (L2[row0 + r] == neg_inf<acc_t>()) {
                  // A row that sees no key gets no gradient.  Its P is 0, but dP = dO V^T is NaN
                  // where a value it never multiplied is NaN, while D is finite (its out is 0):
                  // 0 * NaN would reach dQ and that key's dK (found by random fuzzing, session 29).
                  std::fill(dpr, dpr + kn, acc_t(0));
                  continue;
                }
                // Likewise the tile's keys past the row's causal / window range, which the forward
                // never multiplied for this row (the edge tiles only: nothing elsewhere).  A general
                // select (dS = 0 wherever P = 0) cost 12-16% of the float32 / bfloat16 backward
                // here (N = 1024, D = 64), so the common loop below keeps its form.
                std::fill(dpr, dpr + st.lo[r], acc_t(0));
                std::fill(dpr + st.hi[r], dpr + kn, acc_t(0));
                if (!std::isfinite(di)) {
                  // A NaN or infinite delta (the row's out is NaN, or sees an inf value): dS as
                  // usual where the row sees a key (P != 0) and exactly 0 where causality or a
                  // bool mask hide it (P = 0): 0 * (dP - NaN / inf) would carry a NaN to the dK of
                  // keys the row cannot see (issue 15).
                  for (int64_t j = 0; j < kn; ++j)
                    dpr[j] = pr[j] != acc_t(0) ? pr[j] * (dpr[j] - di) * scale : acc_t(0);
                } else {
#pragma omp simd
                  for (int64_t j = 0; j < kn; ++j) dpr[j] = pr[j] * (dpr[j] - di) * scale;
                }
                if (softcap) {
                  // Through the cap: dS_raw = dS_capped (1 - tanh^2) (0 on hidden keys).
                  const acc_t* dc = st.dcap.data() + r * BKb;
#pragma omp simd
                  for (int64_t j = 0; j < kn; ++j) dpr[j] *= dc[j];
                }
              }
              if (split) {
                if constexpr (k16) {
                  // dK += dS^T Q and dQ += dS K, each as dV above (K = 2 qn2 and qn2, 2 kn2 and kn2)
                  pack_transposed(dP, BKb, 1, qn, kn, st.tr.data(), BQb);
                  split_f32_rows(st.tr.data(), BQb, kn, qn, qn2, st.dst.data(), 2 * BQb, st.dstlo.data(), BQb);
                  split_f32_rows(dP, BKb, qn, kn, kn2, st.ds.data(), 2 * BKb, st.dslo.data(), BKb);
                  brgemm16<at::BFloat16>(kn, D, 2 * qn2, 2 * BQb, Dp, D, true, st.dst.data(), st.qb.data(),
                                         st.dk.data(), path);
                  brgemm16<at::BFloat16>(kn, D, qn2, BQb, Dp, D, true, st.dstlo.data(), st.qbf.data(), st.dk.data(),
                                         path);
                  brgemm16<at::BFloat16>(qn, D, 2 * kn2, 2 * BKb, Dp, D, true, st.ds.data(), st.krb.data(),
                                         dq_c + row0 * D, path);
                  brgemm16<at::BFloat16>(qn, D, kn2, BKb, Dp, D, true, st.dslo.data(), st.krf.data(), dq_c + row0 * D,
                                         path);
                }
              } else if (brgemm) {
                if constexpr (k16) {
                  // dS rounded to the dtype.  dK += dS^T Q (K = qn2: dS^T's columns and Q's rows
                  // [qn, qn2) zero);  dQ += dS K (K = kn2: dS's columns and K's rows [kn, kn2) zero)
                  to_bits16_transposed<scalar_t>(dP, BKb, qn, kn, st.dst.data(), BQb, qn2);
                  for (int64_t r = 0; r < qn; ++r)
                    to_bits16<scalar_t>(dP + r * BKb, kn, st.ds.data() + r * BKb, kn2);
                  brgemm16<scalar_t>(kn, D, qn2, BQb, Dp, D, true, st.dst.data(), st.qb.data(), st.dk.data(), path);
                  brgemm16<scalar_t>(qn, D, kn2, BKb, Dp, D, true, st.ds.data(), st.krb.data(), dq_c + row0 * D,
                                     path);
                }
              } else {
                // dK += dS^T Q;  dQ += dS K
                gemm<acc_t>(kn, D, qn, dP, 1, BKb, Qr, ldq, st.dk.data(), D, true);
                gemm<acc_t>(qn, D, kn, dP, BKb, 1, Kr, ldkr, dq_c + row0 * D, D, true);
              }
            }
          }
          for (int64_t jj = 0; jj < kn; ++jj) {
            const int64_t row = (b * Hk + hk) * M + k0 + jj;
            store_scaled_row(st.dk.data() + jj * D, acc_t(1), D, dk + row * D);
            store_scaled_row(st.dv.data() + jj * Dv, acc_t(1), Dv, dv + row * Dv);
          }
        }
      });

  if (!direct) {
    const int64_t total = B * H * N * D;
    at::parallel_for(0, total, 4096, [&](int64_t begin, int64_t end) {
      // The chunks' partials summed into the first (in chunk order), then converted 16 at a time.
      acc_t* sum = dq_partial.data();
      for (int64_t ch = 1; ch < chunks; ++ch) {
        const acc_t* part = dq_partial.data() + ch * total;
        for (int64_t x = begin; x < end; ++x) sum[x] += part[x];
      }
      store_scaled_row(sum + begin, acc_t(1), end - begin, dq + begin);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points.
// ---------------------------------------------------------------------------------------------
// The Problem of checked inputs: q [B,H,N,D] against M keys of Hk kv heads, values of Dv, no mask
// and causal false until the caller sets them; the score options as the ops take them.
Problem make_problem(const at::Tensor& q, int64_t Hk, int64_t M, int64_t Dv, double scale, int64_t window_left,
                     int64_t window_right, double softcap, const c10::optional<at::Tensor>& alibi_slopes) {
  Problem p;
  p.B = q.size(0);
  p.H = q.size(1);
  p.N = q.size(2);
  p.D = q.size(3);
  p.Hk = Hk;
  p.M = M;
  p.Dv = Dv;
  p.scale = scale;
  p.causal = false;
  // A bound of N + M or more hides nothing: clamped there, so that i + M - N -+ w cannot overflow.
  const int64_t wmax = p.N + p.M;
  p.wl = window_left < 0 ? -1 : std::min(window_left, wmax);
  p.wr = window_right < 0 ? -1 : std::min(window_right, wmax);
  p.softcap = softcap;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    p.alibi = alibi_slopes->const_data_ptr<float>();
    p.alibi_sb = alibi_slopes->stride(0);
    p.alibi_sh = alibi_slopes->stride(1);
  }
  return p;
}

// The Problem of inputs that passed checks::softmax_fwd / softmax_bwd (csrc/checks/softmax.cpp).
Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& mask, double scale, bool is_causal,
                     int64_t window_left, int64_t window_right, double softcap,
                     const c10::optional<at::Tensor>& alibi_slopes) {
  Problem p = make_problem(q, k.size(1), k.size(2), v.size(3), scale, window_left, window_right, softcap, alibi_slopes);
  p.causal = is_causal;
  p.mask = make_mask_view(mask);
  return p;
}

// The decoding kernel on checked inputs (float32 / bfloat16 / float16; dense K / V, or a paged cache).
void run_decode(const Problem& p, bool bf16_dot, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                at::Tensor& out, at::Tensor& lse, const KvPages* pages) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "softmax_decode", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      softmax_decode_kernel<scalar_t>(p, cpu_decode_path(q.scalar_type(), p.N * (p.H / p.Hk)), bf16_dot,
                                      q.const_data_ptr<scalar_t>(), Strides4(q), k.const_data_ptr<scalar_t>(),
                                      Strides4(k), v.const_data_ptr<scalar_t>(), Strides4(v),
                                      out.mutable_data_ptr<scalar_t>(), lse.mutable_data_ptr<float>(), pages);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> softmax_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const c10::optional<at::Tensor>& mask,
                                                   double scale, bool is_causal, int64_t window_left,
                                                   int64_t window_right, double softcap,
                                                   const c10::optional<at::Tensor>& alibi_slopes,
                                                   const c10::optional<at::Tensor>& sinks) {
  checks::softmax_fwd(checks::cpu_target(), q, k, v, mask, scale, is_causal, window_left, window_right,
                      softcap, alibi_slopes, sinks);
  Problem p = make_problem(q, k, v, mask, scale, is_causal, window_left, window_right, softcap,
                           alibi_slopes);
  const at::Tensor sink_values = sinks.has_value() && sinks->defined() ? sinks->contiguous() : at::Tensor();
  if (sink_values.defined()) p.sinks = sink_values.const_data_ptr<float>();
  // The tile-GEMM path of the flash forward and of the decoding path (read here, so that a bad
  // ATTNKIT_CPU_GEMM raises on every call).
  const GemmPath path = cpu_gemm_path(q.scalar_type(), GemmUse::kSoftmax);
  // And how the native kernels of the call multiply bfloat16 (ATTNKIT_CPU_BF16, read on every
  // call too).
  const bool decode = use_decode(p, q.scalar_type());
  const bool bf16_dot = cpu_bf16_dot_products(decode ? GemmUse::kDecode : GemmUse::kSoftmax);
  auto out = at::empty({p.B, p.H, p.N, p.Dv}, q.options());
  auto lse = at::empty({p.B, p.H, p.N}, q.options().dtype(acc_type_of(q.scalar_type())));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  if (p.M == 0 && !p.sinks) {  // no keys: every row is fully masked
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  if (p.M == 0) {  // no keys, sinks: each row is its head's sink alone (finish_row's special values)
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "softmax_fwd", [&] {
      using acc_t = acc_of<scalar_t>;
      scalar_t* o = out.mutable_data_ptr<scalar_t>();
      acc_t* l = lse.mutable_data_ptr<acc_t>();
      for (int64_t row = 0; row < p.B * p.H * p.N; ++row)
        finish_row(static_cast<const acc_t*>(nullptr), neg_inf<acc_t>(), acc_t(0), p.Dv, o + row * p.Dv, l + row,
                   p.sink<acc_t>((row / p.N) % p.H));
    });
    return {out, lse};
  }
  if (decode) {
    run_decode(p, bf16_dot, q, k, v, out, lse, nullptr);
    return {out, lse};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "softmax_fwd", [&] {
    using acc_t = acc_of<scalar_t>;
    softmax_fwd_kernel<scalar_t, acc_t>(p, path, bf16_dot, q.const_data_ptr<scalar_t>(), Strides4(q),
                                        k.const_data_ptr<scalar_t>(), Strides4(k),
                                        v.const_data_ptr<scalar_t>(), Strides4(v),
                                        out.mutable_data_ptr<scalar_t>(),
                                        lse.mutable_data_ptr<acc_t>());
  });
  return {out, lse};
}

// The decoding forward against a paged KV cache, read in place (ops.cpp says what it takes).
std::tuple<at::Tensor, at::Tensor> softmax_decode_paged_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                                            const at::Tensor& v_cache, const at::Tensor& block_table,
                                                            int64_t length, double scale, int64_t window_left,
                                                            int64_t window_right, double softcap,
                                                            const c10::optional<at::Tensor>& alibi_slopes,
                                                            const c10::optional<at::Tensor>& sinks) {
  checks::softmax_decode_paged(checks::cpu_target(), q, k_cache, v_cache, block_table, length, scale, window_left,
                               window_right, softcap, alibi_slopes, sinks);
  Problem p = make_problem(q, k_cache.size(1), length, v_cache.size(3), scale, window_left, window_right, softcap,
                           alibi_slopes);
  const at::Tensor sink_values = sinks.has_value() && sinks->defined() ? sinks->contiguous() : at::Tensor();
  if (sink_values.defined()) p.sinks = sink_values.const_data_ptr<float>();
  // Read here as in softmax_fwd_cpu, so that a bad ATTNKIT_CPU_GEMM / ATTNKIT_CPU_BF16 raises.
  (void)cpu_gemm_path(q.scalar_type(), GemmUse::kSoftmax);
  const bool bf16_dot = cpu_bf16_dot_products(GemmUse::kDecode);
  auto out = at::empty({p.B, p.H, p.N, p.Dv}, q.options());
  auto lse = at::empty({p.B, p.H, p.N}, q.options().dtype(at::kFloat));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  if (p.M == 0 && !p.sinks) {
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }  // (with sinks the decoding kernel writes the empty rows: lse = the sink)
  const at::Tensor table = block_table.contiguous();
  const KvPages pages{table.const_data_ptr<int64_t>(), table.stride(0), k_cache.size(2)};
  run_decode(p, bf16_dot, q, k_cache, v_cache, out, lse, &pages);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const c10::optional<at::Tensor>& mask,
    double scale, bool is_causal, int64_t window_left, int64_t window_right, double softcap,
    const c10::optional<at::Tensor>& alibi_slopes) {
  checks::softmax_bwd(checks::cpu_target(), grad_out, q, k, v, out, lse, mask, scale, is_causal, window_left,
                      window_right, softcap, alibi_slopes);
  const Problem p = make_problem(q, k, v, mask, scale, is_causal, window_left, window_right, softcap,
                                 alibi_slopes);
  auto dq = at::empty({p.B, p.H, p.N, p.D}, q.options());
  auto dk = at::empty({p.B, p.Hk, p.M, p.D}, q.options());
  auto dv = at::empty({p.B, p.Hk, p.M, p.Dv}, q.options());
  if (p.N == 0 || p.M == 0 || p.B == 0 || p.H == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  // lse is read through strides as a 4-D view [B,H,N,1].
  const at::Tensor lse4 = lse.unsqueeze(-1);
  const GemmPath path = cpu_gemm_path(q.scalar_type(), GemmUse::kSoftmax);
  // float32 / float64 Q and dO rows go to the native tiles in place when dense, else as copies
  // made per key block (the kernel's acc_rows: read in place, rows at a power-of-two stride
  // share few L1 sets); rows H * D apart -- FlashAttention's [B, N, H, D] layout seen as
  // [B, H, N, D] -- are made dense once here instead.  B=1 H=8 N=1024 D=64 float32, backward op
  // alone, one thread (Intel Xeon without AMX, session 33, bench/cpu_micro/fa_layout.py): copied
  // per key block, dense 38.1 ms, strided Q 40.4, strided dO 41.3, both 42.5; made dense here,
  // all within ~1 ms of dense (each copy ~0.5 ms).
  const bool float_rows = q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble;
  const auto dense_rows = [&](const at::Tensor& x) {
    return !float_rows || (x.stride(3) == 1 && (x.size(2) <= 1 || x.stride(2) == x.size(3))) ? x : x.contiguous();
  };
  const at::Tensor qd = dense_rows(q), gd = dense_rows(grad_out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "softmax_bwd", [&] {
    using acc_t = acc_of<scalar_t>;
    softmax_bwd_kernel<scalar_t, acc_t>(
        p, path, gd.const_data_ptr<scalar_t>(), Strides4(gd), qd.const_data_ptr<scalar_t>(),
        Strides4(qd), k.const_data_ptr<scalar_t>(), Strides4(k), v.const_data_ptr<scalar_t>(),
        Strides4(v), out.const_data_ptr<scalar_t>(), Strides4(out),
        lse4.const_data_ptr<acc_t>(), Strides4(lse4), dq.mutable_data_ptr<scalar_t>(),
        dk.mutable_data_ptr<scalar_t>(), dv.mutable_data_ptr<scalar_t>());
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("softmax_fwd", &softmax_fwd_cpu);
  m.impl("softmax_bwd", &softmax_bwd_cpu);
  m.impl("softmax_decode_paged", &softmax_decode_paged_cpu);
}

}  // namespace attnkit

// CPU kernels of the modern Hopfield family.
//
// hopfield_energy_fwd(state [B,H,S,D], stored [B,H,N,D], beta) -> (energy, lse), both [B,H,S]
// in float32 (float64 for float64 inputs):
//   lse    = log sum_i exp(beta * x_i . xi)
//   energy = -lse / beta + 0.5 xi.xi + log(N) / beta + 0.5 M^2,   M = max_i |x_i| per (b, h).
//
// Layout of the work: the stored patterns of each (b, h) are packed once, converted to the
// accumulation type, into tiles of kP patterns transposed to [D][kP] (O(N*D) extra memory,
// never S*N).  Each task then takes kQ queries of one (b, h) and walks the tiles: a kQ x kP
// block of scores is accumulated in registers (per d: one contiguous kP-wide load, kQ
// broadcasts, kQ vector FMAs), and folded into a running (max, sum) log-sum-exp per query.
// The exponentials use a polynomial that the compiler vectorizes (float); double uses std::exp.
//
// Cancellation: E is a difference of terms (lse/beta, log(N)/beta, |xi|^2/2, M^2/2) that can be
// far larger than E itself (small beta with small scores: all scores nearly equal, lse ~ log N).
// A float32 row then carries an error of ~eps32 * (size of the terms), which is far more than
// eps32 * |E|.  Such rows (terms > kCancellation * |E|) are recomputed in double from the
// inputs: rare in practice, and it keeps every float32 energy within a few eps32 of |E|.
#include "torch_headers.h"
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../checks/checks.h"
#include "flash_tiles.h"
#include "empty_huge.h"
#include "gemm_path.h"
#include "parallel_tasks.h"
#include "simd_f32.h"

namespace attnkit {
namespace {

constexpr int64_t kQ = 8;   // queries per task tile
constexpr int64_t kP = 16;  // stored patterns per tile (one AVX-512 float vector)
constexpr double kCancellation = 32;  // recompute a float32 row above this cancellation factor

// exp(x) for x <= 0 (the argument is always a score minus the running maximum).  float: range
// reduction x = k ln2 + r, |r| <= ln2/2, then the degree-7 Taylor polynomial of exp(r)
// (truncation error < 1e-8 relative) times 2^k built in the exponent bits.  Arguments below
// -87 give exactly 0 (exp(-87) ~ 1.6e-38 is negligible next to the running sum, >= 1): a
// clamp to exp(-87) instead made exp(-inf) nonzero, so a pattern with an infinite entry and
// score -inf added 1.6e-38 * inf = inf where the float64 reference adds 0 * inf = NaN (and with
// tol that row then kept updating where the reference freezes it).  NaN stays NaN.
inline float exp_nonpositive(float x) {
  const bool under = x < -87.0f;
  x = under ? -87.0f : x;
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.0f : p * scale;
}

inline double exp_nonpositive(double x) { return std::exp(x); }

// The running max to subtract before exp: -inf (every score so far -inf) becomes 0, so that
// those scores give exp(-inf) = 0 rather than exp(-inf - -inf) = NaN.  A row whose first tile
// of scores is all -inf (patterns with an infinite entry) and whose later scores are finite is
// finite in the reference; without this it came out NaN.  A row of only -inf scores still ends
// with l = 0: lse = -inf, and its update 0 * (1 / 0) = NaN, as the reference's softmax gives.
template <typename T>
inline T finite_or_zero(T m) {
  return m == -std::numeric_limits<T>::infinity() ? T(0) : m;
}

// Row kernels of the online softmax: the max of a row of scores, and p_j = exp(s_j - m) in
// place with their sum.  Written with AVX-512 intrinsics for float: GCC left both loops scalar
// (vmaxss / vfmadd...ss in perf annotate), which made the softmax cost as much as both GEMMs
// together (S=1024 N=16384 D=64, one thread: 11 GFLOP/s against torch SDPA's 29 in the same run).
template <typename T>
inline T scores_max(const T* s, int64_t n) {
  T best = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) best = s[j] > best ? s[j] : best;
  return best;
}

template <typename T>
inline T exp_sum_inplace(T* s, int64_t n, T m) {
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const T p = exp_nonpositive(s[j] - m);
    s[j] = p;
    sum += p;
  }
  return sum;
}

#if defined(__AVX512F__)

template <>
inline float scores_max<float>(const float* s, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(s + j));
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
    best = _mm512_mask_max_ps(best, tail, best, _mm512_maskz_loadu_ps(tail, s + j));
  }
  return _mm512_reduce_max_ps(best);
}

template <>
inline float exp_sum_inplace<float>(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 p = exp_nonpositive_v(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 p = exp_nonpositive_v(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv));
    _mm512_mask_storeu_ps(s + j, tail, p);
    sum = _mm512_mask_add_ps(sum, tail, sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same two row kernels on ymm for AVX2 builds (AMD EPYC Zen 3): the generic loops above ran
// scalar there too, and the update with many queries lost to SDPA per step (S=256 N=4096 D=64
// float32, `bench --quick`: 0.80x).  exp_nonpositive's polynomial, eight lanes at a time: exp of
// x < -87 is 0, NaN stays NaN.

inline __m256 exp_nonpositive_v8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // a NaN x stays (max returns its second operand)
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

template <>
inline float scores_max<float>(const float* s, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(s + j));
  float out = hmax8(best);
  for (; j < n; ++j) out = s[j] > out ? s[j] : out;
  return out;
}

template <>
inline float exp_sum_inplace<float>(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 p = exp_nonpositive_v8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  float total = hsum8(sum);
  for (; j < n; ++j) {
    const float p = exp_nonpositive(s[j] - m);
    s[j] = p;
    total += p;
  }
  return total;
}
#endif  // __AVX512F__ / __AVX2__

// log sum_i exp(beta * x_i . q) of one query row, in double throughout (the cancellation
// fallback; scores: scratch space for the N scores).
template <typename scalar_t>
double row_lse_double(const scalar_t* q, const scalar_t* X, int64_t N, int64_t D, double beta,
                      double* scores) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < N; ++i) {
    double dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(X[i * D + d]) * static_cast<double>(q[d]);
    scores[i] = beta * dot;
    m = scores[i] > m ? scores[i] : m;
  }
  double l = 0;
  for (int64_t i = 0; i < N; ++i) l += std::exp(scores[i] - m);
  return m + std::log(l);
}

// lse and energy of one state row from its running (max m, sum l), and the squared norms.
// Rows prone to cancellation in float32 are redone in double from the inputs (see the top).
template <typename scalar_t, typename acc_t>
void finish_energy_row(acc_t m, acc_t l, acc_t xi_sq, double max_sq, double beta_in, const scalar_t* q_row,
                       const scalar_t* X, int64_t N, int64_t D, avec<double>& scores, acc_t* lse,
                       acc_t* energy) {
  const acc_t beta = static_cast<acc_t>(beta_in);
  const acc_t log_n = std::log(static_cast<acc_t>(N));
  acc_t row_lse = m + std::log(l);
  acc_t row_energy = -row_lse / beta + acc_t(0.5) * xi_sq + log_n / beta + static_cast<acc_t>(0.5 * max_sq);
  if constexpr (std::is_same_v<acc_t, float>) {
    const double terms = std::abs(static_cast<double>(row_lse)) / beta + log_n / beta + 0.5 * xi_sq + 0.5 * max_sq;
    // (false for NaN: a NaN row stays NaN)
    if (terms > kCancellation * std::abs(static_cast<double>(row_energy))) {
      if (scores.empty()) scores.resize(static_cast<size_t>(N));
      const double lse_d = row_lse_double(q_row, X, N, D, beta_in, scores.data());
      double q_sq = 0;
      for (int64_t d = 0; d < D; ++d) q_sq += static_cast<double>(q_row[d]) * static_cast<double>(q_row[d]);
      row_lse = static_cast<acc_t>(lse_d);
      row_energy =
          static_cast<acc_t>(-(lse_d - std::log(static_cast<double>(N))) / beta_in + 0.5 * q_sq + 0.5 * max_sq);
    }
  }
  *lse = row_lse;
  *energy = row_energy;
}

// The energy on the AVX-512 GEMM kernels of the update (defined with them, below): float32,
// D a multiple of 16 up to 128.  false: it does not apply.
bool energy_fast(const float* state, const float* stored, float* energy, float* lse, int64_t BH, int64_t S,
                 int64_t N, int64_t D, double beta);

// The energy on the brgemm path (bfloat16 / float16 inputs whose path is not native; defined
// with energy_fast).
template <typename scalar_t>
void energy_brgemm(const scalar_t* state, const scalar_t* stored, float* energy, float* lse, int64_t BH, int64_t S,
                   int64_t N, int64_t D, double beta_in, GemmPath path);

template <typename scalar_t, typename acc_t>
void energy_kernel(const scalar_t* state, const scalar_t* stored, acc_t* energy, acc_t* lse,
                   int64_t BH, int64_t S, int64_t N, int64_t D, double beta_in) {
  const acc_t beta = static_cast<acc_t>(beta_in);
  const int64_t tiles = (N + kP - 1) / kP;
  // Packed stored patterns: [BH][tiles][D][kP], zero-padded past N.
  avec<acc_t> packed(static_cast<size_t>(BH * tiles * D * kP));
  avec<double> max_sq(BH);         // in double for the cancellation fallback
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const scalar_t* X = stored + bh * N * D;
      acc_t* out = packed.data() + bh * tiles * D * kP;
      double best = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        acc_t* tile = out + t * D * kP;
        for (int64_t p = 0; p < kP; ++p) {
          const int64_t i = t * kP + p;
          if (i >= N) {
            for (int64_t d = 0; d < D; ++d) tile[d * kP + p] = 0;
            continue;
          }
          double sq = 0;
          for (int64_t d = 0; d < D; ++d) {
            const acc_t x = static_cast<acc_t>(X[i * D + d]);
            tile[d * kP + p] = x;
            sq += static_cast<double>(x) * static_cast<double>(x);
          }
          best = (sq > best || std::isnan(sq)) ? sq : best;  // std::max would drop a NaN norm
        }
      }
      max_sq[bh] = best;
    }
  });

  const int64_t query_tiles = (S + kQ - 1) / kQ;
  at::parallel_for(0, BH * query_tiles, 1, [&](int64_t begin, int64_t end) {
    avec<acc_t> xi(static_cast<size_t>(kQ * D));
    avec<double> scores;         // the fallback's scratch, allocated on first use
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / query_tiles;
      const int64_t q0 = (task % query_tiles) * kQ;
      const int64_t rows = std::min(kQ, S - q0);
      const scalar_t* Q = state + (bh * S + q0) * D;
      acc_t xi_sq[kQ];
      for (int64_t q = 0; q < kQ; ++q) {
        acc_t sq = 0;
        for (int64_t d = 0; d < D; ++d) {
          const acc_t v = q < rows ? static_cast<acc_t>(Q[q * D + d]) : acc_t(0);
          xi[q * D + d] = v;
          sq += v * v;
        }
        xi_sq[q] = sq;
      }
      acc_t m[kQ], l[kQ];
      for (int64_t q = 0; q < kQ; ++q) {
        m[q] = -std::numeric_limits<acc_t>::infinity();
        l[q] = 0;
      }
      const acc_t* tiles_bh = packed.data() + bh * tiles * D * kP;
      for (int64_t t = 0; t < tiles; ++t) {
        const acc_t* tile = tiles_bh + t * D * kP;
        acc_t sc[kQ][kP] = {};
        for (int64_t d = 0; d < D; ++d) {
          const acc_t* xr = tile + d * kP;
          for (int64_t q = 0; q < kQ; ++q) {
            const acc_t a = xi[q * D + d];
#pragma omp simd
            for (int64_t p = 0; p < kP; ++p) sc[q][p] += a * xr[p];
          }
        }
        const int64_t valid = std::min(kP, N - t * kP);
        for (int64_t q = 0; q < rows; ++q) {
#pragma omp simd
          for (int64_t p = 0; p < valid; ++p) sc[q][p] *= beta;
          // (scores_max: on ymm / zmm for float; a NaN is caught by the exponentials below)
          const acc_t tile_max = scores_max(sc[q], valid);
          if (tile_max > m[q]) {
            // exp(-inf) (first tile) is 0, times l = 0.
            l[q] *= exp_nonpositive(m[q] - tile_max);
            m[q] = tile_max;
          }
          acc_t sum = 0;
          const acc_t mq = finite_or_zero(m[q]);
          if (mq == std::numeric_limits<acc_t>::infinity()) {
            // A score of +inf: lse is +inf, as torch.logsumexp gives (the backward recomputes
            // the probabilities from it), unless a score is NaN.  exp(inf - inf) would make it
            // NaN: count each +inf score as 1 instead (l stays positive and finite, l was
            // rescaled to 0 when m became +inf), finite scores as exp(-inf) = 0.
            for (int64_t p = 0; p < valid; ++p)
              sum += sc[q][p] == mq ? acc_t(1) : exp_nonpositive(sc[q][p] - mq);
          } else {
            sum = exp_sum_inplace(sc[q], valid, mq);  // sc is this tile's scratch: overwritten
          }
          l[q] += sum;
        }
      }
      for (int64_t q = 0; q < rows; ++q) {
        const int64_t row = bh * S + q0 + q;
        finish_energy_row<scalar_t, acc_t>(m[q], l[q], xi_sq[q], max_sq[bh], beta_in, Q + q * D,
                                           stored + bh * N * D, N, D, scores, lse + row, energy + row);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> hopfield_energy_fwd_cpu(const at::Tensor& state,
                                                           const at::Tensor& stored, double beta) {
  checks::hopfield_energy_fwd(checks::cpu_target(), state, stored, beta);
  const auto st = state.contiguous();
  const auto x = stored.contiguous();
  const int64_t B = st.size(0), H = st.size(1), S = st.size(2), D = st.size(3);
  const int64_t N = x.size(2);
  const auto acc_dtype = st.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const GemmPath path = cpu_gemm_path(st.scalar_type());  // once per call; float32 / float64: native
  auto energy = at::empty({B, H, S}, st.options().dtype(acc_dtype));
  auto lse = at::empty({B, H, S}, st.options().dtype(acc_dtype));
  if (energy.numel() == 0) return {energy, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st.scalar_type(), "hopfield_energy_fwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
      if (path != GemmPath::kNative) {
        energy_brgemm<scalar_t>(st.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                energy.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(), B * H, S, N, D, beta,
                                path);
        return;
      }
    }
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
      // The native path: the 16-bit inputs widened to float32 (exact; O((S + N) D) memory) for the
      // float32 kernels -- energy_kernel's own loops took the bfloat16 energy to 0.84x plain
      // PyTorch (S=1024 N=16384 D=64, 67 GFLOP/s, Xeon model 207 without AMX, 2 threads,
      // `bench --match energy`, session 26) where energy_fast runs at float32's rate.
      const at::Tensor stf = st.to(at::kFloat), xf = x.to(at::kFloat);
      if (!energy_fast(stf.const_data_ptr<float>(), xf.const_data_ptr<float>(), energy.mutable_data_ptr<float>(),
                       lse.mutable_data_ptr<float>(), B * H, S, N, D, beta))
        energy_kernel<float, float>(stf.const_data_ptr<float>(), xf.const_data_ptr<float>(),
                                    energy.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(), B * H, S, N, D,
                                    beta);
      return;
    }
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (energy_fast(st.const_data_ptr<float>(), x.const_data_ptr<float>(), energy.mutable_data_ptr<float>(),
                      lse.mutable_data_ptr<float>(), B * H, S, N, D, beta))
        return;
    }
    energy_kernel<scalar_t, acc_t>(st.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                   energy.mutable_data_ptr<acc_t>(), lse.mutable_data_ptr<acc_t>(),
                                   B * H, S, N, D, beta);
  });
  return {energy, lse};
}

// =============================================================================================
// hopfield_update_fwd: all the update steps of attnkit.hopfield_update in one call.
//
// R = steps retrievals; the first U = steps (steps - 1 with values) are updates in the stored
// space xi <- softmax(beta xi X^T) X, the last one (with values) reads out softmax(beta xi X^T) V.
// Each retrieval streams the stored patterns in tiles of kTileN rows; every stored row of a tile
// is read once per step and serves as key and value (keys = values = X):
//   scores = beta * xi_blk . X_tile^T           (GEMM, rows x kTileN)
//   online softmax per row (running max m, sum l; acc rescaled when m grows)
//   acc   += P . X_tile                          (GEMM, rows x D)
// so no S x N matrix exists; the extra memory is O(rows * kTileN) per thread plus the fp32 (or
// fp64) copies of the inputs and, on the fast path below, one packed copy of X (O((S + N) * D)).
//
// Three kernels do a retrieval (retrieve_range picks):
// - streaming (float32, AVX-512, blocks of <= kStreamMaxS states, D <= 128; stream_range_f32):
//   each block of 16 stored rows is read once per group of 16 states and used from L1 as key
//   and value by all of them, no GEMM at all (S=1 is memory-bound);
// - AVX-512 GEMM (float32, D a multiple of 16 up to 128; fast_scores / fast_pv) on the stored
//   patterns packed once per call;
// - MKL SGEMM / DGEMM (everything else: float64, other D), portable loops without MKL.
// bfloat16 / float16 inputs run these on float32 copies, unless their tile-GEMM path (issue 25,
// gemm_path.h) is not native: then every retrieval runs retrieve_range16 (brgemm on 16-bit
// operands; see Gemm16), in either decomposition below.
//
// A fourth, the states-in-lanes kernel (lane_retrieval: float32, AVX-512, no values, S >
// kStreamMaxS, D <= 128), runs every step of the fused decomposition when it applies (update_lanes):
// groups of up to 64 states in the vector lanes, each chunk of stored rows read in place as key
// and value; no packed copy of X.
//
// Two decompositions of the work:
// - fused (the default): one task per (b, h, block of kBlockQ queries); the task keeps its block
//   of states in a thread-local buffer across all steps and writes each step's state out only
//   for the backward.
// - split-N (S <= kSplitMaxS, or kStreamMaxS when the states stream, and few (b, h) compared
//   with the threads, N >= 2 kSplitRows): one
//   query block cannot occupy the machine, so each step hands out (b, h, chunk of kSplitRows
//   stored rows) tasks to the threads; every chunk returns a partial (m, l, acc) per query and
//   the partials merge, in chunk order, through their log-sum-exps (flash-decoding).
//
// tol (>= 0; < 0 means none): exactly the reference's rule.  A row's first update always
// applies; after each applied update whose change max_d |new - old| is not > tol (NaN included)
// the row is frozen, and later updates leave it unchanged.  applied[k][row] records whether
// update k changed the row (the backward lets gradients pass straight through the others).  A
// block whose rows are all frozen skips the remaining updates (its lse is then +inf there).
// =============================================================================================

// BLAS: MKL's Fortran-interface SGEMM / DGEMM, exported by libtorch_cpu when torch is built
// with MKL (the x86 wheels).  Weak references: on a torch without them the portable loops
// below run instead.  (Measured on the 2-core EPYC, S=1024 N=16384 D=64: see gemm_nt.)
extern "C" {
void SGEMM(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
           const int*, const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void DGEMM(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
           const int*, const double*, const int*, const double*, double*, const int*) __attribute__((weak));
}

// Tile sizes.  Measured on the shared 2-core EPYC (load average ~7 from other builds, so only
// ratios taken in the same run mean anything), S=1024 N=16384 D=64 3 steps: 128 x 256 and
// 256 x 512 both ran at 0.60-0.65x of three torch SDPA calls; 256 x 512 kept (fewer rescales of
// acc, the shape torch's own CPU flash attention uses for long sequences).  MKL SGEMM alone on
// these tiles reached ~52 GFLOP/s on one loaded core (128x256 and 256x512 alike; 64x512: 47).
constexpr int64_t kBlockQ = 256;     // queries per fused task
constexpr int64_t kTileN = 512;      // stored rows per tile
constexpr int64_t kSplitMaxS = 16;   // split-N only for this few queries ...
constexpr int64_t kSplitRows = 4096; // ... in chunks of this many stored rows
// Blocks of at most this many query rows use the plain loops below instead of BLAS.  0: BLAS
// always; the loops measured slower for S=1 N=262144 (16-18 ms against 12 ms, same run).  (For
// float32 on AVX-512 such blocks now take the streaming kernel before either.)
constexpr int64_t kSmallRows = 0;
// AVX2 + FMA: blocks of at most this many states take the dot-product tiles (retrieve_range).
constexpr int64_t kDotMaxRows = 16;

template <typename T>
void blas_gemm(char ta, char tb, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb,
               T beta, T* c, int ldc) {
  if constexpr (std::is_same_v<T, float>) {
    SGEMM(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
  } else {
    DGEMM(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
  }
}

template <typename T>
bool have_blas() {
  if constexpr (std::is_same_v<T, float>) return SGEMM != nullptr;
  return DGEMM != nullptr;
}

// Row-major C[rows x cols] = alpha * A[rows x K] . B[cols x K]^T   (overwrites C).
template <typename T>
void gemm_nt(int64_t rows, int64_t cols, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
             int64_t ldb, T* C, int64_t ldc) {
  if (rows > kSmallRows && have_blas<T>()) {
    // Column-major view: C^T (cols x rows) = B (cols x K) . A^T.
    blas_gemm<T>('T', 'N', (int)cols, (int)rows, (int)K, alpha, B, (int)ldb, A, (int)lda, T(0), C, (int)ldc);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < K; ++k) dot += A[r * lda + k] * B[c * ldb + k];
      C[r * ldc + c] = alpha * dot;
    }
}

// Row-major C[rows x cols] += A[rows x K] . B[K x cols].
template <typename T>
void gemm_nn_acc(int64_t rows, int64_t cols, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                 T* C, int64_t ldc) {
  if (rows > kSmallRows && have_blas<T>()) {
    blas_gemm<T>('N', 'N', (int)cols, (int)rows, (int)K, T(1), B, (int)ldb, A, (int)lda, T(1), C, (int)ldc);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const T a = A[r * lda + k];
      T* c = C + r * ldc;
      const T* b = B + k * ldb;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) c[j] += a * b[j];
    }
}


// Folds one tile's row of scores s[0..bk) (already times beta) into its row's running (m, l) of
// the online softmax, rescaling the row's sums acc [Dout] (and accx [D] when given) when the
// maximum grows; s becomes exp(s - m).  (retrieve_range's step, shared with retrieve_range16.)
template <typename T>
inline void fold_scores_row(T* s, int64_t bk, T& m, T& l, T* acc, int64_t Dout, T* accx, int64_t D) {
  const T new_m = std::max(m, scores_max(s, bk));
  if (new_m != m) {
    // exp(-inf) (first tile) is 0 times l = 0 and acc = 0.
    const T alpha = exp_nonpositive(m - new_m);
    l *= alpha;
#pragma omp simd
    for (int64_t d = 0; d < Dout; ++d) acc[d] *= alpha;
    if (accx) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) accx[d] *= alpha;
    }
    m = new_m;
  }
  l += exp_sum_inplace(s, bk, finite_or_zero(m));
}

// ---------------------------------------------------------------------------------------------
// The brgemm path (issue 25, gemm_path.h): for bfloat16 / float16 inputs whose
// cpu_gemm_path(dtype), read once per op call, is not native, the update's and the energy's tile
// GEMMs run through brgemm16 (oneDNN's batch-reduce micro-kernel: AMX tiles on an Intel Xeon) on
// 16-bit operands, float32 sums:
//   scores = beta * round16(xi) . X^T   (X exact: the inputs are 16-bit; the states are float32
//                                        after the first update and rounded here, as the
//                                        reference run in the inputs' dtype rounds them)
//   acc   += round16(P) . X             (or . V on a value step; P rounded as there too)
// X (and V) are packed once per call as B operands (VNNI pairs where brgemm_vnni_layout(path)).
// Every product's K is zero-padded to a multiple of 32 in both operands -- D to Dp in xi and X^T,
// a tile's rows to bkp in P and X / V -- because xi and P may hold a NaN: oneDNN on AMX would
// spread a NaN of row i + 1 into output row i otherwise (gemm_path.h).  Native (auto on CPUs
// without AMX, this AMD EPYC's default) and float32 / float64 inputs run the kernels of this
// file as before; the update's backward (attnkit::softmax_bwd on the float32 states) and the
// energy's backward are float32 and stay native.
// ---------------------------------------------------------------------------------------------

// The operands' 16-bit type and the path of one call, with the two operations on them.
struct Gemm16 {
  GemmPath path = GemmPath::kNative;
  bool bf16 = true;  // bfloat16 operands, else float16

  bool pairs() const { return brgemm_vnni_layout(path); }

  // n floats rounded to the operands' type, zeros up to n_pad.
  void round(const float* src, int64_t n, uint16_t* dst, int64_t n_pad) const {
    if (bf16)
      to_bits16<at::BFloat16>(src, n, dst, n_pad);
    else
      to_bits16<at::Half>(src, n, dst, n_pad);
  }

  // C [M][ldc] (+)= A [M][lda] B (brgemm16 on this path).
  void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C, const uint16_t* A,
            const uint16_t* B, float* C) const {
    if (bf16)
      brgemm16<at::BFloat16>(M, N, K, lda, ldb, ldc, add_C, A, B, C, path);
    else
      brgemm16<at::Half>(M, N, K, lda, ldb, ldc, add_C, A, B, C, path);
  }
};

// parallel_tasks whose workers release their brgemm state (BrgemmRelease) when their share of the
// tasks ends; a worker that takes no task touches none.
template <typename F>
void parallel_tasks_on(GemmPath path, int64_t tasks, const F& body) {
  if (tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::optional<BrgemmRelease> release;
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      if (!release) release.emplace(path);
      body(t);
    }
  });
}

// The stored patterns (and values) of an update call as the B operands of the brgemm path, per
// (b, h) and tile t of kTileN stored rows (rows [t kTileN, ..); the retrievals' tiles start there,
// split-N chunks included), with tw = the tile width padded to 32 (kTileN, or less when N is):
//   X^T [Dp][tw]   the scores' B (pairs along d), zeros past D and past N
//   X   [tw][D]    P.X's B (pairs along the rows), zero rows past N
//   V   [tw][Dv]   P.V's B (with values)
// 16-bit scratch of n elements, uninitialized, on empty_huge's huge-page blocks (empty_huge.h),
// which are kept for the next call of the same size.  The packed copies of the stored patterns
// are O(N D): with avec (zero-filled fresh pages) the page faults and their zeroing were ~55% of
// the samples of an update with one state (bfloat16 S=1 N=65536 H=4 D=64, brgemm, perf, Xeon with
// AMX, session 18).
struct HugeScratch16 {
  at::Tensor block;
  uint16_t* ptr = nullptr;
  void reset(int64_t n) {
    block = empty_huge({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kShort));
    ptr = reinterpret_cast<uint16_t*>(block.data_ptr<int16_t>());
  }
  uint16_t* data() const { return ptr; }
};

struct Stored16 {
  Gemm16 g;
  int64_t D = 0, Dv = 0, Dp = 0, tw = 0, tiles = 0;
  HugeScratch16 xt, xr, vr;

  int64_t tile(int64_t bh, int64_t t) const { return bh * tiles + t; }
  const uint16_t* xt_tile(int64_t bh, int64_t t) const { return xt.data() + tile(bh, t) * Dp * tw; }
  const uint16_t* xr_tile(int64_t bh, int64_t t) const { return xr.data() + tile(bh, t) * tw * D; }
  const uint16_t* vr_tile(int64_t bh, int64_t t) const { return vr.data() + tile(bh, t) * tw * Dv; }
};

// Packs X [BH][N][D] (and V [BH][N][Dv] when not null), 16-bit, into p (path and sizes set).
template <typename T16>
void pack_stored16(const T16* X, const T16* V, int64_t BH, int64_t N, Stored16& p) {
  const int64_t D = p.D, Dv = p.Dv, tw = p.tw;
  p.xt.reset(BH * p.tiles * p.Dp * tw);  // zeroed per tile below (the padding stays zero)
  p.xr.reset(BH * p.tiles * tw * D);      // written whole below
  if (V != nullptr) p.vr.reset(BH * p.tiles * tw * Dv);
  const bool pairs = p.g.pairs();
  parallel_tasks(BH * p.tiles, [&](int64_t i) {
    const int64_t bh = i / p.tiles, t = i % p.tiles;
    const int64_t r0 = t * kTileN, kn = std::min(kTileN, N - r0);
    const T16* x = X + (bh * N + r0) * D;
    std::memset(p.xt.data() + i * p.Dp * tw, 0, static_cast<size_t>(p.Dp * tw) * sizeof(uint16_t));
    pack_transposed_pairs(x, D, 1, kn, D, p.xt.data() + i * p.Dp * tw, tw, pairs);
    pack_rows16(x, D, 1, kn, D, p.xr.data() + i * tw * D, D, pairs, tw);
    if (V != nullptr) pack_rows16(V + (bh * N + r0) * Dv, Dv, 1, kn, Dv, p.vr.data() + i * tw * Dv, Dv, pairs, tw);
  });
}

// retrieve_range on the brgemm path: one retrieval of `rows` states xi [rows][D] over the stored
// rows [n0, n1) of (b, h) bh, folded into the caller's (m, l, acc, accx) likewise.  value_step:
// acc reads out through V ([rows][Dv]) and accx (when not null) through X; otherwise acc through X.
// scores: scratch of rows x kTileN floats.
void retrieve_range16(const Stored16& p, int64_t bh, bool value_step, const float* xi, int64_t rows, int64_t n0,
                      int64_t n1, float beta, float* m, float* l, float* acc, float* accx, float* scores) {
  const int64_t D = p.D, Dp = p.Dp, tw = p.tw;
  const int64_t Dout = value_step ? p.Dv : D;
  thread_local avec<uint16_t> xi16, p16;
  xi16.resize(static_cast<size_t>(rows * Dp));
  p16.resize(static_cast<size_t>(rows * tw));
  for (int64_t r = 0; r < rows; ++r) p.g.round(xi + r * D, D, xi16.data() + r * Dp, Dp);
  for (int64_t t0 = n0; t0 < n1; t0 += kTileN) {
    const int64_t t = t0 / kTileN, bk = std::min(kTileN, n1 - t0);
    const int64_t bkp = round_up(bk, 32);  // <= tw: the packed X / V rows past bk are zeros
    p.g.gemm(rows, bk, Dp, Dp, tw, kTileN, false, xi16.data(), p.xt_tile(bh, t), scores);
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores + r * kTileN;
      for (int64_t j = 0; j < bk; ++j) s[j] *= beta;
      fold_scores_row(s, bk, m[r], l[r], acc + r * Dout, Dout, accx ? accx + r * D : nullptr, D);
      p.g.round(s, bk, p16.data() + r * tw, bkp);
    }
    const uint16_t* xr = p.xr_tile(bh, t);
    p.g.gemm(rows, Dout, bkp, tw, Dout, Dout, true, p16.data(), value_step ? p.vr_tile(bh, t) : xr, acc);
    if (accx) p.g.gemm(rows, D, bkp, tw, D, D, true, p16.data(), xr, accx);
  }
}

// ---------------------------------------------------------------------------------------------
// Streaming retrieval for a few queries (kStreamMaxRows per pass, float32, D <= 16 kStreamMaxDC).
//
// With a handful of queries the GEMM formulation degenerates into matrix-vector products that
// MKL runs poorly on the AMD EPYC machines (its non-AVX-512 path), and it reads each tile of
// stored rows twice (scores, then P.X).  Here every block of 16 stored rows is loaded from
// memory once and used from L1 by all the queries, as keys and as values:
//   v_r  = x_r * xi_q as a 16-lane partial per row r (D/16 FMAs), folded into one score vector
//          s (lane r = row r) by a transpose-and-add tree (reduce16);
//   online softmax on s (block max; the running sum and accumulators rescaled when it grows);
//   acc += p_r x_r (broadcast p_r, D/16 FMAs per row; even and odd rows in separate registers
//          to halve the dependency chain), and with values acc_v += p_r v_r from the V rows.
// The running sum stays a 16-lane vector until the end (one horizontal add per call).
// ---------------------------------------------------------------------------------------------
constexpr int64_t kStreamMaxRows = 16;  // queries handled by one streaming pass over the rows
// Blocks of up to this many states stream, in groups of kStreamMaxRows (one pass over the stored
// rows per group); larger blocks take the GEMM kernels.  Packing X for the AVX-512 GEMM costs
// about one or two passes, and MKL on a lone block of 17 states ran ~6x slower than streaming
// 16 (S=17 against S=16, N=262144, D=64: 121-211 ms against 20-27 ms, same runs).
constexpr int64_t kStreamMaxS = 64;
constexpr int kStreamMaxDC = 8;         // D <= 8 * 16 = 128
constexpr int64_t kStreamBlock = 64;    // stored rows per online-softmax step of the stream
constexpr int64_t kStreamAhead = 2;     // blocks of 16 rows prefetched ahead (1, 2, 4, 8 measured)
// When a step streams more stored bytes than this (all (b, h) together), they come from DRAM,
// not L3, and the stream also prefetches kStreamFarAhead blocks of 16 rows ahead into L2.
// Measured (session 7, S=1 D=64 float32, 2 threads, interleaved in one process): N=262144 (64
// MiB) 1.409 -> 1.312 ms (4, 16, 32 blocks: 1.326, 1.326, 1.341), 1 thread 2.53 -> 2.46 ms;
// N=131072 (32 MiB) 0.633 -> 0.624 ms; but N=65536 (16 MiB, in L3) 0.155 -> 0.172 ms and
// 0.164 -> 0.172 ms, so not below.  (The L3 size sysconf reports in these VMs is the host's,
// 384 MiB, so the bound is a constant: the 32 MiB L3 of one Zen CCX.)
constexpr int64_t kStreamFarBytes = int64_t(32) << 20;
constexpr int64_t kStreamFarAhead = 8;

// Whether retrieve_range runs the streaming kernel for blocks of `rows` states of width D.
template <typename T>
bool streaming_applies(int64_t rows, int64_t D) {
#if defined(__AVX512F__)
  return std::is_same_v<T, float> && rows <= kStreamMaxS && D >= 1 && D <= 16 * kStreamMaxDC;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// Every cache line of [p, p + bytes) into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <int kHint = _MM_HINT_T0>
inline void prefetch_bytes(const float* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(kHint));
}

// Chunk c of a row: a plain load, masked for the last chunk when D is not a multiple of 16.
template <int DC, bool TAIL>
inline __m512 load_chunk(const float* p, int c, __mmask16 tail) {
  if constexpr (TAIL) {
    if (c == DC - 1) return _mm512_maskz_loadu_ps(tail, p + c * 16);
  }
  return _mm512_loadu_ps(p + c * 16);
}

// DC = ceil(D / 16) chunks per stored row, TAIL: D % 16 != 0 (otherwise D = 16 DC at compile
// time).  (m, l, acc, accx) as in retrieve_range; values: the step reads out through V [.., Dv].
template <int DC, bool TAIL>
void stream_range_f32(const float* xi, int64_t S, const float* X, const float* V, bool values, int64_t D_in,
                      int64_t Dv, int64_t n0, int64_t n1, float beta, float* m, float* l, float* acc,
                      float* accx, bool far) {
  constexpr int W = DC * 16;
  const int64_t D = TAIL ? D_in : W;
  const __mmask16 dtail = lanes_below(D - (DC - 1) * 16);
  // Where the X-weighted sum goes: acc without values, accx (when asked) with them.
  float* xsum = values ? accx : acc;
  const int64_t vchunks = (Dv + 15) / 16;
  const __mmask16 vtail = lanes_below(Dv - (vchunks - 1) * 16);
  alignas(64) float q[kStreamMaxRows * W];   // the states, zero-padded to W
  alignas(64) float xa[kStreamMaxRows * W];  // the X-weighted sums, padded
  alignas(64) float pbuf[kStreamBlock];
  alignas(64) float lsum[kStreamMaxRows * 16];
  float mq[kStreamMaxRows];
  for (int64_t r = 0; r < S; ++r) {
    for (int64_t d = 0; d < W; ++d) {
      q[r * W + d] = d < D ? xi[r * D + d] : 0.0f;
      xa[r * W + d] = (xsum != nullptr && d < D) ? xsum[r * D + d] : 0.0f;
    }
    for (int j = 0; j < 16; ++j) lsum[r * 16 + j] = j == 0 ? l[r] : 0.0f;
    mq[r] = m[r];
  }
  const __m512 vbeta = _mm512_set1_ps(beta);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Blocks of kStreamBlock stored rows (sub-blocks of 16 for the scores): one max, one rescale
  // and one exp pass per 64 rows instead of per 16.  Not timed on its own: S=1 N=65536 D=64 in
  // bench --quick went 0.90 -> 0.93x of attnkit softmax per step, within the noise.  (Prefetch
  // distance, same session, S=1 N=262144, 2 threads: 2, 4, 8, 16 blocks of 16 rows ahead gave
  // 1.60, 1.54, 1.68, 1.63 ms; 2 kept.)
  for (int64_t i0 = n0; i0 < n1; i0 += kStreamBlock) {
    const int64_t nr = std::min<int64_t>(kStreamBlock, n1 - i0);
    const float* rows = X + i0 * D;
    // Software prefetch kStreamAhead blocks of 16 rows ahead of each sub-block: the hardware
    // prefetcher alone left one thread at ~16 GB/s from DRAM (S=1, N=262144, D=64: 4.0 ms),
    // with it ~34 GB/s (2.0 ms).
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
      const int64_t a = i0 + r0 + kStreamAhead * 16;
      if (a + 16 <= n1) {
        prefetch_bytes(X + a * D, 16 * D * sizeof(float));
        if (values) prefetch_bytes(V + a * Dv, 16 * Dv * sizeof(float));
      }
      const int64_t f = i0 + r0 + kStreamFarAhead * 16;
      if (far && f + 16 <= n1) {
        prefetch_bytes<_MM_HINT_T1>(X + f * D, 16 * D * sizeof(float));
        if (values) prefetch_bytes<_MM_HINT_T1>(V + f * Dv, 16 * Dv * sizeof(float));
      }
    }
    for (int64_t qi = 0; qi < S; ++qi) {
      const float* qp = q + qi * W;
      __m512 sc[kStreamBlock / 16];
      __m512 bm = neg_inf;
      for (int64_t r0 = 0, sb = 0; r0 < nr; r0 += 16, ++sb) {
        const int64_t nb = std::min<int64_t>(16, nr - r0);
        const float* rb = rows + r0 * D;
        __m512 v[16];
        if (nb == 16) {
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            __m512 t = _mm512_mul_ps(load_chunk<DC, TAIL>(rb + r * D, 0, dtail), _mm512_load_ps(qp));
#pragma GCC unroll 8
            for (int c = 1; c < DC; ++c)
              t = _mm512_fmadd_ps(load_chunk<DC, TAIL>(rb + r * D, c, dtail), _mm512_load_ps(qp + c * 16), t);
            v[r] = t;
          }
        } else {
          for (int r = 0; r < 16; ++r) {
            __m512 t = _mm512_setzero_ps();
            if (r < nb)
              for (int c = 0; c < DC; ++c)
                t = _mm512_fmadd_ps(load_chunk<DC, TAIL>(rb + r * D, c, dtail), _mm512_load_ps(qp + c * 16), t);
            v[r] = t;
          }
        }
        sc[sb] = _mm512_mask_mov_ps(neg_inf, lanes_below(nb), _mm512_mul_ps(reduce16(v), vbeta));
        // NaN scores: vmaxps returns its second operand when either is NaN, so a NaN may be
        // dropped here; exp(NaN - m) below keeps it in the sum either way.
        bm = _mm512_max_ps(bm, sc[sb]);
      }
      const int64_t nsb = (nr + 15) / 16;
      const float bmax = _mm512_reduce_max_ps(bm);
      float* xq = xa + qi * W;
      float* lq = lsum + qi * 16;
      if (bmax > mq[qi]) {
        // exp(-inf) (first block) is 0, times a zero sum and zero accumulators.
        const float alpha = exp_nonpositive(mq[qi] - bmax);
        const __m512 va = _mm512_set1_ps(alpha);
        _mm512_store_ps(lq, _mm512_mul_ps(_mm512_load_ps(lq), va));
        if (xsum != nullptr)
          for (int c = 0; c < DC; ++c) _mm512_store_ps(xq + c * 16, _mm512_mul_ps(_mm512_load_ps(xq + c * 16), va));
        if (values) {
          float* a = acc + qi * Dv;
          for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
        }
        mq[qi] = bmax;
      }
      const __m512 mv = _mm512_set1_ps(finite_or_zero(mq[qi]));
      __m512 psum = _mm512_setzero_ps();
      for (int64_t sb = 0; sb < nsb; ++sb) {
        // Lanes past the last row hold -inf: zero them (exact 0 already unless m is NaN).
        const __m512 pv = _mm512_maskz_mov_ps(lanes_below(nr - sb * 16),
                                              exp_nonpositive_v(_mm512_sub_ps(sc[sb], mv)));
        psum = _mm512_add_ps(psum, pv);
        _mm512_store_ps(pbuf + sb * 16, pv);
      }
      _mm512_store_ps(lq, _mm512_add_ps(_mm512_load_ps(lq), psum));
      if (xsum != nullptr) {
        // The block's sum from zero, added to the running sum once (as in pv_tile).
        __m512 even[DC], odd[DC];
        for (int c = 0; c < DC; ++c) even[c] = odd[c] = _mm512_setzero_ps();
        int64_t r = 0;
#pragma GCC unroll 2
        for (; r + 2 <= nr; r += 2) {
          const __m512 p0 = _mm512_set1_ps(pbuf[r]), p1 = _mm512_set1_ps(pbuf[r + 1]);
#pragma GCC unroll 8
          for (int c = 0; c < DC; ++c) {
            even[c] = _mm512_fmadd_ps(p0, load_chunk<DC, TAIL>(rows + r * D, c, dtail), even[c]);
            odd[c] = _mm512_fmadd_ps(p1, load_chunk<DC, TAIL>(rows + (r + 1) * D, c, dtail), odd[c]);
          }
        }
        for (; r < nr; ++r) {
          const __m512 p0 = _mm512_set1_ps(pbuf[r]);
          for (int c = 0; c < DC; ++c)
            even[c] = _mm512_fmadd_ps(p0, load_chunk<DC, TAIL>(rows + r * D, c, dtail), even[c]);
        }
        for (int c = 0; c < DC; ++c)
          _mm512_store_ps(xq + c * 16, _mm512_add_ps(_mm512_load_ps(xq + c * 16), _mm512_add_ps(even[c], odd[c])));
      }
      if (values) {
        float* a = acc + qi * Dv;
        const float* vrows = V + i0 * Dv;
        for (int64_t c = 0; c < vchunks; ++c) {
          const __mmask16 mk = c == vchunks - 1 ? vtail : static_cast<__mmask16>(0xFFFF);
          __m512 t = _mm512_maskz_loadu_ps(mk, a + c * 16);
          for (int64_t r = 0; r < nr; ++r)
            t = _mm512_fmadd_ps(_mm512_set1_ps(pbuf[r]), _mm512_maskz_loadu_ps(mk, vrows + r * Dv + c * 16), t);
          _mm512_mask_storeu_ps(a + c * 16, mk, t);
        }
      }
    }
  }
  for (int64_t r = 0; r < S; ++r) {
    m[r] = mq[r];
    l[r] = _mm512_reduce_add_ps(_mm512_load_ps(lsum + r * 16));
    if (xsum != nullptr) std::memcpy(xsum + r * D, xa + r * W, sizeof(float) * D);
  }
}

// Runs the streaming kernel when it applies (few queries, D <= 128); false otherwise.
// far: the step's stored rows come from DRAM (see kStreamFarBytes).
bool stream_range(const float* xi, int64_t rows, const float* X, const float* V, int64_t D, int64_t Dout,
                         int64_t n0, int64_t n1, float beta, float* m, float* l, float* acc, float* accx, bool far) {
  if (!streaming_applies<float>(rows, D)) return false;
  // A read-out through values: a value step passes accx, or values that are not X itself.
  const bool values = V != X || accx != nullptr;
  const bool tail = D % 16 != 0;
  using Kernel = void (*)(const float*, int64_t, const float*, const float*, bool, int64_t, int64_t, int64_t,
                          int64_t, float, float*, float*, float*, float*, bool);
  Kernel kernel = nullptr;
  switch ((D + 15) / 16) {
#define ATTNKIT_STREAM_CASE(dc) \
  case dc: kernel = tail ? stream_range_f32<dc, true> : stream_range_f32<dc, false>; break;
    ATTNKIT_STREAM_CASE(1) ATTNKIT_STREAM_CASE(2) ATTNKIT_STREAM_CASE(3) ATTNKIT_STREAM_CASE(4)
    ATTNKIT_STREAM_CASE(5) ATTNKIT_STREAM_CASE(6) ATTNKIT_STREAM_CASE(7) ATTNKIT_STREAM_CASE(8)
#undef ATTNKIT_STREAM_CASE
    default: return false;
  }
  // Groups of kStreamMaxRows states, each with its own (m, l, acc, accx) rows.
  for (int64_t g = 0; g < rows; g += kStreamMaxRows)
    kernel(xi + g * D, std::min(kStreamMaxRows, rows - g), X, V, values, D, Dout, n0, n1, beta, m + g, l + g,
           acc + g * Dout, accx ? accx + g * D : nullptr, far);
  return true;
}
#endif  // __AVX512F__

// ---------------------------------------------------------------------------------------------
// AVX-512 GEMM kernels of the fused path (float32, D a multiple of 16, D <= 128).
//
// MKL's SGEMM runs its AVX2 Zen kernel on these AMD EPYCs (mkl_blas_def_sgemm_kernel_0_zen in
// perf): one tile step (256 states x 512 stored rows x D = 64, scores then P.X) measured 103
// GFLOP/s on one core against 234 for these register-blocked AVX-512 loops.  The stored patterns
// are packed once per call, transposed in groups of 16 rows ([group][D][16], zero-padded to a
// multiple of kPackRows rows), so a score micro-tile is 8 states x 32 rows: per d, two vector
// loads, eight broadcasts, sixteen FMAs.  P.X reads X in its own layout: a micro-tile of RB
// states x D, per stored row D/16 loads, RB broadcasts, RB * D/16 FMAs.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kPackRows = 32;  // packed stored patterns: padded to a multiple of this

template <typename T>
bool fast_gemm_applies(int64_t D) {
#if defined(__AVX512F__)
  return std::is_same_v<T, float> && D % 16 == 0 && D >= 16 && D <= 128;
#else
  return false;
#endif
}

inline int64_t packed_floats(int64_t N, int64_t D) { return (N + kPackRows - 1) / kPackRows * kPackRows * D; }

// Group g of X [N x D] packed as Xp [groups][D][16] (packed_floats(N, D) floats): rows
// 16g .. 16g+15 transposed, zeros past N.
inline void pack_group(const float* X, int64_t N, int64_t D, int64_t g, float* Xp) {
  float* out = Xp + g * D * 16;
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t i = g * 16 + p;
    for (int64_t d = 0; d < D; ++d) out[d * 16 + p] = i < N ? X[i * D + d] : 0.0f;
  }
}

#if defined(__AVX512F__)
// C[MR x 32] = alpha * A[MR x D] . (32 packed rows)^T; b0: the first of the two groups.
template <int MR>
inline void scores_tile(const float* A, int64_t D, const float* b0, float* C, int64_t ldc, __m512 alpha) {
  const float* b1 = b0 + D * 16;
  __m512 c0[MR], c1[MR];
  for (int i = 0; i < MR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < D; ++k) {
    const __m512 x0 = _mm512_loadu_ps(b0 + k * 16), x1 = _mm512_loadu_ps(b1 + k * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(A[i * D + k]);
      c0[i] = _mm512_fmadd_ps(a, x0, c0[i]);
      c1[i] = _mm512_fmadd_ps(a, x1, c1[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(C + i * ldc, _mm512_mul_ps(c0[i], alpha));
    _mm512_storeu_ps(C + i * ldc + 16, _mm512_mul_ps(c1[i], alpha));
  }
}

// C[rows x cols] = alpha * A[rows x D] . X_tile^T with X_tile packed (Bp: its first group, the
// tile starting at a multiple of kPackRows).  Columns up to cols rounded up to 32 are written
// (ldc must leave room; past N they hold 0).
inline void fast_scores(const float* A, int64_t rows, int64_t D, const float* Bp, int64_t cols, float* C,
                        int64_t ldc, float alpha) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t j0 = 0; j0 < cols; j0 += 32) {
    const float* b0 = Bp + (j0 / 16) * D * 16;
    int64_t r0 = 0;
    for (; r0 + 8 <= rows; r0 += 8) scores_tile<8>(A + r0 * D, D, b0, C + r0 * ldc + j0, ldc, va);
    const float* a = A + r0 * D;
    float* c = C + r0 * ldc + j0;
    switch (rows - r0) {
      case 1: scores_tile<1>(a, D, b0, c, ldc, va); break;
      case 2: scores_tile<2>(a, D, b0, c, ldc, va); break;
      case 3: scores_tile<3>(a, D, b0, c, ldc, va); break;
      case 4: scores_tile<4>(a, D, b0, c, ldc, va); break;
      case 5: scores_tile<5>(a, D, b0, c, ldc, va); break;
      case 6: scores_tile<6>(a, D, b0, c, ldc, va); break;
      case 7: scores_tile<7>(a, D, b0, c, ldc, va); break;
      default: break;
    }
  }
}

// acc[RB x D] += P[RB x K] . X[K x D], D = 16 DC.  The tile's sum starts from zero and is added
// to acc once: chained onto the running acc, the 16384 products of S=1024 N=16384 D=64 3 steps
// left 4.8e-6 relative error against float64 (torch SDPA: 7.8e-7).
template <int DC, int RB>
inline void pv_tile(const float* P, int64_t ldp, int64_t K, const float* X, float* acc) {
  constexpr int64_t D = DC * 16;
  __m512 c[RB][DC];
  for (int i = 0; i < RB; ++i)
    for (int d = 0; d < DC; ++d) c[i][d] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    __m512 x[DC];
    for (int d = 0; d < DC; ++d) x[d] = _mm512_loadu_ps(X + k * D + d * 16);
#pragma GCC unroll 12
    for (int i = 0; i < RB; ++i) {
      const __m512 p = _mm512_set1_ps(P[i * ldp + k]);
      for (int d = 0; d < DC; ++d) c[i][d] = _mm512_fmadd_ps(p, x[d], c[i][d]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int d = 0; d < DC; ++d)
      _mm512_storeu_ps(acc + i * D + d * 16, _mm512_add_ps(_mm512_loadu_ps(acc + i * D + d * 16), c[i][d]));
}

template <int DC>
void fast_pv_dc(const float* P, int64_t rows, int64_t K, int64_t ldp, const float* X, float* acc) {
  // Rows per micro-tile: RB x DC accumulators plus DC loaded rows within the 32 registers.
  constexpr int RB = DC <= 2 ? 12 : DC == 3 ? 8 : DC == 4 ? 6 : DC == 5 ? 4 : DC <= 7 ? 3 : 2;
  int64_t r0 = 0;
  for (; r0 + RB <= rows; r0 += RB) pv_tile<DC, RB>(P + r0 * ldp, ldp, K, X, acc + r0 * DC * 16);
  for (; r0 < rows; ++r0) pv_tile<DC, 1>(P + r0 * ldp, ldp, K, X, acc + r0 * DC * 16);
}

// acc[rows x D] += P[rows x K] . X[K x D] (fast_gemm_applies(D)).
inline void fast_pv(const float* P, int64_t rows, int64_t K, int64_t ldp, const float* X, int64_t D, float* acc) {
  switch (D / 16) {
    case 1: fast_pv_dc<1>(P, rows, K, ldp, X, acc); break;
    case 2: fast_pv_dc<2>(P, rows, K, ldp, X, acc); break;
    case 3: fast_pv_dc<3>(P, rows, K, ldp, X, acc); break;
    case 4: fast_pv_dc<4>(P, rows, K, ldp, X, acc); break;
    case 5: fast_pv_dc<5>(P, rows, K, ldp, X, acc); break;
    case 6: fast_pv_dc<6>(P, rows, K, ldp, X, acc); break;
    case 7: fast_pv_dc<7>(P, rows, K, ldp, X, acc); break;
    case 8: fast_pv_dc<8>(P, rows, K, ldp, X, acc); break;
    default: ATTNKIT_CHECK(false, "fast_pv: unsupported D ", D);
  }
}

// ---------------------------------------------------------------------------------------------
// States-in-lanes retrieval (float32, AVX-512, stored-space updates of the fused path).
//
// The kernels above multiply in the layout of the softmax attention kernel: a query row per
// micro-tile row, stored rows in the vector lanes.  That needs X packed transposed for the
// scores (a second copy of X, one pass over it per call), a horizontal max and a scalar online
// softmax per state row, and the states transposed nowhere.  Here a group of G = 16 NV states
// sits in the vector lanes instead, as xi^T [D][G], and the stored rows are read in place:
//   S^T [j][G]  = X_chunk [J x D] . xi^T          (broadcast X[j][d], G-wide vectors of xi^T)
//   per lane (= per state): chunk max, new running max m, alpha = 2^(m_old - m), p = 2^(s - m)
//   acc^T [D][G] = alpha * acc^T + X_chunk^T . P^T (broadcast X[j][d], G-wide vectors of P^T)
// Both products read the same J rows of X (from L1 for the second: X is key and value), the
// online softmax is lane-wise vector code (no horizontal reductions, no per-row branches), the
// chunk's rescale folds into the FMA that adds its partial sum, and xi^T is built once per step
// from the block's states (pre-scaled by beta * log2(e): the exponentials are base 2).
//
// Measured in a scratch build on one core of the 2-core EPYC (S=192 N=16384 D=64, one
// retrieval, best of 15): score GEMM 258 GFLOP/s, P.X 259 (both ~95% of the 272 GFLOP/s the
// core's FMAs peak at), the chunk softmax ~10% of the total; the row-layout kernels above: 225 /
// 240 GFLOP/s and the row softmax 0.66 ms against 0.35 ms per 3.1M scores.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kLaneGroup = 64;  // states per task: four vectors of lanes
// Stored rows per chunk: the chunk of X (16 KiB at D = 64) is read by the scores, then again by
// P.X from L1.  32, 48, 64 and 96 were within 3% of each other (scratch build, best of 15).
constexpr int64_t kLaneChunk = 64;

// 2^x for x <= 0 on 16 lanes: x = n + f, n = round(x) (vrndscaleps), f = x - n (vreduceps, one
// instruction, 0 for x = +-inf), |f| <= 1/2, 2^f by a degree-5 polynomial (least-squares fit on
// Chebyshev nodes of [-1/2, 1/2]: 1.0e-7 relative error in exact arithmetic, 2.3e-7 evaluated
// with float32 FMAs), times 2^n with vscalefps.  A score of -inf gives n = -inf, f = 0 and
// exactly 0 (0 * an infinite stored entry is NaN, as in the reference, not inf); 2^n underflows
// to 0 below -149 likewise; NaN stays NaN.  Against the degree-6 polynomial after a clamp at
// -200 and f = x - n (1.4e-7 relative in float32): one FMA and the clamp fewer, S=64 states
// N=4096 D=64 one retrieval on one core 2.3% faster (scratch A/B in one process), the update
// within 3.6e-7 absolute of it at |xi| ~ 2.5 -- below the 2.6e-6 by which the update moves when
// the chunk length changes from 64 to 32 rows (float32 summation order).
inline __m512 exp2_nonpositive_v(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.340043217e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.676037098e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550327214e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402210736e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472067e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000075f));
  return _mm512_scalef_ps(p, n);
}

// Rows of the micro-tiles for NV vectors of lanes: R x NV accumulators (<= 24) plus NV loads
// and one broadcast within the 32 registers.
template <int NV>
constexpr int lane_rows() {
  return NV == 4 ? 6 : NV == 3 ? 8 : 12;
}

// S^T[r][G] = X[r][0..D) . xi^T (r < R); mc = lane-wise max with the tile's scores (NaN may be
// dropped there: the exponentials carry it into the sum).
template <int R, int NV>
__attribute__((always_inline)) inline void lane_scores_tile(const float* X, int64_t D, const float* xiT,
                                                            float* S, __m512 (&mc)[NV]) {
  constexpr int G = NV * 16;
  __m512 c[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t d = 0; d < D; ++d) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(xiT + d * G + 16 * v);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(X[r * D + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    __m512 t = c[0][v];
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(S + r * G + 16 * v, c[r][v]);
      if (r > 0) t = _mm512_max_ps(t, c[r][v]);
    }
    mc[v] = _mm512_max_ps(mc[v], t);
  }
}

// acc^T[d0 + r][G] = alpha * acc^T[d0 + r][G] + sum_{j < J} X[j][d0 + r] P^T[j][G]  (r < R).  The
// chunk's sum starts from zero and is added once (see pv_tile on chaining onto the running sum).
template <int R, int NV>
__attribute__((always_inline)) inline void lane_pv_tile(const float* X, int64_t D, int64_t J, int64_t d0,
                                                        const float* P, float* accT, const __m512 (&alpha)[NV]) {
  constexpr int G = NV * 16;
  __m512 c[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t j = 0; j < J; ++j) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(P + j * G + 16 * v);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(X[j * D + d0 + r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* a = accT + (d0 + r) * G + 16 * v;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), alpha[v], c[r][v]));
    }
}

template <int NV>
__attribute__((noinline)) void lane_scores_chunk(const float* X, int64_t jn, int64_t D, const float* xiT, float* S,
                                                 __m512 (&mc)[NV]) {
  constexpr int G = NV * 16, R = lane_rows<NV>();
  int64_t j = 0;
  for (; j + R <= jn; j += R) lane_scores_tile<R, NV>(X + j * D, D, xiT, S + j * G, mc);
  if (j + 4 <= jn) {
    lane_scores_tile<4, NV>(X + j * D, D, xiT, S + j * G, mc);
    j += 4;
  }
  if (j + 2 <= jn) {
    lane_scores_tile<2, NV>(X + j * D, D, xiT, S + j * G, mc);
    j += 2;
  }
  for (; j < jn; ++j) lane_scores_tile<1, NV>(X + j * D, D, xiT, S + j * G, mc);
}

template <int NV>
__attribute__((noinline)) void lane_pv_chunk(const float* X, int64_t jn, int64_t D, const float* P, float* accT,
                                             const __m512 (&alpha)[NV]) {
  constexpr int R = lane_rows<NV>();
  int64_t d0 = 0;
  for (; d0 + R <= D; d0 += R) lane_pv_tile<R, NV>(X, D, jn, d0, P, accT, alpha);
  if (d0 + 4 <= D) {
    lane_pv_tile<4, NV>(X, D, jn, d0, P, accT, alpha);
    d0 += 4;
  }
  if (d0 + 2 <= D) {
    lane_pv_tile<2, NV>(X, D, jn, d0, P, accT, alpha);
    d0 += 2;
  }
  for (; d0 < D; ++d0) lane_pv_tile<1, NV>(X, D, jn, d0, P, accT, alpha);
}

// One retrieval of the G = 16 NV states xi^T [D][G] (scaled by beta log2(e)) over the N stored
// rows X [N][D]: m2 (running max, base 2), l [G] and acc^T [D][G] (unnormalised), from scratch.
// S: scratch of kLaneChunk x G.  Per lane exactly the online softmax of retrieve_range: the
// running max moves to max(m, chunk max) (a NaN chunk max leaves it), the sums are rescaled by
// 2^(m_old - m_new) (0 from m_old = -inf), the exponentials subtract m, or 0 while m is -inf.
template <int NV>
void lane_retrieve(const float* X, int64_t N, int64_t D, const float* xiT, float* accT, float* S, float* m2,
                   float* l) {
  constexpr int G = NV * 16;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mv[NV], lv[NV];
  for (int v = 0; v < NV; ++v) {
    mv[v] = ninf;
    lv[v] = _mm512_setzero_ps();
  }
  std::fill(accT, accT + D * G, 0.0f);
  for (int64_t j0 = 0; j0 < N; j0 += kLaneChunk) {
    const int64_t jn = std::min(kLaneChunk, N - j0);
    const float* Xc = X + j0 * D;
    __m512 mc[NV];
    for (int v = 0; v < NV; ++v) mc[v] = ninf;
    lane_scores_chunk<NV>(Xc, jn, D, xiT, S, mc);
    __m512 alpha[NV], sub[NV];
    for (int v = 0; v < NV; ++v) {
      const __m512 nm = _mm512_mask_mov_ps(mv[v], _mm512_cmp_ps_mask(mv[v], mc[v], _CMP_LT_OQ), mc[v]);
      // Lanes whose max did not move keep alpha = 1 exactly (also m = -inf or NaN: no -inf - -inf).
      const __mmask16 moved = _mm512_cmp_ps_mask(nm, mv[v], _CMP_NEQ_UQ);
      alpha[v] = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moved, exp2_nonpositive_v(_mm512_sub_ps(mv[v], nm)));
      mv[v] = nm;
      // Subtract the running max, or 0 while it is -inf (every score so far -inf: p = 0, not NaN).
      sub[v] = _mm512_mask_mov_ps(nm, _mm512_cmp_ps_mask(nm, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
    }
    // The chunk's sum starts from zero and is added to the running sum once: one lane is one
    // state, so summing straight onto l chained all N terms (S=256 N=4096 D=64: 7.5e-7 absolute
    // error of the update against float64, 4.5x torch's float32 matmul-softmax-matmul).
    __m512 cs[NV];
    for (int v = 0; v < NV; ++v) cs[v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < jn; ++j)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        float* s = S + j * G + 16 * v;
        const __m512 p = exp2_nonpositive_v(_mm512_sub_ps(_mm512_loadu_ps(s), sub[v]));
        _mm512_storeu_ps(s, p);
        cs[v] = _mm512_add_ps(cs[v], p);
      }
    for (int v = 0; v < NV; ++v) lv[v] = _mm512_fmadd_ps(lv[v], alpha[v], cs[v]);
    lane_pv_chunk<NV>(Xc, jn, D, S, accT, alpha);
  }
  for (int v = 0; v < NV; ++v) {
    _mm512_storeu_ps(m2 + 16 * v, mv[v]);
    _mm512_storeu_ps(l + 16 * v, lv[v]);
  }
}

// One retrieval of the G = 16 nv states of a task in the lanes layout, xiT [D][G] (the states
// times beta log2(e)): m2, l2 [G] (running max in base 2, sum) and accT [D][G] (unnormalised).
// Scratch S: kLaneChunk x G floats.
inline void lane_retrieval(int nv, const float* X, int64_t N, int64_t D, const float* xiT, float* accT, float* S,
                           float* m2, float* l2) {
  switch (nv) {
    case 1: lane_retrieve<1>(X, N, D, xiT, accT, S, m2, l2); break;
    case 2: lane_retrieve<2>(X, N, D, xiT, accT, S, m2, l2); break;
    case 3: lane_retrieve<3>(X, N, D, xiT, accT, S, m2, l2); break;
    default: lane_retrieve<4>(X, N, D, xiT, accT, S, m2, l2); break;
  }
}

// Row layout [rows][D] <-> lanes layout [D][G] (lanes past `rows` zero).
inline void rows_to_lanes(const float* src, int64_t rows, int64_t D, int64_t G, float* dst) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t q = 0; q < G; ++q) dst[d * G + q] = q < rows ? src[q * D + d] : 0.0f;
}

inline void lanes_to_rows(const float* src, int64_t rows, int64_t D, int64_t G, float* dst) {
  for (int64_t q = 0; q < rows; ++q)
    for (int64_t d = 0; d < D; ++d) dst[q * D + d] = src[d * G + q];
}
#endif  // __AVX512F__

// One retrieval of `rows` states xi [rows x D] over stored rows [n0, n1), folded into the
// running (m, l, acc) that the caller initialised (m = -inf, l = 0, acc = 0):
//   acc  [rows x Dout] = sum_i exp(s_i - m) V_i   with V = values (Dout = Dv) or X (Dout = D)
//   accx [rows x D]    = sum_i exp(s_i - m) X_i   (only when accx != nullptr, with values)
// scores: scratch of rows x kTileN.
template <typename T>
void retrieve_range(const T* xi, int64_t rows, const T* X, const T* V, int64_t D, int64_t Dout, int64_t n0,
                    int64_t n1, T beta, T* m, T* l, T* acc, T* accx, T* scores, const T* Xp = nullptr,
                    bool far = false) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (stream_range(xi, rows, X, V, D, Dout, n0, n1, beta, m, l, acc, accx, far)) return;
  }
#endif
  // The AVX-512 kernels run on the packed patterns (tiles start at multiples of kPackRows).
  const bool fast = Xp != nullptr && n0 % kPackRows == 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // AVX2 + FMA, few states: the scores as dot products of each state with the stored rows in
  // place and the read-out as P X (or P V, and P X when asked) on those rows (flash_tiles.h, the softmax
  // decode's tiles) rather than two BLAS calls a tile, which for one state are two
  // matrix-vector products reading the tile twice.  Measured (S=1 N=65536 D=64 float32, one
  // step, AMD EPYC Zen 3, 2 threads, old and new builds in alternating processes, 3 each):
  // 1.0-1.45 -> 0.80-0.99 ms a call (attnkit's softmax on the same call: 0.70-0.86 ms); with
  // values (Dv = 64, two steps: the value step also sums P X) 3.45-3.9 -> 3.05-3.36 ms.
  const bool dots = std::is_same_v<T, float> && rows <= kDotMaxRows;
#endif
  for (int64_t t0 = n0; t0 < n1; t0 += kTileN) {
    const int64_t bk = std::min(kTileN, n1 - t0);
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, float>) {
      if (dots) {
        decode_dots_avx2(xi, rows, D, X + t0 * D, D, bk, scores, kTileN);
        for (int64_t r = 0; r < rows; ++r) {
          T* s = scores + r * kTileN;
#pragma omp simd
          for (int64_t j = 0; j < bk; ++j) s[j] *= beta;
          fold_scores_row<T>(s, bk, m[r], l[r], acc + r * Dout, Dout, accx ? accx + r * D : nullptr, D);
        }
        decode_pv_avx2(rows, bk, scores, kTileN, V + t0 * Dout, Dout, acc, Dout);
        if (accx) decode_pv_avx2(rows, bk, scores, kTileN, X + t0 * D, D, accx, D);
        continue;
      }
    }
#endif
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (fast) fast_scores(xi, rows, D, Xp + t0 * D, bk, scores, kTileN, beta);
    }
#endif
    if (!fast) gemm_nt<T>(rows, bk, D, beta, xi, D, X + t0 * D, D, scores, kTileN);
    for (int64_t r = 0; r < rows; ++r)
      fold_scores_row(scores + r * kTileN, bk, m[r], l[r], acc + r * Dout, Dout, accx ? accx + r * D : nullptr, D);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (fast) {
        if (V == X)
          fast_pv(scores, rows, bk, kTileN, X + t0 * D, D, acc);
        else
          gemm_nn_acc<T>(rows, Dout, bk, scores, kTileN, V + t0 * Dout, Dout, acc, Dout);
        if (accx) fast_pv(scores, rows, bk, kTileN, X + t0 * D, D, accx);
        continue;
      }
    }
#endif
    gemm_nn_acc<T>(rows, Dout, bk, scores, kTileN, V + t0 * Dout, Dout, acc, Dout);
    if (accx) gemm_nn_acc<T>(rows, D, bk, scores, kTileN, X + t0 * D, D, accx, D);
  }
}

// Where one query row stands after retrieval k (shared by both decompositions).
template <typename T>
struct UpdateCtx {
  int64_t B, H, BH, S, N, D, Dv, R, U;
  T beta;
  double tol;  // < 0: none
  bool has_values, final_state;
  const T* X;       // [BH, N, D]
  const T* V;       // [BH, N, Dv] or nullptr
  T* out;           // [BH, S, Dout]
  T* states;        // [steps + 1, BH, S, D]
  T* lse;           // [R, BH, S]
  bool* applied;    // [U, BH, S]
  const T* init;    // [BH, S, D]: the initial states (states[0] before the kernel fills it, see below)
  // The brgemm path (bfloat16 / float16 inputs, T = float): the stored rows packed as 16-bit
  // operands, X and V then null; nullptr: the native kernels on X and V.
  const Stored16* p16 = nullptr;
  // Native path, bfloat16 / float16 inputs, on builds without the AVX-512 kernels (those read X
  // as float32 in place): the stored rows (and values) stay 16-bit, X and V then null, and each
  // retrieval converts them a tile of rows at a time (retrieve_converted).
  const void* X16 = nullptr;
  const void* V16 = nullptr;
  bool bf16 = false;
};

// Converting X up front wrote a float32 copy twice the size of a bfloat16 X, and every
// retrieval then read that: with one query the call streamed ~3x the bytes it needs.  Measured
// (S=1 N=262144 D=64 bfloat16, AMD EPYC Zen 3, AVX2, `bench --family hopfield`): 9.6 ms against
// 5.2 ms for attnkit's own softmax per step.  Here a tile of kTileN rows is converted into a
// per-thread buffer that stays in L2 while retrieve_range reads it (convert_row, flash_tiles.h:
// vector conversions of both 16-bit types).

inline void retrieve_converted(const UpdateCtx<float>& c, int64_t bh, bool value_step, const float* xi,
                               int64_t rows, int64_t n0, int64_t n1, float* m, float* l, float* acc, float* accx,
                               float* scores) {
  thread_local avec<float> xbuf, vbuf;
  const int64_t D = c.D, Dv = c.Dv, Dout = value_step ? Dv : D;
  xbuf.resize(static_cast<size_t>(kTileN * D));
  if (value_step) vbuf.resize(static_cast<size_t>(kTileN * Dv));
  for (int64_t c0 = n0; c0 < n1; c0 += kTileN) {
    const int64_t cn = std::min(kTileN, n1 - c0);
    const int64_t xoff = (bh * c.N + c0) * D, voff = (bh * c.N + c0) * Dv;
    if (c.bf16) {
      convert_row(static_cast<const at::BFloat16*>(c.X16) + xoff, 1, cn * D, xbuf.data());
      if (value_step) convert_row(static_cast<const at::BFloat16*>(c.V16) + voff, 1, cn * Dv, vbuf.data());
    } else {
      convert_row(static_cast<const at::Half*>(c.X16) + xoff, 1, cn * D, xbuf.data());
      if (value_step) convert_row(static_cast<const at::Half*>(c.V16) + voff, 1, cn * Dv, vbuf.data());
    }
    // The running (m, l, acc) carry over from tile to tile: one online softmax over [n0, n1).
    retrieve_range<float>(xi, rows, xbuf.data(), value_step ? vbuf.data() : xbuf.data(), D, Dout, 0, cn, c.beta,
                          m, l, acc, accx, scores);
  }
}

// One retrieval of rows [n0, n1) of (b, h) bh (retrieve_range's arguments; value_step: the read-out
// through the values) on the call's path: retrieve_range16 on the brgemm path, else retrieve_range.
template <typename T>
void retrieve(const UpdateCtx<T>& c, int64_t bh, bool value_step, const T* xi, int64_t rows, int64_t n0, int64_t n1,
              T* m, T* l, T* acc, T* accx, T* scores, const T* Xp, bool far) {
  if constexpr (std::is_same_v<T, float>) {
    if (c.p16 != nullptr) {
      retrieve_range16(*c.p16, bh, value_step, xi, rows, n0, n1, c.beta, m, l, acc, accx, scores);
      return;
    }
    if (c.X16 != nullptr) {
      retrieve_converted(c, bh, value_step, xi, rows, n0, n1, m, l, acc, accx, scores);
      return;
    }
  }
  const T* X = c.X + bh * c.N * c.D;
  const T* V = value_step ? c.V + bh * c.N * c.Dv : X;
  retrieve_range<T>(xi, rows, X, V, c.D, value_step ? c.Dv : c.D, n0, n1, c.beta, m, l, acc, accx, scores, Xp, far);
}

// parallel_tasks, or on the brgemm path parallel_tasks_on (its workers release oneDNN's state).
template <typename T, typename F>
void update_tasks(const UpdateCtx<T>& c, int64_t tasks, const F& body) {
  if (c.p16 != nullptr)
    parallel_tasks_on(c.p16->g.path, tasks, body);
  else
    parallel_tasks(tasks, body);
}

// Whether a step streams more stored bytes (X, and V on a value step, over every (b, h)) than
// kStreamFarBytes: then they come from DRAM and the stream prefetches further ahead into L2.
template <typename T>
bool streams_from_dram(const UpdateCtx<T>& c, bool value_step) {
  const int64_t row_bytes = (c.D + (value_step ? c.Dv : 0)) * int64_t(sizeof(T));
  return c.BH * c.N * row_bytes > kStreamFarBytes;
}

// Finish retrieval k for rows [q0, q0 + rows) of (b, h) bh from the merged (m, l, acc, accx):
// writes lse, applies the update (with tol) to xi and active, writes states[k + 1] / out.
template <typename T>
void finish_step(const UpdateCtx<T>& c, int64_t bh, int64_t q0, int64_t rows, int64_t k, const T* m, const T* l,
                 const T* acc, const T* accx, T* xi, bool* active) {
  const int64_t D = c.D;
  const bool value_step = c.has_values && k == c.R - 1;
  const int64_t plane = c.BH * c.S;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = bh * c.S + q0 + r;
    const T inv = T(1) / l[r];
    c.lse[k * plane + row] = m[r] + std::log(l[r]);
    if (value_step) {
      T* o = c.out + row * c.Dv;
      const T* a = acc + r * c.Dv;
      for (int64_t d = 0; d < c.Dv; ++d) o[d] = a[d] * inv;
    }
    const T* src = value_step ? accx : acc;
    T* x = xi + r * D;
    if (src != nullptr) {
      const T* a = src + r * D;
      if (!value_step) c.applied[k * plane + row] = active[r];
      if (active[r]) {
        T change = 0;
        for (int64_t d = 0; d < D; ++d) {
          const T nv = a[d] * inv;
          const T diff = std::abs(nv - x[d]);
          change = (diff > change || std::isnan(diff)) ? diff : change;
          x[d] = nv;
        }
        if (c.tol >= 0 && !(change > static_cast<T>(c.tol))) active[r] = false;
      }
      std::memcpy(c.states + ((k + 1) * plane + row) * D, x, sizeof(T) * D);
    }
  }
}


// The energy's constant term needs max_i ||x_i||^2 per (b, h), in double (the cancellation
// fallback): the largest squared norm of rows [0, rows) of X [rows][D] (a NaN norm wins: std::max
// would drop it) ...
template <typename T>
double max_row_norm_sq(const T* X, int64_t rows, int64_t D) {
  double best = 0;
  for (int64_t p = 0; p < rows; ++p) {
    double sq = 0;
    for (int64_t d = 0; d < D; ++d) sq += static_cast<double>(X[p * D + d]) * static_cast<double>(X[p * D + d]);
    best = (sq > best || std::isnan(sq)) ? sq : best;
  }
  return best;
}

// ... and the maxima of `parts` consecutive partial maxima per (b, h), NaN winning as above.
inline avec<double> max_per_head(const avec<double>& part, int64_t BH, int64_t parts) {
  avec<double> out(static_cast<size_t>(BH), 0.0);
  for (int64_t i = 0; i < BH * parts; ++i) {
    double& best = out[i / parts];
    best = (part[i] > best || std::isnan(part[i])) ? part[i] : best;
  }
  return out;
}

// Rows of a block skip retrieval k: every row frozen (only possible for stored-space updates).
template <typename T>
void skip_step(const UpdateCtx<T>& c, int64_t bh, int64_t q0, int64_t rows, int64_t k, const T* xi) {
  const int64_t plane = c.BH * c.S;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = bh * c.S + q0 + r;
    c.lse[k * plane + row] = std::numeric_limits<T>::infinity();
    if (k < c.U) c.applied[k * plane + row] = false;
    std::memcpy(c.states + ((k + 1) * plane + row) * c.D, xi + r * c.D, sizeof(T) * c.D);
  }
}

template <typename T>
bool all_frozen(const UpdateCtx<T>& c, const bool* active, int64_t rows) {
  if (c.tol < 0) return false;
  for (int64_t r = 0; r < rows; ++r)
    if (active[r]) return false;
  return true;
}

// parallel_tasks (parallel_tasks.h) runs every parallel part of this file.

// ---------------------------------------------------------------------------------------------
// The energy on the update's AVX-512 GEMM kernels (float32, fast_gemm_applies(D)).
//
// The register-blocked 8 x 16 tiles of energy_kernel ran at ~45 GFLOP/s on one core (S=256
// N=4096 D=64: 2.97 ms against the plain PyTorch formula's 2.80 ms, same process): per d one
// 16-wide load and 8 broadcasts for 8 FMAs, and a scalar-indexed fold per tile of 16 patterns.
// Here the stored patterns are packed once per (b, h) as for the update, and a task of
// kEnergyRows states walks tiles of kEnergyTile patterns: fast_scores (8 x 32 micro-tiles, two
// loads and eight broadcasts for sixteen FMAs), then per row the vectorized max and exp sum.
// ---------------------------------------------------------------------------------------------
constexpr int64_t kEnergyRows = 64;
constexpr int64_t kEnergyTile = 256;  // a multiple of kPackRows (tiles start on packed groups)

// Folds a row of bk scores sr (times beta) into the row's running (m, l) of the log-sum-exp (sr
// is overwritten).
inline void energy_fold_row(float* sr, int64_t bk, float& m, float& l) {
  const float tile_max = scores_max(sr, bk);
  if (tile_max > m) {
    l *= exp_nonpositive(m - tile_max);  // exp(-inf) = 0 on the first tile
    m = tile_max;
  }
  const float mq = finite_or_zero(m);
  if (mq == std::numeric_limits<float>::infinity()) {
    // lse = +inf unless a score is NaN (see energy_kernel).
    for (int64_t j = 0; j < bk; ++j) l += sr[j] == mq ? 1.0f : exp_nonpositive(sr[j] - mq);
  } else {
    l += exp_sum_inplace(sr, bk, mq);
  }
}

bool energy_fast(const float* state, const float* stored, float* energy, float* lse, int64_t BH, int64_t S,
                 int64_t N, int64_t D, double beta_in) {
#if defined(__AVX512F__)
  if (!fast_gemm_applies<float>(D)) return false;
  const float beta = static_cast<float>(beta_in);
  const int64_t stride = packed_floats(N, D);
  const int64_t groups = stride / (16 * D);
  std::unique_ptr<float[]> packed(new float[BH * stride]);
  // Per group of 16 patterns, the largest squared norm (double, NaN kept); reduced per (b, h).
  avec<double> group_max(BH * groups);
  // (Tasks on OpenMP threads: see parallel_tasks for why not on inter-op helpers.)
  constexpr int64_t kPackBlock = 64;  // groups of 16 patterns per packing task
  const int64_t pack_tasks = (BH * groups + kPackBlock - 1) / kPackBlock;
  parallel_tasks(pack_tasks, [&](int64_t pt) {
    for (int64_t i = pt * kPackBlock; i < std::min(BH * groups, (pt + 1) * kPackBlock); ++i) {
      const int64_t bh = i / groups, g = i % groups;
      const float* X = stored + bh * N * D;
      pack_group(X, N, D, g, packed.get() + bh * stride);
      group_max[i] = max_row_norm_sq(X + g * 16 * D, std::min<int64_t>(16, N - g * 16), D);
    }
  });
  const avec<double> max_sq = max_per_head(group_max, BH, groups);
  const int64_t qblocks = (S + kEnergyRows - 1) / kEnergyRows;
  parallel_tasks(BH * qblocks, [&](int64_t task) {
    thread_local avec<float> scores;
    scores.resize(kEnergyRows * kEnergyTile);
    avec<double> fallback;         // the cancellation fallback's scratch, allocated on first use
    const int64_t bh = task / qblocks, q0 = (task % qblocks) * kEnergyRows;
    const int64_t rows = std::min(kEnergyRows, S - q0);
    const float* xi = state + (bh * S + q0) * D;
    const float* Xp = packed.get() + bh * stride;
    float m[kEnergyRows], l[kEnergyRows];
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.0f);
    for (int64_t t0 = 0; t0 < N; t0 += kEnergyTile) {
      const int64_t bk = std::min(kEnergyTile, N - t0);
      fast_scores(xi, rows, D, Xp + t0 * D, bk, scores.data(), kEnergyTile, beta);
      for (int64_t r = 0; r < rows; ++r) energy_fold_row(scores.data() + r * kEnergyTile, bk, m[r], l[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* q_row = xi + r * D;
      float sq = 0;
      for (int64_t d = 0; d < D; ++d) sq += q_row[d] * q_row[d];
      const int64_t row = bh * S + q0 + r;
      finish_energy_row<float, float>(m[r], l[r], sq, max_sq[bh], beta_in, q_row, stored + bh * N * D, N, D,
                                      fallback, lse + row, energy + row);
    }
  });
  return true;
#else
  return false;
#endif
}

// The energy on the brgemm path (bfloat16 / float16 inputs; see Gemm16): energy_fast's walk, with
// the scores by brgemm16 on the 16-bit inputs themselves (exact products, float32 sums, as in
// energy_kernel).  The patterns are packed once per (b, h) in tiles X^T [Dp][tw] of kEnergyTile,
// a task's state rows as A [rows][Dp]; D is zero-padded to Dp, a multiple of 32, in both: a state
// row may hold a NaN (the K-tail guard, gemm_path.h).
template <typename scalar_t>
void energy_brgemm(const scalar_t* state, const scalar_t* stored, float* energy, float* lse, int64_t BH, int64_t S,
                   int64_t N, int64_t D, double beta_in, GemmPath path) {
  const Gemm16 g{path, std::is_same_v<scalar_t, at::BFloat16>};
  const float beta = static_cast<float>(beta_in);
  const int64_t Dp = round_up(D, 32), tiles = ceil_div(N, kEnergyTile);
  const int64_t tw = std::min(kEnergyTile, round_up(N, 32));
  avec<uint16_t> packed(static_cast<size_t>(BH * tiles * Dp * tw), 0);         // the padding stays zero
  avec<double> tile_max_sq(BH * tiles);         // the largest squared norm per tile (double, NaN kept)
  parallel_tasks(BH * tiles, [&](int64_t i) {
    const int64_t bh = i / tiles, r0 = (i % tiles) * kEnergyTile, kn = std::min(kEnergyTile, N - r0);
    const scalar_t* X = stored + (bh * N + r0) * D;
    pack_transposed_pairs(X, D, 1, kn, D, packed.data() + i * Dp * tw, tw, g.pairs());
    tile_max_sq[i] = max_row_norm_sq(X, kn, D);
  });
  const avec<double> max_sq = max_per_head(tile_max_sq, BH, tiles);
  const int64_t qblocks = ceil_div(S, kEnergyRows);
  parallel_tasks_on(path, BH * qblocks, [&](int64_t task) {
    thread_local avec<float> scores;
    thread_local avec<uint16_t> a16;
    scores.resize(kEnergyRows * kEnergyTile);
    a16.resize(static_cast<size_t>(kEnergyRows * Dp));
    avec<double> fallback;         // the cancellation fallback's scratch, allocated on first use
    const int64_t bh = task / qblocks, q0 = (task % qblocks) * kEnergyRows;
    const int64_t rows = std::min(kEnergyRows, S - q0);
    const scalar_t* xi = state + (bh * S + q0) * D;
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* a = a16.data() + r * Dp;
      for (int64_t d = 0; d < D; ++d) a[d] = bits16(xi[r * D + d]);
      std::fill(a + D, a + Dp, uint16_t(0));
    }
    float m[kEnergyRows], l[kEnergyRows];
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.0f);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t bk = std::min(kEnergyTile, N - t * kEnergyTile);
      g.gemm(rows, bk, Dp, Dp, tw, kEnergyTile, false, a16.data(), packed.data() + (bh * tiles + t) * Dp * tw,
             scores.data());
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * kEnergyTile;
        for (int64_t j = 0; j < bk; ++j) sr[j] *= beta;
        energy_fold_row(sr, bk, m[r], l[r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* q_row = xi + r * D;
      float sq = 0;
      for (int64_t d = 0; d < D; ++d) sq += static_cast<float>(q_row[d]) * static_cast<float>(q_row[d]);
      const int64_t row = bh * S + q0 + r;
      finish_energy_row<scalar_t, float>(m[r], l[r], sq, max_sq[bh], beta_in, q_row, stored + bh * N * D, N, D,
                                         fallback, lse + row, energy + row);
    }
  });
}

// Queries per fused task: kBlockQ, halved (down to kMinBlockQ) until there are at least two
// tasks per thread.  With one (b, h) and S = 256 a single 256-row block left one of the two
// cores idle (bench --quick: 8.6 ms against 4.8 ms for attnkit softmax once per step, which
// takes 64-query blocks); every block reads the stored patterns once per step, so blocks stay
// as large as the thread count allows.  Not below 128: blocks of <= kStreamMaxS = 64 rows take
// the streaming kernel, which at 64 rows ran 0.6x of the softmax peer (S=256 N=4096 D=64 3
// steps, one thread, two runs: 13.1 / 14.0 ms against 128-row blocks' 8.4 / 8.3 ms).
// row_exact: each state's arithmetic is the same whatever block it is in (the AVX-512 kernels
// of this file).  Otherwise MKL's SGEMM / DGEMM multiply the blocks, and their summation order
// can change with a block's row count: an Intel Xeon build for x86-64-v3 gave results that
// differed between 1 and 2 threads (S=150: one block of 150 rows, or 128 + 22; issue 24).  The
// blocks then have a size that does not depend on the thread count, kMinBlockQ (two tasks for
// S=256 on one (b, h), as the halving gives on two threads; a single thread reads X once more
// per step for S > 128).
constexpr int64_t kMinBlockQ = 128;

int64_t fused_block_rows(int64_t BH, int64_t S, bool row_exact) {
  if (!row_exact) return kMinBlockQ;
  int64_t rows = kBlockQ;
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  while (rows > kMinBlockQ && BH * ((S + rows - 1) / rows) < want) rows /= 2;
  return rows;
}

// Whether the fused path runs its stored-space updates on the states-in-lanes kernel
// (lane_retrieval): float32 on AVX-512, no values, blocks too large for the streaming kernel.
// S=256 N=4096 D=64 3 steps, one thread, same process: 3.5 ms against 4.0 ms for the packed
// row-layout kernels (S=1024 N=16384: 55 ms against 65 ms).
template <typename T>
bool lanes_apply(const UpdateCtx<T>& c) {
#if defined(__AVX512F__)
  return std::is_same_v<T, float> && c.p16 == nullptr && !c.has_values && c.S > kStreamMaxS &&
         c.D <= 16 * kStreamMaxDC;
#else
  return false;
#endif
}

template <typename T>
void update_lanes(const UpdateCtx<T>& c) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const int64_t D = c.D;
    // States per task: 64, halved (down to one vector, 16) until there are at least two tasks
    // per thread, so that a few (b, h) with S <= 128 still occupy every thread (the tasks are
    // handed out dynamically; the narrower micro-tiles ran ~5% slower in the scratch build).
    int64_t group = kLaneGroup;
    const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
    while (group > 16 && c.BH * ((c.S + group - 1) / group) < want) group /= 2;
    const int64_t qblocks = (c.S + group - 1) / group;
    const int64_t plane = c.BH * c.S;
    // beta log2(e) folded into the states (the scores come out in base 2): one rounding of each
    // state entry, within the float32 score rounding the tests allow.
    const __m512 scale = _mm512_set1_ps(static_cast<float>(static_cast<double>(c.beta) * 1.4426950408889634));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 tolv = _mm512_set1_ps(static_cast<float>(c.tol));
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const auto body = [&](int64_t task) {
      // Thread-local scratch, all in the lanes layout [D][G]: the block's states (exact), the
      // scaled states of the current step, the retrieval's sums; the chunk's scores; m2, l2.
      // The states stay in lanes across the steps: the update, the tol test and the scaling for
      // the next step are lane-wise vector code; only the rows written out (states[k + 1] for
      // the backward, out) are transposed.  (The row-layout version transposed the states in
      // and the sums out every step and ran finish_step's scalar loop: S=256 N=4096 D=64 3 steps
      // on one thread, 3.47 ms against 12 x 0.28 ms for the retrievals alone.)
      thread_local avec<float> xT, xiT, accT, S, m2, l2;
      xT.resize(kLaneGroup * D); xiT.resize(kLaneGroup * D); accT.resize(kLaneGroup * D);
      S.resize(kLaneChunk * kLaneGroup); m2.resize(kLaneGroup); l2.resize(kLaneGroup);
      const int64_t bh = task / qblocks;
      const int64_t q0 = (task % qblocks) * group;
      const int64_t rows = std::min(group, c.S - q0);
      const int nv = static_cast<int>((rows + 15) / 16);
      const int64_t G = 16 * nv;
      const int64_t row0 = bh * c.S + q0;
      std::memcpy(c.states + row0 * D, c.init + row0 * D, sizeof(float) * rows * D);
      rows_to_lanes(c.init + row0 * D, rows, D, G, xT.data());
      __mmask16 active[4];  // per vector of lanes: the rows not frozen by tol
      for (int v = 0; v < 4; ++v) active[v] = v < nv ? lanes_below(rows - 16 * v) : 0;
      const float* X = c.X + bh * c.N * D;
      const float ln2 = 0.6931471805599453f;
      for (int64_t k = 0; k < c.R; ++k) {
        float* states_out = c.states + ((k + 1) * plane + row0) * D;
        bool any = false;
        for (int v = 0; v < nv; ++v) any |= active[v] != 0;
        if (c.tol >= 0 && !any) {  // every row frozen: skip the retrieval (as skip_step)
          for (int64_t q = 0; q < rows; ++q) {
            c.lse[k * plane + row0 + q] = std::numeric_limits<float>::infinity();
            c.applied[k * plane + row0 + q] = false;
          }
          lanes_to_rows(xT.data(), rows, D, G, states_out);
          continue;
        }
        for (int64_t i = 0; i < D * G; i += 16)
          _mm512_storeu_ps(xiT.data() + i, _mm512_mul_ps(_mm512_loadu_ps(xT.data() + i), scale));
        lane_retrieval(nv, X, c.N, D, xiT.data(), accT.data(), S.data(), m2.data(), l2.data());
        // lse, applied: per row, as finish_step.
        for (int64_t q = 0; q < rows; ++q) {
          c.lse[k * plane + row0 + q] = m2[q] * ln2 + std::log(l2[q]);
          c.applied[k * plane + row0 + q] = (active[q / 16] >> (q % 16)) & 1;
        }
        // The update of the active lanes, xi = acc / l (times 1 / l, as finish_step), and the
        // largest change per lane; a NaN change freezes the row as in finish_step.
        for (int v = 0; v < nv; ++v) {
          const __m512 inv = _mm512_div_ps(one, _mm512_loadu_ps(l2.data() + 16 * v));
          __m512 change = _mm512_setzero_ps();
          __mmask16 nan = 0;
          for (int64_t d = 0; d < D; ++d) {
            float* x = xT.data() + d * G + 16 * v;
            const __m512 old = _mm512_loadu_ps(x);
            const __m512 nv_ = _mm512_mul_ps(_mm512_loadu_ps(accT.data() + d * G + 16 * v), inv);
            const __m512 diff = _mm512_and_ps(_mm512_sub_ps(nv_, old), abs_mask);
            nan |= _mm512_cmp_ps_mask(diff, diff, _CMP_UNORD_Q);
            change = _mm512_max_ps(diff, change);
            _mm512_storeu_ps(x, _mm512_mask_mov_ps(old, active[v], nv_));
          }
          if (c.tol >= 0) active[v] &= _mm512_cmp_ps_mask(change, tolv, _CMP_GT_OQ) & static_cast<__mmask16>(~nan);
        }
        lanes_to_rows(xT.data(), rows, D, G, states_out);
      }
      lanes_to_rows(xT.data(), rows, D, G, c.out + row0 * D);
    };
    parallel_tasks(c.BH * qblocks, body);
  }
#endif
}

template <typename T>
void update_fused(const UpdateCtx<T>& c) {
  if (lanes_apply(c)) {
    update_lanes(c);
    return;
  }
  // Row-exact: the AVX-512 kernels throughout (no values: their read-out goes through BLAS).  Not
  // the brgemm path: whether oneDNN's sums of a row depend on the block's row count is not known.
  const bool brgemm = c.p16 != nullptr;
  const int64_t block = fused_block_rows(c.BH, c.S, !brgemm && fast_gemm_applies<T>(c.D) && !c.has_values);
  const int64_t qblocks = (c.S + block - 1) / block;
  const int64_t D = c.D;
  // The stored patterns packed for the AVX-512 kernels, once for all steps and query blocks
  // (only when some block has more rows than the streaming kernel takes).
  // Uninitialised storage (every float is written by the packing), split over the threads by
  // groups of 16 rows: with few states and a long memory the packing costs about one pass of
  // the scores over X.
  std::unique_ptr<T[]> packed;
  const int64_t pack_stride = packed_floats(c.N, D);
  if (!brgemm && fast_gemm_applies<T>(D) && c.S > kStreamMaxS) {
    if constexpr (std::is_same_v<T, float>) {
      packed.reset(new float[c.BH * pack_stride]);
      const int64_t groups = pack_stride / (16 * D);
      at::parallel_for(0, c.BH * groups, 256, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t bh = i / groups, g = i % groups;
          pack_group(c.X + bh * c.N * D, c.N, D, g, packed.get() + bh * pack_stride);
        }
      });
    }
  }
  const auto body = [&](int64_t task) {
    // Thread-local buffers: the block's states, the running softmax and the score tile.
    thread_local avec<T> xi, m, l, scores, acc, accx;
    xi.resize(kBlockQ * D); m.resize(kBlockQ); l.resize(kBlockQ); scores.resize(kBlockQ * kTileN);
    acc.resize(kBlockQ * std::max(D, c.Dv)); accx.resize(c.final_state ? kBlockQ * D : 0);
    bool active[kBlockQ];
    {
      const int64_t bh = task / qblocks;
      const int64_t q0 = (task % qblocks) * block;
      const int64_t rows = std::min(block, c.S - q0);
      std::memcpy(xi.data(), c.states + (bh * c.S + q0) * D, sizeof(T) * rows * D);
      std::fill(active, active + rows, true);
      for (int64_t k = 0; k < c.R; ++k) {
        const bool value_step = c.has_values && k == c.R - 1;
        if (!value_step && all_frozen(c, active, rows)) {
          skip_step(c, bh, q0, rows, k, xi.data());
          continue;
        }
        const int64_t Dout = value_step ? c.Dv : D;
        T* ax = value_step && c.final_state ? accx.data() : nullptr;
        std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
        std::fill(l.begin(), l.end(), T(0));
        std::fill(acc.begin(), acc.begin() + rows * Dout, T(0));
        if (ax) std::fill(accx.begin(), accx.end(), T(0));
        retrieve<T>(c, bh, value_step, xi.data(), rows, 0, c.N, m.data(), l.data(), acc.data(), ax, scores.data(),
                    packed ? packed.get() + bh * pack_stride : nullptr, streams_from_dram(c, value_step));
        finish_step<T>(c, bh, q0, rows, k, m.data(), l.data(), acc.data(), ax, xi.data(), active);
      }
      if (!c.has_values) {
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(c.out + (bh * c.S + q0 + r) * D, xi.data() + r * D, sizeof(T) * D);
      }
    }
  };
  update_tasks(c, c.BH * qblocks, body);
}

template <typename T>
void update_split(const UpdateCtx<T>& c) {
  const int64_t S = c.S, D = c.D;
  const int64_t chunks = (c.N + kSplitRows - 1) / kSplitRows;
  const int64_t W = std::max(D, c.Dv);
  avec<T> xi(c.BH * S * D);
  std::memcpy(xi.data(), c.states, sizeof(T) * c.BH * S * D);
  std::vector<char> active_store(c.BH * S, 1);
  bool* active = reinterpret_cast<bool*>(active_store.data());
  // Partials per (bh, chunk): m, l [S]; acc [S, Dout] in a slot of S * W; accx [S, D].
  avec<T> pm(c.BH * chunks * S), pl(c.BH * chunks * S), pacc(c.BH * chunks * S * W);
  avec<T> paccx(c.final_state ? c.BH * chunks * S * D : 0);
  std::vector<char> skip(c.BH, 0);
  const bool streams = c.p16 == nullptr && streaming_applies<T>(S, D);
  for (int64_t k = 0; k < c.R; ++k) {
    const bool value_step = c.has_values && k == c.R - 1;
    const int64_t Dout = value_step ? c.Dv : D;
    const bool want_x = value_step && c.final_state;
    const bool far = streams_from_dram(c, value_step);
    for (int64_t bh = 0; bh < c.BH; ++bh) skip[bh] = !value_step && all_frozen(c, active + bh * S, S);
    auto chunk_task = [&](int64_t task) {
      thread_local avec<T> scores;
      if (!streams) scores.resize(S * kTileN);
      {
        const int64_t bh = task / chunks, ch = task % chunks;
        if (skip[bh]) return;
        T* m = pm.data() + task * S;
        T* l = pl.data() + task * S;
        T* acc = pacc.data() + task * S * W;
        T* ax = want_x ? paccx.data() + task * S * D : nullptr;
        std::fill(m, m + S, -std::numeric_limits<T>::infinity());
        std::fill(l, l + S, T(0));
        std::fill(acc, acc + S * Dout, T(0));
        if (ax) std::fill(ax, ax + S * D, T(0));
        retrieve<T>(c, bh, value_step, xi.data() + bh * S * D, S, ch * kSplitRows,
                    std::min(c.N, (ch + 1) * kSplitRows), m, l, acc, ax, scores.data(), nullptr, far);
      }
    };
    update_tasks(c, c.BH * chunks, chunk_task);
    // Merge the chunks through their log-sum-exps: M = max_c m_c, weights exp(m_c - M).  On the
    // calling thread: split-N runs only for BH < 2 threads, and the merge reads chunks x S x W
    // values (S=1 N=262144: 64 x 64), far less than a parallel region costs under load.
    const auto merge = [&](int64_t begin, int64_t end) {
      avec<T> m(S), l(S), acc(S * Dout), ax(want_x ? S * D : 0);
      for (int64_t bh = begin; bh < end; ++bh) {
        if (skip[bh]) {
          skip_step(c, bh, 0, S, k, xi.data() + bh * S * D);
          continue;
        }
        for (int64_t r = 0; r < S; ++r) {
          T big = -std::numeric_limits<T>::infinity();
          bool nan = false;
          for (int64_t ch = 0; ch < chunks; ++ch) {
            const T v = pm[(bh * chunks + ch) * S + r];
            nan |= std::isnan(v);
            big = v > big ? v : big;
          }
          if (nan) big = std::numeric_limits<T>::quiet_NaN();
          T sum = 0;
          T* a = acc.data() + r * Dout;
          std::fill(a, a + Dout, T(0));
          T* axr = want_x ? ax.data() + r * D : nullptr;
          if (axr) std::fill(axr, axr + D, T(0));
          for (int64_t ch = 0; ch < chunks; ++ch) {
            const int64_t t = bh * chunks + ch;
            const T w = exp_nonpositive(pm[t * S + r] - finite_or_zero(big));
            sum += w * pl[t * S + r];
            const T* pa = pacc.data() + t * S * W + r * Dout;  // rows of Dout in a slot of S x W
            for (int64_t d = 0; d < Dout; ++d) a[d] += w * pa[d];
            if (axr) {
              const T* px = paccx.data() + (t * S + r) * D;
              for (int64_t d = 0; d < D; ++d) axr[d] += w * px[d];
            }
          }
          m[r] = big;
          l[r] = sum;
        }
        finish_step<T>(c, bh, 0, S, k, m.data(), l.data(), acc.data(), want_x ? ax.data() : nullptr,
                       xi.data() + bh * S * D, active + bh * S);
      }
    };
    merge(0, c.BH);
  }
  if (!c.has_values) std::memcpy(c.out, xi.data(), sizeof(T) * c.BH * S * D);
}

// Whether the split-N decomposition runs (also used by the tests through the op's behaviour).
// streams: the states stream (streaming_applies), which takes up to kStreamMaxS of them.
bool use_split(int64_t BH, int64_t S, int64_t N, bool streams) {
  return S <= (streams ? kStreamMaxS : kSplitMaxS) && N >= 2 * kSplitRows && BH < 2 * at::get_num_threads();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hopfield_update_fwd_cpu(
    const at::Tensor& state, const at::Tensor& stored, const std::optional<at::Tensor>& values_opt, double beta,
    int64_t steps, std::optional<double> tol, bool final_state) {
  checks::hopfield_update_fwd(checks::cpu_target(), state, stored, values_opt, beta, steps, tol, final_state);
  const bool has_values = values_opt.has_value() && values_opt->defined();
  const int64_t B = state.size(0), H = state.size(1), S = state.size(2), D = state.size(3), N = stored.size(2);
  const int64_t Dv = has_values ? values_opt->size(3) : D;
  const int64_t R = steps, U = has_values ? steps - 1 : steps;
  const auto acc_dtype = state.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = state.options().dtype(acc_dtype);
  // The tile GEMMs' path, once per call (float32 / float64: native).
  const GemmPath path = cpu_gemm_path(state.scalar_type());
  const bool brgemm = path != GemmPath::kNative;
  // The inputs in the accumulation dtype, contiguous (no copy when they already are); on the
  // brgemm path the stored rows and values stay 16-bit (packed below) and only the states convert.
  // Without the AVX-512 kernels, the native path converts 16-bit stored rows per tile
  // (retrieve_converted) rather than up front.
#if defined(__AVX512F__)
  const bool convert_per_tile = false;
#else
  const bool convert_per_tile =
      !brgemm && (state.scalar_type() == at::kBFloat16 || state.scalar_type() == at::kHalf);
#endif
  const bool keep16 = brgemm || convert_per_tile;
  auto st = state.to(acc_dtype).contiguous();
  // The stored patterns' float32 copies are O(N D) too: on empty_huge's kept blocks, as above.
  auto to_acc = [&](const at::Tensor& t) {
    if (t.scalar_type() == acc_dtype && t.is_contiguous()) return t;
    at::Tensor r = empty_huge(t.sizes(), opts);
    r.copy_(t);
    return r;
  };
  auto x = keep16 ? stored.contiguous() : to_acc(stored);
  auto v = !has_values ? at::Tensor() : keep16 ? values_opt->contiguous() : to_acc(*values_opt);
  auto out = at::empty({B, H, S, Dv}, opts);
  auto states = at::empty({steps + 1, B, H, S, D}, opts);
  auto lse = at::empty({R, B, H, S}, opts);
  auto applied = at::empty({U, B, H, S}, state.options().dtype(at::kBool));
  if (has_values && !final_state) states.select(0, steps).zero_();
  if (S == 0 || B * H == 0) return {out, states, lse, applied};
  AT_DISPATCH_FLOATING_TYPES(acc_dtype, "hopfield_update_fwd", [&] {
    UpdateCtx<scalar_t> c;
    c.B = B; c.H = H; c.BH = B * H; c.S = S; c.N = N; c.D = D; c.Dv = Dv; c.R = R; c.U = U;
    c.beta = static_cast<scalar_t>(beta);
    c.tol = tol.has_value() ? *tol : -1.0;
    c.has_values = has_values;
    c.final_state = has_values && final_state;
    Stored16 p16;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (brgemm) {
        p16.g = Gemm16{path, state.scalar_type() == at::kBFloat16};
        p16.D = D;
        p16.Dv = Dv;
        p16.Dp = round_up(D, 32);  // the scores' K, zero-padded: the K-tail guard
        p16.tw = std::min(kTileN, round_up(N, 32));
        p16.tiles = ceil_div(N, kTileN);
        if (p16.g.bf16)
          pack_stored16<at::BFloat16>(x.const_data_ptr<at::BFloat16>(),
                                      has_values ? v.const_data_ptr<at::BFloat16>() : nullptr, B * H, N, p16);
        else
          pack_stored16<at::Half>(x.const_data_ptr<at::Half>(), has_values ? v.const_data_ptr<at::Half>() : nullptr,
                                  B * H, N, p16);
        c.p16 = &p16;
      }
    }
    c.X = keep16 ? nullptr : x.const_data_ptr<scalar_t>();
    c.V = has_values && !keep16 ? v.const_data_ptr<scalar_t>() : nullptr;
    if (convert_per_tile) {
      c.X16 = x.const_data_ptr();
      c.V16 = has_values ? v.const_data_ptr() : nullptr;
      c.bf16 = state.scalar_type() == at::kBFloat16;
    }
    c.out = out.mutable_data_ptr<scalar_t>();
    c.states = states.mutable_data_ptr<scalar_t>();
    c.lse = lse.mutable_data_ptr<scalar_t>();
    c.applied = applied.mutable_data_ptr<bool>();
    c.init = st.const_data_ptr<scalar_t>();
    // states[0] = the initial states.  The lanes kernel's tasks copy their own rows: a separate
    // copy_ is one more parallel region per call.  (Measured when the tasks still ran on a helper
    // thread of torch's inter-op pool, before parallel_tasks: copy_'s OpenMP worker then spun on
    // the second core while the helper needed it, S=1024 N=16384 D=64 3 steps on 2 threads
    // 64-66 ms against 55 ms on one.)
    if (!lanes_apply(c)) states.select(0, 0).copy_(st);
    if (use_split(B * H, S, N, !brgemm && streaming_applies<scalar_t>(S, D)))
      update_split<scalar_t>(c);
    else
      update_fused<scalar_t>(c);
  });
  return {out, states, lse, applied};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("hopfield_energy_fwd", &hopfield_energy_fwd_cpu);
  m.impl("hopfield_update_fwd", &hopfield_update_fwd_cpu);
}

}  // namespace attnkit

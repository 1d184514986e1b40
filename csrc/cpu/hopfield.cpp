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
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace attnkit {
namespace {

constexpr int64_t kQ = 8;   // queries per task tile
constexpr int64_t kP = 16;  // stored patterns per tile (one AVX-512 float vector)
constexpr double kCancellation = 32;  // recompute a float32 row above this cancellation factor

// exp(x) for x <= 0 (the argument is always a score minus the running maximum).  float: range
// reduction x = k ln2 + r, |r| <= ln2/2, then the degree-7 Taylor polynomial of exp(r)
// (truncation error < 1e-8 relative) times 2^k built in the exponent bits.  Arguments below
// -87 are clamped there: exp(-87) ~ 1.6e-38 is negligible next to the running sum (>= 1).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
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
  return p * scale;
}

inline double exp_nonpositive(double x) { return std::exp(x); }

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

template <typename scalar_t, typename acc_t>
void energy_kernel(const scalar_t* state, const scalar_t* stored, acc_t* energy, acc_t* lse,
                   int64_t BH, int64_t S, int64_t N, int64_t D, double beta_in) {
  const acc_t beta = static_cast<acc_t>(beta_in);
  const int64_t tiles = (N + kP - 1) / kP;
  // Packed stored patterns: [BH][tiles][D][kP], zero-padded past N.
  std::vector<acc_t> packed(static_cast<size_t>(BH * tiles * D * kP));
  std::vector<double> max_sq(BH);  // in double for the cancellation fallback
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
          best = std::max(best, sq);
        }
      }
      max_sq[bh] = best;
    }
  });

  const acc_t log_n = std::log(static_cast<acc_t>(N));
  const int64_t query_tiles = (S + kQ - 1) / kQ;
  at::parallel_for(0, BH * query_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xi(static_cast<size_t>(kQ * D));
    std::vector<double> scores;  // the fallback's scratch, allocated on first use
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
          acc_t tile_max = -std::numeric_limits<acc_t>::infinity();
          for (int64_t p = 0; p < valid; ++p) {
            sc[q][p] *= beta;
            tile_max = sc[q][p] > tile_max ? sc[q][p] : tile_max;
          }
          if (tile_max > m[q]) {
            // exp(-inf) (first tile) clamps to ~1e-38, times l = 0.
            l[q] *= exp_nonpositive(m[q] - tile_max);
            m[q] = tile_max;
          }
          acc_t sum = 0;
          const acc_t mq = m[q];
#pragma omp simd reduction(+ : sum)
          for (int64_t p = 0; p < valid; ++p) sum += exp_nonpositive(sc[q][p] - mq);
          l[q] += sum;
        }
      }
      const acc_t half_max_sq = static_cast<acc_t>(0.5 * max_sq[bh]);
      for (int64_t q = 0; q < rows; ++q) {
        const int64_t row = bh * S + q0 + q;
        acc_t row_lse = m[q] + std::log(l[q]);
        acc_t row_energy = -row_lse / beta + acc_t(0.5) * xi_sq[q] + log_n / beta + half_max_sq;
        if constexpr (std::is_same_v<acc_t, float>) {
          const double terms = std::abs(static_cast<double>(row_lse)) / beta + log_n / beta +
                               0.5 * xi_sq[q] + 0.5 * max_sq[bh];
          // (false for NaN: a NaN row stays NaN)
          if (terms > kCancellation * std::abs(static_cast<double>(row_energy))) {
            if (scores.empty()) scores.resize(static_cast<size_t>(N));
            const scalar_t* q_row = Q + q * D;
            const double lse_d = row_lse_double(q_row, stored + bh * N * D, N, D, beta_in, scores.data());
            double q_sq = 0;
            for (int64_t d = 0; d < D; ++d) q_sq += static_cast<double>(q_row[d]) * static_cast<double>(q_row[d]);
            row_lse = static_cast<acc_t>(lse_d);
            row_energy = static_cast<acc_t>(-(lse_d - std::log(static_cast<double>(N))) / beta_in +
                                            0.5 * q_sq + 0.5 * max_sq[bh]);
          }
        }
        lse[row] = row_lse;
        energy[row] = row_energy;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> hopfield_energy_fwd_cpu(const at::Tensor& state,
                                                           const at::Tensor& stored, double beta) {
  TORCH_CHECK(state.dim() == 4 && stored.dim() == 4,
              "hopfield_energy_fwd: expected state [B,H,S,D] and stored [B,H,N,D]; got ",
              state.dim(), "-D and ", stored.dim(), "-D");
  TORCH_CHECK(state.scalar_type() == stored.scalar_type(),
              "hopfield_energy_fwd: state and stored must share a dtype; got ", state.scalar_type(),
              " and ", stored.scalar_type());
  TORCH_CHECK(state.size(0) == stored.size(0) && state.size(1) == stored.size(1) &&
                  state.size(3) == stored.size(3),
              "hopfield_energy_fwd: state and stored must agree on B, H and D; got ", state.sizes(),
              " and ", stored.sizes());
  TORCH_CHECK(stored.size(2) > 0, "hopfield_energy_fwd: needs at least one stored pattern (N >= 1)");
  TORCH_CHECK(beta > 0 && std::isfinite(beta), "hopfield_energy_fwd: beta must be finite and > 0; got ",
              beta);
  const auto st = state.contiguous();
  const auto x = stored.contiguous();
  const int64_t B = st.size(0), H = st.size(1), S = st.size(2), D = st.size(3);
  const int64_t N = x.size(2);
  const auto acc_dtype = st.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto energy = at::empty({B, H, S}, st.options().dtype(acc_dtype));
  auto lse = at::empty({B, H, S}, st.options().dtype(acc_dtype));
  if (energy.numel() == 0) return {energy, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st.scalar_type(), "hopfield_energy_fwd", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
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
// fp64) copies of the inputs (O((S + N) * D)).
//
// Two decompositions of the work:
// - fused (the default): one task per (b, h, block of kBlockQ queries); the task keeps its block
//   of states in a thread-local buffer across all steps and writes each step's state out only
//   for the backward.
// - split-N (S <= kSplitMaxS and few (b, h) compared with the threads, N >= 2 kSplitRows): one
//   query block cannot occupy the machine, so each step runs as one parallel_for over
//   (b, h, chunk of kSplitRows stored rows); every chunk returns a partial (m, l, acc) per query
//   and the partials merge through their log-sum-exps (flash-decoding).
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
// always; the loops measured slower for S=1 N=262144 (16-18 ms against 12 ms, same run).
constexpr int64_t kSmallRows = 0;

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

// Row kernels of the online softmax: the max of a row of scores, and p_j = exp(s_j - m) in
// place with their sum.  Written with AVX-512 intrinsics for float: GCC left both loops scalar
// (vmaxss / vfmadd...ss in perf annotate), which made the softmax cost as much as both GEMMs
// together (S=1024 N=16384 D=64, one thread: 11 GFLOP/s against torch SDPA's 29 in the same run).
template <typename T>
inline T row_max(const T* s, int64_t n) {
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
// exp_nonpositive on 16 lanes (same reduction and polynomial as the scalar version).  max with
// -87 first as the first operand: vmaxps returns its second operand for NaN, so NaN stays NaN.
inline __m512 exp_nonpositive_v(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

template <>
inline float row_max<float>(const float* s, int64_t n) {
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
#endif  // __AVX512F__

// One retrieval of `rows` states xi [rows x D] over stored rows [n0, n1), folded into the
// running (m, l, acc) that the caller initialised (m = -inf, l = 0, acc = 0):
//   acc  [rows x Dout] = sum_i exp(s_i - m) V_i   with V = values (Dout = Dv) or X (Dout = D)
//   accx [rows x D]    = sum_i exp(s_i - m) X_i   (only when accx != nullptr, with values)
// scores: scratch of rows x kTileN.
template <typename T>
void retrieve_range(const T* xi, int64_t rows, const T* X, const T* V, int64_t D, int64_t Dout, int64_t n0,
                    int64_t n1, T beta, T* m, T* l, T* acc, T* accx, T* scores) {
  for (int64_t t0 = n0; t0 < n1; t0 += kTileN) {
    const int64_t bk = std::min(kTileN, n1 - t0);
    gemm_nt<T>(rows, bk, D, beta, xi, D, X + t0 * D, D, scores, kTileN);
    for (int64_t r = 0; r < rows; ++r) {
      T* s = scores + r * kTileN;
      const T new_m = std::max(m[r], row_max(s, bk));
      if (new_m != m[r]) {
        // exp(-inf) (first tile) clamps to ~1e-38 (float) times l = 0 and acc = 0.
        const T alpha = exp_nonpositive(m[r] - new_m);
        l[r] *= alpha;
        T* a = acc + r * Dout;
#pragma omp simd
        for (int64_t d = 0; d < Dout; ++d) a[d] *= alpha;
        if (accx) {
          T* ax = accx + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ax[d] *= alpha;
        }
        m[r] = new_m;
      }
      l[r] += exp_sum_inplace(s, bk, m[r]);
    }
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
};

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

// Runs body(task) for task in [0, tasks) on torch's intra-op threads, handing tasks out one at a
// time from a shared counter rather than in fixed contiguous ranges: on the shared 2-core
// machines a descheduled thread otherwise holds up the whole call (S=1, N=262144: 2 threads
// with static ranges ran 2x slower than 1 thread while the load average was ~7; see use_split).
template <typename F>
void parallel_tasks(int64_t tasks, const F& body) {
  if (tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) body(t);
  });
}

template <typename T>
void update_fused(const UpdateCtx<T>& c) {
  const int64_t qblocks = (c.S + kBlockQ - 1) / kBlockQ;
  const int64_t D = c.D;
  parallel_tasks(c.BH * qblocks, [&](int64_t task) {
    // Thread-local buffers: the block's states, the running softmax and the score tile.
    thread_local std::vector<T> xi, m, l, scores, acc, accx;
    xi.resize(kBlockQ * D); m.resize(kBlockQ); l.resize(kBlockQ); scores.resize(kBlockQ * kTileN);
    acc.resize(kBlockQ * std::max(D, c.Dv)); accx.resize(c.final_state ? kBlockQ * D : 0);
    bool active[kBlockQ];
    {
      const int64_t bh = task / qblocks;
      const int64_t q0 = (task % qblocks) * kBlockQ;
      const int64_t rows = std::min(kBlockQ, c.S - q0);
      std::memcpy(xi.data(), c.states + (bh * c.S + q0) * D, sizeof(T) * rows * D);
      std::fill(active, active + rows, true);
      const T* X = c.X + bh * c.N * D;
      for (int64_t k = 0; k < c.R; ++k) {
        const bool value_step = c.has_values && k == c.R - 1;
        if (!value_step && all_frozen(c, active, rows)) {
          skip_step(c, bh, q0, rows, k, xi.data());
          continue;
        }
        const int64_t Dout = value_step ? c.Dv : D;
        const T* V = value_step ? c.V + bh * c.N * c.Dv : X;
        T* ax = value_step && c.final_state ? accx.data() : nullptr;
        std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
        std::fill(l.begin(), l.end(), T(0));
        std::fill(acc.begin(), acc.begin() + rows * Dout, T(0));
        if (ax) std::fill(accx.begin(), accx.end(), T(0));
        retrieve_range<T>(xi.data(), rows, X, V, D, Dout, 0, c.N, c.beta, m.data(), l.data(), acc.data(), ax,
                          scores.data());
        finish_step<T>(c, bh, q0, rows, k, m.data(), l.data(), acc.data(), ax, xi.data(), active);
      }
      if (!c.has_values) {
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(c.out + (bh * c.S + q0 + r) * D, xi.data() + r * D, sizeof(T) * D);
      }
    }
  });
}

template <typename T>
void update_split(const UpdateCtx<T>& c) {
  const int64_t S = c.S, D = c.D;
  const int64_t chunks = (c.N + kSplitRows - 1) / kSplitRows;
  const int64_t W = std::max(D, c.Dv);
  std::vector<T> xi(c.BH * S * D);
  std::memcpy(xi.data(), c.states, sizeof(T) * c.BH * S * D);
  std::vector<char> active_store(c.BH * S, 1);
  bool* active = reinterpret_cast<bool*>(active_store.data());
  // Partials per (bh, chunk): m, l [S]; acc [S, W]; accx [S, D].
  std::vector<T> pm(c.BH * chunks * S), pl(c.BH * chunks * S), pacc(c.BH * chunks * S * W);
  std::vector<T> paccx(c.final_state ? c.BH * chunks * S * D : 0);
  std::vector<char> skip(c.BH, 0);
  for (int64_t k = 0; k < c.R; ++k) {
    const bool value_step = c.has_values && k == c.R - 1;
    const int64_t Dout = value_step ? c.Dv : D;
    const bool want_x = value_step && c.final_state;
    for (int64_t bh = 0; bh < c.BH; ++bh) skip[bh] = !value_step && all_frozen(c, active + bh * S, S);
    parallel_tasks(c.BH * chunks, [&](int64_t task) {
      thread_local std::vector<T> scores;
      scores.resize(S * kTileN);
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
        const T* X = c.X + bh * c.N * D;
        const T* V = value_step ? c.V + bh * c.N * c.Dv : X;
        retrieve_range<T>(xi.data() + bh * S * D, S, X, V, D, Dout, ch * kSplitRows,
                          std::min(c.N, (ch + 1) * kSplitRows), c.beta, m, l, acc, ax, scores.data());
      }
    });
    // Merge the chunks through their log-sum-exps: M = max_c m_c, weights exp(m_c - M).
    at::parallel_for(0, c.BH, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> m(S), l(S), acc(S * Dout), ax(want_x ? S * D : 0);
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
            const T w = exp_nonpositive(pm[t * S + r] - big);
            sum += w * pl[t * S + r];
            const T* pa = pacc.data() + (t * S + r) * W;
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
    });
  }
  if (!c.has_values) std::memcpy(c.out, xi.data(), sizeof(T) * c.BH * S * D);
}

// Whether the split-N decomposition runs (also used by the tests through the op's behaviour).
bool use_split(int64_t BH, int64_t S, int64_t N) {
  return S <= kSplitMaxS && N >= 2 * kSplitRows && BH < 2 * at::get_num_threads();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hopfield_update_fwd_cpu(
    const at::Tensor& state, const at::Tensor& stored, const std::optional<at::Tensor>& values_opt, double beta,
    int64_t steps, std::optional<double> tol, bool final_state) {
  TORCH_CHECK(state.dim() == 4 && stored.dim() == 4,
              "hopfield_update_fwd: expected state [B,H,S,D] and stored [B,H,N,D]; got ", state.dim(), "-D and ",
              stored.dim(), "-D");
  TORCH_CHECK(state.scalar_type() == stored.scalar_type(),
              "hopfield_update_fwd: state and stored must share a dtype; got ", state.scalar_type(), " and ",
              stored.scalar_type());
  TORCH_CHECK(state.size(0) == stored.size(0) && state.size(1) == stored.size(1) && state.size(3) == stored.size(3),
              "hopfield_update_fwd: state and stored must agree on B, H and D; got ", state.sizes(), " and ",
              stored.sizes());
  TORCH_CHECK(stored.size(2) > 0, "hopfield_update_fwd: needs at least one stored pattern (N >= 1)");
  TORCH_CHECK(beta > 0 && std::isfinite(beta), "hopfield_update_fwd: beta must be finite and > 0; got ", beta);
  TORCH_CHECK(steps >= 1, "hopfield_update_fwd: steps must be >= 1; got ", steps);
  TORCH_CHECK(!tol.has_value() || (*tol >= 0 && std::isfinite(*tol)),
              "hopfield_update_fwd: tol must be finite and >= 0; got ", tol.value_or(0));
  const bool has_values = values_opt.has_value() && values_opt->defined();
  if (has_values) {
    const auto& v = *values_opt;
    TORCH_CHECK(v.dim() == 4 && v.size(0) == stored.size(0) && v.size(1) == stored.size(1) &&
                    v.size(2) == stored.size(2),
                "hopfield_update_fwd: values must be [B,H,N,Dv] matching stored; got ", v.sizes());
    TORCH_CHECK(v.scalar_type() == stored.scalar_type(), "hopfield_update_fwd: values must share the dtype of stored");
  }
  const int64_t B = state.size(0), H = state.size(1), S = state.size(2), D = state.size(3), N = stored.size(2);
  const int64_t Dv = has_values ? values_opt->size(3) : D;
  const int64_t R = steps, U = has_values ? steps - 1 : steps;
  const auto acc_dtype = state.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = state.options().dtype(acc_dtype);
  // The inputs in the accumulation dtype, contiguous (no copy when they already are).
  auto st = state.to(acc_dtype).contiguous();
  auto x = stored.to(acc_dtype).contiguous();
  auto v = has_values ? values_opt->to(acc_dtype).contiguous() : at::Tensor();
  auto out = at::empty({B, H, S, Dv}, opts);
  auto states = at::empty({steps + 1, B, H, S, D}, opts);
  auto lse = at::empty({R, B, H, S}, opts);
  auto applied = at::empty({U, B, H, S}, state.options().dtype(at::kBool));
  if (has_values && !final_state) states.select(0, steps).zero_();
  if (S == 0 || B * H == 0) return {out, states, lse, applied};
  states.select(0, 0).copy_(st);
  AT_DISPATCH_FLOATING_TYPES(acc_dtype, "hopfield_update_fwd", [&] {
    UpdateCtx<scalar_t> c;
    c.B = B; c.H = H; c.BH = B * H; c.S = S; c.N = N; c.D = D; c.Dv = Dv; c.R = R; c.U = U;
    c.beta = static_cast<scalar_t>(beta);
    c.tol = tol.has_value() ? *tol : -1.0;
    c.has_values = has_values;
    c.final_state = has_values && final_state;
    c.X = x.const_data_ptr<scalar_t>();
    c.V = has_values ? v.const_data_ptr<scalar_t>() : nullptr;
    c.out = out.mutable_data_ptr<scalar_t>();
    c.states = states.mutable_data_ptr<scalar_t>();
    c.lse = lse.mutable_data_ptr<scalar_t>();
    c.applied = applied.mutable_data_ptr<bool>();
    if (use_split(B * H, S, N))
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

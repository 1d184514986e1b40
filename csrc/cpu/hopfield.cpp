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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("hopfield_energy_fwd", &hopfield_energy_fwd_cpu);
}

}  // namespace attnkit

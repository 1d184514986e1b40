// CPU kernels of the modern Hopfield family.
//
// hopfield_energy_fwd: one pass over the stored patterns per query with an online
// log-sum-exp, so memory beyond the outputs is O(N) per thread at most (here O(1)).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace attnkit {
namespace {

template <typename scalar_t, typename acc_t>
void energy_kernel(const scalar_t* state, const scalar_t* stored, acc_t* energy, acc_t* lse,
                   int64_t BH, int64_t S, int64_t N, int64_t D, acc_t beta) {
  // Squared-norm maximum of the stored patterns, once per (batch, head).
  std::vector<acc_t> max_sq(BH);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const scalar_t* X = stored + bh * N * D;
      acc_t best = 0;
      for (int64_t i = 0; i < N; ++i) {
        acc_t sq = 0;
        for (int64_t d = 0; d < D; ++d) {
          acc_t x = static_cast<acc_t>(X[i * D + d]);
          sq += x * x;
        }
        best = std::max(best, sq);
      }
      max_sq[bh] = best;
    }
  });

  const acc_t log_n = std::log(static_cast<acc_t>(N));
  at::parallel_for(0, BH * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xi(D);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bh = row / S;
      const scalar_t* q = state + row * D;
      const scalar_t* X = stored + bh * N * D;
      acc_t xi_sq = 0;
      for (int64_t d = 0; d < D; ++d) {
        xi[d] = static_cast<acc_t>(q[d]);
        xi_sq += xi[d] * xi[d];
      }
      // Online log-sum-exp of beta * x_i . xi over the stored patterns.
      acc_t m = -std::numeric_limits<acc_t>::infinity();
      acc_t l = 0;
      for (int64_t i = 0; i < N; ++i) {
        acc_t dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<acc_t>(X[i * D + d]) * xi[d];
        const acc_t s = beta * dot;
        if (s > m) {
          l = l * std::exp(m - s) + 1;
          m = s;
        } else {
          l += std::exp(s - m);
        }
      }
      const acc_t row_lse = m + std::log(l);
      lse[row] = row_lse;
      energy[row] = -row_lse / beta + acc_t(0.5) * xi_sq + log_n / beta + acc_t(0.5) * max_sq[bh];
    }
  });
}

std::tuple<at::Tensor, at::Tensor> hopfield_energy_fwd_cpu(const at::Tensor& state,
                                                           const at::Tensor& stored, double beta) {
  TORCH_CHECK(state.dim() == 4 && stored.dim() == 4,
              "hopfield_energy_fwd: expected state [B,H,S,D] and stored [B,H,N,D]");
  TORCH_CHECK(state.scalar_type() == stored.scalar_type(),
              "hopfield_energy_fwd: state and stored must share a dtype");
  TORCH_CHECK(state.size(0) == stored.size(0) && state.size(1) == stored.size(1) &&
                  state.size(3) == stored.size(3),
              "hopfield_energy_fwd: state and stored must agree on B, H and D");
  TORCH_CHECK(stored.size(2) > 0, "hopfield_energy_fwd: needs at least one stored pattern");
  TORCH_CHECK(beta > 0, "hopfield_energy_fwd: beta must be > 0");
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
                                   B * H, S, N, D, static_cast<acc_t>(beta));
  });
  return {energy, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("hopfield_energy_fwd", &hopfield_energy_fwd_cpu);
}

}  // namespace attnkit

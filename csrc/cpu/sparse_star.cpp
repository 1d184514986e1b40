// CPU forward of the Star-Transformer pattern in one pass (issue 14):
//
//   sparse_star_fwd(q [B,H,N,D], k [B,H,N,D], v [B,H,N,Dv], relay, radius, cyclic, causal, scale)
//       -> out [B,H,N,Dv] (q's dtype), lse [B,H,N] (natural log; float32, float64 for float64)
//
// The keys of row i are attnkit.patterns.Star.mask_rows's: the relay row sees every key; any
// other row sees the relay's key and the satellites (the positions other than the relay,
// numbered in order) within `radius` of its own satellite number, on a ring of N - 1 when
// `cyclic`; `causal` keeps j <= i.  The composed path (attnkit/ops/sparse.py: a band range part,
// the relay column merged in, the relay's neighbourhood recomputed and copied in) made five
// passes over [B, H, N, Dv] tensors for ~4 keys a row: at B=1 H=8 N=4096 D=64 float32 (2
// threads) 4.8-6.5 ms, 2.7 of them in the band kernel, whose strips compute 16 x 18 scores for a
// band of 3.  Here each row lists its keys (at most 2 radius + 2; N for the relay's row), takes
// their scores in the accumulation type, and folds them in one softmax: one read of Q, K and V
// (neighbouring rows hit in cache) and one write of the output.
//
// Forward only: attnkit.sparse_attention calls it when no gradient is wanted; training keeps the
// composed path, whose parts have backward kernels.  NaN and infinities as every sparse kernel
// (issue 15): a NaN or +inf score among a row's keys makes its out and lse NaN; a row whose
// scores are all -inf gets out 0 and lse -inf.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "empty_huge.h"
#include "flash_tiles.h"
#include "../checks/checks.h"

namespace attnkit {
namespace {

constexpr int64_t kStarRows = 256;  // query rows per task

// The positions row i sees, written to keys (room for N); returns how many.  N >= 1, relay < N,
// radius >= 1.
int64_t star_keys(int64_t i, int64_t N, int64_t relay, int64_t radius, bool cyclic, bool causal,
                  int64_t* keys) {
  const int64_t last = causal ? i : N - 1;  // keys j <= last
  int64_t c = 0;
  if (i == relay) {
    for (int64_t j = 0; j <= last; ++j) keys[c++] = j;
    return c;
  }
  if (relay <= last) keys[c++] = relay;
  const int64_t m = N - 1;                     // satellites (N >= 2 here)
  const int64_t s = i - (i > relay ? 1 : 0);   // this row's satellite number
  const int64_t r = std::min(radius, N);       // (no overflow in s +- r or 2 r + 1)
  const auto add = [&](int64_t t) {
    const int64_t p = t + (t >= relay ? 1 : 0);  // satellite t's position
    if (p <= last) keys[c++] = p;
  };
  if (!cyclic) {
    for (int64_t t = std::max<int64_t>(0, s - r); t <= std::min(m - 1, s + r); ++t) add(t);
  } else if (2 * r + 1 >= m) {  // the ring is no longer than the neighbourhood: every satellite
    for (int64_t t = 0; t < m; ++t) add(t);
  } else {
    for (int64_t o = -r; o <= r; ++o) add(((s + o) % m + m) % m);
  }
  return c;
}

template <typename scalar_t, typename acc_t>
void star_fwd_kernel(int64_t BH, int64_t N, int64_t D, int64_t Dv, int64_t relay, int64_t radius, bool cyclic,
                     bool causal, double scale_in, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                     scalar_t* out, acc_t* lse) {
  const acc_t scale = static_cast<acc_t>(scale_in);
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  const int64_t blocks = (N + kStarRows - 1) / kStarRows;
  at::parallel_for(0, BH * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> keys(static_cast<size_t>(N));
    std::vector<acc_t> s(static_cast<size_t>(N)), qi(static_cast<size_t>(D)), o(static_cast<size_t>(Dv));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / blocks, i0 = (t % blocks) * kStarRows, i1 = std::min(N, i0 + kStarRows);
      const scalar_t* K = k + bh * N * D;
      const scalar_t* V = v + bh * N * Dv;
      for (int64_t i = i0; i < i1; ++i) {
        const scalar_t* qrow = q + (bh * N + i) * D;
        for (int64_t d = 0; d < D; ++d) qi[d] = static_cast<acc_t>(qrow[d]);
        const int64_t c = star_keys(i, N, relay, radius, cyclic, causal, keys.data());
        acc_t mx = -inf;
        bool poisoned = false;
        for (int64_t x = 0; x < c; ++x) {
          const scalar_t* kr = K + keys[x] * D;
          acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * static_cast<acc_t>(kr[d]);
          const acc_t sc = dot * scale;
          s[x] = sc;
          poisoned |= sc != sc || sc == inf;
          mx = sc > mx ? sc : mx;
        }
        scalar_t* orow = out + (bh * N + i) * Dv;
        if (poisoned || mx == -inf) {  // NaN everywhere, or nothing to attend: 0 and -inf
          const acc_t fill = poisoned ? nan : acc_t(0);
          for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<scalar_t>(fill);
          lse[bh * N + i] = poisoned ? nan : -inf;
          continue;
        }
        std::fill(o.begin(), o.end(), acc_t(0));
        acc_t l = 0;
        for (int64_t x = 0; x < c; ++x) {
          const acc_t p = std::exp(s[x] - mx);
          l += p;
          const scalar_t* vr = V + keys[x] * Dv;
#pragma omp simd
          for (int64_t e = 0; e < Dv; ++e) o[e] += p * static_cast<acc_t>(vr[e]);
        }
        const acc_t inv = acc_t(1) / l;
        for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<scalar_t>(o[e] * inv);
        lse[bh * N + i] = mx + std::log(l);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> sparse_star_fwd_cpu(const at::Tensor& q_, const at::Tensor& k_,
                                                       const at::Tensor& v_, int64_t relay, int64_t radius,
                                                       bool cyclic, bool causal, double scale) {
  // The checks of a range part (q, k, v as for any part), then what the pattern adds.
  const std::vector<int64_t> plain{1, 0, 1, 0, 1}, lo{0, 1, 1, 0}, hi{0, 1, 1, 0};
  checks::sparse_range_fwd(checks::cpu_target(), q_, k_, v_, plain, lo, hi, scale);
  ATTNKIT_CHECK(k_.size(2) == q_.size(2), "attnkit::sparse_star_fwd (cpu): self-attention: q and k must have ",
                "the same length; got ", q_.sizes(), " and ", k_.sizes());
  ATTNKIT_CHECK(radius >= 1, "attnkit::sparse_star_fwd (cpu): radius must be >= 1; got ", radius);
  const int64_t N = q_.size(2);
  ATTNKIT_CHECK(relay >= 0 && (N == 0 || relay < N), "attnkit::sparse_star_fwd (cpu): relay must be a position ",
                "of the sequence (0..N-1 for N=", N, "); got ", relay);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Dv = v.size(3);
  at::Tensor out = empty_huge({B, H, N, Dv}, q.options());
  at::Tensor lse = at::empty({B, H, N}, q.options().dtype(acc_type_of(q.scalar_type())));
  if (B * H * N == 0) return {out, lse};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "sparse_star_fwd", [&] {
    using acc_t = acc_of<scalar_t>;
    star_fwd_kernel<scalar_t, acc_t>(B * H, N, D, Dv, relay, radius, cyclic, causal, scale,
                                     q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                                     v.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
                                     lse.mutable_data_ptr<acc_t>());
  });
  return {out, lse};
}

}  // namespace

// CPU-only, forward-only (see the top): declared here, not in csrc/ops.cpp, as the fused
// strided ops are; pytorch_ext/ops/sparse.py registers its fake.
TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("sparse_star_fwd(Tensor q, Tensor k, Tensor v, int relay, int radius, bool cyclic, bool causal, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) { m.impl("sparse_star_fwd", &sparse_star_fwd_cpu); }

}  // namespace attnkit

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
//   sparse_star_bwd(grad_out, q, k, v, lse, delta?, relay, radius, cyclic, causal, scale, out?)
//       -> (dq, dk, dv), given the forward's lse and delta_i = rowsum(dO_i * O_i) - dlse_i (as
//       sparse_range_bwd's), or, without delta, out to compute rowsum(dO * O) from.
//
// The backward recomputes each visible pair's P_ij = exp(s_ij - lse_i) twice: once per row
// (dq_i = scale sum_j P_ij (dO_i . v_j - delta_i) k_j, over the row's keys) and once per key
// (dv_j = sum_i P_ij dO_i, dk_j = scale sum_i dS_ij q_i, over the rows that see key j, which
// star_rows lists: the star's neighbourhood is symmetric), so each output row is written by one
// task: no atomics, no per-thread copies, and the result does not depend on the thread count.
// The composed path's backward (range parts, relay column, patched rows, each a backward of
// its own) took 36.7 ms at B=1 H=8 N=4096 D=64 float32 (2 threads) for ~5 keys a row; see
// bench/RESULTS.md (session 8) for this one.
//
// attnkit.sparse_attention calls the pair whenever the cpu backend has them.  NaN and
// infinities as every sparse kernel (issue 15): a NaN or +inf score among a row's keys makes its
// out and lse NaN (and, backward, the gradients of that row and of the keys it sees); a row
// whose scores are all -inf gets out 0 and lse -inf, and passes no gradient.
//
// No tile GEMM here, so no ATTNKIT_CPU_GEMM path (issue 25, gemm_path.h): a row's scores are
// 2 radius + 2 dot products against keys scattered over the row's neighbourhood (the relay's
// row excepted), a key's gradients as many; there is no block of rows sharing a block of keys
// for brgemm to multiply, and the dot products run in the accumulation type on every path.
#include "torch_headers.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "empty_huge.h"
#include "flash_tiles.h"
#include "pattern_bwd.h"
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

// The rows that see key j (those i with j among star_keys(i, ...)), written to rows (room for
// N); returns how many.  Every row sees the relay's key (if causal, the rows from the relay on);
// the relay's row sees every key (if causal, j <= relay); satellite rows see each other within
// `radius` on the line or ring, a symmetric relation, so j's rows are its own neighbourhood
// (if causal, the rows from j on).
int64_t star_rows(int64_t j, int64_t N, int64_t relay, int64_t radius, bool cyclic, bool causal,
                  int64_t* rows) {
  int64_t c = 0;
  if (j == relay) {
    for (int64_t i = causal ? relay : 0; i < N; ++i) rows[c++] = i;
    return c;
  }
  if (!causal || j <= relay) rows[c++] = relay;
  const int64_t m = N - 1;
  const int64_t s = j - (j > relay ? 1 : 0);
  const int64_t r = std::min(radius, N);
  const auto add = [&](int64_t t) {
    const int64_t p = t + (t >= relay ? 1 : 0);
    if (!causal || p >= j) rows[c++] = p;
  };
  if (!cyclic) {
    for (int64_t t = std::max<int64_t>(0, s - r); t <= std::min(m - 1, s + r); ++t) add(t);
  } else if (2 * r + 1 >= m) {
    for (int64_t t = 0; t < m; ++t) add(t);
  } else {
    for (int64_t o = -r; o <= r; ++o) add(((s + o) % m + m) % m);
  }
  return c;
}

// A thread's scratch: position lists (room for N) and rows in the accumulation type.
template <typename acc_t>
struct StarScratch {
  std::vector<int64_t> list;
  avec<acc_t> s, a, b, acc, acc2;
  StarScratch(int64_t N, int64_t D, int64_t Dv)
      : list(static_cast<size_t>(N)), s(static_cast<size_t>(N)), a(static_cast<size_t>(std::max(D, Dv))),
        b(static_cast<size_t>(Dv)), acc(static_cast<size_t>(std::max(D, Dv))), acc2(static_cast<size_t>(Dv)) {}
};

// Runs body(scratch, bh, i0, i1) for every block of kStarRows rows of every head on torch's
// threads, with one StarScratch per chunk of blocks.
template <typename acc_t, typename Body>
void for_row_blocks(int64_t BH, int64_t N, int64_t D, int64_t Dv, Body body) {
  const int64_t blocks = (N + kStarRows - 1) / kStarRows;
  at::parallel_for(0, BH * blocks, 1, [&](int64_t t0, int64_t t1) {
    StarScratch<acc_t> scratch(N, D, Dv);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i0 = (t % blocks) * kStarRows;
      body(scratch, t / blocks, i0, std::min(N, i0 + kStarRows));
    }
  });
}

template <typename scalar_t, typename acc_t>
inline acc_t dot_acc(const acc_t* a, const scalar_t* b, int64_t n) {
  acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * static_cast<acc_t>(b[d]);
  return sum;
}

template <typename scalar_t, typename acc_t>
inline void load_acc_row(const scalar_t* src, int64_t n, acc_t* dst) {
  convert_row(src, 1, n, dst);  // flash_tiles.h: 16-bit rows 16 (AVX-512) or 8 (AVX2) at a time
}

template <typename scalar_t, typename acc_t>
void star_fwd_kernel(int64_t BH, int64_t N, int64_t D, int64_t Dv, int64_t relay, int64_t radius, bool cyclic,
                     bool causal, double scale_in, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                     scalar_t* out, acc_t* lse) {
  const acc_t scale = static_cast<acc_t>(scale_in);
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  for_row_blocks<acc_t>(BH, N, D, Dv, [&](StarScratch<acc_t>& st, int64_t bh, int64_t i0, int64_t i1) {
    const scalar_t* K = k + bh * N * D;
    const scalar_t* V = v + bh * N * Dv;
    acc_t* qi = st.a.data();
    acc_t* o = st.acc.data();
    for (int64_t i = i0; i < i1; ++i) {
      load_acc_row(q + (bh * N + i) * D, D, qi);
      const int64_t c = star_keys(i, N, relay, radius, cyclic, causal, st.list.data());
      acc_t mx = -inf;
      bool poisoned = false;
      for (int64_t x = 0; x < c; ++x) {
        const acc_t sc = dot_acc(qi, K + st.list[x] * D, D) * scale;
        st.s[x] = sc;
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
      std::fill(o, o + Dv, acc_t(0));
      acc_t l = 0;
      for (int64_t x = 0; x < c; ++x) {
        const acc_t p = std::exp(st.s[x] - mx);
        l += p;
        const scalar_t* vr = V + st.list[x] * Dv;
#pragma omp simd
        for (int64_t e = 0; e < Dv; ++e) o[e] += p * static_cast<acc_t>(vr[e]);
      }
      const acc_t inv = acc_t(1) / l;
      for (int64_t e = 0; e < Dv; ++e) orow[e] = static_cast<scalar_t>(o[e] * inv);
      lse[bh * N + i] = mx + std::log(l);
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

// delta (BH * N, computed here from out when not given), then the row pass (dq) and the key
// pass (dk, dv); see the top.  dq, dk, dv are written whole.
template <typename scalar_t, typename acc_t>
void star_bwd_kernel(int64_t BH, int64_t N, int64_t D, int64_t Dv, int64_t relay, int64_t radius, bool cyclic,
                     bool causal, double scale_in, const scalar_t* dout, const scalar_t* q, const scalar_t* k,
                     const scalar_t* v, const acc_t* lse, const acc_t* delta_in, const scalar_t* out, acc_t* dq,
                     acc_t* dk, acc_t* dv) {
  const acc_t scale = static_cast<acc_t>(scale_in);
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  avec<acc_t> delta_buf;
  const acc_t* delta = delta_in;
  if (delta == nullptr) {
    delta_buf.resize(static_cast<size_t>(BH * N));
    at::parallel_for(0, BH * N, 1024, [&](int64_t r0, int64_t r1) {
      avec<acc_t> o(static_cast<size_t>(Dv));
      for (int64_t r = r0; r < r1; ++r) {
        load_acc_row(out + r * Dv, Dv, o.data());
        delta_buf[r] = dot_acc(o.data(), dout + r * Dv, Dv);
      }
    });
    delta = delta_buf.data();
  }
  // Row pass: dq_i over the keys of row i.
  for_row_blocks<acc_t>(BH, N, D, Dv, [&](StarScratch<acc_t>& st, int64_t bh, int64_t i0, int64_t i1) {
    const scalar_t* K = k + bh * N * D;
    const scalar_t* V = v + bh * N * Dv;
    acc_t *qi = st.a.data(), *gi = st.b.data(), *acc = st.acc.data();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = bh * N + i;
      const acc_t li = lse[row];
      std::fill(acc, acc + D, acc_t(0));
      if (li != -inf) {  // a row with no visible score passes no gradient
        load_acc_row(q + row * D, D, qi);
        load_acc_row(dout + row * Dv, Dv, gi);
        const acc_t di = delta[row];
        const int64_t c = star_keys(i, N, relay, radius, cyclic, causal, st.list.data());
        for (int64_t x = 0; x < c; ++x) {
          const scalar_t* kr = K + st.list[x] * D;
          const acc_t p = std::exp(dot_acc(qi, kr, D) * scale - li);
          const acc_t ds = p * (dot_acc(gi, V + st.list[x] * Dv, Dv) - di) * scale;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += ds * static_cast<acc_t>(kr[d]);
        }
      }
      std::copy(acc, acc + D, dq + row * D);
    }
  });
  // Key pass: dk_j, dv_j over the rows that see key j.
  for_row_blocks<acc_t>(BH, N, D, Dv, [&](StarScratch<acc_t>& st, int64_t bh, int64_t j0, int64_t j1) {
    const scalar_t* Q = q + bh * N * D;
    const scalar_t* G = dout + bh * N * Dv;
    const acc_t* L = lse + bh * N;
    const acc_t* De = delta + bh * N;
    acc_t *kj = st.a.data(), *vj = st.b.data(), *ak = st.acc.data(), *av = st.acc2.data();
    for (int64_t j = j0; j < j1; ++j) {
      load_acc_row(k + (bh * N + j) * D, D, kj);
      load_acc_row(v + (bh * N + j) * Dv, Dv, vj);
      std::fill(ak, ak + D, acc_t(0));
      std::fill(av, av + Dv, acc_t(0));
      const int64_t c = star_rows(j, N, relay, radius, cyclic, causal, st.list.data());
      for (int64_t x = 0; x < c; ++x) {
        const int64_t i = st.list[x];
        if (L[i] == -inf) continue;
        const scalar_t* qr = Q + i * D;
        const scalar_t* gr = G + i * Dv;
        const acc_t p = std::exp(dot_acc(kj, qr, D) * scale - L[i]);
        const acc_t ds = p * (dot_acc(vj, gr, Dv) - De[i]) * scale;
#pragma omp simd
        for (int64_t e = 0; e < Dv; ++e) av[e] += p * static_cast<acc_t>(gr[e]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ak[d] += ds * static_cast<acc_t>(qr[d]);
      }
      std::copy(ak, ak + D, dk + (bh * N + j) * D);
      std::copy(av, av + Dv, dv + (bh * N + j) * Dv);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_star_bwd_cpu(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& lse_, const c10::optional<at::Tensor>& delta_opt, int64_t relay, int64_t radius,
    bool cyclic, bool causal, double scale, const c10::optional<at::Tensor>& out_opt) {
  const bool has_delta = checks::sparse_pattern_bwd(checks::cpu_target(), "sparse_star_bwd", dout_, q_, k_, v_,
                                                    lse_, delta_opt, out_opt, scale);
  ATTNKIT_CHECK(radius >= 1, "attnkit::sparse_star_bwd (cpu): radius must be >= 1; got ", radius);
  const int64_t N = q_.size(2);
  ATTNKIT_CHECK(relay >= 0 && (N == 0 || relay < N), "attnkit::sparse_star_bwd (cpu): relay must be a position ",
                "of the sequence (0..N-1 for N=", N, "); got ", relay);
  return run_pattern_bwd(
      dout_.contiguous(), q_.contiguous(), k_.contiguous(), v_.contiguous(), lse_.contiguous(),
      has_delta ? delta_opt->contiguous() : at::Tensor(), has_delta ? at::Tensor() : out_opt->contiguous(),
      [&](int64_t BH, int64_t n, int64_t D, int64_t Dv, const auto* dout, const auto* q, const auto* k,
          const auto* v, const auto* lse, const auto* delta, const auto* out, auto* dq, auto* dk, auto* dv) {
        star_bwd_kernel(BH, n, D, Dv, relay, radius, cyclic, causal, scale, dout, q, k, v, lse, delta, out, dq, dk,
                        dv);
      });
}

}  // namespace

// CPU-only (see the top): declared here, not in csrc/ops.cpp, as the fused
// strided ops are; pytorch_ext/ops/sparse.py registers its fake.
TORCH_LIBRARY_FRAGMENT(attnkit, m) {
  m.def("sparse_star_fwd(Tensor q, Tensor k, Tensor v, int relay, int radius, bool cyclic, bool causal, "
        "float scale) -> (Tensor, Tensor)");
  m.def("sparse_star_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor? delta, int relay, "
        "int radius, bool cyclic, bool causal, float scale, Tensor? out=None) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("sparse_star_fwd", &sparse_star_fwd_cpu);
  m.impl("sparse_star_bwd", &sparse_star_bwd_cpu);
}

}  // namespace attnkit

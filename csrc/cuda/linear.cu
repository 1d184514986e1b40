// CUDA C++ kernels of linear (kernelized) attention, chunked, forward and backward, registered
// for the CUDA dispatch key of attnkit::linear_fwd and attnkit::linear_bwd (schemas and their
// exact semantics in csrc/ops.cpp; the CPU kernels are csrc/cpu/linear.cpp).
//
// STATUS.  Checked: compiles with nvcc -c for sm_80 and sm_90a against torch's headers
// (.ci/compile_cuda.sh).  NOT yet checked: it has not run on a GPU.  tests/csrc/
// test_linear_cuda.py (`pytest -m gpu`) checks it against the float64 reference; until that has
// passed on a GPU, treat this backend as unverified.  The algorithm is the one of the Triton
// kernels (kernels/linear.py), which are tested against the reference under the interpreter.
//
// WHAT IT COMPUTES.  q [B,H,N,D], k [B,H,M,D], v [B,H,M,Dv] (float16, bfloat16, float32 or
// float64; any strides; any D, Dv >= 1; causal needs M == N), feature map phi fused
// ("elu" = elu+1, "relu", "identity"), optional initial state S0 [B,H,D,Dv], z0 [B,H,D] in the
// accumulation type A (float32; float64 for float64 inputs):
//   S_i = S0 + sum_{j in S_i} phi(k_j) v_j^T,  z_i = z0 + sum_{j in S_i} phi(k_j)
//   den_i = phi(q_i).z_i,  out_i = phi(q_i) S_i / (den_i + eps)  (normalize)  or  scale phi(q_i) S_i
// forward -> (out [B,H,N,Dv] in q's dtype, den [B,H,N] raw, S_final, z_final) (A).  No keys and no
// initial state: out = 0 whatever eps (as the reference).
// backward -> (dq, dk, dv) (contiguous, q's dtype), (dS0, dz0) (A; gradients with respect to the
// initial state, zeros-state when none was given), from grad_out, grad_den, grad_S, grad_z (each
// optional = zero).  With r_i = 1/(den_i + eps), c_i = -r_i (g_i . out_i) + grad_den_i
// (normalize) or r_i = scale, c_i = grad_den_i:
//   dphi(q_i) = r_i S_i g_i + c_i z_i
//   dphi(k_j) = sum_{i sees j} (r_i g_i.v_j + c_i) phi(q_i) + R v_j + w      (R, w: see below)
//   dv_j      = sum_{i sees j} r_i (phi(q_i).phi(k_j)) g_i + R^T phi(k_j)
//   dS0 = grad_S + sum_i r_i phi(q_i) g_i^T,   dz0 = grad_z + sum_i c_i phi(q_i)
//
// HOW.  Chunks of kC = 64 rows; every kernel works on 64x64 tiles (D and Dv in blocks of 64,
// padded with zeros) held in shared memory in the accumulation type A, with blocks of 256 threads
// in which thread (ty, tx) = (tid / 16, tid % 16) owns the 4x4 entries (ty + 16 i, tx + 16 j) of
// each 64x64 product (SIMT FMA in A: float16/bfloat16 are computed in float32, so a state that
// grows like N or a factor 1/den that shrinks like 1/N never leaves float16's range).
//  - state_fwd: one block per (D-block, Dv-block, h, b) walks the key chunks in order with the
//    state tile in registers; causal: stores the state before each chunk (Hs [B,H,NT,D,Dv],
//    Zs [B,H,NT,D]: N/64 states, never N); always stores S_final, z_final.
//  - output: one block per (query chunk, Dv-block, h, b): phi(Q_c) Hs[c] (+ causal: the masked
//    intra-chunk (phi(Q_c) phi(K_c)^T o tril) V_c); non-causal reads S_final for every chunk.
//  - backward: delta_i = g_i . out_i; the forward chunk states recomputed by state_fwd
//    (non-causal: the forward's S, z are the totals); state_bwd walks the query chunks backwards
//    (reverse states R_c = grad_S + sum over later chunks of r_i phi(q_i) g_i^T, w_c likewise);
//    dq (per query chunk, D-block), dk (per key chunk, D-block), dv (per key chunk, Dv-block),
//    each an inter-chunk state product plus a masked intra-chunk product.  No atomics:
//    deterministic.
// Shared memory tiles have a leading dimension of 65 (odd), so both row and column walks are
// bank-conflict free.

// The CPU torch wheel (used by CI's compile check) does not ship this generated header; it only
// matters for Windows DLL exports, which c10/cuda/CUDAMacros.h lets us skip.  A CUDA wheel ships
// it and it is used.
#if defined(__has_include)
#if !__has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#define C10_CUDA_NO_CMAKE_CONFIGURE_FILE
#endif
#endif

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace attnkit {
namespace {

constexpr int kThreads = 256;  // 16 x 16 threads, each owning a 4 x 4 micro-tile of a 64 x 64 product
constexpr int kC = 64;         // rows per chunk
constexpr int kT = 64;         // D / Dv block width
constexpr int kLd = kT + 1;    // shared-memory leading dimension (odd: conflict-free column walks)
constexpr int kTile = kC * kLd;
constexpr int kTiles = 3;  // 64 x 64 tiles per block (the most any kernel uses)
constexpr int kVecs = 4;   // 64-vectors per block (den, r, c, z, ...)

enum FeatureMap : int { kElu = 0, kRelu = 1, kIdentity = 2 };

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of chunk t that exist (0 .. 64): min(64, L - 64 t).
__device__ __forceinline__ int chunk_rows(int L, int64_t row0) {
  const int64_t left = static_cast<int64_t>(L) - row0;
  return left < kC ? static_cast<int>(left) : kC;
}

// ---------------------------------------------------------------------------------------------
// device helpers
// ---------------------------------------------------------------------------------------------

template <typename A>
__device__ __forceinline__ A exp_acc(A x) {
  if constexpr (std::is_same_v<A, double>) {
    return exp(x);
  } else {
    return expf(x);
  }
}

// phi(x): elu(x) + 1 = x + 1 (x > 0) or exp(x); relu; identity.
template <typename A>
__device__ __forceinline__ A phi(A x, int fm) {
  if (fm == kElu) return x > A(0) ? x + A(1) : exp_acc(x);
  if (fm == kRelu) return x > A(0) ? x : A(0);
  return x;
}

// phi'(x) (relu'(0) = 0 as torch has it).
template <typename A>
__device__ __forceinline__ A dphi(A x, int fm) {
  if (fm == kElu) return x > A(0) ? A(1) : exp_acc(x);
  if (fm == kRelu) return x > A(0) ? A(1) : A(0);
  return A(1);
}

// Conversions between the element type T and the accumulation type A.  16-bit values go through
// their bits and the CUDA intrinsics (c10's float -> bfloat16 rounding calls a host-only
// constexpr function from device code).
template <typename A, typename T>
__device__ __forceinline__ A to_acc(T x) {
  if constexpr (std::is_same_v<T, A>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return static_cast<A>(__half2float(__ushort_as_half(x.x)));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return static_cast<A>(__uint_as_float(static_cast<uint32_t>(x.x) << 16));
  } else {
    return static_cast<A>(x);
  }
}

template <typename T, typename A>
__device__ __forceinline__ T from_acc(A x) {
  if constexpr (std::is_same_v<T, A>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return T(__half_as_ushort(__float2half_rn(static_cast<float>(x))), T::from_bits());
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return T(__bfloat16_as_ushort(__float2bfloat16_rn(static_cast<float>(x))), T::from_bits());
  } else {
    return static_cast<T>(x);
  }
}

// dst[r][c] (leading dim kLd) = src[r * sr + c * sc] for r < rows, c < cols, else 0; phi applied
// when fm >= 0 (padding stays 0: phi(0) = 1 for elu would count it); each row times
// row_scale[r] when given.  src == nullptr: a zero tile.
template <typename A, typename T>
__device__ __forceinline__ void load_tile(A* dst, const T* src, int64_t sr, int64_t sc, int rows, int cols,
                                          int fm = -1, const A* row_scale = nullptr) {
  for (int idx = threadIdx.x; idx < kC * kT; idx += kThreads) {
    const int r = idx / kT, c = idx % kT;
    A x = A(0);
    if (src != nullptr && r < rows && c < cols) {
      x = to_acc<A>(src[r * sr + c * sc]);
      if (fm >= 0) x = phi(x, fm);
      if (row_scale != nullptr) x *= row_scale[r];
    }
    dst[r * kLd + c] = x;
  }
}

// acc (this thread's 4 x 4 entries of a 64 x 64 product) += A B over k < 64, where
// A(row, k) = a[row][k] (or a[k][row] with kTransA) and B(k, col) = b[k][col] (or b[col][k]).
template <bool kTransA, bool kTransB, typename A>
__device__ __forceinline__ void mm(A (&acc)[4][4], const A* a, const A* b) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll 4
  for (int kk = 0; kk < kT; ++kk) {
    A av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = kTransA ? a[kk * kLd + ty + 16 * i] : a[(ty + 16 * i) * kLd + kk];
#pragma unroll
    for (int j = 0; j < 4; ++j) bv[j] = kTransB ? b[(tx + 16 * j) * kLd + kk] : b[kk * kLd + tx + 16 * j];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
  }
}

template <typename A>
__device__ __forceinline__ void zero(A (&acc)[4][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = A(0);
}

// this thread's entries of a 64 x 64 product to dst[r * ld + c] (r < rows, c < cols)
template <typename A>
__device__ __forceinline__ void store_acc(A* dst, int64_t ld, int rows, int cols, const A (&acc)[4][4]) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r < rows && c < cols) dst[r * ld + c] = acc[i][j];
    }
}

template <typename A>
__device__ __forceinline__ void load_acc(A (&acc)[4][4], const A* src, int64_t ld, int rows, int cols) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      acc[i][j] = (src != nullptr && r < rows && c < cols) ? src[r * ld + c] : A(0);
    }
}

// A masked 64 x 64 product staged to shared memory: dst[r][c] = keep ? acc * rs[r or c] + add : 0,
// with keep = c <= r (kLower, query rows x key columns) or c >= r (key rows x query columns).
template <bool kLower, bool kColFactors, typename A>
__device__ __forceinline__ void stage_masked(A* dst, const A (&acc)[4][4], const A* mul, const A* add) {
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      const bool keep = kLower ? c <= r : c >= r;
      const int f = kColFactors ? c : r;
      A x = acc[i][j];
      if (mul != nullptr) x *= mul[f];
      if (add != nullptr) x += add[f];
      dst[r * kLd + c] = keep ? x : A(0);
    }
}

// ---------------------------------------------------------------------------------------------
// parameters
// ---------------------------------------------------------------------------------------------

template <typename T>
struct View {  // a [B, H, L, X] tensor with element strides
  const T* p = nullptr;
  int64_t sb = 0, sh = 0, sl = 0, sx = 0;
  __device__ __forceinline__ const T* at(int b, int h, int64_t l, int64_t x) const {
    return p == nullptr ? nullptr : p + b * sb + h * sh + l * sl + x * sx;
  }
};

// A float state per chunk: element (b, h, chunk t, row, col) at bh * s_bh + t * s_t + row * ld + col
// (non-causal: s_t = 0, the one total state read by every chunk).
template <typename A>
struct States {
  A* p = nullptr;
  int64_t s_bh = 0, s_t = 0, ld = 0;
  __device__ __forceinline__ A* at(int64_t bh, int64_t t, int64_t row, int64_t col) const {
    return p + bh * s_bh + t * s_t + row * ld + col;
  }
};

template <typename T, typename A>
struct Problem {
  View<T> q, k, v;
  int H, N, M, D, Dv;
  int fm;
  bool causal, normalize;
  A eps, scale;
};

template <typename T, typename A>
struct BwdExtra {
  View<T> g;               // grad_out (p == nullptr: zero)
  const A* den = nullptr;  // [B, H, N] raw
  const A* delta = nullptr;
  const A* gden = nullptr;  // [B, H, N] or nullptr
};

// r_i, c_i of query rows row0 .. row0 + 63 into r[], c[] (threads 0..63).
template <typename T, typename A>
__device__ __forceinline__ void row_factors(const Problem<T, A>& p, const BwdExtra<T, A>& x, int64_t bh, int row0,
                                            A* r, A* c) {
  const int i = threadIdx.x;
  if (i < kC) {
    const int row = row0 + i;
    A ri = p.scale, ci = A(0);
    if (row < p.N) {
      const int64_t at = bh * p.N + row;
      if (p.normalize) {
        ri = A(1) / (x.den[at] + p.eps);
        ci = x.delta != nullptr ? -ri * x.delta[at] : A(0);
      }
      if (x.gden != nullptr) ci += x.gden[at];
    } else {
      ri = A(0);
    }
    r[i] = ri;
    c[i] = ci;
  }
}

// ---------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------

// S = S0 + sum_j phi(k_j) v_j^T, z = z0 + sum_j phi(k_j) over the M keys, chunk by chunk; with
// `chunks` the state before chunk t goes to chunks/zchunks[t].  Grid (NK * NV, H, B).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    state_fwd_kernel(const Problem<T, A> p, const A* S0, const A* z0, States<A> chunks, States<A> zchunks,
                     A* S_out, A* z_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* kt = reinterpret_cast<A*>(smem_raw);
  A* vt = kt + kTile;
  const int nv = static_cast<int>(ceil_div(p.Dv, kT));
  const int ik = blockIdx.x / nv, iv = blockIdx.x % nv;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int d0 = ik * kT, e0 = iv * kT;
  const int dn = min(kT, p.D - d0), en = min(kT, p.Dv - e0);
  const bool z_owner = iv == 0 && static_cast<int>(threadIdx.x) < dn;

  A s[4][4];
  load_acc(s, S0 == nullptr ? nullptr : S0 + (bh * p.D + d0) * p.Dv + e0, p.Dv, dn, en);
  A z = (z0 != nullptr && z_owner) ? z0[bh * p.D + d0 + threadIdx.x] : A(0);

  const int nt = static_cast<int>(ceil_div(p.M, kC));
  for (int t = 0; t < nt; ++t) {
    if (chunks.p != nullptr) {
      store_acc(chunks.at(bh, t, d0, e0), chunks.ld, dn, en, s);
      if (z_owner) *zchunks.at(bh, t, 0, d0 + threadIdx.x) = z;
    }
    const int rows = chunk_rows(p.M, static_cast<int64_t>(t) * kC);
    load_tile(kt, p.k.at(b, h, static_cast<int64_t>(t) * kC, d0), p.k.sl, p.k.sx, rows, dn, p.fm);
    load_tile(vt, p.v.at(b, h, static_cast<int64_t>(t) * kC, e0), p.v.sl, p.v.sx, rows, en);
    __syncthreads();
    mm<true, false>(s, kt, vt);  // s[d][e] += sum_c phi(k)[c][d] v[c][e]
    if (static_cast<int>(threadIdx.x) < kT) {
      for (int c = 0; c < kC; ++c) z += kt[c * kLd + threadIdx.x];
    }
    __syncthreads();
  }
  store_acc(S_out + (bh * p.D + d0) * p.Dv + e0, p.Dv, dn, en, s);
  if (z_owner) z_out[bh * p.D + d0 + threadIdx.x] = z;
}

// out rows of query chunk t, Dv-block iv.  Grid (NT * NV, H, B).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    output_kernel(const Problem<T, A> p, States<A> states, States<A> zstates, T* out, A* den_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* qt = reinterpret_cast<A*>(smem_raw);
  A* kt = qt + kTile;
  A* st = kt + kTile;
  A* zv = st + kTile;
  A* dsum = zv + kT;
  const int nv = static_cast<int>(ceil_div(p.Dv, kT));
  const int t = blockIdx.x / nv, iv = blockIdx.x % nv;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int e0 = iv * kT, en = min(kT, p.Dv - e0);
  const int64_t row0 = static_cast<int64_t>(t) * kC;
  const int rows = chunk_rows(p.N, row0);
  const int tid = threadIdx.x;

  A acc[4][4], pp[4][4];
  zero(acc);
  zero(pp);
  A den = A(0);  // threads 0..63: row tid
  for (int d0 = 0; d0 < p.D; d0 += kT) {
    const int dn = min(kT, p.D - d0);
    load_tile(qt, p.q.at(b, h, row0, d0), p.q.sl, p.q.sx, rows, dn, p.fm);
    if (p.causal) load_tile(kt, p.k.at(b, h, row0, d0), p.k.sl, p.k.sx, rows, dn, p.fm);
    load_tile(st, static_cast<const A*>(states.at(bh, t, d0, e0)), states.ld, int64_t{1}, dn, en);
    if (tid < kT) zv[tid] = tid < dn ? *zstates.at(bh, t, 0, d0 + tid) : A(0);
    __syncthreads();
    mm<false, false>(acc, qt, st);               // phi(Q) S
    if (p.causal) mm<false, true>(pp, qt, kt);  // phi(Q) phi(K)^T
    if (tid < kC) {
      for (int d = 0; d < kT; ++d) den += qt[tid * kLd + d] * zv[d];
    }
    __syncthreads();
  }
  if (p.causal) {
    stage_masked<true, false>(qt, pp, static_cast<const A*>(nullptr), static_cast<const A*>(nullptr));
    load_tile(kt, p.v.at(b, h, row0, e0), p.v.sl, p.v.sx, rows, en);
    __syncthreads();
    mm<false, false>(acc, qt, kt);  // (P o tril) V
    if (tid < kC) {
      for (int j = 0; j < kC; ++j) den += qt[tid * kLd + j];
    }
  }
  if (tid < kC) {
    dsum[tid] = den;
    if (iv == 0 && tid < rows) den_out[bh * p.N + row0 + tid] = den;
  }
  __syncthreads();
  const int ty = tid / 16, tx = tid % 16;
  T* o = out + (bh * p.N + row0) * p.Dv + e0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r < rows && c < en) {
        const A y = p.normalize ? acc[i][j] / (dsum[r] + p.eps) : acc[i][j] * p.scale;
        o[static_cast<int64_t>(r) * p.Dv + c] = from_acc<T>(y);
      }
    }
}

// ---------------------------------------------------------------------------------------------
// backward
// ---------------------------------------------------------------------------------------------

// delta[bh * N + i] = g_i . out_i; one warp per row.
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    delta_kernel(View<T> g, View<T> out, int H, int N, int Dv, int64_t rows, A* delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t i = row % N, bh = row / N;
  const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
  A acc = A(0);
  for (int e = lane; e < Dv; e += 32) acc += to_acc<A>(*g.at(b, h, i, e)) * to_acc<A>(*out.at(b, h, i, e));
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) delta[row] = acc;
}

// R = grad_S + sum_i r_i phi(q_i) g_i^T, w = grad_z + sum_i c_i phi(q_i) over the N queries,
// walking the chunks backwards; with `chunks` the value after chunk t (the sum over the later
// chunks) goes to chunks/zchunks[t].  Grid (NK * NV, H, B).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    state_bwd_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, const A* gS, const A* gz, States<A> chunks,
                     States<A> zchunks, A* dS_out, A* dz_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* qt = reinterpret_cast<A*>(smem_raw);
  A* gt = qt + kTile;
  A* rr = gt + kTile;
  A* cc = rr + kT;
  const int nv = static_cast<int>(ceil_div(p.Dv, kT));
  const int ik = blockIdx.x / nv, iv = blockIdx.x % nv;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int d0 = ik * kT, e0 = iv * kT;
  const int dn = min(kT, p.D - d0), en = min(kT, p.Dv - e0);
  const bool z_owner = iv == 0 && static_cast<int>(threadIdx.x) < dn;

  A s[4][4];
  load_acc(s, gS == nullptr ? nullptr : gS + (bh * p.D + d0) * p.Dv + e0, p.Dv, dn, en);
  A w = (gz != nullptr && z_owner) ? gz[bh * p.D + d0 + threadIdx.x] : A(0);

  const int nt = static_cast<int>(ceil_div(p.N, kC));
  for (int t = nt - 1; t >= 0; --t) {
    if (chunks.p != nullptr) {
      store_acc(chunks.at(bh, t, d0, e0), chunks.ld, dn, en, s);
      if (z_owner) *zchunks.at(bh, t, 0, d0 + threadIdx.x) = w;
    }
    const int64_t row0 = static_cast<int64_t>(t) * kC;
    const int rows = chunk_rows(p.N, row0);
    row_factors(p, x, bh, static_cast<int>(row0), rr, cc);
    __syncthreads();
    load_tile(qt, p.q.at(b, h, row0, d0), p.q.sl, p.q.sx, rows, dn, p.fm);
    load_tile(gt, x.g.at(b, h, row0, e0), x.g.sl, x.g.sx, rows, en, -1, static_cast<const A*>(rr));
    __syncthreads();
    mm<true, false>(s, qt, gt);  // s[d][e] += sum_i phi(q)[i][d] r_i g[i][e]
    if (static_cast<int>(threadIdx.x) < kT) {
      for (int i = 0; i < kC; ++i) w += cc[i] * qt[i * kLd + threadIdx.x];
    }
    __syncthreads();
  }
  store_acc(dS_out + (bh * p.D + d0) * p.Dv + e0, p.Dv, dn, en, s);
  if (z_owner) dz_out[bh * p.D + d0 + threadIdx.x] = w;
}

// dq of query chunk t, D-block ik.  Grid (NT * NK, H, B).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, States<A> states, States<A> zstates, T* dq) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* gt = reinterpret_cast<A*>(smem_raw);
  A* st = gt + kTile;
  A* vt = st + kTile;
  A* rr = vt + kTile;
  A* cc = rr + kT;
  A* zv = cc + kT;
  const int nk = static_cast<int>(ceil_div(p.D, kT));
  const int t = blockIdx.x / nk, ik = blockIdx.x % nk;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int d0 = ik * kT, dn = min(kT, p.D - d0);
  const int64_t row0 = static_cast<int64_t>(t) * kC;
  const int rows = chunk_rows(p.N, row0);
  const int tid = threadIdx.x;

  A acc[4][4], w[4][4];
  zero(acc);
  zero(w);
  if (x.g.p != nullptr) {
    for (int e0 = 0; e0 < p.Dv; e0 += kT) {
      const int en = min(kT, p.Dv - e0);
      load_tile(gt, x.g.at(b, h, row0, e0), x.g.sl, x.g.sx, rows, en);
      load_tile(st, static_cast<const A*>(states.at(bh, t, d0, e0)), states.ld, int64_t{1}, dn, en);
      if (p.causal) load_tile(vt, p.v.at(b, h, row0, e0), p.v.sl, p.v.sx, rows, en);
      __syncthreads();
      mm<false, true>(acc, gt, st);              // g S^T
      if (p.causal) mm<false, true>(w, gt, vt);  // g V^T
      __syncthreads();
    }
  }
  row_factors(p, x, bh, static_cast<int>(row0), rr, cc);
  if (tid < kT) zv[tid] = tid < dn ? *zstates.at(bh, t, 0, d0 + tid) : A(0);
  __syncthreads();
  const int ty = tid / 16, tx = tid % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = acc[i][j] * rr[ty + 16 * i] + cc[ty + 16 * i] * zv[tx + 16 * j];
  if (p.causal) {
    stage_masked<true, false>(gt, w, static_cast<const A*>(rr), static_cast<const A*>(cc));
    load_tile(vt, p.k.at(b, h, row0, d0), p.k.sl, p.k.sx, rows, dn, p.fm);
    __syncthreads();
    mm<false, false>(acc, gt, vt);  // (r g.v + c) o tril, times phi(K)
  }
  T* o = dq + (bh * p.N + row0) * p.D + d0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r < rows && c < dn) {
        const A xq = to_acc<A>(*p.q.at(b, h, row0 + r, d0 + c));
        o[static_cast<int64_t>(r) * p.D + c] = from_acc<T>(acc[i][j] * dphi(xq, p.fm));
      }
    }
}

// dk of key chunk t, D-block ik.  Grid (NT * NK, H, B).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    dk_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, States<A> rstates, States<A> wstates, T* dk) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* vt = reinterpret_cast<A*>(smem_raw);
  A* st = vt + kTile;
  A* gt = st + kTile;
  A* rr = gt + kTile;
  A* cc = rr + kT;
  A* zv = cc + kT;
  const int nk = static_cast<int>(ceil_div(p.D, kT));
  const int t = blockIdx.x / nk, ik = blockIdx.x % nk;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int d0 = ik * kT, dn = min(kT, p.D - d0);
  const int64_t row0 = static_cast<int64_t>(t) * kC;
  const int rows = chunk_rows(p.M, row0);  // keys
  const int qrows = p.causal ? rows : 0;  // the intra-chunk queries (causal: the same rows)
  const int tid = threadIdx.x;

  A acc[4][4], wt[4][4];
  zero(acc);
  zero(wt);
  for (int e0 = 0; e0 < p.Dv; e0 += kT) {
    const int en = min(kT, p.Dv - e0);
    load_tile(vt, p.v.at(b, h, row0, e0), p.v.sl, p.v.sx, rows, en);
    load_tile(st, static_cast<const A*>(rstates.at(bh, t, d0, e0)), rstates.ld, int64_t{1}, dn, en);
    if (p.causal) load_tile(gt, x.g.at(b, h, row0, e0), x.g.sl, x.g.sx, qrows, en);
    __syncthreads();
    mm<false, true>(acc, vt, st);               // V R^T
    if (p.causal) mm<false, true>(wt, vt, gt);  // wt[j][i] = v_j . g_i
    __syncthreads();
  }
  if (p.causal) row_factors(p, x, bh, static_cast<int>(row0), rr, cc);
  if (tid < kT) zv[tid] = tid < dn ? *wstates.at(bh, t, 0, d0 + tid) : A(0);
  __syncthreads();
  const int ty = tid / 16, tx = tid % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] += zv[tx + 16 * j];
  if (p.causal) {
    stage_masked<false, true>(vt, wt, static_cast<const A*>(rr), static_cast<const A*>(cc));
    load_tile(gt, p.q.at(b, h, row0, d0), p.q.sl, p.q.sx, qrows, dn, p.fm);
    __syncthreads();
    mm<false, false>(acc, vt, gt);  // (r_i v_j.g_i + c_i) for i >= j, times phi(Q)
  }
  T* o = dk + (bh * p.M + row0) * p.D + d0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r < rows && c < dn) {
        const A xk = to_acc<A>(*p.k.at(b, h, row0 + r, d0 + c));
        o[static_cast<int64_t>(r) * p.D + c] = from_acc<T>(acc[i][j] * dphi(xk, p.fm));
      }
    }
}

// dv of key chunk t, Dv-block iv.  Grid (NT * NV, H, B).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    dv_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, States<A> rstates, T* dv) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* kt = reinterpret_cast<A*>(smem_raw);
  A* st = kt + kTile;
  A* qt = st + kTile;
  A* rr = qt + kTile;
  A* cc = rr + kT;
  const int nv = static_cast<int>(ceil_div(p.Dv, kT));
  const int t = blockIdx.x / nv, iv = blockIdx.x % nv;
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = static_cast<int64_t>(b) * p.H + h;
  const int e0 = iv * kT, en = min(kT, p.Dv - e0);
  const int64_t row0 = static_cast<int64_t>(t) * kC;
  const int rows = chunk_rows(p.M, row0);
  const int qrows = p.causal ? rows : 0;

  A acc[4][4], pt[4][4];
  zero(acc);
  zero(pt);
  for (int d0 = 0; d0 < p.D; d0 += kT) {
    const int dn = min(kT, p.D - d0);
    load_tile(kt, p.k.at(b, h, row0, d0), p.k.sl, p.k.sx, rows, dn, p.fm);
    load_tile(st, static_cast<const A*>(rstates.at(bh, t, d0, e0)), rstates.ld, int64_t{1}, dn, en);
    if (p.causal) load_tile(qt, p.q.at(b, h, row0, d0), p.q.sl, p.q.sx, qrows, dn, p.fm);
    __syncthreads();
    mm<false, false>(acc, kt, st);              // phi(K) R
    if (p.causal) mm<false, true>(pt, kt, qt);  // pt[j][i] = phi(k_j) . phi(q_i)
    __syncthreads();
  }
  if (p.causal) {
    row_factors(p, x, bh, static_cast<int>(row0), rr, cc);
    __syncthreads();
    stage_masked<false, true>(kt, pt, static_cast<const A*>(rr), static_cast<const A*>(nullptr));
    load_tile(qt, x.g.at(b, h, row0, e0), x.g.sl, x.g.sx, qrows, en);
    __syncthreads();
    mm<false, false>(acc, kt, qt);  // (r_i phi(k_j).phi(q_i)) for i >= j, times g
  }
  const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
  T* o = dv + (bh * p.M + row0) * p.Dv + e0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r < rows && c < en) o[static_cast<int64_t>(r) * p.Dv + c] = from_acc<T>(acc[i][j]);
    }
}

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

int parse_feature_map(std::string_view name) {
  if (name == "elu") return kElu;
  if (name == "relu") return kRelu;
  if (name == "identity") return kIdentity;
  TORCH_CHECK(false, "attnkit::linear (cuda): unknown feature_map '", std::string(name),
              "'; expected 'elu', 'relu' or 'identity'");
  return kIdentity;  // unreachable
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

void check_qkv(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn,
              ": expected q [B,H,N,D], k [B,H,M,D], v [B,H,M,Dv]; got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(q.is_cuda(), fn, ": the cuda backend takes CUDA tensors; got q on ", q.device());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), fn, ": q, k, v must be on one device; got ",
              q.device(), ", ", k.device(), ", ", v.device());
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kHalf || st == at::kBFloat16 || st == at::kFloat || st == at::kDouble, fn,
              ": the cuda kernels take float16, bfloat16, float32 or float64; got ", st);
  TORCH_CHECK(k.scalar_type() == st && v.scalar_type() == st, fn, ": q, k and v must share a dtype");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) && q.size(1) == v.size(1) &&
                  q.size(3) == k.size(3) && k.size(2) == v.size(2),
              fn, ": q, k, v sizes do not fit: ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(!causal || q.size(2) == k.size(2), fn, ": causal needs N == M; got ", q.size(2), " and ", k.size(2));
  TORCH_CHECK(q.size(0) <= 65535 && q.size(1) <= 65535, fn, ": B and H must be <= 65535 (CUDA grid); got ",
              q.size(0), ", ", q.size(1));
  TORCH_CHECK(q.size(2) < (int64_t{1} << 30) && k.size(2) < (int64_t{1} << 30) && q.size(3) < (1 << 24) &&
                  v.size(3) < (1 << 24),
              fn, ": sizes too large: ", q.sizes(), ", ", v.sizes());
}

// An optional contiguous tensor of the accumulation type with the given shape, on q's device.
at::Tensor check_acc(const char* fn, const char* name, const std::optional<at::Tensor>& t, const at::Tensor& q,
                     at::ScalarType acc, at::IntArrayRef shape) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->scalar_type() == acc, fn, ": ", name, " must be ", acc, "; got ", t->scalar_type());
  TORCH_CHECK(t->sizes() == shape, fn, ": ", name, " must have shape ", shape, "; got ", t->sizes());
  TORCH_CHECK(t->device() == q.device(), fn, ": ", name, " must be on q's device (", q.device(), "); got ",
              t->device());
  return t->contiguous();
}

template <typename T>
View<T> view_of(const at::Tensor& x) {
  View<T> w;
  if (!x.defined()) return w;
  w.p = static_cast<const T*>(x.data_ptr());
  w.sb = x.stride(0), w.sh = x.stride(1), w.sl = x.stride(2), w.sx = x.stride(3);
  return w;
}

template <typename A>
const A* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? static_cast<const A*>(t.data_ptr()) : nullptr;
}

// States over a contiguous buffer of `nt` [rows, cols] states per (b, h) (Hs [B,H,NT,D,Dv]:
// rows D; Zs [B,H,NT,D]: rows 1), or, with nt = 0, of one [rows, cols] total per (b, h) that
// every chunk reads (S [B,H,D,Dv], z [B,H,D]).
template <typename A>
States<A> states_of(const at::Tensor& x, int64_t nt, int64_t rows, int64_t cols) {
  States<A> s;
  s.p = static_cast<A*>(x.data_ptr());
  s.ld = cols;
  s.s_t = nt > 0 ? rows * cols : 0;
  s.s_bh = (nt > 0 ? nt : 1) * rows * cols;
  return s;
}

template <typename A>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(kTiles * kTile + kVecs * kT) * sizeof(A);
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <typename T, typename A>
Problem<T, A> make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int fm, bool causal,
                           bool normalize, double eps, double scale) {
  Problem<T, A> p;
  p.q = view_of<T>(q);
  p.k = view_of<T>(k);
  p.v = view_of<T>(v);
  p.H = static_cast<int>(q.size(1));
  p.N = static_cast<int>(q.size(2));
  p.M = static_cast<int>(k.size(2));
  p.D = static_cast<int>(q.size(3));
  p.Dv = static_cast<int>(v.size(3));
  p.fm = fm;
  p.causal = causal;
  p.normalize = normalize;
  p.eps = static_cast<A>(eps);
  p.scale = static_cast<A>(scale);
  return p;
}

// The forward states: S_final / z_final into S, z; per chunk into Hs / Zs when given.
template <typename T, typename A>
void run_state_fwd(const Problem<T, A>& p, int64_t B, const at::Tensor& S0, const at::Tensor& z0, at::Tensor* Hs,
                   at::Tensor* Zs, at::Tensor& S, at::Tensor& z, cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<A>();
  allow_smem(state_fwd_kernel<T, A>, smem);
  States<A> hs, zs;
  if (Hs != nullptr) {
    const int64_t nt = Hs->size(2);
    hs = states_of<A>(*Hs, nt, p.D, p.Dv);
    zs = states_of<A>(*Zs, nt, 1, p.D);
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(p.D, kT) * ceil_div(p.Dv, kT)), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(B));
  state_fwd_kernel<T, A><<<grid, kThreads, smem, stream>>>(p, ptr_or_null<A>(S0), ptr_or_null<A>(z0), hs, zs,
                                                            static_cast<A*>(S.data_ptr()),
                                                            static_cast<A*>(z.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename A>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& S0,
                  const at::Tensor& z0, int fm, bool causal, bool normalize, double eps, double scale, at::Tensor& out,
                  at::Tensor& den, at::Tensor& S, at::Tensor& z) {
  const Problem<T, A> p = make_problem<T, A>(q, k, v, fm, causal, normalize, eps, scale);
  const int64_t B = q.size(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t nt = ceil_div(p.N, kC);
  at::Tensor Hs, Zs;
  if (causal) {
    Hs = at::empty({B, p.H, nt, p.D, p.Dv}, q.options().dtype(acc_type(q.scalar_type())));
    Zs = at::empty({B, p.H, nt, p.D}, Hs.options());
  }
  run_state_fwd<T, A>(p, B, S0, z0, causal ? &Hs : nullptr, causal ? &Zs : nullptr, S, z, stream);
  if (p.N == 0) return;
  if (p.M == 0 && !S0.defined()) {  // no keys, no state: zeros whatever eps (0 / 0 at eps = 0)
    out.zero_();
    den.zero_();
    return;
  }
  constexpr size_t smem = smem_bytes<A>();
  allow_smem(output_kernel<T, A>, smem);
  States<A> hs = causal ? states_of<A>(Hs, nt, p.D, p.Dv) : states_of<A>(S, 0, p.D, p.Dv);
  States<A> zs = causal ? states_of<A>(Zs, nt, 1, p.D) : states_of<A>(z, 0, 1, p.D);
  const dim3 grid(static_cast<unsigned>(nt * ceil_div(p.Dv, kT)), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(B));
  output_kernel<T, A><<<grid, kThreads, smem, stream>>>(p, hs, zs, static_cast<T*>(out.data_ptr()),
                                                         static_cast<A*>(den.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(T{}, A{}) with the element and accumulation types of `st`.
template <typename F>
void dispatch(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kHalf: f(c10::Half{}, float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}, float{}); break;
    case at::kFloat: f(float{}, float{}); break;
    case at::kDouble: f(double{}, double{}); break;
    default: TORCH_CHECK(false, "attnkit::linear (cuda): unsupported dtype ", st);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& S0_in,
    const std::optional<at::Tensor>& z0_in, bool causal, c10::string_view feature_map, bool normalize, double eps,
    double scale) {
  constexpr const char* fn = "attnkit::linear_fwd (cuda)";
  check_qkv(fn, q, k, v, causal);
  const int fm = parse_feature_map(std::string_view(feature_map.data(), feature_map.size()));
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t Dv = v.size(3);
  const auto acc = acc_type(q.scalar_type());
  const at::Tensor S0 = check_acc(fn, "S0", S0_in, q, acc, {B, H, D, Dv});
  const at::Tensor z0 = check_acc(fn, "z0", z0_in, q, acc, {B, H, D});
  TORCH_CHECK(S0.defined() == z0.defined(), fn, ": S0 and z0 go together");
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({B, H, N, Dv}, q.options());
  at::Tensor den = at::empty({B, H, N}, q.options().dtype(acc));
  at::Tensor S = at::empty({B, H, D, Dv}, q.options().dtype(acc));
  at::Tensor z = at::empty({B, H, D}, q.options().dtype(acc));
  if (B * H == 0) return {out, den, S, z};
  if (D == 0 || Dv == 0) {  // empty head dims: every sum is empty
    out.zero_(), den.zero_(), S.zero_(), z.zero_();
    if (S0.defined()) S.copy_(S0), z.copy_(z0);
    return {out, den, S, z};
  }
  dispatch(q.scalar_type(), [&](auto t, auto a) {
    using T = decltype(t);
    using A = decltype(a);
    forward_impl<T, A>(q, k, v, S0, z0, fm, causal, normalize, eps, scale, out, den, S, z);
  });
  return {out, den, S, z};
}

template <typename T, typename A>
void backward_impl(const at::Tensor& g, const at::Tensor& gden, const at::Tensor& gS, const at::Tensor& gz,
                   const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                   const at::Tensor& den, const at::Tensor& S, const at::Tensor& z, const at::Tensor& S0,
                   const at::Tensor& z0, int fm, bool causal, bool normalize, double eps, double scale, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv, at::Tensor& dS0, at::Tensor& dz0) {
  const Problem<T, A> p = make_problem<T, A>(q, k, v, fm, causal, normalize, eps, scale);
  const int64_t B = q.size(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = q.options().dtype(acc_type(q.scalar_type()));
  constexpr size_t smem = smem_bytes<A>();
  const int64_t nt_q = ceil_div(p.N, kC), nt_k = ceil_div(p.M, kC);

  BwdExtra<T, A> x;
  x.g = view_of<T>(g);
  x.den = ptr_or_null<A>(den);
  x.gden = ptr_or_null<A>(gden);
  at::Tensor delta;
  if (normalize && g.defined() && p.N > 0) {
    delta = at::empty({B, p.H, p.N}, opts);
    const int64_t rows = B * p.H * p.N;
    constexpr int64_t kRowsPerBlock = kThreads / 32;
    delta_kernel<T, A><<<static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)), kThreads, 0, stream>>>(
        view_of<T>(g), view_of<T>(out), p.H, p.N, p.Dv, rows, static_cast<A*>(delta.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    x.delta = static_cast<const A*>(delta.data_ptr());
  }

  // Forward states: per chunk (causal, recomputed) or the forward's totals S, z.
  at::Tensor Hs, Zs, S_scratch, z_scratch;
  if (causal) {
    Hs = at::empty({B, p.H, nt_q, p.D, p.Dv}, opts);
    Zs = at::empty({B, p.H, nt_q, p.D}, opts);
    S_scratch = at::empty({B, p.H, p.D, p.Dv}, opts);
    z_scratch = at::empty({B, p.H, p.D}, opts);
    run_state_fwd<T, A>(p, B, S0, z0, &Hs, &Zs, S_scratch, z_scratch, stream);
  }
  States<A> hs = causal ? states_of<A>(Hs, nt_q, p.D, p.Dv) : states_of<A>(S, 0, p.D, p.Dv);
  States<A> zs = causal ? states_of<A>(Zs, nt_q, 1, p.D) : states_of<A>(z, 0, 1, p.D);

  // Reverse states over the queries: per chunk (causal) or the total, which is dS0 / dz0.
  at::Tensor Rs, Ws;
  if (causal) {
    Rs = at::empty({B, p.H, nt_q, p.D, p.Dv}, opts);
    Ws = at::empty({B, p.H, nt_q, p.D}, opts);
  }
  {
    allow_smem(state_bwd_kernel<T, A>, smem);
    States<A> rs, ws;
    if (causal) rs = states_of<A>(Rs, nt_q, p.D, p.Dv), ws = states_of<A>(Ws, nt_q, 1, p.D);
    const dim3 grid(static_cast<unsigned>(ceil_div(p.D, kT) * ceil_div(p.Dv, kT)), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(B));
    state_bwd_kernel<T, A><<<grid, kThreads, smem, stream>>>(p, x, ptr_or_null<A>(gS), ptr_or_null<A>(gz), rs, ws,
                                                              static_cast<A*>(dS0.data_ptr()),
                                                              static_cast<A*>(dz0.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  States<A> rs = causal ? states_of<A>(Rs, nt_q, p.D, p.Dv) : states_of<A>(dS0, 0, p.D, p.Dv);
  States<A> ws = causal ? states_of<A>(Ws, nt_q, 1, p.D) : states_of<A>(dz0, 0, 1, p.D);

  if (p.N > 0) {
    allow_smem(dq_kernel<T, A>, smem);
    const dim3 grid(static_cast<unsigned>(nt_q * ceil_div(p.D, kT)), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(B));
    dq_kernel<T, A><<<grid, kThreads, smem, stream>>>(p, x, hs, zs, static_cast<T*>(dq.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (p.M > 0) {
    allow_smem(dk_kernel<T, A>, smem);
    allow_smem(dv_kernel<T, A>, smem);
    const dim3 gk(static_cast<unsigned>(nt_k * ceil_div(p.D, kT)), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(B));
    dk_kernel<T, A><<<gk, kThreads, smem, stream>>>(p, x, rs, ws, static_cast<T*>(dk.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const dim3 gv(static_cast<unsigned>(nt_k * ceil_div(p.Dv, kT)), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(B));
    dv_kernel<T, A><<<gv, kThreads, smem, stream>>>(p, x, rs, static_cast<T*>(dv.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cuda(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den_in,
    const std::optional<at::Tensor>& grad_S_in, const std::optional<at::Tensor>& grad_z_in, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den_in,
    const at::Tensor& S_in, const at::Tensor& z_in, const std::optional<at::Tensor>& S0_in,
    const std::optional<at::Tensor>& z0_in, bool causal, c10::string_view feature_map, bool normalize, double eps,
    double scale) {
  constexpr const char* fn = "attnkit::linear_bwd (cuda)";
  check_qkv(fn, q, k, v, causal);
  const int fm = parse_feature_map(std::string_view(feature_map.data(), feature_map.size()));
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t M = k.size(2), Dv = v.size(3);
  const auto acc = acc_type(q.scalar_type());
  TORCH_CHECK(out.sizes() == at::IntArrayRef({B, H, N, Dv}) && out.scalar_type() == q.scalar_type() &&
                  out.device() == q.device(),
              fn, ": out must be the forward's output");
  const at::Tensor den = check_acc(fn, "den", den_in, q, acc, {B, H, N});
  const at::Tensor S = check_acc(fn, "S", S_in, q, acc, {B, H, D, Dv});
  const at::Tensor z = check_acc(fn, "z", z_in, q, acc, {B, H, D});
  const at::Tensor S0 = check_acc(fn, "S0", S0_in, q, acc, {B, H, D, Dv});
  const at::Tensor z0 = check_acc(fn, "z0", z0_in, q, acc, {B, H, D});
  TORCH_CHECK(S0.defined() == z0.defined(), fn, ": S0 and z0 go together");
  const at::Tensor gden = check_acc(fn, "grad_den", grad_den_in, q, acc, {B, H, N});
  const at::Tensor gS = check_acc(fn, "grad_S", grad_S_in, q, acc, {B, H, D, Dv});
  const at::Tensor gz = check_acc(fn, "grad_z", grad_z_in, q, acc, {B, H, D});
  at::Tensor g;
  if (grad_out.has_value() && grad_out->defined()) {
    g = *grad_out;
    TORCH_CHECK(g.sizes() == out.sizes() && g.scalar_type() == q.scalar_type() && g.device() == q.device(), fn,
                ": grad_out must be shaped and typed like out");
  }
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor dq = at::empty({B, H, N, D}, q.options());
  at::Tensor dk = at::empty({B, H, M, D}, q.options());
  at::Tensor dv = at::empty({B, H, M, Dv}, q.options());
  at::Tensor dS0 = at::empty({B, H, D, Dv}, q.options().dtype(acc));
  at::Tensor dz0 = at::empty({B, H, D}, q.options().dtype(acc));
  if (B * H == 0) return {dq, dk, dv, dS0, dz0};
  if ((M == 0 && !S0.defined()) || D == 0 || Dv == 0) {
    // out is identically 0 (no keys, no state) or there is no head dim: every gradient but the
    // state's is 0.  (As the CPU kernel: dS0 / dz0 then carry grad_S / grad_z through.)
    dq.zero_(), dk.zero_(), dv.zero_();
    if (gS.defined()) dS0.copy_(gS); else dS0.zero_();
    if (gz.defined()) dz0.copy_(gz); else dz0.zero_();
    return {dq, dk, dv, dS0, dz0};
  }
  if (normalize) TORCH_CHECK(den.defined(), fn, ": den is needed with normalize");
  dispatch(q.scalar_type(), [&](auto t, auto a) {
    using T = decltype(t);
    using A = decltype(a);
    backward_impl<T, A>(g, gden, gS, gz, q, k, v, out, den, S, z, S0, z0, fm, causal, normalize, eps, scale, dq, dk,
                        dv, dS0, dz0);
  });
  return {dq, dk, dv, dS0, dz0};
}

}  // namespace
}  // namespace attnkit

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("linear_fwd", &attnkit::linear_fwd_cuda);
  m.impl("linear_bwd", &attnkit::linear_bwd_cuda);
}

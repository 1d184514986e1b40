// CUDA C++ kernels of the modern Hopfield family for attnkit::hopfield_update_fwd and
// attnkit::hopfield_energy_fwd (schemas and exact semantics in csrc/ops.cpp; the CPU kernels are
// csrc/cpu/hopfield.cpp): the entry points <op>_cuda (csrc/cuda/launch.h), which
// csrc/checks/hopfield.cpp registers for the CUDA dispatch key after running the ops' input
// checks (nothing here throws on bad input: issue 10).  Same ops as the CPU kernels, so the
// fakes and the autograd formula registered in pytorch_ext/ops/hopfield.py serve both.
//
// STATUS.  Checked: compiles with nvcc -c for sm_80 and sm_90a (.ci/compile_cuda.sh); the device
// code runs in the CPU emulator (tests/csrc/test_hopfield_cuda_emulated.py).  On a GPU:
// tests/csrc/test_hopfield_cuda.py (`pytest -m gpu`) passed in full on an H100 (sm_90, torch
// 2.11 + CUDA 13.0, commit 4a5f870, bench/RESULTS.md "session 8").  Speed there: 0.87 ms for one
// query over 2^20 bf16 rows against the Triton kernel's 0.175 ms, so Triton stays the default.
// The algorithm is the one of the Triton kernels (kernels/hopfield.py), which are
// tested against the reference under the interpreter.
//
// WHAT.  state [B,H,S,D], stored X [B,H,N,D] (N >= 1), values V None or [B,H,N,Dv]; float16,
// bfloat16 or float32 (all alike), D, Dv in 1..kMaxD, float32 accumulation.
//   update: R = steps retrievals, the first U (= steps, or steps - 1 with values) in the stored
//   space xi <- softmax(beta xi X^T) X, the last one with values softmax(beta xi X^T) V; tol:
//   per-row early stop (a row's first update applies; after an applied update whose change
//   max_d |new - old| is not > tol, NaN included, the row is frozen).  Returns (float32) out,
//   states [steps+1,B,H,S,D], lse [R,B,H,S] (+inf where a whole block skipped the step), applied
//   bool [U,B,H,S] -- exactly the CPU kernel's outputs.
//   energy: (energy, lse) float32 [B,H,S].
//
// HOW.  Blocks of 256 threads = 8 warps; a block holds kRows = 8 * RPW query rows (RPW = rows per
// warp: 1, 2 or 4, picked from S), warp w owning rows w, w + 8, ...; stored patterns stream in
// tiles of kBN = 32 rows staged in shared memory as float32 (row pitch D + 1: conflict-free when
// the 32 lanes read 32 different rows).  For one tile, lane n of a warp computes the score of
// stored row n against each of its warp's query rows (a dot over D from shared memory), so the
// row max and row sum of the online softmax are warp shuffles; the accumulator acc[r][d] is held
// in registers by lane d % 32 (kMaxD / 32 = 8 per row), and p[r][n] reaches it by __shfl_sync
// from lane n.  Each X tile is loaded once per step and serves as keys and values.
//  - fused: grid (query blocks, B*H); the block keeps its states in shared memory (float32)
//    across all steps and writes each step's state out for the backward only.  A block whose
//    rows are all frozen skips the remaining updates.
//  - split-N (S <= 16, N >= 4096, fewer b*h than SMs; flash-decoding): per step a partial
//    kernel, grid (chunks, B*H), writes (m, l, acc) per query for its chunk of stored rows, and a
//    merge kernel, grid (B*H), combines them through their log-sum-exps and finishes the step
//    (the next state goes to `states`, which the next step's partial kernel reads).  With one
//    query (S = 1) the partial kernel spreads the stored rows over its 8 warps and reads them
//    straight from global memory (retrieve_one_row; session 22, emulated, not yet timed on a GPU).
// Scores are kept in base 2 (beta * log2 e) so the exponentials are exp2f; lse is natural log.
// SIMT float32 FMAs throughout (no tensor cores): the Triton kernel is the default GPU path.

#include "host_utils.cuh"  // first: torch headers and host helpers

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace attnkit {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBN = 32;             // stored rows per tile (one per lane)
constexpr int kMaxD = 256;          // largest D / Dv
constexpr int kCols = kMaxD / 32;   // accumulator registers per row and lane
constexpr int kSplitMaxS = 16;
constexpr int kSplitMinN = 4096;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

template <typename T>
struct Params {
  const T* state;   // [BH, S, D]
  const T* X;       // [BH, N, D]
  const T* V;       // [BH, N, Dv] or nullptr
  float* out;       // [BH, S, Dout]
  float* states;    // [steps + 1, BH, S, D]
  float* lse;       // [R, BH, S]
  bool* applied;    // [U, BH, S]
  int64_t BH, S, N;
  int D, Dv, R, U;
  float beta2;  // beta * log2(e)
  float tol;
  bool has_tol, has_values, final_state;
};

// Shared memory of a block: xi [kRows][D+1], the X tile [kBN][D+1], the V tile [kBN][Dv+1]
// (with values), act [kRows] (int).
struct Smem {
  float* xi;
  float* xt;
  float* vt;
  int* act;
};

template <int RPW>
__device__ Smem carve(float* base, int D, int Dv, bool has_values) {
  Smem s;
  s.xi = base;
  s.xt = s.xi + 8 * RPW * (D + 1);
  s.vt = s.xt + kBN * (D + 1);
  s.act = reinterpret_cast<int*>(s.vt + (has_values ? kBN * (Dv + 1) : 0));
  return s;
}

template <int RPW>
size_t smem_bytes(int D, int Dv, bool has_values) {
  const size_t floats = static_cast<size_t>(8 * RPW * (D + 1) + kBN * (D + 1) + (has_values ? kBN * (Dv + 1) : 0));
  return floats * sizeof(float) + 8 * RPW * sizeof(int);
}

// Stage rows [t0, t0 + cnt) of a [N, W] matrix (one b*h) into tile [kBN][W+1], zeros past cnt.
// Four loads of a thread before their stores: in one loop each load waited for the previous
// element's store (tile is a generic pointer: it might alias src), one memory latency an element
// (linear.cu's state walks paid ~17 us a chunk for that pattern on an H200, session 24).
template <typename T>
__device__ void load_tile(float* tile, const T* src, int64_t t0, int cnt, int W) {
  constexpr int kGroup = 4;
  const int total = kBN * W;
  for (int e0 = threadIdx.x; e0 < total; e0 += kGroup * kThreads) {
    float vals[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int e = e0 + g * kThreads, n = e / W, d = e - n * W;
      vals[g] = e < total && n < cnt ? to_float(src[(t0 + n) * W + d]) : 0.f;
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int e = e0 + g * kThreads, n = e / W, d = e - n * W;
      if (e < total) tile[n * (W + 1) + d] = vals[g];
    }
  }
}

// One retrieval of the block's states (sm.xi) over stored rows [n0, n1) of b*h `bh`:
// m (base 2), l, acc = sum p V (value_step) or sum p X, accx = sum p X (want_x, value step).
// Registers: row i of the warp is query row w + 8 i; acc[i][j] is column lane + 32 j.
template <typename T, int RPW>
__device__ void retrieve(const Params<T>& p, const Smem& sm, int64_t bh, int64_t n0, int64_t n1, bool value_step,
                         bool want_x, float (&m)[RPW], float (&l)[RPW], float (&acc)[RPW][kCols],
                         float (&accx)[RPW][kCols]) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int D = p.D, Dv = p.Dv, Dout = value_step ? Dv : D;
  const T* X = p.X + bh * p.N * D;
  const T* V = value_step ? p.V + bh * p.N * Dv : nullptr;
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[i][j] = 0.f, accx[i][j] = 0.f;
  }
  for (int64_t t0 = n0; t0 < n1; t0 += kBN) {
    const int cnt = static_cast<int>(n1 - t0 < kBN ? n1 - t0 : kBN);
    __syncthreads();  // everyone is done with the previous tile
    load_tile(sm.xt, X, t0, cnt, D);
    if (value_step) load_tile(sm.vt, V, t0, cnt, Dv);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const float* q = sm.xi + (w + kWarps * i) * (D + 1);
      const float* x = sm.xt + lane * (D + 1);
      float s = 0.f;
      for (int d = 0; d < D; ++d) s = fmaf(q[d], x[d], s);
      s = lane < cnt ? s * p.beta2 : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max(s));
      const float alpha = exp2f(m[i] - m_new);  // 0 on the first tile (m = -inf)
      const float pr = exp2f(s - m_new);        // 0 past cnt
      l[i] = l[i] * alpha + warp_sum(pr);
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[i][j] *= alpha, accx[i][j] *= alpha;
      for (int n = 0; n < cnt; ++n) {
        const float pn = __shfl_sync(kFull, pr, n);
        const float* xr = sm.xt + n * (D + 1);
        const float* vr = value_step ? sm.vt + n * (Dv + 1) : xr;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int d = lane + 32 * j;
          if (d < Dout) acc[i][j] = fmaf(pn, vr[d], acc[i][j]);
          if (want_x && d < D) accx[i][j] = fmaf(pn, xr[d], accx[i][j]);
        }
      }
    }
  }
}

// retrieve's result for a block whose only query row is row 0 (S = 1, split-N partials): the
// stored rows spread over the warps instead of the query rows -- retrieve would leave 7 of the 8
// warps with no row and stage every tile through shared memory (0.87 ms for N = 2^20 bf16 on an
// H100, 5% of the copy bandwidth).  Warp w reads rows n0 + w, n0 + w + 8, ... straight from global
// memory, kUnroll of them per step (their loads in flight together); lane c holds columns c + 32 j
// of q, of each row, and of its accumulators (retrieve's layout), so a score is a warp_sum.  Each
// warp keeps its own (m, l, acc, accx); warp 0 then merges the 8 through shared memory (sm.xt,
// sm.vt: unused here) into m[0], l[0], acc[0], accx[0].  Every warp's other outputs: m = -inf,
// l = 0 (the partial rows past S, which the merge never reads).
template <typename T, int RPW>
__device__ void retrieve_one_row(const Params<T>& p, const Smem& sm, int64_t bh, int64_t n0, int64_t n1,
                                 bool value_step, bool want_x, float (&m)[RPW], float (&l)[RPW],
                                 float (&acc)[RPW][kCols], float (&accx)[RPW][kCols]) {
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int D = p.D, Dv = p.Dv, Dout = value_step ? Dv : D;
  const T* X = p.X + bh * p.N * D;
  const T* V = value_step ? p.V + bh * p.N * Dv : nullptr;
  float qr[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) qr[j] = lane + 32 * j < D ? sm.xi[lane + 32 * j] : 0.f;
  float mw = -INFINITY, lw = 0.f, aw[kCols], xw[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) aw[j] = 0.f, xw[j] = 0.f;
  for (int64_t base = n0 + w; base < n1; base += kWarps * kUnroll) {
    float x[kUnroll][kCols], sc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t n = base + static_cast<int64_t>(kWarps) * u;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int d = lane + 32 * j;
        x[u][j] = n < n1 && d < D ? to_float(X[n * D + d]) : 0.f;
      }
    }
    float mx = mw;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < kCols; ++j) dot = fmaf(qr[j], x[u][j], dot);
      const int64_t n = base + static_cast<int64_t>(kWarps) * u;
      sc[u] = n < n1 ? warp_sum(dot) * p.beta2 : -INFINITY;
      mx = fmaxf(mx, sc[u]);
    }
    const float alpha = exp2f(mw - mx);  // 0 on the warp's first step (mw = -inf)
    mw = mx;
    lw *= alpha;
#pragma unroll
    for (int j = 0; j < kCols; ++j) aw[j] *= alpha, xw[j] *= alpha;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float pr = exp2f(sc[u] - mx);  // 0 past n1
      lw += pr;
      const int64_t n = base + static_cast<int64_t>(kWarps) * u;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int d = lane + 32 * j;
        if (value_step) {
          if (d < Dv && n < n1) aw[j] = fmaf(pr, to_float(V[n * Dv + d]), aw[j]);
          if (want_x) xw[j] = fmaf(pr, x[u][j], xw[j]);
        } else {
          aw[j] = fmaf(pr, x[u][j], aw[j]);
        }
      }
    }
  }
  // Merge the warps: acc rows in sm.vt (value step) or sm.xt, accx rows in sm.xt, then (m, l).
  float* acc_s = value_step ? sm.vt : sm.xt;
  float* accx_s = sm.xt;
  float* ml_s = sm.xt + kWarps * D;  // 2 kWarps floats, past the accx rows
  __syncthreads();  // (the block's earlier shared-memory reads are done)
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int d = lane + 32 * j;
    if (d < Dout) acc_s[w * Dout + d] = aw[j];
    if (want_x && d < D) accx_s[w * D + d] = xw[j];
  }
  if (lane == 0) ml_s[w] = mw, ml_s[kWarps + w] = lw;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[i][j] = 0.f, accx[i][j] = 0.f;
  }
  if (w != 0) return;
  float mm = -INFINITY;
  for (int v = 0; v < kWarps; ++v) mm = fmaxf(mm, ml_s[v]);
  for (int v = 0; v < kWarps; ++v) {
    // A warp with no row (m = -inf, l = 0) weighs 0, also where every warp has m = -inf.
    const float wv = ml_s[v] == -INFINITY ? 0.f : exp2f(ml_s[v] - mm);
    l[0] += ml_s[kWarps + v] * wv;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int d = lane + 32 * j;
      if (d < Dout) acc[0][j] = fmaf(acc_s[v * Dout + d], wv, acc[0][j]);
      if (want_x && d < D) accx[0][j] = fmaf(accx_s[v * D + d], wv, accx[0][j]);
    }
  }
  m[0] = mm;
}

// Finish retrieval k for the block's rows [q0, q0 + rows) of b*h `bh` from (m, l, acc, accx):
// lse[k]; the read-out into out (value step; with final_state also the stored-space state into
// states[k + 1]) or the update with the tol rule into sm.xi, sm.act, applied[k], states[k + 1].
template <typename T, int RPW>
__device__ void finish_step(const Params<T>& p, const Smem& sm, int64_t bh, int64_t q0, int rows, int k,
                            bool value_step, const float (&m)[RPW], const float (&l)[RPW],
                            const float (&acc)[RPW][kCols], const float (&accx)[RPW][kCols]) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int D = p.D, Dv = p.Dv;
  const int64_t plane = p.BH * p.S;
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = w + kWarps * i;
    if (r >= rows) continue;  // warp-uniform
    const int64_t row = bh * p.S + q0 + r;
    const float inv = 1.f / l[i];
    float* xr = sm.xi + r * (D + 1);
    if (lane == 0) p.lse[k * plane + row] = (m[i] + log2f(l[i])) * kLn2;
    if (value_step) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int d = lane + 32 * j;
        if (d < Dv) p.out[row * Dv + d] = acc[i][j] * inv;
      }
      if (!p.final_state) continue;
      if (sm.act[r]) {
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int d = lane + 32 * j;
          if (d < D) xr[d] = accx[i][j] * inv;
        }
      }
    } else {
      const bool active = sm.act[r] != 0;
      if (lane == 0) p.applied[k * plane + row] = active;
      if (active) {
        float change = 0.f;
        int nan = 0;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int d = lane + 32 * j;
          if (d < D) {
            const float nv = acc[i][j] * inv;
            const float diff = fabsf(nv - xr[d]);
            nan |= isnan(diff) ? 1 : 0;
            change = fmaxf(change, diff);
            xr[d] = nv;
          }
        }
        change = warp_max(change);
        nan = __any_sync(kFull, nan);
        __syncwarp();  // every lane has read act[r]
        if (p.has_tol && (nan || !(change > p.tol)) && lane == 0) sm.act[r] = 0;
      }
    }
    __syncwarp();
    float* dst = p.states + ((k + 1) * plane + row) * D;
    for (int d = lane; d < D; d += 32) dst[d] = xr[d];
  }
}

// Every row of the block frozen: lse = +inf, applied = false, the state carried to states[k+1].
template <typename T, int RPW>
__device__ void skip_step(const Params<T>& p, const Smem& sm, int64_t bh, int64_t q0, int rows, int k) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t plane = p.BH * p.S;
  for (int i = 0; i < RPW; ++i) {
    const int r = w + kWarps * i;
    if (r >= rows) continue;
    const int64_t row = bh * p.S + q0 + r;
    if (lane == 0) {
      p.lse[k * plane + row] = INFINITY;
      p.applied[k * plane + row] = false;
    }
    float* dst = p.states + ((k + 1) * plane + row) * p.D;
    for (int d = lane; d < p.D; d += 32) dst[d] = sm.xi[r * (p.D + 1) + d];
  }
}

// Whether any row of the block is still active (block-wide; every thread must call it).  The
// barrier first: thread t reads act[t], which lane 0 of warp t % 8 may have just cleared in
// finish_step (no barrier after it in the fused kernel's step loop).
template <int RPW>
__device__ bool any_active(const Smem& sm, int rows) {
  const int t = threadIdx.x;
  __syncthreads();
  return __syncthreads_or(t < rows && t < 8 * RPW && sm.act[t] != 0) != 0;
}

// Load the block's states into sm.xi (zeros past `rows`); from `src` rows [BH, S, D] of type S_t.
template <typename S_t, int RPW>
__device__ void load_states(const Smem& sm, const S_t* src, int rows, int D) {
  for (int e = threadIdx.x; e < 8 * RPW * D; e += kThreads) {
    const int r = e / D, d = e - r * D;
    sm.xi[r * (D + 1) + d] = r < rows ? to_float(src[static_cast<int64_t>(r) * D + d]) : 0.f;
  }
}

template <typename T, int RPW>
__device__ void store_out_states(const Params<T>& p, const Smem& sm, int64_t bh, int64_t q0, int rows) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  for (int i = 0; i < RPW; ++i) {
    const int r = w + kWarps * i;
    if (r >= rows) continue;
    float* dst = p.out + (bh * p.S + q0 + r) * p.D;
    for (int d = lane; d < p.D; d += 32) dst[d] = sm.xi[r * (p.D + 1) + d];
  }
}

template <typename T, int RPW>
__global__ void __launch_bounds__(kThreads) update_fused_kernel(Params<T> p) {
  extern __shared__ float smem_raw[];
  const Smem sm = carve<RPW>(smem_raw, p.D, p.Dv, p.has_values);
  constexpr int kRows = 8 * RPW;
  const int64_t bh = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int rows = static_cast<int>(p.S - q0 < kRows ? p.S - q0 : kRows);
  load_states<T, RPW>(sm, p.state + (bh * p.S + q0) * p.D, rows, p.D);
  if (threadIdx.x < kRows) sm.act[threadIdx.x] = threadIdx.x < rows ? 1 : 0;
  __syncthreads();
  {  // states[0]
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int i = 0; i < RPW; ++i) {
      const int r = w + kWarps * i;
      if (r >= rows) continue;
      float* dst = p.states + (bh * p.S + q0 + r) * p.D;
      for (int d = lane; d < p.D; d += 32) dst[d] = sm.xi[r * (p.D + 1) + d];
    }
  }
  float m[RPW], l[RPW], acc[RPW][kCols], accx[RPW][kCols];
  for (int k = 0; k < p.R; ++k) {
    const bool value_step = p.has_values && k == p.R - 1;
    if (!value_step && !any_active<RPW>(sm, rows)) {
      skip_step<T, RPW>(p, sm, bh, q0, rows, k);
      continue;
    }
    retrieve<T, RPW>(p, sm, bh, 0, p.N, value_step, value_step && p.final_state, m, l, acc, accx);
    finish_step<T, RPW>(p, sm, bh, q0, rows, k, value_step, m, l, acc, accx);
  }
  if (!p.has_values) store_out_states<T, RPW>(p, sm, bh, q0, rows);
}

// Partials of split-N: per (b*h, chunk) m, l [kRows]; acc [kRows][W] (W = max(D, Dv)); accx
// [kRows][D] (value step with final_state).
struct Partials {
  float* m;
  float* l;
  float* acc;
  float* accx;
  int8_t* active;  // [BH, S]
  int64_t chunk;
  int splits, W;
};

// Step k of the split-N path sums p X too (accx): the value step of a call that returns the
// final state.
template <typename T>
__host__ __device__ inline bool split_partial_wants_x(const Params<T>& p, int k) {
  return p.has_values && k == p.R - 1 && p.final_state;
}

// kWantX: the step that also sums p X (the value step of a call returning the final state).
// The other steps' instantiation has no accx to keep: with it, RPW = 4 spilled 68 bytes (ptxas -v,
// sm_90a, session 24); split_partial_launch picks.
template <typename T, int RPW, bool kWantX>
__global__ void __launch_bounds__(kThreads) split_partial_kernel(Params<T> p, Partials q, int k) {
  extern __shared__ float smem_raw[];
  const Smem sm = carve<RPW>(smem_raw, p.D, p.Dv, p.has_values);
  constexpr int kRows = 8 * RPW;
  const int split = blockIdx.x;
  const int64_t bh = blockIdx.y;
  const int rows = static_cast<int>(p.S);
  const int64_t plane = p.BH * p.S;
  const bool value_step = p.has_values && k == p.R - 1;
  load_states<float, RPW>(sm, p.states + k * plane * p.D + bh * p.S * p.D, rows, p.D);
  if (threadIdx.x < kRows) sm.act[threadIdx.x] = threadIdx.x < rows ? q.active[bh * p.S + threadIdx.x] : 0;
  __syncthreads();
  if (!value_step && !any_active<RPW>(sm, rows)) return;  // the merge skips this step too
  const int64_t n0 = split * q.chunk;
  const int64_t n1 = n0 + q.chunk < p.N ? n0 + q.chunk : p.N;
  float m[RPW], l[RPW], acc[RPW][kCols], accx[RPW][kCols];
  const bool want_x = kWantX && value_step && p.final_state;
  bool one_row = false;
  if constexpr (RPW == 1) one_row = rows == 1;  // (S > 8 takes RPW > 1)
  if (one_row) {
    if constexpr (RPW == 1) retrieve_one_row<T, RPW>(p, sm, bh, n0, n1, value_step, want_x, m, l, acc, accx);
  } else {
    retrieve<T, RPW>(p, sm, bh, n0, n1, value_step, want_x, m, l, acc, accx);
  }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int Dout = value_step ? p.Dv : p.D;
  const int64_t part = bh * q.splits + split;
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = w + kWarps * i;
    const int64_t pr = part * kRows + r;
    if (lane == 0) q.m[pr] = m[i], q.l[pr] = l[i];
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int d = lane + 32 * j;
      if (d < Dout) q.acc[pr * q.W + d] = acc[i][j];
      if (want_x && d < p.D) q.accx[pr * p.D + d] = accx[i][j];
    }
  }
}

template <typename T, int RPW>
__global__ void __launch_bounds__(kThreads) split_merge_kernel(Params<T> p, Partials q, int k) {
  extern __shared__ float smem_raw[];
  const Smem sm = carve<RPW>(smem_raw, p.D, p.Dv, p.has_values);
  constexpr int kRows = 8 * RPW;
  const int64_t bh = blockIdx.x;
  const int rows = static_cast<int>(p.S);
  const int64_t plane = p.BH * p.S;
  const bool value_step = p.has_values && k == p.R - 1;
  load_states<float, RPW>(sm, p.states + k * plane * p.D + bh * p.S * p.D, rows, p.D);
  if (threadIdx.x < kRows) sm.act[threadIdx.x] = threadIdx.x < rows ? q.active[bh * p.S + threadIdx.x] : 0;
  __syncthreads();
  if (!value_step && !any_active<RPW>(sm, rows)) {
    skip_step<T, RPW>(p, sm, bh, 0, rows, k);
    // The last step skipped: out (the carried states) must still be written.
    if (!p.has_values && k == p.R - 1) store_out_states<T, RPW>(p, sm, bh, 0, rows);
    return;
  }
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int Dout = value_step ? p.Dv : p.D;
  const bool want_x = value_step && p.final_state;
  float m[RPW], l[RPW], acc[RPW][kCols], accx[RPW][kCols];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int r = w + kWarps * i;
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[i][j] = 0.f, accx[i][j] = 0.f;
    for (int c = 0; c < q.splits; ++c) {
      const int64_t pr = (bh * q.splits + c) * kRows + r;
      const float mc = q.m[pr];
      const float m_new = fmaxf(m[i], mc);
      const float a = exp2f(m[i] - m_new), wc = exp2f(mc - m_new);
      l[i] = l[i] * a + q.l[pr] * wc;
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < kCols; ++j) {
        const int d = lane + 32 * j;
        if (d < Dout) acc[i][j] = acc[i][j] * a + q.acc[pr * q.W + d] * wc;
        if (want_x && d < p.D) accx[i][j] = accx[i][j] * a + q.accx[pr * p.D + d] * wc;
      }
    }
  }
  finish_step<T, RPW>(p, sm, bh, 0, rows, k, value_step, m, l, acc, accx);
  __syncthreads();
  if (threadIdx.x < rows) q.active[bh * p.S + threadIdx.x] = static_cast<int8_t>(sm.act[threadIdx.x]);
  if (!p.has_values && k == p.R - 1) store_out_states<T, RPW>(p, sm, bh, 0, rows);
}

// Energy: per query row the online log-sum-exp over all stored rows, |xi|^2 and max_i |x_i|^2.
template <typename T, int RPW>
__global__ void __launch_bounds__(kThreads) energy_kernel(const T* state, const T* X, float* energy, float* lse,
                                                          int64_t S, int64_t N, int D, float beta) {
  extern __shared__ float smem_raw[];
  const Smem sm = carve<RPW>(smem_raw, D, D, false);
  constexpr int kRows = 8 * RPW;
  const int64_t bh = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int rows = static_cast<int>(S - q0 < kRows ? S - q0 : kRows);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const float beta2 = beta * kLog2e;
  load_states<T, RPW>(sm, state + (bh * S + q0) * D, rows, D);
  const T* Xb = X + bh * N * D;
  float m[RPW], l[RPW];
  for (int i = 0; i < RPW; ++i) m[i] = -INFINITY, l[i] = 0.f;
  float max_sq = 0.f;  // lane-wise over the rows it has seen, reduced at the end
  for (int64_t t0 = 0; t0 < N; t0 += kBN) {
    const int cnt = static_cast<int>(N - t0 < kBN ? N - t0 : kBN);
    __syncthreads();
    load_tile(sm.xt, Xb, t0, cnt, D);
    __syncthreads();
    const float* x = sm.xt + lane * (D + 1);
    float sq = 0.f;
    for (int d = 0; d < D; ++d) sq = fmaf(x[d], x[d], sq);
    max_sq = fmaxf(max_sq, sq);  // rows past cnt are zeros
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const float* qr = sm.xi + (w + kWarps * i) * (D + 1);
      float s = 0.f;
      for (int d = 0; d < D; ++d) s = fmaf(qr[d], x[d], s);
      s = lane < cnt ? s * beta2 : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max(s));
      l[i] = l[i] * exp2f(m[i] - m_new) + warp_sum(exp2f(s - m_new));
      m[i] = m_new;
    }
  }
  max_sq = warp_max(max_sq);
  const float log_n = logf(static_cast<float>(N));
  for (int i = 0; i < RPW; ++i) {
    const int r = w + kWarps * i;
    if (r >= rows) continue;
    const float* qr = sm.xi + r * (D + 1);
    float sq = 0.f;
    for (int d = lane; d < D; d += 32) sq = fmaf(qr[d], qr[d], sq);
    sq = warp_sum(sq);
    if (lane == 0) {
      // -(lse - log N) / beta with lse = top + log(l): the large terms never meet (see the Triton kernel).
      const float top = m[i] * kLn2;
      const int64_t row = bh * S + q0 + r;
      lse[row] = top + logf(l[i]);
      energy[row] = -(top + (logf(l[i]) - log_n)) / beta + 0.5f * sq + 0.5f * max_sq;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

// The kernels agree with the limits the checks use (csrc/cuda/launch.h).
static_assert(kMaxD == cuda_limits::kHopfieldMaxD, "csrc/cuda/launch.h: kHopfieldMaxD");

// Calls f(T{}) with the element type of `st` (float16, bfloat16, float32: checked).
template <typename F>
void dispatch(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kFloat: f(float{}); break;
    default: ATTNKIT_CHECK(false, "attnkit::hopfield (cuda): unchecked dtype");  // checks::hopfield_*: cannot happen
  }
}

// Calls f(std::integral_constant<int, RPW>) for the rows per warp that S needs (1, 2 or 4).
template <typename F>
void dispatch_rpw(int64_t S, F&& f) {
  if (S <= 8) {
    f(std::integral_constant<int, 1>{});
  } else if (S <= 16) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 4>{});
  }
}

}  // namespace

// Entry points (csrc/cuda/launch.h: checked inputs; launch errors are left to the caller).

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hopfield_update_fwd_cuda(
    const at::Tensor& state, const at::Tensor& stored, const std::optional<at::Tensor>& values_opt, double beta,
    int64_t steps, std::optional<double> tol, bool final_state) {
  const bool has_values = values_opt.has_value() && values_opt->defined();
  const int64_t B = state.size(0), H = state.size(1), S = state.size(2), D = state.size(3), N = stored.size(2);
  const int64_t Dv = has_values ? values_opt->size(3) : D;
  const int64_t R = steps, U = has_values ? steps - 1 : steps;
  c10::cuda::CUDAGuard guard(state.device());
  const auto opts = state.options().dtype(at::kFloat);
  auto out = at::empty({B, H, S, Dv}, opts);
  auto states = at::empty({steps + 1, B, H, S, D}, opts);
  auto lse = at::empty({R, B, H, S}, opts);
  auto applied = at::empty({U, B, H, S}, state.options().dtype(at::kBool));
  if (has_values && !final_state) states.select(0, steps).zero_();
  const int64_t BH = B * H;
  if (S == 0 || BH == 0) return {out, states, lse, applied};
  const at::Tensor st = state.contiguous();
  const at::Tensor x = stored.contiguous();
  const at::Tensor v = has_values ? values_opt->contiguous() : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int sms = 0;
  // Unchecked (nothing here throws): should it fail, sms stays 0 and the fused kernel runs.
  (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, state.device().index());
  const bool split = S <= kSplitMaxS && N >= kSplitMinN && BH < sms;
  dispatch(st.scalar_type(), [&](auto t) {
    using T = decltype(t);
    Params<T> p;
    p.state = static_cast<const T*>(st.data_ptr());
    p.X = static_cast<const T*>(x.data_ptr());
    p.V = has_values ? static_cast<const T*>(v.data_ptr()) : nullptr;
    p.out = out.data_ptr<float>();
    p.states = states.data_ptr<float>();
    p.lse = lse.data_ptr<float>();
    p.applied = applied.data_ptr<bool>();
    p.BH = BH, p.S = S, p.N = N;
    p.D = static_cast<int>(D), p.Dv = static_cast<int>(Dv), p.R = static_cast<int>(R), p.U = static_cast<int>(U);
    p.beta2 = static_cast<float>(beta) * kLog2e;
    p.has_tol = tol.has_value();
    p.tol = p.has_tol ? static_cast<float>(*tol) : 0.f;
    p.has_values = has_values;
    p.final_state = has_values && final_state;
    dispatch_rpw(S, [&](auto rpw_c) {
      constexpr int RPW = decltype(rpw_c)::value;
      constexpr int kRows = 8 * RPW;
      const size_t smem = smem_bytes<RPW>(p.D, p.Dv, has_values);
      if (!split) {
        allow_smem(update_fused_kernel<T, RPW>, smem);
        const dim3 grid(static_cast<unsigned>(ceil_div(S, kRows)), static_cast<unsigned>(BH));
        update_fused_kernel<T, RPW><<<grid, kThreads, smem, stream>>>(p);
        return;
      }
      // Split-N: about 4 blocks per SM over all b*h, chunks of whole tiles, >= 8 tiles each.
      states.select(0, 0).copy_(state);
      const int64_t target = std::max<int64_t>(1, (4 * sms) / BH);
      const int64_t chunk = std::max<int64_t>(8 * kBN, ceil_div(ceil_div(N, target), kBN) * kBN);
      Partials q;
      q.chunk = chunk;
      q.splits = static_cast<int>(ceil_div(N, chunk));
      q.W = static_cast<int>(std::max(D, Dv));
      const auto fopts = state.options().dtype(at::kFloat);
      at::Tensor pm = at::empty({BH, q.splits, kRows}, fopts);
      at::Tensor pl = at::empty({BH, q.splits, kRows}, fopts);
      at::Tensor pacc = at::empty({BH, q.splits, kRows, q.W}, fopts);
      at::Tensor paccx = at::empty({p.final_state ? BH * q.splits * kRows * D : 1}, fopts);
      at::Tensor active = at::empty({BH, S}, state.options().dtype(at::kChar));
      active.fill_(1);
      q.m = pm.data_ptr<float>(), q.l = pl.data_ptr<float>(), q.acc = pacc.data_ptr<float>();
      q.accx = paccx.data_ptr<float>();
      q.active = active.data_ptr<int8_t>();
      allow_smem(split_partial_kernel<T, RPW, false>, smem);
      allow_smem(split_partial_kernel<T, RPW, true>, smem);
      allow_smem(split_merge_kernel<T, RPW>, smem);
      const dim3 pgrid(static_cast<unsigned>(q.splits), static_cast<unsigned>(BH));
      for (int k = 0; k < static_cast<int>(R); ++k) {
        if (split_partial_wants_x(p, k)) {
          split_partial_kernel<T, RPW, true><<<pgrid, kThreads, smem, stream>>>(p, q, k);
        } else {
          split_partial_kernel<T, RPW, false><<<pgrid, kThreads, smem, stream>>>(p, q, k);
        }
        split_merge_kernel<T, RPW><<<static_cast<unsigned>(BH), kThreads, smem, stream>>>(p, q, k);
      }
    });
  });
  return {out, states, lse, applied};
}

std::tuple<at::Tensor, at::Tensor> hopfield_energy_fwd_cuda(const at::Tensor& state, const at::Tensor& stored,
                                                            double beta) {
  const int64_t B = state.size(0), H = state.size(1), S = state.size(2), D = state.size(3), N = stored.size(2);
  c10::cuda::CUDAGuard guard(state.device());
  auto energy = at::empty({B, H, S}, state.options().dtype(at::kFloat));
  auto lse = at::empty({B, H, S}, state.options().dtype(at::kFloat));
  if (S == 0 || B * H == 0) return {energy, lse};
  const at::Tensor st = state.contiguous();
  const at::Tensor x = stored.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch(st.scalar_type(), [&](auto t) {
    using T = decltype(t);
    dispatch_rpw(S, [&](auto rpw_c) {
      constexpr int RPW = decltype(rpw_c)::value;
      const size_t smem = smem_bytes<RPW>(static_cast<int>(D), static_cast<int>(D), false);
      allow_smem(energy_kernel<T, RPW>, smem);
      const dim3 grid(static_cast<unsigned>(ceil_div(S, 8 * RPW)), static_cast<unsigned>(B * H));
      energy_kernel<T, RPW><<<grid, kThreads, smem, stream>>>(
          static_cast<const T*>(st.data_ptr()), static_cast<const T*>(x.data_ptr()), energy.data_ptr<float>(),
          lse.data_ptr<float>(), S, N, static_cast<int>(D), static_cast<float>(beta));
    });
  });
  return {energy, lse};
}

}  // namespace attnkit

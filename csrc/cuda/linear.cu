// CUDA C++ kernels of linear (kernelized) attention, chunked, forward and backward, for
// attnkit::linear_fwd and attnkit::linear_bwd (schemas and their exact semantics in csrc/ops.cpp;
// the CPU kernels are csrc/cpu/linear.cpp): the entry points linear_fwd_cuda / linear_bwd_cuda
// (csrc/cuda/launch.h), which csrc/checks/linear.cpp registers for the CUDA dispatch key after
// running the ops' input checks (nothing here throws on bad input: issue 10).
//
// STATUS.  Checked: compiles with nvcc -c for sm_80 and sm_90a against torch's headers
// (.ci/compile_cuda.sh).  The device code (this file up to "host side") runs on the CPU under
// the host emulator of tests/csrc/cuda_emulator (linear_harness.cpp: every thread a fiber,
// ldmatrix / mma.m16n8k16 rebuilt from the PTX ISA, NaN-filled shared memory) in
// tests/csrc/test_linear_cuda_emulated.py, against the float64 reference (float16, bfloat16).
// On a GPU: tests/csrc/test_linear_cuda.py (`pytest -m gpu`) passed in full on an H100 (sm_90,
// torch 2.11 + CUDA 13.0, commit 4a5f870, bench/RESULTS.md "session 8").
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
// padded with zeros) in blocks of 256 threads (8 warps).  Two kinds of product:
//  - chunk products (both operands rows of q, k, v, grad_out or a masked chunk-by-chunk matrix
//    built from them: phi(Q_c) phi(K_c)^T, P V_c, phi(K_c)^T V_c, g V_c^T, ...).  float16 /
//    bfloat16 inputs: on tensor cores, mma.sync.m16n8k16 with 16-bit operands (the feature maps
//    and masked matrices rounded to the input dtype, as a float16 computation would) and fp32
//    accumulation; operand tiles in the input dtype, read with ldmatrix (rows padded to 72
//    elements: 16-byte aligned, conflict-free).  Warp w owns rows 16 (w % 4) .. +15 and columns
//    32 (w / 4) .. +31 of a product as four m16n8 accumulator fragments (MmaLayout).
//    float32 / float64 inputs: FMA in A on CUDA cores, thread (ty, tx) = (tid / 16, tid % 16)
//    owning entries (ty + 16 i, tx + 16 j) (SimtLayout); tiles in A, leading dimension 65.
//  - state products (one operand a chunk state S / R, D x Dv, or z / w): the states are kept in
//    A, so a state that grows like N never leaves float16's range.  bfloat16 inputs: the state
//    tile split in two bfloat16 tiles (hi + lo, 16 bits) and the product on the tensor cores as
//    two (load_state_operand, mm_state); otherwise FMA in A.  The z / w vector products: FMA.
//  Per-row factors that vary a lot (r_i ~ 1 / N) are applied to the fp32 accumulators after a
//  product when they belong to its output rows; inside the product's k dimension (dk, dv,
//  dS0) they are divided by a power of two >= max |factor| of the chunk first, so the 16-bit
//  operand stays in [-1, 1] (no float16 underflow), and that power of two multiplies the result.
//  - state_fwd: one block per (D-block, Dv-block, h, b) walks the key chunks in order with the
//    state tile in registers; causal: stores the state before each chunk (Hs [B,H,NT,D,Dv],
//    Zs [B,H,NT,D]: N/64 states, never N); always stores S_final, z_final.  Only B H D/64 Dv/64
//    blocks (8 for B=1 H=8 D=Dv=64), so a chunk's step is latency: the next chunk's K / V
//    tiles are fetched into registers while this chunk's product runs (fetch_tile /
//    stage_tile), and z's column sums are split over all 256 threads (column_parts).  state_bwd
//    the same, backwards.
//  - output: one block per (query chunk, Dv-block, h, b): phi(Q_c) Hs[c] (+ causal: the masked
//    intra-chunk (phi(Q_c) phi(K_c)^T o tril) V_c); non-causal reads S_final for every chunk.
//  - backward: delta_i = g_i . out_i; the forward chunk states recomputed by state_fwd
//    (non-causal: the forward's S, z are the totals); state_bwd walks the query chunks backwards
//    (reverse states R_c = grad_S + sum over later chunks of r_i phi(q_i) g_i^T, w_c likewise);
//    dq (per query chunk, D-block), dk (per key chunk, D-block), dv (per key chunk, Dv-block),
//    each an inter-chunk state product plus masked intra-chunk products.  No atomics:
//    deterministic.

#include "host_utils.cuh"  // first: torch headers and host helpers

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "mma_sm80.cuh"

namespace attnkit {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kC = 64;         // rows per chunk
constexpr int kT = 64;         // D / Dv block width
constexpr int kLd = kT + 1;    // leading dimension of A tiles (odd: conflict-free column walks)
constexpr int kLd16 = kT + 8;  // of 16-bit tiles: 144-byte rows, 16-byte aligned for ldmatrix
// A tile slot: a 64 x kLd tile of A's, or a 16-bit tile (64 x kLd16), or two of them (a
// bfloat16 state split in hi and lo: load_state_operand).  In A's.
template <typename A>
constexpr int kTileOf = kC * kLd > 2 * kC * kLd16 * 2 / static_cast<int>(sizeof(A))
                            ? kC * kLd
                            : 2 * kC * kLd16 * 2 / static_cast<int>(sizeof(A));
constexpr int kTiles = 3;  // tile slots per block (the most any kernel uses), kTileOf<A> A's each
constexpr int kVecs = 4;   // 64-vectors of A per block (den, r, c, z, ...)

enum FeatureMap : int { kElu = 0, kRelu = 1, kIdentity = 2 };

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Rows of chunk t that exist (0 .. 64): min(64, L - 64 t).
__device__ __forceinline__ int chunk_rows(int L, int64_t row0) {
  const int64_t left = static_cast<int64_t>(L) - row0;
  return left < kC ? static_cast<int>(left) : kC;
}

template <typename T>
constexpr bool kIs16 = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

// Leading dimension of a tile of E's: 16-bit operand tiles or A tiles.
template <typename E>
constexpr int kLdOf = sizeof(E) == 2 ? kLd16 : kLd;

// ---------------------------------------------------------------------------------------------
// element helpers
// ---------------------------------------------------------------------------------------------

template <typename A>
__device__ __forceinline__ A exp_acc(A x) {
  if constexpr (std::is_same_v<A, double>) {
    return exp(x);
  } else {
    return expf(x);
  }
}

// phi(x): elu(x) + 1 = x + 1 (x > 0) or exp(x); relu; identity.  NaN stays NaN (torch.relu(NaN)
// is NaN; `x > 0 ? x : 0` turned it into 0 -- issue 15, found by tests/fuzz on an H100).
template <typename A>
__device__ __forceinline__ A phi(A x, int fm) {
  if (fm == kElu) return x > A(0) ? x + A(1) : exp_acc(x);
  if (fm == kRelu) return x <= A(0) ? A(0) : x;
  return x;
}

// grad · phi'(x) as torch's autograd has it: relu'(0) = 0, elu'(0) = 1, at NaN both pass the
// gradient on unchanged, and relu's zero is a select, not a product (threshold_backward: a NaN
// gradient of an entry with x <= 0 still gives 0, where 0 · NaN would be NaN).
template <typename A>
__device__ __forceinline__ A times_dphi(A grad, A x, int fm) {
  if (fm == kElu) return x <= A(0) ? grad * exp_acc(x) : grad;
  if (fm == kRelu) return x <= A(0) ? A(0) : grad;
  return grad;
}

// Conversions between an element type T and the accumulation type A.  16-bit values go through
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

// The smallest power of two >= m (1 for m = 0 or not finite): dividing by it is exact.
template <typename A>
__device__ __forceinline__ A pow2_above(A m) {
  if (!(m > A(0) && m < A(INFINITY))) return A(1);
  int e = 0;
  if constexpr (std::is_same_v<A, double>) {
    frexp(m, &e);
    return ldexp(1.0, e);
  } else {
    frexpf(m, &e);
    return ldexpf(1.f, e);
  }
}

// pow2_above(max_i |v[i]|) over a 64-vector in shared memory (every thread reads all of it).
template <typename A>
__device__ __forceinline__ A absmax_pow2(const A* v) {
  A m = A(0);
  for (int i = 0; i < kC; ++i) m = fmax(m, fabs(v[i]));
  return pow2_above(m);
}

// ---------------------------------------------------------------------------------------------
// tensor-core primitives: mma16816, ldsm_x4, ldsm_x4_trans and their fragment layouts are in
// mma_sm80.cuh
// ---------------------------------------------------------------------------------------------

// One ldmatrix.x4 of four 8x8 matrices at (row0 + 8 (m % 2 or m / 2), col0 + 8 (...)) of a
// 16-bit tile (leading dimension kLd16): lane l gives row l % 8 of matrix l / 8.  kRowsFirst:
// matrix m sits at rows + 8 (m % 2), columns + 8 (m / 2); else rows + 8 (m / 2), columns + 8 (m % 2).
template <bool kTrans, bool kRowsFirst>
__device__ __forceinline__ void ldsm_tile(uint32_t (&r)[4], const uint16_t* tile, int row0, int col0, int lane) {
  const int m = lane / 8;
  const int row = row0 + lane % 8 + 8 * (kRowsFirst ? m % 2 : m / 2);
  const int col = col0 + 8 * (kRowsFirst ? m / 2 : m % 2);
  if constexpr (kTrans) {
    ldsm_x4_trans(r, tile + row * kLd16 + col);
  } else {
    ldsm_x4(r, tile + row * kLd16 + col);
  }
}

// ---------------------------------------------------------------------------------------------
// who owns which entries of a 64 x 64 product
// ---------------------------------------------------------------------------------------------

// float32 / float64: thread (ty, tx) = (tid / 16, tid % 16) owns (ty + 16 i, tx + 16 j).
struct SimtLayout {
  static constexpr int kR = 4, kK = 4;
  __device__ static int row(int i) { return static_cast<int>(threadIdx.x) / 16 + 16 * i; }
  __device__ static int col(int j) { return static_cast<int>(threadIdx.x) % 16 + 16 * j; }
};

// float16 / bfloat16: warp w owns rows 16 (w % 4) .. +15, columns 32 (w / 4) .. +31 as four
// m16n8 C fragments; fragment n of lane (g, t) is entries [0][2n], [0][2n+1], [1][2n], [1][2n+1].
struct MmaLayout {
  static constexpr int kR = 2, kK = 8;
  __device__ static int row(int i) {
    const int tid = static_cast<int>(threadIdx.x);
    return 16 * ((tid / 32) % 4) + (tid % 32) / 4 + 8 * i;
  }
  __device__ static int col(int j) {
    const int tid = static_cast<int>(threadIdx.x);
    return 32 * (tid / 128) + 8 * (j / 2) + 2 * (tid % 4) + j % 2;
  }
};

// This thread's entries of a 64 x 64 product.
template <class L, typename A>
struct Acc {
  A v[L::kR][L::kK];
};

// f(i, j, row, col) for each entry this thread owns.
template <class L, typename F>
__device__ __forceinline__ void each(F&& f) {
#pragma unroll
  for (int i = 0; i < L::kR; ++i)
#pragma unroll
    for (int j = 0; j < L::kK; ++j) f(i, j, L::row(i), L::col(j));
}

template <class L, typename A>
__device__ __forceinline__ Acc<L, A> zeros() {
  Acc<L, A> a;
  each<L>([&](int i, int j, int, int) { a.v[i][j] = A(0); });
  return a;
}

// acc += f * x entrywise.
template <class L, typename A>
__device__ __forceinline__ void add_scaled(Acc<L, A>& acc, A f, const Acc<L, A>& x) {
  each<L>([&](int i, int j, int, int) { acc.v[i][j] += f * x.v[i][j]; });
}

// acc = src[r * ld + c] (0 outside rows x cols, or for src == nullptr)
template <class L, typename A>
__device__ __forceinline__ void load_acc(Acc<L, A>& acc, const A* src, int64_t ld, int rows, int cols) {
  each<L>([&](int i, int j, int r, int c) {
    acc.v[i][j] = (src != nullptr && r < rows && c < cols) ? src[r * ld + c] : A(0);
  });
}

// dst[r * ld + c] = acc (r < rows, c < cols)
template <class L, typename A>
__device__ __forceinline__ void store_acc(A* dst, int64_t ld, int rows, int cols, const Acc<L, A>& acc) {
  each<L>([&](int i, int j, int r, int c) {
    if (r < rows && c < cols) dst[r * ld + c] = acc.v[i][j];
  });
}

// ---------------------------------------------------------------------------------------------
// tiles and products
// ---------------------------------------------------------------------------------------------

// A tile load in two halves: fetch_tile issues the loads of the thread's 16 elements of a 64 x 64
// tile into registers, stage_tile converts them and stores them to shared memory.  In one loop
// each load waited for the previous element's store (dst is a generic pointer: it might alias
// src), so a tile cost 16 memory latencies in a row -- what the one-block-per-head state walks
// (state_fwd, state_bwd) paid per chunk and per tile: ~17 us a chunk on an H200, session 15
// (N = 1024 / 4096 / 16384: 0.286 / 1.102 / 4.354 ms, linear in the 64-row chunks).  The walks
// also fetch chunk t + 1 while chunk t's products run.
template <typename T>
struct TileRegs {
  static constexpr int kPer = kC * kT / kThreads;  // element u: row (tid + 256 u) / 64, column tid % 64
  T v[kPer];
  bool valid;  // src != nullptr: else a zero tile
  int rows, cols;
};

// regs = src[r * sr + c * sc] for r < rows, c < cols (src == nullptr: a zero tile).
template <typename T>
__device__ __forceinline__ void fetch_tile(TileRegs<T>& regs, const T* src, int64_t sr, int64_t sc, int rows,
                                           int cols) {
  regs.valid = src != nullptr, regs.rows = rows, regs.cols = cols;
#pragma unroll
  for (int u = 0; u < TileRegs<T>::kPer; ++u) {
    const int idx = static_cast<int>(threadIdx.x) + u * kThreads;
    const int r = idx / kT, c = idx % kT;
    if (src != nullptr && r < rows && c < cols) regs.v[u] = src[r * sr + c * sc];
  }
}

// One element of a staged tile, in A: 0 outside the data (`in` false), else phi(raw) when fm >= 0,
// times row_scale[r] * mul when row_scale is given.
template <typename A, typename T>
__device__ __forceinline__ A tile_value(const T& raw, bool in, int r, int fm, const A* row_scale, A mul) {
  if (!in) return A(0);
  A x = to_acc<A>(raw);
  if (fm >= 0) x = phi(x, fm);
  if (row_scale != nullptr) x *= row_scale[r] * mul;
  return x;
}

// dst[r][c] (tile of E's) = the fetched element for r < rows, c < cols, else 0; computed in A:
// phi applied when fm >= 0 (padding stays 0: phi(0) = 1 for elu would count it), each row times
// row_scale[r] * mul when row_scale is given.
template <typename A, typename E, typename T>
__device__ __forceinline__ void stage_tile(E* dst, const TileRegs<T>& regs, int fm = -1,
                                           const A* row_scale = nullptr, A mul = A(1)) {
#pragma unroll
  for (int u = 0; u < TileRegs<T>::kPer; ++u) {
    const int idx = static_cast<int>(threadIdx.x) + u * kThreads;
    const int r = idx / kT, c = idx % kT;
    const bool in = regs.valid && r < regs.rows && c < regs.cols;
    dst[r * kLdOf<E> + c] = from_acc<E>(tile_value(regs.v[u], in, r, fm, row_scale, mul));
  }
}

// Both halves at once: dst[r][c] = src[r * sr + c * sc] (rows x cols, zero padded), as stage_tile.
// (Written out rather than as fetch_tile + stage_tile: through TileRegs the float64 dq / dk / dv
// kernels spilled 8-84 bytes, ptxas -v sm_90a; this way none does.)
// finite_dst (optional): a second copy with the infinities zeroed (finite_half: what mm_state
// multiplies by a split state's lo).
template <typename A, typename E, typename T>
__device__ __forceinline__ void load_tile(E* dst, const T* src, int64_t sr, int64_t sc, int rows, int cols,
                                          int fm = -1, const A* row_scale = nullptr, A mul = A(1),
                                          E* finite_dst = nullptr) {
  constexpr int kPer = TileRegs<T>::kPer;
  T raw[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int idx = static_cast<int>(threadIdx.x) + u * kThreads;
    const int r = idx / kT, c = idx % kT;
    if (src != nullptr && r < rows && c < cols) raw[u] = src[r * sr + c * sc];
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int idx = static_cast<int>(threadIdx.x) + u * kThreads;
    const int r = idx / kT, c = idx % kT;
    const E e = from_acc<E>(tile_value(raw[u], src != nullptr && r < rows && c < cols, r, fm, row_scale, mul));
    dst[r * kLdOf<E> + c] = e;
    if (finite_dst != nullptr) finite_dst[r * kLdOf<E> + c] = isinf(to_acc<A>(e)) ? from_acc<E>(A(0)) : e;
  }
}

// The column sums of a 64 x 64 tile, weighted by w[r] (w == nullptr: 1), split over the 256
// threads: thread (part, col) = (tid / 64, tid % 64) sums rows 16 part .. 16 part + 15 of
// column col into sums[64 part + col] (a 256-entry vector in shared memory: the four 64-vectors
// of Smem); column_sum(sums, col) adds the four parts once the block has synchronized.  The
// state walks' z and w sums ran as one chain of 64 shared-memory loads in each of 64 threads
// while the other 192 waited.
template <typename A, typename E>
__device__ __forceinline__ void column_parts(A* sums, const E* tile, const A* w = nullptr) {
  constexpr int kRowsPer = kC * kT / kThreads;
  const int col = static_cast<int>(threadIdx.x) % kT, part = static_cast<int>(threadIdx.x) / kT;
  A acc = A(0);
#pragma unroll
  for (int i = 0; i < kRowsPer; ++i) {
    const int r = part * kRowsPer + i;
    const A x = to_acc<A>(tile[r * kLdOf<E> + col]);
    acc += w != nullptr ? w[r] * x : x;
  }
  sums[part * kT + col] = acc;
}
template <typename A>
__device__ __forceinline__ A column_sum(const A* sums, int col) {
  return (sums[col] + sums[kT + col]) + (sums[2 * kT + col] + sums[3 * kT + col]);
}

// A masked 64 x 64 matrix staged as a tile: dst[r][c] = keep ? x * col_scale[c] * mul : 0,
// x = this thread's product entry (or 1 for acc == nullptr), keep = c <= r (kLower: query rows x
// key columns) or c >= r (key rows x query columns).  Rows / columns past the data need no
// care: the operand they meet is zero there.
template <bool kLower, class L, typename A, typename E>
__device__ __forceinline__ void stage_masked(E* dst, const Acc<L, A>* acc, const A* col_scale = nullptr,
                                             A mul = A(1)) {
  each<L>([&](int i, int j, int r, int c) {
    A x = acc != nullptr ? acc->v[i][j] : A(1);
    if (col_scale != nullptr) x *= col_scale[c] * mul;
    const bool keep = kLower ? c <= r : c >= r;
    dst[r * kLdOf<E> + c] = from_acc<E>(keep ? x : A(0));
  });
}

// acc += A B over k < 64, where A(row, k) = a[row][k] (or a[k][row] with kTransA) and
// B(k, col) = b[k][col] (or b[col][k] with kTransB).  Two 16-bit tiles: mma.m16n8k16 (MmaLayout);
// otherwise FMA in A, any layout (a state tile of A's against an operand tile of either type).
template <bool kTransA, bool kTransB, class L, typename A, typename EA, typename EB>
__device__ __forceinline__ void mm(Acc<L, A>& acc, const EA* a, const EB* b) {
  if constexpr (sizeof(EA) == 2 && sizeof(EB) == 2) {
    static_assert(std::is_same_v<L, MmaLayout> && std::is_same_v<A, float> && std::is_same_v<EA, EB>);
    constexpr bool kBF16 = std::is_same_v<EA, c10::BFloat16>;
    const auto* at = reinterpret_cast<const uint16_t*>(a);
    const auto* bt = reinterpret_cast<const uint16_t*>(b);
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int r0 = MmaLayout::row(0) - lane / 4, n0 = MmaLayout::col(0) - 2 * (lane % 4);
#pragma unroll
    for (int k0 = 0; k0 < kT; k0 += 16) {
      uint32_t af[4], bf[4];
      // A stored [m][k]: matrices (m, k), (m+8, k), (m, k+8), (m+8, k+8); stored [k][m]: the
      // same four read transposed from (k, m), (k, m+8), (k+8, m), (k+8, m+8).
      if constexpr (kTransA) {
        ldsm_tile<true, false>(af, at, k0, r0, lane);
      } else {
        ldsm_tile<false, true>(af, at, r0, k0, lane);
      }
#pragma unroll
      for (int nt = 0; nt < 4; nt += 2) {
        // B fragments of n-tiles nt, nt + 1: bf[0..1] and bf[2..3].  Stored [n][k]: matrices
        // (n, k), (n, k+8), (n+8, k), (n+8, k+8); stored [k][n]: (k, n), (k+8, n), (k, n+8), (k+8, n+8)
        // read transposed.
        if constexpr (kTransB) {
          ldsm_tile<false, false>(bf, bt, n0 + 8 * nt, k0, lane);
        } else {
          ldsm_tile<true, true>(bf, bt, k0, n0 + 8 * nt, lane);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int n = nt + h;
          float c[4] = {acc.v[0][2 * n], acc.v[0][2 * n + 1], acc.v[1][2 * n], acc.v[1][2 * n + 1]};
          const uint32_t b2[2] = {bf[2 * h], bf[2 * h + 1]};
          mma16816<kBF16>(c, af, b2);
          acc.v[0][2 * n] = c[0], acc.v[0][2 * n + 1] = c[1], acc.v[1][2 * n] = c[2], acc.v[1][2 * n + 1] = c[3];
        }
      }
    }
  } else {
    constexpr int la = kLdOf<EA>, lb = kLdOf<EB>;
#pragma unroll 4
    for (int kk = 0; kk < kT; ++kk) {
      A av[L::kR], bv[L::kK];
#pragma unroll
      for (int i = 0; i < L::kR; ++i) {
        const int r = L::row(i);
        av[i] = to_acc<A>(kTransA ? a[kk * la + r] : a[r * la + kk]);
      }
#pragma unroll
      for (int j = 0; j < L::kK; ++j) {
        const int c = L::col(j);
        bv[j] = to_acc<A>(kTransB ? b[c * lb + kk] : b[kk * lb + c]);
      }
#pragma unroll
      for (int i = 0; i < L::kR; ++i)
#pragma unroll
        for (int j = 0; j < L::kK; ++j) acc.v[i][j] += av[i] * bv[j];
    }
  }
}

// The state operand of a chunk kernel's product (a tile of a float32 state S or R: the products
// phi(Q) S, g S^T, V R^T, phi(K) R), staged in a tile slot `st`:
//  - bfloat16 inputs: split in two bfloat16 tiles, hi = bf16(s) and lo = bf16(s - hi) (16
//    significant bits, float32's range; a non-finite hi: lo = 0), so that mm_state runs
//    the product on the tensor cores as two, the operand tile times hi plus times lo, each
//    product exact in float32.  On CUDA cores (FMA in float32, before session 24) each was
//    64 x 64 x 64 FMAs with 10 shared-memory loads per 16 FMAs;
//  - float16 inputs: a tile of A's, the product on CUDA cores (float16's range cannot hold a
//    state that grows like N, and two of its 11-bit halves would not reach float32's accuracy:
//    the Triton kernels use 3xTF32 there);
//  - float32 / float64 inputs: A tiles throughout.
template <typename T, typename A>
__device__ __forceinline__ void load_state_operand(A* st, const A* src, int64_t ld, int rows, int cols) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    static_assert(2 * kC * kLd16 * sizeof(T) <= kTileOf<A> * sizeof(A), "tile slot too small for hi and lo");
    uint16_t* hi = reinterpret_cast<uint16_t*>(st);
    uint16_t* lo = hi + kC * kLd16;
    constexpr int kPer = kC * kT / kThreads;
    A raw[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int idx = static_cast<int>(threadIdx.x) + u * kThreads;
      const int r = idx / kT, c = idx % kT;
      raw[u] = r < rows && c < cols ? src[r * ld + c] : A(0);
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int idx = static_cast<int>(threadIdx.x) + u * kThreads;
      const int r = idx / kT, c = idx % kT;
      const float x = static_cast<float>(raw[u]);
      const __nv_bfloat16 h = __float2bfloat16_rn(x);
      const float hf = __bfloat162float(h);
      const float rest = isfinite(hf) ? x - hf : 0.f;  // hf = inf: x was inf or rounded to it
      hi[r * kLd16 + c] = __bfloat16_as_ushort(h);
      lo[r * kLd16 + c] = __bfloat16_as_ushort(__float2bfloat16_rn(rest));
    }
  } else {
    load_tile<A>(st, src, ld, int64_t{1}, rows, cols);
  }
}

// Where a bfloat16 operand tile of a state product keeps its copy without infinities: the
// second half of its slot (a 16-bit tile fills half of a float32 slot); nullptr otherwise.
template <typename T, typename E>
__device__ __forceinline__ E* finite_half(E* tile) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return tile + kC * kLd16;
  } else {
    return nullptr;
  }
}

// acc += a S (kTransB: a S^T), the state operand st as load_state_operand<T> staged it.  In
// bfloat16, a x hi + a_finite x lo with a_finite = a without its infinities (load_tile's
// finite_dst): an inf in a meets hi alone, so a row of a with an inf gets inf x s as the FMA and
// the float64 reference give it (inf x lo would add NaN wherever lo is 0 or of the other sign).
template <typename T, bool kTransB, class L, typename A, typename E>
__device__ __forceinline__ void mm_state(Acc<L, A>& acc, const E* a, const A* st) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const T* hi = reinterpret_cast<const T*>(st);
    mm<false, kTransB>(acc, a, hi);
    mm<false, kTransB>(acc, finite_half<T>(a), hi + kC * kLd16);
  } else {
    mm<false, kTransB>(acc, a, st);
  }
}

// The dynamic shared memory of a block: kTiles slots of kTileOf<A> A's (a 16-bit tile, 64 x kLd16,
// fits in one), then kVecs vectors of 64 A's.
template <typename A>
struct Smem {
  unsigned char* base;
  template <typename E>
  __device__ E* tile(int slot) const {
    static_assert(kC * kLdOf<E> * sizeof(E) <= kTileOf<A> * sizeof(A), "tile slot too small");
    return reinterpret_cast<E*>(base + static_cast<size_t>(slot) * kTileOf<A> * sizeof(A));
  }
  __device__ A* vec(int i) const { return reinterpret_cast<A*>(base + kTiles * kTileOf<A> * sizeof(A)) + i * kT; }
};

template <typename A>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(kTiles * kTileOf<A> + kVecs * kT) * sizeof(A);
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
  using L = std::conditional_t<kIs16<T>, MmaLayout, SimtLayout>;  // who owns a product's entries
  using E = std::conditional_t<kIs16<T>, T, A>;                   // operand tiles
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

// Launch grids (host side and the emulator's harness): one block per (block of 64 columns of a
// [rows, width] state, h, b), or per (chunk, block of 64 of width, h, b).
__host__ __forceinline__ dim3 state_grid(int64_t rows, int64_t width, int64_t H, int64_t B) {
  return dim3{static_cast<unsigned>(ceil_div(rows, kT) * ceil_div(width, kT)), static_cast<unsigned>(H),
              static_cast<unsigned>(B)};
}
__host__ __forceinline__ dim3 chunk_grid(int64_t L, int64_t width, int64_t H, int64_t B) {
  return dim3{static_cast<unsigned>(ceil_div(L, kC) * ceil_div(width, kT)), static_cast<unsigned>(H),
              static_cast<unsigned>(B)};
}

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

// out[r * ld + c] = f(entry, r, c) converted to T, for r < rows, c < cols.
template <class L, typename T, typename A, typename F>
__device__ __forceinline__ void store_rows(T* out, int64_t ld, int rows, int cols, const Acc<L, A>& acc, F&& f) {
  each<L>([&](int i, int j, int r, int c) {
    if (r < rows && c < cols) out[r * ld + c] = from_acc<T>(f(acc.v[i][j], r, c));
  });
}

// Where a state kernel's block works: rows d0 .. d0 + dn - 1, columns e0 .. e0 + en - 1 of a
// [D, Dv] state of head h of batch b (grid state_grid(D, Dv)).
struct StateBlock {
  int d0, dn, e0, en, h, b;
  int64_t bh;
  bool z_owner;  // this thread holds z[d0 + tid] (threads < dn of the e0 == 0 blocks)
};
template <typename T, typename A>
__device__ __forceinline__ StateBlock state_block(const Problem<T, A>& p) {
  const int nv = static_cast<int>(ceil_div(p.Dv, kT));
  StateBlock k;
  k.d0 = static_cast<int>(blockIdx.x) / nv * kT, k.e0 = static_cast<int>(blockIdx.x) % nv * kT;
  k.dn = min(kT, p.D - k.d0), k.en = min(kT, p.Dv - k.e0);
  k.h = blockIdx.y, k.b = blockIdx.z;
  k.bh = static_cast<int64_t>(k.b) * p.H + k.h;
  k.z_owner = k.e0 == 0 && static_cast<int>(threadIdx.x) < k.dn;
  return k;
}

// This block's part of a state [B,H,D,Dv] and its vector [B,H,D] (zeros for S == nullptr) into
// s and z, or (store_state) from them.
template <class L, typename A>
__device__ __forceinline__ void load_state(Acc<L, A>& s, A& z, const A* S, const A* Z, const StateBlock& at, int D,
                                           int Dv) {
  load_acc(s, S == nullptr ? nullptr : S + (at.bh * D + at.d0) * Dv + at.e0, Dv, at.dn, at.en);
  z = (Z != nullptr && at.z_owner) ? Z[at.bh * D + at.d0 + threadIdx.x] : A(0);
}
template <class L, typename A>
__device__ __forceinline__ void store_state(A* S, A* Z, const Acc<L, A>& s, A z, const StateBlock& at, int D,
                                            int Dv) {
  store_acc(S + (at.bh * D + at.d0) * Dv + at.e0, Dv, at.dn, at.en, s);
  if (at.z_owner) Z[at.bh * D + at.d0 + threadIdx.x] = z;
}

// Where a chunk kernel's block works: chunk t (rows row0 .. row0 + rows - 1 of L), columns
// c0 .. c0 + cn - 1 of `width`, head h of batch b (grid chunk_grid(L, width)).
struct ChunkBlock {
  int t, c0, cn, rows, h, b;
  int64_t row0, bh;
};
__device__ __forceinline__ ChunkBlock chunk_block(int L, int width, int H) {
  const int nc = static_cast<int>(ceil_div(width, kT));
  ChunkBlock k;
  k.t = static_cast<int>(blockIdx.x) / nc, k.c0 = static_cast<int>(blockIdx.x) % nc * kT;
  k.cn = min(kT, width - k.c0);
  k.row0 = static_cast<int64_t>(k.t) * kC, k.rows = chunk_rows(L, k.row0);
  k.h = blockIdx.y, k.b = blockIdx.z;
  k.bh = static_cast<int64_t>(k.b) * H + k.h;
  return k;
}

// The shared memory of a chunk kernel: operand tiles x, y (E) around a state tile st (A) and
// three 64-vectors r, c, z.
template <typename T, typename A>
struct ChunkSmem {
  using E = typename Problem<T, A>::E;
  E* x;
  A* st;
  E* y;
  A *r, *c, *z;
  __device__ explicit ChunkSmem(unsigned char* raw) {
    const Smem<A> sm{raw};
    x = sm.template tile<E>(0), st = sm.template tile<A>(1), y = sm.template tile<E>(2);
    r = sm.vec(0), c = sm.vec(1), z = sm.vec(2);
  }
};

// ---------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------

// S = S0 + sum_j phi(k_j) v_j^T, z = z0 + sum_j phi(k_j) over the M keys, chunk by chunk; with
// `chunks` the state before chunk t goes to chunks/zchunks[t].  Grid state_grid(D, Dv).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    state_fwd_kernel(const Problem<T, A> p, const A* S0, const A* z0, States<A> chunks, States<A> zchunks,
                     A* S_out, A* z_out) {
  using L = typename Problem<T, A>::L;
  using E = typename Problem<T, A>::E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem<A> sm{smem_raw};
  E *kt = sm.template tile<E>(0), *vt = sm.template tile<E>(1);
  const StateBlock at = state_block(p);
  const int d0 = at.d0, e0 = at.e0, dn = at.dn, en = at.en;
  const int tid = threadIdx.x;
  A* zparts = sm.vec(0);  // chunk t's column sums of phi(K), in four parts (column_parts)
  Acc<L, A> s;
  A z;
  load_state(s, z, S0, z0, at, p.D, p.Dv);

  const int nt = static_cast<int>(ceil_div(p.M, kC));
  TileRegs<T> kr, vr;  // chunk t's K and V tiles, fetched during chunk t - 1
  const auto fetch = [&](int t) {
    const int64_t row0 = static_cast<int64_t>(t) * kC;
    const int rows = chunk_rows(p.M, row0);
    fetch_tile(kr, p.k.at(at.b, at.h, row0, d0), p.k.sl, p.k.sx, rows, dn);
    fetch_tile(vr, p.v.at(at.b, at.h, row0, e0), p.v.sl, p.v.sx, rows, en);
  };
  if (nt > 0) fetch(0);
  for (int t = 0; t < nt; ++t) {
    if (t > 0 && tid < kT) z += column_sum(zparts, tid);  // chunk t - 1's
    if (chunks.p != nullptr) {
      store_acc(chunks.at(at.bh, t, d0, e0), chunks.ld, dn, en, s);
      if (at.z_owner) *zchunks.at(at.bh, t, 0, d0 + tid) = z;
    }
    stage_tile<A>(kt, kr, p.fm);
    stage_tile<A>(vt, vr);
    if (t + 1 < nt) fetch(t + 1);
    __syncthreads();
    mm<true, false>(s, kt, vt);  // s[d][e] += sum_c phi(k)[c][d] v[c][e]
    column_parts(zparts, kt);
    __syncthreads();
  }
  if (nt > 0 && tid < kT) z += column_sum(zparts, tid);
  store_state(S_out, z_out, s, z, at, p.D, p.Dv);
}

// out rows of query chunk t, Dv-block iv.  Grid chunk_grid(N, Dv).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    output_kernel(const Problem<T, A> p, States<A> states, States<A> zstates, T* out, A* den_out) {
  using L = typename Problem<T, A>::L;
  using E = typename Problem<T, A>::E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const ChunkSmem<T, A> sm(smem_raw);
  E *qt = sm.x, *kt = sm.y;
  A *st = sm.st, *zv = sm.z, *dsum = sm.r;
  const ChunkBlock at = chunk_block(p.N, p.Dv, p.H);
  const int t = at.t, e0 = at.c0, en = at.cn, rows = at.rows;
  const int64_t row0 = at.row0;
  const int tid = threadIdx.x;
  constexpr int ld = kLdOf<E>;

  Acc<L, A> acc = zeros<L, A>(), pp = zeros<L, A>();
  A den = A(0);  // threads 0..63: row tid
  for (int d0 = 0; d0 < p.D; d0 += kT) {
    const int dn = min(kT, p.D - d0);
    load_tile<A>(qt, p.q.at(at.b, at.h, row0, d0), p.q.sl, p.q.sx, rows, dn, p.fm, nullptr, A(1),
                 finite_half<T>(qt));
    if (p.causal) load_tile<A>(kt, p.k.at(at.b, at.h, row0, d0), p.k.sl, p.k.sx, rows, dn, p.fm);
    load_state_operand<T>(st, static_cast<const A*>(states.at(at.bh, t, d0, e0)), states.ld, dn, en);
    if (tid < kT) zv[tid] = tid < dn ? *zstates.at(at.bh, t, 0, d0 + tid) : A(0);
    __syncthreads();
    mm_state<T, false>(acc, qt, st);            // phi(Q) S
    if (p.causal) mm<false, true>(pp, qt, kt);  // phi(Q) phi(K)^T
    if (tid < kC) {
      for (int d = 0; d < kT; ++d) den += to_acc<A>(qt[tid * ld + d]) * zv[d];
    }
    __syncthreads();
  }
  if (p.causal) {
    stage_masked<true>(qt, &pp);  // P o tril, rounded as the numerator will use it
    load_tile<A>(kt, p.v.at(at.b, at.h, row0, e0), p.v.sl, p.v.sx, rows, en);
    __syncthreads();
    mm<false, false>(acc, qt, kt);  // (P o tril) V
    if (tid < kC) {
      for (int j = 0; j < kC; ++j) den += to_acc<A>(qt[tid * ld + j]);
    }
  }
  if (tid < kC) {
    dsum[tid] = den;
    if (e0 == 0 && tid < rows) den_out[at.bh * p.N + row0 + tid] = den;
  }
  __syncthreads();
  store_rows(out + (at.bh * p.N + row0) * p.Dv + e0, p.Dv, rows, en, acc, [&](A y, int r, int) {
    return p.normalize ? y / (dsum[r] + p.eps) : y * p.scale;
  });
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
// chunks) goes to chunks/zchunks[t].  Grid state_grid(D, Dv).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    state_bwd_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, const A* gS, const A* gz, States<A> chunks,
                     States<A> zchunks, A* dS_out, A* dz_out) {
  using L = typename Problem<T, A>::L;
  using E = typename Problem<T, A>::E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Smem<A> sm{smem_raw};
  E *qt = sm.template tile<E>(0), *gt = sm.template tile<E>(1);
  A *rr = sm.vec(0), *cc = sm.vec(1);
  A* wparts = sm.template tile<A>(2);  // chunk t's sums of c_i phi(q_i), in four parts (column_parts)
  const StateBlock at = state_block(p);
  const int d0 = at.d0, e0 = at.e0, dn = at.dn, en = at.en;
  const int tid = threadIdx.x;
  Acc<L, A> s;
  A w;
  load_state(s, w, gS, gz, at, p.D, p.Dv);

  const int nt = static_cast<int>(ceil_div(p.N, kC));
  TileRegs<T> qr, gr;  // chunk t's q and grad_out tiles, fetched during chunk t + 1
  const auto fetch = [&](int t) {
    const int64_t row0 = static_cast<int64_t>(t) * kC;
    const int rows = chunk_rows(p.N, row0);
    fetch_tile(qr, p.q.at(at.b, at.h, row0, d0), p.q.sl, p.q.sx, rows, dn);
    fetch_tile(gr, x.g.at(at.b, at.h, row0, e0), x.g.sl, x.g.sx, rows, en);
  };
  if (nt > 0) fetch(nt - 1);
  for (int t = nt - 1; t >= 0; --t) {
    if (t < nt - 1 && tid < kT) w += column_sum(wparts, tid);  // chunk t + 1's
    if (chunks.p != nullptr) {
      store_acc(chunks.at(at.bh, t, d0, e0), chunks.ld, dn, en, s);
      if (at.z_owner) *zchunks.at(at.bh, t, 0, d0 + tid) = w;
    }
    const int64_t row0 = static_cast<int64_t>(t) * kC;
    row_factors(p, x, at.bh, static_cast<int>(row0), rr, cc);
    __syncthreads();
    const A rs = absmax_pow2(rr);  // r_i / rs in [-1, 1]: no float16 underflow of r_i g_i
    stage_tile<A>(qt, qr, p.fm);
    stage_tile<A>(gt, gr, -1, static_cast<const A*>(rr), A(1) / rs);
    if (t > 0) fetch(t - 1);
    __syncthreads();
    Acc<L, A> part = zeros<L, A>();
    mm<true, false>(part, qt, gt);  // sum_i phi(q)[i][d] (r_i / rs) g[i][e]
    add_scaled(s, rs, part);
    column_parts(wparts, qt, static_cast<const A*>(cc));
    __syncthreads();
  }
  if (nt > 0 && tid < kT) w += column_sum(wparts, tid);
  store_state(dS_out, dz_out, s, w, at, p.D, p.Dv);
}

// dq of query chunk t, D-block ik.  Grid chunk_grid(N, D).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    dq_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, States<A> states, States<A> zstates, T* dq) {
  using L = typename Problem<T, A>::L;
  using E = typename Problem<T, A>::E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const ChunkSmem<T, A> sm(smem_raw);
  E *gt = sm.x, *vt = sm.y;
  A *st = sm.st, *rr = sm.r, *cc = sm.c, *zv = sm.z;
  const ChunkBlock at = chunk_block(p.N, p.D, p.H);
  const int t = at.t, d0 = at.c0, dn = at.cn, rows = at.rows;
  const int64_t row0 = at.row0;
  const int tid = threadIdx.x;

  Acc<L, A> acc = zeros<L, A>(), w = zeros<L, A>();
  if (x.g.p != nullptr) {
    for (int e0 = 0; e0 < p.Dv; e0 += kT) {
      const int en = min(kT, p.Dv - e0);
      load_tile<A>(gt, x.g.at(at.b, at.h, row0, e0), x.g.sl, x.g.sx, rows, en, -1, nullptr, A(1),
                   finite_half<T>(gt));
      load_state_operand<T>(st, static_cast<const A*>(states.at(at.bh, t, d0, e0)), states.ld, dn, en);
      if (p.causal) load_tile<A>(vt, p.v.at(at.b, at.h, row0, e0), p.v.sl, p.v.sx, rows, en);
      __syncthreads();
      mm_state<T, true>(acc, gt, st);            // g S^T
      if (p.causal) mm<false, true>(w, gt, vt);  // g V^T
      __syncthreads();
    }
  }
  row_factors(p, x, at.bh, static_cast<int>(row0), rr, cc);
  if (tid < kT) zv[tid] = tid < dn ? *zstates.at(at.bh, t, 0, d0 + tid) : A(0);
  __syncthreads();
  each<L>([&](int i, int j, int r, int c) { acc.v[i][j] = acc.v[i][j] * rr[r] + cc[r] * zv[c]; });
  if (p.causal) {
    // sum_{j <= i} (r_i g_i.v_j + c_i) phi(k_j): r_i and c_i scale output rows, so they are
    // applied to the fp32 results of (g V^T o tril) phi(K) and tril(1) phi(K).
    E* ones = reinterpret_cast<E*>(st);  // (a 16-bit tile fits in a state tile's slot)
    stage_masked<true>(gt, &w);
    stage_masked<true>(ones, static_cast<const Acc<L, A>*>(nullptr));
    load_tile<A>(vt, p.k.at(at.b, at.h, row0, d0), p.k.sl, p.k.sx, rows, dn, p.fm);
    __syncthreads();
    Acc<L, A> pr = zeros<L, A>(), pc = zeros<L, A>();
    mm<false, false>(pr, gt, vt);
    mm<false, false>(pc, ones, vt);
    each<L>([&](int i, int j, int r, int) { acc.v[i][j] += rr[r] * pr.v[i][j] + cc[r] * pc.v[i][j]; });
  }
  store_rows(dq + (at.bh * p.N + row0) * p.D + d0, p.D, rows, dn, acc, [&](A y, int r, int c) {
    return times_dphi(y, to_acc<A>(*p.q.at(at.b, at.h, row0 + r, d0 + c)), p.fm);
  });
}

// dk of key chunk t, D-block ik.  Grid chunk_grid(M, D).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    dk_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, States<A> rstates, States<A> wstates, T* dk) {
  using L = typename Problem<T, A>::L;
  using E = typename Problem<T, A>::E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const ChunkSmem<T, A> sm(smem_raw);
  E *vt = sm.x, *gt = sm.y;
  A *st = sm.st, *rr = sm.r, *cc = sm.c, *zv = sm.z;
  const ChunkBlock at = chunk_block(p.M, p.D, p.H);  // key chunks
  const int t = at.t, d0 = at.c0, dn = at.cn, rows = at.rows;
  const int64_t row0 = at.row0;
  const int qrows = p.causal ? rows : 0;  // the intra-chunk queries (causal: the same rows)
  const int tid = threadIdx.x;

  Acc<L, A> acc = zeros<L, A>(), wt = zeros<L, A>();
  for (int e0 = 0; e0 < p.Dv; e0 += kT) {
    const int en = min(kT, p.Dv - e0);
    load_tile<A>(vt, p.v.at(at.b, at.h, row0, e0), p.v.sl, p.v.sx, rows, en, -1, nullptr, A(1),
                 finite_half<T>(vt));
    load_state_operand<T>(st, static_cast<const A*>(rstates.at(at.bh, t, d0, e0)), rstates.ld, dn, en);
    if (p.causal) load_tile<A>(gt, x.g.at(at.b, at.h, row0, e0), x.g.sl, x.g.sx, qrows, en);
    __syncthreads();
    mm_state<T, true>(acc, vt, st);             // V R^T
    if (p.causal) mm<false, true>(wt, vt, gt);  // wt[j][i] = v_j . g_i
    __syncthreads();
  }
  if (p.causal) row_factors(p, x, at.bh, static_cast<int>(row0), rr, cc);
  if (tid < kT) zv[tid] = tid < dn ? *wstates.at(at.bh, t, 0, d0 + tid) : A(0);
  __syncthreads();
  each<L>([&](int i, int j, int, int c) { acc.v[i][j] += zv[c]; });
  if (p.causal) {
    // sum_{i >= j} (r_i v_j.g_i + c_i) phi(q_i): r_i, c_i run along the product's k dimension,
    // so they enter the operands divided by powers of two >= their maxima.
    const A rs = absmax_pow2(rr), cs = absmax_pow2(cc);
    E* ct = reinterpret_cast<E*>(st);
    stage_masked<false>(vt, &wt, static_cast<const A*>(rr), A(1) / rs);
    stage_masked<false>(ct, static_cast<const Acc<L, A>*>(nullptr), static_cast<const A*>(cc), A(1) / cs);
    load_tile<A>(gt, p.q.at(at.b, at.h, row0, d0), p.q.sl, p.q.sx, qrows, dn, p.fm);
    __syncthreads();
    Acc<L, A> pr = zeros<L, A>(), pc = zeros<L, A>();
    mm<false, false>(pr, vt, gt);
    mm<false, false>(pc, ct, gt);
    add_scaled(acc, rs, pr);
    add_scaled(acc, cs, pc);
  }
  store_rows(dk + (at.bh * p.M + row0) * p.D + d0, p.D, rows, dn, acc, [&](A y, int r, int c) {
    return times_dphi(y, to_acc<A>(*p.k.at(at.b, at.h, row0 + r, d0 + c)), p.fm);
  });
}

// dv of key chunk t, Dv-block iv.  Grid chunk_grid(M, Dv).
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    dv_kernel(const Problem<T, A> p, const BwdExtra<T, A> x, States<A> rstates, T* dv) {
  using L = typename Problem<T, A>::L;
  using E = typename Problem<T, A>::E;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const ChunkSmem<T, A> sm(smem_raw);
  E *kt = sm.x, *qt = sm.y;
  A *st = sm.st, *rr = sm.r, *cc = sm.c;
  const ChunkBlock at = chunk_block(p.M, p.Dv, p.H);  // key chunks
  const int t = at.t, e0 = at.c0, en = at.cn, rows = at.rows;
  const int64_t row0 = at.row0;
  const int qrows = p.causal ? rows : 0;

  Acc<L, A> acc = zeros<L, A>(), pt = zeros<L, A>();
  for (int d0 = 0; d0 < p.D; d0 += kT) {
    const int dn = min(kT, p.D - d0);
    load_tile<A>(kt, p.k.at(at.b, at.h, row0, d0), p.k.sl, p.k.sx, rows, dn, p.fm, nullptr, A(1),
                 finite_half<T>(kt));
    load_state_operand<T>(st, static_cast<const A*>(rstates.at(at.bh, t, d0, e0)), rstates.ld, dn, en);
    if (p.causal) load_tile<A>(qt, p.q.at(at.b, at.h, row0, d0), p.q.sl, p.q.sx, qrows, dn, p.fm);
    __syncthreads();
    mm_state<T, false>(acc, kt, st);            // phi(K) R
    if (p.causal) mm<false, true>(pt, kt, qt);  // pt[j][i] = phi(k_j) . phi(q_i)
    __syncthreads();
  }
  if (p.causal) {
    row_factors(p, x, at.bh, static_cast<int>(row0), rr, cc);
    __syncthreads();
    const A rs = absmax_pow2(rr);
    stage_masked<false>(kt, &pt, static_cast<const A*>(rr), A(1) / rs);
    load_tile<A>(qt, x.g.at(at.b, at.h, row0, e0), x.g.sl, x.g.sx, qrows, en);
    __syncthreads();
    Acc<L, A> pr = zeros<L, A>();
    mm<false, false>(pr, kt, qt);  // (r_i phi(k_j).phi(q_i)) for i >= j, times g
    add_scaled(acc, rs, pr);
  }
  store_rows(dv + (at.bh * p.M + row0) * p.Dv + e0, p.Dv, rows, en, acc, [](A y, int, int) { return y; });
}

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

// The kernels agree with the limits the checks use (csrc/cuda/launch.h).
static_assert(smem_bytes<float>() == cuda_limits::linear_smem_bytes(false), "csrc/cuda/launch.h: linear_smem_bytes");
static_assert(smem_bytes<double>() == cuda_limits::linear_smem_bytes(true), "csrc/cuda/launch.h: linear_smem_bytes");

// name: checked by checks::linear_* (csrc/checks/linear.cpp).
int parse_feature_map(std::string_view name) {
  if (name == "elu") return kElu;
  if (name == "relu") return kRelu;
  ATTNKIT_CHECK(name == "identity", "attnkit::linear (cuda): unchecked feature_map");  // cannot happen
  return kIdentity;
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// An optional tensor (checked: of the accumulation type and its shape, on q's device), contiguous.
at::Tensor contiguous_or_none(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->contiguous() : at::Tensor();
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

// kernel<<<grid, kThreads, smem_bytes<A>()>>>(args...) on the current stream, with the
// shared-memory opt-in (the double kernels use more than the default 48 KiB).  A failed launch
// is left for the caller (csrc/cuda/launch.h).
template <typename A, typename... P, typename... Args>
void launch(void (*kernel)(P...), dim3 grid, Args&&... args) {
  constexpr size_t smem = smem_bytes<A>();
  allow_smem(kernel, smem);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(std::forward<Args>(args)...);
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

// The states every chunk reads: per chunk (causal: Hs [B,H,nt,D,Dv], Zs [B,H,nt,D]) or the
// totals (S [B,H,D,Dv], z [B,H,D]).
template <typename A>
std::pair<States<A>, States<A>> chunk_states(bool causal, const at::Tensor& Hs, const at::Tensor& Zs,
                                             const at::Tensor& S, const at::Tensor& z, int64_t nt, int64_t D,
                                             int64_t Dv) {
  if (causal) return {states_of<A>(Hs, nt, D, Dv), states_of<A>(Zs, nt, 1, D)};
  return {states_of<A>(S, 0, D, Dv), states_of<A>(z, 0, 1, D)};
}

// The forward states: S_final / z_final into S, z; per chunk into Hs / Zs when given.
template <typename T, typename A>
void run_state_fwd(const Problem<T, A>& p, int64_t B, const at::Tensor& S0, const at::Tensor& z0, at::Tensor* Hs,
                   at::Tensor* Zs, at::Tensor& S, at::Tensor& z) {
  States<A> hs, zs;
  if (Hs != nullptr) {
    const int64_t nt = Hs->size(2);
    hs = states_of<A>(*Hs, nt, p.D, p.Dv);
    zs = states_of<A>(*Zs, nt, 1, p.D);
  }
  launch<A>(state_fwd_kernel<T, A>, state_grid(p.D, p.Dv, p.H, B), p, ptr_or_null<A>(S0), ptr_or_null<A>(z0), hs, zs,
            static_cast<A*>(S.data_ptr()), static_cast<A*>(z.data_ptr()));
}

template <typename T, typename A>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& S0,
                  const at::Tensor& z0, int fm, bool causal, bool normalize, double eps, double scale, at::Tensor& out,
                  at::Tensor& den, at::Tensor& S, at::Tensor& z) {
  const Problem<T, A> p = make_problem<T, A>(q, k, v, fm, causal, normalize, eps, scale);
  const int64_t B = q.size(0);
  const int64_t nt = ceil_div(p.N, kC);
  at::Tensor Hs, Zs;
  if (causal) {
    Hs = at::empty({B, p.H, nt, p.D, p.Dv}, q.options().dtype(acc_type(q.scalar_type())));
    Zs = at::empty({B, p.H, nt, p.D}, Hs.options());
  }
  run_state_fwd<T, A>(p, B, S0, z0, causal ? &Hs : nullptr, causal ? &Zs : nullptr, S, z);
  if (p.N == 0) return;
  if (p.M == 0 && !S0.defined()) {  // no keys, no state: zeros whatever eps (0 / 0 at eps = 0)
    out.zero_();
    den.zero_();
    return;
  }
  const auto [hs, zs] = chunk_states<A>(causal, Hs, Zs, S, z, nt, p.D, p.Dv);
  launch<A>(output_kernel<T, A>, chunk_grid(p.N, p.Dv, p.H, B), p, hs, zs, static_cast<T*>(out.data_ptr()),
            static_cast<A*>(den.data_ptr()));
}

// Calls f(T{}, A{}) with the element and accumulation types of `st`.
template <typename F>
void dispatch(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kHalf: f(c10::Half{}, float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}, float{}); break;
    case at::kFloat: f(float{}, float{}); break;
    case at::kDouble: f(double{}, double{}); break;
    default: ATTNKIT_CHECK(false, "attnkit::linear (cuda): unchecked dtype");  // checks::linear_*: cannot happen
  }
}

template <typename T, typename A>
void backward_impl(const at::Tensor& g, const at::Tensor& gden, const at::Tensor& gS, const at::Tensor& gz,
                   const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                   const at::Tensor& den, const at::Tensor& S, const at::Tensor& z, const at::Tensor& S0,
                   const at::Tensor& z0, int fm, bool causal, bool normalize, double eps, double scale, at::Tensor& dq,
                   at::Tensor& dk, at::Tensor& dv, at::Tensor& dS0, at::Tensor& dz0) {
  const Problem<T, A> p = make_problem<T, A>(q, k, v, fm, causal, normalize, eps, scale);
  const int64_t B = q.size(0);
  const auto opts = q.options().dtype(acc_type(q.scalar_type()));
  const int64_t nt_q = ceil_div(p.N, kC);

  BwdExtra<T, A> x;
  x.g = view_of<T>(g);
  x.den = ptr_or_null<A>(den);
  x.gden = ptr_or_null<A>(gden);
  at::Tensor delta;
  if (normalize && g.defined() && p.N > 0) {
    delta = at::empty({B, p.H, p.N}, opts);
    const int64_t rows = B * p.H * p.N;
    constexpr int64_t kRowsPerBlock = kThreads / 32;
    delta_kernel<T, A><<<static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)), kThreads, 0,
                         c10::cuda::getCurrentCUDAStream()>>>(view_of<T>(g), view_of<T>(out), p.H, p.N, p.Dv, rows,
                                                              static_cast<A*>(delta.data_ptr()));
    x.delta = static_cast<const A*>(delta.data_ptr());
  }

  // Forward states: per chunk (causal, recomputed) or the forward's totals S, z.  Reverse
  // states over the queries: per chunk (causal) or the total, which is dS0 / dz0.
  at::Tensor Hs, Zs, S_scratch, z_scratch, Rs, Ws;
  if (causal) {
    Hs = at::empty({B, p.H, nt_q, p.D, p.Dv}, opts);
    Zs = at::empty({B, p.H, nt_q, p.D}, opts);
    S_scratch = at::empty({B, p.H, p.D, p.Dv}, opts);
    z_scratch = at::empty({B, p.H, p.D}, opts);
    run_state_fwd<T, A>(p, B, S0, z0, &Hs, &Zs, S_scratch, z_scratch);
    Rs = at::empty_like(Hs);
    Ws = at::empty_like(Zs);
  }
  const auto [hs, zs] = chunk_states<A>(causal, Hs, Zs, S, z, nt_q, p.D, p.Dv);
  const auto [rs, ws] = chunk_states<A>(causal, Rs, Ws, dS0, dz0, nt_q, p.D, p.Dv);
  launch<A>(state_bwd_kernel<T, A>, state_grid(p.D, p.Dv, p.H, B), p, x, ptr_or_null<A>(gS), ptr_or_null<A>(gz),
            causal ? rs : States<A>{}, causal ? ws : States<A>{}, static_cast<A*>(dS0.data_ptr()),
            static_cast<A*>(dz0.data_ptr()));
  if (p.N > 0) launch<A>(dq_kernel<T, A>, chunk_grid(p.N, p.D, p.H, B), p, x, hs, zs, static_cast<T*>(dq.data_ptr()));
  if (p.M > 0) {
    launch<A>(dk_kernel<T, A>, chunk_grid(p.M, p.D, p.H, B), p, x, rs, ws, static_cast<T*>(dk.data_ptr()));
    launch<A>(dv_kernel<T, A>, chunk_grid(p.M, p.Dv, p.H, B), p, x, rs, static_cast<T*>(dv.data_ptr()));
  }
}

}  // namespace

// Entry points (csrc/cuda/launch.h: checked inputs; launch errors are left to the caller).

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& S0_in,
    const std::optional<at::Tensor>& z0_in, bool causal, std::string_view feature_map, bool normalize, double eps,
    double scale) {
  const int fm = parse_feature_map(feature_map);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t Dv = v.size(3);
  const auto acc = acc_type(q.scalar_type());
  const at::Tensor S0 = contiguous_or_none(S0_in);
  const at::Tensor z0 = contiguous_or_none(z0_in);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_bwd_cuda(
    const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& grad_den_in,
    const std::optional<at::Tensor>& grad_S_in, const std::optional<at::Tensor>& grad_z_in, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& den_in,
    const at::Tensor& S_in, const at::Tensor& z_in, const std::optional<at::Tensor>& S0_in,
    const std::optional<at::Tensor>& z0_in, bool causal, std::string_view feature_map, bool normalize, double eps,
    double scale) {
  const int fm = parse_feature_map(feature_map);
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3);
  const int64_t M = k.size(2), Dv = v.size(3);
  const auto acc = acc_type(q.scalar_type());
  const at::Tensor den = den_in.contiguous();
  const at::Tensor S = S_in.contiguous();
  const at::Tensor z = z_in.contiguous();
  const at::Tensor S0 = contiguous_or_none(S0_in);
  const at::Tensor z0 = contiguous_or_none(z0_in);
  const at::Tensor gden = contiguous_or_none(grad_den_in);
  const at::Tensor gS = contiguous_or_none(grad_S_in);
  const at::Tensor gz = contiguous_or_none(grad_z_in);
  const at::Tensor g = grad_out.has_value() && grad_out->defined() ? *grad_out : at::Tensor();
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
  dispatch(q.scalar_type(), [&](auto t, auto a) {
    using T = decltype(t);
    using A = decltype(a);
    backward_impl<T, A>(g, gden, gS, gz, q, k, v, out, den, S, z, S0, z0, fm, causal, normalize, eps, scale, dq, dk,
                        dv, dS0, dz0);
  });
  return {dq, dk, dv, dS0, dz0};
}

}  // namespace attnkit

// Softmax attention forward for Hopper (sm_90a), FlashAttention-3's design written for attnkit
// (issue 27): TMA loads of Q, K and V tiles completing on mbarriers, wgmma for both products, and
// warp specialization -- one producer warpgroup that only issues the tile loads (its registers
// given back with setmaxnreg) and two consumer warpgroups of 64 query rows each.
//
// STATUS.  Compiled for sm_90a by .ci/compile_cuda.sh (its SASS checked for HGMMA / UTMALDG and
// no local memory by .ci/check_sm90_sass.sh) and run on the CPU by the CUDA emulator
// (tests/csrc/test_softmax_sm90_emulated.py: TMA with the 128-byte swizzle, mbarrier phases and
// wgmma from the PTX ISA) against the float64 reference.  Not yet run on a GPU: opt-in with
// ATTNKIT_CUDA_SM90=1 until `pytest -m gpu` passes with it on an H100/H200 (bench/RESULTS.md).
//
// WHAT IT COMPUTES.  The forward of softmax.cu's kernels (same entry point, same results up to
// fp32 summation order) for the cases it takes: float16 / bfloat16, D = Dv = 64 or 128, no mask,
// causal (top-left, j <= i) or not, GQA (query head h reads kv head h / (H / Hk)), any N and M,
// q, k, v of shape [B, H|Hk, N|M, D] with a contiguous last dim and other strides multiples of
// 16 bytes (what TMA reads).  Out [B, H, N, D] contiguous, lse [B, H, N] float32 (natural log;
// -inf for a row that saw no key, whose out is 0).
//
// HOW.  One block of 384 threads per (128 query rows, h, b):
//  - warpgroup 0 (producer, 40 registers): thread 0 loads Q (D / 64 boxes of 128 rows x 64
//    elements, 128-byte swizzle) once, then streams K and V tiles of 128 keys through a ring of
//    kStages stages: it waits for the stage to be released (kv_empty), then issues the TMA loads
//    of K (on k_full) and V (on v_full) separately, so S = Q Kᵀ can start before V has landed.
//  - warpgroups 1 and 2 (consumers, 232 registers): rows 64 (wg - 1) .. +63 of the block.  Per
//    tile: S = Q Kᵀ by D / 16 wgmma m64n128k16 from shared memory (Q and K K-major), the online
//    softmax in registers (base 2, flash_tiles.cuh's update: the wgmma accumulator of a warp is
//    the m16n8 C fragments of its 16 rows), P re-packed in registers as the A operand, O += P V by
//    8 wgmma m64nDk16 with A from registers and V MN-major (imm-trans-b), then the stage is
//    released.  Out-of-range keys (j >= M, zero-filled by TMA) and causally hidden ones are -inf.
//  - Two consumer loops (ATTNKIT_CUDA_SM90=1 | simple, both emulated, to be timed on a GPU):
//    "simple" waits for each product at once; the default overlaps the softmax of tile t with
//    the P V product of tile t - 1 (FlashAttention-3's intra-warpgroup pipelining).  The two
//    consumers' ping-pong (named barriers) and a persistent scheduler are the next steps.

#include "host_utils.cuh"  // first: torch headers and host helpers

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "mma_sm80.cuh"
#include "flash_tiles.cuh"
#include "sm90_ptx.cuh"

namespace attnkit {
namespace {

constexpr int kSm90Threads = 384;        // 3 warpgroups: producer, 2 consumers
constexpr int kSm90BlockM = 128;         // query rows per block (64 per consumer warpgroup)
constexpr int kSm90BlockN = 128;         // keys per K / V tile
constexpr int kSm90Stages = 2;           // K / V ring depth
constexpr int kPanelCols = 64;           // elements per 128-byte swizzled row (one TMA box wide)
constexpr int kPanelElems = 128 * kPanelCols;  // one 128-row panel (Q tile, K or V tile): 16 KiB
constexpr uint32_t kPanelBytes = kPanelElems * 2;
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;       // 40 * 128 + 232 * 256 = 64512 <= 65536 registers
static_assert(kSm90BlockM == 128 && kSm90BlockN == 128, "the panels hold 128 rows");

// Dynamic shared memory: 1024 bytes of slack to align the tiles (the 128-byte swizzle repeats
// every 1024 bytes and TMA and wgmma read it from address bits 7-9), Q, the K and V rings, and
// 1 + 3 kSm90Stages mbarriers.
template <int kD>
constexpr size_t sm90_smem_bytes() {
  return 1024 + static_cast<size_t>(1 + 2 * kSm90Stages) * (kD / kPanelCols) * kPanelBytes +
         (1 + 3 * kSm90Stages) * sizeof(uint64_t);
}

struct Sm90FwdParams {
  uint16_t* out;  // [B, H, N, D] contiguous
  float* lse;     // [B, H, N]
  int H, group, N, M;
  float scale_log2;  // scale * log2(e)
  bool causal;
};

// S = Q Kᵀ for this consumer's 64 rows against the K tile of stage `stage`, issued (not waited
// for): k-step kk reads columns 16 kk .. of panel kk / 4, 32 bytes further per step.
template <bool kBF16, int kD>
__device__ __forceinline__ void issue_scores(float (&sc)[kSm90BlockN / 8][4], const uint16_t* sq, const uint16_t* sk,
                                             int stage, int wq) {
  constexpr int kP = kD / kPanelCols;
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint16_t* qa = sq + (kk / 4) * kPanelElems + wq * 64 * kPanelCols + (kk % 4) * 16;
    const uint16_t* kb = sk + (stage * kP + kk / 4) * kPanelElems + (kk % 4) * 16;
    wgmma_ss<kBF16, kSm90BlockN, 0>(sc, smem_desc_sw128(qa, 16, 1024), smem_desc_sw128(kb, 16, 1024), kk > 0);
  }
}

// O += P V with P from registers and the V tile of stage `stage`, issued: k-step kc reads keys
// 16 kc .. (16 rows of 128 bytes further); the D columns are kP panels kPanelBytes apart.
template <bool kBF16, int kD>
__device__ __forceinline__ void issue_pv(float (&o)[kD / 8][4], const uint32_t (&pa)[kSm90BlockN / 16][4],
                                         const uint16_t* sv, int stage) {
  constexpr int kP = kD / kPanelCols;
#pragma unroll
  for (int kc = 0; kc < kSm90BlockN / 16; ++kc) {
    const uint16_t* vb = sv + stage * kP * kPanelElems + kc * 16 * kPanelCols;
    wgmma_rs<kBF16, kD, 1>(o, pa[kc], smem_desc_sw128(vb, kPanelBytes, 1024), 1);
  }
}

// Scores to base 2; keys past M and (causal) past the row hidden.  Warp-uniform test: only the
// last tile and the tiles crossing this warp's diagonal need the per-entry check.
__device__ __forceinline__ void scale_and_mask(float (&sc)[kSm90BlockN / 8][4], const Sm90FwdParams& p, int t,
                                               int row0, int g, int tq) {
  const int j0 = t * kSm90BlockN;
  const bool edge = j0 + kSm90BlockN > p.M || (p.causal && j0 + kSm90BlockN - 1 > row0);
#pragma unroll
  for (int nt = 0; nt < kSm90BlockN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = sc[nt][e] * p.scale_log2;
      if (edge) {
        const int j = j0 + 8 * nt + 2 * tq + (e & 1);
        const int i = row0 + g + 8 * (e >> 1);
        sc[nt][e] = (j < p.M && (!p.causal || j <= i)) ? x : -INFINITY;
      } else {
        sc[nt][e] = x;
      }
    }
  }
}

// kOverlap = false ("simple"): per tile, S, softmax, then O += P V, each product waited for at
// once.  kOverlap = true: the products of tile t (S_t) and of tile t - 1 (O += P_{t-1} V_{t-1})
// are issued together; the softmax of S_t runs while the P V product is still on the tensor
// cores, and O is rescaled once that product is done (FlashAttention-3's intra-warpgroup
// overlap; P_{t-1} and S_t in registers at once: 32 + 64 more than O's).
template <bool kBF16, int kD, bool kOverlap>
__global__ void __launch_bounds__(kSm90Threads, 1)
    softmax_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                            const __grid_constant__ CUtensorMap tm_v, const Sm90FwdParams p) {
  constexpr int kP = kD / kPanelCols;  // panels per tile
  constexpr int kNt = kSm90BlockN / 8;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* base = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  uint16_t* sq = reinterpret_cast<uint16_t*>(base);
  uint16_t* sk = sq + kP * kPanelElems;
  uint16_t* sv = sk + kSm90Stages * kP * kPanelElems;
  uint64_t* q_full = reinterpret_cast<uint64_t*>(sv + kSm90Stages * kP * kPanelElems);
  uint64_t* k_full = q_full + 1;
  uint64_t* v_full = k_full + kSm90Stages;
  uint64_t* kv_empty = v_full + kSm90Stages;

  const int q0 = static_cast<int>(blockIdx.x) * kSm90BlockM;
  const int h = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  // Keys [0, kv_end) can be visible to the block's rows (causal: j <= i < min(q0 + 128, N)).
  const int kv_end = p.causal ? min(p.M, min(q0 + kSm90BlockM, p.N)) : p.M;
  const int n_tiles = (kv_end + kSm90BlockN - 1) / kSm90BlockN;
  const int wg = static_cast<int>(threadIdx.x) / 128;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < kSm90Stages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&kv_empty[s], 256);  // every consumer thread releases the stage
    }
    fence_proxy_async();  // the initialized barriers, visible to the TMA unit
  }
  __syncthreads();

  if (wg == 0) {
    setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      const int hk = h / p.group;
      mbar_arrive_expect_tx(q_full, kP * kPanelBytes);
      for (int c = 0; c < kP; ++c) tma_load_4d(sq + c * kPanelElems, &tm_q, c * kPanelCols, q0, h, b, q_full);
      for (int t = 0; t < n_tiles; ++t) {
        const int s = t % kSm90Stages, use = t / kSm90Stages;
        // The stage's previous use released (a fresh barrier's "previous phase" counts as done).
        mbar_wait(&kv_empty[s], (use & 1) ^ 1);
        mbar_arrive_expect_tx(&k_full[s], kP * kPanelBytes);
        for (int c = 0; c < kP; ++c) {
          tma_load_4d(sk + (s * kP + c) * kPanelElems, &tm_k, c * kPanelCols, t * kSm90BlockN, hk, b, &k_full[s]);
        }
        mbar_arrive_expect_tx(&v_full[s], kP * kPanelBytes);
        for (int c = 0; c < kP; ++c) {
          tma_load_4d(sv + (s * kP + c) * kPanelElems, &tm_v, c * kPanelCols, t * kSm90BlockN, hk, b, &v_full[s]);
        }
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  const int wq = wg - 1;  // consumer 0 or 1: rows 64 wq .. 64 wq + 63 of the block
  const int tid = static_cast<int>(threadIdx.x) % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int row0 = q0 + 64 * wq + 16 * warp;  // this warp's first row
  const int g = lane / 4, tq = lane % 4;

  float o[kD / 8][4];
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float sc[kNt][4];
  uint32_t pa[kNt / 2][4];
  auto stage_of = [](int t) { return t % kSm90Stages; };
  auto parity_of = [](int t) { return static_cast<uint32_t>(t / kSm90Stages) & 1u; };

  mbar_wait(q_full, 0);
  if constexpr (!kOverlap) {
    for (int t = 0; t < n_tiles; ++t) {
      mbar_wait(&k_full[stage_of(t)], parity_of(t));
      wgmma_fence();
      issue_scores<kBF16, kD>(sc, sq, sk, stage_of(t), wq);
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(sc);
      scale_and_mask(sc, p, t, row0, g, tq);
      online_softmax_update<kNt, kD / 8>(sc, o, m_run, l_run);
#pragma unroll
      for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
      mbar_wait(&v_full[stage_of(t)], parity_of(t));
      wgmma_fence();
      issue_pv<kBF16, kD>(o, pa, sv, stage_of(t));
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(o);
      acc_fence(pa);  // P's registers stay P's until the products that read them are done
      mbar_arrive(&kv_empty[stage_of(t)]);
    }
  } else if (n_tiles > 0) {
    mbar_wait(&k_full[0], 0);
    wgmma_fence();
    issue_scores<kBF16, kD>(sc, sq, sk, 0, wq);
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(sc);
    scale_and_mask(sc, p, 0, row0, g, tq);
    float alpha[2];
    online_softmax_scores<kNt>(sc, m_run, l_run, alpha);  // o is still 0: no rescale
#pragma unroll
    for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
    for (int t = 1; t < n_tiles; ++t) {
      const int prev = t - 1;
      mbar_wait(&k_full[stage_of(t)], parity_of(t));
      wgmma_fence();
      issue_scores<kBF16, kD>(sc, sq, sk, stage_of(t), wq);  // group 1: S_t
      wgmma_commit();
      mbar_wait(&v_full[stage_of(prev)], parity_of(prev));
      issue_pv<kBF16, kD>(o, pa, sv, stage_of(prev));  // group 2: O += P_{t-1} V_{t-1}
      wgmma_commit();
      wgmma_wait<1>();  // S_t done; the P V product may still run
      acc_fence(sc);
      scale_and_mask(sc, p, t, row0, g, tq);
      online_softmax_scores<kNt>(sc, m_run, l_run, alpha);
      wgmma_wait<0>();
      acc_fence(o);
      acc_fence(pa);
      mbar_arrive(&kv_empty[stage_of(prev)]);
      rescale_rows<kD / 8>(o, alpha);
#pragma unroll
      for (int kc = 0; kc < kNt / 2; ++kc) acc_to_a<kBF16, kNt>(pa[kc], sc, kc);
    }
    const int last = n_tiles - 1;
    mbar_wait(&v_full[stage_of(last)], parity_of(last));
    wgmma_fence();
    issue_pv<kBF16, kD>(o, pa, sv, stage_of(last));
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(o);
    acc_fence(pa);
    mbar_arrive(&kv_empty[stage_of(last)]);
  }

  store_out_lse<kBF16, kD>(p.out, p.lse, (static_cast<int64_t>(b) * p.H + h) * p.N + row0, 1, g, p.N - row0, o,
                           m_run, l_run, tq);
}

// Writes 1 when the device code was built for sm_90a (wgmma and setmaxnreg present), else 0.
__global__ void sm90a_probe_kernel(int* out) { *out = ATTNKIT_SM90A; }

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------

// ATTNKIT_CUDA_SM90 (read per call: cheap, and tests switch it): "1" turns the kernel on
// (the overlapped consumer loop), "simple" the one without overlap; anything else, off.
enum class Sm90Mode { kOff, kOverlap, kSimple };
Sm90Mode sm90_requested() {
  const char* env = std::getenv("ATTNKIT_CUDA_SM90");
  if (env == nullptr) return Sm90Mode::kOff;
  if (std::strcmp(env, "1") == 0) return Sm90Mode::kOverlap;
  if (std::strcmp(env, "simple") == 0) return Sm90Mode::kSimple;
  return Sm90Mode::kOff;
}

// Whether this build carries the sm_90a code and the current device is a compute capability 9.0
// one, probed once per device.
bool sm90_available(int device) {
  static std::mutex mu;
  static int cached[64];
  static bool known[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return false;
  if (known[device]) return cached[device] != 0;
  known[device] = true;
  cached[device] = 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
    (void)cudaGetLastError();
    return false;
  }
  int* flag = nullptr;
  int host = 0;
  if (cudaMalloc(&flag, sizeof(int)) == cudaSuccess) {
    sm90a_probe_kernel<<<1, 1>>>(flag);
    if (cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) host = 0;
    (void)cudaFree(flag);
  }
  (void)cudaGetLastError();  // a build without sm_90 code fails the probe launch: not available
  cached[device] = host;
  return host != 0;
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, without linking libcuda (nullptr when unavailable).
EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(ptr);
  }();
  return fn;
}

// TMA strides are nonzero multiples of 16 bytes: x's, except that a dim of size 1 (never stepped)
// gets the extent of the dims inside it.
bool tma_strides_ok(const at::Tensor& x) {
  if (x.stride(3) != 1 || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (x.size(d) > 1 && (x.stride(d) <= 0 || (x.stride(d) * 2) % 16 != 0)) return false;
  }
  return true;
}

// The 4-d map (D, L, heads, B) of x [B, heads, L, D] with boxes of 64 x 128 x 1 x 1 elements and
// the 128-byte swizzle.
bool make_map(CUtensorMap* map, const at::Tensor& x, bool bf16) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(x.size(3)), static_cast<cuuint64_t>(x.size(2)),
                              static_cast<cuuint64_t>(x.size(1)), static_cast<cuuint64_t>(x.size(0))};
  cuuint64_t strides[3];
  cuuint64_t inner = static_cast<cuuint64_t>(x.size(3)) * 2;
  for (int i = 0; i < 3; ++i) {
    const int d = 2 - i;  // tensor dim of map dim i + 1
    strides[i] = x.size(d) > 1 ? static_cast<cuuint64_t>(x.stride(d)) * 2 : inner;
    inner = strides[i] * static_cast<cuuint64_t>(std::max<int64_t>(x.size(d), 1));
  }
  const cuuint32_t box[4] = {kPanelCols, 128, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode_tiled()(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                        x.data_ptr(), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <bool kBF16, int kD>
void launch_sm90(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Sm90FwdParams& p,
                 dim3 grid, cudaStream_t stream, Sm90Mode mode) {
  constexpr size_t smem = sm90_smem_bytes<kD>();
  if (mode == Sm90Mode::kSimple) {
    allow_smem(softmax_fwd_sm90_kernel<kBF16, kD, false>, smem);
    softmax_fwd_sm90_kernel<kBF16, kD, false><<<grid, kSm90Threads, smem, stream>>>(tq, tk, tv, p);
  } else {
    allow_smem(softmax_fwd_sm90_kernel<kBF16, kD, true>, smem);
    softmax_fwd_sm90_kernel<kBF16, kD, true><<<grid, kSm90Threads, smem, stream>>>(tq, tk, tv, p);
  }
}

}  // namespace

// Entry point (csrc/cuda/launch.h): checked inputs, no mask.
std::optional<std::tuple<at::Tensor, at::Tensor>> softmax_fwd_cuda_sm90(const at::Tensor& q, const at::Tensor& k,
                                                                        const at::Tensor& v, double scale,
                                                                        bool is_causal) {
  const Sm90Mode mode = sm90_requested();
  if (mode == Sm90Mode::kOff) return std::nullopt;
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Hk = k.size(1), M = k.size(2);
  if ((D != 64 && D != 128) || v.size(3) != D || B == 0 || H == 0 || N == 0) return std::nullopt;
  if (!tma_strides_ok(q) || !tma_strides_ok(k) || !tma_strides_ok(v)) return std::nullopt;
  c10::cuda::CUDAGuard guard(q.device());
  if (!sm90_available(q.device().index()) || encode_tiled() == nullptr) return std::nullopt;

  const bool bf16 = q.scalar_type() == at::kBFloat16;
  CUtensorMap tq, tk, tv;
  if (!make_map(&tq, q, bf16) || !make_map(&tk, k, bf16) || !make_map(&tv, v, bf16)) return std::nullopt;
  at::Tensor out = at::empty({B, H, N, D}, q.options());
  at::Tensor lse = at::empty({B, H, N}, q.options().dtype(at::kFloat));
  Sm90FwdParams p;
  p.out = mutable_bits(out);
  p.lse = lse.data_ptr<float>();
  p.H = static_cast<int>(H);
  p.group = static_cast<int>(H / Hk);
  p.N = static_cast<int>(N);
  p.M = static_cast<int>(M);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = is_causal;
  const dim3 grid(static_cast<unsigned>((N + kSm90BlockM - 1) / kSm90BlockM), static_cast<unsigned>(H),
                  static_cast<unsigned>(B));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (bf16) {
    D == 64 ? launch_sm90<true, 64>(tq, tk, tv, p, grid, stream, mode)
            : launch_sm90<true, 128>(tq, tk, tv, p, grid, stream, mode);
  } else {
    D == 64 ? launch_sm90<false, 64>(tq, tk, tv, p, grid, stream, mode)
            : launch_sm90<false, 128>(tq, tk, tv, p, grid, stream, mode);
  }
  return std::make_tuple(out, lse);
}

}  // namespace attnkit

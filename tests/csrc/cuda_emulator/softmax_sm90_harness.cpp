// Host emulator for the device code of csrc/cuda/softmax_sm90.cu (the Hopper softmax forward and
// backward): the emulator of harness.cpp with its Hopper models (harness_sm90.h: TMA with the
// 128-byte swizzle, mbarriers, wgmma, setmaxnreg), the kernels as extract.py cuts them out of
// softmax_sm90.cu, and their launches re-created from what its host side does after its checks
// (the tensor maps of make_map, the grids, the shared-memory sizes).
//
// Build (extract.py writes softmax_sm90_kernels.inc):
//   g++ -std=c++20 -O1 -fno-strict-aliasing -shared -fPIC -I<dir of the .inc> softmax_sm90_harness.cpp -o libemu.so
// Optional: -DEMU_ONLY_F16_D64 (fp16 / head dim 64 only: a quick build, for the test's mutants),
// with -DEMU_ALSO_D256 head dim 256 too (the mutants of the D = 256 kernels).
#define EMU_CORE_ONLY
#include "harness.cpp"

#define __host__
using std::max;
using std::min;

#include "softmax_sm90_kernels.inc"

namespace {
using namespace attnkit;

bool fail(const std::string& what) {
  emu::S.failed = true;
  emu::S.error = what;
  return false;
}

void begin() {
  emu::S.failed = false;
  emu::S.error.clear();
}

// softmax_sm90.cu's make_map: the 4-d map (D, L, heads, B) of x [B, heads, L, D] (element strides
// of dims 0-2 in `st`, 0 where a dim has size 1), boxes of 64 x rows, the 128-byte swizzle; a dim
// of size 1 gets the extent of the dims inside it as its stride.
bool make_map(CUtensorMap& map, const uint16_t* x, const int64_t* st, int64_t B, int64_t heads, int64_t L, int64_t D,
              uint32_t rows) {
  const uint64_t dims[4] = {static_cast<uint64_t>(D), static_cast<uint64_t>(L), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(B)};
  const int64_t sizes[3] = {B, heads, L};
  uint64_t strides[3];
  uint64_t inner = static_cast<uint64_t>(D) * 2;
  for (int i = 0; i < 3; ++i) {
    const int d = 2 - i;
    strides[i] = sizes[d] > 1 ? static_cast<uint64_t>(st[d]) * 2 : inner;
    inner = strides[i] * static_cast<uint64_t>(std::max<int64_t>(sizes[d], 1));
  }
  const uint32_t box[4] = {static_cast<uint32_t>(kPanelCols), rows, 1, 1};
  return emu_make_tensor_map_4d(&map, x, 2, dims, strides, box, 3) == 0;
}

template <bool BF, int D>
bool fwd(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Sm90FwdParams& p, int B,
         int loop) {
  const dim3 grid{static_cast<unsigned>((p.N + kSm90BlockM - 1) / kSm90BlockM), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(B)};
  const size_t smem = sm90_smem_bytes<D>();
  if (loop == 3) {  // persistent: 2 blocks (fewer than the tiles of most cases: each takes several)
    const int tiles = p.q_blocks * p.H * p.B;
    return emu::launch("softmax_fwd_sm90_kernel", dim3{static_cast<unsigned>(std::min(tiles, 2)), 1, 1},
                       kSm90Threads, smem, [=] { softmax_fwd_sm90_kernel<BF, D, true, false, true>(tq, tk, tv, p); });
  }
  if (loop == 2) {
    return emu::launch("softmax_fwd_sm90_kernel", grid, kSm90Threads, smem,
                       [=] { softmax_fwd_sm90_kernel<BF, D, true, true>(tq, tk, tv, p); });
  }
  if (loop == 1) {
    return emu::launch("softmax_fwd_sm90_kernel", grid, kSm90Threads, smem,
                       [=] { softmax_fwd_sm90_kernel<BF, D, true>(tq, tk, tv, p); });
  }
  return emu::launch("softmax_fwd_sm90_kernel", grid, kSm90Threads, smem,
                     [=] { softmax_fwd_sm90_kernel<BF, D, false>(tq, tk, tv, p); });
}

template <bool BF, int D>
bool bwd_narrow(const CUtensorMap* m, const Sm90BwdParams& p, int B, bool atomic);

template <bool BF, int D>
bool bwd(const CUtensorMap* m, const Sm90BwdParams& p, int B, bool atomic) {
  const CUtensorMap m0 = m[0], m1 = m[1], m2 = m[2], m3 = m[3], m4 = m[4], m5 = m[5], m6 = m[6], m7 = m[7];
  if constexpr (D == kWideD) {  // launch_sm90_bwd's D = 256 branch (atomic does not apply)
    if (atomic) return fail("the D = 256 backward has no atomic dQ");
    const size_t wide = sm90_bwd_wide_smem_bytes();
    if (p.N > 0) {
      const dim3 grid{static_cast<unsigned>((p.N + kWideRows - 1) / kWideRows), static_cast<unsigned>(p.H),
                      static_cast<unsigned>(B)};
      if (!emu::launch("softmax_bwd_wide_sm90_kernel", grid, kSm90Threads, wide,
                       [=] { softmax_bwd_wide_sm90_kernel<BF, false>(m0, m1, m2, m3, p); }))
        return false;
    }
    if (p.M > 0) {
      const dim3 grid{static_cast<unsigned>((p.M + kWideRows - 1) / kWideRows), static_cast<unsigned>(p.Hk),
                      static_cast<unsigned>(B)};
      if (!emu::launch("softmax_bwd_wide_sm90_kernel", grid, kSm90Threads, wide,
                       [=] { softmax_bwd_wide_sm90_kernel<BF, true>(m4, m5, m6, m7, p); }))
        return false;
    }
    return true;
  } else {
    return bwd_narrow<BF, D>(m, p, B, atomic);
  }
}

template <bool BF, int D>
bool bwd_narrow(const CUtensorMap* m, const Sm90BwdParams& p, int B, bool atomic) {
  const size_t smem = sm90_bwd_smem_bytes<D>();
  const CUtensorMap m0 = m[0], m1 = m[1], m2 = m[2], m3 = m[3], m4 = m[4], m5 = m[5], m6 = m[6], m7 = m[7];
  if (atomic) {  // launch_sm90_bwd's atomic branch (p.dq_acc zeroed by the caller)
    if (p.M > 0) {
      const dim3 grid{static_cast<unsigned>((p.M + kBwdRows - 1) / kBwdRows), static_cast<unsigned>(p.Hk),
                      static_cast<unsigned>(B)};
      if (!emu::launch("softmax_bwd_dkdv_sm90_kernel", grid, kSm90Threads, sm90_bwd_smem_bytes<D, true>(),
                       [=] { softmax_bwd_dkdv_sm90_kernel<BF, D, true>(m4, m5, m6, m7, p); }))
        return false;
    }
    const int64_t n = static_cast<int64_t>(B) * p.H * p.N * D;
    if (n == 0) return true;
    return emu::launch("sm90_dq_convert_kernel", dim3{static_cast<unsigned>((n / 8 + 255) / 256), 1, 1}, 256, 0,
                       [=] { sm90_dq_convert_kernel<BF>(p.dq_acc, p.dq, n, p.scale); });
  }
  if (p.N > 0) {
    const dim3 grid{static_cast<unsigned>((p.N + kBwdRows - 1) / kBwdRows), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(B)};
    if (!emu::launch("softmax_bwd_dq_sm90_kernel", grid, kSm90Threads, smem,
                     [=] { softmax_bwd_dq_sm90_kernel<BF, D>(m0, m1, m2, m3, p); }))
      return false;
  }
  if (p.M > 0) {
    const dim3 grid{static_cast<unsigned>((p.M + kBwdRows - 1) / kBwdRows), static_cast<unsigned>(p.Hk),
                    static_cast<unsigned>(B)};
    if (!emu::launch("softmax_bwd_dkdv_sm90_kernel", grid, kSm90Threads, smem,
                     [=] { softmax_bwd_dkdv_sm90_kernel<BF, D>(m4, m5, m6, m7, p); }))
      return false;
  }
  return true;
}

template <class F>
bool dispatch(int bf16, int D, F&& f) {
#if defined(EMU_ONLY_F16_D64) && defined(EMU_ALSO_D256)
  if (bf16 || (D != 64 && D != 256))
    return fail("this build has only the fp16, D = 64 and 256 kernels (EMU_ONLY_F16_D64, EMU_ALSO_D256)");
  return D == 64 ? f(std::false_type{}, std::integral_constant<int, 64>{})
                 : f(std::false_type{}, std::integral_constant<int, 256>{});
#elif defined(EMU_ONLY_F16_D64)
  if (bf16 || D != 64) return fail("this build has only the fp16, D = 64 kernels (EMU_ONLY_F16_D64)");
  return f(std::false_type{}, std::integral_constant<int, 64>{});
#else
  if (D != 64 && D != 128 && D != 256) return fail("head dim " + std::to_string(D) + " not supported (64, 128, 256)");
  if (bf16) {
    return D == 64    ? f(std::true_type{}, std::integral_constant<int, 64>{})
           : D == 128 ? f(std::true_type{}, std::integral_constant<int, 128>{})
                      : f(std::true_type{}, std::integral_constant<int, 256>{});
  }
  return D == 64    ? f(std::false_type{}, std::integral_constant<int, 64>{})
         : D == 128 ? f(std::false_type{}, std::integral_constant<int, 128>{})
                    : f(std::false_type{}, std::integral_constant<int, 256>{});
#endif
}
}  // namespace

// The forward (softmax_fwd_cuda_sm90 after its checks: N, M > 0).  q [B, H, N, D], k and v
// [B, Hk, M, D] (element strides of dims 0-2, 0 where a dim has size 1); out contiguous
// [B, H, N, D], lse [B, H, N].  loop: 0 "simple", 1 the overlapped consumer loop (the default),
// 2 overlapped with the consumers' ping-pong, 3 overlapped on the persistent scheduler (2 blocks).
extern "C" int emu_softmax_sm90_fwd(int bf16, int D, int loop, const uint16_t* q, const int64_t* qs,
                                    const uint16_t* k, const int64_t* ks, const uint16_t* v, const int64_t* vs,
                                    uint16_t* out, float* lse, int B, int H, int Hk, int N, int M, float scale,
                                    int causal) {
  begin();
  CUtensorMap tq, tk, tv;
  const uint32_t block_n = D == 256 ? kFwdBlockN<256> : kFwdBlockN<128>;
  if (!make_map(tq, q, qs, B, H, N, D, kSm90BlockM) || !make_map(tk, k, ks, B, Hk, M, D, block_n) ||
      !make_map(tv, v, vs, B, Hk, M, D, block_n))
    return 1;
  Sm90FwdParams p;
  p.out = out;
  p.lse = lse;
  p.H = H;
  p.group = H / Hk;
  p.N = N;
  p.M = M;
  p.B = B;
  p.q_blocks = (N + kSm90BlockM - 1) / kSm90BlockM;
  p.scale_log2 = scale * kLog2e;
  p.causal = causal != 0;
  return dispatch(bf16, D, [&](auto bf, auto d) { return fwd<decltype(bf)::value, decltype(d)::value>(
                                                      tq, tk, tv, p, B, loop); })
             ? 0
             : 1;
}

// The backward (softmax_bwd_cuda_sm90): delta = rowsum(dO ∘ O) [B, H, N] given (softmax.cu's row
// kernel computes it on a GPU); dq [B, H, N, D], dk and dv [B, Hk, M, D] contiguous.  dq_acc:
// nullptr for the two kernels (dQ, dK / dV), else a zeroed float [B, H, N, D] for the kernel that
// adds dQ with atomics (ATTNKIT_CUDA_SM90=atomic).
extern "C" int emu_softmax_sm90_bwd(int bf16, int D, float* dq_acc, const uint16_t* dout, const int64_t* dos, const uint16_t* q,
                                    const int64_t* qs, const uint16_t* k, const int64_t* ks, const uint16_t* v,
                                    const int64_t* vs, const float* lse, const float* delta, uint16_t* dq,
                                    uint16_t* dk, uint16_t* dv, int B, int H, int Hk, int N, int M, float scale,
                                    int causal) {
  begin();
  CUtensorMap m[8];
  const uint32_t big = D == kWideD ? kWideRows : kBwdRows;
  if (!make_map(m[0], q, qs, B, H, N, D, big) || !make_map(m[1], dout, dos, B, H, N, D, big) ||
      !make_map(m[2], k, ks, B, Hk, M, D, kBwdStep) || !make_map(m[3], v, vs, B, Hk, M, D, kBwdStep) ||
      !make_map(m[4], k, ks, B, Hk, M, D, big) || !make_map(m[5], v, vs, B, Hk, M, D, big) ||
      !make_map(m[6], q, qs, B, H, N, D, kBwdStep) || !make_map(m[7], dout, dos, B, H, N, D, kBwdStep))
    return 1;
  Sm90BwdParams p;
  p.lse = lse;
  p.delta = delta;
  p.dq = dq;
  p.dq_acc = dq_acc;
  p.dk = dk;
  p.dv = dv;
  p.H = H;
  p.Hk = Hk;
  p.group = H / Hk;
  p.N = N;
  p.M = M;
  p.scale = scale;
  p.scale_log2 = scale * kLog2e;
  p.causal = causal != 0;
  return dispatch(bf16, D, [&](auto bf, auto d) { return bwd<decltype(bf)::value, decltype(d)::value>(m, p, B, dq_acc != nullptr); })
             ? 0
             : 1;
}

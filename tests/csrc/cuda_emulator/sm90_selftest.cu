// Self-test kernels for the emulator's Hopper models (harness_sm90.h), run by
// tests/csrc/test_sm90_emulated.py through sm90_selftest_harness.cpp: TMA loads (swizzle, zero
// fill, checks), an mbarrier ring between a producer and consumer warpgroups, wgmma (SS and RS,
// K-major and MN-major B) on TMA-loaded 128-byte-swizzled tiles.  Real CUDA (sm_90a), written
// with csrc/cuda/sm90_ptx.cuh as the project's kernels use it; not project kernels.  `kind`
// selects a deliberate bug (0: none) that the test must see caught.
#include "../../../csrc/cuda/sm90_ptx.cuh"

namespace attnkit {
namespace {

// ---------------------------------------------------------------------------------------------
// 1. TMA: `n` boxes of a 4D tensor, each into its own slot (1024-byte aligned) of shared memory,
//    all completing on one mbarrier; then the slots' raw bytes go to `out`.
// ---------------------------------------------------------------------------------------------

constexpr int kTmaThreads = 128;
constexpr int kMaxBoxes = 8;

struct TmaArgs {
  int coords[kMaxBoxes][4];
  int n;               // boxes
  int slot;            // bytes per slot (a multiple of 1024)
  uint32_t box_bytes;  // bytes of one box
  uint16_t* out;       // n * slot / 2
  // 0: right; 1: no mbar_wait; 2: expect_tx 2 bytes short; 3: expect_tx 2 bytes over; 4: the
  // destination 128 bytes off its 1024-byte alignment; 5: the mbarrier never initialized;
  // 6: waits for parity 1 (a fresh barrier's "previous phase": returns at once); 7: a second
  // arrival on the count-1 barrier while its phase waits for the loads' bytes; 8: no
  // fence.proxy.async after mbarrier.init.
  int kind;
};

__global__ void tma_probe_kernel(const __grid_constant__ CUtensorMap tm, const TmaArgs a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem_raw);
  unsigned char* slots = smem_raw + 1024;
  if (threadIdx.x == 0 && a.kind != 5) {
    mbar_init(bar, 1);
    if (a.kind != 8) fence_proxy_async();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t expect = a.box_bytes * a.n;
    if (a.kind == 2) expect -= 2;
    if (a.kind == 3) expect += 2;
    mbar_arrive_expect_tx(bar, expect);
    for (int i = 0; i < a.n; ++i)
      tma_load_4d(slots + i * a.slot + (a.kind == 4 ? 128 : 0), &tm, a.coords[i][0], a.coords[i][1], a.coords[i][2],
                  a.coords[i][3], bar);
  }
  if (a.kind == 7 && threadIdx.x == 0) mbar_arrive(bar);
  if (a.kind == 6) {
    mbar_wait(bar, 1);
  } else if (a.kind != 1) {
    mbar_wait(bar, 0);
  }
  const uint16_t* s = reinterpret_cast<const uint16_t*>(slots);
  for (int i = threadIdx.x; i < a.n * a.slot / 2; i += kTmaThreads) a.out[i] = s[i];
}

// ---------------------------------------------------------------------------------------------
// 2. An mbarrier ring: warpgroup 0 (one thread) loads `tiles` tiles of 64 x 64 16-bit elements
//    (128-byte swizzle) through kStages stages; warpgroups 1 and 2 (256 threads) wait for each,
//    read it (undoing the swizzle), release the stage.
// ---------------------------------------------------------------------------------------------

constexpr int kRingThreads = 384;
constexpr int kStages = 2;
constexpr int kTileBytes = 64 * 128;

struct RingArgs {
  int tiles;
  uint16_t* out;  // tiles x 64 x 64, as the consumers read them
  // 0: right; 1: the producer does not wait for a free stage; 2: the consumers wait for the
  // wrong parity of the full barriers (the first wait returns at once).
  int kind;
};

// Element (r, c) of a 128-byte-swizzled tile of 64-element rows (sm90_ptx.cuh's header comment).
__device__ __forceinline__ int sw128(int r, int c) { return r * 64 + ((((c * 2) / 16) ^ (r % 8)) * 16 + (c * 2) % 16) / 2; }

__global__ void __launch_bounds__(kRingThreads, 1) ring_kernel(const __grid_constant__ CUtensorMap tm, const RingArgs a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw);
  uint64_t* empty = full + kStages;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 256);
    }
    fence_proxy_async();
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      for (int i = 0; i < a.tiles; ++i) {
        const int s = i % kStages, n = i / kStages;
        if (a.kind != 1) mbar_wait(&empty[s], (n & 1) ^ 1);  // use n of stage s: its release n - 1
        mbar_arrive_expect_tx(&full[s], kTileBytes);
        tma_load_4d(smem_raw + 1024 + s * kTileBytes, &tm, 0, 64 * i, 0, 0, &full[s]);
      }
    }
  } else {
    setmaxnreg_inc<232>();
    const int c = threadIdx.x - 128;
    for (int i = 0; i < a.tiles; ++i) {
      const int s = i % kStages, n = i / kStages;
      mbar_wait(&full[s], a.kind == 2 ? (n & 1) ^ 1 : n & 1);
      const uint16_t* tile = reinterpret_cast<const uint16_t*>(smem_raw + 1024 + s * kTileBytes);
      for (int e = 0; e < 16; ++e) {
        const int idx = c * 16 + e, r = idx / 64, col = idx % 64;
        a.out[(i * 64 + r) * 64 + col] = tile[sw128(r, col)];
      }
      mbar_arrive(&empty[s]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. wgmma: D (128 x kN, fp32) = A (128 x kK) B (kK x kN).  Warpgroup 0 (one thread) TMA-loads A
//    (4 boxes of 64 x 64: rows 64c.., k-panel p) and B (K-major: kK / 64 boxes of kN rows x 64 k,
//    from Bᵀ; MN-major: kN / 64 panels of 64 n x kK rows, from B), all 128-byte swizzled, on one
//    mbarrier; warpgroup 1 + c computes rows 64c .. 64c + 63 in kK / 16 k-steps: A by descriptor
//    (SS) or from registers loaded from global memory (RS), B by descriptor.
// ---------------------------------------------------------------------------------------------

constexpr int kMmaThreads = 384;
constexpr int kK = 128;
constexpr int kAOff = 1024;                       // A tile (c, p) at kAOff + (2c + p) * 8192
constexpr int kBOff = kAOff + 4 * 64 * 128;       // K-major: panel p at kBOff + p * kN * 128;
constexpr int kPanelStride = kK * 128;            // MN-major: n-panel q at kBOff + q * kPanelStride
template <int kN>
constexpr int kMmaSmemBytes = kBOff + kK * kN * 2;

struct MmaArgs {
  int rs;              // A from registers
  const uint16_t* a;   // 128 x kK, row-major (RS)
  float* d;            // 128 x kN
  // 0: right; 1: the accumulators read before wgmma_wait; 2: one commit group per k-step and
  // wgmma_wait<1> before the read; 3: warp 0 of each consumer warpgroup commits instead of its
  // first wgmma (divergent); 4: lane 5 passes another B descriptor (non-uniform); 5: no
  // wgmma_fence; 6: no mbar_wait before the wgmmas; 7 (RS): A registers changed before the wait.
  int kind;
};

template <bool kBF16, int kN, int kTransB>
__global__ void __launch_bounds__(kMmaThreads, 1)
    mma_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b, const MmaArgs a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw);
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    mbar_init(full, 1);
    fence_proxy_async();
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      mbar_arrive_expect_tx(full, (a.rs ? 0 : 4 * 64 * 128) + kK * kN * 2);
      if (!a.rs) {
        for (int c = 0; c < 2; ++c)
          for (int p = 0; p < 2; ++p) tma_load_4d(smem_raw + kAOff + (2 * c + p) * 8192, &tm_a, 64 * p, 64 * c, 0, 0, full);
      }
      if (kTransB) {
        for (int q = 0; q < kN / 64; ++q) tma_load_4d(smem_raw + kBOff + q * kPanelStride, &tm_b, 64 * q, 0, 0, 0, full);
      } else {
        for (int p = 0; p < kK / 64; ++p) tma_load_4d(smem_raw + kBOff + p * kN * 128, &tm_b, 64 * p, 0, 0, 0, full);
      }
    }
    return;
  }
  setmaxnreg_inc<232>();
  const int c = wg - 1, t = threadIdx.x % 128, w = t / 32, g = (t % 32) / 4, q = t % 4;
  float acc[kN / 8][4];
  for (int j = 0; j < kN / 8; ++j)
    for (int e = 0; e < 4; ++e) acc[j][e] = __uint_as_float(0x7fc00000u);  // NaN: scale-d 0 must ignore it
  uint32_t afrag[kK / 16][4];
  if (a.rs) {
    for (int kk = 0; kk < kK / 16; ++kk)
      for (int r = 0; r < 4; ++r) {
        const int row = 64 * c + 16 * w + g + 8 * (r % 2), col = 16 * kk + 2 * q + 8 * (r / 2);
        afrag[kk][r] = uint32_t(a.a[row * kK + col]) | (uint32_t(a.a[row * kK + col + 1]) << 16);
      }
  }
  if (a.kind != 6) mbar_wait(full, 0);
  if (a.kind != 5) wgmma_fence();
  for (int kk = 0; kk < kK / 16; ++kk) {
    const int p = kk / 4, within = (kk % 4) * 32;
    const uint64_t desc_a = smem_desc_sw128(smem_raw + kAOff + (2 * c + p) * 8192 + within, 16, 1024);
    uint64_t desc_b = kTransB ? smem_desc_sw128(smem_raw + kBOff + kk * 16 * 128, kPanelStride, 1024)
                              : smem_desc_sw128(smem_raw + kBOff + p * kN * 128 + within, 16, 1024);
    if (a.kind == 4 && t % 32 == 5) desc_b += 1;
    if (a.kind == 3 && kk == 0 && w == 0) {
      wgmma_commit();
      continue;
    }
    if (a.rs) {
      wgmma_rs<kBF16, kN, kTransB>(acc, afrag[kk], desc_b, kk > 0);
    } else {
      wgmma_ss<kBF16, kN, kTransB>(acc, desc_a, desc_b, kk > 0);
    }
    if (a.kind == 2) wgmma_commit();
  }
  if (a.kind != 2) wgmma_commit();
  if (a.kind == 7) afrag[kK / 16 - 1][3] ^= 1u;
  if (a.kind == 2) {
    wgmma_wait<1>();
  } else if (a.kind != 1) {
    wgmma_wait<0>();
  }
  acc_fence(acc);
  for (int j = 0; j < kN / 8; ++j)
    for (int e = 0; e < 4; ++e)
      a.d[(64 * c + 16 * w + g + 8 * (e / 2)) * kN + 8 * j + 2 * q + e % 2] = acc[j][e];
  if (a.kind == 1 || a.kind == 2) wgmma_wait<0>();
}

// ---------------------------------------------------------------------------------------------
// 4. A ring read by wgmma: warpgroup 0 (one thread) TMA-loads `tiles` tiles Bᵀ_i (64 n x 64 k,
//    K-major, 128-byte swizzle) through kStages stages; warpgroup 1 accumulates D (64 x 64) +=
//    A B_i with A (64 x 64) from registers, then releases the stage.  The wgmma reads the stage
//    until its wgmma_wait: releasing the stage before that wait lets the producer's next load
//    overwrite it under the running product (the emulator's release-first rule shows it).
// ---------------------------------------------------------------------------------------------

constexpr int kWgRingThreads = 256;

struct WgRingArgs {
  int tiles;
  const uint16_t* a;  // 64 x 64, row-major
  float* d;           // 64 x 64
  int kind;           // 0: right; 1: the stage released before wgmma_commit / wgmma_wait
};

__global__ void __launch_bounds__(kWgRingThreads, 1)
    wgmma_ring_kernel(const __grid_constant__ CUtensorMap tm_b, const WgRingArgs a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw);
  uint64_t* empty = full + kStages;
  unsigned char* tiles = smem_raw + 1024;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 128);
    }
    fence_proxy_async();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < a.tiles; ++i) {
        const int s = i % kStages, n = i / kStages;
        mbar_wait(&empty[s], (n & 1) ^ 1);
        mbar_arrive_expect_tx(&full[s], kTileBytes);
        tma_load_4d(tiles + s * kTileBytes, &tm_b, 0, 64 * i, 0, 0, &full[s]);
      }
    }
    return;
  }
  const int t = threadIdx.x - 128, w = t / 32, g = (t % 32) / 4, q = t % 4;
  uint32_t afrag[4][4];
  for (int kk = 0; kk < 4; ++kk)
    for (int r = 0; r < 4; ++r) {
      const int row = 16 * w + g + 8 * (r % 2), col = 16 * kk + 2 * q + 8 * (r / 2);
      afrag[kk][r] = uint32_t(a.a[row * 64 + col]) | (uint32_t(a.a[row * 64 + col + 1]) << 16);
    }
  float acc[8][4];
  for (int i = 0; i < a.tiles; ++i) {
    const int s = i % kStages, n = i / kStages;
    mbar_wait(&full[s], n & 1);
    wgmma_fence();
    for (int kk = 0; kk < 4; ++kk)
      wgmma_rs<true, 64, 0>(acc, afrag[kk], smem_desc_sw128(tiles + s * kTileBytes + kk * 32, 16, 1024),
                            i > 0 || kk > 0);
    if (a.kind == 1) mbar_arrive(&empty[s]);
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(acc);
    acc_fence(afrag);
    if (a.kind != 1) mbar_arrive(&empty[s]);
  }
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) a.d[(16 * w + g + 8 * (e / 2)) * 64 + 8 * j + 2 * q + e % 2] = acc[j][e];
}

// ---------------------------------------------------------------------------------------------
// 5. Named barriers: a ping-pong between warpgroups A (0) and B (1).  Round r: A updates every
//    element of a shared array (x -> 3x + r + 1), arrives on barrier 1 and syncs on barrier 2;
//    B syncs on barrier 1, updates (x -> 5x + 2r + 7), arrives on barrier 2.  Only the order
//    A0 B0 A1 B1 ... gives the expected values.
// ---------------------------------------------------------------------------------------------

constexpr int kPingThreads = 256;

struct PingArgs {
  int rounds;
  uint32_t* out;  // 128
  // 0: right; 1: no named barriers (each warp runs all its rounds at once); 2: A's last arrival
  // on barrier 1 missing; 3: B syncs on barrier 1 with count 224 (A arrives with 256); 4: count 100 (not a multiple of
  // 32); 5: barrier id 0; 6: lane 7 of B's warps arrives on barrier 3 instead of 2.
  int kind;
};

__global__ void __launch_bounds__(kPingThreads, 1) pingpong_kernel(const PingArgs a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t* x = reinterpret_cast<uint32_t*>(smem_raw);
  const int t = threadIdx.x % 128;
  if (threadIdx.x < 128) x[t] = t;
  __syncthreads();
  if (threadIdx.x < 128) {
    for (int r = 0; r < a.rounds; ++r) {
      x[t] = 3 * x[t] + r + 1;
      if (a.kind == 1) continue;
      if (!(a.kind == 2 && r == a.rounds - 1)) named_bar_arrive(a.kind == 5 ? 0 : 1, 256);
      named_bar_sync(2, 256);
    }
    a.out[t] = x[t];
  } else {
    for (int r = 0; r < a.rounds; ++r) {
      if (a.kind != 1) named_bar_sync(1, a.kind == 3 ? 224 : a.kind == 4 ? 100 : 256);
      x[t] = 5 * x[t] + 2 * r + 7;
      if (a.kind != 1) named_bar_arrive(a.kind == 6 && t % 32 == 7 ? 3 : 2, 256);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// host side (the extraction ends above it; sm90_selftest_harness.cpp launches the kernels)

}  // namespace
}  // namespace attnkit

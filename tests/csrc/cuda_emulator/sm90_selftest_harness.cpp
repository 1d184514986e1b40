// Launches of sm90_selftest.cu's kernels (the emulator's Hopper self-test), for
// tests/csrc/test_sm90_emulated.py.  Also the example of a Hopper kernel's harness: tensor maps
// made with emu_make_tensor_map_4d from the parameters the host side gives cuTensorMapEncodeTiled,
// passed by value as the kernels' `const __grid_constant__ CUtensorMap` parameters.
//   g++ -std=c++20 -O1 -fno-strict-aliasing -shared -fPIC -I<dir of sm90_kernels.inc> sm90_selftest_harness.cpp
#define EMU_CORE_ONLY
#include "harness.cpp"

#include "sm90_kernels.inc"

namespace {
using namespace attnkit;

void begin() {
  emu::S.failed = false;
  emu::S.error.clear();
}

// A 2D map (dims 2 and 3 of size 1) over a row-major [rows, cols] 16-bit matrix.
bool matrix_map(CUtensorMap& tm, const uint16_t* p, uint64_t cols, uint64_t rows, uint32_t box_cols,
                uint32_t box_rows) {
  const uint64_t dims[4] = {cols, rows, 1, 1};
  const uint64_t strides[3] = {cols * 2, cols * rows * 2, cols * rows * 2};
  const uint32_t box[4] = {box_cols, box_rows, 1, 1};
  return emu_make_tensor_map_4d(&tm, p, 2, dims, strides, box, 3) == 0;
}

template <bool BF, int N, int TR>
bool mma(const CUtensorMap& ta, const CUtensorMap& tb, const MmaArgs& a) {
  return emu::launch("mma_kernel", dim3{1, 1, 1}, kMmaThreads, kMmaSmemBytes<N>,
                     [ta, tb, a] { mma_kernel<BF, N, TR>(ta, tb, a); });
}
}  // namespace

// TMA: n (<= 8) boxes of the 16-bit tensor at base (dims innermost first, strides of dims 1..3 in
// bytes, box, swizzle 0 / 3) at coords[n][4], each into a `slot`-byte slot; out gets the slots.
extern "C" int emu_sm90_tma(const void* base, const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                            int swizzle, const int* coords, int n, int slot, uint16_t* out, int kind) {
  begin();
  CUtensorMap tm;
  if (emu_make_tensor_map_4d(&tm, base, 2, dims, strides, box, swizzle) != 0 || n > kMaxBoxes) return 1;
  TmaArgs a{};
  for (int i = 0; i < n; ++i)
    for (int d = 0; d < 4; ++d) a.coords[i][d] = coords[4 * i + d];
  a.n = n, a.slot = slot, a.out = out, a.kind = kind;
  a.box_bytes = box[0] * box[1] * box[2] * box[3] * 2;
  return emu::launch("tma_probe_kernel", dim3{1, 1, 1}, kTmaThreads, 1024 + static_cast<size_t>(n) * slot,
                     [tm, a] { tma_probe_kernel(tm, a); })
             ? 0
             : 1;
}

// The ring: src is tiles x 64 x 64 (16-bit), out the same as the consumers read it.
extern "C" int emu_sm90_ring(const uint16_t* src, int tiles, uint16_t* out, int kind) {
  begin();
  CUtensorMap tm;
  if (!matrix_map(tm, src, 64, 64 * static_cast<uint64_t>(tiles), 64, 64)) return 1;
  RingArgs a{tiles, out, kind};
  return emu::launch("ring_kernel", dim3{1, 1, 1}, kRingThreads, 1024 + kStages * kTileBytes,
                     [tm, a] { ring_kernel(tm, a); })
             ? 0
             : 1;
}

// wgmma: d (128 x n fp32) = a (128 x 128) b; b_given is Bᵀ (n x 128, K-major) for trans 0, B
// (128 x n, MN-major) for trans 1.  rs: A from registers (read from a) instead of by descriptor.
extern "C" int emu_sm90_mma(int bf16, int n, int trans, int rs, const uint16_t* a, const uint16_t* b_given, float* d,
                            int kind) {
  begin();
  CUtensorMap ta, tb;
  if (!matrix_map(ta, a, kK, 128, 64, 64)) return 1;
  if (!(trans ? matrix_map(tb, b_given, n, kK, 64, kK) : matrix_map(tb, b_given, kK, n, 64, n))) return 1;
  const MmaArgs args{rs, a, d, kind};
  const int which = (bf16 ? 4 : 0) + (n == 128 ? 2 : 0) + (trans ? 1 : 0);
  switch (which) {
    case 0: return mma<false, 64, 0>(ta, tb, args) ? 0 : 1;
    case 1: return mma<false, 64, 1>(ta, tb, args) ? 0 : 1;
    case 2: return mma<false, 128, 0>(ta, tb, args) ? 0 : 1;
    case 3: return mma<false, 128, 1>(ta, tb, args) ? 0 : 1;
    case 4: return mma<true, 64, 0>(ta, tb, args) ? 0 : 1;
    case 5: return mma<true, 64, 1>(ta, tb, args) ? 0 : 1;
    case 6: return mma<true, 128, 0>(ta, tb, args) ? 0 : 1;
    default: return mma<true, 128, 1>(ta, tb, args) ? 0 : 1;
  }
}

// The wgmma ring: a (64 x 64 bf16, row-major), bt (tiles x 64 x 64 bf16: Bᵀ_i, K-major), d (64 x 64
// fp32) = a (B_0 + .. + B_{tiles-1}) accumulated tile by tile.
extern "C" int emu_sm90_wgmma_ring(const uint16_t* a, const uint16_t* bt, int tiles, float* d, int kind) {
  begin();
  CUtensorMap tm;
  if (!matrix_map(tm, bt, 64, 64 * static_cast<uint64_t>(tiles), 64, 64)) return 1;
  const WgRingArgs args{tiles, a, d, kind};
  return emu::launch("wgmma_ring_kernel", dim3{1, 1, 1}, kWgRingThreads, 1024 + kStages * kTileBytes,
                     [tm, args] { wgmma_ring_kernel(tm, args); })
             ? 0
             : 1;
}

// The named-barrier ping-pong: out (128 uint32) after `rounds` rounds.
extern "C" int emu_sm90_pingpong(int rounds, uint32_t* out, int kind) {
  begin();
  const PingArgs args{rounds, out, kind};
  return emu::launch("pingpong_kernel", dim3{1, 1, 1}, kPingThreads, 1024, [args] { pingpong_kernel(args); }) ? 0
                                                                                                               : 1;
}

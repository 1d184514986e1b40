// The Hopper (sm_90a) models of csrc/cuda/sm90_ptx.cuh's PTX helpers, included by harness.cpp
// (README.md, "Hopper: TMA, mbarriers, wgmma").  extract.py removes the helpers from the device
// code after checking their exact asm text; these functions replace them, with the same
// signatures.  What each models (PTX ISA 8.x; CUTLASS cute/arch/mma_sm90_desc.hpp,
// cute/atom/mma_traits_sm90_gmma.hpp, cute/arch/copy_sm90_tma.hpp spell the same):
//
// Shared window.  __cvta_generic_to_shared gives the 32-bit shared-window address of a pointer
// into the block's shared memory: window_base (1024 unless emu_set_shared_window_base) + its byte
// offset.  Swizzles and descriptors work on these addresses, as the hardware does.
//
// mbarrier (a 64-bit object in shared memory; its state is kept here, its 8 bytes hold a tag
// that every operation checks, so an overwritten or never-initialized barrier is an error):
//   init(count): pending arrivals = count, tx-count = 0, phase 0.  arrive: pending - 1.
//   arrive.expect_tx(bytes): tx-count + bytes, then arrive.  A TMA load completing: tx-count -
//   its bytes (tx-count may go below 0 while arrivals are pending, as the ISA allows).  The phase
//   completes when pending == 0 and tx-count == 0: the phase number goes up by one, pending =
//   count.  try_wait.parity(P) is true once the phase of parity P has completed, i.e. while the
//   current phase's parity differs from P (a fresh barrier is in phase 0: waiting for parity 1
//   returns at once).  mbar_wait loops on it: a thread that cannot go on blocks until the
//   barrier's phase moves.  Errors: an operation on an uninitialized (or overwritten) barrier, an
//   arrival when none is pending (more arrivals than the count in a phase), tx-count below 0 when
//   the phase's last arrival has come (more bytes completed than expected), count or tx-count out
//   of the ISA's range.
//
// cp.async.bulk.tensor.4d...mbarrier::complete_tx::bytes (tma_load_4d): the tensor map is the
// emulator's own encoding (emu_make_tensor_map_4d, with cuTensorMapEncodeTiled's parameters and
// checks).  The box at (c0, .. c3) is read from global memory at the issue (every element checked
// against the allocation holding the map's base address; elements outside the tensor, negative
// coordinates included, are zeros), laid out densely in shared memory (box element (i0, .., i3) at
// byte ((i3 b2 + i2) b1 + i1) b0 e + i0 e), with the 128-byte swizzle on the absolute shared
// address: the 16-byte chunk bits 4-6 XOR bits 7-9.  The destination is NaN-filled (0xff bytes) at
// the issue and the box lands -- bytes written, box bytes completed on the mbarrier -- AS LATE AS
// POSSIBLE: when a thread waits on that mbarrier and would otherwise block, or when every thread
// of the block is blocked (before calling it a deadlock).  So a read without the wait reads NaN.
// Checks: destination in shared memory, 128-byte aligned (1024 with the 128-byte swizzle), box
// inside it; source global.
//
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} (wgmma_ss, wgmma_rs), N = 64 or 128:
// a collective of the 128 threads of a warpgroup (warps 4w .. 4w+3); all must issue the same op
// with the same descriptors and scale-d.  Thread t = 32 w' + 4 g + q (w' = warp % 4):
//   D (64 x N fp32): d[j][e] = D[16 w' + g + 8 (e / 2)][8 j + 2 q + e % 2]   (CLayout_64xN)
//   A from registers (RS): a[r] holds A[16 w' + g + 8 (r % 2)][2 q + 8 (r / 2) + {0, 1}], low
//   half first                                                                 (ALayout_64x16)
//   A, B from shared memory by descriptor: start = bits 0-13 << 4, LBO = bits 16-29 << 4, SBO =
//   bits 32-45 << 4, base offset bits 49-51 (must be 0), layout bits 62-63 (must be 1: 128-byte
//   swizzle).  Element (mn, k) of a K-major operand (A always; B with imm-trans-b 0) is at
//   start + (mn % 8) 128 + (mn / 8) SBO + 2 k (LBO unused); of an MN-major B (imm-trans-b 1) at
//   start + 2 (mn % 64) + (mn / 64) LBO + (k % 8) 128 + (k / 8) SBO; then the 128-byte swizzle on
//   that absolute address (so a start moved by 32 bytes per k-step inside a row is right).
//   D = A B + (scale-d ? D : 0): fp32 products of the 16-bit operands (exact), summed in fp32 in
//   k order onto C.  Asynchrony, as late as the ISA allows: the op is computed at the
//   wgmma.wait_group that covers its commit group, reading shared memory then; the accumulators
//   are NaN from the issue until then (a read before the wait reads NaN; a write before it is
//   lost); chained ops on the same accumulators pass their results along.  RS: the A registers
//   are read at the issue and must still hold the same values at the wait (the ISA: accessing
//   them before the wait is undefined).  A wgmma needs a wgmma.fence of its warpgroup since the
//   warpgroup's last wait_group (the ISA requires it before the first wgmma and between register
//   accesses and a wgmma).
// wgmma.fence / commit_group / wait_group N, setmaxnreg.{inc,dec} R: warpgroup collectives
//   (.sync.aligned: all 128 threads, the same instruction).  commit_group closes the warpgroup's
//   ops issued since the last one into a group; wait_group N computes every op of the groups
//   older than the N most recent (ops not yet committed are never covered).  setmaxnreg: R in
//   [24, 256], a multiple of 8 (checked at compile time); otherwise no-op.
// fence.proxy.async: makes the mbarriers its thread initialized usable by TMA loads (a load
//   completing on a barrier whose initializing thread has not run one since is an error: the
//   CUDA programming guide's pattern is mbarrier.init, fence.proxy.async.shared::cta,
//   __syncthreads); otherwise a no-op: ordinary stores that wgmma reads are not tracked.
// acc_fence: a no-op (no compiler reordering here).
// bar.sync / bar.arrive id, count (named_bar_sync / named_bar_arrive; PTX ISA "bar, barrier"):
//   barriers 1 .. 15 of the block; a warp collective (.aligned: all 32 lanes, the same barrier and
//   count), the warp's arrival counting 32 threads; a use completes when `count` threads (a
//   positive multiple of 32, at most the block) have arrived, and the barrier is reusable at once;
//   bar.sync blocks until the use its warp arrived in has completed, bar.arrive does not.  Errors:
//   barrier 0 (__syncthreads'), a bad count, different counts within one use.
// The release-first rule (harness.cpp's run_released_first): the thread whose arrival completes an
//   mbarrier phase (mbarrier.arrive[.expect_tx]) or a named barrier's use steps aside, and the
//   threads waiting for that completion run first, as far as they get; then it goes on.  A GPU may
//   run them before the releaser's next instruction: so whatever the releaser still does with what
//   it released (a wgmma not yet waited for, reading a released ring stage) happens after them
//   (the producer's next TMA load NaN-fills that stage first).
// Fault hooks (emu_configure): 3 = TMA ignores the swizzle, 4 = wgmma reads B with imm-trans-b
// flipped, 5 = wgmma swaps the accumulator rows g and g + 8, 6 = the release-first rule off.
#pragma once

#define __grid_constant__

// <cuda.h>'s opaque tensor map: 128 bytes, 64-byte aligned (a kernel takes it as a
// `const __grid_constant__ CUtensorMap` parameter); here it holds emu::sm90::TensorMap.
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};

namespace emu {
namespace sm90 {

constexpr uint64_t kMbarTag = 0x6d62617200000000ull;  // "mbar" in the high half, the index in the low
constexpr int64_t kMaxCount = (1 << 20) - 1;          // arrival count and tx-count limit (PTX ISA)
constexpr uint64_t kMapMagic = 0x656d752d746d6170ull;  // "emu-tmap"

struct MBar {
  size_t off = 0;        // byte offset in the block's shared memory
  uint32_t count = 0;    // arrivals per phase
  int64_t pending = 0;   // arrivals still expected in the current phase
  int64_t tx = 0;        // transaction bytes expected minus completed in the current phase
  uint64_t phase = 0;    // phases completed (the current one's parity: phase & 1)
  Barrier done;          // its generation moves on at each phase completion; waiters block on it
  unsigned init_thread = 0;    // the thread that initialized it ...
  bool async_visible = false;  // ... and has since run fence.proxy.async (TMA may complete on it)
};

// The emulator's tensor map, in the bytes of a CUtensorMap.
struct TensorMap {
  uint64_t magic;
  uintptr_t base;
  uint32_t elem_bytes, swizzle;  // swizzle: 0 none, 3 = CU_TENSOR_MAP_SWIZZLE_128B
  uint64_t dims[4];              // innermost first
  uint64_t strides[4];           // bytes; strides[0] = elem_bytes
  uint32_t box[4];
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "the tensor map must fit in a CUtensorMap");

// A TMA load in flight: its box as it will land (swizzled, zero-filled), read at the issue.
struct TmaLoad {
  size_t dst;       // shared byte offset of the box
  size_t bar;       // shared byte offset of its mbarrier
  unsigned issuer;  // thread
  std::vector<unsigned char> bytes;
};

// One wgmma.mma_async of a warpgroup, issued, not yet computed.
struct WgOp {
  int n = 0;
  bool bf16 = false, rs = false, trans = false;
  uint64_t desc_a = 0, desc_b = 0, group = 0;
  int scale_d = 0;
  float* d[128];               // each thread's accumulators (n / 2 floats)
  const uint32_t* a_ptr[128];  // RS: each thread's A registers ...
  uint32_t a[128][4];          // ... as read at the issue
  std::vector<float> c;        // 128 x n / 2: C as of the issue, or the previous op's D (chained)
  bool chained = false;        // c is still to come from the pending op before it on the same d
  bool feeds = false;          // a later pending op takes its D as C: not written to d
};

// One warpgroup collective's inputs (two alternate by generation, as a warp's Exchange).
struct WgExchange {
  int kind[128];
  const char* what[128];
  float* d[128];
  const uint32_t* a[128];
  uint64_t desc_a[128], desc_b[128];
  int scale_d[128];
};

struct Warpgroup {
  Barrier bar;
  WgExchange ex[2];
  std::deque<WgOp> ops;  // issue order
  uint64_t committed = 0;
  bool fenced = false;
};

// A named barrier (bar.sync / bar.arrive id, count): bar.generation moves on at each completion;
// bar.arrived counts the threads (32 per warp) of the current use, bar.expected its thread count.
constexpr int kNamedBarriers = 16;

struct State {
  std::deque<MBar> mbars;  // stable addresses: waiters point at `done`
  std::vector<TmaLoad> loads;
  std::vector<Warpgroup> wgs;
  Barrier named[kNamedBarriers];
  std::vector<unsigned> named_released;  // the threads the last completing warp released
  uint32_t window_base = 1024;
};
State T;

void begin_block(unsigned threads) {
  T.mbars.clear();
  T.loads.clear();
  T.wgs.assign((threads + 127) / 128, Warpgroup{});
  for (auto& g : T.wgs) g.bar = Barrier{128, 0, 0};
  for (auto& b : T.named) b = Barrier{};
}

// "0-127, 130": thread indices as ranges.
inline std::string ranges(const std::vector<unsigned>& tids) {
  std::string out;
  for (size_t i = 0; i < tids.size();) {
    size_t j = i;
    while (j + 1 < tids.size() && tids[j + 1] == tids[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(tids[i]) + (j > i ? "-" + std::to_string(tids[j]) : "");
    i = j + 1;
  }
  return out;
}

// For a deadlock message: the named barriers with a use in progress, and the mbarriers that
// threads wait on, with their state and who waits.
std::string blocked_detail() {
  std::string out;
  char buf[200];
  for (int id = 0; id < kNamedBarriers; ++id) {
    const Barrier& b = T.named[id];
    const std::vector<unsigned> w = waiters(b, b.generation);
    if (b.arrived == 0 && w.empty()) continue;
    std::snprintf(buf, sizeof buf, "%snamed barrier %d: %d of %d threads arrived", out.empty() ? "" : "; ", id,
                  b.arrived, b.expected);
    out += buf + (w.empty() ? std::string() : ", threads " + ranges(w) + " wait at bar.sync " + std::to_string(id));
  }
  for (const MBar& m : T.mbars) {
    const std::vector<unsigned> w = waiters(m.done, m.done.generation);
    if (w.empty()) continue;
    std::snprintf(buf, sizeof buf,
                  "%smbarrier at shared byte offset %zu (phase %llu, %lld of %u arrivals and %lld transaction bytes "
                  "pending): threads ",
                  out.empty() ? "" : "; ", m.off, static_cast<unsigned long long>(m.phase),
                  static_cast<long long>(m.pending), m.count, static_cast<long long>(m.tx));
    out += buf + ranges(w) + " wait";
  }
  return out.empty() ? out : " (" + out + ")";
}

// An error found by the emulator's own code: in a kernel thread, the launch's error (the thread
// is parked); at a scheduler point (a TMA landing while every thread waits), recorded.
[[gnu::format(printf, 1, 2)]] inline void report(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  if (S.in_fiber) fail("%s", buf);
  if (!S.failed) {
    S.failed = true;
    S.error = std::string(buf) + " (while every thread of block (" + std::to_string(blockIdx.x) + ", " +
              std::to_string(blockIdx.y) + ", " + std::to_string(blockIdx.z) + ")" +
              (S.kernel ? std::string(" of ") + S.kernel : std::string()) + " waited)";
  }
}

// The shared byte offset of `bytes` at p, which must lie in the block's shared memory, with its
// shared-window address `align`-byte aligned.
template <class U>
size_t shared_offset(const ptr<U>& p, size_t bytes, size_t align, const char* what) {
  if (p.alloc() != &S.shared) fail("%s not in shared memory (it points into %s)", what, p.alloc()->name.c_str());
  const intptr_t off = reinterpret_cast<intptr_t>(p.get()) - reinterpret_cast<intptr_t>(S.smem);
  if (off < 0 || static_cast<size_t>(off) + bytes > S.smem_bytes)
    fail("%s: bytes [%td, %td) outside the block's %zu bytes of shared memory", what, off,
         off + static_cast<intptr_t>(bytes), S.smem_bytes);
  if ((T.window_base + static_cast<size_t>(off)) % align != 0)
    fail("%s: shared address %#zx (byte offset %td) not %zu-byte aligned", what, T.window_base + static_cast<size_t>(off),
         off, align);
  ++S.shared.accesses;
  return static_cast<size_t>(off);
}

// ---------------------------------------------------------------------------------------------
// mbarrier
// ---------------------------------------------------------------------------------------------

// The barrier whose tag is at shared byte offset `off`, or null.
inline MBar* mbar_at(size_t off) {
  uint64_t v;
  std::memcpy(&v, reinterpret_cast<unsigned char*>(S.smem) + off, 8);
  const uint64_t i = v & 0xffffffffu;
  if ((v & ~uint64_t{0xffffffffu}) != kMbarTag || i >= T.mbars.size() || T.mbars[i].off != off) return nullptr;
  return &T.mbars[i];
}

inline MBar& mbar(const ptr<uint64_t>& bar, const char* what) {
  const size_t off = shared_offset(bar, 8, 8, what);
  MBar* m = mbar_at(off);
  if (m == nullptr)
    fail("%s on the mbarrier at shared byte offset %zu, which is not initialized (mbarrier.init) or whose 8 bytes "
         "were overwritten since",
         what, off);
  return *m;
}

inline void complete_if_done(MBar& m) {
  if (m.pending == 0 && m.tx == 0) {
    ++m.phase;
    m.pending = m.count;
    ++m.done.generation;  // wakes its waiters
  }
}

inline void tx_underflow(const MBar& m) {
  report("mbarrier at shared byte offset %zu: %lld transaction bytes more completed than expected (expect_tx) in "
         "its phase %llu, whose last arrival has come",
         m.off, static_cast<long long>(-m.tx), static_cast<unsigned long long>(m.phase));
}

// An arrival of the running thread; if it completes the phase, the threads waiting for it run
// first (run_released_first: the release-first rule).
inline void arrive_on(MBar& m, const char* what) {
  if (m.pending <= 0)
    fail("%s: more arrivals on the mbarrier at shared byte offset %zu than its count %u in its phase %llu (which "
         "waits for %lld transaction bytes)",
         what, m.off, m.count, static_cast<unsigned long long>(m.phase), static_cast<long long>(m.tx));
  if (--m.pending == 0 && m.tx < 0) tx_underflow(m);
  const uint64_t gen = m.done.generation;
  complete_if_done(m);
  if (m.done.generation != gen) run_released_first(waiters(m.done, gen));
}

// Lands the TMA loads in flight (those completing on the barrier at `bar_off` only, unless it is
// SIZE_MAX), in issue order; true if any landed.
inline bool land(size_t bar_off) {
  bool any = false;
  for (size_t i = 0; i < T.loads.size() && !S.failed;) {
    if (bar_off != SIZE_MAX && T.loads[i].bar != bar_off) {
      ++i;
      continue;
    }
    TmaLoad L = std::move(T.loads[i]);
    T.loads.erase(T.loads.begin() + static_cast<ptrdiff_t>(i));
    any = true;
    std::memcpy(reinterpret_cast<unsigned char*>(S.smem) + L.dst, L.bytes.data(), L.bytes.size());
    MBar* m = mbar_at(L.bar);
    if (m == nullptr) {
      report("the mbarrier of a TMA load issued by thread %u (shared byte offset %zu) is no longer initialized "
             "when the load completes",
             L.issuer, L.bar);
      break;
    }
    m->tx -= static_cast<int64_t>(L.bytes.size());
    if (m->pending == 0 && m->tx < 0) {
      tx_underflow(*m);
      break;
    }
    complete_if_done(*m);
  }
  return any;
}

bool land_all() { return !T.loads.empty() && land(SIZE_MAX); }

// ---------------------------------------------------------------------------------------------
// TMA
// ---------------------------------------------------------------------------------------------

// cuTensorMapEncodeTiled's checks (CUDA driver API) for the parameters the emulator takes.
inline bool make_tensor_map_4d(CUtensorMap& out, const void* base, int elem_bytes, const uint64_t dims[4],
                               const uint64_t strides[3], const uint32_t box[4], int swizzle, std::string& error) {
  char buf[256];
  auto bad = [&](const char* fmt, auto... args) {
    std::snprintf(buf, sizeof buf, fmt, args...);
    error = std::string("emu_make_tensor_map_4d: ") + buf;
    return false;
  };
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8)
    return bad("element size %d is not 1, 2, 4 or 8 bytes", elem_bytes);
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return bad("the global address is not 16-byte aligned");
  if (swizzle != 0 && swizzle != 3) return bad("swizzle %d not modelled (0: none, 3: 128B)", swizzle);
  TensorMap m{};
  m.magic = kMapMagic;
  m.base = reinterpret_cast<uintptr_t>(base);
  m.elem_bytes = static_cast<uint32_t>(elem_bytes);
  m.swizzle = static_cast<uint32_t>(swizzle);
  m.strides[0] = static_cast<uint64_t>(elem_bytes);
  for (int i = 0; i < 4; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t{1} << 32)) return bad("dims[%d] = %llu not in [1, 2^32]", i, (unsigned long long)dims[i]);
    if (box[i] == 0 || box[i] > 256) return bad("box[%d] = %u not in [1, 256]", i, box[i]);
    m.dims[i] = dims[i];
    m.box[i] = box[i];
    if (i > 0) {
      if (strides[i - 1] % 16 != 0 || strides[i - 1] >= (uint64_t{1} << 40))
        return bad("stride of dim %d (%llu bytes) not a multiple of 16 below 2^40", i, (unsigned long long)strides[i - 1]);
      m.strides[i] = strides[i - 1];
    }
  }
  const uint64_t inner = uint64_t{box[0]} * static_cast<uint64_t>(elem_bytes);
  if (inner % 16 != 0) return bad("box[0] * element size = %llu bytes, not a multiple of 16", (unsigned long long)inner);
  if (swizzle == 3 && inner != 128)
    return bad("128B swizzle with an inner box of %llu bytes: only 128 is modelled (the hardware allows <= 128)",
               (unsigned long long)inner);
  static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap));
  std::memset(&out, 0, sizeof out);
  std::memcpy(&out, &m, sizeof m);
  return true;
}

template <class U>
inline void read_element(Alloc* a, uintptr_t x, unsigned char* to) {
  const U* q = ptr<const U>(reinterpret_cast<const U*>(x), a).template check<const U>(0);
  std::memcpy(to, q, sizeof(U));
}

// ---------------------------------------------------------------------------------------------
// warpgroup collectives and wgmma
// ---------------------------------------------------------------------------------------------

enum WgKind : int { kWgFence = 1, kWgCommit = 2, kWgWait = 1000, kRegInc = 2000, kRegDec = 3000, kWgmma = 4000 };

// The warpgroup collective protocol (as emu::collective for a warp): deposit, arrive at the
// warpgroup's barrier; the last of the 128 threads checks that all called the same collective,
// runs `compute`, releases them.
template <class Deposit, class Compute>
void wg_collective(int kind, const char* what, Deposit&& deposit, Compute&& compute) {
  const unsigned w = threadIdx.x / 128;
  if ((w + 1) * 128 > blockDim.x)
    fail("%s in an incomplete warpgroup (threads %u.. of a block of %u; a warpgroup is 4 whole warps)", what,
         w * 128, blockDim.x);
  Warpgroup& G = T.wgs[w];
  WgExchange& ex = G.ex[G.bar.generation & 1];
  const unsigned t = threadIdx.x % 128;
  ex.kind[t] = kind;
  ex.what[t] = what;
  deposit(ex, t);
  if (arrive(G.bar, what)) {
    for (unsigned u = 0; u < 128; ++u) {
      if (ex.kind[u] != kind)
        fail("divergent warpgroup %u: thread %u is at %s, thread %u at %s (or the same with other operands)", w,
             threadIdx.x, what, w * 128 + u, ex.what[u]);
    }
    ++S.collectives;
    compute(ex, G);
    release(G.bar);
  }
}

inline float bits_to_float(uint16_t bits, bool bf16) {
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

// Checks a shared-memory matrix descriptor at the issue.
inline void check_descriptor(uint64_t desc, const char* which) {
  if ((desc >> 62) != 1)
    fail("wgmma.mma_async: %s descriptor %#llx has layout type %llu; only 1 (128-byte swizzle) is modelled", which,
         static_cast<unsigned long long>(desc), static_cast<unsigned long long>(desc >> 62));
  if (((desc >> 49) & 7) != 0)
    fail("wgmma.mma_async: %s descriptor %#llx has a non-zero base offset (not modelled)", which,
         static_cast<unsigned long long>(desc));
}

// Element (mn, k) of an operand in shared memory (see the header comment).
inline float smem_operand(uint64_t desc, int mn, int k, bool mn_major, bool bf16, const char* which) {
  const uint64_t start = (desc & 0x3fffu) << 4, lbo = ((desc >> 16) & 0x3fffu) << 4,
                 sbo = ((desc >> 32) & 0x3fffu) << 4;
  uint64_t a = mn_major ? start + uint64_t(mn % 64) * 2 + uint64_t(mn / 64) * lbo + uint64_t(k % 8) * 128 +
                              uint64_t(k / 8) * sbo
                        : start + uint64_t(mn % 8) * 128 + uint64_t(mn / 8) * sbo + uint64_t(k) * 2;
  a ^= ((a >> 7) & 7) << 4;  // 128-byte swizzle
  const int64_t off = static_cast<int64_t>(a) - static_cast<int64_t>(T.window_base);
  if (off < 0 || static_cast<size_t>(off) + 2 > S.smem_bytes)
    fail("wgmma.mma_async: %s element (%d, %d) at shared address %#llx, outside the block's %zu bytes of shared "
         "memory (window base %#x)",
         which, mn, k, static_cast<unsigned long long>(a), S.smem_bytes, T.window_base);
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<unsigned char*>(S.smem) + off, 2);
  return bits_to_float(bits, bf16);
}

// D (128 threads x n / 2) of op.
inline std::vector<float> compute(const WgOp& op) {
  const int nd = op.n / 2;
  static float A[64][16], B[16][128];
  if (op.rs) {
    for (int t = 0; t < 128; ++t) {
      const int w = t / 32, g = (t % 32) / 4, q = t % 4;
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h)
          A[16 * w + g + 8 * (r % 2)][2 * q + 8 * (r / 2) + h] =
              bits_to_float(static_cast<uint16_t>(op.a[t][r] >> (16 * h)), op.bf16);
    }
  } else {
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) A[m][k] = smem_operand(op.desc_a, m, k, false, op.bf16, "A");
  }
  const bool b_mn_major = op.trans != (S.fault == 4);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < op.n; ++n) B[k][n] = smem_operand(op.desc_b, n, k, b_mn_major, op.bf16, "B");
  std::vector<float> out(128 * static_cast<size_t>(nd));
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, g = (t % 32) / 4, q = t % 4;
    for (int i = 0; i < nd; ++i) {
      const int j = i / 4, e = i % 4;
      const int half = S.fault == 5 ? 1 - e / 2 : e / 2;
      const int row = 16 * w + g + 8 * half, col = 8 * j + 2 * q + e % 2;
      float acc = op.scale_d ? op.c[static_cast<size_t>(t) * nd + i] : 0.f;
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      out[static_cast<size_t>(t) * nd + i] = acc;
    }
  }
  return out;
}

// Computes the warpgroup's pending ops of the groups older than the `pending` most recent.
inline void retire(Warpgroup& G, int pending) {
  while (!G.ops.empty() && G.ops.front().group + static_cast<uint64_t>(pending) < G.committed) {
    WgOp& op = G.ops.front();
    const int nd = op.n / 2;
    if (op.rs) {
      for (int t = 0; t < 128; ++t)
        if (std::memcmp(op.a_ptr[t], op.a[t], sizeof op.a[t]) != 0)
          fail("wgmma_rs: the A registers of thread %d changed between the wgmma and the wgmma.wait_group that "
               "covers it (PTX ISA: undefined)",
               static_cast<int>(threadIdx.x / 128 * 128) + t);
    }
    std::vector<float> d = compute(op);
    if (op.feeds) {
      for (auto it = G.ops.begin() + 1; it != G.ops.end(); ++it) {
        if (it->chained && it->d[0] == op.d[0]) {
          it->c = std::move(d);
          it->chained = false;
          break;
        }
      }
    } else {
      for (int t = 0; t < 128; ++t) std::memcpy(op.d[t], &d[static_cast<size_t>(t) * nd], sizeof(float) * nd);
    }
    G.ops.pop_front();
  }
}

template <bool kBF16, int kN, int kTransB>
void wgmma(float* d, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(kN == 64 || kN == 128, "wgmma: N is 64 or 128");
  static_assert(kTransB == 0 || kTransB == 1, "wgmma: imm-trans-b is 0 or 1");
  const bool rs = a != nullptr;
  const int kind = kWgmma + kBF16 + 2 * (kN == 128) + 4 * kTransB + 8 * rs;
  const char* what = rs ? "wgmma.mma_async (A from registers)" : "wgmma.mma_async";
  wg_collective(
      kind, what,
      [&](WgExchange& ex, unsigned t) {
        ex.d[t] = d;
        ex.a[t] = a;
        ex.desc_a[t] = rs ? 0 : desc_a;
        ex.desc_b[t] = desc_b;
        ex.scale_d[t] = scale_d != 0;
      },
      [&](WgExchange& ex, Warpgroup& G) {
        const unsigned base = threadIdx.x / 128 * 128;
        for (unsigned u = 1; u < 128; ++u) {
          if (ex.desc_a[u] != ex.desc_a[0] || ex.desc_b[u] != ex.desc_b[0] || ex.scale_d[u] != ex.scale_d[0])
            fail("%s: thread %u has descriptors %#llx, %#llx and scale-d %d, thread %u %#llx, %#llx and %d: they must "
                 "be the same in the 128 threads of the warpgroup",
                 what, base + u, (unsigned long long)ex.desc_a[u], (unsigned long long)ex.desc_b[u], ex.scale_d[u],
                 base, (unsigned long long)ex.desc_a[0], (unsigned long long)ex.desc_b[0], ex.scale_d[0]);
        }
        if (!G.fenced)
          fail("%s without a wgmma.fence of its warpgroup since its last wgmma.wait_group (the PTX ISA requires one "
               "before the first wgmma and between register accesses and a wgmma)",
               what);
        if (!rs) check_descriptor(ex.desc_a[0], "A");
        check_descriptor(ex.desc_b[0], "B");
        constexpr int nd = kN / 2;
        G.ops.emplace_back();
        WgOp& op = G.ops.back();
        op.n = kN, op.bf16 = kBF16, op.rs = rs, op.trans = kTransB;
        op.desc_a = ex.desc_a[0], op.desc_b = ex.desc_b[0], op.scale_d = ex.scale_d[0], op.group = G.committed;
        for (int t = 0; t < 128; ++t) {
          op.d[t] = ex.d[t];
          op.a_ptr[t] = ex.a[t];
          if (rs) std::memcpy(op.a[t], ex.a[t], sizeof op.a[t]);
        }
        // The accumulators: the previous pending op's on the same registers (its D becomes this
        // one's C), else as they are now.
        WgOp* prev = nullptr;
        for (auto it = G.ops.rbegin() + 1; it != G.ops.rend(); ++it) {
          const bool same = it->d[0] == op.d[0];
          const bool overlap = op.d[0] < it->d[0] + it->n / 2 && it->d[0] < op.d[0] + nd;
          if (overlap && (!same || it->n != kN))
            fail("%s: its accumulators overlap those of a pending wgmma of another shape or start", what);
          if (same) {
            prev = &*it;
            break;
          }
        }
        if (prev != nullptr) {
          for (int t = 0; t < 128; ++t)
            if (prev->d[t] != op.d[t])
              fail("%s: thread %d's accumulators are not those of the pending wgmma that thread %u's are", what,
                   static_cast<int>(base) + t, base);
          prev->feeds = true;
          op.chained = true;
        } else {
          op.c.resize(128 * static_cast<size_t>(nd));
          for (int t = 0; t < 128; ++t) std::memcpy(&op.c[static_cast<size_t>(t) * nd], op.d[t], sizeof(float) * nd);
        }
        for (int t = 0; t < 128; ++t) std::fill(op.d[t], op.d[t] + nd, NAN);  // until the covering wait
      });
}

// ---------------------------------------------------------------------------------------------
// named barriers (bar.sync / bar.arrive id, count)
// ---------------------------------------------------------------------------------------------

// "bar.sync 3", "bar.arrive 3": what a blocked thread waits at, for messages.
inline const char* named_what(int id, bool sync) {
  static char names[2][kNamedBarriers][24];
  char* s = names[sync][id];
  if (s[0] == 0) std::snprintf(s, sizeof names[0][0], "%s %d", sync ? "bar.sync" : "bar.arrive", id);
  return s;
}

// bar.sync / bar.arrive id, count (PTX ISA, "bar, barrier"; bar.sync is barrier.sync.aligned): a
// warp collective (all 32 lanes, the same barrier and count: `.aligned`); the warp's arrival counts
// 32 threads; the use completes when `count` threads have arrived, and the barrier starts its next
// use.  bar.sync then blocks until the use its warp arrived in has completed; bar.arrive does not.
// The warp that completes a use lets the threads it releases run first (run_released_first).
inline void named_barrier(int id, int count, bool sync) {
  const char* op = sync ? "bar.sync" : "bar.arrive";
  if (id < 1 || id >= kNamedBarriers)
    fail("%s %d, %d: barrier %d is not modelled (1 .. 15; barrier 0 is __syncthreads')", op, id, count, id);
  if (count <= 0 || count % 32 != 0 || count > static_cast<int>(blockDim.x))
    fail("%s %d, %d: the thread count must be a positive multiple of the warp size (32), at most the block's %u "
         "threads",
         op, id, count, blockDim.x);
  const char* what = named_what(id, sync);
  const int kind = (1 << 24) | (sync << 20) | (id << 12) | count;
  Exchange& ex = collective(
      kind, what,
      [&](Exchange& e) {
        Barrier& b = T.named[id];
        if (b.arrived > 0 && b.expected != count)
          fail("%s %d, %d: named barrier %d's current use expects %d threads (%d arrived): the thread counts of one "
               "use must agree",
               op, id, count, id, b.expected, b.arrived);
        const uint64_t gen = b.generation;
        b.expected = count;
        b.arrived += 32;
        const bool completed = b.arrived == count;
        if (completed) {
          T.named_released = waiters(b, gen);
          b.arrived = 0;
          ++b.generation;
        }
        e.r_out[0][0] = static_cast<uint32_t>(gen);
        e.r_out[0][1] = static_cast<uint32_t>(gen >> 32);
        e.r_out[0][2] = completed;
        e.r_out[0][3] = threadIdx.x;  // the lane that completed the warp's arrival
      },
      [](Exchange&, unsigned, const void*) {}, nullptr);
  const uint64_t gen = ex.r_out[0][0] | (static_cast<uint64_t>(ex.r_out[0][1]) << 32);
  const bool completed = ex.r_out[0][2] != 0;
  if (completed && ex.r_out[0][3] == threadIdx.x) {
    std::vector<unsigned> tids = std::move(T.named_released);
    T.named_released.clear();
    run_released_first(std::move(tids));
  }
  Barrier& b = T.named[id];
  if (sync && !completed && b.generation == gen) {
    Fiber& f = *S.current;
    f.wait_bar = &b;
    f.wait_gen = gen;
    f.wait_what = what;
    to_scheduler();
  }
}

}  // namespace sm90
}  // namespace emu

// The shared-window address of a pointer into the block's shared memory.
inline size_t __cvta_generic_to_shared(emu::ptr<const void> p) {
  if (p.alloc() != &emu::S.shared)
    emu::fail("__cvta_generic_to_shared of an address not in shared memory (it points into %s)",
              p.alloc()->name.c_str());
  return emu::sm90::T.window_base +
         static_cast<size_t>(reinterpret_cast<uintptr_t>(p.get()) - reinterpret_cast<uintptr_t>(emu::S.smem));
}

[[noreturn]] inline void __trap() { emu::fail("__trap() reached"); }

// ---------------------------------------------------------------------------------------------
// the helpers extract.py removed from sm90_ptx.cuh, with the same signatures
// ---------------------------------------------------------------------------------------------

namespace attnkit {
namespace {

__device__ __forceinline__ void mbar_init(emu::ptr<uint64_t> bar, uint32_t count) {
  using namespace emu::sm90;
  const size_t off = shared_offset(bar, 8, 8, "mbarrier.init");
  if (count < 1 || count > kMaxCount) emu::fail("mbarrier.init with count %u, not in [1, 2^20 - 1]", count);
  MBar* m = mbar_at(off);  // re-initialized: the same entry (its index is in its 8 bytes)
  uint64_t index = T.mbars.size();
  if (m != nullptr) std::memcpy(&index, reinterpret_cast<unsigned char*>(emu::S.smem) + off, 8), index &= 0xffffffffu;
  if (m == nullptr) {
    T.mbars.emplace_back();
    m = &T.mbars.back();
  }
  m->off = off, m->count = count, m->pending = count, m->tx = 0, m->phase = 0;
  m->init_thread = threadIdx.x, m->async_visible = false;
  ++m->done.generation;
  const uint64_t v = kMbarTag | index;
  std::memcpy(reinterpret_cast<unsigned char*>(emu::S.smem) + off, &v, 8);
}

__device__ __forceinline__ void mbar_arrive_expect_tx(emu::ptr<uint64_t> bar, uint32_t bytes) {
  using namespace emu::sm90;
  MBar& m = mbar(bar, "mbarrier.arrive.expect_tx");
  m.tx += bytes;
  if (m.tx > kMaxCount)
    emu::fail("mbarrier.arrive.expect_tx: tx-count %lld of the mbarrier at shared byte offset %zu above 2^20 - 1",
              static_cast<long long>(m.tx), m.off);
  arrive_on(m, "mbarrier.arrive.expect_tx");
}

__device__ __forceinline__ void mbar_arrive(emu::ptr<uint64_t> bar) {
  using namespace emu::sm90;
  arrive_on(mbar(bar, "mbarrier.arrive"), "mbarrier.arrive");
}

__device__ __forceinline__ void mbar_wait(emu::ptr<uint64_t> bar, uint32_t parity) {
  using namespace emu::sm90;
  for (;;) {
    MBar& m = mbar(bar, "mbarrier.try_wait.parity");
    if ((m.phase & 1) != (parity & 1)) return;
    if (land(m.off)) continue;  // its loads in flight landed: look again
    emu::Fiber& f = *emu::S.current;
    f.wait_bar = &m.done;
    f.wait_gen = m.done.generation;
    f.wait_what = "mbarrier.try_wait";
    emu::to_scheduler();
  }
}

// Makes the barriers this thread initialized visible to the async proxy (TMA's complete_tx).
__device__ __forceinline__ void fence_proxy_async() {
  for (auto& m : emu::sm90::T.mbars)
    if (m.init_thread == threadIdx.x) m.async_visible = true;
}

__device__ __forceinline__ void tma_load_4d(emu::ptr<void> dst, emu::ptr<const void> tensor_map, int c0, int c1,
                                            int c2, int c3, emu::ptr<uint64_t> bar) {
  using namespace emu::sm90;
  const char* what = "cp.async.bulk.tensor.4d";
  const CUtensorMap* raw =
      emu::reinterpret_ptr<emu::ptr<const CUtensorMap>>(tensor_map).template check<const CUtensorMap>(0);
  TensorMap tm;
  std::memcpy(&tm, raw, sizeof tm);
  if (tm.magic != kMapMagic) emu::fail("%s: the tensor map was not made by emu_make_tensor_map_4d", what);
  const size_t e = tm.elem_bytes, b0 = tm.box[0], b1 = tm.box[1], b2 = tm.box[2], b3 = tm.box[3];
  const size_t bytes = b0 * b1 * b2 * b3 * e;
  const size_t off = shared_offset(dst, bytes, tm.swizzle ? 1024 : 128, "cp.async.bulk.tensor destination");
  MBar& m = mbar(bar, what);
  if (!m.async_visible)
    emu::fail("%s completing on the mbarrier at shared byte offset %zu, which thread %u initialized without a "
              "fence.proxy.async since (mbarrier.init is a generic-proxy write; the TMA unit is the async proxy)",
              what, m.off, m.init_thread);
  emu::Alloc* src = emu::find_alloc(reinterpret_cast<const void*>(tm.base));
  if (src == &emu::S.shared || std::strcmp(src->space, "local") == 0)
    emu::fail("%s: the tensor map's global address is not in global memory (it points into %s)", what,
              src->name.c_str());
  TmaLoad L{off, m.off, threadIdx.x, std::vector<unsigned char>(bytes, 0)};
  const int64_t c[4] = {c0, c1, c2, c3};
  const uint64_t window = T.window_base + off;
  for (size_t i3 = 0; i3 < b3; ++i3)
    for (size_t i2 = 0; i2 < b2; ++i2)
      for (size_t i1 = 0; i1 < b1; ++i1)
        for (size_t i0 = 0; i0 < b0; ++i0) {
          const int64_t x[4] = {c[0] + int64_t(i0), c[1] + int64_t(i1), c[2] + int64_t(i2), c[3] + int64_t(i3)};
          size_t to = (((i3 * b2 + i2) * b1 + i1) * b0 + i0) * e;
          if (tm.swizzle == 3 && emu::S.fault != 3) {
            const uint64_t a = window + to;
            to = static_cast<size_t>((a ^ (((a >> 7) & 7) << 4)) - window);
          }
          bool inside = true;
          uintptr_t at = tm.base;
          for (int d = 0; d < 4; ++d) {
            inside = inside && x[d] >= 0 && static_cast<uint64_t>(x[d]) < tm.dims[d];
            at += static_cast<uintptr_t>(x[d]) * tm.strides[d];
          }
          if (!inside) continue;  // zero-filled
          unsigned char* out = L.bytes.data() + to;
          switch (e) {
            case 1: read_element<uint8_t>(src, at, out); break;
            case 2: read_element<uint16_t>(src, at, out); break;
            case 4: read_element<uint32_t>(src, at, out); break;
            default: read_element<uint64_t>(src, at, out); break;
          }
        }
  std::memset(reinterpret_cast<unsigned char*>(emu::S.smem) + off, 0xff, bytes);  // NaN until it lands
  T.loads.push_back(std::move(L));
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: a multiple of 8 in [24, 256]");
  emu::sm90::wg_collective(emu::sm90::kRegInc + kRegs, "setmaxnreg.inc", [](auto&, unsigned) {}, [](auto&, auto&) {});
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg: a multiple of 8 in [24, 256]");
  emu::sm90::wg_collective(emu::sm90::kRegDec + kRegs, "setmaxnreg.dec", [](auto&, unsigned) {}, [](auto&, auto&) {});
}

__device__ __forceinline__ void wgmma_fence() {
  emu::sm90::wg_collective(emu::sm90::kWgFence, "wgmma.fence", [](auto&, unsigned) {},
                           [](auto&, emu::sm90::Warpgroup& G) { G.fenced = true; });
}

__device__ __forceinline__ void wgmma_commit() {
  emu::sm90::wg_collective(emu::sm90::kWgCommit, "wgmma.commit_group", [](auto&, unsigned) {},
                           [](auto&, emu::sm90::Warpgroup& G) { ++G.committed; });
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(kPending >= 0, "wgmma.wait_group takes a non-negative count");
  emu::sm90::wg_collective(emu::sm90::kWgWait + kPending, "wgmma.wait_group", [](auto&, unsigned) {},
                           [](auto&, emu::sm90::Warpgroup& G) {
                             emu::sm90::retire(G, kPending);
                             G.fenced = false;
                           });
}

template <int kNt>
__device__ __forceinline__ void acc_fence(float (&)[kNt][4]) {}
template <int kNt>
__device__ __forceinline__ void acc_fence(uint32_t (&)[kNt][4]) {}

// Named barriers (sm90_ptx.cuh's named_bar_sync / named_bar_arrive).
__device__ __forceinline__ void named_bar_sync(int id, int count) { emu::sm90::named_barrier(id, count, true); }
__device__ __forceinline__ void named_bar_arrive(int id, int count) { emu::sm90::named_barrier(id, count, false); }

template <bool kBF16, int kN, int kTransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[kN / 8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  emu::sm90::wgmma<kBF16, kN, kTransB>(&d[0][0], nullptr, desc_a, desc_b, scale_d);
}

template <bool kBF16, int kN, int kTransB, int kOff = 0, int kNt = kN / 8>
__device__ __forceinline__ void wgmma_rs(float (&d)[kNt][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(kOff >= 0 && kOff + kN / 8 <= kNt, "wgmma_rs: the accumulators lie inside d");
  emu::sm90::wgmma<kBF16, kN, kTransB>(&d[kOff][0], a, 0, desc_b, scale_d);
}

}  // namespace
}  // namespace attnkit

// Builds a tensor map as cuTensorMapEncodeTiled would (CU_TENSOR_MAP_INTERLEAVE_NONE, element
// strides 1, OOB fill zeros), in the emulator's encoding: map_out (128 bytes, 64-byte aligned) for
// a kernel's `const __grid_constant__ CUtensorMap` parameter.  dims innermost first, strides_bytes
// of dims 1..3 (multiples of 16), box[4] (each <= 256; box[0] * elem_bytes a multiple of 16, == 128
// with the 128B swizzle), swizzle 0 (none) or 3 (CU_TENSOR_MAP_SWIZZLE_128B).  0 on success; else
// 1, and the launch that follows fails with emu_last_error() saying why.  The memory at base is
// found in the buffer registry at each load (register it like any other buffer).
extern "C" int emu_make_tensor_map_4d(void* map_out, const void* base, int elem_bytes, const uint64_t* dims,
                                      const uint64_t* strides_bytes, const uint32_t* box, int swizzle) {
  std::string error;
  if (emu::sm90::make_tensor_map_4d(*static_cast<CUtensorMap*>(map_out), base, elem_bytes, dims, strides_bytes, box,
                                    swizzle, error))
    return 0;
  if (!emu::S.failed) {
    emu::S.failed = true;
    emu::S.error = error;
  }
  return 1;
}

// The shared-window address of the block's shared memory (default 1024; a multiple of 16).
extern "C" void emu_set_shared_window_base(uint32_t base) { emu::sm90::T.window_base = base; }

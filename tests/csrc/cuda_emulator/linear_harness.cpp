// Host emulator for the device code of csrc/cuda/linear.cu: the emulator of harness.cpp (fibers,
// warp collectives, ldmatrix / mma from the PTX ISA, NaN-filled shared memory; see README.md),
// the linear-attention kernels as extract.py cuts them out of linear.cu (mma_sm80.cuh inlined,
// the PTX helpers checked and removed), and their launches re-created from
// what linear.cu's host side does after its checks (same grids: state_grid / chunk_grid, same
// shared-memory size: smem_bytes, both from the device part).
//
// Build (`python extract.py csrc/cuda/linear.cu <dir>/linear_kernels.inc` writes the include):
//   g++ -std=c++20 -O1 -fno-strict-aliasing -shared -fPIC -I<dir of linear_kernels.inc> linear_harness.cpp -o libemu.so
// Optional: -DEMU_ONLY_F16 (float16 kernels only: a quicker build, for the test's mutants).
#define EMU_CORE_ONLY
#include "harness.cpp"

#include <limits>
using std::isfinite;  // CUDA declares isfinite / isinf (float) globally (linear.cu: load_state_operand, load_tile)
using std::isinf;

#define __host__

// What the device code uses of c10's 16-bit types: the bits and the from-bits constructor.
namespace c10 {
template <int kKind>
struct Bits16 {
  struct from_bits_t {};
  static constexpr from_bits_t from_bits() { return {}; }
  uint16_t x;
  Bits16() = default;
  constexpr Bits16(uint16_t bits, from_bits_t) : x(bits) {}
};
using Half = Bits16<0>;
using BFloat16 = Bits16<1>;
}  // namespace c10

inline uint16_t __half_as_ushort(__half h) { return h.bits; }
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }

#include "linear_kernels.inc"

namespace {
using namespace attnkit;

// A [B, H, L, X] view; strides in elements.
template <typename T>
View<T> view(const void* ptr, const int64_t* s) {
  View<T> w;
  w.p = static_cast<const T*>(ptr);
  if (ptr != nullptr) w.sb = s[0], w.sh = s[1], w.sl = s[2], w.sx = s[3];
  return w;
}

// As linear.cu's states_of: nt > 0 states [rows, cols] per (b, h), or (nt = 0) one total.
States<float> states(float* p, int64_t nt, int64_t rows, int64_t cols) {
  States<float> s;
  s.p = p;
  s.ld = cols;
  s.s_t = nt > 0 ? rows * cols : 0;
  s.s_bh = (nt > 0 ? nt : 1) * rows * cols;
  return s;
}

template <typename Kernel>
bool run(const char* name, dim3 grid, Kernel kernel) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return !emu::S.failed;
  return emu::launch(name, grid, kThreads, smem_bytes<float>(), kernel);
}

std::vector<float> scratch(size_t n) { return std::vector<float>(n, NAN); }

struct Shape {
  int B, H, N, M, D, Dv, fm, causal, normalize;
  float eps, scale;
};

template <typename T>
Problem<T, float> problem(const Shape& s, const void* q, const int64_t* qs, const void* k, const int64_t* ks,
                          const void* v, const int64_t* vs) {
  Problem<T, float> p;
  p.q = view<T>(q, qs), p.k = view<T>(k, ks), p.v = view<T>(v, vs);
  p.H = s.H, p.N = s.N, p.M = s.M, p.D = s.D, p.Dv = s.Dv, p.fm = s.fm;
  p.causal = s.causal, p.normalize = s.normalize, p.eps = s.eps, p.scale = s.scale;
  return p;
}

template <typename T>
bool state_fwd(const Problem<T, float>& p, int B, const float* S0, const float* z0, float* Hs, float* Zs,
               float* S, float* z) {
  const int64_t nt = ceil_div(p.N, kC);
  const States<float> hs = Hs ? states(Hs, nt, p.D, p.Dv) : States<float>{};
  const States<float> zs = Zs ? states(Zs, nt, 1, p.D) : States<float>{};
  return run("state_fwd_kernel", state_grid(p.D, p.Dv, p.H, B),
             [=] { state_fwd_kernel<T, float>(p, S0, z0, hs, zs, S, z); });
}

// linear_fwd_cuda's forward_impl (inputs checked, D, Dv, B, H > 0).
template <typename T>
bool forward(const Shape& s, const Problem<T, float>& p, const float* S0, const float* z0, T* out, float* den,
             float* S, float* z) {
  const int64_t nt = ceil_div(p.N, kC);
  std::vector<float> Hs, Zs;
  if (s.causal) Hs = scratch(size_t(s.B) * s.H * nt * s.D * s.Dv), Zs = scratch(size_t(s.B) * s.H * nt * s.D);
  emu::Buffers buffers;
  buffers.add(Hs, "Hs (chunk states, scratch)");
  buffers.add(Zs, "Zs (chunk normalizers, scratch)");
  if (!state_fwd(p, s.B, S0, z0, s.causal ? Hs.data() : nullptr, s.causal ? Zs.data() : nullptr, S, z)) return false;
  if (p.N == 0) return true;
  if (p.M == 0 && S0 == nullptr) {
    std::fill_n(reinterpret_cast<uint16_t*>(out), size_t(s.B) * s.H * s.N * s.Dv, uint16_t{0});
    std::fill_n(den, size_t(s.B) * s.H * s.N, 0.f);
    return true;
  }
  const States<float> hs = s.causal ? states(Hs.data(), nt, p.D, p.Dv) : states(S, 0, p.D, p.Dv);
  const States<float> zs = s.causal ? states(Zs.data(), nt, 1, p.D) : states(z, 0, 1, p.D);
  return run("output_kernel", chunk_grid(p.N, p.Dv, p.H, s.B), [=] { output_kernel<T, float>(p, hs, zs, out, den); });
}

// linear_bwd_cuda's backward_impl.
template <typename T>
bool backward(const Shape& s, const Problem<T, float>& p, const View<T>& g, const View<T>& out, const float* gden,
              const float* gS, const float* gz, const float* den, const float* S, const float* z, const float* S0,
              const float* z0, T* dq, T* dk, T* dv, float* dS0, float* dz0) {
  const int64_t nt = ceil_div(p.N, kC);
  BwdExtra<T, float> x;
  x.g = g, x.den = den, x.gden = gden;
  std::vector<float> delta;
  emu::Buffers buffers;
  if (s.normalize && g.p != nullptr && p.N > 0) {
    delta = scratch(size_t(s.B) * s.H * s.N);
    buffers.add(delta, "delta (scratch)");
    const int64_t rows = int64_t(s.B) * s.H * s.N;
    const dim3 grid{static_cast<unsigned>(ceil_div(rows, kThreads / 32)), 1, 1};
    float* d = delta.data();
    if (!emu::launch("delta_kernel", grid, kThreads, 0,
                     [=] { delta_kernel<T, float>(g, out, p.H, p.N, p.Dv, rows, d); }))
      return false;
    x.delta = delta.data();
  }
  const size_t per_state = size_t(s.B) * s.H * nt * s.D * s.Dv, per_z = size_t(s.B) * s.H * nt * s.D;
  std::vector<float> Hs, Zs, Ss, zs_, Rs, Ws;
  if (s.causal) {
    Hs = scratch(per_state), Zs = scratch(per_z), Rs = scratch(per_state), Ws = scratch(per_z);
    Ss = scratch(size_t(s.B) * s.H * s.D * s.Dv), zs_ = scratch(size_t(s.B) * s.H * s.D);
    buffers.add(Hs, "Hs (chunk states, scratch)");
    buffers.add(Zs, "Zs (chunk normalizers, scratch)");
    buffers.add(Rs, "Rs (chunk state gradients, scratch)");
    buffers.add(Ws, "Ws (chunk normalizer gradients, scratch)");
    buffers.add(Ss, "S (recomputed total state, scratch)");
    buffers.add(zs_, "z (recomputed total normalizer, scratch)");
    if (!state_fwd(p, s.B, S0, z0, Hs.data(), Zs.data(), Ss.data(), zs_.data())) return false;
  }
  const States<float> hs = s.causal ? states(Hs.data(), nt, p.D, p.Dv) : states(const_cast<float*>(S), 0, p.D, p.Dv);
  const States<float> zs = s.causal ? states(Zs.data(), nt, 1, p.D) : states(const_cast<float*>(z), 0, 1, p.D);
  const States<float> rs = s.causal ? states(Rs.data(), nt, p.D, p.Dv) : states(dS0, 0, p.D, p.Dv);
  const States<float> ws = s.causal ? states(Ws.data(), nt, 1, p.D) : states(dz0, 0, 1, p.D);
  const States<float> rs_out = s.causal ? rs : States<float>{}, ws_out = s.causal ? ws : States<float>{};
  if (!run("state_bwd_kernel", state_grid(p.D, p.Dv, p.H, s.B),
           [=] { state_bwd_kernel<T, float>(p, x, gS, gz, rs_out, ws_out, dS0, dz0); }))
    return false;
  if (p.N > 0 && !run("dq_kernel", chunk_grid(p.N, p.D, p.H, s.B), [=] { dq_kernel<T, float>(p, x, hs, zs, dq); }))
    return false;
  if (p.M > 0) {
    if (!run("dk_kernel", chunk_grid(p.M, p.D, p.H, s.B), [=] { dk_kernel<T, float>(p, x, rs, ws, dk); })) return false;
    if (!run("dv_kernel", chunk_grid(p.M, p.Dv, p.H, s.B), [=] { dv_kernel<T, float>(p, x, rs, dv); })) return false;
  }
  return true;
}

bool fail(const std::string& what) {
  emu::S.failed = true;
  emu::S.error = what;
  return false;
}

void begin() {
  emu::S.failed = false;
  emu::S.error.clear();
}

// Calls f(T{}) for dtype 0 = float16, 1 = bfloat16.
template <typename F>
bool with_dtype(int dtype, F&& f) {
  if (dtype == 0) return f(c10::Half{});
#ifndef EMU_ONLY_F16
  if (dtype == 1) return f(c10::BFloat16{});
#endif
  return fail("dtype " + std::to_string(dtype) + " not in this build");
}
}  // namespace

// shape = [B, H, N, M, D, Dv, feature_map (linear.cu's FeatureMap), causal, normalize]; strides
// [4] per 16-bit tensor; S0, z0, gden, gS, gz may be null; den, S, z, dS0, dz0 and the other
// outputs contiguous.  Return 0 on success, else see emu_last_error().
extern "C" int emu_linear_fwd(int dtype, const int* shape, float eps, float scale, const void* q, const int64_t* qs,
                              const void* k, const int64_t* ks, const void* v, const int64_t* vs, const float* S0,
                              const float* z0, void* out, float* den, float* S, float* z) {
  begin();
  const Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], shape[8], eps, scale};
  return with_dtype(dtype, [&](auto t) {
           using T = decltype(t);
           return forward<T>(s, problem<T>(s, q, qs, k, ks, v, vs), S0, z0, static_cast<T*>(out), den, S, z);
         })
             ? 0
             : 1;
}

extern "C" int emu_linear_bwd(int dtype, const int* shape, float eps, float scale, const void* g, const int64_t* gs,
                              const float* gden, const float* gS, const float* gz, const void* q, const int64_t* qs,
                              const void* k, const int64_t* ks, const void* v, const int64_t* vs, const void* out,
                              const int64_t* os, const float* den, const float* S, const float* z, const float* S0,
                              const float* z0, void* dq, void* dk, void* dv, float* dS0, float* dz0) {
  begin();
  const Shape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], shape[6], shape[7], shape[8], eps, scale};
  return with_dtype(dtype, [&](auto t) {
           using T = decltype(t);
           return backward<T>(s, problem<T>(s, q, qs, k, ks, v, vs), view<T>(g, gs), view<T>(out, os), gden, gS,
                              gz, den, S, z, S0, z0, static_cast<T*>(dq), static_cast<T*>(dk), static_cast<T*>(dv),
                              dS0, dz0);
         })
             ? 0
             : 1;
}

// linear.cu's FeatureMap values, in the order elu, relu, identity.
extern "C" void emu_linear_feature_maps(int* fms) {
  fms[0] = kElu, fms[1] = kRelu, fms[2] = kIdentity;
}

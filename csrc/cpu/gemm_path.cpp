// The CPU kernels' tile-GEMM path, chosen at run time: see gemm_path.h.
#include "gemm_path.h"

#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "../message.h"

namespace attnkit {
namespace {

// CPUID leaf 7: subleaf 0 EDX bit 24 AMX-TILE, bit 22 AMX-BF16; subleaf 1 EAX bit 21 AMX-FP16.
struct AmxFlags {
  bool tile = false, bf16 = false, fp16 = false;
};

AmxFlags read_amx_flags() {
  AmxFlags f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.tile = (d >> 24) & 1u;
  f.bf16 = (d >> 22) & 1u;
  const unsigned max_subleaf = a;
  if (max_subleaf >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.fp16 = (a >> 21) & 1u;
  }
#endif
  return f;
}

const AmxFlags& amx_flags() {
  static const AmxFlags flags = read_amx_flags();
  return flags;
}

}  // namespace

bool cpu_has_amx(at::ScalarType dtype) {
  const AmxFlags& f = amx_flags();
  if (dtype == at::kBFloat16) return f.tile && f.bf16;
  if (dtype == at::kHalf) return f.tile && f.fp16;
  return false;
}

GemmPath cpu_gemm_path(at::ScalarType dtype) {
  const char* env = std::getenv("ATTNKIT_CPU_GEMM");
  const std::string_view want = env == nullptr || *env == '\0' ? std::string_view("auto") : std::string_view(env);
  ATTNKIT_CHECK(want == "auto" || want == "native" || want == "brgemm",
                "ATTNKIT_CPU_GEMM must be one of auto, native, brgemm; got '", want, "'");
  // float32 / float64: the native tiles (brgemm float32 did not measure faster: not offered).
  if (want == "native" || (dtype != at::kBFloat16 && dtype != at::kHalf)) return GemmPath::kNative;
  // could_pack: whether oneDNN runs brgemm on AMX with a VNNI-packed B (fixed for the process).
  static const bool could_pack_bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool could_pack_f16 = at::native::cpublas::could_pack(at::kHalf);
  const bool vnni = dtype == at::kBFloat16 ? could_pack_bf16 : could_pack_f16;
  if (want == "brgemm") return vnni ? GemmPath::kBrgemmVnni : GemmPath::kBrgemmPlain;
  return cpu_has_amx(dtype) && vnni ? GemmPath::kBrgemmVnni : GemmPath::kNative;
}

std::string gemm_path_name(GemmPath path) {
  switch (path) {
    case GemmPath::kBrgemmVnni: return "brgemm (AMX, VNNI)";
    case GemmPath::kBrgemmPlain: return "brgemm (no VNNI: reference fallback)";
    default: return "native";
  }
}

}  // namespace attnkit

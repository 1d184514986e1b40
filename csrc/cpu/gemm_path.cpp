// The CPU kernels' tile-GEMM path, chosen at run time: see gemm_path.h.
#include "gemm_path.h"

#include "amx_tiles.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
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

// CPUID leaf 0: the vendor string in EBX, EDX, ECX.
bool cpu_is_amd() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  char vendor[13];
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  vendor[12] = '\0';
  return std::string_view(vendor) == "AuthenticAMD";
#else
  return false;
#endif
}

}  // namespace

bool cpu_bf16_dot_products(GemmUse use) {
  const char* env = std::getenv("ATTNKIT_CPU_BF16");
  const std::string_view want = env == nullptr || *env == '\0' ? std::string_view("auto") : std::string_view(env);
  ATTNKIT_CHECK(want == "auto" || want == "dot" || want == "float32",
                "ATTNKIT_CPU_BF16 must be one of auto, dot, float32; got '", want, "'");
#if defined(__AVX512BF16__)
  if (want != "auto") return want == "dot";
  (void)use;  // the same rule for the flash tiles and the decoding kernel (gemm_path.h)
  static const bool amd = cpu_is_amd();
  return amd;
#else
  (void)use;
  return false;
#endif
}

bool cpu_has_amx(at::ScalarType dtype) {
  const AmxFlags& f = amx_flags();
  if (dtype == at::kBFloat16) return f.tile && f.bf16;
  if (dtype == at::kHalf) return f.tile && f.fp16;
  return false;
}

bool amx_tile_state_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): granted once for the whole process
  // (oneDNN asks the same before its first AMX kernel); 0 on success.
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
#else
  return false;
#endif
}

bool amx_tiles_available(at::ScalarType dtype) {
  return kHaveAmxTiles && dtype == at::kBFloat16 && cpu_has_amx(dtype) && amx_tile_state_permitted();
}

GemmPath cpu_gemm_path(at::ScalarType dtype, GemmUse use) {
  const char* env = std::getenv("ATTNKIT_CPU_GEMM");
  const std::string_view want = env == nullptr || *env == '\0' ? std::string_view("auto") : std::string_view(env);
  ATTNKIT_CHECK(want == "auto" || want == "native" || want == "brgemm" || want == "amx" || want == "split" ||
                    want == "emulate",
                "ATTNKIT_CPU_GEMM must be one of auto, native, brgemm, amx, split, emulate; got '", want, "'");
  // float32 / float64: the native tiles (brgemm float32 did not measure faster: not offered).
  if (want == "native" || (dtype != at::kBFloat16 && dtype != at::kHalf)) return GemmPath::kNative;
  if (want == "emulate") return GemmPath::kBrgemmEmulated;
  // could_pack: whether oneDNN runs brgemm on AMX with a VNNI-packed B (fixed for the process).
  static const bool could_pack_bf16 = at::native::cpublas::could_pack(at::kBFloat16);
  static const bool could_pack_f16 = at::native::cpublas::could_pack(at::kHalf);
  // The float16 split (softmax flash tiles only): forced by split -- on oneDNN's AMX where it
  // packs bfloat16, else on the emulated brgemm -- and taken by auto where the CPU multiplies
  // bfloat16 on AMX but not float16 (gemm_path.h has the measurement).  split sets nothing else:
  // every other dtype and kernel as under auto.
  if (dtype == at::kHalf && use == GemmUse::kSoftmax) {
    if (want == "split") return could_pack_bf16 ? GemmPath::kSplitBf16 : GemmPath::kSplitBf16Emulated;
    if (want == "auto" && !(cpu_has_amx(at::kHalf) && could_pack_f16) && cpu_has_amx(at::kBFloat16) && could_pack_bf16)
      return GemmPath::kSplitBf16;
  }
  const std::string_view setting = want == "split" ? std::string_view("auto") : want;
  // The decoding kernel's own AMX tiles (bfloat16): forced by amx (an error where they are not
  // there), taken by auto where they are (see gemm_path.h for the measurement).
  if (use == GemmUse::kDecode && dtype == at::kBFloat16 && (setting == "amx" || setting == "auto")) {
    const bool here = amx_tiles_available(dtype);
    ATTNKIT_CHECK(here || setting == "auto",
                  "ATTNKIT_CPU_GEMM=amx: the decoding kernel's own AMX tiles need a build for AMX-TILE, AMX-BF16 "
                  "and AVX512-BF16 (this build: ", kHaveAmxTiles ? "yes" : "no", "), a CPU with them (this CPU: ",
                  cpu_has_amx(dtype) ? "yes" : "no", ") and the AMX tile state granted by the OS (",
                  amx_tile_state_permitted() ? "yes" : "no", ")");
    if (here) return GemmPath::kAmxTiles;
  }
  const bool vnni = dtype == at::kBFloat16 ? could_pack_bf16 : could_pack_f16;
  if (setting == "brgemm" || setting == "amx") return vnni ? GemmPath::kBrgemmVnni : GemmPath::kBrgemmPlain;
  return cpu_has_amx(dtype) && vnni && (use == GemmUse::kTiles || use == GemmUse::kSoftmax) ? GemmPath::kBrgemmVnni
                                                                                           : GemmPath::kNative;
}

GemmPath cpu_decode_path(at::ScalarType dtype, int64_t rows) {
  const GemmPath path = cpu_gemm_path(dtype, GemmUse::kDecode);
  if (path != GemmPath::kAmxTiles || rows >= 4) return path;
  const char* env = std::getenv("ATTNKIT_CPU_GEMM");
  return env != nullptr && std::string_view(env) == "amx" ? path : GemmPath::kNative;
}

std::string gemm_path_name(GemmPath path) {
  switch (path) {
    case GemmPath::kBrgemmVnni: return "brgemm (AMX, VNNI)";
    case GemmPath::kBrgemmPlain: return "brgemm (no VNNI: reference fallback)";
    case GemmPath::kBrgemmEmulated: return "brgemm emulated (VNNI layout, scalar: tests)";
    case GemmPath::kAmxTiles: return "own AMX tiles";
    case GemmPath::kSplitBf16: return "brgemm split (float16 as bfloat16 pairs, AMX)";
    case GemmPath::kSplitBf16Emulated: return "brgemm split emulated (float16 as bfloat16 pairs, scalar: tests)";
    default: return "native";
  }
}

void brgemm16_emulated(bool bf16, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc,
                       bool add_C, const uint16_t* A, const uint16_t* B, float* C) {
  ATTNKIT_CHECK(M >= 0 && N >= 0 && K >= 0 && K % 2 == 0 && lda >= K && ldb >= N && ldc >= N,
                "brgemm16_emulated: a call oneDNN's VNNI kernel would not take: M=", M, " N=", N, " K=", K,
                " lda=", lda, " ldb=", ldb, " ldc=", ldc, " (expected K even, lda >= K, ldb >= N, ldc >= N)");
  auto value = [bf16](uint16_t bits) -> float {
    return bf16 ? static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()))
                : static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  };
  const bool k_tail_defect = K > 32 && K % 32 != 0;
  for (int64_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    for (int64_t n = 0; n < N; ++n) {
      float sum = add_C ? c[n] : 0.0f;
      for (int64_t kk = 0; kk < K; ++kk) sum += value(A[i * lda + kk]) * value(B[((kk / 2) * ldb + n) * 2 + kk % 2]);
      c[n] = sum;
    }
    if (k_tail_defect && i + 1 < M) {
      bool next_row_nan = false;
      for (int64_t kk = 0; kk < K; ++kk) next_row_nan = next_row_nan || std::isnan(value(A[(i + 1) * lda + kk]));
      if (next_row_nan)
        for (int64_t n = 0; n < N; ++n) c[n] = std::numeric_limits<float>::quiet_NaN();
    }
  }
}

}  // namespace attnkit

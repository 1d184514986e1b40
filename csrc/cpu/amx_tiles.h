// attnkit's own AMX tile code (issue 25): the tile configuration a kernel loads for itself on its
// worker thread, and its release.  Used by the bfloat16 decoding kernel (csrc/cpu/softmax.cpp,
// GemmPath::kAmxTiles), whose products are too small for oneDNN's brgemm to pay for its calls.
//
// oneDNN's brgemm (torch's cpublas::brgemm) keeps a thread-local record of the tile configuration
// it loaded last and skips its own `ldtilecfg` while that record matches.  Before loading ours,
// AmxTileScope therefore calls cpublas::brgemm_release, which releases the tiles and clears that
// record, so that the next brgemm call on the thread configures the tiles again.
//
// Compiled in only where the build targets AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on a
// Xeon with AMX, or -march=sapphirerapids); chosen at run time only where the CPU has them and
// Linux grants the process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ATTNKIT_HAVE_AMX_TILES 1
#include <immintrin.h>
#include <ATen/native/CPUBlas.h>
#endif

namespace attnkit {

// Whether this build has the own AMX kernels (compiled for AMX-TILE, AMX-BF16, AVX512-BF16).
constexpr bool kHaveAmxTiles =
#if defined(ATTNKIT_HAVE_AMX_TILES)
    true;
#else
    false;
#endif

// Whether this process may use the AMX tile state: Linux's arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), asked once per process (gemm_path.cpp).  False on other systems.
bool amx_tile_state_permitted();

// The 64-byte operand of `ldtilecfg` (palette 1): per tile, its rows and bytes per row.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int rows_, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

// Loads a tile configuration on the calling thread (after releasing oneDNN's, above) and
// releases the tiles when it dies.  Movable, like BrgemmRelease: a member of the per-worker
// scratch that run_tasks builds and destroys on the worker's thread; only the last owner releases.
class AmxTileScope {
 public:
  AmxTileScope() = default;
  explicit AmxTileScope(const TileConfig& config) {
#if defined(ATTNKIT_HAVE_AMX_TILES)
    at::native::cpublas::brgemm_release(true);
    config_ = config;
    _tile_loadconfig(&config_);
    active_ = true;
#else
    (void)config;
#endif
  }
  AmxTileScope(AmxTileScope&& o) noexcept : active_(o.active_) { o.active_ = false; }
  AmxTileScope& operator=(AmxTileScope&& o) noexcept {
    std::swap(active_, o.active_);
    return *this;
  }
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;
  ~AmxTileScope() {
#if defined(ATTNKIT_HAVE_AMX_TILES)
    if (active_) _tile_release();
#endif
  }

 private:
  alignas(64) TileConfig config_;
  bool active_ = false;
};

}  // namespace attnkit

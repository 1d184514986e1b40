#!/usr/bin/env bash
# Compile every csrc/**/*.cu with nvcc -c for sm_90a (and the *_sm90.cu files for sm_80 too), to
# catch compile errors on machines without a GPU (the CPU torch wheel cannot link a CUDA
# extension, so nothing is run).  Why sm_80 only there: the other files' device code is the same
# for both targets (their one arch test, mma_sm80.cuh's __CUDA_ARCH__ >= 800, holds for both), so
# a second device pass re-checked nothing and cost ~40% of the check (linear.cu, `nvcc --time`,
# Intel Xeon with AMX, session 24: cicc 18.0 s + ptxas 6.3 s for sm_80 of 63 s; the whole check
# 378 CPU-s, beside the tests on CI's 2 cores); the *_sm90.cu files' sm_80 pass is different code
# (the __trap stubs a non-Hopper build gets).
# Under -std=c++17, the standard torch < 2.13 (the GPU image's 2.11) gives extensions and the
# stricter of the two (torch 2.13 gives C++20); one nvcc call per file (a second call under
# C++20 cost CI another minute of host compilation).
# Files named *_sm90.cu are also checked by .ci/check_sm90_sass.py (their sm_90a machine code).
# Skips, saying so, when nvcc is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_cuda: nvcc not found; skipping the CUDA compile check"
  exit 0
fi
mapfile -t sources < <(find csrc -name '*.cu' | sort)
if [ ${#sources[@]} -eq 0 ]; then
  echo "compile_cuda: no .cu sources under csrc/ yet"
  exit 0
fi
includes=$(python -c "import sysconfig; from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))")
out=$(mktemp -d)
echo "compile_cuda: $(nvcc --version | tail -1); ${#sources[@]} file(s), sm_90a (+ sm_80 for *_sm90.cu), C++17"
# Two at a time (the CI machine has 2 cores; COMPILE_JOBS overrides); each file reports its own failure.
printf '%s\n' "${sources[@]}" | xargs -P "${COMPILE_JOBS:-2}" -I{} sh -c '
  obj="$0/$(echo {} | tr / _).o"
  flags="-O3 -DATTNKIT_WITH_CUDA -DTORCH_EXTENSION_NAME=_C '"$includes"' -Xcompiler -fPIC"
  case {} in *_sm90.cu) flags="$flags -Xptxas -v";; esac
  targets="-gencode arch=compute_90a,code=sm_90a"
  case {} in *_sm90.cu) targets="-gencode arch=compute_80,code=sm_80 $targets";; esac
  if nvcc -c {} -o "$obj" -std=c++17 $flags $targets > "$obj.log" 2>&1; then
    echo "  ok   {}"
  else
    echo "  FAIL {}"; cat "$obj.log"; exit 255
  fi
  # The Hopper kernels: HGMMA / UTMALDG / USETMAXREG in their SASS, no local memory (issue 27).
  case {} in *_sm90.cu)
    python .ci/check_sm90_sass.py "$obj" "$obj.log" > "$obj.sass" 2>&1; rc=$?
    sed "s/^/       /" "$obj.sass"; [ "$rc" -eq 0 ] || exit 255;;
  esac' "$out"
rm -rf "$out"

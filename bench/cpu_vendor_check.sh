#!/usr/bin/env bash
# One command for a session on a CPU kind not measured before (issue 25: an Intel Xeon with AMX,
# or another AMD EPYC generation): checks every tile-GEMM path this CPU can run against the
# float64 reference, then measures, each stage under a deadline, logs in bench/out/vendor/.
#
#   bash bench/cpu_vendor_check.sh            # ~25 min on 2 cores (the bench sweeps dominate)
#   QUICK=1 bash bench/cpu_vendor_check.sh    # tests and bench --quick only (~8 min)
#
# Needs the built extension (README: pip install --no-build-isolation -e .).  On a CPU with AMX
# the default path (ATTNKIT_CPU_GEMM=auto) of bfloat16 / float16 is oneDNN's brgemm: the tests run
# under each forced path, and the bench adds an 'attnkit[cpu] native tiles' row beside the
# default one, so each cell compares both paths and SDPA in one interleaved run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench/out/vendor
mkdir -p "$out"
log="$out/check.log"
: > "$log"
say() { echo "$*" | tee -a "$log"; }
stage() {  # stage NAME SECONDS CMD...: run under a deadline, log its tail, never stop the script
  local name=$1 limit=$2
  shift 2
  say "== $name (deadline ${limit} s): $*"
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || rc=$?
  tail -n 25 "$out/$name.log" >> "$log"
  say "== $name: exit $rc in $((SECONDS - t0)) s"
}

say "== CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
say "== flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512_bf16|avx512_fp16|amx_tile|amx_bf16|amx_fp16)$' | tr '\n' ' ')"
python - <<'EOF' 2>&1 | tee -a "$log"
import attnkit
from attnkit import _dispatch
m = _dispatch.native()
print("attnkit cpu kernels:", m.cpu_kernel_isa())
for dtype in ("bfloat16", "float16", "float32"):
    print(f"  auto tile-GEMM path, {dtype}: {m.cpu_gemm_path(dtype)}")
if hasattr(m, "cpu_bf16_products"):  # ATTNKIT_CPU_BF16's auto choice (gemm_path.h, session 26)
    print(f"  native bfloat16 products: flash tiles {m.cpu_bf16_products('softmax') or 'widened (no AVX512-BF16)'}, "
          f"decoding {m.cpu_bf16_products('decode') or 'widened (no AVX512-BF16)'}")
for family, row in attnkit.backends().items():
    print(f"  {family}: {row['cpu'].kernels}")
EOF

# 1. numerics on every path (the brgemm ones are the new code on an AMX machine)
stage gemm_path_tests 900 python -m pytest tests/csrc -n 2 -q -k "gemm_path"
stage bf16_products_tests 600 python -m pytest tests/csrc/test_cpu_bf16_products.py -n 2 -q
for path in brgemm native; do
  ATTNKIT_CPU_GEMM=$path stage "softmax_cpu_tests_$path" 900 \
    python -m pytest tests/csrc/test_softmax_cpu.py tests/csrc/test_softmax_cpu_options.py -n 2 -q
done

# 2. speed: the quick bench (all families), then the softmax sweep cells of issue 25
stage bench_quick 1200 python -m attnkit bench --quick --out "$out/quick" --no-progress
if [ -z "${QUICK:-}" ]; then
  stage bench_softmax 1500 python -m attnkit bench --family softmax --out "$out/softmax" --no-progress \
    --deadline 1380
  stage bench_sparse_hopfield_bf16 1200 python -m attnkit bench --family sparse,hopfield --match bfloat16 \
    --out "$out/sparse_hopfield_bf16" --no-progress --deadline 1080
  stage softmax_vs_sdpa 900 python bench/softmax_cpu_speed.py sdpa --n 256 1024 --d 64 128
  stage softmax_decode 600 python bench/softmax_cpu_speed.py decode
  # ATTNKIT_CPU_BF16's auto choice checked on this CPU: the native bfloat16 forward (and decode)
  # with the dot products and widened (auto takes the dot products on AMD only, measured on an
  # Intel Xeon: csrc/cpu/gemm_path.h).  On a CPU with AMX, auto runs brgemm: native forced here.
  for products in dot float32; do
    ATTNKIT_CPU_GEMM=native ATTNKIT_CPU_BF16=$products stage "bf16_products_$products" 600 \
      python bench/softmax_cpu_speed.py sdpa --n 256 1024 --d 64 128 --dtypes bfloat16
    ATTNKIT_CPU_GEMM=native ATTNKIT_CPU_BF16=$products stage "bf16_decode_$products" 300 \
      python bench/softmax_cpu_speed.py decode --dtype bfloat16
  done
fi
say "== done: logs in $out (check.log holds each stage's tail)"

"""What CPU this is: model, vendor and the instruction-set extensions attnkit's CPU kernels (and
torch's) pick between -- recorded by the benchmarks and printed by CI, because the kernels tuned
on one vendor can lose on the other (DESIGN.md, "Two CPU vendors")."""
from __future__ import annotations

import functools
import platform

# /proc/cpuinfo flag -> the name shown (in this order).
ISA_FLAGS = {
    "avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512F", "avx512bw": "AVX-512BW",
    "avx512_vnni": "AVX-512 VNNI", "avx512_bf16": "AVX-512 BF16", "avx512_fp16": "AVX-512 FP16",
    "amx_tile": "AMX tile", "amx_bf16": "AMX BF16", "amx_int8": "AMX INT8",
}


def parse_cpuinfo(text: str) -> dict:
    """{"model", "vendor", "isa": [names of ISA_FLAGS present]} from /proc/cpuinfo's text (its
    first processor block)."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(fields.get("vendor_id", ""),
                                                                  fields.get("vendor_id") or "unknown")
    return {"model": fields.get("model name") or platform.processor() or platform.machine(),
            "vendor": vendor, "isa": [name for flag, name in ISA_FLAGS.items() if flag in flags]}


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """This machine's :func:`parse_cpuinfo` (model from ``platform`` where /proc/cpuinfo is
    missing; isa then empty)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return {"model": platform.processor() or platform.machine(), "vendor": "unknown", "isa": []}


def describe(info: dict) -> str:
    """One line: 'AMD EPYC (AMD; AVX2, FMA)'."""
    return f"{info['model']} ({info['vendor']}; {', '.join(info['isa']) or 'no AVX2 / AVX-512 / AMX'})"

"""Interleaved CPU timings of the softmax kernels (issues 25 and 28), for kernel work on a shared
machine: every implementation of a comparison runs in one process, alternating (A, B, A, B, ...),
each round's figure the median of a few calls, each implementation's figure the min of the rounds'.
Ratios are what to quote (the machines are shared and noisy); name the CPU with them.

    python bench/softmax_cpu_speed.py band [--heads 1] [--n 16384] [--rounds 3]
        issue 28: the window (1023, 0) band forward against the full causal forward (and
        (1024, 0)), attnkit's cpu backend both.
    python bench/softmax_cpu_speed.py sdpa [--n 256 1024] [--d 64 128] [--rounds 5] [--dtypes float16]
            [--paths native auto]
        issue 25: attnkit's cpu forward (and forward+backward) against torch SDPA, float32 and
        bfloat16 (--dtypes: others, float16 among them), causal and not, B=1 H=8.  --paths: time
        attnkit under each of these ATTNKIT_CPU_GEMM values, side by side ("attnkit[native]", ...).
    python bench/softmax_cpu_speed.py decode [--m 4096] [--variants 0 1] [--rounds 5] [--dtype bfloat16]
        issue 25: the decoding forward (float32 unless --dtype) (B=8 Hq=32 Hk=8 N=1 D=128) against torch SDPA,
        as GB/s of K and V read and as a fraction of the bench's copy bandwidth (64 MiB copy_,
        read + write counted), with a read-only probe (torch.sum of a K+V-sized float32 tensor).
        --variants: values of ATTNKIT_DECODE_VARIANT to time side by side (a kernel under
        experiment may read it; the committed kernel ignores it).
    --base PATH  a second build of csrc/cpu/softmax.cpp loaded with torch.utils.cpp_extension
        (a module exposing fwd(q, k, v, mask, scale, causal, wl, wr, softcap, alibi) and bwd(...))
        to time the kernel before a change in the same process ("base" rows).
Not a test: nothing here runs in the suite.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit


def _time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def interleaved(impls: dict, rounds: int, reps: int) -> dict:
    for fn in impls.values():  # warm up (packing buffers, thread pool)
        fn()
    best = {name: math.inf for name in impls}
    for _ in range(rounds):
        for name, fn in impls.items():
            best[name] = min(best[name], _time(fn, reps))
    return best


def _load_base(path):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("softmax_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def band(args) -> None:
    n, d, h = args.n, 64, args.heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for _ in range(3))
    base = _load_base(args.base)
    scale = d ** -0.5
    impls = {}
    with torch.no_grad():
        impls["full causal"] = lambda: attnkit.softmax_attention(q, k, v, is_causal=True)
        impls["window (1023,0)"] = lambda: attnkit.softmax_attention(q, k, v, is_causal=True, window=(1023, 0))
        impls["window (1024,0)"] = lambda: attnkit.softmax_attention(q, k, v, is_causal=True, window=(1024, 0))
        if base is not None:
            impls["base full causal"] = lambda: base.fwd(q, k, v, None, scale, True, -1, -1, 0.0, None)
            impls["base window (1023,0)"] = lambda: base.fwd(q, k, v, None, scale, True, 1023, 0, 0.0, None)
        best = interleaved(impls, args.rounds, args.reps)
    full = best["full causal"]
    print(f"band: B=1 H={h} N={n} D={d} float32 forward, {torch.get_num_threads()} threads, "
          f"min of {args.rounds} rounds x median of {args.reps}")
    for name, t in best.items():
        ref = best["base full causal"] if name.startswith("base") else full
        print(f"  {name:24s} {1e3 * t:9.1f} ms   full causal / this = {ref / t:5.2f}x")


def _under_paths(paths, fn) -> dict:
    """``fn`` as "attnkit" (paths None: the setting as it is), or as "attnkit[p]" under
    ATTNKIT_CPU_GEMM=p for each p (the kernels read it on every call)."""
    if not paths:
        return {"attnkit": fn}

    def under(path):
        def call():
            os.environ["ATTNKIT_CPU_GEMM"] = path
            return fn()
        return call
    return {f"attnkit[{p}]": under(p) for p in paths}


def sdpa(args) -> None:
    base = _load_base(args.base)
    print(f"sdpa: B=1 H=8, {torch.get_num_threads()} threads, min of {args.rounds} rounds x median of {args.reps}")
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for n in args.n:
            for d in args.d:
                for causal in (False, True):
                    for mode in args.modes:
                        g = torch.Generator().manual_seed(0)
                        q, k, v = (torch.randn(1, 8, n, d, generator=g).to(dtype) for _ in range(3))
                        scale = d ** -0.5
                        if mode == "fwd":
                            impls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
                            impls.update(_under_paths(args.paths, lambda: attnkit.softmax_attention(
                                q, k, v, is_causal=causal)))
                            if base is not None:
                                impls["base"] = lambda: base.fwd(q, k, v, None, scale, causal, -1, -1, 0.0, None)
                            with torch.no_grad():
                                best = interleaved(impls, args.rounds, args.reps)
                        else:
                            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                            go = torch.randn_like(q)

                            def run(f):
                                return lambda: torch.autograd.backward(f(qg, kg, vg), go)
                            impls = {"sdpa": run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c,
                                                                                                 is_causal=causal))}
                            impls.update(_under_paths(args.paths, run(lambda a, b, c: attnkit.softmax_attention(
                                a, b, c, is_causal=causal))))
                            best = interleaved(impls, args.rounds, args.reps)
                        pairs = n * n if not causal else n * (n + 1) // 2
                        gf = 4 * 8 * d * pairs * (3.5 if mode != "fwd" else 1.0) / 1e9
                        line = (f"  {str(dtype)[6:]:8s} N={n:5d} D={d:3d} {'causal' if causal else 'full  '} {mode:7s}"
                                f" sdpa {1e3 * best['sdpa']:7.2f} ms ({gf / best['sdpa']:5.0f} GF/s)")
                        for name in best:
                            if name.startswith("attnkit"):
                                line += (f"  {name} {1e3 * best[name]:7.2f} ms ({gf / best[name]:5.0f} GF/s)"
                                         f"  ratio {best['sdpa'] / best[name]:5.2f}x")
                        if "base" in best:
                            new = next(name for name in best if name.startswith("attnkit"))
                            line += f"  base ratio {best['sdpa'] / best['base']:5.2f}x (new/base {best['base'] / best[new]:4.2f}x)"
                        print(line, flush=True)


def decode(args) -> None:
    import os

    b, h, hk, n, m, d = 8, 32, 8, (args.n or [1])[0], args.m, 128  # --n: query rows per head (N <= 16)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    k = torch.randn(b, hk, m, d, generator=g).to(dtype)
    v = torch.randn(b, hk, m, d, generator=g).to(dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    x = torch.ones(64 * 2**20, dtype=torch.uint8)
    y = torch.empty_like(x)
    big = torch.ones(kv_bytes // 4)

    def variant(val):
        # "VAR" or "VAR,NAME=VALUE,...": ATTNKIT_DECODE_VARIANT and ATTNKIT_DECODE_<NAME>
        var, *extra = str(val).split(",")
        env = {"ATTNKIT_DECODE_VARIANT": var}
        env.update({f"ATTNKIT_DECODE_{kv.split('=')[0]}": kv.split("=")[1] for kv in extra})

        def fn():
            os.environ.update(env)
            return attnkit.softmax_attention(q, k, v, enable_gqa=True)
        return fn

    impls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "copy 64MiB": lambda: y.copy_(x), "sum K+V": lambda: big.sum()}
    for val in args.variants:
        impls[f"attnkit v{val}"] = variant(val)
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for val in args.variants:
            err = (impls[f"attnkit v{val}"]().float() - ref.float()).abs().max().item()
            assert err < (1e-4 if dtype == torch.float32 else 2e-2), (val, err)
        best = interleaved(impls, args.rounds, args.reps)
    copy = 2 * x.numel() / best["copy 64MiB"] / 1e9
    print(f"decode: B={b} Hq={h} Hk={hk} N={n} M={m} D={d} {args.dtype}, {torch.get_num_threads()} threads, "
          f"min of {args.rounds} rounds x median of {args.reps}; copy {copy:.1f} GB/s (read + write), "
          f"sum (read only) {kv_bytes / best['sum K+V'] / 1e9:.1f} GB/s = {kv_bytes / best['sum K+V'] / 1e9 / copy:.0%} of copy")
    for name, t in best.items():
        if name.startswith("attnkit") or name == "sdpa":
            gbs = kv_bytes / t / 1e9
            print(f"  {name:14s} {1e3 * t:8.2f} ms  {gbs:5.1f} GB/s = {gbs / copy:4.0%} of copy"
                  f"  sdpa/this {best['sdpa'] / t:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("band", "sdpa", "decode"))
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--variants", nargs="+", default=["0"])
    ap.add_argument("--n", type=int, nargs="+", default=None, help="decode: the first is N (query rows, default 1)")
    ap.add_argument("--d", type=int, nargs="+", default=[64])
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["fwd"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16", "float16"),
                    help="sdpa: the dtypes to time")
    ap.add_argument("--paths", nargs="+", default=None,
                    help="sdpa: ATTNKIT_CPU_GEMM values to time attnkit under, side by side")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="decode: the dtype of Q, K and V")
    ap.add_argument("--base", default=None)
    args = ap.parse_args()
    if args.what == "band":
        args.n = (args.n or [16384])[0]
        args.reps = min(args.reps, 3)
        band(args)
    elif args.what == "decode":
        decode(args)
    else:
        args.n = args.n or [1024]
        sdpa(args)


if __name__ == "__main__":
    main()

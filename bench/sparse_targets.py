"""Issue 4's CPU targets for attnkit.sparse_attention (cpu backend), B=1 H=8 D=64 float32:

1. causal strided, stride 64, N=4096 (~3% of the causal triangle), forward: against
   FlexAttention (torch.compile'd, BlockMask from the same mask; target >= 5x) and our own dense
   causal softmax attention (target >= 4x); effective GFLOP/s counted on the kept entries only,
   against the dense kernel's GFLOP/s on its own (causal) entries (goal >= 50%).  Also
   forward+backward against dense causal (FlexAttention has no CPU backward).
2. fixed (stride 64, summary 8, causal) and star (relay 0, radius 1) against dense causal (>= 4x).
3. cost vs N with stride = sqrt(N), N = 1024 .. 16384: the fitted exponent of t ~ N^p (the
   kept entries grow like N^1.5).
4. issue 14: kept-entry GFLOP/s against the dense kernel's (goal >= 50%), forward and
   forward+backward, at N = 4096 (in 1.) and N = 16384, strided(64).

Run: ``python -m attnkit.bench.sparse_targets [threads] [--quick | --efficiency [--cpu-time]]``.  Timings are medians of
interleaved rounds (attnkit.bench.harness.interleaved_medians): the machines are shared.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import attnkit
from attnkit import patterns
from attnkit.bench.harness import interleaved_medians

B, H, D = 1, 8, 64


def _inputs(n, grad=False):
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(B, H, n, D, generator=gen).requires_grad_(grad) for _ in range(3)]
    return qkv + [torch.randn(B, H, n, D, generator=gen)]


def _fwd(fn, q, k, v, g):
    with torch.no_grad():
        fn(q, k, v)


def _fwd_bwd(fn, q, k, v, g):
    fn(q, k, v).backward(g)
    q.grad = k.grad = v.grad = None


def _dense_causal(q, k, v):
    return attnkit.softmax_attention(q, k, v, is_causal=True, backend="cpu")


def _sparse(pattern):
    return lambda q, k, v: attnkit.sparse_attention(q, k, v, pattern, backend="cpu")


def _flex(mask):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = mask.shape[-1]
    block_mask = create_block_mask(lambda b, h, i, j: mask[i, j], None, None, n, n, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _gflops(entries, seconds, passes=1.0):
    return 4.0 * B * H * D * entries * passes / seconds / 1e9


def targets(n=4096, stride=64, rounds=5):
    causal_entries = n * (n + 1) // 2
    p = patterns.strided(stride)
    mask = p.mask(n)
    kept = int(mask.sum())
    args = _inputs(n)
    contenders = {"attnkit sparse": (_sparse(p), args), "attnkit dense causal": (_dense_causal, args)}
    try:
        flex = _flex(mask)
        flex(*args[:3])  # compile outside the timing
        contenders["FlexAttention"] = (flex, args)
    except Exception as exc:  # noqa: BLE001 - report and go on without the peer
        print(f"FlexAttention unavailable: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    med = interleaved_medians(contenders, rounds, _fwd)
    ours, dense = med["attnkit sparse"], med["attnkit dense causal"]
    print(f"strided({stride}) N={n} density {kept / n / n:.4f} ({kept / causal_entries:.3f} of causal), forward:")
    for name, t in med.items():
        print(f"  {name:22s} {t * 1e3:9.2f} ms")
    if "FlexAttention" in med:
        print(f"  vs FlexAttention: {med['FlexAttention'] / ours:.2f}x  (target >= 5)")
    eff, dense_rate = _gflops(kept, ours), _gflops(causal_entries, dense)
    print(f"  vs dense causal:  {dense / ours:.2f}x  (target >= 4)")
    print(f"  effective {eff:.1f} GFLOP/s on kept entries vs dense kernel {dense_rate:.1f} GFLOP/s: "
          f"{100 * eff / dense_rate:.0f}%  (goal >= 50%)")

    args = _inputs(n, grad=True)
    med = interleaved_medians({"sparse": (_sparse(p), args), "dense": (_dense_causal, args)},
                              max(3, rounds - 2), _fwd_bwd)
    print(f"  forward+backward: sparse {med['sparse'] * 1e3:.1f} ms, dense causal "
          f"{med['dense'] * 1e3:.1f} ms: {med['dense'] / med['sparse']:.2f}x")
    _print_efficiency(kept, causal_entries, med, "forward+backward")

    args = _inputs(n)
    others = {"fixed(64, summary=8)": patterns.fixed(stride, 8), "star(0, radius=1)": patterns.star(0, 1)}
    contenders = {name: (_sparse(q), args) for name, q in others.items()}
    contenders["dense causal"] = (_dense_causal, args)
    med = interleaved_medians(contenders, rounds, _fwd)
    for name, q in others.items():
        kept = round(q.density(n) * n * n)
        print(f"{name} N={n}, forward: {med[name] * 1e3:.2f} ms, vs dense causal "
              f"{med['dense causal'] / med[name]:.2f}x (target >= 4), effective "
              f"{_gflops(kept, med[name]):.1f} GFLOP/s")


def _strided_kept(n, stride):
    """Entries of the causal strided(stride) mask at length n, counted in row blocks (the
    N x N mask of N = 16384 would take 2 GiB as int64 index grids)."""
    j = torch.arange(n)[None, :]
    kept = 0
    for r0 in range(0, n, 1024):
        d = torch.arange(r0, min(n, r0 + 1024))[:, None] - j
        kept += int(((d >= 0) & ((d <= stride) | (d % stride == 0))).sum())
    return kept


def _print_efficiency(kept, causal_entries, med, what):
    """Kept-entry GFLOP/s of the sparse call against the dense causal kernel's on its own
    entries; forward+backward counts 3.5 forwards (as bench/sparse.py), for both alike."""
    passes = 3.5 if "backward" in what else 1.0
    eff = _gflops(kept, med["sparse"], passes)
    dense_rate = _gflops(causal_entries, med["dense"], passes)
    print(f"  {what}: effective {eff:.1f} GFLOP/s on kept entries vs dense kernel "
          f"{dense_rate:.1f}: {100 * eff / dense_rate:.0f}%  (goal >= 50%)")


def _thread_time_medians(contenders, rounds, call):
    """interleaved_medians, timed in CPU time of the calling thread (time.thread_time): with one
    intra-op thread every kernel runs on it, and the time no longer counts the waits for a core
    that a loaded shared machine adds to wall time (seen: 7.7 -> 78 ms for the same call)."""
    import statistics
    import time

    for fn, args in contenders.values():
        call(fn, *args)
    times = {name: [] for name in contenders}
    for r in range(rounds):
        for name in (list(contenders) if r % 2 == 0 else list(contenders)[::-1]):
            fn, args = contenders[name]
            t = time.thread_time()
            call(fn, *args)
            times[name].append(time.thread_time() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def efficiency(n, stride=64, rounds=3, cpu_time=False):
    """Issue 14: kept-entry GFLOP/s of strided(stride) against the dense causal kernel, forward
    and forward+backward, interleaved in one process (no FlexAttention: at N = 16384 it runs
    the dense masked cost, seconds per call).  ``cpu_time``: one thread, CPU time (see
    _thread_time_medians)."""
    kept, causal_entries = _strided_kept(n, stride), n * (n + 1) // 2
    p = patterns.strided(stride)
    timer = _thread_time_medians if cpu_time else interleaved_medians
    clock = "CPU time, 1 thread" if cpu_time else f"wall time, {torch.get_num_threads()} threads"
    print(f"strided({stride}) N={n}: {kept / causal_entries:.4f} of the causal entries ({clock})")
    for what, grad, fn in (("forward", False, _fwd), ("forward+backward", True, _fwd_bwd)):
        args = _inputs(n, grad=grad)
        med = timer({"sparse": (_sparse(p), args), "dense": (_dense_causal, args)}, rounds, fn)
        print(f"  {what}: sparse {med['sparse'] * 1e3:.1f} ms, dense causal {med['dense'] * 1e3:.1f} ms "
              f"({med['dense'] / med['sparse']:.1f}x)")
        _print_efficiency(kept, causal_entries, med, what)


def scaling(ns=(1024, 2048, 4096, 8192, 16384), rounds=5):
    """t(N) with stride = sqrt(N): least-squares slope of log t on log N."""
    contenders = {}
    for n in ns:
        contenders[n] = (_sparse(patterns.strided(int(math.isqrt(n)))), _inputs(n))
    med = interleaved_medians(contenders, rounds, _fwd)
    xs = [math.log(n) for n in ns]
    ys = [math.log(med[n]) for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    for n in ns:
        print(f"  strided(sqrt N) N={n:6d}: {med[n] * 1e3:9.2f} ms")
    print(f"cost exponent (t ~ N^p, stride = sqrt N, N {ns[0]}..{ns[-1]}, forward): p = {slope:.2f} (ideal 1.5)")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        torch.set_num_threads(int(args[0]))
    quick = "--quick" in sys.argv
    if "--cpu-time" in sys.argv:
        torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if quick:
        targets(n=1024, stride=32, rounds=3)
        scaling(ns=(256, 1024, 4096), rounds=3)
    elif "--efficiency" in sys.argv:  # issue 14's two sizes only
        cpu = "--cpu-time" in sys.argv
        efficiency(4096, rounds=5, cpu_time=cpu)
        efficiency(16384, rounds=3, cpu_time=cpu)
    else:
        targets()
        efficiency(16384)
        scaling()


if __name__ == "__main__":
    main()

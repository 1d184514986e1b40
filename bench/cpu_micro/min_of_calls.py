"""One implementation's minimum call time over ~3 s of back-to-back calls, for A/B runs of two
builds on a noisy machine (session 18): run it alternately in fresh processes, each build first on
PYTHONPATH.  MODE fwd (default): the forward, no gradient; fwdbwd: the forward and
torch.autograd.grad of q, k, v (session 19).  Not a test.

    python bench/cpu_micro/min_of_calls.py N D CAUSAL(0|1) DTYPE [THREADS] [MODE]
"""
import sys
import time

import torch

import attnkit

torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 1)
N = int(sys.argv[1])
D = int(sys.argv[2])
causal = sys.argv[3] == '1'
dt = getattr(torch, sys.argv[4])
backward = (sys.argv[6] if len(sys.argv) > 6 else "fwd") == "fwdbwd"
torch.manual_seed(0)
q, k, v = [torch.randn(1, 8, N, D, dtype=dt, requires_grad=backward) for _ in range(3)]
g = torch.randn(1, 8, N, D, dtype=dt)


def f():
    out = attnkit.softmax_attention(q, k, v, is_causal=causal)
    if backward:
        torch.autograd.grad(out, (q, k, v), g)


f()
ts = []
t_end = time.perf_counter() + 3
while time.perf_counter() < t_end:
    t = time.perf_counter()
    f()
    ts.append(time.perf_counter() - t)
ts.sort()
print(f"min {ts[0]*1e3:.3f} p10 {ts[len(ts)//10]*1e3:.3f} ms (n={len(ts)})")

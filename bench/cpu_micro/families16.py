"""float16 against bfloat16 in the other CPU families' training calls, one process: the sparse
strided(64, causal) and the causal linear forward+backward (B=1 H=8 N=4096 D=64) and the Hopfield
update (S=256 N=65536 D=64, 3 steps); each the min over 5 rounds of a round's median.  A float16
figure well above bfloat16's points at scalar float16 conversions (c10::Half's do not vectorize:
csrc/cpu/convert16.h, session 26).  Not a test.

    python bench/cpu_micro/families16.py [THREADS]
"""
import sys
import time

import torch

import attnkit

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


def timed(f, rounds=5, seconds=0.4):
    best = []
    for _ in range(rounds):
        f()
        ts = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        ts.sort()
        best.append(ts[len(ts) // 2])
    return min(best) * 1e3


torch.manual_seed(0)
for dtype in (torch.float16, torch.bfloat16):
    grad = torch.randn(1, 8, 4096, 64, dtype=dtype)
    q, k, v = (torch.randn(1, 8, 4096, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    pattern = attnkit.patterns.strided(64, causal=True)

    def sparse():
        torch.autograd.grad(attnkit.sparse_attention(q, k, v, pattern), (q, k, v), grad)

    def linear():
        torch.autograd.grad(attnkit.linear_attention(q, k, v, causal=True), (q, k, v), grad)

    stored = torch.randn(1, 1, 65536, 64, dtype=dtype)
    state = torch.randn(1, 1, 256, 64, dtype=dtype)

    def hopfield():
        attnkit.hopfield_update(state, stored, beta=0.125, steps=3)

    print(f"{str(dtype):15} sparse strided fwd+bwd {timed(sparse):7.2f} ms   linear causal fwd+bwd "
          f"{timed(linear):7.2f} ms   hopfield S=256 {timed(hopfield):7.2f} ms", flush=True)

"""Issue 5's CPU targets for attnkit.linear_attention (cpu backend), causal elu, B=1 H=8 D=64:
fwd+bwd vs hand-written PyTorch at N=4096, t(16384)/t(4096), and the crossover N against
attnkit.softmax_attention.  Run: ``python -m attnkit.bench.linear_targets [threads]``.

Interleaved repetitions (the machine is shared and noisy): each round runs every contender
once; the median per contender over rounds is reported, and ratios.
"""
import sys

import torch
import torch.nn.functional as F

import attnkit
from attnkit.bench.harness import interleaved_medians as race


def phi(x):
    return F.elu(x) + 1.0


def masked_quadratic(q, k, v, eps=1e-6):
    pq, pk = phi(q), phi(k)
    n = q.shape[2]
    a = (pq @ pk.transpose(-2, -1)) * torch.ones(n, n, dtype=torch.bool).tril()
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def cumsum_outer(q, k, v, eps=1e-6):
    pq, pk = phi(q), phi(k)
    s = torch.einsum("bhnd,bhne->bhnde", pk, v).cumsum(2)
    z = pk.cumsum(2)
    num = torch.einsum("bhnd,bhnde->bhne", pq, s)
    return num / ((pq * z).sum(-1, keepdim=True) + eps)


def ours(q, k, v):
    return attnkit.linear_attention(q, k, v, causal=True, feature_map="elu", backend="cpu")


def softmax_causal(q, k, v):
    return attnkit.softmax_attention(q, k, v, is_causal=True, backend="cpu")


def fwd_bwd(fn, q, k, v, g):
    out = fn(q, k, v)
    out.backward(g)
    q.grad = k.grad = v.grad = None


def fwd_only(fn, q, k, v, g):
    with torch.no_grad():
        fn(q, k, v)


def inputs(b, h, n, d, grad=True):
    torch.manual_seed(0)
    qkv = [torch.randn(b, h, n, d, requires_grad=grad) for _ in range(3)]
    return qkv + [torch.randn(b, h, n, d)]


def main():
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    # 1. the speed target: B=1 H=8 N=4096 D=64 fp32 causal elu fwd+bwd
    args = inputs(1, 8, 4096, 64)
    med = race({"attnkit cpu": (ours, args), "masked quadratic": (masked_quadratic, args),
                "cumsum outer": (cumsum_outer, args)}, 5, fwd_bwd)
    for name, t in med.items():
        print(f"N=4096 fwd+bwd  {name:18s} {t * 1e3:9.1f} ms")
    best = min(med["masked quadratic"], med["cumsum outer"])
    print(f"speedup vs the better PyTorch version: {best / med['attnkit cpu']:.1f}x")

    # 2. linear cost: t(16384) / t(4096), interleaved
    a4, a16 = inputs(1, 8, 4096, 64), inputs(1, 8, 16384, 64)
    med = race({"4096": (ours, a4), "16384": (ours, a16)}, 7, fwd_bwd)
    print(f"fwd+bwd t(16384)/t(4096) = {med['16384'] / med['4096']:.2f} "
          f"({med['4096'] * 1e3:.1f} ms, {med['16384'] * 1e3:.1f} ms)")
    med = race({"4096": (ours, a4), "16384": (ours, a16)}, 7, fwd_only)
    print(f"fwd     t(16384)/t(4096) = {med['16384'] / med['4096']:.2f} "
          f"({med['4096'] * 1e3:.1f} ms, {med['16384'] * 1e3:.1f} ms)")

    # 3. crossover with attnkit.softmax_attention (cpu), causal, B=1 H=8 D=64
    for mode_name, mode in (("fwd", fwd_only), ("fwd+bwd", fwd_bwd)):
        for n in (64, 128, 256, 512, 1024, 2048, 4096):
            args = inputs(1, 8, n, 64)
            med = race({"linear": (ours, args), "softmax": (softmax_causal, args)},
                       9 if n <= 1024 else 5, mode)
            print(f"crossover {mode_name:7s} N={n:5d}: linear {med['linear'] * 1e3:8.2f} ms, "
                  f"softmax {med['softmax'] * 1e3:8.2f} ms, softmax/linear {med['softmax'] / med['linear']:.2f}")


if __name__ == "__main__":
    main()

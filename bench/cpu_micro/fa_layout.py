"""FlashAttention's [B, N, H, D] layout against attnkit's dense [B, H, N, D] on the CPU kernels
(session 33): attnkit.flash_attn_interface's calls, the same inputs made dense and passed to
attnkit.softmax_attention, torch SDPA on the dense ones; then the backward op alone with each of
its inputs in the strided layout.  One thread, min of 4 rounds of 2 calls, alternated.  Not a test.

    python bench/cpu_micro/fa_layout.py
"""
import time

import torch

import attnkit
from attnkit.flash_attn_interface import flash_attn_func

torch.set_num_threads(1)
B, N, H, D = 1, 1024, 8, 64


def best(cases, rounds=4):
    res = {}
    for _ in range(rounds):
        for name, f in cases.items():
            f()
            start = time.perf_counter()
            f()
            f()
            res[name] = min(res.get(name, 1e9), (time.perf_counter() - start) / 2 * 1e3)
    return res


for dt in (torch.float32, torch.bfloat16):
    for causal in (False, True):
        q, k, v, g = (torch.randn(B, N, H, D, dtype=dt, requires_grad=True) for _ in range(4))
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt = g.detach().transpose(1, 2).contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        res = best({
            "fwd flash_attn_func": lambda: flash_attn_func(q, k, v, causal=causal),
            "fwd softmax_attention dense": lambda: attnkit.softmax_attention(qt, kt, vt, is_causal=causal),
            "fwd SDPA dense": lambda: sdpa(qt, kt, vt, is_causal=causal),
            "fwd+bwd flash_attn_func": lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=causal), (q, k, v), g),
            "fwd+bwd softmax_attention dense": lambda: torch.autograd.grad(
                attnkit.softmax_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), gt),
            "fwd+bwd SDPA dense": lambda: torch.autograd.grad(sdpa(qt, kt, vt, is_causal=causal), (qt, kt, vt), gt),
        })
        print(f"{str(dt).replace('torch.', '')} causal={causal}: " + ", ".join(f"{n} {t:.2f} ms" for n, t in res.items()))

# The backward op alone, float32, each input strided as [B, N, H, D] memory in turn.
q, k, v, g = (torch.randn(B, N, H, D) for _ in range(4))
dense = [x.transpose(1, 2).contiguous() for x in (g, q, k, v)]
strided = [x.transpose(1, 2) for x in (g, q, k, v)]
out, lse = attnkit.softmax_attention(*dense[1:], return_lse=True)
op = torch.ops.attnkit.softmax_bwd
cases = {"dense": dense}
for i, name in enumerate(("dO", "Q", "K", "V")):
    cases[f"strided {name}"] = [strided[j] if j == i else dense[j] for j in range(4)]
cases["all strided"] = strided
res = best({name: (lambda a=a: op(*a, out, lse, None, 0.125, False)) for name, a in cases.items()})
print("backward op float32: " + ", ".join(f"{n} {t:.2f} ms" for n, t in res.items()))

"""Peak extra memory of attnkit.softmax_attention at long N (issue 3's O(N) memory check).

Run: ``python -m attnkit.bench.softmax_memory [--n 16384] [--heads 8] [--dim 64]``.
Prints, for forward and forward+backward, causal or not, the peak memory one call allocates
(outputs and gradients included) and the scratch beyond what the call returns.
"""
from __future__ import annotations

import argparse

import torch

import attnkit

from .harness import measure_memory


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)
    shape = (1, args.heads, args.n, args.dim)
    q, k, v = (torch.randn(shape) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    mib = 2.0**20
    for causal in (False, True):

        def forward():
            return attnkit.softmax_attention(q, k, v, is_causal=causal)

        def forward_backward():
            out = attnkit.softmax_attention(qg, kg, vg, is_causal=causal)
            out.sum().backward()
            return out

        for name, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
            m = measure_memory(step, torch.device("cpu"))
            grads = 3 * q.numel() * q.element_size() if name == "fwd+bwd" else 0
            print(
                f"N={args.n} H={args.heads} D={args.dim} fp32 causal={causal} {name}: "
                f"peak {m['peak_bytes'] / mib:.1f} MiB, of which output {m['retained_bytes'] / mib:.1f} MiB"
                f" and gradients {grads / mib:.1f} MiB; scratch beyond them "
                f"{(m['peak_bytes'] - m['retained_bytes'] - grads) / mib:.1f} MiB"
            )


if __name__ == "__main__":
    main()

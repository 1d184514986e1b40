"""Host (Python) time per call of ``softmax_attention(backend="triton")``, kernels stubbed out.

Issue 26 asks the eager host time of a CUDA call to be within 10 us of SDPA's.  The device part
needs a GPU; the Python around the kernels does not: this runs the triton backend on CPU tensors
under the Triton interpreter with every kernel launch of kernels/softmax.py replaced by a no-op,
so what is timed is attnkit's own call path (validation, routing, autograd, launcher set-up).

    python bench/triton_host_path.py [--reps 1000] [--rounds 5]

Prints the minimum over rounds of the mean per call: the no-grad forward and forward+backward
(torch.autograd.grad) at B=H=1 N=17 D=64 float16 (17 rows: past the decode kernel's 16), plus
the same forward with a window option.  To compare two trees, run it once with each on
PYTHONPATH, alternating.  Session 15 (AMD EPYC Zen 3, the old and new trees alternating):
forward 88.7 -> 58.5 us, forward+backward 361 -> 244 us.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton / attnkit are imported
os.environ.setdefault("ATTNKIT_TRITON_HOPPER", "0")

import torch  # noqa: E402


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _best_us(fn, reps: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        for _ in range(20):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    import attnkit
    from attnkit.kernels import softmax as kernels

    kernels._launch = lambda *a, **k: None  # the Triton kernels of the forward and backward
    kernels.wrap_triton = lambda kernel: _NoLaunch()  # the backward's preprocess kernel
    shape = (1, 1, 17, 64)
    q, k, v = (torch.randn(shape, dtype=torch.float16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.ones(shape, dtype=torch.float16)

    def fwd():
        return attnkit.softmax_attention(q, k, v, is_causal=True, backend="triton")

    def fwd_window():
        return attnkit.softmax_attention(q, k, v, is_causal=True, window=(7, 0), backend="triton")

    def fwd_bwd():
        out = attnkit.softmax_attention(qg, kg, vg, is_causal=True, backend="triton")
        return torch.autograd.grad(out, (qg, kg, vg), g)

    print(f"attnkit {attnkit.__file__}; kernels stubbed; B=H=1 N=17 D=64 float16, causal")
    print(f"  forward, no grad      {_best_us(fwd, args.reps, args.rounds):8.1f} us")
    print(f"  forward, window (7,0) {_best_us(fwd_window, args.reps, args.rounds):8.1f} us")
    print(f"  forward + backward    {_best_us(fwd_bwd, max(1, args.reps // 3), args.rounds):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

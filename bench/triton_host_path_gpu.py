"""Host time per call of ``softmax_attention(backend="triton")`` on a GPU (issue 26), beside SDPA's.

bench/triton_host_path.py times attnkit's Python with the kernels stubbed (it runs on a CPU).
This one needs CUDA and runs everything for real, to split a call's host time into its parts:

- **issue rate**: ``reps`` calls issued back to back, one synchronize at the end, at a size whose
  GPU time is far below the host time (B=H=1, N=17, D=64, bfloat16): the mean wall per call is
  the host path (attnkit's Python, Triton's launcher, the CUDA launches).  Each row's CUDA-event
  time per call is printed beside it: where it comes near the wall, the row is GPU-bound and
  says nothing about the host;
- the same for torch SDPA (the issue's yardstick: attnkit's eager call within 10 us of it), for
  the launcher layer alone (``attnkit.kernels.softmax.softmax_fwd``: no op layer) and for an empty
  Triton kernel (Triton's own launcher: the floor of any Triton op);
- **return time at the options bench's shape** (B=4 H=8 N=16384 D=128, bfloat16, causal, window
  (1023, 0)): the wall until the call returns, without a synchronize, against the GPU time.  The
  session-15 options bench reported 1.494 ms of "Python and launches" per call there, which the
  stubbed CPU figures (~0.09 ms) do not explain.

    python bench/triton_host_path_gpu.py [--reps 2000] [--rounds 5] [--no-large]

Prints min over rounds of the mean per call, in microseconds.  Not a test.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - main() says what is missing
    triton = None
else:
    @triton.jit
    def _empty(x_ptr, n):  # Triton's launcher alone: a kernel that does nothing
        tl.program_id(0)


def _issue_rate_us(fn, reps: int, rounds: int) -> tuple[float, float]:
    """(min over rounds of the wall per call with one synchronize per round, the CUDA-event
    time per call of that round)."""
    best_wall, gpu = float("inf"), float("nan")
    for _ in range(rounds):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps * 1e6
        if wall < best_wall:
            best_wall, gpu = wall, start.elapsed_time(end) * 1e3 / reps
    return best_wall, gpu


def _return_us(fn, reps: int, rounds: int) -> tuple[float, float]:
    """(min over calls of the wall until ``fn`` returns -- the GPU idle before each call -- ,
    the median CUDA-event time of a call)."""
    returns, gpus = [], []
    for _ in range(rounds * reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        returns.append((time.perf_counter() - t0) * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpus.append(start.elapsed_time(end) * 1e3)
    gpus.sort()
    return min(returns), gpus[len(gpus) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-large", action="store_true", help="skip the options-bench shape")
    args = p.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        print("triton_host_path_gpu: needs a CUDA device and Triton (bench/triton_host_path.py is the CPU one)")
        return 2

    import attnkit
    from attnkit.kernels import softmax as kernels

    dev, dt = "cuda", torch.bfloat16
    shape = (1, 1, 17, 64)
    q, k, v = (torch.randn(shape, dtype=dt, device=dev) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.ones(shape, dtype=dt, device=dev)

    def sdpa_fwd_bwd():
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        return torch.autograd.grad(out, (qg, kg, vg), g)

    def attnkit_fwd_bwd():
        out = attnkit.softmax_attention(qg, kg, vg, is_causal=True, backend="triton")
        return torch.autograd.grad(out, (qg, kg, vg), g)

    rows = {
        "torch SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "attnkit forward (op)": lambda: attnkit.softmax_attention(q, k, v, is_causal=True, backend="triton"),
        "attnkit forward, window (7,0)": lambda: attnkit.softmax_attention(
            q, k, v, is_causal=True, window=(7, 0), backend="triton"),
        "kernels.softmax.softmax_fwd (launcher)": lambda: kernels.softmax_fwd(q, k, v, None, None, True),
        "empty Triton kernel": lambda: _empty[(1,)](q, 1),
        "torch SDPA forward+backward": sdpa_fwd_bwd,
        "attnkit forward+backward (op)": attnkit_fwd_bwd,
    }
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, Triton {triton.__version__}; "
          f"B=H=1 N=17 D=64 bfloat16 causal; {args.reps} calls a round, min of {args.rounds}")
    print(f"  {'row':42s} {'wall/call':>10s} {'GPU/call':>10s}")
    for name, fn in rows.items():
        with torch.no_grad() if "backward" not in name else torch.enable_grad():
            wall, gpu = _issue_rate_us(fn, args.reps, args.rounds)
        flag = "  (GPU-bound)" if gpu > 0.8 * wall else ""
        print(f"  {name:42s} {wall:8.1f} us {gpu:8.1f} us{flag}")

    if not args.no_large:
        shape = (4, 8, 16384, 128)
        q, k, v = (torch.randn(shape, dtype=dt, device=dev) for _ in range(3))
        print("B=4 H=8 N=16384 D=128 bfloat16 causal: wall until the call returns (GPU idle before) / GPU time")
        large = {
            "attnkit window (1023,0)": lambda: attnkit.softmax_attention(
                q, k, v, is_causal=True, window=(1023, 0), backend="triton"),
            "kernels.softmax.softmax_fwd window (launcher)": lambda: kernels.softmax_fwd(
                q, k, v, None, None, True, window_left=1023, window_right=0),
            "attnkit full causal": lambda: attnkit.softmax_attention(q, k, v, is_causal=True, backend="triton"),
            "torch SDPA full causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        with torch.no_grad():
            for name, fn in large.items():
                ret, gpu = _return_us(fn, 5, args.rounds)
                print(f"  {name:46s} returns after {ret:9.1f} us; GPU {gpu:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU diagnosis of issue 10, item 3: does a failing host-side check of a native op raise, or
kill the process?  Each probe runs in its own process; prints one line per probe.
Usage: python .ci/gpu_diag_errors.py [PROBE]   (PROBE: run just that one, in this process)
"""
import shutil
import subprocess
import sys

PROBES = {
    # a failing input check reached from the CPU op
    "cpu_linear_causal": "ops.linear_fwd(*cpu(1,2,4,5), None, None, True, 'elu', True, 1e-6, 1.0)",
    # the same check for CUDA tensors (csrc/checks/, before any .cu code runs)
    "cuda_linear_causal": "ops.linear_fwd(*gpu(1,2,4,5), None, None, True, 'elu', True, 1e-6, 1.0)",
    "cuda_softmax_bad_dim": "ops.softmax_fwd(*(t.half()[..., :96] for t in gpu(1,2,8,8)), None, 1.0, False)",
    # an error thrown by torch itself inside a .cu op (c10 allocation / shape checks)
    "torch_error_in_python": "torch.empty(2, 3, device='cuda').view(5)",
}

PRELUDE = """
import torch, attnkit
ops = torch.ops.attnkit
def cpu(b, h, n, m):
    return (torch.randn(b, h, n, 16), torch.randn(b, h, m, 16), torch.randn(b, h, m, 16))
def gpu(b, h, n, m):
    return tuple(t.cuda() for t in cpu(b, h, n, m))
"""


def main():
    if len(sys.argv) > 1:
        scope = {}
        exec(PRELUDE, scope)
        try:
            exec(PROBES[sys.argv[1]], scope)
            print("no error raised")
        except Exception as exc:  # noqa: BLE001
            print(f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return
    backtraced = False
    for name in PROBES:
        p = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True,
                           timeout=120)
        out = (p.stdout + p.stderr).strip().splitlines()
        print(f"probe {name}: rc={p.returncode} {out[-1][:250] if out else ''}", flush=True)
        if p.returncode < 0 and shutil.which("cuda-gdb") and not backtraced:
            backtraced = True  # one backtrace is enough (and each costs ~half a minute)
            try:
                bt = subprocess.run(["cuda-gdb", "-batch", "-ex", "run", "-ex", "bt 40",
                                     "--args", sys.executable, __file__, name],
                                    capture_output=True, text=True, timeout=150)
                lines = [l for l in bt.stdout.splitlines() if l.startswith("#") or "signal" in l]
                print("\n".join(f"  bt {l[:240]}" for l in lines[:45]), flush=True)
            except subprocess.TimeoutExpired:
                print("  bt: cuda-gdb timed out", flush=True)


if __name__ == "__main__":
    main()

"""GPU bench of the CUDA C++ softmax backward variants (session 15; csrc/cuda/softmax.cu,
ATTNKIT_CUDA_SOFTMAX_BWD = default | stream | fused) and of the Hopper forward (session 22;
csrc/cuda/softmax_sm90.cu, variants "sm90", "sm90-pingpong" and "sm90-simple": ATTNKIT_CUDA_SM90=1 |
pingpong | simple, each with the Hopper backward; session 23: "sm90-atomic", ATTNKIT_CUDA_SM90=atomic,
the overlapped forward and the backward whose dK / dV kernel adds dQ with atomics; "sm90-persistent",
ATTNKIT_CUDA_SM90=persistent, the overlapped forward on the persistent scheduler) against
torch SDPA, in one run.

    python bench/cuda_softmax_gpu.py [--deadline 150] [--out cuda_softmax_gpu.json]
    python bench/cuda_softmax_gpu.py --dry-run                       (the plan; no GPU)

The variable is read once per process by the C++ side, so each variant runs in a child process
of its own (``--child NAME``), which also times SDPA on the same inputs: every ratio compares
numbers of one process.  A child that dies (a sticky CUDA error) costs only its own rows.

Cases: bfloat16, B=4, H=8, N=M=8192, D in {128, 64}, causal and not (``--d``, ``--n`` change
them).  Rows per case and implementation (SDPA: ``F.scaled_dot_product_attention``; cuda:
``attnkit.softmax_attention(..., backend="cuda")``): fwd, bwd (``torch.autograd.grad`` of one
retained forward graph) and fwd+bwd.  Timing: CUDA events around each call, ``--warmup`` calls
first, then the median of ``--repeats`` calls, each after an L2 flush (a 256 MiB write outside
the events).  err: max|x - SDPA| / max|SDPA| over out (fwd) or dq, dk, dv (bwd), on fresh
random inputs; a row above ERR_LIMIT (or with NaN) is flagged BAD.  TFLOP/s: 4·B·H·D·(visible
pairs) for the forward (causal: the pairs at or below the diagonal), 2.5x that for the
backward, 3.5x for fwd+bwd.  No case starts after ``--deadline`` seconds; the JSON (``--out``)
is rewritten after every child.  Without CUDA (and without ``--dry-run``) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("default", "stream", "fused", "sm90", "sm90-pingpong", "sm90-simple", "sm90-atomic", "sm90-persistent")
SM90_ENV = "ATTNKIT_CUDA_SM90"
ERR_LIMIT = 2e-2
ENV = "ATTNKIT_CUDA_SOFTMAX_BWD"
MODES = ("fwd", "bwd", "fwd+bwd")


def variant_env(variant):
    """(ATTNKIT_CUDA_SOFTMAX_BWD, ATTNKIT_CUDA_SM90) of a variant's child process."""
    sm90 = {"sm90": "1", "sm90-pingpong": "pingpong", "sm90-simple": "simple", "sm90-atomic": "atomic",
            "sm90-persistent": "persistent"}
    return ("default", sm90[variant]) if variant in sm90 else (variant, "0")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds; no case starts after it")
    ap.add_argument("--out", default="cuda_softmax_gpu.json", help="JSON results")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--d", default="128,64", help="head dims (comma-separated)")
    ap.add_argument("--n", type=int, default=8192, help="N = M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=float, help=argparse.SUPPRESS)  # the parent's absolute deadline
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
    args.d = [int(x) for x in args.d.split(",") if x.strip()]
    return args


def cases(args):
    """The cases in order: D as given (128 first by default), non-causal before causal."""
    return [dict(dtype="bfloat16", B=args.batch, H=args.heads, N=args.n, M=args.n, D=d, causal=c)
            for d in args.d for c in (False, True)]


def case_name(c):
    return f"bf16 B{c['B']} H{c['H']} N{c['N']} D{c['D']}" + (" causal" if c["causal"] else "")


def flops(c, mode):
    pairs = c["N"] * (c["N"] + 1) // 2 if c["causal"] else c["N"] * c["M"]
    fwd = 4.0 * c["B"] * c["H"] * c["D"] * pairs
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def plan(args):
    """(variant, case, impl, mode) rows, as the children run them."""
    rows = []
    for v in args.variants:
        for c in cases(args):
            for impl in ("sdpa", f"cuda[{v}]"):
                rows += [(v, case_name(c), impl, m) for m in MODES]
    return rows


def format_table(records):
    lines = [f"{'variant':8s} {'case':34s} {'impl':14s} {'mode':8s} {'ms':>9s} {'TFLOP/s':>8s} {'xSDPA':>6s} "
             f"{'err':>9s}"]
    for r in records:
        ms = f"{r['ms']:9.3f}" if r.get("ms") is not None else f"{'-':>9s}"
        tf = f"{r['tflops']:8.1f}" if r.get("tflops") is not None else f"{'-':>8s}"
        xs = f"{r['x_sdpa']:6.2f}" if r.get("x_sdpa") is not None else f"{'-':>6s}"
        err = f"{r['err']:9.2e}" if r.get("err") is not None else f"{'-':>9s}"
        flag = " BAD" if r.get("bad") else ""
        note = f"  ({r['note']})" if r.get("note") else ""
        lines.append(f"{r['variant']:8s} {r['case']:34s} {r['impl']:14s} {r['mode']:8s} {ms} {tf} {xs} {err}{flag}{note}")
    return "\n".join(lines)


def rel_err(x, ref):
    """max|x - ref| / max|ref| in float64; inf when x has a NaN or inf that ref has not."""
    x, ref = x.double(), ref.double()
    if not bool(x.isfinite().all()):
        return float("inf")
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------
# child: one variant, every case (needs CUDA)
# ----------------------------------------------------------------------------------------------

def _time(torch, fn, warmup, repeats, flush):
    for _ in range(max(1, warmup)):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush.zero_()  # evict L2 between calls (outside the events)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def run_child(args):
    import torch
    import torch.nn.functional as F

    import attnkit

    variant = args.child
    # (the C++ side reads the variable once, at the first backward of this process)
    bwd, sm90 = variant_env(variant)
    assert os.environ.get(ENV, "default") == bwd, f"{ENV}={os.environ.get(ENV)!r} in the child of {variant}"
    assert os.environ.get(SM90_ENV, "0") == sm90, f"{SM90_ENV}={os.environ.get(SM90_ENV)!r} in the child of {variant}"
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    records = []
    for c in cases(args):
        if args.stop_at is not None and time.time() > args.stop_at:
            records.append(dict(variant=variant, case=case_name(c), impl="-", mode="-", note="deadline: not run"))
            break
        g = torch.Generator(device="cuda").manual_seed(1234 + c["D"] + int(c["causal"]))
        shape = (c["B"], c["H"], c["N"], c["D"])
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        impls = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"]),
            f"cuda[{variant}]": lambda: attnkit.softmax_attention(q, k, v, is_causal=c["causal"], backend="cuda"),
        }
        ref = None
        base = {}
        for impl, fwd in impls.items():
            rec = lambda mode, **kw: records.append(dict(variant=variant, case=case_name(c), impl=impl, mode=mode, **kw))
            try:
                with torch.no_grad():
                    out = fwd()
                out_g = fwd()
                grads = torch.autograd.grad(out_g, (q, k, v), do, retain_graph=True)
                torch.cuda.synchronize()
                if impl == "sdpa":
                    ref = (out, *grads)
                errs = {"fwd": rel_err(out, ref[0]),
                        "bwd": max(rel_err(x, r) for x, r in zip(grads, ref[1:]))}
                errs["fwd+bwd"] = max(errs.values())
                del out, grads

                def fwd_only():
                    with torch.no_grad():
                        fwd()

                steps = {
                    "fwd": fwd_only,
                    "bwd": lambda: torch.autograd.grad(out_g, (q, k, v), do, retain_graph=True),
                    "fwd+bwd": lambda: torch.autograd.grad(fwd(), (q, k, v), do),
                }
                for mode, step in steps.items():
                    ms, times = _time(torch, step, args.warmup, args.repeats, flush)
                    if impl == "sdpa":
                        base[mode] = ms
                    err = errs[mode]
                    rec(mode, ms=ms, times_ms=times, tflops=flops(c, mode) / (ms * 1e-3) / 1e12,
                        x_sdpa=base[mode] / ms if mode in base else None, err=err,
                        bad=not (err <= ERR_LIMIT))
                del out_g
            except Exception as e:  # noqa: BLE001 -- reported as a row; a sticky CUDA error ends the child
                rec("-", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", bad=True)
                if "CUDA error" in str(e):
                    print(json.dumps(records))
                    return 1
        print(f"# {variant}: {case_name(c)} done", file=sys.stderr, flush=True)
    print(json.dumps(records))
    return 0


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    if args.dry_run:
        print(f"plan: {len(args.variants)} child process(es) ({ENV}=" + "|".join(args.variants) + "), "
              f"{len(cases(args))} case(s) each, deadline {args.deadline:.0f} s")
        for row in plan(args):
            print("  " + " | ".join(row))
        return 0
    try:
        import torch
    except ImportError:
        print("cuda_softmax_gpu: torch is not installed; nothing to do")
        return 0
    if not torch.cuda.is_available():
        print("cuda_softmax_gpu: no CUDA device here; nothing to do (--dry-run shows the plan)")
        return 0
    import attnkit
    status = attnkit.backends()["softmax"]["cuda"]
    if not status.usable:
        print(f"cuda_softmax_gpu: attnkit's softmax cuda backend is not usable here ({status.reason}); nothing to do")
        return 0
    t0 = time.time()
    stop_at = t0 + args.deadline
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                started=time.strftime("%Y-%m-%d %H:%M:%S"), args={k: v for k, v in vars(args).items()})
    records = []
    for variant in args.variants:
        if time.time() > stop_at:
            records.append(dict(variant=variant, case="-", impl="-", mode="-", note="deadline: not run"))
            continue
        bwd, sm90 = variant_env(variant)
        env = {**os.environ, ENV: bwd, SM90_ENV: sm90}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--stop-at", str(stop_at),
               "--d", ",".join(map(str, args.d)), "--n", str(args.n), "--batch", str(args.batch),
               "--heads", str(args.heads), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
        with tempfile.TemporaryFile("w+") as out:
            try:
                rc = subprocess.run(cmd, env=env, stdout=out, timeout=max(30.0, stop_at - time.time() + 60.0)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            out.seek(0)
            lines = [ln for ln in out.read().splitlines() if ln.startswith("[")]
        got = json.loads(lines[-1]) if lines else []
        if rc != 0:
            got.append(dict(variant=variant, case="-", impl="-", mode="-", note=f"child exit {rc}", bad=True))
        records += got
        print(format_table(got), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta, elapsed_s=time.time() - t0, records=records), f, indent=1)
    print("\n" + format_table(records))
    print(f"\n{len(records)} rows, {sum(bool(r.get('bad')) for r in records)} BAD, {time.time() - t0:.0f} s; "
          f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

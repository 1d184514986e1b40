"""A sweep of the shapes users run, each attnkit call timed interleaved against its peers in one
process; prints one markdown table (shape x dtype x ratio against the strongest peer).

Issue 14 asked for it: the family benches time one implementation after another, so a load
change on a shared machine between two of them moves the ratio.  Here every case's contenders
(attnkit's CPU backend and every peer the family bench declares for the case) run in rounds --
each round calls every contender a few times in turn -- and the table reports the medians of the
per-call times, so a load that comes and goes hits all of them alike.

Run: ``python -m attnkit.bench.sweep [--family softmax,decode,linear,sparse,hopfield]
[--match REGEX] [--seconds S] [--out DIR]``.  CPU only (the GPU has the family benches, timed
with CUDA events).  The whole sweep takes ~4 minutes on 2 cores (236 s, session 5); ``--seconds`` is the timing
budget of each contender in a case (default 0.6 s, at least 3 rounds whatever the budget).
Writes ``DIR/sweep-cpu.json`` (default DIR: bench/out/).

The grid (B=batch, H=query heads, Hk=kv heads):
- softmax: N in {128, 256, 512} at B=4 H=8 and N in {1024, 2048} at B=1 H=8; D in {64, 128};
  float32 forward and forward+backward, causal and not; bfloat16 and float16 forward; and B=4 N=1024 D=64
  float32 with a key-padding, a random bool and an additive mask.  Peer: torch SDPA.
- decode: B=8 Hq=32, D=128, one query against M in {1024, 4096, 16384} (GQA Hk=8, float32 and
  bfloat16); 4 and 16 queries at M=4096; MQA (Hk=1) at M=16384.  Peer: torch SDPA (enable_gqa).
- linear: causal elu, B=1 H=8 D=64, forward at N in {256, 1024, 4096} (with attnkit's softmax as a
  peer: the crossover) and forward+backward at N in {1024, 4096, 16384}.  Peers: the masked
  quadratic form and the cumsum of outer products (where they fit in memory).
- sparse: strided(64), fixed(64, 8), star at N=4096, strided(64) and star forward+backward, and
  strided(32) at N=1024.  Peers: FlexAttention, SDPA with the dense mask, dense causal SDPA and attnkit.
- hopfield: update S in {1, 16, 256, 1024} against N stored patterns, 1 and 3 steps, energy;
  forward+backward of the update at S in {1, 16, 256} and of the energy at S in {1, 256, 1024}.
  Peers: the plain PyTorch loop, SDPA per step, attnkit's softmax per step.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from . import hopfield as hopfield_bench
from . import linear as linear_bench
from . import softmax as softmax_bench
from . import sparse as sparse_bench
from .harness import Case, prepare

FAMILIES = ("softmax", "decode", "linear", "sparse", "hopfield")
ATTNKIT = "attnkit[cpu]"


def grid(families, device: torch.device) -> list[Case]:
    """The sweep's cases, in the order of ``families``."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    out: list[Case] = []
    for family in families:
        if family == "softmax":
            for n in (128, 256, 512, 1024, 2048):
                b = 4 if n <= 512 else 1
                for d in (64, 128):
                    for mode in ("fwd", "fwd+bwd"):
                        for causal in (False, True):
                            out.append(softmax_bench.make_case(b, 8, n, d, f32, causal, mode, device))
                    out.append(softmax_bench.make_case(b, 8, n, d, bf16, False, "fwd", device))
                    out.append(softmax_bench.make_case(b, 8, n, d, f16, False, "fwd", device))
            for kind in softmax_bench.MASK_KINDS:
                for mode in ("fwd", "fwd+bwd"):
                    out.append(softmax_bench.make_mask_case(4, 8, 1024, 64, f32, kind, mode, device))
        elif family == "decode":
            for dtype in (f32, bf16):
                for m in (1024, 4096, 16384):
                    out.append(softmax_bench.make_decode_case(8, 32, 8, 1, m, 128, dtype, device))
                for nq in (4, 16):
                    out.append(softmax_bench.make_decode_case(8, 32, 8, nq, 4096, 128, dtype, device))
                out.append(softmax_bench.make_decode_case(8, 32, 1, 1, 16384, 128, dtype, device))
        elif family == "linear":
            for n in (256, 1024, 4096):
                out.append(linear_bench.make_case(1, 8, n, 64, 64, f32, True, "fwd", device, crossover=True))
            for n in (1024, 4096, 16384):
                out.append(linear_bench.make_case(1, 8, n, 64, 64, f32, True, "fwd+bwd", device))
        elif family == "sparse":
            strided64 = {"stride": 64, "causal": True}
            out += [
                sparse_bench.make_case("strided", strided64, 1, 8, 4096, 64, f32, "fwd", device),
                sparse_bench.make_case("fixed", {"stride": 64, "summary": 8, "causal": True}, 1, 8, 4096, 64,
                                       f32, "fwd", device),
                sparse_bench.make_case("star", {"relay": 0, "radius": 1}, 1, 8, 4096, 64, f32, "fwd", device),
                sparse_bench.make_case("strided", strided64, 1, 8, 4096, 64, f32, "fwd+bwd", device),
                sparse_bench.make_case("star", {"relay": 0, "radius": 1}, 1, 8, 4096, 64, f32, "fwd+bwd", device),
                sparse_bench.make_case("strided", {"stride": 32, "causal": True}, 1, 8, 1024, 64, f32, "fwd",
                                       device),
            ]
        elif family == "hopfield":
            for s, n, steps in ((1, 65536, 1), (1, 65536, 3), (1, 262144, 1), (16, 16384, 3), (256, 4096, 3),
                                (256, 16384, 3), (1024, 16384, 3)):
                out.append(hopfield_bench.update_case(1, 1, s, n, 64, steps, f32, device))
            for s, n in ((256, 4096), (1024, 16384)):
                out.append(hopfield_bench.energy_case(1, 1, s, n, 64, f32, device))
            for s, n, steps in ((1, 65536, 1), (16, 16384, 3), (256, 4096, 3)):
                out.append(hopfield_bench.update_case(1, 1, s, n, 64, steps, f32, device, mode="fwd+bwd"))
            for s, n in ((1, 65536), (256, 4096), (1024, 16384)):
                out.append(hopfield_bench.energy_case(1, 1, s, n, 64, f32, device, mode="fwd+bwd"))
        else:
            raise ValueError(f"unknown family {family!r}; expected some of {', '.join(FAMILIES)}")
    return out


def contenders(case: Case) -> list:
    """attnkit's CPU backend and the case's runnable peers (no reference, nothing skipped)."""
    return [impl for impl in case.impls
            if (impl.name == ATTNKIT or impl.kind == "peer") and not impl.skip and not impl.unavailable]


def interleaved(steps: dict, seconds: float, min_rounds: int = 3, max_rounds: int = 15) -> dict:
    """Median seconds per call of each step, timed in interleaved rounds.

    Warmup: each step once, then again until ~seconds/10 has passed.  A round calls each step
    ``k`` times in turn (``k`` filling ~seconds/rounds, from the warm-up's timing), so the
    rounds of every step span the same stretch of time."""
    per_call = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        warm, calls = first, 1
        while warm < seconds / 10 and calls < 50:
            t0 = time.perf_counter()
            step()
            last = time.perf_counter() - t0
            warm += last
            calls += 1
        per_call[name] = warm / calls if calls > 1 else first
    slowest = max(per_call.values())
    rounds = max(min_rounds, min(max_rounds, int(seconds / max(slowest, 1e-9))))
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            k = max(1, min(200, int(seconds / rounds / max(per_call[name], 1e-9))))
            for _ in range(k):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def shape_text(case: Case) -> str:
    p = dict(case.params)
    p.pop("dtype", None)
    return " ".join(f"{k}={v}" for k, v in p.items())


def run(cases: list[Case], device: torch.device, seconds: float, log=print) -> list[dict]:
    records = []
    for i, case in enumerate(cases, 1):
        impls = contenders(case)
        rec = {"case": case.label, "mode": case.mode, "dtype": case.params.get("dtype"),
               "shape": shape_text(case), "medians_s": {}}
        if not any(impl.name == ATTNKIT for impl in impls):
            rec["error"] = f"{ATTNKIT} is not usable here"
            records.append(rec)
            continue
        try:
            inputs = case.make_inputs(device)
            steps = {impl.name: prepare(case, impl, inputs, device) for impl in impls}
            rec["medians_s"] = interleaved(steps, seconds)
        except Exception as exc:  # noqa: BLE001 - one failing case is reported, not the sweep
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            inputs = steps = None
        peers = {k: v for k, v in rec["medians_s"].items() if k != ATTNKIT}
        if peers and ATTNKIT in rec["medians_s"]:
            best = min(peers, key=peers.get)
            rec.update(peer=best, ratio=peers[best] / rec["medians_s"][ATTNKIT])
        records.append(rec)
        log(f"[{i}/{len(cases)}] {format_row(rec)}")
    return records


def format_row(rec: dict) -> str:
    m = rec["medians_s"]
    if "error" in rec or "ratio" not in rec:
        return f"| {rec['case']} | {rec['mode']} | {rec['dtype']} | {rec['shape']} | - | - | {rec.get('error', 'no peer')} |"
    return (f"| {rec['case']} | {rec['mode']} | {rec['dtype']} | {rec['shape']} | {m[ATTNKIT] * 1e3:.3g} | "
            f"{rec['peer']} ({m[rec['peer']] * 1e3:.3g}) | {rec['ratio']:.2f}x |")


def table(records: list[dict]) -> str:
    lines = ["| case | mode | dtype | shape | attnkit[cpu] ms | strongest peer (ms) | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [format_row(r) for r in records]
    ratios = [r["ratio"] for r in records if "ratio" in r]
    if ratios:
        lost = [r for r in records if r.get("ratio", math.inf) < 1.0]
        lines.append("")
        lines.append(f"{len(ratios)} cases; ratio min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x, "
                     f"max {max(ratios):.2f}x; slower than the strongest peer: "
                     + (", ".join(f"{r['case']} [{r['mode']}]" for r in lost) or "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnkit.bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=",".join(FAMILIES), help=f"comma-separated, of {','.join(FAMILIES)}")
    ap.add_argument("--match", default=None, help="only the cases whose label or mode matches (re.search)")
    ap.add_argument("--seconds", type=float, default=0.6, help="timing budget per contender and case")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"), help="folder for sweep-cpu.json")
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error(f"--seconds must be > 0; got {args.seconds}")
    families = [f.strip() for f in args.family.split(",") if f.strip()]
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        ap.error(f"unknown family {', '.join(bad)}; expected some of {', '.join(FAMILIES)}")
    device = torch.device("cpu")
    cases = grid(families, device)
    if args.match:
        import re

        pattern = re.compile(args.match)
        cases = [c for c in cases if pattern.search(c.label) or pattern.search(f"{c.label} [{c.mode}]")]
    print(f"# attnkit CPU sweep: {len(cases)} cases, torch {torch.__version__}, {torch.get_num_threads()} threads",
          flush=True)
    started = time.perf_counter()
    records = run(cases, device, args.seconds, log=lambda s: print(s, flush=True))
    print()
    print(table(records))
    print(f"\n(sweep took {time.perf_counter() - started:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "seconds": args.seconds,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "sweep-cpu.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

"""How stable are attnkit's CPU timings from one process to the next?

Runs ``python -m attnkit bench`` (attnkit's CPU backend only, no memory calls) in ``--processes``
fresh processes one after another and prints, per case, the medians each process measured and
their spread, ``max / min - 1`` (issue 14 asks for <= 15% on every full-size case).  A fresh
process each time, because what differs between processes -- where the allocator puts the
tensors, which core a thread starts on, what the OpenMP pool does first -- is what a per-process
median hides.

Run: ``python -m attnkit.bench.spread [--processes 5] [--quick] [--match REGEX] [--out DIR]``
(full sizes: ~20 s a process on 2 cores).  Each process writes ``DIR/run<i>/bench-cpu.json``
(default DIR: bench/out/spread/).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Every implementation but attnkit's CPU kernel is left out (the spread is about ours).
SKIP = "reference|quadratic|cumsum|softmax attention|plain|SDPA|Flex|dense|per step|triton|cuda|fla"
ATTNKIT = "attnkit[cpu]"


def medians(path: Path) -> dict[str, float]:
    """``label [mode]`` -> attnkit[cpu]'s median seconds, from one bench JSON."""
    out = {}
    for case in json.loads(path.read_text())["cases"]:
        for row in case["results"]:
            if row["impl"] == ATTNKIT and row.get("status") == "ok" and row.get("median_s"):
                out[f"{case['label']} [{case['mode']}]"] = row["median_s"]
    return out


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1.0


def table(runs: list[dict[str, float]], limit: float = 0.15) -> str:
    cases = list(dict.fromkeys(k for run in runs for k in run))
    lines = [f"| case | medians of {len(runs)} processes (ms) | spread |", "| --- | --- | --- |"]
    over = []
    for case in cases:
        vals = [run[case] for run in runs if case in run]
        s = spread(vals)
        if s > limit:
            over.append(case)
        lines.append(f"| {case} | {' '.join(f'{v * 1e3:.3g}' for v in vals)} | {100 * s:.0f}% |")
    lines.append("")
    lines.append(f"over {100 * limit:.0f}%: " + (", ".join(over) if over else "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnkit.bench.spread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the --quick cases instead of the full sizes")
    ap.add_argument("--match", default=None, help="passed to the bench: only the cases it matches")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "spread"))
    args = ap.parse_args(argv)
    if args.processes < 2:
        ap.error(f"--processes must be >= 2 (a spread needs two medians); got {args.processes}")
    runs = []
    for i in range(1, args.processes + 1):
        out = Path(args.out) / f"run{i}"
        cmd = [sys.executable, "-m", "attnkit", "bench", "--skip-impl", SKIP, "--no-memory", "--no-progress",
               "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        if args.match:
            cmd += ["--match", args.match]
        print(f"process {i}/{args.processes}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs.append(medians(out / "bench-cpu.json"))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

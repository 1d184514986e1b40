"""How stable are attnkit's CPU timings from one process to the next?

Runs ``python -m attnkit bench`` (attnkit's CPU backend only, no memory calls) in ``--processes``
fresh processes one after another and prints, per case, the medians each process measured and
their spread, ``max / min - 1`` (issue 14 asks for <= 15% on every full-size case).  A fresh
process each time, because what differs between processes -- where the allocator puts the
tensors, which core a thread starts on, what the OpenMP pool does first -- is what a per-process
median hides.

``--peers`` is the control: the peers run too, in the same processes, and the table gains the
spread of the strongest peer's medians and of the ratio attnkit / peer.  When a case moves
between processes and its peer moves with it, the machine moved, not our kernel; the ratio
is then the figure that stays put.  Each process's copy bandwidth (``meta.machine.copy_gb_per_s``)
is printed under the table.

Run: ``python -m attnkit.bench.spread [--processes 5] [--quick] [--peers] [--match REGEX] [--out DIR]``
(full sizes: ~20 s a process on 2 cores, several times that with ``--peers``).  Each process
writes ``DIR/run<i>/bench-cpu.json`` (default DIR: bench/out/spread/).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# Every implementation but attnkit's CPU kernel is left out (the spread is about ours) ...
SKIP = "reference|quadratic|cumsum|softmax attention|plain|SDPA|Flex|dense|per step|triton|cuda|fla"
# ... unless --peers asks for the control, which keeps the peers and drops only the other backends.
SKIP_WITH_PEERS = "reference|triton|cuda|fla"
ATTNKIT = "attnkit[cpu]"


def medians(path: Path) -> dict[str, dict[str, float]]:
    """``label [mode]`` -> {implementation: median seconds} for attnkit[cpu] and every peer."""
    out: dict[str, dict[str, float]] = {}
    for case in json.loads(path.read_text())["cases"]:
        rows = {}
        for row in case["results"]:
            if (row["impl"] == ATTNKIT or row.get("kind") == "peer") and row.get("status") == "ok" \
                    and row.get("median_s"):
                rows[row["impl"]] = row["median_s"]
        if ATTNKIT in rows:
            out[f"{case['label']} [{case['mode']}]"] = rows
    return out


def copy_bandwidth(path: Path) -> float | None:
    """The copy GB/s that process measured (read + write), or None when it did not."""
    return (json.loads(path.read_text())["meta"].get("machine") or {}).get("copy_gb_per_s")


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1.0


def strongest_peer(runs: list[dict[str, dict[str, float]]], case: str) -> str | None:
    """The peer with the lowest median summed over the processes that ran it in every process,
    chosen once per case so that every process's ratio is against the same implementation."""
    present = [run[case] for run in runs if case in run]
    names = set.intersection(*(set(r) - {ATTNKIT} for r in present)) if present else set()
    return min(names, key=lambda n: sum(r[n] for r in present)) if names else None


def table(runs: list[dict[str, dict[str, float]]], limit: float = 0.15, peers: bool = False) -> str:
    cases = list(dict.fromkeys(k for run in runs for k in run))
    if peers:
        lines = [f"| case | attnkit medians of {len(runs)} processes (ms) | spread | strongest peer | "
                 "peer spread | ratio spread |", "| --- | --- | --- | --- | --- | --- |"]
    else:
        lines = [f"| case | medians of {len(runs)} processes (ms) | spread |", "| --- | --- | --- |"]
    over = []
    for case in cases:
        present = [run[case] for run in runs if case in run]
        vals = [r[ATTNKIT] for r in present]
        s = spread(vals)
        if s > limit:
            over.append(case)
        row = f"| {case} | {' '.join(f'{v * 1e3:.3g}' for v in vals)} | {100 * s:.0f}% |"
        if peers:
            peer = strongest_peer(runs, case)
            if peer is None:
                row += " (none) | | |"
            else:
                pv = [r[peer] for r in present]
                ratios = [p / a for p, a in zip(pv, vals)]
                row += f" {peer} | {100 * spread(pv):.0f}% | {100 * spread(ratios):.0f}% |"
        lines.append(row)
    lines.append("")
    lines.append(f"over {100 * limit:.0f}%: " + (", ".join(over) if over else "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnkit.bench.spread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="the --quick cases instead of the full sizes")
    ap.add_argument("--peers", action="store_true",
                    help="run the peers too and report their spread and the ratio's (the control)")
    ap.add_argument("--match", default=None, help="passed to the bench: only the cases it matches")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "spread"))
    args = ap.parse_args(argv)
    if args.processes < 2:
        ap.error(f"--processes must be >= 2 (a spread needs two medians); got {args.processes}")
    runs, copies = [], []
    for i in range(1, args.processes + 1):
        out = Path(args.out) / f"run{i}"
        cmd = [sys.executable, "-m", "attnkit", "bench", "--skip-impl", SKIP_WITH_PEERS if args.peers else SKIP,
               "--no-memory", "--no-progress", "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        if args.match:
            cmd += ["--match", args.match]
        print(f"process {i}/{args.processes}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs.append(medians(out / "bench-cpu.json"))
        copies.append(copy_bandwidth(out / "bench-cpu.json"))
    print(table(runs, peers=args.peers))
    print("copy bandwidth of each process (GB/s): "
          + " ".join("n/a" if c is None else f"{c:.1f}" for c in copies))
    return 0


if __name__ == "__main__":
    sys.exit(main())

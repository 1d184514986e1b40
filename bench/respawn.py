"""Going on after a sticky CUDA error: the cases left run in a fresh process.

An illegal address (or a device-side assert) in one kernel poisons the CUDA context of the whole
process: every later CUDA call fails with the same error.  Seen on the first H100 run of the
sweep: attnkit's Triton linear backward faulted while autotuning, and the sparse and Hopfield
cases after it could not run.  So when a case ends with the context lost
(``record["aborted"]``), ``python -m attnkit bench`` starts itself again in a child process for
the case that crashed (less the implementation that crashed it, whose error row is kept) and
the cases after it, streams the child's output through, and merges the child's records into its
own JSON.  The implementation that crashed is left out of the later cases of the same family and
mode too: in a fresh process it autotunes again, and on that first H100 / H200 run the linear
backward crashed again in the next case.  The child can restart in turn, at most ``--respawns``
times in all; the deadline carries over.  Triton's on-disk kernel cache makes the child's
compilations cheap; its autotuning runs again.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Sequence

from . import harness

# Hidden options of ``python -m attnkit bench`` that only a parent passes to its child.
CHILD_FLAG = "--child"


def case_key(label: str, mode: str) -> str:
    """How a case is named in ``meta.cases_planned`` / ``not_run`` and matched by ``--match``."""
    return f"{label} [{mode}]"


def exact_match(keys: Sequence[str]) -> str:
    """A ``--match`` regex that selects exactly these case keys."""
    return "^(" + "|".join(re.escape(k) for k in keys) + ")$"


def crashed_impls(rec: dict) -> list[str]:
    """The implementations of an aborted case whose call broke the context (status error)."""
    return [row["impl"] for row in rec["results"] if row["status"] == "error"]


def skips_after_crash(aborted: dict, left: Sequence[harness.Case]) -> dict[str, list[str]]:
    """``--skip-in-case`` entries for the child: the crashed implementations in the case that
    crashed and in the later cases of its family and mode."""
    crashed = crashed_impls(aborted)
    return {case_key(c.label, c.mode): crashed for c in left
            if c.family == aborted["family"] and c.mode == aborted["mode"]}


def child_argv(args, keys: Sequence[str], skips: dict[str, list[str]], deadline_left: float | None,
               machine: dict, respawns: int) -> list[str]:
    """The command line of the child: the same options, these cases only, the time left."""
    argv = [sys.executable, "-m", "attnkit", "bench", "--device", args.device, "--family", args.family,
            "--match", exact_match(keys), "--no-progress", CHILD_FLAG, "--respawns", str(respawns),
            "--machine-json", json.dumps(machine), "--grace", repr(args.grace)]
    if args.quick:
        argv.append("--quick")
    if args.skip_impl:
        argv += ["--skip-impl", args.skip_impl]
    if args.repeats is not None:
        argv += ["--repeats", str(args.repeats)]
    if args.warmup is not None:
        argv += ["--warmup", str(args.warmup)]
    if args.no_memory:
        argv.append("--no-memory")
    if deadline_left is not None:
        argv += ["--deadline", repr(max(deadline_left, 0.001))]
    for key, impls in skips.items():
        for impl in impls:
            argv += ["--skip-in-case", f"{key}={impl}"]
    return argv


def run_child(argv: list[str], out_dir: str, timeout: float | None,
              device_type: str = "cuda") -> tuple[int, dict | None]:
    """Run the child with ``--out out_dir``, its stdout streamed through line by line; returns
    (exit status, its JSON or None).  Past ``timeout`` the child's process group is killed
    (its own watchdog should have ended it long before)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv + ["--out", out_dir], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
        rc = proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = -9
    path = os.path.join(out_dir, f"bench-{device_type}.json")
    try:
        with open(path) as f:
            return rc, json.load(f)
    except (OSError, ValueError):
        return rc, None


def merge_crashed_case(parent: dict, child: dict, case: harness.Case, machine: dict | None) -> dict:
    """The record of the case that crashed: the child's rows, except the implementations that
    crashed it, whose rows (the error) come from the parent."""
    mine = {row["impl"]: row for row in parent["results"]}
    crashed = set(crashed_impls(parent))
    rows = [mine[row["impl"]] if row["impl"] in crashed else row for row in child["results"]]
    rec = dict(child, results=rows, ratios=harness.speedups(rows))
    rec["targets"] = harness.check_targets(case, rec, machine)
    rec["notes"] = list(child.get("notes", [])) + [
        f"{', '.join(sorted(crashed))} lost the CUDA context ({parent.get('aborted', '')}); the other rows were "
        "measured in a fresh process"]
    rec["wall_s"] = (parent.get("wall_s") or 0.0) + (child.get("wall_s") or 0.0)
    return rec


def continue_in_child(args, report, cases: Sequence[harness.Case], records: list[dict],
                      respawns: int) -> tuple[str, list[str], str]:
    """Run the cases from the aborted one (``records[-1]``) on in a child process, merging its
    records into ``report``.  Returns (status, not_run, why) of the whole run."""
    aborted = records[-1]
    index = len(records) - 1
    left = cases[index:]
    keys = [case_key(c.label, c.mode) for c in left]
    deadline_left = None if report.deadline is None else report.deadline - report.elapsed()
    if deadline_left is not None and deadline_left <= 0:
        return "aborted", keys[1:], f"stopped: {aborted['aborted']} (in {keys[0]}), past the deadline"
    machine = report.meta.get("machine") or {}
    argv = child_argv(args, keys, skips_after_crash(aborted, left), deadline_left, machine, respawns - 1)
    report.say(f"\n--- {aborted['aborted']}: the {len(left)} case(s) from {keys[0]} on continue in a fresh "
                f"process ({respawns - 1} more restart(s) allowed) ---")
    timeout = None if deadline_left is None else max(deadline_left, 0) + report.grace + 60
    report.postpone(60)  # the child's own watchdog ends it; this process waits for it
    tmp = tempfile.mkdtemp(prefix="attnkit-bench-child-")
    try:
        rc, data = run_child(argv, tmp, timeout, args.device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if data is None:
        return "aborted", keys, f"the child process found no GPU state to go on with (exit status {rc})"
    child_records = data.get("cases", [])
    if child_records and case_key(child_records[0]["label"], child_records[0]["mode"]) == keys[0]:
        report.replace_last(merge_crashed_case(aborted, child_records.pop(0), left[0], machine))
    for rec in child_records:
        report.add_record(rec)
    meta = data.get("meta", {})
    status = meta.get("status", "aborted")
    if status == "running":  # the child was killed before it could say
        status = "abandoned"
    report.meta.setdefault("restarts", []).append({"after": keys[0], "because": aborted["aborted"],
                                                    "exit_status": rc})
    return status, list(meta.get("not_run", [])), meta.get("stopped_because", "")

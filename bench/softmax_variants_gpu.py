"""GPU bench of the fast-case softmax variants (issue 26): each switch of
attnkit.kernels.softmax_hopper against torch SDPA and today's kernels, in one run.

    python -m attnkit.bench.softmax_variants_gpu [--quick] [--deadline 200] [--out FILE.json]
    python -m attnkit.bench.softmax_variants_gpu --dry-run [--quick]     (the plan; no GPU)

Cases: bfloat16, B=4, H=8, D in {128, 64}, N = M in {8192, 4096} (``--quick``: 8192 only),
causal and not; the issue's headline (D=128 N=8192) first.  For each case, on the same inputs:

- ``SDPA fwd`` / ``SDPA bwd`` / ``SDPA fwd+bwd``: ``F.scaled_dot_product_attention`` (its
  backward through ``torch.autograd.grad``; bwd alone re-uses one forward graph).
- ``today ...``: kernels/softmax.py's ``softmax_fwd`` / ``softmax_bwd`` autotuned (their
  FWD_CONFIGS / BWD_*_CONFIGS lists, benchmarked by Triton's autotuner in the first, untimed
  call).
- ``fwd <variant> <tile>``: ``hopper_fwd`` with each FWD_VARIANTS entry and each config of
  ``fwd_configs`` (the first ``--configs``).
- ``bwd <variant> <tile>``: ``hopper_bwd`` alone (from the fastest correct forward's out / lse)
  with each BWD_VARIANTS entry and config.
- ``fwd+bwd <fwd>+<bwd>``: the fastest correct forward followed by each backward variant at its
  fastest config, timed as one step.

Columns: ms (median), TFLOP/s (bench/softmax.py's count: 4·B·H·D·visible pairs for the
forward, causal counting the pairs at or below the diagonal, i.e. about half; bwd 2.5x,
fwd+bwd 3.5x), xSDPA = SDPA's time for the same mode / time (> 1: faster than SDPA), err =
max|x - SDPA| / max|SDPA| over the outputs (out; or dq, dk, dv), and for forwards the lse's max
relative difference from today's kernel.  A row over ERR_LIMIT is flagged BAD and never counts
as the best.  Outputs are written into NaN-filled buffers for the checked call, so an unwritten
element shows.  Targets (issue 26): forward >= 0.9x SDPA, forward+backward >= 0.8x.

Timing: bench/harness.py's ``cuda_time_calls`` (CUDA events, one warm-up call, then the median
of up to ``--repeats`` calls each queued behind an L2 flush; fewer past ``--max-time``
seconds a row).  Compilation: before timing, child processes (``--compile-jobs``) run every
kernel variant and config once on N = 1024 inputs with the same specialization (ints divisible
by 16, the same B, H, D, dtypes), filling Triton's on-disk cache, so that the timed process loads
instead of compiling ~200 kernels one after the other.  A variant that fails to compile in a child
(a Triton without warp specialization for this loop, out of shared memory) is reported and not
run here.  Deadlines: the children get at most ``--compile-timeout`` seconds (and at most 45% of
``--deadline``); each case gets a fair share of the time left (its core rows -- SDPA, today, the
base / fma forwards, the split / atomic backwards -- run regardless), and no row starts after
``--deadline`` seconds.  The table is printed row by row and the JSON rewritten after every
case, so a run cut off keeps what it measured.

Without CUDA (and without ``--dry-run``) the script prints a message and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = "attnkit-softmax-variants-gpu/1"
B, H = 4, 8
ERR_LIMIT = 5e-2  # max|x - SDPA| / max|SDPA| above which a row is BAD (bf16 rounding: ~1e-2)
LSE_LIMIT = 1e-3  # max relative lse difference from today's kernel (both float32)
TARGETS = {"fwd": 0.9, "fwd+bwd": 0.8}
COMPILE_N = 1024  # the compile children's sequence length (not specialized on beyond % 16)
# Rows that run even past their case's time share (never past the run's deadline).
CORE_FWD = ("base", "fma")
CORE_BWD = ("split", "atomic")
CAUSAL_ONLY = ("nosplit", "atomic_nosplit")  # without a diagonal they only test the tail mask


# ----------------------------------------------------------------------------------------------
# cases, rows and records (pure: no GPU; tests/bench/test_bench_softmax_variants.py runs these)
# ----------------------------------------------------------------------------------------------


def cases(quick: bool = False) -> list[dict]:
    """The cases to run, the issue's headline first (a run cut short keeps them)."""
    lens = (8192,) if quick else (8192, 4096)
    return [{"dtype": "bfloat16", "B": B, "H": H, "N": n, "D": d, "causal": causal}
            for n in lens for d in (128, 64) for causal in (False, True)]


def case_label(c: dict) -> str:
    return (f"{c['dtype']} B={c['B']} H={c['H']} N={c['N']} D={c['D']} "
            f"{'causal' if c['causal'] else 'full'}")


def case_flops(c: dict, mode: str) -> float:
    """bench/softmax.py's FLOP count of the case in ``mode`` ("fwd", "bwd", "fwd+bwd")."""
    from .softmax import flops

    fwd = flops(c["B"], c["H"], c["N"], c["N"], c["D"], c["D"], c["causal"], "fwd")
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def tile_label(config) -> str:
    """``128x64 w8 s3`` for a config tuple (bm, bn, warps, stages); ``a / b`` for a pair."""
    if config and isinstance(config[0], (list, tuple)):
        return " / ".join(tile_label(c) for c in config)
    bm, bn, w, s = config
    return f"{bm}x{bn} w{w} s{s}"


def _config_tuple(c):
    if isinstance(c, tuple):  # a (kv, dq) pair of the split backward
        return [_config_tuple(x) for x in c]
    return [c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages]


def plan_case(c: dict, n_configs: int) -> list[dict]:
    """The rows of a case, in the order they run: ``kind`` (sdpa, today, fwd, bwd, fwdbwd),
    ``mode``, ``impl`` (the label), and for variants ``variant`` and ``config``; ``core`` rows
    run past the case's time share; ``skipped`` says why a variant cannot run on this Triton."""
    from attnkit.kernels import softmax_hopper as sh

    rows = [{"kind": "sdpa", "mode": m, "impl": f"SDPA {m}", "core": True}
            for m in ("fwd", "bwd", "fwd+bwd")]
    rows += [{"kind": "today", "mode": m, "impl": f"today {m}", "core": True}
             for m in ("fwd", "bwd", "fwd+bwd")]
    for kind, variants, configs, core in (
            ("fwd", sh.FWD_VARIANTS, lambda v: sh.fwd_configs(c["D"], None, v), CORE_FWD),
            ("bwd", sh.BWD_VARIANTS, lambda v: sh.bwd_configs(v, c["D"]), CORE_BWD)):
        for name, variant in variants.items():
            if name in CAUSAL_ONLY and not c["causal"]:
                continue
            why = sh.variant_support(variant)
            for cfg in configs(variant)[:n_configs]:
                cfg = _config_tuple(cfg)
                row = {"kind": kind, "mode": kind, "variant": name, "config": cfg,
                       "impl": f"{kind} {name} {tile_label(cfg)}", "core": name in core}
                if why:
                    row["skipped"] = why
                rows.append(row)
    for name, variant in sh.BWD_VARIANTS.items():
        if (name in CAUSAL_ONLY and not c["causal"]) or sh.variant_support(variant):
            continue
        rows.append({"kind": "fwdbwd", "mode": "fwd+bwd", "variant": name,
                     "impl": f"fwd+bwd {name}", "core": name in CORE_BWD})
    return rows


def compile_key(c: dict, row: dict) -> str | None:
    """The kernels a row compiles, as a string: rows that compile the same kernels share it
    (the persistent forward's programs per SM are a launch size, not a kernel)."""
    from attnkit.kernels import softmax_hopper as sh

    shape = [c["dtype"], c["B"], c["H"], c["D"], c["causal"]]
    if row["kind"] in ("fwd", "bwd"):
        if row["kind"] == "fwd":
            v = sh.FWD_VARIANTS[row["variant"]]
            sw = [v.exp, v.causal_split, v.tma, v.warp_specialize, bool(v.persistent), v.lazy]
        else:
            v = sh.BWD_VARIANTS[row["variant"]]
            sw = [v.dq, v.causal_split, v.tma, v.warp_specialize]
        return json.dumps([row["kind"], *shape, sw, row["config"]])
    return None


def _risky(row: dict) -> bool:
    from attnkit.kernels import softmax_hopper as sh

    variants = sh.FWD_VARIANTS if row["kind"] == "fwd" else sh.BWD_VARIANTS
    v = variants.get(row.get("variant"))
    return bool(v is not None and (v.warp_specialize or getattr(v, "dq", "") == "tma_reduce"))


def compile_tasks(case_list: list[dict], plans: list[list[dict]]) -> list[dict]:
    """The compile children's work, most important first: every distinct kernel of the
    variants' rows, and today's kernels one config per task (the autotuner then finds them in
    the cache), skipping rows that cannot run."""
    from attnkit.kernels import softmax as ts

    tasks, seen = [], set()

    def add(task):
        if task["key"] not in seen:
            seen.add(task["key"])
            tasks.append(task)

    for c, rows in zip(case_list, plans):
        for row in rows:
            key = compile_key(c, row)
            if key is not None and not row.get("skipped"):
                add({"case": c, "kind": row["kind"], "variant": row["variant"],
                     "config": row["config"], "key": key})
        fwd = [_config_tuple(x) for x in ts.configs_for("fwd", c["D"])]
        dkdv = [_config_tuple(x) for x in ts.configs_for("dkdv", c["D"])]
        dq = [_config_tuple(x) for x in ts.configs_for("dq", c["D"])]
        shape = [c["dtype"], c["B"], c["H"], c["D"], c["causal"]]
        for i, cfg in enumerate(fwd):
            add({"case": c, "kind": "today-fwd", "config": cfg,
                 "key": json.dumps(["today-fwd", *shape, cfg])})
        for i in range(max(len(dkdv), len(dq))):
            pair = [dkdv[min(i, len(dkdv) - 1)], dq[min(i, len(dq) - 1)]]
            add({"case": c, "kind": "today-bwd", "config": pair,
                 "key": json.dumps(["today-bwd", *shape, pair])})
    return tasks


def finish_record(c: dict, rows: list[dict]) -> dict:
    """A case's record from its raw rows (``seconds`` or ``error`` / ``skipped``; ``err``,
    ``lse_err`` where checked): adds ``ms``, ``tflops``, ``vs_sdpa`` per row, the fastest
    correct row per mode (``best``) and the target verdicts."""
    sdpa = {r["mode"]: r.get("seconds") for r in rows if r["kind"] == "sdpa"}
    out_rows = []
    for r in rows:
        r = dict(r)
        sec = r.get("seconds")
        if sec:
            r["ms"] = sec * 1e3
            r["tflops"] = case_flops(c, r["mode"]) / sec / 1e12
            ref = sdpa.get(r["mode"])
            r["vs_sdpa"] = ref / sec if ref else None
        r["bad"] = bool((r.get("err") is not None and not r["err"] <= ERR_LIMIT)
                        or (r.get("lse_err") is not None and not r["lse_err"] <= LSE_LIMIT))
        out_rows.append(r)
    best = {}
    for mode in ("fwd", "bwd", "fwd+bwd"):
        good = [r for r in out_rows if r["mode"] == mode and r.get("seconds") and not r["bad"]
                and r["kind"] in ("fwd", "bwd", "fwdbwd")]
        if good:
            best[mode] = min(good, key=lambda r: r["seconds"])["impl"]
    targets = {}
    for mode, want in TARGETS.items():
        row = next((r for r in out_rows if r["impl"] == best.get(mode)), None)
        targets[mode] = None if row is None else bool((row.get("vs_sdpa") or 0) >= want)
    return {"case": dict(c), "label": case_label(c), "rows": out_rows, "best": best,
            "targets": targets}


def _f(x, spec):
    """x formatted by ``spec``; None as "-" right-aligned to the spec's width."""
    if x is None:
        width = int("".join(ch for ch in spec.split(".")[0] if ch.isdigit()) or 0)
        return "-".rjust(width)
    return format(x, spec)


def format_row(r: dict, best: dict | None = None) -> str:
    note = r.get("error") or r.get("skipped") or ""
    if r.get("fwd") and not note:
        note = f"with {r['fwd']}"
    checks = []
    if r.get("err") is not None:
        checks.append(f"err {r['err']:.1e}")
    if r.get("lse_err") is not None:
        checks.append(f"lse {r['lse_err']:.0e}")
    if r.get("bad"):
        checks.insert(0, "BAD")
    if best and best.get(r["mode"]) == r["impl"]:
        checks.insert(0, "best")
    note = "; ".join(checks + ([note] if note else []))
    return (f"  {r['impl']:<46} {_f(r.get('ms'), '9.3f')} {_f(r.get('tflops'), '7.1f')} "
            f"{_f(r.get('vs_sdpa'), '6.2f')}  {note[:80]}")


def format_case(rec: dict) -> str:
    lines = [f"{rec['label']}",
             f"  {'impl':<46} {'ms':>9} {'TFLOP/s':>7} {'xSDPA':>6}  note"]
    lines += [format_row(r, rec["best"]) for r in rec["rows"]]
    return "\n".join(lines)


def _variant_of(impl: str) -> str:
    """The variant part of a row label: ``fwd fma 128x64 w8 s3`` -> ``fwd fma``."""
    parts = impl.split()
    return " ".join(parts[:2])


def format_summary(records: list[dict]) -> str:
    """Per case the best row of each mode with its xSDPA, then a variant x case matrix of the
    best xSDPA over each variant's configs (what each switch does)."""
    lines = [f"summary (targets: fwd >= {TARGETS['fwd']}x SDPA, fwd+bwd >= "
             f"{TARGETS['fwd+bwd']}x; xSDPA of the fastest correct row)"]
    for rec in records:
        rows = {r["impl"]: r for r in rec["rows"]}
        today = {r["mode"]: r.get("vs_sdpa") for r in rec["rows"] if r["kind"] == "today"}
        sdpa = {r["mode"]: r for r in rec["rows"] if r["kind"] == "sdpa"}
        parts = []
        for mode in ("fwd", "bwd", "fwd+bwd"):
            b = rows.get(rec["best"].get(mode) or "", {})
            verdict = {None: "", True: " ok", False: " MISS"}[rec["targets"].get(mode)]
            parts.append(f"{mode} {_f(b.get('vs_sdpa'), '.2f')}x{verdict} (today "
                         f"{_f(today.get(mode), '.2f')}x, SDPA "
                         f"{_f(sdpa.get(mode, {}).get('tflops'), '.0f')} TF/s)")
        lines.append(f"  {rec['label']}: " + "; ".join(parts))
        for mode in ("fwd", "bwd", "fwd+bwd"):
            if rec["best"].get(mode):
                lines.append(f"      best {mode}: {rec['best'][mode]}")
    names, cells = [], {}
    for i, rec in enumerate(records):
        for r in rec["rows"]:
            if r["kind"] not in ("today", "fwd", "bwd", "fwdbwd"):
                continue
            name = _variant_of(r["impl"])
            if name not in names:
                names.append(name)
            val = None if (r["bad"] or not r.get("vs_sdpa")) else r["vs_sdpa"]
            prev = cells.get((name, i))
            # a config flagged BAD ("BAD" marks the cell) never outranks a correct one
            if val is not None and (not isinstance(prev, float) or val > prev):
                cells[(name, i)] = val
            elif (name, i) not in cells:
                cells[(name, i)] = "BAD" if r["bad"] and r.get("seconds") else None
    heads = [f"c{i + 1}" for i in range(len(records))]
    lines.append("  xSDPA by variant (best config) -- " + "; ".join(
        f"c{i + 1} = {rec['label']}" for i, rec in enumerate(records)))
    lines.append(f"    {'variant':<26}" + "".join(f"{h:>7}" for h in heads))
    for name in names:
        vals = [cells.get((name, i)) for i in range(len(records))]
        lines.append(f"    {name:<26}" + "".join(
            f"{v:>7}" if isinstance(v, str) else _f(v, "7.2f") for v in vals))
    return "\n".join(lines)


def format_plan(case_list, plans, tasks) -> str:
    lines = []
    for c, rows in zip(case_list, plans):
        lines.append(case_label(c))
        for r in rows:
            extra = f"  (skipped: {r['skipped']})" if r.get("skipped") else ""
            lines.append(f"  {r['impl']}{' [core]' if r.get('core') else ''}{extra}")
    kinds = {}
    for t in tasks:
        kinds[t["kind"]] = kinds.get(t["kind"], 0) + 1
    lines.append(f"{len(tasks)} compile tasks: " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# running the kernels (shared by the compile children and the timed process)
# ----------------------------------------------------------------------------------------------


def _triton_config(t):
    import triton

    if t and isinstance(t[0], (list, tuple)):
        return tuple(_triton_config(x) for x in t)
    bm, bn, w, s = t
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


def make_inputs(c: dict, n: int, device, seed: int = 0):
    from .harness import seeded_randn

    dt = getattr(torch, c["dtype"])
    shape = (c["B"], c["H"], n, c["D"])
    return [seeded_randn(shape, dt, device, seed + i) for i in range(4)]  # q, k, v, dO


def _fwd_call(c, row, q, k, v, **kw):
    from attnkit.kernels import softmax_hopper as sh

    return sh.hopper_fwd(q, k, v, None, c["causal"], variant=sh.FWD_VARIANTS[row["variant"]],
                         config=_triton_config(row["config"]), **kw)


def _bwd_call(c, row, go, q, k, v, out, lse, **kw):
    from attnkit.kernels import softmax_hopper as sh

    return sh.hopper_bwd(go, q, k, v, out, lse, None, c["causal"],
                         variant=sh.BWD_VARIANTS[row["variant"]],
                         config=_triton_config(row["config"]), **kw)


def _torch_out_lse(q, k, v, causal):
    """(out, lse) in plain torch, for the compile children's backward tasks: no Triton kernel
    is compiled for them (the inputs are N = COMPILE_N, so the scores are small)."""
    s = (q.float() @ k.float().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1) @ v.float()).to(q.dtype)
    return out, lse.contiguous()


def run_task(task: dict, device) -> None:
    """Compile one task's kernels by running them once on N = COMPILE_N inputs."""
    from attnkit.kernels import softmax as ts

    if task["kind"] == "_exit":  # lets the CPU test kill a child as a compiler abort would
        os._exit(task["code"])
    c = task["case"]
    q, k, v, go = make_inputs(c, task.get("n", COMPILE_N), device)
    if task["kind"] == "fwd":
        _fwd_call(c, task, q, k, v)
        return
    if task["kind"] == "today-fwd":
        ts.softmax_fwd(q, k, v, None, None, c["causal"], config=_triton_config(task["config"]))
        return
    out, lse = _torch_out_lse(q, k, v, c["causal"])
    if task["kind"] == "bwd":
        _bwd_call(c, task, go, q, k, v, out, lse)
    else:  # today-bwd: one (dK/dV, dQ) config pair, and the preprocess kernel
        ts.softmax_bwd(go, q, k, v, out, lse, None, None, c["causal"],
                       config=_triton_config(task["config"]))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"[:240]


def _compile_worker(tasks_path: str, results_path: str) -> int:
    """Child: run each task once (compiling its kernels), one JSON line per task."""
    tasks = json.loads(Path(tasks_path).read_text())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: the tests
    with open(results_path, "a") as f:
        for task in tasks:
            t0 = time.perf_counter()
            err = None
            try:
                run_task(task, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                err = _first_line(exc)
            f.write(json.dumps({"key": task["key"], "error": err,
                                "seconds": round(time.perf_counter() - t0, 2)}) + "\n")
            f.flush()
            if err and device.type == "cuda":
                try:  # a sticky CUDA error: nothing more can run in this process
                    torch.cuda.synchronize()
                    torch.ones(1, device=device).add_(1).item()
                except Exception:  # noqa: BLE001
                    return 3
    return 0


def precompile(tasks: list[dict], jobs: int, timeout_s: float, log) -> dict:
    """Run ``tasks`` in ``jobs`` child processes (task i in child i % jobs, so every child
    starts on the most important ones); -> {key: error or None} for the tasks that reported.
    A child that dies (a compiler abort, a CUDA error) has its task on hand recorded as failed
    and a fresh child takes the rest of its share, while time is left."""
    if jobs <= 0 or not tasks:
        return {}
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-variants-compile-"))
    counter = [0]
    results = {}

    def launch(share):
        j = counter[0]
        counter[0] += 1
        tpath, rpath = tmp / f"tasks{j}.json", tmp / f"results{j}.jsonl"
        tpath.write_text(json.dumps(share))
        rpath.touch()
        logf = open(tmp / f"log{j}.txt", "w")
        p = subprocess.Popen([sys.executable, "-m", "attnkit.bench.softmax_variants_gpu",
                              "--compile-worker", str(tpath), str(rpath)],
                             stdout=logf, stderr=subprocess.STDOUT)
        return {"share": share, "proc": p, "rpath": rpath, "logf": logf}

    def collect(slot):
        for line in slot["rpath"].read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                results[r["key"]] = r["error"]

    active = [launch(tasks[j::jobs]) for j in range(jobs) if tasks[j::jobs]]
    t_end = time.monotonic() + timeout_s
    while active and time.monotonic() < t_end:
        for slot in list(active):
            rc = slot["proc"].poll()
            if rc is None:
                continue
            active.remove(slot)
            slot["logf"].close()
            collect(slot)
            rest = [t for t in slot["share"] if t["key"] not in results]
            if rc not in (0, 3) and rest:
                results[rest[0]["key"]] = f"compile child died (exit code {rc})"
                log(f"  compile child died (exit code {rc}) on {rest[0]['key']}")
                rest = rest[1:]
            if rest and rc != 0:
                active.append(launch(rest))
        time.sleep(0.1)
    for slot in active:  # out of time: these children only (their own pids)
        slot["proc"].kill()
        slot["proc"].wait()
        slot["logf"].close()
        collect(slot)
    return results


# ----------------------------------------------------------------------------------------------
# measuring (CUDA)
# ----------------------------------------------------------------------------------------------


def _median(step, device, args):
    """Median seconds of ``step`` (CUDA events on a GPU; the host clock elsewhere, which only
    the CPU test of run_case uses)."""
    from .harness import time_calls

    times, out = time_calls(step, device, warmup=1, repeats=args.repeats, max_time=args.max_time)
    return statistics.median(times), out


def _rel_err(got, ref) -> float:
    ref = ref.float()
    scale = ref.abs().max().item() or 1.0
    diff = (got.float() - ref).abs().max().item()
    return float("inf") if diff != diff else diff / scale


def _grads_err(got, ref) -> float:
    return max(_rel_err(g, r) for g, r in zip(got, ref))


def run_case(c: dict, rows: list[dict], device, args, compiled: dict, deadline: float,
             share_s: float, log) -> list[dict]:
    """Measure a case's rows (see plan_case); returns the raw rows with ``seconds`` or
    ``error`` / ``skipped`` and the checks."""
    import torch.nn.functional as F

    from attnkit.kernels import softmax as ts
    from attnkit.kernels._flash import autotuning

    from .harness import cuda_context_error

    stop_at = min(deadline, time.monotonic() + share_s)
    q, k, v, go = make_inputs(c, c["N"], device, seed=1)
    causal = c["causal"]
    ref = {}
    state = {"best_fwd": None, "best_bwd": {}}
    done = []

    def nan_like(t):
        return torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)

    def measure(row, step, check=None):
        """Time ``step`` (after ``check``, the call whose outputs are verified)."""
        row = dict(row)
        if row.get("skipped"):
            return row
        now = time.monotonic()
        if now > deadline:
            row["skipped"] = "run deadline"
            return row
        if now > stop_at and not row.get("core"):
            row["skipped"] = "case time share"
            return row
        key = compile_key(c, row)
        if key is not None and compiled.get(key):
            row["error"] = "compile child: " + compiled[key]
            return row
        if key is not None and key not in compiled and _risky(row):
            # Triton's warp-specialization pass has failed on some loops: compile such a
            # kernel only in a child, never in the process that holds the results
            row["skipped"] = "not precompiled (warp-specialized kernels compile in children only)"
            return row
        try:
            if check is not None:
                row.update(check())
            row["seconds"], _ = _median(step, device, args)
        except Exception as exc:  # noqa: BLE001 - recorded; the rest still runs
            row["error"] = _first_line(exc)
            problem = cuda_context_error(device)
            if problem:
                raise RuntimeError(f"CUDA context lost in {row['impl']}: {problem}") from exc
        return row

    def emit(row):
        done.append(row)
        rec_row = finish_record(c, done)["rows"][-1]
        log(format_row(rec_row))

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        ref["out"] = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    # one forward graph that the "SDPA bwd" row differentiates again and again (freed after it)
    graph = {"out": F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)}
    ref["grads"] = torch.autograd.grad(graph["out"], (qg, kg, vg), go, retain_graph=True)

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa_fwdbwd():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return torch.autograd.grad(o, (qg, kg, vg), go)

    steps = {"fwd": sdpa_fwd,
             "bwd": lambda: torch.autograd.grad(graph["out"], (qg, kg, vg), go,
                                                retain_graph=True),
             "fwd+bwd": sdpa_fwdbwd}
    plan = list(rows)
    for row in [r for r in plan if r["kind"] == "sdpa"]:
        emit(measure(row, steps[row["mode"]]))
    graph.clear()

    with autotuning(True):
        today = {}

        def today_check():
            o, lse = ts.softmax_fwd(q, k, v, None, None, causal)
            today["out"], today["lse"] = o, lse
            return {"err": _rel_err(o, ref["out"])}

        for row in [r for r in plan if r["kind"] == "today"]:
            if row["mode"] == "fwd":
                emit(measure(row, lambda: ts.softmax_fwd(q, k, v, None, None, causal),
                             today_check))
            elif row["mode"] == "bwd" and "out" in today:
                o, lse = today["out"], today["lse"]
                emit(measure(row, lambda: ts.softmax_bwd(go, q, k, v, o, lse, None, None, causal),
                             lambda: {"err": _grads_err(ts.softmax_bwd(
                                 go, q, k, v, o, lse, None, None, causal), ref["grads"])}))
            elif row["mode"] == "fwd+bwd":
                def both():
                    o, lse = ts.softmax_fwd(q, k, v, None, None, causal)
                    return ts.softmax_bwd(go, q, k, v, o, lse, None, None, causal)
                emit(measure(row, both))
            else:
                emit(dict(row, skipped="no forward output"))

    # forward variants
    fwd_out = {}
    for row in [r for r in plan if r["kind"] == "fwd"]:
        def check(row=row):
            out = nan_like(ref["out"])
            lse = torch.full(ref["out"].shape[:3], float("nan"), device=device)
            out, lse = _fwd_call(c, row, q, k, v, out=out, lse=lse)
            fwd_out[row["impl"]] = (out, lse)
            res = {"err": _rel_err(out, ref["out"])}
            if "lse" in today:
                res["lse_err"] = _rel_err(lse, today["lse"])
            return res
        r = measure(row, lambda row=row: _fwd_call(c, row, q, k, v), check)
        emit(r)
        good = r.get("seconds") and not finish_record(c, [r])["rows"][0]["bad"]
        if good and (state["best_fwd"] is None or r["seconds"] < state["best_fwd"]["seconds"]):
            state["best_fwd"] = r
        if not (state["best_fwd"] and state["best_fwd"]["impl"] == row["impl"]):
            fwd_out.pop(row["impl"], None)  # keep only the best forward's outputs
    best_fwd = state["best_fwd"]
    if best_fwd is not None:
        out, lse = fwd_out[best_fwd["impl"]]
    elif "out" in today:
        out, lse = today["out"], today["lse"]
    else:
        out = lse = None

    # backward variants, alone, from the best forward's out and lse
    for row in [r for r in plan if r["kind"] == "bwd"]:
        if out is None:
            emit(dict(row, skipped="no forward output"))
            continue

        def check(row=row):
            grads = tuple(nan_like(t) for t in (q, k, v))
            grads = _bwd_call(c, row, go, q, k, v, out, lse, grads=grads)
            return {"err": _grads_err(grads, ref["grads"])}
        r = measure(row, lambda row=row: _bwd_call(c, row, go, q, k, v, out, lse), check)
        emit(r)
        good = r.get("seconds") and not finish_record(c, [r])["rows"][0]["bad"]
        prev = state["best_bwd"].get(row["variant"])
        if good and (prev is None or r["seconds"] < prev["seconds"]):
            state["best_bwd"][row["variant"]] = r

    # the best forward followed by each backward variant's best config, as one step
    for row in [r for r in plan if r["kind"] == "fwdbwd"]:
        bwd_row = state["best_bwd"].get(row["variant"])
        if best_fwd is None or bwd_row is None:
            emit(dict(row, skipped="no correct forward / backward row"))
            continue
        row = dict(row, fwd=best_fwd["impl"], config=[best_fwd["config"], bwd_row["config"]],
                   bwd=bwd_row["impl"])

        def both(bwd_row=bwd_row):
            o, lse_ = _fwd_call(c, best_fwd, q, k, v)
            return _bwd_call(c, bwd_row, go, q, k, v, o, lse_)
        emit(measure(row, both))
    return done


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnkit.bench.softmax_variants_gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="softmax_variants_gpu.json", help="JSON output path")
    p.add_argument("--quick", action="store_true", help="N = 8192 only (4 cases)")
    p.add_argument("--match", default=None, help="only cases whose label contains this")
    p.add_argument("--configs", type=int, default=2,
                   help="configs per variant (the first of each list)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per row (at most)")
    p.add_argument("--max-time", type=float, default=0.1,
                   help="seconds of timed calls per row (fewer repeats past it)")
    p.add_argument("--deadline", type=float, default=200.0,
                   help="no row starts after this many seconds of the whole run")
    p.add_argument("--compile-jobs", type=int, default=max(1, min(15, (os.cpu_count() or 2) - 1)),
                   help="child processes that compile the kernels first (0: compile as timed)")
    p.add_argument("--compile-timeout", type=float, default=80.0,
                   help="seconds for the compile children (at most 45%% of --deadline)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the cases, rows and compile tasks; needs no GPU")
    p.add_argument("--compile-worker", nargs=2, metavar=("TASKS", "RESULTS"),
                   help=argparse.SUPPRESS)
    return p


def _meta(device, args) -> dict:
    import triton

    from attnkit.kernels import softmax_hopper as sh

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"schema": SCHEMA,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": torch.cuda.get_device_name(device),
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "git_commit": commit,
            "has_warp_specialize": sh.HAS_WARP_SPECIALIZE,
            "has_tensor_descriptors": sh.HAS_TENSOR_DESCRIPTORS,
            "has_descriptor_reduce": sh.HAS_DESCRIPTOR_REDUCE,
            "args": {k: v for k, v in vars(args).items() if k != "compile_worker"}}


def _write(path, meta, records):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "cases": records}, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.compile_worker:
        return _compile_worker(*args.compile_worker)

    def log(msg):
        print(msg, flush=True)

    case_list = [c for c in cases(args.quick)
                 if args.match is None or args.match in case_label(c)]
    if args.dry_run:
        plans = [plan_case(c, args.configs) for c in case_list]
        log(format_plan(case_list, plans, compile_tasks(case_list, plans)))
        return 0
    if not torch.cuda.is_available():
        log("attnkit.bench.softmax_variants_gpu: no CUDA device here; nothing to time (run it on "
            "a GPU machine, or pass --dry-run for the plan).")
        return 0
    from attnkit.kernels import softmax_hopper as sh

    t0 = time.monotonic()
    deadline = t0 + args.deadline
    device = torch.device("cuda")
    plans = [plan_case(c, args.configs) for c in case_list]
    tasks = compile_tasks(case_list, plans)
    compile_s = max(10.0, min(args.compile_timeout, 0.45 * args.deadline))
    log(f"compiling {len(tasks)} tasks in {args.compile_jobs} child processes (at most "
        f"{compile_s:.0f} s) ...")
    compiled = precompile(tasks, args.compile_jobs, compile_s, log)
    failed = {k: e for k, e in compiled.items() if e}
    log(f"  {len(compiled)} of {len(tasks)} reported, {len(failed)} failed, "
        f"{time.monotonic() - t0:.1f} s")
    for key, err in list(failed.items())[:12]:
        log(f"    {key}: {err}")

    meta = _meta(device, args)
    meta["compile"] = {"tasks": len(tasks), "reported": len(compiled), "failed": failed,
                       "seconds": round(time.monotonic() - t0, 1)}
    log(f"attnkit softmax variants -- {meta['device_name']}, torch {meta['torch']}, triton "
        f"{meta['triton']}; warp_specialize {sh.HAS_WARP_SPECIALIZE}, tensor descriptors "
        f"{sh.HAS_TENSOR_DESCRIPTORS}, descriptor reduce {sh.HAS_DESCRIPTOR_REDUCE}")
    records = []
    for i, (c, rows) in enumerate(zip(case_list, plans)):
        left = deadline - time.monotonic()
        if left <= 0:
            rec = finish_record(c, [dict(r, skipped="run deadline") for r in rows])
            records.append(rec)
            _write(args.out, meta, records)
            continue
        share = left / (len(case_list) - i)
        log(f"\n{case_label(c)}  (time share {share:.0f} s)")
        log(f"  {'impl':<46} {'ms':>9} {'TFLOP/s':>7} {'xSDPA':>6}  note")
        try:
            raw = run_case(c, rows, device, args, compiled, deadline, share, log)
        except RuntimeError as exc:  # the CUDA context is gone: keep what we have
            log(f"stopping: {exc}")
            meta["stopped"] = str(exc)
            break
        finally:
            torch.cuda.empty_cache()
        records.append(finish_record(c, raw))
        _write(args.out, meta, records)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    _write(args.out, meta, records)
    log("\n" + format_summary(records))
    log(f"\n{meta['seconds']} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU decoding bench (issue 26): the split-KV kernel (attnkit.kernels.decode) against torch SDPA
and a plain copy of the K/V bytes.

    python -m attnkit.bench.decode_gpu [--out decode_gpu.json] [--quick] [--deadline 165]

Shapes: B=8, D=128, (H, Hk) in {(32, 8) GQA, (32, 1) MQA}, N in {1, 4, 16} query rows, M in
{8192, 32768, 131072, 1024} cached keys (in that order), bfloat16 and float16 (48 shapes;
``--quick``: bfloat16, M=8192, N in {1, 4}: 4 shapes, the GQA N=1 one first).  For each shape, on
the same inputs:

- ``copy K/V``: ``copy_`` of K and V into preallocated buffers; its GB/s counts bytes read plus
  written (the convention of bench/harness.py's ``copy_gb_per_s``).
- ``SDPA``: ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)``, with the decoding
  (bottom-right) alignment as a bool ``[N, M]`` mask only when N > 1.
- ``decode ...``, in two passes, both merge variants side by side (``merge="separate"``: a merge
  kernel after the split kernel; ``"fused"``: the split kernel's last program per row block
  merges; rows labelled ``... fused``; one split needs neither):
  1. every config of ``configs_for`` (DECODE_CONFIGS, likely best first, BLOCK_M filled in; the
     entries it drops as not fitting are listed as skipped) at the heuristic split count
     (``default_num_splits``);
  2. the split sweep (:func:`split_sweep`: split counts whose program count fills the SMs
     evenly, plus a geometric ladder) with each variant's fastest config of pass 1.
  Each output is checked against SDPA's (``max_err`` = max|out - sdpa| / max|sdpa|; above
  ERR_LIMIT the row is flagged ``BAD`` and cannot be the best).

GB/s of SDPA and the kernel = K/V bytes / time (the least traffic of the call); ``%copy`` = that
over the copy bandwidth (the larger of the shape's own copy and a 1 GiB copy measured at the
start); ``xSDPA`` = SDPA time / time (> 1: faster than SDPA).  Target (issue 26, K/V length >=
8k): the fastest config at >= 1.0x SDPA and >= 70% of the copy bandwidth.  The summary gives the
best row overall and the best of each merge variant.

Timing: bench/harness.py's ``cuda_time_calls`` (CUDA events; one warm-up call per
implementation and shape, then the median of up to ``--repeats`` calls, each after an L2 flush).
Compilation: before timing, the kernels of every (dtype, heads, N, kernel variant, config) are
compiled in parallel child processes (``--compile-jobs``, default all cores but one) on small
inputs with the same specialization (M and the split count are not specialized on), filling
Triton's on-disk cache, so that the timed process loads them instead of compiling each one by
one (an sm_90 compile of one took 3-10 s on a loaded 2-core CPU machine).  A config that fails in
a child (out of resources, a CUDA error) is reported and not run here.
Deadlines: a shape's clock (``--shape-seconds``) starts after its copy and SDPA rows (on the first
H200 run the GQA N=1 shape spent its whole 8 s before its second config: the first SDPA call of
the process and the first kernel loads went on that clock); the run stops starting shapes after
``--deadline`` seconds (the JSON is rewritten after every shape).  Each record keeps
``setup_s`` (copy, SDPA) and ``decode_s`` to show where the time went.  ``--quick`` stays
under ~90 s on an H200 (about 70 kernels compiled in ~30 s by 15 children, then ~10 s a shape).

Without CUDA the script prints a message and exits 0.
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

SCHEMA = "attnkit-decode-gpu/1"
B, D = 8, 128
HEADS = ((32, 8), (32, 1))
QUERY_ROWS = (1, 4, 16)
KV_LENS = (1024, 8192, 32768, 131072)
DTYPES = ("bfloat16", "float16")
TARGET_MIN_M = 8192
TARGET_VS_SDPA = 1.0
TARGET_COPY_FRACTION = 0.70
ERR_LIMIT = 2e-2  # max|out - sdpa| / max|sdpa| above which a row is flagged BAD
COMPILE_M = 1024  # the compile children's cache length (M is not specialized on)


# ----------------------------------------------------------------------------------------------
# shapes and records (pure: no GPU needed; tests/bench/test_decode_gpu.py runs these)
# ----------------------------------------------------------------------------------------------


def shapes(quick: bool = False, kv_lens=None) -> list[dict]:
    """The shapes to run, most important first, so that a run cut short by its deadline keeps
    them: the --quick set (bf16 M=8192 N in {1, 4}, GQA N=1 first), then bf16 N=1 at 32k and
    128k keys, then the rest of M >= 8192 (the issue's targets), then M = 1024.  ``kv_lens``
    (a sequence of M) replaces the mode's lengths, keeping that order."""
    dtypes = ("bfloat16",) if quick else DTYPES
    lens = (8192,) if quick else (8192, 32768, 131072, 1024)
    if kv_lens is not None:
        lens = tuple(kv_lens)
    rows = (1, 4) if quick else QUERY_ROWS
    out = [{"dtype": dtype, "B": B, "H": h, "Hk": hk, "N": n, "M": m, "D": D}
           for m in lens for dtype in dtypes for h, hk in HEADS for n in rows]

    def tier(s):
        if s["dtype"] == "bfloat16" and s["M"] == 8192 and s["N"] in (1, 4):
            return 0
        if s["dtype"] == "bfloat16" and s["N"] == 1 and s["M"] > 8192:
            return 1
        return 2 if s["M"] >= TARGET_MIN_M else 3

    return sorted(out, key=tier)  # stable: within a tier the loop order above


def shape_label(s: dict) -> str:
    kind = "MQA" if s["Hk"] == 1 else "GQA"
    return (f"{s['dtype']} B={s['B']} H={s['H']} Hk={s['Hk']} ({kind}) N={s['N']} M={s['M']} "
            f"D={s['D']}")


def kv_bytes(s: dict) -> int:
    esize = 2 if s["dtype"] in ("bfloat16", "float16") else 4
    return 2 * s["B"] * s["Hk"] * s["M"] * s["D"] * esize


def config_label(bm: int, bn: int, warps: int, stages: int, splits: int,
                 merge: str = "separate") -> str:
    """A decode row's name; the fused merge's rows end in " fused" (one split merges nothing:
    no suffix)."""
    label = f"S={splits} BM={bm} BN={bn} w{warps} s{stages}"
    return label + " fused" if merge == "fused" and splits > 1 else label


def row_merge(row: dict) -> str:
    """The merge variant a decode row ran: "separate", "fused" or "direct" (one split)."""
    if row.get("splits") == 1:
        return "direct"
    return row.get("merge") or "separate"


def finish_record(shape: dict, rows: list[dict], machine_copy_gbps: float | None) -> dict:
    """A shape's record from its raw rows.

    ``rows``: dicts with ``impl`` (name), ``kind`` ("copy", "sdpa" or "decode"), and
    ``seconds`` (median) or ``error`` / ``skipped`` (a reason); decode rows may carry
    ``config``, ``splits``, ``merge`` and ``max_err``.  Adds per row: ``ms``, ``gbps`` (copy:
    bytes read + written; others: K/V bytes, per second), ``pct_copy`` and ``vs_sdpa``; and the
    record's ``best`` decode row, ``best_by_merge`` (the best row of each merge variant timed)
    and ``target`` verdict (None below TARGET_MIN_M)."""
    nbytes = kv_bytes(shape)
    by_kind = {r["kind"]: r for r in rows if r["kind"] in ("copy", "sdpa")}
    copy_s = (by_kind.get("copy") or {}).get("seconds")
    sdpa_s = (by_kind.get("sdpa") or {}).get("seconds")
    copy_gbps = 2 * nbytes / copy_s / 1e9 if copy_s else None
    ref_copy = max([x for x in (copy_gbps, machine_copy_gbps) if x] or [0.0]) or None
    out_rows = []
    for r in rows:
        r = dict(r)
        sec = r.get("seconds")
        if sec:
            r["ms"] = sec * 1e3
            r["gbps"] = (2 if r["kind"] == "copy" else 1) * nbytes / sec / 1e9
            r["pct_copy"] = 100.0 * r["gbps"] / ref_copy if ref_copy else None
            r["vs_sdpa"] = sdpa_s / sec if (sdpa_s and r["kind"] != "copy") else None
        out_rows.append(r)
    good = [r for r in out_rows if r["kind"] == "decode" and r.get("seconds")
            and (r.get("max_err") is None or r["max_err"] <= ERR_LIMIT)]
    best = min(good, key=lambda r: r["seconds"]) if good else None
    best_by_merge = {}
    for r in sorted(good, key=lambda r: r["seconds"]):
        best_by_merge.setdefault(row_merge(r), r["impl"])
    target = None
    if shape["M"] >= TARGET_MIN_M:
        target = bool(best and (best.get("vs_sdpa") or 0) >= TARGET_VS_SDPA
                      and (best.get("pct_copy") or 0) >= 100 * TARGET_COPY_FRACTION)
    return {"shape": dict(shape), "label": shape_label(shape), "kv_bytes": nbytes,
            "copy_gbps": copy_gbps, "ref_copy_gbps": ref_copy, "rows": out_rows,
            "best": best["impl"] if best else None, "best_by_merge": best_by_merge,
            "target": target}


def _f(x, spec):
    """x formatted by ``spec``; None as "-" right-aligned to the spec's width."""
    if x is None:
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
        return "-".rjust(width)
    return format(x, spec)


def format_shape(rec: dict) -> str:
    lines = [f"{rec['label']}   K/V {rec['kv_bytes'] / 1e6:.1f} MB   copy ref "
             f"{_f(rec['ref_copy_gbps'], '.0f')} GB/s",
             f"  {'impl':<34} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'xSDPA':>6}  note"]
    for r in rec["rows"]:
        note = r.get("error") or r.get("skipped") or ""
        if r.get("max_err") is not None:
            note = (f"BAD err {r['max_err']:.2e}" if r["max_err"] > ERR_LIMIT
                    else f"err {r['max_err']:.1e}") + (f"; {note}" if note else "")
        if r["impl"] == rec["best"]:
            note = "best" + (f"; {note}" if note else "")
        lines.append(f"  {r['impl']:<34} {_f(r.get('ms'), '9.4f')} {_f(r.get('gbps'), '8.0f')} "
                     f"{_f(r.get('pct_copy'), '6.1f')} {_f(r.get('vs_sdpa'), '6.2f')}  "
                     f"{note[:70]}")
    return "\n".join(lines)


def format_summary(records: list[dict]) -> str:
    """The best row per shape, then each merge variant's best (ms, xSDPA, split count: what
    decides the default merge and the split heuristic)."""
    lines = [f"summary: fastest config per shape (target at M >= {TARGET_MIN_M}: >= "
             f"{TARGET_VS_SDPA:.1f}x SDPA and >= {100 * TARGET_COPY_FRACTION:.0f}% of copy)",
             f"  {'shape':<46} {'best':<34} {'ms':>9} {'GB/s':>7} {'%copy':>6} {'xSDPA':>6} "
             f"target"]
    for rec in records:
        best = next((r for r in rec["rows"] if r["impl"] == rec["best"]), {})
        verdict = {None: "-", True: "ok", False: "MISS"}[rec["target"]]
        lines.append(f"  {rec['label']:<46} {(rec['best'] or 'none'):<34} "
                     f"{_f(best.get('ms'), '9.4f')} {_f(best.get('gbps'), '7.0f')} "
                     f"{_f(best.get('pct_copy'), '6.1f')} {_f(best.get('vs_sdpa'), '6.2f')} "
                     f"{verdict}")
    hit = [r["target"] for r in records if r["target"] is not None]
    lines.append(f"  targets met: {sum(hit)} of {len(hit)}")
    lines.append("merge variants: best of each (ms / xSDPA / splits); heuristic = "
                 "default_num_splits' choice")
    for rec in records:
        parts = []
        for merge in ("separate", "fused", "direct"):
            impl = (rec.get("best_by_merge") or {}).get(merge)
            row = next((r for r in rec["rows"] if r["impl"] == impl), None)
            if row:
                parts.append(f"{merge} {row['ms']:.4f} / {_f(row.get('vs_sdpa'), '.2f')} / "
                             f"S={row.get('splits')}")
        lines.append(f"  {rec['label']:<46} heuristic S={rec.get('heuristic_splits', '-')}  "
                     + ("; ".join(parts) or "-"))
    return "\n".join(lines)


def format_table(meta: dict, records: list[dict]) -> str:
    head = (f"attnkit decode bench -- {meta.get('device_name')} ({meta.get('sms')} SMs), torch "
            f"{meta.get('torch')}, triton {meta.get('triton')}; 1 GiB copy "
            f"{_f(meta.get('copy_gb_per_s'), '.0f')} GB/s (read + write)\n"
            "GB/s = K/V bytes / time (copy row: read + written); %copy = of the larger of the "
            "shape's copy and the 1 GiB copy; xSDPA = SDPA time / time")
    return "\n\n".join([head, *(format_shape(r) for r in records), format_summary(records)])


SPLIT_LADDER = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def split_sweep(programs: int, sms: int, kv_len: int, heuristic: int) -> list[int]:
    """The split counts pass 2 times for a shape of ``programs`` programs per split (B * Hk *
    row blocks) on ``sms`` SMs: the ladder SPLIT_LADDER and the counts that make whole waves
    (``cdiv(w * sms, programs)`` for w = 1..4), kept where the program count is between a
    quarter of the SMs (MQA: the heuristic's partials cap goes that low) and 16 per SM and
    every split has a 64-key tile; one split (another kernel variant, 8 more compiles) only
    where it is the heuristic's; plus the heuristic's.  Sorted."""
    keep = set()
    cands = set(SPLIT_LADDER) | {-(-w * sms // programs) for w in range(1, 5)}
    for s in cands:
        if s >= 2 and sms / 4 <= programs * s <= 16 * sms and kv_len // s >= 64:
            keep.add(s)
    keep.add(heuristic)
    return sorted(keep)


def row_blocks(shape: dict, block_m: int) -> int:
    return -(-(shape["H"] // shape["Hk"]) * shape["N"] // block_m)


# ----------------------------------------------------------------------------------------------
# parallel compilation (child processes fill Triton's on-disk cache)
# ----------------------------------------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _run_decode(task: dict, m: int, device, seed: int = 0):
    """softmax_decode_fwd on fresh inputs of the task's shape with cache length ``m``."""
    import triton

    from attnkit.kernels import decode

    from .harness import seeded_randn

    dt = _torch_dtype(task["dtype"])
    q = seeded_randn((task["B"], task["H"], task["N"], task["D"]), dt, device, seed)
    k = seeded_randn((task["B"], task["Hk"], m, task["D"]), dt, device, seed + 1)
    v = seeded_randn((task["B"], task["Hk"], m, task["D"]), dt, device, seed + 2)
    bm, bn, w, st = task["config"]
    cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
    return decode.softmax_decode_fwd(q, k, v, num_splits=task["S"], config=cfg,
                                     merge=task.get("merge", "separate"))


def _compile_worker(tasks_path: str, results_path: str) -> int:
    """Child: run each task once on small inputs (compiling its kernels), one JSON line each."""
    tasks = json.loads(Path(tasks_path).read_text())
    device = torch.device("cuda")
    with open(results_path, "a") as f:
        for task in tasks:
            t0 = time.perf_counter()
            err = None
            try:
                _run_decode(task, COMPILE_M, device)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                err = _first_line(exc)
            f.write(json.dumps({"key": task["key"], "error": err,
                                "seconds": round(time.perf_counter() - t0, 3)}) + "\n")
            f.flush()
            if err:
                try:  # a sticky CUDA error: nothing more can run in this process
                    torch.cuda.synchronize()
                    torch.ones(1, device=device).add_(1).item()
                except Exception:  # noqa: BLE001
                    return 3
    return 0


def task_key(task: dict) -> str:
    """The split kernel a task compiles: what a config's result (or failure) is filed under.
    The split count matters only as one split (the DIRECT variant) or several, with the
    separate or the fused merge (FUSED_MERGE)."""
    variant = "direct" if task["S"] == 1 else task.get("merge", "separate")
    return json.dumps([task[k] for k in ("dtype", "B", "H", "Hk", "N", "D")]
                      + [variant, list(task["config"])])


def merge_key(task: dict) -> str | None:
    """The separate merge kernel a task compiles (None: it runs none): one per merge tile."""
    from attnkit.kernels._flash import pow2
    from attnkit.kernels.decode import _merge_tiles

    if task["S"] == 1 or task.get("merge", "separate") != "separate":
        return None
    rows = task["B"] * task["H"] * task["N"]
    return json.dumps([task[k] for k in ("dtype", "B", "H", "N", "D")]
                      + list(_merge_tiles(task["S"], pow2(task["D"]), rows)))


def compile_tasks(plan: list[dict]) -> list[dict]:
    """The compile children's work for ``plan`` (one entry per shape: the shape, its heuristic
    split ``S``, its ``configs`` [(bm, bn, w, st)] and ``split_variants``): every split kernel
    once -- per (dtype, heads, N, kernel variant, config), M and the split count are not
    specialized on -- for every config in each variant pass 2 may use (the best config is
    known only then), and every separate merge kernel once (per merge tile of each split count
    a shape will time).  Pass 1's tasks come first, shape by shape: the children take them
    round-robin, so the first shape's kernels are ready first."""
    tasks, seen = [], set()

    def add(shape, s, config, merge):
        t = {k: shape[k] for k in ("dtype", "B", "H", "Hk", "N", "D")}
        t.update(S=s, config=list(config), merge=merge)
        t["key"] = task_key(t)
        mkey = merge_key(t)
        if t["key"] in seen and (mkey is None or mkey in seen):
            return
        seen.update({t["key"], mkey} - {None})
        tasks.append(t)

    for entry in plan:
        shape, s = entry["shape"], entry["S"]
        for config in entry["configs"]:
            for merge in merges_for(s):
                add(shape, s, config, merge)
    for entry in plan:
        shape, variants = entry["shape"], entry["split_variants"]
        several = [x for x in variants if x > 1]
        if several:  # the fused / separate split kernels of every config, the merge tiles
            for config in entry["configs"]:
                for merge in ("separate", "fused"):
                    add(shape, several[0], config, merge)
            for x in several:
                add(shape, x, entry["configs"][0], "separate")
        if 1 in variants:
            for config in entry["configs"]:
                add(shape, 1, config, "separate")
    return tasks


def merges_for(splits: int) -> tuple[str, ...]:
    """The merge variants a split count runs (one split: the direct kernel only)."""
    return ("separate",) if splits == 1 else ("separate", "fused")


def precompile(tasks: list[dict], jobs: int, timeout_s: float, log) -> dict:
    """Run ``tasks`` in ``jobs`` child processes; -> {key: error or None} for the tasks that
    reported (a task whose child died or timed out is missing: compiled when timed)."""
    if jobs <= 0 or not tasks:
        return {}
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-decode-compile-"))
    procs = []
    for j in range(jobs):
        share = tasks[j::jobs]
        if not share:
            continue
        tpath, rpath = tmp / f"tasks{j}.json", tmp / f"results{j}.jsonl"
        tpath.write_text(json.dumps(share))
        rpath.touch()
        logf = open(tmp / f"log{j}.txt", "w")
        p = subprocess.Popen([sys.executable, "-m", "attnkit.bench.decode_gpu", "--compile-worker",
                              str(tpath), str(rpath)], stdout=logf, stderr=subprocess.STDOUT)
        procs.append((p, rpath, logf))
    t_end = time.monotonic() + timeout_s
    for p, _, logf in procs:
        try:
            p.wait(timeout=max(0.0, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()  # this child only (its own pid)
            p.wait()
        logf.close()
    results = {}
    for p, rpath, _ in procs:
        for line in rpath.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                results[r["key"]] = r["error"]
        if p.returncode not in (0, 3):
            log(f"  compile child exited with {p.returncode} (log: {tmp})")
    return results


# ----------------------------------------------------------------------------------------------
# measuring (CUDA)
# ----------------------------------------------------------------------------------------------


def _median(step, device, repeats, max_time):
    from .harness import cuda_time_calls

    times, out = cuda_time_calls(step, device, warmup=1, repeats=repeats, max_time=max_time)
    return statistics.median(times), out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    y = torch.empty_like(x)
    sec, _ = _median(lambda: y.copy_(x), device, 10, 1.0)
    return 2 * nbytes / sec / 1e9


def _time_copy(k, v, device, repeats, max_time) -> float:
    """Median seconds of copying K and V into preallocated buffers (freed on return)."""
    kb, vb = torch.empty_like(k), torch.empty_like(v)

    def copy():
        kb.copy_(k)
        vb.copy_(v)

    return _median(copy, device, repeats, max_time)[0]


def _max_err(out, ref) -> float:
    ref = ref.float()
    scale = ref.abs().max().item() or 1.0
    diff = (out.float() - ref).abs().max().item()
    return float("inf") if diff != diff else diff / scale


def run_shape(entry: dict, device, args, compiled: dict, deadline: float) -> tuple[list, dict]:
    """The raw rows of one shape (see finish_record) and its timings {setup_s, decode_s}."""
    import torch.nn.functional as F
    import triton

    from attnkit.kernels import decode

    from .harness import cuda_context_error, seeded_randn

    shape, splits = entry["shape"], entry["S"]
    dt = _torch_dtype(shape["dtype"])
    n, m = shape["N"], shape["M"]
    t_start = time.monotonic()
    q = seeded_randn((shape["B"], shape["H"], n, shape["D"]), dt, device, 1)
    k = seeded_randn((shape["B"], shape["Hk"], m, shape["D"]), dt, device, 2)
    v = seeded_randn((shape["B"], shape["Hk"], m, shape["D"]), dt, device, 3)
    rows = []

    rows.append({"impl": "copy K/V", "kind": "copy",
                 "seconds": _time_copy(k, v, device, args.repeats, args.max_time)})

    mask = None if n == 1 else torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n)
    ref = None
    try:
        sec, ref = _median(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                   enable_gqa=True),
                           device, args.repeats, args.max_time)
        rows.append({"impl": "SDPA" + (" (bool mask)" if mask is not None else ""),
                     "kind": "sdpa", "seconds": sec})
    except Exception as exc:  # noqa: BLE001 - recorded; the kernel still runs
        rows.append({"impl": "SDPA", "kind": "sdpa", "error": _first_line(exc)})
        torch.cuda.empty_cache()
    # The shape's clock starts here: the copy and SDPA (whose first call in a process can take
    # seconds) are not what it limits.
    t_decode = time.monotonic()
    stop_at = min(deadline, t_decode + args.shape_seconds)

    def decode_row(config, s, merge):
        bm, bn, w, st = config
        label = config_label(bm, bn, w, st, s, merge)
        row = {"impl": label, "kind": "decode", "config": list(config), "splits": s,
               "merge": merge if s > 1 else "direct"}
        if s != splits:
            row["note"] = "split variant"
        task = {k_: shape[k_] for k_ in ("dtype", "B", "H", "Hk", "N", "D")}
        task.update(S=s, config=list(config), merge=merge)
        child_err = compiled.get(task_key(task))
        if child_err:
            row["error"] = "compile child: " + child_err
            return row
        if time.monotonic() > stop_at:
            row["skipped"] = "shape time limit"
            return row
        cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        try:
            sec, out = _median(lambda: decode.softmax_decode_fwd(q, k, v, num_splits=s,
                                                                 config=cfg, merge=merge),
                               device, args.repeats, args.max_time)
            row["seconds"] = sec
            if ref is not None:
                row["max_err"] = _max_err(out[0], ref)
        except Exception as exc:  # noqa: BLE001
            row["error"] = _first_line(exc)
            problem = cuda_context_error(device)
            if problem:
                raise RuntimeError(f"CUDA context lost in {label}: {problem}") from exc
        return row

    # Pass 1: every config at the heuristic split count, the merge variants interleaved (so a
    # shape cut short has both for the likely best configs).
    for config in entry["configs"]:
        for merge in merges_for(splits):
            rows.append(decode_row(config, splits, merge))
    for bn, w, st in entry.get("dropped", ()):
        rows.append({"impl": f"S={splits} BN={bn} w{w} s{st}", "kind": "decode",
                     "skipped": "not in configs_for (registers / shared memory estimate)"})
    # Pass 2: the split sweep with each variant's fastest config (the overall fastest where a
    # variant has no row yet: one split at the heuristic).
    timed = [r for r in rows if r["kind"] == "decode" and r.get("seconds")]
    if timed:
        overall = min(timed, key=lambda r: r["seconds"])["config"]
        best = {}
        for merge in ("separate", "fused"):
            mine = [r for r in timed if r.get("merge") == merge]
            best[merge] = tuple(min(mine, key=lambda r: r["seconds"])["config"] if mine
                                else overall)
        for s in entry["split_variants"]:
            if s == splits:
                continue
            for merge in merges_for(s):
                rows.append(decode_row(best[merge], s, merge))
    if args.autotune and time.monotonic() < stop_at:
        for merge in merges_for(splits):
            label = f"S={splits} autotuned" + (" fused" if merge == "fused" else "")
            try:
                sec, out = _median(lambda: decode.softmax_decode_fwd(q, k, v, merge=merge),
                                   device, args.repeats, args.max_time)
                rows.append({"impl": label, "kind": "decode", "seconds": sec, "splits": splits,
                             "merge": merge if splits > 1 else "direct",
                             "max_err": None if ref is None else _max_err(out[0], ref)})
            except Exception as exc:  # noqa: BLE001
                rows.append({"impl": label, "kind": "decode", "error": _first_line(exc)})
    timing = {"setup_s": round(t_decode - t_start, 2),
              "decode_s": round(time.monotonic() - t_decode, 2)}
    return rows, timing


def make_plan(shape_list: list[dict], sms: int) -> list[dict]:
    """Per shape: the heuristic split ``S``, the ``configs`` of pass 1 (configs_for's order:
    likely best first), the ``split_variants`` of pass 2 and the ``dropped`` configs."""
    from attnkit.kernels import decode

    plan = []
    for s in shape_list:
        dt = _torch_dtype(s["dtype"])
        rows = (s["H"] // s["Hk"]) * s["N"]
        splits = decode.default_num_splits(s["B"], s["Hk"], rows, s["M"], sms)
        configs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                   for c in decode.configs_for(s["D"], s["D"], rows, dt)]
        programs = s["B"] * s["Hk"] * -(-rows // decode.MAX_BLOCK_M)
        variants = split_sweep(programs, sms, s["M"], splits)
        kept = {(bn, w, st) for _, bn, w, st in configs}
        dropped = [(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in decode.DECODE_CONFIGS
                   if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) not in kept]
        plan.append({"shape": s, "S": splits, "configs": configs, "split_variants": variants,
                     "dropped": dropped})
    return plan


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnkit.bench.decode_gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="decode_gpu.json", help="JSON output path")
    p.add_argument("--quick", action="store_true", help="bf16, M=8192, N in {1, 4} only")
    p.add_argument("--kv-lens", default=None,
                   help="comma-separated cache lengths M instead of the mode's (e.g. "
                        "--quick --kv-lens 8192,32768,131072)")
    p.add_argument("--match", default=None, help="only shapes whose label contains this")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per row (at most)")
    p.add_argument("--max-time", type=float, default=0.15,
                   help="seconds of timed calls per row (fewer repeats past it)")
    p.add_argument("--shape-seconds", type=float, default=20.0,
                   help="stop starting decode rows of a shape after this many seconds (counted "
                        "from after its copy and SDPA rows)")
    p.add_argument("--deadline", type=float, default=165.0,
                   help="stop starting shapes after this many seconds of the whole run")
    p.add_argument("--compile-jobs", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                   help="child processes that compile the kernels first (0: compile as timed)")
    p.add_argument("--compile-timeout", type=float, default=90.0,
                   help="seconds for the compile children (at most 2/3 of --deadline)")
    p.add_argument("--autotune", action="store_true",
                   help="also time config=None (the autotuner: every config benchmarked per key)")
    p.add_argument("--compile-worker", nargs=2, metavar=("TASKS", "RESULTS"),
                   help=argparse.SUPPRESS)
    return p


def _meta(device, args, copy_gbps, sms) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"schema": SCHEMA,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device_name": torch.cuda.get_device_name(device), "sms": sms,
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "git_commit": commit,
            "copy_gb_per_s": copy_gbps, "args": {k: v for k, v in vars(args).items()
                                                 if k != "compile_worker"}}


def _write(path, meta, records):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "shapes": records}, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.compile_worker:
        return _compile_worker(*args.compile_worker)
    if not torch.cuda.is_available():
        print("attnkit.bench.decode_gpu: no CUDA device here; nothing to time (run it on a GPU "
              "machine).")
        return 0
    from attnkit.kernels import decode

    t0 = time.monotonic()
    deadline = t0 + args.deadline
    device = torch.device("cuda")
    sms = decode.sm_count(device)

    def log(msg):
        print(msg, flush=True)

    kv_lens = None if args.kv_lens is None else [int(x) for x in args.kv_lens.split(",") if x]
    shape_list = [s for s in shapes(args.quick, kv_lens)
                  if args.match is None or args.match in shape_label(s)]
    plan = make_plan(shape_list, sms)
    tasks = compile_tasks(plan)
    log(f"compiling {len(tasks)} kernel variants in {args.compile_jobs} child processes ...")
    # leave at least a third of the run's deadline for the timing
    compile_s = max(10.0, min(args.compile_timeout, args.deadline * 2 / 3))
    compiled = precompile(tasks, args.compile_jobs, compile_s, log)
    failed = {k: e for k, e in compiled.items() if e}
    log(f"  {len(compiled)} reported, {len(failed)} failed, {time.monotonic() - t0:.1f} s")
    for key, err in list(failed.items())[:10]:
        log(f"    {key}: {err}")

    copy_gbps = copy_bandwidth(device)
    torch.cuda.empty_cache()
    meta = _meta(device, args, copy_gbps, sms)
    meta["compile"] = {"tasks": len(tasks), "reported": len(compiled), "failed": failed,
                       "seconds": round(time.monotonic() - t0, 1)}
    meta["plan"] = [{"label": shape_label(e["shape"]), "heuristic_splits": e["S"],
                     "split_variants": e["split_variants"], "configs": e["configs"]}
                    for e in plan]
    log(format_table(meta, []).split("\n\n")[0])
    records = []
    for entry in plan:
        if time.monotonic() > deadline:
            rec = finish_record(entry["shape"], [{"impl": "(all)", "kind": "decode",
                                                  "skipped": "run deadline"}], copy_gbps)
        else:
            try:
                rows, timing = run_shape(entry, device, args, compiled, deadline)
                torch.cuda.empty_cache()  # the shape's inputs are gone with run_shape
            except RuntimeError as exc:  # the CUDA context is gone: keep what we have
                log(f"stopping: {exc}")
                meta["stopped"] = str(exc)
                _write(args.out, meta, records)
                break
            rec = finish_record(entry["shape"], rows, copy_gbps)
            rec["heuristic_splits"] = entry["S"]
            rec.update(timing)
            log("\n" + format_shape(rec) + f"\n  (setup {timing['setup_s']} s, decode rows "
                f"{timing['decode_s']} s)")
        records.append(rec)
        _write(args.out, meta, records)
    meta["seconds"] = round(time.monotonic() - t0, 1)
    _write(args.out, meta, records)
    log("\n" + format_summary(records))
    log(f"\n{meta['seconds']} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

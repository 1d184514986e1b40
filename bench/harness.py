"""The benchmark harness behind ``python -m attnkit bench`` and the pytest-benchmark suites.

A family file (``bench/softmax.py``, ``linear.py``, ``sparse.py``, ``hopfield.py``) declares
its :class:`Case` objects: the shapes, a per-case FLOP count, an input factory and the
:class:`Impl` objects to compare — attnkit through every backend usable here (from
``attnkit.backends()``) and the peers a user would pick instead (torch SDPA, FlexAttention,
hand-written PyTorch).  This module runs them on the same inputs in one process and reports,
per implementation: the median time over ``repeats`` timed calls (after ``warmup`` calls;
``torch.cuda.synchronize`` around every call on CUDA), the achieved FLOP/s (case FLOPs / median
time), the peak extra memory of one call, and, per case, the speedup of each attnkit backend over
each peer (``peer median / attnkit median``: above 1 means attnkit is faster).  Output: a table
on stdout, ``bench-<device>.json`` and ``bench-<device>.png``.

Memory, CPU.  torch has no CPU allocator statistics, so one extra call runs under
``torch.profiler`` with ``profile_memory=True``: the running sum of its allocation / free
events gives the peak bytes allocated through torch's CPU allocator during the call, exactly —
but only for allocations made on the calling thread (the profiler's state is thread-local and
torch does not hand it to OpenMP workers; checked with a C++ op that allocates inside
``at::parallel_for``: half of its allocations went unreported on 2 threads).  Native kernels
that allocate scratch on worker threads, or outside torch (``std::vector``), are invisible to
it.  So a second extra call measures the growth of the process's resident-set high-water mark
(``/proc/self/clear_refs`` resets it; Linux only), which sees every thread and every allocator
but only pages actually touched, and misses memory that the C allocator reuses without returning
it to the OS.  Both are lower bounds of the true figure; the reported ``peak_bytes`` is the
larger, and the JSON keeps both.  Memory, CUDA: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``, minus what was allocated before the call.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

FAMILIES = ("softmax", "linear", "sparse", "hopfield")
KINDS = ("attnkit", "peer")
SCHEMA = "attnkit-bench/1"

# A reference implementation materializes the full score matrix; it is for checking, not
# speed.  Above this many bytes for one score matrix the sweep skips it (and says so).
REFERENCE_SCORE_LIMIT = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}


class Unavailable(Exception):
    """Raised by an implementation that cannot run here (the message says why)."""


@dataclass
class Impl:
    """One way of computing a case.

    ``fn(inputs)`` computes the forward from the dict of input tensors and returns a tensor (the
    harness adds the backward for ``fwd+bwd`` cases).  ``skip`` (too big here, say) or
    ``unavailable`` (cannot run on this machine) give the reason it is not run.
    ``same_result=False`` marks a peer that computes a different function (dense causal
    attention next to a sparse pattern, say): shown for its cost, left out of the output check.
    """

    name: str
    kind: str
    fn: Callable[[dict], Any] | None = None
    backend: str | None = None
    skip: str = ""
    unavailable: str = ""
    same_result: bool = True
    note: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Impl.kind must be one of {KINDS}; got {self.kind!r}")


@dataclass
class Case:
    """One benchmark problem: shapes, FLOP count, inputs and the implementations to compare.

    ``make_inputs(device)`` returns a dict of tensors (the same for every implementation);
    ``grad_inputs`` names those that get gradients in a ``fwd+bwd`` case.  ``flops`` is the
    work of one call as counted by the family file (its docstring says how), so FLOP/s ratios
    equal time ratios.
    """

    family: str
    name: str
    mode: str  # "fwd" | "fwd+bwd"
    params: dict
    flops: float
    make_inputs: Callable[[torch.device], dict]
    impls: list[Impl]
    grad_inputs: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in ("fwd", "fwd+bwd"):
            raise ValueError(f"Case.mode must be 'fwd' or 'fwd+bwd'; got {self.mode!r}")
        if self.mode == "fwd+bwd" and not self.grad_inputs:
            raise ValueError(f"case {self.name}: a fwd+bwd case needs grad_inputs")

    @property
    def label(self) -> str:
        return f"{self.family}/{self.name}"


# --------------------------------------------------------------------------------------------
# helpers the family files share


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def seeded_randn(shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Reproducible standard-normal inputs (drawn in float32 on the CPU, then moved / cast)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def memory_budget(device: torch.device) -> int:
    """Bytes a single implementation may be estimated to need before the sweep skips it."""
    if device.type == "cuda":
        return int(0.5 * torch.cuda.get_device_properties(device).total_memory)
    total = None
    try:
        with open("/proc/meminfo") as f:
            total = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 16 * 2**30
    return int(min(8 * 2**30, 0.4 * total))


def too_big(estimated_bytes: float, device: torch.device, what: str) -> str:
    """A skip reason when ``estimated_bytes`` exceeds the memory budget, else ''."""
    budget = memory_budget(device)
    if estimated_bytes > budget:
        return f"{what} needs ~{fmt_bytes(estimated_bytes)} (budget here {fmt_bytes(budget)})"
    return ""


def reference_skip(score_bytes: float, device: torch.device) -> str:
    """The skip reason for an attnkit reference run whose score matrix is ``score_bytes``."""
    limit = REFERENCE_SCORE_LIMIT.get(device.type, REFERENCE_SCORE_LIMIT["cpu"])
    if score_bytes > limit:
        return (
            f"the reference materializes a {fmt_bytes(score_bytes)} score matrix "
            f"(limit {fmt_bytes(limit)}; it is for checking, not speed)"
        )
    return ""


def attnkit_impls(
    family: str,
    device: torch.device,
    call: Callable[[str], Callable[[dict], Any]],
    *,
    reference_skip_reason: str = "",
) -> list[Impl]:
    """One :class:`Impl` per attnkit backend usable for ``family`` on ``device``.

    ``call(backend)`` returns the forward ``fn(inputs)`` for that backend.  Backends that
    ``attnkit.backends()`` reports unusable are left out (the JSON's meta lists why); the Triton
    interpreter (``TRITON_INTERPRET=1`` on CPU tensors) is left out because it is a checking
    tool, not a fast path.
    """
    from .. import backends
    from .._dispatch import _device_problem, triton_interpreted

    impls = []
    for backend, status in backends()[family].items():
        if not status.usable or _device_problem(backend, device):
            continue
        name = f"attnkit[{backend}]"
        if backend == "triton" and device.type == "cpu" and triton_interpreted():
            impls.append(Impl(name, "attnkit", backend=backend,
                              skip="Triton interpreter (TRITON_INTERPRET=1) is for checking, not speed"))
            continue
        skip = reference_skip_reason if backend == "reference" else ""
        impls.append(Impl(name, "attnkit", fn=call(backend), backend=backend, skip=skip))
    return impls


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------------------
# measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare(case: Case, impl: Impl, inputs: dict, device: torch.device) -> Callable[[], Any]:
    """A zero-argument callable that runs one timed call of ``impl`` on ``inputs``.

    ``fwd``: the forward under ``torch.no_grad``.  ``fwd+bwd``: the forward on inputs that
    require grad, then ``backward`` with a fixed random output gradient; returns the output and
    the input gradients (handed over, so nothing accumulates from call to call).
    """
    fn = impl.fn
    if case.mode == "fwd":
        def step():
            with torch.no_grad():
                return fn(inputs)
        return step

    leaves = {k: (v.detach().clone().requires_grad_(True) if k in case.grad_inputs else v)
              for k, v in inputs.items()}
    grads = [leaves[k] for k in case.grad_inputs]
    grad_out: list[torch.Tensor] = []

    def step():
        out = fn(leaves)
        if not grad_out:  # drawn once, the same for every call and implementation
            grad_out.append(seeded_randn(out.shape, out.dtype, out.device, seed=1234))
        out.backward(grad_out[0])
        result = (out.detach(), *[t.grad for t in grads])
        # The caller owns the gradients from here: no state carries over to the next call (which
        # would otherwise free the previous gradients inside a memory measurement).
        for t in grads:
            t.grad = None
        return result

    return step


def time_calls(step: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
               timer: Callable[[], float] = time.perf_counter, max_time: float | None = None,
               min_repeats: int = 3) -> tuple[list[float], Any]:
    """``warmup`` untimed calls (at least one), then the timed ones; returns (seconds per call,
    the last warmup call's output).

    ``repeats`` timed calls; with ``max_time`` fewer when the last warmup call says ``repeats``
    would take longer than that, but never fewer than ``min(repeats, min_repeats)`` — and a
    single warmup call when that one already took over a third of ``max_time``.
    """
    out, last = None, 0.0
    for i in range(max(1, warmup)):
        if i and max_time is not None and last > max_time / 3:
            break
        _sync(device)
        t0 = timer()
        out = step()
        _sync(device)
        last = timer() - t0
    count = repeats
    if max_time is not None and last > 0:
        count = max(min(repeats, min_repeats), min(repeats, int(max_time / last)))
    times = []
    for _ in range(count):
        _sync(device)
        t0 = timer()
        step()
        _sync(device)
        times.append(timer() - t0)
    return times, out


_CLEAR_REFS_OK: bool | None = None


def interleaved_medians(contenders: dict, rounds: int, run: Callable[..., Any]) -> dict:
    """Median seconds per contender, timed in interleaved rounds (each round runs every
    contender once, after one warm-up call each), so that the load of a shared machine hits all
    of them alike.  ``contenders``: name -> (fn, args); ``run(fn, *args)`` does one call."""
    times = {name: [] for name in contenders}
    for fn, args in contenders.values():
        run(fn, *args)
    for _ in range(rounds):
        for name, (fn, args) in contenders.items():
            start = time.perf_counter()
            run(fn, *args)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _rss_hwm_available() -> bool:
    global _CLEAR_REFS_OK
    if _CLEAR_REFS_OK is None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            _CLEAR_REFS_OK = _rss_kib("VmHWM") is not None
        except OSError:
            _CLEAR_REFS_OK = False
    return _CLEAR_REFS_OK


def _rss_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"{key}:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def rss_peak_growth(step: Callable[[], Any]) -> int | None:
    """Growth of the resident-set high-water mark during one call (bytes), or None where the
    high-water mark cannot be reset (non-Linux, or /proc/self/clear_refs not writable)."""
    if not _rss_hwm_available():
        return None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    out = step()
    peak = _rss_kib("VmHWM")
    del out
    return max(0, (peak - before) * 1024)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's native code logs every start and stop there)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocator_peak(step: Callable[[], Any]) -> tuple[int, int]:
    """(peak, retained) bytes allocated through torch's CPU allocator on this thread during one
    call, from torch.profiler's memory events; ``retained`` is what is still held when the call
    returns (its outputs)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        out = step()
    finally:
        with _quiet_stderr():
            prof.stop()
    del out
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak, current


def measure_memory(step: Callable[[], Any], device: torch.device) -> dict:
    """Peak extra memory of one call (see the module docstring for the method and its limits)."""
    if device.type == "cuda":
        gc.collect()
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        retained = torch.cuda.memory_allocated(device) - base
        del out
        return {"peak_bytes": peak, "retained_bytes": retained, "scratch_bytes": max(0, peak - retained),
                "memory_method": "cuda-allocator"}
    rss = rss_peak_growth(step)
    alloc, retained = allocator_peak(step)
    peak = max(alloc, rss or 0)
    return {
        "peak_bytes": peak,
        "scratch_bytes": max(0, peak - retained),
        "peak_bytes_allocator": alloc,
        "peak_bytes_rss": rss,
        "retained_bytes": retained,
        "memory_method": "max(profiler allocator peak, RSS high-water growth)" if rss is not None
        else "profiler allocator peak (RSS high-water mark unavailable)",
    }


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def max_rel_diff(out, baseline) -> float | None:
    """max |out - baseline| / max |baseline| over all returned tensors (computed in float64)."""
    a, b = _as_tuple(out), _as_tuple(baseline)
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape:
            return None
        if y.numel() == 0:
            continue
        x64, y64 = x.detach().double(), y.detach().double().to(x.device)
        denom = y64.abs().max().item() or 1.0
        worst = max(worst, (x64 - y64).abs().max().item() / denom)
    return worst


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def run_impl(case: Case, impl: Impl, inputs: dict, device: torch.device, *, warmup: int,
             repeats: int, memory: bool, timer: Callable[[], float],
             max_time: float | None = None) -> tuple[dict, Any]:
    """Measure one implementation; never raises (failures become the row's status)."""
    row = {"impl": impl.name, "kind": impl.kind, "backend": impl.backend, "status": "ok", "reason": "",
           "note": impl.note}
    if impl.unavailable:
        row.update(status="unavailable", reason=impl.unavailable)
        return row, None
    if impl.skip:
        row.update(status="skipped", reason=impl.skip)
        return row, None
    out = None
    started = time.perf_counter()
    try:
        step = prepare(case, impl, inputs, device)
        times, out = time_calls(step, device, warmup=warmup, repeats=repeats, timer=timer, max_time=max_time)
        median = statistics.median(times)
        row.update(
            repeats=len(times),
            median_s=median,
            min_s=min(times),
            times_s=times,
            flops_per_s=case.flops / median if median > 0 else None,
        )
        if memory:
            row.update(measure_memory(step, device))
    except Unavailable as exc:
        row.update(status="unavailable", reason=str(exc))
        out = None
    except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the sweep
        row.update(status="error", reason=_first_line(exc))
        out = None
    row["wall_s"] = time.perf_counter() - started  # everything: warmup, timed and memory calls
    return row, out


def run_case(case: Case, device: torch.device, *, warmup: int = 1, repeats: int = 5, memory: bool = True,
             timer: Callable[[], float] = time.perf_counter, max_time: float | None = None,
             progress=None) -> dict:
    """Run every implementation of ``case`` on the same inputs; returns the case's JSON record."""
    inputs = case.make_inputs(device)
    # Peers first, so their output is the baseline the attnkit outputs are checked against.
    order = sorted(range(len(case.impls)), key=lambda i: case.impls[i].kind != "peer")
    rows: list[dict | None] = [None] * len(case.impls)
    baseline, baseline_name = None, None
    for i in order:
        impl = case.impls[i]
        if progress is not None:
            progress.set_postfix_str(f"{case.label} · {impl.name}", refresh=True)
        row, out = run_impl(case, impl, inputs, device, warmup=warmup, repeats=repeats, memory=memory,
                            timer=timer, max_time=max_time)
        if out is not None and impl.same_result:
            if baseline is None:
                baseline, baseline_name = out, impl.name
            else:
                try:
                    row["max_rel_diff"] = max_rel_diff(out, baseline)
                    row["diff_baseline"] = baseline_name
                except Exception as exc:  # noqa: BLE001
                    row["max_rel_diff"], row["diff_baseline"] = None, f"not comparable ({_first_line(exc)})"
        del out
        rows[i] = row
        if memory:  # the next memory measurement starts from a clean heap
            gc.collect()
        if progress is not None:
            progress.update(1)
    del baseline, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "family": case.family,
        "name": case.name,
        "label": case.label,
        "mode": case.mode,
        "params": case.params,
        "flops": case.flops,
        "notes": list(case.notes),
        "results": rows,
        "ratios": speedups(rows),
    }


def speedups(rows: Iterable[dict]) -> list[dict]:
    """Speedup of each measured attnkit row over each measured peer: peer median / attnkit median."""
    rows = [r for r in rows if r.get("status") == "ok" and r.get("median_s")]
    out = []
    for a in (r for r in rows if r["kind"] == "attnkit"):
        for p in (r for r in rows if r["kind"] == "peer"):
            out.append({"attnkit": a["impl"], "peer": p["impl"], "speedup": p["median_s"] / a["median_s"]})
    return out


# --------------------------------------------------------------------------------------------
# pytest-benchmark (bench/test_bench_<family>.py)


def pytest_cases(module, *, quick: bool, device: torch.device) -> tuple[list, list[str]]:
    """(params, ids) to parametrize a pytest-benchmark test with every (case, impl) of a family."""
    params, ids = [], []
    for case in module.cases(quick=quick, device=device):
        for impl in case.impls:
            params.append((case, impl))
            ids.append(f"{case.name}-{case.mode}-{impl.name}".replace(" ", "_"))
    return params, ids


def pytest_benchmark_run(benchmark, case: Case, impl: Impl, device: torch.device, *, rounds: int = 5,
                         warmup: int = 1) -> None:
    """Time one (case, impl) with the ``benchmark`` fixture; grouped by case, so pytest-benchmark's
    table puts each case's implementations side by side.  Skips what cannot run here."""
    import pytest

    if impl.unavailable or impl.skip:
        pytest.skip(impl.unavailable or impl.skip)
    benchmark.group = case.label + f" [{case.mode}]"
    benchmark.extra_info.update(family=case.family, case=case.name, mode=case.mode, params=case.params,
                                flops=case.flops, impl=impl.name, kind=impl.kind, backend=impl.backend)
    step = prepare(case, impl, case.make_inputs(device), device)

    def call():
        out = step()
        _sync(device)
        return out

    try:
        for _ in range(max(1, warmup)):  # compiles (FlexAttention), builds masks, settles caches
            call()
    except Unavailable as exc:
        pytest.skip(str(exc))
    benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=0)
    stats = getattr(benchmark, "stats", None)
    median = getattr(getattr(stats, "stats", None), "median", None)
    if median:
        benchmark.extra_info["gflops_per_s"] = case.flops / median / 1e9


# --------------------------------------------------------------------------------------------
# the sweep


def collect_cases(families: Sequence[str], *, quick: bool, device: torch.device) -> list[Case]:
    import importlib

    cases = []
    for family in families:
        module = importlib.import_module(f".{family}", __package__)
        cases.extend(module.cases(quick=quick, device=device))
    return cases


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="attnkit bench", unit="run", file=sys.stderr, dynamic_ncols=True)


def run_sweep(cases: Sequence[Case], device: torch.device, *, warmup: int = 1, repeats: int = 5,
              memory: bool = True, timer: Callable[[], float] = time.perf_counter,
              max_time: float | None = None, progress: bool = True) -> list[dict]:
    """Run every case; a tqdm bar on stderr counts the (case, implementation) runs."""
    bar = _progress_bar(sum(len(c.impls) for c in cases), progress)
    records = []
    try:
        for case in cases:
            records.append(run_case(case, device, warmup=warmup, repeats=repeats, memory=memory,
                                    timer=timer, max_time=max_time, progress=bar))
    finally:
        if bar is not None:
            bar.close()
    return records


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_peaks(device: torch.device, timer: Callable[[], float] = time.perf_counter) -> dict:
    """Measured GEMM throughput (and copy bandwidth) of this machine, to put FLOP/s in context."""
    n = 2048 if device.type == "cpu" else 8192
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = seeded_randn((n, n), dtype, device, 1)
        b = seeded_randn((n, n), dtype, device, 2)
        times, _ = time_calls(lambda: a @ b, device, warmup=1, repeats=5, timer=timer)
        peaks[f"gemm_{dtype_name(dtype)}_gflops"] = 2 * n**3 / statistics.median(times) / 1e9
    peaks["gemm_n"] = n
    x = torch.empty(64 * 2**20 if device.type == "cpu" else 512 * 2**20, dtype=torch.uint8, device=device)
    x.fill_(1)
    y = torch.empty_like(x)
    times, _ = time_calls(lambda: y.copy_(x), device, warmup=1, repeats=5, timer=timer)
    peaks["copy_gb_per_s"] = 2 * x.numel() / statistics.median(times) / 1e9  # read + write
    return peaks


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def make_meta(device: torch.device, *, quick: bool, warmup: int, repeats: int, families: Sequence[str],
              memory: bool, machine: dict | None, max_time: float | None = None) -> dict:
    from .. import __version__, backends

    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "attnkit": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "quick": quick,
        "warmup": warmup,
        "repeats": repeats,
        "max_time_s": max_time,
        "families": list(families),
        "memory": memory,
        "speedup": "peer median time / attnkit median time (> 1: attnkit is faster)",
        "machine": machine or {},
        "backends": {f: {b: {"usable": s.usable, "reason": s.reason} for b, s in row.items()}
                     for f, row in backends().items()},
    }


# --------------------------------------------------------------------------------------------
# output


def write_json(path: str | os.PathLike, meta: dict, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "cases": records}, f, indent=1, default=str)
        f.write("\n")
    return path


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(meta: dict, records: list[dict]) -> str:
    """The stdout report: one block per case, one row per implementation."""
    lines = []
    machine = meta.get("machine") or {}
    repeats = f"{meta.get('repeats')}"
    if meta.get("max_time_s"):
        repeats = f"up to {repeats} (3+ within ~{meta['max_time_s']:g} s)"
    head = f"attnkit bench — {meta.get('device')} ({meta.get('device_name')}), torch {meta.get('torch')}, " \
           f"{meta.get('threads')} threads, median of {repeats} calls after {meta.get('warmup')} warmup"
    lines.append(head + (" [quick]" if meta.get("quick") else ""))
    if machine:
        lines.append("machine: " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in machine.items()))
    lines.append("speedup = peer time / attnkit time (> 1: attnkit faster); GFLOP/s from the case's FLOP count;\n"
                 "peak = extra memory during one call, scratch = peak minus what the call returns; "
                 "rel diff = max|out - first peer's| / max|first peer's|")
    cols = ("impl", "median ms", "GFLOP/s", "peak MiB", "scratch MiB", "rel diff", "speedup vs peers / status")
    for rec in records:
        lines.append("")
        params = " ".join(f"{k}={v}" for k, v in rec["params"].items())
        lines.append(f"{rec['label']}  [{rec['mode']}]  {params}  ({rec['flops'] / 1e9:.3g} GFLOP)")
        for note in rec.get("notes", []):
            lines.append(f"  note: {note}")
        by_attnkit: dict[str, list[str]] = {}
        for r in rec["ratios"]:
            by_attnkit.setdefault(r["attnkit"], []).append(f"{r['speedup']:.2f}x {r['peer']}")
        table = [cols]
        for row in rec["results"]:
            if row["status"] != "ok":
                table.append((row["impl"], "-", "-", "-", "-", "-", f"{row['status']}: {row['reason']}"))
                continue
            peak, scratch = row.get("peak_bytes"), row.get("scratch_bytes")
            flops = row.get("flops_per_s")
            last = ", ".join(by_attnkit.get(row["impl"], [])) if row["kind"] == "attnkit" else "(peer)"
            if row.get("note"):
                last = f"{last}  ({row['note']})"
            table.append((
                row["impl"],
                _fmt(row["median_s"] * 1e3, ".3f"),
                _fmt(None if flops is None else flops / 1e9, ".1f"),
                _fmt(None if peak is None else peak / 2**20, ".2f"),
                _fmt(None if scratch is None else scratch / 2**20, ".2f"),
                _fmt(row.get("max_rel_diff"), ".1e"),
                last,
            ))
        widths = [max(len(t[i]) for t in table) for i in range(len(cols) - 1)]
        for t in table:
            cells = [t[0].ljust(widths[0])] + [t[i].rjust(widths[i]) for i in range(1, len(cols) - 1)]
            lines.append("  " + "  ".join(cells) + "  " + t[-1])
    return "\n".join(lines) + "\n"


def write_plot(path: str | os.PathLike, meta: dict, records: list[dict]) -> Path:
    """A PNG: per family, the achieved GFLOP/s of every implementation that ran, case by case
    (log scale, the value printed on each bar; one colour per implementation throughout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    families = list(dict.fromkeys(r["family"] for r in records)) or ["(no cases)"]
    names = list(dict.fromkeys(row["impl"] for r in records for row in r["results"]))
    palette = plt.get_cmap("tab20").colors
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    fig, axes = plt.subplots(len(families), 1, figsize=(12, 3.6 * len(families)), squeeze=False)
    for ax, family in zip(axes[:, 0], families):
        recs = [r for r in records if r["family"] == family]
        seen: dict[str, Any] = {}
        values = []
        for i, rec in enumerate(recs):
            ran = [row for row in rec["results"] if row["status"] == "ok" and row.get("flops_per_s")]
            width = 0.8 / max(1, len(ran))
            for j, row in enumerate(ran):
                x = i + (j - (len(ran) - 1) / 2) * width
                y = row["flops_per_s"] / 1e9
                bar = ax.bar(x, y, width=width * 0.95, color=colors[row["impl"]])
                seen.setdefault(row["impl"], bar)
                ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=6)
                values.append(y)
        ax.set_xticks(range(len(recs)))
        ax.set_xticklabels([f"{r['name']}\n[{r['mode']}]" for r in recs], fontsize=7)
        ax.set_xlim(-0.6, max(1, len(recs)) - 0.4)
        ax.set_ylabel("GFLOP/s")
        ax.set_title(family, fontsize=10)
        if values:
            ax.set_yscale("log")
            ax.set_ylim(min(values) / 3, max(values) * 3)
            ax.legend(list(seen.values()), list(seen), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        else:
            ax.text(0.5, 0.5, "no implementation ran", ha="center", va="center", transform=ax.transAxes)
        ax.grid(axis="y", alpha=0.3, which="both")
    fig.suptitle(f"attnkit bench — {meta.get('device')} ({meta.get('device_name')}), {meta.get('date')}"
                 + (" [quick]" if meta.get("quick") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# command line


def default_out_dir() -> Path:
    """``bench/out`` of the source checkout (git-ignored) when attnkit is installed in editable
    mode, else ``./bench/out``."""
    here = Path(__file__).resolve().parent
    if (here.parent / "setup.py").exists():
        return here / "out"
    return Path.cwd() / "bench" / "out"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attnkit bench",
        description="Benchmark attnkit's backends against torch SDPA, FlexAttention and plain PyTorch "
                    "on the same inputs; prints a table and writes DIR/bench-<device>.json and .png.",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: cpu)")
    p.add_argument("--family", default=",".join(FAMILIES),
                   help=f"comma-separated families (default: all of {','.join(FAMILIES)})")
    p.add_argument("--quick", action="store_true", help="small shapes: the whole sweep in a few minutes on 2 CPU cores")
    p.add_argument("--out", default=None, help="output folder (default: bench/out/, git-ignored)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per implementation, exactly (default: up to 10, at least 3, fewer when "
                        "they would take over ~15 s; --quick: up to 5, within ~2 s)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 2; 1 with --quick)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory calls")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_families(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown or not names:
        raise ValueError(f"--family: unknown {', '.join(unknown) or '(empty)'}; expected a comma-separated "
                         f"subset of {','.join(FAMILIES)}")
    return list(dict.fromkeys(names))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        families = parse_families(args.family)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    for name in ("repeats", "warmup"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "repeats" else 0):
            parser.error(f"--{name} must be >= {1 if name == 'repeats' else 0}; got {value}")
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 10)
    max_time = None if args.repeats is not None else (2.0 if args.quick else 15.0)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    device = torch.device(args.device)
    out_dir = Path(args.out) if args.out else default_out_dir()

    t0 = time.perf_counter()
    machine = machine_peaks(device)
    cases = collect_cases(families, quick=args.quick, device=device)
    records = run_sweep(cases, device, warmup=warmup, repeats=repeats, memory=not args.no_memory,
                        max_time=max_time, progress=not args.no_progress)
    meta = make_meta(device, quick=args.quick, warmup=warmup, repeats=repeats, families=families,
                     memory=not args.no_memory, machine=machine, max_time=max_time)
    meta["wall_s"] = time.perf_counter() - t0
    json_path = write_json(out_dir / f"bench-{device.type}.json", meta, records)
    try:
        png_path = write_plot(out_dir / f"bench-{device.type}.png", meta, records)
    except ImportError as exc:
        png_path = f"not written ({exc}; pip install matplotlib)"
    sys.stdout.write(format_table(meta, records))
    print(f"\nwrote {json_path}\nwrote {png_path}\n({meta['wall_s']:.0f} s)")
    return 0

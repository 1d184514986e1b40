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

Timing, CUDA (:func:`cuda_time_calls`).  The first warmup call compiles and autotunes the Triton
kernels (seconds; never timed).  Each timed call is bracketed by CUDA events, after zeroing a
buffer larger than the L2 cache (as ``triton.testing.do_bench`` does: a call that streams its
inputs is not timed from a warm cache) and after a short GPU spin (``torch.cuda._sleep``) that
lets the host queue the whole call before the start event is reached: the events then measure
the device's time for the call, not the host's Python and launch overhead, which is recorded
apart (``host_s``, flagged in the table when it exceeds the device time).  Medians, as on the CPU.

Streaming (:mod:`attnkit.bench.live`).  ``python -m attnkit bench`` prints each case's block
as soon as the case finishes and rewrites the JSON after every implementation, so that a run
stopped midway keeps what it measured; ``--deadline`` stops starting cases past a time budget and
still writes the JSON and the plot.  After an implementation loses the CUDA context (a sticky
error), the cases left continue in a fresh process (:mod:`attnkit.bench.respawn`).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
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

from .._cpuinfo import cpu_info
from .._cpuinfo import describe as describe_cpu
from .._dispatch import cpu_kernels

FAMILIES = ("softmax", "linear", "sparse", "hopfield", "varlen", "options")
KINDS = ("attnkit", "peer")
SCHEMA = "attnkit-bench/1"

# A reference implementation materializes the full score matrix; it is for checking, not
# speed.  Above this many bytes for one score matrix the sweep skips it (and says so).
REFERENCE_SCORE_LIMIT = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}

# Zeroed before every timed CUDA call to evict the previous call's data from the L2 cache
# (50 MiB on an H100; triton.testing.do_bench uses the same 256 MiB).
L2_FLUSH_BYTES = 256 * 2**20
# Longest GPU spin queued ahead of a timed CUDA call (see cuda_time_calls).
MAX_HOLD_S = 0.05


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
    cpu_gemm: str = ""  # ATTNKIT_CPU_GEMM for the whole timed call (forward and backward); "" as set

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Impl.kind must be one of {KINDS}; got {self.kind!r}")


@dataclass
class Case:
    """One benchmark problem: shapes, FLOP count, inputs and the implementations to compare.

    ``make_inputs(device)`` returns a dict of tensors (the same for every implementation);
    ``grad_inputs`` names those that get gradients in a ``fwd+bwd`` case.  ``flops`` is the
    work of one call as counted by the family file (its docstring says how), so FLOP/s ratios
    equal time ratios.  ``bytes``: the least memory traffic of one call, for cases bound by it
    (the table then shows GB/s).  ``targets``: peer name -> the speedup an issue asks of attnkit
    over it; ``copy_fraction_target``: the fraction of the measured copy bandwidth
    (``meta.machine.copy_gb_per_s``) an issue asks for.  Both are checked in the record's
    ``targets`` and shown under the case's table.  ``priority``: the sweep runs lower values
    first, across families (the GPU sweep puts the issues' targets first, so that a run cut short
    by ``--deadline`` keeps them); equal values keep the family order.
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
    bytes: float = 0.0
    targets: dict[str, float] = field(default_factory=dict)
    copy_fraction_target: float | None = None
    priority: int = 0

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
    """Reproducible standard-normal inputs, drawn in float32 and cast: on the CPU for CPU tensors,
    on the GPU for CUDA tensors (drawing a GPU case's hundreds of MiB on the CPU and copying it
    over took seconds per case)."""
    device = torch.device(device)
    if device.type == "cuda":
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(*shape, generator=gen, device=device).to(dtype)
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


# 16-bit references on a CPU: torch's bfloat16 matmul ran 1.2 GFLOP/s on an AMD EPYC Zen 3 (no
# AVX512-BF16; the bench's machine probe), so a reference over 2^22 scores took 1.5 s (softmax
# N=1024, 8 heads) to 18 s (sparse N=4096) a call, for a row nobody compares against.
REFERENCE_16BIT_CPU_SCORES = 2**22


def reference_skip(score_bytes: float, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The skip reason for an attnkit reference run whose score matrix is ``score_bytes``
    (of ``dtype``'s elements when given: 16-bit ones on a CPU have a lower limit)."""
    limit = REFERENCE_SCORE_LIMIT.get(device.type, REFERENCE_SCORE_LIMIT["cpu"])
    if score_bytes > limit:
        return (
            f"the reference materializes a {fmt_bytes(score_bytes)} score matrix "
            f"(limit {fmt_bytes(limit)}; it is for checking, not speed)"
        )
    if (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and score_bytes / 2 > REFERENCE_16BIT_CPU_SCORES):
        return ("the reference is for checking, not speed (torch's 16-bit CPU matmul runs ~1 GFLOP/s "
                "on CPUs without AVX512-BF16)")
    return ""


def attnkit_impls(
    family: str,
    device: torch.device,
    call: Callable[[str], Callable[[dict], Any]],
    *,
    reference_skip_reason: str = "",
    dtype: torch.dtype | None = None,
) -> list[Impl]:
    """One :class:`Impl` per attnkit backend usable for ``family`` on ``device``.

    ``dtype`` (the case's): where the cpu backend's kernels take oneDNN's brgemm for it by
    default (a CPU with AMX: ``ATTNKIT_CPU_GEMM=auto``, csrc/cpu/gemm_path.h), a second cpu row,
    ``attnkit[cpu] native tiles``, runs the same call with ``ATTNKIT_CPU_GEMM=native``, so that one
    run measures both tile-GEMM paths.

    ``call(backend)`` returns the forward ``fn(inputs)`` for that backend.  Backends that
    ``attnkit.backends()`` reports unusable are left out (the JSON's meta lists why); the Triton
    interpreter (``TRITON_INTERPRET=1`` on CPU tensors) is left out because it is a checking
    tool, not a fast path.  On CUDA the reference is left out too (its N×N scores are slow and
    big there; each output is checked against the first peer's instead, see ``max_rel_diff``).
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
        if backend == "reference" and device.type == "cuda":
            skip = "the reference is for checking, not speed (outputs are checked against the first peer)"
        impls.append(Impl(name, "attnkit", fn=call(backend), backend=backend, skip=skip))
        if backend == "cpu" and device.type == "cpu" and dtype is not None and auto_cpu_gemm(family, dtype) not in (
                "", "native"):
            impls.append(Impl(f"{name} native tiles", "attnkit", fn=call(backend), backend=backend,
                              cpu_gemm="native",
                              note="ATTNKIT_CPU_GEMM=native (auto here: AMX, by brgemm -- float16 split in bfloat16 pairs "
                                   "where AMX has no float16 -- or the decoding kernel's own tiles)"))
    return impls


def auto_cpu_gemm(family: str, dtype: torch.dtype) -> str:
    """The tile-GEMM path the cpu backend of ``family`` takes for ``dtype`` under
    ``ATTNKIT_CPU_GEMM=auto`` ("" where the family or the build does not choose at run time)."""
    from .._dispatch import _MAIN_GEMM_USE, RUNTIME_GEMM_FAMILIES, native

    if family not in RUNTIME_GEMM_FAMILIES:
        return ""
    try:
        module = native()
    except Exception:  # noqa: BLE001 - no extension: no cpu backend either
        return ""
    if not hasattr(module, "cpu_gemm_path"):
        return ""
    with cpu_gemm_env("auto"):
        return module.cpu_gemm_path(str(dtype).removeprefix("torch."), _MAIN_GEMM_USE.get(family, "tiles"))


@contextlib.contextmanager
def cpu_gemm_env(value: str):
    """ATTNKIT_CPU_GEMM set to ``value`` inside the block (read by the kernels on every call)."""
    from .._dispatch import CPU_GEMM_ENV_VAR

    before = os.environ.get(CPU_GEMM_ENV_VAR)
    os.environ[CPU_GEMM_ENV_VAR] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[CPU_GEMM_ENV_VAR]
        else:
            os.environ[CPU_GEMM_ENV_VAR] = before


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


def _prepare_step(case: Case, impl: Impl, inputs: dict, device: torch.device) -> Callable[[], Any]:
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


def prepare(case: Case, impl: Impl, inputs: dict, device: torch.device) -> Callable[[], Any]:
    """A zero-argument callable that runs one timed call of ``impl`` on ``inputs``
    (:func:`_prepare_step`), under ``impl.cpu_gemm`` when the row forces a tile-GEMM path."""
    step = _prepare_step(case, impl, inputs, device)
    if not impl.cpu_gemm:
        return step

    def forced():
        with cpu_gemm_env(impl.cpu_gemm):
            return step()
    return forced


# With an automatic repeat count (``max_time`` given): warm up for at least this share of
# ``max_time`` and time at least this share of it, within SHORT_CALL_MAX_REPEATS calls (CPU
# defaults: 0.05 s warm, 0.1 s timed with --quick; 0.375 s and 0.75 s in the full sweep).
SHORT_CALL_WARMUP_SHARE = 1 / 40
SHORT_CALL_TIME_SHARE = 1 / 20
SHORT_CALL_MAX_REPEATS = 400


def time_calls(step: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
               timer: Callable[[], float] = time.perf_counter, max_time: float | None = None,
               min_repeats: int = 3, info: dict | None = None) -> tuple[list[float], Any]:
    """``warmup`` untimed calls (at least one), then the timed ones; returns (seconds per call,
    the last warmup call's output).

    ``repeats`` timed calls; with ``max_time`` fewer when the last warmup call says ``repeats``
    would take longer than that, but never fewer than ``min(repeats, min_repeats)`` — and a
    single warmup call when that one already took over a third of ``max_time``.  With
    ``max_time``, short calls also get more: warmup calls until ``max_time / 40`` has passed and
    timed calls filling ``max_time / 20`` (at most ``SHORT_CALL_MAX_REPEATS`` each).
    On CUDA with the default timer: :func:`cuda_time_calls` (which fills ``info``).
    """
    if device.type == "cuda" and timer is time.perf_counter:
        return cuda_time_calls(step, device, warmup=warmup, repeats=repeats, max_time=max_time,
                               min_repeats=min_repeats, info=info)
    out, last, warm = None, 0.0, 0.0
    i = 0
    while i < max(1, warmup) or (max_time is not None and warm < max_time * SHORT_CALL_WARMUP_SHARE
                                 and i < SHORT_CALL_MAX_REPEATS):
        if i and max_time is not None and last > max_time / 3:
            break
        _sync(device)
        t0 = timer()
        out = step()
        _sync(device)
        last = timer() - t0
        warm += last
        i += 1
    count = repeats
    if max_time is not None and last > 0:
        count = max(min(repeats, min_repeats), min(repeats, int(max_time / last)))
        # Short calls: more of them, so that the median rests on a fixed stretch of time rather
        # than on 10 calls of a millisecond (measured: sub-2 ms cases spread 15-35% over 5 fresh
        # processes with 10 calls each, session 4).
        count = max(count, min(SHORT_CALL_MAX_REPEATS, math.ceil(max_time * SHORT_CALL_TIME_SHARE / last)))
    times = []
    for _ in range(count):
        _sync(device)
        t0 = timer()
        step()
        _sync(device)
        times.append(timer() - t0)
    return times, out


_CUDA_STATE: dict = {}


def _cuda_flush_buffer(device: torch.device) -> torch.Tensor:
    key = ("flush", str(device))
    if key not in _CUDA_STATE:
        _CUDA_STATE[key] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    return _CUDA_STATE[key]


def _cuda_spin_rate(device: torch.device) -> float | None:
    """Cycles per second of ``torch.cuda._sleep``'s spin loop, measured once with events (None
    where that private helper is missing: then no spin is queued)."""
    key = ("spin", str(device))
    if key not in _CUDA_STATE:
        rate = None
        spin = getattr(torch.cuda, "_sleep", None)
        if spin is not None:
            try:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                spin(1000)
                start.record()
                spin(2_000_000)
                end.record()
                end.synchronize()
                rate = 2e6 / (start.elapsed_time(end) / 1e3)
            except Exception:  # noqa: BLE001 - timing still works without the spin
                rate = None
        _CUDA_STATE[key] = rate
    return _CUDA_STATE[key]


def _cuda_timed_call(step: Callable[[], Any], flush: torch.Tensor, hold_s: float, rate: float | None):
    """Queue one timed call: flush L2, spin ``hold_s`` (the host queues the call meanwhile),
    start event, the call, end event.  Returns (start, end, host seconds of the call)."""
    flush.zero_()
    if hold_s > 0 and rate:
        torch.cuda._sleep(int(hold_s * rate))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0
    end.record()
    return start, end, host


def cuda_time_calls(step: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int,
                    max_time: float | None = None, min_repeats: int = 3,
                    info: dict | None = None) -> tuple[list[float], Any]:
    """Device seconds of ``repeats`` calls, timed with CUDA events; returns (seconds per call, the
    last warmup call's output), like :func:`time_calls`.

    The ``warmup`` calls (at least one) come first: the first one compiles and autotunes.  A
    probe call then gives the host time of a call (Python and launches) and a first device time;
    each timed call is queued behind an L2 flush and a GPU spin of twice that host time (at most
    ``MAX_HOLD_S``), so that the GPU reaches the start event only once the whole call is queued:
    the events time the device's work, not the host's.  With ``max_time``, fewer calls when
    ``repeats`` would take longer (never fewer than ``min(repeats, min_repeats)``).  ``info``
    receives ``host_s`` (the probe's host time) and ``timing``.
    """
    out = None
    for _ in range(max(1, warmup)):
        out = step()
    torch.cuda.synchronize(device)
    flush = _cuda_flush_buffer(device)
    rate = _cuda_spin_rate(device)
    start, end, host = _cuda_timed_call(step, flush, 0.0, rate)
    torch.cuda.synchronize(device)
    probe = start.elapsed_time(end) / 1e3
    count = repeats
    if max_time is not None:
        count = max(min(repeats, min_repeats), min(repeats, int(max_time / max(probe, 1e-6))))
    hold = min(MAX_HOLD_S, 2.0 * host + 1e-4) if rate else 0.0
    calls = [_cuda_timed_call(step, flush, hold, rate) for _ in range(count)]
    torch.cuda.synchronize(device)
    if info is not None:
        info.update(host_s=host, timing="cuda-events" + (" (host queued ahead)" if rate else ""))
    return [s.elapsed_time(e) / 1e3 for s, e, _ in calls], out


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
             max_time: float | None = None) -> tuple[dict, Any, Callable[[], Any] | None]:
    """Measure one implementation; never raises (failures become the row's status).  Returns
    (row, the last warmup call's output, the timed step: None unless the row is ok)."""
    row = {"impl": impl.name, "kind": impl.kind, "backend": impl.backend, "status": "ok", "reason": "",
           "note": impl.note}
    if impl.unavailable:
        row.update(status="unavailable", reason=impl.unavailable)
        return row, None, None
    if impl.skip:
        row.update(status="skipped", reason=impl.skip)
        return row, None, None
    from .._dispatch import BackendUnavailableError

    out, step = None, None
    started = time.perf_counter()
    try:
        step = prepare(case, impl, inputs, device)
        info: dict = {}
        times, out = time_calls(step, device, warmup=warmup, repeats=repeats, timer=timer, max_time=max_time,
                                info=info)
        median = statistics.median(times)
        row.update(
            repeats=len(times),
            median_s=median,
            min_s=min(times),
            times_s=times,
            flops_per_s=case.flops / median if median > 0 else None,
        )
        if case.bytes and median > 0:
            row["bytes_per_s"] = case.bytes / median
        row.update(info)
        if memory:
            row.update(measure_memory(step, device))
    except (Unavailable, BackendUnavailableError) as exc:
        row.update(status="unavailable", reason=str(exc))
        out, step = None, None
    except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the sweep
        row.update(status="error", reason=_first_line(exc))
        out, step = None, None
    row["wall_s"] = time.perf_counter() - started  # everything: warmup, timed and memory calls
    return row, out, step


# Interleaved timing (CPU runs of ``python -m attnkit bench``): after every implementation of a
# case has been measured on its own, each is timed again in rounds that run every implementation
# in turn, and those times are the ones reported.  On the shared 2-core machines the project is
# measured on, timing each implementation in one block let the load of the moment decide the
# ratio: the same cell (softmax float32 N=1024 forward, AMD EPYC Zen 3) read 0.84x in one
# `bench --quick` and 1.86x in another the same day, against 1.18x interleaved by
# bench/softmax_cpu_speed.py (session 12).  Interleaving makes a busy stretch hit every
# implementation alike.
# A short call's block in a round starts with one untimed call: the intra-op pool's threads go
# to sleep while another implementation runs single-threaded, and waking them cost a 46 us SDPA
# call (N=16) up to 42 ms on the loaded machine (AMD EPYC Zen 3, load 7, session 13); a call in a
# steady loop finds them awake.
INTERLEAVE_WARM_BELOW_S = 0.01


def interleave_rows(rows: list[dict | None], steps: list[Callable[[], Any] | None],
                    timer: Callable[[], float] = time.perf_counter) -> None:
    """Re-time the rows that measured ok (with ``steps[i]`` their step) in interleaved rounds:
    as many rounds as the fewest timed calls any of them made, each round running implementation
    i ``calls_i`` times in a row (its own timed calls spread over the rounds; after one untimed
    call when its calls are short) and recording each call.  The row's median, minimum, times and rates become the interleaved ones; the block
    figures stay as ``block_median_s`` and ``block_times_s``.  Needs two rows or more."""
    live = [i for i, r in enumerate(rows) if r is not None and r.get("status") == "ok" and steps[i] is not None
            and r.get("times_s")]
    if len(live) < 2:
        return
    rounds = min(len(rows[i]["times_s"]) for i in live)
    calls = {i: max(1, round(len(rows[i]["times_s"]) / rounds)) for i in live}
    warm = {i: rows[i]["median_s"] < INTERLEAVE_WARM_BELOW_S for i in live}
    times = {i: [] for i in live}
    for _ in range(rounds):
        for i in live:
            if warm[i]:
                steps[i]()
            for _ in range(calls[i]):
                t0 = timer()
                steps[i]()
                times[i].append(timer() - t0)
    for i in live:
        row, median = rows[i], statistics.median(times[i])
        row.update(block_median_s=row["median_s"], block_times_s=row["times_s"], times_s=times[i],
                   median_s=median, min_s=min(times[i]), repeats=len(times[i]), timing="interleaved")
        row["flops_per_s"] = row["flops_per_s"] and (row["flops_per_s"] * row["block_median_s"] / median)
        if row.get("bytes_per_s"):
            row["bytes_per_s"] = row["bytes_per_s"] * row["block_median_s"] / median


def _pending_row(impl: Impl, reason: str = "not run yet") -> dict:
    return {"impl": impl.name, "kind": impl.kind, "backend": impl.backend, "status": "pending", "reason": reason,
            "note": impl.note}


def cuda_context_error(device: torch.device) -> str:
    """'' while the CUDA context works, else the error that broke it.

    An illegal address or a device-side assert is sticky: every later CUDA call of the process
    fails with it, so the sweep stops rather than report every later row as an error."""
    if device.type != "cuda":
        return ""
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
        return ""
    except Exception as exc:  # noqa: BLE001 - whatever it is, nothing more can run
        return _first_line(exc)


def _case_record(case: Case, rows: list[dict]) -> dict:
    return {
        "family": case.family,
        "name": case.name,
        "label": case.label,
        "mode": case.mode,
        "params": case.params,
        "flops": case.flops,
        "bytes": case.bytes or None,
        "notes": list(case.notes),
        "results": rows,
        "ratios": speedups(rows),
    }


def check_targets(case: Case, rec: dict, machine: dict | None = None) -> list[dict]:
    """The case's targets against what was measured: one entry per (attnkit backend, target),
    ``got`` None where that backend has no measurement.  Sets ``copy_fraction`` on attnkit rows
    when the case has a bandwidth target and the machine's copy bandwidth is known."""
    copy = (machine or {}).get("copy_gb_per_s")
    ours = [r for r in rec["results"] if r["kind"] == "attnkit" and r.get("backend") != "reference"]
    out = []
    for row in ours:
        for peer, want in case.targets.items():
            got = next((r["speedup"] for r in rec["ratios"]
                        if r["attnkit"] == row["impl"] and r["peer"] == peer), None)
            out.append({"attnkit": row["impl"], "what": f"speedup vs {peer}", "want": want, "got": got,
                        "met": None if got is None else got >= want})
        if case.copy_fraction_target:
            got = None
            if copy and row.get("bytes_per_s"):
                got = row["copy_fraction"] = row["bytes_per_s"] / 1e9 / copy
            out.append({"attnkit": row["impl"], "what": "fraction of the copy bandwidth",
                        "want": case.copy_fraction_target, "got": got,
                        "met": None if got is None else got >= case.copy_fraction_target})
    return out


def run_case(case: Case, device: torch.device, *, warmup: int = 1, repeats: int = 5, memory: bool = True,
             timer: Callable[[], float] = time.perf_counter, max_time: float | None = None,
             progress=None, on_row: Callable[[dict], None] | None = None,
             machine: dict | None = None, interleave: bool = False) -> dict:
    """Run every implementation of ``case`` on the same inputs; returns the case's JSON record.

    ``interleave`` (CPU only): the implementations are timed again in interleaved rounds after
    they have all run (:func:`interleave_rows`), and those times are reported.

    Never raises for a failing implementation (its row says why).  ``on_row(record)`` is called
    with the record so far after each implementation (rows not yet run have status
    ``pending``).  On CUDA, an implementation that breaks the CUDA context ends the case: the
    record then has ``aborted`` (the reason), and the rows left are skipped.
    """
    started = time.perf_counter()
    rows: list[dict | None] = [None] * len(case.impls)
    steps: list[Callable[[], Any] | None] = [None] * len(case.impls)
    aborted = ""
    try:
        inputs = case.make_inputs(device)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the case is reported, not the sweep
        inputs = None
        reason = f"making the inputs failed: {_first_line(exc)}"
        rows = [dict(_pending_row(impl), status="error", reason=reason) for impl in case.impls]
        aborted = cuda_context_error(device)
    # Peers first, so their output is the baseline the attnkit outputs are checked against.
    order = sorted(range(len(case.impls)), key=lambda i: case.impls[i].kind != "peer")
    if inputs is None:
        order = []
    baseline, baseline_name = None, None
    for i in order:
        impl = case.impls[i]
        if aborted:
            rows[i] = dict(_pending_row(impl), status="skipped", reason=f"CUDA context lost ({aborted})")
            continue
        if progress is not None:
            progress.set_postfix_str(f"{case.label} · {impl.name}", refresh=True)
        row, out, step = run_impl(case, impl, inputs, device, warmup=warmup, repeats=repeats, memory=memory,
                                  timer=timer, max_time=max_time)
        if interleave and device.type != "cuda":
            steps[i] = step
        if row["status"] == "error":
            aborted = cuda_context_error(device)
            if aborted:
                row["reason"] += f" (and the CUDA context is lost: {aborted})"
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
        if device.type == "cuda" and not aborted:
            torch.cuda.empty_cache()  # one implementation's cached blocks must not crowd the next
        if progress is not None:
            progress.update(1)
        if on_row is not None:
            partial = _case_record(case, [r or _pending_row(case.impls[j]) for j, r in enumerate(rows)])
            partial["targets"] = check_targets(case, partial, machine)
            on_row(partial)
    if interleave and device.type != "cuda":
        interleave_rows(rows, steps, timer)
    del baseline, inputs, steps
    gc.collect()
    if device.type == "cuda" and not aborted:
        torch.cuda.empty_cache()
    rec = _case_record(case, rows)
    rec["targets"] = check_targets(case, rec, machine)
    rec["wall_s"] = time.perf_counter() - started
    if aborted:
        rec["aborted"] = f"CUDA context lost: {aborted}"
    return rec


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
    """The families' cases, lowest ``priority`` first (a stable sort: the CPU cases, all 0, keep
    the family order)."""
    import importlib

    cases = []
    for family in families:
        module = importlib.import_module(f".{family}", __package__)
        cases.extend(module.cases(quick=quick, device=device))
    return sorted(cases, key=lambda c: c.priority)


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
              max_time: float | None = None, progress: bool = True, deadline_at: float | None = None,
              on_start: Callable[[Case, int], None] | None = None,
              on_row: Callable[[dict], None] | None = None,
              on_record: Callable[[dict], None] | None = None, machine: dict | None = None,
              interleave: bool = False) -> list[dict]:
    """Run the cases in order; a tqdm bar on stderr counts the (case, implementation) runs.
    ``interleave``: as in :func:`run_case`.

    ``deadline_at`` (a ``time.perf_counter()`` value): no case starts after it; the cases not
    run are those past ``len(records)``.  A case whose record says ``aborted`` (the CUDA context
    is lost) ends the sweep too.  ``on_start(case, index)`` before a case, ``on_row`` as in
    :func:`run_case`, ``on_record(record)`` after it: the streaming output hangs on these.
    """
    bar = _progress_bar(sum(len(c.impls) for c in cases), progress)
    records = []
    try:
        for index, case in enumerate(cases):
            if deadline_at is not None and time.perf_counter() >= deadline_at:
                break
            if on_start is not None:
                on_start(case, index)
            rec = run_case(case, device, warmup=warmup, repeats=repeats, memory=memory, timer=timer,
                           max_time=max_time, progress=bar, on_row=on_row, machine=machine,
                           interleave=interleave)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
            if rec.get("aborted"):
                break
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
    """Measured GEMM throughput (and copy bandwidth) of this machine, to put FLOP/s in context.

    The GEMM size doubles from 256 up to 2048 (CPU; 8192 on a GPU) while one product takes
    under 50 ms: on the AMD EPYC with AVX2 only, torch's bfloat16 matmul ran at 0.2 GFLOP/s
    and the fixed 2048^3 probe cost ~7 minutes before the first case (session 12).
    ``gemm_<dtype>_n`` records the size each rate was measured at."""
    n_max = 2048 if device.type == "cpu" else 8192
    peaks = {}
    for dtype in (torch.float32, torch.bfloat16):
        n = 256
        while True:
            a = seeded_randn((n, n), dtype, device, 1)
            b = seeded_randn((n, n), dtype, device, 2)
            one, _ = time_calls(lambda: a @ b, device, warmup=1, repeats=1, timer=timer)
            if n >= n_max or one[0] >= 0.05:
                break
            n *= 2
        times, _ = time_calls(lambda: a @ b, device, warmup=0, repeats=5, timer=timer)
        peaks[f"gemm_{dtype_name(dtype)}_gflops"] = 2 * n**3 / statistics.median(times) / 1e9
        peaks[f"gemm_{dtype_name(dtype)}_n"] = n
    peaks["gemm_n"] = peaks["gemm_float32_n"]
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
        # CUDA: the compute capability ("9.0"), the key of attnkit's GPU dispatch table
        # (attnkit/_gpu_table.py, built from this JSON by bench/gpu_dispatch_table.py)
        "capability": ("%d.%d" % torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        # attnkit's switches in force (ATTNKIT_CUDA_SM90 picks the CUDA C++ kernels measured)
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ATTNKIT_")},
        "torch": torch.__version__,
        "attnkit": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_info(),  # model, vendor, AVX2 / AVX-512 / AMX flags (also for a CUDA run's host)
        "cpu_kernels": cpu_kernels(),  # the vector path attnkit's CPU kernels were built for
        # ... and the tile-GEMM path the softmax kernels (forward, backward, decode) take per dtype
        # (chosen at run time)
        "cpu_kernels_softmax": cpu_kernels("softmax"),
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


def _rate_unit(meta: dict) -> tuple[float, str]:
    """FLOP/s shown in TFLOP/s on a GPU, GFLOP/s on a CPU."""
    return (1e12, "TFLOP/s") if meta.get("device") == "cuda" else (1e9, "GFLOP/s")


def format_header(meta: dict) -> list[str]:
    """The report's first lines: the run, the machine (when measured) and the legend."""
    lines = []
    machine = meta.get("machine") or {}
    repeats = f"{meta.get('repeats')}"
    if meta.get("max_time_s"):
        repeats = (f"up to {repeats} (3+ within ~{meta['max_time_s']:g} s; short calls more, "
                   f"filling ~{meta['max_time_s'] * SHORT_CALL_TIME_SHARE:g} s)")
    head = f"attnkit bench — {meta.get('device')} ({meta.get('device_name')}), torch {meta.get('torch')}, " \
           f"{meta.get('threads')} threads, median of {repeats} calls after {meta.get('warmup')} warmup"
    if meta.get("interleaved"):
        head += ", then again in interleaved rounds (those reported)"
    lines.append(head + (" [quick]" if meta.get("quick") else ""))
    if meta.get("cpu"):
        lines.append(("cpu: " if meta.get("device") == "cpu" else "host cpu: ") + describe_cpu(meta["cpu"]))
    if meta.get("cpu_kernels") and meta.get("device") == "cpu":
        lines.append("attnkit cpu kernels: " + meta["cpu_kernels"])
        if meta.get("cpu_kernels_softmax"):
            # From the run-time choice on: the tiles' path per dtype, then the decoding kernel's
            # where it differs (a CPU with AMX; attnkit._dispatch.cpu_kernels).
            text = meta["cpu_kernels_softmax"]
            start = text.find("; forward, backward and decode tile GEMMs")
            lines.append("attnkit cpu softmax: " + (text[start + 2:] if start >= 0 else text.rsplit("; ", 1)[-1]))
    if machine:
        lines.append(format_machine(machine))
    lines.extend(format_legend(meta))
    return lines


def format_machine(machine: dict) -> str:
    return "machine: " + ", ".join(
        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in machine.items())


def format_legend(meta: dict) -> list[str]:
    unit = _rate_unit(meta)[1]
    lines = [f"speedup = peer time / attnkit time (> 1: attnkit faster); {unit} from the case's FLOP count;\n"
             "peak = extra memory during one call, scratch = peak minus what the call returns; "
             "rel diff = max|out - first peer's| / max|first peer's|"]
    if meta.get("device") == "cuda":
        lines.append("CUDA: device time per call from CUDA events (autotuning and compilation happen in the "
                     "untimed warmup); GB/s = the case's least memory traffic / time")
    return lines


def _fmt_work(flops: float, meta: dict) -> str:
    scale, unit = _rate_unit(meta)
    return f"{flops / scale:.3g} {unit[:-2]}"


def format_case(rec: dict, meta: dict) -> list[str]:
    """One case's block: its title line, notes, one row per implementation, its targets."""
    scale, unit = _rate_unit(meta)
    with_bytes = any(row.get("bytes_per_s") for row in rec["results"])
    cols = ("impl", "median ms", unit, *(("GB/s",) if with_bytes else ()), "peak MiB", "scratch MiB",
            "rel diff", "speedup vs peers / status")
    lines = [""]
    params = " ".join(f"{k}={v}" for k, v in rec["params"].items())
    title = f"{rec['label']}  [{rec['mode']}]  {params}  ({_fmt_work(rec['flops'], meta)})"
    if rec.get("wall_s") is not None:
        title += f"  [{rec['wall_s']:.1f} s]"
    lines.append(title)
    for note in rec.get("notes", []):
        lines.append(f"  note: {note}")
    by_attnkit: dict[str, list[str]] = {}
    for r in rec["ratios"]:
        by_attnkit.setdefault(r["attnkit"], []).append(f"{r['speedup']:.2f}x {r['peer']}")
    table = [cols]
    for row in rec["results"]:
        if row["status"] != "ok":
            table.append((row["impl"], *["-"] * (len(cols) - 2), f"{row['status']}: {row['reason']}"))
            continue
        peak, scratch = row.get("peak_bytes"), row.get("scratch_bytes")
        flops = row.get("flops_per_s")
        last = ", ".join(by_attnkit.get(row["impl"], [])) if row["kind"] == "attnkit" else "(peer)"
        notes = [row["note"]] if row.get("note") else []
        host = row.get("host_s")
        if host and row.get("median_s") and host > 1.5 * row["median_s"]:
            notes.append(f"host-bound when called eagerly: {host * 1e3:.3f} ms of Python and launches per call")
        if row.get("copy_fraction") is not None:
            notes.append(f"{100 * row['copy_fraction']:.0f}% of the copy bandwidth")
        if notes:
            last = f"{last}  ({'; '.join(notes)})"
        cells = [row["impl"], _fmt(row["median_s"] * 1e3, ".3f"), _fmt(None if flops is None else flops / scale, ".1f")]
        if with_bytes:
            bps = row.get("bytes_per_s")
            cells.append(_fmt(None if bps is None else bps / 1e9, ".0f"))
        cells += [_fmt(None if peak is None else peak / 2**20, ".2f"),
                  _fmt(None if scratch is None else scratch / 2**20, ".2f"),
                  _fmt(row.get("max_rel_diff"), ".1e"), last]
        table.append(tuple(cells))
    widths = [max(len(t[i]) for t in table) for i in range(len(cols) - 1)]
    for t in table:
        cells = [t[0].ljust(widths[0])] + [t[i].rjust(widths[i]) for i in range(1, len(cols) - 1)]
        lines.append("  " + "  ".join(cells) + "  " + t[-1])
    for tgt in rec.get("targets") or []:
        if tgt["got"] is None:
            verdict = "not measured"
        elif "fraction" in tgt["what"]:
            verdict = f"{100 * tgt['got']:.0f}%: {'met' if tgt['met'] else 'MISSED'}"
        else:
            verdict = f"{tgt['got']:.2f}x: {'met' if tgt['met'] else 'MISSED'}"
        want = f"{100 * tgt['want']:.0f}%" if "fraction" in tgt["what"] else f"{tgt['want']:g}x"
        lines.append(f"  target: {tgt['attnkit']} {tgt['what']} >= {want}: {verdict}")
    if rec.get("aborted"):
        lines.append(f"  ABORTED: {rec['aborted']}")
    return lines


def format_table(meta: dict, records: list[dict]) -> str:
    """The stdout report: the header, then one block per case, one row per implementation."""
    lines = format_header(meta)
    for rec in records:
        lines.extend(format_case(rec, meta))
    return "\n".join(lines) + "\n"


def write_plot(path: str | os.PathLike, meta: dict, records: list[dict]) -> Path:
    """A PNG: per family, the achieved GFLOP/s (TFLOP/s on a GPU) of every implementation that ran,
    case by case (log scale, the value printed on each bar; one colour per implementation
    throughout)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scale, unit = _rate_unit(meta)
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
                y = row["flops_per_s"] / scale
                bar = ax.bar(x, y, width=width * 0.95, color=colors[row["impl"]])
                seen.setdefault(row["impl"], bar)
                ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=6)
                values.append(y)
        ax.set_xticks(range(len(recs)))
        ax.set_xticklabels([f"{r['name']}\n[{r['mode']}]" for r in recs], fontsize=7)
        ax.set_xlim(-0.6, max(1, len(recs)) - 0.4)
        ax.set_ylabel(unit)
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
                    "on the same inputs; prints each case as it finishes and keeps DIR/bench-<device>.json "
                    "up to date (rewritten after every implementation); writes DIR/bench-<device>.png at the end.",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: cpu)")
    p.add_argument("--family", default=",".join(FAMILIES),
                   help=f"comma-separated families (default: all of {','.join(FAMILIES)})")
    p.add_argument("--quick", action="store_true",
                   help="small sweep: a few minutes on 2 CPU cores; on CUDA the issues' target cases only "
                        "(under a minute on one H100)")
    p.add_argument("--out", default=None, help="output folder (default: bench/out/, git-ignored)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="no case starts later than this many seconds after the start (the cases left are "
                        "listed as not run); the JSON and plot are still written")
    p.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                   help="with --deadline: a case still running this long after the deadline is abandoned and "
                        "the run ends with what it measured (exit status 3; default: 10)")
    p.add_argument("--match", default=None, metavar="REGEX",
                   help="only the cases whose label (family/name) or mode matches (re.search)")
    p.add_argument("--skip-impl", default=None, metavar="REGEX",
                   help="leave out the implementations whose name matches (re.search), e.g. 'cuda\\]|Flex'")
    p.add_argument("--list", action="store_true", help="list the cases and their implementations; run nothing")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per implementation, exactly (default: up to 10, at least 3, fewer when "
                        "they would take over ~15 s; --quick: up to 5, within ~2 s; CUDA: up to 20 within ~1 s; "
                        "short calls get more, filling 1/20 of that time, at most 400)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls first (default: 2; 1 with --quick on a CPU); the first one compiles and "
                        "autotunes the Triton kernels")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory calls")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (each case's start is printed instead)")
    p.add_argument("--respawns", type=int, default=8,
                   help="CUDA: how many times the cases left may continue in a fresh process after an "
                        "implementation loses the CUDA context (an illegal address is sticky; default: 8, "
                        "0: stop there)")
    # Passed by a parent to the child that continues its sweep (attnkit.bench.respawn).
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--machine-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip-in-case", action="append", default=[], help=argparse.SUPPRESS)
    return p


def parse_families(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAMILIES]
    if unknown or not names:
        raise ValueError(f"--family: unknown {', '.join(unknown) or '(empty)'}; expected a comma-separated "
                         f"subset of {','.join(FAMILIES)}")
    return list(dict.fromkeys(names))


# The exit status of ``main`` by how the run ended.
EXIT_STATUS = {"complete": 0, "deadline": 0, "abandoned": 3, "aborted": 4, "interrupted": 130}


def timing_defaults(device_type: str, quick: bool) -> tuple[int, float, int]:
    """(repeats, max_time, warmup) when not given.  CPU: as ever.  CUDA: a call takes
    milliseconds, so up to 20 calls within ~1 s; two warmup calls (the first compiles)."""
    if device_type == "cuda":
        return (10, 0.5, 2) if quick else (20, 1.0, 2)
    return (5, 2.0, 1) if quick else (10, 15.0, 2)


def select_cases(cases: Sequence[Case], match: str | None, skip_impl: str | None) -> list[Case]:
    """The cases ``--match`` keeps, with the implementations ``--skip-impl`` names marked skipped."""
    if match:
        pattern = re.compile(match)
        cases = [c for c in cases if pattern.search(c.label) or pattern.search(f"{c.label} [{c.mode}]")]
    if skip_impl:
        pattern = re.compile(skip_impl)
        for case in cases:
            for impl in case.impls:
                if pattern.search(impl.name) and not impl.skip and not impl.unavailable:
                    impl.skip = f"left out by --skip-impl {skip_impl!r}"
    return list(cases)


def skip_in_cases(cases: Sequence[Case], entries: Sequence[str]) -> None:
    """``--skip-in-case 'LABEL [MODE]=IMPL'``: leave out one implementation of one case (one that
    lost the CUDA context in the parent process, in that case or one of its family and mode)."""
    for entry in entries:
        key, _, name = entry.rpartition("=")
        for case in cases:
            if f"{case.label} [{case.mode}]" == key:
                for impl in case.impls:
                    if impl.name == name:
                        impl.skip = ("lost the CUDA context in a previous process (in this case or one of its "
                                     "family and mode: see the JSON's meta.restarts)")


def format_case_list(cases: Sequence[Case], device: torch.device) -> str:
    meta = {"device": device.type}
    lines = []
    for i, case in enumerate(cases):
        params = " ".join(f"{k}={v}" for k, v in case.params.items())
        lines.append(f"{i + 1:3d}. {case.label} [{case.mode}]  {params}  ({_fmt_work(case.flops, meta)})")
        for impl in case.impls:
            why = impl.unavailable or impl.skip
            lines.append(f"       {impl.name}" + (f"  ({'unavailable' if impl.unavailable else 'skipped'}: {why})"
                                                   if why else ""))
    return "\n".join(lines) + "\n"


def steady_memory() -> bool:
    """Keep freed large blocks in this process (glibc's malloc), so that every implementation's
    outputs and temporaries are recycled from the heap instead of being mapped and faulted in
    afresh on every call.  Returns whether it applied (glibc only).

    Why (issue 14, stable timings): glibc serves blocks above its mmap threshold (at most 32 MiB
    by default) with a fresh mmap per call and unmaps them on free, so a call that returns a
    32 MiB output (linear attention at B=1 H=8 N=16384 D=64) has the kernel zero ~8200 4 KiB or 16
    2 MiB pages each time.  What that costs differed from one fresh process to the next and stayed
    put within a process: 2-44 ms of system time per call (528-656 page faults each), the huge-page
    clearing (clear_page_erms) 11% of the profile samples in a slow process against 2.5% in a fast
    one; wall time per call 28 ms against 63 ms (static threads, 2026-11-26).  With large blocks
    kept: 0 faults per call after the first few, system time ~0.  Every implementation, peers
    included, is then timed on warm memory, as in a long-running training loop.
    """
    if os.environ.get("ATTNKIT_BENCH_FRESH_MEMORY"):  # opt out: time the page faults too
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):
        return False


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
    if args.deadline is not None and args.deadline <= 0:
        parser.error(f"--deadline must be > 0; got {args.deadline}")
    for name in ("match", "skip_impl"):
        try:
            re.compile(getattr(args, name) or "")
        except re.error as exc:
            parser.error(f"--{name.replace('_', '-')}: not a regular expression ({exc})")
    repeats, max_time, warmup = timing_defaults(args.device, args.quick)
    if args.repeats is not None:
        repeats, max_time = args.repeats, None
    warmup = args.warmup if args.warmup is not None else warmup
    device = torch.device(args.device)
    out_dir = Path(args.out) if args.out else default_out_dir()
    steady = device.type == "cpu" and steady_memory()

    t0 = time.perf_counter()
    if args.list:
        cases = select_cases(collect_cases(families, quick=args.quick, device=device), args.match, args.skip_impl)
        sys.stdout.write(format_case_list(cases, device))
        return 0

    from .live import LiveReport
    from .respawn import continue_in_child

    memory = not args.no_memory
    meta = make_meta(device, quick=args.quick, warmup=warmup, repeats=repeats, families=families,
                     memory=memory, machine=None, max_time=max_time)
    meta["steady_memory"] = steady  # large freed blocks kept (see steady_memory)
    meta["interleaved"] = device.type == "cpu"  # CPU: times from interleaved rounds (interleave_rows)
    bar = progress_available() and not args.no_progress
    report = LiveReport(out_dir, device.type, meta, started=t0, deadline=args.deadline, grace=args.grace,
                        announce_cases=not bar, child=args.child)
    not_run: list[str] = []
    status, why = "complete", ""
    with report.guard():
        try:
            report.header()
            report.machine(json.loads(args.machine_json) if args.machine_json else machine_peaks(device))
            cases = select_cases(collect_cases(families, quick=args.quick, device=device), args.match,
                                 args.skip_impl)
            skip_in_cases(cases, args.skip_in_case)
            report.plan(cases)
            records = run_sweep(cases, device, warmup=warmup, repeats=repeats, memory=memory, max_time=max_time,
                                progress=bar, deadline_at=report.deadline_at(), on_start=report.case_started,
                                on_row=report.row_done, on_record=report.case_done, machine=meta["machine"],
                                interleave=meta["interleaved"])
            not_run = [f"{c.label} [{c.mode}]" for c in cases[len(records):]]
            if records and records[-1].get("aborted"):
                status, why = "aborted", f"stopped: {records[-1]['aborted']} (in {records[-1]['label']})"
                if args.respawns > 0:
                    status, not_run, why = continue_in_child(args, report, cases, records, args.respawns)
            elif not_run:
                status, why = "deadline", f"deadline of {args.deadline:.3g} s reached at {report.elapsed():.0f} s"
        except KeyboardInterrupt:
            done = {f"{r['label']} [{r['mode']}]" for r in report.records}
            not_run = [c for c in meta.get("cases_planned", []) if c not in done]
            status, why = "interrupted", f"interrupted at {report.elapsed():.0f} s"
        report.finish(status, not_run, why)
    return EXIT_STATUS[status]


def progress_available() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True

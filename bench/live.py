"""Streaming output of ``python -m attnkit bench``: results as they come, and a run that can be
stopped at any point without losing what it measured.

:class:`LiveReport` prints the header as soon as the run starts, each case's block (the same
block as :func:`attnkit.bench.harness.format_table`) as soon as that case finishes, and rewrites
the JSON after every implementation (atomically: a reader never sees half a file), with
``meta.status`` saying whether the run is still ``running`` or ended ``complete``, at its
``deadline``, ``interrupted`` (Ctrl-C / SIGTERM), ``abandoned`` (a case overran the deadline by
more than the grace period) or ``aborted`` (the CUDA context was lost).  The plot is written at
the end, whichever way the run ends (except a kill -9).

Why the watchdog is a thread *and* faulthandler: a case that overruns (a Triton autotune of many
configs, a hung kernel) cannot be interrupted from Python.  At the deadline plus the grace period
a daemon thread writes the JSON and the plot and ends the process.  It needs the interpreter
lock, which a CUDA wait or a ptxas subprocess lets go of but a long C call that holds it would
not; should the thread not get to run, faulthandler's C-level timer ends the process a little
later, dumping every thread's traceback to stderr (which says where the run was stuck).  The
JSON on disk is complete up to the last implementation either way.
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from . import harness

# meta.status: still running, or how the run ended.
STATUSES = ("running", "complete", "deadline", "interrupted", "abandoned", "aborted")
# Exit status of a run the watchdog ended (a case overran deadline + grace).
EXIT_ABANDONED = 3
# faulthandler ends the process this long after the watchdog should have.
BACKSTOP_S = 20.0


def write_json_atomic(path: str | os.PathLike, meta: dict, records: list[dict]) -> Path:
    """``harness.write_json`` through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    harness.write_json(tmp, meta, records)
    os.replace(tmp, path)
    return path


def say(*lines: str) -> None:
    """Print and flush at once (stdout is a pipe to a log file on the GPU machines)."""
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


class LiveReport:
    """The run's stdout, JSON and plot, kept up to date case by case (see the module docstring).

    ``started`` is the run's ``time.perf_counter()`` at its start; ``deadline`` (seconds from
    then) and ``grace`` arm the watchdog in :meth:`guard`.
    """

    def __init__(self, out_dir: str | os.PathLike, device_type: str, meta: dict, *, started: float,
                 deadline: float | None = None, grace: float = 10.0, announce_cases: bool = False,
                 child: bool = False):
        out_dir = Path(out_dir)
        self.json_path = out_dir / f"bench-{device_type}.json"
        self.png_path = out_dir / f"bench-{device_type}.png"
        self.meta = meta
        self.records: list[dict] = []
        self.current: dict | None = None  # the record of the case running now (partial)
        self.running = ""  # the case running now ("label [mode]")
        self.started = started
        self.deadline = deadline
        self.grace = grace
        self.announce_cases = announce_cases
        self.child = child  # run by a parent (attnkit.bench.respawn): it prints the header and footer
        self.fire_at = None if deadline is None else started + deadline + grace  # the watchdog's time
        self.total = 0
        self.lock = threading.RLock()
        self.finished = False
        self.meta.update(status="running", deadline_s=deadline)

    # -- the timeline -------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def deadline_at(self) -> float | None:
        return None if self.deadline is None else self.started + self.deadline

    def say(self, *lines: str) -> None:
        with self.lock:
            say(*lines)

    def header(self) -> None:
        """The run line, printed before anything is measured."""
        if not self.child:
            say(harness.format_header({**self.meta, "machine": None})[0])

    def machine(self, machine: dict) -> None:
        with self.lock:
            self.meta["machine"] = machine
            if not self.child:
                say(harness.format_machine(machine), *harness.format_legend(self.meta))

    def plan(self, cases: Sequence[harness.Case]) -> None:
        """Record what is about to run (the JSON lists it, so a cut-off run says what is missing)."""
        with self.lock:
            self.total = len(cases)
            self.meta["cases_planned"] = [f"{c.label} [{c.mode}]" for c in cases]
            if self.deadline is not None and not self.child:
                say(f"deadline: {self.deadline:.3g} s (no case starts after it; a case still running "
                    f"{self.grace:g} s later is abandoned)")
            self._write()

    def case_started(self, case: harness.Case, index: int) -> None:
        with self.lock:
            self.current = None
            self.running = f"{case.label} [{case.mode}]"
            if self.announce_cases:
                say(f"[{index + 1}/{self.total}] {case.label} [{case.mode}] ... ({self.elapsed():.0f} s)")

    def row_done(self, partial: dict) -> None:
        with self.lock:
            self.current = partial
            self._write()

    def case_done(self, rec: dict) -> None:
        with self.lock:
            self.current = None
            self.records.append(rec)
            say(*harness.format_case(rec, self.meta))
            self._write()

    def add_record(self, rec: dict) -> None:
        """A record measured elsewhere (a child process, which printed it): kept, not printed."""
        with self.lock:
            self.records.append(rec)
            self._write()

    def replace_last(self, rec: dict) -> None:
        with self.lock:
            self.records[-1] = rec
            self._write()

    def postpone(self, seconds: float) -> None:
        """Move the watchdog (and its backstop) later: while a child process runs the cases left,
        the child's own watchdog keeps the deadline."""
        with self.lock:
            if self.fire_at is not None:
                self.fire_at += seconds
                _arm_backstop(self.fire_at - time.perf_counter() + BACKSTOP_S)

    # -- the end ------------------------------------------------------------------------------

    def finish(self, status: str, not_run: Sequence[str] = (), why: str = "") -> None:
        """Final JSON and plot, and the closing lines; once (the watchdog and the main thread may
        both get here)."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
            self.meta["status"] = status
            self.meta["wall_s"] = self.elapsed()
            self.meta["not_run"] = list(not_run)
            if why:
                self.meta["stopped_because"] = why
            lines = []
            if why:
                lines.append(f"\n{why}")
            if not_run:
                lines.append(f"{len(not_run)} case(s) not run: " + ", ".join(not_run))
            records = self.records + ([self.current] if self.current is not None else [])
            json_path = write_json_atomic(self.json_path, self.meta, records)
            if self.child:  # the parent merges this JSON into its own, says why it ended, draws the plot
                return
            try:
                png_path = harness.write_plot(self.png_path, self.meta, records)
            except ImportError as exc:
                png_path = f"not written ({exc}; pip install matplotlib)"
            except Exception as exc:  # noqa: BLE001 - the JSON is what matters
                png_path = f"not written ({harness._first_line(exc)})"
            lines.append(f"\nwrote {json_path}\nwrote {png_path}\n({self.meta['wall_s']:.0f} s)")
            say(*lines)

    def _write(self) -> None:
        records = self.records + ([self.current] if self.current is not None else [])
        write_json_atomic(self.json_path, self.meta, records)

    # -- guards -------------------------------------------------------------------------------

    def _abandon(self) -> None:
        """The watchdog: past deadline + grace with a case still running."""
        running = self.running or "the case that was running"
        planned = self.meta.get("cases_planned", [])
        done = {f"{r['label']} [{r['mode']}]" for r in self.records}
        self.finish("abandoned", [c for c in planned if c not in done],
                    f"deadline {self.deadline:.3g} s + grace {self.grace:g} s passed at {self.elapsed():.0f} s "
                    f"with {running} still running: abandoned (rows measured so far are in the JSON)")
        sys.stdout.flush()
        os._exit(EXIT_ABANDONED)

    @contextlib.contextmanager
    def guard(self):
        """SIGTERM raises KeyboardInterrupt (so the run ends through :meth:`finish`), and with a
        deadline the watchdog thread and faulthandler's backstop are armed."""
        previous = None
        with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
            previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        stop = threading.Event()
        backstop = False
        if self.fire_at is not None:
            def watch():
                # fire_at may move later (postpone), never earlier: wait, look again
                while not stop.wait(max(0.0, self.fire_at - time.perf_counter())):
                    if time.perf_counter() >= self.fire_at:
                        self._abandon()
                        return

            threading.Thread(target=watch, name="attnkit-bench-watchdog", daemon=True).start()
            backstop = _arm_backstop(self.fire_at - time.perf_counter() + BACKSTOP_S)
        try:
            yield self
        finally:
            stop.set()
            if backstop:
                faulthandler.cancel_dump_traceback_later()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _arm_backstop(seconds: float) -> bool:
    """faulthandler's timer: dump every thread's traceback and exit after ``seconds``.  It needs
    a real file descriptor for the dump (pytest's captured stderr has none: then the one the
    process started with, else no backstop)."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.dump_traceback_later(seconds, exit=True, file=stream)
            return True
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            continue
    return False


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")

"""Shared test setup: GPU-marked tests run only where CUDA is present; Triton kernels run in
the interpreter where there is no GPU."""
import os
import sys

# Idle OpenMP threads sleep rather than spin (read when libgomp loads, i.e. at the first torch
# import: here, and in each xdist worker, which inherits the environment).  The suite runs two
# workers of two threads each on two cores, beside CI's nvcc: with spinning waits
# tests/ops/test_sparse_backends.py::test_double_backward_runs_through_the_reference (a
# gradgradcheck of many tiny ops) took 76 s on the loaded 2-core AMD EPYC Zen 3 and 84 s in CI,
# with PASSIVE 2.5 s (session 13); alone on a quiet machine both ~2 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Without a GPU the Triton kernels run under the interpreter on CPU tensors.  The flag is read
# when a kernel is decorated (@triton.jit), i.e. when attnkit.kernels.* is first imported, so it
# is set here, before any test module imports attnkit.
try:
    import torch as _torch_probe

    _HAS_CUDA = _torch_probe.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Issue 26: numerics tests run the first config of each Triton autotune list (compiling every
# candidate left 33 GPU tests unreached in two 200 s runs on an H100); tests marked ``autotune``
# (one per family) autotune, see the fixture below.  Read by attnkit.kernels._flash at import.
os.environ.setdefault("ATTNKIT_TRITON_AUTOTUNE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# The interpreter's bfloat16 tl.dot multiplied the bits as integers (garbage): fixed here, for the
# test session, so that the Triton kernels' bfloat16 paths are checked on CPU too
# (tests/triton_interpreter_bf16.py).
# And its @triton.jit helper calls re-patched triton.language on every call (45% of an interpreted
# sparse kernel's time): skipped where the launch has already patched it
# (tests/triton_interpreter_nested_calls.py).
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter_bf16  # noqa: E402
    import triton_interpreter_nested_calls  # noqa: E402

    triton_interpreter_bf16.install()
    triton_interpreter_nested_calls.install()

# ATTNKIT_INTERPRET_GPU_TESTS=1 (no GPU): the gpu-marked tests are not skipped but run on CPU
# tensors under the interpreter -- a developer's check of the GPU-only cases (bfloat16, larger
# shapes) before a GPU run.  Those that need CUDA itself (the cuda backend) fail; slow.
INTERPRET_GPU_TESTS = os.environ.get("ATTNKIT_INTERPRET_GPU_TESTS") == "1" and not _HAS_CUDA


@pytest.fixture(autouse=True)
def _autotune_where_marked(request):
    """A test marked ``autotune`` runs its Triton launches through the autotuner."""
    if request.node.get_closest_marker("autotune") is None:
        yield
        return
    from attnkit.kernels._flash import autotuning

    with autotuning(True):
        yield


def _compiles_many_configs(item):
    return item.get_closest_marker("autotune") is not None or "every" in item.name


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Issue 26: the tests that compile many Triton configs go first, so that on a GPU run
        # (`pytest -m gpu -n 16`) they start on every worker at once instead of forming the tail.
        items.sort(key=lambda item: not _compiles_many_configs(item))
        return
    if INTERPRET_GPU_TESTS:
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


# ----------------------------------------------------------------------------------------------
# GPU runs: a test that poisons the CUDA context ends its own worker, nobody else's
# ----------------------------------------------------------------------------------------------
# An illegal address (or any other sticky CUDA error) leaves the process's CUDA context unusable:
# every later test in that process would fail with the same error (seen on an H200: one bad
# Triton launch failed ~120 tests after it).  So after each test that touched CUDA we probe the
# context; if it is poisoned, the test is reported as failed with the CUDA error, and the process
# exits at once.  Under pytest-xdist (`pytest -m gpu -n 8`, as .ci/gpu runs it) the controller
# records that test as crashed and starts a fresh worker for the rest.  Without xdist the run
# stops (pytest.exit) with the error, instead of failing everything after it.
CUDA_CRASH_LOG = os.environ.get("ATTNKIT_CUDA_CRASH_LOG")  # optional file: one line per poisoning


def _cuda_context_error():
    """None if the CUDA context still works, else the error text (a sticky error)."""
    if not (_HAS_CUDA and torch.cuda.is_initialized()):
        return None
    try:
        torch.cuda.synchronize()
        probe = torch.ones(1, device="cuda")
        if (probe + 1).item() != 2.0:
            return "the CUDA context computes 1 + 1 != 2"
    except Exception as exc:  # noqa: BLE001 - any failure here means the context is gone
        return f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return None


def _abandon_process(item, error):
    message = f"{item.nodeid}: CUDA context poisoned ({error}); this process cannot run more tests"
    sys.stderr.write("\nattnkit conftest: " + message + "\n")
    sys.stderr.flush()
    if CUDA_CRASH_LOG:
        with open(CUDA_CRASH_LOG, "a") as log:
            log.write(message + "\n")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(70)  # xdist: this test is reported as the worker's crash; a new worker goes on
    pytest.exit(message, returncode=70)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield
    # Probed inside the call phase, so that under xdist the crash belongs to this test.
    error = _cuda_context_error()
    if error is not None:
        _abandon_process(item, error)


# GPU runs write each failure's traceback as it happens (ATTNKIT_FAIL_LOG): a run stopped at its
# deadline never reaches pytest's summary, and a list of FAILED names alone cannot be debugged.
FAIL_LOG = os.environ.get("ATTNKIT_FAIL_LOG")


def _log_failure(report):
    # Written by the controller (it receives every worker's reports, crashes included), once.
    if FAIL_LOG and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        text = report.longreprtext
        if len(text) > 6000:  # keep the assertion and the innermost frames
            text = text[:1500] + "\n[...]\n" + text[-4500:]
        with open(FAIL_LOG, "a") as log:
            log.write(f"===== {report.nodeid} ({report.when})\n{text}\n")


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random inputs in every test."""
    torch.manual_seed(0)


# ----------------------------------------------------------------------------------------------
# Seconds spent per test file (setup + call + teardown, summed over its tests and workers), for
# issue 26's "compile time measured per test file": printed at the end of the run and written to
# $ATTNKIT_FILE_TIMES when set (.ci/gpu does).  Under xdist the controller sees every report.
# ----------------------------------------------------------------------------------------------
_FILE_SECONDS: dict = {}


_FILE_TIMES = os.environ.get("ATTNKIT_FILE_TIMES")


def _file_time_lines():
    rows = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    return [f"{secs:9.1f} s  {path}" for path, secs in rows]


def _count_file_seconds(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + float(getattr(report, "duration", 0.0))
    if _FILE_TIMES and not os.environ.get("PYTEST_XDIST_WORKER"):
        # rewritten after every report: a run stopped at its deadline still leaves the tally
        with open(_FILE_TIMES, "w") as out:
            out.write("\n".join(_file_time_lines()) + "\n")


def pytest_runtest_logreport(report):
    # One hook for both (a second definition of it replaced the first: until session 32 the
    # failure log of the GPU runs was never written).
    _log_failure(report)
    _count_file_seconds(report)


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    lines = _file_time_lines()
    terminalreporter.write_sep("-", "seconds per test file (summed over workers), top 15")
    for line in lines[:15]:
        terminalreporter.write_line(line)

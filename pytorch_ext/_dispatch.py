"""The one place that picks a backend for an op call.

Backends (see DESIGN.md):

========== ======================================================================
reference  pure PyTorch, any device; materializes scores (for checking, not speed)
cpu        C++ kernels in ``attnkit._C`` (CPU tensors)
triton     Triton kernels (CUDA tensors; CPU tensors only with ``TRITON_INTERPRET=1``)
cuda       CUDA C++ kernels in ``attnkit._C`` (CUDA tensors, when built with CUDA)
========== ======================================================================

A family lists the kernel backends it has implemented with :func:`register_kernel` (its op
module does so at import).  Without an explicit ``backend=`` (or ``ATTNKIT_BACKEND``), a CPU
tensor goes to ``cpu`` and a CUDA tensor to ``triton``; when the family has no such kernel
yet, or the backend cannot run here, the default falls back to ``reference``.  A backend asked
for by name is never replaced: if it cannot run, the call raises
:class:`BackendUnavailableError` saying why.
"""
from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch

from ._env import env_reader

# "hopfield_energy" dispatches apart from "hopfield" (the update): it had a C++ kernel first.
FAMILIES = ("softmax", "linear", "sparse", "hopfield", "hopfield_energy")
BACKENDS = ("reference", "cpu", "triton", "cuda")
ENV_VAR = "ATTNKIT_BACKEND"

_IMPLEMENTED: dict[str, set[str]] = {family: {"reference"} for family in FAMILIES}


class BackendUnavailableError(RuntimeError):
    """A backend was asked for that cannot run this call here (the message says why)."""


class BackendStatus(NamedTuple):
    usable: bool
    reason: str  # empty when usable
    kernels: str = ""  # which kernels run there (e.g. the CPU kernels' vector instructions)


# What the CPU kernels' vector path does with each dtype (csrc/cpu/flash_tiles.h), by the ISA
# attnkit._C reports (cpu_kernel_isa(): fixed at build time by -march).
_CPU_ISA_TEXT = {
    "avx512f+avx512bf16": ("float32 FMA tiles on zmm; bfloat16 by AVX512-BF16 dot products or widened to float32 "
                           "(the softmax kernels: chosen at run time, ATTNKIT_CPU_BF16), the rest widened"),
    "avx512f": "float32 FMA tiles on zmm; bfloat16 / float16 widened to float32",
    "avx2+fma": "float32 FMA tiles on ymm; bfloat16 / float16 widened to float32",
    "scalar": "portable loops (the build has neither AVX2+FMA nor AVX-512)",
}


# The families whose CPU kernels choose their tile-GEMM path at run time (issue 25:
# csrc/cpu/gemm_path.h, ATTNKIT_CPU_GEMM=auto|native|brgemm|amx|emulate), and which of their tile
# GEMMs do (the rest stay on the build's kernels, or on torch: Hopfield's backward).
RUNTIME_GEMM_KERNELS = {
    "softmax": "forward, backward and decode tile GEMMs",
    "hopfield": "update forward tile GEMMs (the backward: torch)",
    "hopfield_energy": "energy forward tile GEMMs (the backward: torch)",
    "sparse": "range, block and fused strided tile GEMMs, forward and backward (star: native dots)",
    "linear": "chunk products, forward and backward (those with the running state: float32)",
}
RUNTIME_GEMM_FAMILIES = tuple(RUNTIME_GEMM_KERNELS)
CPU_GEMM_ENV_VAR = "ATTNKIT_CPU_GEMM"
# The `use` of a family's main tile GEMMs where it is not "tiles": the softmax flash tiles take the
# float16 split (gemm_path.h, GemmUse::kSoftmax).
_MAIN_GEMM_USE = {"softmax": "softmax"}
# Kernels whose tile-GEMM path under ATTNKIT_CPU_GEMM=auto is their own (csrc/cpu/gemm_path.h,
# GemmUse: native where brgemm measured slower on a Xeon with AMX), as cpu_gemm_path's `use` and
# the label the report gives them.
_OWN_GEMM_USE = {"softmax": ("decode", "decoding (N <= 16)"),
                 "sparse": ("ranges", "range and fused strided kernels"),
                 "linear": ("linear", "under auto")}


_BF16_PRODUCTS_TEXT = {"dot": "AVX512-BF16 dot products", "float32": "widened to float32"}


def _gemm_paths(module, use: str) -> str:
    """"bfloat16 <path>, float16 <path>, float32 <path>" for the tile GEMMs of ``use``; the softmax
    kernels' native bfloat16 says how it is multiplied (ATTNKIT_CPU_BF16: csrc/cpu/gemm_path.h)."""
    parts = []
    for dtype in ("bfloat16", "float16", "float32"):
        path = module.cpu_gemm_path(dtype, use)
        if dtype == "bfloat16" and path == "native" and use in ("softmax", "decode") and hasattr(
                module, "cpu_bf16_products"):
            how = _BF16_PRODUCTS_TEXT.get(module.cpu_bf16_products(use))
            path += f" ({how})" if how else ""
        parts.append(f"{dtype} {path}")
    return ", ".join(parts)


def cpu_kernels(family: str | None = None) -> str:
    """The CPU kernels' path on this build: ``"<isa>: <what it does>"`` ("" without attnkit._C,
    or "unknown" for an extension built before cpu_kernel_isa existed).  For a family in
    :data:`RUNTIME_GEMM_FAMILIES`, also the tile-GEMM path its kernels take per dtype in this
    process (``native``, or oneDNN's ``brgemm``: AMX where the CPU has it), chosen at run time."""
    if _native_import_error():
        return ""
    module = native()
    if not hasattr(module, "cpu_kernel_isa"):
        return "unknown"
    isa = module.cpu_kernel_isa()
    text = _CPU_ISA_TEXT.get(isa, "")
    base = f"{isa}: {text}" if text else isa
    if family not in RUNTIME_GEMM_FAMILIES or not hasattr(module, "cpu_gemm_path"):
        return base + "; chosen at build time (-march), no AMX"
    try:
        use = _MAIN_GEMM_USE.get(family, "tiles")
        paths = _gemm_paths(module, use)
    except RuntimeError as exc:  # a bad ATTNKIT_CPU_GEMM / _BF16: every forward call raises the same
        paths = str(exc).splitlines()[0]
    setting = os.environ.get(CPU_GEMM_ENV_VAR) or "auto"
    text = (f"{base}; chosen at build time (-march); {RUNTIME_GEMM_KERNELS[family]} chosen at run "
            f"time per dtype ({CPU_GEMM_ENV_VAR}={setting}): {paths}")
    if family in _OWN_GEMM_USE:
        # A kernel's own choice (auto: native on every CPU; gemm_path.h), where it differs.
        use, label = _OWN_GEMM_USE[family]
        try:
            own = _gemm_paths(module, use)
        except (RuntimeError, TypeError):  # a bad setting (above), or an extension without `use`
            own = paths
        if own != paths:
            if setting == "auto":  # cpu_decode_path (gemm_path.h): the tiles from 4 rows per kv head
                own = own.replace("own AMX tiles", "own AMX tiles (from 4 query rows per kv head; native below)")
            text += f"; {label}: {own}"
    return text



def register_kernel(family: str, backend: str) -> None:
    """Declare that ``family`` has kernels for ``backend`` (called by ops/<family>.py)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _IMPLEMENTED[family].add(backend)


def implemented(family: str) -> tuple[str, ...]:
    """The backends ``family`` has an implementation for, in BACKENDS order."""
    return tuple(b for b in BACKENDS if b in _IMPLEMENTED[family])


# Import probes run once per process; plain dicts rather than functools.lru_cache, which
# torch.compile warns about when it traces through resolve().
_PROBES: dict[str, str] = {}


def _native_import_error() -> str:
    """'' when attnkit._C imports, else why not."""
    if "native" not in _PROBES:
        try:
            from . import _C  # noqa: F401

            _PROBES["native"] = ""
        except ImportError as exc:  # not built (no compiler at install time) or broken
            _PROBES["native"] = f"attnkit._C is not built or failed to load ({exc})"
    return _PROBES["native"]


def native():
    """The compiled extension module ``attnkit._C`` (raises BackendUnavailableError if absent)."""
    reason = _native_import_error()
    if reason:
        raise BackendUnavailableError(reason)
    from . import _C

    return _C


def native_ops_declared(*names: str) -> bool:
    """Whether attnkit._C loads and declares every ``torch.ops.attnkit.<name>``.

    False when the extension is missing, or was built from older sources without these ops;
    the op modules then register no fake/autograd for them and route to the reference.
    """
    if _native_import_error():
        return False
    from . import _C  # noqa: F401  (importing it runs its TORCH_LIBRARY registrations)

    try:
        for name in names:
            getattr(torch.ops.attnkit, name).default
    except (AttributeError, RuntimeError):
        return False
    return True


def _triton_import_error() -> str:
    if "triton" not in _PROBES:
        missing = importlib.util.find_spec("triton") is None
        _PROBES["triton"] = "triton is not installed (pip install triton)" if missing else ""
    return _PROBES["triton"]


_TRITON_INTERPRET = env_reader("TRITON_INTERPRET")


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return _TRITON_INTERPRET() == "1"


def _kernels_text(backend: str, family: str | None = None) -> str:
    if backend == "cpu":
        return cpu_kernels(family)
    if backend == "triton":
        where = "the Triton interpreter (CPU tensors)" if triton_interpreted() else "CUDA tensors"
        return f"Triton kernels on {where}"
    if backend == "cuda":
        return "CUDA C++ kernels (mma.sync, sm_80 instruction set)"
    return ""


def backend_status(backend: str) -> BackendStatus:
    """Whether ``backend`` can run on this machine at all, and why not."""
    if backend == "reference":
        return BackendStatus(True, "")
    if backend == "cpu":
        reason = _native_import_error()
        return BackendStatus(not reason, reason)
    if backend == "triton":
        reason = _triton_import_error()
        if not reason and not torch.cuda.is_available() and not triton_interpreted():
            reason = "no CUDA device (set TRITON_INTERPRET=1 to run Triton kernels on CPU tensors)"
        return BackendStatus(not reason, reason)
    if backend == "cuda":
        if not torch.cuda.is_available():
            return BackendStatus(False, "no CUDA device (or torch was built without CUDA)")
        reason = _native_import_error()
        if not reason and not native().built_with_cuda():
            reason = "attnkit._C was built without CUDA (reinstall with nvcc present, ATTNKIT_BUILD_CUDA=1)"
        return BackendStatus(not reason, reason)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def backends() -> dict[str, dict[str, BackendStatus]]:
    """Which backends are usable here, per family, and why not where not.

    Returns ``{family: {backend: BackendStatus(usable, reason)}}`` for every family in
    :data:`FAMILIES` and backend in :data:`BACKENDS`.

    Example::

        >>> attnkit.backends()["softmax"]["reference"]
        BackendStatus(usable=True, reason='', kernels='')
        >>> attnkit.backends()["linear"]["cpu"].kernels  # on an AVX2-only build: no AMX, auto is native
        'avx2+fma: float32 FMA tiles on ymm; bfloat16 / float16 widened to float32; chosen at build time (-march); chunk products, forward and backward (those with the running state: float32) chosen at run time per dtype (ATTNKIT_CPU_GEMM=auto): bfloat16 native, float16 native, float32 native'
        >>> attnkit.backends()["softmax"]["cpu"].kernels  # the same build
        'avx2+fma: ...; chosen at build time (-march); forward, backward and decode tile GEMMs chosen at run time per dtype (ATTNKIT_CPU_GEMM=auto): bfloat16 native, float16 native, float32 native; score options: ...'
    """
    # .kernels is filled here, for the report only: backend_status() runs in every op's dispatch
    # (also under torch.compile, which cannot trace a call into attnkit._C).
    machine = {backend: backend_status(backend) for backend in BACKENDS}
    machine = {backend: status._replace(kernels=_kernels_text(backend)) if status.usable else status
               for backend, status in machine.items()}
    table: dict[str, dict[str, BackendStatus]] = {}
    for family in FAMILIES:
        row = {}
        for backend in BACKENDS:
            if backend not in _IMPLEMENTED[family]:
                row[backend] = BackendStatus(False, f"{family} has no {backend} kernels yet")
            else:
                row[backend] = machine[backend]
                if backend == "cpu" and family in RUNTIME_GEMM_FAMILIES and row[backend].usable:
                    row[backend] = row[backend]._replace(kernels=_kernels_text(backend, family))
                if family == "softmax" and row[backend].usable:
                    row[backend] = row[backend]._replace(kernels=_with_score_options(row[backend].kernels, backend))
        table[family] = row
    return table


def _with_score_options(text: str, backend: str) -> str:
    """softmax's row: which score options (issue 28) the backend's kernels compute; a call
    with another one goes to another backend when none is named, and raises when this one is."""
    from .score_options import BACKEND_OPTIONS, NAMES

    here = [name for name in NAMES if name in BACKEND_OPTIONS.get(backend, ())]
    missing = [name for name in NAMES if name not in here]
    note = f"score options: {', '.join(here) or 'none'}"
    if missing:
        note += f" ({', '.join(missing)}: routed to another backend, or an error when this one is named)"
    return f"{text}; {note}" if text else note


def _device_problem(backend: str, device: torch.device) -> str:
    """'' when ``backend`` can take tensors on ``device``, else why not."""
    if backend == "reference":
        return ""
    if backend == "cpu" and device.type != "cpu":
        return f"the cpu backend takes CPU tensors; got tensors on {device}"
    if backend == "cuda" and device.type != "cuda":
        return f"the cuda backend takes CUDA tensors; got tensors on {device}"
    if backend == "triton":
        if device.type == "cpu" and not triton_interpreted():
            return "the triton backend takes CUDA tensors (CPU tensors only with TRITON_INTERPRET=1)"
        if device.type not in ("cpu", "cuda"):
            return f"the triton backend takes CUDA tensors; got tensors on {device}"
    return ""


# Read on every call (attnkit._env: a dict lookup, not os.environ.get's 1.1 us when unset).
_BACKEND_ENV = env_reader(ENV_VAR)


def env_backend() -> str | None:
    """The backend named by ATTNKIT_BACKEND, or None when it is unset or empty."""
    return _BACKEND_ENV() or None


def native_cpu(family: str, backend: str | None) -> bool:
    """Whether ``resolve(family, backend, <a CPU device>, ...)`` returns ``"cpu"`` (without
    raising), in one cheap test for the public functions' per-call fast paths (issue 25).
    A str subclass naming a backend gets False: resolve decides."""
    if backend is None:
        backend = _BACKEND_ENV() or None
    if backend is not None and (backend.__class__ is not str or backend != "cpu"):
        return False
    return "cpu" in _IMPLEMENTED[family] and not _native_import_error()


def resolve(family: str, backend: str | None, device: torch.device, op: str) -> str:
    """Pick the backend for one call of ``op`` (a public function name) on ``device``.

    ``backend`` (or the environment variable ``ATTNKIT_BACKEND`` when it is None) names one
    explicitly; None lets the device decide.  Raises ValueError for an unknown name and
    BackendUnavailableError for a backend that cannot run this call here.
    """
    requested = backend if backend is not None else env_backend()
    if requested is None:
        kind = device.type
        if kind == "cpu":
            # backend_status("cpu") and _device_problem("cpu", a CPU device) below, spelled out:
            # this is every default call on CPU tensors (6 us -> 1 us a call).
            return "cpu" if "cpu" in _IMPLEMENTED[family] and not _native_import_error() else "reference"
        if kind == "cuda":
            # backend_status("triton") and _device_problem("triton", a CUDA device), spelled out:
            # a CUDA tensor means CUDA is available, so only Triton's import is in question.
            return "triton" if "triton" in _IMPLEMENTED[family] and not _triton_import_error() else "reference"
        return "reference"
    if not isinstance(requested, str) or requested not in BACKENDS:
        source = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{op}: unknown {source} {requested!r}; expected one of {', '.join(BACKENDS)}")
    if requested not in _IMPLEMENTED[family]:
        raise BackendUnavailableError(
            f"{op}: the {requested} backend has no {family} kernels yet; "
            f"implemented: {', '.join(implemented(family))}"
        )
    status = backend_status(requested)
    if not status.usable:
        raise BackendUnavailableError(f"{op}: backend {requested!r} cannot run here: {status.reason}")
    problem = _device_problem(requested, device)
    if problem:
        raise BackendUnavailableError(f"{op}: {problem}")
    return requested

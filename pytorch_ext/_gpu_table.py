"""The measured choice between attnkit's two GPU kernel backends (issues 26 and 27).

Without a backend named, a CUDA tensor goes to ``triton``.  Where a GPU bench measured the
``cuda`` (CUDA C++) kernels faster on a shape, :func:`prefers_cuda` says so, and the op
(``softmax_attention``, ``linear_attention``) takes ``cuda`` there instead, when that backend
can run the call (the op's routing rules decide, as for a named backend).  The measurements are :data:`attnkit._gpu_table_data.ENTRIES`, written by
``python bench/gpu_dispatch_table.py BENCH_JSON...`` from the JSON of
``python -m attnkit bench --device cuda`` (both backends timed on the same inputs in the same
run); nothing is hand-written there.  ``ATTNKIT_GPU_TABLE=0`` turns the table off (every CUDA
tensor to ``triton``).

One entry per measured case: ``family`` ("softmax" or "linear"), ``capability`` ("9.0": the device's compute
capability), ``dtype`` ("bfloat16"), ``head_dim``, ``causal``, ``mode`` ("fwd": a call whose inputs
need no gradient; "fwd+bwd": one that will be differentiated), ``n`` (the sequence length,
N = M), ``backend`` (the faster), ``ms`` ({backend: median ms}), ``cuda_env`` (the value of
``ATTNKIT_CUDA_SM90`` during the measurement: the CUDA C++ kernels differ with it, so an entry
applies only under the same value), and ``source`` (the bench run: date, commit, device).

A call's entry: the same family, capability, dtype, head dim, causal flag, mode and
``ATTNKIT_CUDA_SM90``, and the measured ``n`` nearest to the call's N on a log scale, if within a
factor of :data:`N_REACH` of it; otherwise no entry (``triton``).  The table is indexed once; an
empty table costs a call's routing one check (the table ships empty until a GPU bench fills it).
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

import torch

from ._dispatch import ENV_VAR as BACKEND_ENV_VAR

ENV_VAR = "ATTNKIT_GPU_TABLE"
SM90_ENV = "ATTNKIT_CUDA_SM90"
# A measured N stands for calls with N within this factor of it (attention's time per FLOP
# changes slowly with N between 1k and 16k; outside the measured range nothing is claimed).
N_REACH = 4.0
BACKENDS = ("triton", "cuda")
# A timed row counts only if its output agreed with the bench's baseline (torch SDPA) to this
# relative difference (the bench's max_rel_diff; 16-bit outputs differ by ~1e-2 at most).
MAX_REL_DIFF = 5e-2


def index_of(entries: list[dict]) -> dict:
    """{(family, capability, dtype, head_dim, causal, mode, cuda_env): [(log n, backend)]}."""
    index: dict = {}
    for e in entries:
        key = (e["family"], e["capability"], e["dtype"], int(e["head_dim"]), bool(e["causal"]), e["mode"],
               e.get("cuda_env", ""))
        index.setdefault(key, []).append((math.log(e["n"]), e["backend"]))
    return index


_INDEX: dict | None = None  # index_of(ENTRIES), built at the first lookup


def _index() -> dict:
    global _INDEX
    if _INDEX is None:
        from ._gpu_table_data import ENTRIES

        _INDEX = index_of(ENTRIES)
    return _INDEX


@lru_cache(maxsize=64)
def _capability(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}.{minor}"


def has_entries() -> bool:
    """Whether any measurement is in the table (an empty one routes nothing: skip the lookup)."""
    return bool(_index())


def prefers_cuda(family: str, backend: str | None, chosen: str, device: torch.device, dtype: torch.dtype,
                 head_dim: int, causal: bool, n: int, inputs) -> bool:
    """Whether a call that the default routing sent to ``triton`` (``chosen``; no backend named,
    no ATTNKIT_BACKEND) should take ``cuda``, as the table measured for its shape.  ``inputs``:
    the tensors whose ``requires_grad`` makes the call a training one.  The op then checks that
    ``cuda`` can run the call."""
    if chosen != "triton" or backend is not None or device.type != "cuda" or not has_entries():
        return False
    if os.environ.get(BACKEND_ENV_VAR):
        return False
    training = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return pick(family, device, dtype, head_dim, causal, n, training) == "cuda"


def pick(family: str, device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool, n: int,
         training: bool) -> str | None:
    """The backend measured faster for this call's shape on this kind of device ("triton" or
    "cuda"), or None where nothing near it was measured (or the table is off)."""
    if os.environ.get(ENV_VAR) == "0" or device.type != "cuda" or n <= 0:
        return None
    index = _index()
    if not index:
        return None
    key = (family, _capability(device.index if device.index is not None else torch.cuda.current_device()),
           str(dtype).replace("torch.", ""), int(head_dim), bool(causal), "fwd+bwd" if training else "fwd",
           os.environ.get(SM90_ENV, ""))
    measured = index.get(key)
    if not measured:
        return None
    log_n = math.log(n)
    distance, backend = min((abs(m - log_n), b) for m, b in measured)
    return backend if distance <= math.log(N_REACH) + 1e-9 else None  # (exactly N_REACH away: in reach)


# The families routed by the table (their public functions consult pick()).  Linear: its feature
# map is not in the key (an elementwise map, the same cost in both backends' kernels).
FAMILIES = ("softmax", "linear")


def entries_from_bench(records: list[dict], meta: dict) -> list[dict]:
    """Table entries from a GPU bench JSON's ``cases`` and ``meta``: for each unmasked case of
    FAMILIES with N = M and Dv = D in which both ``attnkit[triton]`` and ``attnkit[cuda]`` ran
    ("ok", a median time, an output within MAX_REL_DIFF of the baseline's), the faster of the
    two.  Cases where either did not run are left out (no claim)."""
    capability = meta.get("capability")
    if not capability:
        raise ValueError("the bench JSON's meta has no device capability (meta.capability); "
                         "rerun the bench with this attnkit")
    source = f"{meta.get('date', '?')} {meta.get('git_commit', '?')} {meta.get('device_name', '?')}"
    out = []
    for rec in records:
        if rec.get("family") not in FAMILIES:
            continue
        p = rec.get("params", {})
        if p.get("M", p.get("N")) != p.get("N") or p.get("Dv", p.get("D")) != p.get("D") or "mask" in p:
            continue
        ms = {}
        for row in rec.get("results", []):
            backend = row.get("backend")
            diff = row.get("max_rel_diff")
            if row.get("kind") == "attnkit" and backend in BACKENDS and row.get("status") == "ok" \
                    and row.get("median_s") and diff is not None and diff <= MAX_REL_DIFF:
                ms[backend] = row["median_s"] * 1e3
        if len(ms) < len(BACKENDS):
            continue
        out.append({
            "family": rec["family"], "capability": capability, "dtype": p["dtype"], "head_dim": int(p["D"]),
            "causal": bool(p.get("causal", False)), "mode": rec["mode"], "n": int(p["N"]),
            "backend": min(ms, key=ms.get), "ms": {b: round(t, 4) for b, t in ms.items()},
            "cuda_env": (meta.get("env") or {}).get(SM90_ENV, ""), "source": source,
        })
    return out

"""attnkit/_gpu_table.py: the measured choice between the triton and cuda kernels on a GPU
(issues 26, 27), and bench/gpu_dispatch_table.py, which writes it from GPU bench JSONs.

On the CPU: entries from a bench JSON (the faster backend, only where both ran and agreed with
the baseline), the lookup (the nearest measured N within reach, the mode, the
ATTNKIT_CUDA_SM90 value, the switch off), the script's merge.  On a GPU: softmax_attention
takes the cuda kernels where a (made-up) entry says so, and triton where they cannot run the
call (a mask) or nothing was measured.
"""
import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import _gpu_table as gpu_table

ROOT = Path(__file__).resolve().parents[1]


def _row(backend, ms, status="ok", diff=1e-3):
    return {"impl": f"attnkit[{backend}]", "kind": "attnkit", "backend": backend, "status": status,
            "median_s": None if ms is None else ms / 1e3, "max_rel_diff": diff}


def _case(n, d=128, causal=False, mode="fwd", rows=(), m=None, family="softmax", **extra):
    params = {"B": 4, "H": 8, "N": n, "M": n if m is None else m, "D": d, "dtype": "bfloat16", "causal": causal,
              **extra}
    sdpa = {"impl": "torch SDPA", "kind": "peer", "backend": None, "status": "ok", "median_s": 1e-3}
    return {"family": family, "mode": mode, "params": params, "results": [sdpa, *rows]}


META = {"capability": "9.0", "date": "2026-11-29", "git_commit": "abc1234", "device_name": "NVIDIA H200",
        "env": {"ATTNKIT_CUDA_SM90": "1"}}


def test_entries_take_the_faster_backend_where_both_ran():
    cases = [
        _case(8192, rows=[_row("triton", 2.0), _row("cuda", 1.5)]),                # cuda faster
        _case(8192, causal=True, rows=[_row("triton", 1.0), _row("cuda", 1.2)]),   # triton faster
        _case(4096, mode="fwd+bwd", rows=[_row("triton", 5.0), _row("cuda", 4.0)]),
        _case(1024, rows=[_row("triton", 1.0), _row("cuda", None, status="error")]),  # cuda failed
        _case(2048, rows=[_row("triton", 1.0), _row("cuda", 0.5, diff=0.5)]),      # cuda wrong
        _case(2048, rows=[_row("triton", 1.0), _row("cuda", 0.5, diff=None)]),     # not compared
        _case(2048, m=4096, rows=[_row("triton", 1.0), _row("cuda", 0.5)]),        # N != M
        _case(2048, mask="random", rows=[_row("triton", 1.0), _row("cuda", 0.5)]),  # masked
        _case(2048, rows=[_row("triton", 1.0)]),                                   # cuda not run
        # linear (its bench's cases have no M; D = Dv): routed too
        _case(16384, d=64, causal=True, family="linear", Dv=64, feature_map="elu",
              rows=[_row("triton", 0.6), _row("cuda", 0.5)]),
        _case(4096, d=64, causal=True, family="linear", Dv=32, rows=[_row("triton", 0.6), _row("cuda", 0.5)]),
        _case(4096, family="sparse", rows=[_row("triton", 0.6), _row("cuda", 0.5)]),  # not a routed family
    ]
    del cases[-3]["params"]["M"]
    entries = gpu_table.entries_from_bench(cases, META)
    got = [(e["family"], e["n"], e["causal"], e["mode"], e["backend"]) for e in entries]
    assert got == [("softmax", 8192, False, "fwd", "cuda"), ("softmax", 8192, True, "fwd", "triton"),
                   ("softmax", 4096, False, "fwd+bwd", "cuda"), ("linear", 16384, True, "fwd", "cuda")]
    first = entries[0]
    assert first["ms"] == {"triton": 2.0, "cuda": 1.5} and first["cuda_env"] == "1"
    assert first["capability"] == "9.0" and first["dtype"] == "bfloat16" and first["head_dim"] == 128
    assert "abc1234" in first["source"] and "H200" in first["source"]
    with pytest.raises(ValueError, match="no device capability"):
        gpu_table.entries_from_bench(cases, {"date": "x"})


def _entry(n, backend, mode="fwd", causal=False, d=128, env="1", capability="9.0"):
    return {"family": "softmax", "capability": capability, "dtype": "bfloat16", "head_dim": d, "causal": causal,
            "mode": mode, "n": n, "backend": backend, "cuda_env": env}


@pytest.fixture
def table(monkeypatch):
    """A made-up table on a made-up compute capability 9.0 device, ATTNKIT_CUDA_SM90=1."""
    entries = [_entry(1024, "triton"), _entry(8192, "cuda"), _entry(8192, "triton", mode="fwd+bwd"),
               _entry(4096, "cuda", causal=True), _entry(4096, "cuda", env="")]
    monkeypatch.setattr(gpu_table, "_INDEX", gpu_table.index_of(entries))
    monkeypatch.setattr(gpu_table, "_capability", lambda index: "9.0")
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", "1")
    monkeypatch.delenv("ATTNKIT_GPU_TABLE", raising=False)
    return entries


GPU = torch.device("cuda", 0)  # a device object only: pick() asks nothing of the GPU here


def pick(n, causal=False, training=False, d=128, dtype=torch.bfloat16, device=GPU, family="softmax"):
    return gpu_table.pick(family, device, dtype, d, causal, n, training)


def test_pick_takes_the_nearest_measured_n_within_reach(table):
    assert pick(8192) == "cuda" and pick(16384) == "cuda" and pick(32768) == "cuda"
    assert pick(1024) == "triton" and pick(2048) == "triton"   # log-nearest: 2048 is nearer 1024 than 8192
    assert pick(2800) == "triton" and pick(3000) == "cuda"     # the log midpoint of 1024 and 8192 is 2896
    assert pick(256) == "triton" and pick(255) is None         # N_REACH = 4: 1024 / 4 = 256
    assert pick(32769) is None


def test_pick_matches_mode_causal_dims_and_the_sm90_switch(table, monkeypatch):
    assert pick(8192, training=True) == "triton"       # the fwd+bwd entry
    assert pick(4096, causal=True) == "cuda" and pick(4096, causal=True, training=True) is None
    assert pick(8192, d=64) is None and pick(8192, dtype=torch.float16) is None
    assert pick(8192, device=torch.device("cpu")) is None and pick(8192, family="linear") is None
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", "pingpong")  # other CUDA C++ kernels than measured
    assert pick(8192) is None
    monkeypatch.delenv("ATTNKIT_CUDA_SM90")
    assert pick(4096) == "cuda"                         # the entry measured without the switch
    monkeypatch.setenv("ATTNKIT_GPU_TABLE", "0")
    assert pick(4096) is None


def test_prefers_cuda_only_for_default_triton_calls(table, monkeypatch):
    x = torch.zeros(1)
    grad = torch.zeros(1, requires_grad=True)

    def prefers(backend=None, chosen="triton", n=8192, inputs=(x,)):
        return gpu_table.prefers_cuda("softmax", backend, chosen, GPU, torch.bfloat16, 128, False, n, inputs)

    assert prefers() and not prefers(n=1024)
    assert not prefers(backend="triton") and not prefers(chosen="reference")
    assert not prefers(inputs=(x, grad))  # a training call: the fwd+bwd entry says triton
    with torch.no_grad():
        assert prefers(inputs=(x, grad))
    monkeypatch.setenv("ATTNKIT_BACKEND", "triton")
    assert not prefers()
    monkeypatch.delenv("ATTNKIT_BACKEND")
    monkeypatch.setattr(gpu_table, "_INDEX", {})
    assert not gpu_table.has_entries() and not prefers()


def test_the_shipped_table_is_well_formed():
    from attnkit._gpu_table_data import ENTRIES

    for e in ENTRIES:
        assert e["backend"] in gpu_table.BACKENDS and e["mode"] in ("fwd", "fwd+bwd") and e["n"] > 0
        assert set(e["ms"]) == set(gpu_table.BACKENDS) and e["backend"] == min(e["ms"], key=e["ms"].get)
    gpu_table.index_of(ENTRIES)


def test_the_script_writes_and_merges_the_table(tmp_path):
    bench = tmp_path / "bench-cuda.json"
    cases = [_case(8192, rows=[_row("triton", 2.0), _row("cuda", 1.5)]),
             _case(4096, rows=[_row("triton", 1.0), _row("cuda", 1.5)])]
    bench.write_text(json.dumps({"meta": META, "cases": cases}))
    out = tmp_path / "table.py"
    script = ROOT / "bench" / "gpu_dispatch_table.py"
    run = lambda: subprocess.run([sys.executable, str(script), str(bench), "--out", str(out)], check=True,
                                 capture_output=True, text=True)
    printed = run().stdout
    assert "N8192 SM90=1: triton 2.000 ms, cuda 1.500 ms -> cuda" in printed
    first = runpy.run_path(str(out))["ENTRIES"]
    assert [(e["n"], e["backend"]) for e in first] == [(4096, "triton"), (8192, "cuda")]
    # A second run on another measurement of N = 8192 replaces that entry and keeps the other.
    cases[0] = _case(8192, rows=[_row("triton", 1.0), _row("cuda", 1.5)])
    bench.write_text(json.dumps({"meta": META, "cases": cases[:1]}))
    run()
    second = runpy.run_path(str(out))["ENTRIES"]
    assert sorted((e["n"], e["backend"]) for e in second) == [(4096, "triton"), (8192, "triton")]
    assert math.isclose(next(e for e in second if e["n"] == 8192)["ms"]["triton"], 1.0)


def _record_backends(monkeypatch, ops_module):
    """The backends an op module's calls run, in order (its _IMPLEMENTATIONS wrapped)."""
    taken = []
    for name in ("triton", "cuda"):
        real = ops_module._IMPLEMENTATIONS[name]
        monkeypatch.setitem(ops_module._IMPLEMENTATIONS, name,
                            lambda *a, _real=real, _name=name, **k: taken.append(_name) or _real(*a, **k))
    return taken


@pytest.mark.gpu
def test_softmax_routes_by_the_table(table, monkeypatch):
    from attnkit.ops import softmax as softmax_ops

    if not attnkit.backends()["softmax"]["cuda"].usable:
        pytest.skip("attnkit._C has no CUDA kernels here")
    monkeypatch.setattr(gpu_table, "_capability", lambda index: "9.0")
    taken = _record_backends(monkeypatch, softmax_ops)
    q = torch.randn(1, 2, 8192, 128, device="cuda", dtype=torch.bfloat16)
    attnkit.softmax_attention(q, q, q)
    attnkit.softmax_attention(q[:, :, :1024], q[:, :, :1024], q[:, :, :1024])
    assert taken == ["cuda", "triton"]
    attnkit.softmax_attention(q, q, q, dropout_p=0.1)  # the cuda kernels have no dropout: triton
    assert taken[-1] == "triton"
    monkeypatch.setenv("ATTNKIT_GPU_TABLE", "0")
    attnkit.softmax_attention(q, q, q)
    assert taken[-1] == "triton"


@pytest.mark.gpu
def test_linear_routes_by_the_table(monkeypatch):
    from attnkit.ops import linear as linear_ops

    if not attnkit.backends()["linear"]["cuda"].usable:
        pytest.skip("attnkit._C has no CUDA kernels here")
    entries = [_entry(4096, "cuda", causal=True, d=64, env="")]
    entries[0]["family"] = "linear"
    monkeypatch.setattr(gpu_table, "_INDEX", gpu_table.index_of(entries))
    monkeypatch.setattr(gpu_table, "_capability", lambda index: "9.0")
    monkeypatch.delenv("ATTNKIT_CUDA_SM90", raising=False)
    monkeypatch.delenv("ATTNKIT_GPU_TABLE", raising=False)
    taken = _record_backends(monkeypatch, linear_ops)
    q = torch.randn(1, 2, 4096, 64, device="cuda", dtype=torch.bfloat16)
    attnkit.linear_attention(q, q, q, causal=True)
    attnkit.linear_attention(q, q, q, causal=False)  # not measured: triton
    attnkit.linear_attention(q, q, q[..., :32], causal=True)  # Dv != D: triton
    assert taken == ["cuda", "triton", "triton"]

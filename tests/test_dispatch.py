"""Backend selection (pytorch_ext/_dispatch.py) and attnkit.backends()."""
import pytest
import torch

import attnkit
from attnkit import _dispatch
from attnkit._dispatch import BACKENDS, FAMILIES, BackendUnavailableError, resolve

CPU = torch.device("cpu")


def test_backends_table_covers_every_family_and_backend():
    table = attnkit.backends()
    assert set(table) == set(FAMILIES)
    for family, row in table.items():
        assert set(row) == set(BACKENDS)
        assert row["reference"].usable and row["reference"].reason == ""
        for backend, status in row.items():
            # An unusable backend always says why.
            assert status.usable or status.reason, (family, backend)


def test_native_extension_is_built_and_reported():
    # The extension is part of every supported install (CI builds with a compiler); a missing
    # one must show up here rather than as silently skipped kernel tests.
    status = _dispatch.backend_status("cpu")
    assert status.usable and status.reason == "", status
    assert attnkit.backends()["hopfield_energy"]["cpu"].usable


def test_cpu_backend_reports_the_vector_path_its_kernels_were_built_for():
    # Issue 25: attnkit.backends() says which kernels each family's cpu backend runs.  The path
    # is one the extension knows, and this CPU has its instructions (the build ran here).
    from attnkit._cpuinfo import cpu_info

    isa = _dispatch.native().cpu_kernel_isa()
    assert isa in _dispatch._CPU_ISA_TEXT, isa
    base = f"{isa}: {_dispatch._CPU_ISA_TEXT[isa]}; chosen at build time (-march)"
    flags = set(cpu_info()["isa"])  # display names: "AVX2", "AVX-512F", ...
    if flags:  # /proc/cpuinfo read
        needed = {"avx512f+avx512bf16": {"AVX-512F", "AVX-512 BF16"}, "avx512f": {"AVX-512F"},
                  "avx2+fma": {"AVX2", "FMA"}, "scalar": set()}[isa]
        assert needed <= flags, (isa, sorted(flags))
    # Every family's row: the build's path, then (the families whose tile GEMMs choose at run
    # time, issue 25: all of them now) which GEMMs choose and the path of each dtype here.
    for family, row in attnkit.backends().items():
        if not row["cpu"].usable:
            continue
        kernels = row["cpu"].kernels
        assert kernels.startswith(base), (family, kernels)
        if family in _dispatch.RUNTIME_GEMM_FAMILIES:
            assert f"; {_dispatch.RUNTIME_GEMM_KERNELS[family]} chosen at run time per dtype" in kernels, kernels
            for dtype in ("bfloat16", "float16", "float32"):
                assert f"{dtype} {_dispatch.native().cpu_gemm_path(dtype)}" in kernels, (family, kernels)
        else:
            assert kernels == base + ", no AMX", (family, kernels)


def test_softmax_row_says_which_score_options_each_backend_computes():
    from attnkit.score_options import BACKEND_OPTIONS

    row = attnkit.backends()["softmax"]
    assert row["reference"].kernels == "score options: window, softcap, alibi_slopes, sinks"
    for backend, status in row.items():
        if status.usable:
            named = status.kernels.split("score options: ")[1]
            for option in BACKEND_OPTIONS[backend]:
                assert option in named.split(" (")[0], (backend, status.kernels)
    if row["cuda"].usable:
        assert "window, softcap, alibi_slopes: routed to another backend" in row["cuda"].kernels


def test_default_falls_back_to_reference_until_a_family_has_kernels(monkeypatch):
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", {"reference"})
    assert resolve("linear", None, CPU, "op") == "reference"
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", {"reference", "cpu"})
    assert resolve("linear", None, CPU, "op") == "cpu"


def test_default_on_meta_device_is_reference(monkeypatch):
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    assert resolve("softmax", None, torch.device("meta"), "op") == "reference"


def test_default_on_cuda_tensors_is_triton_where_it_imports(monkeypatch):
    # A CUDA tensor means CUDA is there: only Triton's import decides (the per-call fast path).
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    cuda = torch.device("cuda")
    monkeypatch.setitem(_dispatch._PROBES, "triton", "")
    assert resolve("softmax", None, cuda, "op") == "triton"
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", {"reference", "cpu"})
    assert resolve("linear", None, cuda, "op") == "reference"
    monkeypatch.setitem(_dispatch._PROBES, "triton", "triton is not installed (pip install triton)")
    assert resolve("softmax", None, cuda, "op") == "reference"


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match=r"op: unknown backend 'fast'; expected one of reference"):
        resolve("softmax", "fast", CPU, "op")


def test_environment_variable_overrides_the_default(monkeypatch):
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", {"reference", "cpu"})
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    assert resolve("linear", None, CPU, "op") == "reference"
    # An explicit argument beats the environment.
    assert resolve("linear", "cpu", CPU, "op") == "cpu"
    monkeypatch.setenv("ATTNKIT_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown ATTNKIT_BACKEND 'bogus'"):
        resolve("linear", None, CPU, "op")


def test_backend_without_kernels_for_the_family_says_so(monkeypatch):
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", {"reference"})
    with pytest.raises(BackendUnavailableError, match="no linear kernels yet; implemented: reference"):
        resolve("linear", "cpu", CPU, "attnkit.linear_attention")


def test_backend_on_the_wrong_device_says_why(monkeypatch):
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", set(BACKENDS))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="cuda"):
        resolve("linear", "cuda", CPU, "op")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
            resolve("linear", "triton", CPU, "op")


def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "linear", set(BACKENDS))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve("linear", "triton", CPU, "op") == "triton"


def test_missing_extension_is_reported_with_its_reason(monkeypatch):
    monkeypatch.setattr(_dispatch, "_native_import_error", lambda: "attnkit._C is not built (test)")
    assert attnkit.backends()["hopfield_energy"]["cpu"][:2] == (False, "attnkit._C is not built (test)")
    with pytest.raises(BackendUnavailableError, match="is not built"):
        resolve("hopfield_energy", "cpu", CPU, "op")
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    assert resolve("hopfield_energy", None, CPU, "op") == "reference"


@pytest.mark.parametrize("env", [None, "", "cpu", "reference", "bogus"])
@pytest.mark.parametrize("backend", [None, "cpu", "reference", "triton", "bogus"])
def test_native_cpu_says_cpu_only_where_resolve_would(monkeypatch, env, backend):
    # native_cpu is the fast paths' shortcut for resolve(..., CPU tensors) == "cpu" (issue 25):
    # True only where resolve returns "cpu" without raising; False sends the call to resolve.
    if env is None:
        monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    else:
        monkeypatch.setenv("ATTNKIT_BACKEND", env)
    for family in ("softmax", "linear"):
        try:
            picked = resolve(family, backend, CPU, "op")
        except (ValueError, BackendUnavailableError):
            picked = None
        assert _dispatch.native_cpu(family, backend) == (picked == "cpu"), (family, backend, env)
    monkeypatch.setitem(_dispatch._IMPLEMENTED, "softmax", {"reference"})
    assert not _dispatch.native_cpu("softmax", backend)
    monkeypatch.undo()
    monkeypatch.setattr(_dispatch, "_native_import_error", lambda: "attnkit._C is not built (test)")
    assert not _dispatch.native_cpu("softmax", backend)


def test_register_kernel_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown family"):
        _dispatch.register_kernel("nope", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        _dispatch.register_kernel("softmax", "nope")


def test_public_api_names():
    for name in ("softmax_attention", "linear_attention", "sparse_attention", "hopfield_update",
                 "hopfield_energy", "patterns", "backends"):
        assert name in attnkit.__all__ and hasattr(attnkit, name)
    for name in ("strided", "fixed", "star", "block_layout", "connectivity"):
        assert callable(getattr(attnkit.patterns, name))

"""Fixtures shared by the tests of the C++ kernels."""
import pytest


@pytest.fixture(params=["native", "brgemm", "emulate"])
def forced(request, monkeypatch):
    """ATTNKIT_CPU_GEMM set to each tile-GEMM path for the test (csrc/cpu/gemm_path.h): attnkit's
    own tiles, oneDNN's brgemm (AMX with the VNNI layout where the CPU has it, torch's reference
    fallback elsewhere) and attnkit's scalar model of the AMX brgemm (the VNNI layout and oneDNN's
    K-tail NaN defect, on any CPU)."""
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", request.param)
    return request.param

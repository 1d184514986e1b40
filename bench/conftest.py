"""pytest-benchmark suites: ``pytest bench/ --benchmark-only`` (quick shapes by default).

Options: ``--attnkit-full`` runs the full sizes of the issues; ``--attnkit-device cuda`` runs on
the GPU.  The suites are not part of the unit tests (``pytest tests/``; pytest.ini's testpaths).
"""
import pytest
import torch

from attnkit.bench import harness


def pytest_addoption(parser):
    group = parser.getgroup("attnkit bench")
    group.addoption("--attnkit-full", action="store_true", help="the full sizes (default: the --quick shapes)")
    group.addoption("--attnkit-device", default="cpu", choices=("cpu", "cuda"), help="device (default: cpu)")
    group.addoption("--attnkit-rounds", type=int, default=5, help="timed rounds per implementation (default: 5)")


def _device(config):
    return torch.device(config.getoption("--attnkit-device"))


def pytest_generate_tests(metafunc):
    if "bench_item" not in metafunc.fixturenames:
        return
    device = _device(metafunc.config)
    if device.type == "cuda" and not torch.cuda.is_available():
        metafunc.parametrize("bench_item", [pytest.param(None, marks=pytest.mark.skip(reason="no CUDA device"))])
        return
    params, ids = harness.pytest_cases(metafunc.module.FAMILY, quick=not metafunc.config.getoption("--attnkit-full"),
                                       device=device)
    metafunc.parametrize("bench_item", params, ids=ids)


@pytest.fixture
def run_bench(request, benchmark):
    """run_bench((case, impl)): time it with pytest-benchmark."""
    def run(item):
        case, impl = item
        harness.pytest_benchmark_run(benchmark, case, impl, _device(request.config),
                                     rounds=request.config.getoption("--attnkit-rounds"))
    return run

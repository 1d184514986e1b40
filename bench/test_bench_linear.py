"""pytest-benchmark suite for the linear family: `pytest bench/test_bench_linear.py --benchmark-only`.

The cases are those of `bench/linear.py` (shared with `python -m attnkit bench`).
"""
from attnkit.bench import linear as FAMILY  # noqa: N812 - read by bench/conftest.py


def test_linear(bench_item, run_bench):
    run_bench(bench_item)

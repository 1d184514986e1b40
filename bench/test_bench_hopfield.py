"""pytest-benchmark suite for the hopfield family: `pytest bench/test_bench_hopfield.py --benchmark-only`.

The cases are those of `bench/hopfield.py` (shared with `python -m attnkit bench`).
"""
from attnkit.bench import hopfield as FAMILY  # noqa: N812 - read by bench/conftest.py


def test_hopfield(bench_item, run_bench):
    run_bench(bench_item)

"""pytest-benchmark suite for the sparse family: `pytest bench/test_bench_sparse.py --benchmark-only`.

The cases are those of `bench/sparse.py` (shared with `python -m attnkit bench`).
"""
from attnkit.bench import sparse as FAMILY  # noqa: N812 - read by bench/conftest.py


def test_sparse(bench_item, run_bench):
    run_bench(bench_item)

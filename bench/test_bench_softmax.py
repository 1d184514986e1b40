"""pytest-benchmark suite for the softmax family: `pytest bench/test_bench_softmax.py --benchmark-only`.

The cases are those of `bench/softmax.py` (shared with `python -m attnkit bench`).
"""
from attnkit.bench import softmax as FAMILY  # noqa: N812 - read by bench/conftest.py


def test_softmax(bench_item, run_bench):
    run_bench(bench_item)

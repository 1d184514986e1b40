"""pytest-benchmark suite for packed sequences and KV-cache decoding (issue 28):
`pytest bench/test_bench_varlen.py --benchmark-only --attnkit-full` (no --quick cases).

The cases are those of `bench/varlen.py` (shared with `python -m attnkit bench`).
"""
from attnkit.bench import varlen as FAMILY  # noqa: N812 - read by bench/conftest.py


def test_varlen(bench_item, run_bench):
    run_bench(bench_item)

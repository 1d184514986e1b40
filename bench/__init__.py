"""attnkit's benchmarks: one harness (:mod:`attnkit.bench.harness`) and one file per family.

Run them with ``python -m attnkit bench`` (table, JSON and PNG) or, through pytest-benchmark,
``pytest bench/ --benchmark-only``.
"""

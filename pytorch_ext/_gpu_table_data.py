"""Measured GPU dispatch entries (attnkit/_gpu_table.py says what they mean).

Written by ``python bench/gpu_dispatch_table.py BENCH_JSON...``; do not edit by hand.  Empty: no
GPU bench with this table's fields has run since it was introduced (session 25, 2026-11-29;
the last GPU figures, an H200 in session 15, had the Triton kernels ahead of the CUDA C++ ones
in every softmax case, which is what an empty table gives).
"""

ENTRIES: list[dict] = []

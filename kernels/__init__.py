"""Triton kernels, one module per family (attnkit.kernels.<family>).

Imported lazily by the op modules: importing triton is slow and optional, and the
TRITON_INTERPRET flag is read when a kernel is decorated."""

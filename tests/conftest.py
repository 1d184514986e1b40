"""Shared test setup: GPU-marked tests run only where CUDA is present; Triton kernels run in
the interpreter where there is no GPU."""
import os

# Without a GPU the Triton kernels run under the interpreter on CPU tensors.  The flag is read
# when a kernel is decorated (@triton.jit), i.e. when attnkit.kernels.* is first imported, so it
# is set here, before any test module imports attnkit.
try:
    import torch as _torch_probe

    _HAS_CUDA = _torch_probe.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


@pytest.fixture(autouse=True)
def _seed():
    """Fresh but reproducible random inputs in every test."""
    torch.manual_seed(0)

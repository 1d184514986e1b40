"""Shared test setup: GPU-marked tests run only where CUDA is present."""
import pytest
import torch


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

"""The first gradients of a double backward (``create_graph=True``), shared by the ops whose
kernels' backward is not differentiable (softmax, sparse, linear): the op's plain-PyTorch
reference is recomputed on the saved inputs and differentiated with a graph."""
from __future__ import annotations

from typing import Sequence

import torch


def reference_gradients(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor]) -> tuple:
    """d ``outputs`` / d ``inputs`` given the outputs' ``grads``, with ``create_graph=True``.

    Only the inputs that require grad are differentiated: torch.autograd.grad raises on the
    others ("One of the differentiated Tensors does not require grad" -- a double backward
    through q alone, k and v held fixed, did).  They, and the inputs the outputs do not use, get
    zeros (autograd drops a gradient for an input that wants none).  No outputs: all zeros."""
    needed = [t for t in inputs if t.requires_grad]
    found = iter(torch.autograd.grad(list(outputs), needed, list(grads), create_graph=True, allow_unused=True)
                 if outputs and needed else ())
    grads_of = [next(found) if (outputs and t.requires_grad) else None for t in inputs]
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads_of))

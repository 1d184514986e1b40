"""Reference sparse attention: dense softmax attention under the pattern's boolean mask.

Straightforward PyTorch, differentiable by autograd, any dtype (float64 for ground truth).
Materializes the [B, H, N, N] scores: for checking, not for speed.
"""
from __future__ import annotations

import torch

from .softmax import softmax_attention_reference


def sparse_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax self-attention restricted to ``pattern.mask(N)``.

    query, key [B, H, N, D], value [B, H, N, Dv] -> [B, H, N, Dv].  ``pattern``: an
    :mod:`attnkit.patterns` pattern; a block layout's ``[H | 1, N, N]`` mask applies per head.
    ``scale`` defaults to 1/sqrt(D).  A query with no key to attend to gets zeros.
    """
    n = query.shape[-2]
    if key.shape[-2] != n:
        raise ValueError(
            f"sparse_attention_reference: self-attention needs key length == query length; "
            f"got {key.shape[-2]} and {n}"
        )
    mask = pattern.mask(n, device=query.device)
    if mask.dim() == 3:  # [H | 1, N, N] -> broadcast over the batch
        mask = mask.unsqueeze(0)
    return softmax_attention_reference(query, key, value, attn_mask=mask, scale=scale)

"""Padding removal for packed-sequence attention, as ``flash_attn.bert_padding`` has it: a padded
batch ``[B, S, ...]`` with its attention mask becomes the token rows of the valid positions
``[total, ...]`` plus the offsets that :func:`attnkit.flash_attn_interface.flash_attn_varlen_func`
(or :func:`attnkit.softmax_attention_varlen`) take, and back.

Model code that pads, unpads, runs the varlen call and pads again switches with the import:
``from attnkit.bert_padding import pad_input, unpad_input``.  Plain PyTorch, differentiable.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["unpad_input", "pad_input", "index_first_axis", "index_put_first_axis"]

OP_PREFIX = "attnkit.bert_padding."


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[indices]`` along dim 0 (rows ``[n, ...]`` -> ``[len(indices), ...]``); differentiable
    (the gradient scatters back into the rows)."""
    return x.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros ``[first_axis_dim, ...]`` with ``values [len(indices), ...]`` written at rows
    ``indices``: the inverse of :func:`index_first_axis`.  Differentiable in ``values``."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def _check_mask(fn: str, name: str, mask, batch: int, seqlen: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, seqlen):
        raise ValueError(f"{fn}: {name} must be a [B, S] = [{batch}, {seqlen}] tensor (1 / True = a token); got "
                         f"{list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{fn}: {name} must be bool or integer (1 = a token); got {mask.dtype}")
    return mask.bool()


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask: Optional[torch.Tensor] = None):
    """The valid tokens of a padded batch, packed.

    Args:
        hidden_states: ``[B, S, ...]``.
        attention_mask: ``[B, S]`` bool or integer, nonzero = a token of the sequence.
        unused_mask: ``[B, S]`` or None: positions kept in the pack although not attended
            (``flash_attn``'s meaning); they count into ``cu_seqlens`` but not into
            ``used_seqlens``.

    Returns:
        ``(hidden [total, ...], indices int64 [total] (flat positions b * S + s, in order),
        cu_seqlens int32 [B + 1], max_seqlen int, used_seqlens int32 [B])`` -- the five
        results of ``flash_attn`` 2.7's ``unpad_input``.
    """
    fn = OP_PREFIX + "unpad_input"
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise ValueError(f"{fn}: hidden_states must be a tensor [B, S, ...]; got "
                         f"{list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__}")
    batch, seqlen = hidden_states.shape[0], hidden_states.shape[1]
    used = _check_mask(fn, "attention_mask", attention_mask, batch, seqlen)
    kept = used if unused_mask is None else used | _check_mask(fn, "unused_mask", unused_mask, batch, seqlen)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if batch else 0
    rows = index_first_axis(hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, max_seqlen, used.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The packed rows ``[total, ...]`` back into a zero-padded batch ``[batch, seqlen, ...]`` at
    the flat positions ``indices`` (from :func:`unpad_input`).  Differentiable."""
    fn = OP_PREFIX + "pad_input"
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"{fn}: indices must be a 1-D tensor with one entry per row of hidden_states "
                         f"({hidden_states.shape[0]})")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= batch * seqlen):
        raise ValueError(f"{fn}: indices must be flat positions in [0, batch * seqlen = {batch * seqlen})")
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])

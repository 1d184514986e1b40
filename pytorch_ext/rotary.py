"""Rotary position embeddings (RoPE) in FlashAttention's conventions: ``apply_rotary_emb``.

RoFormer's rotation of each pair of a vector's first ``rotary_dim`` channels by the angle of its
position: the pair (x_a, x_b) of position p becomes

    (x_a cos θ - x_b sin θ,  x_a sin θ + x_b cos θ),  cos θ = cos[p, i], sin θ = sin[p, i],

pair i being channels (i, i + rotary_dim / 2) (GPT-NeoX's halves, ``interleaved=False``) or
(2i, 2i + 1) (GPT-J's neighbours, ``interleaved=True``); channels past ``rotary_dim`` pass
unchanged.  ``cos`` / ``sin`` are tables ``[seqlen_ro, rotary_dim / 2]`` indexed by position,
as ``flash_attn.layers.rotary.apply_rotary_emb`` and ``flash_attn_with_kvcache`` take them.

Plain PyTorch (elementwise, O(numel) time and memory, differentiable): computed in float32 for
16-bit inputs (float64 for float64), rounded to x's dtype once -- as FlashAttention's rotary
kernel computes.  attnkit.flash_attn_interface uses it for ``flash_attn_with_kvcache``'s
``rotary_cos`` / ``rotary_sin``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ._validation import check_bool, check_tensor

OP_NAME = "attnkit.rotary.apply_rotary_emb"


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tables(fn: str, cos, sin, head_dim: int, device: torch.device) -> int:
    """cos / sin are floating ``[seqlen_ro, rotary_dim / 2]`` tables of one shape on ``device``,
    rotary_dim <= head_dim; returns rotary_dim."""
    check_tensor(fn, "rotary_cos", cos, "[seqlen_ro, rotary_dim / 2]")
    check_tensor(fn, "rotary_sin", sin, "[seqlen_ro, rotary_dim / 2]")
    if cos.shape != sin.shape:
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must have one shape [seqlen_ro, rotary_dim / 2]; got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    if cos.device != device or sin.device != device:
        raise ValueError(f"{fn}: rotary_cos and rotary_sin must be on the inputs' device ({device}); got "
                         f"{cos.device} and {sin.device}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{fn}: rotary_dim = 2 * rotary_cos.shape[1] = {rotary_dim} must be in [2, head dim = "
                         f"{head_dim}]")
    return rotary_dim


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """x ``[..., N, H, D]`` rotated at the int64 ``positions`` (broadcastable to ``[..., N]``,
    every entry in ``[0, seqlen_ro)``: the caller checks) by the tables ``[seqlen_ro, rd / 2]``.
    A new tensor in x's dtype."""
    half = cos.shape[1]
    rd = 2 * half
    work = _compute_dtype(x.dtype)
    c = cos.to(work)[positions].unsqueeze(-2)  # [..., N, 1, rd / 2]
    s = sin.to(work)[positions].unsqueeze(-2)
    part = x[..., :rd].to(work)
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :half], part[..., half:]
        rotated = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    rotated = rotated.to(x.dtype)
    if rd == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rd:]), dim=-1)


def check_positions(fn: str, positions: torch.Tensor, seqlen_ro: int, what: str) -> None:
    """Every position indexes the tables (read to the host: an out-of-range index would be a
    device-side assert on CUDA)."""
    if positions.numel() == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= seqlen_ro:
        raise ValueError(f"{fn}: {what} reach positions {low}..{high}, but rotary_cos / rotary_sin have "
                         f"seqlen_ro = {seqlen_ro} rows")


def _offsets(fn: str, seqlen_offsets, batch: int, device) -> torch.Tensor:
    """seqlen_offsets (an int, or an int tensor [batch]) as int64 [batch, 1] on device."""
    if isinstance(seqlen_offsets, bool) or not isinstance(seqlen_offsets, (int, torch.Tensor)):
        raise TypeError(f"{fn}: seqlen_offsets must be an int or an int32 / int64 tensor [batch]; got "
                        f"{type(seqlen_offsets).__name__}")
    if isinstance(seqlen_offsets, int):
        return torch.full((batch, 1), seqlen_offsets, dtype=torch.int64, device=device)
    if seqlen_offsets.dtype not in (torch.int32, torch.int64) or tuple(seqlen_offsets.shape) != (batch,):
        raise ValueError(f"{fn}: seqlen_offsets must be an int32 / int64 tensor [batch] = [{batch}]; got "
                         f"{str(seqlen_offsets.dtype).replace('torch.', '')} {list(seqlen_offsets.shape)}")
    return seqlen_offsets.to(device=device, dtype=torch.int64).view(batch, 1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """Rotary position embedding of x, FlashAttention's ``apply_rotary_emb`` (flash_attn.layers.rotary).

    Args:
        x: ``[B, N, H, D]`` (FlashAttention's layout: positions before heads), or with
            ``cu_seqlens`` a pack ``[total, H, D]``.
        cos, sin: ``[seqlen_ro, rotary_dim / 2]`` tables (any floating dtype; read in float32, or
            float64 for float64 x), rotary_dim <= D; the first rotary_dim channels are rotated,
            the others copied.
        interleaved: pairs (2i, 2i + 1) (GPT-J) instead of (i, i + rotary_dim / 2) (GPT-NeoX).
        inplace: write the result into x (and return x).
        seqlen_offsets: token t of batch element (or sequence) b sits at position
            ``seqlen_offsets[b] + t`` (an int: the same for all); e.g. the cache length when
            decoding.
        cu_seqlens: int32 / int64 ``[batch + 1]`` offsets of the pack (positions restart at
            every sequence); ``max_seqlen`` is accepted for FlashAttention's signature (unused).

    Returns:
        x rotated, in x's shape and dtype.  Differentiable in x (and in cos / sin).

    Raises:
        TypeError / ValueError: wrong ranks, shapes, dtypes or devices, positions past the
        tables' seqlen_ro rows, rotary_dim above D.
    """
    fn = OP_NAME
    check_bool(fn, "interleaved", interleaved)
    check_bool(fn, "inplace", inplace)
    if cu_seqlens is None:
        check_tensor(fn, "x", x, "[B, N, H, D]", "with cu_seqlens a pack [total, H, D]")
    else:
        check_tensor(fn, "x", x, "[total, H, D]")
    check_tables(fn, cos, sin, x.shape[-1], x.device)
    if cu_seqlens is None:
        batch, n = x.shape[0], x.shape[1]
        positions = _offsets(fn, seqlen_offsets, batch, x.device) + torch.arange(n, device=x.device)
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
                or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"{fn}: cu_seqlens must be an int32 / int64 tensor [batch + 1]")
        cu = [int(c) for c in cu_seqlens.tolist()]
        if cu[0] != 0 or cu[-1] != x.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{fn}: cu_seqlens must start at 0, not decrease and end at total = {x.shape[0]}; "
                             f"got {cu}")
        lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], dtype=torch.int64, device=x.device)
        batch = lengths.numel()
        seq = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths)
        starts = torch.tensor(cu[:-1], dtype=torch.int64, device=x.device)
        positions = _offsets(fn, seqlen_offsets, batch, x.device).view(batch)[seq] \
            + torch.arange(x.shape[0], device=x.device) - starts[seq]
    check_positions(fn, positions, cos.shape[0], "the tokens")
    out = rotate(x, cos, sin, positions, interleaved)
    if inplace:
        return x.copy_(out)
    return out

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


# ----------------------------------------------------------------------------------------------
# The kernels' building blocks, in plain PyTorch (ground truth of the kernel tests).
# Semantics: csrc/ops.cpp (sparse_range_fwd / block_sparse_fwd) and attnkit.ops.sparse.
# ----------------------------------------------------------------------------------------------

def _floor_affine(t: torch.Tensor, f) -> torch.Tensor:
    a, d, m, b = f
    return torch.div(t + a, d, rounding_mode="floor") * m + b


def range_part_mask(nq: int, nk: int, view, lo, hi, device=None) -> torch.Tensor:
    """``BoolTensor[nq, nk]``: True where query row i attends key row j in one range part.

    ``view = [G, q_pg, q_pt, k_pg, k_pt]``, ``lo = hi = [a, d, m, b]`` as in csrc/ops.cpp:
    group g's query t sits at row g*q_pg + t*q_pt (< nq), its key t' at g*k_pg + t'*k_pt (< nk),
    and t attends t' iff lo(t) <= t' <= hi(t) with f(t) = floor((t + a) / d) * m + b.
    """
    g_count, q_pg, q_pt, k_pg, k_pt = (int(x) for x in view)
    mask = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    for g in range(g_count):
        tq = torch.arange(0, max(0, -(-(nq - g * q_pg) // q_pt)), device=device)
        tk = torch.arange(0, max(0, -(-(nk - g * k_pg) // k_pt)), device=device)
        if tq.numel() == 0 or tk.numel() == 0:
            continue
        lo_t = _floor_affine(tq, lo)[:, None]
        hi_t = _floor_affine(tq, hi)[:, None]
        ok = (tk[None, :] >= lo_t) & (tk[None, :] <= hi_t)
        rows = g * q_pg + tq * q_pt
        cols = g * k_pg + tk * k_pt
        mask[rows[:, None], cols[None, :]] |= ok
    return mask


def _masked_attention_with_lse(q, k, v, mask, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    p = p.masked_fill(~mask, 0.0)
    return p @ v, lse


def _masked_attention_bwd(dout, q, k, v, lse, delta, mask, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    # lse = -inf: a row no part reaches (P = 0, zero gradients).  A NaN lse (a NaN / +inf score
    # somewhere in the row) keeps P NaN on the row's entries, so its gradients are NaN, as
    # SDPA's are (issue 15: testing isfinite zeroed them).  Hidden entries get P = dS = 0.
    empty = torch.isneginf(lse).unsqueeze(-1)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse).unsqueeze(-1), lse.unsqueeze(-1)))
    p = torch.where(mask & ~empty, p, torch.zeros_like(p))
    dp = dout @ v.transpose(-1, -2)
    ds = torch.where(mask, p * (dp - delta.unsqueeze(-1)), torch.zeros_like(p))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ dout


def sparse_range_reference(q, k, v, view, lo, hi, scale):
    """One range part (csrc/ops.cpp ``sparse_range_fwd``): -> (out [B,H,Nq,Dv], lse [B,H,Nq]).

    Computed in the inputs' dtype (use float64 for ground truth); rows with no key: 0 / -inf.
    """
    mask = range_part_mask(q.shape[-2], k.shape[-2], view, lo, hi, device=q.device)
    return _masked_attention_with_lse(q, k, v, mask, scale)


def sparse_range_bwd_reference(dout, q, k, v, lse, delta, view, lo, hi, scale):
    """``sparse_range_bwd``: P = exp(scale q.k - lse) on the part's entries, dS = P (dO.v - delta)
    -> (dq, dk, dv).  ``lse`` and ``delta`` are the merged ones (see csrc/ops.cpp)."""
    mask = range_part_mask(q.shape[-2], k.shape[-2], view, lo, hi, device=q.device)
    return _masked_attention_bwd(dout, q, k, v, lse, delta, mask, scale)


def block_lists_mask(row_ptr, col_idx, block: int, causal: bool, n: int, device=None) -> torch.Tensor:
    """``BoolTensor[Hl, n, n]`` of the block-sparse index lists (csrc/ops.cpp ``block_sparse_fwd``)."""
    row_ptr = row_ptr.cpu().long()
    col_idx = col_idx.cpu().long()
    hl, nb1 = row_ptr.shape
    lay = torch.zeros(hl, nb1 - 1, nb1 - 1, dtype=torch.bool)
    for h in range(hl):
        for r in range(nb1 - 1):
            lay[h, r, col_idx[row_ptr[h, r]:row_ptr[h, r + 1]]] = True
    blk = torch.arange(n) // block
    mask = lay[:, blk[:, None], blk[None, :]]
    if causal:
        mask &= torch.ones(n, n, dtype=torch.bool).tril()
    return mask.to(device)


def block_sparse_reference(q, k, v, row_ptr, col_idx, block, causal, scale):
    """``block_sparse_fwd`` in plain PyTorch: -> (out [B,H,N,Dv], lse [B,H,N])."""
    mask = block_lists_mask(row_ptr, col_idx, block, causal, q.shape[-2], device=q.device)
    return _masked_attention_with_lse(q, k, v, mask, scale)


def block_sparse_bwd_reference(dout, q, k, v, lse, delta, row_ptr, col_idx, block, causal, scale):
    """``block_sparse_bwd`` in plain PyTorch: -> (dq, dk, dv)."""
    mask = block_lists_mask(row_ptr, col_idx, block, causal, q.shape[-2], device=q.device)
    return _masked_attention_bwd(dout, q, k, v, lse, delta, mask, scale)

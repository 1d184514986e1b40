"""``attnkit.nn.SparseSelfAttention``: multi-head self-attention under a sparse pattern.

Projections and heads like :class:`torch.nn.MultiheadAttention`; attention by
:func:`attnkit.sparse_attention`, so the cost tracks the pattern's kept entries.  Every head may
have its own pattern (the Sparse Transformer alternates or mixes patterns across heads).
"""
from __future__ import annotations

import torch
from torch import nn

from .._validation import check_bool, check_dense, check_heads
from ..ops.sparse import sparse_attention
from ..patterns import BlockLayout, Pattern

_NAME = "attnkit.nn.SparseSelfAttention"


class SparseSelfAttention(nn.Module):
    r"""Multi-head sparse self-attention.

    ``out = out_proj(concat_h sparse_attention(q_proj(x)^h, k_proj(x)^h, v_proj(x)^h, pattern_h))``
    with ``num_heads`` heads of dim ``embed_dim // num_heads``.

    Args:
        embed_dim: E, the model dim (the input's last dim and the output's).
        num_heads: heads; must divide ``embed_dim``.
        pattern: one :mod:`attnkit.patterns` pattern for every head, or a list / tuple of
            ``num_heads`` patterns, one per head (heads that share a pattern run in one call).
            A ``block_layout`` with H > 1 layout heads is per-head already and needs
            H == num_heads.
        bias: biases on the four projections.
        batch_first: input and output are ``[batch, seq, E]`` (default) instead of ``[seq, batch, E]``.
        scale: multiplies the scores (default ``1 / sqrt(head_dim)``).
        backend: passed to :func:`attnkit.sparse_attention` (None = its default).
        device, dtype: of the parameters.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, each ``nn.Linear(E, E)``.

    ``forward(x)``: ``[B, N, E]`` -> ``[B, N, E]`` (``[N, B, E]`` with ``batch_first=False``).
    The sequence length must suit the patterns (a block layout needs N = nb * block; a star's
    relay must lie inside the sequence).

    Example::

        >>> from attnkit import patterns
        >>> layer = attnkit.nn.SparseSelfAttention(
        ...     256, 4, [patterns.strided(32)] * 2 + [patterns.fixed(32, summary=4)] * 2)
        >>> layer(torch.randn(2, 1000, 256)).shape
        torch.Size([2, 1000, 256])
    """

    def __init__(self, embed_dim: int, num_heads: int, pattern, bias: bool = True,
                 batch_first: bool = True, scale: float | None = None, backend: str | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        check_heads(_NAME, embed_dim, num_heads)
        check_bool(_NAME, "bias", bias)
        check_bool(_NAME, "batch_first", batch_first)
        patterns = list(pattern) if isinstance(pattern, (list, tuple)) else [pattern] * num_heads
        if len(patterns) != num_heads:
            raise ValueError(
                f"{_NAME}: pattern must be one pattern or a list of num_heads={num_heads} patterns; "
                f"got a list of {len(patterns)}"
            )
        for i, p in enumerate(patterns):
            if not isinstance(p, Pattern):
                raise TypeError(
                    f"{_NAME}: pattern[{i}] must be an attnkit.patterns pattern (strided, fixed, "
                    f"star, block_layout); got {type(p).__name__}"
                )
            if isinstance(p, BlockLayout) and p.heads != 1 and (len(set(patterns)) > 1 or p.heads != num_heads):
                raise ValueError(
                    f"{_NAME}: a block layout with {p.heads} layout heads serves all num_heads="
                    f"{num_heads} heads at once: pass it alone, with as many layout heads as num_heads"
                )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.patterns = tuple(patterns)
        self.batch_first = batch_first
        self.scale = scale
        self.backend = backend
        # Heads grouped by pattern (first-seen order): one sparse_attention call per group.
        groups: dict = {}
        for h, p in enumerate(patterns):
            groups.setdefault(p, []).append(h)
        self._groups = [(p, heads) for p, heads in groups.items()]
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)

    def extra_repr(self) -> str:
        pats = self.patterns[0] if len(self._groups) == 1 else list(self.patterns)
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, pattern={pats}, "
                f"batch_first={self.batch_first}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N, E]`` (``[N, B, E]`` if not batch_first) -> the same shape."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_NAME}: x must be a torch.Tensor; got {type(x).__name__}")
        check_dense(_NAME, "x", x)
        layout = "[batch, seq, embed_dim]" if self.batch_first else "[seq, batch, embed_dim]"
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{_NAME}: x must be 3-D {layout} with embed_dim={self.embed_dim}; got shape "
                f"{tuple(x.shape)}"
            )
        if not self.batch_first:
            x = x.transpose(0, 1)
        b, n, _ = x.shape

        def heads(t):  # [B, N, E] -> [B, H, N, hd]
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        if len(self._groups) == 1:
            out = sparse_attention(q, k, v, self._groups[0][0], scale=self.scale, backend=self.backend)
        else:
            parts, order = [], []
            for p, hs in self._groups:
                idx = torch.tensor(hs, device=x.device)
                parts.append(sparse_attention(q.index_select(1, idx), k.index_select(1, idx),
                                              v.index_select(1, idx), p, scale=self.scale,
                                              backend=self.backend))
                order += hs
            out = torch.cat(parts, dim=1)
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            out = out.index_select(1, inverse.to(x.device))
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))
        return out.transpose(0, 1) if not self.batch_first else out

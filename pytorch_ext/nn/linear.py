"""``attnkit.nn.LinearAttention``: multi-head linear (kernelized) attention as a layer.

Projections and heads like :class:`torch.nn.MultiheadAttention`, attention by
:func:`attnkit.linear_attention` (O(N) in the sequence length), plus the recurrent form for
generation (:meth:`LinearAttention.step`).
"""
from __future__ import annotations

import torch
from torch import nn

from .._validation import check_bool, check_choice, check_dense, check_heads
from ..ops.linear import linear_attention, linear_attention_step
from ..reference.linear import FEATURE_MAPS

_NAME = "attnkit.nn.LinearAttention"


class LinearAttention(nn.Module):
    r"""Multi-head linear attention.

    ``out = out_proj(concat_h linear_attention(q_proj(query)^h, k_proj(key)^h, v_proj(value)^h))``
    with ``num_heads`` heads of dim ``embed_dim // num_heads`` (see
    :func:`attnkit.linear_attention` for the attention itself: feature map φ, normalization).

    Args:
        embed_dim: E, the model dim (the inputs' last dim and the output's).
        num_heads: heads; must divide ``embed_dim``.
        feature_map: ``"elu"`` (elu + 1), ``"relu"`` or ``"identity"``.
        causal: position i attends to positions j <= i only (needs key length = query length).
        bias: biases on the four projections.
        batch_first: inputs and output are ``[batch, seq, E]`` (default) instead of
            ``[seq, batch, E]``.
        backend: passed to :func:`attnkit.linear_attention` (None = its default).
        normalize, eps, scale: keyword only; passed to :func:`attnkit.linear_attention`
            (defaults: normalized, eps 1e-6).
        device, dtype: of the parameters.

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, each an ``nn.Linear(E, E)``
    with torch's default initialization.

    ``forward(query)`` is self-attention; ``forward(query, key, value)`` attends from ``query``
    (length N) to ``key`` / ``value`` (length M; M = N when causal).  Causal layers can carry a
    recurrent state: ``forward(x, initial_state=..., return_state=True)`` and :meth:`step`,
    so that a prompt run in parallel and continued token by token gives the outputs of one
    long call.  A state is a pair ``(S [B, H, hd, hd], z [B, H, hd])`` in float32 (float64 for
    float64 parameters).

    Example::

        >>> layer = attnkit.nn.LinearAttention(64, 8, causal=True)
        >>> x = torch.randn(2, 100, 64)
        >>> y, state = layer(x, return_state=True)           # [2, 100, 64]
        >>> y_t, state = layer.step(torch.randn(2, 64), state)  # the 101st position: [2, 64]
    """

    def __init__(self, embed_dim: int, num_heads: int, feature_map: str = "elu",
                 causal: bool = False, bias: bool = True, batch_first: bool = True,
                 backend: str | None = None, *, normalize: bool = True, eps: float = 1e-6,
                 scale: float = 1.0, device=None, dtype=None) -> None:
        super().__init__()
        check_heads(_NAME, embed_dim, num_heads)
        check_choice(_NAME, "feature_map", feature_map, FEATURE_MAPS)
        for name, flag in (("causal", causal), ("bias", bias), ("batch_first", batch_first),
                           ("normalize", normalize)):
            check_bool(_NAME, name, flag)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.feature_map = feature_map
        self.causal = causal
        self.batch_first = batch_first
        self.backend = backend
        self.normalize = normalize
        self.eps = eps
        self.scale = scale
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"feature_map={self.feature_map!r}, causal={self.causal}, "
                f"batch_first={self.batch_first}, normalize={self.normalize}")

    def _check_input(self, name: str, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_NAME}: {name} must be a torch.Tensor; got {type(x).__name__}")
        check_dense(_NAME, name, x)
        layout = "[batch, seq, embed_dim]" if self.batch_first else "[seq, batch, embed_dim]"
        if x.dim() != 3:
            raise ValueError(f"{_NAME}: {name} must be 3-D {layout}; got shape {tuple(x.shape)}")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{_NAME}: {name}'s last dim must be embed_dim={self.embed_dim}; got {x.shape[-1]}"
            )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, E] -> [B, H, L, hd] (a view: the kernels take any strides)."""
        b, length, _ = x.shape
        return x.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, initial_state=None,
                return_state: bool = False):
        """``[B, N, E]`` (or ``[N, B, E]``) -> same shape; with ``return_state`` also the state.

        ``key`` and ``value`` go together (both None: self-attention on ``query``).
        ``initial_state`` / ``return_state``: causal layers only, see the class docstring.
        """
        if (key is None) != (value is None):
            raise ValueError(f"{_NAME}: pass both key and value, or neither (self-attention)")
        if key is None:
            key = value = query
        for name, x in (("query", query), ("key", key), ("value", value)):
            self._check_input(name, x)
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(
                f"{_NAME}: query, key and value must share the batch size and key and value the "
                f"length; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} "
                f"(batch_first={self.batch_first})"
            )
        b, n, _ = query.shape
        result = linear_attention(
            self._heads(self.q_proj(query)), self._heads(self.k_proj(key)),
            self._heads(self.v_proj(value)), causal=self.causal, feature_map=self.feature_map,
            normalize=self.normalize, eps=self.eps, scale=self.scale,
            initial_state=initial_state, return_state=return_state, backend=self.backend,
        )
        out, state = result if return_state else (result, None)
        out = self.out_proj(out.transpose(1, 2).reshape(b, n, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, state) if return_state else out

    def step(self, x_t: torch.Tensor, state=None):
        """One position of causal self-attention: ``x_t [B, E]`` -> ``(out_t [B, E], state)``.

        ``state`` from :meth:`forward` with ``return_state=True`` or a previous step (None: no
        history).  Needs ``causal=True``.
        """
        if not self.causal:
            raise ValueError(f"{_NAME}: step() needs a causal layer (causal=True)")
        if not isinstance(x_t, torch.Tensor):
            raise TypeError(f"{_NAME}: x_t must be a torch.Tensor; got {type(x_t).__name__}")
        check_dense(_NAME, "x_t", x_t)
        if x_t.dim() != 2 or x_t.shape[-1] != self.embed_dim:
            raise ValueError(
                f"{_NAME}: x_t must be [batch, embed_dim={self.embed_dim}]; got shape {tuple(x_t.shape)}"
            )
        b = x_t.shape[0]

        def heads(t):  # [B, E] -> [B, H, hd]
            return t.view(b, self.num_heads, self.head_dim)

        out, state = linear_attention_step(
            heads(self.q_proj(x_t)), heads(self.k_proj(x_t)), heads(self.v_proj(x_t)), state,
            feature_map=self.feature_map, normalize=self.normalize, eps=self.eps,
            scale=self.scale, backend=self.backend,
        )
        return self.out_proj(out.reshape(b, self.embed_dim)), state

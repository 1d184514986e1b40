"""A small causal transformer on attnkit's ops, shared by the theory modules.

API (import as ``from attnkit.theory._model import TinyCausalTransformer, train_model``):

``TinyCausalTransformer(d_in, d_model, n_layers, n_heads, d_out, max_len, *, mlp_ratio=4,
backend=None, dtype=None)``
    ``forward(x)``: ``x`` ``[B, N, d_in]`` (N <= max_len) -> ``[B, N, d_out]``; position i of the
    output sees only inputs 0..i.  The architecture is GPT-2's, reduced:

    .. code-block:: text

        h_0 = x W_in + b_in + P[:N]                          (learned positions P [max_len, d_model])
        h_l = h_{l-1} + Attn_l(LN(h_{l-1}))                  (pre-norm block, l = 1..n_layers)
        h_l = h_l + MLP_l(LN(h_l))                           (MLP: Linear -> GELU -> Linear, width mlp_ratio·d_model)
        y   = LN(h_L) W_out + b_out

    ``Attn`` is multi-head causal softmax attention: q, k, v = LN(h) W_qkv split into
    ``n_heads`` heads of dim ``d_model // n_heads``, ``attnkit.softmax_attention(q, k, v,
    is_causal=True, backend=backend)`` (scale 1/sqrt(head dim)), heads concatenated, one output
    projection.  Forward and backward run on attnkit's softmax kernels (the C++ ``cpu``
    backend for CPU tensors, float32 or float64).  No dropout.  Initialization: GPT-2's
    (weights N(0, 0.02²), the residual output projections N(0, (0.02/sqrt(2 n_layers))²),
    zero biases, positions N(0, 0.02²)).

    ``dtype``: the parameters' dtype (default torch's default dtype; float64 for exact checks).

``train_model(model, batch_fn, loss_fn, steps, *, lr=1e-3, weight_decay=0.0, grad_clip=1.0,
warmup=0, progress=True, desc="train", log_every=0, callback=None)``
    Adam(W) on ``loss_fn(model, batch_fn(step))`` for ``steps`` steps with a tqdm bar (the
    running loss on it), optional linear warm-up and gradient-norm clipping; returns the list of
    per-step losses (floats).  ``batch_fn(step)`` returns whatever ``loss_fn`` takes as its second
    argument, so a curriculum is a ``batch_fn`` that reads the step.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..ops.softmax import softmax_attention

__all__ = ["CausalSelfAttention", "Block", "TinyCausalTransformer", "train_model"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through :func:`attnkit.softmax_attention`.

    ``x [B, N, d_model] -> out_proj(concat_h softmax(q_h k_hᵀ / sqrt(d_h) + causal) v_h)``.
    """

    def __init__(self, d_model: int, n_heads: int, *, backend: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.backend = backend
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.out_proj = nn.Linear(d_model, d_model, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, e // self.n_heads).permute(2, 0, 3, 1, 4)
        out = softmax_attention(q, k, v, is_causal=True, backend=self.backend)  # [B, H, N, d_h]
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e))


class Block(nn.Module):
    """Pre-norm transformer block: ``h + Attn(LN(h))`` then ``h + MLP(LN(h))``."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, *,
                 backend: Optional[str] = None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_heads, backend=backend, dtype=dtype)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model, dtype=dtype),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model, dtype=dtype),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class TinyCausalTransformer(nn.Module):
    """A GPT-2-style causal transformer on attnkit's softmax attention (see the module docstring).

    Args:
        d_in: input feature dim (the input is read by a linear embedding, not a token table).
        d_model: residual width; ``n_heads`` must divide it.
        n_layers: pre-norm blocks.
        n_heads: attention heads per block.
        d_out: output dim per position (linear read-out after a final LayerNorm).
        max_len: longest sequence (rows of the learned position table).
        mlp_ratio: MLP hidden width / d_model.
        backend: passed to :func:`attnkit.softmax_attention` (None: its default).
        dtype: parameter dtype (None: torch's default).

    Example::

        >>> model = TinyCausalTransformer(d_in=6, d_model=64, n_layers=3, n_heads=4, d_out=1, max_len=41)
        >>> model(torch.randn(8, 41, 6)).shape
        torch.Size([8, 41, 1])
    """

    def __init__(self, d_in: int, d_model: int, n_layers: int, n_heads: int, d_out: int,
                 max_len: int, *, mlp_ratio: int = 4, backend: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Linear(d_in, d_model, dtype=dtype)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model, dtype=dtype))
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, mlp_ratio, backend=backend, dtype=dtype) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model, dtype=dtype)
        self.head = nn.Linear(d_model, d_out, dtype=dtype)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("out_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n > self.max_len:
            raise ValueError(f"sequence length {n} exceeds max_len={self.max_len}")
        h = self.embed(x) + self.pos[:n]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def train_model(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    steps: int,
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    grad_clip: Optional[float] = 1.0,
    warmup: int = 0,
    progress: bool = True,
    desc: str = "train",
    log_every: int = 0,
    callback: Optional[Callable[[int, float], None]] = None,
) -> list[float]:
    """Train ``model`` with AdamW on ``loss_fn(model, batch_fn(step))``; returns per-step losses.

    ``lr`` ramps linearly from 0 over ``warmup`` steps, then stays constant.  Gradients are
    clipped to norm ``grad_clip`` (None: no clipping).  ``progress`` shows a tqdm bar with the
    loss averaged over the last 100 steps; ``callback(step, loss)`` (if given) runs every
    ``log_every`` steps (every step when 0) -- e.g. to record an evaluation curve.
    """
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=not progress, mininterval=0.5, leave=False)
    for step in bar:
        if warmup:
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / warmup)
        loss = loss_fn(model, batch_fn(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        if progress and step % 50 == 0:
            window = losses[-100:]
            bar.set_postfix(loss=f"{sum(window) / len(window):.4g}")
        if callback is not None and (log_every == 0 or step % log_every == 0):
            callback(step, value)
    bar.close()
    model.eval()
    return losses

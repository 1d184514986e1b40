r"""attnkit's reference model: a small causal language model whose attention is chosen per layer.

API (``import attnkit.models``):

``ModelConfig(vocab_size, d_model=128, n_layers=4, n_heads=4, max_len=256, attention="softmax",
positions="rotary", mlp_ratio=4, dropout=0.0, sparse_patterns=None, linear_feature_map="elu",
hopfield_steps=1, hopfield_beta=None, rope_base=10000.0, tie_embeddings=True)``
    Everything that defines the architecture; plain data, saved in checkpoints.

``CausalLM(config=None, *, backend=None, **config_fields)``
    ``forward(tokens)``: ``tokens`` ``[B, N]`` int64 (N <= max_len) -> logits ``[B, N, vocab_size]``;
    position i sees tokens 0..i only.  ``loss(tokens)``: mean next-token cross-entropy (nats)
    over the ``B·(N−1)`` predictions.  ``hidden(embeds)``: the block stack alone, ``[B, N,
    d_model] -> [B, N, d_model]`` (for continuous inputs: a theory module brings its own input
    and output maps).  ``generate(prompt, max_new_tokens, temperature=0.0)``: sampling (greedy at
    temperature 0) without a cache.

``train(model, source, steps, ...)``, ``evaluate(model, source, ...)``
    AdamW training on batches drawn from a source; held-out loss.

``MarkovSource(vocab_size=16, order=2, seed=0, sharpness=2.0)``, ``TextSource(path)``
    The synthetic order-k Markov source (with its exact entropy rate: the best achievable
    loss) and byte-level text from a file.

``save_checkpoint(path, model, ...)``, ``load_checkpoint(path, ...)``
    A checkpoint is a ``torch.save`` of plain data: config, weights, optionally the optimizer
    state, the step and the loss history; ``torch.load(weights_only=True)`` reads it.

``python -m attnkit train`` (:func:`main`) trains it from the command line.

The architecture (pre-norm, GPT-2-like, with rotary or learned positions)::

    h_0 = E[tokens] (+ P[:N] with learned positions)       E [vocab, d_model], P [max_len, d_model]
    h_l = h_{l-1} + Drop(Attn_l(LN(h_{l-1})))             l = 1..n_layers
    h_l = h_l + Drop(MLP_l(LN(h_l)))                       Linear -> GELU -> Linear (mlp_ratio·d_model)
    logits = LN(h_L) Eᵀ                                   (tied; an own head with tie_embeddings=False)

Each ``Attn_l`` projects ``q, k, v = LN(h) W_qkv`` into ``n_heads`` heads of dim
``d_model // n_heads``, applies rotary embeddings to q and k (``positions="rotary"``: the
half-split form of GPT-NeoX / Llama, base ``rope_base``), runs the layer's attention kind, and
projects the concatenated heads back (``W_o``).  The kinds (``attention``: one for every layer
or a list with one per layer):

- ``"softmax"``: :func:`attnkit.softmax_attention` with ``is_causal=True`` (scale 1/√d_h).
- ``"linear"``: :func:`attnkit.linear_attention` with ``causal=True``, the normalized form,
  feature map ``linear_feature_map`` (default ``elu``: elu(x)+1).
- ``"sparse"``: :func:`attnkit.sparse_attention`, one causal :mod:`attnkit.patterns` pattern
  per head (``sparse_patterns``, a list of ``n_heads``; heads that share a pattern run in one
  call).  Default: heads alternate ``strided(s)`` and ``fixed(s, summary=1)`` with
  ``s = max(2, round(sqrt(max_len)))`` (the Sparse Transformer's pair).
- ``"hopfield"``: causal Hopfield self-attention (Ramsauer et al. 2020): the stored patterns
  of query i are the keys k_0..k_i; the state starts at q_i, takes ``hopfield_steps`` updates
  ξ ← softmax(β ξ Kᵀ + causal) K, then reads out softmax(β ξ Kᵀ + causal) V, β =
  ``hopfield_beta`` (default 1/√d_h).  :func:`attnkit.hopfield_update` takes no mask, so each
  step is a causal :func:`attnkit.softmax_attention` call with K as values (the same route
  :class:`attnkit.nn.Hopfield` takes under a mask); ``hopfield_steps=0`` is plain softmax
  attention with scale β.

Initialization (GPT-2's): weights N(0, 0.02²), the residual output projections (``W_o`` and
the MLP's second layer) N(0, (0.02/√(2·n_layers))²), zero biases, unit LayerNorm gains,
learned positions N(0, 0.02²).  ``dropout`` is residual dropout (after the embedding, each
attention and each MLP), active in training mode only; no attention-probability dropout (the
linear and sparse ops have none, and on CPU a softmax call with dropout leaves the C++
kernel for the reference).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import patterns as _patterns
from .ops.linear import linear_attention
from .ops.softmax import softmax_attention
from .ops.sparse import sparse_attention

__all__ = [
    "ATTENTION_KINDS",
    "ModelConfig",
    "CausalLM",
    "MarkovSource",
    "TextSource",
    "train",
    "evaluate",
    "save_checkpoint",
    "load_checkpoint",
    "main",
]

ATTENTION_KINDS = ("softmax", "linear", "sparse", "hopfield")
CHECKPOINT_FORMAT = "attnkit.models.CausalLM/1"


# ==============================================================================================
# configuration (and the sparse patterns as plain data, for checkpoints)
# ==============================================================================================


def _pattern_to_spec(p) -> dict:
    """An :mod:`attnkit.patterns` pattern (or its spec) as a plain dict."""
    if isinstance(p, dict):
        p = _pattern_from_spec(p)  # validates
    if isinstance(p, _patterns.Strided):
        return {"type": "strided", "stride": p.stride, "causal": p.causal}
    if isinstance(p, _patterns.Fixed):
        return {"type": "fixed", "stride": p.stride, "summary": p.summary, "causal": p.causal}
    if isinstance(p, _patterns.Star):
        return {"type": "star", "relay": p.relay, "radius": p.radius, "cyclic": p.cyclic, "causal": p.causal}
    if isinstance(p, _patterns.BlockLayout):
        return {"type": "block_layout", "layout": p.layout.tolist(), "block": p.block, "causal": p.causal}
    raise TypeError(
        "sparse_patterns: each entry must be an attnkit.patterns pattern (strided, fixed, star, "
        f"block_layout) or its dict spec; got {type(p).__name__}"
    )


def _pattern_from_spec(spec: dict):
    kind = spec.get("type")
    args = {k: v for k, v in spec.items() if k != "type"}
    if kind == "strided":
        return _patterns.strided(**args)
    if kind == "fixed":
        return _patterns.fixed(**args)
    if kind == "star":
        return _patterns.star(**args)
    if kind == "block_layout":
        args["layout"] = torch.tensor(args["layout"], dtype=torch.bool)
        return _patterns.block_layout(**args)
    raise ValueError(f"sparse_patterns: unknown pattern type {kind!r} in {spec!r}")


@dataclasses.dataclass
class ModelConfig:
    """The reference model's architecture (see the module docstring).

    Args:
        vocab_size: V, the token alphabet (tokens are ints in ``[0, V)``).
        d_model: residual width; ``n_heads`` must divide it (head dim even with rotary).
        n_layers: pre-norm blocks.
        n_heads: attention heads per block.
        max_len: longest sequence (learned position rows; the sparse default stride).
        attention: one kind for every layer, or a list of ``n_layers`` kinds, from
            ``"softmax" | "linear" | "sparse" | "hopfield"``.
        positions: ``"rotary"`` (on q and k of every layer; no parameters) or ``"learned"``
            (a ``[max_len, d_model]`` table added to the embeddings).
        mlp_ratio: MLP hidden width / d_model.
        dropout: residual dropout probability (training mode only).
        sparse_patterns: per-head causal patterns of the ``"sparse"`` layers: ``n_heads``
            :mod:`attnkit.patterns` patterns or their dict specs (e.g. ``{"type": "strided",
            "stride": 8, "causal": True}``); None: the default of the module docstring.  Stored
            as dict specs.
        linear_feature_map: φ of the ``"linear"`` layers (``"elu" | "relu"``).
        hopfield_steps: Hopfield updates before the read-out (>= 0).
        hopfield_beta: β of the ``"hopfield"`` layers (None: 1/√d_h).
        rope_base: the rotary frequency base.
        tie_embeddings: the output head is the token embedding (transposed).
    """

    vocab_size: int
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_len: int = 256
    attention: Any = "softmax"
    positions: str = "rotary"
    mlp_ratio: int = 4
    dropout: float = 0.0
    sparse_patterns: Optional[Sequence[Any]] = None
    linear_feature_map: str = "elu"
    hopfield_steps: int = 1
    hopfield_beta: Optional[float] = None
    rope_base: float = 10000.0
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig: {name} must be an int >= 1; got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelConfig: n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.positions not in ("rotary", "learned"):
            raise ValueError(f"ModelConfig: positions must be 'rotary' or 'learned'; got {self.positions!r}")
        if self.positions == "rotary" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"ModelConfig: rotary positions need an even head dim; got {self.d_model // self.n_heads}")
        kinds = [self.attention] * self.n_layers if isinstance(self.attention, str) else list(self.attention)
        if len(kinds) != self.n_layers:
            raise ValueError(
                f"ModelConfig: attention must be one kind or a list of n_layers={self.n_layers} kinds; "
                f"got {len(kinds)}"
            )
        for kind in kinds:
            if kind not in ATTENTION_KINDS:
                raise ValueError(f"ModelConfig: attention kind {kind!r} is not one of {ATTENTION_KINDS}")
        self.attention = self.attention if isinstance(self.attention, str) else list(kinds)
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"ModelConfig: dropout must be in [0, 1); got {self.dropout!r}")
        if self.linear_feature_map not in ("elu", "relu"):
            raise ValueError(f"ModelConfig: linear_feature_map must be 'elu' or 'relu'; got {self.linear_feature_map!r}")
        if not isinstance(self.hopfield_steps, int) or self.hopfield_steps < 0:
            raise ValueError(f"ModelConfig: hopfield_steps must be an int >= 0; got {self.hopfield_steps!r}")
        if self.hopfield_beta is not None and not (math.isfinite(self.hopfield_beta) and self.hopfield_beta > 0):
            raise ValueError(f"ModelConfig: hopfield_beta must be a finite number > 0; got {self.hopfield_beta!r}")
        if self.sparse_patterns is None:
            s = max(2, round(math.sqrt(self.max_len)))
            pair = [_patterns.strided(s), _patterns.fixed(s, summary=1)]
            self.sparse_patterns = [pair[h % 2] for h in range(self.n_heads)]
        specs = [_pattern_to_spec(p) for p in self.sparse_patterns]
        if len(specs) != self.n_heads:
            raise ValueError(
                f"ModelConfig: sparse_patterns needs one pattern per head (n_heads={self.n_heads}); got {len(specs)}"
            )
        for spec in specs:
            if not spec["causal"]:
                raise ValueError(f"ModelConfig: sparse patterns must be causal (a causal LM); got {spec}")
        self.sparse_patterns = specs

    @property
    def layer_kinds(self) -> list[str]:
        """The attention kind of each layer."""
        return [self.attention] * self.n_layers if isinstance(self.attention, str) else list(self.attention)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        """Plain data (what a checkpoint stores)."""
        return dataclasses.asdict(self)


# ==============================================================================================
# the model
# ==============================================================================================


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """One layer's multi-head causal attention of kind ``kind``: ``[B, N, d_model] -> [B, N, d_model]``."""

    def __init__(self, config: ModelConfig, kind: str, *, backend: Optional[str] = None):
        super().__init__()
        self.kind = kind
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.backend = backend
        self.feature_map = config.linear_feature_map
        self.hopfield_steps = config.hopfield_steps
        self.beta = config.hopfield_beta if config.hopfield_beta is not None else 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        groups: dict = {}
        if kind == "sparse":
            for h, spec in enumerate(config.sparse_patterns):
                groups.setdefault(_pattern_from_spec(spec), []).append(h)
        self._groups = list(groups.items())

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, n_heads={self.n_heads}"

    def forward(self, x: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        if self.kind == "softmax":
            out = softmax_attention(q, k, v, is_causal=True, backend=self.backend)
        elif self.kind == "linear":
            out = linear_attention(q, k, v, causal=True, feature_map=self.feature_map, backend=self.backend)
        elif self.kind == "hopfield":
            xi = q
            for _ in range(self.hopfield_steps):
                xi = softmax_attention(xi, k, k, is_causal=True, scale=self.beta, backend=self.backend)
            out = softmax_attention(xi, k, v, is_causal=True, scale=self.beta, backend=self.backend)
        else:  # sparse: one call per group of heads sharing a pattern
            if len(self._groups) == 1:
                out = sparse_attention(q, k, v, self._groups[0][0], backend=self.backend)
            else:
                out = torch.empty_like(q)
                for pattern, heads in self._groups:
                    idx = torch.tensor(heads, device=x.device)
                    part = sparse_attention(q.index_select(1, idx), k.index_select(1, idx),
                                            v.index_select(1, idx), pattern, backend=self.backend)
                    out = out.index_copy(1, idx, part)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e))


class Block(nn.Module):
    """Pre-norm block: ``h + Drop(Attn(LN(h)))``, then ``h + Drop(MLP(LN(h)))``."""

    def __init__(self, config: ModelConfig, kind: str, *, backend: Optional[str] = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config, kind, backend=backend)
        self.ln2 = nn.LayerNorm(config.d_model)
        width = config.mlp_ratio * config.d_model
        self.mlp = nn.Sequential(nn.Linear(config.d_model, width), nn.GELU(), nn.Linear(width, config.d_model))
        self.drop = nn.Dropout(config.dropout)

    def forward(self, h: torch.Tensor, rotary=None) -> torch.Tensor:
        h = h + self.drop(self.attn(self.ln1(h), rotary))
        return h + self.drop(self.mlp(self.ln2(h)))


class CausalLM(nn.Module):
    """The reference causal language model (see the module docstring for the architecture).

    Args:
        config: a :class:`ModelConfig`; or leave it out and pass its fields as keywords.
        backend: the attnkit backend of every attention call (None: attnkit's default --
            ``cpu`` for CPU tensors, ``triton`` for CUDA tensors).  Not part of the config.
        **config_fields: :class:`ModelConfig` fields (only without ``config``).

    Shapes: ``forward(tokens [B, N] int64) -> logits [B, N, vocab_size]`` in the parameters'
    dtype; N <= ``max_len``.  (A ``sparse`` layer with a ``block_layout`` pattern also needs N
    to be a multiple of the block.)

    Example::

        >>> model = CausalLM(vocab_size=16, d_model=64, n_layers=4, n_heads=4, max_len=64,
        ...                  attention=["softmax", "linear", "sparse", "hopfield"])
        >>> tokens = MarkovSource(16).sample(8, 64)
        >>> model(tokens).shape, model.loss(tokens).shape
        (torch.Size([8, 64, 16]), torch.Size([]))
    """

    def __init__(self, config: Optional[ModelConfig] = None, *, backend: Optional[str] = None, **config_fields):
        super().__init__()
        if config is None:
            config = ModelConfig(**config_fields)
        elif config_fields:
            raise TypeError("CausalLM: pass either a ModelConfig or its fields as keywords, not both")
        if not isinstance(config, ModelConfig):
            raise TypeError(f"CausalLM: config must be a ModelConfig; got {type(config).__name__}")
        self.config = config
        self.backend = backend
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = (nn.Parameter(torch.zeros(config.max_len, config.d_model))
                    if config.positions == "learned" else None)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, kind, backend=backend) for kind in config.layer_kinds)
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.positions == "rotary":
            d = config.head_dim
            inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            angles = torch.arange(config.max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
            # Not in the state_dict: a function of the config.
            self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
            self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std_out = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("out_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=std_out)
            else:
                nn.init.normal_(p, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, embeds: torch.Tensor) -> torch.Tensor:
        """The block stack on embeddings: ``[B, N, d_model] -> [B, N, d_model]`` (after the
        final LayerNorm).  Adds learned positions / applies rotary embeddings itself."""
        n = embeds.shape[1]
        if n > self.config.max_len:
            raise ValueError(f"CausalLM: sequence length {n} exceeds max_len={self.config.max_len}")
        h = embeds + self.pos[:n] if self.pos is not None else embeds
        h = self.drop(h)
        rotary = None
        if self.pos is None:
            rotary = (self.rope_cos[:n].to(h.dtype), self.rope_sin[:n].to(h.dtype))
        for block in self.blocks:
            h = block(h, rotary)
        return self.ln_f(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``[B, N]`` int64 -> logits ``[B, N, vocab_size]``."""
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"CausalLM: tokens must be an int64 tensor [B, N]; got {tokens.dtype} {tuple(tokens.shape)}")
        h = self.hidden(self.embed(tokens))
        return self.head(h) if self.head is not None else h @ self.embed.weight.t()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of ``tokens`` ``[B, N]`` (N >= 2): a scalar."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Continue ``prompt`` ``[B, N0]`` by ``max_new_tokens`` tokens: ``[B, N0 + max_new_tokens]``.

        Greedy at ``temperature=0``, else sampled from softmax(logits / temperature).  No KV
        cache: each step reruns the last ``max_len`` tokens (this model is for training
        studies, not serving).
        """
        was_training = self.training
        self.eval()
        tokens = prompt
        for _ in range(max_new_tokens):
            logits = self(tokens[:, -self.config.max_len:])[:, -1].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        self.train(was_training)
        return tokens


# ==============================================================================================
# data sources
# ==============================================================================================


class MarkovSource:
    """A random order-``order`` Markov chain over ``vocab_size`` symbols.

    The next-symbol distribution given the last ``order`` symbols is ``softmax(sharpness · g)``
    with g ~ N(0, 1) per (context, symbol), drawn once from ``seed``; the first ``order``
    symbols of a sequence are uniform.  ``sharpness`` sets how predictable it is (0: uniform
    i.i.d.).

    Attributes:
        vocab_size, order.
        transition: ``[vocab_size ** order, vocab_size]`` float64, rows sum to 1 (row index =
            the context read as base-``vocab_size`` digits, oldest first).

    Example::

        >>> src = MarkovSource(vocab_size=8, order=2)
        >>> src.sample(4, 32).shape, round(src.entropy_rate(), 3) < math.log(8)
        (torch.Size([4, 32]), True)
    """

    def __init__(self, vocab_size: int = 16, order: int = 2, *, seed: int = 0, sharpness: float = 2.0):
        if vocab_size < 2 or order < 1:
            raise ValueError(f"MarkovSource: vocab_size >= 2 and order >= 1; got {vocab_size}, {order}")
        if vocab_size ** order > 1 << 20:
            raise ValueError(f"MarkovSource: vocab_size ** order = {vocab_size ** order} contexts is too many")
        self.vocab_size, self.order, self.sharpness, self.seed = vocab_size, order, sharpness, seed
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab_size ** order, vocab_size, generator=g, dtype=torch.float64)
        self.transition = torch.softmax(sharpness * logits, dim=-1)

    def __repr__(self) -> str:
        return (f"MarkovSource(vocab_size={self.vocab_size}, order={self.order}, seed={self.seed}, "
                f"sharpness={self.sharpness})")

    def sample(self, batch: int, length: int, *, generator: Optional[torch.Generator] = None,
               split: str = "train") -> torch.Tensor:
        """``[batch, length]`` int64 token sequences (``split`` is accepted for symmetry with
        :class:`TextSource`: every draw is fresh)."""
        v, k = self.vocab_size, self.order
        out = torch.empty(batch, length, dtype=torch.int64)
        first = min(k, length)
        out[:, :first] = torch.randint(v, (batch, first), generator=generator)
        probs = self.transition.float()
        for t in range(k, length):
            ctx = torch.zeros(batch, dtype=torch.int64)
            for j in range(t - k, t):
                ctx = ctx * v + out[:, j]
            out[:, t] = torch.multinomial(probs[ctx], 1, generator=generator).squeeze(1)
        return out

    def stationary(self) -> torch.Tensor:
        """The stationary distribution of the contexts, ``[vocab_size ** order]`` float64
        (power iteration from uniform)."""
        v, k, p = self.vocab_size, self.order, self.transition
        n_ctx = v ** k
        # context c = (x_1..x_k) moves to (x_2..x_k, y) with probability p[c, y]
        nxt = ((torch.arange(n_ctx)[:, None] % (v ** (k - 1))) * v + torch.arange(v)[None, :]).reshape(-1)
        pi = torch.full((n_ctx,), 1.0 / n_ctx, dtype=torch.float64)
        for _ in range(5000):
            new = torch.zeros_like(pi).index_add_(0, nxt, (pi[:, None] * p).reshape(-1))
            done = float((new - pi).abs().max()) < 1e-14
            pi = new
            if done:
                break
        return pi

    def entropy(self, context: Optional[int] = None) -> float:
        """H(X_t | the previous ``context`` symbols) in nats, under the stationary distribution.

        ``context=None`` (or ``order``): the entropy rate, the loss of the best possible
        predictor far into a sequence.  ``context=0``: the entropy of the symbol frequencies
        (the best loss without looking back); between them, what a predictor that sees only
        the last ``context`` symbols can reach at best.
        """
        v, k = self.vocab_size, self.order
        j = k if context is None else int(context)
        if not 0 <= j <= k:
            raise ValueError(f"MarkovSource.entropy: context must be in [0, {k}]; got {context!r}")
        joint = self.stationary()[:, None] * self.transition          # [(x_1..x_k), y]
        joint = joint.reshape(v ** (k - j), v ** j * v).sum(0)          # keep the last j symbols and y

        def h(p):
            p = p[p > 0]
            return float(-(p * p.log()).sum())

        return h(joint) - h(joint.reshape(v ** j, v).sum(1))

    def entropy_rate(self) -> float:
        """The entropy rate H(X_t | X_{t-order..t-1}) (nats): ``entropy(order)``."""
        return self.entropy()


class TextSource:
    """Byte-level text from a file: tokens are the file's bytes (``vocab_size`` 256, no tokenizer).

    The last ``val_fraction`` of the bytes are held out (``split="val"``).  :meth:`sample`
    draws random windows; :meth:`decode` turns tokens back into text (UTF-8, invalid bytes
    replaced).
    """

    vocab_size = 256

    def __init__(self, path: str, *, val_fraction: float = 0.1):
        with open(path, "rb") as f:
            raw = f.read()
        if len(raw) < 64:
            raise ValueError(f"TextSource: {path} has {len(raw)} bytes; need at least 64")
        self.path = path
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        cut = int(len(data) * (1.0 - val_fraction))
        self.train_data, self.val_data = data[:cut], data[cut:]

    def __repr__(self) -> str:
        return f"TextSource({self.path!r}: {len(self.train_data)} train / {len(self.val_data)} val bytes)"

    def sample(self, batch: int, length: int, *, generator: Optional[torch.Generator] = None,
               split: str = "train") -> torch.Tensor:
        """``[batch, length]`` int64 windows of the ``split`` part (``"train"`` or ``"val"``)."""
        data = self.train_data if split == "train" else self.val_data
        if len(data) < length + 1:
            raise ValueError(f"TextSource: the {split} split has {len(data)} bytes, fewer than length + 1 = {length + 1}")
        starts = torch.randint(len(data) - length + 1, (batch,), generator=generator)
        return torch.stack([data[s:s + length] for s in starts.tolist()])

    @staticmethod
    def decode(tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# ==============================================================================================
# training, evaluation, checkpoints
# ==============================================================================================


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate(model: CausalLM, source, *, batches: int = 4, batch_size: int = 32, seq_len: int = 128,
             seed: int = 1234, split: str = "val") -> float:
    """Mean :meth:`CausalLM.loss` over ``batches`` batches drawn with a fixed ``seed``
    (the same batches on every call), in eval mode."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    device = _device_of(model)
    total = 0.0
    for _ in range(batches):
        tokens = source.sample(batch_size, seq_len, generator=g, split=split).to(device)
        total += float(model.loss(tokens))
    model.train(was_training)
    return total / batches


def train(
    model: CausalLM,
    source,
    steps: int,
    *,
    batch_size: int = 32,
    seq_len: int = 128,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    warmup: Optional[int] = None,
    grad_clip: Optional[float] = 1.0,
    seed: int = 0,
    optimizer: Optional[torch.optim.Optimizer] = None,
    start_step: int = 0,
    progress: bool = True,
    callback: Optional[Callable[[int, float], None]] = None,
) -> list[float]:
    """Train ``model`` with AdamW on next-token loss; returns the per-step training losses.

    Each step draws ``[batch_size, seq_len]`` tokens from ``source.sample`` (a generator seeded
    with ``seed + start_step``, so a resumed run draws new batches), moves them to the model's
    device, and takes one step.  The learning rate ramps linearly over ``warmup`` steps
    (default ``min(100, steps // 10)``; counted from step 0, so a resumed run past it stays at
    ``lr``) and then stays constant.  Gradients are clipped to norm ``grad_clip`` (None: no
    clipping).  ``optimizer``: continue with this one (e.g. from :func:`load_checkpoint`);
    default a fresh AdamW.  ``progress``: a tqdm bar with the running loss.
    ``callback(step, loss)`` runs after every step.
    """
    from tqdm.auto import tqdm

    if seq_len > model.config.max_len + 1:
        raise ValueError(f"train: seq_len={seq_len} exceeds max_len + 1 = {model.config.max_len + 1}")
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warmup = min(100, steps // 10) if warmup is None else warmup
    device = _device_of(model)
    g = torch.Generator().manual_seed(seed + start_step)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(start_step, start_step + steps), desc="train", disable=not progress,
               mininterval=0.5, dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup) if warmup else lr
        tokens = source.sample(batch_size, seq_len, generator=g).to(device)
        loss = model.loss(tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        value = float(loss.detach())
        losses.append(value)
        if progress and (step - start_step) % 10 == 0:
            window = losses[-50:]
            bar.set_postfix(loss=f"{sum(window) / len(window):.4f}")
        if callback is not None:
            callback(step, value)
    bar.close()
    model.eval()
    return losses


def save_checkpoint(path: str, model: CausalLM, *, optimizer: Optional[torch.optim.Optimizer] = None,
                    step: int = 0, losses: Optional[Sequence[float]] = None, **extra) -> None:
    """Write ``model`` (config + weights), optionally the optimizer state, the step count, the
    loss history and any plain-data ``extra`` to ``path`` (``torch.save``; parent folders
    are created)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    state = {
        "format": CHECKPOINT_FORMAT,
        "config": model.config.to_dict(),
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": int(step),
        "losses": [float(x) for x in (losses or [])],
        "extra": extra,
    }
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str, *, device=None, backend: Optional[str] = None, lr: float = 3e-3,
                    weight_decay: float = 0.01) -> tuple[CausalLM, dict]:
    """Read a :func:`save_checkpoint` file: ``(model, info)``.

    ``model`` is a :class:`CausalLM` with the saved config and weights, on ``device`` (default
    CPU), in eval mode, with attnkit ``backend``.  ``info`` has ``"step"``, ``"losses"``,
    ``"extra"``, ``"config"`` and ``"optimizer"``: an AdamW over the model's parameters with
    the saved state loaded (``lr`` / ``weight_decay`` for its param groups until the state
    sets them), or None when none was saved.  Reads with ``torch.load(weights_only=True)``.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"load_checkpoint: {path} is not an attnkit.models checkpoint ({CHECKPOINT_FORMAT})")
    model = CausalLM(ModelConfig(**state["config"]), backend=backend)
    model.load_state_dict(state["model"])
    if device is not None:
        model.to(device)
    model.eval()
    optimizer = None
    if state.get("optimizer") is not None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        optimizer.load_state_dict(state["optimizer"])
    info = {"step": state["step"], "losses": state["losses"], "extra": state["extra"],
            "config": state["config"], "optimizer": optimizer}
    return model, info


# ==============================================================================================
# python -m attnkit train
# ==============================================================================================


def _plot(path: str, losses: Sequence[float], *, evals: Sequence[tuple[int, float]] = (),
          floor: Optional[float] = None, uniform: Optional[float] = None,
          levels: Sequence[tuple[str, float]] = (), title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, lw=0.8, label="train (per step)")
    w = max(1, len(losses) // 50)
    if w > 1:
        smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, color="tab:blue", lw=1.6, label=f"train (mean of {w})")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="tab:orange", ms=4, label="held out")
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"entropy rate {floor:.3f}")
    for (label, value), style in zip(levels, ("-.", (0, (5, 5)), (0, (1, 3)))):
        ax.axhline(value, color="tab:green", ls=style, lw=1, label=f"{label} {value:.3f}")
    if uniform is not None:
        ax.axhline(uniform, color="gray", ls=":", lw=1, label=f"uniform ln V = {uniform:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m attnkit train",
        description="Train attnkit's reference causal LM (attnkit.models.CausalLM) on a synthetic "
                    "order-k Markov source or a text file (byte-level). Writes OUT/loss.png, "
                    "OUT/checkpoint.pt and OUT/losses.json.",
    )
    p.add_argument("--data", default="markov", help="'markov' (default) or the path of a text file")
    p.add_argument("--vocab", type=int, default=16, help="markov: alphabet size (default 16)")
    p.add_argument("--order", type=int, default=2, help="markov: Markov order (default 2)")
    p.add_argument("--attention", default="softmax",
                   help="one kind for every layer or a comma list, one per layer: softmax, linear, "
                        "sparse, hopfield (default softmax)")
    p.add_argument("--positions", choices=("rotary", "learned"), default="rotary")
    p.add_argument("--layers", type=int, default=None, help="default: 2, or the length of --attention's list")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2,
                   help="peak AdamW learning rate (default 1e-2, for the small default model)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=0, help="held-out loss every K steps (default: 10 points)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda when available, else cpu")
    p.add_argument("--backend", default=None, help="attnkit backend for every attention call (default: attnkit's)")
    p.add_argument("--out", default=os.path.join("bench", "out", "train"), help="output folder (default bench/out/train)")
    p.add_argument("--checkpoint", default=None, help="checkpoint to write (default OUT/checkpoint.pt)")
    p.add_argument("--resume", default=None, help="continue from this checkpoint (its architecture; optimizer state too)")
    p.add_argument("--sample", type=int, default=200, help="text data: print this many generated bytes at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m attnkit train [options]`` (``--help`` lists them)."""
    args = _parser().parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.stderr.write("python -m attnkit train: --device cuda, but torch sees no CUDA device\n")
            return 2
        device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.data == "markov":
        source = MarkovSource(args.vocab, args.order, seed=args.seed)
    elif os.path.isfile(args.data):
        source = TextSource(args.data)
    else:
        sys.stderr.write(f"python -m attnkit train: --data must be 'markov' or a file; {args.data!r} is neither\n")
        return 2

    optimizer, start, history = None, 0, []
    if args.resume:
        model, info = load_checkpoint(args.resume, device=device, backend=args.backend, lr=args.lr)
        optimizer, start, history = info["optimizer"], info["step"], list(info["losses"])
        if model.config.vocab_size != source.vocab_size:
            sys.stderr.write(f"python -m attnkit train: the checkpoint's vocab_size {model.config.vocab_size} "
                             f"does not match the data's {source.vocab_size}\n")
            return 2
    else:
        kinds = [k.strip() for k in args.attention.split(",") if k.strip()]
        layers = args.layers if args.layers is not None else (len(kinds) if len(kinds) > 1 else 2)
        attention = kinds[0] if len(kinds) == 1 else kinds
        try:
            config = ModelConfig(vocab_size=source.vocab_size, d_model=args.d_model, n_layers=layers,
                                 n_heads=args.heads, max_len=args.seq_len, attention=attention,
                                 positions=args.positions, dropout=args.dropout)
        except ValueError as exc:
            sys.stderr.write(f"python -m attnkit train: {exc}\n")
            return 2
        model = CausalLM(config, backend=args.backend).to(device)
    seq_len = min(args.seq_len, model.config.max_len) + 1  # +1: N inputs predict N targets

    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    eval_every = args.eval_every or max(1, args.steps // 10)
    evals: list[tuple[int, float]] = []
    eval_kw = dict(batches=2, batch_size=args.batch_size, seq_len=seq_len)
    evals.append((start, evaluate(model, source, **eval_kw)))

    def on_step(step, _loss):
        if (step + 1 - start) % eval_every == 0 or step + 1 == start + args.steps:
            evals.append((step + 1, evaluate(model, source, **eval_kw)))

    print(f"attnkit train: {model.num_parameters():,} parameters, layers {model.config.layer_kinds}, "
          f"{model.config.positions} positions, data {source!r}, device {device}"
          + (f", resumed at step {start}" if args.resume else ""))
    t0 = time.perf_counter()
    losses = train(model, source, args.steps, batch_size=args.batch_size, seq_len=seq_len, lr=args.lr,
                   seed=args.seed, optimizer=optimizer, start_step=start, progress=not args.quiet,
                   callback=on_step)
    elapsed = time.perf_counter() - t0
    history += losses

    out = args.out
    os.makedirs(out, exist_ok=True)
    ckpt = args.checkpoint or os.path.join(out, "checkpoint.pt")
    save_checkpoint(ckpt, model, optimizer=optimizer, step=start + args.steps, losses=history,
                    data=args.data)
    floor = source.entropy_rate() if isinstance(source, MarkovSource) else None
    levels = []
    if isinstance(source, MarkovSource):  # the best losses with less context than the source has
        levels = [(f"best with {c} symbol{'s' if c != 1 else ''} of context", source.entropy(c))
                  for c in range(source.order - 1, -1, -1)]
    uniform = math.log(source.vocab_size)
    title = (f"attnkit.models.CausalLM {model.config.layer_kinds}, {model.config.positions}; "
             f"data {args.data}")
    png = os.path.join(out, "loss.png")
    _plot(png, history, evals=evals, floor=floor, uniform=uniform, levels=levels, title=title)
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump({"train": history, "eval": evals, "entropy_rate": floor, "uniform": uniform,
                   "levels": levels,
                   "config": model.config.to_dict()}, f)

    print(f"steps {start}..{start + args.steps} in {elapsed:.1f} s; held-out loss {evals[0][1]:.4f} -> "
          f"{evals[-1][1]:.4f} nats (uniform ln V = {uniform:.4f}"
          + (f", entropy rate = {floor:.4f})" if floor is not None else ")"))
    if isinstance(source, TextSource) and args.sample > 0:
        prompt = source.sample(1, min(16, seq_len - 1), split="val").to(device)
        text = source.decode(model.generate(prompt, args.sample, temperature=0.8)[0].tolist())
        print("sample:", repr(text))
    print(f"wrote {png}, {ckpt}, {os.path.join(out, 'losses.json')}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

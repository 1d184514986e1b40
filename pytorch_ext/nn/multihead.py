"""``attnkit.nn.MultiheadAttention``: a drop-in for :class:`torch.nn.MultiheadAttention` that runs
on :func:`attnkit.softmax_attention` (so on attnkit's fused kernels, never forming the N × S
attention weights).

Same constructor arguments (less ``add_bias_kv`` / ``add_zero_attn``), same parameters with the
same names and shapes, so ``load_state_dict`` of a torch module's ``state_dict()`` works both
ways, and the same forward arguments and mask conventions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .._validation import check_dense
from ..ops.softmax import softmax_attention

_NAME = "attnkit.nn.MultiheadAttention"


def _mask_kind(name: str, mask: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{_NAME}: {name} must be a torch.Tensor or None; got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{_NAME}: {name} must be bool or floating point; got {str(mask.dtype).replace('torch.', '')}"
        )


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attnkit mask (bool True = attend, or floating = added) as an additive one."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def _merge(a: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype):
    """Both masks at once (attnkit convention): AND of two bool masks, else the sum of their
    additive forms (torch's MHA merges masks of mixed kinds the same way)."""
    if a is None or b is None:
        return a if b is None else b
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    return _as_additive(a, dtype) + _as_additive(b, dtype)


class MultiheadAttention(nn.Module):
    r"""Multi-head attention, a drop-in for :class:`torch.nn.MultiheadAttention`.

    ``out = out_proj(concat_h softmax_attention(q W_q^h, k W_k^h, v W_v^h))`` with head dim
    ``embed_dim // num_heads`` and scale ``1 / sqrt(head_dim)``, computed by
    :func:`attnkit.softmax_attention` (``backend`` chooses its backend; None = its default).

    Args:
        embed_dim: E, the model dim (query's last dim and the output's).
        num_heads: heads; must divide ``embed_dim``.
        dropout: attention-probability dropout, applied in training mode only.
        bias: biases on the input and output projections.
        batch_first: inputs and output are ``[batch, seq, feature]`` instead of
            ``[seq, batch, feature]``.
        kdim, vdim: key's and value's feature dims (default ``embed_dim``).  When either
            differs, the input projection is three matrices ``q_proj_weight`` ``[E, E]``,
            ``k_proj_weight`` ``[E, kdim]``, ``v_proj_weight`` ``[E, vdim]`` (else one
            ``in_proj_weight`` ``[3E, E]``), exactly like torch's module.
        device, dtype: of the parameters.
        backend: keyword only; passed to :func:`attnkit.softmax_attention`.

    Parameters (torch's names and shapes): ``in_proj_weight`` or ``q/k/v_proj_weight``,
    ``in_proj_bias`` ``[3E]`` (when ``bias``), ``out_proj`` (a Linear E → E).  Initialized like
    torch's (xavier-uniform projections, zero biases).

    Not supported: ``add_bias_kv``, ``add_zero_attn``, and ``need_weights=True`` (the N × S
    attention weights are never formed).

    Example::

        >>> ref = torch.nn.MultiheadAttention(64, 8, batch_first=True)
        >>> mha = attnkit.nn.MultiheadAttention(64, 8, batch_first=True)
        >>> mha.load_state_dict(ref.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(2, 10, 64)
        >>> out, weights = mha(x, x, x)
        >>> out.shape, weights
        (torch.Size([2, 10, 64]), None)
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        device=None,
        dtype=None,
        *,
        backend: str | None = None,
    ) -> None:
        if not isinstance(embed_dim, int) or not isinstance(num_heads, int) or embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"{_NAME}: embed_dim and num_heads must be positive ints; got embed_dim={embed_dim!r}, "
                f"num_heads={num_heads!r}"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"{_NAME}: embed_dim must be divisible by num_heads; got embed_dim={embed_dim}, "
                f"num_heads={num_heads}"
            )
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"{_NAME}: dropout must be in [0, 1); got {dropout!r}")
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.backend = backend

        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        # torch's class for this Linear (quantization tooling treats it specially); same state.
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        # torch's module has these attributes; code that inspects them keeps working.
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if not self._qkv_same_embed_dim:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        parts.append(f"batch_first={self.batch_first}")
        if self.backend is not None:
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    # ------------------------------------------------------------------------------------------

    def _projections(self, query, key, value):
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _check_inputs(self, query, key, value):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{_NAME}: {name} must be a torch.Tensor; got {type(x).__name__}")
            check_dense(_NAME, name, x)
        if query.dim() not in (2, 3):
            raise ValueError(
                f"{_NAME}: query must be 3-D (batched) or 2-D (unbatched); got shape {tuple(query.shape)}"
            )
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"{_NAME}: key and value must have query's rank ({query.dim()}-D); got key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}"
            )
        for name, x, want in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if x.shape[-1] != want:
                raise ValueError(
                    f"{_NAME}: {name}'s last dim must be {want}; got shape {tuple(x.shape)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"{_NAME}: key and value must agree on sequence length and batch; got key "
                f"{tuple(key.shape)}, value {tuple(value.shape)}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        r"""Attention of ``query`` over ``key`` / ``value``.

        Args:
            query: ``[L, N, E]`` (``[N, L, E]`` with ``batch_first``), or ``[L, E]`` unbatched.
            key: ``[S, N, kdim]`` (``[N, S, kdim]``), or ``[S, kdim]``.
            value: ``[S, N, vdim]`` (``[N, S, vdim]``), or ``[S, vdim]``.
            key_padding_mask: ``[N, S]`` (``[S]`` unbatched); bool True = this key is padding
                (ignored), or floating (added to the scores of that key).
            need_weights: must be False (the default here; torch's default is True).  The
                attention weights are never formed, so True raises ValueError.
            attn_mask: ``[L, S]`` or ``[N * num_heads, L, S]`` (``[num_heads, L, S]``
                unbatched); bool True = NOT allowed to attend (torch's convention, the opposite
                of :func:`attnkit.softmax_attention`'s), or floating (added to the scores).
            average_attn_weights: accepted for compatibility; unused (no weights).
            is_causal: causal attention, key j visible to query i iff j <= i (top-left).  Like
                torch's module, with ``attn_mask`` given it is a hint that ``attn_mask`` *is* the
                causal mask: without ``key_padding_mask`` the causal rule is used and
                ``attn_mask`` ignored; with ``key_padding_mask``, ``attn_mask`` is used.  Unlike
                torch's, ``attn_mask`` may be None (the causal mask is implied).

        Both masks are merged: two bool masks by AND-ing what they allow, otherwise by adding
        their additive forms (-inf where a bool mask forbids).  A query row with no key left
        gives zeros (torch's module gives NaN there).

        Returns:
            ``(out, None)``: out ``[L, N, E]`` (``[N, L, E]`` with ``batch_first``, ``[L, E]``
            unbatched) in the parameters' dtype.
        """
        if need_weights:
            raise ValueError(
                f"{_NAME}: need_weights=True is not supported: attnkit never forms the N x S "
                "attention weights; pass need_weights=False (torch's default is True)"
            )
        self._check_inputs(query, key, value)
        batched = query.dim() == 3
        if batched:
            if not self.batch_first:
                query, key, value = (x.transpose(0, 1) for x in (query, key, value))
            if key.shape[0] != query.shape[0]:
                raise ValueError(
                    f"{_NAME}: query and key must have the same batch size; got {query.shape[0]} "
                    f"and {key.shape[0]}"
                )
        else:
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
        batch, tgt_len, _ = query.shape
        src_len = key.shape[1]
        heads, head_dim = self.num_heads, self.head_dim
        dtype = query.dtype

        # --- masks, converted to attnkit's convention (bool True = attend) on [B, H, L, S] ---
        pad = None
        if key_padding_mask is not None:
            _mask_kind("key_padding_mask", key_padding_mask)
            want = (batch, src_len) if batched else (src_len,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(
                    f"{_NAME}: key_padding_mask must have shape {list(want)} "
                    f"({'[N, S]' if batched else '[S]'}); got {list(key_padding_mask.shape)}"
                )
            pad = key_padding_mask.reshape(batch, 1, 1, src_len)
            pad = ~pad if pad.dtype == torch.bool else pad
        use_causal = bool(is_causal) and (attn_mask is None or pad is None)
        mask = None
        if attn_mask is not None and not use_causal:
            _mask_kind("attn_mask", attn_mask)
            shapes = [(tgt_len, src_len), (batch * heads, tgt_len, src_len)]
            if tuple(attn_mask.shape) not in shapes:
                raise ValueError(
                    f"{_NAME}: attn_mask must have shape [L, S] = {list(shapes[0])} or "
                    f"[N * num_heads, L, S] = {list(shapes[1])}; got {list(attn_mask.shape)}"
                )
            mask = attn_mask.reshape(-1, heads, tgt_len, src_len) if attn_mask.dim() == 3 else attn_mask
            mask = ~mask if mask.dtype == torch.bool else mask
        if use_causal and pad is not None:
            # softmax_attention takes is_causal or a mask, not both: fold the causal rule in.
            mask = torch.ones(tgt_len, src_len, dtype=torch.bool, device=query.device).tril()
            use_causal = False
        mask = _merge(mask, pad, dtype)

        # --- projections and heads: [B, L, E] -> [B, H, L, head_dim] (views, no copies) ---
        q, k, v = self._projections(query, key, value)
        # (unflatten splits the feature dim: a view for any strides of the batch / seq dims)
        q, k, v = (x.unflatten(-1, (heads, head_dim)).transpose(1, 2) for x in (q, k, v))
        out = softmax_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=use_causal, backend=self.backend,
        )
        out = self.out_proj(out.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim))
        if not batched:
            return out.squeeze(0), None
        return (out if self.batch_first else out.transpose(0, 1)), None

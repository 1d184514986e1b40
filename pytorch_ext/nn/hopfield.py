r"""Hopfield layers: :class:`Hopfield`, :class:`HopfieldPooling`, :class:`HopfieldLayer`.

The interface of the ``hopfield-layers`` package (Ramsauer et al., "Hopfield Networks is All You
Need", 2020), running on :func:`attnkit.hopfield_update` (the modern Hopfield update
ξ ← softmax(β ξ Kᵀ) K with a final read-out through the projected pattern projections).

What a :class:`Hopfield` layer computes, per head h (``B`` batch, ``S`` state patterns,
``N`` stored patterns)::

    R = LayerNorm_state(state)        [B, S, input_size]          (when normalize_state_pattern)
    Y = LayerNorm_stored(stored)      [B, N, stored_pattern_size]
    P = LayerNorm_proj(projection)    [B, N, pattern_projection_size]
    ξ = R W_Q^h,  K = Y W_K^h,  V = P W_V^h          (head dims hidden_size, hidden_size, pattern_size)
    repeat update_steps_max times:  ξ ← softmax(β ξ Kᵀ + mask) K     (early stop, see below)
    Z^h = softmax(β ξ Kᵀ + mask) V                  (dropout on these probabilities in training)
    out = concat_h(Z^h) W_O                         [B, S, output_size]

with β = ``scaling`` (default ``1/√hidden_size``), ``hidden_size`` defaulting to
``input_size // num_heads`` and ``pattern_size`` to ``hidden_size``, ``output_size`` to
``input_size``.  Without masks and dropout this whole retrieval is one
``attnkit.hopfield_update(ξ, K, beta=β, steps=update_steps_max + 1, values=V,
tol=update_steps_eps)`` call.  With a mask (``stored_pattern_padding_mask`` or
``association_mask``: :func:`attnkit.hopfield_update` takes no mask) each update runs through
:func:`attnkit.softmax_attention` with keys = values = K (and the read-out with values V) and the
same early-stop rule; with dropout active (training, ``dropout > 0``) the updates run on
``hopfield_update`` and the final read-out through ``softmax_attention(dropout_p=dropout)``.

Differences from hopfield-layers
--------------------------------
- **Early stop.**  hopfield-layers stops a *head* (for the whole batch) when the L2 norm of the
  change of its S×N association matrix, maxed over the batch, is ≤ ``update_steps_eps``.  Here
  each *state row* is frozen on its own when max_d |ξ_new − ξ_old| ≤ ``update_steps_eps`` (the
  ``tol`` rule of :func:`attnkit.hopfield_update`), with no association matrix formed.  Results
  agree whenever no early stop triggers (e.g. ``update_steps_eps=0``) or all rows converged.
- **update_steps_max < 0** ("iterate until convergence", unbounded) is not supported
  (NotImplementedError): give a bound.
- **Fully masked rows** (a state pattern that may associate with no stored pattern) give a zero
  retrieval (then the output projection's bias), not NaN.
- **No stored patterns** (N = 0) gives the same zero retrieval instead of an error.
- **scaling** must be a real number (one β for all heads); a per-head tensor is not supported.
- **Parameters.**  Projections are ``nn.Linear`` modules ``state_projection``,
  ``stored_projection``, ``pattern_projection_layer``, ``out_projection`` (each with its own
  weight, never a packed ``in_proj_weight``), the learned bias patterns ``bias_stored`` /
  ``bias_projection``, and layer norms ``norm_stored_pattern``, ``norm_state_pattern``,
  ``norm_pattern_projection``: a hopfield-layers ``state_dict`` does not load as is.  Initial
  values follow the same rules (Xavier-uniform projection weights, zero biases, Xavier-normal
  bias patterns, N(0, 1) pooling / lookup weights).
- **Masks.**  Same conventions as hopfield-layers (and old ``nn.MultiheadAttention``):
  ``stored_pattern_padding_mask`` [B, N] bool, True = padding (ignored);
  ``association_mask`` [S, N] or [B·num_heads, S, N], bool True = *not* allowed, or floating
  (added to the scores).  Note this is the opposite of :func:`attnkit.softmax_attention`'s bool
  convention (True = attend).
- **Static patterns** (``*_as_static=True``) are used as they come (after their layer norm, when
  enabled): a static state or stored pattern must have ``num_heads * hidden_size`` features,
  a static pattern projection ``num_heads * pattern_size``.  ``input_size`` is always required
  (it names the state patterns' size); the all-static "no projection at all" mode of
  hopfield-layers, with ``input_size=None``, is not.
- **HopfieldPooling** returns ``[B, quantity * output_size]`` for both ``batch_first`` values
  (hopfield-layers flattens from dim 1 whatever the layout).
- **Not supported** (NotImplementedError when set): ``normalize_hopfield_space=True``,
  ``pattern_projection_as_connected=True``, ``association_activation`` (any value but None),
  ``update_steps_max < 0``, a tensor ``scaling``.  There is no ``return_raw_associations`` /
  ``get_association_matrix`` (the fused update never forms the association matrix); compute
  it from the projections if needed.
- **concat_bias_pattern** with a static stored pattern or pattern projection raises ValueError
  (hopfield-layers asserts the same).
- **Mask dtypes.**  ``stored_pattern_padding_mask`` must be bool (hopfield-layers also takes a
  deprecated uint8 mask); a floating ``association_mask`` is cast to the inputs' dtype.
- **Extras.**  A keyword-only ``backend`` (passed to the attnkit ops); ``scaling``,
  ``update_steps_max``, ``update_steps_eps`` and ``batch_first`` are plain attributes that may be
  changed between calls.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import check_dense
from ..ops.hopfield import hopfield_update
from ..ops.softmax import softmax_attention

__all__ = ["Hopfield", "HopfieldPooling", "HopfieldLayer"]


def _positive_int(fn, name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
    if value < 1:
        raise ValueError(f"{fn}: {name} must be >= 1; got {value}")


def _layer_norm(size, enabled, affine, eps):
    return nn.LayerNorm(size, eps=eps, elementwise_affine=affine) if enabled else None


class Hopfield(nn.Module):
    r"""A modern Hopfield association layer (the ``Hopfield`` module of hopfield-layers).

    See the module docstring (:mod:`attnkit.nn.hopfield`) for the computation and the section
    "Differences from hopfield-layers".

    Args:
        input_size: features of the state patterns (required).
        hidden_size: per-head dim of the association (Hopfield) space; default
            ``input_size // num_heads`` (then ``num_heads`` must divide ``input_size``).
        output_size: features of the output; default ``input_size``.
        pattern_size: per-head dim of the projected pattern projections; default ``hidden_size``.
        num_heads: parallel association heads.
        scaling: β, the inverse temperature; default ``1 / sqrt(hidden_size)``.
        update_steps_max: updates of the state before the read-out (0: one retrieval only).
        update_steps_eps: early-stop threshold of a state row (see the differences).
        normalize_*: layer norm of the raw stored / state / projection patterns (``_affine``:
            with learnable affine parameters; ``_eps``: its epsilon).
        stored_pattern_as_static, state_pattern_as_static, pattern_projection_as_static: use that
            input without a projection.
        stored_pattern_size, pattern_projection_size: features of the stored patterns / pattern
            projections; default ``input_size``.
        batch_first: inputs and output are ``[B, L, F]`` (else ``[L, B, F]``).
        dropout: dropout probability on the final association probabilities (training only).
        input_bias: biases in the three input projections.
        concat_bias_pattern: append one learned stored pattern / projection (per head).
        add_zero_association: append one all-zero stored pattern / projection.
        disable_out_projection: no output projection; output has ``num_heads * pattern_size``
            features.
        backend: passed to :func:`attnkit.hopfield_update` and :func:`attnkit.softmax_attention`
            (None: their default).

    Forward: ``layer(input, stored_pattern_padding_mask=None, association_mask=None)``, where
    ``input`` is one tensor (used as stored, state and projection patterns) or a tuple
    ``(stored_pattern, state_pattern, pattern_projection)``; returns ``[B, S, output_size]``
    (``[S, B, output_size]`` when not ``batch_first``).

    Example::

        >>> layer = attnkit.nn.Hopfield(input_size=32, num_heads=4, update_steps_max=2)
        >>> x = torch.randn(8, 10, 32)                      # [batch, patterns, features]
        >>> layer(x).shape
        torch.Size([8, 10, 32])
        >>> stored, queries = torch.randn(8, 50, 32), torch.randn(8, 3, 32)
        >>> layer((stored, queries, stored)).shape
        torch.Size([8, 3, 32])
    """

    _NAME = "attnkit.nn.Hopfield"

    def __init__(
        self,
        input_size: int | None = None,
        hidden_size: int | None = None,
        output_size: int | None = None,
        pattern_size: int | None = None,
        num_heads: int = 1,
        scaling: float | None = None,
        update_steps_max: int = 0,
        update_steps_eps: float = 1e-4,
        normalize_stored_pattern: bool = True,
        normalize_stored_pattern_affine: bool = True,
        normalize_stored_pattern_eps: float = 1e-5,
        normalize_state_pattern: bool = True,
        normalize_state_pattern_affine: bool = True,
        normalize_state_pattern_eps: float = 1e-5,
        normalize_pattern_projection: bool = True,
        normalize_pattern_projection_affine: bool = True,
        normalize_pattern_projection_eps: float = 1e-5,
        normalize_hopfield_space: bool = False,
        normalize_hopfield_space_affine: bool = False,
        normalize_hopfield_space_eps: float = 1e-5,
        stored_pattern_as_static: bool = False,
        state_pattern_as_static: bool = False,
        pattern_projection_as_static: bool = False,
        pattern_projection_as_connected: bool = False,
        stored_pattern_size: int | None = None,
        pattern_projection_size: int | None = None,
        batch_first: bool = True,
        association_activation: str | None = None,
        dropout: float = 0.0,
        input_bias: bool = True,
        concat_bias_pattern: bool = False,
        add_zero_association: bool = False,
        disable_out_projection: bool = False,
        *,
        backend: str | None = None,
    ):
        super().__init__()
        fn = self._NAME
        unsupported = []
        if normalize_hopfield_space:
            unsupported.append("normalize_hopfield_space=True")
        if pattern_projection_as_connected:
            unsupported.append("pattern_projection_as_connected=True")
        if association_activation is not None:
            unsupported.append(f"association_activation={association_activation!r}")
        if isinstance(scaling, torch.Tensor):
            unsupported.append("a tensor scaling (per-head β)")
        if isinstance(update_steps_max, int) and not isinstance(update_steps_max, bool) and update_steps_max < 0:
            unsupported.append("update_steps_max < 0 (unbounded iteration)")
        if unsupported:
            raise NotImplementedError(
                f"{fn}: not supported: {', '.join(unsupported)}.  Unsupported options: "
                "normalize_hopfield_space, pattern_projection_as_connected, association_activation, "
                "update_steps_max < 0, tensor scaling (see 'Differences from hopfield-layers')"
            )
        if input_size is None:
            raise ValueError(f"{fn}: input_size is required (the features of the state patterns)")
        _positive_int(fn, "input_size", input_size)
        _positive_int(fn, "num_heads", num_heads)
        _positive_int(fn, "hidden_size", hidden_size, allow_none=True)
        _positive_int(fn, "output_size", output_size, allow_none=True)
        _positive_int(fn, "pattern_size", pattern_size, allow_none=True)
        _positive_int(fn, "stored_pattern_size", stored_pattern_size, allow_none=True)
        _positive_int(fn, "pattern_projection_size", pattern_projection_size, allow_none=True)
        if isinstance(update_steps_max, bool) or not isinstance(update_steps_max, int):
            raise TypeError(f"{fn}: update_steps_max must be an int; got {update_steps_max!r}")
        for name, value in (("update_steps_eps", update_steps_eps), ("dropout", dropout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
                raise ValueError(f"{fn}: {name} must be a finite real >= 0; got {value!r}")
        if dropout >= 1:
            raise ValueError(f"{fn}: dropout must be in [0, 1); got {dropout}")
        if scaling is not None and (isinstance(scaling, bool) or not isinstance(scaling, (int, float))
                                    or not (0 < scaling < math.inf)):
            raise ValueError(f"{fn}: scaling must be a finite real > 0 or None; got {scaling!r}")
        if hidden_size is None and input_size % num_heads != 0:
            raise ValueError(
                f"{fn}: num_heads must divide input_size when hidden_size is None; "
                f"got input_size {input_size}, num_heads {num_heads}"
            )
        if concat_bias_pattern and (stored_pattern_as_static or pattern_projection_as_static):
            raise ValueError(f"{fn}: concat_bias_pattern cannot be combined with a static stored pattern "
                             "or pattern projection")

        self.input_size = input_size
        self.num_heads = num_heads
        self.hidden_size = hidden_size if hidden_size is not None else input_size // num_heads
        self.pattern_size = pattern_size if pattern_size is not None else self.hidden_size
        self.stored_pattern_dim = stored_pattern_size if stored_pattern_size is not None else input_size
        self.state_pattern_dim = input_size
        self.pattern_projection_dim = (
            pattern_projection_size if pattern_projection_size is not None else input_size)
        self.disable_out_projection = disable_out_projection
        self.output_size = (num_heads * self.pattern_size if disable_out_projection
                            else (output_size if output_size is not None else input_size))
        self.scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(self.hidden_size)
        self.update_steps_max = update_steps_max
        self.update_steps_eps = float(update_steps_eps)
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.backend = backend
        self.stored_pattern_as_static = stored_pattern_as_static
        self.state_pattern_as_static = state_pattern_as_static
        self.pattern_projection_as_static = pattern_projection_as_static

        assoc = num_heads * self.hidden_size
        proj = num_heads * self.pattern_size
        for name, static, size, need, what in (
            ("stored pattern", stored_pattern_as_static, self.stored_pattern_dim, assoc, "hidden_size"),
            ("state pattern", state_pattern_as_static, self.state_pattern_dim, assoc, "hidden_size"),
            ("pattern projection", pattern_projection_as_static, self.pattern_projection_dim, proj, "pattern_size"),
        ):
            if static and size != need:
                raise ValueError(
                    f"{fn}: a static {name} is used without projection, so it must have "
                    f"num_heads * {what} = {need} features; got {size}"
                )

        self.norm_stored_pattern = _layer_norm(self.stored_pattern_dim, normalize_stored_pattern,
                                               normalize_stored_pattern_affine, normalize_stored_pattern_eps)
        self.norm_state_pattern = _layer_norm(self.state_pattern_dim, normalize_state_pattern,
                                              normalize_state_pattern_affine, normalize_state_pattern_eps)
        self.norm_pattern_projection = _layer_norm(
            self.pattern_projection_dim, normalize_pattern_projection,
            normalize_pattern_projection_affine, normalize_pattern_projection_eps)

        self.state_projection = None if state_pattern_as_static else nn.Linear(self.state_pattern_dim, assoc, bias=input_bias)
        self.stored_projection = None if stored_pattern_as_static else nn.Linear(self.stored_pattern_dim, assoc, bias=input_bias)
        self.pattern_projection_layer = (
            None if pattern_projection_as_static else nn.Linear(self.pattern_projection_dim, proj, bias=input_bias))
        self.out_projection = None if disable_out_projection else nn.Linear(proj, self.output_size)
        if concat_bias_pattern:
            self.bias_stored = nn.Parameter(torch.empty(num_heads, 1, self.hidden_size))
            self.bias_projection = nn.Parameter(torch.empty(num_heads, 1, self.pattern_size))
        else:
            self.register_parameter("bias_stored", None)
            self.register_parameter("bias_projection", None)
        self.add_zero_association = add_zero_association
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.state_projection, self.stored_projection, self.pattern_projection_layer,
                    self.out_projection):
            if lin is not None:
                nn.init.xavier_uniform_(lin.weight)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        for norm in (self.norm_stored_pattern, self.norm_state_pattern, self.norm_pattern_projection):
            if norm is not None:
                norm.reset_parameters()
        if self.bias_stored is not None:
            nn.init.xavier_normal_(self.bias_stored)
            nn.init.xavier_normal_(self.bias_projection)

    # -- forward helpers -------------------------------------------------------------------------

    def _unpack(self, input):
        fn = self._NAME
        if isinstance(input, torch.Tensor):
            stored = state = proj = input
        elif isinstance(input, (tuple, list)) and len(input) == 3:
            stored, state, proj = input
        else:
            raise TypeError(f"{fn}: input must be a tensor or a tuple (stored_pattern, state_pattern, "
                            f"pattern_projection); got {type(input).__name__}"
                            + (f" of length {len(input)}" if isinstance(input, (tuple, list)) else ""))
        for name, x, feat in (("stored_pattern", stored, self.stored_pattern_dim),
                              ("state_pattern", state, self.state_pattern_dim),
                              ("pattern_projection", proj, self.pattern_projection_dim)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a torch.Tensor; got {type(x).__name__}")
            check_dense(fn, name, x)
            if x.dim() != 3:
                layout = "[B, L, F]" if self.batch_first else "[L, B, F]"
                raise ValueError(f"{fn}: {name} must be 3-D {layout}; got shape {tuple(x.shape)}")
            if x.shape[-1] != feat:
                raise ValueError(f"{fn}: {name} must have {feat} features; got shape {tuple(x.shape)}")
        if not self.batch_first:
            stored, state, proj = stored.transpose(0, 1), state.transpose(0, 1), proj.transpose(0, 1)
        if not (stored.shape[0] == state.shape[0] == proj.shape[0]):
            raise ValueError(f"{fn}: stored_pattern, state_pattern and pattern_projection must have the same "
                             f"batch size; got {stored.shape[0]}, {state.shape[0]}, {proj.shape[0]}")
        if stored.shape[1] != proj.shape[1]:
            raise ValueError(f"{fn}: stored_pattern and pattern_projection must hold the same number of patterns; "
                             f"got {stored.shape[1]} and {proj.shape[1]}")
        return stored, state, proj

    def _heads(self, x, proj_layer, norm, head_dim):
        """[B, L, F] -> normalized, projected, [B, H, L, head_dim]."""
        if norm is not None:
            x = norm(x)
        if proj_layer is not None:
            x = proj_layer(x)
        b, n, _ = x.shape
        return x.reshape(b, n, self.num_heads, head_dim).transpose(1, 2)

    def _mask(self, padding, association, b, s, n, n_extra, dtype, device):
        """Both masks as one attnkit mask (bool True = attend, or additive float), broadcastable to
        [B, H, S, N + n_extra], or None."""
        fn = self._NAME
        h = self.num_heads
        parts = []
        if association is not None:
            if not isinstance(association, torch.Tensor):
                raise TypeError(f"{fn}: association_mask must be a torch.Tensor or None; got {type(association).__name__}")
            if association.dtype != torch.bool and not association.is_floating_point():
                raise TypeError(f"{fn}: association_mask must be bool (True = masked out) or floating (added); "
                                f"got {str(association.dtype).replace('torch.', '')}")
            if association.dim() == 2 and tuple(association.shape) == (s, n):
                a = association.view(1, 1, s, n)
            elif association.dim() == 3 and tuple(association.shape) == (b * h, s, n):
                a = association.view(b, h, s, n)
            else:
                raise ValueError(f"{fn}: association_mask must be [S, N] = [{s}, {n}] or "
                                 f"[B * num_heads, S, N] = [{b * h}, {s}, {n}]; got shape {tuple(association.shape)}")
            parts.append(a)
        if padding is not None:
            if not isinstance(padding, torch.Tensor):
                raise TypeError(f"{fn}: stored_pattern_padding_mask must be a torch.Tensor or None; "
                                f"got {type(padding).__name__}")
            if padding.dtype != torch.bool:
                raise TypeError(f"{fn}: stored_pattern_padding_mask must be bool (True = padding); "
                                f"got {str(padding.dtype).replace('torch.', '')}")
            if tuple(padding.shape) != (b, n):
                raise ValueError(f"{fn}: stored_pattern_padding_mask must be [B, N] = [{b}, {n}]; "
                                 f"got shape {tuple(padding.shape)}")
            parts.append(padding.view(b, 1, 1, n))
        if not parts:
            return None
        for p in parts:
            if p.device != device:
                raise ValueError(f"{fn}: masks must be on the inputs' device {device}; got {p.device}")
        if all(p.dtype == torch.bool for p in parts):
            blocked = parts[0] if len(parts) == 1 else parts[0] | parts[1]
            mask = ~blocked  # attnkit convention: True = attend
            if n_extra:  # appended bias / zero patterns are always visible
                mask = torch.cat([mask, mask.new_ones(mask.shape[:-1] + (n_extra,))], dim=-1)
            return mask
        add = None
        for p in parts:
            term = (torch.zeros(p.shape, dtype=dtype, device=device).masked_fill(p, float("-inf"))
                    if p.dtype == torch.bool else p.to(dtype))
            add = term if add is None else add + term
        if n_extra:
            add = torch.cat([add, add.new_zeros(add.shape[:-1] + (n_extra,))], dim=-1)
        return add

    def _retrieve(self, q, k, v, mask):
        steps = self.update_steps_max + 1
        beta, tol = self.scaling, self.update_steps_eps
        drop = self.dropout if self.training else 0.0
        if mask is None and drop == 0.0 and k.shape[2] > 0:
            return hopfield_update(q, k, beta=beta, steps=steps, values=v, tol=tol, backend=self.backend)
        if mask is None and k.shape[2] > 0:
            xi = q if steps == 1 else hopfield_update(q, k, beta=beta, steps=steps - 1, tol=tol, backend=self.backend)
        else:
            # attnkit.hopfield_update has no mask: the masked update through softmax_attention
            # with keys = values = K, and hopfield_update's tol rule (a row whose change is ≤ tol
            # keeps that update and is frozen).
            xi, active = q, None
            for _ in range(steps - 1):
                new = softmax_attention(xi, k, k, attn_mask=mask, scale=beta, backend=self.backend)
                change = (new - xi).abs().amax(dim=-1)
                if active is None:
                    xi, active = new, change > tol
                else:
                    xi = torch.where(active.unsqueeze(-1), new, xi)
                    active = active & (change > tol)
        return softmax_attention(xi, k, v, attn_mask=mask, dropout_p=drop, scale=beta, backend=self.backend)

    def forward(self, input, stored_pattern_padding_mask: torch.Tensor | None = None,
                association_mask: torch.Tensor | None = None) -> torch.Tensor:
        stored, state, proj = self._unpack(input)
        b, s, n = state.shape[0], state.shape[1], stored.shape[1]
        q = self._heads(state, self.state_projection, self.norm_state_pattern, self.hidden_size)
        k = self._heads(stored, self.stored_projection, self.norm_stored_pattern, self.hidden_size)
        v = self._heads(proj, self.pattern_projection_layer, self.norm_pattern_projection, self.pattern_size)
        n_extra = 0
        if self.bias_stored is not None:
            k = torch.cat([k, self.bias_stored.to(k.dtype).expand(b, -1, -1, -1)], dim=2)
            v = torch.cat([v, self.bias_projection.to(v.dtype).expand(b, -1, -1, -1)], dim=2)
            n_extra += 1
        if self.add_zero_association:
            k = torch.cat([k, k.new_zeros(b, self.num_heads, 1, k.shape[-1])], dim=2)
            v = torch.cat([v, v.new_zeros(b, self.num_heads, 1, v.shape[-1])], dim=2)
            n_extra += 1
        mask = self._mask(stored_pattern_padding_mask, association_mask, b, s, n, n_extra, q.dtype, q.device)
        out = self._retrieve(q, k, v, mask)  # [B, H, S, pattern_size]
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.pattern_size)
        if self.out_projection is not None:
            out = self.out_projection(out)
        return out if self.batch_first else out.transpose(0, 1)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, hidden_size={self.hidden_size}, output_size={self.output_size}, "
                f"pattern_size={self.pattern_size}, num_heads={self.num_heads}, scaling={self.scaling:.4g}, "
                f"update_steps_max={self.update_steps_max}, batch_first={self.batch_first}")


# help(attnkit.nn.Hopfield) shows the differences too, not only the module page.
if Hopfield.__doc__ and __doc__:  # (absent under python -OO)
    Hopfield.__doc__ += "\n    " + __doc__[__doc__.index("Differences from hopfield-layers"):].replace("\n", "\n    ")


class _HopfieldWrapper(nn.Module):
    """What :class:`HopfieldPooling` and :class:`HopfieldLayer` share: an inner :class:`Hopfield`
    (``self.hopfield``), its ``batch_first`` and the 3-D input check."""

    def _init_hopfield(self, fn, quantity, input_size, hidden_size, output_size, pattern_size, num_heads,
                       scaling, update_steps_max, update_steps_eps, **kwargs):
        _positive_int(fn, "quantity", quantity)
        self.hopfield = Hopfield(input_size=input_size, hidden_size=hidden_size, output_size=output_size,
                                 pattern_size=pattern_size, num_heads=num_heads, scaling=scaling,
                                 update_steps_max=update_steps_max, update_steps_eps=update_steps_eps, **kwargs)
        self.quantity = quantity

    @property
    def batch_first(self) -> bool:
        return self.hopfield.batch_first

    def _batched(self, w: torch.Tensor, input: torch.Tensor, fn: str, what: str) -> torch.Tensor:
        """``w`` [quantity, size] expanded to the batch of the 3-D ``input`` (after checking it)."""
        if isinstance(input, torch.Tensor):
            check_dense(fn, "input", input)
        if not isinstance(input, torch.Tensor) or input.dim() != 3:
            raise ValueError(f"{fn}: input must be a 3-D tensor of {what}; got "
                             + (f"shape {tuple(input.shape)}" if isinstance(input, torch.Tensor) else type(input).__name__))
        bdim = 0 if self.batch_first else 1
        b = input.shape[bdim]
        w = w.to(input.dtype).unsqueeze(bdim)
        return w.expand(b, -1, -1) if self.batch_first else w.expand(-1, b, -1)


class HopfieldPooling(_HopfieldWrapper):
    r"""Hopfield pooling: ``quantity`` learned state patterns query the input (the stored
    patterns, also the pattern projections), as in hopfield-layers' ``HopfieldPooling``.

    Args:
        input_size, hidden_size, output_size, pattern_size, num_heads, scaling, update_steps_max,
        update_steps_eps: as in :class:`Hopfield`.
        quantity: number of learned state patterns (pooled outputs per sequence).
        trainable: whether the state patterns are learned (``requires_grad``).
        **kwargs: every other :class:`Hopfield` argument (normalizations, static flags,
            ``stored_pattern_size``, ``batch_first``, ``dropout``, ``backend``, ...).

    The learned state patterns, ``pooling_weights`` ``[quantity, F]``, N(0, 1) initialized, have
    ``F = input_size`` (or ``num_heads * hidden_size`` with ``state_pattern_as_static=True``).
    Forward: ``pool(input, stored_pattern_padding_mask=None, association_mask=None)`` with input
    ``[B, N, stored_pattern_size]`` (``[N, B, ...]`` when not ``batch_first``); returns
    ``[B, quantity * output_size]``.

    Example::

        >>> pool = attnkit.nn.HopfieldPooling(input_size=16, quantity=2)
        >>> pool(torch.randn(4, 30, 16)).shape
        torch.Size([4, 32])
    """

    def __init__(self, input_size: int, hidden_size: int | None = None, output_size: int | None = None,
                 pattern_size: int | None = None, num_heads: int = 1, scaling: float | None = None,
                 update_steps_max: int = 0, update_steps_eps: float = 1e-4, quantity: int = 1,
                 trainable: bool = True, **kwargs):
        super().__init__()
        self._init_hopfield("attnkit.nn.HopfieldPooling", quantity, input_size, hidden_size, output_size,
                            pattern_size, num_heads, scaling, update_steps_max, update_steps_eps, **kwargs)
        size = self.hopfield.state_pattern_dim
        self.pooling_weights = nn.Parameter(torch.empty(quantity, size), requires_grad=trainable)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pooling_weights)

    def forward(self, input: torch.Tensor, stored_pattern_padding_mask: torch.Tensor | None = None,
                association_mask: torch.Tensor | None = None) -> torch.Tensor:
        state = self._batched(self.pooling_weights, input, "attnkit.nn.HopfieldPooling", "stored patterns")
        b = state.shape[0 if self.batch_first else 1]
        out = self.hopfield((input, state, input), stored_pattern_padding_mask=stored_pattern_padding_mask,
                            association_mask=association_mask)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out.reshape(b, -1)


class HopfieldLayer(_HopfieldWrapper):
    r"""Hopfield lookup: the input (state patterns) retrieves from ``quantity`` learned stored
    patterns, as in hopfield-layers' ``HopfieldLayer``.

    Args:
        input_size, hidden_size, output_size, pattern_size, num_heads, scaling, update_steps_max,
        update_steps_eps: as in :class:`Hopfield`.
        quantity: number of learned stored patterns.
        lookup_weights_as_separated: learn separate pattern projections (``target_weights``)
            instead of reusing the stored patterns as pattern projections.
        lookup_targets_as_trainable: whether ``target_weights`` are learned (separated only).
        trainable: whether the stored patterns ``lookup_weights`` are learned.
        **kwargs: every other :class:`Hopfield` argument.

    ``lookup_weights`` ``[quantity, stored_pattern_size]`` and ``target_weights``
    ``[quantity, pattern_projection_size]`` (N(0, 1) initialized; with the static flags,
    ``num_heads * hidden_size`` / ``num_heads * pattern_size`` features).  Without separation,
    the stored patterns double as pattern projections, so ``stored_pattern_size`` and
    ``pattern_projection_size`` must agree.  Forward: ``layer(input, stored_pattern_padding_mask=None,
    association_mask=None)`` with input ``[B, S, input_size]``; returns ``[B, S, output_size]``
    (``[S, B, ...]`` when not ``batch_first``); the padding mask, if any, is ``[B, quantity]``.

    Example::

        >>> lookup = attnkit.nn.HopfieldLayer(input_size=16, quantity=50)
        >>> lookup(torch.randn(4, 7, 16)).shape
        torch.Size([4, 7, 16])
    """

    def __init__(self, input_size: int, hidden_size: int | None = None, output_size: int | None = None,
                 pattern_size: int | None = None, num_heads: int = 1, scaling: float | None = None,
                 update_steps_max: int = 0, update_steps_eps: float = 1e-4,
                 lookup_weights_as_separated: bool = False, lookup_targets_as_trainable: bool = True,
                 quantity: int = 1, trainable: bool = True, **kwargs):
        super().__init__()
        fn = "attnkit.nn.HopfieldLayer"
        self._init_hopfield(fn, quantity, input_size, hidden_size, output_size, pattern_size, num_heads,
                            scaling, update_steps_max, update_steps_eps, **kwargs)
        hf = self.hopfield
        if not lookup_weights_as_separated and hf.stored_pattern_dim != hf.pattern_projection_dim:
            raise ValueError(
                f"{fn}: without lookup_weights_as_separated the stored patterns are also the pattern "
                f"projections, so stored_pattern_size and pattern_projection_size must agree; got "
                f"{hf.stored_pattern_dim} and {hf.pattern_projection_dim}")
        self.lookup_weights = nn.Parameter(torch.empty(quantity, hf.stored_pattern_dim), requires_grad=trainable)
        if lookup_weights_as_separated:
            self.target_weights = nn.Parameter(torch.empty(quantity, hf.pattern_projection_dim),
                                               requires_grad=lookup_targets_as_trainable)
        else:
            self.register_parameter("target_weights", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.lookup_weights)
        if self.target_weights is not None:
            nn.init.normal_(self.target_weights)

    def forward(self, input: torch.Tensor, stored_pattern_padding_mask: torch.Tensor | None = None,
                association_mask: torch.Tensor | None = None) -> torch.Tensor:
        fn, what = "attnkit.nn.HopfieldLayer", "state patterns"
        stored = self._batched(self.lookup_weights, input, fn, what)
        targets = stored if self.target_weights is None else self._batched(self.target_weights, input, fn, what)
        return self.hopfield((stored, input, targets), stored_pattern_padding_mask=stored_pattern_padding_mask,
                             association_mask=association_mask)

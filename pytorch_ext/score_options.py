"""Score options of softmax attention (issue 28): sliding window, logit softcap, ALiBi, sinks.

One home for the four keyword arguments of :func:`attnkit.softmax_attention` that change how a
score becomes a probability (named after the peers': FlashAttention's ``window_size``,
``softcap``, ``alibi_slopes``; gpt-oss's ``s_aux`` / FlashAttention-4's ``learnable_sink``):

- ``window=(left, right)`` -- key j is visible to query i (0-based, of N; keys of M) iff
  ``i + M - N - left <= j <= i + M - N + right`` (bottom-right aligned like FlashAttention; -1
  leaves that side unbounded).  Intersected with ``is_causal`` (top-left, j <= i) and the masks.
- ``softcap`` > 0 -- s = softcap · tanh(s / softcap) on s = scale · q·k, before everything else.
- ``alibi_slopes`` float32 [H] or [*batch, H] -- s -= slope_h · |i + M - N - j| after the cap,
  before the masks.
- ``sinks`` float32 [H] -- one more logit per head in each row's softmax denominator, with no
  value: Z_i = Σ_j exp(s_ij) + exp(sink_h), out_i = Σ_j exp(s_ij) / Z_i · v_j, lse_i = log Z_i.

:func:`build` validates them once (before any kernel runs) into a frozen :class:`ScoreOptions`,
or returns None when every option has its default -- the call is then exactly the call without
them (and the public function's fast path never gets here).  The layout code maps it onto the
kernels' ``[B, H, N, D]`` (:meth:`ScoreOptions.to_kernel`), the routing asks which options a
backend runs (:data:`BACKEND_OPTIONS`), and every backend implementation receives it.

Sinks on the kernel backends: the cpu and triton kernels fold them into each row's finish
(before the row is rounded to the inputs' dtype); after the cuda kernels :func:`add_sinks` applies
them -- lse' = logaddexp(lse, sink) and out' = out · exp(lse - lse') (in float32, float64 for
float64 inputs, then cast: a 16-bit row rounded twice).  Either way the kernel's backward given
lse' and out' gives exact dq, dk, dv: the probabilities it recomputes from lse', exp(s - lse'), are
the ones with the sink in the denominator, and its row term D_i = rowsum(dO_i ∘ out'_i) is that
of the sink's softmax too.  The sink's own gradient is
d sink_h = Σ_{b,i} exp(sink_h - lse'_bhi) · (g_bhi - D_bhi), g the lse's gradient (0 if unused).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Optional

import torch

# The options in the order of the public signature (the names of the keyword arguments).
NAMES = ("window", "softcap", "alibi_slopes", "sinks")

# Which options each backend runs (the routing of softmax_attention reads this; a call with an
# option its backend lacks goes to the reference, or raises when the backend was named).  Sinks
# run on every backend: they are applied around the kernel (module docstring).  The C++ CPU and
# the Triton kernels compute window / softcap / ALiBi themselves (forward and backward); the
# CUDA kernels do not yet.
BACKEND_OPTIONS = {
    "reference": frozenset(NAMES),
    "cpu": frozenset(NAMES),
    "triton": frozenset(NAMES),
    "cuda": frozenset({"sinks"}),
}


@dataclass(frozen=True, eq=False)
class ScoreOptions:
    """The validated score options of one call (:func:`build` makes them).

    ``window``: (left, right), each -1 (unbounded) or >= 0; ``softcap``: 0.0 (off) or > 0;
    ``alibi_slopes``: None or float32 [H] / [*batch, H] (the kernels' layout: [B, H], see
    :meth:`to_kernel`); ``sinks``: None or float32 [H].  ``eq=False``: it holds tensors.
    """

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None

    @property
    def names(self) -> tuple[str, ...]:
        """The options that are set, in :data:`NAMES` order."""
        set_ = (self.window != (-1, -1), self.softcap != 0.0, self.alibi_slopes is not None,
                self.sinks is not None)
        return tuple(name for name, on in zip(NAMES, set_) if on)

    @property
    def in_scores(self) -> bool:
        """Whether a kernel must compute some of them in its scores (window, softcap, ALiBi);
        sinks join at the rows' finish (:func:`add_sinks` where a kernel cannot)."""
        return self.window != (-1, -1) or self.softcap != 0.0 or self.alibi_slopes is not None

    def kernel_args(self) -> tuple:
        """``(window_left, window_right, softcap, alibi_slopes)``: the trailing arguments of the
        C++ ops ``attnkit::softmax_fwd`` / ``softmax_bwd`` and of the Triton ops
        ``attnkit::softmax_triton_fwd`` / ``_bwd`` (alibi_slopes float32 [B, H])."""
        return (self.window[0], self.window[1], float(self.softcap), self.alibi_slopes)

    def reference_kwargs(self) -> dict:
        """Keyword arguments of ``softmax_attention_reference``."""
        return dict(window=self.window, softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                    sinks=self.sinks)

    def without_sinks(self) -> Optional["ScoreOptions"]:
        """These options less the sinks (what a kernel computes), or None if nothing is left."""
        return replace(self, sinks=None) if self.in_scores else None

    def to_kernel(self, batch: int, heads: int) -> "ScoreOptions":
        """The options on the kernels' ``[B, H, N, D]`` (the public batch dims flattened into
        B): ALiBi slopes as a float32 ``[B, H]`` view (stride 0 over B for slopes ``[H]``).
        Views only, so gradients reach the caller's tensor."""
        slopes = self.alibi_slopes
        if slopes is None:
            return self
        if slopes.dim() == 1:
            slopes = slopes.expand(batch, heads)
        else:
            slopes = slopes.reshape(batch, heads)
        return replace(self, alibi_slopes=slopes)


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check_window(fn: str, window) -> tuple[int, int]:
    expected = "a pair (left, right) of ints >= -1 (-1: unbounded on that side)"
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{fn}: window must be {expected}; got {window!r}")
    bounds = []
    for side, value in zip(("left", "right"), window):
        if isinstance(value, bool) or isinstance(value, torch.Tensor):
            raise TypeError(f"{fn}: window must be {expected}; got {side} = {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(f"{fn}: window must be {expected}; got {side} = {value!r}") from None
        if value < -1:
            raise ValueError(f"{fn}: window must be {expected}; got {side} = {value}")
        bounds.append(value)
    return bounds[0], bounds[1]


def _check_softcap(fn: str, softcap) -> float:
    # `-inf < x < inf` rather than math.isfinite: it traces under torch.compile (_validation).
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (-math.inf < softcap < math.inf):
        raise TypeError(f"{fn}: softcap must be a finite real number >= 0 (0 = off); got {softcap!r}")
    if softcap < 0:
        raise ValueError(f"{fn}: softcap must be >= 0 (0 = off); got {softcap!r}")
    return float(softcap)


def _check_per_head(fn: str, name: str, x, shapes: dict, device: torch.device) -> None:
    """``x``: a float32 tensor on ``device`` whose shape is one of ``shapes`` (text -> shape)."""
    wanted = " or ".join(f"{text} = {_shape_text(shape)}" for text, shape in shapes.items())
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a float32 tensor of shape {wanted}; got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(
            f"{fn}: {name} must be float32 (cast it with .float()); got {str(x.dtype).replace('torch.', '')}"
        )
    if tuple(x.shape) not in [tuple(shape) for shape in shapes.values()]:
        raise ValueError(f"{fn}: {name} must have shape {wanted}; got {_shape_text(x.shape)}")
    if x.device != device:
        raise ValueError(f"{fn}: {name} must be on the device of query ({device}); got {x.device}")


def build(fn: str, window, softcap, alibi_slopes, sinks, *, heads: int, batch: tuple[int, ...],
          device: torch.device) -> Optional[ScoreOptions]:
    """Validate the score options of one call of ``fn`` (the public function's name, for the
    messages) and return them, or None when every one has its default.

    ``heads``: the result's heads H; ``batch``: its batch dims (those before H; ``()`` for 3-D
    inputs and 2-D ones, which have one head); ``device``: the query's.  Raises TypeError for a
    wrong kind of thing (window not a pair of ints, softcap not a finite number, a non-tensor or
    non-float32 tensor) and ValueError for a wrong value (a bound < -1, a negative softcap, a
    shape or device that does not fit), each saying what was expected and what came.
    """
    window = (-1, -1) if window is None else _check_window(fn, window)
    softcap = _check_softcap(fn, softcap)
    if alibi_slopes is not None:
        shapes = {"[H]": (heads,)}
        if batch:
            shapes["[*batch, H]" if len(batch) > 1 else "[B, H]"] = (*batch, heads)
        _check_per_head(fn, "alibi_slopes", alibi_slopes, shapes, device)
    if sinks is not None:
        _check_per_head(fn, "sinks", sinks, {"[H]": (heads,)}, device)
    if window == (-1, -1) and softcap == 0.0 and alibi_slopes is None and sinks is None:
        return None
    return ScoreOptions(window, softcap, alibi_slopes, sinks)


# ----------------------------------------------------------------------------------------------
# sinks around a kernel (module docstring)
# ----------------------------------------------------------------------------------------------


def _sink_column(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """sinks [H] as [H, 1], in the lse's dtype, against an lse [B, H, N]."""
    return sinks.to(lse.dtype).reshape(-1, 1)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """(out', lse') of attention with sinks, from a kernel's (out, lse) without them.

    out [B, H, N, Dv], lse [B, H, N] (float32, float64 for float64 inputs), sinks [H]:
    lse' = logaddexp(lse, sink), out' = out · exp(lse - lse') computed in the lse's dtype and cast
    back to out's.  A row with no visible key (lse -inf) gets lse' = sink and out' = 0; with a
    -inf sink as well, lse' stays -inf and out' 0.  Not differentiable by itself: see
    :func:`sink_gradient` (the kernels' autograd uses both)."""
    sink = _sink_column(sinks, lse)
    lse_new = torch.logaddexp(lse, sink)
    weight = torch.exp(lse - lse_new)
    weight = torch.where(lse_new == -math.inf, torch.zeros_like(weight), weight)
    out_new = (out.to(lse.dtype) * weight.unsqueeze(-1)).to(out.dtype)
    return out_new, lse_new


def sink_probability(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(sink_h - lse'_bhi) [B, H, N], the sink's share of each row's softmax (0 where lse' is
    -inf: no key and a -inf sink)."""
    p = torch.exp(_sink_column(sinks, lse) - lse)
    return torch.where(lse == -math.inf, torch.zeros_like(p), p)


def sink_gradient(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]) -> torch.Tensor:
    """d loss / d sinks [H] given out', lse' (:func:`add_sinks`) and the gradients of both
    (None: unused).  d sink_h = Σ_{b,i} exp(sink_h - lse'_bhi) · (g_bhi - D_bhi) with
    D_i = rowsum(dO_i ∘ out'_i) and g the lse's gradient -- the softmax gradient of the sink's
    logit, whose value is 0.  Accumulated in the lse's dtype."""
    p = sink_probability(sinks, lse)
    total = torch.zeros_like(lse)
    if grad_out is not None:
        total = total - (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    if grad_lse is not None:
        total = total + grad_lse.to(lse.dtype)
    return (p * total).sum(dim=(0, 2)).to(sinks.dtype)

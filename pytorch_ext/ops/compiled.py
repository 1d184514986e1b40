"""The packed-sequence and KV-cache calls under ``torch.compile``: opaque custom ops.

``softmax_attention_varlen``, ``linear_attention_varlen`` and ``attention_with_kvcache`` read
their offsets / cache lengths on the host and choose their kernel calls from the values (groups
of equal lengths, runs of a cache, the paged blocks): Python that dynamo cannot trace.  Before
this module ``torch.compile(fullgraph=True)`` of a function calling them failed ("Could not
guard on data-dependent expression", at the offsets' checks), and a plain ``torch.compile``
broke the graph there.  Under compilation (``torch.compiler.is_compiling()``) the public
functions now call the ops below instead, after their checks of shapes, dtypes and flags (which
trace).  Each op runs the eager function at run time -- every value check, backend and route
is the eager call's, and a bad value raises the eager call's error there, before any kernel --
and has a fake that gives the results' shapes for tracing.  FlashAttention registers its varlen
and KV-cache functions as custom ops the same way.

Gradients (the two varlen ops): the autograd graph of the eager call cannot cross an opaque op.
softmax_attention_varlen's one Triton launch has backward kernels that need only the forward's
out and lse, so its backward op runs them (the eager call's backward, no recomputation).  Every
other path's backward op recomputes the eager forward with autograd on and differentiates it
(:func:`recompute_gradients`): a compiled training step pays the packed forward twice there (as
activation checkpointing does).  Measured (softmax_attention_varlen, 16 causal sequences of
32-512 tokens, H=8, D=64, float32, cpu backend, one thread, Intel Xeon without AMX; an ad-hoc
loop, min of 5): forward 22.6 ms compiled against 22.5 eager, forward+backward 118 against 81.
No double backward through these ops (the eager functions have one).  Dropout under
compilation keeps the eager, graph-breaking path: a recomputed forward would draw another mask.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

_PREFIX = "attnkit::"


def compiling() -> bool:
    """Whether dynamo is tracing the caller (the public functions then call the ops below)."""
    return torch.compiler.is_compiling()


def check_int(fn: str, name: str, value) -> None:
    """``value`` is an int (a SymInt under compilation), not a bool."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{fn}: {name} must be an int; got {value!r}")


def _autograd_dispatch():
    """Autograd back on for ops called inside a custom op's implementation.

    A custom op's implementation runs below autograd: its dispatch keys are excluded there
    (``torch.enable_grad()`` alone then builds no graph -- the recomputed outputs came out
    without grad_fn and every gradient zero).  The guard restores them for the recomputation, as
    torch's own higher-order ops that differentiate inside do (torch/_higher_order_ops)."""
    from torch._C import DispatchKey

    exclude = torch._C._dispatch_tls_local_exclude_set()
    include = torch._C._dispatch_tls_local_include_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor,
                DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(include.remove(DispatchKey.ADInplaceOrView), exclude)


def recompute_gradients(forward: Callable, inputs: Sequence[Optional[torch.Tensor]], differentiable: Sequence[bool],
                        grad_outputs: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """The gradients of ``sum_i <forward(*inputs)[i], grad_outputs[i]>`` with respect to the
    inputs flagged ``differentiable`` (zeros where an input does not reach an output; an empty
    tensor where the input is None), ``forward`` recomputed with autograd on."""
    with _autograd_dispatch(), torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) if wanted and x is not None else x
                  for x, wanted in zip(inputs, differentiable)]
        outputs = forward(*leaves)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        wrt = [x for x, wanted in zip(leaves, differentiable) if wanted and x is not None]
        found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True) if pairs and wrt else [None] * len(wrt)
    grads, taken = [], iter(found)
    for x, wanted in zip(leaves, differentiable):
        if not wanted:
            continue
        if x is None:
            grads.append(torch.empty(0))
            continue
        g = next(taken)
        grads.append(torch.zeros_like(x, memory_format=torch.contiguous_format) if g is None else g.contiguous())
    return grads


def _like(x: Optional[torch.Tensor]) -> torch.Tensor:
    """The fake of a gradient recompute_gradients returns for input x (contiguous)."""
    return torch.empty(0) if x is None else x.new_empty(x.shape)


def _none_if_empty(g: torch.Tensor, like: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The gradient of an optional input as autograd takes it: None where the input was None
    (the op returned an empty placeholder for it)."""
    return None if like is None else g


# ---------------------------------------------------------------------------------------------
# softmax_attention_varlen
# ---------------------------------------------------------------------------------------------

def _softmax_varlen_options(window, softcap, alibi_slopes, sinks) -> dict:
    options = {}
    if window is not None:
        options["window"] = tuple(window)
    if softcap is not None:
        options["softcap"] = softcap
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        options["sinks"] = sinks
    return options


def _softmax_varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                          enable_gqa, backend, window, softcap, alibi_slopes, sinks):
    from .varlen import softmax_attention_varlen

    return softmax_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=True,
                                    backend=backend,
                                    **_softmax_varlen_options(window, softcap, alibi_slopes, sinks))


@torch.library.custom_op(_PREFIX + "softmax_varlen_compiled", mutates_args=())
def _softmax_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                       scale: Optional[float], enable_gqa: bool, backend: Optional[str],
                       window: Optional[list[int]], softcap: Optional[float], alibi_slopes: Optional[torch.Tensor],
                       sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out, lse = _softmax_varlen_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                         scale, enable_gqa, backend, window, softcap, alibi_slopes, sinks)
    return out.contiguous(), lse.contiguous()


@_softmax_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, enable_gqa, backend,
      window, softcap, alibi_slopes, sinks):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty(q.shape[:2], dtype=lse_dtype)


@torch.library.custom_op(_PREFIX + "softmax_varlen_compiled_bwd", mutates_args=())
def _softmax_varlen_bwd_op(grad_out: torch.Tensor, grad_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                           scale: Optional[float], enable_gqa: bool, backend: Optional[str],
                           window: Optional[list[int]], softcap: Optional[float],
                           alibi_slopes: Optional[torch.Tensor],
                           sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    from .varlen import one_launch_backward

    # A loss that does not read the lse still gets a (zero) gradient for it from AOTAutograd;
    # the eager backward without one is cheaper (16 causal sequences of 32-512 tokens, H=8 D=64
    # float32, one thread: 80 against 116 ms), so an all-zero one is dropped.
    if not grad_lse.any():
        grad_lse = None
    # The Triton one launch: its backward kernels from the saved out / lse, no recomputation.
    options = _softmax_varlen_options(window, softcap, alibi_slopes, sinks)
    grads = one_launch_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, is_causal, scale, backend, options,
                                grad_out, grad_lse)
    if grads is not None:
        dq, dk, dv, dsinks = grads
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), (torch.empty(0) if dsinks is None
                                                                   else dsinks.contiguous())

    def forward(q_, k_, v_, sinks_):
        return _softmax_varlen_eager(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                     scale, enable_gqa, backend, window, softcap, alibi_slopes, sinks_)

    dq, dk, dv, dsinks = recompute_gradients(forward, (q, k, v, sinks), (True, True, True, True),
                                             (grad_out, grad_lse))
    return dq, dk, dv, dsinks


@_softmax_varlen_bwd_op.register_fake
def _(grad_out, grad_lse, out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
      enable_gqa, backend, window, softcap, alibi_slopes, sinks):
    return _like(q), _like(k), _like(v), _like(sinks)


_SOFTMAX_VARLEN_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "is_causal",
                        "scale", "enable_gqa", "backend", "window", "softcap", "alibi_slopes", "sinks")


def _softmax_varlen_setup(ctx, inputs, output):
    args = dict(zip(_SOFTMAX_VARLEN_ARGS, inputs))
    ctx.save_for_backward(*output, *(args[name] for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                                             "alibi_slopes", "sinks")))
    ctx.args = {name: value for name, value in args.items() if not isinstance(value, torch.Tensor)}


def _softmax_varlen_backward(ctx, grad_out, grad_lse):
    out, lse, q, k, v, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
    a = ctx.args
    if grad_out is None:
        grad_out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    if grad_lse is None:
        grad_lse = q.new_zeros(q.shape[:2], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    dq, dk, dv, dsinks = _softmax_varlen_bwd_op(
        grad_out, grad_lse, out, lse, q, k, v, cu_q, cu_k, a["max_seqlen_q"], a["max_seqlen_k"], a["is_causal"], a["scale"],
        a["enable_gqa"], a["backend"], a["window"], a["softcap"], alibi_slopes, sinks)
    return (dq, dk, dv) + (None,) * 11 + (_none_if_empty(dsinks, sinks),)


_softmax_varlen_op.register_autograd(_softmax_varlen_backward, setup_context=_softmax_varlen_setup)


def softmax_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, enable_gqa,
                   backend, score_options: dict):
    """softmax_attention_varlen's (out, lse) through the opaque op (called under compilation)."""
    window = score_options.get("window")
    return _softmax_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                              None if scale is None else float(scale), enable_gqa, backend,
                              None if window is None else [int(w) for w in window],
                              None if score_options.get("softcap") is None else float(score_options["softcap"]),
                              score_options.get("alibi_slopes"), score_options.get("sinks"))


# ---------------------------------------------------------------------------------------------
# linear_attention_varlen
# ---------------------------------------------------------------------------------------------

def _linear_varlen_eager(q, k, v, cu_seqlens, causal, feature_map, normalize, eps, scale, S0, z0, return_state,
                         backend):
    """(out, S, z); S and z empty (float32, CPU) without return_state."""
    from .linear_varlen import linear_attention_varlen

    state = None if S0 is None else (S0, z0)
    result = linear_attention_varlen(q, k, v, cu_seqlens, causal=causal, feature_map=feature_map,
                                     normalize=normalize, eps=eps, scale=scale, initial_state=state,
                                     return_state=return_state, backend=backend)
    if return_state:
        out, (S, z) = result
        return out, S, z
    return result, torch.empty(0), torch.empty(0)


@torch.library.custom_op(_PREFIX + "linear_varlen_compiled", mutates_args=())
def _linear_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                      feature_map: str, normalize: bool, eps: float, scale: float, S0: Optional[torch.Tensor],
                      z0: Optional[torch.Tensor], return_state: bool,
                      backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out, S, z = _linear_varlen_eager(q, k, v, cu_seqlens, causal, feature_map, normalize, eps, scale, S0, z0,
                                         return_state, backend)
    return out.contiguous(), S.contiguous(), z.contiguous()


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@_linear_varlen_op.register_fake
def _(q, k, v, cu_seqlens, causal, feature_map, normalize, eps, scale, S0, z0, return_state, backend):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    if not return_state:
        return out, torch.empty(0, device="cpu"), torch.empty(0, device="cpu")
    batch, dtype = cu_seqlens.shape[0] - 1, _state_dtype(q.dtype)
    return (out, q.new_empty((batch, q.shape[1], q.shape[2], v.shape[2]), dtype=dtype),
            q.new_empty((batch, q.shape[1], q.shape[2]), dtype=dtype))


@torch.library.custom_op(_PREFIX + "linear_varlen_compiled_bwd", mutates_args=())
def _linear_varlen_bwd_op(grad_out: torch.Tensor, grad_S: Optional[torch.Tensor], grad_z: Optional[torch.Tensor],
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                          feature_map: str, normalize: bool, eps: float, scale: float, S0: Optional[torch.Tensor],
                          z0: Optional[torch.Tensor], return_state: bool, backend: Optional[str]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    def forward(q_, k_, v_, S0_, z0_):
        return _linear_varlen_eager(q_, k_, v_, cu_seqlens, causal, feature_map, normalize, eps, scale, S0_, z0_,
                                    return_state, backend)

    return tuple(recompute_gradients(forward, (q, k, v, S0, z0), (True,) * 5, (grad_out, grad_S, grad_z)))


@_linear_varlen_bwd_op.register_fake
def _(grad_out, grad_S, grad_z, q, k, v, cu_seqlens, causal, feature_map, normalize, eps, scale, S0, z0,
      return_state, backend):
    return _like(q), _like(k), _like(v), _like(S0), _like(z0)


_LINEAR_VARLEN_ARGS = ("q", "k", "v", "cu_seqlens", "causal", "feature_map", "normalize", "eps", "scale", "S0", "z0",
                       "return_state", "backend")


def _linear_varlen_setup(ctx, inputs, output):
    args = dict(zip(_LINEAR_VARLEN_ARGS, inputs))
    ctx.save_for_backward(*(args[name] for name in ("q", "k", "v", "cu_seqlens", "S0", "z0")))
    ctx.args = {name: value for name, value in args.items() if not isinstance(value, torch.Tensor)}


def _linear_varlen_backward(ctx, grad_out, grad_S, grad_z):
    q, k, v, cu_seqlens, S0, z0 = ctx.saved_tensors
    a = ctx.args
    if grad_out is None:
        grad_out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    if not a["return_state"]:  # the empty placeholders' gradients
        grad_S = grad_z = None
    dq, dk, dv, dS0, dz0 = _linear_varlen_bwd_op(
        grad_out, grad_S, grad_z, q, k, v, cu_seqlens, a["causal"], a["feature_map"], a["normalize"], a["eps"],
        a["scale"], S0, z0, a["return_state"], a["backend"])
    return (dq, dk, dv) + (None,) * 6 + (_none_if_empty(dS0, S0), _none_if_empty(dz0, z0), None, None)


_linear_varlen_op.register_autograd(_linear_varlen_backward, setup_context=_linear_varlen_setup)


def linear_varlen(q, k, v, cu_seqlens, causal, feature_map, normalize, eps, scale, initial_state, return_state,
                  backend):
    """linear_attention_varlen's result through the opaque op (called under compilation)."""
    S0, z0 = (None, None) if initial_state is None else initial_state
    out, S, z = _linear_varlen_op(q, k, v, cu_seqlens, causal, feature_map, normalize, float(eps), float(scale), S0,
                                  z0, return_state, backend)
    return (out, (S, z)) if return_state else out


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache (inference: no autograd)
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op(_PREFIX + "kvcache_compiled", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                v: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor], cache_seqlen: int,
                block_table: Optional[torch.Tensor], is_causal: bool, scale: Optional[float], enable_gqa: bool,
                backend: Optional[str], window: Optional[list[int]], softcap: Optional[float],
                alibi_slopes: Optional[torch.Tensor],
                sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from .kvcache import attention_with_kvcache

    out, lse = attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlen if cache_seqlens is None else cache_seqlens,
        block_table=block_table, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, return_lse=True,
        backend=backend, **_softmax_varlen_options(window, softcap, alibi_slopes, sinks))
    return out.contiguous(), lse.contiguous()


@_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlen, block_table, is_causal, scale, enable_gqa, backend,
      window, softcap, alibi_slopes, sinks):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:3] + (v_cache.shape[3],)), q.new_empty(q.shape[:3], dtype=lse_dtype)


def kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, enable_gqa, backend,
            score_options: dict):
    """attention_with_kvcache's (out, lse) through the opaque op (called under compilation)."""
    window = score_options.get("window")
    tensor = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    return _kvcache_op(q, k_cache, v_cache, k, v, tensor, 0 if tensor is not None else cache_seqlens, block_table,
                       is_causal, None if scale is None else float(scale), enable_gqa, backend,
                       None if window is None else [int(w) for w in window],
                       None if score_options.get("softcap") is None else float(score_options["softcap"]),
                       score_options.get("alibi_slopes"), score_options.get("sinks"))

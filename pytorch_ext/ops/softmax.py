"""Softmax attention: ``attnkit.softmax_attention``, a drop-in for torch's SDPA.

Layers (DESIGN.md):

- **op** (this module's first half) -- the kernels as ``torch.library`` ops, each with a fake
  (meta) implementation, so that ``torch.compile(fullgraph=True)`` traces them, and an autograd
  formula whose backward is the kernels' own recomputing backward:

  * ``attnkit::softmax_fwd`` / ``attnkit::softmax_bwd`` -- the C++ ops (schemas in
    ``csrc/ops.cpp``; CPU implementation ``csrc/cpu/softmax.cpp``, CUDA ``csrc/cuda/softmax.cu``).
    Their fake and autograd registrations exist only when ``attnkit._C`` loads; without it the
    package still imports and the ``cpu`` / ``cuda`` backends report why they cannot run.
  * ``attnkit::softmax_triton_fwd`` / ``attnkit::softmax_triton_bwd`` -- ``torch.library``
    custom ops around the Triton launchers of ``attnkit.kernels.softmax`` (plus a dropout
    ``seed``, and the C++ ops' defaulted score options).  They are ``custom_op`` with an
    explicit fake, not ``triton_op``: under ``TRITON_INTERPRET=1`` ``triton_op``'s automatic
    fake runs the interpreted kernel on FakeTensors and fails.  The kernel module is imported
    inside the op bodies: importing triton is slow, and ``TRITON_INTERPRET`` is read when the
    kernels are decorated.

- **public function** :func:`softmax_attention` -- validates every input, picks the backend
  (:func:`attnkit._dispatch.resolve`, then the routing rules of its docstring for what a
  kernel cannot do) and calls that backend's entry of :data:`_IMPLEMENTATIONS`.

The score options (issue 28: ``window``, ``softcap``, ``alibi_slopes``, ``sinks``) live in
:mod:`attnkit.score_options`: the public function validates them once into a
:class:`~attnkit.score_options.ScoreOptions` (None when all are default: the calls without them
take exactly the paths they took before), the layout maps it onto the kernels' [B, H, N, D], the
routing reads which backend runs which (``BACKEND_OPTIONS``) and each implementation receives
it.  The C++ ops and the Triton ops take window / softcap / ALiBi and the sinks as trailing
(defaulted) arguments; the cpu and triton kernels fold the sinks into each row's finish (one
rounding of a 16-bit row), the cuda kernels' results get them after (add_sinks); on every kernel
backend their gradients go through :class:`_WithSinks` (the backward kernels take out and lse
with the sinks in them, and need nothing more).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _autocast
from .. import _gpu_table as gpu_table
from .._double_backward import reference_gradients
from .._dispatch import (
    ENV_VAR,
    BackendUnavailableError,
    backend_status,
    native,
    native_cpu,
    native_ops_declared,
    register_kernel,
    resolve,
)
from .._validation import (
    FLOATING,
    check_bool,
    check_real,
    check_same_dtype_device,
    check_size_match,
    check_tensor,
)
from ..reference.softmax import softmax_attention_reference
from .. import score_options
from ..score_options import BACKEND_OPTIONS, ScoreOptions

FAMILY = "softmax"
OP_NAME = "attnkit.softmax_attention"

# What the kernel backends take (the routing rules of softmax_attention; each kernel also
# checks for itself).  The C++ CPU kernel takes every floating dtype and any head dim.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256  # attnkit.kernels.softmax.MAX_HEAD_DIM (not imported: triton is slow to import)
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CUDA_HEAD_DIMS = (64, 128)
# D = Dv = 256 runs on the Hopper kernels alone (csrc/cuda/softmax_sm90.cu: unmasked; opt-in with
# ATTNKIT_CUDA_SM90 until they have passed on a GPU): attnkit._C.softmax_sm90_enabled(device).
CUDA_HOPPER_HEAD_DIM = 256


def _cuda_hopper_kernels(device: torch.device) -> bool:
    """Whether the cuda softmax runs its Hopper kernels on ``device``."""
    if device.type != "cuda":
        return False
    try:
        return bool(native().softmax_sm90_enabled(device.index if device.index is not None else 0))
    except (BackendUnavailableError, AttributeError):
        return False


# ==============================================================================================
# op layer: the C++ ops attnkit::softmax_fwd / softmax_bwd (cpu and cuda backends)
# ==============================================================================================


_NATIVE_OPS = native_ops_declared("softmax_fwd", "softmax_bwd")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    # The kernels accumulate, and return the lse, in float32 (float64 for float64 inputs).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fwd_fake(q, k, v, mask, scale, is_causal, *_dropout):
    b, h, n, _ = q.shape
    out = q.new_empty((b, h, n, v.shape[-1]))
    lse = q.new_empty((b, h, n), dtype=_lse_dtype(q.dtype))
    return out, lse


def _bwd_fake(grad_out, q, k, v, out, lse, mask, scale, is_causal, *_dropout):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _gradients(run_bwd, saved, grad_out, grad_lse, probe_dim=None):
    """(dq, dk, dv) from the kernels' backward, for gradients of both outputs.

    ``run_bwd(grad_out, v, out, with_dropout)`` calls the backward kernel (other arguments
    fixed).  The kernels take the gradient of ``out`` only.  The lse's gradient adds
    ``g_i · p_ij`` to dS (∂lse_i/∂s_ij = p_ij, the probabilities *before* dropout): a second,
    dropout-free call where V is zero (so dP = 0) and the row term D_i = rowsum(dO ∘ O) equals
    ``-g_i`` -- with O a column of ones and dO the column ``-g`` -- makes the kernel's
    dS = P ∘ (dP − D) exactly g P.  For float16 / bfloat16 inputs ``-g`` (float32) is split
    over two columns, its rounding to the inputs' dtype and the rest, so that the kernel's
    float32 row sum recovers it to about float32 precision.  ``probe_dim``: the head dim the
    probe's V and O must have (None: as few columns as that takes; the CUDA kernels need D),
    extra columns are zero.  Skipped when the lse is unused (``grad_lse`` None: the
    gradients are not materialized).
    """
    q, k, v, out, lse = saved[:5]
    dq = dk = dv = None
    if grad_out is not None:
        dq, dk, dv = run_bwd(grad_out, v, out, True)
    if grad_lse is not None:
        minus_g = -grad_lse.to(lse.dtype)
        head = minus_g.to(q.dtype)
        if q.dtype in (torch.float16, torch.bfloat16):
            cols = torch.stack([head, (minus_g - head.to(minus_g.dtype)).to(q.dtype)], dim=-1)
        else:
            cols = head.unsqueeze(-1)
        pad = (0, 0 if probe_dim is None else probe_dim - cols.shape[-1])
        minus_g = F.pad(cols, pad)
        ones = F.pad(torch.ones_like(cols), pad)
        v_zero = v.new_zeros(v.shape[:-1] + (minus_g.shape[-1],))
        dq_l, dk_l, _ = run_bwd(minus_g, v_zero, ones, False)
        dq = dq_l if dq is None else dq + dq_l
        dk = dk_l if dk is None else dk + dk_l
    if dv is None:
        dv = torch.zeros_like(v)
    return dq, dk, dv


def _differentiable_gradients(q, k, v, mask, is_causal, scale, options, grad_out, grad_lse,
                              dropout_p=0.0, dropout_mask=None):
    """(dq, dk, dv) -- and d sinks after them when ``options`` has sinks -- that are themselves
    differentiable, for a double backward (``create_graph=True``): the kernels' backward has no
    autograd of its own, so these come from the reference recomputed on the saved inputs (it
    materializes the N × M scores).  ``options``: the call's ScoreOptions (or None);
    ``dropout_mask``: the kept entries the kernel's forward used (with its ``dropout_p``)."""
    extra = {} if options is None else options.reference_kwargs()
    if dropout_mask is None:
        dropout_p = 0.0
    out, lse = softmax_attention_reference(
        q, k, v, mask, dropout_p, is_causal, scale, q.shape[1] != k.shape[1],
        return_lse=True, dropout_mask=dropout_mask, **extra,
    )
    outputs, grads = [], []
    for tensor, grad in ((out, grad_out), (lse, grad_lse)):
        if grad is not None:
            finite = torch.isfinite(tensor)  # fully masked rows: lse = -inf, no gradient
            outputs.append(torch.where(finite, tensor, 0.0) if tensor is lse else tensor)
            grads.append(grad.to(tensor.dtype))
    wanted = (q, k, v) if extra.get("sinks") is None else (q, k, v, extra["sinks"])
    return reference_gradients(outputs, wanted, grads)


def _kernel_score_options(kernel_args, sinks=None) -> ScoreOptions | None:
    """The ScoreOptions of the C++ ops' trailing arguments (window_left, window_right, softcap,
    alibi_slopes) and the sinks the kernel folded in, or None for the defaults."""
    left, right, softcap, alibi = kernel_args if kernel_args else (-1, -1, 0.0, None)
    if (left, right, softcap) == (-1, -1, 0.0) and alibi is None and sinks is None:
        return None
    return ScoreOptions((left, right), softcap, alibi, sinks)


def _sink_backward(ctx, sink_index, kernel_gradients, differentiable_gradients, sinks, out, lse,
                   grad_out, grad_lse):
    """(dq, dk, dv, d sinks) of an op that folded ``sinks`` into its (out, lse): the kernel's
    backward on them as they are (its recomputed probabilities carry the sink in their
    denominator: see :class:`_WithSinks`) and :func:`attnkit.score_options.sink_gradient`; under
    create_graph the reference's, differentiable.  ``sink_index``: the sinks' input position."""
    if torch.is_grad_enabled():  # create_graph=True: a double backward will follow
        return differentiable_gradients()
    dq, dk, dv = kernel_gradients()
    dsinks = None
    if ctx.needs_input_grad[sink_index]:
        dsinks = score_options.sink_gradient(sinks, out, lse, grad_out, grad_lse)
    return dq, dk, dv, dsinks


def _native_setup_context(ctx, inputs, output):
    # inputs: (q, k, v, mask, scale, is_causal) from _NativeAttention without score options;
    # (..., window_left, window_right, softcap, alibi_slopes) with them or from the registered
    # op.  The first case is the old code to the statement: it runs on every differentiable call
    # (its cost is measured per call, issue 14).
    # The registered op's inputs end with the sinks (folded in by the cpu kernel).
    out, lse = output
    if len(inputs) == 6:
        q, k, v, mask, scale, is_causal = inputs
        ctx.save_for_backward(q, k, v, out, lse, mask)
    else:
        q, k, v, mask, scale, is_causal, left, right, softcap, alibi, *sinks = inputs
        # 8 saved: the backward tells by that
        ctx.save_for_backward(q, k, v, out, lse, mask, alibi, sinks[0] if sinks else None)
        ctx.kernel_args = (left, right, softcap)
        ctx.num_inputs = len(inputs)
    ctx.scale, ctx.is_causal = scale, is_causal
    # An unused lse (return_lse=False) then gets grad None, not zeros: no second kernel call.
    ctx.set_materialize_grads(False)


def _native_backward(ctx, grad_out, grad_lse):
    saved = ctx.saved_tensors
    if len(saved) == 6:  # 6 inputs, no score options
        q, k, v, out, lse, mask = saved
        kernel_args, sinks, no_grads = (), None, (None, None, None)
    else:  # 10 or 11 inputs: (window_left, window_right, softcap, alibi_slopes[, sinks])
        q, k, v, out, lse, mask, alibi, sinks = saved
        kernel_args, no_grads = ctx.kernel_args + (alibi,), (None,) * (ctx.num_inputs - 3)
    # No gradient for the mask (a mask that requires grad is routed to the reference), scale,
    # is_causal or the score options (alibi_slopes that require grad go to the reference too);
    # the sinks get theirs.
    if sinks is None:
        grads = _native_gradients(q, k, v, out, lse, mask, ctx.scale, ctx.is_causal, kernel_args,
                                  grad_out, grad_lse)
        return (*grads, *no_grads)
    *grads, dsinks = _sink_backward(
        ctx, 10,
        lambda: _native_gradients(q, k, v, out, lse, mask, ctx.scale, ctx.is_causal, kernel_args,
                                  grad_out, grad_lse),
        lambda: _differentiable_gradients(q, k, v, mask, ctx.is_causal, ctx.scale,
                                          _kernel_score_options(kernel_args, sinks), grad_out, grad_lse),
        sinks, out, lse, grad_out, grad_lse)
    return (*grads, *no_grads[:-1], dsinks)


def _native_gradients(q, k, v, out, lse, mask, scale, is_causal, kernel_args, grad_out, grad_lse):
    """(dq, dk, dv) of attnkit::softmax_fwd from its saved tensors: the backward of
    _NativeAttention, and of the C++ autograd (csrc/softmax_autograd.cpp) where that one does
    not call the kernel itself (a gradient for the lse, a double backward)."""
    if torch.is_grad_enabled():  # create_graph=True: a double backward will follow
        return _differentiable_gradients(q, k, v, mask, is_causal, scale,
                                         _kernel_score_options(kernel_args), grad_out, grad_lse)
    if grad_lse is None and grad_out is not None:
        # The usual call (the lse unused): one kernel call, as _gradients would make it.
        if not kernel_args:
            return _BWD_CALL(grad_out, q, k, v, out, lse, mask, scale, is_causal)
        return _BWD_OP(grad_out, q, k, v, out, lse, mask, scale, is_causal, *kernel_args)
    # The CUDA kernels need V's head dim equal to the query's.
    probe = q.shape[-1] if q.is_cuda else None

    def run_bwd(g, v, out, _with_dropout):  # no dropout in the C++ kernels
        return _BWD_OP(g, q, k, v, out, lse, mask, scale, is_causal, *kernel_args)

    return _gradients(run_bwd, (q, k, v, out, lse), grad_out, grad_lse, probe)


def _cpp_autograd_backward(q, k, v, out, lse, mask, scale, is_causal, grad_out, grad_lse):
    """The C++ autograd's fallback (attnkit._C.set_softmax_backward_fallback): no score options."""
    return tuple(_native_gradients(q, k, v, out, lse, mask, scale, is_causal, (), grad_out, grad_lse))


if _NATIVE_OPS:
    torch.library.register_fake("attnkit::softmax_fwd", _fwd_fake)
    torch.library.register_fake("attnkit::softmax_bwd", _bwd_fake)
    torch.library.register_autograd("attnkit::softmax_fwd", _native_backward,
                                    setup_context=_native_setup_context)
    _FWD_OP = torch.ops.attnkit.softmax_fwd.default
    _BWD_OP = torch.ops.attnkit.softmax_bwd.default
    # The OpOverload's bound C++ function: calling it skips OpOverload.__call__'s Python frame
    # (*args / **kwargs repacked), 0.3-0.7 us of softmax_attention's 8 us at N=16 (issue 25).
    # Used with the score options (kernel_args).
    _FWD_CALL_OPTIONS = getattr(_FWD_OP, "_op", _FWD_OP)
    # Without them: attnkit._C's typed dispatcher handles (csrc/ops.cpp, softmax_fwd_call), the
    # same dispatch without the boxed call's schema parsing of the Python arguments.  Issue 25,
    # B=H=1 N=16 D=64 float32 forward below autograd, Xeon with AMX (2 threads, best of 5 x 20000
    # calls, alternating, two rounds): 12.4 / 11.6 us boxed against 8.4 / 7.9 us typed.
    _C_MODULE = native()
    _FWD_CALL = getattr(_C_MODULE, "softmax_fwd_call", _FWD_CALL_OPTIONS)
    _BWD_CALL = getattr(_C_MODULE, "softmax_bwd_call", getattr(_BWD_OP, "_op", _BWD_OP))
    # The op with its autograd in C++ (csrc/softmax_autograd.cpp) for differentiable eager calls
    # without score options: no Python frame in the forward's autograd or in the usual backward.
    _FWD_AUTOGRAD = getattr(_C_MODULE, "softmax_fwd_autograd", None)
    if _FWD_AUTOGRAD is not None:
        _C_MODULE.set_softmax_backward_fallback(_cpp_autograd_backward)

    class _NativeAttention(torch.autograd.Function):
        """The eager path of ``attnkit::softmax_fwd`` with its registered autograd: the same
        setup_context and backward, without torch.library's generic wrapper around them.

        That wrapper (an autograd.Function built for any schema) re-fills the schema's default
        arguments, packs the dispatch key set and redispatches on every call; at B=H=1 N=16 D=64
        float32 (one thread, CPU time) it cost ~10 us of a forward and ~30 us of a
        forward+backward, several times the kernels' own 7 us.  torch.compile still traces the
        op itself (see _call_native): its fake and registered autograd are what a graph needs.
        """

        @staticmethod
        def forward(ctx, q, k, v, mask, scale, is_causal, *kernel_args):
            # kernel_args: () or the score options (window_left, window_right, softcap, alibi).
            if kernel_args:
                with _BELOW_AUTOGRAD():
                    output = _FWD_CALL_OPTIONS(q, k, v, mask, scale, is_causal, *kernel_args)
                _native_setup_context(ctx, (q, k, v, mask, scale, is_causal, *kernel_args), output)
                return output
            with _BELOW_AUTOGRAD():
                output = _FWD_CALL(q, k, v, mask, scale, is_causal)
            _native_setup_context(ctx, (q, k, v, mask, scale, is_causal), output)
            return output

        backward = staticmethod(_native_backward)

    # What _NativeAttention.apply (torch.autograd.Function.apply) calls once its Python wrapper
    # has found no setup_context to bind and no functorch transform active: see _native_apply.
    _NATIVE_APPLY = super(torch.autograd.Function, _NativeAttention).apply


def _native_apply(q, k, v, mask, scale, is_causal):
    """``_NativeAttention.apply(q, k, v, mask, scale, is_causal)``, without Function.apply's
    Python wrapper where it does nothing: outside functorch transforms it only unwraps dead
    functorch wrappers (done here for the tensors) before the C++ apply.  Issue 25, B=H=1 N=16
    D=64 float32 with grad, one thread, loaded 2-core AMD EPYC Zen 3 (timeit): the wrapper was
    ~5-6 us of a ~26 us apply.  Under a transform (vmap, grad, ...) the wrapper runs, and raises
    its error (the Function has no setup_context).  Outside them, the C++ autograd Function
    (csrc/softmax_autograd.cpp) where attnkit._C has it: the same formula, no Python frame."""
    if _functorch_active():
        return _NativeAttention.apply(q, k, v, mask, scale, is_causal)
    if _FWD_AUTOGRAD is not None:
        return _FWD_AUTOGRAD(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v),
                             mask if mask is None else _unwrap_if_dead(mask), scale, is_causal)
    return _NATIVE_APPLY(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v),
                         mask if mask is None else _unwrap_if_dead(mask), scale, is_causal)


_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
# Bound once for softmax_attention's fast path (two attribute reads a call less); torch.compile
# knows these functions by identity.
_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _call_native(q, k, v, mask, scale, is_causal):
    """attnkit::softmax_fwd(q, k, v, mask, scale, is_causal) -> (out, lse), differentiable.

    Eager calls skip the Python autograd kernel that register_autograd installs: straight to
    the kernel below autograd when no gradient is wanted, else through _NativeAttention (the
    same formula).  Under torch.compile the op itself, as registered."""
    if _is_compiling():
        return torch.ops.attnkit.softmax_fwd(q, k, v, mask, scale, is_causal)
    if _grad_enabled() and torch._C._any_requires_grad(q, k, v, mask):
        return _native_apply(q, k, v, mask, scale, is_causal)
    with _BELOW_AUTOGRAD():
        return _FWD_CALL(q, k, v, mask, scale, is_causal)


def _call_native_options(q, k, v, mask, scale, is_causal, kernel_args):
    """:func:`_call_native` with the score options' trailing arguments (window_left,
    window_right, softcap, alibi_slopes).  Apart from it so that calls without options pay
    nothing for them (that path is timed per call: issue 14)."""
    if torch.compiler.is_compiling():
        return torch.ops.attnkit.softmax_fwd(q, k, v, mask, scale, is_causal, *kernel_args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, mask):
        return _NativeAttention.apply(q, k, v, mask, scale, is_causal, *kernel_args)
    with _BELOW_AUTOGRAD():
        return _FWD_OP(q, k, v, mask, scale, is_causal, *kernel_args)

# Unconditionally: when attnkit._C is missing, the dispatcher reports the cpu / cuda backends
# unusable with the reason.
register_kernel(FAMILY, "cpu")
register_kernel(FAMILY, "cuda")


# ==============================================================================================
# op layer: the Triton kernels as custom ops attnkit::softmax_triton_fwd / _bwd
# ==============================================================================================


def _triton_fwd_impl(q, k, v, mask, scale, is_causal, dropout_p, seed, window_left=-1,
                     window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None):
    from ..kernels import softmax as kernels

    return kernels.softmax_fwd(q, k, v, mask, scale, is_causal, dropout_p, int(seed),
                               window_left=window_left, window_right=window_right, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks)


def _triton_bwd_impl(grad_out, q, k, v, out, lse, mask, scale, is_causal, dropout_p, seed,
                     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    from ..kernels import softmax as kernels

    return kernels.softmax_bwd(grad_out, q, k, v, out, lse, mask, scale, is_causal, dropout_p,
                               int(seed), window_left=window_left, window_right=window_right,
                               softcap=softcap, alibi_slopes=alibi_slopes)


@torch.library.custom_op("attnkit::softmax_triton_fwd", mutates_args=())
def _triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash forward (attnkit.kernels.softmax.softmax_fwd): (out, lse float32).  ``seed`` is a
    0-d int64 tensor (a tensor, not an int, so that drawing it does not break a compiled graph).
    The trailing score options are those of the C++ op ``attnkit::softmax_fwd`` (defaults: none;
    alibi_slopes float32 [B, H]; sinks float32 [H], folded into the rows: out and lse are those
    with the sinks, differentiable in them), defaulted so that calls without them keep their form."""
    return _triton_fwd_impl(q, k, v, mask, scale, is_causal, dropout_p, seed, window_left,
                            window_right, softcap, alibi_slopes, sinks)


@torch.library.custom_op("attnkit::softmax_triton_bwd", mutates_args=())
def _triton_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash backward (attnkit.kernels.softmax.softmax_bwd): (dq, dk, dv); ``dropout_p``,
    ``seed`` and the score options those of the forward (the kernel regenerates the dropout
    mask; the slopes get no gradient)."""
    return _triton_bwd_impl(grad_out, q, k, v, out, lse, mask, scale, is_causal, dropout_p, seed,
                            window_left, window_right, softcap, alibi_slopes)


_triton_fwd.register_fake(_fwd_fake)
_triton_bwd.register_fake(_bwd_fake)


def _triton_setup_context(ctx, inputs, output):
    # inputs: (q, k, v, mask, scale, is_causal, dropout_p, seed) from _TritonAttention without
    # score options; (..., window_left, window_right, softcap, alibi_slopes) with them, or from
    # the registered op (torch.library fills in the defaults).  As _native_setup_context: the
    # number of saved tensors tells the backward which.
    out, lse = output
    if len(inputs) == 8:
        q, k, v, mask, scale, is_causal, dropout_p, seed = inputs
        ctx.save_for_backward(q, k, v, out, lse, mask, seed)
    else:  # the registered op's inputs end with the sinks
        q, k, v, mask, scale, is_causal, dropout_p, seed, left, right, softcap, alibi, *sinks = inputs
        ctx.save_for_backward(q, k, v, out, lse, mask, seed, alibi, sinks[0] if sinks else None)
        ctx.kernel_args = (left, right, softcap)
        ctx.num_inputs = len(inputs)
    ctx.scale, ctx.is_causal, ctx.dropout_p = scale, is_causal, dropout_p
    ctx.set_materialize_grads(False)


def _triton_backward(ctx, grad_out, grad_lse):
    saved = ctx.saved_tensors
    if len(saved) == 7:  # 8 inputs, no score options
        q, k, _, _, lse, mask, seed = saved
        kernel_args, sinks, no_grads = (), None, (None,) * 5
    else:  # 12 or 13 inputs: the score options passed on to the backward kernel[, the sinks]
        q, k, _, _, lse, mask, seed, alibi, sinks = saved
        kernel_args, no_grads = ctx.kernel_args + (alibi,), (None,) * (ctx.num_inputs - 3)
        saved = saved[:7]

    def differentiable_gradients():  # create_graph=True: a double backward will follow
        keep = None
        if ctx.dropout_p > 0.0:
            from ..kernels import softmax as kernels

            b, h, n, _ = q.shape
            keep = kernels.dropout_keep_mask(b, h, n, k.shape[2], ctx.dropout_p, int(seed), q.device)
        return _differentiable_gradients(q, k, saved[2], mask, ctx.is_causal, ctx.scale,
                                         _kernel_score_options(kernel_args, sinks), grad_out, grad_lse,
                                         ctx.dropout_p, keep)

    def run_bwd(g, v, out, with_dropout):
        p = ctx.dropout_p if with_dropout else 0.0
        return _TRITON_BWD_OP(g, q, k, v, out, lse, mask, ctx.scale, ctx.is_causal, p, seed, *kernel_args)

    if sinks is not None:  # the backward kernel on out', lse' as they are, and d sinks
        *grads, dsinks = _sink_backward(ctx, 12, lambda: _gradients(run_bwd, saved, grad_out, grad_lse),
                                        differentiable_gradients, sinks, saved[3], lse, grad_out, grad_lse)
        return (*grads, *no_grads[:-1], dsinks)
    if torch.is_grad_enabled():
        return (*differentiable_gradients(), *no_grads)
    dq, dk, dv = _gradients(run_bwd, saved, grad_out, grad_lse)
    return (dq, dk, dv, *no_grads)


_triton_fwd.register_autograd(_triton_backward, setup_context=_triton_setup_context)
_TRITON_FWD_DISPATCHED = torch.ops.attnkit.softmax_triton_fwd.default
_TRITON_BWD_DISPATCHED = torch.ops.attnkit.softmax_triton_bwd.default


_FUNCTORCH_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor


def _plain_eager(*tensors) -> bool:
    """Eager tensors of the plain type (no FakeTensor, FunctionalTensor or other subclass, no
    torch.func transform's wrapper -- those are of type Tensor --, not under torch.compile): the
    Triton launchers can take them directly."""
    return not torch.compiler.is_compiling() and all(
        type(t) is torch.Tensor and not _FUNCTORCH_WRAPPED(t) for t in tensors)


# Eager calls reach the launchers directly.  torch.library's dispatch of a Python custom op (the
# dispatcher, the backend_impl wrapper, its dynamo-disable frame) cost 77 us a call, most of the
# triton path's host time: the no-grad forward call took 120.5 us through the op and 43.1 us in
# the launcher alone (kernels stubbed, min of 5 x 3000 calls, AMD EPYC Zen 3, session 15). The
# op stays what torch.compile traces, and what these take whenever the inputs are not plain
# tensors (fake or functional ones while a graph is traced).  Lost in eager mode: the op's name
# in torch.profiler traces (the kernels keep theirs).
def _TRITON_FWD_OP(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args):
    if _plain_eager(q, k, v):
        return _triton_fwd_impl(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args)
    return _TRITON_FWD_DISPATCHED(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args)


def _TRITON_BWD_OP(g, q, k, v, out, lse, mask, scale, is_causal, dropout_p, seed, *kernel_args):
    if _plain_eager(g, q, k, v, out, lse):
        return _triton_bwd_impl(g, q, k, v, out, lse, mask, scale, is_causal, dropout_p, seed,
                                *kernel_args)
    return _TRITON_BWD_DISPATCHED(g, q, k, v, out, lse, mask, scale, is_causal, dropout_p, seed,
                                  *kernel_args)
register_kernel(FAMILY, "triton")


class _TritonAttention(torch.autograd.Function):
    """The eager path of ``attnkit::softmax_triton_fwd`` with its registered autograd, as
    :class:`_NativeAttention` is for the C++ op: the same setup_context and backward without
    torch.library's generic wrapper, which redispatches and re-fills the schema's defaults on
    every differentiable call (``torch._library.utils.fill_defaults`` rebuilds
    ``schema.arguments`` once per argument: 26-38 us for the old 8 arguments, 58-64 us for the
    12 with the score options).  Calling the op directly with grad went from ~98 to ~135 us
    (kernels stubbed out); softmax_attention(backend="triton") goes through here instead and
    got faster: forward+backward ~305 -> ~266 us, no-grad forward ~83 -> ~66 us (minimum of
    6 alternating runs, kernels stubbed, one thread, loaded 2-core AMD EPYC, AVX2).
    torch.compile still traces the op itself (:func:`_call_triton`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args):
        # kernel_args: () or the score options (window_left, window_right, softcap, alibi).
        inputs = (q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args)
        with _BELOW_AUTOGRAD():
            output = _TRITON_FWD_OP(*inputs)
        _triton_setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_triton_backward)


def _call_triton(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args):
    """attnkit::softmax_triton_fwd(q, k, v, mask, scale, is_causal, dropout_p, seed,
    *kernel_args) -> (out, lse), differentiable (``kernel_args``: () or the four score options).
    Eager: below autograd when no gradient is wanted, else :class:`_TritonAttention`; under
    torch.compile the op itself, as registered."""
    if torch.compiler.is_compiling():
        return torch.ops.attnkit.softmax_triton_fwd(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, mask):
        return _TritonAttention.apply(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args)
    with _BELOW_AUTOGRAD():
        return _TRITON_FWD_OP(q, k, v, mask, scale, is_causal, dropout_p, seed, *kernel_args)


# ==============================================================================================
# backend implementations (called by the public function after validation and routing)
# ==============================================================================================


def _kernel_mask(attn_mask, query, key):
    """The mask as the kernels read it: [B, H, N, M] (a stride-0 view over broadcast
    dimensions, never densified); a floating mask in the inputs' dtype, as the reference
    (and the docstring) has it."""
    if attn_mask is None:
        return None
    if attn_mask.is_floating_point() and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    b, h, n, _ = query.shape
    return attn_mask.expand(b, h, n, key.shape[2])


# ---- sinks around a kernel (issue 28): no kernel change ----------------------------------------


def _full_kernel_args(kernel_args) -> tuple:
    """The four score-option arguments of the ops, their defaults when ``kernel_args`` is ()
    (the sinks follow them positionally)."""
    return kernel_args or (-1, -1, 0.0, None)


class _NativeKernel:
    """The C++ ops of one call (mask, scale, is_causal and the score options the kernel computes
    fixed), as :class:`_WithSinks` runs them."""

    dropout_p = 0.0

    def __init__(self, mask, scale, is_causal, kernel_args):
        self.mask, self.scale, self.is_causal, self.kernel_args = mask, scale, is_causal, kernel_args

    def forward(self, q, k, v, sinks):
        """(out', lse') with the sinks: folded into each row's finish by the cpu kernel (one
        rounding of a 16-bit row); applied after the cuda kernels, which take no sinks."""
        with _BELOW_AUTOGRAD():
            if q.is_cuda:
                return score_options.add_sinks(*_FWD_OP(q, k, v, self.mask, self.scale, self.is_causal,
                                                        *self.kernel_args), sinks)
            return _FWD_OP(q, k, v, self.mask, self.scale, self.is_causal, *_full_kernel_args(self.kernel_args),
                           sinks)

    def backward(self, g, q, k, v, out, lse, _with_dropout):  # no dropout in the C++ kernels
        return _BWD_OP(g, q, k, v, out, lse, self.mask, self.scale, self.is_causal, *self.kernel_args)

    def differentiable(self, q, k, v, sinks):
        """forward's (out', lse') through the registered op's autograd (torch.compile)."""
        if q.is_cuda:
            return score_options.add_sinks(*_call_native_options(q, k, v, self.mask, self.scale,
                                                                 self.is_causal, self.kernel_args), sinks)
        return torch.ops.attnkit.softmax_fwd(q, k, v, self.mask, self.scale, self.is_causal,
                                             *_full_kernel_args(self.kernel_args), sinks)


    def probe_dim(self, q):
        return q.shape[-1] if q.is_cuda else None  # the CUDA kernels need Dv == D

    def dropout_mask(self, q, k):
        return None


class _TritonKernel:
    """The Triton ops of one call (with its dropout seed and the score options the kernel
    computes), as :class:`_WithSinks` runs them."""

    def __init__(self, mask, scale, is_causal, dropout_p, seed, kernel_args):
        self.mask, self.scale, self.is_causal = mask, scale, is_causal
        self.dropout_p, self.seed = dropout_p, seed
        self.kernel_args = kernel_args

    def forward(self, q, k, v, sinks):
        """(out', lse') with the sinks folded into each row's finish by the kernel."""
        with _BELOW_AUTOGRAD():
            return _TRITON_FWD_OP(q, k, v, self.mask, self.scale, self.is_causal, self.dropout_p, self.seed,
                                  *_full_kernel_args(self.kernel_args), sinks)

    def backward(self, g, q, k, v, out, lse, with_dropout):
        p = self.dropout_p if with_dropout else 0.0
        return _TRITON_BWD_OP(g, q, k, v, out, lse, self.mask, self.scale, self.is_causal, p,
                              self.seed, *self.kernel_args)

    def differentiable(self, q, k, v, sinks):  # the custom op carries its registered autograd
        return torch.ops.attnkit.softmax_triton_fwd(q, k, v, self.mask, self.scale, self.is_causal,
                                                    self.dropout_p, self.seed, *_full_kernel_args(self.kernel_args),
                                                    sinks)


    def probe_dim(self, q):
        return None

    def dropout_mask(self, q, k):
        if self.dropout_p == 0.0:
            return None
        from ..kernels import softmax as kernels

        b, h, n, _ = q.shape
        return kernels.dropout_keep_mask(b, h, n, k.shape[2], self.dropout_p, int(self.seed), q.device)


class _WithSinks(torch.autograd.Function):
    """Attention with learned sinks on a kernel backend (issue 28).

    Forward: ``kernel.forward`` gives (out', lse') with the sinks -- folded into each row's
    finish by the kernel where it can (one rounding of a 16-bit row), else the kernel without
    them followed by lse' = logaddexp(lse, sink) and out' = out · exp(lse - lse')
    (:func:`attnkit.score_options.add_sinks`).  Backward: the kernel's own
    backward given out' and lse' -- the probabilities it recomputes, exp(s - lse'), carry the sink
    in their denominator and D_i = rowsum(dO ∘ out') is the sink softmax's, so dq, dk, dv are
    exact; the lse's gradient through :func:`_gradients`' probe call, as without sinks -- and
    d sinks from :func:`attnkit.score_options.sink_gradient`.  ``kernel``: a _NativeKernel or
    _TritonKernel (non-tensor, no gradient).
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel):
        out, lse = kernel.forward(q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.kernel = kernel
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        kernel = ctx.kernel
        if torch.is_grad_enabled():  # create_graph=True: a double backward will follow
            options = ScoreOptions(sinks=sinks)
            if kernel.kernel_args:
                options = _kernel_score_options(kernel.kernel_args)
                options = ScoreOptions(options.window, options.softcap, options.alibi_slopes, sinks)
            grads = _differentiable_gradients(q, k, v, kernel.mask, kernel.is_causal, kernel.scale, options,
                                              grad_out, grad_lse, kernel.dropout_p, kernel.dropout_mask(q, k))
            return (*grads, None)
        dq = dk = dv = dsinks = None
        if any(ctx.needs_input_grad[:3]):
            def run_bwd(g, v_, out_, with_dropout):
                return kernel.backward(g, q, k, v_, out_, lse, with_dropout)

            dq, dk, dv = _gradients(run_bwd, (q, k, v, out, lse), grad_out, grad_lse, kernel.probe_dim(q))
        if ctx.needs_input_grad[3]:
            dsinks = score_options.sink_gradient(sinks, out, lse, grad_out, grad_lse)
        return dq, dk, dv, dsinks, None


def _with_sinks(kernel, q, k, v, sinks):
    """(out', lse') of ``kernel`` with ``sinks`` folded in, differentiable in q, k, v and sinks."""
    if torch.compiler.is_compiling():
        # Traced: the op with its registered autograd (the lse's gradient then takes the
        # backward's probe call: exact, one more kernel call).
        return kernel.differentiable(q, k, v, sinks)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, sinks):
        return _WithSinks.apply(q, k, v, sinks, kernel)
    with torch.no_grad():
        return kernel.forward(q, k, v, sinks)


# ---- the implementations --------------------------------------------------------------------


def _run_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                   options=None):
    # The reference computes in the inputs' dtype; it draws its dropout mask with torch.rand, so
    # results are reproducible under torch.manual_seed.
    extra = {} if options is None else options.reference_kwargs()
    return softmax_attention_reference(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse=return_lse, **extra
    )


def _run_native(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                options=None):
    # cpu and cuda: the same op, dispatched on the tensors' device.  GQA is native (H % Hk);
    # dropout_p is 0 here (routing).  Score options: the kernel computes window, softcap and
    # ALiBi (the cuda kernels none: routing); the cpu kernel folds the sinks into its rows'
    # finish, the cuda kernels' results get them after (_NativeKernel.forward).
    if not _NATIVE_OPS:
        raise BackendUnavailableError(
            f"{OP_NAME}: attnkit._C was built without the softmax ops; rebuild it "
            "(pip install --no-build-isolation -e .)"
        )
    mask = _kernel_mask(attn_mask, query, key)
    if options is None:
        out, lse = _call_native(query, key, value, mask, scale, is_causal)
    else:
        kernel_args = options.kernel_args() if options.in_scores else ()
        if options.sinks is None:
            out, lse = _call_native_options(query, key, value, mask, scale, is_causal, kernel_args)
        else:
            kernel = _NativeKernel(mask, scale, is_causal, kernel_args)
            out, lse = _with_sinks(kernel, query, key, value, options.sinks)
    return (out, lse) if return_lse else out


def _draw_seed(dropout_p: float) -> torch.Tensor:
    """The dropout seed: from torch's default (CPU) generator, so that a call is reproducible
    under torch.manual_seed; no draw without dropout (the random stream is left alone)."""
    if dropout_p > 0.0:
        return torch.randint(2**31 - 1, (), dtype=torch.int64)
    return torch.zeros((), dtype=torch.int64)


# Decoding on the triton backend (issue 26): up to this many query rows go to the split-KV kernel
# (attnkit.kernels.decode), which reads each K/V row once for all the query heads that share it
# and splits the keys over the GPU's SMs; the flash kernel gives a 1-row call one program per
# head.  H200, bf16 B=8 H=32 Hk=8 M=8192 D=128 N=4: 0.084 ms against SDPA's 0.347 (with the
# mask it needs there); N=1 0.92x SDPA (bench/RESULTS.md, 2026-11-27).
DECODE_MAX_ROWS = 16


def _decodes(query, key, value, attn_mask, dropout_p, is_causal, sinks=None) -> bool:
    """Whether a triton call goes to the decode kernel: 1..16 query rows and no mask, dropout
    or gradient (the kernel has no backward); causal only where N == M (the kernel aligns
    bottom-right, softmax_attention top-left: the same there); eager only (torch.compile
    traces the flash op, which has a fake and a backward).  The score options go with it (its
    window and ALiBi align bottom-right, as softmax_attention's)."""
    n, m = query.shape[2], key.shape[2]
    wanted = (query, key, value) if sinks is None else (query, key, value, sinks)
    return (attn_mask is None and dropout_p == 0.0 and 1 <= n <= DECODE_MAX_ROWS and m >= 1
            and (not is_causal or n == m)
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and torch._C._any_requires_grad(*wanted)))


def _run_triton(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                options=None):
    # The kernels compute every score option, the sinks folded into the rows' finish.  GQA is
    # native (H % Hk); dropout from the call's seed.
    if _decodes(query, key, value, attn_mask, dropout_p, is_causal, None if options is None else options.sinks):
        from ..kernels import decode

        extra = {}
        if options is not None:
            left, right, softcap, slopes = options.kernel_args()
            extra = dict(window_left=left, window_right=right, softcap=softcap, alibi_slopes=slopes,
                         sinks=options.sinks)
        out, lse = decode.softmax_decode_fwd(query, key, value, scale, is_causal=is_causal, **extra)
        return (out, lse) if return_lse else out
    mask = _kernel_mask(attn_mask, query, key)
    seed = _draw_seed(dropout_p)
    if options is None:
        out, lse = _call_triton(query, key, value, mask, scale, is_causal, dropout_p, seed)
    else:
        kernel_args = options.kernel_args() if options.in_scores else ()
        if options.sinks is None:
            out, lse = _call_triton(query, key, value, mask, scale, is_causal, dropout_p, seed, *kernel_args)
        else:
            kernel = _TritonKernel(mask, scale, is_causal, dropout_p, seed, kernel_args)
            out, lse = _with_sinks(kernel, query, key, value, options.sinks)
    return (out, lse) if return_lse else out


# backend name -> implementation with _run_reference's signature.
_IMPLEMENTATIONS = {
    "reference": _run_reference,
    "cpu": _run_native,
    "cuda": _run_native,
    "triton": _run_triton,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _kernel_limitation(backend, query, key, value, attn_mask, dropout_p, options=None) -> str:
    """'' when ``backend`` can run this call, else what it cannot do (routing rules)."""
    if backend == "reference":
        return ""
    if (
        attn_mask is not None
        and attn_mask.is_floating_point()
        and attn_mask.requires_grad
        and torch.is_grad_enabled()
    ):
        return "a floating attn_mask that requires grad (the kernels compute no mask gradient)"
    if options is not None:
        missing = [name for name in options.names if name not in BACKEND_OPTIONS[backend]]
        if missing:
            return (
                f"the score option{'s' if len(missing) > 1 else ''} {', '.join(missing)} (the "
                f"{backend} kernels run {', '.join(sorted(BACKEND_OPTIONS[backend])) or 'none of them'})"
            )
        slopes = options.alibi_slopes
        if slopes is not None and slopes.requires_grad and torch.is_grad_enabled():
            return "alibi_slopes that require grad (the kernels compute no gradient for the slopes)"
    dtype = query.dtype
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if backend == "cpu":
        if dropout_p > 0.0:
            return f"dropout_p > 0 (got {dropout_p}; the C++ CPU kernel has no dropout)"
    elif backend == "triton":
        if dtype not in TRITON_DTYPES:
            return f"{_dtype_name(dtype)} inputs (the Triton kernels take float16, bfloat16 and float32)"
        if not (1 <= head_dim <= TRITON_MAX_HEAD_DIM and 1 <= value_dim <= TRITON_MAX_HEAD_DIM):
            return (
                f"head dims D = {head_dim}, Dv = {value_dim} (the Triton kernels take head dims "
                f"1..{TRITON_MAX_HEAD_DIM})"
            )
    elif backend == "cuda":
        if dtype not in CUDA_DTYPES:
            return f"{_dtype_name(dtype)} inputs (the CUDA kernels take float16 and bfloat16)"
        hopper = (
            head_dim == value_dim == CUDA_HOPPER_HEAD_DIM
            and attn_mask is None
            and _cuda_hopper_kernels(query.device)
        )
        if (head_dim not in CUDA_HEAD_DIMS or value_dim != head_dim) and not hopper:
            return (
                f"head dims D = {head_dim}, Dv = {value_dim} (the CUDA kernels take D = Dv in "
                f"{CUDA_HEAD_DIMS}, and {CUDA_HOPPER_HEAD_DIM} without a mask on the Hopper kernels: "
                "ATTNKIT_CUDA_SM90 set, compute capability 9.0)"
            )
        if dropout_p > 0.0:
            return f"dropout_p > 0 (got {dropout_p}; the CUDA kernels have no dropout)"
    return ""


def _route(backend, query, key, value, attn_mask, dropout_p, options=None, is_causal=False) -> str:
    """The backend that runs this call: ``resolve``'s pick, unless that kernel cannot run the
    call -- then the reference when the backend was the default, an error when it was named.
    ``options``: the call's ScoreOptions, or None.  On a CUDA tensor with no backend named, the
    ``cuda`` kernels where the GPU dispatch table measured them faster on this shape
    (attnkit/_gpu_table.py) and they can run the call."""
    chosen = resolve(FAMILY, backend, query.device, OP_NAME)
    if (
        key.shape[-2] == query.shape[-2]
        and gpu_table.prefers_cuda(FAMILY, backend, chosen, query.device, query.dtype, query.shape[-1], is_causal,
                                   query.shape[-2], (query, key, value))
        and backend_status("cuda").usable
        and not _kernel_limitation("cuda", query, key, value, attn_mask, dropout_p, options)
    ):
        return "cuda"
    why_not = _kernel_limitation(chosen, query, key, value, attn_mask, dropout_p, options)
    if not why_not:
        return chosen
    named = backend is not None or bool(os.environ.get(ENV_VAR))
    if named:
        source = "backend" if backend is not None else ENV_VAR
        raise BackendUnavailableError(
            f"{OP_NAME}: the {chosen} backend ({source}={chosen!r}) cannot run {why_not}; "
            "use backend='reference', or leave backend=None to route such calls automatically"
        )
    # Default backend: the reference takes everything.  (No other kernel backend would do: on
    # a CUDA tensor the cuda kernels lack all that triton lacks; on a CPU tensor the only
    # other one is interpreted Triton, for debugging.)
    return "reference"


# ==============================================================================================
# public function
# ==============================================================================================


def _check_mask(attn_mask, query: torch.Tensor, target: tuple[int, ...], layout: str) -> None:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"{OP_NAME}: attn_mask must be a torch.Tensor or None; got {type(attn_mask).__name__}"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"{OP_NAME}: attn_mask must be bool (True = attend) or floating point (added to the "
            f"scores); got {str(attn_mask.dtype).replace('torch.', '')}"
        )
    if attn_mask.device != query.device:
        raise ValueError(
            f"{OP_NAME}: attn_mask must be on the device of query ({query.device}); got {attn_mask.device}"
        )
    # Broadcastable *to* the scores' shape: the mask may not enlarge the result (SDPA neither).
    shape = tuple(attn_mask.shape)
    fits = len(shape) <= len(target) and all(
        size == 1 or size == want for size, want in zip(reversed(shape), reversed(target))
    )
    if not fits:
        raise ValueError(
            f"{OP_NAME}: attn_mask must be broadcastable to {layout} = {list(target)}; "
            f"got shape {list(shape)}"
        )


def _broadcast_sizes(what: str, sizes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The broadcast of the named shapes (numpy rules, right-aligned), or a ValueError naming
    them.  Plain ints: torch.compile traces this without graph breaks."""
    rank = max(len(shape) for shape in sizes.values())
    result = []
    for i in range(rank):
        size = 1
        for shape in sizes.values():
            at = len(shape) - rank + i
            dim = shape[at] if at >= 0 else 1
            if dim != 1:
                if size not in (1, dim):
                    got = ", ".join(f"{name} {list(shape)}" for name, shape in sizes.items())
                    raise ValueError(f"{OP_NAME}: {what} must broadcast together; got {got}")
                size = dim
        result.append(size)
    return tuple(result)


class _Layout:
    """How the public shapes map onto the kernels' ``[B, H, N, D]``.

    ``query [..., Hq, N, D]``, ``key [..., Hk, M, D]``, ``value [..., Hk, M, Dv]`` (any number of
    leading dims, at least 2-D; fewer dims count as leading 1s, like SDPA).  The batch dims (all
    before the head dim) broadcast together and are flattened into B; the head dim is dim -3
    (absent for 2-D inputs: one head).  The kernels get views wherever strides allow (expand for
    broadcast dims -- stride 0 -- then reshape): no copy unless a tensor broadcasts over some
    of several batch dims but not all.
    """

    def __init__(self, query, key, value, enable_gqa):
        qs, ks, vs = query.shape, key.shape, value.shape
        self.rank = max(len(qs), len(ks), len(vs))
        if self.rank == 2:
            self.batch, self.heads, self.kv_heads = (), 1, 1
        else:
            if len(qs) == len(ks) == len(vs) and qs[:-3] == ks[:-3] == vs[:-3]:
                # The usual call: equal batch dims, nothing to broadcast.  This shortcut and the
                # head counts read without padded copies of the shapes: _Layout 7-12 -> 3-4 us
                # a call (issue 25, q [1, 4, 1, 128], k / v [1, 1, 16, 128], timeit, one
                # thread, loaded 2-core AMD EPYC Zen 3).
                self.batch = tuple(qs[:-3])
            else:
                self.batch = _broadcast_sizes(
                    "the batch dims (all before the head dim -3) of query, key and value",
                    {name: tuple(t.shape[:-3]) for name, t in (("query", query), ("key", key), ("value", value))},
                )
            # A tensor of fewer dims counts as having leading 1s: one head.
            hq, hk, hv = (shape[-3] if len(shape) >= 3 else 1 for shape in (qs, ks, vs))
            if hk != hv and 1 not in (hk, hv):
                check_size_match(OP_NAME, "number of heads Hk", {"key": hk, "value": hv})
            kv_heads = max(hk, hv) if 1 in (hk, hv) else hk
            heads = hq
            if hq != kv_heads:
                if kv_heads == 1:
                    pass  # broadcast K/V heads: every query head reads the one K/V head
                elif hq == 1:
                    heads = kv_heads  # broadcast the query's head (SDPA's matmul does)
                elif not enable_gqa:
                    raise ValueError(
                        f"{OP_NAME}: query and key must have the same number of heads unless "
                        f"enable_gqa=True; got query {hq}, key {kv_heads}"
                    )
                elif kv_heads == 0 or hq % kv_heads != 0:  # (Hk = 0 raised ZeroDivisionError)
                    raise ValueError(
                        f"{OP_NAME}: with enable_gqa the query's heads must be a multiple of the "
                        f"key's; got query {hq}, key {kv_heads}"
                    )
            self.heads, self.kv_heads = heads, kv_heads
        self.flat_batch = math.prod(self.batch)
        self.gqa = self.heads != self.kv_heads  # the kernels' grouped heads (H % Hk == 0)

    @property
    def out_lead(self) -> tuple[int, ...]:
        """The result's dims before [N, Dv]."""
        return () if self.rank == 2 else (*self.batch, self.heads)

    def scores_shape(self, n: int, m: int) -> tuple[int, ...]:
        return (*self.out_lead, n, m)

    def to_kernel(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """``t`` (one of q, k, v) as ``[B, heads, rows, cols]``."""
        if t.dim() == 4 and self.rank == 4 and t.shape[0] == self.flat_batch and t.shape[1] == heads:
            return t  # already the kernels' layout: the common call pays nothing
        rows, cols = t.shape[-2], t.shape[-1]
        t = t.reshape((1,) * (self.rank - t.dim()) + tuple(t.shape))  # a view: leading 1s
        if self.rank == 2:
            return t.reshape(1, 1, rows, cols)
        t = t.expand(*self.batch, heads, rows, cols)
        return t.reshape(self.flat_batch, heads, rows, cols)

    def mask_to_kernel(self, mask: torch.Tensor) -> torch.Tensor:
        """The mask as ``[B or 1, H or 1, N or 1, M or 1]`` (the kernels expand it)."""
        if self.rank == 4 and mask.dim() == 4:
            # Already [B or 1, H or 1, N or 1, M or 1] (_check_mask): what the reshapes below
            # would return, without their ~2-4 us a call (issue 25, timeit, loaded 2-core AMD
            # EPYC Zen 3).
            return mask
        rank = len(self.out_lead) + 2
        mask = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
        if self.rank == 2:
            return mask.reshape(1, 1, *mask.shape)
        tail = tuple(mask.shape[-3:])
        if all(size == 1 for size in mask.shape[:-3]):
            return mask.reshape(1, *tail)  # batch-broadcast mask: stays one batch
        return mask.expand(*self.batch, *tail).reshape(self.flat_batch, *tail)

    def options_to_kernel(self, options: ScoreOptions | None) -> ScoreOptions | None:
        """The score options on the kernels' layout (ALiBi slopes as [B, H] views)."""
        return None if options is None else options.to_kernel(self.flat_batch, self.heads)

    def restore(self, out: torch.Tensor, lse: torch.Tensor | None):
        out = out.reshape(*self.out_lead, *out.shape[-2:])
        if lse is not None:
            lse = lse.reshape(*self.out_lead, lse.shape[-1])
        return out, lse


def _nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, backend, window,
            softcap, alibi_slopes, sinks):
    """Nested tensors, as SDPA takes them: the packed path (ops/varlen.py), which checks them."""
    from .varlen import softmax_attention_nested

    return softmax_attention_nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                                    backend, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


def softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Scaled dot-product (softmax) attention with the semantics of
    :func:`torch.nn.functional.scaled_dot_product_attention`.

    ``out[..., h, i] = Σ_j softmax_j(scale · q_i·k_j + bias_ij) · v_j``

    Shapes are SDPA's: any number of leading batch dims, at least 2-D.

    Args:
        query: ``[..., H, N, D]`` -- typically ``[B, H, N, D]``; ``[H, N, D]`` and ``[N, D]``
            (one head) work too, and so do more batch dims (``[B1, B2, H, N, D]``).  Or, with
            key and value alike, a nested tensor of the jagged layout ``[B, H, j, D]`` as SDPA
            takes it (each sequence attends within itself; run as one
            :func:`attnkit.softmax_attention_varlen` call; the results nested with query's
            offsets; no ``attn_mask``; ``is_causal`` per sequence, which SDPA's nested path lacks).
        key: ``[..., Hk, M, D]`` (M may differ from N).
        value: ``[..., Hk, M, Dv]`` (Dv may differ from D).
            query, key and value share one floating dtype (float16, bfloat16, float32, float64)
            and one device; any strides (transposed, sliced from a fused qkv tensor, expanded
            with stride 0).  A tensor with fewer dims counts as having leading 1s.  The batch
            dims (all before dim -3, the heads) broadcast together like SDPA's (sizes equal or
            1); a head count of 1 broadcasts against the others' too.  The kernels see the
            batch dims flattened into one: a view of each input (stride 0 where it broadcasts),
            no copy -- except for a tensor that broadcasts over some of several batch dims but
            not all (e.g. key ``[1, B2, H, M, D]`` against query ``[B1, B2, H, N, D]``), which
            the flattening expands in memory.
        attn_mask: None, or a tensor broadcastable to the scores ``[..., H, N, M]`` (the result's
            batch dims; it may not enlarge them): bool (True = attend, False = masked out) or
            floating point (added to the scores; any floating dtype, cast to the inputs' dtype;
            -inf masks out).  The kernels read a broadcast mask through stride-0 views: it is
            never expanded in memory.
        dropout_p: probability in ``[0, 1)`` of zeroing each attention probability (kept ones
            are scaled by ``1 / (1 - dropout_p)``).  Applied whenever it is > 0, like SDPA
            (there is no training flag).  The randomness comes from torch's default generator
            (the reference draws its mask with ``torch.rand``; the Triton kernels draw one
            Philox seed with ``torch.randint`` and regenerate the mask from it in the backward),
            so a call is reproducible under ``torch.manual_seed`` -- but the masks of different
            backends differ.
        is_causal: key j is visible to query i only when ``j <= i`` (top-left aligned, like SDPA,
            also when M != N).  Cannot be combined with ``attn_mask`` (SDPA neither).
        scale: multiplies ``q·k``; default ``1 / sqrt(D)``.  Any finite number.
        enable_gqa: grouped-query attention: when ``H != Hk`` (H must be a multiple of Hk),
            query head h uses key/value head ``h // (H // Hk)``.  Without it ``H == Hk``.
            The kernels never repeat K / V in memory.
        return_lse: also return the log-sum-exp of each row's (scaled, masked) scores (with
            ``sinks``: of the keys' scores *and* the sink, log Z_i below).
        window: ``(left, right)`` sliding window (FlashAttention's ``window_size``): key j is
            visible to query i iff ``i + M - N - left <= j <= i + M - N + right`` (aligned
            bottom-right like FlashAttention: the last query sits at the last key); a bound of
            -1 leaves that side unbounded.  Default None = ``(-1, -1)``.  ``window=(w, 0)``
            with ``M == N`` is causal attention to the last w + 1 keys.  Intersected with
            ``is_causal`` (top-left) and ``attn_mask``: a row left with no key is empty.
        softcap: logit soft-capping (FlashAttention's ``softcap``, Gemma 2): when > 0 each score
            s = scale · q·k becomes ``softcap · tanh(s / softcap)`` before ALiBi and the masks.
            0 (default) = off.  It maps a ±inf score to ±softcap.
        alibi_slopes: ALiBi (FlashAttention's ``alibi_slopes``): float32 ``[H]`` or ``[*batch,
            H]`` (the result's batch dims, e.g. ``[B, H]``); adds ``-slope_h · |i + M - N - j|``
            to the (capped) scores, before the masks.
        sinks: learned attention sinks (gpt-oss's ``s_aux``, FlashAttention-4's
            ``learnable_sink``): float32 ``[H]``, one extra logit per head in each row's softmax
            denominator, with no value: ``Z_i = Σ_j exp(s_ij) + exp(sink_h)``,
            ``out_i = Σ_j exp(s_ij) / Z_i · v_j``, ``lse_i = log Z_i``.  A row with no visible
            key then gives out 0 and lse = sink.  Differentiable (sinks get a gradient).  The
            cpu and triton kernels fold the sink into each row before it is rounded to the
            inputs' dtype; after the cuda kernels (out, lse) are rescaled (lse' =
            logaddexp(lse, sink), out' = out · exp(lse - lse'), in float32), which rounds a
            16-bit row twice (up to ~1 ulp).  The backward kernels take (out', lse') as they
            are; d sinks from ``attnkit.score_options``.
        backend: ``"reference" | "cpu" | "triton" | "cuda"`` or None; see *Backends*.

    Returns:
        ``out`` ``[..., H, N, Dv]`` (the broadcast batch dims; ``[N, Dv]`` for 2-D inputs) in
        the inputs' dtype; with ``return_lse`` the tuple ``(out, lse)``, lse ``[..., H, N]`` in
        float32 (float64 for float64 inputs).

    A row with no key to attend to (fully masked, or M = 0) gives output 0 and lse -inf, and
    zero gradients -- never NaN (SDPA gives NaN there).  NaN and ±Inf inputs propagate as in
    SDPA: a NaN in a query row makes that output row NaN; a NaN in a key (or an inf that makes a
    score +inf, or a NaN in a floating mask) makes NaN every row that can see that key (its lse
    NaN -- or +inf for a +inf score); a NaN (or ±Inf) in a value row reaches at least every row
    that can see it.  A fully masked row stays 0 (lse -inf).  Empty N or M give empty / zero results.
    Differentiable in query, key, value, a floating ``attn_mask`` and ``alibi_slopes`` (reference
    only, see below), ``sinks``, and through ``lse`` too.  The kernel backends are differentiable once (their backward is a
    kernel); double backward needs ``backend="reference"``.

    Backends:
        ``reference`` (pure PyTorch, any device and dtype; materializes the ``N × M`` scores),
        ``cpu`` (C++ flash kernel, CPU tensors: float16 / bfloat16 / float32 / float64, any head
        dim, fp32 accumulation -- fp64 for float64), ``triton`` (flash kernels, CUDA tensors, or
        CPU tensors under ``TRITON_INTERPRET=1``: float16 / bfloat16 / float32, head dims
        1..256), ``cuda`` (CUDA C++ kernels: float16 / bfloat16, D = Dv ∈ {64, 128}, sm_80+; and
        D = Dv = 256 without a mask where the Hopper kernels run: ``ATTNKIT_CUDA_SM90`` set,
        compute capability 9.0).
        ``backend=None`` (and no ``ATTNKIT_BACKEND`` in the environment) picks ``cpu`` for CPU
        tensors and ``triton`` for CUDA tensors (the reference where that backend is not
        usable here), then routes a call the picked kernel cannot run to the reference:

        - ``cpu``: ``dropout_p > 0`` (the C++ kernel has no dropout);
        - ``triton``: float64 inputs; a head dim D or Dv above 256;
        - ``cuda``: dtypes other than float16 / bfloat16; head dims other than D = Dv ∈ {64, 128}
          (or 256 as above);
          ``dropout_p > 0``; ``window``, ``softcap``, ``alibi_slopes``;
        - every kernel: a floating ``attn_mask``, or ``alibi_slopes``, that requires grad while
          grad mode is on (the kernels compute no gradient for them).

        ``sinks`` run on every backend; ``window``, ``softcap`` and ``alibi_slopes`` on the
        ``cpu`` and ``triton`` kernels (not the ``cuda`` ones).  Which score options each backend
        runs: ``attnkit.score_options.BACKEND_OPTIONS``.

        A backend named explicitly (``backend=`` or ``ATTNKIT_BACKEND``) is never replaced: such
        a call raises :class:`attnkit.BackendUnavailableError` naming the limitation, as does a
        backend that cannot run here at all (not built, no GPU, ...).

    Raises:
        TypeError: a non-tensor, non-floating q/k/v, a mask that is neither bool nor floating,
            a non-bool flag, a non-finite or non-numeric ``scale`` / ``dropout_p`` /
            ``softcap``, a ``window`` that is not a pair of ints, ``alibi_slopes`` / ``sinks``
            that are not float32 tensors.
        ValueError: fewer than 2 dims, mismatched sizes / dtypes / devices, batch dims that do
            not broadcast, head counts that do not fit (GQA), a mask that does not broadcast to
            the scores ``[..., H, N, M]`` or lies on another
            device, ``attn_mask`` with ``is_causal``, ``dropout_p`` outside ``[0, 1)``, a window
            bound below -1, a negative ``softcap``, ``alibi_slopes`` / ``sinks`` of another
            shape or device, an unknown backend.
        attnkit.BackendUnavailableError: the backend asked for cannot run here, or cannot run
            this call (see *Backends*).

    Example::

        >>> q = torch.randn(2, 8, 128, 64)
        >>> k = v = torch.randn(2, 2, 256, 64)
        >>> out, lse = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True,
        ...                                      return_lse=True)
        >>> out.shape, lse.shape, lse.dtype
        (torch.Size([2, 8, 128, 64]), torch.Size([2, 8, 128]), torch.float32)
        >>> # Mistral-style sliding window of 4096 keys, Gemma-2 softcap, gpt-oss sinks
        >>> out = attnkit.softmax_attention(q, k, v, enable_gqa=True, window=(4095, 0), softcap=50.0,
        ...                                 sinks=torch.zeros(8))
    """
    if _autocast.any_enabled():  # SDPA's autocast policy (pytorch_ext/_autocast.py)
        query, key, value = _autocast.cast_inputs(query, key, value)
    if query.__class__ is not _Tensor and getattr(query, "is_nested", False):  # (a jagged tensor's class)
        return _nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, backend,
                       window, softcap, alibi_slopes, sinks)
    # --- fast path: the common call (three 4-D [B, H, N, D] tensors of one floating dtype and
    # device, equal heads -- or grouped ones, enable_gqa with Hk = Hv dividing H --, no mask, no
    # dropout, plain bool flags) passes every check below by construction and needs no layout
    # change (the kernels take grouped heads as they are), so it goes straight to routing.
    # Anything else, valid or not, takes the full path, which raises the documented errors.
    # Measured at B=H=1 N=16 D=64 float32 (one thread, CPU time): the checks and _Layout cost
    # ~8 us a call.  GQA took the full path before issue 25: q [1, 4, 1, 128], k / v [1, 1, 16,
    # 128] float32, one thread, no_grad, ~50-70 us a call against ~11-15 us with equal heads
    # (SDPA ~9; loaded 2-core AMD EPYC Zen 3) -- the decode step of a GQA model's KV cache.
    if (
        attn_mask is None
        and window is None
        and alibi_slopes is None
        and sinks is None
        and type(is_causal) is bool
        and type(enable_gqa) is bool
        and type(return_lse) is bool
        and type(dropout_p) in (float, int)
        and dropout_p == 0
        and (scale is None or (type(scale) in (float, int) and -math.inf < scale < math.inf))
        # no score option (issue 28).  `softcap.__class__ is float` rather than `type(softcap) in
        # (float, int)`: measured 0.15 against 0.33 us a call over the old signature's (timeit,
        # loaded 2-core AMD EPYC).  softcap=0 as an int takes the full path (no options either).
        and softcap.__class__ is float
        and softcap == 0.0
        and isinstance(query, _Tensor)
        and isinstance(key, _Tensor)
        and isinstance(value, _Tensor)
    ):
        # The shapes unpacked in a try (a rank other than 4 raises) rather than compared by
        # ndim, and `is` on the dtypes: each tensor attribute read costs ~0.1 us, and at N=16
        # issue 25 allows 2 us over SDPA's whole call.
        dtype = query.dtype
        try:
            (b, h, n, d), (bk, hk, m, dk), (bv, hv, mv, _) = query.shape, key.shape, value.shape
        except (ValueError, RuntimeError):
            pass  # not three 4-D tensors (RuntimeError: a nested tensor of the strided layout): the full path
        else:
            if (
                dtype in FLOATING
                and key.dtype is dtype
                and value.dtype is dtype
                and b == bk == bv
                and hk == hv
                and (h == hk or (enable_gqa and hk > 0 and h % hk == 0))
                and d == dk
                and m == mv
            ):
                scale = (1.0 / math.sqrt(d) if d > 0 else 1.0) if scale is None else float(scale)
                # The default (or backend="cpu") call on CPU tensors: _route's pick spelled out
                # -- the cpu kernel runs every such call (_kernel_limitation: nothing without
                # mask, dropout or score options) -- and _run_native / _call_native inlined.
                # CPU tensors all share one device.  Issue 25, B=H=1 N=16 D=64 float32, one
                # thread, CPU time (loaded AMD EPYC): 15.1 -> 10.8 us a forward (SDPA 7.6),
                # ~2 us of it Python; the kernel call below alone is ~8 us.
                if (
                    _NATIVE_OPS
                    and b * h
                    and query.is_cpu
                    and key.is_cpu
                    and value.is_cpu
                    and _IMPLEMENTATIONS["cpu"] is _run_native  # (tests spy on the implementations)
                    and native_cpu(FAMILY, backend)
                    and not _is_compiling()
                ):
                    try:
                        if (query.requires_grad or key.requires_grad or value.requires_grad) and _grad_enabled():
                            result = _native_apply(query, key, value, None, scale, is_causal)
                        else:
                            with _BELOW_AUTOGRAD():
                                result = _FWD_CALL(query, key, value, None, scale, is_causal)
                    except NotImplementedError:
                        # A sparse-layout tensor (no kernel for its dispatch key; nothing ran):
                        # check_tensor reports it.  (A try costs nothing in Python 3.11.)
                        for name, t in (("query", query), ("key", key), ("value", value)):
                            check_tensor(OP_NAME, name, t, "[..., N, D]")
                        raise
                    return result if return_lse else result[0]
                if query.device == key.device == value.device:
                    chosen = _route(backend, query, key, value, None, 0.0, None, is_causal)
                    implementation = _IMPLEMENTATIONS["reference" if b * h == 0 else chosen]
                    return implementation(query, key, value, None, 0.0, is_causal, scale, h != hk, return_lse)

    # --- validation: everything before any computation ---
    if any(getattr(t, "is_nested", False) for t in (query, key, value)):
        return _nested(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, backend,
                       window, softcap, alibi_slopes, sinks)
    check_tensor(OP_NAME, "query", query, "[..., N, D]")
    check_tensor(OP_NAME, "key", key, "[..., M, D]")
    check_tensor(OP_NAME, "value", value, "[..., M, Dv]")
    # The shared checks are called (to raise their errors) only when a test fails: building
    # their dicts cost ~1.5 us each a call (issue 25, timeit, loaded 2-core AMD EPYC Zen 3).
    dtype, device = query.dtype, query.device
    if key.dtype != dtype or value.dtype != dtype or key.device != device or value.device != device:
        check_same_dtype_device(OP_NAME, {"query": query, "key": key, "value": value})
    n, head_dim = query.shape[-2], query.shape[-1]
    m = key.shape[-2]
    if key.shape[-1] != head_dim:
        check_size_match(OP_NAME, "head dim D", {"query": head_dim, "key": key.shape[-1]})
    if value.shape[-2] != m:
        check_size_match(OP_NAME, "sequence length M", {"key": m, "value": value.shape[-2]})
    # Flags must be real bools, like SDPA, which rejects is_causal=1: a number there is
    # probably a misplaced positional argument.
    check_bool(OP_NAME, "is_causal", is_causal)
    check_bool(OP_NAME, "enable_gqa", enable_gqa)
    check_bool(OP_NAME, "return_lse", return_lse)
    layout = _Layout(query, key, value, enable_gqa)
    if attn_mask is not None:
        if is_causal:
            raise ValueError(
                f"{OP_NAME}: attn_mask and is_causal=True cannot be combined (like SDPA); "
                "fold the causal condition into the mask instead"
            )
        names = {2: "[N, M]", 3: "[H, N, M]", 4: "[B, H, N, M]"}.get(layout.rank, "[..., H, N, M]")
        _check_mask(attn_mask, query, layout.scores_shape(n, m), names)
    check_real(OP_NAME, "dropout_p", dropout_p, low=0.0)
    if dropout_p >= 1.0:
        # p = 1 would drop every probability and then divide by 1 - p = 0.
        raise ValueError(f"{OP_NAME}: dropout_p must be < 1; got {dropout_p!r}")
    check_real(OP_NAME, "scale", scale, allow_none=True)
    # The score options (issue 28), validated once; None when all are default.
    options = score_options.build(OP_NAME, window, softcap, alibi_slopes, sinks, heads=layout.heads,
                                  batch=layout.batch, device=device)

    # --- the kernels' layout [B, H, N, D]: views of the inputs where strides allow ---
    q4 = layout.to_kernel(query, layout.heads)
    k4 = layout.to_kernel(key, layout.kv_heads)
    v4 = layout.to_kernel(value, layout.kv_heads)
    mask4 = None if attn_mask is None else layout.mask_to_kernel(attn_mask)
    options4 = layout.options_to_kernel(options)

    chosen = _route(backend, q4, k4, v4, mask4, dropout_p, options4, is_causal)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    # No (batch, head) pair at all: the reference's empty result, attached to the graph (as
    # sparse_attention does; the Triton launcher rejects H = Hk = 0).
    implementation = _IMPLEMENTATIONS["reference" if q4.shape[0] * q4.shape[1] == 0 else chosen]
    args = (q4, k4, v4, mask4, float(dropout_p), is_causal, float(scale), layout.gqa, return_lse)
    result = implementation(*args) if options4 is None else implementation(*args, options4)
    if layout.rank == 4:
        return result  # already in the caller's shape
    out, lse = result if return_lse else (result, None)
    out, lse = layout.restore(out, lse)
    return (out, lse) if return_lse else out

"""Linear (kernelized) attention: ``attnkit.linear_attention`` and ``attnkit.linear_attention_step``.

Layers (DESIGN.md):

- **op** -- ``attnkit::linear_fwd`` / ``attnkit::linear_bwd``, the C++ ops (schemas in
  ``csrc/ops.cpp``; CPU kernels in ``csrc/cpu/linear.cpp``: chunked causal, two-pass
  non-causal, fused feature maps, fp32 states; CUDA kernels in ``csrc/cuda/linear.cu``, the
  ``cuda`` backend).  This module gives them fake (meta)
  implementations, so that ``torch.compile(fullgraph=True)`` traces them, and the autograd
  formula, whose backward is the ``linear_bwd`` kernel (gradients for q, k, v and the initial
  state).  They are registered only when ``attnkit._C`` loads; without it the package still
  imports and the ``cpu`` backend reports why it cannot run.
- **op** -- ``attnkit::linear_triton_fwd`` / ``attnkit::linear_triton_bwd``: ``torch.library``
  custom ops around the launchers of ``attnkit.kernels.linear`` (the ``triton`` backend), with
  the same outputs, fake implementations and autograd formula.
- **public functions** -- validate every input, pick the backend
  (:func:`attnkit._dispatch.resolve`, then :func:`_route` for what a kernel cannot run) and
  call its entry of :data:`_IMPLEMENTATIONS`.

The op computes, per (batch, head), with S0 / z0 an optional initial state::

    S_i = S0 + Σ_{j∈S_i} φ(k_j) v_jᵀ,  z_i = z0 + Σ_{j∈S_i} φ(k_j)
    num_i = φ(q_i)ᵀ S_i,  den_i = φ(q_i)·z_i
    out_i = num_i / (den_i + eps)  (normalize)   or   scale · num_i

and returns ``(out, den, S, z)``: den without eps (the backward needs it) and the state after
every key, all but ``out`` in the accumulation dtype (float32; float64 for float64 inputs).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .. import _gpu_table as gpu_table
from .._double_backward import reference_gradients
from .._dispatch import (
    ENV_VAR,
    BackendUnavailableError,
    backend_status,
    native_ops_declared,
    register_kernel,
    resolve,
)
from .._validation import (
    FLOATING,
    RANK_HINT,
    check_bool,
    check_choice,
    check_real,
    check_same_dtype_device,
    check_size_match,
    check_tensor,
)
from ..reference.linear import (
    FEATURE_MAPS,
    _causal_sums,
    _noncausal_sums,
    feature_map_reference,
    linear_attention_reference,
    linear_attention_step_reference,
    state_dtype,
)

FAMILY = "linear"
OP_NAME = "attnkit.linear_attention"
STEP_OP_NAME = "attnkit.linear_attention_step"


# ==============================================================================================
# op layer: attnkit::linear_fwd / attnkit::linear_bwd (C++; the cpu backend)
# ==============================================================================================


_NATIVE_OPS = native_ops_declared("linear_fwd", "linear_bwd")


def _fwd_fake(q, k, v, S0, z0, causal, feature_map, normalize, eps, scale):
    b, h, n, d = q.shape
    acc = state_dtype(q.dtype)
    return (
        q.new_empty((b, h, n, v.shape[-1])),
        q.new_empty((b, h, n), dtype=acc),
        q.new_empty((b, h, d, v.shape[-1]), dtype=acc),
        q.new_empty((b, h, d), dtype=acc),
    )


def _bwd_fake(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0, causal,
              feature_map, normalize, eps, scale):
    # The kernel returns contiguous gradients whatever the inputs' strides.
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        S.new_empty(S.shape),
        z.new_empty(z.shape),
    )


def _reference_outputs(q, k, v, S0, z0, causal, feature_map, normalize, eps, scale):
    """linear_fwd's four outputs from the reference, differentiable (for a double backward),
    computed in the accumulation dtype."""
    acc = state_dtype(q.dtype)
    phi_q = feature_map_reference(q.to(acc), feature_map)
    phi_k = feature_map_reference(k.to(acc), feature_map)
    v_acc = v.to(acc)
    num, den = (_causal_sums if causal else _noncausal_sums)(phi_q, phi_k, v_acc, True)
    den = den.squeeze(-1)
    S = torch.matmul(phi_k.transpose(-2, -1), v_acc)
    z = phi_k.sum(dim=-2)
    if S0 is not None:
        num = num + torch.matmul(phi_q, S0)
        den = den + (phi_q * z0.unsqueeze(-2)).sum(-1)
        S, z = S + S0, z + z0
    if not normalize:
        out = num * scale
    elif k.shape[-2] == 0 and S0 is None:
        out = num  # empty sums: 0, as the kernel has it
    else:
        out = num / (den.unsqueeze(-1) + eps)
    return out.to(q.dtype), den, S, z


def _setup_context(ctx, inputs, output):
    q, k, v, S0, z0, causal, feature_map, normalize, eps, scale = inputs
    out, den, S, z = output
    ctx.save_for_backward(q, k, v, out, den, S, z, S0, z0)
    ctx.args = (causal, feature_map, normalize, eps, scale)
    # Unused outputs (den always; the state unless return_state) get grad None, not zeros.
    ctx.set_materialize_grads(False)


def _native_bwd(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0, causal,
                feature_map, normalize, eps, scale):
    return _BWD_OP(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0, causal,
                   feature_map, normalize, eps, scale)


def _triton_bwd_call(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S, z, S0, z0, causal,
                     feature_map, normalize, eps, scale):
    # (S, z are not needed: the Triton backward recomputes the chunk states.)
    return torch.ops.attnkit.linear_triton_bwd(grad_out, grad_den, grad_S, grad_z, q, k, v, out,
                                               den, S0, z0, causal, feature_map, normalize, eps,
                                               scale)


def _backward(ctx, grad_out, grad_den, grad_S, grad_z, run_bwd=_native_bwd):
    """Gradients of (out, den, S, z) with respect to q, k, v and the initial state (S0, z0).

    Normally the backward kernel (``run_bwd``: chunked, no N x D x Dv tensor).  Under
    ``create_graph=True`` (a double backward will follow) the gradients come from the reference
    recomputed on the saved inputs instead, since the kernels have no autograd of their own.
    """
    q, k, v, out, den, S, z, S0, z0 = ctx.saved_tensors
    causal, feature_map, normalize, eps, scale = ctx.args
    want = ctx.needs_input_grad
    if torch.is_grad_enabled():
        inputs = [t for t in (q, k, v, S0, z0) if t is not None]
        outputs = _reference_outputs(q, k, v, S0, z0, causal, feature_map, normalize, eps, scale)
        pairs = [(o, g) for o, g in zip(outputs, (grad_out, grad_den, grad_S, grad_z)) if g is not None]
        grads = reference_gradients([o for o, _ in pairs], inputs, [g for _, g in pairs])
        dq, dk, dv = grads[:3]
        dS0, dz0 = (grads[3], grads[4]) if S0 is not None else (None, None)
    else:
        dq, dk, dv, dS0, dz0 = run_bwd(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S,
                                       z, S0, z0, causal, feature_map, normalize, eps, scale)
    return (
        dq if want[0] else None,
        dk if want[1] else None,
        dv if want[2] else None,
        dS0 if want[3] else None,
        dz0 if want[4] else None,
        None, None, None, None, None,
    )


if _NATIVE_OPS:
    torch.library.register_fake("attnkit::linear_fwd", _fwd_fake)
    torch.library.register_fake("attnkit::linear_bwd", _bwd_fake)
    torch.library.register_autograd("attnkit::linear_fwd", _backward, setup_context=_setup_context)
    _FWD_OP = torch.ops.attnkit.linear_fwd.default
    _BWD_OP = torch.ops.attnkit.linear_bwd.default

    class _NativeLinear(torch.autograd.Function):
        """The eager path of ``attnkit::linear_fwd`` with its registered autograd: the same
        setup_context and backward, without torch.library's generic wrapper around them (which
        re-fills the schema's defaults, packs the dispatch key set and redispatches on every
        call: ~10 us of a forward, ~30 us of a forward+backward at B=H=1 N=16 D=64 float32, one
        thread).  torch.compile still traces the op itself (see _call_native)."""

        @staticmethod
        def forward(ctx, *args):
            with _BELOW_AUTOGRAD():
                output = _FWD_OP(*args)
            _setup_context(ctx, args, output)
            return output

        backward = staticmethod(_backward)

_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd


def _call_native(q, k, v, S0, z0, causal, feature_map, normalize, eps, scale):
    """attnkit::linear_fwd(...) -> (out, den, S, z), differentiable.  Eager calls skip the
    Python autograd kernel that register_autograd installs: straight to the kernel below
    autograd when no gradient is wanted, else through _NativeLinear (the same formula).
    Under torch.compile the op itself, as registered."""
    args = (q, k, v, S0, z0, causal, feature_map, normalize, eps, scale)
    if torch.compiler.is_compiling():
        return torch.ops.attnkit.linear_fwd(*args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, S0, z0):
        return _NativeLinear.apply(*args)
    with _BELOW_AUTOGRAD():
        return _FWD_OP(*args)

# Unconditionally: when attnkit._C is missing (or built without CUDA), the dispatcher reports
# the cpu / cuda backends unusable with the reason.  The CUDA kernels (csrc/cuda/linear.cu)
# implement the same two ops for CUDA tensors, so the fake and autograd registrations above
# serve both.
register_kernel(FAMILY, "cpu")
register_kernel(FAMILY, "cuda")


# ==============================================================================================
# op layer: the Triton kernels (attnkit.kernels.linear) as custom ops attnkit::linear_triton_*
# ==============================================================================================
# custom_op with an explicit fake, not triton_op: under TRITON_INTERPRET=1 triton_op's automatic
# fake would run the interpreted kernels on FakeTensors.  The kernel module is imported inside
# the op bodies: importing triton is slow, and TRITON_INTERPRET is read when the kernels are
# decorated.  Same outputs and conventions as the C++ ops (states in float32: the Triton
# kernels take float16 / bfloat16 / float32 inputs).

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("attnkit::linear_triton_fwd", mutates_args=())
def _triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    S0: Optional[torch.Tensor],
    z0: Optional[torch.Tensor],
    causal: bool,
    feature_map: str,
    normalize: bool,
    eps: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, den, S, z) as attnkit::linear_fwd, from attnkit.kernels.linear.linear_fwd."""
    from ..kernels import linear as kernels

    out, S, z, den = kernels.linear_fwd(
        q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
        scale=scale, initial_state=None if S0 is None else (S0, z0),
    )
    return out, den, S, z


@torch.library.custom_op("attnkit::linear_triton_bwd", mutates_args=())
def _triton_bwd(
    grad_out: Optional[torch.Tensor],
    grad_den: Optional[torch.Tensor],
    grad_S: Optional[torch.Tensor],
    grad_z: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    den: torch.Tensor,
    S0: Optional[torch.Tensor],
    z0: Optional[torch.Tensor],
    causal: bool,
    feature_map: str,
    normalize: bool,
    eps: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dS0, dz0) from attnkit.kernels.linear.linear_bwd (dS0, dz0: zeros when
    there is no initial state -- an op returns tensors, never None)."""
    from ..kernels import linear as kernels

    grads = kernels.linear_bwd(
        grad_out, q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
        scale=scale, initial_state=None if S0 is None else (S0, z0), grad_S=grad_S,
        grad_z=grad_z, grad_den=grad_den, out=out, den=den,
    )
    if S0 is None:
        b, h, _, d = q.shape
        zeros_s = q.new_zeros((b, h, d, v.shape[-1]), dtype=torch.float32)
        grads = (*grads, zeros_s, q.new_zeros((b, h, d), dtype=torch.float32))
    return tuple(grads)


def _triton_bwd_fake(grad_out, grad_den, grad_S, grad_z, q, k, v, out, den, S0, z0, causal,
                     feature_map, normalize, eps, scale):
    b, h, _, d = q.shape
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((b, h, d, v.shape[-1]), dtype=torch.float32),
            q.new_empty((b, h, d), dtype=torch.float32))


def _triton_backward(ctx, grad_out, grad_den, grad_S, grad_z):
    return _backward(ctx, grad_out, grad_den, grad_S, grad_z, run_bwd=_triton_bwd_call)


_triton_fwd.register_fake(_fwd_fake)
_triton_bwd.register_fake(_triton_bwd_fake)
_triton_fwd.register_autograd(_triton_backward, setup_context=_setup_context)
register_kernel(FAMILY, "triton")


# ==============================================================================================
# backend implementations (called by the public functions after validation)
# ==============================================================================================


def _run_reference(query, key, value, causal, feature_map, normalize, eps, scale, initial_state,
                   return_state):
    return linear_attention_reference(
        query, key, value, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
        scale=scale, initial_state=initial_state, return_state=return_state,
    )


def _run_native(query, key, value, causal, feature_map, normalize, eps, scale, initial_state,
                return_state):
    if not _NATIVE_OPS:
        raise BackendUnavailableError(
            f"{OP_NAME}: attnkit._C was built without the linear ops; rebuild it "
            "(pip install --no-build-isolation -e .)"
        )
    S0, z0 = initial_state if initial_state is not None else (None, None)
    out, _den, S, z = _call_native(query, key, value, S0, z0, causal, feature_map, normalize, eps,
                                   scale)
    return (out, (S, z)) if return_state else out


def _run_triton(query, key, value, causal, feature_map, normalize, eps, scale, initial_state,
                return_state):
    S0, z0 = initial_state if initial_state is not None else (None, None)
    out, _den, S, z = torch.ops.attnkit.linear_triton_fwd(
        query, key, value, S0, z0, causal, feature_map, normalize, eps, scale
    )
    return (out, (S, z)) if return_state else out


# backend name -> implementation with _run_reference's signature.
_IMPLEMENTATIONS = {
    "reference": _run_reference,
    "cpu": _run_native,  # the same op for both: the dispatcher picks the kernel by device
    "cuda": _run_native,
    "triton": _run_triton,
}


def _kernel_limitation(backend: str, dtype: torch.dtype, head_dim: int, value_dim: int,
                       batch: int = 1, heads: int = 1) -> str:
    """'' when ``backend`` can run a call with these inputs, else what it cannot do."""
    if backend == "cuda" and (batch > 65535 or heads > 65535):
        return f"B = {batch}, H = {heads} (the CUDA kernels' grid takes B, H <= 65535)"
    if backend == "triton":
        if dtype not in TRITON_DTYPES:
            name = str(dtype).replace("torch.", "")
            return f"{name} inputs (the Triton kernels take float16, bfloat16 and float32)"
        if head_dim < 1 or value_dim < 1:
            return f"head dims D = {head_dim}, Dv = {value_dim} (the Triton kernels need >= 1)"
    return ""


def _route(fn: str, backend, device, dtype, head_dim: int, value_dim: int, batch: int = 1,
           heads: int = 1, causal: bool = False, inputs=None) -> str:
    """The backend that runs this call: ``resolve``'s pick, unless that kernel cannot run the
    call -- then the reference when the backend was the default, an error when it was named.
    On a CUDA tensor with no backend named, a sequence (linear_attention: ``inputs`` = q, k, v)
    goes to the ``cuda`` kernels where the GPU dispatch table measured them faster on its shape
    (attnkit/_gpu_table.py) and they can run it."""
    chosen = resolve(FAMILY, backend, device, fn)
    if (
        inputs is not None
        and head_dim == value_dim
        and gpu_table.prefers_cuda(FAMILY, backend, chosen, device, dtype, head_dim, causal, inputs[0].shape[2],
                                   inputs)
        and backend_status("cuda").usable
        and not _kernel_limitation("cuda", dtype, head_dim, value_dim, batch, heads)
    ):
        return "cuda"
    why_not = _kernel_limitation(chosen, dtype, head_dim, value_dim, batch, heads)
    if not why_not:
        return chosen
    if backend is not None or os.environ.get(ENV_VAR):
        source = "backend" if backend is not None else ENV_VAR
        raise BackendUnavailableError(
            f"{fn}: the {chosen} backend ({source}={chosen!r}) cannot run {why_not}; use "
            "backend='reference', or leave backend=None to route such calls automatically"
        )
    return "reference"


# ==============================================================================================
# public functions
# ==============================================================================================


def _check_state(fn: str, name: str, state, b: int, h: int, d: int, dv: int, dtype, device,
                 lead: str = "B") -> None:
    """``state`` is a pair (S [B, H, D, Dv], z [B, H, D]) in the state dtype of ``dtype``
    (``lead``: the leading dim's name in the messages; linear_attention_varlen's is "batch")."""
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        got = f"a {type(state).__name__} of length {len(state)}" if isinstance(state, (tuple, list)) \
            else type(state).__name__
        raise TypeError(f"{fn}: {name} must be a pair (S, z) of tensors; got {got}")
    s, z = state
    hint = RANK_HINT if lead == "B" else ""
    check_tensor(fn, f"{name}[0] (S)", s, f"[{lead}, H, D, Dv]", hint)
    check_tensor(fn, f"{name}[1] (z)", z, f"[{lead}, H, D]", hint)
    want = state_dtype(dtype)
    for part, t, shape in ((f"{name}[0] (S)", s, (b, h, d, dv)), (f"{name}[1] (z)", z, (b, h, d))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {part} must have shape {list(shape)}; got {list(t.shape)}")
        if t.dtype != want:
            raise ValueError(
                f"{fn}: {part} must be {str(want).replace('torch.', '')} (the state dtype of "
                f"{str(dtype).replace('torch.', '')} inputs); got {str(t.dtype).replace('torch.', '')}"
            )
        if t.device != device:
            raise ValueError(f"{fn}: {part} must be on the device of query ({device}); got {t.device}")


def _check_options(fn, feature_map, normalize, eps, scale) -> None:
    check_bool(fn, "normalize", normalize)
    check_choice(fn, "feature_map", feature_map, FEATURE_MAPS)
    check_real(fn, "eps", eps, low=0.0)
    check_real(fn, "scale", scale)


def _real(x) -> bool:
    """A finite int or float (not bool): what check_real accepts, for the fast path."""
    return type(x) in (float, int) and -math.inf < x < math.inf


# Nested and sparse tensors reached the kernels from the fast paths below and crashed there:
# a sparse or jagged one fails their `layout is _STRIDED` test, a nested one of the strided
# layout the shapes' unpacking (RuntimeError), and _validate then reports them.  (A helper that
# also read is_nested cost 0.6 us of _plain_step's 2.9: session 32, timeit, Intel Xeon without AMX.)
_STRIDED = torch.strided


def _plain_call(query, key, value, causal, feature_map, normalize, eps, scale,
                return_state) -> bool:
    """Whether a call without initial_state passes every check of _validate: then _validate
    is skipped.  False for anything unusual, valid or not (then _validate runs and raises what
    it must).  Measured at B=H=1 N=16 D=64 float32 (one thread, CPU time): _validate's ~30
    calls cost ~9 us a call, these plain comparisons ~1.5 us."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and query.ndim == 4 and key.ndim == 4 and value.ndim == 4
            and query.layout is _STRIDED and key.layout is _STRIDED and value.layout is _STRIDED
            and type(causal) is bool and type(normalize) is bool and type(return_state) is bool
            and type(feature_map) is str and feature_map in FEATURE_MAPS
            and _real(eps) and eps >= 0 and _real(scale)):
        return False
    dtype = query.dtype
    try:
        (b, h, n, d), (bk, hk, m, dk), (bv, hv, mv, _) = query.shape, key.shape, value.shape
    except RuntimeError:  # a nested tensor of the strided layout
        return False
    return (dtype in FLOATING and key.dtype is dtype and value.dtype is dtype
            and b == bk == bv and h == hk == hv and d == dk and m == mv
            and (not causal or m == n) and (causal or not return_state)
            and query.device == key.device == value.device)


def _plain_step(q_t, k_t, v_t, state, feature_map, normalize, eps, scale) -> bool:
    """Whether a linear_attention_step call passes every check of its validation (then it is
    skipped, as _plain_call does for linear_attention): generation calls it once per token.
    Measured (B=1 H=8 D=64 float32 with a state, one thread, CPU time): 15 -> 5 us of Python
    around the op."""
    if not (isinstance(q_t, torch.Tensor) and isinstance(k_t, torch.Tensor)
            and isinstance(v_t, torch.Tensor)
            and q_t.ndim == 3 and k_t.ndim == 3 and v_t.ndim == 3
            and q_t.layout is _STRIDED and k_t.layout is _STRIDED and v_t.layout is _STRIDED
            and type(normalize) is bool and type(feature_map) is str
            and feature_map in FEATURE_MAPS and _real(eps) and eps >= 0 and _real(scale)):
        return False
    dtype, device = q_t.dtype, q_t.device
    try:
        (b, h, d), (bk, hk, dk), (bv, hv, dv) = q_t.shape, k_t.shape, v_t.shape
    except RuntimeError:  # a nested tensor of the strided layout (see _STRIDED)
        return False
    if not (dtype in FLOATING and k_t.dtype is dtype and v_t.dtype is dtype
            and b == bk == bv and h == hk == hv and d == dk
            and k_t.device == device and v_t.device == device):
        return False
    if state is None:
        return True
    if type(state) not in (tuple, list) or len(state) != 2:
        return False
    S, z = state
    want = state_dtype(dtype)
    return (isinstance(S, torch.Tensor) and isinstance(z, torch.Tensor)
            and S.dtype is want and z.dtype is want
            and S.shape == (b, h, d, dv) and z.shape == (b, h, d)
            and S.device == device and z.device == device)


def _validate(query, key, value, causal, feature_map, normalize, eps, scale, initial_state,
              return_state) -> None:
    fn = OP_NAME
    check_tensor(fn, "query", query, "[B, H, N, D]", RANK_HINT)
    check_tensor(fn, "key", key, "[B, H, M, D]", RANK_HINT)
    check_tensor(fn, "value", value, "[B, H, M, Dv]", RANK_HINT)
    check_same_dtype_device(fn, {"query": query, "key": key, "value": value})
    check_size_match(fn, "batch size B", {"query": query.shape[0], "key": key.shape[0],
                                          "value": value.shape[0]})
    check_size_match(fn, "number of heads H", {"query": query.shape[1], "key": key.shape[1],
                                                "value": value.shape[1]})
    check_size_match(fn, "head dim D", {"query": query.shape[3], "key": key.shape[3]})
    check_size_match(fn, "sequence length M", {"key": key.shape[2], "value": value.shape[2]})
    check_bool(fn, "causal", causal)
    check_bool(fn, "return_state", return_state)
    if causal and key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{fn}: causal=True needs the key length M to equal the query length N "
            f"(self-attention); got N={query.shape[2]}, M={key.shape[2]}"
        )
    _check_options(fn, feature_map, normalize, eps, scale)
    if (initial_state is not None or return_state) and not causal:
        what = "initial_state" if initial_state is not None else "return_state=True"
        raise ValueError(
            f"{fn}: {what} needs causal=True (a recurrent state continues a causal sequence)"
        )
    if initial_state is not None:
        b, h, _, d = query.shape
        _check_state(fn, "initial_state", initial_state, b, h, d, value.shape[3], query.dtype,
                     query.device)


def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    return_state: bool = False,
    backend: Optional[str] = None,
):
    """Linear (kernelized) attention: softmax's exp(q·k) replaced by a feature-map dot product.

    With φ the feature map applied to each query and key row and S_i the keys query i sees
    (all of them, or j <= i when ``causal``)::

        out_i = Σ_{j∈S_i} (φ(q_i)·φ(k_j)) v_j / (Σ_{j∈S_i} φ(q_i)·φ(k_j) + eps)   if normalize
        out_i = scale · Σ_{j∈S_i} (φ(q_i)·φ(k_j)) v_j                              otherwise

    Shapes: exactly 4-D ``[B, H, N, D]`` (unlike :func:`attnkit.softmax_attention`, no other
    ranks and no broadcasting: B and H must match across query, key and value); anything else
    raises ValueError naming the expected layout and the shape that came.

    Args:
        query: ``[B, H, N, D]``.
        key: ``[B, H, M, D]``; with ``causal`` M must equal N.
        value: ``[B, H, M, Dv]``; Dv may differ from D.
        causal: query i sees keys j <= i only.
        feature_map: φ -- ``"elu"`` (elu(x) + 1, always positive; Katharopoulos et al. 2020),
            ``"relu"`` (max(x, 0)) or ``"identity"`` (x; with ``normalize=False`` and
            ``scale=1/N`` this is the linear self-attention of in-context-learning theory).
        normalize: divide by the sum of the weights (plus ``eps``).  With ``"identity"`` the
            weights can be negative and the sum can come close to zero: ill-conditioned.
        eps: >= 0, added to the normalizer.  eps = 0 is allowed; a query whose weights sum to
            exactly 0 then gives NaN (as the formula says).
        scale: finite; multiplies the output when ``normalize`` is False (ignored otherwise).
        initial_state: causal only.  ``(S0, z0)`` with S0 ``[B, H, D, Dv]`` = Σ φ(k) vᵀ and
            z0 ``[B, H, D]`` = Σ φ(k) over keys that came *before* this sequence (a returned
            state): every query also sees them, i.e. num_i += φ(q_i)ᵀ S0 and
            den_i += φ(q_i)·z0.  float32 tensors (float64 for float64 inputs).  Differentiable.
        return_state: causal only.  Also return the state after the last key,
            ``(S0 + Σ_j φ(k_j) v_jᵀ, z0 + Σ_j φ(k_j))``, to continue the sequence with
            :func:`linear_attention_step` or another call.  Differentiable.
        backend: ``"reference" | "cpu" | "triton" | "cuda"`` or None; see *Backends*.

    Returns:
        ``out`` ``[B, H, N, Dv]`` in the inputs' dtype, on their device; with ``return_state``
        the pair ``(out, (S, z))``.  Float16, bfloat16, float32 and float64 inputs are accepted
        (all three alike); the kernels accumulate, and keep states, in float32 (float64 for
        float64).  Empty N gives an empty result; M = 0 (no keys, no state) gives zeros.
        Differentiable with respect to query, key, value and the initial state (the ``cpu``
        backend's backward is a kernel; a double backward recomputes through the reference);
        non-contiguous inputs work.

    Backends:
        ``reference`` (pure PyTorch, any device and dtype; the causal form materializes the
        ``N × N`` weights), ``cpu`` (C++ chunked kernels, CPU tensors, every floating dtype),
        ``triton`` (chunked Triton kernels: CUDA tensors, or CPU tensors under
        ``TRITON_INTERPRET=1``; float16 / bfloat16 / float32, head dims >= 1), ``cuda`` (CUDA
        C++ chunked kernels, CUDA tensors, every floating dtype, B and H <= 65535).
        ``backend=None`` (and no ``ATTNKIT_BACKEND`` in the environment)
        picks ``cpu`` for CPU tensors and ``triton`` for CUDA tensors (the reference where that
        backend is not usable here) and routes a call the picked kernel cannot run (Triton:
        float64, a zero head dim; CUDA: B or H above 65535) to the reference.  A backend named explicitly is never
        replaced: it raises :class:`attnkit.BackendUnavailableError` instead.

    Raises:
        TypeError: a non-tensor, non-floating q/k/v or state, a non-bool flag, a non-finite or
            non-numeric eps / scale, a state that is not a pair.
        ValueError: wrong rank, mismatched sizes / dtypes / devices, causal with M != N, an
            unknown feature map or backend, eps < 0, a state without causal or of the wrong
            shape / dtype / device.
        attnkit.BackendUnavailableError: the backend asked for cannot run here, or cannot run
            this call (see *Backends*).

    Example::

        >>> q, k, v = (torch.randn(2, 4, 128, 32) for _ in range(3))
        >>> out = attnkit.linear_attention(q, k, v, causal=True)    # [2, 4, 128, 32]
        >>> # a prompt in parallel, then continued token by token with the same results:
        >>> out, state = attnkit.linear_attention(q, k, v, causal=True, return_state=True)
        >>> q1, k1, v1 = (torch.randn(2, 4, 32) for _ in range(3))
        >>> out1, state = attnkit.linear_attention_step(q1, k1, v1, state)   # out1 [2, 4, 32]
    """
    if not (initial_state is None and _plain_call(query, key, value, causal, feature_map,
                                                  normalize, eps, scale, return_state)):
        _validate(query, key, value, causal, feature_map, normalize, eps, scale, initial_state,
                  return_state)
    backend = _route(OP_NAME, backend, query.device, query.dtype, query.shape[3], value.shape[3],
                     query.shape[0], query.shape[1], causal, (query, key, value))
    if initial_state is not None:
        initial_state = tuple(initial_state)
    return _IMPLEMENTATIONS[backend](query, key, value, causal, feature_map, normalize,
                                     float(eps), float(scale), initial_state, return_state)


def linear_attention_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    *,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    backend: Optional[str] = None,
):
    """One token of causal linear attention, for generation: the recurrent form.

    With the state (S, z) = (Σ φ(k_j) v_jᵀ, Σ φ(k_j)) of the keys so far::

        S' = S + φ(k_t) v_tᵀ,   z' = z + φ(k_t)
        out_t = φ(q_t)ᵀ S' / (φ(q_t)·z' + eps)   if normalize,   else  scale · φ(q_t)ᵀ S'

    the same as the last row of ``linear_attention(..., causal=True)`` over the whole
    sequence: a prompt processed in parallel with ``return_state=True`` and continued token by
    token gives the results of one long call (to rounding).

    Args:
        q_t, k_t: ``[B, H, D]`` -- one token, no sequence axis.
        v_t: ``[B, H, Dv]``.
        state: ``(S [B, H, D, Dv], z [B, H, D])`` from a previous step or from
            ``linear_attention(..., return_state=True)``, float32 (float64 for float64
            inputs); None for an empty history.
        feature_map, normalize, eps, scale, backend: as in :func:`linear_attention`.

    Returns:
        ``(out_t, (S', z'))``: ``out_t`` ``[B, H, Dv]`` in the inputs' dtype and the new state.
        Differentiable with respect to the inputs and the state.

    Example::

        >>> state = None
        >>> for q_t, k_t, v_t in tokens:                       # each [B, H, D] / [B, H, Dv]
        ...     out_t, state = attnkit.linear_attention_step(q_t, k_t, v_t, state)
    """
    fn = STEP_OP_NAME
    if _plain_step(q_t, k_t, v_t, state, feature_map, normalize, eps, scale):
        if state is not None:
            state = tuple(state)
    else:
        check_tensor(fn, "q_t", q_t, "[B, H, D]", RANK_HINT)
        check_tensor(fn, "k_t", k_t, "[B, H, D]", RANK_HINT)
        check_tensor(fn, "v_t", v_t, "[B, H, Dv]", RANK_HINT)
        check_same_dtype_device(fn, {"q_t": q_t, "k_t": k_t, "v_t": v_t})
        check_size_match(fn, "batch size B", {"q_t": q_t.shape[0], "k_t": k_t.shape[0],
                                              "v_t": v_t.shape[0]})
        check_size_match(fn, "number of heads H", {"q_t": q_t.shape[1], "k_t": k_t.shape[1],
                                                    "v_t": v_t.shape[1]})
        check_size_match(fn, "head dim D", {"q_t": q_t.shape[2], "k_t": k_t.shape[2]})
        _check_options(fn, feature_map, normalize, eps, scale)
        if state is not None:
            b, h, d = q_t.shape
            _check_state(fn, "state", state, b, h, d, v_t.shape[2], q_t.dtype, q_t.device)
            state = tuple(state)
    backend = _route(fn, backend, q_t.device, q_t.dtype, q_t.shape[2], v_t.shape[2],
                     q_t.shape[0], q_t.shape[1])
    if backend == "reference":
        return linear_attention_step_reference(q_t, k_t, v_t, state, feature_map=feature_map,
                                               normalize=normalize, eps=float(eps),
                                               scale=float(scale))
    # The kernels' causal form over a sequence of one token, continuing from the state.
    out, new_state = _IMPLEMENTATIONS[backend](
        q_t.unsqueeze(2), k_t.unsqueeze(2), v_t.unsqueeze(2), True, feature_map, normalize,
        float(eps), float(scale), state, True,
    )
    return out.squeeze(2), new_state

"""Modern Hopfield update and energy: the public functions and the ``attnkit::hopfield_*`` ops.

Two dispatch families:

- ``"hopfield"`` (:func:`hopfield_update`): the op
  ``torch.ops.attnkit.hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state)
  -> (out, states, lse, applied)`` (all steps fused; see ``csrc/ops.cpp``) with a C++ CPU kernel
  (``csrc/cpu/hopfield.cpp``) and a CUDA C++ kernel (``csrc/cuda/hopfield.cu``) registered per
  dispatch key, and its twin ``attnkit::hopfield_triton_update_fwd`` around the Triton launcher
  of ``attnkit.kernels.hopfield`` (same arguments, same outputs).  Both get their fake and the
  same autograd formula here (a chunked backward through every step, plain PyTorch from the
  saved per-step states, so it runs on any device).
- ``"hopfield_energy"`` (:func:`hopfield_energy`): the op
  ``torch.ops.attnkit.hopfield_energy_fwd(state, stored, beta) -> (energy, lse)`` (C++ CPU and
  CUDA kernels) and its Triton twin ``attnkit::hopfield_triton_energy_fwd``, each with a fake
  (meta) implementation, so ``torch.compile(fullgraph=True)`` traces it, and the same autograd
  formula.

The Triton ops are ``custom_op`` with an explicit fake rather than ``triton_op`` (whose automatic
fake runs the interpreted kernel on FakeTensors under ``TRITON_INTERPRET=1`` and fails); the
kernel module is imported inside their bodies (importing triton is slow, and
``TRITON_INTERPRET`` is read when the kernels are decorated).  The C++ registrations exist only
when ``attnkit._C`` loads: without the extension the package still imports and the cpu / cuda
backends report why they cannot run.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .._dispatch import ENV_VAR, BackendUnavailableError, native, register_kernel, resolve
from .._validation import FLOATING, RANK_HINT, check_int, check_real, check_same_dtype_device, check_size_match, check_tensor
from ..reference.hopfield import hopfield_energy_reference, hopfield_update_reference
from .softmax import softmax_attention

__all__ = ["hopfield_update", "hopfield_energy"]

_ENERGY_OP_NAME = "attnkit::hopfield_energy_fwd"

# The energy backward recomputes the S×N probabilities from the saved log-sum-exp in slices of
# the stored patterns, so at most about this many probabilities exist at once (one slice of at
# least one pattern per (batch, head, query): the bound is max(this, B·H·S)).
_BWD_PROBS_BUDGET = 1 << 22


def _load_ops():
    """(whether attnkit._C loads, the C++ energy op or None, the C++ update op or None)."""
    try:
        native()  # importing attnkit._C runs its TORCH_LIBRARY registrations
    except BackendUnavailableError:
        return False, None, None
    ops = []
    for name in ("hopfield_energy_fwd", "hopfield_update_fwd"):
        try:
            ops.append(getattr(torch.ops.attnkit, name).default)
        except AttributeError:  # an extension built from older sources, without this op
            ops.append(None)
    return True, ops[0], ops[1]


_native_loaded, _energy_op, _update_op = _load_ops()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels accumulate (and return energy and lse) in float32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _energy_fake(state, stored, beta):
    b, h, s, _ = state.shape
    dtype = _acc_dtype(state.dtype)
    return state.new_empty((b, h, s), dtype=dtype), state.new_empty((b, h, s), dtype=dtype)


def _energy_setup_context(ctx, inputs, output):
    state, stored, beta = inputs
    _, lse = output
    ctx.save_for_backward(state, stored, lse)
    ctx.beta = beta


def _bwd_chunk(batch_heads: int, s: int, n: int) -> int:
    """How many stored patterns one backward slice covers (≥ 1)."""
    return max(1, min(n, _BWD_PROBS_BUDGET // max(1, batch_heads * s)))


def _chunk_probs(xi, x_chunk, lse, beta):
    """p_i = exp(β x_iᵀ ξ − lse) for the patterns of one slice: [B, H, S, chunk]."""
    return torch.exp(torch.matmul(xi, x_chunk.transpose(-2, -1)) * beta - lse.unsqueeze(-1))


def _energy_backward(ctx, grad_energy, grad_lse):
    """Gradients of (energy, lse) with respect to state and stored, from the saved lse.

    With p_i = exp(β x_iᵀ ξ − lse):  ∂lse/∂ξ = β Σ_i p_i x_i,  ∂lse/∂x_i = β p_i ξ, and
    E = −lse/β + ½ξᵀξ + β⁻¹ log N + ½M², so with c = β·ḡ_lse − ḡ_E per query row:
      ∂/∂ξ   = ḡ_E ξ + c Σ_i p_i x_i
      ∂/∂x_i = Σ_rows c p_i ξ  +  (Σ_rows ḡ_E) x_{i*} on the max-norm row i* only
    (the subgradient of ½M² = ½ max_i ‖x_i‖²; on a tie the first maximal row takes it).
    """
    state, stored, lse = ctx.saved_tensors
    beta = ctx.beta
    acc = lse.dtype
    xi = state.to(acc)
    x = stored.to(acc)
    b, h, s, _ = xi.shape
    n = x.shape[-2]
    g_e = grad_energy.to(acc) if grad_energy is not None else torch.zeros_like(lse)
    g_l = grad_lse.to(acc) if grad_lse is not None else torch.zeros_like(lse)
    coef = (beta * g_l - g_e).unsqueeze(-1)  # [B, H, S, 1]
    want_state, want_stored = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

    chunk = _bwd_chunk(b * h, s, n)
    weighted = None  # Σ_i p_i x_i
    stored_parts = []
    bwd = _softmax_bwd_op() if xi.device.type == "cpu" and not torch.is_grad_enabled() else False
    if bwd:
        # The two sums are softmax attention's (queries ξ, keys = values = X, scale β): Σ_i p_i x_i
        # its output, Σ_rows c p_i ξ the dV of a backward with dO = c ξ (its dq, dk unused).
        # B=H=1 D=64 float32, 2 threads, forward + backward (session 8): S=256 N=4096 7.7 -> 3.8
        # ms, S=1024 N=16384 86 -> 46 ms; the slices below (three [S, N] products, exp, scaling)
        # were 6 ms of the first.
        xi_c, x_c = xi.contiguous(), x.contiguous()
        if want_state:
            weighted = torch.ops.attnkit.softmax_fwd(xi_c, x_c, x_c, None, float(beta), False)[0]
        if want_stored:
            g_rows = (coef * xi_c).contiguous()
            # `out` only enters the kernel's delta, hence only dq / dk: any [B, H, S, D] serves.
            stored_parts.append(bwd(g_rows, xi_c, x_c, x_c, weighted if want_state else g_rows,
                                    lse.contiguous(), None, float(beta), False)[2])
    else:
        weighted = torch.zeros_like(xi) if want_state else None
        for start in range(0, n, chunk):
            x_chunk = x[:, :, start:start + chunk]
            probs = _chunk_probs(xi, x_chunk, lse, beta)
            if want_state:
                weighted = weighted + torch.matmul(probs, x_chunk)
            if want_stored:
                stored_parts.append(torch.matmul((probs * coef).transpose(-2, -1), xi))

    grad_state = grad_stored = None
    if want_state:
        grad_state = (g_e.unsqueeze(-1) * xi + coef * weighted).to(state.dtype)
    if want_stored:
        # One slice: its product is the whole gradient (torch.cat would copy it).
        grad_x = stored_parts[0] if len(stored_parts) == 1 else torch.cat(stored_parts, dim=-2)
        # The ½M² term touches one row per (b, h): added to that row alone.  (A one-hot [B, H, N]
        # times x made two more [B, H, N, D] tensors: at S=1 N=65536 D=64 the backward's
        # fresh 16 MiB allocations cost more than its products.)
        top = x.pow(2).sum(dim=-1).argmax(dim=-1, keepdim=True)  # [B, H, 1]
        idx = top.unsqueeze(-1).expand(*top.shape, x.shape[-1])  # [B, H, 1, D]
        term = g_e.sum(dim=-1, keepdim=True).unsqueeze(-1) * x.gather(-2, idx)
        grad_x = grad_x.scatter_add(-2, idx, term) if torch.is_grad_enabled() else grad_x.scatter_add_(-2, idx, term)
        grad_stored = grad_x.to(stored.dtype)
    return grad_state, grad_stored, None


if _energy_op is not None:
    torch.library.register_fake(_ENERGY_OP_NAME, _energy_fake)
    torch.library.register_autograd(_ENERGY_OP_NAME, _energy_backward, setup_context=_energy_setup_context)
if _energy_op is not None or not _native_loaded:
    # Without attnkit._C the family still has a cpu kernel, one this machine cannot run: the
    # dispatcher then reports the extension's import error as the reason (and falls back to the
    # reference by default).  Only an extension that loads without this op (built from older
    # sources) leaves the family without one.
    register_kernel("hopfield_energy", "cpu")
    register_kernel("hopfield_energy", "cuda")


@torch.library.custom_op("attnkit::hopfield_triton_energy_fwd", mutates_args=())
def _triton_energy(state: torch.Tensor, stored: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(energy, lse) float32 [B, H, S] from attnkit.kernels.hopfield.hopfield_energy_fwd."""
    from ..kernels import hopfield as kernels

    return kernels.hopfield_energy_fwd(state, stored, beta)


_triton_energy.register_fake(_energy_fake)
_triton_energy.register_autograd(_energy_backward, setup_context=_energy_setup_context)
register_kernel("hopfield_energy", "triton")


# ----------------------------------------------------------------------------- update op

_UPDATE_OP_NAME = "attnkit::hopfield_update_fwd"


def _update_fake(state, stored, values, beta, steps, tol, final_state):
    b, h, s, d = state.shape
    acc = _acc_dtype(state.dtype)
    dout = d if values is None else values.shape[-1]
    updates = steps if values is None else steps - 1
    return (
        state.new_empty((b, h, s, dout), dtype=acc),
        state.new_empty((steps + 1, b, h, s, d), dtype=acc),
        state.new_empty((steps, b, h, s), dtype=acc),
        state.new_empty((updates, b, h, s), dtype=torch.bool),
    )


def _update_setup_context(ctx, inputs, output):
    state, stored, values, beta, steps, tol, final_state = inputs
    out, states, lse, applied = output
    ctx.save_for_backward(stored, values, out, states, lse, applied, state)
    ctx.beta, ctx.steps, ctx.tol = beta, steps, tol
    ctx.state_dtype = state.dtype
    ctx.mark_non_differentiable(states, lse, applied)


# A retrieval is softmax attention (queries ξ, keys X, values V or X, scale β), so on CPU tensors
# its backward is the C++ softmax backward kernel's (attnkit::softmax_bwd, given the retrieval's
# lse and output).  Against the chunked PyTorch formula below (2 threads, float32, D=64, state
# and stored both wanting gradients, forward + backward of hopfield_update, session 8): S=256
# N=4096 3 steps 25.8 -> 7.7 ms, S=16 N=16384 3 steps 14.8 -> 4.7 ms.  The formula stays for the
# GPU backends.
_SOFTMAX_BWD = None


def _softmax_bwd_op():
    global _SOFTMAX_BWD
    if _SOFTMAX_BWD is None:
        from .softmax import _NATIVE_OPS
        ok = _NATIVE_OPS and torch._C._dispatch_has_kernel_for_dispatch_key("attnkit::softmax_bwd", "CPU")
        _SOFTMAX_BWD = torch.ops.attnkit.softmax_bwd if ok else False
    return _SOFTMAX_BWD


# At most this many queries: the stored-space retrieval's backward in three products that read X
# twice and write its gradient once (_few_queries_backward), where the kernel reads X, writes
# dK and dV, and their sum reads both again.  hopfield_update forward + backward, B=H=1 N=65536
# D=64, 2 threads, float32, the two interleaved in one process (session 8): S=1 one step 4.19
# -> 3.30 ms, three steps 27.7 -> 19.6 ms; S=2 14.5 -> 14.1 ms, S=4 14.7 -> 15.2 ms (S=16
# N=16384, one retrieval alone: 0.84 -> 1.45 ms), so one query only.
_LEAN_MAX_S = 1


def _few_queries_backward(xi, x, lse, o, g, beta, want_x):
    """_retrieval_backward for V = X and a few queries: scores and dP from one product with
    [ξ; g], then grad ξ = β dSᵀ X and grad X = β dS ξ + P g from one more each."""
    s = xi.shape[-2]
    both = torch.cat([xi, g], dim=-2)                                    # [B, H, 2S, D]
    sd = torch.matmul(x, both.transpose(-1, -2))                         # [B, H, N, 2S]
    # lse = +inf (a block frozen by tol) gives P = 0; -inf (no finite score) must too.
    lse_t = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).unsqueeze(-2)
    p = torch.exp(sd[..., :s] * beta - lse_t)                            # [B, H, N, S]
    ds = p * (sd[..., s:] - (g * o).sum(-1).unsqueeze(-2))
    grad_xi = beta * torch.matmul(ds.transpose(-1, -2), x)
    grad_x = torch.matmul(torch.cat([beta * ds, p], dim=-1), both) if want_x else None
    return grad_xi, grad_x, None


def _retrieval_backward(xi, x, v, lse, o, g, beta, want_x, want_v):
    """Backward of one retrieval o = softmax(β ξ Xᵀ) V (V = X when ``v`` is None), chunked over N.

    With p_i = exp(β x_iᵀ ξ − lse), dp_i = g·v_i, Δ = g·o = Σ_i p_i dp_i, ds_i = p_i (dp_i − Δ):
      ∂/∂ξ = β Σ_i ds_i x_i,   ∂/∂x_i = β ds_i ξ (+ p_i g when V = X),   ∂/∂v_i = p_i g.
    Returns (grad ξ, grad X or None, grad V or None); never more than one slice of the S×N
    probabilities exists (see _bwd_chunk).  On CPU the C++ softmax backward kernel computes the
    same three sums in one call.  First derivatives only (see _update_double_backward).
    """
    op = _softmax_bwd_op() if xi.device.type == "cpu" else False
    if op and v is None and xi.shape[-2] <= _LEAN_MAX_S:
        return _few_queries_backward(xi, x, lse, o, g, beta, want_x)
    if op:
        vals = x if v is None else v
        dq, dk, dv = op(g.contiguous(), xi.contiguous(), x.contiguous(), vals.contiguous(), o.contiguous(),
                        lse.contiguous(), None, float(beta), False)
        if v is None:  # dk, dv: fresh outputs of the op (in place: no third [B, H, N, D] tensor)
            return dq, dk.add_(dv) if want_x else None, None
        return dq, dk if want_x else None, dv if want_v else None
    b, h, s, _ = xi.shape
    n = x.shape[-2]
    delta = (g * o).sum(dim=-1, keepdim=True)
    vals = x if v is None else v
    grad_xi = torch.zeros_like(xi)
    parts_x, parts_v = [], []
    chunk = _bwd_chunk(b * h, s, n)
    for start in range(0, n, chunk):
        x_chunk = x[:, :, start:start + chunk]
        probs = _chunk_probs(xi, x_chunk, lse, beta)
        dp = torch.matmul(g, vals[:, :, start:start + chunk].transpose(-2, -1))
        ds = probs * (dp - delta)
        grad_xi = grad_xi + beta * torch.matmul(ds, x_chunk)
        if want_x or (want_v and v is not None):
            pg = torch.matmul(probs.transpose(-2, -1), g)  # Σ_rows p_i g
        if want_x:
            gx = beta * torch.matmul(ds.transpose(-2, -1), xi)
            parts_x.append(gx + pg if v is None else gx)
        if want_v and v is not None:
            parts_v.append(pg)
    grad_x = torch.cat(parts_x, dim=-2) if want_x else None
    grad_v = torch.cat(parts_v, dim=-2) if (want_v and v is not None) else None
    return grad_xi, grad_x, grad_v


def _update_double_backward(ctx, grad_out):
    """Gradients as a differentiable function of the inputs (create_graph=True): through the
    plain-PyTorch reference, recomputed from the saved inputs.  The formula below takes the
    saved per-step states and lse as constants, which is exact for first derivatives only (a
    gradgradcheck failed on it)."""
    stored, values, out, _, _, _, state = ctx.saved_tensors
    inputs = (state, stored, values)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    grads = dict.fromkeys(range(3))
    if grad_out is not None and leaves:
        ref = hopfield_update_reference(state, stored, beta=ctx.beta, steps=ctx.steps, values=values, tol=ctx.tol)
        found = torch.autograd.grad(ref, leaves, grad_out.to(ref.dtype), create_graph=True, allow_unused=True)
        positions = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
        grads.update(zip(positions, found))
    return (*(None if g is None else g.to(t.dtype) for g, t in zip(grads.values(), inputs)),
            None, None, None, None)


def _update_backward(ctx, grad_out, grad_states, grad_lse, grad_applied):
    """Gradients through every retrieval, last to first, from the saved per-step states and lse.

    Retrieval k ran on states[k] and (for the updates in the stored space) produced
    states[k + 1]; a row whose update k did not apply (frozen by ``tol``) passes its gradient
    straight through that step and adds nothing to the stored patterns' gradient.
    """
    if torch.is_grad_enabled():  # double backward: differentiable gradients from the reference
        return _update_double_backward(ctx, grad_out)
    stored, values, out, states, lse, applied, _ = ctx.saved_tensors
    beta = ctx.beta
    acc = lse.dtype
    x = stored.to(acc)
    v = values.to(acc) if values is not None else None
    want_state, want_x = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    want_v = values is not None and ctx.needs_input_grad[2]
    steps = lse.shape[0]
    g = grad_out.to(acc) if grad_out is not None else torch.zeros_like(out)
    grad_x = None
    grad_v = None

    def add_x(total, gx):
        # Each step's gx is a fresh tensor: the first is the running sum, later ones are added in
        # place (no zero-filled start, no new [B, H, N, D] tensor a step: at S=1 N=65536 those
        # page-faulting allocations cost more than the kernel).  No graph here: double backward
        # went to _update_double_backward.
        return gx if total is None else total.add_(gx)

    updates = steps
    if v is not None:
        updates = steps - 1
        g, gx, grad_v = _retrieval_backward(states[steps - 1], x, v, lse[steps - 1], out, g, beta, want_x, want_v)
        if want_x:
            grad_x = add_x(grad_x, gx)
    for k in range(updates - 1, -1, -1):
        mask = applied[k].unsqueeze(-1)
        g_in = torch.where(mask, g, torch.zeros_like(g))
        g_k, gx, _ = _retrieval_backward(states[k], x, None, lse[k], states[k + 1], g_in, beta, want_x, False)
        g = torch.where(mask, g_k, g)
        if want_x:
            grad_x = add_x(grad_x, gx)
    grad_state = g.to(ctx.state_dtype) if want_state else None
    grad_stored = grad_x.to(stored.dtype) if want_x else None
    grad_values = grad_v.to(values.dtype) if grad_v is not None else None
    return grad_state, grad_stored, grad_values, None, None, None, None


if _update_op is not None:
    torch.library.register_fake(_UPDATE_OP_NAME, _update_fake)
    torch.library.register_autograd(_UPDATE_OP_NAME, _update_backward, setup_context=_update_setup_context)

    class _NativeUpdate(torch.autograd.Function):
        """The eager path of ``attnkit::hopfield_update_fwd`` with its registered autograd (the
        same setup_context and backward) without torch.library's generic wrapper, which
        re-fills the schema's defaults and redispatches on every call (as softmax's
        _NativeAttention; see there)."""

        @staticmethod
        def forward(ctx, state, stored, values, beta, steps, tol, final_state):
            with torch._C._AutoDispatchBelowAutograd():
                output = _update_op(state, stored, values, beta, steps, tol, final_state)
            _update_setup_context(ctx, (state, stored, values, beta, steps, tol, final_state), output)
            return output

        backward = staticmethod(_update_backward)


# One 16-bit state: each update is a softmax attention of the state over keys = values = X, and
# the softmax's decoding kernel (keys split over the threads, bfloat16 / float16 K and V read in
# place) runs it faster than this family's fused kernel, which packs or converts all of X per call
# and gives each step's tiles a single row.  Measured on a Xeon with AMX (session 18; B=1 H=4
# D=64, 2 threads, min over 1 s of calls, fused time / per-step decoding time):
#   bfloat16 (fused on brgemm): S=1 1.2-3.5x at N=256..65536, steps 1 and 3; S=16 0.41-0.89x
#     (N >= 1024), 1.26x at N=256 with one step;
#   float16 (fused native: no AMX-FP16 there): S=1 one step 1.6-2.0x, three steps 0.67-0.98x;
#     S=16 0.64-1.17x.
# Hence: S == 1, every step count on a brgemm path, one step on the native path.  The state
# between steps is then the attention's output in the inputs' dtype: the next step's scores
# multiply it in that dtype on either path (brgemm rounds its left operand), and the plain call
# returns only the last one, in that dtype.  tol, values and return_energy keep the fused kernel.
# Session 20, bfloat16 where the decoding kernel runs on attnkit's own AMX tiles (its cost per key
# nearly flat in the rows up to 16) and the flash kernel on brgemm; fused time / per-step
# softmax_attention time (Xeon with AMX, 2 threads, min over 0.8 s of calls, D=64, H=4 for S <= 16,
# else H=1; N = 1024 / 16384; steps 1 / 3):
#   S=2: 3.10 / 3.06, 1.28 / 1.71     S=4: 2.65 / 2.72, 1.15 / 1.52
#   S=8: 2.03 / 1.74, 0.97 / 1.08     S=16: 1.64 / 1.51, 0.94 / 0.96
#   S=17: 1.48 / 0.77, 0.79 / 0.54    S=64: 1.55 / 0.99, 1.04 / 0.77   (the flash kernel, few tasks)
#   S=256: 1.71 / 1.24, 1.38 / 1.10   S=1024: 1.89 / 1.42, 1.74 / 1.34
# and with the decoding kernel's rule (own tiles from 4 rows per kv head, the native dots below):
#   S=2: 2.29 / 2.30, 0.96 / 1.29     S=3: 1.89 / 1.69, 0.85 / 1.10
# Hence also, bfloat16 there: S <= 16 one step, S >= 256 every step count.


def _steps_by_softmax(dtype, s, steps):
    """Whether the plain 16-bit update of ``s`` states runs its steps as softmax_attention calls
    (the decoding kernel for s <= 16, the flash kernel above) rather than the fused kernel."""
    if dtype not in (torch.bfloat16, torch.float16) or s < 1:
        return False
    name = str(dtype).removeprefix("torch.")
    if s == 1 and (steps == 1 or native().cpu_gemm_path(name) != "native"):
        return True
    if dtype is not torch.bfloat16:
        return False
    if s <= 16:
        return steps == 1 and native().cpu_gemm_path(name, "decode") == "own AMX tiles"
    return s >= 256 and native().cpu_gemm_path(name) != "native"


def _update_by_softmax(state, stored, beta, steps):
    """``steps`` updates ξ <- softmax(β ξ Xᵀ) X as softmax attentions on the cpu backend
    (differentiable through torch's autograd, step by step)."""
    xi = state
    for _ in range(steps):
        xi = softmax_attention(xi, stored, stored, scale=beta, backend="cpu")
    return xi


def _call_update(state, stored, values, beta, steps, tol, final_state):
    """attnkit::hopfield_update_fwd, differentiable.  Eager calls skip the Python autograd
    kernel that register_autograd installs: straight to the kernel below autograd when no
    gradient is wanted (B=H=1 S=1 N=64 D=64, one thread, CPU time: 8.0 -> 4.8 us a call), else
    through _NativeUpdate (the same formula).  Under torch.compile the op itself, as registered."""
    if _update_op is None or torch.compiler.is_compiling():
        return torch.ops.attnkit.hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(state, stored, values):
        return _NativeUpdate.apply(state, stored, values, beta, steps, tol, final_state)
    with torch._C._AutoDispatchBelowAutograd():
        return _update_op(state, stored, values, beta, steps, tol, final_state)
# Unconditionally: without attnkit._C the dispatcher reports the extension's import error.
register_kernel("hopfield", "cpu")
register_kernel("hopfield", "cuda")


@torch.library.custom_op("attnkit::hopfield_triton_update_fwd", mutates_args=())
def _triton_update(
    state: torch.Tensor,
    stored: torch.Tensor,
    values: Optional[torch.Tensor],
    beta: float,
    steps: int,
    tol: Optional[float],
    final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """attnkit.kernels.hopfield.hopfield_update_fwd: the outputs of attnkit::hopfield_update_fwd
    (out, states, lse float32; applied bool).  Split-N or fused as the launcher decides."""
    from ..kernels import hopfield as kernels

    return kernels.hopfield_update_fwd(state, stored, values, beta, steps, tol, final_state)


_triton_update.register_fake(_update_fake)
_triton_update.register_autograd(_update_backward, setup_context=_update_setup_context)
register_kernel("hopfield", "triton")


# ----------------------------------------------------------------------------- routing

# What the kernel backends take (each kernel also checks for itself).  The C++ CPU kernel takes
# every floating dtype and any head dim.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256  # attnkit.kernels.hopfield.MAX_HEAD_DIM (not imported: triton is slow)
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CUDA_MAX_HEAD_DIM = 256  # csrc/cuda/hopfield.cu kMaxD


def _kernel_limitation(backend: str, state: torch.Tensor, values: torch.Tensor | None) -> str:
    """'' when ``backend`` can run this call, else what it cannot do."""
    if backend in ("reference", "cpu"):
        return ""
    dtypes, max_dim = (TRITON_DTYPES, TRITON_MAX_HEAD_DIM) if backend == "triton" else (CUDA_DTYPES, CUDA_MAX_HEAD_DIM)
    if state.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        return f"{str(state.dtype).replace('torch.', '')} inputs (the {backend} kernels take {names})"
    d = state.shape[-1]
    dv = d if values is None else values.shape[-1]
    if d > max_dim or dv > max_dim:
        return f"head dims D = {d}, Dv = {dv} (the {backend} kernels take head dims up to {max_dim})"
    return ""


def _route(family: str, backend: str | None, state: torch.Tensor, values, fn: str) -> str:
    """``resolve``'s pick, unless that kernel cannot run the call: then the reference when the
    backend was the default, an error when it was named (backend= or ATTNKIT_BACKEND)."""
    chosen = resolve(family, backend, state.device, fn)
    why_not = _kernel_limitation(chosen, state, values)
    if not why_not:
        return chosen
    if backend is not None or os.environ.get(ENV_VAR):
        source = "backend" if backend is not None else ENV_VAR
        raise BackendUnavailableError(
            f"{fn}: the {chosen} backend ({source}={chosen!r}) cannot run {why_not}; "
            "use backend='reference', or leave backend=None to route such calls automatically"
        )
    return "reference"


def _states_energy(states, stored, beta, steps, dtype, backend="cpu"):
    """Energies of the saved states [steps+1, B, H, S, D] through the energy op of ``backend``
    (the C++ op for cpu / cuda, the Triton op for triton): [steps+1, B, H, S].

    All steps go through one call (the states concatenated along S), so the stored patterns
    stream once for all of them; the C++ CPU energy kernel redoes cancellation-prone rows in double.
    """
    k, b, h, s, d = states.shape
    flat = states.permute(1, 2, 0, 3, 4).reshape(b, h, k * s, d)
    op = torch.ops.attnkit.hopfield_triton_energy_fwd if backend == "triton" else torch.ops.attnkit.hopfield_energy_fwd
    energy, _ = op(flat, stored.to(states.dtype), beta)
    return energy.reshape(b, h, k, s).permute(2, 0, 1, 3).to(dtype)


def _check_common(fn: str, state, stored) -> None:
    """Checks shared by both functions: state [B,H,S,D] and stored [B,H,N,D] with N, D >= 1."""
    check_tensor(fn, "state", state, "[B, H, S, D]", RANK_HINT)
    check_tensor(fn, "stored", stored, "[B, H, N, D]", RANK_HINT)
    check_size_match(fn, "batch size", {"state": state.shape[0], "stored": stored.shape[0]})
    check_size_match(fn, "number of heads", {"state": state.shape[1], "stored": stored.shape[1]})
    check_size_match(fn, "head dim", {"state": state.shape[3], "stored": stored.shape[3]})
    check_same_dtype_device(fn, {"state": state, "stored": stored})
    if state.shape[3] < 1:
        raise ValueError(f"{fn}: the head dim D must be >= 1; got state of shape {tuple(state.shape)}")
    if stored.shape[2] < 1:
        raise ValueError(
            f"{fn}: stored must hold at least one pattern (N >= 1); got stored of shape {tuple(stored.shape)}"
        )


def hopfield_update(
    state: torch.Tensor,
    stored: torch.Tensor,
    *,
    beta: float | None = None,
    steps: int = 1,
    values: torch.Tensor | None = None,
    tol: float | None = None,
    return_energy: bool = False,
    backend: str | None = None,
):
    """The modern Hopfield update (Ramsauer et al. 2020): retrieve stored patterns from states.

    Shapes: exactly 4-D (unlike :func:`attnkit.softmax_attention`, no other ranks and no
    broadcasting: B and H must match); anything else raises ValueError naming the expected
    layout and the shape that came.

    Args:
        state: ξ, ``[B, H, S, D]`` — S query states (S may be 0: an empty result).
        stored: X, ``[B, H, N, D]`` — N ≥ 1 stored patterns x_i.  N = 0 raises ValueError: there
            is nothing to retrieve (softmax over no pattern is undefined).
        beta: inverse temperature β > 0 (finite); default ``1/√D``.
        steps: number of updates, an int ≥ 1.
        values: optional V, ``[B, H, N, Dv]`` — one value row per stored pattern.
        tol: optional early stop per query, a real ≥ 0 (see below).
        return_energy: also return the energy (:func:`hopfield_energy`) of the state before the
            first update and after each update, ``[steps + 1, B, H, S]`` (see below).
        backend: ``None`` | ``"reference"`` | ``"cpu"`` | ``"triton"`` | ``"cuda"`` (env
            ``ATTNKIT_BACKEND``).  CPU tensors default to the C++ kernel (``"cpu"``): all steps
            in one call, the stored patterns streamed once per step (each row read once and
            used as key and value), no S×N matrix, and for a few queries (S ≤ 16) against a
            long memory the patterns split across threads; its backward recomputes each step
            from the saved per-step states.  On the cpu backend, a plain call (no ``values``,
            ``tol`` or ``return_energy``) with one float16 / bfloat16 state (S = 1; all step
            counts on AMX, one step elsewhere: ``_steps_by_softmax``) runs each step as
            :func:`attnkit.softmax_attention` of ξ over keys = values = X instead: the softmax's
            decoding kernel reads the 16-bit patterns in place (bfloat16 S=1 N=262144 on a Xeon
            with AMX: 0.28x -> 2.14x torch SDPA per step); its gradients are that op's, step
            by step.  So do bfloat16 calls on a Xeon with AMX with S <= 16 (one step) and
            S >= 256 (every step count), where that measured faster.  CUDA tensors default to
            the Triton kernel (``"triton"``, also CPU tensors under ``TRITON_INTERPRET=1``): the same fused
            steps with the block's states kept on chip, and for S ≤ 16 against a long memory a
            split over the stored patterns merged through log-sum-exps (flash-decoding);
            ``"cuda"`` is the CUDA C++ kernel.  Both take float16, bfloat16 and float32 and head
            dims up to 256; other calls go to the reference by default (and raise
            BackendUnavailableError when that backend was named).  Every kernel backend shares
            the backward above.

    Returns:
        Without ``values``: ξ after ``steps`` updates ξ ← softmax(β ξ Xᵀ) X, ``[B, H, S, D]``.
        With ``values``: ``steps − 1`` such updates in the stored space, then
        softmax(β ξ Xᵀ) V, ``[B, H, S, Dv]``.  Same dtype and device as ``state``
        (float16, bfloat16, float32 or float64; all inputs must share dtype and device; the
        cpu kernel accumulates in float32, float64 for float64).  Differentiable in
        ``state``, ``stored`` and ``values``.  With ``return_energy=True``: a pair
        ``(result, energy)``; ``energy[0]`` is the energy of ``state``, ``energy[k]`` that of
        the state after update k.  With ``values`` the energies are those of the stored-space
        states: ``energy[steps]`` is the energy of softmax(β ξ Xᵀ) X for the last state ξ (the
        stored-space counterpart of the read-out, under the same ``tol`` rule).  The energy is
        a diagnostic, returned without gradient (detached), in the dtype of ``state``.

    ``tol``: after each update in the stored space (every one of the ``steps`` updates without
    ``values``, the first ``steps − 1`` with it), each query row's change max_d |ξ_new − ξ_old|
    is compared with ``tol``; the row keeps that update and, when the change is ≤ ``tol``, is
    frozen: later updates leave it unchanged (and gradients pass straight through them), while
    the other rows go on.  The final retrieval through ``values`` always runs for every row.
    ``tol=None`` never freezes; ``tol=0`` freezes only rows at an exact fixed point, so it
    returns the same as ``None``.  The reference computes every row at each step (masked); the
    cpu kernel skips a block of queries once all its rows are frozen.

    Example::

        >>> patterns = torch.randn(1, 1, 100, 64).sign()        # 100 stored ±1 patterns
        >>> noisy = patterns[:, :, :5] * torch.where(torch.rand(1, 1, 5, 64) < 0.1, -1.0, 1.0)
        >>> out = attnkit.hopfield_update(noisy, patterns, beta=1.0)
        >>> bool((out.sign() == patterns[:, :, :5]).all())
        True
        >>> out, energy = attnkit.hopfield_update(noisy, patterns, beta=1.0, steps=3, return_energy=True)
        >>> energy.shape, bool((energy[1:] <= energy[:-1] + 1e-4).all())
        (torch.Size([4, 1, 1, 5]), True)
    """
    fn = "attnkit.hopfield_update"
    # --- fast path: the plain call (two 4-D tensors of one floating dtype and device with
    # matching B, H, D and N, D >= 1; no values, no tol, no energy; an int steps >= 1 and a
    # finite beta > 0 or None) passes every check below by construction and goes straight to
    # routing.  Anything else, valid or not, takes the full path, which raises the documented
    # errors.  Measured with the C++ op below autograd (B=H=1 S=1 N=64 D=64, one thread, CPU
    # time): 14.6 -> ~6 us a call.
    if (
        values is None
        and tol is None
        and return_energy is False
        and type(steps) is int
        and steps >= 1
        and isinstance(state, torch.Tensor)
        and isinstance(stored, torch.Tensor)
        and state.ndim == 4
        and stored.ndim == 4
        and state.layout is torch.strided  # (not sparse or jagged: the full path reports those)
        and stored.layout is torch.strided
        and (beta is None or (type(beta) in (float, int) and 0 < beta < math.inf))
    ):
        try:
            dtype, (b, h, s, d), (bx, hx, n, dx) = state.dtype, state.shape, stored.shape
        except RuntimeError:  # a nested tensor of the strided layout: the full path reports it
            dtype = None
        if (
            dtype in FLOATING
            and stored.dtype is dtype
            and b == bx
            and h == hx
            and d == dx
            and d >= 1
            and n >= 1
            and state.device == stored.device
        ):
            chosen = _route("hopfield", backend, state, None, fn)
            if chosen == "cpu" or chosen == "cuda":
                beta = 1.0 / math.sqrt(d) if beta is None else float(beta)
                if chosen == "cpu" and _steps_by_softmax(dtype, s, steps):
                    return _update_by_softmax(state, stored, beta, steps)
                return _call_update(state, stored, None, beta, steps, None, False)[0].to(dtype)
    _check_common(fn, state, stored)
    if values is not None:
        check_tensor(fn, "values", values, "[B, H, N, Dv]", RANK_HINT)
        check_size_match(fn, "batch size", {"values": values.shape[0], "stored": stored.shape[0]})
        check_size_match(fn, "number of heads", {"values": values.shape[1], "stored": stored.shape[1]})
        check_size_match(fn, "length N", {"values": values.shape[2], "stored": stored.shape[2]})
        check_same_dtype_device(fn, {"state": state, "values": values})
    if beta is not None:
        check_real(fn, "beta", beta, low=0, low_inclusive=False)
    check_int(fn, "steps", steps, low=1)
    check_real(fn, "tol", tol, low=0, allow_none=True)
    if not isinstance(return_energy, bool):
        raise TypeError(f"{fn}: return_energy must be a bool; got {return_energy!r}")
    chosen = _route("hopfield", backend, state, values, fn)
    if chosen == "reference":
        result = hopfield_update_reference(state, stored, beta=beta, steps=steps, values=values, tol=tol,
                                           return_energy=return_energy)
        if return_energy:
            return result[0], result[1].detach()
        return result
    beta = 1.0 / math.sqrt(state.shape[-1]) if beta is None else float(beta)
    tol = None if tol is None else float(tol)
    if chosen == "triton":
        out, states, _, _ = torch.ops.attnkit.hopfield_triton_update_fwd(state, stored, values, beta, steps, tol,
                                                                         return_energy)
    else:
        out, states, _, _ = _call_update(state, stored, values, beta, steps, tol, return_energy)
    out = out.to(state.dtype)
    if not return_energy:
        return out
    with torch.no_grad():
        energy = _states_energy(states.detach(), stored.detach(), beta, steps, state.dtype, chosen)
    return out, energy


def hopfield_energy(
    state: torch.Tensor,
    stored: torch.Tensor,
    beta: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Modern Hopfield energy of each state:  ``[B, H, S, D]``, ``[B, H, N, D]`` -> ``[B, H, S]``.

    E(ξ) = −β⁻¹ log Σ_i exp(β x_iᵀ ξ) + ½ ξᵀξ + β⁻¹ log N + ½ M²,  M = max_i ‖x_i‖ (per batch
    and head).  The constants make E ≥ 0; the update of :func:`hopfield_update` never raises it.

    Shapes: exactly 4-D, as :func:`hopfield_update` (other ranks raise ValueError).

    Args:
        state: ξ, ``[B, H, S, D]`` (S may be 0: an empty result).
        stored: X, ``[B, H, N, D]`` with N ≥ 1 (ValueError otherwise).
        beta: inverse temperature β > 0 (finite), required.
        backend: ``None`` | ``"reference"`` | ``"cpu"`` | ``"triton"`` | ``"cuda"`` (env
            ``ATTNKIT_BACKEND``).  CPU tensors default to the C++ kernel (``"cpu"``), which makes
            one pass over the stored patterns per state with an online log-sum-exp, and whose
            backward never holds more than a bounded slice of the S×N probabilities.  CUDA
            tensors default to the Triton kernel (``"triton"``; ``"cuda"``: the CUDA C++ kernel),
            same pass, float16 / bfloat16 / float32 and head dims up to 256 (other calls: the
            reference by default, BackendUnavailableError when named).

    Returns:
        ``[B, H, S]`` in the dtype of ``state`` (float16, bfloat16, float32 or float64; the
        kernel accumulates in float32, float64 for float64).  Differentiable in ``state`` and
        ``stored`` (the ½M² term through its subgradient: the max-norm pattern).

    Example::

        >>> stored = torch.randn(2, 4, 100, 64)
        >>> state = torch.randn(2, 4, 10, 64)
        >>> e0 = attnkit.hopfield_energy(state, stored, 0.125)
        >>> e1 = attnkit.hopfield_energy(attnkit.hopfield_update(state, stored, beta=0.125), stored, 0.125)
        >>> bool((e1 <= e0 + 1e-4).all())
        True
    """
    fn = "attnkit.hopfield_energy"
    _check_common(fn, state, stored)
    check_real(fn, "beta", beta, low=0, low_inclusive=False)
    chosen = _route("hopfield_energy", backend, state, None, fn)
    if chosen == "reference":
        return hopfield_energy_reference(state, stored, beta)
    op = torch.ops.attnkit.hopfield_triton_energy_fwd if chosen == "triton" else torch.ops.attnkit.hopfield_energy_fwd
    energy, _ = op(state, stored, float(beta))
    return energy.to(state.dtype)

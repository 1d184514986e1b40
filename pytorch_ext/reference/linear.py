"""Reference linear (kernelized) attention: straightforward PyTorch, the ground truth of the tests.

With a feature map φ applied row-wise to queries and keys, query i attends to the keys j in S_i
(all j, or j <= i when causal) with the unnormalized weights φ(q_i)·φ(k_j):

    num_i = Σ_{j∈S_i} (φ(q_i)·φ(k_j)) v_j        den_i = Σ_{j∈S_i} φ(q_i)·φ(k_j)
    out_i = num_i / (den_i + eps)   (normalize=True)      out_i = scale * num_i   (normalize=False)

Computes in the dtype it is given (run it in float64 for ground truth, or in float16 /
bfloat16 to measure the error a naive implementation makes in that dtype).

The computation is split in three steps -- feature maps, the (num, den) sums, the final
division or scaling -- so that a carried-in recurrent state (S0 = Σ φ(k) vᵀ and z0 = Σ φ(k)
of earlier positions) adds φ(q_i)·S0 to num and φ(q_i)·z0 to den without touching the rest.

Recurrent state: (S [B, H, D, Dv], z [B, H, D]), the sums Σ_j φ(k_j) v_jᵀ and Σ_j φ(k_j) over
every key seen so far, in the accumulation dtype (:func:`state_dtype`: float64 for float64
inputs, float32 otherwise).  :func:`linear_attention_step_reference` is the one-token update
written from its definition; the tests check that it and the parallel form agree.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FEATURE_MAPS = ("elu", "relu", "identity")


class _EluPlusOne(torch.autograd.Function):
    """elu(x) + 1 whose derivative at a NaN is 1 on every CPU (the kernels' convention).

    torch's own elu backward gives 1 there in its scalar loop but NaN in its vectorized one, so
    a ground truth built on it changed with the tensor's size and the CPU's vector width
    (measured, torch 2.13 on an AMD EPYC with AVX2, float64: 3 elements -> 1, 40 -> NaN; a
    regression test of the linear kernels failed on that CPU and passed on AVX-512 ones).  The
    forward is torch's (same rounding); the backward is written with differentiable ops, so a
    double backward still works.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.elu(x) + 1.0

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        slope = torch.where((x > 0) | torch.isnan(x), torch.ones_like(x), torch.exp(x))
        return grad * slope


def feature_map_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """φ(x) applied element-wise: "elu" -> elu(x) + 1 (positive), "relu" -> max(x, 0), "identity" -> x."""
    if name == "elu":
        return _EluPlusOne.apply(x)
    if name == "relu":
        return F.relu(x)
    if name == "identity":
        return x
    raise ValueError(f"feature_map_reference: unknown feature_map {name!r}; expected one of "
                     f"{', '.join(map(repr, FEATURE_MAPS))}")


def _noncausal_sums(phi_q: torch.Tensor, phi_k: torch.Tensor, value: torch.Tensor,
                    need_den: bool):
    """Every query sees every key: contract keys first, φQ (φKᵀ V) -- no [N, M] matrix."""
    kv = torch.matmul(phi_k.transpose(-2, -1), value)  # [B, H, D, Dv]
    num = torch.matmul(phi_q, kv)  # [B, H, N, Dv]
    den = None
    if need_den:
        k_sum = phi_k.sum(dim=-2, keepdim=True)  # [B, H, 1, D]
        den = (phi_q * k_sum).sum(dim=-1, keepdim=True)  # [B, H, N, 1]
    return num, den


def _causal_sums(phi_q: torch.Tensor, phi_k: torch.Tensor, value: torch.Tensor,
                 need_den: bool):
    """Query i sees keys j <= i: the masked quadratic form (φQ φKᵀ ∘ tril) V."""
    n, m = phi_q.shape[-2], phi_k.shape[-2]
    weights = torch.matmul(phi_q, phi_k.transpose(-2, -1))  # [B, H, N, M]
    keep = torch.ones(n, m, dtype=torch.bool, device=weights.device).tril()
    weights = weights.masked_fill(~keep, 0.0)
    num = torch.matmul(weights, value)
    den = weights.sum(dim=-1, keepdim=True) if need_den else None
    return num, den


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a recurrent state for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
):
    """Linear attention on [B, H, N, D] tensors, computed in the inputs' dtype.

    query [B, H, N, D], key [B, H, M, D], value [B, H, M, Dv] -> out [B, H, N, Dv].
    ``causal`` needs M == N (key j visible to query i when j <= i).  ``scale`` multiplies the
    output only when ``normalize`` is False.  No input checks: the public function does them.
    With no keys at all (M == 0) and no initial state the sums are empty and the output is
    zeros, whatever ``eps``.

    ``initial_state`` (S0 [B, H, D, Dv], z0 [B, H, D]) holds the sums of earlier keys, which
    every query sees: num_i += φ(q_i)·S0, den_i += φ(q_i)·z0 (cast to the inputs' dtype).
    ``return_state`` also returns the state after the last key, (S0 + φ(K)ᵀV, z0 + Σ_j φ(k_j)),
    in :func:`state_dtype`: ``(out, (S, z))``.
    """
    phi_q = feature_map_reference(query, feature_map)
    phi_k = feature_map_reference(key, feature_map)
    sums = _causal_sums if causal else _noncausal_sums
    num, den = sums(phi_q, phi_k, value, normalize)
    if initial_state is not None:
        s0, z0 = (t.to(query.dtype) for t in initial_state)
        num = num + torch.matmul(phi_q, s0)
        if normalize:
            den = den + torch.matmul(phi_q, z0.unsqueeze(-1))
    if not normalize:
        out = num * scale
    elif key.shape[-2] == 0 and initial_state is None:
        # Empty sums: num is already exact zeros (and still attached to the graph); dividing
        # would give 0/0 = NaN when eps == 0.
        out = num
    else:
        out = num / (den + eps)
    if not return_state:
        return out
    acc = state_dtype(query.dtype)
    s = torch.matmul(phi_k.transpose(-2, -1), value)  # [B, H, D, Dv]
    z = phi_k.sum(dim=-2)  # [B, H, D]
    if initial_state is not None:
        s, z = s + s0, z + z0
    return out, (s.to(acc), z.to(acc))


def linear_attention_step_reference(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
):
    """One token of causal linear attention from the recurrence, in the inputs' dtype.

    q_t, k_t [B, H, D], v_t [B, H, Dv], state (S [B, H, D, Dv], z [B, H, D]) or None (zeros):
        S' = S + φ(k_t) v_tᵀ,   z' = z + φ(k_t)
        out_t = φ(q_t)ᵀ S' / (φ(q_t)·z' + eps)   (normalize)   or   scale · φ(q_t)ᵀ S'
    Returns (out_t [B, H, Dv] in the inputs' dtype, (S', z') in :func:`state_dtype`).
    """
    phi_q = feature_map_reference(q_t, feature_map)
    phi_k = feature_map_reference(k_t, feature_map)
    s = phi_k.unsqueeze(-1) * v_t.unsqueeze(-2)  # [B, H, D, Dv]
    z = phi_k
    if state is not None:
        s = s + state[0].to(q_t.dtype)
        z = z + state[1].to(q_t.dtype)
    num = (phi_q.unsqueeze(-1) * s).sum(dim=-2)  # [B, H, Dv]
    if normalize:
        out = num / ((phi_q * z).sum(dim=-1, keepdim=True) + eps)
    else:
        out = num * scale
    acc = state_dtype(q_t.dtype)
    return out, (s.to(acc), z.to(acc))

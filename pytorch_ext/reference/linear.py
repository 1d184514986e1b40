"""Reference linear (kernelized) attention: straightforward PyTorch, the ground truth of the tests.

With a feature map φ applied row-wise to queries and keys, query i attends to the keys j in S_i
(all j, or j <= i when causal) with the unnormalized weights φ(q_i)·φ(k_j):

    num_i = Σ_{j∈S_i} (φ(q_i)·φ(k_j)) v_j        den_i = Σ_{j∈S_i} φ(q_i)·φ(k_j)
    out_i = num_i / (den_i + eps)   (normalize=True)      out_i = scale * num_i   (normalize=False)

Computes in the dtype it is given (run it in float64 for ground truth, or in float16 /
bfloat16 to measure the error a naive implementation makes in that dtype).

The computation is split in three steps -- feature maps, the (num, den) sums, the final
division or scaling -- so that a carried-in recurrent state (Σ φ(k) vᵀ and Σ φ(k) of earlier
positions) can later be added to num and den without touching the rest.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FEATURE_MAPS = ("elu", "relu", "identity")


def feature_map_reference(x: torch.Tensor, name: str) -> torch.Tensor:
    """φ(x) applied element-wise: "elu" -> elu(x) + 1 (positive), "relu" -> max(x, 0), "identity" -> x."""
    if name == "elu":
        return F.elu(x) + 1.0
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
) -> torch.Tensor:
    """Linear attention on [B, H, N, D] tensors, computed in the inputs' dtype.

    query [B, H, N, D], key [B, H, M, D], value [B, H, M, Dv] -> out [B, H, N, Dv].
    ``causal`` needs M == N (key j visible to query i when j <= i).  ``scale`` multiplies the
    output only when ``normalize`` is False.  No input checks: the public function does them.
    With no keys at all (M == 0) the sums are empty and the output is zeros, whatever ``eps``.
    """
    phi_q = feature_map_reference(query, feature_map)
    phi_k = feature_map_reference(key, feature_map)
    sums = _causal_sums if causal else _noncausal_sums
    num, den = sums(phi_q, phi_k, value, normalize)
    if not normalize:
        return num * scale
    if key.shape[-2] == 0:
        # Empty sums: num is already exact zeros (and still attached to the graph); dividing
        # would give 0/0 = NaN when eps == 0.
        return num
    return num / (den + eps)

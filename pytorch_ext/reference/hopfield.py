"""Reference modern Hopfield update and energy: straightforward PyTorch, the ground truth of the tests.

Computes in the dtype it is given (run it in float64 for ground truth, or in float16 /
bfloat16 to measure the error a naive implementation makes in that dtype).  Materializes the
[B, H, S, N] score matrix: for checking, not for speed.  No input checks: the public
functions in ``attnkit.ops.hopfield`` validate before calling these.

With state ξ (one row per query), stored patterns X (one row x_i per pattern) and inverse
temperature β (Ramsauer et al., "Hopfield Networks is All You Need", 2020):

- update:  ξ ← softmax(β ξ Xᵀ) X
- energy:  E(ξ) = −β⁻¹ log Σ_i exp(β x_iᵀ ξ) + ½ ξᵀξ + β⁻¹ log N + ½ M²,  M = max_i ‖x_i‖
"""
from __future__ import annotations

import math

import torch


def hopfield_retrieve(state: torch.Tensor, stored: torch.Tensor, beta: float,
                      values: torch.Tensor | None = None) -> torch.Tensor:
    """One retrieval: softmax(β ξ Xᵀ) V with V = ``values`` (or X itself when None).

    state [B, H, S, D], stored [B, H, N, D], values [B, H, N, Dv] -> [B, H, S, Dv (or D)].
    """
    scores = torch.matmul(state, stored.transpose(-2, -1)) * beta
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, stored if values is None else values)


def hopfield_update_reference(
    state: torch.Tensor,
    stored: torch.Tensor,
    *,
    beta: float | None = None,
    steps: int = 1,
    values: torch.Tensor | None = None,
    tol: float | None = None,
    return_energy: bool = False,
):
    """``steps`` modern Hopfield updates of ``state`` against ``stored`` (see attnkit.hopfield_update).

    Without ``values``: ``steps`` updates ξ ← softmax(β ξ Xᵀ) X, returns ξ [B, H, S, D].
    With ``values`` [B, H, N, Dv]: ``steps − 1`` such updates, then returns
    softmax(β ξ Xᵀ) V [B, H, S, Dv].
    ``tol``: after each update in the stored space, a query row whose change
    max_d |ξ_new − ξ_old| is ≤ tol keeps that update and is frozen for the remaining updates.
    ``beta`` defaults to 1/√D.
    ``return_energy``: also returns the energies [steps + 1, B, H, S] of ξ_0 (the input) and of
    the state after each update in the stored space; with ``values`` the last entry is the
    energy of the stored-space update of the last state (softmax(β ξ Xᵀ) X, with the same
    ``tol`` rule), the state the read-out through ``values`` corresponds to.
    """
    if beta is None:
        beta = 1.0 / math.sqrt(state.shape[-1])
    # With return_energy and values, one more stored-space update gives the last energy's state.
    stored_updates = steps if (values is None or return_energy) else steps - 1
    xi = state
    trajectory = [xi]
    last = None  # the state the read-out through values starts from
    # Rows still updating; None until tol first freezes something (and always None without tol).
    active = None
    for k in range(stored_updates):
        if values is not None and k == steps - 1:
            last = xi
        new = hopfield_retrieve(xi, stored, beta)
        if tol is None:
            xi = new
        else:
            # Masking instead of skipping rows keeps the loop free of data-dependent control flow
            # (torch.compile traces it whole); a frozen row just keeps its previous value.
            change = (new - xi).abs().amax(dim=-1)
            if active is None:
                xi = new
                active = change > tol
            else:
                xi = torch.where(active.unsqueeze(-1), new, xi)
                active = active & (change > tol)
        trajectory.append(xi)
    if values is not None:
        out = hopfield_retrieve(xi if last is None else last, stored, beta, values)
    else:
        out = xi
    if not return_energy:
        return out
    energy = torch.stack([hopfield_energy_reference(t, stored, beta) for t in trajectory])
    return out, energy


def hopfield_energy_reference(state: torch.Tensor, stored: torch.Tensor, beta: float) -> torch.Tensor:
    """Modern Hopfield energy of each state row: state [B, H, S, D], stored [B, H, N ≥ 1, D] -> [B, H, S].

    E(ξ) = −β⁻¹ logsumexp_i(β x_iᵀ ξ) + ½ ξᵀξ + β⁻¹ log N + ½ M², M = max_i ‖x_i‖ per batch
    and head.  The last two terms make E ≥ 0 (and E = 0 only at ξ = x_i with ‖x_i‖ = M as β → ∞).
    Returned in the dtype of ``state``.  The gradient of ½M² goes to the first row of largest
    norm on a tie (the subgradient the kernels' backward takes).
    """
    n = stored.shape[-2]
    scores = torch.matmul(state, stored.transpose(-2, -1)) * beta
    lse = torch.logsumexp(scores, dim=-1)
    # M² directly as the largest squared norm: same value as max‖x_i‖², no sqrt to differentiate;
    # taken at the first maximal row (gather at argmax) rather than by amax, whose gradient splits
    # evenly between tied rows: both are subgradients, the kernels' backward documents the first
    # (ops/hopfield.py).  Ties are common in 16 bits at small D -- session 33's random fuzzing,
    # float16, D = 1, N = 65: two patterns +-x, dX 1.21 off against a tolerance of 1.3e-2.
    sq = stored.pow(2).sum(dim=-1)
    max_sq = sq.gather(-1, sq.argmax(dim=-1, keepdim=True))
    return -lse / beta + 0.5 * state.pow(2).sum(dim=-1) + math.log(n) / beta + 0.5 * max_sq

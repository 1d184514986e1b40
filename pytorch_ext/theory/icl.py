r"""In-context linear regression with attention, reproduced on attnkit's ops.

Three results, each on models whose forward and backward run through attnkit's kernels:

1. **Zhang, Frei & Bartlett (2024)**, "Trained transformers learn linear models in-context",
   JMLR 25(49) (ZFB).  A single linear self-attention (LSA) layer trained by gradient flow on the
   population loss of random linear regression prompts converges from the paper's initialization
   (:func:`zfb_init`) to the global minimizer :func:`zfb_limit`, which predicts
   ``ŷ = x_qᵀ Γ⁻¹ (1/M Σ y_i x_i)`` with ``Γ = (1 + 1/N) Λ + tr(Λ)/N · I`` and has the prediction
   risk :func:`zfb_risk` on prompts of any length M.
2. **von Oswald et al. (2023)**, "Transformers learn in-context by gradient descent", ICML.
   One LSA layer with :func:`gd_step_weights` computes one gradient-descent step on the
   in-context least-squares loss; a layer trained from a random init (:func:`train_lsa`) reaches
   the loss of the best single GD step and its weights align with the construction.
3. **Garg, Tsipras, Liang & Valiant (2022)**, "What can transformers learn in-context? A case
   study of simple function classes", NeurIPS.  :func:`icl_curve`: the normalized error
   ``(ŷ − wᵀx_q)²/d`` against the number k of in-context examples for least squares, averaging,
   3-nearest-neighbours and a small causal transformer on attnkit (:mod:`attnkit.theory._model`).

Conventions.  A batch of regression prompts is ``X [B, M, d]`` (the in-context inputs),
``y [B, M]``, ``x_q [B, d]`` (the query).  The ZFB prompt matrix ``E ∈ R^{(d+1)×(M+1)}`` (one
column per token) is stored here transposed, one **row** per token: :func:`prompt_matrix` returns
``[B, M+1, d+1]`` with rows ``(x_i, y_i)`` and a last row ``(x_q, 0)``.

Command: ``python -m attnkit theory icl [--quick] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..ops.linear import linear_attention

__all__ = [
    "RegressionBatch",
    "sample_regression",
    "prompt_matrix",
    "LinearSelfAttention",
    "zfb_gamma",
    "zfb_init",
    "zfb_limit",
    "zfb_predict",
    "zfb_risk",
    "zfb_population_loss",
    "zfb_population_prompts",
    "train_zfb",
    "monte_carlo_risk",
    "gd_step_weights",
    "gd_step_predict",
    "best_gd_step",
    "lsa_gd_alignment",
    "train_lsa",
    "LSAResult",
    "least_squares_predict",
    "averaging_predict",
    "knn_predict",
    "BASELINES",
    "icl_curve",
    "garg_tokens",
    "paired_tokens",
    "train_icl_transformer",
    "transformer_predictor",
    "main",
]

DTYPE = torch.float64


# ==============================================================================================
# data
# ==============================================================================================


@dataclass
class RegressionBatch:
    """B random linear-regression prompts: ``y_i = wᵀx_i (+ noise)``, the query ``x_q`` and its
    noise-free target ``y_q = wᵀx_q``."""

    X: torch.Tensor  # [B, M, d]
    y: torch.Tensor  # [B, M]
    x_q: torch.Tensor  # [B, d]
    y_q: torch.Tensor  # [B]
    w: torch.Tensor  # [B, d]


def _sqrtm(A: torch.Tensor) -> torch.Tensor:
    """Symmetric PSD square root (eigendecomposition; negative round-off clipped to 0)."""
    e, V = torch.linalg.eigh(A)
    return (V * e.clamp_min(0).sqrt().unsqueeze(-2)) @ V.transpose(-1, -2)


def _as_lambda(Lambda, d: Optional[int] = None, dtype=DTYPE) -> torch.Tensor:
    if Lambda is None:
        if d is None:
            raise ValueError("give Lambda or d")
        return torch.eye(d, dtype=dtype)
    L = torch.as_tensor(Lambda, dtype=dtype)
    if L.dim() == 1:
        L = torch.diag(L)
    if L.dim() != 2 or L.shape[0] != L.shape[1]:
        raise ValueError(f"Lambda must be a [d, d] matrix or a [d] diagonal; got shape {tuple(L.shape)}")
    if not torch.allclose(L, L.T):
        raise ValueError("Lambda must be symmetric")
    if torch.linalg.eigvalsh(L).min() <= 0:
        raise ValueError("Lambda must be positive definite")
    return L


def sample_regression(batch: int, M: int, d: int, *, Lambda=None, x_dist: str = "gaussian",
                      noise_std: float = 0.0, generator: Optional[torch.Generator] = None,
                      dtype: torch.dtype = DTYPE) -> RegressionBatch:
    """Draw ``batch`` prompts of M examples: ``w ~ N(0, I_d)`` and, for every x (the M examples
    and the query), ``x ~ N(0, Λ)`` (``x_dist="gaussian"``: ZFB, Garg et al.; Λ = I when None) or
    ``x ~ U(-1, 1)^d`` (``x_dist="uniform"``: von Oswald et al.).  ``y_i = wᵀx_i + noise_std·ε_i``;
    the query's target ``y_q = wᵀx_q`` is noise-free.
    """
    g = generator
    if x_dist == "gaussian":
        L = _as_lambda(Lambda, d, dtype)
        x = torch.randn(batch, M + 1, d, generator=g, dtype=dtype) @ _sqrtm(L)
    elif x_dist == "uniform":
        x = torch.rand(batch, M + 1, d, generator=g, dtype=dtype) * 2 - 1
    else:
        raise ValueError(f"x_dist must be 'gaussian' or 'uniform'; got {x_dist!r}")
    w = torch.randn(batch, d, generator=g, dtype=dtype)
    clean = torch.einsum("bmd,bd->bm", x, w)
    y = clean[:, :M]
    if noise_std:
        y = y + noise_std * torch.randn(y.shape, generator=g, dtype=dtype)
    return RegressionBatch(X=x[:, :M], y=y, x_q=x[:, M], y_q=clean[:, M], w=w)


def prompt_matrix(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """The ZFB prompt ``E = [[x_1 … x_M, x_q], [y_1 … y_M, 0]]``, one row per token:
    ``[B, M+1, d+1]``."""
    ctx = torch.cat([X, y.unsqueeze(-1)], dim=-1)
    query = torch.cat([x_q, torch.zeros_like(x_q[..., :1])], dim=-1).unsqueeze(1)
    return torch.cat([ctx, query], dim=1)


# ==============================================================================================
# the linear self-attention layer
# ==============================================================================================


class LinearSelfAttention(nn.Module):
    r"""The single-layer linear self-attention of Zhang, Frei & Bartlett (JMLR 2024), eq. (3.3):

    .. math::  f(E) = E + W^{PV} E \cdot \frac{E^\top W^{KQ} E}{M}, \qquad \hat y = f(E)_{d+1, M+1}

    for a prompt E with M labelled columns and the query column (key-query and projection-value
    matrices merged, as in the paper).  Tokens are rows here (``E`` is ``[B, M+1, d+1]``), so the
    attention term is ``(1/M) Σ_j (q_i·k_j) v_j`` with ``q_i = W^{KQ} z_i``, ``k_j = z_j``,
    ``v_j = W^{PV} z_j``: exactly :func:`attnkit.linear_attention` with
    ``feature_map="identity", normalize=False, scale=1/M`` (non-causal; the sum runs over all
    M+1 tokens, the query's included, as in the paper).  Forward and backward run on attnkit's
    linear-attention kernels (``backend`` picks the backend; None = the default).

    Args:
        d: input dimension (tokens have d+1 entries).
        W_KQ, W_PV: ``[d+1, d+1]`` initial weights (copied), or None for i.i.d. N(0, init_std²)
            entries drawn from ``generator``.
    """

    def __init__(self, d: int, W_KQ: Optional[torch.Tensor] = None, W_PV: Optional[torch.Tensor] = None,
                 *, init_std: float = 0.1, generator: Optional[torch.Generator] = None,
                 dtype: torch.dtype = DTYPE, backend: Optional[str] = None):
        super().__init__()
        self.d = d
        self.backend = backend
        shape = (d + 1, d + 1)

        def make(W):
            if W is None:
                return init_std * torch.randn(shape, generator=generator, dtype=dtype)
            W = torch.as_tensor(W, dtype=dtype).detach().clone()
            if tuple(W.shape) != shape:
                raise ValueError(f"weights must be {shape}; got {tuple(W.shape)}")
            return W

        self.W_KQ = nn.Parameter(make(W_KQ))
        self.W_PV = nn.Parameter(make(W_PV))

    def forward(self, E: torch.Tensor) -> torch.Tensor:
        """``E [B, M+1, d+1]`` → ``f(E) [B, M+1, d+1]``."""
        M = E.shape[-2] - 1
        q = (E @ self.W_KQ.T).unsqueeze(1)  # [B, 1, M+1, d+1]
        k = E.unsqueeze(1)
        v = (E @ self.W_PV.T).unsqueeze(1)
        out = linear_attention(q, k, v, feature_map="identity", normalize=False, scale=1.0 / M,
                               backend=self.backend)
        return E + out.squeeze(1)

    def predict(self, E: torch.Tensor) -> torch.Tensor:
        """ŷ = f(E)[d+1, M+1] (the query token's label slot): ``[B]``."""
        return self.forward(E)[:, -1, -1]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Detached copies ``(W_KQ, W_PV)``."""
        return self.W_KQ.detach().clone(), self.W_PV.detach().clone()


# ==============================================================================================
# Zhang, Frei & Bartlett: initialization, limit, closed forms
# ==============================================================================================


def zfb_gamma(Lambda, N: int) -> torch.Tensor:
    r"""ZFB's ``Γ = (1 + 1/N) Λ + tr(Λ)/N · I_d`` (Theorem 4.1), N the training prompt length."""
    L = _as_lambda(Lambda)
    d = L.shape[0]
    return (1 + 1 / N) * L + torch.trace(L) / N * torch.eye(d, dtype=L.dtype)


def zfb_init(d: int, sigma: float, Lambda=None, *, Theta: Optional[torch.Tensor] = None,
             generator: Optional[torch.Generator] = None, dtype: torch.dtype = DTYPE):
    r"""ZFB's initialization (Assumption 3.3): ``W^{PV}(0) = σ [[0, 0], [0, 1]]``,
    ``W^{KQ}(0) = σ [[ΘΘᵀ, 0], [0, 0]]`` with ``‖ΘΘᵀ‖_F = 1`` and ``ΘΘᵀΛ ≠ 0``.

    Θ: given, or drawn with i.i.d. N(0, 1) entries from ``generator`` (our choice: the paper
    allows any such Θ); it is rescaled so that ``‖ΘΘᵀ‖_F = 1``.  ``sigma``: the paper needs it small
    (Theorem 4.1 states an upper bound depending on Λ and N); 0.1 converges in every case we ran.
    The init is *balanced* (``‖W^{KQ}_{11}‖_F = W^{PV}_{22} = σ``), which is what makes gradient flow
    pick the balanced minimizer :func:`zfb_limit` among the rescalings ``(c·W^{PV}, W^{KQ}/c)``.
    Returns ``(W_KQ, W_PV)``, two ``[d+1, d+1]`` tensors.
    """
    L = _as_lambda(Lambda, d, dtype)
    if Theta is None:
        Theta = torch.randn(d, d, generator=generator, dtype=dtype)
    Theta = torch.as_tensor(Theta, dtype=dtype)
    A = Theta @ Theta.T
    A = A / torch.linalg.matrix_norm(A)
    if torch.linalg.matrix_norm(A @ L) == 0:
        raise ValueError("zfb_init: Θ Θᵀ Λ must be nonzero")
    W_KQ = torch.zeros(d + 1, d + 1, dtype=dtype)
    W_PV = torch.zeros(d + 1, d + 1, dtype=dtype)
    W_KQ[:d, :d] = sigma * A
    W_PV[d, d] = sigma
    return W_KQ, W_PV


def zfb_limit(Lambda, N: int):
    r"""The global minimizer reached by gradient flow from :func:`zfb_init` (ZFB Theorem 4.1):

    ``W^{KQ} = [[tr(Γ⁻²)^{-1/4} Γ⁻¹, 0], [0, 0]]``, ``W^{PV} = [[0, 0], [0, tr(Γ⁻²)^{1/4}]]``,
    Γ from :func:`zfb_gamma`.  Its prediction on a prompt of length M is
    ``ŷ = x_qᵀ Γ⁻¹ (1/M Σ_i y_i x_i)`` (:func:`zfb_predict`).  Returns ``(W_KQ, W_PV)``.
    """
    L = _as_lambda(Lambda)
    d = L.shape[0]
    Gi = torch.linalg.inv(zfb_gamma(L, N))
    t = torch.trace(Gi @ Gi)
    W_KQ = torch.zeros(d + 1, d + 1, dtype=L.dtype)
    W_PV = torch.zeros(d + 1, d + 1, dtype=L.dtype)
    W_KQ[:d, :d] = t ** -0.25 * Gi
    W_PV[d, d] = t ** 0.25
    return W_KQ, W_PV


def zfb_predict(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor, Lambda, N: int) -> torch.Tensor:
    r"""The closed-form prediction of the ZFB limit: ``ŷ = x_qᵀ Γ⁻¹ (1/M Σ_{i≤M} y_i x_i)``, M the
    prompt's length, Γ for the *training* length N.  ``[B]``."""
    M = X.shape[1]
    Gi = torch.linalg.inv(zfb_gamma(Lambda, N)).to(X.dtype)
    h = torch.einsum("bm,bmd->bd", y, X) / M
    return torch.einsum("bd,de,be->b", x_q, Gi, h)


def zfb_risk(Lambda, N: int, M: int) -> float:
    r"""Prediction risk of the ZFB limit on a fresh noise-free prompt of length M (ZFB Theorem
    4.1, the ``E(ŷ − ⟨w, x_q⟩)²`` of the trained transformer, w ~ N(0, I), x ~ N(0, Λ)):

    .. math::  \mathcal R(M) = \operatorname{tr}\big[\Lambda (I - \Gamma^{-1}\Lambda)^2\big]
               + \frac1M\Big[\operatorname{tr}(\Gamma^{-2}\Lambda^3)
               + \operatorname{tr}(\Gamma^{-2}\Lambda^2)\operatorname{tr}(\Lambda)\Big]

    (Γ for the training length N; the first term is O(1/N²) for isotropic Λ, the second O(1/M):
    training and test prompt lengths enter differently.)  Derived from the Gaussian fourth moment
    ``E[x xᵀ A x xᵀ] = 2ΛAΛ + tr(AΛ)Λ``; checked by Monte Carlo in the tests.
    """
    L = _as_lambda(Lambda)
    Gi = torch.linalg.inv(zfb_gamma(L, N))
    d = L.shape[0]
    Rm = torch.eye(d, dtype=L.dtype) - Gi @ L
    tr = torch.trace
    G2 = Gi @ Gi
    value = tr(L @ Rm @ Rm) + (tr(G2 @ L @ L @ L) + tr(G2 @ L @ L) * tr(L)) / M
    return float(value)


def zfb_population_loss(W_KQ: torch.Tensor, W_PV: torch.Tensor, Lambda, N: int) -> float:
    r"""Closed-form population loss ``L = ½ E(ŷ − wᵀx_q)²`` at weights of the ZFB form
    (only ``W^{KQ}_{11}`` and ``W^{PV}_{22}`` nonzero; the form gradient flow keeps from
    :func:`zfb_init`).  With ``P = W^{PV}_{22} W^{KQ}_{11}``, ``A = PΛPᵀ``::

        2L = (1 + 1/N) tr(ΛAΛ) + tr(AΛ) tr(Λ)/N − 2 tr(ΛPΛ) + tr(Λ)

    Minimized at ``P = Γ⁻¹``.  Used to check the exact cubature of :func:`zfb_population_prompts`.
    """
    L = _as_lambda(Lambda)
    d = L.shape[0]
    P = W_PV[d, d] * W_KQ[:d, :d]
    A = P @ L @ P.T
    tr = torch.trace
    return float(0.5 * ((1 + 1 / N) * tr(L @ A @ L) + tr(A @ L) * tr(L) / N - 2 * tr(L @ P @ L) + tr(L)))


def _hadamard(m: int, dtype=DTYPE) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=dtype)
    while H.shape[0] < m:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def zfb_population_prompts(Lambda, N: int, *, dtype: torch.dtype = DTYPE):
    r"""A finite set of equally weighted prompts on which the mean of ``½(ŷ − y_q)²`` *equals* the
    ZFB population loss (x ~ N(0, Λ), w ~ N(0, I)) at every weight of the form that gradient flow
    from :func:`zfb_init` keeps -- so full-batch gradient descent on these prompts is gradient
    descent on the population loss, the paper's ``B → ∞`` limit, with no Monte-Carlo error.

    Why it is exact (our construction; the paper works with the expectation analytically): at
    such weights ``ŷ = W^{PV}_{22} wᵀ S W^{KQ}_{11} x_q`` with ``S = (1/N) Σ x_i x_iᵀ``, so the loss is
    quadratic in w, in x_q and in S, and only needs ``E[wwᵀ] = I`` (plus symmetry under w → −w,
    which keeps the other blocks at exactly zero along the trajectory), ``E[x_q x_qᵀ] = Λ``,
    ``E[S] = Λ`` and the Wishart covariance ``Cov(S_ab, S_ce) = (Λ_ac Λ_be + Λ_ae Λ_bc)/N``
    (whitened: ``(δ_ac δ_be + δ_ae δ_bc)/N``).  The design:

    - w ∈ {±√d e_a} (2d points), x_q ∈ {√d Λ^{1/2} e_a} (d points);
    - ``S = Λ^{1/2} (I + N^{-1/2} Σ_k ε_rk c_k B_k) Λ^{1/2}`` over the symmetric basis
      ``B_k`` (``e_a e_aᵀ`` with c = √2; ``e_a e_bᵀ + e_b e_aᵀ`` with c = 1), the sign patterns ε_r
      the rows of a Sylvester-Hadamard matrix (columns 1..K: balanced, orthogonal, so
      ``E ε_k = 0``, ``E ε_k ε_l = δ_kl``);
    - each S realized by N context tokens ``x_j = √N (O S^{1/2})_j`` with O an N × d matrix with
      orthonormal columns (``(1/N) Σ x_j x_jᵀ = S``).

    Needs every S positive semi-definite, i.e. N ≥ (the most negative eigenvalue of
    ``Σ_k ε_rk c_k B_k``)²: N ≥ 6 for d = 2, 9 for d = 3, 17 for d = 5; raises ValueError otherwise.

    Returns ``(E [P, N+1, d+1], y_q [P])`` (``P = m · 2d · d``, m the Hadamard order).
    """
    L = _as_lambda(Lambda, dtype=dtype)
    d = L.shape[0]
    basis = []
    for a in range(d):
        B = torch.zeros(d, d, dtype=dtype)
        B[a, a] = math.sqrt(2.0)
        basis.append(B)
    for a in range(d):
        for b in range(a + 1, d):
            B = torch.zeros(d, d, dtype=dtype)
            B[a, b] = B[b, a] = 1.0
            basis.append(B)
    K = len(basis)
    m = 1
    while m < K + 1:
        m *= 2
    eps = _hadamard(m, dtype)[:, 1:K + 1]  # [m, K]
    H = torch.einsum("rk,kab->rab", eps, torch.stack(basis))
    lowest = float(torch.linalg.eigvalsh(H).min())
    if 1 + lowest / math.sqrt(N) < -1e-12:
        raise ValueError(
            f"zfb_population_prompts: N={N} is too short for the exact cubature at d={d} "
            f"(needs N >= {lowest ** 2:.1f})")
    S_white = torch.eye(d, dtype=dtype) + H / math.sqrt(N)
    R = _sqrtm(L)
    S = R @ S_white @ R  # [m, d, d]
    g = torch.Generator().manual_seed(0)
    O = torch.linalg.qr(torch.randn(N, N, generator=g, dtype=dtype))[0][:, :d]  # orthonormal columns
    ctx = math.sqrt(N) * torch.einsum("ja,rab->rjb", O, _sqrtm(S))  # [m, N, d]
    W = math.sqrt(d) * torch.cat([torch.eye(d, dtype=dtype), -torch.eye(d, dtype=dtype)])  # [2d, d]
    XQ = math.sqrt(d) * R.T  # rows √d Λ^{1/2} e_a, [d, d]
    n_w = W.shape[0]
    X = ctx[:, None, None].expand(m, n_w, d, N, d)
    w = W[None, :, None].expand(m, n_w, d, d)
    xq = XQ[None, None].expand(m, n_w, d, d)
    y = torch.einsum("rwqjd,rwqd->rwqj", X, w)
    y_q = (w * xq).sum(-1)
    E = prompt_matrix(X.reshape(-1, N, d), y.reshape(-1, N), xq.reshape(-1, d))
    return E, y_q.reshape(-1)


def _relative_distance(W_KQ, W_PV, ref) -> float:
    diff = torch.cat([W_KQ - ref[0], W_PV - ref[1]])
    return float(torch.linalg.matrix_norm(diff) / torch.linalg.matrix_norm(torch.cat(ref)))


def _symmetrize(W: torch.Tensor) -> torch.Tensor:
    """``(W + DWD)/2`` with ``D = diag(1, …, 1, −1)``: zeroes the blocks that mix x and y."""
    D = torch.ones(W.shape[0], dtype=W.dtype)
    D[-1] = -1
    return 0.5 * (W + D[:, None] * W * D[None, :])


def train_zfb(Lambda, N: int, *, sigma: float = 0.1, lr: float = 0.1, steps: int = 2000,
              seed: int = 0, grad_tol: float = 1e-13, record_every: int = 10, progress: bool = False,
              backend: Optional[str] = None):
    r"""Gradient descent on the ZFB population loss ``½ E(ŷ − wᵀx_q)²`` from :func:`zfb_init`.

    ``W ← W − lr ∇L(W)`` (plain full-batch GD, a small-step discretization of the paper's gradient
    flow), the loss evaluated exactly on :func:`zfb_population_prompts` through
    :class:`LinearSelfAttention` (forward and gradients by attnkit's linear-attention kernels).
    Θ of the init is drawn from ``seed``.  Stops after ``steps`` steps or when the gradient norm
    falls below ``grad_tol``.

    Symmetry (our choice, named): the population loss is invariant under ``y → −y``
    (``w → −w``), i.e. under ``W ↦ DWD``, ``D = diag(1, …, 1, −1)``; from the symmetric init its
    gradient flow keeps the blocks that mix x and y at zero (ZFB, proof of Lemma 5.2: u₁₂ and u₂₁
    vanish).  In floating point they pick up ~1e-17 round-off, and the cubature of
    :func:`zfb_population_prompts` is exact only on the symmetric subspace -- off it, it does not
    reproduce the population loss's stabilizing curvature, and at d = 5 the round-off grew to O(1)
    within 300 steps.  So every step is followed by the projection ``W ← (W + DWD)/2``, which
    changes nothing in exact arithmetic.

    Returns ``(model, history)``; history has ``step``, ``loss``, ``distance`` (relative
    Frobenius distance of ``(W_KQ, W_PV)`` to :func:`zfb_limit`), recorded every
    ``record_every`` steps and at the end.
    """
    L = _as_lambda(Lambda)
    d = L.shape[0]
    g = torch.Generator().manual_seed(seed)
    W_KQ, W_PV = zfb_init(d, sigma, L, generator=g)
    model = LinearSelfAttention(d, W_KQ, W_PV, backend=backend)
    E, y_q = zfb_population_prompts(L, N)
    target = zfb_limit(L, N)
    history = {"step": [], "loss": [], "distance": []}
    params = [model.W_KQ, model.W_PV]
    bar = _progress(range(steps), progress, "ZFB gradient descent")
    for step in bar:
        loss = 0.5 * (model.predict(E) - y_q).pow(2).mean()
        grads = torch.autograd.grad(loss, params)
        gnorm = math.sqrt(sum(float(gr.pow(2).sum()) for gr in grads))
        last = step == steps - 1 or gnorm < grad_tol
        if step % record_every == 0 or last:
            history["step"].append(step)
            history["loss"].append(float(loss.detach()))
            history["distance"].append(_relative_distance(*model.weights(), target))
        if not math.isfinite(gnorm):
            raise FloatingPointError(f"train_zfb: the gradient is not finite at step {step} (lr={lr} too large?)")
        if last:
            break
        with torch.no_grad():
            for p, gr in zip(params, grads):
                p -= lr * gr
                p.copy_(_symmetrize(p))
    return model, history


def monte_carlo_risk(model: Callable[[torch.Tensor], torch.Tensor], Lambda, M: int, n_prompts: int,
                     *, seed: int = 0, chunk: int = 8192):
    r"""Monte-Carlo estimate of ``E(ŷ − wᵀx_q)²`` for a predictor on fresh prompts of length M
    (x ~ N(0, Λ), w ~ N(0, I), noise-free).  ``model`` maps a prompt matrix to ŷ (e.g.
    ``LinearSelfAttention.predict``).  Returns ``(mean, standard error)``."""
    L = _as_lambda(Lambda)
    d = L.shape[0]
    g = torch.Generator().manual_seed(seed)
    errs = []
    with torch.no_grad():
        for start in range(0, n_prompts, chunk):
            b = min(chunk, n_prompts - start)
            data = sample_regression(b, M, d, Lambda=L, generator=g)
            errs.append((model(prompt_matrix(data.X, data.y, data.x_q)) - data.y_q).pow(2))
    e = torch.cat(errs)
    return float(e.mean()), float(e.std() / math.sqrt(e.numel()))


# ==============================================================================================
# von Oswald et al.: one GD step
# ==============================================================================================


def gd_step_weights(d: int, eta: float, *, dtype: torch.dtype = DTYPE):
    r"""Weights with which :class:`LinearSelfAttention` computes one gradient-descent step
    (von Oswald et al. 2023, Proposition 1, in ZFB's merged parameterization):

    ``W^{KQ} = [[I_d, 0], [0, 0]]``, ``W^{PV} = [[0, 0], [0, η]]``, so that
    ``ŷ = (η/N) Σ_i y_i x_iᵀ x_q = w_1ᵀ x_q`` with ``w_1 = w_0 − η ∇_w L(w_0)``, ``w_0 = 0``,
    ``L(w) = 1/(2N) Σ_i (wᵀx_i − y_i)²``.  (The paper writes the step into the query token's label
    slot with the opposite sign, ``−ŷ``; reading ``f(E)_{d+1, N+1}`` as ZFB do gives +η.)
    Returns ``(W_KQ, W_PV)``.
    """
    W_KQ = torch.zeros(d + 1, d + 1, dtype=dtype)
    W_KQ[:d, :d] = torch.eye(d, dtype=dtype)
    W_PV = torch.zeros(d + 1, d + 1, dtype=dtype)
    W_PV[d, d] = eta
    return W_KQ, W_PV


def gd_step_predict(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor, eta: float) -> torch.Tensor:
    r"""One GD step from w = 0 on ``1/(2N) Σ (wᵀx_i − y_i)²``, evaluated at the query:
    ``ŷ = (η/N) Σ_i y_i x_iᵀ x_q``.  ``[B]``."""
    N = X.shape[1]
    return eta / N * torch.einsum("bn,bnd,bd->b", y, X, x_q)


def best_gd_step(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor, y_q: torch.Tensor):
    r"""The single GD step with the best learning rate on these prompts (exact line search: the
    loss ``½ mean(η p − y_q)²``, ``p = (1/N) Σ y_i x_iᵀ x_q``, is quadratic in η, minimized at
    ``η* = ⟨p, y_q⟩ / ⟨p, p⟩``).  Returns ``(η*, loss at η*)``."""
    p = gd_step_predict(X, y, x_q, 1.0)
    eta = float((p * y_q).sum() / (p * p).sum())
    return eta, float(0.5 * (eta * p - y_q).pow(2).mean())


def lsa_gd_alignment(W_KQ: torch.Tensor, W_PV: torch.Tensor):
    r"""How close a layer's weights are to :func:`gd_step_weights`, after the normalization the
    comparison needs (our choice, von Oswald et al. compare after rescaling):

    ŷ depends on the weights only through the tensor ``T = u ⊗ W^{KQ}_{:, 1:d}`` (u = the last row
    of W^{PV}: ``ŷ = Σ_{abc} T_{abc} (EEᵀ/N)_{ab} x_{q,c}``); T is invariant under the rescaling
    ``(c·W^{PV}, W^{KQ}/c)`` and ignores the entries that never reach ŷ.  Returns
    ``(cosine(T, T_GD), η_eff)`` where ``T_GD`` is T of ``gd_step_weights(d, 1)`` and
    ``η_eff = ⟨T, T_GD⟩ / ‖T_GD‖²`` is the learning rate of the closest GD step.
    """
    d = W_KQ.shape[0] - 1
    T = torch.einsum("a,bc->abc", W_PV[d], W_KQ[:, :d])
    G_KQ, G_PV = gd_step_weights(d, 1.0, dtype=W_KQ.dtype)
    Tg = torch.einsum("a,bc->abc", G_PV[d], G_KQ[:, :d])
    dot = float((T * Tg).sum())
    return dot / float(T.norm() * Tg.norm()), dot / float((Tg * Tg).sum())


@dataclass
class LSAResult:
    """What :func:`train_lsa` measured (losses are ``½ mean(ŷ − y_q)²`` on a fixed evaluation
    set of fresh prompts, shared by the trained layer and the GD step)."""

    model: LinearSelfAttention
    loss: float  # trained layer
    gd_loss: float  # best single GD step
    gd_eta: float  # its learning rate (line search)
    loss_ratio: float  # loss / gd_loss
    cosine: float  # lsa_gd_alignment
    eta_eff: float
    losses: list = field(default_factory=list)  # training loss per step


def train_lsa(d: int = 10, N: int = 10, *, steps: int = 2000, batch: int = 1000, lr: float = 0.03,
              init_std: float = 0.1, x_dist: str = "uniform", eval_prompts: int = 20000,
              seed: int = 0, progress: bool = False, backend: Optional[str] = None) -> LSAResult:
    r"""Train one :class:`LinearSelfAttention` layer from a random init on random regression tasks
    and compare it with the best single GD step (von Oswald et al. 2023, Section 3).

    Setup (the paper's, with our choices named): tasks ``w ~ N(0, I_d)``, ``x ~ U(-1, 1)^d``
    (``x_dist``), N context examples, noise-free; loss ``½ mean(ŷ − y_q)²`` on a fresh batch
    every step; Adam (lr ``lr``, cosine decay to 0 -- ours, the paper uses Adam too; at d = 3
    lr 0.01 left 2 of 8 seeds on a plateau at 2.5× the GD loss after 500 steps, 0.03 none of 8 in
    800); init i.i.d. ``N(0, init_std²)`` entries of both merged matrices (ours).  The GD learning rate η*
    comes from :func:`best_gd_step` on the evaluation set.  Returns :class:`LSAResult`.
    """
    g = torch.Generator().manual_seed(seed)
    model = LinearSelfAttention(d, init_std=init_std, generator=g, backend=backend)
    ev = sample_regression(eval_prompts, N, d, x_dist=x_dist, generator=g)
    E_ev = prompt_matrix(ev.X, ev.y, ev.x_q)
    gd_eta, gd_loss = best_gd_step(ev.X, ev.y, ev.x_q, ev.y_q)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    for _ in _progress(range(steps), progress, "LSA training"):
        data = sample_regression(batch, N, d, x_dist=x_dist, generator=g)
        loss = 0.5 * (model.predict(prompt_matrix(data.X, data.y, data.x_q)) - data.y_q).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        final = float(0.5 * (model.predict(E_ev) - ev.y_q).pow(2).mean())
    cosine, eta_eff = lsa_gd_alignment(*model.weights())
    return LSAResult(model=model, loss=final, gd_loss=gd_loss, gd_eta=gd_eta,
                     loss_ratio=final / gd_loss, cosine=cosine, eta_eff=eta_eff, losses=losses)


# ==============================================================================================
# Garg et al.: ICL curves
# ==============================================================================================


def least_squares_predict(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """Minimum-norm least squares on the k examples: ``ŵ = X⁺ y`` (pseudo-inverse), ``ŷ = ŵᵀx_q``
    (0 for k = 0).  For noise-free data its normalized error is ``1 − k/d`` for k < d (ŵ is the
    projection of w on the span of the x_i) and 0 for k ≥ d."""
    if X.shape[1] == 0:
        return torch.zeros(X.shape[0], dtype=X.dtype)
    w_hat = torch.linalg.pinv(X) @ y.unsqueeze(-1)  # [B, d, 1]
    return (x_q.unsqueeze(1) @ w_hat).reshape(-1)


def averaging_predict(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """Averaging (Garg et al.): ``ŵ = (1/k) Σ y_i x_i``, ``ŷ = ŵᵀx_q`` (0 for k = 0)."""
    if X.shape[1] == 0:
        return torch.zeros(X.shape[0], dtype=X.dtype)
    return torch.einsum("bk,bkd,bd->b", y, X, x_q) / X.shape[1]


def knn_predict(X: torch.Tensor, y: torch.Tensor, x_q: torch.Tensor, n_neighbors: int = 3) -> torch.Tensor:
    """n-nearest neighbours (Garg et al.: 3, uniform weights): the mean label of the
    ``min(n_neighbors, k)`` examples closest to x_q in Euclidean distance (0 for k = 0)."""
    k = X.shape[1]
    if k == 0:
        return torch.zeros(X.shape[0], dtype=X.dtype)
    dist = (X - x_q.unsqueeze(1)).pow(2).sum(-1)
    idx = dist.topk(min(n_neighbors, k), dim=1, largest=False).indices
    return y.gather(1, idx).mean(1)


BASELINES: dict[str, Callable] = {
    "least_squares": least_squares_predict,
    "averaging": averaging_predict,
    "knn3": knn_predict,
}


def icl_curve(predictor: Union[str, Callable], d: int, ks: Sequence[int], *, n_prompts: int = 4000,
              seed: int = 0, noise_std: float = 0.0, return_se: bool = False,
              dtype: torch.dtype = DTYPE):
    r"""Garg et al. (2022)'s in-context learning curve: for each k in ``ks``, the mean normalized
    squared error ``(ŷ − wᵀx_q)² / d`` over ``n_prompts`` fresh prompts with k examples
    (``x, x_q ~ N(0, I_d)``, ``w ~ N(0, I_d)``, ``y_i = wᵀx_i + noise_std·ε``).

    ``predictor``: ``"least_squares"`` (min-norm), ``"averaging"``, ``"knn3"``, or a callable
    ``(X [B, k, d], y [B, k], x_q [B, d]) -> ŷ [B]`` (e.g. :func:`transformer_predictor`).
    Returns a list of mean errors (with ``return_se``: ``(means, standard errors)``).
    Each k uses its own generator seeded from ``(seed, k)``, so curves of different predictors
    with the same seed see the same prompts.
    """
    fn = BASELINES[predictor] if isinstance(predictor, str) else predictor
    means, ses = [], []
    for k in ks:
        g = torch.Generator().manual_seed(seed * 100003 + int(k))
        data = sample_regression(n_prompts, int(k), d, noise_std=noise_std, generator=g, dtype=dtype)
        with torch.no_grad():
            pred = fn(data.X, data.y, data.x_q).to(dtype)
        err = (pred - data.y_q).pow(2) / d
        means.append(float(err.mean()))
        ses.append(float(err.std() / math.sqrt(n_prompts)) if n_prompts > 1 else float("nan"))
    return (means, ses) if return_se else means


def garg_tokens(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Garg et al.'s sequence ``x_1, y_1, x_2, y_2, …``: ``[B, 2k, d+1]`` with x-tokens ``(x_i, 0)``
    and y-tokens ``(0_d, y_i)`` (our encoding; Garg et al. pad y to ``(y, 0, …, 0) ∈ R^d`` and tell
    the two kinds apart by position only).  The prediction of ``y_i`` is read at ``x_i``'s token."""
    B, k, d = X.shape
    xt = torch.cat([X, torch.zeros(B, k, 1, dtype=X.dtype)], -1)
    yt = torch.cat([torch.zeros(B, k, d, dtype=X.dtype), y.unsqueeze(-1)], -1)
    return torch.stack([xt, yt], dim=2).reshape(B, 2 * k, d + 1)


def paired_tokens(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One token per example, the label shifted by one: token i is ``(x_i, y_{i−1})`` (``y_0 = 0``),
    ``[B, k, d+1]``.  Causally it carries the same information as :func:`garg_tokens` at x_i's
    token (``x_1..x_i``, ``y_1..y_{i−1}``) in half the length; the prediction of ``y_i`` is read at
    token i."""
    y_prev = torch.cat([torch.zeros(X.shape[0], 1, dtype=X.dtype), y[:, :-1]], 1)
    return torch.cat([X, y_prev.unsqueeze(-1)], -1)


_TOKENS = {"paired": (paired_tokens, 1), "garg": (garg_tokens, 2)}


def _transformer_outputs(model, X, y, tokens):
    fn, stride = _TOKENS[tokens]
    return model(fn(X, y))[:, 0::stride, 0]  # the prediction of y_i, i = 1..k


def train_icl_transformer(d: int = 5, n_points: int = 15, *, d_model: int = 64, n_layers: int = 4,
                          n_heads: int = 4, steps: int = 15000, batch: int = 64, lr: float = 1e-3,
                          tokens: str = "paired", seed: int = 0, progress: bool = True,
                          dtype: torch.dtype = torch.float32, backend: Optional[str] = None):
    r"""Train a :class:`attnkit.theory._model.TinyCausalTransformer` to regress in context
    (Garg et al. 2022, reduced): prompts of ``n_points`` examples, ``x ~ N(0, I_d)``,
    ``w ~ N(0, I_d)``, noise-free; the output that has seen ``x_1..x_i`` and ``y_1..y_{i−1}``
    predicts ``y_i``; loss = the mean over i of ``(ŷ_i − y_i)²`` (Garg et al.'s; no curriculum).

    Our choices (named): ``tokens="paired"`` (:func:`paired_tokens`, one token ``(x_i, y_{i−1})``
    per example) by default -- in our CPU runs it left the loss plateau in fewer steps than
    Garg et al.'s interleaved ``tokens="garg"`` (:func:`garg_tokens`), which is available;
    a small model (``d_model`` 64, 4 layers, 4 heads, learned positions) so that training takes a
    few minutes on two CPU cores; AdamW at ``lr`` with 200 warm-up steps and gradient clipping 1,
    a fresh batch every step.  Returns ``(model, losses)``.
    """
    from ._model import TinyCausalTransformer, train_model

    if tokens not in _TOKENS:
        raise ValueError(f"tokens must be one of {sorted(_TOKENS)}; got {tokens!r}")
    torch.manual_seed(seed)
    model = TinyCausalTransformer(d + 1, d_model, n_layers, n_heads, 1, _TOKENS[tokens][1] * n_points,
                                  backend=backend, dtype=dtype)
    model.icl_tokens = tokens
    g = torch.Generator().manual_seed(seed)

    def batch_fn(_step):
        data = sample_regression(batch, n_points, d, generator=g, dtype=dtype)
        return data.X, data.y

    def loss_fn(m, b):
        X, y = b
        return (_transformer_outputs(m, X, y, tokens) - y).pow(2).mean()

    losses = train_model(model, batch_fn, loss_fn, steps, lr=lr, warmup=200, progress=progress,
                         desc="ICL transformer")
    return model, losses


def transformer_predictor(model: nn.Module, tokens: Optional[str] = None) -> Callable:
    """A predictor for :func:`icl_curve`: feeds the k examples and the query to a model trained by
    :func:`train_icl_transformer` (in its token format) and reads its prediction of ``y_q``."""
    tokens = tokens or getattr(model, "icl_tokens", "paired")

    def predict(X, y, x_q):
        dtype = next(model.parameters()).dtype
        Xf = torch.cat([X, x_q.unsqueeze(1)], 1).to(dtype)
        yf = torch.cat([y, torch.zeros(y.shape[0], 1, dtype=y.dtype)], 1).to(dtype)
        with torch.no_grad():
            return _transformer_outputs(model, Xf, yf, tokens)[:, -1].to(X.dtype)

    return predict


# ==============================================================================================
# command
# ==============================================================================================


def _progress(it, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, leave=False, mininterval=0.5)


def _table(headers, rows) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def main(argv: Optional[list] = None) -> int:
    """``python -m attnkit theory icl``: the three ICL experiments, a table each, one PNG."""
    ap = argparse.ArgumentParser(prog="python -m attnkit theory icl", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run in seconds (small sizes)")
    ap.add_argument("--out", default=os.path.join("bench", "out", "theory"), help="folder for the PNG")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transformer-steps", type=int, default=None,
                    help="training steps of the ICL transformer (default 15000; --quick: 30)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    prog = not args.no_progress
    t0 = time.time()

    # --- 1. ZFB ---------------------------------------------------------------------------
    d1, N1 = (3, 10) if q else (5, 20)
    lambdas = {
        "isotropic": torch.ones(d1, dtype=DTYPE),
        "anisotropic": torch.linspace(1.0, 0.2, d1, dtype=DTYPE),
    }
    Ms = [N1] if q else [5, N1, 4 * N1]
    n_mc = 2000 if q else 200000
    zfb_rows, risk_rows, zfb_hist = [], [], {}
    for name, lam in lambdas.items():
        model, hist = train_zfb(lam, N1, steps=300 if q else 4000, lr=0.1, seed=args.seed, progress=prog)
        zfb_hist[name] = hist
        test = sample_regression(4000, N1, d1, Lambda=lam, generator=torch.Generator().manual_seed(1))
        E = prompt_matrix(test.X, test.y, test.x_q)
        with torch.no_grad():
            pm = model.predict(E)
        pc = zfb_predict(test.X, test.y, test.x_q, lam, N1)
        rel = float((pm - pc).norm() / pc.norm())
        zfb_rows.append([name, "[" + ", ".join(f"{x:.3g}" for x in lam.tolist()) + "]", N1, hist["step"][-1] + 1,
                         f"{hist['distance'][-1]:.2e}", f"{rel:.1e}"])
        limit = LinearSelfAttention(d1, *zfb_limit(lam, N1))
        for M in Ms:
            mean, se = monte_carlo_risk(limit.predict, lam, M, n_mc, seed=args.seed + M)
            theory = zfb_risk(lam, N1, M)
            risk_rows.append([name, M, f"{theory:.5f}", f"{mean:.5f} ± {se:.5f}", f"{(mean - theory) / se:+.2f}"])
    print(f"ZFB (JMLR 2024): GD from zfb_init on the exact population loss, d={d1}, N={N1}")
    print(_table(["Λ", "diag Λ", "N", "steps", "‖W−W_lim‖/‖W_lim‖", "pred. vs closed form"], zfb_rows))
    print()
    print(f"ZFB risk of the limit on prompts of length M ({n_mc} Monte-Carlo prompts)")
    print(_table(["Λ", "M", "paper (Thm 4.1)", "Monte Carlo", "z"], risk_rows))
    print()

    # --- 2. von Oswald ----------------------------------------------------------------------
    d2, N2 = (3, 10) if q else (10, 10)
    res = train_lsa(d2, N2, steps=150 if q else 4000, batch=256 if q else 1000,
                    eval_prompts=5000 if q else 100000, seed=args.seed, progress=prog)
    W_KQ, W_PV = gd_step_weights(d2, res.gd_eta)
    print(f"von Oswald et al. (ICML 2023): one LSA layer vs one GD step, d={d2}, N={N2}, x ~ U(-1,1)^d")
    print(_table(["GD η* (line search)", "GD loss", "trained loss", "ratio", "cos(T, T_GD)", "η_eff"],
                 [[f"{res.gd_eta:.4f}", f"{res.gd_loss:.5f}", f"{res.loss:.5f}", f"{res.loss_ratio:.4f}",
                   f"{res.cosine:.5f}", f"{res.eta_eff:.4f}"]]))
    print()

    # --- 3. Garg ----------------------------------------------------------------------------
    d3 = 5
    n_points = 3 * d3
    ks = list(range(0, n_points))
    n_prompts = 500 if q else 4000
    steps = args.transformer_steps if args.transformer_steps is not None else (30 if q else 15000)
    t_tr = time.time()
    tf_model, tf_losses = train_icl_transformer(d3, n_points, steps=steps, seed=args.seed, progress=prog)
    t_tr = time.time() - t_tr
    curves = {}
    for name in ["least_squares", "averaging", "knn3"]:
        curves[name] = icl_curve(name, d3, ks, n_prompts=n_prompts, seed=args.seed, return_se=True)
    curves["transformer"] = icl_curve(transformer_predictor(tf_model), d3, ks, n_prompts=n_prompts,
                                      seed=args.seed, return_se=True)
    rows = []
    for i, k in enumerate(ks):
        rows.append([k, f"{max(0.0, 1 - k / d3):.3f}"] + [f"{curves[n][0][i]:.4f}" for n in curves])
    print(f"Garg et al. (NeurIPS 2022): normalized error (ŷ − wᵀx_q)²/d vs k, d={d3}, {n_prompts} prompts; "
          f"transformer: TinyCausalTransformer on attnkit.softmax_attention, {steps} steps ({t_tr:.0f} s)")
    print(_table(["k", "1 − k/d", "least squares", "averaging", "3-NN", "transformer"], rows))

    # --- figure ------------------------------------------------------------------------------
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8.5))
    for name, h in zfb_hist.items():
        ax[0, 0].semilogy(h["step"], h["distance"], label=name)
    ax[0, 0].set(xlabel="GD step", ylabel="‖W − W_lim‖_F / ‖W_lim‖_F",
                 title=f"ZFB: GD from zfb_init → zfb_limit (d={d1}, N={N1})")
    ax[0, 0].legend()
    for i, (name, lam) in enumerate(lambdas.items()):
        Mgrid = list(range(2, 4 * N1 + 1))
        ax[0, 1].plot(Mgrid, [zfb_risk(lam, N1, M) for M in Mgrid], color=f"C{i}", label=f"{name}: paper (Thm 4.1)")
        pts = [r for r in risk_rows if r[0] == name]
        ax[0, 1].errorbar([r[1] for r in pts], [float(r[3].split(" ± ")[0]) for r in pts], color=f"C{i}",
                          yerr=[3 * float(r[3].split(" ± ")[1]) for r in pts], fmt="o",
                          label=f"{name}: Monte Carlo ± 3 SE")
    ax[0, 1].set(xlabel="test prompt length M", ylabel="risk E(ŷ − wᵀx_q)²", yscale="log",
                 title=f"ZFB limit risk (trained at N={N1})")
    ax[0, 1].legend(fontsize=8)
    window = max(1, min(100, len(res.losses) // 20))
    smooth = torch.tensor(res.losses).unfold(0, window, 1).mean(1).tolist()
    ax[1, 0].semilogy(range(window - 1, len(res.losses)), smooth, lw=1,
                      label=f"LSA (training loss, mean of {window} batches)")
    ax[1, 0].axhline(res.loss, color="C1", ls=":", label=f"LSA on the evaluation set: {res.loss:.4f}")
    ax[1, 0].axhline(res.gd_loss, color="k", ls="--", label=f"best GD step (η*={res.gd_eta:.3f}): {res.gd_loss:.4f}")
    ax[1, 0].set(xlabel="Adam step", ylabel="½ mean (ŷ − y_q)²",
                 title=f"von Oswald: LSA vs one GD step (cos = {res.cosine:.4f})")
    ax[1, 0].legend()
    for name, (m, s) in curves.items():
        ax[1, 1].errorbar(ks, m, yerr=[3 * v for v in s], label=name, capsize=2)
    ax[1, 1].plot(ks, [max(0.0, 1 - k / d3) for k in ks], "k:", label="1 − k/d")
    ax[1, 1].set(xlabel="in-context examples k", ylabel="(ŷ − wᵀx_q)² / d", ylim=(-0.05, 1.6),
                 title=f"Garg et al.: ICL curves (d={d3})")
    ax[1, 1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "icl.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path}  ({time.time() - t0:.0f} s)")
    return 0

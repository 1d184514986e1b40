r"""Attention as a max-margin token selector, reproduced on attnkit's softmax attention.

Tarzanagh, Li, Thrampoulidis & Oymak (2023), "Transformers as support vector machines" (TLTO;
arXiv:2308.16898), and Tarzanagh, Li, Zhang & Oymak (2023), "Max-margin token selection in
attention mechanism" (NeurIPS), as presented in the ICASSP 2024 tutorial "Fundamentals of
transformers" (Theorem 2 there).  The model reads one attention output through a linear head,

.. math::  f(X) = v^\top X^\top \operatorname{softmax}(X W z), \qquad
           \mathcal L(W) = \frac1n \sum_{i=1}^n \ell\big(Y_i\, f(X_i)\big), \quad \ell(u) = \log(1 + e^{-u}),

with ``X ∈ R^{T×d}`` the tokens, ``z ∈ R^d`` the query token, ``v`` a fixed head, ``Y_i = ±1``
(and the single-vector variant ``softmax(X p)``, ``p = W z``).  Gradient descent drives ‖W‖ → ∞
and the *direction* ``W/‖W‖`` to the solution of the attention SVM (:func:`att_svm`)

.. math::  W^{mm} = \arg\min_W \|W\|_F \ \text{ s.t. }\ (x_{i,\mathrm{opt}_i} - x_{i,t})^\top W z_i \ge 1
           \quad \forall t \ne \mathrm{opt}_i,\ i = 1..n,

which separates each sequence's selected token from the others.  Here the attention is
:func:`attnkit.softmax_attention` (query ``W z_i`` or ``p``, keys = values = the tokens,
``scale = 1``): forward and gradients run through attnkit's kernels.

Command: ``python -m attnkit theory svm [--quick] [--out DIR]``.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..ops.softmax import softmax_attention

__all__ = [
    "SVMData",
    "tlto_data",
    "attention_output",
    "model_output",
    "logistic_loss",
    "optimal_tokens",
    "att_svm",
    "p_svm",
    "correlation",
    "train_attention",
    "direction_convergence",
    "DirectionResult",
    "regularization_path",
    "main",
]

DTYPE = torch.float64


# ==============================================================================================
# data and model
# ==============================================================================================


@dataclass
class SVMData:
    """One classification data set: ``X [n, T, d]`` tokens, ``Y [n]`` labels ±1, ``z [n, d]``
    query tokens, ``v [d]`` the fixed linear head."""

    X: torch.Tensor
    Y: torch.Tensor
    z: torch.Tensor
    v: torch.Tensor


def tlto_data(seed: int, n: int = 6, T: int = 8, d: int = 10, *, dtype: torch.dtype = DTYPE) -> SVMData:
    """TLTO's synthetic data (their local-convergence experiment): tokens ``x_{i,t}`` and queries
    ``z_i`` uniform on the unit sphere (normalized Gaussians), the head ``v`` a random unit vector,
    labels ``Y_i = ±1`` with probability ½ -- all from ``torch.Generator().manual_seed(seed)``
    (our choice of generator and draw order: v, Y, X, z)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g, dtype=dtype)
    v = v / v.norm()
    Y = torch.where(torch.randn(n, generator=g, dtype=dtype) > 0, 1.0, -1.0).to(dtype)
    X = torch.randn(n, T, d, generator=g, dtype=dtype)
    X = X / X.norm(dim=-1, keepdim=True)
    z = torch.randn(n, d, generator=g, dtype=dtype)
    z = z / z.norm(dim=-1, keepdim=True)
    return SVMData(X=X, Y=Y, z=z, v=v)


def attention_output(X: torch.Tensor, p: torch.Tensor, *, backend: Optional[str] = None,
                     return_probs: bool = False):
    r"""``x^att = Xᵀ softmax(X p)`` for every sequence, by :func:`attnkit.softmax_attention`
    (query p, keys = values = X, scale 1).  ``X [..., n, T, d]``, ``p [..., n, d]`` →
    ``[..., n, d]``; with ``return_probs`` also ``softmax(X p)`` ``[..., n, T]`` (recomputed from the
    log-sum-exp the kernel returns, without gradient)."""
    lead = X.shape[:-2]
    T, d = X.shape[-2:]
    Xf = X.reshape(-1, 1, T, d)
    q = p.reshape(-1, 1, 1, d)
    out, lse = softmax_attention(q, Xf, Xf, scale=1.0, return_lse=True, backend=backend)
    out = out.reshape(*lead, d)
    if not return_probs:
        return out
    with torch.no_grad():
        scores = (Xf @ q.transpose(-1, -2)).squeeze(-1).squeeze(1)  # [B, T]
        probs = torch.exp(scores - lse.reshape(-1, 1)).reshape(*lead, T)
    return out, probs


def model_output(W: torch.Tensor, data: SVMData, *, backend: Optional[str] = None,
                 return_probs: bool = False):
    r"""``f(X_i) = vᵀ X_iᵀ softmax(X_i W z_i)`` for every sequence i: ``[..., n]``.  ``W`` is
    ``[..., d, d]`` (a leading batch of independent runs broadcasts with ``data``), or a vector
    ``p`` ``[..., d]`` for the single-vector variant ``softmax(X_i p)``."""
    if W.dim() == data.z.dim():  # a matrix per run: p_i = W z_i
        p = torch.einsum("...ab,...nb->...na", W, data.z)
    else:
        p = W.unsqueeze(-2).expand(*W.shape[:-1], data.X.shape[-3], W.shape[-1])
    res = attention_output(data.X, p, backend=backend, return_probs=return_probs)
    att, probs = res if return_probs else (res, None)
    f = torch.einsum("...nd,...d->...n", att, data.v)
    return (f, probs) if return_probs else f


def logistic_loss(W: torch.Tensor, data: SVMData, *, backend: Optional[str] = None) -> torch.Tensor:
    r"""``L(W) = (1/n) Σ_i log(1 + exp(−Y_i f(X_i)))`` (per run when W has a batch dim)."""
    f = model_output(W, data, backend=backend)
    return torch.nn.functional.softplus(-data.Y * f).mean(-1)


def optimal_tokens(data: SVMData) -> torch.Tensor:
    r"""The globally optimal token of each sequence: ``opt_i = argmax_t Y_i vᵀ x_{i,t}`` (the token
    whose selection minimizes the loss; TLTO Definition 1, the token scores γ)."""
    return (data.Y.unsqueeze(-1) * (data.X @ data.v)).argmax(-1)


def correlation(A: torch.Tensor, B: torch.Tensor, *, vector: bool = False) -> torch.Tensor:
    """TLTO's correlation coefficient ``⟨A, B⟩ / (‖A‖_F ‖B‖_F)`` over the last two dims (the last
    one with ``vector=True``), batched over leading dims."""
    dims = (-1,) if vector else (-2, -1)
    return (A * B).sum(dims) / (A.pow(2).sum(dims).sqrt() * B.pow(2).sum(dims).sqrt())


# ==============================================================================================
# the SVMs
# ==============================================================================================


def _min_norm_point(G: np.ndarray) -> np.ndarray:
    r"""``argmin ‖x‖ s.t. G x ≥ 1`` by Lawson & Hanson's least-distance programming (Solving Least
    Squares Problems, 1974, ch. 23): solve the NNLS ``min_{u ≥ 0} ‖[Gᵀ; 1ᵀ] u − e_{m+1}‖`` with
    :func:`scipy.optimize.nnls`; with ``r`` its residual, ``x = −r_{1:m} / r_{m+1}`` (r = 0 means
    infeasible).  Exact active-set solution (finite termination)."""
    from scipy.optimize import nnls

    k, m = G.shape
    E = np.vstack([G.T, np.ones((1, k))])
    f = np.zeros(m + 1)
    f[-1] = 1.0
    u, _ = nnls(E, f, maxiter=50 * (k + m + 1))
    r = E @ u - f
    if abs(r[-1]) < 1e-12:
        raise ValueError("att_svm: the SVM is infeasible (no W separates the selected tokens)")
    return -r[:m] / r[-1]


def _min_norm_point_slsqp(G: np.ndarray) -> np.ndarray:
    from scipy.optimize import minimize

    m = G.shape[1]
    res = minimize(lambda x: (0.5 * x @ x, x), np.zeros(m), jac=True, method="SLSQP",
                   constraints=[{"type": "ineq", "fun": lambda x: G @ x - 1.0, "jac": lambda x: G}],
                   options={"ftol": 1e-12, "maxiter": 2000})
    if not res.success:
        raise RuntimeError(f"att_svm (SLSQP): {res.message}")
    return res.x


def _solve(G: np.ndarray, method: str) -> np.ndarray:
    if method == "nnls":
        return _min_norm_point(G)
    if method == "slsqp":
        return _min_norm_point_slsqp(G)
    raise ValueError(f"method must be 'nnls' or 'slsqp'; got {method!r}")


def _svm_constraints(X: torch.Tensor, opt: torch.Tensor, z: Optional[torch.Tensor]) -> np.ndarray:
    Xn = X.detach().cpu().double().numpy()
    n, T, d = Xn.shape
    rows = []
    for i in range(n):
        o = int(opt[i])
        for t in range(T):
            if t == o:
                continue
            diff = Xn[i, o] - Xn[i, t]
            rows.append(diff if z is None else np.outer(diff, z[i].detach().cpu().double().numpy()).ravel())
    return np.asarray(rows)


def att_svm(X: torch.Tensor, z: torch.Tensor, opt: torch.Tensor, *, method: str = "nnls") -> torch.Tensor:
    r"""The attention SVM (TLTO eq. (Att-SVM); the tutorial's Theorem 2):

    .. math::  W^{mm} = \arg\min_W \|W\|_F \quad\text{s.t.}\quad
               (x_{i,\mathrm{opt}_i} - x_{i,t})^\top W z_i \ge 1 \ \ \forall t \ne \mathrm{opt}_i,\ \forall i.

    A convex QP in vec(W) (each constraint is ``⟨(x_{i,opt} − x_{i,t}) z_iᵀ, W⟩ ≥ 1``), solved with
    scipy: ``method="nnls"`` (default) by the Lawson–Hanson reduction of this least-distance
    problem to non-negative least squares (:func:`scipy.optimize.nnls`; exact, active set);
    ``method="slsqp"`` with :func:`scipy.optimize.minimize` (SLSQP), a cross-check.

    Args: ``X [n, T, d]``, ``z [n, d]``, ``opt [n]`` (the selected token of each sequence).
    Returns ``W^mm`` ``[d, d]`` (float64).  Raises ValueError when infeasible.
    """
    G = _svm_constraints(X, opt, z)
    x = _solve(G, method)
    d = X.shape[-1]
    return torch.as_tensor(x, dtype=DTYPE).reshape(d, d)


def p_svm(X: torch.Tensor, opt: torch.Tensor, *, method: str = "nnls") -> torch.Tensor:
    r"""The single-vector attention SVM (Tarzanagh et al., "Max-margin token selection", eq.
    (ATT-SVM)): ``p^{mm} = argmin ‖p‖ s.t. (x_{i,opt_i} − x_{i,t})ᵀ p ≥ 1`` for all t ≠ opt_i, all i.
    Solved like :func:`att_svm`.  Returns ``[d]``."""
    G = _svm_constraints(X, opt, None)
    x = _solve(G, method)
    return torch.as_tensor(x, dtype=DTYPE)


# ==============================================================================================
# gradient descent, directional convergence, regularization path
# ==============================================================================================


def train_attention(data: SVMData, W0: torch.Tensor, *, steps: int = 2000, lr: float = 0.1,
                    normalized: bool = True, record: Sequence[int] = (), progress: bool = False,
                    backend: Optional[str] = None):
    r"""(Normalized) gradient descent on ``L(W)`` through attnkit's softmax attention:
    ``W_{k+1} = W_k − η ∇L(W_k) / ‖∇L(W_k)‖_F`` (TLTO's experiments) or plain
    ``W_{k+1} = W_k − η ∇L(W_k)`` (``normalized=False``).  ``W0`` ``[..., d, d]`` (or ``[..., d]`` for
    p); a leading batch dim trains independent runs at once (``data`` batched the same way), each
    normalized by its own gradient norm.

    Returns ``(W_final, recorded, probs)``: ``recorded`` maps each k in ``record`` to W_k (after k
    steps); ``probs`` the final softmax probabilities ``[..., n, T]``.
    """
    W = W0.detach().clone().requires_grad_(True)
    record = set(int(k) for k in record)
    recorded = {}
    vec_dims = (-2, -1) if W0.dim() == data.z.dim() else (-1,)
    it = range(steps)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="normalized GD" if normalized else "GD", leave=False, mininterval=0.5)
    for k in it:
        if k in record:
            recorded[k] = W.detach().clone()
        loss = logistic_loss(W, data, backend=backend).sum()
        (grad,) = torch.autograd.grad(loss, [W])
        with torch.no_grad():
            if normalized:
                norm = grad.pow(2).sum(vec_dims, keepdim=True).sqrt()
                grad = grad / (norm + torch.finfo(grad.dtype).eps)
            W -= lr * grad
    if steps in record:
        recorded[steps] = W.detach().clone()
    with torch.no_grad():
        _, probs = model_output(W, data, backend=backend, return_probs=True)
    return W.detach(), recorded, probs


@dataclass
class DirectionResult:
    """What :func:`direction_convergence` measured, per seed and averaged."""

    checkpoints: list  # iteration counts k
    mean_correlation: list  # mean over seeds of corr(W_k, W^mm), one per checkpoint
    correlations: torch.Tensor  # [seeds, checkpoints]
    selected: torch.Tensor  # [seeds, n]: the tokens the trained attention selects (opt_i)
    max_prob: torch.Tensor  # [seeds, n]: their softmax probability at the end
    globally_optimal: torch.Tensor  # [seeds]: fraction of sequences whose selected token is opt
    W_mm: torch.Tensor  # [seeds, d, d]


def direction_convergence(n_seeds: int = 20, *, n: int = 6, T: int = 8, d: int = 10, steps: int = 2000,
                          lr: float = 0.1, checkpoints: Sequence[int] = (10, 100, 1000, 2000),
                          seed0: int = 0, variant: str = "W", progress: bool = False,
                          backend: Optional[str] = None) -> DirectionResult:
    r"""TLTO's local-convergence experiment: for each seed, data from :func:`tlto_data`, W₀ with
    i.i.d. ``U(−1/√d, 1/√d)`` entries (PyTorch's default ``nn.Linear`` init, which TLTO's
    experiments use), ``steps`` iterations of normalized GD with step ``lr``; then
    ``opt_i`` = the token the trained attention selects (largest final softmax probability),
    ``W^mm = att_svm(X, z, opt)`` and the correlation ``⟨W_k/‖W_k‖, W^mm/‖W^mm‖⟩`` at each
    checkpoint k.  All seeds train at once (a batch of independent runs through one attention
    call per step).  ``variant="p"`` trains the single vector p (and uses :func:`p_svm`).
    """
    datas = [tlto_data(seed0 + s, n, T, d) for s in range(n_seeds)]
    batch = SVMData(X=torch.stack([x.X for x in datas]), Y=torch.stack([x.Y for x in datas]),
                    z=torch.stack([x.z for x in datas]), v=torch.stack([x.v for x in datas]))
    g = torch.Generator().manual_seed(10_000 + seed0)
    shape = (n_seeds, d, d) if variant == "W" else (n_seeds, d)
    bound = 1 / math.sqrt(d)
    W0 = (torch.rand(shape, generator=g, dtype=DTYPE) * 2 - 1) * bound
    _, recorded, probs = train_attention(batch, W0, steps=steps, lr=lr, record=checkpoints,
                                         progress=progress, backend=backend)
    max_prob, selected = probs.max(-1)
    W_mm = torch.stack([
        att_svm(datas[s].X, datas[s].z, selected[s]) if variant == "W" else p_svm(datas[s].X, selected[s])
        for s in range(n_seeds)
    ])
    cps = sorted(int(k) for k in checkpoints)
    corr = torch.stack([correlation(recorded[k], W_mm, vector=variant == "p") for k in cps], dim=1)
    glob = torch.stack([(selected[s] == optimal_tokens(datas[s])).to(DTYPE).mean() for s in range(n_seeds)])
    return DirectionResult(checkpoints=cps, mean_correlation=[float(c) for c in corr.mean(0)],
                           correlations=corr, selected=selected, max_prob=max_prob,
                           globally_optimal=glob, W_mm=W_mm)


def regularization_path(data: SVMData, radii: Sequence[float], *, W0: Optional[torch.Tensor] = None,
                        restarts: int = 0, seed: int = 0, backend: Optional[str] = None,
                        maxiter: int = 1000):
    r"""The regularization path of the tutorial's Theorem 2 (TLTO Theorem 1):
    ``W̄_R = argmin_{‖W‖_F ≤ R} L(W)``, for each R in ``radii`` (increasing).

    How it is solved (our choices): for R large enough the minimizer lies on the sphere
    ‖W‖_F = R (L decreases along every direction that separates the optimal tokens), so each
    problem is solved on the sphere, ``W = R·U/‖U‖_F`` with U unconstrained, by L-BFGS
    (:func:`scipy.optimize.minimize`, ``method="L-BFGS-B"``), the loss and its gradient computed by
    attnkit's softmax attention in float64.  The objective is shifted and scaled,
    ``(L(W) − L_*) / (L(W_start) − L_*)`` with ``L_* = (1/n) Σ_i ℓ(Y_i vᵀx_{i,opt_i})`` the loss's
    infimum, so that the optimizer's tolerances stay meaningful when L is within 1e-6 of L_* at
    large R.  The path is followed by continuation: each R starts from the previous solution's
    direction (the first from ``W0``, default ``−∇L(0)``); ``restarts`` extra random directions
    (seeded) are tried at each R and the lowest loss kept -- the theorem is about the global
    minimizer, a local method only finds a local one (seen: seed 4 of :func:`tlto_data` follows a
    locally optimal path, corr ≈ 0.45, without restarts, and reaches corr 0.998 at R = 64 with 16).
    Float64 resolves the path while ``L − L_*`` stays above ~1e-13 (R up to ~20-30 ‖W^mm‖_F); where
    it does not, the start is kept as the solution.

    Theorem 2: ``W̄_R / R → W^mm/‖W^mm‖_F`` as R → ∞, with ``opt`` = the globally optimal tokens
    (:func:`optimal_tokens`), when those are unique and the SVM is feasible.

    Returns ``(solutions [len(radii), d, d], losses [len(radii)])``.
    """
    from scipy.optimize import minimize

    d = data.X.shape[-1]
    opt = optimal_tokens(data)
    gamma_opt = data.Y * (data.X[torch.arange(data.X.shape[0]), opt] @ data.v)
    L_star = float(torch.nn.functional.softplus(-gamma_opt).mean())

    def loss_and_grad(x, R):
        U = torch.as_tensor(x, dtype=DTYPE).reshape(d, d).requires_grad_(True)
        W = R * U / U.norm()
        loss = logistic_loss(W, data, backend=backend)
        (g,) = torch.autograd.grad(loss, [U])
        return float(loss.detach()), g.reshape(-1).numpy().astype(np.float64)

    if W0 is None:
        W = torch.zeros(d, d, dtype=DTYPE, requires_grad=True)
        (g0,) = torch.autograd.grad(logistic_loss(W, data, backend=backend), [W])
        x = (-g0).reshape(-1).numpy()
    else:
        x = W0.detach().reshape(-1).double().numpy()
    x = x / np.linalg.norm(x)
    rng = np.random.default_rng(seed)
    sols, losses = [], []
    for R in radii:
        starts = [x] + [s / np.linalg.norm(s) for s in rng.standard_normal((restarts, d * d))]
        best = None
        for x0 in starts:
            f0, _ = loss_and_grad(x0, R)
            scale = f0 - L_star
            if scale <= 1e-13 * max(1.0, abs(L_star)):
                # L is within float64 resolution of its infimum: nothing left to resolve at this R
                if best is None or f0 < best[0]:
                    best = (f0, x0)
                continue

            def fun(u, R=R, scale=scale):
                f, g = loss_and_grad(u, R)
                return (f - L_star) / scale, g / scale

            res = minimize(fun, x0, jac=True, method="L-BFGS-B",
                           options={"maxiter": maxiter, "ftol": 1e-15, "gtol": 1e-12})
            f = L_star + res.fun * scale
            if best is None or f < best[0]:
                best = (f, res.x / np.linalg.norm(res.x))
        x = best[1]
        sols.append(torch.as_tensor(R * x, dtype=DTYPE).reshape(d, d))
        losses.append(best[0])
    return torch.stack(sols), losses


# ==============================================================================================
# command
# ==============================================================================================


def _table(headers, rows) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def _figure_2d(seed: int = 3, steps: int = 2000, lr: float = 0.1):
    """Data, GD trajectory of p and p^mm for the tutorial's d = 2 picture."""
    data = tlto_data(seed, n=3, T=3, d=2)
    p0 = torch.zeros(2, dtype=DTYPE) + 1e-3
    ks = list(range(0, steps + 1, 10))
    _, rec, probs = train_attention(data, p0, steps=steps, lr=lr, record=ks)
    opt = probs.argmax(-1)
    return data, torch.stack([rec[k] for k in ks]), opt, p_svm(data.X, opt)


def main(argv: Optional[list] = None) -> int:
    """``python -m attnkit theory svm``: directional convergence, regularization path, d = 2 figure."""
    ap = argparse.ArgumentParser(prog="python -m attnkit theory svm", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run in seconds (fewer seeds and steps)")
    ap.add_argument("--out", default=os.path.join("bench", "out", "theory"), help="folder for the PNG")
    ap.add_argument("--seeds", type=int, default=None, help="runs to average (default 100; --quick: 4)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    prog = not args.no_progress
    t0 = time.time()
    n_seeds = args.seeds or (4 if q else 100)
    steps = 200 if q else 2000
    cps = [k for k in (1, 10, 100, 1000, 2000) if k <= steps]
    rows = []
    results = {}
    for variant in ("W", "p"):
        r = direction_convergence(n_seeds, steps=steps, checkpoints=cps, variant=variant, progress=prog)
        results[variant] = r
        rows.append([variant] + [f"{c:.4f}" for c in r.mean_correlation]
                    + [f"{float(r.max_prob.mean()):.4f}", f"{float(r.globally_optimal.mean()):.2f}"])
    print(f"TLTO (2023) local convergence: n=6, T=8, d=10, normalized GD step 0.1, {n_seeds} seeds; "
          f"mean corr(W_k, W^mm) with opt = the tokens the trained attention selects")
    print(_table(["param"] + [f"k={k}" for k in cps] + ["sel. prob", "frac. global opt"], rows))
    print()

    # regularization path (tutorial Theorem 2), on the seeds whose selected tokens are globally optimal
    radii = [0.5, 1, 2, 4, 8, 16] if q else [0.5, 1, 2, 4, 8, 16, 32, 64]
    restarts = 0 if q else 16
    rp_rows = []
    n_rp = 2 if q else 5
    rp_corr = []
    seeds = range(n_rp)
    if prog:
        from tqdm.auto import tqdm

        seeds = tqdm(seeds, desc="regularization path", leave=False)
    for s in seeds:
        data = tlto_data(s)
        W_mm = att_svm(data.X, data.z, optimal_tokens(data))
        sols, _ = regularization_path(data, radii, restarts=restarts, seed=s)
        c = [float(correlation(Wr, W_mm)) for Wr in sols]
        rp_corr.append(c)
        rp_rows.append([s] + [f"{x:.4f}" for x in c])
    print("Regularization path W̄_R = argmin_{‖W‖≤R} L(W) (L-BFGS on the sphere ‖W‖ = R, continuation): "
          f"{restarts} random restarts per R: corr(W̄_R, W^mm) with opt = argmax_t Y vᵀx_t (globally optimal tokens)")
    print(_table(["seed"] + [f"R={R:g}" for R in radii], rp_rows))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    for variant, r in results.items():
        ax[0].plot(r.checkpoints, r.mean_correlation, "o-", label=f"{variant}: mean of {n_seeds} seeds")
    ax[0].set(xscale="log", xlabel="iteration k", ylabel="corr(W_k, W^mm)", ylim=(0, 1.02),
              title="normalized GD → attention SVM (n=6, T=8, d=10)")
    ax[0].legend()
    for s, c in enumerate(rp_corr):
        ax[1].plot(radii, c, "o-", label=f"seed {s}")
    ax[1].set(xscale="log", xlabel="radius R", ylabel="corr(W̄_R, W^mm)",
              title="regularization path (Theorem 2)")
    ax[1].legend(fontsize=8)
    data, traj, opt, p_mm = _figure_2d()
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for i in range(data.X.shape[0]):
        X = data.X[i].numpy()
        ax[2].scatter(X[:, 0], X[:, 1], color=colors[i], s=25)
        xo = X[int(opt[i])]
        ax[2].scatter([xo[0]], [xo[1]], color=colors[i], marker="*", s=220, edgecolor="k")
        # sequence i's separating line through its selected token (xᵀp^mm = x_optᵀp^mm, solid) and
        # its margin line ((x_opt − x)ᵀp^mm = 1, dotted): the other tokens lie beyond the margin
        pm = p_mm.numpy()
        t = np.linspace(-1.3, 1.3, 2)
        for c, style in ((xo @ pm, "-"), (xo @ pm - 1, ":")):
            if abs(pm[1]) > abs(pm[0]):
                ax[2].plot(t, (c - pm[0] * t) / pm[1], style, color=colors[i], lw=0.8)
            else:
                ax[2].plot((c - pm[1] * t) / pm[0], t, style, color=colors[i], lw=0.8)
    tr = traj.numpy() / max(1.0, float(traj.norm(dim=-1).max()))
    ax[2].plot(tr[:, 0], tr[:, 1], "k-", lw=1)
    ax[2].annotate("", xy=tr[-1], xytext=tr[-2], arrowprops={"arrowstyle": "->"})
    u = (p_mm / p_mm.norm()).numpy()
    ax[2].plot([0, u[0]], [0, u[1]], "r-", lw=2, label="p^mm direction")
    ax[2].plot([], [], "k-", lw=1.5, label="GD path of p (scaled to the unit disk)")
    ax[2].plot([], [], "k-", lw=0.8, label="separating lines through x_opt")
    ax[2].plot([], [], "k:", label="margin lines (x_opt − x)ᵀp^mm = 1")
    ax[2].set(xlim=(-1.3, 1.3), ylim=(-1.3, 1.3), aspect="equal", title="d = 2: GD vs SVM (★ = selected)")
    ax[2].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "svm.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\nwrote {path}  ({time.time() - t0:.0f} s)")
    return 0

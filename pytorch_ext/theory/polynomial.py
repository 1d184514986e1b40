r"""Why degree 3: polynomial degree of attention layers, separation rank, and the degree/parameter
budget argument.

Sources: D. Navon, "Attention is the optimal building block" (2021, ``shared/seeds/002``): a
linear transformer (attention without softmax) is a polynomial of degree 3^L in its input, a
layer of degree d gives separation rank Θ(d^(L·d_x)) (Levine et al.), and at a fixed parameter
budget B = L·d·N_{d_x} the expressiveness (d^(1/d))^(B d_x / N_{d_x}) is largest at d = e, i.e.
d = 3 among integers (since 3² > 2³); his experiment layer P_d(x) = Π_{k=1}^{d} (W_k x).
Levine, Wies, Sharir, Bata, Shashua, "Limits to depth efficiencies of self-attention" (NeurIPS
2020) and Levine et al. (2021, the note's [1]): separation rank, and the matricization rank as
its lower bound (the note's Lower Bound 4.2: rank M_{(A,B)} ≤ sep_{(A,B)}).

What runs on what: :func:`linear_attention_network` on :func:`attnkit.linear_attention`
(``feature_map="identity", normalize=False``); the softmax check on
:func:`attnkit.softmax_attention`; :class:`PolynomialLayer` is plain ``torch`` (it is not an
attention layer).

Command: ``python -m attnkit theory polynomial [--quick] [--out DIR] [--seed S]`` prints the
degree table, the separation-rank table and the equal-budget fits of degree 2, 3, 4 networks, and
writes ``polynomial.png`` (default folder ``bench/out/theory/``).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..ops.linear import linear_attention

from ._threads import intra_op_threads as _threads

__all__ = [
    "PolynomialLayer",
    "polynomial_network",
    "degree_along_line",
    "linear_attention_network",
    "SeparationRank",
    "separation_rank",
    "degree_efficiency",
    "best_integer_degree",
    "budget_experiment",
    "main",
]




# ----------------------------------------------------------------------------------------------
# Polynomial layers and their degree
# ----------------------------------------------------------------------------------------------

class PolynomialLayer(nn.Module):
    r"""Navon's degree-d layer: ``P(x) = Π_{k=1}^{degree} (W_k x)`` (elementwise product of
    ``degree`` linear maps, no bias), a homogeneous polynomial of degree ``degree`` in x.

    Args:
        d_in, d_out: feature sizes.
        degree: number of factors (≥ 1).
        dtype: parameter dtype (None: torch's default).

    ``weight`` is ``[degree, d_out, d_in]``, initialized N(0, 1/d_in) so each factor W_k x has
    entries of order ‖x‖/√d_in.  Input ``[..., d_in]`` -> ``[..., d_out]``.  Parameters:
    ``degree · d_out · d_in`` (the note's ``d · N_{d_x}``).

    Example::

        >>> layer = PolynomialLayer(4, 4, degree=3)
        >>> layer(torch.randn(2, 4)).shape
        torch.Size([2, 4])
    """

    def __init__(self, d_in: int, d_out: int, degree: int, *, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if degree < 1:
            raise ValueError(f"PolynomialLayer: degree must be >= 1; got {degree}")
        self.d_in, self.d_out, self.degree = d_in, d_out, degree
        self.weight = nn.Parameter(torch.randn(degree, d_out, d_in, dtype=dtype) / math.sqrt(d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight[0].t()
        for k in range(1, self.degree):
            out = out * (x @ self.weight[k].t())
        return out

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, degree={self.degree}"


def polynomial_network(width: int, degree: int, depth: int, *, d_in: Optional[int] = None,
                       dtype: Optional[torch.dtype] = None) -> nn.Sequential:
    """``depth`` :class:`PolynomialLayer` s of ``degree`` (the first from ``d_in`` features, default
    ``width``), composed: a polynomial of degree ``degree ** depth`` (Navon Eq. 16)."""
    d_in = width if d_in is None else d_in
    return nn.Sequential(*[PolynomialLayer(d_in if i == 0 else width, width, degree, dtype=dtype)
                           for i in range(depth)])


def degree_along_line(f: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, direction: torch.Tensor,
                      max_degree: int = 16, rtol: float = 1e-12, span: float = 8.0) -> Optional[int]:
    r"""The degree of t ↦ f(x0 + t·direction) by finite differences in float64; None when it is
    not a polynomial of degree ≤ ``max_degree``.

    g(t) = f(x0 + t·u) (all outputs, flattened) is sampled at K + 1 = ``max_degree`` + 2 equally
    spaced t in [−T, T], T = ``span`` · max(1, ‖x0‖ / ‖u‖) (step h = 2T/K).  For a polynomial of
    degree n the k-th forward difference
    Δ_h^k g is n! h^n a_n (constant) at k = n and exactly 0 for k > n; any smooth non-polynomial
    has Δ_h^k g = h^k g^(k)(τ) ≠ 0 for some k ≤ K.  In float64 a "zero" difference is
    rounding noise: each sample is off by about ε·G (G = max |g|) and Δ^k adds up to 2^k of
    them, so Δ^k counts as zero when ``max |Δ^k g| ≤ rtol · 2^k · G``.  Returns the largest k ≤ K
    whose difference is nonzero if every higher one (up to K) is zero; None if Δ^K itself is
    nonzero (not a polynomial of degree ≤ ``max_degree``).

    Choices: ``rtol`` = 1e-12 and ``span`` = 8.  On random polynomial stacks (degrees 2–16) the
    zero normalized differences were ≤ 2e-16; over t ∈ [−1, 1] the top difference of a degree-16
    stack was only ≈ 1e-15 (the x0 part dominates G and hides the leading coefficient), over a
    line on which t·u outgrows x0 (T = 8 ‖x0‖/‖u‖) it is ≥ 1e-10.  Softmax attention's 11th difference on
    inputs of order 1 is ≈ 1e-4 or more.  Along a random line the degree equals the
    total degree of f with probability 1 (the leading homogeneous part vanishes only on a null
    set of directions).
    """
    K = max_degree + 1
    x0 = x0.to(torch.float64)
    direction = direction.to(torch.float64)
    if float(direction.norm()) == 0:
        raise ValueError("degree_along_line: direction must be nonzero")
    t_max = span * max(1.0, float(x0.norm() / direction.norm()))
    ts = torch.linspace(-t_max, t_max, K + 1, dtype=torch.float64)
    with torch.no_grad():
        g = torch.stack([f(x0 + t * direction).reshape(-1).to(torch.float64) for t in ts])
    scale = float(g.abs().max())
    if scale == 0:
        return 0
    nonzero = []
    v = g
    for k in range(K + 1):
        if k:
            v = v[1:] - v[:-1]
        nonzero.append(float(v.abs().max()) > rtol * 2 ** k * scale)
    if nonzero[K]:
        return None
    return max(k for k in range(K + 1) if nonzero[k]) if any(nonzero) else 0


# ----------------------------------------------------------------------------------------------
# Linear attention networks and the separation rank
# ----------------------------------------------------------------------------------------------

def linear_attention_network(depth: int, dim: int, *, seed: int = 0, readout: bool = True,
                             backend: Optional[str] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    r"""A depth-``depth`` linear-attention network (Levine et al.'s "linear transformer"), float64:

    ``X_{l} = linear_attention(X_{l−1} W_Q^l, X_{l−1} W_K^l, X_{l−1} W_V^l)``  (identity feature
    map, unnormalized, non-causal: X_l = (Q Kᵀ) V), l = 1..depth, and the output
    ``y(X) = Σ_i rᵀ X_L[i]`` (a scalar per sequence) or, with ``readout=False``, X_L itself.

    Each layer is a degree-3 polynomial of its input, so y is a polynomial of degree 3^depth
    (the note's Sec. 1.1).  Choices (the note gives none): one head, no residual connections,
    no output projection (it would merge into the next layer's W's), W's and r ~ N(0, 1/dim)
    drawn from ``seed``.  Returns ``f(X)`` with X ``[B, n, dim]`` -> ``[B]`` (or ``[B, n, dim]``).
    """
    g = torch.Generator().manual_seed(seed)
    ws = [[torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim) for _ in range(3)]
          for _ in range(depth)]
    r = torch.randn(dim, generator=g, dtype=torch.float64) / math.sqrt(dim)

    def f(x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float64)
        for wq, wk, wv in ws:
            q, k, v = (x @ w for w in (wq, wk, wv))
            x = linear_attention(q[:, None], k[:, None], v[:, None], feature_map="identity",
                                 normalize=False, backend=backend)[:, 0]
        return (x @ r).sum(-1) if readout else x

    return f


@dataclass
class SeparationRank:
    """The result of :func:`separation_rank`: ``rank`` (numerical rank of the matricization),
    ``singular_values`` (descending), ``shape`` (I, J) of the matrix and the ``rtol`` used."""

    rank: int
    singular_values: torch.Tensor
    shape: tuple[int, int]
    rtol: float


def separation_rank(f: Callable[[torch.Tensor], torch.Tensor], split: tuple[Sequence[int], Sequence[int]],
                    grid: Union[int, tuple[torch.Tensor, torch.Tensor]], *, dim: Optional[int] = None,
                    rtol: float = 1e-9, seed: int = 0, chunk: int = 65536) -> SeparationRank:
    r"""Rank of the matricization ``M[i, j] = f(a_i, b_j)``: a lower bound of the separation rank.

    The separation rank of f w.r.t. a partition (A, B) of its input positions is the least R with
    f(X) = Σ_{r=1}^{R} g_r(X_A) g'_r(X_B) (Levine et al.; Navon Def. 4.1).  For any template
    points a_1..a_I (values of X_A) and b_1..b_J (values of X_B), M[i, j] = f(X_A = a_i,
    X_B = b_j) has rank M ≤ sep_(A,B)(f) (Navon's Lower Bound 4.2).

    ``f``: ``[B, n, dim]`` -> ``[B]`` (batched, float64).  ``split = (A, B)``: disjoint position
    indices covering 0..n−1.  ``grid``: an int I (I random template points per side from
    ``seed``; needs ``dim``), or ``(a_points [I, |A|, dim], b_points [J, |B|, dim])``.
    Random templates (choice): each position's vector has a uniform random direction and a norm
    uniform in [0.75, 1.25].  Gaussian templates let a few long vectors dominate a degree-27
    polynomial (depth-3 rank seen 31–44 on a 120 grid, below depth 2's 36); unit-norm ones lie
    on the sphere, where ‖x‖² = 1 lowers the rank of the restricted function (depth 2: 24
    instead of 36); the thin shell avoids both (depth 3: 94–127 on a 150 grid).

    Numerical rank: the number of singular values > ``rtol`` · σ_max.  With ``rtol`` above the
    rounding level of the computed M (≈ 1e-13 relative here), that count is ≤ the exact rank of
    M (Weyl: each σ moves by at most the rounding error), so it stays a lower bound of the
    separation rank; it can fall short of the exact rank of a high-degree polynomial, whose
    matricization has singular values spread over many decades (seen at depth 3 in the tests).
    """
    a_idx, b_idx = (list(s) for s in split)
    n = len(a_idx) + len(b_idx)
    if sorted(a_idx + b_idx) != list(range(n)):
        raise ValueError("separation_rank: split must partition the positions 0..n-1")
    if isinstance(grid, int):
        if dim is None:
            raise ValueError("separation_rank: dim is required when grid is a number of points")
        g = torch.Generator().manual_seed(seed)

        def shell(count):
            x = torch.randn(grid, count, dim, generator=g, dtype=torch.float64)
            radius = 0.75 + 0.5 * torch.rand(grid, count, 1, generator=g, dtype=torch.float64)
            return radius * x / x.norm(dim=-1, keepdim=True)

        a_pts, b_pts = shell(len(a_idx)), shell(len(b_idx))
    else:
        a_pts, b_pts = (t.to(torch.float64) for t in grid)
    n_a, n_b, d = a_pts.shape[0], b_pts.shape[0], a_pts.shape[-1]
    rows = []
    with torch.no_grad():
        per = max(1, chunk // n_b)
        for i0 in range(0, n_a, per):
            a = a_pts[i0:i0 + per]
            x = torch.empty(a.shape[0], n_b, n, d, dtype=torch.float64)
            x[:, :, a_idx] = a[:, None]
            x[:, :, b_idx] = b_pts[None]
            rows.append(f(x.reshape(-1, n, d)).reshape(a.shape[0], n_b))
    m = torch.cat(rows)
    s = torch.linalg.svdvals(m)
    rank = int((s > rtol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return SeparationRank(rank=rank, singular_values=s, shape=(n_a, n_b), rtol=rtol)


# ----------------------------------------------------------------------------------------------
# The degree / parameter budget argument
# ----------------------------------------------------------------------------------------------

def degree_efficiency(d: float) -> float:
    r"""``d^(1/d)``: at a parameter budget B = L·d·N_{d_x} a stack of degree-d layers reaches total
    degree d^L = (d^(1/d))^(B/N_{d_x}) (Navon Eq. 17; the separation rank d^(L d_x) likewise), so
    the best building block maximizes d^(1/d): at d = e over the reals (ln d / d has its only
    critical point at ln d = 1), at d = 3 over the integers (3^(1/3) = 1.4422 > 2^(1/2) = 1.4142,
    i.e. 3² > 2³; 4^(1/4) = 2^(1/2))."""
    return d ** (1.0 / d)


def best_integer_degree(max_degree: int = 20) -> int:
    """The integer d in 1..max_degree maximizing :func:`degree_efficiency` (it is 3)."""
    return max(range(1, max_degree + 1), key=degree_efficiency)


class _BudgetNet(nn.Module):
    """x -> (PolynomialLayer -> RMS normalization) × depth -> linear read-out (Navon Sec. 3.1's
    T_d with σ = RMS normalization)."""

    def __init__(self, d_in: int, width: int, degree: int, depth: int):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.layers = nn.ModuleList(PolynomialLayer(width, width, degree) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(h).squeeze(-1)


def budget_experiment(degrees: Sequence[int] = (2, 3, 4), budget_layers: int = 12, width: int = 16,
                      d_in: int = 8, steps: int = 2000, batch: int = 1024, n_test: int = 8192,
                      seeds: Sequence[int] = (0, 1, 2), lr: float = 3e-3, progress: bool = False,
                      threads: Optional[int] = 1) -> dict:
    r"""Fit one target with degree-d polynomial networks at an equal parameter budget (Navon Sec. 3).

    Budget: ``budget_layers`` width×width weight matrices, i.e. depth L = budget_layers / d for
    degree d (12 → L = 6, 4, 3 for d = 2, 3, 4; total degree 64, 81, 64).  Each layer is a
    :class:`PolynomialLayer` followed by RMS normalization (the note's σ, "maybe combined with
    normalization"; without it deep homogeneous polynomials overflow), between a linear input
    map and a linear read-out that are the same for all d.  Target (choice; the note names
    none): y = sin(3 uᵀx) cos(2 vᵀx) + (wᵀx)³ on x ~ U[−1, 1]^d_in with fixed random unit u, v,
    w.  Training (choice): a fresh batch of ``batch`` points every step (no finite training set:
    the comparison is about what the networks can represent, and with a fixed set of 4096
    points these high-degree networks overfit it, test error above the target's variance),
    Adam at ``lr`` with cosine decay to 0, ``steps`` steps, gradient clipping at 1, on
    ``threads`` intra-op threads (None: torch's setting).  Test: ``n_test`` fixed points.
    Returns ``{d: {"depth", "params", "test_mse": [per seed]}, "target_var": …}``.
    """
    g = torch.Generator().manual_seed(1234)
    u, v, w = (t / t.norm() for t in torch.randn(3, d_in, generator=g))

    def target(x):
        return torch.sin(3 * x @ u) * torch.cos(2 * x @ v) + (x @ w) ** 3

    xte = torch.rand(n_test, d_in, generator=g) * 2 - 1
    yte = target(xte)
    out = {}
    jobs = [(d, s) for d in degrees for s in seeds]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs) * steps, desc="equal-budget fits", leave=False, mininterval=0.5)
    with _threads(threads):
        for d in degrees:
            if budget_layers % d:
                raise ValueError(f"budget_experiment: budget_layers={budget_layers} is not a multiple of degree {d}")
            depth = budget_layers // d
            rec = {"depth": depth, "params": None, "test_mse": []}
            for s in seeds:
                torch.manual_seed(s)
                gs = torch.Generator().manual_seed(s)
                net = _BudgetNet(d_in, width, d, depth)
                rec["params"] = sum(p.numel() for layer in net.layers for p in layer.parameters())
                opt = torch.optim.Adam(net.parameters(), lr=lr)
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
                for _ in range(steps):
                    x = torch.rand(batch, d_in, generator=gs) * 2 - 1
                    loss = (net(x) - target(x)).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    if bar is not None:
                        bar.update(1)
                with torch.no_grad():
                    rec["test_mse"].append(float((net(xte) - yte).pow(2).mean()))
            out[d] = rec
    if bar is not None:
        bar.close()
    out["target_var"] = float(yte.var())
    return out


# ----------------------------------------------------------------------------------------------
# Command
# ----------------------------------------------------------------------------------------------

def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def degree_table(seed: int = 0) -> list[tuple[str, int, Optional[int]]]:
    """(what, expected degree, measured degree) for the command and the tests: polynomial stacks,
    linear attention, the linear-attention network, softmax attention (expected None)."""
    from ..ops.softmax import softmax_attention

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for deg, depth in [(2, 1), (2, 2), (2, 3), (2, 4), (3, 1), (3, 2), (4, 1), (4, 2)]:
        net = polynomial_network(4, deg, depth, dtype=torch.float64)
        x0, u = torch.randn(2, 4, generator=g, dtype=torch.float64)
        rows.append((f"PolynomialLayer stack d={deg}, L={depth}", deg ** depth, degree_along_line(net, x0, u, 18)))
    x0, u = torch.randn(2, 1, 1, 5, 3, generator=g, dtype=torch.float64)
    lin = lambda x: linear_attention(x, x, x, feature_map="identity", normalize=False)  # noqa: E731
    rows.append(("linear_attention(X, X, X), identity, unnormalized", 3, degree_along_line(lin, x0, u, 10)))
    for depth in (1, 2):
        net = linear_attention_network(depth, 3, seed=seed)
        rows.append((f"linear-attention network, depth {depth}", 3 ** depth,
                     degree_along_line(net, x0[0], u[0], 12)))
    soft = lambda x: softmax_attention(x, x, x)  # noqa: E731
    rows.append(("softmax_attention(X, X, X)", None, degree_along_line(soft, x0, u, 10)))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m attnkit theory polynomial``: degree and separation-rank tables, the equal-budget
    fits, ``polynomial.png``."""
    ap = argparse.ArgumentParser(prog="python -m attnkit theory polynomial",
                                 description="polynomial degree of attention, separation rank, why degree 3")
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    ap.add_argument("--out", default="bench/out/theory", help="folder for polynomial.png (default bench/out/theory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print("# Degree along a random line (finite differences, float64); None = not a polynomial of degree <= max\n")
    rows = degree_table(args.seed)
    print(_table([[w, "not <= 10" if e is None else str(e), "not <= 10" if m is None else str(m)] for w, e, m in rows],
                 ["map", "expected", "measured"]))

    print("\n# Separation rank lower bound (matricization rank) of depth-L linear-attention networks")
    print("  n = 4 positions of dim 2, split A = {0, 1} | B = {2, 3}, rtol 1e-9\n")
    grid = 80 if args.quick else 300
    depths = [1, 2, 3]
    sep = []
    for depth in depths:
        r = separation_rank(linear_attention_network(depth, 2, seed=args.seed), ([0, 1], [2, 3]), grid, dim=2,
                            seed=args.seed)
        sep.append(r)
    prod = separation_rank(lambda x: x[:, :2].sum((1, 2)) * torch.cos(x[:, 2:]).prod(-1).prod(-1), ([0, 1], [2, 3]),
                           grid, dim=2, seed=args.seed)
    print(_table([[str(dp), f"{r.shape[0]}x{r.shape[1]}", str(r.rank), f"3^{dp}={3 ** dp}"]
                  for dp, r in zip(depths, sep)]
                 + [["separable", f"{prod.shape[0]}x{prod.shape[1]}", str(prod.rank), "1"]],
                 ["depth", "grid", "rank", "degree"]))
    print("(the note: sep = Θ(3^(L·d_x)) once L > log_3 d_x; a measured rank is a lower bound -- at depth 3 the")
    print(" singular values of a degree-27 polynomial spread over many decades, so the count is limited by rtol)")

    print("\n# Degree / parameter budget: d^(1/d)")
    print(_table([[str(d), f"{degree_efficiency(d):.4f}"] for d in range(1, 7)]
                 + [["e", f"{degree_efficiency(math.e):.4f}"]],
                 ["d", "d^(1/d)"]))
    print(f"best integer degree: {best_integer_degree()}")

    res = budget_experiment(steps=30 if args.quick else 2000, seeds=(0,) if args.quick else (0, 1, 2),
                            batch=256 if args.quick else 1024, n_test=1024 if args.quick else 8192, progress=True)
    print("\n# Equal parameter budget (12 width² matrices, width 16): test MSE "
          f"(target variance {res['target_var']:.3f})")
    brows = []
    for d in (2, 3, 4):
        rec = res[d]
        te = rec["test_mse"]
        brows.append([str(d), str(rec["depth"]), str(rec["params"]), f"{d ** rec['depth']}",
                      f"{sum(te) / len(te):.4f}", f"{min(te):.4f}", f"{max(te):.4f}"])
    print(_table(brows, ["degree", "depth", "params", "total degree", "test MSE mean", "min", "max"]))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for dp, r in zip(depths, sep):
        s = r.singular_values
        ax.semilogy(range(1, len(s) + 1), (s / s[0]).clamp_min(1e-18), label=f"depth {dp} (rank {r.rank})")
    ax.axhline(1e-9, color="gray", ls=":", label="rtol")
    ax.set_xlim(0, min(120, sep[-1].shape[0]))
    ax.set_xlabel("index")
    ax.set_ylabel("σ_i / σ_1")
    ax.set_title("matricization spectrum, linear attention")
    ax.legend(fontsize=8)
    ax = axes[1]
    xs = [1 + 0.05 * i for i in range(141)]
    ax.plot(xs, [degree_efficiency(x) for x in xs])
    ax.plot(range(1, 9), [degree_efficiency(d) for d in range(1, 9)], "o")
    ax.axvline(math.e, color="gray", ls=":")
    ax.set_xlabel("degree d")
    ax.set_ylabel("d^(1/d)")
    ax.set_title("expressiveness per parameter (max at e; 3 among integers)")
    ax = axes[2]
    for i, d in enumerate((2, 3, 4)):
        ax.plot([d] * len(res[d]["test_mse"]), res[d]["test_mse"], "o", color=f"C{i}")
    ax.axhline(res["target_var"], color="gray", ls=":", label="target variance")
    ax.legend(fontsize=8)
    ax.set_xticks([2, 3, 4])
    ax.set_yscale("log")
    ax.set_xlabel("degree d (equal budget)")
    ax.set_ylabel("test MSE")
    ax.set_title("equal-budget fits")
    fig.tight_layout()
    path = out / "polynomial.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))

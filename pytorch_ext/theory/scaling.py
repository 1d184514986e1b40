r"""Scaling laws: power-law fits with confidence intervals, Kaplan et al.'s L(N, D), and a ladder
of small attnkit transformers on a source whose entropy rate is known.

Sources: the ECE 598 lecture on scaling laws (``shared/seeds/000``: "performance has a power-law
relationship with each of N, D, C", α_N ≈ 0.076, D ∝ N^(α_N/α_D) ≈ N^0.74, Eq. 1.5); Kaplan et
al., "Scaling Laws for Neural Language Models" (2020): Eq. (1.5)
L(N, D) = [(N_c/N)^(α_N/α_D) + D_c/D]^α_D with Table 2's fit α_N = 0.076, α_D = 0.103,
N_c = 6.4·10¹³, D_c = 1.8·10¹³ (non-embedding parameters, tokens, loss in nats), and the
overfitting rule D ≳ 5·10³ N^0.74 of their Sec. 4.2.

Command: ``python -m attnkit theory scaling [--quick] [--out DIR] [--seed S]`` trains the ladder,
prints the table and the fitted exponent, and writes ``scaling.png`` (default folder
``bench/out/theory/``).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ._threads import intra_op_threads as _threads

__all__ = [
    "PowerLawFit",
    "fit_power_law",
    "KAPLAN",
    "kaplan_loss",
    "kaplan_data_needed",
    "kaplan_overfitting",
    "MarkovSource",
    "random_markov_source",
    "ScalingResult",
    "block_parameters",
    "scaling_experiment",
    "main",
]




# ----------------------------------------------------------------------------------------------
# Power-law fits
# ----------------------------------------------------------------------------------------------

@dataclass
class PowerLawFit:
    """The result of :func:`fit_power_law`: ``y ≈ (x_c / x)^alpha + floor``.

    ``x_c`` is kept as ``log_x_c`` (ln x_c = intercept / α overflows when α → 0); ``x_c`` and
    ``x_c_ci`` are properties.  ``alpha_ci``, ``log_x_c_ci`` (and ``floor_ci`` when the floor was
    fitted) are bootstrap percentile intervals at level ``level``; ``rmse_log`` is the root-mean-square residual of the
    fit in log space; ``n_boot_used`` the bootstrap resamples that gave a fit.
    """

    alpha: float
    log_x_c: float
    floor: float
    alpha_ci: tuple[float, float]
    log_x_c_ci: tuple[float, float]
    floor_ci: Optional[tuple[float, float]]
    rmse_log: float
    level: float
    n: int
    n_boot_used: int

    @staticmethod
    def _exp(v: float) -> float:
        return math.exp(v) if v < 709.0 else math.inf

    @property
    def x_c(self) -> float:
        """``exp(log_x_c)`` (inf when it overflows float64: a nearly flat fit, α ≈ 0)."""
        return self._exp(self.log_x_c)

    @property
    def x_c_ci(self) -> tuple[float, float]:
        """``exp`` of ``log_x_c_ci``."""
        return (self._exp(self.log_x_c_ci[0]), self._exp(self.log_x_c_ci[1]))

    def predict(self, x) -> np.ndarray:
        """``(x_c / x)^alpha + floor``."""
        return np.exp(-self.alpha * (np.log(np.asarray(x, dtype=np.float64)) - self.log_x_c)) + self.floor


def _line(lx: np.ndarray, ly: np.ndarray):
    """Closed-form least squares ly ≈ slope·lx + icpt: (slope, icpt)."""
    mx, my = lx.mean(), ly.mean()
    dx = lx - mx
    sxx = float(dx @ dx)
    slope = float(dx @ (ly - my)) / sxx
    return slope, my - slope * mx


def _fit_fixed_floor(lx: np.ndarray, y: np.ndarray, floor: float):
    """Least squares of ln(y − floor) = α ln x_c − α ln x.  Returns (alpha, ln x_c) or None."""
    r = y - floor
    if np.any(r <= 0) or np.ptp(lx) == 0:
        return None
    slope, icpt = _line(lx, np.log(r))
    if slope == 0:
        return None
    alpha = -slope
    return alpha, icpt / alpha


def _fit_free_floor(lx: np.ndarray, y: np.ndarray):
    """Profile least squares over the floor f ∈ [0, min y): for each f the fit of ln(y − f) is a
    line; the f whose fit has the smallest residual in ln y (ln y − ln ŷ, the same scale for
    every f) wins -- a grid on f / min y, refined by golden-section search.  Returns
    (alpha, ln x_c, floor) or None."""
    ly = np.log(y)
    ymin = float(y.min())

    def sse(f):
        fit = _fit_fixed_floor(lx, y, f)
        if fit is None or not (fit[0] > 0):
            return math.inf
        alpha, log_xc = fit
        res = ly - np.log(np.exp(-alpha * (lx - log_xc)) + f)
        return float(res @ res)

    grid = ymin * (1 - np.geomspace(1, 1e-6, 80))  # 0 .. ymin (1 − 1e-6), dense near ymin
    vals = [sse(f) for f in grid]
    k = int(np.argmin(vals))
    if not math.isfinite(vals[k]):
        return None
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    sc, sd = sse(c), sse(d)
    for _ in range(40):
        if sc < sd:
            hi, d, sd = d, c, sc
            c = hi - g * (hi - lo)
            sc = sse(c)
        else:
            lo, c, sc = c, d, sd
            d = lo + g * (hi - lo)
            sd = sse(d)
    f = c if sc < sd else d
    if min(sc, sd) > vals[k]:
        f = grid[k]
    alpha, log_xc = _fit_fixed_floor(lx, y, f)
    return alpha, log_xc, float(f)


def fit_power_law(x: Sequence[float], y: Sequence[float], floor: Union[None, float, str] = None, *,
                  n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> PowerLawFit:
    r"""Fit ``y = (x_c / x)^α + floor`` by least squares in log space, with bootstrap CIs.

    The power law of Kaplan et al. (2020), L(N) = (N_c / N)^α_N, is a line in log–log space:
    ``ln(y − floor) = α ln x_c − α ln x``; the slope gives −α and the intercept α ln x_c.

    ``floor``:
    - ``None``: no floor (0);
    - a number: a known irreducible part (e.g. the entropy rate of the source), subtracted
      before the fit (every y must exceed it);
    - ``"fit"``: estimated too, by profiling the log-space least squares over floor ∈ [0, min y)
      (the residual compared is ln y − ln ŷ).

    Confidence intervals: residual bootstrap in log space -- ``n_boot`` synthetic data sets
    ``ln y* = ln ŷ + e*`` with e* drawn with replacement from the fit's log residuals (centred and
    inflated by sqrt(n / (n − p)), p = 2 or 3 fitted parameters), each refitted the same way;
    percentile intervals at ``level``.  Choice: residual rather than pairs bootstrap -- with the
    ~10 points of a scaling ladder, resampling the points themselves covered the true exponent
    in only ≈ 85 % of synthetic trials at level 0.95 (the residual version: ≈ 93 %, see the
    tests).  Resamples without a valid fit are skipped (``n_boot_used``).  ``seed`` makes them
    reproducible.  Needs at least 3 points with distinct x > 0.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("fit_power_law: x and y must be 1-D sequences of the same length")
    if len(np.unique(x)) < 3 or np.any(x <= 0):
        raise ValueError("fit_power_law: need at least 3 distinct x > 0")
    if not (0 < level < 1):
        raise ValueError(f"fit_power_law: level must be in (0, 1); got {level}")
    free = isinstance(floor, str)
    if free and floor != "fit":
        raise ValueError(f"fit_power_law: floor must be None, a number or 'fit'; got {floor!r}")
    lx = np.log(x)

    def fit(y_):
        if free:
            return _fit_free_floor(lx, y_)
        f0 = 0.0 if floor is None else float(floor)
        r = _fit_fixed_floor(lx, y_, f0)
        return None if r is None else (r[0], r[1], f0)

    main_fit = fit(y)
    if main_fit is None:
        raise ValueError("fit_power_law: every y must exceed the floor (and y must fall with x for a fitted floor)")
    alpha, log_xc, f = main_fit
    # the space the fit works in: ln(y − floor) for a given floor, ln y for a fitted one
    log_pred = np.log(np.exp(-alpha * (lx - log_xc)) + (f if free else 0.0))
    resid = np.log(y - (0.0 if free else f)) - log_pred
    n = len(x)
    n_par = 3 if free else 2
    rmse = float(np.sqrt(np.mean(resid ** 2)))

    # residual bootstrap in log space, residuals centred and inflated by sqrt(n / (n − p))
    rng = np.random.default_rng(seed)
    scaled = (resid - resid.mean()) * math.sqrt(n / max(n - n_par, 1))
    boots = []
    for _ in range(n_boot):
        y_star = np.exp(log_pred + rng.choice(scaled, n, replace=True)) + (0.0 if free else f)
        r = fit(y_star)
        if r is not None and np.isfinite(r[0]) and np.isfinite(r[1]):
            boots.append(r)
    q = ((1 - level) / 2 * 100, (1 + level) / 2 * 100)
    if boots:
        b = np.asarray(boots)
        a_ci = tuple(float(v) for v in np.percentile(b[:, 0], q))
        # x_c is spread on a log scale: percentiles of ln x_c
        log_xc_ci = tuple(float(v) for v in np.percentile(b[:, 1], q))
        f_ci = tuple(float(v) for v in np.percentile(b[:, 2], q)) if free else None
    else:
        a_ci, log_xc_ci, f_ci = (math.nan, math.nan), (math.nan, math.nan), ((math.nan, math.nan) if free else None)
    return PowerLawFit(alpha=float(alpha), log_x_c=float(log_xc), floor=float(f), alpha_ci=a_ci,
                       log_x_c_ci=log_xc_ci, floor_ci=f_ci, rmse_log=rmse, level=level, n=n,
                       n_boot_used=len(boots))


# ----------------------------------------------------------------------------------------------
# Kaplan et al. (2020)
# ----------------------------------------------------------------------------------------------

#: Kaplan et al. (2020), Table 2: the fit of L(N, D), Eq. (1.5) (N non-embedding parameters,
#: D tokens, loss in nats per token).
KAPLAN = {"alpha_N": 0.076, "alpha_D": 0.103, "N_c": 6.4e13, "D_c": 1.8e13}


def kaplan_loss(N, D=math.inf, *, alpha_N: float = KAPLAN["alpha_N"], alpha_D: float = KAPLAN["alpha_D"],
                N_c: float = KAPLAN["N_c"], D_c: float = KAPLAN["D_c"]):
    r"""Kaplan et al. (2020) Eq. (1.5), the test loss (nats/token) of a model with N non-embedding
    parameters trained (early-stopped) on D tokens:

    ``L(N, D) = [(N_c / N)^(α_N/α_D) + D_c / D]^α_D``

    with Table 2's constants α_N = 0.076, α_D = 0.103, N_c = 6.4·10¹³, D_c = 1.8·10¹³ (the
    defaults).  ``D = inf`` (the default) is the data-unlimited limit, L(N) = (N_c/N)^α_N.
    ``N`` and ``D`` may be numbers or numpy arrays (broadcast).
    """
    N = np.asarray(N, dtype=np.float64)
    D = np.asarray(D, dtype=np.float64)
    data_term = np.where(np.isinf(D), 0.0, D_c / np.where(np.isinf(D), 1.0, D))
    out = ((N_c / N) ** (alpha_N / alpha_D) + data_term) ** alpha_D
    return float(out) if out.ndim == 0 else out


def kaplan_data_needed(N):
    r"""Kaplan et al. (2020) Sec. 4.2: the data needed to avoid overfitting,
    ``D ≳ 5·10³ · N^0.74`` tokens (0.74 ≈ α_N/α_D)."""
    return 5e3 * np.asarray(N, dtype=np.float64) ** 0.74


def kaplan_overfitting(N, D):
    r"""Kaplan et al. (2020) Sec. 4.2: the overfitting penalty
    ``δL(N, D) = L(N, D) / L(N, ∞) − 1 = (1 + (N/N_c)^(α_N/α_D) D_c / D)^α_D − 1``.
    At ``D = kaplan_data_needed(N)`` it is ≈ 0.02 (2.1 % at N = 10³ … 2.07 % at 10¹³ with Table 2's
    constants): the seed-to-seed variation of the loss that Kaplan et al. use as the threshold."""
    return kaplan_loss(N, D) / kaplan_loss(N) - 1


# ----------------------------------------------------------------------------------------------
# A source with a known entropy rate
# ----------------------------------------------------------------------------------------------

@dataclass
class MarkovSource:
    r"""A stationary order-``k`` Markov chain on ``vocab`` symbols.

    ``P[c, s]`` = P(next = s | context c), the context c = (x_{t−k}, …, x_{t−1}) read as a base-V
    number (oldest digit most significant).  ``pi``: the stationary distribution of the contexts.
    Entropy rate (nats): ``H∞ = Σ_c π(c) H(P[c, ·])`` -- the smallest expected next-symbol
    cross-entropy any predictor can reach from position k on (for a chain started from π).
    """

    vocab: int
    order: int
    P: torch.Tensor  # [V^k, V] float64
    pi: torch.Tensor  # [V^k] float64

    @property
    def entropy_rate(self) -> float:
        h = -(self.P * torch.log(self.P.clamp_min(1e-300))).sum(-1)
        return float((self.pi * h).sum())

    def sample(self, batch: int, length: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """``[batch, length]`` int64 sequences started from the stationary distribution."""
        V, k = self.vocab, self.order
        ctx = torch.multinomial(self.pi.expand(batch, -1), 1, generator=generator).squeeze(1)
        digits = [(ctx // V ** (k - 1 - j)) % V for j in range(k)]
        out = torch.empty(batch, length, dtype=torch.long)
        for j in range(min(k, length)):
            out[:, j] = digits[j]
        for t in range(k, length):
            nxt = torch.multinomial(self.P[ctx], 1, generator=generator).squeeze(1)
            out[:, t] = nxt
            ctx = (ctx * V + nxt) % V ** k
        return out

    def nll(self, seq: torch.Tensor) -> torch.Tensor:
        """``[batch, length − k]``: −ln P(x_t | x_{t−k..t−1}) under the true chain, t ≥ k."""
        V, k = self.vocab, self.order
        ctx = torch.zeros(seq.shape[0], dtype=torch.long)
        for j in range(k):
            ctx = ctx * V + seq[:, j]
        out = []
        for t in range(k, seq.shape[1]):
            out.append(-torch.log(self.P[ctx, seq[:, t]]))
            ctx = (ctx * V + seq[:, t]) % V ** k
        return torch.stack(out, dim=1)


def random_markov_source(vocab: int = 8, order: int = 2, concentration: float = 0.5,
                         seed: int = 0) -> MarkovSource:
    r"""A random order-``order`` Markov chain: each row P[c, ·] ~ Dirichlet(concentration · 1)
    (choice: a symmetric Dirichlet; small concentration gives peaked, low-entropy rows), and π
    the stationary distribution of the context chain (power iteration to 1e-13)."""
    g = torch.Generator().manual_seed(seed)
    n_ctx = vocab ** order
    gam = torch._standard_gamma(torch.full((n_ctx, vocab), float(concentration), dtype=torch.float64), generator=g)
    P = gam / gam.sum(-1, keepdim=True)
    P = P.clamp_min(1e-12)
    P = P / P.sum(-1, keepdim=True)
    # context transition: c -> (c * V + s) mod V^k with prob P[c, s]
    nxt = (torch.arange(n_ctx)[:, None] * vocab + torch.arange(vocab)[None, :]) % n_ctx
    pi = torch.full((n_ctx,), 1.0 / n_ctx, dtype=torch.float64)
    for _ in range(100000):
        new = torch.zeros_like(pi).index_add_(0, nxt.reshape(-1), (pi[:, None] * P).reshape(-1))
        if float((new - pi).abs().max()) < 1e-13:
            pi = new
            break
        pi = new
    return MarkovSource(vocab=vocab, order=order, P=P, pi=pi / pi.sum())


# ----------------------------------------------------------------------------------------------
# The experiment (a ladder of small transformers)
# ----------------------------------------------------------------------------------------------

@dataclass
class ScalingResult:
    """The result of :func:`scaling_experiment`.

    ``params``: N of each model (non-embedding: the transformer blocks' parameters);
    ``loss``: its held-out next-symbol cross-entropy (nats, positions t ≥ k); ``entropy_rate``:
    H∞ of the source; ``bayes_loss``: the true chain's cross-entropy on the same held-out data
    (≈ H∞); ``fit``: :func:`fit_power_law` of (N, loss) with floor ``bayes_loss`` (None if
    fewer than 3 points lie above it).
    """

    params: list[int]
    widths: list[int]
    loss: list[float]
    entropy_rate: float
    bayes_loss: float
    fit: Optional[PowerLawFit]
    steps: int
    train_curves: list[list[float]] = field(default_factory=list)


def block_parameters(model) -> int:
    """Non-embedding parameters of an ``attnkit.theory._model.TinyCausalTransformer``: those of its
    transformer blocks (attention, MLP, their LayerNorms).  Kaplan et al. count N without the
    embedding and position matrices; we also leave out the final LayerNorm and the read-out
    (choice: they are the same O(d_model · vocab) for every model of a ladder, like the
    embedding)."""
    return sum(p.numel() for p in model.blocks.parameters())


def scaling_experiment(widths: Sequence[int] = (8, 12, 16, 24, 32, 48, 64), *, n_layers: int = 2,
                       n_heads: int = 2, source: Optional[MarkovSource] = None, context: int = 32,
                       steps: int = 3000, batch: int = 32, lr: float = 3e-3, eval_batch: int = 512,
                       seed: int = 0, n_boot: int = 1000, progress: bool = True,
                       threads: Optional[int] = 1) -> ScalingResult:
    r"""Train a ladder of small causal transformers on a Markov source and fit L(N) − H∞ = (N_c/N)^α.

    Models: ``attnkit.theory._model.TinyCausalTransformer`` (GPT-2-style, pre-norm, softmax
    attention through :func:`attnkit.softmax_attention`), one per d_model in ``widths``,
    ``n_layers`` blocks of ``n_heads`` heads; input one-hot symbols, output next-symbol logits.
    N = :func:`block_parameters`.

    Source (default): :func:`random_markov_source` with vocab 8, order 3, Dirichlet(0.5) rows,
    ``seed`` -- a chain whose entropy rate H∞ is known exactly, so the irreducible loss of
    Kaplan et al.'s fits is not a fitted constant but H∞.  Choice of order 3 (512 contexts):
    with order 2 (64 contexts) every model from d_model 24 on reached the Bayes loss within
    0.002 nats and the ladder saturated; with order 3 none of the default ladder's models does
    in 3000 steps, so every point constrains the fit.

    Training: every step a fresh batch of ``batch`` sequences of ``context + 1`` symbols (no data
    limit: Kaplan's D = ∞ regime; every model sees the same ``steps·batch·context`` tokens),
    next-symbol cross-entropy, AdamW at peak ``lr``, linear warm-up over min(100, steps/10)
    steps then cosine decay to 0, gradient clipping at 1.  Choice: its own loop rather than the
    shared ``train_model`` (which keeps the rate constant after warm-up): with a constant rate
    the larger models stalled ≈ 0.012 nats above the Bayes loss, an optimizer-noise floor that
    flattens the power law; Kaplan et al. also decay the rate to 0.
    Evaluation: mean next-symbol cross-entropy (nats) on ``eval_batch`` held-out sequences, at
    the positions whose context is complete (t ≥ order; from there the best possible loss is
    exactly H∞ for a chain started from its stationary law).
    Fit: :func:`fit_power_law` of (N, loss) with the floor = the true chain's loss on the same
    held-out symbols (``bayes_loss``, an unbiased estimate of H∞).  Choice: this paired floor
    rather than H∞ itself, because the held-out set's sampling noise (≈ ±0.003 nats at 512 × 32
    symbols) is as large as the excess loss of the largest models and cancels in the
    difference; points at or below it are left out of the fit.  ``threads``: torch intra-op
    threads while it     runs (default 1; None keeps torch's setting).
    """
    from tqdm.auto import tqdm

    from ._model import TinyCausalTransformer

    src = source if source is not None else random_markov_source(8, 3, 0.5, seed=seed)
    V, k = src.vocab, src.order
    h = src.entropy_rate
    g_eval = torch.Generator().manual_seed(10_000 + seed)
    eval_seq = src.sample(eval_batch, context + 1, g_eval)
    bayes = float(src.nll(eval_seq).mean())  # the true chain on the held-out symbols t >= k

    def loss_on(model, seq, positions_from=0):
        x = torch.nn.functional.one_hot(seq[:, :-1], V).to(torch.float32)
        logits = model(x)[:, positions_from:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, 1 + positions_from:].reshape(-1))

    warmup = min(100, max(steps // 10, 1))
    params, losses, curves = [], [], []
    with _threads(threads):
        for i, w in enumerate(widths):
            torch.manual_seed(seed * 1000 + i)
            g = torch.Generator().manual_seed(seed * 1000 + i)
            model = TinyCausalTransformer(d_in=V, d_model=w, n_layers=n_layers, n_heads=n_heads, d_out=V,
                                          max_len=context)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            curve = []
            bar = tqdm(range(steps), desc=f"d_model={w}", disable=not progress, leave=False, mininterval=0.5)
            model.train()
            for step in bar:
                # linear warm-up, then cosine decay to 0 (Kaplan et al.'s schedule)
                frac = (step + 1) / warmup if step < warmup else \
                    0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))
                for group in opt.param_groups:
                    group["lr"] = lr * frac
                loss = loss_on(model, src.sample(batch, context + 1, g))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                curve.append(float(loss.detach()))
                if progress and step % 50 == 0:
                    bar.set_postfix(loss=f"{sum(curve[-100:]) / len(curve[-100:]):.4f}")
            bar.close()
            model.eval()
            with torch.no_grad():
                # predictions of symbols t >= k: outputs at positions t - 1 >= k - 1
                losses.append(float(loss_on(model, eval_seq, positions_from=max(k - 1, 0))))
            params.append(block_parameters(model))
            curves.append(curve)
    keep = [j for j, loss in enumerate(losses) if loss > bayes]
    fit = None
    if len(keep) >= 3:
        try:
            fit = fit_power_law([params[j] for j in keep], [losses[j] for j in keep], floor=bayes, n_boot=n_boot,
                                seed=seed)
        except ValueError:
            fit = None
    return ScalingResult(params=params, widths=list(widths), loss=losses, entropy_rate=h, bayes_loss=bayes,
                         fit=fit, steps=steps, train_curves=curves)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m attnkit theory scaling``: Kaplan's L(N, D), the ladder, the fit; ``scaling.png``."""
    ap = argparse.ArgumentParser(prog="python -m attnkit theory scaling",
                                 description="scaling laws: power-law fits, Kaplan et al.'s L(N, D), a small ladder")
    ap.add_argument("--quick", action="store_true", help="three tiny models, a few steps")
    ap.add_argument("--out", default="bench/out/theory", help="folder for scaling.png (default bench/out/theory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="training steps per model (default 3000; quick 30)")
    args = ap.parse_args(argv)

    print("# Kaplan et al. (2020), Eq. (1.5) with Table 2's constants "
          f"(alpha_N={KAPLAN['alpha_N']}, alpha_D={KAPLAN['alpha_D']}, N_c={KAPLAN['N_c']:.1e}, "
          f"D_c={KAPLAN['D_c']:.1e})\n")
    ns = [1e6, 1e7, 1e8, 1e9, 1e10]
    rows = []
    for n in ns:
        d_need = float(kaplan_data_needed(n))
        rows.append([f"{n:.0e}", f"{kaplan_loss(n):.4f}", f"{kaplan_loss(n, 1e9):.4f}", f"{kaplan_loss(n, 1e11):.4f}",
                     f"{d_need:.2e}", f"{kaplan_overfitting(n, d_need):.4f}"])
    print(_table(rows, ["N", "L(N, inf)", "L(N, 1e9)", "L(N, 1e11)", "5e3 N^0.74", "dL there"]))
    print("L(N, inf) = (N_c/N)^alpha_N; at D = 5e3 N^0.74 the overfitting penalty dL = L(N,D)/L(N,inf) - 1 is ~2 %\n")

    quick = args.quick
    steps = args.steps if args.steps is not None else (30 if quick else 3000)
    widths = (8, 16, 32) if quick else (8, 12, 16, 24, 32, 48, 64)
    res = scaling_experiment(widths, steps=steps, context=16 if quick else 32, batch=16 if quick else 32,
                             eval_batch=64 if quick else 512, n_boot=200 if quick else 1000, seed=args.seed)
    print(f"# Ladder: 2-layer attnkit transformers on a random order-3 Markov chain over 8 symbols, {steps} steps each")
    print(f"  entropy rate H = {res.entropy_rate:.4f} nats "
          f"(the true chain's loss on the held-out data: {res.bayes_loss:.4f})\n")
    print(_table([[str(w), str(n), f"{loss:.4f}", f"{loss - res.entropy_rate:.4f}", f"{loss - res.bayes_loss:.4f}"]
                  for w, n, loss in zip(res.widths, res.params, res.loss)],
                 ["d_model", "N (blocks)", "loss", "loss - H", "loss - Bayes(held-out)"]))
    if res.fit is not None:
        f = res.fit
        print(f"\nfit L(N) - Bayes = (N_c/N)^alpha: alpha = {f.alpha:.3f} [{f.alpha_ci[0]:.3f}, {f.alpha_ci[1]:.3f}] "
              f"(95 % bootstrap CI), N_c = {f.x_c:.3g}; Kaplan et al.: alpha_N = 0.076 on WebText2")
    else:
        print("\nfit: not enough points above the entropy rate")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    nn_ = np.geomspace(1e5, 1e11, 50)
    for dd, style in [(math.inf, "-"), (1e9, "--"), (1e11, ":")]:
        ax.loglog(nn_, kaplan_loss(nn_, dd), style, label=f"D = {'inf' if dd == math.inf else f'{dd:.0e}'}")
    ax.set_xlabel("N (non-embedding parameters)")
    ax.set_ylabel("L (nats)")
    ax.set_title("Kaplan et al. Eq. 1.5 (Table 2)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ex = [max(loss - res.bayes_loss, 1e-6) for loss in res.loss]
    ax.loglog(res.params, ex, "o", label="measured L - Bayes (held-out)")
    if res.fit is not None:
        xs = np.geomspace(min(res.params), max(res.params), 50)
        ax.loglog(xs, res.fit.predict(xs) - res.fit.floor, "-", label=f"fit alpha = {res.fit.alpha:.3f}")
    ax.set_xlabel("N (block parameters)")
    ax.set_ylabel("excess loss (nats)")
    ax.set_title("attnkit transformer ladder")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "scaling.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))

"""attnkit.theory.scaling: power-law fits with bootstrap CIs, Kaplan et al.'s L(N, D), the
Markov source with a known entropy rate, and a short run of the transformer ladder."""
import math

import numpy as np
import pytest
import torch

from attnkit.theory import scaling
from attnkit.theory.scaling import (
    KAPLAN,
    fit_power_law,
    kaplan_data_needed,
    kaplan_loss,
    kaplan_overfitting,
    random_markov_source,
)


def _synthetic(alpha, x_c, floor, sigma, seed, n=12):
    rng = np.random.default_rng(seed)
    x = np.geomspace(1e3, 1e7, n)
    return x, (x_c / x) ** alpha * np.exp(sigma * rng.standard_normal(n)) + floor


def test_fit_power_law_exact_data():
    x = np.geomspace(10, 1e6, 9)
    for alpha, x_c in [(0.076, 8.8e13), (0.5, 3.0), (1.3, 1e4)]:
        f = fit_power_law(x, (x_c / x) ** alpha, n_boot=50)
        assert f.alpha == pytest.approx(alpha, rel=1e-10)
        assert f.x_c == pytest.approx(x_c, rel=1e-8)
        assert f.rmse_log < 1e-10
        f = fit_power_law(x, (x_c / x) ** alpha + 1.7, floor=1.7, n_boot=50)
        assert f.alpha == pytest.approx(alpha, rel=1e-9)


@pytest.mark.parametrize("alpha, x_c, floor, seed", [(0.076, 8.8e13, None, 1), (0.3, 500.0, None, 2),
                                                     (0.7, 2e4, 1.5, 3), (0.3, 500.0, 0.8, 4)])
def test_fit_power_law_recovers_known_exponent_within_ci(alpha, x_c, floor, seed):
    # 12 points over 4 decades, 3 % multiplicative noise on the power-law part; the known floor
    # (when there is one) is given to the fit.  Seen: every CI contains the truth, α CI width
    # ≈ 0.01–0.02.
    x, y = _synthetic(alpha, x_c, floor or 0.0, 0.03, seed)
    f = fit_power_law(x, y, floor=floor, n_boot=1000, seed=seed)
    assert f.alpha_ci[0] <= alpha <= f.alpha_ci[1], (f.alpha, f.alpha_ci)
    assert f.x_c_ci[0] <= x_c <= f.x_c_ci[1], (f.x_c, f.x_c_ci)
    assert f.alpha_ci[1] - f.alpha_ci[0] < 0.05
    assert f.n_boot_used == 1000


def test_fit_power_law_fitted_floor():
    # The floor unknown: y = (500/x)^0.3 + 1.5 with 0.3 % noise on y; 12 points.
    # Seen: α = 0.303 (CI ≈ 0.294–0.312), floor = 1.5015 (CI ≈ 1.498–1.505).
    rng = np.random.default_rng(7)
    x = np.geomspace(1e3, 1e7, 12)
    y = ((500.0 / x) ** 0.3 + 1.5) * np.exp(0.003 * rng.standard_normal(12))
    f = fit_power_law(x, y, floor="fit", n_boot=200, seed=7)
    assert f.alpha_ci[0] <= 0.3 <= f.alpha_ci[1], (f.alpha, f.alpha_ci)
    assert f.floor_ci[0] <= 1.5 <= f.floor_ci[1], (f.floor, f.floor_ci)
    # fitting without the floor gives a badly wrong exponent -- the floor matters
    assert fit_power_law(x, y, n_boot=10).alpha < 0.1


def test_fit_power_law_ci_coverage():
    # Over 100 synthetic data sets the 95 % intervals contain the true α at least 85 % of the
    # time (seen 0.92: percentile intervals from ~12 points run a little narrow).
    hits = 0
    for seed in range(100):
        x, y = _synthetic(0.3, 500.0, 0.0, 0.03, 100 + seed)
        f = fit_power_law(x, y, n_boot=300, seed=seed)
        hits += f.alpha_ci[0] <= 0.3 <= f.alpha_ci[1]
    assert hits >= 85, hits


def test_fit_power_law_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_power_law([1, 2], [1, 2])
    with pytest.raises(ValueError):
        fit_power_law([1, 2, 3], [1.0, 0.5, 0.3], floor=0.4)  # y at or below the floor
    with pytest.raises(ValueError):
        fit_power_law([1, 2, 3], [1.0, 0.5, 0.3], floor="guess")


def test_kaplan_loss_data_unlimited_limit():
    # Kaplan et al. Eq. (1.5) at D = inf is L(N) = (N_c / N)^α_N with Table 2's constants.
    assert KAPLAN == {"alpha_N": 0.076, "alpha_D": 0.103, "N_c": 6.4e13, "D_c": 1.8e13}
    for N in (1e3, 1e6, 1.5e8, 1e9, 1e11):
        assert kaplan_loss(N) == pytest.approx((6.4e13 / N) ** 0.076, rel=1e-13)
        assert kaplan_loss(N, math.inf) == kaplan_loss(N)
        # finite data only adds loss, and approaches the limit as D grows
        assert kaplan_loss(N, 1e9) > kaplan_loss(N)
        assert kaplan_loss(N, 1e30) == pytest.approx(kaplan_loss(N), rel=1e-10)
    N = np.array([1e6, 1e8])
    assert np.allclose(kaplan_loss(N), (6.4e13 / N) ** 0.076, rtol=1e-13)
    # the data-limited end: L(∞, D) = (D_c / D)^α_D
    assert kaplan_loss(1e40, 1e10) == pytest.approx((1.8e13 / 1e10) ** 0.103, rel=1e-6)
    # a spot value by hand: ln(6.4e13 / 1.5e9) = 10.6611, × 0.076 = 0.81024, exp -> 2.2485 nats
    assert kaplan_loss(1.5e9) == pytest.approx(2.2485, abs=1e-4)


def test_kaplan_overfitting_rule():
    # D = 5e3 N^0.74 keeps the overfitting penalty δL = L(N, D)/L(N, ∞) − 1 at ≈ 2 % over ten
    # decades of N (seen 0.0216 at N = 1e3 … 0.0207 at 1e13), and 10× less data costs more.
    for N in (1e3, 1e5, 1e7, 1e9, 1e11, 1e13):
        D = kaplan_data_needed(N)
        assert D == pytest.approx(5e3 * N ** 0.74)
        assert 0.019 < kaplan_overfitting(N, D) < 0.023
        assert kaplan_overfitting(N, D / 10) > 0.1


def test_markov_source_entropy_rate():
    src = random_markov_source(vocab=4, order=2, concentration=0.5, seed=3)
    # π is stationary for the context chain and P's rows are distributions
    assert torch.allclose(src.P.sum(-1), torch.ones(16, dtype=torch.float64))
    assert float(src.pi.sum()) == pytest.approx(1.0)
    # the empirical mean of −ln P(x_t | context) over a long sample is H∞ (CLT tolerance:
    # 5 standard errors of the mean)
    g = torch.Generator().manual_seed(0)
    seq = src.sample(64, 400, g)
    nll = src.nll(seq)
    se = float(nll.std()) / math.sqrt(nll.numel()) * math.sqrt(4)  # ×2 for within-sequence correlation
    assert float(nll.mean()) == pytest.approx(src.entropy_rate, abs=5 * se)
    assert 0 < src.entropy_rate < math.log(4)
    # an order-0 i.i.d. uniform source: H∞ = ln V exactly
    flat = scaling.MarkovSource(vocab=3, order=1, P=torch.full((3, 3), 1 / 3, dtype=torch.float64),
                                pi=torch.full((3,), 1 / 3, dtype=torch.float64))
    assert flat.entropy_rate == pytest.approx(math.log(3))


def test_scaling_experiment_short_run():
    # Three tiny attnkit transformers (d_model 8, 16, 24), 40 steps each on the default source
    # (a random order-3 chain over 8 symbols): a finite fit, every held-out loss above the entropy
    # rate and below ln 8 + 0.5 (seen: H = 1.4879 nats, losses ≈ 2.0).
    res = scaling.scaling_experiment((8, 16, 24), steps=40, context=16, batch=16, eval_batch=64, n_boot=100,
                                     progress=False)
    src = random_markov_source(8, 3, 0.5, seed=0)
    assert res.entropy_rate == pytest.approx(src.entropy_rate)
    assert res.params == [24 * w * w + 26 * w for w in (8, 16, 24)]  # 2 blocks of 12 w² + 13 w
    assert all(loss > res.entropy_rate for loss in res.loss), res.loss
    assert all(loss < math.log(8) + 0.5 for loss in res.loss), res.loss
    assert all(len(c) == 40 and c[-1] < c[0] for c in res.train_curves)
    f = res.fit
    assert f is not None
    # finite exponent, ln N_c and intervals (after 40 steps the curve is nearly flat, α ≈ 0, so
    # N_c itself may overflow: the fit keeps ln N_c)
    assert all(math.isfinite(v) for v in (f.alpha, f.log_x_c, *f.alpha_ci, *f.log_x_c_ci))
    assert f.alpha_ci[0] <= f.alpha <= f.alpha_ci[1]
    assert f.floor == res.bayes_loss  # the paired estimate of H on the held-out data
    # the true chain's loss on the same held-out data (64 × 14 symbols at t >= 3) is within 5
    # standard errors of H (per-symbol NLL std < 1.2 nats for this chain: 5 · 1.2 / sqrt(896) = 0.2)
    assert res.bayes_loss == pytest.approx(res.entropy_rate, abs=0.2)


def test_command_quick(tmp_path, capsys):
    assert scaling.main(["--quick", "--steps", "10", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "0.0210" in out  # the overfitting penalty at N = 1e9
    assert (tmp_path / "scaling.png").stat().st_size > 1000

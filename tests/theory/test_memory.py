"""attnkit.theory.memory: Hopfield capacity (classical, dense polynomial, modern exponential),
Ramsauer et al.'s Theorem 3 constant and Theorem 4's retrieval-error bound.

Every number is the issue's (12); the values seen when these tests were written are in the
comments (seed 0, float64)."""
import math

import pytest
import torch

import attnkit
from attnkit.theory import memory
from attnkit.theory.memory import (
    capacity_curve,
    lambert_w0,
    polynomial_capacity_estimate,
    ramsauer_capacity,
    random_sphere_patterns,
    retrieval_bound,
    separation,
    theorem4_beta,
)

D = 200  # the classical tests' d


def test_classical_all_fixed_points_at_d_over_4_ln_d():
    # n = round(200 / (4 ln 200)) = 9; 45 trials, 405 patterns; seen 1.000
    n = round(D / (4 * math.log(D)))
    assert n == 9
    c = capacity_curve("classical", D, [n], samples=400)
    assert c.measured[0] >= 400
    assert c.retrieved[0] >= 0.99, c.retrieved


def test_classical_most_fixed_points_at_d_over_2_ln_d():
    # n = round(200 / (2 ln 200)) = 19; 22 trials, 418 patterns; seen ≈ 0.91 (the issue: ≈ 92 %)
    n = round(D / (2 * math.log(D)))
    assert n == 19
    c = capacity_curve("classical", D, [n], samples=400)
    assert c.retrieved[0] >= 0.80, c.retrieved


def test_classical_dynamics_below_and_above_the_breakdown():
    # 0.14 d = 28 patterns: asynchronous sweeps from the stored patterns end ≈ 1.5 % of the bits
    # away on average (AGS: 1.6 %); 0.3 d = 60: ≈ 29 % away.  ≥ 200 started patterns each.
    below = capacity_curve("classical", D, [round(0.14 * D)], samples=200, dynamics=True)
    above = capacity_curve("classical", D, [round(0.3 * D)], samples=200, dynamics=True)
    assert below.hamming[0] <= 0.03, below.hamming
    assert above.hamming[0] > 0.15, above.hamming


def test_polynomial_a3_stores_clearly_more_than_classical():
    # Same d = 200.  At 5 × d/(2 ln d) = 94 patterns the classical network has (almost) no
    # fixed point left (seen 0.000) while F(z) = z^3 keeps all of them (seen 1.000).  At the
    # source's a = 3 estimate d²/(6 ln d) ≈ 1258 patterns (13× more) most are still fixed
    # points (seen 0.86), and the classical network at that load has none.
    n = 5 * round(D / (2 * math.log(D)) - 0.5) - 1  # 94
    classical = capacity_curve("classical", D, [n], samples=400)
    poly = capacity_curve("polynomial", D, [n], degree=3, samples=400)
    assert classical.retrieved[0] <= 0.05, classical.retrieved
    assert poly.retrieved[0] >= 0.99, poly.retrieved
    est = polynomial_capacity_estimate(D, 3)
    assert est == pytest.approx(D ** 2 / (6 * math.log(D)))
    big = capacity_curve("polynomial", D, [round(est)], degree=3, samples=1)
    assert big.retrieved[0] >= 0.5, big.retrieved
    assert capacity_curve("classical", D, [round(est)], samples=1).retrieved[0] == 0.0


def test_exponential_update_retrieves_ten_d_patterns_in_one_step():
    # d = 32, 320 patterns on the sphere of radius sqrt(31), queries 0.1 M away, β from
    # Theorem 4 (≈ 2.8): every one retrieved within 0.01 M (seen 1.000, mean error ≈ 1e-12 M),
    # and every measured error below Theorem 4's bound.
    d = 32
    c = capacity_curve("exponential", d, [10 * d], samples=640)
    assert c.measured[0] == 640
    assert c.retrieved[0] >= 0.99, c.retrieved
    assert c.bound_ok == [True]
    # β chosen by Theorem 4 is what makes it work: a β 20× smaller averages the patterns.
    small = capacity_curve("exponential", d, [10 * d], beta=c.beta[0] / 20, samples=320)
    assert small.retrieved[0] < 0.5, small.retrieved


def test_measured_one_step_errors_lie_below_retrieval_bound():
    # Several β and query distances, including ones where the bound is far from tight and ones
    # where it is nearly reached (the error then is a sizable fraction of M).
    g = torch.Generator().manual_seed(3)
    d, n = 16, 40
    m = math.sqrt(d - 1)
    x = random_sphere_patterns(n, d, m, g)
    ratios = []
    for beta in (0.2, 0.5, 1.0, 3.0):
        for r in (0.0, 0.05, 0.2):
            u = torch.randn(n, d, generator=g, dtype=torch.float64)
            q = x + r * m * u / u.norm(dim=-1, keepdim=True)
            f = attnkit.hopfield_update(q[None, None], x[None, None], beta=beta, steps=1)[0, 0]
            err = (f - x).norm(dim=-1)
            bound = retrieval_bound(x, beta, q)
            assert bool((err <= bound).all()), (beta, r, (err / bound).max())
            # the theorem's own form (max with ‖x_i* − x_i‖ ≥ 0) is looser still
            assert bool((retrieval_bound(x, beta, q, fixed_point_distance=0.5) >= bound).all())
            ratios.append(float((err / bound).max()))
    assert max(ratios) > 1e-3  # the check is not vacuous: some errors come within 1000× of it


def test_retrieval_bound_matches_formula_by_hand():
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    # Δ: x1: 4 − max(0, −2) = 4; x2: 1 − max(0, 0) = 1; x3: 1 − max(−2, 0) = 1; M = 2
    assert separation(x).tolist() == [4.0, 1.0, 1.0]
    q = x + torch.tensor([[0.0, 0.1], [0.0, 0.0], [0.2, 0.0]], dtype=torch.float64)
    b = retrieval_bound(x, 0.7, q)
    want = [2 * 2 * math.exp(-0.7 * (4 - 2 * 0.1 * 2)) * 2, 2 * 2 * math.exp(-0.7 * 1) * 2,
            2 * 2 * math.exp(-0.7 * (1 - 2 * 0.2 * 2)) * 2]
    assert b.tolist() == pytest.approx(want, rel=1e-14)


def test_theorem4_beta_is_the_smallest_beta_meeting_the_bound():
    g = torch.Generator().manual_seed(5)
    x = random_sphere_patterns(100, 24, math.sqrt(23), g)
    eps, r = 0.01, 0.05 * math.sqrt(23)
    beta = theorem4_beta(x, r, eps, quantile=0.0)  # quantile 0: every pattern covered
    u = torch.randn(100, 24, generator=g, dtype=torch.float64)
    q = x + r * u / u.norm(dim=-1, keepdim=True)
    m = float(x.norm(dim=-1).max())
    # the worst case of the bound over the ball of radius r (the query at distance exactly r)
    worst = 2 * 99 * torch.exp(-beta * (separation(x) - 2 * r * m)) * m
    assert float(worst.max()) == pytest.approx(eps * m, rel=1e-10)
    assert bool((retrieval_bound(x, beta, q) <= eps * m * (1 + 1e-10)).all())
    with pytest.raises(ValueError):
        theorem4_beta(x, 10 * math.sqrt(23), eps)


@pytest.mark.parametrize("d, K, c_paper, sum_paper", [(20, 3.0, 3.1546, 1.27), (75, 1.0, 1.3718, -0.94)])
def test_ramsauer_theorem3_constants(d, K, c_paper, sum_paper):
    # Ramsauer et al. (2021), Theorem 3 with β = 1, p = 0.001: c = 3.1546 (a + ln b > 1.27)
    # and c = 1.3718 (a + ln b < −0.94); both satisfy c ≥ (2/√p)^(4/(d−1)).
    r = ramsauer_capacity(d, beta=1.0, K=K, p=0.001)
    assert abs(r.c - c_paper) < 1e-4  # the paper truncates to 4 decimals: 3.15461, 1.37188
    a_ln_b = r.a + math.log(r.b)
    assert (a_ln_b > sum_paper) if sum_paper > 0 else (a_ln_b < sum_paper)
    assert r.valid
    assert r.M == pytest.approx(K * math.sqrt(d - 1))
    assert r.bound == pytest.approx(math.sqrt(0.001) * r.c ** ((d - 1) / 4))
    # c solves the defining equation: W0(e^(a + ln b)) = b / c  ⇔  (b/c) e^(b/c) = e^(a + ln b)
    w = r.b / r.c
    assert w * math.exp(w) == pytest.approx(math.exp(a_ln_b), rel=1e-12)


def test_lambert_w0():
    for x in (-1 / math.e, -0.3, -1e-3, 0.0, 1e-8, 0.5, 1.0, math.e, 10.0, 1e6, 1e200):
        w = lambert_w0(x)
        assert w >= -1
        if x > 1e100:
            assert w + math.log(w) == pytest.approx(math.log(x), rel=1e-14)
        else:
            assert w * math.exp(w) == pytest.approx(x, rel=1e-13, abs=1e-15)
    assert lambert_w0(math.e) == pytest.approx(1.0, rel=1e-15)
    with pytest.raises(ValueError):
        lambert_w0(-0.5)


def test_capacity_curve_rejects_bad_kind():
    with pytest.raises(ValueError):
        capacity_curve("quantum", 10, [3])


def test_command_quick(tmp_path, capsys):
    assert memory.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3.1546" in out and "1.3718" in out
    assert (tmp_path / "memory.png").stat().st_size > 1000

"""attnkit.theory.polynomial: exact degrees by finite differences, the degree of linear and
softmax attention, separation-rank lower bounds, and the d^(1/d) budget argument."""
import math

import pytest
import torch

import attnkit
from attnkit.theory import polynomial
from attnkit.theory.polynomial import (
    PolynomialLayer,
    best_integer_degree,
    degree_along_line,
    degree_efficiency,
    linear_attention_network,
    polynomial_network,
    separation_rank,
)


def _line(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, *shape, generator=g, dtype=torch.float64)


def test_polynomial_layer_is_product_of_linear_maps():
    layer = PolynomialLayer(5, 3, degree=3, dtype=torch.float64)
    x = torch.randn(7, 5, dtype=torch.float64)
    w = layer.weight
    want = (x @ w[0].t()) * (x @ w[1].t()) * (x @ w[2].t())
    assert torch.allclose(layer(x), want, rtol=1e-14, atol=0)
    assert sum(p.numel() for p in layer.parameters()) == 3 * 3 * 5
    # homogeneous of degree 3: P(c x) = c^3 P(x)
    assert torch.allclose(layer(2.5 * x), 2.5 ** 3 * layer(x), rtol=1e-13, atol=0)


@pytest.mark.parametrize("degree, depth", [(1, 3), (2, 1), (2, 2), (2, 3), (2, 4), (3, 1), (3, 2), (4, 1), (4, 2)])
def test_stack_of_degree_d_layers_has_degree_d_to_the_L(degree, depth):
    # Navon Eq. (16): deg(L_p ∘ … ∘ L_1) = d^p.  Three random lines, three random networks.
    for seed in range(3):
        torch.manual_seed(seed)
        net = polynomial_network(4, degree, depth, dtype=torch.float64)
        x0, u = _line(4, seed=seed)
        assert degree_along_line(net, x0, u, max_degree=18) == degree ** depth


def test_degree_along_line_exact_cases():
    x0 = torch.tensor([0.3, -1.0], dtype=torch.float64)
    u = torch.tensor([1.0, 0.5], dtype=torch.float64)
    assert degree_along_line(lambda x: x[0] * 0 + 2.0, x0, u) == 0
    assert degree_along_line(lambda x: x[0] ** 5 - x[1], x0, u) == 5
    assert degree_along_line(lambda x: x[0] ** 7 * x[1] ** 3, x0, u, max_degree=12) == 10
    # degree exactly max_degree is still found; one more is "not a polynomial of degree <= max"
    assert degree_along_line(lambda x: x[0] ** 6, x0, u, max_degree=6) == 6
    assert degree_along_line(lambda x: x[0] ** 7, x0, u, max_degree=6) is None
    assert degree_along_line(lambda x: torch.exp(x[0]), x0, u, max_degree=12) is None
    assert degree_along_line(torch.sin, x0, u, max_degree=10) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_linear_attention_has_degree_exactly_3(seed):
    # attnkit.linear_attention(feature_map="identity", normalize=False) with q = k = v = X:
    # (X Xᵀ) X, a cubic in X -- third difference nonzero, fourth … eleventh zero.  Also causal
    # and with a scale, and on odd sizes.
    x0, u = _line(2, 1, 7, 3, seed=seed)
    for causal in (False, True):
        f = lambda x: attnkit.linear_attention(x, x, x, feature_map="identity", normalize=False,  # noqa: E731
                                               causal=causal, scale=0.37)
        assert degree_along_line(f, x0, u, max_degree=10) == 3


def test_linear_attention_network_has_degree_3_to_the_L():
    for depth in (1, 2):
        f = linear_attention_network(depth, 3, seed=depth)
        x0, u = _line(1, 5, 3, seed=10 + depth)
        assert degree_along_line(f, x0, u, max_degree=12) == 3 ** depth


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_softmax_attention_is_not_a_polynomial_of_degree_at_most_10(seed):
    x0, u = _line(2, 1, 7, 3, seed=seed)
    f = lambda x: attnkit.softmax_attention(x, x, x)  # noqa: E731
    assert degree_along_line(f, x0, u, max_degree=10) is None
    # … while the identical code path with a linear map in place of softmax is a polynomial
    g = lambda x: (x @ x.transpose(-1, -2)) @ x  # noqa: E731
    assert degree_along_line(g, x0, u, max_degree=10) == 3


def test_separation_rank_grows_with_depth_of_linear_attention():
    # n = 4 positions of dim 2, split {0, 1} | {2, 3}, a 120 × 120 grid.  Seen (seed 0):
    #   depth 1: 6   (= 2 + 2·d_x: f = s_Aᵀ A T_A + s_Aᵀ A T_B + s_Bᵀ A T_A + s_Bᵀ A T_B, with
    #                 s = Σ_i x_i and T = Σ_j x_j x_jᵀ w split into their A and B parts)
    #   depth 2: 36  (σ_{r+1}/σ_r = 4e-14 at depth 1, 5e-10 at depth 2: clean gaps, the exact
    #                 ranks of M)
    #   depth 3: 83  (a lower bound: the spectrum decays smoothly past rtol, σ_84/σ_83 = 0.88)
    ranks = {}
    for depth in (1, 2, 3):
        r = separation_rank(linear_attention_network(depth, 2, seed=0), ([0, 1], [2, 3]), 120, dim=2, seed=0)
        ranks[depth] = r
    assert ranks[1].rank == 6
    assert ranks[2].rank == 36
    assert ranks[3].rank > 36
    for depth in (1, 2):  # a clean gap: these are the exact ranks of the matricization
        s = ranks[depth].singular_values
        k = ranks[depth].rank
        assert float(s[k] / s[k - 1]) < 1e-8
    assert ranks[3].rank < 120  # not limited by the grid


def test_separation_rank_of_a_separable_function_is_1():
    f = lambda x: torch.exp(x[:, :2].sum((1, 2))) * torch.cos(x[:, 2:]).prod(-1).prod(-1)  # noqa: E731
    r = separation_rank(f, ([0, 1], [2, 3]), 60, dim=2)
    assert r.rank == 1
    # a sum of two separable terms has rank 2; a polynomial coupling ⟨x_0, x_2⟩ of dim 3 has rank 3
    g = lambda x: x[:, 0, 0] * x[:, 3, 1] + torch.sin(x[:, 1, 0]) * x[:, 2, 1] ** 2  # noqa: E731
    assert separation_rank(g, ([0, 1], [2, 3]), 60, dim=2).rank == 2
    h = lambda x: (x[:, 0] * x[:, 2]).sum(-1)  # noqa: E731
    assert separation_rank(h, ([0, 1], [2, 3]), 60, dim=3).rank == 3
    # explicit template points and an interleaved split
    a, b = torch.randn(10, 2, 2, dtype=torch.float64), torch.randn(12, 2, 2, dtype=torch.float64)
    r = separation_rank(lambda x: x[:, 0, 0] * x[:, 1, 1], ([0, 2], [1, 3]), (a, b))
    assert r.shape == (10, 12) and r.rank == 1
    with pytest.raises(ValueError):
        separation_rank(f, ([0, 1], [1, 2, 3]), 10, dim=2)


def test_degree_three_is_the_best_integer_building_block():
    # Navon: argmax_d d^(1/d) is e over the reals, 3 over the integers (3² = 9 > 8 = 2³).
    assert best_integer_degree(20) == 3
    assert degree_efficiency(3) > degree_efficiency(2) == pytest.approx(degree_efficiency(4))
    assert degree_efficiency(3) ** 6 == pytest.approx(9) and degree_efficiency(2) ** 6 == pytest.approx(8)
    # the real maximum is at e: ln d / d has derivative (1 − ln d)/d², zero at e
    lo, hi = 2.0, 4.0
    for _ in range(100):  # ternary search on the unimodal d^(1/d)
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (m1, hi) if degree_efficiency(m1) < degree_efficiency(m2) else (lo, m2)
    assert (lo + hi) / 2 == pytest.approx(math.e, abs=1e-6)


def test_command_quick(tmp_path, capsys):
    assert polynomial.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "best integer degree: 3" in out
    assert (tmp_path / "polynomial.png").stat().st_size > 1000

"""attnkit.theory.icl: Zhang-Frei-Bartlett's LSA limit, von Oswald et al.'s GD step, Garg et al.'s
ICL curves -- every number the issue names, in float64 at small sizes.  Also the shared small
causal transformer (attnkit.theory._model) that the ICL command trains."""
import math

import pytest
import torch

import attnkit.theory.icl as icl
from attnkit.theory import _model
from attnkit.theory.icl import (
    LinearSelfAttention,
    gd_step_predict,
    gd_step_weights,
    icl_curve,
    monte_carlo_risk,
    prompt_matrix,
    sample_regression,
    train_lsa,
    train_zfb,
    zfb_init,
    zfb_limit,
    zfb_population_loss,
    zfb_population_prompts,
    zfb_predict,
    zfb_risk,
)

DT = torch.float64
D, N = 3, 10
LAMBDAS = {
    "isotropic": torch.ones(D, dtype=DT),
    "anisotropic": torch.tensor([1.0, 0.5, 0.25], dtype=DT),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# the layer runs on attnkit.linear_attention and computes ZFB's f(E)
# ----------------------------------------------------------------------------------------------


def test_lsa_is_zfb_formula_on_attnkit_linear_attention(monkeypatch):
    calls = []
    real = icl.linear_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(icl, "linear_attention", spy)
    d, M = 4, 7
    layer = LinearSelfAttention(d, init_std=0.5, generator=_gen(0))
    data = sample_regression(5, M, d, generator=_gen(1))
    E = prompt_matrix(data.X, data.y, data.x_q)  # rows = tokens
    out = layer(E)
    # ZFB (3.3) with tokens as columns: f(E) = E + W^PV E (E^T W^KQ E) / M
    Ec = E.transpose(1, 2)
    ref = Ec + layer.W_PV @ Ec @ (Ec.transpose(1, 2) @ layer.W_KQ @ Ec) / M
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    assert calls and calls[0]["feature_map"] == "identity" and calls[0]["normalize"] is False
    assert calls[0]["scale"] == pytest.approx(1 / M)
    # gradients through the op's backward = autograd of the formula
    g = torch.autograd.grad(layer.predict(E).pow(2).sum(), [layer.W_KQ, layer.W_PV])
    g_ref = torch.autograd.grad(ref[:, -1, -1].pow(2).sum(), [layer.W_KQ, layer.W_PV])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# Zhang, Frei & Bartlett
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LAMBDAS)
def test_population_prompts_give_the_exact_population_loss(name):
    """The cubature train_zfb descends on equals the closed-form population loss (weights of the
    form GD keeps), and the limit is its stationary point with loss ½·risk(M=N)."""
    lam = LAMBDAS[name]
    E, y_q = zfb_population_prompts(lam, N)
    g = _gen(2)
    for _ in range(3):
        W_KQ = torch.zeros(D + 1, D + 1, dtype=DT)
        W_PV = torch.zeros(D + 1, D + 1, dtype=DT)
        W_KQ[:D, :D] = torch.randn(D, D, generator=g, dtype=DT)
        W_PV[D, D] = torch.randn((), generator=g, dtype=DT)
        cub = 0.5 * (LinearSelfAttention(D, W_KQ, W_PV).predict(E) - y_q).pow(2).mean()
        assert float(cub.detach()) == pytest.approx(zfb_population_loss(W_KQ, W_PV, lam, N), rel=1e-12)
    limit = LinearSelfAttention(D, *zfb_limit(lam, N))
    loss = 0.5 * (limit.predict(E) - y_q).pow(2).mean()
    assert float(loss.detach()) == pytest.approx(0.5 * zfb_risk(lam, N, N), rel=1e-12)
    grads = torch.autograd.grad(loss, [limit.W_KQ, limit.W_PV])
    assert max(float(gr.abs().max()) for gr in grads) < 1e-12


@pytest.fixture(scope="module")
def trained_zfb():
    """GD (lr 0.2, float64) from zfb_init on the exact population loss, d=3, N=10."""
    return {name: train_zfb(lam, N, lr=0.2, steps=800, seed=0, record_every=100) for name, lam in LAMBDAS.items()}


@pytest.mark.parametrize("name", LAMBDAS)
def test_gd_from_zfb_init_converges_to_zfb_limit(trained_zfb, name):
    model, hist = trained_zfb[name]
    target = zfb_limit(LAMBDAS[name], N)
    W_KQ, W_PV = model.weights()
    dist = float(torch.linalg.matrix_norm(torch.cat([W_KQ - target[0], W_PV - target[1]]))
                 / torch.linalg.matrix_norm(torch.cat(target)))
    print(f"{name}: relative Frobenius distance to zfb_limit {hist['distance'][0]:.3f} -> {dist:.2e} "
          f"after {hist['step'][-1] + 1} steps")
    assert hist["distance"][0] > 0.9  # it starts far away
    assert dist < 1e-2
    # and it is of the paper's form: only W^KQ_11 and W^PV_22 nonzero
    assert int((W_PV != 0).sum()) == 1 and float(W_PV[D, D]) > 0
    assert float(W_KQ[D].abs().max()) == 0 and float(W_KQ[:, D].abs().max()) == 0


@pytest.mark.parametrize("name", LAMBDAS)
def test_trained_predictions_match_closed_form(trained_zfb, name):
    lam = LAMBDAS[name]
    model, _ = trained_zfb[name]
    for M in (N, 4, 3 * N):  # fresh prompts, also of other lengths
        data = sample_regression(2000, M, D, Lambda=lam, generator=_gen(100 + M))
        with torch.no_grad():
            pred = model.predict(prompt_matrix(data.X, data.y, data.x_q))
        closed = zfb_predict(data.X, data.y, data.x_q, lam, N)
        rel = float((pred - closed).norm() / closed.norm())
        print(f"{name} M={M}: relative difference to x_q^T Γ^-1 (1/M Σ y_i x_i): {rel:.1e}")
        assert rel < 1e-6


@pytest.mark.parametrize("M", [N, 3, 4 * N])
@pytest.mark.parametrize("name", LAMBDAS)
def test_limit_risk_monte_carlo_matches_paper(name, M):
    lam = LAMBDAS[name]
    limit = LinearSelfAttention(D, *zfb_limit(lam, N))
    mean, se = monte_carlo_risk(limit.predict, lam, M, 50000, seed=1000 + M)
    theory = zfb_risk(lam, N, M)
    print(f"{name} N={N} M={M}: paper {theory:.5f}, Monte Carlo {mean:.5f} ± {se:.5f} (z = {(mean - theory) / se:+.2f})")
    assert abs(mean - theory) < 3 * se


def test_zfb_init_is_the_papers():
    W_KQ, W_PV = zfb_init(D, 0.05, LAMBDAS["anisotropic"], generator=_gen(3))
    assert float(torch.linalg.matrix_norm(W_KQ[:D, :D])) == pytest.approx(0.05, rel=1e-12)  # σ‖ΘΘᵀ‖_F, ‖ΘΘᵀ‖_F = 1
    assert torch.linalg.eigvalsh(W_KQ[:D, :D]).min() > -1e-15  # ΘΘᵀ is PSD
    assert float(W_PV[D, D]) == 0.05 and int((W_PV != 0).sum()) == 1
    assert float(W_KQ[D].abs().sum() + W_KQ[:, D].abs().sum()) == 0


# ----------------------------------------------------------------------------------------------
# von Oswald et al.
# ----------------------------------------------------------------------------------------------


def test_gd_step_weights_compute_one_gd_step():
    d, M, eta = 5, 9, 0.37
    data = sample_regression(64, M, d, generator=_gen(4))
    layer = LinearSelfAttention(d, *gd_step_weights(d, eta))
    pred = layer.predict(prompt_matrix(data.X, data.y, data.x_q))
    explicit = eta / M * torch.einsum("bn,bnd,bd->b", data.y, data.X, data.x_q)
    torch.testing.assert_close(pred, explicit, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gd_step_predict(data.X, data.y, data.x_q, eta), explicit, rtol=1e-12, atol=1e-12)
    # ... which is w_1^T x_q for w_1 = 0 - eta * grad of 1/(2M) Σ (w^T x_i - y_i)^2 at w = 0
    w0 = torch.zeros(64, d, dtype=DT, requires_grad=True)
    loss = 0.5 / M * (torch.einsum("bnd,bd->bn", data.X, w0) - data.y).pow(2).sum()
    (grad,) = torch.autograd.grad(loss, [w0])
    torch.testing.assert_close(pred, ((w0 - eta * grad) * data.x_q).sum(-1), rtol=1e-12, atol=1e-12)


def test_trained_lsa_reaches_best_gd_step():
    r = train_lsa(3, 10, steps=800, batch=256, lr=0.03, eval_prompts=20000, seed=0)
    print(f"LSA loss {r.loss:.5f} vs best GD step {r.gd_loss:.5f} (η* = {r.gd_eta:.4f}): ratio {r.loss_ratio:.4f}; "
          f"cos(T, T_GD) = {r.cosine:.5f}, η_eff = {r.eta_eff:.4f}")
    assert abs(r.loss_ratio - 1) < 0.05
    assert r.cosine > 0.99
    assert abs(r.eta_eff / r.gd_eta - 1) < 0.05


# ----------------------------------------------------------------------------------------------
# Garg et al.
# ----------------------------------------------------------------------------------------------


def test_icl_curve_least_squares_is_one_minus_k_over_d():
    d, ks = 5, [0, 1, 2, 3, 4, 5, 6, 8]
    means, ses = icl_curve("least_squares", d, ks, n_prompts=20000, seed=0, return_se=True)
    for k, m, s in zip(ks, means, ses):
        print(f"k={k}: least squares {m:.4f} ± {s:.4f}, theory {max(0.0, 1 - k / d):.3f}")
        if k < d:
            assert abs(m - (1 - k / d)) < 3 * s
        else:
            assert m < 1e-20  # exact recovery, up to round-off


def test_icl_curve_averaging_and_knn():
    d, ks = 5, [1, 2, 5, 10]
    # averaging: ŵ = (1/k) Σ y_i x_i has E‖ŵ - w‖²/d = (d + 1)/k for Gaussian x (Wishart second moment)
    means, ses = icl_curve("averaging", d, ks, n_prompts=4000, seed=0, return_se=True)
    for k, m, s in zip(ks, means, ses):
        assert abs(m - (d + 1) / k) < 3 * s
    knn = icl_curve("knn3", d, [0, 3, 30], n_prompts=2000, seed=0)
    assert knn[0] == pytest.approx(icl_curve("least_squares", d, [0], n_prompts=2000, seed=0)[0])  # both predict 0
    assert knn[2] < knn[1]
    # a callable predictor works the same way as a name
    assert icl_curve(icl.averaging_predict, d, ks, n_prompts=4000, seed=0) == means


# ----------------------------------------------------------------------------------------------
# the shared small causal transformer
# ----------------------------------------------------------------------------------------------


def test_tiny_transformer_is_causal_and_runs_on_attnkit(monkeypatch):
    calls = []
    real = _model.softmax_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_model, "softmax_attention", spy)
    torch.manual_seed(0)
    model = _model.TinyCausalTransformer(4, 16, 2, 2, 3, 9, dtype=DT)
    x = torch.randn(3, 9, 4, dtype=DT)
    y = model(x)
    assert y.shape == (3, 9, 3)
    assert len(calls) == 2 and all(c["is_causal"] for c in calls)
    x2 = x.clone()
    x2[:, 5:] += 1.0
    torch.testing.assert_close(model(x2)[:, :5], y[:, :5], rtol=0, atol=0)
    # the kernel's forward and backward agree with the pure-PyTorch reference backend
    ref = _model.TinyCausalTransformer(4, 16, 2, 2, 3, 9, dtype=DT, backend="reference")
    ref.load_state_dict(model.state_dict())
    y_ref = ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(y.square().sum(), list(model.parameters()))
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(ref.parameters()))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_icl_token_formats():
    data = sample_regression(2, 4, 3, generator=_gen(6))
    g = icl.garg_tokens(data.X, data.y)
    p = icl.paired_tokens(data.X, data.y)
    assert g.shape == (2, 8, 4) and p.shape == (2, 4, 4)
    torch.testing.assert_close(g[:, 0::2, :3], data.X)
    torch.testing.assert_close(g[:, 1::2, 3], data.y)
    assert float(g[:, 0::2, 3].abs().max()) == 0 and float(g[:, 1::2, :3].abs().max()) == 0
    torch.testing.assert_close(p[:, :, :3], data.X)
    torch.testing.assert_close(p[:, 1:, 3], data.y[:, :-1])
    assert float(p[:, 0, 3].abs().max()) == 0


@pytest.mark.parametrize("tokens", ["paired", "garg"])
def test_icl_transformer_trains_and_predicts(tokens):
    model, losses = icl.train_icl_transformer(d=3, n_points=6, d_model=16, n_layers=1, n_heads=2, steps=60,
                                              batch=32, lr=3e-3, tokens=tokens, progress=False, dtype=DT)
    assert len(losses) == 60 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < sum(losses[:10])
    predict = icl.transformer_predictor(model)
    curve = icl_curve(predict, 3, [0, 2, 5], n_prompts=200)
    assert all(math.isfinite(v) for v in curve)
    # the predictor reads the same output the training loss uses: the last example's prediction
    data = sample_regression(8, 5, 3, generator=_gen(7))
    with torch.no_grad():
        full = icl._transformer_outputs(model, data.X, data.y, tokens)
    torch.testing.assert_close(predict(data.X[:, :4], data.y[:, :4], data.X[:, 4]), full[:, 4], rtol=1e-12, atol=1e-12)

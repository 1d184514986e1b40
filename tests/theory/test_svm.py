"""attnkit.theory.svm: attention as a max-margin token selector (Tarzanagh, Li, Thrampoulidis &
Oymak 2023) on attnkit.softmax_attention, float64."""
import pytest
import torch

import attnkit.theory.svm as svm
from attnkit.theory.svm import (
    att_svm,
    attention_output,
    correlation,
    direction_convergence,
    logistic_loss,
    optimal_tokens,
    p_svm,
    regularization_path,
    tlto_data,
    train_attention,
)

DT = torch.float64


def test_attention_output_is_softmax_formula_on_attnkit(monkeypatch):
    calls = []
    real = svm.softmax_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(svm, "softmax_attention", spy)
    data = tlto_data(0, n=5, T=7, d=6)
    W = torch.randn(6, 6, dtype=DT, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    p = torch.einsum("ab,nb->na", W, data.z)
    out, probs = attention_output(data.X, p, return_probs=True)
    s = torch.softmax(torch.einsum("ntd,nd->nt", data.X, p), -1)
    torch.testing.assert_close(out, torch.einsum("nt,ntd->nd", s, data.X), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(probs, s.detach(), rtol=1e-12, atol=1e-14)
    assert calls and calls[0]["scale"] == 1.0
    # the loss's gradient through the op's backward = autograd of the plain formula
    (g,) = torch.autograd.grad(logistic_loss(W, data), [W])
    f = torch.einsum("nt,ntd,d->n", s, data.X, data.v)
    (g_ref,) = torch.autograd.grad(torch.nn.functional.softplus(-data.Y * f).mean(), [W])
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-14)


def test_att_svm_solves_the_qp():
    data = tlto_data(0)
    opt = optimal_tokens(data)
    W = att_svm(data.X, data.z, opt)
    margins = torch.stack([
        (data.X[i, opt[i]] - data.X[i, t]) @ W @ data.z[i]
        for i in range(data.X.shape[0]) for t in range(data.X.shape[1]) if t != opt[i]
    ])
    assert float(margins.min()) > 1 - 1e-9  # feasible
    assert float(margins.min()) < 1 + 1e-9  # some constraints active (else W could shrink)
    # two independent scipy solvers agree: the NNLS (Lawson-Hanson) default and SLSQP
    W2 = att_svm(data.X, data.z, opt, method="slsqp")
    assert float((W - W2).norm() / W.norm()) < 1e-6
    # one constraint: W^mm = a / ‖a‖² with a = (x_opt - x_t) z^T
    X = torch.tensor([[[1.0, 0.0], [0.2, 0.7]]], dtype=DT)
    z = torch.tensor([[0.6, 0.8]], dtype=DT)
    a = torch.outer(X[0, 0] - X[0, 1], z[0])
    torch.testing.assert_close(att_svm(X, z, torch.tensor([0])), a / a.pow(2).sum(), rtol=1e-10, atol=1e-12)
    p = p_svm(X, torch.tensor([0]))
    u = X[0, 0] - X[0, 1]
    torch.testing.assert_close(p, u / u.pow(2).sum(), rtol=1e-10, atol=1e-12)
    # infeasible: the selected token is a convex combination... here simply identical to another
    with pytest.raises(ValueError):
        att_svm(torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], dtype=DT), z, torch.tensor([0]))


def test_normalized_gd_converges_in_direction_to_att_svm():
    """TLTO's local-convergence setup: n=6, T=8, d=10, normalized GD step 0.1, 20 seeds,
    opt_i = the token the trained attention selects."""
    r = direction_convergence(20, n=6, T=8, d=10, steps=2000, lr=0.1, checkpoints=(10, 100, 1000, 2000))
    print("mean corr(W_k, W^mm) at k = 10/100/1000/2000: "
          + " / ".join(f"{c:.4f}" for c in r.mean_correlation)
          + f"; min over seeds at 2000: {float(r.correlations[:, -1].min()):.4f}; "
          f"mean selected-token probability {float(r.max_prob.mean()):.4f}; "
          f"fraction of globally optimal selections {float(r.globally_optimal.mean()):.2f}")
    assert r.mean_correlation[-1] >= 0.99
    assert all(a < b for a, b in zip(r.mean_correlation, r.mean_correlation[1:]))
    assert float(r.max_prob.min()) > 0.99  # the attention has become a token selector


def test_regularization_path_approaches_W_mm():
    radii = [1, 2, 4, 8, 16, 32, 64]
    for seed in range(3):
        data = tlto_data(seed)
        W_mm = att_svm(data.X, data.z, optimal_tokens(data))
        sols, losses = regularization_path(data, radii)
        corr = [float(correlation(W, W_mm)) for W in sols]
        print(f"seed {seed}: corr(W̄_R, W^mm) at R = {radii}: " + " ".join(f"{c:.4f}" for c in corr))
        assert all(b >= a - 1e-6 for a, b in zip(corr, corr[1:]))
        assert corr[-1] > 0.99
        assert all(b <= a + 1e-12 for a, b in zip(losses, losses[1:]))  # a bigger ball, a lower loss
        norms = sols.flatten(1).norm(dim=1)
        torch.testing.assert_close(norms, torch.tensor(radii, dtype=DT), rtol=1e-9, atol=0)


def test_single_vector_variant_and_plain_gd():
    # p-parameterization: the same picture for softmax(X p) and p_svm
    r = direction_convergence(8, steps=2000, checkpoints=(10, 100, 1000, 2000), variant="p")
    print("p variant (8 seeds), mean corr(p_k, p^mm) at k = 10/100/1000/2000:",
          " / ".join(f"{c:.4f}" for c in r.mean_correlation))
    assert r.mean_correlation[-1] >= 0.99
    assert all(a < b for a, b in zip(r.mean_correlation, r.mean_correlation[1:]))
    # plain (unnormalized) GD decreases the loss and grows ‖W‖
    data = tlto_data(1)
    W0 = torch.zeros(10, 10, dtype=DT)
    W, rec, _ = train_attention(data, W0, steps=50, lr=1.0, normalized=False, record=(1, 50))
    assert float(logistic_loss(W, data)) < float(logistic_loss(rec[1], data))
    assert float(W.norm()) > float(rec[1].norm())

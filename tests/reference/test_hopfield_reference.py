"""The reference Hopfield update and energy (pytorch_ext/reference/hopfield.py) against an
independent float64 computation: a Python loop over every (batch, head, query) row that
runs the update one row at a time and stops a row with ``break`` (the reference masks)."""
import math

import pytest
import torch

from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference

F64 = torch.float64


def _softmax_row(scores):
    """Softmax of a 1-D float64 tensor, written out."""
    m = max(scores.tolist())
    w = torch.exp(scores - m)
    return w / w.sum()


def _loop_update(state, stored, beta, steps, values=None, tol=None):
    """Row by row: up to ``steps`` (or steps-1) updates, stopping a row once its change <= tol."""
    b_, h_, s_, _ = state.shape
    out_dim = stored.shape[-1] if values is None else values.shape[-1]
    out = torch.empty(b_, h_, s_, out_dim, dtype=F64)
    updates = steps if values is None else steps - 1
    for b in range(b_):
        for h in range(h_):
            x = stored[b, h].to(F64)
            for s in range(s_):
                xi = state[b, h, s].to(F64).clone()
                for _ in range(updates):
                    p = _softmax_row(beta * torch.mv(x, xi))
                    new = torch.mv(x.T, p)
                    change = (new - xi).abs().max().item()
                    xi = new
                    if tol is not None and change <= tol:
                        break
                if values is not None:
                    p = _softmax_row(beta * torch.mv(x, xi))
                    xi = torch.mv(values[b, h].to(F64).T, p)
                out[b, h, s] = xi
    return out


def _loop_energy(state, stored, beta):
    b_, h_, s_, _ = state.shape
    n = stored.shape[2]
    out = torch.empty(b_, h_, s_, dtype=F64)
    for b in range(b_):
        for h in range(h_):
            x = stored[b, h].to(F64)
            big_m = max(math.sqrt(float(row @ row)) for row in x)
            for s in range(s_):
                xi = state[b, h, s].to(F64)
                scores = [beta * float(row @ xi) for row in x]
                top = max(scores)
                lse = top + math.log(sum(math.exp(v - top) for v in scores))
                out[b, h, s] = -lse / beta + 0.5 * float(xi @ xi) + math.log(n) / beta + 0.5 * big_m**2
    return out


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("s", [1, 7])
@pytest.mark.parametrize("n", [1, 300])
@pytest.mark.parametrize("d", [16, 64])
def test_update_matches_row_loop(steps, with_values, s, n, d):
    state = torch.randn(1, 2, s, d, dtype=F64)
    stored = torch.randn(1, 2, n, d, dtype=F64)
    values = torch.randn(1, 2, n, 5, dtype=F64) if with_values else None
    beta = 1.0 / math.sqrt(d)
    got = hopfield_update_reference(state, stored, steps=steps, values=values)  # default beta
    want = _loop_update(state, stored, beta, steps, values)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("tol", [0.0, 1e-3, 0.05, 0.5])
def test_update_with_tol_matches_row_loop(with_values, tol):
    state = torch.randn(2, 2, 7, 16, dtype=F64)
    stored = torch.randn(2, 2, 30, 16, dtype=F64)
    # Rows starting next to a pattern converge at once; random ones take several updates, so
    # each tol here freezes rows at different steps.
    state[1, 1, :4] = stored[1, 1, :4] * 1.01
    values = torch.randn(2, 2, 30, 3, dtype=F64) if with_values else None
    got = hopfield_update_reference(state, stored, beta=0.7, steps=4, values=values, tol=tol)
    want = _loop_update(state, stored, 0.7, 4, values, tol)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tol_freezes_a_converged_query_while_others_keep_moving():
    stored = torch.randn(1, 1, 20, 16, dtype=F64)
    state = torch.stack([stored[0, 0, 0], 0.05 * torch.randn(16, dtype=F64)]).view(1, 1, 2, 16)
    beta = 1.0
    traj = [state]
    for _ in range(3):
        traj.append(hopfield_update_reference(traj[-1], stored, beta=beta))
    change = [(traj[t + 1] - traj[t]).abs().amax(-1)[0, 0] for t in range(3)]
    # Preconditions of the scenario: row 0 (a stored pattern) moves little in its first
    # update and more after it (so freezing it is visible); row 1 keeps moving a lot.
    tol = 2 * change[0][0].item()
    assert change[0][1] > tol and change[1][1] > tol
    assert not torch.equal(traj[3][0, 0, 0], traj[1][0, 0, 0])
    got = hopfield_update_reference(state, stored, beta=beta, steps=3, tol=tol)
    assert torch.equal(got[0, 0, 0], traj[1][0, 0, 0])  # frozen after its first update
    assert torch.equal(got[0, 0, 1], traj[3][0, 0, 1])  # all three updates


def test_tol_zero_equals_no_tol_and_huge_tol_stops_after_one_update():
    state = torch.randn(2, 3, 7, 16, dtype=F64)
    stored = torch.randn(2, 3, 40, 16, dtype=F64)
    values = torch.randn(2, 3, 40, 4, dtype=F64)
    none = hopfield_update_reference(state, stored, beta=2.0, steps=5)
    assert torch.equal(hopfield_update_reference(state, stored, beta=2.0, steps=5, tol=0.0), none)
    one = hopfield_update_reference(state, stored, beta=2.0, steps=1)
    assert torch.equal(hopfield_update_reference(state, stored, beta=2.0, steps=5, tol=1e9), one)
    assert not torch.equal(none, one)
    # With values tol acts on the steps-1 stored-space updates; the retrieval always runs.
    two = hopfield_update_reference(state, stored, beta=2.0, steps=2, values=values)
    assert torch.equal(hopfield_update_reference(state, stored, beta=2.0, steps=6, values=values, tol=1e9), two)


@pytest.mark.parametrize("s,n,d", [(1, 1, 16), (7, 300, 64), (7, 1, 64), (1, 300, 16)])
@pytest.mark.parametrize("beta", [0.01, 1.0, 10.0])
def test_energy_matches_row_loop(s, n, d, beta):
    state = torch.randn(2, 2, s, d, dtype=F64)
    stored = torch.randn(2, 2, n, d, dtype=F64)
    got = hopfield_energy_reference(state, stored, beta)
    want = _loop_energy(state, stored, beta)
    assert got.dtype == F64 and got.shape == (2, 2, s)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_energy_is_nonnegative_and_zero_in_the_limit_at_the_max_norm_pattern():
    stored = torch.randn(3, 2, 50, 16, dtype=F64)
    state = torch.randn(3, 2, 9, 16, dtype=F64) * 3
    assert (hopfield_energy_reference(state, stored, 0.5) >= 0).all()
    # At ξ = x_{i*} (largest norm) and β → ∞, E → 0: E = β⁻¹ log N + O(e^{-β gap}).
    top = stored.pow(2).sum(-1).argmax(-1)
    at_top = torch.gather(stored, 2, top[:, :, None, None].expand(3, 2, 1, 16))
    e = hopfield_energy_reference(at_top, stored, 1e4)
    assert (e >= 0).all() and (e < 1e-3).all()


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_energy_never_rises_along_the_updates(beta):
    # The update is the CCCP step of this energy (Ramsauer et al. 2020, Theorem 1): E(ξ_{t+1}) <= E(ξ_t).
    stored = torch.randn(2, 2, 50, 16, dtype=F64)
    xi = torch.randn(2, 2, 7, 16, dtype=F64) * 2
    energies = [hopfield_energy_reference(xi, stored, beta)]
    for _ in range(8):
        xi = hopfield_update_reference(xi, stored, beta=beta)
        energies.append(hopfield_energy_reference(xi, stored, beta))
    for before, after in zip(energies, energies[1:]):
        assert (after <= before + 1e-12 * (1 + before.abs())).all()
    # Random starts are not fixed points: the first update lowers every energy.
    assert (energies[1] < energies[0] - 1e-6).all()


def _noisy_patterns(num_patterns=1000, dim=128, queries=40, flip=0.1):
    patterns = torch.randint(0, 2, (1, 1, num_patterns, dim), dtype=F64) * 2 - 1
    idx = torch.randperm(num_patterns)[:queries]
    targets = patterns[:, :, idx]
    flips = torch.zeros(1, 1, queries, dim, dtype=torch.bool)
    n_flip = round(flip * dim)
    for q in range(queries):
        flips[0, 0, q, torch.randperm(dim)[:n_flip]] = True
    return patterns, targets, torch.where(flips, -targets, targets)


def test_one_step_retrieval_of_noisy_binary_patterns():
    # β = 1 with unnormalized ±1 patterns: the target scores 128 − 2·13 = 102, the others
    # ~N(0, 128) (max over 1000 ≈ 40), so one update lands on the target.
    patterns, targets, noisy = _noisy_patterns()
    out = hopfield_update_reference(noisy, patterns, beta=1.0)
    assert torch.equal(out.sign(), targets)
    # Control: at a temperature this high the update only averages, and retrieval fails.
    blurred = hopfield_update_reference(noisy, patterns, beta=1e-3)
    assert not torch.equal(blurred.sign(), targets)


def test_low_precision_runs_in_the_given_dtype():
    state = torch.randn(1, 2, 7, 16)
    stored = torch.randn(1, 2, 30, 16)
    for dtype in (torch.bfloat16, torch.float16):
        out = hopfield_update_reference(state.to(dtype), stored.to(dtype), steps=2)
        e = hopfield_energy_reference(state.to(dtype), stored.to(dtype), 0.5)
        assert out.dtype == dtype and e.dtype == dtype
        assert torch.isfinite(out).all() and torch.isfinite(e).all()


@pytest.mark.parametrize("with_values", [False, True])
@pytest.mark.parametrize("tol", [None, 1e-3])
def test_return_energy_is_the_energy_of_each_stored_space_state(with_values, tol):
    state = torch.randn(1, 2, 4, 6, dtype=F64)
    stored = torch.randn(1, 2, 9, 6, dtype=F64) * 2
    values = torch.randn(1, 2, 9, 3, dtype=F64) if with_values else None
    out, energy = hopfield_update_reference(state, stored, beta=0.7, steps=3, values=values, tol=tol,
                                            return_energy=True)
    assert energy.shape == (4, 1, 2, 4)
    torch.testing.assert_close(out, _loop_update(state, stored, 0.7, 3, values, tol))
    # State k of the stored-space trajectory, row by row (with values too: the last entry is the
    # stored-space update of the state the read-out starts from).
    for k in range(4):
        xi_k = state if k == 0 else _loop_update(state, stored, 0.7, k, None, tol)
        torch.testing.assert_close(energy[k], _loop_energy(xi_k, stored, 0.7))
    assert (energy[1:] <= energy[:-1] + 1e-12).all()

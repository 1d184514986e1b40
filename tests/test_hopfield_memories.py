"""attnkit.hopfield: classical Hopfield network and dense associative memories."""
import itertools
import math

import pytest
import torch

from attnkit.hopfield import ClassicalHopfield, DenseAssociativeMemory


def _patterns(p, d, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (p, d), generator=g) * 2 - 1).to(dtype)


def _flip(x, frac, seed=1):
    g = torch.Generator().manual_seed(seed)
    return x * torch.where(torch.rand(x.shape, generator=g) < frac, -1.0, 1.0).to(x.dtype)


MEMORIES = [
    ("classical", lambda xi: ClassicalHopfield(xi)),
    ("poly2", lambda xi: DenseAssociativeMemory(xi, "poly", 2)),
    ("poly3", lambda xi: DenseAssociativeMemory(xi, "poly", 3)),
    ("poly4_rect", lambda xi: DenseAssociativeMemory(xi, "poly", 4, rectified=True)),
    ("exp", lambda xi: DenseAssociativeMemory(xi, "exp")),
    ("exp_beta", lambda xi: DenseAssociativeMemory(xi, "exp", beta=0.3)),
]


# -- explicit, unvectorized versions of the rules (the ground truth) --------------------------------

def _explicit_field_classical(xi, s, i):
    """h_i = (1/d) Σ_μ Σ_{j≠i} ξ^μ_i ξ^μ_j σ_j, looped over patterns."""
    p, d = xi.shape
    h = 0.0
    for mu in range(p):
        h += xi[mu, i].item() * sum(xi[mu, j].item() * s[j].item() for j in range(d) if j != i)
    return h / d


def _explicit_diff_dense(xi, s, i, f):
    """Σ_μ F(ξ^μ_i + Σ_{j≠i} ξ^μ_j σ_j) − F(−ξ^μ_i + Σ_{j≠i} ξ^μ_j σ_j), in Python floats."""
    p, d = xi.shape
    total = 0.0
    for mu in range(p):
        rest = sum(xi[mu, j].item() * s[j].item() for j in range(d) if j != i)
        total += f(xi[mu, i].item() + rest) - f(-xi[mu, i].item() + rest)
    return total


def _explicit_sync(xi, s, decide):
    new = s.clone()
    for i in range(xi.shape[1]):
        v = decide(s, i)
        new[i] = s[i] if v == 0 else math.copysign(1.0, v)
    return new


def _explicit_async(xi, s, decide):
    s = s.clone()
    for i in range(xi.shape[1]):
        v = decide(s, i)
        if v != 0:
            s[i] = math.copysign(1.0, v)
    return s


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["classical", "poly3", "poly4_rect", "exp"])
def test_update_matches_explicit_rule(kind, mode):
    xi = _patterns(5, 11, seed=3)
    probes = _flip(xi[:3], 0.3, seed=4)
    probes = torch.cat([probes, _patterns(2, 11, seed=5)])
    if kind == "classical":
        mem = ClassicalHopfield(xi)
        decide = lambda s, i: _explicit_field_classical(xi, s, i)  # noqa: E731
    else:
        if kind == "poly3":
            mem, f = DenseAssociativeMemory(xi, "poly", 3), lambda z: z ** 3
        elif kind == "poly4_rect":
            mem, f = DenseAssociativeMemory(xi, "poly", 4, rectified=True), lambda z: max(z, 0.0) ** 4
        else:
            mem, f = DenseAssociativeMemory(xi, "exp", beta=0.7), lambda z: math.exp(0.7 * z)
        decide = lambda s, i: _explicit_diff_dense(xi, s, i, f)  # noqa: E731
    got = mem.update(probes, mode=mode)
    step = _explicit_sync if mode == "sync" else _explicit_async
    want = torch.stack([step(xi, s, decide) for s in probes])
    assert torch.equal(got, want)


def test_energy_matches_explicit():
    xi = _patterns(4, 9, seed=2)
    s = _patterns(3, 9, seed=7)
    w = sum(torch.outer(x, x) for x in xi) / 9
    w.fill_diagonal_(0)
    want = torch.stack([-0.5 * (v @ w @ v) for v in s])
    torch.testing.assert_close(ClassicalHopfield(xi).energy(s), want, rtol=1e-12, atol=1e-12)
    m = s @ xi.t()
    torch.testing.assert_close(DenseAssociativeMemory(xi, "poly", 3).energy(s), -(m ** 3).sum(-1))
    torch.testing.assert_close(DenseAssociativeMemory(xi, "poly", 3, rectified=True).energy(s),
                               -(m.clamp_min(0) ** 3).sum(-1))
    torch.testing.assert_close(DenseAssociativeMemory(xi, "exp", beta=0.5).energy(s), -torch.exp(0.5 * m).sum(-1))


def test_classical_weights_hebbian_zero_diagonal():
    xi = _patterns(6, 13)
    w = ClassicalHopfield(xi).weight
    want = torch.zeros(13, 13, dtype=torch.float64)
    for x in xi:
        for i, j in itertools.product(range(13), range(13)):
            if i != j:
                want[i, j] += x[i] * x[j] / 13
    torch.testing.assert_close(w, want)


def test_dense_degree2_equals_classical():
    """F(z) = z² gives exactly the classical rule (same sign of the local field, same ties)."""
    xi = _patterns(30, 40, seed=11)  # high load: many disagreements and exact ties
    probes = _patterns(50, 40, seed=12)
    c, dn = ClassicalHopfield(xi), DenseAssociativeMemory(xi, "poly", 2)
    for mode in ("sync", "async"):
        assert torch.equal(c.update(probes, mode=mode, steps=3), dn.update(probes, mode=mode, steps=3))


@pytest.mark.parametrize("name,make", MEMORIES, ids=[m[0] for m in MEMORIES])
def test_energy_never_increases_async(name, make):
    xi = _patterns(20, 48, seed=5)
    mem = make(xi)
    s = _patterns(64, 48, seed=6)
    g = torch.Generator().manual_seed(0)
    e = mem.energy(s)
    for _ in range(6):
        new = mem.update(s, mode="async", generator=g)
        e_new = mem.energy(new)
        assert (e_new <= e + 1e-9 * e.abs().clamp_min(1)).all()
        changed = (new != s).any(-1)
        assert (e_new[changed] < e[changed]).all()  # a flip always strictly lowers E
        s, e = new, e_new
    # After enough sweeps the asynchronous dynamics has reached fixed points.
    assert torch.equal(mem.update(s, mode="async", steps=None), mem.update(mem.update(s, mode="async", steps=None),
                                                                        mode="async"))


@pytest.mark.parametrize("name,make", MEMORIES, ids=[m[0] for m in MEMORIES])
def test_stored_patterns_fixed_points_at_low_load(name, make):
    xi = _patterns(5, 100, seed=8)  # P = 0.05 d
    mem = make(xi)
    for mode in ("sync", "async"):
        assert torch.equal(mem.update(xi, mode=mode), xi)


def test_classical_capacity():
    d = 200
    low = _patterns(10, d, seed=21)  # P = 0.05 d: well below 0.14 d
    out = ClassicalHopfield(low).update(_flip(low, 0.1), steps=None)
    assert torch.equal(out, low)
    high = _patterns(100, d, seed=22)  # P = 0.5 d: far beyond capacity
    net = ClassicalHopfield(high)
    out = net.update(_flip(high, 0.1), steps=None)
    assert (out == high).all(-1).float().mean() <= 0.05
    # Not even the stored patterns themselves are stable there.
    assert (net.update(high) == high).all(-1).float().mean() <= 0.05


@pytest.mark.parametrize("interaction,degree,p", [("poly", 3, 64), ("poly", 4, 256), ("exp", 1, 1000)])
def test_dense_capacity_beyond_classical(interaction, degree, p):
    d = 64
    xi = _patterns(p, d, seed=31)  # p/d = 1, 4, 15.6: all far beyond 0.14 d
    noisy = _flip(xi, 0.1, seed=32)
    out = DenseAssociativeMemory(xi, interaction, degree).update(noisy, steps=None)
    assert (out == xi).all(-1).float().mean() >= 0.99
    assert (DenseAssociativeMemory(xi, interaction, degree).update(xi) == xi).all(-1).float().mean() >= 0.99
    # The classical network at the same load retrieves almost nothing.
    classical = ClassicalHopfield(xi).update(noisy, steps=None)
    assert (classical == xi).all(-1).float().mean() <= 0.05


@pytest.mark.parametrize("name,make", MEMORIES, ids=[m[0] for m in MEMORIES])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_batched_equals_looped(name, make, mode):
    xi = _patterns(12, 33, seed=41)
    mem = make(xi)
    probes = _flip(xi[torch.arange(20) % 12], 0.25, seed=42)
    batched = mem.update(probes, mode=mode, steps=2, generator=torch.Generator().manual_seed(5))
    looped = torch.stack([mem.update(p, mode=mode, steps=2, generator=torch.Generator().manual_seed(5))
                          for p in probes])
    assert torch.equal(batched, looped)
    assert torch.equal(mem.energy(probes), torch.stack([mem.energy(p) for p in probes]))


def test_leading_dims_dtype_and_noncontiguous():
    xi = _patterns(8, 20, seed=51)
    mem = DenseAssociativeMemory(xi, "poly", 3)
    probes = _patterns(6, 20, seed=52).float()
    flat = mem.update(probes, mode="async", steps=2)
    assert flat.dtype == torch.float32
    assert torch.equal(mem.update(probes.view(2, 3, 20), mode="async", steps=2), flat.view(2, 3, 20))
    nc = probes.t().contiguous().t()
    assert not nc.is_contiguous()
    assert torch.equal(mem.update(nc, mode="async", steps=2), flat)
    c = ClassicalHopfield(xi.float())
    assert torch.equal(c.update(probes.double()), c.update(probes).double())


def test_steps_semantics_and_generator():
    xi = _patterns(10, 30, seed=61)
    mem = ClassicalHopfield(xi)
    s = _patterns(4, 30, seed=62)
    assert torch.equal(mem.update(s, steps=0), s)
    assert torch.equal(mem.update(s, steps=2), mem.update(mem.update(s)))
    fixed = mem.update(s, mode="async", steps=None)
    assert torch.equal(mem.update(fixed, mode="async"), fixed)
    a = mem.update(s, mode="async", generator=torch.Generator().manual_seed(3))
    b = mem.update(s, mode="async", generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    # A random order is a different dynamics than index order (for some probe), at high load.
    xi2 = _patterns(25, 30, seed=63)
    mem2 = ClassicalHopfield(xi2)
    s2 = _patterns(50, 30, seed=64)
    assert not torch.equal(mem2.update(s2, mode="async", generator=torch.Generator().manual_seed(9)),
                           mem2.update(s2, mode="async"))
    assert mem.update(s[:0]).shape == (0, 30)


def test_validation_errors():
    xi = _patterns(3, 8)
    with pytest.raises(TypeError, match="patterns must be a torch.Tensor"):
        ClassicalHopfield([[1, -1]])
    with pytest.raises(TypeError, match="floating dtype"):
        ClassicalHopfield(xi.long())
    with pytest.raises(ValueError, match="only ±1 values"):
        ClassicalHopfield(xi * 0.5)
    with pytest.raises(ValueError, match=r"patterns must be \[P, d\]"):
        ClassicalHopfield(xi[0])
    mem = ClassicalHopfield(xi)
    with pytest.raises(ValueError, match=r"state must be \[\.\.\., 8\]"):
        mem.update(xi[:, :5])
    with pytest.raises(ValueError, match="only ±1 values"):
        mem.update(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown mode 'parallel'"):
        mem.update(xi, mode="parallel")
    with pytest.raises(ValueError, match="steps must be >= 0"):
        mem.update(xi, steps=-1)
    with pytest.raises(TypeError, match="steps must be an int"):
        mem.update(xi, steps=1.5)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        mem.update(xi, mode="async", generator=3)
    with pytest.raises(ValueError, match="only ±1 values"):
        mem.energy(xi * 2)
    with pytest.raises(ValueError, match="unknown interaction 'tanh'"):
        DenseAssociativeMemory(xi, "tanh")
    with pytest.raises(ValueError, match="degree must be >= 1"):
        DenseAssociativeMemory(xi, "poly", 0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        DenseAssociativeMemory(xi, "exp", beta=0.0)
    with pytest.raises(TypeError, match="rectified must be a bool"):
        DenseAssociativeMemory(xi, "poly", 3, rectified=1)
    with pytest.raises(ValueError, match="at least one pattern"):
        DenseAssociativeMemory(xi[:0], "poly", 3)

"""attnkit.patterns: masks, densities, reprs, validation and connectivity.

Ground truth: every mask is rebuilt here from the definitions of the foundation issue with
explicit Python loops over (i, j) (``loop_mask``), and connectivity is recomputed by brute force
(breadth-first search from every position, a subset dynamic program for Hamiltonian paths).
"""
import math
import random
import re

import pytest
import torch

from attnkit import patterns
from attnkit.patterns import Connectivity, block_layout, connectivity, fixed, star, strided

PKG = "attnkit.patterns"

# ----------------------------------------------------------------------------------------------
# ground truth
# ----------------------------------------------------------------------------------------------


def _strided_keep(p, i, j):
    d = i - j
    local = (0 <= d <= p.stride) if p.causal else (abs(d) <= p.stride)
    keep = local or d % p.stride == 0
    return keep and (j <= i or not p.causal)


def _fixed_keep(p, i, j):
    keep = (j // p.stride == i // p.stride) or (j % p.stride >= p.stride - p.summary)
    return keep and (j <= i or not p.causal)


def _star_keep(p, n, i, j):
    if i == p.relay or j == p.relay:  # the relay sees everything; everyone sees the relay
        keep = True
    else:
        si = i if i < p.relay else i - 1  # satellite numbers skip the relay
        sj = j if j < p.relay else j - 1
        d = abs(si - sj)
        if p.cyclic:
            d = min(d, (n - 1) - d)
        keep = d <= p.radius
    return keep and (j <= i or not p.causal)


def loop_mask(p, n):
    """The mask from the issue's definitions, one (i, j) at a time: [n, n] or [H, n, n]."""
    if isinstance(p, patterns.BlockLayout):
        lay = p.layout.tolist()
        return torch.tensor(
            [
                [
                    [lay[h][i // p.block][j // p.block] and (j <= i or not p.causal) for j in range(n)]
                    for i in range(n)
                ]
                for h in range(len(lay))
            ],
            dtype=torch.bool,
        ).reshape(len(lay), n, n)
    if isinstance(p, patterns.Strided):
        keep = lambda i, j: _strided_keep(p, i, j)  # noqa: E731
    elif isinstance(p, patterns.Fixed):
        keep = lambda i, j: _fixed_keep(p, i, j)  # noqa: E731
    else:
        keep = lambda i, j: _star_keep(p, n, i, j)  # noqa: E731
    return torch.tensor([[keep(i, j) for j in range(n)] for i in range(n)], dtype=torch.bool).reshape(n, n)


def brute_layers(adj):
    """Fewest L >= 1 such that every i reaches every target j by a path of <= L edges."""
    n = adj.shape[0]
    a = adj.tolist()
    causal = not any(a[i][j] for i in range(n) for j in range(i + 1, n))
    worst = 0
    for s in range(n):
        dist = {s: 0}
        frontier = [s]
        while frontier:
            nxt = []
            for v in frontier:
                for w in range(n):
                    if a[v][w] and w not in dist:
                        dist[w] = dist[v] + 1
                        nxt.append(w)
            frontier = nxt
        for t in range(n):
            if causal and t > s:
                continue
            if t not in dist:
                return None
            worst = max(worst, dist[t])
    return max(worst, 1) if n else 0


def brute_hamiltonian(adj):
    """Subset dynamic program: ends[S] = the nodes at which a simple path through exactly S can end."""
    n = adj.shape[0]
    a = adj.tolist()
    out = [sum(1 << w for w in range(n) if a[v][w]) for v in range(n)]
    ends = [0] * (1 << n)
    for v in range(n):
        ends[1 << v] = 1 << v
    for s in range(1, 1 << n):
        e = ends[s]
        for v in range(n):
            if e >> v & 1:
                new = out[v] & ~s
                for w in range(n):
                    if new >> w & 1:
                        ends[s | 1 << w] |= 1 << w
    return n == 0 or ends[(1 << n) - 1] != 0


def union_adj(p, n):
    m = loop_mask(p, n)
    return m.any(0) if m.dim() == 3 else m


# ----------------------------------------------------------------------------------------------
# masks and densities against the definitions
# ----------------------------------------------------------------------------------------------

NS = [1, 2, 33, 300]


def _check_mask_and_density(p, n):
    want = loop_mask(p, n)
    got = p.mask(n)
    assert got.dtype == torch.bool
    assert got.shape == want.shape
    assert torch.equal(got, want), f"{p!r} at n={n}"
    assert p.density(n) == int(want.sum()) / (want.numel()), f"{p!r} at n={n}"


# The loop masks cost ~0.1 s each at n = 300: all parameter combinations run at the small
# lengths, a spread of them (strides that do and do not divide 300) at n = 300.


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("causal", [True, False])
def test_strided_mask(n, causal):
    strides = [1, 2, 3, 5, 7, 16, 17, 31, 32, 63, 64] if n < 300 else [1, 7, 17, 64]
    for stride in strides:
        _check_mask_and_density(strided(stride, causal=causal), n)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("causal", [True, False])
def test_fixed_mask(n, causal):
    if n < 300:
        cases = [(s, c) for s in (1, 2, 3, 5, 8, 16, 17, 64) for c in sorted({1, 2, max(1, s // 2), s - 1, s}) if 1 <= c <= s]
    else:
        cases = [(1, 1), (7, 3), (16, 16), (64, 1)]
    for stride, summary in cases:
        _check_mask_and_density(fixed(stride, summary=summary, causal=causal), n)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cyclic", [True, False])
def test_star_mask(n, causal, cyclic):
    if n < 300:
        cases = [(relay, radius) for relay in sorted({0, n // 2, n - 1}) for radius in (1, 2, 3)]
    else:
        cases = [(0, 2), (150, 1), (299, 3)]
    for relay, radius in cases:
        _check_mask_and_density(star(relay, radius, cyclic=cyclic, causal=causal), n)


def test_star_small_ring_and_wide_radius():
    # the ring wraps; with 2*radius + 1 >= n - 1 every satellite sees every satellite
    for n in range(1, 12):
        for radius in (1, 2, 3, 5, 20):
            for relay in range(n):
                for causal in (True, False):
                    _check_mask_and_density(star(relay, radius, cyclic=True, causal=causal), n)


def test_star_definition_examples():
    m = star(relay=2, radius=1).mask(6)
    # satellites: positions 0 1 3 4 5 are satellites 0 1 2 3 4; position 3 (satellite 2) sees
    # positions 1 (satellite 1) and 4 (satellite 3) and the relay, not 0 or 5.
    assert m[3].tolist() == [False, True, True, True, True, False]
    assert m[2].all()  # the relay sees everything
    assert m[:, 2].all()  # everyone sees the relay
    ring = star(relay=0, radius=1, cyclic=True).mask(6)
    assert ring[1, 5] and ring[5, 1]  # satellites 0 and 4 are neighbours on a ring of 5


@pytest.mark.parametrize("n_blocks", [1, 3, 7])
@pytest.mark.parametrize("block", [1, 3, 8])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_block_layout_mask(n_blocks, block, heads, causal):
    layout = torch.rand(heads, n_blocks, n_blocks) < 0.5
    _check_mask_and_density(block_layout(layout, block, causal=causal), n_blocks * block)


def test_block_layout_density_is_mean_over_heads():
    layout = torch.zeros(2, 2, 2, dtype=torch.bool)
    layout[0] = True  # head 0 keeps everything, head 1 nothing
    assert block_layout(layout, 4).density(8) == 0.5
    assert block_layout(layout, 4, causal=True).density(8) == (8 * 9 // 2) / (2 * 64)


def test_strided_definition_examples():
    m = strided(3).mask(8)
    assert [j for j in range(8) if m[7, j]] == [1, 4, 5, 6, 7]
    nc = strided(3, causal=False).mask(8)
    assert [j for j in range(8) if nc[1, j]] == [0, 1, 2, 3, 4, 7]


def test_fixed_definition_examples():
    m = fixed(4, summary=2, causal=False).mask(10)
    # own block {4..7} and the summary columns j mod 4 >= 2: {2, 3, 6, 7} (and none in the partial block)
    assert [j for j in range(10) if m[5, j]] == [2, 3, 4, 5, 6, 7]
    assert [j for j in range(10) if fixed(4, 2).mask(10)[5, j]] == [2, 3, 4, 5]


def test_empty_and_device():
    for p in (strided(4), fixed(4, 2), star(3), block_layout(torch.ones(2, 3, 3, dtype=torch.bool), 4)):
        empty = p.mask(0)
        assert empty.shape[-2:] == (0, 0) and empty.dtype == torch.bool
        assert p.density(0) == 0.0
        assert p.mask(0, device=torch.device("cpu")).device.type == "cpu"
    assert strided(4).mask(5, device="cpu").shape == (5, 5)
    assert block_layout(torch.ones(1, 2, 2, dtype=torch.bool), 3).mask(6).shape == (1, 6, 6)


def test_density_without_mask_at_large_n():
    # closed forms: no n x n tensor (n = 10**6 would need a terabyte); spot-check one row count
    n = 10**6
    d = strided(1000).density(n)
    assert 0 < d < 0.01
    assert fixed(1000, summary=10).density(n) > 0
    assert star(5, 2, cyclic=True, causal=True).density(n) > 0
    rows = strided(7, causal=False)._row_counts(50)
    assert torch.equal(rows, strided(7, causal=False).mask(50).sum(1))


# ----------------------------------------------------------------------------------------------
# repr, immutability, equality
# ----------------------------------------------------------------------------------------------


def test_repr_reads_like_the_call():
    for p in (strided(64), strided(3, causal=False), fixed(128, summary=8), star(2, 3, cyclic=True, causal=True)):
        assert eval(repr(p), vars(patterns)) == p  # noqa: S307
    assert repr(strided(64)) == "strided(stride=64, causal=True)"
    assert repr(fixed(16, 2, False)) == "fixed(stride=16, summary=2, causal=False)"
    assert repr(star()) == "star(relay=0, radius=1, cyclic=False, causal=False)"
    r = repr(block_layout(torch.eye(4, dtype=torch.bool)[None], 64))
    assert r == "block_layout(layout=<bool 1x4x4, 4/16 blocks kept>, block=64, causal=False)"


def test_patterns_are_immutable_and_hashable():
    p = strided(8)
    with pytest.raises(Exception):
        p.stride = 4
    assert hash(p) == hash(strided(8)) and p != strided(8, causal=False)
    layout = torch.eye(3, dtype=torch.bool)[None]
    b = block_layout(layout, 2)
    layout[0, 0, 1] = True  # the pattern keeps its own copy
    assert not b.mask(6)[0, 0, 2]
    b.layout[0, 0, 2] = True  # .layout hands out a copy too
    assert not b.mask(6)[0, 0, 4]
    assert b == block_layout(torch.eye(3, dtype=torch.bool)[None], 2)
    assert hash(b) == hash(block_layout(torch.eye(3, dtype=torch.bool)[None], 2))
    assert b != block_layout(torch.eye(3, dtype=torch.bool)[None], 2, causal=True)
    assert (b.heads, b.num_blocks, b.block, b.causal) == (1, 3, 2, False)


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, exc, message",
    [
        (lambda: strided(0), ValueError, f"{PKG}.strided: stride must be >= 1; got 0"),
        (lambda: strided(-3), ValueError, "stride must be >= 1; got -3"),
        (lambda: strided(2.0), TypeError, "stride must be an int; got 2.0"),
        (lambda: strided(True), TypeError, "stride must be an int; got True"),
        (lambda: strided(4, causal=1), TypeError, "causal must be a bool; got 1"),
        (lambda: fixed(0), ValueError, f"{PKG}.fixed: stride must be >= 1; got 0"),
        (lambda: fixed(4, summary=0), ValueError, r"summary must be in 1..stride \(1..4\); got 0"),
        (lambda: fixed(4, summary=5), ValueError, r"summary must be in 1..stride \(1..4\); got 5"),
        (lambda: fixed(4, summary=1.5), TypeError, "summary must be an int; got 1.5"),
        (lambda: star(relay=-1), ValueError, f"{PKG}.star: relay must be >= 0; got -1"),
        (lambda: star(radius=0), ValueError, "radius must be >= 1; got 0"),
        (lambda: star(cyclic="yes"), TypeError, "cyclic must be a bool; got 'yes'"),
        (lambda: star(causal=None), TypeError, "causal must be a bool; got None"),
        (lambda: block_layout([[True]], 4), TypeError, r"layout must be a bool torch.Tensor \[H, nb, nb\]; got list"),
        (lambda: block_layout(torch.ones(1, 2, 2), 4), TypeError, "layout must be a bool tensor .*got dtype torch.float32"),
        (lambda: block_layout(torch.ones(2, 2, dtype=torch.bool), 4), ValueError, "layout must be a 3-D tensor .*got 2-D"),
        (lambda: block_layout(torch.ones(1, 2, 3, dtype=torch.bool), 4), ValueError, r"square in the blocks\); got \(1, 2, 3\)"),
        (lambda: block_layout(torch.ones(0, 2, 2, dtype=torch.bool), 4), ValueError, r"H >= 1"),
        (lambda: block_layout(torch.ones(1, 2, 2, dtype=torch.bool), 0), ValueError, "block must be >= 1; got 0"),
        (lambda: block_layout(torch.ones(1, 2, 2, dtype=torch.bool), 4, causal=0), TypeError, "causal must be a bool"),
    ],
)
def test_construction_errors(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


def test_length_errors():
    with pytest.raises(ValueError, match=re.escape(f"{PKG}.star.mask: the star's relay must be a position of the sequence (0..4 for n=5); got relay=5")):
        star(relay=5).mask(5)
    with pytest.raises(ValueError, match="relay must be a position"):
        star(relay=7).density(3)
    star(relay=4).mask(5)  # the last position is fine
    lay = block_layout(torch.ones(2, 3, 3, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match=re.escape(f"{PKG}.block_layout.mask: sequence length must match the layout: nb * block = 3 * 4 = 12; got n=13")):
        lay.mask(13)
    with pytest.raises(ValueError, match="nb \\* block = 3 \\* 4 = 12; got n=8"):
        lay.density(8)
    with pytest.raises(ValueError, match=f"{PKG}.strided.mask: n \\(the sequence length\\) must be >= 0; got -1"):
        strided(3).mask(-1)
    with pytest.raises(TypeError, match="n \\(the sequence length\\) must be an int; got 4.0"):
        fixed(3).mask(4.0)
    with pytest.raises(TypeError, match="must be an int; got True"):
        strided(3).density(True)


# ----------------------------------------------------------------------------------------------
# connectivity
# ----------------------------------------------------------------------------------------------


def test_connectivity_known_cases():
    # causal strided with stride sqrt(n): every j <= i within two layers (Child et al.)
    assert connectivity(strided(16), 256) == Connectivity(True, True, 2)
    assert connectivity(strided(16, causal=False), 256) == Connectivity(True, True, 2)
    # stride >= n - 1: the band alone covers everything in one layer
    assert connectivity(strided(32), 33) == Connectivity(True, True, 1)
    assert connectivity(fixed(16, 2), 256) == Connectivity(True, True, 2)
    assert connectivity(fixed(16, 2, causal=False), 256) == Connectivity(True, True, 2)
    # non-causal star: satellite -> relay -> anyone
    assert connectivity(star(0, 1), 33) == Connectivity(True, True, 2)
    assert connectivity(star(16, 2, cyclic=True), 33) == Connectivity(True, True, 2)
    # causal star with the relay first: information only travels along the satellite chain
    assert connectivity(star(0, 1, causal=True), 33).layers_to_full == 31
    assert connectivity(star(0, 2, causal=True), 33).layers_to_full == 16
    # block diagonal: never full, no path across blocks
    diag = torch.eye(4, dtype=torch.bool)[None]
    assert connectivity(block_layout(diag, 8), 32) == Connectivity(True, False, None)
    # a layout without its diagonal: no self loops, yet everything is one edge away
    no_diag = ~torch.eye(5, dtype=torch.bool)[None]
    assert connectivity(block_layout(no_diag, 1), 5) == Connectivity(False, True, 1)
    assert connectivity(block_layout(no_diag, 3), 15) == Connectivity(False, True, 2)
    # local band of blocks (previous block + own block), causal: one block further per layer
    d = torch.arange(6)[:, None] - torch.arange(6)[None, :]
    band = ((d >= 0) & (d <= 1))[None]
    assert connectivity(block_layout(band, 4, causal=True), 24) == Connectivity(True, True, 5)
    # a partial last block without summary columns is never attended by other blocks
    assert connectivity(fixed(5, 2, causal=False), 33).layers_to_full is None
    # trivial lengths
    assert connectivity(strided(4), 0) == Connectivity(True, True, 0)
    assert connectivity(strided(4), 1) == Connectivity(True, True, 1)
    assert connectivity(block_layout(torch.zeros(1, 1, 1, dtype=torch.bool), 1), 1) == Connectivity(False, True, 1)


def test_connectivity_is_a_named_result():
    c = connectivity(strided(4), 16)
    assert (c.self_loops, c.hamiltonian_path, c.layers_to_full) == tuple(c)
    assert isinstance(c.self_loops, bool) and isinstance(c.hamiltonian_path, bool)
    assert isinstance(c.layers_to_full, int)


def _small_patterns():
    for n in (1, 2, 3, 6, 9):
        for s in (1, 2, 3):
            for causal in (True, False):
                yield strided(s, causal), n
                for c in range(1, s + 1):
                    yield fixed(s, c, causal), n
        for relay in {0, n // 2, n - 1}:
            for radius in (1, 2):
                for cyclic in (False, True):
                    for causal in (False, True):
                        yield star(relay, radius, cyclic, causal), n


def test_connectivity_against_brute_force_patterns():
    for p, n in _small_patterns():
        adj = union_adj(p, n)
        want = Connectivity(bool(adj.diagonal().all()), brute_hamiltonian(adj), brute_layers(adj))
        assert connectivity(p, n) == want, f"{p!r} at n={n}"


def test_connectivity_layers_against_brute_force_larger_n():
    for p in (strided(5), strided(6, causal=False), fixed(6, 2), fixed(6, 6, causal=False),
              fixed(5, 1, causal=False), star(10, 1, causal=True), star(0, 2, cyclic=True, causal=True)):
        adj = union_adj(p, 40)
        assert connectivity(p, 40).layers_to_full == brute_layers(adj), repr(p)


def test_connectivity_against_brute_force_block_layouts():
    rng = random.Random(0)
    checked = 0
    while checked < 150:
        heads, nb, block = rng.choice([1, 2]), rng.randint(1, 5), rng.randint(1, 4)
        if nb * block > 11:
            continue
        layout = torch.rand(heads, nb, nb) < rng.choice([0.25, 0.4, 0.6, 0.8])
        p = block_layout(layout, block, causal=rng.random() < 0.3)
        n = nb * block
        adj = union_adj(p, n)
        want = Connectivity(bool(adj.diagonal().all()), brute_hamiltonian(adj), brute_layers(adj))
        assert connectivity(p, n) == want, f"{layout.int().tolist()} block={block} causal={p.causal}"
        checked += 1


@pytest.mark.parametrize("method", ["squaring", "frontier"])
def test_layers_methods_agree_with_brute_force(method):
    cases = [star(0, 1, causal=True), star(1, 2, cyclic=True, causal=True), strided(3), fixed(4, 1, causal=False),
             star(1, 1), fixed(7, 3)]
    for p in cases:
        for n in (2, 9, 23):
            adj = p.mask(n)
            assert patterns._layers_to_full(adj, method) == brute_layers(adj), (repr(p), n)
    for _ in range(30):
        adj = torch.rand(12, 12) < 0.2
        assert patterns._layers_to_full(adj, method) == brute_layers(adj)
        low = adj.tril()
        assert patterns._layers_to_full(low, method) == brute_layers(low)


def test_frontier_chunks():
    # a tiny chunk forces each layer's expansion through many pieces
    for p in (star(0, 2, causal=True), strided(3, causal=False)):
        adj = p.mask(30)
        off = adj & ~torch.eye(30, dtype=torch.bool)
        lower = not bool(adj.triu(1).any())
        assert patterns._layers_frontier(off, lower, chunk=3) == brute_layers(adj)


def test_connectivity_large_n_is_fast_and_right():
    # a long chain (squaring and binary lifting over ~9 levels) and a dense two-layer pattern
    assert connectivity(star(0, 1, causal=True), 512) == Connectivity(True, True, 510)
    assert connectivity(star(0, 4, causal=True), 512).layers_to_full == math.ceil(510 / 4)
    assert connectivity(strided(32), 1024) == Connectivity(True, True, 2)
    d = torch.arange(16)[:, None] - torch.arange(16)[None, :]
    band = d.abs() <= 1
    # non-causal band of blocks: 15 block steps end to end, computed on two copies per block
    assert connectivity(block_layout(band[None], 64), 1024) == Connectivity(True, True, 15)


def test_hamiltonian_block_layout_walks():
    # blocks without a self loop need their copies visited from other blocks: two blocks that
    # only see each other alternate a b a b ...
    swap = torch.tensor([[[False, True], [True, False]]])
    assert connectivity(block_layout(swap, 3), 6).hamiltonian_path is True
    # block a has no self loop, block b has one: a1 b1 b2 a2
    lop = torch.tensor([[[False, True], [True, True]]])
    assert connectivity(block_layout(lop, 2), 4).hamiltonian_path is True
    star_like = torch.tensor([[[False, True, True], [True, False, False], [True, False, False]]])
    # a <-> b, a <-> c, no self loops: visits must alternate a / not-a.  Block 1: b a c.
    # Block 2: four visits to b or c need three a's between them, and a has only two copies.
    assert connectivity(block_layout(star_like, 1), 3).hamiltonian_path is True
    assert connectivity(block_layout(star_like, 2), 6).hamiltonian_path is False


def test_hamiltonian_search_budget(monkeypatch):
    # a layout that needs the search (no chain, not causal, semi-connected)
    layout = torch.tensor([[[False, True, True], [True, False, False], [True, False, False]]])
    p = block_layout(layout, 2)
    assert connectivity(p, 6).hamiltonian_path is False
    monkeypatch.setattr(patterns, "HAMILTONIAN_SEARCH_BUDGET", 1)
    assert connectivity(p, 6).hamiltonian_path is None  # undecided within the budget


def test_connectivity_errors():
    with pytest.raises(TypeError, match=f"{PKG}.connectivity: pattern must be an attnkit.patterns pattern; got str"):
        connectivity("strided", 8)
    with pytest.raises(ValueError, match=f"{PKG}.connectivity: the star's relay must be a position"):
        connectivity(star(9), 4)
    with pytest.raises(ValueError, match=f"{PKG}.connectivity: sequence length must match the layout"):
        connectivity(block_layout(torch.ones(1, 2, 2, dtype=torch.bool), 2), 5)
    with pytest.raises(ValueError, match="must be >= 0; got -2"):
        connectivity(strided(3), -2)


def test_docstring_examples():
    import doctest

    result = doctest.testmod(patterns, extraglobs={"torch": torch}, verbose=False)
    assert result.attempted >= 5 and result.failed == 0

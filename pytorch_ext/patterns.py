"""Sparse attention patterns and the connectivity of their attention graphs.

A pattern says which keys each query may attend to.  Its length is only known when it is
used, so every pattern is a small immutable description with

- ``mask(n, device=None)`` -> ``BoolTensor[n, n]`` (``[H | 1, n, n]`` for :func:`block_layout`),
  True where query ``i`` (row) may attend key ``j`` (column);
- ``density(n)`` -> the kept fraction of the ``n x n`` entries (averaged over the heads of a
  block layout), computed from closed forms in O(n) without building the mask;
- a ``repr`` that reads like the call that made it.

The four families (``i`` the query, ``j`` the key, all positions in ``[0, n)``):

``strided(stride, causal=True)`` (Child et al. 2019)
    ``j`` in A1 or A2 with A1 = {0 <= i-j <= stride} (non-causal: {|i-j| <= stride}) and
    A2 = {(i-j) mod stride = 0}; causal also requires ``j <= i``.
``fixed(stride, summary=1, causal=True)`` (Child et al. 2019)
    ``j`` in the block of ``i`` (``j // stride == i // stride``) or ``j`` is a summary column
    (``j mod stride >= stride - summary``); causal also requires ``j <= i``.
``star(relay=0, radius=1, cyclic=False, causal=False)`` (Star-Transformer, Guo et al. 2019)
    position ``relay`` is the relay node, the other ``n-1`` positions are satellites numbered
    ``0..n-2`` in order.  A satellite sees the satellites within ``radius`` of it (with
    ``cyclic``, ring distance ``min(d, n-1-d)``) and the relay; the relay sees everything;
    causal also requires ``j <= i``.
``block_layout(layout, block, causal=False)``
    ``layout`` is a bool ``[H | 1, nb, nb]`` tensor; element ``(i, j)`` of head ``h`` is kept
    when ``layout[h, i // block, j // block]``; ``n`` must be ``nb * block``.

Parameters are checked when the pattern is made; what depends on ``n`` (the relay inside the
sequence, ``n == nb * block``) is checked by ``mask`` / ``density`` / :func:`connectivity` /
:func:`attnkit.sparse_attention`.  ``n == 0`` is allowed for every pattern and gives an empty
mask (an empty sequence has nothing to check).

:func:`connectivity` reports the three conditions of the theory of sparse transformers (see its
docstring for the exact conventions).

Example::

    >>> from attnkit import patterns
    >>> p = patterns.strided(8)
    >>> p
    strided(stride=8, causal=True)
    >>> p.mask(64).shape, round(p.density(64), 4)
    (torch.Size([64, 64]), 0.1729)
    >>> patterns.connectivity(p, 64)
    Connectivity(self_loops=True, hamiltonian_path=True, layers_to_full=2)
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ._validation import check_int

__all__ = [
    "Pattern",
    "Strided",
    "Fixed",
    "Star",
    "BlockLayout",
    "Connectivity",
    "strided",
    "fixed",
    "star",
    "block_layout",
    "connectivity",
]

_PKG = "attnkit.patterns"


def _check_flag(fn: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool; got {value!r}")


def _check_length(fn: str, n) -> None:
    # torch.SymInt: under torch.compile with dynamic shapes the length is symbolic.
    if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
        raise TypeError(f"{fn}: n (the sequence length) must be an int; got {n!r}")
    if n < 0:
        raise ValueError(f"{fn}: n (the sequence length) must be >= 0; got {n}")


def _positions(n, device) -> torch.Tensor:
    # int32 halves the memory of the [n, n] index arithmetic; n < 2**31 always holds here.
    return torch.arange(n, device=device, dtype=torch.int32)


class Pattern:
    """Base class of the patterns: ``mask``, ``density``, ``check``; see the module docstring."""

    causal: bool

    def check(self, n, fn: str | None = None) -> None:
        """Raise TypeError / ValueError if this pattern cannot be used at length ``n``."""
        _check_length(fn or f"{_PKG}.{self._name}", n)

    def mask(self, n, device=None) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def density(self, n) -> float:
        """The kept fraction of the ``n x n`` entries (0.0 for ``n == 0``)."""
        self.check(n, f"{_PKG}.{self._name}.density")
        if n == 0:
            return 0.0
        return int(self._row_counts(int(n)).sum()) / (n * n)

    def _row_counts(self, n: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def _name(self) -> str:
        return type(self).__name__.lower()

    def __repr__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{self._factory}({args})"


def _causal_filter(m: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return m & (pos[None, :] <= pos[:, None])


@dataclasses.dataclass(frozen=True, repr=False)
class Strided(Pattern):
    """Strided pattern (Child et al. 2019); make it with :func:`strided`."""

    stride: int
    causal: bool = True
    _factory = "strided"

    def __post_init__(self):
        fn = f"{_PKG}.strided"
        check_int(fn, "stride", self.stride, low=1)
        _check_flag(fn, "causal", self.causal)

    def mask(self, n, device=None) -> torch.Tensor:
        """``BoolTensor[n, n]``: True where query i may attend key j."""
        self.check(n, f"{_PKG}.strided.mask")
        pos = _positions(n, device)
        diff = pos[:, None] - pos[None, :]  # i - j
        s = self.stride
        # torch's % follows the divisor's sign, so (i - j) % s == 0 exactly when s divides i - j.
        periodic = diff % s == 0
        if self.causal:
            return (diff >= 0) & ((diff <= s) | periodic)
        return (diff.abs() <= s) | periodic

    def _row_counts(self, n: int) -> torch.Tensor:
        i = torch.arange(n, dtype=torch.int64)
        s = self.stride
        if self.causal:
            # band 0 <= i-j <= s, plus the multiples i-j = k*s (k >= 2) that lie beyond it.
            return torch.clamp(i, max=s) + 1 + torch.clamp(i // s - 1, min=0)
        band = torch.clamp(i + s, max=n - 1) - torch.clamp(i - s, min=0) + 1
        below = torch.clamp(i // s - 1, min=0)
        above = torch.clamp((n - 1 - i) // s - 1, min=0)
        return band + below + above


@dataclasses.dataclass(frozen=True, repr=False)
class Fixed(Pattern):
    """Fixed pattern (Child et al. 2019); make it with :func:`fixed`."""

    stride: int
    summary: int = 1
    causal: bool = True
    _factory = "fixed"

    def __post_init__(self):
        fn = f"{_PKG}.fixed"
        check_int(fn, "stride", self.stride, low=1)
        check_int(fn, "summary", self.summary)
        if not 1 <= self.summary <= self.stride:
            raise ValueError(
                f"{fn}: summary must be in 1..stride (1..{self.stride}); got {self.summary}"
            )
        _check_flag(fn, "causal", self.causal)

    def mask(self, n, device=None) -> torch.Tensor:
        """``BoolTensor[n, n]``: True where query i may attend key j."""
        self.check(n, f"{_PKG}.fixed.mask")
        pos = _positions(n, device)
        l, c = self.stride, self.summary
        block = pos // l
        same_block = block[:, None] == block[None, :]
        summary_col = (pos % l) >= l - c
        m = same_block | summary_col[None, :]
        return _causal_filter(m, pos) if self.causal else m

    def _row_counts(self, n: int) -> torch.Tensor:
        i = torch.arange(n, dtype=torch.int64)
        l, c = self.stride, self.summary
        b = i // l
        if self.causal:
            # own block up to i, plus the c summary columns of each (complete) earlier block.
            return i - b * l + 1 + b * c
        size = torch.clamp(n - b * l, max=l)  # the last block may be partial
        total_summary = (n // l) * c + max(0, n % l - (l - c))
        own_summary = torch.clamp(size - (l - c), min=0)
        return size + total_summary - own_summary


@dataclasses.dataclass(frozen=True, repr=False)
class Star(Pattern):
    """Star-Transformer pattern (Guo et al. 2019); make it with :func:`star`."""

    relay: int = 0
    radius: int = 1
    cyclic: bool = False
    causal: bool = False
    _factory = "star"

    def __post_init__(self):
        fn = f"{_PKG}.star"
        check_int(fn, "relay", self.relay, low=0)
        check_int(fn, "radius", self.radius, low=1)
        _check_flag(fn, "cyclic", self.cyclic)
        _check_flag(fn, "causal", self.causal)

    def check(self, n, fn: str | None = None) -> None:
        fn = fn or f"{_PKG}.star"
        _check_length(fn, n)
        if n > 0 and self.relay >= n:
            raise ValueError(
                f"{fn}: the star's relay must be a position of the sequence (0..{n - 1} for n={n}); "
                f"got relay={self.relay}"
            )

    def mask(self, n, device=None) -> torch.Tensor:
        """``BoolTensor[n, n]``: True where query i may attend key j."""
        self.check(n, f"{_PKG}.star.mask")
        return self.mask_rows(_positions(n, device), n)

    def mask_rows(self, rows: torch.Tensor, n) -> torch.Tensor:
        """``BoolTensor[len(rows), n]``: the rows ``rows`` (int positions) of ``mask(n)``."""
        pos = _positions(n, rows.device)
        rows = rows.to(pos.dtype)

        def satellite(p):  # satellite number (meaningless for the relay)
            return p - (p > self.relay).to(p.dtype)

        dist = (satellite(rows)[:, None] - satellite(pos)[None, :]).abs()
        if self.cyclic:
            dist = torch.minimum(dist, (n - 1) - dist)
        m = (dist <= self.radius) | (rows == self.relay)[:, None] | (pos == self.relay)[None, :]
        return m & (pos[None, :] <= rows[:, None]) if self.causal else m

    def _row_counts(self, n: int) -> torch.Tensor:
        r, rad, m = self.relay, self.radius, n - 1  # m satellites
        pos = torch.arange(n, dtype=torch.int64)
        s = pos - (pos > r).to(torch.int64)
        if not self.causal:
            if self.cyclic:
                near = torch.full_like(s, min(m, 2 * rad + 1))
            else:
                near = torch.clamp(s + rad, max=m - 1) - torch.clamp(s - rad, min=0) + 1
            counts = near + 1  # + the relay
            counts[r] = n
            return counts
        # causal: satellites t <= s at distance d = s - t; cyclic adds the wrap-around d >= m - rad.
        near = torch.clamp(s, max=rad) + 1
        if self.cyclic:
            near = near + torch.clamp(s - max(m - rad, rad + 1) + 1, min=0)
        counts = near + (pos > r).to(torch.int64)  # the relay is visible from later positions
        counts[r] = r + 1
        return counts


class BlockLayout(Pattern):
    """A block-sparse layout; make it with :func:`block_layout`.

    ``layout``: bool ``[H | 1, nb, nb]`` (kept as a private copy), ``block``: the block size.
    """

    _factory = "block_layout"

    def __init__(self, layout: torch.Tensor, block: int, causal: bool = False):
        fn = f"{_PKG}.block_layout"
        if not isinstance(layout, torch.Tensor):
            raise TypeError(f"{fn}: layout must be a bool torch.Tensor [H, nb, nb]; got {type(layout).__name__}")
        if layout.dtype != torch.bool:
            raise TypeError(f"{fn}: layout must be a bool tensor [H, nb, nb]; got dtype {layout.dtype}")
        if layout.dim() != 3:
            raise ValueError(
                f"{fn}: layout must be a 3-D tensor [H, nb, nb] (H = 1 serves every head); "
                f"got {layout.dim()}-D with shape {tuple(layout.shape)}"
            )
        if layout.shape[1] != layout.shape[2] or layout.shape[0] < 1:
            raise ValueError(
                f"{fn}: layout must have shape [H, nb, nb] with H >= 1 (square in the blocks); "
                f"got {tuple(layout.shape)}"
            )
        check_int(fn, "block", block, low=1)
        _check_flag(fn, "causal", causal)
        # A private copy: changing the caller's tensor later must not change the pattern.
        self._layout = layout.detach().clone()
        self._block = block
        self._causal = causal

    layout = property(lambda self: self._layout.clone(), doc="the layout (a copy), bool [H, nb, nb]")
    block = property(lambda self: self._block, doc="the block size")
    causal = property(lambda self: self._causal, doc="whether j <= i is also required")
    heads = property(lambda self: self._layout.shape[0], doc="H, the number of layout heads")
    num_blocks = property(lambda self: self._layout.shape[1], doc="nb, blocks per side")

    def check(self, n, fn: str | None = None) -> None:
        fn = fn or f"{_PKG}.block_layout"
        _check_length(fn, n)
        want = self.num_blocks * self._block
        if n != 0 and n != want:
            raise ValueError(
                f"{fn}: sequence length must match the layout: nb * block = {self.num_blocks} * "
                f"{self._block} = {want}; got n={n}"
            )

    def mask(self, n, device=None) -> torch.Tensor:
        """``BoolTensor[H | 1, n, n]``: True where query i of head h may attend key j."""
        self.check(n, f"{_PKG}.block_layout.mask")
        layout = self._layout if device is None else self._layout.to(device)
        pos = _positions(n, layout.device)
        blk = (pos // self._block).long()
        m = layout[:, blk[:, None], blk[None, :]]
        return _causal_filter(m, pos) if self._causal else m

    def density(self, n) -> float:
        """The kept fraction of the ``H x n x n`` entries (the mean over the layout heads)."""
        self.check(n, f"{_PKG}.block_layout.density")
        if n == 0:
            return 0.0
        lay = self._layout.cpu()
        b = self._block
        if self._causal:
            below = int(torch.tril(lay, diagonal=-1).sum()) * b * b
            diag = int(lay.diagonal(dim1=1, dim2=2).sum()) * (b * (b + 1) // 2)
            kept = below + diag
        else:
            kept = int(lay.sum()) * b * b
        return kept / (self.heads * n * n)

    def index_lists(self, device=None):
        """The layout as per-row and per-column block index lists (what the kernels read).

        Returns ``(row_ptr, col_idx, col_ptr, row_idx)``, int32: ``col_idx[row_ptr[h, r] :
        row_ptr[h, r + 1]]`` are the key blocks of query block ``r`` in head ``h`` (increasing),
        ``row_idx[col_ptr[h, c] : col_ptr[h, c + 1]]`` the query blocks that attend key block
        ``c``; ``row_ptr`` / ``col_ptr`` are ``[H | 1, nb + 1]`` absolute offsets.  With
        ``causal``, blocks above the diagonal (never visible) are left out.
        """
        lay = self._layout.cpu()
        if self._causal:
            lay = lay & torch.ones(self.num_blocks, self.num_blocks, dtype=torch.bool).tril()
        out = []
        for m in (lay, lay.transpose(1, 2)):
            counts = m.sum(-1).reshape(-1)  # [H * nb]
            ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(counts, 0)
            # Absolute offsets per head: row h of ptr is [start of row 0 .. end of row nb-1].
            h, nb = m.shape[0], m.shape[1]
            ptr2 = torch.stack([ptr[i * nb:(i + 1) * nb + 1] for i in range(h)])
            idx = m.nonzero()[:, 2]  # row-major: (head, row, col) sorted -> increasing cols
            out += [ptr2.to(torch.int32), idx.to(torch.int32)]
        return tuple(t.to(device) if device is not None else t for t in out)

    def __eq__(self, other):
        if not isinstance(other, BlockLayout):
            return NotImplemented
        return (
            self._block == other._block
            and self._causal == other._causal
            and self._layout.shape == other._layout.shape
            and torch.equal(self._layout.cpu(), other._layout.cpu())
        )

    def __hash__(self):
        return hash((self._block, self._causal, tuple(self._layout.shape),
                     self._layout.cpu().numpy().tobytes()))

    def __repr__(self) -> str:
        h, nb, _ = self._layout.shape
        kept = int(self._layout.sum())
        return (
            f"block_layout(layout=<bool {h}x{nb}x{nb}, {kept}/{h * nb * nb} blocks kept>, "
            f"block={self._block}, causal={self._causal})"
        )


def strided(stride: int, causal: bool = True) -> Strided:
    """Strided pattern: ``j`` with ``0 <= i-j <= stride`` or ``stride | (i-j)``.

    Non-causal: the band is ``|i-j| <= stride`` and the multiples go both ways.
    ``stride >= 1``.  Example: ``strided(64).mask(4096)``.
    """
    return Strided(stride, causal)


def fixed(stride: int, summary: int = 1, causal: bool = True) -> Fixed:
    """Fixed pattern: ``j`` in the block of ``i`` or ``j mod stride >= stride - summary``.

    ``stride >= 1``, ``1 <= summary <= stride``.  Example: ``fixed(128, summary=8).mask(1024)``.
    """
    return Fixed(stride, summary, causal)


def star(relay: int = 0, radius: int = 1, cyclic: bool = False, causal: bool = False) -> Star:
    """Star-Transformer pattern: a relay position that sees and is seen by all, satellites
    that see their neighbours within ``radius`` (ring distance when ``cyclic``).

    ``relay >= 0`` (and ``< n`` when used), ``radius >= 1``.  Example: ``star(0, 2).mask(100)``.
    """
    return Star(relay, radius, cyclic, causal)


def block_layout(layout: torch.Tensor, block: int, causal: bool = False) -> BlockLayout:
    """Block-sparse pattern: ``(i, j)`` of head ``h`` kept when ``layout[h, i//block, j//block]``.

    ``layout``: bool ``[H | 1, nb, nb]`` (H = 1 serves every head); used at ``n = nb * block``.
    Example::

        >>> lay = torch.eye(4, dtype=torch.bool)[None] | torch.eye(4, dtype=torch.bool).roll(-1, 1)[None]
        >>> block_layout(lay, 64).mask(256).shape
        torch.Size([1, 256, 256])
    """
    return BlockLayout(layout, block, causal)


# ----------------------------------------------------------------------------------------------
# Connectivity
# ----------------------------------------------------------------------------------------------

class Connectivity(NamedTuple):
    """Result of :func:`connectivity`."""

    self_loops: bool
    hamiltonian_path: bool | None
    layers_to_full: int | None


# The walk search for Hamiltonian paths of irregular block layouts gives up (answers None)
# after expanding this many search states.
HAMILTONIAN_SEARCH_BUDGET = 50_000


def connectivity(pattern: Pattern, n: int) -> Connectivity:
    """The three connectivity conditions of the theory of sparse transformers, at length ``n``.

    The graph: one node per position, an edge ``i -> j`` when query ``i`` attends key ``j``
    (``pattern.mask(n)[i, j]``); for a block layout with several heads, the union of the heads
    (the heads of one layer all write to the same residual stream).

    - ``self_loops``: every position attends to itself (the mask's diagonal is all True).
    - ``hamiltonian_path``: some path along edges visits every position exactly once (whether
      edges are read as ``i -> j`` or ``j -> i`` does not change the answer).  Exact for the
      strided, fixed and star patterns (they always contain the chain ``i -> i-1``) and for every
      causal pattern (a DAG apart from self loops: the only candidate is that chain).  For a
      non-causal block layout, positions in one block are interchangeable, so the question
      becomes a walk over the blocks, decided by an exhaustive memoized search; if that search
      exceeds :data:`HAMILTONIAN_SEARCH_BUDGET` states the answer is ``None`` (undecided).
    - ``layers_to_full``: the fewest layers ``L >= 1`` after which every position ``i`` has
      (directly or through intermediate positions, one edge per layer) received information
      from every position ``j`` it can ever reach; ``None`` if that never happens.  The residual
      stream is counted: a position keeps its own information across layers even without a self
      loop, so after ``L`` layers ``i`` has seen ``j`` when a path of at most ``L`` edges leads
      from ``i`` to ``j`` (``(A | I)^L`` in boolean arithmetic).  "Every position" means every
      ``j`` when the mask has any entry above the diagonal, and every ``j <= i`` when it has
      none (causal patterns, including layouts that happen to be causal): later positions can
      never be reached there, so they are not asked for.

    ``n == 0`` gives ``Connectivity(True, True, 0)`` (nothing to connect); for ``n >= 1``
    ``layers_to_full`` is at least 1.  Runs in seconds at ``n = 4096``: repeated squaring of
    the reachability matrix, switching to a breadth-first frontier over all sources for long
    chains on large sparse graphs; for a block layout the same computation on two positions per
    block, which preserves every distance.

    Example::

        >>> connectivity(strided(16), 256)
        Connectivity(self_loops=True, hamiltonian_path=True, layers_to_full=2)
    """
    fn = f"{_PKG}.connectivity"
    if not isinstance(pattern, Pattern):
        raise TypeError(f"{fn}: pattern must be an attnkit.patterns pattern; got {type(pattern).__name__}")
    pattern.check(n, fn)
    if n == 0:
        return Connectivity(True, True, 0)
    adj = pattern.mask(n, device="cpu")
    if adj.dim() == 3:
        adj = adj.any(dim=0)
    self_loops = bool(adj.diagonal().all())
    return Connectivity(self_loops, _hamiltonian(pattern, adj), _layers(pattern, adj))


def _is_twin_layout(pattern: Pattern) -> bool:
    # Non-causal block layout: all positions of a block have the same row and column of the
    # mask (including the entries among themselves), i.e. they are exact copies of each other.
    return isinstance(pattern, BlockLayout) and not pattern.causal and pattern.block > 1


def _layers(pattern: Pattern, adj: torch.Tensor) -> int | None:
    if isinstance(pattern, BlockLayout) and pattern.block > 2:
        # Two positions per block preserve every distance.  Non-causal: the positions of a block
        # are exact copies (same mask row and column), interchangeable on any path.  Causal: a
        # position reaches an earlier block only through the block graph (its offset inside its
        # own block changes nothing there), and an earlier position of its own block directly
        # when the diagonal block is kept, never otherwise.
        union = pattern._layout.cpu().any(dim=0, keepdim=True)
        small = BlockLayout(union, 2, pattern.causal).mask(2 * pattern.num_blocks)[0]
        return _layers_to_full(small)
    return _layers_to_full(adj)


def _layers_to_full(adj: torch.Tensor, method: str | None = None) -> int | None:
    """Fewest L >= 1 with target ⊆ (A | I)^L (see connectivity), or None.

    ``method``: "squaring" or "frontier" (None picks by cost; both are exact)."""
    n = adj.shape[0]
    if n == 0:
        return 0
    adj = adj.cpu()
    eye = torch.eye(n, dtype=torch.bool)
    lower = not bool(torch.triu(adj, diagonal=1).any())
    reach = adj | eye
    if _is_full(reach, lower):
        return 1
    if method == "frontier":
        return _layers_frontier(adj & ~eye, lower)
    if method not in (None, "squaring"):
        raise ValueError(f"unknown method {method!r}")
    # Squaring costs ~2 log2(L) dense n^3 products (~0.5 s each at n = 4096 on 2 cores); the
    # frontier costs ~n * edges element steps in all plus ~1 ms per layer.  The frontier wins
    # only for long chains (L in the thousands) on large sparse graphs, e.g. a causal star.
    off_edges = int(adj.sum()) - int(adj.diagonal().sum())
    frontier_after = None
    if method is None and n > 2048 and n * off_edges <= 200_000_000:
        frontier_after = 2  # switch once R^4 is not full yet
    return _layers_squaring(reach, lower, adj & ~eye if frontier_after else None, frontier_after)


def _is_full(reach: torch.Tensor, lower: bool) -> bool:
    n = reach.shape[0]
    if lower:  # reach stays inside the lower triangle; full = all of it
        return int(reach.sum()) == n * (n + 1) // 2
    return bool(reach.all())


def _bool_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # 0/1 entries, non-negative sums: any rounding keeps a positive sum positive, so bfloat16
    # (much faster than float32 on these CPUs) is exact for the boolean product.
    dtype = torch.float32 if a.shape[0] < 256 else torch.bfloat16
    return (a.to(dtype) @ b.to(dtype)) > 0


def _layers_squaring(reach: torch.Tensor, lower: bool, off: torch.Tensor | None = None,
                     frontier_after: int | None = None) -> int | None:
    powers = [reach]  # powers[k] = (A | I)^(2^k), none of them full
    while True:
        nxt = _bool_matmul(powers[-1], powers[-1])
        if _is_full(nxt, lower):
            break
        if torch.equal(nxt, powers[-1]):  # closed under another layer: never full
            return None
        powers.append(nxt)
        if frontier_after is not None and len(powers) > frontier_after:
            return _layers_frontier(off, lower)
    # 2^(K-1) < L <= 2^K with K = len(powers); binary lifting finds the largest non-full count.
    cur, count = powers[-1], 1 << (len(powers) - 1)
    for k in range(len(powers) - 2, -1, -1):
        cand = _bool_matmul(cur, powers[k])
        if not _is_full(cand, lower):
            cur, count = cand, count + (1 << k)
    return count + 1


def _layers_frontier(off: torch.Tensor, lower: bool, chunk: int = 1 << 22) -> int | None:
    """Breadth-first search from every source at once; ``off``: the edges without self loops."""
    # Up to n small steps: intra-op threads only add synchronization (several times slower
    # on a busy machine), so run them on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _frontier_search(off, lower, chunk)
    finally:
        torch.set_num_threads(threads)


def _frontier_search(off: torch.Tensor, lower: bool, chunk: int) -> int | None:
    n = off.shape[0]
    rows, cols = off.nonzero(as_tuple=True)  # row-major: CSR order
    rowptr = torch.zeros(n + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
    visited = torch.eye(n, dtype=torch.bool).reshape(-1)
    src = torch.arange(n)
    cur = torch.arange(n)
    layer = last = 0
    while cur.numel():
        layer += 1
        deg = rowptr[cur + 1] - rowptr[cur]
        ends = torch.cumsum(deg, 0)
        found = []
        lo = 0
        while lo < cur.numel():  # bound the memory of one expansion
            base = int(ends[lo - 1]) if lo else 0
            hi = max(int(torch.searchsorted(ends, base + chunk, right=True)), lo + 1)
            stop = int(ends[hi - 1])
            if stop > base:
                # expansion slot p belongs to frontier entry e (searchsorted, not
                # repeat_interleave: the latter is slow on small inputs with several threads)
                p = torch.arange(base, stop)
                e = lo + torch.searchsorted(ends[lo:hi], p, right=True)
                nbr = cols[rowptr[cur[e]] + p - (ends[e] - deg[e])]
                lin = src[e] * n + nbr
                lin = torch.unique(lin[~visited[lin]])
                visited[lin] = True
                found.append(lin)
            lo = hi
        lin = torch.cat(found) if found else torch.empty(0, dtype=torch.int64)
        if lin.numel():
            last = layer
        src, cur = lin // n, lin % n
    return max(last, 1) if _is_full(visited.view(n, n), lower) else None


def _hamiltonian(pattern: Pattern, adj: torch.Tensor) -> bool | None:
    n = adj.shape[0]
    if n <= 1:
        return True
    i = torch.arange(n - 1)
    if bool(adj[i + 1, i].all()) or bool(adj[i, i + 1].all()):
        return True  # the consecutive chain
    off = adj & ~torch.eye(n, dtype=torch.bool)
    if not bool(torch.triu(off, 1).any()) or not bool(torch.tril(off, -1).any()):
        # Every edge points the same way along the sequence: a path must visit the positions
        # in order, which is the consecutive chain that was just found missing.
        return False
    if _is_twin_layout(pattern):
        classes = pattern._layout.cpu().any(dim=0)
        visits = pattern.block
    else:
        classes, visits = adj, 1
    # A walk that covers every node needs, for any two nodes, a path one way or the other.
    reach = _closure(classes)
    if not bool((reach | reach.T).all()):
        return False
    try:
        return _walk_search(classes, visits)
    except _BudgetExceeded:
        return None


def _closure(adj: torch.Tensor) -> torch.Tensor:
    reach = adj | torch.eye(adj.shape[0], dtype=torch.bool)
    while True:
        nxt = _bool_matmul(reach, reach)
        if torch.equal(nxt, reach):
            return reach
        reach = nxt


class _BudgetExceeded(Exception):
    pass


def _walk_search(classes: torch.Tensor, visits: int, budget: int | None = None) -> bool:
    """Is there a walk over the nodes of ``classes`` (bool [m, m]) that, lifted to ``visits``
    interchangeable copies per node, visits every copy exactly once?

    Moving between two copies of one node needs its self loop.  Such a node's visits can be
    padded in place, so it only needs 1..visits separate entries; a node without a self loop
    needs exactly ``visits`` entries (never two in a row).  Exhaustive depth-first search over
    (entries used per node, current node) with memoized failures and a reachability cut;
    raises _BudgetExceeded past ``budget`` search states.
    """
    budget = HAMILTONIAN_SEARCH_BUDGET if budget is None else budget
    m = classes.shape[0]
    rows = classes.tolist()
    out = [sum(1 << w for w in range(m) if rows[v][w] and w != v) for v in range(m)]
    need = [1 if (rows[v][v] or visits == 1) else visits for v in range(m)]
    degree = [bin(o).count("1") for o in out]
    indeg = [sum(1 for u in range(m) if out[u] >> v & 1) for v in range(m)]
    everyone = (1 << m) - 1

    def bits(x):
        while x:
            low = x & -x
            yield low.bit_length() - 1
            x ^= low

    def reaches_all(cur, todo, avail):
        # every node still to visit must be reachable through nodes with entries left
        seen = frontier = 1 << cur
        while frontier and todo & ~seen:
            nxt = 0
            for v in bits(frontier):
                nxt |= out[v]
            frontier = nxt & avail & ~seen
            seen |= frontier
        return not todo & ~seen

    def moves(cur, todo, avail):
        # nodes still to visit first, then those with fewest onward moves (Warnsdorff)
        return sorted(bits(out[cur] & avail), key=lambda w: (not todo >> w & 1, degree[w]))

    failed: set = set()
    states = 0
    for start in sorted(range(m), key=lambda v: indeg[v]):
        counts = [0] * m  # entries used per node
        todo, avail = everyone, everyone

        def enter(v):
            nonlocal todo, avail
            counts[v] += 1
            if counts[v] == need[v]:
                todo &= ~(1 << v)
            if counts[v] == visits:
                avail &= ~(1 << v)

        def leave(v):
            nonlocal todo, avail
            if counts[v] == need[v]:
                todo |= 1 << v
            if counts[v] == visits:
                avail |= 1 << v
            counts[v] -= 1

        enter(start)
        if (tuple(counts), start) in failed:
            continue
        stack = [(start, iter(moves(start, todo, avail)))]
        while stack:
            if not todo:
                return True
            cur, it = stack[-1]
            for w in it:
                enter(w)
                key = (tuple(counts), w)
                if key in failed:
                    leave(w)
                    continue
                states += 1
                if states > budget:
                    raise _BudgetExceeded
                if not reaches_all(w, todo & ~(1 << w), avail | (1 << w)):
                    failed.add(key)
                    leave(w)
                    continue
                stack.append((w, iter(moves(w, todo, avail))))
                break
            else:
                stack.pop()
                failed.add((tuple(counts), cur))
                leave(cur)
    return False

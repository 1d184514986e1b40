"""``attnkit.hopfield``: classical and dense associative memories on ±1 patterns.

- :class:`ClassicalHopfield` -- the Hopfield (1982) network: Hebbian weights
  W = (1/d) Σ_μ ξ^μ ξ^μᵀ with zero diagonal, sign updates (synchronous or asynchronous),
  energy E(σ) = −½ σᵀ W σ.
- :class:`DenseAssociativeMemory` -- E(σ) = −Σ_μ F(ξ^μ · σ) with the polynomial interaction
  F(z) = z^a of Krotov & Hopfield (2016) (optionally rectified, F(z) = max(z, 0)^a) or the
  exponential F(z) = exp(β z) of Demircigil et al. (2017).

Both work on many probes at once: a state is ``[..., d]`` (any leading batch dims, e.g.
``[B, d]`` for B probes) and every update is one tensor operation over all probes; the
asynchronous update loops over neurons only.  These are the binary memories that the capacity
experiments use; the continuous (modern) Hopfield update is :func:`attnkit.hopfield_update`.

Conventions shared by both classes:

- Patterns and states hold ±1 values in a floating dtype (ValueError otherwise); results come
  back in the state's dtype.
- A neuron whose update is undecided (local field, or energy difference, exactly 0) keeps its
  current value.  This makes every asynchronous flip strictly lower the energy, so the
  asynchronous dynamics always reaches a fixed point.
- ``update(state, mode="sync" | "async", steps=1, generator=None)``: ``steps`` is the number of
  synchronous updates or asynchronous sweeps (one sweep visits every neuron once); ``steps=None``
  repeats until no probe changes (at most ``max_steps=100``; a synchronous run can end in a
  2-cycle, in which case it stops there after ``max_steps``).  Asynchronous sweeps visit the
  neurons in index order, or, with ``generator``, in a random order drawn from it each sweep
  (the same order for every probe: that is what keeps the probes one batched operation).
"""
from __future__ import annotations

import math

import torch

from ._validation import check_choice, check_int, check_real

__all__ = ["ClassicalHopfield", "DenseAssociativeMemory"]

_MAX_STEPS = 100


def _check_pm1(fn: str, name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor of ±1 values; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{fn}: {name} must have a floating dtype; got {str(x.dtype).replace('torch.', '')}")
    if x.numel() and not bool(((x == 1) | (x == -1)).all()):
        raise ValueError(f"{fn}: {name} must hold only ±1 values")


def _check_patterns(fn: str, patterns) -> None:
    _check_pm1(fn, "patterns", patterns)
    if patterns.dim() != 2:
        raise ValueError(f"{fn}: patterns must be [P, d]; got shape {tuple(patterns.shape)}")
    if patterns.shape[1] < 1:
        raise ValueError(f"{fn}: patterns must have d >= 1 neurons; got shape {tuple(patterns.shape)}")


class _BinaryMemory:
    """Shared driver: validation, step loop, asynchronous neuron order."""

    _name = "attnkit.hopfield._BinaryMemory"

    def __init__(self, patterns: torch.Tensor):
        _check_patterns(self._name, patterns)
        self.patterns = patterns
        self.num_patterns, self.dim = patterns.shape

    def _check_state(self, fn: str, state) -> None:
        _check_pm1(fn, "state", state)
        if state.dim() < 1 or state.shape[-1] != self.dim:
            raise ValueError(f"{fn}: state must be [..., {self.dim}]; got shape {tuple(state.shape)}")
        if state.device != self.patterns.device:
            raise ValueError(
                f"{fn}: state must be on the patterns' device {self.patterns.device}; got {state.device}"
            )

    # Subclasses: one synchronous update of s [M, d] (work dtype); one asynchronous sweep in place.
    def _sync(self, s: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _sweep(self, s: torch.Tensor, order) -> torch.Tensor:
        raise NotImplementedError

    def _work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.patterns.dtype

    def update(self, state: torch.Tensor, mode: str = "sync", steps: int | None = 1,
               generator: torch.Generator | None = None, max_steps: int = _MAX_STEPS) -> torch.Tensor:
        """Apply ``steps`` sign updates to ``state`` [..., d] (±1); returns the new state, same shape
        and dtype.  ``mode``: ``"sync"`` (all neurons at once) or ``"async"`` (one neuron at a time,
        ``steps`` sweeps).  ``steps=None``: until no probe changes, at most ``max_steps``."""
        fn = f"{self._name}.update"
        self._check_state(fn, state)
        check_choice(fn, "mode", mode, ("sync", "async"))
        if steps is not None:
            check_int(fn, "steps", steps, low=0)
        check_int(fn, "max_steps", max_steps, low=1)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"{fn}: generator must be a torch.Generator or None; got {type(generator).__name__}")
        shape = state.shape
        s = state.reshape(-1, self.dim).to(self._work_dtype(state.dtype)).clone()
        if s.shape[0] == 0:
            return state.clone()
        limit = max_steps if steps is None else steps
        for _ in range(limit):
            if mode == "sync":
                new = self._sync(s)
            else:
                if generator is None:
                    order = range(self.dim)
                else:
                    order = torch.randperm(self.dim, generator=generator, device=generator.device).tolist()
                new = self._sweep(s.clone(), order)
            done = steps is None and not bool((new != s).any())
            s = new
            if done:
                break
        return s.to(state.dtype).reshape(shape)

    def energy(self, state: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ClassicalHopfield(_BinaryMemory):
    r"""The classical Hopfield network with Hebbian weights.

    ``W = (1/d) Σ_μ ξ^μ ξ^μᵀ`` with the diagonal set to 0 (no self-coupling).  The 1/d makes the
    local field h = W σ of order 1 (signal 1, crosstalk of standard deviation ≈ √(P/d)); it does
    not change any sign update, only the scale of the energy ``E(σ) = −½ σᵀ W σ``.  Zero diagonal
    and symmetric W make every asynchronous flip lower E.  Capacity: retrieval breaks down near
    P ≈ 0.14 d (Amit, Gutfreund & Sompolinsky 1985).

    Args:
        patterns: ``[P, d]`` of ±1 values (floating dtype); P may be 0 (then W = 0).

    Example::

        >>> xi = torch.randint(0, 2, (10, 200)).float() * 2 - 1
        >>> net = attnkit.hopfield.ClassicalHopfield(xi)
        >>> noisy = xi * torch.where(torch.rand(10, 200) < 0.1, -1.0, 1.0)
        >>> bool((net.update(noisy, steps=None) == xi).all())
        True
    """

    _name = "attnkit.hopfield.ClassicalHopfield"

    def __init__(self, patterns: torch.Tensor):
        super().__init__(patterns)
        # Decisions use the integer-valued Σ_μ ξ^μ ξ^μᵀ (exact in floating point while P < 2^24
        # in float32, 2^53 in float64), so an exactly zero field is seen as 0 and keeps the
        # neuron: the 1/d of `weight` would round and turn such ties into random flips.
        hebb = patterns.t() @ patterns
        hebb.fill_diagonal_(0)
        self._hebb = hebb
        self.weight = hebb / self.dim

    def _sync(self, s):
        h = s @ self._hebb
        # An undecided neuron (h = 0) keeps its value.
        return torch.where(h == 0, s, torch.sign(h))

    def _sweep(self, s, order):
        w = self._hebb
        for i in order:
            h = s @ w[:, i]  # [M]: d × the local field of neuron i for every probe (W_ii = 0)
            s[:, i] = torch.where(h == 0, s[:, i], torch.sign(h))
        return s

    def energy(self, state: torch.Tensor) -> torch.Tensor:
        """``E(σ) = −½ σᵀ W σ`` of each probe: ``[..., d] -> [...]`` in the state's dtype."""
        fn = f"{self._name}.energy"
        self._check_state(fn, state)
        s = state.to(self._hebb.dtype)
        return (-0.5 / self.dim * ((s @ self._hebb) * s).sum(-1)).to(state.dtype)


class DenseAssociativeMemory(_BinaryMemory):
    r"""Dense associative memory: energy ``E(σ) = −Σ_μ F(ξ^μ · σ)``.

    Interactions:

    - ``"poly"``: ``F(z) = z^a`` with ``a = degree`` (Krotov & Hopfield 2016); with
      ``rectified=True``, ``F(z) = max(z, 0)^a`` (their rectified polynomial).  Capacity grows
      like d^(a−1); a = 2 is exactly the classical network (the update equals
      :class:`ClassicalHopfield`'s).
    - ``"exp"``: ``F(z) = exp(β z)`` (Demircigil et al. 2017; β = ``beta``, default 1):
      capacity exponential in d.

    Update of neuron i (the energy-minimizing choice of σ_i with the others fixed, Krotov &
    Hopfield's rule): ``σ_i ← sign(Σ_μ F(ξ^μ_i + Σ_{j≠i} ξ^μ_j σ_j) − F(−ξ^μ_i + Σ_{j≠i} ξ^μ_j σ_j))``,
    unchanged when the difference is 0.  The synchronous mode applies it to all neurons from the
    same old state.

    How it is vectorized: with m_μ = ξ^μ·σ and x = ξ^μ_i σ_i ∈ {±1}, flipping σ_i changes m_μ
    to m_μ − 2x, and F(m − 2x) = E(m) − x O(m) with E = (F(m+2) + F(m−2))/2 and
    O = (F(m+2) − F(m−2))/2.  So σ_i stays iff the margin
    ``Σ_μ [F(m_μ) − E(m_μ)] + σ_i Σ_μ O(m_μ) ξ^μ_i`` is > 0, flips iff < 0: one [probes, P] × [P, d]
    matrix product per synchronous update (no [probes, P, d] tensor).  For F = exp(βz) the
    margin divided by sinh(2β) Σ_μ exp(β m_μ) is ``σ_i (softmax(β m) ξ)_i − tanh β``: no overflow
    for any d or β.  Polynomials are evaluated in float64 on z·2^−k with 2^k ≥ d + 2 (a power of
    two: an exact scaling, so integer-valued fields, and exact ties, stay exact while the values
    fit float64's 53-bit mantissa, and nothing overflows).  :meth:`energy` returns the true,
    unscaled energy in float64 (the exponential one overflows to −inf once β·d exceeds ≈ 709).

    Args:
        patterns: ``[P, d]`` of ±1 values, P ≥ 1.
        interaction: ``"poly"`` or ``"exp"``.
        degree: the polynomial degree a, an int ≥ 1 (``"poly"`` only).
        rectified: use max(z, 0)^a (``"poly"`` only).
        beta: β > 0 for ``"exp"`` (``"exp"`` only).

    Example::

        >>> xi = torch.randint(0, 2, (300, 64)).double() * 2 - 1   # P = 300 > 4 d
        >>> mem = attnkit.hopfield.DenseAssociativeMemory(xi, "exp")
        >>> noisy = xi * torch.where(torch.rand(300, 64) < 0.1, -1.0, 1.0)
        >>> bool((mem.update(noisy) == xi).all(-1).float().mean() > 0.99)   # one step retrieves
        True
    """

    _name = "attnkit.hopfield.DenseAssociativeMemory"

    def __init__(self, patterns: torch.Tensor, interaction: str = "poly", degree: int = 3, *,
                 rectified: bool = False, beta: float = 1.0):
        super().__init__(patterns)
        fn = self._name
        check_choice(fn, "interaction", interaction, ("poly", "exp"))
        check_int(fn, "degree", degree, low=1)
        check_real(fn, "beta", beta, low=0, low_inclusive=False)
        if not isinstance(rectified, bool):
            raise TypeError(f"{fn}: rectified must be a bool; got {rectified!r}")
        if self.num_patterns < 1:
            raise ValueError(f"{fn}: patterns must hold at least one pattern (P >= 1)")
        self.interaction, self.degree, self.rectified, self.beta = interaction, degree, rectified, float(beta)
        # 2^-k with 2^k >= d + 2 >= |z ± 2|: an exact rescaling of the polynomial arguments.
        self._scale = 2.0 ** -math.ceil(math.log2(self.dim + 2))
        self._xi = patterns.to(torch.float64)  # all decisions in float64

    def _work_dtype(self, dtype):
        return torch.float64

    def _f(self, z: torch.Tensor) -> torch.Tensor:
        if self.rectified:
            z = z.clamp_min(0)
        return z.pow(self.degree)

    def _margin(self, m: torch.Tensor, s_cols: torch.Tensor, xi_cols: torch.Tensor) -> torch.Tensor:
        """Stay margin of the neurons ``cols``: m [M, P] overlaps, s_cols [M, k], xi_cols [P, k].
        > 0: keep σ_i; < 0: flip it; 0: undecided (keep)."""
        if self.interaction == "exp":
            p = torch.softmax(self.beta * m, dim=-1)
            return s_cols * (p @ xi_cols) - math.tanh(self.beta)
        z, two = m * self._scale, 2.0 * self._scale
        f0, fp, fm = self._f(z), self._f(z + two), self._f(z - two)
        even = (f0 - 0.5 * (fp + fm)).sum(dim=-1, keepdim=True)  # [M, 1]
        return even + s_cols * ((0.5 * (fp - fm)) @ xi_cols)

    def _sync(self, s):
        m = s @ self._xi.t()  # [M, P] overlaps
        return torch.where(self._margin(m, s, self._xi) < 0, -s, s)

    def _sweep(self, s, order):
        m = s @ self._xi.t()  # [M, P], kept current as neurons flip
        for i in order:
            xi_i = self._xi[:, i:i + 1]  # [P, 1]
            old = s[:, i:i + 1]  # [M, 1]
            new = torch.where(self._margin(m, old, xi_i) < 0, -old, old)
            # Only the flipped probes change their overlaps: m_μ += ξ^μ_i (new − old).
            m = m + (new - old) * xi_i.t()
            s[:, i:i + 1] = new
        return s

    def energy(self, state: torch.Tensor) -> torch.Tensor:
        """``E(σ) = −Σ_μ F(ξ^μ · σ)`` of each probe: ``[..., d] -> [...]`` in float64."""
        fn = f"{self._name}.energy"
        self._check_state(fn, state)
        m = state.to(torch.float64) @ self._xi.t()
        if self.interaction == "exp":
            return -torch.exp(self.beta * m).sum(-1)
        if self.rectified:
            m = m.clamp_min(0)
        return -m.pow(self.degree).sum(-1)


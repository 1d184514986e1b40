r"""Universal prediction of binary sequences: the LZ78 (incremental parsing) predictor against the
Markov / finite-state predictability, and a small attnkit transformer as a sequential predictor.

Sources: the ECE 598 lecture (``shared/seeds/000``, "Transformers as universal predictors?");
M. Feder, N. Merhav, M. Gutman, "Universal prediction of individual sequences", IEEE Trans.
Inform. Theory 38(4), 1992 (FMG): the k-th order Markov predictability
μ_k(xⁿ) = (1/n) Σ_s min(N_s(0), N_s(1)) (N_s(b): how often context s was followed by b), the
finite-state predictability π(x) = lim_k lim sup_n μ_k(xⁿ) (the best error rate of any
finite-state predictor), and the sequential predictor built on Lempel–Ziv incremental parsing
whose error rate approaches π(x) for every sequence.

Command: ``python -m attnkit theory prediction [--quick] [--out DIR] [--seed S]`` prints, for an
alternating, two Bernoulli and an order-2 Markov source, the error rates of the majority
predictor, LZ78 and a trained causal transformer next to the predictability, and writes
``prediction.png`` (default folder ``bench/out/theory/``).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ._threads import intra_op_threads as _threads

__all__ = [
    "LZ78Predictor",
    "lz78_predictor",
    "MajorityPredictor",
    "majority_predictor",
    "error_rate",
    "markov_predictability",
    "predictability",
    "alternating",
    "bernoulli",
    "MarkovBits",
    "markov_bits",
    "TransformerPredictor",
    "train_transformer_predictor",
    "main",
]




# ----------------------------------------------------------------------------------------------
# Sequential predictors
# ----------------------------------------------------------------------------------------------

class LZ78Predictor:
    r"""The sequential predictor of FMG (1992, Sec. V) based on LZ78 incremental parsing.

    The past is parsed into phrases, each the shortest string not seen as a phrase before; the
    phrases form a binary tree (the root is the empty phrase).  A pointer walks down the tree
    from the root as the current phrase grows.  Each node keeps N(0), N(1): how often, standing
    at this node, the next bit was 0 / 1.

    - ``predict()``: the majority bit at the current node, argmax_b N(b) (ties, e.g. at a node
      never visited: 0 -- choice: FMG randomize, predicting 1 with a probability φ(N(1)/N) that
      is ½ at ties; a fixed tie-break keeps runs reproducible and changes nothing
      asymptotically).
    - ``update(bit)``: count ``bit`` at the current node, then step to its child ``bit``; if that
      child does not exist, the phrase ends there: the child is created (a new leaf, counts 0)
      and the pointer returns to the root.

    ``phrases``: the number of complete phrases so far (c(n) ≈ n h / log₂ n for a source of
    entropy rate h bits, Ziv–Lempel).  Pure Python, about 0.3–0.5 µs per bit.
    """

    __slots__ = ("_c0", "_c1", "_k0", "_k1", "_node", "phrases", "steps")

    def __init__(self):
        self._c0, self._c1, self._k0, self._k1 = [0], [0], [-1], [-1]
        self._node = 0
        self.phrases = 0
        self.steps = 0

    def predict(self) -> int:
        n = self._node
        return 1 if self._c1[n] > self._c0[n] else 0

    def update(self, bit: int) -> None:
        n = self._node
        if bit:
            self._c1[n] += 1
            nxt = self._k1[n]
        else:
            self._c0[n] += 1
            nxt = self._k0[n]
        self.steps += 1
        if nxt < 0:
            new = len(self._c0)
            self._c0.append(0)
            self._c1.append(0)
            self._k0.append(-1)
            self._k1.append(-1)
            if bit:
                self._k1[n] = new
            else:
                self._k0[n] = new
            self._node = 0
            self.phrases += 1
        else:
            self._node = nxt

    @property
    def nodes(self) -> int:
        """Nodes of the parsing tree (root included)."""
        return len(self._c0)


def lz78_predictor() -> LZ78Predictor:
    """A fresh :class:`LZ78Predictor` (``.predict()`` -> next bit, ``.update(bit)``)."""
    return LZ78Predictor()


class MajorityPredictor:
    """The order-0 predictor: the majority of all bits so far (ties -> 0, as in
    :class:`LZ78Predictor`).  On 0101… it errs exactly every other bit (the ties fall before
    the 0s)."""

    __slots__ = ("ones", "steps")

    def __init__(self):
        self.ones = 0
        self.steps = 0

    def predict(self) -> int:
        return 1 if 2 * self.ones > self.steps else 0

    def update(self, bit: int) -> None:
        self.ones += bit
        self.steps += 1


def majority_predictor() -> MajorityPredictor:
    """A fresh :class:`MajorityPredictor`."""
    return MajorityPredictor()


def error_rate(x: Sequence[int], predictor) -> float:
    """Run ``predictor`` (``.predict()``, ``.update(bit)``) sequentially over the bits ``x`` --
    predict x_t from x_0..x_{t−1}, then reveal it -- and return the fraction of wrong
    predictions.  ``predictor`` is an object or a zero-argument factory."""
    if callable(predictor) and not hasattr(predictor, "predict"):
        predictor = predictor()
    bits = x.tolist() if hasattr(x, "tolist") else list(x)
    if not bits:
        raise ValueError("error_rate: empty sequence")
    predict, update = predictor.predict, predictor.update
    errors = 0
    for b in bits:
        errors += predict() != b
        update(b)
    return errors / len(bits)


# ----------------------------------------------------------------------------------------------
# Predictability
# ----------------------------------------------------------------------------------------------

def _as_bits(x) -> np.ndarray:
    a = np.asarray(x.tolist() if hasattr(x, "tolist") else x, dtype=np.int64).reshape(-1)
    if a.size and not np.all((a == 0) | (a == 1)):
        raise ValueError("expected a sequence of bits (0/1)")
    return a


def markov_predictability(x, k: int) -> float:
    r"""FMG's k-th order Markov predictability of the bits ``x``:

    ``μ_k(xⁿ) = (1/n) Σ_{s ∈ {0,1}^k} min(N_s(0), N_s(1))``

    where N_s(b) counts the t with context (x_{t−k}, …, x_{t−1}) = s and x_t = b: the error rate
    of the best order-k Markov predictor chosen in hindsight.  Convention (FMG fix an initial
    state): the first k bits see a context padded with zeros (x_{−k} … x_{−1} = 0), so all n
    positions count.  μ_0 is min(#0, #1)/n.
    """
    a = _as_bits(x)
    n = a.size
    if n == 0:
        raise ValueError("markov_predictability: empty sequence")
    if k < 0:
        raise ValueError(f"markov_predictability: k must be >= 0; got {k}")
    ctx = np.zeros(n, dtype=np.int64)
    padded = np.concatenate([np.zeros(k, dtype=np.int64), a])
    for j in range(k):  # context digit j (oldest first): x_{t−k+j}
        ctx = ctx * 2 + padded[j:j + n]
    counts = np.bincount(ctx * 2 + a, minlength=2 ** (k + 1)).reshape(-1, 2)
    return float(np.minimum(counts[:, 0], counts[:, 1]).sum()) / n


def predictability(x, max_order: Optional[int] = None) -> float:
    r"""Estimate of FMG's finite-state predictability π(x) = lim_k lim sup_n μ_k(xⁿ).

    μ_k(xⁿ) is non-increasing in k (a finer context can only lower the best in-hindsight
    error), but at finite n a large k overfits (2^k contexts with few samples each, μ_k → 0).
    Choice: μ_K with K = ``max_order`` or, by default, K = ⌊½ log₂ n⌋, so the 2^K ≤ √n contexts
    see about √n bits each and the in-hindsight bias stays O(n^(−1/4)).
    """
    a = _as_bits(x)
    k = max(0, int(0.5 * math.log2(max(a.size, 1)))) if max_order is None else max_order
    return markov_predictability(a, k)


# ----------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------

def alternating(n: int) -> np.ndarray:
    """``0101…`` of length n (int64)."""
    return (np.arange(n) % 2).astype(np.int64)


def bernoulli(n: int, p: float, seed: int = 0) -> np.ndarray:
    """n i.i.d. Bernoulli(p) bits; its predictability is min(p, 1 − p)."""
    return (np.random.default_rng(seed).random(n) < p).astype(np.int64)


@dataclass(frozen=True)
class MarkovBits:
    r"""A binary order-k Markov source: ``p1[s]`` = P(x_t = 1 | context s), the context
    (x_{t−k}, …, x_{t−1}) read as a binary number (oldest bit most significant).

    ``stationary()``: the stationary distribution π of the contexts; ``predictability``:
    Σ_s π(s) min(p1[s], 1 − p1[s]), the limit of μ_k for every k ≥ the order (and of π(x)),
    i.e. the error rate of the Bayes predictor.
    """

    p1: tuple[float, ...]

    @property
    def order(self) -> int:
        return int(round(math.log2(len(self.p1))))

    def stationary(self) -> np.ndarray:
        k, m = self.order, len(self.p1)
        t = np.zeros((m, m))
        for s in range(m):
            for b, pb in ((0, 1 - self.p1[s]), (1, self.p1[s])):
                t[s, (s * 2 + b) % m] += pb
        w, v = np.linalg.eig(t.T)
        pi = np.real(v[:, np.argmin(np.abs(w - 1))])
        return pi / pi.sum() if k else np.ones(1)

    @property
    def predictability(self) -> float:
        pi = self.stationary()
        return float(sum(pi[s] * min(p, 1 - p) for s, p in enumerate(self.p1)))

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """n bits started from the stationary distribution."""
        rng = np.random.default_rng(seed)
        k, m = self.order, len(self.p1)
        s = int(rng.choice(m, p=self.stationary()))
        out = np.empty(n, dtype=np.int64)
        u = rng.random(n)
        p1 = self.p1
        for j in range(min(k, n)):
            out[j] = (s >> (k - 1 - j)) & 1
        for t in range(k, n):
            b = 1 if u[t] < p1[s] else 0
            out[t] = b
            s = (s * 2 + b) % m
        return out


def markov_bits(p1: Sequence[float]) -> MarkovBits:
    """A :class:`MarkovBits` source with P(1 | context s) = ``p1[s]`` (len(p1) = 2^order)."""
    p1 = tuple(float(p) for p in p1)
    m = len(p1)
    if m < 1 or m & (m - 1):
        raise ValueError("markov_bits: len(p1) must be a power of two (2^order)")
    if not all(0 <= p <= 1 for p in p1):
        raise ValueError("markov_bits: probabilities must be in [0, 1]")
    return MarkovBits(p1)


# ----------------------------------------------------------------------------------------------
# A transformer as a sequential predictor (the command)
# ----------------------------------------------------------------------------------------------

class TransformerPredictor:
    r"""A trained causal transformer (:class:`attnkit.theory._model.TinyCausalTransformer` on
    :func:`attnkit.softmax_attention`) used as a sequential bit predictor with a window of
    ``context`` bits.

    Input: the bits one-hot ``[B, N, 2]``; output at position i: logits of x_{i+1} given
    x_0..x_i.  ``predict()`` / ``update(bit)`` (the predictor interface; one forward pass per
    bit over the last ``context`` bits) and :meth:`error_rate` (batched: the sequence is cut into
    windows of ``context`` bits with stride ``context/2``; each bit is predicted once, from a
    window position with at least ``context/2`` bits before it -- the first ``context/2`` bits
    from the shorter prefix).
    """

    def __init__(self, model, context: int, threads: Optional[int] = 1):
        self.model = model
        self.context = context
        self.threads = threads
        self._past: list[int] = []

    def _logits(self, windows: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.one_hot(windows, 2).to(next(self.model.parameters()).dtype)
        with torch.no_grad(), _threads(self.threads):
            return self.model(x)

    def predict(self) -> int:
        if not self._past:
            return 0
        w = torch.tensor(self._past[-self.context:], dtype=torch.long)[None]
        logits = self._logits(w)[0, -1]
        return int(logits[1] > logits[0])

    def update(self, bit: int) -> None:
        self._past.append(int(bit))
        if len(self._past) > 4 * self.context:
            del self._past[:-self.context]

    def error_rate(self, x) -> float:
        """Fraction of wrong predictions over the bits ``x`` (see the class docstring); the first
        bit is predicted as 0."""
        a = torch.as_tensor(_as_bits(x))
        n, c = a.numel(), self.context
        half = c // 2
        errors = int(a[0] != 0)
        # first window: predict bits 1..c−1 from their prefixes
        first = a[:min(c, n)]
        if first.numel() > 1:
            pred = self._logits(first[None])[0, :-1].argmax(-1)
            errors += int((pred != first[1:]).sum())
        # then windows starting at k·half: predict their second half
        starts = list(range(half, max(n - c, 0) + 1, half)) if n > c else []
        done = min(c, n)
        chunk = 256
        for i in range(0, len(starts), chunk):
            st = torch.tensor(starts[i:i + chunk])
            idx = st[:, None] + torch.arange(c)[None]
            w = a[idx]
            pred = self._logits(w)[:, half - 1:c - 1].argmax(-1)
            errors += int((pred != w[:, half:]).sum())
            done = int(st[-1]) + c
        if done < n:  # the tail: one window ending at n
            w = a[n - c:n][None]
            k = n - done
            pred = self._logits(w)[0, c - 1 - k:c - 1].argmax(-1)
            errors += int((pred != w[0, c - k:]).sum())
        return errors / n


def train_transformer_predictor(sample: Callable[[int, int, np.random.Generator], np.ndarray], *,
                                context: int = 64, steps: int = 600, batch: int = 32, d_model: int = 32,
                                n_layers: int = 2, n_heads: int = 2, lr: float = 3e-3, seed: int = 0,
                                progress: bool = True, desc: str = "transformer",
                                threads: Optional[int] = 1) -> TransformerPredictor:
    r"""Train a small causal transformer (``attnkit.theory._model``, softmax attention on attnkit)
    to predict the next bit of windows drawn by ``sample(batch, length, rng)`` (``[batch, length]``
    bits): cross-entropy of x_{i+1} given x_0..x_i at every position of windows of
    ``context + 1`` bits, fresh windows each step (no data limit), AdamW at ``lr`` with 50
    warm-up steps.  Returns a :class:`TransformerPredictor`.  Choices: d_model 32, 2 layers,
    2 heads, float32 -- small enough for a CPU run of a minute per source.  ``threads``: torch
    intra-op threads for training and evaluation (default 1; None keeps torch's setting).
    """
    from ._model import TinyCausalTransformer, train_model

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = TinyCausalTransformer(d_in=2, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_out=2,
                                  max_len=context)

    def batch_fn(step):
        w = torch.as_tensor(sample(batch, context + 1, rng), dtype=torch.long)
        return w

    def loss_fn(m, w):
        x = torch.nn.functional.one_hot(w[:, :-1], 2).to(torch.float32)
        logits = m(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 2), w[:, 1:].reshape(-1))

    with _threads(threads):
        train_model(model, batch_fn, loss_fn, steps, lr=lr, warmup=min(50, steps // 4), progress=progress,
                    desc=desc)
    return TransformerPredictor(model, context, threads=threads)


def _window_sampler(kind: str, src=None, p: float = 0.5):
    """``sample(batch, length, rng)`` for the command's sources."""
    if kind == "alternating":
        return lambda b, n, rng: (np.arange(n)[None] + rng.integers(0, 2, (b, 1))) % 2
    if kind == "bernoulli":
        return lambda b, n, rng: (rng.random((b, n)) < p).astype(np.int64)

    def markov(b, n, rng):
        k, m = src.order, len(src.p1)
        s = rng.choice(m, size=b, p=src.stationary())
        out = np.empty((b, n), dtype=np.int64)
        for j in range(min(k, n)):
            out[:, j] = (s >> (k - 1 - j)) & 1
        p1 = np.asarray(src.p1)
        for t in range(k, n):
            bit = (rng.random(b) < p1[s]).astype(np.int64)
            out[:, t] = bit
            s = (s * 2 + bit) % m
        return out

    return markov


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m attnkit theory prediction``: error rates of majority, LZ78 and a transformer
    against the predictability; ``prediction.png``."""
    ap = argparse.ArgumentParser(prog="python -m attnkit theory prediction",
                                 description="universal prediction: LZ78 vs Markov predictability vs a transformer")
    ap.add_argument("--quick", action="store_true", help="short sequences, a few training steps")
    ap.add_argument("--out", default="bench/out/theory", help="folder for prediction.png (default bench/out/theory)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    n = 2 ** 14 if args.quick else 2 ** 20
    steps = 20 if args.quick else 600
    context = 32 if args.quick else 64
    chain = markov_bits([0.1, 0.9, 0.8, 0.1])
    sources = [
        ("0101...", alternating(n), 0.0, _window_sampler("alternating")),
        ("Bernoulli(0.1)", bernoulli(n, 0.1, args.seed), 0.1, _window_sampler("bernoulli", p=0.1)),
        ("Bernoulli(0.3)", bernoulli(n, 0.3, args.seed), 0.3, _window_sampler("bernoulli", p=0.3)),
        ("order-2 Markov", chain.sample(n, args.seed), chain.predictability, _window_sampler("markov", chain)),
    ]
    print(f"# Universal prediction, n = {n} bits per source (error rates; LZ78 = Feder–Merhav–Gutman's"
          " incremental-parsing predictor)\n")
    rows, curves = [], {}
    checkpoints = [2 ** k for k in range(10, int(math.log2(n)) + 1, 2)]
    for name, x, bound, sampler in sources:
        maj = error_rate(x, majority_predictor())
        lz = lz78_predictor()
        errs, cum, bits = [], 0, x.tolist()
        for t, b in enumerate(bits, 1):
            cum += lz.predict() != b
            lz.update(b)
            if t in checkpoints:
                errs.append(cum / t)
        curves[name] = errs
        tf = train_transformer_predictor(sampler, context=context, steps=steps, seed=args.seed,
                                         desc=f"transformer {name}")
        tf_err = tf.error_rate(x)
        rows.append([name, f"{bound:.4f}", f"{markov_predictability(x, 2):.4f}", f"{predictability(x):.4f}",
                     f"{maj:.4f}", f"{cum / n:.4f}", f"{lz.phrases / n:.4f}", f"{tf_err:.4f}"])
    print(_table(rows, ["source", "Bayes", "mu_2(x)", "pi(x) est", "majority", "LZ78", "c(n)/n",
                        f"transformer (window {context})"]))
    print("\nBayes: the source's predictability (alternating 0; Bernoulli min(p, 1-p); the chain "
          "Σ π(s) min(p_s, 1-p_s) = 0.12).")
    print("LZ78 approaches it slowly (its excess is of the order of the phrase rate c(n)/n ~ h / log2 n); "
          f"the transformer (trained on fresh windows of {context} bits) predicts the same n bits, each from a window "
          f"with >= {context // 2} bits of past.")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, _, bound, _) in enumerate(sources):
        ax.semilogx(checkpoints, curves[name], "o-", color=f"C{i}", label=f"LZ78, {name}")
        ax.axhline(bound, color=f"C{i}", ls=":")
        ax.plot([checkpoints[-1]], [float(rows[i][-1])], "*", ms=12, color=f"C{i}")
    ax.set_xlabel("n (bits)")
    ax.set_ylabel("error rate")
    ax.set_title("LZ78 error rate → predictability (dotted); ★ transformer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "prediction.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))

"""attnkit.theory.prediction: the LZ78 sequential predictor against the Markov / finite-state
predictability of Feder, Merhav & Gutman (1992).

Tolerances from the sequence length n (stated once, used below):

- sampling noise of an error rate near r: 3 binomial standard errors, 3 sqrt(r (1 − r) / n);
- LZ78's learning cost, per phrase of its incremental parsing (c(n) phrases; c(n) ≈ n h / log₂ n
  for entropy rate h bits, Ziv–Lempel, so c(n)/n → 0 like 1/log n).  In each phrase the first k
  predictions stand at nodes whose path holds fewer than k bits of the current order-k context:
  the j-th costs about μ_j − μ_k more than the order-k predictor.  Deeper nodes see the whole
  context and learn its majority bit; we allow one wrong-majority error per node (the expected
  number of wrong majority votes at a node is O(1) when the context's bias |1 − 2 P(1|s)| is
  not small -- ≥ 0.4 for every source below).  So the tolerance is
  ``(Σ_{j<k} (μ_j − μ_k) + 1) · c(n)/n + 3 σ``.  Seen at n = 2^20: the excess is 0.06–0.65 of
  c(n)/n for Bernoulli, 0.96 c(n)/n for the order-2 chain (whose context deficit alone is
  0.56 c(n)/n), about one error per phrase on 0101….
- "approaches": the excess at n = 2^20 is also smaller than the mean excess of 8 runs at 2^14.
"""
import math

import numpy as np
import pytest

from attnkit.theory import prediction
from attnkit.theory.prediction import (
    alternating,
    bernoulli,
    error_rate,
    lz78_predictor,
    majority_predictor,
    markov_bits,
    markov_predictability,
    predictability,
)

N = 2 ** 20  # long runs: pure-Python LZ78 takes ~0.3 s per million bits


def _lz78(x):
    p = lz78_predictor()
    return error_rate(x, p), p.phrases / len(x)


def test_alternating_majority_errs_half_lz78_goes_to_zero():
    x = alternating(10 ** 5)
    # order 0: ties (even t) predict 0 = x_t, odd t predict 0 ≠ 1: exactly every other bit wrong
    assert error_rate(x, majority_predictor()) == 0.5
    assert markov_predictability(x, 0) == 0.5
    assert markov_predictability(x, 1) == pytest.approx(1e-5)  # only the zero-padded start
    errs = {}
    for n in (10 ** 3, 10 ** 4, 10 ** 5, 10 ** 6):
        e, rate = _lz78(alternating(n))
        errs[n] = e
        # about one error per phrase; phrases grow like 2 sqrt(n) on a periodic sequence
        assert e <= 2 * rate and rate <= (2 * math.sqrt(n) + 2) / n
    # seen: 0.063, 0.0198, 0.0063, 0.0020 -- ~ 2/sqrt(n)
    assert errs[10 ** 3] > errs[10 ** 4] > errs[10 ** 5] > errs[10 ** 6]
    assert errs[10 ** 6] < 0.0025


@pytest.mark.parametrize("p", [0.1, 0.3, 0.8])
def test_lz78_on_bernoulli_approaches_min_p(p):
    target = min(p, 1 - p)
    x = bernoulli(N, p, seed=11)
    e, rate = _lz78(x)
    noise = 3 * math.sqrt(target * (1 - target) / N)
    # k = 0: no context deficit, tolerance c(n)/n + 3σ.
    # seen (seed 11): 0.1 -> 0.1023, 0.3 -> 0.3101, 0.8 -> 0.2340 (excess 0.06, 0.16, 0.65 of the
    # phrase rates 0.037, 0.062, 0.053; for p = 0.8 each fresh node's tie predicts 0, wrong 80 %)
    assert target - noise <= e <= target + rate + noise, (e, rate)
    # … and closer than at n = 2^14 (averaged over 8 short runs)
    short = np.mean([_lz78(bernoulli(2 ** 14, p, seed=s))[0] for s in range(8)])
    assert e - target < short - target
    # the estimated finite-state predictability of the data is min(p, 1 − p)
    assert predictability(x) == pytest.approx(target, abs=noise + 0.01)


def test_lz78_on_order2_markov_approaches_order2_predictability():
    # P(1 | x_{t-2} x_{t-1} = 00, 01, 10, 11): the likely next bit is x_{t-2} XOR x_{t-1}, so
    # neither order 0 nor order 1 predicts it.  π = (0.4, 0.2, 0.2, 0.2), predictability
    # Σ π(s) min(p_s, 1 − p_s) = 0.04 + 0.02 + 0.04 + 0.02 = 0.12.
    src = markov_bits([0.1, 0.9, 0.8, 0.1])
    assert src.stationary() == pytest.approx([0.4, 0.2, 0.2, 0.2], abs=1e-12)
    assert src.predictability == pytest.approx(0.12, abs=1e-12)
    x = src.sample(N, seed=5)
    mu = [markov_predictability(x, k) for k in range(4)]
    noise = 3 * math.sqrt(0.12 * 0.88 / N)
    assert mu[2] == pytest.approx(0.12, abs=noise)  # the data's order-2 predictability
    # order 2 is the right order: μ_0 ≈ μ_1 ≈ 0.40, μ_3 no smaller than μ_2 − noise
    assert mu[1] > mu[2] + 0.25
    assert mu[3] >= mu[2] - noise
    e, rate = _lz78(x)
    deficit = (mu[0] - mu[2]) + (mu[1] - mu[2])  # ≈ 0.56
    # seen (seed 5): LZ78 0.1606 at phrase rate 0.0425 (tolerance 0.066 above μ_2 = 0.1198)
    assert mu[2] - noise <= e <= mu[2] + (deficit + 1) * rate + noise, (e, mu[2], rate)
    short = np.mean([_lz78(src.sample(2 ** 14, seed=s))[0] - markov_predictability(src.sample(2 ** 14, seed=s), 2)
                     for s in range(8)])
    assert e - mu[2] < short  # approaching: seen 0.041 at 2^20 against ≈ 0.07 at 2^14
    assert error_rate(x, majority_predictor()) > mu[2] + 0.25


def test_markov_predictability_by_hand():
    x = [0, 1, 1, 0, 1, 1, 1, 0]
    # k = 0: #0 = 3, #1 = 5 -> 3/8
    assert markov_predictability(x, 0) == 3 / 8
    # k = 1 (x_{-1} = 0): after 0 come 0, 1, 1 (min 1); after 1 come 1, 0, 1, 1, 0 (min 2) -> 3/8
    assert markov_predictability(x, 1) == 3 / 8
    # k = 2 (x_{-2} = x_{-1} = 0): 00 -> 0, 1 (min 1); 01 -> 1, 1; 11 -> 0, 1, 0 (min 1); 10 -> 1
    assert markov_predictability(x, 2) == 2 / 8
    # k = 8: every context is distinct except the zero-padded start (t = 0 and t = 1) -> 1/8
    assert markov_predictability(x, 8) == 1 / 8
    with pytest.raises(ValueError):
        markov_predictability([0, 2], 1)


def test_lz78_parsing_tree():
    # 1011010100010 parses as 1 | 0 | 11 | 01 | 010 | 00 | 10 (LZ78's textbook example)
    p = lz78_predictor()
    for b in "1011010100010":
        p.update(int(b))
    assert p.phrases == 7 and p.nodes == 8
    # predict() is the majority at the current node (root: after phrases 1,0,11,01,010,00,10 the
    # root saw 1 three times and 0 four times -> 0)
    assert p.predict() == 0


def test_command_quick(tmp_path, capsys):
    assert prediction.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "LZ78" in out and "transformer" in out
    assert (tmp_path / "prediction.png").stat().st_size > 1000

"""bench/options.py: the peers compute what attnkit computes (else the ratios compare different
work), and the case lists are what the docstring says.  FlexAttention is left out here (its
torch.compile takes minutes on this machine); the bench checks it against the first peer."""
import torch

from attnkit.bench import options
from attnkit.reference.softmax import softmax_attention_reference  # noqa: F401 - the module loads

import attnkit


def _inputs(option, n=37, h=4):
    x = options._inputs(1, h, n, 8, torch.float64, 3, option)(torch.device("cpu"))
    return x


def _attnkit(option, x, left=0):
    return attnkit.softmax_attention(x["q"], x["k"], x["v"], backend="reference",
                                     **options._kwargs(option, left, x))


def test_dense_band_peer_is_the_window():
    x = _inputs("window")
    torch.testing.assert_close(options._sdpa_band(5)(x), _attnkit("window", x, left=5))


def test_alibi_bias_peer_is_attnkits_alibi():
    x = _inputs("alibi")
    torch.testing.assert_close(options._sdpa_alibi(x), _attnkit("alibi", x))


def test_eager_softcap_and_sink_peers():
    x = _inputs("softcap")
    x["q"] = x["q"] * 20  # scores past the cap, where tanh bends
    torch.testing.assert_close(options._eager_softcap(x), _attnkit("softcap", x))
    x = _inputs("sinks")
    torch.testing.assert_close(options._eager_sinks(x), _attnkit("sinks", x))


def test_window_pairs_counts_the_band():
    for n, left in [(1, 0), (7, 0), (7, 3), (7, 100), (300, 17)]:
        assert options.window_pairs(n, left) == int(options._band(n, left, "cpu").sum())


def test_case_lists():
    cpu = torch.device("cpu")
    assert [c.name for c in options.cases(True, cpu)] == ["window(255,0)-float32-N2048-D64"]
    full = options.cases(False, cpu)
    band = [c for c in full if c.params["N"] == 16384]
    assert len(band) == 1 and band[0].targets == {"attnkit full causal": 8.0}
    assert {c.params["option"] for c in full} == {"window(255,0)", "window(1023,0)", "softcap30",
                                                  "alibi-causal", "sinks"}
    flex_bwd = [i for c in full if c.mode == "fwd+bwd" for i in c.impls if i.name.startswith("FlexAttention")]
    assert flex_bwd and all("no backward on CPU" in i.unavailable for i in flex_bwd)

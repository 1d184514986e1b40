"""Calls past CUDA's grid limit (kernels/_flash.py MAX_GRID_YZ, 65535 on a grid's y / z dims):
the Triton launchers run them on batch slices.  Checked under the interpreter with the limit
lowered, against the same call in one launch (bit for bit: the slices compute the same rows),
and with dropout against the keep mask the launchers document."""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

import attnkit  # noqa: E402
from attnkit.kernels import _flash  # noqa: E402
from attnkit.kernels import softmax as triton_softmax  # noqa: E402
from attnkit.patterns import fixed, strided  # noqa: E402
from attnkit_testing import assert_close_to_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(requires_grad)


def test_batch_slices_cover_the_batch():
    assert _flash.batch_slices(65535) is None and _flash.batch_slices(4095, 16) is None
    slices = _flash.batch_slices(70000)
    assert [(s.start, s.stop) for s in slices] == [(0, 65535), (65535, 70000)]
    slices = _flash.batch_slices(4097, 16)  # 4096 * 16 = 65536 > 65535: 4095 a slice
    assert [(s.start, s.stop) for s in slices] == [(0, 4095), (4095, 4097)]
    with pytest.raises(ValueError, match="grid limit"):
        _flash.batch_slices(2, 70000)


def _results(fn, inputs, g):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(outs[0], [x for x in inputs if x.requires_grad], g)
    return [o.detach() for o in outs] + list(grads)


def _assert_same_with_a_lower_limit(monkeypatch, fn, inputs, g, limit):
    whole = _results(fn, inputs, g)
    monkeypatch.setattr(_flash, "MAX_GRID_YZ", limit)
    sliced = _results(fn, inputs, g)
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)


def test_softmax_in_batch_slices(monkeypatch):
    b, h, hk, n, m, d = 5, 4, 2, 9, 11, 16
    q = _randn(b, h, n, d, seed=1, requires_grad=True)
    k, v = (_randn(b, hk, m, d, seed=i, requires_grad=True) for i in (2, 3))
    mask = _randn(b, 1, n, m, seed=4)  # per batch element: cut with the batch
    alibi = _randn(b, h, seed=5).abs()
    sinks = _randn(h, seed=6, requires_grad=True)
    g = _randn(b, h, n, d, seed=7)

    def call(q, k, v, sinks):
        return attnkit.softmax_attention(q, k, v, mask, enable_gqa=True, window=(6, 2), softcap=3.0,
                                         alibi_slopes=alibi, sinks=sinks, return_lse=True, backend="triton")

    _assert_same_with_a_lower_limit(monkeypatch, call, (q, k, v, sinks), g, limit=4)  # (H = 4 fits; B = 5 does not)


def test_softmax_dropout_in_batch_slices(monkeypatch):
    # Slice i draws its mask with seed + i (dropout_keep_mask says so); out and the gradients are
    # those of that mask.
    monkeypatch.setattr(_flash, "MAX_GRID_YZ", 2)
    b, h, n, m, d, p, seed = 5, 2, 7, 6, 8, 0.3, 1234
    q, k, v = (_randn(b, h, x, d, seed=i, requires_grad=True) for i, x in enumerate((n, m, m)))
    out, lse = triton_softmax.softmax_fwd(q, k, v, None, None, False, p, seed)
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed, DEVICE)
    assert not torch.equal(keep[0], keep[2])  # slices 0 and 1 (seeds 1234, 1235) differ
    scale = 1 / math.sqrt(d)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    probs = torch.softmax(q64 @ k64.transpose(-1, -2) * scale, -1)
    ref = (probs * keep / (1 - p)) @ v64
    assert_close_to_reference(out, ref)
    g = _randn(b, h, n, d, seed=9)
    dq, dk, dv = triton_softmax.softmax_bwd(g, q, k, v, out, lse, None, None, False, p, seed)
    for name, got, want in zip("qkv", (dq, dk, dv), torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert_close_to_reference(got, want, grad=True, name=f"d{name}")


@pytest.mark.parametrize("pattern", [strided(3), fixed(4, 1)], ids=repr)
def test_sparse_in_batch_slices(monkeypatch, pattern):
    # The sparse grids take B * H on one dim: limit 5 with H = 2 is slices of 2 batch elements.
    b, h, n, d = 5, 2, 12, 8
    q, k, v = (_randn(b, h, n, d, seed=i, requires_grad=True) for i in range(3))
    g = _randn(b, h, n, d, seed=4)
    _assert_same_with_a_lower_limit(monkeypatch, lambda q, k, v: attnkit.sparse_attention(q, k, v, pattern,
                                                                                    backend="triton"),
                             (q, k, v), g, limit=5)


def test_hopfield_energy_in_batch_slices(monkeypatch):
    state, stored = _randn(5, 2, 3, 8, seed=1), _randn(5, 2, 10, 8, seed=2)
    whole = attnkit.hopfield_energy(state, stored, beta=0.7, backend="triton")
    monkeypatch.setattr(_flash, "MAX_GRID_YZ", 3)
    assert torch.equal(attnkit.hopfield_energy(state, stored, beta=0.7, backend="triton"), whole)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_in_batch_slices(monkeypatch, causal):
    # Grids (..., H, B): limit 2 is slices of 2 batch elements.  With initial states, the final
    # states returned, and every gradient (q, k, v and the initial states').
    b, h, n, d, dv = 5, 2, 9, 8, 4
    q, k = (_randn(b, h, n, d, seed=i, requires_grad=True) for i in (1, 2))
    v = _randn(b, h, n, dv, seed=3, requires_grad=True)
    s0, z0 = _randn(b, h, d, dv, seed=4, requires_grad=True), _randn(b, h, d, seed=5).abs().requires_grad_()
    g = _randn(b, h, n, dv, seed=6)

    def call(q, k, v, s0, z0):
        if not causal:
            return attnkit.linear_attention(q, k, v, causal=False, backend="triton")
        out, (s, z) = attnkit.linear_attention(q, k, v, causal=True, initial_state=(s0, z0), return_state=True,
                                               backend="triton")
        return out, s, z

    def results():
        outs = call(q, k, v, s0, z0)
        outs = outs if isinstance(outs, tuple) else (outs,)
        leaves = (q, k, v, s0, z0) if causal else (q, k, v)
        grads = torch.autograd.grad([o.sum() * (i + 1) for i, o in enumerate(outs[1:])] + [(outs[0] * g).sum()],
                                    leaves)
        return [o.detach() for o in outs] + list(grads)

    whole = results()
    monkeypatch.setattr(_flash, "MAX_GRID_YZ", 2)
    for a, b_ in zip(whole, results()):
        assert torch.equal(a, b_)


def test_launchers_without_slices_refuse_a_grid_past_the_limit(monkeypatch):
    # The others (the decoding kernel, the Hopfield update, the packed linear launch) raise a
    # clear error before the launch instead of the driver's "invalid argument".
    from attnkit.kernels.decode import softmax_decode_fwd

    monkeypatch.setattr(_flash, "MAX_GRID_YZ", 3)
    q, k, v = _randn(5, 2, 1, 16, seed=1), _randn(5, 2, 8, 16, seed=2), _randn(5, 2, 8, 16, seed=3)
    with pytest.raises(ValueError, match="passes CUDA's limit of 3 on its y / z dims"):
        softmax_decode_fwd(q, k, v)
    assert softmax_decode_fwd(q[:3], k[:3], v[:3])[0].shape == (3, 2, 1, 16)

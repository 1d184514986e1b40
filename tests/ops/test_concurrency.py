"""Calls from several Python threads at once give bit-identical results to the same calls made
one after another (issue 15), for every family on the cpu backend and the reference: forward
and gradients.  The C++ kernels release the GIL and run their own parallel loops, so threads
really overlap inside them; nothing may depend on which thread got there first (shared scratch
buffers, a cached plan, a split that depends on how many threads are free)."""
import threading

import pytest
import torch

import attnkit
from attnkit import patterns

THREADS = 4
ROUNDS = 3


def _inputs(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _softmax(backend, seed):
    q, k, v = _inputs(seed, (2, 4, 37, 32), (2, 2, 45, 32), (2, 2, 45, 24))
    mask = _inputs(seed + 1, (37, 45))[0] > -1.0
    return lambda q, k, v: attnkit.softmax_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                                     return_lse=True, backend=backend), (q, k, v)


def _softmax_causal_5d(backend, seed):
    q, k, v = _inputs(seed, (2, 2, 2, 33, 16), (2, 2, 2, 33, 16), (2, 2, 2, 33, 16))
    return lambda q, k, v: attnkit.softmax_attention(q, k, v, is_causal=True, backend=backend), (q, k, v)


def _softmax_decode(backend, seed):
    # N <= 16 query rows against a long GQA cache: the cpu kernel's decoding path, which splits
    # the keys over tasks when (batch, kv head) pairs are few and merges them by LSE weights.
    q, k, v = _inputs(seed, (1, 8, 2, 64), (1, 2, 3000, 64), (1, 2, 3000, 64))
    return lambda q, k, v: attnkit.softmax_attention(q, k, v, enable_gqa=True, return_lse=True,
                                                     backend=backend), (q, k, v)


def _linear(backend, seed):
    q, k, v = _inputs(seed, (2, 3, 70, 16), (2, 3, 70, 16), (2, 3, 70, 8))
    return lambda q, k, v: attnkit.linear_attention(q, k, v, causal=True, return_state=True,
                                                    backend=backend), (q, k, v)


def _linear_noncausal(backend, seed):
    q, k, v = _inputs(seed, (2, 3, 33, 16), (2, 3, 51, 16), (2, 3, 51, 8))
    return lambda q, k, v: attnkit.linear_attention(q, k, v, feature_map="relu", normalize=False,
                                                    backend=backend), (q, k, v)


def _sparse(pattern):
    def make(backend, seed):
        q, k, v = _inputs(seed, (2, 3, 64, 16), (2, 3, 64, 16), (2, 3, 64, 8))
        return lambda q, k, v: attnkit.sparse_attention(q, k, v, pattern, backend=backend), (q, k, v)
    return make


def _hopfield(backend, seed):
    state, stored, values = _inputs(seed, (2, 2, 9, 32), (2, 2, 200, 32), (2, 2, 200, 16))
    return lambda s, x, v: attnkit.hopfield_update(s, x, values=v, steps=3, beta=0.3, return_energy=True,
                                                   backend=backend), (state, stored, values)


def _hopfield_few_queries(backend, seed):
    # S <= 16 against a long memory: the cpu kernel splits the patterns across threads.
    state, stored = _inputs(seed, (1, 2, 3, 32), (1, 2, 2000, 32))
    return lambda s, x: attnkit.hopfield_update(s, x, steps=2, beta=0.2, backend=backend), (state, stored)


def _hopfield_energy(backend, seed):
    state, stored = _inputs(seed, (2, 2, 17, 32), (2, 2, 300, 32))
    return lambda s, x: attnkit.hopfield_energy(s, x, 0.25, backend=backend), (state, stored)


CASES = {
    "softmax": _softmax,
    "softmax-causal-5d": _softmax_causal_5d,
    "softmax-decode": _softmax_decode,
    "linear-causal-state": _linear,
    "linear-noncausal": _linear_noncausal,
    "sparse-strided": _sparse(patterns.strided(8)),
    "sparse-fixed": _sparse(patterns.fixed(16, 2, causal=False)),
    "sparse-star": _sparse(patterns.star(relay=5, radius=2, cyclic=True)),
    "sparse-block": _sparse(patterns.block_layout(torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.5,
                                                  16, causal=True)),
    "hopfield-update": _hopfield,
    "hopfield-split": _hopfield_few_queries,
    "hopfield-energy": _hopfield_energy,
}


def _flat(result):
    """The tensors of a result (tensor, or nested tuples of tensors), in order."""
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for part in result for t in _flat(part)]


def _call(fn, inputs):
    """Forward outputs and the gradients of their weighted sum with respect to the inputs."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    outputs = _flat(fn(*leaves))
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum()
               for o in outputs if o.requires_grad and torch.isfinite(o).all())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outputs] + [g for g in grads if g is not None]


def _usable(family, backend):
    status = attnkit.backends()[family][backend]
    if not status.usable:
        pytest.skip(f"{family} / {backend}: {status.reason}")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_threads_give_bit_identical_results(case, backend):
    family = case.split("-")[0]
    _usable("hopfield_energy" if case == "hopfield-energy" else family, backend)
    # A different input per thread, so that a result leaking between concurrent calls shows.
    calls = [CASES[case](backend, seed) for seed in range(THREADS)]
    expected = [_call(fn, inputs) for fn, inputs in calls]  # one after another
    assert all(len(e) > 1 for e in expected)  # outputs and at least one gradient
    results = [[None] * THREADS for _ in range(ROUNDS)]
    errors = []
    barrier = threading.Barrier(THREADS)

    def worker(i):
        try:
            for r in range(ROUNDS):
                barrier.wait()  # every round starts all calls together
                results[r][i] = _call(*calls[i])
        except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's index
            errors.append((i, exc))
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, f"thread {errors[0][0]} raised {errors[0][1]!r}"
    for r in range(ROUNDS):
        for i in range(THREADS):
            got, want = results[r][i], expected[i]
            assert len(got) == len(want)
            for j, (a, b) in enumerate(zip(got, want)):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b), (
                    f"{case} / {backend}: round {r}, thread {i}, tensor {j} differs from the sequential "
                    f"call (max |diff| {(a.double() - b.double()).abs().max().item():.3e})"
                )

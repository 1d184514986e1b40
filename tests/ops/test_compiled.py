"""The packed-sequence and KV-cache functions under torch.compile (pytorch_ext/ops/compiled.py):
``fullgraph=True`` traces them (one opaque op each), and the compiled call gives the eager
call's results -- outputs, lse, final states, gradients, the cache written in place -- and its
errors.  The eager functions are checked against float64 references in test_varlen.py and
test_kvcache.py; the compiled forward runs the same eager code at run time (so its bits are the
eager call's), the compiled backward recomputes that forward and differentiates it."""
import itertools

import pytest
import torch

import attnkit

F32 = torch.float32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # the frame cache is shared with other tests that compile
    yield
    torch._dynamo.reset()


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _randn(*shape, seed, dtype=F32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


def _grads(outputs, inputs, seed):
    """d <outputs, random> / d inputs (None where an input is not reached)."""
    outputs = [o for o in outputs if o.requires_grad]
    weights = [_randn(*o.shape, seed=seed + i, dtype=o.dtype) for i, o in enumerate(outputs)]
    return torch.autograd.grad(outputs, inputs, weights, allow_unused=True)


def _assert_same(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_softmax_varlen_fullgraph_gives_the_eager_results(backend, monkeypatch):
    """(The Triton one launch's backward runs its kernels on the saved out / lse; the grouped
    path's recomputes the forward.)"""
    from attnkit.ops import compiled as compiled_ops

    recomputed = []
    real = compiled_ops.recompute_gradients
    monkeypatch.setattr(compiled_ops, "recompute_gradients", lambda *a: recomputed.append(1) or real(*a))
    heads, kv_heads, d, dv = 4, 2, 7, 5
    lengths_q, lengths_k = [7, 0, 1, 7, 13, 3], [7, 3, 1, 7, 13, 5]
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    q = _randn(sum(lengths_q), heads, d, seed=1, requires_grad=True)
    k = _randn(sum(lengths_k), kv_heads, d, seed=2, requires_grad=True)
    v = _randn(sum(lengths_k), kv_heads, dv, seed=3, requires_grad=True)
    sinks = _randn(heads, seed=4, requires_grad=True)
    alibi = _randn(len(lengths_q), heads, seed=5).abs()

    def call(q, k, v, sinks):
        return attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 13, 13, is_causal=True, enable_gqa=True,
                                                return_lse=True, backend=backend, window=(4, -1), softcap=3.0,
                                                alibi_slopes=alibi, sinks=sinks)

    compiled = torch.compile(call, fullgraph=True)
    got, want = compiled(q, k, v, sinks), call(q, k, v, sinks)
    for name, g, w in zip(("out", "lse"), got, want):
        _assert_same(g, w, name)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), _grads(got, (q, k, v, sinks), 10),
                          _grads(want, (q, k, v, sinks), 10)):
        _assert_same(g, w, name)
    assert recomputed == ([] if backend == "triton" else [1])


def test_softmax_varlen_fullgraph_new_lengths_and_output_only():
    """Other offsets and max_seqlen with the same compiled function; out alone (no lse) in the
    loss; the inputs as they come, no score option."""
    compiled = torch.compile(attnkit.softmax_attention_varlen, fullgraph=True)
    for seed, lengths in enumerate(([5, 9], [1, 1, 30, 2], [0, 4])):
        cu = _cu(lengths)
        q, k, v = (_randn(sum(lengths), 2, 8, seed=10 * seed + i, requires_grad=True) for i in range(3))
        got = compiled(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
        want = attnkit.softmax_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
        _assert_same(got, want, f"out, lengths {lengths}")
        for name, g, w in zip("qkv", _grads([got], (q, k, v), seed), _grads([want], (q, k, v), seed)):
            _assert_same(g, w, f"d{name}, lengths {lengths}")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_linear_varlen_fullgraph_gives_the_eager_results(backend):
    heads, d, dv, lengths = 3, 6, 5, [9, 0, 1, 9, 70]
    cu = _cu(lengths)
    q, k = (_randn(sum(lengths), heads, d, seed=i, requires_grad=True) for i in (1, 2))
    v = _randn(sum(lengths), heads, dv, seed=3, requires_grad=True)
    s0 = _randn(len(lengths), heads, d, dv, seed=4, requires_grad=True)
    z0 = _randn(len(lengths), heads, d, seed=5).abs().requires_grad_()

    def call(q, k, v, s0, z0):
        out, (s, z) = attnkit.linear_attention_varlen(q, k, v, cu, causal=True, initial_state=(s0, z0),
                                                      return_state=True, backend=backend)
        return out, s, z

    compiled = torch.compile(call, fullgraph=True)
    inputs = (q, k, v, s0, z0)
    got, want = compiled(*inputs), call(*inputs)
    for name, g, w in zip(("out", "S", "z"), got, want):
        _assert_same(g, w, name)
    for name, g, w in zip(("dq", "dk", "dv", "dS0", "dz0"), _grads(got, inputs, 20), _grads(want, inputs, 20)):
        _assert_same(g, w, name)
    # Non-causal, no state: out alone.
    compiled = torch.compile(attnkit.linear_attention_varlen, fullgraph=True)
    got = compiled(q, k, v, cu, feature_map="relu", backend=backend)
    want = attnkit.linear_attention_varlen(q, k, v, cu, feature_map="relu", backend=backend)
    _assert_same(got, want, "non-causal out")
    for name, g, w in zip("qkv", _grads([got], (q, k, v), 30), _grads([want], (q, k, v), 30)):
        _assert_same(g, w, f"non-causal d{name}")


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_fullgraph_appends_in_place_as_eager(paged):
    batch, heads, kv_heads, d, max_len, new = 3, 4, 2, 8, 48, 2
    seqlens = torch.tensor([5, 0, 30], dtype=torch.int32)
    q = _randn(batch, heads, new, d, seed=1)
    k, v = (_randn(batch, kv_heads, new, d, seed=i) for i in (2, 3))
    cache = [_randn(batch, kv_heads, max_len, d, seed=i) for i in (4, 5)]
    table = None
    if paged:  # blocks of 16 positions, shuffled: [num_blocks, Hk, 16, D]
        block, blocks = 16, batch * max_len // 16
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(6))
        table = perm.view(batch, max_len // block).to(torch.int32)
        paged_cache = []
        for c in cache:
            p = torch.empty(blocks, kv_heads, block, d)
            p[table.flatten().long()] = c.unflatten(2, (max_len // block, block)).permute(0, 2, 1, 3, 4).flatten(0, 1)
            paged_cache.append(p)
        cache = paged_cache

    def call(q, k_cache, v_cache, k, v, seqlens):
        return attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                              enable_gqa=True, return_lse=True, softcap=5.0)

    compiled = torch.compile(call, fullgraph=True)
    caches_got = [c.clone() for c in cache]
    caches_want = [c.clone() for c in cache]
    got = compiled(q, *caches_got, k, v, seqlens)
    want = call(q, *caches_want, k, v, seqlens)
    for name, g, w in zip(("out", "lse", "k_cache", "v_cache"), (*got, *caches_got), (*want, *caches_want)):
        _assert_same(g, w, name)
    assert not torch.equal(caches_got[0], cache[0])  # written in place
    # A decoding step after it, with an int length for every batch element.
    q1 = _randn(batch, heads, 1, d, seed=7)
    got = compiled(q1, *caches_got, None, None, 12)
    want = call(q1, *caches_want, None, None, 12)
    for name, g, w in zip(("step out", "step lse"), got, want):
        _assert_same(g, w, name)


def test_compiled_calls_raise_the_eager_errors():
    """Value errors come from the op at run time, with the eager messages (nothing written to the
    cache); type errors from the checks in front of the op."""
    cu = torch.tensor([0, 3, 2], dtype=torch.int32)  # decreasing
    q = _randn(3, 2, 4, seed=0)
    compiled = torch.compile(attnkit.softmax_attention_varlen, fullgraph=True)
    with pytest.raises(ValueError, match="non-decreasing"):
        compiled(q, q, q, cu, cu, 3, 3)
    torch._dynamo.reset()
    good = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q = 1 is below the length of sequence 1"):
        compiled(q, q, q, good, good, 1, 3)
    torch._dynamo.reset()
    with pytest.raises(TypeError, match="int32 or int64"):  # (fullgraph cannot trace a raise)
        torch.compile(attnkit.softmax_attention_varlen)(q, q, q, good.float(), good, 3, 3)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="non-decreasing"):
        torch.compile(attnkit.linear_attention_varlen, fullgraph=True)(q, q, q, cu)
    torch._dynamo.reset()
    k_cache = torch.zeros(1, 2, 4, 4)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="does not fit in the cache"):
        torch.compile(attnkit.attention_with_kvcache, fullgraph=True)(
            torch.ones(1, 2, 1, 4), k_cache, k_cache.clone(), torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4),
            cache_seqlens=torch.tensor([3], dtype=torch.int32))
    assert torch.equal(k_cache, before)  # nothing written


def test_dropout_under_compile_stays_eager(monkeypatch):
    """dropout_p > 0 keeps the eager path (a recomputed forward would draw another mask): a plain
    torch.compile runs it, breaking the graph there; without dropout the opaque op runs."""
    from attnkit.ops import compiled as compiled_ops

    taken = []
    through_op = compiled_ops.softmax_varlen
    monkeypatch.setattr(compiled_ops, "softmax_varlen", lambda *args: taken.append(1) or through_op(*args))
    lengths = [5, 3]
    cu = _cu(lengths)
    q, k, v = (_randn(8, 2, 4, seed=i) for i in range(3))
    compiled = torch.compile(attnkit.softmax_attention_varlen)
    plain = compiled(q, k, v, cu, cu, 5, 5)
    assert taken == [1]
    _assert_same(plain, attnkit.softmax_attention_varlen(q, k, v, cu, cu, 5, 5), "out without dropout")
    dropped = compiled(q, k, v, cu, cu, 5, 5, dropout_p=0.5)
    assert taken == [1]
    assert dropped.shape == plain.shape and torch.isfinite(dropped).all() and not torch.equal(dropped, plain)


def _opcheck_calls():
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = (_randn(12, 2, 4, seed=i, requires_grad=True) for i in range(3))
    sinks = _randn(2, seed=3, requires_grad=True)
    s0 = _randn(3, 2, 4, 4, seed=4, requires_grad=True)
    z0 = _randn(3, 2, 4, seed=5).abs().requires_grad_()
    cache = [torch.zeros(2, 2, 16, 4) for _ in range(2)]
    new = [_randn(2, 2, 1, 4, seed=i) for i in (6, 7, 8)]
    seqlens = torch.tensor([3, 4], dtype=torch.int32)
    return [
        ("softmax_varlen_compiled", (q, k, v, cu, cu, 7, 7, True, None, False, None, [3, -1], 2.0, None, sinks)),
        ("linear_varlen_compiled", (q, k, v, cu, True, "elu", True, 1e-6, 1.0, s0, z0, True, None)),
        ("linear_varlen_compiled", (q, k, v, cu, False, "relu", True, 1e-6, 1.0, None, None, False, None)),
        ("kvcache_compiled", (new[0], *cache, new[1], new[2], seqlens, 0, None, True, None, False, None, None, None,
                              None, None)),
    ]


@pytest.mark.parametrize("name, args", _opcheck_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(name, args):
    """torch.library.opcheck: schema (the caches' mutation declared), fake against real, the
    autograd registration, AOT dispatch with dynamic shapes."""
    torch.library.opcheck(getattr(torch.ops.attnkit, name).default, args)


@pytest.mark.gpu
def test_cuda_compiled_calls_give_the_eager_results():
    # On a GPU the default backend is triton: the varlen one launches and the decoding kernel,
    # bfloat16, compiled whole (fullgraph) against the eager calls, gradients included.
    dev, bf16 = "cuda", torch.bfloat16
    lengths = [33, 0, 1, 200, 7]
    cu = _cu(lengths).to(dev)
    q, k, v = (_randn(sum(lengths), 8, 64, seed=i, dtype=bf16).to(dev).requires_grad_() for i in range(3))
    softmax = torch.compile(lambda q, k, v: attnkit.softmax_attention_varlen(q, k, v, cu, cu, 200, 200,
                                                                             is_causal=True), fullgraph=True)
    linear = torch.compile(lambda q, k, v: attnkit.linear_attention_varlen(q, k, v, cu, causal=True),
                           fullgraph=True)
    for name, compiled, eager in (
            ("softmax", softmax, lambda q, k, v: attnkit.softmax_attention_varlen(q, k, v, cu, cu, 200, 200,
                                                                                  is_causal=True)),
            ("linear", linear, lambda q, k, v: attnkit.linear_attention_varlen(q, k, v, cu, causal=True))):
        got, want = compiled(q, k, v), eager(q, k, v)
        _assert_same(got, want, f"{name} out")
        for n, g, w in zip("qkv", _grads([got], (q, k, v), 1), _grads([want], (q, k, v), 1)):
            _assert_same(g, w, f"{name} d{n}")
    cache = [torch.zeros(4, 2, 512, 64, device=dev, dtype=bf16) for _ in range(2)]
    seqlens = torch.tensor([0, 100, 511, 37], dtype=torch.int32, device=dev)
    qd = _randn(4, 8, 1, 64, seed=5, dtype=bf16).to(dev)
    kd, vd = (_randn(4, 2, 1, 64, seed=i, dtype=bf16).to(dev) for i in (6, 7))
    step = torch.compile(lambda *a: attnkit.attention_with_kvcache(*a, cache_seqlens=seqlens, enable_gqa=True),
                         fullgraph=True)
    caches_got = [c.clone() for c in cache]
    got = step(qd, *caches_got, kd, vd)
    want = attnkit.attention_with_kvcache(qd, *cache, kd, vd, cache_seqlens=seqlens, enable_gqa=True)
    _assert_same(got, want, "decode out")
    for a, b in zip(caches_got, cache):
        _assert_same(a, b, "cache")


def test_torch_export_of_the_three():
    """torch.export traces the opaque ops too; the exported program gives the eager results."""
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    q, k, v = (_randn(12, 2, 16, seed=i) for i in range(3))
    cache = [torch.zeros(2, 2, 8, 16) for _ in range(2)]
    qd, kd, vd = (_randn(2, 2, 1, 16, seed=i) for i in (3, 4, 5))
    seqlens = torch.tensor([2, 3], dtype=torch.int32)
    calls = [
        (lambda q, k, v, cu: attnkit.softmax_attention_varlen(q, k, v, cu, cu, 9, 9, is_causal=True), (q, k, v, cu)),
        (lambda q, k, v, cu: attnkit.linear_attention_varlen(q, k, v, cu, causal=True), (q, k, v, cu)),
        (lambda q, kc, vc, k, v, s: attnkit.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=s),
         (qd, *cache, kd, vd, seqlens)),
    ]
    for i, (f, args) in enumerate(calls):
        module = type("Call", (torch.nn.Module,), {"forward": lambda self, *a, f=f: f(*a)})()
        exported = torch.export.export(module, tuple(a.clone() for a in args)).module()
        got_args, want_args = [a.clone() for a in args], [a.clone() for a in args]
        _assert_same(exported(*got_args), f(*want_args), f"call {i}")
        for a, b in zip(got_args, want_args):  # the KV cache written alike
            _assert_same(a, b, f"call {i} inputs after")

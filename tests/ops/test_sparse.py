"""attnkit.sparse_attention: the public function (validation, dispatch, numerics, autograd,
compile).

Ground truth is ``attnkit_testing.loop_sparse_attention``: float64, one query row at a time, the allowed
keys listed from the issue's pattern definitions with explicit loops, an elementwise dot product
and a max-shifted softmax over just those keys -- no mask tensor, no matmul.
"""
import re

import pytest
import torch

import attnkit
from attnkit import BackendUnavailableError, patterns
from attnkit._dispatch import BACKENDS, implemented
from attnkit.patterns import block_layout, fixed, star, strided
from attnkit.reference.sparse import sparse_attention_reference
from attnkit_testing import F64, assert_close_to_reference, loop_sparse_attention

OP = "attnkit.sparse_attention"


# ----------------------------------------------------------------------------------------------
# cases (ground truth and tolerance rule: attnkit_testing)
# ----------------------------------------------------------------------------------------------


def _layout(heads, nb, seed):
    layout = torch.rand(heads, nb, nb, generator=torch.Generator().manual_seed(seed)) < 0.5
    layout[:, 1] = False  # a block of queries with nothing to attend
    return layout


CASES = [
    (strided(8), 63),
    (strided(3, causal=False), 7),
    (fixed(16, summary=4), 129),
    (fixed(5, summary=5, causal=False), 7),
    (star(0, 1), 63),
    (star(31, 3, cyclic=True, causal=True), 63),
    (star(0, 2), 1),
    (block_layout(_layout(2, 7, 0), 9), 63),  # one layout head per query head
    (block_layout(_layout(1, 3, 1), 43, causal=True), 129),  # one layout head for all
]
IDS = [f"{p!r}-N{n}" for p, n in CASES]


def _inputs(n, dtype=torch.float32, b=1, h=2, d=8, dv=6):
    q = torch.randn(b, h, n, d, dtype=F64).to(dtype)
    k = torch.randn(b, h, n, d, dtype=F64).to(dtype)
    v = torch.randn(b, h, n, dv, dtype=F64).to(dtype)
    return q, k, v


# ----------------------------------------------------------------------------------------------
# numerics
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, n", CASES, ids=IDS)
def test_matches_loops_float64_and_float32(p, n):
    q, k, v = _inputs(n, F64)
    ref = loop_sparse_attention(q, k, v, p)
    out64 = attnkit.sparse_attention(q, k, v, p)
    assert out64.shape == (1, 2, n, 6) and out64.dtype == F64
    assert_close_to_reference(out64, ref)
    q32, k32, v32 = q.float(), k.float(), v.float()
    out32 = attnkit.sparse_attention(q32, k32, v32, p)
    assert out32.dtype == torch.float32
    assert_close_to_reference(out32, loop_sparse_attention(q32, k32, v32, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p, n", [CASES[0], CASES[5], CASES[7]], ids=[IDS[0], IDS[5], IDS[7]])
def test_low_precision(p, n, dtype):
    q, k, v = _inputs(n, dtype)
    out = attnkit.sparse_attention(q, k, v, p)
    assert out.dtype == dtype
    ref64 = loop_sparse_attention(q, k, v, p)
    assert_close_to_reference(out, ref64, sparse_attention_reference(q, k, v, p))


def test_scale_and_value_dim():
    p = fixed(4, 2)
    q, k, v = _inputs(21, F64, b=2, h=3, d=5, dv=11)
    for scale in (0.05, 1.0, -0.7):
        assert_close_to_reference(attnkit.sparse_attention(q, k, v, p, scale=scale), loop_sparse_attention(q, k, v, p, scale))


def test_empty_rows_are_zero():
    layout = torch.tensor([[[True, False], [False, False]]])  # the second block attends nothing
    q, k, v = _inputs(8, torch.float32)
    out = attnkit.sparse_attention(q, k, v, block_layout(layout, 4))
    assert torch.equal(out[:, :, 4:], torch.zeros(1, 2, 4, 6))
    assert_close_to_reference(out, loop_sparse_attention(q, k, v, block_layout(layout, 4)))


def test_per_head_layouts_differ():
    layout = torch.zeros(2, 2, 2, dtype=torch.bool)
    layout[0] = torch.eye(2, dtype=torch.bool)
    layout[1] = True
    q, k, v = _inputs(6, F64)
    out = attnkit.sparse_attention(q, k, v, block_layout(layout, 3))
    assert_close_to_reference(out, loop_sparse_attention(q, k, v, block_layout(layout, 3)))
    swapped = attnkit.sparse_attention(q, k, v, block_layout(layout.flip(0), 3))
    assert not torch.allclose(out, swapped)


def test_non_contiguous_inputs():
    p = star(5, 2, cyclic=True)
    base = torch.randn(2, 33, 3, 16, dtype=F64)
    q = base.transpose(1, 2)[..., :8]  # [2, 3, 33, 8], strided in every dim
    k = base.transpose(1, 2)[..., 8:]
    v = torch.randn(2, 3, 7, 33, dtype=F64).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = attnkit.sparse_attention(q, k, v, p)
    assert_close_to_reference(out, loop_sparse_attention(q, k, v, p))


def test_empty_sequence():
    for p in (strided(4), fixed(3), star(2), block_layout(torch.ones(2, 3, 3, dtype=torch.bool), 4)):
        q, k, v = _inputs(0, torch.float32)
        q.requires_grad_()
        out = attnkit.sparse_attention(q, k, v, p)
        assert out.shape == (1, 2, 0, 6)
        out.sum().backward()
        assert q.grad.shape == q.shape


# ----------------------------------------------------------------------------------------------
# autograd and compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p, n",
    [(strided(2), 7), (fixed(3, 2, causal=False), 7), (star(3, 1, causal=True), 7),
     (block_layout(_layout(2, 3, 2), 2), 6)],
    ids=repr,
)
def test_gradcheck(p, n):
    q, k, v = (t.requires_grad_() for t in _inputs(n, F64, d=3, dv=2))
    assert torch.autograd.gradcheck(lambda a, b, c: attnkit.sparse_attention(a, b, c, p), (q, k, v))


@pytest.mark.parametrize("p, n", [CASES[0], CASES[4], CASES[8]], ids=[IDS[0], IDS[4], IDS[8]])
def test_float32_grads_match_float64(p, n):
    q, k, v = _inputs(n, F64)
    g = torch.randn(1, 2, n, 6, dtype=F64)
    leaves64 = [t.clone().requires_grad_() for t in (q, k, v)]
    (attnkit.sparse_attention(*leaves64, p) * g).sum().backward()
    leaves32 = [t.float().requires_grad_() for t in (q, k, v)]
    (attnkit.sparse_attention(*leaves32, p) * g.float()).sum().backward()
    for a, b in zip(leaves32, leaves64):
        assert_close_to_reference(a.grad, b.grad, grad=True)


@pytest.mark.parametrize(
    "p, n, backend",
    [(*CASES[0], "inductor"), (*CASES[3], "aot_eager"), (*CASES[5], "aot_eager"), (*CASES[7], "aot_eager")],
    ids=[IDS[0], IDS[3], IDS[5], IDS[7]],
)
def test_compile_fullgraph(p, n, backend):
    # Inductor (C++ codegen, seconds per graph on CPU) once; the other patterns check that the
    # whole call -- validation, pattern mask, dispatch -- traces as one graph, via aot_eager.
    torch._dynamo.reset()  # every pattern is a constant of its graph: start from a clean cache
    compiled = torch.compile(attnkit.sparse_attention, fullgraph=True, backend=backend)
    q, k, v = _inputs(n, torch.float32)
    torch.testing.assert_close(compiled(q, k, v, p), attnkit.sparse_attention(q, k, v, p), rtol=2e-5, atol=2e-6)
    if backend == "inductor":
        return
    # another length (another batch size for the layout, whose length is fixed): the recompile
    # treats the size as symbolic, so the pattern's mask is built from a symbolic n
    n2, b2 = (n, 2) if isinstance(p, patterns.BlockLayout) else (n + 6, 1)
    q2, k2, v2 = _inputs(n2, torch.float32, b=b2)
    torch.testing.assert_close(compiled(q2, k2, v2, p), attnkit.sparse_attention(q2, k2, v2, p), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("p, n", CASES, ids=IDS)
def test_compile_fullgraph_backward(p, n):
    # The backward through a compiled call (AOTAutograd traces it with every op's fake: the fused
    # strided op's backward had none, found in session 32), against the eager gradients.
    torch._dynamo.reset()
    compiled = torch.compile(attnkit.sparse_attention, fullgraph=True, backend="aot_eager")
    q, k, v = (t.requires_grad_() for t in _inputs(n, torch.float32))
    g = torch.randn(q.shape[:3] + (v.shape[3],), dtype=F64).float()
    got = torch.autograd.grad(compiled(q, k, v, p), (q, k, v), g)
    want = torch.autograd.grad(attnkit.sparse_attention(q, k, v, p), (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        assert torch.equal(a, b), f"d{name}"  # (the same kernels in the same order: the same bits)


# ----------------------------------------------------------------------------------------------
# validation and dispatch
# ----------------------------------------------------------------------------------------------


def _bad(**changes):
    q, k, v = _inputs(8, torch.float32)
    args = {"query": q, "key": k, "value": v, "pattern": strided(2)}
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "args, exc, message",
    [
        (_bad(query=torch.randn(2, 8, 4)), ValueError, "query must be a 4-D tensor [B, H, N, D]; got 3-D with shape (2, 8, 4)"),
        (_bad(key=[1.0]), TypeError, "key must be a torch.Tensor [B, H, N, D]; got list"),
        (_bad(value=torch.randn(1, 2, 8, 6, 1)), ValueError, "value must be a 4-D tensor [B, H, N, Dv]; got 5-D"),
        (_bad(query=torch.ones(1, 2, 8, 8, dtype=torch.int64)), TypeError, "query must be floating point (float16, bfloat16, float32 or float64); got int64"),
        (_bad(key=torch.randn(1, 2, 8, 8, dtype=F64)), ValueError, "key must have the dtype of query (float32); got float64"),
        (_bad(key=torch.randn(1, 2, 8, 8, device="meta")), ValueError, "key must be on the device of query (cpu); got meta"),
        (_bad(value=torch.randn(2, 2, 8, 6)), ValueError, "query and key and value must have the same batch size; got query 1, key 1, value 2"),
        (_bad(key=torch.randn(1, 3, 8, 8)), ValueError, "must have the same number of heads; got query 2, key 3, value 2"),
        (_bad(key=torch.randn(1, 2, 8, 5)), ValueError, "query and key must have the same head dim; got query 8, key 5"),
        (_bad(value=torch.randn(1, 2, 9, 6)), ValueError, "key and value must have the same sequence length; got key 8, value 9"),
        (_bad(key=torch.randn(1, 2, 9, 8), value=torch.randn(1, 2, 9, 6)), ValueError,
         "sparse attention is self-attention: query and key must have the same sequence length; got query 8, key 9"),
        (_bad(pattern="strided"), TypeError, "pattern must be an attnkit.patterns pattern (strided, fixed, star, block_layout); got str"),
        (_bad(pattern=torch.ones(8, 8, dtype=torch.bool)), TypeError, "pattern must be an attnkit.patterns pattern"),
        (_bad(pattern=star(relay=8)), ValueError, "the star's relay must be a position of the sequence (0..7 for n=8); got relay=8"),
        (_bad(pattern=block_layout(torch.ones(1, 3, 3, dtype=torch.bool), 2)), ValueError,
         "sequence length must match the layout: nb * block = 3 * 2 = 6; got n=8"),
        (_bad(pattern=block_layout(torch.ones(3, 2, 2, dtype=torch.bool), 4)), ValueError,
         "the block layout has 3 heads; it must have 1 or as many as the query (2)"),
    ],
)
def test_validation_errors(args, exc, message):
    with pytest.raises(exc, match=re.escape(f"{OP}: ") + ".*" + re.escape(message)):
        attnkit.sparse_attention(**args)


@pytest.mark.parametrize("scale, exc, message", [("0.5", TypeError, "scale must be a finite real number; got '0.5'"),
                                                  (float("nan"), TypeError, "scale must be a finite real number; got nan"),
                                                  (True, TypeError, "scale must be a finite real number; got True")])
def test_scale_validation(scale, exc, message):
    with pytest.raises(exc, match=re.escape(f"{OP}: {message}")):
        attnkit.sparse_attention(**_bad(), scale=scale)


def test_backends(monkeypatch):
    q, k, v = _inputs(8, torch.float32)
    p = strided(3)
    want = sparse_attention_reference(q, k, v, p)
    assert torch.equal(attnkit.sparse_attention(q, k, v, p, backend="reference"), want)
    assert set(implemented("sparse")) == set(BACKENDS)
    with pytest.raises(ValueError, match=re.escape(f"{OP}: unknown backend 'fast'; expected one of reference, cpu, triton, cuda")):
        attnkit.sparse_attention(q, k, v, p, backend="fast")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match=f"{OP}: .*cuda"):
            attnkit.sparse_attention(q, k, v, p, backend="cuda")
        monkeypatch.setenv("ATTNKIT_BACKEND", "cuda")
        with pytest.raises(BackendUnavailableError, match="cuda"):
            attnkit.sparse_attention(q, k, v, p)
    monkeypatch.setenv("ATTNKIT_BACKEND", "reference")
    assert torch.equal(attnkit.sparse_attention(q, k, v, p), want)
    monkeypatch.setenv("ATTNKIT_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown ATTNKIT_BACKEND 'nope'"):
        attnkit.sparse_attention(q, k, v, p)


def test_validation_runs_before_dispatch():
    # a bad input is reported even when the backend named could not run either
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6)
    with pytest.raises(ValueError, match="self-attention"):
        attnkit.sparse_attention(q, k, v, strided(2), backend="cuda")

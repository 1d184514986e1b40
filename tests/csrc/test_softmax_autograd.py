"""softmax_attention's autograd in C++ (csrc/softmax_autograd.cpp): differentiable eager calls
of the cpu backend without score options run attnkit::softmax_fwd through a C++
torch::autograd::Function, whose backward calls attnkit::softmax_bwd itself for the usual case
and hands a gradient for the lse and a double backward to the Python fallback.

Ground truth: the float64 reference on the same (rounded) inputs, gradients by torch.autograd
through it; tolerances as DESIGN.md's rule (attnkit_testing.assert_close_to_reference).  Odd
shapes: N = 7 / 16 (the decoding kernel, N <= 16) / 70 (the flash tiles), M = 13 / 130, D = 24.
"""
import contextlib
import threading

import pytest
import torch

import attnkit
from attnkit.ops import softmax as softmax_ops
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, assert_close_to_reference, make_mask, make_qkv

pytestmark = pytest.mark.skipif(getattr(softmax_ops, "_FWD_AUTOGRAD", None) is None,
                                reason="attnkit._C not built (the cpu backend is unusable)")

NODE = "SoftmaxAttentionFunction"


def run(q, k, v, mask=None, causal=False, *, lse=False, reference=False):
    gqa = q.shape[1] != k.shape[1]
    if reference:
        return softmax_attention_reference(q, k, v, mask, 0.0, causal, None, gqa, return_lse=lse)
    return attnkit.softmax_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa, return_lse=lse,
                                     backend="cpu")


def grads_of(q, k, v, mask, causal, dtype, wanted, *, reference=False, create_graph=False):
    """(dq, dk, dv) of <g_out, out> + <g_lse, lse> for the outputs named in ``wanted``."""
    gen = torch.Generator().manual_seed(7)
    out, lse = run(q, k, v, mask, causal, lse=True, reference=reference)
    loss = 0.0
    if "out" in wanted:
        loss = loss + (out * torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)).sum()
    if "lse" in wanted:
        loss = loss + (lse * torch.randn(lse.shape, generator=gen, dtype=F64).to(lse.dtype)).sum()
    return torch.autograd.grad(loss, (q, k, v), create_graph=create_graph, allow_unused=True,
                               materialize_grads=True)


def inputs(b, h, hk, n, m, d, dtype, seed=0):
    q, k, v = make_qkv(b, h, hk, n, m, d, d, seed=seed, dtype=dtype, requires_grad=True)
    ref = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    low = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    return (q, k, v), ref, low


def test_eager_differentiable_call_uses_the_cpp_node():
    (q, k, v), _, _ = inputs(1, 2, 2, 7, 13, 24, torch.float32)
    out, lse = run(q, k, v, lse=True)
    assert NODE in out.grad_fn.name() and lse.grad_fn is out.grad_fn
    with torch.no_grad():
        assert run(q, k, v).grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wanted", [("out",), ("lse",), ("out", "lse")])
@pytest.mark.parametrize("shape,mask_kind,causal", [
    ((1, 2, 2, 7, 13, 24), None, False),
    ((2, 4, 2, 16, 130, 24), "bool", False),       # decoding kernel, GQA
    ((1, 3, 1, 70, 130, 24), "additive", False),   # flash tiles, GQA
    ((1, 2, 2, 70, 70, 24), None, True),
])
def test_gradients_against_float64(dtype, wanted, shape, mask_kind, causal):
    b, h, hk, n, m, d = shape
    (q, k, v), ref, low = inputs(b, h, hk, n, m, d, dtype)
    mask = make_mask(mask_kind, b, h, n, m, dtype=dtype if mask_kind == "additive" else F64)
    mask64 = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(F64))
    got = grads_of(q, k, v, mask, causal, dtype, wanted)
    exp = grads_of(*ref, mask64, causal, F64, wanted, reference=True)
    low_ref = grads_of(*low, mask, causal, dtype, wanted, reference=True) if dtype != torch.float32 else (None,) * 3
    for name, g, e, lo in zip(("dq", "dk", "dv"), got, exp, low_ref):
        assert g.dtype == dtype
        if wanted == ("lse",) and name == "dv":
            assert torch.count_nonzero(g) == 0, "dv: the lse does not depend on v"
            continue
        assert_close_to_reference(g, e, lo, grad=True, name=name, dtype=dtype)


def test_double_backward_against_float64():
    (q, k, v), ref, _ = inputs(1, 2, 1, 9, 13, 24, torch.float32)
    for tensors, reference in ((tuple((q, k, v)), False), (tuple(ref), True)):
        dq, dk, dv = grads_of(*tensors, None, False, None, ("out", "lse"), reference=reference, create_graph=True)
        second = torch.autograd.grad((dq ** 2).sum() + (dk * dv).sum(), tensors)
        if reference:
            expected = second
        else:
            got = second
    for name, g, e in zip(("d2q", "d2k", "d2v"), got, expected):
        assert_close_to_reference(g, e, grad=True, name=name)


def test_retain_graph_and_second_backward():
    (q, k, v), _, _ = inputs(1, 2, 2, 16, 40, 24, torch.float32)
    out = run(q, k, v)
    g = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, (q, k, v), g)


def test_saved_tensor_hooks_see_every_saved_tensor():
    # q, k, v, out, lse (and the mask's slot, undefined here): packed once each, unpacked in the
    # backward, and what the unpack hook returns is what the backward uses.
    (q, k, v), _, _ = inputs(1, 2, 2, 16, 40, 24, torch.float32)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = run(q, k, v)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    assert sorted(packed) == sorted([q.shape, k.shape, v.shape, out.shape, out.shape[:-1]])
    assert sorted(unpacked) == sorted(packed)
    expected = torch.autograd.grad(run(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_fallback_from_another_thread():
    # The lse's gradient goes to the Python fallback, which takes the GIL from the autograd
    # engine; a backward started in a second Python thread must not deadlock or differ.
    (q, k, v), _, _ = inputs(1, 2, 2, 7, 13, 24, torch.float32)
    expected = grads_of(q, k, v, None, False, None, ("out", "lse"))
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("g", grads_of(q, k, v, None, False, None, ("out", "lse"))))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the backward in a second thread did not finish"
    for a, b in zip(result["g"], expected):
        assert torch.equal(a, b)


@contextlib.contextmanager
def fallback_replaced(fn):
    """attnkit._C's softmax backward fallback swapped for ``fn`` (the module's own put back after)."""
    native = softmax_ops._C_MODULE
    native.set_softmax_backward_fallback(fn)
    try:
        yield
    finally:
        native.set_softmax_backward_fallback(softmax_ops._cpp_autograd_backward)


def test_fallback_with_a_bad_result_raises_clearly():
    (q, k, v), _, _ = inputs(1, 1, 1, 5, 6, 8, torch.float32)
    with fallback_replaced(lambda *args: (None, None)):
        _, lse = run(q, k, v, lse=True)
        with pytest.raises(RuntimeError, match="returned 2 values, 3 expected"):
            lse.sum().backward()


def test_fallback_errors_reach_the_caller():
    (q, k, v), _, _ = inputs(1, 1, 1, 5, 6, 8, torch.float32)

    def failing(*args):
        raise ValueError("fallback failed on purpose")

    with fallback_replaced(failing):
        _, lse = run(q, k, v, lse=True)
        with pytest.raises(ValueError, match="fallback failed on purpose"):
            lse.sum().backward()

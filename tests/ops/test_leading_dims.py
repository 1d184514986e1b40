"""SDPA's shapes (issue 15): ``attnkit.softmax_attention`` takes any number of leading batch dims
(``[..., H, N, D]``, at least ``[N, D]``), broadcast together like SDPA's, with masks broadcast
against them; the kernels get ``[B, H, N, D]`` views (no copies where strides allow), the
result comes back in the caller's shape, and gradients flow.  The other families take exactly
4-D and say so.

Ground truth: torch's SDPA in float64 (the semantics claimed), on rows that are not fully
masked; the tolerance rule of DESIGN.md (tests/attnkit_testing.py).
"""
import re

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit.ops import softmax as softmax_ops
from attnkit_testing import F64, assert_close_to_reference

OP = "attnkit.softmax_attention"
BACKENDS = ["cpu", "reference", "triton"]  # triton: interpreted on CPU (tests/conftest.py)


def _usable(backend):
    status = attnkit.backends()["softmax"][backend]
    if not status.usable:
        pytest.skip(f"{backend}: {status.reason}")


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=F64).to(dtype)


def _sdpa64(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q.detach().to(F64), k.detach().to(F64), v.detach().to(F64),
                                          **kwargs)


# (query shape, key shape, value shape, extra kwargs): leading dims of every count, broadcast
# batch dims, broadcast heads and GQA.
SHAPES = [
    ((7, 16), (9, 16), (9, 8), {}),  # [N, D]: one head
    ((3, 7, 16), (3, 9, 16), (3, 9, 8), {}),  # [H, N, D]
    ((2, 3, 7, 16), (2, 3, 9, 16), (2, 3, 9, 8), {}),  # [B, H, N, D]
    ((2, 3, 3, 7, 16), (2, 3, 3, 9, 16), (2, 3, 3, 9, 8), {}),  # [B1, B2, H, N, D]
    ((2, 1, 2, 3, 5, 8), (2, 1, 2, 3, 6, 8), (2, 1, 2, 3, 6, 4), {}),  # three batch dims
    ((2, 3, 3, 7, 16), (1, 3, 3, 9, 16), (1, 3, 3, 9, 8), {}),  # K/V batch broadcast (stride 0)
    ((2, 3, 3, 7, 16), (3, 9, 16), (3, 9, 8), {}),  # K/V with fewer dims: leading 1s
    ((2, 1, 3, 7, 16), (1, 4, 3, 9, 16), (1, 4, 3, 9, 8), {}),  # both sides broadcast
    ((3, 7, 16), (9, 16), (9, 8), {}),  # [H, N, D] against one K/V head
    ((2, 4, 7, 16), (2, 1, 9, 16), (2, 1, 9, 8), {}),  # one K/V head broadcast to H
    ((4, 7, 16), (2, 9, 16), (2, 9, 8), {"enable_gqa": True}),  # GQA, 3-D
    ((2, 2, 6, 5, 8), (2, 2, 3, 6, 8), (2, 2, 3, 6, 8), {"enable_gqa": True}),  # GQA, 5-D
    ((2, 0, 3, 7, 16), (2, 0, 3, 9, 16), (2, 0, 3, 9, 8), {}),  # an empty batch dim
    ((2, 3, 0, 7, 16), (2, 3, 0, 9, 16), (2, 3, 0, 9, 8), {}),  # no heads
    ((2, 3, 0, 16), (2, 3, 9, 16), (2, 3, 9, 8), {}),  # N = 0
    ((2, 3, 7, 16), (2, 3, 0, 16), (2, 3, 0, 8), {}),  # M = 0: zeros, lse -inf
    ((2, 3, 3, 1, 16), (2, 3, 3, 1, 16), (2, 3, 3, 1, 8), {}),  # N = M = 1
]


def _id(case):
    q, k, v, kw = case
    return f"q{list(q)}-k{list(k)}-v{list(v)}" + ("-gqa" if kw else "")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SHAPES, ids=[_id(c) for c in SHAPES])
def test_forward_and_lse_match_sdpa(case, backend):
    _usable(backend)
    qs, ks, vs, kwargs = case
    q, k, v = _rand(*qs), _rand(*ks), _rand(*vs)
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    ref = _sdpa64(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert_close_to_reference(out, ref, name=f"{backend} out")
    # The lse in the caller's shape too: [..., H, N].
    assert lse.shape == ref.shape[:-1]
    q64, k64 = q.to(F64), k.to(F64)
    if kwargs.get("enable_gqa"):
        k64 = k64.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q64 @ k64.transpose(-2, -1) / q.shape[-1] ** 0.5
    assert_close_to_reference(lse, torch.logsumexp(scores, -1), name=f"{backend} lse", dtype=q.dtype)


MASKS = [
    # (query shape, key shape, mask shape)
    ((7, 16), (9, 16), (7, 9)),
    ((7, 16), (9, 16), (9,)),  # key padding for an [N, D] input
    ((3, 7, 16), (3, 9, 16), (3, 1, 9)),
    ((2, 3, 3, 7, 16), (2, 3, 3, 9, 16), (7, 9)),  # one mask for every batch and head
    ((2, 3, 3, 7, 16), (2, 3, 3, 9, 16), (2, 3, 1, 1, 9)),  # per-sequence key padding
    ((2, 3, 3, 7, 16), (2, 3, 3, 9, 16), (3, 1, 7, 9)),  # per inner batch: expanded over B1
    ((2, 3, 3, 7, 16), (2, 3, 3, 9, 16), (2, 1, 3, 7, 9)),  # a broadcast dim between two real ones
    ((2, 3, 3, 7, 16), (2, 3, 3, 9, 16), (2, 3, 3, 7, 9)),  # full
]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MASKS, ids=[f"q{list(q)}-mask{list(m)}" for q, _, m in MASKS])
def test_masks_broadcast_against_leading_dims(case, backend, kind):
    _usable(backend)
    qs, ks, ms = case
    q, k, v = _rand(*qs), _rand(*ks), _rand(*ks[:-1], 8)
    keep = torch.rand(ms) < 0.7
    keep[..., 0] = True  # every row keeps a key: SDPA (NaN on empty rows) stays the ground truth
    mask = keep if kind == "bool" else torch.where(keep, _rand(*ms), float("-inf"))
    out = attnkit.softmax_attention(q, k, v, attn_mask=mask, backend=backend)
    ref = _sdpa64(q, k, v, attn_mask=mask if kind == "bool" else mask.to(F64))
    assert_close_to_reference(out, ref, name=f"{backend} out")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_flow_through_leading_dims(backend):
    """Gradients of a 5-D call with broadcast K/V batch dims and a broadcast mask reach the
    caller's tensors in their own shapes (the expand's backward sums over the broadcast)."""
    _usable(backend)
    q = _rand(2, 3, 2, 7, 16).requires_grad_()
    k = _rand(1, 3, 2, 9, 16).requires_grad_()
    v = _rand(3, 2, 9, 8).requires_grad_()
    mask = torch.rand(3, 1, 7, 9) < 0.7
    mask[..., 0] = True
    g = _rand(2, 3, 2, 7, 8)
    out = attnkit.softmax_attention(q, k, v, attn_mask=mask, backend=backend)
    out.backward(g)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, attn_mask=mask).backward(g.to(F64))
    for name, t, t64 in zip("qkv", (q, k, v), leaves):
        assert t.grad.shape == t.shape
        assert_close_to_reference(t.grad, t64.grad, grad=True, name=f"{backend} d{name}")


def test_two_dim_gradients_and_lse_gradient():
    """[N, D] inputs, gradients of out and lse together (cpu backend, vs float64 autograd)."""
    q, k, v = (_rand(7, 16).requires_grad_(), _rand(9, 16).requires_grad_(), _rand(9, 8).requires_grad_())
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, backend="cpu")
    assert out.shape == (7, 8) and lse.shape == (7,)
    g, gl = _rand(7, 8), _rand(7)
    torch.autograd.backward([out, lse], [g, gl])
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].T / 4.0
    out64 = torch.softmax(s, -1) @ leaves[2]
    torch.autograd.backward([out64, torch.logsumexp(s, -1)], [g.to(F64), gl.to(F64)])
    for name, t, t64 in zip("qkv", (q, k, v), leaves):
        assert_close_to_reference(t.grad, t64.grad, grad=True, name=f"d{name}")


def test_fully_masked_rows_stay_zero_in_any_rank():
    q, k, v = _rand(2, 2, 3, 5, 8), _rand(2, 2, 3, 6, 8), _rand(2, 2, 3, 6, 4)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[2] = False
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask, return_lse=True, backend="cpu")
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    assert torch.isneginf(lse[..., 2]).all()
    assert torch.isfinite(out).all()


def _captured_kernel_inputs(monkeypatch, **call):
    """The tensors the cpu backend's implementation receives for one call."""
    seen = {}
    original = softmax_ops._IMPLEMENTATIONS["cpu"]

    def spy(query, key, value, attn_mask, *rest):
        seen.update(q=query, k=key, v=value, mask=attn_mask)
        return original(query, key, value, attn_mask, *rest)

    monkeypatch.setitem(softmax_ops._IMPLEMENTATIONS, "cpu", spy)
    out = attnkit.softmax_attention(backend="cpu", **call)
    return seen, out


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_kernels_get_views_not_copies(monkeypatch):
    """5-D q (contiguous), K broadcast over every batch dim (stride 0), a transposed V and a
    broadcast [N, M] mask: the kernel sees 4-D views of the same storage; the mask stays small
    (its broadcast dims stride 0, never materialized)."""
    q = _rand(2, 3, 4, 7, 16)
    k = _rand(1, 1, 4, 9, 16)
    v = _rand(2, 3, 4, 8, 9).transpose(-1, -2)  # non-contiguous
    mask = torch.rand(7, 9) < 0.7
    mask[:, 0] = True
    seen, out = _captured_kernel_inputs(monkeypatch, query=q, key=k, value=v, attn_mask=mask)
    assert seen["q"].shape == (6, 4, 7, 16) and _same_storage(seen["q"], q)
    assert seen["k"].shape == (6, 4, 9, 16) and _same_storage(seen["k"], k)
    assert seen["v"].shape == (6, 4, 9, 8) and _same_storage(seen["v"], v)
    assert seen["k"].stride(0) == 0  # the broadcast batch dims, not a copy
    assert _same_storage(seen["mask"], mask) and seen["mask"].numel() == 7 * 9
    assert out.shape == (2, 3, 4, 7, 8)
    assert_close_to_reference(out, _sdpa64(q, k, v, attn_mask=mask), name="out")


def test_qkv_sliced_from_one_fused_tensor_5d():
    """q, k, v as overlapping views of one fused [B1, B2, N, 3, H, D] projection, permuted to
    [B1, B2, H, N, D]: any strides."""
    fused = _rand(2, 2, 7, 3, 4, 16)
    q, k, v = (fused[..., i, :, :].transpose(-3, -2) for i in range(3))
    for backend in BACKENDS:
        if attnkit.backends()["softmax"][backend].usable:
            out = attnkit.softmax_attention(q, k, v, is_causal=True, backend=backend)
            assert_close_to_reference(out, _sdpa64(q, k, v, is_causal=True), name=f"{backend} out")


def test_compile_traces_leading_dims():
    torch._dynamo.reset()
    compiled = torch.compile(attnkit.softmax_attention, fullgraph=True)
    q, k, v = _rand(2, 2, 3, 7, 16), _rand(2, 2, 3, 9, 16), _rand(2, 2, 3, 9, 8)
    out = compiled(q, k, v)
    assert out.shape == (2, 2, 3, 7, 8)
    assert_close_to_reference(out, _sdpa64(q, k, v), name="compiled out")


@pytest.mark.parametrize("call,match", [
    (dict(query=_rand(16), key=_rand(9, 16), value=_rand(9, 8)),
     r"query must be a tensor of at least 2 dims \[..., N, D\]; got 1-D with shape \(16,\)"),
    (dict(query=_rand(7, 16), key=_rand(16), value=_rand(9, 8)),
     r"key must be a tensor of at least 2 dims \[..., M, D\]; got 1-D"),
    (dict(query=_rand(2, 3, 3, 7, 16), key=_rand(3, 3, 3, 9, 16), value=_rand(3, 3, 3, 9, 8)),
     r"batch dims .* must broadcast together; got query \[2, 3\], key \[3, 3\], value \[3, 3\]"),
    (dict(query=_rand(3, 7, 16), key=_rand(2, 9, 16), value=_rand(2, 9, 8)),
     r"same number of heads unless enable_gqa=True; got query 3, key 2"),
    (dict(query=_rand(2, 3, 7, 16), key=_rand(2, 3, 9, 16), value=_rand(2, 3, 9, 8),
          attn_mask=torch.ones(2, 2, 3, 7, 9, dtype=torch.bool)),
     r"attn_mask must be broadcastable to \[B, H, N, M\] = \[2, 3, 7, 9\]; got shape \[2, 2, 3, 7, 9\]"),
    (dict(query=_rand(7, 16), key=_rand(9, 16), value=_rand(9, 8),
          attn_mask=torch.ones(1, 7, 9, dtype=torch.bool)),
     r"attn_mask must be broadcastable to \[N, M\] = \[7, 9\]; got shape \[1, 7, 9\]"),
    (dict(query=_rand(2, 3, 3, 7, 16), key=_rand(2, 3, 3, 9, 16), value=_rand(2, 3, 3, 9, 8),
          attn_mask=torch.ones(3, 3, 3, 7, 9, dtype=torch.bool)),
     r"attn_mask must be broadcastable to \[..., H, N, M\] = \[2, 3, 3, 7, 9\]; got shape \[3, 3, 3, 7, 9\]"),
])
def test_shape_errors_say_what_was_expected_and_what_came(call, match):
    with pytest.raises(ValueError, match=f"^{re.escape(OP)}: .*{match}"):
        attnkit.softmax_attention(**call)


# ----------------------------------------------------------------------------------------------
# the other families: exactly 4-D, and a clear error otherwise
# ----------------------------------------------------------------------------------------------

HINT = "unlike softmax_attention, this op takes no other number of dims"


@pytest.mark.parametrize("shape", [(7, 16), (3, 7, 16), (1, 2, 3, 7, 16)])
def test_other_families_reject_other_ranks_clearly(shape):
    x4 = _rand(2, 3, 8, 16)
    x = _rand(*shape)
    rank = len(shape)
    got = rf"got {rank}-D with shape {re.escape(str(tuple(shape)))} \({HINT}"
    calls = [
        ("attnkit.linear_attention", "query", r"\[B, H, N, D\]", lambda: attnkit.linear_attention(x, x4, x4)),
        ("attnkit.linear_attention", "value", r"\[B, H, M, Dv\]", lambda: attnkit.linear_attention(x4, x4, x)),
        ("attnkit.sparse_attention", "key", r"\[B, H, N, D\]",
         lambda: attnkit.sparse_attention(x4, x, x4, attnkit.patterns.strided(2))),
        ("attnkit.hopfield_update", "state", r"\[B, H, S, D\]", lambda: attnkit.hopfield_update(x, x4)),
        ("attnkit.hopfield_update", "values", r"\[B, H, N, Dv\]",
         lambda: attnkit.hopfield_update(x4, x4, values=x)),
        ("attnkit.hopfield_energy", "stored", r"\[B, H, N, D\]", lambda: attnkit.hopfield_energy(x4, x, 1.0)),
    ]
    for fn, name, layout, call in calls:
        with pytest.raises(ValueError, match=f"^{re.escape(fn)}: {name} must be a 4-D tensor {layout}; {got}"):
            call()


def test_linear_step_rejects_other_ranks_clearly():
    x3 = _rand(2, 3, 16)
    with pytest.raises(ValueError, match=rf"linear_attention_step: q_t must be a 3-D tensor \[B, H, D\]; "
                                         rf"got 4-D with shape \(2, 3, 1, 16\) \({HINT}"):
        attnkit.linear_attention_step(x3.unsqueeze(2), x3, x3)


def test_float_mask_gradient_through_leading_dims():
    """A floating mask that requires grad (routed to the reference) gets SDPA's gradient in its
    own broadcast shape."""
    q, k, v = (torch.randn(*s, dtype=F64) for s in ((2, 2, 3, 5, 8), (2, 2, 3, 6, 8), (2, 2, 3, 6, 4)))
    mask = torch.randn(2, 1, 1, 5, 6, dtype=F64, requires_grad=True)
    attnkit.softmax_attention(q, k, v, attn_mask=mask).sum().backward()
    mask64 = mask.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask64).sum().backward()
    assert mask.grad.shape == mask.shape
    assert_close_to_reference(mask.grad, mask64.grad, grad=True, name="d mask")

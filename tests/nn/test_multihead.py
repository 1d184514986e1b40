"""attnkit.nn.MultiheadAttention against torch.nn.MultiheadAttention.

The oracle is torch's own module with the *same* parameters (our module loads its state_dict),
run in float64; ours runs in float64 (near-exact agreement) and float32 (the tolerance rule of
DESIGN.md: 2e-5 of the largest magnitude, gradients 1e-4).  Masks follow torch's conventions
(attn_mask bool True = not allowed; key_padding_mask bool True = padding; floats added).
"""
import re

import pytest
import torch

import attnkit.nn
from attnkit_testing import F64, assert_close_to_reference

F32 = torch.float32
NAME = "attnkit.nn.MultiheadAttention"


def make_pair(embed_dim=32, num_heads=4, bias=True, batch_first=False, kdim=None, vdim=None,
              dropout=0.0, backend=None):
    """(torch module in float64, ours loaded from its state_dict in float64)."""
    ref = torch.nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, bias=bias,
                                      batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=F64)
    with torch.no_grad():  # non-zero biases, so that they are tested
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_()
    ours = attnkit.nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, bias=bias,
                                         batch_first=batch_first, kdim=kdim, vdim=vdim, dtype=F64,
                                         backend=backend)
    result = ours.load_state_dict(ref.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    return ref, ours


def inputs(batch, tgt, src, e, kdim, vdim, batch_first, batched=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(length, dim):
        shape = (length, dim) if not batched else (batch, length, dim) if batch_first else (length, batch, dim)
        return torch.randn(shape, generator=g, dtype=F64)

    return t(tgt, e), t(src, kdim), t(src, vdim)


def masks(kind, batch, heads, tgt, src, batched=True, seed=0):
    """(key_padding_mask, attn_mask, is_causal) in torch's conventions; no row is fully masked."""
    g = torch.Generator().manual_seed(seed + 7)
    kpm_shape = (batch, src) if batched else (src,)
    kpm = attn = None
    causal = False
    if "kpm_bool" in kind:
        kpm = torch.rand(kpm_shape, generator=g) < 0.3
        kpm[..., 0] = False  # key 0 always visible
    if "kpm_float" in kind:
        kpm = torch.randn(kpm_shape, generator=g, dtype=F64)
    if "attn_bool" in kind:
        attn = torch.rand(tgt, src, generator=g) < 0.3
        attn[:, 0] = False
    if "attn_float3d" in kind:
        n = batch * heads if batched else heads
        attn = torch.randn(n, tgt, src, generator=g, dtype=F64)
        attn[..., 1:].masked_fill_(torch.rand(n, tgt, src - 1, generator=g) < 0.2, float("-inf"))
    if "causal" in kind:
        attn = torch.ones(tgt, src, dtype=torch.bool).triu(1)  # True = not allowed
        causal = True
    return kpm, attn, causal


CASES = [
    # (kind, batch_first, kdim, vdim, bias, batched)
    ("none", False, None, None, True, True),
    ("none", True, None, None, False, True),
    ("kpm_bool", True, None, None, True, True),
    ("kpm_float", False, None, None, True, True),
    ("attn_bool", False, None, None, True, True),
    ("attn_float3d", True, None, None, True, True),
    ("attn_bool+kpm_bool", False, 24, 40, True, True),
    ("attn_float3d+kpm_bool", True, None, None, True, True),
    ("causal", False, None, None, True, True),
    ("causal", True, 20, 20, False, True),
    ("causal+kpm_bool", True, None, None, True, True),
    ("kpm_bool", False, None, None, True, False),
    ("attn_float3d", True, 24, 16, True, False),
    ("causal", False, None, None, True, False),
]


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("dtype", (F64, F32))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_torch(case, dtype):
    kind, batch_first, kdim, vdim, bias, batched = CASES[case]
    e, heads, batch, tgt = 32, 4, 3, 7
    src = tgt if "causal" in kind else 9
    ref, ours = make_pair(e, heads, bias, batch_first, kdim, vdim)
    ours = ours.to(dtype)
    q, k, v = inputs(batch, tgt, src, e, kdim or e, vdim or e, batch_first, batched, seed=case)
    kpm, attn, causal = masks(kind, batch, heads, tgt, src, batched, seed=case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want, _ = ref(q, k, v, key_padding_mask=kpm, need_weights=False, attn_mask=attn, is_causal=causal)

    q_c, k_c, v_c = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    fmask = lambda m: m if m is None or m.dtype == torch.bool else m.to(dtype)  # noqa: E731
    got, weights = ours(q_c, k_c, v_c, key_padding_mask=fmask(kpm), attn_mask=fmask(attn), is_causal=causal)
    assert weights is None
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == F64:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    else:
        assert_close_to_reference(got, want)

    # Gradients flow to the inputs and every parameter, and agree with torch's.
    g = torch.randn(want.shape, dtype=F64)
    ref_params = dict(ref.named_parameters())
    names = list(ref_params)
    our_params = dict(ours.named_parameters())
    assert sorted(names) == sorted(our_params)
    grads = torch.autograd.grad(got, [q_c, k_c, v_c] + [our_params[n] for n in names], g.to(dtype))
    ref_grads = torch.autograd.grad(want, [q, k, v] + [ref_params[n] for n in names], g)
    for name, a, b in zip(["query", "key", "value"] + names, grads, ref_grads):
        assert a is not None and a.shape == b.shape, name
        if dtype == F64:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
        else:
            assert_close_to_reference(a, b, grad=True, name=f"grad {name}")


def test_causal_without_attn_mask_and_padding_fold():
    # is_causal alone (torch's module requires attn_mask too) equals the explicit causal mask;
    # with a key_padding_mask the causal rule is folded into the mask.
    ref, ours = make_pair(batch_first=True)
    q, k, v = inputs(2, 6, 6, 32, 32, 32, True)
    causal_mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    want = ref(q, k, v, attn_mask=causal_mask, need_weights=False)[0]
    torch.testing.assert_close(ours(q, k, v, is_causal=True)[0], want, rtol=1e-10, atol=1e-10)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 3:] = True
    want = ref(q, k, v, attn_mask=causal_mask, key_padding_mask=kpm, need_weights=False)[0]
    torch.testing.assert_close(ours(q, k, v, key_padding_mask=kpm, is_causal=True)[0], want,
                               rtol=1e-10, atol=1e-10)
    # ... and the causal rule is really applied (not a no-op).
    assert (ours(q, k, v)[0] - ours(q, k, v, is_causal=True)[0]).abs().max() > 1e-3


def test_state_dict_round_trip_both_ways():
    for kdim, vdim, bias in ((None, None, True), (24, 40, False), (32, 16, True)):
        ref, ours = make_pair(kdim=kdim, vdim=vdim, bias=bias)
        assert list(ours.state_dict()) == list(ref.state_dict())
        for key, value in ref.state_dict().items():
            assert value.shape == ours.state_dict()[key].shape and torch.equal(value, ours.state_dict()[key])
        fresh = torch.nn.MultiheadAttention(32, 4, bias=bias, kdim=kdim, vdim=vdim, dtype=F64)
        fresh.load_state_dict(ours.state_dict())
        assert ours.in_proj_weight is None if (kdim or vdim) else ours.q_proj_weight is None


def test_initialization_like_torch():
    torch.manual_seed(11)
    ref = torch.nn.MultiheadAttention(32, 4)
    torch.manual_seed(11)
    ours = attnkit.nn.MultiheadAttention(32, 4)
    for (name, a), (_, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(ours.in_proj_bias, torch.zeros(96)) and torch.equal(ours.out_proj.bias, torch.zeros(32))


def test_backend_argument_and_dropout():
    ref, ours = make_pair(dropout=0.3, batch_first=True, backend="reference")
    q, k, v = inputs(2, 5, 6, 32, 32, 32, True)
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v, need_weights=False)[0], rtol=1e-10, atol=1e-10)
    ours.train()
    torch.manual_seed(4)
    a = ours(q, k, v)[0]
    torch.manual_seed(4)
    b = ours(q, k, v)[0]
    assert torch.equal(a, b)  # reproducible under torch.manual_seed
    assert (a - ours.eval()(q, k, v)[0]).abs().max() > 1e-3  # and dropout did act in training
    assert "backend='reference'" in repr(ours)


def test_fully_padded_row_gives_zeros_not_nan():
    _, ours = make_pair(batch_first=True, bias=False)
    q, k, v = inputs(2, 5, 6, 32, 32, 32, True)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key is padding
    out = ours(q, k, v, key_padding_mask=kpm)[0]
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no bias: the projection of 0 is 0


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((), dict(need_weights=True), ValueError, "need_weights=True is not supported"),
    ((torch.randn(2, 3, 4, 32),), {}, ValueError, r"query must be 3-D \(batched\) or 2-D"),
    ((torch.randn(5, 2, 31),), {}, ValueError, "query's last dim must be 32"),
    ((None, torch.randn(6, 32)), {}, ValueError, "key and value must have query's rank"),
    ((None, torch.randn(6, 2, 32), torch.randn(7, 2, 32)), {}, ValueError,
     "key and value must agree on sequence length and batch"),
    ((None, torch.randn(6, 3, 32), torch.randn(6, 3, 32)), {}, ValueError,
     "query and key must have the same batch size; got 2 and 3"),
    ((), dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), ValueError,
     r"key_padding_mask must have shape \[2, 6\]"),
    ((), dict(key_padding_mask=torch.zeros(2, 6, dtype=torch.int64)), TypeError,
     "key_padding_mask must be bool or floating point; got int64"),
    ((), dict(attn_mask=torch.zeros(5, 5, dtype=torch.bool)), ValueError,
     r"attn_mask must have shape \[L, S\] = \[5, 6\] or \[N \* num_heads, L, S\] = \[8, 5, 6\]"),
    ((), dict(attn_mask=[[True]]), TypeError, "attn_mask must be a torch.Tensor or None; got list"),
])
def test_forward_errors(args, kwargs, exc, match):
    mha = attnkit.nn.MultiheadAttention(32, 4)
    default = [torch.randn(5, 2, 32), torch.randn(6, 2, 32), torch.randn(6, 2, 32)]
    call = [a if a is not None else d for a, d in zip(args, default)] + default[len(args):]
    with pytest.raises(exc, match=f"^{re.escape(NAME)}: {match}"):
        mha(*call, **kwargs)


@pytest.mark.parametrize("args,match", [
    ((32, 5), "embed_dim must be divisible by num_heads; got embed_dim=32, num_heads=5"),
    ((0, 4), "embed_dim and num_heads must be positive ints"),
    ((32, 4, 1.0), r"dropout must be in \[0, 1\); got 1.0"),
])
def test_constructor_errors(args, match):
    with pytest.raises(ValueError, match=f"^{re.escape(NAME)}: {match}"):
        attnkit.nn.MultiheadAttention(*args)

"""attnkit.softmax_attention_varlen and attnkit.linear_attention_varlen (issue 28): packed
sequences against float64 references built one sequence at a time (a loop over the packed
offsets; nothing of the library's grouping), forward and gradients."""
import inspect
import itertools

import pytest
import torch

import attnkit
from attnkit.reference.linear import linear_attention_reference
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, LOW_PRECISION, assert_close_to_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCORE_OPTIONS = {"window", "softcap", "alibi_slopes", "sinks"}
HAS_SCORE_OPTIONS = SCORE_OPTIONS <= set(inspect.signature(attnkit.softmax_attention).parameters)
NO_SCORE_OPTIONS = ("attnkit.softmax_attention has no score options (window, softcap, alibi_slopes, sinks) "
                    "in this checkout yet: nothing to pass through")

# Odd lengths with 0 and 1, equal lengths adjacent (a run: views) and apart (gathered), a
# sequence with queries but no keys and one with keys but no queries.
LENGTHS_Q = [7, 0, 1, 7, 13, 1, 7, 7, 3]
LENGTHS_K = [7, 3, 1, 7, 13, 0, 7, 7, 5]


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _packed(lengths, heads, dim, dtype, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), heads, dim, generator=g, dtype=F64)
    return x.to(dtype).requires_grad_(requires_grad)


def _per_sequence(cu, x, i):
    """Sequence i of the packed x [total, H, D] as [1, H, n, D]."""
    return x[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0)


def _loop_softmax(q, k, v, cu_q, cu_k, dtype=None, *, is_causal=False, enable_gqa=False, alibi=None, **options):
    """Packed (out, lse) from one softmax_attention_reference call per sequence, in ``dtype``
    (default: the inputs')."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = (_per_sequence(cu, x, i) for cu, x in ((cu_q, q), (cu_k, k), (cu_k, v)))
        if dtype is not None:
            qi, ki, vi = qi.to(dtype), ki.to(dtype), vi.to(dtype)
        extra = dict(options)
        if alibi is not None:
            extra["alibi_slopes"] = alibi[i:i + 1] if alibi.dim() == 2 else alibi
        out, lse = softmax_attention_reference(qi, ki, vi, is_causal=is_causal, enable_gqa=enable_gqa,
                                               return_lse=True, **extra)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _loss(out, lse, g_out, g_lse):
    """A scalar using both outputs (the lse where finite: rows with no key have -inf)."""
    return (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()


def _inputs(dtype, heads=4, kv_heads=2, d=7, dv=5, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, seed=0):
    q = _packed(lengths_q, heads, d, dtype, seed, True)
    k = _packed(lengths_k, kv_heads, d, dtype, seed + 1, True)
    v = _packed(lengths_k, kv_heads, dv, dtype, seed + 2, True)
    return q, k, v, _cu(lengths_q), _cu(lengths_k)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [F64, F32, BF16, F16], ids=str)
def test_softmax_varlen_matches_per_sequence_reference(dtype, is_causal, backend):
    q, k, v, cu_q, cu_k = _inputs(dtype, seed=3 + is_causal)
    out, lse = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K),
                                                is_causal=is_causal, enable_gqa=True, return_lse=True,
                                                backend=backend)
    assert out.shape == (q.shape[0], 4, 5) and out.dtype == dtype
    assert lse.shape == (q.shape[0], 4) and lse.dtype == (F64 if dtype == F64 else F32)
    g = torch.Generator().manual_seed(11)
    g_out, g_lse = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g, dtype=F64)
    got = torch.autograd.grad(_loss(out, lse, g_out.to(dtype), g_lse.to(lse.dtype)), (q, k, v))

    q64, k64, v64 = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    ref, ref_lse = _loop_softmax(q64, k64, v64, cu_q, cu_k, is_causal=is_causal, enable_gqa=True)
    want = torch.autograd.grad(_loss(ref, ref_lse, g_out, g_lse), (q64, k64, v64))
    low = low_grads = (None, None, None)
    if dtype in LOW_PRECISION:  # DESIGN's rule: the same computation run naively in the dtype
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        low = _loop_softmax(ql, kl, vl, cu_q, cu_k, is_causal=is_causal, enable_gqa=True)
        low_grads = torch.autograd.grad(_loss(*low, g_out.to(dtype), g_lse.to(low[1].dtype)), (ql, kl, vl))
    # Sequence 5 has queries but no keys: out 0, lse -inf, no gradient.
    assert torch.isneginf(lse[cu_q[5]:cu_q[6]]).all() and not out[cu_q[5]:cu_q[6]].any()
    assert_close_to_reference(out, ref, low[0], name="out")
    assert_close_to_reference(lse, ref_lse, low[1], name="lse", dtype=dtype)
    for name, x, y, z in zip(("dq", "dk", "dv"), got, want, low_grads):
        assert_close_to_reference(x, y, z, grad=True, name=name)


@pytest.mark.parametrize("lengths", [[9, 9, 9, 9], [1, 2, 1, 2, 1, 2], [0, 0, 5], [4]])
def test_groupings_give_the_per_sequence_result(lengths):
    # One view call (all equal), gathered groups out of pack order, empty sequences: same result.
    q, k, v, cu, _ = _inputs(F32, heads=2, kv_heads=2, d=8, dv=8, lengths_q=lengths, lengths_k=lengths, seed=5)
    out = attnkit.softmax_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    ref, _ = _loop_softmax(*(x.detach().to(F64) for x in (q, k, v)), cu, cu, is_causal=True)
    assert_close_to_reference(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(_loop_softmax(q64, k64, v64, cu, cu, is_causal=True)[0].sum(), (q64, k64, v64))
    for x, y in zip(grads, want):
        assert_close_to_reference(x, y, grad=True)


def test_strided_inputs_and_int64_offsets():
    # q, k, v sliced from one fused qkv tensor [total, 3, H, D]; int64 offsets.
    lengths = [5, 1, 12]
    qkv = _packed(lengths, 3 * 2, 16, F32, 7).view(-1, 3, 2, 16).requires_grad_()
    q, k, v = qkv.unbind(1)
    cu = _cu(lengths).long()
    out = attnkit.softmax_attention_varlen(q, k, v, cu, cu, 12, 12)
    ref, _ = _loop_softmax(*(x.detach().to(F64) for x in (q, k, v)), cu, cu)
    assert_close_to_reference(out, ref)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape


def test_empty_pack_and_no_query_rows():
    q, k, v, cu_q, cu_k = _inputs(F32, lengths_q=[0, 0], lengths_k=[3, 0])
    out, lse = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 0, 3, enable_gqa=True, return_lse=True)
    assert out.shape == (0, 4, 5) and lse.shape == (0, 4) and lse.dtype == F32
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert not dk.any() and dk.shape == k.shape
    # a loss on the lse alone backpropagates too, as softmax_attention's with N = 0 (session 30's
    # varlen fuzz: the empty pack's lse was outside the graph, and the backward raised)
    dq, dk = torch.autograd.grad(lse.sum(), (q, k))
    assert not dq.any() and not dk.any()
    one = torch.zeros(1, dtype=torch.int32)  # batch 0
    empty = attnkit.softmax_attention_varlen(q, k[:0], v[:0], one, one, 0, 0, enable_gqa=True)
    assert empty.shape == (0, 4, 5)


@pytest.mark.skipif(not HAS_SCORE_OPTIONS, reason=NO_SCORE_OPTIONS)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_score_options_pass_through_per_sequence(backend):
    q, k, v, cu_q, cu_k = _inputs(F32, seed=9)
    g = torch.Generator().manual_seed(2)
    alibi = torch.rand(len(LENGTHS_Q), 4, generator=g)  # [batch, H]: one row per sequence
    sinks = torch.randn(4, generator=g).requires_grad_()
    options = dict(window=(3, 1), softcap=2.5, sinks=sinks)
    out, lse = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 13, 13, is_causal=True, enable_gqa=True,
                                                return_lse=True, backend=backend, alibi_slopes=alibi, **options)
    leaves64 = [x.detach().to(F64).requires_grad_() for x in (q, k, v, sinks)]
    ref, ref_lse = _loop_softmax(*leaves64[:3], cu_q, cu_k, is_causal=True, enable_gqa=True, alibi=alibi.to(F64),
                                 **{**options, "sinks": leaves64[3]})
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse)
    # Sequence 5 has queries but no keys: out 0 and lse = the sink, exactly (1 query of 0 keys);
    # sequence 1 has keys but no query rows.
    assert not out[cu_q[5]:cu_q[6]].any() and torch.equal(lse[cu_q[5]:cu_q[6]], sinks.detach().expand(1, 4))
    # Gradients, the sinks' included: summed over the sequences (the empty one adds g_lse).
    g = torch.Generator().manual_seed(12)
    g_out, g_lse = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g, dtype=F64)
    got = torch.autograd.grad(_loss(out, lse, g_out.to(out.dtype), g_lse.to(lse.dtype)), (q, k, v, sinks))
    want = torch.autograd.grad(_loss(ref, ref_lse, g_out, g_lse), leaves64)
    for name, x, y in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert_close_to_reference(x, y, grad=True, name=name)
    # no gradient reaches the rows of the empty sequences
    assert not got[0][cu_q[5]:cu_q[6]].any()
    assert not got[1][cu_k[1]:cu_k[2]].any() and not got[2][cu_k[1]:cu_k[2]].any()
    # [H] slopes go to every sequence unchanged
    out_h = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 13, 13, enable_gqa=True, backend=backend,
                                             alibi_slopes=alibi[0])
    ref_h, _ = _loop_softmax(*(x.detach().to(F64) for x in (q, k, v)), cu_q, cu_k, enable_gqa=True,
                             alibi=alibi[0].to(F64))
    assert_close_to_reference(out_h, ref_h)


def test_dropout_runs_per_sequence():
    q, k, v, cu_q, cu_k = _inputs(F32)
    out = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 13, 13, dropout_p=0.3, enable_gqa=True)
    assert out.shape == (q.shape[0], 4, 5) and torch.isfinite(out).all()


def _bad_softmax_calls():
    q, k, v, cu_q, cu_k = (x.detach() for x in _inputs(F32))
    base = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=13, max_seqlen_k=13,
                enable_gqa=True)
    cases = [
        (dict(q=q.unsqueeze(0)), ValueError, "q must be a 3-D tensor"),
        (dict(k=k.double()), ValueError, "dtype"),
        (dict(v=v[:-1]), ValueError, "total_k"),
        (dict(k=k[..., :3]), ValueError, "head dim"),
        (dict(enable_gqa=False), ValueError, "enable_gqa=True"),
        (dict(cu_seqlens_q=cu_q.float()), TypeError, "int32 or int64"),
        (dict(cu_seqlens_q=cu_q.tolist()), TypeError, "torch.Tensor"),
        (dict(cu_seqlens_q=cu_q.view(1, -1)), ValueError, "1-D"),
        (dict(cu_seqlens_q=cu_q + 1), ValueError, "start at 0"),
        (dict(cu_seqlens_q=torch.cat([cu_q[:-1], cu_q[-1:] - 1])), ValueError, "end at the number of packed rows of q"),
        (dict(cu_seqlens_q=torch.tensor([0, 30, 20, cu_q[-1]], dtype=torch.int32)), ValueError, "non-decreasing"),
        (dict(cu_seqlens_q=cu_q[:-1]), ValueError, "end at"),
        (dict(cu_seqlens_k=torch.tensor([0, cu_k[-1]], dtype=torch.int32)), ValueError, "same length"),
        (dict(max_seqlen_q=12), ValueError, "below the length of sequence 4"),
        (dict(max_seqlen_k=13.0), TypeError, "max_seqlen_k must be an int"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(backend="nope"), ValueError, "backend"),
        (dict(not_an_option=1), TypeError, "unexpected keyword argument 'not_an_option'"),
    ]
    if HAS_SCORE_OPTIONS:
        cases.append((dict(alibi_slopes=torch.rand(3, 4)), ValueError, r"\[batch, H\] with batch = 9"))
    return [({**base, **change}, error, match) for change, error, match in cases]


@pytest.mark.parametrize("kwargs,error,match", _bad_softmax_calls())
def test_softmax_varlen_bad_arguments(kwargs, error, match, monkeypatch):
    calls = []
    monkeypatch.setattr(attnkit.ops.varlen, "softmax_attention", lambda *a, **kw: calls.append(a))
    with pytest.raises(error, match=match):
        attnkit.softmax_attention_varlen(**kwargs)
    assert not calls  # raised before any kernel


# ---- linear attention ------------------------------------------------------------------------


def _loop_linear(q, k, v, cu, dtype=None, **kwargs):
    outs = []
    for i in range(len(cu) - 1):
        qi, ki, vi = (_per_sequence(cu, x, i) for x in (q, k, v))
        if dtype is not None:
            qi, ki, vi = qi.to(dtype), ki.to(dtype), vi.to(dtype)
        outs.append(linear_attention_reference(qi, ki, vi, **kwargs)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False),
                                     dict(causal=True, feature_map="identity", normalize=False, scale=0.1)],
                         ids=["causal-elu", "elu", "causal-identity"])
@pytest.mark.parametrize("dtype", [F64, F32, BF16], ids=str)
def test_linear_varlen_matches_per_sequence_reference(dtype, options, backend):
    lengths = [7, 0, 1, 7, 13, 1, 7]
    q, k, v, cu, _ = _inputs(dtype, heads=3, kv_heads=3, d=6, dv=5, lengths_q=lengths, lengths_k=lengths, seed=4)
    out = attnkit.linear_attention_varlen(q, k, v, cu, backend=backend, **options)
    assert out.shape == (q.shape[0], 3, 5) and out.dtype == dtype
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad((out * g_out.to(dtype)).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    ref = _loop_linear(q64, k64, v64, cu, **options)
    want = torch.autograd.grad((ref * g_out).sum(), (q64, k64, v64))
    low, low_grads = None, (None, None, None)
    if dtype in LOW_PRECISION:
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        low = _loop_linear(ql, kl, vl, cu, **options)
        low_grads = torch.autograd.grad((low * g_out.to(dtype)).sum(), (ql, kl, vl))
    assert_close_to_reference(out, ref, low)
    for name, x, y, z in zip(("dq", "dk", "dv"), got, want, low_grads):
        assert_close_to_reference(x, y, z, grad=True, name=name)


def _loop_linear_states(q, k, v, cu, s0, z0, **kwargs):
    """(out, S, z) packed / per sequence from linear_attention_reference with each sequence's
    initial state (an empty sequence: no rows, its state the initial one)."""
    outs, states, sums = [], [], []
    for i in range(len(cu) - 1):
        qi, ki, vi = (_per_sequence(cu, x, i) for x in (q, k, v))
        if qi.shape[2] == 0:
            states.append(s0[i])
            sums.append(z0[i])
            continue
        out, (s, z) = linear_attention_reference(qi, ki, vi, initial_state=(s0[i:i + 1], z0[i:i + 1]),
                                                 return_state=True, **kwargs)
        outs.append(out[0].transpose(0, 1))
        states.append(s[0])
        sums.append(z[0])
    return torch.cat(outs), torch.stack(states), torch.stack(sums)


@pytest.mark.parametrize("backend, dtype", [("cpu", F64), ("cpu", F32), ("reference", F64), ("reference", F32),
                                            ("triton", F32)])  # (Triton: float16 / bfloat16 / float32)
@pytest.mark.parametrize("options", [dict(), dict(feature_map="identity", normalize=False, scale=0.1)],
                         ids=["elu", "identity"])
def test_linear_varlen_initial_and_final_states(dtype, options, backend):
    # Each sequence continues from its own initial state and returns its final one (an empty
    # sequence's: the initial state), forward and gradients -- of q, k, v and the initial state,
    # through out and both final states -- against the float64 loop.
    lengths = [7, 0, 1, 7, 13, 1, 7]
    q, k, v, cu, _ = _inputs(dtype, heads=3, kv_heads=3, d=6, dv=5, lengths_q=lengths, lengths_k=lengths, seed=8)
    g = torch.Generator().manual_seed(2)
    state_dtype = F64 if dtype == F64 else F32
    s0 = torch.randn(len(lengths), 3, 6, 5, generator=g, dtype=state_dtype).requires_grad_()
    z0 = (torch.rand(len(lengths), 3, 6, generator=g, dtype=state_dtype) + 1).requires_grad_()
    out, (S, z) = attnkit.linear_attention_varlen(q, k, v, cu, causal=True, initial_state=(s0, z0),
                                                  return_state=True, backend=backend, **options)
    assert out.shape == (q.shape[0], 3, 5) and S.shape == (7, 3, 6, 5) and z.shape == (7, 3, 6)
    assert S.dtype == z.dtype == state_dtype
    grads = [torch.randn(t.shape, generator=g, dtype=F64) for t in (out, S, z)]

    def loss(results):
        return sum((r * gr.to(r.dtype)).sum() for r, gr in zip(results, grads))

    got = torch.autograd.grad(loss((out, S, z)), (q, k, v, s0, z0))
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v, s0, z0)]
    ref = _loop_linear_states(*leaves[:3], cu, *leaves[3:], causal=True, **options)
    want = torch.autograd.grad(loss(ref), leaves)
    for name, x, y in zip(("out", "S", "z"), (out, S, z), ref):
        assert_close_to_reference(x, y.detach(), name=name)
    # the empty sequence's final state is its initial one, exactly
    assert torch.equal(S[1], s0[1]) and torch.equal(z[1], z0[1])
    for name, x, y in zip(("dq", "dk", "dv", "dS0", "dz0"), got, want):
        assert_close_to_reference(x, y, grad=True, name=name)


@pytest.mark.parametrize("change,error,match", [
    (dict(causal=False), ValueError, r"initial_state needs causal=True"),
    (dict(initial_state=lambda s: (s[0][:1], s[1][:1])), ValueError, r"initial_state\[0\] \(S\) must have shape"),
    (dict(initial_state=lambda s: (s[0].double(), s[1].double())), ValueError, r"must be float32"),
    (dict(initial_state=lambda s: s[0]), TypeError, r"must be a pair \(S, z\)"),
    (dict(initial_state=None, return_state=1), TypeError, "return_state must be a bool"),
    (dict(initial_state=None, return_state=True, causal=False), ValueError, r"return_state=True needs causal=True"),
])
def test_linear_varlen_bad_states(change, error, match):
    q, k, v, cu, _ = (x.detach() for x in _inputs(F32, heads=2, kv_heads=2, d=4, dv=3, lengths_q=[3, 4],
                                                   lengths_k=[3, 4]))
    kwargs = dict(causal=True, initial_state=(torch.zeros(2, 2, 4, 3), torch.zeros(2, 2, 4)))
    for name, value in change.items():
        kwargs[name] = value(kwargs[name]) if callable(value) else value
    with pytest.raises(error, match=match):
        attnkit.linear_attention_varlen(q, k, v, cu, **kwargs)


def test_linear_varlen_state_resets_per_sequence():
    # Two copies of one sequence packed together give the same rows twice (causal: no state
    # carried over from the first).
    q, k, v, cu, _ = _inputs(F32, heads=2, kv_heads=2, d=4, dv=4, lengths_q=[6], lengths_k=[6])
    doubled = [torch.cat([x, x]).detach() for x in (q, k, v)]
    out = attnkit.linear_attention_varlen(*doubled, _cu([6, 6]), causal=True)
    torch.testing.assert_close(out[:6], out[6:], rtol=0, atol=0)


@pytest.mark.parametrize("change,error,match", [
    (dict(v=lambda v: v[:-1]), ValueError, "number of packed rows"),
    (dict(k=lambda k: k[:, :1]), ValueError, "number of heads"),
    (dict(cu_seqlens=lambda cu: cu[:-1]), ValueError, "end at"),
    (dict(cu_seqlens=lambda cu: cu.float()), TypeError, "int32 or int64"),
    (dict(feature_map="softmax"), ValueError, "feature_map"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_linear_varlen_bad_arguments(change, error, match, monkeypatch):
    q, k, v, cu, _ = (x.detach() for x in _inputs(F32, heads=2, kv_heads=2, lengths_q=[3, 4], lengths_k=[3, 4]))
    kwargs = dict(q=q, k=k, v=v, cu_seqlens=cu)
    for name, value in change.items():
        kwargs[name] = value(kwargs[name]) if callable(value) else value
    calls = []
    monkeypatch.setattr(attnkit.ops.linear_varlen, "linear_attention", lambda *a, **kw: calls.append(a))
    with pytest.raises(error, match=match):
        attnkit.linear_attention_varlen(**kwargs)
    assert not calls


# ----------------------------------------------------------------------------------------------
# softmax_attention on nested (jagged) tensors: the packed path (ops/varlen.py)
# ----------------------------------------------------------------------------------------------


def _nested(packed, cu):
    """The packed [total, H, D] as SDPA's nested layout [B, H, j, D] (sharing cu as offsets)."""
    return torch.nested.nested_tensor_from_jagged(packed, cu.to(torch.int64)).transpose(1, 2)


@pytest.mark.parametrize("is_causal", [False, True])
def test_nested_tensors_match_the_per_sequence_reference(is_causal):
    lengths_q, lengths_k = [7, 1, 13, 3], [9, 2, 13, 3]
    cu_q, cu_k = _cu(lengths_q).to(torch.int64), _cu(lengths_k).to(torch.int64)
    q = _packed(lengths_q, 4, 8, F32, 1, requires_grad=True)
    k = _packed(lengths_k, 2, 8, F32, 2, requires_grad=True)
    v = _packed(lengths_k, 2, 6, F32, 3, requires_grad=True)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(4))
    out, lse = attnkit.softmax_attention(_nested(q, cu_q), _nested(k, cu_k), _nested(v, cu_k), is_causal=is_causal,
                                         enable_gqa=True, return_lse=True, softcap=4.0, sinks=sinks)
    assert out.is_nested and lse.is_nested and out.shape[:2] == (4, 4) and out.shape[3] == 6
    got, got_lse = out.transpose(1, 2).values(), lse.transpose(1, 2).values()
    want, want_lse = _loop_softmax(*(t.detach().to(F64).requires_grad_() for t in (q, k, v)), cu_q, cu_k,
                                   is_causal=is_causal, enable_gqa=True, softcap=4.0, sinks=sinks.to(F64))
    assert_close_to_reference(got, want)
    assert_close_to_reference(got_lse, want_lse, name="lse")
    # The output has query's ragged structure (its offsets), and gradients reach the values.
    assert out.transpose(1, 2).offsets() is cu_q
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(got, (q, k, v), g)
    ref_inputs = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    ref, _ = _loop_softmax(*ref_inputs, cu_q, cu_k, is_causal=is_causal, enable_gqa=True, softcap=4.0,
                           sinks=sinks.to(F64))
    for name, a, b in zip("qkv", grads, torch.autograd.grad(ref, ref_inputs, g.to(F64))):
        assert_close_to_reference(a, b, grad=True, name=f"grad {name}")


def test_nested_tensors_match_sdpa_and_refuse_what_they_cannot_take():
    lengths = [5, 3, 1]
    cu = _cu(lengths).to(torch.int64)
    q = _nested(_packed(lengths, 2, 8, F32, 0), cu)
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q)  # (SDPA's nested path: not causal)
    got = attnkit.softmax_attention(q, q, q)
    torch.testing.assert_close(got.values(), want.values(), rtol=2e-5, atol=2e-6)
    dense = torch.randn(3, 2, 5, 8)
    with pytest.raises(ValueError, match="must all be nested tensors or none; query, value are nested, key is not"):
        attnkit.softmax_attention(q, dense, q)
    with pytest.raises(ValueError, match="attn_mask is not supported with nested tensors"):
        attnkit.softmax_attention(q, q, q, attn_mask=torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must be \[B, H, j, D\] with the ragged dim third"):
        attnkit.softmax_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    strided = torch.nested.nested_tensor([torch.randn(2, 5, 8), torch.randn(2, 3, 8)])
    with pytest.raises(ValueError, match="must have the jagged layout"):
        attnkit.softmax_attention(strided, strided, strided)
    other = _nested(_packed([5, 4, 1], 2, 8, F32, 1), _cu([5, 4, 1]).to(torch.int64))
    with pytest.raises(ValueError, match="nested key and value must have the same sequence lengths"):
        attnkit.softmax_attention(q, q, other)
    with pytest.raises(ValueError, match="must all be nested tensors or none; key is nested, query is not"):
        attnkit.softmax_attention(dense, q, dense)

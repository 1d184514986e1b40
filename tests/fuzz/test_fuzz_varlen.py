"""Differential fuzzing of the packed-sequence ops (issue 28): attnkit.softmax_attention_varlen
and attnkit.linear_attention_varlen on random packs -- lengths 0 and 1 among odd ones, equal
lengths adjacent (one view call) and apart (a gathered call), query and key lengths apart, int32
and int64 offsets, inputs packed contiguous, transposed, strided, expanded over heads or sliced
from one fused qkv tensor -- against float64 references built one sequence at a time (a loop
over the offsets: nothing of the ops' grouping), forward and gradients, on every backend usable
here.  The softmax op also gets the score options (window, softcap, ALiBi [H] or [batch, H],
sinks), GQA, is_causal and the lse.

The subject is the packing: the grouping, the gathers and scatters, the per-sequence options
and the gradients' way back into the packed tensors.  The kernels' own 16-bit gradient
roundings are test_fuzz_softmax*.py's and test_fuzz_linear.py's subject (with their budgets):
here float16 / bfloat16 cases check the forward (DESIGN.md's rule against the same loop run in
that dtype), float32 / float64 cases the forward and the gradients.  On triton the softmax op
also draws dropout: its one launch's masks are reproducible from the seed it draws
(kernels/softmax.py ``varlen_dropout_keep_masks``), so the references apply the same ones."""
import itertools

import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (requirements.txt)")
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit.reference.linear import feature_map_reference, linear_attention_reference
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, LOW_PRECISION, spread_free_run
from fuzzing import (
    BACKENDS, LAYOUTS, Input, check_exact, dtypes_for, fuzz_settings, interpreted, leaves, linear_operand_rounding,
    linear_state_rounding, linear_term_sizes, make_input, require_backend, softmax_term_sizes, tolerance, value_size,
)

LENGTHS = [0, 1, 2, 3, 5, 7, 16, 17]
LENGTHS_INTERPRETED = [0, 1, 2, 3, 5, 7]
DIMS = [1, 3, 8, 16, 31, 64]
DIMS_INTERPRETED = [1, 3, 8, 16]
WINDOW_SIDES = [-1, 0, 1, 2, 5, 40]
# The cuda kernels: softmax without score options at D = Dv in {64, 128}, their own fuzz columns.
KERNEL_BACKENDS = [p for p in BACKENDS if p.values[0] != "cuda"]
LINEAR_MODES = [("elu", True), ("elu", False), ("relu", False), ("identity", False)]


def _draw_pack(draw, device, backend, label, count=None):
    """Sequence lengths: ``count`` (default: drawn) sequences, each of one of 1-3 lengths drawn
    for the pack -- so that equal lengths recur, adjacent (one view call) and apart (a gathered
    call; with [batch, H] slopes, rows picked out of order)."""
    pool = LENGTHS_INTERPRETED if interpreted(backend, device) else LENGTHS
    kinds = [draw(st.sampled_from(pool), label=f"{label} length {i}")
             for i in range(draw(st.integers(1, 3), label=f"{label} lengths"))]
    if count is None:
        count = draw(st.integers(1, 6), label=f"{label} sequences")
    return [kinds[draw(st.integers(0, len(kinds) - 1), label=f"{label} sequence {i}")] for i in range(count)]


def _cu(lengths, dtype, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype, device=device)


def _packed_inputs(draw, gen, shapes, fused, dtype, device):
    """Input objects for the packed q, k, v of ``shapes`` ([total, H, D] each): one fused
    [total, 3, H, D] base sliced three ways, or each its own base in a drawn layout."""
    if fused:
        total, h, d = shapes[0]
        base = torch.randn(total, 3, h, d, generator=gen, dtype=F64).to(device=device, dtype=dtype)
        return [Input(base, (lambda b, i=i: b[:, i])) for i in range(3)]
    return [make_input(shape, draw(st.sampled_from(LAYOUTS), label=f"{name} layout"), gen, dtype, device)
            for name, shape in zip("qkv", shapes)]


def _sequence_view(inp, start, stop):
    """Sequence rows start:stop of a packed input as [1, H, n, D] (an Input on the same base)."""
    return Input(inp.base, lambda b: inp.view(b)[start:stop].transpose(0, 1).unsqueeze(0))


def _sequences(inputs, cu_q, cu_k):
    """Per sequence, the (q, k, v) Inputs of [1, H, n_i, D] views of the packed bases."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [[_sequence_view(inputs[0], cq[i], cq[i + 1])] + [_sequence_view(x, ck[i], ck[i + 1]) for x in inputs[1:]]
            for i in range(len(cq) - 1)]


def _check_gradients(label, dtype, bases, bases64, sizes):
    """Each packed base's gradient (once for a base q, k, v share) against the float64 one, held
    to ``sizes`` (the largest term each sums, for gradients that cancel)."""
    seen = set()
    for i, (name, base, base64) in enumerate(zip("qkv", bases, bases64)):
        if id(base) in seen or base64.grad is None or base64.grad.numel() == 0:
            continue
        seen.add(id(base))
        got = base.grad if base.grad is not None else torch.zeros_like(base)
        check_exact(f"{label} d{name}", got, base64.grad, tolerance(dtype, base64.grad, grad=True, size=sizes[i]))


def _unpack(x):
    """[1, H, n, ...] -> [n, H, ...] (the packed layout)."""
    return x[0].transpose(0, 1)


# ----------------------------------------------------------------------------------------------
# softmax_attention_varlen
# ----------------------------------------------------------------------------------------------


def _softmax_loop(seqs, bases, is_causal, scale, group, opts, alibi, v_eye=False, dropout=None):
    """Packed (out, lse) from one softmax_attention_reference call per sequence, on the views of
    ``bases`` (float64 or the inputs' dtype); ``alibi`` [batch, H] gives each sequence its row.
    ``v_eye``: the probabilities instead, V = the identity (a list, one per sequence; without
    dropout).  ``dropout``: (p, each sequence's keep mask [H, n, m])."""
    outs, lses = [], []
    for i, views in enumerate(seqs):
        q, k, v = (inp.view(b) for inp, b in zip(views, bases))
        if v_eye:
            m = k.shape[-2]
            v = torch.eye(m, dtype=F64, device=k.device).expand(*k.shape[:-1], m)
        extra = dict(opts)
        if alibi is not None:
            extra["alibi_slopes"] = alibi[i:i + 1] if alibi.dim() == 2 else alibi
        p = 0.0
        if dropout is not None and not v_eye:
            p, extra["dropout_mask"] = dropout[0], dropout[1][i].unsqueeze(0)
        out, lse = softmax_attention_reference(q, k, v, None, p, is_causal, scale, group > 1, return_lse=True,
                                               **extra)
        outs.append(out)
        lses.append(lse)
    if v_eye:
        return outs
    return torch.cat([_unpack(o) for o in outs]), torch.cat([_unpack(x.unsqueeze(-1)).squeeze(-1) for x in lses])


def _check_softmax_case(backend, device, draw):
    dtype = draw(st.sampled_from(dtypes_for(backend, device)), label="dtype")
    lengths_q = _draw_pack(draw, device, backend, "q")
    lengths_k = lengths_q if draw(st.booleans(), label="self-attention") else \
        _draw_pack(draw, device, backend, "k", count=len(lengths_q))
    batch = len(lengths_q)
    hk, group = draw(st.integers(1, 2), label="Hk"), draw(st.sampled_from([1, 1, 2]), label="GQA group")
    h = hk * group
    dims = DIMS_INTERPRETED if interpreted(backend, device) else DIMS
    d = draw(st.sampled_from(dims), label="D")
    dv = d if draw(st.booleans(), label="Dv = D") else draw(st.sampled_from(dims), label="Dv")
    fused = lengths_k == lengths_q and group == 1 and d == dv and draw(st.booleans(), label="fused qkv")
    is_causal = draw(st.booleans(), label="is_causal")
    window = draw(st.one_of(st.none(), st.tuples(st.sampled_from(WINDOW_SIDES), st.sampled_from(WINDOW_SIDES))),
                  label="window")
    softcap = draw(st.sampled_from([0.0, 0.0, 0.5, 5.0]), label="softcap")
    alibi_kind = draw(st.sampled_from(["none", "none", "h", "batch"]), label="alibi_slopes")
    with_sinks = draw(st.booleans(), label="sinks")
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="scale")
    cu_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="offsets dtype")
    want_grad = draw(st.booleans(), label="gradients") and dtype not in LOW_PRECISION
    lse_in_loss = want_grad and draw(st.booleans(), label="the lse in the loss")
    dropout_p = draw(st.sampled_from([0.0, 0.0, 0.25]), label="dropout_p") if backend == "triton" else 0.0
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))

    total_q, total_k = sum(lengths_q), sum(lengths_k)
    inputs = _packed_inputs(draw, gen, ((total_q, h, d), (total_k, hk, d), (total_k, hk, dv)), fused, dtype, device)
    alibi = None
    if alibi_kind != "none":
        alibi = (torch.rand((h,) if alibi_kind == "h" else (batch, h), generator=gen) * 0.5).to(device)
    sinks = (torch.randn(h, generator=gen) * 2).to(device) if with_sinks else None
    cu_q, cu_k = _cu(lengths_q, cu_dtype, device), _cu(lengths_k, cu_dtype, device)

    bases, bases64 = leaves(inputs, want_grad)
    q, k, v = (inp.view(b) for inp, b in zip(inputs, bases))
    sinks_leaf = None if sinks is None else sinks.clone().requires_grad_(want_grad)
    sinks64 = None if sinks is None else sinks.to(F64).requires_grad_(want_grad)
    opts = dict(window=window, softcap=softcap, sinks=sinks_leaf)
    torch_seed = int(torch.randint(2**31, (), generator=gen)) if dropout_p else 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed)
        out, lse = attnkit.softmax_attention_varlen(
            q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=group > 1, return_lse=True, backend=backend, alibi_slopes=alibi, **opts)
    dropout = None
    if dropout_p:  # the seed the call drew (softmax_attention's draw, ops/softmax.py _draw_seed), its masks
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed)
            call_seed = int(torch.randint(2**31 - 1, (), dtype=torch.int64))
        from attnkit.kernels import softmax as triton_softmax

        dropout = (dropout_p, triton_softmax.varlen_dropout_keep_masks(cu_q, cu_k, h, dropout_p, call_seed, device))

    assert out.shape == (total_q, h, dv) and out.dtype == dtype and out.device.type == device
    assert lse.shape == (total_q, h) and lse.dtype == (F64 if dtype == F64 else torch.float32)

    seqs = _sequences(inputs, cu_q.cpu(), cu_k.cpu())
    opts64 = dict(opts, sinks=sinks64)
    alibi64 = None if alibi is None else alibi.to(F64)
    ref, ref_lse = _softmax_loop(seqs, bases64, is_causal, scale, group, opts64, alibi64, dropout=dropout)
    naive = naive_lse = None
    if dtype in LOW_PRECISION:
        with torch.no_grad():
            naive, naive_lse = spread_free_run(  # issue 24
                lambda *b: _softmax_loop(seqs, b, is_causal, scale, group, dict(opts, sinks=sinks), alibi,
                                         dropout=dropout),
                *(b.detach() for b in bases))
    check_exact(f"{backend} out", out, ref, tolerance(dtype, ref, naive=naive, size=value_size(bases64[2].detach())))
    check_exact(f"{backend} lse", lse, ref_lse, tolerance(dtype, ref_lse, naive=naive_lse, unit=1.0))
    # Sequences with query rows but no key: out exactly 0, the lse -inf (or the sink).
    # (The reference backend in float16 / bfloat16 computes its lse in that dtype: the sink rounded.)
    exact_sink = sinks is None or not (backend == "reference" and dtype in LOW_PRECISION)
    for i in range(batch):
        if lengths_k[i] == 0 and lengths_q[i] and exact_sink:
            rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
            assert not out.detach()[rows].any(), f"{backend}: sequence {i} has no key, its out is not 0"
            want_lse = torch.full((lengths_q[i], h), float("-inf")) if sinks is None else sinks.cpu().expand(lengths_q[i], h)
            assert torch.equal(lse.detach()[rows].cpu(), want_lse.to(lse.dtype)), f"{backend}: sequence {i}'s lse"

    if not want_grad:
        return
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    finite_lse = torch.isfinite(ref_lse.detach()).cpu()  # no gradient through a -inf lse
    g_lse = torch.where(finite_lse, torch.randn(lse.shape, generator=gen, dtype=F64), 0.0) if lse_in_loss \
        else torch.zeros(lse.shape, dtype=F64)

    def backward(out, lse):
        outputs, grads = [out], [g.to(device=out.device, dtype=out.dtype)]
        if lse_in_loss:
            outputs.append(torch.where(finite_lse.to(lse.device), lse, 0.0))
            grads.append(g_lse.to(device=lse.device, dtype=lse.dtype))
        torch.autograd.backward(outputs, grads)

    backward(out, lse)
    backward(ref, ref_lse)
    # the yardstick of a gradient that cancels: its largest term, sequence by sequence
    sizes = [0.0, 0.0, 0.0]
    with torch.no_grad():
        probs = _softmax_loop(seqs, [b.detach() for b in bases64], is_causal, scale, group,
                              dict(opts64, sinks=None if sinks64 is None else sinks64.detach()), alibi64, v_eye=True)
    sc = 1.0 / d ** 0.5 if scale is None else scale
    cq = cu_q.tolist()
    for i, (views, p) in enumerate(zip(seqs, probs)):
        rows = slice(cq[i], cq[i + 1])
        seq_out = ref.detach()[rows].transpose(0, 1).unsqueeze(0)
        seq_g = g[rows].transpose(0, 1).unsqueeze(0)
        seq_g_lse = g_lse[rows].transpose(0, 1).unsqueeze(0)
        each = softmax_term_sizes(views, bases64, p, seq_out, sc, group, seq_g.to(seq_out.device),
                                  seq_g_lse.to(seq_out.device))
        # (dropout scales the kept probabilities by 1 / (1 - p): terms at most that much larger)
        sizes = [max(a, b / (1.0 - dropout_p)) for a, b in zip(sizes, each)]
    _check_gradients(backend, dtype, bases, bases64, sizes)
    if sinks is not None:
        # d sink_h = Σ_rows p_sink (g_lse - D): held to the size of its terms, p_sink (|g_lse| + |D|)
        with torch.no_grad():
            p_sink = torch.exp(sinks64.detach() - ref_lse.detach()).cpu()  # [total_q, H]
            big_d = (g * ref.detach().cpu()).sum(-1).abs()
            size = (p_sink * (g_lse.abs() + big_d)).sum(0).max().item() if total_q else 0.0
        got = sinks_leaf.grad if sinks_leaf.grad is not None else torch.zeros_like(sinks_leaf)
        # (float32 sinks: the float32 rule for float32 / float64 inputs alike, as in the options fuzz)
        check_exact(f"{backend} dsinks", got, sinks64.grad, tolerance(torch.float32, sinks64.grad, grad=True, size=size))


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@fuzz_settings(10)
@given(data=st.data())
def test_softmax_varlen_matches_float64_reference(backend, device, data):
    require_backend("softmax", backend, device)
    _check_softmax_case(backend, device, data.draw)


# ----------------------------------------------------------------------------------------------
# linear_attention_varlen
# ----------------------------------------------------------------------------------------------


def _sequence_state(states, i):
    """Sequence i's initial state ``(S0 [1, H, D, Dv], z0 [1, H, D])`` of the pack's, or None."""
    return None if states is None else (states[0][i:i + 1], states[1][i:i + 1])


def _linear_loop_parts(seqs, bases, kwargs, states=None):
    """One linear_attention_reference call per sequence (its state from zero, or from its row of
    ``states``): [1, H, n_i, Dv] each."""
    return [linear_attention_reference(*(inp.view(b) for inp, b in zip(views, bases)),
                                       initial_state=_sequence_state(states, i), **kwargs)
            for i, views in enumerate(seqs)]


def _linear_loop(seqs, bases, kwargs, states=None):
    """Packed out from :func:`_linear_loop_parts`."""
    return torch.cat([_unpack(o) for o in _linear_loop_parts(seqs, bases, kwargs, states)])


def _check_final_states(name, kernel, dtype, got, seqs, bases, bases64, kwargs, states, states64):
    """Each sequence's returned (S, z) against S0 + Σ φ(k_j) v_jᵀ, z0 + Σ φ(k_j) in float64: for
    float32 / float64 inputs the rule of the state dtype on the size of those sums' terms; for
    16-bit inputs DESIGN.md's rule against the reference run in the dtype, plus -- for the
    kernels, whose φ(k) is a 16-bit product operand -- one rounding of each φ(k_j)
    (fuzzing.linear_state_rounding)."""
    feature_map = kwargs["feature_map"]
    low = dtype in LOW_PRECISION
    u = torch.finfo(dtype).eps / 2 if low else 0.0
    for i, views in enumerate(seqs):
        k, v = (inp.view(b).detach() for inp, b in list(zip(views, bases64))[1:])
        pk = feature_map_reference(k, feature_map)[0]  # [H, n, D]
        s0, z0 = (t[0] for t in _sequence_state(states64, i)) if states64 is not None else (0.0, 0.0)
        want = (s0 + pk.transpose(-2, -1) @ v[0], z0 + pk.sum(-2))
        sizes = ((abs(s0) + pk.abs().transpose(-2, -1) @ v[0].abs()).max().item(),
                 (abs(z0) + pk.abs().sum(-2)).max().item())
        extra = (linear_state_rounding(k, v, feature_map, u), u * pk.abs().sum(-2).max().item()) if low \
            else (0.0, 0.0)
        naive = (None, None)
        if low:
            with torch.no_grad():
                naive = linear_attention_reference(*(inp.view(b).detach() for inp, b in zip(views, bases)),
                                                   initial_state=_sequence_state(states, i), return_state=True,
                                                   **kwargs)[1]
        for what, j in (("S", 0), ("z", 1)):
            if low:
                tol = tolerance(dtype, want[j], naive=naive[j][0]) + (extra[j] if kernel else 0.0)
            else:
                tol = tolerance(F64 if dtype == F64 else torch.float32, want[j], size=sizes[j])
            check_exact(f"{name} {what}[{i}]", got[j][i], want[j], tol)


def _check_linear_case(backend, device, draw):
    dtype = draw(st.sampled_from(dtypes_for(backend, device)), label="dtype")
    lengths = _draw_pack(draw, device, backend, "pack")
    h = draw(st.integers(1, 3), label="H")
    dims = DIMS_INTERPRETED if interpreted(backend, device) else DIMS
    d = draw(st.sampled_from(dims), label="D")
    dv = d if draw(st.booleans(), label="Dv = D") else draw(st.sampled_from(dims), label="Dv")
    fused = d == dv and draw(st.booleans(), label="fused qkv")
    causal = draw(st.booleans(), label="causal")
    with_state = causal and draw(st.booleans(), label="initial state")
    return_state = causal and draw(st.booleans(), label="return_state")
    feature_map, normalize = draw(st.sampled_from(LINEAR_MODES), label="feature map, normalize")
    eps = draw(st.sampled_from([1e-6, 1e-3]), label="eps") if normalize else 1e-6
    scale = 1.0 if normalize else draw(st.one_of(st.floats(0.05, 2.0), st.floats(-2.0, -0.05)), label="scale")
    cu_dtype = draw(st.sampled_from([torch.int32, torch.int64]), label="offsets dtype")
    want_grad = draw(st.booleans(), label="gradients") and dtype not in LOW_PRECISION
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))

    total = sum(lengths)
    inputs = _packed_inputs(draw, gen, ((total, h, d), (total, h, d), (total, h, dv)), fused, dtype, device)
    cu = _cu(lengths, cu_dtype, device)
    kwargs = dict(causal=causal, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale)
    bases, bases64 = leaves(inputs, want_grad)
    q, k, v = (inp.view(b) for inp, b in zip(inputs, bases))
    states = states64 = None
    if with_state:  # one per sequence (z0 > 0: a normalizer away from 0); float32 (float64 for float64)
        state_dtype = F64 if dtype == F64 else torch.float32
        s0 = torch.randn(len(lengths), h, d, dv, generator=gen, dtype=F64) * 0.5
        z0 = torch.rand(len(lengths), h, d, generator=gen, dtype=F64) + 0.5
        states = tuple(t.to(device=device, dtype=state_dtype).requires_grad_(want_grad) for t in (s0, z0))
        states64 = tuple(t.detach().to(F64) for t in states)
    result = attnkit.linear_attention_varlen(q, k, v, cu, backend=backend, initial_state=states,
                                             return_state=return_state, **kwargs)
    out = result[0] if return_state else result
    assert out.shape == (total, h, dv) and out.dtype == dtype and out.device.type == device

    seqs = _sequences(inputs, cu.cpu(), cu.cpu())
    ref = _linear_loop(seqs, bases64, kwargs, states64)
    naive = None
    if dtype in LOW_PRECISION:
        with torch.no_grad():
            naive = spread_free_run(lambda *b: _linear_loop(seqs, b, kwargs, states), *(b.detach() for b in bases))  # issue 24
    name = f"{backend} linear varlen({feature_map}, normalize={normalize}, causal={causal}, state={with_state})"
    tol = tolerance(dtype, ref, naive=naive)
    if dtype in LOW_PRECISION and backend != "reference":  # the kernels' 16-bit product operands
        u = torch.finfo(dtype).eps / 2
        tol += max([linear_operand_rounding(*(inp.view(b) for inp, b in zip(views, bases64)), seq_ref, causal,
                                            feature_map, normalize, eps, scale, _sequence_state(states64, i), u)
                    for i, (views, seq_ref) in enumerate(zip(seqs, _linear_loop_parts(seqs, bases64, kwargs, states64)))],
                   default=0.0)
    check_exact(f"{name} out", out, ref, tol)
    if return_state:
        _check_final_states(name, backend != "reference", dtype, result[1], seqs, bases, bases64, kwargs, states,
                            states64)

    if not want_grad:
        return
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    out.backward(g.to(device=out.device, dtype=dtype))
    ref.backward(g.to(ref.device))
    sizes = [0.0, 0.0, 0.0]
    cs = cu.tolist()
    for i, views in enumerate(seqs):
        seq_g = g[cs[i]:cs[i + 1]].transpose(0, 1).unsqueeze(0)
        each = linear_term_sizes(views, bases64, causal, feature_map, normalize, eps, scale, seq_g,
                                 _sequence_state(states64, i))
        sizes = [max(a, b) for a, b in zip(sizes, each)]
    _check_gradients(name, dtype, bases, bases64, sizes)


@pytest.mark.parametrize("backend,device", KERNEL_BACKENDS)
@fuzz_settings(10)
@given(data=st.data())
def test_linear_varlen_matches_float64_reference(backend, device, data):
    require_backend("linear", backend, device)
    _check_linear_case(backend, device, data.draw)

"""The Triton softmax kernels over packed sequences in one launch (issue 28 / 26):
``softmax_varlen_fwd`` / ``softmax_varlen_bwd`` (kernels/softmax.py, VARLEN) and the path of
``attnkit.softmax_attention_varlen`` that takes them (pytorch_ext/ops/varlen_triton.py).

Ground truth: the float64 reference run one sequence at a time (a loop over the offsets).  Each
sequence's arithmetic in the packed launch is that of the per-sequence launch with the same tile
config -- the same tiles from the sequence's first row -- so the forward and the gradients are
also checked bit for bit against softmax_attention(backend="triton") called per sequence.
Without a GPU these run under the Triton interpreter (tests/conftest.py): small packs, one tile
config each.
"""
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

import attnkit  # noqa: E402
from attnkit.kernels import softmax as triton_softmax  # noqa: E402
from attnkit.reference.softmax import softmax_attention_reference  # noqa: E402
from attnkit_testing import F64, LOW_PRECISION, TRITON_BF16_TEST, assert_close_to_reference  # noqa: E402

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=2)
# Odd lengths, 0 and 1, a sequence with queries and no key, one with keys and no query, two
# longer than one tile; the keys' lengths apart from the queries'.
LENGTHS_Q = [5, 0, 1, 19, 3, 33]
LENGTHS_K = [7, 4, 1, 19, 0, 21]


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)


def _pack(lengths_q, lengths_k, h, hk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), h, d, generator=g)
    k = torch.randn(sum(lengths_k), hk, d, generator=g)
    v = torch.randn(sum(lengths_k), hk, dv, generator=g)
    go = torch.randn(sum(lengths_q), h, dv, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, go)]


def _loop(q, k, v, cu_q, cu_k, is_causal, options, alibi=None, dropout=None):
    """Packed (out [total_q, H, Dv], lse [total_q, H]) from softmax_attention_reference called
    per sequence, in the inputs' dtype; ``dropout``: (p, the keep mask [H, n, m] of each
    sequence)."""
    outs, lses = [], []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0) for x, a, b in
                      ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))
        extra = dict(options)
        if alibi is not None:
            extra["alibi_slopes"] = alibi[i:i + 1] if alibi.dim() == 2 else alibi
        if dropout is not None:
            extra.update(dropout_p=dropout[0], dropout_mask=dropout[1][i].unsqueeze(0))
        out, lse = softmax_attention_reference(qi, ki, vi, is_causal=is_causal, enable_gqa=True, return_lse=True,
                                               **extra)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _launcher_kwargs(options, alibi):
    window = options.get("window") or (-1, -1)
    return dict(window_left=window[0], window_right=window[1], softcap=options.get("softcap", 0.0),
                alibi_slopes=alibi, sinks=options.get("sinks"))


def _assert_gradient_close(got, want64, low, term, name):
    """DESIGN.md's rule for a gradient whose exact value may cancel: the float32 rule on the
    size of its terms ``term``; in float16 / bfloat16 the rule plus that float32 term (the
    kernels accumulate in float32; the reference run in the dtype can come out exact there)."""
    err = (got.to(F64) - want64).abs().max().item() if got.numel() else 0.0
    size = max(term, want64.abs().max().item() if want64.numel() else 0.0)
    tol = 1e-4 * size
    if got.dtype in LOW_PRECISION:
        tol += 2 * ((low.to(F64) - want64).abs().max().item() if low.numel() else 0.0) + 1e-3
    assert err <= tol, f"{name} ({got.dtype}): max error {err:.3e} > tolerance {tol:.3e}"


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window": dict(window=(3, 1)),
    "causal-window-wider-than-sequences": dict(is_causal=True, window=(40, -1)),
    "zero-width-window": dict(window=(0, 0)),
    # M < N in the last sequence (33 queries, 21 keys): its rows 0-11 see no key
    "window-rows-without-keys": dict(window=(1, 0)),
    "softcap-alibi-h": dict(softcap=1.5, alibi="h"),
    "causal-alibi-per-sequence-sinks": dict(is_causal=True, alibi="batch", sinks=True),
    "window-softcap-sinks": dict(window=(2, 2), softcap=0.7, sinks=True),
}


def _case(name, h, batch, seed=3):
    spec = dict(CASES[name])
    is_causal = spec.pop("is_causal", False)
    g = torch.Generator().manual_seed(seed)
    alibi = None
    kind = spec.pop("alibi", None)
    if kind is not None:
        alibi = (torch.rand((h,) if kind == "h" else (batch, h), generator=g) * 0.5).to(DEVICE)
    if spec.pop("sinks", False):
        spec["sinks"] = (torch.randn(h, generator=g) * 2).to(DEVICE)
    return is_causal, spec, alibi


@pytest.mark.parametrize("dtype", [F32, F16, pytest.param(BF16, marks=TRITON_BF16_TEST)], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_launchers_match_the_float64_loop(name, dtype):
    h, hk, d, dv = 4, 2, 7, 5
    q, k, v, go = _pack(LENGTHS_Q, LENGTHS_K, h, hk, d, dv, dtype, seed=len(name))
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    is_causal, options, alibi = _case(name, h, len(LENGTHS_Q))
    kw = _launcher_kwargs(options, alibi)
    out, lse = triton_softmax.softmax_varlen_fwd(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), None,
                                                 is_causal, CFG, **kw)
    assert out.shape == (sum(LENGTHS_Q), h, dv) and out.dtype == dtype
    assert lse.shape == (h, sum(LENGTHS_Q)) and lse.dtype == F32
    kw.pop("sinks")
    dq, dk, dv_ = triton_softmax.softmax_varlen_bwd(go, q, k, v, out, lse, cu_q, cu_k, max(LENGTHS_Q),
                                                    max(LENGTHS_K), None, is_causal, CFG, **kw)

    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v)]
    opts64 = dict(options, **({"sinks": options["sinks"].to(F64)} if "sinks" in options else {}))
    ref, ref_lse = _loop(*leaves, cu_q, cu_k, is_causal, opts64, None if alibi is None else alibi.to(F64))
    want = torch.autograd.grad(ref, leaves, go.to(F64))
    low = low_grads = (None,) * 3
    if dtype in LOW_PRECISION:
        low_leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        low = _loop(*low_leaves, cu_q, cu_k, is_causal, options, alibi)
        low_grads = torch.autograd.grad(low[0], low_leaves, go)
    assert_close_to_reference(out, ref, low[0], name="out")
    assert_close_to_reference(lse.t(), ref_lse, low[1], name="lse", dtype=dtype)
    assert_close_to_reference(dv_, want[2], low_grads[2], grad=True, name="dv")
    # dq and dk cancel where a row sees one key (a zero-width window: dS = P (dP - D) = 0
    # exactly): held to the size of the terms they sum, dS's bounded by 2 scale Dv |dO| |V|.
    ds = 2 * d ** -0.5 * dv * go.abs().max().item() * v.abs().max().item()
    rows_per_key = max(LENGTHS_Q) * (h // hk)
    for nm, got, w, lo, term in (("dq", dq, want[0], low_grads[0], ds * k.abs().max().item()),
                                 ("dk", dk, want[1], low_grads[1], ds * q.abs().max().item() * rows_per_key)):
        _assert_gradient_close(got, w, lo, term, nm)
    # Sequence 4 has queries and no key: out 0, lse -inf (or the sink); sequence 1 has keys and
    # no query: its dk, dv are 0.
    rows = slice(sum(LENGTHS_Q[:4]), sum(LENGTHS_Q[:5]))
    assert not out[rows].any()
    want_lse = torch.full((h, LENGTHS_Q[4]), float("-inf"), device=DEVICE) if "sinks" not in options \
        else options["sinks"].unsqueeze(1).expand(h, LENGTHS_Q[4])
    assert torch.equal(lse[:, rows], want_lse)
    keys = slice(sum(LENGTHS_K[:1]), sum(LENGTHS_K[:2]))
    assert not dk[keys].any() and not dv_[keys].any()


@pytest.fixture
def no_hopper_path(monkeypatch):
    # The per-sequence calls compared bit for bit must take kernels/softmax.py's flash kernels
    # (the Hopper fast path is another kernel).
    monkeypatch.setenv("ATTNKIT_TRITON_HOPPER", "0")


@pytest.mark.parametrize("name", ["causal", "causal-alibi-per-sequence-sinks", "window-softcap-sinks"])
def test_one_launch_gives_the_per_sequence_launches_bits(name, no_hopper_path):
    h, hk, d, dv = 4, 2, 16, 8
    q, k, v, go = _pack(LENGTHS_Q, LENGTHS_K, h, hk, d, dv, F32, seed=11)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    is_causal, options, alibi = _case(name, h, len(LENGTHS_Q))
    kw = _launcher_kwargs(options, alibi)
    out, lse = triton_softmax.softmax_varlen_fwd(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), None,
                                                 is_causal, CFG, **kw)
    kw.pop("sinks")
    grads = triton_softmax.softmax_varlen_bwd(go, q, k, v, out, lse, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K),
                                              None, is_causal, CFG, **kw)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(LENGTHS_Q)):
        if LENGTHS_Q[i] == 0 or LENGTHS_K[i] == 0:
            continue  # (the per-sequence launcher returns those on the host)
        qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0).contiguous() for x, a, b in
                      ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))
        gi = go[cq[i]:cq[i + 1]].transpose(0, 1).unsqueeze(0).contiguous()
        kwi = _launcher_kwargs(options, None if alibi is None else (alibi[i:i + 1] if alibi.dim() == 2 else alibi))
        oi, li = triton_softmax.softmax_fwd(qi, ki, vi, None, None, is_causal, config=CFG, **kwi)
        kwi.pop("sinks")
        dqi, dki, dvi = triton_softmax.softmax_bwd(gi, qi, ki, vi, oi, li, None, None, is_causal, config=CFG, **kwi)
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        assert torch.equal(out[rows], oi[0].transpose(0, 1)), f"sequence {i}: out"
        assert torch.equal(lse[:, rows], li[0]), f"sequence {i}: lse"
        for nm, got, want, sl in (("dq", grads[0], dqi, rows), ("dk", grads[1], dki, keys), ("dv", grads[2], dvi, keys)):
            assert torch.equal(got[sl], want[0].transpose(0, 1)), f"sequence {i}: {nm}"


def _public_case(dtype=F32, requires_grad=True):
    q, k, v, _ = _pack(LENGTHS_Q, LENGTHS_K, 4, 2, 8, 8, dtype, seed=5)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)], _cu(LENGTHS_Q), _cu(LENGTHS_K)


def _recorded_launches(monkeypatch):
    """The list that the launchers' names are appended to as they run (varlen and dense)."""
    calls = []
    for name in ("softmax_varlen_fwd", "softmax_varlen_bwd", "softmax_fwd"):
        original = getattr(triton_softmax, name)
        monkeypatch.setattr(triton_softmax, name, lambda *a, _f=original, _n=name, **kw: (calls.append(_n), _f(*a, **kw))[1])
    return calls


def test_the_public_function_takes_one_launch(monkeypatch):
    calls = _recorded_launches(monkeypatch)
    (q, k, v), cu_q, cu_k = _public_case()
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    out, lse = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, is_causal=True, enable_gqa=True,
                                                return_lse=True, backend="triton", sinks=sinks, window=(5, 0))
    assert out.shape == (sum(LENGTHS_Q), 4, 8) and lse.shape == (sum(LENGTHS_Q), 4)
    (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    # one forward, and two backward launches (out's gradient, then the lse's probe)
    assert calls == ["softmax_varlen_fwd", "softmax_varlen_bwd", "softmax_varlen_bwd"]
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v, sinks)]
    ref, ref_lse = _loop(*leaves[:3], cu_q, cu_k, True, dict(window=(5, 0), sinks=leaves[3]))
    (ref.square().sum() + torch.where(torch.isfinite(ref_lse), ref_lse, 0.0).sum()).backward()
    assert_close_to_reference(out, ref.detach())
    assert_close_to_reference(lse, ref_lse.detach())
    for nm, got, want in zip(("dq", "dk", "dv", "dsinks"), (q, k, v, sinks), leaves):
        assert_close_to_reference(got.grad, want.grad, grad=True, name=nm)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_dropout_in_one_launch(dtype):
    # Sequence b's keep mask is dropout_keep_mask(1, H, total_q, m_b, p, seed + b)'s rows of the
    # sequence: the forward and both backward kernels against the float64 loop with those masks,
    # with GQA, causality, a window and sinks on.
    h, hk, d, dv, p, seed = 4, 2, 7, 5, 0.3, 2**31 - 2  # (seed + b passes 2^31: int64 keys)
    q, k, v, go = _pack(LENGTHS_Q, LENGTHS_K, h, hk, d, dv, dtype, seed=9)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    sinks = torch.randn(h, device=DEVICE)
    args = (cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), None, True, CFG)
    kw = dict(window_left=6, window_right=1, dropout_p=p, seed=seed)
    out, lse = triton_softmax.softmax_varlen_fwd(q, k, v, *args, sinks=sinks, **kw)
    grads = triton_softmax.softmax_varlen_bwd(go, q, k, v, out, lse, *args, **kw)
    keep = triton_softmax.varlen_dropout_keep_masks(cu_q, cu_k, h, p, seed, DEVICE)
    assert [tuple(m.shape) for m in keep] == [(h, n, m) for n, m in zip(LENGTHS_Q, LENGTHS_K)]
    kept = torch.cat([m.flatten() for m in keep]).float().mean().item()
    assert abs(kept - (1 - p)) < 0.05, kept  # ~1100 draws
    # one key per sequence: sequences 0 and 3 draw different masks where their shapes overlap
    assert not torch.equal(keep[0][:, :4, :7], keep[3][:, :4, :7])
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v)]
    options = dict(window=(6, 1), sinks=sinks.to(F64))
    ref, ref_lse = _loop(*leaves, cu_q, cu_k, True, options, dropout=(p, keep))
    want = torch.autograd.grad(ref, leaves, go.to(F64))
    low, low_grads = (None, None), (None,) * 3
    if dtype in LOW_PRECISION:
        low_leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        low = _loop(*low_leaves, cu_q, cu_k, True, dict(window=(6, 1), sinks=sinks), dropout=(p, keep))
        low_grads = torch.autograd.grad(low[0], low_leaves, go)
    assert_close_to_reference(out, ref, low[0], name="out")
    assert_close_to_reference(lse.t(), ref_lse, low[1], name="lse", dtype=dtype)
    ds = 2 * d ** -0.5 * dv * go.abs().max().item() * v.abs().max().item() / (1 - p)
    terms = (ds * k.abs().max().item(), ds * q.abs().max().item() * max(LENGTHS_Q) * (h // hk), None)
    for nm, got, w, lo, term in zip(("dq", "dk", "dv"), grads, want, low_grads, terms):
        if term is None:
            assert_close_to_reference(got, w, lo, grad=True, name=nm)
        else:
            _assert_gradient_close(got, w, lo, term, nm)
    # without dropout the same seed changes nothing; another seed another mask
    other = triton_softmax.softmax_varlen_fwd(q, k, v, *args, sinks=sinks, **dict(kw, seed=seed - 1))[0]
    assert not torch.equal(other, out)


def test_the_public_function_runs_dropout_in_one_launch(monkeypatch):
    calls = _recorded_launches(monkeypatch)
    (q, k, v), cu_q, cu_k = _public_case()
    p = 0.4
    torch.manual_seed(17)
    out, lse = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, dropout_p=p, is_causal=True,
                                                enable_gqa=True, return_lse=True, backend="triton")
    (out.square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    # one forward; the backward's out gradient with the mask, the lse's probe without
    assert calls == ["softmax_varlen_fwd", "softmax_varlen_bwd", "softmax_varlen_bwd"]
    torch.manual_seed(17)
    seed = int(torch.randint(2**31 - 1, (), dtype=torch.int64))  # the draw softmax_attention makes
    keep = triton_softmax.varlen_dropout_keep_masks(cu_q, cu_k, 4, p, seed, DEVICE)
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v)]
    ref, ref_lse = _loop(*leaves, cu_q, cu_k, True, {}, dropout=(p, keep))
    (ref.square().sum() + torch.where(torch.isfinite(ref_lse), ref_lse, 0.0).sum()).backward()
    assert_close_to_reference(out, ref.detach())
    assert_close_to_reference(lse, ref_lse.detach())
    for nm, got, want in zip(("dq", "dk", "dv"), (q, k, v), leaves):
        assert_close_to_reference(got.grad, want.grad, grad=True, name=nm)
    # reproducible under torch.manual_seed, another draw another mask
    torch.manual_seed(17)
    again = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, dropout_p=p, is_causal=True,
                                             enable_gqa=True, backend="triton")
    assert torch.equal(again, out)
    assert not torch.equal(attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, dropout_p=p, is_causal=True,
                                                            enable_gqa=True, backend="triton"), out)


def test_double_backward_goes_through_the_grouped_reference():
    (q, k, v), cu_q, cu_k = _public_case()
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    out = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, is_causal=True, enable_gqa=True,
                                           backend="triton", sinks=sinks)
    dq, dsinks = torch.autograd.grad(out.square().sum(), (q, sinks), create_graph=True)
    (dq.square().sum() + dsinks.sum()).backward()
    # (float64 q, k, v; the sinks stay float32, as softmax_attention takes them)
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v)] + [sinks.detach().clone().requires_grad_()]
    ref = attnkit.softmax_attention_varlen(*leaves[:3], cu_q, cu_k, 33, 21, is_causal=True, enable_gqa=True,
                                           backend="reference", sinks=leaves[3])
    rdq, rdsinks = torch.autograd.grad(ref.square().sum(), (leaves[0], leaves[3]), create_graph=True)
    (rdq.square().sum() + rdsinks.sum()).backward()
    assert_close_to_reference(dq, rdq.detach(), grad=True, name="dq")
    for nm, got, want in zip(("q", "k", "v", "sinks"), (q, k, v, sinks), leaves):
        assert_close_to_reference(got.grad, want.grad.to(F64), grad=True, name=f"d/d{nm} of the first gradients",
                                  dtype=F32)


def test_no_gradient_wanted_and_empty_packs():
    (q, k, v), cu_q, cu_k = _public_case(requires_grad=False)
    out = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, enable_gqa=True, backend="triton")
    ref, _ = _loop(*(x.to(F64) for x in (q, k, v)), cu_q, cu_k, False, {})
    assert_close_to_reference(out, ref)
    # launchers: no sequence, no query row
    none = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out, lse = triton_softmax.softmax_varlen_fwd(q[:0], k[:0], v[:0], none, none, 0, 0, None, False)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    dq, dk, dv = triton_softmax.softmax_varlen_bwd(out, q[:0], k[:0], v[:0], out, lse, zeros, zeros, 0, 0, None,
                                                   True)
    assert dq.shape == (0, 4, 8) and dk.shape == (0, 2, 8)


def test_launcher_errors():
    (q, k, v), cu_q, cu_k = _public_case(requires_grad=False)
    call = triton_softmax.softmax_varlen_fwd
    with pytest.raises(ValueError, match="3-D"):
        call(q.unsqueeze(0), k, v, cu_q, cu_k, 33, 21, None, False)
    with pytest.raises(ValueError, match="int32 / int64"):
        call(q, k, v, cu_q.float(), cu_k, 33, 21, None, False)
    with pytest.raises(ValueError, match="one length"):
        call(q, k, v, cu_q, cu_k[:-1], 33, 21, None, False)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int"):
        call(q, k, v, cu_q, cu_k, 33, -1, None, False)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        call(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_q, cu_k, 33, 21, None, False)
    with pytest.raises(ValueError, match="alibi_slopes"):
        call(q, k, v, cu_q, cu_k, 33, 21, None, False, alibi_slopes=torch.ones(5, 4, device=DEVICE))


@pytest.mark.gpu
def test_cuda_graph_replays_the_launches():
    # No host read of the offsets: both launchers can be captured and replayed (issue 26).
    (q, k, v), cu_q, cu_k = _public_case(dtype=BF16, requires_grad=False)
    go = torch.randn_like(q)
    run = lambda: triton_softmax.softmax_varlen_bwd(  # noqa: E731
        go, q, k, v, *triton_softmax.softmax_varlen_fwd(q, k, v, cu_q, cu_k, 33, 21, None, True), cu_q, cu_k, 33, 21,
        None, True)
    eager = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_graph_replays_the_public_function():
    # Under capture softmax_attention_varlen reads no offset on the host: the one launch, sized by
    # max_seqlen_q / max_seqlen_k.  Forward and backward captured, replayed with new inputs.
    (q, k, v), cu_q, cu_k = _public_case(dtype=BF16)
    static = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    go = torch.randn(sum(LENGTHS_Q), 4, 8, device=DEVICE, dtype=BF16)

    def step():
        out = attnkit.softmax_attention_varlen(*static, cu_q, cu_k, 33, 21, is_causal=True, enable_gqa=True,
                                               backend="triton", window=(4, 0))
        return (out, *torch.autograd.grad(out, static, go))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture: compiles the kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for x in static:  # new values in the captured inputs
        x.data.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(eager, captured):
        assert torch.equal(a, b)
    # a call that would need the host: a clear error, not a capture failure
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        with pytest.raises(ValueError, match="under CUDA graph capture"):
            attnkit.softmax_attention_varlen(*static, cu_q, cu_k, 33, 21, dropout_p=0.1, enable_gqa=True,
                                             backend="triton")


def test_the_capture_path_without_a_gpu():
    # What softmax_attention_varlen runs under CUDA graph capture (no host read of the offsets),
    # called directly: the same result as the checked path; the grid from max_seqlen_*.
    from attnkit.ops import varlen

    (q, k, v), cu_q, cu_k = _public_case()
    sinks = torch.randn(4, device=DEVICE)
    opts = dict(window=(4, 0), sinks=sinks, alibi_slopes=torch.rand(len(LENGTHS_Q), 4, device=DEVICE))
    out, lse = varlen._captured(q, k, v, cu_q, cu_k, 40, 30, 0.0, True, None, "triton", opts)
    want, want_lse = attnkit.softmax_attention_varlen(q, k, v, cu_q, cu_k, 33, 21, is_causal=True, enable_gqa=True,
                                                      return_lse=True, backend="triton", **opts)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    for kwargs, error, match in (
        (dict(dropout_p=0.1), ValueError, "only the Triton one-launch path"),
        (dict(backend="reference"), ValueError, "got backend reference"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
        (dict(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an int"),
        (dict(cu_seqlens_k=cu_k[:-1]), ValueError, "the same length"),
        (dict(cu_seqlens_q=cu_q.float()), TypeError, "int32 or int64"),
    ):
        call = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=33, max_seqlen_k=21,
                    dropout_p=0.0, is_causal=True, scale=None, backend="triton", score_options={})
        call.update(kwargs)
        with pytest.raises(error, match=match):
            varlen._captured(**call)

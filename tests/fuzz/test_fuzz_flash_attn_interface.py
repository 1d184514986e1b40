"""Differential fuzzing of attnkit.flash_attn_interface against tests/attnkit_testing.fa_reference,
FlashAttention's semantics written out in float64 (bottom-right causality and windows, softcap,
ALiBi, GQA, its [B, N, H, D] layout; for the KV cache: the append in place, cache_batch_idx,
cache_leftpad, a paged cache, rotary positions).  Every draw of N against M (either larger, 0
included), window sides, head dims and options must give the reference's result -- the mapping
onto attnkit's top-left is_causal and score options is what is under test.

Tolerances: fuzzing.py's (DESIGN.md's rule).  Gradients (float32 / float64) are held to the size
of the terms they sum (scale |dO| |V| |K| for dq: a single visible key's dq is exactly 0).
"""
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (requirements.txt)")
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit import flash_attn_interface as fai
from attnkit.reference.softmax import softmax_attention_reference
from attnkit.rotary import rotate
from attnkit_testing import F64, LOW_PRECISION, fa_reference, rotary_reference
from fuzzing import BACKENDS, dtypes_for, fuzz_settings, require_backend, tolerance, value_size

COLUMNS = [p for p in BACKENDS if p.values[0] in ("reference", "cpu", "triton")]
KV_COLUMNS = [p for p in BACKENDS if p.values[0] in ("cpu", "triton")]
SIDES = [-1, -1, 0, 1, 3, 7]


def _naive(q, k, v, *, causal, window, softcap, alibi, scale, sinks=None):
    """The naive implementation's run in the inputs' dtype, DESIGN.md's yardstick for 16 bits:
    attnkit's reference (as every fuzz test takes it; its lse is computed in the dtype too), the
    FlashAttention options written in its terms here -- causality bottom-right as the window's
    right bound 0.  (fa_reference in bfloat16 computes its lse in float32 and rounds once: a
    yardstick up to one bfloat16 ulp tighter than the reference column's own lse, by chance per
    row -- session 33's random fuzzing, N = 1, M = 4: 0.0077 against 2 x 0.0008 + 1e-3.)"""
    left, right = window
    right = 0 if causal else right
    out, lse = softmax_attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                           enable_gqa=True, return_lse=True, window=(left, right),
                                           softcap=softcap, alibi_slopes=alibi, sinks=sinks)
    return out.transpose(1, 2), lse


def _assert_close(name, got, want64, tol):
    got64 = got.detach().cpu().to(F64)
    assert torch.equal(torch.isfinite(got64), torch.isfinite(want64)), f"{name}: non-finite entries differ"
    finite = torch.isfinite(want64)
    assert torch.equal(got64[~finite], want64[~finite]), f"{name}: infinities differ"
    err = (got64[finite] - want64[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


@st.composite
def dense_case(draw, backend, device):
    dtype = draw(st.sampled_from(dtypes_for(backend, device)))
    kv_heads, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    n, m = draw(st.integers(0, 20)), draw(st.integers(0, 20))
    d, dv = draw(st.sampled_from([1, 5, 8, 16])), draw(st.sampled_from([1, 8, 16]))
    causal = draw(st.booleans())
    window = (draw(st.sampled_from(SIDES)), draw(st.sampled_from(SIDES)))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.5, 3.0]))
    alibi = draw(st.sampled_from([None, None, "[H]", "[B, H]"]))
    scale = draw(st.sampled_from([None, 0.3, 2.0]))
    batch = draw(st.integers(1, 2))
    sinks = draw(st.sampled_from([False, False, True]))
    return (dtype, batch, kv_heads, group, n, m, d, dv, causal, window, softcap, alibi, scale, sinks,
            draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend,device", COLUMNS)
@fuzz_settings(ci_examples=20)
@given(data=st.data())
def test_flash_attn_func_matches_flash_attention_semantics(backend, device, data):
    require_backend("softmax", backend, device)
    dtype, batch, hk, group, n, m, d, dv, causal, window, softcap, alibi, scale, with_sinks, seed = data.draw(
        dense_case(backend, device))
    gen = torch.Generator().manual_seed(seed)
    heads = hk * group
    q = torch.randn(batch, n, heads, d, generator=gen).to(dtype)
    k = torch.randn(batch, m, hk, d, generator=gen).to(dtype)
    v = torch.randn(batch, m, hk, dv, generator=gen).to(dtype)
    g = torch.randn(batch, n, heads, dv, generator=gen).to(dtype)
    slopes = None if alibi is None else torch.rand(*((heads,) if alibi == "[H]" else (batch, heads)), generator=gen)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None  # (float32, as attnkit takes them)
    grads = dtype in (torch.float32, F64)
    leaves = [x.to(device).requires_grad_(grads) for x in (q, k, v)]
    out, lse, probs = fai.flash_attn_func(*leaves, softmax_scale=scale, causal=causal, window_size=window,
                                          softcap=softcap, alibi_slopes=None if slopes is None else slopes.to(device),
                                          return_attn_probs=True, s_aux=None if sinks is None else sinks.to(device),
                                          backend=backend)
    assert probs is None and out.shape == (batch, n, heads, dv) and out.is_contiguous() and lse.shape == (batch, heads, n)
    options = dict(causal=causal, window=window, softcap=softcap, alibi=slopes, scale=scale, sinks=sinks)
    ref64 = [x.to(F64).requires_grad_(grads) for x in (q, k, v)]
    want, want_lse = fa_reference(*ref64, **options)
    naive = _naive(q, k, v, **options) if dtype in LOW_PRECISION else (None, None)
    _assert_close("out", out, want.detach(), tolerance(dtype, want.detach(), naive=naive[0], size=value_size(v)))
    _assert_close("lse", lse, want_lse.detach(), tolerance(dtype if dtype == F64 else torch.float32, want_lse.detach())
                  if dtype not in LOW_PRECISION else tolerance(dtype, want_lse.detach(), naive=naive[1]))
    if not grads or n == 0 or m == 0:
        return
    got = torch.autograd.grad(out, leaves, g.to(device))
    ref = torch.autograd.grad(want, ref64, g.to(F64))
    s = d ** -0.5 if scale is None else scale
    gv = (g.abs().max() * v.abs().max()).item()
    sizes = {"dq": s * gv * k.abs().max().item(), "dk": s * gv * q.abs().max().item(), "dv": g.abs().max().item()}
    for (name, size), a, b in zip(sizes.items(), got, ref):
        _assert_close(name, a, b, tolerance(dtype, b, grad=True, size=size))


@st.composite
def kv_case(draw, backend, device):
    dtype = draw(st.sampled_from([t for t in dtypes_for(backend, device) if t != F64]))
    batch = draw(st.integers(1, 3))
    kv_heads, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
    nq = draw(st.sampled_from([1, 1, 2, 5, 17]))
    nk = draw(st.integers(0, min(nq, 4)))
    lengths = draw(st.lists(st.integers(0, 24), min_size=batch, max_size=batch))
    layout = draw(st.sampled_from(["plain", "batch_idx", "leftpad", "batch_idx+leftpad", "paged"]))
    pads = [draw(st.integers(0, n)) if "leftpad" in layout else 0 for n in lengths]
    rotary = nk > 0 and draw(st.booleans())
    interleaved = draw(st.booleans())
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (4, 0), (2, 3), (-1, 1)]))
    softcap = draw(st.sampled_from([0.0, 0.0, 2.0]))
    alibi = draw(st.sampled_from([None, None, "[H]", "[B, H]"]))
    return (dtype, batch, kv_heads, group, nq, nk, lengths, layout, pads, rotary, interleaved, causal, window, softcap,
            alibi, draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend,device", KV_COLUMNS)
@fuzz_settings(ci_examples=20)
@given(data=st.data())
def test_flash_attn_with_kvcache_matches_flash_attention_semantics(backend, device, data):
    require_backend("softmax", backend, device)
    (dtype, batch, hk, group, nq, nk, lengths, layout, pads, rotary, interleaved, causal, window, softcap, alibi,
     seed) = data.draw(kv_case(backend, device))
    gen = torch.Generator().manual_seed(seed)
    heads, d, dv, max_len = hk * group, 16, 8, 24 + 4
    rows = batch + 2 if "batch_idx" in layout else batch
    cache_rows = torch.randperm(rows, generator=gen)[:batch].tolist() if "batch_idx" in layout else list(range(batch))
    q = torch.randn(batch, nq, heads, d, generator=gen).to(dtype)
    k = torch.randn(batch, nk, hk, d, generator=gen).to(dtype) if nk else None
    v = torch.randn(batch, nk, hk, dv, generator=gen).to(dtype) if nk else None
    k_cache = torch.randn(rows, max_len, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(rows, max_len, hk, dv, generator=gen).to(dtype)
    cos, sin = torch.randn(max_len + nq, 4, generator=gen), torch.randn(max_len + nq, 4, generator=gen)
    slopes = None if alibi is None else torch.rand(*((heads,) if alibi == "[H]" else (batch, heads)), generator=gen)
    # The cache as it must be after the call, and the key range of each batch element.
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_ref = q
    if nk:
        k_new = k
        if rotary:
            # Rotated as attnkit.rotary rotates (float32, rounded once), at the positions of
            # FlashAttention's rule; those values within rounding of the pair-by-pair definition.
            local = causal or window != (-1, -1)
            k_pos = [[n + t for t in range(nk)] for n in lengths]
            q_pos = [[n + t if local else n for t in range(nq)] for n in lengths]
            k_new = rotate(k, cos, sin, torch.tensor(k_pos), interleaved)
            q_ref = rotate(q, cos, sin, torch.tensor(q_pos), interleaved)
            for x, want in ((k_new, rotary_reference(k.double(), cos, sin, k_pos, interleaved)),
                            (q_ref, rotary_reference(q.double(), cos, sin, q_pos, interleaved))):
                scale = want.abs().max().item() if want.numel() else 0.0
                assert (x.double() - want).abs().max().item() <= 4 * torch.finfo(dtype).eps * scale * 4
        for b, (r, n) in enumerate(zip(cache_rows, lengths)):
            want_k[r, n:n + nk] = k_new[b]
            want_v[r, n:n + nk] = v[b]
    call = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=causal, window_size=window,
                softcap=softcap, alibi_slopes=slopes, rotary_interleaved=interleaved, return_softmax_lse=True,
                backend=backend)
    if rotary:
        call.update(rotary_cos=cos, rotary_sin=sin)
    if "batch_idx" in layout:
        call["cache_batch_idx"] = torch.tensor(cache_rows, dtype=torch.int32)
    if "leftpad" in layout:
        call["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    if layout == "paged":  # blocks of 4 positions, shuffled, with two spare ones
        blocks = max_len // 4
        order = torch.randperm(batch * blocks + 2, generator=gen)
        table = order[:batch * blocks].view(batch, blocks).to(torch.int32)
        kc = torch.randn(batch * blocks + 2, 4, hk, d, generator=gen).to(dtype)
        vc = torch.randn(batch * blocks + 2, 4, hk, dv, generator=gen).to(dtype)
        for b in range(batch):
            for i in range(blocks):
                kc[table[b, i]] = k_cache[b, 4 * i:4 * i + 4]
                vc[table[b, i]] = v_cache[b, 4 * i:4 * i + 4]
        call["block_table"] = table.to(device)
    on = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in call.items()}
    kc, vc = kc.to(device), vc.to(device)
    out, lse = fai.flash_attn_with_kvcache(q.to(device), kc, vc, None if k is None else k.to(device),
                                           None if v is None else v.to(device), **on)
    if layout == "paged":
        got_k = torch.stack([torch.cat([kc.cpu()[table[b, i]] for i in range(max_len // 4)]) for b in range(batch)])
        got_v = torch.stack([torch.cat([vc.cpu()[table[b, i]] for i in range(max_len // 4)]) for b in range(batch)])
    else:
        got_k, got_v = kc.cpu(), vc.cpu()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    for b, (r, pad, n) in enumerate(zip(cache_rows, pads, lengths)):
        keys = (want_k[r:r + 1, pad:n + nk], want_v[r:r + 1, pad:n + nk])
        options = dict(causal=causal, window=window, softcap=softcap,
                       alibi=None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b:b + 1]))
        want, want_lse = fa_reference(q_ref[b:b + 1].to(F64), keys[0].to(F64), keys[1].to(F64), **options)
        naive = _naive(q_ref[b:b + 1], *keys, scale=None, **options) if dtype in LOW_PRECISION else (None, None)
        _assert_close(f"out[{b}]", out[b:b + 1], want, tolerance(dtype, want, naive=naive[0], size=value_size(keys[1])))
        lse_rule = tolerance(dtype, want_lse, naive=naive[1]) if dtype in LOW_PRECISION else \
            tolerance(torch.float32, want_lse)
        _assert_close(f"lse[{b}]", lse[b:b + 1], want_lse, lse_rule)

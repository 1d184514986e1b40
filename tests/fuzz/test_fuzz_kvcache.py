"""Differential fuzzing of attnkit.attention_with_kvcache with a paged cache (issue 28): the
decoding kernels read the blocks in place (cpu: attnkit::softmax_decode_paged; triton:
softmax_decode_fwd's block_table), so every draw of block size, shuffled table, lengths (0 and
1 included), GQA group, query count (up to 19: past the decoding kernel's 16 rows the blocks are
gathered), appended rows, causality and score options (window, softcap, sinks, ALiBi [H] / [B, H]) must
give what the float64 reference gives on the same cache laid out contiguously -- and, on triton
with at most 16 queries, the contiguous call's bits (the decode kernel's key tiles are the same,
score options included; only the rows' addresses differ).

The pool's spare blocks and every position past a sequence's length hold NaN: never read.
Values are finite N(0, 1) draws; the tolerance is fuzzing.py's (DESIGN.md's rule).
"""
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (requirements.txt)")
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit_testing import F64, LOW_PRECISION
from fuzzing import BACKENDS, dtypes_for, fuzz_settings, interpreted, require_backend, tolerance, value_size

# The cuda backend has no KV-cache decode of its own (its calls take softmax_attention's route).
KV_BACKENDS = [p for p in BACKENDS if p.values[0] in ("cpu", "triton")]


def _pages(cache, block_size, table, spare):
    """cache [B, Hk, max_len, *] cut into blocks placed where `table` says, in a NaN pool."""
    b, hk, max_len, dim = cache.shape
    pool = torch.full((table.numel() + spare, hk, block_size, dim), float("nan"), dtype=cache.dtype)
    for i in range(b):
        for j in range(table.shape[1]):
            rows = cache[i, :, j * block_size:(j + 1) * block_size]
            pool[table[i, j], :, :rows.shape[1]] = rows
    return pool


@st.composite
def kv_case(draw, backend, device):
    dtype = draw(st.sampled_from([d for d in dtypes_for(backend, device) if d != F64]))
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    nq = draw(st.sampled_from([1, 1, 2, 5, 16, 19]))
    nk = draw(st.integers(0, nq))
    block_size = draw(st.sampled_from([1, 3, 8, 16, 64]))
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    is_causal = draw(st.booleans())
    options = {}
    if draw(st.booleans()):
        options["window"] = (draw(st.sampled_from([-1, 0, 3, 9])), draw(st.sampled_from([-1, 0, 2])))
    if draw(st.booleans()):
        options["softcap"] = draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):
        options["sinks"] = "draw"
    if draw(st.booleans()):
        options["alibi_slopes"] = draw(st.sampled_from(["[H]", "[B, H]"]))
    seed = draw(st.integers(0, 2**16))
    return dtype, kv_heads, group, nq, nk, block_size, lengths, is_causal, options, seed


@pytest.mark.parametrize("backend,device", KV_BACKENDS)
@fuzz_settings(ci_examples=25)
@given(data=st.data())
def test_paged_cache_matches_the_contiguous_cache_and_the_reference(backend, device, data):
    require_backend("softmax", backend, device)
    dtype, hk, group, nq, nk, block_size, lengths, is_causal, options, seed = data.draw(kv_case(backend, device))
    gen = torch.Generator().manual_seed(seed)
    b, heads, d, dv = len(lengths), hk * group, 16, 8
    capacity = max(lengths) + nk
    blocks = max(1, -(-capacity // block_size))
    max_len = blocks * block_size
    q = torch.randn(b, heads, nq, d, generator=gen).to(dtype)
    k = torch.randn(b, hk, nk, d, generator=gen).to(dtype) if nk else None
    v = torch.randn(b, hk, nk, dv, generator=gen).to(dtype) if nk else None
    k_cache = torch.randn(b, hk, max_len, d, generator=gen).to(dtype)
    v_cache = torch.randn(b, hk, max_len, dv, generator=gen).to(dtype)
    for i, n in enumerate(lengths):  # past each length: NaN (a cache from torch.empty)
        k_cache[i, :, n:] = float("nan")
        v_cache[i, :, n:] = float("nan")
    spare = 2
    table = torch.randperm(b * blocks + spare, generator=gen)[:b * blocks].view(b, blocks).to(torch.int32)
    k_pages, v_pages = _pages(k_cache, block_size, table, spare), _pages(v_cache, block_size, table, spare)
    call = dict(options)
    if "sinks" in call:
        call["sinks"] = torch.randn(heads, generator=gen)
    if "alibi_slopes" in call:
        call["alibi_slopes"] = torch.rand(*((heads,) if call["alibi_slopes"] == "[H]" else (b, heads)), generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)

    def run(kc, vc, tbl, on_backend, cast=None):
        args = [x if x is None or cast is None else x.to(cast) for x in (q, kc, vc, k, v)]
        moved = [x if x is None else x.to(device) for x in args]
        on_device = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in call.items()}
        return attnkit.attention_with_kvcache(*moved, cache_seqlens=seqlens, block_table=None if tbl is None else
                                             tbl.to(device), is_causal=is_causal, enable_gqa=True, return_lse=True,
                                             backend=on_backend, **on_device)

    out_p, lse_p = run(k_pages.clone(), v_pages.clone(), table, backend)
    out_c, lse_c = run(k_cache.clone(), v_cache.clone(), None, backend)
    ref, ref_lse = run(k_cache.clone(), v_cache.clone(), None, "reference", cast=F64)
    naive = run(k_cache.clone(), v_cache.clone(), None, "reference") if dtype in LOW_PRECISION else (None, None)
    if interpreted(backend, device) or device == "cuda":
        if nq <= 16:  # the Triton decode kernel's route: the same tiles
            assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    for got, want, low, name in ((out_p, ref, naive[0], "out"), (lse_p, ref_lse, naive[1], "lse")):
        got64, want64 = got.cpu().to(F64), want.cpu()
        assert torch.equal(torch.isfinite(got64), torch.isfinite(want64)), name
        finite = torch.isfinite(want64)
        # (out: the values' size, the terms it sums -- the visible cache rows and the new ones)
        tol = tolerance(dtype, want64, naive=low, size=value_size(*(
            [v_cache[i, :, :n] for i, n in enumerate(lengths)] + [v])) if name == "out" else None)
        err = (got64[finite] - want64[finite]).abs().max().item() if finite.any() else 0.0
        assert err <= tol, f"{name}: {err:.3g} > {tol:.3g}"

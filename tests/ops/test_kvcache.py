"""attnkit.attention_with_kvcache (issue 28): the in-place append, then attention of the new
queries to each batch element's visible keys, causal bottom-right -- against float64 references
built per batch element from the definition (a bool mask over that element's visible keys), and
a paged cache under a shuffled block table against the contiguous one."""
import inspect

import pytest
import torch

import attnkit
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, LOW_PRECISION, assert_close_to_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCORE_OPTIONS = {"window", "softcap", "alibi_slopes", "sinks"}
HAS_SCORE_OPTIONS = SCORE_OPTIONS <= set(inspect.signature(attnkit.softmax_attention).parameters)
NO_SCORE_OPTIONS = ("attnkit.softmax_attention has no score options (window, softcap, alibi_slopes, sinks) "
                    "in this checkout yet: nothing to pass through")

B, H, HK, D, DV, MAX_LEN = 4, 4, 2, 7, 5, 40
SEQLENS = [3, 0, 21, 3]  # a run of equal lengths is not what b = 0 and 3 are (they are apart)


def _randn(shape, seed, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _inputs(dtype, nq, nk, seed=0, seqlens=SEQLENS):
    b = len(seqlens)
    q = _randn((b, H, nq, D), seed, dtype)
    k = _randn((b, HK, nk, D), seed + 1, dtype) if nk else None
    v = _randn((b, HK, nk, DV), seed + 2, dtype) if nk else None
    k_cache = _randn((b, HK, MAX_LEN, D), seed + 3, dtype)
    v_cache = _randn((b, HK, MAX_LEN, DV), seed + 4, dtype)
    return q, k, v, k_cache, v_cache, torch.tensor(seqlens, dtype=torch.int32)


def _appended(k_cache, v_cache, k, v, seqlens):
    """The caches as they must be after the call (a copy)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if k is not None:
        for b, n in enumerate(seqlens):
            k_cache[b, :, n:n + k.shape[2]] = k[b]
            v_cache[b, :, n:n + k.shape[2]] = v[b]
    return k_cache, v_cache


def _reference(q, k_cache, v_cache, seqlens, nk, is_causal, dtype=None, alibi=None, **options):
    """(out, lse) per batch element from the definition: query j sees keys < L - Nq + j + 1."""
    nq = q.shape[2]
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        length = n + nk
        qb, kb, vb = q[b:b + 1], k_cache[b:b + 1, :, :length], v_cache[b:b + 1, :, :length]
        if dtype is not None:
            qb, kb, vb = qb.to(dtype), kb.to(dtype), vb.to(dtype)
        mask = None
        if is_causal:
            mask = torch.arange(length)[None, :] < (length - nq + torch.arange(nq)[:, None] + 1)
        extra = dict(options)
        if alibi is not None:
            extra["alibi_slopes"] = alibi[b:b + 1] if alibi.dim() == 2 else alibi
        out, lse = softmax_attention_reference(qb, kb, vb, mask, enable_gqa=True, return_lse=True, **extra)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(out, lse, q, k_cache, v_cache, seqlens, nk, is_causal, dtype, **options):
    ref, ref_lse = _reference(q.to(F64), k_cache.to(F64), v_cache.to(F64), seqlens, nk, is_causal,
                              **{name: x.to(F64) if isinstance(x, torch.Tensor) else x for name, x in options.items()})
    low = (None, None)
    if dtype in LOW_PRECISION:
        low = _reference(q, k_cache, v_cache, seqlens, nk, is_causal, **options)
    assert_close_to_reference(out, ref, low[0], name="out")
    assert_close_to_reference(lse, ref_lse, low[1], name="lse", dtype=dtype)


# (Nq, Nk): decoding with and without an append, a chunk of a prefill (Nk = Nq), more queries
# than new keys, and more queries than the decode kernel's 16 rows.
SHAPES = [(1, 1), (1, 0), (5, 5), (6, 2), (19, 19)]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("dtype", [F64, F32, BF16, F16], ids=str)
def test_matches_the_reference_and_appends_in_place(dtype, nq, nk, is_causal, backend):
    q, k, v, k_cache, v_cache, seqlens = _inputs(dtype, nq, nk, seed=nq + 3 * nk)
    want_k, want_v = _appended(k_cache, v_cache, k, v, SEQLENS)
    out, lse = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                              is_causal=is_causal, enable_gqa=True, return_lse=True,
                                              backend=backend)
    # The append: the new rows where they belong, every other entry untouched (bitwise).
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert out.shape == (B, H, nq, DV) and out.dtype == dtype
    assert lse.shape == (B, H, nq) and lse.dtype == (F64 if dtype == F64 else F32)
    assert seqlens.tolist() == SEQLENS  # not advanced by the call
    _check(out, lse, q, k_cache, v_cache, SEQLENS, nk, is_causal, dtype)
    if is_causal and nk < nq:
        # b = 1 has L = nk < Nq keys: its first Nq - L queries see none.
        assert torch.isneginf(lse[1, :, :nq - nk]).all() and not out[1, :, :nq - nk].any()


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 5), (6, 2), (3, 0)])
def test_paged_cache_with_shuffled_blocks_equals_contiguous(nq, nk, is_causal):
    q, k, v, k_cache, v_cache, seqlens = _inputs(F32, nq, nk, seed=20 + nq)
    block_size = 8
    blocks = MAX_LEN // block_size
    # Every batch element's blocks, scattered over a pool with 3 spare blocks (NaN: never read).
    g = torch.Generator().manual_seed(nq + nk)
    table = torch.randperm(B * blocks + 3, generator=g)[:B * blocks].view(B, blocks).to(torch.int32)
    k_pages = torch.full((B * blocks + 3, HK, block_size, D), float("nan"))
    v_pages = torch.full((B * blocks + 3, HK, block_size, DV), float("nan"))
    for b in range(B):
        for i in range(blocks):
            k_pages[table[b, i]] = k_cache[b, :, i * block_size:(i + 1) * block_size]
            v_pages[table[b, i]] = v_cache[b, :, i * block_size:(i + 1) * block_size]
    spare = sorted(set(range(B * blocks + 3)) - set(table.flatten().tolist()))
    out_p, lse_p = attnkit.attention_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens,
                                                  block_table=table, is_causal=is_causal, enable_gqa=True,
                                                  return_lse=True)
    out_c, lse_c = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                  is_causal=is_causal, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out_p, out_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_p, lse_c, rtol=1e-6, atol=1e-6)
    # The pages hold exactly the contiguous cache after the append; the spare blocks untouched.
    for b in range(B):
        for i in range(blocks):
            assert torch.equal(k_pages[table[b, i]], k_cache[b, :, i * block_size:(i + 1) * block_size])
            assert torch.equal(v_pages[table[b, i]], v_cache[b, :, i * block_size:(i + 1) * block_size])
    assert torch.isnan(k_pages[spare]).all() and torch.isnan(v_pages[spare]).all()


@pytest.mark.parametrize("nq,nk", [(1, 1), (6, 2)])
def test_positions_past_the_visible_length_are_never_read(nq, nk):
    # A cache from torch.empty may hold NaN past each batch element's length: no effect.
    q, k, v, k_cache, v_cache, seqlens = _inputs(F32, nq, nk, seed=70)
    clean = [x.clone() for x in (k_cache, v_cache)]
    for cache in (k_cache, v_cache):
        for b, n in enumerate(SEQLENS):
            cache[b, :, n:] = float("nan")
    out = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, enable_gqa=True)
    want = attnkit.attention_with_kvcache(q, *clean, k, v, cache_seqlens=seqlens, enable_gqa=True)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_paged_cache_reads_only_the_blocks_it_needs():
    # Unused table entries hold garbage (-1); block 0 is a shared prefix both batch elements read.
    q, k, v, _, _, _ = _inputs(F32, 1, 1, seqlens=[5, 4])
    pages_k, pages_v = _randn((3, HK, 4, D), 1, F32), _randn((3, HK, 4, DV), 2, F32)
    table = torch.tensor([[0, 1, -1, -1], [0, 2, -1, -1]], dtype=torch.int32)
    out = attnkit.attention_with_kvcache(q, pages_k, pages_v, k, v, cache_seqlens=torch.tensor([5, 4]),
                                         block_table=table, enable_gqa=True)
    assert torch.equal(pages_k[1][:, 1], k[0, :, 0]) and torch.equal(pages_v[2][:, 0], v[1, :, 0])
    for b, (blocks, length) in enumerate((((0, 1), 6), ((0, 2), 5))):
        flat_k = torch.cat([pages_k[i] for i in blocks], dim=1)[None, :, :length].double()
        flat_v = torch.cat([pages_v[i] for i in blocks], dim=1)[None, :, :length].double()
        ref, _ = _reference(q[b:b + 1].double(), flat_k, flat_v, [length], 0, True)
        assert_close_to_reference(out[b:b + 1], ref)


def test_int_cache_seqlens_and_decoding_equals_one_causal_call():
    # A prefill of 11 tokens in chunks of 6 and 5, then 4 decoding steps, equals
    # softmax_attention(is_causal=True) over the whole 15 tokens.
    n = 15
    q, k, v = (_randn((2, H if i == 0 else HK, n, D if i < 2 else DV), 40 + i, F32) for i in range(3))
    k_cache, v_cache = torch.zeros(2, HK, 16, D), torch.zeros(2, HK, 16, DV)
    pieces, start = [], 0
    for size in (6, 5, 1, 1, 1, 1):
        part = slice(start, start + size)
        pieces.append(attnkit.attention_with_kvcache(q[:, :, part], k_cache, v_cache, k[:, :, part], v[:, :, part],
                                                     cache_seqlens=start, enable_gqa=True))
        start += size
    whole = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole, rtol=1e-5, atol=1e-6)


def test_no_gradient():
    q, k, v, k_cache, v_cache, seqlens = _inputs(F32, 1, 1)
    q.requires_grad_(), k.requires_grad_()
    out = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, enable_gqa=True)
    assert not out.requires_grad and not k_cache.requires_grad


@pytest.mark.skipif(not HAS_SCORE_OPTIONS, reason=NO_SCORE_OPTIONS)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 5), (6, 2)])
@pytest.mark.parametrize("which", ["window-alibi", "softcap-sinks"])
def test_score_options_pass_through(which, nq, nk, backend):
    q, k, v, k_cache, v_cache, seqlens = _inputs(F32, nq, nk, seed=60 + nq)
    g = torch.Generator().manual_seed(5)
    if which == "window-alibi":  # positions relative to the last key: the causal bound folds into the window
        options = dict(window=(4, 2), alibi=torch.rand(B, H, generator=g))
    else:  # split into prefix and causal part: the sink counted once
        options = dict(softcap=1.5, sinks=torch.randn(H, generator=g))
    call = {("alibi_slopes" if name == "alibi" else name): x for name, x in options.items()}
    out, lse = attnkit.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, enable_gqa=True,
                                              return_lse=True, backend=backend, **call)
    _check(out, lse, q, k_cache, v_cache, SEQLENS, nk, True, F32, **options)


def _bad_calls():
    q, k, v, k_cache, v_cache, seqlens = _inputs(F32, 2, 2)
    base = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens, enable_gqa=True)
    table = torch.arange(B * 5, dtype=torch.int32).view(B, 5)
    cases = [
        (dict(q=q[0]), ValueError, "q must be a 4-D tensor"),
        (dict(v=None), ValueError, "both k and v"),
        (dict(k=k.double()), ValueError, "dtype"),
        (dict(k=k[:, :, :1]), ValueError, r"k and v must be \[B, Hk, Nk, D\]"),
        (dict(k_cache=k_cache[:2], v_cache=v_cache[:2]), ValueError, "batch size"),
        (dict(v_cache=v_cache[:, :, :10]), ValueError, "v_cache must match k_cache"),
        (dict(k_cache=k_cache[..., :3], k=k[..., :3]), ValueError, "head dim"),
        (dict(enable_gqa=False), ValueError, "enable_gqa=True"),
        (dict(cache_seqlens=seqlens.float()), TypeError, "int32 or int64"),
        (dict(cache_seqlens=seqlens[:2]), ValueError, r"shape \[B\]"),
        (dict(cache_seqlens=seqlens - 5), ValueError, ">= 0"),
        (dict(cache_seqlens=True), TypeError, "cache_seqlens"),
        (dict(cache_seqlens=torch.tensor([0, 0, MAX_LEN - 1, 0], dtype=torch.int32)), ValueError,
         "batch element 2 does not fit"),
        (dict(cache_seqlens=MAX_LEN - 1), ValueError, "does not fit"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(not_an_option=1), TypeError, "unexpected keyword argument 'not_an_option'"),
        (dict(block_table=table.float(), k_cache=k_cache.view(-1, HK, 8, D), v_cache=v_cache.view(-1, HK, 8, DV)),
         TypeError, "block_table must be int32"),
        (dict(block_table=table[:2], k_cache=k_cache.view(-1, HK, 8, D), v_cache=v_cache.view(-1, HK, 8, DV)),
         ValueError, r"\[B, max_blocks\]"),
        (dict(block_table=table + 5, k_cache=k_cache.view(-1, HK, 8, D), v_cache=v_cache.view(-1, HK, 8, DV)),
         ValueError, "is not a block of the cache"),
        (dict(block_table=torch.zeros(B, 5, dtype=torch.int32), k_cache=k_cache.view(-1, HK, 8, D),
              v_cache=v_cache.view(-1, HK, 8, DV), cache_seqlens=3), ValueError, "both write block 0 offset 3"),
    ]
    if HAS_SCORE_OPTIONS:
        cases.append((dict(alibi_slopes=torch.rand(3, H)), ValueError, r"\[batch, H\] with batch = 4"))
    return [({**base, **change}, error, match) for change, error, match in cases]


@pytest.mark.parametrize("kwargs,error,match", _bad_calls())
def test_bad_arguments_raise_before_the_cache_is_written(kwargs, error, match):
    before = [kwargs[name].clone() for name in ("k_cache", "v_cache")]
    with pytest.raises(error, match=match):
        attnkit.attention_with_kvcache(**kwargs)
    assert torch.equal(kwargs["k_cache"], before[0]) and torch.equal(kwargs["v_cache"], before[1])

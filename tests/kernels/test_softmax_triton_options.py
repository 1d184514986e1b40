"""Score options of the Triton softmax kernels (issue 28), at the launcher level:
``softmax_fwd`` / ``softmax_bwd`` with ``window_left`` / ``window_right``, ``softcap`` and
``alibi_slopes``.

Without a GPU these run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports attnkit), where a tile step costs milliseconds: shapes
stay small and each case names its tile configs.  With a GPU the same tests run on CUDA, plus
the ``gpu``-marked ones (bfloat16, which the interpreter cannot do; larger shapes; autotuning).

Ground truth: :func:`reference`, a float64 implementation of the semantics written here from the
issue (independent of attnkit.reference): s = scale * q.k; s = softcap * tanh(s / softcap);
s -= slope[b, h] * |i + M - N - j|; then the user mask, causal (j <= i, top-left) and the window
(i + M - N - left <= j <= i + M - N + right, bottom-right, -1 = unbounded side).  A row with no
visible key gives out 0, lse -inf and zero gradients.  Tolerance rule (DESIGN.md, through
attnkit_testing.assert_close_to_reference): float32 within 2e-5 of the largest reference
magnitude (gradients 1e-4); float16 / bfloat16 within 2x the error of the same reference run in
that dtype, plus 1e-3.
"""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from attnkit.kernels import softmax as triton_softmax  # noqa: E402
from attnkit.kernels._flash import tanh_and_grad, tanh_exp2  # noqa: E402
from attnkit_testing import TRITON_BF16_TEST, assert_close_to_reference  # noqa: E402

F16, F32, F64 = torch.float16, torch.float32, torch.float64
BF16 = torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "lse", "dq", "dk", "dv")


def cfg(bm, bn):
    """A tile config for the interpreter tests (warps / stages mean nothing there)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------
# inputs and the float64 reference
# ----------------------------------------------------------------------------------------------


def make_inputs(b, h, hk, n, m, d, dv, dtype, seed=0, qk_std=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g) * qk_std
    k = torch.randn(b, hk, m, d, generator=g)
    v = torch.randn(b, hk, m, dv, generator=g)
    go = torch.randn(b, h, n, dv, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, go)]


def make_slopes(b, h, kind, seed=2):
    """float32 ALiBi slopes: "bh" a [B, H] tensor, "h" a [H] tensor expanded to [B, H] (stride 0
    over B), "h1" the bare [H] tensor (the launcher expands it)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bh":
        return (torch.rand(b, h, generator=g) * 0.5).to(DEVICE)
    slopes = (2.0 ** (-torch.arange(1, h + 1, dtype=F32) * 8.0 / h) * 4.0).to(DEVICE)  # as ALiBi
    if kind == "h1":
        return slopes
    expanded = slopes.expand(b, h)
    assert b == 1 or expanded.stride(0) == 0
    return expanded


def make_mask(kind, b, h, n, m, seed=1):
    """None, "bool" (about 30% masked) or "add" (N(0, 1), about 20% -inf), [B, H, N, M]."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        return (torch.rand(b, h, n, m, generator=g) < 0.7).to(DEVICE)
    mask = torch.randn(b, h, n, m, generator=g)
    return mask.masked_fill(torch.rand(b, h, n, m, generator=g) < 0.2, float("-inf")).to(DEVICE)


def visible_keys(n, m, causal=False, window=(-1, -1), device="cpu"):
    """bool [N, M]: key j visible to query i under causal (top-left) and the window."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(m, device=device)[None, :]
    vis = torch.ones(n, m, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= i
    left, right = window
    if left >= 0:
        vis &= j >= i + m - n - left
    if right >= 0:
        vis &= j <= i + m - n + right
    return vis


def reference(q, k, v, go, *, mask=None, causal=False, scale=None, window=(-1, -1), softcap=0.0,
              alibi=None, dropout_p=0.0, keep=None, sinks=None, dtype=F64):
    """(out, lse, dq, dk, dv) in ``dtype`` with the semantics of the module docstring; gradients
    by autograd.  ``keep``: the kernel's dropout keep mask (bool [B, H, N, M]).  ``sinks``
    ([H]): one more column of scores, the head's sink, in each row's softmax, with no value."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    qq, kk, vv = leaves
    b, h, n, d = q.shape
    hk, m = k.shape[1], k.shape[2]
    kk, vv = kk.repeat_interleave(h // hk, 1), vv.repeat_interleave(h // hk, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (qq @ kk.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        i = torch.arange(n, device=s.device)[:, None]
        j = torch.arange(m, device=s.device)[None, :]
        dist = (i + m - n - j).abs().to(dtype)
        s = s - alibi.to(dtype).expand(b, h)[..., None, None] * dist
    vis = visible_keys(n, m, causal, window, s.device).expand(b, h, n, m)
    if mask is not None:
        if mask.dtype == torch.bool:
            vis = vis & mask
        else:
            s = s + mask.to(dtype)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        s_all = torch.cat([s, sinks.to(s.device, dtype).view(1, h, 1, 1).expand(b, h, n, 1)], -1)
        lse = torch.logsumexp(s_all, -1)
        p = torch.exp(s_all - lse[..., None])[..., :m]
        if keep is not None:
            p = p * keep / (1.0 - dropout_p)
        out = p @ vv
        out.backward(go.to(dtype))
        return (out.detach(), lse.detach(), *(t.grad for t in leaves))
    alive = (s > float("-inf")).any(-1, keepdim=True)
    s_safe = torch.where(alive, s, torch.zeros_like(s))  # dead rows: no NaN, forward or backward
    p = torch.softmax(s_safe, -1) * alive
    lse = torch.where(alive[..., 0], torch.logsumexp(s_safe, -1),
                      torch.full_like(alive[..., 0], float("-inf"), dtype=dtype))
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    out = p @ vv
    out.backward(go.to(dtype))
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def run_kernels(q, k, v, go, *, mask=None, causal=False, scale=None, dropout_p=0.0, seed=0,
                fwd_config=None, bwd_config=None, sinks=None, **options):
    # The sinks are the forward's: the backward takes its out and lse as they are.
    out, lse = triton_softmax.softmax_fwd(q, k, v, mask, scale, causal, dropout_p, seed,
                                          fwd_config, sinks=sinks, **options)
    grads = triton_softmax.softmax_bwd(go, q, k, v, out, lse, mask, scale, causal, dropout_p,
                                       seed, bwd_config, **options)
    return (out, lse, *grads)


def options_of(window=(-1, -1), softcap=0.0, alibi=None):
    return dict(window_left=window[0], window_right=window[1], softcap=softcap,
                alibi_slopes=alibi)


def check(got, q, k, v, go, **kw):
    """Each of (out, lse, dq, dk, dv) against the float64 reference (DESIGN.md's rule)."""
    dtype = q.dtype
    ref = reference(q, k, v, go, **kw)
    lowp = None if dtype == F32 else reference(q, k, v, go, dtype=dtype, **kw)
    for i, name in enumerate(NAMES):
        assert got[i].dtype == (F32 if name == "lse" else dtype), name
        if name in ("dq", "dk") and torch.all(ref[i] == 0):
            # Every row sees at most one key (a (0, 0) window): the softmax is 1 or empty, so
            # dq = dk = 0 exactly, and the kernels get them as p * (dP - delta), a difference of
            # two float32 sums of the same terms: rounding-sized against those terms (as in
            # test_softmax_triton.test_single_key).
            d, dv = q.shape[-1], v.shape[-1]
            terms = (go.abs().amax() * v.abs().amax() * dv) * max(q.abs().amax(),
                                                                  k.abs().amax()) * d
            assert got[i].abs().max() <= 1e-5 * terms / math.sqrt(d), name
            continue
        assert_close_to_reference(got[i], ref[i], None if lowp is None else lowp[i],
                                  dtype=dtype, grad=i >= 2, name=name)
    return ref


# ----------------------------------------------------------------------------------------------
# each option alone and combined, against the float64 reference
# ----------------------------------------------------------------------------------------------

# name: (B, H, Hk, N, M, D, Dv, dtype, causal, mask, window, softcap, alibi, scale,
#        fwd tile, (dK/dV tile, dQ tile))
CASES = {
    # window alone: both sides, N != M both ways, odd head dims, GQA
    "win_5_9_n63_m129_d17_gqa2": (1, 2, 1, 63, 129, 17, 15, F32, False, None, (5, 9), 0.0,
                                  None, None, cfg(32, 32), (cfg(16, 32), cfg(32, 16))),
    "win_left_only_n129_m63": (1, 1, 1, 129, 63, 16, 16, F32, False, None, (10, -1), 0.0, None,
                               None, cfg(32, 16), (cfg(16, 32), cfg(32, 16))),
    "win_right_only_n7_m129": (1, 2, 2, 7, 129, 33, 33, F32, False, None, (-1, 4), 0.0, None,
                               None, cfg(16, 32), (cfg(16, 32), cfg(16, 32))),
    "win_0_0_n7_m7": (1, 2, 1, 7, 7, 16, 16, F32, False, None, (0, 0), 0.0, None, None,
                      cfg(16, 16), (cfg(16, 16), cfg(16, 16))),
    "win_0_0_n63_m129_causal": (1, 1, 1, 63, 129, 16, 16, F32, True, None, (0, 0), 0.0, None,
                                None, cfg(16, 32), (cfg(32, 16), cfg(16, 32))),
    "win_larger_than_n_m": (1, 2, 1, 63, 7, 16, 24, F32, False, None, (200, 300), 0.0, None,
                            None, cfg(32, 16), (cfg(16, 32), cfg(32, 16))),
    "win_n1_m129": (1, 2, 1, 1, 129, 16, 16, F32, False, None, (10, -1), 0.0, None, None,
                    cfg(16, 64), (cfg(16, 64), cfg(16, 64))),
    # rows that see no key at all (N > M, bottom-right window): out 0, lse -inf, zero grads
    "win_rows_outside_n129_m7": (1, 2, 1, 129, 7, 16, 16, F32, False, None, (2, 1), 0.0, None,
                                 None, cfg(32, 16), (cfg(16, 32), cfg(32, 16))),
    # sliding window + causal (top-left) with a bool mask, GQA
    "win_20_causal_bool_gqa2": (1, 2, 1, 129, 129, 16, 16, F32, True, "bool", (20, -1), 0.0,
                                None, None, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    # softcap alone: scale 1 makes |s| ~ sqrt(D), well into tanh's saturation and its linear part
    "softcap_n63_m129_d33": (1, 2, 1, 63, 129, 33, 20, F32, False, None, (-1, -1), 5.0, None,
                             1.0, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    "softcap_causal_add": (1, 2, 2, 129, 63, 16, 16, F32, True, "add", (-1, -1), 2.0, None,
                           1.0, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    # ALiBi alone: [B, H], [H] expanded (stride 0) and bare [H] slopes
    "alibi_bh_n33_m65": (2, 2, 1, 33, 65, 16, 16, F32, False, None, (-1, -1), 0.0, "bh",
                         None, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    "alibi_h_expanded_causal_n65_m33": (2, 2, 1, 65, 33, 24, 16, F32, True, None, (-1, -1),
                                        0.0, "h", None, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    "alibi_h1_bool": (1, 4, 2, 7, 63, 16, 16, F32, False, "bool", (-1, -1), 0.0, "h1", None,
                      cfg(16, 32), (cfg(32, 16), cfg(16, 32))),
    # all three, with causal and a mask
    "all_causal_bool_gqa2": (1, 2, 1, 63, 129, 17, 17, F32, True, "bool", (30, 5), 3.0, "bh",
                             0.5, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    "all_add_n129_m63": (1, 2, 2, 129, 63, 16, 8, F32, False, "add", (3, 40), 4.0, "h", 0.5,
                         cfg(64, 32), (cfg(32, 64), cfg(64, 32))),
    # float16
    "f16_win_causal_gqa2": (1, 2, 1, 129, 129, 32, 32, F16, True, None, (20, -1), 0.0, None,
                            None, cfg(64, 64), (cfg(64, 64), cfg(64, 64))),
    "f16_softcap_alibi_n63_m129": (1, 2, 1, 63, 129, 17, 17, F16, False, None, (-1, -1), 5.0,
                                   "bh", 1.0, cfg(32, 64), (cfg(32, 64), cfg(32, 64))),
    "f16_all_bool_n129_m7": (1, 2, 2, 129, 7, 16, 16, F16, False, "bool", (3, 2), 3.0, "h",
                             0.5, cfg(32, 16), (cfg(16, 32), cfg(32, 16))),
}


def _case_inputs(case):
    (b, h, hk, n, m, d, dv, dtype, causal, mask_kind, window, softcap, alibi_kind, scale,
     fwd_cfg, bwd_cfg) = case
    q, k, v, go = make_inputs(b, h, hk, n, m, d, dv, dtype)
    mask = make_mask(mask_kind, b, h, n, m)
    alibi = None if alibi_kind is None else make_slopes(b, h, alibi_kind)
    ref_kw = dict(mask=mask, causal=causal, scale=scale, window=window, softcap=softcap,
                  alibi=alibi)
    return (q, k, v, go), ref_kw, fwd_cfg, bwd_cfg


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_options_match_float64_reference(case):
    (q, k, v, go), kw, fwd_cfg, bwd_cfg = _case_inputs(case)
    got = run_kernels(q, k, v, go, mask=kw["mask"], causal=kw["causal"], scale=kw["scale"],
                      fwd_config=fwd_cfg, bwd_config=bwd_cfg,
                      **options_of(kw["window"], kw["softcap"], kw["alibi"]))
    ref = check(got, q, k, v, go, **kw)
    # rows without a visible key: exactly out 0, lse -inf, dq 0 (the reference says which)
    dead = torch.isinf(ref[1]).to(got[1].device)
    assert torch.all(got[0][dead] == 0) and torch.all(got[2][dead] == 0)
    assert torch.all(got[1][dead] == float("-inf"))


def test_rows_outside_the_window_exist_in_the_cases():
    # The "rows outside" cases really have dead rows, and live ones (the test above checks both).
    vis = visible_keys(129, 7, window=(2, 1))
    assert (~vis.any(-1)).sum() > 100 and vis.any(-1).sum() > 0
    assert torch.equal(visible_keys(7, 7, window=(0, 0)), torch.eye(7, dtype=torch.bool))


def test_options_with_dropout_use_the_keep_mask():
    b, h, hk, n, m, d, p, seed = 1, 2, 1, 63, 70, 16, 0.25, 2024
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, F32)
    mask = make_mask("bool", b, h, n, m)
    alibi = make_slopes(b, h, "bh")
    kw = dict(mask=mask, causal=True, scale=1.0, window=(25, 3), softcap=3.0, alibi=alibi)
    got = run_kernels(q, k, v, go, mask=mask, causal=True, scale=1.0, dropout_p=p, seed=seed,
                      fwd_config=cfg(32, 32), bwd_config=cfg(32, 32),
                      **options_of((25, 3), 3.0, alibi))
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed, DEVICE)
    check(got, q, k, v, go, dropout_p=p, keep=keep, **kw)
    # another seed's mask must not pass: the comparison can fail
    other = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed + 1, DEVICE)
    with pytest.raises(AssertionError, match="tolerance"):
        check(got, q, k, v, go, dropout_p=p, keep=other, **kw)


def test_each_option_changes_the_result():
    # Guards against an option being silently ignored (a reference that ignores it too would
    # otherwise pass): each one moves out away from the plain kernel's.
    q, k, v, go = make_inputs(1, 2, 1, 40, 50, 16, 16, F32)
    slopes = make_slopes(1, 2, "bh")
    plain = triton_softmax.softmax_fwd(q, k, v, None, 1.0, False, config=cfg(32, 32))
    for opts in (options_of(window=(5, -1)), options_of(window=(-1, 5)),
                 options_of(softcap=2.0), options_of(alibi=slopes)):
        out, lse = triton_softmax.softmax_fwd(q, k, v, None, 1.0, False, config=cfg(32, 32),
                                              **opts)
        assert (out - plain[0]).abs().max() > 1e-2, opts
    # and the neutral settings give the plain kernel's results bit for bit
    same = triton_softmax.softmax_fwd(q, k, v, None, 1.0, False, config=cfg(32, 32),
                                      **options_of(window=(-1, -1), softcap=0.0, alibi=None))
    assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1])


# ----------------------------------------------------------------------------------------------
# band skipping: tiles outside the window are never visited
# ----------------------------------------------------------------------------------------------
# A NaN in a key tile's k / v reaches every row of a query tile that visits that key tile,
# masked or not (p = 0 but 0 * NaN = NaN in P V and dS K); a NaN in a query tile's q / dO
# likewise reaches every key of a key tile whose dK/dV loop visits it (dS^T Q, P^T dO).  So with
# the poison placed in tiles that no row's window reaches, any visit shows as NaN where the
# correct result (the unpoisoned run, bit for bit) is finite.  Fails if the loops go back to
# covering all of [0, M) / [0, N).


def _poisoned_pair(geometry):
    n, m, window, causal, poison = geometry
    q, k, v, go = make_inputs(1, 1, 1, n, m, 16, 16, F32, seed=4)
    clean = run_kernels(q, k, v, go, causal=causal, fwd_config=cfg(16, 16),
                        bwd_config=cfg(16, 16), **options_of(window))
    q2, k2, v2, go2 = (t.clone() for t in (q, k, v, go))
    tensors = {"q": q2, "k": k2, "v": v2, "go": go2}
    for name, index in poison:
        tensors[name][index] = float("nan")
    dirty = run_kernels(q2, k2, v2, go2, causal=causal, fwd_config=cfg(16, 16),
                        bwd_config=cfg(16, 16), **options_of(window))
    return clean, dirty


def test_band_skips_key_tiles_outside_every_window():
    # N = 7, M = 129, window (3, 3): row i sees keys i + 119 .. i + 125; key tile [0, 16) is far
    # outside every window.  NaN keys / values there must not reach out, lse or dq.
    clean, dirty = _poisoned_pair((7, 129, (3, 3), False, [("k", (0, 0, 5)), ("v", (0, 0, 5))]))
    for name, a, b in zip(NAMES, clean, dirty):
        assert torch.isfinite(b).all() or name == "lse", name
        if name in ("out", "lse", "dq"):
            assert torch.equal(a, b), name


def test_band_skips_query_tiles_outside_every_window():
    # N = 129, M = 7, window (3, 3): rows 0 .. 118 see no key (query tiles 0 .. 6 of 16 rows are
    # dead).  NaN queries / output gradients in row 3 must not reach dk / dv.
    clean, dirty = _poisoned_pair((129, 7, (3, 3), False, [("q", (0, 0, 3)), ("go", (0, 0, 3))]))
    for name in ("dk", "dv"):
        i = NAMES.index(name)
        assert torch.isfinite(dirty[i]).all(), name
        assert torch.equal(clean[i], dirty[i]), name
    assert torch.equal(clean[0], dirty[0])  # row 3 is dead: out 0 either way


def test_band_skips_tiles_on_both_sides():
    # N = M = 129, window (3, 3): row i sees keys i - 3 .. i + 3.  Poison key 64 (k, v) and row
    # 64 (q, dO).  Query tiles [48, 64), [64, 80), [80, 96) reach key tile [64, 80), masked or
    # not, so their rows may turn NaN; rows before 48 (the band's upper end) and from 96 on (its
    # lower end) must not.  Their NaN delta then reaches the key tiles that visit them, [32, 48)
    # to [96, 112); keys before 32 and from 112 on must stay clean (the dK/dV loop's two ends).
    clean, dirty = _poisoned_pair((129, 129, (3, 3), False,
                                   [("k", (0, 0, 64)), ("v", (0, 0, 64)),
                                    ("q", (0, 0, 64)), ("go", (0, 0, 64))]))
    assert torch.isnan(dirty[0][0, 0, 64]).all() and torch.isnan(dirty[3][0, 0, 64]).all()
    for i in range(5):
        rows = (slice(0, 32), slice(112, 129)) if i >= 3 else (slice(0, 48), slice(96, 129))
        for r in rows:
            assert torch.equal(clean[i][:, :, r], dirty[i][:, :, r]), (NAMES[i], r)


def test_band_skips_tiles_under_causal_sliding_window():
    # N = M = 96, causal with window (10, -1): row i sees keys i - 10 .. i.  Key 0 is seen by
    # rows 0 .. 10; query tiles from row 32 on start their band at key 22, so key tile [0, 16)
    # is skipped there (rows 16 .. 31 visit it, masked, and legitimately get its NaN value).
    # Row 95 is seen by keys 85 .. 95; key tiles [32, 64) end their query band before row 80,
    # so they skip query tile [80, 96) (key tile [16, 32) visits rows 16 .. 31, whose out and
    # so delta are NaN already; key tile [64, 80) visits row 95 legitimately).
    clean, dirty = _poisoned_pair((96, 96, (10, -1), True,
                                   [("k", (0, 0, 0)), ("v", (0, 0, 0)),
                                    ("q", (0, 0, 95)), ("go", (0, 0, 95))]))
    out, lse, dq, dk, dv = dirty
    assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(dk[0, 0, 90]).all()  # poison works
    assert torch.equal(clean[0][:, :, 32:95], out[:, :, 32:95])
    assert torch.equal(clean[1][:, :, 32:95], lse[:, :, 32:95])
    assert torch.equal(clean[2][:, :, 32:95], dq[:, :, 32:95])
    for i, got in ((3, dk), (4, dv)):
        assert torch.equal(clean[i][:, :, 32:64], got[:, :, 32:64]), NAMES[i]


# Out of bounds (DESIGN.md, "Out-of-bounds on CPU"): the band loops start and end at computed
# tile indices (lo may be past hi, hi negative, the unmasked middle may end at N); run them on
# inputs and launcher buffers flush against an inaccessible page, at either end, in a child
# process (a stray unmasked access is a SIGSEGV there), and check the results bit for bit.
_GUARD_SCRIPT = r"""
import sys, torch, triton
from guarded_memory import GuardedAllocations, guarded_copy, is_guarded
from attnkit.kernels import softmax as ks

def cfg(bm, bn):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)

CASES = [  # N, M, causal, window, softcap, alibi, (BLOCK_M, BLOCK_N)
    (7, 129, False, (3, 3), 2.0, True, (16, 32)),  # key tiles before the band; hi < lo rows
    (129, 7, True, (2, 1), 0.0, True, (32, 16)),  # dead query tiles, negative band ends
    (50, 45, True, (10, -1), 3.0, False, (16, 16)),  # all three ranges, causal
    (40, 9, False, (-1, 0), 0.0, False, (16, 16)),  # unmasked middle up to a partial tile
]
for n, m, causal, window, softcap, alibi, (bm, bn) in CASES:
    g = torch.Generator().manual_seed(n * 1000 + m)
    q, k, v, go = (torch.randn(*s, generator=g) for s in
                   ((1, 1, n, 24), (1, 1, m, 24), (1, 1, m, 40), (1, 1, n, 40)))
    slopes = torch.rand(1, generator=g).expand(1, 1) if alibi else None
    opts = dict(window_left=window[0], window_right=window[1], softcap=softcap)

    def run(q, k, v, go, slopes):
        out, lse = ks.softmax_fwd(q, k, v, None, None, causal, config=cfg(bm, bn),
                                  alibi_slopes=slopes, **opts)
        grads = ks.softmax_bwd(go, q, k, v, out, lse, None, None, causal,
                               config=(cfg(bn, bm), cfg(bm, bn)), alibi_slopes=slopes, **opts)
        return (out, lse, *grads)

    want = run(q, k, v, go, slopes)
    for where in ("end", "start"):
        guarded = [guarded_copy(t, where) for t in (q, k, v, go)]
        g_slopes = None if slopes is None else guarded_copy(slopes, where)
        with GuardedAllocations(where) as mode:
            got = run(*guarded, g_slopes)
        assert mode.count > 0 and all(is_guarded(t) for t in got), (where, n, m)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (where, n, m)
print("GUARDED OK")
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="guarded memory needs the interpreter (CPU tensors)")
def test_band_loops_stay_in_bounds():
    import os
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _GUARD_SCRIPT],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GUARDED OK" in proc.stdout, (
        f"child exited with {proc.returncode} (-11: an out-of-bounds access)\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# ----------------------------------------------------------------------------------------------
# tanh via exp2
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh_probe_kernel(X, T, T2, G, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0)
    t, g = tanh_and_grad(x)
    tl.store(T + offs, t, mask=ok)
    tl.store(G + offs, g, mask=ok)
    tl.store(T2 + offs, tanh_exp2(x), mask=ok)


def test_tanh_via_exp2_is_accurate_and_safe():
    special = [0.0, -0.0, 1e-30, 1e-8, -1e-4, 0.05, 0.0999, 0.1, -0.1001, 0.5, 1.0, -3.0, 9.0,
               20.0, -44.0, 88.0, 1e4, -1e30, 3e38, float("inf"), float("-inf"), float("nan")]
    x = torch.cat([torch.tensor(special), torch.linspace(-12, 12, 1001),
                   torch.logspace(-9, 1, 301) * torch.tensor([-1.0, 1.0]).repeat(151)[:301]])
    x = x.to(F32).to(DEVICE)
    t, t2, g = (torch.empty_like(x) for _ in range(3))
    _tanh_probe_kernel[(triton.cdiv(x.numel(), 256),)](x, t, t2, g, x.numel(), BLOCK=256)
    x64 = x.double().cpu()
    want_t = torch.tanh(x64)
    want_g = 1.0 - want_t * want_t
    big = x64.abs() > 1.0  # 1 - tanh^2 as e^-2|x| terms there (no cancellation in float64 either)
    want_g[big] = 4.0 * torch.exp(-2 * x64[big].abs()) / (1 + torch.exp(-2 * x64[big].abs())) ** 2
    nan = torch.isnan(x64)
    for got, want, name in ((t, want_t, "tanh"), (t2, want_t, "tanh_exp2"), (g, want_g, "grad")):
        got = got.double().cpu()
        assert torch.equal(torch.isnan(got), nan), name  # NaN stays NaN, nothing else is NaN
        err = (got - want)[~nan].abs()
        assert (err <= 2e-6 * want[~nan].abs() + 1e-37).all(), (name, x64[~nan][err.argmax()])
    assert t[special.index(float("inf"))] == 1.0 and t[special.index(float("-inf"))] == -1.0
    assert g[special.index(float("inf"))] == 0.0


# ----------------------------------------------------------------------------------------------
# launcher errors
# ----------------------------------------------------------------------------------------------


def _small():
    return make_inputs(2, 2, 1, 3, 4, 16, 16, F32)[:3]


@pytest.mark.parametrize("extra, exc, match", [
    ({"window_left": -2}, ValueError, r"window_left must be >= -1 \(-1 = unbounded\); got -2"),
    ({"window_right": -5}, ValueError, r"window_right must be >= -1"),
    ({"window_left": 1.5}, TypeError, r"window_left must be an int >= -1"),
    ({"window_right": True}, TypeError, r"window_right must be an int >= -1"),
    ({"softcap": -1.0}, ValueError,
     r"softcap must be a finite number >= 0 \(0.0 = off\); got -1.0"),
    ({"softcap": float("inf")}, ValueError, r"softcap must be a finite number >= 0"),
    ({"softcap": float("nan")}, ValueError, r"softcap must be a finite number >= 0"),
    ({"softcap": "3"}, TypeError, r"softcap must be a real number"),
    ({"alibi_slopes": [0.5, 0.25]}, TypeError, r"alibi_slopes must be a float32 tensor"),
    ({"alibi_slopes": torch.ones(2, 2, dtype=F64)}, TypeError,
     r"alibi_slopes must be float32; got torch.float64"),
    ({"alibi_slopes": torch.ones(3)}, ValueError,
     r"alibi_slopes of shape \(3,\) does not broadcast to \[B, H\] = \[2, 2\]"),
    ({"alibi_slopes": torch.ones(2, 2, 1)}, ValueError, r"does not broadcast to \[B, H\]"),
])
@pytest.mark.parametrize("launcher", ["fwd", "bwd"])
def test_launcher_errors(extra, exc, match, launcher):
    q, k, v = _small()
    extra = {key: (val.to(DEVICE) if torch.is_tensor(val) else val) for key, val in extra.items()}
    with pytest.raises(exc, match=match):
        if launcher == "fwd":
            triton_softmax.softmax_fwd(q, k, v, None, None, False, **extra)
        else:
            out = torch.zeros(2, 2, 3, 16, device=DEVICE)
            lse = torch.zeros(2, 2, 3, device=DEVICE)
            triton_softmax.softmax_bwd(out, q, k, v, out, lse, None, None, False, **extra)


def test_alibi_on_another_device_is_rejected():
    q, k, v = _small()
    other = torch.ones(2, 2, device="meta")
    with pytest.raises(ValueError, match=r"alibi_slopes must be on q's device"):
        triton_softmax.softmax_fwd(q, k, v, None, None, False, alibi_slopes=other)


def test_options_are_keyword_only():
    q, k, v = _small()
    with pytest.raises(TypeError):
        triton_softmax.softmax_fwd(q, k, v, None, None, False, 0.0, 0, None, 3)


def test_empty_sequences_with_options():
    b, h, hk, d = 1, 2, 1, 16
    for n, m in ((0, 5), (5, 0)):
        q, k, v, go = make_inputs(b, h, hk, n, m, d, d, F32)
        opts = options_of((2, 2), 3.0, make_slopes(b, h, "bh"))
        out, lse = triton_softmax.softmax_fwd(q, k, v, None, None, True, **opts)
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
        grads = triton_softmax.softmax_bwd(go, q, k, v, out, lse, None, None, True, **opts)
        assert all(torch.all(g == 0) for g in grads)


def test_tune_key_has_the_option_flags():
    assert {"HAS_WINDOW", "HAS_SOFTCAP", "HAS_ALIBI"} <= set(triton_softmax._TUNE_KEY)


# ----------------------------------------------------------------------------------------------
# learned sinks, folded into the forward's finish (session 29): the backward kernels take the
# forward's out and lse, which carry the sink (attnkit.score_options gives d sinks)
# ----------------------------------------------------------------------------------------------

SINKS = torch.tensor([-1.5, 0.4, 2.0, 6.0])

# name: (B, H, Hk, N, M, D, Dv, dtype, causal, mask, window, softcap, alibi, scale, fwd tile,
#        (dK/dV tile, dQ tile)) as CASES, each run with SINKS[:H]
SINK_CASES = {
    "sinks_plain_gqa2": (1, 4, 2, 33, 65, 16, 16, F32, False, None, (-1, -1), 0.0, None, None,
                         cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    # rows no key reaches: out 0, lse = the sink exactly, dq 0
    "sinks_rows_outside_n129_m7": (1, 2, 1, 129, 7, 16, 16, F32, False, None, (2, 1), 0.0, None,
                                   None, cfg(32, 16), (cfg(16, 32), cfg(32, 16))),
    # and with causal (top-left) and a window (bottom-right) that leave rows i < 61 no key
    "sinks_all_causal_bool": (1, 4, 2, 129, 63, 17, 17, F32, True, "bool", (30, 5), 3.0, "bh",
                              0.5, cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    "sinks_f16_window_add": (1, 2, 1, 63, 70, 16, 16, F16, False, "add", (20, 4), 0.0, "h", None,
                             cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
}


@pytest.mark.parametrize("case", SINK_CASES.values(), ids=SINK_CASES.keys())
def test_sinks_match_float64_reference(case):
    (q, k, v, go), kw, fwd_cfg, bwd_cfg = _case_inputs(case)
    sinks = SINKS[:q.shape[1]].to(DEVICE)
    got = run_kernels(q, k, v, go, mask=kw["mask"], causal=kw["causal"], scale=kw["scale"],
                      fwd_config=fwd_cfg, bwd_config=bwd_cfg, sinks=sinks,
                      **options_of(kw["window"], kw["softcap"], kw["alibi"]))
    check(got, q, k, v, go, sinks=sinks, **kw)
    dead = torch.isinf(reference(q, k, v, go, **kw)[1]).to(got[1].device)  # without the sinks
    if case in (SINK_CASES["sinks_rows_outside_n129_m7"], SINK_CASES["sinks_all_causal_bool"]):
        assert dead.any() and not dead.all()
    lse_sink = sinks.view(1, -1, 1).expand_as(got[1])
    assert torch.all(got[0][dead] == 0) and torch.all(got[2][dead] == 0)
    assert torch.equal(got[1][dead], lse_sink[dead])


def test_sinks_with_dropout_use_the_keep_mask():
    b, h, hk, n, m, d, p, seed = 1, 2, 1, 40, 50, 16, 0.25, 77
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, F32)
    sinks = SINKS[:h].to(DEVICE)
    got = run_kernels(q, k, v, go, causal=True, dropout_p=p, seed=seed, fwd_config=cfg(32, 32),
                      bwd_config=cfg(32, 32), sinks=sinks, **options_of((10, 0)))
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed, DEVICE)
    check(got, q, k, v, go, causal=True, window=(10, 0), dropout_p=p, keep=keep, sinks=sinks)


def test_sinks_special_values_and_no_keys():
    # As attnkit.score_options.add_sinks: NaN -> NaN rows, +inf -> out 0 and lse +inf, -inf ->
    # the kernel without sinks bit for bit; no key (M = 0): out 0, lse = the sink.
    from attnkit import score_options

    q, k, v, _ = make_inputs(1, 4, 2, 5, 9, 16, 16, F32)
    sinks = torch.tensor([math.nan, math.inf, -math.inf, 0.5], device=DEVICE)
    out, lse = triton_softmax.softmax_fwd(q, k, v, None, None, False, sinks=sinks)
    plain = triton_softmax.softmax_fwd(q, k, v, None, None, False)
    want = score_options.add_sinks(*plain, sinks)
    torch.testing.assert_close(out, want[0], equal_nan=True, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, want[1], equal_nan=True, rtol=2e-6, atol=2e-6)
    assert torch.equal(out[:, 2], plain[0][:, 2]) and torch.equal(lse[:, 2], plain[1][:, 2])
    out0, lse0 = triton_softmax.softmax_fwd(q, k[:, :, :0], v[:, :, :0], None, None, False, sinks=sinks)
    assert torch.isnan(out0[:, 0]).all() and not out0[:, 1:].any()
    assert torch.isnan(lse0[:, 0]).all() and torch.equal(lse0[:, 1:], sinks[1:].view(1, 3, 1).expand(1, 3, 5))


@pytest.mark.parametrize("sinks,exc,match", [
    ([0.5, 0.25], TypeError, r"softmax_fwd: sinks must be a float32 tensor \[H\]; got list"),
    (torch.ones(2, dtype=F64), TypeError, r"sinks must be float32; got torch.float64"),
    (torch.ones(3), ValueError, r"sinks must have shape \[H\] = \[2\]; got \[3\]"),
    (torch.ones(1, 2), ValueError, r"sinks must have shape \[H\] = \[2\]; got \[1, 2\]"),
])
def test_sinks_launcher_errors(sinks, exc, match):
    q, k, v = _small()
    sinks = sinks.to(DEVICE) if torch.is_tensor(sinks) else sinks
    with pytest.raises(exc, match=match):
        triton_softmax.softmax_fwd(q, k, v, None, None, False, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# GPU: bfloat16 (its small cases run interpreted too), larger shapes, the autotuned path
# ----------------------------------------------------------------------------------------------


@TRITON_BF16_TEST
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bf16_options_match_float64_reference(case):
    # The interpreter cases in bfloat16, with their tile configs (one compile per kernel each on
    # a GPU; the autotuned path is the large test's).  On CPU: the fixed interpreter.
    (q, k, v, go), kw, fwd_cfg, bwd_cfg = _case_inputs(case)
    q, k, v, go = (t.to(BF16) for t in (q, k, v, go))
    got = run_kernels(q, k, v, go, mask=kw["mask"], causal=kw["causal"], scale=kw["scale"],
                      fwd_config=fwd_cfg, bwd_config=bwd_cfg,
                      **options_of(kw["window"], kw["softcap"], kw["alibi"]))
    check(got, q, k, v, go, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, autotune", [pytest.param(BF16, True, marks=pytest.mark.autotune),
                                             (F16, False), (F32, False)],
                         ids=["bf16_autotuned", "f16", "f32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_large_all_options(dtype, autotune, causal):
    b, h, hk, n, m, d = 2, 4, 2, 1000, 1100, 128
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, dtype)
    alibi = make_slopes(b, h, "h")
    kw = dict(causal=causal, window=(256, 64), softcap=2.0, alibi=alibi)
    configs = {} if autotune else dict(fwd_config=cfg(64, 64), bwd_config=cfg(64, 64))
    got = run_kernels(q, k, v, go, causal=causal, **configs, **options_of((256, 64), 2.0, alibi))
    check(got, q, k, v, go, **kw)


@pytest.mark.gpu
def test_gpu_bf16_options_with_dropout():
    b, h, hk, n, m, d, p, seed = 2, 4, 2, 500, 600, 64, 0.1, 99
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, BF16)
    alibi = make_slopes(b, h, "bh")
    kw = dict(causal=True, window=(100, -1), softcap=20.0, alibi=alibi)
    got = run_kernels(q, k, v, go, causal=True, dropout_p=p, seed=seed,
                      **options_of((100, -1), 20.0, alibi))
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed, DEVICE)
    check(got, q, k, v, go, dropout_p=p, keep=keep, **kw)


@TRITON_BF16_TEST
def test_band_skipping_bf16():
    # The interpreter's poison checks on the compiled kernels, bfloat16, 64 x 64 tiles (fixed:
    # a 128-key tile would hold the poisoned key 5 and the visible keys 119.. together).
    for geometry, rows_ok, keys_ok in (
            ((7, 129, (3, 3), False, [("k", (0, 0, 5)), ("v", (0, 0, 5))]), True, False),
            ((129, 7, (3, 3), False, [("q", (0, 0, 3)), ("go", (0, 0, 3))]), False, True)):
        n, m, window, causal, poison = geometry
        q, k, v, go = (t.to(BF16) for t in make_inputs(1, 2, 1, n, m, 16, 16, F32, seed=4))
        tensors = {"q": q, "k": k, "v": v, "go": go}
        for name, index in poison:
            tensors[name][index] = float("nan")
        out, lse, dq, dk, dv = run_kernels(q, k, v, go, causal=causal, fwd_config=cfg(64, 64),
                                           bwd_config=cfg(64, 64), **options_of(window))
        if rows_ok:
            assert torch.isfinite(out).all() and torch.isfinite(dq).all()
        if keys_ok:
            assert torch.isfinite(dk).all() and torch.isfinite(dv).all()

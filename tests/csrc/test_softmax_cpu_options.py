"""The score-option arguments of the C++ ops attnkit::softmax_fwd / softmax_bwd (issue 28):
``window_left``, ``window_right``, ``softcap``, ``alibi_slopes`` (float32 [B, H]), called directly
through torch.ops: schema defaults, opcheck, the input checks of both backends (the CUDA branch
on meta tensors), and what the public function's tests cannot reach (huge window bounds, slopes
read through their strides, the backward's NaN-row path with a window).  The numbers of every
option against the float64 reference: tests/ops/test_softmax_score_options.py.
"""
import math

import pytest
import torch

import attnkit  # noqa: F401  (loads attnkit._C, which registers the ops)
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import assert_close_to_reference, has_cpu_kernel

F16, F32, F64 = torch.float16, torch.float32, torch.float64

pytestmark = pytest.mark.skipif(not has_cpu_kernel("softmax_fwd"), reason="attnkit._C is not built")


def ops():
    return torch.ops.attnkit.softmax_fwd.default, torch.ops.attnkit.softmax_bwd.default


def inputs(b=1, h=4, hk=2, n=7, m=9, d=16, dv=8, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=F64).to(dtype) for shape in
            ((b, h, n, d), (b, hk, m, d), (b, hk, m, dv), (b, h, n, dv))]


def test_schema_defaults_are_the_plain_call():
    fwd, bwd = ops()
    q, k, v, g = inputs(n=33, m=40)
    plain = fwd(q, k, v, None, 0.25, True)
    for out, ref in zip(fwd(q, k, v, None, 0.25, True, -1, -1, 0.0, None), plain):
        assert torch.equal(out, ref)
    out, lse = plain
    a = bwd(g, q, k, v, out, lse, None, 0.25, True)
    for x, y in zip(a, bwd(g, q, k, v, out, lse, None, 0.25, True, window_left=-1, softcap=0.0)):
        assert torch.equal(x, y)


def test_opcheck_with_options():
    fwd, bwd = ops()
    q, k, v, g = inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    slopes = torch.rand(4).expand(1, 4)  # stride 0 over B
    mask = torch.rand(1, 1, 7, 9).expand(1, 4, 7, 9) > 0.3
    torch.library.opcheck(fwd, (q, k, v, None, 0.3, True, 3, 1, 2.0, slopes))
    torch.library.opcheck(fwd, (q, k, v, mask, 0.3, False, -1, 0, 0.0, torch.rand(1, 4)))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = fwd(qd, kd, vd, mask, 0.3, False, 2, 2, 1.5, slopes)
    torch.library.opcheck(bwd, (g, qd, kd, vd, out, lse, mask, 0.3, False, 2, 2, 1.5, slopes))


def test_slopes_through_their_strides():
    # [H] expanded (stride 0 over B), a transposed [H, B] view, and a dense copy: the same result.
    fwd, _ = ops()
    q, k, v, _ = inputs(b=3, n=20, m=20)
    dense = torch.rand(3, 4)
    views = (dense, dense.t().contiguous().t(), dense.clone())
    outs = [fwd(q, k, v, None, 0.25, False, 4, 4, 0.0, s)[0] for s in views]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    row = torch.rand(4)
    a = fwd(q, k, v, None, 0.25, False, -1, -1, 0.0, row.expand(3, 4))[0]
    b = fwd(q, k, v, None, 0.25, False, -1, -1, 0.0, row.repeat(3, 1))[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("bound", [2**62, 2**63 - 1])
def test_huge_window_bounds_hide_nothing(bound):
    fwd, bwd = ops()
    q, k, v, g = inputs(n=70, m=50)
    plain = fwd(q, k, v, None, 0.25, False)
    wide = fwd(q, k, v, None, 0.25, False, bound, bound, 0.0, None)
    assert torch.equal(plain[0], wide[0]) and torch.equal(plain[1], wide[1])
    for x, y in zip(bwd(g, q, k, v, *plain, None, 0.25, False), bwd(g, q, k, v, *plain, None, 0.25, False, bound, bound)):
        assert torch.equal(x, y)
    # one side huge, the other a real bound: the band of the bounded side
    left = fwd(q, k, v, None, 0.25, False, bound, 0, 0.0, None)[0]
    ref = softmax_attention_reference(q.double(), k.double(), v.double(), scale=0.25, enable_gqa=True, window=(-1, 0))
    assert_close_to_reference(left, ref)


def test_backward_of_a_nan_row_with_a_window_and_softcap():
    """A row the forward found NaN (a NaN in a key it sees) keeps NaN gradients on the keys it sees
    and clean ones on the keys its window hides (the backward's NaN-row path recomputes which)."""
    fwd, bwd = ops()
    n = m = 80
    q, k, v, g = inputs(h=2, hk=1, n=n, m=m)
    k[0, 0, 30, 3] = math.nan  # seen by rows 30..35 with window (5, 0)
    out, lse = fwd(q, k, v, None, 0.25, False, 5, 0, 3.0, None)
    nan_rows = torch.isnan(lse[0, 0]).nonzero().flatten().tolist()
    assert nan_rows == list(range(30, 36))
    dq, dk, dv = bwd(g, q, k, v, out, lse, None, 0.25, False, 5, 0, 3.0, None)
    assert torch.isnan(dq[0, :, 30:36]).all()
    # Other rows: clean but for the NaN's own column, which dQ += dS K reaches through 0 * NaN in
    # the tiles that hold key 30 (the reference's dense dS @ K has that column NaN on every row).
    others = torch.cat([dq[0, :, :30], dq[0, :, 36:]], dim=1)
    assert not torch.isnan(others[..., [c for c in range(16) if c != 3]]).any()
    seen = torch.zeros(m, dtype=torch.bool)
    seen[25:36] = True  # the keys rows 30..35 see
    assert torch.isnan(dv[0, 0, seen]).all() and not torch.isnan(dv[0, 0, ~seen]).any()
    assert not torch.isnan(dk[0, 0, ~seen]).any()


# ----------------------------------------------------------------------------------------------
# input checks (csrc/checks/softmax.cpp): the CPU kernel and the check alone, and the CUDA branch
# ----------------------------------------------------------------------------------------------

_checks = attnkit._C._checks
CPU = _checks.Target("cpu")
CUDA = _checks.Target("cuda", device="meta")


@pytest.mark.parametrize("args,match", [
    ((-2, -1, 0.0, None), r"window bounds must be -1 \(unbounded\) or >= 0; got window_left = -2, window_right = -1"),
    ((0, -5, 0.0, None), r"got window_left = 0, window_right = -5"),
    ((-1, -1, -1.0, None), r"softcap must be finite and >= 0 \(0 = off\); got -1"),
    ((-1, -1, math.inf, None), r"softcap must be finite and >= 0 \(0 = off\); got inf"),
    ((-1, -1, math.nan, None), r"softcap must be finite and >= 0"),
    ((-1, -1, 0.0, torch.ones(4)), r"alibi_slopes must have shape \[B, H\] = \[1, 4\] \(a broadcast view is fine\); "
                                   r"got \[4\]"),
    ((-1, -1, 0.0, torch.ones(2, 4)), r"alibi_slopes must have shape \[B, H\] = \[1, 4\]"),
    ((-1, -1, 0.0, torch.ones(1, 4, dtype=F64)), r"alibi_slopes must be Float; got Double"),
])
def test_cpu_rejects_bad_options(args, match):
    fwd, bwd = ops()
    q, k, v, g = inputs()
    out, lse = fwd(q, k, v, None, 0.25, False)
    for name, op, head in (("softmax_fwd", fwd, (q, k, v)), ("softmax_bwd", bwd, (g, q, k, v, out, lse))):
        full = rf"attnkit::{name} \(cpu\): .*{match}"
        with pytest.raises(RuntimeError, match=full):
            op(*head, None, 0.25, False, *args)
        with pytest.raises(RuntimeError, match=full):
            getattr(_checks, name)(CPU, *head, None, 0.25, False, *args)


def test_cpu_check_rejects_slopes_on_another_device():
    q, k, v, _ = inputs()
    with pytest.raises(RuntimeError, match=r"attnkit::softmax_fwd \(cpu\): alibi_slopes must be on q's device \(cpu\); "
                                           r"got meta"):
        _checks.softmax_fwd(CPU, q, k, v, None, 0.25, False, -1, -1, 0.0, torch.empty(1, 4, device="meta"))


def test_cuda_branch_refuses_every_option():
    q = torch.empty(1, 2, 4, 64, dtype=F16, device="meta")
    out = torch.empty(1, 2, 4, 64, dtype=F16, device="meta")
    lse = torch.empty(1, 2, 4, dtype=F32, device="meta")
    slopes = torch.empty(1, 2, dtype=F32, device="meta")
    _checks.softmax_fwd(CUDA, q, q, q, None, 1.0, False)  # the defaults pass
    _checks.softmax_fwd(CUDA, q, q, q, None, 1.0, False, -1, -1, 0.0, None)
    cases = (((3, 0, 0.0, None), r"got window \("), ((-1, -1, 2.0, None), r"got softcap \("),
             ((-1, -1, 0.0, slopes), r"got alibi_slopes \("), ((-1, 7, 1.0, slopes), r"got window softcap alibi_slopes \("))
    for args, got in cases:
        for name, head in (("softmax_fwd", (q, q, q)), ("softmax_bwd", (out, q, q, q, out, lse))):
            with pytest.raises(RuntimeError, match=rf"attnkit::{name} \(cuda\): the cuda kernels do not implement the "
                                                   rf"score options window, softcap and alibi_slopes yet; {got}run "
                                                   rf"them on the cpu backend or the reference\)"):
                getattr(_checks, name)(CUDA, *head, None, 1.0, False, *args)


# ----------------------------------------------------------------------------------------------
# the forward's band tiling (issue 28): tiles cut where every row of a 64-row query block starts
# and stops seeing keys, edge tiles multiplied by 16-row groups over their own keys, merged where
# the groups' keys agree -- against float64 at the sizes where those cuts land on and off the
# 16-key, 64-row and 256-key boundaries
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,m,causal,windows", [
    (300, 300, True, ((0, 0), (15, 0), (63, 0), (256, 1))),
    (300, 300, False, ((16, -1), (65, 64), (-1, 40))),
    (150, 420, True, ((1, 0), (64, 2), (299, 17))),
    (420, 150, False, ((17, 2), (255, 0), (-1, 0))),
    (1, 300, True, ((40, 0),)),
    (300, 1, False, ((3, 0),)),
])
def test_band_tiles_forward(n, m, causal, windows):
    fwd, _ = ops()
    q, k, v, _ = inputs(h=2, hk=1, n=n, m=m, d=33, dv=17, seed=n + m)
    for wl, wr in windows:
        ref, ref_lse = softmax_attention_reference(q.double(), k.double(), v.double(), None, 0.0, causal, 0.3, True,
                                                   return_lse=True, window=(wl, wr))
        for dtype in (F32, F64) if n == m else (F32,):
            qd, kd, vd = (t.to(dtype) for t in (q, k, v))
            out, lse = fwd(qd, kd, vd, None, 0.3, causal, wl, wr, 0.0, None)
            assert_close_to_reference(out, ref, name=f"out {dtype} window ({wl}, {wr})")
            assert_close_to_reference(lse, ref_lse, name=f"lse {dtype} window ({wl}, {wr})", dtype=dtype)


def test_band_tiles_with_mask_softcap_alibi_and_gradients():
    fwd, bwd = ops()
    n, m = 150, 280
    q, k, v, g = inputs(b=1, h=2, hk=1, n=n, m=m, d=40, dv=24, seed=5)
    mask = torch.rand(1, 1, n, m, generator=torch.Generator().manual_seed(1)).expand(1, 2, n, m) > 0.2
    slopes = torch.rand(1, 2)
    for causal, (wl, wr), cap in ((True, (70, 0), 0.0), (False, (17, 90), 4.0)):
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = softmax_attention_reference(qr, kr, vr, mask, 0.0, causal, 0.25, True, return_lse=True,
                                                   window=(wl, wr), softcap=cap, alibi_slopes=slopes.double())
        ref_grads = torch.autograd.grad(ref, (qr, kr, vr), g.double())
        out, lse = fwd(q, k, v, mask, 0.25, causal, wl, wr, cap, slopes)
        assert_close_to_reference(out, ref.detach())
        assert_close_to_reference(lse, ref_lse.detach(), name="lse")
        for name, x, r in zip(("dq", "dk", "dv"), bwd(g, q, k, v, out, lse, mask, 0.25, causal, wl, wr, cap, slopes),
                              ref_grads):
            assert_close_to_reference(x, r, grad=True, name=f"{name} window ({wl}, {wr}) softcap {cap}")


# ----------------------------------------------------------------------------------------------
# sinks in the forward's finish (issue 28, session 29): the op takes them and returns out and lse
# with them; its backward needs nothing more (softmax_bwd on those out, lse is the sink softmax's)
# ----------------------------------------------------------------------------------------------


def _sink_reference(q, k, v, dtype, sinks, **options):
    rows = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rows, 1), v.repeat_interleave(rows, 1)
    slopes = options.pop("alibi_slopes", None)
    return softmax_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True,
                                       alibi_slopes=None if slopes is None else slopes.to(dtype),
                                       sinks=sinks.to(dtype), **options)


@pytest.mark.parametrize("n,seed", [(8, 365), (40, 107)], ids=["decode-kernel", "flash-kernel"])
def test_sinks_round_a_bfloat16_row_once(n, seed):
    # A sink with softcap and ALiBi, bfloat16, through the op on both CPU kernels: N = 8 takes the
    # decoding kernel, N = 40 the flash forward.  Folded into the rows' finish the result keeps
    # DESIGN.md's rule; the sink applied to finished bfloat16 rows (add_sinks, what attnkit did
    # before) misses it -- checked both ways, the second on the correctly rounded rows without the
    # sink (the float64 reference's), so that it holds whatever a CPU's kernel rounds.  (The seeds:
    # the first of a search over random inputs of these shapes where that misses; 1 in ~100-400.)
    fwd, _ = ops()
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    q = torch.randn(1, 1, n, 16, generator=g).to(bf16)
    k, v = torch.randn(1, 1, 5, 16, generator=g).to(bf16), torch.randn(1, 1, 5, 8, generator=g).to(bf16)
    sinks, slopes = torch.randn(1, generator=g), torch.rand(1, generator=g)
    options = dict(window=(-1, 0), softcap=0.5, alibi_slopes=slopes)
    want, naive = (_sink_reference(q, k, v, dtype, sinks, **options) for dtype in (F64, bf16))
    args = (q, k, v, None, 0.25, False, -1, 0, 0.5, slopes.expand(1, 1))
    out, lse = fwd(*args, sinks)
    assert_close_to_reference(out, want[0], naive[0], name="out")
    assert_close_to_reference(lse, want[1], naive[1], name="lse", dtype=bf16)
    plain_out, plain_lse = softmax_attention_reference(q.double(), k.double(), v.double(), return_lse=True,
                                                       window=(-1, 0), softcap=0.5, alibi_slopes=slopes.double())
    twice = attnkit.score_options.add_sinks(plain_out.to(bf16), plain_lse.float(), sinks)[0]
    with pytest.raises(AssertionError, match="out"):
        assert_close_to_reference(twice, want[0], naive[0], name="out")


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("n", [3, 33])
def test_sinks_in_the_op_match_float64(dtype, n):
    # GQA, a mask hiding whole rows, a window: every row against the float64 reference; rows with
    # no visible key give out 0 and lse = their head's sink exactly (float64: the sink's exact
    # value, no float32 step on the way).
    fwd, _ = ops()
    q, k, v, _ = inputs(b=2, h=4, hk=2, n=n, m=21, dtype=dtype, seed=3)
    mask = torch.rand(2, 4, n, 21, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, :, 1] = False
    sinks = torch.tensor([-2.0, 0.3, 1.7, 5.0])
    out, lse = fwd(q, k, v, mask, 0.3, False, 9, 2, 0.0, None, sinks)
    want = _sink_reference(q, k, v, F64, sinks, attn_mask=mask, scale=0.3, window=(9, 2))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(out, want[0].to(dtype), **tol)
    torch.testing.assert_close(lse, want[1].to(lse.dtype), **tol)
    assert not out[0, :, 1].any()
    assert torch.equal(lse[0, :, 1], sinks.to(lse.dtype))


@pytest.mark.parametrize("n", [1, 40], ids=["decode-kernel", "flash-kernel"])
def test_sinks_special_values_and_no_keys(n):
    # As attnkit.score_options.add_sinks (and the reference): a NaN sink gives NaN rows, +inf out
    # 0 and lse +inf, -inf nothing at all; with no key (M = 0) out 0 and lse = the sink.
    fwd, _ = ops()
    q, k, v, _ = inputs(b=1, h=4, hk=2, n=n, m=9, seed=5)
    sinks = torch.tensor([math.nan, math.inf, -math.inf, 0.5])
    out, lse = fwd(q, k, v, None, 0.25, False, -1, -1, 0.0, None, sinks)
    want_out, want_lse = attnkit.score_options.add_sinks(*fwd(q, k, v, None, 0.25, False), sinks)
    torch.testing.assert_close(out, want_out, equal_nan=True, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, equal_nan=True, rtol=2e-6, atol=2e-6)
    assert torch.equal(out[:, 2], fwd(q, k, v, None, 0.25, False)[0][:, 2])  # -inf: bit for bit
    out0, lse0 = fwd(q, k[:, :, :0], v[:, :, :0], None, 0.25, False, -1, -1, 0.0, None, sinks)
    assert torch.isnan(out0[:, 0]).all() and not out0[:, 1:].any()
    assert torch.equal(lse0, sinks.view(1, 4, 1).expand(1, 4, n)) or torch.isnan(lse0[:, 0]).all()
    assert torch.equal(lse0[:, 1:], sinks[1:].view(1, 3, 1).expand(1, 3, n))


def test_sinks_through_the_registered_autograd():
    # torch.ops.attnkit.softmax_fwd with sinks, differentiated through its registered autograd
    # (what torch.compile traces): q, k, v and the sinks against gradcheck, the lse in the loss;
    # then opcheck (fake, autograd registration, schema).
    fwd, _ = ops()
    q, k, v, _ = inputs(b=1, h=4, hk=2, n=6, m=7, d=5, dv=3, dtype=F64, seed=9)
    sinks = torch.tensor([-1.0, 0.2, 0.9, 2.0], requires_grad=True)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def loss(q, k, v, s):
        out, lse = torch.ops.attnkit.softmax_fwd(q, k, v, None, 0.4, True, 3, -1, 1.5, None, s.float())
        return out, lse

    torch.autograd.gradcheck(lambda q, k, v: loss(q, k, v, sinks), (q, k, v))
    out, lse = loss(q, k, v, sinks)
    (dsinks,) = torch.autograd.grad((out.square().sum() + lse.sum()), (sinks,))
    s64 = sinks.detach().double().requires_grad_()
    ro, rl = _sink_reference(q.detach(), k.detach(), v.detach(), F64, s64, is_causal=True, scale=0.4, window=(3, -1),
                             softcap=1.5)
    (want,) = torch.autograd.grad(ro.square().sum() + rl.sum(), (s64,))
    torch.testing.assert_close(dsinks, want.float(), rtol=1e-5, atol=1e-6)
    qd, kd, vd = (t.detach().float().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(fwd, (qd, kd, vd, None, 0.4, True, 3, -1, 1.5, None, sinks.detach()))


@pytest.mark.parametrize("sinks,match", [
    (torch.zeros(3), r"sinks must have shape \[H\] = \[4\]; got \[3\]"),
    (torch.zeros(4, dtype=F64), r"sinks must be Float; got Double"),
    (torch.zeros(1, 4), r"sinks must have shape \[H\] = \[4\]; got \[1, 4\]"),
])
def test_cpu_rejects_bad_sinks(sinks, match):
    fwd, _ = ops()
    q, k, v, _ = inputs()
    with pytest.raises(RuntimeError, match=rf"attnkit::softmax_fwd \(cpu\): {match}"):
        fwd(q, k, v, None, 0.25, False, -1, -1, 0.0, None, sinks)
    with pytest.raises(RuntimeError, match=rf"attnkit::softmax_fwd \(cpu\): {match}"):
        _checks.softmax_fwd(CPU, q, k, v, None, 0.25, False, -1, -1, 0.0, None, sinks)
    with pytest.raises(RuntimeError, match=r"sinks must be on q's device \(cpu\); got meta"):
        _checks.softmax_fwd(CPU, q, k, v, None, 0.25, False, -1, -1, 0.0, None, torch.zeros(4, device="meta"))


def test_cuda_branch_refuses_sinks():
    # The cuda kernels do not fold sinks in; attnkit applies them around those kernels.
    q = torch.empty(1, 2, 4, 64, dtype=F16, device="meta")
    with pytest.raises(RuntimeError, match=r"attnkit::softmax_fwd \(cuda\): the cuda kernels do not fold sinks into "
                                           r"the softmax; got sinks"):
        _checks.softmax_fwd(CUDA, q, q, q, None, 1.0, False, -1, -1, 0.0, None,
                            torch.empty(2, dtype=F32, device="meta"))

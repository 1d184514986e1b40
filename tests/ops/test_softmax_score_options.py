"""Score options of attnkit.softmax_attention (issue 28): ``window``, ``softcap``,
``alibi_slopes``, ``sinks`` -- alone and combined, with is_causal, bool / float masks, GQA,
return_lse, forward and every gradient (q, k, v, sinks).

Ground truths:

- :func:`loop_score_attention` -- float64, one query row at a time, each row's visible keys
  listed from the definitions of the issue (index arithmetic, no mask tensor), the sink as one more
  term of the denominator.  Independent of ``attnkit.reference``; it checks the reference
  (:func:`test_reference_matches_the_loop`), forward and gradients, alibi_slopes' included.
- ``softmax_attention_reference`` in float64 -- the ground truth of the kernel tests, with the
  tolerance rule of DESIGN.md (``assert_close_to_reference``; float16 / bfloat16: the reference
  run in that dtype sets the tolerance).  Gradients come from a loss on out *and* lse.

The C++ CPU kernel runs through the public function (``backend="cpu"``): its flash forward
(tiles of 64 rows x 256 keys, N > 16), its decode forward (N <= 16 rows, keys split over tasks
for M >= 1024) and its backward (64 x 64 tiles).  Sinks get their gradient from
``attnkit.score_options``; the kernel backward runs on lse' and out'.

The Triton kernels run through the public function too (``backend="triton"``: the custom ops
``attnkit::softmax_triton_fwd`` / ``_bwd`` with the score options as trailing arguments).
Without a GPU they run interpreted on CPU tensors (tests/conftest.py), in float32 and float16
(bfloat16 kernels: tests/kernels/test_softmax_triton_options.py, interpreted too) at N, M <= ~70, where the first tile
config of each kernel (forward 128 x 64, dK/dV 32 x 128, dQ 128 x 32) still puts tile edges
inside the sequences; the tile configs themselves are the launcher tests'
(tests/kernels/test_softmax_triton_options.py).
"""
import math
import re

import pytest
import torch

import attnkit
import attnkit.ops.softmax as ops_softmax
from attnkit import BackendUnavailableError
from attnkit.reference.softmax import softmax_attention_reference
from attnkit.score_options import BACKEND_OPTIONS, ScoreOptions
from attnkit_testing import F64, assert_close_to_reference, assert_nonfinite_like_reference, num_threads

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
OP = "attnkit.softmax_attention"
CPU_USABLE = attnkit.backends()["softmax"]["cpu"].usable
needs_cpu = pytest.mark.skipif(not CPU_USABLE, reason="the cpu backend is not usable here")
_TRITON_STATUS = attnkit.backends()["softmax"]["triton"]
needs_triton = pytest.mark.skipif(not _TRITON_STATUS.usable, reason=f"triton backend unusable: {_TRITON_STATUS.reason}")
CUDA = torch.cuda.is_available()
# Where the triton backend's inputs live: CUDA, or CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if CUDA else "cpu"
# bfloat16 through the op on a GPU; without one the kernels' bfloat16 cases run interpreted in
# tests/kernels/test_softmax_triton_options.py (the interpreter is slow: CI time).
TRITON_DTYPES = [F32, F16, BF16] if CUDA else [F32, F16]
CPU = pytest.param("cpu", marks=needs_cpu)
TRITON = pytest.param("triton", marks=needs_triton)


def row(backend, *values):
    """A parametrize row ``(backend, *values)``, skipped where that backend is unusable."""
    return pytest.param(backend, *values, marks=needs_triton if backend == "triton" else needs_cpu)


def device_of(backend):
    return TRITON_DEVICE if backend == "triton" else "cpu"


# ----------------------------------------------------------------------------------------------
# the independent float64 ground truth
# ----------------------------------------------------------------------------------------------


def visible_keys(i, n, m, is_causal, window):
    """The keys query i sees before any mask: causality (j <= i) and the window, bottom-right
    (i + M - N - left <= j <= i + M - N + right; -1 = unbounded)."""
    left, right = (-1, -1) if window is None else window
    keys = []
    for j in range(m):
        if is_causal and j > i:
            continue
        if left >= 0 and j < i + m - n - left:
            continue
        if right >= 0 and j > i + m - n + right:
            continue
        keys.append(j)
    return keys


def loop_score_attention(q, k, v, mask=None, is_causal=False, scale=None, window=None, softcap=0.0,
                         alibi=None, sinks=None):
    """(out, lse) in float64, one row at a time; differentiable in q, k, v, a float mask, alibi
    ([H] or [B, H]) and sinks ([H]).  A row with no visible key: out 0 and lse -inf, or lse =
    sink with a sink."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    b, h, n, d = q.shape
    hk, m, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kv_head = torch.arange(h) // (h // hk)
    kh, vh = k[:, kv_head], v[:, kv_head]  # [B, H, M, *]
    slopes = None if alibi is None else alibi.to(F64).expand(b, h)
    sink = None if sinks is None else sinks.to(F64).reshape(1, h).expand(b, h)
    outs, lses = [], []
    for i in range(n):
        ok = torch.zeros(b, h, m, dtype=torch.bool)
        ok[..., visible_keys(i, n, m, is_causal, window)] = True
        s = (q[:, :, i, None, :] * kh).sum(-1) * scale  # [B, H, M]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            dist = torch.tensor([abs(i + m - n - j) for j in range(m)], dtype=F64)
            s = s - slopes[..., None] * dist
        if mask is not None:
            row = torch.broadcast_to(mask, (b, h, n, m))[:, :, i]
            if row.dtype == torch.bool:
                ok = ok & row
            else:
                s = s + row.to(F64)
                ok = ok & (row > -math.inf)
        top = torch.where(ok, s, -math.inf).amax(-1).detach()  # [B, H]
        if sink is not None:
            top = torch.maximum(top, sink.detach())
        finite_top = torch.isfinite(top)
        top = torch.where(finite_top, top, torch.zeros_like(top))
        w = torch.where(ok, torch.exp(torch.where(ok, s, top[..., None]) - top[..., None]), torch.zeros_like(s))
        den = w.sum(-1)
        if sink is not None:
            den = den + torch.exp(sink - top)
        some = den > 0
        safe = torch.where(some, den, torch.ones_like(den))
        outs.append(((w / safe[..., None])[..., None] * vh).sum(-2))
        lses.append(torch.where(some, torch.log(safe) + top, torch.full_like(den, -math.inf)))
    return torch.stack(outs, dim=2), torch.stack(lses, dim=2)


def make_inputs(b, h, hk, n, m, d, dv, dtype, *, mask=None, alibi=None, sinks=False, seed=0):
    """q, k, v (rounded to ``dtype``), a mask ("bool" / "float": [B, H, N, M], about 25% hidden,
    one row fully hidden when N > 2), float32 alibi slopes ("h": [H], "bh": [B, H]) and sinks."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, dtype=F64).to(dtype)
               for shape in ((b, h, n, d), (b, hk, m, d), (b, hk, m, dv)))
    attn_mask = None
    if mask is not None:
        hidden = torch.rand(b, h, n, m, generator=g) < 0.25
        if n > 2:
            hidden[:, :, 1] = True  # a fully masked row
        if mask == "bool":
            attn_mask = ~hidden
        else:
            attn_mask = torch.randn(b, h, n, m, generator=g, dtype=F64).masked_fill(hidden, -math.inf).to(dtype)
    slopes = None
    if alibi is not None:
        slopes = (torch.rand((h,) if alibi == "h" else (b, h), generator=g) * 0.5).float()
    sink = torch.randn(h, generator=g).float() * 2 if sinks else None
    return q, k, v, attn_mask, slopes, sink


def run(backend, q, k, v, attn_mask, is_causal, opts, grad_out, grad_lse, *, dtype=None):
    """(out, lse, dq, dk, dv[, dsinks]) of softmax_attention on ``backend`` (the reference: in
    ``dtype``, default the inputs'), from the loss <out, grad_out> + <lse, grad_lse>."""
    dtype = q.dtype if dtype is None else dtype
    device = device_of(backend)
    q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in (q, k, v))
    sinks = opts.get("sinks")
    kw = {name: val.to(device) if isinstance(val, torch.Tensor) else val for name, val in opts.items()}
    wanted = [q, k, v]
    if sinks is not None:
        # the float64 ground truth takes float64 sinks (the same values), so d sinks is float64
        ground_truth = backend == "reference" and dtype == F64
        kw["sinks"] = sinks.detach().to(device, F64 if ground_truth else sinks.dtype).requires_grad_()
        wanted.append(kw["sinks"])
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(dtype)
    mask = None if mask is None else mask.to(device)
    grad_out, grad_lse = grad_out.to(device), grad_lse.to(device)
    if backend == "reference":
        # Ground truths on one thread: small ops, for which a second thread costs more than it
        # gives (5x more on a loaded 2-core machine, measured); the kernel keeps torch's count.
        with num_threads(1):
            out, lse = softmax_attention_reference(q, k, v, mask, 0.0, is_causal, None, q.shape[1] != k.shape[1],
                                                   return_lse=True, **kw)
            return _grads(out, lse, wanted, grad_out, grad_lse)
    else:
        out, lse = attnkit.softmax_attention(q, k, v, mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1],
                                             return_lse=True, backend=backend, **kw)
    return _grads(out, lse, wanted, grad_out, grad_lse)


def _grads(out, lse, wanted, grad_out, grad_lse):
    loss_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    grads = torch.autograd.grad((out, loss_lse), wanted, (grad_out.to(out.dtype), grad_lse.to(lse.dtype)),
                                allow_unused=True)
    # compared on the CPU (a no-op there; a Triton run on a GPU comes back)
    return tuple(None if t is None else t.detach().cpu() for t in (out, lse, *grads))


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def check_against_reference(q, k, v, attn_mask, is_causal, opts, *, backend="cpu", seed=1):
    """The kernel backend against the float64 reference (DESIGN.md's rule), every output."""
    dtype = q.dtype
    b, h, n = q.shape[:3]
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(b, h, n, v.shape[-1], generator=g, dtype=F64)
    grad_lse = torch.randn(b, h, n, generator=g, dtype=F64)
    got = run(backend, q, k, v, attn_mask, is_causal, opts, grad_out, grad_lse)
    ref64 = run("reference", q, k, v, attn_mask, is_causal, opts, grad_out, grad_lse, dtype=F64)
    low = None
    if dtype in (F16, BF16):
        low = run("reference", q, k, v, attn_mask, is_causal, opts, grad_out, grad_lse, dtype=dtype)
    for i, (x, r) in enumerate(zip(got, ref64)):
        name = NAMES[i]
        # sinks are float32, and so is their gradient: the float32 rule for float64 inputs.
        rule = F32 if name == "dsinks" and dtype == F64 else dtype
        assert_close_to_reference(x, r, None if low is None else low[i], grad=i >= 2, name=name, dtype=rule)
    return got, ref64


# ----------------------------------------------------------------------------------------------
# the reference against the loop
# ----------------------------------------------------------------------------------------------

LOOP_CASES = [
    # (b, h, hk, n, m, d, dv), is_causal, mask, options
    ((1, 2, 2, 7, 7, 5, 3), False, None, dict(window=(2, 1))),
    ((1, 2, 1, 9, 13, 4, 3), True, None, dict(window=(3, 0))),
    ((2, 2, 2, 8, 5, 4, 4), False, None, dict(window=(0, 0))),  # N > M: the first rows see nothing
    ((1, 2, 2, 6, 9, 3, 2), False, "bool", dict(window=(-1, 2), softcap=1.5)),
    ((1, 2, 2, 7, 7, 4, 3), False, None, dict(softcap=0.7)),
    ((2, 2, 1, 5, 11, 4, 3), False, "float", dict(alibi_slopes="bh")),
    ((1, 4, 2, 6, 6, 3, 5), True, None, dict(alibi_slopes="h", sinks=True)),
    ((1, 2, 2, 7, 4, 4, 4), False, "bool", dict(sinks=True)),  # a fully masked row with a sink
    ((2, 2, 2, 9, 12, 5, 3), True, None, dict(window=(4, 2), softcap=2.0, alibi_slopes="bh", sinks=True)),
    ((1, 2, 2, 5, 8, 4, 4), True, None, dict(window=(0, 1), sinks=True)),  # causal + window: no key at all
]


def split_options(opts, slopes, sink):
    out = {key: val for key, val in opts.items() if key not in ("alibi_slopes", "sinks")}
    if slopes is not None:
        out["alibi_slopes"] = slopes
    if sink is not None:
        out["sinks"] = sink
    return out


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: f"{c[0]}-causal{int(c[1])}-{c[2]}-{'+'.join(c[3])}")
def test_reference_matches_the_loop(case):
    shape, is_causal, mask_kind, opts = case
    q, k, v, mask, slopes, sink = make_inputs(*shape, F64, mask=mask_kind, alibi=opts.get("alibi_slopes"),
                                              sinks=opts.get("sinks", False))
    if is_causal and mask is not None:
        pytest.skip("attn_mask and is_causal do not combine")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    extra = [t.double().requires_grad_() for t in (slopes, sink) if t is not None]
    it = iter(extra)
    slopes64 = next(it) if slopes is not None else None
    sink64 = next(it) if sink is not None else None
    window, softcap = opts.get("window"), opts.get("softcap", 0.0)
    out, lse = softmax_attention_reference(*leaves, mask, 0.0, is_causal, None, shape[1] != shape[2],
                                           return_lse=True, window=window, softcap=softcap,
                                           alibi_slopes=slopes64, sinks=sink64)
    with num_threads(1):
        out_l, lse_l = loop_score_attention(*leaves, mask, is_causal, None, window, softcap, slopes64, sink64)
    assert_close_to_reference(out, out_l, name="out")
    assert_close_to_reference(lse, lse_l, name="lse")
    g = torch.Generator().manual_seed(3)
    go, gl = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g, dtype=F64)
    wanted = leaves + extra
    finite = lambda x: torch.where(torch.isfinite(x), x, torch.zeros_like(x))  # noqa: E731
    got = torch.autograd.grad((out, finite(lse)), wanted, (go, gl))
    want = torch.autograd.grad((out_l, finite(lse_l)), wanted, (go, gl))
    for name, x, r in zip(("dq", "dk", "dv", "d extra", "d extra 2"), got, want):
        assert_close_to_reference(x, r, grad=True, name=name)
    # Each row sees what the window and causality leave it: out 0 / lse -inf (or the sink) there.
    n, m = shape[3], shape[4]
    for i in range(n):
        if not visible_keys(i, n, m, is_causal, window):
            assert (out[:, :, i] == 0).all()
            if sink is None:
                assert (lse[:, :, i] == -math.inf).all()
            else:
                torch.testing.assert_close(lse[:, :, i], sink64.detach().expand(shape[0], -1))


def test_reference_window_semantics_by_hand():
    # N = 3 queries, M = 5 keys: bottom-right alignment puts query 2 at key 4.
    q = torch.zeros(1, 1, 3, 1, dtype=F64)
    k = torch.zeros(1, 1, 5, 1, dtype=F64)
    v = torch.arange(5, dtype=F64).reshape(1, 1, 5, 1)
    out = softmax_attention_reference(q, k, v, window=(0, 0))
    assert out.flatten().tolist() == [2.0, 3.0, 4.0]  # row i sees key i + M - N only
    out = softmax_attention_reference(q, k, v, window=(1, 0))
    assert out.flatten().tolist() == [1.5, 2.5, 3.5]
    out = softmax_attention_reference(q, k, v, window=(0, 0), is_causal=True)  # j = i + 2 and j <= i: none
    assert out.flatten().tolist() == [0.0, 0.0, 0.0]
    out, lse = softmax_attention_reference(q, k, v, window=(0, -1), return_lse=True)
    assert out.flatten().tolist() == [3.0, 3.5, 4.0] and torch.allclose(lse.flatten(), torch.log(torch.tensor([3.0, 2, 1], dtype=F64)))


# ----------------------------------------------------------------------------------------------
# the C++ CPU kernel against the reference
# ----------------------------------------------------------------------------------------------

# (b, h, hk, n, m, d, dv): odd sizes straddling the tiles (64 x 256 forward, 64 x 64 backward),
# N != M, D odd, GQA; N <= 16 takes the decode forward.
SHAPES = {
    "flash": (2, 4, 2, 129, 63, 17, 9),
    "flash-long": (1, 2, 1, 63, 300, 33, 16),
    "decode": (1, 8, 2, 7, 129, 16, 12),
    "square": (1, 2, 2, 129, 129, 16, 16),
    "one-query": (1, 4, 2, 1, 129, 7, 5),
    "one-key": (2, 2, 1, 63, 1, 9, 4),
}
OPTION_SETS = {
    "window": dict(window=(5, 3)),
    "window-zero": dict(window=(0, 0)),
    "window-wide": dict(window=(500, 700)),  # larger than N and M: hides nothing
    "window-left": dict(window=(40, -1)),
    "softcap": dict(softcap=2.5),
    "alibi-h": dict(alibi_slopes="h"),
    "alibi-bh": dict(alibi_slopes="bh"),
    "sinks": dict(sinks=True),
    "all": dict(window=(30, 4), softcap=3.0, alibi_slopes="h", sinks=True),
}


def options_for(opts, slopes, sink):
    return split_options(opts, slopes, sink)


@needs_cpu
@pytest.mark.parametrize("dtype,shape", [(F32, "flash"), (F32, "decode"), (BF16, "flash"), (BF16, "decode"),
                                         (F64, "flash"), (F16, "decode")], ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("option", list(OPTION_SETS))
def test_cpu_kernel_each_option(dtype, shape, option):
    opts = OPTION_SETS[option]
    q, k, v, _, slopes, sink = make_inputs(*SHAPES[shape], dtype, alibi=opts.get("alibi_slopes"),
                                           sinks=opts.get("sinks", False))
    check_against_reference(q, k, v, None, False, options_for(opts, slopes, sink))


@needs_cpu
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("combo", ["causal", "bool", "float"])
@pytest.mark.parametrize("shape", ["flash-long", "decode", "square", "one-query", "one-key"])
def test_cpu_kernel_all_options_with_masks(dtype, combo, shape):
    opts = OPTION_SETS["all"]
    mask_kind = None if combo == "causal" else combo
    q, k, v, mask, slopes, sink = make_inputs(*SHAPES[shape], dtype, mask=mask_kind, alibi="bh", sinks=True)
    check_against_reference(q, k, v, mask, combo == "causal", options_for(opts, slopes, sink))


# ----------------------------------------------------------------------------------------------
# the Triton kernels against the reference (interpreted on CPU tensors without a GPU)
# ----------------------------------------------------------------------------------------------

# (b, h, hk, n, m, d, dv), small for the interpreter: odd sizes that cross the first configs'
# tile edges (dK/dV query tiles of 32, dQ key tiles of 32, forward key tiles of 64), N != M both
# ways, D and Dv odd or unequal, GQA.
TRITON_SHAPES = {
    "tiles": (1, 2, 1, 67, 45, 17, 9),
    "long": (1, 2, 1, 23, 70, 16, 8),
    "square": (1, 2, 2, 65, 65, 16, 16),
    "one-query": (1, 4, 2, 1, 33, 7, 5),
    "one-key": (2, 2, 1, 29, 1, 9, 4),
}
# OPTION_SETS' windows at the scale of TRITON_SHAPES ("all" keeps a band narrower than N and M).
TRITON_OPTION_SETS = {**OPTION_SETS, "window-left": dict(window=(20, -1)),
                      "all": dict(window=(12, 4), softcap=3.0, alibi_slopes="h", sinks=True)}


# float16 on one shape: the interpreter is slow, and the options' code is the same per dtype.
TRITON_OPTION_CASES = [(F32, "tiles"), (F32, "long"), *((dtype, "long") for dtype in TRITON_DTYPES[1:])]


@needs_triton
@pytest.mark.parametrize("dtype,shape", TRITON_OPTION_CASES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("option", list(TRITON_OPTION_SETS))
def test_triton_kernel_each_option(dtype, shape, option):
    opts = TRITON_OPTION_SETS[option]
    q, k, v, _, slopes, sink = make_inputs(*TRITON_SHAPES[shape], dtype, alibi=opts.get("alibi_slopes"),
                                           sinks=opts.get("sinks", False))
    check_against_reference(q, k, v, None, False, options_for(opts, slopes, sink), backend="triton")


@needs_triton
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("combo", ["causal", "bool", "float"])
@pytest.mark.parametrize("shape,sinks", [("long", True), ("square", True), ("one-query", True), ("one-key", True),
                                         ("square", False), ("one-key", False)],
                         ids=lambda x: {True: "sinks", False: "no-sinks"}.get(x, x))
def test_triton_kernel_all_options_with_masks(dtype, combo, shape, sinks):
    # Without sinks the options go straight to the op (its registered autograd); with them
    # through the sink transform around it: both pass the score options forward and backward.
    opts = dict(TRITON_OPTION_SETS["all"], sinks=sinks)
    mask_kind = None if combo == "causal" else combo
    q, k, v, mask, slopes, sink = make_inputs(*TRITON_SHAPES[shape], dtype, mask=mask_kind, alibi="bh", sinks=sinks)
    check_against_reference(q, k, v, mask, combo == "causal", options_for(opts, slopes, sink), backend="triton")


@needs_triton
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("option", ["sinks", "window-softcap", "alibi-bh", "all"])
def test_triton_dropout_with_options(dropout_p, option):
    # With dropout the reference gets the kernel's keep mask, regenerated from the call's seed;
    # the options reach the forward and both backward calls (dO and the lse's probe).
    device = TRITON_DEVICE
    opts = {"window-softcap": dict(window=(3, 2), softcap=2.0), "alibi-bh": dict(alibi_slopes="bh"),
            "sinks": dict(sinks=True), "all": dict(window=(4, 1), softcap=2.0, alibi_slopes="h", sinks=True)}[option]
    b, h, hk, n, m, d = 2, 4, 2, 7, 9, 16
    q, k, v, _, slopes, sink = make_inputs(b, h, hk, n, m, d, d, F32, alibi=opts.get("alibi_slopes"),
                                           sinks=opts.get("sinks", False))
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    kw = options_for(opts, None if slopes is None else slopes.to(device),
                     None if sink is None else sink.to(device).requires_grad_())
    wanted = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(b, h, n, d, generator=g).to(device)
    grad_lse = torch.randn(b, h, n, generator=g).to(device)
    torch.manual_seed(11)
    out, lse = attnkit.softmax_attention(q, k, v, dropout_p=dropout_p, enable_gqa=True, return_lse=True,
                                         backend="triton", **kw)
    got = (out, lse, *torch.autograd.grad((out, lse), wanted, (grad_out, grad_lse)))
    torch.manual_seed(11)  # the same seed: return_lse=False returns the same out
    plain = attnkit.softmax_attention(q, k, v, dropout_p=dropout_p, enable_gqa=True, backend="triton", **kw)
    assert torch.equal(plain, out)
    keep = None
    if dropout_p:
        from attnkit.kernels import softmax as triton_softmax

        torch.manual_seed(11)
        seed = int(torch.randint(2**31 - 1, (), dtype=torch.int64))  # the call's draw (ops.softmax._draw_seed)
        keep = triton_softmax.dropout_keep_mask(b, h, n, m, dropout_p, seed, device)
    leaves = [t.detach().cpu().double().requires_grad_() for t in wanted]
    ref_kw = {name: val.detach().cpu().double() if isinstance(val, torch.Tensor) else val for name, val in kw.items()}
    if "sinks" in kw:
        ref_kw["sinks"] = leaves[3]
    with num_threads(1):
        out_r, lse_r = softmax_attention_reference(*leaves[:3], None, dropout_p, False, None, True, return_lse=True,
                                                   dropout_mask=None if keep is None else keep.cpu(), **ref_kw)
        ref = (out_r, lse_r, *torch.autograd.grad((out_r, lse_r), leaves, (grad_out.cpu().double(),
                                                                           grad_lse.cpu().double())))
    for i, (x, r) in enumerate(zip(got, ref)):
        assert_close_to_reference(x.cpu(), r, grad=i >= 2, name=NAMES[i], dtype=F32)


@pytest.mark.parametrize("backend,dtype", [row("cpu", F32), row("cpu", F64), row("triton", F32), row("triton", F16)],
                         ids=["cpu-float32", "cpu-float64", "triton-float32", "triton-float16"])
@pytest.mark.parametrize("shape,window,causal", [
    ((1, 2, 2, 70, 90, 16, 16), (5, 0), True),     # causal ∩ window (bottom-right, M > N): nothing
    ((1, 2, 1, 20, 7, 8, 8), (0, 0), False),       # N > M: rows below N - M see nothing
    ((1, 2, 2, 9, 3, 8, 8), (1, 1), True),         # N > M, causal
    ((1, 2, 2, 5, 40, 8, 8), (-1, 0), True),       # right bound past causality: causal wins
])
@pytest.mark.parametrize("sinks", [False, True])
def test_kernel_rows_outside_the_window(backend, dtype, shape, window, causal, sinks):
    q, k, v, _, _, sink = make_inputs(*shape, dtype, sinks=sinks)
    got, _ = check_against_reference(q, k, v, None, causal, split_options(dict(window=window), None, sink),
                                     backend=backend)
    n, m = shape[3], shape[4]
    empty = [i for i in range(n) if not visible_keys(i, n, m, causal, window)]
    # Keys that no row sees get exactly zero dk, dv (README: zero gradients) -- every key in the
    # first case, whose key blocks the C++ backward skips.
    seen = set().union(*(visible_keys(i, n, m, causal, window) for i in range(n)))
    unseen = [j for j in range(m) if j not in seen]
    assert (got[3][:, :, unseen] == 0).all() and (got[4][:, :, unseen] == 0).all()
    if empty:
        assert (got[0][:, :, empty] == 0).all() and (got[2][:, :, empty] == 0).all()
        lse = got[1][:, :, empty]
        if sink is None:
            assert (lse == -math.inf).all()
        else:  # lse = the sink, exactly
            assert torch.equal(lse, sink.to(lse.dtype).reshape(1, -1, 1).expand_as(lse))


@needs_cpu
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("opts", [dict(window=(1050, 50)), dict(window=(1060, 0), softcap=4.0, alibi_slopes="h", sinks=True),
                                  dict(softcap=2.0, sinks=True)], ids=["window", "all", "softcap-sinks"])
def test_decode_split_keys(dtype, opts):
    # N <= 16 rows and M >= 1024 keys seen: the decode forward splits the keys over tasks (two
    # here, at 2 threads) and merges them.
    q, k, v, _, slopes, sink = make_inputs(1, 4, 1, 7, 1100, 32, 32, dtype, alibi=opts.get("alibi_slopes"),
                                           sinks=opts.get("sinks", False))
    check_against_reference(q, k, v, None, False, options_for(opts, slopes, sink))


@needs_cpu
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_count_invariance(threads):
    # The backward splits a kv head's key blocks over threads when B * Hk < 4 threads (dq partials).
    with num_threads(threads):
        for shape, dtype in (((1, 2, 1, 129, 200, 16, 16), F32), ((1, 4, 1, 5, 1100, 32, 32), BF16)):
            q, k, v, _, slopes, sink = make_inputs(*shape, dtype, alibi="h", sinks=True)
            check_against_reference(q, k, v, None, True, options_for(OPTION_SETS["all"], slopes, sink))


@pytest.mark.parametrize("backend", [CPU, TRITON])
def test_window_larger_than_the_sequence_is_no_window(backend):
    device = device_of(backend)
    q, k, v = (t.to(device) for t in make_inputs(1, 2, 2, 70, 70, 16, 16, F32)[:3])
    plain = attnkit.softmax_attention(q, k, v, is_causal=True, backend=backend)
    for window in ((70, 70), (10**12, 10**12), (-1, -1), (2**62, -1)):
        wide = attnkit.softmax_attention(q, k, v, is_causal=True, window=window, backend=backend)
        assert torch.equal(plain, wide), window
    # defaults given explicitly take the call without options
    assert torch.equal(plain, attnkit.softmax_attention(q, k, v, is_causal=True, softcap=0.0, window=None,
                                                        alibi_slopes=None, sinks=None, backend=backend))
    assert torch.equal(plain, attnkit.softmax_attention(q, k, v, is_causal=True, softcap=0, backend=backend))


@pytest.mark.parametrize("backend", [CPU, TRITON])
def test_empty_sequences(backend):
    device = device_of(backend)
    for n, m in ((0, 9), (7, 0), (0, 0)):
        q, k, v, _, slopes, sink = make_inputs(1, 2, 2, n, m, 8, 4, F32, alibi="h", sinks=True)
        q, k, v, sinks = (t.to(device).requires_grad_() for t in (q, k, v, sink))
        out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, window=(1, 1), softcap=1.0,
                                             alibi_slopes=slopes.to(device), sinks=sinks, backend=backend)
        assert out.shape == (1, 2, n, 4) and lse.shape == (1, 2, n)
        assert (out == 0).all() and torch.equal(lse, sinks.detach().reshape(1, 2, 1).expand(1, 2, n))
        grads = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v, sinks))
        assert all((g == 0).all() for g in grads[:3])
        assert torch.equal(grads[3].cpu(), torch.full((2,), float(n)))  # d lse / d sink = 1 on each row


@pytest.mark.parametrize("backend,dtype", [row("cpu", F32), row("cpu", BF16), row("triton", F32), row("triton", F16)],
                         ids=["cpu-float32", "cpu-bfloat16", "triton-float32", "triton-float16"])
@pytest.mark.parametrize("poison", ["q nan", "k nan", "k +inf", "q -inf"])
# The interpreter's numpy matmul warns on the 0 · inf products that an infinite q / k entry
# makes (zero rows past the end of a tile, the zero gradient of a capped score); where one
# reaches a result the float64 reference has the same NaN, which the test checks.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_softcap_with_nonfinite_inputs(backend, dtype, poison):
    """README's NaN rules with a cap: a NaN in a query row poisons that row, a NaN in a key the
    rows that see it (window and causality respected); an infinite score is capped to ±softcap,
    so a ±inf input that only makes scores infinite poisons nothing."""
    b, h, hk, n, m, d = 1, 2, 1, 40, 40, 16
    q, k, v, _, _, _ = make_inputs(b, h, hk, n, m, d, d, dtype)
    spec = {"q nan": ("q", (0, 1, 10, 3), math.nan), "k nan": ("k", (0, 0, 12, 5), math.nan),
            "k +inf": ("k", (0, 0, 12, 5), math.inf), "q -inf": ("q", (0, 0, 20, 2), -math.inf)}[poison]
    {"q": q, "k": k}[spec[0]][spec[1]] = spec[2]
    opts = dict(window=(6, 2), softcap=5.0)
    g = torch.Generator().manual_seed(5)
    grad_out = torch.randn(b, h, n, d, generator=g, dtype=F64)
    grad_lse = torch.zeros(b, h, n, dtype=F64)
    got = run(backend, q, k, v, None, True, opts, grad_out, grad_lse)
    ref64 = run("reference", q, k, v, None, True, opts, grad_out, grad_lse, dtype=F64)
    low = run("reference", q, k, v, None, True, opts, grad_out, grad_lse, dtype=dtype) if dtype != F32 else None
    visible = torch.zeros(1, 1, n, m, dtype=torch.bool)
    for i in range(n):
        visible[0, 0, i, visible_keys(i, n, m, True, opts["window"])] = True
    assert_nonfinite_like_reference(got, ref64, low, visible, dtype=dtype)
    nan_rows = torch.isnan(got[0]).any(-1)
    if poison in ("k +inf", "q -inf"):
        assert not nan_rows.any() and torch.isfinite(got[1]).all()  # capped, not poisoned
    elif poison == "q nan":
        assert nan_rows[0, 1, 10] and nan_rows.sum() == 1
    else:  # the rows of both heads that see key 12: i in [12, 18] (window (6, 2), causal)
        rows = [i for i in range(n) if 12 in visible_keys(i, n, m, True, opts["window"])]
        assert nan_rows[0, :, rows].all() and nan_rows.sum() == 2 * len(rows)


@pytest.mark.parametrize("backend,dtype", [row("cpu", F32), row("cpu", BF16), row("triton", F32)],
                         ids=["cpu-float32", "cpu-bfloat16", "triton-float32"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sinks_with_masked_out_rows(backend, dtype, mask_kind):
    """README: a row with no visible key gives 0 and lse = sink -- here rows that the mask hides
    (the kernels compute them: no window skips them) in one head, in both, and every row of the
    second batch element.  Exactly: out 0, lse the sink and dq 0 on those rows, dk = dv = 0 for
    the batch element that sees nothing.  The values, the sink gradient included (each hidden
    row adds exactly its g_lse: p_sink = 1, D = 0), against the float64 reference in float32;
    in bfloat16 that is the fuzz test's, whose tolerance knows a flash backward's rounding.
    Small for the interpreter: one call, forward and backward with out and lse in the loss."""
    b, h, hk, n, m, d = 2, 2, 1, 9, 21, 8  # GQA: both query heads read one kv head
    q, k, v, _, _, sink = make_inputs(b, h, hk, n, m, d, d, dtype, sinks=True, seed=4)
    g = torch.Generator().manual_seed(8)
    hidden = torch.rand(b, h, n, m, generator=g) < 0.25
    hidden[0, :, 2] = True      # in both heads
    hidden[0, 1, 6] = True      # in one head
    hidden[0, 0, 8] = True      # the last row, in the other
    hidden[1] = True            # every row of batch element 1
    rows = hidden.all(-1)       # [B, H, N]
    if mask_kind == "bool":
        mask = ~hidden
    else:
        mask = torch.randn(hidden.shape, generator=g, dtype=F64).masked_fill(hidden, -math.inf).to(dtype)
    opts = dict(sinks=sink)
    if dtype == F32:
        got, _ = check_against_reference(q, k, v, mask, False, opts, backend=backend)
    else:
        got = run(backend, q, k, v, mask, False, opts, torch.randn(b, h, n, d, generator=g, dtype=F64),
                  torch.randn(b, h, n, generator=g, dtype=F64))
    out, lse, dq, dk, dv, dsinks = got
    assert (out[rows] == 0).all() and (dq[rows] == 0).all()
    assert torch.equal(lse[rows], sink.reshape(1, h, 1).expand(b, h, n)[rows])
    assert not dk[1].any() and not dv[1].any()
    assert torch.isfinite(lse).all() and torch.isfinite(dsinks).all()


@pytest.mark.parametrize("backend,dtype", [row("cpu", F32), row("cpu", F64), row("triton", F32)],
                         ids=["cpu-float32", "cpu-float64", "triton-float32"])
def test_lse_only_and_out_only_gradients_with_sinks(backend, dtype):
    q, k, v, _, slopes, sink = make_inputs(1, 4, 2, 33, 47, 8, 8, dtype, alibi="h", sinks=True)
    opts = options_for(OPTION_SETS["all"], slopes, sink)
    for go_scale, gl_scale in ((1.0, 0.0), (0.0, 1.0)):
        g = torch.Generator().manual_seed(7)
        grad_out = torch.randn(1, 4, 33, 8, generator=g, dtype=F64) * go_scale
        grad_lse = torch.randn(1, 4, 33, generator=g, dtype=F64) * gl_scale
        got = run(backend, q, k, v, None, True, opts, grad_out, grad_lse)
        ref = run("reference", q, k, v, None, True, opts, grad_out, grad_lse, dtype=F64)
        for i, (x, r) in enumerate(zip(got, ref)):
            rule = F32 if NAMES[i] == "dsinks" else dtype
            assert_close_to_reference(x, r, grad=i >= 2, name=NAMES[i], dtype=rule)
    # only the sinks want a gradient
    device = device_of(backend)
    s = sink.to(device).requires_grad_()
    out = attnkit.softmax_attention(q.to(device), k.to(device), v.to(device), is_causal=True, window=(30, 4), sinks=s,
                                    enable_gqa=True, backend=backend)
    (ds,) = torch.autograd.grad(out.sum(), s)
    ds = ds.cpu()
    s64 = sink.double().requires_grad_()
    ref = softmax_attention_reference(q.double(), k.double(), v.double(), is_causal=True, window=(30, 4), sinks=s64,
                                      enable_gqa=True)
    (ds64,) = torch.autograd.grad(ref.sum(), s64)
    assert_close_to_reference(ds, ds64, grad=True, name="dsinks", dtype=F32)


@pytest.mark.parametrize("backend", [CPU, TRITON])
def test_leading_dims_and_broadcast_slopes(backend):
    # [B1, B2, H, N, D] with alibi [B1, B2, H]; [H, N, D] with alibi [H]; 2-D with [1].
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 9, 8, generator=g)
    k, v = torch.randn(2, 3, 4, 11, 8, generator=g), torch.randn(2, 3, 4, 11, 5, generator=g)
    slopes, sinks = torch.rand(2, 3, 4, generator=g), torch.randn(4, generator=g)
    device = device_of(backend)

    def call(q, k, v, **kw):  # on the backend's device; the results back on the CPU
        kw = {name: val.to(device) if isinstance(val, torch.Tensor) else val for name, val in kw.items()}
        result = attnkit.softmax_attention(q.to(device), k.to(device), v.to(device), backend=backend, **kw)
        return tuple(t.cpu() for t in result) if isinstance(result, tuple) else result.cpu()

    out, lse = call(q, k, v, return_lse=True, window=(3, 1), alibi_slopes=slopes, sinks=sinks, softcap=2.0)
    ref, ref_lse = softmax_attention_reference(q.double(), k.double(), v.double(), return_lse=True, window=(3, 1),
                                               alibi_slopes=slopes.double(), sinks=sinks.double(), softcap=2.0)
    assert out.shape == (2, 3, 4, 9, 5) and lse.shape == (2, 3, 4, 9)
    assert_close_to_reference(out, ref)
    assert_close_to_reference(lse, ref_lse, dtype=F32)
    out3 = call(q[0, 0], k[0, 0], v[0, 0], window=(3, 1), alibi_slopes=slopes[0, 0])
    ref3 = softmax_attention_reference(q[0, 0].double(), k[0, 0].double(), v[0, 0].double(), window=(3, 1),
                                       alibi_slopes=slopes[0, 0].double())
    assert_close_to_reference(out3, ref3)
    out2 = call(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], alibi_slopes=slopes[0, 0, :1], sinks=sinks[:1])
    ref2 = softmax_attention_reference(q[0, 0, 0].double()[None], k[0, 0, 0].double()[None], v[0, 0, 0].double()[None],
                                       alibi_slopes=slopes[0, 0, :1].double(), sinks=sinks[:1].double())[0]
    assert_close_to_reference(out2, ref2)


# ----------------------------------------------------------------------------------------------
# routing, other backends, compile, double backward
# ----------------------------------------------------------------------------------------------


def test_backend_options_table():
    every = {"window", "softcap", "alibi_slopes", "sinks"}
    assert BACKEND_OPTIONS["reference"] == BACKEND_OPTIONS["cpu"] == BACKEND_OPTIONS["triton"] == every
    assert BACKEND_OPTIONS["cuda"] == {"sinks"}
    q = torch.randn(1, 2, 4, 8)
    options = ScoreOptions(window=(3, 0), softcap=1.0, alibi_slopes=torch.zeros(1, 2), sinks=torch.zeros(2))
    assert options.names == ("window", "softcap", "alibi_slopes", "sinks") and options.in_scores
    sinks_only = ScoreOptions(sinks=torch.zeros(2))
    why = ops_softmax._kernel_limitation("cuda", q, q, q, None, 0.0, options)
    assert why == "the score options window, softcap, alibi_slopes (the cuda kernels run sinks)"
    # cuda with sinks alone: what stops it is the float32 inputs, not the sinks
    assert ops_softmax._kernel_limitation("cuda", q, q, q, None, 0.0, sinks_only).startswith("float32 inputs")
    for backend in ("cpu", "triton"):
        assert ops_softmax._kernel_limitation(backend, q, q, q, None, 0.0, options) == ""
        assert ops_softmax._kernel_limitation(backend, q, q, q, None, 0.0, sinks_only) == ""
    # the Triton kernels' own limits still apply with options
    why = ops_softmax._kernel_limitation("triton", q.double(), q.double(), q.double(), None, 0.0, options)
    assert why.startswith("float64 inputs")


@needs_triton
def test_triton_backend_named_or_from_the_environment_runs_score_options(monkeypatch):
    # Named (backend= or ATTNKIT_BACKEND), the triton backend runs the options rather than
    # refusing them; slopes that require grad are still refused (no slope gradient in a kernel).
    device = TRITON_DEVICE
    q, k, v, _, slopes, sink = make_inputs(1, 2, 2, 7, 9, 16, 16, F32, alibi="h", sinks=True)
    q, k, v, slopes, sink = (t.to(device) for t in (q, k, v, slopes, sink))
    kw = dict(window=(2, 2), softcap=1.5, alibi_slopes=slopes, sinks=sink)
    want = softmax_attention_reference(q.double(), k.double(), v.double(), window=(2, 2), softcap=1.5,
                                       alibi_slopes=slopes.double(), sinks=sink.double())
    assert_close_to_reference(attnkit.softmax_attention(q, k, v, backend="triton", **kw), want)
    monkeypatch.setenv("ATTNKIT_BACKEND", "triton")
    assert_close_to_reference(attnkit.softmax_attention(q, k, v, **kw), want)
    with pytest.raises(BackendUnavailableError, match=r"ATTNKIT_BACKEND='triton'.* alibi_slopes that require grad"):
        attnkit.softmax_attention(q, k, v, alibi_slopes=slopes.clone().requires_grad_())


@needs_triton
def test_opcheck_triton_ops_with_options():
    # The Triton ops with their trailing score options through torch.library's checks (schema,
    # fake, autograd registration, AOT dispatch); without them the same ops are checked in
    # tests/ops/test_softmax_backends.py.
    dev = TRITON_DEVICE
    q, k, v, mask, slopes, _ = make_inputs(2, 2, 1, 7, 9, 16, 8, F32, mask="bool", alibi="h")
    q, k, v = (t.to(dev).requires_grad_() for t in (q, k, v))
    mask, slopes = mask.to(dev), slopes.to(dev).expand(2, 2)  # the layout's [B, H] view, stride 0 over B
    seed = torch.tensor(1234)
    fwd = torch.ops.attnkit.softmax_triton_fwd.default
    bwd = torch.ops.attnkit.softmax_triton_bwd.default
    options = (3, 1, 2.0, slopes)
    torch.library.opcheck(fwd, (q, k, v, None, 0.3, True, 0.0, seed, *options))
    # The rest without test_aot_dispatch_dynamic: interpreted, it costs ~6 s a call, and it
    # checks the fakes, which ignore the options (the first call covers them).
    cheap = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(fwd, (q, k, v, None, 0.3, False, 0.0, seed, -1, 0), test_utils=cheap)  # some defaulted
    torch.library.opcheck(fwd, (q, k, v, mask, 0.3, False, 0.25, seed, *options), test_utils=cheap)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = fwd(qd, kd, vd, mask, 0.3, False, 0.25, seed, *options)
    torch.library.opcheck(bwd, (torch.randn_like(out), qd, kd, vd, out, lse, mask, 0.3, False, 0.25, seed, *options),
                          test_utils=cheap)
    # the defaulted arguments are the op without options, bit for bit
    plain = fwd(qd, kd, vd, mask, 0.3, False, 0.0, seed)
    spelled_out = fwd(qd, kd, vd, mask, 0.3, False, 0.0, seed, -1, -1, 0.0, None)
    assert all(torch.equal(a, b) for a, b in zip(plain, spelled_out))


@needs_cpu
def test_default_routing_of_slopes_that_require_grad(monkeypatch):
    ran = []
    for name in ("reference", "cpu"):
        original = ops_softmax._IMPLEMENTATIONS[name]
        monkeypatch.setitem(ops_softmax._IMPLEMENTATIONS, name,
                            lambda *a, _n=name, _f=original: ran.append(_n) or _f(*a))
    q, k, v, _, slopes, sink = make_inputs(1, 2, 2, 9, 9, 8, 8, F32, alibi="h", sinks=True)
    slopes.requires_grad_()
    out = attnkit.softmax_attention(q, k, v, alibi_slopes=slopes, sinks=sink, window=(2, 2))
    (ds,) = torch.autograd.grad(out.sum(), slopes)
    assert ran == ["reference"] and torch.isfinite(ds).all() and (ds != 0).any()
    with torch.no_grad():
        attnkit.softmax_attention(q, k, v, alibi_slopes=slopes, sinks=sink)
    assert ran == ["reference", "cpu"]
    with pytest.raises(BackendUnavailableError, match="alibi_slopes that require grad"):
        attnkit.softmax_attention(q, k, v, alibi_slopes=slopes, backend="cpu")
    # dropout with options on a CPU tensor: the reference (the C++ kernel has no dropout)
    ran.clear()
    torch.manual_seed(0)
    out = attnkit.softmax_attention(q, k, v, dropout_p=0.3, sinks=sink, window=(1, 1))
    assert ran == ["reference"] and out.shape == q.shape


@pytest.mark.parametrize("backend,dtype", [row("cpu", F64), row("triton", F32)], ids=["cpu-float64", "triton-float32"])
@pytest.mark.parametrize("with_options", [False, True], ids=["plain", "options"])
def test_double_backward_through_some_inputs_only(backend, dtype, with_options):
    # create_graph=True with q alone requiring grad (k, v and the sinks held fixed): the first
    # gradients come from the reference recomputed on the saved inputs, which differentiated k, v
    # and the sinks too and raised "One of the differentiated Tensors does not require grad"
    # (found in session 29).  dq and the second derivative against the reference backend.
    device = device_of(backend)
    q, k, v, _, slopes, sink = make_inputs(1, 2, 1, 6, 8, 4, 4, dtype, alibi="h", sinks=True)
    q, k, v, sink = (t.to(device) for t in (q, k, v, sink))
    q.requires_grad_()
    kw = dict(is_causal=True, window=(3, 1), softcap=2.0, alibi_slopes=slopes.to(device), sinks=sink) if with_options \
        else dict(is_causal=True)
    results = []
    for name in (backend, "reference"):
        out = attnkit.softmax_attention(q, k, v, backend=name, **kw)
        (dq,) = torch.autograd.grad(out.pow(2).sum(), (q,), create_graph=True)
        (second,) = torch.autograd.grad(dq.pow(2).sum(), (q,))
        results.append((dq, second))
    for x, r in zip(*results):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend,dtype", [row("cpu", F64), row("triton", F32)], ids=["cpu-float64", "triton-float32"])
def test_double_backward_with_options(backend, dtype):
    device = device_of(backend)
    q, k, v, _, slopes, sink = make_inputs(1, 2, 1, 6, 8, 4, 4, dtype, alibi="h", sinks=True)
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    sinks = sink.double().float().to(device).requires_grad_()
    kw = dict(is_causal=True, window=(3, 1), softcap=2.0, alibi_slopes=slopes.to(device), sinks=sinks, return_lse=True)
    out, lse = attnkit.softmax_attention(q, k, v, backend=backend, **kw)
    grads = torch.autograd.grad(out.pow(2).sum() + lse.sum(), (q, k, v, sinks), create_graph=True)
    second = torch.autograd.grad(sum(g.sum() for g in grads), (q, k, v))
    out_r, lse_r = attnkit.softmax_attention(q, k, v, backend="reference", **kw)
    grads_r = torch.autograd.grad(out_r.pow(2).sum() + lse_r.sum(), (q, k, v, sinks), create_graph=True)
    second_r = torch.autograd.grad(sum(g.sum() for g in grads_r), (q, k, v))
    for x, r in zip(grads + second, grads_r + second_r):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [CPU, TRITON])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_compile_fullgraph_with_options(backend, sinks):
    # aot_eager: dynamo's full graph and AOTAutograd (fakes, registered autograd) without inductor's
    # code generation (the softmax compile tests run inductor; this keeps the file fast).  Without
    # sinks the graph holds the op with its options; with them, the op and the sink transform.
    torch._dynamo.reset()
    compiled = torch.compile(attnkit.softmax_attention, fullgraph=True, backend="aot_eager")
    device = device_of(backend)
    q, k, v, _, slopes, sink = make_inputs(1, 4, 2, 33, 40, 16, 16, F32, alibi="bh", sinks=True)
    q, k, v, sink = (t.to(device).requires_grad_() for t in (q, k, v, sink))
    wanted = (q, k, v, sink) if sinks else (q, k, v)
    kw = dict(is_causal=True, enable_gqa=True, return_lse=True, window=(5, 2), softcap=3.0,
              alibi_slopes=slopes.to(device), sinks=sink if sinks else None, backend=backend)
    out, lse = compiled(q, k, v, **kw)
    grads = torch.autograd.grad(out.sum() + lse.sum(), wanted)
    out_e, lse_e = attnkit.softmax_attention(q, k, v, **kw)
    grads_e = torch.autograd.grad(out_e.sum() + lse_e.sum(), wanted)
    for x, r in zip((out, lse, *grads), (out_e, lse_e, *grads_e)):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# bad arguments: raised before any kernel runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(window=3), TypeError, r"window must be a pair \(left, right\) of ints >= -1 .*; got 3"),
    (dict(window=(1, 2, 3)), TypeError, r"window must be a pair"),
    (dict(window=(1.5, 2)), TypeError, r"got left = 1.5"),
    (dict(window=(True, 2)), TypeError, r"got left = True"),
    (dict(window=(1, -2)), ValueError, r"window must be a pair .*; got right = -2"),
    (dict(softcap=-1.0), ValueError, r"softcap must be >= 0 \(0 = off\); got -1.0"),
    (dict(softcap=math.inf), TypeError, r"softcap must be a finite real number >= 0 .*; got inf"),
    (dict(softcap=math.nan), TypeError, r"softcap must be a finite real number"),
    (dict(softcap="1"), TypeError, r"softcap must be a finite real number"),
    (dict(softcap=True), TypeError, r"softcap must be a finite real number"),
    (dict(alibi_slopes=[0.5, 0.25]), TypeError, r"alibi_slopes must be a float32 tensor of shape \[H\] = \[2\] or "
                                                r"\[B, H\] = \[3, 2\]; got list"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, r"alibi_slopes must be float32 .*; got float64"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \[H\] = \[2\] or \[B, H\] = \[3, 2\]; "
                                                   r"got \[3\]"),
    (dict(alibi_slopes=torch.ones(1, 2)), ValueError, r"got \[1, 2\]"),
    (dict(alibi_slopes=torch.ones(2, device="meta")), ValueError, r"alibi_slopes must be on the device of query"),
    (dict(sinks=torch.ones(2, 1)), ValueError, r"sinks must have shape \[H\] = \[2\]; got \[2, 1\]"),
    (dict(sinks=torch.ones(2, dtype=torch.bfloat16)), TypeError, r"sinks must be float32 \(cast it with .float\(\)\); "
                                                                 r"got bfloat16"),
    (dict(sinks=torch.ones(2, device="meta")), ValueError, r"sinks must be on the device of query"),
])
def test_bad_arguments(kwargs, exc, match, monkeypatch):
    def boom(*args, **kw):
        raise AssertionError("computation ran before validation")

    for name in list(ops_softmax._IMPLEMENTATIONS):
        monkeypatch.setitem(ops_softmax._IMPLEMENTATIONS, name, boom)
    q = torch.randn(3, 2, 5, 4)
    with pytest.raises(exc, match=f"^{re.escape(OP)}: .*{match}"):
        attnkit.softmax_attention(q, q, q, **kwargs)

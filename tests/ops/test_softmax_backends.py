"""attnkit.softmax_attention on each kernel backend, named explicitly, and the routing rules.

- ``cpu``: the C++ kernels (csrc/cpu/softmax.cpp) through the ops ``attnkit::softmax_fwd`` /
  ``softmax_bwd``; skipped when attnkit._C is not built.
- ``triton``: the Triton kernels through the custom ops ``attnkit::softmax_triton_fwd`` /
  ``_bwd``; without a GPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
  on CPU tensors: small shapes, float32 and float16 (bfloat16 through the op in the ``gpu``
  tests; the kernels' bfloat16 runs interpreted in tests/kernels).
- ``cuda``: the CUDA C++ kernels, ``gpu``-marked tests only.

Everything goes through the public function, gradients by autograd through it (so the
registered autograd formulas are what is tested), against the float64 ``loop_attention`` of
tests/attnkit_testing.py with the tolerance rule of DESIGN.md.  Gradients include the lse's
(``return_lse=True`` and a loss that uses it).
"""
import contextlib
import math
import re

import pytest
import torch

import attnkit
import attnkit.ops.softmax as ops_softmax
from attnkit import BackendUnavailableError
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, assert_close_to_reference, loop_attention, make_mask, make_qkv

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
OP = "attnkit.softmax_attention"
CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"

_STATUS = attnkit.backends()["softmax"]
needs_cpu = pytest.mark.skipif(not _STATUS["cpu"].usable,
                               reason=f"cpu backend unusable: {_STATUS['cpu'].reason}")
needs_triton = pytest.mark.skipif(not _STATUS["triton"].usable,
                                  reason=f"triton backend unusable: {_STATUS['triton'].reason}")


# ----------------------------------------------------------------------------------------------
# one comparison: forward, lse and gradients of the public function on a backend
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def single_thread():
    """Ground truths on one thread: ``loop_attention`` runs thousands of tiny ops, for which
    waking a second OpenMP thread costs more than the op (a lot more on a loaded machine).  The
    kernels under test keep torch's thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_backend(backend, device, b, h, hk, n, m, d, dv, dtype, mask_kind=None, mask_shape=None,
                  scale=None, seed=0, layout="contiguous"):
    """Run ``backend`` and compare out, lse and dq/dk/dv (from a loss on out *and* lse) with the
    float64 ground truth computed from the same rounded inputs.  Returns the output."""
    q, k, v = make_qkv(b, h, hk, n, m, d, dv, seed=seed, dtype=dtype)
    if layout == "strided":
        # [B, N, H, D] storage seen as [B, H, N, D]; every other key; a slice of wider values.
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = torch.cat([k, torch.zeros_like(k)], dim=2).view(b, hk, 2, m, d)[:, :, 0] if m else k
        v = torch.cat([torch.zeros_like(v), v], dim=-1)[..., dv:]
        assert n <= 1 or not q.is_contiguous()
        assert dv == 0 or not v.is_contiguous()
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    mask_dtype = dtype if dtype != F64 else F64
    mask = make_mask(mask_kind, b, h, n, m, seed=seed, shape=mask_shape, dtype=mask_dtype)
    causal = mask_kind == "causal"
    kw = dict(attn_mask=None if mask is None else mask.to(device), is_causal=causal,
              enable_gqa=h != hk, scale=scale)
    out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, backend=backend, **kw)
    assert out.dtype == dtype and out.device == q.device
    assert lse.dtype == (F64 if dtype == F64 else F32)

    q64, k64, v64 = (t.detach().cpu().to(F64).requires_grad_() for t in (q, k, v))
    with single_thread():
        ref, ref_lse = loop_attention(q64, k64, v64, attn_mask=mask, is_causal=causal, scale=scale)
    low = low_lse = low_grads = None
    g = torch.randn(out.shape, dtype=F64)
    g_lse = torch.randn(lse.shape, dtype=F64)

    def loss(o, lse_, gdtype):
        lse_ = torch.where(torch.isfinite(lse_), lse_, 0.0)  # fully masked rows: lse = -inf
        return (o * g.to(gdtype).to(o.device)).sum() + (lse_ * g_lse.to(lse_.dtype).to(o.device)).sum()

    if dtype in (F16, BF16):
        q_lp, k_lp, v_lp = (t.detach().cpu().clone().requires_grad_() for t in (q, k, v))
        kw_cpu = dict(kw, attn_mask=mask)
        with single_thread():
            low, low_lse = softmax_attention_reference(q_lp, k_lp, v_lp, return_lse=True, **kw_cpu)
            low_grads = torch.autograd.grad(loss(low, low_lse, dtype), (q_lp, k_lp, v_lp))
    assert_close_to_reference(out.cpu(), ref, low, name="out")
    assert_close_to_reference(lse.cpu(), ref_lse, low_lse, name="lse", dtype=dtype)
    grads = torch.autograd.grad(loss(out, lse, dtype), (q, k, v))
    with single_thread():
        ref_grads = torch.autograd.grad(loss(ref, ref_lse, F64), (q64, k64, v64))
    for i, (name, got, want) in enumerate(zip("qkv", grads, ref_grads)):
        assert got.shape == want.shape
        assert_close_to_reference(got.cpu(), want, None if low_grads is None else low_grads[i],
                                  grad=True, name=f"grad {name}")
    return out


def spy_backends(monkeypatch):
    """Record which implementation each call of the public function runs."""
    ran = []
    for name, impl in list(ops_softmax._IMPLEMENTATIONS.items()):
        def spy(*args, _impl=impl, _name=name):
            ran.append(_name)
            return _impl(*args)
        monkeypatch.setitem(ops_softmax._IMPLEMENTATIONS, name, spy)
    return ran


# ----------------------------------------------------------------------------------------------
# cpu backend (C++)
# ----------------------------------------------------------------------------------------------

# (b, h, hk, n, m, d, dv, mask_kind, mask_shape): sizes across the kernel's tiles (64 query rows
# x 256 keys forward, 64 x 64 backward), head dims off the 16-column panels, GQA ratios 1, 2, 4,
# masks full and broadcast.
CPU_CASES = [
    (2, 4, 2, 129, 257, 16, 24, None, None),
    (1, 4, 1, 257, 129, 80, 80, "causal", None),
    (2, 2, 2, 7, 300, 96, 33, "bool", (7, 300)),
    (1, 4, 2, 64, 65, 32, 32, "additive", (1, 4, 1, 65)),
    (2, 2, 2, 1, 7, 64, 64, "additive", (2, 1, 1, 7)),
    (1, 2, 2, 1000, 7, 16, 16, "causal", None),
]


@needs_cpu
@pytest.mark.parametrize("dtype", (F64, F32, BF16, F16))
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_cpu_against_float64(case, dtype):
    b, h, hk, n, m, d, dv, mask_kind, mask_shape = CPU_CASES[case]
    if dtype in (BF16, F16) and n * m > 20000:
        n, m = min(n, 129), min(m, 129)  # the low-precision reference runs too; keep it quick
    check_backend("cpu", "cpu", b, h, hk, n, m, d, dv, dtype, mask_kind, mask_shape, seed=case)


@needs_cpu
@pytest.mark.parametrize("dtype", (F64, F32))
def test_cpu_non_contiguous_and_scale(dtype):
    check_backend("cpu", "cpu", 2, 4, 2, 63, 33, 16, 12, dtype, "bool", (63, 33), scale=-0.7,
                  layout="strided")


@needs_cpu
def test_cpu_head_dim_above_triton_limit():
    # The C++ kernel has no head-dim limit.
    check_backend("cpu", "cpu", 1, 1, 1, 7, 9, 300, 260, F32)


# ----------------------------------------------------------------------------------------------
# triton backend (interpreter on CPU tensors without a GPU)
# ----------------------------------------------------------------------------------------------

TRITON_CASES = [
    # b, h, hk, n, m, d, dv, mask_kind, mask_shape, dtype
    (1, 2, 1, 7, 9, 16, 8, "causal", None, F32),
    (2, 2, 2, 1, 7, 16, 16, None, None, F16),
    (1, 4, 2, 64, 33, 32, 24, "bool", (64, 33), F32),
    (2, 2, 2, 33, 64, 16, 16, "additive", (2, 1, 1, 64), F16),
    (1, 2, 2, 129, 65, 80, 48, "causal", None, F32),
    (1, 4, 1, 9, 130, 96, 40, "additive", None, F32),
]


@needs_triton
@pytest.mark.parametrize("case", range(len(TRITON_CASES)))
def test_triton_against_float64(case):
    b, h, hk, n, m, d, dv, mask_kind, mask_shape, dtype = TRITON_CASES[case]
    check_backend("triton", TRITON_DEVICE, b, h, hk, n, m, d, dv, dtype, mask_kind, mask_shape,
                  seed=case)


@needs_triton
def test_triton_non_contiguous_and_scale():
    check_backend("triton", TRITON_DEVICE, 1, 2, 2, 9, 17, 16, 8, F32, "bool", (1, 2, 9, 17),
                  scale=1.3, layout="strided")


def _dropout_readout(backend, device, b, h, n, m, p, seed):
    """The keep mask a dropout call uses, read through the output: q = 0 makes every
    probability 1/M and V = I makes out = the dropped probability matrix."""
    q = torch.zeros(b, h, n, 16, device=device)
    k = torch.randn(b, h, m, 16, device=device)
    v = torch.eye(m, device=device).expand(b, h, m, m)
    torch.manual_seed(seed)
    out = attnkit.softmax_attention(q, k, v, dropout_p=p, backend=backend)
    kept = out > 0
    torch.testing.assert_close(out[kept].cpu(), torch.full_like(out[kept].cpu(), 1 / (m * (1 - p))))
    return kept.cpu()


@needs_triton
def test_triton_dropout_reproducible_and_matches_its_mask():
    b, h, hk, n, m, p = 1, 2, 1, 33, 40, 0.3
    keep = _dropout_readout("triton", TRITON_DEVICE, b, h, n, m, p, seed=7)
    assert torch.equal(keep, _dropout_readout("triton", TRITON_DEVICE, b, h, n, m, p, seed=7))
    other = _dropout_readout("triton", TRITON_DEVICE, b, h, n, m, p, seed=8)
    assert not torch.equal(keep, other)
    # Fraction kept: 1 - p within 6 standard deviations (fixed seeds: deterministic).
    frac = keep.double().mean().item()
    assert abs(frac - (1 - p)) <= 6 * math.sqrt(p * (1 - p) / keep.numel())

    # The same seed on real inputs: the forward and the backward (which regenerates the mask
    # from the saved seed) equal the ground truth with that mask.
    q, k, v = (t.to(TRITON_DEVICE).requires_grad_() for t in make_qkv(b, h, hk, n, m, 16, 8, dtype=F32))
    torch.manual_seed(7)
    out, lse = attnkit.softmax_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True,
                                         return_lse=True, backend="triton")
    q64, k64, v64 = (t.detach().cpu().to(F64).requires_grad_() for t in (q, k, v))
    ref, ref_lse = loop_attention(q64, k64, v64, is_causal=True, keep=keep, dropout_p=p)
    assert_close_to_reference(out.cpu(), ref)
    assert_close_to_reference(lse.cpu(), ref_lse, name="lse")  # the lse is taken before dropout
    g, g_lse = torch.randn(out.shape, dtype=F64), torch.randn(lse.shape, dtype=F64)
    grads = torch.autograd.grad((out * g.float().to(out.device)).sum()
                                + (lse * g_lse.float().to(out.device)).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g).sum() + (ref_lse * g_lse).sum(), (q64, k64, v64))
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close_to_reference(got.cpu(), want, grad=True, name=f"grad {name}")


@needs_triton
def test_triton_double_backward_falls_back_to_the_reference():
    # create_graph=True: the first gradients come from the reference recomputed on the saved
    # inputs (the kernel's backward is not differentiable), with the kernel's dropout mask.
    q, k, v = (t.to(TRITON_DEVICE).requires_grad_() for t in make_qkv(1, 2, 2, 7, 9, 16, 8, dtype=F32))
    g = torch.randn(1, 2, 7, 8, device=TRITON_DEVICE)
    for p in (0.0, 0.4):
        torch.manual_seed(3)
        out = attnkit.softmax_attention(q, k, v, dropout_p=p, is_causal=True, backend="triton")
        first = torch.autograd.grad(out, (q, k, v), g, create_graph=True)
        torch.manual_seed(3)
        out = attnkit.softmax_attention(q, k, v, dropout_p=p, is_causal=True, backend="triton")
        plain = torch.autograd.grad(out, (q, k, v), g)
        for got, want in zip(first, plain):
            assert got.requires_grad
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Second derivative (p = 0) against the float64 ground truth.
    q64, k64, v64 = (t.detach().cpu().to(F64).requires_grad_() for t in (q, k, v))
    out = attnkit.softmax_attention(q, k, v, is_causal=True, backend="triton")
    dq = torch.autograd.grad(out, q, g, create_graph=True)[0]
    second = torch.autograd.grad((dq * dq).sum(), v)[0]
    ref = loop_attention(q64, k64, v64, is_causal=True)[0]
    dq64 = torch.autograd.grad(ref, q64, g.cpu().to(F64), create_graph=True)[0]
    assert_close_to_reference(second.cpu(), torch.autograd.grad((dq64 * dq64).sum(), v64)[0], grad=True)


# ----------------------------------------------------------------------------------------------
# both kernel backends: fully masked rows, empty sequences, gradcheck
# ----------------------------------------------------------------------------------------------


def _kernel_backends():
    params = [pytest.param("cpu", "cpu", marks=needs_cpu),
              pytest.param("triton", TRITON_DEVICE, marks=needs_triton)]
    return pytest.mark.parametrize("backend,device", params)


@_kernel_backends()
@pytest.mark.parametrize("kind", ("bool", "additive"))
def test_fully_masked_rows(backend, device, kind):
    b, h, n, m = 1, 2, 7, 9
    q, k, v = (t.to(device).requires_grad_() for t in make_qkv(b, h, h, n, m, 16, 8, dtype=F32))
    keep = make_mask("bool", b, h, n, m)
    keep[0, 0, 3] = False
    keep[0, 1] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    dead = ~keep.any(-1)
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask.to(device), return_lse=True,
                                         backend=backend)
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    grads = torch.autograd.grad((out * dead[..., None]).sum(), (q, k, v))
    for grad in grads:  # the dead rows alone: no gradient anywhere, and no NaN
        assert torch.equal(grad.cpu(), torch.zeros_like(grad.cpu()))


@_kernel_backends()
@pytest.mark.parametrize("n,m", [(0, 5), (4, 0), (0, 0)])
def test_empty_sequences(backend, device, n, m):
    q, k, v = (t.to(device).requires_grad_() for t in make_qkv(2, 4, 2, n, m, 16, 8, dtype=F32))
    out, lse = attnkit.softmax_attention(q, k, v, enable_gqa=True, is_causal=True, return_lse=True,
                                         backend=backend)
    assert out.shape == (2, 4, n, 8) and lse.shape == (2, 4, n)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    grads = torch.autograd.grad(out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum(), (q, k, v))
    for t, grad in zip((q, k, v), grads):
        assert grad.shape == t.shape and torch.equal(grad, torch.zeros_like(grad))


@needs_cpu
@pytest.mark.parametrize("variant", ("plain", "causal_gqa", "bool_dead_row", "additive_dv"))
def test_cpu_gradcheck(variant):
    # float64 on the C++ kernel: gradcheck of out and lse.  (tests/ops/test_softmax.py runs
    # gradgradcheck on the default CPU backend, i.e. the kernel's double-backward fallback.)
    b, h, hk, n, m, d, dv = 1, 2, 2, 5, 6, 3, 3
    kw = {}
    if variant == "causal_gqa":
        h, kw = 4, dict(is_causal=True, enable_gqa=True)
    if variant == "bool_dead_row":
        mask = make_mask("bool", b, h, n, m)
        mask[0, 1, 2] = False
        kw = dict(attn_mask=mask)
    if variant == "additive_dv":
        dv, kw = 4, dict(attn_mask=make_mask("additive", b, h, n, m, shape=(n, m)))
    inputs = make_qkv(b, h, hk, n, m, d, dv, requires_grad=True)

    def fn(q, k, v):
        out, lse = attnkit.softmax_attention(q, k, v, return_lse=True, backend="cpu", **kw)
        return out, torch.where(torch.isfinite(lse), lse, 0.0)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------
# opcheck and torch.compile
# ----------------------------------------------------------------------------------------------


@needs_cpu
def test_opcheck_cpu_ops():
    q, k, v = make_qkv(1, 4, 2, 7, 9, 16, 8, dtype=F32, requires_grad=True)
    bool_mask = make_mask("bool", 1, 1, 7, 9).expand(1, 4, 7, 9)
    add_mask = make_mask("additive", 1, 4, 7, 9, dtype=F32)
    fwd, bwd = torch.ops.attnkit.softmax_fwd.default, torch.ops.attnkit.softmax_bwd.default
    for mask, causal in ((None, True), (bool_mask, False), (add_mask, False)):
        torch.library.opcheck(fwd, (q, k, v, mask, 0.3, causal))
    torch.library.opcheck(fwd, tuple(t.detach().double() for t in (q, k, v)) + (None, 0.25, False))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = fwd(qd, kd, vd, bool_mask, 0.3, False)
    torch.library.opcheck(bwd, (torch.randn_like(out), qd, kd, vd, out, lse, bool_mask, 0.3, False))


@needs_triton
def test_opcheck_triton_ops():
    dev = TRITON_DEVICE
    q, k, v = (t.to(dev).requires_grad_() for t in make_qkv(1, 2, 1, 7, 9, 16, 8, dtype=F32))
    mask = make_mask("bool", 1, 1, 7, 9).expand(1, 2, 7, 9).to(dev)
    seed = torch.tensor(1234)
    fwd = torch.ops.attnkit.softmax_triton_fwd.default
    bwd = torch.ops.attnkit.softmax_triton_bwd.default
    torch.library.opcheck(fwd, (q, k, v, None, 0.3, True, 0.0, seed))
    torch.library.opcheck(fwd, (q, k, v, mask, 0.3, False, 0.25, seed),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = fwd(qd, kd, vd, mask, 0.3, False, 0.25, seed)
    torch.library.opcheck(bwd, (torch.randn_like(out), qd, kd, vd, out, lse, mask, 0.3, False, 0.25, seed))


@needs_triton
def test_triton_eager_calls_skip_the_dispatcher_and_match_the_op(monkeypatch):
    # Eager calls on plain tensors reach the launchers directly (torch.library's dispatch of the
    # Python op was ~77 us of a ~120 us call): same kernels, so bit for bit the op's results,
    # forward and backward; fake tensors (a graph being traced) still take the op.
    import attnkit.ops.softmax as ops_softmax
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = TRITON_DEVICE
    q, k, v = (t.to(dev).requires_grad_() for t in make_qkv(1, 2, 1, 7, 9, 16, 8, dtype=F32))
    g = torch.randn(1, 2, 7, 8, device=dev)
    out_op, lse_op = torch.ops.attnkit.softmax_triton_fwd(q, k, v, None, 0.3, True, 0.0, torch.tensor(0))
    want = torch.autograd.grad((out_op * g).sum() + lse_op.sum(), (q, k, v))

    def dispatched(*args, **kwargs):
        raise AssertionError("an eager call went through the dispatcher")

    real_fwd = ops_softmax._TRITON_FWD_DISPATCHED
    monkeypatch.setattr(ops_softmax, "_TRITON_FWD_DISPATCHED", dispatched)
    monkeypatch.setattr(ops_softmax, "_TRITON_BWD_DISPATCHED", dispatched)
    out, lse = attnkit.softmax_attention(q, k, v, scale=0.3, is_causal=True, enable_gqa=True,
                                         return_lse=True, backend="triton")
    got = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))
    for a, b in zip((out, lse, *got), (out_op, lse_op, *want)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    monkeypatch.setattr(ops_softmax, "_TRITON_FWD_DISPATCHED", real_fwd)
    plain, seed = [t.detach() for t in (q, k, v)], torch.tensor(0)
    mode = FakeTensorMode()
    fq, fk, fv, fseed = (mode.from_tensor(t) for t in (*plain, seed))
    with mode:
        fout, flse = ops_softmax._TRITON_FWD_OP(fq, fk, fv, None, 0.3, True, 0.0, fseed)
    assert tuple(fout.shape) == (1, 2, 7, 8) and tuple(flse.shape) == (1, 2, 7)
    # torch.func's wrappers are of type Tensor too: they must take the op as well.
    seen = []

    def probe(qq):
        seen.append(ops_softmax._plain_eager(qq, plain[1], plain[2]))
        return qq.sum()

    torch.func.grad(probe)(plain[0])
    assert seen == [False] and ops_softmax._plain_eager(*plain)


def _check_compiled_matches(backend, device):
    # Dynamo's cache of softmax_attention's frame is shared by every test that compiles it, and
    # stops recompiling past torch._dynamo.config.recompile_limit entries: start afresh.
    torch._dynamo.reset()
    compiled = torch.compile(attnkit.softmax_attention, fullgraph=True)
    q, k, v = (t.to(device).requires_grad_() for t in make_qkv(1, 4, 2, 7, 9, 16, 8, dtype=F32))
    q64, k64, v64 = (t.detach().cpu().to(F64).requires_grad_() for t in (q, k, v))
    g = torch.randn(1, 4, 7, 8, dtype=F64)
    # 1) causal + GQA + lse used in the loss
    out, lse = compiled(q, k, v, is_causal=True, enable_gqa=True, return_lse=True, backend=backend)
    ref, ref_lse = loop_attention(q64, k64, v64, is_causal=True)
    assert_close_to_reference(out.cpu(), ref)
    assert_close_to_reference(lse.cpu(), ref_lse, name="lse")
    grads = torch.autograd.grad((out * g.float().to(device)).sum() + lse.sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), (q64, k64, v64))
    for name, got, want in zip("qkv", grads, ref_grads):
        assert_close_to_reference(got.cpu(), want, grad=True, name=f"grad {name}")
    # 2) a broadcast bool mask, no lse, a second scale (may be traced symbolically)
    mask = make_mask("bool", 1, 1, 7, 9, shape=(7, 9))
    for scale in (0.3, 0.5):
        out = compiled(q, k, v, attn_mask=mask.to(device), scale=scale, enable_gqa=True, backend=backend)
        ref = loop_attention(q64, k64, v64, attn_mask=mask, scale=scale)[0]
        assert_close_to_reference(out.cpu(), ref)
        grads = torch.autograd.grad(out, (q, k, v), g.float().to(device))
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g)
        for name, got, want in zip("qkv", grads, ref_grads):
            assert_close_to_reference(got.cpu(), want, grad=True, name=f"grad {name}")


@needs_cpu
def test_compile_fullgraph_cpu():
    _check_compiled_matches("cpu", "cpu")


@needs_triton
def test_compile_fullgraph_triton():
    _check_compiled_matches("triton", TRITON_DEVICE)


# ----------------------------------------------------------------------------------------------
# routing
# ----------------------------------------------------------------------------------------------


def _qkv(dtype=F32, d=16, dv=8, device="cpu"):
    return [t.to(device) for t in make_qkv(1, 2, 2, 5, 6, d, dv, dtype=dtype)]


@needs_cpu
@pytest.mark.parametrize("changes,expected", [
    (dict(), "cpu"),
    (dict(dtype=F64), "cpu"),
    (dict(dtype=BF16, d=300, dv=300), "cpu"),
    (dict(attn_mask="bool"), "cpu"),
    (dict(attn_mask="additive"), "cpu"),
    (dict(dropout_p=0.2), "reference"),
    (dict(attn_mask="additive_grad"), "reference"),
    (dict(attn_mask="additive_grad", no_grad=True), "cpu"),
])
def test_default_routing_on_cpu_tensors(monkeypatch, changes, expected):
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    ran = spy_backends(monkeypatch)
    changes = dict(changes)
    q, k, v = _qkv(changes.pop("dtype", F32), changes.pop("d", 16), changes.pop("dv", 8))
    mask = changes.pop("attn_mask", None)
    if mask is not None:
        kind = "bool" if mask == "bool" else "additive"
        mask_t = make_mask(kind, 1, 2, 5, 6, dtype=q.dtype)
        if mask == "additive_grad":
            mask_t.requires_grad_()
        changes["attn_mask"] = mask_t
    if changes.pop("no_grad", False):
        with torch.no_grad():
            out = attnkit.softmax_attention(q, k, v, **changes)
    else:
        out = attnkit.softmax_attention(q, k, v, **changes)
    assert ran == [expected]
    assert out.shape == (1, 2, 5, v.shape[-1])


@pytest.mark.parametrize("backend,changes,match", [
    pytest.param("cpu", dict(dropout_p=0.2), r"cannot run dropout_p > 0 \(got 0.2; the C\+\+ CPU kernel has "
                 r"no dropout\)", marks=needs_cpu),
    pytest.param("cpu", dict(attn_mask="additive_grad"), "cannot run a floating attn_mask that requires grad",
                 marks=needs_cpu),
    pytest.param("triton", dict(dtype=F64), r"cannot run float64 inputs \(the Triton kernels take float16, "
                 "bfloat16 and float32\\)", marks=needs_triton),
    pytest.param("triton", dict(d=300), r"cannot run head dims D = 300, Dv = 8 \(the Triton kernels take "
                 r"head dims 1..256\)", marks=needs_triton),
    pytest.param("triton", dict(dv=257), "cannot run head dims D = 16, Dv = 257", marks=needs_triton),
    pytest.param("triton", dict(attn_mask="additive_grad"), "cannot run a floating attn_mask that requires grad", marks=needs_triton),
])
def test_named_backend_limitations_raise(backend, changes, match):
    changes = dict(changes)
    q, k, v = _qkv(changes.pop("dtype", F32), changes.pop("d", 16), changes.pop("dv", 8),
                   device="cpu" if backend == "cpu" else TRITON_DEVICE)
    if changes.pop("attn_mask", None):
        changes["attn_mask"] = make_mask("additive", 1, 2, 5, 6, dtype=q.dtype).to(q.device).requires_grad_()
    prefix = f"{re.escape(OP)}: the {backend} backend \\(backend='{backend}'\\) "
    with pytest.raises(BackendUnavailableError, match=f"^{prefix}{match}.*; use backend='reference'"):
        attnkit.softmax_attention(q, k, v, backend=backend, **changes)


@needs_cpu
def test_backend_from_environment_is_named_too(monkeypatch):
    # ATTNKIT_BACKEND names a backend like backend= does: never silently replaced.
    monkeypatch.setenv("ATTNKIT_BACKEND", "cpu")
    q, k, v = _qkv()
    with pytest.raises(BackendUnavailableError, match=r"the cpu backend \(ATTNKIT_BACKEND='cpu'\) cannot run dropout"):
        attnkit.softmax_attention(q, k, v, dropout_p=0.1)
    ran = spy_backends(monkeypatch)
    attnkit.softmax_attention(q, k, v)
    assert ran == ["cpu"]


def test_kernel_limitation_rules():
    # The routing table itself, for every backend (cuda included: its rules must hold on a
    # machine without a GPU too).  CPU tensors stand in for the devices.
    limit = ops_softmax._kernel_limitation
    q, k, v = _qkv(F16, d=64, dv=64)
    assert limit("cuda", q, k, v, None, 0.0) == ""
    assert "float32 inputs" in limit("cuda", *_qkv(F32, d=64, dv=64), None, 0.0)
    assert "D = 80, Dv = 80" in limit("cuda", *_qkv(F16, d=80, dv=80), None, 0.0)
    assert "D = 64, Dv = 32" in limit("cuda", *_qkv(BF16, d=64, dv=32), None, 0.0)
    assert "dropout_p > 0" in limit("cuda", q, k, v, None, 0.1)
    assert limit("triton", q, k, v, None, 0.1) == ""
    assert limit("triton", *_qkv(F32, d=256, dv=256), None, 0.0) == ""
    assert "head dims" in limit("triton", *_qkv(F32, d=16, dv=0), None, 0.0)
    assert limit("cpu", *_qkv(F64, d=300, dv=1), None, 0.0) == ""
    assert limit("reference", *_qkv(F64, d=300), torch.zeros(5, 6, requires_grad=True), 0.5) == ""
    bias = torch.zeros(5, 6, dtype=F16, requires_grad=True)
    for backend in ("cpu", "triton", "cuda"):
        assert "requires grad" in limit(backend, q, k, v, bias, 0.0)
        assert limit(backend, q, k, v, bias.detach(), 0.0) == ""
        with torch.no_grad():
            assert "requires grad" not in limit(backend, q, k, v, bias, 0.0)


def test_cuda_backend_on_cpu_tensors_raises():
    with pytest.raises(BackendUnavailableError, match=f"^{re.escape(OP)}: .*(cuda|CUDA)"):
        attnkit.softmax_attention(*_qkv(), backend="cuda")


@needs_cpu
def test_default_routes_dropout_to_the_reference_reproducibly():
    # backend=None with dropout on a CPU tensor: the reference, whose mask comes from
    # torch.rand -- the same call under the same seed gives the same result.
    q, k, v = _qkv()
    torch.manual_seed(5)
    a = attnkit.softmax_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(5)
    b = attnkit.softmax_attention(q, k, v, dropout_p=0.3, backend="reference")
    assert torch.equal(a, b)


@needs_cpu
def test_mask_requiring_grad_gets_its_gradient_by_default():
    q, k, v = make_qkv(1, 2, 2, 5, 6, 16, 8, requires_grad=True)
    bias = make_mask("additive", 1, 2, 5, 6, shape=(5, 6)).requires_grad_()
    out = attnkit.softmax_attention(q, k, v, attn_mask=bias)
    got = torch.autograd.grad(out.sum(), bias)[0]
    ref = loop_attention(q, k, v, attn_mask=bias)[0]
    assert_close_to_reference(got, torch.autograd.grad(ref.sum(), bias)[0], grad=True)


# ----------------------------------------------------------------------------------------------
# GPU (run with `pytest -m gpu` where CUDA is present)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (F32, F16, BF16))
@pytest.mark.parametrize("n,m,d,mask_kind,ratio", [(1000, 257, 128, "causal", 4), (129, 1000, 80, "bool", 2),
                                                    (257, 129, 256, "additive", 1)])
def test_triton_on_cuda(dtype, n, m, d, mask_kind, ratio):
    check_backend("triton", "cuda", 2, 4, 4 // ratio, n, m, d, d, dtype, mask_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (F16, BF16))
@pytest.mark.parametrize("d,mask_kind,ratio", [(64, "causal", 2), (128, None, 1), (64, "additive", 4),
                                               (128, "bool", 1)])
def test_cuda_backend_on_cuda(dtype, d, mask_kind, ratio):
    if not _STATUS["cuda"].usable:
        pytest.skip(f"cuda backend unusable: {_STATUS['cuda'].reason}")
    check_backend("cuda", "cuda", 2, 4, 4 // ratio, 257, 129, d, d, dtype, mask_kind)


@pytest.mark.gpu
def test_default_routing_on_cuda_tensors(monkeypatch):
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    ran = spy_backends(monkeypatch)
    attnkit.softmax_attention(*_qkv(F32, device="cuda"))
    attnkit.softmax_attention(*_qkv(F32, device="cuda"), dropout_p=0.1)
    attnkit.softmax_attention(*_qkv(F64, device="cuda"))
    attnkit.softmax_attention(*_qkv(F16, d=300, device="cuda"))
    assert ran == ["triton", "triton", "reference", "reference"]


# ----------------------------------------------------------------------------------------------
# triton: decoding calls go to the split-KV kernel (attnkit.kernels.decode)
# ----------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
@pytest.mark.parametrize("b, h, hk, n, m, d, dv, causal", [
    (2, 4, 2, 1, 37, 16, 24, False),   # one query, GQA, Dv != D
    (1, 3, 1, 5, 130, 32, 32, False),  # MQA, M past two key tiles
    (2, 2, 2, 7, 7, 8, 8, True),       # causal with N == M: top-left is bottom-right
    (1, 2, 1, 16, 1, 8, 8, False),     # 16 rows, one key
], ids=["n1-gqa", "n5-mqa", "n7-causal-square", "n16-m1"])
def test_triton_decoding_calls_take_the_decode_kernel(monkeypatch, dtype, b, h, hk, n, m, d, dv, causal):
    from attnkit.kernels import decode

    calls = []
    real = decode.softmax_decode_fwd
    monkeypatch.setattr(decode, "softmax_decode_fwd", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    gen = torch.Generator().manual_seed(n * 100 + m)
    q = torch.randn(b, h, n, d, generator=gen).to(TRITON_DEVICE, dtype)
    k = torch.randn(b, hk, m, d, generator=gen).to(TRITON_DEVICE, dtype)
    v = torch.randn(b, hk, m, dv, generator=gen).to(TRITON_DEVICE, dtype)
    out, lse = attnkit.softmax_attention(q, k, v, is_causal=causal, enable_gqa=hk != h, return_lse=True,
                                         backend="triton")
    assert len(calls) == 1 and calls[0]["is_causal"] == causal
    g = h // hk
    ref, ref_lse = softmax_attention_reference(q.double(), k.double().repeat_interleave(g, 1),
                                               v.double().repeat_interleave(g, 1), None, 0.0, causal, None,
                                               False, return_lse=True)
    low = None
    if dtype != F32:
        low = softmax_attention_reference(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, 0.0,
                                          causal, None, False)
    assert_close_to_reference(out, ref, low, dtype=dtype)
    # the lse is float32 from exact products of the inputs (float16 values are exact in float64)
    assert_close_to_reference(lse, ref_lse, None, dtype=F32)


@needs_triton
def test_triton_calls_the_decode_kernel_cannot_serve_keep_the_flash_kernel(monkeypatch):
    from attnkit.kernels import decode

    calls = []
    monkeypatch.setattr(decode, "softmax_decode_fwd", lambda *a, **kw: calls.append(1))
    q = torch.randn(1, 2, 3, 8, device=TRITON_DEVICE)
    k = torch.randn(1, 2, 9, 8, device=TRITON_DEVICE)
    v = torch.randn(1, 2, 9, 8, device=TRITON_DEVICE)
    grad_q = q.clone().requires_grad_()
    attnkit.softmax_attention(grad_q, k, v, backend="triton").sum().backward()  # a gradient
    attnkit.softmax_attention(q, k, v, is_causal=True, backend="triton")  # top-left causal, N < M
    attnkit.softmax_attention(q, k, v, attn_mask=torch.ones(3, 9, dtype=torch.bool, device=TRITON_DEVICE),
                              backend="triton")  # a mask
    attnkit.softmax_attention(torch.randn(1, 2, 17, 8, device=TRITON_DEVICE), k, v, backend="triton")  # 17 rows
    sinks = torch.zeros(2, device=TRITON_DEVICE, requires_grad=True)
    attnkit.softmax_attention(q, k, v, sinks=sinks, backend="triton")  # a gradient for the sinks
    assert calls == []


@needs_triton
@pytest.mark.parametrize("n, causal", [(1, False), (4, False), (6, True)])
def test_triton_decoding_calls_take_the_decode_kernel_with_score_options(monkeypatch, n, causal):
    # Window, softcap, ALiBi [H] and sinks go into the decode kernel with the call (its window and
    # ALiBi are bottom-right, as softmax_attention's; causal only where N == M): against float64.
    from attnkit.kernels import decode

    calls = []
    real = decode.softmax_decode_fwd
    monkeypatch.setattr(decode, "softmax_decode_fwd", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    gen = torch.Generator().manual_seed(40 + n)
    m = n if causal else 90
    q = torch.randn(2, 4, n, 16, generator=gen).to(TRITON_DEVICE)
    k, v = (torch.randn(2, 2, m, 16, generator=gen).to(TRITON_DEVICE) for _ in range(2))
    options = dict(window=(20, 1), softcap=4.0, alibi_slopes=torch.rand(4, generator=gen).to(TRITON_DEVICE),
                   sinks=torch.randn(4, generator=gen).to(TRITON_DEVICE))
    out, lse = attnkit.softmax_attention(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True,
                                         backend="triton", **options)
    assert len(calls) == 1 and calls[0]["sinks"] is options["sinks"] and calls[0]["softcap"] == 4.0
    ref, ref_lse = softmax_attention_reference(q.double(), k.double(), v.double(), is_causal=causal,
                                               enable_gqa=True, return_lse=True,
                                               **{name: x.double() if torch.is_tensor(x) else x
                                                  for name, x in options.items()})
    assert_close_to_reference(out, ref, None, dtype=F32)
    assert_close_to_reference(lse, ref_lse, None, dtype=F32)

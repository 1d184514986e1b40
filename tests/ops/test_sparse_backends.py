"""attnkit.sparse_attention on its kernel backends, end to end (decomposition + kernels + merge),
forward and gradients, against the float64 reference of softmax attention under pattern.mask(n).

The matrix of issue 4: n in {1, 33, 300, 1025} (not multiples of the strides), causal and not,
strides 1..64, summary 1..stride, radius 1..3, cyclic or not, relay at 0 and in the middle,
float32 / bfloat16, and block layouts.  ``cpu`` runs the whole matrix; ``triton`` runs under the
interpreter in CI (TRITON_INTERPRET=1, tests/conftest.py) on a smaller one (n <= 100: the
interpreter runs a tile step in milliseconds), float32 / float16 (bfloat16 Triton through the
op runs under ``pytest -m gpu``; the kernels' bfloat16 runs interpreted in tests/kernels).
"""
import pytest
import torch

import attnkit
from attnkit import patterns
from attnkit._dispatch import backend_status
from attnkit.ops import sparse as ops
from attnkit.reference.sparse import sparse_attention_reference
from attnkit_testing import F64, assert_close_to_reference

NS = [1, 33, 300, 1025]


def _usable(backend, device="cpu"):
    status = backend_status(backend)
    if not status.usable:
        pytest.skip(f"{backend} backend not usable here: {status.reason}")
    if backend in ("cpu", "cuda") and not ops._NATIVE_KERNELS[backend]:
        pytest.fail(f"attnkit._C was built without the {backend} sparse kernels")


def _check(backend, p, n, dtype=torch.float32, b=1, h=2, d=16, dv=12, device="cpu", grads=True):
    gen = torch.Generator().manual_seed(n * 7 + d)
    q64, k64, v64 = (torch.randn(b, h, n, x, generator=gen, dtype=F64) for x in (d, d, dv))
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_(grads) for t in (q64, k64, v64))
    q64, k64, v64 = (t.detach().to(F64).cpu().requires_grad_(grads) for t in (q, k, v))
    out = attnkit.sparse_attention(q, k, v, p, backend=backend)
    ref = sparse_attention_reference(q64, k64, v64, p)
    low = None
    if dtype in (torch.float16, torch.bfloat16):
        ql, kl, vl = (t.detach().cpu().requires_grad_(grads) for t in (q, k, v))
        low = sparse_attention_reference(ql, kl, vl, p)
    assert_close_to_reference(out.cpu(), ref, None if low is None else low.detach(), name="out")
    if not grads:
        return
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), g.to(device=device, dtype=dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), g)
    lows = (None,) * 3 if low is None else torch.autograd.grad(low, (ql, kl, vl), g.to(dtype))
    for name, x, w, lo in zip(("dq", "dk", "dv"), got, want, lows):
        if lo is None and not w.any():
            # Exactly zero by cancellation (a row with one key: softmax has no gradient there):
            # the relative rule has nothing to scale with; bound the rounding of the cancelling
            # terms dS = P (dO.v - dO.o) by the magnitudes that enter it.
            bound = 1e-5 * g.abs().max() * v64.abs().max() * max(k64.abs().max(), q64.abs().max())
            assert x.abs().max() <= bound, f"{name}: {x.abs().max():.3e} where the gradient is exactly 0"
            continue
        assert_close_to_reference(x.cpu(), w, lo, grad=True, name=name)


def _strided_cases():
    for n in NS:
        for s in (1, 2, 7, 64):
            for causal in (True, False):
                yield patterns.strided(s, causal), n


def _fixed_cases():
    for n in NS:
        for l, c in ((1, 1), (4, 1), (7, 7), (16, 3), (64, 8)):
            for causal in (True, False):
                yield patterns.fixed(l, c, causal), n


def _star_cases():
    for n in NS:
        for relay in sorted({0, n // 2}):
            for radius in (1, 3):
                for cyclic in (False, True):
                    for causal in (False, True):
                        yield patterns.star(relay, radius, cyclic, causal), n


def _layout_cases():
    g = torch.Generator().manual_seed(3)
    for block, nb, heads, causal in ((16, 5, 1, False), (16, 4, 2, True), (24, 3, 2, False), (9, 7, 1, True),
                                     (64, 2, 2, False)):
        lay = torch.rand(heads, nb, nb, generator=g) < 0.5
        lay[:, min(1, nb - 1)] = False  # a query block with nothing to attend
        yield patterns.block_layout(lay, block, causal), nb * block


def _ids(cases):
    return [f"{p!r}-N{n}" for p, n in cases]


CPU_CASES = list(_strided_cases()) + list(_fixed_cases()) + list(_star_cases()) + list(_layout_cases())


@pytest.mark.parametrize("p, n", CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_float32(p, n):
    _usable("cpu")
    _check("cpu", p, n)


BF16_CASES = [(patterns.strided(64), 1025), (patterns.strided(7, False), 300), (patterns.fixed(64, 8), 1025),
              (patterns.fixed(16, 3, False), 300), (patterns.star(150, 2, True), 300),
              (patterns.star(0, 1, causal=True), 33), *list(_layout_cases())[:2]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=["bf16", "f64"])
@pytest.mark.parametrize("p, n", BF16_CASES, ids=_ids(BF16_CASES))
def test_cpu_other_dtypes(p, n, dtype):
    _usable("cpu")
    _check("cpu", p, n, dtype=dtype)


TRITON_CASES = [
    (patterns.strided(1), 33), (patterns.strided(7), 33), (patterns.strided(7, False), 40),
    (patterns.strided(16), 100), (patterns.fixed(4, 1), 33), (patterns.fixed(7, 7, False), 33),
    (patterns.fixed(16, 3), 70), (patterns.star(0, 1), 33), (patterns.star(16, 3, True, True), 33),
    (patterns.star(10, 2, True, False), 20), (patterns.strided(3), 1),
    *[(p, n) for p, n in _layout_cases() if n <= 100],
]


@pytest.mark.parametrize("p, n", TRITON_CASES, ids=_ids(TRITON_CASES))
def test_triton(p, n):
    _usable("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check("triton", p, n, device=device)


@pytest.mark.parametrize("p, n", TRITON_CASES[:3], ids=_ids(TRITON_CASES[:3]))
def test_triton_float16(p, n):
    _usable("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check("triton", p, n, dtype=torch.float16, device=device)


GPU_CASES = [(patterns.strided(64), 4100), (patterns.fixed(64, 8), 2049), (patterns.star(1000, 1), 2049),
             (patterns.strided(128, False), 1025)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p, n", GPU_CASES, ids=_ids(GPU_CASES))
def test_gpu(p, n, dtype, backend):
    _usable(backend)
    _check(backend, p, n, dtype=dtype, d=64, dv=64, device="cuda")


def test_rows_with_nothing_to_attend_are_zero_with_zero_grads():
    _usable("cpu")
    lay = torch.zeros(1, 3, 3, dtype=torch.bool)
    lay[0, 0, 0] = lay[0, 2, 1] = True
    q, k, v = (torch.randn(1, 1, 48, 8, requires_grad=True) for _ in range(3))
    out = attnkit.sparse_attention(q, k, v, patterns.block_layout(lay, 16), backend="cpu")
    assert torch.equal(out[0, 0, 16:32], torch.zeros(16, 8))
    out.sum().backward()
    assert torch.equal(q.grad[0, 0, 16:32], torch.zeros(16, 8))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_opcheck(backend):
    _usable(backend)
    fwd = {"cpu": torch.ops.attnkit.sparse_range_fwd, "triton": torch.ops.attnkit.sparse_range_triton_fwd}[backend]
    bfwd = {"cpu": torch.ops.attnkit.block_sparse_fwd, "triton": torch.ops.attnkit.block_sparse_triton_fwd}[backend]
    q, k, v = (torch.randn(1, 2, 21, 16, requires_grad=True) for _ in range(3))
    for view, lo, hi in ops.strided_parts(21, 4, False):
        torch.library.opcheck(fwd, (q, k, v, list(view), list(lo), list(hi), 0.3))
    lay = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.6
    rp, ci, _, _ = patterns.block_layout(lay, 16, True).index_lists()
    q, k, v = (torch.randn(1, 2, 48, 16, requires_grad=True) for _ in range(3))
    torch.library.opcheck(bfwd, (q, k, v, rp, ci, 16, True, 0.3))


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_compile_fullgraph_with_backward(backend):
    _usable(backend)
    torch._dynamo.reset()
    p = patterns.fixed(8, 2)
    fn = torch.compile(lambda q, k, v: attnkit.sparse_attention(q, k, v, p, backend=backend), fullgraph=True,
                       backend="aot_eager")
    q, k, v = (torch.randn(1, 2, 37, 16, dtype=F64).float().requires_grad_() for _ in range(3))
    out = fn(q, k, v)
    ref = sparse_attention_reference(*(t.detach().double().requires_grad_() for t in (q, k, v)), p)
    assert_close_to_reference(out, ref.detach())
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_double_backward_runs_through_the_reference():
    _usable("cpu")
    q, k, v = (torch.randn(1, 1, 20, 4, dtype=F64, requires_grad=True) for _ in range(3))
    p = patterns.strided(3)
    assert torch.autograd.gradgradcheck(lambda a, b, c: attnkit.sparse_attention(a, b, c, p, backend="cpu"),
                                        (q, k, v))


def test_double_backward_through_q_alone():
    # k and v held fixed: the reference recomputed for the first gradients differentiated them
    # too and raised "One of the differentiated Tensors does not require grad" (session 29).
    _usable("cpu")
    q = torch.randn(1, 1, 20, 4, dtype=F64, requires_grad=True)
    k, v = torch.randn(1, 1, 20, 4, dtype=F64), torch.randn(1, 1, 20, 4, dtype=F64)
    p = patterns.strided(3)
    assert torch.autograd.gradgradcheck(lambda a: attnkit.sparse_attention(a, k, v, p, backend="cpu"), (q,))

"""CUDA C++ softmax-attention kernels (csrc/cuda/softmax.cu): torch.ops.attnkit.softmax_fwd /
softmax_bwd on CUDA tensors against the float64 reference.

Every test needs a GPU (``pytest -m gpu``; skipped elsewhere by tests/conftest.py).  The ground
truth is ``softmax_attention_reference`` run in float64 on the same (already rounded) inputs, its
gradients by autograd.  Tolerance (DESIGN.md): within 2x the error the reference itself makes
when run in the inputs' dtype, + 1e-3; infinities (lse = -inf on fully masked rows) must match
exactly and NaN never passes.
"""
import math

import pytest
import torch

from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, LOW_PRECISION as LOW, assert_close_to_reference, native_cuda_ops

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    return native_cuda_ops()


# ----------------------------------------------------------------------------------------------
# reference (the tolerance rule is attnkit_testing.assert_close_to_reference)
# ----------------------------------------------------------------------------------------------


def reference(q, k, v, dout, mask, scale, causal, dtype):
    """(out, lse, dq, dk, dv) of the reference run in ``dtype`` (float64: the ground truth)."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out, lse = softmax_attention_reference(
        qq, kk, vv, mask, 0.0, causal, scale, qq.shape[1] != kk.shape[1], return_lse=True
    )
    out.backward(dout.to(dtype))
    return out, lse, qq.grad, kk.grad, vv.grad


def run_and_check(ops, q, k, v, mask=None, causal=False, scale=None, dout=None):
    """Runs the CUDA forward and backward and checks all five results against the reference."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if dout is None:
        dout = torch.randn(q.shape, device=q.device).to(q.dtype)
    out, lse = ops.softmax_fwd(q, k, v, mask, scale, causal)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    dq, dk, dv = ops.softmax_bwd(dout, q, k, v, out, lse, mask, scale, causal)
    assert (dq.dtype, dk.dtype, dv.dtype) == (q.dtype,) * 3
    ref64 = reference(q, k, v, dout, mask, scale, causal, F64)
    ref_low = reference(q, k, v, dout, mask, scale, causal, q.dtype)
    for name, x, r64, rlow in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref64, ref_low):
        assert_close_to_reference(x, r64, rlow, name=name, dtype=q.dtype)
    return out, lse, dq, dk, dv


def make_qkv(b, h, hk, n, m, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, h, n, d), (b, hk, m, d), (b, hk, m, d))
    return [torch.randn(s, generator=g, device="cuda").to(dtype) for s in shapes]


# ----------------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------------

SIZES = ((1, 1), (7, 129), (129, 7), (64, 64), (257, 100), (1000, 1000))


@pytest.mark.parametrize("n,m", SIZES)
@pytest.mark.parametrize("group", (1, 2, 4))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", LOW)
def test_matches_reference(ops, dtype, d, causal, group, n, m):
    b, h = 2, 4
    q, k, v = make_qkv(b, h, h // group, n, m, d, dtype, seed=n * 7 + m + group)
    run_and_check(ops, q, k, v, causal=causal)


@pytest.mark.parametrize("scale", (0.3, -1.0, 0.0))
def test_scale(ops, scale):
    q, k, v = make_qkv(1, 2, 1, 70, 90, 64, torch.float16)
    run_and_check(ops, q, k, v, scale=scale)


def _keep(n, m, seed):
    """~70% True, row 1 (when present) fully False, the rest of the rows keep key 0 visible."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    keep = torch.rand(n, m, generator=g, device="cuda") < 0.7
    keep[:, 0] = True
    if n > 1:
        keep[1] = False
    return keep


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("kind", ("bool", torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", LOW)
def test_masks_with_fully_masked_rows(ops, dtype, d, kind, causal):
    b, h, hk, n, m = 2, 4, 2, 133, 70
    q, k, v = make_qkv(b, h, hk, n, m, d, dtype, seed=3)
    keep = _keep(n, m, seed=4)
    if kind == "bool":
        mask = keep.expand(b, h, n, m)  # stride-0 broadcast over batch and heads
    else:
        g = torch.Generator(device="cuda").manual_seed(5)
        bias = torch.randn(1, h, n, m, generator=g, device="cuda").to(kind)
        mask = bias.masked_fill(~keep, float("-inf")).expand(b, h, n, m)  # broadcast over batch
    out, lse, dq, dk, dv = run_and_check(ops, q, k, v, mask=mask, causal=causal)
    # Row 1 sees no key: zeros and lse -inf, no NaN, zero gradient.
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.isneginf(lse[:, :, 1]).all()
    assert torch.equal(dq[:, :, 1], torch.zeros_like(dq[:, :, 1]))


def test_mask_with_size_one_dims_and_no_visible_key_at_all(ops):
    b, h, n, m = 2, 2, 9, 65
    q, k, v = make_qkv(b, h, h, n, m, 64, torch.bfloat16)
    # Key padding mask [B, 1, 1, M], passed with its size-1 dims; batch 1 masks every key.
    keep = torch.ones(b, 1, 1, m, dtype=torch.bool, device="cuda")
    keep[0, ..., 50:] = False
    keep[1] = False
    out, lse, dq, dk, dv = run_and_check(ops, q, k, v, mask=keep)
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    for grad in (dq[1], dk[1], dv[1], dk[0, :, 50:], dv[0, :, 50:]):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_non_contiguous_and_misaligned_inputs(ops):
    b, h, hk, n, m, d = 2, 4, 2, 77, 91, 64
    dtype = torch.float16
    # [B, N, H, D] storage viewed as [B, H, N, D] (strided rows, the usual projection layout).
    q = torch.randn(b, n, h, d, device="cuda").to(dtype).transpose(1, 2)
    # A view at an odd element offset: rows no longer 16-byte aligned (the kernel copies it).
    k = torch.randn(b * hk * m * d + 1, device="cuda").to(dtype)[1:].view(b, hk, m, d)
    v = torch.randn(b, hk, m, 2 * d, device="cuda").to(dtype)[..., d:]  # row stride 2D
    dout = torch.randn(1, 1, 1, d, device="cuda").to(dtype).expand(b, h, n, d)  # stride 0
    run_and_check(ops, q, k, v, causal=True, dout=dout)


@pytest.mark.parametrize("n,m", ((0, 5), (5, 0), (0, 0)))
def test_empty_sequences(ops, n, m):
    q, k, v = make_qkv(2, 2, 1, n, m, 64, torch.bfloat16)
    out, lse = ops.softmax_fwd(q, k, v, None, 0.125, False)
    assert out.shape == (2, 2, n, 64) and lse.shape == (2, 2, n)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    dq, dk, dv = ops.softmax_bwd(torch.ones_like(out), q, k, v, out, lse, None, 0.125, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for grad in (dq, dk, dv):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_deterministic(ops):
    q, k, v = make_qkv(1, 4, 1, 300, 300, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    first = ops.softmax_fwd(q, k, v, None, 0.1, True)
    grads = ops.softmax_bwd(dout, q, k, v, *first, None, 0.1, True)
    again = ops.softmax_fwd(q, k, v, None, 0.1, True)
    grads_again = ops.softmax_bwd(dout, q, k, v, *again, None, 0.1, True)
    for x, y in zip(first + grads, again + grads_again):
        assert torch.equal(x, y)


def test_runs_on_the_current_stream(ops):
    # q2 is filled on a side stream after a long sleep there; a kernel launched on any other
    # stream than the current one would read it before the copy (zeros) and give another result.
    q, k, v = make_qkv(2, 4, 4, 200, 300, 64, torch.float16)
    expected = ops.softmax_fwd(q, k, v, None, 0.125, False)[0]
    q2 = torch.zeros_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        q2.copy_(q)
        out = ops.softmax_fwd(q2, k, v, None, 0.125, False)[0]
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


# ----------------------------------------------------------------------------------------------
# errors (the Python side routes unsupported calls elsewhere)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,dv", ((96, 96), (32, 32), (64, 128)))
def test_unsupported_head_dims(ops, d, dv):
    q = torch.randn(1, 1, 4, d, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, 4, d, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 1, 4, dv, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="head dims 64 and 128"):
        ops.softmax_fwd(q, k, v, None, 1.0, False)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_unsupported_dtypes(ops, dtype):
    q = torch.randn(1, 1, 4, 64, device="cuda", dtype=dtype)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.softmax_fwd(q, q, q, None, 1.0, False)


def test_bad_shapes_and_masks(ops):
    q, k, v = make_qkv(1, 3, 2, 4, 5, 64, torch.float16)
    with pytest.raises(RuntimeError, match="multiple of the key/value heads"):
        ops.softmax_fwd(q, k, v, None, 1.0, False)
    q, k, v = make_qkv(1, 2, 1, 4, 5, 64, torch.float16)
    with pytest.raises(RuntimeError, match=r"mask must have shape \[B, H, N, M\]"):
        ops.softmax_fwd(q, k, v, torch.ones(1, 2, 4, 6, dtype=torch.bool, device="cuda"), 1.0, False)
    with pytest.raises(RuntimeError, match="mask must be bool or floating point"):
        ops.softmax_fwd(q, k, v, torch.ones(1, 2, 4, 5, dtype=torch.int32, device="cuda"), 1.0, False)
    with pytest.raises(RuntimeError, match="mask must be on q's device"):
        ops.softmax_fwd(q, k, v, torch.ones(1, 2, 4, 5, dtype=torch.bool), 1.0, False)

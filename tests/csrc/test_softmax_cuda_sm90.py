"""The Hopper forward of the CUDA C++ softmax (csrc/cuda/softmax_sm90.cu, issue 27) on a GPU.

Opt-in today (ATTNKIT_CUDA_SM90=1, =pingpong, =simple or =persistent, each test run under all four): torch.ops.attnkit.softmax_fwd then takes
the TMA / wgmma kernel for unmasked float16 / bfloat16 calls with D = 64 or 128 on a compute
capability 9.0 device with an sm_90a build; the backward stays softmax.cu's.  Checked against
the float64 reference under DESIGN.md's rule (test_softmax_cuda.run_and_check), and checked to
have run: its results differ in the last bits from the default kernel's (another summation
order), where a silent fallback would give them bit for bit.  Skipped (saying why) off Hopper.
D = 256 (test_d256_*): only these kernels take it (the forward on 64-key tiles, the backward's two
wide kernels), so the op refuses it with ATTNKIT_CUDA_SM90 off and runs it with it on, through
torch.ops and through attnkit.softmax_attention(backend="cuda").
test_atomic_backward: ATTNKIT_CUDA_SM90=atomic's backward (dQ added with atomics by the dK / dV
kernel) against the float64 reference, and dK and dV bit for bit the two-kernel backward's
(tests/csrc/test_softmax_cuda.py runs under it in .ci/gpu_sm90, its determinism test left out).
The same kernel runs on the CPU in tests/csrc/test_softmax_sm90_emulated.py.
"""
import pytest
import torch

from attnkit_testing import LOW_PRECISION as LOW
from test_softmax_cuda import make_qkv, ops, run_and_check  # noqa: F401 - ops is a fixture

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, params=("1", "pingpong", "simple", "persistent"),
                ids=("overlap", "pingpong", "simple", "persistent"))
def hopper(request, monkeypatch):
    """Each test under the four forwards (ATTNKIT_CUDA_SM90=1: overlapped; =pingpong; =simple;
    =persistent: overlapped, on the persistent scheduler)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernel runs on compute capability 9.0 devices (H100 / H200) only")
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", request.param)


SIZES = ((1, 1), (7, 129), (129, 7), (128, 128), (257, 100), (1000, 1000), (300, 2049))


@pytest.mark.parametrize("n,m", SIZES)
@pytest.mark.parametrize("group", (1, 4))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", LOW)
def test_matches_reference(ops, dtype, d, causal, group, n, m):
    b, h = 2, 4
    q, k, v = make_qkv(b, h, h // group, n, m, d, dtype, seed=n * 7 + m + group)
    run_and_check(ops, q, k, v, causal=causal)


def test_strided_inputs(ops):
    b, h, hk, n, m, d = 2, 4, 2, 77, 300, 128
    dtype = torch.bfloat16
    q = torch.randn(b, n, h, d, device="cuda").to(dtype).transpose(1, 2)  # [B, N, H, D] storage
    k = torch.randn(b, m, hk, d, device="cuda").to(dtype).transpose(1, 2)
    v = torch.randn(b, hk, m, 2 * d, device="cuda").to(dtype)[..., d:]  # row stride 2 D
    run_and_check(ops, q, k, v, causal=True)


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_the_kernel_ran(ops, monkeypatch, d, causal):
    q, k, v = make_qkv(2, 8, 2, 1000, 1500, d, torch.bfloat16, seed=3)
    hopper_out, hopper_lse = ops.softmax_fwd(q, k, v, None, 0.1, causal)
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", "0")
    out, lse = ops.softmax_fwd(q, k, v, None, 0.1, causal)
    torch.testing.assert_close(hopper_out, out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(hopper_lse, lse, rtol=1e-4, atol=1e-4)
    assert not torch.equal(hopper_lse, lse), "ATTNKIT_CUDA_SM90=1 gave the default kernel's bits: not taken"


@pytest.mark.parametrize("n,m", ((0, 5), (5, 0)))
def test_empty_sequences_fall_back(ops, n, m):
    q, k, v = make_qkv(1, 2, 1, n, m, 64, torch.float16)
    out, lse = ops.softmax_fwd(q, k, v, None, 0.125, False)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_deterministic(ops):
    q, k, v = make_qkv(1, 4, 1, 700, 900, 128, torch.float16, seed=5)
    first = ops.softmax_fwd(q, k, v, None, 0.1, True)
    again = ops.softmax_fwd(q, k, v, None, 0.1, True)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("causal", (False, True))
def test_atomic_backward(ops, monkeypatch, d, causal):
    # =atomic's forward and backward against the float64 reference (DESIGN.md's rule), then the
    # two-kernel backward (=1) on the same out and lse.
    q, k, v = make_qkv(2, 8, 2, 1000, 1500, d, torch.bfloat16, seed=4)
    dout = torch.randn_like(q)
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", "atomic")
    out, lse, *atomic = run_and_check(ops, q, k, v, causal=causal, scale=0.1, dout=dout)
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", "1")
    two_kernels = ops.softmax_bwd(dout, q, k, v, out, lse, None, 0.1, causal)
    # dK and dV: the same products in the same order as the two-kernel backward's.
    assert torch.equal(atomic[1], two_kernels[1]) and torch.equal(atomic[2], two_kernels[2])
    assert not torch.equal(atomic[0], two_kernels[0]), "=atomic gave the dQ kernel's bits: not taken"


@pytest.mark.parametrize("n,m", ((7, 129), (257, 100), (1000, 1000)))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("dtype", LOW)
def test_d256_matches_reference(ops, dtype, causal, n, m):
    q, k, v = make_qkv(2, 4, 2, n, m, 256, dtype, seed=n + m)
    run_and_check(ops, q, k, v, causal=causal)


def test_d256_strided_inputs(ops):
    b, h, hk, n, m, d = 1, 4, 2, 150, 200, 256
    q = torch.randn(b, n, h, d, device="cuda").to(torch.float16).transpose(1, 2)  # [B, N, H, D] storage
    k = torch.randn(b, hk, m, d, device="cuda").to(torch.float16)
    v = torch.randn(b, hk, m, d + 8, device="cuda").to(torch.float16)[..., 8:]  # row stride D + 8
    run_and_check(ops, q, k, v, causal=True)


def test_d256_only_on_the_hopper_kernels(ops, monkeypatch):
    q, k, v = make_qkv(1, 2, 1, 100, 100, 256, torch.bfloat16, seed=1)
    mask = torch.ones(1, 2, 100, 100, dtype=torch.bool, device="cuda")
    with pytest.raises(RuntimeError, match=r"got D = 256, Dv = 256 \(256 runs on the Hopper kernels, which take no mask"):
        ops.softmax_fwd(q, k, v, mask, 0.1, False)
    monkeypatch.setenv("ATTNKIT_CUDA_SM90", "0")
    with pytest.raises(RuntimeError, match=r"got D = 256, Dv = 256 \(256 runs on the Hopper kernels: ATTNKIT_CUDA_SM90"):
        ops.softmax_fwd(q, k, v, None, 0.1, False)


@pytest.mark.parametrize("n,m", ((0, 5), (5, 0)))
def test_d256_empty_sequences(ops, n, m):
    q, k, v = make_qkv(1, 2, 1, n, m, 256, torch.float16)
    out, lse = ops.softmax_fwd(q, k, v, None, 0.0625, False)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    dq, dk, dv = ops.softmax_bwd(torch.ones_like(out), q, k, v, out, lse, None, 0.0625, False)
    assert all(torch.equal(x, torch.zeros_like(x)) for x in (dq, dk, dv))


def test_d256_through_the_public_function():
    # attnkit.softmax_attention(backend="cuda") takes D = 256 here; forward and gradients under
    # DESIGN.md's rule against the reference in float64 and in bfloat16.
    import attnkit
    from attnkit_testing import assert_close_to_reference

    inputs = make_qkv(1, 4, 2, 300, 300, 256, torch.bfloat16, seed=7)
    dout = torch.randn(1, 4, 300, 256, device="cuda").to(torch.bfloat16)

    def run(dtype, backend):
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in inputs)
        out = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
        out.backward(dout.to(dtype))
        return out.detach(), q.grad, k.grad, v.grad

    got, ref64, ref_low = run(torch.bfloat16, "cuda"), run(torch.float64, "reference"), run(torch.bfloat16, "reference")
    for name, x, r64, rlow in zip(("out", "dq", "dk", "dv"), got, ref64, ref_low):
        assert_close_to_reference(x, r64, rlow, name=name, dtype=torch.bfloat16)
    q, k, v = inputs
    with pytest.raises(attnkit.BackendUnavailableError, match="without a mask on the Hopper kernels"):
        attnkit.softmax_attention(q, k, v, attn_mask=torch.ones(300, 300, dtype=torch.bool, device="cuda"),
                                  enable_gqa=True, backend="cuda")

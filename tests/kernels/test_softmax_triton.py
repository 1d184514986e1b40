"""Triton softmax-attention kernels (attnkit.kernels.softmax): forward, backward, dropout mask.

Without a GPU these run on CPU tensors under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports attnkit), where a tile step costs milliseconds: shapes
stay small (N, M <= 130) and each case names its tile config.  With a GPU the same tests run on
CUDA, plus the ``gpu``-marked ones (bfloat16, which the interpreter cannot do, and large shapes).

Ground truth: ``softmax_attention_reference`` run in float64 on the same (already rounded)
inputs, gradients by autograd.  Tolerance rule (DESIGN.md): float32 within 2e-5 of the largest
reference magnitude (gradients 1e-4); float16 / bfloat16 within 2x the error the reference makes
when it runs in that dtype, plus 1e-3.
"""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

import attnkit  # noqa: E402
from attnkit.kernels import softmax as triton_softmax  # noqa: E402
from attnkit.reference.softmax import softmax_attention_reference  # noqa: E402
from attnkit_testing import TRITON_BF16, TRITON_BF16_TEST, assert_close_to_reference  # noqa: E402

F16, F32, F64 = torch.float16, torch.float32, torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FWD, DKDV, DQ = (triton_softmax.FWD_CONFIGS, triton_softmax.BWD_DKDV_CONFIGS,
                 triton_softmax.BWD_DQ_CONFIGS)


def cfg(bm, bn):
    """A tile config for the interpreter tests (warps / stages mean nothing there)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------
# inputs and reference (the tolerance rule is attnkit_testing.assert_close_to_reference)
# ----------------------------------------------------------------------------------------------


def make_inputs(b, h, hk, n, m, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, hk, m, d, generator=g)
    v = torch.randn(b, hk, m, dv, generator=g)
    go = torch.randn(b, h, n, dv, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, go)]


def make_mask(kind, b, h, n, m, seed=1):
    """None, "bool" / "add" (full [B, H, N, M], about 30% masked, -inf entries in "add"), or
    broadcast views: "bcast_bool" ([N, M] expanded, stride 0 over B and H), "bcast_add" (a
    [B, 1, 1, M] key-padding bias expanded).  Every row keeps key i % M visible."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(n)
    if kind in ("bool", "bcast_bool"):
        shape = (b, h, n, m) if kind == "bool" else (n, m)
        mask = torch.rand(shape, generator=g) < 0.7
        mask[..., rows, rows % m] = True
    elif kind == "add":
        mask = torch.randn(b, h, n, m, generator=g)
        mask = mask.masked_fill(torch.rand(b, h, n, m, generator=g) < 0.2, float("-inf"))
        mask[..., rows, rows % m] = 0.0
    elif kind == "bcast_add":
        mask = torch.randn(b, 1, 1, m, generator=g)
        mask[..., : m // 3] = float("-inf")  # padded keys ...
        mask[..., 0] = 0.0  # ... but key 0 stays (causal rows see it)
    else:
        raise AssertionError(kind)
    mask = mask.to(DEVICE)
    if kind.startswith("bcast"):
        mask = mask.expand(b, h, n, m)
        assert 0 in mask.stride()
    return mask


def reference(q, k, v, go, mask, causal, scale=None, dropout_p=0.0, keep=None, dtype=F64):
    """(out, lse, dq, dk, dv) of the reference run in ``dtype`` on the given inputs."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out, lse = softmax_attention_reference(
        *leaves, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1], return_lse=True, dropout_mask=keep)
    out.backward(go.to(dtype))
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def run_kernels(q, k, v, go, mask, causal, scale=None, dropout_p=0.0, seed=0,
                fwd_config=None, bwd_config=None):
    out, lse = triton_softmax.softmax_fwd(q, k, v, mask, scale, causal, dropout_p, seed,
                                          fwd_config)
    grads = triton_softmax.softmax_bwd(go, q, k, v, out, lse, mask, scale, causal, dropout_p,
                                       seed, bwd_config)
    return (out, lse, *grads)


NAMES = ("out", "lse", "dq", "dk", "dv")


def check_against_reference(got, q, k, v, go, mask, causal, scale=None, dropout_p=0.0,
                            keep=None):
    dtype = q.dtype
    ref = reference(q, k, v, go, mask, causal, scale, dropout_p, keep)
    lowp = None if dtype == F32 else reference(q, k, v, go, mask, causal, scale, dropout_p,
                                               keep, dtype=dtype)
    for i, name in enumerate(NAMES):
        assert got[i].dtype == (F32 if name == "lse" else dtype), name
        assert_close_to_reference(got[i], ref[i], None if lowp is None else lowp[i], dtype=dtype,
                                  grad=i >= 2, name=name)


# ----------------------------------------------------------------------------------------------
# forward and backward against the float64 reference
# ----------------------------------------------------------------------------------------------

# (B, H, Hk, N, M, D, Dv, causal, mask, dtype, fwd tile, (dK/dV tile, dQ tile)); tile None means
# the launcher's own choice (the first eligible config when interpreted).
CASES = {
    "n1_m129": (1, 2, 2, 1, 129, 16, 16, False, None, F32, cfg(16, 64),
                (cfg(16, 64), cfg(16, 64))),
    "n7_m7_gqa2_bool": (1, 2, 1, 7, 7, 16, 16, False, "bool", F32, cfg(16, 16),
                        (cfg(16, 16), cfg(16, 16))),
    "n129_m64_causal_d80": (1, 1, 1, 129, 64, 80, 80, True, None, F32, cfg(64, 32),
                            (cfg(32, 64), cfg(64, 32))),
    "n64_m129_causal_d96_add_gqa2": (1, 2, 1, 64, 129, 96, 96, True, "add", F32, cfg(32, 64),
                                     (cfg(32, 64), cfg(32, 64))),
    "n33_m65_dv48_gqa4_bcast_bool": (2, 4, 1, 33, 65, 32, 48, False, "bcast_bool", F32,
                                     cfg(32, 32), (cfg(32, 32), cfg(32, 32))),
    "d128_causal_bcast_add_default_tiles": (1, 1, 1, 40, 50, 128, 128, True, "bcast_add", F32,
                                            None, None),
    "d256_dv64_bool": (1, 1, 1, 20, 17, 256, 64, False, "bool", F32, cfg(32, 16),
                       (cfg(16, 32), cfg(32, 16))),
    "f16_n129_m129_causal_gqa2": (1, 2, 1, 129, 129, 64, 64, True, None, F16, cfg(64, 64),
                                  (cfg(64, 64), cfg(64, 64))),
    "f16_n7_m64_add_d80_dv40_gqa4": (1, 4, 1, 7, 64, 80, 40, False, "add", F16, cfg(16, 64),
                                     (cfg(16, 64), cfg(16, 64))),
    "f16_n64_m33_bool_d96": (2, 2, 2, 64, 33, 96, 96, False, "bool", F16, cfg(64, 32),
                             (cfg(32, 32), cfg(64, 32))),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_backward_match_float64_reference(case):
    check_case(case)


def check_case(case):
    b, h, hk, n, m, d, dv, causal, mask_kind, dtype, fwd_cfg, bwd_cfg = case
    q, k, v, go = make_inputs(b, h, hk, n, m, d, dv, dtype)
    mask = make_mask(mask_kind, b, h, n, m)
    got = run_kernels(q, k, v, go, mask, causal, fwd_config=fwd_cfg, bwd_config=bwd_cfg)
    check_against_reference(got, q, k, v, go, mask, causal)


# The float16 cases above in bfloat16 (on CPU: the fixed interpreter, tests/conftest.py).
BF16_CASES = {name.replace("f16_", "bf16_"): case[:9] + (torch.bfloat16,) + case[10:]
              for name, case in CASES.items() if case[9] == F16}


@TRITON_BF16_TEST
@pytest.mark.parametrize("case", BF16_CASES.values(), ids=BF16_CASES.keys())
def test_bf16_forward_and_backward_match_float64_reference(case):
    check_case(case)


@pytest.mark.parametrize("n, causal", [(1, False), (7, True)])
def test_single_key(n, causal):
    # With one key the softmax is identically 1: out_i = v_0, dv_0 = sum_i dO_i and dq = dk = 0
    # exactly, so a relative tolerance on dq / dk means nothing (their reference is 0).  The
    # kernels get them as p * (dp - D), a difference of two float32 sums of the same terms:
    # check it is rounding-sized against the size of those terms.
    q, k, v, go = make_inputs(1, 2, 1, n, 1, 16, 16, F32)
    out, lse, dq, dk, dv = run_kernels(q, k, v, go, None, causal, fwd_config=cfg(16, 16),
                                       bwd_config=cfg(16, 16))
    ref = reference(q, k, v, go, None, causal)
    for got, expected, name in ((out, ref[0], "out"), (lse, ref[1], "lse"), (dv, ref[4], "dv")):
        assert_close_to_reference(got, expected, dtype=F32, grad=name == "dv", name=name)
    assert torch.all(ref[2] == 0) and torch.all(ref[3] == 0)
    terms = (go.abs().amax() * v.abs().amax() * 16) * max(q.abs().amax(), k.abs().amax()) * 16
    for got, name in ((dq, "dq"), (dk, "dk")):
        assert got.abs().max() <= 1e-5 * terms / math.sqrt(16), name


def test_scale_and_non_contiguous_inputs():
    # [B, N, H, D] storage viewed as [B, H, N, D]; a transposed mask; a strided grad_out.
    b, h, n, m, d = 1, 2, 37, 45, 32
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, n, h, d, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(b, m, h, d, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(b, m, h, 2 * d, generator=g).to(DEVICE).transpose(1, 2)[..., ::2]
    go = torch.randn(b, h, d, n, generator=g).to(DEVICE).transpose(2, 3)
    mask = (torch.rand(b, h, m, n, generator=g) < 0.8).to(DEVICE).transpose(2, 3)
    mask[..., 0] = True
    assert not any(t.is_contiguous() for t in (q, k, v, go, mask))
    got = run_kernels(q, k, v, go, mask, True, scale=0.3, fwd_config=cfg(32, 32),
                      bwd_config=cfg(32, 32))
    check_against_reference(got, q, k, v, go, mask, True, scale=0.3)
    # and the scale is really used: the default 1/sqrt(D) gives a different output
    default = triton_softmax.softmax_fwd(q, k, v, mask, None, True, config=cfg(32, 32))[0]
    assert (default - got[0]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# every autotune candidate, through the paths it can take (masked and unmasked tiles)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("i", range(len(FWD)), ids=[f"fwd{i}" for i in range(len(FWD))])
def test_every_forward_config(i):
    # N = M = 130 > 128: two query tiles and, for each, full and partial key tiles.
    causal = i % 2 == 0
    q, k, v, go = make_inputs(1, 2, 1, 130, 130, 16, 16, F32, seed=i)
    mask = make_mask("bool" if i % 3 else "add", 1, 2, 130, 130)
    out, lse = triton_softmax.softmax_fwd(q, k, v, mask, None, causal, config=FWD[i])
    ref = reference(q, k, v, go, mask, causal)
    assert_close_to_reference(out, ref[0], dtype=F32, name="out")
    assert_close_to_reference(lse, ref[1], dtype=F32, name="lse")


@pytest.mark.parametrize("i", range(max(len(DKDV), len(DQ))), ids=lambda i: f"bwd{i}")
def test_every_backward_config(i):
    causal = i % 2 == 0
    q, k, v, go = make_inputs(1, 2, 1, 130, 130, 16, 16, F32, seed=10 + i)
    mask = make_mask("bool" if i % 3 else "add", 1, 2, 130, 130)
    pair = (DKDV[i % len(DKDV)], DQ[i % len(DQ)])
    got = run_kernels(q, k, v, go, mask, causal, fwd_config=cfg(64, 64), bwd_config=pair)
    check_against_reference(got, q, k, v, go, mask, causal)


def test_config_lists_and_head_dim_filter():
    for name, configs in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        assert configs and all(isinstance(c, triton.Config) for c in configs)
        for c in configs:  # tl.dot needs >= 16 along every dimension on GPUs
            assert c.kwargs["BLOCK_M"] >= 16 and c.kwargs["BLOCK_N"] >= 16
        assert triton_softmax.configs_for(name, 64) == configs  # small heads: everything
        big = triton_softmax.configs_for(name, 256)
        assert big and len(big) < len(configs)  # large heads: only the smaller tiles
        assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 64 for c in big)
        assert triton_softmax.configs_for(name, 80) == triton_softmax.configs_for(name, 128)


# ----------------------------------------------------------------------------------------------
# fully masked rows and empty sequences
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "add", "causal_bool"])
def test_fully_masked_rows(kind):
    b, h, n, m, d = 1, 2, 40, 70, 16
    q, k, v, go = make_inputs(b, h, 1, n, m, d, d, F32)
    keep = torch.rand(b, h, n, m, generator=torch.Generator().manual_seed(5)) < 0.6
    keep[..., 0] = True  # every other row keeps a visible key, even when causal
    dead = torch.zeros(b, h, n, dtype=torch.bool)
    dead[0, 0, [3, 39]] = True
    dead[0, 1, :] = True  # a whole head without a visible key
    keep[dead] = False
    causal = kind == "causal_bool"
    if causal:  # row 1 sees only keys 0 and 1 causally; masking those two kills the row
        keep[0, 0, 1, :2] = False
        dead[0, 0, 1] = True
    mask = keep if kind != "add" else torch.zeros(b, h, n, m).masked_fill(~keep, float("-inf"))
    mask = mask.to(DEVICE)
    got = run_kernels(q, k, v, go, mask, causal, fwd_config=cfg(32, 32), bwd_config=cfg(32, 32))
    out, lse, dq, dk, dv = (t.cpu() for t in got)
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert torch.all(out[dead] == 0) and torch.all(dq[dead] == 0)
    assert torch.all(lse[dead] == float("-inf")) and torch.isfinite(lse[~dead]).all()
    check_against_reference(got, q, k, v, go, mask, causal)


@pytest.mark.parametrize("n, m", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(n, m):
    b, h, hk, d, dv = 2, 4, 2, 16, 24
    q, k, v, go = make_inputs(b, h, hk, n, m, d, dv, F32)
    for mask in (None, torch.ones(n, m, dtype=torch.bool, device=DEVICE)):
        out, lse = triton_softmax.softmax_fwd(q, k, v, mask, None, True)
        assert out.shape == (b, h, n, dv) and lse.shape == (b, h, n) and lse.dtype == F32
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
        dq, dk, dv_ = triton_softmax.softmax_bwd(go, q, k, v, out, lse, mask, None, True)
        assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
        for t in (dq, dk, dv_):
            assert torch.all(t == 0)


def test_empty_batch():
    q, k, v, go = make_inputs(0, 2, 1, 5, 6, 16, 16, F32)
    out, lse = triton_softmax.softmax_fwd(q, k, v, None, None, False)
    assert out.shape == (0, 2, 5, 16) and lse.shape == (0, 2, 5)
    grads = triton_softmax.softmax_bwd(go, q, k, v, out, lse, None, None, False)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ----------------------------------------------------------------------------------------------
# dropout
# ----------------------------------------------------------------------------------------------


def test_dropout_keep_mask_is_philox_of_the_flat_index():
    b, h, n, m, p = 2, 3, 33, 70, 0.3
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, 1234, DEVICE)
    assert keep.shape == (b, h, n, m) and keep.dtype == torch.bool
    # the counter of element (b, h, i, j) is its flat index: the same draws laid out flat
    flat = triton_softmax.dropout_keep_mask(1, 1, 1, b * h * n * m, p, 1234, DEVICE)
    assert torch.equal(keep.flatten(), flat.flatten())
    assert abs(keep.float().mean().item() - (1 - p)) < 0.015  # 13860 draws: sd 0.004
    assert torch.equal(keep, triton_softmax.dropout_keep_mask(b, h, n, m, p, 1234, DEVICE))
    assert not torch.equal(keep, triton_softmax.dropout_keep_mask(b, h, n, m, p, 1235, DEVICE))
    assert triton_softmax.dropout_keep_mask(b, h, n, m, 0.0, 1234, DEVICE).all()


@pytest.mark.parametrize("dtype", [F32, F16, TRITON_BF16])
def test_dropout_forward_and_backward_use_the_keep_mask(dtype):
    b, h, hk, n, m, d, p, seed = 1, 2, 1, 45, 70, 32, 0.25, 2024
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, dtype)
    mask = make_mask("add", b, h, n, m)
    got = run_kernels(q, k, v, go, mask, True, dropout_p=p, seed=seed, fwd_config=cfg(32, 32),
                      bwd_config=cfg(32, 32))
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed, DEVICE)
    check_against_reference(got, q, k, v, go, mask, True, dropout_p=p, keep=keep)
    # a different mask (another seed) must not pass: the test can fail
    other = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed + 1, DEVICE)
    with pytest.raises(AssertionError, match="tolerance"):
        check_against_reference(got, q, k, v, go, mask, True, dropout_p=p, keep=other)


def test_dropout_same_seed_same_result():
    q, k, v, go = make_inputs(1, 2, 2, 20, 30, 16, 16, F32)

    def run(seed, p=0.5):
        return run_kernels(q, k, v, go, None, False, dropout_p=p, seed=seed,
                           fwd_config=cfg(16, 32), bwd_config=cfg(16, 32))

    first, again, other = run(7), run(7), run(8)
    for a, b_ in zip(first, again):
        assert torch.equal(a, b_)
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], run(7, p=0.0)[0])
    assert torch.equal(first[1], other[1])  # the lse is that of the undropped softmax


# ----------------------------------------------------------------------------------------------
# launcher errors
# ----------------------------------------------------------------------------------------------


def _small(d=16, dv=16, h=2, hk=1, dtype=F32):
    return make_inputs(1, h, hk, 3, 4, d, dv, dtype)[:3]


@pytest.mark.parametrize("inputs, extra, exc, match", [
    (lambda: _small(d=272), {}, ValueError, r"head dim must be in 1\.\.256; got 272"),
    (lambda: _small(dv=300), {}, ValueError, r"v head dim must be in 1\.\.256; got 300"),
    (lambda: _small(h=3, hk=2), {}, ValueError, r"multiple of key/value heads"),
    (lambda: _small(dtype=F64), {}, TypeError, r"float16, bfloat16 or float32; got torch.float64"),
    (lambda: _small(), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\); got 1.0"),
    (lambda: _small(), {"mask": torch.ones(5, 4, dtype=torch.bool)}, ValueError,
     r"does not broadcast"),
    (lambda: _small(), {"mask": torch.ones(3, 4, dtype=torch.int32)}, TypeError,
     r"mask must be bool or floating; got torch.int32"),
    (lambda: [t[0] for t in _small()], {}, ValueError, r"q must be 4-D"),
])
def test_launcher_errors(inputs, extra, exc, match):
    q, k, v = inputs()
    kwargs = dict(mask=None, scale=None, is_causal=False)
    kwargs.update({key: (val.to(DEVICE) if torch.is_tensor(val) else val)
                   for key, val in extra.items()})
    with pytest.raises(exc, match=match):
        triton_softmax.softmax_fwd(q, k, v, **kwargs)


def test_dropout_keep_mask_rejects_bad_probability():
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\); got -0.1"):
        triton_softmax.dropout_keep_mask(1, 1, 2, 2, -0.1, 0, DEVICE)


# ----------------------------------------------------------------------------------------------
# GPU: bfloat16 (its small cases run interpreted too), large shapes, the autotuned path
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.autotune
@pytest.mark.parametrize("dtype", [torch.bfloat16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_large_autotuned(dtype, causal):
    b, h, hk, n, m, d = 2, 4, 2, 1000, 1000, 128
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, dtype)
    mask = make_mask("bcast_add", b, h, n, m)
    got = run_kernels(q, k, v, go, mask, causal)
    check_against_reference(got, q, k, v, go, mask, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv", [(16, 16), (80, 80), (96, 64), (256, 256)])
def test_gpu_bf16_head_dims(d, dv):
    b, h, hk, n, m = 1, 4, 1, 257, 300
    q, k, v, go = make_inputs(b, h, hk, n, m, d, dv, torch.bfloat16)
    mask = make_mask("bool", b, h, n, m)
    got = run_kernels(q, k, v, go, mask, True)
    check_against_reference(got, q, k, v, go, mask, True)


@pytest.mark.gpu
def test_gpu_float32_large():
    q, k, v, go = make_inputs(1, 4, 4, 1000, 777, 64, 64, F32)
    got = run_kernels(q, k, v, go, None, True)
    check_against_reference(got, q, k, v, go, None, True)


# One test per (kernel, config): each compiles on its own worker (issue 26: one test that looped
# over a list compiled it serially and held the GPU suite's tail).
_EVERY_CONFIG_D128 = [(kernel, i) for kernel in ("fwd", "dkdv", "dq")
                      for i in range(len(triton_softmax.configs_for(kernel, 128)))]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, index", _EVERY_CONFIG_D128,
                         ids=[f"{kernel}-{i}" for kernel, i in _EVERY_CONFIG_D128])
def test_gpu_every_eligible_config_bf16(kernel, index):
    b, h, hk, n, m, d = 1, 2, 1, 1000, 1000, 128
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, torch.bfloat16)
    config = triton_softmax.configs_for(kernel, d)[index]
    fwd_cfg = config if kernel == "fwd" else None
    bwd_cfg = {"fwd": None, "dkdv": (config, None), "dq": (None, config)}[kernel]
    got = run_kernels(q, k, v, go, None, True, fwd_config=fwd_cfg, bwd_config=bwd_cfg)
    check_against_reference(got, q, k, v, go, None, True)


@pytest.mark.gpu
def test_gpu_bf16_dropout():
    b, h, hk, n, m, d, p, seed = 2, 4, 2, 500, 600, 64, 0.1, 99
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, torch.bfloat16)
    got = run_kernels(q, k, v, go, None, True, dropout_p=p, seed=seed)
    keep = triton_softmax.dropout_keep_mask(b, h, n, m, p, seed, DEVICE)
    check_against_reference(got, q, k, v, go, None, True, dropout_p=p, keep=keep)


# ----------------------------------------------------------------------------------------------
# NaN / inf inputs (issue 15): propagate as in SDPA, forward and backward
# ----------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
# (tensor, index, value) for attnkit_testing.poison
NONFINITE = {
    "q_nan": ("q", (0, 1, 9, 3), NAN),
    "k_nan": ("k", (0, 0, 20, 0), NAN),
    "k_posinf": ("k", (0, 0, 5), INF),
    "v_nan": ("v", (0, 0, 30, 2), NAN),
    "mask_nan": ("mask", (0, 1, 12, 4), NAN),
    "q_nan_on_masked_row": ("q", (0, 0, 6, 0), NAN),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_inputs_propagate_like_the_reference(name, causal):
    from attnkit_testing import assert_nonfinite_like_reference, poison

    b, h, hk, n, d = 1, 2, 1, 40, 16
    q, k, v, go = (t.cpu() for t in make_inputs(b, h, hk, n, n, d, d, F32, seed=3))
    mask = None
    if name == "mask_nan":
        mask = torch.zeros(b, h, n, n)
    elif name == "q_nan_on_masked_row":
        mask = torch.ones(b, h, n, n, dtype=torch.bool)
        mask[0, 0, 6] = False  # row 6 of head 0 sees no key: stays 0 despite its NaN query
    poison(NONFINITE[name], q, k, v, mask)
    q, k, v, go = (t.to(DEVICE) for t in (q, k, v, go))
    mask = None if mask is None else mask.to(DEVICE)
    got = run_kernels(q, k, v, go, mask, causal, fwd_config=cfg(16, 16), bwd_config=cfg(16, 16))
    ref = reference(q, k, v, go, mask, causal)
    visible = torch.ones(b, h, n, n, dtype=torch.bool)
    if causal:
        visible &= torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        visible &= mask.cpu()
    assert torch.isnan(ref[0]).any() or name == "q_nan_on_masked_row"  # the case poisons something
    assert_nonfinite_like_reference(got, ref, None, visible, dtype=F32,
                                    v=v if name == "v_nan" else None)
    if name == "q_nan_on_masked_row":
        assert torch.equal(got[0][0, 0, 6].cpu(), torch.zeros(d)) and got[1][0, 0, 6] == float("-inf")


# ----------------------------------------------------------------------------------------------
# the fast case on Hopper: softmax_fwd / softmax_bwd hand it to kernels/softmax_hopper.py
# ----------------------------------------------------------------------------------------------

from attnkit.kernels import softmax_hopper  # noqa: E402


@pytest.fixture
def routed_calls(monkeypatch):
    """Counts the calls that took the fast path (the real kernels still run)."""
    calls = []
    for name in ("fast_fwd", "fast_bwd"):
        real = getattr(softmax_hopper, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(softmax_hopper, name, spy)
    return calls


# (B, H, Hk, N, M, D, causal): odd lengths, N > M and N < M, GQA, both head dims of the table.
FAST_CASES = {
    "d64_n70_m45_gqa2": (1, 4, 2, 70, 45, 64, False),
    "d64_n45_m70_causal": (2, 2, 2, 45, 70, 64, True),
    "d128_n33_m129_causal_gqa4": (1, 4, 1, 33, 129, 128, True),
    "d128_n129_m17": (1, 2, 2, 129, 17, 128, False),
}


@pytest.mark.parametrize("dtype", [F16, TRITON_BF16])
@pytest.mark.parametrize("case", FAST_CASES.values(), ids=FAST_CASES.keys())
def test_fast_path_matches_float64_reference(case, dtype, monkeypatch, routed_calls):
    # ATTNKIT_TRITON_HOPPER=1 takes the path wherever the case holds (here: the interpreter).
    monkeypatch.setenv("ATTNKIT_TRITON_HOPPER", "1")
    b, h, hk, n, m, d, causal = case
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, dtype)
    got = run_kernels(q, k, v, go, None, causal)
    assert routed_calls == ["fast_fwd", "fast_bwd"]
    check_against_reference(got, q, k, v, go, None, causal)


def _fast_call_variants():
    """(id, kwargs of a softmax_fwd + softmax_bwd call) that must NOT take the fast path."""
    q, k, v, go = make_inputs(1, 2, 1, 9, 11, 64, 64, F16)
    base = dict(q=q, k=k, v=v, go=go, mask=None, fwd_kw={}, bwd_kw={})
    f32 = [t.float() for t in (q, k, v, go)]
    q96, k96, v96, go96 = make_inputs(1, 2, 1, 9, 11, 96, 96, F16)
    strided = [torch.cat([t, t], dim=-1)[..., ::2] for t in (q, k, v, go)]
    return {
        "mask": dict(base, mask=torch.ones(9, 11, dtype=torch.bool, device=DEVICE)),
        "dropout": dict(base, dropout_p=0.2),
        "window": dict(base, fwd_kw=dict(window_left=3), bwd_kw=dict(window_left=3)),
        "softcap": dict(base, fwd_kw=dict(softcap=5.0), bwd_kw=dict(softcap=5.0)),
        "alibi": dict(base, fwd_kw=dict(alibi_slopes=torch.ones(2, device=DEVICE)),
                      bwd_kw=dict(alibi_slopes=torch.ones(2, device=DEVICE))),
        "config": dict(base, fwd_config=cfg(16, 16), bwd_config=cfg(16, 16)),
        "float32": dict(base, q=f32[0], k=f32[1], v=f32[2], go=f32[3]),
        "d96": dict(base, q=q96, k=k96, v=v96, go=go96),
        "head_dim_stride_2": dict(base, q=strided[0], k=strided[1], v=strided[2], go=strided[3]),
    }


@pytest.mark.parametrize("name", list(_fast_call_variants()))
def test_fast_path_only_for_its_case(name, monkeypatch, routed_calls):
    monkeypatch.setenv("ATTNKIT_TRITON_HOPPER", "1")
    c = _fast_call_variants()[name]
    p, seed = c.get("dropout_p", 0.0), 5
    out, lse = triton_softmax.softmax_fwd(c["q"], c["k"], c["v"], c["mask"], None, False, p, seed,
                                          c.get("fwd_config"), **c["fwd_kw"])
    triton_softmax.softmax_bwd(c["go"], c["q"], c["k"], c["v"], out, lse, c["mask"], None, False,
                               p, seed, c.get("bwd_config"), **c["bwd_kw"])
    assert routed_calls == []


@pytest.mark.parametrize("mode", ["0", "auto"])
def test_fast_path_off_and_auto_off_hopper(mode, monkeypatch, routed_calls):
    # "auto" takes the path on compute capability 9.x only (where it was measured).
    monkeypatch.setenv("ATTNKIT_TRITON_HOPPER", mode)
    q, k, v, go = make_inputs(1, 2, 2, 9, 11, 64, 64, F16)
    run_kernels(q, k, v, go, None, True)
    on_hopper = (mode == "auto" and q.is_cuda and not triton_softmax.INTERPRETED
                 and torch.cuda.get_device_capability(q.device)[0] == 9)
    assert routed_calls == (["fast_fwd", "fast_bwd"] if on_hopper else [])


def test_fast_path_still_rejects_bad_options(monkeypatch):
    monkeypatch.setenv("ATTNKIT_TRITON_HOPPER", "1")
    q, k, v, _ = make_inputs(1, 1, 1, 4, 4, 64, 64, F16)
    with pytest.raises(ValueError, match="window"):
        triton_softmax.softmax_fwd(q, k, v, None, None, False, window_left=-5)


def test_fast_bwd_takes_tma_reduce_only_where_it_runs(monkeypatch):
    # FAST_BWD_REDUCE (D=64 causal): taken where this Triton can run descriptor reduce-adds and
    # the tensors are aligned for descriptors; split everywhere else (the interpreter included).
    taken = []
    monkeypatch.setattr(softmax_hopper, "hopper_bwd",
                        lambda *a, variant, config: taken.append(variant.dq) or (None, None, None))
    q, k, v, go = make_inputs(1, 2, 2, 9, 11, 64, 64, F16)
    out, lse = torch.zeros_like(q), torch.zeros(1, 2, 9, device=q.device)
    softmax_hopper.fast_bwd(go, q, k, v, out, lse, None, True)
    expected = "tma_reduce" if not softmax_hopper.variant_support(softmax_hopper.BWD_VARIANTS["tma_reduce"]) \
        else "split"
    assert taken == [expected]
    monkeypatch.setattr(softmax_hopper, "variant_support", lambda variant: "")
    taken.clear()
    softmax_hopper.fast_bwd(go, q, k, v, out, lse, None, True)
    softmax_hopper.fast_bwd(go, q, k, v, out, lse, None, False)  # not in the table
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape).copy_(q)
    softmax_hopper.fast_bwd(go, misaligned, k, v, out, lse, None, True)
    assert taken == ["tma_reduce", "split", "split"]
    q128, k128, v128, go128 = make_inputs(1, 2, 2, 9, 11, 128, 128, F16)
    taken.clear()
    softmax_hopper.fast_bwd(go128, q128, k128, v128, torch.zeros_like(q128), lse, None, True)
    assert taken == ["split"]
    # torch.use_deterministic_algorithms(True): never the reduce-adds (dQ's shares in no fixed order).
    taken.clear()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    softmax_hopper.fast_bwd(go, q, k, v, out, lse, None, True)
    assert taken == ["split"]


@pytest.mark.gpu
def test_gpu_deterministic_mode_backward_is_reproducible():
    # Under torch.use_deterministic_algorithms(True) the default backward (on an sm_90 GPU the
    # fast path, whose D=64 causal case adds dQ by reduce-adds otherwise) gives the same bits
    # on every run.
    q, k, v, go = make_inputs(2, 8, 8, 1000, 1000, 64, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(attnkit.softmax_attention(q, k, v, is_causal=True), (q, k, v), go)
                for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_fast_path_bf16(d, causal, routed_calls):
    # Default mode: taken on an sm_90 GPU, this file's kernels elsewhere; both must be right.
    b, h, hk, n, m = 2, 4, 2, 1000, 777
    q, k, v, go = make_inputs(b, h, hk, n, m, d, d, torch.bfloat16)
    got = run_kernels(q, k, v, go, None, causal)
    if torch.cuda.get_device_capability()[0] == 9:
        assert routed_calls == ["fast_fwd", "fast_bwd"]
    check_against_reference(got, q, k, v, go, None, causal)


def test_host_cdiv_and_next_pow2_match_triton():
    # kernels/_flash.py's host helpers stand in for triton.cdiv / next_power_of_2 (ConstexprFunctions,
    # ~5 us a call) in every launcher's grid and padding arithmetic.
    from attnkit.kernels._flash import cdiv, next_pow2, pow2

    for a in range(0, 600):
        assert next_pow2(a) == triton.next_power_of_2(a), a
        assert pow2(a) == max(16, triton.next_power_of_2(a)), a
        for b in (1, 3, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)

"""Shared helpers of attnkit's tests: the tolerance rule of DESIGN.md and independent float64
ground truths.  ``from attnkit_testing import ...`` works from any test module: tests/ has no
``__init__.py`` and holds conftest.py, so pytest puts tests/ on sys.path (rootdir-relative
"rootdir/conftest" insertion, the default ``prepend`` import mode).

- :func:`assert_close_to_reference` -- the tolerance rule for one tensor.
- :func:`loop_attention` -- softmax attention in float64, one query row at a time (a formulation
  independent of the library's reference: index arithmetic for GQA, ``where`` for masks,
  elementwise products summed).
- :func:`loop_sparse_attention` (with :func:`sparse_allowed_keys`) -- sparse attention in
  float64 from the pattern definitions: explicit loops over the allowed keys, no mask tensor.
- :func:`make_qkv`, :func:`make_mask` -- seeded random inputs and masks.
- :func:`state_reference` -- linear attention with a recurrent state (S0, z0 in; S, z and the raw
  normalizer out) in the recurrent form: cumulative sums of outer products.
- :func:`has_cpu_kernel`, :func:`native_cuda_ops` -- what the tests of the C++ / CUDA kernels
  (tests/csrc) check before they call ``torch.ops.attnkit``.
- :func:`num_threads` -- torch's CPU thread count set for a block (thread-count invariance tests).
- :func:`make_hopfield_inputs`, :func:`loop_hopfield_update` -- Hopfield inputs and the update
  op's outputs in float64, one retrieval at a time (Triton and CUDA tests of the op).
- :func:`without_spread_nan`, :func:`finite_inputs`, :func:`spread_free_run` -- a low-precision
  *tolerance* reference on poisoned inputs without the NaN that a torch matmul can spread
  between rows, and :func:`nan_spreading_matmul`, which emulates that defect on any machine
  (issue 24).
- :func:`triton_bf16_checkable`, :data:`TRITON_BF16`, :data:`TRITON_BF16_TEST` -- bfloat16 in
  the Triton kernels' tests (a dtype parameter; a whole test): on a GPU, and on CPU under the
  interpreter that tests/conftest.py fixed (tests/triton_interpreter_bf16.py).
"""
import contextlib
import math

import pytest
import torch

F64 = torch.float64
LOW_PRECISION = (torch.float16, torch.bfloat16)


def triton_bf16_checkable() -> bool:
    """Whether the Triton kernels' bfloat16 paths can be checked here: on a GPU, or under the
    interpreter once tests/triton_interpreter_bf16.py is installed (tests/conftest.py does)."""
    if torch.cuda.is_available():
        return True
    try:
        import triton_interpreter_bf16
    except ImportError:  # pragma: no cover
        return False
    return triton_interpreter_bf16.installed()


_NO_BF16 = pytest.mark.skipif(
    not triton_bf16_checkable(),
    reason="bfloat16 Triton needs a GPU or tests/triton_interpreter_bf16.py's interpreter fix "
           "(it did not install on this Triton)")
# bfloat16 in a Triton test's dtype list: skipped, saying why, where it cannot be checked (a
# Triton whose interpreter the fix does not fit) -- never silently dropped.
TRITON_BF16 = pytest.param(torch.bfloat16, id="bf16", marks=_NO_BF16)
# A bfloat16 Triton test at interpreter sizes: gpu-marked on a GPU machine (`pytest -m gpu`
# selects it there), run under the fixed interpreter elsewhere.
TRITON_BF16_TEST = pytest.mark.gpu if torch.cuda.is_available() else _NO_BF16

__all__ = ["F64", "LOW_PRECISION", "assert_close_to_reference", "loop_attention", "loop_sparse_attention",
           "sparse_allowed_keys", "make_qkv", "make_mask", "state_reference", "has_cpu_kernel",
           "native_cuda_ops", "num_threads", "make_hopfield_inputs", "loop_hopfield_update",
           "finite_inputs", "without_spread_nan", "spread_free_run", "nan_spreading_matmul",
           "triton_bf16_checkable", "TRITON_BF16", "TRITON_BF16_TEST"]


@contextlib.contextmanager
def num_threads(n: int):
    """torch's intra-op thread count is ``n`` inside the block, and what it was again after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(before)


def finite_inputs(*tensors, keep_neginf: bool = False):
    """Copies of ``tensors`` (None and non-floating tensors pass through) whose NaN and ±inf
    entries are 0: the inputs of the second run of :func:`without_spread_nan`.
    ``keep_neginf``: keep -inf entries (an additive mask's "masked out").  A tensor that requires
    grad comes back as a new leaf that requires grad."""
    def clean(t):
        if t is None or not t.is_floating_point():
            return t
        t = t.detach()
        ok = torch.isfinite(t) | (torch.isneginf(t) if keep_neginf else torch.zeros_like(t, dtype=torch.bool))
        return torch.where(ok, t, torch.zeros_like(t)).requires_grad_(t.requires_grad)

    cleaned = [clean(t) for t in tensors]
    return cleaned[0] if len(cleaned) == 1 else tuple(cleaned)


def without_spread_nan(run, clean_run):
    """A float16 / bfloat16 reference run on poisoned inputs that only sets a *tolerance*
    (DESIGN.md's rule), with each NaN entry taken from ``clean_run`` -- the same reference run
    on :func:`finite_inputs` of those inputs.  Tensors, or (nested) tuples / lists of them (None
    kept).

    Why (issue 24): torch 2.13's bfloat16 CPU matmul on AMX machines (oneDNN, K > 32 and
    K % 32 != 0) writes the NaN of row i + 1 of A into output row i as well, so a reference run
    on poisoned inputs can hold NaN in a row the poison does not reach, and the tolerance rule
    then fails on the reference, not on the kernel.  Such a row does not depend on the poisoned
    entry at all, so the clean run has its value exactly; every other entry stays the poisoned
    run's (an entry that an infinite input reaches without a NaN -- a score of -inf, say --
    keeps its true low-precision value).  Entries where the poison really reaches are NaN in the
    float64 reference, and the tests never read the tolerance run there.
    """
    if run is None or isinstance(run, torch.Tensor):
        if run is None or not run.is_floating_point():
            return run
        return torch.where(torch.isnan(run), clean_run.to(run.dtype), run)
    return type(run)(without_spread_nan(a, b) for a, b in zip(run, clean_run))


def spread_free_run(run, *tensors, keep_neginf=()):
    """``run(*tensors)`` -- a low-precision reference that sets a tolerance -- through
    :func:`without_spread_nan`: when its result holds a NaN, ``run`` is called again on
    :func:`finite_inputs` of the tensors (the positions in ``keep_neginf`` keep their -inf: an
    additive mask) and those NaN entries are taken from that run.  ``run`` returns a tensor or
    (nested) tuples / lists of tensors (None allowed)."""
    result = run(*tensors)

    def has_nan(r):
        if r is None or isinstance(r, torch.Tensor):
            return r is not None and r.is_floating_point() and bool(torch.isnan(r).any())
        return any(has_nan(x) for x in r)

    if not has_nan(result):
        return result
    clean = [finite_inputs(t, keep_neginf=i in keep_neginf) for i, t in enumerate(tensors)]
    return without_spread_nan(result, run(*clean))


class _NaNSpreadingMatmul(torch.overrides.TorchFunctionMode):
    """See :func:`nan_spreading_matmul`."""

    _OPS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
            torch.mm, torch.Tensor.mm}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self._OPS or len(args) < 2:
            return out
        a = args[0]
        if not (isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION and a.dim() >= 2 and out.dim() >= 2):
            return out
        with torch.no_grad():
            # Output row i also turns NaN when row i + 1 of A holds a NaN (within a matrix).
            below = torch.isnan(a).any(-1)[..., 1:]              # [..., N - 1]: rows 1..N-1 of A
            spread = torch.zeros(torch.broadcast_shapes(below.shape[:-1], out.shape[:-2]) + (out.shape[-2],),
                                 dtype=torch.bool, device=out.device)
            spread[..., :-1] = below
            if not spread.any():
                return out
            out = out.clone()
            out[spread.unsqueeze(-1).expand(out.shape)] = float("nan")
        return out


def nan_spreading_matmul():
    """A context in which every float16 / bfloat16 ``matmul`` / ``@`` / ``bmm`` / ``mm`` of torch
    behaves like torch 2.13's bfloat16 matmul on an Intel Xeon with AMX (issue 24): output row
    i is NaN whenever row i + 1 of the left operand holds a NaN, on any machine.  Tests run their
    low-precision references under it to show that their tolerance logic judges the kernel by
    the rows a poison reaches, and only those (the regression tests of issue 24)."""
    return _NaNSpreadingMatmul()


def has_cpu_kernel(name: str) -> bool:
    """Whether ``attnkit::<name>`` has a CPU kernel registered (attnkit._C built and loaded)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"attnkit::{name}", "CPU")
    except RuntimeError:  # schema not registered: attnkit._C is not built
        return False


def native_cuda_ops():
    """``torch.ops.attnkit`` once attnkit._C is known to hold its CUDA kernels (the ``ops``
    fixture of the tests/csrc/test_*_cuda.py files, which run on a GPU only)."""
    from attnkit._dispatch import native

    assert native().built_with_cuda(), (
        "attnkit._C was built without CUDA; reinstall on this machine with nvcc present "
        "(ATTNKIT_BUILD_CUDA=1 pip install --no-build-isolation -e .)"
    )
    return torch.ops.attnkit


def _max_finite_err(x: torch.Tensor, ref64: torch.Tensor, name: str) -> float:
    """max |x - ref64| over the finite entries, after checking that x has no NaN and the same
    infinities as ref64 (lse is -inf on fully masked rows).  A GPU result is compared on the
    reference's device (torch.equal raises on tensors of two devices: on an H100 every GPU
    sparse Triton test failed on that, not on its numbers)."""
    ref64 = ref64.detach()
    x = x.detach().to(device=ref64.device, dtype=F64)
    assert not torch.isnan(x).any(), f"{name}: NaN in the result"
    assert not torch.isnan(ref64).any(), f"{name}: NaN in the float64 reference"
    inf_x, inf_ref = torch.isinf(x), torch.isinf(ref64)
    assert torch.equal(inf_x, inf_ref), f"{name}: infinities differ from the reference"
    assert torch.equal(x[inf_x], ref64[inf_ref]), f"{name}: signs of infinities differ"
    finite = ~inf_ref
    if not finite.any():
        return 0.0
    return (x[finite] - ref64[finite]).abs().max().item()


def assert_close_to_reference(out, ref64, ref_lowp=None, *, grad=False, name="output", dtype=None):
    """The test rule of DESIGN.md, for one tensor (an output, an lse or a gradient).

    ``ref64`` is the float64 ground truth computed from the *same* (already rounded) inputs.
    ``dtype``: the dtype of the computation's inputs, which picks the rule (default
    ``out.dtype``; pass it for an lse, which is float32 for float16 / bfloat16 inputs).
    - float64: max error <= 1e-10 · max|ref64| (both are exact up to rounding).
    - float32: max error <= 2e-5 · max|ref64| (1e-4 for gradients, ``grad=True``).
    - float16 / bfloat16: max error <= 2 · (max error of ``ref_lowp``) + 1e-3, where
      ``ref_lowp`` is the reference run in that dtype (the error a naive implementation makes).
    Non-finite entries (lse = -inf) must match exactly; NaN never passes.
    """
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert ref64.dtype == F64, f"{name}: the reference must be float64; got {ref64.dtype}"
    err = _max_finite_err(out, ref64, name)
    finite = torch.isfinite(ref64)
    size = ref64.detach()[finite].abs().max().item() if finite.any() else 0.0
    dtype = out.dtype if dtype is None else dtype
    if dtype == F64:
        tol = 1e-10 * size
    elif dtype == torch.float32:
        tol = (1e-4 if grad else 2e-5) * size
    elif dtype in LOW_PRECISION:
        assert ref_lowp is not None, f"{name}: a {dtype} computation needs ref_lowp"
        tol = 2.0 * _max_finite_err(ref_lowp, ref64, f"{name} (reference in {dtype})") + 1e-3
    else:
        raise AssertionError(f"{name}: unexpected dtype {dtype}")
    assert err <= tol, f"{name} ({dtype} inputs): max error {err:.3e} > tolerance {tol:.3e}"


def loop_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, *, keep=None, dropout_p=0.0):
    """Independent float64 ground truth with SDPA semantics; returns (out, lse).

    Differentiable (q, k, v and a floating mask), and gradient-safe on fully masked rows.
    ``keep``: optional bool [B, H, N, M] dropout mask (True = kept, scaled by 1 / (1 - p)).
    """
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    b, h, n, d = q.shape
    hk, m, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if m == 0 or n == 0:
        out = q.new_zeros(b, h, n, dv) + 0.0 * (q.sum() + k.sum() + v.sum())
        return out, torch.full((b, h, n), float("-inf"), dtype=F64)
    kv_head = torch.arange(h) // (h // hk)  # query head -> its key/value head
    kh, vh = k[:, kv_head], v[:, kv_head]  # [B, H, M, *]
    allowed = torch.ones(b, h, n, m, dtype=torch.bool)
    bias = torch.zeros(b, h, n, m, dtype=F64)
    if attn_mask is not None:
        full = torch.broadcast_to(attn_mask, (b, h, n, m))
        if attn_mask.dtype == torch.bool:
            allowed = full
        else:
            bias = full.to(F64)
            allowed = full > float("-inf")
    outs, lses = [], []
    for i in range(n):
        ok = allowed[:, :, i, :].clone()
        if is_causal:
            ok[..., i + 1:] = False
        s = (q[:, :, i, None, :] * kh).sum(-1) * scale + bias[:, :, i, :]  # [B, H, M]
        any_ok = ok.any(-1, keepdim=True)
        top = torch.where(ok, s, float("-inf")).amax(-1, keepdim=True).detach()
        top = torch.where(any_ok, top, torch.zeros_like(top))
        w = torch.where(ok, torch.exp(torch.where(ok, s, top) - top), torch.zeros_like(s))
        den = w.sum(-1, keepdim=True)
        den = torch.where(any_ok, den, torch.ones_like(den))
        p = w / den
        if keep is not None:
            p = p * keep[:, :, i, :] / (1.0 - dropout_p)
        outs.append((p[..., None] * vh).sum(-2))
        lses.append(torch.where(any_ok, torch.log(den) + top, torch.full_like(den, float("-inf")))[..., 0])
    return torch.stack(outs, dim=2), torch.stack(lses, dim=2)


def sparse_allowed_keys(p, h, i, n):
    """Keys query i of head h may attend under pattern ``p`` (an ``attnkit.patterns`` pattern),
    straight from the definitions of the foundation issue."""
    from attnkit import patterns

    keys = []
    for j in range(n):
        if isinstance(p, patterns.Strided):
            d = i - j
            keep = ((0 <= d <= p.stride) if p.causal else abs(d) <= p.stride) or d % p.stride == 0
        elif isinstance(p, patterns.Fixed):
            keep = j // p.stride == i // p.stride or j % p.stride >= p.stride - p.summary
        elif isinstance(p, patterns.Star):
            if p.relay in (i, j):
                keep = True
            else:
                si, sj = i - (i > p.relay), j - (j > p.relay)
                d = abs(si - sj)
                keep = (min(d, n - 1 - d) if p.cyclic else d) <= p.radius
        else:
            layout = p.layout
            keep = bool(layout[h % layout.shape[0], i // p.block, j // p.block])
        if keep and (j <= i or not p.causal):
            keys.append(j)
    return keys


def loop_sparse_attention(q, k, v, p, scale=None):
    """Independent float64 ground truth of sparse attention (not differentiable): per query row,
    an elementwise dot product and a max-shifted softmax over just its allowed keys; rows with
    no allowed key give zeros."""
    q, k, v = q.detach().to(F64), k.detach().to(F64), v.detach().to(F64)
    b_, h_, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b_, h_, n, v.shape[-1], dtype=F64)
    for h in range(h_):
        for i in range(n):
            keys = sparse_allowed_keys(p, h, i, n)
            if not keys:
                continue  # nothing to attend: zeros
            for b in range(b_):
                s = (q[b, h, i][None, :] * k[b, h, keys]).sum(-1) * scale
                w = torch.exp(s - s.max())
                out[b, h, i] = (w[:, None] * v[b, h, keys]).sum(0) / w.sum()
    return out


def make_qkv(b, h, hk, n, m, d, dv, seed=0, dtype=F64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=g, dtype=F64) for shape in
               ((b, h, n, d), (b, hk, m, d), (b, hk, m, dv))]
    return [t.to(dtype).requires_grad_(requires_grad) for t in tensors]


def make_mask(kind, b, h, n, m, seed=0, shape=None, dtype=F64):
    """None | "bool" | "additive" mask (shape defaults to [B, H, N, M]).  A bool mask keeps about
    70% of the entries, an additive one is N(0, 1) with about 20% -inf; either way key i % M stays
    visible to row i, so no row is fully masked."""
    if kind in (None, "causal"):
        return None
    g = torch.Generator().manual_seed(seed + 1000)
    shape = (b, h, n, m) if shape is None else shape
    if kind == "bool":
        mask = torch.rand(shape, generator=g) < 0.7
        rows = torch.arange(shape[-2])
        mask[..., rows, rows % shape[-1]] = True  # one visible key per row (if m > 0)
        return mask
    bias = torch.randn(shape, generator=g, dtype=F64)
    bias = bias.masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf"))
    rows = torch.arange(shape[-2])
    bias[..., rows, rows % shape[-1]] = 0.0
    return bias.to(dtype)


def state_reference(q, k, v, s0, z0, *, causal, feature_map, normalize, eps, scale):
    """(out [B,H,N,Dv], den raw [B,H,N], S_final [B,H,D,Dv], z_final [B,H,D]) of linear attention
    with an initial state s0 [B,H,D,Dv], z0 [B,H,D], from the recurrent form: query i sees
    S0 + the sum of φ(k_j) v_jᵀ over j <= i (causal) or over all j; den = φ(q_i)·z_i.
    Differentiable (autograd gives the ground-truth gradients, those of s0, z0 included); run it
    in float64 for a ground truth."""
    from attnkit.reference.linear import feature_map_reference  # (this module needs only torch to import)

    pq = feature_map_reference(q, feature_map)
    pk = feature_map_reference(k, feature_map)
    outer = pk[..., :, None] * v[..., None, :]
    s_final, z_final = s0 + outer.sum(2), z0 + pk.sum(2)
    if causal:
        num = torch.einsum("bhnd,bhnde->bhne", pq, s0[:, :, None] + outer.cumsum(2))
        den = (pq * (z0[:, :, None] + pk.cumsum(2))).sum(-1)
    else:
        num = pq @ s_final
        den = (pq * z_final[:, :, None]).sum(-1)
    out = num / (den[..., None] + eps) if normalize else num * scale
    return out, den, s_final, z_final


def linear_dq_term_scale(q, k, v, grad_out, *, causal, feature_map, normalize, eps, scale):
    """Element-wise [B,H,N,D] size of the terms that linear attention's dq sums, in float64:
    |φ'(q_i)| ⊙ (r_i |S_i g_i| + |r_i δ_i| |z_i|) with r = 1/(den + eps), δ_i = g_i·out_i when
    normalized (r = scale, no second term otherwise).

    Normalized, the two terms cancel wherever out_i does not depend on q_i -- exactly with a
    single key (out = v for any q, up to eps), nearly with few keys -- so dq is rounding noise
    there, and its error can only be held to a tolerance relative to these terms, not to |dq|
    (the test rule for a result that cancels, as for a single key's dq in the sparse tests)."""
    from attnkit.reference.linear import feature_map_reference

    q, k, v, g = (t.detach().to(F64) for t in (q, k, v, grad_out))
    qq = q.clone().requires_grad_()
    pq = feature_map_reference(qq, feature_map)
    dphi = torch.autograd.grad(pq.sum(), qq)[0].abs()  # φ' element-wise (φ acts element-wise)
    pq = pq.detach()
    pk = feature_map_reference(k, feature_map)
    if causal:
        states = (pk[..., :, None] * v[..., None, :]).cumsum(2)  # [B,H,N,D,Dv]
        zs = pk.cumsum(2)
    else:
        states = (pk.transpose(-2, -1) @ v)[:, :, None].expand(*q.shape, v.shape[-1])
        zs = pk.sum(2, keepdim=True).expand_as(q)
    s_g = torch.einsum("bhnde,bhne->bhnd", states, g).abs()
    if not normalize:
        return dphi * abs(scale) * s_g
    den = (pq * zs).sum(-1)
    r = 1.0 / (den + eps)
    out = torch.einsum("bhnd,bhnde->bhne", pq, states) * r[..., None]
    delta = (g * out).sum(-1)
    return dphi * (r.abs()[..., None] * s_g + (r * delta).abs()[..., None] * zs.abs())


def linear_dk_term_scale(q, k, v, grad_out, *, causal, feature_map, normalize, eps, scale):
    """Element-wise [B,H,M,D] size of the terms that linear attention's dk sums, in float64:
    |φ'(k_j)| ⊙ Σ_{i sees j} (|r_i| |g_i·v_j| + |r_i δ_i|) |φ(q_i)| (normalized; r = scale and
    no δ term otherwise).  Normalized, the two terms cancel where out does not depend on k --
    exactly with a single key (out = v), so dk is rounding noise there like dq (see
    linear_dq_term_scale); measured on the CPU kernel: 1.2e-7 against a float64 |dk| of 1e-12."""
    from attnkit.reference.linear import feature_map_reference

    q, k, v, g = (t.detach().to(F64) for t in (q, k, v, grad_out))
    kk = k.clone().requires_grad_()
    pk = feature_map_reference(kk, feature_map)
    dphi = torch.autograd.grad(pk.sum(), kk)[0].abs()
    pk = pk.detach()
    pq = feature_map_reference(q, feature_map)
    n, m = q.shape[-2], k.shape[-2]
    gv = (g @ v.transpose(-1, -2)).abs()  # [B,H,N,M] |g_i·v_j|
    visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril()
    if not normalize:
        terms = abs(scale) * gv
    else:
        if causal:
            states = (pk[..., :, None] * v[..., None, :]).cumsum(2)
            zs = pk.cumsum(2)
        else:
            states = (pk.transpose(-2, -1) @ v)[:, :, None].expand(*q.shape, v.shape[-1])
            zs = pk.sum(2, keepdim=True).expand_as(q)
        r = 1.0 / ((pq * zs).sum(-1) + eps)
        out = torch.einsum("bhnd,bhnde->bhne", pq, states) * r[..., None]
        delta = (g * out).sum(-1)
        terms = r.abs()[..., None] * gv + (r * delta).abs()[..., None]
    terms = terms * visible.to(F64)
    return dphi * (terms.transpose(-1, -2) @ pq.abs())


def make_hopfield_inputs(b, h, s, n, d, dv=None, dtype=torch.float32, seed=0, scale=1.0, device="cpu"):
    """(state [B, H, S, D] (times ``scale``), stored [B, H, N, D], values [B, H, N, Dv] or None
    for ``dv`` None): seeded float64 normal draws rounded to ``dtype``, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(b, h, s, d, generator=g, dtype=F64) * scale
    stored = torch.randn(b, h, n, d, generator=g, dtype=F64)
    values = None if dv is None else torch.randn(b, h, n, dv, generator=g, dtype=F64)
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return cast(state), cast(stored), cast(values)


def loop_hopfield_update(state, stored, values, beta, steps, tol, final_state):
    """The four outputs of the Hopfield update op (csrc/ops.cpp: out, states, lse, applied) in
    float64 on the CPU, one retrieval at a time, the tol rule row by row."""
    xi, x = state.detach().double().cpu(), stored.detach().double().cpu()
    v = None if values is None else values.detach().double().cpu()
    updates = steps if v is None else steps - 1
    active = torch.ones(xi.shape[:-1], dtype=torch.bool)
    states, lses, applied = [xi], [], []

    def retrieve(q, val):
        scores = beta * q @ x.transpose(-2, -1)
        return torch.softmax(scores, -1) @ val, torch.logsumexp(scores, -1)

    for _ in range(updates):
        new, lse = retrieve(xi, x)
        lses.append(lse)
        applied.append(active.clone())
        change = (new - xi).abs().amax(-1)
        xi = torch.where(active.unsqueeze(-1), new, xi)
        if tol is not None:
            active = active & (change > tol)
        states.append(xi)
    if v is None:
        out = xi
    else:
        out, lse = retrieve(xi, v)
        lses.append(lse)
        last = torch.where(active.unsqueeze(-1), retrieve(xi, x)[0], xi)
        states.append(last if final_state else torch.zeros_like(xi))
    empty = torch.zeros((0,) + xi.shape[:-1], dtype=torch.bool)
    return out, torch.stack(states), torch.stack(lses), torch.stack(applied) if applied else empty


def poison(spec, q, k, v, mask):
    """Writes one non-finite value into an input: ``spec`` = (tensor name, index, value) with the
    name "q", "k", "v" or "mask"; an index of fewer dims fills that whole slice."""
    name, index, value = spec
    {"q": q, "k": k, "v": v, "mask": mask}[name][index] = value


def assert_nonfinite_like_reference(got, ref64, ref_low, visible, *, dtype, v=None):
    """Issue 15's rule for NaN / ±inf inputs: ``got`` and the references are (out, lse, dq, dk,
    dv) of one attention call; ``visible`` bool [B, H, N, M] says which key each query row sees.

    - out, lse: NaN exactly where the float64 reference has it (a NaN in q poisons its row, a NaN
      or +inf in k or a float mask the rows that see it); with a NaN in v (``v_poisoned``) the
      reference also reaches hidden rows through 0 · NaN in P V, so out's NaN only has to lie
      within the reference's and cover the NaN's column on every row that sees it (pass ``v``).
    - gradients: NaN only where the reference has it (which also has 0 · NaN products on keys a
      NaN row cannot see, tile by tile in a kernel), and at least on the rows whose out is NaN
      (dq) and on every key such a row sees (dk, dv, summed over the heads that share the key).
    - every other entry: the usual tolerance (assert_close_to_reference) on the finite part.
    """
    names = ("out", "lse", "dq", "dk", "dv")
    v_poisoned = v is not None and bool(torch.isnan(v).any())
    out_ref = ref64[0].detach().cpu()
    vis = visible.cpu().expand(*out_ref.shape[:2], *visible.shape[-2:])
    poisoned = torch.isnan(out_ref).all(-1) if not v_poisoned else torch.zeros(out_ref.shape[:3], dtype=torch.bool)
    hk = got[3].shape[1]
    # keys each kv head must carry a NaN gradient for: seen by a poisoned row of its group
    seen = (vis & poisoned[..., None]).reshape(vis.shape[0], hk, -1, *vis.shape[-2:]).any(2).any(2)
    for i, name in enumerate(names):
        x, r = got[i].detach().cpu(), ref64[i].detach().cpu()
        nan_x, nan_r = torch.isnan(x), torch.isnan(r)
        if i < 2 and not v_poisoned:
            assert torch.equal(nan_x, nan_r), (
                f"{name}: NaN at {int(nan_x.sum())} entries, the float64 reference at {int(nan_r.sum())}")
        else:
            assert not (nan_x & ~nan_r).any(), f"{name}: NaN where the float64 reference has none"
            if name == "out":  # v_poisoned: rows that see a NaN value, in its column
                nan_v = torch.isnan(v.detach().cpu()).repeat_interleave(out_ref.shape[1] // hk, dim=1)
                must = (vis.to(F64) @ nan_v.to(F64)) > 0
                assert nan_x[must].all(), "out: a row that sees a NaN value lost it"
            elif name == "dq":
                assert nan_x[poisoned].all(), "dq: a NaN row's gradient lost the NaN"
            elif name in ("dk", "dv"):
                assert nan_x[seen].all(), f"{name}: a key a NaN row sees lost the NaN"
        keep = ~(nan_x | nan_r)
        low = ref_low[i].detach().cpu() if ref_low is not None else None
        assert_close_to_reference(
            torch.where(keep, x.to(F64), 0.0).to(x.dtype), torch.where(keep, r, 0.0),
            None if low is None else torch.where(keep, low.to(F64), 0.0).to(low.dtype),
            dtype=dtype, grad=i >= 2, name=name)


def rotary_reference(x, cos, sin, positions, interleaved):
    """x [B, N, H, D] with token (b, t) at positions[b][t]: each channel pair rotated, one by one."""
    out = x.clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            p = positions[b][t]
            for i in range(half):
                a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                xa, xc = x[b, t, :, a].double(), x[b, t, :, c].double()
                cs, sn = cos[p, i].double(), sin[p, i].double()
                out[b, t, :, a] = (xa * cs - xc * sn).to(x.dtype)
                out[b, t, :, c] = (xa * sn + xc * cs).to(x.dtype)
    return out


def fa_reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None, sinks=None):
    """(out [B, N, H, Dv], lse [B, H, N]) by FlashAttention's definitions, in q's dtype: query i
    sees key j iff ``j <= i + M - N + right`` (right = 0 when causal) and, with left >= 0,
    ``j >= i + M - N - left``; the scores are scale · q·k, capped (softcap · tanh(s / softcap)),
    minus slope · |i + M - N - j|; ``sinks`` [H]: one more logit per head in each row's
    denominator, with no value.  A row that sees no key: out 0, lse -inf (with sinks: the sink)."""
    batch, n, heads, head_dim = q.shape
    m, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, kx) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n)[:, None]
    j = torch.arange(m)[None, :]
    dist = i + m - n - j  # how far key j lies left of query i's diagonal
    if alibi is not None:
        slopes = alibi.to(s.dtype).view(-1 if alibi.dim() == 2 else 1, heads, 1, 1)
        s = s - slopes * dist.abs().to(s.dtype)
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(n, m, dtype=torch.bool)
    if right >= 0:
        visible &= dist >= -right
    if left >= 0:
        visible &= dist <= left
    s = s.masked_fill(~visible, -math.inf)
    if sinks is not None:  # one more logit per head, with no value (gpt-oss's s_aux)
        s = torch.cat([s, sinks.to(s.dtype).view(1, heads, 1, 1).expand(batch, heads, n, 1)], dim=-1)
        visible = torch.cat([visible, visible.new_ones(n, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(visible, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    if sinks is not None:
        p = p[..., :m]
    out = torch.einsum("bhnm,bmhd->bnhd", p.to(v.dtype), vx)
    return out, lse

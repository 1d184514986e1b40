"""Shared machinery of the differential fuzz tests (issue 15): every public op x every backend
usable here against the float64 reference, on cases that hypothesis generates.

Budget: each test has a fixed CI example count and runs derandomized (the same cases on every
run, no example database).  ``ATTNKIT_FUZZ_EXAMPLES=<n>`` gives every test n examples drawn
at random instead (local runs, the GPU command); a failure prints the blob that replays it
(``@reproduce_failure``).

Inputs: hypothesis draws the *structure* of a case (sizes, dtype, layout, mask, which special
value goes where, a seed); the values come from a seeded torch generator (drawing tensors
element by element through hypothesis would cost most of the budget).  Every input is a view
of a leaf ``base`` tensor (contiguous, transposed, strided, expanded with stride 0, or sliced
from one fused qkv tensor), so that gradients are compared on the bases: the float64 ground
truth applies the same view to the base in float64.

Checks (the semantics of issue 15, DESIGN.md's tolerance rule):

- ``exact`` mode (no special value in V): the result is NaN / ±inf exactly where the float64
  reference is, and every row that must be poisoned (a NaN in its query, in a key it sees, in
  its mask entries) is -- checked on the reference too; elsewhere the finite values are within
  the tolerance.
- ``v`` mode (NaN / ±inf in values): every entry (row i, column d) whose row sees a non-finite
  v[j, d] is non-finite; other entries may be non-finite only in a column that holds a special
  value (SDPA's 0·NaN within a tile); finite entries are within the tolerance of the reference
  computed with the special values of V replaced by 0.
- a fully masked row (finite query) is exactly 0.
- tolerance (tests/attnkit_testing.py, DESIGN.md): float64 1e-10, float32 2e-5 (gradients 1e-4)
  relative to the largest reference entry; float16 / bfloat16 2x the error of the reference run
  in that dtype plus 1e-3.  Cases with huge (1e4) entries in q / k make scores of size ~1e5:
  there the float32 rounding of the scores alone moves the probabilities by ~1e-3, whatever the
  implementation, so float32 gets the low-precision rule's form on top of its own (2x the error
  of the reference run in float32).
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, reject, settings
from hypothesis import strategies as st

import attnkit
from attnkit._dispatch import triton_interpreted
from attnkit.reference.linear import feature_map_reference
from attnkit_testing import F64, LOW_PRECISION, triton_bf16_checkable

ENV_EXAMPLES = "ATTNKIT_FUZZ_EXAMPLES"
_LOCAL_EXAMPLES = int(os.environ.get(ENV_EXAMPLES, "0") or 0)
HUGE = 1.0e4
CUDA = torch.cuda.is_available()


def fuzz_settings(ci_examples: int):
    """``ci_examples`` derandomized examples, or ATTNKIT_FUZZ_EXAMPLES random ones."""
    return settings(
        max_examples=_LOCAL_EXAMPLES or ci_examples,
        derandomize=not _LOCAL_EXAMPLES,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


# (backend, device) columns; the GPU ones carry the gpu mark (`pytest -m gpu`; skipped without
# CUDA by tests/conftest.py).  Interpreted Triton runs where there is no GPU (conftest sets
# TRITON_INTERPRET=1 there).
BACKENDS = [
    pytest.param("reference", "cpu", id="reference"),
    pytest.param("cpu", "cpu", id="cpu"),
    pytest.param("triton", "cpu", id="triton-interpreted"),
    pytest.param("triton", "cuda", id="triton-gpu", marks=pytest.mark.gpu),
    pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.gpu),
    pytest.param("reference", "cuda", id="reference-gpu", marks=pytest.mark.gpu),
]


def require_backend(family: str, backend: str, device: str) -> None:
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA device")
    if backend == "triton" and device == "cpu" and not triton_interpreted():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set where there is no GPU)")
    status = attnkit.backends()[family][backend]
    if not status.usable:
        pytest.skip(f"{family} / {backend}: {status.reason}")


def interpreted(backend: str, device: str) -> bool:
    return backend == "triton" and device == "cpu"


def dtypes_for(backend: str, device: str, kernel_dtypes=None, interpreted_bf16: bool = True):
    """The dtypes a (backend, device) column fuzzes.  The Triton interpreter's bfloat16 is
    fixed for the tests (tests/triton_interpreter_bf16.py): bfloat16 is fuzzed there too, unless
    the fix did not install on this Triton or the caller says ``interpreted_bf16=False``."""
    if backend == "reference" or backend == "cpu":
        return [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    if interpreted(backend, device):
        bf16 = interpreted_bf16 and triton_bf16_checkable()
        return [torch.float32, torch.float16] + ([torch.bfloat16] if bf16 else [])
    return list(kernel_dtypes or (torch.float32, torch.float16, torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# inputs: views of leaf bases
# ----------------------------------------------------------------------------------------------

LAYOUTS = ["contiguous", "contiguous", "transposed", "strided", "expanded"]


class Input:
    """A leaf ``base`` and the view that makes the op's input from it."""

    def __init__(self, base: torch.Tensor, view):
        self.base = base
        self.view = view

    def tensor(self) -> torch.Tensor:
        return self.view(self.base)

    def tensor64(self, base64) -> torch.Tensor:
        return self.view(base64)


def make_input(shape, layout: str, gen: torch.Generator, dtype, device) -> Input:
    """Random N(0, 1) values of ``shape`` (rounded to dtype) presented with ``layout``."""
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        base = torch.randn(shape[:-2] + (shape[-1], shape[-2]), generator=gen, dtype=F64)
        view = lambda b: b.transpose(-1, -2)  # noqa: E731
    elif layout == "strided":
        base = torch.randn(shape[:-1] + (2 * shape[-1] + 1,), generator=gen, dtype=F64)
        view = lambda b: b[..., 1::2]  # noqa: E731  (inner stride 2, offset 1)
    elif layout == "expanded" and len(shape) >= 2:
        base = torch.randn(shape[:-2] + (1, shape[-1]), generator=gen, dtype=F64)
        view = lambda b: b.expand(*shape)  # noqa: E731  (stride-0 rows)
    else:
        base = torch.randn(shape, generator=gen, dtype=F64)
        view = lambda b: b  # noqa: E731
    return Input(base.to(device=device, dtype=dtype), view)


def fused_qkv(lead, n, heads, d, gen, dtype, device):
    """q, k, v sliced from one fused projection [*lead, N, 3, H, D] (one base, three views)."""
    base = torch.randn(*lead, n, 3, heads, d, generator=gen, dtype=F64).to(device=device, dtype=dtype)
    return [Input(base, (lambda b, i=i: b[..., i, :, :].transpose(-3, -2))) for i in range(3)]


SPECIALS = ["none", "none", "none", "nan_q", "nan_k", "inf_k", "nan_v", "inf_v", "huge"]


def set_values(inp: Input, kind: str, gen: torch.Generator, within_view: bool = False) -> None:
    """A special value at a random position of ``inp``'s base: "nan", "inf" (random sign),
    "pinf", "huge" (±1e4 at a few positions).  ``within_view``: at positions of the input's own
    view instead -- for q, k, v sliced from one fused base, where a position of the base may
    belong to another of them (session 29: "huge in v" put 1e4 into q and k, scores of 1e8)."""
    target = inp.view(inp.base) if within_view else inp.base  # (the base: contiguous)
    n = target.numel()
    if n == 0:
        return
    count = 3 if kind == "huge" else 1
    idx = torch.randint(n, (count,), generator=gen).tolist()
    signs = (torch.randint(2, (count,), generator=gen) * 2 - 1).tolist()
    with torch.no_grad():
        for i, sgn in zip(idx, signs):  # (row-major: the base's flat index i)
            target[torch.unravel_index(torch.tensor(i), target.shape)] = _special(kind, sgn)


def _special(kind: str, sign: int) -> float:
    if kind == "nan":
        return float("nan")
    if kind == "inf":
        return sign * float("inf")
    if kind == "pinf":
        return float("inf")
    if kind == "huge":
        return sign * HUGE
    raise AssertionError(kind)


def leaves(inputs, requires_grad: bool):
    """(leaf bases as given, their float64 copies) -- the same leaf once for shared bases."""
    ids, out, out64 = {}, [], []
    for inp in inputs:
        key = id(inp.base)
        if key not in ids:
            b = inp.base.detach().clone().requires_grad_(requires_grad)
            b64 = inp.base.detach().to(F64).requires_grad_(requires_grad)
            ids[key] = (b, b64)
        out.append(ids[key][0])
        out64.append(ids[key][1])
    return out, out64


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def _finite_err(x64: torch.Tensor, ref64: torch.Tensor, where: torch.Tensor) -> float:
    if not where.any():
        return 0.0
    return (x64[where] - ref64[where]).abs().max().item()


def value_size(*values) -> float:
    """The largest finite |v| of the value tensors: the size of the terms an attention output
    sums (sum_j p_j v_j with p a distribution, the sinks' share included), the yardstick of its
    float32 rule -- ``tolerance(..., size=value_size(v))`` -- where those terms cancel.  Found by
    session 32's random fuzzing (ATTNKIT_FUZZ_EXAMPLES=2000 test_fuzz_softmax, cpu): float32,
    N = 1, M = 63, Dv = 1, an output of 9e-4 from values of size ~1: the kernel's 2.4e-8 is a
    fifth of float32's eps on the terms, against 2e-5 of the result's own size, 1.8e-8."""
    sizes = [v[torch.isfinite(v)].abs().max().item() for v in values if v is not None and torch.isfinite(v).any()]
    return max(sizes, default=0.0)


def tolerance(dtype, ref64, *, grad=False, naive=None, huge_scores=0.0, unit=None, size=None) -> float:
    """DESIGN.md's rule for one tensor.  ``naive``: the same computation by the reference in
    the inputs' dtype (needed for float16 / bfloat16, and for float32 with huge scores).
    ``huge_scores``: the largest |scaled score| S of a case with 1e4 entries in q / k, else 0;
    ``unit``: what a relative change of the probabilities is a change of (max |V| for an
    output, 1 for an lse -- scores' units --, the gradient's term size; default: its size).
    ``size``: the yardstick of the relative rule when it is not max |ref64| -- a gradient that
    cancels (dq with a single key is exactly 0, computed as p (dp - D) with dp = D) is held to
    the size of the terms it sums, as in tests/attnkit_testing.linear_dq_term_scale."""
    finite = torch.isfinite(ref64)
    largest = ref64[finite].abs().max().item() if finite.any() else 0.0
    size = largest if size is None else max(size, largest)

    def naive_err():
        assert naive is not None, "the low-precision rule needs the reference run in that dtype"
        n64 = naive.detach().to(device=ref64.device, dtype=F64)
        both = finite & torch.isfinite(n64)
        if not torch.equal(both, finite):
            # The naive computation overflowed where the ground truth is finite: the rule has no
            # number to give (the generators avoid such cases; a rare one is dropped).
            reject()
        return _finite_err(n64, ref64, both)

    if dtype == F64:
        # Scores of size S carry ~S eps_f64 of rounding into the probabilities (the kernels' lse
        # kept in natural log and read back in base 2): the float32 case's first-order term, in
        # float64.  Found by session 32's random fuzzing (ATTNKIT_FUZZ_EXAMPLES=2000
        # test_fuzz_sparse, cpu): N = 1, D = 1, q and k holding 1e4 -- one key at score 1e8, P =
        # exp(s - lse) = 1 -+ 1e-8 --: dv 1.8e-9 off against 1e-10 of its size, 5.7e-11.
        eps = torch.finfo(F64).eps
        return 1e-10 * size + 2.0 * eps * huge_scores * (size if unit is None else unit)
    if dtype == torch.float32:
        tol = (1e-4 if grad else 2e-5) * size
        if huge_scores * torch.finfo(torch.float32).eps > 0.5:
            # Scores past ~4e6 (a 1e4 entry of q meeting one of k): their float32 rounding alone
            # is ~1 in absolute, so the probabilities are not determined by the inputs to any
            # precision, and the first-order term below means nothing -- as for a kernel's lse
            # stored in natural log and read back in base 2 (a single key of score 1.5e8 came back
            # with P = 2^16: session 29, test_fuzz_sparse, fused qkv).  Such a case is dropped.
            reject()
        if huge_scores:
            # Scores of size S are themselves rounded to float32 (by any kernel: S eps / 2 at
            # best), which moves the probabilities -- and the result -- by up to ~S eps: the
            # unavoidable error, and the naive float32 reference's as a yardstick.
            eps = torch.finfo(torch.float32).eps
            tol += max(2.0 * naive_err(), 2.0 * eps * huge_scores * (size if unit is None else unit))
        return tol
    if dtype in LOW_PRECISION:
        if huge_scores * torch.finfo(torch.float32).eps > 0.5:
            # The float32 case's reason above holds here too: the kernels compute 16-bit scores
            # in float32.  Session 31's random fuzzing (ATTNKIT_FUZZ_EXAMPLES=1500
            # test_fuzz_sparse, cpu): bfloat16 strided(1), N = 2, fused qkv, q / k holding
            # ±9984 -- a row's single visible key at score 1.41e8 came back from the natural-log
            # lse with P = 18.7 instead of 1, dv 26.6 off.  Dropped, as for float32.
            reject()
        tol = 2.0 * naive_err() + 1e-3
        if huge_scores:
            # The float32 case's first-order term too: the kernels compute 16-bit scores (and
            # keep the lse) in float32, so scores of size S carry ~S eps_f32 of rounding into the
            # probabilities -- which the reference run in the dtype does not show where its
            # softmax is exactly one-hot.  Found by session 32's random fuzzing
            # (ATTNKIT_FUZZ_EXAMPLES=2000 test_fuzz_softmax, cpu): bfloat16, N = 1, M = 33, q
            # holding 1e4, scale 1: the row's winning score 35252 (the next 22867: p one-hot),
            # but the backward's P = exp(s - lse) from float32 s and lse near 3.5e4 (ulp 0.004)
            # came out 1 -+ ~4e-3, and dv = P g moved by that: 1.56e-2 at |g| ~ 3.7, against the
            # rule's 1.34e-2 without this term.
            eps = torch.finfo(torch.float32).eps
            tol += 2.0 * eps * huge_scores * (size if unit is None else unit)
        if grad:
            # The kernels compute a 16-bit gradient in float32 (dP = dO V^T and D = rowsum(dO ∘ O)
            # summed in their own orders): the float32 rule's term, which the reference run in
            # the dtype does not carry where the gradient cancels and that reference comes out
            # exact.  Found by session 29's random fuzzing (ATTNKIT_FUZZ_EXAMPLES=1500
            # test_fuzz_sparse): triton float16 strided(1), N = 1 -- a single key, dq = 0 exactly
            # --, D = 16, v = ±1e4: dq 1.75e-3 against the 16-bit rule's 1.0e-3, dP and D each
            # sums of 16 terms of ~1e4 |dO| in float32.
            tol += 1e-4 * size
        return tol
    raise AssertionError(dtype)


def check_exact(name, out, ref64, tol, required=None, zero_or_nan=None, may_be_nan=None):
    """NaN / ±inf exactly where ``ref64`` has them; ``required`` (bool, broadcastable to out):
    entries that must be non-finite (checked on the reference too); finite entries within
    ``tol``.  ``zero_or_nan`` (bool, broadcastable): entries of rows that see no key but hold
    a NaN query -- 0 (nothing to attend) or NaN (the query's NaN) both stand there, whatever the
    reference says.  ``may_be_nan`` (bool, broadcastable): entries that may be NaN where the
    reference is finite (:func:`amx_spread_rows`); where they are not NaN they are checked as usual."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    x = out.detach().to(device=ref64.device, dtype=F64)
    r = ref64.detach()
    if zero_or_nan is not None:
        loose = torch.broadcast_to(zero_or_nan.to(r.device), r.shape)
        ok = torch.isnan(x) | (x == 0)
        assert ok[loose].all(), f"{name}: a row without keys (NaN query) is neither 0 nor NaN"
        r = torch.where(loose, x, r)
    if may_be_nan is not None:
        r = torch.where(torch.broadcast_to(may_be_nan.to(r.device), r.shape) & torch.isnan(x), x, r)
    if required is not None:
        required = torch.broadcast_to(required.to(r.device), r.shape)
        assert not torch.isfinite(r[required]).any(), \
            f"{name}: the float64 reference drops a NaN / inf that must reach {int(required.sum())} entries"
        lost = required & torch.isfinite(x)
        assert not lost.any(), (
            f"{name}: NaN / inf dropped: {int(lost.sum())} of {int(required.sum())} entries that must "
            f"be non-finite are finite (first at {lost.nonzero()[0].tolist()})"
        )
    for what, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = fn(x) != fn(r)
        assert not diff.any(), (
            f"{name}: {what} pattern differs from the float64 reference at {int(diff.sum())} entries "
            f"(first at {diff.nonzero()[0].tolist()}: got {x[tuple(diff.nonzero()[0])].item()}, "
            f"reference {r[tuple(diff.nonzero()[0])].item()})"
        )
    finite = torch.isfinite(r)
    err = _finite_err(x, r, finite)
    assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"


def amx_spread_rows(backend, dtype, ref64, rows_up=2):
    """For ``backend="reference"`` in bfloat16 on a CPU with AMX-BF16: the rows (bool [..., N])
    up to ``rows_up`` above a row that is non-finite in ``ref64`` [..., N, Dv] -- where torch
    2.13's bfloat16 matmul writes the NaN of its left operand's row i + 1 into output row i too
    (README, "backend='reference' inherits torch's matmul"; oneDNN on AMX, K > 32 and K % 32 != 0),
    once per product the NaN passes through (two in linear attention: the scores, then A V).
    None elsewhere: the kernels, other dtypes and other CPUs get the exact NaN pattern."""
    from attnkit._cpuinfo import cpu_info

    if backend != "reference" or dtype != torch.bfloat16 or "AMX BF16" not in cpu_info()["isa"]:
        return None
    poisoned = ~torch.isfinite(ref64.detach().cpu()).all(-1)
    near = torch.zeros_like(poisoned)
    for s in range(1, rows_up + 1):
        near[..., :-s] |= poisoned[..., s:]
    return near & ~poisoned


def check_v_mode(name, out, clean64, tol, required, allowed):
    """``required``: entries that must be non-finite; ``allowed``: entries that may be (both
    bool, broadcastable to out); finite entries within ``tol`` of ``clean64``."""
    x = out.detach().to(device=clean64.device, dtype=F64)
    required = torch.broadcast_to(required.to(x.device), x.shape)
    allowed = torch.broadcast_to(allowed.to(x.device), x.shape) | required
    lost = required & torch.isfinite(x)
    assert not lost.any(), (
        f"{name}: NaN / inf of V dropped at {int(lost.sum())} of {int(required.sum())} entries "
        f"(first at {lost.nonzero()[0].tolist()})"
    )
    stray = ~torch.isfinite(x) & ~allowed
    assert not stray.any(), (
        f"{name}: non-finite entries where no row sees a special value: {int(stray.sum())} "
        f"(first at {stray.nonzero()[0].tolist()})"
    )
    finite = torch.isfinite(x)
    assert torch.isfinite(clean64[finite]).all(), f"{name}: the cleaned reference is not finite"
    err = _finite_err(x, clean64, finite)
    assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"


def grad_term_sizes(inputs, bases64, vis, bias, scale, group, g, g_lse):
    """Per base, the largest term that its float64 gradient sums: with P the probabilities,
    dP = g Vᵀ, D = rowsum(g ∘ out) and A = P (|dP| + |D| + |g_lse|) (dS = P (dP - D + g_lse)),
    dq sums |scale| A |K|, dk |scale| Aᵀ |Q|, dv Pᵀ |g| -- mapped back through the views (sums
    over broadcast copies, transposes) by autograd.  ``vis``: bool, broadcastable to the
    scores, which keys each row sees; ``bias``: a float mask added to the scores, or None."""
    with torch.no_grad():
        q, k, v = (inp.view(b.detach()) for inp, b in zip(inputs, bases64))
        squeeze = q.dim() == 2
        if squeeze:
            q, k, v, g, g_lse = q[None], k[None], v[None], g[None], g_lse[None]
        g, g_lse = g.to(q.device), g_lse.to(q.device)
        kk, vv = (t.repeat_interleave(group, dim=-3) if group > 1 else t for t in (k, v))
        sc = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
        s = (q @ kk.transpose(-2, -1)) * sc
        vis = vis.to(s.device)
        if bias is not None:
            s = s + bias.to(device=s.device, dtype=F64)
        s = torch.where(vis, s, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = torch.nan_to_num(torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)), nan=0.0, posinf=0.0)
        out = p @ torch.nan_to_num(vv, nan=0.0, posinf=0.0, neginf=0.0)
        gg = g.to(F64)
        dp = (gg @ vv.transpose(-2, -1)).abs()
        big_d = (gg * out).sum(-1, keepdim=True).abs()
        a = torch.nan_to_num(p * (dp + big_d + g_lse.to(F64).abs().unsqueeze(-1)), nan=0.0, posinf=0.0)
        tq = abs(sc) * a @ torch.nan_to_num(kk.abs(), posinf=0.0, nan=0.0)
        tk = abs(sc) * a.transpose(-2, -1) @ torch.nan_to_num(q.abs(), posinf=0.0, nan=0.0)
        tv = p.transpose(-2, -1) @ gg.abs()
        if group > 1:
            tk, tv = (t.unflatten(-3, (-1, group)).sum(-3) for t in (tk, tv))
        # K/V broadcast over batch dims: the gradient sums over the copies.
        tk, tv = (t.sum_to_size(x.shape) for t, x in ((tk, k), (tv, v)))
        if squeeze:
            tq, tk, tv = tq[0], tk[0], tv[0]
    return base_term_max(inputs, bases64, (tq, tk, tv))


def softmax_term_sizes(inputs, bases64, p, out64, scale, group, g, g_lse):
    """Per base, the largest term its float64 gradient sums -- the yardstick of a gradient that
    cancels (grad_term_sizes, with the score options' probabilities ``p`` [..., H, N, M]: the
    sinks' share is left out of them, and the softcap's derivative, at most 1, is bounded by 1).
    dS = P (dP - D + g_lse): dq sums |scale| A |K|, dk |scale| Aᵀ |Q|, dv Pᵀ |g|, with
    A = P (|dP| + |D| + |g_lse|)."""
    with torch.no_grad():
        q, k, v = (inp.view(b.detach()) for inp, b in zip(inputs, bases64))
        kk, vv = (t.repeat_interleave(group, dim=-3) if group > 1 else t for t in (k, v))
        gg = g.to(F64)
        dp = (gg @ vv.transpose(-2, -1)).abs()
        big_d = (gg * out64).sum(-1, keepdim=True).abs()
        a = p * (dp + big_d + g_lse.to(F64).abs().unsqueeze(-1))
        sc = abs(scale)
        tq = sc * a @ kk.abs()
        tk = sc * a.transpose(-2, -1) @ q.abs()
        tv = p.transpose(-2, -1) @ gg.abs()
        if group > 1:
            tk, tv = (t.unflatten(-3, (-1, group)).sum(-3) for t in (tk, tv))
    return base_term_max(inputs, bases64, (tq, tk, tv))


def _linear_phi_prime(x, feature_map):
    if feature_map == "elu":
        return torch.where(x > 0, torch.ones_like(x), torch.exp(torch.clamp(x, max=0)))
    if feature_map == "relu":
        return (x > 0).to(x.dtype)
    return torch.ones_like(x)


def linear_term_sizes(inputs, bases64, causal, feature_map, normalize, eps, scale, g, state):
    """Per base, the largest term its gradient sums (the yardstick of a gradient that cancels:
    normalized with one key, out = v whatever q and k, so dq = dk = 0 up to rounding).  With
    w_ij = φ(q_i)·φ(k_j): ∂L/∂w_ij = (g_i·v_j - g_i·out_i) / den_i normalized, scale g_i·v_j
    otherwise; dq_i sums φ'(q_i) ∂L/∂w_ij φ(k_j) (and the initial state's terms), dk_j sums
    φ'(k_j) ∂L/∂w_ij φ(q_i), dv_j sums w_ij g_i / den_i."""
    with torch.no_grad():
        q, k, v = (torch.nan_to_num(inp.view(b.detach()), nan=0.0, posinf=0.0, neginf=0.0)
                   for inp, b in zip(inputs, bases64))
        g = g.to(q.device, F64)
        pq, pk = feature_map_reference(q, feature_map), feature_map_reference(k, feature_map)
        w = pq @ pk.transpose(-2, -1)
        if causal:
            w = w * torch.ones(w.shape[-2:], dtype=F64, device=w.device).tril()
        s0, z0 = state if state is not None else (None, None)
        gv = (g @ v.transpose(-2, -1)).abs()
        if normalize:
            den = w.sum(-1) + eps + (0.0 if z0 is None else (pq * z0.to(F64).unsqueeze(-2)).sum(-1))
            num = w @ v + (0.0 if s0 is None else pq @ s0.to(F64))
            out = num / den.unsqueeze(-1)
            gout = (g * out).sum(-1).abs()
            t = (gv + gout.unsqueeze(-1)) / den.abs().unsqueeze(-1)
            state_q = 0.0 if s0 is None else (g.abs() @ s0.to(F64).abs().transpose(-2, -1)
                                              + gout.unsqueeze(-1) * z0.to(F64).abs().unsqueeze(-2)) / den.abs().unsqueeze(-1)
            tv = w.abs().transpose(-2, -1) @ (g.abs() / den.abs().unsqueeze(-1))
        else:
            t = abs(scale) * gv
            state_q = 0.0 if s0 is None else abs(scale) * g.abs() @ s0.to(F64).abs().transpose(-2, -1)
            tv = abs(scale) * w.abs().transpose(-2, -1) @ g.abs()
        if causal:
            t = t * torch.ones(t.shape[-2:], dtype=F64, device=t.device).tril()
        tq = _linear_phi_prime(q, feature_map) * (t @ pk.abs() + state_q)
        tk = _linear_phi_prime(k, feature_map) * (t.transpose(-2, -1) @ pq.abs())
        terms = [torch.nan_to_num(x, nan=0.0, posinf=0.0) for x in (tq, tk, tv)]
    return base_term_max(inputs, bases64, terms)


def linear_operand_rounding(q64, k64, v64, out64, causal, feature_map, normalize, eps, scale, state, u) -> float:
    """What the linear kernels' 16-bit product operands add to DESIGN.md's rule for the output:
    φ(q), φ(k) and the intra-chunk scores -- in bfloat16 also the state -- go to the products
    rounded to the inputs' dtype (kernels/linear.py ``_dot_plain`` / ``_dot_state``), each by u
    relative; the reference run in the dtype rounds others (φ computed in the dtype, its score
    and output products) and may come out nearly exact.  With w_ij = |φ(q_i)|·|φ(k_j)| over the
    visible j (and |φ(q_i)|·|S0|, |φ(q_i)|·|z0| for an initial state), three roundings a term:
    unnormalized out_i moves by 3u |scale| Σ_j w_ij |v_j|, normalized by
    3u (Σ_j w_ij |v_j| + |out_i| Σ_j w_ij) / |den_i|.  Found by session 30's random fuzzing
    (tests/fuzz/test_fuzz_varlen.py, ATTNKIT_FUZZ_EXAMPLES=1500): triton float16, causal elu
    unnormalized, scale -1.75, four sequences of 7 tokens, D = 3: out 3.84e-2 off, the float16
    reference 1.6e-2 (the rule 3.25e-2).  Tensors ``[B, H, N, *]`` (views of float64 bases),
    ``state`` None or (S0, z0); returns the largest entry."""
    with torch.no_grad():
        q, k, v = (torch.nan_to_num(t.detach(), nan=0.0, posinf=0.0, neginf=0.0) for t in (q64, k64, v64))
        pq, pk = feature_map_reference(q, feature_map).abs(), feature_map_reference(k, feature_map).abs()
        w = pq @ pk.transpose(-2, -1)
        if causal:
            w = w * torch.ones(w.shape[-2:], dtype=F64, device=w.device).tril()
        num = w @ v.abs()
        den_terms = w.sum(-1)
        if state is not None:
            s0, z0 = (t.to(F64).abs() for t in state)
            num = num + pq @ s0
            den_terms = den_terms + (pq * z0.unsqueeze(-2)).sum(-1)
        if normalize:
            pq_signed = feature_map_reference(q, feature_map)
            den = (pq_signed @ feature_map_reference(k, feature_map).transpose(-2, -1)
                   * (torch.ones(w.shape[-2:], dtype=F64, device=w.device).tril() if causal else 1.0)).sum(-1) + eps
            if state is not None:
                den = den + (pq_signed * state[1].to(F64).unsqueeze(-2)).sum(-1)
            out = torch.nan_to_num(out64.detach().abs(), nan=0.0, posinf=0.0)
            budget = 3 * u * (num + out * den_terms.unsqueeze(-1)) / den.abs().unsqueeze(-1)
        else:
            budget = 3 * u * abs(scale) * num
        budget = budget[torch.isfinite(budget)]
        return budget.max().item() if budget.numel() else 0.0


def linear_state_rounding(k64, v64, feature_map, u) -> float:
    """The returned state S = S0 + Σ_j φ(k_j) v_jᵀ of a linear kernel in float16 / bfloat16: φ(k)
    goes to the product rounded to the dtype (kernels/linear.py ``_dot_plain``), by u relative,
    a rounding the reference run in the dtype makes in its own way: u Σ_j |φ(k_j)| |v_j|ᵀ at
    most.  Found by session 30's random fuzzing (bfloat16 interpreted, N = 2, D = 1: S 1.35e-2
    off against the rule's 1.16e-2).  Tensors ``[B, H, M, *]``; returns the largest entry."""
    with torch.no_grad():
        k, v = (torch.nan_to_num(t.detach(), nan=0.0, posinf=0.0, neginf=0.0) for t in (k64, v64))
        term = u * feature_map_reference(k, feature_map).abs().transpose(-2, -1) @ v.abs()
        term = term[torch.isfinite(term)]
        return term.max().item() if term.numel() else 0.0


def base_term_max(inputs, bases64, terms):
    """The largest gradient term per base, from the term sizes ``terms`` of each input (in the
    input's shape): pushed back through the views (transposes, sums over stride-0 copies, one
    base shared by several inputs) by autograd."""
    total = {}
    for inp, b64, t in zip(inputs, bases64, terms):
        probe = b64.detach().clone().requires_grad_()
        view = inp.view(probe)
        t = t.to(view.device, F64)
        (grad,) = torch.autograd.grad(view, probe, t.expand(torch.broadcast_shapes(t.shape, view.shape))
                                      .sum_to_size(view.shape).contiguous())
        total[id(b64)] = total.get(id(b64), 0) + grad
    return [total[id(b64)].max().item() if total[id(b64)].numel() else 0.0 for b64 in bases64]


def flash_rounding(inputs, bases64, p, scale, group, delta, grad_sizes, u):
    """Per base, what a flash backward in float16 / bfloat16 adds to DESIGN.md's rule (2x the
    error of the reference run in that dtype + 1e-3) -- two roundings that the reference run in
    the dtype, which differentiates the softmax without D, does not make:

    - D = rowsum(dO ∘ O) comes from the output the kernel returned, rounded to the dtype (once
      by the forward; on the cuda kernels with sinks once more by their rescale out' = out ·
      exp(lse - lse'), attnkit.score_options.add_sinks; in a sparse pattern's parts, each part's
      output, merged -- test_fuzz_sparse): off by delta_i = g_i · (out_i - out64_i) [B, H, N],
      the forward's own error, already held to its tolerance.  dS = P (dP - D + g_lse) carries it
      like g_lse: dq_i by |scale| Σ_j P_ij |delta_i| |k_j|, dk_j by |scale| Σ_i P_ij |delta_i| |q_i|
      (dv not at all);
    - each gradient the kernels return is rounded to the dtype, element by element of the view
      they were given (a stride-0 view's copies are summed into the base after that rounding,
      and may cancel there: session 28's random fuzzing, an expanded K, dk 1.38x the budget
      counted on the base), and with the lse in the loss there are two, out's and the lse
      probe's (ops.softmax._gradients), summed in the dtype: u times the sizes ``grad_sizes`` of
      those parts and of their sum (u the unit roundoff), parts that cancel where the result
      does.

    Where a gradient cancels (few keys, a sink taking most of the weight) the reference run in
    the dtype can be almost exact, far below these.  Measured on the cpu kernel in bfloat16,
    1500 random cases through _check_case (N, M <= 17, D <= 31, masks, window, softcap, ALiBi,
    sinks, GQA, the lse in the loss or not): DESIGN.md's rule alone failed 27 gradients (dq, dk,
    dsinks; up to 2.7x the rule), the rule plus this budget none (the worst used 0.53 of the
    budget).  Against the float64 reference fed the kernel's own D (g_lse - delta), out's and the
    lse's parts rounded apart, the kernel was within 1.8 u max |grad| (3000 cases): rounding, not
    a defect."""
    with torch.no_grad():
        # (non-finite q / k entries -- special values -- count 0: the rows they poison have NaN
        # gradients, checked as such, and P = 0 in ``p``)
        q, k = (torch.nan_to_num(inp.view(b.detach()).cpu(), nan=0.0, posinf=0.0, neginf=0.0)
                for inp, b in zip(inputs[:2], bases64[:2]))
        kk = k.repeat_interleave(group, dim=-3) if group > 1 else k  # (heads at dim -3)
        a = p * delta.abs().unsqueeze(-1)
        tq = abs(scale) * a @ kk.abs()
        tk = abs(scale) * a.transpose(-2, -1) @ q.abs()
        if group > 1:
            tk = tk.unflatten(-3, (-1, group)).sum(-3)
        tv = torch.zeros(inputs[2].view(bases64[2].detach()).shape, dtype=F64)
    carried = base_term_max(inputs, bases64, (tq, tk, tv))
    return [c + u * size for c, size in zip(carried, grad_sizes)]


def max_score(q64, k64, group, scale) -> float:
    """The largest finite |scale| Σ_d |q_d k_d| (float64) -- the size of the products a score
    sums, which bounds its rounding (a score that cancels to 0 is still rounded at their size)."""
    with torch.no_grad():
        if group > 1:
            k64 = k64.repeat_interleave(group, dim=-3)
        sc = 1.0 / q64.shape[-1] ** 0.5 if scale is None else scale
        s = (q64.abs() @ k64.abs().transpose(-2, -1)) * abs(sc)
        s = s[torch.isfinite(s)]
        return s.max().item() if s.numel() else 0.0


def base_support(inputs, bases64, masks):
    """Per base, the bool tensor of its entries that feed the view-space entries ``masks``
    (bool, one per input, broadcastable with it -- summed over the dims the input broadcasts):
    pushed through the views by autograd."""
    total = {}
    for inp, b64, m in zip(inputs, bases64, masks):
        probe = b64.detach().clone().requires_grad_()
        view = inp.view(probe)
        m = m.to(view.device, F64)  # broadcast to the view, summed over the view's broadcast dims
        m = m.expand(torch.broadcast_shapes(m.shape, view.shape)).sum_to_size(view.shape)
        (grad,) = torch.autograd.grad(view, probe, m.contiguous())
        total[id(b64)] = total.get(id(b64), 0) + grad
    return [total[id(b64)] > 0 for b64 in bases64]


def check_grad_with_specials(name, got, ref64, tol, allowed):
    """Gradients of a case with non-finite inputs: non-finite only where the float64 reference
    is or where ``allowed`` (entries fed by a poisoned row: the reference's own value there can
    be an artefact, e.g. p = finite / inf = 0 on a row with a +inf score); wherever both are
    finite, within ``tol`` (None: no value comparison)."""
    x = got.detach().to(device=ref64.device, dtype=F64)
    r = ref64.detach()
    stray = ~torch.isfinite(x) & torch.isfinite(r) & ~allowed.to(r.device)
    assert not stray.any(), (
        f"{name}: non-finite at {int(stray.sum())} entries where the float64 reference is finite and "
        f"no poisoned row reaches (first at {stray.nonzero()[0].tolist()})"
    )
    both = torch.isfinite(x) & torch.isfinite(r)
    if tol is not None and both.any():
        err = (x[both] - r[both]).abs().max().item()
        assert err <= tol, f"{name}: max error {err:.3e} > tolerance {tol:.3e}"


def draw_special(data, allowed=SPECIALS):
    return data.draw(st.sampled_from(allowed), label="special")

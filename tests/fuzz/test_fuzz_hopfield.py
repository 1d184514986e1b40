"""Differential fuzzing of attnkit.hopfield_update and hopfield_energy (issue 15): every backend
usable here against the float64 reference, over steps, beta, tol, values, return_energy, the
layouts of fuzzing.py and NaN / ±inf / 1e4 entries; forward and gradients.

tol is drawn from None, 0 and 1e6 (never freezes / only exact fixed points / freezes after the
first update): a tol between those would freeze a row in float32 and not in float64 (or the
reverse) whenever the row's change lies within rounding of tol -- a legitimate discontinuity,
not an error."""
import math

import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (requirements.txt)")
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit.reference.hopfield import hopfield_energy_reference, hopfield_update_reference
from attnkit_testing import F64, spread_free_run
from fuzzing import (
    BACKENDS, LAYOUTS, base_support, base_term_max, check_exact, check_grad_with_specials, dtypes_for, grad_term_sizes, max_score, fuzz_settings, interpreted, leaves, make_input,
    require_backend, set_values, tolerance,
)

SEQ = [0, 1, 2, 3, 5, 7, 16, 17, 33, 65]
SEQ_INTERPRETED = [0, 1, 2, 3, 5, 7, 17]
DIMS = [1, 2, 3, 8, 16, 31, 64, 100, 128, 256]
HOPFIELD_SPECIALS = ["none", "none", "none", "nan_state", "nan_stored", "inf_stored", "nan_values", "huge"]


def _draw_case(data, backend, device, want_values=True, distinct=False):
    """``distinct``: N >= 2 distinct stored patterns and values (no stride-0 copies) -- with one
    pattern, or copies of one, the update's output does not depend on the state and its
    gradient cancels to exactly 0, held to no relative rule."""
    draw = data.draw
    dtype = draw(st.sampled_from(dtypes_for(backend, device)), label="dtype")
    b, h = draw(st.sampled_from([1, 2, 0]), label="B"), draw(st.integers(1, 3), label="H")
    seq = SEQ_INTERPRETED if interpreted(backend, device) else SEQ
    s = draw(st.sampled_from(seq), label="S (states)")
    n = draw(st.sampled_from([x for x in seq if x >= (2 if distinct else 1)]), label="N (stored)")
    d = draw(st.sampled_from(DIMS), label="D")
    dv = draw(st.sampled_from(DIMS), label="Dv") if want_values and draw(st.booleans(), label="values") else None
    special = draw(st.sampled_from(HOPFIELD_SPECIALS if dv is not None else
                                   [x for x in HOPFIELD_SPECIALS if x != "nan_values"]), label="special")
    if special == "huge" and dtype == torch.float16:
        special = "none"  # float16 scores of 1e4 entries overflow the float16 yardstick
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))
    shapes = [(b, h, s, d), (b, h, n, d)] + ([(b, h, n, dv)] if dv is not None else [])
    inputs = [make_input(shape, draw(st.sampled_from([x for x in LAYOUTS if not (distinct and i >= 1 and x == "expanded")]),
                                     label=f"layout {i}"), gen, dtype, device)
              for i, shape in enumerate(shapes)]
    if special == "huge":
        set_values(inputs[draw(st.integers(0, len(inputs) - 1), label="huge in")], "huge", gen)
    elif special != "none":
        kind, where = special.split("_")
        set_values(inputs[{"state": 0, "stored": 1, "values": 2}[where]], kind, gen)
    return dtype, inputs, special, gen


def _probability_rounding(state64, stored64, values64, beta, u):
    """What a kernel's one 16-bit retrieval adds to DESIGN.md's rule: it rounds the probabilities
    it feeds to the product with the values (X, or V) to the inputs' dtype, each by u relative --
    out moves by up to u Σ_n p_n |y_n| -- where the reference run in the dtype rounds others
    (its normalized p, its scores) and may come out nearly exact.  Found by session 30's random
    fuzzing (ATTNKIT_FUZZ_EXAMPLES=1000): triton bfloat16, one step, two stored patterns, values
    holding 1e4 entries: out 13.7 off, the bfloat16 reference 1.8 (the rule 4.6), u Σ p |v| ~20.
    (Several retrievals take float32 operands in the kernels: no such rounding, see
    kernels/hopfield.py.)"""
    with torch.no_grad():
        xi, x = (torch.nan_to_num(t.detach(), nan=0.0, posinf=0.0, neginf=0.0) for t in (state64, stored64))
        y = x if values64 is None else torch.nan_to_num(values64.detach(), nan=0.0, posinf=0.0, neginf=0.0)
        p = torch.softmax(beta * xi @ x.transpose(-2, -1), dim=-1)
        term = u * (p @ y.abs())
        term = term[torch.isfinite(term)]
        return term.max().item() if term.numel() else 0.0


def _required(state64, stored64, values64):
    """Entries that must be non-finite: a NaN state row poisons its row; a NaN stored pattern
    (or value row) every row of its (batch, head) -- every state sees every pattern."""
    with torch.no_grad():
        row = torch.isnan(state64).any(-1)  # [B, H, S]
        head = torch.isnan(stored64).flatten(2).any(-1)  # [B, H]
        rows = row | head[..., None]
        if values64 is None:
            return rows.unsqueeze(-1)
        col = torch.isnan(values64).any(-2, keepdim=True)  # [B, H, 1, Dv]
        return rows.unsqueeze(-1) | col


@pytest.mark.parametrize("backend,device", BACKENDS)
@fuzz_settings(20)
@given(data=st.data())
def test_hopfield_update_matches_float64_reference(backend, device, data):
    require_backend("hopfield", backend, device)
    draw = data.draw
    want_grad = draw(st.booleans(), label="gradients")
    dtype, inputs, special, gen = _draw_case(data, backend, device, distinct=want_grad)
    # Gradients over several steps shrink as the states converge (the update contracts), far
    # below the terms they sum: no relative rule holds there, so gradient cases take one step,
    # whose terms are those of softmax attention (fuzzing.grad_term_sizes).
    steps = 1 if want_grad else draw(st.integers(1, 3), label="steps")
    d = inputs[0].tensor().shape[-1]
    beta = draw(st.one_of(st.none(), st.floats(0.05, 2.0 / math.sqrt(d))), label="beta")
    tol = draw(st.sampled_from([None, 0.0, 1e6]), label="tol")
    return_energy = draw(st.booleans(), label="return_energy")
    bases, bases64 = leaves(inputs, want_grad)
    args = [inp.view(x) for inp, x in zip(inputs, bases)]
    args64 = [inp.view(x) for inp, x in zip(inputs, bases64)]
    values, values64 = (args[2], args64[2]) if len(args) == 3 else (None, None)
    kwargs = dict(beta=beta, steps=steps, tol=tol)
    result = attnkit.hopfield_update(args[0], args[1], values=values, return_energy=return_energy,
                                     backend=backend, **kwargs)
    out, energy = result if return_energy else (result, None)
    ref, ref_energy = hopfield_update_reference(args64[0], args64[1], values=values64, return_energy=True, **kwargs)
    # 1e4 entries make scores of size S: float32 rounds them by ~S eps (see fuzzing.tolerance).
    beta_eff = 1.0 / math.sqrt(d) if beta is None else beta
    huge_scores = max_score(args64[0].detach(), args64[1].detach(), 1, beta_eff) if special == "huge" else 0.0
    read = (args64[1] if values64 is None else values64).detach()
    read = read[torch.isfinite(read)]
    unit = read.abs().max().item() if read.numel() else 0.0
    needs_naive = dtype in (torch.float16, torch.bfloat16) or huge_scores > 0
    naive = naive_energy = None
    if needs_naive:
        with torch.no_grad():
            naive, naive_energy = spread_free_run(  # issue 24
                lambda s_, x_, v_: hopfield_update_reference(s_, x_, values=v_, return_energy=True, **kwargs),
                args[0].detach(), args[1].detach(), None if values is None else values.detach())
    assert out.dtype == dtype and out.device.type == device and out.shape == ref.shape
    name = f"{backend} hopfield_update(steps={steps}, beta={beta}, tol={tol}, values={values is not None})"
    required = _required(args64[0].detach(), args64[1].detach(), None if values64 is None else values64.detach())
    out_tol = tolerance(dtype, ref, naive=naive, huge_scores=huge_scores, unit=unit)
    if dtype in (torch.float16, torch.bfloat16) and backend != "reference" and steps == 1:
        out_tol += _probability_rounding(args64[0], args64[1], values64, beta_eff, torch.finfo(dtype).eps / 2)
    check_exact(f"{name} out", out, ref, out_tol, required)
    if return_energy:
        assert energy.shape == ref_energy.shape and not energy.requires_grad
        check_exact(f"{name} energy", energy, ref_energy.detach(),
                    tolerance(dtype, ref_energy.detach(), naive=naive_energy, huge_scores=huge_scores,
                              unit=1.0 / beta_eff), required.all(-1)[None] if values is None
                    else _required(args64[0].detach(), args64[1].detach(), None).squeeze(-1)[None])
    if not want_grad:
        return
    g = torch.randn(out.shape, generator=gen, dtype=F64).to(device=device, dtype=dtype)
    out.backward(g)
    ref.backward(g.to(F64))
    naive_grads = [None] * len(bases)
    if needs_naive:
        def naive_gradients(*naive_bases):
            nb = [x.detach().clone().requires_grad_() for x in naive_bases]
            na = [inp.view(x) for inp, x in zip(inputs, nb)]
            hopfield_update_reference(na[0], na[1], values=na[2] if len(na) == 3 else None, **kwargs).backward(g)
            return [x.grad for x in nb]

        naive_grads = spread_free_run(naive_gradients, *bases)  # issue 24
    # Every state row sees every pattern: a poisoned row (non-finite out in the reference) may
    # poison its own state gradient and every stored / value gradient of its (batch, head).
    poisoned = ~torch.isfinite(ref.detach().cpu()).all(-1, keepdim=True)  # [B, H, S, 1]
    head = poisoned.any(-2, keepdim=True)
    allowed = base_support(inputs, bases64, [poisoned, head, head][:len(inputs)])
    # One step: softmax attention with q = state, k = stored, v = values (or stored).
    trio = [inputs[0], inputs[1], inputs[2] if len(inputs) == 3 else inputs[1]]
    trio64 = [bases64[0], bases64[1], bases64[2] if len(inputs) == 3 else bases64[1]]
    terms = grad_term_sizes(trio, trio64, torch.ones(out.shape[-2], args[1].shape[-2], dtype=torch.bool),
                            None, beta_eff, 1, g.cpu(), torch.zeros(out.shape[:-1], dtype=F64))
    # A kernel's backward rounds each gradient to the dtype per input view, before autograd
    # sums a stride-0 view's copies into the base (the rounding fuzzing.flash_rounding budgets
    # for the softmax fuzz; the reference run in the dtype makes it at other places): u times
    # the views' own gradients, pushed back to the bases.  Found by session 33's random fuzzing
    # (ATTNKIT_FUZZ_EXAMPLES=5000, cpu): bfloat16, a state [1, 2, 1, 64] expanded to 3 rows,
    # N = 2: its gradient 2.08 off by 1.57e-2 (one bfloat16 ulp there; computed in float32 and
    # rounded once, 3.6e-3) against the rule's 1.44e-2, the naive run's error 5.6e-3.
    views = [0.0] * len(bases)
    if dtype in (torch.float16, torch.bfloat16) and backend != "reference":
        per_view = [a.detach().clone().requires_grad_() for a in args64]
        hopfield_update_reference(per_view[0], per_view[1], values=per_view[2] if len(per_view) == 3 else None,
                                  **kwargs).backward(g.cpu().to(F64))
        sizes = [torch.nan_to_num(v.grad.abs(), nan=0.0, posinf=0.0) for v in per_view]
        views = [torch.finfo(dtype).eps / 2 * size for size in base_term_max(inputs, bases64, sizes)]
    for i, (x, x64) in enumerate(zip(bases, bases64)):
        if x64.grad is None or x64.grad.numel() == 0:
            continue
        got = x.grad if x.grad is not None else torch.zeros_like(x)
        finite = torch.isfinite(x64.grad)
        tol = tolerance(dtype, x64.grad[finite], grad=True, huge_scores=huge_scores, size=terms[i],
                        naive=None if naive_grads[i] is None else naive_grads[i][finite.to(naive_grads[i].device)])
        tol += views[i]
        if special in ("none", "huge"):
            check_exact(f"{name} grad {i}", got, x64.grad, tol)
        else:
            check_grad_with_specials(f"{name} grad {i}", got, x64.grad, tol, allowed[i])
    if special == "nan_state" and inputs[0].view(bases[0]) is bases[0]:
        rows = torch.isnan(args64[0].detach()).any(-1)
        assert not torch.isfinite(bases[0].grad[rows.to(bases[0].device)]).all(-1).any(), \
            f"{name}: a NaN state row's gradient lost the NaN"


@pytest.mark.parametrize("backend,device", BACKENDS)
@fuzz_settings(15)
@given(data=st.data())
def test_hopfield_energy_matches_float64_reference(backend, device, data):
    require_backend("hopfield_energy", backend, device)
    draw = data.draw
    want_grad = draw(st.booleans(), label="gradients")
    dtype, inputs, special, gen = _draw_case(data, backend, device, want_values=False, distinct=want_grad)
    want_grad = want_grad and special == "none"
    d = inputs[0].tensor().shape[-1]
    beta = draw(st.floats(0.05, 2.0 / math.sqrt(d)), label="beta")
    bases, bases64 = leaves(inputs, want_grad)
    state, stored = (inp.view(x) for inp, x in zip(inputs, bases))
    state64, stored64 = (inp.view(x) for inp, x in zip(inputs, bases64))
    energy = attnkit.hopfield_energy(state, stored, beta, backend=backend)
    ref = hopfield_energy_reference(state64, stored64, beta)
    naive = spread_free_run(lambda s_, x_: hopfield_energy_reference(s_, x_, beta), state.detach(), stored.detach()) \
        if dtype in (torch.float16, torch.bfloat16) else None  # issue 24
    assert energy.dtype == dtype and energy.shape == ref.shape
    required = _required(state64.detach(), stored64.detach(), None).squeeze(-1)
    check_exact(f"{backend} hopfield_energy(beta={beta})", energy, ref, tolerance(dtype, ref, naive=naive), required)
    if not want_grad:
        return
    g = torch.randn(energy.shape, generator=gen, dtype=F64).to(device=device, dtype=dtype)
    energy.backward(g)
    ref.backward(g.to(F64))
    naive_grads = [None, None]
    if dtype in (torch.float16, torch.bfloat16):
        def naive_gradients(*naive_bases):
            nb = [x.detach().clone().requires_grad_() for x in naive_bases]
            hopfield_energy_reference(*(inp.view(x) for inp, x in zip(inputs, nb)), beta).backward(g)
            return [x.grad for x in nb]

        naive_grads = spread_free_run(naive_gradients, *bases)  # issue 24
    for i, (x, x64) in enumerate(zip(bases, bases64)):
        if x64.grad is None or x64.grad.numel() == 0:
            continue
        got = x.grad if x.grad is not None else torch.zeros_like(x)
        check_exact(f"{backend} hopfield_energy grad {i}", got, x64.grad,
                    tolerance(dtype, x64.grad, grad=True, naive=naive_grads[i]))

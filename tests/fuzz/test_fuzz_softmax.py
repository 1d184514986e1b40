"""Differential fuzzing of attnkit.softmax_attention (issue 15): every backend usable here
against the float64 reference, forward (out, lse) and gradients, on generated shapes (0 and 1,
odd sizes, 2-D to 5-D, GQA, broadcast K/V batch dims, D up to 256), layouts (transposed,
strided, expanded, one fused qkv tensor, q = k = v), masks (bool / float, broadcast, fully
masked rows, causal) and special values (NaN, ±inf, 1e4).  See fuzzing.py for the checks."""
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (requirements.txt)")
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit.reference.softmax import softmax_attention_reference
from attnkit_testing import F64, LOW_PRECISION, spread_free_run
from fuzzing import (
    BACKENDS, LAYOUTS, SPECIALS, base_support, base_term_max, check_exact, check_grad_with_specials, check_v_mode,
    dtypes_for, flash_rounding, fused_qkv, fuzz_settings, grad_term_sizes, interpreted, leaves, make_input, max_score,
    require_backend, set_values, tolerance, value_size,
)

SEQ = [0, 1, 2, 3, 5, 7, 16, 17, 33, 63, 65]
SEQ_INTERPRETED = [0, 1, 2, 3, 5, 7, 17, 33]
DIMS = [1, 2, 3, 8, 16, 31, 64, 100, 128, 256]
CUDA_DIMS = [64, 128]  # the CUDA C++ kernels take D = Dv in {64, 128}


def _scores_visibility(shape, is_causal, mask):
    n, m = shape[-2], shape[-1]
    vis = torch.ones(shape, dtype=torch.bool)
    if is_causal:
        vis &= torch.ones(n, m, dtype=torch.bool).tril()
    if mask is not None:
        mask = mask.cpu()
        vis &= mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    return vis


def _draw_mask(data, gen, kind, scores_shape, dtype, device, finite_only):
    """A bool / float mask broadcastable to ``scores_shape``: each dim full or 1, leading 1s
    sometimes dropped; sometimes a fully masked row."""
    keep = [data.draw(st.booleans(), label=f"mask keeps dim {i}") for i in range(len(scores_shape))]
    shape = [s if k else 1 for s, k in zip(scores_shape, keep)]
    while shape and shape[0] == 1 and len(shape) > 1 and data.draw(st.booleans(), label="drop a leading 1"):
        shape = shape[1:]
    if kind == "bool":
        mask = torch.rand(shape, generator=gen) < 0.7
    else:
        mask = torch.randn(shape, generator=gen, dtype=F64)
        if not finite_only:
            mask = mask.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
    if len(shape) >= 2 and shape[-2] > 0 and shape[-1] > 0 and data.draw(st.booleans(), label="a fully masked row"):
        row = int(torch.randint(shape[-2], (1,), generator=gen))
        if kind == "bool":
            mask[..., row, :] = False
        elif not finite_only:
            mask[..., row, :] = float("-inf")
    return mask.to(device=device, dtype=torch.bool if kind == "bool" else dtype)


def _run_reference(q, k, v, mask, is_causal, scale, group):
    """The library's reference on the caller's shapes (its matmuls broadcast the batch dims;
    GQA by repeating K/V heads)."""
    if q.dim() == 2:  # [N, D]: the reference wants a head dim
        out, lse = _run_reference(q[None], k[None], v[None], mask, is_causal, scale, group)
        return out[0], lse[0]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    return softmax_attention_reference(q, k, v, mask, 0.0, is_causal, scale, False, return_lse=True)


def _flash_budget(inputs, bases64, views64, mask64, is_causal, scale, group, g, g_lse, out, ref_out, dtype):
    """fuzzing.flash_rounding for this op: P the float64 probabilities (the reference's output
    for V = the identity), D's error from the output the kernel returned, and the sizes of what
    the kernels round -- each gradient per input view, before autograd sums views of one base
    (a shared q = k = v, an expanded K), and with the lse in the loss (``g_lse`` not None) out's
    part and the lse's apart.  Rows poisoned by a special value count 0: their gradients are
    checked as NaN.  Found needed by session 29's random fuzzing (ATTNKIT_FUZZ_EXAMPLES=1500,
    float16 with v = ±1e4): cpu N = 1, M = 2, D = 3, an expanded K, dq 8.97e-2 against the
    rule's 1.0e-3; triton N = 5, M = 2, D = 1, dk 3.76 against 2.48 -- the rounding the
    sparse and options fuzz already budget for."""
    q64, k64, v64 = (view.detach() for view in views64)
    with torch.no_grad():
        m = k64.shape[-2]
        eye = torch.eye(m, dtype=F64, device=k64.device).expand(*k64.shape[:-1], m)
        p = _run_reference(q64, k64, eye, mask64, is_causal, scale, group)[0].cpu()
        p = torch.nan_to_num(p, nan=0.0, posinf=0.0, neginf=0.0)
        delta = (g.cpu().to(F64) * (out.detach().cpu().to(F64) - ref_out.detach().cpu())).sum(-1)
        delta = torch.where(torch.isfinite(delta), delta, 0.0)
    per_view = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    o, lse = _run_reference(*per_view, mask64, is_causal, scale, group)
    parts = [torch.autograd.grad(o, per_view, g.to(o.device, F64), retain_graph=g_lse is not None)]
    if g_lse is not None:
        finite = torch.isfinite(lse.detach())
        parts.append(torch.autograd.grad(torch.where(finite, lse, 0.0), per_view,
                                         torch.where(finite, g_lse.to(lse.device, F64), 0.0),
                                         allow_unused=True, materialize_grads=True))  # (no dv)
    sizes = []
    for i in range(3):
        each = [torch.nan_to_num(part[i].detach().abs(), nan=0.0, posinf=0.0).cpu() for part in parts]
        total = torch.nan_to_num(sum(part[i].detach() for part in parts).abs(), nan=0.0, posinf=0.0).cpu()
        sizes.append(total + (sum(each) if len(each) > 1 else 0.0))
    grad_sizes = base_term_max(inputs, bases64, sizes)
    sc = 1.0 / q64.shape[-1] ** 0.5 if scale is None else scale
    return flash_rounding(inputs, bases64, p, sc, group, delta, grad_sizes, torch.finfo(dtype).eps / 2)


@pytest.mark.parametrize("backend,device", BACKENDS)
@fuzz_settings(25)
@given(data=st.data())
def test_softmax_attention_matches_float64_reference(backend, device, data):
    require_backend("softmax", backend, device)
    draw = data.draw
    cuda_kernel = backend == "cuda"
    dtype = draw(st.sampled_from(dtypes_for(backend, device, (torch.float16, torch.bfloat16) if cuda_kernel else None)),
                 label="dtype")
    rank = draw(st.sampled_from([2, 3, 4, 4, 5]), label="rank")
    hk, group = (1, 1) if rank == 2 else (draw(st.integers(1, 3), label="Hk"),
                                          draw(st.sampled_from([1, 1, 2, 3]), label="GQA group"))
    h = hk * group
    batch = tuple(draw(st.sampled_from([1, 2, 3, 0] if i == 0 else [1, 2]), label=f"batch dim {i}")
                  for i in range(rank - 3))
    seq = SEQ_INTERPRETED if interpreted(backend, device) else SEQ
    n, m = draw(st.sampled_from(seq), label="N"), draw(st.sampled_from(seq), label="M")
    d = draw(st.sampled_from(CUDA_DIMS if cuda_kernel else DIMS), label="D")
    dv = d if cuda_kernel or draw(st.booleans(), label="Dv = D") else draw(st.sampled_from(DIMS), label="Dv")
    qkv = draw(st.sampled_from(["separate", "separate", "fused", "shared"]), label="qkv")
    if qkv != "separate" and not (rank >= 3 and n == m and group == 1 and d == dv):
        qkv = "separate"
    special = draw(st.sampled_from(SPECIALS + ["nan_mask"]), label="special")
    mask_kind = draw(st.sampled_from(["none", "none", "causal", "bool", "float"]), label="mask")
    if special == "nan_mask" and mask_kind != "float":
        special = "nan_k"
    if qkv != "separate" and special not in ("none", "huge"):
        special = "none"  # one base: a special value would sit in q, k and v at once
    kv_broadcast = rank >= 4 and qkv == "separate" and draw(st.booleans(), label="K/V batch dims broadcast")
    want_grad = draw(st.booleans(), label="gradients")
    return_lse = draw(st.booleans(), label="return_lse")
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="scale")
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))

    lead_q = (*batch, h) if rank >= 3 else ()
    lead_kv = (*(1 if kv_broadcast else b for b in batch), hk) if rank >= 3 else ()
    if qkv == "fused":
        inputs = fused_qkv(batch, n, h, d, gen, dtype, device)
    elif qkv == "shared":
        one = make_input((*lead_q, n, d), draw(st.sampled_from(LAYOUTS), label="layout"), gen, dtype, device)
        inputs = [one, one, one]
    else:
        inputs = [make_input(shape, draw(st.sampled_from(LAYOUTS), label=f"{name} layout"), gen, dtype, device)
                  for name, shape in (("q", (*lead_q, n, d)), ("k", (*lead_kv, m, d)), ("v", (*lead_kv, m, dv)))]
    if special == "huge":
        # float16 scores of 1e4-sized q / k overflow the reference run in float16 (the rule's
        # yardstick): there the huge values go to V only.
        targets = "v" if dtype == torch.float16 else draw(st.sampled_from(["q", "k", "v", "qk"]), label="huge in")
        for name in targets:
            set_values(inputs["qkv".index(name)], "huge", gen, within_view=qkv == "fused")
    elif special in ("nan_q", "nan_k", "nan_v"):
        set_values(inputs["qkv".index(special[-1])], "nan", gen)
    elif special in ("inf_k", "inf_v"):
        set_values(inputs["qkv".index(special[-1])], "inf", gen)
    # (q, k and v one shared tensor: "huge in v" is in q and k too)
    huge = special == "huge" and (targets != "v" or qkv == "shared")
    qk_special = special in ("nan_q", "nan_k", "inf_k")
    scores_shape = (*lead_q, n, m)
    mask = None
    if mask_kind in ("bool", "float"):
        # With a non-finite q / k a float -inf entry would meet a NaN / inf score (NaN + -inf is
        # NaN, like SDPA's): masked keys come from bool masks then.
        mask = _draw_mask(data, gen, mask_kind, scores_shape, dtype, device, finite_only=qk_special)
        if special == "nan_mask" and mask.numel():
            mask.view(-1)[int(torch.randint(mask.numel(), (1,), generator=gen))] = float("nan")
    is_causal = mask_kind == "causal"

    bases, bases64 = leaves(inputs, want_grad)
    q, k, v = (inp.view(b) for inp, b in zip(inputs, bases))
    q64, k64, v64 = (inp.view(b) for inp, b in zip(inputs, bases64))
    mask64 = None if mask is None else (mask if mask.dtype == torch.bool else mask.to(F64))
    huge_scores = max_score(q64.detach(), k64.detach(), group, scale) if huge else 0.0
    out, lse = attnkit.softmax_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=group > 1, return_lse=True, backend=backend)
    if not return_lse:  # the plain call returns the same out
        plain = attnkit.softmax_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=group > 1, backend=backend)
        assert plain.shape == out.shape and plain.dtype == dtype
    assert out.dtype == dtype and out.device.type == device
    v_mode = special in ("nan_v", "inf_v")
    ref, ref_lse = _run_reference(q64, k64, v64, mask64, is_causal, scale, group)
    ref_out = ref  # the ground truth the gradients flow through (V's specials included)
    naive = naive_lse = None
    if v_mode:  # finite entries are compared with the problem whose special V entries are 0
        with torch.no_grad():
            clean = torch.where(torch.isfinite(v64), v64, torch.zeros_like(v64))
            ref = _run_reference(q64, k64, clean, mask64, is_causal, scale, group)[0]
    if dtype in (torch.float16, torch.bfloat16) or huge:
        v_naive = torch.where(torch.isfinite(v), v, torch.zeros_like(v)) if v_mode else v
        with torch.no_grad():  # without the NaN a torch matmul can spread between rows (issue 24)
            naive, naive_lse = spread_free_run(
                lambda q_, k_, v_, m_: _run_reference(q_, k_, v_, m_, is_causal, scale, group),
                q.detach(), k.detach(), v_naive.detach(), mask, keep_neginf=(3,))

    # --- forward ---
    vis = _scores_visibility(scores_shape, is_causal, mask)
    has_key = vis.any(-1)
    kf = k64.detach().cpu().repeat_interleave(group, dim=-3) if group > 1 else k64.detach().cpu()
    vf = v64.detach().cpu().repeat_interleave(group, dim=-3) if group > 1 else v64.detach().cpu()
    q_nan = torch.isnan(q64.detach().cpu()).any(-1)
    required_rows = (q_nan & has_key) | (vis & torch.isnan(kf).any(-1).unsqueeze(-2)).any(-1)
    if mask is not None and mask.is_floating_point():
        required_rows |= (vis & torch.isnan(mask.cpu())).any(-1)
    v_size = value_size(v64.detach())
    tol = tolerance(dtype, ref, naive=naive, huge_scores=huge_scores, unit=v_size, size=v_size)
    lse_tol = tolerance(dtype, ref_lse.to(F64), naive=naive_lse, huge_scores=huge_scores, unit=1.0)
    if v_mode:
        v_bad = ~torch.isfinite(vf)  # [..., M, Dv]
        required = (vis.unsqueeze(-1) & v_bad.unsqueeze(-3)).any(-2)
        allowed = v_bad.any(-2, keepdim=True)
        check_v_mode(f"{backend} out", out, ref, tol, required, allowed)
    else:
        check_exact(f"{backend} out", out, ref, tol, required_rows.unsqueeze(-1))
    # A row whose scores hold +inf has lse +inf in the float64 reference (log of an infinite
    # sum) and NaN in a kernel that subtracts its running max (inf - inf): both mark the row
    # poisoned -- its out is NaN either way -- so NaN stands for +inf there.
    lse_ref = ref_lse.detach().to(F64)
    lse_ref = torch.where(torch.isposinf(lse_ref) & torch.isnan(lse.detach().to(F64).to(lse_ref.device)),
                          float("nan"), lse_ref)
    check_exact(f"{backend} lse", lse, lse_ref, lse_tol, required_rows)
    # A row with no visible key (and a finite query) is exactly 0, its lse -inf.  (With a
    # non-finite V, 0 · NaN may reach it in the special's column, as any hidden row: v mode.)
    empty = torch.broadcast_to((~has_key & ~q_nan).to(out.device), out.shape[:-1])
    assert torch.isneginf(lse.detach()[empty]).all(), f"{backend}: a fully masked row's lse is not -inf"
    if not v_mode:
        assert torch.equal(out.detach()[empty], torch.zeros_like(out.detach()[empty])), f"{backend}: fully masked row not 0"

    # --- gradients ---
    if not want_grad:
        return
    g = torch.randn(out.shape, generator=gen, dtype=F64).to(device=device, dtype=dtype)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=F64).to(device)
    outputs, grads = [out], [g]
    outputs64, grads64 = [ref_out], [g.to(F64)]
    if return_lse:
        finite_lse = torch.isfinite(ref_lse.detach())  # no gradient through a -inf lse
        outputs += [lse]
        grads += [torch.where(finite_lse, g_lse, 0.0).to(lse.dtype)]
        outputs64 += [torch.where(finite_lse, ref_lse, 0.0)]
        grads64 += [torch.where(finite_lse, g_lse, 0.0).to(F64)]
    torch.autograd.backward(outputs, grads)
    torch.autograd.backward(outputs64, grads64)
    naive_grads = None
    needs_naive = dtype in (torch.float16, torch.bfloat16) or huge
    if needs_naive and not v_mode:
        def naive_gradients(*naive_bases):
            nb = [b.detach().clone().requires_grad_() for b in naive_bases[:3]]
            nq, nk, nv = (inp.view(b) for inp, b in zip(inputs, nb))
            n_out, n_lse = _run_reference(nq, nk, nv, naive_bases[3], is_causal, scale, group)
            n_outputs = [n_out] + ([torch.where(finite_lse, n_lse, 0.0)] if return_lse else [])
            torch.autograd.backward(n_outputs, [g] + ([grads[1]] if return_lse else []))
            return [b.grad for b in nb]

        naive_grads = spread_free_run(naive_gradients, *bases, mask, keep_neginf=(3,))  # issue 24
    bias = mask.cpu() if mask is not None and mask.is_floating_point() else None
    term_sizes = grad_term_sizes(inputs, bases64, vis, bias, scale, group, g.cpu(),
                                 (grads[1] if return_lse else torch.zeros_like(lse)).cpu())
    # Entries a poisoned row (non-finite out in the reference) feeds: its own dq, the dk / dv
    # of the keys it sees (summed over a GQA group).
    flash = [0.0, 0.0, 0.0]  # a flash backward's own roundings (fuzzing.flash_rounding)
    if dtype in LOW_PRECISION and backend != "reference" and not v_mode:
        flash = _flash_budget(inputs, bases64, (q64, k64, v64), mask64, is_causal, scale, group, g,
                              grads[1] if return_lse else None, out, ref_out, dtype)
    elif dtype in LOW_PRECISION and not v_mode:
        # The reference backend differentiates in the dtype too, but sums a gradient's copies (a
        # GQA group's heads, K / V batch dims broadcast) in its own stages, each rounded to the
        # dtype -- the run above (repeat_interleave) in others: up to u Σ|terms| per stage.
        # Found by session 30's random fuzzing (ATTNKIT_FUZZ_EXAMPLES=1500): bfloat16, a single
        # key shared by 2 batches x 2 heads x 3 rows, dv 1.5546875 against the true 1.56509 and
        # the run above's 1.5625 (1.04e-2 > 6.8e-3).
        flash = [torch.finfo(dtype).eps / 2 * size for size in term_sizes]
    poisoned = ~torch.isfinite(ref_out.detach().cpu()).all(-1)
    fed = (vis & poisoned.unsqueeze(-1)).any(-2)  # [*lead_q, M]
    if group > 1:
        fed = fed.unflatten(-2, (-1, group)).any(-2)
    fed = fed.unsqueeze(-1)
    allowed = base_support(inputs, bases64, [poisoned.unsqueeze(-1), fed, fed])
    seen = set()
    for i, (name, b, b64) in enumerate(zip("qkv", bases, bases64)):
        if id(b) in seen or b64.grad is None or b64.grad.numel() == 0:
            continue
        seen.add(id(b))
        finite = torch.isfinite(b64.grad)
        gtol = None  # no value comparison: low precision with special V entries (no yardstick)
        if not needs_naive:
            gtol = tolerance(dtype, b64.grad[finite], grad=True, size=term_sizes[i])
        elif naive_grads is not None:
            gtol = tolerance(dtype, b64.grad[finite], grad=True, naive=naive_grads[i][finite.to(naive_grads[i].device)],
                             huge_scores=huge_scores, size=term_sizes[i]) + flash[i]
        got = b.grad if b.grad is not None else torch.zeros_like(b)
        if special in ("none", "huge"):
            check_exact(f"{backend} d{name}", got, b64.grad, gtol)
            continue
        check_grad_with_specials(f"{backend} d{name}", got, b64.grad, gtol, allowed[i])
        if name == "q" and q is b and not v_mode:
            rows = torch.broadcast_to(required_rows, q.shape[:-1]).to(got.device)
            assert not torch.isfinite(got.detach()[rows]).all(-1).any(), f"{backend} dq: NaN of the forward dropped"

"""Softmax attention cases: attnkit.softmax_attention against torch SDPA.

FLOPs: 4·B·H·D·(visible query-key pairs) for the forward (Q·Kᵀ and P·V, 2 FLOPs per
multiply-add), the pairs being N·M, or Σᵢ min(i+1, M) when causal (top-left); forward+backward
counts 3.5× the forward (the backward's five matrix products against the forward's two, the
convention of FlashAttention-2).

Full sizes (issue 3): B=1, H=8, N=4096, D=64 — float32 forward and forward+backward, causal and
not, and bfloat16 and float16 forward.  ``--quick``: N=1024.  Masks (:func:`make_mask_case`, full runs only):
B=4, H=8, N=1024, D=64 float32 with a key-padding, a random bool and an additive mask, forward
and forward+backward.

Decoding (issue 14, :func:`make_decode_case`): one query row per head against a KV cache, B=8,
Hq=32, Hk=8 (GQA), D=128, M in {1024, 4096, 16384}, float32 (target 2x SDPA) and bfloat16
(3x), and at least 70% of the machine's copy bandwidth (K and V bytes read per call / time);
N_q = 4 and 16 at M=4096 in float32 without a target.  ``--quick``: float32 M=4096 N_q=1.

Call path (issue 25, :func:`overhead_cases`, in ``--quick`` too): B=H=1, N=16, D=64 float32
forward and forward+backward, where the time is Python, autograd and dispatch, not the kernel.

CUDA (issue 10, :func:`cuda_cases`): the GPU targets first — bfloat16, D=128, N=8192, B=4, H=8,
not causal: forward >= 1.0x torch SDPA, forward+backward >= 0.9x (``--quick``: these two only);
then the same shape causal and bfloat16 D=64 N=4096.  Every distinct (dtype, head dim, causal,
fwd / bwd) autotunes its Triton kernels once (6 forward, 8 backward configs) in the first,
untimed call: ~8-18 s per case on an H200 (2026-11-26).  No float32 on the GPU: its autotuning
alone took 37 s there, for a figure no issue asks for.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Case, Impl, attnkit_impls, dtype_name, reference_skip, seeded_randn

FAMILY = "softmax"
EXTRA = 20  # Case.priority of the GPU cases no issue names as a target: after all the targets


def visible_pairs(n: int, m: int, causal: bool) -> int:
    """Number of (query, key) pairs attended: all N·M, or top-left causal Σᵢ min(i+1, M)."""
    if not causal:
        return n * m
    full = min(n, m)  # rows 0..full-1 see i+1 keys, the rest see all M
    return full * (full + 1) // 2 + (n - full) * m


def flops(b: int, h: int, n: int, m: int, d: int, dv: int, causal: bool, mode: str) -> float:
    fwd = 2.0 * b * h * visible_pairs(n, m, causal) * (d + dv)
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _inputs(b, h, n, d, dtype, seed):
    def make(device):
        return {
            "q": seeded_randn((b, h, n, d), dtype, device, seed),
            "k": seeded_randn((b, h, n, d), dtype, device, seed + 1),
            "v": seeded_randn((b, h, n, d), dtype, device, seed + 2),
        }
    return make


def _attnkit(causal):
    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.softmax_attention(x["q"], x["k"], x["v"], is_causal=causal, backend=backend)
        return fn
    return call


def _sdpa(causal):
    def fn(x):
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)
    return fn


def make_case(b: int, h: int, n: int, d: int, dtype: torch.dtype, causal: bool, mode: str,
              device: torch.device, seed: int = 0, targets: dict | None = None, priority: int = 0,
              call=None) -> Case:
    """``call``: ``call(backend) -> fn(inputs)`` for the attnkit rows (default :func:`_attnkit`)."""
    score_bytes = b * h * n * n * torch.empty((), dtype=dtype).element_size()
    impls = attnkit_impls(FAMILY, device, call or _attnkit(causal),
                          dtype=dtype, reference_skip_reason=reference_skip(score_bytes, device, dtype))
    impls.append(Impl("torch SDPA", "peer", fn=_sdpa(causal)))
    name = f"{'causal' if causal else 'full'}-{dtype_name(dtype)}-N{n}-D{d}"
    params = {"B": b, "H": h, "N": n, "D": d, "dtype": dtype_name(dtype), "causal": causal}
    return Case(FAMILY, name, mode, params, flops(b, h, n, n, d, d, causal, mode),
                _inputs(b, h, n, d, dtype, seed), impls,
                grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else (), targets=dict(targets or {}),
                priority=priority)


MASK_KINDS = ("padding", "bool", "additive")


def _mask_inputs(b, h, n, d, dtype, seed, kind):
    """q, k, v and the mask: ``padding`` a key-padding mask [B, 1, 1, N] (batch element i keeps
    its first N - i N / (2 B) keys, as a padded batch of a language model), ``bool`` a random [N,
    N] mask keeping ~70% of the entries, ``additive`` a float [N, N] bias."""
    base = _inputs(b, h, n, d, dtype, seed)

    def make(device):
        x = base(device)
        gen = torch.Generator().manual_seed(seed + 3)
        if kind == "padding":
            lengths = torch.tensor([n - i * n // (2 * b) for i in range(b)])
            mask = (torch.arange(n)[None, :] < lengths[:, None])[:, None, None, :]
        elif kind == "bool":
            mask = torch.rand(n, n, generator=gen) > 0.3
        else:
            mask = torch.randn(n, n, generator=gen).to(dtype)
        x["mask"] = mask.to(device)
        return x
    return make


def make_mask_case(b: int, h: int, n: int, d: int, dtype: torch.dtype, kind: str, mode: str,
                   device: torch.device, seed: int = 0) -> Case:
    """SDPA with ``attn_mask`` (see :func:`_mask_inputs` for the kinds), as model code calls it."""
    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.softmax_attention(x["q"], x["k"], x["v"], attn_mask=x["mask"], backend=backend)
        return fn

    score_bytes = b * h * n * n * torch.empty((), dtype=dtype).element_size()
    impls = attnkit_impls(FAMILY, device, call, dtype=dtype, reference_skip_reason=reference_skip(score_bytes, device, dtype))
    impls.append(Impl("torch SDPA", "peer",
                      fn=lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["mask"])))
    name = f"mask-{kind}-{dtype_name(dtype)}-N{n}-D{d}"
    params = {"B": b, "H": h, "N": n, "D": d, "dtype": dtype_name(dtype), "causal": False, "mask": kind}
    return Case(FAMILY, name, mode, params, flops(b, h, n, n, d, d, False, mode),
                _mask_inputs(b, h, n, d, dtype, seed, kind), impls,
                grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else ())


def _decode_inputs(b, h, hk, n, m, d, dtype, seed):
    def make(device):
        return {
            "q": seeded_randn((b, h, n, d), dtype, device, seed),
            "k": seeded_randn((b, hk, m, d), dtype, device, seed + 1),
            "v": seeded_randn((b, hk, m, d), dtype, device, seed + 2),
        }
    return make


def make_decode_case(b: int, h: int, hk: int, n: int, m: int, d: int, dtype: torch.dtype,
                     device: torch.device, seed: int = 0, targets: dict | None = None,
                     copy_fraction: float | None = None) -> Case:
    """Decoding forward: ``n`` query rows per head against ``m`` cached keys on ``hk`` kv heads.
    GB/s counts the K and V bytes (each read once: the floor of the call's memory traffic)."""
    esize = torch.empty((), dtype=dtype).element_size()

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.softmax_attention(x["q"], x["k"], x["v"], enable_gqa=True, backend=backend)
        return fn

    # The reference repeats K and V per query head (GQA) and runs unfused: ~1 s a call at
    # M=4096 here, for a figure nobody compares against.
    impls = attnkit_impls(FAMILY, device, call,
                          dtype=dtype, reference_skip_reason="the reference is for checking, not speed (GQA "
                          "repeats K/V per query head: ~1 s a call at M=4096 on 2 cores)")
    impls.append(Impl("torch SDPA", "peer",
                      fn=lambda x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], enable_gqa=True)))
    name = f"decode-{dtype_name(dtype)}-Nq{n}-M{m}-Hq{h}-Hk{hk}-D{d}"
    params = {"B": b, "H": h, "Hk": hk, "N": n, "M": m, "D": d, "dtype": dtype_name(dtype), "causal": False}
    return Case(FAMILY, name, "fwd", params, flops(b, h, n, m, d, d, False, "fwd"),
                _decode_inputs(b, h, hk, n, m, d, dtype, seed), impls,
                bytes=2.0 * b * hk * m * d * esize, targets=dict(targets or {}),
                copy_fraction_target=copy_fraction)


def decode_cases(quick: bool, device: torch.device) -> list[Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    if quick:
        return [make_decode_case(8, 32, 8, 1, 4096, 128, f32, device, targets={"torch SDPA": 2.0},
                                 copy_fraction=0.7)]
    out = []
    for dtype, target in ((f32, 2.0), (bf16, 3.0)):
        for m in (1024, 4096, 16384):
            out.append(make_decode_case(8, 32, 8, 1, m, 128, dtype, device,
                                        targets={"torch SDPA": target}, copy_fraction=0.7))
    for n in (4, 16):
        out.append(make_decode_case(8, 32, 8, n, 4096, 128, f32, device))
    return out


# Issue 25's call-path targets at N=16 (B=H=1, D=64, float32), where the kernels' work is a few
# hundred nanoseconds and the time is the call path (Python, autograd, dispatch): forward within
# 2 us of SDPA's -- SDPA's forward was 7.3 us on the Intel Xeon of the issue, so >= 0.78x there,
# rounded to 0.8x here -- and forward+backward within 1.2x of SDPA's (>= 0.83x).  The speedup
# targets are what the harness checks; each case's note gives the issue's own figure (the
# forward's gap in us, the forward+backward's time ratio), from :func:`overhead_figures`.
OVERHEAD_TARGETS = {"fwd": 0.8, "fwd+bwd": 0.83}
OVERHEAD_MAX_GAP_US = 2.0  # forward: attnkit's time - SDPA's
OVERHEAD_MAX_RATIO = 1.2  # forward+backward: attnkit's time / SDPA's


def _attnkit_bound(causal):
    """:func:`_attnkit` with the function looked up once, not imported on every call: in the
    overhead cases the bench's own wrapper would otherwise be part of the call path timed."""
    def call(backend):
        from .. import softmax_attention

        def fn(x):
            return softmax_attention(x["q"], x["k"], x["v"], is_causal=causal, backend=backend)
        return fn
    return call


def overhead_figures(mode: str, inputs: dict, rounds: int = 5, calls: int = 2000) -> dict:
    """Issue 25's figure for one mode on ``inputs`` (q, k, v): the default-backend attnkit call
    and SDPA alternating, each ``rounds`` times ``calls`` calls, the best round's time per call
    of each (a load that comes and goes hits both alike).  ``fwd``: ``gap_us`` = attnkit - SDPA;
    ``fwd+bwd`` (``out.sum().backward()``, a quarter as many calls): ``ratio`` = attnkit / SDPA."""
    import time

    from .. import softmax_attention

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if mode == "fwd+bwd":
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        calls = max(1, calls // 4)
    fns = {"attnkit": softmax_attention, "sdpa": F.scaled_dot_product_attention}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            if mode == "fwd+bwd":
                def step(fn=fn):
                    fn(q, k, v).sum().backward()
            else:
                def step(fn=fn):
                    fn(q, k, v)
            for _ in range(max(1, calls // 10)):  # warm
                step()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    us = {name: 1e6 * t for name, t in best.items()}
    out = {"attnkit_us": us["attnkit"], "sdpa_us": us["sdpa"], "rounds": rounds, "calls": calls}
    if mode == "fwd":
        out["gap_us"] = us["attnkit"] - us["sdpa"]
        out["met"] = out["gap_us"] <= OVERHEAD_MAX_GAP_US
    else:
        out["ratio"] = us["attnkit"] / us["sdpa"]
        out["met"] = out["ratio"] <= OVERHEAD_MAX_RATIO
    return out


def overhead_note(mode: str, figures: dict) -> str:
    """The case note of :func:`overhead_figures`' result."""
    how = (f"default backend {figures['attnkit_us']:.2f} us, SDPA {figures['sdpa_us']:.2f} us a call, "
           f"alternating, best of {figures['rounds']} x {figures['calls']} calls")
    verdict = "met" if figures["met"] else "MISSED"
    if mode == "fwd":
        return (f"issue 25: forward gap attnkit - SDPA = {figures['gap_us']:.2f} us (target <= "
                f"{OVERHEAD_MAX_GAP_US:g} us: {verdict}; {how})")
    return (f"issue 25: forward+backward attnkit / SDPA = {figures['ratio']:.3f} (target <= "
            f"{OVERHEAD_MAX_RATIO:g}: {verdict}; {how})")


def overhead_cases(device: torch.device) -> list[Case]:
    """The small-shape call-path cases (issue 25), in --quick too.  Making a case's inputs also
    times the issue's figure on them (:func:`overhead_figures`, ~1-3 s) into the case's notes:
    the harness times one implementation after the other and checks speedups only."""
    out = []
    for mode in ("fwd", "fwd+bwd"):
        case = make_case(1, 1, 16, 64, torch.float32, False, mode, device,
                         targets={"torch SDPA": OVERHEAD_TARGETS[mode]}, priority=EXTRA - 1,
                         call=_attnkit_bound(False))
        if device.type == "cpu":
            make = case.make_inputs

            def make_and_time(dev, make=make, case=case, mode=mode):
                inputs = make(dev)
                note = overhead_note(mode, overhead_figures(mode, inputs))
                case.notes[:] = [n for n in case.notes if not n.startswith("issue 25:")] + [note]
                return inputs
            case.make_inputs = make_and_time
        out.append(case)
    return out


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        return cuda_cases(quick, device)
    n = 1024 if quick else 4096
    out = overhead_cases(device)
    for mode in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            out.append(make_case(1, 8, n, 64, torch.float32, causal, mode, device))
    out.append(make_case(1, 8, n, 64, torch.bfloat16, False, "fwd", device))
    out.append(make_case(1, 8, n, 64, torch.float16, False, "fwd", device))
    if not quick:  # masks as model code passes them (B=4, N=1024: a padded batch)
        for kind in MASK_KINDS:
            for mode in ("fwd", "fwd+bwd"):
                out.append(make_mask_case(4, 8, 1024, 64, torch.float32, kind, mode, device))
    out += decode_cases(quick, device)
    return out


def cuda_cases(quick: bool, device: torch.device) -> list[Case]:
    """The GPU sweep, targets first (a run cut short by ``--deadline`` loses the extras)."""
    bf16 = torch.bfloat16
    # Issue 3's GPU target: bfloat16, D=128, N=8192, B·H=32.  The kernels take ~2 ms (forward)
    # and ~10 ms (forward+backward) on an H100, so even --quick runs the full shape: the time
    # goes to the Triton autotuning in the first call.
    out = [make_case(4, 8, 8192, 128, bf16, False, "fwd", device, targets={"torch SDPA": 1.0}, priority=1),
           make_case(4, 8, 8192, 128, bf16, False, "fwd+bwd", device, targets={"torch SDPA": 0.9}, priority=2)]
    if quick:
        return out
    out += [make_case(4, 8, 8192, 128, bf16, True, "fwd", device, priority=EXTRA),
            make_case(4, 8, 8192, 128, bf16, True, "fwd+bwd", device, priority=EXTRA),
            make_case(1, 8, 4096, 64, bf16, False, "fwd", device, priority=EXTRA)]
    return out

"""Hopfield cases: attnkit.hopfield_update (and hopfield_energy) against plain PyTorch and SDPA.

Update ξ ← softmax(β ξ Xᵀ) X, ``steps`` times.  Peers: the plain PyTorch loop (matmul, softmax,
matmul) and one torch SDPA call per step (keys = values = the stored patterns, ``scale=β``).
Energy E(ξ) = −β⁻¹ lse(β ξ Xᵀ) + ½ ξᵀξ + β⁻¹ log N + ½ M²; peer: the same formula in PyTorch.

FLOPs: update 4·B·H·S·N·D per step (ξ Xᵀ and P X); energy 2·B·H·S·N·D.

Full sizes (issue 6): B=H=1, S=1024, N=16384, D=64, 3 steps; one query S=1, N=262144, D=64, one
step; energy at S=1024, N=16384; on CUDA also one query at N=2²⁰.  ``--quick``: S=256, N=4096 and
S=1, N=65536.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .harness import Case, Impl, attnkit_impls, dtype_name, reference_skip, seeded_randn

FAMILY = "hopfield"


def plain_update(state, stored, beta: float, steps: int) -> torch.Tensor:
    xi = state
    for _ in range(steps):
        xi = torch.softmax(beta * (xi @ stored.transpose(-1, -2)), dim=-1) @ stored
    return xi


def sdpa_update(state, stored, beta: float, steps: int) -> torch.Tensor:
    xi = state
    for _ in range(steps):
        xi = F.scaled_dot_product_attention(xi, stored, stored, scale=beta)
    return xi


def attnkit_softmax_update(state, stored, beta: float, steps: int) -> torch.Tensor:
    """The update as a user of attnkit would write it without the Hopfield op: our own softmax
    attention kernel once per step (the issue's multi-query GPU peer)."""
    import attnkit

    xi = state
    for _ in range(steps):
        xi = attnkit.softmax_attention(xi, stored, stored, scale=beta)
    return xi


def plain_energy(state, stored, beta: float) -> torch.Tensor:
    n = stored.shape[-2]
    lse = torch.logsumexp(beta * (state @ stored.transpose(-1, -2)), dim=-1)
    m = stored.norm(dim=-1).amax(dim=-1, keepdim=True)  # [B, H, 1]
    return -lse / beta + 0.5 * (state * state).sum(-1) + math.log(n) / beta + 0.5 * m * m


def _inputs(b, h, s, n, d, dtype, seed):
    def make(device):
        return {
            "state": seeded_randn((b, h, s, d), dtype, device, seed),
            "stored": seeded_randn((b, h, n, d), dtype, device, seed + 1),
        }
    return make


def update_case(b: int, h: int, s: int, n: int, d: int, steps: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> Case:
    beta = 1.0 / math.sqrt(d)

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.hopfield_update(x["state"], x["stored"], beta=beta, steps=steps, backend=backend)
        return fn

    size = torch.empty((), dtype=dtype).element_size()
    impls = attnkit_impls(FAMILY, device, call, reference_skip_reason=reference_skip(b * h * s * n * size, device))
    impls.append(Impl("plain PyTorch loop", "peer", fn=lambda x: plain_update(x["state"], x["stored"], beta, steps)))
    impls.append(Impl("torch SDPA per step", "peer", fn=lambda x: sdpa_update(x["state"], x["stored"], beta, steps)))
    impls.append(Impl("attnkit softmax per step", "peer",
                      fn=lambda x: attnkit_softmax_update(x["state"], x["stored"], beta, steps)))
    params = {"B": b, "H": h, "S": s, "N": n, "D": d, "steps": steps, "dtype": dtype_name(dtype)}
    notes = []
    if s <= 16:  # few queries: bound by reading the stored patterns, once per step at best
        mib = b * h * n * d * size * steps / 2**20
        notes.append(f"reads >= {mib:.0f} MiB of stored patterns in all: time x copy bandwidth "
                     "(meta copy_gb_per_s, read + write) bounds the achievable")
    return Case(FAMILY, f"update-S{s}-N{n}-D{d}-steps{steps}", "fwd", params, 4.0 * b * h * s * n * d * steps,
                _inputs(b, h, s, n, d, dtype, seed), impls, notes=notes)


def energy_case(b: int, h: int, s: int, n: int, d: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> Case:
    beta = 1.0 / math.sqrt(d)

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.hopfield_energy(x["state"], x["stored"], beta, backend=backend)
        return fn

    size = torch.empty((), dtype=dtype).element_size()
    # The energy has its own dispatch entry (it had a C++ kernel before the update did).
    impls = attnkit_impls("hopfield_energy", device, call,
                          reference_skip_reason=reference_skip(b * h * s * n * size, device))
    impls.append(Impl("plain PyTorch", "peer", fn=lambda x: plain_energy(x["state"], x["stored"], beta)))
    params = {"B": b, "H": h, "S": s, "N": n, "D": d, "dtype": dtype_name(dtype)}
    return Case(FAMILY, f"energy-S{s}-N{n}-D{d}", "fwd", params, 2.0 * b * h * s * n * d,
                _inputs(b, h, s, n, d, dtype, seed), impls)


def cases(quick: bool, device: torch.device) -> list[Case]:
    f32 = torch.float32
    if quick:
        return [
            update_case(1, 1, 256, 4096, 64, 3, f32, device),
            update_case(1, 1, 1, 65536, 64, 1, f32, device),
            energy_case(1, 1, 256, 4096, 64, f32, device),
        ]
    out = [
        update_case(1, 1, 1024, 16384, 64, 3, f32, device),
        update_case(1, 1, 1, 262144, 64, 1, f32, device),
        energy_case(1, 1, 1024, 16384, 64, f32, device),
    ]
    if device.type == "cuda":  # issue 6's GPU targets: one query at N = 2^20; many queries in bf16
        out.append(update_case(1, 1, 1, 2**20, 64, 1, f32, device))
        out.append(update_case(1, 1, 1, 2**20, 64, 1, torch.bfloat16, device))
        out.append(update_case(1, 8, 4096, 16384, 64, 3, torch.bfloat16, device))
    return out

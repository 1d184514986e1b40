"""Hopfield cases: attnkit.hopfield_update (and hopfield_energy) against plain PyTorch and SDPA.

Update ξ ← softmax(β ξ Xᵀ) X, ``steps`` times.  Peers: the plain PyTorch loop (matmul, softmax,
matmul) and one torch SDPA call per step (keys = values = the stored patterns, ``scale=β``).
Energy E(ξ) = −β⁻¹ lse(β ξ Xᵀ) + ½ ξᵀξ + β⁻¹ log N + ½ M²; peer: the same formula in PyTorch.

FLOPs: update 4·B·H·S·N·D per step (ξ Xᵀ and P X); energy 2·B·H·S·N·D.

Full sizes (issue 6): B=H=1, S=1024, N=16384, D=64, 3 steps; one query S=1, N=262144, D=64, one
step; energy at S=1024, N=16384; and forward+backward (state and stored patterns) at S=256,
N=4096, 3 steps.  ``--quick``: S=256, N=4096 and S=1, N=65536.

CUDA (issue 10, :func:`cuda_cases`): one query at N = 2²⁰, D=64, bfloat16 (``--quick``: this case
only) and float32 — bound by reading the stored patterns once, so reported in GB/s against the
measured copy bandwidth (target >= 70%); then many queries (B=1, H=8, S=4096, N=16384, 3 steps)
and the energy (S=1024, N=16384), bfloat16.  GB/s counts the stored patterns read once per step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .harness import Case, Impl, attnkit_impls, dtype_name, reference_skip, seeded_randn

FAMILY = "hopfield"
SPLIT_QUERIES = 16  # at most this many queries: the kernels split N across the GPU / cores


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
                seed: int = 0, copy_fraction_target: float | None = None, priority: int = 0,
                mode: str = "fwd") -> Case:
    """``mode`` "fwd+bwd": gradients of the state and the stored patterns (training a Hopfield
    layer), FLOPs counted as 3.5x the forward's (the softmax cases' convention)."""
    beta = 1.0 / math.sqrt(d)

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.hopfield_update(x["state"], x["stored"], beta=beta, steps=steps, backend=backend)
        return fn

    size = torch.empty((), dtype=dtype).element_size()
    impls = attnkit_impls(FAMILY, device, call, dtype=dtype, reference_skip_reason=reference_skip(b * h * s * n * size, device, dtype))
    impls.append(Impl("plain PyTorch loop", "peer", fn=lambda x: plain_update(x["state"], x["stored"], beta, steps)))
    impls.append(Impl("torch SDPA per step", "peer", fn=lambda x: sdpa_update(x["state"], x["stored"], beta, steps)))
    # On CUDA a single query would autotune the softmax kernels for this peer alone, and one
    # query is not what they are for: the peer runs for many queries only.
    if torch.device(device).type != "cuda" or s > SPLIT_QUERIES:
        impls.append(Impl("attnkit softmax per step", "peer",
                          fn=lambda x: attnkit_softmax_update(x["state"], x["stored"], beta, steps)))
    params = {"B": b, "H": h, "S": s, "N": n, "D": d, "steps": steps, "dtype": dtype_name(dtype)}
    notes = []
    stored_bytes = float(b * h * n * d * size * steps)
    if s <= SPLIT_QUERIES:  # few queries: bound by reading the stored patterns, once per step at best
        mib = stored_bytes / 2**20
        notes.append(f"reads >= {mib:.0f} MiB of stored patterns in all: time x copy bandwidth "
                     "(meta copy_gb_per_s, read + write) bounds the achievable")
    name = f"update-S{s}-N{n}-D{d}-steps{steps}"
    if torch.device(device).type == "cuda" or dtype != torch.float32:
        name += f"-{dtype_name(dtype)}"  # the sweeps have shapes in two dtypes (CPU names: float32 plain)
    train = mode == "fwd+bwd"
    return Case(FAMILY, name, mode, params, 4.0 * b * h * s * n * d * steps * (3.5 if train else 1.0),
                _inputs(b, h, s, n, d, dtype, seed), impls, notes=[] if train else notes,
                bytes=stored_bytes if s <= SPLIT_QUERIES and not train else 0.0,
                copy_fraction_target=copy_fraction_target, priority=priority,
                grad_inputs=("state", "stored") if train else ())


def energy_case(b: int, h: int, s: int, n: int, d: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0, priority: int = 0, mode: str = "fwd") -> Case:
    """``mode`` "fwd+bwd": gradients of the state and the stored patterns (FLOPs 3.5x)."""
    beta = 1.0 / math.sqrt(d)

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.hopfield_energy(x["state"], x["stored"], beta, backend=backend)
        return fn

    size = torch.empty((), dtype=dtype).element_size()
    # The energy has its own dispatch entry (it had a C++ kernel before the update did).
    impls = attnkit_impls("hopfield_energy", device, call,
                          dtype=dtype, reference_skip_reason=reference_skip(b * h * s * n * size, device, dtype))
    impls.append(Impl("plain PyTorch", "peer", fn=lambda x: plain_energy(x["state"], x["stored"], beta)))
    params = {"B": b, "H": h, "S": s, "N": n, "D": d, "dtype": dtype_name(dtype)}
    name = f"energy-S{s}-N{n}-D{d}" + (f"-{dtype_name(dtype)}" if torch.device(device).type == "cuda"
                                        or dtype != torch.float32 else "")
    train = mode == "fwd+bwd"
    return Case(FAMILY, name, mode, params, 2.0 * b * h * s * n * d * (3.5 if train else 1.0),
                _inputs(b, h, s, n, d, dtype, seed), impls, priority=priority,
                grad_inputs=("state", "stored") if train else ())


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        return cuda_cases(quick, device)
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
        # training: the update's backward (each step through the softmax backward kernel)
        update_case(1, 1, 256, 4096, 64, 3, f32, device, mode="fwd+bwd"),
        # bfloat16 (issue 25: "Hopfield keeps its lead in bfloat16"; on a CPU with AMX the
        # forward's tile GEMMs take brgemm by default, and a "native tiles" row runs beside it)
        update_case(1, 1, 1024, 16384, 64, 3, torch.bfloat16, device),
        update_case(1, 1, 1, 262144, 64, 1, torch.bfloat16, device),
        energy_case(1, 1, 1024, 16384, 64, torch.bfloat16, device),
    ]
    return out


COPY_TARGET = 0.7  # issue 10: single-query retrieval at >= 70% of the measured copy bandwidth
EXTRA = 20  # Case.priority of the GPU cases no issue names as a target: after all the targets


def cuda_cases(quick: bool, device: torch.device) -> list[Case]:
    """Issue 6's GPU targets: one query at N = 2^20 (bandwidth), many queries in bfloat16."""
    bf16 = torch.bfloat16
    # The cheapest target case runs first of all (no autotuning: the split-N kernels take one config).
    out = [update_case(1, 1, 1, 2**20, 64, 1, bf16, device, copy_fraction_target=COPY_TARGET, priority=0)]
    if quick:
        return out
    out += [update_case(1, 1, 1, 2**20, 64, 1, torch.float32, device, copy_fraction_target=COPY_TARGET,
                        priority=EXTRA),
            update_case(1, 8, 4096, 16384, 64, 3, bf16, device, priority=EXTRA),
            energy_case(1, 1, 1024, 16384, 64, bf16, device, priority=EXTRA)]
    return out

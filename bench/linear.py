"""Linear attention cases: attnkit.linear_attention against the two ways people write it in PyTorch.

Peers: the masked quadratic form ((φQ φKᵀ) ∘ tril) V with its row sums as the normalizer, and the
cumulative sum of outer products Σ_{j≤i} φ(k_j) v_jᵀ (an [N, D, Dv] tensor per head).

FLOPs are those of the O(N) recurrent form, the same for every implementation (so the quadratic
peer's figure is an *effective* rate): forward 4·B·H·N·D·Dv (the state update φ(k) vᵀ and the
read-out φ(q)ᵀS per token, 2 FLOPs per multiply-add); forward+backward 3× the forward.

Full sizes (issue 5): B=1, H=8, N=4096 and N=16384, D=64, float32, causal, elu+1,
forward+backward (their ratio is the linear-cost check t(16384)/t(4096) ≤ 4.6).
Crossover (issue 5): causal forward at N = 128 .. 2048 (CUDA: bfloat16, 512 .. 8192) with
attnkit.softmax_attention as a further peer computing a different function; its ratio crosses 1
where linear attention becomes the cheaper one.
``--quick``: N=256 and N=1024, and the crossover at N=256 only.

CUDA (issue 10, :func:`cuda_cases`): bfloat16, causal, elu+1, B=1, H=8, D=64, each case against
flash-linear-attention's chunk kernel when it is installed (``fla-core``: ``pip install --no-index
--no-deps .whl/fla_core-*.whl``; reported unavailable otherwise) — the forward at N=16384 right
after the other families' targets, the crossover with softmax at N = 1024, 4096, 8192 (forward),
and last of the whole sweep forward+backward at N=16384 and N=4096 (their ratio is the
linear-cost check).  The order follows the compile cost: fla's autotuner compiles some 50 kernel
configs for its forward and as many for its backward on first use (together ~110 s on an H200,
2026-11-26; later cases reuse them), so a sweep cut short by ``--deadline`` loses fla's backward
first.  Not in ``--quick``: that, and attnkit's own linear kernels' ~20 s of autotuning.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .harness import Case, Impl, Unavailable, attnkit_impls, dtype_name, reference_skip, seeded_randn, too_big

FAMILY = "linear"
EPS = 1e-6


def phi(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1, the default feature map."""
    return F.elu(x) + 1.0


def quadratic(q, k, v, causal: bool, eps: float = EPS) -> torch.Tensor:
    """The masked quadratic form: materializes the [N, N] kernel matrix."""
    scores = phi(q) @ phi(k).transpose(-1, -2)
    if causal:
        n = q.shape[-2]
        scores = scores * torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return (scores @ v) / (scores.sum(-1, keepdim=True) + eps)


def cumsum_outer(q, k, v, causal: bool, eps: float = EPS) -> torch.Tensor:
    """Prefix sums of the outer products φ(k_j) v_jᵀ: an [N, D, Dv] tensor per head."""
    fq, fk = phi(q), phi(k)
    if causal:
        state = torch.cumsum(fk.unsqueeze(-1) * v.unsqueeze(-2), dim=-3)  # [B, H, N, D, Dv]
        norm = torch.cumsum(fk, dim=-2)
        num = torch.einsum("bhnd,bhnde->bhne", fq, state)
    else:
        state = fk.transpose(-1, -2) @ v  # [B, H, D, Dv]
        norm = fk.sum(-2, keepdim=True)
        num = fq @ state
    return num / ((fq * norm).sum(-1, keepdim=True) + eps)


def flops(b: int, h: int, n: int, d: int, dv: int, mode: str) -> float:
    fwd = 4.0 * b * h * n * d * dv
    return fwd * (3.0 if mode == "fwd+bwd" else 1.0)


def _inputs(b, h, n, d, dv, dtype, seed):
    def make(device):
        return {
            "q": seeded_randn((b, h, n, d), dtype, device, seed),
            "k": seeded_randn((b, h, n, d), dtype, device, seed + 1),
            "v": seeded_randn((b, h, n, dv), dtype, device, seed + 2),
        }
    return make


def _attnkit(causal):
    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.linear_attention(x["q"], x["k"], x["v"], causal=causal, feature_map="elu",
                                            backend=backend)
        return fn
    return call


FLA_IMPORT = "fla.ops.linear_attn.chunk_linear_attn"
FLA_INSTALL = "pip install --no-index --no-deps .whl/fla_core-*.whl (fla-core, pure Python on Triton)"


def fla_missing() -> str:
    """'' when flash-linear-attention (``fla``) is installed, else why it is not run.  Only
    looked up here; it is imported on the first (warmup) call, which takes seconds."""
    if importlib.util.find_spec("fla") is None:
        return f"flash-linear-attention is not installed: {FLA_INSTALL}"
    return ""


def _import_fla_chunk():
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as exc:  # noqa: BLE001 - installed but broken here (triton / torch versions)
        raise Unavailable(f"{FLA_IMPORT} does not import: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
    return chunk_linear_attn


def _fla_chunk(mode: str):
    """flash-linear-attention's chunked kernel (the issue's GPU peer), on the same φ(q), φ(k):
    ``fla.ops.linear_attn.chunk_linear_attn(q, k, v, scale, normalize=True)`` takes [B, T, H, K]
    (time before heads) and normalizes by φ(q)·Σφ(k) itself (+1e-10, no 1e-6); causal only, CUDA
    only (Triton).  Returns (fn, note).

    ``fwd``: the inputs are laid out as [B, T, H, D] once, outside the timed calls (a user of
    fla keeps that layout), and φ is applied inside them (attnkit applies it in its kernel).
    ``fwd+bwd``: the transposes to and from that layout (and their backward) are timed with it,
    because the harness's gradients are taken with respect to the [B, H, N, D] inputs."""
    if mode == "fwd":
        state: dict = {}

        def fwd(x):
            chunk = _import_fla_chunk()
            if state.get("src") is not x["q"]:
                state["src"] = x["q"]
                state["bthd"] = tuple(x[k].transpose(1, 2).contiguous() for k in ("q", "k", "v"))
            q, k, v = state["bthd"]
            out, _ = chunk(phi(q), phi(k), v, scale=1.0, normalize=True)
            return out.transpose(1, 2)
        return fwd, "normalizes without eps; [B, T, H, D] inputs made outside the timing"

    def fwd_bwd(x):
        chunk = _import_fla_chunk()
        q, k, v = (t.transpose(1, 2) for t in (phi(x["q"]), phi(x["k"]), x["v"]))
        out, _ = chunk(q, k, v, scale=1.0, normalize=True)
        return out.transpose(1, 2)
    return fwd_bwd, "normalizes without eps; the transposes to [B, T, H, D] are timed"


def _softmax_peer(causal):
    def fn(x):
        import attnkit

        return attnkit.softmax_attention(x["q"], x["k"], x["v"], is_causal=causal)
    return fn


def make_case(b: int, h: int, n: int, d: int, dv: int, dtype: torch.dtype, causal: bool, mode: str,
              device: torch.device, seed: int = 0, crossover: bool = False, priority: int = 0) -> Case:
    """``crossover``: also time attnkit's own softmax attention on the same inputs (a different
    function: the ratio says from which N on linear attention is the cheaper one).  On CUDA
    (causal), flash-linear-attention's chunk kernel is a peer too."""
    size = torch.empty((), dtype=dtype).element_size()
    # Big intermediates live at the peak (measured: cumsum outer fwd+bwd peaks at ~4x its
    # [N, D, Dv] tensor): ~2 for the forward, ~4 with the backward.
    live = 4 if mode == "fwd+bwd" else 2
    nn_bytes = b * h * n * n * size
    outer_bytes = b * h * n * d * dv * size if causal else 0
    impls = attnkit_impls(FAMILY, device, _attnkit(causal),
                          dtype=dtype, reference_skip_reason=reference_skip(nn_bytes, device, dtype))
    impls.append(Impl("masked quadratic", "peer", fn=lambda x: quadratic(x["q"], x["k"], x["v"], causal),
                      skip=too_big(live * nn_bytes, device, "the [N, N] kernel matrix")))
    impls.append(Impl("cumsum outer", "peer", fn=lambda x: cumsum_outer(x["q"], x["k"], x["v"], causal),
                      skip=too_big(live * outer_bytes, device, "the [N, D, Dv] prefix-sum tensor")))
    if device.type == "cuda" and causal:
        fla_fn, note = _fla_chunk(mode)
        impls.append(Impl("flash-linear-attention chunk", "peer", fn=fla_fn, unavailable=fla_missing(), note=note))
    if crossover:
        impls.append(Impl("attnkit softmax attention", "peer", fn=_softmax_peer(causal), same_result=False,
                          note="softmax, not linear attention: the crossover point"))
    name = f"{'causal' if causal else 'full'}-elu-{dtype_name(dtype)}-N{n}-D{d}"
    params = {"B": b, "H": h, "N": n, "D": d, "Dv": dv, "dtype": dtype_name(dtype), "causal": causal,
              "feature_map": "elu"}
    return Case(FAMILY, name, mode, params, flops(b, h, n, d, dv, mode), _inputs(b, h, n, d, dv, dtype, seed),
                impls, grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else (), priority=priority)


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        return cuda_cases(quick, device)
    sizes = (256, 1024) if quick else (4096, 16384)
    out = [make_case(1, 8, n, 64, 64, torch.float32, True, "fwd+bwd", device) for n in sizes]
    # The crossover with softmax attention (issue 5): causal forward over a sweep of N.
    sweep = (256,) if quick else (128, 256, 512, 1024, 2048)
    out += [make_case(1, 8, n, 64, 64, torch.float32, True, "fwd", device, crossover=True) for n in sweep]
    return out


# Case.priority: after the other families' targets; after all the targets; last of all.
FLA_CASE, EXTRA, LAST = 10, 20, 30


def cuda_cases(quick: bool, device: torch.device) -> list[Case]:
    """The GPU sweep: bfloat16, causal, B=1, H=8, D=64 (see the module docstring); none in
    ``--quick``."""
    if quick:
        return []
    bf16 = torch.bfloat16
    out = [make_case(1, 8, 16384, 64, 64, bf16, True, "fwd", device, priority=FLA_CASE)]
    out += [make_case(1, 8, n, 64, 64, bf16, True, "fwd", device, crossover=True, priority=EXTRA)
            for n in (1024, 4096, 8192)]
    out += [make_case(1, 8, n, 64, 64, bf16, True, "fwd+bwd", device, priority=LAST) for n in (16384, 4096)]
    return out

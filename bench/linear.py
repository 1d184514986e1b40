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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Case, Impl, attnkit_impls, dtype_name, reference_skip, seeded_randn, too_big

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


def _fla_chunk(causal):
    """flash-linear-attention's chunked kernel (the issue's GPU peer), on the same φ(q), φ(k):
    ``fla.ops.linear_attn.chunk_linear_attn`` takes [B, T, H, K] and normalizes by
    φ(q)·Σφ(k) itself (no eps).  Causal only; CUDA only (Triton)."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as exc:  # noqa: BLE001 - not installed / not importable here
        return None, (f"flash-linear-attention is not importable ({type(exc).__name__}); "
                      "pip install flash-linear-attention")

    def fn(x):
        q, k, v = (t.transpose(1, 2) for t in (phi(x["q"]), phi(x["k"]), x["v"]))
        out, _ = chunk_linear_attn(q, k, v, scale=1.0, normalize=True)
        return out.transpose(1, 2)
    return fn, ""


def _softmax_peer(causal):
    def fn(x):
        import attnkit

        return attnkit.softmax_attention(x["q"], x["k"], x["v"], is_causal=causal)
    return fn


def make_case(b: int, h: int, n: int, d: int, dv: int, dtype: torch.dtype, causal: bool, mode: str,
              device: torch.device, seed: int = 0, crossover: bool = False) -> Case:
    """``crossover``: also time attnkit's own softmax attention on the same inputs (a different
    function: the ratio says from which N on linear attention is the cheaper one)."""
    size = torch.empty((), dtype=dtype).element_size()
    # Big intermediates live at the peak (measured: cumsum outer fwd+bwd peaks at ~4x its
    # [N, D, Dv] tensor): ~2 for the forward, ~4 with the backward.
    live = 4 if mode == "fwd+bwd" else 2
    nn_bytes = b * h * n * n * size
    outer_bytes = b * h * n * d * dv * size if causal else 0
    impls = attnkit_impls(FAMILY, device, _attnkit(causal),
                          reference_skip_reason=reference_skip(nn_bytes, device))
    impls.append(Impl("masked quadratic", "peer", fn=lambda x: quadratic(x["q"], x["k"], x["v"], causal),
                      skip=too_big(live * nn_bytes, device, "the [N, N] kernel matrix")))
    impls.append(Impl("cumsum outer", "peer", fn=lambda x: cumsum_outer(x["q"], x["k"], x["v"], causal),
                      skip=too_big(live * outer_bytes, device, "the [N, D, Dv] prefix-sum tensor")))
    if device.type == "cuda" and causal:
        fla_fn, why = _fla_chunk(causal)
        impls.append(Impl("flash-linear-attention chunk", "peer", fn=fla_fn, unavailable=why,
                          note="normalizes without eps"))
    if crossover:
        impls.append(Impl("attnkit softmax attention", "peer", fn=_softmax_peer(causal), same_result=False,
                          note="softmax, not linear attention: the crossover point"))
    name = f"{'causal' if causal else 'full'}-elu-{dtype_name(dtype)}-N{n}-D{d}"
    params = {"B": b, "H": h, "N": n, "D": d, "Dv": dv, "dtype": dtype_name(dtype), "causal": causal,
              "feature_map": "elu"}
    return Case(FAMILY, name, mode, params, flops(b, h, n, d, dv, mode), _inputs(b, h, n, d, dv, dtype, seed),
                impls, grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else ())


def cases(quick: bool, device: torch.device) -> list[Case]:
    sizes = (256, 1024) if quick else (4096, 16384)
    out = [make_case(1, 8, n, 64, 64, torch.float32, True, "fwd+bwd", device) for n in sizes]
    # The crossover with softmax attention (issue 5): causal forward over a sweep of N.
    sweep = (256,) if quick else (128, 256, 512, 1024, 2048)
    if device.type == "cuda" and not quick:
        sweep = (512, 1024, 2048, 4096, 8192)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out += [make_case(1, 8, n, 64, 64, dtype, True, "fwd", device, crossover=True) for n in sweep]
    return out

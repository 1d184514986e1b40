"""Reference softmax attention: straightforward PyTorch, the ground truth of the tests.

Computes in the dtype it is given (run it in float64 for ground truth, or in float16 /
bfloat16 to measure the error a naive implementation makes in that dtype).  Materializes the
[B, H, N, M] score matrix: for checking, not for speed.
"""
from __future__ import annotations

import math

import torch


def expand_kv_heads(x: torch.Tensor, num_query_heads: int) -> torch.Tensor:
    """Repeat each key/value head so that ``x`` has ``num_query_heads`` heads (GQA / MQA)."""
    groups = num_query_heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def softmax_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    return_lse: bool = False,
    dropout_mask: torch.Tensor | None = None,
):
    """SDPA semantics on [B, H, N, D] tensors, with zeros (and LSE -inf) for fully masked rows.

    query [B, H, N, D], key [B, Hk, M, D], value [B, Hk, M, Dv] -> out [B, H, N, Dv]
    (and lse [B, H, N] when ``return_lse``; float64 for float64 inputs, float32 otherwise).
    ``attn_mask``: bool (True = attend) or additive float, broadcastable to [B, H, N, M].
    ``is_causal``: key j is visible to query i when j <= i (top-left aligned, like SDPA).
    ``dropout_mask``: optional bool [B, H, N, M] of kept probabilities (True = keep); without it
    and with ``dropout_p > 0`` one is drawn as ``torch.rand_like(scores) >= dropout_p`` (so a
    call is reproducible under torch.manual_seed); kept probabilities are scaled by 1/(1 - p).
    The lse is that of the scores before dropout.  Differentiable in every floating input
    (attn_mask included), with zero -- not NaN -- gradients on fully masked rows.
    No input checks: the public function validates.
    """
    num_heads = query.shape[-3]
    if enable_gqa:
        key = expand_kv_heads(key, num_heads)
        value = expand_kv_heads(value, num_heads)
    n, m = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(n, m, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
    # Softmax with a detached shift (softmax is shift invariant, so the gradient is exact).  The
    # shift is the row's log-sum-exp, replaced by 0 where it is -inf (a fully masked row, or
    # M = 0): every exponent is then exp(-inf) = 0, so the row's denominator is 0.  Guarding the
    # division and the log with `where` keeps such rows at output 0 / LSE -inf *and* keeps their
    # gradients 0 -- torch.logsumexp's own backward gives NaN there (-inf - -inf), which an
    # additive -inf mask would pass on to query and key.
    shift = torch.logsumexp(scores.detach(), dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    exps = torch.exp(scores - shift)
    denom = exps.sum(dim=-1, keepdim=True)
    # A NaN sum (a NaN or +inf score) is not "no key": that row's out and lse are NaN, as
    # SDPA's are; only a row whose every key is hidden has the sum 0 (issue 15).
    attended = denom != 0
    safe_denom = torch.where(attended, denom, torch.ones_like(denom))
    probs = exps / safe_denom
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = torch.rand_like(probs) >= dropout_p
        probs = probs * dropout_mask / (1.0 - dropout_p)
    out = torch.matmul(probs, value)
    if not return_lse:
        return out
    lse = torch.where(attended, shift + torch.log(safe_denom), torch.full_like(denom, float("-inf")))
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return out, lse.squeeze(-1).to(lse_dtype)

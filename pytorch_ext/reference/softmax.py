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
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
):
    """SDPA semantics on [B, H, N, D] tensors, with zeros (and LSE -inf) for fully masked rows.

    query [B, H, N, D], key [B, Hk, M, D], value [B, Hk, M, Dv] -> out [B, H, N, Dv]
    (and lse [B, H, N] when ``return_lse``; float64 for float64 inputs, float32 otherwise).
    ``attn_mask``: bool (True = attend) or additive float, broadcastable to [B, H, N, M].
    ``is_causal``: key j is visible to query i when j <= i (top-left aligned, like SDPA).
    ``dropout_mask``: optional bool [B, H, N, M] of kept probabilities (True = keep); without it
    and with ``dropout_p > 0`` one is drawn as ``torch.rand_like(scores) >= dropout_p`` (so a
    call is reproducible under torch.manual_seed); kept probabilities are scaled by 1/(1 - p).
    The lse is that of the scores before dropout.

    Score options (issue 28; ``attnkit.softmax_attention`` documents them), applied in this
    order to the score s_ij = scale · q_i·k_j:

    - ``softcap`` > 0: s = softcap · tanh(s / softcap);
    - ``alibi_slopes`` [H] or [B, H] (any leading dims before H): s -= slope_h · |i + M - N - j|;
    - then the masks: ``attn_mask``, ``is_causal``, and ``window = (left, right)`` (-1 =
      unbounded on that side): key j is visible to query i iff
      ``i + M - N - left <= j <= i + M - N + right`` (bottom-right aligned, FlashAttention's);
    - ``sinks`` [H]: one more logit per head in each row's softmax denominator, with no value:
      p_ij = exp(s_ij) / (Σ_j exp(s_ij) + exp(sink_h)); the lse is log of that whole
      denominator (keys and sink), so a row with no visible key gives out 0 and lse = sink.

    Differentiable in every floating input (attn_mask, alibi_slopes and sinks included), with
    zero -- not NaN -- gradients on fully masked rows.  No input checks: the public function
    validates.
    """
    num_heads = query.shape[-3]
    if enable_gqa:
        key = expand_kv_heads(key, num_heads)
        value = expand_kv_heads(value, num_heads)
    n, m = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(n, device=query.device).unsqueeze(-1)
    cols = torch.arange(m, device=query.device)
    if alibi_slopes is not None:
        distance = (rows + (m - n) - cols).abs().to(scores.dtype)  # |i + M - N - j|, [N, M]
        slopes = alibi_slopes.to(scores.dtype)
        scores = scores - slopes.reshape(*slopes.shape, 1, 1) * distance
    if is_causal:
        causal = torch.ones(n, m, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if window is not None and tuple(window) != (-1, -1):
        left, right = window
        visible = torch.ones(n, m, dtype=torch.bool, device=query.device)
        if left >= 0:
            visible &= cols >= rows + (m - n) - left
        if right >= 0:
            visible &= cols <= rows + (m - n) + right
        scores = scores.masked_fill(~visible, float("-inf"))
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
    sink = None
    if sinks is not None:
        # The sink's logit as one more column of each row (it enters the shift and the sum).
        sink = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        shift = torch.logsumexp(torch.cat([scores, sink], dim=-1).detach(), dim=-1, keepdim=True)
    else:
        shift = torch.logsumexp(scores.detach(), dim=-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    exps = torch.exp(scores - shift)
    denom = exps.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - shift)
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

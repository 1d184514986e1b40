"""Softmax attention: ``attnkit.softmax_attention``, a drop-in for torch's SDPA.

Layers (DESIGN.md): the public function below validates every input, asks
:func:`attnkit._dispatch.resolve` for the backend of family ``"softmax"`` and calls that
backend's implementation from :data:`_IMPLEMENTATIONS`.  Only the pure-PyTorch reference exists
so far; kernel backends add their entry (and ``register_kernel("softmax", ...)``) here.
"""
from __future__ import annotations

import math

import torch

from .._dispatch import resolve
from .._validation import (
    check_bool,
    check_real,
    check_same_dtype_device,
    check_size_match,
    check_tensor,
)
from ..reference.softmax import softmax_attention_reference

FAMILY = "softmax"
OP_NAME = "attnkit.softmax_attention"


def _run_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    # The reference computes in the inputs' dtype; it draws its dropout mask with torch.rand, so
    # results are reproducible under torch.manual_seed.
    return softmax_attention_reference(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse=return_lse
    )


# backend name -> implementation with _run_reference's signature.
_IMPLEMENTATIONS = {"reference": _run_reference}


def _check_mask(attn_mask, query: torch.Tensor, target: tuple[int, int, int, int]) -> None:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"{OP_NAME}: attn_mask must be a torch.Tensor or None; got {type(attn_mask).__name__}"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"{OP_NAME}: attn_mask must be bool (True = attend) or floating point (added to the "
            f"scores); got {str(attn_mask.dtype).replace('torch.', '')}"
        )
    if attn_mask.device != query.device:
        raise ValueError(
            f"{OP_NAME}: attn_mask must be on the device of query ({query.device}); got {attn_mask.device}"
        )
    # Broadcastable *to* [B, H, N, M]: the mask may not enlarge the result (SDPA neither).
    shape = tuple(attn_mask.shape)
    fits = len(shape) <= 4 and all(
        size == 1 or size == want for size, want in zip(reversed(shape), reversed(target))
    )
    if not fits:
        raise ValueError(
            f"{OP_NAME}: attn_mask must be broadcastable to [B, H, N, M] = {list(target)}; "
            f"got shape {list(shape)}"
        )


def softmax_attention(
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
    backend: str | None = None,
):
    """Scaled dot-product (softmax) attention with the semantics of
    :func:`torch.nn.functional.scaled_dot_product_attention`.

    ``out[b, h, i] = Σ_j softmax_j(scale · q_i·k_j + bias_ij) · v_j``

    Args:
        query: ``[B, H, N, D]``.
        key: ``[B, Hk, M, D]`` (M may differ from N).
        value: ``[B, Hk, M, Dv]`` (Dv may differ from D).
            query, key and value share one floating dtype (float16, bfloat16, float32, float64)
            and one device; any strides.
        attn_mask: None, or a tensor broadcastable to ``[B, H, N, M]``: bool (True = attend,
            False = masked out) or floating point (added to the scores; any floating dtype, cast
            to the inputs' dtype; -inf masks out).
        dropout_p: probability in ``[0, 1)`` of zeroing each attention probability (kept ones
            are scaled by ``1 / (1 - dropout_p)``).  Applied whenever it is > 0, like SDPA
            (there is no training flag); the random mask comes from torch's generator, so a
            call is reproducible under ``torch.manual_seed``.
        is_causal: key j is visible to query i only when ``j <= i`` (top-left aligned, like SDPA,
            also when M != N).  Cannot be combined with ``attn_mask`` (SDPA neither).
        scale: multiplies ``q·k``; default ``1 / sqrt(D)``.  Any finite number.
        enable_gqa: grouped-query attention: when ``H != Hk`` (H must be a multiple of Hk),
            query head h uses key/value head ``h // (H // Hk)``.  Without it ``H == Hk``.
        return_lse: also return the log-sum-exp of each row's (scaled, masked) scores.
        backend: ``"reference" | "cpu" | "triton" | "cuda"`` or None (default: the device's
            backend, else the reference; the environment variable ``ATTNKIT_BACKEND`` overrides
            it).  Softmax has only the reference so far.

    Returns:
        ``out`` ``[B, H, N, Dv]`` in the inputs' dtype; with ``return_lse`` the tuple
        ``(out, lse)``, lse ``[B, H, N]`` in float32 (float64 for float64 inputs).

    A row with no key to attend to (fully masked, or M = 0) gives output 0 and lse -inf, and
    zero gradients -- never NaN (SDPA gives NaN there).  Empty N or M give empty / zero results.
    Differentiable in query, key, value and a floating ``attn_mask``.

    Raises:
        TypeError: a non-tensor, non-floating q/k/v, a mask that is neither bool nor floating,
            a non-bool flag, a non-finite or non-numeric ``scale`` / ``dropout_p``.
        ValueError: wrong rank, mismatched sizes / dtypes / devices, head counts that do not
            fit (GQA), a mask that does not broadcast to ``[B, H, N, M]`` or lies on another
            device, ``attn_mask`` with ``is_causal``, ``dropout_p`` outside ``[0, 1)``, an
            unknown backend.
        attnkit.BackendUnavailableError: the backend asked for cannot run here.

    Example::

        >>> q = torch.randn(2, 8, 128, 64)
        >>> k = v = torch.randn(2, 2, 256, 64)
        >>> out, lse = attnkit.softmax_attention(q, k, v, is_causal=True, enable_gqa=True,
        ...                                      return_lse=True)
        >>> out.shape, lse.shape, lse.dtype
        (torch.Size([2, 8, 128, 64]), torch.Size([2, 8, 128]), torch.float32)
    """
    # --- validation: everything before any computation ---
    check_tensor(OP_NAME, "query", query, "[B, H, N, D]")
    check_tensor(OP_NAME, "key", key, "[B, Hk, M, D]")
    check_tensor(OP_NAME, "value", value, "[B, Hk, M, Dv]")
    check_same_dtype_device(OP_NAME, {"query": query, "key": key, "value": value})
    batch, heads, n, head_dim = query.shape
    kv_heads, m = key.shape[1], key.shape[2]
    check_size_match(OP_NAME, "batch size", {"query": batch, "key": key.shape[0], "value": value.shape[0]})
    check_size_match(OP_NAME, "head dim D", {"query": head_dim, "key": key.shape[3]})
    check_size_match(OP_NAME, "sequence length M", {"key": m, "value": value.shape[2]})
    check_size_match(OP_NAME, "number of heads Hk", {"key": kv_heads, "value": value.shape[1]})
    # Flags must be real bools, like SDPA, which rejects is_causal=1: a number there is
    # probably a misplaced positional argument.
    check_bool(OP_NAME, "is_causal", is_causal)
    check_bool(OP_NAME, "enable_gqa", enable_gqa)
    check_bool(OP_NAME, "return_lse", return_lse)
    if heads != kv_heads:
        if not enable_gqa:
            raise ValueError(
                f"{OP_NAME}: query and key must have the same number of heads unless "
                f"enable_gqa=True; got query {heads}, key {kv_heads}"
            )
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(
                f"{OP_NAME}: with enable_gqa the query's heads must be a multiple of the key's; "
                f"got query {heads}, key {kv_heads}"
            )
    if attn_mask is not None:
        if is_causal:
            raise ValueError(
                f"{OP_NAME}: attn_mask and is_causal=True cannot be combined (like SDPA); "
                "fold the causal condition into the mask instead"
            )
        _check_mask(attn_mask, query, (batch, heads, n, m))
    check_real(OP_NAME, "dropout_p", dropout_p, low=0.0)
    if dropout_p >= 1.0:
        # p = 1 would drop every probability and then divide by 1 - p = 0.
        raise ValueError(f"{OP_NAME}: dropout_p must be < 1; got {dropout_p!r}")
    check_real(OP_NAME, "scale", scale, allow_none=True)

    chosen = resolve(FAMILY, backend, query.device, OP_NAME)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return _IMPLEMENTATIONS[chosen](
        query, key, value, attn_mask, float(dropout_p), is_causal, float(scale), enable_gqa, return_lse
    )

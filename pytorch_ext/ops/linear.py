"""Linear (kernelized) attention: the public function.

For now every backend call goes to the pure-PyTorch reference (``reference/linear.py``);
kernel backends register themselves in ``_IMPLEMENTATIONS`` and with
``_dispatch.register_kernel("linear", ...)`` when they land.
"""
from __future__ import annotations

import torch

from .._dispatch import resolve
from .._validation import (
    check_bool,
    check_choice,
    check_real,
    check_same_dtype_device,
    check_size_match,
    check_tensor,
)
from ..reference.linear import FEATURE_MAPS, linear_attention_reference

FAMILY = "linear"
OP_NAME = "attnkit.linear_attention"

_IMPLEMENTATIONS = {"reference": linear_attention_reference}


def _validate(query, key, value, causal, feature_map, normalize, eps, scale) -> None:
    fn = OP_NAME
    check_tensor(fn, "query", query, "[B, H, N, D]")
    check_tensor(fn, "key", key, "[B, H, M, D]")
    check_tensor(fn, "value", value, "[B, H, M, Dv]")
    check_same_dtype_device(fn, {"query": query, "key": key, "value": value})
    check_size_match(fn, "batch size B", {"query": query.shape[0], "key": key.shape[0],
                                          "value": value.shape[0]})
    check_size_match(fn, "number of heads H", {"query": query.shape[1], "key": key.shape[1],
                                                "value": value.shape[1]})
    check_size_match(fn, "head dim D", {"query": query.shape[3], "key": key.shape[3]})
    check_size_match(fn, "sequence length M", {"key": key.shape[2], "value": value.shape[2]})
    check_bool(fn, "causal", causal)
    check_bool(fn, "normalize", normalize)
    if causal and key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{fn}: causal=True needs the key length M to equal the query length N "
            f"(self-attention); got N={query.shape[2]}, M={key.shape[2]}"
        )
    check_choice(fn, "feature_map", feature_map, FEATURE_MAPS)
    check_real(fn, "eps", eps, low=0.0)
    check_real(fn, "scale", scale)


def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    feature_map: str = "elu",
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Linear (kernelized) attention: softmax's exp(q·k) replaced by a feature-map dot product.

    With φ the feature map applied to each query and key row and S_i the keys query i sees
    (all of them, or j <= i when ``causal``)::

        out_i = Σ_{j∈S_i} (φ(q_i)·φ(k_j)) v_j / (Σ_{j∈S_i} φ(q_i)·φ(k_j) + eps)   if normalize
        out_i = scale · Σ_{j∈S_i} (φ(q_i)·φ(k_j)) v_j                              otherwise

    Args:
        query: ``[B, H, N, D]``.
        key: ``[B, H, M, D]``; with ``causal`` M must equal N.
        value: ``[B, H, M, Dv]``; Dv may differ from D.
        causal: query i sees keys j <= i only.
        feature_map: φ -- ``"elu"`` (elu(x) + 1, always positive; Katharopoulos et al. 2020),
            ``"relu"`` (max(x, 0)) or ``"identity"`` (x; with ``normalize=False`` and
            ``scale=1/N`` this is the linear self-attention of in-context-learning theory).
        normalize: divide by the sum of the weights (plus ``eps``).  With ``"identity"`` the
            weights can be negative and the sum can come close to zero: ill-conditioned.
        eps: >= 0, added to the normalizer.  eps = 0 is allowed; a query whose weights sum to
            exactly 0 then gives NaN (as the formula says).
        scale: finite; multiplies the output when ``normalize`` is False (ignored otherwise).
        backend: ``"reference" | "cpu" | "triton" | "cuda"`` or None (the device's default,
            or the environment variable ``ATTNKIT_BACKEND``).

    Returns:
        ``[B, H, N, Dv]`` in the inputs' dtype, on their device.  Float16, bfloat16, float32
        and float64 are accepted (all three tensors alike).  Empty N gives an empty result;
        M = 0 (no keys) gives zeros.  Differentiable with respect to all three tensors;
        non-contiguous inputs work.

    Example::

        >>> q, k, v = (torch.randn(2, 4, 128, 32) for _ in range(3))
        >>> out = attnkit.linear_attention(q, k, v, causal=True)    # [2, 4, 128, 32]
    """
    _validate(query, key, value, causal, feature_map, normalize, eps, scale)
    backend = resolve(FAMILY, backend, query.device, OP_NAME)
    impl = _IMPLEMENTATIONS[backend]
    return impl(query, key, value, causal=causal, feature_map=feature_map,
                normalize=normalize, eps=float(eps), scale=float(scale))

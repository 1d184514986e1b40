"""attnkit.sparse_attention: softmax attention restricted to a sparse pattern.

For now every backend request resolves to the pure-PyTorch reference (family "sparse" has no
kernels yet); the kernels will plug in behind the same public function.
"""
from __future__ import annotations

from .._dispatch import resolve
from .._validation import check_real, check_same_dtype_device, check_size_match, check_tensor
from ..patterns import BlockLayout, Pattern
from ..reference.sparse import sparse_attention_reference

OP = "attnkit.sparse_attention"
FAMILY = "sparse"


def _validate(query, key, value, pattern, scale) -> None:
    layout = "[B, H, N, D]"
    check_tensor(OP, "query", query, layout)
    check_tensor(OP, "key", key, layout)
    check_tensor(OP, "value", value, "[B, H, N, Dv]")
    check_same_dtype_device(OP, {"query": query, "key": key, "value": value})
    check_size_match(OP, "batch size", {"query": query.shape[0], "key": key.shape[0], "value": value.shape[0]})
    check_size_match(OP, "number of heads", {"query": query.shape[1], "key": key.shape[1], "value": value.shape[1]})
    check_size_match(OP, "head dim", {"query": query.shape[3], "key": key.shape[3]})
    check_size_match(OP, "sequence length", {"key": key.shape[2], "value": value.shape[2]})
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{OP}: sparse attention is self-attention: query and key must have the same sequence "
            f"length; got query {query.shape[2]}, key {key.shape[2]}"
        )
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"{OP}: pattern must be an attnkit.patterns pattern (strided, fixed, star, block_layout); "
            f"got {type(pattern).__name__}"
        )
    pattern.check(query.shape[2], OP)
    if isinstance(pattern, BlockLayout) and pattern.heads not in (1, query.shape[1]):
        raise ValueError(
            f"{OP}: the block layout has {pattern.heads} heads; it must have 1 or as many as the "
            f"query ({query.shape[1]})"
        )
    check_real(OP, "scale", scale, allow_none=True)


def sparse_attention(query, key, value, pattern, *, scale=None, backend=None):
    """Softmax self-attention where query i may only attend the keys ``pattern.mask(N)[i]``.

    Args:
        query: ``[B, H, N, D]`` float16 / bfloat16 / float32 / float64.
        key: ``[B, H, N, D]``, same dtype and device (self-attention: same length N).
        value: ``[B, H, N, Dv]`` (Dv may differ from D).
        pattern: an :mod:`attnkit.patterns` pattern — ``strided``, ``fixed``, ``star`` or
            ``block_layout`` (whose layout has 1 head or H heads; N must be nb * block).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        backend: ``"reference" | "cpu" | "triton" | "cuda"`` or None (device default, or the
            environment variable ``ATTNKIT_BACKEND``).  Until the sparse kernels land, only
            ``"reference"`` runs.

    Returns:
        ``[B, H, N, Dv]`` in the input dtype: ``out_i = Σ_{j: mask[i, j]} softmax_j(scale q_i·k_j) v_j``.
        A query whose row of the mask is empty (possible with block layouts) gets zeros.
        N = 0 gives an empty result.

    Example::

        >>> q = k = v = torch.randn(2, 4, 256, 64)
        >>> out = attnkit.sparse_attention(q, k, v, attnkit.patterns.strided(16))
        >>> out.shape
        torch.Size([2, 4, 256, 64])
    """
    _validate(query, key, value, pattern, scale)
    backend = resolve(FAMILY, backend, query.device, OP)
    if backend == "reference":
        return sparse_attention_reference(query, key, value, pattern, scale=scale)
    raise AssertionError(f"{OP}: resolve() returned {backend!r}, which has no implementation")  # pragma: no cover

"""attnkit as a Hugging Face transformers attention implementation.

Usage::

    import attnkit.integrations.transformers as attnkit_hf
    from transformers import AutoModelForCausalLM, LlamaConfig

    attnkit_hf.register()                                    # adds "attnkit" (once per process)
    model = AutoModelForCausalLM.from_config(LlamaConfig(...), attn_implementation="attnkit")
    other.set_attn_implementation("attnkit")                 # switch an existing model

After :func:`register`, every attention layer of a model whose ``config._attn_implementation``
is ``"attnkit"`` calls :func:`attention_forward`, i.e. :func:`attnkit.softmax_attention`:

- **GQA / MQA**: key and value keep their ``num_key_value_heads`` heads; the call passes
  ``enable_gqa=True`` (K / V are never repeated in memory).
- **Causal without a mask** where transformers allows it: the mask function is transformers'
  own ``sdpa_mask``, which returns ``None`` when the causal structure alone says everything
  (no padding; prefill or a query block as long as the keys), and the call then passes
  ``is_causal=True`` (top-left aligned, like SDPA).
- **Padding**: otherwise the mask is the boolean ``[B, 1, N, M]`` tensor of ``sdpa_mask``
  (True = attend), broadcast over heads without being expanded.  A query row with no visible
  key (left padding, a fully padded sequence) gives output 0 -- never NaN.
- **KV-cache decoding**: one query (or a few) against the cached keys ``M > N``; with one
  query and no mask every cached key is visible (``is_causal=False``, as SDPA's integration
  does).
- **Dropout in training**: the model's attention dropout (``dropout`` > 0 only in training
  mode) goes to ``softmax_attention(dropout_p=...)``.  On CPU tensors that call runs on the
  reference backend (the C++ kernel has no dropout); on CUDA the Triton kernel draws it.
- **Scale**: the model's ``scaling`` (``None``: ``1 / sqrt(head_dim)``).
- ``position_bias`` (T5-style additive biases) is folded into a floating mask, as SDPA's
  integration does.

- **Sliding window** (Mistral, Qwen2/3, Gemma 2/3, gpt-oss: the ``sliding_window`` kwarg, a
  layer's key i - sliding_window < j <= i) runs in the kernel as ``window=(sliding_window - 1,
  0)``: the registered mask function (:func:`attnkit_mask`) skips a sliding layer's mask in the
  cases where a full causal layer's is skipped (no padding; prefill or one query), so no dense
  N x M window mask is built there.  Where a mask is built anyway (padding, static caches) it
  already holds the window, and the kernel gets the mask alone (the window's bottom-right
  alignment would not fit a static cache's empty slots).
- **Logit soft-capping** (Gemma 2: the ``softcap`` kwarg) -> ``softcap=``.
- **Attention sinks** (gpt-oss: the ``s_aux`` kwarg, one learned logit per head) -> ``sinks=``
  (cast to float32; the gradient reaches the model's parameter).
- **Packed sequences** (padding-free training: documents packed into one row, with the
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` kwargs of transformers' flash-attention path) ->
  :func:`attnkit.softmax_attention_varlen`, no work across documents.  transformers still builds
  its block-diagonal mask from the position ids (its mask function cannot tell the packing
  apart from other patterns); attnkit does not read it.

- **Continuous batching** (``model.generate_batch`` / ``init_continuous_batching``: transformers
  switches a model to ``"paged|" + its implementation``): :func:`register` adds
  ``"paged|attnkit"`` too (:func:`paged_attention_forward`).  Each step is one packed batch of
  requests -- prefill chunks and single decoding tokens mixed -- whose keys transformers' paged
  cache gathers (``cache.update`` with its read / write indices); attnkit runs it as
  :func:`attnkit.softmax_attention_varlen` with the causality bottom-right per request (the new
  tokens are the last of each request's keys: ``window=(-1, 0)``, or ``(sliding_window - 1, 0)``
  on a sliding layer), softcap and sinks as above.  transformers builds no mask for it (it
  builds masks only for ``paged|eager`` / ``paged|sdpa``).

Not supported: attention weights are never returned (``output_attentions=True`` gives ``None``
weights, with a warning, like SDPA).  Bidirectional sliding windows (encoders) keep
transformers' dense mask.

Tested with transformers 5.17.0 (:data:`TESTED_TRANSFORMERS_VERSIONS`; CI pins it in
``requirements.txt``, and the GPU image ships it): Llama (GQA), GPT-2 and BERT built from small
configs, against ``attn_implementation="sdpa"``.  The extra asks for ``transformers>=5.17``.
On 4.57.6 (the last 4.x) the same suite partly fails: ``set_attn_implementation`` leaves
BERT's config on "sdpa", and 4.x's SDPA integration ignores ``position_bias``; older versions
without ``AttentionMaskInterface`` make :func:`register` raise its ImportError.

transformers is an optional dependency (the pip extra ``attnkit[transformers]``): this module
imports without it; :func:`register` raises ImportError naming the extra.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..ops.softmax import softmax_attention

__all__ = [
    "NAME",
    "EXTRA",
    "TESTED_TRANSFORMERS_VERSIONS",
    "register",
    "is_registered",
    "attention_forward",
    "attnkit_mask",
    "make_attention_forward",
    "paged_attention_forward",
    "make_paged_attention_forward",
]

NAME = "attnkit"
"""The default ``attn_implementation`` name that :func:`register` adds."""

EXTRA = "transformers"
"""The pip extra that installs transformers: ``pip install "attnkit[transformers]"``."""

TESTED_TRANSFORMERS_VERSIONS = ("5.17.0",)
"""transformers versions the test suite (tests/integrations/test_transformers.py) ran on."""

_log = logging.getLogger(__name__)
_warned: list = []  # the output_attentions warning is given once per process


def _missing_transformers(exc: Exception) -> ImportError:
    return ImportError(
        "attnkit.integrations.transformers.register() needs Hugging Face transformers "
        f"(>= 5.17; tested: {', '.join(TESTED_TRANSFORMERS_VERSIONS)}), which could not be imported "
        f"({type(exc).__name__}: {exc}). Install the optional extra: "
        f'pip install "attnkit[{EXTRA}]"  (or: pip install transformers=={TESTED_TRANSFORMERS_VERSIONS[0]})'
    )


def _position_bias_mask(position_bias, attention_mask, is_causal, n, m, dtype):
    """A floating ``[.., N, M]`` mask: ``position_bias`` where attending, ``finfo.min`` elsewhere
    (the rule of transformers' SDPA integration)."""
    min_value = torch.finfo(dtype).min
    if attention_mask is None:
        if not is_causal:
            return position_bias
        causal = torch.ones(n, m, dtype=torch.bool, device=position_bias.device).tril()
        return torch.where(causal, position_bias, min_value)
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, position_bias, min_value)
    return position_bias + attention_mask


def _packed_forward(query, key, value, dropout, scaling, is_causal, options, kwargs, backend):
    """Padding-free training: one row of documents packed end to end, with transformers'
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` (what its
    flash-attention path reads; DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes
    them).  Runs :func:`attnkit.softmax_attention_varlen`: no work across documents, and the
    block-diagonal mask transformers built from the position ids is not read."""
    from ..ops.varlen import softmax_attention_varlen

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [total, H, D]
    if kwargs.get("sliding_window") is not None and is_causal:
        options["window"] = (int(kwargs["sliding_window"]) - 1, 0)  # within each document
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"])
    max_q = int(kwargs.get("max_length_q") or int((cu_q[1:] - cu_q[:-1]).max()))
    max_k = int(kwargs.get("max_length_k") or int((cu_k[1:] - cu_k[:-1]).max()))
    out = softmax_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=float(dropout),
                                   is_causal=is_causal, scale=scaling, enable_gqa=q.shape[1] != k.shape[1],
                                   backend=backend, **options)
    return out.unsqueeze(0).contiguous(), None  # [1, total, H, Dv]


def make_attention_forward(backend: Optional[str] = None) -> Callable:
    """An attention function for transformers' ``AttentionInterface`` on
    :func:`attnkit.softmax_attention` with ``backend`` (None: attnkit's default dispatch, or
    the ``ATTNKIT_BACKEND`` environment variable).  :func:`attention_forward` is the one with
    ``backend=None``; :func:`register` uses this to register another backend under another name.
    """

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        dropout: float = 0.0,
        scaling: Optional[float] = None,
        is_causal: Optional[bool] = None,
        position_bias: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention signature (see :func:`attention_forward`)."""
        options = _score_kwargs(kwargs)
        if kwargs.get("output_attentions", False) and not _warned:
            _warned.append(True)
            _log.warning("attn_implementation='attnkit' does not return attention weights "
                         "(output_attentions=True gives None); use 'eager' for them.")
        n, m = query.shape[2], key.shape[2]
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        if kwargs.get("cu_seq_lens_q") is not None and query.shape[0] == 1:
            return _packed_forward(query, key, value, dropout, scaling, bool(is_causal), options, kwargs,
                                   backend)
        sliding_window = kwargs.get("sliding_window")
        if sliding_window is not None and attention_mask is None and is_causal and position_bias is None:
            # A causal sliding layer whose mask attnkit_mask skipped: the keys end at the last
            # query (prefill or decoding), so the bottom-right window is transformers' window.
            options["window"] = (int(sliding_window) - 1, 0)
        # transformers' mask function returns None exactly when is_causal may stand in for the
        # causal mask; one query with no mask sees every cached key (bottom-right alignment:
        # is_causal=False), as in transformers' SDPA integration.
        is_causal = bool(is_causal) and attention_mask is None and n > 1
        if is_causal and m > n:
            # Prefill into an empty static cache: the keys past N are empty slots; top-left
            # causal never reads them, so they are cut off (as SDPA's integration does).
            key, value = key[:, :, :n], value[:, :, :n]
            if position_bias is not None:
                position_bias = position_bias[..., :n]
            m = n
        if attention_mask is not None and attention_mask.shape[-1] > m:
            attention_mask = attention_mask[..., :m]
        if position_bias is not None:
            attention_mask = _position_bias_mask(position_bias, attention_mask, is_causal, n, m, query.dtype)
            is_causal = False
        out = softmax_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=float(dropout),
            is_causal=is_causal,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
            backend=backend,
            **options,
        )
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = forward.__qualname__ = (
        "attention_forward" if backend is None else f"attention_forward_{backend}"
    )
    return forward


attention_forward = make_attention_forward(None)
attention_forward.__doc__ = """transformers' attention function for ``attn_implementation="attnkit"``.

Args:
    module: the calling attention layer (read: ``is_causal`` when the call does not say).
    query: ``[B, H, N, D]``.
    key: ``[B, Hk, M, D]`` (Hk divides H: GQA without repeating K / V).
    value: ``[B, Hk, M, Dv]``.
    attention_mask: None, or ``[B or 1, 1 or H, N, >= M]``: bool (True = attend, from the
        registered mask function ``sdpa_mask``) or floating (added to the scores).
    dropout: attention-probability dropout (the models pass 0 outside training).
    scaling: the score scale (None: ``1 / sqrt(D)``).
    is_causal: overrides ``module.is_causal``; only used when there is no mask and N > 1.
    position_bias: optional additive bias broadcastable to ``[B, H, N, M]`` (T5-style).
    **kwargs: the rest of the model's attention kwargs: ``sliding_window`` (int: a causal
        window of that many keys, applied in the kernel when there is no mask), ``softcap``
        (float), ``s_aux`` (sinks ``[H]``); everything else is ignored.

Returns:
    ``(out, None)``: ``out`` ``[B, N, H, Dv]`` contiguous, in the inputs' dtype; no attention
    weights.
"""


def _score_kwargs(kwargs) -> dict:
    """softcap / sinks from transformers' attention kwargs, as attnkit's score options."""
    options = {}
    if kwargs.get("softcap") is not None:
        options["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        options["sinks"] = kwargs["s_aux"].float()
    return options


def make_paged_attention_forward(backend: Optional[str] = None) -> Callable:
    """The ``"paged|<name>"`` function for continuous batching on attnkit ``backend`` (see
    :func:`paged_attention_forward`)."""

    def forward(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, *, cache=None,
                cu_seq_lens_q=None, cu_seq_lens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kwargs):
        """transformers' paged attention signature (see :func:`paged_attention_forward`)."""
        from ..ops.varlen import softmax_attention_varlen

        if cache is None or cu_seq_lens_q is None or cu_seq_lens_k is None:
            raise ValueError("attnkit's paged attention (attn_implementation 'paged|attnkit') needs the paged cache "
                             "and the cu_seq_lens_q / cu_seq_lens_k of transformers' continuous batching; got "
                             f"cache={type(cache).__name__}, cu_seq_lens_q={type(cu_seq_lens_q).__name__}, "
                             f"cu_seq_lens_k={type(cu_seq_lens_k).__name__}.  Use 'attnkit' for a standard forward.")
        # Mistral-style layers pass their window as a kwarg, Gemma / gpt-oss-style ones hold it.
        sliding_window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        if isinstance(cu_seq_lens_k, dict):  # per layer type when the model mixes full and sliding layers
            layer_type = "sliding_attention" if sliding_window else "full_attention"
            cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
        # The new tokens into the cache, and every request's keys back out of it: [total_k, Hk, D].
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        options = _score_kwargs(kwargs)
        # A request's new tokens are the last of its keys: causal bottom-right, the window's right
        # bound 0 (with a sliding layer's left bound).
        options["window"] = (int(sliding_window) - 1 if sliding_window else -1, 0)
        q = query[0].transpose(0, 1)  # [total_q, H, D]
        cu_q, cu_k = cu_seq_lens_q.to(torch.int64), cu_seq_lens_k.to(torch.int64)
        max_q = int(max_seqlen_q) if max_seqlen_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_seqlen_k) if max_seqlen_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        out = softmax_attention_varlen(q, key, value, cu_q, cu_k, max_q, max_k, dropout_p=float(dropout),
                                       is_causal=False, scale=scaling, enable_gqa=q.shape[1] != key.shape[1],
                                       backend=backend, **options)
        return out.unsqueeze(0), None  # [1, total_q, H, Dv]

    forward.__name__ = forward.__qualname__ = (
        "paged_attention_forward" if backend is None else f"paged_attention_forward_{backend}"
    )
    return forward


paged_attention_forward = make_paged_attention_forward(None)
paged_attention_forward.__doc__ = """transformers' paged attention function for continuous batching,
``attn_implementation="paged|attnkit"`` (:func:`register` adds it).

Args:
    module: the calling attention layer (read: ``layer_idx``, and ``sliding_window`` unless the
        call passes it).
    query: ``[1, H, total_q, D]``: the step's new tokens of every request, packed.
    key, value: ``[1, Hk, total_q, D / Dv]``: their keys and values, written into ``cache``.
    attention_mask: ignored (transformers builds none for this implementation).
    dropout, scaling: as in :func:`attention_forward`.
    cache: transformers' ``PagedAttentionCache``; ``cache.update(..., read_index=,
        write_index=)`` writes the new rows and returns every request's keys / values
        ``[total_k, Hk, D]`` packed.
    cu_seq_lens_q, cu_seq_lens_k: ``[requests + 1]`` cumulative query / key counts (the key
        ones a dict per layer type when the model mixes full and sliding layers), with
        ``max_seqlen_q`` / ``max_seqlen_k``.
    **kwargs: ``read_index`` / ``write_index`` (required), ``sliding_window``, ``softcap``,
        ``s_aux`` (sinks); the rest is ignored.

Returns:
    ``(out, None)``: ``out`` ``[1, total_q, H, Dv]``: request r's query t attends to its keys
    ``<= m_r - n_r + t`` (bottom-right), within ``sliding_window`` on a sliding layer.

Raises:
    ValueError: no paged cache or no ``cu_seq_lens`` (a standard forward: use ``"attnkit"``).
"""


def attnkit_mask(*args, local_size=None, config=None, **kwargs):
    """The mask function registered with attnkit: transformers' ``sdpa_mask``, except that a
    *sliding-window* layer's mask is skipped (None) exactly where a full causal layer's is (no
    padding; prefill, or one query against the cache) -- attnkit applies that window in the
    kernel (:func:`attention_forward` reads the layer's ``sliding_window``) instead of reading
    a dense N x M window mask.  Other local patterns (chunked attention: ``local_size`` is the
    config's ``attention_chunk_size``) keep sdpa_mask's rule.  Wherever a mask is built it is
    sdpa_mask's own (the window included)."""
    from transformers.masking_utils import sdpa_mask

    sliding = getattr(config, "sliding_window", None) if config is not None else None
    chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
    if local_size is not None and local_size == sliding and local_size != chunk:
        local_size = None  # the window is attnkit's: skip the mask as for a full causal layer
    return sdpa_mask(*args, local_size=local_size, config=config, **kwargs)


def _interfaces():
    try:
        import transformers  # noqa: F401
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise _missing_transformers(exc) from exc
    return AttentionInterface, AttentionMaskInterface, sdpa_mask


def register(name: str = NAME, *, backend: Optional[str] = None) -> str:
    """Add attnkit to transformers as the attention implementation ``name``.

    Registers :func:`attention_forward` (or, with ``backend``, one bound to that attnkit
    backend) in ``transformers.AttentionInterface`` and :func:`attnkit_mask` (transformers'
    ``sdpa_mask``: boolean masks, ``None`` where ``is_causal`` -- and, for sliding layers, the
    kernel's window -- suffices) in ``transformers.masking_utils.AttentionMaskInterface`` under
    ``name``, for every model in this process; and :func:`paged_attention_forward` (bound the
    same way) under ``"paged|" + name``, the implementation transformers' continuous batching
    switches such a model to.  Calling it again is harmless (the entries are replaced).

    Args:
        name: the ``attn_implementation`` string (default ``"attnkit"``).
        backend: an attnkit backend for every call (``"cpu"``, ``"triton"``, ``"cuda"``,
            ``"reference"``), or None for attnkit's default dispatch.

    Returns:
        ``name``, to pass as ``attn_implementation``.

    Raises:
        ImportError: transformers is not installed (or too old); the message names the extra
            ``pip install "attnkit[transformers]"``.

    Example::

        >>> import attnkit.integrations.transformers as attnkit_hf
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> attnkit_hf.register()
        'attnkit'
        >>> cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnkit")
    """
    if not isinstance(name, str) or not name or name == "eager" or "|" in name:
        raise ValueError(f"register: name must be a non-empty string other than 'eager', without '|'; got {name!r}")
    attention_interface, mask_interface, sdpa_mask = _interfaces()
    fn = attention_forward if backend is None else make_attention_forward(backend)
    attention_interface.register(name, fn)
    mask_interface.register(name, attnkit_mask)
    paged = paged_attention_forward if backend is None else make_paged_attention_forward(backend)
    attention_interface.register(f"paged|{name}", paged)
    return name


def is_registered(name: str = NAME) -> bool:
    """Whether ``name`` is in transformers' attention interface (False without transformers)."""
    try:
        attention_interface, _, _ = _interfaces()
    except ImportError:
        return False
    return name in attention_interface._global_mapping

"""Continuous batching through the transformers backend (issue 28): ``"paged|attnkit"``, which
:func:`register` adds and transformers' ``generate_batch`` switches an attnkit model to.

Tiny randomly initialised models (Llama with GQA; Mistral-style sliding window on every layer,
passed as a kwarg; Gemma 2's soft-capping with alternating sliding / full layers, whose key
offsets come per layer type; gpt-oss's sinks), four prompts scheduled together in a few paged
blocks, prompts longer than a step's token budget (chunked prefill) and longer than the window:

- every call's output against the float64 reference computed here, request by request, with the
  options the layer should have (not the ones the function passed): causal bottom-right, the
  window of a sliding layer, the softcap, the sinks;
- the generated tokens against greedy ``generate`` of each prompt alone with ``eager``.

transformers sizes the paged cache from the accelerator's free memory and finds none on a CPU
(``PagedAttentionMemoryHandler.get_available_memory`` returns 0 there), so the tests give it
1 GiB; the cache itself is a handful of 8-token blocks.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
cb_cache = pytest.importorskip("transformers.generation.continuous_batching.cache")

from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LlamaConfig  # noqa: E402

import attnkit.integrations.transformers as attnkit_hf  # noqa: E402
from attnkit.ops import varlen as varlen_op  # noqa: E402
from attnkit.reference.softmax import softmax_attention_reference  # noqa: E402
from test_transformers_features import VOCAB, WINDOW, _config, one_thread  # noqa: E402,F401 (an autouse fixture)

F64 = torch.float64
PROMPTS = (5, 19, 3, 11)  # 19 > the step budget of 12 tokens: its prefill comes in chunks
NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    assert attnkit_hf.register() == "attnkit"
    monkeypatch.setattr(cb_cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)
    yield
    attnkit_hf.register()  # the real functions back, in place of a test's spy


def _model(family):
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, initializer_range=0.2, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
    else:
        cfg = _config(family)
    eager = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    if family == "gptoss":  # the sinks start at 0 in a fresh model: give them weight
        for layer in eager.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("attnkit")  # generate_batch switches it to "paged|attnkit"
    return eager, ours


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPTS]


def _expected_options(family, config, module):
    """(window, softcap, sinks) the layer's attention must have, from the model's config."""
    types = getattr(config, "layer_types", None)
    sliding = family != "llama" and (types is None or types[module.layer_idx] == "sliding_attention")
    window = (WINDOW - 1, 0) if sliding else (-1, 0)
    softcap = config.attn_logit_softcapping if family == "gemma2" else 0.0
    sinks = module.sinks.detach() if family == "gptoss" else None
    return window, softcap, sinks


def _reference(q, k, v, cu_q, cu_k, scale, window, softcap, sinks):
    """out [total_q, H, Dv] in float64, each request alone: query t of n sees its keys
    ``<= m - n + t`` and (a window) ``>= m - n + t - left``."""
    outs = []
    for r in range(len(cu_q) - 1):
        rows_q, rows_k = slice(cu_q[r], cu_q[r + 1]), slice(cu_k[r], cu_k[r + 1])
        qr, kr, vr = (x[rows].transpose(0, 1)[None].to(F64) for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k)))
        n, m = qr.shape[2], kr.shape[2]
        pos = m - n + torch.arange(n)[:, None]
        j = torch.arange(m)[None, :]
        mask = j <= pos
        if window[0] >= 0:
            mask &= j >= pos - window[0]
        out = softmax_attention_reference(qr, kr, vr, mask, scale=scale, enable_gqa=True, softcap=softcap,
                                          sinks=None if sinks is None else sinks.to(F64))
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gptoss"])
def test_generate_batch_matches_eager_and_every_call_the_reference(family, monkeypatch):
    eager, ours = _model(family)
    calls, modules = [], []
    real_varlen, real_paged = varlen_op.softmax_attention_varlen, attnkit_hf.paged_attention_forward

    def spy_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        out = real_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
        calls.append(dict(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(), cu_q=cu_q.tolist(),
                          cu_k=cu_k.tolist(), kw=kw, out=out.detach().clone()))
        return out

    def spy_paged(module, *args, **kwargs):
        modules.append(module)
        return real_paged(module, *args, **kwargs)

    monkeypatch.setattr(varlen_op, "softmax_attention_varlen", spy_varlen)
    transformers.AttentionInterface.register("paged|attnkit", spy_paged)

    prompts = _prompts()
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=12, block_size=8)
    with torch.no_grad():
        result = ours.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=batching)
        got = [result[key].generated_tokens for key in sorted(result)]
        want = []
        for p in prompts:
            out = eager.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    assert got == want

    assert calls and len(calls) == len(modules)
    assert any(c["cu_q"][-1] > len(c["cu_q"]) - 1 for c in calls)  # prefill chunks (n > 1) ...
    assert any(max(b - a for a, b in zip(c["cu_q"], c["cu_q"][1:])) == 1 for c in calls)  # ... and decoding
    if family != "llama":  # a request's keys reach past the window
        assert any(max(b - a for a, b in zip(c["cu_k"], c["cu_k"][1:])) > WINDOW for c in calls)
    for c, module in zip(calls, modules):
        window, softcap, sinks = _expected_options(family, ours.config, module)
        want = _reference(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["kw"]["scale"], window, softcap, sinks)
        err = float((c["out"].to(F64) - want).abs().max())
        assert err <= 2e-5 * float(want.abs().max()), (module.layer_idx, err)


def test_registers_the_paged_name_and_needs_the_paged_cache():
    assert attnkit_hf.is_registered("paged|attnkit")
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"needs the paged cache .* got cache=NoneType"):
        attnkit_hf.paged_attention_forward(module, q, q, q, None)

"""The score options through the transformers backend (issue 28): sliding window (Mistral-style,
every layer; Gemma 2: alternating with full layers, plus logit soft-capping), attention sinks
(gpt-oss: s_aux, plus sliding windows), against transformers' eager implementation on tiny
randomly initialised models: logits, every parameter's gradient, greedy generation with a cache,
and what reaches attnkit (the window in the kernel, no dense mask)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, MistralConfig  # noqa: E402

import attnkit.integrations.transformers as attnkit_hf  # noqa: E402

VOCAB, WINDOW = 97, 5


def _config(family):
    common = dict(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=WINDOW,
                  attention_dropout=0.0)
    if family == "mistral":
        return MistralConfig(**common)
    if family == "gemma2":
        return Gemma2Config(**common, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                            query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    return GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1,
                        layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: see test_transformers.py
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnkit_hf.register() == "attnkit"


@pytest.fixture(scope="module")
def models():
    twins = {}
    for family in ("mistral", "gemma2", "gptoss"):
        torch.manual_seed(0)
        eager = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager").eval()
        if family == "gptoss":  # the sinks start at 0 in a fresh model: give them weight
            for layer in eager.model.layers:
                torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
        ours = copy.deepcopy(eager)
        ours.set_attn_implementation("attnkit")
        twins[family] = (eager, ours)
    return twins


class Recorder:
    def __init__(self, monkeypatch):
        self.calls = []
        real = attnkit_hf.softmax_attention

        def spy(q, k, v, **kw):
            self.calls.append(dict(n=q.shape[2], m=k.shape[2], mask=kw["attn_mask"] is not None,
                                   window=kw.get("window"), softcap=kw.get("softcap"),
                                   sinks=kw.get("sinks") is not None, is_causal=kw["is_causal"]))
            return real(q, k, v, **kw)

        monkeypatch.setattr(attnkit_hf, "softmax_attention", spy)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gptoss"])
def test_logits_and_every_gradient_match_eager(family, models, monkeypatch):
    eager, ours = (copy.deepcopy(m) for m in models[family])
    rec = Recorder(monkeypatch)
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    out_e, out_a = eager(ids, labels=ids), ours(ids, labels=ids)
    assert _rel(out_a.logits.detach(), out_e.logits.detach()) <= 1e-5
    out_e.loss.backward()
    out_a.loss.backward()
    grads_e = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    grads_a = dict((n, p.grad) for n, p in ours.named_parameters())
    largest = max(float(g.abs().max()) for g in grads_e.values())
    for name, g in grads_e.items():
        err = float((grads_a[name] - g).abs().max())
        assert err <= 1e-4 * largest, f"{name}: gradient differs by {err:.3g} (largest {largest:.3g})"
    if family == "gptoss":  # the sinks' own gradient is among them, and not zero
        assert all(float(grads_e[f"model.layers.{i}.self_attn.sinks"].abs().max()) > 0 for i in range(2))
    # What reached attnkit: no dense mask; sliding layers carry the window (every Mistral layer,
    # Gemma 2's / gpt-oss's first), soft-capping and sinks where the model has them.
    sliding = [True, True] if family == "mistral" else [True, False]
    assert [c["window"] for c in rec.calls] == [(WINDOW - 1, 0) if s else None for s in sliding]
    assert all(not c["mask"] and c["is_causal"] for c in rec.calls)
    assert all(c["softcap"] == (2.0 if family == "gemma2" else None) for c in rec.calls)
    assert all(c["sinks"] is (family == "gptoss") for c in rec.calls)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gptoss"])
def test_greedy_generation_with_a_cache_matches_eager(family, models, monkeypatch):
    eager, ours = models[family]
    prompt = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        expected = eager.generate(prompt, **kw)
        rec = Recorder(monkeypatch)
        got = ours.generate(prompt, **kw)
    assert torch.equal(got, expected)
    # The prefill (7 > WINDOW keys) runs the window in the kernel, the decoding steps too (one
    # query against the sliding cache, which transformers trims to the window); no mask anywhere.
    windowed = [c for c in rec.calls if c["window"] is not None]
    assert any(c["n"] == 7 and c["m"] == 7 for c in windowed) and any(c["n"] == 1 for c in windowed)
    assert not any(c["mask"] for c in rec.calls)


def test_left_padded_batch_keeps_transformers_mask(models):
    # With padding the mask is built (the window included) and the kernel gets it alone.
    eager, ours = models["mistral"]
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        out_e = eager(ids, attention_mask=mask).logits
        out_a = ours(ids, attention_mask=mask).logits
    assert _rel(out_a[0], out_e[0]) <= 1e-5 and _rel(out_a[1, 4:], out_e[1, 4:]) <= 1e-5


def test_attention_function_takes_softcap_sinks_and_window():
    # The function alone, against the eager formulas written out here.
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=torch.float64)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = attnkit_hf.attention_forward(module, q, k, v, None, scaling=0.5, softcap=3.0, s_aux=sinks,
                                          sliding_window=4)
    s = 3.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.5 / 3.0)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    s = s.masked_fill(~((j <= i) & (j > i - 4)), float("-inf"))
    s = torch.cat([s, sinks.view(1, 2, 1, 1).expand(1, 2, 9, 1)], dim=-1)
    want = torch.softmax(s, dim=-1)[..., :-1] @ v
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_packed_documents_match_each_document_alone(monkeypatch):
    # Llama (GQA) on three documents packed into one row, with the flash-attention kwargs:
    # logits and every gradient equal those of each document run alone (eager).
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, initializer_range=0.2, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("attnkit")
    lengths = [5, 1, 9]
    docs = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    packed = dict(position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    seen = []
    real = attnkit_hf._packed_forward
    monkeypatch.setattr(attnkit_hf, "_packed_forward", lambda *a: seen.append(1) or real(*a))
    out = ours(ids, **packed).logits
    assert len(seen) == 2  # both layers took the varlen path
    # The yardstick: eager on each document alone (its packed run does not separate them).
    alone = torch.cat([eager(d).logits for d in docs], dim=1)
    assert _rel(out.detach(), alone.detach()) <= 1e-5
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * w).sum().backward()
    (alone * w).sum().backward()
    grads_a = dict(ours.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in eager.parameters())
    for name, p in eager.named_parameters():
        assert float((grads_a[name].grad - p.grad).abs().max()) <= 1e-4 * largest, name


def test_packed_documents_under_torch_compile_fullgraph():
    # The packed path (softmax_attention_varlen) traces whole under torch.compile(fullgraph=True)
    # (pytorch_ext/ops/compiled.py; before, dynamo stopped at the offsets' host read): the
    # compiled Llama's logits and gradients against the same model run eagerly.
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=VOCAB, initializer_range=0.2, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnkit").eval()
    lengths = [5, 1, 9]
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)

    def logits(ids, pos, cu):
        return ours(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9,
                    max_length_k=9).logits

    torch._dynamo.reset()
    w = torch.randn(1, sum(lengths), VOCAB, generator=torch.Generator().manual_seed(4))
    results = []
    for f in (torch.compile(logits, fullgraph=True), logits):
        ours.zero_grad()
        out = f(ids, pos, cu)
        (out * w).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}))
    torch._dynamo.reset()
    (out_c, grads_c), (out_e, grads_e) = results
    # Inductor fuses the model's other ops (norms, rotary) in another order: float32 rounding.
    assert _rel(out_c, out_e) <= 1e-5
    largest = max(float(g.abs().max()) for g in grads_e.values())
    for name, g in grads_e.items():
        assert float((grads_c[name] - g).abs().max()) <= 1e-4 * largest, name

"""attnkit as a Hugging Face transformers attention implementation (attnkit.integrations.transformers).

Every model is built from a small config (no download): Llama with GQA (4 query heads, 2 KV
heads), GPT-2 and BERT.  The twin of each model runs attn_implementation="sdpa" with the same
weights; its outputs are the yardstick.  initializer_range=0.2 (not the default 0.02) so that
attention is far from uniform and a wrong mask, scale or GQA mapping changes the logits.
"""
import copy
import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
)

import attnkit.integrations.transformers as attnkit_hf  # noqa: E402

VOCAB = 97
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, **common)
    elif family == "gpt2":
        cfg = GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, **common)
    else:
        cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                         max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         **common)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _auto(family):
    return AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread.  With two, every small op pays OpenMP's
    hand-off, and on a loaded 2-core machine the spin-waiting threads made this file over 10x
    slower (measured: 408 s against 26 s for both model test files).  Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnkit_hf.register() == "attnkit"


def _twins(family, seed=0, **overrides):
    """(sdpa model, attnkit model) with the same weights; the attnkit one is switched with
    set_attn_implementation (from_config(attn_implementation="attnkit") is tested below)."""
    torch.manual_seed(seed)
    sdpa = _auto(family).from_config(_config(family, **overrides), attn_implementation="sdpa").eval()
    ours = copy.deepcopy(sdpa)
    ours.set_attn_implementation("attnkit")
    assert ours.config._attn_implementation == "attnkit"
    assert sdpa.config._attn_implementation == "sdpa"
    return sdpa, ours


@pytest.fixture(scope="module")
def models():
    return {family: _twins(family) for family in ("llama", "gpt2", "bert")}


class Recorder:
    """Wraps attnkit.softmax_attention as the integration calls it; records each call."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = attnkit_hf.softmax_attention

        def spy(q, k, v, **kw):
            mask = kw["attn_mask"]
            self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape),
                                   mask=None if mask is None else (tuple(mask.shape), mask.dtype),
                                   is_causal=kw["is_causal"], enable_gqa=kw["enable_gqa"],
                                   dropout_p=kw["dropout_p"], scale=kw["scale"]))
            return real(q, k, v, **kw)

        monkeypatch.setattr(attnkit_hf, "softmax_attention", spy)


def _max_rel(a, b):
    return float((a - b).abs().max() / b.abs().max())  # callers pass detached or no-grad tensors


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------


def test_register_adds_attention_and_mask_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert AttentionInterface._global_mapping["attnkit"] is attnkit_hf.attention_forward
    assert AttentionMaskInterface._global_mapping["attnkit"] is attnkit_hf.attnkit_mask
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function

    # A sliding layer without padding: sdpa_mask builds the window, attnkit_mask leaves it to
    # the kernel; a chunked layer (local_size = the chunk) and padding keep sdpa_mask's mask.
    window = dict(batch_size=1, q_length=8, kv_length=8, local_size=3,
                  mask_function=sliding_window_causal_mask_function(3))
    assert sdpa_mask(**window) is not None
    assert attnkit_hf.attnkit_mask(**window, config=SimpleNamespace(sliding_window=3)) is None
    chunked = SimpleNamespace(sliding_window=3, attention_chunk_size=3)
    assert torch.equal(attnkit_hf.attnkit_mask(**window, config=chunked), sdpa_mask(**window))
    padded = dict(window, attention_mask=torch.tensor([[False] + [True] * 7]))
    assert torch.equal(attnkit_hf.attnkit_mask(**padded, config=SimpleNamespace(sliding_window=3)),
                       sdpa_mask(**padded))
    assert attnkit_hf.is_registered()


def test_pinned_transformers_version_is_a_tested_one():
    # CI installs requirements.txt: the version pinned there is the one these tests ran on.
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = re.findall(r"^transformers==(\S+)", f.read(), flags=re.M)
    assert len(pins) == 1 and pins[0] in attnkit_hf.TESTED_TRANSFORMERS_VERSIONS


def test_from_config_runs_every_layer_on_attnkit(monkeypatch):
    rec = Recorder(monkeypatch)
    cfg = _config("llama")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnkit")
    assert model.config._attn_implementation == "attnkit"
    model(torch.randint(3, VOCAB, (2, 9)))
    assert len(rec.calls) == cfg.num_hidden_layers


def test_register_under_another_name_with_a_backend(monkeypatch):
    rec = Recorder(monkeypatch)
    assert attnkit_hf.register("attnkit-reference", backend="reference") == "attnkit-reference"
    sdpa, _ = _twins("gpt2")
    ref = copy.deepcopy(sdpa)
    ref.set_attn_implementation("attnkit-reference")
    ids = torch.randint(3, VOCAB, (2, 11))
    with torch.no_grad():
        assert _max_rel(ref(ids).logits, sdpa(ids).logits) <= 1e-5
    assert len(rec.calls) == 2
    with pytest.raises(ValueError, match="name"):
        attnkit_hf.register("paged|attnkit")


def test_package_imports_and_register_names_the_extra_without_transformers():
    # A fresh interpreter in which `import transformers` fails.
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import attnkit, attnkit.integrations.transformers as t\n"
        "assert not t.is_registered()\n"
        "try:\n    t.register()\nexcept ImportError as e:\n    print('ERROR:', e)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert 'pip install "attnkit[transformers]"' in out.stdout


# ----------------------------------------------------------------------------------------------
# the attention function against transformers' own SDPA function, case by case
# ----------------------------------------------------------------------------------------------


def _case(name, g):
    b, h, hk, n, m, d = 2, 4, 2, 5, 5, 8
    kw, mask = {}, None
    if name == "decode":            # one query against a longer cache: all keys visible
        n, m = 1, 9
    elif name == "static_prefill":  # causal prefill into a longer (empty) static cache
        m = 9
    elif name == "bool_mask":
        m = 7
        mask = torch.rand(b, 1, n, m, generator=g) > 0.3
        mask[1, 0, 2] = False       # a fully masked row
    elif name == "float_mask":
        m = 7
        mask = torch.randn(b, 1, n, m, generator=g)
    elif name == "position_bias":
        kw["position_bias"] = torch.randn(1, h, n, m, generator=g)
    elif name == "not_causal":
        kw["is_causal"] = False
    q = torch.randn(b, h, n, d, generator=g)
    k = torch.randn(b, hk, m, d, generator=g)
    v = torch.randn(b, hk, m, d, generator=g)
    return q, k, v, mask, kw


@pytest.mark.parametrize(
    "name", ["causal", "not_causal", "decode", "static_prefill", "bool_mask", "float_mask", "position_bias"]
)
def test_attention_function_matches_transformers_sdpa(name):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, mask, kw = _case(name, torch.Generator().manual_seed(7))
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    ours, weights = attnkit_hf.attention_forward(module, q, k, v, mask, scaling=0.3, **kw)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, **kw)
    assert weights is None
    assert ours.shape == theirs.shape == (q.shape[0], q.shape[2], q.shape[1], v.shape[-1])
    if name == "bool_mask":  # SDPA and attnkit agree everywhere but on the fully masked row ...
        assert torch.equal(ours[1, 2], torch.zeros_like(ours[1, 2]))  # ... where attnkit gives 0
        ours, theirs = ours[0], theirs[0]
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# whole models: float32 logits and gradients, bfloat16, what reaches the kernel
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_float32_logits_and_every_gradient_match_sdpa(family, models, monkeypatch):
    sdpa, _ = models[family]
    sdpa, ours = copy.deepcopy(sdpa), copy.deepcopy(models[family][1])
    rec = Recorder(monkeypatch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 19), generator=g)
    labels = ids.clone()
    out_s, out_a = sdpa(ids, labels=labels), ours(ids, labels=labels)
    assert _max_rel(out_a.logits.detach(), out_s.logits.detach()) <= 1e-5
    out_s.loss.backward()
    out_a.loss.backward()
    params_s, params_a = dict(sdpa.named_parameters()), dict(ours.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in params_s.values() if p.grad is not None)
    assert largest > 0
    for name, p in params_s.items():
        if p.grad is None:  # e.g. BERT's pooler: not on the masked-LM loss's path
            assert params_a[name].grad is None, name
            continue
        err = float((params_a[name].grad - p.grad).abs().max())
        assert err <= 1e-4 * largest, f"{name}: gradient differs by {err:.3g} (largest gradient {largest:.3g})"
    n_layers = sdpa.config.num_hidden_layers
    assert len(rec.calls) == n_layers
    for call in rec.calls:
        assert call["mask"] is None  # no padding: no mask at all ...
        assert call["is_causal"] is (family != "bert")  # ... causal through the flag
        assert call["dropout_p"] == 0.0
    if family == "llama":  # GQA: 2 KV heads reach the kernel, not repeated to 4
        assert all(c["k"][1] == 2 and c["q"][1] == 4 and c["enable_gqa"] for c in rec.calls)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_bfloat16_logits_within_twice_sdpa_error(family, models):
    sdpa, ours = models[family]
    ids = torch.randint(3, VOCAB, (2, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = sdpa(ids).logits  # float32
        err_sdpa = float((copy.deepcopy(sdpa).to(torch.bfloat16)(ids).logits.float() - exact).abs().max())
        err_ours = float((copy.deepcopy(ours).to(torch.bfloat16)(ids).logits.float() - exact).abs().max())
    assert 0 < err_sdpa
    assert err_ours <= 2 * err_sdpa, f"bfloat16 error {err_ours:.3g} vs SDPA's {err_sdpa:.3g}"


# ----------------------------------------------------------------------------------------------
# padding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_padding_and_a_fully_padded_row(family, models, monkeypatch):
    """Row 0 padded (left for the decoders, right for BERT), row 1 all padding, row 2 none:
    no NaN anywhere; row 0's real tokens get the logits of the same tokens run alone."""
    sdpa, ours = models[family]
    rec = Recorder(monkeypatch)
    n, pad = 17, 6
    ids = torch.randint(3, VOCAB, (3, n), generator=torch.Generator().manual_seed(3))
    am = torch.ones(3, n, dtype=torch.long)
    real = slice(pad, n) if family != "bert" else slice(0, n - pad)
    am[0] = 0
    am[0, real] = 1
    am[1] = 0
    ids[0][am[0] == 0] = 0
    ids[1] = 0
    kw = {}
    if family != "bert":  # left padding: positions count real tokens only
        kw["position_ids"] = (am.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = ours(ids, attention_mask=am, **kw).logits
        alone = ours(ids[0:1, real]).logits[0]
        reference = sdpa(ids, attention_mask=am, **kw).logits
    assert torch.isfinite(logits).all()
    assert _max_rel(logits[0, real], alone) <= 1e-5
    assert _max_rel(logits[2], reference[2]) <= 1e-5
    assert _max_rel(logits[0, real], reference[0, real]) <= 1e-5
    padded_calls = rec.calls[: sdpa.config.num_hidden_layers]
    for call in padded_calls:  # a boolean [B, 1, N, M] mask, never expanded over heads
        assert call["mask"] == ((3, 1, n, n), torch.bool)
        assert call["is_causal"] is False


# ----------------------------------------------------------------------------------------------
# generation with a KV cache
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_generate_with_kv_cache_matches_sdpa(family, models, monkeypatch):
    sdpa, ours = models[family]
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, VOCAB, (2, 7), generator=g)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = sdpa.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
        rec = Recorder(monkeypatch)
        got = ours.generate(prompt, attention_mask=torch.ones_like(prompt), **kw)
        calls = list(rec.calls)
        no_cache = ours.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=False, **kw)
    assert torch.equal(got, expected)
    assert torch.equal(no_cache, expected)
    layers = sdpa.config.num_hidden_layers
    prefill, decode = calls[:layers], calls[layers:]
    assert all(c["q"][2] == 7 and c["is_causal"] and c["mask"] is None for c in prefill)
    # decoding: one query against the whole cache, no mask, not causal (every key visible)
    assert len(decode) == layers * (kw["max_new_tokens"] - 1)
    for i, call in enumerate(decode):
        assert call["q"][2] == 1 and call["k"][2] == 8 + i // layers
        assert call["mask"] is None and call["is_causal"] is False


def test_greedy_generate_left_padded_batch_matches_sdpa(models):
    sdpa, ours = models["llama"]
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (3, 9), generator=g)
    am = torch.ones_like(prompt)
    am[0, :4] = 0
    am[2, :1] = 0
    prompt[am == 0] = 0
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = sdpa.generate(prompt, **kw)
        got = ours.generate(prompt, **kw)
        alone = ours.generate(prompt[0:1, 4:], attention_mask=am[0:1, 4:], max_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(got, expected)
    assert torch.equal(got[0, 4:], alone[0])


# ----------------------------------------------------------------------------------------------
# dropout in training
# ----------------------------------------------------------------------------------------------


def test_attention_dropout_in_training(monkeypatch):
    rec = Recorder(monkeypatch)
    sdpa, ours = _twins("llama", attention_dropout=0.25)
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(6))
    ours.train()
    torch.manual_seed(0)
    a = ours(ids, labels=ids)
    torch.manual_seed(1)
    b = ours(ids, labels=ids)
    assert not torch.equal(a.logits, b.logits)  # dropout drew different masks
    a.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    assert {c["dropout_p"] for c in rec.calls} == {0.25}
    ours.eval()
    rec.calls.clear()
    with torch.no_grad():
        assert _max_rel(ours(ids).logits, sdpa(ids).logits) <= 1e-5
    assert {c["dropout_p"] for c in rec.calls} == {0.0}


# ----------------------------------------------------------------------------------------------
# the README example runs
# ----------------------------------------------------------------------------------------------


def test_readme_example_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Use with Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README: no python example under 'Use with Hugging Face transformers'"
    exec(compile(blocks[0], "README-transformers", "exec"), {"__name__": "readme"})

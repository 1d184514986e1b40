"""attnkit.models: the reference causal LM, its data sources, checkpoints and `python -m attnkit train`."""
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

import attnkit.models as M
from attnkit import patterns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = list(M.ATTENTION_KINDS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread.  With two, every small op pays OpenMP's
    hand-off, and on a loaded 2-core machine the spin-waiting threads made this file over 10x
    slower (measured: 408 s against 26 s for both model test files).  Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny(kind, **kw):
    args = dict(vocab_size=8, d_model=32, n_layers=2, n_heads=4, max_len=32, attention=kind)
    args.update(kw)
    return M.CausalLM(**args)


# ----------------------------------------------------------------------------------------------
# the Markov source
# ----------------------------------------------------------------------------------------------


def test_markov_entropies_match_the_samples():
    """entropy(c) = H(X_t | previous c symbols) agrees with the empirical conditional entropy."""
    src = M.MarkovSource(vocab_size=4, order=2, seed=3)
    x = src.sample(64, 600, generator=torch.Generator().manual_seed(0))[:, 50:]  # past the uniform start
    v = src.vocab_size
    for c in range(3):
        ctx = torch.zeros_like(x[:, c:])
        for j in range(c):
            ctx = ctx * v + x[:, j: x.shape[1] - c + j]
        joint = torch.bincount((ctx * v + x[:, c:]).reshape(-1), minlength=v ** (c + 1)).double()
        joint = joint / joint.sum()
        marg = joint.view(-1, v).sum(1)
        h = float(-(joint[joint > 0] * joint[joint > 0].log()).sum() + (marg[marg > 0] * marg[marg > 0].log()).sum())
        assert abs(h - src.entropy(c)) < 0.02, (c, h, src.entropy(c))
    assert src.entropy_rate() == src.entropy(2) < src.entropy(1) < src.entropy(0) < math.log(v)


# ----------------------------------------------------------------------------------------------
# each attention kind computes what the docstring says, causally
# ----------------------------------------------------------------------------------------------


def _dense_reference(attn, x, rotary):
    """The layer's attention in float64 from dense masks (no attnkit op)."""
    b, n, e = x.shape
    h, d = attn.n_heads, attn.head_dim
    q, k, v = attn.qkv(x).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    q, k = M._rotate(q, *rotary), M._rotate(k, *rotary)
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def softmax_attn(q, k, v, scale, mask):
        s = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v

    if attn.kind == "softmax":
        out = softmax_attn(q, k, v, d ** -0.5, causal)
    elif attn.kind == "linear":
        fq, fk = F.elu(q) + 1, F.elu(k) + 1
        w = (fq @ fk.transpose(-1, -2)) * causal
        out = (w @ v) / (w.sum(-1, keepdim=True) + 1e-6)
    elif attn.kind == "hopfield":
        xi = q
        for _ in range(attn.hopfield_steps):
            xi = softmax_attn(xi, k, k, attn.beta, causal)
        out = softmax_attn(xi, k, v, attn.beta, causal)
    else:
        masks = torch.zeros(h, n, n, dtype=torch.bool)
        for p, heads in attn._groups:
            masks[heads] = p.mask(n)
        out = softmax_attn(q, k, v, d ** -0.5, masks)
    return attn.out_proj(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("kind", KINDS)
def test_attention_kind_matches_a_dense_reference(kind):
    torch.manual_seed(0)
    # 3 different patterns over 4 heads (heads 0 and 3 share one): grouping and head order.
    pats = [patterns.strided(3), patterns.fixed(4, summary=2), patterns.star(0, radius=2, causal=True),
            patterns.strided(3)]
    model = _tiny(kind, sparse_patterns=pats, hopfield_steps=2).double()
    attn = model.blocks[0].attn
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    rotary = (model.rope_cos[:23].double(), model.rope_sin[:23].double())
    torch.testing.assert_close(attn(x, rotary), _dense_reference(attn, x, rotary), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_logits_are_causal(positions):
    torch.manual_seed(0)
    model = _tiny(["softmax", "linear", "sparse", "hopfield"], n_layers=4, positions=positions)
    tokens = torch.randint(8, (2, 20))
    changed = tokens.clone()
    changed[:, 11] = (changed[:, 11] + 1) % 8
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=0)
    assert not torch.allclose(a[:, 11:], b[:, 11:])


# ----------------------------------------------------------------------------------------------
# training lowers the loss on an order-2 Markov source, for each attention kind
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_loss_on_an_order2_markov_source(kind):
    """80 steps take the held-out loss from ln V to below the best loss any predictor that
    ignores the previous tokens can reach (entropy(0)): the model uses its context."""
    torch.manual_seed(0)
    src = M.MarkovSource(vocab_size=8, order=2, seed=0)  # entropies (0, 1, 2 symbols): 2.04, 1.78, 1.15
    model = _tiny(kind)
    before = M.evaluate(model, src, batches=2, batch_size=32, seq_len=33)
    losses = M.train(model, src, 80, batch_size=16, seq_len=33, lr=1e-2, progress=False)
    after = M.evaluate(model, src, batches=2, batch_size=32, seq_len=33)
    assert len(losses) == 80 and all(math.isfinite(x) for x in losses)
    assert abs(before - math.log(8)) < 0.1
    assert after < src.entropy(0) - 0.1, f"{kind}: held-out loss {before:.3f} -> {after:.3f}"


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS + ["mixed"])
def test_save_load_gives_identical_logits(kind, tmp_path):
    torch.manual_seed(1)
    if kind == "mixed":  # every kind, learned positions, an own head, a causal block layout
        layout = torch.ones(1, 4, 4, dtype=torch.bool).tril()
        pats = [patterns.block_layout(layout, 8, causal=True), patterns.strided(4),
                patterns.fixed(8, summary=2), patterns.star(0, causal=True)]
        model = _tiny(KINDS, n_layers=4, positions="learned", tie_embeddings=False, sparse_patterns=pats,
                      hopfield_steps=2, hopfield_beta=0.7)
    else:
        model = _tiny(kind)
    src = M.MarkovSource(vocab_size=8, order=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = M.train(model, src, 3, batch_size=4, seq_len=33, optimizer=opt, progress=False)
    path = str(tmp_path / "sub" / "model.pt")
    M.save_checkpoint(path, model, optimizer=opt, step=3, losses=losses, note="hi")
    loaded, info = M.load_checkpoint(path)
    tokens = src.sample(3, 32)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
    assert loaded.config == model.config
    assert info["step"] == 3 and info["losses"] == losses and info["extra"] == {"note": "hi"}
    saved_state = opt.state_dict()["state"]
    loaded_state = info["optimizer"].state_dict()["state"]
    assert all(torch.equal(saved_state[i]["exp_avg"], loaded_state[i]["exp_avg"]) for i in saved_state)


def test_config_is_checked():
    with pytest.raises(ValueError, match="kind"):
        M.ModelConfig(vocab_size=8, attention="flash")
    with pytest.raises(ValueError, match="n_layers"):
        M.ModelConfig(vocab_size=8, n_layers=2, attention=["softmax"])
    with pytest.raises(ValueError, match="causal"):
        M.ModelConfig(vocab_size=8, n_heads=2, d_model=16, sparse_patterns=[patterns.strided(4, causal=False)] * 2)
    with pytest.raises(ValueError, match="one pattern per head"):
        M.ModelConfig(vocab_size=8, n_heads=4, d_model=16, sparse_patterns=[patterns.strided(4)])
    with pytest.raises(ValueError, match="even head dim"):
        M.ModelConfig(vocab_size=8, n_heads=4, d_model=12)
    with pytest.raises(TypeError):
        M.CausalLM(M.ModelConfig(vocab_size=8), d_model=4)
    with pytest.raises(ValueError, match="max_len"):
        _tiny("softmax")(torch.zeros(1, 33, dtype=torch.long))


def test_generate_and_hidden():
    torch.manual_seed(0)
    model = _tiny("softmax", max_len=16)
    prompt = torch.randint(8, (2, 5))
    out = model.generate(prompt, 20)  # past max_len: the last max_len tokens are the context
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, 20))  # greedy is deterministic
    sampled = model.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 11) and int(sampled.max()) < 8
    h = model.hidden(torch.randn(2, 7, 32))
    assert h.shape == (2, 7, 32)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = _tiny(KINDS, n_layers=4, dropout=0.2)
    tokens = torch.randint(8, (2, 16))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens))


# ----------------------------------------------------------------------------------------------
# python -m attnkit train
# ----------------------------------------------------------------------------------------------


def test_train_command_writes_curve_and_checkpoint_and_resumes(tmp_path, capsys):
    from attnkit.__main__ import main

    out = str(tmp_path / "run")
    common = ["--out", out, "--quiet", "--d-model", "32", "--seq-len", "16", "--batch-size", "4"]
    assert main(["train", "--steps", "4", "--attention", "softmax,linear,sparse,hopfield", *common]) == 0
    with open(os.path.join(out, "loss.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "losses.json")) as f:
        record = json.load(f)
    assert len(record["train"]) == 4 and record["entropy_rate"] < record["uniform"]
    model, info = M.load_checkpoint(os.path.join(out, "checkpoint.pt"))
    assert model.config.layer_kinds == KINDS and info["step"] == 4 and info["optimizer"] is not None
    assert main(["train", "--steps", "3", "--resume", os.path.join(out, "checkpoint.pt"), *common]) == 0
    _, info = M.load_checkpoint(os.path.join(out, "checkpoint.pt"))
    assert info["step"] == 7 and len(info["losses"]) == 7
    assert "resumed at step 4" in capsys.readouterr().out


def test_train_command_on_a_text_file(tmp_path, capsys):
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = str(tmp_path / "run")
    assert M.main(["--data", str(text), "--steps", "3", "--out", out, "--quiet", "--d-model", "32",
                   "--seq-len", "16", "--batch-size", "4", "--positions", "learned", "--sample", "12"]) == 0
    printed = capsys.readouterr().out
    assert "sample:" in printed and os.path.exists(os.path.join(out, "checkpoint.pt"))
    model, _ = M.load_checkpoint(os.path.join(out, "checkpoint.pt"))
    assert model.config.vocab_size == 256
    assert M.main(["--data", str(tmp_path / "missing.txt"), "--out", out, "--quiet"]) == 2


def test_readme_example_runs(tmp_path, monkeypatch):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Reference model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "README: no python example under 'Reference model'"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README-models", "exec"), {"__name__": "readme"})

"""attnkit.nn.LinearAttention against an explicit computation: the four projections done by hand,
heads split by hand, and linear attention written as a loop over queries, in float64."""
import pytest
import torch

import attnkit
from attnkit.nn.linear import LinearAttention

F64 = torch.float64
BACKENDS = [b for b in ("reference", "cpu") if attnkit.backends()["linear"][b].usable]
NAME = "attnkit.nn.LinearAttention"


def phi(x, name):
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    return x


def explicit(layer, query, key, value, *, batch_first=True):
    """The layer's output written out: y = W_o concat_h(attn_h) + b_o (float64)."""
    if not batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))

    def proj(lin, x):
        out = x @ lin.weight.T
        return out + lin.bias if lin.bias is not None else out

    q, k, v = proj(layer.q_proj, query), proj(layer.k_proj, key), proj(layer.v_proj, value)
    b, n, e = q.shape
    m, h = k.shape[1], layer.num_heads
    hd = e // h
    heads = []
    for hi in range(h):
        cols = slice(hi * hd, (hi + 1) * hd)
        pq, pk, vh = phi(q[..., cols], layer.feature_map), phi(k[..., cols], layer.feature_map), v[..., cols]
        rows = []
        for i in range(n):
            stop = i + 1 if layer.causal else m
            w = (pq[:, i, None, :] * pk[:, :stop]).sum(-1)  # [B, |S_i|]
            num = (w[..., None] * vh[:, :stop]).sum(1)
            rows.append(num / (w.sum(-1, keepdim=True) + layer.eps) if layer.normalize
                        else num * layer.scale)
        heads.append(torch.stack(rows, dim=1))
    out = proj(layer.out_proj, torch.cat(heads, dim=-1))
    return out if batch_first else out.transpose(0, 1)


def make_layer(e=24, h=3, seed=0, **kw):
    torch.manual_seed(seed)
    layer = LinearAttention(e, h, dtype=F64, **kw)
    with torch.no_grad():  # non-zero biases, so that they are tested
        for p in layer.parameters():
            if p.dim() == 1:
                p.normal_()
    return layer


def x_of(*shape, seed=1, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature_map,causal", [("elu", False), ("elu", True), ("relu", True),
                                                ("identity", False)])
def test_self_attention_matches_explicit(feature_map, causal, backend):
    normalize = feature_map != "identity"
    layer = make_layer(feature_map=feature_map, causal=causal, backend=backend, normalize=normalize,
                       scale=0.05)
    x = x_of(2, 37, 24)
    torch.testing.assert_close(layer(x), explicit(layer, x, x, x), rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_and_gradients_match_explicit(backend):
    layer = make_layer(backend=backend)
    q, kv = x_of(2, 11, 24, seed=2), x_of(2, 70, 24, seed=3)
    v = x_of(2, 70, 24, seed=4)
    out = layer(q, kv, v)
    assert out.shape == (2, 11, 24)
    want = explicit(layer, q, kv, v)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-11)
    g = x_of(2, 11, 24, seed=5)
    params = list(layer.parameters())
    got = torch.autograd.grad(out, params, g)
    exp = torch.autograd.grad(want, params, g)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_sequence_first_layout():
    layer = make_layer(batch_first=False, causal=True)
    x = x_of(29, 2, 24)  # [N, B, E]
    out = layer(x)
    assert out.shape == (29, 2, 24)
    torch.testing.assert_close(out, explicit(layer, x, x, x, batch_first=False), rtol=1e-10, atol=1e-11)


def test_without_bias():
    layer = LinearAttention(16, 4, bias=False, dtype=F64)
    assert all(lin.bias is None for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj))
    assert sum(p.numel() for p in layer.parameters()) == 4 * 16 * 16
    x = x_of(1, 9, 16)
    torch.testing.assert_close(layer(x), explicit(layer, x, x, x), rtol=1e-10, atol=1e-11)


def test_float32_within_tolerance():
    layer = make_layer(causal=True)
    x = x_of(2, 130, 24)
    want = explicit(layer, x, x, x)
    layer32 = make_layer(causal=True).float()
    out = layer32(x.float())
    assert out.dtype == torch.float32
    assert ((out.double() - want).abs().max() / want.abs().max()).item() <= 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_then_step_equals_full_forward(backend):
    layer = make_layer(causal=True, backend=backend)
    x = x_of(2, 50, 24, seed=6)
    full = layer(x)
    head, state = layer(x[:, :40], return_state=True)
    torch.testing.assert_close(head, full[:, :40], rtol=1e-10, atol=1e-11)
    assert state[0].shape == (2, 3, 8, 8) and state[1].shape == (2, 3, 8)
    for t in range(40, 50):
        y_t, state = layer.step(x[:, t], state)
        assert y_t.shape == (2, 24)
        torch.testing.assert_close(y_t, full[:, t], rtol=1e-10, atol=1e-11)
    # from scratch, token by token
    state = None
    for t in range(5):
        y_t, state = layer.step(x[:, t], state)
        torch.testing.assert_close(y_t, full[:, t], rtol=1e-10, atol=1e-11)


def test_initial_state_continues_a_sequence():
    layer = make_layer(causal=True)
    x = x_of(1, 60, 24, seed=7)
    full = layer(x)
    a, state = layer(x[:, :25], return_state=True)
    b = layer(x[:, 25:], initial_state=state)
    torch.testing.assert_close(torch.cat([a, b], dim=1), full, rtol=1e-10, atol=1e-11)


def test_torch_compile_fullgraph():
    layer = make_layer(causal=True).float()
    x = x_of(2, 33, 24, dtype=torch.float32)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


def test_repr_and_attributes():
    layer = LinearAttention(32, 4, feature_map="relu", causal=True)
    assert layer.head_dim == 8
    text = repr(layer)
    assert "embed_dim=32, num_heads=4, feature_map='relu', causal=True" in text
    assert "q_proj" in text and "out_proj" in text


# ------------------------------------------------------------------ validation

def test_constructor_validation():
    with pytest.raises(ValueError, match=f"{NAME}: num_heads must divide embed_dim; got embed_dim=10, num_heads=4"):
        LinearAttention(10, 4)
    with pytest.raises(ValueError, match=f"{NAME}: num_heads must be >= 1; got 0"):
        LinearAttention(8, 0)
    with pytest.raises(TypeError, match=f"{NAME}: embed_dim must be an int; got 8.0"):
        LinearAttention(8.0, 2)
    with pytest.raises(ValueError, match=f"{NAME}: unknown feature_map 'softmax'"):
        LinearAttention(8, 2, feature_map="softmax")
    with pytest.raises(TypeError, match=f"{NAME}: causal must be a bool; got 'yes'"):
        LinearAttention(8, 2, causal="yes")


def test_forward_validation():
    layer = LinearAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="pass both key and value, or neither"):
        layer(x, x)
    with pytest.raises(ValueError, match=r"query must be 3-D \[batch, seq, embed_dim\]; got shape \(5, 8\)"):
        layer(x[0])
    with pytest.raises(ValueError, match=r"key's last dim must be embed_dim=8; got 7"):
        layer(x, x[..., :7], x)
    with pytest.raises(TypeError, match="value must be a torch.Tensor; got list"):
        layer(x, x, x.tolist())
    with pytest.raises(ValueError, match="key and value the length"):
        layer(x, x, x[:, :3])
    with pytest.raises(ValueError, match="initial_state needs causal=True"):
        layer(x, return_state=False, initial_state=(torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 4)))


def test_step_validation():
    with pytest.raises(ValueError, match=r"step\(\) needs a causal layer"):
        LinearAttention(8, 2).step(torch.randn(2, 8))
    layer = LinearAttention(8, 2, causal=True)
    with pytest.raises(ValueError, match=r"x_t must be \[batch, embed_dim=8\]; got shape \(2, 1, 8\)"):
        layer.step(torch.randn(2, 1, 8))
    with pytest.raises(TypeError, match="x_t must be a torch.Tensor"):
        layer.step([1.0] * 8)

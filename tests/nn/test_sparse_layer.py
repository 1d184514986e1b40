"""attnkit.nn.SparseSelfAttention against the same computation written out with the reference."""
import pytest
import torch

import attnkit
from attnkit import patterns
from attnkit.reference.sparse import sparse_attention_reference


def _by_hand(layer, x, pats):
    b, n, e = x.shape
    h, hd = layer.num_heads, layer.head_dim
    x64 = x.double()

    def proj(lin):
        y = torch.nn.functional.linear(x64, lin.weight.double(), lin.bias.double())
        return y.view(b, n, h, hd).transpose(1, 2)

    q, k, v = proj(layer.q_proj), proj(layer.k_proj), proj(layer.v_proj)
    outs = [sparse_attention_reference(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], pats[i]) for i in range(h)]
    out = torch.cat(outs, 1).transpose(1, 2).reshape(b, n, e)
    return torch.nn.functional.linear(out, layer.out_proj.weight.double(), layer.out_proj.bias.double())


@pytest.mark.parametrize("backend", [None, "reference"])
def test_per_head_patterns(backend):
    torch.manual_seed(0)
    pats = [patterns.strided(4), patterns.fixed(5, 2), patterns.strided(4), patterns.star(3, 1)]
    layer = attnkit.nn.SparseSelfAttention(32, 4, pats, backend=backend).double()
    x = torch.randn(2, 37, 32, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    want = _by_hand(layer, x, pats)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    (gw,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, gw, rtol=1e-9, atol=1e-9)


def test_one_pattern_and_sequence_first():
    torch.manual_seed(1)
    p = patterns.strided(8, causal=False)
    layer = attnkit.nn.SparseSelfAttention(16, 2, p, batch_first=False)
    x = torch.randn(50, 3, 16)
    out = layer(x)
    assert out.shape == (50, 3, 16)
    want = _by_hand(layer, x.transpose(0, 1), [p, p]).transpose(0, 1)
    torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)


def test_per_head_block_layout():
    torch.manual_seed(2)
    lay = torch.rand(2, 4, 4) < 0.5
    lay[:, 0, 0] = True
    p = patterns.block_layout(lay, 16)
    layer = attnkit.nn.SparseSelfAttention(8, 2, p).double()
    x = torch.randn(1, 64, 8, dtype=torch.float64)
    heads = [patterns.block_layout(lay[i:i + 1], 16) for i in range(2)]
    torch.testing.assert_close(layer(x), _by_hand(layer, x, heads), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(embed_dim=10, num_heads=3, pattern=patterns.strided(2)), ValueError, "num_heads must divide embed_dim"),
    (dict(embed_dim=8, num_heads=2, pattern=[patterns.strided(2)]), ValueError, "list of num_heads=2 patterns"),
    (dict(embed_dim=8, num_heads=2, pattern="strided"), TypeError, "pattern[0] must be an attnkit.patterns pattern"),
    (dict(embed_dim=8, num_heads=2, pattern=patterns.block_layout(torch.ones(3, 2, 2, dtype=torch.bool), 4)),
     ValueError, "as many layout heads as num_heads"),
])
def test_constructor_errors(kwargs, exc, message):
    with pytest.raises(exc, match=message.replace("[", r"\[").replace("]", r"\]")):
        attnkit.nn.SparseSelfAttention(**kwargs)


def test_forward_errors():
    layer = attnkit.nn.SparseSelfAttention(8, 2, patterns.strided(2))
    with pytest.raises(ValueError, match=r"x must be 3-D \[batch, seq, embed_dim\] with embed_dim=8"):
        layer(torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match="sequence length must match the layout"):
        attnkit.nn.SparseSelfAttention(8, 2, patterns.block_layout(torch.ones(1, 2, 2, dtype=torch.bool), 4))(
            torch.randn(1, 9, 8))

"""Nested and sparse tensors get a clear error from every public function and layer (before
session 32 most reached the kernels and failed there: a NotImplementedError of the dispatcher
or torch's "NestedTensorImpl doesn't support sizes") -- except softmax_attention, which takes
SDPA's jagged nested tensors (tests/ops/test_varlen.py)."""
import warnings

import pytest
import torch

import attnkit
from attnkit import nn as ann
from attnkit.patterns import strided


def _odd_tensors():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided-layout nested tensor's prototype warning
        jagged = torch.nested.nested_tensor([torch.randn(5, 2, 8), torch.randn(3, 2, 8)],
                                            layout=torch.jagged).transpose(1, 2)
        nested_strided = torch.nested.nested_tensor([torch.randn(2, 5, 8), torch.randn(2, 3, 8)])
    return {"jagged": jagged, "nested-strided": nested_strided, "sparse-coo": torch.randn(2, 2, 5, 8).to_sparse()}


def _calls():
    d = torch.randn(2, 2, 5, 8)
    cu = torch.tensor([0, 5, 8])
    return {
        "softmax_attention (all three)": lambda x: attnkit.softmax_attention(x, x, x),
        "softmax_attention (key alone)": lambda x: attnkit.softmax_attention(d, x, d),
        "linear_attention": lambda x: attnkit.linear_attention(x, d, d),
        "linear_attention_step": lambda x: attnkit.linear_attention_step(x, d[:, :, 0], d[:, :, 0]),
        "sparse_attention": lambda x: attnkit.sparse_attention(x, x, x, strided(2)),
        "hopfield_update": lambda x: attnkit.hopfield_update(x, x),
        "hopfield_energy": lambda x: attnkit.hopfield_energy(x, x, beta=1.0),
        "merge_attention_states": lambda x: attnkit.merge_attention_states(x, d[..., 0], d, d[..., 0]),
        "attention_with_kvcache": lambda x: attnkit.attention_with_kvcache(x, torch.zeros(2, 2, 8, 8),
                                                                           torch.zeros(2, 2, 8, 8), cache_seqlens=0),
        "softmax_attention_varlen": lambda x: attnkit.softmax_attention_varlen(x, x, x, cu, cu, 5, 5),
        "linear_attention_varlen": lambda x: attnkit.linear_attention_varlen(x, x, x, cu),
        "nn.MultiheadAttention": lambda x: ann.MultiheadAttention(8, 2)(x, x, x),
        "nn.LinearAttention": lambda x: ann.LinearAttention(8, 2)(x),
        "nn.LinearAttention.step": lambda x: ann.LinearAttention(8, 2, causal=True).step(x),
        "nn.SparseSelfAttention": lambda x: ann.SparseSelfAttention(8, 2, strided(2))(x),
        "nn.Hopfield": lambda x: ann.Hopfield(8)(x),
        "nn.HopfieldPooling": lambda x: ann.HopfieldPooling(8)(x),
        "nn.HopfieldLayer": lambda x: ann.HopfieldLayer(8, 4)(x),
    }


# (softmax_attention with all three jagged: taken, SDPA's layout -- tests/ops/test_varlen.py)
@pytest.mark.parametrize("call, kind", [(call, kind) for call in _calls() for kind in _odd_tensors()
                                        if (call, kind) != ("softmax_attention (all three)", "jagged")])
def test_nested_and_sparse_tensors_are_refused_clearly(call, kind):
    x = _odd_tensors()[kind]
    expected = "nested" if kind != "sparse-coo" else "dense \\(strided\\) tensor"
    with pytest.raises(ValueError, match=expected):
        _calls()[call](x)

"""attnkit.rotary.apply_rotary_emb against a pair-by-pair loop of the rotation's definition."""
import pytest
import torch

from attnkit.rotary import apply_rotary_emb
from attnkit_testing import rotary_reference

F64 = torch.float64


def _randn(shape, seed, dtype=F64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


@pytest.mark.parametrize("rotary_dim", [4, 8])
@pytest.mark.parametrize("interleaved", [False, True])
def test_matches_the_pairwise_rotation(interleaved, rotary_dim):
    x = _randn((2, 5, 3, 8), 1)
    cos, sin = _randn((12, rotary_dim // 2), 2), _randn((12, rotary_dim // 2), 3)
    offsets = torch.tensor([0, 6], dtype=torch.int32)
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    positions = [[int(o) + t for t in range(5)] for o in offsets]
    assert torch.allclose(got, rotary_reference(x, cos, sin, positions, interleaved), rtol=1e-13, atol=1e-13)
    # an int offset: every batch element from it
    same = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3)
    assert torch.allclose(same, rotary_reference(x, cos, sin, [[3 + t for t in range(5)]] * 2, interleaved),
                          rtol=1e-13, atol=1e-13)


def test_packed_sequences_restart_their_positions():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    x = _randn((7, 2, 6), 11)
    cos, sin = _randn((10, 3), 12), _randn((10, 3), 13)
    got = apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=4, seqlen_offsets=torch.tensor([1, 0, 2]))
    want = torch.cat([rotary_reference(x[None, 0:3], cos, sin, [[1, 2, 3]], False)[0],
                      rotary_reference(x[None, 3:7], cos, sin, [[2, 3, 4, 5]], False)[0]])
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-13)


def test_low_precision_rounds_once_and_inplace_writes_x():
    x = _randn((1, 4, 2, 8), 21, torch.bfloat16)
    cos, sin = _randn((4, 4), 22, torch.float32), _randn((4, 4), 23, torch.float32)
    got = apply_rotary_emb(x, cos, sin)
    want = rotary_reference(x.float(), cos, sin, [[0, 1, 2, 3]], False).to(torch.bfloat16)
    assert torch.equal(got, want)
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, inplace=True) is y and torch.equal(y, got)


def test_gradients():
    x = _randn((1, 3, 2, 6), 31).requires_grad_()
    cos, sin = _randn((3, 2), 32).requires_grad_(), _randn((3, 2), 33).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, c, s: apply_rotary_emb(a, c, s, interleaved=True), (x, cos, sin))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(x=torch.zeros(2, 3, 8)), ValueError, r"x must be a 4-D tensor \[B, N, H, D\]"),
    (dict(cos=torch.zeros(4, 5), sin=torch.zeros(4, 5)), ValueError, "rotary_dim"),
    (dict(cos=torch.zeros(4, 2), sin=torch.zeros(5, 2)), ValueError, "one shape"),
    (dict(seqlen_offsets=2), ValueError, "seqlen_ro = 4"),
    (dict(seqlen_offsets=torch.tensor([0.5])), ValueError, "seqlen_offsets"),
    (dict(seqlen_offsets=1.0), TypeError, "seqlen_offsets"),
    (dict(interleaved=1), TypeError, "interleaved"),
])
def test_bad_calls_raise(kwargs, error, match):
    call = dict(x=torch.zeros(1, 3, 2, 8), cos=torch.zeros(4, 2), sin=torch.zeros(4, 2))
    call.update(kwargs)
    with pytest.raises(error, match=match):
        apply_rotary_emb(call.pop("x"), call.pop("cos"), call.pop("sin"), **call)

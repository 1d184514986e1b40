"""tests/triton_interpreter_bf16.py: the interpreter's bfloat16 fixed for the test session."""
import numpy as np
import pytest
import torch

import triton_interpreter_bf16 as fix

pytestmark = pytest.mark.skipif(not fix.installed(), reason="runs where tests/conftest.py installed the fix "
                                "(the Triton interpreter, no GPU)")


def _values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50000, generator=g) * torch.logspace(-40, 38, 50000)  # subnormals to overflow
    ties = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.0039062e-39])  # halfway cases, a subnormal
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-45])
    return torch.cat([x, ties, specials])


def test_float32_to_bfloat16_rounds_to_nearest_even_as_torch():
    x = _values()
    want = x.bfloat16().view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(fix.f32_to_bf16_bits(x.numpy()), want)
    nan = fix.f32_to_bf16_bits(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(fix.bf16_bits_to_f32(nan)).all()


def test_bfloat16_to_float32_is_exact():
    x = _values().bfloat16()
    assert torch.equal(torch.from_numpy(fix.bf16_bits_to_f32(x.view(torch.int16).numpy().view(np.uint16))), x.float())


def test_interpreted_kernel_dots_and_casts_bfloat16():
    import triton
    import triton.language as tl

    @triton.jit
    def dot_and_round(a_ptr, b_ptr, c_ptr, r_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tile = i[:, None] * N + i[None, :]
        c = tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile))
        tl.store(c_ptr + tile, c)
        tl.store(r_ptr + tile, c.to(tl.bfloat16))

    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(2))
    c, r = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    dot_and_round[(1,)](a, b, c, r, N=16)
    want = a.double() @ b.double()
    assert (c.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(r, c.bfloat16())  # rounded to nearest even, as on a GPU


def test_interpreted_comparisons_and_min_max_of_bfloat16():
    # They compared the uint16 bits: NaN != NaN was False (the sparse backward's NaN guard did
    # nothing), and negative values ordered as large integers.
    import triton
    import triton.language as tl

    @triton.jit
    def compare(x_ptr, y_ptr, ne_ptr, lt_ptr, mx_ptr, mn_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x, y = tl.load(x_ptr + i), tl.load(y_ptr + i)
        tl.store(ne_ptr + i, (x != x).to(tl.int32))
        tl.store(lt_ptr + i, (x < y).to(tl.int32))
        tl.store(mx_ptr + i, tl.maximum(x, y))
        tl.store(mn_ptr + i, tl.minimum(x, y))

    x = torch.tensor([1.0, float("nan"), -2.0, -0.5, float("inf"), 3.0, -float("inf"), 0.0]).bfloat16()
    y = torch.tensor([2.0, 1.0, -1.0, -4.0, 1.0, -3.0, 5.0, -0.0]).bfloat16()
    ne, lt = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    mx, mn = torch.empty(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    compare[(1,)](x, y, ne, lt, mx, mn, N=8)
    assert ne.tolist() == torch.isnan(x).int().tolist()
    assert lt.tolist() == (x < y).int().tolist()
    finite = ~torch.isnan(x)
    assert torch.equal(mx[finite], torch.maximum(x, y)[finite]) and torch.equal(mn[finite], torch.minimum(x, y)[finite])

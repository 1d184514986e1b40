"""tests/triton_interpreter_nested_calls.py: the interpreter's helper calls without the repeated
triton.language patching, same results."""
import pytest
import torch

import triton_interpreter_nested_calls as fix

pytestmark = pytest.mark.skipif(not fix.installed(), reason="runs where tests/conftest.py installed the fix "
                                "(the Triton interpreter, no GPU)")

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _scaled_row_sum(x, scale):
    return tl.sum(x, axis=1) * scale  # tl.sum: a triton.language.standard helper (sees tl.core)


@triton.jit
def _rows_kernel(x_ptr, out_ptr, n_rows, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col = tl.arange(0, N)
    keep = row < n_rows
    x = tl.load(x_ptr + row[:, None] * N + col[None, :], mask=keep[:, None], other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)  # standard helper before any other
    for _ in range(tl.cdiv(3, 2)):  # standard helper again: 2 passes
        acc += _scaled_row_sum(x, 0.5)
    tl.store(out_ptr + row, acc, mask=keep)


def _patch_lang_calls(monkeypatch):
    from triton.runtime import interpreter

    calls = []
    original = interpreter._patch_lang

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    return calls


def test_nested_helpers_give_the_same_result_with_one_patch_per_launch_and_module(monkeypatch):
    calls = _patch_lang_calls(monkeypatch)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(0))
    out = torch.empty(37)
    grid = (triton.cdiv(37, 8),)
    _rows_kernel[grid](x, out, 37, N=16, BLOCK=8)
    torch.testing.assert_close(out, x.sum(dim=1), rtol=1e-6, atol=1e-6)
    # The launch patches once; the first standard helper patches tl.core once; the 5 programs'
    # other helper calls (tl.zeros, tl.cdiv, 2 x (_scaled_row_sum, tl.sum) each: 30 in all)
    # find it done.  The interpreter as shipped: 1 + 30 calls.
    assert calls[0] == "_rows_kernel" and len(calls) == 2, calls
    # The launch's patch is undone after it, as the interpreter does.
    assert not fix._LAUNCHES
    assert tl.core.is_builtin(tl.load)


def test_a_failing_helper_still_raises_the_interpreter_error():
    from triton.runtime.interpreter import InterpreterError

    @triton.jit
    def _bad_helper(x):
        return tl.reshape(x, [3])  # 8 elements cannot be 3

    @triton.jit
    def _kernel(x_ptr):
        x = tl.load(x_ptr + tl.arange(0, 8))
        _bad_helper(x)

    with pytest.raises(InterpreterError):
        _kernel[(1,)](torch.zeros(8))
    assert not fix._LAUNCHES

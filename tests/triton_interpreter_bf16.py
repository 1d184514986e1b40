"""bfloat16 in the Triton interpreter, for the tests (DESIGN.md, "known traps").

The interpreter stores bfloat16 tensors as their uint16 bits, and (triton 3.5.1 and 3.9.0):

- its ``create_dot`` hands those bits to ``np.matmul`` as integers: every bfloat16 ``tl.dot``
  came out garbage;
- its float32 -> bfloat16 cast (``x.to(tl.bfloat16)``, a store into a bfloat16 tensor)
  truncates the mantissa instead of rounding to nearest even as a GPU does: P and dS rounded
  toward zero, a bias that put the kernels' bfloat16 outputs past DESIGN.md's tolerance (1.2e-2
  against 1.1e-2 on a window case) where the GPU passes; its explicit round-to-nearest mode
  rounds half up and can carry into the exponent bits.

So the Triton kernels' bfloat16 paths -- the GPU's main dtype -- could only be checked on a GPU.
:func:`install` makes the interpreter's dot widen bfloat16 operands to float32 first (the bits
shifted up by 16: exact) and multiply in float32, as the tensor cores do (bfloat16 x bfloat16
products are exact in float32, sums in float32), and its float32 <-> bfloat16 casts exact bit
operations (round to nearest even; NaN kept NaN).  The accumulation order differs from a GPU's,
as it does for float32 and float16 already.

Installed by tests/conftest.py for the test session only; attnkit itself never patches Triton.
"""
from __future__ import annotations

import numpy as np

_ORIGINAL = None


def _widen(handle, TensorHandle, tl):
    return TensorHandle(bf16_bits_to_f32(handle.data), tl.float32)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 values: exact."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray, round_to_nearest: bool = True) -> np.ndarray:
    """float32 values -> bfloat16 bits (uint16): round to nearest even (or toward zero); a NaN
    stays a (quiet) NaN, infinities and overflow to infinity as in IEEE arithmetic."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if round_to_nearest:
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    else:
        rounded = bits >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x0040), rounded)
    return rounded.astype(np.uint16)


def install() -> bool:
    """Patch the interpreter's dot for bfloat16 operands; False where this Triton has no
    interpreter builder of the expected shape (nothing is patched then)."""
    global _ORIGINAL
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle_type = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle_type is None or not hasattr(builder, "create_dot"):
        return False
    if _ORIGINAL is not None:
        return True
    original = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.get_element_ty() == tl.bfloat16:
            a = _widen(a, handle_type, tl)
        if b.get_element_ty() == tl.bfloat16:
            b = _widen(b, handle_type, tl)
        return original(self, a, b, d, *args, **kwargs)

    original_cast = builder.cast_impl
    original_fp_to_fp = builder.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == tl.float32 and dst_ty == tl.bfloat16:
            return handle_type(f32_to_bf16_bits(src.data), dst_ty)
        if src_ty == tl.bfloat16 and dst_ty == tl.float32:
            return handle_type(bf16_bits_to_f32(src.data), dst_ty)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            to_nearest = rounding_mode is None or "RTNE" in str(rounding_mode)
            return handle_type(f32_to_bf16_bits(src.data, to_nearest), dst_type.scalar)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    # Comparisons and min / max of bfloat16 operands compared their uint16 bits: a NaN was
    # never != itself (the Triton sparse backward's NaN guard `do != do` did nothing in
    # bfloat16, so a poisoned row's NaN spread to the keys it cannot see -- session 32's random
    # fuzzing of test_fuzz_sparse, found as a kernel failure that a GPU would not show), and
    # negative values ordered wrongly.  They widen both operands first (exact); min / max
    # narrow their result back (exact: it is one of the operands).
    for name in [n for n in dir(builder) if n.startswith("create_fcmp")]:
        setattr(builder, name, _widening(getattr(builder, name), handle_type, tl, narrow=False))
    for name in ("create_maximumf", "create_minimumf", "create_maxnumf", "create_minnumf"):
        if hasattr(builder, name):
            setattr(builder, name, _widening(getattr(builder, name), handle_type, tl, narrow=True))
    _ORIGINAL = original
    return True


def _widening(original, handle_type, tl, narrow):
    """``original(self, lhs, rhs)`` on float32 copies of bfloat16 operands."""
    def op(self, lhs, rhs):
        if lhs.get_element_ty() != tl.bfloat16 and rhs.get_element_ty() != tl.bfloat16:
            return original(self, lhs, rhs)
        wide = [_widen(x, handle_type, tl) if x.get_element_ty() == tl.bfloat16 else x for x in (lhs, rhs)]
        result = original(self, *wide)
        if narrow:
            return handle_type(f32_to_bf16_bits(result.data), tl.bfloat16)
        return result
    return op


def installed() -> bool:
    return _ORIGINAL is not None

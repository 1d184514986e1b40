"""``torch.autocast`` for attnkit's softmax attention, as torch's SDPA has it.

Inside ``torch.autocast(device_type, dtype=...)`` torch runs ``scaled_dot_product_attention``
as a lower-precision op: its floating inputs other than float64 are cast to the autocast dtype
first -- float32 q / k / v run in bfloat16 (or float16), and q, k, v of mixed float32 /
bfloat16 dtypes (a projection under autocast next to a float32 tensor) are accepted.
``softmax_attention`` and ``softmax_attention_varlen`` do the same, so that they stay drop-ins
for SDPA in mixed-precision training (before, they computed in float32 there and refused the
mixed dtypes).  Floating masks follow the inputs' dtype already (softmax_attention's rule); the
score options' float32 tensors (``alibi_slopes``, ``sinks``) are not inputs SDPA has and stay
float32.  Outside autocast the check costs one ``torch._C._is_any_autocast_enabled()`` call
(~0.1 us, timeit on the Intel Xeon without AMX).
"""
from __future__ import annotations

import torch

any_enabled = torch._C._is_any_autocast_enabled


def cast_inputs(*tensors):
    """``tensors`` as autocast would give them to SDPA: under autocast for the first one's device
    type, each floating tensor other than float64 in the autocast dtype; otherwise unchanged
    (non-tensors too: the callers' checks report them)."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor):
        return tensors
    device_type = first.device.type
    try:
        if not torch.is_autocast_enabled(device_type):
            return tensors
        dtype = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 and t.dtype != dtype else t for t in tensors)

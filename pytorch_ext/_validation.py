"""Input checks shared by the public functions.

Each raises before any kernel runs, with a message that names the function, what was
expected and what came: TypeError for a wrong kind of thing (not a tensor, not floating
point), ValueError for a wrong value (rank, sizes, ranges, mismatched dtypes or devices).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Rank errors of the families that take exactly [B, H, N, D] (only softmax_attention takes
# SDPA's any leading dims): what to do instead.
RANK_HINT = ("unlike softmax_attention, this op takes no other number of dims: unsqueeze to add "
             "a batch or head dim, reshape to fold extra batch dims into B")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_dense(fn: str, name: str, x: torch.Tensor, layout: str = "") -> None:
    """The tensor ``x`` is dense: neither nested nor of a sparse layout.  (Those reached the
    kernels before and failed there: a NotImplementedError of the dispatcher, or torch's
    "NestedTensorImpl doesn't support sizes".)"""
    if x.is_nested or x.layout is not torch.strided:
        got = f"a nested tensor ({x.layout})" if x.is_nested else f"a tensor of layout {x.layout}"
        raise ValueError(
            f"{fn}: {name} must be a dense (strided) tensor{' ' + layout if layout else ''}; got {got}"
            + (" -- attnkit.softmax_attention takes SDPA's jagged nested tensors; elsewhere pass their "
               "values() and offsets() to the packed-sequence (varlen) functions" if x.is_nested else "")
        )


def check_tensor(fn: str, name: str, x, layout: str, hint: str = "") -> None:
    """``x`` is a floating-point tensor whose rank matches ``layout`` (e.g. "[B, H, N, D]").

    A layout that starts with ``...`` (e.g. "[..., N, D]") takes any number of leading dims:
    the rank must be at least that of the named dims.  ``hint``: appended to a rank error
    (what to do instead)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor {layout}; got {type(x).__name__}")
    check_dense(fn, name, x, layout)
    leading, rank = _parse_layout(layout)
    if (x.dim() < rank) if leading else (x.dim() != rank):
        what = f"a tensor of at least {rank} dims" if leading else f"a {rank}-D tensor"
        raise ValueError(
            f"{fn}: {name} must be {what} {layout}; got {x.dim()}-D with shape "
            f"{tuple(x.shape)}" + (f" ({hint})" if hint else "")
        )
    if x.dtype not in FLOATING:
        raise TypeError(
            f"{fn}: {name} must be floating point (float16, bfloat16, float32 or float64); "
            f"got {_dtype_name(x.dtype)}"
        )


_LAYOUTS: dict[str, tuple[bool, int]] = {}  # the package's few dozen literal layouts, parsed


def _parse_layout(layout: str) -> tuple[bool, int]:
    """(whether ``layout`` starts with ``...``, the number of named dims).  Parsed once per
    layout (the layouts are literals): check_tensor went from 1.06-1.20 to 0.40-0.52 us a call
    (issue 25, timeit, one thread, loaded 2-core AMD EPYC Zen 3); softmax_attention's full
    path checks three tensors a call.  A dict, not functools.lru_cache, which torch.compile
    warns about."""
    parsed = _LAYOUTS.get(layout)
    if parsed is None:
        dims = [part.strip() for part in layout.strip("[]").split(",")]
        leading = dims[0] == "..."
        parsed = _LAYOUTS[layout] = (leading, len(dims) - 1 if leading else len(dims))
    return parsed


def check_same_dtype_device(fn: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """All tensors share the first one's dtype and device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.dtype != first.dtype:
            raise ValueError(
                f"{fn}: {name} must have the dtype of {first_name} ({_dtype_name(first.dtype)}); "
                f"got {_dtype_name(x.dtype)}"
            )
        if x.device != first.device:
            raise ValueError(
                f"{fn}: {name} must be on the device of {first_name} ({first.device}); got {x.device}"
            )


def check_size_match(fn: str, what: str, sizes: Mapping[str, int]) -> None:
    """All named sizes are equal, e.g. what="batch size", sizes={"query": 2, "key": 3}."""
    values = list(sizes.values())
    if any(v != values[0] for v in values[1:]):
        got = ", ".join(f"{name} {value}" for name, value in sizes.items())
        raise ValueError(f"{fn}: {' and '.join(sizes)} must have the same {what}; got {got}")


def check_real(fn: str, name: str, value, *, low=None, low_inclusive=True, high=None,
               allow_none=False) -> None:
    """A finite real number within [low, high] (exclusive low when low_inclusive=False)."""
    if value is None and allow_none:
        return
    # `-inf < value < inf` rather than math.isfinite: under torch.compile a float argument seen
    # with two values becomes symbolic, and math.isfinite cannot trace it (NaN fails both sides).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (-math.inf < value < math.inf):
        raise TypeError(f"{fn}: {name} must be a finite real number; got {value!r}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        bound = f">= {low}" if low_inclusive else f"> {low}"
        raise ValueError(f"{fn}: {name} must be {bound}; got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{fn}: {name} must be <= {high}; got {value!r}")


def check_int(fn: str, name: str, value, *, low=None, high=None) -> None:
    """An integer (not bool) within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int; got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{fn}: {name} must be >= {low}; got {value}")
    if high is not None and value > high:
        raise ValueError(f"{fn}: {name} must be <= {high}; got {value}")


def check_bool(fn: str, name: str, value) -> None:
    """A real bool (not 0/1, not a tensor)."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool; got {value!r}")


def check_choice(fn: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{fn}: unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}")


def check_heads(fn: str, embed_dim, num_heads) -> None:
    """A layer's ``embed_dim`` and ``num_heads``: positive ints, ``num_heads`` dividing ``embed_dim``."""
    check_int(fn, "embed_dim", embed_dim, low=1)
    check_int(fn, "num_heads", num_heads, low=1)
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"{fn}: num_heads must divide embed_dim; got embed_dim={embed_dim}, num_heads={num_heads}"
        )

"""Tensors that sit flush against an inaccessible page, so that an out-of-bounds access by a
Triton kernel run under the interpreter (``TRITON_INTERPRET=1``) faults instead of silently
reading a neighbour's bytes (DESIGN.md, "Out-of-bounds on CPU").

Under the interpreter a kernel's loads and stores go to the real addresses of CPU tensors, and
a masked-off lane is never dereferenced.  So if a tensor's storage ends exactly where a
``PROT_NONE`` page begins, an unmasked access one element past its end is a SIGSEGV; with the
guard page just before a page-aligned start, so is an access one element before it.  The two
modes (``"end"``, ``"start"``) need separate runs: one mapping cannot be flush at both ends for
an arbitrary size.  The guard is 1 MiB of address space (GUARD_BYTES), not just one page.

- :func:`guarded_bytes` -- ``nbytes`` of fresh (zeroed) memory flush against a guard page.
- :func:`guarded_copy` -- a tensor's values, sizes and strides in such memory (its storage is
  exactly the span its elements cover, so the guard is flush against the last / first element).
- :class:`GuardedAllocations` -- a ``TorchFunctionMode``: while active, every *fresh* tensor a
  torch call returns (``torch.empty``, ``empty_like``, ``zeros``, ``full``, ``ones``,
  ``new_empty``, ``.contiguous()``, ``.to()``, ``.clone()``, arithmetic, ...) is moved into
  guarded memory, so a kernel launcher's own outputs and scratch buffers are guarded as well
  as its inputs.  A mode rather than patched names: it sees every allocation, whichever way the
  launcher spells it, without touching the kernel modules.
- :func:`is_guarded` -- whether a tensor's storage is one of ours (so tests can check that the
  mode really caught the launcher's buffers).

Each mapping lives as long as the tensor: ``torch.frombuffer`` keeps a reference to the buffer
(a ``memoryview`` of the ``mmap``), so the pages are unmapped only when the last tensor sharing
the storage dies.  Run anything that may fault in a child process.
"""
from __future__ import annotations

import ctypes
import mmap
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

PAGE = mmap.PAGESIZE
# The inaccessible region: 1 MiB (address space only, no memory), so that an access that
# overshoots by a row, a tile or a head stride still lands in it rather than in a neighbour.
GUARD_BYTES = max(PAGE, 1 << 20)
MODES = ("end", "start")
_PROT_NONE = 0
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

# data_ptr of every live guarded storage -> its mode (weak: entries vanish with the storage).
_GUARDED: dict[int, str] = {}


def guarded_bytes(nbytes: int, where: str = "end") -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` (>= 1) zeroed bytes whose last byte (``where="end"``) is
    followed, or whose first byte (``where="start"``) is preceded, by GUARD_BYTES of PROT_NONE
    pages."""
    if where not in MODES:
        raise ValueError(f"where must be one of {MODES}; got {where!r}")
    if nbytes < 1:
        raise ValueError("guarded_bytes needs at least one byte")
    data_pages = -(-nbytes // PAGE)
    mm = mmap.mmap(-1, data_pages * PAGE + GUARD_BYTES, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    del anchor  # releases its export of the buffer (the address stays valid while mm lives)
    if where == "end":  # [data pages][guard]; the data ends at the guard
        guard, offset = base + data_pages * PAGE, data_pages * PAGE - nbytes
    else:  # [guard][data pages]; the data starts right after it, page-aligned
        guard, offset = base, GUARD_BYTES
    if _libc.mprotect(guard, GUARD_BYTES, _PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect(PROT_NONE) failed")
    view = memoryview(mm)[offset:offset + nbytes]
    buf = torch.frombuffer(view, dtype=torch.uint8)  # holds `view`, which holds `mm`
    ptr = buf.untyped_storage().data_ptr()
    _GUARDED[ptr] = where
    # The storage's last reference to `view` goes when the storage dies: forget the pointer then.
    weakref.finalize(view, _GUARDED.pop, ptr, None)
    return buf


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last element of ``t`` (non-negative strides), inclusive."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def guarded_copy(t: torch.Tensor, where: str = "end") -> torch.Tensor:
    """``t`` (same dtype, sizes, strides and values; not its autograd history) in guarded memory
    covering exactly its elements: flush against the guard at the last element ("end") or the
    first ("start").  Empty tensors are returned as they are (nothing to guard)."""
    if t.numel() == 0 or t.device.type != "cpu":
        return t
    if any(s < 0 for s in t.stride()):
        raise ValueError("guarded_copy: negative strides are not supported")
    raw = guarded_bytes(_span(t) * t.element_size(), where)
    out = torch.empty(0, dtype=t.dtype).set_(raw.untyped_storage(), 0, t.shape, t.stride())
    with torch.no_grad():
        out.copy_(t.detach())
    return out


def is_guarded(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in memory from :func:`guarded_bytes` (views included)."""
    return t.numel() > 0 and t.untyped_storage().data_ptr() in _GUARDED


class GuardedAllocations(TorchFunctionMode):
    """While active, the fresh tensors that torch calls return are moved into guarded memory.

    "Fresh": a CPU tensor whose storage is none of the call's tensor / storage arguments (so
    views, in-place ops and ``set_`` keep aliasing what they alias; a kernel writing into a
    launcher's buffer writes into the very tensor the launcher returns).  Tensors that carry
    autograd history are left alone (a launcher has none; the op layer is not run under this).
    ``count`` is how many tensors were moved -- a test checks it is not 0.
    """

    def __init__(self, where: str = "end"):
        super().__init__()
        if where not in MODES:
            raise ValueError(f"where must be one of {MODES}; got {where!r}")
        self.where = where
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        # Storages of the arguments, taken after the call (set_ / out= have rebound them).
        inputs = tree_leaves((args, kwargs))
        taken = {id(x) for x in inputs}
        storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
        storages |= {x.data_ptr() for x in inputs if isinstance(x, torch.UntypedStorage)}

        def move(x):
            if (not isinstance(x, torch.Tensor) or id(x) in taken or x.device.type != "cpu"
                    or x.numel() == 0 or x.requires_grad or type(x) is not torch.Tensor
                    or x.untyped_storage().data_ptr() in storages or is_guarded(x)):
                return x
            self.count += 1
            return guarded_copy(x, self.where)

        return tree_map(move, result)

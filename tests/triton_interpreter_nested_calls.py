"""The Triton interpreter's device-function calls, made cheaper for the test session.

Under ``TRITON_INTERPRET=1`` (triton 3.9.0) a kernel launch patches ``triton.language`` once
for the launch (``GridExecutor.__call__``: ``_patch_lang``, restored after the grid), and then
*every call of a @triton.jit helper inside the kernel* (``InterpretedFunction.__call__``) runs
``_patch_lang`` again: ``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math`` and
``tl.core`` and a fresh set of the same replacements, for every helper call of every program of
the grid.  The builtins are already replaced by then (``_patch_builtin`` skips non-builtins),
the rest is set again to equivalent functions, and the launch's restore puts the originals
back; so the repeat changes nothing but the time.  It was 45% of an interpreted sparse range
kernel's time (cProfile of tests/kernels/test_triton_bounds.py's sparse cases: 12.7 of 28.0 s
in ``_patch_lang``, 5067 calls for 10 cases; Intel Xeon with AMX, session 24).

:func:`install` skips that repeat where the launch in progress has already patched the
helper's language modules (the ``tl`` / ``tl.core`` objects in its globals): the kernel's own
patch, plus what earlier helper calls of the same launch patched (triton.language.standard's
helpers -- ``tl.zeros``, ``tl.cdiv``, ``tl.sum`` -- see ``tl.core`` as well, which the launch
does not patch: their first call in a launch still runs ``_patch_lang``, as the interpreter
would, and the later ones find it done).  A helper called outside a launch keeps the
interpreter's own behaviour.  Nothing else is changed: the helper still runs its rewritten
body, errors are still wrapped in ``InterpreterError``.  ``installed()`` says whether it took
(False where the interpreter does not have the expected shape: then it runs as shipped).

Installed by tests/conftest.py (and test_triton_bounds.py's child processes) for the test
session only; attnkit itself never patches Triton.
"""
from __future__ import annotations

import inspect

_INSTALLED = False
# Per launch in progress (innermost last): the ids of the language modules patched so far.
_LAUNCHES: list[set] = []
# fn.__globals__ -> (its size when looked at, the language modules in it).  The interpreter
# adds its own globals (``tl`` among them) to a kernel module's on the first rewrite, so a
# changed size means look again.
_MODULES_OF: dict = {}


def _lang_modules(fn, tl) -> frozenset:
    """The ids of the triton.language modules that ``_patch_lang(fn)`` would patch."""
    g = fn.__globals__
    seen = _MODULES_OF.get(id(g))
    if seen is None or seen[0] != len(g):
        seen = (len(g), frozenset(id(v) for v in g.values() if inspect.ismodule(v) and (v is tl or v is tl.core)))
        _MODULES_OF[id(g)] = seen
    return seen[1]


def install() -> bool:
    """Patch the interpreter's launch and device-call paths; False (nothing patched) where this
    Triton's interpreter is not the one this was written against."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "_patch_lang")
    if not all(hasattr(interpreter, name) for name in needed):
        return False
    grid_executor, device_function = interpreter.GridExecutor, interpreter.InterpretedFunction
    error = interpreter.InterpreterError
    try:  # the device call must be exactly "patch, rewrite, call" for the replacement to match
        source = inspect.getsource(device_function.__call__)
    except (OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in source or "self.rewrite()" not in source:
        return False

    launch = grid_executor.__call__

    def launch_call(self, *args, **kwargs):
        _LAUNCHES.append(set(_lang_modules(self.fn, tl)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _LAUNCHES.pop()

    def device_call(self, *args, **kwargs):
        modules = _lang_modules(self.fn, tl)
        if not _LAUNCHES or not modules <= _LAUNCHES[-1]:
            interpreter._patch_lang(self.fn)  # as the interpreter does
            if _LAUNCHES:
                _LAUNCHES[-1].update(modules)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    grid_executor.__call__ = launch_call
    device_function.__call__ = device_call
    _INSTALLED = True
    return True


def installed() -> bool:
    return _INSTALLED
